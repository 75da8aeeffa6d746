"""Scheduler snapshots (#16 item 1, streams/edge/scheduler_snapshot.py): a snapshot at k, then the replay of k..n, gives
the same outputs and the same state as the replay of 0..n, for random inputs (the scheduler invariants' state
machine drives the inputs: users, operators, node agents, lost nodes, ticks); a snapshot of another format, or of
other code with another state layout, is not used (the replay is longer); one of other code with this layout is used
by a takeover (an upgrade goes on from the old code's state), never by the audit."""
from __future__ import annotations

import functools

import orjson
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import rule

from agents import state_digest
from streams.edge import scheduler_snapshot as snapshot
from agents.scheduler.core import ElasticScheduler
from agents.scheduler.node_index import NodeIndex  # noqa: F401 - the state graph's classes import
from tests import test_scheduler_invariants as inv


def canonical(obj, seen=None):
    """A comparable form of an object graph: the same for two states that are equal field by field (sets and
    dicts regardless of the order they were built in)."""
    seen = set() if seen is None else seen
    if obj is None or isinstance(obj, (bool, int, float, str, bytes)):
        return obj
    if isinstance(obj, (list, tuple)):
        return (type(obj).__name__, [canonical(x, seen) for x in obj])
    if isinstance(obj, (set, frozenset)):
        return ("set", sorted((canonical(x, seen) for x in obj), key=repr))
    if isinstance(obj, dict):
        return ("dict", sorted(((canonical(k, seen), canonical(v, seen)) for k, v in obj.items()), key=repr))
    if id(obj) in seen:
        return ("cycle", type(obj).__name__)
    seen = seen | {id(obj)}
    fields = {}
    if hasattr(obj, "__dict__"):
        fields.update(vars(obj))
    for cls in type(obj).__mro__:
        for name in getattr(cls, "__slots__", ()):
            if hasattr(obj, name):
                fields[name] = getattr(obj, name)
    # memos of derived values (functools.cached_property) are not state: one side may have computed one already
    fields = {k: v for k, v in fields.items() if not k.startswith("__pydantic")
              and not isinstance(getattr(type(obj), k, None), functools.cached_property)}
    if not fields and not callable(obj):
        return (type(obj).__name__, repr(obj))
    return (type(obj).__qualname__, sorted(((k, canonical(v, seen)) for k, v in fields.items()), key=repr))


def first_difference(a, b, path="state"):
    """Where two canonical forms part (for the failure message)."""
    if type(a) is not type(b) or not isinstance(a, (tuple, list)):
        return None if a == b else f"{path}: {a!r:.300} != {b!r:.300}"
    if len(a) != len(b):
        return f"{path}: lengths {len(a)} != {len(b)}: {a!r:.300} / {b!r:.300}"
    for i, (x, y) in enumerate(zip(a, b)):
        label = x[0] if isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], str) else i
        d = first_difference(x, y, f"{path}.{label}")
        if d:
            return d
    return None


def replay_from(state, inputs, times):
    outs = []
    for env, t in zip(inputs, times):
        outs.extend(state.step(env, t))
    return state, outs


class SnapshotMachine(inv.SchedulerMachine):
    """The invariants' machine on the worker's scheduler (ElasticScheduler), snapshotting where hypothesis says."""

    def __init__(self):
        super().__init__()
        self.s = ElasticScheduler(**inv.config())
        # the constructor of the parent fed the fleet and quotas to its own core scheduler: feed them again
        inputs, self.inputs, self.outputs = self.inputs, [], []
        for env in inputs:
            self.inputs.append(env)
            self.outputs.extend(self.s.step(env))
        self.snaps: list[tuple[int, int, bytes]] = []  # (k inputs, outputs so far, the snapshot record)

    @rule()
    def take_snapshot(self):
        k = len(self.inputs)
        self.snaps.append((k, len(self.outputs), snapshot.dump(self.s, k, 0)))

    def teardown(self):
        n = len(self.inputs)
        times = [None] * n
        # replay 0..n from scratch
        full, full_out = replay_from(ElasticScheduler(**inv.config()), self.inputs, times)
        assert [e.model_dump() for e in full_out] == [e.model_dump() for e in self.outputs]
        want = canonical(full)
        for k, outs_before, value in self.snaps + [(n, len(self.outputs), snapshot.dump(self.s, n, 0))]:
            snap = snapshot.load(value)
            assert snap is not None and snap.offset == k
            state, tail = replay_from(snap.state, self.inputs[k:], times[k:])
            assert [e.model_dump() for e in tail] == [e.model_dump() for e in self.outputs[outs_before:]]
            got = canonical(state)
            assert got == want, first_difference(got, want)
            # the audit's digest of a state (agents/state_digest.py) says the same: equal states, equal digests
            assert state_digest.digest(state) == state_digest.digest(full)
            # and the input goes on the same from either: one tick more
            tick = self.clock.env(inv.SchedulerTick(now_ms=self.clock.now), "ticker", dt=1000)
            assert [e.model_dump() for e in state.step(tick)] == [e.model_dump() for e in
                                                                  snapshot.load(snapshot.dump(full, n, 0)).state.step(tick)]


SnapshotMachine.TestCase.settings = settings(max_examples=40, stateful_step_count=40, deadline=None)
TestSnapshotThenTailEqualsFullReplay = SnapshotMachine.TestCase


def test_a_negative_control_the_comparison_sees_a_different_state():
    a = ElasticScheduler(**inv.config())
    b = snapshot.load(snapshot.dump(a, 0, 0)).state
    assert canonical(a) == canonical(b)
    b.now_ms += 1
    assert canonical(a) != canonical(b)


def test_snapshots_of_another_format_or_other_code_are_not_used():
    value = snapshot.dump(ElasticScheduler(**inv.config()), 7, 0)
    assert snapshot.load(value).offset == 7
    doc = orjson.loads(value)
    assert snapshot.load(orjson.dumps({**doc, "code": "0" * 16})) is None
    assert snapshot.load(orjson.dumps({**doc, "v": 0})) is None  # no upcaster from format 0
    assert snapshot.load(orjson.dumps({**doc, "state": doc["state"][:-8]})) is None  # damaged
    assert snapshot.load(None) is None


def test_after_an_upgrade_a_takeover_loads_the_old_codes_snapshot_of_the_same_layout_and_the_audit_does_not():
    """An upgrade: the old code's snapshot (other `code`, the same `layout`) is what the new code's takeover goes on
    from; the audit, which re-runs decisions, uses only its own code's. A snapshot of another layout is no one's."""
    from agents.audit_log import snap_info

    a = ElasticScheduler(**inv.config())
    a.now_ms = 12_345
    doc = orjson.loads(snapshot.dump(a, 7, 0))
    assert doc["layout"] == snapshot.state_layout()
    old = orjson.dumps({**doc, "code": "0" * 16})
    got = snapshot.load(old, upgrade=True)
    assert got.offset == 7 and got.code == "0" * 16 and canonical(got.state) == canonical(a)
    assert snapshot.load(old) is None  # the audit's load
    assert not snap_info(7, old, "f").usable and snap_info(7, snapshot.dump(a, 7, 0), "f").usable
    other_shape = orjson.dumps({**doc, "code": "0" * 16, "layout": "1" * 16})
    assert snapshot.load(other_shape, upgrade=True) is None and snapshot.load(other_shape) is None
    assert snapshot.load(orjson.dumps({k: v for k, v in doc.items() if k != "layout"} | {"code": "0" * 16}),
                         upgrade=True) is None  # a snapshot that does not say its layout


def test_the_state_layout_moves_with_the_states_shape_not_with_behaviour():
    base = """
@dataclass
class Rec:
    a: int
    memo: tuple = ()

class Book:
    __slots__ = ("x",)

    def __init__(self):
        self.x = 1

    def grow(self, n):
        self.x += n
        return self.x
"""
    shapes = snapshot.class_shapes(base)
    # a method's behaviour changed, a helper added, a comment: the same shape
    assert snapshot.class_shapes(base.replace("self.x += n", "self.x += 2 * n").replace(
        "        return self.x", "        return self.x  # why\n\n    def size(self):\n        return 1")) == shapes
    # a field added, renamed or retyped, an attribute set anew, slots changed: another shape
    for changed in (base.replace("    memo: tuple = ()", "    memo: tuple = ()\n    more: int = 0"),
                    base.replace("memo: tuple", "memos: tuple"), base.replace("a: int", "a: str"),
                    base.replace("        return self.x", "        self.last = n\n        return self.x"),
                    base.replace('("x",)', '("x", "y")')):
        assert snapshot.class_shapes(changed) != shapes, changed


def test_an_older_format_is_upcast_when_an_upcaster_exists(monkeypatch):
    doc = orjson.loads(snapshot.dump(ElasticScheduler(**inv.config()), 9, 0))
    old = {**doc, "v": 0, "at": doc["offset"]}
    del old["offset"]
    monkeypatch.setitem(snapshot.UPCASTERS, 0, lambda d: {**{k: v for k, v in d.items() if k != "at"},
                                                        "offset": d["at"], "v": snapshot.FORMAT})
    assert snapshot.load(orjson.dumps(old)).offset == 9


def test_the_writer_is_due_every_n_records_or_t_of_log_time():
    w = snapshot.Writer(None, every_records=100, every_log_ms=10_000)
    assert not w.due(99, 0) and w.due(100, 0)
    w.start_at(100, 5_000)
    assert not w.due(100, 60_000)  # nothing new read
    assert not w.due(150, 14_999) and w.due(150, 15_000) and w.due(200, 5_000)


def test_the_writer_keeps_the_audit_checkpoints_and_tombstones_the_rest():
    import asyncio

    class Producer:
        def __init__(self):
            self.sent = []

        async def send(self, topic, key, value, partition):
            self.sent.append((int(key), value is not None))
            fut = asyncio.get_running_loop().create_future()
            fut.set_result(None)
            return fut

    async def go(w, offsets):
        for off in offsets:
            await w.write(ElasticScheduler(**inv.config()), off, 0)

    p = Producer()
    w = snapshot.Writer(p, every_records=40, audit_every=100)
    asyncio.run(go(w, [40, 80, 120, 160, 200, 240, 280]))
    tombstoned = [k for k, alive in p.sent if not alive]
    assert w.kept == [120, 200] and sorted(w.written) == [240, 280]
    assert tombstoned == [40, 80, 160]  # never a checkpoint
    # what is left on the topic tells a writer that takes over the same
    assert snapshot.checkpoints([120, 200, 240, 280], 100) == [120, 200]
    w2 = snapshot.Writer(Producer(), every_records=40, audit_every=100)
    w2.start_at(280, 0, [120, 200, 240, 280])
    assert w2.kept == [120, 200] and w2.written == [240, 280]
    # the offset it took over at written again (an upgrade's first snapshot): one record under that key, never
    # tombstoned while it is among the latest
    p3 = Producer()
    w3 = snapshot.Writer(p3, every_records=40, audit_every=1000)
    w3.start_at(80, 0, [40, 80])
    asyncio.run(go(w3, [80, 120]))
    assert [k for k, alive in p3.sent if not alive] == [40] and w3.written == [80, 120]
