"""第三组：故障与恢复 — fault and recovery, in the fault pool (dc-fault): fault-1 and fault-2, two A100-80GB each, each
node run by a simulated agent of its own whose control file injects faults while it runs."""
from __future__ import annotations

import time

from schemas.events import GpuHealth, InferenceLoad, ServiceDeclared, ServiceRemoved
from tests.acceptance.conftest import answers, inject
from tests.acceptance.probe import cancel, nodes, placements, rows, submit, timeline, wait_state
from tests.live import job_states, wait_for

GROUP = 3
POOL = {"datacenter": "dc-fault"}
WHOLE = dict(compute_milli=1000, gpu_memory_mib=40 * 1024, constraints=POOL)


def _free_cards(pool) -> dict[str, int]:
    n = nodes(pool)
    return {name: sum(1 for g in n[name]["cards"] if g["healthy"] and g["free_milli"] == 1000)
            for name in ("fault-1", "fault-2")}


def _cancel(pool, *jobs: str) -> None:
    cancel(pool, *jobs)
    wait_for(lambda: _free_cards(pool) == {"fault-1": 2, "fault-2": 2}, 60, "the fault pool free again", pool)


@answers(GROUP, "任务失败时哪些任务受影响、资源是否释放？ When a job fails, who else is affected, and is its unit "
                "released without anyone stepping in?", eight=(5, 6))
def test_a_job_failure_affects_that_job_alone(pool, evidence):
    jobs = [submit(pool, "alice", f"g3-fail-{i}", duration_s=300, checkpoint_interval_s=2, **WHOLE) for i in range(2)]
    placed = {j: wait_state(pool, j, "running")["nodes"] for j in jobs}
    inject(pool, "agent-f1" if placed[jobs[0]] == "fault-1" else "agent-f2", f"fail:{jobs[0]}")
    wait_state(pool, jobs[0], "failed", timeout=60)
    time.sleep(2)
    assert job_states(pool)[jobs[1]]["state"] == "running"  # the other job never noticed
    assert len(placements(pool, jobs[1])) == 1
    node = nodes(pool)[placed[jobs[0]]]
    assert jobs[0] not in node["jobs"]  # its card is free again, no person involved
    evidence.events("one job fails: its unit is released, the other job runs on", timeline(pool, jobs))
    _cancel(pool, jobs[1])


@answers(GROUP, "节点重启时任务如何恢复、队列顺序是否改变？ When a node restarts, do its jobs resume from their checkpoints "
                "ahead of newer work, without a person?", eight=(5,))
def test_a_node_restart_resumes_its_jobs_first(pool, evidence):
    jobs = [submit(pool, "alice", f"g3-restart-{i}", duration_s=300, checkpoint_interval_s=2, **WHOLE)
            for i in range(4)]
    where = {j: wait_state(pool, j, "running")["nodes"] for j in jobs}  # all four cards of the pool
    newer = submit(pool, "alice", "g3-newer", duration_s=30, **WHOLE)  # waits: the pool is full
    wait_state(pool, newer, "pending", timeout=30)
    time.sleep(4)  # a checkpoint or two
    inject(pool, "agent-f2", "restart:fault-2")
    moved = [j for j in jobs if where[j] == "fault-2"]
    for j in moved:
        wait_for(lambda j=j: len(placements(pool, j)) == 2, 60, f"{j} placed again", pool)
    again = {j: placements(pool, j)[1] for j in moved}
    assert all(p["resume_from"].startswith("ckpt:") for p in again.values())  # from their checkpoints
    assert job_states(pool)[newer]["state"] == "pending"  # the interrupted ones went first
    evidence.events("fault-2 restarts: its two jobs stop at their checkpoints and are placed again before the newer "
                    "job", timeline(pool, [*moved, newer]))
    _cancel(pool, *jobs, newer)


@answers(GROUP, "设备不可用时影响范围如何、切分单元是否正确释放？ When a device fails, which jobs are affected — only those "
                "on it — and is its unit taken out and the work moved?", eight=(5, 6))
def test_a_device_failure_moves_only_the_work_on_it(pool, evidence):
    jobs = [submit(pool, "alice", f"g3-ecc-{i}", duration_s=300, checkpoint_interval_s=2, **WHOLE) for i in range(2)]
    for j in jobs:
        wait_state(pool, j, "running")
    on = {j: (placements(pool, j)[0]["node"], placements(pool, j)[0]["assignments"][0]["gpu_uuid"]) for j in jobs}
    victim = jobs[0]
    node, card = on[victim]
    index = int(card.rsplit("-", 1)[1])
    inject(pool, "agent-f1" if node == "fault-1" else "agent-f2", f"ecc:{node}:{index}")
    wait_for(lambda: len(placements(pool, victim)) == 2, 60, "the job on the failed card placed again", pool)
    assert placements(pool, victim)[1]["assignments"][0]["gpu_uuid"] != card
    other = jobs[1]
    assert len(placements(pool, other)) == 1 and job_states(pool)[other]["state"] == "running"
    bad = next(g for g in nodes(pool)[node]["cards"] if g["uuid"] == card)
    assert not bad["healthy"] and "ECC" in bad["fault"]
    evidence.events("an uncorrectable ECC error on one card: only its job moves", timeline(pool, jobs))
    evidence.table("the card", ["node", "card", "healthy", "fault"], [[node, card, bad["healthy"], bad["fault"]]])
    inject(pool, "agent-f1" if node == "fault-1" else "agent-f2", f"clear:{node}:{index}")
    # the operator clears the card once its telemetry is clean: a clear older than the last faulty sample is
    # rightly overruled by that sample
    wait_for(lambda: next(g for g in nodes(pool)[node]["cards"] if g["uuid"] == card)["telemetry"].get(
        "ecc_uncorrected") == 0, 30, "clean telemetry from the repaired card", pool)
    pool.client().send([GpuHealth(node=node, gpu_uuid=card, healthy=True, reason="operator: card checked")])
    wait_for(lambda: next(g for g in nodes(pool)[node]["cards"] if g["uuid"] == card)["healthy"], 30, "card back",
             pool)
    _cancel(pool, *jobs)


@answers(GROUP, "调度器短暂异常时运行中的任务是否受影响、请求是否丢失、顺序是否改变？ When the scheduler is down for a while, "
                "do running jobs go on, and are the requests sent meanwhile taken in order once it is back?",
         eight=(5,))
def test_the_scheduler_down_for_a_while(pool, evidence):
    running = submit(pool, "alice", "g3-through", duration_s=300, checkpoint_interval_s=2, **WHOLE)
    wait_state(pool, running, "running")
    pool.stop_process("worker")
    down_at = time.time()
    for k, tier in enumerate(("offline", "inference", "online-training")):
        submit(pool, "alice", f"g3-while-{k}", tier=tier, duration_s=5, **WHOLE)  # into the inbox; no worker
    time.sleep(8)
    pool.start_worker()
    back_after = time.time() - down_at
    later = [f"acme/g3-while-{k}" for k in range(3)]
    for j in later:
        wait_state(pool, j, "running", "completed", timeout=120)
    first = {j: placements(pool, j)[0] for j in later}
    assert len(placements(pool, running)) == 1 and job_states(pool)[running]["state"] == "running"
    evidence.note(f"the worker (gateway, scheduler, folds) was down for {back_after:.0f} s; nobody stepped in")
    evidence.events("the running job went on; the three requests sent meanwhile were taken once it was back",
                    timeline(pool, [running, *later]))
    assert all(first[j] for j in later)
    _cancel(pool, running, *later)


@answers(GROUP, "在线服务在故障中的流量与副本如何？ For an online service, what happens to its replicas and traffic when "
                "a node under it is lost?", eight=(5, 6))
def test_a_service_keeps_its_replicas_through_a_node_loss(pool, evidence):
    alice = pool.client("alice")
    alice.send([ServiceDeclared(service_id="chat", tenant="acme", replica_compute_milli=1000,
                                replica_memory_mib=30 * 1024, replica_qps=50, min_replicas=2, max_replicas=3,
                                constraints=POOL)])

    def serving() -> dict[str, str]:
        return {j: r["nodes"] for j, r in job_states(pool).items()
                if j.startswith("acme/chat/") and r["state"] == "running"}

    before = wait_for(lambda: len(s := serving()) >= 2 and s, 90, "two replicas running", pool)
    lost = sorted(set(before.values()))[-1]
    t0 = time.time()
    inject(pool, "agent-f1" if lost == "fault-1" else "agent-f2", f"lose:{lost}")
    for _ in range(3):  # the traffic goes on being reported
        alice.send([InferenceLoad(service_id="chat", qps=60, p50_ms=40, p99_ms=120)])
        time.sleep(1)
    after = wait_for(lambda: len(s := {j: n for j, n in serving().items() if n != lost}) >= 2 and s, 120,
                     "two replicas running again, on the node that is left", pool)
    took = time.time() - t0
    evidence.table("replicas of acme/chat", ["when", "replicas (job: node)"], [
        ["before", ", ".join(f"{j}: {n}" for j, n in sorted(before.items()))],
        [f"{took:.0f} s after {lost} was lost", ", ".join(f"{j}: {n}" for j, n in sorted(after.items()))]])
    evidence.events("the service's replicas through the loss", timeline(pool, sorted(set(before) | set(after))))
    # the replicas may be back before the loss is noticed (a third replica for the traffic, on the node that is
    # left); the recovery below is of a node the pool holds down, its silence declared
    wait_for(lambda: nodes(pool)[lost]["state"] == "down", 60, f"{lost} declared down", pool)
    alice.send([ServiceRemoved(service_id="chat")])
    back = int(time.time() * 1000)
    inject(pool, "agent-f1" if lost == "fault-1" else "agent-f2", f"recover:{lost}")
    wait_for(lambda: nodes(pool)[lost]["state"] == "ready" and _free_cards(pool) == {"fault-1": 2, "fault-2": 2},
             90, "the pool whole again", pool)
    # back for good: its agent reports its inventory before its first heartbeat, and the worker once judged it by
    # the heartbeat it had before it was lost -- silent again within a second, interrupting what was just placed
    time.sleep(4)  # past two heartbeat intervals
    every = rows(pool, "SELECT JSONExtractBool(payload, 'alive') AS alive, event_time_ms, seq, offset FROM "
                       "gpupool.events FINAL WHERE kind = 'node.liveness' AND node = {n:String} "
                       "ORDER BY event_time_ms, offset", {"n": lost})
    said = [r["alive"] for r in every if r["event_time_ms"] >= back]
    assert said and said[0] and all(said), f"{lost}'s liveness after it came back ({back}): {said}; all: {every}"
