"""Logs the owner can read (issue #32 item 6, docs/jobs.md "Logs"), on the real broker and worker. One stack serves
the module: a broker, a worker, the simulated fleet demo:2 (node-000: A100-80GB x4, node-001: H100-80GB x4, each
node its own principal), the tenants alice (acme) and bob (globex), fin (finance) and aud
(auditor).

The node side is the node agent's own shipper (agents/node/logship.py), fed with a program's bytes and publishing as
the node principal of the node the job was placed on, to that principal's channel -- what a node agent's runner
does. The worker relays the pieces of jobs placed on the node (and refuses the rest), the sink stores them, and
`gpupool logs` and the dashboard's job page show them to the job's tenant and to operators; another tenant gets
nothing. The shipper's own behaviour (batching, UTF-8, caps) is unit-tested in tests/test_logship.py."""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time

import pytest
from aiokafka import AIOKafkaProducer
from aiokafka.errors import TopicAuthorizationFailedError

from agents.client import ApiFailure
from agents.node.logship import LogCaps, LogShipper
from agents.node.metrics import AgentMetrics
from infra import security
from schemas.envelope import decode, encode, envelope
from schemas.events import Constraints, JobLog, JobRequested
from schemas.topics import node_channel
from tests.live import cli, job_states, live_pool, read_topic, wait_for

pytestmark = pytest.mark.broker

USERS = (("alice", "tenant", "acme"), ("bob", "tenant", "globex"), ("fin", "finance", None),
         ("aud", "auditor", None))
CAP = 300  # the run's size cap in these tests: what the program writes past it is cut, marked and counted
LINES = [f"step {i:02d} loss {1.0 / (i + 1):.4f} ünïcode ✓\n" for i in range(20)]  # 34 bytes each (UTF-8)
WARNING = "warning: lr warm-up skipped\n".encode()


@pytest.fixture(scope="module")
def pool(tmp_path_factory, broker_mode, libs_home):
    with live_pool(tmp_path_factory, broker_mode, libs_home, "job-logs", USERS, quota_for=("acme", "globex")) as s:
        s.client("alice").send([JobRequested(job_id="train", tenant="acme", compute_milli=1000,
                                             gpu_memory_mib=8 * 1024, duration_s=3600,
                                             constraints=Constraints(models=("H100-80GB",)))])
        wait_for(lambda: job_states(s, "alice").get("acme/train", {}).get("state") == "running", 120,
                 "alice's job running", s)
        s.placed = _placement(s, "acme/train")
        s.metrics = AgentMetrics()  # the node agent's, as its shipper counts into them
        yield s


def _placement(pool, job: str):
    return next(e.payload for e in map(decode, (m.value for m in read_topic(pool, "gpupool.commands")))
                if e.kind == "cmd.place" and e.payload.job_id == job)


def _speaker(pool, node: str) -> security.Credentials:
    """The credentials the fleet's agent holds for `node`: its node principal."""
    return next(c for c in security.stored_all(pool.home) if c.role == "node" and node in c.nodes)


class NodeSide:
    """A node agent's publishing as its principal: `publish(payload, source)` writes to the principal's channel,
    as agents/node/nvml_agent.py does."""

    def __init__(self, pool, node: str):
        self.creds = _speaker(pool, node)
        self.conn = pool.conn(self.creds.name)
        self.channel = node_channel(self.creds.name).name
        self.producer = None
        self.seq = time.time_ns() // 1000

    async def __aenter__(self):
        self.producer = AIOKafkaProducer(**self.conn.options(), acks="all", enable_idempotence=True)
        await self.producer.start()
        return self

    async def __aexit__(self, *exc):
        await self.producer.stop()

    async def publish(self, payload, source: str, *_) -> None:
        self.seq += 1
        env = envelope(payload, source=source, seq=self.seq, time_ms=time.time_ns() // 1_000_000)
        await self.producer.send_and_wait(self.channel, key=payload.node.encode(), value=encode(env))


def ship(pool, node: str, job: str, attempt: int, chunks: list[tuple[str, bytes, bool]], caps: LogCaps,
         shipper: LogShipper | None = None) -> LogShipper:
    """Feed the chunks (stream, bytes, eof) to a shipper publishing as `node`'s principal, and publish them all."""
    async def go():
        async with NodeSide(pool, node) as side:
            sh = shipper or LogShipper(node, None, caps=caps, metrics=pool.metrics)
            sh.publish = side.publish
            for stream, data, eof in chunks:
                sh.output(job, attempt, 0, stream, data, eof)  # returns at once: the publisher task sends
            await sh.close()
            sh._task = None
            sh._closed = False
            return sh

    return asyncio.run(go())


def _dropped_metric(metrics: AgentMetrics, cap: str) -> float:
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    fams = {f.name: f for f in text_string_to_metric_families(generate_latest(metrics.registry).decode())}
    return sum(s.value for s in fams["gpupool_node_log_dropped_bytes"].samples
               if s.name.endswith("_total") and s.labels["cap"] == cap)


def _worker_metric(pool, name: str) -> float:
    import base64
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    admin = pool.client().creds
    auth = base64.b64encode(f"{admin.name}:{admin.token}".encode()).decode()
    req = urllib.request.Request(f"http://127.0.0.1:{pool.web_port}/metrics",
                                 headers={"Authorization": f"Basic {auth}"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        text = resp.read().decode()
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


def test_the_owner_reads_its_jobs_output_with_the_cut_marked_and_nobody_else_does(pool):
    node, attempt = pool.placed.node, pool.placed.attempt
    caps = LogCaps(max_bytes=CAP)
    program = "".join(LINES).encode()
    # the program writes its lines in odd-sized reads (characters split across them), a warning on stderr, and ends
    chunks = [("stdout", program[i:i + 7], False) for i in range(0, len(program), 7)]
    chunks += [("stderr", WARNING, True), ("stdout", b"", True)]
    before = _worker_metric(pool, "gpupool_job_log_dropped_bytes_total")
    sh = ship(pool, node, "acme/train", attempt, chunks, caps)
    cut = len(program) - CAP
    assert sh.stats["dropped:size"] == cut + len(WARNING) == _dropped_metric(pool.metrics, "size")

    def shown():
        out = cli(pool, "logs", "train", user="alice")
        return out.count("bytes dropped by the log cap") == 2 and out

    out = wait_for(shown, 120, "alice's job's output through `gpupool logs`", pool)
    kept = program[:CAP].decode("utf-8", "replace")
    lines = out.splitlines()
    assert lines[0] == f"==> attempt {attempt}, part 0 on {node} <=="
    assert out.startswith(lines[0] + "\n" + kept)  # in order, the characters whole across the 7-byte reads
    # the cut marked after the text it ended: stderr's line came after the cap was reached (its stream's final
    # piece says so), then stdout's end says how much of it was cut; the warning itself is not shown
    assert lines[-2:] == [f"[... {len(WARNING)} bytes dropped by the log cap ...]",
                          f"[... {cut} bytes dropped by the log cap ...]"]
    assert "warning" not in out
    # counted: by the node (above) and by the worker as it relays the marks
    wait_for(lambda: _worker_metric(pool, "gpupool_job_log_dropped_bytes_total") >= before + cut + len(WARNING), 60,
             "the cut counted in the worker's /metrics", pool)
    assert pool.stats()["relay"].get("job_log_dropped_bytes", 0) >= cut + len(WARNING)

    # an operator reads any tenant's job; the JSON form has every piece with its stream and number
    assert cli(pool, "logs", "acme/train") == out
    pieces = [json.loads(ln) for ln in cli(pool, "logs", "train", "--format", "json", user="alice").splitlines()]
    assert {(p["stream"], p["final"]) for p in pieces} >= {("stdout", True), ("stderr", True)}
    assert [p["seq"] for p in pieces if p["stream"] == "stdout"] == list(range(len([p for p in pieces
                                                                                    if p["stream"] == "stdout"])))
    tail = cli(pool, "logs", "train", "--tail", "2", "-q", user="alice").splitlines()
    assert tail == lines[-2:]
    assert cli(pool, "logs", "train", "--attempt", str(attempt + 5), user="alice", check=False).returncode == 1

    # another tenant gets nothing: its member's name for it is its own tenant's job, and the API says no such job
    for asked in ("train", "acme/train"):
        other = cli(pool, "logs", asked, user="bob", check=False)
        assert other.returncode == 1 and other.stdout == "" and "step" not in other.stderr, other
        assert other.stderr.startswith(f"no output of job globex/{asked} on record"), other.stderr
    with pytest.raises(ApiFailure, match="404"):
        pool.client("bob").api("/api/logs", {"job": "acme/train"})
    # finance reads bills, not programs' output: neither through the API nor through its SQL
    with pytest.raises(ApiFailure, match="403"):
        pool.client("fin").api("/api/logs", {"job": "acme/train"})
    refused = cli(pool, "sql", "SELECT text FROM gpupool_logs.job_logs", user="fin", check=False)
    assert refused.returncode != 0 and "not for ad-hoc SQL" in (refused.stdout + refused.stderr)
    assert "step" not in refused.stdout


def test_follow_prints_what_comes_and_ends_with_the_run(pool):
    """`gpupool logs -f` on a run that goes on: it prints what is there, then what comes, and ends by itself once
    both streams of the run have ended."""
    node, attempt = pool.placed.node, pool.placed.attempt + 1  # a later run of the job on the same node (a requeue)
    caps = LogCaps()
    sh = ship(pool, node, "acme/train", attempt, [("stdout", b"resumed from checkpoint 40\n", False)], caps)
    wait_for(lambda: "resumed from checkpoint 40" in cli(pool, "logs", "train", "--attempt", str(attempt),
                                                         user="alice"), 120, "the first line", pool)
    env = {**os.environ, **pool.env, "GPUPOOL_USER": "alice"}
    follower = subprocess.Popen([sys.executable, "-m", "agents.cli", "logs", "train", "-f", "--attempt", str(attempt)],
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        ship(pool, node, "acme/train", attempt, [("stdout", b"step 41\nstep 42\n", False),
                                                 ("stdout", b"done\n", True), ("stderr", b"", True)], caps, sh)
        out, err = follower.communicate(timeout=180)  # it ends by itself: the run's streams ended
    finally:
        if follower.poll() is None:
            follower.kill()
            follower.communicate()
    assert follower.returncode == 0, err
    assert out == (f"==> attempt {attempt}, part 0 on {node} <==\n"
                   "resumed from checkpoint 40\nstep 41\nstep 42\ndone\n"), out


def test_a_nodes_log_of_a_job_not_placed_on_it_is_refused_and_counted(pool):
    placed = pool.placed.node
    other = next(n for n in ("node-000", "node-001") if n != placed)
    before = pool.stats().get("relay", {}).get("refused:not_your_node", 0)
    forged = JobLog(job_id="acme/train", node=other, attempt=pool.placed.attempt, stream="stdout", seq=0,
                    text="FORGED: another node's words in acme's log\n")

    async def go():
        async with NodeSide(pool, other) as side:
            await side.publish(forged, f"{other}/log/acme/train")
            # straight onto the log topic: the broker refuses a node principal
            try:
                await side.producer.send_and_wait("gpupool.job-logs", key=b"acme/train",
                                                  value=encode(envelope(forged, source=f"{other}/log/acme/train",
                                                                        seq=1, time_ms=1)))
                return True
            except TopicAuthorizationFailedError:
                return False

    direct = asyncio.run(go())
    assert not direct, "the broker let a node principal write gpupool.job-logs"
    wait_for(lambda: pool.stats().get("relay", {}).get("refused:not_your_node", 0) > before, 60,
             "the relay's refusal", pool)
    letters = [json.loads(m.value) for m in read_topic(pool, "gpupool.dead-letters")]
    assert any(d["reason"] == "not_your_node" and "never placed" in d["detail"] and "acme/train" in d["detail"]
               for d in letters), letters
    relayed = [decode(m.value) for m in read_topic(pool, "gpupool.job-logs")]
    assert relayed and all(e.payload.node == placed for e in relayed)  # only the placed node's pieces
    assert "FORGED" not in cli(pool, "logs", "train", user="alice")


def _consume(conn_opts: dict, topic: str) -> int:
    """Records read from partition 0..N of `topic`; the broker's refusal raises."""
    from aiokafka import AIOKafkaConsumer, TopicPartition

    async def go():
        consumer = AIOKafkaConsumer(**conn_opts, enable_auto_commit=False, group_id=None)
        await consumer.start()
        try:
            tps = [TopicPartition(topic, p) for p in range(4)]
            consumer.assign(tps)
            await consumer.seek_to_beginning(*tps)
            return sum(len(v) for v in (await consumer.getmany(timeout_ms=5000)).values())
        finally:
            await consumer.stop()

    return asyncio.run(go())


def test_the_auditor_reads_the_whole_log_but_not_programs_output(pool):
    wait_for(lambda: "step 00" in cli(pool, "logs", "train", user="alice"), 120, "the output stored", pool)
    aud = pool.conn("aud").options()
    assert _consume(aud, "gpupool.job-events") > 0  # the pool's record: the auditor's
    with pytest.raises(TopicAuthorizationFailedError):
        _consume(aud, "gpupool.job-logs")
    assert _consume(pool.conn(security.SERVICE).options(), "gpupool.job-logs") > 0  # the relay's and the sink's
    with pytest.raises(ApiFailure, match="403"):
        pool.client("aud").api("/api/logs", {"job": "acme/train"})


def test_the_job_page_shows_its_logs_to_its_tenant_only(pool):
    from tests.browser import Browser, chromium_path

    if chromium_path() is None:
        pytest.fail("no chromium: `make browser` installs Debian's (apt-get install chromium), or set GPUPOOL_CHROMIUM")
    wait_for(lambda: "step 00" in cli(pool, "logs", "train", user="alice"), 120, "the output stored", pool)
    base = f"http://127.0.0.1:{pool.web_port}"
    with Browser() as browser:
        browser.sign_in(base, "alice", pool.client("alice").creds.token, "jobs")
        page = browser.open(base, "job/acme%2Ftrain")
        assert "Logs" in page and "Timeline" in page
        logs = browser.text("#job-logs")
        assert "==> attempt" in logs and LINES[0].strip() in logs and "bytes dropped by the log cap" in logs
        assert browser.errors == []
        # bob: acme's job is not found, and nothing of its output is on the page
        browser.sign_in(base, "bob", pool.client("bob").creds.token, "jobs")
        browser.expected = (404,)
        other = browser.open(base, "job/acme%2Ftrain")
        assert "Not found" in other and "step 00" not in other
        assert browser.eval("document.getElementById('job-logs') === null")
