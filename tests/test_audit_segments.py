"""The segmented audit (#16 item 2, agents/audit_segments.py) on a file copy of a log, no broker: a clean log
verifies in segments with two processes, with the full replay's verdict; a tampered snapshot, a tampered, lost or
forged output is found and named (segment, offsets, first differing item); --from/--to replay only the covering
segments; the reader holds a chunk at a time. The digest the state check compares (agents/state_digest.py) is
canonical across processes and hash seeds, and sees a one-field change."""
from __future__ import annotations

import os
import struct
import subprocess
import sys
import types
from pathlib import Path

import orjson
import pytest

from agents import audit_segments as seg
from agents import state_digest
from agents.audit_compare import compare_outputs, replay_records
from agents.audit_log import FileLog, Recorded, SnapInfo
from streams.edge import scheduler_snapshot as snapshot
from schemas.envelope import decode, encode

RECORDS, EVERY = 3_000, 500


@pytest.fixture(scope="module")
def clean_log(tmp_path_factory) -> Path:
    from bench.audit_segments import generate

    d = tmp_path_factory.mktemp("log")
    meta = generate(d, RECORDS, 8, EVERY)
    assert meta["snapshots"] == RECORDS // EVERY - 1 and meta["outputs"] > 500
    return d


def copy_log(src: Path, dst: Path) -> Path:
    subprocess.run(["cp", "-r", str(src), str(dst)], check=True)
    return dst


def rewrite_outputs(d: Path, change) -> None:
    """Rewrite outputs.log with change(list of Recorded) -> list of Recorded."""
    recs = list(FileLog(d).read_outputs())
    with open(d / "outputs.log", "wb") as f:
        for r in change(recs):
            t = r.topic.encode()
            v = r.value or b""
            f.write(struct.pack("<H", len(t)) + t + struct.pack("<iqi", r.partition, r.offset, len(v)) + v)


def full_verdict(d: Path):
    """What `audit replay --verify --full` decides on these outputs: one replay from 0, compare_outputs."""
    log = FileLog(d)
    inputs = [r for chunk in log.read_input(0, log.input_end(), 10_000) for r in chunk]
    return compare_outputs(replay_records(inputs), list(log.read_outputs()), log.committed())


def test_a_clean_log_verifies_in_segments_with_two_jobs_and_the_full_replays_verdict(clean_log):
    res = seg.verify_source(FileLog(clean_log), jobs=2)
    assert res["ok"], res["lines"]
    assert res["segments"] == RECORDS // EVERY and res["records_replayed"] == RECORDS
    assert res["states_checked"] == RECORDS // EVERY - 1  # every snapshot is some segment's end
    full = full_verdict(clean_log)
    assert full.ok and res["report"].compared == full.compared and res["report"].matched == full.matched
    one = seg.verify_source(FileLog(clean_log), jobs=1)
    assert one["ok"] and one["report"].matched == res["report"].matched


def test_a_tampered_snapshot_is_found_and_its_first_difference_named(clean_log, tmp_path):
    d = copy_log(clean_log, tmp_path / "log")
    at = 2 * EVERY
    path = d / "snapshots" / f"{at:020d}"
    snap = snapshot.load(path.read_bytes())
    job_id = sorted(snap.state.jobs)[3]
    snap.state.jobs[job_id].attempt += 7  # a forged state, loadable, at the right offset
    path.write_bytes(snapshot.dump(snap.state, at, snap.log_ms))
    res = seg.verify_source(FileLog(d), jobs=2)
    # the segment that ends there; the one that starts from the forged state derives it on (its end differs too)
    assert not res["ok"] and res["states_different"] >= 1
    line = next(ln for ln in res["lines"] if "is not the snapshot" in ln)
    assert f"segment 1 [{EVERY}, {at})" in line and f"offset {at}" in line
    assert f"jobs[{job_id!r}].attempt" in line, line
    # the outputs themselves are intact: the full replay, which does not read snapshots, passes
    assert full_verdict(d).ok
    # a snapshot that does not load (damaged state) is named too
    doc = orjson.loads(path.read_bytes())
    doc["state"] = doc["state"][:-12]
    path.write_bytes(orjson.dumps(doc))
    res = seg.verify_source(FileLog(d), jobs=1)
    assert not res["ok"] and any(f"the snapshot at offset {at} does not load" in p for p in res["problems"])


def _place(recs, index=5):
    places = [(i, r) for i, r in enumerate(recs) if r.value and b'"cmd.place"' in r.value]
    return places[index]


def test_a_tampered_lost_or_forged_output_is_found_and_named(clean_log, tmp_path):
    d = copy_log(clean_log, tmp_path / "log")
    i, rec = _place(list(FileLog(d).read_outputs()), 40)
    env = decode(rec.value)
    forged = env.model_copy(update={"payload": env.payload.model_copy(update={"node": "node-999"})})

    def tamper(recs):
        recs[i] = Recorded(rec.topic, rec.partition, rec.offset, encode(forged))
        return recs

    rewrite_outputs(d, tamper)
    res = seg.verify_source(FileLog(d), jobs=2)
    assert not res["ok"] and len(res["report"].different) == 1
    line = res["report"].different[0]
    assert line.startswith("segment ") and env.event_id in line and "payload.node" in line and "node-999" in line
    assert "caused by input offset" in line
    assert not full_verdict(d).ok  # the full replay agrees

    # lost (before the committed offset: missing), forged by the scheduler's name (extra), by another (extra)
    d2 = copy_log(clean_log, tmp_path / "log2")
    alien = env.model_copy(update={"event_id": "scheduler:999999", "seq": 999999})
    mallory = env.model_copy(update={"event_id": "mallory:1", "source": "mallory"})

    def lose_and_forge(recs):
        return [r for j, r in enumerate(recs) if j != i] + [
            Recorded(rec.topic, rec.partition, 10 ** 6, encode(alien)),
            Recorded(rec.topic, rec.partition, 10 ** 6 + 1, encode(mallory))]

    rewrite_outputs(d2, lose_and_forge)
    res = seg.verify_source(FileLog(d2), jobs=2)
    rep = res["report"]
    assert not res["ok"] and len(rep.missing) == 1 and env.event_id in rep.missing[0]
    assert rep.missing[0].startswith("segment ")
    assert any("scheduler:999999" in x for x in rep.extra) and any("mallory" in x for x in rep.extra)


def test_from_to_verifies_only_the_covering_segments(clean_log, tmp_path):
    d = copy_log(clean_log, tmp_path / "log")
    res = seg.verify_source(FileLog(d), jobs=1, offsets=(1_200, 1_700))
    assert res["ok"] and res["window_segments"] == [(1_000, 1_500), (1_500, 2_000)]
    assert res["records_replayed"] == 1_000
    # the last covered segment's end is checked against its snapshot by itself (no verified segment starts there)
    assert res["states_checked"] == 2
    # a tampered snapshot outside the window is not looked at; inside it is
    for at, seen in ((2_500, False), (1_500, True)):
        path = d / "snapshots" / f"{at:020d}"
        snap = snapshot.load(path.read_bytes())
        snap.state.cycle += 1
        path.write_bytes(snapshot.dump(snap.state, at, snap.log_ms))
        got = seg.verify_source(FileLog(d), jobs=1, offsets=(1_200, 1_700))
        assert got["ok"] is not seen, got["lines"]
    # by log time: the segments whose snapshots' log times bracket the window
    snaps = FileLog(d).snapshots()
    t = next(s.log_ms for s in snaps if s.offset == 2_000)
    res = seg.verify_source(FileLog(clean_log), jobs=1, window=(t + 1, t + 2))
    assert res["ok"] and res["window_segments"] == [(2_000, 2_500)]


def test_the_reader_and_the_segments_hold_a_chunk_at_a_time(clean_log):
    log = FileLog(clean_log)
    it = log.read_input(700, 2_100, 64)
    assert isinstance(it, types.GeneratorType)  # nothing is read before it is asked for
    chunks = list(it)
    assert max(map(len, chunks)) == 64 and sum(map(len, chunks)) == 1_400
    assert chunks[0][0][0] == 700 and chunks[-1][-1][0] == 2_099
    res = seg.verify_source(log, jobs=1, chunk=64, bucket=100)
    assert res["ok"] and res["max_chunk"] == 64
    # the recorded outputs held at a time: the spill files a segment's sequence numbers reached, not the log's
    assert 0 < res["max_held"] <= 3 * 100 < res["outputs_read"]


def test_the_plan_cuts_at_the_usable_snapshots():
    snaps = [SnapInfo(100, 1, True, "a"), SnapInfo(250, 2, False, "b"), SnapInfo(400, 3, True, "c")]
    segs = seg.plan(snaps, 500)
    assert [(s.start, s.stop) for s in segs] == [(0, 100), (100, 400), (400, 500)]
    assert segs[0].start_snap is None and segs[1].start_snap.where == "a" and segs[2].end_snap is None
    assert [(s.start, s.stop) for s in seg.plan(snaps, 400)] == [(0, 100), (100, 400)]
    assert [(s.start, s.stop) for s in seg.plan([], 0)] == [(0, 0)]
    assert [s.index for s in seg.covering(segs, (150, 420))] == [1, 2]
    assert [s.index for s in seg.covering(segs, times=(2, 3))] == [1]


# ---------------------------------------------------------------- the digest


def test_the_digest_is_the_same_in_another_process_with_another_hash_seed(clean_log):
    value = (clean_log / "snapshots" / f"{EVERY * 3:020d}").read_bytes()
    state = snapshot.load(value).state
    here = state_digest.digest(state)
    code = ("import sys; from streams.edge import scheduler_snapshot as snapshot; from agents import state_digest; "
            "print(state_digest.digest(snapshot.load(open(sys.argv[1], 'rb').read()).state))")
    for seed in ("1", "12345"):
        out = subprocess.run([sys.executable, "-c", code, str(clean_log / "snapshots" / f"{EVERY * 3:020d}")],
                             env={**os.environ, "PYTHONHASHSEED": seed}, capture_output=True, text=True, check=True)
        assert out.stdout.strip() == here
    # a one-field change anywhere is seen, and named
    other = snapshot.load(value).state
    job_id = sorted(other.jobs)[0]
    other.jobs[job_id].checkpoint_ms += 1
    assert state_digest.digest(other) != here
    assert f"jobs[{job_id!r}].checkpoint_ms" in state_digest.first_difference(other, state)


def test_the_digest_ignores_the_order_dicts_and_sets_were_built_in():
    class Box:
        def __init__(self, d, s):
            self.d, self.s = d, s

    a = Box({"x": 1, "y": [1, 2]}, {"p", "q", "r"})
    b = Box({"y": [1, 2], "x": 1}, {"r", "q", "p"})
    assert state_digest.digest(a) == state_digest.digest(b)
    assert state_digest.digest(Box({"x": 1, "y": [2, 1]}, {"p", "q", "r"})) != state_digest.digest(a)
    assert state_digest.digest(Box({"x": 1}, {"p"})) != state_digest.digest(Box({"x": 1}, ("p",)))
    assert state_digest.first_difference(Box({"x": 1, "y": [1, 3]}, set()), Box({"x": 1, "y": [1, 2]}, set())) \
        == "state.d['y'][1]: derived 3 != recorded 2"


def test_a_digest_that_reuses_an_earlier_ones_immutable_parts_sees_every_change(clean_log):
    """`digest(state, keep)`: the encodings of deeply immutable parts (and of mutable objects whose fields are all
    the very same immutable objects) are reused by a later digest of the same process. After the state changes --
    a replay, a field set on a record, an item put into a list inside a frozen object -- it still equals a fresh
    digest."""
    from dataclasses import dataclass

    @dataclass(frozen=True)
    class Frozen:
        items: list
        name: str

    class Record:
        def __init__(self, f, t):
            self.f, self.t = f, t

    inner = Frozen([1, 2], "a")
    box = {"r": Record(inner, (3, (4, "x"))), "s": Record(Frozen([], "b"), ())}
    keep: dict = {}
    first = state_digest.digest(box, keep)
    assert first == state_digest.digest(box) and state_digest.digest(box, keep) == first
    inner.items.append(3)  # inside a frozen object: its list is mutable, so it is never reused
    assert state_digest.digest(box, keep) == state_digest.digest(box) != first
    box["r"].t = (3, (4, "y"))  # a record's field replaced
    assert state_digest.digest(box, keep) == state_digest.digest(box)
    box["s"].f = Frozen([], "c")
    assert state_digest.digest(box, keep) == state_digest.digest(box)
    box["s"].extra = 1  # a field added
    assert state_digest.digest(box, keep) == state_digest.digest(box)
    # a real state: its digest before and after a replay of a segment, with and without the earlier parts
    value = (clean_log / "snapshots" / f"{EVERY * 3:020d}").read_bytes()
    state = snapshot.load(value).state
    keep = {}
    before = state_digest.digest(state, keep)
    job_id = sorted(state.jobs)[0]
    state.jobs[job_id].checkpoint_ms += 1
    after = state_digest.digest(state, keep)
    assert after != before and after == state_digest.digest(state)


def test_the_verdict_names_the_code_it_re_runs_and_other_code_that_wrote_snapshots(clean_log, tmp_path):
    """The replay verifies with the code it runs: a log whose snapshots another scheduler version wrote (an upgrade)
    is audited with this code, those snapshots are not segment boundaries, and the verdict names both versions (and,
    when the outputs differ, says that span needs the code that wrote it)."""
    d = copy_log(clean_log, tmp_path / "log")
    for path in sorted((d / "snapshots").iterdir())[:2]:
        doc = orjson.loads(path.read_bytes())
        doc["code"] = "0123456789abcdef"  # written by other code: not loadable here
        path.write_bytes(orjson.dumps(doc))
    res = seg.verify_source(FileLog(d), jobs=1)
    assert res["ok"]  # this log's decisions are this code's: the rest still verifies, in fewer segments
    assert f"scheduler code: {snapshot.code_version()} (the code this audit re-runs)" in res["lines"]
    [note] = [ln for ln in res["lines"] if "written by scheduler code 0123456789abcdef" in ln]
    assert f"offsets {EVERY}..{2 * EVERY}" in note and "expected to differ" not in note
    lines = seg.code_lines(FileLog(d).snapshots(), ok=False)
    assert "audit that span with the code that wrote it" in lines[-1]
    assert seg.code_lines(FileLog(clean_log).snapshots(), ok=False) == [lines[0]]  # one code: nothing to say
    # no snapshot on record names any code: a mismatch says the scheduler may have run other code; a match, nothing
    assert seg.code_lines([], ok=True) == [lines[0]]
    assert "no scheduler snapshot is on record" in seg.code_lines([], ok=False)[-1]


def test_the_verdict_names_the_code_an_upgrade_took_over_from():
    """The snapshot a scheduler writes when it takes over from another code's (an upgrade) says so, and the audit's
    verdict names the code that decided the input before it and how to audit each span."""
    import orjson

    from agents.audit_log import snap_info
    from agents.audit_segments import code_lines
    from agents.scheduler.core import ElasticScheduler
    from streams.edge import scheduler_snapshot as snapshot

    value = snapshot.dump(ElasticScheduler(), 186, 0, took_over_from="0" * 16)
    assert orjson.loads(value)["took_over_from"] == "0" * 16
    info = snap_info(186, value, "f")
    assert info.usable and info.took_over_from == "0" * 16
    lines = code_lines([info], ok=True)
    assert any(f"at input offset 186 scheduler code {snapshot.code_version()} took over from code {'0' * 16}" in ln
               and "--to" in ln for ln in lines), lines
    assert not any("took over" in ln for ln in code_lines([snap_info(186, snapshot.dump(ElasticScheduler(), 186, 0),
                                                                     "f")], ok=True))


def test_outputs_of_an_input_stepped_while_the_outputs_are_read_are_not_extra(clean_log, tmp_path):
    """A live scheduler keeps stepping inputs (ticks) while the audit reads its log. verify_source reads the
    recorded outputs, then the input's end (agents/audit.read_log's order), so every output it read has its input
    below that end. Here the log grows by one input and that input's outputs the moment the outputs are read: read
    in the other order (before 7dfffbe), the end was taken before the growth and those outputs were "extra"."""
    d = copy_log(clean_log, tmp_path / "log")
    log = FileLog(d)
    replayed = replay_records([r for chunk in log.read_input(0, log.input_end(), 10_000) for r in chunk])
    last = max(off for off, _ in replayed)  # the last input with outputs: the one stepped during the read
    tail = {env.event_id for off, env in replayed if off == last}
    grown = list(log.read_outputs())
    meta = d / "meta.json"
    rewrite_outputs(d, lambda recs: [r for r in recs if decode(r.value).event_id not in tail])
    meta.write_text(orjson.dumps({"records": last, "committed": last}).decode())

    class Live(FileLog):
        def read_outputs(self):
            # the scheduler steps input `last` and records its outputs (its offset is not committed yet)
            rewrite_outputs(self.dir, lambda _: grown)
            meta.write_text(orjson.dumps({"records": last + 1, "committed": last}).decode())
            self._meta = FileLog(self.dir)._meta
            return super().read_outputs()

    res = seg.verify_source(Live(d), jobs=1)
    assert res["ok"], res["lines"]
    assert res["input_records"] == last + 1 and res["committed_offset"] == last
    # the end taken before the growth: the new input's outputs are extra (what the racy order reported)
    meta.write_text(orjson.dumps({"records": last, "committed": last}).decode())
    stale = seg.verify_source(FileLog(d), jobs=1)
    assert not stale["ok"] and len(stale["report"].extra) == len(tail) > 0
