"""A simulated fleet: node inventories built from a YAML description or the openb node CSV.

Card UUIDs are derived from node name and index, so the same fleet file always yields the same inventory.
MIG-capable models can start with a MIG layout, following the real profile placement rules.
"""
from __future__ import annotations

import csv
from pathlib import Path

import yaml

from schemas.events import GpuCard, MigInstance, NodeInventory
from schemas.gpu_models import MIG_MEMORY_SLICES, mig_profile, model


def card_uuid(node: str, index: int) -> str:
    return f"GPU-{node}-{index}"


def mig_layout(node: str, index: int, model_name: str, profiles: list[str]) -> tuple[MigInstance, ...]:
    """Place profiles first-fit on the memory slices, honouring each profile's allowed starts."""
    used = [False] * MIG_MEMORY_SLICES
    out = []
    for n, name in enumerate(profiles):
        p = mig_profile(model_name, name)
        for start in p.starts:
            if start + p.memory_slices <= MIG_MEMORY_SLICES and not any(used[start:start + p.memory_slices]):
                for s in range(start, start + p.memory_slices):
                    used[s] = True
                out.append(MigInstance(uuid=f"MIG-{node}-{index}-{n}", profile=name, start=start,
                                       size=p.memory_slices))
                break
        else:
            raise ValueError(f"MIG profile {name} does not fit on {node} card {index}")
    return tuple(out)


def make_node(name: str, gpu_model: str, gpus: int, *, cpu_milli: int = 64000, memory_mib: int = 256 * 1024,
              rack: str = "rack-0", datacenter: str = "dc-0", nvlink: bool = True,
              mig: list[str] | None = None, driver: str = "550.54.15", cuda: str = "12.4") -> NodeInventory:
    m = model(gpu_model)
    cards = []
    for i in range(gpus):
        layout = mig_layout(name, i, gpu_model, mig) if mig and m.mig_capable else ()
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
    """YAML: `nodes: [{name|prefix, count?, model, gpus, cpu_milli?, memory_mib?, rack?, datacenter?, mig?}]`."""
    doc = yaml.safe_load(Path(path).read_text())
    out = []
    for spec in doc["nodes"]:
        count = int(spec.get("count", 1))
        for k in range(count):
            name = spec["name"] if count == 1 and "name" in spec else f"{spec.get('prefix', spec.get('name'))}-{k}"
            out.append(make_node(name, spec["model"], int(spec["gpus"]), cpu_milli=int(spec.get("cpu_milli", 64000)),
                                 memory_mib=int(spec.get("memory_mib", 256 * 1024)), rack=spec.get("rack", "rack-0"),
                                 datacenter=spec.get("datacenter", "dc-0"), mig=spec.get("mig")))
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
