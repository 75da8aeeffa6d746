"""Cluster-wide metrics over node views. Pure.

Fragmentation is FGD's measure (Weng et al., ATC'23): for each node, the free GPU milli that the workload's typical
pods could not use, weighted by how often each type occurs; the cluster's fragmentation is the sum over nodes, and the
fragmentation ratio is that sum over all free GPU milli. The typical pods come from the workload itself (the job
requests the pool has seen), expressed on each card's own scale.
"""
from __future__ import annotations

from collections import Counter
from typing import Iterable

from streams.folds.fgd_measure import TypicalPod, fragmentation
from schemas.events import JobRequested
from schemas.gpu_models import model, share_for
from streams.folds.node_view import NodeView


def typical_from_requests(requests: Iterable[JobRequested], coverage_pct: int = 95) -> tuple[TypicalPod, ...]:
    """FGD's typical-pod set from job requests: (CPU, milli-GPU on a reference A100, cards) types, most frequent first,
    until they cover `coverage_pct` of the requests."""
    ref = model("A100-80GB")
    counts: Counter = Counter()
    for r in requests:
        cards = max(-(-r.compute_milli // ref.cu_milli), -(-r.gpu_memory_mib // ref.memory_mib))
        milli = share_for(r.compute_milli, ref) if cards == 1 else 1000
        counts[(r.cpu_milli, min(milli, 1000), cards, tuple(sorted(r.constraints.models)))] += 1
    total = sum(counts.values())
    out, covered = [], 0
    for (cpu, milli, cards, models), n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
        if covered * 100 >= coverage_pct * total:
            break
        out.append(TypicalPod(cpu, milli, cards, frozenset(models) or None, n))
        covered += n
    return tuple(out)


def metrics(views: Iterable[NodeView], typical: tuple[TypicalPod, ...] = ()) -> dict:
    """Integer metrics: milli-GPU, cards, permille ratios."""
    views = sorted(views, key=lambda v: v.node)
    capacity = allocated = free_total = frag = 0
    cards = unhealthy = 0
    unschedulable: list[str] = []
    free_by: dict[str, Counter] = {"model": Counter(), "rack": Counter(), "datacenter": Counter()}
    whole_free_by_model: Counter = Counter()
    frag_by: dict[str, Counter] = {}  # the node's card model -> data center -> fragmented milli
    for v in views:
        if v.inventory is None or v.removed:
            continue  # a removed node's capacity left the pool for good (the scheduler's, docs/scheduler.md)
        if not v.schedulable:
            unschedulable.append(v.node)
        node_free: list[int] = []
        for c in v.card_free():
            cards += 1
            capacity += 1000
            allocated += 1000 - c.milli  # on a MIG card, capacity outside a free instance counts as allocated
            if not c.healthy:
                unhealthy += 1
                continue
            if not v.schedulable:
                continue
            node_free.append(c.milli)
            free_total += c.milli
            free_by["model"][c.model] += c.milli
            free_by["rack"][v.inventory.rack] += c.milli
            free_by["datacenter"][v.inventory.datacenter] += c.milli
            if not c.mig and c.milli == 1000 and c.memory_mib == model(c.model).memory_mib:
                whole_free_by_model[c.model] += 1
        if node_free and typical:
            cpu, mem = v.free_cpu_memory()
            f = fragmentation(node_free, max(cpu, 0), max(mem, 0), typical, v.inventory.gpus[0].model)
            frag += f
            frag_by.setdefault(v.inventory.gpus[0].model, Counter())[v.inventory.datacenter] += f
    return {
        "nodes": sum(1 for v in views if not v.removed),
        "cards": cards, "unhealthy_cards": unhealthy, "unschedulable_nodes": unschedulable,
        "capacity_milli": capacity, "allocated_milli": allocated,
        "allocation_permille": allocated * 1000 // capacity if capacity else 0,
        "free_milli": free_total, "fragmentation_milli": frag,
        "fragmentation_permille": frag * 1000 // free_total if free_total else 0,
        "fragmentation_milli_by_model_datacenter": {m: dict(sorted(c.items())) for m, c in sorted(frag_by.items())},
        "free_milli_by_model": dict(sorted(free_by["model"].items())),
        "free_milli_by_rack": dict(sorted(free_by["rack"].items())),
        "free_milli_by_datacenter": dict(sorted(free_by["datacenter"].items())),
        "whole_free_cards_by_model": dict(sorted(whole_free_by_model.items())),
        "typical_pod_types": len(typical),
    }
