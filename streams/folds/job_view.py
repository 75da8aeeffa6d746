"""The materialized view of one job: a pure, idempotent fold over the job-keyed topics.

The view reads three topics -- requests, the node agents' job events and the scheduler's decisions -- that the live
worker reads interleaved in whatever order they come and a refold reads one after the other, so the view must come
out the same for every interleaving that keeps each source's order. The node agents' reports are kept per run (one
placement: `Run`) and the job's state, node, run and counts are derived from the runs the scheduler has not
superseded: a `job.interrupted` (a node lost, a card failed) names the placement commands of the run it ended, and
every report of that run, read before the interruption or after it, counts for nothing -- a node that comes back
and reports the old run completed, failed or stopped does not end or move the job's new run, and neither does a
late start of the old run.

A failed run ends the job only beyond the retries its request gave (`retries`, docs/jobs.md "Exit reasons and
retries"): the scheduler requeues a job with a retry left after a back-off, so a failed run within them is like a
stopped one -- the job waits (the scheduler's BackOff reason, or the view's own words for it until that is read) and
follows its next run. Failures are counted per placement (a gang's parts failing in one run count once), over the
runs the scheduler has not superseded, as the scheduler counts them.

A cancel (a request) or a rejection (a decision) closes the job unless a run ended it first: the two are on different
topics, so which came first is said by their times, never by the reading order (the earliest cancel or rejection is
kept). This fold is the one rule for a job's state: the sink stores each change it makes (gpupool.jobs, from the
job-view changelog) and the API, the CLI and the dashboard read it there (docs/jobs.md, "A job's state")."""
from __future__ import annotations

from dataclasses import dataclass, replace

from schemas.envelope import Envelope
from schemas.events import (
    JobCancelled, JobCheckpointed, JobCompleted, JobFailed, JobInterrupted, JobPending, JobRequested,
    JobScaleRequested, JobStarted, JobStopped, Reason, Rejected,
)
from streams.folds.exits import failure_text

TERMINAL = frozenset({"completed", "failed", "cancelled", "rejected"})
CLOSED = frozenset({"cancelled", "rejected"})  # said by a request or a decision, not by a run


@dataclass(frozen=True)
class Run:
    """One run of the job (one placement) as its node reported it. Keyed by the placement's command id: what
    job.started and job.completed name, and job.interrupted lists. A stop or a checkpoint naming another command (a
    cmd.preempt's, a cmd.migrate's) is of the run its node reported last, unless that one has ended."""
    command_id: str
    node: str
    started_ms: int = 0
    end: str = ""  # "" (runs) | completed | failed | stopped | migrated
    ended_ms: int = 0
    failure: str = ""
    checkpoint: str = ""
    attempt: int = 0  # the placement's number, where the node's failure report says it (0: not said)
    code: str = ""  # why it failed (schemas/events.EXIT_CODES); "" for a report from before exit reasons
    exit_code: int | None = None
    signal: int | None = None
    part: int = 0  # the gang part it ran (from its completion; 0 otherwise)
    parts: int = 1  # the gang's parts in that run, as its completion says (1: a job of one part, or not said)


@dataclass(frozen=True)
class JobView:
    job_id: str
    request: JobRequested | None = None
    state: str = "unknown"  # pending | running | completed | failed | cancelled | rejected
    node: str = ""
    command_id: str = ""
    started_ms: int = 0
    ended_ms: int = 0
    progress_ms: int = 0  # the furthest any run reported (a superseded one's too: a max, whatever the reading order)
    checkpoint: str = ""  # what the job resumes from
    preemptions: int = 0
    migrations: int = 0  # runs moved by defragmentation (job.stopped reason "migrated"): not preemptions
    interruptions: int = 0  # runs ended by a node loss or a card fault (job.interrupted)
    superseded: tuple[str, ...] = ()  # placement command ids of interrupted runs: their nodes' reports are stale
    reasons: tuple[Reason, ...] = ()
    applied: tuple[tuple[str, int], ...] = ()  # (source, last seq); a job hears from few sources
    request_event_id: str = ""  # the request that defined the job: the first one; a later one never replaces it
    refused: tuple[str, ...] = ()  # codes of later requests under this id that were rejected (duplicate_job_id)
    runs: tuple[Run, ...] = ()  # the runs its nodes reported, in the order their first reports were read
    failures: int = 0  # failed runs (placements) that stand, retried or the last
    backoff: tuple[Reason, ...] = ()  # the scheduler's latest BackOff reasons (read whenever: `_derive` picks them)
    # the earliest fact that closed it, by its time: a cancel or a rejection ("" none), when, and the rejection's reasons;
    # a run that ended the job before it (completed, or failed beyond its retries) wins, however the two are read
    closed: str = ""
    closed_ms: int = 0
    closed_reasons: tuple[Reason, ...] = ()

    def last_seq(self, source: str) -> int:
        for s, seq in self.applied:
            if s == source:
                return seq
        return -1


def _mark(view: JobView, env: Envelope, **changes) -> JobView:
    applied = tuple(sorted({**dict(view.applied), env.source: env.seq}.items()))
    return replace(view, applied=applied, **changes)


def _live(view: JobView) -> list[Run]:
    return [r for r in view.runs if r.command_id not in view.superseded]


def _retries(view: JobView) -> int:
    return view.request.retries if view.request is not None else 0


def failure_ends(failures: int, retries: int) -> bool:
    """Whether `failures` failed runs (placements) that stand end a job whose request allows `retries` retries: the
    one rule for it, read by this view (`_current`) and by the scheduler, which requeues a failed job this says
    does not end (agents/scheduler/core.py, `_retry`)."""
    return failures > retries


def _current(live: list[Run], retries: int = 0) -> tuple[Run | None, bool, int]:
    """(the run the job's state is of, whether that run ended the job, the failed runs that stand): the first that
    ended the job -- completed (a gang's part: once every part of its run completed), or the failure beyond its
    `retries` -- else the last still going, else the last one (stopped, or failed with a retry left: the job
    waits)."""
    failed: list = []
    for r in live:
        if r.end == "completed" and r.parts > 1 and r.attempt and len(
                {x.part for x in live if x.end == "completed" and x.attempt == r.attempt}) < r.parts:
            continue  # a part of a gang is done; the gang is done once every part of its run is (docs/jobs.md)
        if r.end == "completed":
            return r, True, len(failed)
        if r.end == "failed":
            key = r.attempt or r.command_id  # a gang's parts of one placement fail as one run
            if key not in failed:
                failed.append(key)
            if failure_ends(len(failed), retries):
                return r, True, len(failed)
    cur = next((r for r in reversed(live) if not r.end), None) or (live[-1] if live else None)
    return cur, False, len(failed)


def _failure(r: Run) -> str:
    return failure_text(r.code or None, r.failure, r.exit_code, r.signal)


def _backing_off(view: JobView, cur: Run, failures: int) -> tuple[Reason, ...]:
    """Why a job whose last run failed with a retry left waits: the scheduler's BackOff reason for that failure
    (when, from what), else the same in the view's words until it is read."""
    if view.backoff and view.backoff[0].data.get("failures") == failures:
        return view.backoff
    retries = _retries(view)
    return (Reason(code="BackOff", plugin="Retry", nodes=(cur.node,) if cur.node else (),
                   message=f"run {failures} of {retries + 1} failed ({_failure(cur)}); retrying",
                   data={"failures": failures, "retries": retries}),)


def _closing(view: JobView) -> tuple[str, int, tuple[Reason, ...]]:
    """(cancelled | rejected | "", when, the rejection's reasons): what closed the job; a view from an older worker's
    changelog, closed before `closed` was kept, says it in its state."""
    if view.closed:
        return view.closed, view.closed_ms, view.closed_reasons
    if view.state in CLOSED:
        return view.state, view.ended_ms, view.reasons if view.state == "rejected" else ()
    return "", 0, ()


def _close(view: JobView, kind: str, at_ms: int, reasons: tuple[Reason, ...]) -> JobView:
    """A cancel or a rejection: the earliest of them (by its time, then its name) is what closed the job."""
    closed, closed_ms, _ = _closing(view)
    if closed and (closed_ms, closed) <= (at_ms, kind):
        return view
    return replace(view, closed=kind, closed_ms=at_ms, closed_reasons=reasons)


def _end_ms(live: list[Run], cur: Run) -> int:
    """When the run that ended the job ended: a gang's with its last part."""
    if cur.end == "completed" and cur.parts > 1 and cur.attempt:
        return max(r.ended_ms for r in live if r.end == "completed" and r.attempt == cur.attempt)
    return cur.ended_ms


def _derive(view: JobView, waiting: tuple[Reason, ...]) -> JobView:
    """The job's state, node and run from the runs that stand and what closed it, whatever order they were read
    in; `waiting`: its reasons if it waits (none: a failed run with a retry left says its own)."""
    live = _live(view)
    cur, ends, failures = _current(live, _retries(view))
    closed, closed_ms, closed_reasons = _closing(view)
    # runs stopped (preempted, drained) or moved (migrated) while it was open count; a superseded run's do not
    counted = [r.end for r in live if not closed or r.ended_ms < closed_ms]
    view = replace(view, preemptions=counted.count("stopped"), migrations=counted.count("migrated"))
    if closed and not (ends and _end_ms(live, cur) <= closed_ms):
        return replace(view, state=closed, node=cur.node if cur is not None else "",
                       command_id=cur.command_id if cur is not None else "",
                       started_ms=cur.started_ms if cur is not None else 0, ended_ms=closed_ms,
                       reasons=closed_reasons, failures=failures)
    if cur is None:
        state = "pending" if view.request is not None or view.runs or view.interruptions else view.state
        return replace(view, state=state, node="", command_id="", started_ms=0, ended_ms=0, reasons=waiting,
                       failures=0)
    state = "running" if not cur.end else cur.end if ends else "pending"
    if state == "failed":
        runs = f"; failed after {failures} runs" if _retries(view) else ""
        data: dict[str, int | str] = {"runs": failures} if _retries(view) else {}
        if cur.code:
            data["exit"] = cur.code
        reasons = (Reason(code="failed", message=_failure(cur) + runs, data=data),)
    elif state == "pending":
        reasons = waiting or (_backing_off(view, cur, failures) if cur.end == "failed" else ())
    else:
        reasons = ()
    ended = _end_ms(live, cur) if state in TERMINAL else 0
    return replace(view, state=state, node=cur.node if state != "pending" else "", command_id=cur.command_id,
                   started_ms=cur.started_ms, ended_ms=ended, reasons=reasons, failures=failures)


def _runs(view: JobView) -> tuple[Run, ...]:
    """The runs recorded; a view written before runs were (an older worker's changelog) has the one it shows."""
    if view.runs or not view.command_id:
        return view.runs
    end = {"running": "", "completed": "completed", "failed": "failed"}.get(view.state, "stopped")
    return (Run(command_id=view.command_id, node=view.node, started_ms=view.started_ms, end=end,
                ended_ms=view.ended_ms, failure=view.reasons[0].message if end == "failed" and view.reasons else ""),)


def _run_of(runs: tuple[Run, ...], p) -> int | None:
    """Which run a node's report is about: the one its command id names, else (a stop's or a checkpoint's own
    command id, a failure naming none) the run its node reported last, if that one has not ended."""
    for i, r in enumerate(runs):
        if p.command_id and r.command_id == p.command_id:
            return i
    if isinstance(p, (JobStarted, JobCompleted)) or not p.node:
        return None
    i = next((i for i in range(len(runs) - 1, -1, -1) if runs[i].node == p.node), None)
    if i is not None and runs[i].end and not isinstance(p, JobCheckpointed):
        return None  # a stop or failure of a run never reported started here
    return i


def _report(view: JobView, env: Envelope, p) -> JobView:
    """A node's report, recorded as a fact of its run; the job follows the runs that stand."""
    runs = list(_runs(view))
    i = _run_of(tuple(runs), p)
    progress = max(view.progress_ms, getattr(p, "progress_ms", 0))
    if i is None and isinstance(p, JobCheckpointed):  # of no run reported started: the work's, not a run
        return replace(view, progress_ms=progress, checkpoint=p.checkpoint or view.checkpoint)
    if i is None:
        runs.append(Run(command_id=p.command_id or "", node=p.node))
        i = len(runs) - 1
    r = before = runs[i]
    t = env.event_time_ms
    match p:
        case JobStarted():
            r = replace(r, started_ms=r.started_ms or t)
        case JobCheckpointed():
            r = replace(r, checkpoint=p.checkpoint or r.checkpoint)
        case JobCompleted() if not r.end:
            r = replace(r, end="completed", ended_ms=t, attempt=p.attempt or r.attempt, part=p.part, parts=p.parts)
        case JobFailed() if not r.end:
            r = replace(r, end="failed", ended_ms=t, failure=p.reason, attempt=p.attempt, code=p.code or "",
                        exit_code=p.exit_code, signal=p.signal)
        case JobStopped() if not r.end:
            r = replace(r, end="migrated" if p.reason == "migrated" else "stopped", ended_ms=t,
                        checkpoint=p.checkpoint or r.checkpoint)
    runs[i] = r
    v = replace(view, runs=tuple(runs), progress_ms=progress)
    if r.command_id in view.superseded:
        return v  # a report of a run the scheduler interrupted (a node that came back): not this job's
    if not (isinstance(p, JobStopped) and before.end):  # a stop of a run that had ended is stale: no checkpoint
        v = replace(v, checkpoint=getattr(p, "checkpoint", "") or view.checkpoint)
    # a run that just failed: what the job waited for before it is past (a retry says why it waits now)
    return _derive(v, () if r.end == "failed" != before.end else view.reasons)


def _interrupted(view: JobView, p: JobInterrupted) -> JobView:
    """The scheduler ended a run: its reports, whenever read, count for nothing (a stop of it read before no longer
    counts). The job follows the runs that stand (a newer run may already have been read), else it waits for the
    reasons the interruption gives; it resumes from the checkpoint the newer run reported, else from the one the
    scheduler says."""
    runs = _runs(view)
    # a producer that predates `commands` named none: the runs going on on the node, as far as read
    commands = p.commands or tuple(r.command_id for r in _live(replace(view, runs=runs))
                                   if not r.end and (r.node == p.node or not p.node))
    v = replace(view, runs=runs, superseded=view.superseded + commands, interruptions=view.interruptions + 1)
    v = _derive(v, p.reasons)
    live = _live(v)
    cur = _current(live, _retries(v))[0]
    if cur is not None and cur.end in ("", "completed", "failed") and cur.checkpoint:
        return replace(v, checkpoint=cur.checkpoint)
    return replace(v, checkpoint=p.checkpoint or next((r.checkpoint for r in reversed(live) if r.checkpoint), ""))


def evolve(view: JobView | None, env: Envelope) -> JobView:
    p = env.payload
    job_id = getattr(p, "job_id", None)
    if view is None:
        view = JobView(job_id=job_id or "")
    if job_id != view.job_id or env.seq <= view.last_seq(env.source):
        return view
    match p:
        case JobRequested() if view.request is None:
            v = _mark(view, env, request=p, request_event_id=env.event_id,
                      state="pending" if view.state == "unknown" else view.state)
            if p.retries and any(r.end == "failed" for r in v.runs):
                v = _derive(v, ())  # a failure read before the request: it may have a retry left
            return v
        case JobScaleRequested() if view.request is not None:
            req = view.request.model_copy(update={"compute_milli": p.compute_milli,
                                                  "gpu_memory_mib": p.gpu_memory_mib})
            return _mark(view, env, request=req)
        case JobCancelled():
            return _mark(_derive(_close(view, "cancelled", env.event_time_ms, ()), view.reasons), env)
        case JobStarted() | JobCheckpointed() | JobCompleted() | JobFailed() | JobStopped():
            return _mark(_report(view, env, p), env)
        case JobInterrupted():
            return _mark(_interrupted(view, p), env)
        case JobPending():
            # a failed run's back-off, kept whenever it is read: the failure it answers may be read after it
            backoff = p.reasons if p.reasons and p.reasons[0].code == "BackOff" else view.backoff
            if view.state in ("unknown", "pending"):
                # why a waiting job waits; the scheduler's decisions and the node's reports are different topics, so
                # a pending said before a placement can be read after the run it led to started: stale then, not news
                return _mark(view, env, reasons=p.reasons, backoff=backoff)
            return _mark(view, env, backoff=backoff)
        case Rejected() if view.request is not None and env.causation_id != view.request_event_id:
            return _mark(view, env, refused=view.refused + (p.code,))  # about another request, not this job
        case Rejected():
            return _mark(_derive(_close(view, "rejected", env.event_time_ms, p.reasons), view.reasons), env)
    return _mark(view, env)


# ---------------------------------------------------------------- what the jobs list says of a job (streams/folds/rows.py)


def exit_of(r: Run) -> str:
    """A failed run's exit as the jobs list says it: "ExitCode 3", "Signal 9", "OOMKilled"... ("" before exit
    reasons were recorded)."""
    if r.code == "ExitCode" and r.exit_code is not None:
        return f"ExitCode {r.exit_code}"
    if r.code == "Signal" and r.signal is not None:
        return f"Signal {r.signal}"
    return r.code


def last_exit(view: JobView) -> str:
    """Why its last failed run that stands ended ("" when none failed): the latest by its end's time."""
    failed = [r for r in _live(view) if r.end == "failed"]
    return exit_of(max(failed, key=lambda r: r.ended_ms)) if failed else ""


def retry_at_ms(view: JobView) -> int:
    """While it waits out a failed run's back-off, when the scheduler tries it again (0: it does not)."""
    if view.state == "pending" and view.reasons and view.reasons[0].code == "BackOff":
        at = view.reasons[0].data.get("retry_at_ms", 0)
        return at if isinstance(at, int) else 0
    return 0
