"""Adding simulated nodes to a running pool (docs/operators.md, "Adding nodes to a running pool"): a second
`gpupool agent --simulate FLEET` started beside a running fleet, as the docs say, with no other option. Its nodes
report, take work, and the first fleet keeps receiving its commands: each simulated fleet reads commands in a consumer
group of its own (agents/node/sim_agent.sim_group), so neither takes the other's partitions and drops what it finds
there."""
from __future__ import annotations

import pytest

from agents.node.sim_agent import sim_group
from schemas.events import Constraints, JobRequested
from tests.live import job_states, quotas, wait_for

pytestmark = pytest.mark.broker


def _fleet(stack, name: str, node: str, model: str) -> str:
    path = stack.home / f"{name}.yaml"
    path.write_text(f"nodes:\n  - {{name: {node}, model: {model}, gpus: 2}}\n")
    return str(path)


def test_each_simulated_fleet_has_its_own_command_group():
    a, b = sim_group({"na": 0}), sim_group({"nb": 0, "nc": 0})
    assert a != b and a == sim_group({"na": 1}) and a.startswith("gpupool-agent-sim-")  # the node role's prefix
    assert sim_group({"nb": 0, "nc": 0}) != sim_group({"nb": 0})


def test_a_fleet_added_to_a_running_pool_takes_work_and_the_first_keeps_its_own(stack):
    stack.start_worker()
    stack.start_agent(_fleet(stack, "a", "na", "A100-80GB"))
    stack.add_user("alice", "tenant", "acme")
    quotas(stack, "acme")
    alice = stack.client("alice")
    nodes = lambda: {n["node"]: n["state"] for n in alice.api("/api/nodes")["nodes"]}  # noqa: E731
    wait_for(lambda: nodes().get("na") == "ready", 90, "na ready", stack)

    stack.spawn("agent-b", "agent", "--simulate", _fleet(stack, "b", "nb", "T4"))  # what the docs say, nothing more
    wait_for(lambda: nodes().get("nb") == "ready", 90, "nb, the added node, ready", stack)
    jobs = [JobRequested(job_id=f"{model[:2].lower()}-{i}", tenant="acme", compute_milli=100, gpu_memory_mib=1024,
                         duration_s=1, constraints=Constraints(models=(model,)))
            for model in ("A100-80GB", "T4") for i in range(3)]
    alice.send(jobs)
    want = {f"acme/{j.job_id}" for j in jobs}
    done = wait_for(lambda: (s := job_states(stack, "alice")) and all(s.get(j, {}).get("state") == "completed"
                                                                      for j in want) and s, 120,
                    "every job on both fleets completed", stack)
    assert {done[f"acme/a1-{i}"]["nodes"] for i in range(3)} == {"na"}
    assert {done[f"acme/t4-{i}"]["nodes"] for i in range(3)} == {"nb"}
