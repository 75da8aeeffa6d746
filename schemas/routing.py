"""Which topic, and which key, each kind of record is written to; each kind has exactly one home topic."""
from __future__ import annotations

from schemas.envelope import Envelope
from schemas.topics import (
    COMMANDS, DECISIONS, INVENTORY, JOB_EVENTS, JOB_LOGS, JOB_REQUESTS, LEDGER, NODE_CONTROL, PRINCIPALS, TELEMETRY,
    TELEMETRY_MINUTES, TopicSpec,
)

_BY_KIND: dict[str, TopicSpec] = {
    # node agents
    "node.inventory": INVENTORY, "node.heartbeat": TELEMETRY, "gpu.telemetry": TELEMETRY,
    "job.started": JOB_EVENTS, "job.checkpointed": JOB_EVENTS, "job.completed": JOB_EVENTS, "job.failed": JOB_EVENTS,
    "job.stopped": JOB_EVENTS, "job.log": JOB_LOGS,
    "replica.ready": JOB_EVENTS, "replica.unready": JOB_EVENTS, "replica.metrics": JOB_EVENTS,
    # what operators decide about nodes (through the gateway) and what the worker derives from telemetry
    "node.cordon": NODE_CONTROL, "gpu.health": NODE_CONTROL, "node.liveness": NODE_CONTROL,
    "node.removed": NODE_CONTROL, "node.admitted": NODE_CONTROL,
    # requests, once the gateway let them in (or the autoscaler made them)
    "job.requested": JOB_REQUESTS, "job.cancelled": JOB_REQUESTS, "job.scale_requested": JOB_REQUESTS,
    "reservation.requested": JOB_REQUESTS, "reservation.cancelled": JOB_REQUESTS,
    "service.declared": JOB_REQUESTS, "service.removed": JOB_REQUESTS, "inference.load": JOB_REQUESTS,
    # the scheduler's and the gateway's answers
    "job.pending": DECISIONS, "job.rejected": DECISIONS, "reservation.decided": DECISIONS,
    "service.scaled": DECISIONS, "request.rejected": DECISIONS, "job.interrupted": DECISIONS,
    # the ledger
    "quota.set": LEDGER, "quota.changed": LEDGER, "quota.borrowed": LEDGER, "quota.returned": LEDGER,
    "usage.accrued": LEDGER, "price.set": LEDGER, "quota.rejected": LEDGER,
    # the worker's downsampled telemetry history
    "telemetry.minute": TELEMETRY_MINUTES, "pool.minute": TELEMETRY_MINUTES,
    "principal.registered": PRINCIPALS, "principal.removed": PRINCIPALS,
}


def home(kind: str) -> TopicSpec | None:
    """The one topic a kind may be read from (None: scheduler.tick, which lives on the scheduler input only)."""
    return COMMANDS if kind.startswith("cmd.") else _BY_KIND.get(kind)


def at_home(env: Envelope, topic: str) -> bool:
    spec = home(env.kind)
    return spec is not None and spec.name == topic


def key_of(env: Envelope, spec: TopicSpec) -> bytes:
    p = env.payload
    if spec in (INVENTORY, TELEMETRY, COMMANDS, NODE_CONTROL, TELEMETRY_MINUTES):
        # a move (cmd.migrate) goes to the node it leaves: that agent checkpoints and stops the run there
        key = getattr(p, "node", None) or getattr(p, "from_node", None) or getattr(p, "worker", "")
    elif spec in (JOB_REQUESTS, JOB_EVENTS, JOB_LOGS, DECISIONS):
        key = (getattr(p, "job_id", None) or getattr(p, "reservation_id", None) or getattr(p, "service_id", None)
               or getattr(p, "subject", None) or getattr(p, "request_id", ""))
    elif spec is PRINCIPALS:
        key = p.name
    else:
        key = getattr(p, "tenant", None) or "price-book"  # the ledger: by tenant; prices are everyone's
    return key.encode()


def route(env: Envelope) -> tuple[TopicSpec, bytes]:
    spec = home(env.kind)
    if spec is None:
        raise ValueError(f"{env.kind} has no home topic (scheduler.tick goes to the scheduler input only)")
    return spec, key_of(env, spec)
