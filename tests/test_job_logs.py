"""Programs' output from the topic to the reader, on a real embedded ClickHouse (no broker): how a `job.log` piece
becomes a row (streams/folds/rows.py) in its own database, written exactly once by the sink's idempotence (the same
batch again: its token; a piece relayed twice: one row, the first), kept for the configured retention, and read by
/api/logs (streams/edge/api.py) in order, from a cursor, as a tail, by attempt and part -- to the job's tenant and to
operators, nobody else. The whole path on the live broker and worker: tests/test_job_logs_live.py."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest

from infra.clickhouse import connect
from infra.config import parse_bytes
from schemas.envelope import encode, envelope
from schemas.events import JobLog
from streams.edge import api
from streams.folds.gateway import Principal
from streams.folds.node_relay import check
from streams.folds.rows import TABLES, rows_for
from streams.edge.sink import Sink, log_retention, log_retention_days

ALICE = Principal("alice", "tenant", "acme")
BOB = Principal("bob", "tenant", "globex")
ADMIN = Principal("admin", "operator")


def piece(seq: int, text: str, *, job="acme/train", attempt=1, part=0, stream="stdout", dropped=0, final=False,
          node="node-000"):
    return envelope(JobLog(job_id=job, node=node, attempt=attempt, part=part, stream=stream, seq=seq, text=text,
                           dropped_bytes=dropped, final=final),
                    source=f"{node}/log/{job}", seq=1000 + seq, time_ms=1_700_000_000_000 + seq)  # a node's clock,
    # years behind: the retention counts from when the sink stored a piece, not from it


@dataclass
class Msg:  # what the sink reads of a Kafka record
    offset: int
    value: bytes


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    dsn = f"chdb://{tmp_path_factory.mktemp('joblogs') / 'clickhouse'}"
    client = connect(dsn)
    runner = api.QueryRunner(dsn)
    yield dsn, client, runner
    runner.close()  # chdb holds one data path per process: every session on it ends with the module
    client.close()


def _sink(client) -> Sink:
    sink = Sink(cfg=None, conn=None)
    sink.client = client
    return sink


def _rows(client, job: str) -> list[tuple]:
    return client.query("SELECT offset, attempt, stream, seq, text, dropped_bytes, final FROM gpupool_logs.job_logs "
                        "FINAL WHERE job_id = {j:String} ORDER BY offset", parameters={"j": job}).result_rows


def test_a_piece_is_a_row_of_its_own_table_never_the_events_mirror():
    env = piece(3, "hello\n", dropped=7, final=True)
    rows = rows_for(env, "gpupool.job-logs", 2, 41)
    assert list(rows) == ["job_logs"] and TABLES["job_logs"] == "gpupool_logs.job_logs"
    (row,) = rows["job_logs"]
    assert row == ["gpupool.job-logs", 2, 41, env.event_id, env.event_time_ms, "acme", "acme/train", "node-000", 1, 0,
                   "stdout", 3, "hello\n", 7, True]


def test_the_sink_writes_a_batch_once_and_a_relayed_copy_is_one_row(store):
    dsn, client, _ = store
    sink = _sink(client)
    envs = [piece(0, "one\n"), piece(1, "two\n"), piece(0, "err\n", stream="stderr")]
    msgs = [Msg(10 + i, encode(e)) for i, e in enumerate(envs)]
    assert sink._insert_batch("gpupool.job-logs", 1, msgs) == 3
    sink._insert_batch("gpupool.job-logs", 1, msgs)  # ClickHouse did not answer: the same batch, the same token
    assert len(client.query("SELECT * FROM gpupool_logs.job_logs WHERE job_id = 'acme/train'").result_rows) == 3
    # the relay re-ran after a crash: the same piece again, at a later offset; the reader's cursor keeps the first
    sink._insert_batch("gpupool.job-logs", 1, [Msg(20, encode(envs[1]))])
    assert [(r[0], r[4]) for r in _rows(client, "acme/train")] == [(10, "one\n"), (11, "two\n"), (12, "err\n")]


def test_retention_is_the_operators_and_set_once(store):
    _, client, _ = store
    assert log_retention_days(client) == 7  # as the DDL makes it
    assert log_retention(client, 7) is False  # nothing to change
    assert log_retention(client, 30) is True and log_retention_days(client) == 30
    assert log_retention(client, 30) is False
    with pytest.raises(ValueError):
        log_retention(client, 0)
    log_retention(client, 7)
    assert parse_bytes("64MiB") == 64 << 20 and parse_bytes("512k") == 512 << 10 and parse_bytes("100") == 100
    with pytest.raises(ValueError):
        parse_bytes("lots")


def test_api_logs_in_order_from_a_cursor_as_a_tail_by_attempt(store):
    dsn, client, runner = store
    sink = _sink(client)
    envs = [piece(i, f"line {i}\n", job="acme/serve") for i in range(5)]
    envs += [piece(0, "", job="acme/serve", stream="stderr", dropped=123, final=True),
             piece(0, "second run\n", job="acme/serve", attempt=2, node="node-001")]
    sink._insert_batch("gpupool.job-logs", 3, [Msg(100 + i, encode(e)) for i, e in enumerate(envs)])

    def ask(principal, **params):
        return asyncio.run(api.answer("/api/logs", principal, {"job": "acme/serve", **params}, b"", runner))

    doc = ask(ALICE)
    assert [(p["attempt"], p["stream"], p["seq"], p["text"]) for p in doc["pieces"]] == [
        (1, "stdout", i, f"line {i}\n") for i in range(5)] + [(1, "stderr", 0, ""), (2, "stdout", 0, "second run\n")]
    assert doc["pieces"][5]["dropped_bytes"] == 123 and doc["pieces"][5]["final"]
    assert doc["pieces"][6]["node"] == "node-001" and doc["next"] == 106 and doc["more"] is False
    assert [p["seq"] for p in ask(ALICE, after=102)["pieces"]] == [3, 4, 0, 0]  # what came after the cursor
    assert ask(ALICE, after=106)["pieces"] == [] and ask(ALICE, after=106)["next"] == 106
    assert [p["text"] for p in ask(ALICE, tail=2)["pieces"]] == ["", "second run\n"]  # the last two, in order
    assert [p["seq"] for p in ask(ALICE, attempt=1, limit=2)["pieces"]] == [0, 1]
    assert ask(ALICE, attempt=1, limit=2)["more"] is True
    assert {p["attempt"] for p in ask(ADMIN, attempt=2)["pieces"]} == {2}  # an operator reads any job's
    with pytest.raises(api.ApiError) as no:
        ask(ALICE, after="x")
    assert no.value.status == 400


def test_only_the_jobs_tenant_and_operators_read_its_output(store):
    dsn, _, runner = store
    for principal, status in ((BOB, 404), (Principal("fin", "finance"), 403), (Principal("aud", "auditor"), 403),
                              (Principal("svc", "service"), 403), (Principal("node-x", "node", nodes=("x",)), 403)):
        with pytest.raises(api.ApiError) as refused:
            asyncio.run(api.answer("/api/logs", principal, {"job": "acme/train"}, b"", runner))
        assert refused.value.status == status, principal
    # bob's own job of that name is another job: nothing of acme's
    doc = asyncio.run(api.answer("/api/logs", BOB, {"job": "globex/train"}, b"", runner))
    assert doc["pieces"] == []


def test_a_node_writes_only_its_own_nodes_logs():
    node_a = Principal("node-a", "node", nodes=("a",))
    ok = check(node_a, "node-a", encode(piece(0, "x\n", node="a")))
    assert ok.env is not None and ok.job_check == ("acme/train", "a")  # then checked against the placements
    assert check(node_a, "node-a", encode(piece(0, "x\n", node="b"))).code == "not_your_node"
    forged = envelope(JobLog(job_id="acme/train", node="a", text="x"), source="b/log/acme/train", seq=1, time_ms=1)
    assert check(node_a, "node-a", encode(forged)).code == "not_your_node"
