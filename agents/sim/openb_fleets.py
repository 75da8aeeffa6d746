"""Generate fleets of other shapes from openb's node types, for the FGD protocol (agents/sim/fgd_protocol.py).

The FGD paper's experiment runs on one fleet, openb's 1,213 GPU nodes. To see whether a packing policy's margin
holds on other pools, this module draws fleets of named shapes from the same node types, each a pure function of
(shape, seed, GPU count) via ``numpy.random.default_rng(seed)``. A fleet is written as an openb node CSV
(sn, cpu_milli, memory_mib, gpu, model), which ``fgd_protocol --nodes`` reads.

How a fleet is drawn: a shape is a list of groups, each a set of openb node types and a share of the fleet's GPUs.
For each group in order, nodes are drawn i.i.d. from its types with probability proportional to the type's node
count in openb (so a draw is a draw, with replacement, of an openb node of those types), until the group holds its
share of the GPUs (the last group: the rest); the group stops at the first node that reaches it. Some shapes then
transform every node (CPU halved, ...). Shapes (``SHAPES``):

* ``openb-resampled`` -- openb's own mix, drawn again: a control for what redrawing a fleet does by itself.
* ``older-2gpu`` -- mostly 2-GPU nodes of older models: 80 % of the GPUs on openb's 2-GPU nodes of its pre-Ampere
  models (P100, T4), 20 % on its 4- and 8-GPU nodes of those models (T4, V100M16, V100M32), so that multi-GPU
  pods still have hosts. (A10 is Ampere; G2 and G3 are undisclosed models and left out.)
* ``cpu-lean`` -- openb's mix with every node's CPU cut to 3/4 (memory and GPUs kept): about 13 cores per GPU,
  against the 14 the default workload asks per GPU of demand, so CPU binds node by node.
* ``cpu-poor`` -- openb's mix with every node's CPU halved (memory and GPUs kept): about 9 cores per GPU, so the
  pool runs out of CPU well before its GPUs.
* ``8gpu-only`` -- openb's 8-GPU nodes only (G2, G3, V100M16, V100M32).
* ``cpu-rich`` -- openb's mix with every node's CPU and memory doubled: GPUs bind, host resources rarely do.

    python -m agents.sim.openb_fleets --shape cpu-poor --seed 0 --out FILE.csv
    python -m agents.sim.openb_fleets --stats FILE.csv [FILE.csv ...] [--pods PODS.csv]
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from collections import Counter
from dataclasses import dataclass, replace
from typing import Callable, Sequence

import numpy as np

NAME_FORMAT = "fleet-node-{:04d}"


@dataclass(frozen=True, order=True)
class NodeType:
    model: str
    gpus: int
    cpu_milli: int
    memory_mib: int


# openb_node_list_gpu_node.csv (alibaba/clusterdata cluster-trace-gpu-v2023, as in /work/shared/traces/openb):
# every distinct (model, gpu, cpu_milli, memory_mib) with its node count; 1,213 nodes, 6,212 GPUs.
OPENB_TYPES: dict[NodeType, int] = {
    NodeType("A10", 1, 128_000, 1_048_576): 2,
    NodeType("G2", 8, 96_000, 393_216): 549,
    NodeType("G3", 8, 128_000, 786_432): 39,
    NodeType("P100", 1, 8_000, 61_440): 3,
    NodeType("P100", 2, 16_000, 122_880): 107,
    NodeType("P100", 2, 64_000, 262_144): 22,
    NodeType("P100", 2, 8_000, 61_440): 2,
    NodeType("T4", 2, 104_000, 524_288): 387,
    NodeType("T4", 4, 96_000, 393_216): 17,
    NodeType("V100M16", 1, 8_000, 32_768): 19,
    NodeType("V100M16", 4, 32_000, 131_072): 28,
    NodeType("V100M16", 8, 64_000, 262_144): 7,
    NodeType("V100M16", 8, 82_000, 344_064): 1,
    NodeType("V100M32", 4, 48_000, 376_832): 9,
    NodeType("V100M32", 8, 96_000, 786_432): 21,
}
OPENB_GPUS = sum(t.gpus * n for t, n in OPENB_TYPES.items())
OLDER_MODELS = frozenset({"P100", "T4", "V100M16", "V100M32"})  # openb's disclosed pre-Ampere models


@dataclass(frozen=True)
class Group:
    """Node types (a filter on openb's) and the share of the fleet's GPUs they hold (None: the rest)."""
    where: Callable[[NodeType], bool]
    share: float | None = None


@dataclass(frozen=True)
class Shape:
    name: str
    description: str
    groups: tuple[Group, ...]
    cpu_factor: float = 1.0
    memory_factor: float = 1.0

    def transform(self, t: NodeType) -> NodeType:
        return replace(t, cpu_milli=round(t.cpu_milli * self.cpu_factor),
                       memory_mib=round(t.memory_mib * self.memory_factor))


def _any(t: NodeType) -> bool:
    return True


SHAPES: dict[str, Shape] = {s.name: s for s in (
    Shape("openb-resampled", "openb's node mix, drawn again (control)", (Group(_any),)),
    Shape("older-2gpu", "80 % of GPUs on 2-GPU P100/T4 nodes, 20 % on 4-/8-GPU T4/V100 nodes",
          (Group(lambda t: t.gpus == 2 and t.model in OLDER_MODELS, 0.8),
           Group(lambda t: t.gpus >= 4 and t.model in OLDER_MODELS))),
    Shape("cpu-lean", "openb's node mix, every node's CPU cut to 3/4", (Group(_any),), cpu_factor=0.75),
    Shape("cpu-poor", "openb's node mix, every node's CPU halved", (Group(_any),), cpu_factor=0.5),
    Shape("8gpu-only", "openb's 8-GPU nodes only", (Group(lambda t: t.gpus == 8),)),
    Shape("cpu-rich", "openb's node mix, every node's CPU and memory doubled", (Group(_any),),
          cpu_factor=2.0, memory_factor=2.0),
)}


def generate(shape: str, seed: int = 0, gpus: int = OPENB_GPUS, batch: int = 256) -> list[NodeType]:
    """The fleet's nodes in draw order: each group drawn until it holds its share of ``gpus``."""
    try:
        spec = SHAPES[shape]
    except KeyError:
        raise ValueError(f"unknown shape {shape!r} (one of {', '.join(SHAPES)})") from None
    if gpus <= 0:
        raise ValueError("a fleet needs at least one GPU")
    rng = np.random.default_rng(seed)
    nodes: list[NodeType] = []
    held = 0
    for i, group in enumerate(spec.groups):
        types = sorted(t for t in OPENB_TYPES if group.where(t))
        if not types:
            raise ValueError(f"shape {shape}: a group matches no openb node type")
        last = i == len(spec.groups) - 1
        quota = gpus - held if last or group.share is None else round(group.share * gpus)
        counts = np.array([OPENB_TYPES[t] for t in types], dtype=np.float64)
        size = np.array([t.gpus for t in types], dtype=np.int64)
        got = 0
        while got < quota:
            draws = rng.choice(len(types), size=batch, p=counts / counts.sum())
            cum = got + np.cumsum(size[draws])
            reached = np.flatnonzero(cum >= quota)
            take = draws[: reached[0] + 1] if len(reached) else draws
            nodes.extend(spec.transform(types[j]) for j in take)
            got = int(cum[len(take) - 1])
        held += got
    return nodes


# --------------------------------------------------------------------------- files


FIELDS = ("sn", "cpu_milli", "memory_mib", "gpu", "model")


def write_fleet(path: str, nodes: Sequence[NodeType]) -> None:
    with open(path, "w", newline="") as fh:
        w = csv.writer(fh, lineterminator="\n")
        w.writerow(FIELDS)
        for i, t in enumerate(nodes):
            w.writerow((NAME_FORMAT.format(i), t.cpu_milli, t.memory_mib, t.gpus, t.model))


def read_fleet(path: str) -> list[NodeType]:
    """GPU nodes of an openb-style node CSV."""
    with open(path, newline="") as fh:
        return [NodeType((r.get("model") or "").strip(), int(r["gpu"]), int(r["cpu_milli"]), int(r["memory_mib"]))
                for r in csv.DictReader(fh) if int(r["gpu"]) > 0]


def summary(nodes: Sequence[NodeType]) -> dict:
    """What a shape claims: GPUs by node size and model, host CPU and memory per GPU."""
    total = sum(t.gpus for t in nodes)
    by_size: Counter = Counter()
    by_model: Counter = Counter()
    for t in nodes:
        by_size[t.gpus] += t.gpus
        by_model[t.model] += t.gpus
    pct = (lambda c: {str(k): round(100 * v / total, 2) for k, v in sorted(c.items())}) if total else (lambda c: {})
    return {
        "nodes": len(nodes),
        "gpus": total,
        "gpu_pct_by_node_gpus": pct(by_size),
        "gpu_pct_by_model": pct(by_model),
        "cores_per_gpu": round(sum(t.cpu_milli for t in nodes) / 1000 / total, 2) if total else 0.0,
        "memory_gib_per_gpu": round(sum(t.memory_mib for t in nodes) / 1024 / total, 2) if total else 0.0,
    }


def unhostable_demand_pct(nodes: Sequence[NodeType], pods) -> float:
    """Share of the pods' GPU demand that no node of the fleet could host even empty (so no policy places it)."""
    kinds = sorted(set(nodes))
    total = bad = 0
    for p in pods:
        if not p.num_gpu:
            continue
        total += p.gpu_demand
        if not any(t.gpus >= p.num_gpu and t.cpu_milli >= p.cpu_milli and t.memory_mib >= p.memory_mib
                   and (p.models is None or t.model in p.models) for t in kinds):
            bad += p.gpu_demand
    return round(100 * bad / total, 2) if total else 0.0


# --------------------------------------------------------------------------- CLI


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m agents.sim.openb_fleets",
                                description="Draw a fleet of a named shape from openb's node types, or print "
                                            "fleet statistics.")
    p.add_argument("--shape", choices=tuple(SHAPES))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--gpus", type=int, default=OPENB_GPUS, help="GPUs in the fleet (default: openb's 6,212)")
    p.add_argument("--out", help="output node CSV")
    p.add_argument("--stats", nargs="+", metavar="CSV", help="print summary statistics of these node lists")
    p.add_argument("--pods", nargs="*", default=(), metavar="CSV",
                   help="with --stats: also the share of each pod list's GPU demand no node could host")
    return p


def run_cli(argv: list[str]) -> int:
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    try:
        if args.stats:
            from agents.sim.fgd_protocol import load_pods
            pods = {path: load_pods(path) for path in args.pods}
            for path in args.stats:
                nodes = read_fleet(path)
                out = {"file": path, **summary(nodes)}
                if pods:
                    out["unhostable_demand_pct"] = {p: unhostable_demand_pct(nodes, v) for p, v in pods.items()}
                print(json.dumps(out, sort_keys=True))
            return 0
        if not (args.shape and args.out):
            parser.print_usage(sys.stderr)
            print("error: --shape and --out are required (or --stats)", file=sys.stderr)
            return 2
        nodes = generate(args.shape, args.seed, args.gpus)
        write_fleet(args.out, nodes)
    except (OSError, ValueError, KeyError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps({"file": args.out, "shape": args.shape, "seed": args.seed, **summary(nodes)}, sort_keys=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(run_cli(sys.argv[1:]))
