"""Helpers for the tests that run the real stack: the CLI as a subprocess, the worker's API, the log read back as a
principal allowed to read it, and raw produces as a given principal (authenticated, or not at all)."""
from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import time

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from streams.edge.scheduler_agent import read_partition
from infra.kafka_client import stop_consumer
from infra.security import SERVICE
from schemas.topics import by_name


def cli(stack, *argv: str, user: str | None = None, check: bool = True) -> str | subprocess.CompletedProcess:
    env = {**os.environ, **stack.env}
    if user:
        env["GPUPOOL_USER"] = user
    out = subprocess.run([sys.executable, "-m", "agents.cli", *argv], env=env, capture_output=True, text=True,
                         timeout=120)
    if not check:
        return out
    assert out.returncode == 0, out.stderr[-3000:] + "\n--- stdout ---\n" + out.stdout[-3000:]
    return out.stdout


def quotas(stack, *tenants: str, compute: int = 100_000) -> None:
    """Give the tenants a quota, as the admin operator: without one a tenant runs nothing (the scheduler's default
    quota is 0, docs/scheduler.md)."""
    from schemas.events import QuotaSet

    stack.client().send([QuotaSet(tenant=t, gpu_milli=compute) for t in tenants])


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


def job_states(stack, user: str = "admin") -> dict[str, dict]:
    cols, rows = stack.client(user).rows("/api/jobs")
    return {r[0]: dict(zip(cols, r)) for r in rows}


def read_topic(stack, topic: str, user: str = SERVICE) -> list:
    """Every record of every partition of `topic`, read as `user` (the service may read every internal topic)."""
    conn = stack.conn(user)

    async def go():
        spec_parts = by_name(topic).partitions
        consumer = AIOKafkaConsumer(**conn.options())
        await consumer.start()
        try:
            for _ in range(50):  # a fresh consumer's metadata can lag a topic's creation
                await consumer._client.force_metadata_update()
                if len(consumer.partitions_for_topic(topic) or ()) >= spec_parts:
                    break
                await asyncio.sleep(0.1)
        finally:
            await stop_consumer(consumer)
        out = []
        for p in range(spec_parts):
            await read_partition(conn, TopicPartition(topic, p), None, out.append)
        return out

    return asyncio.run(go())


def produce(stack, topic: str, values: list[bytes], user: str | None = SERVICE, keys: list[bytes] | None = None,
            partitions: list[int] | None = None, **producer_kw) -> None:
    """Send raw records as `user` (None: with no credentials at all)."""
    opts = stack.conn(user).options() if user else {"bootstrap_servers": stack.bootstrap}

    async def go():
        producer = AIOKafkaProducer(**opts, **producer_kw)
        await producer.start()
        try:
            for i, v in enumerate(values):
                await producer.send_and_wait(topic, value=v, key=keys[i] if keys else None,
                                             partition=partitions[i] if partitions else None)
        finally:
            await producer.stop()

    asyncio.run(go())


def caught_up(stack, group: str, specs) -> bool:
    async def go():
        from aiokafka.admin import AIOKafkaAdminClient

        conn = stack.conn(SERVICE)
        admin = AIOKafkaAdminClient(**conn.options())
        consumer = AIOKafkaConsumer(**conn.options())
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


def replication(conn) -> tuple[dict[str, set[int]], set[str | None]]:
    """Per topic of the project, the replica counts of its partitions, and the `min.insync.replicas` values of all
    of them, read back from the brokers (`conn`: a principal that may describe topics, e.g. the service)."""
    from aiokafka.admin import AIOKafkaAdminClient
    from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType

    from schemas.topics import ALL_TOPICS

    async def go():
        admin = AIOKafkaAdminClient(**conn.options())
        await admin.start()
        try:
            meta = await admin.describe_topics([s.name for s in ALL_TOPICS])
            cfgs = await admin.describe_configs([ConfigResource(ConfigResourceType.TOPIC, s.name)
                                                 for s in ALL_TOPICS])
        finally:
            await admin.close()
        return meta, cfgs

    meta, cfgs = asyncio.run(go())
    replicas = {t["topic"]: {len(p["replicas"]) for p in t["partitions"]} for t in meta}
    insync = {dict((c[0], c[1]) for c in res[4]).get("min.insync.replicas") for resp in cfgs for res in resp.resources}
    return replicas, insync


@contextlib.contextmanager
def live_pool(tmp_path_factory, broker_mode: str, libs_home, name: str, users, fleet: str = "demo:2",
              quota_for=(), **stack_kw):
    """A module's stack: a broker (or GPUPOOL_KAFKA's), a worker, a simulated fleet, the principals `users`
    ((name, role, tenant) each) and a quota for each tenant of `quota_for`; yielded once the scheduler has the
    fleet's nodes, stopped afterwards."""
    from agents.stack import Stack

    s = Stack(home=tmp_path_factory.mktemp(name) / "gpupool", libs_home=libs_home,
              bootstrap=os.environ["GPUPOOL_KAFKA"] if broker_mode == "env" else None, **stack_kw)
    s.start_broker()
    try:
        s.start_worker()
        s.start_agent(fleet)
        for user, role, tenant in users:
            s.add_user(user, role, tenant)
        if quota_for:
            quotas(s, *quota_for)  # without one a tenant runs nothing
        nodes = int(fleet.rpartition(":")[2]) if fleet.startswith("demo:") else None
        wait_for(lambda: s.stats()["scheduler"]["nodes"] == nodes if nodes else s.stats()["scheduler"]["nodes"],
                 60, "the fleet in the scheduler", s)
        yield s
    finally:
        s.stop()
