"""The colocation protocol: one GPU fleet, one trace-driven input, run split (a training pool and an inference pool)
and unified (the elastic scheduler over the whole fleet); docs/colocation.md describes it and the measured figures.

    python -m agents.sim.colocation --gpus 512 --hours 22 --seed 0 --json          # the vendored samples
    gpupool simulate --protocol colocation --qps Q.csv --philly P.csv --plots docs --json

The simulator plays every node agent and the ticker: it answers `cmd.place` with `job.started` after a start latency
(cold or warm replica, training start), reports `job.checkpointed` every checkpoint interval, answers `cmd.preempt`
with a checkpoint and `job.stopped` after the grace period, applies `cmd.resize`, stops work on `cmd.release`, and
reports `job.completed` when a job's work (less the progress it resumed from) is done. Every tick it sends one
`inference.load` per service (demand and a queueing model of the ready replicas) and a `scheduler.tick`. Time is
simulated event time only; the same --seed gives the same figures.
"""
from __future__ import annotations

import argparse
import heapq
import json
import math
import sys
import time
import zlib
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Callable, NamedTuple

import numpy as np

from agents.node.fleet import make_node
from agents.scheduler.core import Scheduler
from agents.scheduler.quota import open_ledger
from agents.sim import colocation_traces as traces
from schemas.envelope import Envelope, envelope
from schemas.events import (
    InferenceLoad, JobCheckpointed, JobCompleted, JobRequested, JobStarted, JobStopped, SchedulerTick,
    ServiceDeclared, Tier,
)
from schemas.gpu_models import model as gpu_model


class _Stop(NamedTuple):
    """What `preempt` reads of a command: a move (cmd.migrate) is a stop on the node it leaves."""
    job_id: str
    node: str
    grace_s: int
    command_id: str

T0_MS = 1_700_000_000_000  # the simulation's epoch (event times are milliseconds; nothing reads a clock)
LN100 = math.log(100.0)
LN2 = math.log(2.0)
P99_CAP_MS = 600_000  # the queueing model's ceiling for a service with no ready replica or an exploding queue
REQUIRED_KEYS = ("allocated_gpu_hours_pct", "inference_served_within_30s_pct", "unmet_inference_pct",
                 "training_mean_queueing_s", "training_p99_queueing_s", "training_mean_jct_s", "preemptions",
                 "migrations")


# ---------------------------------------------------------------- parameters

@dataclass(frozen=True)
class ServiceShape:
    """One replica of a service: its size, what it serves within the SLO, and the SLO."""
    replica_compute_milli: int
    replica_memory_mib: int
    replica_qps: int  # requests/s one base-size replica serves within the latency target
    latency_target_ms: int
    boost_compute_milli: int = 0
    min_replicas: int = 1
    max_queue: int = 200  # requests queued per replica before the service sheds load
    cpu_milli: int = 4000
    memory_mib: int = 16 * 1024

    @property
    def gpus(self) -> float:
        return self.replica_compute_milli / 1000


SHAPES = {
    # A generative LLM replica: one whole A100-80GB, 8 req/s within a 2 s p99.
    "genai-generative": ServiceShape(1000, 60 * 1024, 8, 2000, min_replicas=2),
    # The API front: half a card per replica (a vertical boost to the whole card), 20 req/s within 500 ms.
    "genai-api": ServiceShape(500, 20 * 1024, 20, 500, boost_compute_milli=500, min_replicas=1, cpu_milli=2000),
}


@dataclass(frozen=True)
class Params:
    gpus: int = 512
    gpus_per_node: int = 8
    gpu_model: str = "A100-80GB"
    hours: float = 22.0
    seed: int = 0
    mode: str = "load"  # the elastic scheduler's mode in the unified run: load | clock
    tick_s: int = 10  # scheduler.tick and inference.load period
    bucket_steps: int = 5  # the GenAI curve is averaged over 5 x 57 s = 285 s buckets, interpolated between them
    peak_share: float = 0.6  # the curve's peak needs this share of the fleet (in replicas at SLO capacity)
    training_load: float = 1.2  # training offers this multiple of the GPU-time inference demand leaves free
    philly_start: str = "2017-10-10 01:00:00"
    max_job_hours: float = 6.0  # Philly run times are capped at this (the trace's tail runs for weeks)
    checkpoint_s: int = 600
    train_start_s: float = 60.0  # container start and data loading, fresh or resumed
    cold_start_s: float = 120.0  # a replica on a node that has not served the service: image pull, remote weights
    warm_start_s: float = 30.0  # on a node that served it before: image and weights cached on local disk
    start_jitter: float = 0.2  # each start latency is drawn uniformly within +-20 % (seeded per job and start)
    served_grace_s: int = 30
    training_share_pct: int = 30  # passed to ElasticConfig
    warm_pool: int = 2  # passed to ElasticConfig

    @property
    def nodes(self) -> int:
        return -(-self.gpus // self.gpus_per_node)

    @property
    def span_s(self) -> int:
        return int(round(self.hours * 3600))


# ---------------------------------------------------------------- the workload (identical for both runs)

@dataclass(frozen=True)
class Workload:
    services: tuple[ServiceDeclared, ...]
    shapes: dict[str, ServiceShape]
    demand_qps: np.ndarray  # (ticks, services): requests/s offered during tick i, i.e. [i * tick, (i + 1) * tick)
    jobs: tuple[traces.TrainingJob, ...]
    scale: float  # simulated requests/s per trace request/s
    peak_gpus: float  # the curve's peak need (GPUs at SLO capacity), before request noise
    inference_gpu_s: float  # demand over the span, GPU-seconds
    backlog: traces.Backlog | None

    def demand_gpus(self) -> np.ndarray:
        per = np.array([self.shapes[s.service_id].gpus / self.shapes[s.service_id].replica_qps for s in self.services])
        return self.demand_qps * per


def build_workload(p: Params, qps: traces.QpsTrace, philly: list[traces.PhillyJob] | None) -> Workload:
    services, shapes = [], {}
    max_replicas = p.gpus  # nothing stops a service from growing to the whole fleet but the fleet
    for sid in qps.series:
        shape = SHAPES.get(sid, SHAPES["genai-generative"])
        shapes[sid] = shape
        services.append(ServiceDeclared(
            service_id=sid, tenant="genai", project=sid, replica_compute_milli=shape.replica_compute_milli,
            replica_memory_mib=shape.replica_memory_mib, boost_compute_milli=shape.boost_compute_milli,
            replica_qps=shape.replica_qps, min_replicas=shape.min_replicas,
            max_replicas=max(shape.min_replicas, int(max_replicas / shape.gpus)),
            latency_target_ms=shape.latency_target_ms, max_queue=shape.max_queue))
    ids = list(qps.series)
    per_gpu = np.array([shapes[s].gpus / shapes[s].replica_qps for s in ids])
    # The peak is taken over the whole trace period at tick resolution, so it does not depend on --hours.
    period_ticks = np.arange(0, qps.span_s, p.tick_s) + p.tick_s / 2
    raw_period = np.stack([traces.curve(qps.series[s], qps.step_s, p.bucket_steps, period_ticks) for s in ids], axis=1)
    peak_raw = float((raw_period * per_gpu).sum(axis=1).max())
    scale = p.peak_share * p.gpus / peak_raw
    n_ticks = -(-p.span_s // p.tick_s)
    mid = np.arange(n_ticks) * p.tick_s + p.tick_s / 2
    lam = np.stack([traces.curve(qps.series[s], qps.step_s, p.bucket_steps, mid) for s in ids], axis=1) * scale
    # Requests arrive as a Poisson process around the curve: the count in each tick is drawn, seeded.
    rng = np.random.default_rng([p.seed, 1])
    demand = rng.poisson(lam * p.tick_s) / p.tick_s
    inference_gpu_s = float((demand * per_gpu).sum() * p.tick_s)
    backlog = None
    jobs: tuple[traces.TrainingJob, ...] = ()
    if philly is not None and p.training_load > 0:
        free = max(0.0, p.gpus * p.span_s - inference_gpu_s)
        backlog = traces.training_backlog(
            philly, datetime.fromisoformat(p.philly_start), p.span_s, p.training_load * free,
            max_duration_s=int(p.max_job_hours * 3600), max_gpus=p.gpus_per_node)
        jobs = backlog.jobs
    return Workload(tuple(services), shapes, demand, jobs, scale, p.peak_share * p.gpus, inference_gpu_s, backlog)


# ---------------------------------------------------------------- the pools and the schedulers

@dataclass
class Pool:
    name: str
    scheduler: object  # anything with step(envelope) -> [envelope]
    nodes: list[str]
    services: list[str]
    training: bool


def default_elastic(p: Params, mode: str):
    from agents.scheduler.core import ElasticScheduler
    from agents.scheduler.elastic import ElasticConfig

    return ElasticScheduler(elastic=ElasticConfig(mode=mode, training_share_pct=p.training_share_pct,
                                                  warm_pool=p.warm_pool), ledger=open_ledger())


def split_sizes(p: Params, w: Workload) -> tuple[int, int]:
    """(inference nodes, training nodes): the inference pool is the curve's peak need rounded up to whole nodes,
    the training pool the rest of the fleet."""
    inf = min(p.nodes - 1, -(-math.ceil(w.peak_gpus - 1e-9) // p.gpus_per_node))
    return inf, p.nodes - inf


def make_pools(label: str, p: Params, w: Workload, elastic: Callable | None = None) -> list[Pool]:
    elastic = elastic or default_elastic
    sids = [s.service_id for s in w.services]
    if label == "unified":
        names = [f"node-{i:03d}" for i in range(p.nodes)]
        return [Pool("fleet", elastic(p, p.mode), names, sids, True)]
    if label == "split":
        n_inf, n_train = split_sizes(p, w)
        return [Pool("inference", elastic(p, "load"), [f"inf-{i:03d}" for i in range(n_inf)], sids, False),
                Pool("training", Scheduler(ledger=open_ledger()), [f"trn-{i:03d}" for i in range(n_train)], [], True)]
    raise ValueError(label)


# ---------------------------------------------------------------- the node agents, the ticker and the clock

E_TICK, E_SUBMIT, E_START, E_CKPT, E_DONE, E_STOP = range(6)


@dataclass
class Run:
    """One placement of a job on a node, from cmd.place to its end."""
    job_id: str
    node: str
    command_id: str
    pool: Pool
    service: str | None
    token: int
    milli: int
    asked_milli: int
    duration_ms: int | None
    base_progress_ms: int
    started_ms: int = -1
    progress_ms: int = 0  # progress at `since_ms`
    since_ms: int = 0
    rate: float = 1.0  # work per unit of time: held milli / asked milli (a resize changes it)
    version: int = 0  # bumped when the completion time moves
    stopping: bool = False
    serving: bool = False  # a replica takes traffic once a traffic_shift names it, until a scale_in does

    def progress(self, now: int) -> int:
        if self.started_ms < 0:
            return self.base_progress_ms
        p = self.progress_ms + int((now - self.since_ms) * self.rate)
        return min(p, self.duration_ms) if self.duration_ms is not None else p


@dataclass
class TrainState:
    job: traces.TrainingJob
    submit_ms: int
    first_start_ms: int = -1
    done_ms: int = -1
    last_node: str = ""
    running: bool = False
    starts: int = 0
    preempted: int = 0


def parse_checkpoint(ckpt: str) -> int:
    try:
        return int(ckpt.rsplit(":", 1)[1]) if ckpt.startswith("ckpt:") else 0
    except (IndexError, ValueError):
        return 0


def _unit(*key) -> float:
    return zlib.crc32("/".join(map(str, key)).encode()) / 2 ** 32


class FleetSim:
    def __init__(self, p: Params, w: Workload, pools: list[Pool], label: str):
        self.p, self.w, self.pools, self.label = p, w, pools, label
        self.now = T0_MS
        self.end = T0_MS + p.span_s * 1000
        self.heap: list = []
        self._n = 0
        self.src_seq: dict[str, int] = {}
        self.service_pool = {s: pool for pool in pools for s in pool.services}
        self.training_pool = next(pool for pool in pools if pool.training)
        self.shapes = w.shapes
        self.sids = [s.service_id for s in w.services]
        self.runs: dict[str, Run] = {}
        self.alloc: dict[tuple[str, str], tuple[int, str]] = {}
        self.alloc_total = {"inference": 0, "training": 0}
        self.alloc_steps: list[tuple[int, int, int]] = [(T0_MS, 0, 0)]
        self.capacity = {s: 0.0 for s in self.sids}  # ready SLO capacity, requests/s
        self.cap_steps: dict[str, list[tuple[int, float]]] = {s: [(T0_MS, 0.0)] for s in self.sids}
        self.ready = {s: 0 for s in self.sids}
        self.backlog_req = {s: 0.0 for s in self.sids}
        self.dropped = {s: 0.0 for s in self.sids}
        self.node_cache: dict[str, set[str]] = {}
        self.train: dict[str, TrainState] = {}
        self.preemptions = {"inference": 0, "training": 0}
        self.migrations = 0
        self.commands: dict[str, int] = {}
        self.scaled: list[tuple[int, str, str, int, int]] = []  # (time, service, action, replicas, took_ms)
        self.usage_milli_ms = {"inference": 0, "training": 0}
        self.replica_starts = {"cold": 0, "warm": 0}
        self.inputs = 0
        self.replica_life: dict[str, list[int]] = {}  # replica -> [placed, ready, ended] (ms; -1: not yet)
        self.waiting_jobs = self.waiting_gpus = self.running_jobs = 0
        self.series: dict[str, list] = {k: [] for k in (
            "t", "alloc_inference", "alloc_training", "ready_gpus", "waiting_jobs", "waiting_gpus", "running_jobs")}
        for s in self.sids:
            self.series[f"p99:{s}"] = []
            self.series[f"queue:{s}"] = []
        self.sched_s = 0.0

    # ------------------------------------------------------------ plumbing

    def push(self, t: int, kind: int, *args) -> None:
        self._n += 1
        heapq.heappush(self.heap, (t, self._n, kind, args))

    def feed(self, pool: Pool, payload, source: str) -> None:
        seq = self.src_seq[source] = self.src_seq.get(source, 0) + 1
        env = envelope(payload, source=source, seq=seq, time_ms=self.now)
        self.inputs += 1
        t = time.process_time()
        outs = pool.scheduler.step(env)
        self.sched_s += time.process_time() - t  # CPU time: the share is right on a busy machine too
        for o in outs:
            self.on_output(pool, o)

    def cls_of(self, job_id: str) -> tuple[str, str | None]:
        if job_id in self.train:
            return "training", None
        svc = job_id.rsplit("/r", 1)[0]
        return ("inference", svc) if svc in self.capacity else ("training", None)

    def set_alloc(self, key: tuple[str, str], milli: int, cls: str) -> None:
        before = self.alloc.pop(key, None)
        if before:
            self.alloc_total[before[1]] -= before[0]
        if milli > 0:
            self.alloc[key] = (milli, cls)
            self.alloc_total[cls] += milli
        step = (self.now, self.alloc_total["inference"], self.alloc_total["training"])
        if self.alloc_steps[-1][0] == self.now:
            self.alloc_steps[-1] = step
        else:
            self.alloc_steps.append(step)

    def add_capacity(self, svc: str, qps: float, replicas: int) -> None:
        self.capacity[svc] = max(0.0, self.capacity[svc] + qps)
        self.ready[svc] += replicas
        steps = self.cap_steps[svc]
        if steps[-1][0] == self.now:
            steps[-1] = (self.now, self.capacity[svc])
        else:
            steps.append((self.now, self.capacity[svc]))

    def set_serving(self, job_id: str, on: bool) -> None:
        run = self.runs.get(job_id)
        if run is None or run.service is None or run.serving == on:
            return
        run.serving = on
        if run.started_ms >= 0:
            self.add_capacity(run.service, self.replica_qps(run) * (1 if on else -1), 1 if on else -1)

    def replica_qps(self, run: Run) -> float:
        shape = self.shapes[run.service]
        return shape.replica_qps * run.milli / shape.replica_compute_milli

    # ------------------------------------------------------------ scheduler outputs: the node agents' side

    def on_output(self, pool: Pool, env: Envelope) -> None:
        p = env.payload
        kind = p.kind
        self.commands[kind] = self.commands.get(kind, 0) + 1
        if kind == "cmd.place":
            self.place(pool, p)
        elif kind == "cmd.preempt":
            self.preempt(pool, p)
        elif kind == "cmd.release":
            self.release(p)
        elif kind == "cmd.resize":
            self.resize(p)
        elif kind == "cmd.migrate":
            # carried out as the node agents do: checkpoint and stop on the node it leaves (no preemption counted);
            # the scheduler then places it on the planned node, where its resume counts it among the migrations
            self.preempt(pool, _Stop(p.job_id, p.from_node, 30, p.command_id), count=False)
        elif kind == "service.scaled":
            self.scaled.append((self.now, p.service_id, p.action, p.replicas, p.took_ms))
            if p.action == "traffic_shift":
                for j in p.jobs:
                    self.set_serving(j, True)
            elif p.action == "scale_in":
                for j in p.jobs:
                    self.set_serving(j, False)
        elif kind == "usage.accrued":
            cls, _ = self.cls_of(p.job_id)
            self.usage_milli_ms[cls] += p.gpu_milli_ms

    def place(self, pool: Pool, p) -> None:
        cls, svc = self.cls_of(p.job_id)
        milli = sum(a.milli for a in p.assignments)
        self.set_alloc((p.job_id, p.node), milli, cls)
        old = self.runs.get(p.job_id)
        if old is not None and old.node != p.node and p.gang_size > 1:
            return  # another part of a gang: it holds its cards; the first part carries the job
        if old is not None:
            self._end_run(old)
        st = self.train.get(p.job_id)
        attempt = st.starts if st else self.commands["cmd.place"]
        if cls == "inference":
            self.replica_life.setdefault(p.job_id, [self.now, -1, -1])
            warm = svc in self.node_cache.get(p.node, ())
            base = self.p.warm_start_s if warm else self.p.cold_start_s
            self.replica_starts["warm" if warm else "cold"] += 1
            asked = self.shapes[svc].replica_compute_milli
        else:
            base = self.p.train_start_s
            asked = st.job.gpus * 1000 if st else milli
        jitter = 1 + self.p.start_jitter * (2 * _unit(self.p.seed, p.job_id, attempt) - 1)
        run = Run(p.job_id, p.node, p.command_id, pool, svc, self._n + 1, milli, asked,
                  p.duration_s * 1000 if p.duration_s is not None else None, parse_checkpoint(p.resume_from))
        self.runs[p.job_id] = run
        self.push(self.now + int(round(base * jitter * 1000)), E_START, p.job_id, run.token)

    def preempt(self, pool: Pool, p, count: bool = True) -> None:
        run = self.runs.get(p.job_id)
        if run is None or run.node != p.node or run.stopping:
            return  # nothing running here to stop (it finished at this very moment)
        cls, _ = self.cls_of(p.job_id)
        if count:
            self.preemptions[cls] += 1
            if p.job_id in self.train:
                self.train[p.job_id].preempted += 1
        run.stopping = True
        # A job still starting stops at once, where it resumed from; a running one checkpoints within the grace.
        delay = p.grace_s * 1000 if run.started_ms >= 0 else 0
        self.push(self.now + delay, E_STOP, p.job_id, run.token, p.command_id)

    def release(self, p) -> None:
        self.set_alloc((p.job_id, p.node), 0, "")
        run = self.runs.get(p.job_id)
        if run is not None and run.node == p.node:
            self._end_run(run)

    def resize(self, p) -> None:
        key = (p.job_id, p.node)
        if key not in self.alloc:
            return
        milli = sum(a.milli for a in p.assignments)
        self.set_alloc(key, milli, self.alloc[key][1])
        run = self.runs.get(p.job_id)
        if run is None or run.node != p.node:
            return
        if run.service and run.started_ms >= 0 and run.serving:
            before = self.replica_qps(run)
            run.milli = milli
            self.add_capacity(run.service, self.replica_qps(run) - before, 0)
        elif run.service is None:
            if run.started_ms >= 0:
                run.progress_ms, run.since_ms = run.progress(self.now), self.now
            run.milli = milli
            run.rate = milli / run.asked_milli
            if run.started_ms >= 0:
                self._schedule_done(run)
        else:
            run.milli = milli

    def _end_run(self, run: Run) -> None:
        """The run is gone from its node (released, stopped or completed): no further events from it."""
        if self.runs.get(run.job_id) is run:
            del self.runs[run.job_id]
        if run.service:
            self.replica_life[run.job_id][2] = self.now
        if run.service and run.started_ms >= 0 and run.serving:
            self.add_capacity(run.service, -self.replica_qps(run), -1)
        st = self.train.get(run.job_id)
        if st is not None and st.running:
            st.running = False
            self.running_jobs -= 1
            if st.done_ms < 0:
                self.waiting_jobs += 1
                self.waiting_gpus += st.job.gpus
        run.token = -1

    def _schedule_done(self, run: Run) -> None:
        if run.duration_ms is None or run.rate <= 0:
            return
        run.version += 1
        left = max(0, run.duration_ms - run.progress_ms)
        self.push(run.since_ms + int(math.ceil(left / run.rate)), E_DONE, run.job_id, run.token, run.version)

    # ------------------------------------------------------------ node-agent events

    def _valid(self, job_id: str, token: int) -> Run | None:
        run = self.runs.get(job_id)
        return run if run is not None and run.token == token else None

    def start(self, job_id: str, token: int) -> None:
        run = self._valid(job_id, token)
        if run is None:
            return
        run.started_ms = run.since_ms = self.now
        run.progress_ms = run.base_progress_ms
        run.rate = run.milli / run.asked_milli if run.service is None else 1.0
        src = f"{run.node}/job/{job_id}"
        if run.service:
            self.replica_life[job_id][1] = self.now
            self.node_cache.setdefault(run.node, set()).add(run.service)
            if run.serving:  # promoted while it was starting: it takes traffic as soon as it is up
                self.add_capacity(run.service, self.replica_qps(run), 1)
        st = self.train.get(job_id)
        if st is not None:
            if st.first_start_ms < 0:
                st.first_start_ms = self.now
            elif st.last_node and st.last_node != run.node:
                self.migrations += 1  # a preempted job resumed elsewhere: its checkpoint moved
            st.last_node, st.running = run.node, True
            st.starts += 1
            self.running_jobs += 1
            self.waiting_jobs -= 1
            self.waiting_gpus -= st.job.gpus
        self.feed(run.pool, JobStarted(job_id=job_id, node=run.node, command_id=run.command_id), src)
        if self._valid(job_id, token) is None:
            return
        if run.duration_ms is not None:
            self._schedule_done(run)
            if self.p.checkpoint_s > 0:
                self.push(self.now + self.p.checkpoint_s * 1000, E_CKPT, job_id, token)

    def checkpoint(self, job_id: str, token: int) -> None:
        run = self._valid(job_id, token)
        if run is None or run.stopping:
            return
        progress = run.progress(self.now)
        self.feed(run.pool, JobCheckpointed(job_id=job_id, node=run.node, progress_ms=progress,
                                            checkpoint=f"ckpt:{job_id}:{progress}", command_id=run.command_id),
                  f"{run.node}/job/{job_id}")
        if self._valid(job_id, token) is not None:
            self.push(self.now + self.p.checkpoint_s * 1000, E_CKPT, job_id, token)

    def done(self, job_id: str, token: int, version: int) -> None:
        run = self._valid(job_id, token)
        if run is None or run.version != version:
            return
        st = self.train.get(job_id)
        if st is not None:
            st.done_ms = self.now
        self._end_run(run)
        self.feed(run.pool, JobCompleted(job_id=job_id, node=run.node, command_id=run.command_id),
                  f"{run.node}/job/{job_id}")

    def stop(self, job_id: str, token: int, command_id: str) -> None:
        run = self._valid(job_id, token)
        if run is None:
            return
        progress = run.progress(self.now)
        ckpt = f"ckpt:{job_id}:{progress}"
        self._end_run(run)
        src = f"{run.node}/job/{job_id}"
        self.feed(run.pool, JobCheckpointed(job_id=job_id, node=run.node, progress_ms=progress, checkpoint=ckpt,
                                            command_id=command_id), src)
        self.feed(run.pool, JobStopped(job_id=job_id, node=run.node, command_id=command_id, progress_ms=progress,
                                       checkpoint=ckpt), src)

    # ------------------------------------------------------------ the ticker and the load reporter

    def tick(self, i: int) -> None:
        dt = self.p.tick_s
        for k, svc in enumerate(self.sids):
            lam = float(self.w.demand_qps[i, k])
            prev = float(self.w.demand_qps[i - 1, k]) if i > 0 else 0.0
            shape = self.shapes[svc]
            n, cap = self.ready[svc], self.capacity[svc]
            mu = cap + n * LN100 / (shape.latency_target_ms / 1000)  # the replicas' total service rate
            # the queue over the last tick: what arrived beyond the service rate waits, up to max_queue a replica
            b = max(0.0, self.backlog_req[svc] + (prev - mu) * dt)
            limit = shape.max_queue * max(n, 1)
            if b > limit:
                self.dropped[svc] += b - limit
                b = limit
            self.backlog_req[svc] = b
            if n == 0 or lam >= mu:
                p99 = p50 = P99_CAP_MS if lam > 0 or b > 0 else 0
                in_system = b
                util = 100 if lam > 0 else 0
            else:
                drain = b / mu
                per = (mu - lam) / n  # n identical M/M/1 servers: sojourn time ~ Exp(mu/n - lam/n)
                p99 = min(P99_CAP_MS, int(1000 * (drain + LN100 / per)))
                p50 = min(P99_CAP_MS, int(1000 * (drain + LN2 / per)))
                rho = lam / mu
                in_system = b + n * rho / (1 - rho)
                util = min(100, int(round(100 * lam / cap))) if cap > 0 else 100
            self.series[f"p99:{svc}"].append(p99)
            self.series[f"queue:{svc}"].append(in_system)
            self.feed(self.service_pool[svc], InferenceLoad(
                service_id=svc, qps=int(round(lam)), p50_ms=p50, p99_ms=p99, queue_depth=int(round(in_system)),
                util_pct=util), f"sim/load/{svc}")
        for pool in self.pools:
            self.feed(pool, SchedulerTick(now_ms=self.now), f"sim/ticker/{pool.name}")
        s = self.series
        s["t"].append(self.now - T0_MS)
        s["alloc_inference"].append(self.alloc_total["inference"])
        s["alloc_training"].append(self.alloc_total["training"])
        s["ready_gpus"].append(sum(self.capacity[v] * self.shapes[v].gpus / self.shapes[v].replica_qps
                                   for v in self.sids))
        s["waiting_jobs"].append(self.waiting_jobs)
        s["waiting_gpus"].append(self.waiting_gpus)
        s["running_jobs"].append(self.running_jobs)

    def submit(self, job: traces.TrainingJob) -> None:
        self.train[job.job_id] = TrainState(job, self.now)
        self.waiting_jobs += 1
        self.waiting_gpus += job.gpus
        self.feed(self.training_pool, JobRequested(
            job_id=job.job_id, tenant=job.tenant, project="philly", tier=Tier.OFFLINE, compute_milli=1000 * job.gpus,
            gpu_memory_mib=job.gpus * 40 * 1024, cpu_milli=4000 * job.gpus, memory_mib=16 * 1024 * job.gpus,
            duration_s=job.duration_s, checkpoint_interval_s=self.p.checkpoint_s), f"sim/user/{job.job_id}")

    # ------------------------------------------------------------ the run

    def run(self) -> dict:
        wall, cpu = time.perf_counter(), time.process_time()
        m = gpu_model(self.p.gpu_model)
        for pool in self.pools:
            for name in pool.nodes:
                self.feed(pool, make_node(name, self.p.gpu_model, self.p.gpus_per_node, cpu_milli=64_000,
                                          memory_mib=512 * 1024), f"{name}/inventory")
            for svc in self.w.services:
                if svc.service_id in pool.services:
                    self.feed(pool, svc, f"sim/service/{svc.service_id}")
        assert m.cu_milli == 1000, "the protocol's GPU-hours assume one card = 1000 milli"
        for i in range(len(self.w.demand_qps)):
            self.push(T0_MS + i * self.p.tick_s * 1000, E_TICK, i)
        for job in self.w.jobs:
            self.push(T0_MS + int(round(job.submit_s * 1000)), E_SUBMIT, job)
        handlers = {E_TICK: self.tick, E_SUBMIT: self.submit, E_START: self.start, E_CKPT: self.checkpoint,
                    E_DONE: self.done, E_STOP: self.stop}
        while self.heap and self.heap[0][0] < self.end:
            t, _, kind, args = heapq.heappop(self.heap)
            self.now = t
            handlers[kind](*args)
        self.now = self.end
        out = self.metrics()
        out["_timing"] = {"wall_s": round(time.perf_counter() - wall, 2), "cpu_s": round(time.process_time() - cpu, 2),
                          "scheduler_s": round(self.sched_s, 2)}
        return out

    # ------------------------------------------------------------ metrics

    def fleet_gpus(self) -> int:
        return sum(len(pool.nodes) for pool in self.pools) * self.p.gpus_per_node

    def metrics(self) -> dict:
        p, span = self.p, self.p.span_s
        # allocated GPU time: the scheduler's holdings (cmd.place .. cmd.release), integrated over the span
        times = np.array([t for t, _, _ in self.alloc_steps] + [self.end], dtype=float)
        inf = np.array([a for _, a, _ in self.alloc_steps], dtype=float)
        trn = np.array([b for _, _, b in self.alloc_steps], dtype=float)
        dur = np.diff(np.clip(times, T0_MS, self.end)) / 1000
        alloc_inf_gpu_s = float((inf * dur).sum()) / 1000
        alloc_trn_gpu_s = float((trn * dur).sum()) / 1000
        fleet_gpu_s = self.fleet_gpus() * span
        served = demand_coverage(self.w.demand_gpus(), self.cap_steps, self.sids, self.shapes, p.tick_s, span,
                                 p.served_grace_s)
        # training: queueing = submit -> first job.started; a job never started counts its wait to the end
        queue, jct, started, completed = [], [], 0, 0
        for st in self.train.values():
            if st.first_start_ms >= 0:
                started += 1
                queue.append((st.first_start_ms - st.submit_ms) / 1000)
            else:
                queue.append((self.end - st.submit_ms) / 1000)
            if st.done_ms >= 0:
                completed += 1
                jct.append((st.done_ms - st.submit_ms) / 1000)
        q = np.array(queue) if queue else np.zeros(1)
        by_gpus: dict[int, list[float]] = {}
        for x, st in zip(queue, self.train.values()):
            by_gpus.setdefault(st.job.gpus, []).append(x)
        short = sum(1 for placed, ready, ended in self.replica_life.values()
                    if ready >= 0 and 0 <= ended and ended - ready < 600_000)
        never = sum(1 for placed, ready, ended in self.replica_life.values() if ready < 0 and ended >= 0)
        actions: dict[str, int] = {}
        took = [tk for _, _, a, _, tk in self.scaled if a == "traffic_shift" and tk > 0]
        for _, _, a, _, _ in self.scaled:
            actions[a] = actions.get(a, 0) + 1
        return {
            "allocated_gpu_hours_pct": round(100 * (alloc_inf_gpu_s + alloc_trn_gpu_s) / fleet_gpu_s, 3),
            "inference_served_within_30s_pct": round(served["served_pct"], 4),
            "unmet_inference_pct": round(served["unmet_pct"], 4),
            "training_mean_queueing_s": round(float(q.mean()), 1),
            "training_p99_queueing_s": round(float(np.percentile(q, 99)), 1),
            "training_mean_jct_s": round(float(np.mean(jct)), 1) if jct else None,
            "preemptions": self.preemptions["training"] + self.preemptions["inference"],
            "migrations": self.migrations,
            # beyond the required keys
            "fleet_gpus": self.fleet_gpus(),
            "pools": {pool.name: len(pool.nodes) * p.gpus_per_node for pool in self.pools},
            "allocated_inference_gpu_hours": round(alloc_inf_gpu_s / 3600, 1),
            "allocated_training_gpu_hours": round(alloc_trn_gpu_s / 3600, 1),
            "inference_demand_gpu_hours": round(served["demand_gpu_s"] / 3600, 1),
            "training_jobs": len(self.train),
            "training_started": started,
            "training_completed": completed,
            "training_started_mean_queueing_s": round(float(np.mean([x for x, st in zip(queue, self.train.values())
                                                                     if st.first_start_ms >= 0])), 1)
            if started else None,
            "preemptions_of_training": self.preemptions["training"],
            "preemptions_of_inference": self.preemptions["inference"],
            "dropped_requests": int(sum(self.dropped.values())),
            "p99_over_target_pct": round(100 * float(np.mean([
                np.mean(np.array(self.series[f"p99:{s}"]) > self.shapes[s].latency_target_ms) for s in self.sids])), 3)
            if self.sids else 0.0,
            "replica_starts": dict(self.replica_starts),
            "scale_actions": dict(sorted(actions.items())),
            "scale_up_took_s_p50": round(float(np.percentile(took, 50)) / 1000, 1) if took else None,
            "scale_up_took_s_p95": round(float(np.percentile(took, 95)) / 1000, 1) if took else None,
            "scale_up_took_s_max": round(max(took) / 1000, 1) if took else None,
            "replicas_created": len(self.replica_life),
            "replicas_ended_within_10min_of_ready": short,
            "replicas_ended_before_ready": never,
            "training_mean_queueing_s_by_gpus": {str(g): round(float(np.mean(v)), 1) for g, v in sorted(by_gpus.items())},
            "training_jobs_by_gpus": {str(g): len(v) for g, v in sorted(by_gpus.items())},
            "training_preempted_twice_or_more": sum(1 for st in self.train.values() if st.preempted >= 2),
            "unmet_longest_s": served["longest_unmet_s"],
            "commands": dict(sorted(self.commands.items())),
            "scheduler_inputs": self.inputs,
        }


def demand_coverage(demand_gpus: np.ndarray, cap_steps: dict, sids: list[str], shapes: dict, tick_s: int,
                    span_s: int, grace_s: int) -> dict:
    """Demand-GPU-seconds covered by ready capacity, on a one-second grid. Demand in tick i is constant over
    [i * tick, (i + 1) * tick); ready capacity is a step function of event time. Served within the grace: demand at
    second t counts as served up to the largest capacity ready at any time in [t, t + grace] (capacity may arrive up
    to `grace_s` after the demand appeared). Unmet: demand above the capacity ready at that very second."""
    grid = np.arange(span_s)
    total = served = unmet = 0.0
    longest = 0
    for k, s in enumerate(sids):
        d = demand_gpus[np.minimum(grid // tick_s, len(demand_gpus) - 1), k]
        steps = cap_steps[s]
        at = np.array([(t - T0_MS) / 1000 for t, _ in steps])
        per = shapes[s].gpus / shapes[s].replica_qps
        val = np.array([c * per for _, c in steps])
        c = val[np.searchsorted(at, grid, side="right") - 1]
        ahead = np.concatenate([c, np.full(grace_s, c[-1])])
        best = np.lib.stride_tricks.sliding_window_view(ahead, grace_s + 1).max(axis=1)[:span_s]
        total += float(d.sum())
        served += float(np.minimum(d, best).sum())
        unmet += float(np.maximum(0.0, d - c).sum())
        short = np.concatenate(([0], (d > c + 1e-9).astype(np.int8), [0]))
        edges = np.flatnonzero(np.diff(short))
        if len(edges):
            longest = max(longest, int((edges[1::2] - edges[::2]).max()))
    return {"demand_gpu_s": total, "served_pct": 100 * served / total if total else 100.0,
            "unmet_pct": 100 * unmet / total if total else 0.0, "longest_unmet_s": longest}


# ---------------------------------------------------------------- both runs, the report

def run_one(p: Params, w: Workload, label: str, elastic: Callable | None = None) -> dict:
    sim = FleetSim(p, w, make_pools(label, p, w, elastic), label)
    res = sim.run()
    res["_series"] = sim.series
    return res


def run_both(p: Params, w: Workload, elastic: Callable | None = None, labels=("split", "unified"),
             processes: int = 1) -> dict:
    """Both runs; with processes > 1 each in its own process (the runs share nothing, the result is the same)."""
    if processes > 1 and len(labels) > 1:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(min(processes, len(labels)), mp_context=multiprocessing.get_context("fork")) as ex:
            futures = {label: ex.submit(run_one, p, w, label, elastic) for label in labels}
            return {label: f.result() for label, f in futures.items()}
    return {label: run_one(p, w, label, elastic) for label in labels}


def describe(p: Params, w: Workload) -> str:
    n_inf, n_train = split_sizes(p, w)
    b = w.backlog
    lines = [
        f"fleet: {p.nodes} nodes x {p.gpus_per_node} {p.gpu_model} = {p.nodes * p.gpus_per_node} GPUs; "
        f"{p.hours:g} h simulated, tick {p.tick_s} s, seed {p.seed}",
        f"inference: {len(w.services)} services, trace qps x {w.scale:.1f}; peak need {w.peak_gpus:.0f} GPUs; "
        f"demand {w.inference_gpu_s / 3600:.0f} GPU-h ({100 * w.inference_gpu_s / (p.gpus * p.span_s):.1f} % of the fleet)",
        f"split: inference pool {n_inf} nodes ({n_inf * p.gpus_per_node} GPUs), "
        f"training pool {n_train} nodes ({n_train * p.gpus_per_node} GPUs)",
    ]
    if b is not None:
        lines.append(
            f"training: {len(w.jobs)} Philly jobs submitted from {b.window_start:%Y-%m-%d %H:%M} to "
            f"{b.window_end:%Y-%m-%d %H:%M} ({b.passes} pass(es)), arrivals x{b.compression:.2f} faster; "
            f"{b.offered_gpu_s / 3600:.0f} GPU-h offered ({p.training_load:g} x what inference leaves free)")
    return "\n".join(lines)


def table(res: dict) -> str:
    modes = [m for m in ("split", "unified") if m in res]
    rows = [("allocated GPU-hours %", "allocated_gpu_hours_pct", "{:.1f}"),
            ("inference served within 30 s %", "inference_served_within_30s_pct", "{:.3f}"),
            ("unmet inference demand %", "unmet_inference_pct", "{:.3f}"),
            ("training mean queueing (s)", "training_mean_queueing_s", "{:,.0f}"),
            ("training p99 queueing (s)", "training_p99_queueing_s", "{:,.0f}"),
            ("training mean JCT (s)", "training_mean_jct_s", "{:,.0f}"),
            ("training jobs started / completed", None, None),
            ("preemptions", "preemptions", "{}"),
            ("migrations", "migrations", "{}")]
    out = ["| metric | " + " | ".join(modes) + " |", "|---" * (len(modes) + 1) + "|"]
    for name, key, fmt in rows:
        if key is None:
            cells = [f"{res[m]['training_started']} / {res[m]['training_completed']} of {res[m]['training_jobs']}"
                     for m in modes]
        else:
            cells = [fmt.format(res[m][key]) if res[m][key] is not None else "-" for m in modes]
        out.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def goals(res: dict) -> str:
    if "unified" not in res or "split" not in res:
        return "goals: need both runs"
    u, s = res["unified"], res["split"]
    ratio = s["training_mean_queueing_s"] / u["training_mean_queueing_s"] if u["training_mean_queueing_s"] else math.inf
    checks = [
        (u["allocated_gpu_hours_pct"] >= 90, f"unified allocates >= 90 % of GPU-hours: {u['allocated_gpu_hours_pct']:.1f} %"),
        (u["inference_served_within_30s_pct"] >= 99.9,
         f"unified serves >= 99.9 % of inference demand within 30 s: {u['inference_served_within_30s_pct']:.3f} %"),
        (ratio >= 1.6, f"training mean queueing >= 1.6x lower than split: {ratio:.2f}x"),
    ]
    return "\n".join(f"goal {'met' if ok else 'NOT met'}: {text}" for ok, text in checks)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="gpupool simulate --protocol colocation",
                                 description="one fleet, one trace, split vs unified (docs/colocation.md)")
    ap.add_argument("--qps", default=str(traces.QPS_SAMPLE), help="GenAI qps.csv (default: the vendored curve)")
    ap.add_argument("--philly", default=str(traces.PHILLY_SAMPLE),
                    help="Philly job CSV (default: the vendored sample)")
    ap.add_argument("--gpus", type=int, default=Params.gpus)
    ap.add_argument("--gpus-per-node", type=int, default=Params.gpus_per_node)
    ap.add_argument("--hours", type=float, default=Params.hours, help="simulated span")
    ap.add_argument("--seed", type=int, default=Params.seed)
    ap.add_argument("--mode", choices=["load", "clock"], default=Params.mode, help="the elastic scheduler's mode")
    ap.add_argument("--training-load", type=float, default=Params.training_load,
                    help="training work offered, as a multiple of the GPU-time inference demand leaves free")
    ap.add_argument("--philly-start", default=Params.philly_start)
    ap.add_argument("--tick", type=int, default=Params.tick_s, help="seconds between ticks and load reports")
    ap.add_argument("--cold-start-s", type=float, default=Params.cold_start_s,
                    help="replica start on a node that never ran the service")
    ap.add_argument("--warm-start-s", type=float, default=Params.warm_start_s,
                    help="replica start on a node that ran the service before (cached image and weights)")
    ap.add_argument("--runs", default="split,unified", help="which runs (default both; the JSON has their keys)")
    ap.add_argument("--processes", type=int, default=2, help="run split and unified side by side (1: one after the other)")
    ap.add_argument("--plots", metavar="DIR", help="write colocation_{load,allocation,queue}.png there")
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    return ap


def params_from(args) -> Params:
    return Params(gpus=args.gpus, gpus_per_node=args.gpus_per_node, hours=args.hours, seed=args.seed, mode=args.mode,
                  training_load=args.training_load, philly_start=args.philly_start, tick_s=args.tick,
                  cold_start_s=args.cold_start_s, warm_start_s=args.warm_start_s)


def public(res: dict) -> dict:
    return {m: {k: v for k, v in r.items() if not k.startswith("_")} for m, r in res.items()}


def run_cli(argv: list[str]) -> int:
    try:
        args = _parser().parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    try:
        p = params_from(args)
        w = build_workload(p, traces.load_qps(args.qps), traces.load_philly(args.philly))
    except (OSError, ValueError, KeyError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(describe(p, w), file=sys.stderr)
    started = time.perf_counter()
    labels = tuple(x for x in args.runs.split(",") if x)
    if not labels or any(x not in ("split", "unified") for x in labels):
        print("error: --runs takes split, unified or both", file=sys.stderr)
        return 2
    res = run_both(p, w, labels=labels, processes=args.processes)
    t = {m: res[m]["_timing"] for m in res}
    print(f"simulated both runs in {time.perf_counter() - started:.1f} s wall; " + "; ".join(
        f"{m} {t[m]['wall_s']} s wall, {t[m]['cpu_s']} s CPU, of which in the scheduler(s) {t[m]['scheduler_s']} s"
        for m in t), file=sys.stderr)
    if args.plots:
        from agents.sim.colocation_plots import plot_all
        for path in plot_all(p, w, res, Path(args.plots)):
            print(f"wrote {path}", file=sys.stderr)
    print(table(res))
    print(goals(res))
    if args.json:
        print(json.dumps(public(res), sort_keys=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(run_cli(sys.argv[1:]))
