"""Liveness that a busy or paused worker cannot fool (issue #31 item 3), on the real broker, worker and simulated
fleet: a silence the node view disproves never takes a node from the scheduler, a silence answered brings it back
to the scheduler by itself (no restart), and a worker paused (SIGSTOP 5 s) under a tenant's burst, then killed
(kill -9) and restarted, declares no node dead and interrupts no job. Every wait is on a condition; nothing here is
timed."""
from __future__ import annotations

import os
import signal
import time

import pytest

from agents.client import Client
from infra.security import SERVICE
from schemas.envelope import decode, encode, envelope
from schemas.events import Constraints, JobRequested, NodeLiveness
from schemas.topics import DECISIONS, JOB_EVENTS, NODE_CONTROL
from tests.live import produce, quotas, read_topic, wait_for

pytestmark = pytest.mark.broker


def _fleet(stack, text: str) -> str:
    path = stack.home / "fleet.yaml"
    path.write_text(text)
    return str(path)


def _view(stack, node: str) -> dict | None:
    """The worker's node view of `node` (its changelog-backed table, as the service reads it)."""
    views = Client(stack.config, SERVICE).api("/internal/views")["nodes"]
    return next((v for v in views if v["node"] == node), None)


def _readiness(stack) -> tuple[list[str], list[str]]:
    """(nodes `gpupool node list` shows down, nodes the scheduler holds not ready)."""
    down = sorted(n["node"] for n in stack.client().api("/api/nodes")["nodes"] if n["state"] == "down")
    return down, stack.stats()["scheduler"]["not_ready"]


def _silence(stack, node: str, last_heartbeat_ms: int, seq: int) -> None:
    """A `node.liveness` silent, as the worker's liveness judge writes it (the service's record on node control)."""
    env = envelope(NodeLiveness(node=node, alive=False, last_heartbeat_ms=last_heartbeat_ms),
                   source=f"{node}/liveness", seq=seq, time_ms=time.time_ns() // 1_000_000)
    produce(stack, NODE_CONTROL.name, [encode(env)], keys=[node.encode()])


def _facts(stack, topic: str, kind: str) -> list:
    out = []
    for rec in read_topic(stack, topic):
        try:
            env = decode(rec.value)
        except Exception:  # noqa: BLE001 - not ours to judge here
            continue
        if env.kind == kind:
            out.append(env)
    return out


def _running(stack, user: str, ids: set[str]) -> dict | None:
    from tests.live import job_states

    states = job_states(stack, user)
    return states if all(states.get(j, {}).get("state") == "running" and states[j].get("nodes") for j in ids) \
        else None


def _completed(stack, job: str, what: str) -> None:
    """Wait for `job` to complete; if it does not, say what the liveness did meanwhile."""
    try:
        wait_for(lambda: any(e.payload.job_id == job for e in _facts(stack, JOB_EVENTS.name, "job.completed")), 300,
                 what, stack)
    except AssertionError as exc:
        silences = [(e.payload.node, e.payload.last_heartbeat_ms)
                    for e in _facts(stack, NODE_CONTROL.name, "node.liveness") if not e.payload.alive]
        raise AssertionError(f"silences declared: {silences}; readiness (node list down, scheduler not ready): "
                             f"{_readiness(stack)}\n{exc}") from None


def _pause(pid: int, seconds: float) -> None:
    os.kill(pid, signal.SIGSTOP)
    try:
        time.sleep(seconds)
    finally:
        os.kill(pid, signal.SIGCONT)


def test_the_scheduler_holds_a_node_ready_exactly_when_its_view_does_after_a_false_and_a_true_silence(stack):
    """1. A false silence: the judge's "silent after heartbeat H" is read back after a newer heartbeat was folded
    (the race a burst makes likely). The node view stays alive; so must the scheduler: a job placed afterwards runs,
    and nothing is interrupted. Before the fix the silence went to the scheduler, which refused the node while
    `node list` showed it ready, until the node agent was restarted.
    2. A silence the view takes (numbered, as a restarted worker's verdict can be, above the telemetry that answers
    it): the node's next heartbeat brings its view back, and the "alive again" must reach the scheduler by itself,
    numbered above the silence it answers -- the job interrupted by it runs again on the node, and the scheduler's
    readiness equals the view's. Before the fix the "alive again" was numbered by the telemetry's log time, dropped
    as older than the silence, and the scheduler refused the node for good."""
    stack.start_worker()
    stack.start_agent(_fleet(stack, "nodes:\n  - {name: na, model: A100-80GB, gpus: 2}\n"))
    stack.add_user("alice", "tenant", "acme")
    quotas(stack, "acme")
    view = wait_for(lambda: (v := _view(stack, "na")) and v["inventory"] and
                    v["last_heartbeat_ms"] > v["inventory_ms"] + 1 and v, 60, "na heard after its inventory", stack)
    wait_for(lambda: _readiness(stack) == ([], []) and stack.stats()["scheduler"]["nodes"] == 1, 60,
             "na ready to both", stack)

    # 1. silent after a heartbeat older than the view's latest: the view stays alive
    _silence(stack, "na", view["inventory_ms"] + 1, seq=time.time_ns() // 1000)
    wait_for(lambda: (v := _view(stack, "na")) and v["silent_since_ms"] == view["inventory_ms"] + 1, 60,
             "the silence folded", stack)
    assert _readiness(stack)[0] == []  # node list: ready
    stack.client("alice").send([JobRequested(job_id="j1", tenant="acme", compute_milli=1000, gpu_memory_mib=8192,
                                             duration_s=3600)])
    wait_for(lambda: _running(stack, "alice", {"acme/j1"}), 60, "j1 placed on na and running", stack)
    assert _readiness(stack) == ([], [])
    assert _facts(stack, DECISIONS.name, "job.interrupted") == []

    # 2. a silence the view takes, numbered above the telemetry that will answer it
    hb = _view(stack, "na")["last_heartbeat_ms"]
    seq = (time.time_ns() // 1_000_000 + 600_000) * 1000
    _silence(stack, "na", hb + 15_000, seq=seq)
    wait_for(lambda: [e for e in _facts(stack, DECISIONS.name, "job.interrupted")
                      if e.payload.job_id == "acme/j1"], 60, "j1 interrupted by the node's loss", stack)
    # the node's next heartbeats answer it: the view is alive again, and the scheduler with it, by itself
    wait_for(lambda: _readiness(stack) == ([], []), 60, "the scheduler's readiness back to the view's", stack)
    wait_for(lambda: _running(stack, "alice", {"acme/j1"}), 90, "j1 running again on na", stack)
    alive_again = [e for e in _facts(stack, NODE_CONTROL.name, "node.liveness") if e.payload.alive and e.seq > seq]
    assert alive_again and all(e.payload.last_heartbeat_ms > hb + 15_000 for e in alive_again)


def test_a_paused_busy_or_killed_worker_declares_no_node_dead(stack):
    """Four nodes, every card busy with a long job (900 of its 1000 milli: room for the other tenant's probes); a
    tenant's burst of 2,000 requests; the worker stopped for 5 s (SIGSTOP) while it digests them, and four times
    more for 2.5 s; then killed (kill -9) and started again. No node is declared silent, no job
    is interrupted, the long jobs run on where they were, and another tenant's job still runs."""
    # the whole burst through the gateway's door (its rate window would refuse most of it): this test is about the
    # load the worker digests, not the door (tests/test_tenant_isolation_live.py)
    stack.extra_env["GPUPOOL_RATE_PER_WINDOW"] = "1000000"
    stack.start_worker()
    stack.start_agent(_fleet(stack, "nodes:\n  - {prefix: n, count: 4, model: A100-80GB, gpus: 2}\n"))
    stack.add_user("alice", "tenant", "acme")
    stack.add_user("bob", "tenant", "bulk")
    quotas(stack, "acme", "bulk")
    wait_for(lambda: stack.stats()["scheduler"]["nodes"] == 4, 60, "four nodes", stack)
    longs = {f"acme/long{i}" for i in range(8)}
    stack.client("alice").send([JobRequested(job_id=f"long{i}", tenant="acme", compute_milli=900,
                                             gpu_memory_mib=8192, duration_s=3600) for i in range(8)])
    before = wait_for(lambda: _running(stack, "alice", longs), 120, "eight long jobs running", stack)
    assert {before[j]["nodes"] for j in longs} == {"n-0", "n-1", "n-2", "n-3"}  # every node holds work

    # the burst: 2,000 requests no node can take (a model the pool lacks), each admitted, judged and refused
    stack.client("bob").send([JobRequested(job_id=f"b{i}", tenant="bulk", compute_milli=1000, gpu_memory_mib=1024,
                                           duration_s=1, constraints=Constraints(models=("T4",)))
                              for i in range(2000)])
    worker = stack.procs["worker"]
    _pause(worker.pid, 5.0)  # paused while the burst waits in its inbox
    for _ in range(4):
        # shorter pauses, past the recovery window of the last (10 s of log time): long enough for the nodes'
        # heartbeats to be two intervals old, short enough for the probes of the log's clock to show no gap (no
        # recovery window): what the judge sees then is only what it read
        time.sleep(11)
        _pause(worker.pid, 2.5)
    wait_for(lambda: stack.stats()["gateway"].get("accepted", 0) >= 2000 + 8, 300, "the burst admitted", stack)
    stack.client("alice").send([JobRequested(job_id="probe1", tenant="acme", compute_milli=100, gpu_memory_mib=1024,
                                             duration_s=1)])
    _completed(stack, "acme/probe1", "probe1 run after the burst")

    stack.stop_process("worker", sig=signal.SIGKILL)
    stack.start_worker()
    stack.client("alice").send([JobRequested(job_id="probe2", tenant="acme", compute_milli=100, gpu_memory_mib=1024,
                                             duration_s=1)])
    _completed(stack, "acme/probe2", "probe2 run after the crash")

    silences = [e for e in _facts(stack, NODE_CONTROL.name, "node.liveness") if not e.payload.alive]
    assert silences == []
    assert _facts(stack, DECISIONS.name, "job.interrupted") == []
    after = _running(stack, "alice", longs)
    assert after and {j: after[j]["nodes"] for j in longs} == {j: before[j]["nodes"] for j in longs}
    assert _readiness(stack) == ([], [])
