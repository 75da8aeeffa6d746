"""`gpupool audit replay --verify` by segments: streaming, in parallel processes, from the scheduler's snapshots.

The input log is cut at the offsets of the snapshots on record (streams/edge/scheduler_snapshot.py: the writer keeps the
first snapshot of every AUDIT_EVERY input records for this, besides the latest two): segment k is [s_k, s_k+1), the
first starts at offset 0 from the empty state, the last ends at the input's end. Each segment, in a process of its
own (`--jobs N`):

  1. loads the snapshot at its start (the first: a fresh scheduler configured as the live one, core.live_config);
  2. replays its records through `core.replay` (the agent's rebuild and the full audit run the same function), read
     from the source in chunks of CHUNK records -- never the whole log, never the whole segment;
  3. compares every output as it is produced with the recorded copies (same event id, same envelope; missing when
     caused by an input offset below the committed one; extra when recorded and never produced: the rule of
     agents/audit.py), the recorded outputs read from spill files of BUCKET sequence numbers each, loaded as the
     replay's sequence numbers reach them;
  4. digests the state it derives at its end (agents/state_digest.py: canonical, order- and hash-seed-independent);
     the process of the next segment digests the snapshot it starts from (or, when the next segment is not verified,
     this process loads it): the two must be equal. On a difference the segment is run once more to name the first
     differing part of the state.

Segment 0 starts from the empty state and every segment's end state is checked to be the next one's start, so all
segments passing is the full replay passing: the same outputs, and each snapshot the state the replay reaches there.

Before the segments, the parent reads the output topics once (orjson: source and sequence number only) into the
spill files; commands from any other source, and undecodable commands, are reported there (only the scheduler
writes commands). The parent holds one bucket's buffers and the segments' verdicts, never the log.

`--from/--to` (log times) and `--from-offset/--to-offset` (input offsets) verify only the segments that cover the
window, and compare only the outputs in it; `--full` runs the replay from offset 0 in one process instead
(agents/audit.py, all of the log in memory).
"""
from __future__ import annotations

import os
import shutil
import struct
import sys
import tempfile
import time
from dataclasses import dataclass, field

from agents.audit_compare import (
    OUR_SOURCES, Report, _diff_paths, _doc, _in_window, _label, foreign_record, usage_row,
)
from agents.audit_log import Recorded, SnapInfo, open_source
from schemas.envelope import DecodeError, decode, encode

CHUNK = 2_000  # input records a segment's process holds at a time
BUCKET = 20_000  # output sequence numbers per spill file
_HEAD = struct.Struct("<qiqii")  # seq, partition, offset, event id length (-1: none), value length


@dataclass(frozen=True)
class Segment:
    index: int
    start: int  # first input offset (the start snapshot's, 0 for the first segment)
    stop: int  # one past the last: the next snapshot's offset, or the input's end
    start_snap: SnapInfo | None
    end_snap: SnapInfo | None

    def label(self) -> str:
        return f"segment {self.index} [{self.start}, {self.stop})"


def plan(snaps: list[SnapInfo], end: int) -> list[Segment]:
    """The segments of an input of `end` records cut at the usable snapshots (pure)."""
    segs: list[Segment] = []
    prev_off, prev = 0, None
    for s in sorted((s for s in snaps if s.usable and 0 < s.offset <= end), key=lambda s: s.offset):
        segs.append(Segment(len(segs), prev_off, s.offset, prev, s))
        prev_off, prev = s.offset, s
    if prev_off < end or not segs:
        segs.append(Segment(len(segs), prev_off, end, prev, None))
    return segs


def covering(segs: list[Segment], offsets: tuple[int | None, int | None] = (None, None),
             times: tuple[int | None, int | None] = (None, None)) -> list[Segment]:
    """The segments that cover an input-offset window [lo, hi) and a log-time window [from, to) (pure). A segment's
    outputs have event times between its start snapshot's log time and its end snapshot's."""
    lo, hi = offsets
    tlo, thi = times
    out = []
    for s in segs:
        if lo is not None and s.stop <= lo:
            continue
        if hi is not None and s.start >= hi:
            continue
        t0 = s.start_snap.log_ms if s.start_snap else None
        t1 = s.end_snap.log_ms if s.end_snap else None
        if thi is not None and t0 is not None and t0 >= thi:
            continue
        if tlo is not None and t1 is not None and t1 < tlo:
            continue
        out.append(s)
    return out


# ---------------------------------------------------------------- the recorded outputs, spilled by sequence number


def _bucket_path(directory: str, source: str, b: int) -> str:
    return os.path.join(directory, f"{source.replace('/', '%')}.{b:08d}")


def spill_outputs(records, directory: str, window=(None, None), bucket: int = BUCKET) -> tuple[Report, int]:
    """Read the recorded outputs once, writing those of the scheduler's sources into files of `bucket` sequence
    numbers; report the commands no scheduler wrote. Returns (that report, records read)."""
    rep = Report()
    bufs: dict[tuple[str, int], bytearray] = {}
    n = 0

    def flush(key):
        with open(_bucket_path(directory, *key), "ab") as f:
            f.write(bufs.pop(key))

    for rec in records:
        n += 1
        head = _head(rec.value)
        if head is None or head[0] not in OUR_SOURCES:
            foreign_record(rec, window, rep)
            continue
        source, seq, eid = head
        key = (source, seq // bucket)
        t = rec.topic.encode()
        e = eid.encode("utf-8", "surrogatepass") if eid is not None else b""
        v = rec.value or b""
        buf = bufs.setdefault(key, bytearray())
        buf += (struct.pack("<H", len(t)) + t + _HEAD.pack(seq, rec.partition, rec.offset,
                                                           len(e) if eid is not None else -1, len(v)) + e + v)
        if len(buf) > 1 << 20:
            flush(key)
    for key in list(bufs):
        flush(key)
    return rep, n


def _read_bucket(path: str):
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        return
    with f:
        data = f.read()
    i = 0
    while i < len(data):
        (tl,) = struct.unpack_from("<H", data, i)
        i += 2
        topic = data[i:i + tl].decode()
        i += tl
        seq, part, off, el, vl = _HEAD.unpack_from(data, i)
        i += _HEAD.size
        eid = data[i:i + el].decode("utf-8", "surrogatepass") if el >= 0 else None
        i += max(el, 0)
        yield seq, eid, Recorded(topic, part, off, bytes(data[i:i + vl]))
        i += vl


def _to_json(env) -> bytes:
    """The envelope as pydantic's serializer writes it in one pass: the bytes `encode` writes (orjson over
    model_dump(mode="json"), the same fields in the same order; tests/test_fast_decode.py holds the two equal), at
    about two thirds of the cost. A recorded copy is matched when equal to either, or as a document (the rule)."""
    return env.__pydantic_serializer__.to_json(env)


class OutputCheck:
    """The recorded outputs of one segment against its replay, as the replay produces them (agents/audit.py's
    rule). `lo`: per source, the last sequence number before the segment; `last`: the segment runs to the input's
    end (every recorded output after lo is its to explain)."""

    def __init__(self, directory: str | None, lo: dict[str, int], committed: int, window, offsets, last: bool,
                 bucket: int = BUCKET):
        self.dir, self.lo, self.committed, self.window, self.offsets = directory, dict(lo), committed, window, offsets
        self.last, self.bucket = last, bucket
        self.next_bucket = {s: lo.get(s, 0) // bucket for s in OUR_SOURCES}
        # event id -> recorded copies not yet matched: (source, seq, record)
        self.recorded: dict[str, list[tuple[str, int, Recorded]]] = {}
        self.rep = Report()
        self.max_held = 0
        self.usage: list[tuple[str, dict, bool, bool]] = []  # (event id, row, in the log at a sunk offset, in window)
        self.sink: dict | None = None

    def _load_through(self, source: str, seq: int) -> None:
        if self.dir is None:
            return
        while self.next_bucket[source] <= seq // self.bucket:
            for s, eid, rec in _read_bucket(_bucket_path(self.dir, source, self.next_bucket[source])):
                if s > self.lo.get(source, 0):
                    eid = eid or f"{source}:{s}"
                    self.recorded.setdefault(eid, []).append((source, s, rec))
            self.next_bucket[source] += 1
        self.max_held = max(self.max_held, len(self.recorded))

    def _wanted(self, off: int, t: int) -> bool:
        lo, hi = self.offsets
        return _in_window(t, self.window) and (lo is None or off >= lo) and (hi is None or off < hi)

    def output(self, off: int, env) -> None:
        self._load_through(env.source, env.seq)
        recs = self.recorded.pop(env.event_id, ())
        if env.kind == "usage.accrued" and self.sink is not None:
            sunk = any(self.sink.get((r.topic, r.partition), -1) >= r.offset for _, _, r in recs)
            self.usage.append((env.event_id, usage_row(env), sunk, self._wanted(off, env.event_time_ms)))
        if not self._wanted(off, env.event_time_ms):
            return
        if not recs:
            if off < self.committed:
                self.rep.compared += 1
                self.rep.missing.append(f"{_label(env)} (caused by input offset {off} < committed {self.committed})")
            return
        raw = None
        for _, _, rec in recs:
            self.rep.compared += 1
            raw = raw if raw is not None else _to_json(env)
            if rec.value == raw or rec.value == encode(env):
                self.rep.matched += 1
                continue
            try:
                diffs = _diff_paths(_doc(env), _doc(decode(rec.value)))
            except DecodeError as exc:
                diffs = [f"undecodable ({exc.code})"]
            if diffs:
                self.rep.different.append(f"{_label(env)} at {rec.topic}/{rec.partition}@{rec.offset} (caused by "
                                          f"input offset {off}): " + "; ".join(diffs[:5]))
            else:
                self.rep.matched += 1

    def finish(self, hi: dict[str, int]) -> Report:
        """After the segment's replay: `hi`, per source, its last sequence number. Recorded outputs of the segment's
        range that the replay never produced are extra."""
        for s in OUR_SOURCES:
            if self.last and self.dir is not None:
                names = [p for p in os.listdir(self.dir) if p.startswith(s.replace("/", "%") + ".")]
                top = max((int(p.rsplit(".", 1)[1]) for p in names), default=-1)
                self._load_through(s, (top + 1) * self.bucket - 1)
            else:
                self._load_through(s, hi.get(s, 0))
        for eid, recs in self.recorded.items():
            for source, s, rec in recs:
                if not self.last and s > hi.get(source, 0):
                    continue  # the next segment's
                try:
                    env = decode(rec.value)
                    t, what = env.event_time_ms, _label(env)
                except DecodeError as exc:
                    t, what = None, f"{eid} undecodable ({exc.code})"
                if t is None or _in_window(t, self.window):
                    self.rep.compared += 1
                    self.rep.extra.append(f"{what} at {rec.topic}/{rec.partition}@{rec.offset}: the replay never "
                                          f"produces it")
        self.recorded.clear()
        return self.rep


def _head(value: bytes | None) -> tuple[str, int, str | None] | None:
    """(source, seq, event id or None) of an envelope's value, or None when it is not a JSON object with a source
    and a seq (audit_log.loads_head's rule): read once, in the pre-pass, so the segments need not parse it again."""
    import orjson

    try:
        doc = orjson.loads(value)
        head = str(doc["source"]), int(doc["seq"])
    except Exception:  # noqa: BLE001
        return None
    try:
        eid = str(doc["event_id"])
    except Exception:  # noqa: BLE001
        eid = None
    return head[0], head[1], eid


def _seqs(state) -> dict[str, int]:
    from agents.scheduler.core import SOURCE
    from agents.scheduler.elastic import SOURCE as AUTOSCALER

    return {SOURCE: state.out_seq, AUTOSCALER: state.autoscaler.seq if state.autoscaler is not None else 0}


# ---------------------------------------------------------------- one segment, in its own process


@dataclass
class Task:
    seg: Segment
    source: tuple
    committed: int
    window: tuple = (None, None)
    offsets: tuple = (None, None)
    spill: str | None = None
    sink: dict | None = None
    digest_start: bool = False  # digest the snapshot it starts from (the previous segment's end is checked to it)
    check_end: bool = False  # load the snapshot at its end and compare here (no verified segment starts from it)
    diff: bool = False  # name the first difference of the end state from the end snapshot
    chunk: int = CHUNK
    bucket: int = BUCKET


@dataclass
class Result:
    seg: Segment
    records: int = 0
    outputs: int = 0
    report: Report = field(default_factory=Report)
    start_digest: str | None = None
    end_digest: str | None = None
    end_recorded_digest: str | None = None
    problems: list[str] = field(default_factory=list)
    difference: str | None = None
    usage: list = field(default_factory=list)
    max_chunk: int = 0
    max_held: int = 0
    cpu_s: float = 0.0


def _load(src, info: SnapInfo):
    from streams.edge import scheduler_snapshot as snapshot

    snap = snapshot.load(src.snapshot(info))
    if snap is None or snap.offset != info.offset:
        return None
    return snap.state


def run_segment(task: Task) -> Result:
    """One segment, in this process (a worker's, or the parent's with --jobs 1). The cyclic garbage collector is
    told to leave the objects there are once the start state is loaded alone (gc.freeze: a state of ~77,000 job
    records is a few hundred thousand tracked objects, which every full collection during the replay and the digests
    would walk again); they are handed back to it when the segment is done, so a worker that runs several segments
    frees each one's state: collected here, before the next segment's state is loaded and frozen (garbage frozen
    with it would stay for the process's life). Meanwhile young objects are collected less often, as in the live
    agent (streams/edge/scheduler_snapshot.GC_THRESHOLDS): a step makes and drops many small objects, few of them in
    cycles."""
    import gc

    from streams.edge.scheduler_snapshot import GC_THRESHOLDS

    before = gc.get_threshold()
    gc.set_threshold(*GC_THRESHOLDS)
    try:
        return _run_segment(task, gc.freeze)
    finally:
        gc.set_threshold(*before)
        gc.unfreeze()
        gc.collect()


def _run_segment(task: Task, loaded) -> Result:
    from agents import state_digest
    from agents.scheduler.core import Scheduler, live_config, replay

    t0 = time.process_time()
    seg = task.seg
    res = Result(seg)
    src = open_source(task.source)
    # the encodings of the immutable parts of the start state (requests, placements, reasons, node facts), reused
    # by the digest of the end state: most of a state outlives a segment unchanged
    keep: dict = {}
    if seg.start_snap is not None:
        state = _load(src, seg.start_snap)
        if state is None:
            res.problems.append(f"{seg.label()}: the snapshot at offset {seg.start} does not load")
            return res
        loaded()
        if task.digest_start:
            res.start_digest = state_digest.digest(state, keep)
    else:
        state = Scheduler(**live_config())
    check = OutputCheck(task.spill, _seqs(state), task.committed, task.window, task.offsets,
                        last=seg.end_snap is None, bucket=task.bucket)
    check.sink = task.sink
    for chunk in src.read_input(seg.start, seg.stop, task.chunk):
        res.max_chunk = max(res.max_chunk, len(chunk))
        res.records += len(chunk)

        def tag(i, got, chunk=chunk):
            off = chunk[i][0]
            res.outputs += len(got)
            for o in got:
                check.output(off, o)

        replay([v for _, v, _ in chunk], [t for _, _, t in chunk], scheduler=state, on_outputs=tag)
    if res.records != seg.stop - seg.start:
        res.problems.append(f"{seg.label()}: read {res.records} input records, expected {seg.stop - seg.start}")
    res.report = check.finish(_seqs(state))
    res.usage = check.usage
    res.max_held = check.max_held
    if seg.end_snap is not None:
        res.end_digest = state_digest.digest(state, keep)
        keep.clear()
        if task.check_end or task.diff:
            recorded = _load(src, seg.end_snap)
            if recorded is None:
                res.problems.append(f"{seg.label()}: the snapshot at offset {seg.stop} does not load")
            else:
                res.end_recorded_digest = state_digest.digest(recorded)
                if task.diff and res.end_recorded_digest != res.end_digest:
                    res.difference = state_digest.first_difference(state, recorded)
    res.cpu_s = time.process_time() - t0
    return res


# ---------------------------------------------------------------- the whole verification


def code_lines(snaps, ok: bool) -> list[str]:
    """Which scheduler code this audit re-runs, and which other code wrote snapshots on record: the replay verifies
    with its own code, so decisions another version made are expected to differ (docs/reliability.md: upgrades)."""
    from streams.edge import scheduler_snapshot as snapshot

    mine = snapshot.code_version()
    other: dict[str, list[int]] = {}
    for s in snaps:
        if s.code and s.code != mine:
            other.setdefault(s.code, []).append(s.offset)
    lines = [f"scheduler code: {mine} (the code this audit re-runs)"]
    for s in snaps:
        if s.took_over_from:
            lines.append(f"  note: at input offset {s.offset} scheduler code {s.code} took over from code "
                         f"{s.took_over_from} (an upgrade): the input before it was decided by {s.took_over_from}"
                         + (" -- audit that span with that code (--to), and the rest from there (--from)"
                            if s.took_over_from != mine else ""))
    for code, offs in sorted(other.items(), key=lambda kv: min(kv[1])):
        lines.append(f"  note: snapshots at input offsets {min(offs)}..{max(offs)} were written by scheduler code {code}"
                     + ("" if ok else ": outputs decided by that code are expected to differ -- audit that span with "
                                      "the code that wrote it"))
    if not ok and not snaps:
        # a young log: nothing on record names the code that decided it, and a scheduler running other code than
        # the audit's (a checkout changed under a running stack) reads here as every decision differing
        lines.append("  note: no scheduler snapshot is on record to say which code decided this input: if the "
                     "scheduler ran other code than this audit's, every decision after the first change differs -- "
                     "audit with the code it ran (the worker's /stats/: scheduler.takeover.code)")
    return lines


def _pool(jobs: int):
    import multiprocessing

    return multiprocessing.get_context("spawn").Pool(jobs)


def verify_source(src, jobs: int = 1, window=(None, None), offsets=(None, None), chunk: int = CHUNK,
                  sink: dict | None = None, on_result=None, progress=None, bucket: int = BUCKET) -> dict:
    """Verify the log of `src` (agents/audit_log: KafkaLog or FileLog) by segments in `jobs` processes. `sink`: the
    sink's acknowledged offsets per (topic, partition) (then each result carries its usage events for the bill);
    `on_result(Result)`: called per segment, in order. Returns the verdict as data and its lines."""
    t0 = time.monotonic()
    committed = src.committed()
    spill = tempfile.mkdtemp(prefix="gpupool-audit-")
    try:
        t = time.monotonic()
        outside, n_out = spill_outputs(src.read_outputs(), spill, window, bucket)
        prepass_s = time.monotonic() - t
        # the input's end is read after the outputs (agents/audit.read_log's order): every recorded output's input
        # is then below it. Read before, a live scheduler's outputs of inputs (ticks) that came in between were
        # "extra" (a CI failure of test_security.test_the_authenticated_actor_is_recorded)
        end = src.input_end()
        snaps = src.snapshots()
        segs = plan(snaps, end)
        chosen = covering(segs, offsets, window)
        unusable = [s for s in snaps if not s.usable]
        ids = {s.index for s in chosen}
        tasks = [Task(s, src.spec(), committed, window, offsets, spill, sink,
                      digest_start=s.start_snap is not None and s.index - 1 in ids,
                      check_end=s.end_snap is not None and s.index + 1 not in ids, chunk=chunk, bucket=bucket)
                 for s in chosen]
        results: list[Result] = []
        total = sum(s.stop - s.start for s in chosen)
        done = 0
        procs = min(jobs, len(tasks))  # no more processes than segments; one segment runs here
        pool = _pool(procs) if procs > 1 else None
        try:
            it = pool.imap(run_segment, tasks, chunksize=1) if pool else map(run_segment, tasks)
            for r in it:
                r.usage, usage = [], r.usage
                if on_result:
                    on_result(r, usage)
                results.append(r)
                done += r.records
                if progress:
                    progress(done, total)
            # the states: each segment's end against the snapshot the next one starts from
            by = {r.seg.index: r for r in results}
            states: list[str] = []
            checked = 0
            redo = []
            for r in results:
                if r.end_digest is None:
                    continue
                nxt = by.get(r.seg.index + 1)
                recorded = nxt.start_digest if nxt is not None and nxt.start_digest else r.end_recorded_digest
                if recorded is None:
                    continue  # it does not load: said in the problems
                checked += 1
                if recorded != r.end_digest:
                    redo.append(r.seg)
            for seg in redo:
                task = Task(seg, src.spec(), committed, window, offsets, None, None, diff=True, chunk=chunk)
                again = pool.apply(run_segment, (task,)) if pool else run_segment(task)
                states.append(f"{seg.label()}: the state it derives (digest {by[seg.index].end_digest[:16]}) is not "
                              f"the snapshot at offset {seg.stop} (digest "
                              f"{(again.end_recorded_digest or '?')[:16]}): first difference {again.difference}")
        finally:
            if pool:
                pool.close()
                pool.join()
    finally:
        shutil.rmtree(spill, ignore_errors=True)

    rep = Report(compared=outside.compared, matched=outside.matched, missing=list(outside.missing),
                 extra=list(outside.extra), different=list(outside.different))
    problems = []
    for r in results:
        rep.compared += r.report.compared
        rep.matched += r.report.matched
        for name in ("missing", "extra", "different"):
            getattr(rep, name).extend(f"{r.seg.label()}: {x}" for x in getattr(r.report, name))
        problems.extend(r.problems)
    lines = rep.lines("scheduler outputs")
    ends = sum(1 for s in chosen if s.end_snap)
    if ends:
        lines.append(f"scheduler state: {checked} of {ends} segment end(s) checked against the snapshot there, "
                     f"{len(states)} different")
    else:  # a young log, or a window inside one segment: no snapshot to hold a derived state against
        lines.append("scheduler state: no snapshot ends a segment verified here, so no derived state was checked "
                     "against one (the outputs above were)")
    lines.extend(f"  different: {s}" for s in states)
    lines.extend(f"  problem: {p}" for p in problems)
    if unusable:
        lines.append(f"  note: {len(unusable)} snapshot(s) this code cannot load (other code or format, or damaged), "
                     f"not used as segment boundaries: offsets {', '.join(str(s.offset) for s in unusable[:10])}")
    lines.extend(code_lines(snaps, ok=rep.ok and not states and not problems))
    ok = rep.ok and not states and not problems
    return {"ok": ok, "lines": lines, "report": rep, "segments": len(chosen), "segments_total": len(segs),
            "input_records": end, "records_replayed": sum(r.records for r in results), "committed_offset": committed,
            "outputs_compared": rep.compared, "outputs_read": n_out, "states_checked": checked,
            "states_different": len(states), "problems": problems, "prepass_s": round(prepass_s, 2),
            "max_chunk": max((r.max_chunk for r in results), default=0),
            "max_held": max((r.max_held for r in results), default=0),
            "segment_cpu_s": round(sum(r.cpu_s for r in results), 2), "wall_s": round(time.monotonic() - t0, 2),
            "window_segments": [(s.start, s.stop) for s in chosen]}


def main(argv=None) -> int:
    """`python -m agents.audit_segments --log-dir DIR [--jobs N] [--from-offset A] [--to-offset B]`: verify a file
    copy of the log (bench/audit_segments.py writes one)."""
    import argparse

    from agents.audit_log import FileLog

    ap = argparse.ArgumentParser(prog="python -m agents.audit_segments")
    ap.add_argument("--log-dir", required=True)
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--from-offset", type=int)
    ap.add_argument("--to-offset", type=int)
    args = ap.parse_args(argv)
    res = verify_source(FileLog(args.log_dir), jobs=args.jobs, offsets=(args.from_offset, args.to_offset))
    print("\n".join(res["lines"]))
    print(f"audit replay --verify: {'OK' if res['ok'] else 'MISMATCH'} ({res['wall_s']} s, {res['segments']} "
          f"segment(s), --jobs {args.jobs})")
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
