"""The design card's whole path on a real Kafka broker and the embedded ClickHouse: no mocks anywhere.

submit -> Faust fold -> scheduler agent -> placement command -> simulated node agent -> lifecycle events ->
ClickHouse rows -> `gpupool jobs` / `gpupool billing`.
"""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time

import orjson
import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from infra.kafka_client import stop_consumer

from agents.cli import JOBS_SQL
from agents.scheduler.agent import read_partition
from schemas.envelope import decode
from schemas.topics import DEAD_LETTERS, INVENTORY, JOB_EVENTS, JOB_REQUESTS, TELEMETRY, COMMANDS
from streams import codec, job_view, node_view

pytestmark = pytest.mark.broker


def cli(stack, *argv: str) -> str:
    out = subprocess.run([sys.executable, "-m", "agents.cli", *argv], env={**os.environ, **stack.env},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def quotas(stack, *tenants: str) -> None:
    """Give the tenants a quota: without one a tenant runs nothing (the scheduler's default_quota_milli is 0)."""
    for t in tenants:
        cli(stack, "quota", "set", t, "--compute", "100000")


def wait_for(predicate, timeout: float = 60.0, what: str = "condition", stack=None):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(0.5)
    logs = (stack.log("worker")[-4000:] + stack.log("agent")[-2000:]) if stack else ""
    raise AssertionError(f"timed out waiting for {what}; last={last!r}\n{logs}")


def job_states(stack) -> dict[str, dict]:
    return {r["job_id"]: r for r in stack.query(JOBS_SQL)}


def read_topic(bootstrap: str, topic: str) -> list:
    async def go():
        consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap)
        await consumer.start()
        try:
            parts = sorted(await _partitions(consumer, topic))
        finally:
            await stop_consumer(consumer)
        out = []
        for p in parts:
            await read_partition(bootstrap, TopicPartition(topic, p), None, out.append)
        return out

    return asyncio.run(go())


async def _partitions(consumer, topic) -> set[int]:
    """A fresh consumer's metadata can lag a topic's creation; ask until every partition is known."""
    from schemas.topics import ALL_TOPICS

    want = next((s.partitions for s in ALL_TOPICS if s.name == topic), 1)
    for _ in range(50):
        await consumer._client.force_metadata_update()
        parts = consumer.partitions_for_topic(topic) or set()
        if len(parts) >= want:
            return parts
        await asyncio.sleep(0.1)
    raise AssertionError(f"metadata for {topic} never showed {want} partitions")


def caught_up(bootstrap: str, group: str, specs) -> bool:
    async def go():
        from aiokafka.admin import AIOKafkaAdminClient

        admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
        consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap)
        await admin.start()
        await consumer.start()
        try:
            committed = await admin.list_consumer_group_offsets(group)
            parts = [TopicPartition(s.name, p) for s in specs for p in range(s.partitions)]
            ends = await consumer.end_offsets(parts)
            return all(ends[tp] == 0 or (tp in committed and committed[tp].offset >= ends[tp]) for tp in parts)
        finally:
            await stop_consumer(consumer)
            await admin.close()

    return asyncio.run(go())


def test_whole_path_submit_to_bill(stack):
    stack.start_worker()
    stack.start_agent("demo:2")
    quotas(stack, "acme", "zeta")
    # node-000 is A100-80GB x4 (1000 milli-CU a card), node-001 H100-80GB x4.
    cli(stack, "submit", "--tenant", "acme", "--compute", "500", "--memory-gib", "10", "--duration", "2",
        "--job-id", "frac-1", "--model", "A100-80GB")
    cli(stack, "submit", "--tenant", "acme", "--compute", "2000", "--memory-gib", "100", "--duration", "3",
        "--job-id", "gang-1", "--model", "A100-80GB")
    cli(stack, "submit", "--tenant", "zeta", "--compute", "250", "--memory-gib", "8", "--duration", "1",
        "--job-id", "frac-2", "--model", "A100-80GB")
    states = wait_for(lambda: (s := job_states(stack)) and len(s) == 3 and
                      all(v["state"] == "completed" for v in s.values()) and s, 90, "three completed jobs", stack)
    assert states["gang-1"]["node"] == "node-000" and states["frac-2"]["node"] == "node-000"

    jobs_json = json.loads(cli(stack, "jobs", "--format", "json"))
    assert {j["job_id"]: (j["state"], j["node"]) for j in jobs_json}["gang-1"] == ("completed", "node-000")

    def billed():
        rows = json.loads(cli(stack, "billing", "--by", "tenant", "--format", "json"))
        return {r["tenant"]: r for r in rows} if sum(r["jobs"] for r in rows) == 3 else None

    bill = wait_for(billed, 30, "usage rows for 3 jobs", stack)
    # frac-1: 500 milli on one A100 for 2 s; gang-1: 2 whole A100s (2000 CU, 100 GiB) for 3 s; frac-2: 250 x 1 s
    assert bill["acme"]["milli_gpu_ms"] == 500 * 2000 + 2 * 1000 * 3000
    assert bill["zeta"]["milli_gpu_ms"] == 250 * 1000
    assert bill["acme"]["gpu_seconds"] == pytest.approx(7.0)

    kinds = {r["kind"]: r["n"] for r in stack.query(
        "SELECT kind, count() AS n FROM gpupool.events FINAL WHERE job_id = 'gang-1' GROUP BY kind")}
    assert {"job.requested", "cmd.place", "job.started", "job.completed", "cmd.release", "usage.accrued"} <= set(kinds)
    place = stack.query("SELECT reasons FROM gpupool.scheduling FINAL WHERE job_id = 'gang-1' AND kind = 'cmd.place'")
    assert "Placed" in place[0]["reasons"]
    explain = cli(stack, "explain", "gang-1")
    assert "cmd.place" in explain and "GpuFit" in explain


def test_plain_kafka_client_submits_a_job(stack):
    """No project code on the producing side: a JSON document by hand, as docs/producing-jobs.md shows."""
    stack.start_worker()
    stack.start_agent("demo:1")
    quotas(stack, "ext")
    doc = {"schema_version": 2, "event_id": "ext-1", "source": "external-client", "seq": 1,
           "event_time_ms": int(time.time() * 1000), "tenant": "ext",
           "payload": {"kind": "job.requested", "job_id": "ext-job-1", "tenant": "ext", "compute_milli": 300,
                       "gpu_memory_mib": 4096, "duration_s": 1}}

    async def send():
        producer = AIOKafkaProducer(bootstrap_servers=stack.bootstrap)
        await producer.start()
        try:
            await producer.send_and_wait("gpupool.job-requests", key=b"ext-job-1", value=json.dumps(doc).encode())
        finally:
            await producer.stop()

    asyncio.run(send())
    wait_for(lambda: job_states(stack).get("ext-job-1", {}).get("state") == "completed", 60, "external job", stack)
    placed = stack.query("SELECT node FROM gpupool.scheduling FINAL WHERE job_id = 'ext-job-1' AND kind = 'cmd.place'")
    assert placed and placed[0]["node"] == "node-000"


def test_bad_input_is_dead_lettered_and_folding_continues(stack):
    stack.start_worker()
    stack.start_agent("demo:1")
    quotas(stack, "t")
    good = {"schema_version": 2, "event_id": "e", "source": "s", "seq": 1, "event_time_ms": 1,
            "payload": {"kind": "job.requested", "job_id": "x", "tenant": "t", "compute_milli": 100,
                        "gpu_memory_mib": 100}}

    def variant(**payload_changes):
        d = json.loads(json.dumps(good))
        d["payload"].update(payload_changes)
        return json.dumps(d).encode()

    future = dict(good, schema_version=9)
    bad = [
        (b"{this is not json", "malformed_json"),
        (variant(compute_milli="a lot"), "invalid"),
        (variant(kind="job.teleported"), "unknown_kind"),
        (json.dumps(future).encode(), "future_version"),
        (b'{"pad": "' + b"x" * (1 << 20) + b'"}', "oversized"),
        (variant(gpu_memory_mib=-1024), "invalid"),
    ]

    async def send():
        producer = AIOKafkaProducer(bootstrap_servers=stack.bootstrap, max_request_size=4 << 20)
        await producer.start()
        try:
            for raw, _ in bad:
                await producer.send_and_wait("gpupool.job-requests", key=b"bad", value=raw)
            after = dict(good, event_id="after", seq=2,
                         payload=dict(good["payload"], job_id="after-bad", duration_s=1))
            await producer.send_and_wait("gpupool.job-requests", key=b"after-bad", value=json.dumps(after).encode())
        finally:
            await producer.stop()

    asyncio.run(send())
    wait_for(lambda: job_states(stack).get("after-bad", {}).get("state") == "completed", 60,
             "the good job after the bad ones", stack)
    # the good job is on another partition than the bad ones: it may be through before the last of them is lettered
    letters = wait_for(lambda: len(ls := [orjson.loads(m.value) for m in read_topic(stack.bootstrap, DEAD_LETTERS.name)])
                       >= len(bad) and ls, 30, "every bad record dead-lettered", stack)
    assert sorted(d["reason"] for d in letters) == sorted(code for _, code in bad)
    assert all(d["topic"] == "gpupool.job-requests" and d["offset"] >= 0 for d in letters)
    neg = next(d for d in letters if "gpu_memory_mib" in d["detail"])
    assert neg["reason"] == "invalid"
    assert stack.stats()["dead_letters"] == {"malformed_json": 1, "invalid": 2, "unknown_kind": 1,
                                             "future_version": 1, "oversized": 1}


def test_refolding_from_offset_zero_equals_the_live_tables(stack):
    stack.start_worker()
    stack.start_agent("demo:2", "--fault", "ecc:node-001:2")
    quotas(stack, "t0", "t1")
    for i in range(6):
        cli(stack, "submit", "--tenant", f"t{i % 2}", "--compute", str(200 + 100 * i), "--memory-gib", "6",
            "--duration", "1", "--job-id", f"rf-{i}")
    wait_for(lambda: (s := job_states(stack)) and len(s) == 6 and all(v["state"] == "completed" for v in s.values()),
             90, "six completed jobs", stack)
    time.sleep(2)  # a few more telemetry rounds
    stack.stop_process("agent")
    time.sleep(4)  # the liveness timer marks the silent nodes down (2 missed heartbeats): the last derived facts
    # Faust flushes a table's changelog before it commits the source offsets, so once the worker's group has
    # committed up to the end of every source topic, the changelogs hold the live tables.
    wait_for(lambda: caught_up(stack.bootstrap, "gpupool", [INVENTORY, TELEMETRY, COMMANDS, JOB_REQUESTS,
                                                           JOB_EVENTS]), 60, "the worker to commit everything", stack)

    def latest(topic):
        out = {}
        for m in read_topic(stack.bootstrap, topic):
            out[orjson.loads(m.key)] = None if m.value is None else orjson.loads(m.value)
        return out

    live_nodes = {k: codec.load_view(codec.NODE_VIEW, v) for k, v in latest("gpupool-node-view-changelog").items()}
    live_jobs = {k: codec.load_view(codec.JOB_VIEW, v) for k, v in latest("gpupool-job-view-changelog").items()}

    def refold(topics, mod, key_of):
        views = {}
        for topic in topics:
            records = read_topic(stack.bootstrap, topic)
            assert records, f"nothing read back from {topic}"
            for m in records:
                try:
                    env = decode(m.value)
                except Exception:  # noqa: BLE001 - dead-lettered live too
                    continue
                k = key_of(env)
                views[k] = mod.evolve(views.get(k), env)
        return views

    nodes = refold([INVENTORY.name, TELEMETRY.name, COMMANDS.name], node_view,
                   lambda e: getattr(e.payload, "node", None) or e.payload.to_node)
    jobs = refold([JOB_REQUESTS.name, JOB_EVENTS.name], job_view, lambda e: e.payload.job_id)
    assert set(nodes) == set(live_nodes) == {"node-000", "node-001"}
    for name in nodes:
        assert nodes[name] == live_nodes[name], name
    assert nodes["node-001"].unhealthy  # the injected ECC fault took a card out, live and refolded
    assert set(jobs) == set(live_jobs) and len(jobs) == 6
    for name in jobs:
        assert jobs[name] == live_jobs[name], name


def test_duplicated_ledger_records_do_not_double_bill(stack):
    stack.start_worker()
    stack.start_agent("demo:1")
    quotas(stack, "dup")
    for i in range(3):
        cli(stack, "submit", "--tenant", "dup", "--compute", "400", "--memory-gib", "4", "--duration", "1",
            "--job-id", f"dup-{i}")
    wait_for(lambda: (s := job_states(stack)) and len(s) == 3 and all(v["state"] == "completed" for v in s.values()),
             60, "three jobs", stack)

    def total():  # once every job's last usage is in (a usage tick may have cut a run in two)
        rows = stack.query("SELECT sum(gpu_milli_ms) AS s, uniqExact(job_id) AS n FROM gpupool.usage FINAL "
                           "WHERE tenant = 'dup'")
        return rows[0]["s"] if rows and rows[0]["n"] == 3 else None

    before = wait_for(total, 30, "usage rows", stack)
    assert before == 3 * 400 * 1000
    ledger = read_topic(stack.bootstrap, "gpupool.ledger")

    async def resend():
        producer = AIOKafkaProducer(bootstrap_servers=stack.bootstrap)
        await producer.start()
        try:
            for m in ledger:  # at-least-once upstream: every ledger record delivered a second time
                await producer.send_and_wait("gpupool.ledger", key=m.key, value=m.value, partition=m.partition)
        finally:
            await producer.stop()

    asyncio.run(resend())
    ends = {}
    for m in ledger:
        ends[m.partition] = ends.get(m.partition, 0) + 2  # each record now twice
    wait_for(lambda: all(stack.stats()["sink"]["positions"].get(f"gpupool.ledger/{p}", 0) >= n
                         for p, n in ends.items()), 30, "sink to read the duplicates", stack)
    assert total() == before


def test_reservation_and_service_through_the_live_path(stack):
    """The CLI books a reservation and declares a service; the live scheduler (ElasticScheduler) holds the booked
    capacity, hands it to the job that names it, and starts the service's minimum replicas as ordinary jobs that the
    node agent runs -- all through Kafka, visible in ClickHouse."""
    stack.start_worker()
    stack.start_agent("demo:2")
    # a booking is checked against the pool's capacity: wait until the scheduler has seen the nodes
    wait_for(lambda: json.loads(cli(stack, "cluster", "--format", "json"))["cards"] == 8, 60, "two nodes", stack)
    quotas(stack, "acme")
    rid = cli(stack, "reserve", "book", "--tenant", "acme", "--compute", "2000", "--memory-gib", "100",
              "--hours", "1").strip()

    def decided(status):
        rows = stack.query("SELECT payload FROM gpupool.events FINAL WHERE kind = 'reservation.decided'")
        return [r for r in rows if f'"{rid}"' in r["payload"] and f'"status":"{status}"' in r["payload"]]

    wait_for(lambda: decided("active"), 60, "the reservation's hold", stack)
    cli(stack, "submit", "--tenant", "acme", "--tier", "online-training", "--compute", "2000", "--memory-gib", "100",
        "--duration", "2", "--job-id", "booked-1", "--reservation", rid)
    wait_for(lambda: decided("used"), 60, "the reservation used", stack)
    states = wait_for(lambda: (s := job_states(stack)) and s.get("booked-1", {}).get("state") == "completed" and s,
                      60, "the booked job completed", stack)
    assert states["booked-1"]["node"]

    cli(stack, "service", "declare", "chat", "--tenant", "acme", "--compute", "300", "--memory-gib", "10",
        "--replica-qps", "50", "--min-replicas", "2")
    # two serving replicas (and possibly warm ones, started ahead from idle capacity: docs/elastic.md)
    running = wait_for(lambda: (r := [j for j, v in job_states(stack).items()
                                      if j.startswith("chat/") and v["state"] == "running"]) and len(r) >= 2 and r,
                       60, "service replicas running", stack)
    assert {"chat/r1", "chat/r2"} <= set(running)
    scaled = stack.query("SELECT payload FROM gpupool.events FINAL WHERE kind = 'service.scaled'")
    assert any('"chat"' in r["payload"] for r in scaled)
