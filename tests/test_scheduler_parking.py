"""Parked jobs (core.Scheduler._park, _wake; #14 item 2's throughput) decide nothing: a waiting victim in its quiet
window that no node took leaves the cycle's queue until something may give it room, and every decision -- each
command, each quota and usage event, in order -- is the one the scheduler makes when it tries every waiting job on
every cycle. Only when a waiting job is told why it waits (`job.pending`) may differ: a parked job keeps the reasons
of its last attempt until it is tried again.

The runs: random fleets, quotas with and without borrowing, tiers and sizes; node agents that start what is placed,
stop what is preempted (after a delay), complete some jobs after a while, and a user who cancels some; log time moves
on so that quiet windows and protections end during the run, and ticks bring the timed full cycle."""
from __future__ import annotations

from collections import deque

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from agents.node.fleet import make_node
from agents.scheduler import core
from agents.scheduler.core import Scheduler
from agents.scheduler.holdings import Holdings
from agents.scheduler.preemption import PreemptionConfig
from agents.scheduler.quota import Ledger
from schemas.events import (
    JobCancelled, JobCompleted, JobPending, JobStarted, JobStopped, PlaceJob, PreemptJob, QuotaSet, SchedulerTick,
    Tier,
)
from tests.builders import Clock, job

TIERS = (Tier.INFERENCE, Tier.ONLINE_TRAINING, Tier.OFFLINE)
SIZES = ((250, 10), (500, 20), (1000, 40), (1000, 70), (2000, 140))  # (milli-CU, GiB)

fleets = st.lists(st.sampled_from((1, 2, 4)), min_size=1, max_size=4)
quotas = st.dictionaries(st.sampled_from(("a", "b", "c")),
                         st.tuples(st.sampled_from((0, 500, 1000, 2000, 4000)), st.sampled_from((100, 150, 200))),
                         max_size=3)
# (tenant, tier, size, gap before it in steps, what happens to it: run on / complete after k steps / cancel after k)
def _requests(tiers):
    return st.tuples(st.sampled_from(("a", "b", "c")), st.sampled_from(tiers), st.sampled_from(SIZES),
                     st.integers(0, 3), st.sampled_from(("run", "complete", "cancel")), st.integers(1, 12))


# offline work first (the fleet fills), then work of every tier (which stops some of it: victims that wait)
requests = st.builds(lambda a, b: a + b, st.lists(_requests((Tier.OFFLINE,)), min_size=1, max_size=10),
                     st.lists(_requests(TIERS), min_size=1, max_size=10))


def drive(fleet, quota, reqs, tick_every: int = 5) -> tuple[list, int]:
    """Step the scheduler through the requests and its agents' answers; returns (every output payload in order,
    how many times a job was parked)."""
    clock = Clock()
    s = Scheduler(ledger=Ledger(default_quota_milli=None), usage_tick_ms=10**12,
                  preemption=PreemptionConfig(victim_quiet_ms=20_000, protect_ms=40_000, window_ms=60_000))
    parks = 0
    real = s._park

    def count(rec, standing):
        nonlocal parks
        before = len(s.parked)
        real(rec, standing)
        parks += len(s.parked) > before
    s._park = count
    for i, gpus in enumerate(fleet):
        s.step(clock.env(make_node(f"n{i}", "A100-80GB", gpus), f"n{i}/inventory"))
    for tenant, (milli, pct) in sorted(quota.items()):
        s.step(clock.env(QuotaSet(tenant=tenant, gpu_milli=milli, overcommit_pct=pct), "operator"))
    log: list = []
    todo = deque(reqs)
    answers: deque = deque()
    later: list[tuple[int, object, str]] = []  # (step due, payload, source): completions and cancellations
    fate: dict[str, tuple[str, int]] = {}
    n = steps = 0
    while todo or answers or later:
        steps += 1
        assert steps < 4000, "no convergence"
        due = [x for x in later if x[0] <= steps]
        if due:
            later.remove(due[0])
            env = clock.env(due[0][1], due[0][2], dt=700)
        elif todo and (not answers or todo[0][3] == 0):
            tenant, tier, (milli, gib), _, what, k = todo.popleft()
            n += 1
            fate[f"j{n}"] = (what, k)
            env = clock.env(job(f"j{n}", tenant, milli, gib, tier=tier, duration=None, checkpoint_interval_s=60),
                            f"cli/j{n}", dt=1000)
            if what == "cancel":
                later.append((steps + k, JobCancelled(job_id=f"j{n}"), f"cli/j{n}/cancel"))
        elif answers:
            if todo:
                t = todo[0]
                todo[0] = t[:3] + (t[3] - 1,) + t[4:]
            payload, src, dt = answers.popleft()
            env = clock.env(payload, src, dt=dt)
        else:
            later.sort(key=lambda x: x[0])
            steps = later[0][0] - 1
            continue
        outs = s.step(env)
        if steps % tick_every == 0:
            outs += s.step(clock.env(SchedulerTick(now_ms=clock.now + 1500), "tick", dt=1500))
        for o in outs:
            p = o.payload
            log.append(p)
            if isinstance(p, PlaceJob):
                answers.append((JobStarted(job_id=p.job_id, node=p.node, command_id=p.command_id),
                                f"{p.node}/job/{p.job_id}", 10))
                what, k = fate.get(p.job_id, ("run", 0))
                if what == "complete" and p.gang_index == 0:
                    later.append((steps + k, JobCompleted(job_id=p.job_id, node=p.node, command_id=p.command_id),
                                  f"{p.node}/job/{p.job_id}"))
            elif isinstance(p, PreemptJob):
                rec = s.jobs[p.job_id]
                place_cmd = next(part.command_id for part in rec.parts if part.node == p.node)
                answers.append((JobStopped(job_id=p.job_id, node=p.node, command_id=place_cmd,
                                           checkpoint=f"ckpt:{p.job_id}"), f"{p.node}/job/{p.job_id}", 500))
    for _ in range(3):  # past every quiet window and protection: what is left to do is done
        clock.now += 60_000
        log += [o.payload for o in s.step(clock.env(SchedulerTick(now_ms=clock.now), "tick"))]
    return log, parks


def decisions(log: list) -> list:
    """Every output but a waiting job's reasons (what parking may tell later), as data, each command id replaced by
    its rank among them: command ids number the scheduler's outputs (core.Scheduler._command_id), so a reason told
    once more or once less moves the ids of the commands after it."""
    ids: dict[str, str] = {}
    out = []
    for p in log:
        if isinstance(p, JobPending):
            continue
        d = p.model_dump()
        if "command_id" in d:
            d["command_id"] = ids.setdefault(d["command_id"], f"#{len(ids)}")
        out.append(d)
    return out


def _both(fleet, quota, reqs, monkeypatch):
    parked, parks = drive(fleet, quota, reqs)
    with monkeypatch.context() as mp:
        mp.setattr(core.Scheduler, "_park", lambda self, rec, standing: None)
        plain, none = drive(fleet, quota, reqs)
    assert none == 0
    return parked, plain, parks


@settings(max_examples=400, deadline=None)
@given(fleets, quotas, requests)
def test_parking_changes_no_decision(fleet, quota, reqs):
    with pytest.MonkeyPatch.context() as mp:
        parked, plain, parks = _both(fleet, quota, reqs, mp)
    event(f"parked: {min(parks, 3)}+")
    assert decisions(parked) == decisions(plain)


def test_a_parked_victim_is_woken_by_capacity_that_opens_for_it(monkeypatch):
    """Two nodes of one card full of offline work; an inference job stops one offline job, whose victim waits parked
    (the card went to the inference job). Then the other offline job completes: its card opens, and the parked
    victim takes it -- as it would if it were tried on every cycle."""
    reqs = [("b", Tier.OFFLINE, (1000, 70), 0, "run", 1), ("b", Tier.OFFLINE, (1000, 70), 0, "complete", 12),
            ("a", Tier.INFERENCE, (1000, 70), 0, "run", 1)]
    parked, plain, parks = _both([1, 1], {}, reqs, monkeypatch)
    assert parks >= 1  # the victim was parked: the test is not vacuous
    assert decisions(parked) == decisions(plain)
    placed = [p.job_id for p in parked if isinstance(p, PlaceJob)]
    preempted = [p.job_id for p in parked if isinstance(p, PreemptJob)]
    assert len(preempted) == 1 and placed.count(preempted[0]) == 2, (placed, preempted)


def test_a_parked_victim_is_tried_in_the_cycle_in_which_the_claim_on_its_node_ends(monkeypatch):
    """Two cards full of offline shares (seven quarters, a half waits); an inference job stops two quarters and is
    cancelled. The waiting half takes over the stopping work (nominated on the node), the first victim to stop waits
    parked behind that claim; when the second stops, the half takes its room in a cycle -- and the claim ends there,
    so the first victim (ahead of the second in the queue) must be tried in that same cycle, as a cycle over the whole
    queue tries it, and takes the room left before the second victim does (found by the property above)."""
    o = Tier.OFFLINE
    reqs = [("a", o, (250, 10), 0, "run", 1)] * 7 + [("a", o, (500, 20), 0, "run", 1),
                                                      ("a", Tier.INFERENCE, (500, 20), 0, "cancel", 1)]
    parked, plain, parks = _both([2], {}, reqs, monkeypatch)
    assert parks >= 1
    assert decisions(parked) == decisions(plain)
    stopped = [p.job_id for p in parked if isinstance(p, PreemptJob)]
    placed_again = [p.job_id for p in parked if isinstance(p, PlaceJob) and p.resume_from]
    assert stopped and placed_again[:1] == stopped[:1], (stopped, placed_again)



@settings(max_examples=300, deadline=None)
@given(fleets, quotas, requests)
def test_a_tenants_parked_places_are_settled_before_a_cycle_moves_its_sums(fleet, quota, reqs):
    """A parked job woken in a cycle is tried where the queue's order at the cycle's start puts it: its place is
    worked out when it is woken (`_woken`), from its tenant's sums as they were at the cycle's start should the cycle
    have changed them first (core.Scheduler._settle marks their versions just before the first change). Held here:
    no tenant's sums change in a cycle (Holdings._sum, their one writer) before that mark; after every change, every
    parked job's place as `_parked_key` reads it is the one it had at the cycle's start (not only the few woken);
    and a job woken in a cycle gets that place."""
    changes, woken_in_cycle, moved = _places_as_at_the_cycles_start(fleet, quota, reqs)
    event(f"sums moved with parked jobs: {min(len(changes), 3)}+")
    event(f"woken in a cycle: {min(len(woken_in_cycle), 1)}+")
    event(f"a parked job's standing moved in a cycle: {min(len(moved), 1)}+")


def test_a_parked_job_whose_standing_a_cycle_moved_keeps_its_place_at_the_cycles_start():
    """One of the runs above (~1 in 300) where a cycle's change to a tenant's sums moves a parked job's standing
    (b's offline job, parked, stands beyond b's quota once b's online training takes the cards ahead of it): its
    place as `_parked_key` reads it stays the cycle's start's -- read from the sums' versions then
    (claims.standing_at), not from the sums now."""
    o, t, i = Tier.OFFLINE, Tier.ONLINE_TRAINING, Tier.INFERENCE
    reqs = [("b", o, (500, 20), 2, "run", 7), ("a", i, (500, 20), 1, "complete", 4),
            ("b", t, (2000, 140), 3, "cancel", 4), ("a", t, (2000, 140), 1, "run", 5),
            ("b", t, (250, 10), 2, "complete", 6), ("c", i, (1000, 70), 3, "cancel", 11),
            ("b", t, (1000, 70), 0, "cancel", 4), ("b", o, (1000, 70), 2, "complete", 12),
            ("c", i, (1000, 40), 0, "cancel", 9), ("b", i, (250, 10), 3, "cancel", 5),
            ("c", i, (500, 20), 3, "complete", 5)]
    changes, _, moved = _places_as_at_the_cycles_start([2], {"b": (1000, 200)}, reqs)
    assert moved, "no parked job's standing moved in a cycle: the run no longer tests what it is for"


def _places_as_at_the_cycles_start(fleet, quota, reqs):
    """Drive the run, checking that every parked job's place read in a full cycle is the one it had at the cycle's
    start. Returns (tenants whose sums moved with parked jobs, jobs woken in a cycle, parked jobs whose standing
    now differs from the cycle's start's)."""
    real_places, real_woken, real_sum = core.Scheduler._park_places, core.Scheduler._woken, Holdings._sum
    changes, woken_in_cycle, moved = [], [], []

    def places(self):
        self.h.scheduler_under_test = self
        self.ref_keys = {j: self._queue_key(self.jobs[j]) for j in self.parked
                         if j in self.jobs and self.jobs[j].phase == "pending"}
        real_places(self)

    def woken(self):
        got = real_woken(self)
        for key, rec in got:
            assert key == self.ref_keys[rec.request.job_id], rec.request.job_id
            woken_in_cycle.append(rec.request.job_id)
        return got

    def sums(self, rec, *a):
        s = getattr(self, "scheduler_under_test", None)
        t = rec.request.tenant
        if s is not None and s.h.parked_of.get(t):
            assert t not in s._unsettled, f"{t}'s sums moved in a cycle before its parked jobs' places were settled"
            changes.append(t)
        real_sum(self, rec, *a)
        if s is not None and (s._unsettled or s._settled_at):  # in a full cycle, after its start
            for j in s.h.parked_of.get(t, ()):
                if j in s.ref_keys:
                    assert s._parked_key(s.jobs[j]) == s.ref_keys[j], j
                    if s._queue_key(s.jobs[j]) != s.ref_keys[j]:
                        moved.append(j)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(core.Scheduler, "_park_places", places)
        mp.setattr(core.Scheduler, "_woken", woken)
        mp.setattr(Holdings, "_sum", sums)
        drive(fleet, quota, reqs)
    return changes, woken_in_cycle, moved
