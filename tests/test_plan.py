"""A cycle is a session on a statement (#34 item 2; ../shared/style-examples.md, KAI's Statement with checkpoints).

- `Plan` (agents/scheduler/plan.py): trial operations over the node views, each logging its inverse. After any
  sequence of evictions, placements, checkpoints and rollbacks, the plan's views equal the base's views with the
  operations still in force applied afresh, in order (the rebuilt-equals-incremental property test_holdings holds
  the holdings to), and the base is never written.
- `Statement` (core.py): no command while a trial is in force, no rollback past an emitted envelope, no commit with a
  trial left open; defragmentation's trials leave the plan empty whatever they decided.
- The cycle runs over a snapshot: while it runs, the holdings refuse a fact.
"""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agents.scheduler import core, defrag
from agents.scheduler.core import Scheduler, Statement
from agents.scheduler.plan import Plan
from schemas.envelope import envelope
from schemas.events import Assignment, Constraints, JobCancelled, JobStarted, Tier
from streams.folds import node_view
from tests.builders import Clock, inventory, job, open_ledger

NODES = ("n1", "n2", "n3")
JOBS = ("a", "b", "c", "d")


def _base() -> dict[str, node_view.NodeView]:
    views = {}
    for i, n in enumerate(NODES):
        views[n] = node_view.evolve(None, envelope(inventory(n, gpus=2), source=f"{n}/inventory", seq=1,
                                                   time_ms=1000 + i))
    return views


def _shape(view: node_view.NodeView) -> tuple:
    """What a view says of room: who holds what, and the free cards and host."""
    return (tuple(sorted((j, h.slices, h.cpu_milli, h.memory_mib) for j, h in view.allocations.items())),
            view.card_free(), view.free_cpu_memory())


def _card(views, node: str, k: int) -> str:
    return views[node].cards()[k].uuid


ops = st.lists(st.one_of(
    st.tuples(st.just("place"), st.sampled_from(NODES), st.sampled_from(JOBS), st.integers(0, 1),
              st.sampled_from((250, 500, 1000))),
    st.tuples(st.just("evict"), st.sampled_from(NODES), st.sampled_from(JOBS), st.just(0), st.just(0)),
    st.tuples(st.just("checkpoint"), st.just(""), st.just(""), st.just(0), st.just(0)),
    st.tuples(st.just("rollback"), st.just(""), st.just(""), st.integers(0, 30), st.just(0)),
), max_size=30)


@settings(max_examples=200, deadline=None)
@given(ops)
def test_a_plan_equals_its_operations_in_force_applied_afresh(steps):
    base = _base()
    before = {n: _shape(v) for n, v in base.items()}
    plan = Plan(base)
    cps: list[int] = []
    for kind, node, j, k, milli in steps:
        if kind == "place":
            plan.place(node, job(j, compute=milli, mem_gib=10),
                       (Assignment(gpu_uuid=_card(base, node, k), milli=milli, memory_mib=10 * 1024),))
        elif kind == "evict":
            plan.evict(node, j)
        elif kind == "checkpoint":
            cps.append(plan.checkpoint())
        elif cps:
            cp = cps[k % len(cps)]
            if cp > plan.checkpoint():
                with pytest.raises(ValueError):
                    plan.rollback(cp)
                continue
            plan.rollback(cp)
            cps = [c for c in cps if c <= cp]
        # rebuilt: the base's views with the operations in force applied afresh, in order
        fresh = Plan(base)
        for op in plan.ops:
            if op.kind == "place":
                fresh.place(op.node, job(op.job_id, compute=op.assignments[0].milli, mem_gib=10), op.assignments)
            else:
                fresh.evict(op.node, op.job_id)
        assert {n: _shape(plan[n]) for n in NODES} == {n: _shape(fresh[n]) for n in NODES}
        assert {n: _shape(v) for n, v in base.items()} == before, "a plan wrote its base"
    plan.discard()
    assert not plan.open and all(plan[n] is base[n] for n in NODES)


def test_a_placement_on_the_plan_sees_the_trial_and_not_the_holdings():
    """`place` runs on the plan as on the holdings' views: a card the trial filled is not offered again."""
    from agents.scheduler.node_index import NodeIndex
    from agents.scheduler.placement import Placement, place
    from agents.scheduler.scoring import Workload
    base = {"n1": _base()["n1"]}
    index = NodeIndex()
    index.update(base["n1"])
    plan = Plan(base)
    big = job("x", compute=1000, mem_gib=80)
    first = place(index, plan, big, Workload())
    assert isinstance(first, Placement)
    plan.place("n1", big, first.parts[0].assignments)
    second = place(index, plan, job("y", compute=1000, mem_gib=80), Workload())
    assert isinstance(second, Placement)
    assert {a.gpu_uuid for a in second.parts[0].assignments}.isdisjoint(
        {a.gpu_uuid for a in first.parts[0].assignments})
    plan.rollback(0)
    assert not base["n1"].allocations


def _two_nodes_of_offline_work():
    """Two 2-card nodes, one checkpointable offline job on a card of each: a 2-card block exists only by a move."""
    clock, s = Clock(), Scheduler(ledger=open_ledger())

    def feed(payload, source):
        for o in s.step(clock.env(payload, source, dt=10)):
            if o.kind == "cmd.place":
                s.step(clock.env(JobStarted(job_id=o.payload.job_id, node=o.payload.node,
                                            command_id=o.payload.command_id), f"{o.payload.node}/job", dt=1))

    def offline(j):
        return job(j, compute=1000, tier=Tier.OFFLINE, checkpoint_interval_s=60, duration=None)

    feed(inventory("n1", gpus=2), "n1/inventory")
    feed(offline("o0"), "cli/o0")
    feed(offline("f"), "cli/f")  # n1 full
    feed(inventory("n2", gpus=2), "n2/inventory")
    feed(offline("o1"), "cli/o1")  # on n2
    feed(JobCancelled(job_id="f"), "cli/f")  # one free card on each node
    return clock, s


def test_a_defragmentation_trial_leaves_the_plan_empty_and_its_winner_is_emitted_after():
    clock, s = _two_nodes_of_offline_work()
    assert {s.jobs["o0"].node, s.jobs["o1"].node} == {"n1", "n2"}
    trials = []
    real = defrag._clear

    def clear(sched, rec, trial, view, m, n, free, exclude):
        got = real(sched, rec, trial, view, m, n, free, exclude)
        trials.append((view.node, len(trial.ops), got is not None))
        return got

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(defrag, "_clear", clear)
        out = s.step(clock.env(job("blk", compute=2000, tier=Tier.ONLINE_TRAINING, duration=None,
                                   constraints=Constraints(max_spread="node")), "cli/blk", dt=10))
    # each node was tried on the plan: the mover evicted and placed (two operations) in each trial
    assert sorted(t[0] for t in trials) == ["n1", "n2"] and all(t[1] == 2 and t[2] for t in trials)
    moves = [o.payload for o in out if o.kind == "cmd.migrate"]
    assert len(moves) == 1 and moves[0].from_node != moves[0].to_node
    assert s.jobs["blk"].nominated[0] == moves[0].from_node


def test_a_command_is_refused_while_a_trial_is_in_force_and_the_cycle_commits_none():
    clock, s = _two_nodes_of_offline_work()
    real = defrag._clear

    def clear_and_leave_it(sched, rec, trial, view, m, n, free, exclude):
        got = real(sched, rec, trial, view, m, n, free, exclude)
        trial.place(view.node, rec.request, ())  # a trial left in force: the next command must be refused
        return got

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(defrag, "plan", lambda sched, rec, exclude, trial: (
            clear_and_leave_it(sched, rec, trial, sched.nodes["n1"], "A100-80GB", 2, {}, exclude)))
        with pytest.raises(RuntimeError, match="while a trial is in the plan"):
            s.step(clock.env(job("blk", compute=2000, tier=Tier.ONLINE_TRAINING, duration=None,
                                 constraints=Constraints(max_spread="node")), "cli/blk", dt=10))
    assert s._stmt is None and not s.h.frozen


def test_a_statement_rolls_back_trials_never_what_it_emitted():
    base = _base()
    out: list = []
    stmt = Statement(out, envelope(inventory("n1", gpus=2), source="x", seq=1, time_ms=0), base)
    cp = stmt.checkpoint()
    stmt.plan.evict("n1", "a")
    with pytest.raises(RuntimeError, match="left in the plan"):
        stmt.commit()
    stmt.rollback(cp)
    stmt.out.append(envelope(inventory("n1", gpus=2), source="x", seq=2, time_ms=0))
    with pytest.raises(RuntimeError, match="rollback past 1 emitted"):
        stmt.rollback(cp)
    stmt.commit()
    assert len(out) == 1 and not stmt.out


def test_the_cycle_runs_over_a_snapshot_the_holdings_refuse_a_fact_meanwhile():
    clock, s = _two_nodes_of_offline_work()
    seen = []
    real = Scheduler._session

    def session(self, stmt, only):
        seen.append(self.h.frozen)
        with pytest.raises(RuntimeError, match="folded during a cycle"):
            self.h.apply(clock.env(inventory("n3", gpus=2), "n3/inventory"))
        assert "n3" not in self.h.nodes
        real(self, stmt, only)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Scheduler, "_session", session)
        s.step(clock.env(job("j", compute=500), "cli/j", dt=10))
    assert seen == [True] and not s.h.frozen
    s.step(clock.env(inventory("n3", gpus=2), "n3/inventory", dt=10))  # between cycles a fact folds as ever
    assert "n3" in s.h.nodes
    assert core.Statement is Statement
