"""The node agent's side of software shares: each telemetry round, the share watch (agents/node/shares.py) over the
jobs running on a share, and the stop of a job that held more than its share for K rounds -- JobFailed with code
ShareExceeded, the numbers in its reason, which the job's owner reads in `jobs` and `history`. Its neighbours
on the card are not touched. docs/operators.md, "Share enforcement".

The enforcer knows the executor only through three callables, so that the real agent and any other executor can use
it: `running()` (job id -> its assignments, for the jobs running and not already being stopped), `stop(breach,
grace_s)` (end that job and report it), and `spawn(coro)` (run a stop in the background: the telemetry loop is the
node's heartbeat and must not wait out a grace period). `stop_job_for_share` is the stop for agents/node/nvml_agent.py's
Executor.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Mapping

from agents.node.shares import (
    HAMI_LOCK_DIRECTORY, MPS_DEFAULT_PIPE_DIRECTORY, GpuMemoryUsage, ShareBreach, ShareConfig, ShareWatch, share_limits,
)
from schemas.events import Assignment, GpuCard, JobFailed

log = logging.getLogger("gpupool.agent.shares")

Running = Callable[[], Mapping[str, tuple[Assignment, ...]]]
Stop = Callable[[ShareBreach, float], Awaitable[None]]


class ShareEnforcer:
    def __init__(self, config: ShareConfig, *, running: Running, stop: Stop,
                 spawn: Callable[[Coroutine], None] | None = None,
                 cards: Callable[[], Iterable[GpuCard]] = lambda: ()):
        self.config = config
        self.watch = ShareWatch(config.watch_samples, config.slack_mib)
        self.running = running
        self.stop = stop
        self.spawn = spawn
        self.cards = cards

    def allowed(self) -> dict[str, dict[str, int]]:
        """job -> shared card -> MiB it may hold, over the jobs running on a share now."""
        cards = tuple(self.cards())
        out = {}
        for job_id, assignments in self.running().items():
            limits = share_limits(assignments, cards)
            if limits:
                out[job_id] = limits
        return out

    def check(self, usage: GpuMemoryUsage | None) -> list[ShareBreach]:
        """One round of the watch; a round without a usage (a backend that reads none) changes nothing."""
        if usage is None:
            return []
        return self.watch.observe(usage.by_job, self.allowed(), usage.cards)

    async def enforce(self, usage: GpuMemoryUsage | None) -> list[ShareBreach]:
        """One round; each job found over its share for K rounds is stopped (in the background when `spawn` is
        given). Returns what was found."""
        breaches = self.check(usage)
        for b in breaches:
            log.warning("job %s: %s; stopping it", b.job_id, b.message)
            coro = self.stop(b, self.config.stop_grace_s)
            if self.spawn is not None:
                self.spawn(coro)
            else:
                await coro
        return breaches


def share_problems(config: ShareConfig) -> list[str]:
    """What keeps this node from enforcing its configured mode, said before the agent starts any job."""
    out = []
    if config.mode == "hami" and not os.path.isfile(config.hami_library):
        out.append(f"HAMi-core's library {config.hami_library} (GPUPOOL_HAMI_LIBRARY) is not a file on this node")
    if config.mode == "hami" and not os.path.isdir(HAMI_LOCK_DIRECTORY):
        out.append(f"HAMi-core's lock directory {HAMI_LOCK_DIRECTORY} is missing (root: mkdir -m 1777 "
                   f"{HAMI_LOCK_DIRECTORY}; a systemd-tmpfiles line keeps it across reboots)")
    if config.mode == "mps":
        pipe = config.mps_pipe_directory or MPS_DEFAULT_PIPE_DIRECTORY
        if not os.path.isdir(pipe):
            out.append(f"no MPS control daemon: its pipe directory {pipe} does not exist "
                       f"(start nvidia-cuda-mps-control -d, or set GPUPOOL_MPS_PIPE_DIRECTORY)")
    return out


async def stop_job_for_share(executor, breach: ShareBreach, grace_s: float) -> None:
    """End a job of agents/node/nvml_agent.py's Executor for its share: SIGTERM to its process group, SIGKILL after
    `grace_s`, then JobFailed(code="ShareExceeded") under its placement's command id (the scheduler frees its share
    and, when the job has retries left, places it again). A job already stopping or ended is left to that.
    The executor's job carries its run (`job.run`, agents/node/runner.py Run, whose stop(grace) returns how it
    ended)."""
    job = executor.running.get(breach.job_id)
    if job is None or job.stopping or job.run is None or not job.run.running:
        return
    job.stopping = True  # its waiter stays silent: this reports
    ended = await job.run.stop(grace_s)
    sig, rc = ended.signal, ended.exit_code
    if executor.running.get(job.job_id) is job:
        del executor.running[job.job_id]
    src = f"{executor.node}/job/{job.job_id}"
    await executor.publish(JobFailed(job_id=job.job_id, node=executor.node, reason=breach.message,
                                     command_id=job.command_id, code=breach.code, signal=sig, exit_code=rc,
                                     attempt=job.attempt), src, job.command_id)
