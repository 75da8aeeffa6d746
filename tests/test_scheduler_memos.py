"""The scheduler's memos (#14 item 2's throughput) decide nothing: with every one of them turned off, the same inputs
give the same outputs, in the same order, over random fleets, quotas, tiers and arrival orders.

The memos: a job's standing (claims.standing_now, until its accounts' sums or a quota move), the quota's answer for
one account and shape (core.Scheduler._admit, until the ledger moves), a victim's quiet reason (core.Scheduler._quiet)
and a waiting job's last miss (core.Scheduler._still_unplaced: no node open to it changed since `place` found none).
Turning them off: the record fields read as empty and drop what is written to them, and the ledger's version reads
new on every look."""
from __future__ import annotations

import itertools
from contextlib import contextmanager

import pytest
from hypothesis import given, settings

from agents.scheduler import core
from agents.scheduler.holdings import JobRecord
from agents.scheduler.quota import Ledger
from schemas.events import PlaceJob, PreemptJob, Tier
from tests.test_claim_properties import drive, fleets, quotas, requests

MEMO_FIELDS = ("standing_memo", "quiet_memo", "miss_memo")


@contextmanager
def memos_off():
    mp = pytest.MonkeyPatch()
    for name in MEMO_FIELDS:
        mp.setattr(JobRecord, name, property(lambda self: (), lambda self, value: None), raising=True)
    fresh = itertools.count()
    mp.setattr(Ledger, "version", property(lambda self: next(fresh), lambda self, value: None), raising=False)
    try:
        yield
    finally:
        mp.undo()


def _both(fleet, quota, reqs):
    _, _, with_memos, _ = drive(fleet, quota, reqs)
    with memos_off():
        _, _, without, _ = drive(fleet, quota, reqs)
    return with_memos, without


@settings(max_examples=100, deadline=None)
@given(fleets, quotas, requests)
def test_the_memos_change_no_output(fleet, quota, reqs):
    with_memos, without = _both(fleet, quota, reqs)
    assert with_memos == without


def test_a_waiting_victim_is_answered_from_its_last_miss_and_nothing_changes(monkeypatch):
    """Four cards full of offline work; two inference jobs arrive and each stops one. While the second victim stops,
    the first waits in its quiet window: the card freed is kept for the second inference job, so the first victim's
    retry is answered from its last miss -- and the run says exactly what it says with no memo at all."""
    hits = []
    real = core.Scheduler._still_unplaced

    def spy(self, rec, exclude, barred):
        got = real(self, rec, exclude, barred)
        if got is not None:
            hits.append(rec.request.job_id)
        return got

    monkeypatch.setattr(core.Scheduler, "_still_unplaced", spy)
    reqs = [("b", Tier.OFFLINE, (1000, 70), 0)] * 4 + [("a", Tier.INFERENCE, (1000, 70), 0)] * 2
    with_memos, without = _both([1, 1, 1, 1], {}, reqs)
    assert with_memos == without
    preempts = [p.job_id for _, p in with_memos if isinstance(p, PreemptJob)]
    assert len(preempts) == 2
    assert set(hits) & set(preempts), hits  # a victim's retry came from its memo (the test is not vacuous)
    placed = [p.job_id for _, p in with_memos if isinstance(p, PlaceJob)]
    assert placed.count("j5") == placed.count("j6") == 1
