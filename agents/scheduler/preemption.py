"""Preemption and reclaim: which running work to stop so a waiting job fits, tried before anything is emitted.

A candidate plan is tried before anything is emitted: victims are released one by one, least disruptive first, until
the job fits. On a node of plain cards the trial is arithmetic (`Room`: host CPU and memory, per-card free compute
and GPU memory once the victims' holdings are added back -- exactly what a scratch view with them released would
say, and the tests hold it to that); on a node with MIG cards it runs on a scratch copy of the node's view (the
statement), discarded (rollback) whatever the outcome. Only the chosen plan becomes commands. Pure: no I/O, no clock;
time comes in as `now_ms`.

Who may be stopped for whom is the claim order's (claims.py): work whose claim is strictly below the waiting job's --
rule "tier" when it is below whatever its standing, "reclaim" when only because it stands beyond its account's quota
(a plan may then not take so much of one account that the rest would stand within it again: the `valid` check).
A job preempted `max_preemptions` times within `window_ms` is protected for `protect_ms`.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import NamedTuple

from agents.scheduler import topology
from agents.scheduler.node_index import NodeIndex, cards_needed
from agents.scheduler.placement import _NO_CONSTRAINTS, FILTERS, _card_allowed, fit_cards, gang_room, group_by
from schemas.envelope import envelope
from schemas.events import JobRequested, ReleaseJob
from schemas.gpu_models import model, share_for
from streams.folds import node_view


@dataclass(frozen=True)
class PreemptionConfig:
    max_preemptions: int = 3
    window_ms: int = 3600_000
    protect_ms: int = 1800_000
    # nodes with a workable plan compared before choosing (the cheapest wins); for a multi-node gang, groups of
    # nodes (a rack, a data center) with room enough
    candidate_nodes: int = 16
    # A job stopped to make room for another (a preemption victim) preempts and reclaims nothing for this long after
    # its stop, in log time: it takes free capacity only, so a victim's requeue triggers no preemption its
    # preemptor's request was not allowed (no chains; Armada: evicted jobs do not evict).
    victim_quiet_ms: int = 600_000
    # Defragmentation (defrag.py): moves (cmd.migrate) of one tenant's work allowed in any hour of log time; 0: none.
    migrations_per_hour: int = 2


def quiet_until(preempted_at: tuple[int, ...], cfg: PreemptionConfig) -> int:
    """Until when (log time) a job stopped for others at these times may not preempt: its last stop + the quiet."""
    return preempted_at[-1] + cfg.victim_quiet_ms if preempted_at else -1


class Victim(NamedTuple):
    """A candidate victim. A named tuple, not a frozen dataclass: a search builds one per job it judges (~190,000 in
    bench.placement --preemption --jobs 1000), and a frozen dataclass's __init__ costs several times a tuple's."""
    job_id: str
    node: str
    tier_rank: int
    borrowed: bool
    progress_lost_ms: int  # work since its last checkpoint (or start)
    rule: str  # "tier" | "reclaim" (claims.Search.rule) | "yield" (the autoscaler's warm and extra replicas)


@dataclass(frozen=True)
class Plan:
    node: str
    victims: tuple[Victim, ...]
    # every node the job takes cards on once the victims are gone (a multi-node gang's parts, its free cards
    # included): what the job claims while it waits, so that nobody behind it takes a part it counted on
    nodes: tuple[str, ...] = ()

    @property
    def cost(self) -> tuple:
        # fewest victims, then least work lost, then the lowest tiers; node name breaks ties deterministically
        return (len(self.victims), sum(v.progress_lost_ms for v in self.victims),
                -sum(v.tier_rank for v in self.victims), self.node)


def disruption_order(v: Victim) -> tuple:
    """Least disruptive first, the claim order's weakest first: beyond quota, lowest tier; then least progress
    lost."""
    return (0 if v.borrowed else 1, -v.tier_rank, v.progress_lost_ms, v.job_id)


def protected(preempted_at: tuple[int, ...], now_ms: int, cfg: PreemptionConfig) -> bool:
    recent = [t for t in preempted_at if now_ms - t <= cfg.window_ms]
    return len(recent) >= cfg.max_preemptions and now_ms - max(recent) <= cfg.protect_ms


def released(view: node_view.NodeView, job_ids) -> node_view.NodeView:
    """The statement: a scratch view with these jobs' holdings released (the real view is untouched)."""
    for i, j in enumerate(job_ids):
        view = node_view.evolve(view, envelope(ReleaseJob(command_id=f"trial-{i}", job_id=j, node=view.node),
                                               source="preemption-trial", seq=i + 1, time_ms=0))
    return view


def plan_for(job: JobRequested, nodes: list[node_view.NodeView], candidates: dict[str, list[Victim]]) -> Plan | None:
    """The cheapest node plan that makes `job` fit, or None."""
    return plan_over(job, ((view, candidates.get(view.node, ())) for view in nodes))


def plan_over(job: JobRequested, pairs, limit: int | None = None) -> Plan | None:
    """The cheapest plan over (node view, its candidate victims[, valid[, room]]) pairs, looking at no more than
    `limit` nodes that can yield a plan (kube-scheduler likewise stops after a number of candidate nodes); pairs may
    be lazy. `valid(chosen, v)`: whether a "reclaim" victim may join those chosen (claims.Search.valid). `room`: the
    node's Room for the job when the caller found already that the node passes the node filters and the job fits
    with every victim gone (not asked again), else None."""
    best: Plan | None = None
    found = 0
    shape = Shape(job)
    for pair in pairs:
        view, victims = pair[0], pair[1]
        valid = pair[2] if len(pair) > 2 else None
        room = pair[3] if len(pair) > 3 else None
        if not victims:
            continue
        if room is None:
            if any(f(view, job) for f in NODE_FILTERS):
                continue  # a node that is down, cordoned or of the wrong kind does not fit whatever we stop
            room = Room(view, job, shape)
            if not room.fits(victims):
                continue
        chosen = least_disruptive(room, sorted(victims, key=disruption_order), valid)
        if chosen is not None:
            plan = Plan(view.node, tuple(chosen))
            if best is None or plan.cost < best.cost:
                best = plan
            found += 1
        if limit is not None and found >= limit:
            break
    return best


def least_disruptive(room: "Room", ordered, valid=None) -> list | None:
    """One node's plan: victims taken least disruptive first (`ordered`: in disruption order) until the job fits
    (the room's tally follows what is chosen), then pruned; None when it never fits, or fits with none of them. A
    victim is anything with `job_id` and `rule`; `valid` as in plan_over."""
    room.start()
    chosen: list = []
    for v in ordered:
        if valid is not None and v.rule == "reclaim" and not valid(chosen, v):
            continue  # taking it too would bring its account back within quota
        chosen.append(v)
        room.add(v.job_id)
        if room.ok():
            # as much as it needs: drop, most disruptive first, every victim the job fits without (`chosen` is
            # in disruption order already, and stays so)
            for extra in reversed(chosen):
                room.add(extra.job_id, -1)
                if room.ok():
                    chosen = [c for c in chosen if c is not extra]
                else:
                    room.add(extra.job_id)
            # none left: the job fits there with nobody stopped, yet the placement did not take it (a node claimed
            # by a job ahead of it): stopping nobody is no plan
            return chosen or None
    return None


NODE_FILTERS = tuple(f for name, f in FILTERS if name != "HostResources")  # what stopping work does not change


def filters_key(c) -> object:
    """The key under which a view's facts keep whether NODE_FILTERS reject a job with constraints `c` (all they read
    of the job): a plain string for the default constraints, whose frozen model hashes field by field on every look."""
    return "filters" if c is _NO_CONSTRAINTS or c == _NO_CONSTRAINTS else ("filters", c)


class Shape:
    """What `job` needs of one card model, worked out once per search rather than once per node: the share of one
    card (a job that fits one card), else (cards, their memory) for a gang of whole cards, else nothing."""

    __slots__ = ("job", "per_model", "plain")

    def __init__(self, job: JobRequested):
        self.job = job
        self.per_model: dict[str, tuple[int | None, tuple[int, int] | None]] = {}
        c = job.constraints
        # no card-level constraint: a card is allowed when it is healthy (what _card_allowed says then)
        self.plain = not (c.models or c.min_compute_capability or c.min_driver or c.min_cuda)

    def of(self, name: str) -> tuple[int | None, tuple[int, int] | None]:
        got = self.per_model.get(name)
        if got is None:
            job, m = self.job, model(name)
            iso = job.isolation_asked
            if job.compute_milli <= m.cu_milli and job.gpu_memory_mib <= m.memory_mib:
                # "mig": no software share will do (MIG cards are left to the trial); "exclusive": one whole card
                got = (None, None) if iso == "mig" else (None, (1, m.memory_mib)) if iso == "exclusive" else (
                    share_for(job.compute_milli, m), None)
            elif job.gang:
                got = (None, (cards_needed(job.compute_milli, job.gpu_memory_mib, name), m.memory_mib))
            else:
                got = (None, None)
            self.per_model[name] = got
        return got


def _tally(view: node_view.NodeView, job_id: str, sign: int, freed: dict[str, list[int]]) -> tuple[int, int]:
    """Count `job_id`'s cards as freed (sign 1) or held again (sign -1) in `freed` (card -> [milli, MiB]); returns the
    host CPU and memory that moves with it."""
    held = view.allocations.get(job_id)
    if held is None:
        return 0, 0
    for a in held.slices:
        f = freed.get(a.gpu_uuid)
        if f is None:
            freed[a.gpu_uuid] = [sign * a.milli, sign * a.memory_mib]
        else:
            f[0] += sign * a.milli
            f[1] += sign * a.memory_mib
    return sign * held.cpu_milli, sign * held.memory_mib


class Room:
    """Whether `job` fits on a node once some of its jobs are gone, by arithmetic on the node's free CPU, memory and
    per-card free compute and GPU memory: exactly `fits(released(view, victims), job)` for a node that passes the
    NodeReady and Constraints filters (which stopping work does not change), without building a scratch view.
    A node with MIG cards (free instances, not amounts) is left to the trial on a scratch view.

    Either ask at once (`fits`, `fits_without`) or keep a tally: `start`, then `add` (or take back, sign -1) one job
    at a time and ask `ok` -- a search that adds victims one by one then costs one pass over the cards per step."""

    __slots__ = ("view", "job", "cpu", "mem", "cards", "mig", "share", "whole", "_cpu", "_mem", "_freed", "_ids",
                 "_by_uuid", "_fit0", "_whole0", "_whole_ok0")

    def __init__(self, view: node_view.NodeView, job: JobRequested, shape: Shape | None = None):
        self.view, self.job = view, job
        shape = shape or Shape(job)
        self.cpu, self.mem = view.free_cpu_memory()
        free = view.card_free()
        self.mig = any(c.mig for c in free)
        # allowed cards: (uuid, model, free milli, free memory); per model what one share needs, and how many
        # whole cards (of what memory) a gang needs
        if shape.plain:
            self.cards = [(c.uuid, c.model, c.milli, c.memory_mib) for c in free if not c.mig and c.healthy]
        else:
            self.cards = [(c.uuid, c.model, c.milli, c.memory_mib) for c in free
                          if not c.mig and _card_allowed(c, job, view)]
        self.share: dict[str, int] = {}
        self.whole: dict[str, tuple[int, int]] = {}
        for c in self.cards:
            name = c[1]
            if name not in self.share and name not in self.whole:
                share, whole = shape.of(name)
                if share is not None:
                    self.share[name] = share
                elif whole is not None:
                    self.whole[name] = whole
        # the cards as they are, so that `ok` looks only at the cards the tallied jobs free: which already fit a
        # share, how many are whole per model (and whether that is enough), and each card by id
        self._by_uuid: dict[str, tuple[str, int, int, bool]] = {}
        fit0, whole0 = [], {}
        for uuid, name, milli, memory in self.cards:
            need = self.share.get(name)
            was_whole = need is None and name in self.whole and milli == 1000 and memory == self.whole[name][1]
            self._by_uuid[uuid] = (name, milli, memory, was_whole)
            if need is not None and milli >= need and memory >= job.gpu_memory_mib:
                fit0.append(uuid)
            elif was_whole:
                whole0[name] = whole0.get(name, 0) + 1
        self._fit0, self._whole0 = tuple(fit0), whole0
        self._whole_ok0 = any(n >= self.whole[name][0] for name, n in whole0.items())
        self.start()

    def fits(self, victims) -> bool:
        return self.fits_without([v.job_id for v in victims])

    def fits_without(self, job_ids) -> bool:
        """Whether the job fits once these jobs are gone (ids of jobs not on the node free nothing)."""
        self.start()
        for j in job_ids:
            self.add(j)
        return self.ok()

    def start(self) -> None:
        self._cpu, self._mem, self._freed, self._ids = self.cpu, self.mem, {}, []

    def add(self, job_id: str, sign: int = 1) -> None:
        """Count `job_id`'s holding as freed (sign 1) or no longer freed (sign -1)."""
        if self.mig:
            if sign > 0:
                self._ids.append(job_id)
            else:
                self._ids.remove(job_id)
            return
        cpu, mem = _tally(self.view, job_id, sign, self._freed)
        self._cpu += cpu
        self._mem += mem

    def ok(self) -> bool:
        """Whether the job fits once the tallied jobs are gone."""
        job = self.job
        if self.mig:
            return fits(released(self.view, self._ids), job)
        if self._cpu < job.cpu_milli or self._mem < job.memory_mib:
            return False
        freed = self._freed
        for uuid in self._fit0:
            if uuid not in freed:
                return True  # a card that held a share before anything was freed (the freed ones are read below)
        whole = None
        for uuid, f in freed.items():
            card = self._by_uuid.get(uuid)
            if card is None:
                continue  # a card the job may not use
            name, milli, memory, was_whole = card
            milli, memory = milli + f[0], memory + f[1]
            need = self.share.get(name)
            if need is not None:
                if milli >= need and memory >= job.gpu_memory_mib:
                    return True
            elif name in self.whole:
                now_whole = milli == 1000 and memory == self.whole[name][1]
                if now_whole != was_whole:
                    if whole is None:
                        whole = dict(self._whole0)
                    whole[name] = whole.get(name, 0) + (1 if now_whole else -1)
        if whole is None:
            return self._whole_ok0
        return any(n >= self.whole[name][0] for name, n in whole.items())


def _could_fit(view: node_view.NodeView, job: JobRequested, victims) -> bool:
    """A cheap necessary condition, from the victims' holdings alone, before any trial: host CPU and memory, and a
    card (or enough whole cards) with room once they are gone. MIG cards are left to the trial."""
    cpu, mem = view.free_cpu_memory()
    freed: dict[str, list[int]] = {}
    for v in victims:
        held = view.allocations.get(v.job_id)
        if held is None:
            continue
        cpu += held.cpu_milli
        mem += held.memory_mib
        for a in held.slices:
            f = freed.setdefault(a.gpu_uuid, [0, 0])
            f[0] += a.milli
            f[1] += a.memory_mib
    if cpu < job.cpu_milli or mem < job.memory_mib:
        return False
    whole: dict[str, int] = {}
    for c in view.card_free():
        if c.mig:
            return True
        if not c.healthy:
            continue
        f = freed.get(c.uuid, (0, 0))
        milli, memory = c.milli + f[0], c.memory_mib + f[1]
        m = model(c.model)
        if job.compute_milli <= m.cu_milli and job.gpu_memory_mib <= m.memory_mib:
            if milli >= share_for(job.compute_milli, m) and memory >= job.gpu_memory_mib:
                return True
        elif milli == 1000 and memory == m.memory_mib:
            whole[c.model] = whole.get(c.model, 0) + 1
    return any(n >= cards_needed(job.compute_milli, job.gpu_memory_mib, name) for name, n in whole.items())


def fits(view: node_view.NodeView, job: JobRequested) -> bool:
    return all(not f(view, job) for _, f in FILTERS) and not isinstance(fit_cards(view, job), str)


def plan_gang(job: JobRequested, views: dict[str, node_view.NodeView], index: NodeIndex, models: list[str],
              candidates: Mapping[str, list[Victim]], valid=None, facts=None, bound: bool = True,
              limit: int | None = None) -> Plan | None:
    """Preemption for a gang that spans nodes: the tightest level (rack, data center, anywhere, within the job's
    max_spread) where free cards plus what lower-tier work holds add up; free cards are used first, and on each node
    only as many victims are stopped as its part needs (least disruptive first, then pruned). A node's room once its
    victims are gone is counted by arithmetic (`gang_room_after`), a group's nodes when the group is first looked at.
    `facts(view)`: a dict kept for that view object (views are immutable), where a node's rooms are kept for the next
    search; None: worked out every time. `bound`: a group whose plan would stop more jobs than the best one so far is
    passed over unplanned (`_gang_fewest`). `limit`: at one level, the groups with room enough in total compared
    before choosing (the cheapest plan among them wins), as the single-node search compares `candidate_nodes` nodes
    (kube-scheduler's bounded preemption candidates); None: every group."""
    spread = "nvlink" if job.constraints.interconnect == "nvlink" else job.constraints.max_spread
    # a node's room is counted from its victims' ids: a LazyVictims gives them without building every node's victims
    ids_of = getattr(candidates, "ids", None) or (lambda name: [v.job_id for v in candidates.get(name, ())])
    ids_memo: dict[str, list[str]] = {}
    c = job.constraints  # all a node's gang room reads of the job but for its part's cards, CPU and memory
    allowed = (tuple(c.models) if c.models else (), c.min_compute_capability, c.min_driver, c.min_cuda)
    fkey = filters_key(c)
    ids_of = (lambda name, _of=ids_of: ids_memo[name] if name in ids_memo else ids_memo.setdefault(name, _of(name)))
    for m in models:
        n = cards_needed(job.compute_milli, job.gpu_memory_mib, m)
        if n < 2:
            continue
        cpu_part, mem_part = job.cpu_milli, job.memory_mib  # host CPU and memory are per part, as asked
        free = {name for name, _ in index.whole_free(m)}
        # a node without cards of this model has no room whoever stops (removed nodes: NodeReady says so too)
        names = sorted((set(candidates) | free) & index.with_model(m))
        seen: dict[str, tuple[int, int] | None] = {}  # node -> (room now, room once its victims are gone), or None

        def room(name: str) -> tuple[int, int] | None:
            view = views[name]
            if m not in view.fit_summary.by_model:
                return None  # no healthy plain card of this model: no room whoever stops (the same cards after it)
            if facts is None:
                if any(f(view, job) for f in NODE_FILTERS):
                    return None
            else:
                kept = facts(view)
                k = fkey  # what they read: the view, and of the job its constraints alone
                rejected = kept.get(k)
                if rejected is None:
                    rejected = kept[k] = any(f(view, job) for f in NODE_FILTERS)
                if rejected:
                    return None
            ids = ids_of(name)
            if not ids and name not in free:
                return None  # nobody to stop there and no free card (`candidates` may name nodes that hold nobody)
            if facts is None:
                most = gang_room_after(view, job, m, cpu_part, mem_part, ids)
                return (gang_room(view, job, m, cpu_part, mem_part), most) if most > 0 else None
            kept = facts(view)
            mine = ("gang of", m, cpu_part, mem_part, allowed)  # the last ids asked, found without hashing them
            got = kept.get(mine)
            if got is not None and got[0] is ids:
                most = got[1]
            else:
                k = ("gang", m, cpu_part, mem_part, allowed, tuple(ids))
                most = kept.get(k)
                if most is None:
                    most = kept[k] = gang_room_after(view, job, m, cpu_part, mem_part, ids)
                kept[mine] = (ids, most)
            if most <= 0:
                return None
            k = ("gang room", m, cpu_part, mem_part, allowed)
            now = kept.get(k)
            if now is None:
                now = kept[k] = gang_room(view, job, m, cpu_part, mem_part)
            return now, most

        def rooms_of(members) -> dict[str, tuple[int, int]]:
            out = {}
            for name in members:
                got = seen[name] if name in seen else seen.setdefault(name, room(name))
                if got is not None:
                    out[name] = got
            return out

        for level in ("rack", "datacenter", "any"):
            if not topology.allowed(level, spread):
                if sum(most for _, most in rooms_of(names).values()) < n:
                    break  # not room enough anywhere: the next model
                return None
            best: Plan | None = None
            compared = 0
            for group in group_by(level, names, views):
                rooms = rooms_of(group)
                if sum(most for _, most in rooms.values()) < n:
                    continue  # not room enough in the group whoever stops: no plan here
                members = list(rooms)
                compared += 1
                if not (bound and best is not None and _gang_fewest(job, views, m, n, cpu_part, mem_part, members,
                                                                     rooms, ids_of, facts, allowed) > best.cost[0]):
                    plan = _gang_plan(job, views, m, n, cpu_part, mem_part, members, rooms, candidates, valid)
                    if plan is not None and (best is None or plan.cost < best.cost):
                        best = plan
                # else its plan would stop more jobs than the best one: it cannot be cheaper
                if limit is not None and compared >= limit:
                    break
            if best is not None:
                return best
    return None


def _gang_fewest(job, views, m, n, cpu_part, mem_part, members, rooms, ids_of, facts=None,
                 allowed=None) -> int | float:
    """A lower bound of how many victims `_gang_plan` stops for these members (inf: it finds no plan), from the
    nodes' cards alone: a node it takes victims from (its part's room now below what it takes there) stops at least
    one, and at least as many as it takes cards beyond its whole free ones, over the most cards of that model one of
    its victims holds (a job's release frees no more cards whole than it holds slices on). What it reads of a node
    is kept with the view (`facts`, as plan_gang's) by what of the job it reads (`allowed`: its card constraints)."""
    total, fewest = 0, 0
    for name in sorted(members, key=lambda x: (-rooms[x][0], -rooms[x][1], x)):
        now, most = rooms[name]
        take = min(most, n - total)
        if take <= 0:
            break
        if now < take:
            view = views[name]
            ids = ids_of(name)
            k = ("fewest", m, cpu_part, mem_part, allowed, tuple(ids))
            kept = facts(view) if facts is not None else None
            got = kept.get(k) if kept is not None else None
            if got is None:
                tally = GangTally(view, job, m, cpu_part, mem_part)
                full = tally.full
                whole = sum(1 for _, milli, memory in tally.cards if milli == 1000 and memory == full)
                cards = {c[0] for c in tally.cards}
                most_cards = 0
                for j in ids:
                    held = view.allocations.get(j)
                    if held is not None:
                        most_cards = max(most_cards, len({a.gpu_uuid for a in held.slices} & cards))
                got = (tally.room(), whole, most_cards)
                if kept is not None:
                    kept[k] = got
            room0, whole, most_cards = got
            if room0 < take:  # no victim gone: what _gang_plan's choice starts from
                if take > whole:
                    if most_cards == 0:
                        return float("inf")
                    fewest += max(1, -(-(take - whole) // most_cards))
                else:
                    fewest += 1
        total += take
    return fewest


def _gang_plan(job, views, m, n, cpu_part, mem_part, members, rooms, candidates, valid=None) -> Plan | None:
    total, victims, first, used = 0, [], None, []
    for name in sorted(members, key=lambda x: (-rooms[x][0], -rooms[x][1], x)):
        now, most = rooms[name]
        take = min(most, n - total)
        if take <= 0:
            break
        first = first or name
        used.append(name)
        if now < take:
            tally = GangTally(views[name], job, m, cpu_part, mem_part)
            chosen: list[Victim] = []
            for v in sorted(candidates.get(name, ()), key=disruption_order):
                if valid is not None and v.rule == "reclaim" and not valid(victims + chosen, v):
                    continue
                chosen.append(v)
                tally.add(v.job_id)
                if tally.room() >= take:
                    break
            if tally.room() < take:
                return None  # the victims its account may lose do not free this part
            # drop, most disruptive first, every victim the part has room without (`chosen` is in disruption order)
            for extra in reversed(chosen):
                tally.add(extra.job_id, -1)
                if tally.room() >= take:
                    chosen = [c for c in chosen if c is not extra]
                else:
                    tally.add(extra.job_id)
            victims.extend(chosen)
        total += take
    if total < n or not victims:
        return None  # enough without stopping anything is the placement's business, not preemption's
    return Plan(first, tuple(sorted(victims, key=disruption_order)), tuple(sorted(used)))


def gang_room_after(view: node_view.NodeView, job: JobRequested, model_name: str, cpu_part: int, mem_part: int,
                    job_ids) -> int:
    """`gang_room(released(view, job_ids), ...)` by arithmetic: whole free cards of this model the node could give one
    part of a gang once these jobs are gone (host CPU and memory included), without a scratch view."""
    tally = GangTally(view, job, model_name, cpu_part, mem_part)
    for j in job_ids:
        tally.add(j)
    return tally.room()


class GangTally:
    """A running count of what a node could give one part of a gang (whole free cards of one model, host CPU and
    memory per part) as jobs are counted as gone (`add`) or back (`add(.., -1)`)."""

    __slots__ = ("view", "cards", "full", "cpu", "mem", "cpu_part", "mem_part", "freed", "_by_uuid", "_whole0")

    def __init__(self, view: node_view.NodeView, job: JobRequested, model_name: str, cpu_part: int, mem_part: int):
        self.view, self.cpu_part, self.mem_part = view, cpu_part, mem_part
        full = self.full = model(model_name).memory_mib
        self.cards = [(c.uuid, c.milli, c.memory_mib) for c in view.card_free()
                      if c.model == model_name and not c.mig and _card_allowed(c, job, view)]
        # each card by id, with whether it is whole before anything is freed: `room` reads only the freed ones
        self._by_uuid = {uuid: (milli, memory, milli == 1000 and memory == full) for uuid, milli, memory in self.cards}
        self._whole0 = sum(1 for _, _, was in self._by_uuid.values() if was)
        self.cpu, self.mem = view.free_cpu_memory()
        self.freed: dict[str, list[int]] = {}

    def add(self, job_id: str, sign: int = 1) -> None:
        cpu, mem = _tally(self.view, job_id, sign, self.freed)
        self.cpu += cpu
        self.mem += mem

    def room(self) -> int:
        full, by_uuid = self.full, self._by_uuid
        room = self._whole0
        for uuid, f in self.freed.items():
            card = by_uuid.get(uuid)
            if card is not None:
                milli, memory, was = card
                room += (milli + f[0] == 1000 and memory + f[1] == full) - was
        if self.cpu < self.cpu_part or self.mem < self.mem_part:
            return 0  # not the host CPU or memory one part asks
        return max(room, 0)
