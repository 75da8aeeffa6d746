"""The scheduler agent: the single writer of scheduling decisions.

Exclusivity comes from Kafka: the scheduler input has one partition, and only the member of consumer group
`gpupool-scheduler` that owns it decides. On taking ownership it rebuilds its state by replaying the input up to the
group's committed offset without emitting (the outputs of those records are already in the log), then goes live.
Outputs are produced (acks=all, idempotent producer) before the input offset is committed; a crash in between
re-emits identical envelopes (same ids), which every consumer ignores as duplicates.
"""
from __future__ import annotations

import gc

import asyncio
import logging

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from infra.kafka_client import stop_consumer
from aiokafka.abc import ConsumerRebalanceListener

from agents.scheduler.core import Scheduler, live_config, replay
from infra.config import Config
from schemas.envelope import DecodeError, decode, encode
from schemas.routing import route
from schemas.topics import SCHEDULER_INPUT

log = logging.getLogger("gpupool.scheduler")
GROUP = "gpupool-scheduler"
TP = TopicPartition(SCHEDULER_INPUT.name, 0)


class _Ownership(ConsumerRebalanceListener):
    def __init__(self):
        self.changed = asyncio.Event()
        self.owned = False

    async def on_partitions_revoked(self, revoked):
        self.owned = False
        self.changed.set()

    async def on_partitions_assigned(self, assigned):
        self.owned = TP in assigned
        self.changed.set()


async def read_partition(conn, tp: TopicPartition, until: int | None = None, on_record=None) -> int:
    """Read one partition from offset 0 up to `until` (exclusive; None = its end now); returns records read.
    `conn`: the reader's connection (infra.security.KafkaConn).

    Progress is tracked from the records themselves: aiokafka's position() after a seek can wait on a reset that
    never comes."""
    consumer = AIOKafkaConsumer(**conn.options(), enable_auto_commit=False, auto_offset_reset="earliest")
    await consumer.start()
    try:
        consumer.assign([tp])
        end = (await consumer.end_offsets([tp]))[tp] if until is None else until
        if end <= 0:
            return 0
        consumer.seek(tp, 0)  # reset to earliest if retention removed offset 0
        n = 0
        next_offset = 0
        while next_offset < end:
            batch = await consumer.getmany(tp, timeout_ms=1000, max_records=5000)
            for msg in batch.get(tp, []):
                if msg.offset >= end:
                    return n
                n += 1
                next_offset = msg.offset + 1
                if on_record:
                    on_record(msg)
        return n
    finally:
        await stop_consumer(consumer)


async def replay_input(conn, until: int | None = None, on_record=None) -> int:
    """The scheduler input from offset 0 up to `until`."""
    return await read_partition(conn, TP, until, on_record)


def tune_gc() -> None:
    """The scheduler's state is a large, long-lived object graph (node views, job records, the ledger) that the
    cyclic collector would otherwise traverse again and again: collect young objects less often and move what
    exists after a rebuild out of the collector's sight. Measured in bench/placement.py (`--gc`)."""
    gc.set_threshold(50_000, 20, 20)
    gc.freeze()


class SchedulerAgent:
    def __init__(self, cfg: Config, conn):
        self.cfg = cfg
        self.conn = conn
        self.state = Scheduler(**live_config())
        self.position = 0
        self.emitted = 0
        self.bad_input = 0
        self.live = False

    def stats(self) -> dict:
        return {"position": self.position, "emitted": self.emitted, "live": self.live, "cycle": self.state.cycle,
                "nodes": len(self.state.nodes),
                "bad_input": self.bad_input,
                "pending": [r.request.job_id for r in self.state.pending_order()][:50]}

    def _step(self, msg) -> list:
        try:
            env = decode(msg.value)
        except DecodeError:
            self.bad_input += 1  # the folds already dead-lettered it; the scheduler only skips
            return []
        return self.state.step(env, msg.timestamp)  # the broker's append time is the scheduler's clock

    async def _rebuild(self, committed: int) -> None:
        """The state at the committed offset: the input replayed (`core.replay`, as the audit does) in batches as it
        is read, without emitting (those outputs are in the log already)."""
        self.state = Scheduler(**live_config())
        batch: list = []

        def flush() -> None:
            stepped = []
            replay([m.value for m in batch], [m.timestamp for m in batch], scheduler=self.state,
                   on_outputs=lambda i, _outs: stepped.append(i))
            self.bad_input += len(batch) - len(stepped)  # the folds dead-lettered them; the scheduler only skips
            batch.clear()

        def keep(msg) -> None:
            batch.append(msg)
            if len(batch) >= 5000:
                flush()

        await replay_input(self.conn, committed, keep)
        flush()
        self.position = committed
        tune_gc()

    async def run(self) -> None:
        ownership = _Ownership()
        consumer = AIOKafkaConsumer(**self.conn.options(), group_id=GROUP, enable_auto_commit=False,
                                    auto_offset_reset="earliest", max_poll_records=1000)
        producer = AIOKafkaProducer(**self.conn.options(), acks="all", enable_idempotence=True, linger_ms=5)
        await consumer.start()
        await producer.start()
        consumer.subscribe([SCHEDULER_INPUT.name], listener=ownership)
        try:
            while True:
                if not ownership.owned:
                    self.live = False
                    ownership.changed.clear()
                    await consumer.getmany(timeout_ms=500)  # drives the group protocol while standing by
                    continue
                if not self.live:
                    committed = await consumer.committed(TP) or 0
                    await self._rebuild(committed)
                    consumer.seek(TP, committed)
                    self.live = True
                    log.info("scheduler live at input offset %d", committed)
                batch = await consumer.getmany(TP, timeout_ms=500, max_records=1000)
                msgs = batch.get(TP, [])
                if not msgs or not ownership.owned:
                    continue
                sends = []
                for msg in msgs:
                    for out in self._step(msg):
                        spec, key = route(out)
                        sends.append(await producer.send(spec.name, key=key, value=encode(out)))
                    self.position = msg.offset + 1
                for fut in sends:
                    await fut
                self.emitted += len(sends)
                await consumer.commit({TP: self.position})
        finally:
            await stop_consumer(consumer)
            await producer.stop()
