"""Node agents for a simulated fleet: hundreds of nodes in one process, the same contracts as real ones.

Each node publishes its inventory at start, telemetry per card and MIG instance every interval (the telemetry batch
doubles as the heartbeat), and carries out the scheduler's commands once per command id. A simulated job runs for
its duration; its completion is stamped start + duration exactly, so the bill is checkable to the millisecond.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from infra.kafka_client import stop_consumer

from infra.config import Config
from schemas.envelope import DecodeError, Envelope, decode, encode, envelope
from schemas.events import (
    Assignment, GpuSample, GpuTelemetry, JobCheckpointed, JobCompleted, JobStarted, JobStopped, MigReconfigure,
    NodeInventory, PlaceJob, PreemptJob, ReleaseJob, ResizeJob,
)
from schemas.routing import route
from schemas.topics import COMMANDS

log = logging.getLogger("gpupool.agent")


def wall_ms() -> int:
    return time.time_ns() // 1_000_000


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
    task: asyncio.Task | None = None

    def progress(self, now: int) -> int:
        return self.base_progress_ms + max(0, now - self.started_ms)


@dataclass
class SimNode:
    inventory: NodeInventory
    running: dict[str, Running] = field(default_factory=dict)
    ecc_faults: set[str] = field(default_factory=set)
    lost: bool = False
    slow_factor: float = 1.0


class SimFleetAgent:
    def __init__(self, cfg: Config, inventories: list[NodeInventory], *, telemetry_interval_s: float = 1.0,
                 group_id: str = "gpupool-sim-agent"):
        self.cfg = cfg
        self.nodes = {inv.node: SimNode(inv) for inv in inventories}
        self.interval = telemetry_interval_s
        self.group_id = group_id
        self.seen_commands: set[str] = set()
        self._seq: dict[str, int] = {}
        self._seq_base = time.time_ns() // 1000  # restart-safe: a new process starts above the old sequence
        self.producer: AIOKafkaProducer | None = None
        self.published = 0
        self.stopping = asyncio.Event()

    def _next_seq(self, source: str) -> int:
        self._seq[source] = self._seq.get(source, self._seq_base) + 1
        return self._seq[source]

    async def publish(self, payload, source: str, time_ms: int | None = None, cause: str | None = None) -> None:
        env = envelope(payload, source=source, seq=self._next_seq(source), time_ms=time_ms or wall_ms(),
                       causation_id=cause)
        spec, key = route(env)
        await self.producer.send(spec.name, key=key, value=encode(env))
        self.published += 1

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
            units = [(i.uuid, i.size * card.memory_mib // 8) for i in card.mig_layout] or [(card.uuid, card.memory_mib)]
            for uuid, total in units:
                out.append(GpuSample(
                    gpu_uuid=card.uuid, mig_uuid=uuid if uuid != card.uuid else None,
                    util_pct=min(100, milli.get(uuid, 0) // 10), mem_used_mib=min(total, mem.get(uuid, 0)),
                    mem_total_mib=total, temperature_c=35 + min(100, milli.get(uuid, 0) // 10) // 2,
                    power_mw=60_000 + 3_000 * min(100, milli.get(uuid, 0) // 10),
                    ecc_uncorrected=1 if card.uuid in node.ecc_faults else 0,
                    job_ids=tuple(jobs.get(uuid, ()))))
        return tuple(out)

    async def telemetry_loop(self) -> None:
        while not self.stopping.is_set():
            t = wall_ms()
            for name, node in sorted(self.nodes.items()):
                if not node.lost:
                    await self.publish(GpuTelemetry(node=name, samples=self.samples(node)), f"{name}/telemetry", t)
            await self.producer.flush()
            try:
                await asyncio.wait_for(self.stopping.wait(), self.interval)
            except asyncio.TimeoutError:
                pass

    # ---------------------------------------------------------------- commands

    async def _run_job(self, node: str, job_id: str, r: Running) -> None:
        remaining = max(0, r.duration_ms - r.base_progress_ms) if r.duration_ms is not None else None
        if remaining is None:
            await asyncio.Event().wait()  # runs until stopped
        elapsed = int(remaining * self.nodes[node].slow_factor)
        await asyncio.sleep(elapsed / 1000)
        self.nodes[node].running.pop(job_id, None)
        await self.publish(JobCompleted(job_id=job_id, node=node, command_id=r.command_id),
                           f"{node}/job/{job_id}", r.started_ms + elapsed, cause=r.command_id)
        await self.producer.flush()

    async def execute(self, env: Envelope) -> None:
        p = env.payload
        node_name = getattr(p, "node", None)
        node = self.nodes.get(node_name)
        if node is None or p.command_id in self.seen_commands:
            return  # not ours, or a duplicate delivery: each command id is carried out once
        self.seen_commands.add(p.command_id)
        now = wall_ms()
        match p:
            case PlaceJob():
                if p.job_id in node.running:
                    return
                r = Running(p.command_id, p.assignments, now,
                            p.duration_s * 1000 if p.duration_s is not None else None, parse_checkpoint(p.resume_from))
                node.running[p.job_id] = r
                await self.publish(JobStarted(job_id=p.job_id, node=node_name, command_id=p.command_id),
                                   f"{node_name}/job/{p.job_id}", now, cause=p.command_id)
                r.task = asyncio.create_task(self._run_job(node_name, p.job_id, r))
            case PreemptJob():
                r = node.running.pop(p.job_id, None)
                if r is None:
                    return
                if r.task:
                    r.task.cancel()
                progress = r.progress(now)
                ckpt = f"ckpt:{p.job_id}:{progress}"
                src = f"{node_name}/job/{p.job_id}"
                await self.publish(JobCheckpointed(job_id=p.job_id, node=node_name, progress_ms=progress,
                                                   checkpoint=ckpt, command_id=p.command_id), src, now, p.command_id)
                await self.publish(JobStopped(job_id=p.job_id, node=node_name, command_id=p.command_id,
                                              progress_ms=progress, checkpoint=ckpt), src, now, p.command_id)
            case ReleaseJob():
                r = node.running.pop(p.job_id, None)
                if r and r.task:
                    r.task.cancel()
            case ResizeJob():
                r = node.running.get(p.job_id)
                if r:
                    r.assignments = p.assignments
            case MigReconfigure():
                # Simulation applies the layout; the NVML backend does so only with an explicit opt-in.
                gpus = tuple(g.model_copy(update={"mig_layout": p.layout, "mig_enabled": bool(p.layout)})
                             if g.uuid == p.gpu_uuid else g for g in node.inventory.gpus)
                node.inventory = node.inventory.model_copy(update={"gpus": gpus})
                await self.publish(node.inventory, f"{node_name}/inventory", now, cause=p.command_id)
        await self.producer.flush()

    async def command_loop(self) -> None:
        consumer = AIOKafkaConsumer(COMMANDS.name, bootstrap_servers=self.cfg.bootstrap, group_id=self.group_id,
                                    enable_auto_commit=False, auto_offset_reset="earliest")
        await consumer.start()
        try:
            while not self.stopping.is_set():
                batches = await consumer.getmany(timeout_ms=200)
                for tp, msgs in batches.items():
                    for msg in msgs:
                        try:
                            env = decode(msg.value)
                        except DecodeError as exc:
                            log.warning("skipping undecodable command at %s/%d: %s", tp, msg.offset, exc)
                            continue
                        await self.execute(env)
                if batches:
                    await consumer.commit()
        finally:
            await stop_consumer(consumer)

    # ---------------------------------------------------------------- faults

    def inject(self, fault: str) -> None:
        """`ecc:NODE:INDEX`, `lose:NODE`, `slow:NODE:FACTOR`, `recover:NODE`."""
        kind, _, rest = fault.partition(":")
        parts = rest.split(":")
        node = self.nodes[parts[0]]
        if kind == "ecc":
            node.ecc_faults.add(node.inventory.gpus[int(parts[1])].uuid)
        elif kind == "lose":
            node.lost = True
        elif kind == "slow":
            node.slow_factor = float(parts[1])
        elif kind == "recover":
            node.lost, node.slow_factor = False, 1.0
        else:
            raise ValueError(f"unknown fault {fault!r}")

    async def run(self) -> None:
        self.producer = AIOKafkaProducer(bootstrap_servers=self.cfg.bootstrap, acks="all", enable_idempotence=True,
                                         linger_ms=10, max_batch_size=1 << 20)
        await self.producer.start()
        try:
            for name, node in sorted(self.nodes.items()):
                await self.publish(node.inventory, f"{name}/inventory")
            await self.producer.flush()
            await asyncio.gather(self.telemetry_loop(), self.command_loop())
        finally:
            for node in self.nodes.values():
                for r in node.running.values():
                    if r.task:
                        r.task.cancel()
            await self.producer.stop()
