"""Retries with back-off and per-tier grace periods in the scheduler (docs/jobs.md, "Exit reasons and retries", "Stops
and grace periods"): the pure Scheduler fed events, the replay the audit runs, and properties over random runs."""
from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agents.audit_compare import compare_outputs, replay_records
from agents.audit_log import Recorded
from agents.scheduler.core import DEFAULT_GRACE_S, Scheduler, live_config
from agents.scheduler.quota import open_ledger
from schemas.envelope import encode
from schemas.events import (
    JobCancelled, JobCheckpointed, JobCompleted, JobFailed, JobStarted, NodeCordon, QuotaSet, SchedulerTick, Tier,
)
from schemas.topics import COMMANDS, DECISIONS, LEDGER
from streams.folds.exits import BACKOFF_CAP_MS, backoff_ms
from tests.builders import Clock, inventory, job

T0 = 1_767_000_000_000
J = "t/j"
SRC = f"n1/job/{J}"


def _places(out):
    return [o.payload for o in out if o.kind == "cmd.place"]


def _setup(retries: int = 2, **kw):
    c = Clock(T0)
    s = Scheduler(ledger=open_ledger(), **kw)
    s.step(c.env(inventory("n1", gpus=1), "n1/inventory"))
    (p,) = _places(s.step(c.env(job(J, "t", 1000, 10, retries=retries), "cli/j")))
    return c, s, p


def _fail(c, s, p, dt=1000, **kw):
    kw = {"reason": "loss is NaN", "code": "ExitCode", "exit_code": 1, **kw}
    return s.step(c.env(JobFailed(job_id=J, node=p.node, command_id=p.command_id, attempt=p.attempt, **kw), SRC, dt=dt))


def _start(c, s, p, dt=100):
    return s.step(c.env(JobStarted(job_id=J, node=p.node, command_id=p.command_id), SRC, dt=dt))


def _tick(c, s, dt):
    return s.step(c.env(SchedulerTick(now_ms=c.now + dt), "ticker", dt=dt))


def test_backoff_doubles_from_ten_seconds_and_stops_at_five_minutes():
    assert [backoff_ms(n) for n in range(1, 9)] == [10_000, 20_000, 40_000, 80_000, 160_000, 300_000, 300_000,
                                                     300_000]
    assert backoff_ms(10_000) == BACKOFF_CAP_MS and backoff_ms(0) == 0


def test_a_failed_run_with_a_retry_left_waits_its_back_off_in_log_time_and_resumes_from_its_checkpoint():
    c, s, p = _setup(retries=2)
    _start(c, s, p)
    s.step(c.env(JobCheckpointed(job_id=J, node="n1", progress_ms=4000, checkpoint="ckpt-A",
                                 command_id=p.command_id), SRC, dt=4000))
    out = _fail(c, s, p, dt=1000)
    failed_at = c.now
    kinds = [o.kind for o in out]
    assert "cmd.release" in kinds and not _places(out) and s.phase_of(J) == "pending"
    release = next(o.payload for o in out if o.kind == "cmd.release")
    assert release.reasons[0].code == "Failed" and release.attempt == 1
    (pending,) = [o.payload for o in out if o.kind == "job.pending"]
    (why,) = pending.reasons
    assert (why.code, why.plugin) == ("BackOff", "Retry")
    assert why.message == (f"run 1 of 3 failed (exit code 1: loss is NaN); retrying from ckpt-A at "
                           f"{failed_at + 10_000} ms")
    assert why.data == {"failures": 1, "retries": 2, "attempt": 1, "retry_at_ms": failed_at + 10_000,
                        "backoff_ms": 10_000, "exit": "ExitCode", "exit_code": 1}
    # billed from its start to its failure, once
    (usage,) = [o.payload for o in out if o.kind == "usage.accrued"]
    assert (usage.start_ms, usage.end_ms, usage.attempt) == (failed_at - 5000, failed_at, 1)
    # not before the back-off ends (log time), whatever else happens: a tick, a free node
    assert not _places(_tick(c, s, 9_999))
    (again,) = _places(_tick(c, s, 1))
    assert (again.attempt, again.resume_from) == (2, "ckpt-A")
    # the second failure waits twice as long; the message says what it resumes from
    _start(c, s, again)
    out = _fail(c, s, again, dt=2000, code="Signal", exit_code=None, signal=9, reason="")
    (why,) = next(o.payload for o in out if o.kind == "job.pending").reasons
    assert why.message.startswith("run 2 of 3 failed (killed by signal 9 (SIGKILL)); retrying from ckpt-A at ")
    assert why.data["backoff_ms"] == 20_000 and why.data["signal"] == 9 and "exit_code" not in why.data
    assert not _places(_tick(c, s, 19_999)) and _places(_tick(c, s, 1))


def test_retries_spent_end_the_job_failed_and_it_is_never_placed_again():
    c, s, p = _setup(retries=1)
    _start(c, s, p)
    _fail(c, s, p)
    (p2,) = _places(_tick(c, s, 10_000))
    _start(c, s, p2)
    out = _fail(c, s, p2, code="OOMKilled", exit_code=None)
    assert s.phase_of(J) == "done"
    assert [o.payload.reasons[0].code for o in out if o.kind == "cmd.release"] == ["Failed"]
    assert not [o for o in out if o.kind == "job.pending"]
    for _ in range(5):
        assert not _places(_tick(c, s, 300_000))


def test_without_retries_a_failure_ends_the_job_as_it_always_did():
    c, s, p = _setup(retries=0)
    _start(c, s, p)
    out = s.step(c.env(JobFailed(job_id=J, node="n1", command_id=p.command_id, reason="exit code 1"), SRC, dt=500))
    assert s.phase_of(J) == "done" and not [o for o in out if o.kind == "job.pending"]
    assert not _places(_tick(c, s, 60_000))


def test_a_run_that_failed_before_it_started_is_not_billed_and_is_retried():
    c, s, p = _setup(retries=1)
    out = _fail(c, s, p, code="ImageNotFound", exit_code=None, reason="localhost/nope:1 is not on n1")
    assert not [o for o in out if o.kind == "usage.accrued"]
    (why,) = next(o.payload for o in out if o.kind == "job.pending").reasons
    assert "image not found (ImageNotFound): localhost/nope:1 is not on n1" in why.message
    assert "retrying from the start" in why.message
    assert _places(_tick(c, s, 10_000))


def test_a_job_cancelled_while_it_backs_off_is_done_and_never_placed():
    c, s, p = _setup(retries=3)
    _start(c, s, p)
    _fail(c, s, p)
    s.step(c.env(JobCancelled(job_id=J), "cli/j", dt=100))
    assert s.phase_of(J) == "done"
    assert not _places(_tick(c, s, 60_000))


def test_a_late_failure_report_of_a_superseded_run_changes_nothing():
    c, s, p = _setup(retries=2)
    _start(c, s, p)
    _fail(c, s, p)
    (p2,) = _places(_tick(c, s, 10_000))
    _start(c, s, p2)
    # the first run's failure again (a redelivery under a new sequence number): not a second failure
    out = s.step(c.env(JobFailed(job_id=J, node="n1", command_id=p.command_id, reason="again", attempt=1), SRC))
    assert not out and s.phase_of(J) == "running" and s.jobs[J].failures == 1


def test_the_back_off_wait_of_other_jobs_is_not_held_against_the_queue():
    """While a failed job backs off, the card it left is free to other work."""
    c, s, p = _setup(retries=2)
    _start(c, s, p)
    _fail(c, s, p)
    (other,) = _places(s.step(c.env(job("t/k", "t", 1000, 10), "cli/k", dt=10)))
    assert other.job_id == "t/k" and other.node == "n1"


# ---------------------------------------------------------------- properties

RUN = st.tuples(st.sampled_from(["fail", "fail", "fail-before-start", "complete"]), st.integers(0, 200_000))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(retries=st.integers(0, 4), runs=st.lists(RUN, min_size=1, max_size=7), tick_s=st.sampled_from([1, 7, 30]))
def test_retries_never_exceed_what_was_asked_and_the_bill_is_the_sum_of_the_runs(retries, runs, tick_s):
    """Whatever its runs do, a job is placed at most retries + 1 times, is retried only after its back-off, ends
    failed once its retries are spent, and is billed exactly for the time its runs ran: from each start to that run's
    end, nothing for a run that never started, nothing while it waits."""
    c = Clock(T0)
    s = Scheduler(ledger=open_ledger(), usage_tick_ms=60_000)
    s.step(c.env(inventory("n1", gpus=1), "n1/inventory"))
    out = s.step(c.env(job(J, "t", 1000, 10, retries=retries), "cli/j"))
    usage, places, ran, backoffs = [], [], 0, []
    todo = list(runs)
    failures = 0
    while True:
        usage += [o.payload for o in out if o.kind == "usage.accrued"]
        backoffs += [o.payload.reasons[0] for o in out if o.kind == "job.pending"
                     and o.payload.reasons[0].code == "BackOff"]
        got = _places(out)
        if got:
            (p,) = got
            places.append((c.now, p))
            if backoffs:
                assert c.now >= backoffs[-1].data["retry_at_ms"], "placed before its back-off ended"
            what, length = todo.pop(0) if todo else ("complete", 1000)
            if what != "fail-before-start":
                _start(c, s, p, dt=10)
                started = c.now
                left = length
                while left > tick_s * 1000:  # ticks while it runs: the usage ticks bill the run as it goes
                    usage += [o.payload for o in _tick(c, s, tick_s * 1000) if o.kind == "usage.accrued"]
                    left -= tick_s * 1000
                c.now += left
                ran += 1000 * (c.now + 1 - started)  # the end is reported 1 ms after the last tick's time
            end = JobCompleted(job_id=J, node="n1", command_id=p.command_id) if what == "complete" else JobFailed(
                job_id=J, node="n1", command_id=p.command_id, attempt=p.attempt, reason="x", code="ExitCode",
                exit_code=2)
            failures += what != "complete"
            out = s.step(c.env(end, SRC, dt=1))
            continue
        if s.phase_of(J) == "done":
            break
        assert s.phase_of(J) == "pending" and backoffs
        out = _tick(c, s, tick_s * 1000)
    assert len(places) <= retries + 1
    assert len(backoffs) <= retries
    assert [p.attempt for _, p in places] == list(range(1, len(places) + 1))
    if failures > retries:
        assert len(places) == retries + 1 and len(backoffs) == retries
    # the bill: the sum of the runs, each billed once, intervals never overlapping nor covering a back-off
    assert sum(u.gpu_milli_ms for u in usage) == ran
    spans = sorted((u.start_ms, u.end_ms) for u in usage)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
    for b in backoffs:
        wait = (b.data["retry_at_ms"] - b.data["backoff_ms"], b.data["retry_at_ms"])
        assert not any(start < wait[1] and end > wait[0] for start, end in spans), "billed while backing off"


# ---------------------------------------------------------------- the audit's replay, grace from the log

def _recorded(envs):
    def topic(e):
        if e.is_command:
            return COMMANDS.name
        return LEDGER.name if e.kind.startswith(("usage", "quota")) else DECISIONS.name
    return [Recorded(topic(e), 0, i, encode(e)) for i, e in enumerate(envs)]


def test_the_replay_the_audit_runs_re_derives_every_retry_and_grace_from_the_log_alone():
    """The live agent and the audit both start from `live_config()` (no grace of their own): the operator's grace
    periods reach the scheduler on the ticks, so a replay of the input log makes the same stops, with the same
    grace, and the same retries at the same log times -- whatever environment the auditor runs in."""
    c = Clock(T0)
    live = Scheduler(**live_config())
    grace = {Tier.OFFLINE: 90, Tier.ONLINE_TRAINING: 20, Tier.INFERENCE: 5}
    inputs = [c.env(inventory("n1", gpus=1), "n1/inventory"),
              c.env(SchedulerTick(now_ms=c.now, grace_s=grace), "ticker", dt=1),
              c.env(QuotaSet(tenant="t", gpu_milli=4000), "operator", dt=1),
              c.env(job(J, "t", 1000, 10, retries=1), "cli/j", dt=1)]
    outs = [o for e in inputs for o in live.step(e, e.event_time_ms)]
    (p,) = _places(outs)

    def feed(env):
        inputs.append(env)
        got = live.step(env, env.event_time_ms)
        outs.extend(got)
        return got

    feed(c.env(JobStarted(job_id=J, node="n1", command_id=p.command_id), SRC, dt=100))
    feed(c.env(JobFailed(job_id=J, node="n1", command_id=p.command_id, reason="x", code="ExitCode", exit_code=3,
                         attempt=1), SRC, dt=3000))
    placed = []
    for _ in range(12):
        placed += _places(feed(c.env(SchedulerTick(now_ms=c.now + 1000, grace_s=grace), "ticker", dt=1000)))
    (p2,) = placed
    feed(c.env(JobStarted(job_id=J, node="n1", command_id=p2.command_id), SRC, dt=100))
    (stop,) = [o.payload for o in feed(c.env(NodeCordon(node="n1", drain=True, reason="maintenance"), "operator",
                                               dt=100)) if o.kind == "cmd.preempt"]
    assert stop.grace_s == 90  # the offline tier's, from the ticks
    replayed = replay_records([(i, encode(e), e.event_time_ms) for i, e in enumerate(inputs)])
    rep = compare_outputs(replayed, _recorded(outs), len(inputs))
    assert rep.ok and rep.compared == len(outs), rep
    # negative control: a replay whose ticks said another grace makes another stop
    other = [e.model_copy(update={"payload": SchedulerTick(now_ms=e.payload.now_ms, grace_s={Tier.OFFLINE: 30})})
             if e.kind == "scheduler.tick" else e for e in inputs]
    rep = compare_outputs(replay_records([(i, encode(e), e.event_time_ms) for i, e in enumerate(other)]),
                          _recorded(outs), len(inputs))
    assert not rep.ok and any("grace_s" in d for d in rep.different)


def test_grace_periods_come_from_construction_then_from_the_ticks_and_a_tick_without_them_changes_nothing():
    c = Clock(T0)
    s = Scheduler(ledger=open_ledger(), grace_s={"inference": 10})
    assert s.grace_s == {Tier.INFERENCE: 10, Tier.ONLINE_TRAINING: DEFAULT_GRACE_S, Tier.OFFLINE: DEFAULT_GRACE_S}
    s.step(c.env(SchedulerTick(now_ms=c.now, grace_s={Tier.OFFLINE: 120}), "ticker", dt=1))
    assert s.grace_s == {Tier.INFERENCE: DEFAULT_GRACE_S, Tier.ONLINE_TRAINING: DEFAULT_GRACE_S, Tier.OFFLINE: 120}
    s.step(c.env(SchedulerTick(now_ms=c.now), "ticker", dt=1))  # a ticker that predates grace periods
    assert s.grace_s[Tier.OFFLINE] == 120


def test_the_operators_grace_periods_are_read_strictly():
    import pytest

    from infra.config import parse_grace

    assert parse_grace("inference=10, online-training=30,offline=60") == {
        "inference": 10, "online-training": 30, "offline": 60}
    assert parse_grace("45") == {"inference": 45, "online-training": 45, "offline": 45}
    assert parse_grace("") == {} and parse_grace("offline=0") == {"offline": 0}
    for bad in ("gpu=10", "offline=-1", "offline=ten", "offline", "offline=3601", "offline=1.5"):
        with pytest.raises(ValueError, match="GPUPOOL_GRACE_S"):
            parse_grace(bad)
