import orjson
import pytest

from schemas import jsonschema
from schemas.envelope import MAX_RECORD_BYTES, DecodeError, decode, encode, envelope
from schemas.events import KINDS, JobRequested
from tests.builders import inventory, job

REPO_DOCS = __import__("pathlib").Path(__file__).resolve().parent.parent / "docs" / "events"


def test_round_trip_every_kind_we_build():
    for payload in (inventory(), job()):
        env = envelope(payload, source="s", seq=3, time_ms=99)
        assert decode(encode(env)) == env


def test_envelope_carries_tenant_of_the_payload():
    env = envelope(job(tenant="acme"), source="s", seq=1, time_ms=1)
    assert env.tenant == "acme" and env.kind == "job.requested"


@pytest.mark.parametrize("raw,code", [
    (b"{not json", "malformed_json"),
    (b"[1,2]", "not_an_object"),
    (orjson.dumps({"schema_version": 2, "event_id": "e", "source": "s", "seq": 1, "event_time_ms": 1,
                   "payload": {"kind": "job.exploded"}}), "unknown_kind"),
    (orjson.dumps({"schema_version": 99, "event_id": "e", "source": "s", "seq": 1, "event_time_ms": 1,
                   "payload": {"kind": "node.heartbeat", "node": "n"}}), "future_version"),
    (b"{" + b" " * (MAX_RECORD_BYTES + 1) + b"}", "oversized"),
])
def test_bad_records_are_named(raw, code):
    with pytest.raises(DecodeError) as err:
        decode(raw)
    assert err.value.code == code


def test_wrong_types_and_negative_memory_are_invalid():
    good = orjson.loads(encode(envelope(job(), source="s", seq=1, time_ms=1)))
    good["payload"]["gpu_memory_mib"] = -5
    with pytest.raises(DecodeError) as err:
        decode(orjson.dumps(good))
    assert err.value.code == "invalid" and "gpu_memory_mib" in err.value.detail
    good["payload"]["gpu_memory_mib"] = "lots"
    with pytest.raises(DecodeError) as err:
        decode(orjson.dumps(good))
    assert err.value.code == "invalid"


def test_version_1_is_upcast():
    v1 = {"schema_version": 1, "event_id": "e1", "source": "old-client", "seq": 1, "time_ms": 42,
          "payload": {"kind": "job.requested", "job_id": "j", "tenant": "t", "compute_milli": 100,
                      "gpu_memory_gib": 3}}
    env = decode(orjson.dumps(v1))
    assert env.event_time_ms == 42 and env.schema_version == 3 and env.actor is None
    assert isinstance(env.payload, JobRequested) and env.payload.gpu_memory_mib == 3 * 1024


def test_models_are_frozen():
    with pytest.raises(Exception):
        job().compute_milli = 7


def test_published_json_schemas_are_up_to_date():
    docs = jsonschema.documents()
    assert len(docs) == len(KINDS) + 1
    for name, doc in docs.items():
        path = REPO_DOCS / name
        assert path.exists(), f"{name} missing: run `python -m schemas.jsonschema docs/events`"
        assert path.read_text() == jsonschema.render(doc), f"{name} is stale: re-export docs/events"
    stale = {p.name for p in REPO_DOCS.glob("*.json")} - set(docs)
    assert not stale, f"schemas for removed kinds: {stale}"
