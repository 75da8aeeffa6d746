"""Placement throughput of the pure scheduler: placements per second at 5,000 nodes x 8 GPUs, 50,000 jobs.

    .venv/bin/python -m bench.placement [--nodes 5000] [--gpus-per-node 8] [--jobs 50000] [--seed 1]
                                        [--mode a|b|ab] [--multinode-pct P] [--preemption [--victims requeue|cancel]]
                                        [--max-seconds S] [--quick] [--profile] [--json]

No broker, no decode: envelopes go straight into `Scheduler.step`, the call the live agent makes for every input
record (the agent also decodes each record and encodes and produces each output; neither is timed here).

Inputs are deterministic from --seed and built before any timing starts:

- Fleet: --nodes nodes of --gpus-per-node cards, by node index 50% A100-80GB, 30% H100-80GB, 20% H200 (models from
  schemas/gpu_models.py); 1 node in 20 of the A100s is MIG-enabled with 7 x 1g.10gb per card. 32 nodes a rack,
  2 data centers. Built with `agents.node.fleet.make_node` (the simulator's inventories).
- Jobs: --jobs `JobRequested`, shapes drawn by weight (compute in milli-CU, 1000 = one A100; memory in GiB):
  MIG-sized 100/8, quarter 250/20, half 500/40, whole card 1000/80, gangs of 2/4/8 cards (2000/160, 4000/320,
  8000/640) and a multi-node gang of 16 cards (16000/1280, does not fit one 8-card node). Tiers vary by shape.
  7 tenants with skewed demand, 3 projects. Quotas are set from each tenant's own demand -- in what its jobs would
  hold, the unit quota is charged in (`holding`: whole cards count their model's CU) -- so that two tenants borrow
  (quota 0.8x and 0.9x their demand, 150% overcommit cap, never blocked), four stay within quota (1.3x) and one has
  no quota (the bench's scheduler leaves such a tenant unlimited, `open_ledger`; the product's default would make
  it wait); one (tenant, project) pair has a project quota (2x). The fleet's GPU memory ends ~75% held when all
  fit.

What is timed (process CPU time and wall time, `time.process_time` / `time.perf_counter`), per scenario:

- (a) one by one: each `job.requested` envelope is stepped and its outputs read before the next is sent; in the
  core every request runs `_cycle` (over all pending jobs at 798bc19; at aff17a6 over the new job alone when nothing
  else changed since the last full cycle). This is what the live agent does with a burst.
- (b) queued, then one cycle: the 50,000 requests are stepped (untimed) with the scheduler's `_cycle` switched off
  for that instance, so they only enter the pending queue; then one `scheduler.tick` is stepped (timed). The core has
  no way to queue a request without cycling (every `job.requested` runs `_cycle`), so this is a state the live core
  cannot reach through `step`: (b) measures what one cycle over a 50,000-job queue costs, the batched path.
  Reported as unavailable if the core has no `_cycle` or the queue does not hold every request.
- --preemption: the fleet is first filled completely with offline-tier work (untimed, through `step`; node agents'
  `job.started` answers included, event time one hour before the timed part so victims have progress to lose).
  Each node gets one tiling pattern (8 whole cards, 4 x 2-card gangs, 2 x 4-card, 1 x 8-card, 16 halves, 32
  quarters; 56 MIG slices on MIG nodes), so no card has room left. Then --jobs inference / online-training jobs are
  stepped one by one (scenario a). The first cannot fit without preemption; a victim can free more than its
  preemptor needs, and later jobs may then fit directly: the result says how many placed after preempting.

In every scenario the bench acts as the node agents inside the timed loop: each `cmd.preempt` is answered with the
victim's `job.stopped` (at once, as if it checkpointed instantly), stepped like any input: with the default
`--victims requeue` the victim goes back to the queue as the product does; with `cancel` its owner cancels it just
before the stop arrives, so it never requeues (kube-scheduler's preemption benchmark deletes its victims). A job
nominated after preempting is counted once a `cmd.place` for it comes out after its victims stopped.

Counted: placements = distinct timed job ids that got a `cmd.place` (a multi-node gang sending several counts once);
preemption decisions = distinct jobs named in `cmd.preempt` reasons (`for_job`); victims = `cmd.preempt` commands.
Rates are over the timed part only; also per tenth of the submitted jobs, to show how the rate changes as the fleet
fills. GC pauses inside the timed part are measured (`gc.callbacks`) and reported, not removed. A digest of every
placement decision (job -> node, in order) shows whether two runs decided the same.

--profile runs the timed part under cProfile (figures then inflated: not a measurement) and prints the top 25
functions by cumulative time. --max-seconds stops a timed loop early; the result then says `truncated` and gives
how many jobs were submitted. Prints a table and a final line `RESULT {json}`; with --json only the JSON line goes
to stdout (the table to stderr).
"""
from __future__ import annotations

import argparse
import cProfile
import gc
import io
import os
import json
import pstats
import random
import subprocess
import sys
import time
import zlib
from collections import Counter, deque
from dataclasses import dataclass, field

from agents.node.fleet import make_node
from streams.edge.scheduler_agent import tune_gc
from agents.scheduler.core import Scheduler
from agents.scheduler.node_index import cards_needed
from agents.scheduler.quota import open_ledger
from schemas.gpu_models import model as gpu_model, share_for
from schemas.envelope import Envelope, envelope
from schemas.events import (
    JobCancelled, JobRequested, JobStarted, JobStopped, NodeInventory, QuotaSet, SchedulerTick, Tier,
)

GIB = 1024
T0 = 1_760_000_000_000  # fixed epoch ms: the inputs are the same on every run
T_FILL = T0  # the preemption fill's event times
T_RUN = T0 + 3_600_000  # the timed part starts an hour later

# (name, compute_milli, gpu_memory_gib, weight %, tiers to draw from)
SHAPES = (
    ("mig-small", 100, 8, 20.0, (Tier.INFERENCE, Tier.INFERENCE, Tier.OFFLINE)),
    ("quarter", 250, 20, 35.0, (Tier.INFERENCE, Tier.ONLINE_TRAINING, Tier.OFFLINE)),
    ("half", 500, 40, 20.0, (Tier.INFERENCE, Tier.ONLINE_TRAINING, Tier.OFFLINE)),
    ("whole", 1000, 80, 15.0, (Tier.INFERENCE, Tier.ONLINE_TRAINING, Tier.OFFLINE)),
    ("gang-2", 2000, 160, 6.0, (Tier.ONLINE_TRAINING, Tier.OFFLINE)),
    ("gang-4", 4000, 320, 2.5, (Tier.ONLINE_TRAINING, Tier.OFFLINE)),
    ("gang-8", 8000, 640, 1.2, (Tier.ONLINE_TRAINING, Tier.OFFLINE)),
    ("gang-16-multinode", 16000, 1280, 0.3, (Tier.ONLINE_TRAINING, Tier.OFFLINE)),
)
SHAPE_BY_NAME = {s[0]: s for s in SHAPES}
# tenant, weight of the demand, quota as a multiple of its own demand (None: no quota configured)
TENANTS = (("team-a", 30, 0.8), ("team-b", 20, 0.9), ("team-c", 15, 1.3), ("team-d", 15, 1.3), ("team-e", 10, 1.3),
           ("team-f", 5, 1.3), ("guest", 5, None))
PROJECTS = ("train", "eval", "serve")
PROJECT_QUOTA = ("team-a", "train", 2.0)
OVERCOMMIT_PCT = 150


# ---------------------------------------------------------------- inputs

class Feed:
    """Envelopes with per-source sequence numbers, as each producer would number them."""

    def __init__(self):
        self.seqs: dict[str, int] = {}

    def env(self, payload, source: str, time_ms: int) -> Envelope:
        seq = self.seqs[source] = self.seqs.get(source, 0) + 1
        return envelope(payload, source=source, seq=seq, time_ms=time_ms)


def node_model(i: int) -> tuple[str, bool]:
    """(model, MIG-enabled) by node index: 50% A100-80GB (1 in 20 of them MIG), 30% H100-80GB, 20% H200."""
    k = i % 10
    if k < 5:
        return "A100-80GB", i % 40 == 0  # 1 node in 40 = 1 A100 node in 20
    return ("H100-80GB", False) if k < 8 else ("H200", False)


def fleet(nodes: int, gpus: int) -> list[NodeInventory]:
    out = []
    for i in range(nodes):
        name = f"node-{i:05d}"
        m, mig = node_model(i)
        out.append(make_node(name, m, gpus, rack=f"rack-{i // 32:03d}", datacenter=f"dc-{(i // 32) % 2}",
                             mig=["1g.10gb"] * 7 if mig else None))
    return out


def draw_jobs(rng: random.Random, n: int, prefix: str, tiers: tuple[Tier, ...] | None = None,
              multinode_pct: float | None = None) -> list[JobRequested]:
    names = [s[0] for s in SHAPES]
    weights = [multinode_pct if multinode_pct is not None and s[0].endswith("multinode") else s[3] for s in SHAPES]
    tw = [t[1] for t in TENANTS]
    out = []
    for k in range(n):
        name, compute, mem, _, shape_tiers = SHAPE_BY_NAME[rng.choices(names, weights)[0]]
        tier = rng.choice(tiers or shape_tiers)
        tenant = rng.choices([t[0] for t in TENANTS], tw)[0]
        out.append(JobRequested(job_id=f"{prefix}{k:06d}.{name}", tenant=tenant, project=rng.choice(PROJECTS),
                                tier=tier, compute_milli=compute, gpu_memory_mib=mem * GIB,
                                cpu_milli=1000, memory_mib=8 * GIB, duration_s=rng.randint(600, 7200),
                                checkpoint_interval_s=300))
    return out


FLEET_MIX = (("A100-80GB", 50), ("H100-80GB", 30), ("H200", 20))  # node_model's shares of the fleet, in percent


def holding(j: JobRequested) -> int:
    """What the job would hold in the quota's unit (milli-CU, agents/scheduler/quota.py: held), averaged over the
    fleet's card models by their share: a share of a card holds what it asked, whole cards the
    model's CU each -- a 2-card gang on H100s holds 6,340 milli-CU for the 2,000 it asks."""
    total = 0
    for name, pct in FLEET_MIX:
        m = gpu_model(name)
        if cards_needed(j.compute_milli, j.gpu_memory_mib, name) == 1:
            cu = m.cu_milli if share_for(j.compute_milli, m) >= 1000 else j.compute_milli
        else:
            cu = cards_needed(j.compute_milli, j.gpu_memory_mib, name) * m.cu_milli
        total += cu * pct
    return total // 100


def quotas(jobs: list[JobRequested]) -> list[QuotaSet]:
    """Quotas as multiples of each tenant's demand, in what its jobs would hold (the unit quota is charged in)."""
    demand: Counter = Counter()
    proj: Counter = Counter()
    for j in jobs:
        demand[j.tenant] += holding(j)
        proj[(j.tenant, j.project)] += holding(j)
    out = [QuotaSet(tenant=t, gpu_milli=int(demand[t] * f), overcommit_pct=OVERCOMMIT_PCT)
           for t, _, f in TENANTS if f is not None]
    t, p, f = PROJECT_QUOTA
    out.append(QuotaSet(tenant=t, project=p, gpu_milli=int(proj[(t, p)] * f), overcommit_pct=OVERCOMMIT_PCT))
    return out


def fill_pattern(rng: random.Random, inv: NodeInventory) -> list[tuple[int, int]]:
    """(compute_milli, gpu_memory_mib) of offline jobs that together take every card of the node."""
    gpus = len(inv.gpus)
    card = inv.gpus[0]
    if card.mig_enabled:
        return [(100, 8 * GIB)] * (len(card.mig_layout) * gpus)
    mem = card.memory_mib
    options = [[(1000, mem)] * gpus, [(500, mem // 2)] * (2 * gpus), [(250, mem // 4)] * (4 * gpus)]
    for g in (2, 4, 8):
        if gpus % g == 0:
            options.append([(1000 * g, mem * g)] * (gpus // g))
    return rng.choice(options)


@dataclass
class Inputs:
    nodes: list[NodeInventory]
    jobs: list[JobRequested]  # the timed ones
    quotas: list[QuotaSet]
    fill: list[list[JobRequested]] = field(default_factory=list)  # per node, same order as nodes (--preemption)


def build(args) -> Inputs:
    rng = random.Random(args.seed)
    nodes = fleet(args.nodes, args.gpus_per_node)
    if not args.preemption:
        jobs = draw_jobs(rng, args.jobs, "j", multinode_pct=args.multinode_pct)
        return Inputs(nodes, jobs, quotas(jobs))
    jobs = draw_jobs(rng, args.jobs, "hi", (Tier.INFERENCE, Tier.ONLINE_TRAINING), args.multinode_pct)
    fill = []
    tw = [t[1] for t in TENANTS]
    n = 0
    for inv in nodes:
        part = []
        for compute, mem in fill_pattern(rng, inv):
            part.append(JobRequested(job_id=f"fill{n:07d}", tenant=rng.choices([t[0] for t in TENANTS], tw)[0],
                                     project=rng.choice(PROJECTS), tier=Tier.OFFLINE, compute_milli=compute,
                                     gpu_memory_mib=mem, cpu_milli=500, memory_mib=4 * GIB, duration_s=36_000,
                                     checkpoint_interval_s=600))
            n += 1
        fill.append(part)
    return Inputs(nodes, jobs, quotas(jobs + [j for part in fill for j in part]), fill)


# ---------------------------------------------------------------- the run

class Run:
    """A scheduler plus the bench acting as users and node agents around it."""

    def __init__(self, victims: str):
        self.s = Scheduler(ledger=open_ledger())  # `guest`, without a quota, is unlimited (the product's default: 0)
        self.feed = Feed()
        self.victims = victims
        self.now = T0
        self.placed: dict[str, str] = {}  # job id -> node of its first cmd.place
        self.place_cmds = 0
        self.multinode: set[str] = set()
        self.preempts = 0
        self.preempted_for: set[str] = set()
        self.last_pending: dict[str, tuple[str, ...]] = {}
        self.outputs = 0
        self.kinds: Counter = Counter()
        self.digest = 0
        self.answers = 0
        self.started: list[Envelope] = []  # job.started answers to feed (the fill only)
        self.answer_started = False

    def reset_counts(self) -> None:
        """Counters cover the timed part only (the placed map stays: it is filtered by the timed job ids)."""
        self.place_cmds = self.preempts = self.outputs = self.answers = 0
        self.kinds.clear()
        self.preempted_for.clear()
        self.multinode.clear()

    def step(self, env: Envelope) -> None:
        """Step one input and, acting as the node agents, answer each preemption at once."""
        queue = deque([env])
        while queue:
            outs = self.s.step(queue.popleft())
            self.outputs += len(outs)
            for out in outs:
                p = out.payload
                k = p.kind
                self.kinds[k] += 1
                if k == "cmd.place":
                    self.place_cmds += 1
                    if p.job_id not in self.placed:
                        self.placed[p.job_id] = p.node
                        self.digest = zlib.crc32(f"{p.job_id}>{p.node};".encode(), self.digest)
                    if getattr(p, "gang_size", 1) > 1:
                        self.multinode.add(p.job_id)
                    if self.answer_started:
                        self.started.append(self.feed.env(JobStarted(job_id=p.job_id, node=p.node,
                                                                     command_id=p.command_id),
                                                          f"{p.node}/job/{p.job_id}", self.now))
                elif k == "cmd.preempt":
                    self.preempts += 1
                    for r in p.reasons:
                        if "for_job" in r.data:
                            self.preempted_for.add(str(r.data["for_job"]))
                    src = f"{p.node}/job/{p.job_id}"
                    answers = []
                    if self.victims == "cancel":  # its owner gives up on it: it never requeues
                        answers.append(self.feed.env(JobCancelled(job_id=p.job_id, reason="preempted"), "cli/cancel",
                                                     self.now))
                    answers.append(self.feed.env(JobStopped(job_id=p.job_id, node=p.node, command_id=p.command_id,
                                                            checkpoint=f"ckpt-{p.job_id}-{self.now}"), src, self.now))
                    self.answers += len(answers)
                    queue.extend(answers)  # stepped in order, after the input that caused them
                elif k == "job.pending":
                    self.last_pending[p.job_id] = tuple(f"{r.plugin}:{r.code}" for r in p.reasons)


def setup(inp: Inputs, victims: str, preemption: bool) -> Run:
    """Everything before the timed part, through `step`."""
    run = Run(victims)
    run.now = T_FILL
    for q in inp.quotas:
        run.step(run.feed.env(q, "cli/quota", run.now))
    if not preemption:
        for inv in inp.nodes:
            run.step(run.feed.env(inv, f"{inv.node}/inventory", run.now))
        return run
    # Fill: nodes arrive in reverse name order, each followed by its own jobs. The newest node is first in the
    # scheduler's name order and every node after it is already full, so a first-fit scan stops at once: the fill
    # costs O(jobs), not O(jobs x nodes). Every placement is answered with job.started (the jobs run).
    run.answer_started = True
    for inv, part in reversed(list(zip(inp.nodes, inp.fill))):
        run.step(run.feed.env(inv, f"{inv.node}/inventory", run.now))
        for j in part:
            run.step(run.feed.env(j, "cli/fill", run.now))
            run.now += 1
        for env in run.started:
            run.step(env)
        run.started.clear()
    run.answer_started = False
    want = sum(len(p) for p in inp.fill)
    got = sum(1 for j in run.placed if j.startswith("fill"))
    if got != want:
        raise SystemExit(f"fill placed {got} of {want} offline jobs: the fleet is not full, the preemption "
                         f"scenario would not measure preemption")
    return run


class GcTimer:
    def __init__(self):
        self.total = 0.0
        self.count = 0
        self._t = 0.0

    def __call__(self, phase, info):
        if phase == "start":
            self._t = time.perf_counter()
        else:
            self.total += time.perf_counter() - self._t
            self.count += 1


@dataclass
class Timed:
    scenario: str
    submitted: int
    cpu_s: float
    wall_s: float
    gc_s: float
    gc_count: int
    deciles: list[dict]
    truncated: bool
    profile: str = ""
    step_ms: dict = field(default_factory=dict)  # (a): wall ms of one request's step: p50, p99, max
    # (a): where the time goes: (shape, "preempting" | "plain") -> [requests, wall s of their steps]; a step that
    # preempts counts what the node agents' answers cause too (the victims' stops, their requeue and explanation)
    paths: dict = field(default_factory=dict)


def _instructions(on: bool) -> None:
    """Under bench/instructions.sh (valgrind's callgrind, started with instrumentation off): count the instructions
    of scenario (a)'s timed part alone -- a figure this shared machine's load does not move, where CPU seconds vary
    by a third from run to run."""
    if os.environ.get("GPUPOOL_CALLGRIND") == "1":
        subprocess.run(["callgrind_control", "-i", "on" if on else "off", str(os.getpid())], capture_output=True,
                       check=False)


def timed_one_by_one(run: Run, jobs: list[JobRequested], max_s: float, profile: bool) -> Timed:
    envs = []
    for k, j in enumerate(jobs):  # built before the clock starts
        envs.append(run.feed.env(j, "cli/requests", T_RUN + k))
    run.reset_counts()
    marks = {max(1, len(envs) * d // 10) for d in range(1, 11)}
    ids = {j.job_id for j in jobs}
    deciles = []
    gct = GcTimer()
    prof = cProfile.Profile() if profile else None
    gc.callbacks.append(gct)
    truncated = False
    submitted = 0
    steps: list[float] = []  # wall seconds of each request's step, node-agent answers included
    paths: dict[tuple[str, str], list] = {}
    _instructions(True)
    c0, w0 = time.process_time(), time.perf_counter()
    lc, lp = c0, 0
    if prof:
        prof.enable()
    try:
        for k, env in enumerate(envs, 1):
            run.now = env.event_time_ms
            before = run.preempts
            t = time.perf_counter()
            run.step(env)
            dt = time.perf_counter() - t
            steps.append(dt)
            p = paths.setdefault((env.payload.job_id.rsplit(".", 1)[-1],
                                  "preempting" if run.preempts > before else "plain"), [0, 0.0])
            p[0] += 1
            p[1] += dt
            submitted = k
            if k in marks or max_s:
                c, w = time.process_time(), time.perf_counter()
                if k in marks:
                    p = sum(1 for j in ids if j in run.placed)  # over the timed ids: the fill jobs are many
                    deciles.append({"submitted": k, "placed": p, "cpu_s": round(c - lc, 3),
                                    "per_s_cpu": round((p - lp) / max(c - lc, 1e-9), 1)})
                    lc, lp = c, p
                if max_s and w - w0 > max_s:
                    truncated = k < len(envs)
                    if truncated:  # the partial tenth, so the rate where it stopped is on record
                        p = sum(1 for j in ids if j in run.placed)  # over the timed ids: the fill jobs are many
                        deciles.append({"submitted": k, "placed": p, "cpu_s": round(c - lc, 3),
                                        "per_s_cpu": round((p - lp) / max(c - lc, 1e-9), 1)})
                    break
    finally:
        if prof:
            prof.disable()
        c1, w1 = time.process_time(), time.perf_counter()
        _instructions(False)
        gc.callbacks.remove(gct)
    steps.sort()
    lat = {f"p{q}": round(1000 * steps[min(len(steps) - 1, len(steps) * q // 100)], 3) for q in (50, 99)} \
        if steps else {}
    if steps:
        lat["max"] = round(1000 * steps[-1], 3)
    return Timed("a", submitted, c1 - c0, w1 - w0, gct.total, gct.count, deciles, truncated, _top(prof), lat, paths)


def timed_queued(run: Run, jobs: list[JobRequested], profile: bool) -> Timed | str:
    """(b): the requests are stepped with the cycle switched off (untimed), then one tick runs one cycle."""
    s = run.s
    if not callable(getattr(s, "_cycle", None)):
        return "unavailable: the scheduler core has no _cycle to hold back"
    s._cycle = lambda *a, **k: None  # an instance attribute shadows the method while the queue is built
    try:
        for k, j in enumerate(jobs):
            run.now = T_RUN + k
            run.step(run.feed.env(j, "cli/requests", run.now))
    finally:
        del s._cycle
    if len(getattr(s, "pending", ())) != len(jobs):
        return f"unavailable: {len(getattr(s, 'pending', ()))} pending after queueing {len(jobs)} requests"
    run.now = T_RUN + len(jobs)
    run.reset_counts()
    tick = run.feed.env(SchedulerTick(now_ms=run.now), "ticker", run.now)
    gct = GcTimer()
    prof = cProfile.Profile() if profile else None
    gc.callbacks.append(gct)
    c0, w0 = time.process_time(), time.perf_counter()
    if prof:
        prof.enable()
    try:
        run.step(tick)
    finally:
        if prof:
            prof.disable()
        c1, w1 = time.process_time(), time.perf_counter()
        gc.callbacks.remove(gct)
    return Timed("b", len(jobs), c1 - c0, w1 - w0, gct.total, gct.count, [], False, _top(prof))


def _top(prof) -> str:
    if prof is None:
        return ""
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(25)
    if os.environ.get("GPUPOOL_PROFILE_OUT"):  # the whole profile, for pstats (sorted other ways)
        prof.dump_stats(os.environ["GPUPOOL_PROFILE_OUT"])
    return buf.getvalue()


# ---------------------------------------------------------------- report

KUBE = {  # kubernetes/kubernetes test/integration/scheduler_perf, `threshold` (pods/s) of the performance workloads
    "plain": ("SchedulingBasic/5000Nodes_50000Pods", 810),
    "extended": ("SchedulingWithExtendedResource/5000pods_5000nodes", 180),
    "preemption": ("PreemptionAsync/5000Nodes (regular pods among preemptors at 5/s)", 570),
}
GOAL = {"plain": 2000, "preemption": 1000}


def memory_used_pct(run: Run) -> float | None:
    """GPU memory held on the fleet after the timed part, from the scheduler's own node views."""
    try:
        free = total = 0
        for v in run.s.nodes.values():
            for c in v.card_free():
                free += c.memory_mib
            total += sum(g.memory_mib for g in v.inventory.gpus)
        return round(100 * (total - free) / total, 1) if total else None
    except (AttributeError, TypeError):
        return None


def summarize(run: Run, t: Timed, jobs: list[JobRequested], inp: Inputs, args) -> dict:
    ids = {j.job_id for j in jobs[:t.submitted]}
    placed = [j for j in run.placed if j in ids]
    by_shape: dict[str, list[int]] = {}
    for j in jobs[:t.submitted]:
        shape = j.job_id.split(".", 1)[1]
        row = by_shape.setdefault(shape, [0, 0])
        row[0] += 1
        row[1] += j.job_id in run.placed
    waiting = Counter(run.last_pending.get(j.job_id, ("?",))[0] for j in jobs[:t.submitted]
                      if j.job_id not in run.placed)
    via_preemption = sum(1 for j in placed if j in run.preempted_for)
    n = len(placed)
    kind = "preemption" if args.preemption else "plain"
    cards = sum(len(inv.gpus) for inv in inp.nodes)
    out = {
        "scenario": ("preemption-" if args.preemption else "plain-") + t.scenario,
        "nodes": len(inp.nodes), "gpus": cards, "jobs": len(jobs), "submitted": t.submitted,
        "truncated": t.truncated, "seed": args.seed,
        "multinode_pct": SHAPE_BY_NAME["gang-16-multinode"][3] if args.multinode_pct is None else args.multinode_pct,
        "victims": args.victims if args.preemption else None,
        "fill_jobs": sum(len(p) for p in inp.fill),
        "placed": n, "placed_via_preemption": via_preemption, "multinode_placed": len(run.multinode & ids),
        "place_commands": run.place_cmds, "preempt_commands": run.preempts,
        "preemption_decisions": len(run.preempted_for & ids),
        "decisions_for_other_jobs": len(run.preempted_for - ids),  # e.g. requeued victims reclaiming borrowed work
        "node_agent_answers": run.answers,
        "cpu_s": round(t.cpu_s, 3), "wall_s": round(t.wall_s, 3), "gc_s": round(t.gc_s, 3), "gc_runs": t.gc_count,
        "placements_per_s_cpu": round(n / t.cpu_s, 1) if t.cpu_s else None,
        "placements_per_s_wall": round(n / t.wall_s, 1) if t.wall_s else None,
        "decisions_per_s_cpu": round(len(run.preempted_for & ids) / t.cpu_s, 1) if t.cpu_s else None,
        "goal_per_s": GOAL[kind], "kube_floor": {KUBE[kind][0]: KUBE[kind][1]},
        "by_shape": {k: {"submitted": v[0], "placed": v[1]} for k, v in by_shape.items()},
        "unplaced_by_reason": dict(waiting.most_common(8)),
        "gpu_memory_used_pct_after": memory_used_pct(run), "step_ms": t.step_ms,
        "deciles": t.deciles, "outputs": run.outputs, "digest": f"{run.digest:08x}",
        "by_path": [{"shape": k[0], "path": k[1], "requests": v[0], "wall_ms": round(1000 * v[1], 1),
                     "ms_each": round(1000 * v[1] / v[0], 3)}
                    for k, v in sorted(t.paths.items(), key=lambda kv: -kv[1][1])],
        "profiled": bool(t.profile),
    }
    if not args.preemption:
        out["kube_floor"][KUBE["extended"][0]] = KUBE["extended"][1]
    return out


def table(r: dict) -> str:
    rows = [
        ("scenario", r["scenario"] + ("  (PROFILED: not a measurement)" if r["profiled"] else "")
         + ("  (TRUNCATED by --max-seconds)" if r["truncated"] else "")),
        ("fleet", f"{r['nodes']:,} nodes, {r['gpus']:,} GPUs" + (f", filled with {r['fill_jobs']:,} offline jobs"
                                                                 if r["fill_jobs"] else "")),
        ("jobs submitted (timed)", f"{r['submitted']:,} of {r['jobs']:,} (multi-node gang weight "
                                   f"{r['multinode_pct']}%); GPU memory held after: {r['gpu_memory_used_pct_after']}%"),
        ("placed (distinct jobs)", f"{r['placed']:,}  ({r['place_commands']:,} cmd.place in all; "
                                   f"{r['multinode_placed']} multi-node)"),
        ("preemption", f"{r['preemption_decisions']:,} decisions for timed jobs (+{r['decisions_for_other_jobs']:,} "
                       f"for other jobs), {r['preempt_commands']:,} victims, {r['placed_via_preemption']:,} timed "
                       f"jobs placed after preempting"),
        ("timed", f"cpu {r['cpu_s']:.2f} s, wall {r['wall_s']:.2f} s (gc {r['gc_s']:.2f} s in {r['gc_runs']} runs)"),
        ("placements/s", f"{r['placements_per_s_cpu']:,} per CPU-s, {r['placements_per_s_wall']:,} per wall-s "
                         f"(goal >= {r['goal_per_s']:,})"),
    ]
    if r["preemption_decisions"]:
        rows.append(("preemption decisions/s", f"{r['decisions_per_s_cpu']:,} per CPU-s"))
    rows.append(("kube-scheduler floors", "; ".join(f"{k}: {v}/s" for k, v in r["kube_floor"].items())))
    rows.append(("by shape (placed/submitted)", ", ".join(f"{k} {v['placed']}/{v['submitted']}"
                                                          for k, v in r["by_shape"].items())))
    if r["unplaced_by_reason"]:
        rows.append(("unplaced, last reason", ", ".join(f"{k} {v}" for k, v in r["unplaced_by_reason"].items())))
    if r["step_ms"]:
        rows.append(("one request's step (wall ms)", ", ".join(f"{k} {v:,}" for k, v in r["step_ms"].items())))
    if r["deciles"]:
        rows.append(("rate per tenth (per CPU-s)", " ".join(f"{d['per_s_cpu']:,.0f}" for d in r["deciles"])))
    if r["by_path"]:
        total = sum(p["wall_ms"] for p in r["by_path"]) or 1
        rows.append(("where the time goes", "; ".join(
            f"{p['shape']} {p['path']} {p['requests']} x {p['ms_each']:.2f} ms ({100 * p['wall_ms'] / total:.0f}%)"
            for p in r["by_path"][:6])))
    rows.append(("decision digest", r["digest"]))
    w = max(len(a) for a, _ in rows)
    return "\n".join(f"{a:<{w}}  {b}" for a, b in rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=None, help="default 5,000 (--quick: 200)")
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--jobs", type=int, default=None, help="timed job requests, default 50,000 (--quick: 2,000; "
                                                           "with --preemption the higher-tier jobs that must "
                                                           "preempt, --quick: 200)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--mode", choices=("a", "b", "ab"), default="ab",
                    help="a: one by one, a cycle each; b: all queued, then one cycle (seeded; plain only)")
    ap.add_argument("--multinode-pct", type=float, default=None,
                    help="weight (%%%%) of the 16-card multi-node gang shape; default %.1f, 0 leaves it out"
                         % SHAPE_BY_NAME["gang-16-multinode"][3])  # %%%% -> %% here -> % in argparse's help
    ap.add_argument("--preemption", action="store_true", help="fill the fleet with offline work first")
    ap.add_argument("--victims", choices=("requeue", "cancel"), default="requeue",
                    help="after job.stopped, a victim requeues (the product) or its owner cancels it")
    ap.add_argument("--max-seconds", type=float, default=0.0, help="stop a one-by-one loop after this wall time")
    ap.add_argument("--quick", action="store_true", help="200 nodes, 2,000 jobs (200 with --preemption)")
    ap.add_argument("--profile", action="store_true", help="cProfile the timed part; print the top 25 cumulative")
    ap.add_argument("--json", action="store_true", help="only the JSON line on stdout")
    ap.add_argument("--gc", choices=("agent", "default"), default="agent",
                    help="agent: the scheduler agent's collector settings (streams.edge.scheduler_agent.tune_gc); "
                         "default: Python's")
    args = ap.parse_args(argv)
    if args.nodes is None:
        args.nodes = 200 if args.quick else 5000
    if args.jobs is None:
        args.jobs = (200 if args.preemption else 2000) if args.quick else 50_000
    say = (lambda *a: print(*a, file=sys.stderr)) if args.json else print

    t = time.perf_counter()
    inp = build(args)
    say(f"built {len(inp.nodes):,} inventories, {len(inp.jobs):,} timed requests"
        + (f", {sum(len(p) for p in inp.fill):,} fill jobs" if inp.fill else "")
        + f" in {time.perf_counter() - t:.1f} s")
    modes = ["a"] if args.preemption else list(args.mode)
    results = []
    for mode in modes:
        t = time.perf_counter()
        run = setup(inp, args.victims, args.preemption)
        say(f"[{mode}] setup through step in {time.perf_counter() - t:.1f} s "
            f"({len(run.s.nodes):,} nodes, {len(run.s.jobs):,} jobs known)")
        gc.collect()
        if args.gc == "agent":
            tune_gc()  # what the scheduler agent does after rebuilding its state
        if mode == "a":
            timed = timed_one_by_one(run, inp.jobs, args.max_seconds, args.profile)
        else:
            timed = timed_queued(run, inp.jobs, args.profile)
            if isinstance(timed, str):
                say(f"[b] {timed}")
                results.append({"scenario": "plain-b", "unavailable": timed})
                continue
        r = summarize(run, timed, inp.jobs, inp, args)
        results.append(r)
        say(table(r))
        if timed.profile:
            say(f"--- cProfile of scenario ({mode}), top 25 by cumulative time ---")
            say(timed.profile)
        say("")
    doc = {"bench": "placement", "results": results}
    print(json.dumps(doc) if args.json else "RESULT " + json.dumps(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
