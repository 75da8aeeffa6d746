"""Offline replay of the FGD evaluation protocol on the openb trace.

Runs the experiment of "Beware of Fragmentation" (ATC'23) as written down in
FGD-PROTOCOL.md: each seed shuffles the pod list, inflates it to 130 % of the
cluster's GPU capacity, and schedules every pod once (no departures, no
retries) with one packing policy; allocation and fragmentation are recorded
after every attempt and averaged per arrived-% bucket 0..130.

    python -m agents.sim.fgd_protocol --nodes N.csv --pods P.csv --policy fgd --seeds 42-51 --json
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from agents.sim.live_protocol import run_live
from agents.sim.packing import (
    GPU_MILLI,
    POLICY_NAMES,
    ClusterState,
    FragIndex,
    FragTracker,
    PodRequest,
    make_policy,
    schedule,
    typical_pods,
)

PRODUCT = "gpupool"  # the product's row: the live scheduler (agents/sim/live_protocol.py), not a policy of packing.py
DEFAULT_POLICY = PRODUCT
ALL_POLICIES = (*POLICY_NAMES, PRODUCT)
TUNE = 1.3
MAX_X = 130
DRAW_BATCH = 4096


@dataclass(frozen=True)
class NodeTable:
    names: tuple[str, ...]
    cpu_milli: tuple[int, ...]
    memory_mib: tuple[int, ...]
    gpu_count: tuple[int, ...]
    models: tuple[str, ...]

    def state(self) -> ClusterState:
        return ClusterState(self.cpu_milli, self.memory_mib, self.gpu_count, self.models)

    @property
    def gpu_capacity(self) -> int:
        return sum(self.gpu_count) * GPU_MILLI


def load_nodes(path: str) -> NodeTable:
    """GPU nodes only: the protocol leaves CPU-only nodes out of the experiment."""
    rows = []
    with open(path, newline="") as fh:
        for r in csv.DictReader(fh):
            if int(r["gpu"]) > 0:
                rows.append((r["sn"], int(r["cpu_milli"]), int(r["memory_mib"]), int(r["gpu"]),
                             (r.get("model") or "").strip()))
    if not rows:
        raise ValueError(f"{path}: no GPU nodes")
    names, cpu, mem, gpu, model = zip(*rows)
    return NodeTable(names, cpu, mem, gpu, model)


def load_pods(path: str) -> tuple[PodRequest, ...]:
    """Pods sorted by name, as the protocol's generator expects them."""
    rows = []
    with open(path, newline="") as fh:
        for r in csv.DictReader(fh):
            pod = PodRequest.from_trace(int(r["cpu_milli"]), int(r["memory_mib"]), int(r["num_gpu"]),
                                        int(r["gpu_milli"]), r.get("gpu_spec") or "")
            rows.append((r["name"], pod))
    rows.sort(key=lambda x: x[0])
    return tuple(p for _, p in rows)


# ------------------------------------------------------------------ arrival order


def arrival_sequence(pods: Sequence[PodRequest], capacity_milli: int, rng: np.random.Generator,
                     tune: float = TUNE) -> np.ndarray:
    """Indices into the name-sorted ``pods``: a shuffle, then a resampled tail.

    The tail is drawn with replacement until the first draw whose m (not m*k)
    would push the GPU demand past ``tune`` x capacity; that draw is dropped.
    """
    n = len(pods)
    m = np.array([p.gpu_milli if p.num_gpu else 0 for p in pods], dtype=np.int64)
    demand = np.array([p.gpu_demand for p in pods], dtype=np.int64)
    target = tune * capacity_milli
    order = rng.permutation(n)
    total = int(demand.sum())
    tail: list[np.ndarray] = []
    if total + (m.min() if n else 0) > target or not m.any():
        return order  # nothing could be appended (or nothing would ever stop it)
    while True:
        draws = rng.integers(0, n, size=DRAW_BATCH)
        before = total + np.concatenate(([0], np.cumsum(demand[draws])[:-1]))
        over = np.flatnonzero(before + m[draws] > target)
        if len(over):
            tail.append(draws[: over[0]])
            break
        tail.append(draws)
        total += int(demand[draws].sum())
    return np.concatenate([order, *tail])


# ---------------------------------------------------------------------- one seed


@dataclass(frozen=True)
class SeedResult:
    seed: int
    allocation: np.ndarray  # % of capacity allocated, per X in 0..130
    frag_amount: np.ndarray  # fragmentation as % of capacity
    frag_ratio: np.ndarray  # fragmentation as % of free GPU milli
    attempts: int
    failures: int
    over_allocated: bool


def bucket_means(x: np.ndarray, y: np.ndarray, max_x: int = MAX_X) -> np.ndarray:
    """Mean of y per integer x; an empty bucket borrows its two neighbours."""
    keep = (x >= 0) & (x <= max_x + 1)
    cnt = np.bincount(x[keep], minlength=max_x + 2)[: max_x + 2].astype(np.float64)
    tot = np.bincount(x[keep], weights=y[keep], minlength=max_x + 2)[: max_x + 2]
    out = np.full(max_x + 1, np.nan)
    for X in range(max_x + 1):
        if cnt[X]:
            out[X] = tot[X] / cnt[X]
        else:
            lo, hi = max(0, X - 1), X + 2
            c = cnt[lo:hi].sum()
            if c:
                out[X] = tot[lo:hi].sum() / c
    return out


def horizon(pods: Sequence[PodRequest], seq: np.ndarray, capacity_milli: int, max_x: int = MAX_X) -> int:
    """How many arrivals of ``seq`` can reach a bucket: those up to the last one whose arrived % rounds to at most
    max_x + 1 (``bucket_means`` reads no further). On a fleet smaller than the pod list's demand the shuffled list
    runs far past 130 %; the attempts after that point change no reported number, so they are not made."""
    demand = np.array([p.gpu_demand for p in pods], dtype=np.int64)
    x = np.rint(np.cumsum(demand[seq]) / (capacity_milli / 100.0))
    return int(np.searchsorted(x, max_x + 1, side="right"))


def run_seed(nodes: NodeTable, pods: Sequence[PodRequest], policy_name: str, seed: int,
             typical=None, whole: bool = False, scheduler=None) -> SeedResult:
    """Replay one seed; the seed drives the order, node priorities and random choices. ``whole``: attempt every
    arrival, also those past the last bucket (same results, slower; for tests). The product row (``gpupool``) is the
    live scheduler (``run_live``; ``scheduler``: the `Scheduler` to feed, a fresh one by default); the anchors are the
    simulator's policies (agents/sim/packing.py)."""
    rng = np.random.default_rng(seed)
    capacity = nodes.gpu_capacity
    seq = arrival_sequence(pods, capacity, rng)
    if not whole:
        seq = seq[: horizon(pods, seq, capacity)]
    priority = rng.permutation(len(nodes.names)).astype(np.int64)
    typical = typical_pods(pods) if typical is None else typical
    n = len(seq)
    arrived = np.empty(n, dtype=np.int64)
    used = np.empty(n, dtype=np.int64)
    frag = np.empty(n, dtype=np.float64)
    free = np.empty(n, dtype=np.int64)
    tally = {"i": 0, "arrived": 0, "used": 0, "failures": 0}

    def record(pod: PodRequest, node: int | None) -> None:
        i = tally["i"]
        tally["arrived"] += pod.gpu_demand
        if node is None:
            tally["failures"] += 1
        else:
            tally["used"] += pod.gpu_demand
            metric.refresh(node)
        arrived[i], used[i], frag[i] = tally["arrived"], tally["used"], metric.total_milli
        free[i] = capacity - tally["used"]
        tally["i"] = i + 1

    if policy_name == PRODUCT:
        # the product row: the live scheduler, fed the trace's events (agents/sim/live_protocol.py)
        state = nodes.state()
        metric = FragTracker(FragIndex(typical, state.model_names, state.gpu_width), state)
        live = run_live(nodes, pods, seq, record, scheduler=scheduler, state=state)
        state = live.state
    else:
        state = nodes.state()
        policy = make_policy(policy_name, typical, pods)
        policy.bind(state)
        metric = FragTracker(FragIndex(typical, state.model_names, state.gpu_width), state)
        for pi in seq:
            pod = pods[pi]
            placement = schedule(state, pod, policy, priority, rng)
            record(pod, None if placement is None else placement.node)
    if tally["i"] != n:
        raise RuntimeError(f"{tally['i']} of {n} arrivals were decided")
    failures = tally["failures"]

    unit = capacity / 100.0
    x = np.rint(arrived / unit).astype(np.int64)
    ratio = np.where(free > 0, 100.0 * frag / np.maximum(free, 1), 0.0)
    return SeedResult(
        seed=seed,
        allocation=bucket_means(x, used / unit),
        frag_amount=bucket_means(x, frag / unit),
        frag_ratio=bucket_means(x, ratio),
        attempts=n,
        failures=failures,
        over_allocated=bool((state.gpu_free < 0).any()),
    )


# ------------------------------------------------------------------- many seeds


def _run_seed_job(args) -> SeedResult:
    return run_seed(*args)


def run(nodes: NodeTable, pods: Sequence[PodRequest], policy_name: str, seeds: Sequence[int],
        processes: int = 2, progress=None) -> list[SeedResult]:
    """All seeds, in seed order; ``processes`` > 1 spreads seeds over workers."""
    typical = typical_pods(pods)
    jobs = [(nodes, pods, policy_name, s, typical) for s in seeds]
    results: list[SeedResult] = []
    if processes > 1 and len(jobs) > 1:
        with ProcessPoolExecutor(max_workers=min(processes, len(jobs))) as pool:
            for res in pool.map(_run_seed_job, jobs):
                results.append(res)
                if progress:
                    progress(res)
    else:
        for job in jobs:
            res = _run_seed_job(job)
            results.append(res)
            if progress:
                progress(res)
    return results


def summarise(results: Sequence[SeedResult], policy_name: str) -> dict:
    alloc = np.array([r.allocation for r in results])
    ratio = np.array([r.frag_ratio for r in results])
    amount = np.array([r.frag_amount for r in results])

    def at(a: np.ndarray, x: int) -> float:
        return round(float(np.nanmean(a[:, x])), 4)

    return {
        "policy": policy_name,
        "seeds": [r.seed for r in results],
        "allocation_pct_at_90": at(alloc, 90),
        "allocation_pct_at_100": at(alloc, 100),
        "allocation_pct_at_130": at(alloc, 130),
        "frag_ratio_at_90": at(ratio, 90),
        "frag_ratio_at_100": at(ratio, 100),
        "frag_ratio_at_130": at(ratio, 130),
        "frag_amount_at_100": at(amount, 100),
        "frag_amount_at_130": at(amount, 130),
        "per_seed": [
            {
                "seed": r.seed,
                "allocation_pct_at_100": round(float(r.allocation[100]), 4),
                "allocation_pct_at_130": round(float(r.allocation[130]), 4),
                "frag_ratio_at_100": round(float(r.frag_ratio[100]), 4),
                "attempts": r.attempts,
                "failures": r.failures,
            }
            for r in results
        ],
        "over_allocated": any(r.over_allocated for r in results),
    }


# --------------------------------------------------------------------------- CLI


def parse_seeds(text: str) -> list[int]:
    """'42-51' or '42,43,50' (or a mix)."""
    seeds: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        if "-" in part[1:]:
            lo, hi = part.split("-", 1) if part[0] != "-" else (part, part)
            a, b = int(lo), int(hi)
            if b < a:
                raise argparse.ArgumentTypeError(f"empty seed range {part!r}")
            seeds.extend(range(a, b + 1))
        else:
            seeds.append(int(part))
    if not seeds:
        raise argparse.ArgumentTypeError("no seeds")
    return seeds


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gpupool simulate --protocol fgd",
                                description="Replay the FGD evaluation protocol on an openb-style trace.")
    p.add_argument("--nodes", required=True, help="node list CSV (sn,cpu_milli,memory_mib,gpu,model)")
    p.add_argument("--pods", required=True, help="pod list CSV (name,cpu_milli,memory_mib,num_gpu,gpu_milli[,gpu_spec])")
    p.add_argument("--policy", default=DEFAULT_POLICY, choices=ALL_POLICIES)
    p.add_argument("--seeds", default="42-51", type=parse_seeds, help="e.g. 42-51 or 42,44")
    p.add_argument("--processes", default=2, type=int, help="worker processes (one seed each)")
    p.add_argument("--json", action="store_true", help="end stdout with one JSON object")
    return p


def _table(summary: dict) -> str:
    lines = [f"policy {summary['policy']}, seeds {summary['seeds'][0]}..{summary['seeds'][-1]}",
             f"{'seed':>6} {'alloc@100':>10} {'alloc@130':>10} {'fragratio@100':>14} {'failed':>7}"]
    for r in summary["per_seed"]:
        lines.append(f"{r['seed']:>6} {r['allocation_pct_at_100']:>10.2f} {r['allocation_pct_at_130']:>10.2f}"
                     f" {r['frag_ratio_at_100']:>14.2f} {r['failures']:>7}")
    lines.append(f"{'mean':>6} {summary['allocation_pct_at_100']:>10.2f} {summary['allocation_pct_at_130']:>10.2f}"
                 f" {summary['frag_ratio_at_100']:>14.2f}")
    lines.append(f"frag ratio at 90/100/130: {summary['frag_ratio_at_90']:.2f} / "
                 f"{summary['frag_ratio_at_100']:.2f} / {summary['frag_ratio_at_130']:.2f}")
    return "\n".join(lines)


def run_cli(argv: list[str]) -> int:
    try:
        args = _parser().parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    try:
        nodes = load_nodes(args.nodes)
        pods = load_pods(args.pods)
    except (OSError, ValueError, KeyError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    started = time.monotonic()
    print(f"{len(nodes.names)} nodes, {nodes.gpu_capacity // GPU_MILLI} GPUs, {len(pods)} pods; "
          f"policy {args.policy}; seeds {args.seeds}", file=sys.stderr)

    from contextlib import nullcontext

    from infra.progress import Bar, interactive

    bar, done = Bar(f"policy {args.policy}: seeds") if interactive() else None, []

    def progress(res: SeedResult) -> None:
        done.append(res)
        if bar is not None:
            bar.update(len(done), len(args.seeds))
        else:
            print(f"  seed {res.seed}: allocation {res.allocation[100]:.2f}% @100, {res.allocation[130]:.2f}% @130 "
                  f"({res.attempts} attempts, {time.monotonic() - started:.1f}s)", file=sys.stderr)

    with bar or nullcontext():
        results = run(nodes, pods, args.policy, args.seeds, processes=args.processes, progress=progress)
    summary = summarise(results, args.policy)
    summary["wall_s"] = round(time.monotonic() - started, 2)
    print(f"done in {summary['wall_s']}s", file=sys.stderr)
    if args.json:
        print(json.dumps(summary, sort_keys=True))
    else:
        print(_table(summary))
    return 1 if summary["over_allocated"] else 0


if __name__ == "__main__":
    raise SystemExit(run_cli(sys.argv[1:]))
