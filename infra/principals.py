"""Principals as the broker knows them: SCRAM credentials, the ACLs of each role, the inbox of each requester, and the
registry record the worker reads. `ACL_TABLE` is the one statement of who may do what on Kafka (docs/security.md
renders it); `gpupool user add|list|remove` and `gpupool up` go through `add` / `remove` / `bootstrap`.
"""
from __future__ import annotations

import asyncio
import time

from infra import security
from infra.kafka_admin import Acl, KafkaAdmin
from infra.security import ADMIN, SERVICE, Credentials, KafkaConn
from schemas.envelope import encode, envelope
from schemas.events import PrincipalRegistered, PrincipalRemoved
from schemas.routing import key_of
from schemas.topics import (
    ALL_TOPICS, COMMANDS, INBOX_PREFIX, JOB_LOGS, NODE_CHANNEL_PREFIX, PRINCIPALS, inbox, node_channel,
)

GROUP_PREFIX_SERVICE = "gpupool"  # gpupool (Faust), gpupool-scheduler, gpupool-sink, gpupool-gateway, ...
GROUP_PREFIX_NODE = "gpupool-agent"  # gpupool-agent-NODE (NVML), gpupool-agent-sim-... (a simulated fleet)



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
        # inboxes and node channels are read (the gateway, the node relay), never written; Faust's own internal
        # topics are made and used by it
        allow("topic", INBOX_PREFIX, "read", "describe", pattern="prefixed")
        allow("topic", NODE_CHANNEL_PREFIX, "read", "describe", pattern="prefixed")
        allow("topic", "gpupool-", "all", pattern="prefixed")
        allow("topic", "gpupool.", "create", pattern="prefixed")
        allow("group", GROUP_PREFIX_SERVICE, "all", pattern="prefixed")
        allow("cluster", "kafka-cluster", "describe", "describe_configs")
    elif role == "node":
        # its own channel only: the worker relays what it says about its own nodes (docs/security.md)
        allow("topic", node_channel(name).name, "write", "describe")
        allow("topic", COMMANDS.name, "read", "describe")
        allow("group", GROUP_PREFIX_NODE, "read", "describe", pattern="prefixed")
    elif role in ("tenant", "operator"):
        allow("topic", inbox(name).name, "write", "describe")
        if role == "operator":
            # user management: inboxes, node channels, SCRAM credentials and ACLs (cluster ALTER), the registry
            allow("topic", INBOX_PREFIX, "create", "describe", pattern="prefixed")
            allow("topic", NODE_CHANNEL_PREFIX, "create", "describe", pattern="prefixed")
            allow("topic", PRINCIPALS.name, "write", "describe")
            allow("cluster", "kafka-cluster", "alter", "describe")
    elif role == "auditor":
        allow("topic", "gpupool", "read", "describe", pattern="prefixed")  # the whole log, inboxes included
        # but not what programs printed: a job's output is its tenant's and the operators' (docs/jobs.md, "Logs")
        out.append(Acl(user, "topic", JOB_LOGS.name, "read", "literal", permission="deny"))
        allow("group", "gpupool-scheduler", "describe")  # the scheduler's committed offset bounds the comparison
        allow("group", "gpupool-sink", "describe")
    # finance: nothing on Kafka; bills are read over the worker's HTTP API
    return out


def has_inbox(role: str) -> bool:
    return role in ("tenant", "operator")


def own_topic(creds: Credentials):
    """The topic only this principal writes: a requester's inbox, a node principal's channel, or None."""
    if has_inbox(creds.role):
        return inbox(creds.name)
    if creds.role == "node":
        return node_channel(creds.name)
    return None


def registration(creds: Credentials) -> PrincipalRegistered:
    return PrincipalRegistered(name=creds.name, role=creds.role, tenant=creds.tenant, token_sha256=creds.token_sha256,
                               nodes=tuple(creds.nodes), auto_admit=creds.auto_admit)


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
    if own_topic(creds) is not None:
        await ensure_topics(conn, (own_topic(creds),))
    await _publish(conn, registration(creds))
    await _wait_authenticates(conn.as_user(creds.name, creds.password))


async def add_many(conn: KafkaConn, many: list[Credentials]) -> None:
    """`add` for many principals at once (the simulated fleet's node principals): one admin connection, the ACLs
    and topics in one request each, one producer for the registry records."""
    from aiokafka import AIOKafkaProducer

    from infra.kafka_local import ensure_topics

    if not many:
        return
    async with KafkaAdmin(conn) as admin:
        want: list[Acl] = []
        for creds in many:
            await admin.upsert_user(creds.name, creds.password, conn.mechanism)
            await admin.delete_acls(f"User:{creds.name}")
            want += acls_for(creds.name, creds.role)
        await admin.create_acls(want)
        for creds in many:
            await _wait_acls(admin, f"User:{creds.name}", acls_for(creds.name, creds.role))
    await ensure_topics(conn, tuple(t for c in many if (t := own_topic(c)) is not None))
    producer = AIOKafkaProducer(**conn.options(), acks="all", enable_idempotence=True)
    await producer.start()
    try:
        for creds in many:
            env = envelope(registration(creds), source=f"principals/{conn.username}", seq=time.time_ns() // 1000,
                           time_ms=time.time_ns() // 1_000_000, actor=conn.username)
            await producer.send(PRINCIPALS.name, key=key_of(env, PRINCIPALS), value=encode(env))
        await producer.flush()
    finally:
        await producer.stop()
    for creds in many:
        await _wait_authenticates(conn.as_user(creds.name, creds.password))


# A simulated fleet of more nodes than this gets one principal for all of them (the `simulated` mode,
# docs/security.md): creating thousands of SCRAM users and channels costs minutes; a real fleet has one a node.
FLEET_PRINCIPALS_MAX = 64


def fleet_principal(nodes: list[str]) -> str:
    """The one principal of a big simulated fleet: `node-fleet-` and a digest of its nodes, so that two fleets of one
    stack never take each other's nodes away."""
    import hashlib

    return "node-fleet-" + hashlib.sha256("\n".join(sorted(nodes)).encode()).hexdigest()[:12]


def fleet_credentials(home, nodes: list[str], *, auto_admit: bool = True) -> list[Credentials]:
    """The node principals of a simulated fleet: one a node (`node-NODE`), or one for all when the fleet has more
    than FLEET_PRINCIPALS_MAX nodes; stored ones are kept when they still speak for the same nodes."""
    if len(nodes) > FLEET_PRINCIPALS_MAX:
        wanted = [(fleet_principal(nodes), tuple(nodes))]
    else:
        wanted = [(security.node_principal(n), (n,)) for n in nodes]
    out = []
    for name, speaks_for in wanted:
        creds = security.stored(home, name)
        if creds is None or creds.role != "node" or creds.nodes != speaks_for or creds.auto_admit != auto_admit:
            creds = security.new_credentials(name, "node", nodes=speaks_for, auto_admit=auto_admit)
        out.append(creds)
    return out


async def add_fleet(cfg, conn: KafkaConn, nodes: list[str]) -> list[Credentials]:
    """Make (or refresh) the simulated fleet's node principals, auto-admitted (the operator starting a simulated
    fleet admits it), and store their credentials under $GPUPOOL_HOME."""
    many = fleet_credentials(cfg.home, nodes)
    await add_many(conn, many)
    for creds in many:
        security.save(cfg.home, creds)
    return many


async def remove(conn: KafkaConn, name: str) -> int:
    """Delete a principal's credential and ACLs and tell the registry; its inbox stays (it is history)."""
    async with KafkaAdmin(conn) as admin:
        removed = await admin.delete_acls(f"User:{name}")
        await admin.delete_user(name, conn.mechanism)
    await _publish(conn, PrincipalRemoved(name=name))
    return removed


async def bootstrap(cfg, conn: KafkaConn) -> list[str]:
    """What `gpupool up` (and the test stacks) make first: the topics, then `service` and one operator, `admin`, each
    with credentials stored under $GPUPOOL_HOME. Existing stored credentials are kept. The node principals come
    with the fleet (`add_fleet`, `gpupool user add NAME --role node --node NODE`)."""
    from infra.kafka_local import ensure_topics

    await ensure_topics(conn)
    made = []
    for name, role in ((SERVICE, "service"), (ADMIN, "operator")):
        creds = security.stored(cfg.home, name)
        if creds is None or creds.role != role:
            creds = security.new_credentials(name, role)
        await add(conn, creds)
        security.save(cfg.home, creds)
        made.append(name)
    return made
