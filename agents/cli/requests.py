"""Commands that state something: each is a request to the acting principal's inbox, which the gateway turns into
a fact on the log (or answers with a rejection the principal can read)."""
from __future__ import annotations

import json
import sys
import time
import uuid
from pathlib import Path

import yaml

from agents.cli.output import parse_time, when
from agents.client import price_rows
from agents.client import Client


# A job file (`gpupool submit -f job.yaml`, docs/jobs.md): the submit options as keys (with - or _), and the program.
# A flag given on the command line wins over the file's key, as `sbatch` options win over `#SBATCH` lines.
SUBMIT_DEFAULTS = {
    "project": "default", "tier": "offline", "compute": None, "memory_gib": None, "cpu": 1000,
    "host_memory_mib": 1024, "duration": None, "checkpoint_every": 0, "model": None, "latency_sensitive": False,
    "max_spread": "datacenter", "nvlink": False, "reservation": None, "isolation": None, "job_id": None,
    "image": None, "env": None, "volume": None, "workdir": None, "retries": 0, "command": None,
}
JOB_FILE_ALIASES = {"volumes": "volume", "models": "model", "memory": "memory_gib", "checkpoint_interval":
                    "checkpoint_every", "id": "job_id", "name": "job_id"}


def load_job_file(path: str) -> dict:
    """The keys of a job file, checked: a key the file may not hold is an error that names it (a typo must not be
    dropped silently, as a misspelt `#SBATCH` line would be)."""
    text = sys.stdin.read() if path == "-" else Path(path).read_text()
    doc = yaml.safe_load(text) or {}
    if not isinstance(doc, dict):
        raise SystemExit(f"gpupool submit: {path}: a job file is a mapping of keys (docs/jobs.md)")
    out = {}
    for key, value in doc.items():
        name = JOB_FILE_ALIASES.get(str(key).replace("-", "_"), str(key).replace("-", "_"))
        if name not in SUBMIT_DEFAULTS:
            raise SystemExit(f"gpupool submit: {path}: unknown key {key!r} (keys: "
                             f"{', '.join(sorted(k.replace('_', '-') for k in SUBMIT_DEFAULTS))})")
        out[name] = value
    return out


def _env_pairs(items) -> dict[str, str]:
    if isinstance(items, dict):
        return {str(k): str(v) for k, v in items.items()}
    env = {}
    for item in items or ():
        name, eq, value = str(item).partition("=")
        if not eq:
            raise SystemExit(f"gpupool submit: --env {item!r}: want NAME=VALUE")
        env[name] = value
    return env


def submit_options(args) -> dict:
    """The submit options: the command line's, else the job file's, else the defaults."""
    doc = load_job_file(args.file) if getattr(args, "file", None) else {}
    opts = {}
    for name, default in SUBMIT_DEFAULTS.items():
        given = getattr(args, name, None)
        if name == "command":
            given = list(getattr(args, "program", None) or ()) or None
        opts[name] = given if given is not None else doc.get(name, default)
    if isinstance(opts["command"], str):
        raise SystemExit("gpupool submit: command: a list of arguments ([python, train.py, --lr, '3e-4']), not one "
                         "string: the node never runs it through a shell")
    for name in ("compute", "memory_gib"):
        if opts[name] is None:
            raise SystemExit(f"gpupool submit: --{name.replace('_', '-')} is required (on the command line or as "
                             f"`{name.replace('_', '-')}:` in the job file)")
    return opts


def job_request(args, job_id: str, tenant: str):
    from schemas.events import Constraints, JobRequested, Tier

    o = submit_options(args)
    models = o["model"]
    return JobRequested(
        job_id=job_id, tenant=tenant, project=o["project"], tier=Tier(o["tier"]),
        compute_milli=o["compute"], gpu_memory_mib=int(float(o["memory_gib"]) * 1024), cpu_milli=o["cpu"],
        memory_mib=o["host_memory_mib"], duration_s=o["duration"], latency_sensitive=o["latency_sensitive"],
        reservation_id=o["reservation"], checkpoint_interval_s=o["checkpoint_every"], isolation=o["isolation"],
        constraints=Constraints(models=tuple([models] if isinstance(models, str) else models or ()),
                                max_spread=o["max_spread"], interconnect="nvlink" if o["nvlink"] else "any"),
        image=o["image"], command=tuple(str(a) for a in o["command"] or ()), env=_env_pairs(o["env"]),
        workdir=o["workdir"] or "", retries=o["retries"],
        volumes=_mounts(o["volume"]))


def _mounts(items) -> tuple:
    from pydantic import ValidationError

    from schemas.program import Mount

    out = []
    for v in items or ():
        try:
            out.append(Mount.parse(v) if isinstance(v, str) else Mount(**v))
        except ValidationError:
            raise
        except (ValueError, TypeError) as exc:
            raise SystemExit(f"gpupool submit: {exc}") from None
    return tuple(out)


def cmd_submit(cfg, args) -> int:
    c = Client(cfg)
    tenant = c.own_tenant(args.tenant)
    job_id = submit_options(args)["job_id"] or f"job-{uuid.uuid4().hex[:10]}"
    req = job_request(args, job_id, tenant)
    ref = c.qualify(tenant, job_id)
    wait = getattr(args, "wait", 0.0)
    # a chosen id may name a job on record already: its requests so far tell ours apart (a fresh id has none)
    before = _requests(c, ref) if wait and job_id == submit_options(args)["job_id"] else []
    c.send([req])
    print(ref)
    return _submit_answer(c, ref, req, before, wait) if wait else 0


SUBMIT_POLL_S = 0.25


def _requests(c: Client, job: str) -> list[dict] | None:
    """The job's events on record, or None when the API cannot say."""
    try:
        return c.api("/api/history", {"job": job}, timeout=10.0)["events"]
    except SystemExit:
        return None


def _submit_answer(c: Client, job: str, req, before: list[dict] | None, wait_s: float) -> int:
    """What the scheduler answered this request, read back from the store for up to `wait_s` seconds, on stderr
    (stdout keeps the job's name alone, for scripts): placed where, waiting why, or rejected why -- like sbatch,
    a request no node could ever hold, or a different request under a used id, exits 1. The same request again
    is a no-op the scheduler does not answer: said at once, from the request on record."""
    from agents.cli import explain
    from agents.cli.views import _cards

    if before is None:
        return 0  # the API is not up: nothing to read back
    asked = {k: v for k, v in req.model_dump(mode="json").items() if k not in ("job_id", "tenant")}
    first = next((e for e in before if e["kind"] == "job.requested"), None)
    if first is not None and {k: v for k, v in first["payload"].items() if k not in ("job_id", "tenant")} == asked:
        state = _state_of(c, job)
        print(f"gpupool submit: {job}: the same request is on record already (sending it again changes nothing)"
              + (f"; {state}" if state else ""), file=sys.stderr)
        return 0
    mine = sum(1 for e in before if e["kind"] == "job.requested")  # ours is the next one stored
    refused = sum(1 for e in before if _at_the_door(e))
    deadline = time.monotonic() + wait_s
    while True:
        events = _requests(c, job) or []
        seen = [i for i, e in enumerate(events) if e["kind"] == "job.requested"]
        door = [e for e in events if _at_the_door(e)][refused:]
        if len(seen) <= mine and door:
            # refused by the gateway (rate_limited, an id too long...): never stored as a request, so answered here
            why = "; ".join(f"{r.get('code', '')}: {r.get('message', '')}" for r in door[0].get("reasons") or ())
            print(f"gpupool submit: {job}: rejected at the gateway ({door[0]['payload'].get('code')}): {why}",
                  file=sys.stderr)
            return 1
        if len(seen) > mine:
            after = events[seen[mine] + 1:]
            answer = next((e for e in after if e["kind"] in ("cmd.place", "job.pending", "job.rejected")), None)
            # a rejection answers a later request under a used id; anything else there is the first job's
            if answer is not None and (not mine or answer["kind"] == "job.rejected"):
                block = next(b for b in explain.blocks(after) if b[0] is answer)
                head, *rest = explain.answer_lines(block, _cards(c) if answer["kind"] == "cmd.place" else {})
                print("\n".join([f"gpupool submit: {job}: {head}", *rest]), file=sys.stderr)
                return 1 if answer["kind"] == "job.rejected" else 0
        if time.monotonic() >= deadline:
            print(f"gpupool submit: {job}: no answer from the scheduler within {wait_s:g} s (yet): "
                  f"`gpupool explain {job}` shows it once there is", file=sys.stderr)
            return 0
        time.sleep(SUBMIT_POLL_S)


def _at_the_door(event: dict) -> bool:
    """A refusal of the gateway's (its reasons name the Gateway plugin), not the scheduler's."""
    return event["kind"] == "job.rejected" and any(r.get("plugin") == "Gateway" for r in event.get("reasons") or ())


def _state_of(c: Client, job: str) -> str:
    """Where the job stands as the jobs list says it -- its view's fold decided it (gpupool.jobs, docs/jobs.md "A
    job's state") -- e.g. "running on node-00"; "" when the API cannot say or has no row of it yet."""
    from agents.cli.views import standing

    row = standing(c, job)
    if row is None:
        return ""
    return row["state"] + (f" on {row['nodes']}" if row.get("nodes") else "")


def _job_id(c: Client, job: str) -> str:
    return c.job_ref(job)


def cmd_cancel(cfg, args) -> int:
    from schemas.events import JobCancelled

    from agents.cli.views import _not_on_record

    c = Client(cfg)
    jobs = [_job_id(c, j) for j in args.jobs]
    # a cancel of a job nobody submitted changes nothing: say so, rather than let it look done (asked before the
    # cancel is sent, which is itself on record; the bill's store may lag a just-submitted job by a second: "yet")
    unknown = {j for j in jobs if not _submitted(c, j)}
    c.send([JobCancelled(job_id=j, reason=args.reason or "") for j in jobs])  # who: the gateway records it
    rc = 0
    for asked, j in zip(args.jobs, jobs):
        print(j)
        if j in unknown:
            why = _not_on_record(c, asked, j)
            print(f"gpupool cancel: {why} (yet); the cancel was sent", file=sys.stderr)
            rc = 1 if why != f"no job {j} on record" else rc  # a name read as another tenant's: a mistake to flag
    return rc


def _submitted(c: Client, job: str) -> bool:
    """Whether the job's request is on record (True when the API cannot say: nothing to warn of then)."""
    events = _requests(c, job)
    return events is None or any(e["kind"] == "job.requested" for e in events)


def cmd_quota_set(cfg, args) -> int:
    from schemas.events import QuotaSet

    if args.compute is None:
        raise SystemExit("quota set needs --compute (milli-CU)")
    q = QuotaSet(tenant=args.tenant, project=args.project, gpu_milli=args.compute,
                 gpu_memory_mib=int(args.memory_gib * 1024) if args.memory_gib is not None else None,
                 overcommit_pct=args.overcommit_pct)
    c = Client(cfg)
    sent_ms = time.time_ns() // 1_000_000
    c.send([q])
    return _quota_answer(c, q, sent_ms, args.wait)


QUOTA_GRACE_S = 3.0  # a refusal is stored after the set it answers (the scheduler read the set first): this long


def _quota_answer(c: Client, q, sent_ms: int, wait_s: float) -> int:
    """What became of a quota.set: refused (quota.rejected: the projects' quotas would add up to more than the
    tenant's), or stored and not refused within QUOTA_GRACE_S -- an accepted set has no answer of its own, so "in
    force" is said only after the grace -- read from the store, up to `wait_s` seconds; 1 when refused."""
    name = f"{q.tenant}/{q.project}" if q.project else q.tenant
    deadline = time.monotonic() + wait_s
    seen = None  # when the store first showed the set
    while True:
        try:
            cols, rows = c.rows("/api/quota", {"tenant": q.tenant})
        except SystemExit:
            rows, cols = [], []  # the API is not up: nothing to read back
        for r in (dict(zip(cols, r)) for r in rows):
            if r["tenant"] != q.tenant or (r["project"] or None) != q.project:
                continue
            if r.get("rejected_ms") and r["rejected_ms"] >= sent_ms - 1000 and r["rejected_milli"] == q.gpu_milli:
                print(f"gpupool quota set: {name}: refused ({r['rejected_code']}); the quota in force is still "
                      f"{r['quota_milli'] if r.get('quota_set_by') else 'none'}", file=sys.stderr)
                return 1
            if r.get("quota_milli") == q.gpu_milli and r.get("overcommit_pct") == q.overcommit_pct:
                seen = seen or time.monotonic()
                if time.monotonic() - seen >= QUOTA_GRACE_S:
                    print(f"{name}: quota {q.gpu_milli} milli-CU, cap {q.overcommit_pct}%, in force")
                    return 0
        if time.monotonic() >= deadline:
            if wait_s > 0:
                print(f"{name}: quota set sent; not in force after {wait_s:g} s (`gpupool quota show`)")
            return 0
        time.sleep(0.5)


def cmd_reserve(cfg, args) -> int:
    """Book capacity for a window (`reserve book`) or cancel a booking (`reserve cancel ID`)."""
    from schemas.events import ReservationCancelled, ReservationRequested, Tier

    c = Client(cfg)
    if args.action == "list":
        from agents.cli.output import emit, when

        cols, rows = c.rows("/api/reservations", {"tenant": args.tenant})
        if not rows and args.format == "table":
            print("no reservations on record")
            return 0
        i = {k: n for n, k in enumerate(cols)}
        if args.format == "table":  # the window as times, the rest as stored
            rows = [[*r[:i["start_ms"]], when(r[i["start_ms"]]), when(r[i["end_ms"]]), *r[i["end_ms"] + 1:]]
                    for r in rows]
            cols = [*cols[:i["start_ms"]], "start", "end", *cols[i["end_ms"] + 1:]]
        emit(cols, rows, args.format)
        return 0
    if args.action == "cancel":
        if not args.reservation_id:
            raise SystemExit("reserve cancel needs the reservation id")
        c.send([ReservationCancelled(reservation_id=args.reservation_id)])
        return 0
    missing = [f"--{k.replace('_', '-')}" for k in ("compute", "memory_gib") if getattr(args, k) is None]
    if missing:
        raise SystemExit(f"reserve book needs {', '.join(missing)}")
    tenant = c.own_tenant(args.tenant)
    rid = args.reservation_id or f"res-{uuid.uuid4().hex[:10]}"
    start = parse_time(args.start) if args.start else time.time_ns() // 1_000_000
    r = ReservationRequested(reservation_id=rid, tenant=tenant, project=args.project, tier=Tier(args.tier),
                             compute_milli=args.compute, gpu_memory_mib=int(args.memory_gib * 1024),
                             start_ms=start, end_ms=start + int(args.hours * 3_600_000))
    c.send([r])
    print(c.qualify(tenant, rid))
    return 0


def cmd_service(cfg, args) -> int:
    """Declare (or re-declare) an inference service with its SLO, or remove it."""
    from schemas.events import ServiceDeclared, ServiceRemoved
    from schemas.program import Serve

    c = Client(cfg)
    if args.action == "endpoints":
        return service_endpoints(c, args)
    if args.action == "remove":
        payload = ServiceRemoved(service_id=args.service_id)
    else:
        missing = [f"--{k.replace('_', '-')}" for k in ("compute", "memory_gib", "replica_qps")
                   if getattr(args, k) is None]
        if missing:
            raise SystemExit(f"service declare needs {', '.join(missing)}")
        payload = ServiceDeclared(
            service_id=args.service_id, tenant=c.own_tenant(args.tenant), project=args.project,
            replica_compute_milli=args.compute, replica_memory_mib=int(args.memory_gib * 1024),
            boost_compute_milli=args.boost, replica_qps=args.replica_qps, min_replicas=args.min_replicas,
            max_replicas=args.max_replicas, latency_target_ms=args.latency_ms, max_queue=args.max_queue,
            latency_sensitive=not args.not_latency_sensitive, scale_in_stable_s=args.scale_in_stable_s,
            scale_in_cooldown_s=args.scale_in_cooldown_s, image=args.image,
            command=tuple(getattr(args, "program", ()) or ()), env=_env_pairs(args.env),
            serve=None if args.port is None else Serve(port=args.port, readiness_path=args.readiness_path,
                                                       metrics=args.metrics, metrics_path=args.metrics_path))
    c.send([payload])
    if args.action == "remove":
        print(f"service {args.service_id}: removal sent (its replicas stop, each with its grace)")
        return 0
    p = payload
    boost = f" (+{p.boost_compute_milli} milli-CU each at a peak)" if p.boost_compute_milli else ""
    print(f"service {p.tenant}/{p.service_id.split('/')[-1]} declared: replicas of {p.replica_compute_milli} milli-CU "
          f"and {p.replica_memory_mib} MiB{boost}, {p.replica_qps} requests/s each, {p.min_replicas} to "
          f"{p.max_replicas} replicas, scaled from its load (`gpupool service endpoints {args.service_id}`)")
    return 0


def service_endpoints(c: Client, args) -> int:
    """`gpupool service endpoints NAME`: the replicas of one's own service, where they are and what they take."""
    params = {"service": c.job_ref(args.service_id)}
    if args.ramp_s is not None:
        params["ramp_s"] = str(args.ramp_s)
    doc = c.api("/api/service/endpoints", params)
    if args.format == "json":
        print(json.dumps(doc, indent=2, sort_keys=True))
        return 0
    rows = [["REPLICA", "NODE", "ADDRESS", "PORT", "STATE", "WEIGHT"]]
    for r in doc["replicas"]:
        rows.append([r["job_id"], r["node"], r["address"] or "-", str(r["port"] or "-"), r["state"], str(r["weight"])])
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip())
    return 0


def node_request(action: str, node: str, reason: str, revoke: bool = False):
    """cordon / uncordon / drain / remove / admit / clear (a card's health, NODE:INDEX or NODE:UUID)."""
    from schemas.events import NodeAdmitted, NodeCordon

    if action == "admit":
        return NodeAdmitted(node=node, admitted=not revoke, reason=reason)
    if action == "cordon":
        return NodeCordon(node=node, cordoned=True, reason=reason)
    if action == "uncordon":
        return NodeCordon(node=node, cordoned=False, reason=reason)
    if action == "drain":
        return NodeCordon(node=node, cordoned=True, drain=True, reason=reason)
    if action == "remove":
        from schemas.events import KINDS

        if "node.removed" not in KINDS:
            raise SystemExit("this version cannot remove nodes")
        return KINDS["node.removed"](node=node, reason=reason)
    raise SystemExit(f"node {action}: one of cordon, uncordon, drain, remove, admit")


# the state a node shows (streams/edge/api.node_state) once each change is applied
_NODE_STATE_AFTER = {"cordon": ("cordoned", "draining"), "drain": ("draining",), "remove": ("removed",),
                     "uncordon": ("ready", "not-admitted", "down", "no-inventory"), "admit": ("ready", "cordoned",
                     "draining", "down", "no-inventory"), "revoke": ("not-admitted",)}


def node_states(c: Client) -> dict[str, str]:
    return {n["node"]: n["state"] for n in c.api("/api/nodes")["nodes"]}


def cmd_node_change(cfg, args) -> int:
    """Sends the change, then reads the nodes back until each shows it (a few seconds: the worker folds the log) and
    prints each node's new state, or the state it still shows when the wait is over."""
    c = Client(cfg)
    revoke = getattr(args, "revoke", False)
    c.send([node_request(args.action, n, args.reason or "", revoke) for n in args.nodes])
    want = _NODE_STATE_AFTER.get("revoke" if args.action == "admit" and revoke else args.action)
    if want is None:
        return 0
    deadline = time.monotonic() + float(getattr(args, "wait", 20) or 20)
    while True:
        try:
            states = node_states(c)
        except SystemExit:  # the worker's API is away: the change is on the log all the same
            print(f"{args.action}: sent; the worker's API does not answer, so the new state is not read back")
            return 0
        pending = [n for n in args.nodes if states.get(n) not in want]
        if not pending or time.monotonic() >= deadline:
            break
        time.sleep(0.25)
    for n in args.nodes:
        state = states.get(n)
        if state is None:
            print(f"{n}: {args.action} sent; the pool has not heard of this node (yet)")
        elif n in pending:
            print(f"{n}: {args.action} sent; the node still shows {state}")
        else:
            print(f"{n}: {state}")
    return 0


# ---------------------------------------------------------------- prices


def cmd_prices_change(cfg, args) -> int:
    c = Client(cfg)
    since = parse_time(args.valid_from) if args.valid_from else time.time_ns() // 1_000_000
    if args.action == "load":
        try:
            text = Path(args.file).read_text()
        except OSError as exc:
            raise SystemExit(f"prices load: {exc}") from None
        if args.currency:
            raise SystemExit("prices load: the currency is the file's `currency:` (default USD), not --currency")
        rows = price_rows(text, since)
    else:
        row = {"gpu_model": args.model, "per_gpu_hour": args.per_gpu_hour, "borrowed": args.borrowed}
        if args.currency:
            row["currency"] = args.currency
        row.update({k: getattr(args, k) for k in ("datacenter", "tod_band", "tier") if getattr(args, k)})
        rows = price_rows(yaml.safe_dump({"prices": [row]}), since)
    c.send(rows)
    currencies = ", ".join(sorted({r.currency for r in rows}))
    print(f"{len(rows)} price(s) in {currencies} from {when(since)}")
    return 0
