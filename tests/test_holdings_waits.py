"""The scheduler's bookkeeping of waiting jobs on the one write path (#34 item 2): parking, nominations and the
claim charges (what preemption freed for whom) change only by `Holdings.apply` of a typed change (`Park` ..
`ExpireFreed`), and what is derived from each -- the parked jobs by closed nodes and by tenant, the nominations
dict, the nodes kept for each job -- equals the one rebuilt from scratch from its facts, after every step of random
scheduler runs (the invariants' machine: preemption, quiet windows, requeues, lost nodes) and after every random
sequence of changes applied to bare holdings."""
from __future__ import annotations

from hypothesis import given, settings, strategies as st
from hypothesis.stateful import invariant

from agents.scheduler.holdings import (
    ChargeFreed, ExpireFreed, Holdings, JobRecord, Nominate, Park, RechargeFreed, Reclose, UnchargeFreed, Unpark,
    UnparkAll, Woke, rebuilt,
)
from schemas.events import Tier
from tests.builders import job
from tests.test_scheduler_invariants import SchedulerMachine

JOBS = tuple(f"j{i}" for i in range(6))
NODES = tuple(f"n{i}" for i in range(5))


def _rebuilt_waits(h: Holdings) -> tuple:
    return rebuilt(h.nodes, h.jobs, h.parked, h.freed_for).waits_state()


class WaitsMachine(SchedulerMachine):
    """The scheduler invariants' runs, checked after every step."""

    @invariant()
    def parking_nominations_and_charges_equal_rebuilt(self):
        h = self.s.h
        assert h.waits_state() == _rebuilt_waits(h)

    @invariant()
    def every_nomination_is_a_live_record(self):
        h = self.s.h
        for j, rec in h.nominations.items():
            assert h.jobs.get(j) is rec and rec.nominated is not None, j

    @invariant()
    def every_charge_names_its_owner(self):
        h = self.s.h
        for n, (_, _, j) in h.freed_for.items():
            assert n in h.freed_by[j], (n, j)


WaitsMachine.TestCase.settings = settings(max_examples=40, stateful_step_count=40, deadline=None)
TestWaits = WaitsMachine.TestCase


def _holdings() -> Holdings:
    h = Holdings()
    for i, j in enumerate(JOBS):
        h.add_job(JobRecord(request=job(j, tenant=f"t{i % 3}"), arrival=i + 1))
    return h


_closed = st.frozensets(st.sampled_from(NODES), max_size=3)
_park = st.builds(lambda j, c, t, cy, u: Park(j, f"t{JOBS.index(j) % 3}", c, t, cy, u),
                  st.sampled_from(JOBS), _closed, st.sampled_from(list(Tier)), st.integers(0, 9),
                  st.integers(0, 100))
_parking = st.one_of(_park, st.builds(Unpark, st.sampled_from(JOBS)), st.just(UnparkAll()), st.just(Woke()),
                     st.tuples(_closed, _closed))


@given(st.lists(_parking, max_size=40))
@settings(max_examples=300, deadline=None)
def test_parking_rebuilt_equals_incremental(changes):
    h = _holdings()
    for c in changes:
        if isinstance(c, Park) and c.job_id in h.parked:
            h.apply(Unpark(c.job_id))  # the scheduler parks a job only from the queue (not parked)
        if isinstance(c, tuple) and not isinstance(c, (Park, Unpark, UnparkAll, Woke)):
            closed, extra = c  # Reclose: the jobs parked closed to `closed` widen to `closed | extra`
            if closed not in h.parked_by:
                continue
            c = Reclose(closed, closed | extra)
            if c.wider != c.closed and c.wider in h.parked_by:
                continue  # two groups are never merged: `_wake` widens a group only to nodes claimed by others
        h.apply(c)
        assert h.waits_state() == _rebuilt_waits(h)
        assert all(h.parked[j][3] == h.jobs[j].request.tenant for j in h.parked)
        assert {j for _, j in h.park_until} >= set(h.parked)


_nominate = st.builds(lambda j, on, node, victims, claim: Nominate(j, (node, victims) if on else None, claim),
                      st.sampled_from(JOBS), st.booleans(), st.sampled_from(NODES),
                      st.tuples(st.sampled_from(JOBS)), st.tuples(st.sampled_from(NODES)))


@given(st.lists(_nominate, max_size=40))
@settings(max_examples=300, deadline=None)
def test_nominations_rebuilt_equals_incremental(changes):
    h = _holdings()
    for c in changes:
        before = h.jobs[c.job_id].claim
        version, claimed = h.nominations_version, h.claimed_all()
        h.apply(c)
        assert h.waits_state() == _rebuilt_waits(h)
        assert h.nominations_version == version + 1
        assert set(before) <= h.unclosed  # what it claimed before may open to parked jobs
        assert h.claimed_all() == frozenset(n for r in h.jobs.values() if r.nominated for n in r.claim)
        assert claimed is not None
        h.apply(Woke())


_key = st.tuples(st.booleans(), st.integers(0, 2), st.booleans())  # claims.Claim's shape: (within, tier, reserved)
_charges = st.one_of(
    st.builds(lambda j, ns, k, now, d: ChargeFreed(j, ns, k, now, now + d), st.sampled_from(JOBS),
              st.lists(st.sampled_from(NODES), max_size=3, unique=True).map(tuple), _key, st.integers(0, 50),
              st.integers(1, 50)),
    st.builds(RechargeFreed, st.sampled_from(JOBS), st.integers(0, 100)),
    st.builds(UnchargeFreed, st.sampled_from(JOBS)),
    st.builds(ExpireFreed, st.integers(0, 100)))


@given(st.lists(_charges, max_size=40))
@settings(max_examples=300, deadline=None)
def test_claim_charges_rebuilt_equals_incremental(changes):
    """Including the plain rule each change states: a charge keeps a node's stronger unexpired claim, an uncharge
    frees only the nodes still kept for that job, an expiry drops exactly the charges whose time is up; the barred
    nodes (a memo) always read what `freed_for` says."""
    h = _holdings()
    now = 0
    for c in changes:
        if isinstance(c, (ChargeFreed, ExpireFreed)):
            now = max(now, c.now_ms)
            c = c._replace(now_ms=now) if isinstance(c, ExpireFreed) else \
                ChargeFreed(c.job_id, c.nodes, c.key, now, now + (c.until - c.now_ms))
        before = dict(h.freed_for)
        h.apply(c)
        assert h.waits_state() == _rebuilt_waits(h)
        if isinstance(c, ChargeFreed):  # what the job's last charge kept goes first (a plan made again)
            for n in c.nodes:
                old = before.get(n)
                old = None if old is not None and old[2] == c.job_id else old
                keep = old is not None and old[1] > now and old[0] > c.key
                assert h.freed_for[n] == (old[0] if keep else c.key, c.until, c.job_id)
        elif isinstance(c, UnchargeFreed):
            assert not any(f[2] == c.job_id for f in h.freed_for.values())
            assert {n: f for n, f in before.items() if f[2] != c.job_id} == h.freed_for
        elif isinstance(c, ExpireFreed) and h.barred_until <= now:
            assert all(f[1] > now for f in h.freed_for.values())
        for mine in [(False, 0, False), (True, 2, True), (True, 1, False)]:
            assert h.barred(mine) == frozenset(n for n, f in h.freed_for.items() if mine <= f[0])
