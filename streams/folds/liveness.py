"""Whether a node is silent, judged on the log's time, never on the worker's wall clock. Pure; the worker's liveness
timer calls it (streams/edge/app.py).

A node is silent when the telemetry partition it writes to has been read, in log time (the broker's append time),
`misses` heartbeat intervals past the node's latest heartbeat there. How far a partition is read, in log time, is
known only from the log itself:

* every record folded says the partition is read up to that record's append time (`folded`);
* a probe of the log's clock at log time T, with the partition's end offset E **asked of the broker after T** (a
  record appended before T has an offset below E): once the fold has read up to E, the partition is read up to T
  (`silent(nodes, T, ends)`; `clock`). Probes not reached yet are kept (`marks`) and count when the fold reaches them.

So a worker that was stopped (SIGSTOP), restarted, stalled by a slow query, or buried under a tenant's burst judges
by what it has read, never by its own wall clock or by how long it was away: the records it has not read yet are
not silence. The end offset must be asked after the probe: the highwater of the fold's last fetch is older than the
probe (a fetch the busy or paused worker made seconds before), and taking it for the end "now" turned every second
of the worker's delay into a node's silence (issue #31: a 5,000-request burst, or a 5 s SIGSTOP, and all four
healthy nodes were declared dead).

Silence is counted only over log time the worker watched: from its start, and again from the end of any gap in its
own view of the log (a broker outage: consecutive probes of the log's clock more than `gap_intervals` heartbeat
intervals apart). After such a start, nobody is declared silent for `recovery_ms` of log time: the nodes' own
producers reconnect with backoff and flush what they buffered (Kubernetes' node-monitor grace plays the same part).
A node not heard from since then is judged once every partition is read up to now.

Each verdict (silent, or alive again) gets a sequence number above every earlier one for that node -- above the
view's own last liveness fact too, so one written by an earlier run of the worker (or another worker) never makes an
"alive again" look older than the "silent" it answers.

**The scheduler's readiness is the node view's** (`forward_to_scheduler`, `alive_again`): the scheduler folds the
node facts it is sent (inventory, cordon, health, liveness, removal) but no heartbeat, so it knows a node is alive
again only from an inventory or an "alive again". The worker's folds therefore (1) send an "alive again" whenever a
node's view goes from silent to alive, whatever brought it back (a heartbeat, telemetry, an inventory), with the
view's latest heartbeat; (2) keep from the scheduler a "silent" that the view already disproves (a heartbeat newer
than the one the silence was judged after was folded before the silence was read back): forwarded, it made the
scheduler drop the node and interrupt its jobs while the view -- and `gpupool node list` -- had it alive, and no
"alive again" ever followed because the view never went silent (issue #31's nodes refused for five minutes until
their agent was restarted); and (3) answer with an "alive again" every liveness record read back after which the
view is alive but the scheduler may not know it: a disproved "silent", an "alive again" dropped as not newer (a
restarted worker numbers without knowing of the verdicts in flight), one whose heartbeat a later silence covers. With these, a node is ready to the scheduler exactly when its view is alive,
once the facts in flight are read (tests/test_liveness.py::test_the_schedulers_readiness_is_the_node_views).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from schemas.envelope import Envelope
from schemas.events import NodeLiveness


@dataclass
class Liveness:
    interval_ms: int = 1000
    misses: int = 2
    gap_intervals: int = 3
    recovery_ms: int = 10_000
    heard: dict[str, tuple[int, int]] = field(default_factory=dict)  # node -> (partition, log time of its heartbeat)
    read: dict[int, tuple[int, int]] = field(default_factory=dict)  # partition -> (next offset, log time read to)
    start: dict[int, int] = field(default_factory=dict)  # partition -> the offset this worker began reading at
    marks: dict[int, list[tuple[int, int]]] = field(default_factory=dict)  # partition -> [(end offset, log time)]
    started_ms: int | None = None  # log time from which silence counts: this worker's start, or the end of a gap
    last_probe_ms: int | None = None
    seq: dict[str, int] = field(default_factory=dict)

    def heard_from(self, node: str, partition: int, offset: int, log_ms: int) -> None:
        prev = self.heard.get(node)
        self.heard[node] = (partition, max(log_ms, prev[1]) if prev else log_ms)
        self.folded(partition, offset, log_ms)

    def revived(self, node: str, partition: int, log_ms: int) -> None:
        """The node's view came alive again from a record that is not a heartbeat (its inventory, on the nodes topic:
        an agent that comes back reports it first): its silence counts from that record's log time, not from its last
        heartbeat before it went silent -- else the next probe declared it silent again at once, and the work just
        placed on it was interrupted (a restart for nothing). `partition`: its telemetry partition, whose read time
        judges it."""
        prev = self.heard.get(node)
        self.heard[node] = (partition, max(log_ms, prev[1]) if prev else log_ms)

    def folded(self, partition: int, offset: int, log_ms: int) -> None:
        nxt, t = self.read.get(partition, (0, 0))
        self.read[partition] = (max(nxt, offset + 1), max(t, log_ms))

    def _next(self, partition: int) -> int | None:
        return self.read[partition][0] if partition in self.read else self.start.get(partition)

    def probed(self, partition: int, end: int, log_ms: int) -> None:
        """The broker said, after log time `log_ms`, that `partition` ends at `end`: everything appended to it
        before `log_ms` is below `end`."""
        marks = self.marks.setdefault(partition, [])
        if not marks or marks[-1][1] < log_ms:
            marks.append((end, log_ms))
        self.clock(partition)

    def clock(self, partition: int) -> int | None:
        """How far `partition` is read, in log time: the latest probe whose end offset the fold has reached, or the
        append time of the last record folded, whichever is later; None while neither is known."""
        nxt = self._next(partition)
        marks = self.marks.get(partition)
        if nxt is not None and marks:
            reached = [t for end, t in marks if end <= nxt]
            if reached:
                self.marks[partition] = [(end, t) for end, t in marks if end > nxt]
                _, t = self.read.get(partition, (nxt, None))
                self.read[partition] = (nxt, max(reached) if t is None else max(t, max(reached)))
        return self.read[partition][1] if partition in self.read else None

    def silent(self, nodes: list[str], log_now: int, ends: dict[int, int | None]) -> list[str]:
        """Of `nodes` (those the view holds alive), the ones to declare silent now. `log_now`: the log's time by a
        probe of its clock; `ends`: each telemetry partition this worker judges, with its end offset as the broker
        gave it **after** that probe (None where not known)."""
        gap = self.last_probe_ms is not None and log_now - self.last_probe_ms > self.gap_intervals * self.interval_ms
        if self.started_ms is None or gap:
            self.started_ms = log_now  # the worker did not watch the log meanwhile: nobody's silence counts from it
        self.last_probe_ms = max(log_now, self.last_probe_ms or log_now)
        for p, end in ends.items():
            if end is not None:
                self.probed(p, end, log_now)
        limit = self.misses * self.interval_ms
        clocks = {p: self.clock(p) for p in ends}
        all_read = bool(clocks) and all(c is not None and c >= log_now for c in clocks.values())
        if log_now - self.started_ms < max(self.recovery_ms, limit):
            return []
        out = []
        for node in nodes:
            if node in self.heard:
                p, t = self.heard[node]
                c = clocks.get(p)
                if c is not None and c - t > limit:
                    out.append(node)
            elif all_read:
                out.append(node)
        return out

    def next_seq(self, node: str, log_ms: int, applied: int = -1) -> int:
        """The sequence number of a verdict on `node` at `log_ms`: above every earlier one of this judge and above
        `applied`, the last liveness fact the node's view holds (whoever wrote it)."""
        seq = max(log_ms * 1000, self.seq.get(node, -1) + 1, applied + 1)
        self.seq[node] = seq
        return seq

    def forget(self, partitions: set[int]) -> None:
        """Partitions another worker owns now: their nodes are its to judge."""
        self.heard = {n: v for n, v in self.heard.items() if v[0] not in partitions}
        for p in partitions:
            self.read.pop(p, None)
            self.start.pop(p, None)
            self.marks.pop(p, None)


def liveness_source(node: str) -> str:
    return f"{node}/liveness"


def forward_to_scheduler(env: Envelope, after) -> bool:
    """Whether a node fact the scheduler reads goes to it, given the node view `after` folding it: all do, except a
    "silent" that the view already disproves (`after` is alive: a heartbeat newer than the one the silence was
    judged after is in the view). See the module's docstring."""
    p = env.payload
    return not (isinstance(p, NodeLiveness) and not p.alive and after.alive)


def alive_again(before, after, env: Envelope) -> bool:
    """Whether an "alive again" must be sent after fold-nodes read `env` (`before` -> `after`; `after is before`
    where the view dropped it as not newer), so that the scheduler holds the node alive exactly when the view does:

    * any record that brought a silent node's view back to life (an inventory; the telemetry task asks the same of
      its batches);
    * a liveness record after which the view is alive but the scheduler may not know it: a "silent" the view
      disproves (kept from the scheduler), an "alive again" dropped as not newer (numbered by a restarted worker
      that did not know of a verdict in flight: the answer it carried is lost), or one whose heartbeat a later
      silence already covers. Not an "alive again" the view applied and stays alive after: the scheduler gets it
      and holds the node alive too."""
    p = env.payload
    if isinstance(p, NodeLiveness):
        if after is None or not after.alive:
            return False
        told = p.alive and after is not before and p.last_heartbeat_ms > after.silent_since_ms
        return not told
    return before is not None and not before.alive and after.alive
