"""The worker's Prometheus metrics (docs/observability.md has every one with its meaning).

Two kinds: counters and histograms moved as the worker folds facts (placements, preemptions, rejections, dead
letters, decision latency, queue wait), and gauges computed when scraped from what the worker holds (its node-view
and job-view tables, the tenants' ledger as the ledger topic states it, the consumer groups' lag, the sink's
progress). One registry per worker, served at `/metrics` to the operator, auditor and service roles.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics
from prometheus_client.core import GaugeMetricFamily, CounterMetricFamily

from schemas.envelope import Envelope
from streams.folds.node_view import NodeView

# Latency buckets in seconds: from a decision within a tick to a wait of an hour.
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900, 3600)
TIERS = ("inference", "online-training", "offline")
# every state streams.edge.api.node_state gives (each a gpupool_nodes series, 0 when no node is in it)
NODE_STATES = ("ready", "cordoned", "draining", "down", "not-admitted", "no-inventory", "removed")
EARLY_PLACEMENTS = 10_000  # placements held for their request at most (WorkerMetrics._placed_early)


def _reason(env: Envelope) -> str:
    reasons = getattr(env.payload, "reasons", ()) or ()
    return reasons[0].code if reasons else "unspecified"


class _Seen:
    """Command and event ids already counted (a re-emitted record is counted once), the newest `size` kept."""

    def __init__(self, size: int = 200_000):
        self.size = size
        self._ids: OrderedDict[str, None] = OrderedDict()

    def first(self, key: str) -> bool:
        if key in self._ids:
            return False
        self._ids[key] = None
        if len(self._ids) > self.size:
            self._ids.popitem(last=False)
        return True


class WorkerMetrics:
    def __init__(self):
        disable_created_metrics()  # no `_created` series beside each counter: Prometheus does not need them
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.placements = Counter("gpupool_placements", "Jobs placed (a gang counts once), by tier and card model",
                                  ["tier", "gpu_model"], registry=r)
        self.preemptions = Counter("gpupool_preemptions", "Jobs told to checkpoint and stop, by reason",
                                   ["reason"], registry=r)
        self.migrations = Counter("gpupool_migrations", "Jobs moved to another node, by reason", ["reason"],
                                  registry=r)
        self.resizes = Counter("gpupool_resizes", "Running jobs resized in place, by reason", ["reason"], registry=r)
        self.rejections = Counter("gpupool_rejections", "Job requests rejected, by reason (code)", ["reason"],
                                  registry=r)
        self.interruptions = Counter("gpupool_interruptions", "Runs ended by a lost node or a failed card, by reason",
                                     ["reason"], registry=r)
        self.elastic = Counter("gpupool_elastic_actions", "Autoscaler actions on inference services, by action",
                               ["action"], registry=r)
        self.dead_letters = Counter("gpupool_dead_letters", "Records set aside as bad, by reason", ["reason"],
                                    registry=r)
        self.auth_failures = Counter("gpupool_auth_failures", "HTTP requests refused at authentication, by outcome: "
                                     "missing, invalid (401), throttled (429: too many failures)", ["outcome"],
                                     registry=r)
        self.gateway = Counter("gpupool_gateway_requests", "People's requests the gateway read, by outcome",
                               ["outcome"], registry=r)
        self.job_log_pieces = Counter("gpupool_job_log_pieces", "Pieces of programs' output (job.log) the node relay "
                                      "forwarded to gpupool.job-logs", registry=r)
        self.job_log_dropped = Counter("gpupool_job_log_dropped_bytes", "Bytes of programs' output the nodes' log caps "
                                       "cut, as the relayed pieces mark them (dropped_bytes)", registry=r)
        self.telemetry_minutes = Counter("gpupool_telemetry_minutes", "Node-minutes of telemetry history emitted",
                                         registry=r)
        self.decision_latency = Histogram(
            "gpupool_decision_latency_seconds",
            "Request in (the gateway's append time) to placement command out (its produce time), for jobs placed "
            "on their first scheduling pass, by tier", ["tier"], buckets=LATENCY_BUCKETS, registry=r)
        self.queue_wait = Histogram(
            "gpupool_queue_wait_seconds", "Time from (re)queueing to placement, for every placement, by tier",
            ["tier"], buckets=LATENCY_BUCKETS, registry=r)
        self._seen = _Seen()
        # job -> (queued since, tier, first pass): who waits since when
        self._waiting: dict[str, tuple[int, str, bool]] = {}
        self._tiers: dict[str, str] = {}  # job -> tier, while it lives
        # job -> (produce time, card model) of a first cmd.place folded before its request: the gateway hands a
        # request to the scheduler and to the folds at once, so the node fold may read the placement first; it is
        # counted when the request comes (with its tier and latency), when the job ends, or when too many wait
        self._placed_early: OrderedDict[str, tuple[int, str]] = OrderedDict()
        self.ledger: dict[str, dict[str, int]] = {}  # tenant -> quota, used, reserved, borrowed (milli-CU)
        self.lag: dict[tuple[str, str], int] = {}  # (group, topic) -> records behind
        self._sources: dict[str, Callable[[], object]] = {}
        r.register(_Scraped(self))

    def source(self, name: str, fn: Callable[[], object]) -> None:
        """What the scrape-time gauges read: nodes, jobs, sink, scheduler (functions of the worker's memory)."""
        self._sources[name] = fn

    # ---------------------------------------------------------------- facts as they are folded

    def job_fact(self, env: Envelope) -> None:
        """A record of the job-keyed topics (requests, job events, decisions)."""
        p, kind = env.payload, env.kind
        if not self._seen.first(env.event_id):
            return
        if kind == "job.requested":
            if p.job_id in self._tiers:
                return  # a retry of a job that lives (or a different request under its id): not a new wait
            self._tiers[p.job_id] = str(p.tier)
            early = self._placed_early.pop(p.job_id, None)
            if early is None:
                self._waiting.setdefault(p.job_id, (env.event_time_ms, str(p.tier), True))
            else:
                self._placed(p.job_id, str(p.tier), early[0], early[1], env.event_time_ms, True)
        elif kind == "job.pending" and p.job_id in self._waiting:
            since, tier, _ = self._waiting[p.job_id]
            self._waiting[p.job_id] = (since, tier, False)
        elif kind in ("job.stopped", "job.interrupted") and p.job_id in self._tiers:
            self._waiting[p.job_id] = (env.event_time_ms, self._tiers[p.job_id], False)
        elif kind == "job.rejected":
            self.rejections.labels(p.code).inc()
            self._waiting.pop(p.job_id, None)
        elif kind in ("job.completed", "job.failed", "job.cancelled"):
            self._waiting.pop(p.job_id, None)
            if (early := self._placed_early.pop(p.job_id, None)) is not None:  # its request never came here
                self._placed(p.job_id, "", early[0], early[1], None, False)
            self._tiers.pop(p.job_id, None)
        if kind == "job.interrupted":
            self.interruptions.labels(p.code).inc()
        elif kind == "service.scaled":
            self.elastic.labels(p.action).inc()

    def command(self, env: Envelope, produced_ms: int, gpu_model: str = "") -> None:
        """A scheduler command as the node fold reads it; `produced_ms`: the record's timestamp (its produce time)."""
        p, kind = env.payload, env.kind
        if not self._seen.first(p.command_id):
            return
        if kind == "cmd.place":
            if getattr(p, "gang_index", 0):
                return  # one placement per job: the other parts of a gang are the same decision
            if p.job_id not in self._waiting and p.job_id not in self._tiers:
                self._placed_early[p.job_id] = (produced_ms, gpu_model)
                while len(self._placed_early) > EARLY_PLACEMENTS:  # requests that will not come (a restart)
                    job, (at, model) = self._placed_early.popitem(last=False)
                    self._placed(job, "", at, model, None, False)
                return
            since, tier, first = self._waiting.pop(p.job_id, (None, "", False))
            self._placed(p.job_id, tier or self._tiers.get(p.job_id, ""), produced_ms, gpu_model, since, first)
        elif kind == "cmd.preempt":
            self.preemptions.labels(_reason(env)).inc()
        elif kind == "cmd.migrate":
            self.migrations.labels(_reason(env)).inc()
        elif kind == "cmd.resize":
            self.resizes.labels(_reason(env)).inc()

    def _placed(self, job: str, tier: str, produced_ms: int, gpu_model: str, since: int | None, first: bool) -> None:
        self._tiers[job] = tier
        self.placements.labels(tier or "unknown", gpu_model or "unknown").inc()
        if since is not None:
            wait = max(0, produced_ms - since) / 1000
            self.queue_wait.labels(tier or "unknown").observe(wait)
            if first:
                self.decision_latency.labels(tier or "unknown").observe(wait)

    def ledger_fact(self, env: Envelope) -> None:
        p = env.payload
        if getattr(p, "project", None) is not None:
            return  # the tenant level only; projects are in /api/quota
        row = self.ledger.setdefault(p.tenant, {"quota": 0, "used": 0, "reserved": 0, "borrowed": 0})
        if env.kind == "quota.set":
            row["quota"] = p.gpu_milli
        elif env.kind == "quota.changed":
            row.update(used=p.used_milli, reserved=p.reserved_milli, borrowed=p.borrowed_milli)

    def waiting(self) -> dict[str, tuple[int, str, bool]]:
        return self._waiting


def _gauge(name: str, doc: str, labels: Iterable[str] = ()) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, labels=list(labels))


def fleet_families(views: list[NodeView]) -> list[GaugeMetricFamily]:
    """Capacity, allocation and free GPUs by card model and data center; nodes by state; cards by health."""
    from streams.edge.api import node_state

    cap = _gauge("gpupool_gpu_capacity", "GPUs in the pool (healthy or not), by card model and data center",
                 ["gpu_model", "datacenter"])
    alloc = _gauge("gpupool_gpu_allocated", "GPUs held by jobs (a MIG card: outside its free instances), by card "
                   "model and data center", ["gpu_model", "datacenter"])
    free = _gauge("gpupool_gpu_free", "GPUs free on healthy cards of schedulable nodes, by card model and data "
                  "center", ["gpu_model", "datacenter"])
    nodes = _gauge("gpupool_nodes", "Nodes by state (ready, cordoned, draining, down, not-admitted, no-inventory, "
                   "removed)", ["state"])
    cards = _gauge("gpupool_cards", "Cards by health", ["health"])
    node_st = _gauge("gpupool_node_state", "1 for each node, labelled with its state (ready, cordoned, draining, "
                     "down, not-admitted, no-inventory, removed): the node a `down` alert names", ["node", "state"])
    card_ok = _gauge("gpupool_card_healthy", "1 for a card in service, 0 for one out of service (a fatal XID or "
                     "uncorrected ECC errors, until an operator clears it), by node, card and card model",
                     ["node", "gpu", "gpu_model"])
    totals: dict[tuple[str, str], list[int]] = {}
    states: dict[str, int] = {}
    healthy = unhealthy = 0
    for v in views:
        st = node_state(v)
        states[st] = states.get(st, 0) + 1
        node_st.add_metric([v.node, st], 1)
        if v.inventory is None or v.removed:
            continue  # a removed node's cards left the pool (cluster_metrics.metrics alike)
        dc = v.inventory.datacenter
        for c in v.card_free():
            t = totals.setdefault((c.model, dc), [0, 0, 0])
            t[0] += 1000
            t[1] += 1000 - c.milli
            if c.healthy and v.schedulable:
                t[2] += c.milli
            healthy += c.healthy
            unhealthy += not c.healthy
            card_ok.add_metric([v.node, c.uuid, c.model], 1 if c.healthy else 0)
    for (m, dc), (c, a, f) in sorted(totals.items()):
        cap.add_metric([m, dc], c / 1000)
        alloc.add_metric([m, dc], a / 1000)
        free.add_metric([m, dc], f / 1000)
    for st in NODE_STATES:
        nodes.add_metric([st], states.get(st, 0))
    cards.add_metric(["healthy"], healthy)
    cards.add_metric(["unhealthy"], unhealthy)
    return [cap, alloc, free, nodes, cards, node_st, card_ok]


class _Scraped:
    """Gauges computed at scrape time from the worker's memory."""

    def __init__(self, m: WorkerMetrics):
        self.m = m

    def describe(self):
        return []

    def collect(self):
        m, src = self.m, self.m._sources
        if "nodes" in src:
            yield from fleet_families(src["nodes"]())
        if "cluster" in src:
            doc = src["cluster"]()
            g = _gauge("gpupool_fragmented_gpus", "Free GPUs the workload's typical jobs could not use (FGD), by card "
                       "model and data center", ["gpu_model", "datacenter"])
            for model, by_dc in sorted(doc["fragmentation_milli_by_model_datacenter"].items()):
                for dc, milli in sorted(by_dc.items()):
                    g.add_metric([model, dc], milli / 1000)
            yield g
            g = _gauge("gpupool_allocation_ratio", "Allocated over capacity, the whole pool")
            g.add_metric([], doc["allocation_permille"] / 1000)
            yield g
            g = _gauge("gpupool_fragmentation_ratio", "Fragmented over free GPUs, the whole pool")
            g.add_metric([], doc["fragmentation_permille"] / 1000)
            yield g
        if "queue" in src:
            now_ms, pending = src["queue"]()
            n = _gauge("gpupool_queue_length", "Jobs waiting to be placed, by tier", ["tier"])
            oldest = _gauge("gpupool_queue_oldest_wait_seconds", "How long the longest-waiting job of a tier has waited",
                            ["tier"])
            by: dict[str, list[int]] = {t: [] for t in TIERS}
            for tier, since in pending:
                by.setdefault(tier, []).append(since)
            for tier, sinces in sorted(by.items()):
                n.add_metric([tier], len(sinces))
                oldest.add_metric([tier], max(0, now_ms - min(sinces)) / 1000 if sinces else 0)
            yield n
            yield oldest
        fams = {k: _gauge(f"gpupool_tenant_{k}_compute_units", doc, ["tenant"]) for k, doc in (
            ("quota", "The tenant's quota, in compute units (1 = one A100's dense throughput)"),
            ("used", "Compute units the tenant's placements hold (reserved holds included)"),
            ("reserved", "Of used, what the tenant's reservations hold idle"),
            ("borrowed", "Of used, what is beyond the tenant's quota (borrowed, preemptible)"))}
        for tenant, row in sorted(m.ledger.items()):
            for k, fam in fams.items():
                fam.add_metric([tenant], row[k] / 1000)
        yield from fams.values()
        lag = _gauge("gpupool_consumer_lag_records", "Records not yet consumed (end offset minus committed), by "
                     "consumer group and topic", ["group", "topic"])
        for (group, topic), n in sorted(m.lag.items()):
            lag.add_metric([group, topic], n)
        yield lag
        if "sink" in src and (s := src["sink"]()) is not None:
            c = CounterMetricFamily("gpupool_sink_rows", "Rows the sink wrote to ClickHouse")
            c.add_metric([], s["inserted_rows"])
            yield c
            c = CounterMetricFamily("gpupool_sink_retries", "ClickHouse inserts the sink retried")
            c.add_metric([], s["retries"])
            yield c
            g = _gauge("gpupool_sink_position", "The next offset the sink will write, by topic and partition",
                       ["topic", "partition"])
            for key, off in sorted(s["positions"].items()):
                topic, _, part = key.rpartition("/")
                g.add_metric([topic, part], off)
            yield g
        if "scheduler" in src and (s := src["scheduler"]()) is not None:
            g = _gauge("gpupool_scheduler_input_position", "The scheduler's position on its input topic")
            g.add_metric([], s["position"])
            yield g
            g = _gauge("gpupool_scheduler_live", "1 when this worker's scheduler decides (owns its input), else 0")
            g.add_metric([], 1 if s["live"] else 0)
            yield g


async def consumer_lag(admin, consumer, groups: Iterable[str]) -> dict[tuple[str, str], int]:
    """Per group and topic: the end offsets less the group's committed offsets, summed over partitions."""
    out: dict[tuple[str, str], int] = {}
    for group in groups:
        committed = await admin.list_consumer_group_offsets(group)
        tps = [tp for tp, meta in committed.items() if meta is not None and meta.offset >= 0]
        if not tps:
            continue
        ends = await consumer.end_offsets(tps)
        for tp in tps:
            out[(group, tp.topic)] = out.get((group, tp.topic), 0) + max(0, ends[tp] - committed[tp].offset)
    return out
