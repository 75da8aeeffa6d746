"""Simulated-fleet publish benchmark: the real agent CLI publishing a fleet's telemetry into a fresh broker.

    .venv/bin/python -m bench.fleet [--fleet bench/fleet-200x8.yaml] [--interval 1.0] [--duration 60] [--with-worker]

1. Starts a fresh local Kafka broker (agents.stack.Stack) in a temporary home; with --with-worker also one Faust
   worker (`agents.cli worker --no-scheduler --no-sink`) folding what the fleet publishes.
2. Spawns `python -m agents.cli agent --simulate FLEET --interval I` and waits for its first telemetry record.
3. Measures a window of --duration seconds: telemetry records produced (topic end offsets before/after), the agent
   process's CPU (utime+stime from /proc/<pid>/stat, as % of one core), and with the worker its fold progress and
   CPU.
4. Stops the agent (and worker), reads the telemetry topic back from offset 0 and, per node, counts the batches whose
   event time falls in the window and the gaps between consecutive batches: the achieved interval.
5. Prints a table and one final JSON line (prefix `RESULT `). Everything started here is stopped on exit.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from aiokafka import AIOKafkaConsumer, TopicPartition

from agents.node import fleet as fleet_mod
from agents.node.sim_agent import wall_ms
from agents.stack import Stack
from bench.procs import cpu_seconds, exit_on_signal
from schemas.envelope import decode
from schemas.topics import TELEMETRY

ROOT = Path(__file__).resolve().parent.parent


async def end_offsets(conn) -> int:
    consumer = AIOKafkaConsumer(**conn.options(), enable_auto_commit=False, group_id=None)
    await consumer.start()
    try:
        tps = [TopicPartition(TELEMETRY.name, p) for p in range(TELEMETRY.partitions)]
        return sum((await consumer.end_offsets(tps)).values())
    finally:
        await consumer.stop()


async def read_back(conn, total: int) -> list[tuple[str, int, int]]:
    """(node, event time ms, GPU samples) of every telemetry record on the topic."""
    consumer = AIOKafkaConsumer(**conn.options(), enable_auto_commit=False, group_id=None,
                                max_partition_fetch_bytes=16 << 20, fetch_max_bytes=64 << 20)
    await consumer.start()
    out = []
    try:
        tps = [TopicPartition(TELEMETRY.name, p) for p in range(TELEMETRY.partitions)]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        t0 = time.monotonic()
        while len(out) < total and time.monotonic() - t0 < 60:
            for msgs in (await consumer.getmany(timeout_ms=500, max_records=20000)).values():
                for msg in msgs:
                    env = decode(msg.value)
                    if env.kind == "gpu.telemetry":
                        out.append((env.payload.node, env.event_time_ms, len(env.payload.samples)))
    finally:
        await consumer.stop()
    return out


def main() -> int:
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, exit_on_signal)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fleet", default=str(ROOT / "bench" / "fleet-200x8.yaml"))
    ap.add_argument("--interval", type=float, default=1.0)
    ap.add_argument("--duration", type=float, default=60.0)
    ap.add_argument("--with-worker", action="store_true", help="also run a Faust worker folding the telemetry")
    ap.add_argument("--libs-home", default=str(ROOT / ".gpupool"))
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args()

    inventories = fleet_mod.load(args.fleet)
    nodes = len(inventories)
    gpus = sum(len(inv.gpus) for inv in inventories)
    home = Path(tempfile.mkdtemp(prefix="gpupool-bench-fleet-"))
    stack = Stack(home=home, libs_home=Path(args.libs_home))
    result: dict = {"bench": "fleet", "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "fleet": args.fleet,
                    "nodes": nodes, "gpus": gpus, "interval_s": args.interval, "duration_s": args.duration,
                    "with_worker": args.with_worker, "cpus": os.cpu_count()}
    try:
        bootstrap = stack.start_broker()
        conn = stack.conn("service")  # reads every topic
        print(f"broker {bootstrap} up (home {home})", flush=True)
        worker = None
        if args.with_worker:
            worker = stack.spawn("worker", "worker", "--no-scheduler", "--no-sink")
            deadline = time.monotonic() + 120
            while True:
                try:
                    stack.stats()
                    break
                except OSError:
                    if worker.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(f"worker did not come up: {stack.log('worker')[-3000:]}") from None
                    time.sleep(0.2)
            print("worker up", flush=True)
        t_spawn = time.monotonic()
        agent = stack.spawn("agent", "agent", "--simulate", args.fleet, "--interval", str(args.interval))
        while asyncio.run(end_offsets(conn)) == 0:
            if agent.poll() is not None or time.monotonic() - t_spawn > 120:
                raise RuntimeError(f"agent published nothing: {stack.log('agent')[-3000:]}")
            time.sleep(0.2)
        result["agent_startup_s"] = round(time.monotonic() - t_spawn, 2)
        print(f"agent publishing after {result['agent_startup_s']}s; measuring {args.duration:.0f}s", flush=True)

        broker_pid = stack.broker.running_pid() if stack.broker else None
        off0, w0, m0 = asyncio.run(end_offsets(conn)), wall_ms(), time.monotonic()
        cpu0 = {"agent": cpu_seconds(agent.pid), "broker": cpu_seconds(broker_pid),
                "worker": cpu_seconds(worker.pid if worker else None)}
        fold0 = stack.stats()["folded"].get("gpu.telemetry", 0) if worker else 0
        while time.monotonic() - m0 < args.duration:
            time.sleep(min(5.0, args.duration - (time.monotonic() - m0)))
            if agent.poll() is not None:
                raise RuntimeError(f"agent exited: {stack.log('agent')[-3000:]}")
            print(f"  t={time.monotonic() - m0:5.1f}s", flush=True)
        m1, w1 = time.monotonic(), wall_ms()
        cpu1 = {"agent": cpu_seconds(agent.pid), "broker": cpu_seconds(broker_pid),
                "worker": cpu_seconds(worker.pid if worker else None)}
        off1 = asyncio.run(end_offsets(conn))
        fold1 = stack.stats()["folded"].get("gpu.telemetry", 0) if worker else 0
        window = m1 - m0
        stack.stop_process("agent")
        if worker:
            stack.stop_process("worker")
        total = asyncio.run(end_offsets(conn))
        recs = asyncio.run(read_back(conn, total))
    finally:
        stack.stop()
        if not args.keep:
            shutil.rmtree(home, ignore_errors=True)

    per_node: dict[str, list[int]] = defaultdict(list)
    samples_in_window = 0
    for node, t, s in recs:
        per_node[node].append(t)
        if w0 <= t < w1:
            samples_in_window += s
    in_window = {node: sum(1 for t in ts if w0 <= t < w1) for node, ts in per_node.items()}
    counts = [in_window.get(inv.node, 0) for inv in inventories]
    gaps = [b - a for ts in per_node.values() for a, b in zip(sorted(ts), sorted(ts)[1:])
            if w0 <= a and b < w1]
    published = off1 - off0
    cpu = {k: round(100 * (cpu1[k] - cpu0[k]) / window, 1) for k in cpu0}
    result.update({
        "window_s": round(window, 2),
        "published_records": published, "records_per_s": round(published / window, 1),
        "gpu_samples_in_window": samples_in_window, "gpu_samples_per_s": round(samples_in_window / window, 1),
        "expected_batches_per_node": round(window / args.interval, 1),
        "batches_per_node": {"min": min(counts), "mean": round(statistics.mean(counts), 2), "max": max(counts)},
        "interval_ms": {"mean": round(statistics.mean(gaps), 1) if gaps else None,
                        "p50": statistics.median(gaps) if gaps else None,
                        "p99": sorted(gaps)[int(0.99 * (len(gaps) - 1))] if gaps else None,
                        "max": max(gaps) if gaps else None},
        "cpu_pct_of_one_core": cpu,
    })
    if args.with_worker:
        result["worker_folded_in_window"] = fold1 - fold0
        result["worker_fold_per_s"] = round((fold1 - fold0) / window, 1)

    print()
    print(f"fleet {nodes} nodes x {gpus // max(nodes, 1)} GPUs, interval {args.interval}s, window {window:.1f}s"
          f"{' (with Faust worker)' if args.with_worker else ''}")
    print(f"{'published telemetry records/s':34} {result['records_per_s']:>10}")
    print(f"{'published GPU samples/s':34} {result['gpu_samples_per_s']:>10}")
    b = result["batches_per_node"]
    print(f"{'batches per node in window':34} {'min ' + str(b['min']) + ' mean ' + str(b['mean']) + ' max ' + str(b['max']):>10}"
          f"   (expected {result['expected_batches_per_node']})")
    iv = result["interval_ms"]
    print(f"{'achieved interval ms':34} mean {iv['mean']}  p50 {iv['p50']}  p99 {iv['p99']}  max {iv['max']}")
    print(f"{'agent CPU % of one core':34} {cpu['agent']:>10}")
    print(f"{'broker CPU % of one core':34} {cpu['broker']:>10}")
    if args.with_worker:
        print(f"{'worker CPU % of one core':34} {cpu['worker']:>10}")
        print(f"{'worker folded telemetry/s':34} {result['worker_fold_per_s']:>10}   "
              f"(agent published {result['records_per_s']}/s)")
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
