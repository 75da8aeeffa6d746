"""The log as the segmented audit reads it (agents/audit_segments.py): from Kafka, or from a file copy.

Both sources answer the same questions, and never hand over more than one chunk of input at a time:

    committed()                 the scheduler group's committed input offset
    input_end()                 the scheduler input's end offset
    snapshots()                 the scheduler snapshots on record (tombstones applied): [SnapInfo], by offset
    snapshot(info)              one snapshot's value
    read_input(start, stop, n)  the input records [start, stop) as chunks of at most n (offset, value, log ms)
    read_outputs()              every record of the scheduler's output topics (Recorded), one at a time

`KafkaLog` reads the topics (each call its own consumer, so each audit process reads its own segment); `FileLog`
reads a directory the benchmark writes (bench/audit_segments.py) with `FileLogWriter`:

    meta.json       {"records": n, "committed": c}
    input.log       per record: <q log ms><i length, -1 for none> value
    input.idx       <q byte position> of every INDEX_EVERY-th record (seeks to a segment's start)
    outputs.log     per record: <H topic length> topic <i partition> <q offset> <i length> value
    snapshots/      one file per snapshot, named by the input offset it covers (20 digits): the record's value
"""
from __future__ import annotations

import asyncio
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import orjson

from schemas.topics import COMMANDS, DECISIONS, JOB_REQUESTS, LEDGER

INDEX_EVERY = 4096
_IN = struct.Struct("<qi")
_OUT = struct.Struct("<iqi")
_POS = struct.Struct("<q")


@dataclass(frozen=True)
class Recorded:
    """One record read back from an output topic."""
    topic: str
    partition: int
    offset: int
    value: bytes | None


@dataclass(frozen=True)
class SnapInfo:
    """A snapshot on record: the input offset it covers, its log time, whether this code can load it (format and
    code version), and where to read it (a topic offset or a file name)."""
    offset: int
    log_ms: int
    usable: bool
    where: object
    code: str = ""  # the scheduler code version that wrote it ("" when its header does not say or is damaged)
    took_over_from: str = ""  # written at an upgrade: the code that decided the input before it


def snap_info(key_offset: int, value: bytes, where) -> SnapInfo:
    from streams.edge import scheduler_snapshot as snapshot

    try:
        doc = snapshot.header(value)
        usable = snapshot.usable(doc) and int(doc.get("offset", -1)) == key_offset  # its own code's only
        return SnapInfo(key_offset, int(doc.get("log_ms", 0)), usable, where, str(doc.get("code") or ""),
                        str(doc.get("took_over_from") or ""))
    except Exception:  # noqa: BLE001 - damaged: on record, not usable
        return SnapInfo(key_offset, 0, False, where)


# ---------------------------------------------------------------- files


class FileLogWriter:
    def __init__(self, directory: Path):
        self.dir = Path(directory)
        (self.dir / "snapshots").mkdir(parents=True, exist_ok=True)
        self._in = open(self.dir / "input.log", "wb", buffering=1 << 20)
        self._idx = open(self.dir / "input.idx", "wb")
        self._out = open(self.dir / "outputs.log", "wb", buffering=1 << 20)
        self.records = 0
        self._pos = 0
        self._offsets: dict[tuple[str, int], int] = {}

    def add_input(self, value: bytes | None, log_ms: int) -> int:
        if self.records % INDEX_EVERY == 0:
            self._idx.write(_POS.pack(self._pos))
        data = _IN.pack(log_ms, -1 if value is None else len(value)) + (value or b"")
        self._in.write(data)
        self._pos += len(data)
        self.records += 1
        return self.records - 1

    def add_output(self, topic: str, partition: int, value: bytes | None) -> None:
        off = self._offsets.get((topic, partition), 0)
        self._offsets[(topic, partition)] = off + 1
        t = topic.encode()
        self._out.write(struct.pack("<H", len(t)) + t + _OUT.pack(partition, off, -1 if value is None else len(value))
                        + (value or b""))

    def add_snapshot(self, offset: int, value: bytes | None) -> None:
        path = self.dir / "snapshots" / f"{offset:020d}"
        if value is None:
            path.unlink(missing_ok=True)
        else:
            path.write_bytes(value)

    def close(self, committed: int | None = None) -> None:
        for f in (self._in, self._idx, self._out):
            f.close()
        (self.dir / "meta.json").write_text(json.dumps({"records": self.records, "committed":
                                                       self.records if committed is None else committed}))


class FileLog:
    def __init__(self, directory: Path | str):
        self.dir = Path(directory)
        self._meta = json.loads((self.dir / "meta.json").read_text())

    def spec(self):
        return ("file", str(self.dir))

    def committed(self) -> int:
        return int(self._meta["committed"])

    def input_end(self) -> int:
        return int(self._meta["records"])

    def snapshots(self) -> list[SnapInfo]:
        out = []
        for p in sorted((self.dir / "snapshots").iterdir()):
            out.append(snap_info(int(p.name), p.read_bytes(), p.name))
        return out

    def snapshot(self, info: SnapInfo) -> bytes:
        return (self.dir / "snapshots" / str(info.where)).read_bytes()

    def read_input(self, start: int, stop: int, chunk: int) -> Iterator[list[tuple[int, bytes | None, int]]]:
        stop = min(stop, self.input_end())
        with open(self.dir / "input.idx", "rb") as idx:
            idx.seek((start // INDEX_EVERY) * _POS.size)
            pos = _POS.unpack(idx.read(_POS.size))[0] if start < stop else 0
        off = (start // INDEX_EVERY) * INDEX_EVERY
        with open(self.dir / "input.log", "rb", buffering=1 << 20) as f:
            f.seek(pos)
            while off < start:  # from the indexed record to the segment's first
                ms, n = _IN.unpack(f.read(_IN.size))
                f.seek(max(n, 0), os.SEEK_CUR)
                off += 1
            batch: list[tuple[int, bytes | None, int]] = []
            while off < stop:
                ms, n = _IN.unpack(f.read(_IN.size))
                batch.append((off, f.read(n) if n >= 0 else None, ms))
                off += 1
                if len(batch) >= chunk:
                    yield batch
                    batch = []
            if batch:
                yield batch

    def read_outputs(self) -> Iterator[Recorded]:
        with open(self.dir / "outputs.log", "rb", buffering=1 << 20) as f:
            while True:
                head = f.read(2)
                if not head:
                    return
                t = f.read(struct.unpack("<H", head)[0]).decode()
                part, off, n = _OUT.unpack(f.read(_OUT.size))
                yield Recorded(t, part, off, f.read(n) if n >= 0 else None)


# ---------------------------------------------------------------- Kafka


class KafkaLog:
    """The topics themselves, read as an auditor (`conn`: infra.security.KafkaConn, picklable: each audit process
    opens its own consumers)."""

    def __init__(self, conn):
        self.conn = conn
        self._loop: asyncio.AbstractEventLoop | None = None

    def spec(self):
        return ("kafka", self.conn)

    def _run(self, coro):
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
        return self._loop.run_until_complete(coro)

    def committed(self) -> int:
        from schemas.topics import SCHEDULER_INPUT

        return self._run(_committed(self.conn, SCHEDULER_GROUP, SCHEDULER_INPUT.name))

    async def _consumer(self, **kw):
        """A started consumer (aiokafka wants to be made inside the loop that runs it: this object's)."""
        from aiokafka import AIOKafkaConsumer

        c = AIOKafkaConsumer(**self.conn.options(), enable_auto_commit=False, auto_offset_reset="earliest", **kw)
        await c.start()
        return c

    def _end(self, tp) -> int:
        async def go():
            c = await self._consumer()
            try:
                return (await c.end_offsets([tp]))[tp]
            finally:
                from infra.kafka_client import stop_consumer

                await stop_consumer(c)

        return self._run(go())

    def input_end(self) -> int:
        from streams.edge.scheduler_agent import TP

        return self._end(TP)

    def _records(self, tp, start: int, stop: int | None, chunk: int, **kw):
        """Chunks of the records of one partition in [start, stop) (None: its end now), one consumer."""
        from infra.kafka_client import stop_consumer

        async def opened():
            c = await self._consumer(**kw)
            c.assign([tp])
            end = (await c.end_offsets([tp]))[tp] if stop is None else stop
            if end > start:
                c.seek(tp, start)
            return c, end

        c, end = self._run(opened())
        try:
            if end <= start:
                return
            nxt, idle = start, 0
            while nxt < end:
                got = self._run(c.getmany(tp, timeout_ms=1000, max_records=chunk)).get(tp, [])
                batch = [m for m in got if m.offset < end]
                if batch:
                    nxt, idle = batch[-1].offset + 1, 0
                    yield batch
                elif (idle := idle + 1) >= 10:  # compaction may leave no record at the last offsets
                    return
                if len(batch) < len(got):
                    return
        finally:
            self._run(stop_consumer(c))

    def snapshots(self) -> list[SnapInfo]:
        from aiokafka import TopicPartition

        from schemas.topics import SCHEDULER_SNAPSHOTS

        tp = TopicPartition(SCHEDULER_SNAPSHOTS.name, 0)
        live: dict[int, SnapInfo] = {}
        for batch in self._records(tp, 0, None, 8, max_partition_fetch_bytes=64 << 20, fetch_max_bytes=64 << 20):
            for m in batch:
                k = int(m.key)
                if m.value is None:
                    live.pop(k, None)
                else:
                    live[k] = snap_info(k, m.value, m.offset)
        return [live[k] for k in sorted(live)]

    def snapshot(self, info: SnapInfo) -> bytes:
        from aiokafka import TopicPartition

        from schemas.topics import SCHEDULER_SNAPSHOTS

        tp = TopicPartition(SCHEDULER_SNAPSHOTS.name, 0)
        for batch in self._records(tp, int(info.where), int(info.where) + 1, 1, max_partition_fetch_bytes=64 << 20,
                                   fetch_max_bytes=64 << 20):
            for m in batch:
                if m.offset == info.where:
                    return m.value
        raise LookupError(f"snapshot at topic offset {info.where} is gone")

    def read_input(self, start: int, stop: int, chunk: int) -> Iterator[list[tuple[int, bytes | None, int]]]:
        from streams.edge.scheduler_agent import TP

        for batch in self._records(TP, start, stop, chunk):
            yield [(m.offset, m.value, m.timestamp) for m in batch]

    def read_outputs(self) -> Iterator[Recorded]:
        from aiokafka import TopicPartition


        for spec in OUTPUT_TOPICS:
            for p in range(spec.partitions):
                for batch in self._records(TopicPartition(spec.name, p), 0, None, 5000):
                    for m in batch:
                        yield Recorded(m.topic, m.partition, m.offset, m.value)


def open_source(spec):
    kind, arg = spec
    return FileLog(arg) if kind == "file" else KafkaLog(arg)


def loads_head(value: bytes | None) -> tuple[str, int] | None:
    """(source, seq) of an envelope's value, or None when it is not a JSON object with both."""
    try:
        doc = orjson.loads(value)
        return str(doc["source"]), int(doc["seq"])
    except Exception:  # noqa: BLE001
        return None


OUTPUT_TOPICS = (COMMANDS, DECISIONS, LEDGER, JOB_REQUESTS)  # the autoscaler's replica requests are outputs too
SCHEDULER_GROUP = "gpupool-scheduler"  # the live scheduler's consumer group: its committed input offset is C


async def _committed(conn, group: str, topic: str, partition: int = 0) -> int:
    from aiokafka import TopicPartition
    from aiokafka.admin import AIOKafkaAdminClient

    admin = AIOKafkaAdminClient(**conn.options())
    await admin.start()
    try:
        offsets = await admin.list_consumer_group_offsets(group)
    finally:
        await admin.close()
    meta = offsets.get(TopicPartition(topic, partition))
    return max(meta.offset, 0) if meta is not None else 0
