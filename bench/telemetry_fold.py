"""Telemetry fold throughput: the Faust worker against a bare aiokafka consumer on the same records.

    .venv/bin/python -m bench.telemetry_fold [--nodes 1000] [--records 50000] [--gpus 8] [--profile FILE]

1. Starts a fresh local Kafka broker (agents.stack.Stack) in a temporary home and pre-produces the nodes'
   inventories plus N GpuTelemetry envelopes (GPUS samples each), built with schemas.envelope / schemas.routing.
2. (a) Starts one Faust worker through the project's CLI (`agents.cli worker --no-scheduler --no-sink`) and polls its
   /stats/ until folded["gpu.telemetry"] reaches N. Wall time is measured from worker-ready (the web page answers)
   to done; the window from the first folded record to done is reported too, as are the worker's and the broker's
   CPU use over that time (from /proc/<pid>/stat).
   (b) With the worker stopped, reads the same topic from offset 0 with a bare aiokafka consumer, five passes:
   decode() only (the baseline of the ratio); decode_telemetry() only (the worker's decoder, schemas/envelope.py);
   decode + the batch fold; decode + node_view.evolve in process (views kept as objects); decode + evolve + the
   view's JSON serialization that the worker's node-view changelog write costs per record (no Kafka write).
3. Prints a table and one final JSON line (prefix `RESULT `).

Telemetry event times are anchored a few minutes ahead of the wall clock so the worker's liveness timer does not
declare the whole backlog's nodes silent while it catches up (that would inject node.liveness records into the run).
Everything started here (broker, worker) is stopped on exit, also on error or Ctrl-C.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from agents.node import fleet
from agents.stack import Stack
from schemas.envelope import decode, decode_telemetry, encode, envelope
from schemas.events import GpuSample, GpuTelemetry
from schemas.routing import route
from schemas.topics import TELEMETRY
from bench.procs import cpu_seconds, exit_on_signal
from streams.edge import codec
from streams.folds import node_view

ROOT = Path(__file__).resolve().parent.parent
MODELS = ("A100-80GB", "H100-80GB", "A10", "T4")


# ---------------------------------------------------------------- records

def build_records(nodes: int, records: int, gpus: int, t0_ms: int) -> tuple[list, list]:
    """Inventories (one per node) and `records` telemetry envelopes, round-robin over the nodes; (topic, key, value)."""
    invs = [fleet.make_node(f"bn-{i:04d}", MODELS[i % len(MODELS)], gpus, rack=f"rack-{i // 16}") for i in range(nodes)]
    inv_recs = []
    for inv in invs:
        env = envelope(inv, source=f"{inv.node}/inventory", seq=1, time_ms=t0_ms)
        spec, key = route(env)
        inv_recs.append((spec.name, key, encode(env)))
    tel_recs = []
    for k in range(records):
        inv = invs[k % nodes]
        batch = k // nodes  # the node's k-th interval
        util = [(batch * 7 + c.index * 13) % 101 for c in inv.gpus]
        samples = tuple(GpuSample(gpu_uuid=c.uuid, util_pct=u, mem_used_mib=c.memory_mib * u // 100,
                                  mem_total_mib=c.memory_mib, temperature_c=35 + u // 2, power_mw=60_000 + 3_000 * u,
                                  job_ids=(f"job-{batch % 50}",) if u else ())
                        for c, u in zip(inv.gpus, util))
        env = envelope(GpuTelemetry(node=inv.node, samples=samples), source=f"{inv.node}/telemetry", seq=batch + 1,
                       time_ms=t0_ms + batch * 1000)
        spec, key = route(env)
        assert spec is TELEMETRY
        tel_recs.append((spec.name, key, encode(env)))
    return inv_recs, tel_recs


async def produce(conn, recs: list) -> None:
    producer = AIOKafkaProducer(**conn.options(), acks="all", linger_ms=20, max_batch_size=1 << 20,
                                max_request_size=8 << 20)
    await producer.start()
    try:
        pending = []
        for topic, key, value in recs:
            pending.append(await producer.send(topic, key=key, value=value))
            if len(pending) >= 5000:
                await asyncio.gather(*pending)
                pending.clear()
        await asyncio.gather(*pending)
        await producer.flush()
    finally:
        await producer.stop()


# ---------------------------------------------------------------- (a) Faust

# Experiments only (--faust-settings / --patch): the same CLI entry point with extra faust.App settings merged in
# and/or a proposed change patched in, to measure a streams/edge/app.py change without editing that file.
#   no_changelog: drop the table's changelog writes (NOT a fix - it loses recovery; it bounds what the changelog costs)
OVERRIDE_LAUNCHER = """
import json, os, sys, faust
_App, _extra = faust.App, json.loads(os.environ.get("BENCH_FAUST_SETTINGS") or "{}")
faust.App = lambda *a, **kw: _App(*a, **{**kw, **_extra})
patches = set(filter(None, os.environ.get("BENCH_PATCH", "").split(",")))
if "no_changelog" in patches:
    from faust.tables.table import Table
    Table.on_key_set = lambda self, key, value: None
from agents.cli import main
sys.exit(main(sys.argv[1:]))
"""


PROFILE_LAUNCHER = """
import atexit, cProfile, sys, time
out = sys.argv.pop(1)
prof = cProfile.Profile(time.process_time)
atexit.register(lambda: (prof.disable(), prof.dump_stats(out)))
prof.enable()
from agents.cli import main
sys.exit(main(sys.argv[1:]))
"""


def run_faust(stack: Stack, n: int, nodes: int, timeout: float, profile: str | None,
              settings: str | None = None, patch: str | None = None) -> dict:
    argv = ["worker", "--no-scheduler", "--no-sink"]
    if settings or patch:
        import subprocess
        log = open(stack.home / "worker.log", "ab")
        proc = subprocess.Popen([sys.executable, "-c", OVERRIDE_LAUNCHER, *argv], stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=ROOT,
                                env={**os.environ, **stack.env, "BENCH_FAUST_SETTINGS": settings or "",
                                     "BENCH_PATCH": patch or ""},
                                start_new_session=True)
        stack.procs["worker"] = proc
    elif profile:
        # Same CLI, under cProfile timed by the process's CPU clock (on a shared machine wall time charges other
        # processes' turns to whatever was running); written when the worker exits on SIGTERM.
        log = open(stack.home / "worker.log", "ab")
        import subprocess
        proc = subprocess.Popen([sys.executable, "-c", PROFILE_LAUNCHER, profile, *argv],
                                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env={**os.environ, **stack.env}, start_new_session=True)
        stack.procs["worker"] = proc
    else:
        proc = stack.spawn("worker", *argv)
    t_spawn = time.monotonic()
    deadline = t_spawn + 120
    client = stack.client()
    while not client.healthy():  # /healthz needs no token; /stats/ would wait on a worker that is not up yet
        if proc.poll() is not None:
            raise RuntimeError(f"worker exited {proc.returncode}: {stack.log('worker')[-3000:]}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"worker did not answer: {stack.log('worker')[-3000:]}")
        time.sleep(0.1)
    stats = stack.stats()
    t_ready = time.monotonic()
    broker_pid = stack.broker.running_pid() if stack.broker else None
    cpu0 = cpu_seconds(proc.pid), cpu_seconds(broker_pid)
    t_first = None
    done = 0
    progress = []
    deadline = t_ready + timeout
    while time.monotonic() < deadline:
        stats = stack.stats()
        done = stats["folded"].get("gpu.telemetry", 0)
        now = time.monotonic()
        if done and t_first is None:
            t_first = now
        if not progress or now - progress[-1][0] >= 5:
            progress.append((now, done))
            print(f"  faust: t={now - t_ready:6.1f}s folded {done}/{n}", flush=True)
            if proc.poll() is not None or "Crashed reason=" in stack.log("worker"):
                raise RuntimeError(f"worker failed: {stack.log('worker')[-3000:]}")
            if len(progress) >= 7 and progress[-1][1] == progress[-7][1]:
                print("  faust: no progress for 30 s, giving up", flush=True)
                break
        if done >= n:
            break
        time.sleep(0.5)
    t_done = time.monotonic()
    cpu1 = cpu_seconds(proc.pid), cpu_seconds(broker_pid)
    stack.stop_process("worker")
    tel = stats.get("telemetry") or {}
    # the worker's own clock of its telemetry task: from its first batch to its last (no polling granularity)
    busy = (tel["last_batch_at"] - tel["first_batch_at"]) if tel.get("first_batch_at") else None
    wall = t_done - t_ready
    fold_window = t_done - (t_first or t_ready)
    return {
        "complete": done >= n, "folded": done, "startup_s": round(t_ready - t_spawn, 2), "wall_s": round(wall, 2),
        "first_to_done_s": round(fold_window, 2), "rec_per_s": round(done / wall, 1),
        "rec_per_s_first_to_done": round(done / fold_window, 1) if fold_window else None,
        "task_first_to_last_batch_s": round(busy, 3) if busy else None,
        "rec_per_s_task": round(tel.get("records", 0) / busy, 1) if busy else None,
        "telemetry_task": {k: tel.get(k) for k in ("records", "batches", "changelog_writes", "flushes")},
        "worker_cpu_pct": round(100 * (cpu1[0] - cpu0[0]) / wall, 1),
        "worker_cpu_s": round(cpu1[0] - cpu0[0], 2),
        "rec_per_worker_cpu_s": round(done / (cpu1[0] - cpu0[0]), 1) if cpu1[0] > cpu0[0] else None,
        "broker_cpu_pct": round(100 * (cpu1[1] - cpu0[1]) / wall, 1),
        "stats": {k: stats.get(k) for k in ("folded", "dead_letters", "gateway")},  # not the liveness map of every node
    }


# ---------------------------------------------------------------- (b) bare consumer

async def bare_pass(conn, n: int, mode: str) -> dict:
    consumer = AIOKafkaConsumer(**conn.options(), enable_auto_commit=False, group_id=None,
                                max_partition_fetch_bytes=16 << 20, fetch_max_bytes=64 << 20)
    await consumer.start()
    try:
        tps = [TopicPartition(TELEMETRY.name, p) for p in sorted(consumer.partitions_for_topic(TELEMETRY.name)
                                                                 or range(TELEMETRY.partitions))]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        views: dict[str, object] = {}
        count = samples = 0
        t0, c0 = time.monotonic(), time.process_time()
        while count < n and time.monotonic() - t0 < 300:
            batches = await consumer.getmany(timeout_ms=500, max_records=20000)
            for msgs in batches.values():
                by_node: dict[str, list] = {}
                for msg in msgs:
                    env = decode_telemetry(msg.value) if mode == "decode_telemetry" else decode(msg.value)
                    count += 1
                    samples += len(env.payload.samples)
                    if mode == "evolve":
                        key = env.payload.node
                        views[key] = node_view.evolve(views.get(key), env)
                    elif mode == "batch":  # the worker's pure part (streams/edge/telemetry.py): per node of a batch
                        by_node.setdefault(env.payload.node, []).append(env)
                    elif mode == "fold":  # what Worker._fold did per record, minus Kafka: evolve + changelog value
                        key = env.payload.node
                        views[key] = after = node_view.evolve(views.get(key), env)
                        codec.NODE_VIEW.dump_json(after)  # the node-view table's changelog serializer
                for key, envs in by_node.items():
                    views[key] = node_view.fold_telemetry(views.get(key), envs)
        wall, cpu = time.monotonic() - t0, time.process_time() - c0
    finally:
        await consumer.stop()
    return {"mode": mode, "records": count, "samples": samples, "wall_s": round(wall, 2), "cpu_s": round(cpu, 2),
            "rec_per_s": round(count / wall, 1), "samples_per_s": round(samples / wall, 1),
            "rec_per_cpu_s": round(count / cpu, 1) if cpu else None}


# ---------------------------------------------------------------- main

def main() -> int:
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, exit_on_signal)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=1000)
    ap.add_argument("--records", type=int, default=50_000)
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--fold-timeout", type=float, default=150.0, help="give up on the Faust fold after this long")
    ap.add_argument("--libs-home", default=str(ROOT / ".gpupool"), help="where kafka/libs (the jar cache) lives")
    ap.add_argument("--profile", metavar="FILE", help="run the worker under cProfile, write the profile here")
    ap.add_argument("--skip-faust", action="store_true")
    ap.add_argument("--patch", metavar="LIST", help="experiment: no_changelog (see OVERRIDE_LAUNCHER)")
    ap.add_argument("--faust-settings", metavar="JSON",
                    help='experiment: extra faust.App settings for the worker, e.g. \'{"producer_linger": 0.02}\'')
    ap.add_argument("--keep", action="store_true", help="keep the temporary home (broker data, worker log)")
    args = ap.parse_args()

    home = Path(tempfile.mkdtemp(prefix="gpupool-bench-fold-"))
    stack = Stack(home=home, libs_home=Path(args.libs_home))
    n = args.records
    result: dict = {"bench": "telemetry_fold", "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "nodes": args.nodes,
                    "records": n, "gpus_per_record": args.gpus, "samples": n * args.gpus, "cpus": os.cpu_count()}
    try:
        t = time.monotonic()
        bootstrap = stack.start_broker()
        print(f"broker {bootstrap} up in {time.monotonic() - t:.1f}s (home {home})", flush=True)
        t = time.monotonic()
        inv_recs, tel_recs = build_records(args.nodes, n, args.gpus, time.time_ns() // 1_000_000 + 600_000)
        build_s = time.monotonic() - t
        t = time.monotonic()
        asyncio.run(produce(stack.conn("service"), inv_recs + tel_recs))  # what the node relay writes
        prod_s = time.monotonic() - t
        size = sum(len(v) for _, _, v in tel_recs)
        result["produce"] = {"build_encode_s": round(build_s, 2), "produce_s": round(prod_s, 2),
                             "rec_per_s": round(len(inv_recs + tel_recs) / prod_s, 1),
                             "telemetry_bytes": size, "avg_record_bytes": size // n}
        print(f"built+encoded {len(inv_recs)} inventories + {n} telemetry records in {build_s:.1f}s; "
              f"produced in {prod_s:.1f}s ({size / 1e6:.1f} MB telemetry)", flush=True)
        del inv_recs, tel_recs

        if not args.skip_faust:
            faust = run_faust(stack, n, args.nodes, args.fold_timeout, args.profile, args.faust_settings,
                              args.patch)
            faust["settings_override"] = json.loads(args.faust_settings) if args.faust_settings else None
            faust["patch"] = args.patch
            faust["samples_per_s"] = round(faust["rec_per_s"] * args.gpus, 1)
            result["faust"] = faust
        for mode in ("decode", "decode_telemetry", "batch", "evolve", "fold"):
            r = asyncio.run(bare_pass(stack.conn("service"), n, mode))
            print(f"  bare {mode}: {r['records']} records in {r['wall_s']}s", flush=True)
            result[f"bare_{mode}"] = r
    finally:
        stack.stop()
        if not args.keep:
            shutil.rmtree(home, ignore_errors=True)

    f = result.get("faust")
    bare = result["bare_decode"]
    rows = []
    if f:
        rows.append(("Faust worker (ready->done)", f["folded"], f["wall_s"], f["rec_per_s"], f["samples_per_s"]))
        rows.append(("Faust worker (1st fold->done)", f["folded"], f["first_to_done_s"], f["rec_per_s_first_to_done"],
                     round(f["rec_per_s_first_to_done"] * args.gpus, 1)))
        if f.get("rec_per_s_task"):
            rows.append(("worker's telemetry task (1st->last)", f["telemetry_task"]["records"],
                         f["task_first_to_last_batch_s"], f["rec_per_s_task"], round(f["rec_per_s_task"] * args.gpus, 1)))
    for mode, label in (("decode", "bare aiokafka + decode"), ("decode_telemetry", "bare + decode_telemetry"),
                        ("batch", "bare + decode + batch fold"),
                        ("evolve", "bare + decode + evolve"),
                        ("fold", "bare + decode + evolve + view JSON")):
        r = result[f"bare_{mode}"]
        rows.append((label, r["records"], r["wall_s"], r["rec_per_s"], r["samples_per_s"]))
    print()
    print(f"{'path':34} {'records':>8} {'wall s':>8} {'records/s':>11} {'GPU samples/s':>14}")
    for label, recs, wall, rps, sps in rows:
        print(f"{label:34} {recs:>8} {wall:>8} {rps:>11} {sps:>14}")
    if f:
        # the goal's figure: the worker's telemetry task from its first batch to its last (Faust's group join and
        # table recovery before it are start-up, not fold rate), against the bare consumer's whole pass
        rate = f.get("rec_per_s_task") or f["rec_per_s"]
        f["samples_per_s"] = round(rate * args.gpus, 1)
        result["ratio_faust_over_bare_decode"] = round(rate / bare["rec_per_s"], 3)
        result["ratio_ready_to_done_over_bare_decode"] = round(f["rec_per_s"] / bare["rec_per_s"], 3)
        result["ratio_faust_over_bare_evolve"] = round(rate / result["bare_evolve"]["rec_per_s"], 3)
        # on a shared machine: records per CPU-second of the process, worker (ready -> done, start-up included)
        # against the bare consumer's pass
        if f.get("rec_per_worker_cpu_s") and bare.get("rec_per_cpu_s"):
            result["ratio_per_cpu_s"] = round(f["rec_per_worker_cpu_s"] / bare["rec_per_cpu_s"], 3)
        result["goal"] = {"ratio_min": 0.5, "samples_per_s_min": 40_000,
                          "ratio_met": result["ratio_faust_over_bare_decode"] >= 0.5,
                          "samples_met": f["samples_per_s"] >= 40_000}
        print(f"\nratio worker/bare(decode) = {result['ratio_faust_over_bare_decode']}  (goal >= 0.5; from worker-ready: "
              f"{result['ratio_ready_to_done_over_bare_decode']})   worker GPU samples/s = {f['samples_per_s']}  "
              f"(goal >= 40000)")
        print(f"per CPU-second: worker {f.get('rec_per_worker_cpu_s')} records, bare decode {bare.get('rec_per_cpu_s')}: "
              f"ratio {result.get('ratio_per_cpu_s')}")
        print(f"worker CPU {f['worker_cpu_pct']}% of one core, broker CPU {f['broker_cpu_pct']}% over the fold; "
              f"worker folded: {f['stats']['folded']}, dead letters: {f['stats']['dead_letters']}")
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
