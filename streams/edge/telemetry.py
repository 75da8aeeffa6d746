"""The telemetry fold, off Faust's per-message path (issue #16 item 3).

Telemetry is most of what the node agents send (a record a node a second), and through a Faust agent every record
was a stream event handed over one at a time that rewrote the node's whole view to the changelog. Here one task of
the worker reads `gpupool.telemetry` with its own aiokafka consumer, `getmany` batches at a time, and folds each
node's records of a batch at once (`node_view.fold_telemetry`) into the same `node-view` table the `fold-nodes`
agent keeps:

* **Which partitions.** Exactly the telemetry partitions whose node-view partitions Faust assigned to this worker
  (telemetry is co-partitioned with inventory, commands and node control: same key, same count), so a node's view,
  its telemetry and the judge of its liveness live in one process however many workers share the partitions. While
  Faust rebalances or recovers the table, this task reads nothing and writes nothing; afterwards it reassigns its
  consumer and resumes each partition from its own committed offset (group `gpupool-telemetry`, offsets committed,
  never a member).
* **What is written when.** Every batch updates the table's in-memory view at once (the API, the liveness judge and
  the next inventory or command fold read it). The durable copy, the table's changelog, is written at once only
  when telemetry changed something durable (`node_view.durable_change`: a new card fault, the node's liveness, a new
  view); otherwise the view is marked dirty and written with the others every `flush_s` (default 5 s). The
  telemetry offset is committed only after the changelog writes that cover it are acknowledged, so a worker that
  crashes re-reads at most `flush_s` of telemetry from that offset into views restored from the changelog, and the
  sequence numbers make the repeat a no-op where the view already had it: the restored view is the one it had.
  The writes go to the producer at once (not through Faust's producer buffer); the wait for their acknowledgements
  and the commit run in a task of their own while the fold goes on (`start_flush` / `finish_flush`).
* **The cyclic collector** waits while one `getmany`'s records are folded and is enabled again once they are freed
  (`_fold_batches`): young collections over a batch's live records cost as much as decoding them.
* **Derived facts** are as before: a card with a new fault gives `gpu.health` (node control), a node heard again
  after a silence gives `node.liveness` alive; the liveness judge (streams/edge/app.py, streams/folds/liveness.py) learns from
  here which node was heard when, in log time, and how far each partition is read.
* **Per-minute history** (docs/observability.md): the samples of each node's new records of a batch go, in runs of
  one minute of log time, to the worker's `telemetry_history.TelemetryMinutes`; the minutes they close are published
  by the worker (`gpupool.telemetry-minutes`), and the liveness timer closes those of nodes gone silent.
"""
from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections import defaultdict
from typing import Iterable, Protocol

from infra.kafka_client import partition_of, stop_consumer
from schemas.envelope import DecodeError, decode_telemetry, encode, envelope
from schemas.events import GpuHealth, GpuSample, GpuTelemetry, NodeLiveness
from schemas.routing import at_home, route
from schemas.topics import INVENTORY, TELEMETRY
from streams.folds import node_view
from streams.folds.liveness import alive_again, liveness_source

log = logging.getLogger("gpupool.telemetry")
GROUP = "gpupool-telemetry"
FLUSH_INTERVAL_S = 5.0
MAX_RECORDS = 2000
YIELD_EVERY = 250  # records decoded between two yields to the event loop (the scheduler and the API share it)


def health_source(node: str, gpu_uuid: str) -> str:
    """The source of the `gpu.health` facts derived from a card's telemetry: the card's own, its sequence numbers
    the node's telemetry records' (a fact re-derived after a restart repeats its id, and is deduped as one)."""
    return f"{node}/health/{gpu_uuid}"


class MinuteFeed(Protocol):
    """Where a batch's samples go for the per-minute history: `add` returns the minutes it closed (payloads to
    publish), `close_before` those the log's time has passed."""

    def add(self, node: str, log_ms: int, samples: Iterable[GpuSample], *, models=None,
            datacenter: str = "") -> list: ...

    def close_before(self, log_ms: int) -> list: ...

    def minute_of(self, t_ms: int) -> int: ...


class NoMinutes:
    def add(self, node, log_ms, samples, *, models=None, datacenter=""):
        return []

    def close_before(self, log_ms):
        return []

    def minute_of(self, t_ms):
        return t_ms


class TelemetryFold:
    def __init__(self, worker, minutes: MinuteFeed | None = None, flush_s: float = FLUSH_INTERVAL_S):
        self.w = worker
        self.minutes = minutes or NoMinutes()
        self.feeds_minutes = not isinstance(self.minutes, NoMinutes)
        self.flush_s = flush_s
        self.partitions: frozenset[int] = frozenset()
        self.positions: dict[int, int] = {}  # partition -> next offset folded
        self.dirty: dict[int, set[str]] = defaultdict(set)
        self._models: dict[str, tuple] = {}  # node -> (its inventory, card uuid -> model)
        self.unacked: list = []  # changelog writes not yet known to be acknowledged
        self.consumer = None
        self.records = 0
        self.batches = 0
        self.changelog_writes = 0
        self.flushes = 0
        self.first_batch_at: float | None = None  # wall clock of the first and the latest batch (benchmarks)
        self.last_batch_at: float | None = None

    def stats(self) -> dict:
        return {"partitions": sorted(self.partitions), "records": self.records, "batches": self.batches,
                "changelog_writes": self.changelog_writes, "flushes": self.flushes,
                "dirty": sum(len(v) for v in self.dirty.values()), "first_batch_at": self.first_batch_at,
                "last_batch_at": self.last_batch_at}

    # ---------------------------------------------------------------- which partitions

    def _table_ready(self) -> bool:
        app = self.w.app
        return not app.rebalancing and bool(getattr(app.tables, "actives_ready", True))

    def _faust_partitions(self) -> frozenset[int]:
        return frozenset(tp.partition for tp in self.w.app.consumer.assignment() if tp.topic == INVENTORY.name)

    def owns(self, node: str) -> bool:
        return partition_of(node.encode(), TELEMETRY.partitions) in self.partitions

    async def _follow_assignment(self) -> bool:
        """Reassign the consumer when Faust's assignment changed; False while the table is not ready."""
        if not self._table_ready():
            if self.partitions:
                self._drop(self.partitions)  # another worker may own them now: never write what it recovers
                self.consumer.assign([])
                self.partitions = frozenset()
            return False
        want = self._faust_partitions()
        if want != self.partitions:
            self._drop(self.partitions - want)
            tps = [_tp(p) for p in sorted(want)]
            self.consumer.assign(tps)
            for tp in tps:  # resume from what this group committed: every view restored covers the offsets before it
                committed = await self.consumer.committed(tp)
                start = max(committed or 0, 0)
                self.consumer.seek(tp, start)
                self.positions[tp.partition] = start
                self.w.liveness.start[tp.partition] = start
            if not self.partitions:
                from streams.edge.scheduler_agent import tune_gc

                tune_gc()  # what exists now (Faust, the recovered table) is long-lived: out of the collector's sight
            self.partitions = want
            log.info("telemetry partitions %s", sorted(want))
        return True

    def _drop(self, partitions: Iterable[int]) -> None:
        for p in set(partitions):
            self.dirty.pop(p, None)  # not flushed: the uncommitted telemetry is read again by whoever owns it
            self.positions.pop(p, None)
        self.w.liveness.forget(set(partitions))

    # ---------------------------------------------------------------- the loop

    async def run(self) -> None:
        from aiokafka import AIOKafkaConsumer

        # fetches as large as the bench's bare consumer's (16 MiB a partition, 64 MiB a response: at most that much
        # read ahead): a worker catching up a backlog waits on fewer fetch round trips (docs/performance.md)
        self.consumer = AIOKafkaConsumer(**self.w.conn.options(), group_id=GROUP, enable_auto_commit=False,
                                         auto_offset_reset="earliest", max_partition_fetch_bytes=16 << 20,
                                         fetch_max_bytes=64 << 20)
        await self.consumer.start()
        last_flush = time.monotonic()
        flushing: asyncio.Future | None = None
        try:
            while True:
                if not await self._follow_assignment() or not self.partitions:
                    await asyncio.sleep(0.1)
                    continue
                batches = await self.consumer.getmany(timeout_ms=200, max_records=MAX_RECORDS)
                if not self._table_ready():
                    continue  # a rebalance began while fetching: this batch is read again by the owner
                collecting = gc.isenabled()
                gc.disable()  # the collector waits for the batch: see _fold_batches
                try:
                    await self._fold_batches(batches)
                finally:
                    batches = None  # the batch's records freed before the collector may run again
                    if collecting:
                        gc.enable()
                if time.monotonic() - last_flush >= self.flush_s and (flushing is None or flushing.done()):
                    started = await self.start_flush()
                    if started is not None:
                        # in the background: the fold goes on while the broker acknowledges (one flush at a time)
                        flushing = asyncio.ensure_future(self.finish_flush(*started))
                    last_flush = time.monotonic()
        finally:
            if flushing is not None and not flushing.done():
                flushing.cancel()  # not committed: read again from the last commit, nothing lost
            await stop_consumer(self.consumer)

    async def _fold_batches(self, batches) -> None:
        """The partitions' records of one `getmany`, with the cyclic collector held off by the caller until they are
        folded and freed: a batch keeps ~25 tracked objects a record alive (envelopes, samples, their dicts) while it
        is folded, and every young collection meanwhile traversed them all again (in process, 2,000-record batches:
        ~59 µs a record decoded with the collector running at the worker's thresholds, ~43 with it waiting for the
        batch; docs/performance.md). Bounded: one batch's allocations (MAX_RECORDS records), after which the
        collector runs as before over what is still alive. Other tasks that run at the batch's yields wait with it."""
        for tp, msgs in batches.items():
            if tp.partition in self.partitions and msgs:
                await self.fold_batch(tp.partition, msgs)

    async def fold_batch(self, partition: int, msgs) -> None:
        """One partition's records of a batch: decode, group by node (log order kept), fold, derive, mark."""
        w = self.w
        self.first_batch_at = self.first_batch_at or time.time()
        by_node: dict[str, list] = {}
        last_log_ms: dict[str, int] = {}  # node -> the broker's append time of its last record here (ms)
        log_times: dict[str, list[int]] = {}  # node -> the append time of each of its records (ms)
        for i, msg in enumerate(msgs, start=1):
            if i % YIELD_EVERY == 0:
                await asyncio.sleep(0)  # a batch must not hold the loop: the scheduler and the API wait on it
            try:
                env = decode_telemetry(msg.value)  # decode's one-pass fast path for the hot record
            except DecodeError as exc:
                await w.dead_letter(msg, exc.code, exc.detail)
                continue
            if env.payload.kind != "gpu.telemetry" and not at_home(env, TELEMETRY.name):  # (asserted below)
                await w.dead_letter(msg, "wrong_topic", f"{env.kind} does not belong on {TELEMETRY.name}")
                continue
            node = env.payload.node
            runs = by_node.get(node)
            if runs is None:
                by_node[node] = [env]
                log_times[node] = [msg.timestamp]
            else:
                runs.append(env)
                log_times[node].append(msg.timestamp)
            last_log_ms[node] = msg.timestamp  # aiokafka: the broker's append time, in ms
        last = msgs[-1]
        for node, log_ms in last_log_ms.items():
            w.liveness.heard_from(node, partition, last.offset, log_ms)  # heard at its last record in the batch
        w.liveness.folded(partition, last.offset, last.timestamp)
        self.positions[partition] = last.offset + 1
        self.records += len(msgs)
        self.batches += 1
        self.last_batch_at = time.time()
        folded = 0
        for node, envs in by_node.items():
            try:
                folded += await self._fold_node(partition, node, envs, log_times[node], last_log_ms[node])
            except Exception as exc:  # noqa: BLE001 - a record that breaks the fold must not stop the others
                log.warning("telemetry fold of %s failed: %s", node, exc)
                w.dead_letters["telemetry_error"] += 1
                w.metrics.dead_letters.labels("telemetry_error").inc()
        w.folded["gpu.telemetry"] += folded  # records of the telemetry topic that changed a view

    async def _fold_node(self, partition: int, node: str, envs, log_times: list[int], log_ms: int) -> int:
        """One node's records of a batch: fold, store, derive; how many records changed its view."""
        w = self.w
        before = w.view_of(node)
        after = node_view.fold_telemetry(before, envs)
        if after is before:
            return 0
        w.node_table.data[node] = after  # in memory now; the changelog below
        if node_view.durable_change(before, after):
            await self._write(partition, node, after)
            self.dirty[partition].discard(node)
        else:
            self.dirty[partition].add(node)
        await self._derive(node, envs[-1], before, after, log_ms)
        if self.feeds_minutes:
            await self._feed_minutes(node, envs, log_times, before, after)
        return len(envs)

    async def _write(self, partition: int, node: str, view) -> None:
        self.changelog_writes += 1
        self.unacked.append(await self.w.send_view_changelog(partition, node, view))

    async def _derive(self, node: str, env, before, after, log_ms: int) -> None:
        w = self.w
        for gpu, why in sorted(after.unhealthy.items()):
            if before is None or gpu not in before.unhealthy:
                # a source per card: several cards failing in one record are several facts, and (source, seq)
                # is what every reader dedupes on -- one source for the node gave them all one id, and the
                # scheduler kept only the first card's fault (jobs went on, and were placed, on the others)
                await w.send(envelope(GpuHealth(node=node, gpu_uuid=gpu, healthy=False, reason=why),
                                      source=health_source(node, gpu), seq=env.seq, time_ms=env.event_time_ms,
                                      causation_id=env.event_id))
        if alive_again(before, after, env):
            # above the view's last liveness fact (the "silent" it answers, whoever wrote it): never dropped as older,
            # so the scheduler learns it too (streams/folds/liveness.py)
            source = liveness_source(node)
            await w.send(envelope(NodeLiveness(node=node, alive=True, last_heartbeat_ms=after.last_heartbeat_ms),
                                  source=source, seq=w.liveness.next_seq(node, log_ms, after.applied.get(source, -1)),
                                  time_ms=env.event_time_ms, causation_id=env.event_id))

    async def _feed_minutes(self, node: str, envs, log_times: list[int], before, view) -> None:
        """The samples of the records that were new to the view (a record read again after a restart is not
        counted twice), each at its own log time: a run that crosses a minute's end closes that minute."""
        applied = before.applied if before is not None else {}
        seen: dict[str, int] = {}  # source -> the last seq taken from this run (over `applied`, not a copy of it)
        inv = view.inventory
        models = self._models_of(node, inv)
        dc = inv.datacenter if inv is not None else ""
        minute_of = self.minutes.minute_of
        run: list = []
        run_ms = None
        closed: list = []
        for env, log_ms in zip(envs, log_times):
            if env.payload.kind != "gpu.telemetry":
                continue
            src = env.source
            last = seen.get(src)
            if env.seq <= (applied.get(src, -1) if last is None else last):
                continue
            seen[src] = env.seq
            if run and minute_of(log_ms) != minute_of(run_ms):
                closed += self.minutes.add(node, run_ms, run, models=models, datacenter=dc)
                run = []
            run.extend(env.payload.samples)
            run_ms = log_ms
        if run:
            closed += self.minutes.add(node, run_ms, run, models=models, datacenter=dc)
        if closed:
            await self.w._emit_minutes(closed)  # the minutes a batch closed, as the worker publishes them

    def _models_of(self, node: str, inv) -> dict[str, str]:
        """Card uuid -> model of the node's inventory, made again only when the inventory changes (not per batch)."""
        cached = self._models.get(node)
        if cached is None or cached[0] is not inv:
            cached = self._models[node] = (inv, {g.uuid: g.model for g in inv.gpus} if inv is not None else {})
        return cached[1]

    async def flush(self) -> None:
        """Write every dirty view to the changelog, wait for the broker, then commit what those writes cover."""
        started = await self.start_flush()
        if started is not None:
            await self.finish_flush(*started)

    async def start_flush(self):
        """The writing half of a flush: what is dirty and which offsets the writes cover are taken at once, the
        writes are handed to the producer, and what `finish_flush` needs is returned. The
        run loop folds on while `finish_flush` waits for the broker: a write made after this covers only later
        offsets, and the next flush waits for it."""
        if not self._table_ready():
            return None
        assignment = self.partitions
        positions = dict(self.positions)
        pending = {p: nodes for p, nodes in self.dirty.items() if nodes}
        self.dirty = defaultdict(set)
        for p, nodes in pending.items():
            for node in nodes:
                if (view := self.w.node_table.data.get(node)) is not None:
                    await self._write(p, node, view)
        futures, self.unacked = self.unacked, []  # every changelog write since the last commit, the immediate ones too
        return assignment, positions, pending, futures

    async def finish_flush(self, assignment, positions, pending, futures) -> None:
        """Wait for the writes' acknowledgements, then commit the offsets they cover (nothing if the assignment
        changed meanwhile, or a write failed: those views are dirty again)."""
        try:
            for fut in futures:
                await fut
            if not self._table_ready() or self.partitions != assignment:
                return  # revoked or reassigned meanwhile: the owner re-reads from the last commit
            offsets = {_tp(p): o for p, o in positions.items() if p in self.partitions}
            if offsets:
                await self.consumer.commit(offsets)
            self.flushes += 1
        except Exception as exc:  # noqa: BLE001 - not committed: read again after a crash, nothing lost
            log.warning("telemetry flush failed (%s); the offsets stay where they were", exc)
            for p, nodes in pending.items():
                if p in self.partitions:
                    self.dirty[p] |= nodes


assert at_home(envelope(GpuTelemetry(node="n", samples=()), source="n", seq=0, time_ms=0), TELEMETRY.name)  # the
# decode loop skips the home check for the kind that lives here


def _tp(partition: int):
    from aiokafka import TopicPartition

    return TopicPartition(TELEMETRY.name, partition)

