"""Where a job fits: filter plugins that each say why a node is rejected, then a choice of cards.

Pure: reads a snapshot of node views, returns a Placement or the reasons there is none.
"""
from __future__ import annotations

from dataclasses import dataclass

from schemas.events import Assignment, JobRequested, Reason
from schemas.gpu_models import mig_profile, mig_share_milli, model, share_for, version_tuple
from streams.node_view import CardFree, NodeView


@dataclass(frozen=True)
class Placement:
    node: str
    assignments: tuple[Assignment, ...]
    reasons: tuple[Reason, ...]


@dataclass(frozen=True)
class Unschedulable:
    reasons: tuple[Reason, ...]


# ---------------------------------------------------------------- filters: (node, job) -> None | reason code

def _f_schedulable(v: NodeView, job: JobRequested) -> str | None:
    if v.inventory is None:
        return "NoInventory"
    if not v.alive:
        return "NodeNotReady"
    if v.cordoned:
        return "NodeCordoned"
    return None


def _f_constraints(v: NodeView, job: JobRequested) -> str | None:
    c = job.constraints
    inv = v.inventory
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
    gpu = next(g for g in v.cards() if g.uuid == card.uuid)
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


def fit_cards(v: NodeView, job: JobRequested) -> tuple[Assignment, ...] | str:
    """Cards for `job` on node `v`, or the reason code why none fit.

    One card when the request fits one card (a MIG instance, else a software share, best fit first); otherwise whole
    cards of one model, as few as the compute and memory need.
    """
    if not _may_fit(v, job):
        return "InsufficientGPU"
    cards = [c for c in v.card_free() if _card_allowed(c, job, v)]
    if not cards:
        return "NoAllowedHealthyGPU"
    share_fits: list[tuple[int, int, str, Assignment]] = []
    for c in cards:
        m = model(c.model)
        if c.mig:
            if not job.constraints.mig_allowed:
                continue
            for inst in sorted(c.free_instances, key=lambda i: (i.size, i.start)):
                p = mig_profile(c.model, inst.profile)
                if p.compute_slices * m.cu_milli // 7 >= job.compute_milli and p.memory_mib >= job.gpu_memory_mib:
                    share_fits.append((mig_share_milli(p), p.memory_mib, c.uuid,
                                       Assignment(gpu_uuid=c.uuid, milli=mig_share_milli(p), memory_mib=p.memory_mib,
                                                  mig_profile=p.name, mig_uuid=inst.uuid)))
                    break
            continue
        if job.compute_milli <= m.cu_milli and job.gpu_memory_mib <= m.memory_mib:
            need = share_for(job.compute_milli, m)
            if c.milli >= need and c.memory_mib >= job.gpu_memory_mib:
                # best fit: the card left with the least free compute after this job
                share_fits.append((c.milli - need, c.memory_mib - job.gpu_memory_mib, c.uuid,
                                   Assignment(gpu_uuid=c.uuid, milli=need, memory_mib=job.gpu_memory_mib)))
    if share_fits:
        share_fits.sort(key=lambda t: (t[0], t[1], t[2]))
        return (share_fits[0][3],)
    # whole cards: group the completely free ones by model, take the model needing the fewest cards
    by_model: dict[str, list[CardFree]] = {}
    for c in cards:
        m = model(c.model)
        if not c.mig and c.milli == 1000 and c.memory_mib == m.memory_mib:
            by_model.setdefault(c.model, []).append(c)
    best: tuple[int, str] | None = None
    for name, free in sorted(by_model.items()):
        m = model(name)
        n = max(-(-job.compute_milli // m.cu_milli), -(-job.gpu_memory_mib // m.memory_mib))
        if n > 1 and not job.gang:
            continue
        if len(free) >= n and (best is None or n < best[0]):
            best = (n, name)
    if best is None:
        return "InsufficientGPU"
    n, name = best
    free = by_model[name][:n]
    per_card_mem = -(-job.gpu_memory_mib // n)
    return tuple(Assignment(gpu_uuid=c.uuid, milli=1000, memory_mib=per_card_mem) for c in free)


def place(nodes: list[NodeView], job: JobRequested) -> Placement | Unschedulable:
    """First fit over the nodes in the given order; every rejection is recorded by plugin and node."""
    rejected: dict[tuple[str, str], list[str]] = {}
    for v in nodes:
        why = None
        for plugin, f in FILTERS:
            code = f(v, job)
            if code:
                why = (plugin, code)
                break
        if why is None:
            fit = fit_cards(v, job)
            if isinstance(fit, str):
                why = ("GpuFit", fit)
            else:
                shape = "MIG " + fit[0].mig_profile if fit[0].mig_profile else (
                    f"{fit[0].milli} milli-GPU share" if len(fit) == 1 and fit[0].milli < 1000
                    else f"{len(fit)} whole card(s)")
                return Placement(v.node, fit, (Reason(code="Placed", plugin="GpuFit", nodes=(v.node,),
                                                      message=f"first node that fits; {shape}"),))
        rejected.setdefault(why, []).append(v.node)
    reasons = tuple(Reason(code=code, plugin=plugin, nodes=tuple(ns[:20]), data={"count": len(ns)},
                           message=f"{len(ns)} node(s) rejected by {plugin}: {code}")
                    for (plugin, code), ns in sorted(rejected.items()))
    return Unschedulable(reasons or (Reason(code="NoNodes", message="the pool has no nodes"),))
