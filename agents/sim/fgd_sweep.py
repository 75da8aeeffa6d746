"""Run the FGD protocol over fleets x workloads x policies, and tabulate the results per fleet.

    python -m agents.sim.fgd_sweep run --fleets F1.csv F2.csv --workloads W1.csv W2.csv \
        --policies gpupool fgd bestfit --seeds 42-51 --out DIR
    python -m agents.sim.fgd_sweep table DIR [--against fgd] [--policies gpupool fgd bestfit]

``run`` writes one JSON file per (fleet, workload, policy) into DIR (fgd_protocol's summary, plus the wall time and
the commit it ran at) and skips those already there, so an interrupted sweep resumes. Names are the file stems, with
openb's own files shortened: openb_node_list_gpu_node -> openb, openb_pod_list_default -> default.
``table`` prints one markdown table per fleet: allocation at 100 % and 130 % arrived per workload and policy, and for
each ``--against`` baseline the paired per-seed difference at 130 % (with its standard error) and at 100 %, and the
seeds won at each.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

import numpy as np

from agents.sim import fgd_protocol as fp


def short_name(path: str) -> str:
    stem = Path(path).stem
    for prefix in ("openb_pod_list_", "openb_node_list_"):
        if stem.startswith(prefix):
            stem = stem[len(prefix):]
    return "openb" if stem == "gpu_node" else stem


def result_path(out: Path, fleet: str, workload: str, policy: str) -> Path:
    return out / f"{fleet}__{workload}__{policy}.json"


def commit() -> str:
    """HEAD, with '+dirty' when tracked files differ from it (so a figure names what produced it)."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True, cwd=Path(__file__).parent).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, check=True, cwd=Path(__file__).parent).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def run_sweep(fleets: Sequence[str], workloads: Sequence[str], policies: Sequence[str], seeds: Sequence[int],
              out: Path, processes: int = 2) -> None:
    out.mkdir(parents=True, exist_ok=True)
    at = commit()
    for fleet in fleets:
        nodes = fp.load_nodes(fleet)
        for workload in workloads:
            pods = fp.load_pods(workload)
            for policy in policies:
                path = result_path(out, short_name(fleet), short_name(workload), policy)
                if path.exists():
                    continue
                started = time.monotonic()
                summary = fp.summarise(fp.run(nodes, pods, policy, seeds, processes=processes), policy)
                summary.update(wall_s=round(time.monotonic() - started, 2), commit=at, fleet=short_name(fleet),
                               workload=short_name(workload), nodes_file=fleet, pods_file=workload)
                tmp = path.with_suffix(".tmp")
                tmp.write_text(json.dumps(summary, sort_keys=True) + "\n")
                tmp.rename(path)
                print(f"{path.name}: {summary['allocation_pct_at_100']:.2f} / {summary['allocation_pct_at_130']:.2f}"
                      f" in {summary['wall_s']} s", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- tables


def load_results(out: Path) -> dict[tuple[str, str, str], dict]:
    got = {}
    for path in sorted(out.glob("*__*__*.json")):
        r = json.loads(path.read_text())
        got[(r["fleet"], r["workload"], r["policy"])] = r
    return got


def paired(ours: dict, base: dict, x: int = 130) -> tuple[float, float, int, int]:
    """Mean per-seed difference at x % arrived, its standard error, seeds won, seeds compared."""
    key = f"allocation_pct_at_{x}"
    a = {s["seed"]: s[key] for s in ours["per_seed"]}
    b = {s["seed"]: s[key] for s in base["per_seed"]}
    seeds = sorted(set(a) & set(b))
    d = np.array([a[s] - b[s] for s in seeds])
    se = float(d.std(ddof=1) / np.sqrt(len(d))) if len(d) > 1 else float("nan")
    return float(d.mean()), se, int((d > 0).sum()), len(d)


def fleet_table(results: dict, fleet: str, workloads: Sequence[str], policies: Sequence[str],
                against: str | Sequence[str]) -> str:
    bases = [against] if isinstance(against, str) else list(against)
    ours_name = policies[0]
    head = ["workload"] + [f"{p} @100 / @130" for p in policies]
    for b in bases:
        head += [f"{ours_name} − {b} @130 (SE)", f"wins vs {b} @130", f"{ours_name} − {b} @100", f"wins vs {b} @100"]
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for w in workloads:
        row = [w]
        for p in policies:
            r = results.get((fleet, w, p))
            row.append(f"{r['allocation_pct_at_100']:.2f} / {r['allocation_pct_at_130']:.2f}" if r else "—")
        ours = results.get((fleet, w, ours_name))
        for b in bases:
            base = results.get((fleet, w, b))
            if ours and base:
                d, se, wins, n = paired(ours, base)
                d100, _, wins100, _ = paired(ours, base, 100)
                row += [f"{d:+.2f} ({se:.2f})", f"{wins}/{n}", f"{d100:+.2f}", f"{wins100}/{n}"]
            else:
                row += ["—"] * 4
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def tables(out: Path, policies: Sequence[str], against: str | Sequence[str]) -> str:
    results = load_results(out)
    fleets = sorted({f for f, _, _ in results})
    order = ("default", "gpushare20", "gpushare40", "gpushare60", "gpushare80", "gpushare100",
             "multigpu20", "multigpu30", "multigpu40", "multigpu50")
    chunks = []
    for fleet in fleets:
        workloads = sorted({w for f, w, _ in results if f == fleet},
                           key=lambda w: (order.index(w) if w in order else len(order), w))
        commits = sorted({r["commit"] for (f, _, p), r in results.items() if f == fleet and p in policies})
        chunks.append(f"### {fleet}  (commit {', '.join(commits)})\n\n"
                      + fleet_table(results, fleet, workloads, policies, against))
    return "\n\n".join(chunks)


# --------------------------------------------------------------------------- CLI


def run_cli(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m agents.sim.fgd_sweep", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--fleets", nargs="+", required=True)
    r.add_argument("--workloads", nargs="+", required=True)
    r.add_argument("--policies", nargs="+", default=["gpupool", "fgd", "bestfit"], choices=fp.ALL_POLICIES)
    r.add_argument("--seeds", default="42-51", type=fp.parse_seeds)
    r.add_argument("--processes", default=2, type=int)
    r.add_argument("--out", required=True)
    t = sub.add_parser("table")
    t.add_argument("out")
    t.add_argument("--policies", nargs="+", default=["gpupool", "fgd", "bestfit"])
    t.add_argument("--against", nargs="+", default=["fgd"], help="baselines for the paired margins and wins")
    try:
        args = p.parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    if args.cmd == "run":
        try:
            run_sweep(args.fleets, args.workloads, args.policies, args.seeds, Path(args.out), args.processes)
        except (OSError, ValueError, KeyError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        return 0
    print(tables(Path(args.out), args.policies, args.against))
    return 0


if __name__ == "__main__":
    raise SystemExit(run_cli(sys.argv[1:]))
