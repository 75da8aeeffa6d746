"""Job request in -> placement command out, on an idle live stack (issue #16: p99 < 50 ms).

    .venv/bin/python -m bench.request_latency [--requests 200] [--gap 0.25] [--nodes 4] [--sink]

1. Starts what the tests start (agents.stack.Stack): a fresh local SASL broker with the topics and principals, one
   worker through the project's CLI (`agents.cli worker`: gateway, folds, scheduler; `--no-sink` unless --sink), a
   simulated fleet (`agents.cli agent --simulate demo:N`), a quota for tenant `bench` and a tenant principal
   `bench-client` (as `gpupool user add` makes it).
2. A consumer of `gpupool.commands` as the service principal (the service reads every internal topic; tenants may
   not read commands), positioned at the end. Warm-up: `--warmup` requests (default 50, ~15 s) sent and waited for
   like the others and reported apart (`warmup_wall_ms`): on a stack just started the first few dozen run two to
   three times slower (the broker's JIT and every process's first use of its code paths), which is the start-up of a
   stack, not an idle live one (docs/performance.md shows both).
3. N requests, one at a time, as `bench-client` into its inbox `gpupool.in.bench-client` (a producer with acks=all,
   linger 0): each waits for its `cmd.place`, then `--gap` seconds pass before the next, so the stack is idle when a
   request arrives (each job runs 1 s and completes; between requests only those completions and the fleet's
   telemetry move). Measured per request, in this process's monotonic clock: from just before `send` to the moment
   the consumer hands over the `cmd.place` naming the job; and in log time: the command's append time minus the
   request's (the broker's clock at both ends: no client in it), and the same for each hop on the way (the
   gateway's copy on the scheduler's input topic, then the scheduler's command; the gateway writes the request to
   `gpupool.job-requests` for the folds too, just before).
4. Prints p50/p90/p99/max of both, the commit, the load average, the worker's CPU seconds over the run, and one JSON
   line (prefix `RESULT `).
Everything started here is stopped on exit, also on error or Ctrl-C.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from agents.stack import Stack
from bench.procs import cpu_seconds, exit_on_signal
from infra.security import SERVICE
from schemas.envelope import decode, encode, envelope
from schemas.events import JobRequested, QuotaSet
from schemas.topics import COMMANDS, SCHEDULER_INPUT, inbox

ROOT = Path(__file__).resolve().parent.parent
TENANT = "bench"
CLIENT = "bench-client"


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q / 100 * len(s) + 0.5) - 1))]  # nearest rank


def summary(xs: list[float]) -> dict:
    return {"n": len(xs), "p50": round(pct(xs, 50), 2), "p90": round(pct(xs, 90), 2), "p99": round(pct(xs, 99), 2),
            "max": round(max(xs), 2), "mean": round(sum(xs) / len(xs), 2)}


async def measure(stack: Stack, n: int, warmup: int, gap: float, timeout: float) -> dict:
    service = stack.conn(SERVICE)
    consumer = AIOKafkaConsumer(**service.options(), group_id=None, enable_auto_commit=False,
                                fetch_max_wait_ms=500)
    await consumer.start()
    producer = AIOKafkaProducer(**stack.conn(CLIENT).options(), acks="all", linger_ms=0)
    await producer.start()
    seen: dict[str, tuple[float, int]] = {}  # job id -> (monotonic time handed over, command's append time)
    hops: dict[str, dict[str, int]] = {}  # job id -> topic -> append time of the request there (the hops between)
    arrived = asyncio.Event()

    async def follow():
        while True:
            batches = await consumer.getmany(timeout_ms=1000)
            now = time.monotonic()
            for tp, msgs in batches.items():
                for m in msgs:
                    env = decode(m.value)
                    if env.kind == "cmd.place" and env.payload.job_id not in seen:
                        seen[env.payload.job_id] = (now, m.timestamp)
                        arrived.set()
                    elif env.kind == "job.requested":
                        hops.setdefault(env.payload.job_id, {}).setdefault(tp.topic, m.timestamp)

    try:
        # the commands, and on the way the request's hop: the gateway's copy on the scheduler's input, read in the
        # same consumer (log times only: which fetch sees them first is moot)
        tps = [TopicPartition(spec.name, p) for spec in (COMMANDS, SCHEDULER_INPUT)
               for p in range(spec.partitions)]
        consumer.assign(tps)
        await consumer.seek_to_end(*tps)
        for tp in tps:
            await consumer.position(tp)  # resolve the end now, before any request is sent
        follower = asyncio.create_task(follow())
        topic = inbox(CLIENT).name
        wall, log_ms, lost, warm = [], [], [], []
        legs: dict[str, list[int]] = {"gateway": [], "scheduler": []}
        for i in range(warmup + n):
            job = f"req-{i:04d}"
            req = JobRequested(job_id=job, tenant=TENANT, compute_milli=100, gpu_memory_mib=1024, duration_s=1)
            value = encode(envelope(req, source=CLIENT, seq=i + 1, time_ms=int(time.time() * 1000)))
            arrived.clear()
            t0 = time.monotonic()
            meta = await producer.send_and_wait(topic, key=job.encode(), value=value)
            full = f"{TENANT}/{job}"
            deadline = t0 + timeout
            while full not in seen and time.monotonic() < deadline:
                try:
                    await asyncio.wait_for(arrived.wait(), max(0.01, deadline - time.monotonic()))
                except asyncio.TimeoutError:
                    break
                arrived.clear()
            if full not in seen:
                lost.append(job)
                print(f"  {job}: no cmd.place within {timeout}s", flush=True)
            elif i < warmup:
                warm.append((seen[full][0] - t0) * 1000)
            else:
                t1, cmd_ms = seen[full]
                wall.append((t1 - t0) * 1000)
                log_ms.append(cmd_ms - meta.timestamp)
                h = hops.get(full, {})
                if SCHEDULER_INPUT.name in h:
                    legs["gateway"].append(h[SCHEDULER_INPUT.name] - meta.timestamp)
                    legs["scheduler"].append(cmd_ms - h[SCHEDULER_INPUT.name])
            if i >= warmup and (i - warmup + 1) % 50 == 0:
                print(f"  {i - warmup + 1}/{n}: last {wall[-1] if wall else float('nan'):.1f} ms", flush=True)
            await asyncio.sleep(gap)
        follower.cancel()
    finally:
        await producer.stop()
        await consumer.stop()
    return {"wall_ms": summary(wall) if wall else None, "log_ms": summary(log_ms) if log_ms else None,
            "legs_log_ms": {k: summary(v) for k, v in legs.items() if v},
            "warmup_wall_ms": summary(warm) if warm else None,
            "lost": lost, "samples_wall_ms": [round(x, 2) for x in wall]}


def main() -> int:
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, exit_on_signal)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=50, help="requests before the measured ones, reported apart")
    ap.add_argument("--gap", type=float, default=0.25, help="seconds between a placement and the next request")
    ap.add_argument("--nodes", type=int, default=4, help="simulated fleet demo:N")
    ap.add_argument("--sink", action="store_true", help="run the worker with its ClickHouse sink (default: --no-sink)")
    ap.add_argument("--timeout", type=float, default=30.0, help="give up on one request's placement after this")
    ap.add_argument("--libs-home", default=str(ROOT / ".gpupool"), help="where kafka/libs (the jar cache) lives")
    ap.add_argument("--keep", action="store_true", help="keep the temporary home (broker data, logs)")
    args = ap.parse_args()

    home = Path(tempfile.mkdtemp(prefix="gpupool-bench-latency-"))
    stack = Stack(home=home, libs_home=Path(args.libs_home))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                                capture_output=True, text=True).stdout.strip())
    result: dict = {"bench": "request_latency", "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                    "commit": commit + ("+dirty" if dirty else ""), "requests": args.requests, "gap_s": args.gap,
                    "fleet": f"demo:{args.nodes}", "sink": args.sink, "cpus": os.cpu_count(),
                    "loadavg_before": os.getloadavg()}
    try:
        t = time.monotonic()
        stack.start_broker()
        print(f"broker {stack.bootstrap} up in {time.monotonic() - t:.1f}s (home {home})", flush=True)
        stack.start_worker(120.0, *([] if args.sink else ["--no-sink"]))
        stack.start_agent(f"demo:{args.nodes}")
        stack.client().send([QuotaSet(tenant=TENANT, gpu_milli=1_000_000)])
        stack.add_user(CLIENT, "tenant", TENANT)
        print("worker, fleet, quota and tenant principal up", flush=True)
        worker_pid = stack.procs["worker"].pid
        cpu0, t0 = cpu_seconds(worker_pid), time.monotonic()
        r = asyncio.run(measure(stack, args.requests, args.warmup, args.gap, args.timeout))
        result["worker_cpu_s"] = round(cpu_seconds(worker_pid) - cpu0, 2)
        result["run_s"] = round(time.monotonic() - t0, 1)
        result.update(r)
        result["loadavg_after"] = os.getloadavg()
    finally:
        stack.stop()
        if not args.keep:
            shutil.rmtree(home, ignore_errors=True)

    print()
    print(f"commit {result['commit']}, fleet demo:{args.nodes}, {args.requests} requests {args.gap}s apart, "
          f"load average before {result['loadavg_before'][0]:.2f}, after {result['loadavg_after'][0]:.2f}")
    print(f"{'request -> cmd.place':34} {'n':>4} {'p50':>8} {'p90':>8} {'p99':>8} {'max':>8}  (ms)")
    for label, key in (("producer -> command consumer", "wall_ms"), ("append -> append (log time)", "log_ms"),
                       (f"warm-up ({args.warmup}), producer -> consumer", "warmup_wall_ms")):
        s = result[key]
        if s:
            print(f"{label:34} {s['n']:>4} {s['p50']:>8} {s['p90']:>8} {s['p99']:>8} {s['max']:>8}")
    legs = {"gateway": "  inbox -> scheduler input (gateway)", "scheduler": "  scheduler input -> commands"}
    for key, label in legs.items():
        if s := result["legs_log_ms"].get(key):
            print(f"{label:34} {s['n']:>4} {s['p50']:>8} {s['p90']:>8} {s['p99']:>8} {s['max']:>8}")
    if result["lost"]:
        print(f"no placement for {len(result['lost'])} requests")
    if result["wall_ms"]:
        result["goal"] = {"p99_ms_max": 50, "met": result["wall_ms"]["p99"] < 50}
        print(f"p99 {result['wall_ms']['p99']} ms (goal < 50: {'met' if result['goal']['met'] else 'not met'}); "
              f"worker CPU {result['worker_cpu_s']} s over {result['run_s']} s")
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
