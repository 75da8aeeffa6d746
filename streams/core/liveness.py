"""Whether a node is silent, judged on the log's time, never on the worker's wall clock. Pure; the worker's liveness
timer calls it (streams/app.py).

A node is silent when the telemetry partition it writes to has been read, in log time (the broker's append time),
`misses` heartbeat intervals past the node's latest heartbeat. A partition's read time is the log's "now" where
the worker has read everything there is, and the append time of the last record it folded where it is behind: so a
worker that was stopped, restarted, stalled by a slow query or buried under a burst reads the backlog before it
judges anyone. Silence is counted only over log time the worker watched: from its start, and again from the end of
any gap in its own view of the log (a broker outage, a stall of the worker: consecutive probes of the log's clock
more than `gap_intervals` heartbeat intervals apart). After such a start, nobody is declared silent for
`recovery_ms` of log time: the nodes' own producers reconnect with backoff and flush what they buffered (Kubernetes'
node-monitor grace plays the same part). A node not heard from since then is judged once every partition is read up
to now.

Each verdict (silent, or alive again) gets a sequence number above every earlier one for that node, so an "alive
again" is never taken for older than the "silent" it answers.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Liveness:
    interval_ms: int = 1000
    misses: int = 2
    gap_intervals: int = 3
    recovery_ms: int = 10_000
    heard: dict[str, tuple[int, int]] = field(default_factory=dict)  # node -> (partition, log time of its heartbeat)
    read: dict[int, tuple[int, int]] = field(default_factory=dict)  # partition -> (next offset, log time read to)
    start: dict[int, int] = field(default_factory=dict)  # partition -> the offset this worker began reading at
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

    def clock(self, partition: int, log_now: int, highwater: int | None) -> int | None:
        """How far `partition` is read, in log time; None while that is not known."""
        nxt = self.read.get(partition, (self.start.get(partition), None))[0]
        if highwater is None or nxt is None:
            return None
        if nxt >= highwater:
            return log_now
        return self.read[partition][1] if partition in self.read else None

    def silent(self, nodes: list[str], log_now: int, highwaters: dict[int, int | None]) -> list[str]:
        """Of `nodes` (those the view holds alive), the ones to declare silent now."""
        gap = self.last_probe_ms is not None and log_now - self.last_probe_ms > self.gap_intervals * self.interval_ms
        if self.started_ms is None or gap:
            self.started_ms = log_now  # the worker did not watch the log meanwhile: nobody's silence counts from it
        self.last_probe_ms = log_now
        limit = self.misses * self.interval_ms
        clocks = {p: self.clock(p, log_now, hw) for p, hw in highwaters.items()}
        all_read = bool(clocks) and all(c == log_now for c in clocks.values())
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

    def next_seq(self, node: str, log_ms: int) -> int:
        seq = max(log_ms * 1000, self.seq.get(node, -1) + 1)
        self.seq[node] = seq
        return seq

    def forget(self, partitions: set[int]) -> None:
        """Partitions another worker owns now: their nodes are its to judge."""
        self.heard = {n: v for n, v in self.heard.items() if v[0] not in partitions}
        for p in partitions:
            self.read.pop(p, None)
            self.start.pop(p, None)
