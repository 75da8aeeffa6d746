"""Which nodes can still take what: buckets of schedulable nodes, kept current as views change.

Scanning 5,000 nodes for every job is what makes a naive scheduler slow. Each schedulable node sits in a few buckets:
per card model, one per exact free state (free compute milli, free memory MiB) of its healthy non-MIG cards that
have compute left, and one for the number of completely free cards; and whether it has a free MIG instance or MIG
room to create one. A job then looks only at buckets whose state holds it, tightest first (best fit), so every node
it is shown has a card with room; the exact checks (host CPU and memory, constraints, scoring) run on those few.

The share states present are kept per model in a sorted list (coarse tenths of a card, then the exact values), so
a lookup skips the states too small for the job without visiting their nodes. Free states are few in practice
(request shapes are discrete); a bucket that empties is dropped with its state.

Buckets are insertion-ordered dicts, never sets: iteration order must be a function of the input history so that a
replay makes the same choices (string hashing is salted per process).
"""
from __future__ import annotations

from bisect import bisect_left, insort
from dataclasses import dataclass, field
from typing import Iterator

from schemas.gpu_models import MIG_COMPUTE_SLICES, mig_profile, model
from streams.folds.node_view import NodeView

SHARE_BUCKETS = 11  # coarse tenths of a card (0..10) that order the share states: tightest tenth first


def _keys(v: NodeView) -> tuple:
    if v.removed:
        return ()  # out of the pool for good: not even among the down nodes explanations look at one by one
    if not v.schedulable:
        return (("down",),)
    keys: set[tuple] = set()
    whole: dict[str, int] = {}
    mig_free = False
    for g, c in zip(v.cards(), v.card_free()):  # card_free is one entry per card, in inventory order
        if not c.healthy:
            continue
        if c.mig:
            mig_free = mig_free or bool(c.free_instances)
            continue
        if c.milli > 0:
            keys.add(("share", c.model, c.milli, c.memory_mib))
            if c.milli == 1000 and c.memory_mib == g.memory_mib:
                whole[c.model] = whole.get(c.model, 0) + 1
    for name, n in whole.items():
        keys.add(("whole", name, n))
    keys.add(("host",))  # every schedulable node: where a CPU-only job may go
    keys = sorted(keys)
    if mig_free or any(c.mig_enabled and v.free_mig_slices(c) and _free_compute_slices(c) and
                       c.uuid not in v.unhealthy and c.uuid not in v.mig_pending for c in v.cards()):
        keys.append(("mig",))
    return tuple(keys)


def _free_compute_slices(card) -> int:
    """Compute slices of a MIG card no instance holds: without one, no instance can be carved (memory room or not)."""
    return MIG_COMPUTE_SLICES - sum(mig_profile(card.model, i.profile).compute_slices for i in card.mig_layout)


def _share_entry(model_name: str, milli: int, memory_mib: int) -> tuple[int, int, int, int]:
    """How a share state sorts: (tenths of compute, tenths of memory, milli, MiB) -- tightest first."""
    mem = model(model_name).memory_mib
    return (min(milli // 100, SHARE_BUCKETS - 1), min(memory_mib * 10 // mem, SHARE_BUCKETS - 1), milli, memory_mib)


INTERNED_MAX = 4096
CHANGES_KEPT = 16384  # NodeIndex.changes: a memo older than the window is made again from the whole fleet


class Interned:
    """A memo key standing for one tuple (`NodeIndex.intern`): hashed and compared by identity."""

    __slots__ = ("key",)

    def __init__(self, key: tuple):
        self.key = key

    def __repr__(self) -> str:
        return f"Interned({self.key!r})"


@dataclass
class NodeIndex:
    buckets: dict[tuple, dict[str, None]] = field(default_factory=dict)
    keys: dict[str, tuple] = field(default_factory=dict)
    models: dict[str, int] = field(default_factory=dict)  # model -> most cards of it on one node
    cu: dict[str, int] = field(default_factory=dict)  # node -> compute (milli-CU) of its healthy cards, if schedulable
    capacity_milli: int = 0  # the pool's schedulable compute
    _inventory: dict[str, object] = field(default_factory=dict)
    # model -> sorted share states present (see _share_entry); derived from `buckets`, rebuilt when None (an index
    # built from copied buckets gets it on first use)
    _shares: dict[str, list[tuple[int, int, int, int]]] | None = None
    # node -> (view, workload, typical-set version, {job shape: outcome}): what placement found on this exact view,
    # reused while the view object and the workload's typical set are the same (views are immutable)
    fit_cache: dict[str, tuple] = field(default_factory=dict)
    # node -> (view, {model: when each card that will be completely free is, sorted}): the explanation's ExpectedFree
    # (placement._expected_free) on this exact view
    free_at_cache: dict[str, tuple] = field(default_factory=dict)
    # node -> (view, {(job shape, models tried): why it does not take such a job}): the explanation's answer per
    # node (placement._unschedulable) on this exact view
    why_cache: dict[str, tuple] = field(default_factory=dict)
    # a job shape -> the one object that stands for it in the memos above (`intern`)
    _interned: dict[tuple, "Interned"] = field(default_factory=dict)
    _capacity_basis: dict[str, tuple] = field(default_factory=dict)  # node -> what its `cu` was computed from
    # node -> (cards per model, CPU, host memory) of its inventory: what it could ever host (scarcity weights)
    hosts: dict[str, tuple] = field(default_factory=dict)
    hosts_version: int = 0
    _with_model: tuple[int, dict[str, frozenset[str]]] = (-1, {})  # (hosts_version, model -> nodes with such cards)
    _view: dict[str, NodeView] = field(default_factory=dict)  # node -> the view `update` was last given
    # the nodes whose view `update` took, in order -- the last CHANGES_KEPT of them; changes_base: the position of
    # the first kept -- so a memo over the whole fleet is brought up to date by the nodes changed since it was made
    changes: list[str] = field(default_factory=list)
    changes_base: int = 0
    # (gang part's model, CPU, memory per part) -> (position in `changes`, {node: whole cards of the model one part
    # could take there}): placement._gang_avail's memo of every node that can give a gang part something
    gang_avail: dict[tuple, tuple[int, dict[str, int]]] = field(default_factory=dict)
    # the node views this index is kept in step with, view for view (`Holdings.nodes`: every view it holds was given
    # to `update`); a memo over the whole fleet is read only for these views, never for a trial's or a copy's
    views: object = None

    def intern(self, key: tuple) -> "Interned":
        """One object per distinct key, to key the per-view memos by: a nested tuple is hashed afresh at every look
        (tens of thousands per explanation run), an object by its identity. Past INTERNED_MAX keys the table starts
        again, and the index's memos with it; what other memos keep under an old object is never found again and
        goes with its view."""
        got = self._interned.get(key)
        if got is None:
            if len(self._interned) >= INTERNED_MAX:
                self._interned.clear()
                self.why_cache.clear()
                self.fit_cache.clear()
            got = self._interned[key] = Interned(key)
        return got

    def copy(self) -> "NodeIndex":
        """An independent copy (bucket dicts copied, order kept) that can be updated without touching this one."""
        return NodeIndex(buckets={k: dict(v) for k, v in self.buckets.items()}, keys=dict(self.keys),
                         models=dict(self.models), cu=dict(self.cu), capacity_milli=self.capacity_milli,
                         _inventory=dict(self._inventory), hosts=dict(self.hosts), hosts_version=self.hosts_version)

    def _capacity(self, v: NodeView) -> None:
        basis = (v.inventory, v.faults, v.cleared, v.schedulable)  # all a node's compute depends on
        seen = self._capacity_basis.get(v.node)
        if seen is not None and all(a is b for a, b in zip(seen[:3], basis)) and seen[3] == basis[3]:
            return  # the same objects: a placement or release changed only what is free
        self._capacity_basis[v.node] = basis
        cu = sum(model(c.model).cu_milli for c in v.cards() if c.uuid not in v.unhealthy) if v.schedulable else 0
        if cu == self.cu.get(v.node):
            return
        self.capacity_milli += cu - self.cu.get(v.node, 0)
        self.cu[v.node] = cu

    def update(self, v: NodeView) -> None:
        if self._view.get(v.node) is v:
            return  # the very view it was given last (a fold that changed nothing: a preemption command)
        self._view[v.node] = v
        changes = self.changes
        changes.append(v.node)
        if len(changes) > CHANGES_KEPT:
            del changes[:CHANGES_KEPT // 2]
            self.changes_base += CHANGES_KEPT // 2
        self.fit_cache.pop(v.node, None)
        self.free_at_cache.pop(v.node, None)
        self.why_cache.pop(v.node, None)
        self._capacity(v)
        new = _keys(v)
        old = self.keys.get(v.node)
        if old == new:
            return
        shares = self._shares
        for k in old or ():
            b = self.buckets.get(k)
            if b is None:
                continue
            b.pop(v.node, None)
            if not b and k[0] == "share":  # a state nobody has any more: dropped, so lookups never walk it
                del self.buckets[k]
                if shares is not None:
                    entries = shares[k[1]]
                    del entries[bisect_left(entries, _share_entry(k[1], k[2], k[3]))]
        for k in new:
            b = self.buckets.get(k)
            if b is None:
                b = self.buckets[k] = {}
            if not b and k[0] == "share" and shares is not None:
                insort(shares.setdefault(k[1], []), _share_entry(k[1], k[2], k[3]))
            b[v.node] = None
        self.keys[v.node] = new
        if v.removed:  # a removed node hosts nothing any more (re-added: its inventory is taken again)
            if v.node in self.hosts:
                del self.hosts[v.node]
                self.hosts_version += 1
            self._inventory.pop(v.node, None)
        elif self._inventory.get(v.node) is not v.inventory:  # only a new inventory changes what cards there are
            self._inventory[v.node] = v.inventory
            per_model: dict[str, int] = {}
            for c in v.cards():
                per_model[c.model] = per_model.get(c.model, 0) + 1
            for name, n in per_model.items():
                if n > self.models.get(name, 0):
                    self.models[name] = n
            host = (tuple(sorted(per_model.items())), v.inventory.cpu_milli, v.inventory.memory_mib) \
                if v.inventory is not None else None
            if host is not None and self.hosts.get(v.node) != host:
                self.hosts[v.node] = host
                self.hosts_version += 1

    def with_model(self, model_name: str) -> frozenset[str]:
        """The nodes whose inventory has cards of this model (removed nodes aside): a superset of the nodes with a
        healthy card of it, kept while no inventory changes."""
        v, got = self._with_model
        if v != self.hosts_version:
            got = {}
            for node, host in self.hosts.items():
                for name, _ in host[0]:
                    got.setdefault(name, set()).add(node)
            got = {name: frozenset(ns) for name, ns in got.items()}
            self._with_model = (self.hosts_version, got)
        return got.get(model_name, frozenset())

    def _share_states(self, model_name: str) -> list[tuple[int, int, int, int]]:
        if self._shares is None:
            shares: dict[str, list] = {}
            for k, nodes in self.buckets.items():
                if k[0] == "share" and nodes:
                    shares.setdefault(k[1], []).append(_share_entry(k[1], k[2], k[3]))
            for entries in shares.values():
                entries.sort()
            self._shares = shares
        return self._shares.get(model_name, ())

    @property
    def down(self) -> dict[str, None]:
        return self.buckets.get(("down",), {})

    def share_nodes(self, model_name: str, need_milli: int, need_memory_mib: int) -> Iterator[str]:
        """Nodes with a healthy non-MIG card of this model that has at least `need_milli` and `need_memory_mib`
        free, tightest first (by tenths of a card, compute then memory, then exact free compute and memory)."""
        entries = self._share_states(model_name)
        start = bisect_left(entries, (min(need_milli // 100, SHARE_BUCKETS - 1),))
        for _b, _bm, milli, mem in entries[start:]:
            if milli >= need_milli and mem >= need_memory_mib:
                yield from self.buckets[("share", model_name, milli, mem)]

    def whole_nodes_spread(self, model_name: str, cards: int) -> Iterator[str]:
        """Nodes with at least `cards` completely free cards of this model: one of each count of free cards in turn
        (fewest first), so a bounded sample sees the tight nodes and the whole ones alike."""
        its = [iter(self.buckets[key]) for key in (("whole", model_name, k)
                                                   for k in range(cards, self.models.get(model_name, 0) + 1))
               if key in self.buckets]
        while its:
            alive = []
            for it in its:
                n = next(it, None)
                if n is not None:
                    yield n
                    alive.append(it)
            its = alive

    def changed_since(self, position: int) -> list[str] | None:
        """The nodes whose view changed since `position` (a value of `position_now`), oldest first, repeats
        included; None when the window no longer reaches back that far."""
        if position < self.changes_base:
            return None
        return self.changes[position - self.changes_base:]

    @property
    def position_now(self) -> int:
        return self.changes_base + len(self.changes)

    def whole_cards(self, node: str, model_name: str) -> int:
        """How many completely free cards of this model the node has (0 when it is in no such bucket)."""
        for k in self.keys.get(node, ()):
            if k[0] == "whole" and k[1] == model_name:
                return k[2]
        return 0

    def whole_free(self, model_name: str) -> Iterator[tuple[str, int]]:
        """(node, completely free cards of this model) for every node that has any."""
        for k in range(1, self.models.get(model_name, 0) + 1):
            for n in self.buckets.get(("whole", model_name, k), ()):
                yield n, k

    def mig_nodes(self) -> Iterator[str]:
        yield from self.buckets.get(("mig",), ())

    def host_nodes(self) -> Iterator[str]:
        """Every schedulable node, in the order their views last changed (a CPU-only job's candidates)."""
        yield from self.buckets.get(("host",), ())


def cards_needed(compute_milli: int, gpu_memory_mib: int, model_name: str) -> int:
    m = model(model_name)
    return max(-(-compute_milli // m.cu_milli), -(-gpu_memory_mib // m.memory_mib))
