"""How the scheduler ranks the nodes that fit: card-model preference by kind of work, then fragmentation.

Model preference (seeds 000/002: heterogeneous pool, cost vs performance):
- latency-sensitive inference: the newest generation, then the most memory per card;
- other inference: the most memory per card, then the newest;
- training and batch: the fewest cards (one model, fewest parts to synchronise), then the oldest generation that
  does the job, so the newest cards stay free for latency-sensitive services.

Fragmentation is FGD's measure (Weng et al., ATC'23) with this project's CPU/host-memory cap (the FGD protocol of
docs/evaluation.md replays this very code through `Scheduler`, agents/sim/live_protocol.py): for each typical job
type t of the workload, the free GPU milli of a node that t could use -- on cards with at least t's share free,
capped by how many t's the node's free CPU and memory can still host -- and everything else counts as fragment; free GPUs behind CPU and memory
that no typical type fits any more count once more in full (lost to every later job, not only the next). Among fitting
nodes the one whose placement adds the least fragmentation wins. Types weigh their count times how scarce their hosts
are (see `Workload`). Typical types are learned from the requests the scheduler has seen: a type is a request's
compute, GPU memory and CPU, with the median host memory of its requests (FGD's typical type is its CPU and GPU
request); the most frequent types up to 99 % of the requests (at most 64), then the types that hold most of the GPU
demand, so a rare many-card type is one of them. A CPU-only type (no card) counts every free card as a fragment,
as FGD counts a type that cannot use the node's GPUs. A many-card shape whose hosts the many-card demand
oversubscribes (twice their share of the cards or more)
weighs its cards per job too: there a host card another job breaks is a card of many-card demand with nowhere else to
go. Integer arithmetic throughout.
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
DEMAND_PRESSURE_INV = 10  # a shape joins by GPU demand where that demand is >= 1/10 of its hosts' cards
OVERSUBSCRIBED = 2  # a many-card shape weighs its cards too where the many-card demand on its hosts is >= 2x theirs


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
    proportion to the demand those nodes see (scarcity weights). The fleet
    comes from the node index (`fleet`); with none known, every shape gets the same multiplier."""

    def __init__(self, coverage_pct: int = 99, max_types: int = 64) -> None:
        self.counts: Counter = Counter()
        self.total = 0
        self.coverage_pct = coverage_pct
        self.max_types = max_types
        self._typical: tuple = ()
        self._oversubscribed: dict[tuple, int] = {}  # shape -> its fewest cards per job
        self._typical_at = 0
        self._epoch = 0  # changes whenever the weighed typical shapes do (a new typical set, new host weights)
        self._signature: tuple = ()  # the weighed typical shapes of this epoch
        self._fleet_version = -1
        self._hosts: Counter = Counter()  # (cards per model, CPU, memory) -> nodes with that inventory
        self._multiplier: dict[tuple, int] = {}
        self._host_memo: dict[tuple, dict] = {}  # shape -> `_host_cards`, for the current hosts
        self._total: int | None = None  # `_total_cards`, for the current hosts
        self._per_model: dict[str, tuple[Shape, ...]] = {}
        self._frag: dict[tuple[str, str], tuple] = {}  # (node, card) -> (view, epoch, value)
        # (compute, GPU memory, CPU) -> Counter of the host memory its requests asked: a type's host memory is their
        # median (FGD's typical type is its CPU and GPU request; host memory only caps how many fit a host)
        self._host_memory: dict[tuple, Counter] = {}

    def fleet(self, index) -> None:
        """Take the hosts of this node index (a no-op while its inventories are unchanged)."""
        if index.hosts_version != self._fleet_version:
            self._fleet_version = index.hosts_version
            self._hosts = Counter(index.hosts.values())
            self._multiplier, self._per_model, self._host_memo, self._total = {}, {}, {}, None
            self._typical_at = 0  # which shapes join by demand depends on the hosts: the set is worked out again

    def _host_cards(self, shape: tuple) -> dict:
        """Per inventory that could host the shape: the cards of all its nodes. Kept per shape while the hosts are
        the same (`fleet` clears it); the cards a shape needs are worked out once per card model."""
        got = self._host_memo.get(shape)
        if got is None:
            compute, gpu_mem, cpu, host = shape
            need: dict[str, int] = {}
            got = {}
            for inv, n in self._hosts.items():
                per_model, inv_cpu, inv_mem = inv
                if cpu <= inv_cpu and host <= inv_mem:
                    for m, c in per_model:
                        k = need.get(m)
                        if k is None:
                            k = need[m] = cards_needed(compute, gpu_mem, m)
                        if k <= c:
                            got[inv] = sum(c for _, c in per_model) * n
                            break
            self._host_memo[shape] = got
        return got

    def _hosting(self, shape: tuple) -> int:
        """Cards on nodes whose inventory could host the shape."""
        return sum(self._host_cards(shape).values())

    def _cards(self, shape: tuple) -> int:
        """The fewest cards the shape takes on a card model of its hosts that fits it (0: no host)."""
        compute, gpu_mem, _, _ = shape
        need = {m: cards_needed(compute, gpu_mem, m) for inv in self._host_cards(shape) for m, _ in inv[0]}
        return min((need[m] for inv in self._host_cards(shape) for m, c in inv[0] if need[m] <= c), default=0)

    def _total_cards(self) -> int:
        """All cards of the fleet's hosts (kept while the hosts are the same)."""
        if self._total is None:
            self._total = sum(sum(c for _, c in per_model) * n for (per_model, _, _), n in self._hosts.items())
        return self._total

    def _oversubscribed_of(self, typical: list, demand: int) -> dict:
        """The many-card typical shapes whose hosts the many-card demand oversubscribes OVERSUBSCRIBED times or more.
        Each many-card shape u spreads its demand d_u (count x compute) evenly over its hosts' cards (S_u); the load
        on t's hosts is sum_u d_u x (cards hosting both) / S_u, and t is oversubscribed when load / D >= 2 x S_t / C
        (D the demand of all requests, C all cards): its hosts would see at least twice their share of the demand
        from many-card jobs alone, so keeping them whole is worth a job of t's cards, not one job's count."""
        if not self._hosts or not demand:
            return {}
        many = [(shape, n * shape[0], self._host_cards(shape)) for shape, n in typical if self._cards(shape) >= 2]
        total = self._total_cards()
        out = {}
        for shape, _, hosts_t in many:
            s_t = sum(hosts_t.values())
            # load = sum_u d_u * shared_u / S_u; compared exactly over the common denominator prod_u S_u.
            den, num = 1, 0
            for _, d_u, hosts_u in many:
                s_u = sum(hosts_u.values())
                shared = sum(c for inv, c in hosts_u.items() if inv in hosts_t)
                num, den = num * s_u + d_u * shared * den, den * s_u
            if num * total >= OVERSUBSCRIBED * demand * s_t * den:
                out[shape] = self._cards(shape)
        return out

    def multiplier(self, shape: tuple) -> int:
        got = self._multiplier.get(shape)
        if got is None:
            total = self._total_cards()
            hosting = self._hosting(shape)
            got = self._multiplier[shape] = total * SCARCITY_SCALE // hosting if hosting else SCARCITY_SCALE
        return got

    @property
    def weight(self) -> int:
        self._refresh()
        return sum(n * self.multiplier(shape) * self._oversubscribed.get(shape, 1) for shape, n in self._typical)

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
        key = (r.compute_milli, r.gpu_memory_mib, r.cpu_milli)
        self.counts[key] += 1
        got = self._host_memory.get(key)
        if got is None:
            got = self._host_memory[key] = Counter()
        got[r.memory_mib] += 1
        self.total += 1

    def _shape_of(self, key: tuple, n: int) -> tuple:
        """A type's shape: its (compute, GPU memory, CPU) and the (lower) median of its requests' host memory."""
        seen = 0
        for mem, c in sorted(self._host_memory[key].items()):
            seen += c
            if seen * 2 >= n:
                return (*key, mem)
        raise AssertionError("a type's host-memory counts add up to its count")

    def _refresh(self) -> None:
        # Recomputed when the workload has grown by a quarter: cheap, and a function of the input alone.
        if self.total and (not self._typical_at or self.total * 4 >= self._typical_at * 5):
            out, covered = [], 0
            counts = {self._shape_of(k, n): n for k, n in self.counts.items()}
            for shape, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
                if covered * 100 >= self.coverage_pct * self.total or len(out) >= self.max_types:
                    break
                out.append((shape, n))
                covered += n
            # Then the shapes that hold the GPU demand (count x compute, largest first) up to the same coverage: a
            # rare 8-card shape is few requests but many cards, and without it nothing keeps 8-card nodes whole.
            # Only where that demand is at least a tenth of the cards that could host the shape (multiplier = C / S
            # x 1000): d / D >= S / C / 10. Hosts with room to spare are not worth keeping whole for it.
            have, added = {shape for shape, _ in out}, 0
            demand = sum(n * shape[0] for shape, n in counts.items())
            covered = 0
            for shape, n in sorted(counts.items(), key=lambda kv: (-kv[1] * kv[0][0], kv[0])):
                if covered * 100 >= self.coverage_pct * demand or added >= self.max_types or not shape[0]:
                    break
                covered += n * shape[0]
                if shape not in have and self._hosts and self._hosting(shape) and \
                        n * shape[0] * self.multiplier(shape) * DEMAND_PRESSURE_INV >= demand * SCARCITY_SCALE:
                    out.append((shape, n))
                    added += 1
            self._oversubscribed = self._oversubscribed_of(out, demand)
            self._typical, self._typical_at, self._per_model = tuple(out), self.total, {}
            # What the weighed shapes are: results kept under the epoch stay valid while it is the same. A changed
            # inventory (a node added, a host's CPU taken by other work) most often leaves every weight as it was.
            signature = tuple((shape, n * self.multiplier(shape) * self._oversubscribed.get(shape, 1))
                              for shape, n in self._typical)
            if signature != self._signature:
                self._signature = signature
                self._epoch += 1

    def shapes(self, model_name: str) -> tuple[Shape, ...]:
        self._refresh()
        got = self._per_model.get(model_name)
        if got is None:
            m = model(model_name)
            out = []
            for shape, n in self._typical:
                compute, mem, cpu, host = shape
                cards = max(-(-compute // m.cu_milli), -(-mem // m.memory_mib))  # 0: a CPU-only job
                milli = min(1000, share_for(compute, m)) if cards == 1 else 1000
                weight = n * self.multiplier(shape) * (cards if shape in self._oversubscribed else 1)
                out.append(Shape(milli, cards, cpu, host, weight))
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
        host_fits = host_fits or (host and t.cards > 0)  # a CPU-only type on the host does not use its cards
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
