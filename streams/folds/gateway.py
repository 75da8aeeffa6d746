"""The gateway: where a person's request becomes a fact. Pure; the worker's inbox consumer (streams/edge/app.py) calls it.

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

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass

from pydantic import TypeAdapter, ValidationError

from schemas.envelope import SCHEMA_VERSION, DecodeError, Envelope, envelope, json_object
from schemas.upcasters import upcast
from schemas.events import ID_MAX, KINDS, Ident, PrincipalRegistered, PrincipalRemoved, Reason, Rejected, RequestRejected
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
_IDENT = TypeAdapter(Ident)
# The longest id a request may give (the tenant's prefix included): the pool derives ids from it -- a reservation's
# hold (`ID#hold`) and its placement (`hold-ID#hold-0`), a service's replicas (`ID/r12`), a release
# (`release-ID`) -- each of which must still be an id (ID_MAX). 40 characters are kept for those.
REQUEST_ID_MAX = ID_MAX - 40


@dataclass(frozen=True)
class RateLimit:
    """How many requests one principal's inbox may hold per window of log time (Slurm's and Kubernetes' API
    Priority and Fairness' answer to one client's burst: the excess is refused at the door, cheaply, and told).

    Counted on the log itself: the n-th record of an inbox whose append time falls in window w (of `window_ms`) is
    refused when n > `per_window`. n is the record's offset less the offset of the first record of that window
    (the broker answers it: ListOffsets by time), so the decision is a function of the inbox alone -- a re-run of
    the gateway after a crash, or another worker taking the inbox over, decides every record as before."""
    window_ms: int = 10_000
    per_window: int = 200  # a burst of 200, 20 requests/s sustained


@dataclass(frozen=True)
class Principal:
    name: str
    role: str
    tenant: str | None = None
    token_sha256: str = ""
    nodes: tuple[str, ...] = ()  # node role: the nodes it speaks for (streams/folds/node_relay.py)
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


def admit(principal: Principal | None, owner: str, raw: bytes | None, offset: int, log_ms: int,
          window_first: int | None = None, limit: RateLimit = RateLimit(),
          volumes: Mapping[str, object] | None = None) -> Outcome:
    """Decide one inbox record. `owner`: the inbox's principal name; `log_ms`: the broker's append time;
    `window_first`: the offset of the inbox's first record in this record's rate window (RateLimit; None: not
    counted); `volumes`: the operator's allow-list of mountable volumes (infra/config.py, Volume; None: none). Every
    record gets an outcome the sender can read; one that is not even JSON is also dead-lettered."""
    payload: dict = {}
    try:
        try:
            meta, payload = _request_doc(raw)
        except DecodeError as exc:
            answer = _refusal(principal, owner, offset, log_ms, {}, Refused(exc.code, exc.detail))
            return Outcome(rejected=answer.rejected, dead_letter=(exc.code, exc.detail))
        if window_first is not None and offset - window_first >= limit.per_window:
            raise Refused("rate_limited", f"{owner} sent more than {limit.per_window} requests in "
                                          f"{limit.window_ms // 1000} s of log time; this one was not admitted: send "
                                          f"it again from {(log_ms // limit.window_ms + 1) * limit.window_ms} ms on")
        kind = payload.get("kind", "")
        if not isinstance(kind, str) or kind not in KINDS:
            raise Refused("unknown_kind", f"kind {printable(repr(kind))}")
        if principal is None:
            raise Refused("unknown_principal", f"{owner!r} is not a registered principal")
        allowed = KINDS_BY_ROLE.get(principal.role, frozenset())
        if kind not in allowed:
            raise Refused("forbidden", f"role {principal.role} may not send {kind}")
        payload, tenant = _scope(principal, kind, dict(payload))
        try:
            event = KINDS[kind].model_validate(payload)
        except ValidationError as exc:
            raise Refused("invalid", _invalid(exc)) from None
        if kind == "job.requested":
            _check_volumes(event.volumes, volumes or {})
        claimed = meta.get("event_time_ms")
        # One source per (principal, routing key): every record of a source lands in one partition of its home
        # topic, so the per-source order the folds and the scheduler rely on survives Kafka (docs/architecture.md).
        probe = envelope(event, source="gateway", seq=0, time_ms=log_ms)
        key = key_of(probe, home(kind)).decode()
        try:
            env = envelope(event, source=source_of(owner, key), seq=offset, time_ms=log_ms, tenant=tenant,
                           actor=owner, claimed_time_ms=claimed, causation_id=meta.get("event_id"),
                           event_id=f"{SOURCE_PREFIX}{owner}:{offset}",
                           correlation_id=meta.get("correlation_id") or getattr(event, ID_FIELDS.get(kind, "kind"),
                                                                                None))
        except ValidationError as exc:
            raise Refused("invalid", _invalid(exc)) from None
    except Refused as why:
        return _refusal(principal, owner, offset, log_ms, payload, why)
    return Outcome(accepted=env)


def _check_volumes(mounts, allowed: Mapping[str, object]) -> None:
    """A job mounts only volumes of the operator's list, and a read-only one only read-only (docs/jobs.md)."""
    for m in mounts:
        vol = allowed.get(m.volume)
        if vol is None:
            raise Refused("unknown_volume", f"volume {m.volume!r} is not on the operator's list of volumes"
                                            f"{' (' + ', '.join(sorted(allowed)) + ')' if allowed else ' (none)'}; "
                                            f"a job names a volume, never a host path")
        if getattr(vol, "read_only", True) and not m.read_only:
            raise Refused("read_only_volume", f"volume {m.volume!r} may be mounted read-only only (:ro)")


def _invalid(exc: ValidationError) -> str:
    """The first problem pydantic found, in words a sender reads (an id's pattern said as the rule it keeps)."""
    first = exc.errors()[0]
    where = ".".join(str(p) for p in first["loc"])
    if first["type"] == "string_pattern_mismatch":
        return (f"{where}: not an id (letters, digits, punctuation and symbols only: no white space, control or "
                f"format characters)")
    msg = first["msg"].removeprefix("Value error, ")
    return f"{where}: {msg}" if where else msg


def _refusal(principal: Principal | None, owner: str, offset: int, log_ms: int, payload: dict,
             why: Refused) -> Outcome:
    """The answer to a refused request; should even that not be built, the raw record as a dead letter, so that no
    record can stop the gateway (every refusal has an outcome: an answer, or a dead letter saying why not)."""
    kind = payload.get("kind", "")
    try:
        return Outcome(rejected=_answer(principal, owner, offset, log_ms, kind if isinstance(kind, str) else "",
                                        payload, why))
    except (ValidationError, ValueError, TypeError) as exc:
        return Outcome(dead_letter=("unanswerable", f"{why.code}: {printable(why.message, 500)}; the answer could "
                                                    f"not be built: {printable(str(exc), 500)}"))


def source_of(owner: str, key: str) -> str:
    """The source of an inbox's records with one routing key: `in/NAME/KEY`, or, where that would be longer than an
    id may be (a job id near the limit), the key's digest in its place -- the same key, the same source."""
    source = f"{SOURCE_PREFIX}{owner}/{key}"
    if len(source) <= ID_MAX:
        return source
    return f"{SOURCE_PREFIX}{owner}/#{hashlib.sha256(key.encode()).hexdigest()[:32]}"


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
        payload[field] = _qualified(tenant, field, payload[field])
    if kind == "job.requested":
        if payload.get("service_id"):
            raise Refused("forbidden", "service_id is set by the autoscaler, not by a request")
        if payload.get("reservation_id"):
            payload["reservation_id"] = _qualified(tenant, "reservation_id", payload["reservation_id"])
    return payload, tenant


def _qualified(tenant: str, field: str, value) -> str:
    """An id of the request qualified with the tenant, refused in words when it is not a string or not an id the
    contracts take once qualified (too long, characters an id may not hold)."""
    if not isinstance(value, str):
        raise Refused("invalid", f"{field}: a string, not {type(value).__name__}")
    ident = qualify(tenant, value)
    why = id_problem(field, ident)
    if why is not None:
        raise Refused("invalid", why)
    return ident


def printable(text: str, limit: int = 200) -> str:
    """`text` as it may be shown in a table or a log line: cut to `limit` characters, and every character an id may
    not hold (control, format such as a bidi override, white space other than a plain space) written as an escape,
    so a refusal quoting what the sender sent can neither break a line nor turn the text around."""
    return "".join(ch if ch == " " or valid_id(ch) else ch.encode("unicode_escape").decode("ascii")
                   for ch in text[:limit])


def id_problem(field: str, text: str, longest: int = REQUEST_ID_MAX) -> str | None:
    """Why `text` is not an id a request may give, in words a sender reads; None when it is one. The characters
    are the contracts' rule (`valid_id`, schemas/events.py's Ident), asked of each character to name the one."""
    if not text:
        return f"{field}: empty"
    if len(text) > longest:
        return f"{field}: {len(text)} characters, at most {longest} (the tenant's prefix included)"
    bad = next((ch for ch in text if not valid_id(ch)), None)
    if bad is not None:
        return (f"{field}: U+{ord(bad):04X} is not allowed in an id (letters, digits, punctuation and symbols only: "
                f"no white space, control or format characters)")
    return None


def valid_id(text: str) -> bool:
    """Whether `text` is an id the contracts take (schemas/events.py, Ident: the one rule)."""
    try:
        _IDENT.validate_python(text)
    except ValidationError:
        return False
    return True


def _answer(principal: Principal | None, owner: str, offset: int, log_ms: int, kind: str, payload: dict,
            why: Refused) -> Envelope:
    """The refusal, in the sender's own namespace: a job request's answer names the job as the sender's tenant
    would own it, so it can never land on another tenant's job. It is always valid: a job id that is not one the
    contracts take (too long once qualified, characters an id may not hold) is answered as a `request.rejected`
    quoting it, escaped and cut (`printable`)."""
    source = f"gateway/{owner}"
    role = principal.role if principal is not None else ""
    tenant = principal.tenant if role == "tenant" else None
    reason = Reason(code=why.code, plugin="Gateway", message=printable(why.message, 2000))
    field = ID_FIELDS.get(kind)
    raw_id = payload.get(field, "") if field else ""
    raw_id = raw_id if isinstance(raw_id, str) else ""
    job_id = None
    if kind in JOB_KINDS and raw_id:
        if role == "tenant":
            job_id = raw_id if raw_id.startswith(f"{tenant}/") else f"{tenant}/{raw_id}"
        elif role == "operator" and "/" in raw_id:
            job_id = raw_id  # an operator acts in the tenant the id names
    if job_id is not None and valid_id(job_id):
        return envelope(Rejected(job_id=job_id, code=why.code, reasons=(reason,)), source=source, seq=offset,
                        time_ms=log_ms, tenant=tenant, actor=owner, event_id=f"{source}:{offset}")
    subject = raw_id or str(payload.get("node", "") or payload.get("tenant", ""))
    return envelope(RequestRejected(request_id=f"{owner}@{offset}", principal=owner, request_kind=printable(kind),
                                    subject=printable(subject), code=why.code, message=reason.message),
                    source=source, seq=offset, time_ms=log_ms, tenant=tenant, actor=owner)
