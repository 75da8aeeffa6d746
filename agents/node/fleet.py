"""A simulated fleet: node inventories built from a YAML description or the openb node CSV.

Card UUIDs are derived from node name and index, so the same fleet file always yields the same inventory.
MIG-capable models can start with a MIG layout, following the real profile placement rules.

A fleet is checked as it is read: an unknown card model, a missing or misspelt field, a value of the wrong type is a
ValueError of one line naming the file and the field (`fleet f.yaml: nodes[2].model: unknown card model 'A100'
(known: ...)`), never a node built from a guess.
"""
from __future__ import annotations

import csv
from pathlib import Path

import yaml

from schemas.events import GpuCard, MigInstance, NodeInventory
from schemas.gpu_models import MIG_COMPUTE_SLICES, MIG_MEMORY_SLICES, MODELS, mig_profile, model

FIELDS = {  # a node entry's fields: type, and whether it must be given (names and versions may be written as numbers)
    "name": (str, False), "prefix": (str, False), "count": (int, False), "model": (str, True), "gpus": (int, True),
    "cpu_milli": (int, False), "memory_mib": (int, False), "rack": (str, False), "nodes_per_rack": (int, False),
    "datacenter": (str, False), "nvlink": (bool, False), "mig": (list, False), "driver": (str, False),
    "cuda": (str, False), "labels": (dict, False),
}
AS_TEXT = frozenset({"name", "prefix", "rack", "datacenter", "driver", "cuda"})
MINIMUM = {"count": 1, "gpus": 1, "cpu_milli": 0, "memory_mib": 0, "nodes_per_rack": 0}


def known_model(name: str, where: str) -> str:
    """The card model, if the project knows it (schemas/gpu_models.py); a fleet never invents one."""
    if name not in MODELS:
        raise ValueError(f"{where}: unknown card model {name!r} (known: {', '.join(sorted(MODELS))})")
    return name


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
              mig: list[str] | None = None, driver: str = "550.54.15", cuda: str = "12.4",
              labels: dict[str, str] | None = None) -> NodeInventory:
    m = model(known_model(gpu_model, f"node {name}: model"))
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
                         gpus=tuple(cards), labels={str(k): str(v) for k, v in (labels or {}).items()})


def from_yaml(path: str | Path) -> list[NodeInventory]:
    """YAML: `nodes: [{name|prefix, count?, model, gpus, cpu_milli?, memory_mib?, rack?, nodes_per_rack?, datacenter?,
    nvlink?, mig?, driver?, cuda?, labels?}]` and optionally `faults: [{at: SECONDS, fault: "ecc:NODE:INDEX"}]` (load_faults).

    One entry with `count: N` gives N nodes named `<prefix>-0..N-1`; with `nodes_per_rack: K` they fill racks
    `<rack>-0`, `<rack>-1`, ... K at a time. Cards of one node are NVLink peers unless `nvlink: false`."""
    doc = _document(path)
    out = []
    nodes = doc.get("nodes")
    if nodes is None or not isinstance(nodes, list):
        raise ValueError(f"fleet {path}: nodes: a list of node entries is required")
    for i, spec in enumerate(nodes):
        spec = _entry(path, i, spec)
        count = spec.get("count", 1)
        per_rack = spec.get("nodes_per_rack", 0)
        rack = spec.get("rack", "rack-0")
        for k in range(count):
            name = spec["name"] if count == 1 and "name" in spec else f"{spec.get('prefix', spec.get('name'))}-{k}"
            try:
                out.append(make_node(name, spec["model"], spec["gpus"], cpu_milli=spec.get("cpu_milli", 64000),
                                     memory_mib=spec.get("memory_mib", 256 * 1024),
                                     rack=f"{rack}-{k // per_rack}" if per_rack else rack,
                                     datacenter=spec.get("datacenter", "dc-0"), nvlink=spec.get("nvlink", True),
                                     mig=spec.get("mig"), driver=spec.get("driver", "550.54.15"),
                                     cuda=spec.get("cuda", "12.4"), labels=spec.get("labels")))
            except ValueError as exc:
                raise ValueError(f"fleet {path}: nodes[{i}]: {exc}") from None
    names = [n.node for n in out]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"fleet {path}: node names used twice: {', '.join(dup)}")
    return out


def _document(path: str | Path) -> dict:
    try:
        doc = yaml.safe_load(Path(path).read_text())
    except OSError as exc:
        raise ValueError(f"fleet {path}: cannot read it: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        raise ValueError(f"fleet {path}: not valid YAML: {getattr(exc, 'problem', None) or exc}{at}") from None
    doc = doc or {}
    if not isinstance(doc, dict):
        raise ValueError(f"fleet {path}: a mapping with `nodes` (and optionally `faults`) is required")
    extra = sorted(set(doc) - {"nodes", "faults"})
    if extra:
        raise ValueError(f"fleet {path}: {extra[0]}: unknown field (known: faults, nodes)")
    return doc


def _entry(path: str | Path, i: int, spec) -> dict:
    """One node entry, checked: known fields, each of its type and range, a known card model, a name or prefix."""
    where = f"fleet {path}: nodes[{i}]"
    if not isinstance(spec, dict):
        raise ValueError(f"{where}: a mapping of node fields is required")
    spec = {k: str(v) if k in AS_TEXT and isinstance(v, (int, float)) and not isinstance(v, bool) else v
            for k, v in spec.items()}
    for key, value in spec.items():
        if key not in FIELDS:
            raise ValueError(f"{where}.{key}: unknown field (known: {', '.join(sorted(FIELDS))})")
        kind = FIELDS[key][0]
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise ValueError(f"{where}.{key}: {value!r} is not {'an integer' if kind is int else kind.__name__}")
        if key in MINIMUM and value < MINIMUM[key]:
            raise ValueError(f"{where}.{key}: {value} is below {MINIMUM[key]}")
        if key == "mig" and not all(isinstance(p, str) for p in value):
            raise ValueError(f"{where}.mig: a list of MIG profile names is required")
    for key, (_, required) in FIELDS.items():
        if required and key not in spec:
            raise ValueError(f"{where}.{key}: required")
    if "name" not in spec and "prefix" not in spec:
        raise ValueError(f"{where}.name: required (or `prefix` with `count`)")
    known_model(spec["model"], f"{where}.model")
    return spec


def from_openb_csv(path: str | Path, limit: int | None = None, nodes_per_rack: int = 16) -> list[NodeInventory]:
    """openb node list (sn, cpu_milli, memory_mib, gpu, model); GPU-less rows are skipped."""
    out = []
    try:
        f = open(path, newline="")
    except OSError as exc:
        raise ValueError(f"fleet {path}: cannot read it: {exc.strerror or exc}") from None
    with f:
        for line, row in enumerate(csv.DictReader(f), start=2):
            where = f"fleet {path}: line {line}"
            try:
                gpus = int(row["gpu"])
                if gpus == 0:
                    continue
                cpu, mem = int(row["cpu_milli"]), int(row["memory_mib"])
                name, card = row["sn"], row["model"]
            except KeyError as exc:
                raise ValueError(f"{where}: column {exc.args[0]} missing (want sn, cpu_milli, memory_mib, gpu, "
                                 "model)") from None
            except (TypeError, ValueError):
                raise ValueError(f"{where}: gpu, cpu_milli and memory_mib must be integers") from None
            n = len(out)
            out.append(make_node(name, known_model(card, f"{where}: model"), gpus, cpu_milli=cpu, memory_mib=mem,
                                 rack=f"rack-{n // nodes_per_rack}", datacenter=f"dc-{n // (nodes_per_rack * 8)}"))
            if limit and len(out) >= limit:
                break
    return out


def load(spec: str) -> list[NodeInventory]:
    """A fleet file (.yaml/.yml/.csv), `demo:N` for N mixed nodes, or `default` (what `gpupool up` simulates)."""
    if spec == "default":
        return default_fleet()
    if spec.startswith("demo:"):
        n = spec.split(":", 1)[1]
        if not n.isdigit() or int(n) < 1:
            raise ValueError(f"fleet {spec}: demo:N wants a positive number of nodes")
        return demo_fleet(int(n))
    if spec.endswith(".csv"):
        return from_openb_csv(spec)
    return from_yaml(spec)


def demo_fleet(n: int) -> list[NodeInventory]:
    """A small heterogeneous fleet: A100-80GB, H100, A10 and T4 nodes across two racks."""
    shapes = [("A100-80GB", 4), ("H100-80GB", 4), ("A10", 4), ("T4", 4)]
    return [make_node(f"node-{i:03d}", shapes[i % 4][0], shapes[i % 4][1], rack=f"rack-{i // 2}",
                      datacenter="dc-0") for i in range(n)]


def default_fleet() -> list[NodeInventory]:
    """`gpupool up`'s fleet: demo:4 (A100, H100, A10 and T4 nodes) and a node of two A100s in MIG mode (3g.40gb,
    2g.20gb and two 1g.10gb instances each), so that every kind of isolation a request may ask for exists."""
    return demo_fleet(4) + [make_node("node-004", "A100-80GB", 2, rack="rack-2", datacenter="dc-0",
                                      mig=["3g.40gb", "2g.20gb", "1g.10gb", "1g.10gb"])]


def load_faults(spec: str) -> list[str]:
    """The scenario faults of a fleet YAML (`faults: [{at: 10, fault: "ecc:node-1:0"}]`) as `fault@at` strings, in the
    form SimFleetAgent.inject takes; none for `demo:N` and CSV fleets."""
    if spec == "default" or spec.startswith("demo:") or spec.endswith(".csv"):
        return []
    doc = _document(spec)
    out = []
    for i, f in enumerate(doc.get("faults") or []):
        if not isinstance(f, dict) or "fault" not in f:
            raise ValueError(f"fleet {spec}: faults[{i}] needs a `fault` (and optionally `at` seconds)")
        try:
            at = float(f.get("at", 0))
        except (TypeError, ValueError):
            raise ValueError(f"fleet {spec}: faults[{i}].at: {f.get('at')!r} is not a number of seconds") from None
        if at < 0:
            raise ValueError(f"fleet {spec}: faults[{i}] at {at} is negative")
        out.append(f"{f['fault']}@{at:g}")
    return out
