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
        key = p.job_id
    else:
        key = p.tenant
    return spec, key.encode()
