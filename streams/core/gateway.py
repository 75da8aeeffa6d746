"""The gateway: where a person's request becomes a fact. Pure; the worker's inbox consumer (streams/app.py) calls it.

A request arrives on its principal's inbox topic (`gpupool.in.NAME`), which only that principal may write, so the
topic says who sent it; the registry (principals topic) says the principal's role and tenant. The gateway then
- refuses kinds the role may not state, and payloads about another tenant (`tenant_mismatch`);
- qualifies ids with the tenant ("train-1" from a member of acme is job "acme/train-1"), so tenants' ids never
  collide and a tenant can never name another tenant's job, reservation or service;
- stamps what the system owns: source `in/NAME/KEY` (KEY: the record's routing key, so one source's records share
  a partition), seq = the inbox offset (so a client re-using its own sequence numbers loses nothing), event id
  `in/NAME:OFFSET`, event time = the broker's append time of the request, the actor = the principal; the client's
  own time is kept as `claimed_time_ms` (data, never a clock).
Every refusal is an event the sender can read: `job.rejected` for job requests, `request.rejected` for others.
"""
from __future__ import annotations

from dataclasses import dataclass

from pydantic import ValidationError

from schemas.envelope import DecodeError, Envelope, envelope
from schemas.events import KINDS, PrincipalRegistered, PrincipalRemoved, Reason, Rejected, RequestRejected
from schemas.routing import home, key_of

TENANT_KINDS = frozenset({
    "job.requested", "job.cancelled", "job.scale_requested", "reservation.requested", "reservation.cancelled",
    "service.declared", "service.removed", "inference.load",
})
OPERATOR_KINDS = TENANT_KINDS | frozenset({"quota.set", "node.cordon", "node.removed", "gpu.health", "price.set",
                                          "node.admitted"})
KINDS_BY_ROLE = {"tenant": TENANT_KINDS, "operator": OPERATOR_KINDS}
JOB_KINDS = frozenset({"job.requested", "job.cancelled", "job.scale_requested"})
# the id field each request kind names its subject by, qualified with the tenant
ID_FIELDS = {"job.requested": "job_id", "job.cancelled": "job_id", "job.scale_requested": "job_id",
             "reservation.requested": "reservation_id", "reservation.cancelled": "reservation_id",
             "service.declared": "service_id", "service.removed": "service_id", "inference.load": "service_id"}
SOURCE_PREFIX = "in/"


@dataclass(frozen=True)
class Principal:
    name: str
    role: str
    tenant: str | None = None
    token_sha256: str = ""
    nodes: tuple[str, ...] = ()  # node role: the nodes it speaks for (streams/core/node_relay.py)
    auto_admit: bool = False


def fold_registry(registry: dict[str, Principal], env: Envelope) -> dict[str, Principal]:
    """The principals topic as a map; a removal forgets the name."""
    p = env.payload
    if isinstance(p, PrincipalRegistered):
        return {**registry, p.name: Principal(p.name, p.role, p.tenant, p.token_sha256, p.nodes, p.auto_admit)}
    if isinstance(p, PrincipalRemoved):
        return {k: v for k, v in registry.items() if k != p.name}
    return registry


@dataclass(frozen=True)
class Outcome:
    accepted: Envelope | None = None  # the request as a fact, for its home topic
    rejected: Envelope | None = None  # the answer the sender reads
    dead_letter: tuple[str, str] | None = None  # (code, detail): nothing to answer (undecodable)


class Refused(Exception):
    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code, self.message = code, message


def qualify(tenant: str, ident: str) -> str:
    """`name` -> `tenant/name`; an id that already names a tenant must name this one."""
    if "/" not in ident:
        return f"{tenant}/{ident}"
    owner, _, rest = ident.partition("/")
    if owner != tenant or not rest:
        raise Refused("tenant_mismatch", f"{ident!r} names tenant {owner!r}, not {tenant!r}")
    return ident


def _request_doc(raw: bytes | None) -> tuple[dict, dict]:
    """(what the client claimed about itself, the payload) of what it sent: a whole envelope (any supported
    version, upcast) or just the payload (`{"kind": ...}`). Only the payload is validated, by admit(): the
    envelope's fields are the client's claims, kept as data when they have the right type."""
    from schemas.envelope import SCHEMA_VERSION, json_object
    from schemas.upcasters import upcast

    doc = json_object(raw)
    if "payload" not in doc:
        return {}, doc
    version = doc.get("schema_version", 1)
    if not isinstance(version, int) or not 1 <= version <= SCHEMA_VERSION:
        raise Refused("future_version" if isinstance(version, int) and version > SCHEMA_VERSION else "invalid",
                      f"schema_version {version!r}; this pool reads 1..{SCHEMA_VERSION}")
    doc = upcast(doc)
    payload = doc.get("payload")
    if not isinstance(payload, dict):
        raise Refused("invalid", "payload: an object with a kind")
    kept: dict = {}
    t = doc.get("event_time_ms")
    if isinstance(t, int) and not isinstance(t, bool) and t >= 0:
        kept["event_time_ms"] = t
    for k in ("event_id", "correlation_id"):
        v = doc.get(k)
        if isinstance(v, str) and 0 < len(v) <= 200:
            kept[k] = v
    return kept, payload


def admit(principal: Principal | None, owner: str, raw: bytes | None, offset: int, log_ms: int) -> Outcome:
    """Decide one inbox record. `owner`: the inbox's principal name; `log_ms`: the broker's append time. Every
    record gets an outcome the sender can read; one that is not even JSON is also dead-lettered."""
    payload: dict = {}
    try:
        try:
            meta, payload = _request_doc(raw)
        except DecodeError as exc:
            return Outcome(rejected=_answer(principal, owner, offset, log_ms, "", {}, Refused(exc.code, exc.detail)),
                           dead_letter=(exc.code, exc.detail))
        kind = payload.get("kind", "")
        if kind not in KINDS:
            raise Refused("unknown_kind", f"kind {kind!r}")
        if principal is None:
            raise Refused("unknown_principal", f"{owner!r} is not a registered principal")
        allowed = KINDS_BY_ROLE.get(principal.role, frozenset())
        if kind not in allowed:
            raise Refused("forbidden", f"role {principal.role} may not send {kind}")
        payload, tenant = _scope(principal, kind, dict(payload))
        try:
            event = KINDS[kind].model_validate(payload)
        except ValidationError as exc:
            first = exc.errors()[0]
            raise Refused("invalid", f"{'.'.join(str(p) for p in first['loc'])}: {first['msg']}") from None
    except Refused as why:
        return Outcome(rejected=_answer(principal, owner, offset, log_ms, payload.get("kind", ""), payload, why))
    claimed = meta.get("event_time_ms")
    # One source per (principal, routing key): every record of a source lands in one partition of its home topic,
    # so the per-source order the folds and the scheduler rely on survives Kafka (docs/architecture.md).
    probe = envelope(event, source="gateway", seq=0, time_ms=log_ms)
    key = key_of(probe, home(kind)).decode()
    env = envelope(event, source=f"{SOURCE_PREFIX}{owner}/{key}", seq=offset, time_ms=log_ms, tenant=tenant,
                   actor=owner, claimed_time_ms=claimed, causation_id=meta.get("event_id"),
                   event_id=f"{SOURCE_PREFIX}{owner}:{offset}",
                   correlation_id=meta.get("correlation_id") or getattr(event, ID_FIELDS.get(kind, "kind"), None))
    return Outcome(accepted=env)


def clock_skew_ms(env: Envelope) -> int:
    """How far the client's clock was from the broker's when it sent the request (0 when it claimed nothing)."""
    return 0 if env.claimed_time_ms is None else env.claimed_time_ms - env.event_time_ms


def _scope(principal: Principal, kind: str, payload: dict) -> tuple[dict, str | None]:
    """The payload with its ids qualified and its tenant checked; and the tenant it concerns."""
    field = ID_FIELDS.get(kind)
    if principal.role == "tenant":
        tenant = principal.tenant
        if "tenant" in payload and payload["tenant"] != tenant:
            raise Refused("tenant_mismatch",
                          f"the request names tenant {payload['tenant']!r}; {principal.name} is a member of "
                          f"{tenant!r}")
        if kind in ("job.requested", "reservation.requested", "service.declared"):
            payload.setdefault("tenant", tenant)
    else:  # operators act for anyone: the tenant is the one the request names, or the qualified id's
        tenant = payload.get("tenant")
        if field and tenant is None:
            ident = str(payload.get(field, ""))
            if "/" not in ident:
                raise Refused("unqualified_id", f"an operator names {field} as TENANT/NAME, not {ident!r}")
            tenant = ident.split("/", 1)[0]
    if field and field in payload:
        payload[field] = qualify(tenant, str(payload[field]))
    if kind == "job.requested":
        if payload.get("service_id"):
            raise Refused("forbidden", "service_id is set by the autoscaler, not by a request")
        if payload.get("reservation_id"):
            payload["reservation_id"] = qualify(tenant, str(payload["reservation_id"]))
    return payload, tenant


def _answer(principal: Principal | None, owner: str, offset: int, log_ms: int, kind: str, payload: dict,
            why: Refused) -> Envelope:
    """The refusal, in the sender's own namespace: a job request's answer names the job as the sender's tenant
    would own it, so it can never land on another tenant's job."""
    source = f"gateway/{owner}"
    role = principal.role if principal is not None else ""
    tenant = principal.tenant if role == "tenant" else None
    reason = Reason(code=why.code, plugin="Gateway", message=why.message)
    field = ID_FIELDS.get(kind)
    raw_id = str(payload.get(field, "")) if field else ""
    job_id = None
    if kind in JOB_KINDS and raw_id:
        if role == "tenant":
            job_id = raw_id if raw_id.startswith(f"{tenant}/") else f"{tenant}/{raw_id}"
        elif role == "operator" and "/" in raw_id:
            job_id = raw_id  # an operator acts in the tenant the id names
    if job_id is not None:
        return envelope(Rejected(job_id=job_id, code=why.code, reasons=(reason,)), source=source, seq=offset,
                        time_ms=log_ms, tenant=tenant, actor=owner, event_id=f"{source}:{offset}")
    subject = raw_id or str(payload.get("node", "") or payload.get("tenant", ""))
    return envelope(RequestRejected(request_id=f"{owner}@{offset}", principal=owner, request_kind=kind,
                                    subject=subject[:200], code=why.code, message=why.message[:2000]),
                    source=source, seq=offset, time_ms=log_ms, tenant=tenant, actor=owner)
