"""A hypothesis state machine over the scheduler: random submissions of every tier and size, node-agent reactions
(start, complete, checkpoint-and-stop on preemption), ticks and quotas; after every step the invariants hold."""
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from agents.scheduler.core import Scheduler, replay
from schemas.events import TIER_RANK, ReservationRequested, JobCompleted, JobStarted, JobStopped, QuotaSet, SchedulerTick, Tier
from tests.builders import Clock, inventory, job
from schemas.gpu_models import model as gpu_model

TENANTS = ("t1", "t2", "t3")


class SchedulerMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.clock = Clock()
        self.s = Scheduler()
        self.inputs = []
        self.outputs = []
        self.n = 0
        for i, (model, gpus, mig, rack) in enumerate([
                ("A100-80GB", 4, None, "r0"), ("T4", 2, None, "r0"),
                ("A100-40GB", 1, ["3g.20gb", "1g.5gb"], "r0"), ("A100-80GB", 4, None, "r1")]):
            self.feed(self.clock.env(inventory(f"n{i}", model=model, gpus=gpus, mig=mig, rack=rack),
                                     f"n{i}/inventory"))

    def feed(self, env):
        self.inputs.append(env)
        out = self.s.step(env)
        self.outputs.extend(out)
        return out

    def jobs_in(self, *states):
        """Jobs a node agent knows of (reservation holds never reach a node)."""
        return sorted(j for j, r in self.s.jobs.items() if r.state in states and r.hold is None)

    @rule(tenant=st.sampled_from(TENANTS), tier=st.sampled_from(list(Tier)),
          compute=st.sampled_from([100, 300, 500, 1000, 2500, 6000]), mem=st.sampled_from([2, 8, 30, 70, 150]))
    def submit(self, tenant, tier, compute, mem):
        self.n += 1
        self.feed(self.clock.env(job(f"j{self.n}", tenant=tenant, compute=compute, mem_gib=mem, tier=tier),
                                 f"cli/j{self.n}", dt=10))

    @rule(data=st.data())
    def node_agent_acts(self, data):
        placed, running, stopping = self.jobs_in("placed"), self.jobs_in("running"), self.jobs_in("stopping")
        choices = [("start", j) for j in placed] + [("complete", j) for j in running] + \
                  [("stop", j) for j in stopping]
        if not choices:
            return
        what, j = data.draw(st.sampled_from(choices))
        rec = self.s.jobs[j]
        cmd = rec.placement
        src = f"{cmd.node}/job/{j}"
        if what == "start":
            self.feed(self.clock.env(JobStarted(job_id=j, node=cmd.node, command_id=cmd.command_id), src, dt=5))
        elif what == "complete":
            self.feed(self.clock.env(JobCompleted(job_id=j, node=cmd.node, command_id=cmd.command_id), src, dt=500))
        else:
            self.feed(self.clock.env(JobStopped(job_id=j, node=cmd.node, command_id=cmd.command_id,
                                                checkpoint=f"ckpt:{j}:1"), src, dt=50))

    @rule(tenant=st.sampled_from(TENANTS), quota=st.sampled_from([500, 1000, 3000]),
          overcommit=st.sampled_from([100, 120, 150]))
    def set_quota(self, tenant, quota, overcommit):
        self.feed(self.clock.env(QuotaSet(tenant=tenant, gpu_milli=quota, overcommit_pct=overcommit), "operator",
                                 dt=1))

    @rule(tenant=st.sampled_from(TENANTS), tier=st.sampled_from(list(Tier)), compute=st.sampled_from([500, 2000]),
          start=st.integers(0, 3000), length=st.integers(500, 5000))
    def reserve(self, tenant, tier, compute, start, length):
        self.n += 1
        now = self.clock.now
        self.feed(self.clock.env(ReservationRequested(
            reservation_id=f"r{self.n}", tenant=tenant, tier=tier, compute_milli=compute, gpu_memory_mib=8192,
            start_ms=now + start, end_ms=now + start + length), "cli/reserve", dt=1))

    @rule(data=st.data())
    def mig_done(self, data):
        """The node agent applies a pending MIG reconfigure and reports its inventory."""
        pending = [(n, u) for n, v in sorted(self.s.nodes.items()) for u in sorted(v.mig_pending)]
        if not pending:
            return
        node, uuid = data.draw(st.sampled_from(pending))
        v = self.s.nodes[node]
        layout = v.mig_commands[uuid][1]
        gpus = tuple(g.model_copy(update={"mig_layout": layout}) if g.uuid == uuid else g for g in v.inventory.gpus)
        self.feed(self.clock.env(v.inventory.model_copy(update={"gpus": gpus}), f"{node}/inventory", dt=1))

    @rule()
    def tick(self):
        self.feed(self.clock.env(SchedulerTick(now_ms=self.clock.now), "ticker", dt=1000))

    @invariant()
    def no_card_or_slice_over_allocated(self):
        for v in self.s.nodes.values():
            for card in v.card_free():
                assert card.milli >= 0 and card.memory_mib >= 0, (v.node, card)
            seen = set()
            for held in v.allocations.values():
                for a in held.slices:
                    if a.mig_uuid:
                        assert a.mig_uuid not in seen, "a MIG instance held by two jobs"
                        seen.add(a.mig_uuid)
            cpu, mem = v.free_cpu_memory()
            assert cpu >= 0 and mem >= 0

    @invariant()
    def holdings_match_job_states(self):
        held = {(node, j) for node, v in self.s.nodes.items() for j in v.allocations}
        expected = {(part.node, j) for j, r in self.s.jobs.items()
                    if r.state in ("placed", "running", "stopping") for part in r.parts}
        assert held == expected
        by_tier = {}
        for r in self.s.jobs.values():
            if r.state in ("placed", "running", "stopping") and r.hold is None:
                by_tier[TIER_RANK[r.request.tier]] = by_tier.get(TIER_RANK[r.request.tier], 0) + 1
        assert {k: v for k, v in self.s.held_by_tier.items() if v} == by_tier
        assert self.s.stopping == {j for j, r in self.s.jobs.items() if r.state == "stopping"}
        for r in self.s.jobs.values():
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
    def quota_ledger_matches_holdings(self):
        for tenant in TENANTS:
            jobs = [r for r in self.s.jobs.values() if r.request.tenant == tenant and
                    r.state in ("placed", "running", "stopping")]
            acct = self.s.ledger.accounts.get((tenant, None))
            used = acct.used_milli if acct else 0
            borrowed = acct.borrowed_milli if acct else 0
            assert used == sum(r.request.compute_milli for r in jobs)
            assert (acct.used_memory_mib if acct else 0) == sum(r.request.gpu_memory_mib for r in jobs)
            assert (acct.reserved_milli if acct else 0) == sum(r.request.compute_milli for r in jobs if r.hold)
            assert borrowed == sum(r.request.compute_milli for r in jobs if r.placement.borrowed)
            assert 0 <= borrowed <= used

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
        _, again = replay(self.inputs)
        assert [e.model_dump() for e in again] == [e.model_dump() for e in self.outputs]
        # converged: once a tick emits nothing, the next one does too. Reservation windows are time-driven
        # decisions, so time first moves past every window.
        ends = [b.request.end_ms for b in self.s.book.bookings.values()]
        if ends and max(ends) >= self.clock.now:
            self.feed(self.clock.env(SchedulerTick(now_ms=max(ends) + 1), "ticker", dt=max(ends) + 1 - self.clock.now))
        for _ in range(2):
            self.feed(self.clock.env(SchedulerTick(now_ms=self.clock.now), "ticker", dt=1000))
        quiet = self.feed(self.clock.env(SchedulerTick(now_ms=self.clock.now), "ticker", dt=1000))
        assert quiet == [], [e.payload for e in quiet]


SchedulerMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
TestSchedulerInvariants = SchedulerMachine.TestCase
