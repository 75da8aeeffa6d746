"""`gpupool demo`: the design card's whole path on the embedded defaults, checked end to end.

A fresh local broker and embedded ClickHouse under $GPUPOOL_HOME/demo, a 4-node simulated fleet, 20 jobs from two
tenants; then the bill is compared, to the milli-GPU-millisecond, with what the placed jobs must have used.
Nothing is left running.
"""
from __future__ import annotations

import random
import shutil
import time
import uuid

import orjson

from agents.cli import emit
from agents.stack import Stack
from schemas.events import JobRequested, QuotaSet, Tier

TENANTS = ("acme", "globex")
MEMBERS = {"acme": "alice", "globex": "bob"}  # the tenant principal that submits each tenant's jobs
# A tenant without a quota runs nothing (the scheduler's default, docs/scheduler.md): the operator sets them first,
# generously here (milli-CU: the compute units of what a job holds), so no demo job waits on quota.
QUOTAS = (QuotaSet(tenant="acme", gpu_milli=40_000), QuotaSet(tenant="globex", gpu_milli=20_000))


def demo_jobs(n: int, run: str, seed: int = 7) -> list[JobRequested]:
    """acme trains on whole cards; globex serves and fine-tunes on fractions."""
    rng = random.Random(seed)
    jobs = []
    for i in range(n):
        if i % 2 == 0:
            jobs.append(JobRequested(job_id=f"demo-{run}-{i:02d}", tenant="acme", project="llm-train",
                                     tier=Tier.OFFLINE, compute_milli=rng.choice([1000, 2000, 3000]),
                                     gpu_memory_mib=rng.choice([40, 60, 80]) * 1024, cpu_milli=4000,
                                     memory_mib=32 * 1024, duration_s=rng.randint(2, 6)))
        else:
            jobs.append(JobRequested(job_id=f"demo-{run}-{i:02d}", tenant="globex", project="chat-serving",
                                     tier=rng.choice([Tier.INFERENCE, Tier.ONLINE_TRAINING]),
                                     compute_milli=rng.choice([100, 200, 300, 500]),
                                     gpu_memory_mib=rng.choice([4, 8, 12]) * 1024, cpu_milli=2000,
                                     memory_mib=8 * 1024, duration_s=rng.randint(2, 6)))
    return jobs


def step(n: int, total: int, text: str) -> None:
    print(f"[{n}/{total}] {text}", flush=True)


def run_demo(cfg, args) -> int:
    t0 = time.monotonic()
    home = cfg.home / "demo"
    shutil.rmtree(home, ignore_errors=True)
    stack = Stack(home=home, libs_home=cfg.home, bootstrap=cfg.kafka)
    run = uuid.uuid4().hex[:6]
    total = 6
    try:
        step(1, total, "Kafka: " + ("using GPUPOOL_KAFKA" if cfg.kafka else "local KRaft broker from Maven Central"))
        bootstrap = stack.start_broker()
        step(2, total, f"broker {bootstrap} answers; topics created ({time.monotonic() - t0:.1f}s)")
        stack.start_worker()
        step(3, total, f"Faust worker up: folds, scheduler agent, ClickHouse sink ({stack.env['GPUPOOL_CLICKHOUSE']})")
        stack.start_agent(f"demo:{args.nodes}")
        step(4, total, f"simulated fleet of {args.nodes} nodes (A100-80GB, H100-80GB, A10, T4; 4 cards each)")
        for tenant, member in MEMBERS.items():
            stack.add_user(member, "tenant", tenant)
        jobs = demo_jobs(args.jobs, run)
        stack.client().send(list(QUOTAS))  # as the admin operator
        for tenant, member in MEMBERS.items():
            stack.client(member).send([j for j in jobs if j.tenant == tenant])
        step(5, total, f"quotas set by admin; submitted {len(jobs)} jobs: " + ", ".join(
            f"{tenant}'s by principal {member}" for tenant, member in MEMBERS.items()))
        jobs = [j.model_copy(update={"job_id": f"{j.tenant}/{j.job_id}"}) for j in jobs]  # as the gateway names them
        ours = {j.job_id for j in jobs}
        deadline = time.monotonic() + 180
        states: dict[str, str] = {}
        last = ""
        while time.monotonic() < deadline:
            rows = [r for r in jobs_rows(stack) if r["job_id"] in ours]
            states = {r["job_id"]: r["state"] for r in rows}
            counts = {s: sum(1 for v in states.values() if v == s) for s in sorted(set(states.values()))}
            line = "  ".join(f"{k} {v}" for k, v in counts.items())
            if line != last:
                print(f"      t={time.monotonic() - t0:5.1f}s  {line}", flush=True)
                last = line
            if len(states) == len(ours) and all(v == "completed" for v in states.values()):
                break
            time.sleep(1.0)
        else:
            print(f"timed out waiting for jobs: {states}")
            return 1
        time.sleep(1.5)  # the last usage records reach ClickHouse on the sink's next batch
        step(6, total, "billing from ClickHouse (gpupool billing --by tenant)")
        ok = check_bill(stack, jobs)
        print()
        emit(["job_id", "tenant", "state", "node"],
             [[r["job_id"], r["tenant"], r["state"], r["node"]] for r in jobs_rows(stack) if r["job_id"] in ours],
             "table")
        print(f"\ndemo finished in {time.monotonic() - t0:.1f}s: {'OK' if ok else 'MISMATCH'}")
        return 0 if ok else 1
    finally:
        stack.stop()
        if not args.keep:
            shutil.rmtree(home / "kafka-data", ignore_errors=True)


def jobs_rows(stack: Stack) -> list[dict]:
    cols, rows = stack.client().rows("/api/jobs")
    return [dict(zip(cols, r)) for r in rows]


def check_bill(stack: Stack, jobs: list[JobRequested]) -> bool:
    """Expected, from what the node agents reported, independently of the scheduler's accrual: for each run of a
    job (a job.started, then the job.stopped or job.completed of the same placement command), the milli-GPUs its
    placement command gave it x the run's length."""
    by_id = {j.job_id: j for j in jobs}
    expected: dict[str, int] = {t: 0 for t in TENANTS}
    milli: dict[str, int] = {}
    started: dict[tuple[str, str], tuple[str, int]] = {}  # (job, node) -> (placement command, start)
    for row in stack.query("SELECT kind, job_id, node, command_id, event_time_ms, payload FROM gpupool.events FINAL "
                           "WHERE kind IN ('cmd.place', 'job.started', 'job.stopped', 'job.completed') "
                           "ORDER BY event_time_ms, topic, partition, offset"):
        job = by_id.get(row["job_id"])
        if job is None:
            continue
        cmd, run, at = row["command_id"], (row["job_id"], row["node"]), int(row["event_time_ms"])
        if row["kind"] == "cmd.place":
            milli[cmd] = sum(a["milli"] for a in orjson.loads(row["payload"])["assignments"])
        elif row["kind"] == "job.started":
            started[run] = (cmd, at)
        elif run in started:  # a stop names the preempt command, a completion the placement: match by node
            placed, since = started.pop(run)
            expected[job.tenant] += milli[placed] * (at - since)
    billed_rows = stack.query(
        "SELECT tenant, sum(gpu_milli_ms) AS milli_ms, uniqExact(job_id) AS jobs FROM gpupool.usage FINAL "
        "WHERE has({ids:Array(String)}, job_id) GROUP BY tenant ORDER BY tenant", {"ids": sorted(by_id)})
    billed = {r["tenant"]: int(r["milli_ms"]) for r in billed_rows}
    emit(["tenant", "jobs", "gpu_seconds_billed", "gpu_seconds_run", "match"],
         [[r["tenant"], r["jobs"], f"{billed[r['tenant']] / 1e6:.3f}", f"{expected[r['tenant']] / 1e6:.3f}",
           "yes" if billed[r["tenant"]] == expected[r["tenant"]] else "NO"] for r in billed_rows], "table")
    ok = billed == expected
    print(("CHECK OK: each tenant's billed GPU-seconds equal the GPU-seconds its jobs ran, as the nodes reported"
           if ok else f"CHECK FAILED: billed {billed} != run {expected}"), flush=True)
    return ok
