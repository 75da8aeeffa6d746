"""第二组：单卡边界和共享行为 — single-card boundary and sharing, in the sharing pool (dc-share): share-a10, one A10
shared by software shares, and share-mig, one A100-80GB carved into MIG instances (3g.40gb, 2g.20gb, 1g.10gb)."""
from __future__ import annotations

from schemas.envelope import decode
from schemas.events import JobCancelled
from tests.acceptance.conftest import answers
from tests.acceptance.probe import cancel, nodes, placements, submit, timeline, wait_state
from tests.live import job_states, read_topic, wait_for
from tests.program_helpers import need_python3

GROUP = 2
A10 = {"datacenter": "dc-share", "models": ["A10"]}
MIG = {"datacenter": "dc-share", "models": ["A100-80GB"]}


def _card_rows(pool, node: str) -> list[list]:
    n = nodes(pool)[node]
    out = []
    for g in n["cards"]:
        out.append([node, g["uuid"], g["model"], g["free_milli"], g["free_memory_mib"], ", ".join(g["holders"])])
        for i in g["mig"]:
            out.append([node, i["uuid"], f"MIG {i['profile']}", "", "", ", ".join(i["holders"]) or "free"])
    return out


@answers(GROUP, "同一设备上的多个任务是否按约定分配资源单元？ Do several jobs on one card get the units agreed, and no "
                "more than the card has?", eight=(2, 3))
def test_several_jobs_share_one_card_with_the_agreed_units(pool, evidence):
    """Three jobs of 100 milli-CU on an A10 (400 milli-CU a card) each get a quarter of it: 250 milli-GPU and the
    GPU memory asked for; the card is not oversold."""
    jobs = [submit(pool, "alice", f"g2-share-{i}", compute_milli=100, gpu_memory_mib=4 * 1024, duration_s=60,
                   constraints=A10) for i in range(3)]
    for j in jobs:
        wait_state(pool, j, "running")
    shares = {j: placements(pool, j)[0]["assignments"] for j in jobs}
    assert all(len(a) == 1 and a[0]["milli"] == 250 and a[0]["memory_mib"] == 4096 for a in shares.values())
    assert len({a[0]["gpu_uuid"] for a in shares.values()}) == 1
    card = nodes(pool)["share-a10"]["cards"][0]
    assert card["free_milli"] == 250 and card["free_memory_mib"] == 24 * 1024 - 3 * 4096
    assert sorted(card["holders"]) == sorted(jobs)
    evidence.table("share-a10 with three software shares", ["node", "unit", "model", "free milli", "free MiB",
                                                             "held by"], _card_rows(pool, "share-a10"))
    cancel(pool, *jobs)


@answers(GROUP, "硬件切分单元（MIG）是否各自独立交付？ Are MIG instances delivered as separate units, each job in its "
                "own instance?", eight=(2, 3, 6))
def test_mig_instances_are_separate_units(pool, evidence):
    jobs = [submit(pool, "alice", f"g2-mig-{i}", compute_milli=150, gpu_memory_mib=9 * 1024, duration_s=60,
                   constraints=MIG) for i in range(2)]
    for j in jobs:
        wait_state(pool, j, "running")
    units = {j: placements(pool, j)[0]["assignments"][0] for j in jobs}
    assert all(u["mig_uuid"] and u["mig_profile"] for u in units.values())
    assert len({u["mig_uuid"] for u in units.values()}) == 2  # one instance each
    evidence.table("share-mig: each job in its own MIG instance", ["node", "unit", "model", "free milli", "free MiB",
                                                                   "held by"], _card_rows(pool, "share-mig"))
    evidence.events("the placements", timeline(pool, jobs))
    cancel(pool, *jobs)


@answers(GROUP, "资源不足和超额申请时平台如何表现？ What happens when there is too little capacity now, and when a "
                "request exceeds what the pool could ever give?", eight=(2,))
def test_too_little_capacity_waits_and_an_over_request_is_rejected(pool, evidence):
    holder = submit(pool, "alice", "g2-hold", compute_milli=400, gpu_memory_mib=20 * 1024, duration_s=120,
                    constraints=A10)
    wait_state(pool, holder, "running")
    waits = submit(pool, "alice", "g2-wait", compute_milli=200, gpu_memory_mib=8 * 1024, duration_s=2,
                   constraints=A10)
    wait_state(pool, waits, "pending", timeout=30)
    wait_for(lambda: any(e["kind"] == "job.pending" for e in timeline(pool, [waits])), 30, "a reason", pool)
    never = submit(pool, "alice", "g2-never", compute_milli=5000, gpu_memory_mib=100 * 1024, duration_s=2,
                   constraints=A10)
    rejected = wait_state(pool, never, "rejected", timeout=60)
    assert rejected["rejections"] == "unsatisfiable"
    evidence.events("too little now: it waits, saying why; more than the pool could ever give: rejected at once",
                    timeline(pool, [holder, waits, never]))
    # cancel frees the unit, and the waiting job gets it (再次分配)
    pool.client("alice").send([JobCancelled(job_id=holder)])
    wait_state(pool, holder, "cancelled")
    done = wait_state(pool, waits, "running", "completed", timeout=60)
    assert done["nodes"] == "share-a10"
    evidence.events("cancel, release and re-allocation on share-a10", timeline(pool, [holder, waits]))


@answers(GROUP, "平台状态与实际任务行为是否一致？任务是否只看到自己的设备？ Does what the platform shows match what the node "
                "agents run, and does each job see only its own devices?", eight=(3, 6))
def test_the_platform_matches_what_the_agents_run_and_jobs_see_only_their_devices(pool, evidence):
    """The node agents report, per card and MIG instance, which jobs run there (telemetry job_ids); that must be
    the scheduler's placement exactly: each job on the units it was given and on no other. And each job is a real
    process (the simulated fleet runs a job's command, issue #32): what it sees of the devices, CUDA_VISIBLE_DEVICES
    and NVIDIA_VISIBLE_DEVICES printed by the program itself and read back from its logs (/api/logs, as its
    tenant), is exactly its own units -- the share of the A10 the card's UUID, the MIG job its instance's UUID --
    and none of the other job's. (With the NVML agent the same environment comes from the same assignments:
    tests/test_nvml_backend.py; in a container, the CDI devices: tests/test_programs_live.py.)"""
    program = ("import os, time\n"
               "print('CUDA_VISIBLE_DEVICES=' + os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>'), flush=True)\n"
               "print('NVIDIA_VISIBLE_DEVICES=' + os.environ.get('NVIDIA_VISIBLE_DEVICES', '<unset>'), flush=True)\n"
               "time.sleep(120)\n")
    jobs = [submit(pool, "alice", f"g2-see-{i}", compute_milli=150, gpu_memory_mib=9 * 1024, duration_s=60,
                   constraints=MIG if i else A10, command=(need_python3(), "-c", program)) for i in range(2)]
    for j in jobs:
        wait_state(pool, j, "running")
    given = {j: {a.get("mig_uuid") or a["gpu_uuid"] for a in placements(pool, j)[0]["assignments"]} for j in jobs}

    def reported() -> dict[str, set[str]]:
        """The node agents' telemetry of the last 3 s of log time: which jobs run on which card or MIG instance."""
        records = sorted(read_topic(pool, "gpupool.telemetry"), key=lambda m: m.timestamp)
        recent = [m for m in records if m.timestamp >= records[-1].timestamp - 3000]
        seen: dict[str, set[str]] = {}
        for m in recent:
            for sample in decode(m.value).payload.samples:
                for job in sample.job_ids:
                    seen.setdefault(job, set()).add(sample.mig_uuid or sample.gpu_uuid)
        return seen

    def program_saw(job: str) -> dict[str, set[str]] | None:
        """What the job's program printed: variable -> the devices it names (None until both lines are in)."""
        text = "".join(p["text"] for p in pool.client("alice").api("/api/logs", {"job": job})["pieces"])
        got = dict(line.split("=", 1) for line in text.splitlines() if "_VISIBLE_DEVICES=" in line)
        if set(got) != {"CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES"}:
            return None
        return {k: set(v.split(",")) for k, v in got.items()}

    seen = wait_for(lambda: (r := reported()) and all(r.get(j) == given[j] for j in jobs) and r, 30,
                    "the agents' telemetry to show the jobs where they were placed", pool)
    saw = {j: wait_for(lambda j=j: program_saw(j), 60, f"{j}'s program to print what it sees", pool) for j in jobs}
    rows = [[j, ", ".join(sorted(given[j])), ", ".join(sorted(seen.get(j, ()))),
             ", ".join(sorted(saw[j]["CUDA_VISIBLE_DEVICES"])), ", ".join(sorted(saw[j]["NVIDIA_VISIBLE_DEVICES"]))]
            for j in jobs]
    assert all(seen.get(j) == given[j] for j in jobs), rows
    for j in jobs:
        assert saw[j]["CUDA_VISIBLE_DEVICES"] == saw[j]["NVIDIA_VISIBLE_DEVICES"] == given[j], rows
        others = set().union(*(given[o] for o in jobs if o != j))
        assert not saw[j]["CUDA_VISIBLE_DEVICES"] & others, rows  # another job's devices are absent
    assert given[jobs[0]] != given[jobs[1]]
    view = {j: job_states(pool)[j]["nodes"] for j in jobs}
    assert view[jobs[0]] == "share-a10" and view[jobs[1]] == "share-mig"
    evidence.table("units the scheduler gave vs units the node agents report vs what each job's program saw",
                   ["job", "given (placement)", "reported (node agent telemetry)",
                    "program's CUDA_VISIBLE_DEVICES", "program's NVIDIA_VISIBLE_DEVICES"], rows)
    evidence.table("share-mig now", ["node", "unit", "model", "free milli", "free MiB", "held by"],
                   _card_rows(pool, "share-mig"))
    cancel(pool, *jobs)


@answers(GROUP, "持续运行的任务是否一直保有其单元并按实际占用计费？ Does a long-running job keep its unit for its whole run, "
                "billed for what it held?", eight=(4,))
def test_a_long_run_keeps_its_unit_and_is_billed_for_it(pool, evidence):
    job = submit(pool, "alice", "g2-long", compute_milli=100, gpu_memory_mib=2 * 1024, duration_s=20,
                 checkpoint_interval_s=5, constraints=A10)
    done = wait_state(pool, job, "completed", timeout=90)
    place = placements(pool, job)
    assert len(place) == 1  # one run, never moved
    sql = ("SELECT start_ms, end_ms, gpu_milli, gpu_milli_ms, cu_milli, cu_milli_ms FROM gpupool.usage FINAL "
           "WHERE job_id = {j:String} ORDER BY start_ms")
    usage = wait_for(lambda: (u := pool.query(sql, {"j": job})) and sum(
        int(r["end_ms"]) - int(r["start_ms"]) for r in u) >= 20_000 and u, 30, "the whole run billed", pool)
    total = sum(int(r["gpu_milli_ms"]) for r in usage)
    ran = sum(int(r["end_ms"]) - int(r["start_ms"]) for r in usage)
    assert ran == 20_000 and total == 250 * 20_000  # a quarter of an A10 for the 20 s it ran, to the millisecond
    evidence.table("its bill", ["start_ms", "end_ms", "gpu_milli", "gpu_milli_ms", "cu_milli", "cu_milli_ms"],
                   [[r[k] for k in ("start_ms", "end_ms", "gpu_milli", "gpu_milli_ms", "cu_milli", "cu_milli_ms")]
                    for r in usage])
    evidence.events("its life", timeline(pool, [job]))
    assert done["elapsed_s"] >= 20
