"""Commands that read: each asks the worker's HTTP API as the acting principal, which answers what that principal
may see (a tenant: its own tenant's jobs and bill)."""
from __future__ import annotations

import json
import time

from agents.cli import explain
from agents.cli.output import emit, mib, parse_time, when
from agents.client import Client


def _job(c: Client, job: str) -> str:
    return c.job_ref(job)


def _not_on_record(c: Client, asked: str, job: str) -> str:
    """Why nothing is shown of a job no record names: a tenant's member reads its own tenant's jobs alone, and a name
    with a slash is still one of them ("chat/r2" is acme's "acme/chat/r2") -- say so, rather than leave another
    tenant's job to look like one that was never scheduled."""
    if c.creds.role == "tenant" and "/" in asked and asked != job:  # a name like another tenant's, read as its own
        return (f"no job {job} on record: {c.name} is a member of tenant {c.creds.tenant!r} and names its jobs "
                f"alone, so {asked!r} was read as {c.creds.tenant}'s job {asked!r}")
    return f"no job {job} on record"


def cmd_jobs(cfg, args) -> int:
    cols, rows = Client(cfg).rows("/api/jobs", {
        "tenant": args.tenant, "project": args.project, "state": args.state, "tier": args.tier,
        "since": parse_time(args.since)})
    if args.format == "table":
        cols, rows = jobs_table(cols, rows)
    emit(cols, rows, args.format)
    return 0


EXIT_COLUMNS = ("last_exit", "failures", "retries", "retry_at_ms")


def exit_cell(d: dict) -> str:
    """A job's runs' end as the jobs table says it: the last failed run's exit ("ExitCode 3", "Signal 9",
    "OOMKilled"...), and "retrying at TIME (run N of M failed)" while it waits out the back-off, or "failed after N
    runs" once its retries are spent; "-" when no run failed."""
    failures, retries, last = int(d.get("failures") or 0), int(d.get("retries") or 0), d.get("last_exit") or ""
    if not failures:
        return "-"
    last = last or "failed"
    if d.get("state") == "failed":
        return f"{last}, failed after {failures} runs" if retries else last
    if d.get("retry_at_ms"):
        return f"{last}, run {failures} of {retries + 1} failed, retrying at {when(int(d['retry_at_ms']))}"
    return f"{last} (run {failures} of {retries + 1} failed)"


def jobs_table(cols: list[str], rows: list) -> tuple[list[str], list]:
    """The table a person reads: the exit columns said as one (`exit_cell`); JSON and CSV keep them apart."""
    if not all(c in cols for c in EXIT_COLUMNS):
        return cols, rows  # an older worker's answer
    keep = [i for i, c in enumerate(cols) if c not in EXIT_COLUMNS]
    out = [[r[i] for i in keep] + [exit_cell(dict(zip(cols, r)))] for r in rows]
    return [cols[i] for i in keep] + ["exit"], out


def cmd_billing(cfg, args) -> int:
    cols, rows = Client(cfg).rows("/api/billing", {
        "by": args.by, "tenant": args.tenant, "project": args.project, "since": parse_time(args.since),
        "until": parse_time(args.until), "cost": "1" if args.cost else None})
    if args.cost and args.format == "table":  # a person reads the amounts in the currency's minor unit, with it
        keep = [c for c in cols if c not in ("own_micro", "borrowed_micro")]
        rows = [[r[cols.index(c)] for c in keep] for r in rows]
        cols = keep
    emit(cols, rows, args.format)
    return 0


def invoice_period(args) -> tuple[int, int]:
    """--month YYYY-MM (UTC) or --period FROM TO."""
    from streams.edge.api import ApiError, month_bounds

    if bool(args.month) == bool(args.period):
        raise SystemExit("invoice: one of --month YYYY-MM or --period FROM TO")
    if args.month:
        try:
            return month_bounds(args.month)
        except ApiError as exc:
            raise SystemExit(f"invoice: --{exc.message}") from None
    since, until = parse_time(args.period[0]), parse_time(args.period[1])
    if until <= since:
        raise SystemExit("invoice: --period FROM TO needs FROM before TO")
    return since, until


def cmd_invoice(cfg, args) -> int:
    """Each tenant's invoice for the period, written as CSV and HTML files into --out (finance without --tenant:
    every tenant with usage in it; a tenant: its own), one line per file written and its total(s)."""
    from pathlib import Path

    from schemas.money import show_minor
    from streams.edge import invoice_render

    since, until = invoice_period(args)
    doc = Client(cfg).api("/api/invoice", {"tenant": args.tenant, "since": since, "until": until})
    if args.format == "json":
        print(json.dumps(doc["invoices"], indent=1))
        return 0
    kinds = [k.strip() for k in args.format.split(",") if k.strip()]
    if not kinds or set(kinds) - {"csv", "html"}:
        raise SystemExit("invoice: --format csv, html, csv,html or json")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if not doc["invoices"]:
        print(f"no usage from {when(since)} to {when(until)}: no invoice")
    for inv in doc["invoices"]:
        stem = invoice_render.file_stem(inv)
        written = []
        if "csv" in kinds:
            (out / f"{stem}.csv").write_text(invoice_render.csv_text([inv]))
            written.append(str(out / f"{stem}.csv"))
        if "html" in kinds:
            (out / f"{stem}.html").write_text(invoice_render.html_page(inv, issued_ms=int(time.time() * 1000)))
            written.append(str(out / f"{stem}.html"))
        totals = ", ".join(f"{show_minor(s['total_minor'], s['currency'])} {s['currency']}"
                           for s in inv["currencies"]) or "nothing"
        unpriced = sum(u["milli_gpu_ms"] for u in inv["unpriced"])
        note = f" (+ {unpriced / 3.6e9:.4f} GPU-hours no price applied to)" if unpriced else ""
        print(f"{invoice_render.number(inv)}: {inv['tenant']} {totals}{note}: {' '.join(written)}")
    return 0


def cmd_sql(cfg, args) -> int:
    cols, rows = Client(cfg).sql(args.statement)
    emit(cols, rows, args.format)
    return 0


def cmd_cluster(cfg, args) -> int:
    c = Client(cfg)
    doc = c.api("/cluster/")
    if args.format == "json":
        print(json.dumps(doc))
        return 0
    print(f"nodes {doc['nodes']}  cards {doc['cards']}  unhealthy {doc['unhealthy_cards']}  "
          f"unschedulable {len(doc['unschedulable_nodes'])}")
    print(f"allocated {doc['allocated_milli'] / 1000:.2f} of {doc['capacity_milli'] / 1000:.0f} GPUs "
          f"({doc['allocation_permille'] / 10:.1f}%); fragmentation {doc['fragmentation_milli'] / 1000:.2f} GPUs "
          f"({doc['fragmentation_permille'] / 10:.1f}% of free)")
    kept = _kept_by(c)
    if kept["total"]:
        print(f"kept for reservations: {kept['total'] / 1000:.2f} GPUs (not free to other work; counted out below)")
    for dim in ("model", "rack", "datacenter"):
        free = ", ".join(f"{k} {(v - kept[dim].get(k, 0)) / 1000:.2f}" for k, v in doc[f"free_milli_by_{dim}"].items())
        print(f"free GPUs by {dim}: {free}")
    return 0


def _kept_by(c: Client) -> dict:
    """What reservation holds keep (milli-GPU) on ready nodes, by card model, rack and data center: the cluster's
    free figures come from the node views, which a hold never reaches (/api/nodes adds the holds)."""
    out: dict = {"model": {}, "rack": {}, "datacenter": {}, "total": 0}
    try:
        nodes = c.api("/api/nodes")["nodes"]
    except SystemExit:
        return out
    for n in nodes:
        if n["state"] != "ready":
            continue
        for g in n["cards"]:
            kept = g.get("reserved_milli", 0) if g["healthy"] else 0
            if kept:
                for dim, k in (("model", g["model"]), ("rack", n["rack"]), ("datacenter", n["datacenter"])):
                    out[dim][k] = out[dim].get(k, 0) + kept
                out["total"] += kept
    return out


def _cards(c: Client) -> dict[str, dict]:
    """Card uuid -> its card document (model, generation), for naming what a placement got."""
    try:
        return {g["uuid"]: g for n in c.api("/api/nodes")["nodes"] for g in n["cards"]}
    except SystemExit:
        return {}


def _cost(c: Client, job: str) -> str | None:
    """The job's bill priced by the price book, when the caller may read bills."""
    if c.creds.role not in ("tenant", "finance", "operator", "auditor"):
        return None
    try:
        cols, rows = c.rows("/api/billing", {"by": "job", "cost": "1", "tenant": job.split("/", 1)[0]
                                              if c.creds.role != "tenant" else None})
    except SystemExit:
        return None
    mine = [d for d in (dict(zip(cols, r)) for r in rows) if d.get("job_id") == job and d.get("currency")]
    if not mine:
        return None
    return "; ".join(f"{d['cost']} {d['currency']} at the price book's rates ({d['borrowed_cost']} {d['currency']} "
                     f"of it borrowed)" for d in mine)


def standing(c: Client, job: str) -> dict | None:
    """The job's row of the jobs list: where it stands as its view's fold decided it (gpupool.jobs, docs/jobs.md "A
    job's state"); None when the API cannot say or has no row of it yet."""
    try:
        doc = c.api("/api/jobs", {"job": job}, timeout=10.0)
    except SystemExit:
        return None
    rows = [dict(zip(doc["columns"], r)) for r in doc["rows"]]
    return rows[0] if rows else None


def cmd_explain(cfg, args) -> int:
    c = Client(cfg)
    job = _job(c, args.job)
    if args.format == "json":
        print(json.dumps(c.api("/api/explain", {"job": job})))
        return 0
    events = c.api("/api/history", {"job": job})["events"]
    if not events:
        print(_not_on_record(c, args.job, job))
        return 1
    if not any(e["kind"] in explain.DECISIONS for e in events):
        print(f"no scheduling decision recorded for {job} yet (`gpupool history {args.job}` shows what is)")
        return 1
    print("\n".join(explain.explain_lines(job, events, _cards(c), _cost(c, job), standing(c, job))))
    return 0


def cmd_history(cfg, args) -> int:
    """A job's whole life, like Slurm's sacct: requested, each placement, checkpoint, preemption, resume, stop, bill
    and end, with times, nodes and reasons."""
    c = Client(cfg)
    job = _job(c, args.job)
    doc = c.api("/api/history", {"job": job})
    if args.format == "json":
        print(json.dumps(doc))
        return 0
    if not doc["events"]:
        print(_not_on_record(c, args.job, job))
        return 1
    if not any(e["kind"] in explain.SHOWN_IN_HISTORY for e in doc["events"]):
        print(f"nothing recorded for {job}")
        return 1
    print("\n".join(explain.history_lines(job, doc["events"], _cards(c), _cost(c, job), standing(c, job))))
    return 0


def cmd_quota_show(cfg, args) -> int:
    cols, rows = Client(cfg).rows("/api/quota", {"tenant": args.tenant})
    if args.format != "table":
        emit(cols, rows, args.format)
        return 0
    out = []
    for r in rows:
        d = dict(zip(cols, r))
        if not d.get("quota_set_by") and not d.get("used_milli") and not d.get("reserved_milli") \
                and not d.get("used_memory_mib"):
            continue  # an account known only by a refused quota.set: no quota, nothing held (the json shows it)
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
        # a reservation's hold keeps cards the node's own view shows free: they are not free to other work
        held = sum(g.get("reserved_milli", 0) for g in n["cards"] if g["healthy"])
        free = sum(g["free_milli"] for g in n["cards"] if g["healthy"]) - held
        bad = sum(1 for g in n["cards"] if not g["healthy"])
        # free to take work: a node that is down, cordoned or draining has none (as `gpupool cluster` counts)
        rows.append([n["node"], n["state"], ", ".join(f"{k} x{v}" for k, v in sorted(models.items())),
                     f"{free / 1000:.2f}" if n["state"] == "ready" else f"- ({free / 1000:.2f} idle)",
                     f"{held / 1000:.2f}" if held else "-", bad, len(n["jobs"]), n["rack"], n["datacenter"]])
    emit(["node", "state", "cards", "free_gpus", "reserved_gpus", "unhealthy", "jobs", "rack", "datacenter"], rows,
         "table")
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
    idx = {g["uuid"]: g["index"] for g in node["cards"]}
    for g in node["cards"]:
        health = "ok" if g["healthy"] else f"OUT OF SERVICE: {g['fault']}"
        holders = ", ".join(g["holders"]) or "-"
        # a reservation's hold keeps capacity without a command to the node: free here is net of it
        kept = g.get("reserved_milli", 0)
        print(f"  card {g['index']} {g['model']} {mib(g['memory_mib'])}: {health}; free {g['free_milli'] - kept} "
              f"milli, {mib(g['free_memory_mib'] - g.get('reserved_memory_mib', 0))}; held by {holders}"
              + (f"; {kept} milli kept for a reservation" if kept else ""))
        for i in g["mig"]:
            print(f"      MIG {i['profile']} {i['uuid']}: {', '.join(i['holders']) or 'free'}")
    for h in node.get("holds", ()):
        rid = h["reservation_id"]  # another tenant's is not named (redacted for a tenant)
        whose = f"reservation {rid}" if "/" in rid else "a reservation of another tenant"
        print(f"  kept for {whose} ({h['milli']} milli-GPU, {mib(h['memory_mib'])} on card(s) "
              f"{', '.join(str(idx[u]) for u in h['cards'])}) until {when(h['end_ms'])}: not free to other work")
    return 0


def cmd_prices_show(cfg, args) -> int:
    cols, rows = Client(cfg).rows("/api/prices")
    if args.format == "table":  # the price in its currency, exactly (2.50 USD, 0.3456 USD, 150 JPY)
        from schemas.money import show_rate

        at, cur = cols.index("micro_per_gpu_hour"), cols.index("currency")
        rows = [[*r[:at], show_rate(int(r[at]), r[cur]), *r[at + 1:]] for r in rows]
        cols = [*cols[:at], "per_gpu_hour", *cols[at + 1:]]
    emit(cols, rows, args.format)
    return 0


def cmd_user_list(cfg, args) -> int:
    doc = Client(cfg).api("/api/principals")
    emit(["name", "role", "tenant", "nodes"],
         [[p["name"], p["role"], p["tenant"] or "",
           ",".join(p.get("nodes") or ()) + (" (auto-admit)" if p.get("auto_admit") else "")]
          for p in doc["principals"]], args.format)
    return 0
