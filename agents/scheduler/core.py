"""The scheduler as a deterministic fold over its one input stream.

`Scheduler.step(envelope)` applies one input record and returns the envelopes the scheduler emits in response
(commands, pending reasons, ledger events). The outputs are a function of the input sequence alone: time comes from
event times and ticks, ids from a counter, ties from sorted keys. The live agent, the simulator and the audit replayer
all drive this same class, so replaying the input reproduces every decision bit for bit.
"""
from __future__ import annotations

import bisect
import functools
import heapq
import zlib
from dataclasses import dataclass, replace

from agents.scheduler.admission import Fleet
from agents.scheduler import defrag
from agents.scheduler.claims import (
    GROUPS, Claim, Search, claim, claim_of_group, holding_on, standing_at, standing_now,
)
from agents.scheduler.elastic import (
    SERVICE_KINDS, SOURCE as AUTOSCALER, Autoscaler, Backfill, Charge, Emit, LoadSample, Request,
)
from agents.scheduler.elastic import ElasticConfig, Resize
from agents.scheduler.holdings import (
    ChargeFreed, ExpireFreed, Holdings, JobRecord, Nominate, Park, RechargeFreed, Reclose, UnchargeFreed, Unpark,
    UnparkAll, Woke, fingerprint, rebuilt,
)
from agents.scheduler.node_index import cards_needed
from agents.scheduler.placement import DEFAULT_CANDIDATES, MigPlan, Placement, Unschedulable, place
from agents.scheduler.placement import allowed_models, fit_cards
from agents.scheduler.plan import Plan as TrialPlan
from agents.scheduler.preemption import (
    NODE_FILTERS, Plan, PreemptionConfig, Room, Shape, Victim, disruption_order, filters_key, fits, least_disruptive,
    plan_gang, plan_over, protected, quiet_until,
)
from agents.scheduler.quota import CPU_PER_CU, Admission, Ledger, held
from agents.scheduler.reservations import LIVE, Book, Booking
from agents.scheduler.scoring import Workload
from agents.scheduler.victims import LazyVictims
from schemas.envelope import DecodeError, Envelope, decode_fast, envelope
from schemas.gpu_models import model as gpu_model
from schemas.events import (
    DEFAULT_RENDEZVOUS_PORTS, TIER_RANK, GpuHealth, JobCancelled, JobCheckpointed, JobCompleted, JobFailed,
    JobInterrupted, JobPending, JobRequested, JobStarted, JobStopped, MigrateJob, MigReconfigure, ReservationCancelled,
    ReservationDecided, ReservationRequested, NodeAdmitted, NodeCordon, NodeInventory, NodeLiveness, NodeRemoved,
    PlaceJob, PreemptJob, QuotaRejected, QuotaSet, Reason, Rejected, ReleaseJob, ResizeJob, SchedulerTick, Tier,
    UsageAccrued,
)
from streams.folds import node_view
from streams.folds.exits import backoff_ms, failure_text
from streams.folds.job_view import failure_ends
from streams.folds.gateway import SOURCE_PREFIX as GATEWAY_PREFIX

SOURCE = "scheduler"
# How long a finished job is remembered (its Ended record, its commands, its own sources' dedupe entries), in log
# time after the last record about it: within it a retried or repeated request, a late or repeated report is
# answered exactly as while the job was live; a job.requested for an id nobody remembers that is older than this
# (event time before log time - RETAIN_MS) is refused (`stale_request`): it may be a duplicate of one forgotten
# (docs/scheduler.md, "Finished jobs").
RETAIN_MS = 24 * 3600_000
# The most jobs one tenant may have waiting; a request through the gateway beyond it is refused (`too_many_pending`).
MAX_PENDING = 500
# How long a job told to stop (cmd.preempt, cmd.migrate) has between SIGTERM and SIGKILL to checkpoint and exit, per
# tier, until the operator's configuration (GPUPOOL_GRACE_S, carried by the ticks: SchedulerTick.grace_s) says
# otherwise (docs/jobs.md, "Stops and grace periods").
DEFAULT_GRACE_S = 30


def grace_map(given: dict | None = None) -> dict[Tier, int]:
    """Every tier's grace period in seconds: `given`'s (tier or its name -> seconds), DEFAULT_GRACE_S for the rest."""
    out = {t: DEFAULT_GRACE_S for t in Tier}
    for k, v in (given or {}).items():
        out[Tier(k)] = int(v)
    return out


def own_source(source: str, job_id: str) -> bool:
    """Whether an input source is the job's own: a node agent's reports about it (NODE/job/JOB) or the gateway's
    records of one principal about it (in/OWNER/JOB: one source per principal and routing key, the job id)."""
    return source.endswith("/job/" + job_id) or (source.startswith(GATEWAY_PREFIX) and source.endswith("/" + job_id))


@dataclass(slots=True)
class Attempt:
    """What the allocate action found for a job it did not decide: its quota blocked it (`quota`, with `holding`
    when it was what a placement found that the quota refused), or no node took it (`result`, place's
    Unschedulable); and, as worked out for it, its quiet window's reason, standing, kind and need (the dominance
    memo's)."""
    rec: JobRecord
    quota: Admission | None = None
    holding: tuple[int, int] | None = None
    result: object = None
    quiet: Reason | None = None
    standing: bool = False
    kind: tuple | None = None
    need: tuple = ()


class Statement:
    """One cycle's session (Volcano's and KAI's Statement; docs/scheduler.md, "A cycle"). Two layers:

    - Commands. Each is applied to the holdings as it is made -- the cycle's later jobs see it, as a Statement's
      operations change the session at once -- and its envelope waits in `out` until `commit` hands them, in order,
      to the step's outputs: what a cycle emits reaches the outside world once, at its end.
    - Trials. `plan` (plan.py) holds operations tried on the node views without touching the holdings -- a
      defragmentation's moves, node by node -- each logging its inverse; `checkpoint()` and `rollback(cp)` bound a
      trial, and a trial is always rolled back before a command is made (`_emit` refuses one while a trial is in
      force), so an abandoned trial emits nothing and leaves nothing. Rolling back past a command is refused: the
      command is already in the holdings, as a committed KAI operation is in the cache.

    The holdings the cycle runs over are a snapshot: while it runs they take the cycle's own commands and changes
    and no fact (`Holdings.frozen`)."""
    __slots__ = ("out", "cause", "_into", "_nodes", "_plan")

    def __init__(self, into: list[Envelope], cause: Envelope, nodes):
        self.out: list[Envelope] = []
        self.cause = cause
        self._into = into
        self._nodes = nodes
        self._plan: TrialPlan | None = None  # made on the first trial: most cycles try nothing

    @property
    def plan(self) -> TrialPlan:
        p = self._plan
        if p is None:
            p = self._plan = TrialPlan(self._nodes)
        return p

    @property
    def trying(self) -> bool:
        """Whether a trial's operations are in force."""
        return self._plan is not None and self._plan.open

    def checkpoint(self) -> tuple[int, int]:
        """(envelopes made so far, the plan's checkpoint)."""
        return len(self.out), self.plan.checkpoint()

    def rollback(self, cp: tuple[int, int]) -> None:
        """Undo the trial operations made after `cp`; refused if anything was emitted since (it is in the
        holdings)."""
        if len(self.out) != cp[0]:
            raise RuntimeError(f"rollback past {len(self.out) - cp[0]} emitted envelope(s): they are in the holdings")
        self.plan.rollback(cp[1])

    def commit(self) -> None:
        if self.trying:
            raise RuntimeError(f"a trial of {len(self.plan.ops)} operation(s) was left in the plan at commit")
        self._into.extend(self.out)
        self.out = []


class Scheduler:
    """The policy over `Holdings` (holdings.py): it reads the state, decides, and emits; what it emits is applied to
    the holdings (the one write path), so the node views, the indices and the job records follow its decisions.
    Configuration (the same configuration decides the same, so the live agent, the audit and `replay` share it):
    `ledger`, `preemption`, `candidates`, `full_cycle_ms`, `usage_tick_ms`, `elastic` (an ElasticConfig: the
    autoscaler component, elastic.py), `grace_s` (tier -> seconds a stop waits before SIGKILL, until a tick on the
    log says otherwise: the live agent and the audit leave it at the default and take the operator's from the ticks,
    so a replay of the log decides the same whatever its own environment says). `nodes` and `jobs` adopt a state
    built elsewhere (tests)."""

    full_cycle_ms: int = 10_000
    usage_tick_ms: int = 60_000
    retain_ms: int | None = RETAIN_MS
    max_pending: int = MAX_PENDING
    search_memo = True  # the claim search keeps per-node facts (_plan_nodes); off: the reference walk (tests)
    # the operator's port range for gangs' rendezvous (first, last): the ticks carry it (SchedulerTick
    # .rendezvous_ports), so every replay chooses the same ports (_rendezvous)
    rendezvous_ports: tuple[int, int] = DEFAULT_RENDEZVOUS_PORTS
    _stmt: Statement | None = None  # the cycle's statement while a cycle runs (`_cycle`), else None

    def __init__(self, *, ledger: Ledger | None = None, preemption: PreemptionConfig | None = None,
                 candidates: int = DEFAULT_CANDIDATES, full_cycle_ms: int | None = None,
                 usage_tick_ms: int | None = None, elastic=None, nodes: dict | None = None,
                 jobs: dict | None = None, applied: dict | None = None, out_seq: int = 0,
                 retain_ms: int | None = RETAIN_MS, max_pending: int = MAX_PENDING, grace_s: dict | None = None):
        self.h = Holdings() if nodes is None and jobs is None else rebuilt(nodes or {}, jobs or {})
        self.ledger = ledger if ledger is not None else Ledger()
        self.preemption = preemption or PreemptionConfig()
        self.candidates = candidates
        if full_cycle_ms is not None:
            self.full_cycle_ms = full_cycle_ms
        if usage_tick_ms is not None:
            self.usage_tick_ms = usage_tick_ms
        if retain_ms != RETAIN_MS:
            if retain_ms is not None and retain_ms <= 0:
                raise ValueError("retain_ms: a positive number of ms, or None (finished jobs kept for ever)")
            self.retain_ms = retain_ms  # None: finished jobs are kept (as Ended) for ever, and nothing is stale
        if max_pending != MAX_PENDING:
            self.max_pending = max_pending
        self.applied: dict[str, int] = dict(applied or {})
        self.grace_s = grace_map(grace_s)
        # failed runs waiting out their back-off (core._retry): (log time it ends, job), a heap
        self._backoff: list[tuple[int, str]] = []
        self.now_ms = 0
        self.cycle = 0
        self.out_seq = out_seq
        self.arrivals = 0
        self.workload = Workload()
        # Jobs nominated on nodes (kube-scheduler's nominatedNodeName, `Holdings.nominations`): what their victims
        # free there is theirs; jobs of the same or a lower claim do not take it in the meantime (or preemption would
        # thrash).
        # What preemption freed, per node (`Holdings.freed_for`): node -> (the claim it was freed for, until when in
        # log time, for whom).
        # What a plan frees beyond what its job needs stays with that claim while the plan's victims are in their
        # quiet window (from the plan to victim_quiet_ms after its job took its node) and its job waits for or holds
        # it: a job in its own quiet window whose claim is not above it does not take it (`_barred`), so a requeued
        # victim cannot take the leftover and make the next request of that claim stop someone for it -- the chain
        # is charged to its origin (#14 item 2). Other work may take it; once the job that freed it lets go of its
        # holding (ends, is stopped) it is free capacity like any. Both change only by `Holdings.apply`.
        # node -> (its view, facts kept while that view object is current): the claim search's (_plan_nodes)
        self._node_memo: dict[str, tuple[node_view.NodeView, dict]] = {}
        self.book = Book()
        # The pending queue is retried as a whole only when something may have changed its answers: the epoch moves
        # on every input that can free capacity or change quota, health or reservations, and on a tick every
        # full_cycle_ms. A request arriving when nothing moved tries only itself: everything else failed against
        # the same or a larger free capacity.
        self.epoch = 0
        self.node_epoch = 0
        self._full_epoch = -1
        self._full_ms = -1 << 62
        self._admit_memo: tuple[int, dict] = (-1, {})  # (ledger version, question -> Ledger.admit's answer)
        # Parked jobs (kube-scheduler's unschedulable pods, Kueue's inadmissible workloads, `Holdings.parked`): a
        # waiting job in its quiet window (it may stop nobody) whose last attempt no node took stays out of the
        # cycle's queue until something may give it room (`_wake`); its last reasons stand meanwhile.
        # a parked job woken in a full cycle is tried at its place in the queue's order at the cycle's start: its
        # standing then is read from its tenant's sums as they were (`_settle` marks their versions, claims.standing_at)
        self._unsettled: set[str] = set()  # tenants with parked jobs whose sums have not moved in this cycle
        self._settled_at: dict[str, dict] = {}  # tenant -> its sums' versions at this cycle's start, once they moved
        self._park_mark = (0, 0)  # (node epoch, quota version) the parked jobs were parked under
        self._flush = False  # the timed full cycle: every parked job is tried again
        # Usage accrues while jobs run: on the first tick usage_tick_ms of log time after the last accrual, every
        # running job is billed [accrued_ms, now) (and at its end, the rest), so a bill includes running work.
        self._usage_ms: int | None = None
        self.fleet = Fleet()  # what the pool could ever host (admission.py)
        self.unsure: dict[str, None] = {}  # pending jobs that looked unsatisfiable while the fleet grew
        # the elastic layer (elastic.py): reads this state, yields requests and decisions that `_act` carries out
        self.autoscaler = Autoscaler(elastic, self) if elastic is not None else None

    # the holdings, read through (they change only by `Holdings.apply`)
    nodes = property(lambda self: self.h.nodes)
    jobs = property(lambda self: self.h.jobs)
    index = property(lambda self: self.h.index)
    victim_index = property(lambda self: self.h.victims)
    pending = property(lambda self: self.h.pending)
    stopping = property(lambda self: self.h.stopping)
    running = property(lambda self: self.h.running)
    held_by_tier = property(lambda self: self.h.held_by_tier)
    ended = property(lambda self: self.h.ended)
    parked = property(lambda self: self.h.parked)
    nominations = property(lambda self: self.h.nominations)
    freed_for = property(lambda self: self.h.freed_for)

    def phase_of(self, job_id: str) -> str | None:
        """A job's phase in the scheduler's bookkeeping (holdings.PHASES, not the job's state as users see it:
        streams/folds/job_view.py decides that): its record's while it is live, "done" while it is remembered as
        finished, else None."""
        rec = self.jobs.get(job_id)
        if rec is not None:
            return rec.phase
        return "done" if job_id in self.h.ended else None

    # ---------------------------------------------------------------- emitting

    def _emit(self, out: list[Envelope], payload, cause: Envelope, causation: str = "") -> None:
        """`causation`: the event id the output names as its cause when not the input being handled (`_judge`)."""
        self.out_seq += 1
        env = envelope(payload, source=SOURCE, seq=self.out_seq, time_ms=self.now_ms,
                       causation_id=causation or cause.event_id,
                       correlation_id=getattr(payload, "job_id", None))
        out.append(env)
        if env.is_command:
            if self._stmt is not None and self._stmt.trying:
                raise RuntimeError(f"{env.kind} made while a trial is in the plan: roll it back first")
            if self._unsettled:
                self._settle_for(getattr(payload, "job_id", ""))
            self.h.apply(env)

    def _command_id(self) -> str:
        return f"c{self.out_seq + 1}"

    def _command(self, out: list[Envelope], payload, cause: Envelope) -> None:
        """Emit a command about one run of a job, and remember which run (its attempt) it concerns."""
        self.h.commanded(self.jobs[payload.job_id], payload.command_id, payload.attempt)
        self._emit(out, payload, cause)

    # ---------------------------------------------------------------- input

    def step(self, env: Envelope, log_ms: int | None = None) -> list[Envelope]:
        """Apply one input. `log_ms`: the broker's append time of the input record, the scheduler's only clock (a
        replay passes the same times, read from the same log); without it (pure tests, simulations) the event time
        stands in for it. With the autoscaler component, it is handed the service kinds and, after the scheduler's
        own handling, every other input; what it yields is carried out here (`_act`)."""
        out: list[Envelope] = []
        if not self._fresh(env, log_ms):
            return out  # duplicate or stale: at-least-once delivery made exact
        h = self.h
        if h.expiry and h.expiry[0][0] <= self.now_ms or h.strays and h.strays[0][0] <= self.now_ms:
            self._forget()
        a = self.autoscaler
        if a is not None and env.kind in SERVICE_KINDS:
            self._act(out, env, a.on_input(env))
        else:
            self._input(out, env)
            if a is not None:
                self._act(out, env, a.after(env))
        if a is not None:
            a.record_share()
        if h.done_now:
            self._bury()
        return out

    # ---------------------------------------------------------------- finished jobs

    def _bury(self) -> None:
        """The jobs that ended in this step: each record gives way to what is kept of it (holdings.Ended), until
        retain_ms after the last record about it. Nothing more is billed, released or charged for a job once it
        is done (its end billed and released it); what still refers to it by id asks `state_of`."""
        h = self.h
        for rec in h.done_now:
            j = rec.request.job_id
            if h.jobs.get(j) is rec and rec.phase == "done":
                self.unsure.pop(j, None)
                h.bury(rec, None if self.retain_ms is None else max(self.now_ms, rec.said_ms) + self.retain_ms)
        h.done_now.clear()

    def _forget(self) -> None:
        """Finished jobs whose time is up are forgotten, with their own sources' dedupe entries: from now on a
        record about one is as about a job never seen (and a request for its id, if older than retain_ms, stale)."""
        a = self.autoscaler
        h = self.h
        for j, t in h.forget(self.now_ms):
            for src in t.sources:
                self.applied.pop(src, None)
            if a is not None:
                a.replica_of.pop(j, None)
        while h.strays and h.strays[0][0] <= self.now_ms:
            _, src, j = heapq.heappop(h.strays)
            if j not in h.jobs and j not in h.ended:
                self.applied.pop(src, None)

    def _heard(self, env: Envelope) -> None:
        """A fresh record about a job: it is remembered at least retain_ms from max(now, its event time) (so a
        duplicate of it arriving later is either still recognised, or older than retain_ms: stale); a source of
        its own is noted, to be forgotten with it."""
        j = getattr(env.payload, "job_id", None)
        if not isinstance(j, str):
            return
        t = max(self.now_ms, env.event_time_ms)
        own = own_source(env.source, j)
        rec = self.jobs.get(j)
        if rec is not None:
            self.h.note(rec, said_ms=max(rec.said_ms, t))
            if own and env.source not in rec.sources:
                self.h.note(rec, sources=rec.sources + (env.source,))
            return
        e = self.h.ended.get(j)
        if e is not None:
            if own:
                self.h.ended_source(j, env.source)
            if self.retain_ms is not None:
                self.h.keep_until(j, t + self.retain_ms)
        elif own and self.retain_ms is not None:  # about a job nobody remembers: its source's entry goes in time too
            heapq.heappush(self.h.strays, (t + self.retain_ms, env.source, j))

    def _fresh(self, env: Envelope, log_ms: int | None) -> bool:
        if env.seq <= self.applied.get(env.source, -1):
            return False
        self.applied[env.source] = env.seq
        self.now_ms = max(self.now_ms, env.event_time_ms if log_ms is None else log_ms)
        return True

    def _act(self, out: list[Envelope], cause: Envelope, actions) -> None:
        """Carry out the autoscaler's actions one by one: each is decided on the state the last one left."""
        a = self.autoscaler
        for act in actions:
            if isinstance(act, Emit):
                self._emit(out, act.payload, cause)
            elif isinstance(act, Request):  # fed through the ordinary input path, as if it came from the log
                a.seq += 1
                env = envelope(act.payload, source=AUTOSCALER, seq=a.seq, time_ms=self.now_ms,
                               causation_id=cause.event_id, correlation_id=getattr(act.payload, "job_id", None))
                out.append(env)
                if self._fresh(env, None):
                    self._input(out, env)
            elif isinstance(act, LoadSample):  # a service's load from its replicas' scrapes: emitted, then decided on
                a.seq += 1
                env = envelope(act.payload, source=AUTOSCALER, seq=a.seq, time_ms=self.now_ms,
                               causation_id=cause.event_id)
                out.append(env)
                if self._fresh(env, None):
                    self._act(out, env, a.on_input(env))
            elif isinstance(act, Resize):
                rec = self.jobs[act.job_id]
                self._accrue(out, cause, rec)  # billed at the old size up to now
                self._emit(out, ResizeJob(command_id=self._command_id(), job_id=act.job_id, node=rec.node,
                                          assignments=act.assignments, reasons=(act.why,), attempt=rec.attempt),
                           cause)
            elif isinstance(act, Charge):
                move = self.ledger.hold if act.sign > 0 else self.ledger.release
                for ev in move(act.hold, False, memory=0):
                    self._emit(out, ev, cause)
            elif isinstance(act, Backfill):
                self._cycle(out, cause)

    def _input(self, out: list[Envelope], env: Envelope) -> None:
        """The scheduler's own handling of one input (a fresh one: `_fresh` said so)."""
        self._handle(out, env)
        self._heard(env)

    def _handle(self, out: list[Envelope], env: Envelope) -> None:
        if self._usage_ms is None:
            self._usage_ms = self.now_ms
        p = env.payload
        if p.kind not in _SAME_EPOCH:
            self.epoch += 1
        if self._backoff and self._backoff[0][0] <= self.now_ms:
            self._backoff_over()
        match p:
            case NodeInventory() | NodeCordon() | NodeLiveness() | GpuHealth() | NodeRemoved() | NodeAdmitted():
                self.node_epoch += 1  # a node's facts changed: waiting jobs are explained afresh
                before = self.nodes.get(p.node)
                self.h.apply(env)
                self._typical()
                self._node_changed(out, env, before, self.nodes[p.node])
                self._cycle(out, env)
            case JobRequested():
                rec = self.jobs.get(p.job_id)
                ended = self.h.ended.get(p.job_id) if rec is None else None
                if rec is not None or ended is not None:
                    # the same request again (a retry) changes nothing, also once the job ended
                    if (p != rec.request) if rec is not None else (fingerprint(p) != ended.fingerprint):
                        self._emit(out, Rejected(job_id=p.job_id, code="duplicate_job_id", reasons=(Reason(
                            code="DuplicateJobId", plugin="Admission",
                            message="a different request already uses this job id; the first one stands"),)), env)
                elif self.retain_ms is not None and self.now_ms - env.event_time_ms >= self.retain_ms:
                    # older than what is remembered of finished jobs: it may repeat a request whose job ended and
                    # was forgotten, so it is not run (again)
                    self._emit(out, Rejected(job_id=p.job_id, code="stale_request", reasons=(Reason(
                        code="StaleRequest", plugin="Admission",
                        message=f"the request was made at {env.event_time_ms} ms and reached the scheduler at "
                                f"{self.now_ms} ms, more than {self.retain_ms} ms later: finished jobs are "
                                f"remembered that long, so it cannot be told from a repeat of one; send it again",
                        data={"event_time_ms": env.event_time_ms, "retain_ms": self.retain_ms}),)), env)
                elif env.source.startswith(GATEWAY_PREFIX) and self.h.pending_of.get(p.tenant, 0) >= self.max_pending:
                    # Slurm's MaxSubmitJobs, Kueue's queue limits: a tenant's burst waits at its own door, not in
                    # everyone's queue (what the pending queue costs each cycle is bounded by the tenants' caps)
                    self._emit(out, Rejected(job_id=p.job_id, code="too_many_pending", reasons=(Reason(
                        code="TooManyPending", plugin="Admission",
                        message=f"{p.tenant} has {self.max_pending} jobs waiting, the most a tenant may have; send "
                                f"it again once some of them are placed, or cancel some",
                        data={"pending": self.h.pending_of[p.tenant], "max_pending": self.max_pending}),)), env)
                else:
                    self.arrivals += 1
                    self.h.apply(Unpark(p.job_id))  # a forgotten job's id again: an old entry says nothing of it
                    rec = JobRecord(request=p, arrival=self.arrivals, request_event=env.event_id)
                    self.h.add_job(rec)
                    self.workload.observe(p)
                    self._typical()
                    if self._judge(out, env, rec):
                        return
                    if p.reservation_id:
                        self._use_reservation(out, env, rec)
                    self._cycle(out, env, only=rec)
            case JobCancelled():
                self._finish(out, env, p.job_id, self.now_ms)
                self._cycle(out, env)
            case JobStarted():
                rec = self.jobs.get(p.job_id)
                if rec is None:
                    self._ended_report(out, env, p, runs=True)
                elif self._superseded(out, env, rec, p.node, p.command_id, runs=True):
                    pass
                elif rec.phase in ("placed", "stopping", "migrating") and rec.started_ms < 0 and rec.hold is None \
                        and any(part.command_id == p.command_id for part in rec.parts):
                    # billed from its start, also when it was told to stop before the node said it started
                    self.h.apply(env, self._fact_ms(env))
            case JobCheckpointed():
                rec = self.jobs.get(p.job_id)
                if rec is None:
                    self._ended_report(out, env, p, runs=True)
                elif self._superseded(out, env, rec, p.node, p.command_id, runs=True):
                    pass
                elif rec.phase in ("running", "stopping", "migrating"):
                    self.h.checkpointed(rec, p.checkpoint or rec.checkpoint, self._fact_ms(env))
            case JobCompleted() | JobFailed():
                rec = self.jobs.get(p.job_id)
                if rec is None:
                    if self._ended_report(out, env, p, runs=False) is False:
                        self._cycle(out, env)
                elif not self._superseded(out, env, rec, p.node, p.command_id, runs=False):
                    if isinstance(p, JobCompleted) and not self._gang_complete(rec, p):
                        return  # a part of a gang is done; the others still run (docs/jobs.md, "Gangs")
                    if isinstance(p, JobFailed) and rec.hold is None and \
                            not failure_ends(rec.failures + 1, rec.request.retries):
                        self._retry(out, env, rec, p)  # a retry left (job_view's rule): requeued after a back-off
                    else:
                        self._finish(out, env, p.job_id, self._fact_ms(env))
                    self._cycle(out, env)
            case JobStopped():
                rec = self.jobs.get(p.job_id)
                if rec is None:
                    if self._ended_report(out, env, p, runs=False) is False:
                        self._cycle(out, env)
                elif not self._superseded(out, env, rec, p.node, p.command_id, runs=False):
                    self._requeue(out, env, p)
                    self._cycle(out, env)
            case QuotaSet():
                why = self.ledger.set_quota(p)
                if why:
                    self._emit(out, QuotaRejected(tenant=p.tenant, project=p.project, gpu_milli=p.gpu_milli,
                                                  code=why[0].code, reasons=why), env)
                self._cycle(out, env)
            case ReservationRequested():
                if p.reservation_id not in self.book.bookings:
                    booking, displaced, reasons = self.book.decide(p, self.index.capacity_milli)
                    for b in displaced:
                        self._end_hold(out, env, b, "displaced", (Reason(
                            code="Displaced", plugin="Reservation",
                            message=f"a stronger reservation ({p.reservation_id}) needs the capacity"),))
                    self._emit(out, ReservationDecided(reservation_id=p.reservation_id, status=booking.status,
                                                       reasons=reasons), env)
                    self._cycle(out, env)
            case ReservationCancelled():
                b = self.book.bookings.get(p.reservation_id)
                if b is not None and b.status in LIVE:
                    self._end_hold(out, env, b, "cancelled", ())
                    self._cycle(out, env)
            case SchedulerTick():
                if p.grace_s:  # the operator's grace periods, as the ticker read them (docs/jobs.md)
                    self.grace_s = grace_map(p.grace_s)
                if p.rendezvous_ports and tuple(p.rendezvous_ports) != self.rendezvous_ports:
                    self.rendezvous_ports = (p.rendezvous_ports[0], p.rendezvous_ports[1])
                if self.now_ms - self._usage_ms >= self.usage_tick_ms:
                    self._usage_ms = self.now_ms
                    for j in list(self.running):
                        self._accrue(out, env, self.jobs[j], self.now_ms)
                if self.now_ms - self._full_ms >= self.full_cycle_ms:
                    self.epoch += 1  # time alone can change answers (protection expiry, reservation windows)
                    self._flush = True
                if self.unsure and self.fleet.settled(self.now_ms):
                    self._judge_pending(out, env, list(self.unsure))
                self._cycle(out, env)

    # ---------------------------------------------------------------- lifecycle

    def _accrue(self, out: list[Envelope], env: Envelope, rec: JobRecord, end_ms: int | None = None) -> None:
        """Bill the run from where it was last billed to `end_ms` (default: now), one line per node. Intervals
        follow each other: the end never goes back before what a tick already billed, and a tick bills nothing
        twice. The first line of a run is written even when empty (a run that ended where it started)."""
        if rec.phase not in ("running", "stopping", "migrating") or rec.placement is None or rec.started_ms < 0:
            return
        start = rec.accrued_ms
        end = max(self.now_ms if end_ms is None else end_ms, start)
        if end == start and start > rec.started_ms:
            return
        r = rec.request
        for pl in rec.parts:  # one usage line per node: billing is by node, model and data center
            if not pl.assignments:
                continue  # a CPU-only job holds no card: no GPU time to bill (the price book prices GPU time)
            milli = sum(a.milli for a in pl.assignments)
            cu, _ = held(pl.assignments, lambda uuid, node=pl.node: self.card_model(node, uuid), r.compute_milli)
            inv = self.nodes[pl.node].inventory
            card_model = self.card_model(pl.node, pl.assignments[0].gpu_uuid)
            self._emit(out, UsageAccrued(
                tenant=r.tenant, project=r.project, job_id=r.job_id, tier=r.tier, node=pl.node, gpu_model=card_model,
                datacenter=inv.datacenter if inv else "", start_ms=start, end_ms=end, gpu_milli=milli,
                gpu_milli_ms=milli * (end - start), borrowed=pl.borrowed, cu_milli=cu, cu_milli_ms=cu * (end - start),
                reserved=rec.reserved, attempt=rec.attempt), env)
        self.h.note(rec, accrued_ms=end)

    def _release(self, out: list[Envelope], env: Envelope, rec: JobRecord, why: str) -> None:
        """Release every part the run holds (a hold's only in the scheduler's own view: it was never sent), and give
        its quota back."""
        self._uncharge(rec)  # it lets go of what was freed for it
        self.h.note(rec, completed_parts=())  # the run's parts that completed (a gang's): the next counts anew
        if rec.placement is None:
            return
        if self._unsettled:
            self._settle_for(rec.request.job_id)
        self.epoch += 1  # capacity freed: the whole queue may fit differently
        borrowed, milli, memory = rec.placement.borrowed, rec.held_milli, rec.held_memory_mib
        for part in rec.parts:
            if rec.hold is not None:  # a hold was never sent to a node: undo it in the scheduler's view only
                self.h.apply(envelope(ReleaseJob(command_id=f"release-{rec.request.job_id}", job_id=part.job_id,
                                                 node=part.node), source=SOURCE, seq=self._hold_seq(),
                                      time_ms=self.now_ms))
                continue
            self._emit(out, ReleaseJob(command_id=self._command_id(), job_id=rec.request.job_id, node=part.node,
                                       reasons=(Reason(code=why),), attempt=rec.attempt), env)
        for ev in self.ledger.release(rec.request, borrowed, reserved=rec.hold is not None or rec.reserved,
                                      milli=milli, memory=memory):
            self._emit(out, ev, env)

    def _finish(self, out: list[Envelope], env: Envelope, job_id: str, end_ms: int) -> None:
        rec = self.jobs.get(job_id)
        if rec is None or rec.phase == "done":
            return
        self._uncharge(rec)  # what its victims freed is nobody's in particular now
        self._accrue(out, env, rec, end_ms)
        self._release(out, env, rec, {"job.cancelled": "Cancelled", "job.failed": "Failed"}.get(env.kind, "Completed"))
        self.h.set_phase(rec, "done")
        self.unsure.pop(job_id, None)
        self._nominate(rec, None)

    def _gang_complete(self, rec: JobRecord, p: JobCompleted) -> bool:
        """Whether this completion ends the job: a job of one part, yes; a part of a gang is recorded, and the gang is
        done when every part of its run has completed (torchrun's: a worker exiting 0 is done, the group succeeds
        once all are). Meanwhile the gang keeps every part's cards, and is billed for them, as one allocation. A
        completion that does not say its gang's parts (`parts` 1: a producer that predates gangs' completions, such as
        the simulators that report a gang's first part only) or names no part of the run ends the job as before."""
        if len(rec.parts) < 2 or p.parts < 2:
            return True
        i = next((i for i, part in enumerate(rec.parts) if part.command_id == p.command_id), None)
        if i is None:
            return True
        if i not in rec.completed_parts:
            self.h.note(rec, completed_parts=tuple(sorted(rec.completed_parts + (i,))))
        return len(rec.completed_parts) == len(rec.parts)

    def _rendezvous(self, r: JobRequested, master: str) -> tuple[str, int]:
        """Where a job's parts meet (docs/jobs.md, "Gangs"): rank 0's node address (its inventory's, else its name)
        and a port of the operator's range that no other placed job of the scheduler's holds as its master port on
        that node. The walk starts at a point derived from the job id and attempt (crc32: the same in every process
        and replay), so a new attempt of the job does not take the port its previous, just-released run may still
        hold. With every port of the range taken, the walk's first port is given (the range is too small: an
        operator's choice, docs/operators.md)."""
        inv = self.nodes[master].inventory if master in self.nodes else None
        addr = (inv.address if inv is not None else "") or master
        first, last = self.rendezvous_ports
        size = last - first + 1
        held_ports = set()
        view = self.nodes.get(master)
        for j in (view.allocations if view is not None else ()):
            other = self.jobs.get(j)
            if other is not None and other.parts and other.parts[0].node == master and other.parts[0].master_port:
                held_ports.add(other.parts[0].master_port)
        attempt = self.jobs[r.job_id].attempt if r.job_id in self.jobs else 0
        start = (zlib.crc32(r.job_id.encode()) + attempt) % size
        for k in range(size):
            port = first + (start + k) % size
            if port not in held_ports:
                return addr, port
        return addr, first + start

    def _fact_ms(self, env: Envelope) -> int:
        """A node's own time for what it did (a job's start, checkpoint, end, a fault: the bill's intervals), never
        later than the log's: a node clock running ahead cannot bill the future."""
        return min(env.event_time_ms, self.now_ms)

    def _requeue(self, out: list[Envelope], env: Envelope, p: JobStopped) -> None:
        """The node stopped the job (checkpointed): billed to the stop, requeued to resume from the checkpoint. A
        stop the scheduler asked for to make room is a preemption (it counts towards protection); one for a drain
        or a removal, or the agent's own (shutdown, restart), is an interruption."""
        rec = self.jobs.get(p.job_id)
        if rec is None or rec.phase not in ("placed", "running", "stopping", "migrating"):
            return
        move = rec.migration if rec.phase == "migrating" else None
        preempted = rec.phase == "stopping" and not rec.stop_cause
        self._end_run(out, env, rec, "Stopped", p.checkpoint)
        if move is not None:
            # moved, not preempted: it resumes from its checkpoint on the planned node, before anything else
            self.h.note(rec, migration=None)
            self._nominate(rec, (move.to_node, ()), (move.to_node,))
        elif preempted:
            self.h.note(rec, preemptions=rec.preemptions + 1, preempted_at=rec.preempted_at + (self.now_ms,))
        else:
            self.h.note(rec, interruptions=rec.interruptions + 1)

    def _end_run(self, out: list[Envelope], env: Envelope, rec: JobRecord, why: str, checkpoint: str) -> None:
        """A run its node ended while the job goes on (stopped after a checkpoint, or failed with a retry left):
        billed up to the node's time of the end (never after now), released (`why`: the release's code), and
        pending again to resume from `checkpoint`, else its last one."""
        self._accrue(out, env, rec, self._fact_ms(env))
        self._release(out, env, rec, why)
        self.h.note(rec, checkpoint=checkpoint or rec.checkpoint, stop_cause="")
        self.h.set_phase(rec, "pending")

    def _retry(self, out: list[Envelope], env: Envelope, rec: JobRecord, p: JobFailed) -> None:
        """A run failed and the job has a retry left (Kubernetes' backoffLimit, Slurm's --requeue): the run ends as a
        stop does (`_end_run`: billed to its failure, released), and the job waits out a back-off in log time
        (streams/folds/exits.backoff_ms: 10 s doubling per failure, at most 5 min) before it is placed again,
        resuming from its last checkpoint. Its reason says which run failed, why, and when it is tried again; a
        move under way is called off (the job no longer runs to be moved)."""
        self._end_run(out, env, rec, "Failed", "")
        self._nominate(rec, None)
        wait = backoff_ms(rec.failures + 1)
        self.h.note(rec, migration=None, failures=rec.failures + 1, retry_at=self.now_ms + wait)
        heapq.heappush(self._backoff, (rec.retry_at, rec.request.job_id))
        runs, why = rec.request.retries + 1, failure_text(p.code, p.reason, p.exit_code, p.signal)
        data: dict[str, int | str] = {"failures": rec.failures, "retries": rec.request.retries, "attempt": rec.attempt,
                                      "retry_at_ms": rec.retry_at, "backoff_ms": wait, "exit": p.code or ""}
        if p.exit_code is not None:
            data["exit_code"] = p.exit_code
        if p.signal is not None:
            data["signal"] = p.signal
        self._pending(out, env, rec, (Reason(
            code="BackOff", plugin="Retry", nodes=(p.node,) if p.node else (), data=data,
            message=f"run {rec.failures} of {runs} failed ({why}); retrying from "
                    f"{rec.checkpoint or 'the start'} at {rec.retry_at} ms"),))

    def _backoff_over(self) -> None:
        """Failed runs whose back-off has ended by now: their jobs may be placed again, so the whole queue is
        tried (the epoch moves). An entry of a job that left the queue meanwhile (cancelled, placed) is dropped."""
        heap = self._backoff
        while heap and heap[0][0] <= self.now_ms:
            at, j = heapq.heappop(heap)
            rec = self.jobs.get(j)
            if rec is not None and rec.phase == "pending" and rec.retry_at == at:
                self.epoch += 1

    def _superseded(self, out: list[Envelope], env: Envelope, rec: JobRecord, node: str, command_id: str | None,
                    runs: bool) -> bool:
        """Whether a node's report about `rec` answers a command of a run that is no longer the job's (it was
        interrupted, moved or ended since). Such a report changes nothing; when it says the old run still runs
        (`runs`: started, checkpointed), the node is told to stop it: a release naming that run's attempt, which
        a newer run of the job on the same node survives (agents/node/fencing.py). Reports naming a command the
        scheduler did not send are judged as before (not ours to judge)."""
        attempt = rec.commands.get(command_id) if command_id else None
        if attempt is None:
            return False
        if attempt == rec.attempt and rec.placement is not None and rec.phase in (
                "placed", "running", "stopping", "migrating"):
            return False
        if runs and node:
            self._stop_superseded(out, env, rec.request.job_id, node, attempt, rec.attempt, rec.phase)
        return True

    def _stop_superseded(self, out: list[Envelope], env: Envelope, job_id: str, node: str, attempt: int,
                         current: int, state: str) -> None:
        self._emit(out, ReleaseJob(command_id=self._command_id(), job_id=job_id, node=node, attempt=attempt,
                                   reasons=(Reason(code="Superseded", plugin="Lifecycle", nodes=(node,),
                                                   message=f"attempt {attempt} of {job_id} was superseded (the job "
                                                           f"is at attempt {current}, {state})" if attempt != current
                                                   else f"attempt {attempt} of {job_id} had already been ended by the "
                                                        f"scheduler (the job is {state}): its run is stopped",
                                                   data={"attempt": attempt, "current_attempt": current}),)), env)

    def _ended_report(self, out: list[Envelope], env: Envelope, p, runs: bool) -> bool | None:
        """A node's report about a job with no live record: None when nothing is remembered of it (never seen, or
        forgotten: the report changes nothing); else whether it names a command of one of its runs -- every run
        of a finished job is superseded, and one that says it still runs (`runs`) is told to stop, as
        `_superseded` answers for a live record. A finished job's end reported again naming no command of its
        own (False) goes on as the end of a done record always did: nothing of the job changes, the queue is
        tried again (`_cycle`)."""
        e = self.h.ended.get(p.job_id)
        if e is None:
            return None
        attempt = e.commands.get(p.command_id) if p.command_id else None
        if attempt is None:
            return False
        if runs and p.node:
            self._stop_superseded(out, env, p.job_id, p.node, attempt, e.attempt, "done")
        return True

    # ---------------------------------------------------------------- failures and node lifecycle

    def _node_changed(self, out: list[Envelope], env: Envelope, before: node_view.NodeView | None,
                      after: node_view.NodeView) -> None:
        """What a node fact means for the work on it: a node silent for two heartbeats (node.liveness alive=false)
        or a card with a fatal fault interrupts its jobs; a drain or a removal checkpoints them and moves them off.
        A node leaving the pool (removed) or shrinking may make waiting requests unsatisfiable."""
        node = after.node
        if before is not None and before.alive and not after.alive:
            p = env.payload
            last = min(p.last_heartbeat_ms, self.now_ms) if isinstance(p, NodeLiveness) else self.now_ms
            self._interrupt_on(out, env, node, None, "NodeLost", last, (Reason(
                code="NodeLost", plugin="Lifecycle", nodes=(node,), data={"last_heartbeat_ms": last},
                message=f"{node} has been silent for two heartbeats (last at {last} ms)"),))
        bad = [u for u in after.unhealthy if before is None or u not in before.unhealthy]
        if bad:
            self._interrupt_on(out, env, node, frozenset(bad), "GpuFault", self._fact_ms(env), tuple(Reason(
                code="GpuFault", plugin="Lifecycle", nodes=(node,), data={"gpu_uuid": u},
                message=f"card {u} on {node} failed: {after.unhealthy[u]}") for u in bad))
        if after.removed:
            self._move_off(out, env, node, "NodeRemoved", f"{node} was removed from the pool")
        elif after.cordoned and after.drain:
            self._move_off(out, env, node, "Drain", f"{node} is being drained")
        inv = after.inventory if not after.removed else None
        if self.fleet.update(node, inv, self.now_ms) and self.pending:
            self._judge_pending(out, env, sorted(self.pending, key=lambda j: self.jobs[j].arrival))

    def _on_node(self, node: str, cards: frozenset[str] | None = None) -> list[JobRecord]:
        """Jobs holding capacity on `node` (on one of `cards`, when given), in the view's order."""
        view = self.nodes[node]
        out = []
        for j, h in view.allocations.items():
            rec = self.jobs.get(j)
            if rec is None or rec.phase not in ("placed", "running", "stopping", "migrating"):
                continue
            if cards is None or any(a.gpu_uuid in cards for a in h.slices):
                out.append(rec)
        return out

    def _interrupt_on(self, out: list[Envelope], env: Envelope, node: str, cards: frozenset[str] | None, code: str,
                      at_ms: int, reasons: tuple[Reason, ...]) -> None:
        """Interrupt every job on the node (or on these cards): billed to `at_ms` (the last heartbeat, the fault),
        never before what is already billed nor after now; released everywhere (a gang as a whole); requeued to
        resume from its last checkpoint ahead of newer work of its tier."""
        for rec in self._on_node(node, cards):
            r = rec.request
            self.unsure.pop(r.job_id, None)
            if rec.hold is not None:
                self._hold_again(out, env, rec, code)
                continue
            self._accrue(out, env, rec, min(at_ms, self.now_ms))
            billed = rec.accrued_ms if rec.started_ms >= 0 else 0
            self._emit(out, JobInterrupted(job_id=r.job_id, node=node, code=code, attempt=rec.attempt,
                                           billed_to_ms=max(billed, 0), checkpoint=rec.checkpoint, reasons=reasons,
                                           commands=tuple(part.command_id for part in rec.parts)), env)
            self._release(out, env, rec, code)
            self.h.note(rec, stop_cause="")
            self.h.set_phase(rec, "pending")
            self.h.note(rec, interruptions=rec.interruptions + 1)

    def _move_off(self, out: list[Envelope], env: Envelope, node: str, code: str, why: str) -> None:
        """Checkpoint-and-move every job off the node (a drain, a removal): each is told to checkpoint and stop
        (cmd.preempt naming the drain), and once stopped is requeued ahead of newer work of its tier and placed
        elsewhere; nothing new comes to the node meanwhile (it is cordoned or removed). A reservation's hold is held
        again elsewhere at once."""
        for rec in self._on_node(node):
            if rec.phase == "stopping":
                continue  # already told to stop
            if rec.hold is not None:
                self._hold_again(out, env, rec, code)
                continue
            self._command(out, PreemptJob(command_id=self._command_id(), job_id=rec.request.job_id, node=node,
                                          attempt=rec.attempt, grace_s=self.grace_s[rec.request.tier],
                                          reasons=(Reason(
                                              code=code, plugin="Lifecycle", nodes=(node,),
                                              message=f"{why}: checkpoint and move"),)), env)

    def _hold_again(self, out: list[Envelope], env: Envelope, rec: JobRecord, why: str) -> None:
        """A reservation's hold on a node that failed or leaves: released, and queued to be held elsewhere."""
        self._release(out, env, rec, why)
        rec.hold.status = "queued"
        self.h.set_phase(rec, "pending")

    # ---------------------------------------------------------------- admission against the fleet

    def _typical(self) -> None:
        """Bring the workload's typical set and the fleet's hosts (scoring.Workload) up to date now, on the input
        that changed them (a request, a node's facts), rather than when a placement next asks: which waiting jobs
        are tried (parked or not) then decides nothing about the scores."""
        self.workload.fleet(self.index)
        self.workload.version()

    def _judge(self, out: list[Envelope], env: Envelope, rec: JobRecord) -> bool:
        """Reject `rec` at once when no placement in the fleet could ever hold it (True: rejected). While the
        fleet still grows, a request that looks unsatisfiable waits and is judged again once it has settled."""
        why = self.fleet.never_fits(rec.request)
        if why is None and self.fleet.kinds:
            self.unsure.pop(rec.request.job_id, None)
            return False
        if why is None or not self.fleet.settled(self.now_ms):
            self.unsure[rec.request.job_id] = None
            return False
        self.unsure.pop(rec.request.job_id, None)
        self.h.set_phase(rec, "done")
        self._nominate(rec, None)
        self._emit(out, Rejected(job_id=rec.request.job_id, code="unsatisfiable", reasons=(Reason(
            code="Unsatisfiable", plugin="Admission",
            message="Requested node configuration is not available: no node of the pool could ever hold it"),)
            + why), env, rec.request_event)  # caused by its request, even when judged later (a tick, a node's loss)
        return True

    def _judge_pending(self, out: list[Envelope], env: Envelope, job_ids) -> None:
        for j in job_ids:
            rec = self.jobs.get(j)
            if rec is not None and rec.phase == "pending" and rec.hold is None and rec.nominated is None:
                self._judge(out, env, rec)
            else:
                self.unsure.pop(j, None)

    # ---------------------------------------------------------------- the cycle

    def pending_order(self) -> list[JobRecord]:
        """Jobs that preemption freed capacity for come first (the capacity was stopped for them); then the claim
        order (claims.py: standing, tier, on a reservation); among equal claims, stopped work resumes before newer
        work; then arrival order."""
        return sorted((self.jobs[j] for j in self.pending), key=self._queue_key)

    def _queue_key(self, r: JobRecord, standing: bool | None = None) -> tuple:
        """`standing`: its standing when it is not now's (`_parked_key`)."""
        if standing is None:
            standing = standing_now(self.h, self.ledger, r)
        return (0 if r.nominated else 1, -standing, TIER_RANK[r.request.tier],
                0 if r.reserved else 1, 0 if r.preemptions or r.interruptions else 1, r.arrival)

    def _cycle(self, out: list[Envelope], cause: Envelope, only: JobRecord | None = None) -> None:
        """One scheduling cycle, a session in the manner of Volcano's and KAI's (docs/scheduler.md, "A cycle"): the
        queue's order is taken once at its start (`_open`); each job in it goes through the actions in their fixed
        order -- allocate, defragment, reclaim, preempt (`ACTIONS`) -- until one decides it, and a job none decides
        is left waiting, its reasons said (`_leave_waiting`). Everything the cycle emits goes into one `Statement`,
        which is committed once, at the end, to the step's outputs."""
        self.cycle += 1
        h = self.h
        stmt = self._stmt = Statement(out, cause, h.nodes)
        h.frozen = True  # a snapshot: no fact is folded into the holdings until the cycle ends
        try:
            self._session(stmt, only)
        finally:
            h.frozen = False
            self._stmt = None
        stmt.commit()
        self._end_settled()  # the places are needed in this cycle only

    def _session(self, stmt: Statement, only: JobRecord | None) -> None:
        """The cycle's body over its statement: the queue, and each job through the actions."""
        self._reservation_windows(stmt.out, stmt.cause)
        queue, full = self._open(only)
        failed: dict[tuple, list[tuple[tuple[int, ...], tuple]]] = {}  # kind -> (need, (result, quiet)), in order
        h = self.h
        i, last = 0, None
        while True:
            if full and (h.opened or h.unclosed) and h.parked:
                # A parked job keeps its place in the queue's order: one that something in this cycle woke (a
                # nominated job ahead took its node, ending its claim) is tried where a cycle over the whole queue
                # would try it -- if that place is still ahead (else it is tried in the next cycle, as it would be)
                for key, rec in self._woken():
                    if last is None or key > last:
                        bisect.insort(queue, (key, rec), lo=i, key=_first)
            if i >= len(queue):
                break
            last, rec = queue[i]
            i += 1
            attempt = self._allocate(stmt, rec, failed)
            if attempt is None:
                continue  # decided: placed, carving a MIG card for it, or nothing new to say
            for action in ACTIONS:
                if action(self, stmt, attempt):
                    break
            else:
                self._leave_waiting(stmt, attempt, failed)

    def _open(self, only: JobRecord | None) -> tuple[list[tuple[tuple, JobRecord]], bool]:
        """The cycle's queue, in order, taken at its start: `only` alone when nothing moved since the last full
        cycle, else every pending job not parked (woken ones first back from the parked) -- and whether it is
        full."""
        if only is not None and self.epoch == self._full_epoch:
            return ([(self._queue_key(only), only)] if only.phase == "pending" else []), False
        self._wake()
        self._park_places()
        parked = self.parked
        queue = sorted(((self._queue_key(self.jobs[j]), self.jobs[j]) for j in self.pending if j not in parked),
                       key=_first)
        self._full_epoch, self._full_ms = self.epoch, self.now_ms
        return queue, True

    def _allocate(self, stmt: Statement, rec: JobRecord, failed: dict) -> Attempt | None:
        """The allocate action: place the job on free capacity within its quota (`place`; on cheaper cards if what
        was found holds more than its quota lets it hold). None when that decided it (placed, a MIG carve asked for
        it, or it waits for one, or waits out a back-off); else what the attempt found, for the next actions."""
        out, cause = stmt.out, stmt.cause
        if rec.retry_at > self.now_ms:
            return None  # a failed run's back-off: not placed again before it ends (_retry); its reason stands
        r = rec.request
        if rec.mig_wait is not None:
            node, card = rec.mig_wait
            if card in self.nodes[node].mig_pending and self.nodes[node].schedulable:
                return None  # the card is being carved for it; nothing new to say
            self.h.note(rec, mig_wait=None)
        quota = self._admit(rec)
        if quota.blocked:
            self._unnominate_blocked(rec)
            return Attempt(rec, quota=quota, quiet=self._quiet(rec))
        standing = standing_now(self.h, self.ledger, rec)
        quiet = self._quiet(rec)
        kind = (TIER_RANK[r.tier], r.tenant, r.project, standing, r.gang, quiet is not None, r.isolation_asked) \
            if (r.constraints is _NO_CONSTRAINTS or r.constraints == _NO_CONSTRAINTS) and not rec.reserved else None
        need = (r.compute_milli, r.gpu_memory_mib, r.cpu_milli, r.memory_mib)
        dominated = next((why for f, why in failed.get(kind, ()) if _at_least(need, f)),
                         None) if kind and rec.nominated is None else None
        if dominated is not None:
            # It asks for at least as much as a job of the same kind (tier, account, standing: the same claim,
            # the same preemption candidates) that just failed, and nothing was freed since: it fails too.
            self._unplaced(out, cause, rec, dominated, None)
            if quiet is not None:
                self._park(rec, standing)
            return None
        exclude = self._claimed_from(rec)
        barred = self._barred(rec, standing) if quiet is not None else frozenset()
        result = self._still_unplaced(rec, exclude, barred) if rec.nominated is None else None
        if result is None:
            result = place(self.index, self.nodes, r, self.workload, self.candidates,
                           prefer=rec.nominated[0] if rec.nominated else None, exclude=exclude, barred=barred)
            if rec.nominated is None and isinstance(result, Unschedulable):
                self.h.note(rec, miss_memo=(self.h.view_seq, exclude | barred, self.node_epoch, result.seen))
        if isinstance(result, MigPlan):
            self._reconfigure(out, cause, rec, result)
            return None
        if not isinstance(result, Placement):
            return Attempt(rec, result=result, quiet=quiet, standing=standing, kind=kind, need=need)
        holding = self._holding(result, r)
        if holding != (r.compute_milli, r.gpu_memory_mib):
            quota = self._admit(rec, holding)  # charged for what it would hold, not what it asked
            if quota.blocked and rec.nominated is None:
                cheaper = self._within_quota(rec, result, holding, exclude, barred)
                if cheaper is not None:
                    result, holding, quota = cheaper
            if quota.blocked:
                self._unnominate_blocked(rec)
                return Attempt(rec, quota=quota, quiet=quiet, holding=holding)
        self._bind(out, cause, rec, result, quota, holding)
        return None

    def _defragment_action(self, stmt: Statement, a: Attempt) -> bool:
        """The defragment action: a job no node took although the pool has its cards in total (`_defragment`)."""
        if a.quota is not None or a.rec.nominated is not None or a.quiet is not None:
            return False
        return self._defragment(stmt.out, stmt.cause, a.rec)

    def _reclaim_action(self, stmt: Statement, a: Attempt) -> bool:
        """The reclaim action: a job its own account's quota keeps waiting stops that account's weaker work
        (`_preempt_for_quota`); not while it is in its quiet window."""
        if a.quota is None or a.quiet is not None:
            return False
        return self._preempt_for_quota(stmt.out, stmt.cause, a.rec, a.quota, a.holding)

    def _preempt_action(self, stmt: Statement, a: Attempt) -> bool:
        """The preempt action: a job no node took stops weaker work by the claim order (`_preempt_for`); not while
        it is in its quiet window."""
        if a.quota is not None or a.quiet is not None:
            return False
        return self._preempt_for(stmt.out, stmt.cause, a.rec)

    def _leave_waiting(self, stmt: Statement, a: Attempt, failed: dict) -> None:
        """No action decided the job: it waits, told why (its quota's reasons, or what every node said); one in its
        quiet window that no node took is parked."""
        rec = a.rec
        if a.quota is not None:
            self._pending(stmt.out, stmt.cause, rec, a.quota.reasons)
            return
        self._unplaced(stmt.out, stmt.cause, rec, a.result, a.quiet)
        if a.kind:
            failed.setdefault(a.kind, []).append((a.need, (a.result, a.quiet)))
        if a.quiet is not None:
            self._park(rec, a.standing)

    def _park(self, rec: JobRecord, standing: bool) -> None:
        """`rec`, in its quiet window, was not placed: it leaves the queue (`_wake` says when it comes back). Not a
        job nominated, on a reservation or waiting for a MIG carve; nor a borrowing one barred from a node that
        it would not be barred from within quota (its standing may move with any holder of its account: it stays in
        the queue)."""
        if rec.nominated is not None or rec.reserved or rec.hold is not None or rec.mig_wait is not None:
            return
        barred = self._barred(rec, standing)
        if not standing and barred != self._barred(rec, True):
            return
        r = rec.request
        self.h.apply(Park(r.job_id, r.tenant, self._claimed_from(rec) | barred, r.tier, self.cycle,
                          quiet_until(rec.preempted_at, self.preemption)))

    def _park_places(self) -> None:
        """At a full cycle's start: each parked job's place in the queue's order as it stands now (`_queue_key`) is
        needed only if something in this cycle wakes it (`_woken`). It is worked out then, from its tenant's sums as
        they are -- or, should the cycle have changed them first, as they were at the cycle's start: `_settle`
        marks their versions just before the first change (and keeps the changes since in their logs)."""
        self._end_settled()
        self._unsettled.update(self.h.parked_of)

    def _settle(self, tenant: str) -> None:
        """Before this cycle first changes `tenant`'s sums: the versions its parked jobs' places are read at."""
        self._unsettled.discard(tenant)
        if tenant not in self.h.parked_of:
            return
        at = self._settled_at[tenant] = {}
        for key, s in self.h.sums.items():
            if key[0] == tenant:
                at[key] = s.version
                s.pin = s.version  # the changes after it stay in the log until the cycle ends (Sums.ahead_at)

    def _end_settled(self) -> None:
        """The places are needed in one cycle only: the marks and the logs' pins go."""
        self._unsettled.clear()
        for tenant, at in self._settled_at.items():
            for key in at:
                s = self.h.sums.get(key)
                if s is not None:
                    s.pin = None
        self._settled_at.clear()

    def _settle_for(self, job_id: str) -> None:
        """Before a command or fact about `job_id` changes its tenant's sums in a cycle (`_park_places`)."""
        if self._unsettled:
            rec = self.jobs.get(job_id)
            if rec is not None and rec.request.tenant in self._unsettled:
                self._settle(rec.request.tenant)

    def _parked_key(self, rec: JobRecord) -> tuple:
        """A parked job's place in the queue's order at this cycle's start."""
        at = self._settled_at.get(rec.request.tenant)
        if at is None:  # its tenant's sums have not moved in this cycle
            return self._queue_key(rec)
        return self._queue_key(rec, standing_at(self.h, self.ledger, rec, at))

    def _woken(self) -> list[tuple[tuple, JobRecord]]:
        """(place in the queue at this cycle's start, job) of the jobs parked before this cycle that `_wake` woke."""
        out = []
        for j, cycle in self._wake().items():
            rec = self.jobs.get(j)
            if cycle != self.cycle and rec is not None and rec.phase == "pending":
                out.append((self._parked_key(rec), rec))
        return out

    def _wake(self) -> dict[str, int]:
        """Parked jobs go back to the queue when their last attempt may no longer hold: a node not closed to them
        then changed its view other than by a placement (Holdings.opened: a stop, an end, a resize, a MIG carve);
        a node closed to them then is no longer closed to their tier at its best standing (a claim or a bar ended);
        their quiet window ended; any node's facts or any quota changed; or the timed full cycle. Otherwise every
        node open to one of them is the same or fuller and none is newly open: `place` would fail again. (An entry
        of a job that left the queue otherwise -- cancelled, judged unsatisfiable -- is dropped on the next wake of
        all; a new request under its id is never parked: `_handle` unparks it.) Returns the jobs woken: job -> the
        cycle it was parked in."""
        h = self.h
        h.apply(ExpireFreed(self.now_ms))
        mark = (self.node_epoch, self.ledger.quota_version)
        parked = h.parked
        woken: dict[str, int] = {}
        if parked:
            if self._flush or mark != self._park_mark:
                woken = {j: p[2] for j, p in parked.items()}
                h.apply(UnparkAll())
            else:
                heap = h.park_until
                while heap and heap[0][0] <= self.now_ms:
                    j = heapq.heappop(heap)[1]
                    got = parked.get(j)
                    if got is not None:
                        h.apply(Unpark(j))
                        woken[j] = got[2]
                opened = h.opened
                if opened:
                    claimed = None
                    for closed in [c for c in h.parked_by if not opened <= c]:
                        extra = opened - closed
                        claimed = h.claimed_all() if claimed is None else claimed
                        if extra <= claimed:
                            # every node that opened for them is claimed by a nominated job, ahead of every job
                            # not nominated: still closed to them. They stay parked, closed to those nodes too, so
                            # the claim's end wakes them (`unclosed`) -- a stop on a node its preemptor claims
                            # woke every victim parked before the claim, to fail and park again
                            h.apply(Reclose(closed, closed | extra))
                            continue
                        for j in list(h.parked_by[closed]):
                            woken[j] = parked[j][2]
                            h.apply(Unpark(j))
                if h.unclosed:
                    claimed = h.claimed_all()
                    for closed in [c for c in h.parked_by if not c.isdisjoint(h.unclosed)]:
                        left = [n for n in closed & h.unclosed if n not in claimed]
                        tiers = {t for t in Tier if any(not self._barred_at_best(n, t) for n in left)}
                        if tiers:
                            for j in [j for j in h.parked_by[closed] if parked[j][1] in tiers]:
                                woken[j] = parked[j][2]
                                h.apply(Unpark(j))
        h.apply(Woke())
        self._flush = False
        self._park_mark = mark
        return woken

    def _barred_at_best(self, node: str, tier: Tier) -> bool:
        """Whether `node` is barred to quiet jobs of this tier even when they stand within quota (`_barred`)."""
        f = self.freed_for.get(node)
        return f is not None and f[1] > self.now_ms and claim(True, tier, False) <= f[0]

    def _within_quota(self, rec: JobRecord, result: Placement, holding: tuple[int, int], exclude: frozenset[str],
                      barred: frozenset[str]):
        """A placement on cheaper cards when the one found would hold more than the quota lets the job have now
        (Kueue's "try the next flavor"): cards are charged by their model's compute units, so 2 whole H100s for a
        3,000 milli-CU, 100 GiB request hold 6,340 milli-CU where 3 A100s hold 3,000. The models whose cards cost
        at least as much as the dearest card of the last try are left out, one price step at a time, until a
        placement's holding is admitted or no model is left (then None: the job waits with the first try's
        quota reason). Returns (placement, holding, admission); the placement's reasons say what was passed over."""
        r = rec.request
        models = allowed_models(self.index, r)
        first, first_holding = result, holding
        while True:
            dearest = max(gpu_model(self.card_model(p.node, a.gpu_uuid)).cu_milli
                          for p in result.parts for a in p.assignments)
            models = [m for m in models if gpu_model(m).cu_milli < dearest]
            if not models:
                return None
            narrowed = r.model_copy(update={"constraints": r.constraints.model_copy(update={"models": tuple(models)})})
            result = place(self.index, self.nodes, narrowed, self.workload, self.candidates, exclude=exclude,
                           barred=barred)
            if not isinstance(result, Placement):
                return None
            holding = self._holding(result, r)
            quota = self._admit(rec, holding)
            if not quota.blocked:
                passed = sorted({self.card_model(p.node, a.gpu_uuid) for p in first.parts for a in p.assignments})
                return replace(result, reasons=result.reasons + (Reason(
                    code="CheaperCards", plugin="Quota", nodes=tuple(p.node for p in first.parts),
                    message=f"the best fit on {', '.join(passed)} would hold {first_holding[0]} milli-CU, beyond "
                            f"what {r.tenant}'s quota allows now: placed on cards that hold {holding[0]}",
                    data={"passed_over": ",".join(passed), "passed_over_milli": first_holding[0],
                          "held_milli": holding[0]}),)), holding, quota

    def _still_unplaced(self, rec: JobRecord, exclude: frozenset[str], barred: frozenset[str]):
        """What `place` would answer for a job whose last attempt no node took, when it is sure to be the same: no
        node's facts changed (the node epoch), no node open to it now changed its view since, and every node closed
        to it then is still closed -- so each node it may use gives the answer it gave then. Else None (try it).
        The answer's reasons are worked out, by `place`, only if read (before anything changes, as any attempt's)."""
        m = rec.miss_memo
        if not m or m[2] != self.node_epoch:
            return None
        closed = exclude | barred if barred else exclude
        if not m[1] <= closed or self.h.views_changed_since(m[0], closed):
            return None
        self.workload.fleet(self.index)  # as `place` would have (a no-op while the hosts stand still)
        self.h.note(rec, miss_memo=(self.h.view_seq, closed, m[2], m[3]))
        r = rec.request
        return Unschedulable(explain=lambda never: place(self.index, self.nodes, r, self.workload, self.candidates,
                                                         exclude=exclude, barred=barred).reasons_for(never),
                             seen=m[3])

    def _admit(self, rec: JobRecord, holding: tuple[int, int] | None = None) -> Admission:
        """The quota's answer for `rec` (holding: what a placement would hold; the request's amounts before one
        is found, a lower bound). A reservation's hold, and the job that takes it, are reserved in-quota capacity:
        the booking was the admission (reservations.py), so they are charged (used and reserved) but never
        borrowed nor kept waiting by the quota. What a nominated job ahead of it waits for counts as used
        (`_quota_kept`)."""
        if rec.reserved or rec.hold is not None:
            rid = rec.hold.request.reservation_id if rec.hold is not None else rec.request.reservation_id
            return Admission(False, False, (Reason(
                code="Reserved", plugin="Quota", message=f"on reservation {rid}",
                data={"request_milli": holding[0] if holding else rec.request.compute_milli}),))
        r = rec.request
        if r.cpu_only:
            # no card, so no GPU quota to charge: its CPU is bounded by the tenant's quota instead (CPU_PER_CU
            # milli-CPU per milli-CU of the borrowing cap), or one tenant's CPU-only jobs could take every host's CPU
            # and strand the cards other tenants' jobs need. No quota in force (the open ledger): no bound.
            q = self.ledger.tenant_quota(r.tenant)
            if q is not None:
                cap = q.gpu_milli * q.overcommit_pct // 100 * CPU_PER_CU
                used = self.h.host_cpu.get(r.tenant, 0)
                if used + r.cpu_milli > cap:
                    return Admission(True, False, (Reason(
                        code="CpuOnlyCapExceeded", plugin="Quota", message=(
                            f"{r.tenant}'s CPU-only jobs hold {used} milli-CPU; this one's {r.cpu_milli} would pass "
                            f"{cap} ({CPU_PER_CU} milli-CPU per milli-CU of its quota's cap): it waits for one to "
                            f"end"), data={"used_cpu_milli": used, "request_cpu_milli": r.cpu_milli,
                                           "cap_cpu_milli": cap}),))
        need, mem = holding if holding else (None, None)
        kept = self._quota_kept(rec)
        # a retried queue asks the same question for many jobs of one account and shape: answered once while the
        # ledger and the pool's capacity stand still (the answer depends on nothing else)
        key = (r.tenant, r.project, r.compute_milli, r.gpu_memory_mib, need, mem, self.index.capacity_milli,
               tuple(sorted(((k, tuple(v)) for k, v in kept.items()), key=repr)) if kept else ())
        memo = self._admit_memo
        if memo[0] != self.ledger.version:
            memo = self._admit_memo = (self.ledger.version, {})
        got = memo[1].get(key)
        if got is None:
            got = memo[1][key] = self.ledger.admit(r, self.index.capacity_milli, need, mem, freed=kept)
        return got

    def _quota_kept(self, rec: JobRecord) -> dict | None:
        """The quota kept for jobs nominated ahead of `rec` in the queue, of its tenant, while their victims stop:
        what they asked counts as used in its accounts (a negative `freed` for Ledger.admit). As a nominated job's
        nodes are closed to jobs behind it (`_claimed_from`), so is the quota its victims free: a job behind it --
        one of those victims, requeued -- does not take it back and make it stop someone again (a loop)."""
        if not self.nominations:
            return None
        t = rec.request.tenant
        mine = None
        kept: dict | None = None
        for o in self.nominations.values():
            if o is rec or o.request.tenant != t or o.phase != "pending" or o.reserved or o.hold is not None \
                    or o.nominated is None or not o.nominated[1]:
                continue
            if not self._victims_stopping(o):
                continue  # its victims are gone: it takes what they freed now, or plans again
            if rec.nominated is not None:  # else every nominated job is ahead of it (`_queue_key`)
                mine = self._queue_key(rec) if mine is None else mine
                if self._queue_key(o) >= mine:
                    continue
            kept = {} if kept is None else kept
            for k in ((t, None), (t, o.request.project)):
                f = kept.setdefault(k, [0, 0])
                f[0] -= o.request.compute_milli
                f[1] -= o.request.gpu_memory_mib
        return kept

    def _holding(self, result: Placement, r: JobRequested) -> tuple[int, int]:
        """What a placement of `r` holds in the quota's units (quota.held), over all its parts."""
        cu = mem = 0
        for part in result.parts:
            c, m = held(part.assignments, lambda uuid, node=part.node: self.card_model(node, uuid), r.compute_milli)
            cu, mem = cu + c, mem + m
        return cu, mem

    def _bind(self, out: list[Envelope], cause: Envelope, rec: JobRecord, result: Placement, quota,
              holding: tuple[int, int]) -> None:
        r = rec.request
        if rec.hold is None:
            self.h.note(rec, attempt=rec.attempt + 1)
        gang = len(result.parts)
        nodes = tuple(p.node for p in result.parts) if gang > 1 else ()
        # a program's parts meet at rank 0's node (a stand-in without a program needs no rendezvous)
        master_addr, master_port = self._rendezvous(r, result.parts[0].node) if (
            rec.hold is None and (r.command or r.image)) else ("", 0)
        cmds = []
        for i, part in enumerate(result.parts):
            if rec.hold is not None:
                cmd = PlaceJob(command_id=f"hold-{r.job_id}-{i}", job_id=r.job_id, tenant=r.tenant, node=part.node,
                               assignments=part.assignments, cpu_milli=part.cpu_milli, memory_mib=part.memory_mib,
                               borrowed=quota.borrowed, gang_size=gang, gang_index=i, gang_nodes=nodes)
                if self._unsettled:
                    self._settle_for(r.job_id)
                self.h.apply(envelope(cmd, source=SOURCE, seq=self._hold_seq(), time_ms=self.now_ms))
                cmds.append(cmd)
                continue
            cmd = PlaceJob(
                command_id=self._command_id(), job_id=r.job_id, tenant=r.tenant, node=part.node,
                assignments=part.assignments, cpu_milli=part.cpu_milli, memory_mib=part.memory_mib,
                duration_s=r.duration_s, checkpoint_interval_s=r.checkpoint_interval_s, resume_from=rec.checkpoint,
                borrowed=quota.borrowed, gang_size=gang, gang_index=i, gang_nodes=nodes,
                reasons=result.reasons + quota.reasons + (Reason(code="Cycle", data={"cycle": self.cycle}),),
                attempt=rec.attempt, tier=r.tier, master_addr=master_addr, master_port=master_port, **r.program)
            self._command(out, cmd, cause)
            cmds.append(cmd)
        for ev in self.ledger.hold(r, quota.borrowed, reserved=rec.hold is not None or rec.reserved,
                                   milli=holding[0], memory=holding[1]):
            self._emit(out, ev, cause)
        if rec.nominated is not None and rec.nominated[1]:
            self._recharge(rec)  # its victims have stopped: what they freed beyond its need stays its claim's
        self._nominate(rec, None)
        if rec.hold is not None:
            rec.hold.status = "active"
            self._emit(out, ReservationDecided(reservation_id=rec.hold.request.reservation_id, status="active",
                                               node=result.node, reasons=result.reasons,
                                               assignments=tuple(a for p in result.parts for a in p.assignments)),
                       cause)

    # ---------------------------------------------------------------- reservations

    def _hold_seq(self) -> int:
        # Holds change only the scheduler's own view; they share its command sequence so the view's per-source
        # order stays the order of the scheduler's decisions.
        self.out_seq += 1
        return self.out_seq

    def _reservation_windows(self, out: list[Envelope], cause: Envelope) -> None:
        for b in self.book.closing(self.now_ms):
            self._end_hold(out, cause, b, "expired", (Reason(code="WindowPassed", plugin="Reservation"),))
        for b in self.book.opening(self.now_ms):
            if b.hold_id not in self.jobs or self.jobs[b.hold_id].phase == "done":
                self.arrivals += 1
                self.h.add_job(JobRecord(request=b.hold_request(), arrival=self.arrivals, hold=b))
                b.status = "queued"
                self.epoch += 1

    def _end_hold(self, out: list[Envelope], cause: Envelope, b: Booking, status: str,
                  reasons: tuple[Reason, ...], node: str = "") -> None:
        rec = self.jobs.get(b.hold_id)
        if rec is not None and rec.phase != "done":
            if rec.placement is not None:
                node = node or rec.node
                self._release(out, cause, rec, status)
            self.h.set_phase(rec, "done")
        b.status = status
        self._emit(out, ReservationDecided(reservation_id=b.request.reservation_id, status=status, node=node,
                                           reasons=reasons), cause)

    def _use_reservation(self, out: list[Envelope], cause: Envelope, rec: JobRecord) -> None:
        """The job that names a reservation takes its hold's capacity: the hold goes, the job is tried there first."""
        b = self.book.bookings.get(rec.request.reservation_id)
        if b is None or b.request.tenant != rec.request.tenant or b.status not in LIVE:
            return
        hold = self.jobs.get(b.hold_id)
        node = hold.node if hold is not None and hold.phase == "placed" else ""
        self._end_hold(out, cause, b, "used", (Reason(code="UsedBy", plugin="Reservation",
                                                      data={"job_id": rec.request.job_id}),), node)
        self.h.note(rec, reserved=True)  # the booked capacity is the tenant's own: charged as reserved, billed as such
        if node:
            self._nominate(rec, (node, ()), (node,))

    def _reconfigure(self, out: list[Envelope], cause: Envelope, rec: JobRecord, plan: MigPlan) -> None:
        """Carve a MIG instance out of idle slices; the job is placed once the node reports the new layout."""
        self._emit(out, MigReconfigure(
            command_id=self._command_id(), node=plan.node, gpu_uuid=plan.gpu_uuid, layout=plan.layout,
            reasons=(Reason(code="MigCarve", plugin="GpuFit", nodes=(plan.node,),
                            message=f"new {plan.profile} instance in idle slices for {rec.request.job_id}",
                            data={"for_job": rec.request.job_id, "profile": plan.profile}),)), cause)
        self.h.note(rec, mig_wait=(plan.node, plan.gpu_uuid))
        self._pending(out, cause, rec, (Reason(
            code="MigReconfiguring", plugin="GpuFit", nodes=(plan.node,),
            message=f"waiting for {plan.node} to create a {plan.profile} instance"),))

    # ---------------------------------------------------------------- preemption and reclaim

    def _victims(self, search: Search, key) -> LazyVictims:
        """Every node's candidate victims for the search's job (multi-node gang plans may need them all), each node's
        worked out when the plan first looks at it; the nodes named are those the victim index names (some may hold
        nobody)."""
        return LazyVictims(self._victim_nodes(search, key),
                           lambda name: self._victims_on(self.nodes[name], search, key),
                           lambda name: self._victim_ids_on(self.nodes[name], search, key))

    def _victim_nodes(self, search: Search, key):
        """The nodes that may hold a victim for the search's job of claim `key`, in node order (the victim index; a
        superset of the nodes `_victims_on` finds anyone on, and the same order as a walk over every node)."""
        self._sync_victim_index()
        return self.victim_index.in_order(self.nodes, self.victim_index.nodes_for(search.tables(key)))

    def _rule(self, o, search, key) -> str | None:
        """The rule that lets the claim search stop `o` for claim `key` (Search.rule), or None: protected, or the
        claim order lets nothing stop it."""
        if o.preempted_at and protected(o.preempted_at, self.now_ms, self.preemption):
            return None
        return search.rule(o, key)

    def _victim(self, o, node: str, search, rule: str) -> Victim:
        """`o` as a candidate victim on `node` by this rule (`_rule`): its tier, whether it stands as borrowed, the
        work it would lose."""
        since = max(o.started_ms, o.checkpoint_ms) if o.phase == "running" else self.now_ms
        return Victim(o.request.job_id, node, TIER_RANK[o.request.tier],
                      rule == "reclaim" or not search.victim_claim(o, search.mine)[0], max(0, self.now_ms - since),
                      rule)

    def _candidates_on(self, view: node_view.NodeView, search: Search, key) -> list[str]:
        """The jobs on this node of the (tenant, claim group) tables that may hold a victim for claim `key`
        (Search.groups: a superset of who may be stopped), from the victim index's entries, before any standing is
        worked out."""
        self._sync_victim_index()
        tables = search.tables(key)
        if not self.search_memo:
            return [j for j, (g, t) in self.victim_index.held.get(view.node, {}).items() if (t, g) in tables]
        # a node's entries are a function of the jobs its view holds (victims.py): kept with the view
        facts = self._view_facts(view)
        got = facts.get(tables)
        if got is None:
            got = facts[tables] = tuple(j for j, (g, t) in self.victim_index.held.get(view.node, {}).items()
                                        if (t, g) in tables)
        return got

    def _sync_victim_index(self) -> None:
        """The victim index's sync; when it reads every view afresh (views set by hand), what was kept per view goes
        too (a node's candidates are kept with its view)."""
        vi = self.victim_index
        if vi.stale or len(vi.pos) != len(self.nodes):
            self._node_memo.clear()
        vi.sync(self.nodes, self.jobs)

    def _victims_on(self, view: node_view.NodeView, search: Search, key=None) -> list[Victim]:
        """Who on this node may be stopped for the search's job: work whose claim is below the job's (claims.py:
        the one order for tier preemption and reclaim); never a reservation hold, never a protected job, never
        one already stopping. Read from the victim index's entries for the node (the jobs its view holds, holds
        aside), so other work is passed over without a look-up. `key`: the job's claim (default: on this node's
        cards)."""
        return [self._victim(o, view.node, search, rule) for o, rule in self._stoppable_on(view, search, key)]

    def _victim_ids_on(self, view: node_view.NodeView, search: Search, key=None) -> list[str] | tuple[str, ...]:
        """The ids of `_victims_on`'s victims, without building them (a multi-node gang's plan counts every node's
        room from these, and builds the victims of the nodes it takes from only: ~1,000 nodes per card model).
        Kept as `_stoppable_kept`'s pairs are: one tuple for the same pairs."""
        key = key or search.node_key(view)
        if not self.search_memo:
            return [o.request.job_id for o, _ in self._stoppable_on(view, search, key)]
        pairs, keep = self._stoppable_kept(view, search, key)
        if not keep:
            return tuple(o.request.job_id for o, _ in pairs)
        facts = self._view_facts(view)
        k = ("ids of", search.tables(key), key)
        got = facts.get(k)
        if got is None or got[0] is not pairs:  # the ids of these very pairs, one tuple (plan_gang's memo asks `is`)
            got = facts[k] = (pairs, tuple(o.request.job_id for o, _ in pairs))
        return got[1]

    def _stoppable_kept(self, view: node_view.NodeView, search: Search, key, facts: dict | None = None,
                        tables: frozenset | None = None):
        """`_stoppable_on`, kept with the view while no job record on the node changed (Holdings.node_jobs), by the
        candidates and their `Search.below` (`_judged_on`: searches of other claims often judge a node's candidates
        alike) -- when they read nothing else: every candidate's claim below whatever its standing, and none
        protected now (a protection only ever ends while a job holds capacity: its stops are the same). Found again
        by the claim's tables and key first, without hashing the candidates (the caller synced the victim index,
        `_victim_nodes`). Returns (the pairs, whether they are kept). `facts`, `tables`: the view's facts and the
        claim's tables, when the caller has them."""
        if facts is None:
            facts = self._view_facts(view)
        moved = self.h.node_jobs.get(view.node, 0)
        mine = ("stoppable of", tables if tables is not None else search.tables(key), key)
        got = facts.get(mine)
        if got is not None and got[0] == moved:
            return got[1], True
        judged = self._judged_on(view, search, key)
        k = ("stoppable", judged)
        got = facts.get(k)
        if got is not None and got[0] == moved:
            facts[mine] = got
            return got[1], True
        pairs = tuple(self._stoppable_on(view, search, key))
        jobs, now, cfg = self.jobs, self.now_ms, self.preemption
        keep = all(below and not (jobs[j].preempted_at and protected(jobs[j].preempted_at, now, cfg))
                   for j, below in judged)
        if keep:
            facts[k] = facts[mine] = (moved, pairs)
        return pairs, keep

    def _stoppable_on(self, view: node_view.NodeView, search: Search, key=None) -> list[tuple[JobRecord, str]]:
        """(job, rule) for each job on this node that may be stopped for the search's job (`_victims_on`): `_rule`
        for each candidate, its half that reads the job's fixed facts alone (Search.below) kept with the view
        (`_judged_on`), the rest -- its state, its protection, its standing -- asked each time. A multi-node gang's
        plan asks this of ~1,000 nodes per card model, a single-node search of ~16 per decision."""
        key = key or search.node_key(view)
        jobs, now, cfg = self.jobs, self.now_ms, self.preemption
        out = []
        for j, below in self._judged_on(view, search, key):
            other = jobs[j]
            if other.phase not in _STOPPABLE or other.placement is None:
                continue
            if other.preempted_at and protected(other.preempted_at, now, cfg):
                continue  # what `_rule` asks first
            if below:
                out.append((other, "tier"))
            else:
                rule = search.rule(other, key, False)
                if rule is not None:
                    out.append((other, rule))
        return out

    def _judged_on(self, view: node_view.NodeView, search: Search, key) -> tuple[tuple[str, bool], ...]:
        """(job, Search.below) for each of `_candidates_on`'s jobs. Whether a job's claim is below `key` whatever
        its standing reads its tier and whether it is on its reservation, fixed while it holds capacity on the node
        (so while the view holds it): kept with the view, per claim."""
        jobs = self.jobs
        if not self.search_memo:
            return tuple((j, search.below(jobs[j], key)) for j in self._candidates_on(view, search, key))
        self._sync_victim_index()
        facts = self._view_facts(view)
        tables = search.tables(key)
        k = ("below", tables, key)  # the candidates are a function of the tables (`_candidates_on`)
        got = facts.get(k)
        if got is None:
            # a job's claim group in the victim index's entry is its tier and whether it is on its reservation
            # (claims.group): Search.below is whether that group's within-quota claim is below `key`
            held = self.victim_index.held.get(view.node, {})
            below = _below_by_group(key)
            got = facts[k] = tuple((j, below[held[j][0]]) for j in self._candidates_on(view, search, key))
        return got

    def _preempt_for(self, out: list[Envelope], cause: Envelope, rec: JobRecord) -> bool:
        """True when the job waits on preemptions (already under way, or started now)."""
        if rec.nominated is not None:
            if self._victims_stopping(rec):
                return True
            self._nominate(rec, None)  # its victims are gone and it still does not fit: plan again
        waiting = self._freed_by_stops(rec)
        if waiting is not None:
            # Work already stopping frees more than the jobs it was stopped for need: wait for it, stop nothing more.
            self._nominate(rec, waiting, (waiting[0],))
            self._pending(out, cause, rec, (Reason(
                code="Preempting", plugin="Preemption", nodes=(waiting[0],),
                message=f"waiting for {len(waiting[1])} job(s) already stopping on {waiting[0]}",
                data={"victims": ",".join(waiting[1])}),))
            return True
        search = Search(self.h, self.ledger, rec)
        r = rec.request
        never = self._never_admitted_on(rec)
        keys = [search.key(m) for m in self.index.models
                if (not r.constraints.models or m in r.constraints.models) and m not in never]
        if never and not keys:
            return False  # its quota admits it on no card model it may use: stopping work frees nothing for it
        strongest, weakest = max(keys, default=search.key()), min(keys, default=search.key())
        if not search.tables(strongest):
            return False  # nobody's claim is below its own, on any card model: no search over the nodes
        too_big = {m: cards_needed(r.compute_milli, r.gpu_memory_mib, m) > n for m, n in self.index.models.items()}
        plan = None
        plan_key = weakest
        shape = Shape(r)
        if not all(too_big.values()):  # else no node has cards enough, whoever stops: only a multi-node gang plan
            plan = (self._plan_nodes if self.search_memo else self._plan_walk)(search, r, shape, strongest, never)
            if plan is not None:
                plan_key = search.node_key(self.nodes[plan.node])
        if plan is None and r.gang and any(too_big.values()):
            plan = plan_gang(rec.request, self.nodes, self.index,
                             [m for m in allowed_models(self.index, rec.request) if m not in never],
                             self._victims(search, weakest), lambda chosen, v: search.valid(chosen, v, weakest),
                             self._view_facts if self.search_memo else None, self.search_memo,
                             self.preemption.candidate_nodes)
        if plan is None:
            return False
        self._stop_for(out, cause, rec, plan.victims)
        # it claims every node it counted on: a gang part's free cards as much as the ones its victims free (one
        # left out went to the victims' requeue, and the gang stopped more work again elsewhere, for ever)
        self._nominate(rec, (plan.node, tuple(v.job_id for v in plan.victims)),
                       tuple(sorted({plan.node, *plan.nodes} | {v.node for v in plan.victims})))
        self._charge(rec, plan_key)
        where = tuple(sorted({v.node for v in plan.victims}))
        self._pending(out, cause, rec, (Reason(
            code="Preempting", plugin="Preemption", nodes=where,
            message=f"waiting for {len(plan.victims)} job(s) to checkpoint and stop on {', '.join(where)}",
            data={"victims": ",".join(rec.nominated[1])}),))
        return True

    def _never_admitted_on(self, rec: JobRecord) -> frozenset[str]:
        """The card models on which its quota would never admit it: what it would hold there (whole cards count
        their model's compute, quota.held) is beyond its account's whole borrowing cap even with nothing of its
        tenant running. Stopping work on such cards frees nothing it may take (the claim search leaves them out).
        Only models where it would hold more than it asked are read: what it asked was admitted before the search."""
        if rec.reserved or rec.hold is not None:
            return frozenset()
        r = rec.request
        out, freed = [], None
        for m in self.index.models:
            need, mem = holding_on(r, m)
            if need <= r.compute_milli and mem <= r.gpu_memory_mib:
                continue
            if freed is None:
                freed = {k: (a.used_milli, a.used_memory_mib) for k in ((r.tenant, None), (r.tenant, r.project))
                         if (a := self.ledger.accounts.get(k)) is not None}
            if self.ledger.admit(r, self.index.capacity_milli, need, mem, freed=freed).blocked:
                out.append(m)
        return frozenset(out)

    def _plan_walk(self, search: Search, r: JobRequested, shape: Shape, strongest: Claim,
                   never: frozenset[str] = frozenset()):
        """The claim search over single nodes as `plan_over` says it, every candidate node's victims built: the
        reference `_plan_nodes` is held to (tests/test_search_memo.py), taken when `search_memo` is off. `never`:
        card models its quota never admits it on (`_never_admitted_on`): a node of those alone is passed over."""
        def pairs():
            for name in self._victim_nodes(search, strongest):
                view = self.nodes[name]
                if never and {g.model for g in view.cards()} <= never:
                    continue
                key = search.node_key(view)  # its claim on this node's cards
                # a node where the job would not fit even with every job that may be a victim gone yields no
                # plan: passed over before any victim's standing is worked out (what plan_over would find)
                ids = self._candidates_on(view, search, key)
                if not ids or any(f(view, r) for f in NODE_FILTERS):
                    continue
                room = Room(view, r, shape)
                if not room.fits_without(ids):
                    continue
                victims = self._victims_on(view, search, key)
                valid = (lambda chosen, v, key=key: search.valid(chosen, v, key))
                # when every job it may stop there is a victim, the room found already that the job fits with
                # them all gone: plan_over does not ask again
                yield view, victims, valid, room if len(victims) == len(ids) else None
        return plan_over(r, pairs(), self.preemption.candidate_nodes)

    def _plan_nodes(self, search: Search, r: JobRequested, shape: Shape, strongest: Claim,
                    never: frozenset[str] = frozenset()):
        """What `plan_over` over `_preempt_for`'s pairs (the reference, taken when `search_memo` is off) chooses, the
        same nodes visited and counted, with less work per node: each candidate's rule, standing and progress are
        worked out in one pass (no Victim built but for the plan's), and what is a function of the node's view and
        the job's shape alone -- the node's Room, whether the job fits with a set of jobs gone, the choice among
        victims in a given disruption order -- is kept while the node's view object is the same one (views are
        immutable: a change makes a new one). Choices that ask the claim order (a "reclaim" victim) are not kept. A
        node whose plan needs no standing to exist (no "reclaim" victim, no MIG trial) is counted at once and its plan
        worked out afterwards, cheapest lower bound first (`_plan_bound`), only while that bound could still beat the
        best plan: the standings of candidates on nodes that cannot win are never read."""
        best: Plan | None = None
        best_cost = None  # best.cost (a property that sums each time it is read)
        found, limit = 0, self.preemption.candidate_nodes
        now = self.now_ms
        mine = search.mine
        sk = self.index.intern(_shape_key(r))  # the memos' key for its shape: one object, hashed by identity
        my_tenant, quota_version, bounded, sums = r.tenant, self.ledger.quota_version, search.bounded, self.h.sums
        h, ledger = self.h, self.ledger
        my_milli, my_memory = r.compute_milli, r.gpu_memory_mib
        versions: dict[str, int] = {}
        surely, slack = search.surely_within, search.slack

        def version_of(tenant: str) -> int:
            t = sums.get((tenant, None))
            v = versions[tenant] = t.version if t is not None else -1
            return v

        def choose(name, room, rows, lost_of, accounts, key, reclaim, keep, facts):
            """The victims `least_disruptive` chooses on this node, in the claim order's disruption order."""
            # each one's standing coming back (Search.victim_claim): none is asked when every account's largest job
            # here is sure to stand within (surely_within: its stronger and equal holders, the preemptor and it fit)
            surely_all = True
            for k, most_m, most_mem in accounts:
                sl = slack[k] if k in slack else surely(*k)
                if most_m > sl[0] or most_mem > sl[1]:
                    surely_all = False
                    break
            entries = []
            for (j, o, tr, rule, k), lost in zip(rows, lost_of):
                if rule == "reclaim" or surely_all:
                    entries.append((0 if rule == "reclaim" else 1, -tr, lost, j, rule))
                    continue
                # its memos read here first: a reserved job and an account no quota bounds stand within; another
                # tenant's job stands as it stands now (standing_now's memo, while its tenant's sums and the quotas
                # have not moved)
                req = o.request
                if o.reserved or bounded.get((req.tenant, req.project)) is False:
                    borrowed = False
                elif (req.compute_milli <= (sl := slack[k] if k in slack else surely(*k))[0]
                      and req.gpu_memory_mib <= sl[1]):
                    borrowed = False  # its account's stronger and equal holders, the preemptor and it fit
                elif req.tenant != my_tenant:
                    # another tenant's job stands as it stands now: its standing_now (whose memo it reads first)
                    sm = o.standing_memo
                    if sm and sm[1] == quota_version and sm[0] == (
                            versions[req.tenant] if req.tenant in versions else version_of(req.tenant)):
                        borrowed = not sm[2]
                    else:
                        borrowed = not standing_now(h, ledger, o)
                elif not standing_now(h, ledger, o):
                    borrowed = True  # beyond quota now: the preemptor's holding, if counted ahead of it, only adds
                elif (sm := o.standing_memo) and sm[3][0] >= my_milli and sm[3][1] >= my_memory:
                    borrowed = False  # within by more than the preemptor will hold, wherever that counts
                else:
                    borrowed = not search.victim_claim(o, mine)[0]
                entries.append((0 if borrowed else 1, -tr, lost, j, rule))
            entries.sort()  # disruption_order: (borrowed first, lowest tier, least progress lost, job id), ids unique
            if reclaim or not keep:
                ordered = [Victim(e[3], name, -e[1], e[0] == 0, e[2], e[4]) for e in entries]
                chosen = least_disruptive(room, ordered,
                                          (lambda chosen, v, key=key: search.valid(chosen, v, key)) if reclaim
                                          else None)
            else:
                order_key = ("order", sk, tuple(e[3] for e in entries))
                picked = facts.get(order_key, False)
                if picked is False:
                    got = least_disruptive(room, [_Pick(e[3]) for e in entries])
                    picked = facts[order_key] = None if got is None else frozenset(p.job_id for p in got)
                chosen = None if picked is None else [Victim(e[3], name, -e[1], e[0] == 0, e[2], e[4])
                                                      for e in entries if e[3] in picked]
            return chosen

        # its claim on a node and that claim's tables, by the node's card models (Search.node_key)
        node_keys: dict[frozenset, tuple[Claim, frozenset]] = {}
        fkey = filters_key(r.constraints)
        deferred = []  # (bound, order, node's context): nodes whose plan is worked out only if it may be cheaper
        for name in self._victim_nodes(search, strongest):
            view = self.nodes[name]
            facts = self._view_facts(view)
            models = facts.get("models")
            if models is None:
                models = facts["models"] = frozenset(g.model for g in view.cards())
            if never and models <= never:
                continue  # cards its quota never admits it on (_plan_walk passes them over alike)
            got = node_keys.get(models)
            if got is None:
                key = search.node_key(view)
                got = node_keys[models] = (key, search.tables(key))
            key, tables = got
            # _candidates_on, read here (the victim index was synced by _victim_nodes)
            ids = facts.get(tables)
            if ids is None:
                ids = self._candidates_on(view, search, key)
            if not ids:
                continue
            rejected = facts.get(fkey)  # what the filters read: the view, and of the job its constraints alone
            if rejected is None:
                rejected = facts[fkey] = any(f(view, r) for f in NODE_FILTERS)
            if rejected:
                continue
            room = facts.get(sk)
            if room is None:
                room = Room(view, r, shape)
                if not room.mig:  # a MIG node's trial runs on a scratch view with the whole job: never kept
                    facts[sk] = room
            keep = not room.mig
            # whether the job fits with these jobs gone: on a MIG node the trial (a scratch view, ~1 ms for a node
            # of 56 slices) reads more of the job than the shape key says -- its constraints too (`fits`)
            what = sk if keep else (sk, r.constraints)
            ids_key = (what, ids)
            ok = facts.get(ids_key)
            if ok is None:
                ok = facts[ids_key] = room.fits_without(ids)
            if not ok:
                continue
            # a node where it fits with nobody gone yields no plan (least_disruptive), and is not counted as one
            none_key = (what, ())
            free = facts.get(none_key)
            if free is None:
                free = facts[none_key] = room.fits_without(())
            if free:
                continue
            # who may be stopped here (kept with the view, `_stoppable_kept`), and what of each does not move while
            # that is kept: its id, tier, the account its standing is read in; the work each loses is read now
            pairs = self._stoppable_kept(view, search, key, facts, tables)[0]
            if not pairs:
                continue
            got = facts.get("rows")
            if got is None or got[0] is not pairs:
                rows = tuple((o.request.job_id, o, TIER_RANK[o.request.tier], rule,
                              (o.request.tenant, o.request.project, o.group)) for o, rule in pairs)
                # since when each would lose work if stopped (a start, a checkpoint and a state change each move
                # the node's count, Holdings.node_jobs, and so the pairs kept): NO_LOSS while it does not run
                sinces = tuple(max(o.started_ms, o.checkpoint_ms) if o.phase == "running" else _NO_LOSS
                               for _, o, _, _, _ in rows)
                accounts: dict[tuple, list[int]] = {}
                for _, o, _, rule, k in rows:
                    a = accounts.setdefault(k, [0, 0])
                    a[0], a[1] = max(a[0], o.request.compute_milli), max(a[1], o.request.gpu_memory_mib)
                got = facts["rows"] = (pairs, rows, tuple(c[0] for c in rows), any(c[3] == "reclaim" for c in rows),
                                       tuple((k, a[0], a[1]) for k, a in accounts.items()), sinces,
                                       # the rows by the work each loses, least first (latest since first)
                                       tuple(sorted(range(len(rows)), key=lambda i: -sinces[i])))
            rows, cand_ids, reclaim, accounts = got[1], got[2], got[3], got[4]
            if len(rows) != len(ids):
                got_key = (what, cand_ids)
                ok = facts.get(got_key)
                if ok is None:
                    ok = facts[got_key] = room.fits_without(cand_ids)
                if not ok:
                    continue
            if keep and not reclaim:
                # It yields a plan (the job fits with them all gone, and no victim's account is asked: the choice
                # adds victims until it fits), worked out below only if it could be cheaper than the best one
                # (`_plan_bound`): the cheapest plan of the nodes counted is the same whatever order they are tried in
                deferred.append((_plan_bound(facts, sk, room, got, now), len(deferred),
                                 (name, room, rows, got[5], accounts, facts)))
                found += 1
                if found >= limit:
                    break
                continue
            chosen = choose(name, room, rows, _lost_of(got[5], now), accounts, key, reclaim, keep, facts)
            if chosen is not None:
                plan = Plan(name, tuple(chosen))
                cost = plan.cost
                if best_cost is None or cost < best_cost:
                    best, best_cost = plan, cost
                found += 1
                if found >= limit:
                    break
        deferred.sort(key=lambda d: (d[0], d[1]))
        for bound, _, (name, room, rows, sinces, accounts, facts) in deferred:
            if best_cost is not None and bound > best_cost[:2]:
                break  # no plan of this node or of any after it can be cheaper
            chosen = choose(name, room, rows, _lost_of(sinces, now), accounts, None, False, True, facts)
            plan = Plan(name, tuple(chosen))
            cost = plan.cost
            if best_cost is None or cost < best_cost:
                best, best_cost = plan, cost
        return best

    def _view_facts(self, view: node_view.NodeView) -> dict:
        """What the claim search keeps of this node while its view object is current (`_node_memo`)."""
        m = self._node_memo.get(view.node)
        if m is None or m[0] is not view:
            m = self._node_memo[view.node] = (view, {})
        return m[1]

    def _defragment(self, out: list[Envelope], cause: Envelope, rec: JobRecord) -> bool:
        """Defragmentation (defrag.py), after allocate and before preempt: when the job's block of cards is free in
        total but not in one place, move checkpointable low-tier work off one node (`cmd.migrate`: checkpoint, stop,
        resume on the planned node) so that node holds it; the job is nominated there. True when it waits on moves."""
        plan = defrag.plan(self, rec, self._claimed_from(rec), self._stmt.plan if self._stmt is not None else None)
        if plan is None:
            return False
        r = rec.request
        for mv in plan.moves:
            o = self.jobs[mv.job_id]
            self._command(out, MigrateJob(
                command_id=self._command_id(), job_id=mv.job_id, from_node=plan.node, to_node=mv.to_node,
                assignments=mv.assignments, attempt=o.attempt, grace_s=self.grace_s[o.request.tier], reasons=(Reason(
                    code="Defragment", plugin="Defragmentation", nodes=(plan.node, mv.to_node),
                    message=f"moved to {mv.to_node} to open a block of {plan.model} cards on {plan.node} for "
                            f"{r.job_id} ({r.tier.value}); stranded free cards {plan.frag_before_milli} -> "
                            f"{plan.frag_after_milli} milli-GPU",
                    data={"for_job": r.job_id, "model": plan.model, "frag_before_milli": plan.frag_before_milli,
                          "frag_after_milli": plan.frag_after_milli, "moves": len(plan.moves)}),)), cause)
            self._nominate(o, (mv.to_node, ()), (mv.to_node,))
        self._nominate(rec, (plan.node, tuple(mv.job_id for mv in plan.moves)), (plan.node,))
        self._pending(out, cause, rec, (Reason(
            code="Defragmenting", plugin="Defragmentation", nodes=(plan.node,),
            message=f"waiting for {len(plan.moves)} job(s) to move off {plan.node}: the pool has the cards in "
                    f"total, not in one place",
            data={"victims": ",".join(mv.job_id for mv in plan.moves), "frag_before_milli": plan.frag_before_milli,
                  "frag_after_milli": plan.frag_after_milli}),))
        return True

    def _quiet(self, rec: JobRecord) -> Reason | None:
        """Why a recently stopped victim may not preempt now (None: it may): it was stopped for another job less
        than `victim_quiet_ms` of log time ago, and takes free capacity only until then -- so a victim's requeue
        starts no chain of preemptions its preemptor was not allowed."""
        if not rec.preempted_at:
            return None
        memo = rec.quiet_memo
        if memo and memo[0] == rec.preempted_at:  # asked for every waiting victim on every retry: made once a stop
            return memo[2] if self.now_ms < memo[1] else None
        until = quiet_until(rec.preempted_at, self.preemption)
        why = Reason(code="RecentlyPreempted", plugin="Preemption", data={"until_ms": until},
                     message=f"stopped for another job at {rec.preempted_at[-1]} ms: it preempts nothing until "
                             f"{until} ms, and meanwhile takes free capacity that preemption did not free for "
                             f"stronger work")
        self.h.note(rec, quiet_memo=(rec.preempted_at, until, why))
        return why if self.now_ms < until else None

    def _charge(self, rec: JobRecord, key: Claim) -> None:
        """The nodes `rec` claims (a plan's) are freed for its claim `key` until the quiet window of victims stopped
        now ends (`_recharge` moves it on when it takes its node); a node freed for several keeps the strongest."""
        self.h.apply(ChargeFreed(rec.request.job_id, rec.claim, key, self.now_ms,
                                 self.now_ms + self.preemption.victim_quiet_ms))

    def _recharge(self, rec: JobRecord) -> None:
        """`rec` took its node: its victims have stopped, their quiet windows run to victim_quiet_ms from now, and so
        does what they freed for it."""
        self.h.apply(RechargeFreed(rec.request.job_id, self.now_ms + self.preemption.victim_quiet_ms))

    def _uncharge(self, rec: JobRecord) -> None:
        self.h.apply(UnchargeFreed(rec.request.job_id))

    def _barred(self, rec: JobRecord, standing: bool) -> frozenset[str]:
        """Nodes a job in its quiet window (`standing`: its standing now) may not take from: preemption freed them,
        less than the victims' quiet window ago, for a claim at least as strong as its own (`freed_for`) -- the next
        request of that claim would stop someone else for it (one of equal claim cannot stop it)."""
        if not self.h.freed_for:
            return frozenset()
        self.h.apply(ExpireFreed(self.now_ms))
        return self.h.barred(claim(standing, rec.request.tier, rec.reserved))

    def _stop_for(self, out: list[Envelope], cause: Envelope, rec: JobRecord, victims) -> None:
        r = rec.request
        for v in victims:
            self._command(out, PreemptJob(command_id=self._command_id(), job_id=v.job_id, node=v.node,
                                          grace_s=self.grace_s[self.jobs[v.job_id].request.tier], reasons=(
                Reason(code="PreemptedFor", plugin="Preemption", message=f"{v.rule}: {r.job_id} ({r.tier.value})",
                       data={"for_job": r.job_id, "rule": v.rule, "progress_lost_ms": v.progress_lost_ms}),),
                attempt=self.jobs[v.job_id].attempt), cause)

    def _preempt_for_quota(self, out: list[Envelope], cause: Envelope, rec: JobRecord, quota: Admission,
                           holding: tuple[int, int] | None = None) -> bool:
        """A job its own account's quota keeps waiting (QuotaExceeded, ProjectQuotaExceeded: beyond the cap) stops
        that account's weaker work (claims.py: its own borrowed or lower-tier jobs) until the quota admits it --
        the same claim order as everywhere, inside one tenant: a tenant's inference service displaces its own
        training. True when it waits on such stops (under way, or started now)."""
        if rec.nominated is not None and any(self.phase_of(v) == "stopping" for v in rec.nominated[1]):
            return True
        codes = {q.code for q in quota.reasons}
        if not codes & {"QuotaExceeded", "ProjectQuotaExceeded"}:
            return False
        r = rec.request
        sums = self.h.sums.get((r.tenant, None))
        if sums is None or not any(sums.milli[:rec.group]) and not self._beyond_quota(r.tenant):
            return False  # its account holds nothing weaker: same-tenant work of its group or above never is
        project = "ProjectQuotaExceeded" in codes
        search = Search(self.h, self.ledger, rec)
        key = search.key()
        need, mem = holding if holding else (None, None)
        cands = []
        for o in (self.jobs[j] for j in self._account_holders(r.tenant)):
            if o is rec or o.phase not in ("placed", "running") or o.placement is None or o.hold is not None:
                continue
            if project and o.request.project != r.project:
                continue
            rule = self._rule(o, search, key)
            if rule is not None:
                cands.append(self._victim(o, o.node, search, rule))
        chosen: list[Victim] = []
        # what its victims free, less what is kept for jobs nominated ahead of it (its admission counts that too)
        freed: dict[tuple[str, str | None], list[int]] = {k: list(f) for k, f in (self._quota_kept(rec) or {}).items()}

        def count(v: Victim, sign: int) -> None:
            o = self.jobs[v.job_id]
            for k in ((r.tenant, None), (r.tenant, o.request.project)):
                f = freed.setdefault(k, [0, 0])
                f[0] += sign * o.held_milli
                f[1] += sign * o.held_memory_mib

        def admitted() -> bool:
            # within its quota, not borrowing: a job that stopped its own account's work to borrow would itself be
            # reclaimed by another tenant's, whose victim came back and stopped it again (a storm:
            # test_claim_properties.py::test_a_job_that_reclaims_its_own_accounts_work_to_borrow_is_not_reclaimed...)
            got = self.ledger.admit(r, self.index.capacity_milli, need, mem, freed=freed)
            return not got.blocked and not got.borrowed

        for v in sorted(cands, key=disruption_order):
            if v.rule == "reclaim" and not search.valid(chosen, v, key):
                continue
            chosen.append(v)
            count(v, 1)
            if admitted():
                break
        else:
            return False
        for extra in reversed(chosen):  # as many as it needs: drop, most disruptive first, what it does without
            count(extra, -1)
            if admitted():
                chosen = [c for c in chosen if c is not extra]
            else:
                count(extra, 1)
        if not chosen:
            return False  # admitted without stopping anyone: nothing to wait for
        if holding is None and not self._fits_after(rec, chosen):
            return False  # its quota would admit it, but no node would hold it: stopping its own work gains nothing
        self._stop_for(out, cause, rec, chosen)
        self._nominate(rec, (chosen[0].node, tuple(v.job_id for v in chosen)), tuple(sorted({v.node for v in chosen})))
        self._charge(rec, key)
        self._pending(out, cause, rec, (Reason(
            code="Preempting", plugin="Preemption", nodes=tuple(sorted({v.node for v in chosen})),
            message=f"waiting for {len(chosen)} job(s) of its own account to stop: its quota is held by weaker work",
            data={"victims": ",".join(v.job_id for v in chosen), "quota": 1}),) + quota.reasons)
        return True

    def _fits_after(self, rec: JobRecord, chosen) -> bool:
        """Whether `rec` would be placed once these victims are gone: on free capacity now, or on a node of theirs
        with their holdings released there (a scratch view, as any preemption plan is tried)."""
        if isinstance(place(self.index, self.nodes, rec.request, self.workload, self.candidates,
                            exclude=self._claimed_from(rec)), Placement):
            return True
        on: dict[str, list[str]] = {}
        for v in chosen:
            on.setdefault(v.node, []).append(v.job_id)
        trial = self._trial()
        for n, ids in sorted(on.items()):
            cp = trial.checkpoint()
            for j in ids:
                trial.evict(n, j)
            ok = fits(trial[n], rec.request)
            trial.rollback(cp)
            if ok:
                return True
        return False

    def _trial(self) -> TrialPlan:
        """Where a trial runs: the cycle's plan (`Statement.plan`), or a fresh one over the node views when no cycle
        runs (an input's own handling). The caller rolls back what it tried."""
        return self._stmt.plan if self._stmt is not None else TrialPlan(self.nodes)

    def _account_holders(self, tenant: str) -> list[str]:
        """Jobs of this tenant holding capacity (holds aside), in node order then job order (the victim index)."""
        vi = self.victim_index
        vi.sync(self.nodes, self.jobs)
        nodes = vi.in_order(self.nodes, [ns for (t, _g), ns in vi.by_group.items() if t == tenant and ns])
        out: dict[str, None] = {}
        for name in nodes:
            for j, (_g, t) in vi.held.get(name, {}).items():
                if t == tenant:
                    out[j] = None
        return list(out)

    def _beyond_quota(self, tenant: str) -> bool:
        a = self.ledger.accounts.get((tenant, None))
        q = self.ledger.tenant_quota(tenant)
        return a is not None and q is not None and a.used_milli > q.gpu_milli

    def _unnominate_blocked(self, rec: JobRecord) -> None:
        """A nominated job its quota keeps waiting once its victims are all gone (its quota lowered meanwhile, or the
        cards freed hold more than its quota lets it hold): the nodes it claimed are not kept for it -- they would
        sit idle, other work told NominatedForOther, for as long as it waits on its quota."""
        if rec.nominated is not None and not self._victims_stopping(rec):
            self._nominate(rec, None)

    def _victims_stopping(self, rec: JobRecord) -> bool:
        """Whether any victim the nominated job `rec` waits for is still stopping (or moving)."""
        return any(self.phase_of(v) in ("stopping", "migrating") for v in rec.nominated[1])

    def _nominate(self, rec: JobRecord, nominated, claim: tuple[str, ...] = ()) -> None:
        self.h.apply(Nominate(rec.request.job_id, nominated, claim))

    def _claimed_from(self, rec: JobRecord) -> frozenset[str]:
        """Nodes `rec` may not take from: claimed by a nominated job ahead of it in the queue."""
        if not self.nominations:
            return frozenset()
        if rec.nominated is None:  # every nominated job is ahead of one that is not (`_queue_key`)
            return self.h.claimed_all()
        mine = self._queue_key(rec)
        return frozenset(n for o in self.nominations.values() if o is not rec and self._queue_key(o) < mine
                         for n in o.claim)

    def _freed_by_stops(self, rec: JobRecord) -> tuple[str, tuple[str, ...]] | None:
        """A node where `rec` fits once the jobs stopping there are gone and the jobs nominated to it have taken
        their share: (node, the stopping jobs), or None. Tried on the cycle's plan (each node's trial rolled back),
        like any preemption plan, or by arithmetic where nobody else waits for the node."""
        if not self.stopping:
            return None
        stopping: dict[str, list[str]] = {}
        for j in sorted(self.stopping):
            for part in self.jobs[j].parts:
                stopping.setdefault(part.node, []).append(j)
        claims: dict[str, list[JobRecord]] = {}
        for o in self.nominations.values():
            if o.nominated is not None and o.phase == "pending" and o is not rec:
                claims.setdefault(o.nominated[0], []).append(o)
        for node in sorted(stopping):
            if node not in claims:  # nobody else waits for this node: arithmetic, no scratch view
                view = self.nodes[node]
                if not any(f(view, rec.request) for f in NODE_FILTERS) and \
                        Room(view, rec.request).fits_without(stopping[node]):
                    return node, tuple(stopping[node])
                continue
            trial = self._trial()
            cp = trial.checkpoint()
            for j in stopping[node]:
                trial.evict(node, j)
            for o in sorted(claims[node], key=lambda o: o.arrival):
                fit = fit_cards(trial[node], o.request)
                if not isinstance(fit, str):
                    trial.place(node, o.request, fit)
            ok = fits(trial[node], rec.request)
            trial.rollback(cp)
            if ok:
                return node, tuple(stopping[node])
        return None

    def _unplaced(self, out: list[Envelope], cause: Envelope, rec: JobRecord, result, quiet) -> None:
        """A job no node took (`result`: place's Unschedulable, or a (result, quiet) pair of the job of its kind it
        is dominated by). It is explained -- every rejecting node and code, the capacity expected to free -- only
        when what its attempt saw changed since its last one (the nodes it looked at and why each refused, the
        fleet, the down nodes, any node's facts, its protection): otherwise its reasons are the ones it was told, and
        a waiting queue retried as capacity moves costs no explaining."""
        if isinstance(result, tuple):
            result, quiet = result
        seen = (result.seen, self.node_epoch, quiet.code if quiet is not None else None)
        if rec.pending_codes and rec.pending_seen == seen:
            return
        # what would free capacity is counted on cards its quota could admit it on
        reasons = result.reasons_for(self._never_admitted_on(rec))
        self._pending(out, cause, rec, reasons + ((quiet,) if quiet is not None else ()))
        self.h.note(rec, pending_seen=seen)

    def _pending(self, out: list[Envelope], cause: Envelope, rec: JobRecord, reasons: tuple[Reason, ...]) -> None:
        self.h.note(rec, pending_seen=None)  # told something else than an unplaced attempt's reasons (_unplaced)
        # a quota's reason is said again when the cap that blocks it moves (an operator's change is seen to take),
        # not when what is used moves
        codes = tuple(f"{r.plugin}:{r.code}" if r.plugin != "Quota" or "cap_milli" not in r.data
                      else f"{r.plugin}:{r.code}:{r.data['cap_milli']}" for r in reasons)
        if codes != rec.pending_codes:  # say it once per change, not every cycle
            self.h.note(rec, pending_codes=codes)
            self._emit(out, JobPending(job_id=rec.request.job_id, reasons=reasons), cause)

    def card_model(self, node: str, gpu_uuid: str) -> str:
        return self.h.card_model(node, gpu_uuid)


_NO_CONSTRAINTS = JobRequested.model_fields["constraints"].default


# the actions of a cycle after allocate (`Scheduler._allocate`), in their order (Volcano's and KAI's: allocate,
# then consolidate, reclaim, preempt); each takes the attempt allocate left and says whether it decided the job
ACTIONS = (Scheduler._defragment_action, Scheduler._reclaim_action, Scheduler._preempt_action)


@functools.lru_cache(maxsize=64)
def _below_by_group(key: Claim) -> tuple[bool, ...]:
    """Per claim group g, whether its within-quota claim is below `key` (Search.below of a job of that group): read
    by index for each candidate of a node."""
    return tuple(claim_of_group(True, g) < key for g in range(GROUPS))


_NO_LOSS = 1 << 62  # `since` of a candidate that does not run: it loses no work


def _plan_bound(facts: dict, sk, room, got: tuple, now: int) -> tuple[int, int]:
    """A lower bound of a node's plan's (victims, work lost) -- `Plan.cost`'s first two fields -- from what its
    candidates lose, before any standing is read: one victim losing at least the least any candidate that alone makes
    room loses; else two or more, losing at least the two least. `got`: the node's kept rows (`_plan_nodes`), whose
    last field orders them by the work each loses, least first -- so which one is the least-losing lone room-maker is
    kept with them."""
    k = ("bound", sk)
    kept = facts.get(k)
    if kept is None or kept[0] is not got:
        rows, first = got[1], None
        for i in got[6]:
            one = ("one", sk, rows[i][0])  # whether the job fits with that one gone (kept with the view)
            alone = facts.get(one)
            if alone is None:
                alone = facts[one] = room.fits_without((rows[i][0],))
            if alone:
                first = i
                break
        kept = facts[k] = (got, first)
    sinces = got[5]  # the work each loses is read for the one or two the bound names alone
    if kept[1] is not None:
        return 1, _lost(sinces[kept[1]], now)
    return 2, sum(_lost(sinces[i], now) for i in got[6][:2])


def _lost(since: int, now: int) -> int:
    """The work a candidate loses if stopped now: since its start or checkpoint (_NO_LOSS: it does not run)."""
    return now - since if since < now else 0


def _lost_of(sinces, now: int) -> list[int]:
    """`_lost` of each, written inline: a call per candidate cost 0.6 % of bench.placement's 200 row."""
    return [now - since if since < now else 0 for since in sinces]


def _first(pair: tuple):
    return pair[0]


class _Pick(tuple):
    """A candidate as `least_disruptive` sees it when no "reclaim" victim is among them: its id alone."""
    __slots__ = ()
    rule = "tier"

    def __new__(cls, job_id: str):
        return tuple.__new__(cls, (job_id,))

    job_id = property(lambda self: self[0])


def _shape_key(r: JobRequested) -> tuple:
    """Everything of `r` a Room (on a node without MIG cards) reads: two jobs of one key get the same Room there."""
    c = r.constraints
    return (r.cpu_milli, r.memory_mib, r.compute_milli, r.gpu_memory_mib, r.isolation_asked, r.gang,
            tuple(c.models) if c.models else (), c.min_compute_capability, c.min_driver, c.min_cuda)


def _at_least(need: tuple, other: tuple) -> bool:
    """Whether `need` (compute, GPU memory, CPU, memory) asks for at least `other`'s every amount: four comparisons
    written out (a zip and all() per failed job of the cycle's list cost ~800,000 generator steps in
    bench.placement --preemption --jobs 1000)."""
    return need[0] >= other[0] and need[1] >= other[1] and need[2] >= other[2] and need[3] >= other[3]


_STOPPABLE = frozenset({"placed", "running"})  # states a job may be stopped in for another (not yet stopping)

_SAME_EPOCH = frozenset({"job.requested", "job.started", "job.checkpointed", "scheduler.tick"})


def ElasticScheduler(elastic: ElasticConfig = ElasticConfig(), **kw) -> Scheduler:  # noqa: N802 - the name callers know
    """The scheduler with the autoscaler component (what the live agent runs): `Scheduler(elastic=..., **kw)`. It
    lives here, not in elastic.py: core imports elastic, never the other way round."""
    return Scheduler(elastic=elastic, **kw)


def live_config() -> dict:
    """The live scheduler agent's configuration: the autoscaler component, the product's ledger (a tenant without a
    quota gets 0). The audit replays with it, and any replay of the live log must: the same configuration decides
    the same."""
    return {"elastic": ElasticConfig()}


def step_contained(s: Scheduler, env: Envelope, log_ms: int | None) -> tuple[list[Envelope], str | None]:
    """`s.step`, with an input whose handling raises contained to that input: (its outputs, None), or ([], why)
    when it raised. The live agent and every replay (rebuild, audit) step through here, so a record that trips a
    bug in the policy is skipped the same way everywhere -- the replay still reproduces the live decisions -- and
    no record can stop the scheduler for everyone (a crash would read the same record again after the restart)."""
    try:
        return s.step(env, log_ms), None
    except Exception as exc:  # noqa: BLE001 - one record's fault, told by the caller, never a stop
        return [], f"{type(exc).__name__}: {exc}"


def replay(records, log_times: list[int] | None = None, *, scheduler: Scheduler | None = None, on_outputs=None,
           **config) -> tuple[Scheduler, list[Envelope]]:
    """The one replay: run the scheduler over recorded input -- the agent's rebuild, the audit and the benches all
    call this. `records`: envelopes, or record values as read from the log (bytes: decoded; one that does not decode
    is skipped, as the live scheduler skips it: the folds dead-lettered it), each at its log time when known.
    `scheduler`: go on from this state (a rebuild read in batches), else a new one configured as `config` says.
    `on_outputs(i, outputs)`: called per input record instead of collecting the outputs (a rebuild keeps none, the
    audit tags them with their input's offset). Returns the final state and the outputs collected."""
    s = scheduler if scheduler is not None else Scheduler(**config)
    outs: list[Envelope] = []
    for i, rec in enumerate(records):
        if not isinstance(rec, Envelope):
            try:
                rec = decode_fast(rec)
            except DecodeError:
                continue
        got, _fault = step_contained(s, rec, None if log_times is None else log_times[i])
        if on_outputs is not None:
            on_outputs(i, got)
        else:
            outs.extend(got)
    return s, outs
