"""The worker's HTTP API: who may ask what, and the queries behind each answer (docs/security.md).

Every request but /healthz carries a principal's token (`Authorization: Bearer TOKEN`, or HTTP Basic NAME:TOKEN);
the registry (principals topic) knows each token's SHA-256. A tenant sees only its own tenant's jobs, explanations
and bill, and an explanation shown to a tenant never names another tenant's job. Queries run in threads, never on
the event loop that folds and schedules; people's own SQL goes through infra/sql_guard.py.
"""
from __future__ import annotations

import asyncio
import base64
import re
import threading

import orjson

from infra import sql_guard
from infra.security import same_token
from streams.gateway import Principal

ALL_READERS = ("tenant", "operator", "finance", "auditor", "service")
# path -> (method, roles allowed, what it answers): the table docs/security.md shows and the tests walk
ENDPOINTS: dict[str, tuple[str, tuple[str, ...], str]] = {
    "/healthz": ("GET", (), "whether the worker answers (no data; no token needed)"),
    "/api/whoami": ("GET", ALL_READERS + ("node",), "the caller's name, role and tenant"),
    "/api/jobs": ("GET", ALL_READERS, "jobs with state and node (a tenant: its own)"),
    "/api/explain": ("GET", ("tenant", "operator", "auditor", "service"),
                     "one job's decisions with their reasons (a tenant: its own jobs, other tenants' jobs unnamed)"),
    "/api/billing": ("GET", ("tenant", "finance", "operator", "auditor"), "GPU-seconds (a tenant: its own bill)"),
    "/api/sql": ("POST", ("finance", "auditor", "operator"), "one read-only statement under ClickHouse's limits"),
    "/api/principals": ("GET", ("operator", "auditor"), "who is who (names, roles, tenants; never secrets)"),
    "/cluster/": ("GET", ALL_READERS, "allocation, fragmentation and free capacity (no job names)"),
    "/stats/": ("GET", ("operator", "auditor", "service"), "the worker's counters"),
}

OTHER_JOB = "a job of another tenant"
_QUALIFIED = re.compile(r"(?<![\w/.-])([a-z0-9][a-z0-9-]{0,62})/([A-Za-z0-9_.:#@-][^\s,;()'\"]*)")


class ApiError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


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
SELECT job_id, any(tenant_of) AS tenant,
       multiIf(countIf(kind = 'job.completed') > 0, 'completed', countIf(kind = 'job.failed') > 0, 'failed',
               countIf(kind = 'job.cancelled') > 0, 'cancelled',
               countIf(kind = 'job.rejected' AND code != 'duplicate_job_id') > 0, 'rejected',
               argMaxIf(kind, (event_time, offset), kind IN ('job.started', 'job.stopped')) = 'job.started', 'running',
               countIf(kind = 'cmd.place') > countIf(kind = 'cmd.release'), 'placed', 'pending') AS state,
       argMaxIf(node, (event_time, offset), kind = 'cmd.place') AS node,
       minIf(event_time, kind IN ('job.requested', 'job.rejected')) AS submitted,
       argMinIf(actor, event_time, kind = 'job.requested') AS submitted_by,
       arrayStringConcat(groupUniqArrayIf(code, kind = 'job.rejected'), ',') AS rejections
FROM (SELECT *, event_time, JSONExtractString(payload, 'code') AS code,
             if(position(job_id, '/') > 0, splitByChar('/', job_id)[1], tenant) AS tenant_of
      FROM gpupool.events FINAL WHERE job_id != '' AND {where})
GROUP BY job_id ORDER BY submitted, job_id
"""

EXPLAIN_SQL = """
SELECT event_time_ms, kind, node, reasons, actor FROM (
  SELECT event_time_ms, kind, node, reasons, '' AS actor, event_id FROM gpupool.scheduling FINAL
  WHERE job_id = {job:String}
  UNION ALL
  SELECT event_time_ms, kind, node, '[]' AS reasons, actor, event_id FROM gpupool.events FINAL
  WHERE job_id = {job:String} AND kind IN ('job.requested', 'job.cancelled', 'job.started', 'job.completed',
                                            'job.failed', 'job.stopped')
) ORDER BY event_time_ms, event_id
"""

BILLING_GROUPS = {"tenant": "tenant", "project": "tenant, project", "job": "tenant, project, job_id",
                  "model": "tenant, gpu_model",
                  "day": "tenant, toDate(fromUnixTimestamp64Milli(toInt64(end_ms))) AS day"}


def jobs_sql(tenant: str | None) -> tuple[str, dict]:
    if tenant is None:
        return JOBS_SQL.replace("{where}", "1"), {}
    return JOBS_SQL.replace("{where}", "startsWith(job_id, concat({tenant:String}, '/'))"), {"tenant": tenant}


def billing_sql(by: str, tenant: str | None, project: str | None, since_ms: int | None, until_ms: int | None):
    if by not in BILLING_GROUPS:
        raise ApiError(400, f"by: one of {', '.join(BILLING_GROUPS)}")
    where, params = ["1"], {}
    if tenant:
        where.append("tenant = {tenant:String}")
        params["tenant"] = tenant
    if project:
        where.append("project = {project:String}")
        params["project"] = project
    if since_ms is not None:
        where.append("end_ms >= {since:UInt64}")
        params["since"] = since_ms
    if until_ms is not None:
        where.append("start_ms < {until:UInt64}")
        params["until"] = until_ms
    group = BILLING_GROUPS[by]
    keys = group.replace(" AS day", "").replace("toDate(fromUnixTimestamp64Milli(toInt64(end_ms)))", "day")
    sql = (f"SELECT {group}, sum(gpu_milli_ms) AS milli_gpu_ms, round(sum(gpu_milli_ms) / 1e6, 3) AS gpu_seconds, "
           f"round(sumIf(gpu_milli_ms, borrowed) / 1e6, 3) AS borrowed_gpu_seconds, uniqExact(job_id) AS jobs "
           f"FROM gpupool.usage FINAL WHERE {' AND '.join(where)} GROUP BY {keys} ORDER BY {keys}")
    return sql, params


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

    def __init__(self, dsn: str, timeout_s: int = 30, sql_timeout_s: int = 10):
        self.dsn = dsn
        self.timeout_s = timeout_s
        self.sql_timeout_s = sql_timeout_s
        self._reader = None
        self._lock = threading.Lock()

    def _ours(self, sql: str, params: dict) -> tuple[list[str], list[list]]:
        from infra.clickhouse import connect

        with self._lock:
            if self._reader is None:
                self._reader = connect(self.dsn, apply_ddl=False)
            r = self._reader.query(sql, parameters=params or None,
                                   settings={"max_execution_time": self.timeout_s})
            return list(r.column_names), [list(row) for row in r.result_rows]

    async def ours(self, sql: str, params: dict | None = None) -> tuple[list[str], list[list]]:
        return await asyncio.to_thread(self._ours, sql, params or {})

    async def theirs(self, sql: str, params: dict | None = None) -> tuple[list[str], list[list]]:
        return await asyncio.to_thread(sql_guard.run_readonly, self.dsn, sql, params or {},
                                       {"max_execution_time": self.sql_timeout_s})


def _plain(rows: list[list]) -> list[list]:
    return [[v if isinstance(v, (int, float, str, bool, type(None))) else str(v) for v in r] for r in rows]


async def answer(path: str, principal: Principal, params: dict, body: bytes, runner: QueryRunner,
                 extra: dict | None = None) -> dict:
    """The document one authorized request gets. `extra`: what the worker answers from memory (cluster, stats,
    principals)."""
    authorize(path, principal)
    if path == "/api/whoami":
        return {"name": principal.name, "role": principal.role, "tenant": principal.tenant}
    if path == "/api/jobs":
        sql, qp = jobs_sql(tenant_scope(principal, params.get("tenant")))
        cols, rows = await runner.ours(sql, qp)
        return {"columns": cols, "rows": _plain(rows)}
    if path == "/api/explain":
        job = params.get("job") or ""
        scope = tenant_scope(principal, None)
        if scope is not None and owner_of(job) != scope:
            raise ApiError(404, f"no job {job!r} of tenant {scope!r}")
        cols, rows = await runner.ours(EXPLAIN_SQL, {"job": job})
        out = []
        for at, kind, node, reasons, actor in rows:
            rs = orjson.loads(reasons)
            out.append({"time_ms": at, "kind": kind, "node": node, "actor": actor,
                        "reasons": redact(rs, scope) if scope is not None else rs})
        return {"job": job, "events": out}
    if path == "/api/billing":
        sql, qp = billing_sql(params.get("by") or "tenant", tenant_scope(principal, params.get("tenant")),
                              params.get("project"), _int(params, "since"), _int(params, "until"))
        cols, rows = await runner.ours(sql, qp)
        return {"columns": cols, "rows": _plain(rows)}
    if path == "/api/sql":
        try:
            doc = orjson.loads(body or b"{}")
            sql, qp = str(doc.get("sql", "")), doc.get("parameters") or {}
        except (orjson.JSONDecodeError, AttributeError):
            raise ApiError(400, 'body: {"sql": "...", "parameters": {...}}') from None
        try:
            cols, rows = await runner.theirs(sql, qp)
        except sql_guard.QueryRefused as exc:
            raise ApiError(400, f"refused: {exc}") from None
        except Exception as exc:  # noqa: BLE001 - ClickHouse's own refusal or error, returned to the caller
            raise ApiError(400, str(exc).splitlines()[0][:2000]) from None
        return {"columns": cols, "rows": _plain(rows)}
    return (extra or {})[path]
