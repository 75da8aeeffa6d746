"""Fencing: a node never runs a superseded placement of a job.

The scheduler numbers the placements of each job (`attempt` 1, 2, ...: a job interrupted by a node loss, moved off a
drained node or preempted is placed anew) and every command about a run names its attempt: `cmd.place`,
`cmd.preempt`, `cmd.release`, `cmd.resize`, `cmd.migrate`. A node agent keeps, per job, the newest attempt it has
been told about and the newest one a stop ended, and from them:

- refuses a placement older than one it has seen, or one a release or preemption already ended (a command of a run
  the scheduler has moved on from, delivered late or again);
- lets a stop end only a run of its attempt or an older one: a release of the job's old run, sent when its node was
  lost, does not stop the new run the same node was given since;
- a placement of a newer attempt replaces an older run of the job still going on the node (a node that comes back
  with stale work and is given the job again runs it once).

Attempt 0 is unnumbered (a producer that predates attempts): never refused, and a stop of attempt 0 ends whatever
runs. Pure bookkeeping, shared by the simulated and the NVML agents and by the tests' model of a node agent.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Fence:
    newest: dict[str, int] = field(default_factory=dict)  # job -> newest attempt placed here
    ended: dict[str, int] = field(default_factory=dict)  # job -> newest attempt a stop has ended

    def may_place(self, job_id: str, attempt: int) -> bool:
        """Whether a placement of this attempt may run here (and, if so, it is now the newest)."""
        if not attempt:
            return True
        if attempt < self.newest.get(job_id, 0) or attempt <= self.ended.get(job_id, 0):
            return False
        self.newest[job_id] = attempt
        return True

    def place(self, job_id: str, attempt: int, running: int | None) -> str:
        """What a placement of `attempt` means on a node running attempt `running` of the job (None: not running):
        "refuse" (superseded), "running" (that run or a newer one goes on already: nothing to do), "replace" (an
        older run goes on: stop it, start this one) or "start"."""
        if not self.may_place(job_id, attempt):
            return "refuse"
        if running is None:
            return "start"
        return "running" if not attempt or running >= attempt else "replace"

    def stops(self, job_id: str, attempt: int, running: int | None) -> bool:
        """A stop (release, preemption) of `attempt` arrived: whether it ends the run of attempt `running` (None:
        nothing runs). Either way, placements of `attempt` and older are over."""
        if attempt:
            self.ended[job_id] = max(self.ended.get(job_id, 0), attempt)
        return running is not None and (not attempt or not running or running <= attempt)

    def applies(self, attempt: int, running: int) -> bool:
        """Whether a command about one run (a resize) concerns the run going on, of attempt `running`."""
        return not attempt or not running or attempt == running
