"""The worker's HTTP API: who may ask what, and the queries behind each answer (docs/security.md).

Every request but /healthz carries a principal's token (`Authorization: Bearer TOKEN`, or HTTP Basic NAME:TOKEN);
the registry (principals topic) knows each token's SHA-256. A tenant sees only its own tenant's jobs, explanations
and bill, and an explanation shown to a tenant never names another tenant's job. Queries run in threads, never on
the event loop that folds and schedules; people's own SQL goes through infra/sql_guard.py.
"""
from __future__ import annotations

import asyncio
import inspect
import base64
import re
import threading

import orjson

from infra import security, sql_guard
from infra.kafka_admin import Acl
from infra.principals import acls_for
from infra.security import same_token
from streams.folds.gateway import KINDS_BY_ROLE, Principal

ALL_READERS = ("tenant", "operator", "finance", "auditor", "service")
# path -> (method, roles allowed, what it answers): the table docs/security.md shows and the tests walk
ENDPOINTS: dict[str, tuple[str, tuple[str, ...], str]] = {
    "/healthz": ("GET", (), "whether the worker answers (no data; no token needed)"),
    "/api/whoami": ("GET", ALL_READERS + ("node",), "the caller's name, role and tenant"),
    "/api/jobs": ("GET", ALL_READERS, "jobs with state, nodes, cards, wait and run time (a tenant: its own)"),
    "/api/history": ("GET", ("tenant", "operator", "auditor", "service"),
                     "one job's whole life: requests, placements, checkpoints, preemptions, stops, bills"),
    "/api/logs": ("GET", ("tenant", "operator"),
                  "a job's program output, stdout and stderr of each attempt and part, cuts marked (a tenant: its own "
                  "jobs' only)"),
    "/api/quota": ("GET", ("tenant", "operator", "finance", "auditor"),
                   "quota, used, reserved and borrowed per tenant and project (a tenant: its own)"),
    "/api/nodes": ("GET", ALL_READERS, "nodes with state, cards and holders (a tenant sees only its own job names)"),
    "/api/prices": ("GET", ("tenant", "operator", "finance", "auditor"), "the price book in force"),
    "/api/explain": ("GET", ("tenant", "operator", "auditor", "service"),
                     "one job's decisions with their reasons (a tenant: its own jobs, other tenants' jobs unnamed)"),
    "/api/billing": ("GET", ("tenant", "finance", "operator", "auditor"), "GPU-seconds (a tenant: its own bill)"),
    "/api/invoice": ("GET", ("tenant", "finance", "operator", "auditor"),
                     "invoices for a month or period, one per tenant, as JSON, CSV or a printable HTML page (a "
                     "tenant: its own)"),
    "/api/reservations": ("GET", ("tenant", "operator", "auditor"),
                          "reservations with their window and latest decision (a tenant: its own)"),
    "/api/sql": ("POST", ("finance", "auditor", "operator"), "one read-only statement under ClickHouse's limits"),
    "/api/principals": ("GET", ("operator", "auditor"), "who is who (names, roles, tenants; never secrets)"),
    "/api/telemetry": ("GET", ALL_READERS, "utilization and memory per minute from telemetry, by workload, tenant or "
                       "card model (a tenant: its own jobs' use only)"),
    "/api/pool": ("GET", ALL_READERS, "the pool per minute: capacity, allocation, fragmentation, queue and wait by "
                  "tier (no job names)"),
    "/api/service": ("GET", ("tenant", "operator", "auditor", "service"),
                     "an inference service's latency and QPS over time and its elastic actions, latency before vs "
                     "after each; without `service`, the services (a tenant: its own)"),
    "/api/service/endpoints": ("GET", ("tenant", "operator", "auditor", "service"),
                               "a service's replicas with address, port, state and weight, and the ready ones that "
                               "take traffic (also /api/service/NAME/endpoints; a tenant: its own services only)"),
    "/cluster/": ("GET", ALL_READERS, "allocation, fragmentation and free capacity (no job names)"),
    "/stats/": ("GET", ("operator", "auditor", "service"), "the worker's counters"),
    "/internal/views": ("GET", ("service",),
                        "this worker's partitions of the node and job views (workers answer for the whole pool by "
                        "asking each other)"),
    "/metrics": ("GET", ("operator", "auditor", "service"), "Prometheus metrics (text exposition format)"),
    "/ui/": ("GET", (), "the dashboard's static files: code, no data (no token needed; every request they make "
             "carries the signed-in principal's token)"),
}

OTHER_JOB = "a job of another tenant"
_QUALIFIED = re.compile(r"(?<![\w/.-])([a-z0-9][a-z0-9-]{0,62})/([A-Za-z0-9_.:#@-][^\s,;()'\"]*)")


class Rendered:
    """An answer that is a file, not a JSON document: its bytes and headers (an invoice's CSV or HTML page)."""

    def __init__(self, body: bytes, headers: dict[str, str]):
        self.body, self.headers = body, headers


class ApiError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


class AuthThrottle:
    """Failed authentications per client (its address and the name it claims, or none for a bare token): past
    `max_failures` within `window_s`, that client is answered 429 without its token being looked at until the
    window has passed. Guessing a token is then `max_failures` tries a window, not as fast as the API answers; a
    principal proving itself from elsewhere, or under its own name, is not held up by someone else's guessing.
    `clock`: seconds (the HTTP edge's wall clock; injected in tests)."""

    def __init__(self, max_failures: int = 10, window_s: float = 60.0, clock=None, keep: int = 10_000):
        import time

        self.max_failures, self.window_s, self.keep = max_failures, window_s, keep
        self.clock = clock or time.monotonic
        self.failures: dict[tuple[str, str], list[float]] = {}

    def _recent(self, client: tuple[str, str]) -> list[float]:
        now = self.clock()
        recent = [t for t in self.failures.get(client, ()) if now - t < self.window_s]
        if recent:
            self.failures[client] = recent
        else:
            self.failures.pop(client, None)
        return recent

    def retry_after(self, client: tuple[str, str]) -> int | None:
        """Seconds until `client` may try again, or None when it may now."""
        recent = self._recent(client)
        if len(recent) < self.max_failures:
            return None
        return max(1, int(recent[-self.max_failures] + self.window_s - self.clock()) + 1)

    def failed(self, client: tuple[str, str]) -> int:
        """Count one failure; how many `client` has within the window now."""
        if len(self.failures) >= self.keep and client not in self.failures:
            for old in list(self.failures)[: self.keep // 10]:  # bounded: the oldest clients go first
                del self.failures[old]
        recent = self._recent(client)
        recent.append(self.clock())
        self.failures[client] = recent
        return len(recent)


def claimed_name(header: str | None) -> str:
    """The name a Basic header claims ("" for a bearer token or none): half of the throttle's key."""
    scheme, _, value = (header or "").partition(" ")
    if scheme.lower() != "basic":
        return ""
    try:
        return base64.b64decode(value).decode().partition(":")[0][:200]
    except (ValueError, UnicodeDecodeError):
        return ""


# The largest request body read (POST /api/sql): an SQL text of sql_guard.MAX_SQL_BYTES, its JSON escapes and its
# parameters. Over it: 413.
MAX_BODY_BYTES = 4 * sql_guard.MAX_SQL_BYTES


async def read_body(request, limit: int = MAX_BODY_BYTES) -> bytes:
    """A request's body, read in chunks and never past `limit` bytes: ApiError(413) as soon as it is longer (a
    declared Content-Length over the limit is refused before any of it is read)."""
    if request.content_length is not None and request.content_length > limit:
        raise ApiError(413, f"the request body is {request.content_length} bytes: at most {limit} are read")
    chunks, size = [], 0
    async for chunk in request.content.iter_chunked(64 * 1024):
        size += len(chunk)
        if size > limit:
            raise ApiError(413, f"the request body is over {limit} bytes: at most {limit} are read")
        chunks.append(chunk)
    return b"".join(chunks)


def authenticate(header: str | None, registry: dict[str, Principal]) -> Principal:
    """The principal a request's Authorization header proves, or ApiError(401)."""
    if not header:
        raise ApiError(401, "authentication required: Authorization: Bearer TOKEN (gpupool user add prints it)")
    scheme, _, value = header.partition(" ")
    name = None
    if scheme.lower() == "basic":
        try:
            name, _, token = base64.b64decode(value).decode().partition(":")
        except (ValueError, UnicodeDecodeError):
            raise ApiError(401, "malformed Basic credentials") from None
    elif scheme.lower() == "bearer":
        token = value.strip()
    else:
        raise ApiError(401, f"unsupported authorization scheme {scheme!r}")
    candidates = [registry[name]] if name and name in registry else ([] if name else list(registry.values()))
    for p in candidates:
        if p.token_sha256 and same_token(token, p.token_sha256):
            return p
    raise ApiError(401, "invalid credentials")


def authorize(path: str, principal: Principal) -> None:
    roles = ENDPOINTS[path][1]
    if principal.role not in roles:
        raise ApiError(403, f"role {principal.role} may not use {path}")


def tenant_scope(principal: Principal, asked: str | None) -> str | None:
    """The tenant a query is confined to: a tenant's own, whatever it asked; others may name one or none."""
    if principal.role == "tenant":
        if asked and asked != principal.tenant:
            raise ApiError(403, f"{principal.name} is a member of {principal.tenant!r}, not {asked!r}")
        return principal.tenant
    return asked or None


def owner_of(job_id: str) -> str:
    """Job ids are tenant-qualified by the gateway ("acme/train-1"); a reservation's hold is "acme/r1#hold"."""
    return job_id.split("/", 1)[0] if "/" in job_id else ""


# ---------------------------------------------------------------- redaction


def redact_text(text: str, tenant: str) -> str:
    return _QUALIFIED.sub(lambda m: m.group(0) if m.group(1) == tenant else OTHER_JOB, text)


def redact(value, tenant: str):
    """Any id of another tenant's job (tenant-qualified), anywhere in a reason, becomes "a job of another tenant";
    a list of such ids is counted instead of named."""
    if isinstance(value, str):
        if "," in value and all(_QUALIFIED.fullmatch(v) for v in value.split(",")):
            mine = [v for v in value.split(",") if owner_of(v) == tenant]
            others = len(value.split(",")) - len(mine)
            return ",".join(mine + ([f"{others} job(s) of other tenants"] if others else []))
        return redact_text(value, tenant)
    if isinstance(value, list):
        return [redact(v, tenant) for v in value]
    if isinstance(value, dict):
        return {k: redact(v, tenant) for k, v in value.items()}
    return value


# ---------------------------------------------------------------- queries

JOBS_SQL = """
SELECT job_id, tenant, state, tier, project, compute_milli,
       if(state = 'pending', 0, arraySum(arrayMap(x -> x.3, arrayFilter(x -> x.1 = last_place_ms, places)))) AS cards,
       if(state = 'pending', '', arrayStringConcat(arraySort(arrayDistinct(arrayMap(x -> x.2,
           arrayFilter(x -> x.1 = last_place_ms, places)))), ',')) AS nodes,
       fromUnixTimestamp64Milli(toInt64(submitted_ms), 'UTC') AS submitted,
       -- waiting: all of its time on record that it did not run (before its first start, and requeued after a
       -- preemption or a lost node until it starts again); elapsed: the time its runs ran, each from its start to
       -- its stop, interruption or end (now, while it runs) -- Slurm's sacct Elapsed, summed over requeues
       round((if(ended_ms > 0, ended_ms, now_ms) - submitted_ms - run_ms) / 1000, 1) AS wait_s,
       round(run_ms / 1000, 1) AS elapsed_s,
       submitted_by, rejections,
       -- why its last failed run ended (ExitCode 3, Signal 9 (SIGKILL), OOMKilled, ...: docs/jobs.md "Exit reasons
       -- and retries"), how many of its runs failed, the retries it asked for, and while it waits out a failed
       -- run's back-off, when it is tried again (epoch ms; 0: not backing off)
       last_exit, failures, retries, retry_at_ms
FROM (
SELECT *,
       arraySum(arrayMap(i -> ifNull(if(runs[i].3 = 'job.started',
                                        greatest(if(i < length(runs), runs[i + 1].1, if(ended_ms > 0, ended_ms, now_ms))
                                                 - runs[i].1, 0), 0), 0),
                         arrayEnumerate(runs))) AS run_ms
FROM (
  -- the job's state, run, counts and reasons: as its view's fold decided them (gpupool.jobs, written by the sink
  -- from the job view's changelog: streams/folds/job_view.py), never decided again here
  SELECT job_id, tenant, state, tier, project, compute_milli, ended_ms, failures, retries, last_exit, retry_at_ms
  FROM gpupool.jobs FINAL WHERE {inner}
) AS j
INNER JOIN (
  -- its timeline from the events on record: when it was submitted, by whom, where it was placed, and how long its
  -- runs ran
  SELECT job_id,
         arrayFlatten(groupArrayIf(JSONExtract(payload, 'commands', 'Array(String)'), kind = 'job.interrupted'))
             AS superseded,
         -- its runs' turns by log time in ms, each interruption with the runs it ended; a start or stop of a run
         -- reported after the interruption that ended it (a node back from the dead) is no turn of the job's
         arrayFilter(x -> NOT (x.3 IN ('job.started', 'job.stopped', 'job.failed') AND has(superseded, x.4) AND NOT arrayExists(
                                   y -> y.3 = 'job.interrupted' AND has(y.5, x.4) AND (y.1, y.2) > (x.1, x.2),
                                   turns_ms)),
                     arraySort(x -> (x.1, x.2), turns_ms)) AS runs,
         groupArrayIf((event_time_ms, offset, kind, command_id,
                       if(kind = 'job.interrupted', JSONExtract(payload, 'commands', 'Array(String)'), [])),
                      kind IN ('job.started', 'job.stopped', 'job.interrupted', 'job.failed')) AS turns_ms,
         maxIf(event_time_ms, kind = 'cmd.place') AS last_place_ms,
         groupArrayIf((event_time_ms, node, JSONLength(payload, 'assignments')), kind = 'cmd.place') AS places,
         minIf(event_time_ms, kind IN ('job.requested', 'job.rejected')) AS submitted_ms,
         argMinIf(actor, event_time, kind = 'job.requested') AS submitted_by,
         arrayStringConcat(groupUniqArrayIf(JSONExtractString(payload, 'code'), kind = 'job.rejected'), ',')
             AS rejections,
         toUnixTimestamp64Milli(now64(3)) AS now_ms
  FROM gpupool.events FINAL WHERE job_id != '' AND {inner}
  GROUP BY job_id
) AS e USING job_id)
WHERE {outer}
ORDER BY submitted, job_id
"""

# One step of the scheduler writes several records at one log time, on several topics: they are listed in the order
# it decided them, its seq (its event ids are "scheduler:<seq>"), not by topic nor by the id as text. Other sources'
# records at that time come first: at one log time they are what the step read, not what it wrote.
SCHEDULER_SEQ = "if(startsWith(event_id, 'scheduler:'), toUInt64OrZero(substring(event_id, 11)), 0)"

EXPLAIN_SQL = """
SELECT event_time_ms, kind, node, reasons, actor FROM (
  SELECT event_time_ms, kind, node, reasons, '' AS actor, event_id FROM gpupool.scheduling FINAL
  WHERE job_id = {job:String}
  UNION ALL
  SELECT event_time_ms, kind, node, '[]' AS reasons, actor, event_id FROM gpupool.events FINAL
  WHERE job_id = {job:String} AND kind IN ('job.requested', 'job.cancelled', 'job.started', 'job.completed',
                                            'job.failed', 'job.stopped')
) ORDER BY event_time_ms, """ + SCHEDULER_SEQ + """, event_id
"""

BILLING_GROUPS = {"tenant": "tenant", "project": "tenant, project", "job": "tenant, project, job_id",
                  "model": "tenant, gpu_model",
                  "day": "tenant, toDate(fromUnixTimestamp64Milli(toInt64(end_ms))) AS day"}


HISTORY_SQL = """
SELECT e.event_time_ms AS at, e.kind AS kind, e.node AS node, e.command_id AS command_id, e.actor AS actor,
       e.payload AS payload, s.reasons AS reasons
FROM gpupool.events AS e FINAL
LEFT JOIN (SELECT event_id, reasons FROM gpupool.scheduling FINAL WHERE job_id = {job:String}) AS s
       ON s.event_id = e.event_id
WHERE e.job_id = {job:String}
ORDER BY e.event_time_ms, if(e.source = 'scheduler', e.seq, 0), e.topic, e.partition, e.offset
"""

# A job's output (docs/jobs.md, "Logs"): the pieces of gpupool_logs.job_logs in the order the relay forwarded them (one
# partition holds a job's pieces: the offset is the cursor, `after`), a piece relayed twice once (FINAL keeps the
# first). {where} adds the attempt and part asked for; a tail is read backwards and turned round by the caller.
LOGS_SQL = """
SELECT offset, attempt, part, node, stream, seq, text, dropped_bytes, final, event_time_ms
FROM gpupool_logs.job_logs FINAL
WHERE job_id = {job:String} AND offset > {after:Int64} AND {where}
ORDER BY offset {order} LIMIT {limit:UInt32}
"""
LOGS_PAGE = 1000  # pieces an answer holds at most (16 MiB of text at the pieces' limit); `more` says there is more
LOGS_COLUMNS = ("offset", "attempt", "part", "node", "stream", "seq", "text", "dropped_bytes", "final", "time_ms")


def _count(params: dict, name: str, default: int | None = None, low: int = 0) -> int | None:
    v = params.get(name)
    if v in (None, ""):
        return default
    try:
        n = int(v)
    except ValueError:
        raise ApiError(400, f"{name}: an integer") from None
    if n < low:
        raise ApiError(400, f"{name}: at least {low}")
    return n


def logs_query(job: str, params: dict) -> tuple[str, dict, bool]:
    """(SQL, parameters, whether it reads backwards) of a /api/logs request: `after` (the cursor of the last answer,
    -1: from the start), `attempt`, `part`, `tail` (the last N pieces), `limit`."""
    qp = {"job": job, "after": _count(params, "after", -1, low=-1)}
    where = ["1"]
    for name in ("attempt", "part"):
        n = _count(params, name)
        if n is not None:
            where.append(f"{name} = {{{name}:UInt32}}")
            qp[name] = n
    tail = _count(params, "tail", low=1)
    qp["limit"] = min(tail or _count(params, "limit", LOGS_PAGE, low=1), LOGS_PAGE)
    sql = LOGS_SQL.replace("{where}", " AND ".join(where)).replace("{order}", "DESC" if tail else "ASC")
    return sql, qp, bool(tail)


def logs_doc(job: str, rows: list[list], backwards: bool, after: int, limit: int) -> dict:
    """The answer: the pieces in order, the cursor to ask `after` next, whether a page was cut short."""
    rows = list(reversed(rows)) if backwards else rows
    pieces = [dict(zip(LOGS_COLUMNS, [int(r[0]), int(r[1]), int(r[2]), r[3], r[4], int(r[5]), r[6], int(r[7]),
                                      bool(r[8]), int(r[9])])) for r in rows]
    return {"job": job, "pieces": pieces, "next": pieces[-1]["offset"] if pieces else after,
            "more": not backwards and len(pieces) >= limit}


# A reservation as booked (its request) and where it stands (the scheduler's latest reservation.decided, in the order
# it decided them): the request's own fields, the decision's status, node and reason codes.
RESERVATIONS_SQL = """
SELECT reservation_id, tenant, project, tier, compute_milli, gpu_memory_mib, start_ms, end_ms, status, node, reasons,
       booked_by
FROM (SELECT JSONExtractString(payload, 'reservation_id') AS reservation_id,
             if(position(reservation_id, '/') > 0, splitByChar('/', reservation_id)[1], '') AS tenant,
             argMinIf(JSONExtractString(payload, 'project'), event_time_ms, kind = 'reservation.requested') AS project,
             argMinIf(JSONExtractString(payload, 'tier'), event_time_ms, kind = 'reservation.requested') AS tier,
             argMinIf(JSONExtractUInt(payload, 'compute_milli'), event_time_ms, kind = 'reservation.requested')
                 AS compute_milli,
             argMinIf(JSONExtractUInt(payload, 'gpu_memory_mib'), event_time_ms, kind = 'reservation.requested')
                 AS gpu_memory_mib,
             argMinIf(JSONExtractUInt(payload, 'start_ms'), event_time_ms, kind = 'reservation.requested') AS start_ms,
             argMinIf(JSONExtractUInt(payload, 'end_ms'), event_time_ms, kind = 'reservation.requested') AS end_ms,
             argMaxIf(JSONExtractString(payload, 'status'), (event_time_ms, seq), kind = 'reservation.decided')
                 AS status,
             argMaxIf(JSONExtractString(payload, 'node'), (event_time_ms, seq), kind = 'reservation.decided') AS node,
             argMaxIf(arrayStringConcat(arrayMap(x -> JSONExtractString(x, 'code'),
                                                 JSONExtractArrayRaw(payload, 'reasons')), ','),
                      (event_time_ms, seq), kind = 'reservation.decided') AS reasons,
             argMinIf(actor, event_time_ms, kind = 'reservation.requested') AS booked_by
      FROM gpupool.events FINAL
      WHERE kind IN ('reservation.requested', 'reservation.decided') AND {where}
      GROUP BY reservation_id)
WHERE {outer}
ORDER BY start_ms, reservation_id
"""

# The reservations holding capacity now (their latest decision is "active") and the cards each keeps: the scheduler
# holds them in its own view alone (nothing is sent to a node), so the node views cannot show them: /api/nodes adds
# them.
HOLDS_SQL = """
SELECT reservation_id, end_ms, held FROM (
  SELECT JSONExtractString(payload, 'reservation_id') AS reservation_id,
         argMinIf(JSONExtractUInt(payload, 'end_ms'), event_time_ms, kind = 'reservation.requested') AS end_ms,
         argMaxIf(JSONExtractString(payload, 'status'), (event_time_ms, seq), kind = 'reservation.decided') AS status,
         argMaxIf(JSONExtractRaw(payload, 'assignments'), (event_time_ms, seq), kind = 'reservation.decided') AS held
  FROM gpupool.events FINAL
  WHERE kind IN ('reservation.requested', 'reservation.decided')
  GROUP BY reservation_id)
WHERE status = 'active'
ORDER BY reservation_id
"""


def with_holds(doc: dict, holds: list[tuple]) -> dict:
    """The nodes document with the reservation holds (HOLDS_SQL's rows) on the nodes whose cards they keep: each
    card's `reserved_milli` / `reserved_memory_mib`, each node's `holds` (reservation, until when, how much)."""
    by_card: dict[str, list[tuple[str, int, dict]]] = {}
    for rid, end_ms, held in holds:
        for a in orjson.loads(held or "[]"):
            by_card.setdefault(a["gpu_uuid"], []).append((rid, end_ms, a))
    for n in doc["nodes"]:
        mine: dict[str, dict] = {}
        for g in n["cards"]:
            g["reserved_milli"] = g["reserved_memory_mib"] = 0
            for rid, end_ms, a in by_card.get(g["uuid"], ()):
                g["reserved_milli"] += a["milli"]
                g["reserved_memory_mib"] += a["memory_mib"]
                h = mine.setdefault(rid, {"reservation_id": rid, "end_ms": end_ms, "milli": 0, "memory_mib": 0,
                                          "cards": []})
                h["milli"] += a["milli"]
                h["memory_mib"] += a["memory_mib"]
                h["cards"].append(g["uuid"])
        n["holds"] = list(mine.values())
    return doc


QUOTA_SQL = """
SELECT tenant, project, quota_milli, overcommit_pct, quota_memory_mib, used_milli, reserved_milli, borrowed_milli,
       used_memory_mib, quota_set_by, rejected_ms, rejected_milli, rejected_code
FROM (SELECT tenant, project, argMax(quota_milli, offset) AS quota_milli, argMax(overcommit_pct, offset) AS overcommit_pct,
             argMax(quota_memory_mib, offset) AS quota_memory_mib, argMax(actor, offset) AS quota_set_by
      FROM gpupool.quota_events FINAL WHERE kind = 'quota.set' AND {where}
        AND event_id NOT IN (SELECT answers FROM gpupool.quota_events FINAL WHERE kind = 'quota.rejected')
      GROUP BY tenant, project) AS q
FULL OUTER JOIN
     (SELECT tenant, project, argMax(used_milli, offset) AS used_milli, argMax(reserved_milli, offset) AS reserved_milli,
             argMax(borrowed_milli, offset) AS borrowed_milli, argMax(used_memory_mib, offset) AS used_memory_mib
      FROM gpupool.quota_events FINAL WHERE kind = 'quota.changed' AND {where} GROUP BY tenant, project) AS c
USING (tenant, project)
-- the last quota.set refused for the account (`gpupool quota set` says so instead of leaving the old quota to look set),
-- also for an account whose every set was refused
FULL OUTER JOIN
     (SELECT tenant, JSONExtractString(payload, 'project') AS project, max(event_time_ms) AS rejected_ms,
             argMax(JSONExtractUInt(payload, 'gpu_milli'), event_time_ms) AS rejected_milli,
             argMax(JSONExtractString(payload, 'code'), event_time_ms) AS rejected_code
      FROM gpupool.events FINAL WHERE kind = 'quota.rejected' AND {where} GROUP BY tenant, project) AS r
USING (tenant, project)
ORDER BY tenant, project
"""

PRICES_SQL = """
SELECT gpu_model, datacenter, tod_band, tier, borrowed, micro_per_gpu_hour, currency, valid_from, actor
FROM gpupool.price_book FINAL ORDER BY gpu_model, borrowed, datacenter, tod_band, tier, valid_from
"""

# The usage of a period, each interval clipped to it: an interval [start, end) counts gpu_milli x the part of it
# that lies in [since, until) (gpu_milli_ms is gpu_milli x (end - start) exactly, so the clipped part is exact), so
# consecutive periods (two months) split an interval across their boundary and count none of it twice.
PERIOD_USAGE = """
SELECT * REPLACE (toUInt64(if(end_ms > start_ms,
                              intDiv(toUInt128(gpu_milli_ms)
                                         * (least(end_ms, {clip_until}) - greatest(start_ms, {clip_since})),
                                     end_ms - start_ms), gpu_milli_ms)) AS gpu_milli_ms)
FROM gpupool.usage FINAL WHERE {where}
"""

# One price per usage event (the most specific row valid at the interval's end; its price and currency taken
# together), then summed; Int128 keeps it exact. Unpriced usage has currency '' and price 0.
PRICED_USAGE = """
SELECT event_id, tenant, project, job_id, tier, gpu_model, borrowed, reserved, end_ms, gpu_milli_ms, priced,
       if(priced, pc.1, 0) AS micro_per_gpu_hour, if(priced, pc.2, '') AS currency
FROM (
SELECT u.event_id AS event_id, any(u.tenant) AS tenant, any(u.project) AS project, any(u.job_id) AS job_id,
       any(u.tier) AS tier, any(u.gpu_model) AS gpu_model, any(u.borrowed) AS borrowed, any(u.reserved) AS reserved,
       any(u.end_ms) AS end_ms, any(u.gpu_milli_ms) AS gpu_milli_ms,
       argMax(tuple(p.micro_per_gpu_hour, p.currency),
              ((p.datacenter != '*') + (p.tod_band != '*') + (p.tier != '*'), p.valid_from)) AS pc,
       -- a LEFT JOIN's unmatched row has the column types' defaults (''), not NULL: no price is a '' model
       countIf(p.gpu_model != '') > 0 AS priced
FROM (SELECT *, if(toHour(fromUnixTimestamp64Milli(toInt64(start_ms), 'UTC')) BETWEEN 8 AND 19,
                   'peak', 'offpeak') AS tod_band
      FROM ({usage})) AS u
LEFT JOIN (SELECT * FROM gpupool.price_book FINAL) AS p
       ON p.gpu_model = u.gpu_model AND p.borrowed = u.borrowed
      AND p.datacenter IN (u.datacenter, '*') AND p.tod_band IN (u.tod_band, '*') AND p.tier IN (u.tier, '*')
      AND p.valid_from <= fromUnixTimestamp64Milli(toInt64(u.end_ms), 'UTC')
GROUP BY u.event_id)
"""


def period_usage(where: str, since_ms: int | None, until_ms: int | None) -> str:
    """PERIOD_USAGE for a WHERE clause whose parameters include since/until when they are given."""
    return (PERIOD_USAGE.replace("{where}", where)
            .replace("{clip_since}", "{since:UInt64}" if since_ms is not None else "start_ms")
            .replace("{clip_until}", "{until:UInt64}" if until_ms is not None else "end_ms"))


def priced_usage(where: str, since_ms: int | None = None, until_ms: int | None = None) -> str:
    """PRICED_USAGE over the usage `where` selects, clipped to [since, until) when given."""
    return PRICED_USAGE.replace("{usage}", period_usage(where, since_ms, until_ms))


# The invoice's lines: per tenant, currency, project, card model, tier, kind of time (own quota, reserved,
# borrowed) and unit price, the exact GPU time and bill numerator (strings: Int128 does not fit JSON's integers).
INVOICE_SQL = """
SELECT tenant, currency, project, gpu_model, tier, multiIf(reserved, 'reserved', borrowed, 'borrowed', 'quota') AS time,
       micro_per_gpu_hour, priced, toString(sum(gpu_milli_ms)) AS milli_gpu_ms,
       toString(sum(toInt128(gpu_milli_ms) * micro_per_gpu_hour)) AS numerator, uniqExact(job_id) AS jobs
FROM ({priced})
GROUP BY tenant, currency, project, gpu_model, tier, time, micro_per_gpu_hour, priced
ORDER BY tenant, currency, project, gpu_model, tier, time, micro_per_gpu_hour
"""


TELEMETRY_GROUPS = {"workload": "workload", "tenant": "tenant", "model": "gpu_model", "tier": "tier"}

# Per minute and group: the mean utilization of the cards (or MIG instances) the group's jobs were on, counting only
# the part of it the samples attribute to them; how many such units; and their memory.
TELEMETRY_SQL = """
SELECT minute_ms, {group} AS g, round(sum(util_permille) / 10 / uniqExact(gpu_uuid, mig_uuid), 1) AS util_pct,
       uniqExact(gpu_uuid, mig_uuid) AS gpus, sum(mem_used_mib) AS mem_used_mib
FROM gpupool.telemetry_by_job WHERE minute_ms >= {since:UInt64} AND {where}
GROUP BY minute_ms, g ORDER BY minute_ms, g
"""

# Per minute: every card and MIG instance of the pool, busy or idle.
POOL_UTIL_SQL = """
SELECT minute_ms, round(avg(util_mean_permille) / 10, 1) AS util_pct, count() AS gpus,
       sum(mem_used_mean_mib) AS mem_used_mib, sum(mem_total_mib) AS mem_total_mib, max(temperature_max_c) AS temp_max_c,
       round(sum(power_mean_mw) / 1000) AS power_w
FROM gpupool.telemetry_minutes FINAL WHERE minute_ms >= {since:UInt64} GROUP BY minute_ms ORDER BY minute_ms
"""

POOL_SQL = """
SELECT minute_ms, capacity_milli, allocated_milli, free_milli, fragmentation_milli, queue_by_tier,
       oldest_wait_ms_by_tier, allocated_milli_by_model, capacity_milli_by_model
FROM gpupool.pool_minutes FINAL WHERE minute_ms >= {since:UInt64} ORDER BY minute_ms
"""

SERVICE_SQL = """
SELECT event_time_ms, kind, payload FROM gpupool.events FINAL
WHERE kind IN ('inference.load', 'service.scaled', 'service.declared', 'service.removed')
  AND JSONExtractString(payload, 'service_id') = {service:String}
ORDER BY event_time_ms, topic, partition, offset
"""

SERVICES_SQL = """
SELECT JSONExtractString(payload, 'service_id') AS service_id, max(event_time_ms) AS declared_ms,
       countIf(kind = 'service.removed') > 0 AS removed
FROM gpupool.events FINAL WHERE kind IN ('service.declared', 'service.removed') AND {where}
GROUP BY service_id ORDER BY service_id
"""

# What the endpoints fold reads of one service (streams/folds/serving.py): its declarations and elastic actions, and
# its replicas' placements, stops, the nodes' readiness reports and the runs' ends; replica ids are "SERVICE/rN"; the
# inventories of the nodes they were placed on (the address each node advertises for itself).
ENDPOINTS_SQL = """
SELECT event_time_ms, kind, payload FROM gpupool.events FINAL
WHERE (kind IN ('service.declared', 'service.removed', 'service.scaled')
       AND JSONExtractString(payload, 'service_id') = {service:String})
   OR (kind IN ('cmd.place', 'cmd.preempt', 'cmd.release', 'cmd.migrate', 'replica.ready', 'replica.unready',
                'job.completed', 'job.failed', 'job.stopped', 'job.interrupted', 'job.cancelled')
       AND startsWith(job_id, concat({service:String}, '/r')))
   OR (kind = 'node.inventory' AND node IN (SELECT node FROM gpupool.events WHERE kind = 'cmd.place'
                                            AND startsWith(job_id, concat({service:String}, '/r'))))
ORDER BY event_time_ms, topic, partition, offset
"""
ROUTER_RAMP_S = 10.0  # GPUPOOL_ROUTER_RAMP_S: how long a new replica's weight takes to grow to full


def ramp_ms(params: dict) -> int:
    import os

    raw = params.get("ramp_s") or os.environ.get("GPUPOOL_ROUTER_RAMP_S") or ROUTER_RAMP_S
    try:
        return max(0, int(float(raw) * 1000))
    except ValueError:
        raise ApiError(400, f"ramp_s: seconds, not {raw!r}") from None


def endpoints_doc(service: str, rows: list[list], now_ms: int, ramp: int) -> dict:
    """The endpoints fold over one service's rows, read at `now_ms` with weights ramped over `ramp` ms."""
    from schemas.events import KINDS
    from streams.folds.serving import Endpoints

    e = Endpoints()
    for at, kind, payload in rows:
        try:
            e.fold_payload(KINDS[kind].model_validate_json(payload), int(at))
        except Exception:  # noqa: BLE001 - a row of an older schema: skipped, not a failed page
            continue
    svc = e.of(service)
    if svc is None:
        raise ApiError(404, f"no service {service!r}")
    return {**svc.doc(now_ms, ramp), "now_ms": now_ms, "ramp_ms": ramp}


AROUND_MS = 60_000  # latency before vs after an elastic action: the load reports of this window on each side


def service_doc(service: str, rows: list[list]) -> dict:
    """One service's load series (the service-level reports, or every replica's when there are none) and its
    elastic actions, each with the mean p50/p99/QPS of the window before it and after it."""
    loads, actions, declared = [], [], None
    for at, kind, payload in rows:
        p = orjson.loads(payload)
        if kind == "inference.load":
            loads.append({"time_ms": at, "replica": p.get("replica", ""), "qps": p.get("qps", 0),
                          "p50_ms": p.get("p50_ms", 0), "p99_ms": p.get("p99_ms", 0),
                          "queue_depth": p.get("queue_depth", 0), "util_pct": p.get("util_pct", 0)})
        elif kind == "service.scaled":
            actions.append({"time_ms": at, "action": p["action"], "replicas": p.get("replicas", 0),
                            "took_ms": p.get("took_ms", 0), "jobs": p.get("jobs", []),
                            "reasons": p.get("reasons", [])})
        elif kind == "service.declared":
            declared = p
    whole = [x for x in loads if not x["replica"]] or loads

    def mean(xs: list[dict], key: str) -> float | None:
        return round(sum(x[key] for x in xs) / len(xs), 1) if xs else None

    for a in actions:
        before = [x for x in whole if a["time_ms"] - AROUND_MS <= x["time_ms"] < a["time_ms"]]
        after = [x for x in whole if a["time_ms"] < x["time_ms"] <= a["time_ms"] + a["took_ms"] + AROUND_MS]
        a["before"] = {k: mean(before, k) for k in ("p50_ms", "p99_ms", "qps")}
        a["after"] = {k: mean(after, k) for k in ("p50_ms", "p99_ms", "qps")}
    return {"service": service, "declared": declared, "loads": whole, "actions": actions}


def jobs_sql(tenant: str | None, params: dict | None = None) -> tuple[str, dict]:
    """The jobs list, confined to `tenant` (None: all), filtered by project, state, tier and submission time."""
    params = params or {}
    # a job is what was submitted (or refused): a reservation's hold, named in the quota's records, is none
    inner, outer, qp = ["1"], ["submitted_ms > 0"], {}
    if tenant is not None:
        inner.append("startsWith(job_id, concat({tenant:String}, '/'))")
        qp["tenant"] = tenant
    if params.get("job"):  # one job: `gpupool submit` says where a repeated request's job stands
        inner.append("job_id = {job:String}")
        qp["job"] = params["job"]
    since = _int(params, "since")
    if since is not None:
        outer.append("submitted_ms >= {since:UInt64}")
        qp["since"] = since
    for name in ("project", "state", "tier"):
        if params.get(name):
            outer.append(f"{name} = {{{name}:String}}")
            qp[name] = params[name]
    return JOBS_SQL.replace("{inner}", " AND ".join(inner)).replace("{outer}", " AND ".join(outer)), qp


def usage_where(tenant: str | None, project: str | None, since_ms: int | None,
                until_ms: int | None) -> tuple[str, dict]:
    """The usage a bill covers: an interval overlapping [since, until) (clipped to it by PERIOD_USAGE)."""
    where, params = ["1"], {}
    if tenant:
        where.append("tenant = {tenant:String}")
        params["tenant"] = tenant
    if project:
        where.append("project = {project:String}")
        params["project"] = project
    if since_ms is not None:
        where.append("end_ms > {since:UInt64}")
        params["since"] = since_ms
    if until_ms is not None:
        where.append("start_ms < {until:UInt64}")
        params["until"] = until_ms
    return " AND ".join(where), params


def billing_sql(by: str, tenant: str | None, project: str | None, since_ms: int | None, until_ms: int | None,
                cost: bool = False):
    if by not in BILLING_GROUPS:
        raise ApiError(400, f"by: one of {', '.join(BILLING_GROUPS)}")
    where, params = usage_where(tenant, project, since_ms, until_ms)
    group = BILLING_GROUPS[by]
    keys = group.replace(" AS day", "").replace("toDate(fromUnixTimestamp64Milli(toInt64(end_ms)))", "day")
    if cost:  # money, in integers: own and borrowed GPU time priced apart, each currency apart (never summed
        # across currencies); usage no price matches is counted (in a row of currency ''), never hidden
        sql = (f"SELECT {group}, currency, round(sum(gpu_milli_ms) / 3.6e9, 4) AS gpu_hours, "
               f"round(sumIf(gpu_milli_ms, borrowed) / 3.6e9, 4) AS borrowed_gpu_hours, "
               f"toInt64(intDiv(sumIf(toInt128(gpu_milli_ms) * micro_per_gpu_hour, NOT borrowed), 3600000000)) "
               f"AS own_micro, "
               f"toInt64(intDiv(sumIf(toInt128(gpu_milli_ms) * micro_per_gpu_hour, borrowed), 3600000000)) "
               f"AS borrowed_micro, "
               f"toInt64(intDiv(sum(toInt128(gpu_milli_ms) * micro_per_gpu_hour), 3600000000)) AS cost_micro, "
               f"round(sumIf(gpu_milli_ms, NOT priced) / 3.6e9, 4) AS unpriced_gpu_hours, uniqExact(job_id) AS jobs "
               f"FROM ({priced_usage(where, since_ms, until_ms)}) GROUP BY {keys}, currency "
               f"ORDER BY {keys}, currency")
        return sql, params
    sql = (f"SELECT {group}, sum(gpu_milli_ms) AS milli_gpu_ms, round(sum(gpu_milli_ms) / 1e6, 3) AS gpu_seconds, "
           f"round(sumIf(gpu_milli_ms, borrowed) / 1e6, 3) AS borrowed_gpu_seconds, uniqExact(job_id) AS jobs "
           f"FROM ({period_usage(where, since_ms, until_ms)}) GROUP BY {keys} ORDER BY {keys}")
    return sql, params


def with_money(cols: list[str], rows: list[list]) -> tuple[list[str], list[list]]:
    """billing --cost's rows with the amounts a person reads beside the integers: own_cost, borrowed_cost and cost,
    each its micro-units rounded to the currency's minor unit (schemas.money.show_micro: half up), as decimal
    strings ('12.34'; '' where no price applied)."""
    from schemas.money import show_micro

    if not rows or "currency" not in cols:  # an empty answer (the embedded engine names no columns then)
        return cols, rows
    at = cols.index("currency")
    idx = {c: cols.index(c) for c in ("own_micro", "borrowed_micro", "cost_micro")}
    out = []
    for r in rows:
        cur = r[at]
        money = [show_micro(int(r[idx[c]]), cur) if cur else "" for c in ("own_micro", "borrowed_micro",
                                                                           "cost_micro")]
        out.append([*r, *money])
    return [*cols, "own_cost", "borrowed_cost", "cost"], out


def month_bounds(month: str) -> tuple[int, int]:
    """'YYYY-MM' as [its first instant, the next month's first instant), UTC, in epoch ms."""
    from datetime import datetime, timezone

    try:
        a = datetime.strptime(month, "%Y-%m").replace(tzinfo=timezone.utc)
    except ValueError:
        raise ApiError(400, f"month: YYYY-MM, not {month!r}") from None
    b = a.replace(year=a.year + 1, month=1) if a.month == 12 else a.replace(month=a.month + 1)
    return int(a.timestamp() * 1000), int(b.timestamp() * 1000)


def invoice_period(params: dict) -> tuple[int, int]:
    """An invoice's period: `month` (YYYY-MM, UTC) or `since` and `until` (epoch ms), since before until."""
    if params.get("month"):
        if params.get("since") or params.get("until"):
            raise ApiError(400, "month or since/until, not both")
        return month_bounds(params["month"])
    since, until = _int(params, "since"), _int(params, "until")
    if since is None or until is None:
        raise ApiError(400, "an invoice needs a period: month=YYYY-MM, or since and until (epoch ms)")
    if until <= since:
        raise ApiError(400, "until must be after since")
    return since, until


async def invoice_answer(principal: Principal, params: dict, runner: "QueryRunner"):
    """/api/invoice: the invoices of a period (streams/folds/invoice.py), each tenant's only to itself and to the
    roles that read every bill; `format=csv|html` renders one (a tenant's own, or the one `tenant` names)."""
    import time

    from streams.edge import invoice_render
    from streams.folds.invoice import invoices

    since, until = invoice_period(params)
    scope = tenant_scope(principal, params.get("tenant"))
    fmt = params.get("format") or "json"
    if fmt not in ("json", "csv", "html"):
        raise ApiError(400, "format: json, csv or html")
    if fmt != "json" and scope is None:
        raise ApiError(400, f"format={fmt} renders one invoice: name its tenant (tenant=T)")
    where, qp = usage_where(scope, None, since, until)
    cols, rows = await runner.ours(INVOICE_SQL.replace("{priced}", priced_usage(where, since, until)), qp)
    docs = invoices([dict(zip(cols, r)) for r in rows], since, until, [scope] if scope else None)
    if fmt == "json":
        return {"since_ms": since, "until_ms": until, "invoices": docs}
    inv = docs[0]
    name = invoice_render.file_stem(inv)
    if fmt == "csv":
        return Rendered(invoice_render.csv_text([inv]).encode(), {
            "Content-Type": "text/csv; charset=utf-8", "Content-Disposition": f'attachment; filename="{name}.csv"'})
    page = invoice_render.html_page(inv, issued_ms=time.time_ns() // 1_000_000)
    return Rendered(page.encode(), {
        "Content-Type": "text/html; charset=utf-8", "Content-Disposition": f'inline; filename="{name}.html"',
        "Content-Security-Policy": "default-src 'none'; style-src 'unsafe-inline'; frame-ancestors 'none'",
        "X-Content-Type-Options": "nosniff"})


def _int(params: dict, name: str) -> int | None:
    v = params.get(name)
    if v in (None, ""):
        return None
    try:
        return int(v)
    except ValueError:
        raise ApiError(400, f"{name}: an integer (epoch ms)") from None


class QueryRunner:
    """Runs queries in threads: the project's own (one reader session, one at a time) and people's (a fresh
    read-only session each, through sql_guard)."""

    def __init__(self, dsn: str | None, timeout_s: int = 30, sql_timeout_s: int = 10):
        self.dsn = dsn
        self.timeout_s = timeout_s
        self.sql_timeout_s = sql_timeout_s
        self._reader = None
        self._lock = threading.Lock()

    def _no_clickhouse(self) -> None:
        if self.dsn is None:
            raise ApiError(503, "this worker does not hold ClickHouse (the embedded engine lives in the worker with "
                                "the sink): ask that one")

    def _ours(self, sql: str, params: dict) -> tuple[list[str], list[list]]:
        from infra.clickhouse import connect

        self._no_clickhouse()
        with self._lock:
            if self._reader is None:
                self._reader = connect(self.dsn, apply_ddl=False)
            r = self._reader.query(sql, parameters=params or None,
                                   settings={"max_execution_time": self.timeout_s})
            return list(r.column_names), [list(row) for row in r.result_rows]

    async def ours(self, sql: str, params: dict | None = None) -> tuple[list[str], list[list]]:
        return await asyncio.to_thread(self._ours, sql, params or {})

    def close(self) -> None:
        """End the reader session (chdb: one data path per process; a session left open holds it)."""
        with self._lock:
            if self._reader is not None:
                self._reader.close()
                self._reader = None

    async def theirs(self, sql: str, params: dict | None = None) -> tuple[list[str], list[list]]:
        self._no_clickhouse()
        return await asyncio.to_thread(sql_guard.run_readonly, self.dsn, sql, params or {},
                                       {"max_execution_time": self.sql_timeout_s})


def node_state(view) -> str:
    if view.removed:
        return "removed"  # decommissioned for good: whatever its agent still reports
    if view.inventory is None:
        return "no-inventory"
    if not view.alive:
        return "down"
    if view.cordoned:
        return "draining" if view.drain else "cordoned"
    if not view.admitted:
        return "not-admitted"  # `gpupool node admit NODE` (docs/security.md, "Node identity")
    return "ready"


def node_doc(view) -> dict:
    """One node as `gpupool node show` prints it: its cards, what is free, who holds what (job ids)."""
    holders: dict[str, list[str]] = {}
    for job, held in sorted(view.allocations.items()):
        for a in held.slices:
            holders.setdefault(a.mig_uuid or a.gpu_uuid, []).append(job)
            if a.mig_uuid:
                holders.setdefault(a.gpu_uuid, []).append(job)
    free = {c.uuid: c for c in view.card_free()}
    inv = view.inventory

    def use(uuid: str) -> dict:
        s = view.telemetry.get(uuid)
        if s is None:
            return {}
        return {"util_pct": s.util_pct, "mem_used_mib": s.mem_used_mib, "temperature_c": s.temperature_c,
                "power_w": s.power_mw // 1000, "ecc_uncorrected": s.ecc_uncorrected, "xid_errors": list(s.xid_errors)}
    cpu, mem = view.free_cpu_memory()
    return {
        "node": view.node, "state": node_state(view), "rack": inv.rack if inv else "",
        "datacenter": inv.datacenter if inv else "", "labels": dict(inv.labels) if inv else {},
        "cpu_milli": inv.cpu_milli if inv else 0, "free_cpu_milli": cpu, "memory_mib": inv.memory_mib if inv else 0,
        "free_memory_mib": mem, "last_heartbeat_ms": view.last_heartbeat_ms,
        "jobs": sorted(view.allocations),
        "cards": [{"uuid": g.uuid, "index": g.index, "model": g.model, "memory_mib": g.memory_mib,
                   "generation": _generation(g.model), "telemetry": use(g.uuid),
                   "healthy": g.uuid not in view.unhealthy, "fault": view.unhealthy.get(g.uuid, ""),
                   "free_milli": free[g.uuid].milli if g.uuid in free else 0,
                   "free_memory_mib": free[g.uuid].memory_mib if g.uuid in free else 0,
                   "mig": [{"uuid": i.uuid, "profile": i.profile, "holders": sorted(set(holders.get(i.uuid, ()))),
                            "telemetry": use(i.uuid)}
                           for i in g.mig_layout],
                   "holders": sorted(set(holders.get(g.uuid, ())))} for g in (inv.gpus if inv else ())],
    }


def _generation(model_name: str) -> int:
    from schemas.gpu_models import model

    try:
        return model(model_name).generation
    except (KeyError, ValueError):
        return 0


def _plain(rows: list[list]) -> list[list]:
    return [[v if isinstance(v, (int, float, str, bool, type(None))) else str(v) for v in r] for r in rows]


def _asked_job(principal, params: dict) -> tuple[str, str | None]:
    """(the job asked about, the caller's tenant scope): a tenant asking about another tenant's job is told there
    is no such job of its own, as for a job that does not exist."""
    job = params.get("job") or ""
    scope = tenant_scope(principal, None)
    if scope is not None and owner_of(job) != scope:
        raise ApiError(404, f"no job {job!r} of tenant {scope!r}")
    return job, scope


async def answer(path: str, principal: Principal, params: dict, body: bytes, runner: QueryRunner,
                 extra: dict | None = None) -> dict:
    """The document one authorized request gets. `extra`: path -> a function of the worker's memory (cluster, stats,
    principals, nodes), called only for its own path."""
    authorize(path, principal)
    if path == "/api/whoami":
        return {"name": principal.name, "role": principal.role, "tenant": principal.tenant}
    if path == "/api/jobs":
        sql, qp = jobs_sql(tenant_scope(principal, params.get("tenant")), params)
        cols, rows = await runner.ours(sql, qp)
        return {"columns": cols, "rows": _plain(rows)}
    if path == "/api/history":
        job, scope = _asked_job(principal, params)
        cols, rows = await runner.ours(HISTORY_SQL, {"job": job})
        out = []
        for at, kind, node, command_id, actor, payload, reasons in rows:
            doc = {"time_ms": at, "kind": kind, "node": node, "command_id": command_id, "actor": actor,
                   "payload": orjson.loads(payload), "reasons": orjson.loads(reasons) if reasons else []}
            out.append(redact(doc, scope) if scope is not None else doc)
        return {"job": job, "events": out}
    if path == "/api/logs":
        # the job's tenant (a member of another tenant is told there is no such job of its own) and operators
        job, _ = _asked_job(principal, params)
        if not job:
            raise ApiError(400, "job: the job whose output to show (TENANT/NAME)")
        sql, qp, backwards = logs_query(job, params)
        _, rows = await runner.ours(sql, qp)
        return logs_doc(job, rows, backwards, qp["after"], qp["limit"])
    if path == "/api/quota":
        t = tenant_scope(principal, params.get("tenant"))
        cols, rows = await runner.ours(QUOTA_SQL.replace("{where}", "tenant = {t:String}" if t else "1"),
                                       {"t": t} if t else {})
        return {"columns": cols, "rows": _plain(rows)}
    if path == "/api/reservations":
        t = tenant_scope(principal, params.get("tenant"))
        sql = RESERVATIONS_SQL.replace("{where}", "startsWith(JSONExtractString(payload, 'reservation_id'), "
                                                  "concat({t:String}, '/'))" if t else "1")
        sql = sql.replace("{outer}", "tenant = {t:String} AND project != ''" if t else "project != ''")
        cols, rows = await runner.ours(sql, {"t": t} if t else {})
        return {"columns": cols, "rows": _plain(rows)}
    if path == "/api/prices":
        cols, rows = await runner.ours(PRICES_SQL)
        return {"columns": cols, "rows": _plain(rows)}
    if path == "/api/explain":
        job, scope = _asked_job(principal, params)
        cols, rows = await runner.ours(EXPLAIN_SQL, {"job": job})
        out = []
        for at, kind, node, reasons, actor in rows:
            rs = orjson.loads(reasons)
            out.append({"time_ms": at, "kind": kind, "node": node, "actor": actor,
                        "reasons": redact(rs, scope) if scope is not None else rs})
        return {"job": job, "events": out}
    if path == "/api/billing":
        cost = params.get("cost") in ("1", "true")
        sql, qp = billing_sql(params.get("by") or "tenant", tenant_scope(principal, params.get("tenant")),
                              params.get("project"), _int(params, "since"), _int(params, "until"), cost=cost)
        cols, rows = await runner.ours(sql, qp)
        if cost:
            cols, rows = with_money(cols, rows)
        return {"columns": cols, "rows": _plain(rows)}
    if path == "/api/invoice":
        return await invoice_answer(principal, params, runner)
    if path == "/api/telemetry":
        since = _int(params, "since") or 0
        group = params.get("by") or "workload"
        if group not in TELEMETRY_GROUPS:
            raise ApiError(400, f"by: one of {', '.join(TELEMETRY_GROUPS)}")
        t = tenant_scope(principal, params.get("tenant"))
        where, qp = ["1"], {"since": since}
        if t is not None:
            where.append("tenant = {tenant:String}")
            qp["tenant"] = t
        if params.get("job"):
            where.append("job_id = {job:String}")
            qp["job"] = params["job"]
        cols, rows = await runner.ours(TELEMETRY_SQL.replace("{group}", TELEMETRY_GROUPS[group])
                                       .replace("{where}", " AND ".join(where)), qp)
        doc = {"by": group, "columns": cols, "rows": _plain(rows)}
        if principal.role != "tenant" and not params.get("job"):  # the whole pool, idle cards included
            pc, pr = await runner.ours(POOL_UTIL_SQL, {"since": since})
            doc["pool"] = {"columns": pc, "rows": _plain(pr)}
        return doc
    if path == "/api/pool":
        cols, rows = await runner.ours(POOL_SQL, {"since": _int(params, "since") or 0})
        return {"columns": cols, "rows": [[v if not isinstance(v, dict) else dict(v) for v in r] for r in rows]}
    if path == "/api/service":
        scope = tenant_scope(principal, None)
        service = params.get("service") or ""
        if not service:
            where, qp = ("startsWith(JSONExtractString(payload, 'service_id'), concat({t:String}, '/'))",
                         {"t": scope}) if scope is not None else ("1", {})
            cols, rows = await runner.ours(SERVICES_SQL.replace("{where}", where), qp)
            return {"columns": cols, "rows": _plain(rows)}
        if scope is not None and owner_of(service) != scope:
            raise ApiError(404, f"no service {service!r} of tenant {scope!r}")
        cols, rows = await runner.ours(SERVICE_SQL, {"service": service})
        doc = service_doc(service, rows)
        return redact(doc, scope) if scope is not None else doc
    if path == "/api/service/endpoints":
        scope = tenant_scope(principal, None)
        service = params.get("service") or ""
        if not service:
            raise ApiError(400, "service: the service whose endpoints to list")
        if scope is not None and "/" not in service:
            service = f"{scope}/{service}"  # a tenant names its own services with or without the tenant
        if scope is not None and owner_of(service) != scope:
            raise ApiError(404, f"no service {service!r} of tenant {scope!r}")
        import time

        cols, rows = await runner.ours(ENDPOINTS_SQL, {"service": service})
        return endpoints_doc(service, rows, time.time_ns() // 1_000_000, ramp_ms(params))
    if path == "/api/sql":
        if len(body) > MAX_BODY_BYTES:
            raise ApiError(413, f"the request body is over {MAX_BODY_BYTES} bytes: an SQL text may have at most "
                                f"{sql_guard.MAX_SQL_BYTES}")
        try:
            doc = orjson.loads(body or b"{}")
            sql, qp = str(doc.get("sql", "")), doc.get("parameters") or {}
        except (orjson.JSONDecodeError, AttributeError):
            raise ApiError(400, 'body: {"sql": "...", "parameters": {...}}') from None
        try:
            cols, rows = await runner.theirs(sql, qp)
        except sql_guard.QueryTooLarge as exc:
            raise ApiError(413, str(exc)) from None
        except sql_guard.QueryRefused as exc:
            raise ApiError(400, f"refused: {exc}") from None
        except Exception as exc:  # noqa: BLE001 - ClickHouse's own refusal or error, returned to the caller
            raise ApiError(400, str(exc).splitlines()[0][:2000]) from None
        return {"columns": cols, "rows": _plain(rows)}
    doc = (extra or {})[path]()
    if inspect.isawaitable(doc):  # pages that ask the other workers for their partitions
        doc = await doc
    if path == "/api/nodes":
        try:
            _, holds = await runner.ours(HOLDS_SQL)
        except Exception:  # noqa: BLE001 - no store to ask (a worker without ClickHouse): the views alone
            holds = None
        if holds is not None:
            doc = with_holds(doc, holds)
        if principal.role == "tenant":
            return redact(doc, principal.tenant)
    return doc


def access_table() -> str:
    """The table of docs/security.md: each role's rights on Kafka (from infra.principals.acls_for), the requests the gateway takes
    from it, and the HTTP endpoints it may use; tests/test_security.py checks the doc shows exactly this."""
    def ops(acls: list[Acl], *wanted: str, permission: str = "allow") -> str:
        names = sorted({(a.name + ("*" if a.pattern == "prefixed" else ""))
                        for a in acls if a.resource == "topic" and a.permission == permission
                        and (a.operation in wanted or a.operation == "all")})
        return ", ".join(f"`{n.replace('NAME', 'NAME')}`" for n in names) or "-"

    rows = ["| role | writes (Kafka) | reads (Kafka) | requests the gateway takes | HTTP endpoints |",
            "|---|---|---|---|---|"]
    for role in security.ROLES:
        acls = acls_for("NAME", role)
        kinds = ", ".join(f"`{k}`" for k in sorted(KINDS_BY_ROLE.get(role, ()))) or "-"
        http = ", ".join(f"`{p}`" for p, (_, roles, _) in ENDPOINTS.items() if role in roles) or "-"
        extra = []
        if any(a.resource == "cluster" and a.operation == "alter" for a in acls):
            extra.append("cluster ALTER (SCRAM users, ACLs)")
        groups = sorted({a.name + ("*" if a.pattern == "prefixed" else "") for a in acls if a.resource == "group"})
        if groups:
            extra.append("groups " + ", ".join(f"`{g}`" for g in groups))
        denied = ops(acls, "read", permission="deny")
        reads = ops(acls, "read") + (f" but not {denied}" if denied != "-" else "") + (
            "; " + "; ".join(extra) if extra else "")
        rows.append(f"| `{role}` | {ops(acls, 'write')} | {reads} | {kinds} | {http} |")
    return "\n".join(rows) + "\n"
