"""Scheduler snapshots: the scheduler's state at an input offset, so a takeover replays only the tail.

A snapshot at offset k is the state after the input records 0..k-1 (exactly what `replay` of them gives): taking over
at committed offset c from the latest snapshot k <= c and replaying k..c-1 gives the same state, and replaying on
from there the same outputs, as replaying 0..c-1 (tests/test_scheduler_snapshot.py, a hypothesis property test).

The record (topic `gpupool.scheduler-snapshots`, compacted, key = the offset as 20 digits, written by the service
principal only) is an orjson document:

    {"v": FORMAT, "code": CODE, "layout": LAYOUT, "offset": k, "log_ms": ..., ["took_over_from": CODE,]
     "state": base64(zlib(pickle(state)))}

The state itself is a pickle of the scheduler object graph (hundreds of classes of the core: pickle is the one
encoding that covers every one of them without a second, hand-kept schema); the envelope around it is versioned
twice: `v`, the format of the document (older formats are upcast by UPCASTERS, none exist yet: format 2 holds
finished jobs as holdings.Ended and each job's commands on its record, and a format-1 state, every JobRecord kept, is
not upcast but ignored -- its code differs anyway), and `code`, a digest
of the scheduler's sources (agents/scheduler/*.py and the event schemas), and `layout`, a digest of the state's shape
(`state_layout`: every class of those sources with the fields and attributes it holds, and STATE_SEMANTICS).

Who may load which snapshot:
- the audit (`load`, strict) only one of its own `code`: it re-runs decisions, and a span another version decided is
  verified with that version (agents/audit_segments.code_lines says which);
- a takeover (`load(..., upgrade=True)`) also one of other code whose `layout` is this code's: an upgraded scheduler
  goes on from the state the old one left (the decisions it made stand; the new policy decides from there), instead
  of deriving the whole history again with the new policy -- a job the old code placed on H100s would, in such a
  state, be on the cards the new code would have chosen, not where it runs. A stopping scheduler writes a snapshot at
  the offset it stopped at (scheduler_agent), so after a clean stop the new code replays nothing the old code decided,
  and its first act is a snapshot of its own at that offset, where the audit with the new code can start. A snapshot of
  another layout (or format nobody upcasts) is ignored: the takeover replays from an older usable one, or from 0 with
  the new code (the one case where an upgrade re-derives history: say so in the upgrade's notes, or drain first).
Only the service principal may write the topic (infra/principals.py), and the pickle is only ever loaded from there.

Older snapshots are deleted by tombstones (the writer keeps the latest KEEP), so compaction bounds the topic -- except
the audit's checkpoints: the first snapshot written in each span of AUDIT_EVERY input records is never tombstoned.
They split the input into segments that `gpupool audit replay --verify` checks in parallel, each from the checkpoint
at its start, checking the one at its end (agents/audit_segments.py); the topic grows by one state per AUDIT_EVERY
records.
"""
from __future__ import annotations

import ast
import asyncio
import base64
import hashlib
import logging
import pickle
import zlib
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import orjson

log = logging.getLogger("gpupool.scheduler.snapshot")

FORMAT = 2  # 2: finished jobs kept as holdings.Ended, commands per job record (1: every JobRecord kept)
KEEP = 2  # snapshots kept (older ones get a tombstone) ...
AUDIT_EVERY = 50_000  # ... besides the first of every span of this many input records (the audit's checkpoints)
# the cyclic collector's thresholds for a process holding a scheduler state: the live agent's (scheduler_agent.tune_gc)
# and an audit segment's (agents/audit_segments.run_segment)
GC_THRESHOLDS = (50_000, 20, 20)
EVERY_RECORDS = 2_000  # a snapshot at least every this many input records ...
EVERY_LOG_MS = 120_000  # ... or this much log time, whichever comes first (and something was read)
UPCASTERS: dict[int, Any] = {}  # format -> fn(doc) -> doc of format+1


# Moved by hand when a change gives fields the state already has another meaning (a memo keyed differently, a unit
# changed): state_layout sees only the state's shape, and a snapshot whose layout matches is loaded by new code.
STATE_SEMANTICS = 3  # 2: a standing memo says by how much (claims.within_by), the sums log the amounts; 3: a share
# holds what its job asked (quota.held: the sums, held_milli and the ledger count no rounding dust), and a resize
# moves the sums (a boosted replica's holding is in them)


def _state_sources() -> list[Path]:
    """The sources whose classes make up the state: the scheduler's, the views the stream folds fold, the events."""
    root = Path(__file__).resolve().parents[2]
    return (sorted((root / "agents" / "scheduler").glob("*.py")) + sorted((root / "streams" / "folds").glob("*.py"))
            + [root / "schemas" / "events.py", root / "schemas" / "envelope.py"])


@lru_cache(maxsize=1)
def code_version() -> str:
    h = hashlib.sha256()
    for p in _state_sources():
        h.update(p.name.encode())
        h.update(p.read_bytes())
    return h.hexdigest()[:16]


def class_shapes(source: str) -> list[str]:
    """The shape of every class a module defines: its name, bases, the fields it declares in its body (annotated
    names: dataclass, pydantic and NamedTuple fields, with their annotations; __slots__; other class attributes) and
    every attribute its methods assign on `self`. A change of behaviour (a method's body) leaves it as it was; a field
    or attribute added, removed, renamed or retyped changes it."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.ClassDef):
            continue
        body, attrs = [], set()
        for item in node.body:
            if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                body.append(f"{item.target.id}: {ast.unparse(item.annotation)}")
            elif isinstance(item, ast.Assign):
                for t in item.targets:
                    if isinstance(t, ast.Name):
                        body.append(t.id + (f" = {ast.unparse(item.value)}" if t.id == "__slots__" else ""))
            elif isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for sub in ast.walk(item):
                    targets = sub.targets if isinstance(sub, ast.Assign) else \
                        [sub.target] if isinstance(sub, (ast.AnnAssign, ast.AugAssign)) else []
                    for t in targets:
                        for e in ast.walk(t):
                            if isinstance(e, ast.Attribute) and isinstance(e.value, ast.Name) and e.value.id == "self":
                                attrs.add(e.attr)
        out.append(f"class {node.name}({', '.join(ast.unparse(b) for b in node.bases)}): "
                   f"{'; '.join(body)} | self.{', self.'.join(sorted(attrs))}")
    return out


@lru_cache(maxsize=1)
def state_layout() -> str:
    """A digest of the state's shape (`class_shapes` of every state source) and STATE_SEMANTICS: the same for two
    versions of the code whose states pickle and unpickle into one another, whatever else they changed."""
    h = hashlib.sha256(f"semantics {STATE_SEMANTICS}\n".encode())
    for p in _state_sources():
        h.update(f"{p.name}\n".encode())
        for line in class_shapes(p.read_text()):
            h.update(line.encode() + b"\n")
    return h.hexdigest()[:16]


def key_of(offset: int) -> bytes:
    return f"{offset:020d}".encode()


@dataclass
class Snapshot:
    offset: int
    log_ms: int
    state: Any
    code: str = ""  # the code that wrote it (another than this one's only for a takeover after an upgrade)


def dump(state, offset: int, log_ms: int, took_over_from: str | None = None) -> bytes:
    """`took_over_from`: the code whose snapshot this code took over from here (an upgrade), said on the record so
    the audit can name the code that decided the input before it."""
    blob = zlib.compress(pickle.dumps(state, protocol=pickle.HIGHEST_PROTOCOL), 1)
    doc = {"v": FORMAT, "code": code_version(), "layout": state_layout(), "offset": offset, "log_ms": log_ms}
    if took_over_from:
        doc["took_over_from"] = took_over_from
    return orjson.dumps({**doc, "state": base64.b64encode(blob).decode()})


def usable(doc: dict, upgrade: bool = False) -> bool:
    """Whether this code may load a snapshot with this (upcast) header: of its own format and code, or, for a
    takeover after an upgrade (`upgrade`), of another code with this code's state layout."""
    if doc.get("v") != FORMAT:
        return False
    return doc.get("code") == code_version() or upgrade and doc.get("layout") == state_layout()


def load(value: bytes | None, upgrade: bool = False) -> Snapshot | None:
    """The snapshot in `value`, or None when it is not one this code can use (another format nobody upcasts, other
    code -- unless `upgrade` and the same state layout --, damage): the caller then replays further back."""
    if not value:
        return None
    try:
        doc = orjson.loads(value)
        v = doc.get("v")
        while isinstance(v, int) and v < FORMAT and v in UPCASTERS:
            doc = UPCASTERS[v](doc)
            v = doc.get("v")
        if not usable(doc, upgrade):
            return None
        state = _unpickle(zlib.decompress(base64.b64decode(doc["state"])))
        return Snapshot(int(doc["offset"]), int(doc["log_ms"]), state, str(doc.get("code") or ""))
    except Exception as exc:  # noqa: BLE001 - a snapshot that does not load is no snapshot: replay longer
        log.warning("snapshot not usable: %s", exc)
        return None


def _unpickle(blob: bytes):
    """pickle.loads with the cyclic garbage collector paused: unpickling a state makes a few hundred thousand tracked
    objects, none of them garbage, and each collection on the way walks those made so far (a third of the load's
    time for a state of ~70,000 job records)."""
    import gc

    paused = gc.isenabled()
    gc.disable()
    try:
        return pickle.loads(blob)
    finally:
        if paused:
            gc.enable()


def header(value: bytes) -> dict:
    """The document without its state (cheap checks: offset, format, code)."""
    doc = orjson.loads(value)
    doc.pop("state", None)
    return doc


# ---------------------------------------------------------------- the topic

async def latest(conn, at_most: int) -> tuple[Snapshot | None, list[int]]:
    """The newest snapshot a takeover may use (`load(..., upgrade=True)`) at or below input offset `at_most`, read
    from the snapshot topic, and the offsets of every snapshot there (the writer's to tombstone in time)."""
    from aiokafka import AIOKafkaConsumer, TopicPartition

    from infra.kafka_client import stop_consumer
    from schemas.topics import SCHEDULER_SNAPSHOTS

    tp = TopicPartition(SCHEDULER_SNAPSHOTS.name, 0)
    consumer = AIOKafkaConsumer(**conn.options(), enable_auto_commit=False, auto_offset_reset="earliest",
                                max_partition_fetch_bytes=64 << 20, fetch_max_bytes=64 << 20)
    await consumer.start()
    try:
        consumer.assign([tp])
        end = (await consumer.end_offsets([tp]))[tp]
        live: dict[int, bytes | None] = {}  # offset covered -> value (or None: not kept), tombstones applied
        if end > 0:
            consumer.seek(tp, 0)
            next_offset = 0
            while next_offset < end:
                batch = await consumer.getmany(tp, timeout_ms=1000)
                for msg in batch.get(tp, []):
                    next_offset = msg.offset + 1
                    k = int(msg.key)
                    if msg.value is None:
                        live.pop(k, None)
                    else:
                        live[k] = msg.value if k <= at_most else None
                        # the candidates' values only (the newest few at or below at_most): the audit's checkpoints
                        # make the topic hold a state per AUDIT_EVERY records, which need not all be in memory
                        below = sorted((o for o, v in live.items() if v is not None), reverse=True)
                        for o in below[KEEP + 2:]:
                            live[o] = None
    finally:
        await stop_consumer(consumer)
    for k in sorted((o for o, v in live.items() if v is not None), reverse=True):
        snap = await asyncio.to_thread(load, live[k], True)  # unpickling a large state must not hold the loop
        if snap is not None and snap.offset == k:
            return snap, sorted(live)
    return None, sorted(live)


def checkpoints(offsets, audit_every: int = AUDIT_EVERY) -> list[int]:
    """Of the snapshot offsets written, in order, those kept for the audit: the first in each span of audit_every
    records after the last one kept. Applied to the offsets still on the topic (the kept ones and the latest KEEP)
    it gives the same answer, so a writer that takes over knows which of them it may tombstone."""
    kept: list[int] = []
    for off in sorted(offsets):
        if audit_every > 0 and off // audit_every > (kept[-1] // audit_every if kept else 0):
            kept.append(off)
    return kept


class Writer:
    """Writes the scheduler's snapshots when due; tombstones those older than the latest KEEP, except the audit's
    checkpoints (`checkpoints`)."""

    def __init__(self, producer, every_records: int = EVERY_RECORDS, every_log_ms: int = EVERY_LOG_MS,
                 audit_every: int = AUDIT_EVERY):
        self.producer = producer
        self.every_records = every_records
        self.every_log_ms = every_log_ms
        self.audit_every = audit_every
        self.kept: list[int] = []
        self.last_offset = -1
        self.last_log_ms = -1
        self.written: list[int] = []
        self.count = 0
        self.last_bytes = 0

    def start_at(self, offset: int, log_ms: int, existing: list[int] = ()) -> None:
        self.last_offset, self.last_log_ms = offset, log_ms
        self.kept = checkpoints(existing, self.audit_every)
        self.written = [o for o in sorted(existing) if o not in set(self.kept)]

    def due(self, offset: int, log_ms: int) -> bool:
        if offset <= self.last_offset:
            return False
        if self.last_offset < 0:
            return offset >= self.every_records
        return offset - self.last_offset >= self.every_records or log_ms - self.last_log_ms >= self.every_log_ms

    async def write(self, state, offset: int, log_ms: int, took_over_from: str | None = None) -> None:
        from schemas.topics import SCHEDULER_SNAPSHOTS

        # The scheduler's own loop waits here, so nothing changes the state while the thread pickles it; the
        # worker's other agents run meanwhile.
        value = await asyncio.to_thread(dump, state, offset, log_ms, took_over_from)
        await (await self.producer.send(SCHEDULER_SNAPSHOTS.name, key=key_of(offset), value=value, partition=0))
        # the same offset written again (the state a stopped scheduler left, snapshotted by its successor): one
        # record on the compacted topic, listed once -- a second entry would later tombstone the newer value
        self.written = [o for o in self.written if o != offset]
        self.kept = [o for o in self.kept if o != offset]
        if checkpoints(self.kept + [offset], self.audit_every)[-1:] == [offset]:
            self.kept.append(offset)  # an audit checkpoint: never tombstoned
        else:
            self.written.append(offset)
        self.count += 1
        self.last_bytes = len(value)
        self.last_offset, self.last_log_ms = offset, log_ms
        while len(self.written) > KEEP:
            old = self.written.pop(0)
            await self.producer.send(SCHEDULER_SNAPSHOTS.name, key=key_of(old), value=None, partition=0)
