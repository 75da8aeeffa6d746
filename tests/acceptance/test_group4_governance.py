"""第四组：治理证据 — governance evidence: job, resource, tenant, permission, queue, quota, operator and timeline
linked; the export a third party can review for cost allocation."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from schemas.events import QuotaSet
from tests.acceptance.conftest import HERE, answers
from tests.acceptance.probe import placements, submit, timeline, wait_state
from tests.live import wait_for

GROUP = 4


@answers(GROUP, "任务、资源、租户、权限、队列、配额、操作人和时间线能否关联？ Can one job be linked to its resources, tenant, "
                "permission, queue, quota, the operator who set it, and its timeline?", eight=(3, 4))
def test_a_job_links_to_everything_it_touched(pool, evidence):
    pool.client().send([QuotaSet(tenant="acme", project="research", gpu_milli=20_000)])
    job = submit(pool, "alice", "g4-linked", project="research", tier="online-training", compute_milli=500,
                 gpu_memory_mib=16 * 1024, duration_s=3, constraints={"datacenter": "dc-serve"})
    wait_state(pool, job, "completed")
    wait_for(lambda: pool.query("SELECT count() AS n FROM gpupool.usage FINAL WHERE job_id = {j:String}",
                                {"j": job})[0]["n"] > 0, 30, "its bill", pool)
    p = {"j": job}
    req = pool.query("SELECT actor, tenant, payload FROM gpupool.events FINAL WHERE job_id = {j:String} "
                     "AND kind = 'job.requested'", p)[0]
    place = placements(pool, job)[0]
    quota = pool.query("SELECT kind, project, used_milli, actor FROM gpupool.quota_events FINAL WHERE job_id = "
                       "{j:String} ORDER BY offset", p)
    quota_set = pool.query("SELECT actor, quota_milli FROM gpupool.quota_events FINAL WHERE kind = 'quota.set' AND "
                           "tenant = 'acme' AND project = 'research' ORDER BY offset", {})[-1]
    usage = pool.query("SELECT node, gpu_model, gpu_milli_ms, cu_milli_ms, borrowed FROM gpupool.usage FINAL "
                       "WHERE job_id = {j:String}", p)
    who = {r["name"]: r for r in pool.client().api("/api/principals")["principals"]}
    links = [
        ["job", job, "the gateway named it: tenant/id"],
        ["tenant", req["tenant"], "from the principal's channel (its inbox)"],
        ["principal (permission)", f"{req['actor']} (role {who[req['actor']]['role']} of {who[req['actor']]['tenant']})",
         "authenticated by the broker (SCRAM), recorded as actor"],
        ["queue (tier) and project", f"{json.loads(req['payload'])['tier']} / {json.loads(req['payload'])['project']}",
         "the request"],
        ["resources", f"{place['node']}: " + ", ".join(a["gpu_uuid"] for a in place["assignments"]), "cmd.place"],
        ["quota", "; ".join(f"{q['kind']} used={q['used_milli']}" for q in quota), "quota_events, by job id"],
        ["operator", f"{quota_set['actor']} set research's quota to {quota_set['quota_milli']} milli-CU",
         "quota.set with its actor"],
        ["bill", "; ".join(f"{u['node']} {u['gpu_model']} {int(u['gpu_milli_ms']) / 1e6:.3f} GPU-s" for u in usage),
         "usage, by job id"],
    ]
    assert req["actor"] == "alice" and req["tenant"] == "acme" and quota and usage
    assert quota_set["actor"] == "admin" and place["node"] in ("serve-t4", "serve-l4")
    evidence.table("one job and everything it is linked to", ["what", "value", "linked through"], links)
    evidence.events("its timeline", timeline(pool, [job]))


@answers(GROUP, "权限是否成为记录的一部分、租户之间是否隔离？ Are permissions part of the record, and can one tenant see or "
                "act on another's work?", eight=(4, 8))
def test_permissions_are_enforced_and_recorded(pool, evidence):
    bob, alice = pool.client("bob"), pool.client("alice")
    mine = submit(pool, "bob", "g4-bobs", compute_milli=100, gpu_memory_mib=1024, duration_s=2,
                  constraints={"datacenter": "dc-serve"})
    wait_state(pool, mine, "completed")
    from agents.client import ApiFailure
    seen = []
    for path, params in (("/api/explain", {"job": mine}), ("/api/history", {"job": mine}),
                         ("/api/billing", {"tenant": "globex"}), ("/api/jobs", {"tenant": "globex"})):
        try:
            alice.api(path, params)
            seen.append([path, "answered (should not)"])
        except ApiFailure as exc:
            seen.append([path, str(exc)])
    assert all("403" in s or "404" in s for _, s in seen)
    assert {r[0] for r in alice.rows("/api/jobs")[1]} and not any(r[0].startswith("globex/")
                                                                  for r in alice.rows("/api/jobs")[1])
    assert any(r[0] == mine for r in bob.rows("/api/jobs")[1])
    roles = [[p["name"], p["role"], p["tenant"] or ""] for p in pool.client().api("/api/principals")["principals"]]
    evidence.table("who is who (the principals registry)", ["principal", "role", "tenant"], roles)
    evidence.table("alice (acme) asking about bob's (globex) job and bill", ["request", "answer"], seen)


@answers(GROUP, "平台能否导出足以支撑成本分摊复核的证据？ Can the platform export evidence that supports a cost-allocation "
                "review by a third party?", eight=(8,))
def test_the_export_supports_a_cost_allocation_review(pool, evidence, tmp_path):
    out = tmp_path / "acme-pack"
    env = {**os.environ, **pool.env, "GPUPOOL_USER": "aud"}
    until = time.time_ns() // 1_000_000  # one period for the pack and the bill, while jobs may still be running
    made = subprocess.run([sys.executable, "-m", "agents.audit", "export", "--tenant", "acme", "--out", str(out),
                           "--to", str(until)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert made.returncode == 0, made.stdout + made.stderr
    check = subprocess.run([sys.executable, "-m", "agents.audit", "verify-export", str(out), "--pubkey",
                            str(pool.home / "keys" / "evidence-ed25519.pub.pem")], env=env, capture_output=True,
                           text=True, timeout=60)
    assert check.returncode == 0 and "OK" in check.stdout, check.stdout
    summary = json.loads((out / "summary.json").read_text())
    cost = json.loads((out / "cost.json").read_text())
    billed = pool.client("fin").rows("/api/billing", {"tenant": "acme", "cost": "1", "by": "tenant",
                                                      "until": str(until)})
    bill = {r["currency"]: r["cost_micro"] for r in (dict(zip(billed[0], row)) for row in billed[1]) if r["currency"]}
    # money per currency, never summed across currencies (the shipped price book is in USD); the reviewer adds the
    # lines' exact numerators and divides once, as the bill does
    in_pack = {cur: sum(int(r["numerator"]) for r in cost if r["currency"] == cur) // 3_600_000_000
               for cur in {r["currency"] for r in cost} if cur}
    assert in_pack == summary["cost_micro"] == bill and bill.get("USD", 0) > 0, (in_pack, summary["cost_micro"], bill)
    assert summary["verification"]["ok"] is True
    text = "".join(p.read_text() for p in out.iterdir() if p.suffix in (".csv", ".json"))
    assert "globex" not in text and "bob" not in text
    evidence.table("the pack", ["file", "bytes"], [[p.name, p.stat().st_size] for p in sorted(out.iterdir())])
    evidence.table("cost allocation in the pack (micro-units)", list(cost[0]) if cost else [],
                   [list(r.values()) for r in cost])
    evidence.note(f"verify-export with the pool's public key: {check.stdout.strip().splitlines()[-1]}; "
                  f"pack total {summary['cost_micro']} micro-units = billing --cost {bill}; "
                  f"the replay verification over the period: {'OK' if summary['verification']['ok'] else 'FAILED'}")
    evidence.series("GPU-hours per project and model in the pack", "GPU-hours",
                    [(f"{r['project']} {r['gpu_model']}{' borrowed' if r['borrowed'] else ''}", r["gpu_hours"])
                     for r in cost])


@answers(GROUP, "设备或运行时升级后，历史任务和资源账目是否还能追溯？ After a driver upgrade, can past jobs and the "
                "accounts still be traced to the devices they ran on?", eight=(7,))
def test_history_and_accounts_survive_a_driver_upgrade(pool, evidence, tmp_path):
    job = submit(pool, "alice", "g4-before-upgrade", compute_milli=1000, gpu_memory_mib=8192, duration_s=2,
                 constraints={"datacenter": "dc-fault"})
    wait_state(pool, job, "completed")
    card = placements(pool, job)[0]["assignments"][0]["gpu_uuid"]
    node = placements(pool, job)[0]["node"]
    fleet = HERE / ("fault-1.yaml" if node == "fault-1" else "fault-2.yaml")
    upgraded = tmp_path / "upgraded.yaml"
    upgraded.write_text(fleet.read_text().replace("labels:", "driver: '560.35.03', cuda: '12.6', labels:"))
    agent = "agent-f1" if node == "fault-1" else "agent-f2"
    pool.stop_process(agent)
    pool.spawn(agent, "agent", "--simulate", str(upgraded), "--group", f"gpupool-agent-{agent}",
               "--control", str(pool.controls[agent]))
    wait_for(lambda: any('"driver_version":"560.35.03"' in r["payload"] for r in pool.query(
        "SELECT payload FROM gpupool.events FINAL WHERE kind = 'node.inventory' AND node = {n:String}",
        {"n": node})), 60, "the upgraded inventory", pool)
    inv = pool.query("SELECT event_time_ms, payload FROM gpupool.events FINAL WHERE kind = 'node.inventory' "
                     "AND node = {n:String} ORDER BY event_time_ms", {"n": node})
    versions = []
    for r in inv:
        g = next(g for g in json.loads(r["payload"])["gpus"] if g["uuid"] == card)
        versions.append([r["event_time_ms"], card, g["driver_version"], g["cuda_version"]])
    assert versions[0][2] != versions[-1][2] == "560.35.03"  # the same card, now on another driver
    usage = pool.query("SELECT node, gpu_model, gpu_milli_ms FROM gpupool.usage FINAL WHERE job_id = {j:String}",
                       {"j": job})
    assert usage and all(u["node"] == node for u in usage)
    after = submit(pool, "alice", "g4-after-upgrade", compute_milli=1000, gpu_memory_mib=8192, duration_s=2,
                   constraints={"datacenter": "dc-fault", "min_driver": "560"})
    wait_state(pool, after, "completed")
    assert placements(pool, after)[0]["node"] == node  # only the upgraded node has that driver
    evidence.table("the card's inventory over time (the log keeps every version)",
                   ["event_time_ms", "card", "driver", "CUDA"], versions)
    evidence.events("a job before and one after the upgrade, on the same card's node", timeline(pool, [job, after]))
