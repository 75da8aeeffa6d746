"""Commands that read: each asks the worker's HTTP API as the acting principal, which answers what that principal
may see (a tenant: its own tenant's jobs and bill)."""
from __future__ import annotations

import json

from agents.cli.output import duration, emit, mib, parse_time, when
from agents.client import Client


def _job(c: Client, job: str) -> str:
    return c.qualify(c.creds.tenant, job) if c.creds.role == "tenant" and "/" not in job else job


def cmd_jobs(cfg, args) -> int:
    cols, rows = Client(cfg).rows("/api/jobs", {
        "tenant": args.tenant, "project": args.project, "state": args.state, "tier": args.tier,
        "since": parse_time(args.since)})
    emit(cols, rows, args.format)
    return 0


def cmd_billing(cfg, args) -> int:
    cols, rows = Client(cfg).rows("/api/billing", {
        "by": args.by, "tenant": args.tenant, "project": args.project, "since": parse_time(args.since),
        "until": parse_time(args.until), "cost": "1" if args.cost else None})
    emit(cols, rows, args.format)
    return 0


def cmd_sql(cfg, args) -> int:
    cols, rows = Client(cfg).sql(args.statement)
    emit(cols, rows, args.format)
    return 0


def cmd_cluster(cfg, args) -> int:
    doc = Client(cfg).api("/cluster/")
    if args.format == "json":
        print(json.dumps(doc))
        return 0
    print(f"nodes {doc['nodes']}  cards {doc['cards']}  unhealthy {doc['unhealthy_cards']}  "
          f"unschedulable {len(doc['unschedulable_nodes'])}")
    print(f"allocated {doc['allocated_milli'] / 1000:.2f} of {doc['capacity_milli'] / 1000:.0f} GPUs "
          f"({doc['allocation_permille'] / 10:.1f}%); fragmentation {doc['fragmentation_milli'] / 1000:.2f} GPUs "
          f"({doc['fragmentation_permille'] / 10:.1f}% of free)")
    for dim in ("model", "rack", "datacenter"):
        free = ", ".join(f"{k} {v / 1000:.2f}" for k, v in doc[f"free_milli_by_{dim}"].items())
        print(f"free GPUs by {dim}: {free}")
    return 0


def _reasons(reasons: list[dict], indent: str = "    ") -> list[str]:
    out = []
    for r in reasons:
        extra = " ".join(f"{k}={v}" for k, v in sorted(r.get("data", {}).items()))
        plugin = f"[{r['plugin']}] " if r.get("plugin") else ""
        text = " ".join(x for x in (r.get("message", ""), extra) if x)
        out.append(f"{indent}{plugin}{r['code']}" + (f": {text}" if text else ""))
    return out


def cmd_explain(cfg, args) -> int:
    c = Client(cfg)
    job = _job(c, args.job)
    doc = c.api("/api/explain", {"job": job})
    if args.format == "json":
        print(json.dumps(doc))
        return 0
    if not doc["events"]:
        print(f"no scheduling decisions recorded for {job}")
        return 1
    for e in doc["events"]:
        who = f"  by {e['actor']}" if e.get("actor") else ""
        print(f"{when(e['time_ms'])}  {e['kind']}  {e['node'] or '-'}{who}")
        for line in _reasons(e["reasons"]):
            print(line)
    return 0


def _summary(e: dict) -> str:
    p, kind = e["payload"], e["kind"]
    if kind == "job.requested":
        return (f"requested {p['compute_milli']} milli-CU, {mib(p['gpu_memory_mib'])} GPU memory, tier {p['tier']}, "
                f"project {p.get('project', 'default')}" + (f", by {e['actor']}" if e.get("actor") else ""))
    if kind == "cmd.place":
        cards = len(p["assignments"])
        share = sum(a["milli"] for a in p["assignments"])
        gang = f", gang part {p['gang_index'] + 1}/{p['gang_size']}" if p.get("gang_size", 1) > 1 else ""
        resume = f", resuming from {p['resume_from']}" if p.get("resume_from") else ""
        borrowed = ", borrowed" if p.get("borrowed") else ""
        return f"placed on {p['node']}: {cards} card(s), {share} milli-GPU{gang}{resume}{borrowed}"
    if kind == "job.started":
        return f"started on {p['node']}"
    if kind == "job.checkpointed":
        return f"checkpoint at {duration(p['progress_ms'])} of work ({p.get('checkpoint') or '-'})"
    if kind == "cmd.preempt":
        return f"told to checkpoint and stop on {p['node']}"
    if kind == "job.stopped":
        return f"stopped on {p['node']} after {duration(p.get('progress_ms', 0))} of work"
    if kind == "cmd.release":
        return f"released on {p['node']}"
    if kind == "job.completed":
        return f"completed on {p['node']}"
    if kind == "job.failed":
        return f"failed on {p.get('node') or '-'}: {p.get('reason', '')}"
    if kind == "job.cancelled":
        return "cancelled" + (f" by {e['actor']}" if e.get("actor") else "") + (
            f": {p['reason']}" if p.get("reason") else "")
    if kind == "usage.accrued":
        borrowed = " (borrowed)" if p.get("borrowed") else ""
        return (f"billed {p['gpu_milli_ms'] / 1e6:.3f} GPU-s on {p['node']} ({p['gpu_model']}), "
                f"{duration(p['end_ms'] - p['start_ms'])} x {p['gpu_milli']} milli-GPU{borrowed}")
    if kind == "job.pending":
        return "waiting"
    if kind == "job.rejected":
        return f"rejected: {p['code']}"
    if kind == "cmd.resize":
        return f"resized on {p['node']} to {sum(a['milli'] for a in p['assignments'])} milli-GPU"
    if kind == "cmd.migrate":
        return f"moving from {p['from_node']} to {p['to_node']}"
    return kind


SHOWN_IN_HISTORY = {"job.requested", "cmd.place", "job.started", "job.checkpointed", "cmd.preempt", "job.stopped",
                    "cmd.release", "job.completed", "job.failed", "job.cancelled", "usage.accrued", "job.pending",
                    "job.rejected", "cmd.resize", "cmd.migrate", "job.interrupted"}


def cmd_history(cfg, args) -> int:
    """A job's whole life, like Slurm's sacct: requested, each placement, checkpoint, preemption, resume, stop, bill
    and end, with times, nodes and reasons."""
    c = Client(cfg)
    job = _job(c, args.job)
    doc = c.api("/api/history", {"job": job})
    if args.format == "json":
        print(json.dumps(doc))
        return 0
    events = [e for e in doc["events"] if e["kind"] in SHOWN_IN_HISTORY]
    if not events:
        print(f"nothing recorded for {job}")
        return 1
    print(job)
    billed = 0
    for e in events:
        if e["kind"] == "usage.accrued":
            billed += e["payload"]["gpu_milli_ms"]
        print(f"  {when(e['time_ms'])}  {_summary(e)}")
        if e["kind"] in ("cmd.place", "cmd.preempt", "job.pending", "job.rejected", "cmd.migrate", "job.interrupted"):
            for line in _reasons(e["reasons"], "        "):
                print(line)
    print(f"  billed so far: {billed / 1e6:.3f} GPU-seconds")
    return 0


def cmd_quota_show(cfg, args) -> int:
    cols, rows = Client(cfg).rows("/api/quota", {"tenant": args.tenant})
    if args.format != "table":
        emit(cols, rows, args.format)
        return 0
    out = []
    for r in rows:
        d = dict(zip(cols, r))
        quota = d.get("quota_milli")
        out.append([d["tenant"], d["project"] or "(tenant)", quota if quota else "-",
                    f"{d['overcommit_pct']}%" if d.get("overcommit_pct") else "-", d.get("used_milli") or 0,
                    d.get("reserved_milli") or 0, d.get("borrowed_milli") or 0,
                    mib(d["used_memory_mib"]) if d.get("used_memory_mib") else "0",
                    d.get("quota_set_by") or "-"])
    emit(["tenant", "project", "quota_milli", "cap", "used_milli", "reserved_milli", "borrowed_milli",
          "used_gpu_memory", "set_by"], out, "table")
    return 0


def cmd_node_list(cfg, args) -> int:
    doc = Client(cfg).api("/api/nodes")
    if args.format == "json":
        print(json.dumps(doc))
        return 0
    rows = []
    for n in doc["nodes"]:
        models: dict[str, int] = {}
        for g in n["cards"]:
            models[g["model"]] = models.get(g["model"], 0) + 1
        free = sum(g["free_milli"] for g in n["cards"] if g["healthy"])
        bad = sum(1 for g in n["cards"] if not g["healthy"])
        rows.append([n["node"], n["state"], ", ".join(f"{k} x{v}" for k, v in sorted(models.items())),
                     f"{free / 1000:.2f}", bad, len(n["jobs"]), n["rack"], n["datacenter"]])
    emit(["node", "state", "cards", "free_gpus", "unhealthy", "jobs", "rack", "datacenter"], rows, "table")
    return 0


def cmd_node_show(cfg, args) -> int:
    doc = Client(cfg).api("/api/nodes")
    node = next((n for n in doc["nodes"] if n["node"] == args.nodes[0]), None)
    if node is None:
        raise SystemExit(f"no node {args.nodes[0]!r}")
    if args.format == "json":
        print(json.dumps(node))
        return 0
    print(f"{node['node']}  {node['state']}  rack {node['rack']}  datacenter {node['datacenter']}  "
          f"last heartbeat {when(node['last_heartbeat_ms'])}")
    print(f"  CPU {node['free_cpu_milli'] / 1000:g} of {node['cpu_milli'] / 1000:g} free; host memory "
          f"{mib(node['free_memory_mib'])} of {mib(node['memory_mib'])} free")
    for g in node["cards"]:
        health = "ok" if g["healthy"] else f"OUT OF SERVICE: {g['fault']}"
        holders = ", ".join(g["holders"]) or "-"
        print(f"  card {g['index']} {g['model']} {mib(g['memory_mib'])}: {health}; free {g['free_milli']} milli, "
              f"{mib(g['free_memory_mib'])}; held by {holders}")
        for i in g["mig"]:
            print(f"      MIG {i['profile']} {i['uuid']}: {', '.join(i['holders']) or 'free'}")
    return 0


def cmd_prices_show(cfg, args) -> int:
    cols, rows = Client(cfg).rows("/api/prices")
    if args.format == "table":
        rows = [[*r[:5], f"{r[5] / 1e6:.2f}", *r[6:]] for r in rows]
        cols = [*cols[:5], "per_gpu_hour", *cols[6:]]
    emit(cols, rows, args.format)
    return 0


def cmd_user_list(cfg, args) -> int:
    doc = Client(cfg).api("/api/principals")
    emit(["name", "role", "tenant"], [[p["name"], p["role"], p["tenant"] or ""] for p in doc["principals"]],
         args.format)
    return 0
