"""Derive openb workload variants (gpushareP, multigpuP) from the default pod list.

The FGD paper ("Beware of Fragmentation", Weng et al., USENIX ATC'23) evaluates on
variants of openb_pod_list_default.csv that stress GPU sharing or multi-GPU pods.
The artifact ships them as CSV files only (alibaba/clusterdata
cluster-trace-gpu-v2023/csv, mirrored in hkust-adsl/kubernetes-scheduler-simulator
data/csv); its README says they "are sampled from the default one, emphasizing
certain types of workloads", and no generation script is published. The method
below is read off the published files (see docs/evaluation.md, "Generalisation"):

* ``gpushareP`` -- GPU-sharing pods (one GPU, gpu_milli < 1000) make up P % of the
  trace's GPU demand (sum of num_gpu x gpu_milli). CPU-only pods are kept
  unchanged and in order, the number of GPU pods is kept (so the pod count is
  the source's), and GPU pods are re-drawn per class: the class that must grow
  is drawn with replacement, the class that must shrink is a random subsample
  without replacement. Output order as in the artifact: CPU-only block, then the
  sharing block, then the other GPU pods, renamed openb-pod-0000.. in that order.
* ``multigpuP`` -- multi-GPU pods (num_gpu > 1) make up P % of the GPU demand. The
  source is kept unchanged and multi-GPU pods drawn with replacement from the
  source's own multi-GPU pods are appended (the pod count grows, as in the
  artifact's files), named on from the source's count.

Where the artifact's stopping rule is not recoverable, the variant stops at the
first count whose demand share reaches P % (for gpushare: the smallest number of
sharing pods; for multigpu: the first appended pod that reaches it). Every
choice comes from ``numpy.random.default_rng(seed)``: a variant is a pure function
of (source rows, kind, P, seed). gpuspec variants are not generated: their GPU
model constraints come from production data absent from the default trace.

    python -m agents.sim.openb_variants --pods DEFAULT.csv --kind gpushare --pct 60 --seed 0 --out FILE.csv
    python -m agents.sim.openb_variants --stats FILE.csv [FILE.csv ...]
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from typing import Iterable, Sequence

import numpy as np

from agents.sim.packing import PodRequest

KINDS = ("gpushare", "multigpu")
NAME_FORMAT = "openb-pod-{:04d}"

Row = dict[str, str]


# --------------------------------------------------------------------------- rows


def read_rows(path: str) -> tuple[list[str], list[Row]]:
    """Header and rows of a pod list, in file order."""
    with open(path, newline="") as fh:
        reader = csv.DictReader(fh)
        rows = list(reader)
        fields = list(reader.fieldnames or [])
    missing = {"name", "cpu_milli", "memory_mib", "num_gpu", "gpu_milli"} - set(fields)
    if missing:
        raise ValueError(f"{path}: missing columns {sorted(missing)}")
    return fields, rows


def write_rows(path: str, fields: Sequence[str], rows: Iterable[Row]) -> None:
    with open(path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(fields), lineterminator="\n")
        writer.writeheader()
        for r in rows:
            writer.writerow({f: r.get(f, "") for f in fields})


def pod_of(row: Row) -> PodRequest:
    """The simulator's reading of a row (gpu_milli clamped as the protocol says)."""
    return PodRequest.from_trace(int(row["cpu_milli"]), int(row["memory_mib"]), int(row["num_gpu"]),
                                 int(row["gpu_milli"]), row.get("gpu_spec") or "")


def pod_class(row: Row) -> str:
    """'cpu' (no GPU), 'share' (one GPU, < 1000 milli), 'whole' (one whole GPU), 'multi' (> 1 GPU)."""
    pod = pod_of(row)
    if pod.num_gpu == 0:
        return "cpu"
    if pod.num_gpu > 1:
        return "multi"
    return "share" if pod.is_sharing else "whole"


def gpu_demand(row: Row) -> int:
    """GPU demand in milli-GPU: num_gpu x gpu_milli (clamped)."""
    return pod_of(row).gpu_demand


def content_key(row: Row) -> tuple[str, ...]:
    """A row without its name: what 'drawn from the source' compares."""
    return tuple(v for k, v in sorted(row.items()) if k != "name")


def summary(rows: Sequence[Row]) -> dict:
    """Pod counts per class, GPU demand and the two shares that define the variants."""
    n = len(rows)
    counts = {"cpu": 0, "share": 0, "whole": 0, "multi": 0}
    demand = {"share": 0, "whole": 0, "multi": 0}
    for r in rows:
        c = pod_class(r)
        counts[c] += 1
        if c != "cpu":
            demand[c] += gpu_demand(r)
    total = sum(demand.values())
    gpu_pods = n - counts["cpu"]
    return {
        "pods": n,
        "cpu_only": counts["cpu"],
        "gpu_pods": gpu_pods,
        "sharing_pods": counts["share"],
        "whole_gpu_pods": counts["whole"],
        "multi_gpu_pods": counts["multi"],
        "frac_sharing_pods": round(counts["share"] / n, 4) if n else 0.0,
        "frac_multi_gpu_pods": round(counts["multi"] / n, 4) if n else 0.0,
        "gpu_demand_gpus": round(total / 1000, 3),
        "sharing_demand_pct": round(100 * demand["share"] / total, 3) if total else 0.0,
        "multi_gpu_demand_pct": round(100 * demand["multi"] / total, 3) if total else 0.0,
    }


def _renamed(rows: Iterable[Row], start: int = 0) -> list[Row]:
    out = []
    for i, r in enumerate(rows, start):
        new = dict(r)
        new["name"] = NAME_FORMAT.format(i)
        out.append(new)
    return out


# ------------------------------------------------------------------- generators


def _check_pct(pct: float) -> float:
    pct = float(pct)
    if not 0.0 <= pct <= 100.0:
        raise ValueError(f"pct must be in 0..100, got {pct}")
    return pct


def _stream(rng: np.random.Generator, size: int, length: int, grow: bool) -> np.ndarray:
    """Indices 0..size-1, ``length`` long: i.i.d. draws if the class grows, else a
    permutation (a subsample without replacement) followed by i.i.d. draws that are
    only read if the exact count turns out above ``size``."""
    if size == 0:
        return np.zeros(0, dtype=np.int64)
    if grow:
        return rng.integers(0, size, size=length)
    perm = rng.permutation(size)
    if length <= size:
        return perm[:length]
    return np.concatenate([perm, rng.integers(0, size, size=length - size)])


def gpushare_plan(rows: Sequence[Row], pct: float, seed: int) -> tuple[list[Row], list[Row], list[Row], int]:
    """The draws behind ``gpushare_variant``: (CPU-only rows, sharing stream, other-GPU
    stream, n). Both streams are as long as the number of GPU pods; the variant
    takes the first n of the sharing stream and the first (GPU pods - n) of the other."""
    pct = _check_pct(pct)
    cpu = [r for r in rows if pod_class(r) == "cpu"]
    share = [r for r in rows if pod_class(r) == "share"]
    other = [r for r in rows if pod_class(r) in ("whole", "multi")]
    n_gpu = len(share) + len(other)
    if pct > 0 and not share:
        raise ValueError("the source has no GPU-sharing pods to draw from")
    if pct < 100 and not other:
        raise ValueError("the source has no whole-GPU pods to draw from")
    ds = np.array([gpu_demand(r) for r in share], dtype=np.int64)
    dw = np.array([gpu_demand(r) for r in other], dtype=np.int64)

    # Expected count from the class means decides which class grows (drawn with
    # replacement) and which shrinks (subsampled without replacement).
    f = pct / 100.0
    if pct == 0:
        estimate = 0.0
    elif pct == 100:
        estimate = float(n_gpu)
    else:
        ms, mw = ds.mean(), dw.mean()
        estimate = f * n_gpu * mw / ((1 - f) * ms + f * mw)
    rng = np.random.default_rng(seed)
    s_idx = _stream(rng, len(share), n_gpu, grow=estimate > len(share))
    w_idx = _stream(rng, len(other), n_gpu, grow=n_gpu - estimate > len(other))

    # share(n) = S(n) / (S(n) + W(n_gpu - n)) is non-decreasing in n: take the
    # smallest n that reaches pct.
    zeros = np.zeros(n_gpu + 1, dtype=np.int64)
    cs = np.concatenate(([0], np.cumsum(ds[s_idx]))) if len(s_idx) else zeros
    cw = np.concatenate(([0], np.cumsum(dw[w_idx]))) if len(w_idx) else zeros
    n = np.arange(n_gpu + 1)
    s_dem, w_dem = cs[n], cw[n_gpu - n]
    reached = s_dem * 100.0 >= pct * (s_dem + w_dem)
    n_share = 0 if pct == 0 else (int(np.argmax(reached)) if reached.any() else n_gpu)
    return cpu, [share[i] for i in s_idx], [other[i] for i in w_idx], n_share


def gpushare_variant(rows: Sequence[Row], pct: float, seed: int) -> list[Row]:
    """GPU-sharing pods re-weighted to ``pct`` % of the GPU demand; pod count kept."""
    cpu, s_stream, w_stream, n_share = gpushare_plan(rows, pct, seed)
    n_gpu = len(rows) - len(cpu)
    return _renamed(cpu + s_stream[:n_share] + w_stream[: n_gpu - n_share])


def multigpu_variant(rows: Sequence[Row], pct: float, seed: int, batch: int = 1024) -> list[Row]:
    """The source, then multi-GPU pods drawn from it until they are ``pct`` % of the GPU demand."""
    pct = _check_pct(pct)
    multi = [r for r in rows if pod_class(r) == "multi"]
    if not multi:
        raise ValueError("the source has no multi-GPU pods to draw from")
    if pct >= 100:
        raise ValueError("multi-GPU pods cannot reach 100 % of the demand by appending")
    dm = np.array([gpu_demand(r) for r in multi], dtype=np.int64)
    total = sum(gpu_demand(r) for r in rows if pod_class(r) != "cpu")
    multi_total = int(dm.sum())
    if multi_total * 100.0 > pct * total:
        raise ValueError(f"the source's multi-GPU share is already {100 * multi_total / total:.2f} % "
                         f"(> {pct}); this variant only adds multi-GPU pods")
    rng = np.random.default_rng(seed)
    drawn: list[np.ndarray] = []
    added = 0
    while multi_total * 100.0 < pct * total:  # (else already there: append nothing)
        draws = rng.integers(0, len(multi), size=batch)
        cum = added + np.cumsum(dm[draws])
        ok = (multi_total + cum) * 100.0 >= pct * (total + cum)
        if ok.any():
            k = int(np.argmax(ok))
            drawn.append(draws[: k + 1])
            break
        drawn.append(draws)
        added = int(cum[-1])
    idx = np.concatenate(drawn) if drawn else np.zeros(0, dtype=np.int64)
    return _renamed(list(rows)) + _renamed((multi[i] for i in idx), start=len(rows))


def make_variant(rows: Sequence[Row], kind: str, pct: float, seed: int) -> list[Row]:
    if kind == "gpushare":
        return gpushare_variant(rows, pct, seed)
    if kind == "multigpu":
        return multigpu_variant(rows, pct, seed)
    raise ValueError(f"unknown kind {kind!r} (one of {', '.join(KINDS)})")


# --------------------------------------------------------------------------- CLI


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m agents.sim.openb_variants",
                                description="Derive an openb workload variant (gpushareP / multigpuP) "
                                            "from a pod list, or print pod-list statistics.")
    p.add_argument("--pods", help="source pod list (openb_pod_list_default.csv)")
    p.add_argument("--kind", choices=KINDS)
    p.add_argument("--pct", type=float, help="target share of GPU demand, percent")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="output CSV")
    p.add_argument("--stats", nargs="+", metavar="CSV", help="print summary statistics of these pod lists")
    return p


def run_cli(argv: list[str]) -> int:
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    try:
        if args.stats:
            for path in args.stats:
                print(json.dumps({"file": path, **summary(read_rows(path)[1])}, sort_keys=True))
            return 0
        if not (args.pods and args.kind and args.pct is not None and args.out):
            parser.print_usage(sys.stderr)
            print("error: --pods, --kind, --pct and --out are required (or --stats)", file=sys.stderr)
            return 2
        fields, rows = read_rows(args.pods)
        out = make_variant(rows, args.kind, args.pct, args.seed)
        write_rows(args.out, fields, out)
    except (OSError, ValueError, KeyError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps({"file": args.out, "kind": args.kind, "pct": args.pct, "seed": args.seed,
                      **summary(out)}, sort_keys=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(run_cli(sys.argv[1:]))
