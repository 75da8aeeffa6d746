"""The node agent for one real node: NVML for the cards, the user's programs for the jobs, Kafka for everything else.

It publishes the node's inventory at start and whenever NVML's view of it changes, one telemetry batch per interval
(the batch is also the heartbeat), and GpuHealth events for card faults. It carries out the scheduler's commands
addressed to this node once per command id, fenced by attempt (agents/node/fencing.py): a placement of a superseded
attempt is refused, a stop ends only its own run or an older one, a newer placement replaces an older run.

What a placed job runs: its own program (the placement's command, in its image when it names one), through the
runner every node agent shares (agents/node/runner.py; docs/jobs.md "Running a program"): a plain process as the
unprivileged job user or a podman container, with only its cards, the pool's environment and the user's, its output
to the attempt's log file (and to an extra `output` sink), its checkpoints from the manifest it writes. A placement
without a command is a stand-in run, as before the programs came:
  * GPUPOOL_JOB_COMMANDS: inline JSON, or the path of a JSON file, mapping a job id (or "*" for any job) to an argv
    list; `{job_id}`, `{duration_s}` and `{resume_from}` in an argument are replaced. Read at each placement, so an
    operator can add jobs without restarting the agent.
  * otherwise, when the placement has a duration: `sleep <remaining seconds>` (a stand-in job, as in the simulation);
  * otherwise the job fails at once with a reason saying so.
A stand-in that exits within the grace time of a stop is taken to have checkpointed where it was; one that has to
be killed resumes from its previous checkpoint. A program's checkpoints are only those its manifest names.

Node identity comes from GPUPOOL_NODE (default: the host name), GPUPOOL_RACK and GPUPOOL_DATACENTER; the address the
node's programs are reached at by a gang's other parts (its inventory's `address`, a rendezvous master's address:
docs/jobs.md "Gangs") from GPUPOOL_NODE_ADDRESS, else `node_address`'s guess: the local address of the route to the
Kafka cluster.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from pathlib import Path

from agents.node.fencing import Fence
from agents.node.logship import shipper_for
from agents.node.runner import (  # noqa: F401
    LogFile, NodeContext, Output, Run, completed, log_file, tee, visible_devices, write_share,
)
from agents.node.serving import Replicas
from agents.node.share_enforcer import ShareEnforcer, share_problems, stop_job_for_share
from agents.node.shares import ShareConfig
from agents.node.sim_agent import parse_checkpoint, wall_ms
from infra.kafka_client import consume_commands
from infra.security import kafka_conn, node_principal
from schemas.topics import node_channel
from schemas.envelope import Envelope, encode, envelope
from schemas.events import (
    Assignment, GpuHealth, GpuSample, GpuTelemetry, JobCheckpointed, JobFailed, JobStarted, JobStopped,
    MigrateJob, MigReconfigure, NodeInventory, PlaceJob, PreemptJob, ReleaseJob, ResizeJob,
)
from schemas.routing import route

log = logging.getLogger("gpupool.agent.nvml")

JOB_COMMANDS_ENV = "GPUPOOL_JOB_COMMANDS"
INVENTORY_EVERY_S = 30.0  # NVML has no change notification for most of the inventory; re-read and compare
RELEASE_GRACE_S = 10.0  # a release is not a preemption: no checkpoint is owed, so the wait is short

Publish = Callable[[object, str, "str | None"], Awaitable[None]]


# ---------------------------------------------------------------- what to run, and where

def job_argv(p: PlaceJob, environ: dict[str, str] | os._Environ = os.environ) -> list[str] | None:
    spec = environ.get(JOB_COMMANDS_ENV, "").strip()
    if spec:
        doc = json.loads(spec if spec.startswith("{") else Path(spec).read_text())
        argv = doc.get(p.job_id) or doc.get("*")
        if argv:
            subs = {"{job_id}": p.job_id, "{duration_s}": "" if p.duration_s is None else str(p.duration_s),
                    "{resume_from}": p.resume_from}
            out = []
            for arg in argv:
                for k, v in subs.items():
                    arg = str(arg).replace(k, v)
                out.append(arg)
            return out
    if p.duration_s is not None:
        remaining_ms = max(0, p.duration_s * 1000 - parse_checkpoint(p.resume_from))
        return ["sleep", f"{remaining_ms / 1000:g}"]
    return None


# ---------------------------------------------------------------- command execution

@dataclass
class JobProc:
    job_id: str
    command_id: str
    run: Run | None
    started_ms: int
    base_progress_ms: int
    resume_from: str
    assignments: tuple[Assignment, ...]
    stopping: bool = False
    waiter: asyncio.Task | None = None
    attempt: int = 0  # the placement's attempt (PlaceJob.attempt)
    standin: bool = False  # no command of the user's: GPUPOOL_JOB_COMMANDS or a sleep
    tier: str = "offline"

    def progress(self, now: int) -> int:
        return self.base_progress_ms + max(0, now - self.started_ms)

    @property
    def ended(self) -> bool:
        return self.run is None or not self.run.running


class Executor:
    """Carries out one node's commands; everything it reports goes through `publish(payload, source, cause)`.
    `ctx` says how the node runs programs (agents/node/runner.py; default: from the environment, jobs under
    `log_dir` when given); `output` gets every run's stdout and stderr besides the attempt's log file."""

    def __init__(self, node: str, publish: Publish, *, argv_for: Callable[[PlaceJob], list[str] | None] = job_argv,
                 allow_mig_reconfigure: bool = False, reconfigure: Callable[[MigReconfigure], Awaitable[None]]
                 | None = None, republish: Callable[[str], Awaitable[None]] | None = None,
                 log_dir: Path | None = None, clock: Callable[[], int] = wall_ms, ctx: NodeContext | None = None,
                 output: Output | None = None):
        self.node = node
        self.publish = publish
        self.argv_for = argv_for
        self.allow_mig_reconfigure = allow_mig_reconfigure
        self.reconfigure = reconfigure
        self.republish = republish  # the node's inventory again, as the answer to a refused command
        if ctx is None:
            ctx = NodeContext.from_env(node, Path(os.environ.get("GPUPOOL_HOME", "./.gpupool")).resolve())
        if log_dir is not None:
            ctx = replace(ctx, jobs_root=Path(log_dir))
        self.ctx = ctx
        self.output = output
        self.clock = clock
        self.seen: set[str] = set()
        self.running: dict[str, JobProc] = {}
        # A stop that found nothing to stop, per job: (source, seq). A placement of that job from the same source with
        # a lower seq was overtaken by the stop and must not start.
        self.fences: dict[str, tuple[str, int]] = {}
        self.fence = Fence()  # by attempt: which run of each job this node may run
        self.tasks: set[asyncio.Task] = set()
        # serving replicas (agents/node/serving.py): probed, scraped and drained before a stop; reached at the
        # node's advertised address (the agent's: GPUPOOL_NODE_ADDRESS or its guess, `node_address`; "": 127.0.0.1)
        self.address = os.environ.get("GPUPOOL_NODE_ADDRESS", "")
        self.replicas = Replicas(lambda payload, src: self.publish(payload, src, payload.command_id), self.clock)

    def _src(self, job_id: str) -> str:
        return f"{self.node}/job/{job_id}"

    def _background(self, coro) -> None:
        # A preemption waits out its grace time; the command loop must not wait with it.
        task = asyncio.create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def drain(self) -> None:
        """Wait for stops in progress and for every running job to end (tests; shutdown after stop_all)."""
        while self.tasks or any(j.waiter and not j.waiter.done() for j in self.running.values()):
            pending = set(self.tasks) | {j.waiter for j in self.running.values() if j.waiter}
            await asyncio.gather(*pending, return_exceptions=True)

    async def execute(self, env: Envelope) -> None:
        p = env.payload
        node = getattr(p, "node", None) or getattr(p, "from_node", None)  # a move is the leaving node's to carry out
        if not env.is_command or node != self.node or p.command_id in self.seen:
            return  # not ours, or a redelivery: each command id is carried out once
        self.seen.add(p.command_id)
        match p:
            case PlaceJob():
                await self._place(env, p)
            case PreemptJob():
                job = self.running.get(p.job_id)
                grace = self.ctx.grace_for(job.tier if job else "offline", float(p.grace_s))
                self._background(self._stop(env, p.job_id, p.command_id, grace, report=True, attempt=p.attempt))
            case MigrateJob():
                # checkpoint (SIGTERM, the job's own handler) and stop; the scheduler resumes it on the planned node
                job = self.running.get(p.job_id)
                grace = self.ctx.grace_for(job.tier if job else "offline", float(p.grace_s))
                self._background(self._stop(env, p.job_id, p.command_id, grace, report=True, attempt=p.attempt,
                                            reason="migrated"))
            case ReleaseJob():
                job = self.running.get(p.job_id)
                grace = self.ctx.grace_for(job.tier if job else "offline", RELEASE_GRACE_S)
                self._background(self._stop(env, p.job_id, p.command_id, grace, report=False, attempt=p.attempt))
            case ResizeJob():
                job = self.running.get(p.job_id)
                if job and self.fence.applies(p.attempt, job.attempt):
                    # A process's CUDA_VISIBLE_DEVICES is fixed at start; the new slices apply from its next start.
                    log.info("resize of %s recorded; the running process keeps its devices", p.job_id)
                    job.assignments = p.assignments
                    if job.run is not None and job.run.place.serve is not None:
                        write_share(job.run.place, self.ctx, p.assignments)  # a replica reads its new share
            case MigReconfigure():
                await self._mig(p)

    async def _place(self, env: Envelope, p: PlaceJob) -> None:
        old = self.running.get(p.job_id)
        what = self.fence.place(p.job_id, p.attempt, old.attempt if old else None)
        if what == "refuse":
            log.warning("placement %s of %s is of a superseded attempt (%d); not starting it", p.command_id, p.job_id,
                        p.attempt)
            return
        if what == "running":
            return
        if what == "replace":
            log.warning("%s: attempt %d replaces the superseded attempt %d still running", p.job_id, p.attempt,
                        old.attempt)
            await self._stop(None, p.job_id, p.command_id, RELEASE_GRACE_S, report=False, attempt=old.attempt)
        fence = self.fences.get(p.job_id)
        if fence is not None:
            if fence[0] == env.source and env.seq < fence[1]:
                log.warning("placement %s of %s was overtaken by a stop; not starting it", p.command_id, p.job_id)
                return
            del self.fences[p.job_id]
        src = self._src(p.job_id)
        standin = not p.command and not p.image
        argv = None
        if standin:
            try:
                argv = self.argv_for(p)
            except (OSError, ValueError) as exc:
                argv, why = None, f"cannot read {JOB_COMMANDS_ENV}: {exc}"
            else:
                why = f"no command for this job: give it one, set {JOB_COMMANDS_ENV} or give the job a duration"
            if not argv:
                await self.publish(JobFailed(job_id=p.job_id, node=self.node, reason=why, command_id=p.command_id,
                                             code="StartFailed", attempt=p.attempt, part=p.gang_index),
                                   src, p.command_id)
                return
        job = JobProc(p.job_id, p.command_id, None, self.clock(), parse_checkpoint(p.resume_from), p.resume_from,
                      p.assignments, attempt=p.attempt, standin=standin, tier=getattr(p.tier, "value", p.tier))

        async def checkpointed(ckpt: str, progress_ms: int) -> None:
            await self.publish(JobCheckpointed(job_id=p.job_id, node=self.node, progress_ms=progress_ms,
                                               checkpoint=ckpt, command_id=p.command_id), src, p.command_id)

        port = Replicas.port_for(p)
        run = Run(p, self.ctx, argv=argv, output=tee(LogFile(log_file(p, self.ctx)), self.output),
                  on_checkpoint=checkpointed, port=port)
        job.run = run
        failed = await run.start()
        if failed is not None:
            await self.publish(failed.failed(p, self.node), src, p.command_id)
            return
        self.running[p.job_id] = job
        await self.publish(JobStarted(job_id=p.job_id, node=self.node, command_id=p.command_id), src, p.command_id)
        if p.serve is not None:
            self.replicas.start(self.node, self.address, p, port)
        job.waiter = asyncio.create_task(self._wait(job, p))

    async def _wait(self, job: JobProc, p: PlaceJob) -> None:
        ended = await job.run.wait()
        if self.running.get(job.job_id) is job:
            self.replicas.end(self.node, job.job_id)
        if job.stopping or ended.stopped:
            return  # the stop reports
        if self.running.get(job.job_id) is job:
            del self.running[job.job_id]
        src = self._src(job.job_id)
        if ended.ok:
            await self.publish(completed(p, job.job_id, self.node, job.command_id), src, job.command_id)
        else:
            await self.publish(ended.failed(p, self.node, job.command_id), src, job.command_id)

    async def _stop(self, env: Envelope | None, job_id: str, command_id: str, grace_s: float, *, report: bool,
                    attempt: int = 0, reason: str = "") -> None:
        job = self.running.get(job_id)
        src = self._src(job_id)
        running = job.attempt if job is not None and not job.ended else None
        if not self.fence.stops(job_id, attempt, running) and running is not None:
            log.info("stop of attempt %d of %s leaves its newer attempt %d running", attempt, job_id, running)
            return
        if job is None or job.ended:
            if job is None and env is not None:
                self.fences[job_id] = (env.source, env.seq)
            if report and job is None:
                # The scheduler holds the job's slices until it hears the job stopped; nothing ran here, so progress
                # stays where it was.
                await self.publish(JobStopped(job_id=job_id, node=self.node, command_id=command_id), src, command_id)
            return
        if job.stopping:
            # Another stop is already under way (a preemption after a release): it signals; this one only reports.
            await job.run.wait()
            if report:
                await self.publish(JobStopped(job_id=job_id, node=self.node, command_id=command_id,
                                              progress_ms=max(job.base_progress_ms, job.run.progress_ms),
                                              checkpoint=job.run.checkpoint or job.resume_from,
                                              reason=reason), src, command_id)
            return
        job.stopping = True
        await self.replicas.drain(self.node, job_id)  # a serving replica: out of rotation first (serving.py)
        ended = await job.run.stop(grace_s)
        if self.running.get(job_id) is job:
            del self.running[job_id]
        if not report:
            return
        now = self.clock()
        if job.run.checkpoint:
            # the program's own word: the last checkpoint its manifest named (re-read after it exited)
            progress, ckpt = max(job.base_progress_ms, job.run.progress_ms), job.run.checkpoint
        elif job.standin and ended.graceful:
            progress, ckpt = job.progress(now), f"ckpt:{job_id}:{job.progress(now)}"
            await self.publish(JobCheckpointed(job_id=job_id, node=self.node, progress_ms=progress, checkpoint=ckpt,
                                               command_id=command_id), src, command_id)
        else:
            progress, ckpt = job.base_progress_ms, job.resume_from  # nothing newer: it resumes where it started
        await self.publish(JobStopped(job_id=job_id, node=self.node, command_id=command_id, progress_ms=progress,
                                      checkpoint=ckpt, reason=reason), src, command_id)

    async def stop_all(self, grace_s: float | None = None) -> None:
        """Agent shutdown: jobs are stopped (SIGTERM, the grace period of their tier unless `grace_s` says, then
        SIGKILL) and reported stopped at their last checkpoint (reason "agent shutdown"; the command id is the
        placement's: no command asked for it), so the scheduler places them again rather than waiting for
        completions no one will report."""
        for job_id, job in list(self.running.items()):
            grace = self.ctx.grace_for(job.tier) if grace_s is None else grace_s
            self._background(self._stop(None, job_id, job.command_id, grace, report=True, attempt=job.attempt,
                                        reason="agent shutdown"))
        await self.drain()

    async def _mig(self, p: MigReconfigure) -> None:
        layout = ", ".join(f"{i.profile}@{i.start}" for i in p.layout) or "(none)"
        if not self.allow_mig_reconfigure or self.reconfigure is None:
            log.warning("dry run: would reconfigure MIG on %s to %s (start the agent with --allow-mig-reconfigure)",
                        p.gpu_uuid, layout)
            return
        kept = {i.uuid for i in p.layout}
        busy = sorted(j.job_id for j in self.running.values()
                      if any(a.gpu_uuid == p.gpu_uuid and a.mig_uuid not in kept for a in j.assignments))
        if busy:
            # Instances the layout keeps may be busy (a carve next to running work); one that goes may not.
            log.error("MIG reconfigure of %s refused: it would remove the instance(s) of running job(s) %s",
                      p.gpu_uuid, ", ".join(busy))
            if self.republish is not None:
                await self.republish(p.command_id)  # the scheduler stops waiting for a layout that will not come
            return
        await self.reconfigure(p)

    def job_lookup(self) -> Callable[[int], str | None]:
        """pid -> job id over a snapshot of the running jobs, safe to call from the NVML worker thread (a plain
        run's process group; a container's init process, found by ancestry)."""
        by_pgid = {j.run.pid: j.job_id for j in self.running.values() if j.run is not None and j.run.pid}
        return lambda pid: job_of_pid(pid, by_pgid)

    def job_of_pid(self, pid: int) -> str | None:
        return self.job_lookup()(pid)


def job_of_pid(pid: int, by_pgid: dict[int, str]) -> str | None:
    """Which job a GPU process belongs to: its process group, else its ancestry (a job that made new sessions)."""
    try:
        job = by_pgid.get(os.getpgid(pid))
    except OSError:
        return None
    for _ in range(32):
        if job is not None or pid <= 1:
            return job
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            pid = int(stat.rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            return None
        job = by_pgid.get(pid)
    return job


# ---------------------------------------------------------------- the Kafka side

class Sequencer:
    """Per-source sequence numbers; a restarted process starts above the old one (sim_agent does the same)."""

    def __init__(self):
        self._seq: dict[str, int] = {}
        self._base = time.time_ns() // 1000

    def next(self, source: str) -> int:
        self._seq[source] = self._seq.get(source, self._base) + 1
        return self._seq[source]


def with_faults(tel: GpuTelemetry, health: list[GpuHealth]) -> GpuTelemetry:
    """A node states its cards' faults in its telemetry (the one topic it writes about its cards); the worker turns
    them into gpu.health facts, as it does for ECC errors and fatal XIDs (docs/security.md: one writer a topic)."""
    if not health:
        return tel
    why = {h.gpu_uuid: h.reason for h in health}
    samples = [s.model_copy(update={"fault": why.pop(s.gpu_uuid)}) if s.gpu_uuid in why and s.mig_uuid is None
               else s for s in tel.samples]
    samples += [GpuSample(gpu_uuid=uuid, util_pct=0, mem_used_mib=0, mem_total_mib=0, fault=reason)
                for uuid, reason in sorted(why.items())]  # a card that could not be read at all
    return tel.model_copy(update={"samples": tuple(samples)})


def node_address(bootstrap: str, environ=os.environ) -> str:
    """The address this node advertises to the other parts of a gang: GPUPOOL_NODE_ADDRESS when the operator set it
    (the interface the nodes' training network uses), else the local address the kernel picks to reach the first
    Kafka broker (a UDP socket's connect sends nothing), else the host name's address."""
    given = environ.get("GPUPOOL_NODE_ADDRESS", "").strip()
    if given:
        return given
    host = (bootstrap.split(",")[0].rsplit(":", 1)[0] or "127.0.0.1").strip("[]")
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))
            return s.getsockname()[0]
    except OSError:
        try:
            return socket.gethostbyname(socket.gethostname())
        except OSError:
            return ""


class NvmlAgent:
    def __init__(self, cfg, args, backend, *, node: str | None = None):
        self.cfg = cfg
        self.node = node or os.environ.get("GPUPOOL_NODE") or socket.gethostname()
        # the node's own principal (`gpupool user add node-NODE --role node --node NODE`): it writes only its
        # channel, `gpupool.node.PRINCIPAL`, which the worker relays (docs/security.md, "Node identity")
        self.principal = getattr(args, "principal", None) or node_principal(self.node)
        self.channel = node_channel(self.principal).name
        self.rack = os.environ.get("GPUPOOL_RACK", "rack-0")
        self.datacenter = os.environ.get("GPUPOOL_DATACENTER", "dc-0")
        self.address = node_address(cfg.bootstrap if cfg is not None else "")
        self.interval = float(getattr(args, "interval", 1.0) or 1.0)
        self.group_id = getattr(args, "group", None) or f"gpupool-agent-{self.node}"
        self.backend = backend
        self.seq = Sequencer()
        self.producer = None
        self.inventory: NodeInventory | None = None
        self.stopping = asyncio.Event()
        self.executor = Executor(self.node, self.publish,
                                 allow_mig_reconfigure=bool(getattr(args, "allow_mig_reconfigure", False)),
                                 reconfigure=self._reconfigure, republish=self._republish,
                                 ctx=NodeContext.from_env(self.node, cfg.home, volumes=cfg.volumes),
                                 output=shipper_for(self).output)  # stdout/stderr as job.log (docs/jobs.md)
        self.executor.address = self.address  # its serving replicas are reached where its gangs meet
        from agents.node.metrics import AgentMetrics

        self.metrics = AgentMetrics(lambda: {self.node: len(self.executor.running)})
        # software shares (docs/operators.md, "Share enforcement"): GPUPOOL_SHARE_ENFORCEMENT and the watch
        self.shares = ShareEnforcer(
            ShareConfig.from_env(os.environ),
            running=lambda: {j.job_id: j.assignments for j in self.executor.running.values() if not j.stopping},
            stop=lambda breach, grace_s: stop_job_for_share(self.executor, breach, grace_s),
            spawn=self.executor._background, cards=lambda: self.inventory.gpus if self.inventory else ())

    async def publish(self, payload, source: str, cause: str | None = None) -> None:
        env = envelope(payload, source=source, seq=self.seq.next(source), time_ms=wall_ms(), causation_id=cause)
        _, key = route(env)
        await self.producer.send(self.channel, key=key, value=encode(env))
        self.metrics.observe(payload)
        await self.producer.flush()  # job facts are rare and must not sit in a batch when the agent dies

    async def publish_inventory(self, force: bool = False, cause: str | None = None) -> None:
        inv = await asyncio.to_thread(self.backend.inventory, self.node, self.rack, self.datacenter)
        if self.address and not inv.address:
            inv = inv.model_copy(update={"address": self.address})
        if force or inv != self.inventory:
            await self.publish(inv, f"{self.node}/inventory", cause)
            self.inventory = inv
            self.executor.ctx = replace(self.executor.ctx, cards=inv.gpus)  # what a share's limits are read against

    async def _republish(self, cause: str) -> None:
        await self.publish_inventory(force=True, cause=cause)

    async def _reconfigure(self, p: MigReconfigure) -> None:
        try:
            await asyncio.to_thread(self.backend.reconfigure_mig, p.gpu_uuid, p.layout)
        except Exception as exc:  # noqa: BLE001 - the published inventory below says what the card really is
            log.error("MIG reconfigure of %s failed: %s", p.gpu_uuid, exc)
        await self.publish_inventory(force=True, cause=p.command_id)

    async def enforce_shares(self, usage) -> list:
        """One round of the share watch over this round's per-job GPU memory (the backend's `last_usage`): a job over
        its share K rounds in a row is stopped, JobFailed ShareExceeded; its neighbours go on."""
        return await self.shares.enforce(usage)

    async def telemetry_loop(self) -> None:
        last_inventory = time.monotonic()
        while not self.stopping.is_set():
            tel, health = await asyncio.to_thread(self.backend.telemetry, self.node, self.executor.job_lookup())
            for h in health:
                log.warning("card %s unhealthy: %s", h.gpu_uuid, h.reason)
            await self.publish(with_faults(tel, health), f"{self.node}/telemetry")
            await self.enforce_shares(getattr(self.backend, "last_usage", None))
            if time.monotonic() - last_inventory >= INVENTORY_EVERY_S:
                last_inventory = time.monotonic()
                await self.publish_inventory()
            try:
                await asyncio.wait_for(self.stopping.wait(), self.interval)
            except asyncio.TimeoutError:
                pass

    @property
    def conn(self):
        return kafka_conn(self.cfg, self.principal)  # the node's principal: writes only its own channel

    async def command_loop(self) -> None:
        async def execute(env) -> None:
            self.metrics.commands.labels(env.kind).inc()
            await self.executor.execute(env)

        await consume_commands(self.conn, self.group_id, self.stopping, execute, log)

    async def run(self) -> None:
        from aiokafka import AIOKafkaProducer

        self.producer = AIOKafkaProducer(**self.conn.options(), acks="all", enable_idempotence=True, linger_ms=10)
        await self.producer.start()
        try:
            await self.publish_inventory(force=True)
            await asyncio.gather(self.telemetry_loop(), self.command_loop())
        finally:
            try:
                # each job its tier's grace period (GPUPOOL_GRACE_S), then SIGKILL; the wait is bounded all the same
                longest = max((self.executor.ctx.grace_for(j.tier) for j in self.executor.running.values()),
                              default=0.0)
                await asyncio.wait_for(self.executor.stop_all(), longest + 30)
            finally:
                await shipper_for(self).close()  # the last pieces of the programs' output
                await self.producer.stop()


def metrics_port(args) -> int:
    """`--metrics-port`, else GPUPOOL_AGENT_METRICS_PORT, else 0 (none)."""
    port = getattr(args, "metrics_port", None)
    return int(port if port is not None else os.environ.get("GPUPOOL_AGENT_METRICS_PORT") or 0)


def run_nvml_agent(cfg, args) -> int:
    from agents.node.nvml_backend import NvmlBackend

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        problems = share_problems(ShareConfig.from_env(os.environ))
    except ValueError as exc:
        problems = [str(exc)]
    if problems:
        print(f"gpupool agent: share enforcement: {'; '.join(problems)}", file=sys.stderr)
        return 2
    try:
        backend = NvmlBackend().open()
    except Exception as exc:  # noqa: BLE001 - NVMLError_LibraryNotFound, DriverNotLoaded, ...
        print(f"gpupool agent: no usable NVIDIA driver: {exc}", file=sys.stderr)
        return 2
    agent = NvmlAgent(cfg, args, backend)
    agent.metrics.serve(metrics_port(args))

    async def main():
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, agent.stopping.set)
        task = asyncio.create_task(agent.run())
        stop = asyncio.create_task(agent.stopping.wait())
        await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
        agent.stopping.set()
        stop.cancel()
        try:
            await asyncio.wait_for(task, 60)
        except (asyncio.CancelledError, asyncio.TimeoutError):
            pass
        except Exception as exc:  # noqa: BLE001 - a broker failure ends the agent with a line, not a trace
            print(f"gpupool agent: {type(exc).__name__}: {exc}", file=sys.stderr)
            return 1
        return 0

    try:
        return asyncio.run(main())
    finally:
        backend.close()
