"""Elastic inference and training/inference co-location: the autoscaler, a component of the scheduler (issue #7).

`Autoscaler` reads `service.declared`, `service.removed` and `inference.load` (handed to it by the scheduler) and,
after the scheduler's own handling of every other input, what that input means for the services. It holds the
services (replicas, samples, boosts, batches, the learned curve) and the training share's history; it never writes
the scheduler's state. What it decides it *yields* as actions, which the scheduler carries out one by one
(`Scheduler._act`), each on the state the last one left:

- `Emit(service.scaled)`: a decision, emitted as it is;
- `Request(job.requested | job.cancelled)`: a replica's request or a cancellation, with source "autoscaler" and
  its own sequence numbers, emitted and fed through the scheduler's ordinary input path, so placement, preemption,
  quota and billing are the ordinary ones. The live agent publishes it; when it comes back through the scheduler
  input, the per-source seq dedupe drops it, and a replay of the input reproduces every decision;
- `LoadSample(inference.load)`: a service-level sample the autoscaler folded from its replicas' scrapes
  (`replica.metrics`, streams/folds/serving.py): emitted with source "autoscaler" like a Request, then decided on
  as any `inference.load`;
- `Resize` (a vertical boost or its revert: `cmd.resize`), `Charge` (a boost's extra compute held in or given back to
  the quota ledger), `Backfill` (a cycle now).

Every autoscaler action is a `service.scaled` event with its trigger and, once done, how long it took. The rules are
in docs/elastic.md; the pure policy (signals, curve, share meter, trial placement) in autoscaler.py.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from agents.scheduler.autoscaler import (
    PLUGIN, DailyCurve, Sample, ShareMeter, Signal, assess, ceil_div, clamp, permille, replicas_for, share_ok,
    trial_placements,
)
from agents.scheduler.holdings import JobRecord
from agents.scheduler.preemption import Victim, plan_for, protected
from agents.scheduler.quota import held
from schemas.envelope import Envelope
from schemas.events import (
    TIER_RANK, Assignment, InferenceLoad, JobCancelled, JobCompleted, JobFailed, JobRequested, JobStarted, JobStopped,
    Reason, ReplicaMetrics, ReplicaReady, ReplicaUnready, SchedulerTick, ServiceDeclared, ServiceRemoved,
    ServiceScaled, Tier,
)
from streams.folds.serving import LoadFold
from schemas.gpu_models import model, share_for

SOURCE = "autoscaler"
SERVICE_KINDS = frozenset({"service.declared", "service.removed", "inference.load", "replica.ready",
                           "replica.unready", "replica.metrics"})
REPLICA_KINDS = frozenset({"replica.ready", "replica.unready", "replica.metrics"})


@dataclass(frozen=True)
class ElasticConfig:
    mode: str = "load"  # "load": react to the live signal | "clock": also learn the daily curve and pre-scale
    training_share_pct: int = 30  # share of pool milli-GPU guaranteed to non-inference work over window_ms (0: off)
    window_ms: int = 6 * 3600_000
    warm_pool: int = 2  # warm replicas per service: started ahead from free capacity, kept out of serving
    warm_quiet_ms: int = 600_000  # the warm pool is refilled only when no non-inference work waited this long
    # the combined trigger
    growth_samples: int = 2  # the queue must rise strictly across this many consecutive samples (>= 2)
    util_high_pct: int = 85
    util_samples: int = 2  # utilization >= util_high_pct on this many consecutive samples
    # sizing and hysteresis
    headroom_pct: int = 20  # scale up to ceil(demand x (100 + headroom) / 100 / replica_qps)
    scale_in_hysteresis_pct: int = 20  # scale in only to ceil(qps x (100 + headroom + hysteresis) / 100 / replica_qps)
    scale_up_cooldown_ms: int = 60_000  # after a traffic shift, the next "+1 on a hot signal" waits this long
    scale_in_stable_ms: int = 300_000  # surplus (or calm, for a shrink) must hold this long
    scale_in_cooldown_ms: int = 300_000  # between scale-ins, and after a scale-up decision
    # the training-share guarantee
    share_horizon_ms: int = 900_000  # how far ahead a displacement or an allocation is projected
    share_readmit_pct: int = 5  # a displacement needs the projected share >= training_share_pct + this
    # clock mode
    bucket_ms: int = 900_000  # 96 buckets a day
    curve_alpha_den: int = 4  # EWMA weight 1/4 per day
    lead_ms: int = 900_000  # pre-scale this long before a predicted rise
    # load from the replicas' scrapes (replica.metrics): one service-level sample per this much log time, over the
    # replicas heard of within load_stale_ms
    load_interval_ms: int = 2000
    load_stale_ms: int = 10_000

    def __post_init__(self) -> None:
        if self.mode not in ("load", "clock"):
            raise ValueError(f"ElasticConfig.mode must be 'load' or 'clock', not {self.mode!r}")
        if self.growth_samples < 2 or self.util_samples < 1:
            raise ValueError("growth_samples must be >= 2 and util_samples >= 1")
        if not 0 <= self.training_share_pct <= 100:
            raise ValueError("training_share_pct must be within 0..100")
        if self.bucket_ms <= 0 or 86_400_000 % self.bucket_ms:
            raise ValueError("bucket_ms must divide a day")


@dataclass
class Boost:
    command_id: str  # the placement the boost applies to
    node: str
    base: tuple[Assignment, ...]  # the assignments before the boost
    hold: JobRequested  # the extra compute held in the quota ledger (compute_milli: the milli-CU the larger share
    #                     holds beyond the base one, quota.held; no GPU memory)


@dataclass
class Batch:
    """Replicas of one scale-up decision, waiting to be ready (job.started) before traffic shifts to them."""
    decided_ms: int
    jobs: tuple[str, ...]


@dataclass
class Service:
    spec: ServiceDeclared
    curve: DailyCurve
    replicas: dict[str, str] = field(default_factory=dict)  # job id -> "serving" | "warm", in creation order
    samples: list[Sample] = field(default_factory=list)
    replica_util: dict[str, int] = field(default_factory=dict)  # latest per-replica utilization
    boosts: dict[str, Boost] = field(default_factory=dict)
    batches: list[Batch] = field(default_factory=list)
    last_up_ms: int = -(1 << 62)
    last_ready_ms: int = -(1 << 62)
    last_in_ms: int = -(1 << 62)
    low_since: int | None = None  # first sample of the current surplus run
    calm_since: int | None = None  # first sample since the last hot one
    denied: set[str] = field(default_factory=set)  # triggers whose refusal has been said and still holds
    # serving replicas (spec.serve): job id -> the placement whose node said it is ready (its probe answered)
    probed: dict[str, str] = field(default_factory=dict)

    def serving(self) -> list[str]:
        return [j for j, role in self.replicas.items() if role == "serving"]

    def warm(self) -> list[str]:
        return [j for j, role in self.replicas.items() if role == "warm"]


@dataclass(frozen=True)
class Emit:
    """A decision the scheduler emits as it is (service.scaled)."""
    payload: object


@dataclass(frozen=True)
class Request:
    """A request of the autoscaler's own (a replica's job.requested, a job.cancelled): the scheduler emits it (source
    "autoscaler") and feeds it through its ordinary input path, as if it had come from the log."""
    payload: object


@dataclass(frozen=True)
class LoadSample:
    """A service-level inference.load the autoscaler derived from its replicas' scrapes: the scheduler emits it
    (source "autoscaler") and hands it back to the autoscaler as an input."""
    payload: InferenceLoad


@dataclass(frozen=True)
class Resize:
    """Change a running replica's share on its own card (cmd.resize): usage up to now billed at the old size."""
    job_id: str
    assignments: tuple[Assignment, ...]
    why: Reason


@dataclass(frozen=True)
class Charge:
    """Hold (sign 1) or give back (-1) a boost's extra compute in the quota ledger."""
    hold: JobRequested
    sign: int


@dataclass(frozen=True)
class Backfill:
    """Run a cycle now (the freed share is backfilled at once, not at the next tick)."""


class Autoscaler:
    """The elastic layer as a component of the scheduler: it reads the scheduler's state (never writes it) and
    yields actions -- decisions to emit, requests to feed through the ordinary input path, resizes, ledger charges,
    a backfill -- which the scheduler carries out one at a time (`Scheduler._act`), so the next one is decided on
    the state the last one left. Its own state is the services, their replicas, samples, boosts and batches, and
    the training share's history (the tally itself is the holdings'). The scheduler hands it the service kinds
    (`on_input`) and, after its own handling, every other input (`after`)."""

    def __init__(self, cfg: ElasticConfig, sched):
        self.cfg = cfg
        self.s = sched
        self.services: dict[str, Service] = {}
        self.replica_of: dict[str, str] = {}  # replica job id -> service id
        self.replica_counter: dict[str, int] = {}  # per service id; survives removal so ids never repeat
        self.seq = 0  # the autoscaler source's sequence numbers
        self.training_waited_ms = -(1 << 62)  # the last time non-inference work was seen waiting
        self.share = ShareMeter()
        self.loads = LoadFold(cfg.load_interval_ms, cfg.load_stale_ms)

    # the scheduler's state, read through
    jobs = property(lambda self: self.s.jobs)
    nodes = property(lambda self: self.s.nodes)
    pending = property(lambda self: self.s.pending)
    now_ms = property(lambda self: self.s.now_ms)
    ledger = property(lambda self: self.s.ledger)
    index = property(lambda self: self.s.index)
    fleet = property(lambda self: self.s.fleet)
    h = property(lambda self: self.s.h)
    workload = property(lambda self: self.s.workload)
    candidates = property(lambda self: self.s.candidates)
    preemption = property(lambda self: self.s.preemption)

    def card_model(self, node: str, gpu_uuid: str) -> str:
        return self.s.card_model(node, gpu_uuid)

    def pending_order(self):
        return self.s.pending_order()

    # ---------------------------------------------------------------- input

    def on_input(self, env: Envelope):
        """A service kind: service.declared, service.removed, inference.load."""
        p = env.payload
        match p:
            case ServiceDeclared():
                yield from self._declare(p)
            case ServiceRemoved():
                yield from self._remove(p)
            case InferenceLoad():
                yield from self._load(p)
            case ReplicaReady() | ReplicaUnready() | ReplicaMetrics():
                yield from self._replica_report(env)

    def after(self, env: Envelope):
        """What the scheduler's handling of any other input means for the services."""
        p = env.payload
        if not self.services:
            return
        job_id = getattr(p, "job_id", None)
        sid = self.replica_of.get(job_id) if job_id else None
        if sid in self.services:
            svc = self.services[sid]
            if isinstance(p, (JobCompleted, JobFailed, JobCancelled, JobStopped)):
                yield from self._housekeep(svc)
            if isinstance(p, JobStarted):
                yield from self._check_ready(svc)
        if isinstance(p, SchedulerTick):
            for sid in sorted(self.services):
                yield from self._maintain(self.services[sid])
            yield from self._yield_to_training()
        elif isinstance(p, JobRequested) and p.tier != Tier.INFERENCE:
            yield from self._yield_to_training()

    # ---------------------------------------------------------------- services

    def _declare(self, p: ServiceDeclared):
        svc = self.services.get(p.service_id)
        if svc is None:
            cfg = self.cfg
            svc = self.services[p.service_id] = Service(spec=p, curve=DailyCurve(cfg.bucket_ms, 86_400_000 //
                                                                                   cfg.bucket_ms, cfg.curve_alpha_den))
        else:
            svc.spec = p  # a new spec applies to replicas created from now on
        yield from self._maintain(svc)

    def _remove(self, p: ServiceRemoved):
        svc = self.services.get(p.service_id)
        if svc is None:
            return
        jobs = tuple(svc.replicas)
        yield from self._scaled(svc, "scale_in", jobs, (Reason(code="ServiceRemoved", plugin=PLUGIN),), replicas=0)
        for j in jobs:
            yield from self._cancel(j, "ServiceRemoved")
        yield from self._housekeep(svc)
        del self.services[p.service_id]

    def _load(self, p: InferenceLoad):
        svc = self.services.get(p.service_id)
        if svc is None:
            return
        if p.replica:
            svc.replica_util[p.replica] = p.util_pct  # per-replica samples only order the vertical boosts
            return
        cfg = self.cfg
        svc.samples.append(Sample(self.now_ms, p.qps, p.p99_ms, p.queue_depth, p.util_pct))
        del svc.samples[:-max(cfg.growth_samples, cfg.util_samples, 2)]
        if cfg.mode == "clock":
            svc.curve.observe(self.now_ms, p.qps)
        yield from self._housekeep(svc)
        sig = assess(svc.samples, svc.spec.latency_target_ms, cfg.growth_samples, cfg.util_high_pct, cfg.util_samples)
        if sig.hot:
            svc.low_since = svc.calm_since = None
            yield from self._scale_up(svc, sig)
        else:
            svc.denied.discard("signal")
            if svc.calm_since is None:
                svc.calm_since = self.now_ms
            yield from self._scale_down(svc)
        yield from self._maintain(svc)
        yield from self._yield_to_training()

    def ready(self, svc: Service, job_id: str) -> bool:
        """A replica counts ready when it runs and, for a service with endpoints, its current placement's node said
        its readiness probe answered (replica.ready, and no replica.unready since)."""
        if self.s.phase_of(job_id) != "running":
            return False
        if svc.spec.serve is None:
            return True
        rec = self.jobs.get(job_id)
        return rec is not None and rec.placement is not None and svc.probed.get(job_id) == rec.placement.command_id

    def _replica_report(self, env: Envelope):
        """A node's word about one of its serving replicas: ready, unready, or a scrape of its metrics."""
        p = env.payload
        sid = self.replica_of.get(p.job_id)
        svc = self.services.get(sid) if sid else None
        if svc is None or p.job_id not in svc.replicas:
            return
        rec = self.jobs.get(p.job_id)
        current = rec.placement.command_id if rec is not None and rec.placement is not None else None
        if p.command_id != current:
            return  # about a superseded run
        if isinstance(p, ReplicaReady):
            svc.probed[p.job_id] = p.command_id
            yield from self._check_ready(svc)
        elif isinstance(p, ReplicaUnready):
            svc.probed.pop(p.job_id, None)
        else:
            loads = getattr(self, "loads", None)
            if loads is None:  # a state restored from before the scrapes
                loads = self.loads = LoadFold(self.cfg.load_interval_ms, self.cfg.load_stale_ms)
            sample = loads.observe(svc.spec.service_id, p, p.command_id, self.now_ms)
            if sample is not None:
                yield LoadSample(sample)

    # ---------------------------------------------------------------- scale up

    def _scale_up(self, svc: Service, sig: Signal):
        cfg, spec, now = self.cfg, svc.spec, self.now_ms
        live = len(svc.serving())
        need = clamp(replicas_for(sig.demand_qps, spec.replica_qps, cfg.headroom_pct), spec.min_replicas,
                     spec.max_replicas)
        critical = clamp(ceil_div(sig.demand_qps, spec.replica_qps), spec.min_replicas, spec.max_replicas)
        target = need
        if not svc.batches and now - svc.last_ready_ms >= cfg.scale_up_cooldown_ms:
            target = max(need, live + 1)  # the signals say the current replicas are not enough
        target = min(target, max(spec.max_replicas, spec.min_replicas))
        add = target - live
        at_max = live >= spec.max_replicas
        if add <= 0 and not at_max:
            return  # a scale-up is under way or cooling down: give it time
        rest = max(0, add) - min(max(0, add), len(svc.warm()))
        demand = Reason(code="Demand", plugin=PLUGIN, data={
            "qps": svc.samples[-1].qps, "demand_qps": sig.demand_qps, "replica_qps": spec.replica_qps,
            "serving": live, "target": target, "critical": critical})
        if rest > 0 or at_max:
            yield from self._boost(svc, sig.reasons + (demand,))
        if add > 0:
            yield from self._grow(svc, add, critical - live, sig.reasons + (demand,), "signal")

    def _grow(self, svc: Service, add: int, protected_n: int,
              reasons: tuple[Reason, ...], trigger: str):
        """Add `add` serving replicas: warm ones first (ready ones before starting ones), then new ones, of which
        those beyond `protected_n` are subject to the training-share guarantee. Ready promoted replicas take traffic
        at once; the others form a batch that shifts traffic when all are ready."""
        now = self.now_ms
        warm = svc.warm()
        warm.sort(key=lambda j: 0 if self.ready(svc, j) else 1)  # ready ones first (stable sort)
        promote = tuple(warm[:add])
        new_jobs, refused = self._add_replicas(svc, add - len(promote), max(0, protected_n - len(promote)))
        jobs = promote + new_jobs
        if promote:
            reasons += (Reason(code="WarmPool", plugin=PLUGIN, message="warm replicas promoted",
                               data={"promoted": len(promote)}),)
        if refused is not None:
            reasons += (refused,)
        if not jobs:
            if refused is not None and trigger not in svc.denied:
                svc.denied.add(trigger)  # said once, until it no longer holds
                yield from self._scaled(svc, "horizontal_up", (), reasons)
            return
        if refused is None:
            svc.denied.discard(trigger)
        else:
            svc.denied.add(trigger)
        for j in promote:
            svc.replicas[j] = "serving"
        yield from self._scaled(svc, "horizontal_up", jobs, reasons, pre=new_jobs)
        svc.last_up_ms = now
        ready = tuple(j for j in promote if self.ready(svc, j))
        if ready:
            yield from self._scaled(svc, "traffic_shift", ready, (Reason(
                code="ReplicasReady", plugin=PLUGIN, message="warm replicas were ready",
                data={"decided_ms": now, "took_ms": 0}),), took_ms=0)
            svc.last_ready_ms = now
        starting = tuple(j for j in jobs if j not in ready)
        if starting:
            svc.batches.append(Batch(now, starting))
        elif ready and not svc.batches:
            yield from self._revert_boosts(svc, "vertical_revert", "AfterTrafficShift")

    def _add_replicas(self, svc: Service, n: int, protected_n: int,
                      role: str = "serving") -> tuple[tuple[str, ...], Reason | None]:
        """Request up to `n` new replicas. The first `protected_n` (the min / SLO-critical need) are requested
        whatever they displace. The rest are requested only while they fit free capacity or the preemption they need
        keeps the projected training share >= training_share_pct + share_readmit_pct; the first refused one stops the
        rest and its reason is returned. Returns the ids requested (the requests are emitted later, by `_scaled`)."""
        if n <= 0:
            return (), None
        cfg, spec = self.cfg, svc.spec
        first = self.replica_counter.get(spec.service_id, 0) + 1
        reqs = [self._replica_request(spec, f"{spec.service_id}/r{first + i}") for i in range(n)]
        never = self.fleet.never_fits(reqs[0]) if self.fleet.settled(self.now_ms) else None
        if never is not None:  # core would reject every one of them (admission.py): say so once, request none
            return (), Reason(code="Unsatisfiable", plugin=PLUGIN, message="no node of the pool could ever hold a "
                              "replica: " + never[0].message, data={"not_requested": n})
        if protected_n >= n:
            trial: list[int | None] = [0] * n  # all of the critical need: no trial needed
        else:
            held: dict[str, int] = {}
            for (j, _), m in self.h.train_held.items():
                held[j] = held.get(j, 0) + m
            trial = self._trial(reqs, self._training_victims(), held)
        chosen: list[str] = []
        displaced = 0
        refused: Reason | None = None
        for i, (r, d) in enumerate(zip(reqs, trial)):
            if i >= protected_n:
                if d is None:
                    refused = Reason(code="NoCapacity", plugin=PLUGIN, message="no free capacity and no preemption "
                                     "plan for a replica beyond the critical need", data={"not_requested": n - i})
                    break
                if d > 0 and cfg.training_share_pct > 0:
                    t, c = self.share.projected(self.now_ms, cfg.window_ms, cfg.share_horizon_ms,
                                                self.h.train_milli - displaced - d, self.h.cap_milli)
                    if not share_ok(t, c, cfg.training_share_pct + cfg.share_readmit_pct):
                        refused = Reason(
                            code="TrainingShareGuarantee", plugin=PLUGIN,
                            message=f"a replica beyond the critical need would preempt training and bring its "
                                    f"projected share below {cfg.training_share_pct}%",
                            data={"projected_share_permille": permille(t, c), "share_pct": cfg.training_share_pct,
                                  "displaced_milli": displaced + d, "not_requested": n - i})
                        break
                    displaced += d
            chosen.append(r.job_id)
        self.replica_counter[spec.service_id] = first - 1 + len(chosen)
        for j in chosen:
            svc.replicas[j] = role
            self.replica_of[j] = spec.service_id
        return tuple(chosen), refused

    def _trial(self, reqs: list[JobRequested], candidates: dict[str, list[Victim]],
               held: dict[str, int]) -> list[int | None]:
        return trial_placements(self.index, self.nodes, self.workload, self.candidates, reqs, candidates, held)

    def _replica_request(self, spec: ServiceDeclared, job_id: str) -> JobRequested:
        return JobRequested(job_id=job_id, tenant=spec.tenant, project=spec.project, tier=Tier.INFERENCE,
                            compute_milli=spec.replica_compute_milli, gpu_memory_mib=spec.replica_memory_mib,
                            constraints=spec.constraints, latency_sensitive=spec.latency_sensitive,
                            service_id=spec.service_id, image=spec.image, command=spec.command, env=spec.env,
                            serve=spec.serve)

    def _training_victims(self) -> dict[str, list[Victim]]:
        """Running or placed non-inference work, as the tier rule of preemption.py sees it (an estimate of what
        core's preemption would stop for an inference replica)."""
        out: dict[str, list[Victim]] = {}
        for rec in self.jobs.values():
            if rec.phase not in ("placed", "running") or rec.placement is None or getattr(rec, "hold", None):
                continue
            r = rec.request
            if r.tier == Tier.INFERENCE or protected(rec.preempted_at, self.now_ms, self.preemption):
                continue
            since = max(rec.started_ms, rec.checkpoint_ms) if rec.phase == "running" else self.now_ms
            lost = max(0, self.now_ms - since)
            for part in rec.parts:
                out.setdefault(part.node, []).append(Victim(r.job_id, part.node, TIER_RANK[r.tier],
                                                            rec.placement.borrowed, lost, "tier"))
        return out

    # ---------------------------------------------------------------- vertical

    def _boostable(self, svc: Service) -> list[tuple[str, JobRecord, Assignment, int]]:
        """Serving, running replicas on a software share of one card whose card has the free milli for the boost."""
        spec = svc.spec
        if spec.boost_compute_milli <= 0:
            return []
        order = sorted(enumerate(svc.serving()), key=lambda t: (-svc.replica_util.get(t[1], 0), t[0]))
        out = []
        taken: dict[str, int] = {}  # card uuid -> milli promised to earlier boosts in this pass
        charged = 0  # milli-CU the boosts admitted before it in this pass hold beyond their base shares
        for _, j in order:
            rec = self.jobs.get(j)
            if j in svc.boosts or rec is None or rec.phase != "running" or rec.placement is None:
                continue
            pl = rec.placement
            if len(rec.parts) != 1 or len(pl.assignments) != 1 or pl.assignments[0].mig_uuid:
                continue  # MIG slices cannot grow; multi-card replicas are not boosted
            a = pl.assignments[0]
            card = next((c for c in self.nodes[pl.node].card_free() if c.uuid == a.gpu_uuid), None)
            if card is None or not card.healthy:
                continue
            new = share_for(rec.request.compute_milli + spec.boost_compute_milli, model(card.model))
            extra = new - a.milli
            if extra <= 0 or new > 1000 or card.milli - taken.get(card.uuid, 0) < extra:
                continue
            cu = self._extra_cu(pl.node, a, new, rec.request.compute_milli)
            # within the tenant's own quota, counting the boosts admitted before it in this pass
            together = JobRequested(job_id=j, tenant=spec.tenant, project=spec.project, tier=Tier.INFERENCE,
                                    compute_milli=charged + cu, gpu_memory_mib=1, cpu_milli=0, memory_mib=0)
            adm = self.ledger.admit(together, self.index.capacity_milli, charged + cu, 0)
            if adm.blocked or adm.borrowed:
                continue
            taken[card.uuid] = taken.get(card.uuid, 0) + extra
            charged += cu
            out.append((j, rec, a, new))
        return out

    def _extra_cu(self, node: str, a: Assignment, new_milli: int, asked_milli: int) -> int:
        """milli-CU a share grown to `new_milli` holds beyond the share `a` of a job that asked `asked_milli` (the
        quota's unit, quota.held)."""
        card_model = lambda uuid: self.card_model(node, uuid)  # noqa: E731
        return (held((a.model_copy(update={"milli": new_milli}),), card_model, asked_milli)[0]
                - held((a,), card_model, asked_milli)[0])

    def _boost(self, svc: Service, reasons: tuple[Reason, ...]):
        todo = self._boostable(svc)
        if not todo:
            return
        spec = svc.spec
        yield from self._scaled(svc, "vertical_up", tuple(j for j, *_ in todo), reasons + (Reason(
            code="VerticalBoost", plugin=PLUGIN, message="grow replicas on their own cards while new ones start",
            data={"boost_compute_milli": spec.boost_compute_milli}),))
        for j, rec, a, new in todo:
            pl = rec.placement
            boosted = (a.model_copy(update={"milli": new}),)
            extra_cu = self._extra_cu(pl.node, a, new, rec.request.compute_milli)
            hold = JobRequested(job_id=j, tenant=spec.tenant, project=spec.project, tier=Tier.INFERENCE,
                                compute_milli=extra_cu, gpu_memory_mib=1, cpu_milli=0, memory_mib=0)
            yield from self._resize(rec, boosted, Reason(code="VerticalBoost", plugin=PLUGIN,
                                                        data={"from_milli": a.milli, "to_milli": new}))
            yield Charge(hold, 1)
            svc.boosts[j] = Boost(pl.command_id, pl.node, pl.assignments, hold)

    def _resize(self, rec: JobRecord, assignments: tuple[Assignment, ...], why: Reason):
        yield Resize(rec.request.job_id, assignments, why)

    def _revert_boosts(self, svc: Service, action: str, code: str,
                       data: dict | None = None):
        if not svc.boosts:
            return
        jobs = tuple(svc.boosts)
        yield from self._scaled(svc, action, jobs, (Reason(code=code, plugin=PLUGIN, data=data or {}),))
        for j in jobs:
            b = svc.boosts.pop(j)
            rec = self.jobs.get(j)
            if rec and rec.phase == "running" and rec.placement and rec.placement.command_id == b.command_id:
                yield from self._resize(rec, b.base, Reason(code=code, plugin=PLUGIN))
            yield Charge(b.hold, -1)
        yield Backfill()  # the freed share is backfilled now, not at the next tick

    # ---------------------------------------------------------------- ready, housekeeping

    def _check_ready(self, svc: Service):
        shifted = False
        for b in list(svc.batches):
            alive = tuple(j for j in b.jobs if j in svc.replicas)
            if not alive:
                svc.batches.remove(b)
                continue
            if all(self.ready(svc, j) for j in alive):
                svc.batches.remove(b)
                took = self.now_ms - b.decided_ms
                yield from self._scaled(svc, "traffic_shift", alive, (Reason(
                    code="ReplicasReady", plugin=PLUGIN, message=f"ready {took} ms after the decision",
                    data={"decided_ms": b.decided_ms, "took_ms": took}),), took_ms=took)
                svc.last_ready_ms = self.now_ms
                shifted = True
        if shifted and not svc.batches:
            yield from self._revert_boosts(svc, "vertical_revert", "AfterTrafficShift")

    def _housekeep(self, svc: Service):
        """Forget replicas that ended (completed, failed, cancelled); release boost holds whose placement is gone."""
        for j in [j for j in svc.replicas if self.s.phase_of(j) in (None, "done")]:
            del svc.replicas[j]
            svc.replica_util.pop(j, None)
            svc.probed.pop(j, None)
        for j in list(svc.boosts):
            rec = self.jobs.get(j)
            if rec is None or rec.placement is None or rec.placement.command_id != svc.boosts[j].command_id:
                yield Charge(svc.boosts.pop(j).hold, -1)
        if svc.batches:
            yield from self._check_ready(svc)

    # ---------------------------------------------------------------- scale down

    def _scale_in_windows(self, spec: ServiceDeclared) -> tuple[int, int]:
        """(stable, cooldown) in ms: the service's own windows where it declared them, else the pool's."""
        cfg = self.cfg
        return (cfg.scale_in_stable_ms if spec.scale_in_stable_s is None else spec.scale_in_stable_s * 1000,
                cfg.scale_in_cooldown_ms if spec.scale_in_cooldown_s is None else spec.scale_in_cooldown_s * 1000)

    def _scale_down(self, svc: Service):
        cfg, spec, now = self.cfg, svc.spec, self.now_ms
        qps = svc.samples[-1].qps
        floor = self._prescale_target(svc)
        keep = clamp(max(replicas_for(qps, spec.replica_qps, cfg.headroom_pct + cfg.scale_in_hysteresis_pct),
                         floor[0] if floor else 0), spec.min_replicas, spec.max_replicas)
        serving = svc.serving()
        if len(serving) > keep:
            if svc.low_since is None:
                svc.low_since = now
            stable, cooldown = self._scale_in_windows(spec)
            if now - svc.low_since < stable or now - svc.last_up_ms < cooldown or now - svc.last_in_ms < cooldown:
                return
            surplus = len(serving) - keep
            # starting replicas first, then the newest ready ones
            order = sorted(enumerate(serving), key=lambda t: (0 if not self.ready(svc, t[1]) else 1, -t[0]))
            victims = [j for _, j in order[:surplus]]
            # kept warm (no restart at the next peak) unless non-inference work waits, or waited lately
            quiet = not self._training_waits() and now - self.training_waited_ms >= cfg.warm_quiet_ms
            slots = cfg.warm_pool - len(svc.warm()) if quiet else 0
            kept = [j for j in victims if self.ready(svc, j) and j not in svc.boosts][:max(0, slots)]
            reasons = (Reason(code="LoadLow", plugin=PLUGIN, message=f"{len(serving)} replicas serve {qps} qps; "
                              f"{keep} keep {cfg.headroom_pct + cfg.scale_in_hysteresis_pct}% headroom",
                              data={"qps": qps, "serving": len(serving), "keep": keep,
                                    "low_for_ms": now - svc.low_since}),)
            if kept:
                reasons += (Reason(code="KeptWarm", plugin=PLUGIN, message="moved to the warm pool",
                                   data={"jobs": ",".join(kept)}),)
            yield from self._scaled(svc, "scale_in", tuple(victims), reasons, replicas=keep)
            for j in victims:
                if j in kept:
                    svc.replicas[j] = "warm"
                else:
                    yield from self._cancel(j, "ScaleIn")
            yield from self._housekeep(svc)
            svc.last_in_ms, svc.low_since = now, None
            return
        svc.low_since = None
        if svc.boosts and not svc.batches and svc.calm_since is not None and now - svc.calm_since >= \
                self._scale_in_windows(spec)[0]:
            yield from self._revert_boosts(svc, "shrink", "LoadLow", {"qps": qps, "calm_for_ms": now - svc.calm_since})

    # ---------------------------------------------------------------- maintenance: min, clock, warm pool

    def _prescale_target(self, svc: Service) -> tuple[int, int, int] | None:
        """Clock mode: (replicas for the predicted peak, predicted qps, the peak bucket's start) within lead_ms."""
        if self.cfg.mode != "clock":
            return None
        pred = svc.curve.predict(self.now_ms, self.cfg.lead_ms)
        if pred is None:
            return None
        spec = svc.spec
        n = clamp(replicas_for(pred[0], spec.replica_qps, self.cfg.headroom_pct), spec.min_replicas,
                  spec.max_replicas)
        return n, pred[0], pred[1]

    def _maintain(self, svc: Service):
        spec, cfg = svc.spec, self.cfg
        live = len(svc.serving())
        if live < spec.min_replicas:
            yield from self._grow(svc, spec.min_replicas - live, spec.min_replicas - live, (Reason(
                code="MinReplicas", plugin=PLUGIN, data={"min_replicas": spec.min_replicas, "serving": live}),),
                "min")
            live = len(svc.serving())
        pre = self._prescale_target(svc)
        if pre and pre[0] > live and not svc.batches:
            yield from self._grow(svc, pre[0] - live, 0, (Reason(
                code="ClockPrescale", plugin=PLUGIN, message=f"learned peak of {pre[1]} qps from {pre[2]} ms",
                data={"predicted_qps": pre[1], "peak_at_ms": pre[2], "target": pre[0], "serving": live}),),
                "clock")
            live = len(svc.serving())
        elif not pre or pre[0] <= live:
            svc.denied.discard("clock")
        # the warm pool: filled only from free capacity, while nothing at all waits and no training has waited for
        # warm_quiet_ms (where training wants the capacity, it gets it: warm replicas would only be started and
        # then yield)
        want = min(cfg.warm_pool, max(spec.max_replicas - live, 0)) - len(svc.warm())
        if want > 0 and not self.pending and self.now_ms - self.training_waited_ms >= cfg.warm_quiet_ms:
            first = self.replica_counter.get(spec.service_id, 0) + 1
            reqs = [self._replica_request(spec, f"{spec.service_id}/r{first + i}") for i in range(want)]
            fits = self._trial(reqs, {}, {})
            n = next((i for i, d in enumerate(fits) if d != 0), len(fits))
            if n:
                jobs, _ = self._add_replicas(svc, n, n, role="warm")
                yield from self._scaled(svc, "horizontal_up", jobs, (Reason(
                    code="WarmPool", plugin=PLUGIN, message="warm replicas from free capacity",
                    data={"warm_pool": cfg.warm_pool, "warm": len(svc.warm())}),), pre=jobs)

    def _yield_to_training(self):
        """Warm replicas always give way to waiting non-inference work they would make fit; serving replicas beyond
        the critical need give way too while the projected training share is below training_share_pct."""
        cfg = self.cfg
        if not self._training_waits():
            return
        cands: dict[str, list[Victim]] = {}
        owner: dict[str, str] = {}
        t, c = self.share.projected(self.now_ms, cfg.window_ms, cfg.share_horizon_ms, self.h.train_milli,
                                    self.h.cap_milli)
        share_low = cfg.training_share_pct > 0 and not share_ok(t, c, cfg.training_share_pct)
        for sid in sorted(self.services):
            svc = self.services[sid]
            extras: list[str] = []
            if share_low and svc.samples:
                # the critical need at the highest qps of the kept samples: one low sample frees nothing
                critical = clamp(ceil_div(max(x.qps for x in svc.samples), svc.spec.replica_qps),
                                 svc.spec.min_replicas, svc.spec.max_replicas)
                serving = svc.serving()
                extras = serving[critical:] if len(serving) > critical else []
            for rank, jobs in ((0, svc.warm()), (1, extras)):
                for j in jobs:
                    rec = self.jobs.get(j)
                    if rec is not None and rec.phase in ("placed", "running") and rec.placement is not None:
                        cands.setdefault(rec.node, []).append(Victim(j, rec.node, 0, False, rank, "yield"))
                        owner[j] = sid
        if not cands:
            return
        waiting = [r for r in self.pending_order() if r.request.tier != Tier.INFERENCE and r.nominated is None]
        failed: list[tuple] = []  # needs that found no plan: a job asking at least as much finds none either
        for rec in waiting:
            r = rec.request
            if rec.phase != "pending":
                continue
            need = (r.compute_milli, r.gpu_memory_mib, r.cpu_milli, r.memory_mib)
            if any(c == r.constraints and all(a >= b for a, b in zip(need, f)) for c, f in failed):
                continue
            plan = plan_for(r, [self.nodes[n] for n in sorted(cands) if cands[n]], cands)
            if plan is None:
                failed.append((r.constraints, need))
                continue
            by_svc: dict[str, list[str]] = {}
            for v in plan.victims:
                by_svc.setdefault(owner[v.job_id], []).append(v.job_id)
            stopped = {v.job_id for v in plan.victims}
            cands[plan.node] = [v for v in cands[plan.node] if v.job_id not in stopped]
            for sid, jobs in sorted(by_svc.items()):
                svc = self.services[sid]
                warm = [j for j in jobs if svc.replicas.get(j) == "warm"]
                reasons = ()
                if warm:
                    reasons += (Reason(code="WarmPoolYields", plugin=PLUGIN, message=f"for {rec.request.job_id}",
                                       data={"for_job": rec.request.job_id, "jobs": ",".join(warm)}),)
                if len(warm) < len(jobs):
                    reasons += (Reason(code="TrainingShareGuarantee", plugin=PLUGIN,
                                       message=f"training share below {cfg.training_share_pct}%: replicas beyond the "
                                               f"critical need give way to {rec.request.job_id}",
                                       data={"projected_share_permille": permille(t, c),
                                             "share_pct": cfg.training_share_pct, "for_job": rec.request.job_id}),)
                serving_after = len([j for j in svc.serving() if j not in jobs])
                yield from self._scaled(svc, "scale_in", tuple(jobs), reasons, replicas=serving_after)
                for j in jobs:
                    yield from self._cancel(j, "YieldToTraining")
                yield from self._housekeep(svc)

    def _training_waits(self) -> bool:
        waits = any(self.jobs[j].request.tier != Tier.INFERENCE for j in self.pending)
        if waits:
            self.training_waited_ms = self.now_ms
        return waits

    # ---------------------------------------------------------------- emitting

    def _cancel(self, job_id: str, why: str):
        rec = self.jobs.get(job_id)
        if rec is not None and rec.phase != "done":
            yield Request(JobCancelled(job_id=job_id, reason=why))

    def _scaled(self, svc: Service, action: str, jobs: tuple[str, ...],
                reasons: tuple[Reason, ...], *, replicas: int | None = None, took_ms: int = 0,
                pre: tuple[str, ...] = ()):
        """One service.scaled event; `pre` names new replicas whose requests follow it (in that order)."""
        if replicas is None:
            replicas = len(svc.serving())
        yield Emit(ServiceScaled(service_id=svc.spec.service_id, action=action, replicas=replicas, jobs=jobs,
                                 took_ms=took_ms, reasons=reasons))
        if pre:
            for j in pre:
                yield Request(self._replica_request(svc.spec, j))

    # ---------------------------------------------------------------- the training-share meter

    def record_share(self) -> None:
        """After each input: the training share's history (the tally is the holdings')."""
        self.share.record(self.now_ms, self.h.train_milli, self.h.cap_milli)
        self.share.prune(self.now_ms - self.cfg.window_ms)

    def training_share(self) -> tuple[int, int]:
        """(non-inference milli-GPU x ms, pool milli-GPU x ms) over the last window_ms."""
        return self.share.integral(self.now_ms - self.cfg.window_ms, self.now_ms)

