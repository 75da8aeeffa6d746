"""`gpupool audit`: check the recorded decisions and the bill by replaying the log, and export governance evidence.

replay --verify [--jobs N] [--from T --to T | --from-offset A --to-offset B] [--full]
    By default by segments (agents/audit_segments.py): the input cut at the scheduler's snapshots on record, each
    segment replayed from the snapshot at its start in one of N processes, streaming (a chunk of records at a time),
    its outputs compared as below and the state it reaches checked against the snapshot at its end (canonical
    digests, agents/state_digest.py); a window verifies only the segments that cover it. `--full` is the replay
    described here, from offset 0 in one process with the whole log in memory; both give the same verdict on the
    outputs and the bill (tests/test_audit_segments.py).

    Reads `gpupool.scheduler-input` from offset 0, re-runs the pure scheduler (agents/scheduler/core.py) over it and
    compares (a) every envelope the replay produces with the scheduler's recorded outputs (`gpupool.commands`,
    scheduler-sourced records in `gpupool.job-events` and `gpupool.ledger`), matched by event id, full envelope;
    (b) the replay's `usage.accrued` events with the rows of `gpupool.usage FINAL` in ClickHouse, by event id.

    The comparison rule (docs/billing.md):
      * C = the committed input offset of the consumer group `gpupool-scheduler`. The live scheduler produces the
        outputs of an input record before it commits past it, so every output caused by an input offset < C must be
        in the log. Outputs of inputs >= C may or may not be there yet (in flight, or a crash before the commit).
      * Read in this order: C, then the recorded outputs up to their end, then the input up to its end. Every
        recorded output then comes from an input the replay also reads, so nothing recorded is "extra" by a race.
      * missing   = a replay output caused by an input offset < C that the log does not hold;
        extra     = a recorded scheduler output whose event id the replay never produces (or any record in
                    `gpupool.commands` from another source: only the scheduler writes commands);
        different = same event id, different envelope (each recorded copy is checked: a re-emitted duplicate must
                    be identical).
      * Bill: a replay usage event is expected in ClickHouse when the log holds it (part a) at a ledger offset the
        sink has acknowledged (`gpupool.sink_progress`); usage rows whose event id the replay never produces are
        extra; matched rows must agree in every column except the Kafka coordinates (topic, partition, offset:
        a re-emitted duplicate lives at another offset, and FINAL keeps either copy).
      * --from/--to restrict the comparison to outputs whose event time lies in [from, to); with --full the replay
        itself starts at offset 0, since the scheduler's state depends on everything before the window; by segments
        it starts at the snapshot before the window (which the segment before it, when verified, checks).

export --tenant T --out DIR [--from T --to T]
    The tenant's evidence pack for the period (agents/evidence.py): a CSV and a JSON file per section, a summary, the
    result of the verification above run over the period, and a manifest of SHA-256 hashes signed with ed25519.

verify-export DIR [--pubkey FILE]
    Checks the pack: every file's hash, no file missing or added, the manifest's signature.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

from agents.audit_compare import (
    Report, _in_window, compare_bill, compare_bill_rows, compare_outputs, replay_records,
)
from agents.audit_log import OUTPUT_TOPICS, SCHEDULER_GROUP, Recorded, _committed
from agents.scheduler.core import SOURCE
from schemas.envelope import DecodeError, Envelope, decode
from schemas.topics import INVENTORY, LEDGER, NODE_CONTROL, SCHEDULER_INPUT
from streams.folds.rows import COLUMNS

# ---------------------------------------------------------------- reading the log


def _replay(inputs):
    """Replay with progress on stderr: a bar on a terminal, a line at each tenth otherwise."""
    from infra.progress import Bar

    with Bar("replay") as bar:
        return replay_records(inputs, bar)


async def _read_topic(conn, spec, on_record) -> int:
    from aiokafka import TopicPartition

    from streams.edge.scheduler_agent import read_partition

    n = 0
    for p in range(spec.partitions):
        n += await read_partition(conn, TopicPartition(spec.name, p), None, on_record)
    return n


def read_log(conn) -> tuple[int, list[Recorded], list[tuple[int, bytes | None, int]]]:
    """(scheduler committed offset, recorded outputs, scheduler input with log times) read in the race-free
    order. `conn`: an auditor's connection (it may read every topic)."""
    async def go():
        committed = await _committed(conn, SCHEDULER_GROUP, SCHEDULER_INPUT.name)
        recorded: list[Recorded] = []
        for spec in OUTPUT_TOPICS:
            await _read_topic(conn, spec,
                              lambda m: recorded.append(Recorded(m.topic, m.partition, m.offset, m.value)))
        inputs: list[tuple[int, bytes | None, int]] = []
        await _read_topic(conn, SCHEDULER_INPUT, lambda m: inputs.append((m.offset, m.value, m.timestamp)))
        return committed, recorded, inputs

    return asyncio.run(go())


def _sink_progress(client) -> dict[tuple[str, int], int]:
    _, rows = client.sql("SELECT topic, partition, max(last_offset) FROM gpupool.sink_progress "
                         "GROUP BY topic, partition")
    return {(t, int(p)): int(o) for t, p, o in rows}


def _usage_rows(client) -> list[dict]:
    return client.records(f"SELECT {', '.join(COLUMNS['usage'])} FROM gpupool.usage FINAL")


# ---------------------------------------------------------------- replay --verify


def verify(cfg, window: tuple[int | None, int | None], full: bool = False, jobs: int | None = None,
           offsets: tuple[int | None, int | None] = (None, None)) -> int:
    report = verification(cfg, window, full=full, jobs=jobs, offsets=offsets)
    print("\n".join(report["lines"]))
    return 0 if report["ok"] else 1


def verification(cfg, window: tuple[int | None, int | None], full: bool = False, jobs: int | None = None,
                 offsets: tuple[int | None, int | None] = (None, None)) -> dict:
    """Replay the log and compare (the module's docstring): the report as data, its lines as printed. By segments
    in `jobs` processes (default: one per CPU), or `full`: from offset 0 in one process."""
    if not full:
        return segmented_verification(cfg, window, offsets, jobs or os.cpu_count() or 1)
    if offsets != (None, None):
        raise SystemExit("--from-offset/--to-offset select segments: not with --full")
    from agents.client import Client

    t0 = time.monotonic()
    client = Client(cfg)
    committed, recorded, inputs = read_log(client.conn())
    print(f"scheduler input: {len(inputs)} records, scheduler committed offset {committed}; "
          f"recorded outputs read: {len(recorded)}", file=sys.stderr)
    replayed = _replay(inputs)
    outputs = compare_outputs(replayed, recorded, committed, window)

    # The bill: which replay usage events the sink must have written.
    progress = _sink_progress(client)
    where: dict[str, list[Recorded]] = {}
    for rec in recorded:
        if rec.topic == LEDGER.name:
            try:
                env = decode(rec.value)
            except DecodeError:
                continue
            if env.source == SOURCE and env.kind == "usage.accrued":
                where.setdefault(env.event_id, []).append(rec)
    usage = [env for _, env in replayed if env.kind == "usage.accrued"]
    expected, pending = [], set()
    for env in usage:
        recs = where.get(env.event_id, [])
        if any(progress.get((r.topic, r.partition), -1) >= r.offset for r in recs):
            expected.append(env)
        else:
            pending.add(env.event_id)  # not in the log (reported above) or not sunk yet
    rows = _usage_rows(client)
    in_window = {e.event_id for e in usage if _in_window(e.event_time_ms, window)}
    known = {e.event_id for e in usage}
    expected = [e for e in expected if e.event_id in in_window]
    rows = [r for r in rows if str(r["event_id"]) in in_window or str(r["event_id"]) not in known]
    if window != (None, None):  # rows the replay does not know have no trustworthy time but their end_ms
        rows = [r for r in rows if str(r["event_id"]) in known or _in_window(int(r["end_ms"]), window)]
    bill = compare_bill(expected, rows, pending, known)

    lines = outputs.lines("scheduler outputs") + bill.lines("bill (gpupool.usage FINAL)")
    if pending:
        lines.append(f"  note: {len(pending)} replay usage event(s) not yet acknowledged by the sink, not compared")
    ok = outputs.ok and bill.ok
    lines.append(f"audit replay --verify: {'OK' if ok else 'MISMATCH'} ({time.monotonic() - t0:.1f} s)")
    from agents.evidence import iso

    return {"ok": ok, "lines": lines, "ran_at": iso(time.time_ns() // 1_000_000),
            "window": {"from": iso(window[0]), "to": iso(window[1])}, "input_records": len(inputs),
            "committed_offset": committed, "outputs_compared": outputs.compared, "usage_compared": bill.compared,
            "missing": len(outputs.missing) + len(bill.missing), "extra": len(outputs.extra) + len(bill.extra),
            "different": len(outputs.different) + len(bill.different)}


def segmented_verification(cfg, window, offsets, jobs: int) -> dict:
    """The verification by segments (agents/audit_segments.py) on the live log, with the bill: each segment's
    replay usage events against the rows of `gpupool.usage FINAL` as the segment's verdict arrives."""
    from agents.audit_log import KafkaLog
    from agents.audit_segments import verify_source
    from agents.client import Client
    from agents.evidence import iso
    from infra.progress import Bar

    t0 = time.monotonic()
    client = Client(cfg)
    progress = _sink_progress(client)
    rows = {str(r["event_id"]): r for r in _usage_rows(client)}
    bill = Report()
    pending = 0

    def on_result(res, usage):
        nonlocal pending
        want, not_sunk, known, have = {}, set(), set(), []
        for eid, row, sunk, in_window in usage:
            known.add(eid)
            got = rows.pop(eid, None)
            if not in_window:
                continue
            if sunk:
                want[eid] = row
            else:
                not_sunk.add(eid)
            if got is not None:
                have.append(got)
        pending += len(not_sunk)
        r = compare_bill_rows(want, have, not_sunk, known)
        bill.compared += r.compared
        bill.matched += r.matched
        for name in ("missing", "extra", "different"):
            getattr(bill, name).extend(getattr(r, name))

    with Bar("replay") as bar:
        res = verify_source(KafkaLog(client.conn()), jobs=jobs, window=window, offsets=offsets, sink=progress,
                            on_result=on_result, progress=bar)
    # rows no verified segment produced: extra, unless a window leaves them to segments not verified
    if offsets == (None, None):
        left = [r for r in rows.values() if window == (None, None) or _in_window(int(r["end_ms"]), window)]
        r = compare_bill_rows({}, left, set(), set())
        bill.compared += r.compared
        bill.extra.extend(r.extra)
    print(f"scheduler input: {res['input_records']} records, scheduler committed offset {res['committed_offset']}; "
          f"recorded outputs read: {res['outputs_read']}; {res['segments']} of {res['segments_total']} segment(s) "
          f"verified in {jobs} process(es)", file=sys.stderr)
    lines = res["lines"] + bill.lines("bill (gpupool.usage FINAL)")
    if pending:
        lines.append(f"  note: {pending} replay usage event(s) not yet acknowledged by the sink, not compared")
    ok = res["ok"] and bill.ok
    lines.append(f"audit replay --verify: {'OK' if ok else 'MISMATCH'} ({time.monotonic() - t0:.1f} s, "
                 f"{res['segments']} segment(s), --jobs {jobs})")
    rep = res["report"]
    return {"ok": ok, "lines": lines, "ran_at": iso(time.time_ns() // 1_000_000),
            "window": {"from": iso(window[0]), "to": iso(window[1])}, "input_records": res["input_records"],
            "committed_offset": res["committed_offset"], "outputs_compared": rep.compared,
            "usage_compared": bill.compared, "segments": res["segments"], "states_checked": res["states_checked"],
            "states_different": res["states_different"],
            "missing": len(rep.missing) + len(bill.missing), "extra": len(rep.extra) + len(bill.extra),
            "different": len(rep.different) + len(bill.different) + res["states_different"]}


# ---------------------------------------------------------------- export


def _read_envelopes(conn, specs) -> list[tuple[str, int, int, Envelope]]:
    out = []

    def keep(m):
        if m.value is None:
            return
        try:
            out.append((m.topic, m.partition, m.offset, decode(m.value)))
        except DecodeError:
            pass

    async def go():
        for spec in specs:
            await _read_topic(conn, spec, keep)

    asyncio.run(go())
    return out


def export(cfg, tenant: str, out: Path, window: tuple[int | None, int | None], key: Path | None) -> int:
    """The tenant's evidence pack for the period (agents/evidence.py), with the verification run over it."""
    from agents import evidence
    from agents.client import Client

    client = Client(cfg)
    facts = _read_envelopes(client.conn(), (INVENTORY, NODE_CONTROL))
    latest: dict[str, Envelope] = {}
    for _, _, _, env in facts:
        if env.kind == "node.inventory":
            cur = latest.get(env.payload.node)
            if cur is None or (env.event_time_ms, env.seq) >= (cur.event_time_ms, cur.seq):
                latest[env.payload.node] = env
    report = verification(cfg, window)
    if not report["ok"]:  # the pack records it; whoever ran the export is told why at once
        print("\n".join(report["lines"]), file=sys.stderr)
    summary = evidence.write_pack(client, tenant, out, window[0], window[1], report,
                                  evidence.signing_key(cfg.home, key), list(latest.values()),
                                  [f for f in facts if f[3].kind != "node.inventory"])
    print(json.dumps({"out": str(out), "verified": report["ok"], **summary["sections"]}))
    return 0 if report["ok"] else 1


def verify_export(directory: Path, pubkey: Path | None) -> int:
    from agents.evidence import verify_pack

    problems = verify_pack(directory, pubkey)
    for p in problems:
        print(p)
    print(f"audit verify-export {directory}: {'OK' if not problems else 'FAILED'}"
          + ("" if pubkey else " (signed by the key in the manifest; pass --pubkey to check who signed)"))
    return 0 if not problems else 1


# ---------------------------------------------------------------- entry


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gpupool audit", description="audit the log: replay, verify, export")
    sub = p.add_subparsers(dest="action", required=True)
    r = sub.add_parser("replay", help="re-run the scheduler over its input log")
    r.add_argument("--verify", action="store_true", help="compare with the recorded outputs, the snapshots and the "
                                                         "bill, segment by segment (see --full)")
    r.add_argument("--from", dest="since", help="ISO time or epoch ms: compare outputs from this event time (only "
                                                "the segments that cover it are replayed)")
    r.add_argument("--to", dest="until", help="ISO time or epoch ms: compare outputs before this event time")
    r.add_argument("--from-offset", type=int, help="input offset: verify the segments from the one holding it")
    r.add_argument("--to-offset", type=int, help="input offset (exclusive): verify the segments up to it")
    r.add_argument("--jobs", type=int, help="processes verifying segments in parallel (default: one per CPU)")
    r.add_argument("--full", action="store_true", help="one replay from offset 0 in one process, the whole log in "
                                                       "memory (no segments, no snapshot checks)")
    e = sub.add_parser("export", help="a tenant's evidence pack for a period: sections, summary, verification, "
                                      "a signed manifest")
    e.add_argument("--tenant", required=True)
    e.add_argument("--out", required=True)
    e.add_argument("--from", dest="since", help="ISO time or epoch ms (default: the beginning)")
    e.add_argument("--to", dest="until", help="ISO time or epoch ms (default: now)")
    e.add_argument("--key", help="ed25519 private key (PEM) to sign with (default: the pool's evidence key)")
    v = sub.add_parser("verify-export", help="check an evidence pack's hashes and signature")
    v.add_argument("directory")
    v.add_argument("--pubkey", help="the pool's evidence public key (PEM) the pack must be signed with")
    return p


def run_audit(cfg, argv: list[str]) -> int:
    from aiokafka.errors import GroupAuthorizationFailedError, TopicAuthorizationFailedError

    try:
        return _run_audit(cfg, argv)
    except (GroupAuthorizationFailedError, TopicAuthorizationFailedError) as exc:
        raise SystemExit(f"{cfg.user} may not read the log ({type(exc).__name__}): the audit reads every topic, "
                         f"which only auditor principals may (gpupool user add NAME --role auditor; then --as NAME)")


def _run_audit(cfg, argv: list[str]) -> int:
    from agents.client import parse_time

    args = parser().parse_args(argv)
    if args.action == "replay":
        if not args.verify:
            from agents.client import Client

            committed, _, inputs = read_log(Client(cfg).conn())
            outs = _replay(inputs)
            print(f"replayed {len(inputs)} input records (committed {committed}): {len(outs)} outputs")
            return 0
        return verify(cfg, (parse_time(args.since), parse_time(args.until)), full=args.full, jobs=args.jobs,
                      offsets=(args.from_offset, args.to_offset))
    if args.action == "verify-export":
        return verify_export(Path(args.directory), Path(args.pubkey) if args.pubkey else None)
    return export(cfg, args.tenant, Path(args.out), (parse_time(args.since), parse_time(args.until)),
                  Path(args.key) if args.key else None)


if __name__ == "__main__":
    from infra import config as config_mod

    raise SystemExit(run_audit(config_mod.load(), sys.argv[1:]))
