"""Serving replicas, folded from the log (issue #33 items 4 and 5, docs/serving.md). Pure: no I/O, no clock, integers.

- `LoadFold`: the scrapes of a service's replicas (`replica.metrics`, from their nodes) become the service-level
  `inference.load` the autoscaler decides on. The autoscaler runs it inside the scheduler (agents/scheduler/elastic.py),
  so a replay of the scheduler's input gives the same samples at the same log times.
- `Endpoints`: where each service's replicas are reached and how much traffic each takes, from the declarations, the
  scheduler's placements and elastic actions, and the nodes' `replica.ready` / `replica.unready`. The HTTP API serves
  it to the service's tenant (`/api/service/NAME/endpoints`), the router renders it (agents/router.py).

A replica takes traffic (`weight` > 0) when all of these hold: its current placement's node said it is ready (its
readiness probe answered) and has not since said otherwise; the autoscaler shifted traffic to it (`service.scaled`
`traffic_shift` naming it) and has not since scaled it in; its run has not ended and no stop or release was sent for
it. From the later of the two moments (ready, shifted) its weight ramps linearly from 1 to `FULL_WEIGHT` over the
router's ramp period (the seed's "shift traffic to them gradually"). A replica named by a `scale_in`, or whose stop
was sent, is `draining`: weight 0 while it finishes what it has (the node waits its drain period before it signals
the program, agents/node/serving.py). A released replica (no end will be reported) leaves the list once its node's
drain period, as its `replica.unready` says it, is over.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from schemas.envelope import Envelope
from schemas.events import InferenceLoad, ReplicaMetrics

FULL_WEIGHT = 100
DEFAULT_ADDRESS = "127.0.0.1"


def service_of(job_id: str) -> str:
    """A replica's service: replica ids are "{service_id}/r{n}" (agents/scheduler/elastic.py)."""
    return job_id.rsplit("/", 1)[0] if "/" in job_id else ""


# ---------------------------------------------------------------- load from the scrapes (item 5)

@dataclass
class _Scrape:
    command_id: str
    at_ms: int  # the node's scrape time (rates are over the replica's own clock)
    heard_ms: int  # the log time it was read (staleness is judged on the log's time)
    m: ReplicaMetrics


@dataclass
class ServiceLoad:
    base: dict[str, _Scrape] = field(default_factory=dict)  # replica -> the scrape the last sample ended at
    last: dict[str, _Scrape] = field(default_factory=dict)  # replica -> its newest scrape
    emitted_ms: int = -(1 << 62)


def quantile_ms(buckets: list[tuple[int, int]], count: int, q_permille: int) -> int:
    """The upper bound of the bucket holding the q-quantile (Prometheus' histogram_quantile without interpolation:
    an upper estimate). Past the last finite bucket: that bucket's bound. 0 when nothing was counted."""
    if count <= 0:
        return 0
    rank = (count * q_permille + 999) // 1000
    for bound, n in buckets:
        if n >= rank:
            return bound
    return buckets[-1][0] if buckets else 0


class LoadFold:
    """replica.metrics -> a service's inference.load, at most one per `interval_ms` of log time per service.

    A sample covers, for each replica scraped since the last sample, the difference between its newest scrape and the
    one the last sample ended at (same placement; a counter that went back is a restarted program: it starts over):
    qps = finished requests per second plus the growth of what is in flight (running + waiting), i.e. the offered
    load; p50/p99 from the summed differences of the latency histograms; queue_depth = waiting requests; util_pct =
    the highest KV-cache usage. A replica not heard of for `stale_ms` drops out."""

    def __init__(self, interval_ms: int = 2000, stale_ms: int = 10_000):
        self.interval_ms = interval_ms
        self.stale_ms = stale_ms
        self.services: dict[str, ServiceLoad] = {}

    def forget(self, service_id: str) -> None:
        self.services.pop(service_id, None)

    def observe(self, service_id: str, m: ReplicaMetrics, command_id: str, now_ms: int) -> InferenceLoad | None:
        st = self.services.get(service_id)
        if st is None:  # the first sample covers a whole interval from the first scrape heard
            st = self.services[service_id] = ServiceLoad(emitted_ms=now_ms)
        scrape = _Scrape(command_id, m.scraped_ms, now_ms, m)
        old = st.last.get(m.job_id)
        if old is not None and (old.command_id != command_id or m.scraped_ms <= old.at_ms
                                or m.requests_total < old.m.requests_total):
            st.base.pop(m.job_id, None)  # another run, or the program restarted: its counters start over
            if m.scraped_ms <= old.at_ms and old.command_id == command_id:
                return None  # an older scrape than one already read
        st.last[m.job_id] = scrape
        st.base.setdefault(m.job_id, scrape)
        for j in [j for j, s in st.last.items() if now_ms - s.heard_ms > self.stale_ms]:
            del st.last[j]
            st.base.pop(j, None)
        if now_ms - st.emitted_ms < self.interval_ms:
            return None
        pairs = [(st.base[j], s) for j, s in st.last.items() if j in st.base and s.at_ms > st.base[j].at_ms]
        if not pairs:
            return None
        st.emitted_ms = now_ms
        milli_qps = 0
        hist: dict[int, int] = {}
        count = 0
        waiting = 0
        util = 0
        for b, s in pairs:
            dt = s.at_ms - b.at_ms
            done = s.m.requests_total - b.m.requests_total
            grew = max(0, (s.m.running + s.m.waiting) - (b.m.running + b.m.waiting))
            milli_qps += (done + grew) * 1_000_000 // dt
            before = dict(b.m.latency_buckets)
            for bound, n in s.m.latency_buckets:
                hist[bound] = hist.get(bound, 0) + max(0, n - before.get(bound, 0))
            count += max(0, s.m.latency_count - b.m.latency_count)
            waiting += s.m.waiting
            util = max(util, s.m.kv_cache_permille // 10)
            st.base[s.m.job_id] = s
        buckets = sorted(hist.items())
        # a histogram whose finite buckets hold fewer than the count: the rest are past the last bound
        return InferenceLoad(service_id=service_id, qps=(milli_qps + 500) // 1000,
                             p50_ms=quantile_ms(buckets, count, 500), p99_ms=quantile_ms(buckets, count, 990),
                             queue_depth=waiting, util_pct=min(100, util))


# ---------------------------------------------------------------- endpoints (item 4)

@dataclass
class Replica:
    job_id: str
    node: str = ""
    command_id: str = ""  # the current placement
    address: str = ""
    port: int = 0
    ready_ms: int | None = None  # the current placement's readiness (None: not ready)
    shifted_ms: int | None = None  # traffic shifted to it (None: not serving: starting, warm or scaled in)
    draining_ms: int | None = None  # scaled in, or its stop sent
    ended: bool = False
    released: bool = False  # a cmd.release was sent: no report of its end will come
    stop_ms: int | None = None  # released and drained: when its node signals it to stop (its drain period's end)

    def weight(self, now_ms: int, ramp_ms: int) -> int:
        if self.ended or self.draining_ms is not None or self.ready_ms is None or self.shifted_ms is None:
            return 0
        since = max(self.ready_ms, self.shifted_ms)
        if ramp_ms <= 0 or now_ms - since >= ramp_ms:
            return FULL_WEIGHT
        return max(1, FULL_WEIGHT * max(0, now_ms - since) // ramp_ms)

    def state(self) -> str:
        if self.ended:
            return "ended"
        if self.draining_ms is not None:
            return "draining"
        if self.ready_ms is None:
            return "starting"
        return "serving" if self.shifted_ms is not None else "warm"


@dataclass
class ServiceEndpoints:
    service_id: str
    tenant: str = ""
    serve: object = None  # the declaration's Serve (None: its replicas have no endpoint)
    removed: bool = False
    replicas: dict[str, Replica] = field(default_factory=dict)

    def doc(self, now_ms: int, ramp_ms: int) -> dict:
        """What the API and the router read: every replica that is not ended, with its state and weight; `ready`
        lists those that take traffic."""
        rows = []
        for r in self.replicas.values():
            if r.ended or (r.stop_ms is not None and now_ms >= r.stop_ms):
                continue  # ended, or released and its drain period over: stopped
            rows.append({"job_id": r.job_id, "node": r.node, "address": r.address, "port": r.port,
                         "state": r.state(), "weight": r.weight(now_ms, ramp_ms),
                         "ready_ms": r.ready_ms, "shifted_ms": r.shifted_ms, "draining_ms": r.draining_ms})
        return {"service": self.service_id, "removed": self.removed,
                "serve": self.serve.model_dump() if self.serve is not None else None,
                "replicas": rows, "ready": [x for x in rows if x["weight"] > 0]}


ENDPOINT_KINDS = ("service.declared", "service.removed", "service.scaled", "cmd.place", "cmd.preempt", "cmd.release",
                  "cmd.migrate", "replica.ready", "replica.unready", "job.started", "job.completed", "job.failed",
                  "job.stopped", "job.interrupted", "job.cancelled", "node.inventory")


class Endpoints:
    """The fold over the log of every service's endpoints. Feed it envelopes in log order (`fold`); unknown kinds and
    jobs of no declared service are ignored."""

    def __init__(self):
        self.services: dict[str, ServiceEndpoints] = {}
        self.addresses: dict[str, str] = {}  # node -> its advertised address (node.inventory)

    def _replica(self, job_id: str, create: bool = False) -> Replica | None:
        svc = self.services.get(service_of(job_id))
        if svc is None:
            return None
        r = svc.replicas.get(job_id)
        if r is None and create:
            r = svc.replicas[job_id] = Replica(job_id)
        return r

    def fold(self, env: Envelope) -> None:
        self.fold_payload(env.payload, env.event_time_ms)

    def fold_payload(self, p, t: int) -> None:
        """One fact (a payload model) at its event time `t`."""
        k = p.kind
        if k == "node.inventory":
            self.addresses[p.node] = getattr(p, "address", "") or DEFAULT_ADDRESS
        elif k == "service.declared":
            svc = self.services.get(p.service_id)
            if svc is None or svc.removed:
                svc = self.services[p.service_id] = ServiceEndpoints(p.service_id)
            svc.tenant, svc.serve = p.tenant, p.serve
        elif k == "service.removed":
            svc = self.services.get(p.service_id)
            if svc is not None:
                svc.removed = True
                for r in svc.replicas.values():
                    if r.draining_ms is None:
                        r.draining_ms = t
        elif k == "service.scaled":
            svc = self.services.get(p.service_id)
            if svc is None:
                return
            kept = {j for reason in p.reasons if reason.code == "KeptWarm"
                    for j in str(reason.data.get("jobs", "")).split(",") if j}
            for j in p.jobs:
                r = svc.replicas.get(j)
                if r is None:
                    r = svc.replicas[j] = Replica(j)
                if p.action == "traffic_shift":
                    r.shifted_ms = t
                    r.draining_ms = None
                elif p.action == "scale_in":
                    r.shifted_ms = None  # kept warm, or cancelled: either way it takes no traffic from now on
                    r.draining_ms = None if j in kept else t
                elif p.action == "horizontal_up":
                    r.draining_ms = None  # a warm replica promoted (traffic follows its traffic_shift)
        elif k == "cmd.place":
            r = self._replica(p.job_id, create=True)
            if r is not None:
                r.node, r.command_id, r.ended = p.node, p.command_id, False
                r.ready_ms, r.draining_ms, r.address, r.port = None, None, "", 0
                r.released, r.stop_ms = False, None
        elif k in ("cmd.preempt", "cmd.migrate", "cmd.release"):
            r = self._replica(p.job_id)
            node = getattr(p, "node", None) or getattr(p, "from_node", "")
            if r is not None and r.node == node:
                if r.draining_ms is None:
                    r.draining_ms = t
                r.released = r.released or k == "cmd.release"
        elif k == "replica.ready":
            r = self._replica(p.job_id)
            if r is not None and r.command_id == p.command_id and not r.ended:
                # the address the node advertises for itself (its inventory, stamped by the relay) wins over the
                # report's: a node points traffic only at itself
                r.ready_ms, r.address, r.port = t, self.addresses.get(p.node) or p.address, p.port
        elif k == "replica.unready":
            r = self._replica(p.job_id)
            if r is not None and r.command_id == p.command_id:
                r.ready_ms = None
                if p.reason == "draining":
                    if r.draining_ms is None:
                        r.draining_ms = t
                    if r.released:
                        r.stop_ms = t + p.drain_ms
        elif k in ("job.completed", "job.failed", "job.stopped"):
            r = self._replica(p.job_id)
            if r is not None and (not getattr(p, "command_id", "") or p.command_id == r.command_id):
                r.ended, r.ready_ms = True, None
        elif k == "job.interrupted":
            r = self._replica(p.job_id)
            if r is not None and (not p.commands or r.command_id in p.commands):
                r.ended, r.ready_ms = True, None
        elif k == "job.cancelled":
            r = self._replica(p.job_id)
            if r is not None and r.draining_ms is None:
                r.draining_ms = t

    def of(self, service_id: str) -> ServiceEndpoints | None:
        return self.services.get(service_id)
