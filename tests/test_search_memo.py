"""The claim search's shortcuts (#14 item 2's throughput) decide nothing: with them off (`Scheduler.search_memo`
False: the reference -- `plan_over` over every candidate node's victims, `plan_gang` without kept rooms and without
its bound), the same inputs give the same outputs, in the same order, over random fleets (racks, node sizes), quotas,
tiers, sizes up to multi-node gangs, and arrival orders.

The shortcuts: what `Scheduler._plan_nodes` keeps per node view object (the node's Room for a job shape, whether the
job fits with a set of jobs gone, the choice among victims in one disruption order), the rooms `plan_gang` keeps the
same way, the candidates' standings read from their memos in one pass, and `plan_gang` passing over a group whose
plan cannot be cheaper than the best one (`_gang_fewest`)."""
from __future__ import annotations

from contextlib import contextmanager

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import invariant

from agents.scheduler import core
from agents.scheduler.claims import Search
from agents.scheduler.core import Scheduler
from agents.scheduler.placement import allowed_models
from agents.scheduler.preemption import Shape, plan_gang
from schemas.events import PreemptJob, Tier
from tests.test_claim_properties import drive as claim_drive
from tests.test_scheduler_invariants import SchedulerMachine

TIERS = (Tier.INFERENCE, Tier.ONLINE_TRAINING, Tier.OFFLINE)
# (milli-CU, GiB): shares, a card, two, four and eight cards (a multi-node gang on the smaller nodes)
SIZES = ((250, 10), (500, 20), (1000, 40), (1000, 70), (2000, 140), (4000, 280), (8000, 560))
fleets = st.lists(st.tuples(st.sampled_from((1, 2, 4, 8)), st.integers(0, 2)), min_size=1, max_size=6)  # (GPUs, rack)
quotas = st.dictionaries(st.sampled_from(("a", "b", "c")),
                         st.tuples(st.sampled_from((0, 500, 1000, 2000, 4000, 8000)), st.sampled_from((100, 150, 200))),
                         max_size=3)
requests = st.lists(st.tuples(st.sampled_from(("a", "b", "c")), st.sampled_from(TIERS), st.sampled_from(SIZES),
                              st.sampled_from(("p", "q")), st.integers(0, 3)),
                    min_size=1, max_size=16)


@st.composite
def scenarios(draw, fleets=fleets, requests=requests):
    """A fleet, offline work that fills it about (one size per node, enough for its cards), then the requests."""
    fleet = draw(fleets)
    fill = []
    for gpus, _ in fleet:
        milli, gib = draw(st.sampled_from([s for s in SIZES if s[0] <= gpus * 1000]))
        for _ in range(gpus * 1000 // milli):
            fill.append((draw(st.sampled_from(("a", "b", "c"))), Tier.OFFLINE, (milli, gib),
                         draw(st.sampled_from(("p", "q"))), 0))
    return fleet, fill + draw(requests)


@contextmanager
def search_memo_off():
    mp = pytest.MonkeyPatch()
    mp.setattr(Scheduler, "search_memo", False)
    try:
        yield
    finally:
        mp.undo()


def drive(fleet, quota, reqs, stop_delay_ms=500):
    """tests/test_claim_properties.drive (racks and projects given): the outputs in order with their log time."""
    return claim_drive(fleet, quota, reqs, stop_delay_ms)[2]


# multi-node gangs: small nodes over a few racks, and requests of four and eight cards among the rest
small_fleets = st.lists(st.tuples(st.sampled_from((1, 2, 4)), st.integers(0, 3)), min_size=2, max_size=8)
gang_requests = st.lists(st.tuples(st.sampled_from(("a", "b", "c")), st.sampled_from(TIERS[:2]),
                                   st.sampled_from(SIZES[-2:] * 2 + SIZES), st.sampled_from(("p", "q")),
                                   st.integers(0, 3)), min_size=1, max_size=10)


@settings(max_examples=200, deadline=None)
@given(scenarios(), quotas)
def test_the_search_shortcuts_change_no_output(scenario, quota):
    _same_with_and_without(*scenario, quota)


@settings(max_examples=150, deadline=None)
@given(scenarios(), quotas)
def test_the_search_shortcuts_change_no_output_when_few_nodes_are_compared(scenario, quota):
    """The same with two workable nodes compared instead of 16 (`candidate_nodes`): on these small fleets, where the
    search stops counting nodes -- and which of the nodes counted have their plan worked out, cheapest bound first
    (core._plan_bound) -- then matters as 16 does on a large fleet."""
    from agents.scheduler.preemption import PreemptionConfig

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(core, "PreemptionConfig", lambda: PreemptionConfig(candidate_nodes=2))
        assert Scheduler().preemption.candidate_nodes == 2
        _same_with_and_without(*scenario, quota)


def test_a_node_where_the_job_fits_with_nobody_stopped_yields_no_plan():
    """A hypothesis example the property above found now and then (a flaky CI risk): inference requests barred from
    a node claimed by a nominated job ahead of them fit there with nobody stopped. The walk chose that node with an
    empty plan ("waiting for 0 job(s) to checkpoint and stop on "), the kept search counted it as no cheaper than a
    one-victim plan and stopped a job elsewhere. Stopping nobody is no plan, in both."""
    O, I = Tier.OFFLINE, Tier.INFERENCE
    reqs = ([("a", O, (1000, 40), "p", 0)] * 4 + [("a", O, (500, 20), "p", 0)] * 8
            + [("a", I, (250, 10), "p", g) for g in (0, 0, 2, 3)] + [("a", I, (2000, 140), "p", 3)]
            + [("a", I, (250, 10), "p", g) for g in (0, 1, 2)] + [("a", I, (500, 20), "p", 3)])
    with_memo = drive([(4, 0), (4, 0)], {}, reqs)
    with search_memo_off():
        without = drive([(4, 0), (4, 0)], {}, reqs)
    assert with_memo == without
    waits = [p for _, p in with_memo if p.kind == "job.pending" and p.reasons[0].code == "Preempting"]
    assert waits and all(p.reasons[0].data["victims"] for p in waits)


@settings(max_examples=150, deadline=None)
@given(scenarios(small_fleets, gang_requests), quotas)
def test_the_gang_search_shortcuts_change_no_output(scenario, quota):
    _same_with_and_without(*scenario, quota)


def _same_with_and_without(fleet, reqs, quota):
    calls = {"plan_nodes": 0, "gang": 0}
    real_nodes, real_gang = Scheduler._plan_nodes, core.plan_gang

    def count_nodes(self, *a, **k):
        calls["plan_nodes"] += 1
        return real_nodes(self, *a, **k)

    def count_gang(*a, **k):
        calls["gang"] += 1
        return real_gang(*a, **k)

    mp = pytest.MonkeyPatch()
    mp.setattr(Scheduler, "_plan_nodes", count_nodes)
    mp.setattr(core, "plan_gang", count_gang)
    try:
        with_memo = drive(fleet, quota, reqs)
    finally:
        mp.undo()
    with search_memo_off():
        without = drive(fleet, quota, reqs)
    event(f"searches: {min(calls['plan_nodes'], 3)}+, multi-node gang searches: {min(calls['gang'], 2)}+")
    event(f"preemptions: {min(sum(isinstance(p, PreemptJob) for _, p in with_memo), 3)}+")
    assert with_memo == without


class SearchMemoMachine(SchedulerMachine):
    """After every step of random scheduler runs (tests/test_scheduler_invariants.py: every tier and size, quotas
    with borrowing, reservations, MIG cards, preemption and requeue, lost nodes), each pending job's claim search
    gives the same plan -- node, victims, their rules, standings and progress lost -- with what the scheduler kept
    from earlier searches as without (the reference walk), and the same multi-node gang plan."""

    @invariant()
    def the_search_plans_what_the_walk_plans(self):
        s = self.s
        for rec in list(s.jobs.values()):
            if rec.phase != "pending":
                continue
            search = Search(s.h, s.ledger, rec)
            r = rec.request
            keys = [search.key(m) for m in s.index.models if not r.constraints.models or m in r.constraints.models]
            strongest, weakest = max(keys, default=search.key()), min(keys, default=search.key())
            if not search.groups(strongest):
                continue
            shape = Shape(r)
            never = s._never_admitted_on(rec)  # card models its quota never admits it on: both pass them over
            assert s._plan_nodes(search, r, shape, strongest, never) == \
                s._plan_walk(search, r, shape, strongest, never)
            if r.gang:
                def gang(memo):
                    return plan_gang(r, s.nodes, s.index, allowed_models(s.index, r), s._victims(search, weakest),
                                     lambda chosen, v: search.valid(chosen, v, weakest),
                                     s._view_facts if memo else None, memo, s.preemption.candidate_nodes)
                assert gang(True) == gang(False)


SearchMemoMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
TestSearchMemo = SearchMemoMachine.TestCase
