"""Scheduler takeover after a long history: from a snapshot plus the tail, against a full replay.

    nice -n 10 .venv/bin/python -m bench.takeover [--records 1000000] [--nodes 64] [--tail 2000]

1. Builds a history of scheduler input in process: N nodes' inventories, quotas, then one scheduler tick a second of
   log time, a job request every 10 s (fractional and whole-card jobs of 60-600 s), each placed job started and
   completed by its "node agent" as the placement says. The scheduler (ElasticScheduler, as the agent runs it)
   steps every record as it is built: that pass is the full replay's cost, timed (records/s).
2. Starts a fresh local broker, produces the whole history to gpupool.scheduler-input, commits the scheduler group
   at the end, and writes the snapshot of the state at (end - tail) to gpupool.scheduler-snapshots, as the live
   agent would have (it writes one every 2,000 records).
3. Times `SchedulerAgent._rebuild(committed)` — what a worker does when it takes the scheduler partition over: read
   the snapshot topic, load the latest snapshot at or below the committed offset, replay the tail from Kafka —
   and checks the rebuilt state equals the in-process one (tests/test_scheduler_snapshot.canonical).
4. Prints one `RESULT {json}` line.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def history(n_records: int, nodes: int, snapshot_at: int, seed: int = 7, on_record=None):
    """(envelopes, log_ms) of the scheduler input, and the scheduler that stepped them (state after each).
    `on_record(i, env, log_ms, outputs, scheduler)`: called after each record is stepped, instead of keeping the
    envelopes (bench/audit_segments.py streams them to files)."""
    from agents.node import fleet
    from agents.scheduler.core import ElasticScheduler
    from schemas.envelope import envelope
    from schemas.events import JobCompleted, JobRequested, JobStarted, QuotaSet, SchedulerTick, Tier

    from streams.edge import scheduler_snapshot as snapshot

    rng = random.Random(seed)
    s = ElasticScheduler()
    seqs: dict[str, int] = {}
    # log time ends about now (a history of ~1.3 records a second of log time, started that long ago): the tail,
    # replayed at the broker's append times, does not jump the scheduler's clock by weeks (usage accrual over such
    # a gap would be the whole cost)
    now = int(time.time() * 1000) - int(n_records / 1.5 * 1000)
    snap = None
    out_envs: list = []
    times: list[int] = []
    due: list[tuple[int, object]] = []  # (log ms, payload) the node agents will say
    t0 = time.process_time()

    count = [0]

    def feed(payload, source):
        seqs[source] = seqs.get(source, 0) + 1
        env = envelope(payload, source=source, seq=seqs[source], time_ms=now)
        count[0] += 1
        if on_record is None:
            out_envs.append(env)
            times.append(now)
        outs = s.step(env, now)
        if on_record is not None:
            on_record(count[0] - 1, env, now, outs, s)
        if count[0] == snapshot_at:
            nonlocal snap
            snap = snapshot.dump(s, snapshot_at, now)
        for o in outs:
            if o.kind == "cmd.place":
                p = o.payload
                due.append((now + 500, JobStarted(job_id=p.job_id, node=p.node, command_id=p.command_id)))
                due.append((now + 500 + running[p.job_id], JobCompleted(job_id=p.job_id, node=p.node,
                                                                         command_id=p.command_id)))

    running: dict[str, int] = {}
    models = ("A100-80GB", "H100-80GB")
    for i in range(nodes):
        feed(fleet.make_node(f"node-{i:03d}", models[i % 2], 8, rack=f"r{i // 8}"), f"node-{i:03d}/inventory")
    for t in ("acme", "zeta", "umbra"):
        feed(QuotaSet(tenant=t, gpu_milli=nodes * 8 * 1000, overcommit_pct=150), "operator")
    j = ticks = 0
    while count[0] < n_records:
        now += 1000
        ticks += 1
        feed(SchedulerTick(now_ms=now), "ticker")
        due.sort(key=lambda d: d[0])
        while due and due[0][0] <= now and count[0] < n_records:
            _, p = due.pop(0)
            feed(p, f"{p.node}/job/{p.job_id}")
        if ticks % 10 == 0 and count[0] < n_records:
            j += 1
            job_id = f"{('acme', 'zeta', 'umbra')[j % 3]}/j{j}"
            running[job_id] = rng.choice((60_000, 120_000, 600_000))
            compute = rng.choice((250, 500, 1000, 2000))
            feed(JobRequested(job_id=job_id, tenant=job_id.split("/")[0], compute_milli=compute,
                              gpu_memory_mib=8192, tier=rng.choice(list(Tier)), duration_s=running[job_id] // 1000),
                 "cli")
    return out_envs[:n_records], times[:n_records], s, time.process_time() - t0, j, snap


async def produce(conn, topic, values, timestamps=None) -> None:
    from aiokafka import AIOKafkaProducer

    p = AIOKafkaProducer(**conn.options(), acks="all", linger_ms=20, max_batch_size=1 << 20,
                         max_request_size=64 << 20)
    await p.start()
    try:
        futs = []
        for i, (k, v) in enumerate(values):
            futs.append(await p.send(topic, key=k, value=v, partition=0))
            if len(futs) >= 20_000:
                await asyncio.gather(*futs)
                futs = []
        await asyncio.gather(*futs)
    finally:
        await p.stop()


async def commit(conn, group, offset) -> None:
    from aiokafka import AIOKafkaConsumer, TopicPartition

    from streams.edge.scheduler_agent import TP

    c = AIOKafkaConsumer(**conn.options(), group_id=group, enable_auto_commit=False)
    await c.start()
    try:
        c.assign([TP])
        await c.commit({TP: offset})
    finally:
        await c.stop()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--records", type=int, default=1_000_000)
    ap.add_argument("--nodes", type=int, default=64)
    ap.add_argument("--tail", type=int, default=2_000, help="records after the latest snapshot (the agent's N)")
    ap.add_argument("--libs-home", default=str(ROOT / ".gpupool"))
    args = ap.parse_args()

    from streams.edge import scheduler_snapshot as snapshot
    from streams.edge.scheduler_agent import GROUP, SchedulerAgent
    from agents.stack import Stack
    from schemas.envelope import encode
    from schemas.topics import SCHEDULER_INPUT, SCHEDULER_SNAPSHOTS

    n = args.records
    k = n - args.tail
    print(f"building {n} input records and stepping them in process ...", flush=True)
    # the snapshot at k: step 0..k, snapshot, then step on to n (the same scheduler object)
    envs, times, full, full_cpu_s, jobs, snap_value = history(n, args.nodes, k)
    result = {"records": n, "nodes": args.nodes, "jobs": jobs, "tail": args.tail,
              "full_replay_cpu_s": round(full_cpu_s, 1), "full_replay_rec_per_s": round(n / full_cpu_s),
              "snapshot_bytes": len(snap_value), "jobs_in_state": len(full.jobs),
              "ended_in_state": len(full.ended), "applied_in_state": len(full.applied)}
    print(f"  stepped {n} records in {full_cpu_s:.1f} CPU-s ({n / full_cpu_s:.0f}/s); snapshot {len(snap_value)} "
          f"bytes", flush=True)
    home = Path(tempfile.mkdtemp(prefix="gpupool-takeover-"))
    stack = Stack(home=home / "gpupool", libs_home=Path(args.libs_home))
    try:
        stack.start_broker()
        conn = stack.conn("service")
        t = time.monotonic()
        asyncio.run(produce(conn, SCHEDULER_INPUT.name, ((e.source.encode(), encode(e)) for e in envs)))
        result["produce_s"] = round(time.monotonic() - t, 1)
        asyncio.run(produce(conn, SCHEDULER_SNAPSHOTS.name, [(snapshot.key_of(k), snap_value)]))
        asyncio.run(commit(conn, GROUP, n))
        print(f"  produced in {result['produce_s']} s; timing the takeover ...", flush=True)
        agent = SchedulerAgent(stack.config, conn)
        agent.snapshots = snapshot.Writer(None)
        seen_ms: list[int] = []
        replayed = agent._replayed
        agent._replayed = lambda msg: (seen_ms.append(msg.timestamp), replayed(msg))
        t, c = time.monotonic(), time.process_time()
        asyncio.run(agent._rebuild(n))
        result["takeover_s"] = round(time.monotonic() - t, 2)
        result["takeover_cpu_s"] = round(time.process_time() - c, 2)
        result["takeover"] = agent.takeover
        print(f"  takeover {result['takeover_s']} s ({result['takeover']})", flush=True)
        # the tail was replayed at the broker's append times (the scheduler's clock), not the generator's: the
        # reference is the snapshot's state stepped in process over the same tail at those times
        ref = snapshot.load(snap_value).state
        for e, ms in zip(envs[k:], seen_ms):
            ref.step(e, ms)
        # the full canonical comparison (tests/test_scheduler_snapshot.py) is too slow for a state of ~77,000 jobs:
        # compare what decides and bills (every job's record fields that matter, every node's view, the clock)
        def summary(st):
            return (st.now_ms, st.cycle, {j: (r.phase, r.attempt, tuple(p.node for p in r.parts), r.started_ms)
                                          for j, r in st.jobs.items()},
                    {n: (v.allocations, v.faults, v.applied) for n, v in st.nodes.items()},
                    {j: (e.fingerprint, e.attempt, e.commands, e.sources, e.until_ms) for j, e in st.ended.items()},
                    st.applied)
        result["same_state_as_in_process"] = len(seen_ms) == args.tail and summary(agent.state) == summary(ref)
        result["peak_rss_mib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    finally:
        stack.stop()
        subprocess.run(["rm", "-rf", str(home)], check=False)
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
