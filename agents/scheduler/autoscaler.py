"""The autoscaler's pure policy: load signals and the combined trigger, replica counts, the learned daily load curve,
the training-share meter and the trial placement that tells what a new replica would displace.

Nothing here holds scheduler state or emits anything; `agents/scheduler/elastic.py` applies these rules to the
scheduler's state. All capacity arithmetic is integer (milli-GPU, milli-CU, MiB); time is event time in ms.
"""
from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass, field
from typing import Mapping, Sequence

from agents.scheduler.node_index import NodeIndex
from agents.scheduler.placement import MigPlan, Placement, place
from agents.scheduler.preemption import Victim, plan_for
from agents.scheduler.scoring import Workload
from schemas.envelope import envelope
from schemas.events import JobRequested, PlaceJob, Reason, ReleaseJob
from streams.folds import node_view

PLUGIN = "Autoscaler"


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def replicas_for(qps: int, replica_qps: int, headroom_pct: int) -> int:
    """Replicas serving `qps` with `headroom_pct` percent to spare: ceil(qps x (100 + headroom) / 100 / replica_qps)."""
    return ceil_div(qps * (100 + headroom_pct), 100 * replica_qps)


def clamp(n: int, low: int, high: int) -> int:
    return min(max(n, low), max(high, low))


# ---------------------------------------------------------------- signals and the combined trigger

@dataclass(frozen=True)
class Sample:
    """One service-level load sample (an `inference.load` with no replica named)."""
    t_ms: int
    qps: int
    p99_ms: int
    queue_depth: int
    util_pct: int


@dataclass(frozen=True)
class Signal:
    hot: bool  # the combined trigger fired
    latency: bool  # p99 over target and the queue growing
    util: bool  # utilization high on every one of the last `util_samples` samples
    demand_qps: int  # the offered load the replicas are sized for: the last sample's qps (requests/s arriving)
    reasons: tuple[Reason, ...]


def assess(samples: Sequence[Sample], latency_target_ms: int, growth_samples: int, util_high_pct: int,
           util_samples: int) -> Signal:
    """The combined scale-up trigger over the latest samples (oldest first):

    - latency: the last sample's p99 is over the target AND the queue depth rose strictly across the last
      `growth_samples` samples (q[-n] < ... < q[-1]); or
    - utilization: util_pct >= `util_high_pct` on each of the last `util_samples` samples.

    One noisy signal alone does not fire: a latency spike with a flat queue, a rising queue within the SLO, a single
    hot utilization sample.
    """
    if not samples:
        return Signal(False, False, False, 0, ())
    last = samples[-1]
    latency = False
    if last.p99_ms > latency_target_ms and len(samples) >= max(2, growth_samples):
        qs = [s.queue_depth for s in samples[-max(2, growth_samples):]]
        latency = all(a < b for a, b in zip(qs, qs[1:]))
    util = len(samples) >= util_samples > 0 and all(s.util_pct >= util_high_pct for s in samples[-util_samples:])
    demand = last.qps
    reasons: list[Reason] = []
    if latency:
        prev = samples[-2]
        dt = last.t_ms - prev.t_ms
        growth = (last.queue_depth - prev.queue_depth) * 1000 // dt if dt > 0 else 0
        reasons.append(Reason(code="LatencyOverTarget", plugin=PLUGIN,
                              message=f"p99 {last.p99_ms} ms > {latency_target_ms} ms and queue "
                                      f"{samples[-max(2, growth_samples)].queue_depth} -> {last.queue_depth}",
                              data={"p99_ms": last.p99_ms, "target_ms": latency_target_ms,
                                    "queue_depth": last.queue_depth, "queue_before": prev.queue_depth,
                                    "queue_growth_per_s": max(0, growth)}))
    if util:
        reasons.append(Reason(code="UtilizationHigh", plugin=PLUGIN,
                              message=f"utilization >= {util_high_pct}% on the last {util_samples} samples",
                              data={"util_pct": last.util_pct, "threshold_pct": util_high_pct,
                                    "samples": util_samples}))
    return Signal(latency or util, latency, util, demand, tuple(reasons))


# ---------------------------------------------------------------- the learned daily curve (clock mode)

@dataclass
class DailyCurve:
    """Per time-of-day bucket (default 96 quarter hours), an integer EWMA of the bucket's peak qps, in milli-qps.

    A bucket's peak is folded in when the first sample of a later bucket arrives: level = peak on the first
    observation, else level + (peak - level) // alpha_den (floor division: deterministic for negative steps too).
    """
    bucket_ms: int = 900_000
    buckets: int = 96
    alpha_den: int = 4
    level: list[int] = field(default_factory=list)
    seen: list[int] = field(default_factory=list)
    open_bucket: int = -1  # absolute bucket number (t // bucket_ms) of the samples not yet folded
    open_peak: int = 0

    def __post_init__(self) -> None:
        if not self.level:
            self.level = [0] * self.buckets
            self.seen = [0] * self.buckets

    def observe(self, t_ms: int, qps: int) -> None:
        b = t_ms // self.bucket_ms
        if b != self.open_bucket:
            self._fold()
            self.open_bucket, self.open_peak = b, 0
        self.open_peak = max(self.open_peak, qps)

    def _fold(self) -> None:
        if self.open_bucket < 0:
            return
        i = self.open_bucket % self.buckets
        v = self.open_peak * 1000
        self.level[i] = v if not self.seen[i] else self.level[i] + (v - self.level[i]) // self.alpha_den
        self.seen[i] += 1

    def predict(self, t_ms: int, lead_ms: int) -> tuple[int, int] | None:
        """The highest learned peak (qps, rounded up) among the buckets that overlap [t, t + lead], with the start
        time of the first bucket that has it; None when none of them has been observed yet."""
        best: tuple[int, int] | None = None
        for b in range(t_ms // self.bucket_ms, (t_ms + lead_ms) // self.bucket_ms + 1):
            i = b % self.buckets
            if self.seen[i]:
                qps = ceil_div(self.level[i], 1000)
                if best is None or qps > best[0]:
                    best = (qps, b * self.bucket_ms)
        return best


# ---------------------------------------------------------------- the training-share meter

@dataclass
class ShareMeter:
    """Piecewise-constant history of (non-inference milli-GPU allocated, pool milli-GPU) over event time, integrated
    exactly in milli-GPU x ms. A segment's values hold from its start to the next segment's start (the last: to now).
    Each segment also carries the integrals up to its start, so an integral over any interval is two look-ups."""
    starts: list[int] = field(default_factory=list)
    values: list[tuple[int, int]] = field(default_factory=list)  # (train_milli, cap_milli)
    cum: list[tuple[int, int]] = field(default_factory=list)  # integrals from the first segment to this one's start
    first: int = 0  # segments before this index are pruned

    def record(self, t_ms: int, train_milli: int, cap_milli: int) -> None:
        v = (train_milli, cap_milli)
        if len(self.starts) > self.first:
            if self.values[-1] == v:
                return
            if self.starts[-1] >= t_ms:  # a change at the same instant replaces the zero-length segment
                self.starts.pop(), self.values.pop(), self.cum.pop()
                if len(self.starts) > self.first and self.values[-1] == v:
                    return
        if len(self.starts) > self.first:
            (tr, cp), (ct, cc), s = self.values[-1], self.cum[-1], self.starts[-1]
            self.cum.append((ct + tr * (t_ms - s), cc + cp * (t_ms - s)))
        else:
            self.cum.append((0, 0))
        self.starts.append(t_ms)
        self.values.append(v)

    def prune(self, before_ms: int) -> None:
        """Forget what ended before `before_ms` (the segment covering it stays); compacts now and then."""
        i = bisect_right(self.starts, before_ms, self.first) - 1
        if i > self.first:
            self.first = i
            if self.first > 1024 and self.first * 2 > len(self.starts):
                del self.starts[:self.first], self.values[:self.first], self.cum[:self.first]
                self.first = 0

    def _at(self, t_ms: int) -> tuple[int, int]:
        i = bisect_right(self.starts, t_ms, self.first) - 1
        if i < self.first:
            return self.cum[self.first] if len(self.starts) > self.first else (0, 0)
        (tr, cp), (ct, cc), s = self.values[i], self.cum[i], self.starts[i]
        return ct + tr * (t_ms - s), cc + cp * (t_ms - s)

    def integral(self, a_ms: int, b_ms: int) -> tuple[int, int]:
        """(non-inference milli x ms, pool milli x ms) over [a, b); before the first record both are 0."""
        if b_ms <= a_ms:
            return 0, 0
        (ta, ca), (tb, cb) = self._at(a_ms), self._at(b_ms)
        return tb - ta, cb - ca

    def projected(self, now_ms: int, window_ms: int, horizon_ms: int, train_now: int, cap_now: int) -> tuple[int, int]:
        """The window as it will be `horizon_ms` from now, [now + h - window, now + h), if the allocation from now on
        is (train_now, cap_now): the recorded part plus the projected part."""
        h = min(horizon_ms, window_ms)
        train, cap = self.integral(now_ms + h - window_ms, now_ms)
        return train + train_now * h, cap + cap_now * h


def share_ok(train_ms: int, cap_ms: int, pct: int) -> bool:
    return cap_ms <= 0 or train_ms * 100 >= pct * cap_ms


def permille(train_ms: int, cap_ms: int) -> int:
    return train_ms * 1000 // cap_ms if cap_ms > 0 else 1000


# ---------------------------------------------------------------- what new replicas would displace

def trial_placements(index: NodeIndex, views: Mapping[str, node_view.NodeView], workload: Workload, k: int,
                     requests: Sequence[JobRequested], candidates: Mapping[str, Sequence[Victim]],
                     held_milli: Mapping[str, int]) -> list[int | None]:
    """For each request in order, tried with the scheduler's own placement and preemption planning on a scratch copy
    of the views and index (the real ones are untouched): 0 when it fits free capacity (a MIG carve of idle slices
    counts as free), the milli-GPU held by the work a preemption plan would stop when only that makes it fit, None
    when nothing does. Each outcome is applied to the copy before the next request is tried."""
    scratch: dict[str, node_view.NodeView] | None = None
    idx = index
    cands = {n: list(vs) for n, vs in candidates.items()}
    seq = 0
    out: list[int | None] = []

    def apply(node: str, payload) -> None:
        nonlocal seq, scratch, idx
        if scratch is None:  # copied on the first change only: a single trial reads the real state
            scratch, idx = dict(views), index.copy()
        seq += 1
        scratch[node] = node_view.evolve(scratch[node], envelope(payload, source="autoscaler-trial", seq=seq,
                                                                 time_ms=0))
        idx.update(scratch[node])

    for n, r in enumerate(requests):
        last = n == len(requests) - 1
        current = scratch if scratch is not None else views
        fit = place(idx, current, r, workload, k)
        if isinstance(fit, MigPlan):
            out.append(0)  # carving idle MIG slices stops nobody; not applied to the copy
            continue
        displaced = 0
        if not isinstance(fit, Placement):
            live = {n_: vs for n_, vs in cands.items() if vs}
            plan = plan_for(r, [current[n_] for n_ in sorted(live)], live)
            if plan is None:
                out.append(None)
                continue
            stopped = {v.job_id for v in plan.victims}
            displaced = sum(held_milli.get(j, 0) for j in stopped)
            out.append(displaced)
            if last:
                break
            for v in plan.victims:
                apply(plan.node, ReleaseJob(command_id=f"trial-{seq}", job_id=v.job_id, node=plan.node))
            cands[plan.node] = [c for c in cands[plan.node] if c.job_id not in stopped]
            fit = place(idx, scratch, r, workload, k, prefer=plan.node)
            if not isinstance(fit, Placement):
                continue
        else:
            out.append(0)
            if last:
                break
        for part in fit.parts:
            apply(part.node, PlaceJob(command_id=f"trial-{seq}", job_id=r.job_id, tenant=r.tenant, node=part.node,
                                      assignments=part.assignments, cpu_milli=part.cpu_milli,
                                      memory_mib=part.memory_mib))
    return out
