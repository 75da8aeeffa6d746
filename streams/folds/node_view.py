"""The materialized view of one node: a pure fold `evolve(view, envelope) -> view`.

The same fold runs in three places: the Faust node-view table (keyed by node), the scheduler's snapshot, and the
audit replayer. It is idempotent: each source's sequence number is remembered, and a record whose seq is not newer
than the last applied one from that source changes nothing.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from functools import cached_property

from schemas.envelope import Envelope
from schemas.events import (
    Assignment, GpuCard, GpuHealth, GpuSample, GpuTelemetry, MigInstance, MigReconfigure, NodeCordon, NodeHeartbeat, NodeInventory,
    NodeAdmitted, NodeLiveness, NodeRemoved, PlaceJob, ReleaseJob, ResizeJob,
)
from schemas.gpu_models import MIG_MEMORY_SLICES, mig_profile, mig_share_milli

# XIDs after which a card must leave service until an operator clears it (NVIDIA's XID catalogue: double-bit ECC,
# internal micro-controller halt, row-remap failure, NVLink error, fallen off the bus, uncontained ECC, GSP errors).
FATAL_XIDS = frozenset({48, 62, 64, 74, 79, 95, 119, 120})


@dataclass(frozen=True)
class CardFree:
    """What is still free on one card. A MIG-enabled card is free only by instance, never as a whole."""
    uuid: str
    model: str
    milli: int
    memory_mib: int
    healthy: bool
    free_instances: tuple[MigInstance, ...] = ()
    mig: bool = False
    release_ms: int | None = None  # when the last holder is expected to finish (None: idle or open-ended)


@dataclass(frozen=True)
class FitSummary:
    """Per model on one node: (largest free milli on one healthy card, largest free memory on one, whole free cards);
    and whether any MIG instance is free. A necessary condition for a fit, computed once per view."""
    by_model: dict[str, tuple[int, int, int]]
    mig_free: bool


@dataclass(frozen=True)
class Held:
    slices: tuple[Assignment, ...]
    cpu_milli: int = 0
    memory_mib: int = 0
    expected_release_ms: int | None = None  # placement time + the job's stated duration, when it has one
    attempt: int = 0  # the placement's attempt (PlaceJob.attempt): a release or resize of an older one leaves it


@dataclass(frozen=True)
class NodeView:
    """Every field is a per-source fact or a max/latest-by-event-time merge of such facts, so the fold gives the same
    view for any interleaving of the sources (each source's own order kept): the property tests hold it to that."""
    node: str
    inventory: NodeInventory | None = None
    cordon: tuple[int, bool, bool] = (-1, False, False)  # (event time, cordoned, drain): the latest wins
    removal: tuple[int, bool] = (-1, False)  # (event time, removed) of node.removed: the latest wins
    last_heartbeat_ms: int = -1
    silent_since_ms: int = -2  # a liveness fold saw no heartbeat after this time; a later heartbeat overrides
    faults: dict[str, tuple[int, str]] = field(default_factory=dict)  # card uuid -> (latest fault time, why)
    cleared: dict[str, int] = field(default_factory=dict)  # card uuid -> latest operator clear time
    allocations: dict[str, "Held"] = field(default_factory=dict)  # job id -> what it holds here
    telemetry: dict[str, GpuSample] = field(default_factory=dict)  # card or MIG uuid -> latest sample
    applied: dict[str, int] = field(default_factory=dict)  # source -> last seq applied
    inventory_ms: int = -1  # event time of the inventory in force
    # card uuid -> (time, layout) of the latest MIG reconfigure command
    mig_commands: dict[str, tuple[int, tuple[MigInstance, ...]]] = field(default_factory=dict)
    # node identity (docs/security.md): an inventory relayed from a node principal's channel (its envelope's actor
    # set) makes the node one that needs admission; (event time, admitted) of the latest node.admitted decides it.
    # A node of a log from before node identity (no relayed inventory, no decision) counts as admitted.
    needs_admission: bool = False
    admission: tuple[int, bool] = (-1, False)

    @property
    def mig_pending(self) -> frozenset[str]:
        """Cards with a MIG reconfigure the node has not reported done: the inventory does not show the commanded
        layout and is not newer than the command. Not carved again meanwhile."""
        layouts = {g.uuid: g.mig_layout for g in self.cards()}
        return frozenset(u for u, (t, layout) in self.mig_commands.items()
                         if t >= self.inventory_ms and layouts.get(u) != layout)

    @property
    def cordoned(self) -> bool:
        return self.cordon[1]

    @property
    def drain(self) -> bool:
        return self.cordon[2]

    @property
    def removed(self) -> bool:
        """Decommissioned by an operator: no inventory brings it back, only a re-add (node.removed removed=false)."""
        return self.removal[1]

    @property
    def admitted(self) -> bool:
        return self.admission[1] if self.admission[0] >= 0 else not self.needs_admission

    @property
    def alive(self) -> bool:
        return self.last_heartbeat_ms > self.silent_since_ms

    @cached_property  # views are immutable: every change makes a new one, so derived facts are computed once
    def unhealthy(self) -> dict[str, str]:
        """Cards out of service: a fault newer than the last clear. A card stays out until an operator clears it."""
        return {u: why for u, (t, why) in sorted(self.faults.items()) if t > self.cleared.get(u, -1)}

    # ---------------------------------------------------------------- derived facts

    @property
    def schedulable(self) -> bool:
        return self.inventory is not None and self.alive and not self.cordoned and not self.removed and self.admitted

    def cards(self) -> tuple[GpuCard, ...]:
        return self.inventory.gpus if self.inventory else ()

    def free_cpu_memory(self) -> tuple[int, int]:
        return self._free_cpu_memory

    @cached_property
    def _free_cpu_memory(self) -> tuple[int, int]:
        if self.inventory is None:
            return 0, 0
        cpu = self.inventory.cpu_milli - sum(h.cpu_milli for h in self.allocations.values())
        mem = self.inventory.memory_mib - sum(h.memory_mib for h in self.allocations.values())
        return cpu, mem

    def card_free(self) -> tuple[CardFree, ...]:
        return self._card_free

    @cached_property
    def fit_summary(self) -> FitSummary:
        by_model: dict[str, tuple[int, int, int]] = {}
        mig_free = False
        for g, c in zip(self.cards(), self._card_free):  # card_free is one entry per card, in inventory order
            if not c.healthy:
                continue
            if c.mig:
                mig_free = mig_free or bool(c.free_instances)
                continue
            milli, mem, whole = by_model.get(c.model, (0, 0, 0))
            full = c.milli == 1000 and c.memory_mib == g.memory_mib
            by_model[c.model] = (max(milli, c.milli), max(mem, c.memory_mib), whole + full)
        return FitSummary(by_model, mig_free)

    @cached_property
    def _card_free(self) -> tuple[CardFree, ...]:
        used_milli: dict[str, int] = {}
        used_mem: dict[str, int] = {}
        used_mig: set[str] = set()
        release: dict[str, int | None] = {}
        for held in self.allocations.values():
            for a in held.slices:
                if a.gpu_uuid in release and release[a.gpu_uuid] is None or held.expected_release_ms is None:
                    release[a.gpu_uuid] = None
                else:
                    release[a.gpu_uuid] = max(release.get(a.gpu_uuid) or 0, held.expected_release_ms)
                used_milli[a.gpu_uuid] = used_milli.get(a.gpu_uuid, 0) + a.milli
                used_mem[a.gpu_uuid] = used_mem.get(a.gpu_uuid, 0) + a.memory_mib
                if a.mig_uuid:
                    used_mig.add(a.mig_uuid)
        out = []
        for card in self.cards():
            healthy = card.uuid not in self.unhealthy
            if card.mig_enabled:
                free = tuple(i for i in card.mig_layout if i.uuid not in used_mig and i.job_id is None)
                out.append(CardFree(card.uuid, card.model, sum(mig_share_milli(mig_profile(card.model, i.profile))
                                                               for i in free),
                                    sum(mig_profile(card.model, i.profile).memory_mib for i in free), healthy,
                                    free, mig=True, release_ms=release.get(card.uuid)))
            else:
                out.append(CardFree(card.uuid, card.model, 1000 - used_milli.get(card.uuid, 0),
                                    card.memory_mib - used_mem.get(card.uuid, 0), healthy,
                                    release_ms=release.get(card.uuid)))
        return tuple(out)

    def free_mig_slices(self, card: GpuCard) -> int:
        """Memory slices not covered by any MIG instance (room for a reconfigure)."""
        covered = sum(i.size for i in card.mig_layout)
        return MIG_MEMORY_SLICES - covered


# ---------------------------------------------------------------- the fold

def _fresh(view: NodeView, env: Envelope) -> bool:
    return env.seq > view.applied.get(env.source, -1)


_FIELDS = tuple(f.name for f in fields(NodeView))
_FIELD_SET = frozenset(_FIELDS)


def _with(view: NodeView, **changes) -> NodeView:
    """`dataclasses.replace(view, **changes)` without its per-field keyword pass and __init__ (a third of a placement's
    fold): the new view gets the old one's fields, then the changes -- and none of its derived facts (the cached
    properties live in the instance's dict beside the fields, and only the fields are copied)."""
    if not changes.keys() <= _FIELD_SET:
        raise TypeError(f"not NodeView fields: {sorted(changes.keys() - _FIELD_SET)}")
    new = object.__new__(NodeView)
    d, old = new.__dict__, view.__dict__
    for k in _FIELDS:
        d[k] = old[k]
    d.update(changes)
    return new


def _mark(view: NodeView, env: Envelope, **changes) -> NodeView:
    applied = dict(view.applied)
    applied[env.source] = env.seq
    return _with(view, applied=applied, **changes)


def _sample_fault(s: GpuSample) -> str:
    if not (s.fault or s.ecc_uncorrected or s.xid_errors):
        return ""  # the common case, said first: telemetry is most of what the fold sees
    if s.fault:
        return s.fault
    if s.ecc_uncorrected > 0:
        return f"uncorrectable ECC errors: {s.ecc_uncorrected}"
    fatal = sorted(FATAL_XIDS.intersection(s.xid_errors))
    return f"fatal XID {fatal[0]}" if fatal else ""


def _fault(faults: dict[str, tuple[int, str]], card: str, at: int, why: str) -> dict[str, tuple[int, str]]:
    if card in faults and faults[card][0] >= at:
        return faults
    out = dict(faults)
    out[card] = (at, why)
    return out


def _newer(view: NodeView, job_id: str, attempt: int) -> bool:
    """Whether the job holds slices here under a newer attempt than a command's (0: unnumbered, never older)."""
    held = view.allocations.get(job_id)
    return bool(attempt) and held is not None and held.attempt > attempt


def evolve(view: NodeView | None, env: Envelope) -> NodeView:
    """Apply one envelope to the view of the node it concerns. Unrelated kinds leave the view unchanged."""
    p = env.payload
    node = getattr(p, "node", None) or getattr(p, "to_node", None)
    if view is None:
        view = NodeView(node=node or "")
    if node != view.node or not _fresh(view, env):
        return view
    t = env.event_time_ms
    match p:
        case NodeInventory():
            needs = view.needs_admission or env.actor is not None  # relayed from a node principal's channel
            if t < view.inventory_ms:
                return _mark(view, env, last_heartbeat_ms=max(view.last_heartbeat_ms, t), needs_admission=needs)
            return _mark(view, env, inventory=p, inventory_ms=t, last_heartbeat_ms=max(view.last_heartbeat_ms, t),
                         needs_admission=needs)
        case MigReconfigure():
            commands = dict(view.mig_commands)
            if t >= commands.get(p.gpu_uuid, (-1, ()))[0]:
                commands[p.gpu_uuid] = (t, p.layout)
            return _mark(view, env, mig_commands=commands)
        case NodeHeartbeat():
            return _mark(view, env, last_heartbeat_ms=max(view.last_heartbeat_ms, t))
        case GpuTelemetry():
            telemetry = dict(view.telemetry)
            faults = view.faults
            for s in p.samples:
                telemetry[s.mig_uuid or s.gpu_uuid] = s
                why = _sample_fault(s)
                if why:
                    faults = _fault(faults, s.gpu_uuid, t, why)
            return _mark(view, env, telemetry=telemetry, faults=faults, last_heartbeat_ms=max(view.last_heartbeat_ms, t))
        case NodeCordon():
            return _mark(view, env, cordon=max(view.cordon, (t, p.cordoned, p.drain)))
        case NodeRemoved():
            return _mark(view, env, removal=max(view.removal, (t, p.removed)))
        case NodeAdmitted():
            return _mark(view, env, admission=max(view.admission, (t, p.admitted)))
        case NodeLiveness():
            if p.alive:
                return _mark(view, env, last_heartbeat_ms=max(view.last_heartbeat_ms, p.last_heartbeat_ms))
            return _mark(view, env, silent_since_ms=max(view.silent_since_ms, p.last_heartbeat_ms))
        case GpuHealth():
            if p.healthy:
                cleared = dict(view.cleared)
                cleared[p.gpu_uuid] = max(cleared.get(p.gpu_uuid, -1), t)
                return _mark(view, env, cleared=cleared)
            return _mark(view, env, faults=_fault(view.faults, p.gpu_uuid, t, p.reason or "reported unhealthy"))
        case PlaceJob():
            if _newer(view, p.job_id, p.attempt):
                return _mark(view, env)  # a superseded placement: the newer one holds the slices
            allocations = dict(view.allocations)
            release = t + p.duration_s * 1000 if p.duration_s is not None else None
            came = allocations[p.job_id] = Held(p.assignments, p.cpu_milli, p.memory_mib, release, p.attempt)
            out = _mark(view, env, allocations=allocations)
            if p.job_id not in view.allocations:
                _carry(view, out, came, 1)
            return out
        case ResizeJob():
            if _newer(view, p.job_id, p.attempt):
                return _mark(view, env)
            allocations = dict(view.allocations)
            before = allocations.get(p.job_id, Held(()))
            allocations[p.job_id] = replace(before, slices=p.assignments)
            return _mark(view, env, allocations=allocations)
        case ReleaseJob():
            if _newer(view, p.job_id, p.attempt):
                return _mark(view, env)  # ends an older run of the job, not the one holding the slices
            allocations = dict(view.allocations)
            gone = allocations.pop(p.job_id, None)
            out = _mark(view, env, allocations=allocations)
            if gone is not None:
                _carry(view, out, gone, -1)
            return out
    return view


def _carry(before: NodeView, after: NodeView, held: Held, sign: int) -> None:
    """Give `after` -- `before` with one holding added (sign 1) or taken off (-1), nothing else changed -- the free
    cards and free host CPU and memory that `before` has worked out already, moved by that holding alone: a
    placement or a release then costs the cards it touches, not a pass over every card and holder (the scheduler
    reads them of every view it makes). Equal to working them out afresh (tests/test_node_view.py); a holding of a
    MIG instance is left to the fresh count."""
    d, got = after.__dict__, before.__dict__
    if "_free_cpu_memory" in got and before.inventory is not None:
        cpu, mem = got["_free_cpu_memory"]
        d["_free_cpu_memory"] = (cpu - sign * held.cpu_milli, mem - sign * held.memory_mib)
    cards = got.get("_card_free")
    if cards is None or any(a.mig_uuid for a in held.slices):
        return
    moved: dict[str, list[int]] = {}
    for a in held.slices:
        m = moved.setdefault(a.gpu_uuid, [0, 0])
        m[0] += a.milli
        m[1] += a.memory_mib
    # when each touched card's last holder is expected to finish: _card_free's rule over the holders left
    release: dict[str, int | None] = {}
    for h in after.allocations.values():
        for a in h.slices:
            u = a.gpu_uuid
            if u in moved:
                if u in release and release[u] is None or h.expected_release_ms is None:
                    release[u] = None
                else:
                    release[u] = max(release.get(u) or 0, h.expected_release_ms)
    out = list(cards)
    for i, c in enumerate(cards):
        m = moved.get(c.uuid)
        if m is not None:
            if c.mig:
                return  # a slice of a MIG card that names no instance: left to the fresh count
            out[i] = CardFree(c.uuid, c.model, c.milli - sign * m[0], c.memory_mib - sign * m[1], c.healthy,
                              c.free_instances, False, release.get(c.uuid))
    d["_card_free"] = tuple(out)



# ---------------------------------------------------------------- telemetry in batches

def fold_telemetry(view: NodeView | None, envs: list[Envelope]) -> NodeView:
    """`evolve` over a run of one node's records from its telemetry partition (in log order), copying the view's
    maps once for the run instead of once a record: the same view as folding them one by one (property-tested,
    tests/test_telemetry_fold.py). What is not `gpu.telemetry` goes through `evolve` as it comes."""
    telemetry = faults = applied = None
    heartbeat = -1
    for env in envs:
        p = env.payload
        if not isinstance(p, GpuTelemetry):
            view = _settle(view, telemetry, faults, applied, heartbeat)
            telemetry = faults = applied = None
            view = evolve(view, env)
            continue
        if view is None:
            view = NodeView(node=p.node)
        if p.node != view.node:
            continue
        last = (applied if applied is not None else view.applied).get(env.source, -1)
        if env.seq <= last:
            continue
        if telemetry is None:
            telemetry, faults, applied = dict(view.telemetry), view.faults, dict(view.applied)
            heartbeat = view.last_heartbeat_ms
        t = env.event_time_ms
        for s in p.samples:
            telemetry[s.mig_uuid or s.gpu_uuid] = s
            if s.fault or s.ecc_uncorrected or s.xid_errors:  # _sample_fault's fast path, inline: the hot loop
                why = _sample_fault(s)
                if why:
                    faults = _fault(faults, s.gpu_uuid, t, why)
        applied[env.source] = env.seq
        heartbeat = max(heartbeat, t)
    return _settle(view, telemetry, faults, applied, heartbeat)


def _settle(view, telemetry, faults, applied, heartbeat) -> NodeView:
    if telemetry is None:
        return view
    return _with(view, telemetry=telemetry, faults=faults, applied=applied, last_heartbeat_ms=heartbeat)


def durable_change(before: NodeView | None, after: NodeView) -> bool:
    """Whether telemetry changed what the node view must not lose in a crash: a card's health (a new fault), the
    node's liveness, or a view that did not exist. The latest samples and heartbeat alone are written to the
    changelog at a bounded interval instead (streams/edge/telemetry.py)."""
    return before is None or after.faults != before.faults or after.alive != before.alive \
        or after.inventory is not before.inventory
