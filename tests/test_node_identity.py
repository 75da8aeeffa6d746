"""One identity per node (docs/security.md, "Node identity"), probed on the real broker and worker: each simulated
node reports as its own principal (`node-NODE`, made by the stack as `gpupool up` makes them), through its own
channel, which the worker relays. One stack serves the module: a broker, a worker, the fleet demo:2 (node-000:
A100-80GB x4, node-001: H100-80GB x4) and the tenants alice (acme) and bob (globex).

What a stolen node credential could do before: end another tenant's running job on another node with a forged
`job.completed` (its card freed), and bring a copied inventory into the pool under a new name."""
from __future__ import annotations

import asyncio
import json
import time

import pytest
from aiokafka import AIOKafkaProducer
from aiokafka.errors import TopicAuthorizationFailedError

from agents.node import fleet
from agents.stack import Stack
from infra import security
from schemas.envelope import decode, encode, envelope
from schemas.events import Constraints, GpuCard, JobCompleted, JobRequested, NodeInventory
from tests.live import cli, job_states, quotas, read_topic, wait_for

pytestmark = pytest.mark.broker


@pytest.fixture(scope="module")
def pool(tmp_path_factory, broker_mode, libs_home):
    import os

    s = Stack(home=tmp_path_factory.mktemp("node-identity") / "gpupool", libs_home=libs_home,
              bootstrap=os.environ["GPUPOOL_KAFKA"] if broker_mode == "env" else None)
    s.start_broker()
    try:
        s.start_worker()
        s.start_agent("demo:2")
        for name, tenant in (("alice", "acme"), ("bob", "globex")):
            s.add_user(name, "tenant", tenant)
        quotas(s, "acme", "globex")
        wait_for(lambda: s.client().api("/cluster/")["cards"] == 8, 90, "the fleet", s)
        yield s
    finally:
        s.stop()


def _speaker(pool: Stack, node: str) -> security.Credentials:
    """The credentials the fleet's agent holds for `node` (what an attacker on that node would steal)."""
    for creds in security.stored_all(pool.home):
        if creds.role == "node" and node in getattr(creds, "nodes", ()):
            return creds
    return security.stored(pool.home, "node")  # before node identity: the one shared principal


def _send(pool: Stack, creds: security.Credentials, topic: str, value: bytes, key: bytes) -> bool:
    """Whether the broker took the record (False: it refused the principal that topic)."""
    try:
        _produce(pool, creds, topic, value, key)
        return True
    except TopicAuthorizationFailedError:
        return False


def _produce(pool: Stack, creds: security.Credentials, topic: str, value: bytes, key: bytes) -> None:
    async def go():
        producer = AIOKafkaProducer(**pool.conn(creds.name).options(), request_timeout_ms=10_000)
        await producer.start()
        try:
            await asyncio.wait_for(producer.send_and_wait(topic, key=key, value=value), 20)
        finally:
            await producer.stop()

    asyncio.run(go())


def _refused(pool: Stack, code: str = "not_your_node") -> int:
    return pool.stats().get("relay", {}).get(f"refused:{code}", 0)


def _node(pool: Stack, name: str) -> dict | None:
    return next((n for n in pool.client().api("/api/nodes")["nodes"] if n["node"] == name), None)


def _metrics(pool: Stack) -> str:
    import base64
    import urllib.request

    admin = pool.client().creds
    auth = base64.b64encode(f"{admin.name}:{admin.token}".encode()).decode()
    req = urllib.request.Request(f"http://127.0.0.1:{pool.web_port}/metrics", headers={"Authorization": f"Basic {auth}"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return resp.read().decode()


def _placement(pool: Stack, job: str):
    return next(e.payload for e in map(decode, (m.value for m in read_topic(pool, "gpupool.commands")))
                if e.kind == "cmd.place" and e.payload.job_id == job)


def test_a_node_cannot_end_another_nodes_job(pool):
    pool.client("bob").send([JobRequested(job_id="long-1", tenant="globex", compute_milli=1000,
                                          gpu_memory_mib=8 * 1024, duration_s=3600,
                                          constraints=Constraints(models=("H100-80GB",)))])
    wait_for(lambda: job_states(pool, "bob").get("globex/long-1", {}).get("state") == "running", 90, "bob's job",
             pool)
    place = _placement(pool, "globex/long-1")
    assert place.node == "node-001"
    thief = _speaker(pool, "node-000")  # node-000's credential, in an attacker's hands
    before = _refused(pool)

    def forged(node: str) -> bytes:
        return encode(envelope(JobCompleted(job_id="globex/long-1", node=node, command_id=place.command_id),
                               source=f"{node}/job/globex/long-1", seq=time.time_ns(), time_ms=time.time_ns() // 10**6))

    # straight onto the shared topic (what the one shared node principal could do), then through the principal's
    # own channel: about a node it does not speak for, and about a job not placed on its own node
    direct = _send(pool, thief, "gpupool.job-events", forged("node-001"), b"globex/long-1")
    channel = f"gpupool.node.{thief.name}"
    assert _send(pool, thief, channel, forged("node-001"), b"node-001") or direct
    _send(pool, thief, channel, forged("node-000"), b"node-000")
    wait_for(lambda: _refused(pool) >= before + 2 or job_states(pool, "bob")["globex/long-1"]["state"] != "running",
             60, "the forgeries read", pool)
    assert job_states(pool, "bob")["globex/long-1"]["state"] == "running"  # not ended by another node's word
    assert not direct, "the broker let a node principal write gpupool.job-events"

    letters = [json.loads(m.value) for m in read_topic(pool, "gpupool.dead-letters")]
    mine = [d for d in letters if d["topic"] == channel and d["reason"] == "not_your_node"]
    assert len(mine) >= 2 and any("never placed" in d["detail"] for d in mine), mine
    assert 'gpupool_dead_letters_total{reason="not_your_node"}' in _metrics(pool)
    # the job runs on, its card held: in the job view, the node view and the scheduler's own
    assert job_states(pool, "bob")["globex/long-1"]["state"] == "running"
    assert "globex/long-1" in _node(pool, "node-001")["jobs"]
    busy = pool.client().api("/cluster/")["busy_cards"]
    assert any(a.gpu_uuid in busy for a in place.assignments)
    completions = [e for e in map(decode, (m.value for m in read_topic(pool, "gpupool.job-events")))
                   if e.kind == "job.completed" and e.payload.job_id == "globex/long-1"]
    assert completions == []


def test_a_copied_inventory_under_another_name_is_refused(pool):
    thief = _speaker(pool, "node-000")
    inv = fleet.load("demo:2")[0]
    ghost = inv.model_copy(update={"node": "ghost-000", "gpus": tuple(
        g.model_copy(update={"uuid": g.uuid.replace("node-000", "ghost-000")}) for g in inv.gpus)})
    before = _refused(pool)
    copied = [encode(envelope(ghost, source=source, seq=time.time_ns(), time_ms=time.time_ns() // 10**6))
              for source in ("ghost-000/inventory", "node-000/inventory")]
    direct = _send(pool, thief, "gpupool.inventory", copied[0], b"ghost-000")
    for value in copied:
        _send(pool, thief, f"gpupool.node.{thief.name}", value, b"ghost-000")
    wait_for(lambda: _refused(pool) >= before + 2 or _node(pool, "ghost-000"), 60, "the copies read", pool)
    assert _node(pool, "ghost-000") is None and not direct
    assert pool.client().api("/cluster/")["cards"] == 8


def test_a_new_node_takes_no_work_until_an_operator_admits_it(pool, tmp_path):
    # an operator registers a real node's principal, without auto-admission
    out = cli(pool, "user", "add", "node-fresh", "--role", "node", "--node", "fresh-000")
    assert "fresh-000" in out
    assert any(ln.split()[:2] == ["node-fresh", "node"] and "fresh-000" in ln
               for ln in cli(pool, "user", "list").splitlines())
    spec = tmp_path / "fresh.yaml"
    spec.write_text("nodes:\n  - {name: fresh-000, model: L4, gpus: 2}\n")
    pool.spawn("agent-fresh", "agent", "--simulate", str(spec), "--principal", "node-fresh",
               "--group", "gpupool-agent-fresh")
    wait_for(lambda: (n := _node(pool, "fresh-000")) and n["state"] == "not-admitted", 90, "fresh-000 heard", pool)
    pool.client("alice").send([JobRequested(job_id="on-l4", tenant="acme", compute_milli=100, gpu_memory_mib=1024,
                                            duration_s=3600, constraints=Constraints(models=("L4",)))])
    wait_for(lambda: "NodeNotAdmitted" in json.dumps(pool.client("alice").api("/api/explain", {"job": "acme/on-l4"})),
             90, "the job waiting on admission", pool)
    # listed once the sink has stored its view's change too (gpupool.jobs: a topic of its own, read beside the decision)
    wait_for(lambda: job_states(pool, "alice").get("acme/on-l4", {}).get("state") == "pending", 30, "listed waiting",
             pool)
    assert "fresh-000" in pool.client().api("/cluster/")["unschedulable_nodes"]

    cli(pool, "node", "admit", "fresh-000", "--reason", "racked and burned in")
    wait_for(lambda: job_states(pool, "alice")["acme/on-l4"]["state"] == "running", 90, "the job placed", pool)
    assert _placement(pool, "acme/on-l4").node == "fresh-000" and _node(pool, "fresh-000")["state"] == "ready"
    pool.stop_process("agent-fresh")


def test_the_fleet_still_places_runs_and_completes_jobs(pool):
    pool.client("alice").send([JobRequested(job_id="short-1", tenant="acme", compute_milli=500,
                                            gpu_memory_mib=4 * 1024, duration_s=1)])
    wait_for(lambda: job_states(pool, "alice").get("acme/short-1", {}).get("state") == "completed", 90,
             "the job completed", pool)
    assert pool.stats()["relay"]["relayed"] > 0
