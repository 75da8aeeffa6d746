"""The Kafka admin requests aiokafka lacks: SCRAM credentials (KIP-554) and ACLs, in the flexible protocol versions
Kafka 4 speaks (the old ACL versions were removed by KIP-896). Built on aiokafka's protocol structs and sent over the
admin client's authenticated connection, so no JVM is started for them.
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass

from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.protocol.api import Request, RequestStruct, Response
from aiokafka.protocol.types import (
    CompactArray, CompactBytes, CompactString, Int8, Int16, Int32, Schema, TaggedFields,
)

# Kafka's enums (org.apache.kafka.common.acl / resource)
RESOURCE = {"any": 1, "topic": 2, "group": 3, "cluster": 4, "transactional_id": 5}
PATTERN = {"any": 1, "match": 2, "literal": 3, "prefixed": 4}
OPERATION = {"any": 1, "all": 2, "read": 3, "write": 4, "create": 5, "delete": 6, "alter": 7, "describe": 8,
             "cluster_action": 9, "describe_configs": 10, "alter_configs": 11, "idempotent_write": 12}
PERMISSION = {"any": 1, "deny": 2, "allow": 3}
SCRAM_MECHANISM = {"SCRAM-SHA-256": 1, "SCRAM-SHA-512": 2}
SCRAM_ITERATIONS = 8192
_NAMES = {kind: {v: k for k, v in table.items()} for kind, table in
          (("resource", RESOURCE), ("pattern", PATTERN), ("operation", OPERATION), ("permission", PERMISSION))}


class KafkaAdminError(RuntimeError):
    pass


@dataclass(frozen=True, order=True)
class Acl:
    """ALLOW `operation` on a resource (name matched literally or as a prefix) to `principal` ("User:NAME")."""
    principal: str
    resource: str  # topic | group | cluster | transactional_id
    name: str
    operation: str
    pattern: str = "literal"  # literal | prefixed
    permission: str = "allow"
    host: str = "*"

    def row(self) -> tuple:
        return (RESOURCE[self.resource], self.name, PATTERN[self.pattern], self.principal, self.host,
                OPERATION[self.operation], PERMISSION[self.permission], {})


# ---------------------------------------------------------------- protocol structs

def _str():
    return CompactString("utf-8")


class _AlterScramResponse(Response):
    API_KEY = 51
    API_VERSION = 0
    SCHEMA = Schema(("throttle_time_ms", Int32),
                    ("results", CompactArray(("user", _str()), ("error_code", Int16), ("error_message", _str()),
                                             ("tags", TaggedFields))),
                    ("tags", TaggedFields))


class _AlterScramStruct(RequestStruct):
    FLEXIBLE_VERSION = True
    API_KEY = 51
    API_VERSION = 0
    RESPONSE_TYPE = _AlterScramResponse
    SCHEMA = Schema(("deletions", CompactArray(("name", _str()), ("mechanism", Int8), ("tags", TaggedFields))),
                    ("upsertions", CompactArray(("name", _str()), ("mechanism", Int8), ("iterations", Int32),
                                                ("salt", CompactBytes), ("salted_password", CompactBytes),
                                                ("tags", TaggedFields))),
                    ("tags", TaggedFields))


class _AlterScram(Request[_AlterScramStruct]):
    API_KEY = 51

    def __init__(self, deletions, upsertions):
        self.deletions, self.upsertions = deletions, upsertions

    def build(self, cls):
        return cls(self.deletions, self.upsertions, {})


def _acl_response(version: int):
    class _CreateAclsResponse(Response):
        API_KEY = 30
        API_VERSION = version
        SCHEMA = Schema(("throttle_time_ms", Int32),
                        ("results", CompactArray(("error_code", Int16), ("error_message", _str()),
                                                 ("tags", TaggedFields))),
                        ("tags", TaggedFields))
    return _CreateAclsResponse


_ACL_ROW = (("resource_type", Int8), ("resource_name", _str()), ("pattern_type", Int8), ("principal", _str()),
            ("host", _str()), ("operation", Int8), ("permission_type", Int8), ("tags", TaggedFields))


class _CreateAclsV2(RequestStruct):
    FLEXIBLE_VERSION = True
    API_KEY = 30
    API_VERSION = 2
    RESPONSE_TYPE = _acl_response(2)
    SCHEMA = Schema(("creations", CompactArray(*_ACL_ROW)), ("tags", TaggedFields))


class _CreateAclsV3(_CreateAclsV2):
    API_VERSION = 3
    RESPONSE_TYPE = _acl_response(3)


class _CreateAcls(Request[_CreateAclsV2 | _CreateAclsV3]):
    API_KEY = 30

    def __init__(self, rows):
        self.rows = rows

    def build(self, cls):
        return cls(self.rows, {})


def _delete_response(version: int):
    class _DeleteAclsResponse(Response):
        API_KEY = 31
        API_VERSION = version
        SCHEMA = Schema(("throttle_time_ms", Int32),
                        ("filter_results", CompactArray(
                            ("error_code", Int16), ("error_message", _str()),
                            ("matching_acls", CompactArray(("error_code", Int16), ("error_message", _str()),
                                                           *_ACL_ROW)),
                            ("tags", TaggedFields))),
                        ("tags", TaggedFields))
    return _DeleteAclsResponse


class _DeleteAclsV2(RequestStruct):
    FLEXIBLE_VERSION = True
    API_KEY = 31
    API_VERSION = 2
    RESPONSE_TYPE = _delete_response(2)
    SCHEMA = Schema(("filters", CompactArray(*_ACL_ROW)), ("tags", TaggedFields))


class _DeleteAclsV3(_DeleteAclsV2):
    API_VERSION = 3
    RESPONSE_TYPE = _delete_response(3)


class _DeleteAcls(Request[_DeleteAclsV2 | _DeleteAclsV3]):
    API_KEY = 31

    def __init__(self, filters):
        self.filters = filters

    def build(self, cls):
        return cls(self.filters, {})


def _describe_response(version: int):
    class _DescribeAclsResponse(Response):
        API_KEY = 29
        API_VERSION = version
        SCHEMA = Schema(("throttle_time_ms", Int32), ("error_code", Int16), ("error_message", _str()),
                        ("resources", CompactArray(
                            ("resource_type", Int8), ("resource_name", _str()), ("pattern_type", Int8),
                            ("acls", CompactArray(("principal", _str()), ("host", _str()), ("operation", Int8),
                                                  ("permission_type", Int8), ("tags", TaggedFields))),
                            ("tags", TaggedFields))),
                        ("tags", TaggedFields))
    return _DescribeAclsResponse


class _DescribeAclsV2(RequestStruct):
    FLEXIBLE_VERSION = True
    API_KEY = 29
    API_VERSION = 2
    RESPONSE_TYPE = _describe_response(2)
    SCHEMA = Schema(*_ACL_ROW)


class _DescribeAclsV3(_DescribeAclsV2):
    API_VERSION = 3
    RESPONSE_TYPE = _describe_response(3)


class _DescribeAcls(Request[_DescribeAclsV2 | _DescribeAclsV3]):
    API_KEY = 29

    def __init__(self, row):
        self.row = row

    def build(self, cls):
        return cls(*self.row)


# ---------------------------------------------------------------- the admin

def salted_password(password: str, salt: bytes, iterations: int, mechanism: str = "SCRAM-SHA-512") -> bytes:
    algo = "sha512" if mechanism == "SCRAM-SHA-512" else "sha256"
    return hashlib.pbkdf2_hmac(algo, password.encode(), salt, iterations)


def _check(results: list[dict], what: str) -> None:
    errors = [f"{r.get('user') or what}: error {r['error_code']} {r['error_message'] or ''}".strip()
              for r in results if r["error_code"]]
    if errors:
        raise KafkaAdminError("; ".join(errors))


class KafkaAdmin:
    """SCRAM users and ACLs over an authenticated aiokafka admin connection (`conn`: infra.security.KafkaConn)."""

    def __init__(self, conn, request_timeout_ms: int = 30_000):
        self.conn = conn
        self.client = AIOKafkaAdminClient(**conn.options(), request_timeout_ms=request_timeout_ms)

    async def __aenter__(self) -> "KafkaAdmin":
        await self.client.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.client.close()

    async def _send(self, request):
        node = self.client._client.get_random_node()
        return (await self.client._client.send(node, request)).to_object()

    async def upsert_user(self, name: str, password: str, mechanism: str = "SCRAM-SHA-512") -> None:
        salt = os.urandom(32)
        resp = await self._send(_AlterScram([], [(name, SCRAM_MECHANISM[mechanism], SCRAM_ITERATIONS, salt,
                                                  salted_password(password, salt, SCRAM_ITERATIONS, mechanism), {})]))
        _check(resp["results"], name)

    async def delete_user(self, name: str, mechanism: str = "SCRAM-SHA-512") -> None:
        resp = await self._send(_AlterScram([(name, SCRAM_MECHANISM[mechanism], {})], []))
        errors = [r for r in resp["results"] if r["error_code"] not in (0, 91)]  # 91: no such credential
        _check(errors, name)

    async def create_acls(self, acls: list[Acl]) -> None:
        if acls:
            resp = await self._send(_CreateAcls([a.row() for a in acls]))
            _check(resp["results"], "acl")

    async def delete_acls(self, principal: str) -> int:
        """Every ACL of `principal`; returns how many were removed."""
        flt = (RESOURCE["any"], None, PATTERN["any"], principal, None, OPERATION["any"], PERMISSION["any"], {})
        resp = await self._send(_DeleteAcls([flt]))
        _check(resp["filter_results"], "acl")
        return sum(len(r["matching_acls"]) for r in resp["filter_results"])

    async def describe_acls(self, principal: str | None = None) -> list[Acl]:
        flt = (RESOURCE["any"], None, PATTERN["any"], principal, None, OPERATION["any"], PERMISSION["any"], {})
        resp = await self._send(_DescribeAcls(flt))
        if resp["error_code"]:
            raise KafkaAdminError(f"describe acls: error {resp['error_code']} {resp['error_message'] or ''}")
        out = []
        for res in resp["resources"]:
            for a in res["acls"]:
                out.append(Acl(a["principal"], _NAMES["resource"][res["resource_type"]], res["resource_name"],
                               _NAMES["operation"][a["operation"]], _NAMES["pattern"][res["pattern_type"]],
                               _NAMES["permission"][a["permission_type"]], a["host"]))
        return sorted(out)
