"""How the scheduler ranks the nodes that fit: card-model preference by kind of work, then fragmentation.

Model preference (seeds 000/002: heterogeneous pool, cost vs performance):
- latency-sensitive inference: the newest generation, then the most memory per card;
- other inference: the most memory per card, then the newest;
- training and batch: the fewest cards (one model, fewest parts to synchronise), then the oldest generation that
  does the job, so the newest cards stay free for latency-sensitive services.

Fragmentation is FGD's measure (Weng et al., ATC'23) with this project's CPU/host-memory cap (the `gpupool` policy of
the simulator's agents/sim/packing.py, evaluated in docs/evaluation.md): for each typical job type t of the workload,
the free GPU milli of a node that t could use -- on cards with at least t's share free, capped by how many t's the
node's free CPU and memory can still host -- and everything else counts as fragment; free GPUs behind CPU and memory
that no typical type fits any more count once more in full (lost to every later job, not only the next). Among fitting
nodes the one whose placement adds the least fragmentation wins. Types weigh their count times how scarce their hosts
are (see `Workload`), as in the offline policy. Typical types are learned from the requests the scheduler has seen
(most frequent shapes first). Integer arithmetic throughout.
"""
from __future__ import annotations

from bisect import bisect_left
from collections import Counter
from dataclasses import dataclass

from agents.scheduler.node_index import cards_needed
from schemas.events import JobRequested, Tier
from schemas.gpu_models import model, share_for

_BIG = 1 << 40
SCARCITY_SCALE = 1000


@dataclass(frozen=True)
class Shape:
    """One typical job type on one card model: share per card (milli), cards, CPU, host memory, weight."""
    milli: int
    cards: int
    cpu_milli: int
    memory_mib: int
    weight: int


def model_order(job: JobRequested, models: list[str]) -> list[str]:
    def key(name: str) -> tuple:
        m = model(name)
        if job.tier == Tier.INFERENCE:
            if job.latency_sensitive:
                return (-m.generation, -m.memory_mib, name)
            return (-m.memory_mib, -m.generation, name)
        cards = max(-(-job.compute_milli // m.cu_milli), -(-job.gpu_memory_mib // m.memory_mib))
        return (cards, m.generation, m.cu_milli, name)
    return sorted(models, key=key)


class Workload:
    """The shapes of the requests seen so far, and the typical set derived from them (refreshed as it grows).

    Each typical shape weighs its count times C / S (x 1000, integers): S is the cards on nodes whose inventory could
    host the shape (cards of one model, CPU, host memory), C all cards. A shape only a few nodes can host weighs in
    proportion to the demand those nodes see (the scarcity weights of `gpupool` in agents/sim/packing.py). The fleet
    comes from the node index (`fleet`); with none known, every shape gets the same multiplier."""

    def __init__(self, coverage_pct: int = 95, max_types: int = 12) -> None:
        self.counts: Counter = Counter()
        self.total = 0
        self.coverage_pct = coverage_pct
        self.max_types = max_types
        self._typical: tuple = ()
        self._typical_at = 0
        self._epoch = 0  # changes whenever the typical set or the fleet's hosts do
        self._fleet_version = -1
        self._hosts: Counter = Counter()  # (cards per model, CPU, memory) -> nodes with that inventory
        self._multiplier: dict[tuple, int] = {}
        self._per_model: dict[str, tuple[Shape, ...]] = {}
        self._frag: dict[tuple[str, str], tuple] = {}  # (node, card) -> (view, epoch, value)

    def fleet(self, index) -> None:
        """Take the hosts of this node index (a no-op while its inventories are unchanged)."""
        if index.hosts_version != self._fleet_version:
            self._fleet_version = index.hosts_version
            self._hosts = Counter(index.hosts.values())
            self._multiplier, self._per_model = {}, {}
            self._epoch += 1

    def multiplier(self, shape: tuple) -> int:
        got = self._multiplier.get(shape)
        if got is None:
            compute, gpu_mem, cpu, host = shape
            total = hosting = 0
            for (per_model, hcpu, hmem), n in self._hosts.items():
                cards = sum(c for _, c in per_model)
                total += cards * n
                if cpu <= hcpu and host <= hmem and any(
                        cards_needed(compute, gpu_mem, m) <= c for m, c in per_model):
                    hosting += cards * n
            got = self._multiplier[shape] = total * SCARCITY_SCALE // hosting if hosting else SCARCITY_SCALE
        return got

    @property
    def weight(self) -> int:
        self._refresh()
        return sum(n * self.multiplier(shape) for shape, n in self._typical)

    def version(self) -> int:
        """Which typical set and fleet are in force: results that depend on them are reused only while this is the
        same."""
        self._refresh()
        return self._epoch

    def cached(self, view, card: str, compute):
        """What a node's cards of one model look like before a placement (and their fragmentation), kept while the
        view object, the typical set and the fleet are the same ones (views are immutable: a changed node is a new
        object)."""
        self._refresh()
        key = (view.node, card)
        hit = self._frag.get(key)
        if hit is not None and hit[0] is view and hit[1] == self._epoch:
            return hit[2]
        value = compute()
        self._frag[key] = (view, self._epoch, value)
        return value

    def observe(self, r: JobRequested) -> None:
        self.counts[(r.compute_milli, r.gpu_memory_mib, r.cpu_milli, r.memory_mib)] += 1
        self.total += 1

    def _refresh(self) -> None:
        # Recomputed when the workload has grown by a quarter: cheap, and a function of the input alone.
        if self.total and (not self._typical_at or self.total * 4 >= self._typical_at * 5):
            out, covered = [], 0
            for shape, n in sorted(self.counts.items(), key=lambda kv: (-kv[1], kv[0])):
                if covered * 100 >= self.coverage_pct * self.total or len(out) >= self.max_types:
                    break
                out.append((shape, n))
                covered += n
            self._typical, self._typical_at, self._per_model = tuple(out), self.total, {}
            self._epoch += 1

    def shapes(self, model_name: str) -> tuple[Shape, ...]:
        self._refresh()
        got = self._per_model.get(model_name)
        if got is None:
            m = model(model_name)
            out = []
            for shape, n in self._typical:
                compute, mem, cpu, host = shape
                cards = max(-(-compute // m.cu_milli), -(-mem // m.memory_mib))
                milli = min(1000, share_for(compute, m)) if cards == 1 else 1000
                out.append(Shape(milli, cards, cpu, host, n * self.multiplier(shape)))
            got = self._per_model[model_name] = tuple(out)
        return got


def fragmentation(free: list[int], cpu: int, mem: int, shapes: tuple[Shape, ...]) -> int:
    """Weighted fragment (milli x weight) of one node's free cards of one model."""
    free = sorted(free)
    g = sum(free)
    below = [0]  # below[i]: free milli on the i smallest cards
    for f in free:
        below.append(below[-1] + f)
    total = 0
    host_fits = False
    for t in shapes:
        host = cpu >= t.cpu_milli and mem >= t.memory_mib
        host_fits = host_fits or host
        i = bisect_left(free, t.milli)  # cards from i on have at least the type's share free
        if len(free) - i >= t.cards and host:
            n = min(cpu // t.cpu_milli if t.cpu_milli else _BIG, mem // t.memory_mib if t.memory_mib else _BIG)
            total += t.weight * (g - min(g - below[i], n * t.cards * 1000))
        else:
            total += t.weight * g
    if shapes and not host_fits:
        # Stranded behind CPU/memory no typical job fits: lost to every later job, counted once more in full.
        total += sum(t.weight for t in shapes) * g
    return total
