"""The Faust worker: live folds into changelog-backed tables, the feed of the scheduler's input, the scheduler agent,
the ClickHouse sink and a small query API. Everything that decides anything is in the pure modules it calls."""
from __future__ import annotations

import time
from collections import Counter

import faust
from faust.web import View

from infra.config import Config
from schemas.envelope import DecodeError, Envelope, decode, encode, envelope
from schemas.events import GpuHealth, NodeLiveness, SchedulerTick
from schemas.routing import route
from schemas.topics import (
    COMMANDS, DEAD_LETTERS, INVENTORY, JOB_EVENTS, JOB_REQUESTS, JOB_VIEW_CHANGELOG, LEDGER, NODE_VIEW_CHANGELOG,
    SCHEDULER_INPUT, TELEMETRY,
)
from streams import cluster_metrics, codec, job_view, node_view

# What the scheduler must see, in one total order. Telemetry itself stays out: only the health and liveness
# transitions the folds derive from it go in, so the audit log stays small and the scheduler stays fast.
NODE_FACTS_FOR_SCHEDULER = frozenset({"node.inventory", "node.cordon", "gpu.health", "node.liveness"})
JOB_FACTS_FOR_SCHEDULER = frozenset({
    "job.requested", "job.cancelled", "job.scale_requested", "job.started", "job.completed", "job.failed",
    "job.stopped", "job.checkpointed",
})
LEDGER_FACTS_FOR_SCHEDULER = frozenset({"quota.set"})
# Requests on the job-request topic that name a reservation or a service rather than a job: no job view to fold,
# straight to the scheduler.
SCHEDULER_REQUESTS = frozenset({
    "reservation.requested", "reservation.cancelled", "service.declared", "service.removed", "inference.load",
})

HEARTBEAT_INTERVAL_S = 1.0
TICK_INTERVAL_S = 1.0


def _as_view(mod, value):
    """Table values are views; after a recovery from the changelog Faust hands them back as decoded JSON."""
    if isinstance(value, dict):
        return codec.load_view(codec.NODE_VIEW if mod is node_view else codec.JOB_VIEW, value)
    return value


def node_key(env: Envelope) -> str:
    return getattr(env.payload, "node", None) or env.payload.to_node


def now_ms() -> int:
    return time.time_ns() // 1_000_000


class Worker:
    """Holds the app and the in-process counters the query API reports."""

    def __init__(self, cfg: Config, *, with_scheduler: bool = True, with_sink: bool = True,
                 app_id: str = "gpupool"):
        self.cfg = cfg
        self.dead_letters: Counter[str] = Counter()
        self.folded: Counter[str] = Counter()
        self.app = faust.App(
            app_id, broker=f"kafka://{cfg.bootstrap}", store="memory://", datadir=str(cfg.home / "faust"),
            web_port=cfg.web_port, web_host="127.0.0.1", web_in_thread=False, topic_partitions=8,
            table_standby_replicas=0, producer_acks=-1,
            broker_commit_every=500, broker_commit_interval=0.5, stream_buffer_maxsize=16384,
            consumer_auto_offset_reset="earliest",
        )
        # Changelog-backed tables of serialized views (orjson on the changelog, like every other wire).
        self.node_table = self.app.Table("node-view", default=None, partitions=NODE_VIEW_CHANGELOG.partitions)
        self.job_table = self.app.Table("job-view", default=None, partitions=JOB_VIEW_CHANGELOG.partitions)
        # read lazily when the changelog topic and store are made
        self.node_table.value_serializer = "node-view"
        self.job_table.value_serializer = "job-view"
        raw = dict(key_serializer="raw", value_serializer="raw")
        self.node_topics = self.app.topic(INVENTORY.name, TELEMETRY.name, COMMANDS.name, **raw)
        self.job_topics = self.app.topic(JOB_REQUESTS.name, JOB_EVENTS.name, **raw)
        self.ledger_topic = self.app.topic(LEDGER.name, **raw)
        self.scheduler_input = self.app.topic(SCHEDULER_INPUT.name, **raw)
        self.dead_letter_topic = self.app.topic(DEAD_LETTERS.name, **raw)
        self.home_topics = {s.name: self.app.topic(s.name, **raw) for s in (INVENTORY, TELEMETRY, JOB_EVENTS)}
        self.app.agent(self.node_topics, name="fold-nodes")(self.fold_nodes)
        self.app.agent(self.job_topics, name="fold-jobs")(self.fold_jobs)
        self.app.agent(self.ledger_topic, name="feed-ledger")(self.feed_ledger)
        self.app.timer(HEARTBEAT_INTERVAL_S)(self.check_liveness)
        self.app.timer(TICK_INTERVAL_S, on_leader=True)(self.tick)
        self.scheduler = self.sink = None
        if with_scheduler:
            from agents.scheduler.agent import SchedulerAgent
            self.scheduler = SchedulerAgent(cfg)
            self.app.task(self.scheduler.run)
        if with_sink:
            from streams.sink import Sink
            self.sink = Sink(cfg)
            self.app.task(self.sink.run)
        self._register_pages()

    # ---------------------------------------------------------------- ingest

    async def _reject(self, event, code: str, detail: str) -> None:
        m = event.message
        self.dead_letters[code] += 1
        await self.dead_letter_topic.send(
            key=m.topic.encode(), value=codec.dead_letter(code, detail, m.topic, m.partition, m.offset, event.value))

    async def _decode(self, event) -> Envelope | None:
        try:
            return decode(event.value)
        except DecodeError as exc:
            await self._reject(event, exc.code, exc.detail)
            return None

    async def _fold(self, event, table, mod, key_of, env: Envelope | None = None):
        """Decode (unless already decoded), fold, store. Returns (envelope, before, after) or None when nothing changed
        or the record was bad; a record that breaks the fold is dead-lettered, never allowed to crash the agent."""
        env = env or await self._decode(event)
        if env is None:
            return None
        try:
            key = key_of(env)
            before = _as_view(mod, table.get(key))
            after = mod.evolve(before, env)
        except Exception as exc:  # noqa: BLE001 - bad input must not stop the fold of what follows
            await self._reject(event, "fold_error", f"{type(exc).__name__}: {exc}")
            return None
        if after is before:
            return None
        table[key] = after
        self.folded[env.kind] += 1
        return env, before, after

    async def _send(self, env: Envelope) -> None:
        spec, key = route(env)
        await self.home_topics[spec.name].send(key=key, value=encode(env))

    async def fold_nodes(self, stream):
        async for event in stream.events():
            folded = await self._fold(event, self.node_table, node_view, node_key)
            if folded is None:
                continue
            env, before, after = folded
            key = after.node
            if env.kind in NODE_FACTS_FOR_SCHEDULER:
                await self.scheduler_input.send(key=env.source.encode(), value=event.value)
            for gpu, why in sorted(after.unhealthy.items()):
                if before is None or gpu not in before.unhealthy:
                    # A card leaves service on the sample that showed the error; the derived fact reaches the
                    # scheduler through the same path as any other.
                    await self._send(envelope(GpuHealth(node=key, gpu_uuid=gpu, healthy=False, reason=why),
                                              source=f"{key}/health", seq=env.seq, time_ms=env.event_time_ms,
                                              causation_id=env.event_id))
            if before is not None and not before.alive and after.alive and env.kind != "node.liveness":
                await self._send(envelope(NodeLiveness(node=key, alive=True,
                                                       last_heartbeat_ms=after.last_heartbeat_ms),
                                          source=f"{key}/liveness", seq=env.event_time_ms,
                                          time_ms=env.event_time_ms, causation_id=env.event_id))

    async def fold_jobs(self, stream):
        async for event in stream.events():
            env = await self._decode(event)
            if env is None:
                continue
            if not hasattr(env.payload, "job_id"):
                if env.kind in SCHEDULER_REQUESTS:
                    self.folded[env.kind] += 1
                    await self.scheduler_input.send(key=env.source.encode(), value=event.value)
                continue
            folded = await self._fold(event, self.job_table, job_view, lambda e: e.payload.job_id, env)
            if folded is None:
                continue
            env = folded[0]
            if env.kind in JOB_FACTS_FOR_SCHEDULER:
                await self.scheduler_input.send(key=env.source.encode(), value=event.value)

    async def feed_ledger(self, stream):
        async for event in stream.events():
            env = await self._decode(event)
            if env is not None and env.kind in LEDGER_FACTS_FOR_SCHEDULER:
                self.folded[env.kind] += 1
                await self.scheduler_input.send(key=env.source.encode(), value=event.value)

    # ---------------------------------------------------------------- time enters as events

    async def check_liveness(self):
        t = now_ms()
        for key, view in list(self.node_table.items()):
            view = _as_view(node_view, view)
            if view and view.alive and node_view.missed_heartbeats(view, t, int(HEARTBEAT_INTERVAL_S * 1000)):
                await self._send(envelope(NodeLiveness(node=key, alive=False,
                                                       last_heartbeat_ms=view.last_heartbeat_ms),
                                          source=f"{key}/liveness", seq=t, time_ms=t))

    async def tick(self):
        t = now_ms()
        await self.scheduler_input.send(key=b"ticker", value=encode(
            envelope(SchedulerTick(now_ms=t), source="ticker", seq=t, time_ms=t)))

    # ---------------------------------------------------------------- query API (the process that owns chdb answers)

    def _register_pages(self) -> None:
        worker = self

        class Query(View):
            async def post(self, request):
                return await worker.query_page(self, request)

        class Stats(View):
            async def get(self, request):
                return await worker.stats_page(self, request)

        class Cluster(View):
            async def get(self, request):
                return self.json(worker.cluster())

        self.app.page("/query/")(Query)
        self.app.page("/stats/")(Stats)
        self.app.page("/cluster/")(Cluster)

    async def query_page(self, web, request):
        body = await request.json()
        sql = str(body.get("sql", "")).strip()
        if not sql.split(None, 1) or sql.split(None, 1)[0].upper() not in {"SELECT", "WITH", "SHOW", "DESCRIBE"}:
            return web.json({"error": "read-only queries only"}, status=400)
        if self.sink is None or self.sink.client is None:
            return web.json({"error": "ClickHouse not ready"}, status=503)
        try:
            result = self.sink.client.query(sql, parameters=body.get("parameters") or None)
        except Exception as exc:  # noqa: BLE001 - a bad query must not hurt the worker
            return web.json({"error": str(exc)[:2000]}, status=400)
        rows = [[v if isinstance(v, (int, float, str, bool, type(None))) else str(v) for v in r]
                for r in result.result_rows]
        return web.json({"columns": list(result.column_names), "rows": rows})

    def cluster(self) -> dict:
        """The materialized view's metrics over this worker's table partitions (all of them with one worker)."""
        views = [_as_view(node_view, v) for _, v in list(self.node_table.items())]
        jobs = [_as_view(job_view, v) for _, v in list(self.job_table.items())]
        requests = [v.request for v in jobs if v is not None and v.request is not None]
        out = cluster_metrics.metrics([v for v in views if v], cluster_metrics.typical_from_requests(requests))
        out["busy_cards"] = {c.uuid: c.release_ms for v in views if v for c in v.card_free() if c.milli < 1000}
        return out

    async def stats_page(self, web, request):
        return web.json({
            "dead_letters": dict(self.dead_letters), "folded": dict(self.folded),
            "scheduler": self.scheduler.stats() if self.scheduler else None,
            "sink": self.sink.stats() if self.sink else None,
        })

