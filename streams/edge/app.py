"""The Faust worker: the gateway for people's requests, live folds into changelog-backed tables, the feed of the
scheduler's input, the scheduler agent, the ClickHouse sink and the HTTP API. Everything that decides anything is in
the pure modules it calls. It connects as the `service` principal (docs/security.md)."""
from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter

import faust
from faust.web import View

from agents.scheduler.core import grace_map
from infra.config import Config
from infra.kafka_client import CheckedProducer, commit_or_reread, partition_of, rewind, stop_consumer
from infra.security import SERVICE, KafkaConn, kafka_conn
from schemas.envelope import MAX_RECORD_BYTES, DecodeError, Envelope, decode, encode, envelope
from schemas.events import GpuHealth, NodeLiveness, PoolMinute, SchedulerTick
from schemas.routing import at_home, route
from schemas.topics import replication
from schemas.topics import (
    CLOCK, COMMANDS, DEAD_LETTERS, DECISIONS, INBOX_PREFIX, INVENTORY, JOB_EVENTS, JOB_REQUESTS, JOB_VIEW_CHANGELOG, LEDGER,
    NODE_CHANNEL_PREFIX, NODE_CONTROL, NODE_VIEW_CHANGELOG, PRINCIPALS, SCHEDULER_INPUT, TELEMETRY, TELEMETRY_MINUTES,
    channel_owner, inbox_owner,
)
from streams.edge import api, codec, metrics, ui
from streams.folds import cluster_metrics, gateway, job_view, node_relay, node_view, telemetry_history
from streams.folds.liveness import Liveness, alive_again, forward_to_scheduler, liveness_source
from streams.edge.telemetry import TelemetryFold

log = logging.getLogger("gpupool.worker")

# What the scheduler must see, in one total order. Telemetry itself stays out: only the health and liveness
# transitions the folds derive from it go in, so the audit log stays small and the scheduler stays fast.
NODE_FACTS_FOR_SCHEDULER = frozenset({"node.inventory", "node.cordon", "gpu.health", "node.liveness", "node.removed",
                                      "node.admitted"})
JOB_FACTS_FOR_SCHEDULER = frozenset({
    "job.requested", "job.cancelled", "job.scale_requested", "job.started", "job.completed", "job.failed",
    "job.stopped", "job.checkpointed",
})
LEDGER_FACTS_FOR_SCHEDULER = frozenset({"quota.set"})
# A node's reports about its serving replicas (ready, unready, metrics: docs/serving.md), relayed to the job-events
# topic: the autoscaler reads them (readiness, and the load it folds from the scrapes); no job view folds them.
REPLICA_KINDS = frozenset({"replica.ready", "replica.unready", "replica.metrics"})
# Requests on the job-request topic that name a reservation or a service rather than a job: no job view to fold,
# straight to the scheduler.
SCHEDULER_REQUESTS = frozenset({
    "reservation.requested", "reservation.cancelled", "service.declared", "service.removed", "inference.load",
})
# What the gateway admits and the scheduler reads goes from the gateway to the scheduler's input at once, beside
# its home topic (not through a fold: a hop less on the way from request to placement, issue #16). Every record of
# a gateway source takes that one way, so the per-source order the scheduler's sequence check relies on holds.
GATEWAY_TO_SCHEDULER = JOB_FACTS_FOR_SCHEDULER | LEDGER_FACTS_FOR_SCHEDULER | SCHEDULER_REQUESTS


def forwarded_by_fold(env: Envelope, kinds: frozenset[str]) -> bool:
    """Whether a fold forwards this fact to the scheduler's input: a kind the scheduler reads, not written by the
    gateway (which sent it there itself)."""
    return env.kind in kinds and not env.source.startswith(gateway.SOURCE_PREFIX)

HEARTBEAT_INTERVAL_S = 1.0
TICK_INTERVAL_S = 1.0
LAG_INTERVAL_S = 15.0  # how often the consumer groups' lag is measured for /metrics
GATEWAY_GROUP = "gpupool-gateway"
NODE_RELAY_GROUP = "gpupool-node-relay"
LAG_GROUPS = ("gpupool", "gpupool-scheduler", "gpupool-sink", GATEWAY_GROUP, NODE_RELAY_GROUP)
FAIR_TURN = 8  # records an inbox hands the gateway before the next inbox of the batch takes its turn
GATEWAY_YIELD_EVERY = 64  # records the gateway decides before it lets the rest of the loop run


def fair_turns(batches: dict, turn: int):
    """(partition, record) of a batch, the partitions taking turns of `turn` records (in topic order), each
    partition's records in their own order."""
    queues = [(tp, msgs) for tp, msgs in sorted(batches.items(), key=lambda kv: (kv[0].topic, kv[0].partition))]
    at = 0
    while queues:
        for tp, msgs in queues:
            for msg in msgs[at:at + turn]:
                yield tp, msg
        at += turn
        queues = [(tp, msgs) for tp, msgs in queues if len(msgs) > at]


def _as_view(mod, value):
    """Table values are views; after a recovery from the changelog Faust hands them back as decoded JSON."""
    if isinstance(value, dict):
        return codec.load_view(codec.NODE_VIEW if mod is node_view else codec.JOB_VIEW, value)
    return value


def node_key(env: Envelope) -> str:
    return getattr(env.payload, "node", None) or env.payload.to_node


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def _tp(topic: str, partition: int):
    from aiokafka import TopicPartition

    return TopicPartition(topic, partition)


class Worker:
    """Holds the app and the in-process counters the API reports."""

    def __init__(self, cfg: Config, *, with_scheduler: bool = True, with_sink: bool = True,
                 app_id: str = "gpupool", name: str = "worker", brokers: int = 1):
        self.cfg = cfg
        self.name = name
        self._grace = grace_map(cfg.grace_s)  # every tier's grace period, as each tick carries it
        self.conn = kafka_conn(cfg, SERVICE)
        self.dead_letters: Counter[str] = Counter()
        self.folded: Counter[str] = Counter()
        self.gateway_counts: Counter[str] = Counter()
        self.relay_counts: Counter[str] = Counter()  # the node relay: relayed, refused:CODE
        self.registry: dict[str, gateway.Principal] = {}
        self.auth_throttle = api.AuthThrottle()
        self.rate_limit = gateway.RateLimit(window_ms=cfg.rate_window_ms, per_window=cfg.rate_per_window)
        self._windows: dict = {}  # inbox partition -> (rate window, its first offset, the last offset read here)
        self.app = faust.App(
            app_id, broker=f"kafka://{cfg.bootstrap}", broker_credentials=self.conn.faust_credentials(),
            store="memory://", datadir=str(cfg.home / ("faust" if name == "worker" else f"faust-{name}")),
            # Faust's own topics (the assignor's leader topic) replicated as ours are (schemas/topics.replication)
            topic_replication_factor=replication(brokers).factor,
            web_port=cfg.web_port, web_host="127.0.0.1", web_bind=cfg.web_bind, web_in_thread=False,
            topic_partitions=8, table_standby_replicas=0, producer_acks=-1,
            broker_commit_every=500, broker_commit_interval=0.5, stream_buffer_maxsize=16384,
            broker_session_timeout=10.0, broker_heartbeat_interval=3.0,  # a killed worker is replaced in ~10 s
            consumer_auto_offset_reset="earliest",
        )
        # Changelog-backed tables of serialized views (orjson on the changelog, like every other wire).
        self.node_table = self.app.Table("node-view", default=None, partitions=NODE_VIEW_CHANGELOG.partitions)
        self.job_table = self.app.Table("job-view", default=None, partitions=JOB_VIEW_CHANGELOG.partitions)
        # read lazily when the changelog topic and store are made
        self.node_table.value_serializer = "node-view"
        self.job_table.value_serializer = "job-view"
        raw = dict(key_serializer="raw", value_serializer="raw")
        # telemetry is folded in batches by its own task (streams/edge/telemetry.py), on the same table partitions
        self.node_topics = self.app.topic(INVENTORY.name, COMMANDS.name, NODE_CONTROL.name, **raw)
        self.job_topics = self.app.topic(JOB_REQUESTS.name, JOB_EVENTS.name, DECISIONS.name, **raw)
        self.ledger_topic = self.app.topic(LEDGER.name, **raw)
        self.scheduler_input = self.app.topic(SCHEDULER_INPUT.name, **raw)
        self.dead_letter_topic = self.app.topic(DEAD_LETTERS.name, **raw)
        self.clock_topic = self.app.topic(CLOCK.name, **raw)
        self.liveness = Liveness(interval_ms=int(HEARTBEAT_INTERVAL_S * 1000))
        # how far, in log time, the node relay has carried the node channels into the node topics: the same reading
        # clock as the telemetry partitions' (Liveness.probed/folded/clock), kept per channel partition
        self.relayed = Liveness(interval_ms=int(HEARTBEAT_INTERVAL_S * 1000))
        self.relay_consumer = None
        self._declared_silent: dict[str, int] = {}  # node -> the last heartbeat its silence was declared after
        self.home_topics = {s.name: self.app.topic(s.name, **raw)
                            for s in (INVENTORY, TELEMETRY, JOB_EVENTS, NODE_CONTROL, JOB_REQUESTS, DECISIONS,
                                      LEDGER, TELEMETRY_MINUTES)}
        self.metrics = metrics.WorkerMetrics()
        # per card and minute, on the log's time of the telemetry records (streams/folds/telemetry_history.py)
        self.minutes = telemetry_history.TelemetryMinutes(job_info=self._job_info)
        self.app.agent(self.node_topics, name="fold-nodes")(self._each(self.fold_node))
        self.app.agent(self.job_topics, name="fold-jobs")(self._each(self.fold_job))
        self.app.agent(self.ledger_topic, name="feed-ledger")(self._each(self.feed_ledger_record))
        self.app.timer(HEARTBEAT_INTERVAL_S)(self.check_liveness)
        self.app.timer(TICK_INTERVAL_S, on_leader=True)(self.tick)
        self.app.timer(LAG_INTERVAL_S)(self.measure_lag)
        self.app.task(self.follow_registry)
        self.telemetry = TelemetryFold(self, self.minutes)
        self.app.task(self.telemetry.run)
        self.app.task(self.run_gateway)
        self.app.task(self.run_node_relay)
        self.placements = node_relay.Placements()
        self._auto_admitted: set[str] = set()
        self._registry_position = 0
        self.registry_ready = asyncio.Event()  # the registry was read to its end once: the API can authenticate
        self.scheduler = self.sink = None
        if with_scheduler:
            from streams.edge.scheduler_agent import SchedulerAgent
            self.scheduler = SchedulerAgent(cfg, self.conn)
            self.app.task(self.scheduler.run)
        if with_sink:
            from streams.edge.sink import Sink
            self.sink = Sink(cfg, self.conn)
            self.app.task(self.sink.run)
        # chDB: one process per data path, so only the worker with the sink answers from ClickHouse
        self.queries = api.QueryRunner(cfg.clickhouse if with_sink or not cfg.clickhouse.startswith("chdb://")
                                       else None, sql_timeout_s=cfg.sql_timeout_s)
        self.metrics.source("nodes", lambda: [v for _, v in self.own_views(self.node_table, TELEMETRY.partitions)])
        self.metrics.source("cluster", self.local_cluster)
        self.metrics.source("queue", self._queue)
        self.metrics.source("sink", lambda: self.sink.stats() if self.sink else None)
        self.metrics.source("scheduler", lambda: self.scheduler.stats() if self.scheduler else None)
        self._lag_clients = None
        self._pool_minute_ms = -1  # the minute of log time the pool was last measured in
        self._register_pages()

    # ---------------------------------------------------------------- who is who

    async def follow_registry(self) -> None:
        """The principals topic, folded from its start and followed: the gateway's and the API's view of who is who
        (a removed principal's token stops working as soon as the removal is read)."""
        from aiokafka import AIOKafkaConsumer, TopicPartition

        tp = TopicPartition(PRINCIPALS.name, 0)
        consumer = AIOKafkaConsumer(**self.conn.options(), enable_auto_commit=False, group_id=None)
        await consumer.start()
        try:
            consumer.assign([tp])
            await consumer.seek_to_beginning(tp)
            end = (await consumer.end_offsets([tp]))[tp]
            while True:
                if self._registry_position >= end:
                    self.registry_ready.set()
                for msg in (await consumer.getmany(tp, timeout_ms=500)).get(tp, []):
                    try:
                        env = decode(msg.value)
                    except DecodeError:
                        env = None
                    if env is not None and at_home(env, PRINCIPALS.name):
                        self.registry = gateway.fold_registry(self.registry, env)
                    self._registry_position = msg.offset + 1
        finally:
            await stop_consumer(consumer)

    async def _registry_caught_up(self, timeout_s: float = 10.0) -> None:
        from aiokafka import AIOKafkaConsumer, TopicPartition

        tp = TopicPartition(PRINCIPALS.name, 0)
        consumer = AIOKafkaConsumer(**self.conn.options(), enable_auto_commit=False, group_id=None)
        await consumer.start()
        try:
            end = (await consumer.end_offsets([tp]))[tp]
        finally:
            await stop_consumer(consumer)
        deadline = time.monotonic() + timeout_s
        while self._registry_position < end and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    # ---------------------------------------------------------------- the gateway: people's requests become facts

    async def run_gateway(self) -> None:
        """Every inbox (`gpupool.in.*`, found by pattern as principals are added), in order per inbox; outputs
        are produced before the inbox offset is committed, and a re-run re-derives identical envelopes (source
        `in/NAME`, seq = offset), which every consumer drops as duplicates."""
        from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

        await self._registry_caught_up()
        consumer = AIOKafkaConsumer(**self.conn.options(), group_id=GATEWAY_GROUP, enable_auto_commit=False,
                                    auto_offset_reset="earliest", metadata_max_age_ms=2000)
        # linger 0: a request on an idle stack goes on at once; the gateway flushes after each inbox's batch anyway
        producer = CheckedProducer(lambda: AIOKafkaProducer(**self.conn.options(), acks="all",
                                                            enable_idempotence=True, linger_ms=0), log)
        await consumer.start()
        await producer.start()
        consumer.subscribe(pattern=f"^{INBOX_PREFIX.replace('.', chr(92) + '.')}.+")
        try:
            while True:
                batches = await consumer.getmany(timeout_ms=500, max_records=1000)
                for tp in batches:
                    if inbox_owner(tp.topic) not in self.registry:  # added a moment ago: the registry may lag
                        await self._registry_caught_up()
                # Fair interleaving (Kubernetes' API Priority and Fairness queues each flow apart): the inboxes of a
                # batch take turns, FAIR_TURN records each, so one principal's burst goes out to the scheduler's
                # input interleaved with everyone else's requests instead of ahead of them.
                for i, (tp, msg) in enumerate(fair_turns(batches, FAIR_TURN), start=1):
                    await self._admit(producer, inbox_owner(tp.topic), msg,
                                      await self._window_first(consumer, tp, msg))
                    if i % GATEWAY_YIELD_EVERY == 0:
                        await asyncio.sleep(0)  # the scheduler, the folds and the API share the loop
                if batches:
                    if await producer.flush():
                        await commit_or_reread(consumer, {tp: msgs[-1].offset + 1 for tp, msgs in batches.items()},
                                               log)
                    else:  # not every answer was acknowledged: the batch again, never a request lost
                        for tp in batches:
                            self._windows.pop(tp, None)
                        await rewind(consumer, list(batches))
        finally:
            await stop_consumer(consumer)
            await producer.stop()

    async def _window_first(self, consumer, tp, msg) -> int | None:
        """The offset of the first record of `msg`'s rate window in its inbox (gateway.RateLimit): carried on from
        the record before it when that one was read here, else asked of the broker (the first offset at or after
        the window's start time). None when the broker cannot say: the record is then not counted."""
        window = msg.timestamp // self.rate_limit.window_ms
        known = self._windows.get(tp)
        if known is not None and known[0] == window and known[2] == msg.offset - 1:
            first = known[1]
        elif known is not None and known[0] < window and known[2] == msg.offset - 1:
            first = msg.offset  # the record after the last one of the window before: the first of its own
        else:
            try:
                found = await consumer.offsets_for_times({tp: window * self.rate_limit.window_ms})
                first = found[tp].offset if found.get(tp) is not None else msg.offset
            except Exception as exc:  # noqa: BLE001 - the broker could not say: not counted, never stopped
                log.warning("rate window of %s not known: %s", tp.topic, exc)
                self._windows.pop(tp, None)
                return None
        self._windows[tp] = (window, first, msg.offset)
        return first

    async def _admit(self, producer, owner: str, msg, window_first: int | None = None) -> None:
        """One inbox record, contained: whatever goes wrong with it (a bug the fuzz tests have not found, an answer
        the broker will not take) ends as a dead letter naming the record, and the gateway goes on with the next."""
        try:
            await self._admit_one(producer, owner, msg, window_first)
        except Exception as exc:  # noqa: BLE001 - one record must never stop the gateway for everyone
            log.exception("inbox record %s:%d dead-lettered", msg.topic, msg.offset)
            await self._gateway_dead_letter(producer, msg, "gateway_error", f"{type(exc).__name__}: {exc}")

    async def _gateway_dead_letter(self, producer, msg, code: str, detail: str) -> None:
        await self._set_aside(producer, msg, code, detail, self.gateway_counts, "dead_letter")

    async def _set_aside(self, producer, msg, code: str, detail: str, counts: Counter, prefix: str) -> None:
        """A record of an inbox or a node channel not taken: a dead letter with the reason (the record's topic,
        partition, offset and first bytes), counted for operators (/stats/, gpupool_dead_letters{reason})."""
        self.dead_letters[code] += 1
        self.metrics.dead_letters.labels(code).inc()
        counts[f"{prefix}:{code}"] += 1
        await producer.send(DEAD_LETTERS.name, key=msg.topic.encode(), value=codec.dead_letter(
            code, detail, msg.topic, msg.partition, msg.offset, msg.value))

    async def _admit_one(self, producer, owner: str, msg, window_first: int | None) -> None:
        out = gateway.admit(self.registry.get(owner), owner, msg.value, msg.offset, msg.timestamp, window_first,
                            self.rate_limit, self.cfg.volumes)
        if out.dead_letter is not None:
            await self._gateway_dead_letter(producer, msg, *out.dead_letter)
        for env, what in ((out.accepted, "accepted"), (out.rejected, "rejected")):
            if env is None:
                continue
            spec, key = route(env)
            value = encode(env)
            if len(value) > MAX_RECORD_BYTES:  # the request as a fact outgrew what every reader takes
                await self._gateway_dead_letter(producer, msg, "oversized", f"{what}: {len(value)} bytes")
                continue
            await producer.send(spec.name, key=key, value=value)
            if what == "accepted" and env.kind in GATEWAY_TO_SCHEDULER:
                # after its home topic (the same producer keeps the order): one Kafka hop less between a request
                # and its placement; the folds do not forward what the gateway wrote (forwarded_by_fold)
                await producer.send(SCHEDULER_INPUT.name, key=env.source.encode(), value=value)
            self.gateway_counts[what] += 1
            self.metrics.gateway.labels(what).inc()
            if what == "accepted" and abs(gateway.clock_skew_ms(env)) > self.cfg.max_skew_ms:
                self.gateway_counts["clock_skew"] += 1  # the log's time was used; the client's is kept as data

    # ---------------------------------------------------------------- the node relay: node reports become facts

    async def run_node_relay(self) -> None:
        """Every node principal's channel (`gpupool.node.*`, found by pattern as principals are added), in order per
        channel: each record checked by streams/folds/node_relay.py and relayed to its home topic, or dead-lettered.
        Outputs are produced before the channel offset is committed; a re-run relays the same bytes again, which the
        folds drop as duplicates (per-source sequence numbers)."""
        from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

        await self._registry_caught_up()
        consumer = AIOKafkaConsumer(**self.conn.options(), group_id=NODE_RELAY_GROUP, enable_auto_commit=False,
                                    auto_offset_reset="earliest", metadata_max_age_ms=2000)
        commands = AIOKafkaConsumer(**self.conn.options(), group_id=None, enable_auto_commit=False)
        producer = CheckedProducer(lambda: AIOKafkaProducer(**self.conn.options(), acks="all",
                                                            enable_idempotence=True, linger_ms=0), log)
        await consumer.start()
        await commands.start()
        await producer.start()
        commands.assign([_tp(COMMANDS.name, p) for p in range(COMMANDS.partitions)])
        await commands.seek_to_beginning()
        consumer.subscribe(pattern=f"^{NODE_CHANNEL_PREFIX.replace('.', chr(92) + '.')}.+")
        self.relay_consumer = consumer
        try:
            while True:
                batches = await consumer.getmany(timeout_ms=500, max_records=2000)
                await self._read_placements(commands, timeout_ms=0)
                for tp, msgs in sorted(batches.items(), key=lambda kv: kv[0].topic):
                    owner = channel_owner(tp.topic)
                    if owner not in self.registry:  # added a moment ago: the registry may lag its channel
                        await self._registry_caught_up()
                    for msg in msgs:
                        await self._relay_one(producer, commands, owner, msg)
                    if not await producer.flush():  # a report not acknowledged: the channel again from its commit
                        await rewind(consumer, [tp])
                        continue
                    for msg in msgs:  # the relay's clock (liveness) moves only over what was relayed for sure
                        self.relayed.folded(tp, msg.offset, msg.timestamp)
                    await commit_or_reread(consumer, {tp: msgs[-1].offset + 1}, log)
        finally:
            await stop_consumer(consumer)
            await stop_consumer(commands)
            await producer.stop()

    async def _relay_one(self, producer, commands, owner: str, msg) -> None:
        """One channel record, whatever happens: the broker away is waited out (the record is relayed once it is
        back, never dropped: a node's job.completed must not be lost to a broker restart); any other failure is
        that record's own dead letter (`relay_error`), and the relay goes on."""
        from aiokafka.errors import KafkaError

        while True:
            try:
                await self._relay(producer, commands, owner, msg)
                return
            except KafkaError as exc:
                log.warning("node relay: %s; %s:%d again in 1 s", exc, msg.topic, msg.offset)
                await asyncio.sleep(1.0)
            except Exception as exc:  # noqa: BLE001 - one record's failure stays that record's
                log.exception("node relay: %s:%d", msg.topic, msg.offset)
                await self._refuse(producer, owner, msg, "relay_error", f"{type(exc).__name__}: {exc}")
                return

    async def _read_placements(self, commands, timeout_ms: int = 0, until: dict | None = None) -> None:
        """Fold the commands read so far into the placements; with `until` (partition -> offset), read on until
        every partition reached it."""
        while True:
            for msgs in (await commands.getmany(timeout_ms=timeout_ms, max_records=5000)).values():
                for msg in msgs:
                    try:
                        env = decode(msg.value)
                    except DecodeError:
                        continue  # the node-view fold dead-letters it
                    self.placements.fold(env)
            if until is None:
                return
            positions = [await commands.position(tp) for tp in until]
            if all(pos >= end for pos, end in zip(positions, until.values())):
                return
            timeout_ms = 200

    async def _refuse(self, producer, owner: str, msg, code: str, detail: str) -> None:
        """A channel record not relayed: a dead letter with the reason, counted for operators (/stats/ relay,
        gpupool_dead_letters{reason}), and a log line naming the principal."""
        log.warning("node relay refused a record of %s (%s:%d): %s %s", owner, msg.topic, msg.offset, code, detail)
        await self._set_aside(producer, msg, code, detail, self.relay_counts, "refused")

    async def _relay(self, producer, commands, owner: str, msg) -> None:
        principal = self.registry.get(owner)
        verdict = node_relay.check(principal, owner, msg.value)
        if verdict.job_check is not None:
            job, node = verdict.job_check
            if not self.placements.placed(job, node):
                # the node read its command before it reported: the commands written until now must show it
                ends = await commands.end_offsets(list(commands.assignment()))
                await self._read_placements(commands, until=ends)
                if not self.placements.placed(job, node):
                    verdict = node_relay.Verdict(code="not_your_node",
                                                 detail=f"{owner}: job {job!r} was never placed on {node!r}")
        if verdict.env is None:
            await self._refuse(producer, owner, msg, verdict.code, verdict.detail)
            return
        env = verdict.env
        if env.kind == "node.inventory" and env.payload.node not in self._auto_admitted:
            admitted = node_relay.admission(principal, env, msg.timestamp)
            if admitted is not None:  # before the inventory: the node is never seen unadmitted for long
                spec, key = route(admitted)
                await producer.send(spec.name, key=key, value=encode(admitted))
                self._auto_admitted.add(env.payload.node)
        spec, key = route(env)
        await producer.send(spec.name, key=key, value=verdict.raw)
        self.relay_counts["relayed"] += 1
        if env.kind == "job.log":  # a program's output: how much the node's caps cut (docs/jobs.md, "Logs")
            self.metrics.job_log_pieces.inc()
            if env.payload.dropped_bytes:
                self.metrics.job_log_dropped.inc(env.payload.dropped_bytes)
                self.relay_counts["job_log_dropped_bytes"] += env.payload.dropped_bytes

    # ---------------------------------------------------------------- ingest

    def _each(self, handle):
        """A Faust agent that hands each record to `handle`, contained: an exception in one record's handling ends
        that record as a dead letter (`handler_error`) and the agent goes on with the next, so no record can stop
        a fold for everyone (an exception escaping an agent would stop the worker, and its restart would read the
        same record again)."""
        async def agent(stream):
            async for event in stream.events():
                try:
                    await handle(event)
                except Exception as exc:  # noqa: BLE001 - contained to this record
                    log.exception("record %s:%d dead-lettered", event.message.topic, event.message.offset)
                    await self._reject(event, "handler_error", f"{type(exc).__name__}: {exc}")
        agent.__name__ = agent.__qualname__ = handle.__name__
        return agent

    async def _reject(self, event, code: str, detail: str) -> None:
        await self.dead_letter(event.message, code, detail, event.value)

    async def dead_letter(self, m, code: str, detail: str, raw: bytes | None = None) -> None:
        """`m`: a Faust message or an aiokafka record (topic, partition, offset; `raw` defaults to its value)."""
        self.dead_letters[code] += 1
        self.metrics.dead_letters.labels(code).inc()
        await self.dead_letter_topic.send(key=m.topic.encode(), value=codec.dead_letter(
            code, detail, m.topic, m.partition, m.offset, m.value if raw is None else raw))

    def view_of(self, node: str):
        return _as_view(node_view, self.node_table.data.get(node))  # the store itself: no per-read sensors

    def node_partitions(self) -> frozenset[int]:
        """The node-view partitions Faust assigned to this worker (inventory is co-partitioned with the table)."""
        return frozenset(tp.partition for tp in self.app.consumer.assignment() if tp.topic == INVENTORY.name)

    def own_views(self, table, partitions_of: int) -> list:
        """This worker's views: with workers sharing the partitions, the memory store can still hold keys of a
        partition a rebalance took away."""
        mine = self.node_partitions() if table is self.node_table else frozenset(
            tp.partition for tp in self.app.consumer.assignment() if tp.topic == JOB_REQUESTS.name)
        mod = node_view if table is self.node_table else job_view
        return [(k, v) for k, v in ((k, _as_view(mod, v)) for k, v in list(table.items()))
                if v is not None and partition_of(k.encode(), partitions_of) in mine]

    async def _decode(self, event) -> Envelope | None:
        try:
            env = decode(event.value)
        except DecodeError as exc:
            await self._reject(event, exc.code, exc.detail)
            return None
        if not at_home(env, event.message.topic):
            # Each kind has one home topic, and each topic one writing role: a kind found elsewhere was written by
            # someone the ACLs did not let state it.
            await self._reject(event, "wrong_topic", f"{env.kind} does not belong on {event.message.topic}")
            return None
        return env

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

    async def send_view_changelog(self, partition: int, key: str, view):
        """A node view to the table's changelog from outside an agent (the telemetry task), handed to the producer
        now: `send_changelog` would queue it in Faust's producer buffer, which sends one message a turn of the event
        loop, behind the fold. Returns the future of the broker's acknowledgement."""
        t = self.node_table
        return await t.changelog_topic.send(key=key, value=view, partition=partition, key_serializer=t.key_serializer,
                                            value_serializer=t.value_serializer, callback=t._on_changelog_sent)

    async def send(self, env: Envelope) -> None:
        spec, key = route(env)
        await self.home_topics[spec.name].send(key=key, value=encode(env))

    async def fold_node(self, event) -> None:
        m = event.message
        decoded = await self._decode(event)
        folded = None if decoded is None else await self._fold(event, self.node_table, node_view, node_key,
                                                               decoded)
        if decoded is not None and m.topic == COMMANDS.name:
            self.metrics.command(decoded, round(m.timestamp * 1000), self._model_of(decoded))
        if folded is None:
            if decoded is not None and decoded.kind == "node.liveness":  # dropped as not newer: answered?
                view = self.view_of(decoded.payload.node)
                if view is not None and alive_again(view, view, decoded):
                    await self._alive_again(view, decoded, round(m.timestamp * 1000))
            return
        env, before, after = folded
        if env.kind in NODE_FACTS_FOR_SCHEDULER and forward_to_scheduler(env, after):
            # a "silent" the view already disproves (a newer heartbeat was folded before it was read back) stays
            # here: the scheduler's readiness is the view's (streams/folds/liveness.py)
            await self.scheduler_input.send(key=env.source.encode(), value=event.value)
        if alive_again(before, after, env):
            # alive again: an inventory from a node that was silent (a later position than the silence; its
            # silence counts from this record now, not from its last heartbeat before it went silent), or a
            # "silent" the view disproves, answered (streams/folds/liveness.py)
            log_ms = round(event.message.timestamp * 1000)
            if env.kind != "node.liveness":
                self.liveness.revived(after.node, partition_of(after.node.encode(), TELEMETRY.partitions), log_ms)
            await self._alive_again(after, env, log_ms)

    async def _alive_again(self, view, cause: Envelope, log_ms: int) -> None:
        """A `node.liveness` alive for `view`, numbered above the view's last liveness fact."""
        source = liveness_source(view.node)
        await self.send(envelope(NodeLiveness(node=view.node, alive=True, last_heartbeat_ms=view.last_heartbeat_ms),
                                 source=source, seq=self.liveness.next_seq(view.node, log_ms,
                                                                           view.applied.get(source, -1)),
                                 time_ms=cause.event_time_ms, causation_id=cause.event_id))

    async def fold_job(self, event) -> None:
        env = await self._decode(event)
        if env is None:
            return
        self.metrics.job_fact(env)
        if env.kind in REPLICA_KINDS:  # a node's word about a serving replica: the autoscaler's, no job view of it
            self.folded[env.kind] += 1
            await self.scheduler_input.send(key=env.source.encode(), value=event.value)
            return
        if not hasattr(env.payload, "job_id"):
            if env.kind in SCHEDULER_REQUESTS:
                self.folded[env.kind] += 1
                if forwarded_by_fold(env, SCHEDULER_REQUESTS):
                    await self.scheduler_input.send(key=env.source.encode(), value=event.value)
            return
        folded = await self._fold(event, self.job_table, job_view, lambda e: e.payload.job_id, env)
        if folded is None:
            return
        env = folded[0]
        if forwarded_by_fold(env, JOB_FACTS_FOR_SCHEDULER):
            await self.scheduler_input.send(key=env.source.encode(), value=event.value)

    async def feed_ledger_record(self, event) -> None:
        env = await self._decode(event)
        if env is not None and env.kind in ("quota.set", "quota.changed"):
            self.metrics.ledger_fact(env)
        if env is not None and env.kind in LEDGER_FACTS_FOR_SCHEDULER:
            self.folded[env.kind] += 1
            if forwarded_by_fold(env, LEDGER_FACTS_FOR_SCHEDULER):
                await self.scheduler_input.send(key=env.source.encode(), value=event.value)

    # ---------------------------------------------------------------- time enters as events

    async def _log_now(self) -> int:
        """The broker's time now: the append time of a record this worker writes to the clock topic."""
        fut = await self.clock_topic.send(key=self.app.conf.id.encode(), value=b"")
        return (await fut).timestamp

    async def _telemetry_ends(self) -> dict[int, int | None]:
        """How far each telemetry partition this worker owns goes, asked of the broker now (after the probe of the
        log's clock). Not the highwater of the telemetry task's last fetch: a worker that is busy or was paused
        fetched that seconds before the probe, and what came since is not silence (streams/folds/liveness.py)."""
        consumer = self.telemetry.consumer
        assigned = consumer.assignment() if consumer is not None else set()
        tps = [tp for p in sorted(self.telemetry.partitions) if (tp := _tp(TELEMETRY.name, p)) in assigned]
        if not tps:
            return {}
        ends = await consumer.end_offsets(tps)
        return {tp.partition: ends.get(tp) for tp in tps}

    async def _relay_clock(self, log_now: int) -> int | None:
        """How far, in log time, everything the nodes said on the channels this worker relays has reached the node
        topics: each channel partition read to the end the broker gives now (after the probe at `log_now`), or to
        its last record relayed. A node's heartbeat reaches the telemetry topic through the relay, so a relay that is
        paused or behind (a burst on the loop it shares) must not make the nodes look silent: the judge reads the
        log only up to this clock. None while a partition's position is not known yet (the relay starting)."""
        consumer = self.relay_consumer
        tps = sorted(consumer.assignment()) if consumer is not None else []
        if not tps:
            return log_now
        ends = await consumer.end_offsets(tps)
        clocks = []
        for tp in tps:
            if tp not in self.relayed.read and tp not in self.relayed.start:
                self.relayed.start[tp] = await consumer.position(tp)
            if ends.get(tp) is not None:
                self.relayed.probed(tp, ends[tp], log_now)
            clocks.append(self.relayed.clock(tp))
        return None if any(c is None for c in clocks) else min(clocks)

    async def check_liveness(self):
        """Judge silence on log time (streams/folds/liveness.py): no stall of this worker, of the broker or of a query
        makes a live node look dead. Each worker judges the nodes of the telemetry partitions it owns."""
        try:
            log_now = await self._log_now()
            relayed = await self._relay_clock(log_now)  # asked after the probe, before the telemetry's ends
            ends = await self._telemetry_ends()  # asked after the probe: records appended before it lie below
        except Exception as exc:  # noqa: BLE001 - the broker is away: no log time passes, nobody is judged
            log.warning("liveness not judged: %s", exc)
            return
        for p, end in ends.items():
            if end is not None:
                self.liveness.probed(p, end, log_now)
        clocks = {p: self.liveness.clock(p) for p in ends}

        def clock_of(node: str) -> int | None:  # how far the node's telemetry partition is read (its own if not ours)
            p = partition_of(node.encode(), TELEMETRY.partitions)
            return clocks.get(p) if p in clocks else log_now

        await self._emit_minutes(self.minutes.close_before(log_now, clock_of))  # minutes of nodes gone silent
        if self.app.is_leader():  # one pool minute for the whole pool, from the leader among several workers
            await self._pool_minute(log_now)
        if not self.telemetry.partitions:
            return
        alive = {key: view for key, view in self.own_views(self.node_table, TELEMETRY.partitions)
                 if view.alive and view.inventory is not None and self.telemetry.owns(key)}
        if relayed is None:
            return  # the relay is starting: what the nodes said is not all on the log's node topics yet
        limit = self.liveness.misses * self.liveness.interval_ms
        for key in self.liveness.silent(sorted(alive), log_now, ends):
            # and silent up to what the relay carried: every channel was relayed up to `relayed`, so a node heard
            # last at `t` (a relayed record's time, no earlier than the node said it) said nothing in (t, relayed);
            # a relay paused or behind (a burst on the loop it shares) is then never taken for the nodes' silence
            heard = self.liveness.heard.get(key)
            if relayed - (heard[1] if heard is not None else log_now - limit) <= limit:
                continue
            view = alive[key]
            if self._declared_silent.get(key) == view.last_heartbeat_ms:
                continue  # said already; the view turns silent when fold-nodes reads it back
            self._declared_silent[key] = view.last_heartbeat_ms
            source = liveness_source(key)
            await self.send(envelope(NodeLiveness(node=key, alive=False, last_heartbeat_ms=view.last_heartbeat_ms),
                                     source=source,
                                     seq=self.liveness.next_seq(key, log_now, view.applied.get(source, -1)),
                                     time_ms=log_now))

    # ---------------------------------------------------------------- observability (docs/observability.md)

    def _job_info(self, job_id: str) -> tuple[str, str]:
        view = _as_view(job_view, self.job_table.data.get(job_id))  # the store itself: no per-read sensors
        tier = view.request.tier.value if view is not None and view.request is not None else ""
        return telemetry_history.tenant_of(job_id), tier

    def _model_of(self, env: Envelope) -> str:
        assignments = getattr(env.payload, "assignments", ())
        view = _as_view(node_view, self.node_table.get(node_key(env))) if assignments else None
        if view is None:
            return ""
        return next((g.model for g in view.cards() if g.uuid == assignments[0].gpu_uuid), "")

    async def _emit_minutes(self, minutes) -> None:
        for tm in minutes:
            if tm.cards:
                await self.send(envelope(tm, source=f"{tm.node}/telemetry-minutes", seq=tm.minute_ms,
                                          time_ms=tm.minute_ms + self.minutes.minute_ms))
                self.metrics.telemetry_minutes.inc()

    async def _pool_minute(self, log_now: int) -> None:
        """At the first liveness check of each minute of log time: the pool as it stands, as the last minute's."""
        minute = self.minutes.minute_of(log_now)
        if minute == self._pool_minute_ms:
            return
        first, self._pool_minute_ms = self._pool_minute_ms < 0, minute
        if first:
            return  # started mid-minute: nothing was measured for the minute that ended
        views, _, _ = await self.all_views()
        doc = await self.cluster(views)
        by_cap: Counter[str] = Counter()
        by_alloc: Counter[str] = Counter()
        for v in views:
            for c in v.card_free():
                by_cap[c.model] += 1000
                by_alloc[c.model] += 1000 - c.milli
        t, pending = self._queue()
        queue: Counter[str] = Counter(tier for tier, _ in pending)
        oldest: dict[str, int] = {}
        for tier, since in pending:
            oldest[tier] = max(oldest.get(tier, 0), t - since)
        pm = PoolMinute(worker=self.app.conf.id, minute_ms=minute - self.minutes.minute_ms,
                        capacity_milli=doc["capacity_milli"], allocated_milli=doc["allocated_milli"],
                        free_milli=doc["free_milli"], fragmentation_milli=doc["fragmentation_milli"],
                        allocated_milli_by_model=dict(by_alloc), capacity_milli_by_model=dict(by_cap),
                        queue_by_tier=dict(queue), oldest_wait_ms_by_tier=oldest)
        await self.send(envelope(pm, source=f"{self.app.conf.id}/pool-minutes", seq=minute, time_ms=log_now))

    def _queue(self) -> tuple[int, list[tuple[str, int]]]:
        """(now, [(tier, waiting since)]): the scheduler's queue when it decides in this worker, else the jobs the
        job view holds as pending (placed but not yet started counts there too). Since: when it was (re)queued, as
        this worker saw it (now, for jobs queued before this worker started)."""
        waiting = self.metrics.waiting()
        t = now_ms()
        if self.scheduler is not None and self.scheduler.live:
            return t, [(r.request.tier.value, waiting.get(r.request.job_id, (t,))[0])
                       for r in self.scheduler.state.pending_order()]
        out = []
        for job, v in list(self.job_table.items()):
            v = _as_view(job_view, v)
            if v is not None and v.state == "pending" and v.request is not None:
                out.append((v.request.tier.value, waiting.get(job, (t,))[0]))
        return t, out

    async def measure_lag(self):
        from aiokafka import AIOKafkaConsumer
        from aiokafka.admin import AIOKafkaAdminClient

        try:
            if self._lag_clients is None:
                admin = AIOKafkaAdminClient(**self.conn.options())
                consumer = AIOKafkaConsumer(**self.conn.options(), enable_auto_commit=False, group_id=None)
                await admin.start()
                await consumer.start()
                self._lag_clients = (admin, consumer)
            self.metrics.lag = await metrics.consumer_lag(*self._lag_clients, LAG_GROUPS)
        except Exception as exc:  # noqa: BLE001 - the broker is away: the last figures stay
            log.warning("consumer lag not measured: %s", exc)

    async def tick(self):
        # The scheduler's clock is the broker's append time of this record, not `t`: the payload only says when
        # the ticker meant it.
        # Each tick carries the operator's grace periods (GPUPOOL_GRACE_S, every tier's: the default filled in), so
        # the scheduler and every replay of its input take them from the log (docs/jobs.md, "Stops and grace periods");
        # and the gangs' rendezvous port range (GPUPOOL_RENDEZVOUS_PORTS, docs/jobs.md "Gangs"), the same way.
        t = now_ms()
        await self.scheduler_input.send(key=b"ticker", value=encode(
            envelope(SchedulerTick(now_ms=t, grace_s=self._grace, rendezvous_ports=self.cfg.rendezvous_ports),
                     source="ticker", seq=t, time_ms=t)))

    # ---------------------------------------------------------------- HTTP API (streams/edge/api.py)

    def _register_pages(self) -> None:
        worker = self

        def view(path: str):
            class Page(View):
                async def get(self, request):
                    return await worker.serve(self, request, path)

                async def post(self, request):
                    return await worker.serve(self, request, path)
            return Page

        for path in api.ENDPOINTS:
            if path != "/ui/":
                self.app.page(path)(view(path))

        class ServiceEndpoints(View):  # /api/service/NAME/endpoints: /api/service/endpoints?service=NAME
            async def get(self, request, name: str = ""):
                return await worker.serve(self, request, "/api/service/endpoints", {"service": name})

        self.app.page("/api/service/{name:.+}/endpoints")(ServiceEndpoints)

        class Static(View):  # the dashboard's files: code, no data; every request they make carries a token
            async def get(self, request, name: str = ""):
                found = ui.asset(name or "index.html")
                if found is None:
                    return self.json({"error": "not found"}, status=404)
                body, ctype = found
                return self.bytes(body, headers={**dict(ui.HEADERS), "Content-Type": ctype})

        self.app.page("/ui/{name:.*}")(Static)

    async def serve(self, web, request, path: str, params: dict | None = None):
        if path == "/healthz":
            ready = (self.sink is None or self.sink.client is not None) and self.registry_ready.is_set()
            return web.json({"ok": ready}, status=200 if ready else 503)
        method = api.ENDPOINTS[path][0]
        if not self.registry_ready.is_set():
            return web.json({"error": "the worker is starting (reading who is who); try again"}, status=503)
        try:
            if request.method != method:
                raise api.ApiError(405, f"{path} takes {method}")
            header = request.headers.get("Authorization")
            principal = await self._authenticated(request, header)
            body = await api.read_body(request) if request.method == "POST" else b""
            if path == "/metrics":
                from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

                api.authorize(path, principal)
                return web.bytes(generate_latest(self.metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})
            doc = await api.answer(path, principal, {**dict(request.query), **(params or {})}, body, self.queries,
                                   self._memory_pages)
            if isinstance(doc, api.Rendered):  # a file (an invoice's CSV or HTML page), not a JSON document
                return web.bytes(doc.body, headers=doc.headers)
        except api.ApiError as exc:
            headers = {"Retry-After": str(exc.retry_after)} if getattr(exc, "retry_after", None) else None
            return web.json({"error": exc.message}, status=exc.status, headers=headers)
        except Exception as exc:  # noqa: BLE001 - a failed query must not hurt the worker
            log.warning("API %s failed: %s", path, exc)
            return web.json({"error": str(exc).splitlines()[0][:2000]}, status=500)
        return web.json(doc)

    async def _authenticated(self, request, header: str | None):
        """The principal the request proves (api.authenticate), with failed attempts throttled per client
        (api.AuthThrottle): each failure is counted and logged, and a client past the count is answered 429."""
        peer = request.transport.get_extra_info("peername") if request.transport is not None else None
        client = (str(peer[0]) if peer else "?", api.claimed_name(header))
        wait = self.auth_throttle.retry_after(client)
        if wait is not None:
            self.metrics.auth_failures.labels("throttled").inc()
            err = api.ApiError(429, f"too many failed authentications from {client[0]}"
                                    f"{' as ' + repr(client[1]) if client[1] else ''}; try again in {wait} s")
            err.retry_after = wait
            raise err
        try:
            try:
                return api.authenticate(header, self.registry)
            except api.ApiError as exc:
                if exc.status != 401 or not header:
                    raise
                await self._registry_caught_up(timeout_s=5.0)  # a principal added a moment ago
                return api.authenticate(header, self.registry)
        except api.ApiError as exc:
            if exc.status == 401:
                n = self.auth_throttle.failed(client)
                self.metrics.auth_failures.labels("invalid" if header else "missing").inc()
                if header:
                    log.warning("authentication failed from %s%s (%d in %d s): %s", client[0],
                                f" as {client[1]!r}" if client[1] else "", n, self.auth_throttle.window_s,
                                exc.message)
            raise

    @property
    def _memory_pages(self) -> dict:
        return {"/cluster/": self.cluster, "/stats/": self.stats, "/api/nodes": self.nodes,
                "/internal/views": self.internal_views,
                "/api/principals": lambda: {"principals": [
                    {"name": p.name, "role": p.role, "tenant": p.tenant, "nodes": list(p.nodes),
                     "auto_admit": p.auto_admit} for p in sorted(
                        self.registry.values(), key=lambda p: p.name)]}}

    def internal_views(self) -> dict:
        return {"worker": self.name,
                "nodes": [codec.NODE_VIEW.dump_python(v, mode="json")
                          for _, v in self.own_views(self.node_table, TELEMETRY.partitions)],
                "jobs": [codec.JOB_VIEW.dump_python(v, mode="json")
                         for _, v in self.own_views(self.job_table, JOB_REQUESTS.partitions)]}

    def _peer_urls(self) -> list[str]:
        """The other workers of this app, by the URL each gave Faust's assignor (one per member)."""
        mine = str(self.app.conf.canonical_url).rstrip("/")
        urls = set()
        for table in ("node-view", "job-view"):
            try:
                urls |= {str(u).rstrip("/") for u in self.app.router.table_metadata(table)}
            except (KeyError, AttributeError):
                continue
        return sorted(urls - {mine})

    async def all_views(self) -> tuple[list, list, list[str]]:
        """Node and job views of the whole pool: this worker's partitions and each peer's, asked over HTTP as the
        service principal; the URLs of peers that did not answer (their partitions are missing meanwhile)."""
        import aiohttp

        nodes = [v for _, v in self.own_views(self.node_table, TELEMETRY.partitions)]
        jobs = [v for _, v in self.own_views(self.job_table, JOB_REQUESTS.partitions)]
        peers = self._peer_urls()
        missing = []
        if peers:
            from infra import security

            creds = security.load(self.cfg, SERVICE)
            auth = aiohttp.BasicAuth(creds.name, creds.token)
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5), auth=auth) as session:
                for url in peers:
                    try:
                        async with session.get(f"{url}/internal/views") as resp:
                            resp.raise_for_status()
                            doc = await resp.json()
                    except Exception as exc:  # noqa: BLE001 - a peer going away: say so, answer with the rest
                        log.warning("worker %s did not give its views: %s", url, exc)
                        missing.append(url)
                        continue
                    nodes += [codec.load_view(codec.NODE_VIEW, d) for d in doc["nodes"]]
                    jobs += [codec.load_view(codec.JOB_VIEW, d) for d in doc["jobs"]]
        return nodes, jobs, missing

    async def nodes(self) -> dict:
        views, _, missing = await self.all_views()
        doc = {"nodes": [api.node_doc(v) for v in sorted(views, key=lambda v: v.node)]}
        if missing:
            doc["unanswered_workers"] = missing
        return doc

    async def cluster(self, views=None) -> dict:
        """The materialized view's metrics over the whole pool (every worker's partitions)."""
        got, jobs, missing = await self.all_views()
        return self._cluster_doc(got if views is None else views, jobs, missing)

    def local_cluster(self) -> dict:
        """The same over this worker's own partitions (the whole pool with one worker): for /metrics, which does
        not wait on the other workers."""
        return self._cluster_doc([v for _, v in self.own_views(self.node_table, TELEMETRY.partitions)],
                                 [v for _, v in self.own_views(self.job_table, JOB_REQUESTS.partitions)], [])

    @staticmethod
    def _cluster_doc(views, jobs, missing) -> dict:
        requests = [v.request for v in jobs if v.request is not None]
        out = cluster_metrics.metrics(views, cluster_metrics.typical_from_requests(requests))
        out["busy_cards"] = {c.uuid: c.release_ms for v in views for c in v.card_free() if c.milli < 1000}
        if missing:
            out["unanswered_workers"] = missing
        return out

    def stats(self) -> dict:
        return {
            "worker": self.name, "partitions": sorted(self.node_partitions()),
            "dead_letters": dict(self.dead_letters), "folded": dict(self.folded),
            "gateway": dict(self.gateway_counts), "principals": len(self.registry),
            "relay": dict(self.relay_counts),
            "liveness": {"heard": {n: list(v) for n, v in sorted(self.liveness.heard.items())},
                         "read": {str(p): list(v) for p, v in sorted(self.liveness.read.items())},
                         "start": {str(p): o for p, o in sorted(self.liveness.start.items())},
                         "started_ms": self.liveness.started_ms},
            "scheduler": self.scheduler.stats() if self.scheduler else None,
            "sink": self.sink.stats() if self.sink else None,
            "telemetry": self.telemetry.stats(),
        }

