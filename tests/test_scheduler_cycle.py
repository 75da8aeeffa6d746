"""A cycle is a session (#34 item 2): the actions after allocate run in Volcano's and KAI's order -- defragment,
reclaim, preempt -- and everything a cycle emits reaches the step's outputs once, when its Statement commits."""
from __future__ import annotations

import pytest

from agents.scheduler import core
from agents.scheduler.core import ACTIONS, Scheduler
from schemas.events import JobStarted, Tier
from tests.builders import Clock, inventory, job, open_ledger


def test_the_actions_run_in_volcanos_order():
    assert [a.__name__ for a in ACTIONS] == ["_defragment_action", "_reclaim_action", "_preempt_action"]


def test_a_cycle_commits_its_outputs_once_at_its_end():
    """A fleet full of offline work, then inference that must preempt: every cycle commits exactly once, nothing it
    emits is in the step's outputs before that, and the outputs are the ones a cycle emitted, in order."""
    cycles, commits = [], []
    real_cycle, real_commit = Scheduler._cycle, core.Statement.commit

    def cycle(self, out, cause, only=None):
        cycles.append(len(out))
        real_cycle(self, out, cause, only)

    def commit(self):
        assert len(self._into) == cycles[-1], "what the cycle emitted reached the step before its commit"
        commits.append(len(self.out))
        real_commit(self)

    c = Clock()
    s = Scheduler(ledger=open_ledger())
    outs = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Scheduler, "_cycle", cycle)
        mp.setattr(core.Statement, "commit", commit)
        s.step(c.env(inventory("n1", model="A100-80GB", gpus=2), "n1/inventory"))
        for k in range(2):
            for e in s.step(c.env(job(f"o{k}", compute=1000, mem_gib=40, tier=Tier.OFFLINE), "cli", dt=10)):
                if e.kind == "cmd.place":
                    s.step(c.env(JobStarted(job_id=e.payload.job_id, node="n1", command_id=e.payload.command_id),
                                 f"n1/job/{e.payload.job_id}", dt=10))
        outs = s.step(c.env(job("inf", compute=1000, mem_gib=40, tier=Tier.INFERENCE), "cli", dt=3_600_000))
    assert len(commits) == len(cycles) > 0
    assert any(e.kind == "cmd.preempt" for e in outs)
