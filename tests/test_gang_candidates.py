"""A multi-node gang's preemption compares a bounded number of groups, as the single-node claim search compares
`PreemptionConfig.candidate_nodes` nodes (kube-scheduler's bounded preemption candidates): at a level (rack, data
center, anywhere), the first `candidate_nodes` groups, in group order, whose nodes have room enough in total once
their victims are gone; the cheapest plan among them wins. A group without room enough is not counted."""
from __future__ import annotations

from agents.node.fleet import make_node
from agents.scheduler.core import Scheduler
from agents.scheduler.preemption import PreemptionConfig
from agents.scheduler.quota import open_ledger
from schemas.events import JobStarted, Tier
from tests.builders import Clock, job


def _run(candidates: int) -> list:
    """rack-0: one 2-card node (room 2 of the 4 the gang needs: no group); rack-1, rack-2: two 2-card nodes, each
    card held by its own offline job (4 victims a rack); rack-3: two 2-card nodes, each held by one 2-card offline
    job (2 victims). Then a 4-card inference gang that must stay in one rack. Returns the preemptions it makes."""
    c = Clock()
    s = Scheduler(ledger=open_ledger(), preemption=PreemptionConfig(candidate_nodes=candidates))
    layout = [("rack-0", "a", (1, 1)), ("rack-1", "b", (1, 1)), ("rack-1", "c", (1, 1)), ("rack-2", "d", (1, 1)),
              ("rack-2", "e", (1, 1)), ("rack-3", "f", (2,)), ("rack-3", "g", (2,))]
    for rack, name, jobs in layout:  # each node arrives, then its own jobs: the only node with room
        s.step(c.env(make_node(name, "A100-80GB", 2, rack=rack), f"{name}/inventory", dt=10))
        for i, cards in enumerate(jobs):
            jid = f"t/{name}{i}"
            for o in s.step(c.env(job(jid, "t", 1000 * cards, 80 * cards), "cli/fill", dt=10)):
                if o.kind == "cmd.place":
                    assert o.payload.node == name
                    s.step(c.env(JobStarted(job_id=jid, node=name, command_id=o.payload.command_id),
                                 f"{name}/job/{jid}", dt=10))
    gang = job("t/serve", "t", 4000, 320, tier=Tier.INFERENCE, constraints={"max_spread": "rack"})
    out = s.step(c.env(gang, "cli/serve", dt=1000))
    return [o.payload for o in out if o.kind == "cmd.preempt"]


def test_every_group_compared_by_default_finds_the_cheapest_rack():
    stopped = _run(16)
    assert sorted(p.node for p in stopped) == ["f", "g"]  # two victims in rack-3, not four in rack-1 or rack-2


def test_a_group_without_room_enough_is_not_counted():
    # rack-0 cannot hold the gang whoever stops: the three groups compared are racks 1, 2 and 3
    assert sorted(p.node for p in _run(3)) == ["f", "g"]


def test_the_bound_stops_at_the_candidates_compared():
    stopped = _run(2)  # racks 1 and 2 only: a plan there, dearer than rack-3's
    assert len(stopped) == 4 and ({p.node for p in stopped} in ({"b", "c"}, {"d", "e"})), stopped
