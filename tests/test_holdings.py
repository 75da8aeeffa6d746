"""One write path (agents/scheduler/holdings.py): after every step of random scheduler runs (every tier and size,
quotas with borrowing, reservations, preemption and requeue, lost nodes, drains, card faults), every index the
holdings keep as commands and facts are applied -- node index, victim index, per-tier counts, pending/stopping/
running sets, the claim standings' sums, the training share's tally -- equals the one rebuilt from scratch from the
node views and the job records."""
from hypothesis import settings
from hypothesis.stateful import invariant

from agents.scheduler.holdings import HOLDING, rebuilt
from tests.test_scheduler_invariants import SchedulerMachine


class HoldingsMachine(SchedulerMachine):
    @invariant()
    def incremental_equals_rebuilt(self):
        h = self.s.h
        assert h.state() == rebuilt(h.nodes, h.jobs).state()

    @invariant()
    def records_and_views_agree(self):
        h = self.s.h
        for j, rec in h.jobs.items():
            if rec.state in HOLDING:
                assert rec.placement is not None and rec.placement is rec.parts[0], j
                for part in rec.parts:
                    assert j in h.nodes[part.node].allocations, (j, part.node)
            else:
                assert rec.placement is None and rec.parts == (), (j, rec.state)


HoldingsMachine.TestCase.settings = settings(max_examples=40, stateful_step_count=40, deadline=None)
TestHoldings = HoldingsMachine.TestCase


def test_rebuilt_of_nothing_is_empty():
    from agents.scheduler.holdings import Holdings

    assert rebuilt({}, {}).state() == Holdings().state()
