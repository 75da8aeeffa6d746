"""The FGD protocol's product row: the live scheduler (agents/scheduler/core.py `Scheduler`) replays the trace.

Nothing of the product's policy is copied here. Each seed builds a fresh `Scheduler` -- the product's own, with the
open ledger the simulations use (no quota: the protocol has one tenant and nothing to share) -- and feeds it, through
`agents.scheduler.core.replay` (the one replay the worker's rebuild and the audit call, one record at a time through
`step_contained`, as the live agent steps), the events a real pool would see:

- one `node.inventory` per trace node, with the trace's CPU, memory and GPU count (cards built as the fleet simulator
  builds them, `agents.node.fleet.card_uuid`);
- per pod of the arrival sequence, the user's `job.requested` (its CPU, memory, cards or share, or no card at all,
  see `request_of`). Typical shapes are learned from these requests as they arrive (`scoring.Workload`), never from
  the trace as a whole. The scheduler's `cmd.place` is answered by the node agent's `job.started`;
- a request no node takes is withdrawn by its user at once (`job.cancelled`): the protocol does not retry failures.
  The protocol's pods never leave, so no run completes.

Which node and cards each pod got is read from the `cmd.place` the scheduler emitted; those placements are mirrored
into the protocol's `ClusterState` only to measure allocation and FGD's fragmentation the same way for every row.

What the trace says that the product says otherwise, explicitly:

- **Cards.** openb's `gpu_milli` is a share of whichever card the pod lands on: the protocol's GPUs are
  interchangeable (the three dev traces name no model in `gpu_spec`). The product's requests are in milli-CU of a
  card model, and its model preference ranks models before fragmentation (scoring.model_order), which the trace
  gives no ground for. So every card is of one model, `LIVE_MODEL`, unknown to schemas/gpu_models.py, i.e. the
  default profile (400 milli-CU, 16 GiB): a k-GPU pod asks k x 400 milli-CU, a share of m milli asks the compute
  whose share on that card is exactly m (`share_for`). A pod that names models is refused (`ValueError`).
- **CPU-only pods** (13 % of openb's pods) are the product's CPU-only jobs (`compute_milli` 0: data preparation,
  evaluation, tokenizers beside the GPU work): the scheduler places them too, on the node whose free cards their
  CPU and memory strand least (placement.host_delta). Until this round they were placed by FGD's rule outside the
  scheduler; the copy of the policy (GpupoolPolicy, deleted) had placed them by its own measure, which was most of
  its margin over FGD (docs/evaluation.md).
- **One node per pod.** A protocol pod runs on one node; every node is its own rack and data center, so no gang of
  the product spans two nodes (`Constraints.max_spread` would say the same per request, at the cost of the
  scheduler's per-shape caches, which skip constrained requests).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, Sequence

import numpy as np

from agents.node.fleet import card_uuid
from agents.scheduler.core import Scheduler, replay
from agents.scheduler.quota import open_ledger
from agents.sim.packing import GPU_MILLI, ClusterState, PodRequest
from schemas.envelope import Envelope, envelope
from schemas.events import GpuCard, JobCancelled, JobRequested, JobStarted, NodeInventory, Tier
from schemas.gpu_models import model as gpu_model
from schemas.gpu_models import share_for

LIVE_MODEL = "openb-gpu"  # unknown to schemas/gpu_models.py: the default profile (400 milli-CU, 16 GiB a card)
TENANT = "openb"
T0_MS = 1_700_000_000_000  # event times: one millisecond per input (nothing reads a clock)
CPU_PODS = "sim/cpu-pods"  # the source of the inventories that CPU-only pods shrink


def request_of(job_id: str, pod: PodRequest) -> JobRequested:
    """The user's request for one pod of the trace: its CPU and memory, and k whole cards, a share of one, or no
    card at all (a CPU-only job)."""
    if pod.models:
        raise ValueError(f"{job_id}: a pod that names card models ({'|'.join(sorted(pod.models))}) has no request "
                         f"in the live replay (its cards are one model, {LIVE_MODEL})")
    m = gpu_model(LIVE_MODEL)
    if not pod.num_gpu:
        compute = 0
    elif pod.num_gpu > 1 or pod.gpu_milli == GPU_MILLI:
        compute = pod.num_gpu * m.cu_milli
    else:
        compute = max(1, pod.gpu_milli * m.cu_milli // GPU_MILLI)
        while share_for(compute, m) < pod.gpu_milli:
            compute += 1
        if share_for(compute, m) != pod.gpu_milli:
            raise ValueError(f"{job_id}: no compute gives a share of exactly {pod.gpu_milli} milli on {LIVE_MODEL}")
    return JobRequested(job_id=job_id, tenant=TENANT, project="openb", tier=Tier.OFFLINE, compute_milli=compute,
                        gpu_memory_mib=pod.num_gpu, cpu_milli=pod.cpu_milli, memory_mib=pod.memory_mib)


def inventory(name: str, cpu_milli: int, memory_mib: int, gpus: int) -> NodeInventory:
    m = gpu_model(LIVE_MODEL)
    cards = tuple(GpuCard(uuid=card_uuid(name, i), index=i, model=LIVE_MODEL, memory_mib=m.memory_mib,
                          compute_capability=m.compute_capability) for i in range(gpus))
    return NodeInventory(node=name, rack=name, datacenter=name, cpu_milli=cpu_milli, memory_mib=memory_mib,
                         gpus=cards)


@dataclass
class LiveRun:
    """One seed's replay: what the scheduler was fed, what it decided, and the mirrored state."""
    state: ClusterState
    inputs: list[Envelope] = field(default_factory=list)
    outputs: list[list[Envelope]] = field(default_factory=list)  # per input, what the scheduler emitted
    placed: dict[str, tuple[str, tuple[tuple[str, int], ...]]] = field(default_factory=dict)  # job -> node, cards
    scheduler: Scheduler | None = None


class _Feed:
    """The input side of the replay: yields the next record once the scheduler's answer to the last is known
    (`replay` calls `answered` with each record's outputs before it asks for the next)."""

    def __init__(self, nodes, pods: Sequence[PodRequest], seq: np.ndarray, state: ClusterState, run: LiveRun,
                 on_arrival) -> None:
        self.nodes, self.pods, self.seq, self.state, self.run = nodes, pods, seq, state, run
        self.on_arrival = on_arrival  # (pod, node index or None), after each arrival's answer
        self.node_of = {name: i for i, name in enumerate(nodes.names)}
        self.seqs: dict[str, int] = {}
        self.now = T0_MS
        self.last: list[Envelope] = []

    def env(self, payload, source: str) -> Envelope:
        n = self.seqs[source] = self.seqs.get(source, 0) + 1
        self.now += 1
        e = envelope(payload, source=source, seq=n, time_ms=self.now)
        self.run.inputs.append(e)
        return e

    def answered(self, _i: int, outputs: list[Envelope]) -> None:
        self.run.outputs.append(outputs)
        self.last = outputs

    def __iter__(self) -> Iterator[Envelope]:
        nodes = self.nodes
        for i, name in enumerate(nodes.names):
            yield self.env(inventory(name, nodes.cpu_milli[i], nodes.memory_mib[i], nodes.gpu_count[i]),
                           f"{name}/inventory")
        for k, pi in enumerate(self.seq):
            yield from self.pod(f"p{k:06d}", self.pods[pi])

    def pod(self, job: str, pod: PodRequest) -> Iterator[Envelope]:
        yield self.env(request_of(job, pod), f"sim/user/{job}")
        out = self.last
        if not out:  # a request is always answered (placed, pending or rejected): none means its step raised
            raise RuntimeError(f"{job}: the scheduler's step raised (step_contained skipped it)")
        place = [o.payload for o in out if o.kind == "cmd.place"]
        odd = [o.kind for o in out if o.kind.startswith("cmd.") and o.kind != "cmd.place"]
        if odd:
            raise RuntimeError(f"{job}: the scheduler sent {odd}; the protocol's pods never move or stop")
        if not place:
            self.on_arrival(pod, None)
            if any(o.kind == "job.pending" for o in out):
                yield self.env(JobCancelled(job_id=job, reason="the protocol does not retry a failed pod"),
                               f"sim/user/{job}")
            return
        p = place[0]
        node = self.node_of[p.node]
        gpus = tuple(int(a.gpu_uuid.rsplit("-", 1)[1]) for a in p.assignments)
        if len(place) > 1 or len(gpus) != pod.num_gpu or any(a.milli != pod.gpu_milli for a in p.assignments):
            raise RuntimeError(f"{job}: placed as {place}, not on one node as {pod.num_gpu} x {pod.gpu_milli} milli")
        self.state.place(node, pod, gpus)
        self.run.placed[job] = (p.node, tuple((a.gpu_uuid, a.milli) for a in p.assignments))
        self.on_arrival(pod, node)
        yield self.env(JobStarted(job_id=job, node=p.node, command_id=p.command_id), f"{p.node}/job/{job}")


def run_live(nodes, pods: Sequence[PodRequest], seq: np.ndarray, on_arrival, scheduler: Scheduler | None = None,
             state: ClusterState | None = None) -> LiveRun:
    """Replay the arrivals `seq` through a live `Scheduler` (a fresh one unless given); `on_arrival(pod, node)` after
    each arrival's outcome (node index, None: it failed). Every pod is a job of the product, CPU-only pods too."""
    s = Scheduler(ledger=open_ledger()) if scheduler is None else scheduler
    if not isinstance(s, Scheduler):
        raise TypeError(f"the product row is the live scheduler (agents.scheduler.core.Scheduler), not {type(s)!r}")
    state = nodes.state() if state is None else state
    run = LiveRun(state)
    feed = _Feed(nodes, pods, seq, state, run, on_arrival)
    replay(feed, scheduler=s, on_outputs=feed.answered)
    run.scheduler = s
    return run
