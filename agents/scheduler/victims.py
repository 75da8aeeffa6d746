"""Which nodes hold work that could be stopped for a waiting job, kept current as node views change.

A preemption search used to ask every node, for every waiting job, who on it may be stopped (a walk over every
allocation of 5,000 nodes). The index keeps, per node, the claim group (tier, on its reservation: holdings.group) and
tenant of each job it holds (reservation holds aside: never victims), and across nodes which nodes hold work of each
(tenant, claim group). A search (claims.Search.groups) picks the tables whose work may be weaker than the waiting
job's claim -- lower groups, or groups of an account beyond its quota -- and visits only the nodes they name, in the
scheduler's node order, so the plans and their tie-breaks are the ones the walk over every node gave. Who exactly may
be stopped (state, protection, standing) is still decided per job by the caller: the index is a superset, never a
guess.

It is kept by the holdings' fold of the scheduler's own commands (holdings.py): a placement adds its job to the
node, a release takes it off. A node's entry is thus a function of the jobs its view holds and of facts fixed while
they hold it, and `rebuilt` (read afresh from every view) must give the same index; the tests hold the two equal.
Views that never went through the scheduler's fold (set by hand) are read in full on the next search.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Callable, Iterator

Entry = tuple[int, str]  # (claim group, tenant)


def entries(view, jobs) -> dict[str, Entry]:
    """What the index holds for one view: every job on it that is not a reservation hold."""
    out: dict[str, Entry] = {}
    for j in view.allocations:
        rec = jobs.get(j)
        if rec is None or rec.hold is not None:
            continue
        out[j] = (rec.group, rec.request.tenant)
    return out


@dataclass
class VictimIndex:
    pos: dict[str, int] = field(default_factory=dict)  # node -> place in the scheduler's node order
    held: dict[str, dict[str, Entry]] = field(default_factory=dict)  # node -> job -> entry
    by_group: dict[tuple[str, int], dict[str, int]] = field(default_factory=dict)  # (tenant, group) -> node -> jobs
    stale: bool = False  # the fold met a node it had not seen arrive: read every view on the next sync

    def fold(self, node: str, payload, view, jobs: dict, views: dict) -> None:
        """After the scheduler folded `payload` into `node`'s view (`views`, the scheduler's, now holds it): keep the
        job it placed or released current."""
        if node not in self.pos:
            if len(self.pos) != len(views) - 1:
                self.stale = True  # a node that was there before the index saw it (views set by hand)
            self.pos[node] = len(self.pos)
        job = payload.__dict__.get("job_id")  # not getattr: a kind without one pays pydantic's AttributeError
        kind = payload.__dict__.get("kind", "")
        if job is None or kind not in ("cmd.place", "cmd.release"):
            return  # nothing else adds or removes a job's holding (a resize keeps the job where it is)
        old = self.held.get(node, {}).get(job)
        rec = jobs.get(job)
        new = None
        if job in view.allocations and rec is not None and rec.hold is None:
            new = (rec.group, rec.request.tenant)
        if new == old:
            return
        if old is not None:
            self._drop(node, job, old)
        if new is not None:
            self._add(node, job, new)

    def sync(self, views: dict, jobs: dict) -> None:
        """Read every view afresh if some were never seen through the scheduler's fold (views set by hand)."""
        if len(self.pos) == len(views) and not self.stale:
            return
        self.stale = False
        self.pos = {name: i for i, name in enumerate(views)}
        for name, view in views.items():
            self._set(name, entries(view, jobs))

    def _set(self, node: str, new: dict[str, Entry]) -> None:
        for job, e in list(self.held.get(node, {}).items()):
            self._drop(node, job, e)
        for job, e in new.items():
            self._add(node, job, e)

    def _add(self, node: str, job: str, e: Entry) -> None:
        self.held.setdefault(node, {})[job] = e
        _inc(self.by_group, (e[1], e[0]), node)

    def _drop(self, node: str, job: str, e: Entry) -> None:
        held = self.held[node]
        del held[job]
        if not held:
            del self.held[node]
        _dec(self.by_group, (e[1], e[0]), node)

    def nodes_for(self, groups) -> list[dict[str, int]]:
        """The node tables of these (tenant, claim group) keys: a node is a candidate when any of them names it."""
        return [ns for k in groups if (ns := self.by_group.get(k))]

    def in_order(self, views: dict, tables: list[dict[str, int]]) -> Iterator[str]:
        """The nodes any of `tables` names, in the scheduler's node order (the order of `views`): lazily, walking the
        views, where they name many of the nodes (a search usually stops early); else the few, sorted."""
        if len(tables) == 1 and len(tables[0]) * 4 >= len(views):
            only = tables[0]
            return (n for n in views if n in only)
        if sum(len(t) for t in tables) * 4 >= len(views):
            return _named_by_any(views, tables)
        names: set[str] = set()
        for t in tables:
            names.update(t)
        return iter(sorted(names, key=self.pos.__getitem__))

    def state(self) -> tuple:
        """Everything a rebuild must reproduce (for the tests)."""
        return (self.held, {k: dict(ns) for k, ns in self.by_group.items() if ns})


class LazyVictims(Mapping):
    """node -> who may be stopped there, for the nodes the index names, each worked out on first look: a multi-node
    gang's plan looks only at nodes of the card model it tries, and a node named here may turn out to hold nobody."""

    def __init__(self, names, victims_on: Callable[[str], list], ids_on: Callable[[str], list[str]] | None = None):
        self._names = dict.fromkeys(names)
        self._victims_on = victims_on
        self._ids_on = ids_on  # the ids of victims_on's victims, cheaper than building them
        self._memo: dict[str, list] = {}

    def ids(self, name: str) -> list[str]:
        """The job ids of `self[name]` (none for a node not named), without building the victims when the ids have
        their own way (`ids_on`): a multi-node gang's plan counts every node's room from the ids alone."""
        if name not in self._names:
            return []
        got = self._memo.get(name)
        if got is not None or self._ids_on is None:
            return [v.job_id for v in (got if got is not None else self[name])]
        return self._ids_on(name)

    def __getitem__(self, name: str) -> list:
        if name not in self._names:
            raise KeyError(name)
        got = self._memo.get(name)
        if got is None:
            got = self._memo[name] = self._victims_on(name)
        return got

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


def _named_by_any(views: dict, tables: list[dict[str, int]]) -> Iterator[str]:
    for n in views:
        for t in tables:
            if n in t:
                yield n
                break


def rebuilt(views: dict, jobs: dict) -> VictimIndex:
    """The index read afresh from every view (what the incremental one must equal)."""
    idx = VictimIndex()
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

