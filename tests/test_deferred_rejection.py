"""A request no node could ever hold is rejected -- at once when the fleet has settled, else once it has (a tick),
or when the fleet shrinks under it (a node removed). Each rejection names the job's own request as its cause, so the
job's state (streams/folds/job_view.py, the one rule) is "rejected" whenever it was judged.

Found by the acceptance suite (test_group2_sharing, a request made while the pool's nodes were still joining): the
rejection judged on the next tick named the tick as its cause, and job_view, which reads a rejection caused by another
request under the same id as that request's refusal (a duplicate id), kept the job "pending" for ever."""
from __future__ import annotations

from agents.scheduler.core import Scheduler
from schemas.events import Constraints, NodeRemoved, SchedulerTick
from streams.folds import job_view
from tests.builders import Clock, inventory, job, open_ledger


def _view(envs) -> job_view.JobView:
    v = None
    for e in envs:
        if getattr(e.payload, "job_id", None) == "never":
            v = job_view.evolve(v, e)
    return v


def test_a_request_judged_unsatisfiable_after_the_fleet_settled_is_rejected_in_the_jobs_view():
    c = Clock(start=0)
    s = Scheduler(ledger=open_ledger())
    s.step(c.env(inventory("a10-1", model="A10", gpus=2), "a10-1/inventory"))
    ask = c.env(job("never", compute=5000, mem_gib=100, constraints=Constraints(models=("A10",))), "cli/never", dt=10)
    early = s.step(ask)  # the fleet is still growing: it waits
    assert [e.kind for e in early] == ["job.pending"]
    later = s.step(c.env(SchedulerTick(now_ms=20_000), "ticker", dt=20_000))
    (rej,) = [e for e in later if e.kind == "job.rejected"]
    assert rej.payload.code == "unsatisfiable" and rej.causation_id == ask.event_id
    assert _view([ask, *early, *later]).state == "rejected"


def test_a_request_the_shrunken_fleet_can_no_longer_hold_is_rejected_in_the_jobs_view():
    c = Clock(start=0)
    s = Scheduler(ledger=open_ledger())
    s.step(c.env(inventory("a10-1", model="A10", gpus=2), "a10-1/inventory"))
    s.step(c.env(inventory("a10-2", model="A10", gpus=2), "a10-2/inventory"))
    s.step(c.env(SchedulerTick(now_ms=20_000), "ticker", dt=20_000))
    hold = s.step(c.env(job("hold", compute=200, mem_gib=24, constraints=Constraints(models=("A10",)),
                            duration=None), "cli/hold", dt=10))
    assert any(e.kind == "cmd.place" for e in hold)
    # four A10 cards could hold it as a gang, not while the holder has one: it waits
    ask = c.env(job("never", compute=1000, mem_gib=4 * 24, gang=True, constraints=Constraints(models=("A10",))),
                "cli/never", dt=10)
    early = s.step(ask)
    assert not [e for e in early if e.kind == "job.rejected"]
    gone = s.step(c.env(NodeRemoved(node="a10-2"), "operator", dt=10))  # two cards left in the pool: never
    (rej,) = [e for e in gone if e.kind == "job.rejected"]
    assert rej.causation_id == ask.event_id
    assert _view([ask, *early, *gone]).state == "rejected"
