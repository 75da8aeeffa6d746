"""The ClickHouse sink is exact: at-least-once delivery, crashes and ClickHouse outages neither lose nor double usage.

(a) On a real broker: a worker killed with SIGKILL mid-stream (twice) and restarted on the same home (same chdb path,
    same consumer groups); the bill in `gpupool.usage FINAL` equals the ledger topic's `usage.accrued` events
    (deduplicated by event id), and `audit replay --verify` agrees.
(b) Without a broker: ClickHouse failing the first N inserts; the sink retries the same batch with the same
    insert_deduplication_token; and the same batch inserted twice writes its rows once, even without FINAL.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from infra.clickhouse import connect
from infra.config import Config
from schemas.envelope import decode, encode, envelope
from schemas.events import JobRequested, QuotaChanged, QuotaSet, Tier, UsageAccrued
from schemas.routing import route
from schemas.topics import LEDGER
from streams.edge.sink import Sink, batch_rows

# ---------------------------------------------------------------- (b) no broker: outages and repeated batches


@dataclass(frozen=True)
class Rec:
    """What the sink reads from an aiokafka ConsumerRecord."""
    topic: str
    partition: int
    offset: int
    value: bytes
    key: bytes | None = None


class FlakyClickHouse:
    """A real clickhouse-connect client whose first `failures` inserts raise, as a ClickHouse that is down would.
    Records every insert attempt (table, row count, token)."""

    def __init__(self, real, failures: int):
        self.real = real
        self.failures = failures
        self.attempts: list[tuple[str, int, str | None]] = []

    def insert(self, table, rows, column_names=None, settings=None, **kw):
        if table == "gpupool.sink_intent":  # the sink's own bookkeeping row: not what these tests count or break
            return self.real.insert(table, rows, column_names=column_names, settings=settings, **kw)
        token = (settings or {}).get("insert_deduplication_token")
        self.attempts.append((table, len(rows), token))
        if self.failures > 0:
            self.failures -= 1
            raise ConnectionError("ClickHouse unavailable (injected)")
        return self.real.insert(table, rows, column_names=column_names, settings=settings, **kw)

    def query(self, *a, **kw):
        return self.real.query(*a, **kw)

    def command(self, *a, **kw):
        return self.real.command(*a, **kw)


def _ledger_batch(n_jobs: int = 5, first_offset: int = 100) -> list[Rec]:
    """Real envelopes of the ledger topic (usage and quota changes, as the scheduler emits them), one partition."""
    recs, seq, off = [], 0, first_offset
    for i in range(n_jobs):
        for payload in (QuotaChanged(tenant="acme", project="default", job_id=f"j{i}", used_milli=500 * (i + 1),
                                     borrowed_milli=0),
                        UsageAccrued(tenant="acme", project="default", job_id=f"j{i}", tier=Tier.OFFLINE, node="node-000",
                                     gpu_model="A100-80GB", datacenter="dc-0", start_ms=1_000_000 + i,
                                     end_ms=1_002_000 + i, gpu_milli=500, gpu_milli_ms=500 * 2000)):
            seq += 1
            env = envelope(payload, source="scheduler", seq=seq, time_ms=1_002_000 + i)
            spec, key = route(env)
            assert spec.name == LEDGER.name
            recs.append(Rec(LEDGER.name, 2, off, encode(env), key))
            off += 1
    return recs


def _totals(client, final: bool) -> tuple[int, int, int]:
    fin = " FINAL" if final else ""
    return tuple(client.query(f"SELECT count(), uniqExact(event_id), sum(gpu_milli_ms) FROM gpupool.usage{fin}")
                 .result_rows[0])


def _sink(tmp_path: Path, client, retry_s: float = 0.01) -> Sink:
    cfg = Config(home=tmp_path, kafka=None, clickhouse=f"chdb://{tmp_path / 'ch'}", kafka_port=0, web_port=0)
    sink = Sink(cfg, None, retry_s=retry_s)
    sink.client = client
    return sink


@pytest.fixture(scope="module")
def chdb_client(tmp_path_factory):
    """One embedded ClickHouse for the module (chdb: one data path per process, and a session is not cheap)."""
    client = connect(f"chdb://{tmp_path_factory.mktemp('sinkch') / 'clickhouse'}")
    yield client
    client.close()


@pytest.fixture
def fresh(chdb_client):
    for table in ("events", "usage", "quota_events", "scheduling", "sink_progress", "sink_intent", "usage_daily"):
        chdb_client.command(f"TRUNCATE TABLE gpupool.{table}")
    return chdb_client


def test_same_batch_twice_same_token_writes_rows_once_without_final(tmp_path, fresh):
    recs = _ledger_batch()
    sink = _sink(tmp_path, fresh)
    n1 = sink._insert_batch(LEDGER.name, 2, recs)
    n2 = sink._insert_batch(LEDGER.name, 2, recs)  # redelivered after a crash before the commit
    assert n1 == n2 == len(recs) + 10  # every record in `events`, plus 5 usage rows, 5 quota rows (sent, not stored)
    # no FINAL: the second insert was dropped by the token (non_replicated_deduplication_window), not merged away
    assert _totals(fresh, final=False) == (5, 5, 5 * 500 * 2000)
    assert fresh.query("SELECT count(), uniqExact(topic, partition, offset) FROM gpupool.events").result_rows[0] \
        == (len(recs), len(recs))
    assert fresh.query("SELECT count() FROM gpupool.quota_events").result_rows[0][0] == 5

    # negative control: another token (a different batch boundary over the same records) is physically written
    # twice, and only FINAL (ReplacingMergeTree by event id) collapses it
    sink._insert_batch(LEDGER.name, 2, recs[:4])
    cnt, uniq, _ = _totals(fresh, final=False)
    assert (cnt, uniq) == (7, 5)
    assert _totals(fresh, final=True) == (5, 5, 5 * 500 * 2000)


def _write_batch(sink: Sink, topic: str, partition: int, msgs) -> None:
    """Sink.run's retry loop for one (tp, msgs). Uses `Sink.write_batch` once streams/edge/sink.py has it (the proposed
    extraction); until then a line-for-line copy of the loop inside Sink.run."""
    import asyncio

    if hasattr(sink, "write_batch"):
        asyncio.run(sink.write_batch(topic, partition, msgs))
        return
    while True:
        try:
            sink.inserted += sink._insert_batch(topic, partition, msgs)
            break
        except Exception:  # noqa: BLE001 - as Sink.run
            sink.retries += 1
            time.sleep(sink.retry_s)


def test_clickhouse_unavailable_retries_same_batch_same_token(tmp_path, fresh):
    """Sink.run's loop, step for step: insert, on failure pause and retry the same msgs, then (Kafka) commit.

    Sink.run's retry loop is inline and needs an AIOKafkaConsumer, so this drives `_insert_batch` the way that loop
    does (the refactor that would let the test call the loop itself: see the module's report)."""
    recs = _ledger_batch()
    flaky = FlakyClickHouse(fresh, failures=3)
    sink = _sink(tmp_path, flaky)

    # the first failures can hit any insert of the batch (usage first, then quota, then progress): failure 1 on
    # `events`, and so on; the loop re-sends the whole batch each time
    _write_batch(sink, LEDGER.name, 2, recs)
    committed = recs[-1].offset + 1  # Sink.run commits only after the batch is in
    assert sink.retries == 3 and committed == 110

    tokens = {t for _, _, t in flaky.attempts if t}
    data_tables = {tb for tb, rows in batch_rows(LEDGER.name, 2, recs).items() if rows}
    assert tokens == {f"{tb}/{LEDGER.name}/2/100-109" for tb in data_tables}  # same token on every attempt
    assert sum(1 for tb, _, _ in flaky.attempts if tb == "gpupool.events") == 4  # 3 failures + the good one
    assert _totals(fresh, final=False) == (5, 5, 5 * 500 * 2000)
    assert _totals(fresh, final=True) == (5, 5, 5 * 500 * 2000)
    assert fresh.query("SELECT max(last_offset) FROM gpupool.sink_progress").result_rows[0][0] == 109


def test_failure_between_tables_then_retry_is_exact(tmp_path, fresh):
    """ClickHouse goes away after `events` and `usage` were written but before `quota_events` and the progress row:
    the retry re-sends every table with the same tokens; the tables already written drop the repeat."""
    recs = _ledger_batch()
    tables = [tb for tb, rows in batch_rows(LEDGER.name, 2, recs).items() if rows]
    assert tables[:2] == ["events", "usage"]

    class FailAfter(FlakyClickHouse):
        def insert(self, table, rows, column_names=None, settings=None, **kw):
            if table == "gpupool.sink_intent":
                return self.real.insert(table, rows, column_names=column_names, settings=settings, **kw)
            self.attempts.append((table, len(rows), (settings or {}).get("insert_deduplication_token")))
            if len(self.attempts) == 3:  # the third insert of the first attempt: quota_events
                raise ConnectionError("ClickHouse went away mid-batch (injected)")
            return self.real.insert(table, rows, column_names=column_names, settings=settings, **kw)

    client = FailAfter(fresh, failures=0)
    sink = _sink(tmp_path, client)
    with pytest.raises(ConnectionError):
        sink._insert_batch(LEDGER.name, 2, recs)
    assert _totals(fresh, final=False)[0] == 5  # usage already in
    assert fresh.query("SELECT count() FROM gpupool.sink_progress").result_rows[0][0] == 0  # progress not
    sink._insert_batch(LEDGER.name, 2, recs)
    assert _totals(fresh, final=False) == (5, 5, 5 * 500 * 2000)
    assert fresh.query("SELECT count() FROM gpupool.events").result_rows[0][0] == len(recs)
    assert fresh.query("SELECT count() FROM gpupool.quota_events").result_rows[0][0] == 5
    assert [t for tb, _, t in client.attempts if tb == "gpupool.usage"] == [f"usage/{LEDGER.name}/2/100-109"] * 2


def test_crash_mid_batch_then_other_boundaries_is_not_written_twice(tmp_path, fresh):
    """The sink dies after `events` and `usage` of offsets 100-109 are in, before the progress row; after the restart
    the consumer (from the committed offset 100) returns 100-113 in one batch. The sink's intent row makes it cut
    that batch at 109, so 100-109 get their original token and are not written twice, even without FINAL, and the
    `usage_daily` rollup (fed by every insert) counts each interval once."""
    recs = _ledger_batch(n_jobs=7)  # offsets 100-113

    class DiesAfterUsage(FlakyClickHouse):
        def insert(self, table, rows, column_names=None, settings=None, **kw):
            if table == "gpupool.quota_events":
                raise ConnectionError("sink process killed here (injected)")
            return self.real.insert(table, rows, column_names=column_names, settings=settings, **kw)

    with pytest.raises(ConnectionError):
        _sink(tmp_path, DiesAfterUsage(fresh, 0))._insert_batch(LEDGER.name, 2, recs[:10])
    _sink(tmp_path, fresh)._insert_batch(LEDGER.name, 2, recs)  # the restarted sink: progress says nothing done
    assert _totals(fresh, final=True) == (7, 7, 7 * 500 * 2000)  # the bill of record is right either way
    rollup = fresh.query("SELECT sum(intervals) FROM gpupool.usage_daily").result_rows[0][0]
    assert (_totals(fresh, final=False)[0], rollup) == (7, 7)  # without the intent cut: (12, 12)


def test_connect_retries_until_clickhouse_answers(tmp_path):
    """Sink._connect: pauses and retries while ClickHouse cannot be reached (a server URL nothing listens on)."""
    import asyncio

    from infra import kafka_local

    cfg = Config(home=tmp_path, kafka=None, clickhouse=f"http://127.0.0.1:{kafka_local.free_port()}",
                 kafka_port=0, web_port=0)
    sink = Sink(cfg, None, retry_s=0.05)

    async def go():
        task = asyncio.create_task(sink._connect())
        while sink.retries < 2:  # waited on (a loaded machine makes each try slower), not a 0.5 s window
            assert not task.done()
            await asyncio.sleep(0.05)
        assert not task.done() and sink.client is None
        task.cancel()

    asyncio.run(asyncio.wait_for(go(), 60))


# ---------------------------------------------------------------- (a) a real broker, SIGKILLed worker


def _wait(predicate, timeout: float, what: str, stack):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            last = predicate()
        except (OSError, RuntimeError, SystemExit) as exc:  # the worker is (re)starting
            last = exc
        if last and not isinstance(last, Exception):
            return last
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}; last={last!r}\n{stack.log('worker')[-4000:]}"
                         f"\n{stack.log('agent')[-2000:]}")


def _submit(stack, jobs: list[tuple[str, str, int, int]]) -> None:
    """As the operator, for each job's tenant (the gateway names the job TENANT/ID); with quotas first (without
    one a tenant runs nothing)."""
    stack.client().send([QuotaSet(tenant=t, gpu_milli=100_000) for t in sorted({j[1] for j in jobs})])
    stack.client().send([JobRequested(job_id=j, tenant=tenant, compute_milli=c, gpu_memory_mib=8 * 1024,
                                      duration_s=d) for j, tenant, c, d in jobs])


def _states(stack) -> dict[str, str]:
    from tests.live import job_states

    return {j.split("/", 1)[1]: r["state"] for j, r in job_states(stack).items()}


def _ledger_usage(stack) -> tuple[dict[str, UsageAccrued], int]:
    from tests.live import read_topic

    recs = [decode(m.value) for m in read_topic(stack, LEDGER.name)]
    usage = [e for e in recs if e.kind == "usage.accrued"]
    return {e.event_id: e.payload for e in usage}, len(usage)


def _kill_worker(stack) -> None:
    pid = stack.procs["worker"].pid
    stack.stop_process("worker", sig=signal.SIGKILL)
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


@pytest.mark.broker
def test_worker_sigkilled_mid_stream_bill_is_exact(stack, capsys):
    t0 = time.monotonic()
    stack.start_worker()
    stack.start_agent("demo:2")  # node-000: A100-80GB x4, node-001: H100-80GB x4
    wave1 = [(f"sx-{i}", ("acme", "zeta")[i % 2], (500, 1000, 250)[i % 3], 1 + i % 2) for i in range(5)]
    wave2 = [(f"sx-{i}", ("acme", "zeta")[i % 2], (500, 1000, 2000)[i % 3], 1 + i % 2) for i in range(5, 10)]
    jobs = {j for j, *_ in wave1 + wave2}

    _submit(stack, wave1)
    # kill 1: as soon as a placement is in ClickHouse (jobs placed/running, outputs and sink batches in flight)
    _wait(lambda: any(s in ("placed", "running", "completed") for s in _states(stack).values()), 60,
          "a first placement", stack)
    _kill_worker(stack)
    _submit(stack, wave2)  # the agents keep running and reporting meanwhile; requests pile up in Kafka
    stack.start_worker()
    # kill 2: mid-stream again, once the restarted worker has written something of the second wave
    _wait(lambda: any(j in jobs - {w[0] for w in wave1} for j in _states(stack)), 90, "second wave in ClickHouse",
          stack)
    _kill_worker(stack)
    stack.start_worker()

    states = _wait(lambda: (s := _states(stack)) and set(s) == jobs and all(v == "completed" for v in s.values())
                   and s, 180, "ten completed jobs", stack)
    assert len(states) == 10

    # every job's last usage event is in the ledger (a usage tick may have cut a run in two: not one per job). The
    # completions above come from the node agents; the usage of the last ones comes from the scheduler, which after
    # the second kill first waits for the killed member's session to lapse and then takes over (snapshot + tail):
    # give it that time on a loaded machine
    ledger, ledger_records = _wait(
        lambda: (u := _ledger_usage(stack)) and {p.job_id.split("/", 1)[1] for p in u[0].values()} == jobs and u, 120,
        "usage events of ten jobs in the ledger", stack)
    n = len(ledger)
    want_sum = sum(p.gpu_milli_ms for p in ledger.values())
    want_by_tenant = {}
    for p in ledger.values():
        want_by_tenant[p.tenant] = want_by_tenant.get(p.tenant, 0) + p.gpu_milli_ms

    def usage_final():
        r = stack.query("SELECT count() AS n, uniqExact(event_id) AS u, sum(gpu_milli_ms) AS s "
                        "FROM gpupool.usage FINAL")[0]
        return r if r["n"] == n else None

    fin = _wait(usage_final, 60, f"{n} usage rows (FINAL)", stack)
    assert (fin["n"], fin["u"], int(fin["s"])) == (n, n, want_sum)
    by_tenant = {r["tenant"]: int(r["s"]) for r in stack.query(
        "SELECT tenant, sum(gpu_milli_ms) AS s FROM gpupool.usage FINAL GROUP BY tenant")}
    assert by_tenant == want_by_tenant
    ids = {r["event_id"] for r in stack.query("SELECT event_id FROM gpupool.usage FINAL")}
    assert ids == set(ledger)
    # each row equals the ledger's event (the sink's mapping), not only the totals
    rows = {r["event_id"]: r for r in stack.query(
        "SELECT event_id, job_id, tenant, start_ms, end_ms, gpu_milli, gpu_milli_ms FROM gpupool.usage FINAL")}
    for eid, p in ledger.items():
        r = rows[eid]
        assert (r["job_id"], r["tenant"], int(r["start_ms"]), int(r["end_ms"]), int(r["gpu_milli"]),
                int(r["gpu_milli_ms"])) == (p.job_id, p.tenant, p.start_ms, p.end_ms, p.gpu_milli, p.gpu_milli_ms)
    assert {p.job_id.split("/", 1)[1] for p in ledger.values()} == jobs

    # without FINAL: what was physically written. The sink writes each ledger *record* (topic, partition, offset)
    # at most once (token + progress table), so count() never exceeds the ledger's usage records; a usage event
    # re-emitted by the restarted scheduler at a new offset is a second record, collapsed only by FINAL.
    raw = stack.query("SELECT count() AS n, uniqExact(event_id) AS u, "
                      "uniqExact(topic, partition, offset) AS coords FROM gpupool.usage")[0]
    ev = stack.query("SELECT count() AS n, uniqExact(topic, partition, offset) AS coords FROM gpupool.events")[0]
    assert raw["u"] == n and raw["coords"] == raw["n"] <= ledger_records
    assert ev["n"] == ev["coords"]  # no record of any topic written twice by the sink

    stack.add_user("aud", "auditor")
    audit = subprocess.run([sys.executable, "-m", "agents.audit", "replay", "--verify"],
                           env={**os.environ, **stack.env, "GPUPOOL_USER": "aud"}, capture_output=True, text=True,
                           timeout=120)
    assert audit.returncode == 0, audit.stdout + audit.stderr
    assert f"bill (gpupool.usage FINAL): compared {n}, matched {n}" in audit.stdout

    with capsys.disabled():
        print(f"\n[sink exactness] 2 SIGKILLs; ledger usage records {ledger_records} ({len(ledger)} unique); "
              f"usage without FINAL: count {raw['n']}, uniqExact(event_id) {raw['u']}; events rows {ev['n']}; "
              f"sum gpu_milli_ms {want_sum}; {time.monotonic() - t0:.0f} s")
