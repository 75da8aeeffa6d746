"""The telemetry topic's decoder (schemas.envelope.decode_telemetry, the telemetry task's hot path) says what
`decode` says: for any telemetry record, in its canonical form or damaged by a field changed, removed, retyped,
an older or a future schema version, another kind or bytes that are not JSON, it returns an Envelope equal to
`decode`'s (same class, same fields) or raises the DecodeError `decode` raises, with the same code."""
from __future__ import annotations

import json

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schemas.envelope import SCHEMA_VERSION, DecodeError, decode, decode_telemetry, encode, envelope
from schemas.events import GpuSample, GpuTelemetry, NodeHeartbeat

ints = st.integers(-5, 2**63)
# the edges of the two parsers' exact integers: orjson (decode's parser) reads [-2**63, 2**64) exactly and anything
# beyond as a float; pydantic's own JSON parser keeps every integer exact
edge_ints = st.sampled_from([-(2**64), -(2**63) - 1, -(2**63), 2**63 - 1, 2**63, 2**64 - 1, 2**64,
                             -(10**19) + 1, -(10**18), 10**19 - 1]) | st.integers(-(2**70), 2**70)
text = st.text(max_size=8)
# an id: the characters schemas/events.py's Ident takes (letters, marks, digits, punctuation, symbols)
ident = st.text(st.characters(categories=("L", "M", "N", "P", "S")), min_size=1, max_size=12)


@st.composite
def samples(draw):
    return GpuSample(gpu_uuid=draw(ident), mig_uuid=draw(st.none() | text),
                     util_pct=draw(st.integers(0, 100)), mem_used_mib=draw(st.integers(0, 2**40)),
                     mem_total_mib=draw(st.integers(0, 2**40)), temperature_c=draw(st.integers(-50, 150)),
                     power_mw=draw(st.integers(0, 2**32)), ecc_corrected=draw(st.integers(0, 9)),
                     ecc_uncorrected=draw(st.integers(0, 9)), xid_errors=tuple(draw(st.lists(st.integers(0, 99),
                                                                                              max_size=2))),
                     job_ids=tuple(draw(st.lists(ident, max_size=2))), fault=draw(st.sampled_from(["", "xid 79"])))


@st.composite
def telemetry_doc(draw) -> dict:
    env = envelope(GpuTelemetry(node=draw(ident),
                                samples=tuple(draw(st.lists(samples(), max_size=3)))),
                   source=draw(ident), seq=draw(st.integers(0, 2**62)),
                   time_ms=draw(st.integers(0, 2**45)))
    return orjson.loads(encode(env))


# what a damaged record may carry instead of a field's value
odd_values = st.one_of(st.none(), st.booleans(), ints, edge_ints, st.floats(allow_nan=False), text, st.builds(list),
                       st.builds(dict), st.builds(lambda: [2**64]), st.builds(lambda: [-(2**63) - 1]),
                       st.builds(lambda: [1, "a"]), st.just(5.0), st.just("7"), st.integers(2**64, 2**70))


@st.composite
def damaged(draw, doc: dict) -> dict:
    """The document with one change: a field set to an odd value or removed, at the envelope, payload or a sample."""
    doc = orjson.loads(orjson.dumps(doc))
    where = [doc, doc["payload"], *doc["payload"]["samples"]]
    target = draw(st.sampled_from(where))
    key = draw(st.sampled_from(sorted(target) + ["extra_field"]))
    if draw(st.booleans()) and key in target:
        del target[key]
    else:
        target[key] = draw(odd_values | st.sampled_from([1, 2, SCHEMA_VERSION + 1, "gpu.telemetry", "node.heartbeat"]))
    return doc


def outcome(fn, raw: bytes):
    try:
        env = fn(raw)
    except DecodeError as exc:
        return ("refused", exc.code)
    # equal models, and the same bytes when written again (a field holding True equals one holding 1) and the
    # same fields set (what `exclude_unset` writes)
    sets = (env.model_fields_set, getattr(env.payload, "model_fields_set", None),
            [s.model_fields_set for s in getattr(env.payload, "samples", ())])
    return ("decoded", type(env), env, env.model_dump_json(), sets)


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_the_fast_path_says_what_decode_says(data):
    doc = data.draw(telemetry_doc())
    if data.draw(st.booleans()):
        doc = data.draw(damaged(doc))
    # orjson cannot write integers beyond 64 bits; written as `encode` writes (no spaces), so the fast path is tried
    raw = json.dumps(doc, separators=(",", ":")).encode()
    assert outcome(decode_telemetry, raw) == outcome(decode, raw)


@pytest.mark.parametrize("version", ['"3"', "3.0", "true"])
def test_a_version_decode_refuses_is_refused_on_the_fast_path_too(version):
    """decode reads the version off the document and refuses one that is not an int; the one-pass validation would
    coerce "3" or 3.0 to 3 -- the fast path takes only a record that starts as encode writes it."""
    raw = encode(envelope(GpuTelemetry(node="n1", samples=()), source="n1/telemetry", seq=1, time_ms=42))
    bad = raw.replace(b'"schema_version":3,', b'"schema_version":' + version.encode() + b",", 1)
    assert outcome(decode_telemetry, bad) == outcome(decode, bad)
    if version != "true":  # (True is an int to Python: decode reads it as version 1, and so does the fast path now)
        assert outcome(decode, bad) == ("refused", "invalid")
    again = raw[:-1] + b',"schema_version":' + version.encode() + b"}"  # a second copy of the key, last wins
    assert outcome(decode_telemetry, again) == outcome(decode, again)


def test_a_current_record_takes_the_fast_path(monkeypatch):
    import sys

    envelope_module = sys.modules[decode_telemetry.__module__]

    raw = encode(envelope(GpuTelemetry(node="n1", samples=()), source="n1/telemetry", seq=1, time_ms=42))
    monkeypatch.setattr(envelope_module, "decode", lambda raw: (_ for _ in ()).throw(AssertionError("slow path")))
    assert envelope_module.decode_telemetry(raw).payload.node == "n1"

@pytest.mark.parametrize("raw", [
    b"", b"not json", b"[1, 2]", b'{"schema_version": 3, "payload": {"kind": []}}',
    b'{"schema_version": 3, "payload": {"kind": {"a": 1}}}', b'{"schema_version": 3}', b"x" * (2 << 20), b'{"a": NaN}',
    encode(envelope(NodeHeartbeat(node="n1"), source="n1/telemetry", seq=2, time_ms=9000)),
])
def test_other_bytes_and_kinds_are_decode_s(raw):
    assert outcome(decode_telemetry, raw) == outcome(decode, raw)


def test_an_older_version_is_upcast_and_an_absent_version_is_version_1():
    doc = orjson.loads(encode(envelope(GpuTelemetry(node="n1", samples=()), source="n1/telemetry", seq=1,
                                       time_ms=42)))
    v1 = {k: v for k, v in doc.items() if k not in ("schema_version", "event_time_ms", "actor", "claimed_time_ms")}
    v1["time_ms"] = 42
    for d in (v1, {**v1, "schema_version": 1}):
        env = decode_telemetry(orjson.dumps(d))
        assert env == decode(orjson.dumps(d)) and env.event_time_ms == 42 and env.schema_version == SCHEMA_VERSION
    with pytest.raises(DecodeError) as exc:
        decode_telemetry(orjson.dumps({**doc, "schema_version": SCHEMA_VERSION + 1}))
    assert exc.value.code == "future_version"


INT_FIELDS = {"envelope": ["schema_version", "seq", "event_time_ms", "claimed_time_ms"],
              "sample": ["util_pct", "mem_used_mib", "mem_total_mib", "temperature_c", "power_mw", "ecc_corrected",
                         "ecc_uncorrected", "xid_errors"]}


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_integers_beyond_64_bits_anywhere_are_what_decode_says(data):
    """orjson reads an integer outside [-2**63, 2**64) as a float, which an int field refuses or rounds; pydantic's
    JSON parser keeps it exact. Whatever field it is in (an unbounded one, temperature_c or an xid, included)."""
    doc = data.draw(telemetry_doc().filter(lambda d: d["payload"]["samples"]))
    where = data.draw(st.sampled_from(sorted(INT_FIELDS)))
    target = doc if where == "envelope" else data.draw(st.sampled_from(doc["payload"]["samples"]))
    key = data.draw(st.sampled_from(INT_FIELDS[where]))
    value = data.draw(edge_ints)
    target[key] = [value] if key == "xid_errors" else value
    raw = json.dumps(doc).encode()
    assert outcome(decode_telemetry, raw) == outcome(decode, raw)
