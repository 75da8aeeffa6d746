from schemas.events import (
    Assignment, GpuHealth, GpuSample, GpuTelemetry, NodeCordon, NodeHeartbeat, NodeLiveness, PlaceJob, ReleaseJob,
)
from streams.folds.node_view import evolve
from tests.builders import Clock, inventory


def fold(envs):
    v = None
    for e in envs:
        v = evolve(v, e)
    return v


def sample(uuid, **kw):
    return GpuSample(gpu_uuid=uuid, util_pct=0, mem_used_mib=0, mem_total_mib=1, **kw)


def test_inventory_gives_capacity_and_all_free():
    c = Clock()
    v = fold([c.env(inventory("n1", gpus=2), "n1/inventory")])
    free = v.card_free()
    assert [f.milli for f in free] == [1000, 1000]
    assert v.schedulable and v.free_cpu_memory() == (64000, 256 * 1024)


def test_placement_and_release_change_free_capacity():
    c = Clock()
    inv = inventory("n1", gpus=2)
    a = Assignment(gpu_uuid=inv.gpus[0].uuid, milli=300, memory_mib=1024)
    v = fold([c.env(inv, "n1/inventory"),
              c.env(PlaceJob(command_id="c1", job_id="j", tenant="t", node="n1", assignments=(a,), cpu_milli=1000,
                             memory_mib=2048), "scheduler")])
    assert v.card_free()[0].milli == 700 and v.card_free()[0].memory_mib == inv.gpus[0].memory_mib - 1024
    assert v.free_cpu_memory() == (63000, 256 * 1024 - 2048)
    v = evolve(v, c.env(ReleaseJob(command_id="c2", job_id="j", node="n1"), "scheduler"))
    assert v.card_free()[0].milli == 1000


def test_seven_mig_instances_are_never_a_whole_free_card():
    c = Clock()
    inv = inventory("n1", model="A100-40GB", gpus=1, mig=["1g.5gb"] * 7)
    v = fold([c.env(inv, "n1/inventory")])
    (card,) = v.card_free()
    assert card.mig and len(card.free_instances) == 7
    assert card.milli == 7 * (1000 // 7) < 1000  # slice accounting, not a whole card
    inst = card.free_instances[0]
    v = evolve(v, c.env(PlaceJob(command_id="c1", job_id="j", tenant="t", node="n1", assignments=(
        Assignment(gpu_uuid=inv.gpus[0].uuid, milli=142, memory_mib=5120, mig_profile="1g.5gb",
                   mig_uuid=inst.uuid),)), "scheduler"))
    assert len(v.card_free()[0].free_instances) == 6


def test_uncorrectable_ecc_removes_card_until_cleared():
    c = Clock()
    inv = inventory("n1", gpus=2)
    u = inv.gpus[1].uuid
    v = fold([c.env(inv, "n1/inventory"),
              c.env(GpuTelemetry(node="n1", samples=(sample(u, ecc_uncorrected=2),)), "n1/telemetry")])
    assert u in v.unhealthy and not v.card_free()[1].healthy
    # the error counter going back to 0 does not return it; only an explicit clear does
    v = evolve(v, c.env(GpuTelemetry(node="n1", samples=(sample(u),)), "n1/telemetry"))
    assert u in v.unhealthy
    v = evolve(v, c.env(GpuHealth(node="n1", gpu_uuid=u, healthy=True, reason="cleared"), "operator"))
    assert v.card_free()[1].healthy


def test_fatal_xid_removes_card_but_benign_xid_does_not():
    c = Clock()
    inv = inventory("n1", gpus=2)
    v = fold([c.env(inv, "n1/inventory"),
              c.env(GpuTelemetry(node="n1", samples=(sample(inv.gpus[0].uuid, xid_errors=(13,)),
                                                      sample(inv.gpus[1].uuid, xid_errors=(79,)))), "n1/telemetry")])
    assert set(v.unhealthy) == {inv.gpus[1].uuid} and "79" in v.unhealthy[inv.gpus[1].uuid]


def test_a_silence_and_a_cordon_make_node_unschedulable():
    c = Clock()
    v = fold([c.env(inventory("n1"), "n1/inventory"), c.env(NodeHeartbeat(node="n1"), "n1/telemetry")])
    v2 = evolve(v, c.env(NodeLiveness(node="n1", alive=False, last_heartbeat_ms=v.last_heartbeat_ms), "n1/liveness"))
    assert v2.alive is False
    v2b = evolve(v2, c.env(NodeHeartbeat(node="n1"), "n1/telemetry", dt=5))
    assert v2b.alive and v2b.schedulable
    assert not v2.schedulable
    v3 = evolve(v, c.env(NodeCordon(node="n1", cordoned=True), "operator"))
    assert not v3.schedulable


def test_duplicates_and_stale_sequence_numbers_change_nothing():
    c = Clock()
    e1 = c.env(inventory("n1"), "n1/inventory")
    e2 = c.env(NodeCordon(node="n1", cordoned=True), "op")
    v = fold([e1, e2])
    assert evolve(v, e2) is v and evolve(v, e1) is v


def test_other_nodes_records_are_ignored():
    c = Clock()
    v = fold([c.env(inventory("n1"), "n1/inventory")])
    assert evolve(v, c.env(NodeCordon(node="n2"), "op")) is v


def test_a_removed_node_stays_out_until_re_added_and_older_attempts_leave_newer_holdings():
    from schemas.events import NodeRemoved

    c = Clock()
    v = evolve(None, c.env(inventory("n1"), "n1/inventory"))
    v = evolve(v, c.env(NodeRemoved(node="n1"), "operator", dt=10))
    assert v.removed and not v.schedulable
    v = evolve(v, c.env(inventory("n1"), "n1/inventory", dt=10))  # it reports again: still out
    assert v.removed and not v.schedulable
    v = evolve(v, c.env(NodeRemoved(node="n1", removed=False), "operator", dt=10))
    assert not v.removed and v.schedulable
    a = (Assignment(gpu_uuid=v.inventory.gpus[0].uuid, milli=1000, memory_mib=1),)
    v = evolve(v, c.env(PlaceJob(command_id="c2", job_id="j", tenant="t", node="n1", assignments=a, attempt=2),
                        "scheduler"))
    v = evolve(v, c.env(ReleaseJob(command_id="c3", job_id="j", node="n1", attempt=1), "scheduler"))
    v = evolve(v, c.env(PlaceJob(command_id="c1", job_id="j", tenant="t", node="n1", assignments=a,
                                 attempt=1, cpu_milli=7), "scheduler"))
    assert "j" in v.allocations and v.allocations["j"].attempt == 2 and v.allocations["j"].cpu_milli == 0
    v = evolve(v, c.env(ReleaseJob(command_id="c4", job_id="j", node="n1", attempt=2), "scheduler"))
    assert "j" not in v.allocations


from dataclasses import replace as _fresh_copy  # noqa: E402

from hypothesis import given, settings, strategies as st  # noqa: E402

from schemas.events import ResizeJob  # noqa: E402


@settings(max_examples=300, deadline=None)
@given(steps=st.lists(st.tuples(st.sampled_from(["place", "release", "resize", "fault"]), st.integers(0, 4),
                                st.lists(st.tuples(st.integers(0, 3), st.integers(1, 1000), st.integers(1, 40000)),
                                         min_size=1, max_size=3),
                                st.one_of(st.none(), st.integers(1, 100)), st.integers(0, 3), st.booleans()),
                      max_size=25))
def test_a_placement_or_release_carries_the_free_cards_it_did_not_touch(steps):
    """The free cards and host room a placement or a release carries over from the view before it (node_view._carry)
    are what a fresh count of the new view says, whatever was placed, replaced, resized or released before."""
    c = Clock()
    inv = inventory("n1", gpus=4)
    v = evolve(None, c.env(inv, "n1/inventory"))
    for op, j, slices, duration, attempt, read in steps:
        if read:  # what the scheduler does with every view it makes: so the next one has something to carry
            v.card_free(), v.free_cpu_memory()
        job = f"j{j}"
        assignments = tuple(Assignment(gpu_uuid=inv.gpus[k].uuid, milli=m, memory_mib=mem) for k, m, mem in slices)
        if op == "place":
            p = PlaceJob(command_id=f"c{len(c.seqs)}", job_id=job, tenant="t", node="n1", assignments=assignments,
                         cpu_milli=500 * (j + 1), memory_mib=1024 * (j + 1), duration_s=duration, attempt=attempt)
        elif op == "release":
            p = ReleaseJob(command_id="r", job_id=job, node="n1", attempt=attempt)
        elif op == "resize":
            p = ResizeJob(command_id="z", job_id=job, node="n1", assignments=assignments, attempt=attempt)
        else:
            p = GpuHealth(node="n1", gpu_uuid=inv.gpus[j % 4].uuid, healthy=False, reason="test")
        v = evolve(v, c.env(p, "scheduler", dt=7))
        fresh = _fresh_copy(v)
        assert v.card_free() == fresh.card_free()
        assert v.free_cpu_memory() == fresh.free_cpu_memory()


def test_a_new_view_gets_the_fields_and_none_of_the_old_ones_derived_facts():
    """The fold's copy (`_with`) is `dataclasses.replace`: the same fields, the change applied, unknown fields
    refused -- and the old view's cached derived facts (free cards, fit summary) are not carried over by it."""
    import pytest as _pytest
    from dataclasses import replace as _replace

    from streams.folds import node_view as nv

    v = Clock().env(inventory("n0", "A100-80GB", gpus=2), "n0/inventory")
    v = nv.evolve(None, v)
    assert v.fit_summary.by_model["A100-80GB"][2] == 2 and "fit_summary" in v.__dict__
    w = nv._with(v, allocations={"j": nv.Held((Assignment(gpu_uuid=v.cards()[0].uuid, milli=1000,
                                                          memory_mib=81920),))})
    assert w == _replace(v, allocations=w.allocations)
    assert "fit_summary" not in w.__dict__ and w.fit_summary.by_model["A100-80GB"][2] == 1
    with _pytest.raises(TypeError):
        nv._with(v, bogus=1)
