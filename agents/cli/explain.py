"""`explain` and `history` for people: local ISO times, every reason as a sentence (the scheduler's own message, or,
where it gave only a code and data, what that code means), one block per gang with its parts listed, the isolation
asked for, and the cost so far. Pure: documents in, lines out (tests/test_explain_text.py)."""
from __future__ import annotations

import re
import shlex

from agents.cli.output import duration, mib, when
from streams.folds.exits import BACKOFF_BASE_MS, BACKOFF_CAP_MS, exit_label, failure_text

# an epoch-milliseconds instant in a message ("last at 1796128512698 ms"), said as a time instead
_EPOCH_MS = re.compile(r"\b(1\d{12})(?: ?ms)?\b")


def _times(text: str) -> str:
    return _EPOCH_MS.sub(lambda m: when(int(m.group(1))), text)


def _value(key: str, v) -> str:
    return when(v) if isinstance(v, int) and key.endswith("_ms") and v >= 10 ** 12 else str(v)

# What a reason code means when the scheduler said no more than the code and its data.
MEANING = {
    "QuotaExceeded": "over the tenant's quota and its borrowing cap: waits until its own usage falls",
    "Borrowing": "within the borrowing cap but beyond the quota: runs on borrowed capacity, preemptible",
    "WithinQuota": "within the tenant's quota",
    "NoQuota": "the tenant has no quota: nothing of it runs until an operator sets one",
    "NoQuotaConfigured": "the tenant has no quota: nothing of it runs until an operator sets one",
    "ProjectQuotaExceeded": "over the project's quota",
    "Cycle": "decided in this scheduling cycle",
    "WindowPassed": "the reservation's window has passed",
    "ServiceRemoved": "the service was removed",
    "Demand": "the service's demand",
    "NoCapacity": "no node has room for it now",
    "NoNodes": "no node is available",
    "NoNodeMatches": "no node matches its constraints",
    "Preempting": "lower-priority work is being checkpointed and stopped to make room",
    "PreemptedFor": "stopped (after a checkpoint) to make room for more important work",
    "NodeLost": "its node went silent for two heartbeats: billed to the last one, requeued",
    "BackOff": "a run failed and the job has a retry left: it is placed again after a back-off",
    "GpuFault": "a card it held failed: billed to the fault, requeued",
    "Placed": "placed",
    "MinReplicas": "the service runs fewer replicas than its minimum",
    "LatencyOverTarget": "p99 latency is over the service's target",
    "UtilizationHigh": "the replicas' utilization is high",
    "LoadLow": "the load is low enough to serve with fewer replicas",
    "ReplicasReady": "the new replicas report ready",
    "MigCarve": "a card is being carved into MIG instances for it",
    "MigReconfiguring": "waits while a card's MIG layout changes",
    "Topology": "placed across more of the network than ideal",
    "Unsatisfiable": "no node of the pool could ever hold it",
    "unsatisfiable": "no node of the pool could ever hold it",
    "duplicate_job_id": "a different request already uses this job id",
    "DuplicateJobId": "a different request already uses this job id",
}

DECISIONS = ("job.requested", "job.pending", "job.rejected", "cmd.place", "cmd.preempt", "cmd.resize", "cmd.migrate",
             "cmd.release", "job.interrupted", "job.started", "job.stopped", "job.completed", "job.failed",
             "job.cancelled")


def reason_text(r: dict) -> str:
    """One reason as a sentence: [plugin] Code: message (or what the code means), data."""
    data = " ".join(f"{k}={_value(k, v)}" for k, v in sorted((r.get("data") or {}).items()))
    text = _times(r.get("message") or MEANING.get(r.get("code", ""), ""))
    plugin = f"[{r['plugin']}] " if r.get("plugin") else ""
    body = "; ".join(x for x in (text, data) if x)
    if r.get("nodes"):
        body = "; ".join(x for x in (body, "nodes " + ", ".join(r["nodes"])) if x)
    return f"{plugin}{r.get('code', '?')}" + (f": {body}" if body else "")


def reason_lines(reasons: list[dict], indent: str) -> list[str]:
    return [indent + reason_text(r) for r in reasons]


def _part(e: dict, cards: dict[str, dict]) -> str:
    p = e["payload"]
    share = sum(a["milli"] for a in p["assignments"])
    models = sorted({cards.get(a["gpu_uuid"], {}).get("model", "") for a in p["assignments"]} - {""})
    migs = [a["mig_profile"] for a in p["assignments"] if a.get("mig_profile")]
    what = f"MIG {', '.join(migs)}" if migs else f"{len(p['assignments'])} card(s), {share} milli-GPU" \
        if p["assignments"] else f"CPU-only, {p.get('cpu_milli', 0)} milli-CPU, {p.get('memory_mib', 0)} MiB"
    return f"{p['node']}: {what}" + (f" ({', '.join(models)})" if models else "")


def blocks(events: list[dict]) -> list[list[dict]]:
    """Events in order, a gang's placement parts (same attempt, same time) in one block."""
    out: list[list[dict]] = []
    for e in events:
        prev = out[-1][0] if out else None
        if (prev is not None and e["kind"] == "cmd.place" == prev["kind"]
                and e["time_ms"] == prev["time_ms"]
                and e["payload"].get("attempt") == prev["payload"].get("attempt")
                and e["payload"].get("gang_size", 1) > 1):
            out[-1].append(e)
        else:
            out.append([e])
    return out


def _isolation(req: dict) -> str:
    """The isolation asked for, or the tier's default (schemas.events.DEFAULT_ISOLATION) when the request said none."""
    from schemas.events import DEFAULT_ISOLATION, Tier

    if req.get("isolation"):
        return req["isolation"]
    try:
        return f"{DEFAULT_ISOLATION[Tier(req.get('tier', 'offline'))]} (the tier's default)"
    except ValueError:
        return "not stated"


def program_lines(p: dict, indent: str) -> list[str]:
    """What program a job asked for (job.requested, else its placement: cmd.place carries the same): the argv (as
    a shell would quote it, though none runs it), the image or a plain process, every environment variable with its
    value (the tenant's own), the volumes and the working directory; its retries. None of it: the simulated stand-in
    run."""
    lines = []
    if p.get("command"):
        where = f"in image {p['image']}" if p.get("image") else "as a plain process (no image)"
        lines.append(f"{indent}program: {shlex.join(p['command'])}  ({where})")
    elif p.get("image"):
        lines.append(f"{indent}program: the image's own command, in image {p['image']}")
    env = p.get("env") or {}
    if env:
        lines.append(f"{indent}env: " + ", ".join(f"{k}={shlex.quote(str(v))}" for k, v in sorted(env.items())))
    vols = p.get("volumes") or ()
    if vols:
        lines.append(f"{indent}volumes: " + ", ".join(
            f"{v['volume']}:{v['path']}:{'ro' if v.get('read_only', True) else 'rw'}" for v in vols))
    if p.get("workdir"):
        lines.append(f"{indent}workdir: {p['workdir']}")
    if p.get("retries"):
        lines.append(f"{indent}retries: {p['retries']} (a failed run is placed again after {BACKOFF_BASE_MS // 1000} s,"
                     f" doubling per failure, at most {BACKOFF_CAP_MS // 60_000} min)")
    return lines


def _program(events: list[dict]) -> dict | None:
    return next((e["payload"] for e in events if e["kind"] == "job.requested"), None) or next(
        (e["payload"] for e in events if e["kind"] == "cmd.place"), None)


def header(job: str, events: list[dict]) -> list[str]:
    req = next((e["payload"] for e in events if e["kind"] == "job.requested"), None)
    if req is None:
        place = _program(events)
        return [job] + (program_lines(place, "  ") if place else [])
    isolation = _isolation(req)
    return [f"{job}  tier {req.get('tier')}, {req['compute_milli']} milli-CU, {mib(req['gpu_memory_mib'])} GPU memory, "
            f"project {req.get('project', 'default')}, isolation {isolation}"] + program_lines(req, "  ")


def failure(p: dict) -> str:
    """A failed run's end in words: its exit code, signal or other code and the node's reason (a report from before
    exit reasons: its reason alone, as it always read)."""
    return failure_text(p.get("code"), p.get("reason", ""), p.get("exit_code"), p.get("signal"))


def ending_lines(events: list[dict], indent: str = "", standing: dict | None = None) -> list[str]:
    """How a job that asked for retries ended, as the jobs list says it (`standing`: its row of /api/jobs -- the job
    view's fold decided it, docs/jobs.md "A job's state"): "failed after N runs" once they are spent, "completed
    after N failed run(s)" when a retry made it; nothing while a retry is left (the BackOff reason says when), for a
    job that asked for none (its one job.failed line says it all), or when the list has no row of it."""
    if standing is None:
        return []
    failures, retries = int(standing.get("failures") or 0), int(standing.get("retries") or 0)
    if not failures or not retries:
        return []
    if standing.get("state") == "completed":
        return [f"{indent}completed after {failures} failed run(s)"]
    if standing.get("state") != "failed":
        return []
    failed = [e for e in events if e["kind"] == "job.failed"]
    last = failed[-1]["payload"] if failed else {}
    label = (exit_label(last.get("code"), last.get("exit_code"), last.get("signal")) or standing.get("last_exit")
             or "failed")
    words = f": {failure(last)}" if last else ""
    return [f"{indent}failed after {failures} runs ({retries} retries spent); the last: {label}{words}"]


def _unique_reasons(block: list[dict]) -> list[dict]:
    seen, out = set(), []
    for e in block:
        for r in e.get("reasons") or ():
            key = repr(sorted(r.items()))
            if key not in seen:
                seen.add(key)
                out.append(r)
    return out


def event_line(block: list[dict], cards: dict[str, dict]) -> list[str]:
    e = block[0]
    kind, p = e["kind"], e["payload"]
    who = f"  by {e['actor']}" if e.get("actor") else ""
    if kind == "cmd.place":
        n = p.get("gang_size", 1)
        attempt = f" (attempt {p['attempt']})" if p.get("attempt", 0) > 1 else ""
        if n > 1:  # every part resumes from the one checkpoint of the gang, and borrows or not as one
            lines = [f"{when(e['time_ms'])}  cmd.place  gang of {n} parts{attempt}"
                     + (", resuming from " + p["resume_from"] if p.get("resume_from") else "")
                     + (", borrowed" if p.get("borrowed") else "")]
            lines += [f"    part {x['payload'].get('gang_index', 0) + 1}/{n} on {_part(x, cards)}"
                      for x in sorted(block, key=lambda x: x["payload"].get("gang_index", 0))]
            if len(block) < n:
                lines.append(f"    ({n - len(block)} part(s) not recorded yet)")
            return lines
        return [f"{when(e['time_ms'])}  cmd.place  {_part(e, cards)}{attempt}"
                + (", resuming from " + p["resume_from"] if p.get("resume_from") else "")
                + (", borrowed" if p.get("borrowed") else "")]
    if kind == "job.failed":
        attempt = f" (attempt {p['attempt']})" if p.get("attempt") else ""
        return [f"{when(e['time_ms'])}  job.failed  {e.get('node') or p.get('node') or '-'}{attempt}: {failure(p)}"]
    return [f"{when(e['time_ms'])}  {kind}  {e.get('node') or '-'}{who}"]


def explain_lines(job: str, events: list[dict], cards: dict[str, dict] | None = None,
                  cost: str | None = None, standing: dict | None = None) -> list[str]:
    """`gpupool explain`: the decisions about a job with every reason, a gang's parts in one block; `standing`: its
    row of the jobs list, which says how it ended."""
    cards = cards or {}
    shown = [e for e in events if e["kind"] in DECISIONS]
    lines = header(job, events)
    for block in blocks(shown):
        lines += event_line(block, cards)
        lines += reason_lines(_unique_reasons(block), "    ")
    lines += ending_lines(events, "", standing)
    lines.append(cost_line(events, cost))
    return lines


def answer_lines(block: list[dict], cards: dict[str, dict]) -> list[str]:
    """The scheduler's first answer to a request (`gpupool submit` reads it back): placed where (a gang's parts in
    one block), waiting why, or rejected why, each with its reasons."""
    e = block[0]
    if e["kind"] == "cmd.place":
        first, *rest = event_line(block, cards)
        return [first.split("  cmd.place  ", 1)[1].join(("placed on ", ""))] + rest
    head = "waiting" if e["kind"] == "job.pending" else summary(e)
    return [head] + reason_lines(_unique_reasons(block), "    ")


def cost_line(events: list[dict], cost: str | None = None) -> str:
    billed = sum(e["payload"]["gpu_milli_ms"] for e in events if e["kind"] == "usage.accrued")
    return f"cost so far: {billed / 1e6:.3f} GPU-seconds" + (f", {cost}" if cost else "")


# What a kind says in one line when its node is all there is to say.
ON_NODE = {"job.started": "started on {node}", "cmd.preempt": "told to checkpoint and stop on {node}",
           "cmd.release": "released on {node}", "job.completed": "completed on {node}"}


def summary(e: dict) -> str:
    p, kind = e["payload"], e["kind"]
    if kind in ON_NODE:
        return ON_NODE[kind].format(node=p.get("node") or "-")
    if kind == "job.requested":
        return (f"requested {p['compute_milli']} milli-CU, {mib(p['gpu_memory_mib'])} GPU memory, tier {p['tier']}, "
                f"project {p.get('project', 'default')}, isolation {_isolation(p)}"
                + (f", by {e['actor']}" if e.get("actor") else ""))
    if kind == "job.checkpointed":
        return f"checkpoint at {duration(p['progress_ms'])} of work ({p.get('checkpoint') or '-'})"
    if kind == "job.stopped":
        return f"stopped on {p['node']} after {duration(p.get('progress_ms', 0))} of work" + (
            f" ({p['reason']})" if p.get("reason") else "")
    if kind == "job.failed":
        attempt = f" (attempt {p['attempt']})" if p.get("attempt") else ""
        return f"failed on {p.get('node') or '-'}{attempt}: {failure(p)}"
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
    if kind == "job.interrupted":
        return f"interrupted on {p.get('node') or '-'}: {p['code']}, billed to {when(p.get('billed_to_ms'))}"
    if kind == "cmd.resize":
        return f"resized on {p['node']} to {sum(a['milli'] for a in p['assignments'])} milli-GPU"
    if kind == "cmd.migrate":
        return f"moving from {p['from_node']} to {p['to_node']}"
    return kind


SHOWN_IN_HISTORY = {"job.requested", "cmd.place", "job.started", "job.checkpointed", "cmd.preempt", "job.stopped",
                    "cmd.release", "job.completed", "job.failed", "job.cancelled", "usage.accrued", "job.pending",
                    "job.rejected", "cmd.resize", "cmd.migrate", "job.interrupted"}
WITH_REASONS = {"cmd.place", "cmd.preempt", "job.pending", "job.rejected", "cmd.migrate", "job.interrupted",
                "cmd.resize"}


def history_lines(job: str, events: list[dict], cards: dict[str, dict] | None = None,
                  cost: str | None = None, standing: dict | None = None) -> list[str]:
    """`gpupool history`: the whole life, like Slurm's sacct, a gang's placement parts in one block; `standing`: its
    row of the jobs list, which says how it ended."""
    cards = cards or {}
    lines = [job]
    for block in blocks([e for e in events if e["kind"] in SHOWN_IN_HISTORY]):
        e = block[0]
        if e["kind"] == "cmd.place":
            first, *rest = event_line(block, cards)
            lines.append("  " + first.replace("  cmd.place  ", "  placed on ", 1))
            lines += ["  " + x for x in rest]
        else:
            lines.append(f"  {when(e['time_ms'])}  {summary(e)}")
        if e["kind"] == "job.requested":
            lines += program_lines(e["payload"], "        ")
        if e["kind"] in WITH_REASONS:
            lines += reason_lines(_unique_reasons(block), "        ")
    lines += ending_lines(events, "  ", standing)
    lines.append("  " + cost_line(events, cost))
    return lines
