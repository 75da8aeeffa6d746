"""No record can stop a consumer (issue #31 item 1), as properties over arbitrary input: what a hostile or careless
client may send -- any JSON, ids of any length and any characters, numbers where strings go and the reverse, sizes
near the limits -- driven through the functions the worker's consumers call: the gateway (`gateway.admit`), the
decoder, the node and job folds, the telemetry fold, the scheduler's step (`core.step_contained`, the one the live
agent and every replay use) and the sink's rows.

Every input ends admitted or refused with a reason the sender can read, and the answer itself is always a valid
record; nothing but a `DecodeError` leaves the decoder; no fold and no scheduler step raises on a record that
decodes. The live half (tests/test_containment_live.py) shows the worker itself going on."""
from __future__ import annotations

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agents.scheduler.core import Scheduler, step_contained
from schemas.envelope import DecodeError, decode, decode_fast, encode, envelope
from schemas.events import ID_MAX, KINDS, NodeInventory, QuotaSet, SchedulerTick
from streams.folds import gateway, job_view, node_view
from streams.folds.gateway import TENANT_KINDS, Principal
from streams.folds.rows import rows_for

PRINCIPALS = [Principal("alice", "tenant", "acme"), Principal("admin", "operator"), Principal("fin", "finance"),
              None]

# what a client can put where a value goes: every JSON type, integers past 64 bits, long and strange text
NASTY_TEXT = st.one_of(
    st.text(max_size=40),
    st.text(alphabet=st.sampled_from(["a", "/", "\x00", "\n", "\u202e", "\u200b", "\ufeff", " ", "\u2066", "é",
                                      "中", "\U0001F600", "\\", '"', ";"]), max_size=30),
    st.integers(min_value=ID_MAX - 10, max_value=ID_MAX + 10).map(lambda n: "x" * n),
    st.sampled_from(["x" * 5000, "acme/" + "y" * 196, "globex/x", "/", "acme/", "a/b/c"]),
)
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(2 ** 70), max_value=2 ** 70),
                    st.floats(allow_nan=False, allow_infinity=False), NASTY_TEXT)
JSON = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                                           max_size=3),
                    max_leaves=8)

# a valid request of each kind a tenant sends; the fuzz then replaces or adds fields
BASE = {
    "job.requested": {"kind": "job.requested", "job_id": "j1", "compute_milli": 1000, "gpu_memory_mib": 1024},
    "job.cancelled": {"kind": "job.cancelled", "job_id": "j1"},
    "job.scale_requested": {"kind": "job.scale_requested", "job_id": "j1", "compute_milli": 2000},
    "reservation.requested": {"kind": "reservation.requested", "reservation_id": "r1", "compute_milli": 1000,
                              "gpu_memory_mib": 1024, "start_ms": 0, "end_ms": 3_600_000},
    "reservation.cancelled": {"kind": "reservation.cancelled", "reservation_id": "r1"},
    "service.declared": {"kind": "service.declared", "service_id": "s1", "replica_compute_milli": 500,
                         "replica_memory_mib": 1024},
    "service.removed": {"kind": "service.removed", "service_id": "s1"},
    "inference.load": {"kind": "inference.load", "service_id": "s1", "qps": 10},
    "quota.set": {"kind": "quota.set", "tenant": "acme", "gpu_milli": 4000},
    "node.cordon": {"kind": "node.cordon", "node": "n1"},
}


def _fields(kind: str) -> list[str]:
    return sorted(KINDS[kind].model_fields) if kind in KINDS else []


@st.composite
def requests(draw) -> dict:
    kind = draw(st.sampled_from(sorted(BASE) + ["no.such.kind"]))
    doc = dict(BASE.get(kind, {"kind": kind}))
    names = st.sampled_from(_fields(kind) + ["tenant", "extra"]) if kind in KINDS else st.text(max_size=6)
    id_field = gateway.ID_FIELDS.get(kind, "node" if kind == "node.cordon" else "tenant")
    if draw(st.booleans()):  # the id: what the answer has to name
        doc[id_field] = draw(NASTY_TEXT)
    for name, value in draw(st.dictionaries(names, NASTY_TEXT | JSON, max_size=3)).items():
        doc[name] = value
    if draw(st.booleans()):  # a whole envelope around it, with the client's own claims
        doc = {"schema_version": draw(st.sampled_from([1, 2, 3, 4, "3", True])), "event_id": draw(JSON),
               "event_time_ms": draw(JSON), "payload": doc}
    return doc


def _readable(text: str) -> bool:
    """A reason a person reads in a table: no control or format characters (a bidi override, a NUL, a newline), by
    the contracts' one rule for an id's characters (its Unicode tables, not this Python's older ones), or a space."""
    return all(ch == " " or gateway.valid_id(ch) for ch in text)


def _answer_text(env) -> str:
    p = env.payload
    if p.kind == "job.rejected":
        return " ".join(r.message for r in p.reasons) + p.job_id
    return p.message + p.subject + p.request_kind


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(principal=st.sampled_from(PRINCIPALS), doc=requests())
def test_every_request_is_admitted_or_refused_with_a_valid_readable_answer(principal, doc):
    raw = orjson.dumps(doc, option=orjson.OPT_PASSTHROUGH_SUBCLASS) if _encodable(doc) else b"\xff"
    out = gateway.admit(principal, "alice", raw, 7, 1_700_000_000_000)  # must not raise, whatever it is
    assert (out.accepted is None) != (out.rejected is None)  # admitted, or refused with an answer (never dropped)
    for env in (out.accepted, out.rejected):
        if env is not None:
            assert decode_fast(encode(env)) == env  # a valid record: every reader of its topic takes it
    if out.rejected is not None:
        assert out.rejected.payload.code and _readable(_answer_text(out.rejected))
    if out.accepted is not None:
        assert principal is not None and out.accepted.kind in gateway.KINDS_BY_ROLE[principal.role]
        if principal.role == "tenant":
            assert out.accepted.tenant == "acme"
        ident = getattr(out.accepted.payload, gateway.ID_FIELDS.get(out.accepted.kind, "kind"), "")
        assert gateway.valid_id(ident)


def _encodable(doc) -> bool:
    try:
        orjson.dumps(doc)
    except orjson.JSONEncodeError:  # an integer past 64 bits: the client can only send its text
        return False
    return True


@settings(max_examples=300, deadline=None)
@given(raw=st.binary(max_size=200) | st.sampled_from([b"", b"null", b"[]", b'{"payload": 1}',
                                                       b'{"schema_version": 99, "payload": {}}',
                                                       b'{"payload": {"kind": ["x"]}}']))
def test_the_decoder_raises_nothing_but_a_decode_error(raw):
    for dec in (decode, decode_fast):
        try:
            dec(raw)
        except DecodeError:
            pass


def _inventory(node: str) -> dict:
    return NodeInventory(node=node, cpu_milli=1000, memory_mib=1024).model_dump(mode="json")


FACTS = {
    "node.inventory": _inventory("n1"),
    "gpu.telemetry": {"kind": "gpu.telemetry", "node": "n1", "samples": [
        {"gpu_uuid": "GPU-n1-0", "util_pct": 5, "mem_used_mib": 1, "mem_total_mib": 10}]},
    "job.started": {"kind": "job.started", "job_id": "acme/j1", "node": "n1", "command_id": "c1"},
    "job.completed": {"kind": "job.completed", "job_id": "acme/j1", "node": "n1", "command_id": "c1"},
    "job.failed": {"kind": "job.failed", "job_id": "acme/j1", "node": "n1", "command_id": "c1", "reason": "x"},
    "job.checkpointed": {"kind": "job.checkpointed", "job_id": "acme/j1", "node": "n1", "checkpoint": "k",
                         "progress_ms": 5},
}


@st.composite
def node_facts(draw) -> bytes:
    kind = draw(st.sampled_from(sorted(FACTS)))
    payload = dict(FACTS[kind])
    names = st.sampled_from(_fields(kind) + ["extra"])
    for name, value in draw(st.dictionaries(names, JSON, max_size=2)).items():
        payload[name] = value
    doc = {"schema_version": 3, "event_id": draw(NASTY_TEXT), "source": draw(NASTY_TEXT),
           "seq": draw(st.integers(min_value=-1, max_value=2 ** 63)), "event_time_ms": 1_000, "payload": payload}
    return orjson.dumps(doc) if _encodable(doc) else b"{}"


def scheduler_with_a_node():
    s = Scheduler()
    inv = envelope(NodeInventory.model_validate(FACTS["node.inventory"] | {"gpus": [
        {"uuid": "GPU-n1-0", "index": 0, "model": "A100-80GB", "memory_mib": 81920}]}), source="n1", seq=1, time_ms=1)
    _, fault = step_contained(s, inv, 1)
    assert fault is None
    return s


@settings(max_examples=400, deadline=None)
@given(raw=node_facts(), request=requests())
def test_no_fold_and_no_scheduler_step_raises_on_a_record_that_decodes(raw, request):
    """What a node sends, and what the gateway lets in, through every fold: the node view, the job view, the
    telemetry fold, the scheduler, the sink's rows. A record that decodes is one the folds must take."""
    scheduler = scheduler_with_a_node()  # a fresh one each example: a property over one input, not a history
    envs = []
    try:
        envs.append(decode(raw))
    except DecodeError:
        pass
    admitted = gateway.admit(PRINCIPALS[0], "alice", orjson.dumps(request) if _encodable(request) else b"{}", 3, 5)
    if admitted.accepted is not None:
        envs.append(admitted.accepted)
    for env in envs:
        if env.kind == "gpu.telemetry":
            node_view.fold_telemetry(None, [env])
        elif hasattr(env.payload, "node") and env.kind.startswith(("node.", "job.")) and not hasattr(
                env.payload, "job_id"):
            node_view.evolve(None, env)
        if hasattr(env.payload, "job_id"):
            job_view.evolve(None, env)
        _, fault = step_contained(scheduler, env, 10)
        assert fault is None, fault
        rows_for(env, "gpupool.job-events", 0, 1)


def test_step_contained_skips_an_input_whose_handling_raises_and_goes_on():
    """The one containment the live scheduler and every replay share: a record that raises in the policy is told
    and skipped; the next record is handled as ever."""
    s = Scheduler()

    class Boom(Exception):
        pass

    real = s.step

    def step(env, log_ms=None):
        if env.source == "bad":
            raise Boom("tripped")
        return real(env, log_ms)

    s.step = step
    inv = envelope(NodeInventory.model_validate(_inventory("n2")), source="bad", seq=1, time_ms=1)
    out, fault = step_contained(s, inv, 1)
    assert out == [] and fault == "Boom: tripped"
    good = envelope(NodeInventory.model_validate(_inventory("n2")), source="n2", seq=1, time_ms=2)
    out, fault = step_contained(s, good, 2)
    assert fault is None and "n2" in s.nodes


def test_an_over_long_id_is_refused_with_a_valid_answer_not_a_crash():
    """The reproduction of #31: a job id of 201 characters (any of about 196 or more once qualified) made a refusal
    the contracts refused, and the exception stopped the worker. A request's id may have REQUEST_ID_MAX characters
    with the tenant's prefix: the ids the pool derives from it (a hold, its placement, a replica) stay ids."""
    n_max = gateway.REQUEST_ID_MAX - len("acme/")
    longest = gateway.admit(PRINCIPALS[0], "alice", orjson.dumps(BASE["job.requested"] | {"job_id": "x" * n_max}), 1, 1)
    assert longest.accepted.payload.job_id == "acme/" + "x" * n_max
    assert decode_fast(encode(longest.accepted)) == longest.accepted
    for n in (n_max + 1, 196, 201, 5000):
        out = gateway.admit(PRINCIPALS[0], "alice", orjson.dumps(BASE["job.requested"] | {"job_id": "x" * n}), 1, 1)
        assert out.accepted is None and out.rejected is not None, n
        assert decode_fast(encode(out.rejected)) == out.rejected
        assert f"at most {gateway.REQUEST_ID_MAX}" in _answer_text(out.rejected)


def test_the_ids_the_pool_derives_from_the_longest_request_id_are_ids():
    """Found by the fold property below: a reservation id of 196 characters was admitted, and its hold's placement
    (`hold-ID#hold-0`) was no id -- the scheduler raised on it. The longest a request may give leaves room for them."""
    rid = "r" * (gateway.REQUEST_ID_MAX - len("acme/"))
    doc = BASE["reservation.requested"] | {"reservation_id": rid, "start_ms": 0, "end_ms": 10 ** 12}
    env = gateway.admit(PRINCIPALS[0], "alice", orjson.dumps(doc), 1, 1).accepted
    s = Scheduler()
    outs = []
    for e in (envelope(NodeInventory.model_validate(FACTS["node.inventory"] | {"gpus": [
            {"uuid": "GPU-n1-0", "index": 0, "model": "A100-80GB", "memory_mib": 81920}]}), source="n1", seq=1,
            time_ms=1), envelope(QuotaSet(tenant="acme", gpu_milli=10_000), source="in/admin/acme", seq=1, time_ms=1),
              env, envelope(SchedulerTick(now_ms=5_000), source="ticker", seq=1, time_ms=5_000)):
        out, fault = step_contained(s, e, e.event_time_ms + 1)
        assert fault is None, fault
        outs += out
    assert [o.payload.status for o in outs if o.kind == "reservation.decided"][-1] == "active"
    assert s.jobs[f"acme/{rid}#hold"].placement is not None  # the hold holds its card (placed, not emitted)


@pytest.mark.parametrize("bad", ["a\x00b", "a\nb", "a\u202eb", "a b", "a\u200bb", "\ufeffa"])
def test_ids_hold_only_the_documented_characters(bad):
    out = gateway.admit(PRINCIPALS[0], "alice", orjson.dumps(BASE["job.requested"] | {"job_id": bad}), 1, 1)
    assert out.accepted is None and "is not allowed in an id" in out.rejected.payload.message
    assert _readable(_answer_text(out.rejected))  # the answer quotes it escaped: it cannot turn a line around
    assert not gateway.valid_id(bad) and gateway.valid_id("acme/train-1.v2:ckpt@3")


@pytest.mark.parametrize("field,value", [("compute_milli", True), ("compute_milli", 1.0), ("compute_milli", "1000"),
                                         ("gpu_memory_mib", False)])
def test_a_boolean_or_text_is_refused_where_a_number_is_expected(field, value):
    out = gateway.admit(PRINCIPALS[0], "alice", orjson.dumps(BASE["job.requested"] | {field: value}), 1, 1)
    assert out.accepted is None and out.rejected.payload.code == "invalid"
    assert field in out.rejected.payload.reasons[0].message


@settings(max_examples=300, deadline=None)
@given(raw=node_facts() | st.binary(max_size=64), owner=st.sampled_from(["node-n1", "node-n2", "ghost"]))
def test_the_node_relay_decides_every_channel_record_without_raising(raw, owner):
    """The relay (a node's channel to the node topics) over what a node may send: each record relayed as a valid
    record of the node the principal speaks for, or refused with a code."""
    from streams.folds import node_relay

    registry = {"node-n1": Principal("node-n1", "node", nodes=("n1",)),
                "node-n2": Principal("node-n2", "node", nodes=("n2",))}
    verdict = node_relay.check(registry.get(owner), owner, raw)
    if verdict.env is None:
        assert verdict.code
    else:
        assert verdict.env.payload.node in registry[owner].nodes and decode(verdict.raw) == verdict.env
