"""The envelope every record on every topic carries, and the wire codec (orjson)."""
from __future__ import annotations

from typing import Annotated

import orjson
from pydantic import Field, Strict, ValidationError

from schemas.events import COMMAND_KINDS, KINDS, Event, Frozen, Ident, Int, NonNeg
from schemas.upcasters import SCHEMA_VERSION, upcast

MAX_RECORD_BYTES = 1 << 20


class Envelope(Frozen):
    schema_version: Annotated[int, Strict(), Field(ge=1)] = SCHEMA_VERSION
    event_id: Ident
    source: Ident  # the producer; (source, seq) orders a source's facts
    seq: NonNeg
    event_time_ms: NonNeg
    causation_id: str | None = None
    correlation_id: str | None = None
    tenant: str | None = None
    # Set by the gateway on requests it lets in: the authenticated principal, and the time the client claimed
    # (event_time_ms is then the broker's append time of the request: docs/security.md).
    actor: str | None = None
    claimed_time_ms: Int | None = None
    payload: Event

    @property
    def kind(self) -> str:
        return self.payload.kind

    @property
    def is_command(self) -> bool:
        return self.payload.kind in COMMAND_KINDS


def envelope(payload, *, source: str, seq: int, time_ms: int, causation_id: str | None = None,
             correlation_id: str | None = None, tenant: str | None = None, event_id: str | None = None,
             actor: str | None = None, claimed_time_ms: int | None = None) -> Envelope:
    """Build an envelope; the default event id is derived from (source, seq) so a re-send is recognisable."""
    return Envelope(
        event_id=event_id or f"{source}:{seq}", source=source, seq=seq, event_time_ms=time_ms,
        causation_id=causation_id, correlation_id=correlation_id,
        # the payload's own field, read from its fields: getattr on a kind without one costs pydantic's formatted
        # AttributeError (~2 us), and most records (commands, node facts) have none
        tenant=tenant if tenant is not None else payload.__dict__.get("tenant"), actor=actor,
        claimed_time_ms=claimed_time_ms, payload=payload,
    )


class DecodeError(ValueError):
    """Why a record cannot be folded; `code` is the dead-letter reason."""

    def __init__(self, code: str, detail: str):
        super().__init__(f"{code}: {detail}")
        self.code = code
        self.detail = detail


def encode(env: Envelope) -> bytes:
    return orjson.dumps(env.model_dump(mode="json", exclude_defaults=False))


def json_object(raw: bytes | bytearray | memoryview | None) -> dict:
    """A record's value as a JSON object, or the DecodeError that says why it is not one (empty, too large, not
    JSON, not an object): the checks every reader of records makes before it looks inside."""
    if raw is None:
        raise DecodeError("empty", "record has no value")
    if len(raw) > MAX_RECORD_BYTES:
        raise DecodeError("oversized", f"{len(raw)} bytes > {MAX_RECORD_BYTES}")
    try:
        doc = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise DecodeError("malformed_json", str(exc)) from None
    if not isinstance(doc, dict):
        raise DecodeError("not_an_object", type(doc).__name__)
    return doc


def decode(raw: bytes | bytearray | memoryview | None) -> Envelope:
    doc = json_object(raw)
    version = doc.get("schema_version", 1)
    if not isinstance(version, int) or version < 1:
        raise DecodeError("invalid", f"schema_version {version!r}")
    if version > SCHEMA_VERSION:
        raise DecodeError("future_version", f"schema_version {version} > supported {SCHEMA_VERSION}")
    doc = upcast(doc)
    payload = doc.get("payload")
    kind = payload.get("kind") if isinstance(payload, dict) else None
    if not isinstance(kind, str) or kind not in KINDS:  # a list or an object as the kind: unknown, not a crash
        raise DecodeError("unknown_kind", f"kind {kind!r}")
    try:
        return Envelope.model_validate(doc)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise DecodeError("invalid", f"{where}: {first['msg']} ({exc.error_count()} error(s))") from None



# ---------------------------------------------------------------- the hot record's fast path

# `gpu.telemetry` is most of what crosses the wire (a record a node a second, a sample a card). `decode` parses it with
# orjson and then validates the Python objects; pydantic can parse and validate the bytes in one pass instead, at
# two thirds of the cost (docs/performance.md). The two JSON parsers agree on every document without NaN/Infinity (no
# field of a telemetry record takes a float, so those fail validation either way) and on every integer in
# [-2**63, 2**64) (orjson turns any other into a float, pydantic keeps it exact): a record with a run of 19 digits
# anywhere (-2**63 - 1 has 19; every integer of 18 digits or fewer is in range, of either sign),
# records of an older or a future version, of another kind, and everything the one-pass validation refuses go
# through `decode`, which accepts or refuses them exactly as before (tests/test_telemetry_decode.py).
_DIGIT_RUNS = bytes(0x39 if 0x30 <= b <= 0x39 else 0x20 for b in range(256))  # every digit a "9", the rest blank
_CURRENT_HEAD = b'{"schema_version":%d,' % SCHEMA_VERSION  # how `encode` starts a current record
_NINETEEN_DIGITS = b"9" * 19  # (20 until a record with -2**63 - 1 in an unbounded field was folded, not refused)


def decode_telemetry(raw: bytes | bytearray | memoryview | None) -> Envelope:
    """`decode` for the records of the telemetry topic, with a one-pass fast path for current `gpu.telemetry`."""
    if type(raw) is not bytes or len(raw) > MAX_RECORD_BYTES or not raw.startswith(_CURRENT_HEAD) \
            or raw.count(b"schema_version") != 1 or _NINETEEN_DIGITS in raw.translate(_DIGIT_RUNS):
        return decode(raw)  # (the version as encode writes it, once: else the one pass would take "3" or 3.0)
    try:
        env = Envelope.model_validate_json(raw)
    except ValueError:  # ValidationError, not JSON: decode says which dead letter it is
        return decode(raw)
    if env.schema_version != SCHEMA_VERSION or "schema_version" not in env.model_fields_set \
            or env.payload.kind != "gpu.telemetry":
        return decode(raw)  # an older version is upcast there (an absent version is version 1), a future refused
    return env


# ---------------------------------------------------------------- every record's fast path

# The same one pass for the records of any kind (the scheduler's input: `core.replay`, the agent's step), with more
# guards. `decode` reads the schema version off orjson's document and refuses one that is not an int ("3", 3.0),
# where the one-pass validation would coerce it: the fast path takes only a record that starts as `encode` writes it,
# `{"schema_version":3,`, names that key nowhere else and has no backslash at all (an escape such as \\u005f is the
# only way to write a key other than literally; a duplicate key is one orjson and pydantic both resolve to the last). And no field of any
# contract takes a float (schemas/events.py: quantities are integers), yet an integral JSON float such as 1.0 or 1e3
# is read as an int by either path; to leave nothing to the two parsers' rounding of a fraction or an exponent, a
# record with a digit followed by "." or "e"/"E" anywhere (a number that is not a plain integer; in a string, such as
# "8.0", it costs only the slow path) goes through `decode` too, as do runs of 19 digits (above).
_MARKS = bytes(0x39 if 0x30 <= b <= 0x39 else 0x2E if b == 0x2E else 0x65 if b in (0x45, 0x65) else 0x5C if b == 0x5C
               else 0x20 for b in range(256))  # digits a "9", "." and "\\" kept, "e"/"E" an "e", the rest blank


def decode_fast(raw: bytes | bytearray | memoryview | None) -> Envelope:
    """`decode`, with a one-pass fast path for a current record of any kind: an equal Envelope (same class, fields
    and fields set) or the same DecodeError (tests/test_fast_decode.py)."""
    if type(raw) is not bytes or len(raw) > MAX_RECORD_BYTES or not raw.startswith(_CURRENT_HEAD) \
            or raw.count(b"schema_version") != 1:
        return decode(raw)
    marks = raw.translate(_MARKS)
    if b"\\" in marks or b"9." in marks or b"9e" in marks or _NINETEEN_DIGITS in marks:
        return decode(raw)
    try:
        return Envelope.model_validate_json(raw)
    except ValueError:  # ValidationError, not JSON: decode says which dead letter it is
        return decode(raw)
