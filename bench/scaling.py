"""How the pure scheduler's cost grows with the fleet (#35 item 5): one `bench.placement --mode a` run per fleet size,
each in its own process, and a table of what a decision costs there.

    .venv/bin/python -m bench.scaling [--sizes 1000,5000,20000] [--jobs-per-node 10] [--seed 1] [--json]

For each size N: `python -m bench.placement --mode a --nodes N --jobs 10N --json` (N nodes x 8 GPUs, the same shapes,
tenants and quotas as bench.placement; scenario (a), every request stepped one by one and its outputs read). Each
row says, from that run alone:

- CPU microseconds per request of the timed part (process CPU time / requests submitted) and placements per
  CPU-second;
- the share of the timed CPU time spent in garbage collection (bench.placement measures its pauses);
- p50 / p99 / max wall milliseconds of one request's step;
- the child's peak resident memory (`ru_maxrss` from wait4: the whole process -- the bench's inputs, the scheduler's
  state, the interpreter) and that divided by the nodes;
- the decision digest (what was placed where, in order), so two commits' tables show whether they decided the same.

The last line compares the largest fleet's cost per request with the smallest's (#35 item 1 asks <= 1.2x from 1,000
to 20,000 nodes). CPU times move with the machine's load: compare two commits by alternating runs, or by
bench/instructions.sh. A 20,000-node run takes a few minutes and ~3-4 GiB here.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time


def measure(nodes: int, jobs: int, seed: int) -> dict:
    """One bench.placement run in a child process: its result, and the child's peak RSS read by wait4 on it."""
    cmd = [sys.executable, "-m", "bench.placement", "--mode", "a", "--nodes", str(nodes), "--jobs", str(jobs),
           "--seed", str(seed), "--json"]
    t = time.perf_counter()
    with open(os.devnull, "w") as devnull:
        r_fd, w_fd = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: stdout to the pipe, stderr away
            os.close(r_fd)
            os.dup2(w_fd, 1)
            os.dup2(devnull.fileno(), 2)
            os.execv(sys.executable, cmd)
        os.close(w_fd)
        chunks = []
        with os.fdopen(r_fd) as f:
            for chunk in iter(lambda: f.read(65536), ""):
                chunks.append(chunk)
        _, status, usage = os.wait4(pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"bench.placement --nodes {nodes} failed (exit {os.waitstatus_to_exitcode(status)})")
    line = [ln for ln in "".join(chunks).splitlines() if ln.startswith("{")][-1]
    (r,) = json.loads(line)["results"]
    r["elapsed_s"] = round(time.perf_counter() - t, 1)
    r["peak_rss_kib"] = usage.ru_maxrss  # Linux: KiB
    return r


def row(r: dict) -> dict:
    n, sub = r["nodes"], r["submitted"]
    return {
        "nodes": n, "gpus": r["gpus"], "requests": sub, "placed": r["placed"],
        "us_per_request_cpu": round(1e6 * r["cpu_s"] / sub, 1),
        "placements_per_s_cpu": r["placements_per_s_cpu"],
        "gc_share_pct": round(100 * r["gc_s"] / r["cpu_s"], 1) if r["cpu_s"] else None,
        "step_ms_p50": r["step_ms"].get("p50"), "step_ms_p99": r["step_ms"].get("p99"),
        "step_ms_max": r["step_ms"].get("max"),
        "peak_rss_mib": round(r["peak_rss_kib"] / 1024, 1),
        "peak_rss_per_node_kib": round(r["peak_rss_kib"] / n, 1),
        "digest": r["digest"], "elapsed_s": r["elapsed_s"],
    }


def table(rows: list[dict]) -> str:
    head = ("nodes", "requests", "placed", "us/request (CPU)", "placements/CPU-s", "GC % of CPU",
            "step p50 / p99 / max ms", "peak RSS MiB", "per node KiB", "digest")
    lines = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for x in rows:
        lines.append("| " + " | ".join(str(v) for v in (
            f"{x['nodes']:,}", f"{x['requests']:,}", f"{x['placed']:,}", x["us_per_request_cpu"],
            f"{x['placements_per_s_cpu']:,}", x["gc_share_pct"],
            f"{x['step_ms_p50']} / {x['step_ms_p99']} / {x['step_ms_max']}", x["peak_rss_mib"],
            x["peak_rss_per_node_kib"], x["digest"])) + " |")
    if len(rows) > 1:
        a, b = rows[0], rows[-1]
        lines.append(f"\ncost per request at {b['nodes']:,} nodes / at {a['nodes']:,}: "
                     f"{b['us_per_request_cpu'] / a['us_per_request_cpu']:.2f}x (#35 item 1 asks <= 1.2x); "
                     f"peak RSS per node at {b['nodes']:,}: {b['peak_rss_per_node_kib']} KiB (#35 item 3 asks <= 60 KB)")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1000,5000,20000", help="fleet sizes in nodes, comma-separated")
    ap.add_argument("--jobs-per-node", type=int, default=10)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", action="store_true", help="only the JSON line on stdout")
    args = ap.parse_args(argv)
    say = (lambda *a: print(*a, file=sys.stderr, flush=True)) if args.json else (lambda *a: print(*a, flush=True))
    rows = []
    for n in (int(x) for x in args.sizes.split(",")):
        r = measure(n, n * args.jobs_per_node, args.seed)
        rows.append(row(r))
        say(f"{n:,} nodes: {rows[-1]['us_per_request_cpu']} us/request, peak RSS {rows[-1]['peak_rss_mib']} MiB "
            f"({rows[-1]['elapsed_s']} s)")
    say(table(rows))
    doc = {"bench": "scaling", "rows": rows}
    print(json.dumps(doc) if args.json else "RESULT " + json.dumps(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
