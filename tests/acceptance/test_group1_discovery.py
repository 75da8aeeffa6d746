"""第一组：资源发现和组织 — discovery and organisation, on the two pools of tests/acceptance/fleet.yaml: a training
pool (dc-train: A100-80GB and H100-80GB, labels pool=training) and an inference pool (dc-serve: T4 and L4, labels
pool=inference)."""
from __future__ import annotations

import json

from schemas.events import GpuHealth, NodeCordon
from tests.acceptance.conftest import answers
from tests.acceptance.probe import nodes, placements, submit, timeline, wait_state
from tests.live import produce, wait_for

GROUP = 1


@answers(GROUP, "至少两个资源池或两类资源标签：平台能否发现并描述它们？ Are two pools and their label sets discovered, "
                "with each device's model, memory, network and runtime?", eight=(1, 3))
def test_two_pools_are_discovered_and_described(pool, evidence):
    """Every node of both pools is known with its datacenter (the pool), labels, rack, cards (model, memory,
    compute capability, NVLink domain, driver, CUDA) and a stable card uuid."""
    seen = nodes(pool)
    pools = {n["datacenter"]: sorted(name for name, m in seen.items() if m["datacenter"] == n["datacenter"])
             for n in seen.values()}
    assert pools["dc-train"] == ["train-a100", "train-h100"] and pools["dc-serve"] == ["serve-l4", "serve-t4"]
    assert {seen[n]["labels"]["pool"] for n in pools["dc-train"]} == {"training"}
    assert {seen[n]["labels"]["pool"] for n in pools["dc-serve"]} == {"inference"}
    assert all(n["state"] == "ready" for name, n in seen.items() if name in pools["dc-train"] + pools["dc-serve"])
    # the view is the worker's fold; the bill store is the sink's, which may lag it by a batch
    def inventories():
        found = pool.query("SELECT node, payload FROM gpupool.events FINAL WHERE kind = 'node.inventory' "
                           "AND node IN ('train-a100', 'train-h100', 'serve-t4', 'serve-l4') ORDER BY node")
        return found if len({r["node"] for r in found}) == 4 else None
    inv = wait_for(inventories, 60, "the four nodes' inventories in ClickHouse", pool)
    rows = []
    for r in inv:
        doc = json.loads(r["payload"])
        for g in doc["gpus"]:
            rows.append([doc["node"], doc["datacenter"], json.dumps(doc["labels"]), doc["rack"], g["uuid"], g["model"],
                         g["memory_mib"], g["compute_capability"], g["nvlink_domain"] or "-", g["driver_version"],
                         g["cuda_version"]])
    assert len({r[4] for r in rows}) == len(rows) == 10  # a unique, stable id per card
    evidence.table("inventory of the two pools (as the node agents reported it)",
                   ["node", "pool (datacenter)", "labels", "rack", "card uuid", "model", "memory MiB", "cc",
                    "NVLink domain", "driver", "CUDA"], rows)


@answers(GROUP, "节点上线、维护、异常和重新可用时，平台状态是否准确？ Are a node's states — online, maintenance, faulty, "
                "back — shown as they are, and does work avoid a node that is not ready?", eight=(5,))
def test_node_states_online_maintenance_faulty_and_back(pool, evidence):
    admin = pool.client()
    states = [("online", nodes(pool)["train-h100"]["state"])]
    admin.send([NodeCordon(node="train-h100", cordoned=True, reason="firmware upgrade")])
    wait_for(lambda: nodes(pool)["train-h100"]["state"] == "cordoned", 30, "maintenance", pool)
    states.append(("maintenance (cordon)", nodes(pool)["train-h100"]["state"]))
    # while it is in maintenance, work that only it could hold waits, with the reason
    job = submit(pool, "alice", "g1-h100-only", compute_milli=2000, gpu_memory_mib=70 * 1024, duration_s=2,
                 constraints={"models": ["H100-80GB"]})
    pending = wait_state(pool, job, "pending", timeout=30)
    wait_for(lambda: any(e["kind"] == "job.pending" and "NodeCordoned" in json.dumps(e["what"])
                         for e in timeline(pool, [job])), 30, "the pending reason", pool)
    card = nodes(pool)["train-h100"]["cards"][1]["uuid"]
    admin.send([GpuHealth(node="train-h100", gpu_uuid=card, healthy=False, reason="operator: suspected fault"),
                NodeCordon(node="train-h100", cordoned=False, reason="upgrade done")])
    wait_for(lambda: not nodes(pool)["train-h100"]["cards"][1]["healthy"], 30, "the faulty card", pool)
    states.append(("faulty card", f"card 1 out of service: {nodes(pool)['train-h100']['cards'][1]['fault']}"))
    admin.send([GpuHealth(node="train-h100", gpu_uuid=card, healthy=True, reason="operator: card replaced")])
    wait_for(lambda: nodes(pool)["train-h100"]["cards"][1]["healthy"]
             and nodes(pool)["train-h100"]["state"] == "ready", 30, "back", pool)
    states.append(("back", nodes(pool)["train-h100"]["state"]))
    done = wait_state(pool, job, "running", "completed", timeout=60)
    assert pending["state"] == "pending" and done["nodes"] == "train-h100"
    assert [s for _, s in states][0] == "ready" and states[1][1] == "cordoned" and states[-1][1] == "ready"
    evidence.table("train-h100 through its states", ["step", "state the platform shows"], states)
    evidence.events("the H100-only job: waits while its only node is in maintenance, runs when it is back",
                    timeline(pool, [job]))


@answers(GROUP, "调度器是否根据资源条件选对池，而不是由用户手工指定机器？ Does the scheduler pick the pool from what the "
                "request needs, never from a machine the user names?", eight=(2,))
def test_the_scheduler_picks_the_pool_from_the_request(pool, evidence):
    big = submit(pool, "alice", "g1-80g", compute_milli=1000, gpu_memory_mib=75 * 1024, duration_s=2)
    small = submit(pool, "alice", "g1-serve", tier="inference", compute_milli=100, gpu_memory_mib=4 * 1024,
                   duration_s=2, constraints={"datacenter": "dc-serve"})
    new = submit(pool, "alice", "g1-cc89", compute_milli=200, gpu_memory_mib=8 * 1024, duration_s=2,
                 constraints={"min_compute_capability": "8.9", "datacenter": "dc-serve"})
    for j in (big, small, new):
        wait_state(pool, j, "running", "completed")
    where = {j: placements(pool, j)[0]["node"] for j in (big, small, new)}
    assert where[big] in ("train-a100", "train-h100")  # only 80 GB cards hold 75 GiB
    assert where[small] in ("serve-t4", "serve-l4")
    assert where[new] == "serve-l4"  # of the inference pool only the L4 is compute capability 8.9
    # a request cannot name a machine: the contract has no such field, and the gateway refuses the attempt
    produce(pool, "gpupool.in.alice", [json.dumps({"kind": "job.requested", "job_id": "g1-named", "tenant": "acme",
                                                   "compute_milli": 100, "gpu_memory_mib": 1024,
                                                   "node": "train-a100"}).encode()], user="alice")
    named = wait_state(pool, "acme/g1-named", "rejected", timeout=30)
    assert named["rejections"] == "invalid"
    evidence.table("where each request went, and why", ["job", "needs", "placed on"], [
        [big, "75 GiB of GPU memory on one card", where[big]],
        [small, "inference, 4 GiB, constraints.datacenter dc-serve", where[small]],
        [new, "compute capability >= 8.9 in dc-serve", where[new]],
        ["acme/g1-named", "a request that names node train-a100", "rejected: invalid (no such field)"]])
    evidence.events("their decisions with the scheduler's reasons", timeline(pool, [big, small, new]))
