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
            if rec.phase in HOLDING:
                assert rec.placement is not None and rec.placement is rec.parts[0], j
                for part in rec.parts:
                    assert j in h.nodes[part.node].allocations, (j, part.node)
            else:
                assert rec.placement is None and rec.parts == (), (j, rec.phase)


HoldingsMachine.TestCase.settings = settings(max_examples=40, stateful_step_count=40, deadline=None)
TestHoldings = HoldingsMachine.TestCase


def test_rebuilt_of_nothing_is_empty():
    from agents.scheduler.holdings import Holdings

    assert rebuilt({}, {}).state() == Holdings().state()


from hypothesis import given, strategies as st  # noqa: E402

# holders arriving in bursts far apart (a tenant's first job of a group after ~100,000 others; a window that slides
# past its old holders as they leave), and what each holds
_changes = st.lists(st.tuples(st.integers(0, 3), st.integers(0, 200_000), st.integers(1, 4000), st.integers(1, 80_000),
                              st.booleans()), max_size=60)


def _change(s, held: dict, change) -> None:
    """One holder arrives (its group and arrival, what it holds) or, `leave`, one held leaves: on the sums and on
    `held`, the plain record they are checked against."""
    from agents.scheduler.holdings import GROUPS

    g, arrival, milli, memory, leave = change
    g %= GROUPS
    if leave and held:
        (g, arrival), (milli, memory) = sorted(held.items())[arrival % len(held)]
        s.add(g, arrival, -milli, -memory)
        del held[(g, arrival)]
    elif (g, arrival) not in held:
        s.add(g, arrival, milli, memory)
        held[(g, arrival)] = (milli, memory)


@given(_changes, st.lists(st.integers(-1, 200_002), min_size=1, max_size=20))
@settings(max_examples=300, deadline=None)
def test_the_claim_sums_say_what_the_holders_ahead_hold(changes, asks):
    """Sums.ahead_of (a Fenwick tree over a window of arrivals) against a plain sum over the holders: the claim
    standings' arithmetic, whatever the arrivals' spread and however the window moved."""
    from agents.scheduler.holdings import GROUPS, Sums

    s = Sums()
    held: dict[tuple[int, int], tuple[int, int]] = {}
    for change in changes:
        _change(s, held, change)
        for a in asks:
            for gg in range(GROUPS):
                want = [0, 0]
                for (hg, ha), (hm, hmem) in held.items():
                    if hg > gg or hg == gg and ha < a:
                        want[0] += hm
                        want[1] += hmem
                assert s.ahead_of(gg, a) == tuple(want), (gg, a)
        t = [x for x in s._trees if x is not None]
        assert all(len(tm) <= max(1024, 2 * 200_002 + 2) for _, tm, _ in t)


@given(_changes, st.integers(0, 60), st.lists(st.tuples(st.integers(0, 5), st.integers(-1, 200_002)), min_size=1,
                                              max_size=10))
@settings(max_examples=200, deadline=None)
def test_the_sums_say_what_the_holders_ahead_held_at_a_pinned_version(changes, cut, asks):
    """Sums.ahead_at: what ahead_of said at an earlier version, however many changes came since (more than the log
    keeps unpinned: the pin keeps them) -- what a parked job's place at a cycle's start is read from
    (core.Scheduler._parked_key, claims.standing_at)."""
    from agents.scheduler.holdings import GROUPS, SUMS_LOG, Sums

    s = Sums()
    held: dict[tuple[int, int], tuple[int, int]] = {}
    then, version = None, None
    for i, change in enumerate(changes * (1 + SUMS_LOG // max(1, len(changes)))):
        if i == cut:
            version = s.pin = s.version
            then = {(gg % GROUPS, a): s.ahead_of(gg % GROUPS, a) for gg, a in asks}
        _change(s, held, change)
    if then is None:
        return
    assert {k: s.ahead_at(version, *k) for k in then} == then
    assert s.log_from <= version and len(s.log) >= s.version - version
