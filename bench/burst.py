"""One tenant's burst against another tenant's single jobs (issue #31 item 2): submit -> placement, idle and during
the burst, and the worker's peak memory.

    .venv/bin/python -m bench.burst [--burst 5000] [--probes 20] [--nodes 4]

1. Starts what the tests start (agents.stack.Stack): a fresh local SASL broker, one worker through the project's
   CLI (gateway, folds, scheduler, sink), a simulated fleet (`demo:N`), quotas for tenants `acme` and `globex`, and
   the tenant principals alice (acme) and bob (globex).
2. Idle: bob sends `--probes` one-card jobs, one at a time, each after the one before was placed.
3. Burst: alice sends `--burst` job requests at once (one producer, batched), and bob's probes follow as in 2,
   the first one right after the burst left alice's producer.
4. Every time is the log's: a probe's latency is the append time of its `cmd.place` on `gpupool.commands` minus
   the append time of its request in bob's inbox (the broker's clock at both ends, no client in it). The worker's
   peak resident memory is VmHWM of its process. Prints p50/p99/max of each phase, what became of alice's burst
   (admitted, refused and why), the commit and the load average, and one JSON line (prefix `RESULT `).
Runs on any commit that has agents.stack.Stack (copy this file into an older tree to measure it).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import tempfile
import time
from collections import Counter
from pathlib import Path

import orjson
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from agents.stack import Stack
from infra.security import SERVICE
from schemas.envelope import decode
from schemas.events import QuotaSet

ROOT = Path(__file__).resolve().parent.parent


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q / 100 * len(s) + 0.5) - 1))] if s else float("nan")


def summary(xs: list[float]) -> dict:
    return {"n": len(xs), "p50_ms": pct(xs, 50), "p99_ms": pct(xs, 99), "max_ms": max(xs) if xs else None}


def job(job_id: str, compute: int, duration: int) -> bytes:
    return orjson.dumps({"kind": "job.requested", "job_id": job_id, "compute_milli": compute,
                         "gpu_memory_mib": 1024, "duration_s": duration})


def peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


class Probe:
    """bob's probes: sends one, waits for its cmd.place on the commands topic, in log time."""

    def __init__(self, stack: Stack):
        self.stack = stack
        self.placed: dict[str, int] = {}  # job -> append time of its cmd.place
        self.sent: dict[str, int] = {}  # job -> append time of its request in bob's inbox

    async def start(self) -> None:
        self.consumer = AIOKafkaConsumer(**self.stack.conn(SERVICE).options(), group_id=None,
                                         enable_auto_commit=False, fetch_max_wait_ms=200)
        await self.consumer.start()
        parts = [TopicPartition("gpupool.commands", p) for p in
                 (self.consumer.partitions_for_topic("gpupool.commands") or range(8))]
        self.consumer.assign(parts)
        await self.consumer.seek_to_end(*parts)
        self.bob = AIOKafkaProducer(**self.stack.conn("bob").options(), acks="all", linger_ms=0)
        await self.bob.start()
        self.follow = asyncio.create_task(self._follow())

    async def _follow(self) -> None:
        while True:
            for msgs in (await self.consumer.getmany(timeout_ms=500)).values():
                for m in msgs:
                    env = decode(m.value)
                    if env.kind == "cmd.place" and env.payload.job_id.startswith("globex/"):
                        self.placed.setdefault(env.payload.job_id, m.timestamp)

    async def one(self, name: str, timeout_s: float) -> float | None:
        meta = await self.bob.send_and_wait(f"gpupool.in.bob", value=job(name, 100, 1))
        self.sent[f"globex/{name}"] = meta.timestamp
        deadline = time.monotonic() + timeout_s
        while f"globex/{name}" not in self.placed and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        got = self.placed.get(f"globex/{name}")
        return None if got is None else got - meta.timestamp

    async def stop(self) -> None:
        self.follow.cancel()
        await self.bob.stop()
        await self.consumer.stop()


async def run(stack: Stack, burst: int, probes: int, timeout_s: float) -> dict:
    probe = Probe(stack)
    await probe.start()
    try:
        idle = [await probe.one(f"idle-{i}", timeout_s) for i in range(probes)]
        alice = AIOKafkaProducer(**stack.conn("alice").options(), acks="all", linger_ms=20,
                                 max_batch_size=1 << 20)
        await alice.start()
        t0 = time.monotonic()
        futs = [await alice.send("gpupool.in.alice", value=job(f"burst-{i}", 1000, 3600)) for i in range(burst)]
        await alice.flush()
        for f in futs:
            await f
        sent_s = time.monotonic() - t0
        await alice.stop()
        during = [await probe.one(f"burst-{i}", timeout_s) for i in range(probes)]
    finally:
        await probe.stop()
    return {"idle": idle, "during": during, "burst_sent_s": round(sent_s, 2)}


def outcome(stack: Stack) -> dict:
    from tests.live import read_topic

    codes = Counter()
    for r in read_topic(stack, "gpupool.decisions"):
        env = decode(r.value)
        if env.kind == "job.rejected" and env.payload.job_id.startswith("acme/burst-"):
            codes[env.payload.code] += 1
    admitted = sum(1 for r in read_topic(stack, "gpupool.job-requests")
                   if (e := decode(r.value)).kind == "job.requested" and e.payload.job_id.startswith("acme/burst-"))
    silent = sum(1 for r in read_topic(stack, "gpupool.node-control")
                 if (e := decode(r.value)).kind == "node.liveness" and not e.payload.alive)
    interrupted = sum(1 for r in read_topic(stack, "gpupool.decisions") if decode(r.value).kind == "job.interrupted")
    return {"admitted": admitted, "refused": dict(codes), "nodes_declared_silent": silent,
            "jobs_interrupted": interrupted}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--burst", type=int, default=5000)
    ap.add_argument("--probes", type=int, default=20)
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds a probe may wait for its placement")
    args = ap.parse_args()
    home = Path(tempfile.mkdtemp(prefix="gpupool-burst-")) / "gpupool"
    stack = Stack(home=home, libs_home=ROOT / ".gpupool")
    stack.start_broker()
    try:
        stack.start_worker()
        stack.start_agent(f"demo:{args.nodes}")
        stack.add_user("alice", "tenant", "acme")
        stack.add_user("bob", "tenant", "globex")
        stack.client().send([QuotaSet(tenant=t, gpu_milli=1_000_000) for t in ("acme", "globex")])
        while stack.client().api("/cluster/").get("cards", 0) < 4 * args.nodes:
            time.sleep(0.5)
        res = asyncio.run(run(stack, args.burst, args.probes, args.timeout))
        worker_pid = stack.procs["worker"].pid
        res["worker_peak_rss_mib"] = round(peak_rss_mib(worker_pid), 1)
        res["burst_outcome"] = outcome(stack)
    finally:
        stack.stop()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    doc = {"commit": commit, "burst": args.burst, "nodes": args.nodes, "loadavg": os.getloadavg(),
           "idle": summary([x for x in res["idle"] if x is not None]),
           "during": summary([x for x in res["during"] if x is not None]),
           "unplaced_probes": sum(x is None for x in res["idle"] + res["during"]),
           "burst_sent_s": res["burst_sent_s"], "worker_peak_rss_mib": res["worker_peak_rss_mib"],
           "burst_outcome": res["burst_outcome"]}
    print(f"commit {commit}, load average {doc['loadavg']}")
    print(f"bob's submit -> placement, idle:           {doc['idle']}")
    print(f"bob's submit -> placement, during a burst: {doc['during']} (alice's {args.burst} sent in "
          f"{doc['burst_sent_s']} s)")
    print(f"alice's burst: {doc['burst_outcome']}; worker peak RSS {doc['worker_peak_rss_mib']} MiB")
    print("RESULT " + json.dumps(doc))


if __name__ == "__main__":
    main()
