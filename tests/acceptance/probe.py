"""What the acceptance checks do and look at, as a user and an operator would: requests through their principals'
inboxes, answers through the worker's API and the bill's tables."""
from __future__ import annotations

import time

import orjson

from agents.evidence import iso
from schemas.events import JobRequested
from tests.live import job_states, wait_for


def submit(pool, user: str, job_id: str, **fields) -> str:
    tenant = pool.client(user).creds.tenant
    fields.setdefault("compute_milli", 100)
    fields.setdefault("gpu_memory_mib", 1024)
    pool.client(user).send([JobRequested(job_id=job_id, tenant=tenant, **fields)])
    return f"{tenant}/{job_id}"


def state(pool, job: str, user: str = "admin") -> dict:
    return job_states(pool, user).get(job, {})


def wait_state(pool, job: str, *states: str, timeout: float = 90, user: str = "admin") -> dict:
    return wait_for(lambda: (r := state(pool, job, user)).get("state") in states and r, timeout,
                    f"{job} in {states}", pool)


def history(pool, job: str, user: str = "admin") -> list[dict]:
    return pool.client(user).api("/api/history", {"job": job})["events"]


def placements(pool, job: str) -> list[dict]:
    return [e["payload"] for e in history(pool, job) if e["kind"] == "cmd.place"]


def what(e: dict) -> str:
    p = e["payload"]
    reasons = "; ".join(f"{r['code']}" + (f": {r['message']}" if r.get("message") else "") for r in e["reasons"])
    if e["kind"] == "cmd.place":
        cards = ", ".join(f"{a['gpu_uuid']} {a['milli']}m" + (f" {a['mig_profile']}" if a.get("mig_profile") else "")
                          for a in p["assignments"])
        return f"{cards}; {reasons}"
    return reasons or ", ".join(f"{k}={v}" for k, v in p.items() if k not in ("kind", "job_id", "node")
                                and v not in ("", None, [], {}))[:200]


def timeline(pool, jobs: list[str], user: str = "admin") -> list[dict]:
    out = []
    for j in jobs:
        for e in history(pool, j, user):
            out.append({"at": iso(e["time_ms"]), "ms": e["time_ms"], "kind": e["kind"], "node": e["node"],
                        "job": j, "what": f"{j}: {what(e)}"})
    return sorted(out, key=lambda e: e["ms"])


def nodes(pool, user: str = "admin") -> dict[str, dict]:
    return {n["node"]: n for n in pool.client(user).api("/api/nodes")["nodes"]}


def rows(pool, sql: str, params: dict | None = None) -> list[dict]:
    return pool.query(sql, params)


def payloads(pool, kind: str, job: str) -> list[dict]:
    return [orjson.loads(r["payload"]) for r in pool.query(
        "SELECT payload FROM gpupool.events FINAL WHERE kind = {k:String} AND job_id = {j:String} "
        "ORDER BY event_time_ms, topic, partition, offset", {"k": kind, "j": job})]


def settle(seconds: float = 1.5) -> None:
    time.sleep(seconds)
