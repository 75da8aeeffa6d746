"""The general decoder (schemas.envelope.decode_fast: the scheduler's input, core.replay and the agent's step) says
what `decode` says, for a record of any kind: documents drawn from the envelope's JSON schema (every kind, every
optional field present or absent), records the scheduler reads and writes in a short run, each in its canonical form
or damaged -- a value anywhere changed, removed, retyped, made a float, a big integer or an odd string, a byte
changed, inserted or dropped -- an older or a future schema version, bytes that are not JSON. Either an Envelope
equal to `decode`'s (same class, same fields, same fields set, same bytes written again) or the DecodeError
`decode` raises, with the same code."""
from __future__ import annotations

import json
import math
import sys

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from schemas.envelope import SCHEMA_VERSION, DecodeError, Envelope, decode, decode_fast, encode, envelope
from schemas.events import KINDS
from tests.builders import inventory, job

SCHEMA = Envelope.model_json_schema()
DEFS = SCHEMA["$defs"]

text = st.text(max_size=6) | st.sampled_from(["v1.2", "1e5", "9.", "\ud800", "\udc00x", "é", "\x00", "a\"b", "\\"])
edge_ints = st.sampled_from([0, -1, 2**63 - 1, 2**63, 2**64 - 1, 2**64, -(2**63), -(2**63) - 1, 10**18, -(10**18),
                             10**19 - 1]) | st.integers(-(2**70), 2**70)
odd = st.one_of(st.none(), st.booleans(), st.integers(-5, 10**6), edge_ints, text, st.builds(list), st.builds(dict),
                st.floats(allow_nan=False, allow_infinity=False), st.sampled_from([1.0, 1e3, -0.0, 2.5, 1e300, 1.00000000000000011,
                                                             0.1e1, 5e-324, 123456789012345678.0]),
                st.builds(lambda: [1, "a"]), st.builds(lambda: {"a": 1}), st.just("7"), st.sampled_from(sorted(KINDS)))


def from_schema(node: dict, depth: int = 0):
    """A strategy for values of a (pydantic-written) JSON schema node: mostly valid, absent optional fields."""
    if "$ref" in node:
        return st.deferred(lambda: from_schema(DEFS[node["$ref"].rsplit("/", 1)[1]], depth + 1))
    if "const" in node:
        return st.just(node["const"])
    if "enum" in node:
        return st.sampled_from(node["enum"])
    if "oneOf" in node or "anyOf" in node:
        return st.one_of([from_schema(n, depth) for n in node.get("oneOf") or node["anyOf"]])
    t = node.get("type")
    if t == "integer":
        lo = node.get("minimum", node["exclusiveMinimum"] + 1 if "exclusiveMinimum" in node else -3)
        return st.integers(lo, node.get("maximum", lo + 2**40)) | st.just(lo)
    if t == "string":
        size = {"min_size": node.get("minLength", 0), "max_size": min(node.get("maxLength", 8), 8)}
        return st.one_of(*[st.text("abcxyz-_/:0123456789é\u20ac", **size)] * 15, st.text(**size))
    if t == "boolean":
        return st.booleans()
    if t == "null":
        return st.none()
    if t == "array":
        if "prefixItems" in node:
            return st.tuples(*(from_schema(n, depth) for n in node["prefixItems"])).map(list)
        return st.lists(from_schema(node.get("items", {"type": "integer"}), depth + 1), max_size=2 if depth < 4 else 0)
    if t == "object" and "properties" not in node:
        vals = node.get("additionalProperties", {"type": "integer"})
        return st.dictionaries(st.text(max_size=4), from_schema(vals if isinstance(vals, dict) else {}, depth + 1),
                               max_size=2)
    if t == "object":
        req = set(node.get("required", ()))

        @st.composite
        def obj(draw):
            out = {}
            for k, sub in node["properties"].items():
                if k in req or draw(st.booleans()):
                    out[k] = draw(from_schema(sub, depth + 1))
            return out
        return obj()
    return odd


@st.composite
def schema_doc(draw) -> dict:
    kind = draw(st.sampled_from(sorted(KINDS)))
    doc = draw(from_schema({k: v for k, v in SCHEMA.items() if k != "$defs"}
                           | {"properties": {**SCHEMA["properties"], "payload": {"type": "null"}}}))
    doc["payload"] = draw(from_schema(DEFS[KINDS[kind].__name__]))
    if draw(st.integers(0, 9)):
        doc["payload"]["kind"] = kind
    if draw(st.integers(0, 4)):  # mostly current, and first, as `encode` writes it
        doc.pop("schema_version", None)
        doc = {"schema_version": SCHEMA_VERSION, **doc}
    return doc


def _run_docs() -> list[dict]:
    from bench.takeover import history

    docs: list[dict] = []

    def on(i, env, log_ms, outs, s):
        if i % 7 == 0 or env.kind != "scheduler.tick":
            docs.append(orjson.loads(encode(env)))
        docs.extend(orjson.loads(encode(o)) for o in outs[:3])

    history(400, 3, 0, on_record=on)
    for p in (inventory(), job(), job(tenant="acme", duration=None)):
        docs.append(orjson.loads(encode(envelope(p, source="s", seq=3, time_ms=99))))
    return docs


RUN_DOCS = _run_docs()


def _spots(doc):
    """Every (container, key) in a document: each value's place, a dict's new key, a list's first element."""
    out = []
    if isinstance(doc, dict):
        out.extend((doc, k) for k in doc)
        out.append((doc, "extra_field"))
        for v in doc.values():
            out.extend(_spots(v))
    elif isinstance(doc, list):
        out.extend((doc, i) for i in range(len(doc)))
        for v in doc:
            out.extend(_spots(v))
    return out


@st.composite
def damaged(draw, doc: dict) -> dict:
    doc = orjson.loads(orjson.dumps(doc))
    spots = _spots(doc)
    for _ in range(draw(st.integers(1, 2))):
        target, key = draw(st.sampled_from(spots))
        if isinstance(target, dict) and key in target and draw(st.booleans()):
            del target[key]
            spots = _spots(doc)
        elif isinstance(target, dict) or key < len(target):
            value = draw(odd | st.sampled_from([1, 2, SCHEMA_VERSION + 1]))
            if isinstance(target.get(key) if isinstance(target, dict) else target[key], int) and draw(st.booleans()):
                value = draw(st.sampled_from([float(target[key]), float(target[key]) + 0.5, -float(target[key])])
                             if not isinstance(target[key], bool) else st.just(1.0))
            target[key] = value
            spots = _spots(doc)
    return doc


@settings(max_examples=2000, database=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(st.data())
def test_a_damaged_document_shares_no_container_with_another_draw(data):
    """damaged() writes into what it inserted: a list or dict drawn once and shared by every draw (st.just) was once
    set inside itself, stayed cyclic, and failed a later example far from the cause (RecursionError in _spots,
    FlakyStrategyDefinition; CI at 6ecf029). These 2,000 derandomized draws failed so with the shared strategy."""
    doc = data.draw(damaged({"a": 1, "b": {"c": 2}, "l": [3]}))
    assert _spots(doc) is not None


def dumps(doc, style: int = 0) -> bytes:
    """JSON text for a document: compact and UTF-8 as `encode` writes it (a lone surrogate as bytes no UTF-8 decoder
    takes), with \\u escapes, or spaced as json.dumps writes by default."""
    if style == 0:
        return json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode("utf-8", "surrogatepass")
    if style == 1:
        return json.dumps(doc, separators=(",", ":")).encode()
    return json.dumps(doc).encode()


def outcome(fn, raw: bytes):
    try:
        env = fn(raw)
    except DecodeError as exc:
        return ("refused", exc.code)
    sets = []

    def walk(m):
        if hasattr(m, "model_fields_set"):
            sets.append((type(m).__name__, frozenset(m.model_fields_set)))
            for name in type(m).model_fields:
                walk(getattr(m, name))
        elif isinstance(m, (tuple, list)):
            for x in m:
                walk(x)
        elif isinstance(m, dict):
            for x in m.values():
                walk(x)
    walk(env)
    return ("decoded", type(env), type(env.payload), env, env.model_dump_json(), encode(env), sets)


def check(raw: bytes):
    assert outcome(decode_fast, raw) == outcome(decode, raw)


styles = st.integers(0, 9).map(lambda i: max(i - 7, 0))  # mostly as `encode` writes


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_documents_of_every_kind_decode_as_decode_says(data):
    doc = data.draw(schema_doc())
    if data.draw(st.integers(0, 2)) == 0:
        doc = data.draw(damaged(doc))
    check(dumps(doc, data.draw(styles)))


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_the_scheduler_s_records_damaged_or_not_decode_as_decode_says(data):
    doc = data.draw(st.sampled_from(RUN_DOCS))
    if data.draw(st.booleans()):
        doc = data.draw(damaged(doc))
    check(dumps(doc, data.draw(styles)))


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(RUN_DOCS), st.data())
def test_bytes_changed_inserted_or_dropped(doc, data):
    raw = bytearray(orjson.dumps(doc))
    for _ in range(data.draw(st.integers(1, 3))):
        i = data.draw(st.integers(0, len(raw) - 1))
        op = data.draw(st.sampled_from(["set", "insert", "drop"]))
        b = data.draw(st.sampled_from(b'0123456789.eE-+"\\{}[],: \x00\xff\xc3\xed\xa0\x80u'))
        if op == "set":
            raw[i] = b
        elif op == "insert":
            raw.insert(i, b)
        else:
            del raw[i]
    check(bytes(raw))


def test_the_run_covers_the_scheduler_s_kinds_and_takes_the_fast_path(monkeypatch):
    kinds = {d["payload"]["kind"] for d in RUN_DOCS}
    assert {"scheduler.tick", "job.requested", "job.started", "job.completed", "node.inventory", "cmd.place",
            "cmd.release", "usage.accrued"} <= kinds
    module = sys.modules[decode_fast.__module__]
    slow = []
    monkeypatch.setattr(module, "decode", lambda raw: slow.append(raw) or decode(raw))
    raws = [encode(decode(orjson.dumps(d))) for d in RUN_DOCS]
    assert [decode_fast(r) for r in raws] == [decode(r) for r in raws]
    # the slow path only for a record with a digit before a "." (the inventory's compute capability "8.0")
    assert 0 < len(slow) < len(raws) / 10 and all(orjson.loads(r)["payload"]["kind"] == "node.inventory" for r in slow)


@pytest.mark.parametrize("raw", [
    None, b"", b"not json", b"[1, 2]", b"{}", b'{"schema_version": 3, "payload": {"kind": []}}',
    b'{"schema_version": 3}', b"x" * (2 << 20), b'{"a": NaN}', b'{"seq": Infinity}', b'\xef\xbb\xbf{}', b"{} x",
])
def test_other_bytes_are_decode_s(raw):
    check(raw)


@pytest.mark.parametrize("edit", [
    lambda d: d.update(seq=1.0), lambda d: d.update(seq=math.inf), lambda d: d.update(seq=2**64),
    lambda d: d.update(seq=-(2**63) - 1), lambda d: d.update(seq=10**19 - 1), lambda d: d.update(seq=True),
    lambda d: d.update(seq="12"), lambda d: d.update(event_id="\ud800"), lambda d: d.update(schema_version=1),
    lambda d: d.update(schema_version=2), lambda d: d.pop("schema_version"),
    lambda d: d.update(schema_version=SCHEMA_VERSION + 1), lambda d: d.update(schema_version=3.0),
    lambda d: d["payload"].update(kind="job.exploded"), lambda d: d["payload"].update(kind=["cmd.place"]),
])
def test_edges(edit):
    doc = orjson.loads(encode(envelope(job(), source="cli", seq=5, time_ms=1000)))
    edit(doc)
    for style in (0, 1, 2):
        check(dumps(doc, style))


def test_duplicate_keys_are_decode_s():
    base = encode(envelope(job(), source="cli", seq=5, time_ms=1000))
    for a, b in ((b'"seq":5', b'"seq":5,"seq":6'), (b'"schema_version":3', b'"schema_version":3,"schema_version":1'),
                 (b'"kind":"job.requested"', b'"kind":"job.requested","kind":"job.started"'),
                 (b'"kind":"job.requested"', b'"kind":"job.started","kind":"job.requested"')):
        check(base.replace(a, b, 1))


def test_a_memoryview_or_bytearray_is_decode_s():
    raw = encode(envelope(job(), source="cli", seq=5, time_ms=1000))
    for r in (bytearray(raw), memoryview(raw)):
        assert decode_fast(r) == decode(raw)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_pydantic_s_serializer_writes_what_encode_writes(data):
    """The audit matches a replayed output to its recorded copy by the serializer's bytes first
    (agents/audit_segments._to_json): they are `encode`'s, for any envelope that decodes."""
    from agents.audit_segments import _to_json

    doc = data.draw(st.sampled_from(RUN_DOCS) | schema_doc())
    if data.draw(st.booleans()):
        doc = data.draw(damaged(doc))
    try:
        env = decode(dumps(doc))
    except DecodeError:
        return
    assert _to_json(env) == encode(env)
