"""How an envelope becomes ClickHouse rows. Pure, so the sink and the audit replayer agree by construction."""
from __future__ import annotations

import orjson

from schemas.envelope import Envelope
from schemas.events import (
    PriceSet, QuotaBorrowed, QuotaChanged, QuotaRejected, QuotaReturned, QuotaSet, UsageAccrued,
)

COLUMNS: dict[str, tuple[str, ...]] = {
    "events": ("topic", "partition", "offset", "event_id", "kind", "source", "seq", "event_time_ms", "tenant", "job_id",
               "node", "command_id", "payload", "actor", "claimed_time_ms"),
    "usage": ("topic", "partition", "offset", "event_id", "tenant", "project", "job_id", "tier", "node", "gpu_model",
              "datacenter", "start_ms", "end_ms", "gpu_milli", "gpu_milli_ms", "borrowed", "cu_milli", "cu_milli_ms",
              "reserved", "attempt"),
    "quota_events": ("topic", "partition", "offset", "event_id", "event_time_ms", "kind", "tenant", "project", "job_id",
                     "quota_milli", "used_milli", "borrowed_milli", "milli", "overcommit_pct", "reserved_milli",
                     "quota_memory_mib", "used_memory_mib", "actor", "answers"),
    "price_book": ("gpu_model", "datacenter", "tod_band", "tier", "borrowed", "micro_per_gpu_hour", "valid_from",
                   "event_id", "actor"),
    "scheduling": ("topic", "partition", "offset", "event_id", "event_time_ms", "kind", "command_id", "job_id", "tenant",
                   "node", "reasons"),
}
SCHEDULING_KINDS = frozenset({"cmd.place", "cmd.preempt", "cmd.resize", "cmd.migrate", "cmd.release",
                              "cmd.mig_reconfigure", "job.pending", "job.rejected", "job.interrupted"})


def rows_for(env: Envelope, topic: str, partition: int, offset: int) -> dict[str, list]:
    """Rows per table for one record, in COLUMNS order."""
    p = env.payload
    at = (topic, partition, offset, env.event_id)
    job_id = getattr(p, "job_id", "") or ""
    node = getattr(p, "node", "") or getattr(p, "to_node", "") or ""
    command_id = getattr(p, "command_id", "") or ""
    payload_json = orjson.dumps(p.model_dump(mode="json")).decode()
    actor = env.actor or ""
    out: dict[str, list] = {"events": [[*at, p.kind, env.source, env.seq, env.event_time_ms,
                                        env.tenant or "", job_id, node, command_id, payload_json, actor,
                                        env.claimed_time_ms if env.claimed_time_ms is not None else -1]]}
    match p:
        case UsageAccrued():
            out["usage"] = [[*at, p.tenant, p.project, p.job_id, p.tier.value, p.node, p.gpu_model, p.datacenter,
                             p.start_ms, p.end_ms, p.gpu_milli, p.gpu_milli_ms, p.borrowed, p.cu_milli, p.cu_milli_ms,
                             p.reserved, p.attempt]]
        case QuotaSet():
            out["quota_events"] = [[*at, env.event_time_ms, p.kind, p.tenant, p.project or "", "",
                                    p.gpu_milli, 0, 0, 0, p.overcommit_pct, 0, p.gpu_memory_mib or 0, 0, actor, ""]]
        case QuotaChanged():
            out["quota_events"] = [[*at, env.event_time_ms, p.kind, p.tenant, p.project or "",
                                    p.job_id or "", 0, p.used_milli, p.borrowed_milli, 0, 0, p.reserved_milli, 0,
                                    p.used_memory_mib, actor, ""]]
        case PriceSet():
            out["price_book"] = [[p.gpu_model, p.datacenter, p.tod_band, p.tier, p.borrowed, p.micro_per_gpu_hour,
                                  p.valid_from_ms, env.event_id, actor]]  # DateTime64(3) takes epoch ms
        case QuotaRejected():  # a refused quota.set: shown beside the set it answers, never in force
            out["quota_events"] = [[*at, env.event_time_ms, p.kind, p.tenant, p.project or "", "",
                                    p.gpu_milli, 0, 0, 0, 0, 0, 0, 0, actor, env.causation_id or ""]]
        case QuotaBorrowed() | QuotaReturned():
            out["quota_events"] = [[*at, env.event_time_ms, p.kind, p.tenant, "", p.job_id, 0, 0, 0,
                                    p.milli, 0, 0, 0, 0, actor, ""]]
    if p.kind in SCHEDULING_KINDS:
        reasons = orjson.dumps([r.model_dump(mode="json") for r in getattr(p, "reasons", ())]).decode()
        out["scheduling"] = [[*at, env.event_time_ms, p.kind, command_id, job_id, env.tenant or "", node,
                              reasons]]
    return out
