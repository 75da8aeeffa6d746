"""The node relay's decisions and node admission, as pure functions (streams/folds/node_relay.py,
streams/folds/node_view.py): what a node principal may report, and when a node it reports may take work. The same on
the live broker and worker: tests/test_node_identity.py."""
from __future__ import annotations

from agents.node.fleet import make_node
from agents.scheduler.placement import _f_schedulable
from schemas.envelope import decode, encode, envelope
from schemas.events import (
    Assignment, GpuSample, GpuTelemetry, JobCompleted, JobRequested, MigrateJob, NodeAdmitted, PlaceJob,
    QuotaSet,
)
from streams.folds import node_view
from streams.folds.gateway import Principal
from streams.folds.node_relay import Placements, admission, check

A = Principal("node-a", "node", nodes=("a",))
FLEET = Principal("node-fleet", "node", nodes=("a", "b"), auto_admit=True)


def raw(payload, source: str, seq: int = 1, t: int = 1_000) -> bytes:
    return encode(envelope(payload, source=source, seq=seq, time_ms=t))


def test_a_node_reports_its_own_nodes_only():
    tel = raw(GpuTelemetry(node="a", samples=(GpuSample(gpu_uuid="g", util_pct=1, mem_used_mib=1,
                                                         mem_total_mib=2),)), "a/telemetry")
    ok = check(A, "node-a", tel)
    assert ok.env is not None and ok.raw == tel and ok.code == ""  # relayed as its own bytes
    inv = make_node("a", "A100-80GB", 2)
    stamped = check(A, "node-a", raw(inv, "a/inventory"))
    assert decode(stamped.raw).actor == "node-a" and decode(stamped.raw).payload == inv
    # another node's report, or its own node under another node's source
    assert check(A, "node-a", raw(inv.model_copy(update={"node": "ghost-000"}), "ghost-000/inventory")).code \
        == "not_your_node"
    assert check(A, "node-a", raw(inv, "b/inventory")).code == "not_your_node"
    done = JobCompleted(job_id="t/j", node="b", command_id="c1")
    assert check(A, "node-a", raw(done, "b/job/t/j")).code == "not_your_node"
    assert check(FLEET, "node-fleet", raw(done, "b/job/t/j")).job_check == ("t/j", "b")  # the fleet's: checked next


def test_what_is_not_a_nodes_to_say_is_refused():
    assert check(A, "node-a", raw(QuotaSet(tenant="t", gpu_milli=1), "a/x")).code == "forbidden"
    assert check(A, "node-a", raw(NodeAdmitted(node="a"), "a/x")).code == "forbidden"  # no node admits itself
    assert check(None, "ghost", raw(make_node("a", "A100-80GB", 1), "a/inventory")).code == "unknown_principal"
    tenant = Principal("alice", "tenant", "acme")
    assert check(tenant, "alice", raw(make_node("a", "A100-80GB", 1), "a/inventory")).code == "unknown_principal"
    assert check(A, "node-a", b"not json").code == "malformed_json"


def test_a_job_is_a_nodes_only_where_the_scheduler_placed_it():
    places = Placements()
    a = Assignment(gpu_uuid="g", milli=1000, memory_mib=1)
    places.fold(envelope(PlaceJob(command_id="c1", job_id="t/j", tenant="t", node="a", assignments=(a,)),
                         source="scheduler", seq=1, time_ms=1))
    assert places.placed("t/j", "a") and not places.placed("t/j", "b") and not places.placed("t/k", "a")
    places.fold(envelope(MigrateJob(command_id="c2", job_id="t/j", from_node="a", to_node="b", assignments=(a,)),
                         source="scheduler", seq=2, time_ms=2))
    assert places.placed("t/j", "a") and places.placed("t/j", "b")


def test_auto_admission_is_the_principals_and_stated_once():
    inv = check(FLEET, "node-fleet", raw(make_node("a", "A100-80GB", 1), "a/inventory")).env
    fact = admission(FLEET, inv, 5_000)
    assert fact.payload == NodeAdmitted(node="a", admitted=True, reason=fact.payload.reason)
    assert (fact.source, fact.seq) == ("admission/a", 1)
    assert admission(A, check(A, "node-a", raw(make_node("a", "A100-80GB", 1), "a/inventory")).env, 5_000) is None


def _fold(*envs):
    view = None
    for env in envs:
        view = node_view.evolve(view, env)
    return view


def test_a_relayed_node_takes_work_only_once_admitted_in_any_order():
    inv = make_node("a", "A100-80GB", 2)
    legacy = envelope(inv, source="a/inventory", seq=1, time_ms=1_000)
    relayed = envelope(inv, source="a/inventory", seq=1, time_ms=1_000, actor="node-a")
    admit = envelope(NodeAdmitted(node="a"), source="in/admin/a", seq=7, time_ms=2_000)
    revoke = envelope(NodeAdmitted(node="a", admitted=False), source="in/admin/a", seq=8, time_ms=3_000)
    job = JobRequested(job_id="t/j", tenant="t", compute_milli=100, gpu_memory_mib=10)
    assert _fold(legacy).schedulable  # a log from before node identity replays as it did
    held = _fold(relayed)
    assert not held.schedulable and _f_schedulable(held, job) == "NodeNotAdmitted"
    assert _fold(relayed, admit).schedulable and _fold(admit, relayed).schedulable
    assert not _fold(relayed, admit, revoke).schedulable and not _fold(revoke, relayed, admit).schedulable
    # a later inventory (the node restarted) leaves the decision as it was
    again = envelope(inv, source="a/inventory", seq=2, time_ms=4_000, actor="node-a")
    assert _fold(relayed, admit, again).schedulable


def test_a_simulated_fleet_gets_a_principal_a_node_and_a_big_one_one_principal(tmp_path):
    from infra import principals, security

    small = principals.fleet_credentials(tmp_path, ["node-000", "node-001"])
    assert [(c.name, c.nodes, c.auto_admit) for c in small] == [("node-node-000", ("node-000",), True),
                                                               ("node-node-001", ("node-001",), True)]
    security.save(tmp_path, small[0])
    assert principals.fleet_credentials(tmp_path, ["node-000"])[0] == small[0]  # stored ones are kept
    many = [f"n{i}" for i in range(principals.FLEET_PRINCIPALS_MAX + 1)]
    (big,) = principals.fleet_credentials(tmp_path, many)
    assert big.nodes == tuple(many) and big.name.startswith("node-fleet-")
    (other,) = principals.fleet_credentials(tmp_path, [f"m{i}" for i in range(len(many))])
    assert other.name != big.name  # two big fleets of one stack keep their own nodes
