"""Admission's early verdict (admission._never_fits: most requests fit one card, or one node, of the first node kinds
read) says what the reading of every kind says (admission._verdict), for random fleets and requests: the shortcut
returns None only where the full reading would, and otherwise hands over to it."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from agents.node.fleet import make_node
from agents.scheduler.admission import Fleet, _never_fits, _verdict
from schemas.events import Constraints, JobRequested, Tier

MODELS = ("A100-80GB", "H100-80GB", "T4", "A10")
nodes = st.lists(st.tuples(st.sampled_from(MODELS), st.sampled_from((1, 2, 4, 8)),
                           st.sampled_from((8_000, 32_000, 64_000)), st.sampled_from((32, 128, 512)),
                           st.sampled_from(("rack-0", "rack-1")), st.sampled_from(("dc-0", "dc-1")),
                           st.sampled_from(("535.0", "550.54.15"))), min_size=1, max_size=6)
requests = st.builds(
    lambda compute, gib, cpu, mem_gib, gang, tier, models, spread, dc, driver: JobRequested(
        job_id="j", tenant="t", compute_milli=compute, gpu_memory_mib=gib * 1024, cpu_milli=cpu,
        memory_mib=mem_gib * 1024, gang=gang, tier=tier, constraints=Constraints(
            models=models, max_spread=spread, datacenter=dc, min_driver=driver)),
    st.sampled_from((250, 1000, 3000, 8000, 20_000, 70_000)), st.sampled_from((10, 40, 80, 300, 700)),
    st.sampled_from((1000, 16_000, 40_000, 100_000)), st.sampled_from((1, 100, 400)), st.booleans(),
    st.sampled_from((Tier.OFFLINE, Tier.INFERENCE)), st.sampled_from(((), ("T4",), ("A100-80GB", "A10"))),
    st.sampled_from(("node", "rack", "datacenter", "any")), st.sampled_from((None, "dc-1")),
    st.sampled_from((None, "550.0")))


@settings(max_examples=300, deadline=None)
@given(nodes, requests)
def test_the_early_verdict_is_the_full_one(spec, job):
    fleet = Fleet()
    for i, (m, n, cpu, mem, rack, dc, driver) in enumerate(spec):
        fleet.update(f"n{i}", make_node(f"n{i}", m, n, cpu_milli=cpu, memory_mib=mem * 1024, rack=rack,
                                        datacenter=dc, driver=driver), 0)
    kinds = list(fleet.kinds.values())
    assert _never_fits(job, kinds) == _verdict(job, kinds)


def test_a_mig_slice_on_a_pool_without_a_card_in_mig_mode_never_fits():
    """isolation mig on a pool whose cards are all out of MIG mode is rejected at once (NoMigCard), like any request
    no node could hold; one card in MIG mode anywhere, of a model the request allows, makes it possible."""
    job = JobRequested(job_id="j", tenant="t", compute_milli=100, gpu_memory_mib=5 * 1024, isolation="mig")
    plain = Fleet()
    for i, m in enumerate(("A100-80GB", "H100-80GB", "T4")):
        plain.update(f"n{i}", make_node(f"n{i}", m, 4), 0)
    (why,) = plain.never_fits(job)
    assert why.code == "NoMigCard" and "3 nodes" in why.message
    assert plain.never_fits(job.model_copy(update={"isolation": None})) is None  # a share would do
    plain.update("mig", make_node("mig", "A100-80GB", 1, mig=["1g.10gb"]), 0)
    assert plain.never_fits(job) is None
    only_t4 = job.model_copy(update={"constraints": Constraints(models=("T4",))})
    assert plain.never_fits(only_t4)[0].code == "NoMigCard"  # the MIG card is not one the request allows
