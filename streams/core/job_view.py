"""The materialized view of one job: a pure, idempotent fold over the job-keyed topics.

The view reads three topics -- requests, the node agents' job events and the scheduler's decisions -- that the live
worker reads interleaved in whatever order they come and a refold reads one after the other, so the view must come
out the same for every interleaving that keeps each source's order. The node agents' reports are kept per run (one
placement: `Run`) and the job's state, node, run and counts are derived from the runs the scheduler has not
superseded: a `job.interrupted` (a node lost, a card failed) names the placement commands of the run it ended, and
every report of that run, read before the interruption or after it, counts for nothing -- a node that comes back
and reports the old run completed, failed or stopped does not end or move the job's new run, and neither does a
late start of the old run."""
from __future__ import annotations

from dataclasses import dataclass, replace

from schemas.envelope import Envelope
from schemas.events import (
    JobCancelled, JobCheckpointed, JobCompleted, JobFailed, JobInterrupted, JobPending, JobRequested,
    JobScaleRequested, JobStarted, JobStopped, Reason, Rejected,
)

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


def _current(live: list[Run]) -> Run | None:
    """The run the job's state is of: the first that ended the job (completed, failed), else the last still going,
    else the last one (stopped: the job waits)."""
    return (next((r for r in live if r.end in ("completed", "failed")), None)
            or next((r for r in reversed(live) if not r.end), None)
            or (live[-1] if live else None))


def _derive(view: JobView, waiting: tuple[Reason, ...]) -> JobView:
    """The job's state, node and run from the runs that stand; `waiting`: its reasons if it waits."""
    if view.state in CLOSED:
        return view
    cur = _current(_live(view))
    if cur is None:
        state = "pending" if view.request is not None or view.runs or view.interruptions else view.state
        return replace(view, state=state, node="", command_id="", started_ms=0, ended_ms=0, reasons=waiting)
    state = {"": "running", "completed": "completed", "failed": "failed"}.get(cur.end, "pending")
    reasons = {"running": (), "completed": (), "failed": (Reason(code="failed", message=cur.failure),)}.get(
        state, waiting)
    return replace(view, state=state, node=cur.node if state != "pending" else "", command_id=cur.command_id,
                   started_ms=cur.started_ms, ended_ms=cur.ended_ms if state in TERMINAL else 0, reasons=reasons)


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
            r = replace(r, end="completed", ended_ms=t)
        case JobFailed() if not r.end:
            r = replace(r, end="failed", ended_ms=t, failure=p.reason)
        case JobStopped() if not r.end:
            r = replace(r, end="migrated" if p.reason == "migrated" else "stopped",
                        checkpoint=p.checkpoint or r.checkpoint)
    runs[i] = r
    v = replace(view, runs=tuple(runs), progress_ms=progress)
    if r.command_id in view.superseded:
        return v  # a report of a run the scheduler interrupted (a node that came back): not this job's
    v = replace(v, checkpoint=getattr(p, "checkpoint", "") or view.checkpoint)
    if r.end != before.end and view.state not in CLOSED:
        v = replace(v, preemptions=v.preemptions + (r.end == "stopped"),
                    migrations=v.migrations + (r.end == "migrated"))
    return _derive(v, view.reasons)


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
    if v.state in CLOSED:
        return v
    ended = [r.end for r in runs if r.command_id in commands and r.command_id not in view.superseded]
    v = _derive(replace(v, preemptions=v.preemptions - ended.count("stopped"),
                        migrations=v.migrations - ended.count("migrated")), p.reasons)
    live = _live(v)
    cur = _current(live)
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
    finished = view.state in TERMINAL
    match p:
        case JobRequested() if view.request is None:
            return _mark(view, env, request=p, request_event_id=env.event_id,
                         state="pending" if view.state == "unknown" else view.state)
        case JobScaleRequested() if view.request is not None:
            req = view.request.model_copy(update={"compute_milli": p.compute_milli,
                                                  "gpu_memory_mib": p.gpu_memory_mib})
            return _mark(view, env, request=req)
        case JobCancelled() if not finished:
            return _mark(view, env, state="cancelled", ended_ms=env.event_time_ms)
        case JobStarted() | JobCheckpointed() | JobCompleted() | JobFailed() | JobStopped():
            return _mark(_report(view, env, p), env)
        case JobInterrupted():
            return _mark(_interrupted(view, p), env)
        case JobPending() if view.state in ("unknown", "pending"):
            # why a waiting job waits; the scheduler's decisions and the node's reports are different topics, so a
            # pending said before a placement can be read after the run it led to started: stale then, not news
            return _mark(view, env, reasons=p.reasons)
        case Rejected() if view.request is not None and env.causation_id != view.request_event_id:
            return _mark(view, env, refused=view.refused + (p.code,))  # about another request, not this job
        case Rejected() if not finished:
            return _mark(view, env, state="rejected", reasons=p.reasons)
    return _mark(view, env)
