"""Telemetry folded in batches (streams/edge/telemetry.py, issue #16 item 3).

(a) The pure batch fold (`node_view.fold_telemetry`) gives the view of folding the same records one by one, however
    a partition's records are cut into batches, from any view the other sources made, with duplicates and stale
    redeliveries; and `durable_change` is False only when nothing but the latest samples and heartbeat changed.
(b) The task's rules, on a stand-in for the worker (no broker): a telemetry-only batch writes nothing to the
    changelog and marks the view dirty; a new card fault is written at once and said as `gpu.health`; a node heard
    after a silence is written at once and said alive; the flush writes every dirty view, waits for the broker and
    only then commits the offsets they cover; a failed flush commits nothing and keeps the views dirty; undecodable
    records and kinds off their home topic are dead-lettered; the per-minute feed gets each node's samples with the
    log time of its last record; a flush still waiting for acknowledgements commits only what its writes cover while
    the fold goes on, and nothing if the assignment changed meanwhile; the cyclic collector is off while a batch is
    folded and on again after it, also after a batch that raised.
"""
from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass, field

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from schemas.envelope import encode, envelope
from schemas.events import GpuSample, GpuTelemetry, JobRequested, NodeHeartbeat, NodeLiveness
from streams.folds import node_view
from streams.folds.liveness import Liveness
from streams.edge.telemetry import TelemetryFold
from tests.builders import inventory
from tests.test_fold_properties import CARDS, delivery, fold, payloads_for, per_source_streams


@st.composite
def telemetry_run(draw, first_seq: int = 1, t0: int = 0):
    """One node's records of its telemetry partition in log order, with redeliveries (at-least-once)."""
    payloads = draw(st.lists(payloads_for("n1/telemetry"), min_size=1, max_size=12))
    envs, t = [], t0
    for i, p in enumerate(payloads, start=first_seq):
        t += draw(st.integers(1, 1500))
        envs.append(envelope(p, source="n1/telemetry", seq=i, time_ms=t))
    out = []
    for e in envs:
        out.append(e)
        if draw(st.integers(0, 4)) == 0:
            out.append(draw(st.sampled_from(out)))
    return out


def _cuts(draw, n: int) -> list[int]:
    return sorted(set(draw(st.lists(st.integers(0, n), max_size=4))) | {0, n})


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_batch_fold_is_the_one_by_one_fold_however_batched(data):
    streams = data.draw(per_source_streams())
    streams["n1/telemetry"] = []  # the telemetry source is the run below
    base = fold(node_view, data.draw(delivery(streams))) if data.draw(st.booleans()) else None
    run = data.draw(telemetry_run())
    want = fold(node_view, run) if base is None else _fold_from(base, run)
    assert node_view.fold_telemetry(base, run) == want
    cuts = _cuts(data.draw, len(run))
    v = base
    for a, b in zip(cuts, cuts[1:]):
        v = node_view.fold_telemetry(v, run[a:b])
    assert v == want


def _fold_from(view, envs):
    for e in envs:
        view = node_view.evolve(view, e)
    return view


TELEMETRY_ONLY = {"telemetry", "last_heartbeat_ms", "applied"}


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_not_durable_means_only_samples_and_heartbeat_changed(data):
    streams = data.draw(per_source_streams())
    streams["n1/telemetry"] = []
    base = fold(node_view, data.draw(delivery(streams)))
    after = node_view.fold_telemetry(base, data.draw(telemetry_run()))
    if node_view.durable_change(base, after):
        return
    changed = {f for f in base.__dataclass_fields__ if getattr(base, f) != getattr(after, f)}
    assert changed <= TELEMETRY_ONLY
    assert after.alive == base.alive and after.unhealthy == base.unhealthy


# ---------------------------------------------------------------- (b) the task's rules, without a broker


@dataclass(frozen=True)
class Rec:
    topic: str
    partition: int
    offset: int
    value: bytes
    timestamp: int


class FakeTable:
    def __init__(self):
        self.data: dict = {}
        self.changelog: list[tuple[int, str, object]] = []
        self.fail = False

    def get(self, key):
        return self.data.get(key)

    def send_changelog(self, partition, key, value):
        fut = asyncio.get_running_loop().create_future()
        if self.fail:
            fut.set_exception(ConnectionError("broker away (injected)"))
        else:
            self.changelog.append((partition, key, value))
            fut.set_result(None)
        return fut


class FakeConsumer:
    def __init__(self):
        self.commits: list[dict] = []

    async def commit(self, offsets):
        self.commits.append({tp.partition: o for tp, o in offsets.items()})


@dataclass
class FakeWorker:
    node_table: FakeTable = field(default_factory=FakeTable)
    liveness: Liveness = field(default_factory=Liveness)
    folded: Counter = field(default_factory=Counter)
    sent: list = field(default_factory=list)
    letters: list = field(default_factory=list)

    def __post_init__(self):
        class App:
            rebalancing = False

            class tables:
                actives_ready = True
        self.app = App()

    def view_of(self, node):
        return self.node_table.get(node)

    async def send_view_changelog(self, partition, key, view):
        return self.node_table.send_changelog(partition, key, view)

    async def send(self, env):
        self.sent.append(env)

    async def dead_letter(self, m, code, detail, raw=None):
        self.letters.append((m.offset, code))

    async def _emit_minutes(self, minutes):
        self.sent.extend(minutes)


class RecordingMinutes:
    def __init__(self):
        self.calls = []

    def add(self, node, log_ms, samples, *, models=None, datacenter=""):
        self.calls.append((node, log_ms, len(list(samples)), dict(models or {})))
        return []

    def close_before(self, log_ms):
        return []

    def minute_of(self, t_ms):
        return t_ms - t_ms % 60_000


def _fold_task(worker, minutes=None) -> TelemetryFold:
    f = TelemetryFold(worker, minutes=minutes)
    f.consumer = FakeConsumer()
    f.partitions = frozenset({3})
    return f


def _tel(node: str, seq: int, t: int, ecc: int = 0) -> bytes:
    samples = tuple(GpuSample(gpu_uuid=c, util_pct=40, mem_used_mib=10, mem_total_mib=100,
                              ecc_uncorrected=ecc if i == 0 else 0) for i, c in enumerate(CARDS))
    return encode(envelope(GpuTelemetry(node=node, samples=samples), source=f"{node}/telemetry", seq=seq, time_ms=t))


def _recs(values: list[bytes], first_offset: int = 0, t0: int = 10_000) -> list[Rec]:
    return [Rec("gpupool.telemetry", 3, first_offset + i, v, t0 + 1000 * i) for i, v in enumerate(values)]


def _with_inventory(worker: FakeWorker, node: str = "n1"):
    view = node_view.evolve(None, envelope(inventory(node, gpus=2), source=f"{node}/inventory", seq=1,
                                           time_ms=1000))
    worker.node_table.data[node] = view
    return view


def test_telemetry_only_batches_write_no_changelog_until_the_flush_then_commit_after_it():
    w = FakeWorker()
    _with_inventory(w)
    minutes = RecordingMinutes()
    f = _fold_task(w, minutes)

    async def go():
        await f.fold_batch(3, _recs([_tel("n1", i, 1000 + 1000 * i) for i in range(1, 6)]))
        assert w.node_table.changelog == [] and f.dirty[3] == {"n1"}
        view = w.node_table.data["n1"]
        assert view.last_heartbeat_ms == 6000 and set(view.telemetry) == set(CARDS)  # in memory at once
        assert w.sent == [] and w.folded["gpu.telemetry"] == 5
        assert w.liveness.heard["n1"] == (3, 14_000) and w.liveness.read[3] == (5, 14_000)
        assert minutes.calls == [("n1", 14_000, 10, {c: "A100-80GB" for c in CARDS})]
        await f.flush()
        assert [(p, k) for p, k, _ in w.node_table.changelog] == [(3, "n1")]
        assert w.node_table.changelog[0][2] == view
        assert f.consumer.commits == [{3: 5}] and not f.dirty[3]

    asyncio.run(go())


def test_a_new_fault_and_alive_again_are_written_at_once_and_said():
    w = FakeWorker()
    inv = _with_inventory(w)
    w.node_table.data["n1"] = node_view.evolve(inv, envelope(NodeLiveness(node="n1", alive=False,
                                                                          last_heartbeat_ms=1000),
                                                             source="n1/liveness", seq=1, time_ms=3000))
    assert not w.node_table.data["n1"].alive
    f = _fold_task(w)

    async def go():
        await f.fold_batch(3, _recs([_tel("n1", 1, 5000), _tel("n1", 2, 6000, ecc=2)]))
        assert [(p, k) for p, k, _ in w.node_table.changelog] == [(3, "n1")]  # durable: written before any flush
        assert not f.dirty[3]
        kinds = sorted((e.kind, getattr(e.payload, "alive", None)) for e in w.sent)
        assert kinds == [("gpu.health", None), ("node.liveness", True)]
        health = next(e for e in w.sent if e.kind == "gpu.health").payload
        assert (health.gpu_uuid, health.healthy) == (CARDS[0], False)
        # the same records again (a restart from the last commit): nothing changes, nothing is said twice
        w.sent.clear()
        await f.fold_batch(3, _recs([_tel("n1", 1, 5000), _tel("n1", 2, 6000, ecc=2)]))
        assert w.sent == [] and len(w.node_table.changelog) == 1

    asyncio.run(go())


def test_a_failed_flush_commits_nothing_and_keeps_the_views_dirty():
    w = FakeWorker()
    _with_inventory(w)
    f = _fold_task(w)

    async def go():
        await f.fold_batch(3, _recs([_tel("n1", 1, 2000)]))
        await f.fold_batch(3, _recs([_tel("n1", 2, 3000)], first_offset=1))
        w.node_table.fail = True
        await f.flush()
        assert f.consumer.commits == [] and f.dirty[3] == {"n1"}
        w.node_table.fail = False
        await f.flush()
        assert f.consumer.commits == [{3: 2}]

    asyncio.run(go())


class HeldTable(FakeTable):
    """A changelog whose acknowledgements wait until the test releases them (a slow broker)."""

    def __init__(self):
        super().__init__()
        self.held: list = []

    def send_changelog(self, partition, key, value):
        fut = asyncio.get_running_loop().create_future()
        self.changelog.append((partition, key, value))
        self.held.append(fut)
        return fut

    def ack_all(self):
        for fut in self.held:
            if not fut.done():
                fut.set_result(None)
        self.held = []


def test_a_flush_waiting_for_acks_commits_only_what_its_writes_cover_while_the_fold_goes_on():
    w = FakeWorker(node_table=HeldTable())
    _with_inventory(w)
    f = _fold_task(w)

    async def go():
        await f.fold_batch(3, _recs([_tel("n1", 1, 2000), _tel("n1", 2, 3000)]))
        flushing = asyncio.ensure_future(f.finish_flush(*await f.start_flush()))  # as the run loop does
        await asyncio.sleep(0)
        assert len(w.node_table.changelog) == 1 and f.consumer.commits == []  # written, not acknowledged yet
        await f.fold_batch(3, _recs([_tel("n1", 3, 4000)], first_offset=2))  # folded meanwhile: dirty again
        assert f.dirty[3] == {"n1"}
        w.node_table.ack_all()
        await flushing
        assert f.consumer.commits == [{3: 2}]  # what the acknowledged write covers, not offset 2 folded after it
        flushing = asyncio.ensure_future(f.finish_flush(*await f.start_flush()))
        await asyncio.sleep(0)
        w.node_table.ack_all()
        await flushing
        assert f.consumer.commits == [{3: 2}, {3: 3}]

    async def reassigned():
        await f.fold_batch(3, _recs([_tel("n1", 4, 5000)], first_offset=3))
        flushing = asyncio.ensure_future(f.finish_flush(*await f.start_flush()))
        await asyncio.sleep(0)
        f.partitions = frozenset({3, 5})  # the assignment changed while the broker acknowledged
        w.node_table.ack_all()
        await flushing
        assert f.consumer.commits == [{3: 2}, {3: 3}]  # nothing more: the owner re-reads from the last commit
        assert f.dirty[3] == set()

    asyncio.run(go())
    asyncio.run(reassigned())


def test_bad_records_are_dead_lettered_and_do_not_stop_the_batch():
    w = FakeWorker()
    _with_inventory(w)
    f = _fold_task(w)
    off_home = encode(envelope(JobRequested(job_id="j", tenant="t", compute_milli=1, gpu_memory_mib=1),
                               source="x", seq=1, time_ms=1))
    hb = encode(envelope(NodeHeartbeat(node="n1"), source="n1/telemetry", seq=2, time_ms=9000))

    async def go():
        await f.fold_batch(3, _recs([b"not json", off_home, _tel("n1", 1, 8000), hb]))
        assert w.letters == [(0, "malformed_json"), (1, "wrong_topic")]
        assert w.node_table.data["n1"].last_heartbeat_ms == 9000 and f.positions[3] == 4

    asyncio.run(go())


def test_a_rebalance_stops_writes_and_forgets_the_partitions():
    w = FakeWorker()
    _with_inventory(w)
    f = _fold_task(w)

    async def go():
        await f.fold_batch(3, _recs([_tel("n1", 1, 2000)]))
        w.app.rebalancing = True

        class Consumer(FakeConsumer):
            def assign(self, tps):
                self.assigned = tps
        f.consumer = Consumer()
        assert await f._follow_assignment() is False
        await f.flush()
        assert f.consumer.commits == [] and w.node_table.changelog == []  # the new owner re-reads from the commit
        assert "n1" not in w.liveness.heard and 3 not in w.liveness.read and f.partitions == frozenset()

    asyncio.run(go())


def test_minutes_get_each_new_record_at_its_own_log_time_and_a_record_read_again_is_not_counted_twice():
    from streams.folds.telemetry_history import TelemetryMinutes

    w = FakeWorker()
    _with_inventory(w)
    minutes = TelemetryMinutes()
    f = _fold_task(w, minutes)

    async def go():
        # log times 58 s, 59 s, 60 s, 61 s: the first two in minute 0, the others in minute 1
        await f.fold_batch(3, _recs([_tel("n1", i, 1000 * i) for i in range(1, 5)], t0=58_000))
        closed = [m for m in w.sent if getattr(m, "kind", "") == "telemetry.minute"]
        assert [(m.minute_ms, [c.samples for c in m.cards]) for m in closed] == [(0, [2, 2])]
        # the same records again (a restart re-reads from the last commit), then one new: minute 1 has 3 records
        await f.fold_batch(3, _recs([_tel("n1", i, 1000 * i) for i in range(1, 6)], t0=58_000))
        assert [(m.minute_ms, [c.samples for c in m.cards]) for m in minutes.flush()] == [(60_000, [3, 3])]

    asyncio.run(go())


def test_a_fault_sample_inside_a_batch_marks_its_card_faulted_though_later_samples_are_clean():
    """The hot path (one-pass decode, one fold per node and batch): a card's fault in the middle of a node's run,
    among other nodes' records and an older schema version's record, is in the view after the batch, written at
    once and said as `gpu.health`; the other nodes' views stay clean."""
    w = FakeWorker()
    _with_inventory(w, "n1")
    _with_inventory(w, "n2")
    f = _fold_task(w)
    faulty = GpuTelemetry(node="n1", samples=tuple(
        GpuSample(gpu_uuid=c, util_pct=40, mem_used_mib=10, mem_total_mib=100, fault="nvml: GPU is lost" if i else "")
        for i, c in enumerate(CARDS)))
    v2 = orjson.loads(_tel("n2", 2, 4000))
    v2["schema_version"] = 2
    for k in ("actor", "claimed_time_ms"):
        del v2[k]

    async def go():
        await f.fold_batch(3, _recs([_tel("n1", 1, 2000), _tel("n2", 1, 2000),
                                     encode(envelope(faulty, source="n1/telemetry", seq=2, time_ms=3000)),
                                     orjson.dumps(v2), _tel("n1", 3, 4000)]))
        n1, n2 = w.node_table.data["n1"], w.node_table.data["n2"]
        assert set(n1.unhealthy) == {CARDS[1]} and n1.last_heartbeat_ms == 4000 and n1.applied["n1/telemetry"] == 3
        assert n2.unhealthy == {} and n2.applied["n2/telemetry"] == 2 and w.letters == []
        assert [(p, k) for p, k, _ in w.node_table.changelog] == [(3, "n1")] and f.dirty[3] == {"n2"}
        assert [(e.kind, e.payload.gpu_uuid, e.payload.healthy) for e in w.sent] == [("gpu.health", CARDS[1], False)]

    asyncio.run(go())


def test_the_collector_waits_for_a_batch_and_runs_again_after_it_also_when_the_fold_fails(monkeypatch):
    import gc

    import aiokafka
    import pytest

    from schemas.topics import TELEMETRY

    w = FakeWorker()
    w.conn = type("Conn", (), {"options": staticmethod(lambda: {})})()
    _with_inventory(w)
    f = _fold_task(w)
    tp = aiokafka.TopicPartition(TELEMETRY.name, 3)
    batches = [{tp: _recs([_tel("n1", 1, 2000)])}, {tp: _recs([b"boom"], first_offset=1)},
               {tp: _recs([_tel("n1", 2, 3000)], first_offset=2)}]
    seen: list[bool] = []

    class Consumer(FakeConsumer):
        def __init__(self, **kwargs):
            super().__init__()

        async def start(self):
            pass

        async def stop(self):
            pass

        async def getmany(self, timeout_ms, max_records):
            seen.append(gc.isenabled())  # between batches: the collector runs
            if not batches:
                raise asyncio.CancelledError
            return batches.pop(0)

    real_fold = f.fold_batch

    async def fold_batch(partition, msgs):
        seen.append(gc.isenabled())  # while a batch is folded: it waits
        if msgs[0].value == b"boom":
            raise RuntimeError("a fold that fails (injected)")
        await real_fold(partition, msgs)

    async def follow():
        return True

    monkeypatch.setattr(aiokafka, "AIOKafkaConsumer", Consumer)
    monkeypatch.setattr(f, "fold_batch", fold_batch)
    monkeypatch.setattr(f, "_follow_assignment", follow)

    async def go():
        with pytest.raises(RuntimeError):
            await f.run()  # an exception out of a batch ends the task: the collector must not stay off
        assert gc.isenabled()
        await f.run()  # the rest of the batches, until the consumer says stop

    assert gc.isenabled()
    try:
        asyncio.run(go())
    except asyncio.CancelledError:
        pass
    assert gc.isenabled()
    assert seen == [True, False, True, False, True, False, True]
    assert w.node_table.data["n1"].applied["n1/telemetry"] == 2


def test_cards_failing_in_one_record_are_each_said_and_the_scheduler_takes_every_one_out():
    """Two cards of a node fail in the same telemetry record: each is its own `gpu.health` fact with its own id (a
    source per card), so the scheduler, which dedupes on (source, seq), takes both out of service -- with one
    source for the node both had one id, only the first card was taken out, and a job went on on (and was placed
    onto) the other. Re-derived after a restart, each fact repeats its id."""
    from agents.scheduler.core import Scheduler
    from agents.scheduler.quota import open_ledger

    w = FakeWorker()
    _with_inventory(w, "n1")
    f = _fold_task(w)
    both = encode(envelope(GpuTelemetry(node="n1", samples=tuple(
        GpuSample(gpu_uuid=c, util_pct=40, mem_used_mib=10, mem_total_mib=100, ecc_uncorrected=1) for c in CARDS)),
        source="n1/telemetry", seq=2, time_ms=3000))

    async def go():
        await f.fold_batch(3, _recs([_tel("n1", 1, 2000), both]))

    asyncio.run(go())
    health = [e for e in w.sent if e.kind == "gpu.health"]
    assert sorted(e.payload.gpu_uuid for e in health) == sorted(CARDS) and len(CARDS) == 2
    assert len({e.event_id for e in health}) == len(health)
    s = Scheduler(ledger=open_ledger())
    s.step(envelope(inventory("n1", gpus=2), source="n1/inventory", seq=1, time_ms=1000))
    for e in health:
        s.step(e)
    assert set(s.nodes["n1"].unhealthy) == set(CARDS)
    # the same record folded again from the last commit derives the same facts: the same ids
    w2 = FakeWorker()
    _with_inventory(w2, "n1")

    async def again():
        await _fold_task(w2).fold_batch(3, _recs([_tel("n1", 1, 2000), both]))

    asyncio.run(again())
    assert sorted(e.event_id for e in w2.sent if e.kind == "gpu.health") == sorted(e.event_id for e in health)
