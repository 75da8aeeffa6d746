"""A node agent's serving replicas (issue #33 items 4 and 5, docs/serving.md): the readiness probe, the Prometheus
scrape, the drain before a stop. Used by the simulated fleet (sim_agent.py) and the NVML agent alike, for a placement
that carries `serve`; what it learns goes out as the node's own reports (`replica.ready`, `replica.unready`,
`replica.metrics`) through the agent's `publish`, on the job's own source, so the relay checks the node speaks of its
own job and the scheduler reads them in order with the job's other events.

- probe: `GET http://127.0.0.1:PORT{readiness_path}` every `probe_s` (0.5 s); the first 200 answer makes it ready
  (`replica.ready` with the node's advertised address and the port); `FAILURES` (3) failed probes in a row after that
  make it unready (`replica.unready`, probe_failed), and a later answer ready again.
- scrape: while ready, `GET {metrics_path}` every `scrape_s` (1 s) for a service whose `serve.metrics` is `vllm` or
  `sglang`, parsed by agents/node/scrape.py into a `replica.metrics`.
- drain: before the node signals a serving replica to stop (a release, a preemption, a move, the agent's shutdown),
  it says `replica.unready` (draining) and waits `drain_s` (GPUPOOL_DRAIN_S, default 3 s) so the router takes it out
  of rotation and its requests in flight finish; then the ordinary stop (SIGTERM, grace, SIGKILL).

GPUPOOL_PROBE_S, GPUPOOL_SCRAPE_S and GPUPOOL_DRAIN_S set the three periods.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from typing import Awaitable, Callable

from agents.node.scrape import replica_metrics
from schemas.events import PlaceJob, ReplicaMetrics, ReplicaReady, ReplicaUnready

log = logging.getLogger("gpupool.serving")

FAILURES = 3
MAX_BODY = 4 << 20
Publish = Callable[[object, str], Awaitable[None]]  # (payload, source) -> sent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def http_get(host: str, port: int, path: str, timeout: float = 2.0) -> tuple[int, bytes]:
    """A plain HTTP/1.0 GET: (status, body); (0, b"") when nothing answered in time."""
    async def go():
        reader, writer = await asyncio.open_connection(host, port)
        try:
            writer.write(f"GET {path} HTTP/1.0\r\nHost: {host}\r\nAccept: */*\r\n\r\n".encode())
            await writer.drain()
            data = await reader.read(MAX_BODY)
            while len(data) < MAX_BODY:
                more = await reader.read(MAX_BODY - len(data))
                if not more:
                    break
                data += more
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()
        head, _, body = data.partition(b"\r\n\r\n")
        try:
            return int(head.split(b" ", 2)[1]), body
        except (IndexError, ValueError):
            return 0, b""
    try:
        return await asyncio.wait_for(go(), timeout)
    except (OSError, asyncio.TimeoutError):
        return 0, b""


def periods(environ=os.environ) -> tuple[float, float, float]:
    """(probe_s, scrape_s, drain_s) from GPUPOOL_PROBE_S, GPUPOOL_SCRAPE_S, GPUPOOL_DRAIN_S."""
    def f(name: str, default: float) -> float:
        try:
            return max(0.0, float(environ.get(name) or default))
        except ValueError:
            return default
    return f("GPUPOOL_PROBE_S", 0.5), f("GPUPOOL_SCRAPE_S", 1.0), f("GPUPOOL_DRAIN_S", 3.0)


class Replica:
    """One serving run on this node: its probe-and-scrape loop."""

    def __init__(self, node: str, address: str, place: PlaceJob, port: int, publish: Publish,
                 now_ms: Callable[[], int], probe_s: float, scrape_s: float):
        self.node, self.address, self.place, self.port = node, address or "127.0.0.1", place, port
        self.publish, self.now_ms = publish, now_ms
        self.probe_s, self.scrape_s = probe_s, scrape_s
        self.source = f"{node}/job/{place.job_id}"
        self.ready = False
        self.draining = False
        self.task: asyncio.Task | None = None

    def _ids(self) -> dict:
        p = self.place
        return {"job_id": p.job_id, "node": self.node, "command_id": p.command_id, "attempt": p.attempt}

    async def loop(self) -> None:
        serve = self.place.serve
        failures = 0
        next_scrape = 0.0
        loop = asyncio.get_running_loop()
        while not self.draining:
            status, _ = await http_get("127.0.0.1", self.port, serve.readiness_path)
            if self.draining:
                return
            if status == 200:
                failures = 0
                if not self.ready:
                    self.ready = True
                    await self.publish(ReplicaReady(**self._ids(), address=self.address, port=self.port),
                                       self.source)
            else:
                failures += 1
                if self.ready and failures >= FAILURES:
                    self.ready = False
                    await self.publish(ReplicaUnready(**self._ids(), reason="probe_failed"), self.source)
            if self.ready and serve.metrics != "none" and loop.time() >= next_scrape:
                next_scrape = loop.time() + self.scrape_s
                at = self.now_ms()
                status, body = await http_get("127.0.0.1", self.port, serve.metrics_path)
                if status == 200 and not self.draining:
                    try:
                        fields = replica_metrics(serve.metrics, body.decode("utf-8", "replace"))
                        await self.publish(ReplicaMetrics(**self._ids(), scraped_ms=at, **fields), self.source)
                    except ValueError as exc:
                        log.warning("%s: metrics of %s unreadable: %s", self.node, self.place.job_id, exc)
            await asyncio.sleep(self.probe_s if not self.ready else min(self.probe_s, self.scrape_s))


class Replicas:
    """The serving replicas of a node agent (one object for a whole simulated fleet)."""

    def __init__(self, publish: Callable[[object, str], Awaitable[None]], now_ms: Callable[[], int],
                 environ=os.environ):
        self.publish = publish
        self.now_ms = now_ms
        self.probe_s, self.scrape_s, self.drain_s = periods(environ)
        self.runs: dict[tuple[str, str], Replica] = {}  # (node, job id) -> its replica

    @staticmethod
    def port_for(place: PlaceJob) -> int:
        """The port a replica listens on: its service's, else a free one of this host."""
        return 0 if place.serve is None else (place.serve.port or free_port())

    def start(self, node: str, address: str, place: PlaceJob, port: int) -> None:
        self.end(node, place.job_id)
        r = Replica(node, address, place, port, self.publish, self.now_ms, self.probe_s, self.scrape_s)
        r.task = asyncio.get_running_loop().create_task(r.loop())
        self.runs[(node, place.job_id)] = r

    def serving(self, node: str, job_id: str) -> bool:
        return (node, job_id) in self.runs

    async def drain(self, node: str, job_id: str) -> None:
        """Out of rotation before a stop: unready (draining), then the drain period."""
        r = self.runs.pop((node, job_id), None)
        if r is None:
            return
        r.draining = True
        if r.task is not None:
            r.task.cancel()
        await self.publish(ReplicaUnready(**r._ids(), reason="draining", drain_ms=int(self.drain_s * 1000)),
                           r.source)
        if self.drain_s > 0:
            await asyncio.sleep(self.drain_s)

    def end(self, node: str, job_id: str) -> None:
        """The run ended (or is lost): no more probes, nothing said."""
        r = self.runs.pop((node, job_id), None)
        if r is not None:
            r.draining = True
            if r.task is not None:
                r.task.cancel()

    def end_all(self) -> None:
        for node, job in list(self.runs):
            self.end(node, job)
