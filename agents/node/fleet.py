"""A simulated fleet: node inventories built from a YAML description or the openb node CSV.

Card UUIDs are derived from node name and index, so the same fleet file always yields the same inventory.
MIG-capable models can start with a MIG layout, following the real profile placement rules.
"""
from __future__ import annotations

import csv
from pathlib import Path

import yaml

from schemas.events import GpuCard, MigInstance, NodeInventory
from schemas.gpu_models import MIG_COMPUTE_SLICES, MIG_MEMORY_SLICES, mig_profile, model


def card_uuid(node: str, index: int) -> str:
    return f"GPU-{node}-{index}"


def mig_layout(node: str, index: int, model_name: str, profiles: list[str]) -> tuple[MigInstance, ...]:
    """Place the profiles on the card's memory slices following NVIDIA's placement table: each profile only at its
    allowed first slices, no two instances overlapping, at most 7 compute slices in all. The instances keep the order
    given; each takes the lowest allowed start that still lets the rest fit (first-fit whenever first-fit works).
    An impossible layout raises ValueError saying why."""
    m = model(model_name)
    where = f"{node} card {index} ({model_name})"
    if not m.mig_capable:
        raise ValueError(f"MIG layout on {where}: the model has no MIG")
    try:
        wanted = [mig_profile(model_name, name) for name in profiles]
    except KeyError:
        known = ", ".join(p.name for p in m.mig_profiles)
        bad = next(n for n in profiles if n not in known.split(", "))
        raise ValueError(f"MIG layout on {where}: no profile {bad!r} (known: {known})") from None
    for p in wanted:
        if not p.starts:
            known = ", ".join(q.name for q in m.mig_profiles)
            raise ValueError(f"MIG layout on {where}: no profile {p.name!r} (known: {known})")
    compute = sum(p.compute_slices for p in wanted)
    if compute > MIG_COMPUTE_SLICES:
        raise ValueError(f"MIG layout on {where}: {'+'.join(profiles)} needs {compute} compute slices, "
                         f"the card has {MIG_COMPUTE_SLICES}")
    memory = sum(p.memory_slices for p in wanted)
    if memory > MIG_MEMORY_SLICES:
        raise ValueError(f"MIG layout on {where}: {'+'.join(profiles)} needs {memory} memory slices, "
                         f"the card has {MIG_MEMORY_SLICES}")

    def place(i: int, used: int) -> list[int] | None:
        if i == len(wanted):
            return []
        p = wanted[i]
        for start in p.starts:
            bits = ((1 << p.memory_slices) - 1) << start
            if start + p.memory_slices <= MIG_MEMORY_SLICES and not used & bits:
                rest = place(i + 1, used | bits)
                if rest is not None:
                    return [start] + rest
        return None

    starts = place(0, 0)
    if starts is None:
        raise ValueError(f"MIG layout on {where}: {'+'.join(profiles)} has no valid placement "
                         f"(allowed starts: {', '.join(f'{p.name} at {list(p.starts)}' for p in wanted)})")
    return tuple(MigInstance(uuid=f"MIG-{node}-{index}-{n}", profile=p.name, start=start, size=p.memory_slices)
                 for n, (p, start) in enumerate(zip(wanted, starts)))


def make_node(name: str, gpu_model: str, gpus: int, *, cpu_milli: int = 64000, memory_mib: int = 256 * 1024,
              rack: str = "rack-0", datacenter: str = "dc-0", nvlink: bool = True,
              mig: list[str] | None = None, driver: str = "550.54.15", cuda: str = "12.4") -> NodeInventory:
    m = model(gpu_model)
    cards = []
    for i in range(gpus):
        layout = mig_layout(name, i, gpu_model, list(mig)) if mig else ()
        cards.append(GpuCard(
            uuid=card_uuid(name, i), index=i, model=gpu_model, memory_mib=m.memory_mib,
            compute_capability=m.compute_capability, nvlink_domain=f"{name}-nvl" if nvlink and gpus > 1 else None,
            nvlink_peers=tuple(card_uuid(name, j) for j in range(gpus) if j != i) if nvlink and gpus > 1 else (),
            pci_bus=f"0000:{0x17 + i:02x}:00.0", numa_node=0 if i < max(gpus // 2, 1) else 1,
            mig_capable=m.mig_capable, mig_enabled=bool(layout), mig_profiles=tuple(p.name for p in m.mig_profiles),
            mig_layout=layout, driver_version=driver, cuda_version=cuda, firmware_version="sim"))
    return NodeInventory(node=name, rack=rack, datacenter=datacenter, cpu_milli=cpu_milli, memory_mib=memory_mib,
                         gpus=tuple(cards))


def from_yaml(path: str | Path) -> list[NodeInventory]:
    """YAML: `nodes: [{name|prefix, count?, model, gpus, cpu_milli?, memory_mib?, rack?, nodes_per_rack?, datacenter?,
    nvlink?, mig?, driver?, cuda?}]` and optionally `faults: [{at: SECONDS, fault: "ecc:NODE:INDEX"}]` (load_faults).

    One entry with `count: N` gives N nodes named `<prefix>-0..N-1`; with `nodes_per_rack: K` they fill racks
    `<rack>-0`, `<rack>-1`, ... K at a time. Cards of one node are NVLink peers unless `nvlink: false`."""
    doc = yaml.safe_load(Path(path).read_text()) or {}
    out = []
    for spec in doc.get("nodes") or []:
        count = int(spec.get("count", 1))
        per_rack = int(spec.get("nodes_per_rack", 0))
        rack = str(spec.get("rack", "rack-0"))
        for k in range(count):
            name = spec["name"] if count == 1 and "name" in spec else f"{spec.get('prefix', spec.get('name'))}-{k}"
            out.append(make_node(name, spec["model"], int(spec["gpus"]), cpu_milli=int(spec.get("cpu_milli", 64000)),
                                 memory_mib=int(spec.get("memory_mib", 256 * 1024)),
                                 rack=f"{rack}-{k // per_rack}" if per_rack else rack,
                                 datacenter=str(spec.get("datacenter", "dc-0")), nvlink=bool(spec.get("nvlink", True)),
                                 mig=spec.get("mig"), driver=str(spec.get("driver", "550.54.15")),
                                 cuda=str(spec.get("cuda", "12.4"))))
    names = [n.node for n in out]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"fleet {path}: node names used twice: {', '.join(dup)}")
    return out


def from_openb_csv(path: str | Path, limit: int | None = None, nodes_per_rack: int = 16) -> list[NodeInventory]:
    """openb node list (sn, cpu_milli, memory_mib, gpu, model); GPU-less rows are skipped."""
    out = []
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            if int(row["gpu"]) == 0:
                continue
            n = len(out)
            out.append(make_node(row["sn"], row["model"], int(row["gpu"]), cpu_milli=int(row["cpu_milli"]),
                                 memory_mib=int(row["memory_mib"]), rack=f"rack-{n // nodes_per_rack}",
                                 datacenter=f"dc-{n // (nodes_per_rack * 8)}"))
            if limit and len(out) >= limit:
                break
    return out


def load(spec: str) -> list[NodeInventory]:
    """A fleet file (.yaml/.yml/.csv) or `demo:N` for N mixed nodes."""
    if spec.startswith("demo:"):
        return demo_fleet(int(spec.split(":", 1)[1]))
    if spec.endswith(".csv"):
        return from_openb_csv(spec)
    return from_yaml(spec)


def demo_fleet(n: int) -> list[NodeInventory]:
    """A small heterogeneous fleet: A100-80GB, H100, A10 and T4 nodes across two racks."""
    shapes = [("A100-80GB", 4), ("H100-80GB", 4), ("A10", 4), ("T4", 4)]
    return [make_node(f"node-{i:03d}", shapes[i % 4][0], shapes[i % 4][1], rack=f"rack-{i // 2}",
                      datacenter="dc-0") for i in range(n)]


def load_faults(spec: str) -> list[str]:
    """The scenario faults of a fleet YAML (`faults: [{at: 10, fault: "ecc:node-1:0"}]`) as `fault@at` strings, in the
    form SimFleetAgent.inject takes; none for `demo:N` and CSV fleets."""
    if spec.startswith("demo:") or spec.endswith(".csv"):
        return []
    doc = yaml.safe_load(Path(spec).read_text()) or {}
    out = []
    for i, f in enumerate(doc.get("faults") or []):
        if not isinstance(f, dict) or "fault" not in f:
            raise ValueError(f"fleet {spec}: faults[{i}] needs a `fault` (and optionally `at` seconds)")
        at = float(f.get("at", 0))
        if at < 0:
            raise ValueError(f"fleet {spec}: faults[{i}] at {at} is negative")
        out.append(f"{f['fault']}@{at:g}")
    return out
