"""A hypothesis state machine over the scheduler and a model of its node agents: random submissions of every tier and
size, quotas (tenant and project, some refused), reservations, ticks; the node agents carry out the commands they are
sent (fenced by attempt, agents/node/fencing.py) and report starts, checkpoints, completions and stops; nodes are
lost (partitioned: their work goes on, unseen, and the commands sent to them wait), come back (the waiting commands
arrive, then the node reports what it still runs), are drained, uncordoned, removed and re-added; cards fail and
are cleared. After every step the invariants hold: no unit held by two jobs, no job running twice, every interval
billed exactly once, quota used == the sum of holdings."""
from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from agents.node.fencing import Fence
from agents.scheduler.core import Scheduler, replay
from agents.scheduler.quota import Ledger, held
from schemas.events import (
    TIER_RANK, GpuHealth, JobCheckpointed, JobCompleted, JobStarted, JobStopped, NodeCordon, NodeLiveness,
    MigrateJob, NodeRemoved, PlaceJob, PreemptJob, QuotaSet, ReleaseJob, ReservationRequested, SchedulerTick, Tier,
)
from schemas.gpu_models import model as gpu_model
from tests.builders import Clock, inventory, job

TENANTS = ("t1", "t2", "t3")  # t3 starts without a quota: its jobs wait (NoQuota) until one is set
NODES = ("n0", "n1", "n2", "n3")
USAGE_TICK_MS = 2_000


def config() -> dict:
    """The machine's scheduler configuration (the replay in teardown uses the same)."""
    return {"ledger": Ledger(), "usage_tick_ms": USAGE_TICK_MS}


@dataclass
class Run:
    attempt: int
    command_id: str
    started: bool = False


@dataclass
class Agent:
    """What one node agent knows: the runs it carries out, the stops it owes a report for, its fence; while lost,
    the commands sent to it wait in its inbox."""
    node: str
    fence: Fence = field(default_factory=Fence)
    runs: dict[str, Run] = field(default_factory=dict)
    # job -> (preempt or migrate command id, place's, whether it is a move)
    stopping: dict[str, tuple[str, str, bool]] = field(default_factory=dict)
    lost: bool = False
    inbox: list = field(default_factory=list)
    last_heartbeat_ms: int = 0

    def execute(self, p) -> None:
        """The agents' command rules (sim_agent.py / nvml_agent.py), on this model."""
        r = self.runs.get(p.job_id) if hasattr(p, "job_id") else None
        if isinstance(p, PlaceJob):
            if self.fence.place(p.job_id, p.attempt, r.attempt if r else None) in ("start", "replace"):
                self.runs[p.job_id] = Run(p.attempt, p.command_id)  # replaces an older run of the job, if any
        elif isinstance(p, (PreemptJob, MigrateJob)):  # a move is a stop with a checkpoint, reason "migrated"
            if self.fence.stops(p.job_id, p.attempt, r.attempt if r else None):
                del self.runs[p.job_id]
                self.stopping[p.job_id] = (p.command_id, r.command_id, isinstance(p, MigrateJob))
        elif isinstance(p, ReleaseJob):
            if self.fence.stops(p.job_id, p.attempt, r.attempt if r else None):
                del self.runs[p.job_id]


class SchedulerMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.clock = Clock()
        self.s = Scheduler(**config())
        self.inputs = []
        self.outputs = []
        self.n = 0
        self.agents = {name: Agent(name) for name in NODES}
        self.started: dict[tuple[str, int], int] = {}  # (job, attempt) -> event time of its run's start
        self.completed: dict[tuple[str, int], int] = {}  # (job, attempt) -> event time of its completion
        for i, (model, gpus, mig, rack) in enumerate([
                ("A100-80GB", 4, None, "r0"), ("T4", 2, None, "r0"),
                ("A100-40GB", 1, ["3g.20gb", "1g.5gb"], "r0"), ("A100-80GB", 4, None, "r1")]):
            self.feed(self.clock.env(inventory(f"n{i}", model=model, gpus=gpus, mig=mig, rack=rack),
                                     f"n{i}/inventory"))
        for tenant in ("t1", "t2"):
            self.feed(self.clock.env(QuotaSet(tenant=tenant, gpu_milli=8000, overcommit_pct=150), "operator"))
        for a in self.agents.values():
            a.last_heartbeat_ms = self.clock.now

    def feed(self, env):
        self.inputs.append(env)
        out = self.s.step(env)
        self.outputs.extend(out)
        for e in out:
            node = getattr(e.payload, "node", None) or getattr(e.payload, "from_node", None)  # a move: its source
            if e.is_command and node in self.agents:
                a = self.agents[node]
                if a.lost:
                    a.inbox.append(e.payload)
                else:
                    a.execute(e.payload)
        return out

    def report(self, agent: Agent, payload, dt: int = 5):
        env = self.clock.env(payload, f"{agent.node}/job/{payload.job_id}", dt=dt)
        agent.last_heartbeat_ms = self.clock.now
        return self.feed(env)

    # ---------------------------------------------------------------- users and operators

    @rule(jobs=st.lists(st.tuples(
        st.sampled_from(TENANTS), st.sampled_from(list(Tier)),
        st.sampled_from([100, 300, 500, 1000, 2500, 6000, 20000]), st.sampled_from([2, 8, 30, 70, 150]),
        st.sampled_from(["default", "p1"])), min_size=1, max_size=3))
    def submit(self, jobs):
        for tenant, tier, compute, mem, project in jobs:
            self.n += 1
            self.feed(self.clock.env(job(f"j{self.n}", tenant=tenant, compute=compute, mem_gib=mem, tier=tier,
                                         project=project, checkpoint_interval_s=1), f"cli/j{self.n}", dt=10))

    @rule(tenant=st.sampled_from(TENANTS), quota=st.sampled_from([500, 1000, 3000, 8000]),
          overcommit=st.sampled_from([100, 120, 150]), project=st.sampled_from([None, None, "p1"]))
    def set_quota(self, tenant, quota, overcommit, project):
        self.feed(self.clock.env(QuotaSet(tenant=tenant, project=project, gpu_milli=quota, overcommit_pct=overcommit),
                                 "operator", dt=1))

    @rule(tenant=st.sampled_from(TENANTS), tier=st.sampled_from(list(Tier)), compute=st.sampled_from([500, 2000]),
          start=st.integers(0, 3000), length=st.integers(500, 5000))
    def reserve(self, tenant, tier, compute, start, length):
        self.n += 1
        now = self.clock.now
        self.feed(self.clock.env(ReservationRequested(
            reservation_id=f"r{self.n}", tenant=tenant, tier=tier, compute_milli=compute, gpu_memory_mib=8192,
            start_ms=now + start, end_ms=now + start + length), "cli/reserve", dt=1))

    @rule()
    def tick(self):
        """A second passes: every reachable agent has started what it was given (and said so), then the ticker."""
        for name, a in sorted(self.agents.items()):
            if not a.lost:
                for j, r in sorted(a.runs.items()):
                    if not r.started and a.runs.get(j) is r:
                        self.start(a, j, r)
        self.clock.now += 1000
        for a in self.agents.values():
            if not a.lost:
                a.last_heartbeat_ms = self.clock.now  # telemetry doubles as the heartbeat
        self.feed(self.clock.env(SchedulerTick(now_ms=self.clock.now), "ticker"))

    def start(self, a: Agent, j: str, r: Run) -> None:
        r.started = True
        rec = self.s.jobs.get(j)  # None: the job ended (a node coming back with a run of a finished job)
        was = rec.started_ms if rec is not None else 0
        self.report(a, JobStarted(job_id=j, node=a.node, command_id=r.command_id))
        if was < 0 <= rec.started_ms:  # the run's billing starts here
            self.started[(j, r.attempt)] = self.clock.now

    # ---------------------------------------------------------------- node agents

    @rule(data=st.data(), times=st.integers(1, 3))
    def node_agent_acts(self, data, times):
        for _ in range(times):
            self.agent_acts(data)

    def agent_acts(self, data):
        choices = []
        for name, a in sorted(self.agents.items()):
            if a.lost:
                continue
            for j, r in sorted(a.runs.items()):
                choices += [("checkpoint", name, j), ("complete", name, j)] if r.started else [("start", name, j)]
            choices += [("stopped", name, j) for j in sorted(a.stopping)]
        if not choices:
            return
        what, name, j = data.draw(st.sampled_from(choices))
        a = self.agents[name]
        if what == "stopped":
            preempt, place, moved = a.stopping.pop(j)
            self.report(a, JobStopped(job_id=j, node=name, command_id=preempt, checkpoint=f"ckpt:{j}:1",
                                      reason="migrated" if moved else ""), dt=50)
            return
        r = a.runs[j]
        rec = self.s.jobs[j]
        if what == "start":
            self.start(a, j, r)
        elif what == "checkpoint":
            self.report(a, JobCheckpointed(job_id=j, node=name, progress_ms=1, checkpoint=f"ckpt:{j}:{self.n}",
                                           command_id=r.command_id), dt=100)
        else:
            del a.runs[j]
            was = rec.phase
            self.report(a, JobCompleted(job_id=j, node=name, command_id=r.command_id), dt=500)
            if was == "running" and rec.phase == "done":
                self.completed[(j, r.attempt)] = self.clock.now

    @rule(data=st.data())
    def node_lost(self, data):
        """Partitioned: silent from now, its work goes on unseen; the liveness fold reports two missed heartbeats.
        A node running work is the likelier to go (that is where it matters)."""
        up = [n for n in NODES if not self.agents[n].lost]
        busy = [n for n in up if any(r.started for r in self.agents[n].runs.values())]
        if not up:
            return
        node = data.draw(st.sampled_from(busy or up))
        a = self.agents[node]
        a.lost = True
        self.feed(self.clock.env(NodeLiveness(node=node, alive=False, last_heartbeat_ms=a.last_heartbeat_ms),
                                 f"{node}/liveness", dt=2000))

    @rule(data=st.data(), commands_first=st.booleans(), done=st.booleans())
    def node_returns(self, data, commands_first, done):
        """The node comes back: the commands sent meanwhile arrive, and what it did meanwhile is reported (its
        inventory, the start of each run it had not started, a checkpoint of each run it still has, or the run's
        completion when `done`) -- in either order: the reports may have been buffered by its producer and reach
        the log before it reads its commands."""
        lost = [n for n in NODES if self.agents[n].lost]
        if not lost:
            return
        node = data.draw(st.sampled_from(lost))
        a = self.agents[node]
        a.lost = False
        inbox, a.inbox = a.inbox, []
        if commands_first:
            for p in inbox:
                a.execute(p)
        a.last_heartbeat_ms = self.clock.now + 1
        self.feed(self.clock.env(self.s.nodes[node].inventory, f"{node}/inventory", dt=1))
        for j, r in sorted(a.runs.items()):
            if a.runs.get(j) is not r:
                continue  # stopped by a release its earlier reports brought
            if not r.started:  # it went on meanwhile: what it was given, it started
                self.start(a, j, r)
                if a.runs.get(j) is not r:
                    continue
            if done:
                del a.runs[j]
                self.report(a, JobCompleted(job_id=j, node=node, command_id=r.command_id))
            else:
                self.report(a, JobCheckpointed(job_id=j, node=node, progress_ms=2, checkpoint=f"ckpt:{j}:stale",
                                               command_id=r.command_id))
        for p in inbox if not commands_first else ():
            a.execute(p)

    @rule(node=st.sampled_from(NODES), drain=st.booleans())
    def cordon(self, node, drain):
        self.feed(self.clock.env(NodeCordon(node=node, cordoned=True, drain=drain), "operator", dt=1))

    @rule(node=st.sampled_from(NODES))
    def uncordon(self, node):
        self.feed(self.clock.env(NodeCordon(node=node, cordoned=False), "operator", dt=1))

    @rule(node=st.sampled_from(NODES), removed=st.booleans())
    def remove_or_readd(self, node, removed):
        self.feed(self.clock.env(NodeRemoved(node=node, removed=removed), "operator", dt=1))

    @rule(node=st.sampled_from(NODES), card=st.integers(0, 3), healthy=st.booleans())
    def card_health(self, node, card, healthy):
        cards = self.s.nodes[node].inventory.gpus
        uuid = cards[card % len(cards)].uuid
        self.feed(self.clock.env(GpuHealth(node=node, gpu_uuid=uuid, healthy=healthy, reason="ecc"),
                                 f"{node}/health", dt=1))

    @rule(data=st.data())
    def mig_done(self, data):
        """The node agent applies a pending MIG reconfigure and reports its inventory."""
        pending = [(n, u) for n, v in sorted(self.s.nodes.items()) for u in sorted(v.mig_pending)
                   if not self.agents[n].lost]
        if not pending:
            return
        node, uuid = data.draw(st.sampled_from(pending))
        v = self.s.nodes[node]
        layout = v.mig_commands[uuid][1]
        gpus = tuple(g.model_copy(update={"mig_layout": layout}) if g.uuid == uuid else g for g in v.inventory.gpus)
        self.agents[node].last_heartbeat_ms = self.clock.now + 1  # an inventory is a sign of life too
        self.feed(self.clock.env(v.inventory.model_copy(update={"gpus": gpus}), f"{node}/inventory", dt=1))

    # ---------------------------------------------------------------- invariants

    def holding(self):
        """(job, node) -> (milli-CU, MiB) each job holds on each node, from the node views and what the job asked
        (quota.held: a share holds what it asked)."""
        out = {}
        for node, v in self.s.nodes.items():
            models = {g.uuid: g.model for g in v.cards()}
            for j, h in v.allocations.items():
                out[(j, node)] = held(h.slices, models.__getitem__, self.s.jobs[j].request.compute_milli)
        return out

    @invariant()
    def no_card_or_slice_over_allocated(self):
        for v in self.s.nodes.values():
            for card in v.card_free():
                assert card.milli >= 0 and card.memory_mib >= 0, (v.node, card)
            seen = set()
            for h in v.allocations.values():
                for a in h.slices:
                    if a.mig_uuid:
                        assert a.mig_uuid not in seen, "a MIG instance held by two jobs"
                        seen.add(a.mig_uuid)
            cpu, mem = v.free_cpu_memory()
            assert cpu >= 0 and mem >= 0

    @invariant()
    def holdings_match_job_states(self):
        held_ = {(node, j) for node, v in self.s.nodes.items() for j in v.allocations}
        expected = {(part.node, j) for j, r in self.s.jobs.items()
                    if r.phase in ("placed", "running", "stopping") for part in r.parts}
        assert held_ == expected
        by_tier = {}
        for r in self.s.jobs.values():
            if r.phase in ("placed", "running", "stopping") and r.hold is None:
                by_tier[TIER_RANK[r.request.tier]] = by_tier.get(TIER_RANK[r.request.tier], 0) + 1
        assert {k: v for k, v in self.s.held_by_tier.items() if v} == by_tier
        assert self.s.stopping == {j for j, r in self.s.jobs.items() if r.phase == "stopping"}
        assert set(self.s.running) == {j for j, r in self.s.jobs.items()
                                       if r.phase in ("running", "stopping") and r.started_ms >= 0}
        for r in self.s.jobs.values():
            if r.phase in ("placed", "running", "stopping"):  # nothing holds capacity on a removed node
                assert all(not self.s.nodes[p.node].removed or r.phase == "stopping" for p in r.parts)
            if len(r.parts) > 1:  # a gang is all or nothing: its parts add up to what it needs, by what each card
                # brings (a low-tier gang may mix card models)
                brought_cu = brought_mem = 0
                kinds = set()
                for p in r.parts:
                    by_uuid = {g.uuid: g.model for g in self.s.nodes[p.node].inventory.gpus}
                    for a in p.assignments:
                        m = gpu_model(by_uuid[a.gpu_uuid])
                        kinds.add(m.name)
                        brought_cu += m.cu_milli
                        brought_mem += a.memory_mib
                assert brought_cu >= r.request.compute_milli and brought_mem >= r.request.gpu_memory_mib
                assert len({p.node for p in r.parts}) == len(r.parts)
                assert len(kinds) == 1 or r.request.tier == Tier.OFFLINE

    @invariant()
    def quota_used_is_the_sum_of_holdings(self):
        holding = self.holding()
        for tenant in TENANTS:
            for project in (None, "default", "p1"):
                jobs = [r for r in self.s.jobs.values() if r.request.tenant == tenant and
                        (project is None or r.request.project == project) and
                        r.phase in ("placed", "running", "stopping")]
                acct = self.s.ledger.accounts.get((tenant, project))
                used = sum(holding[(r.request.job_id, p.node)][0] for r in jobs for p in r.parts)
                mem = sum(holding[(r.request.job_id, p.node)][1] for r in jobs for p in r.parts)
                assert used == sum(r.held_milli for r in jobs) and used >= sum(r.request.compute_milli for r in jobs)
                assert (acct.used_milli if acct else 0) == used, (tenant, project)
                assert (acct.used_memory_mib if acct else 0) == mem
                assert (acct.reserved_milli if acct else 0) == sum(r.held_milli for r in jobs if r.hold or r.reserved)
                borrowed = acct.borrowed_milli if acct else 0
                assert borrowed == sum(r.held_milli for r in jobs if r.placement.borrowed)
                assert 0 <= borrowed <= (acct.used_milli if acct else 0)
        assert self.s.ledger.pool_used_milli == sum(cu for cu, _ in holding.values())

    @invariant()
    def project_quotas_stay_within_the_tenant(self):
        for tenant in TENANTS:
            t = self.s.ledger.tenant_quota(tenant)
            projects = [a.quota.gpu_milli for (tt, p), a in self.s.ledger.accounts.items()
                        if tt == tenant and p is not None and a.quota is not None]
            assert not projects or sum(projects) <= t.gpu_milli

    @invariant()
    def no_job_runs_twice(self):
        """Reachable nodes run only the scheduler's current placement of a job, and only while it holds one."""
        for name, a in self.agents.items():
            if a.lost:
                continue
            for j, r in a.runs.items():
                rec = self.s.jobs.get(j)
                assert rec is not None, (name, j, r, self.s.phase_of(j))  # never a finished job's run
                assert rec.phase in ("placed", "running", "stopping") and rec.attempt == r.attempt, (name, j, r)
                assert name in {p.node for p in rec.parts}

    @invariant()
    def every_interval_is_billed_exactly_once(self):
        runs: dict[tuple[str, int], dict[str, list[tuple[int, int]]]] = {}
        for e in self.outputs:
            if e.kind == "usage.accrued":
                u = e.payload
                assert u.gpu_milli_ms == u.gpu_milli * (u.end_ms - u.start_ms) >= 0
                assert u.cu_milli_ms == u.cu_milli * (u.end_ms - u.start_ms)
                runs.setdefault((u.job_id, u.attempt), {}).setdefault(u.node, []).append((u.start_ms, u.end_ms))
        by_job: dict[str, list[tuple[int, int, int]]] = {}
        for (j, attempt), parts in runs.items():
            spans = list(parts.values())
            assert all(s == spans[0] for s in spans)  # every part of a gang over the same intervals
            intervals = spans[0]
            for (_, end), (start, _) in zip(intervals, intervals[1:]):
                assert start == end, (j, attempt, intervals)  # each follows the last: no gap, no overlap
            assert intervals[0][0] == self.started[(j, attempt)]  # from the run's start
            if (j, attempt) in self.completed:
                assert intervals[-1][1] == self.completed[(j, attempt)]  # to its end
            rec = self.s.jobs.get(j)
            if rec is not None and rec.attempt == attempt and j in self.s.running:
                assert intervals[-1][1] == rec.accrued_ms <= self.s.now_ms
            by_job.setdefault(j, []).append((attempt, intervals[0][0], intervals[-1][1]))
        for j, spans in by_job.items():  # runs of one job never overlap in time: it is never billed twice
            spans.sort()
            for (_, _, end), (_, start, _) in zip(spans, spans[1:]):
                assert end <= start, (j, spans)

    @invariant()
    def admissions_respect_quota_and_cap(self):
        for env in self.outputs:
            if env.kind != "cmd.place":
                continue
            for r in env.payload.reasons:
                if r.code == "WithinQuota":
                    assert r.data["used_milli"] + r.data["request_milli"] <= r.data["quota_milli"]
                    assert not env.payload.borrowed
                elif r.code == "Borrowing":
                    assert r.data["used_milli"] + r.data["request_milli"] <= r.data["cap_milli"]
                    assert env.payload.borrowed

    def teardown(self):
        # identical inputs give identical commands
        _, again = replay(self.inputs, **config())
        assert [e.model_dump() for e in again] == [e.model_dump() for e in self.outputs]
        # converged: once a tick emits nothing but usage, the next one does too. Reservation windows and the fleet's
        # settling are time-driven decisions, so time first moves past every window.
        ends = [b.request.end_ms for b in self.s.book.bookings.values()]
        if ends and max(ends) >= self.clock.now:
            self.feed(self.clock.env(SchedulerTick(now_ms=max(ends) + 1), "ticker", dt=max(ends) + 1 - self.clock.now))
        for _ in range(2):
            self.feed(self.clock.env(SchedulerTick(now_ms=self.clock.now), "ticker", dt=self.s.fleet.settle_ms))
        quiet = self.feed(self.clock.env(SchedulerTick(now_ms=self.clock.now), "ticker", dt=1000))
        assert [e for e in quiet if e.kind != "usage.accrued"] == [], [e.payload for e in quiet]


SchedulerMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=50, deadline=None)
TestSchedulerInvariants = SchedulerMachine.TestCase


class _Draws:
    """A fixed sequence for a rule's `data.draw` (the machine's steps replayed as a plain test)."""

    def __init__(self, seq):
        self.seq = list(seq)

    def draw(self, strategy):
        return self.seq.pop(0)


def test_a_job_whose_lowered_quota_would_not_take_it_back_is_not_moved_and_a_move_resumes():
    """The machine's run that found it (CI, 2026-12-02): t1's quota is lowered to 3,000 under its running offline j4;
    a waiting inference job of t2 needs j4's node. Defragmentation moved j4 (`cmd.migrate`), and the quota, which a
    move asks again before the job resumes, kept it waiting: a move that was a stop. Now j4 is not moved (it is
    preempted for the tier, said as such), and every move emitted resumes on its planned node once stopped."""
    m = SchedulerMachine()
    m.submit(jobs=[("t1", Tier.INFERENCE, 100, 2, "default"), ("t1", Tier.INFERENCE, 2500, 2, "default")])
    m.submit(jobs=[("t1", Tier.INFERENCE, 100, 150, "default"), ("t1", Tier.OFFLINE, 300, 2, "default")])
    m.tick()
    m.node_agent_acts(data=_Draws([("checkpoint", "n0", "j1"), ("complete", "n0", "j1"), ("complete", "n0", "j2")]),
                      times=3)
    m.submit(jobs=[("t1", Tier.ONLINE_TRAINING, 1000, 2, "default")])
    m.set_quota(overcommit=100, project=None, quota=3000, tenant="t1")
    m.submit(jobs=[("t1", Tier.INFERENCE, 100, 2, "default")])
    m.submit(jobs=[("t2", Tier.INFERENCE, 1000, 2, "default"), ("t2", Tier.INFERENCE, 2500, 2, "default")])
    moves = [o.payload for o in m.outputs if o.kind == "cmd.migrate"]
    assert "j4" not in {mv.job_id for mv in moves}
    assert m.s.jobs["j4"].phase == "stopping"  # preempted for j8's tier instead, which counts as a preemption
    for mv in moves:
        m.node_agent_acts(data=_Draws([("stopped", mv.from_node, mv.job_id)]), times=1)
        rec = m.s.jobs[mv.job_id]
        assert rec.phase == "placed" and rec.placement.node == mv.to_node
    m.teardown()
