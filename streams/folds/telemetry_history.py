"""Telemetry history: GPU samples folded into per-minute buckets per card and MIG instance. Pure.

Fed with each telemetry batch and the log's time of its record (the broker's append time: `gpupool.telemetry` is
stamped by the broker), it keeps one open bucket per (node, uuid) and minute and hands back the minutes that the
log's time has passed, as `TelemetryMinute` facts (one per node and minute). Nothing here knows Faust, Kafka or a
clock: the worker's node fold calls it today, and a batched telemetry consumer can call it unchanged.

Attribution: a sample names the jobs on its card (`job_ids`); each named job gets an equal part of that sample's
utilization and memory, so a minute's per-job parts add up to the card's own mean. Who a job is (tenant, tier)
comes from `job_info`, a function the caller supplies (the worker reads its job-view table); without it the tenant
is the job id's prefix ("acme/train-1" is acme's) and the tier is unknown ("").
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping

from schemas.events import CardMinute, GpuSample, JobMinute, TelemetryMinute

MINUTE_MS = 60_000
JobInfo = Callable[[str], tuple[str, str]]  # job id -> (tenant, tier)


def tenant_of(job_id: str) -> str:
    return job_id.split("/", 1)[0] if "/" in job_id else ""


def default_job_info(job_id: str) -> tuple[str, str]:
    return tenant_of(job_id), ""


@dataclass(slots=True)  # slots: the per-sample update below reads and writes a dozen of these for every sample
class _Bucket:
    gpu_uuid: str
    mig_uuid: str
    gpu_model: str = ""
    n: int = 0
    util_sum: int = 0  # percent
    util_max: int = 0
    mem_sum: int = 0
    mem_max: int = 0
    mem_total: int = 0
    temp_sum: int = 0
    temp_max: int = -1_000
    power_sum: int = 0
    power_max: int = 0
    ecc_corrected: int = 0
    ecc_uncorrected: int = 0
    xids: set[int] = field(default_factory=set)
    jobs: dict[str, list[int]] = field(default_factory=dict)  # job -> [samples, util permille sum, mem MiB sum]

    def add(self, s: GpuSample) -> None:
        _add_samples({s.mig_uuid or s.gpu_uuid: self}, (s,), None)

    def close(self, job_info: JobInfo) -> CardMinute:
        return CardMinute.model_validate(self.doc(job_info))

    def doc(self, job_info: JobInfo) -> dict:
        """The card's minute as the fields of a `CardMinute` (its jobs as those of `JobMinute`s): validated by the
        caller in one call for the whole node-minute (`TelemetryMinutes._close`), not one model at a time."""
        n = self.n
        jobs = []
        for job, (count, util, mem) in sorted(self.jobs.items()):
            tenant, tier = job_info(job)
            # the mean over the card's samples in the minute (a job there for half of it gets half its share)
            jobs.append({"job_id": job, "tenant": tenant, "tier": tier, "samples": count, "util_permille": util // n,
                         "mem_used_mib": mem // n})
        return {
            "gpu_uuid": self.gpu_uuid, "mig_uuid": self.mig_uuid, "gpu_model": self.gpu_model, "samples": n,
            "util_mean_permille": self.util_sum * 10 // n, "util_max_pct": self.util_max,
            "mem_used_mean_mib": self.mem_sum // n, "mem_used_max_mib": self.mem_max, "mem_total_mib": self.mem_total,
            "temperature_mean_c": round(self.temp_sum / n), "temperature_max_c": self.temp_max,
            "power_mean_mw": self.power_sum // n, "power_max_mw": self.power_max, "ecc_corrected": self.ecc_corrected,
            "ecc_uncorrected": self.ecc_uncorrected, "xid_errors": tuple(sorted(self.xids)), "jobs": jobs}


def _add_samples(buckets: dict[str, _Bucket], samples: Iterable[GpuSample], models: Mapping[str, str] | None) -> None:
    """Each sample into its card's (or MIG instance's) bucket, opened on first sight. The telemetry task's hot loop
    (every sample of every card): comparisons inline, not max(), no call per sample, slotted buckets."""
    for s in samples:
        key = s.mig_uuid or s.gpu_uuid
        b = buckets.get(key)
        if b is None:
            b = buckets[key] = _Bucket(s.gpu_uuid, s.mig_uuid or "", (models or {}).get(s.gpu_uuid, ""))
        u, m, t, w = s.util_pct, s.mem_used_mib, s.temperature_c, s.power_mw
        b.n += 1
        b.util_sum += u
        if u > b.util_max:
            b.util_max = u
        b.mem_sum += m
        if m > b.mem_max:
            b.mem_max = m
        if s.mem_total_mib > b.mem_total:
            b.mem_total = s.mem_total_mib
        b.temp_sum += t
        if t > b.temp_max:
            b.temp_max = t
        b.power_sum += w
        if w > b.power_max:
            b.power_max = w
        if s.ecc_corrected > b.ecc_corrected:
            b.ecc_corrected = s.ecc_corrected
        if s.ecc_uncorrected > b.ecc_uncorrected:
            b.ecc_uncorrected = s.ecc_uncorrected
        if s.xid_errors:
            b.xids.update(s.xid_errors)
        jobs = s.job_ids
        if jobs:
            k = len(jobs)
            for job in jobs:
                acc = b.jobs.get(job)
                if acc is None:
                    acc = b.jobs[job] = [0, 0, 0]
                acc[0] += 1
                acc[1] += u * 10 // k
                acc[2] += m // k


class TelemetryMinutes:
    """Open minutes per node; `add` a batch, get back the minutes it closed.

    A node's minute closes when a later batch of the same node falls in a later minute, or when `close_before(t)`
    is told the log's time has passed the minute's end by `grace_ms` (a node gone silent). A batch for a minute
    already closed (a record re-read after a restart) opens it again: the caller's store keeps, per card and
    minute, the row with the most samples (ClickHouse's ReplacingMergeTree on `samples` does)."""

    def __init__(self, job_info: JobInfo = default_job_info, minute_ms: int = MINUTE_MS, grace_ms: int = 5_000):
        self.job_info = job_info
        self.minute_ms = minute_ms
        self.grace_ms = grace_ms
        # node -> (minute, datacenter, {uuid: bucket})
        self._open: dict[str, tuple[int, str, dict[str, _Bucket]]] = {}

    def minute_of(self, t_ms: int) -> int:
        return t_ms - t_ms % self.minute_ms

    def open_nodes(self) -> int:
        return len(self._open)

    def add(self, node: str, log_ms: int, samples: Iterable[GpuSample], *, models: Mapping[str, str] | None = None,
            datacenter: str = "") -> list[TelemetryMinute]:
        """Fold one telemetry batch of `node` read at log time `log_ms`; `models`: card uuid -> model."""
        minute = self.minute_of(log_ms)
        closed = []
        current = self._open.get(node)
        if current is not None and current[0] != minute:
            closed.append(self._close(node))
            current = None
        if current is None:
            current = (minute, datacenter, {})
            self._open[node] = current
        _add_samples(current[2], samples, models)
        return closed

    def close_before(self, log_ms: int, clock_of: Callable[[str], int | None] | None = None) -> list[TelemetryMinute]:
        """Close every node's minute that ended at least `grace_ms` before `log_ms`, or, with `clock_of`, before
        the log time the node's own records are read to (`clock_of(node)`, at most `log_ms`; None: not known, not
        closed): a worker catching up a backlog closes a minute once it has read past it, not while that minute's
        later records are still unread (it would close it again with only those, and the store keeps one row)."""
        end = self.minute_ms + self.grace_ms
        due = sorted(n for n, (m, _, _) in self._open.items() if m + end <= log_ms)
        if clock_of is not None:
            due = [n for n in due if (c := clock_of(n)) is not None and self._open[n][0] + end <= c]
        return [self._close(n) for n in due]

    def flush(self) -> list[TelemetryMinute]:
        """Close everything (a clean shutdown; a partial minute)."""
        return [self._close(n) for n in sorted(self._open)]

    def _close(self, node: str) -> TelemetryMinute:
        minute, dc, buckets = self._open.pop(node)
        known: dict[str, tuple[str, str]] = {}  # a job on several cards (a gang) is looked up once a minute

        def job_info(job: str) -> tuple[str, str]:
            info = known.get(job)
            if info is None:
                info = known[job] = self.job_info(job)
            return info

        # One validation for the node's minute, cards and jobs nested (the same models and checks as building each
        # CardMinute and JobMinute on its own, at about half the cost: a minute can hold hundreds of JobMinutes)
        cards = [b.doc(job_info) for _, b in sorted(buckets.items()) if b.n]
        return TelemetryMinute.model_validate({"node": node, "datacenter": dc, "minute_ms": minute, "cards": cards})
