"""Which topic, and which key, each kind of record is written to."""
from __future__ import annotations

from schemas.envelope import Envelope
from schemas.topics import COMMANDS, INVENTORY, JOB_EVENTS, JOB_REQUESTS, LEDGER, TELEMETRY, TopicSpec

_BY_KIND: dict[str, TopicSpec] = {
    "node.inventory": INVENTORY, "node.cordon": INVENTORY, "gpu.health": INVENTORY,
    "node.heartbeat": TELEMETRY, "gpu.telemetry": TELEMETRY, "node.liveness": TELEMETRY,
    "job.requested": JOB_REQUESTS, "job.cancelled": JOB_REQUESTS, "job.scale_requested": JOB_REQUESTS,
    "job.started": JOB_EVENTS, "job.checkpointed": JOB_EVENTS, "job.completed": JOB_EVENTS, "job.failed": JOB_EVENTS,
    "job.stopped": JOB_EVENTS, "job.pending": JOB_EVENTS, "job.rejected": JOB_EVENTS,
    "quota.set": LEDGER, "quota.changed": LEDGER, "quota.borrowed": LEDGER, "quota.returned": LEDGER,
    "usage.accrued": LEDGER,
    # requests to the scheduler keyed by what they name; its answers beside the job events
    "reservation.requested": JOB_REQUESTS, "reservation.cancelled": JOB_REQUESTS,
    "service.declared": JOB_REQUESTS, "service.removed": JOB_REQUESTS, "inference.load": JOB_REQUESTS,
    "reservation.decided": JOB_EVENTS, "service.scaled": JOB_EVENTS,
    "node.removed": INVENTORY, "job.interrupted": JOB_EVENTS, "quota.rejected": LEDGER,
}


def route(env: Envelope) -> tuple[TopicSpec, bytes]:
    p = env.payload
    if env.is_command:
        spec = COMMANDS
    else:
        spec = _BY_KIND.get(p.kind)
        if spec is None:
            raise ValueError(f"{p.kind} has no home topic (scheduler.tick goes to the scheduler input only)")
    if spec in (INVENTORY, TELEMETRY, COMMANDS):
        key = getattr(p, "node", None) or getattr(p, "to_node", "")
    elif spec in (JOB_REQUESTS, JOB_EVENTS):
        key = getattr(p, "job_id", None) or getattr(p, "reservation_id", None) or p.service_id
    else:
        key = p.tenant
    return spec, key.encode()
