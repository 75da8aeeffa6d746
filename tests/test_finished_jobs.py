"""Finished jobs (#16, "recovery and audit that don't grow with history"; docs/scheduler.md, "Finished jobs"): once a
job has ended its JobRecord gives way to a compact `holdings.Ended`, forgotten `retain_ms` of log time after the last
record about it, so the state holds the live jobs in full and a bounded, time-limited remainder of the finished ones.

What must not change is held against `Keeping`, the scheduler as it was: every record kept, done ones included (a
done JobRecord answers every input as the scheduler always did). Written out:

- an identical `job.requested` again (a retry, a new record) -> nothing;
- a different request under the id -> one `job.rejected` `duplicate_job_id`, nothing else;
- the request's own record re-delivered (same source and seq) -> nothing (its source's dedupe entry is kept);
- a late `job.started` / `job.checkpointed` naming a command of the job -> one `cmd.release` (`Superseded`, naming
  that attempt: a node still running it is told to stop); naming none of its commands -> nothing;
- a late `job.completed` / `job.failed` / `job.stopped` naming a command of the job -> nothing; naming none -> the
  queue tried again, as a done record did; never a bill, a release, a ledger change;
- `job.cancelled` of a finished job -> the queue tried again, nothing of the job changes.

After the horizon the job is forgotten: a report about it is as about a job never seen, and a request for its id
older than the horizon (a duplicate of one forgotten, re-delivered late) is refused `stale_request` -- never run again.
"""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import rule

from agents import state_digest
from agents.scheduler.core import RETAIN_MS, Scheduler
from agents.scheduler.holdings import Ended
from schemas.envelope import envelope
from schemas.events import (
    JobCancelled, JobCheckpointed, JobCompleted, JobFailed, JobStarted, JobStopped, SchedulerTick,
)
from streams.edge import scheduler_snapshot as snapshot
from tests import test_scheduler_invariants as inv
from tests.builders import Clock, inventory, job, open_ledger
from tests.test_scheduler_snapshot import canonical, first_difference


class Keeping(Scheduler):
    """The reference: every job record kept for ever, done ones included (the scheduler before #16's Ended)."""

    def _bury(self) -> None:
        self.h.done_now.clear()


def dumps(outs):
    return [e.model_dump() for e in outs]


def finished(cls=Scheduler, **kw):
    """A pool of one node where job j was placed, started and completed: (scheduler, clock, its request, its place)."""
    c = Clock()
    s = cls(ledger=open_ledger(), **kw)
    s.step(c.env(inventory("n1", gpus=2), "n1/inventory"))
    req = c.env(job("j", compute=500), "in/alice/j")
    (place,) = [e.payload for e in s.step(req) if e.kind == "cmd.place"]
    s.step(c.env(JobStarted(job_id="j", node="n1", command_id=place.command_id), "n1/job/j", dt=10))
    s.step(c.env(JobCompleted(job_id="j", node="n1", command_id=place.command_id), "n1/job/j", dt=5000))
    return s, c, req, place


def test_a_finished_job_is_kept_as_a_compact_record():
    s, c, req, place = finished()
    assert "j" not in s.jobs and s.phase_of("j") == "done"
    e = s.ended["j"]
    assert isinstance(e, Ended) and e.attempt == 1 and e.commands == {place.command_id: 1}
    assert set(e.sources) == {"in/alice/j", "n1/job/j"} and e.until_ms == s.now_ms + RETAIN_MS
    assert s.applied["in/alice/j"] == 1 and s.applied["n1/job/j"] == 2  # dedupe kept while it is remembered


def late(kind, place, own=True):
    cid = place.command_id if own else "c999"
    return {"started": JobStarted(job_id="j", node="n1", command_id=cid),
            "checkpointed": JobCheckpointed(job_id="j", node="n1", command_id=cid, progress_ms=1, checkpoint="k"),
            "completed": JobCompleted(job_id="j", node="n1", command_id=cid),
            "failed": JobFailed(job_id="j", node="n1", command_id=cid, reason="oom"),
            "stopped": JobStopped(job_id="j", node="n1", command_id=cid, checkpoint="k"),
            "cancelled": JobCancelled(job_id="j")}[kind]


CASES = [("retry", None), ("different", None), ("redelivered", None), ("cancelled", None)] + [
    (k, own) for k in ("started", "checkpointed", "completed", "failed", "stopped") for own in (True, False)]


@pytest.mark.parametrize("case,own", CASES)
def test_inputs_about_a_finished_job_give_what_a_kept_record_gave(case, own):
    got = []
    for cls in (Scheduler, Keeping):
        s, c, req, place = finished(cls)
        bill = (dict(s.ledger.accounts), s.ledger.pool_used_milli)
        if case == "retry":
            env = c.env(job("j", compute=500), "in/alice/j", dt=100)
        elif case == "different":
            env = c.env(job("j", compute=1000), "in/alice/j", dt=100)
        elif case == "redelivered":
            env = req
        else:
            env = c.env(late(case, place, own), "n1/job/j" if case != "cancelled" else "in/alice/j", dt=100)
        out = s.step(env)
        tick = s.step(c.env(SchedulerTick(now_ms=c.now + 1000), "ticker", dt=1000))
        got.append((dumps(out), dumps(tick)))
        assert (dict(s.ledger.accounts), s.ledger.pool_used_milli) == bill  # nothing billed, charged or released
        assert not [o for o in out if o.kind in ("usage.accrued", "cmd.place", "quota.changed")]
        assert s.phase_of("j") == "done"  # nothing resurrected
    assert got[0] == got[1]
    out = got[0][0]
    kinds = [o["payload"]["kind"] for o in out]
    if case == "different":
        assert kinds == ["job.rejected"] and out[0]["payload"]["code"] == "duplicate_job_id"
    elif case in ("started", "checkpointed") and own:
        assert kinds == ["cmd.release"]
        why = out[0]["payload"]["reasons"][0]
        assert why["code"] == "Superseded" and out[0]["payload"]["attempt"] == 1
        assert "had already been ended by the scheduler (the job is done)" in why["message"]
    else:
        assert kinds == []


def test_a_finished_job_is_forgotten_after_the_horizon_and_a_late_duplicate_never_runs_again():
    retain = 60_000
    s, c, req, place = finished(retain_ms=retain)
    end = s.now_ms
    # a late report within the horizon is recognised, and keeps the job remembered from its own time
    c.now = end + retain - 1
    out = s.step(c.env(late("started", place), "n1/job/j"))
    assert [o.kind for o in out] == ["cmd.release"]
    last = s.now_ms
    assert s.ended["j"].until_ms == last + retain
    s.step(c.env(SchedulerTick(now_ms=last + retain - 1), "ticker", dt=retain - 1))
    assert "j" in s.ended  # not yet
    s.step(c.env(SchedulerTick(now_ms=last + retain), "ticker", dt=1))
    assert "j" not in s.ended and "j" not in s.jobs and s.phase_of("j") is None  # forgotten at last + retain
    assert "in/alice/j" not in s.applied and "n1/job/j" not in s.applied  # with its own sources' entries
    assert set(s.applied) == {"n1/inventory", "ticker"}
    # a late report now is as about a job never seen
    assert s.step(c.env(late("started", place), "n1/job/j", dt=1)) == []
    # the request re-delivered (same source, seq and event time): older than the horizon, so refused, not run
    out = s.step(req)
    assert [(o.kind, o.payload.code) for o in out] == [("job.rejected", "stale_request")]
    assert s.phase_of("j") is None
    # a new request under the id (made now) is a new job: ids may be used again once forgotten
    out = s.step(c.env(job("j", compute=250), "in/alice/j", dt=1))
    assert [o.kind for o in out if o.kind == "cmd.place"] == ["cmd.place"] and s.jobs["j"].attempt == 1


def test_without_a_horizon_finished_jobs_are_kept_compact_for_ever():
    s, c, req, place = finished(retain_ms=None)
    assert s.ended["j"].until_ms is None and not s.h.expiry
    c.now += 10 * RETAIN_MS
    s.step(c.env(SchedulerTick(now_ms=c.now), "ticker"))
    assert "j" in s.ended and s.step(req) == []  # the duplicate is still dropped
    assert [o.payload.code for o in s.step(c.env(job("j", compute=1000), "in/alice/j"))] == ["duplicate_job_id"]


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([250, 500, 1000, 2000]), st.integers(1, 30), st.integers(0, 3)),
                min_size=5, max_size=60), st.sampled_from([1, 5_000, 60_000]))
def test_the_state_holds_the_live_jobs_and_the_recently_finished(jobs, retain):
    """Jobs of random sizes and durations, started and completed by their node as placed: at every step the
    records held are exactly the live jobs (none done), the finished ones are kept compact and only within the
    horizon, and the dedupe entries are the shared sources' plus those of the jobs remembered."""
    c = Clock()
    s = Scheduler(ledger=open_ledger(), retain_ms=retain)
    for n in ("n1", "n2"):
        s.step(c.env(inventory(n, gpus=2), f"{n}/inventory"))
    due: list[tuple[int, int, object]] = []  # (time, order, report)
    k = 0

    def feed(env):
        nonlocal k
        for o in s.step(env):
            if o.kind == "cmd.place":
                p = o.payload
                k += 1
                due.append((c.now + 10, k, JobStarted(job_id=p.job_id, node=p.node, command_id=p.command_id)))
                due.append((c.now + 10 + dur[p.job_id], k, JobCompleted(job_id=p.job_id, node=p.node,
                                                                       command_id=p.command_id)))
        assert all(r.phase != "done" for r in s.jobs.values())
        assert set(s.jobs) == set(s.pending) | {j for j, r in s.jobs.items() if r.placement is not None}
        for j, e in s.ended.items():
            assert e.until_ms > s.now_ms and len(e.commands) <= 2 and len(e.sources) <= 3, (j, e)  # a gang: 2 nodes
        assert set(s.applied) <= {"n1/inventory", "n2/inventory", "ticker"} | {
            src for j in list(s.jobs) + list(s.ended) for src in (f"in/t1/{j}", f"n1/job/{j}", f"n2/job/{j}")}

    dur = {}
    for i, (compute, seconds, gap) in enumerate(jobs):
        dur[f"j{i}"] = seconds * 1000
        feed(c.env(job(f"j{i}", compute=compute), f"in/t1/j{i}", dt=gap * 1000))
        due.sort()
        while due and due[0][0] <= c.now:
            _, _, p = due.pop(0)
            feed(c.env(p, f"{p.node}/job/{p.job_id}"))
    while due:
        due.sort()
        t, _, p = due.pop(0)
        c.now = max(c.now, t)
        feed(c.env(p, f"{p.node}/job/{p.job_id}"))
    feed(c.env(SchedulerTick(now_ms=c.now + retain), "ticker", dt=retain))
    assert not s.jobs and not s.ended and not s.h.expiry and not s.pending
    assert set(s.applied) == {"n1/inventory", "n2/inventory", "ticker"}


def test_a_snapshot_of_a_state_with_finished_jobs_round_trips():
    s, c, req, place = finished()
    value = snapshot.dump(s, 7, s.now_ms)
    got = snapshot.load(value).state
    assert canonical(got) == canonical(s), first_difference(canonical(got), canonical(s))
    assert state_digest.digest(got) == state_digest.digest(s)
    assert got.ended["j"].fingerprint == s.ended["j"].fingerprint
    for env in (c.env(late("started", place), "n1/job/j", dt=1), c.env(job("j", compute=999), "in/alice/j"), req):
        assert dumps(got.step(env)) == dumps(s.step(env))


def test_a_snapshot_of_the_older_format_is_not_used():
    s, *_ = finished()
    doc = snapshot.orjson.loads(snapshot.dump(s, 7, s.now_ms))
    doc["v"] = 1
    assert snapshot.FORMAT == 2 and snapshot.load(snapshot.orjson.dumps(doc)) is None


KINDS = ("started", "checkpointed", "completed", "failed", "stopped", "cancelled", "retry", "different", "redelivered")


class FinishedJobsMachine(inv.SchedulerMachine):
    """The invariants' machine with the scheduler and `Keeping` side by side, fed the same inputs -- and inputs about
    its finished jobs (late and repeated reports naming their commands or none, retries, other requests under their
    ids, cancels, records re-delivered): every output the same, and the same live records."""

    def __init__(self):
        self.ref = Keeping(**inv.config())
        self.requests = {}
        super().__init__()

    def feed(self, env):
        if env.kind == "job.requested":
            self.requests.setdefault(env.payload.job_id, env)
        out = super().feed(env)
        assert dumps(self.ref.step(env)) == dumps(out)
        assert not self.ref.h.ended  # the reference keeps its records
        return out

    @rule(data=st.data(), times=st.integers(1, 4))
    def about_finished_jobs(self, data, times):
        for _ in range(times):
            self.about_a_finished_job(data, data.draw(st.sampled_from(KINDS)), data.draw(st.booleans()),
                                      data.draw(st.sampled_from(inv.NODES)))

    @rule(data=st.data())
    def runs_complete(self, data):
        """Time passes and the agents complete some of their started runs (as agent_acts does), so that jobs finish
        within a run of the machine."""
        self.tick()
        for name, a in sorted(self.agents.items()):
            if a.lost:
                continue
            for j, r in sorted(a.runs.items()):
                if a.runs.get(j) is r and r.started and data.draw(st.booleans()):  # not stopped meanwhile
                    rec = self.s.jobs[j]
                    was = rec.phase
                    del a.runs[j]
                    self.report(a, JobCompleted(job_id=j, node=name, command_id=r.command_id), dt=500)
                    if was == "running" and rec.phase == "done":
                        self.completed[(j, r.attempt)] = self.clock.now

    def about_a_finished_job(self, data, kind, own, node):
        done = sorted(j for j in self.s.ended if j in self.requests)  # not reservations' holds: nobody asks
        if not done:
            return
        j = data.draw(st.sampled_from(done))
        e = self.s.ended[j]
        cid = data.draw(st.sampled_from(sorted(e.commands))) if own and e.commands else "c-never-sent"
        req = self.requests[j]
        if kind in ("retry", "different", "redelivered"):
            if kind == "redelivered":
                self.feed(req)
                return
            p = req.payload if kind == "retry" else req.payload.model_copy(
                update={"compute_milli": req.payload.compute_milli + 1})
            self.feed(self.clock.env(p, req.source, dt=1))
            return
        p = {"started": lambda: JobStarted(job_id=j, node=node, command_id=cid),
             "checkpointed": lambda: JobCheckpointed(job_id=j, node=node, command_id=cid, progress_ms=1,
                                                     checkpoint="late"),
             "completed": lambda: JobCompleted(job_id=j, node=node, command_id=cid),
             "failed": lambda: JobFailed(job_id=j, node=node, command_id=cid, reason="late"),
             "stopped": lambda: JobStopped(job_id=j, node=node, command_id=cid, checkpoint="late"),
             "cancelled": lambda: JobCancelled(job_id=j)}[kind]()
        self.feed(self.clock.env(p, f"{node}/job/{j}" if kind != "cancelled" else "cli/cancel", dt=1))

    def teardown(self):
        live = {j: r for j, r in self.ref.jobs.items() if r.phase != "done"}
        assert set(live) == set(self.s.jobs)
        a, b = canonical(live), canonical(dict(self.s.jobs))
        assert a == b, first_difference(a, b)
        assert set(self.s.ended) == {j for j, r in self.ref.jobs.items() if r.phase == "done"}
        assert self.clock.now - 1_000_000 < RETAIN_MS  # nothing forgotten: the comparison is exact
        super().teardown()


FinishedJobsMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=60, deadline=None)
TestFinishedJobsAnswerAsKeptRecords = FinishedJobsMachine.TestCase


def test_the_stale_guard_is_about_unknown_ids_only():
    """A request older than the horizon for an id still remembered is answered as any (a retry: nothing)."""
    s, c, req, place = finished()
    old = envelope(req.payload, source="in/alice/j", seq=99, time_ms=req.event_time_ms)
    c.now = req.event_time_ms + RETAIN_MS - 1  # the job is remembered until its end + RETAIN_MS
    assert s.step(old, c.now + 10) == []
