"""The scheduler agent: the single writer of scheduling decisions.

Exclusivity comes from Kafka: the scheduler input has one partition, and only the member of consumer group
`gpupool-scheduler` that owns it decides. On taking ownership it rebuilds its state from the latest snapshot at or
below the group's committed offset (streams/edge/scheduler_snapshot.py), replaying only the input after it up to the
committed offset, without emitting (the outputs of those records are already in the log), then goes live. The
rebuild yields to the event loop as it goes, so the worker's other agents (folds, sink, API) go on meanwhile. While
live it writes a snapshot every N input records or T s of log time, after the offsets it covers are committed.
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
from aiokafka.errors import CommitFailedError, IllegalStateError, RebalanceInProgressError

from streams.edge import scheduler_snapshot as snapshot
from agents.scheduler.core import Scheduler, live_config, replay, step_contained
from infra.config import Config
from schemas.envelope import DecodeError, decode_fast, encode
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


async def read_partition(conn, tp: TopicPartition, until: int | None = None, on_record=None, start: int = 0,
                         yield_every: int = 0) -> int:
    """Read one partition from offset `start` (0: its beginning) up to `until` (exclusive; None = its end now);
    returns records read. `conn`: the reader's connection (infra.security.KafkaConn). `yield_every` > 0: hand the
    event loop to other tasks every that many records.

    Progress is tracked from the records themselves: aiokafka's position() after a seek can wait on a reset that
    never comes."""
    consumer = AIOKafkaConsumer(**conn.options(), enable_auto_commit=False, auto_offset_reset="earliest")
    await consumer.start()
    try:
        consumer.assign([tp])
        end = (await consumer.end_offsets([tp]))[tp] if until is None else until
        if end <= start:
            return 0
        consumer.seek(tp, start)  # from 0: reset to earliest if retention removed offset 0
        n = 0
        next_offset = start
        while next_offset < end:
            batch = await consumer.getmany(tp, timeout_ms=1000, max_records=5000)
            for msg in batch.get(tp, []):
                if msg.offset >= end:
                    return n
                n += 1
                next_offset = msg.offset + 1
                if on_record:
                    on_record(msg)
                if yield_every and n % yield_every == 0:
                    await asyncio.sleep(0)
        return n
    finally:
        await stop_consumer(consumer)


async def replay_input(conn, until: int | None = None, on_record=None, start: int = 0, yield_every: int = 0) -> int:
    """The scheduler input from offset `start` (default 0) up to `until`."""
    return await read_partition(conn, TP, until, on_record, start, yield_every)


def snapshot_every_records() -> int:
    import os

    return int(os.environ.get("GPUPOOL_SNAPSHOT_EVERY", snapshot.EVERY_RECORDS))


def snapshot_every_log_ms() -> int:
    import os

    return int(float(os.environ.get("GPUPOOL_SNAPSHOT_EVERY_S", snapshot.EVERY_LOG_MS / 1000)) * 1000)


def snapshot_audit_every() -> int:
    import os

    return int(os.environ.get("GPUPOOL_SNAPSHOT_AUDIT_EVERY", snapshot.AUDIT_EVERY))


def tune_gc() -> None:
    """The scheduler's state is a large, long-lived object graph (node views, job records, the ledger) that the
    cyclic collector would otherwise traverse again and again: collect young objects less often and move what
    exists after a rebuild out of the collector's sight. Measured in bench/placement.py (`--gc`)."""
    gc.set_threshold(*snapshot.GC_THRESHOLDS)
    gc.freeze()


class SchedulerAgent:
    def __init__(self, cfg: Config, conn):
        self.cfg = cfg
        self.conn = conn
        self.state = Scheduler(**live_config())
        self.position = 0
        self.emitted = 0
        self.bad_input = 0
        self.faults = 0  # inputs whose handling raised (core.step_contained): skipped, as every replay skips them
        self.live = False
        self.snapshots: snapshot.Writer | None = None
        self.takeover: dict = {}  # the last rebuild: from which snapshot, how many records replayed, how long
        self.last_log_ms = 0

    def stats(self) -> dict:
        return {"position": self.position, "emitted": self.emitted, "live": self.live, "cycle": self.state.cycle,
                "takeover": self.takeover,
                "snapshots": {"written": self.snapshots.count, "last_offset": self.snapshots.last_offset,
                              "last_bytes": self.snapshots.last_bytes} if self.snapshots else None,
                "nodes": len(self.state.nodes),
                # the nodes the scheduler holds not alive (placement's NodeNotReady): the node view's "down" ones
                "not_ready": sorted(n for n, v in self.state.nodes.items() if v.inventory is not None and not v.alive),
                "bad_input": self.bad_input, "faults": self.faults,
                "pending": [r.request.job_id for r in self.state.pending_order()][:50]}

    def _step(self, msg) -> list:
        try:
            env = decode_fast(msg.value)
        except DecodeError:
            self.bad_input += 1  # the folds already dead-lettered it; the scheduler only skips
            return []
        out, fault = step_contained(self.state, env, msg.timestamp)  # the broker's append time is its clock
        if fault is not None:
            self.bad_input += 1
            self.faults += 1
            log.error("scheduler input offset %d (%s) skipped: %s", msg.offset, env.event_id, fault)
        return out

    def _replayed(self, msg) -> None:
        """One record of the tail after the snapshot, through the one replay (core.replay) the audit uses."""
        stepped = []
        replay([msg.value], [msg.timestamp], scheduler=self.state, on_outputs=lambda i, _outs: stepped.append(i))
        self.bad_input += 1 - len(stepped)  # the folds dead-lettered it; the scheduler only skips
        self.last_log_ms = msg.timestamp

    async def _rebuild(self, committed: int) -> None:
        """The state at the committed offset: the latest usable snapshot at or below it, then the input after it
        replayed without emitting (those outputs are in the log already), yielding to the loop as it goes."""
        import time

        t0 = time.monotonic()
        snap, existing = await snapshot.latest(self.conn, committed)
        start = snap.offset if snap is not None else 0
        self.state = snap.state if snap is not None else Scheduler(**live_config())
        self.last_log_ms = snap.log_ms if snap is not None else 0
        t1 = time.monotonic()
        n = await replay_input(self.conn, committed, self._replayed, start=start, yield_every=200)
        self.position = committed
        if self.snapshots is not None:
            self.snapshots.start_at(start if snap is not None else -1, self.last_log_ms, existing)
        self.takeover = {"committed": committed, "snapshot_offset": snap.offset if snap is not None else None,
                         "snapshot_code": snap.code if snap is not None else None, "code": snapshot.code_version(),
                         "replayed": n, "load_s": round(t1 - t0, 3), "replay_s": round(time.monotonic() - t1, 3)}
        log.info("scheduler rebuilt: %s", self.takeover)
        tune_gc()
        if snap is not None and snap.code != snapshot.code_version() and self.snapshots is not None:
            # an upgrade: the old code's state, taken over. A snapshot of this code's at once marks on the log where
            # this code starts deciding (the audit with this code starts a segment there; the old span is verified
            # with the old code)
            log.warning("scheduler code %s takes over from a snapshot of code %s at input offset %d",
                        snapshot.code_version(), snap.code, snap.offset)
            await self._snapshot(committed, "after an upgrade", took_over_from=snap.code)

    async def _snapshot(self, offset: int, why: str, took_over_from: str | None = None) -> None:
        try:
            await self.snapshots.write(self.state, offset, self.last_log_ms, took_over_from)
        except Exception as exc:  # noqa: BLE001 - no snapshot: the next takeover replays longer
            log.warning("scheduler snapshot at %d (%s) not written: %s", offset, why, exc)

    async def _commit(self, consumer) -> bool:
        """Commit the input offset after a batch's outputs were acknowledged. False when the partition was taken
        away meanwhile (a rebalance while the batch was sent: a worker joined or a coordinator moved): this worker
        stands by, and the owner now rebuilds from the offset last committed and decides that batch again -- the same
        outputs, deduplicated downstream by source and sequence, as after a kill -9 -- instead of the whole worker
        crashing on the commit."""
        try:
            await consumer.commit({TP: self.position})
            return True
        except (IllegalStateError, CommitFailedError, RebalanceInProgressError) as exc:
            log.warning("scheduler input offset %d not committed (%s): the partition moved; standing by",
                        self.position, exc)
            self.live = False
            return False

    async def run(self) -> None:
        ownership = _Ownership()
        consumer = AIOKafkaConsumer(**self.conn.options(), group_id=GROUP, enable_auto_commit=False,
                                    auto_offset_reset="earliest", max_poll_records=1000)
        # linger 0: an idle scheduler's command leaves at once (issue #16: request -> cmd.place p99 < 50 ms,
        # bench/request_latency.py); under load the records of a batch still share requests while one is in flight
        producer = AIOKafkaProducer(**self.conn.options(), acks="all", enable_idempotence=True, linger_ms=0,
                                    max_request_size=64 << 20)  # a snapshot is one record
        await consumer.start()
        await producer.start()
        self.snapshots = snapshot.Writer(producer, snapshot_every_records(), snapshot_every_log_ms(),
                                         snapshot_audit_every())
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
                    self.last_log_ms = msg.timestamp
                for fut in sends:
                    await fut
                self.emitted += len(sends)
                if not await self._commit(consumer):
                    continue
                if self.snapshots.due(self.position, self.last_log_ms) and ownership.owned:
                    await self._snapshot(self.position, "due")
        finally:
            if self.live and ownership.owned and self.position > self.snapshots.last_offset:
                # a clean stop (a worker shut down, an upgrade): the state at the offset it stopped at, so whoever
                # takes over -- new code too -- replays nothing this code decided
                try:
                    await asyncio.wait_for(self._snapshot(self.position, "on stopping"), 30)
                except (asyncio.TimeoutError, asyncio.CancelledError):
                    log.warning("scheduler snapshot on stopping at %d not written in time", self.position)
            await stop_consumer(consumer)
            await producer.stop()
