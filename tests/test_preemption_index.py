"""The victim index against what it stands for: after every step of random scheduler runs (every tier and size,
quotas with borrowing, reservations, preemption and requeue), the incrementally kept index equals one rebuilt from
the node views, every node where someone may be stopped for a pending job is among the nodes it names, and it names
them in the scheduler's node order (the order the walk over every node used, so plans and tie-breaks stay the same).
The inherited teardown replays the inputs into a fresh scheduler that never syncs between steps: the same outputs
show the lazy sync does not change decisions."""
from hypothesis import settings
from hypothesis.stateful import invariant

from agents.scheduler.victims import VictimIndex, rebuilt
from schemas.events import TIER_RANK
from tests.test_scheduler_invariants import SchedulerMachine


class VictimIndexMachine(SchedulerMachine):
    @invariant()
    def index_is_the_rebuilt_index(self):
        s = self.s
        s.victim_index.sync(s.nodes, s.jobs)
        assert s.victim_index.state() == rebuilt(s.nodes, s.jobs).state()
        assert not s.victim_index.dirty

    @invariant()
    def index_names_every_node_with_a_victim_in_node_order(self):
        s = self.s
        order = list(s.nodes)
        for rec in list(s.jobs.values()):
            if rec.state != "pending":
                continue
            for within_quota in (False, True):
                named = list(s._victim_nodes(rec, within_quota))
                assert named == [n for n in order if n in set(named)]
                with_victims = [n for n in order if s._victims_on(s.nodes[n], rec, within_quota)]
                assert set(with_victims) <= set(named), (rec.request.job_id, within_quota)
                # and the index is tight: a node it names holds lower-tier or borrowed work of another tenant
                r = rec.request
                for n in named:
                    assert any(TIER_RANK[o.request.tier] > TIER_RANK[r.tier] or (
                        within_quota and o.request.tenant != r.tenant and
                        (o.placement is None or o.placement.borrowed))
                        for o in (s.jobs[j] for j in s.nodes[n].allocations) if o.hold is None)


def test_index_built_by_hand_matches_marks():
    """Views the scheduler never marked (set by hand) are picked up by a full read on the next sync."""
    idx = VictimIndex()
    idx.sync({}, {})
    assert idx.state() == ({}, {}, {})


VictimIndexMachine.TestCase.settings = settings(max_examples=40, stateful_step_count=40, deadline=None)
TestVictimIndex = VictimIndexMachine.TestCase
