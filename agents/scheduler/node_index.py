"""Which nodes can still take what: buckets of schedulable nodes, kept current as views change.

Scanning 5,000 nodes for every job is what makes a naive scheduler slow. Each schedulable node sits in a few buckets:
per card model, the free compute and free memory of each card (both in tenths of a card) and the number of completely
free cards; and whether it has a free MIG instance or MIG room to create one. A job then looks only at buckets that can hold it,
tightest first (best fit), and the exact checks run on those few nodes.

Buckets are insertion-ordered dicts, never sets: iteration order must be a function of the input history so that a
replay makes the same choices (string hashing is salted per process).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator

from schemas.gpu_models import model
from streams.node_view import NodeView

SHARE_BUCKETS = 11  # largest free milli on one card // 100: 0..10


def _keys(v: NodeView) -> tuple:
    if not v.schedulable:
        return (("down",),)
    keys: set[tuple] = set()
    s = v.fit_summary
    for c in v.card_free():
        if c.healthy and not c.mig and c.milli > 0:
            keys.add(("share", c.model, c.milli // 100, c.memory_mib * 10 // model(c.model).memory_mib))
    for name, (_milli, _mem, whole) in s.by_model.items():
        if whole > 0:
            keys.add(("whole", name, whole))
    keys = sorted(keys)
    if s.mig_free or any(c.mig_enabled and v.free_mig_slices(c) and c.uuid not in v.unhealthy and
                         c.uuid not in v.mig_pending for c in v.cards()):
        keys.append(("mig",))
    return tuple(keys)


@dataclass
class NodeIndex:
    buckets: dict[tuple, dict[str, None]] = field(default_factory=dict)
    keys: dict[str, tuple] = field(default_factory=dict)
    models: dict[str, int] = field(default_factory=dict)  # model -> most cards of it on one node
    cu: dict[str, int] = field(default_factory=dict)  # node -> compute (milli-CU) of its healthy cards, if schedulable
    capacity_milli: int = 0  # the pool's schedulable compute
    _inventory: dict[str, object] = field(default_factory=dict)

    def _capacity(self, v: NodeView) -> None:
        cu = sum(model(c.model).cu_milli for c in v.cards() if c.uuid not in v.unhealthy) if v.schedulable else 0
        if cu == self.cu.get(v.node):
            return
        self.capacity_milli += cu - self.cu.get(v.node, 0)
        self.cu[v.node] = cu

    def update(self, v: NodeView) -> None:
        self._capacity(v)
        new = _keys(v)
        old = self.keys.get(v.node)
        if old == new:
            return
        for k in old or ():
            self.buckets[k].pop(v.node, None)
        for k in new:
            self.buckets.setdefault(k, {})[v.node] = None
        self.keys[v.node] = new
        if self._inventory.get(v.node) is not v.inventory:  # only a new inventory changes what cards there are
            self._inventory[v.node] = v.inventory
            per_model: dict[str, int] = {}
            for c in v.cards():
                per_model[c.model] = per_model.get(c.model, 0) + 1
            for name, n in per_model.items():
                if n > self.models.get(name, 0):
                    self.models[name] = n

    @property
    def down(self) -> dict[str, None]:
        return self.buckets.get(("down",), {})

    def share_nodes(self, model_name: str, need_milli: int, need_memory_mib: int) -> Iterator[str]:
        """Nodes with a card of this model that has at least roughly `need_milli` and `need_memory_mib` free (in
        tenths of a card, both), tightest first."""
        # Buckets whose every card has room come first, tightest first; the two boundary rows (cards that may
        # or may not have room) last -- walking them first visits many nearly full cards that do not fit.
        mem = model(model_name).memory_mib
        b0 = min(need_milli // 100, SHARE_BUCKETS - 1)
        m0 = min(need_memory_mib * 10 // mem, SHARE_BUCKETS - 1)
        sure_b = b0 if need_milli % 100 == 0 else b0 + 1
        sure_m = m0 if (need_memory_mib * 10) % mem == 0 else m0 + 1
        for b in range(sure_b, SHARE_BUCKETS):
            for bm in range(sure_m, SHARE_BUCKETS):
                yield from self.buckets.get(("share", model_name, b, bm), ())
        for b in range(b0, SHARE_BUCKETS):
            for bm in range(m0, SHARE_BUCKETS):
                if b < sure_b or bm < sure_m:
                    yield from self.buckets.get(("share", model_name, b, bm), ())

    def whole_nodes(self, model_name: str, cards: int) -> Iterator[str]:
        """Nodes with at least `cards` completely free cards of this model, fewest spare first."""
        for k in range(cards, self.models.get(model_name, 0) + 1):
            yield from self.buckets.get(("whole", model_name, k), ())

    def whole_free(self, model_name: str) -> Iterator[tuple[str, int]]:
        """(node, completely free cards of this model) for every node that has any."""
        for k in range(1, self.models.get(model_name, 0) + 1):
            for n in self.buckets.get(("whole", model_name, k), ()):
                yield n, k

    def mig_nodes(self) -> Iterator[str]:
        yield from self.buckets.get(("mig",), ())


def cards_needed(compute_milli: int, gpu_memory_mib: int, model_name: str) -> int:
    m = model(model_name)
    return max(-(-compute_milli // m.cu_milli), -(-gpu_memory_mib // m.memory_mib))
