"""The segmented audit (`gpupool audit replay --verify --jobs N`) over 1,000,000 input records: rate and memory.

    nice -n 5 .venv/bin/python -m bench.audit_segments [--records 1000000] [--segment-every 50000] [--jobs 1,2]
                                                        [--dir DIR] [--keep]

1. Builds the history of bench/takeover.py (64 nodes, 3 tenant quotas, a tick a second, a job every 10 s, each
   started and completed as placed) with the scheduler stepping every record as it is built, and writes it as a
   file copy of the log (agents/audit_log.FileLog): the input records with their log times, every output the
   scheduler emitted (the recorded outputs: commands, decisions, ledger, job requests), and a snapshot every
   --segment-every records (the live writer's audit checkpoints: streams/edge/scheduler_snapshot.AUDIT_EVERY). The
   directory is reused when it holds a log of the same size made by this code (--dir; else a temp dir).
2. For each --jobs value, runs the verification in a fresh process
   (`agents.audit_segments.verify_source`, what `python -m agents.audit_segments --log-dir DIR --jobs N` runs): the
   output pre-pass, the segments in N worker
   processes (each reads its own segment from the files in chunks, loads the snapshot at its start, replays, checks
   outputs and the state at its end), the verdict. Wall time, CPU seconds of that process and its children
   (getrusage), peak RSS of the parent and of the largest child.
3. Prints a table and one `RESULT {json}` line (with the commit and the load average).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def generate(directory: Path, records: int, nodes: int, every: int) -> dict:
    from agents.audit_log import FileLogWriter
    from streams.edge import scheduler_snapshot as snapshot
    from bench.takeover import history
    from schemas.envelope import encode
    from schemas.routing import route

    w = FileLogWriter(directory)
    counts = {"outputs": 0, "snapshots": 0}

    def on_record(i, env, log_ms, outs, s):
        w.add_input(encode(env), log_ms)
        for o in outs:
            spec, key = route(o)
            w.add_output(spec.name, zlib.crc32(key) % spec.partitions, encode(o))
        counts["outputs"] += len(outs)
        if (i + 1) % every == 0 and i + 1 < records:
            w.add_snapshot(i + 1, snapshot.dump(s, i + 1, log_ms))
            counts["snapshots"] += 1
            print(f"  {i + 1} records, snapshot written", file=sys.stderr, flush=True)

    _, _, s, cpu_s, jobs, _ = history(records, nodes, 0, on_record=on_record)
    w.close()
    meta = {"records": records, "nodes": nodes, "segment_every": every, "code": snapshot.code_version(),
            "jobs": jobs, "jobs_in_state": len(s.jobs),
            "ended_in_state": len(s.ended), "applied_in_state": len(s.applied), "generate_cpu_s": round(cpu_s, 1), **counts}
    (directory / "bench.json").write_text(json.dumps(meta))
    return meta


def measure(directory: Path, jobs: int) -> dict:
    """One verification in a fresh process; its rusage (self and children) comes back on its last line."""
    cmd = [sys.executable, "-m", "bench.audit_segments", "--child", str(directory), str(jobs)]
    t = time.monotonic()
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    wall = time.monotonic() - t
    sys.stderr.write(done.stderr[-3000:])
    if done.returncode not in (0, 1):
        raise SystemExit(f"verification failed to run: {done.stdout[-2000:]}")
    out = json.loads(done.stdout.strip().splitlines()[-1])
    out["process_wall_s"] = round(wall, 1)
    return out


def _own_peak_mib(usage) -> int:
    """This process's own peak RSS since it started its program: VmHWM (ru_maxrss also counts the image it was forked
    from before exec -- a bench that built the log in-process first would be measured at its own size)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return round(int(line.split()[1]) / 1024)
    except OSError:
        pass
    return round(usage.ru_maxrss / 1024)


def child(directory: Path, jobs: int) -> int:
    from agents import audit_segments
    from agents.audit_log import FileLog

    t = time.monotonic()
    res = audit_segments.verify_source(FileLog(directory), jobs=jobs)
    wall = time.monotonic() - t
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    print("\n".join(res["lines"]), file=sys.stderr)
    print(json.dumps({"ok": res["ok"], "jobs": jobs, "segments": res["segments"], "records": res["input_records"],
                      "outputs_compared": res["outputs_compared"], "states_checked": res["states_checked"],
                      "wall_s": round(wall, 2), "cpu_s": round(me.ru_utime + me.ru_stime + kids.ru_utime
                                                                + kids.ru_stime, 2),
                      "parent_cpu_s": round(me.ru_utime + me.ru_stime, 2),
                      "peak_rss_parent_mib": _own_peak_mib(me),
                      "peak_rss_child_mib": round(kids.ru_maxrss / 1024),
                      "prepass_s": res.get("prepass_s"), "max_chunk": res.get("max_chunk")}))
    return 0 if res["ok"] else 1


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--records", type=int, default=1_000_000)
    ap.add_argument("--nodes", type=int, default=64)
    ap.add_argument("--segment-every", type=int, default=50_000)
    ap.add_argument("--jobs", default="1,2")
    ap.add_argument("--dir", help="where the file copy of the log is (reused when it matches)")
    ap.add_argument("--keep", action="store_true", help="keep the temp dir")
    ap.add_argument("--generate-only", action="store_true")
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(Path(args.child[0]), int(args.child[1]))

    from streams.edge import scheduler_snapshot as snapshot

    directory = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="gpupool-audit-bench-"))
    meta_path = directory / "bench.json"
    meta = json.loads(meta_path.read_text()) if meta_path.exists() else None
    want = {"records": args.records, "nodes": args.nodes, "segment_every": args.segment_every,
            "code": snapshot.code_version()}
    if meta is None or any(meta.get(k) != v for k, v in want.items()):
        shutil.rmtree(directory, ignore_errors=True)
        directory.mkdir(parents=True)
        print(f"building {args.records} input records in {directory} ...", file=sys.stderr, flush=True)
        meta = generate(directory, args.records, args.nodes, args.segment_every)
    print(f"log: {json.dumps(meta)}", file=sys.stderr, flush=True)
    if args.generate_only:
        return 0
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=ROOT).stdout.strip()
    dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                                text=True, cwd=ROOT).stdout.strip())
    runs = []
    for j in (int(x) for x in args.jobs.split(",")):
        load = os.getloadavg()
        r = measure(directory, j)
        r["load_before"] = [round(x, 2) for x in load]
        r["load_after"] = [round(x, 2) for x in os.getloadavg()]
        r["rec_per_wall_s"] = round(r["records"] / r["wall_s"])
        r["rec_per_cpu_s"] = round(r["records"] / r["cpu_s"])
        runs.append(r)
    print(f"{'jobs':>4} {'ok':>3} {'segments':>8} {'wall s':>8} {'CPU s':>8} {'rec/wall-s':>11} {'rec/CPU-s':>10} "
          f"{'RSS parent':>10} {'RSS child':>10} {'load 1m':>8}")
    for r in runs:
        print(f"{r['jobs']:>4} {'yes' if r['ok'] else 'NO':>3} {r['segments']:>8} {r['wall_s']:>8} {r['cpu_s']:>8} "
              f"{r['rec_per_wall_s']:>11,} {r['rec_per_cpu_s']:>10,} {r['peak_rss_parent_mib']:>7} MiB "
              f"{r['peak_rss_child_mib']:>6} MiB {r['load_before'][0]:>8}")
    print("RESULT " + json.dumps({"commit": commit + ("+dirty" if dirty else ""), "log": meta, "runs": runs}))
    if not args.dir and not args.keep:
        shutil.rmtree(directory, ignore_errors=True)
    return 0 if all(r["ok"] for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
