"""A cycle's trials: the plan of its Statement, with checkpoints (KAI's Statement, Volcano's `Discard`).

A `Plan` lies over the holdings' node views. Its operations -- `evict` (a job's holding on a node released) and
`place` (a job holding cards on a node) -- change the plan's views at once, so the next operation of the same trial
sees them, and each logs its inverse: the view it replaced. `checkpoint()` is the log's length; `rollback(cp)` undoes
the operations after it, newest first, and truncates the log; `discard()` undoes them all. Node views are immutable
(streams/folds/node_view.py: an evolve returns a new view), so an inverse is exact and costs nothing to keep.

A plan never writes the holdings. What a trial decides reaches them only as the commands the scheduler emits after
the trial is rolled back (core.Statement: a command may not be emitted while a trial is open), and those commands go
through `Holdings.apply`, the one write path -- so a trial that was abandoned emits nothing and leaves nothing.

The plan is a read-only mapping of node name -> view (the base's names, the plan's views where it changed them), so
the placement's filters and scorer (placement.place) run on it unchanged. Pure: no I/O, no clock.
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import NamedTuple

from schemas.envelope import envelope
from schemas.events import JobRequested, PlaceJob, ReleaseJob
from streams.folds import node_view

SOURCE = "plan-trial"  # the source of a trial's envelopes: never on the log, never in the holdings' views
_NONE = object()


class Op(NamedTuple):
    """One operation of a plan: what it did, and the plan's view of the node before it (its inverse)."""
    kind: str  # "evict" | "place"
    node: str
    job_id: str
    assignments: tuple
    before: object  # the plan's own view of the node before the operation, or _NONE (it showed the base's)


class Plan(Mapping):
    """Trial operations over a mapping of node views (the holdings'); see the module docstring."""
    __slots__ = ("_base", "_over", "_log", "_seq")

    def __init__(self, base: Mapping[str, node_view.NodeView]):
        self._base = base
        self._over: dict[str, node_view.NodeView] = {}
        self._log: list[Op] = []
        self._seq = 0  # the trial envelopes' sequence: only ever rises, so a view never drops one as a duplicate

    # ------------------------------------------------------------ the mapping placement reads

    def __getitem__(self, node: str) -> node_view.NodeView:
        v = self._over.get(node)
        return self._base[node] if v is None else v

    def __iter__(self) -> Iterator[str]:
        return iter(self._base)

    def __len__(self) -> int:
        return len(self._base)

    def __contains__(self, node: object) -> bool:
        return node in self._base

    # ------------------------------------------------------------ operations

    def evict(self, node: str, job_id: str) -> node_view.NodeView:
        """The job's holding on `node` released, in the plan."""
        self._seq += 1
        return self._do(Op("evict", node, job_id, (), self._over.get(node, _NONE)), envelope(
            ReleaseJob(command_id=f"trial-{self._seq}", job_id=job_id, node=node),
            source=SOURCE, seq=self._seq, time_ms=0))

    def place(self, node: str, job: JobRequested, assignments: tuple) -> node_view.NodeView:
        """`job` holding these cards (and its host CPU and memory) on `node`, in the plan."""
        self._seq += 1
        return self._do(Op("place", node, job.job_id, tuple(assignments), self._over.get(node, _NONE)), envelope(
            PlaceJob(command_id=f"trial-{self._seq}", job_id=job.job_id, tenant=job.tenant, node=node,
                     assignments=tuple(assignments), cpu_milli=job.cpu_milli, memory_mib=job.memory_mib),
            source=SOURCE, seq=self._seq, time_ms=0))

    def _do(self, op: Op, env) -> node_view.NodeView:
        view = self._over[op.node] = node_view.evolve(self[op.node], env)
        self._log.append(op)
        return view

    # ------------------------------------------------------------ checkpoints

    def checkpoint(self) -> int:
        """A point to roll back to: the number of operations made so far."""
        return len(self._log)

    def rollback(self, cp: int) -> None:
        """Undo the operations made after checkpoint `cp`, newest first."""
        if not 0 <= cp <= len(self._log):
            raise ValueError(f"checkpoint {cp} is not in this plan (it has {len(self._log)} operations)")
        log, over = self._log, self._over
        while len(log) > cp:
            op = log.pop()
            if op.before is _NONE:
                del over[op.node]
            else:
                over[op.node] = op.before

    def discard(self) -> None:
        """Undo every operation: the plan shows the base's views again."""
        self.rollback(0)

    @property
    def ops(self) -> tuple[Op, ...]:
        """The operations in force, oldest first."""
        return tuple(self._log)

    @property
    def open(self) -> bool:
        """Whether a trial's operations are in force (not yet rolled back)."""
        return bool(self._log)
