"""The materialized view of one job: a pure, idempotent fold over the job-keyed topics."""
from __future__ import annotations

from dataclasses import dataclass, replace

from schemas.envelope import Envelope
from schemas.events import (
    JobCancelled, JobCheckpointed, JobCompleted, JobFailed, JobInterrupted, JobPending, JobRequested,
    JobScaleRequested, JobStarted, JobStopped, Reason, Rejected,
)

TERMINAL = frozenset({"completed", "failed", "cancelled", "rejected"})


@dataclass(frozen=True)
class JobView:
    job_id: str
    request: JobRequested | None = None
    state: str = "unknown"  # pending | running | completed | failed | cancelled | rejected
    node: str = ""
    command_id: str = ""
    started_ms: int = 0
    ended_ms: int = 0
    progress_ms: int = 0
    checkpoint: str = ""
    preemptions: int = 0
    migrations: int = 0  # runs moved by defragmentation (job.stopped reason "migrated"): not preemptions
    interruptions: int = 0  # runs ended by a node loss or a card fault (job.interrupted)
    superseded: tuple[str, ...] = ()  # placement command ids of interrupted runs: their nodes' reports are stale
    reasons: tuple[Reason, ...] = ()
    applied: tuple[tuple[str, int], ...] = ()  # (source, last seq); a job hears from few sources
    request_event_id: str = ""  # the request that defined the job: the first one; a later one never replaces it
    refused: tuple[str, ...] = ()  # codes of later requests under this id that were rejected (duplicate_job_id)

    def last_seq(self, source: str) -> int:
        for s, seq in self.applied:
            if s == source:
                return seq
        return -1


def _mark(view: JobView, env: Envelope, **changes) -> JobView:
    applied = tuple(sorted({**dict(view.applied), env.source: env.seq}.items()))
    return replace(view, applied=applied, **changes)


def evolve(view: JobView | None, env: Envelope) -> JobView:
    p = env.payload
    job_id = getattr(p, "job_id", None)
    if view is None:
        view = JobView(job_id=job_id or "")
    if job_id != view.job_id or env.seq <= view.last_seq(env.source):
        return view
    if getattr(p, "command_id", None) in view.superseded and not p.kind.startswith("cmd."):
        return _mark(view, env)  # a report of a run the scheduler interrupted (a node that came back): not this job's
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
        case JobStarted() if not finished:
            return _mark(view, env, state="running", node=p.node, command_id=p.command_id,
                         started_ms=env.event_time_ms, reasons=())
        case JobCheckpointed():
            return _mark(view, env, progress_ms=max(view.progress_ms, p.progress_ms),
                         checkpoint=p.checkpoint or view.checkpoint)
        case JobCompleted() if not finished:
            return _mark(view, env, state="completed", node=p.node, ended_ms=env.event_time_ms)
        case JobFailed() if not finished:
            return _mark(view, env, state="failed", ended_ms=env.event_time_ms,
                         reasons=(Reason(code="failed", message=p.reason),))
        case JobStopped() if not finished and p.reason == "migrated":
            return _mark(view, env, state="pending", node="", migrations=view.migrations + 1,
                         progress_ms=max(view.progress_ms, p.progress_ms), checkpoint=p.checkpoint)
        case JobStopped() if not finished:
            return _mark(view, env, state="pending", node="", preemptions=view.preemptions + 1,
                         progress_ms=max(view.progress_ms, p.progress_ms), checkpoint=p.checkpoint)
        case JobInterrupted() if not finished:
            return _mark(view, env, state="pending", node="", interruptions=view.interruptions + 1,
                         checkpoint=p.checkpoint or view.checkpoint, reasons=p.reasons,
                         superseded=view.superseded + p.commands)
        case JobPending() if view.state in ("unknown", "pending"):
            # why a waiting job waits; the scheduler's decisions and the node's reports are different topics, so a
            # pending said before a placement can be read after the run it led to started: stale then, not news
            return _mark(view, env, reasons=p.reasons)
        case Rejected() if view.request is not None and env.causation_id != view.request_event_id:
            return _mark(view, env, refused=view.refused + (p.code,))  # about another request, not this job
        case Rejected() if not finished:
            return _mark(view, env, state="rejected", reasons=p.reasons)
    return _mark(view, env)
