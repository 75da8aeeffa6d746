"""The audit's rule, without I/O: the scheduler's replay over recorded input records, and the comparisons of what
it produces with the recorded outputs and the bill (docs/billing.md; `gpupool audit`, agents/audit.py, explains the
rule). Used by the whole-log audit (agents/audit.py) and the segmented one (agents/audit_segments.py) alike."""
from __future__ import annotations

from dataclasses import dataclass, field

from agents.audit_log import Recorded
from agents.scheduler.core import SOURCE, live_config, replay
from agents.scheduler.elastic import SOURCE as AUTOSCALER
from schemas.envelope import DecodeError, Envelope, decode
from schemas.topics import COMMANDS
from streams.folds.rows import COLUMNS, rows_for

OUR_SOURCES = frozenset({SOURCE, AUTOSCALER})
USAGE_KEY_COLUMNS = ("topic", "partition", "offset")
USAGE_COMPARED = tuple(c for c in COLUMNS["usage"] if c not in USAGE_KEY_COLUMNS)
SHOW = 20


# ---------------------------------------------------------------- pure comparison


@dataclass
class Report:
    compared: int = 0
    matched: int = 0
    missing: list[str] = field(default_factory=list)
    extra: list[str] = field(default_factory=list)
    different: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (self.missing or self.extra or self.different)

    def lines(self, title: str) -> list[str]:
        out = [f"{title}: compared {self.compared}, matched {self.matched}, missing {len(self.missing)}, "
               f"extra {len(self.extra)}, different {len(self.different)}"]
        for label, items in (("missing", self.missing), ("extra", self.extra), ("different", self.different)):
            for item in items[:SHOW]:
                out.append(f"  {label}: {item}")
            if len(items) > SHOW:
                out.append(f"  ... {len(items) - SHOW} more {label}")
        return out


def _in_window(t: int, window: tuple[int | None, int | None]) -> bool:
    lo, hi = window
    return (lo is None or t >= lo) and (hi is None or t < hi)


def _doc(env: Envelope) -> dict:
    return env.model_dump(mode="json")


def _diff_paths(a, b, path: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b)):
            out.extend(_diff_paths(a.get(k), b.get(k), f"{path}.{k}" if path else k))
        return out
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        out = []
        for i, (x, y) in enumerate(zip(a, b)):
            out.extend(_diff_paths(x, y, f"{path}[{i}]"))
        return out
    return [] if a == b else [f"{path}: replay {a!r} != recorded {b!r}"]


def _label(env: Envelope) -> str:
    p = env.payload
    what = getattr(p, "command_id", None) or getattr(p, "job_id", None) or ""
    return f"{env.event_id} {p.kind} {what}".rstrip()


def foreign_record(rec: Recorded, window: tuple[int | None, int | None], rep: Report) -> None:
    """A record of the output topics that none of the scheduler's sources wrote (the full and the segmented audit
    alike): on the commands topic it is extra -- undecodable, or a command only the scheduler may write -- when in
    the window; elsewhere it is another producer's record on a shared topic (users' requests, node reports)."""
    if rec.topic != COMMANDS.name:
        return
    try:
        env = decode(rec.value)
    except DecodeError as exc:
        rep.compared += 1
        rep.extra.append(f"{rec.topic}/{rec.partition}@{rec.offset} undecodable ({exc.code})")
        return
    if _in_window(env.event_time_ms, window):
        rep.compared += 1
        rep.extra.append(f"{_label(env)} from source {env.source!r} at {rec.topic}/{rec.partition}@{rec.offset}: "
                         f"only the scheduler writes commands")


def compare_outputs(replayed: list[tuple[int, Envelope]], recorded: list[Recorded], committed: int,
                    window: tuple[int | None, int | None] = (None, None)) -> Report:
    """Replay outputs (input offset that caused them, envelope) against the records read from the output topics."""
    rep = Report()
    by_id: dict[str, tuple[int, Envelope]] = {}
    for off, env in replayed:
        by_id[env.event_id] = (off, env)
    seen: dict[str, list[Recorded]] = {}
    for rec in recorded:
        try:
            env = decode(rec.value)
        except DecodeError:
            env = None
        if env is None or env.source not in OUR_SOURCES:
            foreign_record(rec, window, rep)
            continue
        seen.setdefault(env.event_id, []).append(rec)
        mine = by_id.get(env.event_id)
        t = mine[1].event_time_ms if mine else env.event_time_ms
        if not _in_window(t, window):
            continue
        rep.compared += 1
        if mine is None:
            rep.extra.append(f"{_label(env)} at {rec.topic}/{rec.partition}@{rec.offset}: the replay never "
                             f"produces it")
            continue
        diffs = _diff_paths(_doc(mine[1]), _doc(env))
        if diffs:
            rep.different.append(f"{_label(mine[1])} at {rec.topic}/{rec.partition}@{rec.offset}: "
                                 + "; ".join(diffs[:5]))
        else:
            rep.matched += 1
    for off, env in replayed:
        if off < committed and env.event_id not in seen and _in_window(env.event_time_ms, window):
            rep.compared += 1
            rep.missing.append(f"{_label(env)} (caused by input offset {off} < committed {committed})")
    return rep


def usage_row(env: Envelope) -> dict:
    row = rows_for(env, "", 0, 0)["usage"][0]
    return {c: v for c, v in zip(COLUMNS["usage"], row) if c not in USAGE_KEY_COLUMNS}


def _norm(v):
    return bool(v) if isinstance(v, bool) else (int(v) if isinstance(v, int) else str(v))


def compare_bill(expected: list[Envelope], rows: list[dict], not_yet_sunk: set[str] = frozenset(),
                 known_ids: set[str] | None = None) -> Report:
    """Replay usage events against `gpupool.usage FINAL` rows (dicts with the usage columns), keyed by event id.

    `expected`: replay usage events ClickHouse must hold; `not_yet_sunk`: event ids the sink has not reached yet
    (neither missing nor extra); `known_ids`: every usage event id the replay produces (rows outside are extra)."""
    return compare_bill_rows({e.event_id: usage_row(e) for e in expected}, rows, not_yet_sunk, known_ids)


def compare_bill_rows(want: dict[str, dict], rows: list[dict], not_yet_sunk: set[str] = frozenset(),
                      known_ids: set[str] | None = None) -> Report:
    """`compare_bill` with the expected rows made already (event id -> usage_row)."""
    rep = Report()
    known = set(want) | set(not_yet_sunk) | (known_ids or set())
    have: dict[str, dict] = {}
    for r in rows:
        have[str(r["event_id"])] = r
    for eid, r in have.items():
        if eid not in want:
            if eid not in known:
                rep.compared += 1
                rep.extra.append(f"usage row {eid} (tenant {r.get('tenant')}, job {r.get('job_id')}): "
                                 f"the replay never produces it")
            continue
        rep.compared += 1
        diffs = [f"{c}: replay {want[eid][c]!r} != clickhouse {r.get(c)!r}" for c in USAGE_COMPARED
                 if c != "event_id" and _norm(want[eid][c]) != _norm(r.get(c))]
        if diffs:
            rep.different.append(f"usage row {eid} (job {want[eid]['job_id']}): " + "; ".join(diffs))
        else:
            rep.matched += 1
    for eid, w in want.items():
        if eid not in have:
            rep.compared += 1
            rep.missing.append(f"usage row {eid} (tenant {w['tenant']}, job {w['job_id']})")
    return rep


def replay_records(values: list[tuple[int, bytes | None, int]], progress=None) -> list[tuple[int, Envelope]]:
    """Step the pure scheduler over (offset, raw value, log time) input records, each at the broker's append time
    the live scheduler saw, configured as the live agent is (`core.live_config`); outputs tagged with their input
    offset. The replay is `core.replay`, the one the agent's rebuild runs."""
    outs: list[tuple[int, Envelope]] = []
    n = len(values)

    def tag(i: int, got: list[Envelope]) -> None:
        off = values[i][0]
        outs.extend((off, o) for o in got)
        if progress:
            progress(i + 1, n)

    replay([raw for _, raw, _ in values], [t for _, _, t in values], on_outputs=tag, **live_config())
    return outs
