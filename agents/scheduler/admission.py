"""Admission against the fleet: a request no placement in the pool could ever satisfy is rejected at once, with the
reason (Slurm: "Requested node configuration is not available"), instead of waiting for ever.

"Could ever" is judged against every node's full inventory, whatever is in use: its cards (model, compute
capability, driver, CUDA), host CPU and memory, rack and data center. Nodes that are down, cordoned or have a faulty
card count as possible (they may come back); removed nodes do not. MIG layouts are not held against a request (an
operator can change them), but a request for a MIG slice (isolation mig) needs a card in MIG mode somewhere. The judgement follows placement's rules: a request that fits one card of an allowed model
on a node with the host CPU and memory; else, for a gang, the whole cards of one model it needs within its spread
(one node, one rack, one data center, anywhere, as `max_spread` / `interconnect` allow), host CPU and memory counted
per card as placement counts them; else, for an offline gang, cards of several models within the spread.

The fleet is kept as node kinds (inventories alike but for names and MIG layouts, with their count), so a verdict
costs one pass over the kinds and is cached per request shape until the fleet changes. While the fleet is still
growing (a node joined or changed within `settle_ms` of log time) a request that looks unsatisfiable waits instead:
the nodes that would take it may not have reported yet (docs/scheduler.md).

Pure: no I/O, no clock; time comes in as `now_ms`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from agents.scheduler import topology
from agents.scheduler.node_index import cards_needed
from agents.scheduler.placement import gpu_allowed, inventory_rejects
from schemas.events import JobRequested, NodeInventory, Reason, Tier
from schemas.gpu_models import model

PLUGIN = "Admission"
LEVELS = ("rack", "datacenter", "any")  # beyond one node, tightest first


def _kind(inv: NodeInventory) -> tuple:
    """What a node could ever host: its place, host resources and cards (NVLink domains by order within the node,
    so two nodes alike but for names are one kind)."""
    domains: dict[str | None, int] = {}
    cards = tuple(sorted((g.model, g.compute_capability, g.driver_version, g.cuda_version,
                          domains.setdefault(g.nvlink_domain, len(domains)) if g.nvlink_domain else -1, g.mig_enabled)
                         for g in inv.gpus))
    return (inv.datacenter, inv.rack, inv.cpu_milli, inv.memory_mib, cards)


@dataclass
class Fleet:
    kinds: dict[tuple, list] = field(default_factory=dict)  # kind -> [nodes of it, one of their inventories]
    of: dict[str, tuple] = field(default_factory=dict)  # node -> its kind
    grown_ms: int = -(1 << 62)  # when a node last joined or changed
    settle_ms: int = 10_000
    _verdicts: dict[tuple, tuple[Reason, ...] | None] = field(default_factory=dict)

    def update(self, node: str, inv: NodeInventory | None, now_ms: int) -> bool:
        """Keep `node` as its inventory says (None: gone from the pool, i.e. removed). True when the fleet lost
        capacity (a node left or changed): pending requests may have become unsatisfiable."""
        new = _kind(inv) if inv is not None else None
        old = self.of.get(node)
        if new == old:
            return False
        self._verdicts.clear()
        if old is not None:
            entry = self.kinds[old]
            entry[0] -= 1
            if not entry[0]:
                del self.kinds[old]
            del self.of[node]
        if new is not None:
            self.of[node] = new
            self.kinds.setdefault(new, [0, inv])[0] += 1
            self.grown_ms = now_ms
        return old is not None

    def settled(self, now_ms: int) -> bool:
        return bool(self.kinds) and now_ms - self.grown_ms >= self.settle_ms

    def never_fits(self, job: JobRequested) -> tuple[Reason, ...] | None:
        """Why no placement in this fleet could ever hold `job` (None: one could, or the pool is empty)."""
        if not self.kinds:
            return None
        key = (job.compute_milli, job.gpu_memory_mib, job.cpu_milli, job.memory_mib, job.gang,
               job.tier == Tier.OFFLINE, job.constraints, job.isolation_asked == "mig")
        if key not in self._verdicts:
            self._verdicts[key] = _never_fits(job, list(self.kinds.values()))
        return self._verdicts[key]


def _never_fits(job: JobRequested, kinds: list[list]) -> tuple[Reason, ...] | None:
    # most requests fit one card, or one node, of the first node kinds: said without reading every kind (the
    # verdict below says the same: None once a usable kind with the host room has a card that holds the job, or,
    # for a gang, the cards of one model it needs); a hardware slice is judged by the full reading
    for _, inv in kinds if job.isolation_asked != "mig" else ():
        if inv.cpu_milli < job.cpu_milli or inv.memory_mib < job.memory_mib:
            continue
        allowed = [g for g in inv.gpus if gpu_allowed(g, job)]
        if not allowed or inventory_rejects(inv, job) is not None:
            continue
        per_model: dict[str, int] = {}
        for g in allowed:
            m = model(g.model)
            if job.compute_milli <= m.cu_milli and job.gpu_memory_mib <= m.memory_mib:
                return None
            per_model[g.model] = per_model.get(g.model, 0) + 1
        if job.gang and any(2 <= cards_needed(job.compute_milli, job.gpu_memory_mib, name) <= n
                            for name, n in per_model.items()):
            return None
    return _verdict(job, kinds)


def _verdict(job: JobRequested, kinds: list[list]) -> tuple[Reason, ...] | None:
    """`_never_fits` from a reading of every kind (tests/test_admission_verdict.py holds the two equal)."""
    c = job.constraints
    rejected: dict[str, int] = {}
    usable: list[tuple[int, NodeInventory, list]] = []  # (nodes, inventory, its allowed cards)
    for count, inv in kinds:
        code = inventory_rejects(inv, job)
        allowed = [g for g in inv.gpus if gpu_allowed(g, job)] if code is None else []
        if code is None and not allowed:
            code = "NoAllowedCard"
        if code is not None:
            rejected[code] = rejected.get(code, 0) + count
            continue
        usable.append((count, inv, allowed))
    nodes = sum(k[0] for k in kinds)
    if usable and job.isolation_asked == "mig" and not any(g.mig_enabled for _, _, cards in usable for g in cards):
        # only a card in MIG mode gives a hardware slice (placement.fit_cards: NoMigCard); the pool has none
        return (Reason(code="NoMigCard", plugin=PLUGIN, data={"nodes": nodes}, message=(
            f"isolation mig asks for a MIG slice, and no card the request allows on the pool's {nodes} nodes is in "
            f"MIG mode (an operator enables MIG on an A100/H100/H200 and its node reports the layout)")),)
    if not usable:
        return (Reason(code="NoNodeMatches", plugin=PLUGIN, data={"nodes": nodes, **rejected}, message=(
            f"no node of the pool's {nodes} matches the constraints: "
            + ", ".join(f"{n} {code}" for code, n in sorted(rejected.items())))),)
    host = [(n, inv, cards) for n, inv, cards in usable
            if inv.cpu_milli >= job.cpu_milli and inv.memory_mib >= job.memory_mib]
    biggest = max((model(g.model) for _, _, cards in usable for g in cards),
                  key=lambda m: (m.cu_milli, m.memory_mib, m.name))
    def one_card(cards) -> bool:
        return any(job.compute_milli <= model(g.model).cu_milli and job.gpu_memory_mib <= model(g.model).memory_mib
                   for g in cards)

    if any(one_card(cards) for _, _, cards in host):
        return None  # one card holds it (a share, a MIG slice, the whole card)
    fits_one = any(one_card(cards) for _, _, cards in usable)  # by its cards, on a node without the host room
    if not job.gang:
        if fits_one:
            return (_host_reason(job, usable),)
        return (Reason(code="LargerThanAnyCard", plugin=PLUGIN, message=(
            f"{job.compute_milli} milli-CU with {job.gpu_memory_mib} MiB does not fit one card, and the job is not a "
            f"gang (gang: false); the largest allowed card: {biggest.name}, {biggest.cu_milli} milli-CU, "
            f"{biggest.memory_mib} MiB"), data={"request_milli": job.compute_milli,
                                                 "request_memory_mib": job.gpu_memory_mib,
                                                 "largest_card_milli": biggest.cu_milli,
                                                 "largest_card_memory_mib": biggest.memory_mib}),)
    limit = "nvlink" if c.interconnect == "nvlink" else c.max_spread
    levels = [lv for lv in LEVELS if topology.allowed(lv, limit)]
    models = sorted({g.model for _, _, cards in usable for g in cards})
    data: dict[str, int | str] = {"spread": limit}
    for name in models:
        need = cards_needed(job.compute_milli, job.gpu_memory_mib, name)
        cpu_part, mem_part = job.cpu_milli, job.memory_mib  # host CPU and memory are per part, as asked
        most = 0
        for _, inv, cards in host:  # one node: the whole request's host CPU and memory there
            most = max(most, sum(1 for g in cards if g.model == name))
        for level in levels:
            groups: dict[tuple, int] = {}
            for n, inv, cards in usable:
                k = _group(level, inv)
                groups[k] = groups.get(k, 0) + n * _room(inv, cards, name, cpu_part, mem_part)
            most = max(most, max(groups.values(), default=0))
        if need >= 2 and most >= need:
            return None
        data[f"cards_needed_{name}"] = need
        data[f"cards_at_most_{name}"] = most
    if job.tier == Tier.OFFLINE and len(models) > 1 and c.interconnect != "nvlink" and job.compute_milli:
        # a mixed-model gang (offline tier): cards of several models, on nodes with the host CPU and memory a part
        # asks (placement._mixed_gang)
        per_card = {}
        for name in models:
            m = model(name)
            per_card[name] = (m.cu_milli, m.memory_mib, job.cpu_milli, job.memory_mib)
        for level in levels:
            groups: dict[tuple, list[int]] = {}
            for n, inv, cards in usable:
                g = groups.setdefault(_group(level, inv), [0, 0])
                for name in {x.model for x in cards}:
                    cu, mem, cpu_part, mem_part = per_card[name]
                    room = _room(inv, cards, name, cpu_part, mem_part)
                    g[0] += n * room * cu
                    g[1] += n * room * mem
            if any(cu >= job.compute_milli and mem >= job.gpu_memory_mib for cu, mem in groups.values()):
                return None
    if fits_one:
        return (_host_reason(job, usable),)
    where = topology.WORDS[levels[-1]] if levels else "one node"
    return (Reason(code="GangTooLarge", plugin=PLUGIN, data=data, message=(
        f"{job.compute_milli} milli-CU with {job.gpu_memory_mib} MiB needs, within {where} (max_spread "
        f"{limit}), " + "; ".join(f"{data[f'cards_needed_{m}']} {m} cards (at most {data[f'cards_at_most_{m}']})"
                                 for m in models))),)


def _room(inv: NodeInventory, cards: list, name: str, cpu_part: int, mem_part: int) -> int:
    """Cards of this model one node could give a gang, none unless it has the host CPU and memory a part asks
    (placement.gang_room, on the inventory rather than on what is free)."""
    if inv.cpu_milli < cpu_part or inv.memory_mib < mem_part:
        return 0
    return sum(1 for g in cards if g.model == name)


def _group(level: str, inv: NodeInventory) -> tuple:
    return {"rack": (inv.datacenter, inv.rack), "datacenter": (inv.datacenter,), "any": ()}[level]


def _host_reason(job: JobRequested, usable: list) -> Reason:
    cpu = max(inv.cpu_milli for _, inv, _ in usable)
    mem = max(inv.memory_mib for _, inv, _ in usable)
    return Reason(code="HostResourcesNeverEnough", plugin=PLUGIN, message=(
        f"{job.cpu_milli} milli-CPU and {job.memory_mib} MiB of host memory on one node: the largest matching node "
        f"has {cpu} milli-CPU and {mem} MiB"), data={"request_cpu_milli": job.cpu_milli,
                                                     "request_memory_mib": job.memory_mib,
                                                     "largest_cpu_milli": cpu, "largest_memory_mib": mem})
