"""A run's standard output and error, shipped as `job.log` pieces (docs/jobs.md, "Logs").

The runner hands every chunk it reads from a program's stdout or stderr to `LogShipper.output(job_id, attempt,
part, stream, data, eof)`; the shipper turns the bytes into `JobLog` pieces and publishes them through the agent's
own `publish` (the node principal's channel, `gpupool.node.PRINCIPAL`; the worker's relay forwards a node's pieces to
`gpupool.job-logs` only for jobs placed on that node).

- `output` never blocks and never waits on Kafka: it decodes, cuts and queues, and returns. A background task
  publishes the queued pieces in order. What cannot be held is dropped and counted, never buffered without bound.
- Bytes are decoded as UTF-8 with replacement, incrementally per stream (a character split across two reads is one
  character), and cut on line boundaries where possible: a piece holds at most `piece_chars` characters (the
  contract's 16384), ends at its last complete line when it has one, and small writes are batched: a stream's text
  is sent once `flush_s` old (its complete lines; a line without its end once `partial_s` old), or when a piece is
  full, or at the stream's end.
- Caps per run (a job's attempt and gang part on this node), all the operator's (infra/config.py):
  a rate (`GPUPOOL_LOG_RATE` bytes/s, a token bucket of `GPUPOOL_LOG_BURST` bytes), a total
  (`GPUPOOL_LOG_MAX_BYTES` per run), and what may wait unsent (`GPUPOOL_LOG_BUFFER` characters: a broker away or
  slow costs output, never the agent's memory). A cut is marked where it happened: the text before it goes out as
  its own piece, the next piece of that stream carries `dropped_bytes`, and the stream's last piece (`final`) carries
  what was cut after the last text. Each cut is counted by cap in the agent's metrics
  (`gpupool_node_log_dropped_bytes_total{cap="rate|size|buffer"}`).
- Each stream of a run numbers its pieces from 0 (`seq`), so a reader orders them and sees a gap; all pieces of a
  job on a node share one source, `NODE/log/JOB`, numbered by the agent's own per-source sequence.

Wiring (one line in the runner's owner): pass `shipper_for(agent).output` as the runner's output callback.
"""
from __future__ import annotations

import asyncio
import codecs
import inspect
import logging
import time
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from schemas.events import JobLog

log = logging.getLogger("gpupool.agent.logs")

STREAMS = ("stdout", "stderr")
PIECE_CHARS = 16384  # JobLog.text's limit
FINISHED_KEPT = 10_000  # runs remembered as ended (a late chunk of one is ignored, not numbered afresh)


@dataclass(frozen=True)
class LogCaps:
    rate_bytes_s: int = 1 << 20
    burst_bytes: int = 4 << 20
    max_bytes: int = 64 << 20  # per run (attempt and part)
    buffer_chars: int = 4 << 20  # decoded text held unsent, per run
    piece_chars: int = PIECE_CHARS
    flush_s: float = 0.25  # a stream's complete lines wait at most this long
    partial_s: float = 1.0  # a line without its end (a progress bar's \r updates) waits at most this long

    @classmethod
    def of(cls, cfg) -> "LogCaps":
        """The caps of a configuration (infra/config.py: GPUPOOL_LOG_RATE, _BURST, _MAX_BYTES, _BUFFER)."""
        return cls(rate_bytes_s=cfg.log_rate_bytes_s, burst_bytes=cfg.log_burst_bytes, max_bytes=cfg.log_max_bytes,
                   buffer_chars=cfg.log_buffer_bytes)


@dataclass
class _Stream:
    decoder: codecs.IncrementalDecoder = field(default_factory=lambda: codecs.getincrementaldecoder("utf-8")("replace"))
    pending: str = ""  # decoded, not yet cut into a piece
    since: float | None = None  # when the oldest pending text came
    dropped: int = 0  # bytes cut since the last piece: marked on the next one
    seq: int = 0
    done: bool = False  # its final piece is cut


@dataclass
class _Run:
    job_id: str
    attempt: int
    part: int
    node: str
    tokens: float
    refilled: float
    taken: int = 0  # bytes taken (the total cap counts these)
    held: int = 0  # characters pending or queued, not yet published (the buffer cap counts these)
    streams: dict[str, _Stream] = field(default_factory=lambda: {s: _Stream() for s in STREAMS})


class LogShipper:
    """`output` for a runner, a background publisher for the agent. `node`: the node a run's pieces are stated for,
    or a function of the job id that finds it (a simulated fleet's many nodes; `for_node` binds one);
    `publish(payload, source)`: the agent's. `metrics`: an AgentMetrics, or a function that gives it (an agent that
    makes its metrics after its runner). `clock`: monotonic seconds (the caps' and the batching's; tests give their
    own)."""

    def __init__(self, node: str | Callable[[str], str | None], publish: Callable[..., Awaitable[None]], *,
                 caps: LogCaps = LogCaps(), metrics=None, clock: Callable[[], float] = time.monotonic,
                 retry_s: float = 1.0):
        self.node_of = node if callable(node) else (lambda _job, _n=node: _n)
        self.publish = publish
        self.caps = caps
        self._metrics = metrics  # agents/node/metrics.py AgentMetrics, a function giving it, or None
        self.clock = clock
        self.retry_s = retry_s
        self.runs: dict[tuple[str, int, int], _Run] = {}
        self.queue: deque[tuple[_Run, JobLog]] = deque()
        self.stats = {"taken_bytes": 0, "pieces": 0, "dropped:rate": 0, "dropped:size": 0, "dropped:buffer": 0,
                      "dropped:no_node": 0}
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._closed = False
        self._finished: OrderedDict[tuple[str, int, int], None] = OrderedDict()  # runs whose streams both ended

    @property
    def metrics(self):
        m = self._metrics
        return m() if callable(m) else m

    def for_node(self, node: str) -> Callable[..., None]:
        """`output` for the runs of one node (a simulated fleet's runner, which knows the node of each run)."""
        def output(job_id: str, attempt: int, part: int, stream: str, data: bytes, eof: bool = False) -> None:
            self.output(job_id, attempt, part, stream, data, eof, node=node)
        return output

    # ---------------------------------------------------------------- the runner's side: never blocks

    def output(self, job_id: str, attempt: int, part: int, stream: str, data: bytes, eof: bool = False, *,
               node: str | None = None) -> None:
        """A chunk of one run's stdout or stderr (`data` may be empty; `eof`: the stream ended). Returns at once."""
        if stream not in STREAMS:
            raise ValueError(f"stream {stream!r}: stdout or stderr")
        run = self._run(job_id, int(attempt), int(part), node, len(data))
        if run is None:
            return
        s = run.streams[stream]
        if s.done:
            return  # a chunk after the stream's end: the runner's mistake, nothing to mark it on
        now = self.clock()
        if data:
            self._take(run, s, stream, bytes(data), now)
        if eof:
            self._decode_rest(run, s)
            self._cut(run, s, stream, "all", final=True)
            s.done = True
            if all(x.done for x in run.streams.values()):
                key = (run.job_id, run.attempt, run.part)
                del self.runs[key]
                self._finished[key] = None
                if len(self._finished) > FINISHED_KEPT:
                    self._finished.popitem(last=False)
        self._kick()

    def _run(self, job_id: str, attempt: int, part: int, node: str | None, size: int) -> _Run | None:
        key = (job_id, attempt, part)
        run = self.runs.get(key)
        if run is None and key in self._finished:
            return None  # a chunk after both streams ended: nothing to mark it on
        if run is None:
            node = node or self.node_of(job_id)
            if not node:
                self._dropped("no_node", size)
                log.warning("output of %s (attempt %d, part %d) for no node of this agent: dropped", job_id, attempt,
                            part)
                return None
            run = self.runs[key] = _Run(job_id, attempt, part, node, tokens=float(self.caps.burst_bytes),
                                        refilled=self.clock())
        return run

    def _take(self, run: _Run, s: _Stream, stream: str, data: bytes, now: float) -> None:
        caps = self.caps
        run.tokens = min(float(caps.burst_bytes), run.tokens + (now - run.refilled) * caps.rate_bytes_s)
        run.refilled = now
        by_size = max(0, caps.max_bytes - run.taken)
        by_rate = int(run.tokens)
        by_buffer = max(0, caps.buffer_chars - run.held)
        n = min(len(data), by_size, by_rate, by_buffer)
        if n < len(data):
            cap = "size" if by_size == n else "rate" if by_rate == n else "buffer"
            self._dropped(cap, len(data) - n)
        keep = data[:n]
        if keep:
            run.tokens -= n
            run.taken += n
            self.stats["taken_bytes"] += n
            if self.metrics is not None:
                self.metrics.log_bytes.labels(stream).inc(n)
            text = s.decoder.decode(keep)
            if text:
                s.pending += text
                run.held += len(text)
                if s.since is None:
                    s.since = now
        if n < len(data):
            # the cut is marked where it happened: the text before it leaves as its own piece (a character the cut
            # split is its replacement), and the next piece says how much is missing before it
            self._decode_rest(run, s)
            self._cut(run, s, stream, "all")
            s.dropped += len(data) - n
        if len(s.pending) >= caps.piece_chars:
            self._cut(run, s, stream, "full")

    @staticmethod
    def _decode_rest(run: _Run, s: _Stream) -> None:
        """What the decoder holds of a character not yet complete, as its replacement: a cut or the end."""
        rest = s.decoder.decode(b"", final=True)
        s.decoder.reset()
        s.pending += rest
        run.held += len(rest)

    def _dropped(self, cap: str, n: int) -> None:
        self.stats[f"dropped:{cap}"] += n
        metrics = self.metrics
        if metrics is not None:
            metrics.log_dropped.labels(cap).inc(n)

    def _cut(self, run: _Run, s: _Stream, stream: str, mode: str, final: bool = False) -> None:
        """Cut pending text into pieces. `mode`: "full" (only full pieces, each at its last line end if it has one),
        "lines" (full pieces, then the complete lines left), "all" (everything: a cut, the stream's end). `final`:
        the stream's last piece, cut even with no text (it carries what was dropped since the last piece)."""
        size = self.caps.piece_chars
        last_queued_final = False
        while s.pending:
            text = s.pending
            if len(text) >= size:
                take = text[:size].rfind("\n") + 1 or size  # a line longer than a piece is cut inside
            elif mode == "all":
                take = len(text)
            elif mode == "lines":
                take = text.rfind("\n") + 1
                if not take:
                    break
            else:
                break
            s.pending = text[take:]
            last_queued_final = final and not s.pending
            self._queue(run, s, stream, text[:take], last_queued_final)
        if not s.pending:
            s.since = None
        if final and not last_queued_final:
            self._queue(run, s, stream, "", True)

    def _queue(self, run: _Run, s: _Stream, stream: str, text: str, final: bool) -> None:
        piece = JobLog(job_id=run.job_id, node=run.node, attempt=run.attempt, part=run.part, stream=stream,
                       seq=s.seq, text=text, dropped_bytes=s.dropped, final=final)
        s.seq += 1
        s.dropped = 0
        self.queue.append((run, piece))

    # ---------------------------------------------------------------- the agent's side: publish in order

    def _kick(self) -> None:
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return  # no loop (a unit test's synchronous feeding): `flush` publishes
        if self._task is None or self._task.done():
            self.start()
        if self.queue:
            self._wake.set()

    def start(self) -> asyncio.Task:
        """The publisher task (started by the first output; an agent may start it itself)."""
        if self._task is None or self._task.done():
            self._wake = asyncio.Event()
            self._task = asyncio.create_task(self._publisher())
        return self._task

    def tick(self) -> None:
        """Cut what has waited long enough: complete lines after flush_s, a line without its end after partial_s."""
        now = self.clock()
        for run in list(self.runs.values()):
            for stream, s in run.streams.items():
                if s.pending and s.since is not None and now - s.since >= self.caps.flush_s:
                    self._cut(run, s, stream, "all" if now - s.since >= self.caps.partial_s else "lines")

    async def _send_queued(self) -> None:
        while self.queue:
            run, piece = self.queue[0]
            while True:
                try:
                    out = self.publish(piece, f"{run.node}/log/{run.job_id}")
                    if inspect.isawaitable(out):
                        await out
                    break
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # noqa: BLE001 - the broker away: keep the piece, retry; the caps bound it
                    log.warning("job.log of %s not published (%s); again in %.1f s", run.job_id, exc, self.retry_s)
                    await asyncio.sleep(self.retry_s)
            self.queue.popleft()
            run.held -= len(piece.text)
            self.stats["pieces"] += 1

    async def _publisher(self) -> None:
        while not self._closed:
            try:
                await asyncio.wait_for(self._wake.wait(), self.caps.flush_s)
            except asyncio.TimeoutError:
                pass
            self._wake.clear()
            self.tick()
            await self._send_queued()

    async def flush(self) -> None:
        """Cut everything pending (as pieces, not final) and publish every queued piece: an agent's shutdown, or a
        test that feeds bytes without a running publisher."""
        for run in list(self.runs.values()):
            for stream, s in run.streams.items():
                if s.pending:
                    self._cut(run, s, stream, "all")
        if self._task is not None and not self._task.done():
            self._wake.set()
            while self.queue and not self._task.done():
                await asyncio.sleep(0.01)
        if self.queue:
            await self._send_queued()

    async def close(self, timeout_s: float = 10.0) -> None:
        """Publish what is pending (within `timeout_s`), then stop the publisher."""
        try:
            await asyncio.wait_for(self.flush(), timeout_s)
        except asyncio.TimeoutError:
            log.warning("%d job.log piece(s) not published at shutdown", len(self.queue))
        self._closed = True
        task = self._task
        if task is not None and not task.done():
            self._wake.set()
            try:
                await asyncio.wait_for(asyncio.shield(task), 2.0)
            except asyncio.TimeoutError:
                task.cancel()  # stuck publishing to a broker that is away
                await asyncio.gather(task, return_exceptions=True)


def _sim_node_of(agent) -> Callable[[str], str | None]:
    """A simulated fleet's node of a job: the one running it (a fallback: `for_node` says it outright)."""
    def node_of(job_id: str) -> str | None:
        return next((name for name, n in agent.nodes.items() if job_id in n.running), None)
    return node_of


def shipper_for(agent) -> LogShipper:
    """The one shipper of a node agent (made on first use and kept on it): its node (the NVML agent's own, or the
    simulated fleet's node running the job), its `publish`, its metrics (read when used: they may come later) and
    the caps of its configuration. Wiring a runner: `output=shipper_for(agent).output` (one node), or
    `shipper_for(agent).for_node(NODE)` (a fleet); at shutdown, `await shipper_for(agent).close()` sends what is
    still held."""
    shipper = getattr(agent, "log_shipper", None)
    if shipper is None:
        node = getattr(agent, "node", None) if isinstance(getattr(agent, "node", None), str) else _sim_node_of(agent)
        cfg = getattr(agent, "cfg", None)
        shipper = LogShipper(node, agent.publish, caps=LogCaps.of(cfg) if cfg is not None else LogCaps(),
                             metrics=lambda: getattr(agent, "metrics", None))
        agent.log_shipper = shipper
    return shipper
