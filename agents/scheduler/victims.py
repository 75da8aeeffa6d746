"""Which nodes hold work that could be stopped for a waiting job, kept current as node views change.

A preemption search used to ask every node, for every waiting job, who on it may be stopped (a walk over every
allocation of 5,000 nodes). The index keeps, per node, the tier rank, tenant and borrowed flag of each job it holds
(reservation holds aside: never victims), and across nodes which nodes hold work of each tier rank and borrowed
work of each tenant. A search then visits only the nodes that hold lower-tier work or (for a job within its own
quota) another tenant's borrowed work, in the scheduler's node order, so the plans and their tie-breaks are the ones
the walk over every node gave. Who exactly may be stopped (state, protection) is still decided per node by the caller:
the index is a superset, never a guess.

It is synced lazily: the scheduler marks a node when its view changes, and the marked nodes are re-read from their
views before a search (by then every placement has its command and borrowed flag on record). A node's entry is a
function of its view object and of facts fixed while that view stands (a job's tier and tenant; the borrowed flag of
the placement the view holds), so re-reading only the views that changed gives the index a rebuild would give
(`rebuilt` is that rebuild; the tests hold the two equal).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator

from schemas.events import TIER_RANK

Entry = tuple[int, str, bool]  # (tier rank, tenant, borrowed)


def entries(view, jobs) -> dict[str, Entry]:
    """What the index holds for one view: every job on it that is not a reservation hold."""
    out: dict[str, Entry] = {}
    for j in view.allocations:
        rec = jobs.get(j)
        if rec is None or rec.hold is not None:
            continue
        r = rec.request
        # A placement not on record yet counts as borrowed: a superset, the caller decides exactly.
        out[j] = (TIER_RANK[r.tier], r.tenant, rec.placement.borrowed if rec.placement is not None else True)
    return out


@dataclass
class VictimIndex:
    pos: dict[str, int] = field(default_factory=dict)  # node -> place in the scheduler's node order
    dirty: dict[str, None] = field(default_factory=dict)  # nodes whose view changed since the last sync
    seen: dict[str, object] = field(default_factory=dict)  # node -> the view object last read
    held: dict[str, dict[str, Entry]] = field(default_factory=dict)  # node -> job -> entry
    by_rank: dict[int, dict[str, int]] = field(default_factory=dict)  # tier rank -> node -> jobs of that rank there
    by_borrowed: dict[str, dict[str, int]] = field(default_factory=dict)  # tenant -> node -> its borrowed jobs there

    def mark(self, node: str) -> None:
        if node not in self.pos:
            self.pos[node] = len(self.pos)
        self.dirty[node] = None

    def sync(self, views: dict, jobs: dict) -> None:
        if len(self.pos) != len(views):  # views that never went through mark (built by hand): take them all
            self.pos = {name: i for i, name in enumerate(views)}
            self.dirty = dict.fromkeys(views)
        for name in self.dirty:
            view = views.get(name)
            if view is None or self.seen.get(name) is view:
                continue
            self.seen[name] = view
            self._set(name, entries(view, jobs))
        self.dirty.clear()

    def _set(self, node: str, new: dict[str, Entry]) -> None:
        old = self.held.get(node, {})
        if old == new:
            return
        for e in old.values():
            _dec(self.by_rank, e[0], node)
            if e[2]:
                _dec(self.by_borrowed, e[1], node)
        for e in new.values():
            _inc(self.by_rank, e[0], node)
            if e[2]:
                _inc(self.by_borrowed, e[1], node)
        if new:
            self.held[node] = new
        else:
            self.held.pop(node, None)

    def nodes_for(self, rank: int, tenant: str, within_quota: bool) -> set[str]:
        """Nodes holding work of a lower tier than `rank`, or (within quota) another tenant's borrowed work."""
        out: set[str] = set()
        for r, ns in self.by_rank.items():
            if r > rank:
                out.update(ns)
        if within_quota:
            for t, ns in self.by_borrowed.items():
                if t != tenant:
                    out.update(ns)
        return out

    def in_order(self, views: dict, names: set[str]) -> Iterator[str]:
        """`names` in the scheduler's node order (the order of `views`), lazily where most nodes are named."""
        if len(names) * 4 >= len(views):
            return (n for n in views if n in names)
        return iter(sorted(names, key=self.pos.__getitem__))

    def state(self) -> tuple:
        """Everything a rebuild must reproduce (for the tests)."""
        return (self.held, {r: dict(ns) for r, ns in self.by_rank.items() if ns},
                {t: dict(ns) for t, ns in self.by_borrowed.items() if ns})


def rebuilt(views: dict, jobs: dict) -> VictimIndex:
    """The index read afresh from every view (what the incremental one must equal)."""
    idx = VictimIndex()
    for name in views:
        idx.mark(name)
    idx.sync(views, jobs)
    return idx


def _inc(table: dict, key, node: str) -> None:
    ns = table.setdefault(key, {})
    ns[node] = ns.get(node, 0) + 1


def _dec(table: dict, key, node: str) -> None:
    ns = table[key]
    if ns[node] == 1:
        del ns[node]
    else:
        ns[node] -= 1

