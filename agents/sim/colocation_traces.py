"""Inputs of the colocation protocol: the GenAI serving curve, the Philly training backlog, and their scaling.

Both loaders read the public files as published (the shared copies under /work/shared/traces) and the small samples
vendored in agents/sim/data (same columns; see data/PROVENANCE-colocation.md), so one code path serves the full run,
the demo and the tests.

GenAI serving trace (Alibaba cluster-trace-v2026-GenAI, qps.csv): one row per (container, sample) with the
container's request rate; every timestamp lies on a 57 s grid and a container that served nothing in a step has no
row. The service's load at a step is the sum over its containers. Services are the request types.

Philly (Microsoft, CC BY 4.0, via the Pollux artifact): one row per job with submit time, run time, GPUs and virtual
cluster (the tenant).
"""
from __future__ import annotations

import csv
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import numpy as np

DATA = Path(__file__).parent / "data"
QPS_SAMPLE = DATA / "genai_qps_sample.csv"
PHILLY_SAMPLE = DATA / "philly_sample.csv"
QPS_STEP_S = 57  # the GenAI trace's sampling grid: every timestamp is t0 + k * 57 s
SERVICE_OF_TYPE = {"Generative Requests": "genai-generative", "API Requests": "genai-api"}


# ---------------------------------------------------------------- GenAI serving curve

@dataclass(frozen=True)
class QpsTrace:
    """Requests/s per service on the trace's 57 s grid (index k = t0 + 57 k s), summed over containers."""
    t0: float
    step_s: int
    series: dict[str, np.ndarray]  # service id -> qps per step

    @property
    def span_s(self) -> int:
        return self.step_s * max(len(s) for s in self.series.values())


def service_id(request_type: str) -> str:
    return SERVICE_OF_TYPE.get(request_type) or "genai-" + "".join(
        c if c.isalnum() else "-" for c in request_type.lower()).strip("-")


def load_qps(path: str | Path) -> QpsTrace:
    rows: list[tuple[float, str, float]] = []
    with open(path, newline="") as fh:
        for r in csv.DictReader(fh):
            rows.append((float(r["timestamp_anon"]), service_id(r["request_type"] or "unknown"), float(r["value"])))
    if not rows:
        raise ValueError(f"{path}: no rows")
    t0 = min(t for t, _, _ in rows)
    n = int(round((max(t for t, _, _ in rows) - t0) / QPS_STEP_S)) + 1
    series: dict[str, np.ndarray] = {}
    for t, svc, v in rows:
        k = (t - t0) / QPS_STEP_S
        if abs(k - round(k)) > 1e-6:
            raise ValueError(f"{path}: timestamp {t} is off the {QPS_STEP_S} s grid")
        series.setdefault(svc, np.zeros(n))[int(round(k))] += v
    return QpsTrace(t0, QPS_STEP_S, dict(sorted(series.items())))


def bucket_means(qps: np.ndarray, bucket_steps: int) -> np.ndarray:
    """Mean request rate per bucket of `bucket_steps` grid steps (a short last bucket is averaged over what it has)."""
    n = len(qps)
    k = -(-n // bucket_steps)
    padded = np.zeros(k * bucket_steps)
    padded[:n] = qps
    sums = padded.reshape(k, bucket_steps).sum(axis=1)
    counts = np.full(k, bucket_steps, dtype=float)
    counts[-1] = n - (k - 1) * bucket_steps
    return sums / counts


DAY_S = 86_400


def curve(qps: np.ndarray, step_s: int, bucket_steps: int, times_s: np.ndarray) -> np.ndarray:
    """The demand at `times_s` (seconds from the trace start): bucket means, linearly interpolated between bucket
    centres. The curve is one day: a trace shorter than 24 h is completed by interpolating from its last bucket to
    its first (both in the night trough for the GenAI trace), and past 24 h the day starts over, so any span can be
    simulated and a clock-aware autoscaler sees the same time of day every 24 h."""
    means = bucket_means(qps, bucket_steps)
    width = step_s * bucket_steps
    span = step_s * len(qps)
    period = max(span, DAY_S)
    centres = (np.arange(len(means)) + 0.5) * width
    centres[-1] = (len(means) - 1) * width + 0.5 * (span - (len(means) - 1) * width)  # a short last bucket
    # periodic extension: one bucket before and after
    xs = np.concatenate(([centres[-1] - period], centres, [centres[0] + period]))
    ys = np.concatenate(([means[-1]], means, [means[0]]))
    return np.interp(np.mod(times_s, period), xs, ys)


# ---------------------------------------------------------------- Philly training backlog

@dataclass(frozen=True)
class PhillyJob:
    submitted: datetime
    duration_s: int
    num_gpus: int
    tenant: str


def load_philly(path: str | Path) -> list[PhillyJob]:
    out = []
    with open(path, newline="") as fh:
        for r in csv.DictReader(fh):
            out.append(PhillyJob(datetime.fromisoformat(r["timestamp"]), max(1, int(float(r["duration"]))),
                                 int(r["num_gpus"]), r["cluster"]))
    if not out:
        raise ValueError(f"{path}: no rows")
    out.sort(key=lambda j: j.submitted)  # stable: file order breaks ties
    return out


@dataclass(frozen=True)
class TrainingJob:
    job_id: str
    tenant: str
    submit_s: float  # seconds from the simulation start
    gpus: int
    duration_s: int  # run time without interruption
    trace_gpus: int  # as in the trace (before the one-node cap)
    trace_duration_s: int

    @property
    def work_gpu_s(self) -> int:
        return self.gpus * self.duration_s


@dataclass(frozen=True)
class Backlog:
    jobs: tuple[TrainingJob, ...]
    compression: float  # trace seconds per simulated second of arrivals
    window_start: datetime
    window_end: datetime  # the submit time of the last job taken (of its pass through the file)
    passes: int  # >1 when the file ran out and was replayed after itself
    offered_gpu_s: int


def training_backlog(rows: list[PhillyJob], start: datetime, span_s: float, target_gpu_s: float, *,
                     max_duration_s: int, max_gpus: int) -> Backlog:
    """Philly jobs from `start` on, in submit order, until their work (GPUs x run time, each run time capped at
    `max_duration_s`, GPUs capped at one node's `max_gpus`) reaches `target_gpu_s`. Their submit times are then
    compressed by one factor so that the window's arrivals fill `span_s`: the backlog keeps the trace's job mix,
    tenants and arrival pattern, only faster. If the file ends first it is replayed after itself (counted in
    `passes`)."""
    window = [r for r in rows if r.submitted >= start]
    if not window:
        raise ValueError(f"no Philly job submitted at or after {start}")
    period = (window[-1].submitted - start).total_seconds() + 1.0  # a replay starts one second after the last job
    taken: list[tuple[float, PhillyJob, int]] = []  # (trace offset s, job, pass)
    work = 0
    passes = 0
    while work < target_gpu_s:
        passes += 1
        for r in window:
            if work >= target_gpu_s:
                break
            offset = (r.submitted - start).total_seconds() + (passes - 1) * period
            taken.append((offset, r, passes))
            work += min(r.num_gpus, max_gpus) * min(r.duration_s, max_duration_s)
        if passes > 1000:
            raise ValueError("target too large for the Philly file")
    span_trace = max(taken[-1][0], 1.0)
    compression = span_trace / max(1.0, span_s - 1)  # the last job arrives one second before the end
    jobs = []
    for i, (offset, r, p) in enumerate(taken):
        jobs.append(TrainingJob(
            job_id=f"philly-{i:05d}", tenant=f"vc-{r.tenant}", submit_s=offset / compression,
            gpus=min(r.num_gpus, max_gpus), duration_s=min(r.duration_s, max_duration_s),
            trace_gpus=r.num_gpus, trace_duration_s=r.duration_s))
    return Backlog(tuple(jobs), compression, start, taken[-1][1].submitted, passes, work)


# ---------------------------------------------------------------- vendoring the samples

def write_samples(qps_src: str | Path, philly_src: str | Path, out: str | Path = DATA, *,
                  philly_from: str = "2017-10-10 00:00:00", philly_to: str = "2017-10-14 00:00:00",
                  philly_every: int = 4) -> None:
    """Write the vendored samples: the GenAI curve summed over containers per 57 s step and request type (every step
    of the trace; same columns, container_ip empty), and every `philly_every`-th Philly job submitted in
    [philly_from, philly_to) (rows unchanged)."""
    out = Path(out)
    sums: dict[tuple[float, str], float] = {}
    with open(qps_src, newline="") as fh:
        for r in csv.DictReader(fh):
            key = (float(r["timestamp_anon"]), r["request_type"])
            sums[key] = sums.get(key, 0.0) + float(r["value"])
    with open(out / QPS_SAMPLE.name, "w", newline="") as fh:
        w = csv.writer(fh, lineterminator="\n")
        w.writerow(["timestamp_anon", "value", "container_ip", "request_type"])
        for (t, kind), v in sorted(sums.items()):
            w.writerow([f"{t:.1f}", f"{v:.4f}".rstrip("0").rstrip("."), "", kind])
    with open(philly_src, newline="") as fh:
        reader = csv.reader(fh)
        header = next(reader)
        rows = [r for r in reader if philly_from <= r[0] < philly_to]
    with open(out / PHILLY_SAMPLE.name, "w", newline="") as fh:
        w = csv.writer(fh, lineterminator="\n")
        w.writerow(header)
        w.writerows(rows[::philly_every])


if __name__ == "__main__":
    import sys

    if len(sys.argv) != 3:
        raise SystemExit("usage: python -m agents.sim.colocation_traces QPS_CSV PHILLY_CSV  (rewrites the samples)")
    write_samples(sys.argv[1], sys.argv[2])
