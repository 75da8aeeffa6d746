"""Node agents for a simulated fleet: hundreds of nodes in one process, the same contracts as real ones.

Each node publishes its inventory at start, telemetry per card and MIG instance every interval (the telemetry batch
doubles as the heartbeat), and carries out the scheduler's commands once per command id. A simulated job runs for
its duration; its completion is stamped start + duration exactly, so the bill is checkable to the millisecond. A job
placed with a checkpoint interval reports a checkpoint every interval of its run; one placed with `resume_from` runs
only what is left. Everything the agent writes goes through `self.producer` (`send(topic, key=, value=)`, `flush()`):
the node principals' channels that run() connects (agents/node/channels.py: each node writes as its own principal to
`gpupool.node.NAME`, and the worker relays it), or any object with those coroutines given to the constructor (the
tests': records then go to their home topics).
With `speedup` > 1 simulated time runs that much faster than the wall clock (durations, checkpoint intervals and fault
delays are simulated seconds, event times simulated milliseconds; the telemetry interval stays wall seconds).

Faults (`inject`, the CLI's --fault, a fleet file's `faults:`), each optionally `@SECONDS` after the agent starts:
  ecc:NODE:INDEX     the card reports uncorrectable ECC errors in its telemetry
  clear:NODE:INDEX   the ECC errors are gone from telemetry (the node view keeps the card out until an operator's
                     GpuHealth(healthy=True): by design)
  lose:NODE          the node is gone: no telemetry, its jobs die silently, commands to it are not received
  slow:NODE:FACTOR   jobs placed on the node from now on take FACTOR times as long (checkpoints too)
  recover:NODE       the node is back at full speed and re-publishes its inventory
  restart:NODE       the node's agent restarts: each running job is lost and reported stopped at its last
                     checkpoint (JobStopped reason "agent restarted": the scheduler requeues it to resume from there),
                     and the inventory is published again
  fail:JOB           the job's process dies (JobFailed "simulated failure"); nothing else on its node moves
A running agent also applies the faults appended, one a line, to its control file (`--control FILE`; the fleet that
`gpupool up` supervises reads $GPUPOOL_HOME/run/faults, which `gpupool agent inject FAULT...` appends to).

A placement that carries a command (or an image) runs the user's program for real, through the runner every node agent
shares (agents/node/runner.py): a plain process as the job user, or a podman container, with the simulated cards'
UUIDs as its devices, the pool's environment, its output to the attempt's log file (and to `output`), its checkpoints
from the manifest it writes; started, checkpointed, completed, failed and stopped are reported from the real process.
The fleet's nodes share one checkpoint root (GPUPOOL_CHECKPOINT_ROOT), so a program resumes on any of them. For such
a run the faults act on the process: `lose` SIGKILLs it and reports nothing, `restart` stops it (SIGTERM, the tier's
grace, SIGKILL) and reports it stopped at the last checkpoint its manifest named, `fail` SIGKILLs it and reports the
failure (code Simulated). A placement without a command keeps the stand-in run above.

Commands are fenced (agents/node/fencing.py): a placement of a superseded attempt is refused, a stop ends only its
own run or an older one. When the agent stops (run() ends: SIGTERM, `gpupool down`) every running job is
checkpointed and reported stopped (JobStopped reason "agent shutdown"), so the scheduler bills it to that moment and
places it again when capacity comes back, rather than waiting for completions no one will report; a real program is
stopped with its tier's grace period (GPUPOOL_GRACE_S) first.
"""
from __future__ import annotations

import asyncio
import hashlib
import ipaddress
import logging
import os
import time
from pathlib import Path
from dataclasses import dataclass, field

from agents.node.fencing import Fence
from agents.node.logship import shipper_for
from agents.node.runner import LogFile, NodeContext, Output, Run, completed, log_file, tee, write_share
from agents.node.serving import Replicas
from infra.kafka_client import consume_commands
from infra.security import NODE, kafka_conn

from infra.config import Config
from schemas.envelope import Envelope, encode, envelope
from schemas.events import (
    Assignment, GpuSample, GpuTelemetry, JobCheckpointed, JobFailed, JobStarted, JobStopped,
    MigrateJob, MigReconfigure, NodeInventory, PlaceJob, PreemptJob, ReleaseJob, ResizeJob,
)
from schemas.gpu_models import mig_profile
from schemas.routing import route

log = logging.getLogger("gpupool.agent")

SHUTDOWN_REPORT_S = 10.0  # how long shutdown waits to report the running jobs stopped (beyond programs' grace)
RELEASE_GRACE_S = 10.0  # a release of a real program: no checkpoint is owed, so the wait is short
FAULT_KINDS = {"ecc": 2, "clear": 2, "lose": 1, "slow": 2, "recover": 1, "restart": 1, "fail": 1}  # kind -> fields


def wall_ms() -> int:
    return time.time_ns() // 1_000_000


def loopback(i: int) -> str:
    """The i-th simulated node's address: 127.0.0.2 onwards (every address of 127.0.0.0/8 is this machine's)."""
    return str(ipaddress.IPv4Address(int(ipaddress.IPv4Address("127.0.0.2")) + i))


def parse_checkpoint(ckpt: str) -> int:
    """Checkpoints are `ckpt:<job>:<progress ms>`; anything else resumes from the start."""
    try:
        return int(ckpt.rsplit(":", 1)[1]) if ckpt.startswith("ckpt:") else 0
    except (IndexError, ValueError):
        return 0


@dataclass
class Running:
    command_id: str
    assignments: tuple[Assignment, ...]
    started_ms: int
    duration_ms: int | None
    base_progress_ms: int
    checkpoint_ms: int = 0
    slow: float = 1.0  # the node's slow factor when the job started: wall time = progress * slow
    started_mono: float = 0.0  # event-loop time at start (the sleeps aim at absolute targets, so nothing drifts)
    task: asyncio.Task | None = None
    attempt: int = 0  # the placement's attempt (PlaceJob.attempt)
    run: Run | None = None  # a real program (the placement's command), else the stand-in run
    place: PlaceJob | None = None
    tier: str = "offline"

    def progress(self, now: int) -> int:
        p = self.base_progress_ms + int(max(0, now - self.started_ms) / self.slow)
        return min(p, self.duration_ms) if self.duration_ms is not None else p

    def last_checkpoint(self, now: int) -> int:
        """Progress at the last checkpoint the run reported (where it resumes from if it dies now)."""
        if not self.checkpoint_ms:
            return self.base_progress_ms
        done = self.progress(now) - self.base_progress_ms
        return self.base_progress_ms + done // self.checkpoint_ms * self.checkpoint_ms


@dataclass
class SimNode:
    inventory: NodeInventory
    running: dict[str, Running] = field(default_factory=dict)
    ecc_faults: set[str] = field(default_factory=set)
    lost: bool = False
    slow_factor: float = 1.0
    fence: Fence = field(default_factory=Fence)


@dataclass(frozen=True)
class Fault:
    kind: str
    node: str
    arg: str = ""
    at_s: float | None = None  # seconds after the agent starts; None: at once

    def __str__(self) -> str:
        return ":".join(x for x in (self.kind, self.node, self.arg) if x) + (
            f"@{self.at_s:g}" if self.at_s is not None else "")


def sim_group(nodes) -> str:
    """`gpupool-agent-sim-FIRST-DIGEST`: one group per fleet (its nodes' names), within the node role's ACL prefix."""
    names = sorted(nodes)
    digest = hashlib.blake2b("\n".join(names).encode(), digest_size=4).hexdigest()
    return f"gpupool-agent-sim-{names[0] if names else 'none'}-{digest}"[:200]


class SimFleetAgent:
    def __init__(self, cfg: Config, inventories: list[NodeInventory], *, telemetry_interval_s: float = 1.0,
                 group_id: str | None = None, faults: list[str] | tuple[str, ...] = (), producer=None,
                 speedup: float = 1.0, principal: str | None = None, control: Path | None = None,
                 ctx: NodeContext | None = None, output: Output | None = None):
        if speedup <= 0:
            raise ValueError("speedup must be positive")
        self.cfg = cfg
        # how the fleet runs programs (one context for every node; each run gets its node's name and cards)
        self.ctx = ctx or NodeContext.from_env(
            "", cfg.home if cfg is not None else Path(os.environ.get("GPUPOOL_HOME", "./.gpupool")).resolve(),
            volumes=cfg.volumes if cfg is not None else {})
        self.output = output  # every program's stdout and stderr, besides the attempt's log file
        self.speedup = speedup
        # each simulated node advertises an address of its own (a gang's parts meet at rank 0's: docs/jobs.md
        # "Gangs"): the fleet file's, else a distinct loopback address, 127.0.0.2, 127.0.0.3, ... in the fleet's order
        self.nodes = {inv.node: SimNode(inv if inv.address else inv.model_copy(update={"address": loopback(i)}))
                      for i, inv in enumerate(inventories)}
        self.interval = telemetry_interval_s
        # the fleet's own consumer group for commands: two fleets started on one pool (`gpupool up`'s and one added
        # later with `gpupool agent --simulate`) must not share one, or each would take the other's partitions and
        # drop the commands of nodes it does not run
        self.group_id = group_id or sim_group(self.nodes)
        # the node principal every node reports as (None: each node's own, agents/node/channels.py): it writes only
        # its channel, which the worker relays; with a producer given (the tests'), records go to their home topics
        self.principal = principal
        self.topic_of: dict[str, str] = {}  # node -> its principal's channel, once run() connected
        self.control = control  # a file of faults to apply as lines are appended (None: none)
        self.seen_commands: set[str] = set()
        self._seq: dict[str, int] = {}
        self._seq_base = time.time_ns() // 1000  # restart-safe: a new process starts above the old sequence
        self.producer = producer  # None: run() makes a Kafka producer
        self.published = 0
        self.stopping = asyncio.Event()
        self.timed_faults: list[Fault] = []
        self._speakers: dict = {}  # node -> the credentials of its principal (run())
        self.started_mono: float | None = None  # event-loop time the agent started at; timed faults count from it
        self._started_wall = 0
        self._tasks: set[asyncio.Task] = set()
        from agents.node.metrics import AgentMetrics

        self.metrics = AgentMetrics(lambda: {n: len(v.running) for n, v in self.nodes.items()})
        self.replicas = Replicas(self._report, self.now_ms)  # serving replicas: probe, scrape, drain (serving.py)
        for f in faults:
            self.inject(f)

    @classmethod
    def from_spec(cls, cfg: Config, spec: str, **kw) -> "SimFleetAgent":
        """The fleet of a fleet file / CSV / `demo:N`, with the file's scenario faults (`faults:`) scheduled."""
        from agents.node import fleet

        return cls(cfg, fleet.load(spec), faults=[*fleet.load_faults(spec), *kw.pop("faults", ())], **kw)

    def _start_clock(self) -> None:
        if self.started_mono is None:
            self.started_mono = asyncio.get_running_loop().time()
            self._started_wall = wall_ms()

    def now_ms(self) -> int:
        """Event time: the wall clock, or with a speedup, simulated time running that much faster since the start."""
        if self.speedup == 1.0:
            return wall_ms()
        self._start_clock()
        return self._started_wall + int((asyncio.get_running_loop().time() - self.started_mono) * 1000 * self.speedup)

    def _mono_at(self, base_mono: float, sim_ms: float) -> float:
        return base_mono + sim_ms / 1000 / self.speedup

    def _mono_now(self) -> float:
        return asyncio.get_running_loop().time()

    def _next_seq(self, source: str) -> int:
        self._seq[source] = self._seq.get(source, self._seq_base) + 1
        return self._seq[source]

    async def publish(self, payload, source: str, time_ms: int | None = None, cause: str | None = None) -> None:
        env = envelope(payload, source=source, seq=self._next_seq(source), time_ms=time_ms or self.now_ms(),
                       causation_id=cause)
        spec, key = route(env)
        await self.producer.send(self.topic_of.get(payload.node, spec.name), key=key, value=encode(env))
        self.published += 1
        self.metrics.observe(payload)

    async def _report(self, payload, source: str) -> None:
        """A serving replica's report (ready, unready, metrics), sent at once; a lost node tells nothing."""
        node = self.nodes.get(payload.node)
        if node is None or node.lost:
            return
        await self.publish(payload, source, cause=getattr(payload, "command_id", None))
        await self.producer.flush()

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # ---------------------------------------------------------------- telemetry

    def samples(self, node: SimNode) -> tuple[GpuSample, ...]:
        milli: dict[str, int] = {}
        mem: dict[str, int] = {}
        jobs: dict[str, list[str]] = {}
        for job_id, r in sorted(node.running.items()):
            for a in r.assignments:
                key = a.mig_uuid or a.gpu_uuid
                milli[key] = milli.get(key, 0) + a.milli
                mem[key] = mem.get(key, 0) + a.memory_mib
                jobs.setdefault(key, []).append(job_id)
        out = []
        for card in node.inventory.gpus:
            units = [(i.uuid, mig_profile(card.model, i.profile).memory_mib) for i in card.mig_layout] or [
                (card.uuid, card.memory_mib)]
            for uuid, total in units:
                util = min(100, milli.get(uuid, 0) // 10)
                out.append(GpuSample(
                    gpu_uuid=card.uuid, mig_uuid=uuid if uuid != card.uuid else None,
                    util_pct=util, mem_used_mib=min(total, mem.get(uuid, 0)), mem_total_mib=total,
                    temperature_c=35 + util // 2, power_mw=60_000 + 3_000 * util,
                    ecc_uncorrected=1 if card.uuid in node.ecc_faults else 0,
                    job_ids=tuple(jobs.get(uuid, ()))))
        return tuple(out)

    async def publish_telemetry(self) -> None:
        """One telemetry batch from every node that is not lost."""
        t = self.now_ms()
        for name, node in sorted(self.nodes.items()):
            if not node.lost:
                await self.publish(GpuTelemetry(node=name, samples=self.samples(node)), f"{name}/telemetry", t)
        await self.producer.flush()

    async def telemetry_loop(self) -> None:
        # A fixed rate: the next round is due one interval after the last was due, however long publishing took.
        loop = asyncio.get_running_loop()
        due = loop.time()
        while not self.stopping.is_set():
            await self.publish_telemetry()
            due += self.interval
            try:
                await asyncio.wait_for(self.stopping.wait(), max(0.0, due - loop.time()))
            except asyncio.TimeoutError:
                pass

    # ---------------------------------------------------------------- commands

    async def _sleep_until(self, r: Running, offset_ms: int) -> None:
        await asyncio.sleep(max(0.0, self._mono_at(r.started_mono, offset_ms) - asyncio.get_running_loop().time()))

    async def _run_job(self, node_name: str, job_id: str, r: Running) -> None:
        node = self.nodes[node_name]
        src = f"{node_name}/job/{job_id}"
        remaining = max(0, r.duration_ms - r.base_progress_ms) if r.duration_ms is not None else None
        k = 1
        while r.checkpoint_ms > 0 and (remaining is None or k * r.checkpoint_ms < remaining):
            offset = int(k * r.checkpoint_ms * r.slow)
            await self._sleep_until(r, offset)
            progress = r.base_progress_ms + k * r.checkpoint_ms
            await self.publish(JobCheckpointed(job_id=job_id, node=node_name, progress_ms=progress,
                                               checkpoint=f"ckpt:{job_id}:{progress}", command_id=r.command_id),
                               src, r.started_ms + offset, cause=r.command_id)
            await self.producer.flush()
            k += 1
        if remaining is None:
            await asyncio.Event().wait()  # runs until stopped
        elapsed = int(remaining * r.slow)
        await self._sleep_until(r, elapsed)
        if node.running.get(job_id) is not r:
            return
        del node.running[job_id]
        await self.publish(completed(r.place, job_id, node_name, r.command_id),
                           src, r.started_ms + elapsed, cause=r.command_id)
        await self.producer.flush()

    async def execute(self, env: Envelope) -> None:
        p = env.payload
        self.metrics.commands.labels(env.kind).inc()
        node_name = getattr(p, "node", None) or getattr(p, "from_node", None)  # a move is the leaving node's
        node = self.nodes.get(node_name)
        if node is None or node.lost or p.command_id in self.seen_commands:
            return  # not ours, a node that is gone, or a duplicate delivery: each command id is carried out once
        self.seen_commands.add(p.command_id)
        now = self.now_ms()
        match p:
            case PlaceJob():
                old = node.running.get(p.job_id)
                what = node.fence.place(p.job_id, p.attempt, old.attempt if old else None)
                if what == "refuse":
                    log.warning("%s: placement %s of %s is of a superseded attempt (%d); not starting it",
                                node_name, p.command_id, p.job_id, p.attempt)
                    return
                if what == "running":
                    return  # already running here: a second place for it changes nothing
                if what == "replace":  # an older run of the job, superseded: the new one replaces it
                    node.running.pop(p.job_id)
                    self._end(old, RELEASE_GRACE_S)
                if p.command or p.image:
                    await self._place_program(node_name, node, p, now)
                    await self.producer.flush()
                    return
                r = Running(p.command_id, p.assignments, now,
                            p.duration_s * 1000 if p.duration_s is not None else None, parse_checkpoint(p.resume_from),
                            checkpoint_ms=p.checkpoint_interval_s * 1000, slow=node.slow_factor,
                            started_mono=self._mono_now(), attempt=p.attempt, place=p)
                node.running[p.job_id] = r
                await self.publish(JobStarted(job_id=p.job_id, node=node_name, command_id=p.command_id),
                                   f"{node_name}/job/{p.job_id}", now, cause=p.command_id)
                r.task = self._spawn(self._run_job(node_name, p.job_id, r))
            case PreemptJob() | MigrateJob():
                # a move (defragmentation) is carried out here as a stop with a checkpoint: the scheduler then
                # places the job on the planned node, resuming from that checkpoint (fenced by attempt alike)
                r = node.running.get(p.job_id)
                if not node.fence.stops(p.job_id, p.attempt, r.attempt if r else None):
                    return  # not running here (finished, never placed, already stopped), or a newer run is
                node.running.pop(p.job_id)
                if r.task:
                    r.task.cancel()
                reason = "migrated" if isinstance(p, MigrateJob) else ""
                if r.run is not None:  # a real program: SIGTERM, its grace, SIGKILL; then its last checkpoint
                    grace = self.ctx.grace_for(r.tier, float(p.grace_s))  # the tier's, as the scheduler set it
                    self._spawn(self._stop_program(node_name, p.job_id, r, grace, p.command_id, reason))
                    return
                progress = r.progress(now)
                ckpt = f"ckpt:{p.job_id}:{progress}"
                src = f"{node_name}/job/{p.job_id}"
                await self.publish(JobCheckpointed(job_id=p.job_id, node=node_name, progress_ms=progress,
                                                   checkpoint=ckpt, command_id=p.command_id), src, now, p.command_id)
                await self.publish(JobStopped(job_id=p.job_id, node=node_name, command_id=p.command_id,
                                              progress_ms=progress, checkpoint=ckpt, reason=reason),
                                   src, now, p.command_id)
            case ReleaseJob():
                r = node.running.get(p.job_id)
                if node.fence.stops(p.job_id, p.attempt, r.attempt if r else None):
                    node.running.pop(p.job_id)
                    self._end(r, self.ctx.grace_for(r.tier, RELEASE_GRACE_S), node_name, p.job_id)
            case ResizeJob():
                r = node.running.get(p.job_id)
                if r and node.fence.applies(p.attempt, r.attempt):
                    r.assignments = p.assignments
                    if r.run is not None and r.place is not None and r.place.serve is not None:
                        write_share(r.place, r.run.ctx, p.assignments)  # the replica feels its new share
            case MigReconfigure():
                # Simulation applies the layout; the NVML backend does so only with an explicit opt-in.
                gpus = tuple(g.model_copy(update={"mig_layout": p.layout, "mig_enabled": bool(p.layout)})
                             if g.uuid == p.gpu_uuid else g for g in node.inventory.gpus)
                node.inventory = node.inventory.model_copy(update={"gpus": gpus})
                await self.publish(node.inventory, f"{node_name}/inventory", now, cause=p.command_id)
        await self.producer.flush()

    # ---------------------------------------------------------------- real programs

    async def _place_program(self, node_name: str, node: SimNode, p: PlaceJob, now: int) -> None:
        """Start the placement's program for real; report it started, or failed to start and why."""
        src = f"{node_name}/job/{p.job_id}"
        ctx = self.ctx.for_node(node_name)
        if ctx.cards != node.inventory.gpus:
            from dataclasses import replace

            ctx = replace(ctx, cards=node.inventory.gpus)

        async def checkpointed(ckpt: str, progress_ms: int) -> None:
            if node.lost:
                return  # a lost machine tells nothing
            await self.publish(JobCheckpointed(job_id=p.job_id, node=node_name, progress_ms=progress_ms,
                                               checkpoint=ckpt, command_id=p.command_id), src, cause=p.command_id)
            await self.producer.flush()

        port = Replicas.port_for(p)
        run = Run(p, ctx, output=tee(LogFile(log_file(p, ctx)), self.output, shipper_for(self).for_node(node_name)),
                  on_checkpoint=checkpointed, port=port)
        failed = await run.start()
        if failed is not None:
            await self.publish(failed.failed(p, node_name), src, self.now_ms(), cause=p.command_id)
            return
        r = Running(p.command_id, p.assignments, now, None, parse_checkpoint(p.resume_from),
                    started_mono=self._mono_now(), attempt=p.attempt, run=run, place=p,
                    tier=getattr(p.tier, "value", p.tier))
        node.running[p.job_id] = r
        await self.publish(JobStarted(job_id=p.job_id, node=node_name, command_id=p.command_id), src, now,
                           cause=p.command_id)
        if p.serve is not None:
            self.replicas.start(node_name, node.inventory.address, p, port)
        r.task = self._spawn(self._watch_program(node_name, p.job_id, r))

    async def _watch_program(self, node_name: str, job_id: str, r: Running) -> None:
        """The program ended of itself: completed, or failed with its reason (a stop reports for itself)."""
        ended = await r.run.wait()
        node = self.nodes[node_name]
        if node.running.get(job_id) is r or node.running.get(job_id) is None:
            self.replicas.end(node_name, job_id)
        if ended.stopped or node.lost or node.running.get(job_id) is not r:
            return
        del node.running[job_id]
        src = f"{node_name}/job/{job_id}"
        if ended.ok:
            await self.publish(completed(r.place, job_id, node_name, r.command_id), src, cause=r.command_id)
        else:
            await self.publish(ended.failed(r.place, node_name, r.command_id), src, cause=r.command_id)
        await self.producer.flush()

    async def _stop_program(self, node_name: str, job_id: str, r: Running, grace_s: float, command_id: str,
                            reason: str) -> None:
        """Stop a program (SIGTERM, grace, SIGKILL) and report it stopped at the last checkpoint its manifest named
        (re-read after it exited), else where it started from. A serving replica is drained first (serving.py)."""
        await self.replicas.drain(node_name, job_id)
        await r.run.stop(grace_s)
        if self.nodes[node_name].lost:
            return
        progress = max(r.base_progress_ms, r.run.progress_ms)
        ckpt = r.run.checkpoint or (r.place.resume_from if r.place else "")
        await self.publish(JobStopped(job_id=job_id, node=node_name, command_id=command_id, progress_ms=progress,
                                      checkpoint=ckpt, reason=reason), f"{node_name}/job/{job_id}", cause=command_id)
        await self.producer.flush()

    async def _fail_program(self, node_name: str, job_id: str, r: Running) -> None:
        self.replicas.end(node_name, job_id)
        await r.run.kill()
        await self.publish(JobFailed(job_id=job_id, node=node_name, reason="simulated failure: killed by SIGKILL",
                                     command_id=r.command_id, code="Simulated", signal=9, attempt=r.attempt,
                                     part=r.place.gang_index if r.place else 0),
                           f"{node_name}/job/{job_id}", cause=r.command_id)
        await self.producer.flush()

    def _end(self, r: Running, grace_s: float | None, node_name: str = "", job_id: str = "") -> None:
        """End a run without a report: a stand-in's task is cancelled; a program is stopped with `grace_s` (None:
        SIGKILLed at once), in the background; a serving replica named by node and job is drained first."""
        if r.task:
            r.task.cancel()
        if r.run is not None:
            if grace_s is None:
                if node_name:
                    self.replicas.end(node_name, job_id)
                self._spawn(r.run.kill())
            elif node_name and self.replicas.serving(node_name, job_id):
                async def drained():
                    await self.replicas.drain(node_name, job_id)
                    await r.run.stop(grace_s)
                self._spawn(drained())
            else:
                self._spawn(r.run.stop(grace_s))

    async def command_loop(self) -> None:
        # any of the fleet's principals reads the commands (every node principal may; each node takes its own)
        reader = self.principal or (next(iter(self._speakers.values())).name if self._speakers else NODE)
        await consume_commands(kafka_conn(self.cfg, reader), self.group_id, self.stopping, self.execute, log)

    # ---------------------------------------------------------------- faults

    def parse_fault(self, text: str) -> Fault:
        """`KIND:NODE[:ARG][@SECONDS]`, checked against this fleet; a bad fault raises ValueError at once."""
        body, at, delay = text.partition("@")
        kind, _, rest = body.partition(":")
        parts = rest.split(":") if rest else []
        if kind == "fail":  # fail:JOB -- the job's id may hold ':' itself
            parts = [rest] if rest else []
        if kind not in FAULT_KINDS or len(parts) != FAULT_KINDS[kind]:
            raise ValueError(f"unknown fault {text!r}: want ecc:NODE:INDEX, clear:NODE:INDEX, lose:NODE, "
                             f"slow:NODE:FACTOR, recover:NODE, restart:NODE or fail:JOB, optionally @SECONDS")
        if kind == "fail":
            seconds = float(delay) if at else None
            return Fault(kind, "", parts[0], seconds)
        node = self.nodes.get(parts[0])
        if node is None:
            raise ValueError(f"fault {text!r}: no node {parts[0]!r} in the fleet")
        arg = parts[1] if len(parts) > 1 else ""
        try:
            if kind in ("ecc", "clear") and not 0 <= int(arg) < len(node.inventory.gpus):
                raise ValueError(f"fault {text!r}: {parts[0]} has {len(node.inventory.gpus)} cards")
            if kind == "slow" and float(arg) <= 0:
                raise ValueError(f"fault {text!r}: the slow factor must be positive")
            seconds = float(delay) if at else None
        except ValueError as exc:
            raise ValueError(str(exc) if str(exc).startswith("fault") else f"fault {text!r}: {exc}") from None
        if seconds is not None and seconds < 0:
            raise ValueError(f"fault {text!r}: the delay must not be negative")
        return Fault(kind, parts[0], arg, seconds)

    def inject(self, fault: str | Fault) -> None:
        """Apply a fault now, or, with `@SECONDS`, that long after the agent starts (scheduled by run(); if the agent
        is already running, counted from its start). What a fault publishes is sent in the background."""
        f = self.parse_fault(fault) if isinstance(fault, str) else fault
        if f.at_s is not None:
            if self.started_mono is None:
                self.timed_faults.append(f)
            else:
                self._spawn(self._apply_at(f))
            return
        msgs = self._change(f)
        if msgs and self.producer is not None:
            self._spawn(self._send_all(msgs))

    async def apply(self, fault: str | Fault) -> None:
        """Apply a fault now (any delay ignored) and wait until what it publishes is sent."""
        f = self.parse_fault(fault) if isinstance(fault, str) else fault
        await self._send_all(self._change(f))

    async def _apply_at(self, f: Fault) -> None:
        self._start_clock()
        await asyncio.sleep(max(0.0, self._mono_at(self.started_mono, (f.at_s or 0) * 1000)
                                - asyncio.get_running_loop().time()))
        log.info("fault %s", f)
        await self.apply(f)

    async def _send_all(self, msgs: list[tuple]) -> None:
        for payload, source, time_ms, cause in msgs:
            await self.publish(payload, source, time_ms, cause)
        if msgs:
            await self.producer.flush()

    def _drop_jobs(self, node: SimNode) -> dict[str, Running]:
        jobs, node.running = node.running, {}
        for r in jobs.values():
            if r.task:
                r.task.cancel()
        return jobs

    def _change(self, f: Fault) -> list[tuple]:
        """The state change of a fault; returns what it publishes as (payload, source, time, cause)."""
        if f.kind == "fail":  # the job's process dies: the agent reports it failed; nothing else on the node moves
            for name, n in sorted(self.nodes.items()):
                r = n.running.pop(f.arg, None)
                if r is not None:
                    if r.task:
                        r.task.cancel()
                    if r.run is not None:  # a real program: SIGKILL it, then report (in the background)
                        self._spawn(self._fail_program(name, f.arg, r))
                        return []
                    return [(JobFailed(job_id=f.arg, node=name, reason="simulated failure: exit status 1",
                                       command_id=r.command_id), f"{name}/job/{f.arg}", self.now_ms(), r.command_id)]
            log.warning("fault %s: no such job running here", f)
            return []
        node = self.nodes[f.node]
        if f.kind == "ecc":
            node.ecc_faults.add(node.inventory.gpus[int(f.arg)].uuid)
        elif f.kind == "clear":
            node.ecc_faults.discard(node.inventory.gpus[int(f.arg)].uuid)
        elif f.kind == "lose":
            node.lost = True
            for job_id, r in self._drop_jobs(node).items():  # the machine is gone: nothing of it reports
                self._end(r, None, f.node, job_id)  # its real processes die with it (SIGKILL)
        elif f.kind == "slow":
            node.slow_factor = float(f.arg)
        elif f.kind == "recover":
            was_lost = node.lost
            node.lost, node.slow_factor = False, 1.0
            if was_lost:
                return [(node.inventory, f"{f.node}/inventory", self.now_ms(), None)]
        elif f.kind == "restart":
            if node.lost:
                return []
            now = self.now_ms()
            lost = sorted(self._drop_jobs(node).items())
            for job_id, r in lost:
                if r.run is not None:  # a real program: stopped with its grace, reported at its last checkpoint
                    self._spawn(self._stop_program(f.node, job_id, r, self.ctx.grace_for(r.tier), r.command_id,
                                                   "agent restarted"))
            msgs = [self._stopped(f.node, job_id, r, r.last_checkpoint(now), "agent restarted", now)
                    for job_id, r in lost if r.run is None]
            return msgs + [(node.inventory, f"{f.node}/inventory", now, None)]
        return []

    @staticmethod
    def _stopped(node: str, job_id: str, r: Running, progress: int, why: str, now: int) -> tuple:
        """A JobStopped the agent sends of its own accord (no preempt asked for it): the placement's command id,
        the checkpoint it resumes from."""
        ckpt = f"ckpt:{job_id}:{progress}" if progress else ""
        return (JobStopped(job_id=job_id, node=node, command_id=r.command_id, progress_ms=progress, checkpoint=ckpt,
                           reason=why), f"{node}/job/{job_id}", now, r.command_id)

    async def stop_jobs(self) -> None:
        """Shutdown: every running job checkpoints now and is reported stopped (reason "agent shutdown"); a real
        program is stopped first (SIGTERM, its tier's grace, SIGKILL), all at once, and reported at its last
        checkpoint."""
        now = self.now_ms()
        msgs = []
        programs = []
        for name, node in sorted(self.nodes.items()):
            if node.lost:
                continue
            for job_id, r in sorted(self._drop_jobs(node).items()):
                if r.run is not None:
                    programs.append(self._stop_program(name, job_id, r, self.ctx.grace_for(r.tier), r.command_id,
                                                       "agent shutdown"))
                    continue
                progress = r.progress(now)
                msgs.append((JobCheckpointed(job_id=job_id, node=name, progress_ms=progress,
                                             checkpoint=f"ckpt:{job_id}:{progress}", command_id=r.command_id),
                             f"{name}/job/{job_id}", now, r.command_id))
                msgs.append(self._stopped(name, job_id, r, progress, "agent shutdown", now))
        await self._send_all(msgs)
        await asyncio.gather(*programs)

    def shutdown_budget_s(self) -> float:
        """How long shutdown may take to stop and report every job: the longest grace of a running program, and
        the time to send the reports."""
        graces = [self.ctx.grace_for(r.tier) for n in self.nodes.values() for r in n.running.values() if r.run]
        return max(graces, default=0.0) + SHUTDOWN_REPORT_S

    async def control_loop(self, path: Path) -> None:
        """Faults from a control file, one per line, as they are appended (`gpupool agent inject FAULT`): an
        operator's or a test's way to break a simulated fleet while it runs. A bad line is logged and skipped."""
        done = 0
        while not self.stopping.is_set():
            try:
                lines = path.read_text().splitlines()
            except OSError:
                lines = []
            for line in lines[done:]:
                if line.strip():
                    try:
                        await self.apply(line.strip())
                        log.warning("fault %s applied", line.strip())
                    except Exception as exc:  # noqa: BLE001 - a bad line must not stop the fleet
                        log.warning("control %s: %s: %s", path, line.strip(), exc)
            done = len(lines)
            try:
                await asyncio.wait_for(self.stopping.wait(), 0.5)
            except asyncio.TimeoutError:
                pass

    # ---------------------------------------------------------------- the process

    async def run(self, *, consume_commands: bool = True) -> None:
        """Publish every inventory, then telemetry every interval and (unless told not to) the commands from Kafka,
        until `stopping` is set. Timed faults fire their delay after this start."""
        own = self.producer is None
        if own:
            from agents.node.channels import NodeChannels, speaking_for

            self._speakers = speaking_for(self.cfg, sorted(self.nodes), self.principal)
            self.producer = NodeChannels(self.cfg, self._speakers, linger_ms=10, max_batch_size=1 << 20)
            await self.producer.start()
            self.topic_of = dict(self.producer.topic_of)
        self._start_clock()
        try:
            for f in self.timed_faults:
                self._spawn(self._apply_at(f))
            for name, node in sorted(self.nodes.items()):
                if not node.lost:
                    await self.publish(node.inventory, f"{name}/inventory")
            await self.producer.flush()
            await asyncio.gather(self.telemetry_loop(), *([self.command_loop()] if consume_commands else []),
                                 *([self.control_loop(self.control)] if self.control else []))
        finally:
            try:
                await asyncio.wait_for(self.stop_jobs(), self.shutdown_budget_s())
            except (asyncio.TimeoutError, Exception) as exc:  # noqa: BLE001 - a broker gone first: nothing to tell
                log.warning("running jobs not reported stopped at shutdown: %s", exc)
            if getattr(self, "log_shipper", None) is not None:
                await self.log_shipper.close()  # the last pieces of the programs' output
            for task in list(self._tasks):
                task.cancel()
            if own:
                await self.producer.stop()
