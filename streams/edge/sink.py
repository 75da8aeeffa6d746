"""The ClickHouse sink: at-least-once from Kafka, made exact by idempotence.

Per partition, a batch of records becomes one insert per table with insert_deduplication_token derived from
(topic, partition, first offset, last offset); then the progress row; only then is the Kafka offset committed. While
ClickHouse does not answer, the sink pauses and retries the same batch (same token): nothing lost, nothing doubled.
On start it resumes from the later of the group's committed offset and its own progress table.
"""
from __future__ import annotations

import asyncio
import logging

from aiokafka import AIOKafkaConsumer, TopicPartition
from infra.kafka_client import commit_or_reread, stop_consumer

from infra.clickhouse import connect
from infra.config import Config
from schemas.envelope import DecodeError, decode
from schemas.routing import at_home
from schemas.topics import (
    COMMANDS, DECISIONS, INVENTORY, JOB_EVENTS, JOB_LOGS, JOB_REQUESTS, JOB_VIEW_CHANGELOG, LEDGER, NODE_CONTROL,
    TELEMETRY_MINUTES,
)
from streams.folds.rows import COLUMNS, TABLES, job_rows, rows_for

log = logging.getLogger("gpupool.sink")
GROUP = "gpupool-sink"
SINK_TOPICS = (JOB_REQUESTS.name, JOB_EVENTS.name, DECISIONS.name, COMMANDS.name, LEDGER.name, INVENTORY.name,
               NODE_CONTROL.name, TELEMETRY_MINUTES.name, JOB_LOGS.name,
               # the job view's changes: each job's state as its fold decided it (gpupool.jobs, docs/jobs.md)
               JOB_VIEW_CHANGELOG.name)


def log_retention_days(client) -> int | None:
    """The days gpupool_logs.job_logs keeps a piece, as its TTL says (None: no TTL)."""
    import re

    rows = client.query("SELECT engine_full FROM system.tables WHERE database = 'gpupool_logs' AND name = 'job_logs'"
                        ).result_rows
    found = re.search(r"TTL .*?(?:INTERVAL (\d+) DAY|toIntervalDay\((\d+)\))", rows[0][0]) if rows else None
    return int(found.group(1) or found.group(2)) if found else None


def log_retention(client, days: int) -> bool:
    """Keep programs' output `days` days (GPUPOOL_LOG_RETENTION_DAYS, docs/jobs.md "Logs"): the TTL of
    gpupool_logs.job_logs set to it when it says otherwise (True: changed). ClickHouse drops expired rows as it
    merges."""
    if days < 1:
        raise ValueError(f"GPUPOOL_LOG_RETENTION_DAYS={days}: at least 1")
    if log_retention_days(client) == days:
        return False
    client.command(f"ALTER TABLE gpupool_logs.job_logs MODIFY TTL stored + INTERVAL {int(days)} DAY")
    return True


CHAOS_ENV = "GPUPOOL_CHAOS"  # fault tests only: with it set, a file switches ClickHouse off for the sink


def outage_switch(home) -> "Path":
    """While this file exists (and GPUPOOL_CHAOS=1 is in the worker's environment), every ClickHouse call of the
    sink fails as if the server were down (docs/reliability.md: ClickHouse unavailable for 60 s)."""
    from pathlib import Path

    return Path(home) / "chaos" / "clickhouse-down"


class SwitchedOff:
    """A ClickHouse client that fails while the outage switch is on."""

    def __init__(self, real, switch):
        self.real, self.switch = real, switch

    def _check(self) -> None:
        if self.switch.exists():
            raise ConnectionError("ClickHouse unavailable (fault test: outage switch on)")

    def insert(self, *a, **kw):
        self._check()
        return self.real.insert(*a, **kw)

    def query(self, *a, **kw):
        self._check()
        return self.real.query(*a, **kw)

    def command(self, *a, **kw):
        self._check()
        return self.real.command(*a, **kw)


def view_rows(msg) -> dict[str, list]:
    """A record of the job view's changelog: the view the fold wrote (a tombstone: none), as its row of `jobs`,
    versioned by its offset."""
    import orjson

    from streams.edge.codec import JOB_VIEW, load_view

    if msg.value is None:
        return {}
    return job_rows(load_view(JOB_VIEW, orjson.loads(msg.value)), msg.offset)


def batch_rows(topic: str, partition: int, msgs) -> dict[str, list]:
    tables: dict[str, list] = {t: [] for t in COLUMNS}
    if topic == JOB_VIEW_CHANGELOG.name:
        for msg in msgs:
            try:
                made = view_rows(msg)
            except Exception:  # noqa: BLE001 - one record's row, never the batch
                log.exception("no job row for %s:%d:%d: left out", topic, partition, msg.offset)
                continue
            for table, rows in made.items():
                tables[table].extend(rows)
        return tables
    for msg in msgs:
        try:
            env = decode(msg.value)
        except DecodeError:
            continue  # dead-lettered by the folds
        if not at_home(env, topic):
            continue  # a kind off its home topic: dead-lettered by the folds, never billed or shown
        try:
            made = rows_for(env, topic, partition, msg.offset)
        except Exception:  # noqa: BLE001 - one record's rows, never the batch: else the sink retried it for ever
            log.exception("no rows for %s:%d:%d (%s): left out", topic, partition, msg.offset, env.event_id)
            continue
        for table, rows in made.items():
            tables[table].extend(rows)
    return tables


class Sink:
    def __init__(self, cfg: Config, conn, retry_s: float = 1.0):
        self.cfg = cfg
        self.conn = conn
        self.client = None
        self.retry_s = retry_s
        self.inserted = 0
        self.retries = 0
        self.positions: dict[str, int] = {}
        self._intents: dict[tuple[str, int], tuple[int, int] | None] = {}

    def stats(self) -> dict:
        return {"inserted_rows": self.inserted, "retries": self.retries, "positions": self.positions}

    def _open_intent(self, topic: str, partition: int) -> tuple[int, int] | None:
        """A range announced before a crash and never confirmed by a progress row (looked up once per partition)."""
        key = (topic, partition)
        if key not in self._intents:
            rows = self.client.query(
                "SELECT i.first_offset, i.last_offset FROM gpupool.sink_intent AS i FINAL "
                "LEFT JOIN (SELECT topic, partition, max(last_offset) AS done FROM gpupool.sink_progress "
                "GROUP BY topic, partition) AS p ON i.topic = p.topic AND i.partition = p.partition "
                "WHERE i.topic = {t:String} AND i.partition = {p:UInt16} AND i.last_offset > p.done",
                parameters={"t": topic, "p": partition}).result_rows
            self._intents[key] = (rows[0][0], rows[0][1]) if rows else None
        return self._intents[key]

    def _insert_batch(self, topic: str, partition: int, msgs) -> int:
        """Write one batch; a batch overlapping an unfinished range from before a crash is cut at that range's end,
        so the redelivered part is written with the token it had the first time."""
        intent = self._open_intent(topic, partition)
        if intent is not None and msgs[0].offset <= intent[1] < msgs[-1].offset:
            head = [m for m in msgs if m.offset <= intent[1]]
            return self._insert_batch(topic, partition, head) + self._insert_batch(
                topic, partition, [m for m in msgs if m.offset > intent[1]])
        return self._insert_range(topic, partition, msgs)

    def _insert_range(self, topic: str, partition: int, msgs) -> int:
        first, last = msgs[0].offset, msgs[-1].offset
        self.client.insert("gpupool.sink_intent", [[topic, partition, first, last]],
                           column_names=["topic", "partition", "first_offset", "last_offset"])
        n = 0
        for table, rows in batch_rows(topic, partition, msgs).items():
            if rows:
                self.client.insert(TABLES[table], rows, column_names=list(COLUMNS[table]),
                                   settings={"insert_deduplication_token": f"{table}/{topic}/{partition}/{first}-{last}",
                                             # a repeated block must not reach the rollups either
                                             "deduplicate_blocks_in_dependent_materialized_views": 1})
                n += len(rows)
        self.client.insert("gpupool.sink_progress", [[topic, partition, last]],
                           column_names=["topic", "partition", "last_offset"])
        self._intents[(topic, partition)] = None
        return n

    async def write_batch(self, topic: str, partition: int, msgs) -> None:
        """Insert one batch, pausing and retrying the same batch (same tokens) while ClickHouse fails."""
        while True:
            try:
                self.inserted += self._insert_batch(topic, partition, msgs)
                return
            except Exception as exc:  # noqa: BLE001 - pause and retry the same batch and token
                self.retries += 1
                log.warning("ClickHouse insert failed (%s); retrying", exc)
                await asyncio.sleep(self.retry_s)

    def _progress(self) -> dict[tuple[str, int], int]:
        rows = self.client.query("SELECT topic, partition, max(last_offset) FROM gpupool.sink_progress "
                                 "GROUP BY topic, partition").result_rows
        return {(t, p): o for t, p, o in rows}

    async def _progress_when_up(self) -> dict[tuple[str, int], int]:
        while True:
            try:
                return self._progress()
            except Exception as exc:  # noqa: BLE001 - ClickHouse away: wait, as for an insert
                self.retries += 1
                log.warning("ClickHouse unavailable (%s); retrying", exc)
                await asyncio.sleep(self.retry_s)

    async def _connect(self) -> None:
        import os

        while self.client is None:
            try:
                client = connect(self.cfg.clickhouse)
                if log_retention(client, self.cfg.log_retention_days):
                    log.info("job logs are kept %d day(s)", self.cfg.log_retention_days)
                self.client = client
                if os.environ.get(CHAOS_ENV) == "1":
                    self.client = SwitchedOff(self.client, outage_switch(self.cfg.home))
            except Exception as exc:  # noqa: BLE001 - wait for ClickHouse, never crash
                self.retries += 1
                log.warning("ClickHouse unavailable (%s); retrying", exc)
                await asyncio.sleep(self.retry_s)

    async def run(self) -> None:
        from aiokafka.abc import ConsumerRebalanceListener

        await self._connect()
        resumed: set[TopicPartition] = set()
        sink = self

        class Reassigned(ConsumerRebalanceListener):
            """A partition this sink gets (again) may have been written meanwhile by another worker's sink: its
            progress and any open intent are read afresh before its first batch."""

            async def on_partitions_revoked(self, revoked):
                pass

            async def on_partitions_assigned(self, assigned):
                for tp in assigned:
                    resumed.discard(tp)
                    sink._intents.pop((tp.topic, tp.partition), None)

        consumer = AIOKafkaConsumer(**self.conn.options(), group_id=GROUP,
                                    enable_auto_commit=False, auto_offset_reset="earliest", max_poll_records=5000)
        consumer.subscribe(list(SINK_TOPICS), listener=Reassigned())
        await consumer.start()
        try:
            while True:
                batches = await consumer.getmany(timeout_ms=500, max_records=5000)
                if any(tp not in resumed for tp in batches):
                    progress = await self._progress_when_up()
                for tp, msgs in sorted(batches.items(), key=lambda kv: (kv[0].topic, kv[0].partition)):
                    if tp not in resumed:
                        resumed.add(tp)
                        done = progress.get((tp.topic, tp.partition), -1)
                        msgs = [m for m in msgs if m.offset > done]  # written before a crash, not yet committed
                    if not msgs:
                        continue
                    await self.write_batch(tp.topic, tp.partition, msgs)
                    if not await commit_or_reread(consumer, {tp: msgs[-1].offset + 1}, log):
                        continue  # no longer ours: its next owner reads on from the last commit
                    self.positions[f"{tp.topic}/{tp.partition}"] = msgs[-1].offset + 1
        finally:
            await stop_consumer(consumer)
