"""Principals as the broker knows them: SCRAM credentials, the ACLs of each role, the inbox of each requester, and the
registry record the worker reads. `ACL_TABLE` is the one statement of who may do what on Kafka (docs/security.md
renders it); `gpupool user add|list|remove` and `gpupool up` go through `add` / `remove` / `bootstrap`.
"""
from __future__ import annotations

import asyncio
import time

from infra import security
from infra.kafka_admin import Acl, KafkaAdmin
from infra.security import ADMIN, NODE, SERVICE, Credentials, KafkaConn
from schemas.envelope import encode, envelope
from schemas.events import PrincipalRegistered, PrincipalRemoved
from schemas.routing import key_of
from schemas.topics import ALL_TOPICS, COMMANDS, INBOX_PREFIX, PRINCIPALS, inbox

GROUP_PREFIX_SERVICE = "gpupool"  # gpupool (Faust), gpupool-scheduler, gpupool-sink, gpupool-gateway, ...
GROUP_PREFIX_NODE = "gpupool-agent"  # gpupool-agent-NODE (NVML), gpupool-agent-sim (simulated fleets)


def _topics_written_by(role: str) -> list[str]:
    return [s.name for s in ALL_TOPICS if s.writer == role]


def acls_for(name: str, role: str) -> list[Acl]:
    """What a principal of `role` may do on Kafka; nothing else is allowed (the authorizer denies by default)."""
    user = f"User:{name}"
    out: list[Acl] = []

    def allow(resource: str, res_name: str, *ops: str, pattern: str = "literal") -> None:
        out.extend(Acl(user, resource, res_name, op, pattern) for op in ops)

    if role == "service":
        for spec in ALL_TOPICS:  # reads everything; writes only what the service states (one writer a topic)
            allow("topic", spec.name, "read", "describe", "describe_configs")
            if spec.writer == "service":
                allow("topic", spec.name, "write")
        # inboxes are read (the gateway), never written; Faust's own internal topics are made and used by it
        allow("topic", INBOX_PREFIX, "read", "describe", pattern="prefixed")
        allow("topic", "gpupool-", "all", pattern="prefixed")
        allow("topic", "gpupool.", "create", pattern="prefixed")
        allow("group", GROUP_PREFIX_SERVICE, "all", pattern="prefixed")
        allow("cluster", "kafka-cluster", "describe", "describe_configs")
    elif role == "node":
        for topic in _topics_written_by("node"):
            allow("topic", topic, "write", "describe")
        allow("topic", COMMANDS.name, "read", "describe")
        allow("group", GROUP_PREFIX_NODE, "read", "describe", pattern="prefixed")
    elif role in ("tenant", "operator"):
        allow("topic", inbox(name).name, "write", "describe")
        if role == "operator":
            # user management: inboxes, SCRAM credentials and ACLs (cluster ALTER), the registry
            allow("topic", INBOX_PREFIX, "create", "describe", pattern="prefixed")
            allow("topic", PRINCIPALS.name, "write", "describe")
            allow("cluster", "kafka-cluster", "alter", "describe")
    elif role == "auditor":
        allow("topic", "gpupool", "read", "describe", pattern="prefixed")  # the whole log, inboxes included
        allow("group", "gpupool-scheduler", "describe")  # the scheduler's committed offset bounds the comparison
        allow("group", "gpupool-sink", "describe")
    # finance: nothing on Kafka; bills are read over the worker's HTTP API
    return out


def has_inbox(role: str) -> bool:
    return role in ("tenant", "operator")


async def _wait_authenticates(conn: KafkaConn, timeout: float = 15.0) -> None:
    """A new credential reaches the broker's metadata a moment after the controller commits it."""
    from aiokafka.admin import AIOKafkaAdminClient

    deadline = time.monotonic() + timeout
    while True:
        admin = AIOKafkaAdminClient(**conn.options(), request_timeout_ms=3000)
        try:
            await admin.start()
            return
        except Exception:  # noqa: BLE001 - not visible yet
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)
        finally:
            await admin.close()


async def _wait_acls(admin: KafkaAdmin, principal: str, want: list[Acl], timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not set(want) <= set(await admin.describe_acls(principal)):
        if time.monotonic() > deadline:
            raise TimeoutError(f"ACLs of {principal} not visible after {timeout}s")
        await asyncio.sleep(0.2)


async def _publish(conn: KafkaConn, payload) -> None:
    from aiokafka import AIOKafkaProducer

    env = envelope(payload, source=f"principals/{conn.username}", seq=time.time_ns() // 1000,
                   time_ms=time.time_ns() // 1_000_000, actor=conn.username)
    producer = AIOKafkaProducer(**conn.options(), acks="all", enable_idempotence=True)
    await producer.start()
    try:
        await producer.send_and_wait(PRINCIPALS.name, key=key_of(env, PRINCIPALS), value=encode(env))
    finally:
        await producer.stop()


async def add(conn: KafkaConn, creds: Credentials) -> None:
    """Create (or update) a principal: its SCRAM credential, its ACLs, its inbox, its registry record. `conn`: an
    operator (or the local broker's own principal at bootstrap)."""
    from infra.kafka_local import ensure_topics

    async with KafkaAdmin(conn) as admin:
        await admin.upsert_user(creds.name, creds.password, conn.mechanism)
        acls = acls_for(creds.name, creds.role)
        await admin.delete_acls(f"User:{creds.name}")  # a role change must not keep the old role's rights
        await admin.create_acls(acls)
        await _wait_acls(admin, f"User:{creds.name}", acls)
    if has_inbox(creds.role):
        await ensure_topics(conn, (inbox(creds.name),))
    await _publish(conn, PrincipalRegistered(name=creds.name, role=creds.role, tenant=creds.tenant,
                                             token_sha256=creds.token_sha256))
    await _wait_authenticates(conn.as_user(creds.name, creds.password))


async def remove(conn: KafkaConn, name: str) -> int:
    """Delete a principal's credential and ACLs and tell the registry; its inbox stays (it is history)."""
    async with KafkaAdmin(conn) as admin:
        removed = await admin.delete_acls(f"User:{name}")
        await admin.delete_user(name, conn.mechanism)
    await _publish(conn, PrincipalRemoved(name=name))
    return removed


async def bootstrap(cfg, conn: KafkaConn) -> list[str]:
    """What `gpupool up` (and the test stacks) make first: the topics, then `service`, `node` and one operator,
    `admin`, each with credentials stored under $GPUPOOL_HOME. Existing stored credentials are kept."""
    from infra.kafka_local import ensure_topics

    await ensure_topics(conn)
    made = []
    for name, role in ((SERVICE, "service"), (NODE, "node"), (ADMIN, "operator")):
        creds = security.stored(cfg.home, name)
        if creds is None or creds.role != role:
            creds = security.new_credentials(name, role)
        await add(conn, creds)
        security.save(cfg.home, creds)
        made.append(name)
    return made


def access_table() -> str:
    """The table of docs/security.md: each role's rights on Kafka (from acls_for), the requests the gateway takes
    from it, and the HTTP endpoints it may use; tests/test_security.py checks the doc shows exactly this."""
    from streams.api import ENDPOINTS
    from streams.core.gateway import KINDS_BY_ROLE

    def ops(acls: list[Acl], *wanted: str) -> str:
        names = sorted({(a.name + ("*" if a.pattern == "prefixed" else ""))
                        for a in acls if a.resource == "topic" and (a.operation in wanted or a.operation == "all")})
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
        reads = ops(acls, "read") + ("; " + "; ".join(extra) if extra else "")
        rows.append(f"| `{role}` | {ops(acls, 'write')} | {reads} | {kinds} | {http} |")
    return "\n".join(rows) + "\n"
