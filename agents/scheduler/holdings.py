"""Who holds what: the scheduler's state behind one write path.

`Holdings.apply(envelope)` is the only place holdings change. It takes what the scheduler folds -- its own commands
(`cmd.place`, `cmd.release`, `cmd.preempt`, `cmd.resize`, `cmd.migrate`, `cmd.mig_reconfigure`, and the placements of
reservation holds, which are never sent), the node facts (inventory, cordon, liveness, card health, removal) and the
job facts that change a run (`job.started`) -- and keeps every index derived from the node views and the job records
there, nowhere else:

- the node views (`streams/folds/node_view.evolve`, the fold the Faust table and the audit run too) and the node index
  (which nodes can take what: `node_index.py`);
- the victim index (which nodes hold work of which claim: `victims.py`);
- per tier, how many jobs hold capacity; per tenant and project, what the holders of each claim group hold (the
  claim order's standings, `claims.py`);
- which jobs are pending, placed, running, stopping (`set_phase` is the one writer of a record's phase: `apply`
  moves a job to placed, running and stopping, the scheduler's policy moves it back to pending or to done);
- the training share's tally: milli-GPU held by non-inference work and the pool's milli-GPU (docs/elastic.md).

The scheduler's policy (core.py) decides and emits; what it emits is applied here, so a decision and the state it
leaves cannot drift apart, and `rebuilt` (every index read afresh from the views and the records) must equal the
incrementally kept one (tests/test_holdings.py).
"""
from __future__ import annotations

import heapq
from array import array
from dataclasses import dataclass, field
from hashlib import blake2b
from typing import NamedTuple

from agents.scheduler.node_index import NodeIndex
from agents.scheduler.quota import held
from agents.scheduler.victims import VictimIndex
from schemas.envelope import Envelope
from schemas.events import (
    TIER_RANK, GpuHealth, JobRequested, JobStarted, MigrateJob, MigReconfigure, NodeCordon, NodeInventory,
    NodeAdmitted, NodeLiveness, NodeRemoved, PlaceJob, PreemptJob, ReleaseJob, ResizeJob, Tier,
)
from streams.folds import node_view

# A job record's phase: the scheduler's own bookkeeping of where a job is in its placement -- waiting in the queue,
# placed (told to start), running (its node said it started), told to stop or to move, done (nothing more is billed,
# released or charged for it). It is not the job's state as users see it (completed, failed, cancelled, ...): that
# is decided by streams/folds/job_view.py alone, from the job's events, and the scheduler asks job_view's rules where
# it needs one (`job_view.failure_ends`: whether a failed run ends the job).
PHASES = ("pending", "placed", "running", "stopping", "migrating", "done")
HOLDING = ("placed", "running", "stopping", "migrating")  # phases in which a job holds capacity on its nodes
VIEW_LOG = 8192  # node view changes kept in Holdings.view_log
MOVES_WINDOW_MS = 3600_000  # defrag.HOUR_MS: the window of the disruption budget
SUMS_LOG = 32  # latest changes a Sums keeps (Sums.log): a standing older than those is worked out again
GROUPS = 6  # claim groups: (tier, reserved), weakest first -- see claims.group


_FILLS = (PlaceJob, PreemptJob)  # view changes that never free anything (a stop order frees on the stop)


def group(tier: Tier, reserved: bool) -> int:
    """A job's claim group: 0 (offline) .. 5 (inference on its own reservation); higher is stronger."""
    return (2 - TIER_RANK[tier]) * 2 + (1 if reserved else 0)


@dataclass(slots=True)
class JobRecord:
    request: JobRequested
    arrival: int
    # the event id of the request that made the record: a decision about that request made later names it as its
    # cause (a rejection judged once the fleet settled or shrank), as job_view tells a rejection of this job from
    # one of another request under the same id by its cause
    request_event: str = ""
    # where the scheduler's placement bookkeeping has the job (PHASES; `Holdings.set_phase` writes it): not the job's
    # state as users see it, which streams/folds/job_view.py alone decides from the job's events
    phase: str = "pending"
    node: str = ""
    placement: PlaceJob | None = None  # the first part (the only one unless a gang spans nodes)
    parts: tuple[PlaceJob, ...] = ()
    started_ms: int = -1  # event time of the current run's start; -1 while it has not started
    preemptions: int = 0
    preempted_at: tuple[int, ...] = ()
    checkpoint: str = ""
    checkpoint_ms: int = 0
    pending_codes: tuple[str, ...] = ()
    pending_seen: tuple | None = None  # what its last failed attempt saw (core.Scheduler._unplaced)
    nominated: tuple[str, tuple[str, ...]] | None = None  # (node, victims) while its preemptions take effect
    claim: tuple[str, ...] = ()  # nodes whose freed capacity is kept for it while nominated
    mig_wait: tuple[str, str] | None = None  # (node, card) whose MIG reconfigure it waits for
    hold: object | None = None  # a reservation's hold (reservations.Booking): placed without a command, never a victim
    attempt: int = 0  # placements made so far: the number of the current one while it holds capacity
    accrued_ms: int = -1  # the current run is billed up to here (usage.accrued, on ticks and at its end)
    held_milli: int = 0  # what the quota ledger charged for the current placement (quota.held)
    held_memory_mib: int = 0
    interruptions: int = 0  # runs ended by a node loss, a card fault, a drain, a removal, an agent's own stop
    failures: int = 0  # runs that ended in job.failed and were retried (at most request.retries: core._retry)
    retry_at: int = -1  # log time before which it is not placed again (a failed run's back-off); -1: none
    stop_cause: str = ""  # why a "stopping" job was told to stop: "" (preempted for another job), Drain, NodeRemoved
    reserved: bool = False  # placed on its own reservation's capacity: reserved in-quota, never borrowed
    migrations: int = 0  # runs moved by defragmentation (cmd.migrate)
    migrated_at: tuple[int, ...] = ()
    migration: MigrateJob | None = None  # the move under way: the run stops on from_node, resumes on to_node
    completed_parts: tuple[int, ...] = ()  # the gang parts (indexes) of the current run that completed (core)
    standing_memo: tuple = ()  # (its tenant's sums version, the quota version, standing): claims.standing_now's memo
    quiet_memo: tuple = ()  # (preempted_at, until, reason): core.Scheduler._quiet's memo
    miss_memo: tuple = ()  # (view seq, nodes closed to it, node epoch, seen): its last attempt no node took
    # command id -> attempt of every cmd.place, cmd.preempt and cmd.migrate sent about it: a node's report names the
    # command it answers, so a report of a superseded run is known for what it is (core.Scheduler._superseded)
    commands: dict[str, int] = field(default_factory=dict)
    sources: tuple[str, ...] = ()  # its own input sources (named after it: core.own_source), forgotten with it
    said_ms: int = 0  # the latest max(log time, event time) of a record about it (how long it is remembered)

    @property
    def group(self) -> int:
        return group(self.request.tier, self.reserved or self.hold is not None)


# the JobRecord fields the policy writes through `Holdings.note` (the others: `apply`, `set_phase`, `Nominate`)
NOTED = frozenset({
    "said_ms", "sources", "accrued_ms", "completed_parts", "migration", "preemptions", "preempted_at", "interruptions",
    "checkpoint", "stop_cause", "failures", "retry_at", "mig_wait", "miss_memo", "attempt", "reserved", "quiet_memo",
    "pending_seen", "pending_codes", "standing_memo",
})


@dataclass(slots=True)
class Ended:
    """What the scheduler keeps of a job that ended (completed, failed, cancelled, rejected; a reservation's hold
    that ended): its JobRecord is replaced by this once nothing more can be billed, released or charged for it, so
    the state holds the live jobs in full and a few fields per finished one (docs/scheduler.md, "Finished jobs"):

    - `fingerprint` of its request: an identical `job.requested` again (a retry) changes nothing, another one under
      the same id is rejected `duplicate_job_id`;
    - `attempt` and `commands`: a late or repeated node report naming one of its commands is recognised as about a
      superseded run (a run that still says it runs is told to stop: cmd.release naming that attempt), exactly as
      the record answered;
    - `sources`: its own input sources, whose dedupe entries (`Scheduler.applied`) go when it is forgotten;
    - `until_ms`: the log time it is forgotten at -- `retain_ms` after the last record about it (core.RETAIN_MS)."""
    fingerprint: bytes
    attempt: int
    commands: dict[str, int]
    sources: tuple[str, ...]
    until_ms: int | None  # None: never forgotten (retain_ms None)


def fingerprint(request: JobRequested) -> bytes:
    """A digest of a request that two requests share exactly when they are equal (the pydantic JSON of a validated
    model, in field order): deterministic across processes, unlike hash()."""
    return blake2b(request.model_dump_json().encode(), digest_size=16).digest()


def pool_milli(view: node_view.NodeView) -> int:
    """The pool capacity a node contributes: 1000 milli-GPU per healthy card while it is schedulable, else 0."""
    if not view.schedulable:
        return 0
    bad = view.unhealthy
    return 1000 * sum(1 for g in view.cards() if g.uuid not in bad)


@dataclass
class Sums:
    """What the holders of each claim group hold in one account (tenant, or tenant and project), in the quota's
    units (milli-CU, GPU memory MiB): the claim order's standings are suffix sums of these."""
    milli: list[int] = field(default_factory=lambda: [0] * GROUPS)
    memory: list[int] = field(default_factory=lambda: [0] * GROUPS)
    # per group, each holder's (milli, MiB) by its arrival: the tie-break inside a group (earlier work first); and
    # per group a Fenwick tree over a window of arrivals of the same (base, trees), so "what the earlier arrivals
    # hold" is a log-time sum
    by_arrival: list[dict[int, list[int]]] = field(default_factory=lambda: [{} for _ in range(GROUPS)])
    _trees: list = field(default_factory=lambda: [None] * GROUPS)
    version: int = 0  # moves on every change: a standing worked out from these sums holds while it does not
    # the (group, arrival, milli, MiB) of the latest changes, log[i] the one that made version log_from + i + 1: a
    # standing worked out at an earlier version still holds when the changes since ahead of its job did not move
    # their holdings by as much as it had to spare (`holds_since`)
    log: list[tuple[int, int, int, int]] = field(default_factory=list)
    log_from: int = 0
    pin: int | None = None  # the log keeps every change after this version (`ahead_at` is asked of it)

    def at_least(self, g: int) -> tuple[int, int]:
        """What the holders of group g and stronger hold."""
        return sum(self.milli[g:]), sum(self.memory[g:])

    def ahead_of(self, g: int, arrival: int) -> tuple[int, int]:
        """What the holders ahead of a job of group g that arrived `arrival`-th hold: every stronger group's, and
        those of its own group that arrived before it (the claim order's tie-break)."""
        m, mem = self.at_least(g + 1) if g + 1 < GROUPS else (0, 0)
        t = self._trees[g]
        if t is not None:
            base, tm, tmem = t
            i = arrival - base  # arrival a sits at a - base + 1: the sum over arrivals < `arrival`
            if i >= len(tm) - 1:  # every holder of the group is in the tree's window: all of them
                return m + self.milli[g], mem + self.memory[g]
            while i > 0:
                m, mem = m + tm[i], mem + tmem[i]
                i -= i & -i
        return m, mem

    def ahead_at(self, version: int, g: int, arrival: int) -> tuple[int, int]:
        """What `ahead_of` said when these sums were at `version`: the changes since that were ahead of the job taken
        back. The log must hold them all (`pin`)."""
        m, mem = self.ahead_of(g, arrival)
        if version < self.log_from:
            raise ValueError(f"the sums' log starts after version {version}: pin it first")
        for gg, aa, dm, dmem in self.log[version - self.log_from:]:
            if gg > g or gg == g and aa < arrival:
                m, mem = m - dm, mem - dmem
        return m, mem

    def holds_since(self, version: int, g: int, arrival: int, within: bool,
                    room: tuple[int, int]) -> tuple[int, int] | None:
        """Whether a standing (`within`) worked out at `version` for a job of group g that arrived `arrival`-th still
        holds, and by how much now (None: it may not): `room` (milli, MiB) is by how much it held then
        (claims.within_by) -- if it stood within, the holders ahead of it (what `ahead_of` sums for it) took no
        more since than its slack in either unit; if not, they gave back less than it was beyond by in one unit.
        What they gave back (within) or took (beyond) is not counted: it only helps. None also when the changes
        since are no longer all in the log."""
        if version < self.log_from:
            return None
        rm, rmem = room
        for i in range(version - self.log_from, len(self.log)):
            gg, aa, m, mem = self.log[i]
            if gg > g or gg == g and aa < arrival:
                if within:
                    rm, rmem = rm - max(m, 0), rmem - max(mem, 0)
                    if rm < 0 or rmem < 0:
                        return None
                else:
                    rm, rmem = rm + min(m, 0), rmem + min(mem, 0)
                    if rm <= 0 and rmem <= 0:
                        return None
        return rm, rmem

    def add(self, g: int, arrival: int, milli: int, memory: int) -> None:
        """Count a holder's change (holdings._sum, the one writer)."""
        self.version += 1
        if len(self.log) >= SUMS_LOG:
            cut = SUMS_LOG // 2 if self.pin is None else min(SUMS_LOG // 2, self.pin - self.log_from)
            if cut > 0:
                del self.log[:cut]
                self.log_from += cut
        self.log.append((g, arrival, milli, memory))
        self.milli[g] += milli
        self.memory[g] += memory
        got = self.by_arrival[g].setdefault(arrival, [0, 0])
        got[0] += milli
        got[1] += memory
        if got == [0, 0]:
            del self.by_arrival[g][arrival]
        t = self._trees[g]
        if t is None or arrival < t[0] or arrival - t[0] + 1 >= len(t[1]):
            self._trees[g] = self._tree(g, arrival)  # out of its window: rebuilt from the holders
            return
        base, tm, tmem = t
        i = arrival - base + 1
        while i < len(tm):
            tm[i] += milli
            tmem[i] += memory
            i += i & -i

    def _tree(self, g: int, arrival: int):
        """The group's tree over a window of arrivals from its earliest holder's (or `arrival`), twice as wide as
        its holders' spread: sized by the work it holds now, not by every arrival ever counted (a tree sized by the
        arrival counter cost a scan of ~100,000 slots for a tenant's first job of a group, and most of a
        snapshot's bytes)."""
        held = self.by_arrival[g]
        base = min(held, default=arrival)
        size = max(1024, 2 * (max(held, default=arrival) - base) + 2)
        tm, tmem = array("q", bytes(8 * size)), array("q", bytes(8 * size))
        for a, (am, amem) in held.items():
            i = a - base + 1
            while i < size:
                tm[i] += am
                tmem[i] += amem
                i += i & -i
        return base, tm, tmem


# ---------------------------------------------------------------- the scheduler's own changes
# Besides the commands and facts it folds, the scheduler changes its bookkeeping of waiting jobs -- which are parked,
# which are nominated on nodes, which nodes preemption freed for whom -- and it does so only by applying one of these
# typed changes (`Holdings.apply`), so each piece of that bookkeeping has one writer and what is derived from it
# (`parked_by`, `parked_of`, `nominations`, `freed_by`) is kept in step there: `rebuilt` must reproduce it
# (tests/test_holdings_waits.py).

class Park(NamedTuple):
    """A waiting job in its quiet window that no node took leaves the queue (core.Scheduler._park): closed to the
    nodes `closed` (claimed by a nominated job ahead of it, or barred to it), parked in cycle `cycle`, its quiet
    window ending at `until` (log time)."""
    job_id: str
    tenant: str
    closed: frozenset
    tier: Tier
    cycle: int
    until: int


class Unpark(NamedTuple):
    """A parked job goes back to the queue (or its id is requested anew); nothing if it is not parked."""
    job_id: str


class UnparkAll(NamedTuple):
    """Every parked job goes back to the queue (the timed full cycle, a node's facts or a quota changed)."""


class Reclose(NamedTuple):
    """The jobs parked closed to `closed` are closed to `wider` (a superset) from now on."""
    closed: frozenset
    wider: frozenset


class Woke(NamedTuple):
    """The scheduler read `opened` and `unclosed` (core.Scheduler._wake): both start afresh."""


class Nominate(NamedTuple):
    """A job is nominated on a node, waiting for `nominated` = (node, victims), the nodes `claim` kept for it; or,
    `nominated` None, no longer. The nodes it claimed before are no longer closed to parked jobs (`unclosed`)."""
    job_id: str
    nominated: tuple | None
    claim: tuple = ()


class ChargeFreed(NamedTuple):
    """What preemption frees on `nodes` is kept for claim `key` (claims.Claim) until `until`, charged to `job_id`
    (core.Scheduler._charge): a node already kept for a stronger claim that has not expired keeps that claim."""
    job_id: str
    nodes: tuple
    key: tuple
    now_ms: int
    until: int


class RechargeFreed(NamedTuple):
    """`job_id` took its node: what is still kept for it is kept until `until`."""
    job_id: str
    until: int


class UnchargeFreed(NamedTuple):
    """`job_id` lets go of what was freed for it: those nodes are free capacity like any (and `unclosed`)."""
    job_id: str


class ExpireFreed(NamedTuple):
    """The charges whose time is up at `now_ms` go (and their nodes are `unclosed`)."""
    now_ms: int


class Holdings:
    """The scheduler's node views and job records, and everything derived from them; `apply` is the only write."""

    # While a cycle runs (core.Scheduler._cycle) the holdings are its snapshot: they take the cycle's own commands and
    # changes, and a fact (a node's inventory, a job's start, ...) is refused -- no input is folded mid-cycle.
    frozen = False

    def __init__(self) -> None:
        self.nodes: dict[str, node_view.NodeView] = {}
        self.jobs: dict[str, JobRecord] = {}
        self.index = NodeIndex()
        self.index.views = self.nodes  # the views it indexes, view for view (`_fold` updates it with each)
        self.victims = VictimIndex()
        self.held_by_tier: dict[int, int] = {}  # tier rank -> jobs holding capacity (holds aside)
        self.pending: set[str] = set()  # jobs in phase "pending": the cycle's queue
        self.pending_of: dict[str, int] = {}  # tenant -> how many of its jobs are pending (the cap's count)
        self.stopping: set[str] = set()  # jobs told to checkpoint and stop (or move), not yet stopped
        self.migrated: dict[str, list[int]] = {}  # tenant -> when its jobs were told to move (the disruption budget)
        self.running: dict[str, None] = {}  # jobs whose run is billed (started, holding), in order
        self.sums: dict[tuple[str, str | None], Sums] = {}  # (tenant, project or None) -> holders' sums per group
        self.train_held: dict[tuple[str, str], int] = {}  # (job, node) -> milli-GPU a non-inference job holds
        self.train_milli = 0
        # tenant -> milli-CPU its CPU-only jobs' parts hold (they charge no GPU quota: core.Scheduler._admit bounds
        # this by the tenant's quota instead, so one tenant's CPU-only jobs cannot take every host's CPU)
        self.host_cpu: dict[str, int] = {}
        self.cap: dict[str, int] = {}  # node -> milli-GPU it gives the pool (pool_milli)
        self.cap_milli = 0
        # the nodes whose views changed, in order (the last VIEW_LOG of them; view_base: the sequence number of the
        # first kept): what a waiting job's last failed attempt saw still holds while none it may use is in here
        self.view_log: list[str] = []
        self.view_base = 0
        # the nodes whose views changed in a way that may give a waiting job room (anything but a placement or a
        # stop order), since the scheduler last read them: what wakes its parked jobs (core.Scheduler._wake)
        self.opened: set[str] = set()
        # finished jobs (Ended, the compact record kept for idempotence) and when each is forgotten: a heap of
        # (until_ms, job id), an entry stale once its job's until_ms moved on (a later record about it) or it went
        self.ended: dict[str, Ended] = {}
        self.expiry: list[tuple[int, str]] = []
        # a job's own sources that spoke of a job nobody remembers (a report after it was forgotten, a request
        # refused as stale): (until_ms, source, job id), their dedupe entries dropped then unless the job is known
        self.strays: list[tuple[int, str, str]] = []
        self.done_now: list[JobRecord] = []  # records set to done in the step under way (buried at its end)
        # node -> how many times the phase or placement of a job holding capacity there changed: what is kept of who
        # may be stopped on a node is kept while its view object and this count stay the same (a job's phase can
        # change without its node's view: a move leaves the node it stops on as it is until the stop)
        self.node_jobs: dict[str, int] = {}
        # Parked jobs (kube-scheduler's unschedulable pods, Kueue's inadmissible workloads): job -> (the nodes closed
        # to it in its last attempt, its tier, the cycle it was parked in, its tenant); the same jobs by their closed
        # nodes and by tenant; (quiet window's end, job), a heap whose entries may be stale (`Park`, `Unpark`)
        self.parked: dict[str, tuple[frozenset[str], Tier, int, str]] = {}
        self.parked_by: dict[frozenset[str], dict[str, None]] = {}
        self.parked_of: dict[str, dict[str, None]] = {}
        self.park_until: list[tuple[int, str]] = []
        # nodes that may no longer be closed to a parked job (a claim or a charge ended) since the scheduler last
        # read them (`Woke`)
        self.unclosed: set[str] = set()
        # Jobs nominated on nodes (kube-scheduler's nominatedNodeName): job -> its record, exactly the records whose
        # `nominated` is set (`Nominate` writes both); the version moves on every change (the claimed nodes' memo)
        self.nominations: dict[str, JobRecord] = {}
        self.nominations_version = 0
        self.claims_memo: tuple[int, frozenset[str]] = (-1, frozenset())  # (version, every node a nomination claims)
        # What preemption freed, per node: node -> (the claim it was kept for, until when in log time, for whom),
        # and its inverse, job -> the nodes kept for it (`ChargeFreed` .. `ExpireFreed`)
        self.freed_for: dict[str, tuple[tuple, int, str]] = {}
        self.freed_by: dict[str, dict[str, None]] = {}
        self.barred_memo: dict[tuple, frozenset[str]] = {}  # claim -> the nodes kept for it or a stronger one
        self.barred_until = -1 << 62  # the memo holds until the first charge in it expires (a lower bound)

    # ---------------------------------------------------------------- the write path

    def add_job(self, rec: JobRecord) -> None:
        """A new job record (a request, or a reservation's hold when its window opens): pending. A hold's id may
        have ended before (a booking's hold queued again): the new record takes over what was kept of it."""
        t = self.ended.pop(rec.request.job_id, None)
        if t is not None:
            rec.commands, rec.sources = dict(t.commands), t.sources
        self.jobs[rec.request.job_id] = rec
        rec.phase = "pending"
        self._pending(rec, True)

    def _pending(self, rec: JobRecord, pending: bool) -> None:
        """The one place a job enters or leaves the pending set, and its tenant's count with it."""
        j, tenant = rec.request.job_id, rec.request.tenant
        if pending and j not in self.pending:
            self.pending.add(j)
            self.pending_of[tenant] = self.pending_of.get(tenant, 0) + 1
        elif not pending and j in self.pending:
            self.pending.discard(j)
            left = self.pending_of[tenant] - 1
            if left:
                self.pending_of[tenant] = left
            else:
                del self.pending_of[tenant]

    def set_phase(self, rec: JobRecord, phase: str) -> None:
        """The one writer of a record's phase; keeps the pending and stopping sets."""
        j = rec.request.job_id
        state = rec.phase = phase
        self._moved(rec)
        self._pending(rec, state == "pending")
        if state in ("stopping", "migrating"):
            self.stopping.add(j)
        else:
            self.stopping.discard(j)
        if state == "done":
            self.done_now.append(rec)
            if rec.nominated is not None:  # a finished job claims nothing (a reservation's hold ended while nominated)
                self._nominate(Nominate(j, None))

    def note(self, rec: JobRecord, **fields) -> None:
        """The policy's writes to a job record's own bookkeeping: its counts (attempt, failures, preemptions,
        interruptions), back-off, checkpoint and stop cause, what it waits for (a MIG carve), what it was told
        (pending_codes, pending_seen), billing (accrued_ms), whether it is reserved, and the memos kept on it. Every
        JobRecord field written outside `apply` is written here, `set_phase`, `checkpointed` or by `Nominate`:
        `NOTED` names the fields; the phase, the placement and the nomination have their own writers."""
        for k, v in fields.items():
            if k not in NOTED:
                raise AttributeError(f"JobRecord.{k} is not written by Holdings.note")
            setattr(rec, k, v)

    def commanded(self, rec: JobRecord, command_id: str, attempt: int) -> None:
        """A command about one run of the job was sent: which run (attempt) it concerns."""
        rec.commands[command_id] = attempt

    def checkpointed(self, rec: JobRecord, checkpoint: str, at_ms: int) -> None:
        """A run's checkpoint: what it resumes from, and from when it would lose work if stopped."""
        rec.checkpoint, rec.checkpoint_ms = checkpoint, at_ms
        self._moved(rec)

    def _moved(self, rec: JobRecord) -> None:
        """A change to the record of a job holding capacity on its parts' nodes (`node_jobs`)."""
        for part in rec.parts:
            self.node_jobs[part.node] = self.node_jobs.get(part.node, 0) + 1

    def bury(self, rec: JobRecord, until_ms: int | None) -> None:
        """Replace a finished job's record by what is kept of it (Ended), to be forgotten at `until_ms`."""
        j = rec.request.job_id
        del self.jobs[j]
        self.ended[j] = Ended(fingerprint(rec.request), rec.attempt, rec.commands, rec.sources, until_ms)
        if until_ms is not None:
            heapq.heappush(self.expiry, (until_ms, j))

    def ended_source(self, job_id: str, source: str) -> None:
        """One of a finished job's own sources spoke of it: its dedupe entry goes when the job is forgotten."""
        t = self.ended[job_id]
        if source not in t.sources:
            t.sources += (source,)

    def keep_until(self, job_id: str, until_ms: int) -> None:
        """A record about a finished job arrived: it is kept until `until_ms` at least."""
        t = self.ended[job_id]
        if t.until_ms is not None and until_ms > t.until_ms:
            t.until_ms = until_ms
            heapq.heappush(self.expiry, (until_ms, job_id))

    def forget(self, now_ms: int) -> list[tuple[str, Ended]]:
        """Drop the finished jobs whose time is up (until_ms <= now_ms); returns them."""
        gone = []
        heap = self.expiry
        while heap and heap[0][0] <= now_ms:
            until, j = heapq.heappop(heap)
            t = self.ended.get(j)
            if t is not None and t.until_ms == until:
                del self.ended[j]
                gone.append((j, t))
        return gone

    def apply(self, env, fact_ms: int | None = None) -> None:
        """Fold one command, node fact or job fact (an Envelope) or one of the scheduler's own changes (`Park` ..
        `ExpireFreed`) into the holdings and every index. `fact_ms`: a job fact's time as the scheduler takes it
        (the node's own time, never later than the log's)."""
        own = _OWN.get(type(env))
        if own is not None:
            own(self, env)
            return
        if self.frozen and not env.is_command:
            raise RuntimeError(f"{env.kind} folded during a cycle: a cycle runs over a snapshot of the holdings")
        p = env.payload
        match p:
            case NodeInventory() | NodeCordon() | NodeLiveness() | GpuHealth() | NodeRemoved() | NodeAdmitted():
                view = self._fold(p.node, env)
                cap = pool_milli(view)
                self.cap_milli += cap - self.cap.get(p.node, 0)
                self.cap[p.node] = cap
            case PlaceJob():
                self._place(env, p)
            case ReleaseJob():
                self._release(env, p)
            case PreemptJob():
                self._fold(p.node, env)
                rec = self.jobs.get(p.job_id)
                if rec is not None and self._current(rec, p.attempt) and rec.phase in ("placed", "running"):
                    code = p.reasons[0].code if p.reasons else ""
                    rec.stop_cause = "" if code == "PreemptedFor" else code
                    self.set_phase(rec, "stopping")
            case ResizeJob():
                self._fold(p.node, env)
                rec = self.jobs.get(p.job_id)
                if rec is not None and self._current(rec, p.attempt) and rec.placement is not None:
                    # the claim order's sums count what the part holds now (a boost is held capacity of its
                    # account): a release takes off what it holds then, and a rebuild counts the parts as they are
                    models = {g.uuid: g.model for g in self.nodes[p.node].cards()}
                    ask = rec.request.compute_milli
                    for part in rec.parts:
                        if part.node == p.node:
                            was = held(part.assignments, models.__getitem__, ask)
                            now = held(p.assignments, models.__getitem__, ask)
                            if now != was:
                                self._sum(rec, now[0] - was[0], now[1] - was[1], 1)
                    rec.parts = tuple(part.model_copy(update={"assignments": p.assignments})
                                      if part.node == p.node else part for part in rec.parts)
                    rec.placement = rec.parts[0]
                    self._train(rec, p.node, sum(a.milli for a in p.assignments))
            case MigrateJob():
                self._fold(p.to_node, env)  # the target holds the job's cards from now on (streams/folds/node_view.py)
                rec = self.jobs.get(p.job_id)
                if rec is not None and self._current(rec, p.attempt) and rec.phase in ("placed", "running"):
                    rec.migration, rec.stop_cause = p, "Migrate"
                    rec.migrations += 1
                    rec.migrated_at += (env.event_time_ms,)
                    moved = self.migrated.setdefault(rec.request.tenant, [])
                    moved.append(env.event_time_ms)
                    # the disruption budget counts the last hour's moves (defrag.recent_moves, on a clock that
                    # never goes back): older ones never count again
                    while moved[0] <= env.event_time_ms - MOVES_WINDOW_MS:
                        del moved[0]
                    self.set_phase(rec, "migrating")
            case MigReconfigure():
                self._fold(p.node, env)
            case JobStarted():
                rec = self.jobs[p.job_id]
                rec.started_ms = rec.accrued_ms = env.event_time_ms if fact_ms is None else fact_ms
                self._moved(rec)  # the work it would lose if stopped counts from here
                if rec.phase == "placed":
                    self.set_phase(rec, "running")
                self.running[p.job_id] = None

    def _current(self, rec: JobRecord, attempt: int) -> bool:
        return not attempt or attempt == rec.attempt

    def _fold(self, name: str, env: Envelope) -> node_view.NodeView:
        view = self.nodes[name] = node_view.evolve(self.nodes.get(name), env)
        self.view_log.append(name)
        if not isinstance(env.payload, _FILLS):
            self.opened.add(name)
        if len(self.view_log) > VIEW_LOG:
            del self.view_log[:VIEW_LOG // 2]
            self.view_base += VIEW_LOG // 2
        self.index.update(view)
        self.victims.fold(name, env.payload, view, self.jobs, self.nodes)
        return view

    def _place(self, env: Envelope, p: PlaceJob) -> None:
        rec = self.jobs[p.job_id]
        first = p.gang_index == 0
        if first and rec.placement is not None:
            self._drop(rec)  # a hold placed again elsewhere: nothing of the old placement stays counted
        self._fold(p.node, env)
        models = {g.uuid: g.model for g in self.nodes[p.node].cards()}
        cu, mem = held(p.assignments, models.__getitem__, rec.request.compute_milli)
        if first:
            rec.parts, rec.held_milli, rec.held_memory_mib = (), 0, 0
        # the record keeps the command without its reasons: they went out with it (the job's events, `explain`),
        # and nothing here reads them again -- a few Reason models per placed job are most of what a job costs
        # to hold (#35 item 3)
        rec.parts += (p.model_copy(update={"reasons": ()}) if p.reasons else p,)
        rec.placement, rec.node = rec.parts[0], rec.parts[0].node
        rec.held_milli += cu
        rec.held_memory_mib += mem
        self._sum(rec, cu, mem, 1)
        self._host(rec, p.cpu_milli, 1)
        if first:
            if rec.hold is None:
                rank = TIER_RANK[rec.request.tier]
                self.held_by_tier[rank] = self.held_by_tier.get(rank, 0) + 1
            rec.pending_codes, rec.pending_seen = (), None
            self.set_phase(rec, "placed")
        if rec.hold is None:
            self._train(rec, p.node, sum(a.milli for a in p.assignments))

    def _release(self, env: Envelope, p: ReleaseJob) -> None:
        self._fold(p.node, env)
        rec = self.jobs.get(p.job_id)
        if rec is None or rec.placement is None or not self._current(rec, p.attempt):
            return  # the release of a superseded run: the job's newer run (if any) is untouched (node_view alike)
        mine = [part for part in rec.parts if part.node == p.node]
        if not mine:
            return
        if rec.migration is not None and rec.migration.to_node == p.node:
            rec.migration = None  # the target's hold of a move that is called off
        models = {g.uuid: g.model for g in self.nodes[p.node].cards()}
        for part in mine:
            cu, mem = held(part.assignments, models.__getitem__, rec.request.compute_milli)
            self._sum(rec, cu, mem, -1)
            self._host(rec, part.cpu_milli, -1)
        if rec.hold is None:
            self._train(rec, p.node, 0)
        rest = tuple(part for part in rec.parts if part.node != p.node)
        if rest:
            rec.parts, rec.placement, rec.node = rest, rest[0], rest[0].node
            return
        self._ended(rec)

    def _ended(self, rec: JobRecord) -> None:
        """The run holds nothing any more: off every index (the state the policy gives it next)."""
        j = rec.request.job_id
        self._moved(rec)
        if rec.hold is None:
            self.held_by_tier[TIER_RANK[rec.request.tier]] -= 1
        self.running.pop(j, None)
        self.stopping.discard(j)
        rec.placement, rec.parts, rec.node = None, (), ""
        rec.started_ms = -1
        rec.held_milli = rec.held_memory_mib = 0

    def _drop(self, rec: JobRecord) -> None:
        self._sum(rec, rec.held_milli, rec.held_memory_mib, -1)
        for part in rec.parts:
            self._host(rec, part.cpu_milli, -1)
        self._ended(rec)

    def _host(self, rec: JobRecord, cpu_milli: int, sign: int) -> None:
        """The tally of CPU-only jobs' CPU per tenant (`host_cpu`)."""
        if rec.request.cpu_only:
            t = rec.request.tenant
            left = self.host_cpu.get(t, 0) + sign * cpu_milli
            if left:
                self.host_cpu[t] = left
            else:
                self.host_cpu.pop(t, None)

    def _sum(self, rec: JobRecord, milli: int, memory: int, sign: int) -> None:
        r, g = rec.request, rec.group
        for key in ((r.tenant, None), (r.tenant, r.project)):
            s = self.sums.get(key)
            if s is None:
                s = self.sums[key] = Sums()
            s.add(g, rec.arrival, sign * milli, sign * memory)

    def _train(self, rec: JobRecord, node: str, milli: int) -> None:
        """The training share's tally: milli-GPU held by non-inference work on each node."""
        if rec.request.tier == Tier.INFERENCE:
            return
        key = (rec.request.job_id, node)
        self.train_milli += milli - self.train_held.pop(key, 0)
        if milli:
            self.train_held[key] = milli


    # ---------------------------------------------------------------- the scheduler's own changes (apply's)

    def _park(self, c: Park) -> None:
        self.parked[c.job_id] = (c.closed, c.tier, c.cycle, c.tenant)
        self.parked_by.setdefault(c.closed, {})[c.job_id] = None
        self.parked_of.setdefault(c.tenant, {})[c.job_id] = None
        heapq.heappush(self.park_until, (c.until, c.job_id))

    def _unpark(self, c: Unpark) -> None:
        got = self.parked.pop(c.job_id, None)
        if got is None:
            return
        closed, _, _, tenant = got
        for index, key in ((self.parked_by, closed), (self.parked_of, tenant)):
            same = index[key]
            del same[c.job_id]
            if not same:
                del index[key]

    def _unpark_all(self, c: UnparkAll) -> None:
        for d in (self.parked, self.parked_by, self.parked_of):
            d.clear()
        self.park_until.clear()

    def _reclose(self, c: Reclose) -> None:
        moved = self.parked_by.pop(c.closed)
        into = self.parked_by.setdefault(c.wider, {})
        parked = self.parked
        for j in moved:
            into[j] = None
            p = parked[j]
            parked[j] = (c.wider, p[1], p[2], p[3])

    def _woke(self, c: Woke) -> None:
        self.opened.clear()
        self.unclosed.clear()

    def _nominate(self, c: Nominate) -> None:
        rec = self.jobs[c.job_id]
        self.unclosed.update(rec.claim)
        self.nominations_version += 1
        rec.nominated, rec.claim = c.nominated, c.claim if c.nominated is not None else ()
        if c.nominated is None:
            self.nominations.pop(c.job_id, None)
        else:
            self.nominations[c.job_id] = rec

    def _charge_freed(self, c: ChargeFreed) -> None:
        self._uncharge_freed(UnchargeFreed(c.job_id))  # a plan made again: what the last one freed is not kept
        mine = None
        for n in c.nodes:
            old = self.freed_for.get(n)
            k = old[0] if old is not None and old[1] > c.now_ms and old[0] > c.key else c.key
            if old is not None and old[2] != c.job_id:
                self._unown(old[2], n)
            self.freed_for[n] = (k, c.until, c.job_id)
            if mine is None:
                mine = self.freed_by.setdefault(c.job_id, {})
            mine[n] = None
        self.barred_memo.clear()
        self.barred_until = min(self.barred_until, c.until)

    def _unown(self, job_id: str, node: str) -> None:
        nodes = self.freed_by[job_id]
        del nodes[node]
        if not nodes:
            del self.freed_by[job_id]

    def _recharge_freed(self, c: RechargeFreed) -> None:
        for n in self.freed_by.get(c.job_id, ()):
            old = self.freed_for[n]
            self.freed_for[n] = (old[0], c.until, old[2])

    def _uncharge_freed(self, c: UnchargeFreed) -> None:
        nodes = self.freed_by.pop(c.job_id, None)
        if nodes is None:
            return
        for n in nodes:
            del self.freed_for[n]
            self.unclosed.add(n)
        self.barred_memo.clear()

    def _expire_freed(self, c: ExpireFreed) -> None:
        now = c.now_ms
        if now < self.barred_until or not self.freed_for:
            return
        for n, f in list(self.freed_for.items()):
            if f[1] <= now:
                self.unclosed.add(n)
                del self.freed_for[n]
                self._unown(f[2], n)
        self.barred_memo.clear()
        self.barred_until = min((f[1] for f in self.freed_for.values()), default=1 << 62)

    def barred(self, mine: tuple) -> frozenset[str]:
        """The nodes kept for a claim at least as strong as `mine` (charges expired first: `ExpireFreed`)."""
        got = self.barred_memo.get(mine)
        if got is None:
            got = self.barred_memo[mine] = frozenset(n for n, f in self.freed_for.items() if mine <= f[0])
        return got

    def claimed_all(self) -> frozenset[str]:
        """Every node a nominated job claims."""
        v, got = self.claims_memo
        if v != self.nominations_version:
            got = frozenset(n for o in self.nominations.values() for n in o.claim)
            self.claims_memo = (self.nominations_version, got)
        return got

    def waits_state(self) -> tuple:
        """What `rebuilt` must reproduce of the scheduler's own bookkeeping (for the tests)."""
        return ({k: dict(v) for k, v in self.parked_by.items()}, {k: dict(v) for k, v in self.parked_of.items()},
                {j: r.request.job_id for j, r in self.nominations.items()},
                {j: dict(ns) for j, ns in self.freed_by.items()})

    # ---------------------------------------------------------------- reading

    @property
    def view_seq(self) -> int:
        """The number of node view changes so far."""
        return self.view_base + len(self.view_log)

    def views_changed_since(self, seq: int, closed: frozenset[str]) -> bool:
        """Whether a node outside `closed` changed its view after change number `seq` (True also when the log no
        longer reaches back that far)."""
        if seq < self.view_base:
            return True
        return any(n not in closed for n in self.view_log[seq - self.view_base:])

    def holding(self, rec: JobRecord) -> bool:
        return rec.phase in HOLDING and rec.placement is not None

    def card_model(self, node: str, gpu_uuid: str) -> str:
        inv = self.nodes[node].inventory
        return next((g.model for g in inv.gpus if g.uuid == gpu_uuid), "unknown") if inv else "unknown"

    def state(self) -> tuple:
        """Everything `rebuilt` must reproduce (for the tests)."""
        return (self.victims.state(), {k: v for k, v in self.held_by_tier.items() if v}, set(self.pending),
                dict(self.pending_of),
                set(self.stopping), set(self.running),
                {k: (s.milli, s.memory) for k, s in self.sums.items() if any(s.milli) or any(s.memory)},
                self.train_milli, dict(self.train_held), dict(self.host_cpu), self.cap_milli,
                self.index.capacity_milli,
                {k: dict(v) for k, v in self.index.buckets.items() if v})



_OWN = {
    Park: Holdings._park, Unpark: Holdings._unpark, UnparkAll: Holdings._unpark_all, Reclose: Holdings._reclose,
    Woke: Holdings._woke, Nominate: Holdings._nominate, ChargeFreed: Holdings._charge_freed,
    RechargeFreed: Holdings._recharge_freed, UnchargeFreed: Holdings._uncharge_freed,
    ExpireFreed: Holdings._expire_freed,
}

def rebuilt(nodes: dict[str, node_view.NodeView], jobs: dict[str, JobRecord], parked: dict | None = None,
            freed_for: dict | None = None) -> Holdings:
    """The derived state read afresh from the node views and the job records (what `apply` must have kept), and of
    the scheduler's bookkeeping from its facts: the parked jobs (`Holdings.parked`), the nominations (the records'
    `nominated`) and what preemption freed for whom (`Holdings.freed_for`)."""
    h = Holdings()
    h.nodes, h.jobs = dict(nodes), jobs
    h.index.views = h.nodes
    for j, (closed, tier, cycle, tenant) in (parked or {}).items():
        h.parked[j] = (closed, tier, cycle, tenant)
        h.parked_by.setdefault(closed, {})[j] = None
        h.parked_of.setdefault(tenant, {})[j] = None
    for n, f in (freed_for or {}).items():
        h.freed_for[n] = f
        h.freed_by.setdefault(f[2], {})[n] = None
    h.barred_until = min((f[1] for f in h.freed_for.values()), default=1 << 62)
    h.nominations = {j: rec for j, rec in jobs.items() if rec.nominated is not None}
    for name, view in nodes.items():
        h.index.update(view)
        cap = pool_milli(view)
        h.cap[name] = cap
        h.cap_milli += cap
    h.victims.sync(h.nodes, jobs)
    for j, rec in jobs.items():
        if rec.phase == "pending":
            h._pending(rec, True)
        if rec.phase in ("stopping", "migrating"):
            h.stopping.add(j)
        if rec.placement is None:
            continue
        if rec.hold is None:
            rank = TIER_RANK[rec.request.tier]
            h.held_by_tier[rank] = h.held_by_tier.get(rank, 0) + 1
        if rec.phase in ("running", "stopping", "migrating") and rec.started_ms >= 0:
            h.running[j] = None
        for part in rec.parts:
            models = {g.uuid: g.model for g in nodes[part.node].cards()}
            cu, mem = held(part.assignments, models.__getitem__, rec.request.compute_milli)
            h._sum(rec, cu, mem, 1)
            h._host(rec, part.cpu_milli, 1)
            if rec.hold is None:
                h._train(rec, part.node, sum(a.milli for a in part.assignments))
    return h
