"""How an envelope becomes ClickHouse rows. Pure, so the sink and the audit replayer agree by construction."""
from __future__ import annotations

import orjson

from schemas.envelope import Envelope
from streams.folds import job_view
from schemas.events import (
    JobLog, PoolMinute, PriceSet, QuotaBorrowed, QuotaChanged, QuotaRejected, QuotaReturned, QuotaSet, TelemetryMinute,
    UsageAccrued,
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
                   "event_id", "actor", "currency"),
    "telemetry_minutes": ("minute_ms", "node", "datacenter", "gpu_uuid", "mig_uuid", "gpu_model", "samples",
                          "util_mean_permille", "util_max_pct", "mem_used_mean_mib", "mem_used_max_mib",
                          "mem_total_mib", "temperature_mean_c", "temperature_max_c", "power_mean_mw",
                          "power_max_mw", "ecc_corrected", "ecc_uncorrected", "xid_errors", "job_ids", "job_tenants",
                          "job_tiers", "job_samples", "job_util_permille", "job_mem_mib", "event_id"),
    "pool_minutes": ("minute_ms", "worker", "capacity_milli", "allocated_milli", "free_milli", "fragmentation_milli",
                     "allocated_milli_by_model", "capacity_milli_by_model", "queue_by_tier", "oldest_wait_ms_by_tier",
                     "event_id"),
    "job_logs": ("topic", "partition", "offset", "event_id", "event_time_ms", "tenant", "job_id", "node", "attempt",
                 "part", "stream", "seq", "text", "dropped_bytes", "final"),
    "scheduling": ("topic", "partition", "offset", "event_id", "event_time_ms", "kind", "command_id", "job_id", "tenant",
                   "node", "reasons"),
    # a job as its view (streams/folds/job_view.py) says it, one row per change the fold made; `version` is the change's
    # offset on the job view's changelog, so the latest change wins (ReplacingMergeTree(version), FINAL)
    "jobs": ("job_id", "tenant", "project", "tier", "compute_milli", "gpu_memory_mib", "retries", "state", "node",
             "command_id", "started_ms", "ended_ms", "progress_ms", "checkpoint", "preemptions", "migrations",
             "interruptions", "failures", "last_exit", "retry_at_ms", "reasons", "version"),
}
# Where each table lives: the pool's record in `gpupool`, programs' output in a database of its own (infra/ddl.sql)
TABLES: dict[str, str] = {t: f"gpupool_logs.{t}" if t == "job_logs" else f"gpupool.{t}" for t in COLUMNS}
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
    if isinstance(p, TelemetryMinute):  # a table of its own, and too many records to mirror in `events` too
        return {"telemetry_minutes": [
            [p.minute_ms, p.node, p.datacenter, c.gpu_uuid, c.mig_uuid, c.gpu_model, c.samples, c.util_mean_permille,
             c.util_max_pct, c.mem_used_mean_mib, c.mem_used_max_mib, c.mem_total_mib, c.temperature_mean_c,
             c.temperature_max_c, c.power_mean_mw, c.power_max_mw, c.ecc_corrected, c.ecc_uncorrected,
             list(c.xid_errors), [j.job_id for j in c.jobs], [j.tenant for j in c.jobs], [j.tier for j in c.jobs],
             [j.samples for j in c.jobs], [j.util_permille for j in c.jobs], [j.mem_used_mib for j in c.jobs],
             env.event_id] for c in p.cards]}
    if isinstance(p, JobLog):  # a program's output: its own table (docs/jobs.md, "Logs"), never the `events` mirror
        return {"job_logs": [[*at, env.event_time_ms, p.job_id.split("/", 1)[0] if "/" in p.job_id else "",
                              p.job_id, p.node, p.attempt, p.part, p.stream, p.seq, p.text, p.dropped_bytes,
                              p.final]]}
    if isinstance(p, PoolMinute):
        return {"pool_minutes": [[p.minute_ms, p.worker, p.capacity_milli, p.allocated_milli, p.free_milli,
                                  p.fragmentation_milli, p.allocated_milli_by_model, p.capacity_milli_by_model,
                                  p.queue_by_tier, p.oldest_wait_ms_by_tier, env.event_id]]}
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
                                  p.valid_from_ms, env.event_id, actor, p.currency]]  # DateTime64(3) takes epoch ms
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


def job_rows(view: job_view.JobView, version: int) -> dict[str, list]:
    """The row of `jobs` for one change of a job's view (the job view's changelog record at offset `version`): the
    state, node, run and reasons the fold decided, never decided again here. A view of no request and no
    rejection -- a job no one submitted, e.g. only a node's report read so far -- is still a row (the API lists
    what was submitted)."""
    r = view.request
    tenant = view.job_id.split("/", 1)[0] if "/" in view.job_id else r.tenant if r is not None else ""
    reasons = orjson.dumps([x.model_dump(mode="json") for x in view.reasons]).decode()
    return {"jobs": [[view.job_id, tenant, r.project if r is not None else "", r.tier.value if r is not None else "",
                      r.compute_milli if r is not None else 0, r.gpu_memory_mib if r is not None else 0,
                      r.retries if r is not None else 0, view.state, view.node, view.command_id, view.started_ms,
                      view.ended_ms, view.progress_ms, view.checkpoint, view.preemptions, view.migrations,
                      view.interruptions, view.failures, job_view.last_exit(view), job_view.retry_at_ms(view),
                      reasons, version]]}
