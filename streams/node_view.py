"""The materialized view of one node: a pure fold `evolve(view, envelope) -> view`.

The same fold runs in three places: the Faust node-view table (keyed by node), the scheduler's snapshot, and the
audit replayer. It is idempotent: each source's sequence number is remembered, and a record whose seq is not newer
than the last applied one from that source changes nothing.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from schemas.envelope import Envelope
from schemas.events import (
    Assignment, GpuCard, GpuHealth, GpuSample, GpuTelemetry, MigInstance, NodeCordon, NodeHeartbeat, NodeInventory,
    NodeLiveness, PlaceJob, ReleaseJob, ResizeJob,
)
from schemas.gpu_models import MIG_MEMORY_SLICES, mig_profile, mig_share_milli

# XIDs after which a card must leave service until an operator clears it (NVIDIA's XID catalogue: double-bit ECC,
# internal micro-controller halt, row-remap failure, NVLink error, fallen off the bus, uncontained ECC, GSP errors).
FATAL_XIDS = frozenset({48, 62, 64, 74, 79, 95, 119, 120})
HEARTBEAT_MISSES = 2  # a node is unschedulable after this many missed heartbeats


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


@dataclass(frozen=True)
class Held:
    slices: tuple[Assignment, ...]
    cpu_milli: int = 0
    memory_mib: int = 0


@dataclass(frozen=True)
class NodeView:
    node: str
    inventory: NodeInventory | None = None
    cordoned: bool = False
    drain: bool = False
    alive: bool = True
    last_heartbeat_ms: int = 0
    unhealthy: dict[str, str] = field(default_factory=dict)  # card uuid -> why
    allocations: dict[str, "Held"] = field(default_factory=dict)  # job id -> what it holds here
    telemetry: dict[str, GpuSample] = field(default_factory=dict)  # card or MIG uuid -> latest sample
    applied: dict[str, int] = field(default_factory=dict)  # source -> last seq applied

    # ---------------------------------------------------------------- derived facts

    @property
    def schedulable(self) -> bool:
        return self.inventory is not None and self.alive and not self.cordoned

    def cards(self) -> tuple[GpuCard, ...]:
        return self.inventory.gpus if self.inventory else ()

    def free_cpu_memory(self) -> tuple[int, int]:
        if self.inventory is None:
            return 0, 0
        cpu = self.inventory.cpu_milli - sum(h.cpu_milli for h in self.allocations.values())
        mem = self.inventory.memory_mib - sum(h.memory_mib for h in self.allocations.values())
        return cpu, mem

    def card_free(self) -> list[CardFree]:
        used_milli: dict[str, int] = {}
        used_mem: dict[str, int] = {}
        used_mig: set[str] = set()
        for held in self.allocations.values():
            for a in held.slices:
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
                                    free, mig=True))
            else:
                out.append(CardFree(card.uuid, card.model, 1000 - used_milli.get(card.uuid, 0),
                                    card.memory_mib - used_mem.get(card.uuid, 0), healthy))
        return out

    def free_mig_slices(self, card: GpuCard) -> int:
        """Memory slices not covered by any MIG instance (room for a reconfigure)."""
        covered = sum(i.size for i in card.mig_layout)
        return MIG_MEMORY_SLICES - covered


# ---------------------------------------------------------------- the fold

def _fresh(view: NodeView, env: Envelope) -> bool:
    return env.seq > view.applied.get(env.source, -1)


def _mark(view: NodeView, env: Envelope, **changes) -> NodeView:
    applied = dict(view.applied)
    applied[env.source] = env.seq
    return replace(view, applied=applied, **changes)


def _health_from_sample(unhealthy: dict[str, str], s: GpuSample) -> dict[str, str]:
    card = s.gpu_uuid
    if card in unhealthy:
        return unhealthy  # stays out until cleared by a gpu.health(healthy=True)
    why = ""
    if s.ecc_uncorrected > 0:
        why = f"uncorrectable ECC errors: {s.ecc_uncorrected}"
    fatal = sorted(FATAL_XIDS.intersection(s.xid_errors))
    if fatal:
        why = f"fatal XID {fatal[0]}"
    if not why:
        return unhealthy
    out = dict(unhealthy)
    out[card] = why
    return out


def evolve(view: NodeView | None, env: Envelope) -> NodeView:
    """Apply one envelope to the view of the node it concerns. Unrelated kinds leave the view unchanged."""
    p = env.payload
    node = getattr(p, "node", None) or getattr(p, "to_node", None)
    if view is None:
        view = NodeView(node=node or "")
    if node != view.node or not _fresh(view, env):
        return view
    match p:
        case NodeInventory():
            keep = {u: why for u, why in view.unhealthy.items() if any(c.uuid == u for c in p.gpus)}
            return _mark(view, env, inventory=p, unhealthy=keep, alive=True,
                         last_heartbeat_ms=max(view.last_heartbeat_ms, env.event_time_ms))
        case NodeHeartbeat():
            return _mark(view, env, last_heartbeat_ms=max(view.last_heartbeat_ms, env.event_time_ms), alive=True)
        case GpuTelemetry():
            telemetry = dict(view.telemetry)
            unhealthy = view.unhealthy
            for s in p.samples:
                telemetry[s.mig_uuid or s.gpu_uuid] = s
                unhealthy = _health_from_sample(unhealthy, s)
            return _mark(view, env, telemetry=telemetry, unhealthy=unhealthy,
                         last_heartbeat_ms=max(view.last_heartbeat_ms, env.event_time_ms), alive=True)
        case NodeCordon():
            return _mark(view, env, cordoned=p.cordoned, drain=p.drain)
        case NodeLiveness():
            return _mark(view, env, alive=p.alive)
        case GpuHealth():
            unhealthy = dict(view.unhealthy)
            if p.healthy:
                unhealthy.pop(p.gpu_uuid, None)
            else:
                unhealthy[p.gpu_uuid] = p.reason or "reported unhealthy"
            return _mark(view, env, unhealthy=unhealthy)
        case PlaceJob():
            allocations = dict(view.allocations)
            allocations[p.job_id] = Held(p.assignments, p.cpu_milli, p.memory_mib)
            return _mark(view, env, allocations=allocations)
        case ResizeJob():
            allocations = dict(view.allocations)
            before = allocations.get(p.job_id, Held(()))
            allocations[p.job_id] = replace(before, slices=p.assignments)
            return _mark(view, env, allocations=allocations)
        case ReleaseJob():
            allocations = dict(view.allocations)
            allocations.pop(p.job_id, None)
            return _mark(view, env, allocations=allocations)
    return view


def missed_heartbeats(view: NodeView, now_ms: int, interval_ms: int) -> bool:
    """True when the node has been silent for HEARTBEAT_MISSES intervals (the edge turns this into an event)."""
    return view.inventory is not None and now_ms - view.last_heartbeat_ms > HEARTBEAT_MISSES * interval_ms
