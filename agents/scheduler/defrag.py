"""Defragmentation, an action of the cycle after allocate and before preempt (docs/scheduler.md, "Defragmentation").

A waiting job of a tier above offline that needs whole cards of one model on one node, when the pool has that many
free cards of the model in total but no node has them together, is given a block by moving low-tier work instead of
stopping it: checkpointable offline jobs (a checkpoint interval, running, one part, not protected) on one node are
each told to checkpoint and stop there and resume on a planned node that has room for them now (`cmd.migrate`), so
that the node is left with the block. Among the nodes that can be cleared so, the plan that moves the least work
wins (fewest jobs, then least compute held, then node order). Moves are within a disruption budget: at most
`PreemptionConfig.migrations_per_hour` moves of one tenant's work in any hour of log time.

Each node is tried on the cycle's plan (plan.py, the Statement's trials): a mover is evicted from the node and
placed on its target there, so the next mover's placement sees the targets as the moves chosen so far leave them; a
mover that finds no target, or whose quota would not take it back, is rolled back to the checkpoint taken before it;
and every node's trial is rolled back once it is judged, the cheapest kept as an `Opening`. Nothing is emitted here:
the scheduler emits the winning opening's moves (core.Scheduler._defragment) after the trial is rolled back.

The fragmentation said in the reason is the free whole cards of that model stranded on nodes with fewer than the
job needs, in milli-GPU, before and after the opening. Pure: it reads the scheduler's state and the plan, and
returns an opening.
"""
from __future__ import annotations

from dataclasses import dataclass

from agents.scheduler.node_index import cards_needed
from agents.scheduler.placement import Placement, allowed_models, place
from agents.scheduler.plan import Plan
from agents.scheduler.preemption import fits, protected
from agents.scheduler.quota import held
from schemas.events import TIER_RANK, Assignment, Tier
from schemas.gpu_models import model

HOUR_MS = 3600_000


@dataclass(frozen=True)
class Move:
    job_id: str
    to_node: str
    assignments: tuple[Assignment, ...]
    held_milli: int


@dataclass(frozen=True)
class Opening:
    node: str  # the node left with the block
    model: str
    moves: tuple[Move, ...]
    frag_before_milli: int
    frag_after_milli: int

    @property
    def cost(self) -> tuple[int, int]:
        return len(self.moves), sum(m.held_milli for m in self.moves)


def recent_moves(migrated: dict[str, list[int]], tenant: str, now_ms: int) -> int:
    """How many of this tenant's jobs were moved within the last hour of log time."""
    return sum(1 for t in migrated.get(tenant, ()) if now_ms - t < HOUR_MS)


def _whole_free(view, model_name: str) -> int:
    full = None
    n = 0
    for c in view.card_free():
        if c.model != model_name or c.mig or not c.healthy:
            continue
        if full is None:
            full = model(model_name).memory_mib
        if c.milli == 1000 and c.memory_mib == full:
            n += 1
    return n


def _stranded(free: dict[str, int], n: int) -> int:
    return sum(k for k in free.values() if k < n) * 1000


def plan(s, rec, exclude: frozenset[str] = frozenset(), trial: Plan | None = None) -> Opening | None:
    """The least-work opening of a block for `rec` on one node, or None (not a fragmentation case, no movable work,
    or the budget is spent). `s`: the scheduler (its node views, jobs, index, workload, configuration); `trial`: the
    cycle's plan the nodes are tried on (a fresh one over the node views without), left as it was found."""
    cfg = s.preemption
    r = rec.request
    if cfg.migrations_per_hour <= 0 or r.tier == Tier.OFFLINE or rec.nominated is not None:
        return None
    if trial is None:
        trial = Plan(s.nodes)
    best: Opening | None = None
    for m in allowed_models(s.index, r):
        n = cards_needed(r.compute_milli, r.gpu_memory_mib, m)
        if n < 2 and r.isolation_asked != "exclusive":
            continue  # a share of one card: not a block of cards
        if n > s.index.models.get(m, 0):
            continue  # no node has that many cards: a multi-node gang, not a block
        free = dict(s.index.whole_free(m))
        if sum(free.values()) < n:
            continue  # the capacity is not there in total: preemption's case, not fragmentation's
        before = _stranded(free, n)
        for name, view in s.nodes.items():
            if name in exclude or sum(1 for g in view.cards() if g.model == m) < n:
                continue
            cp = trial.checkpoint()
            p = _clear(s, rec, trial, view, m, n, free, exclude)
            trial.rollback(cp)
            if p is not None and (best is None or p.cost < best.cost):
                best = Opening(p.node, m, p.moves, before, p.frag_after_milli)
    return best


def _readmitted(s, rec, o, part) -> bool:
    """Whether the quota takes the moved job `o` back on its planned cards: a move releases the job's holding at the
    stop and admits it again before it resumes, so a job running above a quota lowered since it started would be
    stopped for good (kept waiting `QuotaExceeded`), not moved. When the job the block is opened for is of the same
    tenant, what it asked counts as used meanwhile, as the scheduler counts it (`Scheduler._quota_kept`)."""
    cu, mem = held(part.assignments, lambda uuid: s.card_model(part.node, uuid), o.request.compute_milli)
    q, w = o.request, rec.request
    kept = w.tenant == q.tenant and not rec.reserved and rec.hold is None
    freed = {}
    for account in ((q.tenant, None), (q.tenant, q.project)):
        back = [o.held_milli, o.held_memory_mib]
        if kept and account in ((w.tenant, None), (w.tenant, w.project)):
            back = [back[0] - w.compute_milli, back[1] - w.gpu_memory_mib]
        freed[account] = back
    return not s.ledger.admit(q, s.index.capacity_milli, cu, mem, freed=freed).blocked


def _clear(s, rec, trial: Plan, view, m: str, n: int, free: dict[str, int], exclude) -> Opening | None:
    """Moves that leave `view`'s node with room for `rec`, least work first, tried on `trial` (each mover evicted
    from the node and placed on its target; a mover that cannot move rolled back); None when it cannot be
    cleared. The caller rolls the trial back."""
    r = rec.request
    budget: dict[str, int] = {}
    movers = []
    for j in sorted(view.allocations):
        o = s.jobs.get(j)
        if o is None or o.phase != "running" or o.hold is not None or o.reserved or len(o.parts) != 1:
            continue
        q = o.request
        if TIER_RANK[q.tier] <= TIER_RANK[r.tier] or q.tier != Tier.OFFLINE or q.checkpoint_interval_s <= 0:
            continue
        if o.preempted_at and protected(o.preempted_at, s.now_ms, s.preemption):
            continue
        movers.append(o)
    if not movers:
        return None
    movers.sort(key=lambda o: (o.held_milli, o.request.job_id))
    chosen: list[Move] = []
    used = frozenset(exclude) | {view.node}
    for o in movers:
        t = o.request.tenant
        if t not in budget:
            budget[t] = s.preemption.migrations_per_hour - recent_moves(s.h.migrated, t, s.now_ms)
        if budget[t] <= 0:
            continue
        # a job in its quiet window (reclaimed or preempted a moment ago) may not take a node preemption freed for a
        # claim as strong as its weakest (`Scheduler._barred`): a move there would leave it waiting FreedForStronger
        barred = s._barred(o, False) if s._quiet(o) is not None else frozenset()
        cp = trial.checkpoint()
        trial.evict(view.node, o.request.job_id)
        # the targets as the moves chosen so far leave them (several moves may share one); the node itself excluded
        got = place(s.index, trial, o.request, s.workload, s.candidates, exclude=used | barred)
        if not isinstance(got, Placement) or len(got.parts) != 1 or not _readmitted(s, rec, o, got.parts[0]):
            # no target, or its quota (lowered since it started) would not take it back: the move would be a stop
            trial.rollback(cp)
            continue
        part = got.parts[0]
        trial.place(part.node, o.request, part.assignments)
        budget[t] -= 1
        chosen.append(Move(o.request.job_id, part.node, part.assignments, o.held_milli))
        after = trial[view.node]
        if fits(after, r):
            new = dict(free)
            new[view.node] = _whole_free(after, m)
            for mv in chosen:
                target = s.nodes[mv.to_node]
                whole = {c.uuid for c in target.card_free() if c.model == m and c.milli == 1000}
                new[mv.to_node] = new.get(mv.to_node, 0) - len({a.gpu_uuid for a in mv.assignments} & whole)
            return Opening(view.node, m, tuple(chosen), 0, _stranded(new, n))
    return None
