"""Where a job fits: filter plugins that each say why a node is rejected, a choice of cards, a score among the
nodes that fit, and multi-node gangs.

Pure: reads a snapshot of node views (and the index of which nodes can take what), returns a Placement or the
reasons there is none.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

from agents.scheduler import topology
from agents.scheduler.node_index import NodeIndex, cards_needed
from agents.scheduler.scoring import Workload, fragmentation, model_order
from schemas.events import Assignment, GpuCard, JobRequested, MigInstance, NodeInventory, Reason, Tier
from schemas.gpu_models import (
    MIG_COMPUTE_SLICES, MIG_MEMORY_SLICES, MODELS, mig_profile, mig_share_milli, model, share_for, version_tuple,
)
from streams.folds.node_view import CardFree, NodeView


@dataclass(frozen=True)
class Part:
    node: str
    assignments: tuple[Assignment, ...]
    cpu_milli: int
    memory_mib: int


@dataclass(frozen=True)
class Placement:
    parts: tuple[Part, ...]
    reasons: tuple[Reason, ...]

    @property
    def node(self) -> str:
        return self.parts[0].node

    @property
    def assignments(self) -> tuple[Assignment, ...]:
        return self.parts[0].assignments


@dataclass(frozen=True)
class MigPlan:
    """No free instance fits, but idle slices of a MIG card can be carved into one: reconfigure, then place."""
    node: str
    gpu_uuid: str
    layout: tuple[MigInstance, ...]
    profile: str


class Unschedulable:
    """No placement. Its reasons are worked out when first read: a job that then preempts, or that a cycle skips,
    never needs them (explaining a failure looks at up to EXPLAIN_LIMIT nodes and their running jobs). They are read
    before the scheduler changes anything, so they describe the state `place` saw."""

    __slots__ = ("_reasons", "_explain", "seen")

    def __init__(self, reasons: tuple[Reason, ...] | None = None, explain=None, seen: tuple = ()) -> None:
        self._reasons, self._explain = reasons, explain
        # what the attempt saw before any explaining: the nodes it looked at and why each refused (the scheduler
        # re-explains a waiting job only when this, or a node's facts, changed -- core.Scheduler._unplaced)
        self.seen = seen

    @property
    def reasons(self) -> tuple[Reason, ...]:
        return self.reasons_for(frozenset())

    def reasons_for(self, never: frozenset[str]) -> tuple[Reason, ...]:
        """Its reasons, what would free capacity counted on card models other than `never` (those the job's quota
        would never admit it on, core.Scheduler._never_admitted_on): read once, the first reader's `never` kept."""
        if self._reasons is None:
            self._reasons, self._explain = self._explain(never), None
        return self._reasons

    def __eq__(self, other) -> bool:
        return isinstance(other, Unschedulable) and self.reasons == other.reasons

    __hash__ = None

    def __repr__(self) -> str:
        return f"Unschedulable(reasons={self.reasons!r})"


# ---------------------------------------------------------------- filters: (node, job) -> None | reason code

def _f_schedulable(v: NodeView, job: JobRequested) -> str | None:
    if v.removed:
        return "NodeRemoved"
    if v.inventory is None:
        return "NoInventory"
    if not v.alive:
        return "NodeNotReady"
    if v.cordoned:
        return "NodeCordoned"
    if not v.admitted:
        return "NodeNotAdmitted"  # reported through a node principal, not yet admitted (`gpupool node admit`)
    return None


def _f_constraints(v: NodeView, job: JobRequested) -> str | None:
    return inventory_rejects(v.inventory, job)


def inventory_rejects(inv: NodeInventory, job: JobRequested) -> str | None:
    """The Constraints plugin's code for a node with this inventory, or None: what the node's cards and place allow,
    whatever is in use (admission asks it of every node's inventory)."""
    c = job.constraints
    if c.datacenter and inv.datacenter != c.datacenter:
        return "DatacenterMismatch"
    cards = inv.gpus
    if c.models and not any(g.model in c.models for g in cards):
        return "ModelNotAllowed"
    if c.min_compute_capability and not any(
            version_tuple(g.compute_capability) >= version_tuple(c.min_compute_capability) for g in cards):
        return "ComputeCapabilityTooLow"
    if c.min_driver and not any(version_tuple(g.driver_version) >= version_tuple(c.min_driver) for g in cards):
        return "DriverTooOld"
    if c.min_cuda and not any(version_tuple(g.cuda_version) >= version_tuple(c.min_cuda) for g in cards):
        return "CudaTooOld"
    return None


def _f_host(v: NodeView, job: JobRequested) -> str | None:
    cpu, mem = v.free_cpu_memory()
    if cpu < job.cpu_milli:
        return "InsufficientCPU"
    if mem < job.memory_mib:
        return "InsufficientHostMemory"
    return None


FILTERS = (("NodeReady", _f_schedulable), ("Constraints", _f_constraints), ("HostResources", _f_host))


def _card_allowed(card: CardFree, job: JobRequested, v: NodeView) -> bool:
    c = job.constraints
    if not card.healthy or (c.models and card.model not in c.models):
        return False
    if not (c.min_compute_capability or c.min_driver or c.min_cuda):
        return True
    return gpu_allowed(next(g for g in v.cards() if g.uuid == card.uuid), job)


def gpu_allowed(gpu: GpuCard, job: JobRequested) -> bool:
    """Whether the job's card-level constraints (model, compute capability, driver, CUDA) allow this card."""
    c = job.constraints
    if c.models and gpu.model not in c.models:
        return False
    if c.min_compute_capability and version_tuple(gpu.compute_capability) < version_tuple(c.min_compute_capability):
        return False
    if c.min_driver and version_tuple(gpu.driver_version) < version_tuple(c.min_driver):
        return False
    if c.min_cuda and version_tuple(gpu.cuda_version) < version_tuple(c.min_cuda):
        return False
    return True


def _may_fit(v: NodeView, job: JobRequested) -> bool:
    """A cheap necessary condition from the node's per-model summary, so most full nodes are passed over at once."""
    s = v.fit_summary
    if s.mig_free:
        return True
    for name, (max_milli, max_mem, whole) in s.by_model.items():
        m = model(name)
        if job.compute_milli <= m.cu_milli and job.gpu_memory_mib <= m.memory_mib:
            if max_milli >= share_for(job.compute_milli, m) and max_mem >= job.gpu_memory_mib:
                return True
        n = max(-(-job.compute_milli // m.cu_milli), -(-job.gpu_memory_mib // m.memory_mib))
        if whole >= n:
            return True
    return False


DEFAULT_CANDIDATES = 32  # fitting nodes scored per job (kube-scheduler scores a sample of feasible nodes too)


def _rejects(v: NodeView, job: JobRequested, skip_host: bool = False) -> tuple[str, str] | None:
    for plugin, f in FILTERS:
        if skip_host and plugin == "HostResources":
            continue
        code = f(v, job)
        if code:
            return plugin, code
    return None


def _whole_cards(v: NodeView, job: JobRequested, cards: list[CardFree], n: int, per_card_mem: int
                 ) -> tuple[Assignment, ...]:
    """`n` of these completely free cards, inside one NVLink domain when one has room (the tightest such domain)."""
    domain = {g.uuid: g.nvlink_domain for g in v.cards()}
    by_domain: dict[str | None, list[CardFree]] = {}
    for c in cards:
        by_domain.setdefault(domain.get(c.uuid), []).append(c)
    roomy = sorted(((len(cs), str(d)) for d, cs in by_domain.items() if d is not None and len(cs) >= n))
    chosen = next(cs for d, cs in by_domain.items() if str(d) == roomy[0][1]) if roomy else cards
    return tuple(Assignment(gpu_uuid=c.uuid, milli=1000, memory_mib=per_card_mem) for c in chosen[:n])


def free_whole(v: NodeView, job: JobRequested, model_name: str) -> list[CardFree]:
    full = model(model_name).memory_mib
    return [c for c in v.card_free() if c.model == model_name and not c.mig and c.milli == 1000
            and c.memory_mib == full and _card_allowed(c, job, v)]


def fit_cards(v: NodeView, job: JobRequested, order: list[str] | None = None) -> tuple[Assignment, ...] | str:
    """Cards for `job` on node `v`, or the reason code why none fit. `order`: the card models allowed, preferred first.

    One card when the request fits one card (a MIG instance, else a software share; the preferred model first, then
    best fit); otherwise whole cards of one model (the preferred one that has room), as few as compute and memory
    need, inside one NVLink domain when possible.
    """
    if job.isolation_asked == "mig" and not any(g.mig_enabled for g in v.cards()):
        return "NoMigCard"  # free or busy, its cards are no answer to a hardware slice: say which it lacks
    if not _may_fit(v, job):
        return "InsufficientGPU"
    cards = [c for c in v.card_free() if _card_allowed(c, job, v) and (order is None or c.model in order)]
    if not cards:
        return "NoAllowedHealthyGPU"
    rank = {m: i for i, m in enumerate(order or ())}
    iso = job.isolation_asked
    # (rank, leftover milli, leftover memory, card, then what the assignment will hold): assignments are built for
    # the chosen card only -- this loop runs for every card of every node looked at
    share_fits: list[tuple] = []
    for c in cards:
        m = model(c.model)
        if c.mig:
            if not job.constraints.mig_allowed or iso == "exclusive":
                continue
            for inst in sorted(c.free_instances, key=lambda i: (i.size, i.start)):
                p = mig_profile(c.model, inst.profile)
                if _instance_holds(m, p, job):
                    share_fits.append((rank.get(c.model, 0), mig_share_milli(p), p.memory_mib, c.uuid,
                                       mig_share_milli(p), p.memory_mib, p.name, inst.uuid))
                    break
            continue
        if iso != "mig" and job.compute_milli <= m.cu_milli and job.gpu_memory_mib <= m.memory_mib:
            # "exclusive": the whole card (all its compute and memory), "shared": a software share of it
            need, mem = (1000, m.memory_mib) if iso == "exclusive" else (share_for(job.compute_milli, m),
                                                                          job.gpu_memory_mib)
            if c.milli >= need and c.memory_mib >= mem:
                # best fit: the card left with the least free compute after this job
                share_fits.append((rank.get(c.model, 0), c.milli - need, c.memory_mib - mem, c.uuid,
                                   need, mem, None, None))
    if share_fits:
        best = min(share_fits, key=lambda t: t[:4])
        return (Assignment(gpu_uuid=best[3], milli=best[4], memory_mib=best[5], mig_profile=best[6],
                           mig_uuid=best[7]),)
    if not job.gang:
        return "InsufficientGPU"
    models = order or sorted({c.model for c in cards},
                             key=lambda n: (cards_needed(job.compute_milli, job.gpu_memory_mib, n), n))
    for name in models:
        n = cards_needed(job.compute_milli, job.gpu_memory_mib, name)
        if n < 2:
            continue
        free = [c for c in cards if c.model == name and not c.mig and c.milli == 1000
                and c.memory_mib == model(name).memory_mib]
        if len(free) >= n:
            return _whole_cards(v, job, free, n, -(-job.gpu_memory_mib // n))
    return "InsufficientGPU"


def _instance_holds(m, p, job: JobRequested) -> bool:
    """Whether one instance of MIG profile `p` on a card of model `m` has the job's compute and GPU memory."""
    return (p.compute_slices * m.cu_milli // MIG_COMPUTE_SLICES >= job.compute_milli
            and p.memory_mib >= job.gpu_memory_mib)


def mig_plan(v: NodeView, job: JobRequested, order: list[str]) -> MigPlan | None:
    """The smallest MIG profile that fits `job`, carved out of memory slices no instance covers, on a healthy
    MIG-enabled card with no reconfigure under way. Existing instances are never touched (busy or not)."""
    if not job.constraints.mig_allowed or job.isolation_asked == "exclusive":
        return None
    best: tuple | None = None
    for c in v.cards():
        if not c.mig_enabled or c.uuid in v.unhealthy or c.uuid in v.mig_pending or c.model not in order:
            continue
        m = model(c.model)
        covered = {i.start + k for i in c.mig_layout for k in range(i.size)}
        compute_used = sum(mig_profile(c.model, i.profile).compute_slices for i in c.mig_layout)
        room = MIG_MEMORY_SLICES - len(covered)
        for p in sorted(m.mig_profiles, key=lambda p: (p.memory_slices, p.compute_slices)):
            if not _instance_holds(m, p, job):
                continue
            if compute_used + p.compute_slices > MIG_COMPUTE_SLICES:
                continue
            start = next((s for s in p.starts if not covered & set(range(s, s + p.memory_slices))), None)
            if start is None:
                continue
            key = (order.index(c.model), p.memory_slices, room, c.uuid)
            if best is None or key < best[0]:
                inst = MigInstance(uuid=f"MIG-{c.uuid}-{p.name}-{start}", profile=p.name, start=start,
                                   size=p.memory_slices)
                layout = tuple(sorted(c.mig_layout + (inst,), key=lambda i: i.start))
                best = (key, MigPlan(v.node, c.uuid, layout, p.name))
            break
    return best[1] if best else None


def _delta(v: NodeView, fit: tuple[Assignment, ...], job: JobRequested, workload: Workload) -> int:
    """Fragmentation this placement adds to the node's cards of the chosen model (weighted milli)."""
    if fit[0].mig_uuid:
        return 0  # an existing MIG instance: its slices are carved already
    model_name, cards, cpu, mem, before = workload.cached(v, fit[0].gpu_uuid, lambda: _frag_base(v, fit, workload))
    used = {a.gpu_uuid: a.milli for a in fit}
    after = fragmentation([milli - used.get(uuid, 0) for uuid, milli in cards], cpu - job.cpu_milli,
                          mem - job.memory_mib, workload.shapes(model_name))
    return after - before


def _frag_base(v: NodeView, fit: tuple[Assignment, ...], workload: Workload) -> tuple:
    """(model, [(card, free milli)] of that model's healthy whole-share cards, free CPU, free memory, fragmentation)."""
    model_name = next(c.model for c in v.card_free() if c.uuid == fit[0].gpu_uuid)
    cards = [(c.uuid, c.milli) for c in v.card_free() if c.model == model_name and c.healthy and not c.mig]
    cpu, mem = v.free_cpu_memory()
    return model_name, cards, cpu, mem, fragmentation([m for _, m in cards], cpu, mem, workload.shapes(model_name))


def _shape(fit: tuple[Assignment, ...]) -> str:
    if fit[0].mig_profile:
        return "MIG " + fit[0].mig_profile
    if len(fit) == 1 and fit[0].milli < 1000:
        return f"{fit[0].milli} milli-GPU share"
    return f"{len(fit)} whole card(s)"


def allowed_models(index: NodeIndex, job: JobRequested) -> list[str]:
    c = job.constraints.models
    return model_order(job, [m for m in index.models if not c or m in c])


FIT_CACHE_SHAPES = 256  # outcomes kept per node view, so a workload of many distinct shapes cannot grow it unbounded


def _known(index: NodeIndex, v: NodeView, workload: Workload, version: int) -> dict:
    """What placement already found on this exact view (outcomes by job shape), for this workload's typical set."""
    entry = index.fit_cache.get(v.node)
    if entry is None or entry[0] is not v or entry[1] is not workload or entry[2] != version:
        entry = index.fit_cache[v.node] = (v, workload, version, {})
    elif len(entry[3]) >= FIT_CACHE_SHAPES:
        entry[3].clear()  # many shapes against a node that does not change: start over (answers are recomputed alike)
    return entry[3]


def _mig_could_hold(job: JobRequested, models: list[str]) -> bool:
    """Whether one MIG instance of an allowed model could hold the job (an existing one or a carved one): when none
    could, the MIG nodes have nothing for it and are not walked. A model without a profile table (instances known
    only by name) always could."""
    if not job.constraints.mig_allowed or job.isolation_asked == "exclusive":
        return False
    for name in models:
        m = MODELS.get(name)
        if m is None:
            return True
        for p in m.mig_profiles:
            if _instance_holds(m, p, job):
                return True
    return False


def _closed(rejected: dict, name: str, barred: frozenset[str]) -> None:
    """A node closed to this job by preemption: freed for a stronger claim, or claimed by a job nominated ahead."""
    rejected.setdefault(("Preemption", "FreedForStronger" if name in barred else "NominatedForOther"), []).append(name)


def _unplaced(index: NodeIndex, views: dict[str, NodeView], job: JobRequested, rejected: dict, seen: set
              ) -> "Unschedulable":
    """What the job saw, the nodes closed to it aside (claimed by a nominated job, freed for a stronger claim): a
    waiting job is not explained afresh only because that set moved (core.Scheduler._unplaced)."""
    closed = sum(len(v) for k, v in rejected.items() if k[0] == "Preemption")
    saw = (tuple(sorted((k, tuple(v)) for k, v in rejected.items() if k[0] != "Preemption")), len(seen) - closed,
           len(views), len(index.down))
    return Unschedulable(explain=lambda never: _unschedulable(index, views, job, rejected, seen, never).reasons,
                         seen=saw)


_NO_CONSTRAINTS = JobRequested.model_fields["constraints"].default


def place(index: NodeIndex, views: dict[str, NodeView], job: JobRequested, workload: Workload,
          k: int = DEFAULT_CANDIDATES, prefer: str | None = None, exclude: frozenset[str] = frozenset(),
          barred: frozenset[str] = frozenset()) -> Placement | MigPlan | "Unschedulable":
    """Fitting nodes from the index, preferred card model first and tightest first; up to `k` of them are scored by
    the fragmentation they would add, the least wins. Failing that, a multi-node gang; failing that, a MIG
    reconfigure. Every rejection is recorded by plugin and node. `prefer`: a node tried first (a reservation's).

    What a node gives a job of a shape (rejection, or cards and fragmentation added) is a function of the node's
    view, the shape and the workload's typical set: it is kept in `index.fit_cache` per view object and reused by
    the next job of the same shape that looks at the unchanged node. `exclude`: nodes claimed by a job nominated
    ahead of this one (`Preemption: NominatedForOther`); `barred`: nodes whose free capacity preemption freed for a
    claim at least as strong as this recently stopped job's, which it may not take yet
    (`Preemption: FreedForStronger`)."""
    if barred:
        exclude = exclude | barred
    workload.fleet(index)
    if job.cpu_only:
        return _place_host(index, views, job, workload, k, prefer, exclude, barred)
    models = allowed_models(index, job)
    rejected: dict[tuple[str, str], list[str]] = {}
    fits: list[tuple[int, int, int, str, tuple[Assignment, ...]]] = []
    seen: set[str] = set()
    version = workload.version()
    iso = job.isolation_asked
    shape = index.intern((job.compute_milli, job.gpu_memory_mib, job.cpu_milli, job.memory_mib, job.gang, iso)) \
        if job.constraints == _NO_CONSTRAINTS else None

    def consider(name: str, rank: int, order: list[str], order_key: str | None) -> None:
        seen.add(name)
        if name in exclude:
            _closed(rejected, name, barred)
            return
        v = views[name]
        outcome = None
        if shape is not None:
            known = _known(index, v, workload, version)
            outcome = known.get((shape, order_key))
        if outcome is None:
            why = _rejects(v, job)
            if why is None:
                fit = fit_cards(v, job, order)
                if isinstance(fit, str):
                    why = ("GpuFit", fit)
                else:
                    outcome = (None, fit, _delta(v, fit, job, workload))
            if outcome is None:
                outcome = (why, None, 0)
            if shape is not None:
                known[(shape, order_key)] = outcome
        why, fit, delta = outcome
        if why is None:
            fits.append((rank, delta, len(fits), name, fit))
        else:
            rejected.setdefault(why, []).append(name)

    mig = _mig_could_hold(job, models)

    def mig_nodes() -> None:
        if len(fits) < k and mig:
            for name in index.mig_nodes():
                if len(fits) >= k:
                    break
                if name not in seen:
                    consider(name, len(models), models, None)

    if prefer in views:
        consider(prefer, -1, models, None)
    if iso == "mig" and mig and not fits:
        # a hardware slice first: a free instance, else one carved from idle slices; whole cards (a request larger
        # than a card of some model) only when no slice can be had -- more isolation than asked is the fallback
        mig_nodes()
        if not fits:
            carve = _carve(index, views, job, models, exclude)
            if carve is not None:
                return carve
    for rank, m in enumerate(models):
        if fits and fits[0][0] == -1:
            break
        n = cards_needed(job.compute_milli, job.gpu_memory_mib, m)
        if n == 1 and iso == "mig":
            continue  # a hardware slice only: the MIG nodes below
        if n == 1 and iso != "exclusive" and share_for(job.compute_milli, model(m)) < 1000:
            # a share of one card: the nodes with such a card, tightest card first
            nodes = index.share_nodes(m, share_for(job.compute_milli, model(m)), job.gpu_memory_mib)
        elif n == 1 or job.gang:
            # whole cards: one node of each count of free cards in turn, so the sample holds the nodes a few cards
            # from full and the untouched ones alike and the score, not the walk, decides which one breaks
            nodes = index.whole_nodes_spread(m, n)
        else:
            nodes = ()
        for name in nodes:
            if len(fits) >= k:
                break
            if name not in seen:
                consider(name, rank, [m], m)
    mig_nodes()
    if fits:
        rank, delta, _, name, fit = min(fits)
        w = max(1, workload.weight)
        parts = (Part(name, fit, job.cpu_milli, job.memory_mib),)
        reasons = [Reason(code="Placed", plugin="GpuFit", nodes=(name,),
                          message=f"{_shape(fit)}; best of {len(fits)} fitting node(s) scored: fragmentation "
                                  f"{delta // w:+d} milli-GPU; isolation {isolation_given(views[name], fit)}"
                                  + (f" ({iso} asked)" if isolation_given(views[name], fit) != iso else ""),
                          data={"candidates": len(fits), "frag_delta_milli": delta // w,
                                "isolation": isolation_given(views[name], fit), "isolation_asked": iso})]
        if len(fit) > 1:
            reasons.append(_topology_reason(index, views, parts, fit_model(views[name], fit)))
        return Placement(parts, tuple(reasons))
    if job.gang:
        gang = _gang(index, views, job, models, exclude, shape is not None)
        if gang is None and job.tier == Tier.OFFLINE and len(models) > 1:
            gang = _mixed_gang(index, views, job, models, exclude)
        if gang is not None:
            return gang
    if mig:
        carve = _carve(index, views, job, models, exclude)
        if carve is not None:
            return carve
    return _unplaced(index, views, job, rejected, seen)


CPU_ONLY_CANDIDATES = 64  # nodes a CPU-only job scores at most (it stops at the first that strands nothing)


def host_delta(v: NodeView, job: JobRequested, workload: Workload) -> int:
    """Fragmentation a CPU-only job adds to a node: the CPU and host memory it takes can leave the node's free cards
    unusable by the typical jobs (capped by how many of them the host can still hold) or stranded behind a host no
    typical job fits. Never negative; 0: it strands nothing."""
    cpu, mem = v.free_cpu_memory()
    by_model: dict[str, list[int]] = {}
    for c in v.card_free():
        if c.healthy and not c.mig:
            by_model.setdefault(c.model, []).append(c.milli)
    delta = 0
    for name, free in by_model.items():
        if not any(free):
            continue
        shapes = workload.shapes(name)
        delta += fragmentation(free, cpu - job.cpu_milli, mem - job.memory_mib, shapes) - \
            fragmentation(free, cpu, mem, shapes)
    return delta


def _place_host(index: NodeIndex, views: dict[str, NodeView], job: JobRequested, workload: Workload, k: int,
                prefer: str | None, exclude: frozenset[str], barred: frozenset[str]) -> "Placement | Unschedulable":
    """A CPU-only job: the node whose free cards its CPU and memory strand least (`host_delta`), among up to
    CPU_ONLY_CANDIDATES schedulable nodes with the host room, the first that strands nothing at once."""
    rejected: dict[tuple[str, str], list[str]] = {}
    seen: set[str] = set()
    best = None
    scored = 0
    names = chain([prefer] if prefer in views else (), index.host_nodes())
    for name in names:
        if name in seen:
            continue
        seen.add(name)
        if name in exclude:
            _closed(rejected, name, barred)
            continue
        v = views[name]
        why = _rejects(v, job)
        if why is not None:
            rejected.setdefault(why, []).append(name)
            continue
        delta = host_delta(v, job, workload)
        scored += 1
        if best is None or delta < best[0]:
            best = (delta, name)
        if best[0] <= 0 or scored >= max(k, CPU_ONLY_CANDIDATES):
            break
    if best is not None:
        delta, name = best
        w = max(1, workload.weight)
        return Placement((Part(name, (), job.cpu_milli, job.memory_mib),), (Reason(
            code="Placed", plugin="HostFit", nodes=(name,),
            message=f"CPU-only: {job.cpu_milli} milli-CPU, {job.memory_mib} MiB; best of {scored} node(s) scored: "
                    f"fragmentation {delta // w:+d} milli-GPU (the cards its CPU and memory leave unusable)",
            data={"candidates": scored, "frag_delta_milli": delta // w, "cpu_only": True}),))
    return _unplaced(index, views, job, rejected, seen)


def _carve(index: NodeIndex, views: dict[str, NodeView], job: JobRequested, models: list[str],
           exclude: frozenset[str]) -> MigPlan | None:
    """A MIG instance to carve for the job out of idle slices, on the first MIG node (index order) that has them."""
    for name in index.mig_nodes():
        v = views[name]
        if name not in exclude and _rejects(v, job) is None:
            plan = mig_plan(v, job, models)
            if plan is not None:
                return plan
    return None


def isolation_given(v: NodeView, fit: tuple[Assignment, ...]) -> str:
    """The isolation a placement gives: "mig" on a MIG instance, "exclusive" when it holds whole cards (all their
    compute), "shared" a software share of a card."""
    if any(a.mig_profile for a in fit):
        return "mig"
    return "exclusive" if all(a.milli >= 1000 for a in fit) else "shared"


def fit_model(v: NodeView, fit: tuple[Assignment, ...]) -> str:
    return next(g.model for g in v.cards() if g.uuid == fit[0].gpu_uuid)


def _topology_reason(index: NodeIndex, views: dict[str, NodeView], parts: tuple[Part, ...], model_name: str
                     ) -> Reason:
    domains = {}
    for p in parts:
        v = views[p.node]
        domains[p.node] = {g.uuid: g.nvlink_domain for g in v.cards()}
    level = topology.level_of([(views[p.node].inventory.rack, views[p.node].inventory.datacenter,
                                tuple(domains[p.node].get(a.gpu_uuid) for a in p.assignments)) for p in parts])
    n = sum(len(p.assignments) for p in parts)
    has_nvlink = any(d for p in parts for d in domains[p.node].values())
    ideal = ("nvlink" if has_nvlink else "node") if n <= index.models.get(model_name, 0) else "rack"
    if topology.LEVELS.index(level) < topology.LEVELS.index(ideal):
        ideal = level
    return Reason(code="Topology", plugin="Topology", nodes=tuple(p.node for p in parts),
                  message=topology.explain(level, ideal, len(parts)),
                  data={"level": level, "ideal": ideal, "slowdown_pct": topology.slowdown_pct(level, ideal),
                        "parts": len(parts)})


def gang_room(view: NodeView, job: JobRequested, model_name: str, cpu_part: int, mem_part: int) -> int:
    """Whole free cards of this model the node could give one part of a gang: none unless the node has the host CPU
    and memory a part asks (`cpu_part`, `mem_part`: the request's, per part -- docs/jobs.md "Gangs")."""
    room = len(free_whole(view, job, model_name))
    cpu, mem = view.free_cpu_memory()
    if cpu < cpu_part or mem < mem_part:
        return 0
    return max(room, 0)


def group_by(level: str, names, views: dict[str, NodeView]) -> list[list[str]]:
    """The nodes grouped by rack, data center, or all together; groups in a deterministic order."""
    groups: dict[tuple, list[str]] = {}
    for name in names:
        inv = views[name].inventory
        key = {"rack": (inv.datacenter, inv.rack), "datacenter": (inv.datacenter,), "any": ()}[level]
        groups.setdefault(key, []).append(name)
    return [groups[k] for k in sorted(groups)]


def _gang(index: NodeIndex, views: dict[str, NodeView], job: JobRequested, models: list[str],
          exclude: frozenset[str] = frozenset(), unconstrained: bool = False) -> Placement | None:
    """All or nothing over several nodes: the fewest parts inside one rack, else one data center, else anywhere --
    as far as the job's max_spread allows. `unconstrained` (a job without constraints): what each node can give a
    part is a function of its view alone, kept in the index and read again only for the nodes that changed
    (`_gang_avail`)."""
    limit = "nvlink" if job.constraints.interconnect == "nvlink" else job.constraints.max_spread
    for m in models:
        n = cards_needed(job.compute_milli, job.gpu_memory_mib, m)
        if n < 2:
            continue
        cpu_part, mem_part = job.cpu_milli, job.memory_mib  # host CPU and memory are per part, as asked
        key = ("gang", m, cpu_part, mem_part)
        if unconstrained and views is index.views:
            avail = _gang_avail(index, views, job, m, key)
            if exclude:
                avail = {name: u for name, u in avail.items() if name not in exclude}
        else:  # constraints (what a node gives depends on the job), or views other than the index's (a trial)
            avail = {}
            for name, _k in index.whole_free(m):
                if name in exclude:
                    continue
                v = views[name]
                usable = 0 if _rejects(v, job, skip_host=True) else gang_room(v, job, m, cpu_part, mem_part)
                if usable > 0:
                    avail[name] = usable
        if sum(avail.values()) < n:
            continue
        for level in ("rack", "datacenter", "any"):
            if not topology.allowed(level, limit):
                break  # not within the allowed spread on this model: the next model may have room closer together
            best = None
            for members in group_by(level, avail, views):
                take, total = [], 0
                for name, usable in sorted(((x, avail[x]) for x in members), key=lambda t: (-t[1], t[0])):
                    take.append((name, min(usable, n - total)))
                    total += take[-1][1]
                    if total >= n:
                        break
                if total >= n and (best is None or len(take) < len(best)):
                    best = take
            if best is not None:
                per_card_mem = -(-job.gpu_memory_mib // n)
                parts = tuple(Part(name, _whole_cards(views[name], job, free_whole(views[name], job, m), c,
                                                      per_card_mem), cpu_part, mem_part) for name, c in best)
                return Placement(parts, (
                    Reason(code="Placed", plugin="Gang", nodes=tuple(p.node for p in parts),
                           message=f"{n} whole {m} card(s) in {len(parts)} part(s), all or nothing; "
                                   "isolation exclusive",
                           data={"cards": n, "parts": len(parts), "isolation": "exclusive",
                                 "isolation_asked": job.isolation_asked}),
                    _topology_reason(index, views, parts, m)))
    return None


def _gang_avail(index: NodeIndex, views: dict[str, NodeView], job: JobRequested, m: str, key: tuple
                ) -> dict[str, int]:
    """{node: whole cards of model m that one part of a gang (CPU and memory per part as in `key`) could take
    there}, for every node that could take one: what a gang without constraints reads of the fleet. A function of
    each node's view alone, so it is kept (`NodeIndex.gang_avail`) and brought up to date from the nodes whose view
    changed since (`NodeIndex.changed_since`) -- a gang reads the nodes that changed, not the fleet (#35 item 1). Not
    to be written to: the caller copies it to filter it."""
    memo = index.gang_avail.get(key)
    since = index.changed_since(memo[0]) if memo is not None else None
    _, _, cpu_part, mem_part = key
    if since is None:
        avail: dict[str, int] = {}
        todo = (name for name, _k in index.whole_free(m))
    else:
        avail = memo[1]
        todo = dict.fromkeys(since)
    for name in todo:
        v = views.get(name)
        usable = 0 if v is None or not index.whole_cards(name, m) or _rejects(v, job, skip_host=True) \
            else gang_room(v, job, m, cpu_part, mem_part)
        if usable > 0:
            avail[name] = usable
        else:
            avail.pop(name, None)
    index.gang_avail[key] = (index.position_now, avail)
    return avail


def _mixed_gang(index: NodeIndex, views: dict[str, NodeView], job: JobRequested, models: list[str],
                exclude: frozenset[str] = frozenset()) -> Placement | None:
    """Low-tier work may mix card models (issue #4, heterogeneity): when no one model can hold the gang, whole cards
    of several models, counted by what each card brings (its compute units and memory), until the job's compute and
    GPU memory are both covered. Host CPU and memory are asked per part, as the request says (docs/jobs.md,
    "Gangs"). Fewest parts inside one rack, else one data center, else anywhere, as max_spread allows."""
    if job.constraints.interconnect == "nvlink" or not job.compute_milli:
        return None
    limit = job.constraints.max_spread
    need_cu, need_mem = job.compute_milli, job.gpu_memory_mib
    offers: list[tuple[str, str, int]] = []  # node, model, whole cards it can give
    per_card: dict[str, tuple[int, int, int, int]] = {}
    for m in models:
        gm = model(m)
        per_card[m] = (gm.cu_milli, gm.memory_mib, job.cpu_milli, job.memory_mib)  # host CPU, memory: per part
        for name, _k in index.whole_free(m):
            if name in exclude:
                continue
            v = views[name]
            if _rejects(v, job, skip_host=True):
                continue
            room = gang_room(v, job, m, job.cpu_milli, job.memory_mib)
            if room > 0:
                offers.append((name, m, room))
    total_cu = sum(per_card[m][0] * c for _, m, c in offers)
    total_mem = sum(per_card[m][1] * c for _, m, c in offers)
    if total_cu < need_cu or total_mem < need_mem:
        return None
    nodes = {name for name, _, _ in offers}
    for level in ("rack", "datacenter", "any"):
        if not topology.allowed(level, limit):
            break
        best = None
        for members in group_by(level, nodes, views):
            inside = set(members)
            mine = sorted((o for o in offers if o[0] in inside),
                          key=lambda o: (-per_card[o[1]][0] * o[2], o[0], o[1]))
            take, cu, mem = [], 0, 0
            for name, m, room in mine:
                c_cu, c_mem = per_card[m][0], per_card[m][1]
                want = max(-(-(need_cu - cu) // c_cu), -(-(need_mem - mem) // c_mem) if need_mem > mem else 0)
                c = min(room, max(1, want))
                take.append((name, m, c))
                cu, mem = cu + c * c_cu, mem + c * c_mem
                if cu >= need_cu and mem >= need_mem:
                    break
            if cu >= need_cu and mem >= need_mem and len({m for _, m, _ in take}) > 1 and (
                    best is None or len(take) < len(best)):
                best = take
        if best is not None:
            taken_mem = sum(per_card[m][1] * c for _, m, c in best)
            parts = []
            for name, m, c in best:
                card_mem = min(per_card[m][1], -(-need_mem * per_card[m][1] // taken_mem)) if need_mem else 0
                parts.append(Part(name, _whole_cards(views[name], job, free_whole(views[name], job, m), c, card_mem),
                                  job.cpu_milli, job.memory_mib))
            parts_t = tuple(parts)
            mix: dict[str, int] = {}
            for _, m, c in best:
                mix[m] = mix.get(m, 0) + c
            return Placement(parts_t, (
                Reason(code="Placed", plugin="Gang", nodes=tuple(p.node for p in parts_t),
                       message="no one card model has room: low-tier gang over "
                               + " + ".join(f"{c} {m}" for m, c in sorted(mix.items()))
                               + f" in {len(parts_t)} part(s), all or nothing",
                       data={"cards": sum(mix.values()), "parts": len(parts_t), "mixed_models": len(mix),
                             "isolation": "exclusive", "isolation_asked": job.isolation_asked,
                             **{f"cards_{m}": c for m, c in sorted(mix.items())}}),
                _topology_reason(index, views, parts_t, best[0][1])))
    return None


def _free_at(index: NodeIndex | None, v: NodeView) -> dict[str, list[int]]:
    """Per model, when each card of the node that will be completely free is (0: now), sorted: one pass over the
    node's cards, kept per view (`NodeIndex.free_at_cache`; it depends on nothing else)."""
    entry = index.free_at_cache.get(v.node) if index is not None else None
    if entry is not None and entry[0] is v:
        return entry[1]
    free_at: dict[str, list[int]] = {}
    for c in v.card_free():
        if c.healthy and not c.mig and (c.milli == 1000 or c.release_ms is not None):
            free_at.setdefault(c.model, []).append(0 if c.milli == 1000 else c.release_ms)
    for times in free_at.values():
        times.sort()
    if index is not None:
        index.free_at_cache[v.node] = (v, free_at)
    return free_at


def _expected_free(views: dict[str, NodeView], job: JobRequested, order: list[str], nodes,
                   index: NodeIndex | None = None, shape: object | None = None) -> Reason | None:
    """What would free capacity: the earliest time one of these nodes is expected to have enough completely free
    cards of an allowed model for the job, from the stated durations of the work holding them. `nodes`: nodes whose
    filters pass the job (`_unschedulable`'s InsufficientGPU ones: only their cards are short), so none is asked
    again. `shape`: the job's key in `NodeIndex.why_cache`, where each node's earliest (time, model) is kept per
    view."""
    if job.isolation_asked == "mig":
        return None  # whole cards coming free are no MIG instance: nothing here says when one will be
    best: tuple[int, str, str] | None = None
    needed = [(m, cards_needed(job.compute_milli, job.gpu_memory_mib, m)) for m in order]  # the same for every node
    why_cache = index.why_cache if shape is not None and index is not None else None
    key = index.intern(("free", shape)) if why_cache is not None else None
    for name in nodes:
        v = views[name]
        known = None
        if why_cache is not None:
            entry = why_cache.get(name)  # _view_memo, read here: most nodes' answers are kept
            known = entry[1] if entry is not None and entry[0] is v else _view_memo(index, v)
        mine = known.get(key, False) if known is not None else False
        if mine is False:  # the node's earliest (time, model), or None
            mine = None
            free_at = _free_at(index, v)
            for m, n in needed:
                times = free_at.get(m, ())
                if len(times) >= n and (mine is None or (times[n - 1], m) < mine):
                    mine = (times[n - 1], m)
            if known is not None:
                known[key] = mine
        if mine is not None and (best is None or (mine[0], name, mine[1]) < best):
            best = (mine[0], name, mine[1])
    if best is None:
        return None
    at, name, m = best
    return Reason(code="ExpectedFree", plugin="Capacity", nodes=(name,), data={"at_ms": at, "model": m},
                  message=f"{name} is expected to have room for it at {at} ms (from running jobs' stated durations)"
                  if at else f"{name} has the {m} cards free now: what else it lacks is said above")


def _view_memo(index: NodeIndex, v: NodeView) -> dict:
    """What the explanation keeps of this exact view (`NodeIndex.why_cache`): answers by job shape."""
    entry = index.why_cache.get(v.node)
    if entry is None or entry[0] is not v:
        entry = index.why_cache[v.node] = (v, {})
    return entry[1]


EXPLAIN_LIMIT = 64  # nodes checked one by one to explain a failure; the rest are counted from the index
EXPLAIN_MEMO = True  # each node's answer kept per view (`_view_memo`); off: worked out every time (the tests' reference)


def _unschedulable(index: NodeIndex, views: dict[str, NodeView], job: JobRequested,
                   rejected: dict[tuple[str, str], list[str]], seen: set[str],
                   never: frozenset[str] = frozenset()) -> "Unschedulable":
    """Why no node fits. The nodes looked at say why; down nodes and up to EXPLAIN_LIMIT others are checked one by
    one; beyond that, nodes the index holds in no bucket that could take the job are counted as InsufficientGPU.
    What would free capacity (`_expected_free`) leaves out the card models in `never`: its quota would never admit
    it there, so cards of those coming free are no room for it."""
    order = allowed_models(index, job)
    # a node's answer is a function of its view and of what the filters and fit_cards read of the job: kept per view
    # (`NodeIndex.why_cache`) for a job without constraints, by its shape and the models tried -- each waiting victim
    # is explained once, against the same first EXPLAIN_LIMIT nodes, most of them unchanged since the last one
    shape = index.intern((job.compute_milli, job.gpu_memory_mib, job.cpu_milli, job.memory_mib, job.gang,
                          job.isolation_asked, tuple(order))) \
        if EXPLAIN_MEMO and job.constraints == _NO_CONSTRAINTS else None

    def check(name: str) -> None:
        seen.add(name)
        v = views[name]
        known = None
        if shape is not None:
            known = _view_memo(index, v)
            why = known.get(shape)
            if why is not None:
                rejected.setdefault(why, []).append(name)
                return
        why = _rejects(v, job)
        if why is None:
            fit = fit_cards(v, job, order)
            why = ("GpuFit", fit if isinstance(fit, str) else "InsufficientGPU")
        if known is not None:
            known[shape] = why
        rejected.setdefault(why, []).append(name)

    down = index.down
    for name in down:
        if name not in seen:
            check(name)
    limit = EXPLAIN_LIMIT + len(down)
    why_cache = index.why_cache
    for name in views:
        if len(seen) >= limit:
            break
        if name in seen:
            continue
        if shape is not None:  # check's answer kept with the node's view, read here: most of the nodes, each time
            entry = why_cache.get(name)
            if entry is not None and entry[0] is views[name]:
                why = entry[1].get(shape)
                if why is not None:
                    seen.add(name)
                    rejected.setdefault(why, []).append(name)
                    continue
        check(name)
    extra = len(views) - len(seen)
    if extra:
        rejected.setdefault(("GpuFit", "InsufficientGPU"), [])
    reasons = []
    for (plugin, code), ns in sorted(rejected.items()):
        count = len(ns) + (extra if (plugin, code) == ("GpuFit", "InsufficientGPU") else 0)
        reasons.append(Reason(code=code, plugin=plugin, nodes=tuple(ns[:20]), data={"count": count},
                              message=f"{count} node(s) rejected by {plugin}: {code}"))
    freeing = _expected_free(views, job, [m for m in order if m not in never] if never else order,
                             rejected.get(("GpuFit", "InsufficientGPU"), ()), index,
                             index.intern((shape, never)) if never and shape is not None else shape)
    if freeing is not None:
        reasons.append(freeing)
    return Unschedulable(tuple(reasons) or (Reason(code="NoNodes", message="the pool has no nodes"),))
