"""The node agent's log shipper (agents/node/logship.py), fed with bytes as a runner feeds it: how a program's
output becomes `job.log` pieces -- batched, cut at line ends, decoded across reads, numbered per stream -- and how the
caps cut it, mark the cut and count it. The clock is the test's; publishing is a recording function. On the live
broker and worker the pieces become what `gpupool logs` shows: tests/test_job_logs_live.py."""
from __future__ import annotations

import asyncio

from prometheus_client.parser import text_string_to_metric_families

from agents.node.logship import LogCaps, LogShipper, shipper_for
from agents.node.metrics import AgentMetrics
from schemas.events import JobLog


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


class Published:
    """A publish function: records (payload, source) in order."""

    def __init__(self):
        self.sent: list[tuple[JobLog, str]] = []

    async def __call__(self, payload, source, *_):
        self.sent.append((payload, source))

    @property
    def pieces(self) -> list[JobLog]:
        return [p for p, _ in self.sent]

    def text(self, stream: str = "stdout") -> str:
        return "".join(p.text for p in self.pieces if p.stream == stream)


def shipper(caps: LogCaps = LogCaps(), metrics=None):
    clock, pub = Clock(), Published()
    return LogShipper("node-a", pub, caps=caps, metrics=metrics, clock=clock), clock, pub


def flushed(sh: LogShipper) -> None:
    asyncio.run(sh.flush())


def published(sh: LogShipper) -> None:
    """Publish what is queued, cutting nothing more (what the publisher task does between ticks)."""
    asyncio.run(sh._send_queued())


def dropped_metric(metrics: AgentMetrics) -> dict[str, float]:
    from prometheus_client import generate_latest

    fams = {f.name: f for f in text_string_to_metric_families(generate_latest(metrics.registry).decode())}
    return {s.labels["cap"]: s.value for s in fams["gpupool_node_log_dropped_bytes"].samples
            if s.name.endswith("_total")}


def test_small_writes_are_batched_into_one_piece_of_whole_lines():
    sh, clock, pub = shipper()
    for i in range(5):
        assert sh.output("acme/train", 1, 0, "stdout", f"step {i}\n".encode(), False) is None
    sh.output("acme/train", 1, 0, "stdout", b"step 5 (no end yet)", False)
    published(sh)
    assert pub.pieces == []  # nothing before the batching interval
    clock.t += sh.caps.flush_s
    sh.tick()
    published(sh)
    (piece,) = pub.pieces
    assert piece.text == "".join(f"step {i}\n" for i in range(5))  # whole lines; the partial one waits
    assert (piece.job_id, piece.node, piece.attempt, piece.part, piece.stream, piece.seq, piece.final) == \
        ("acme/train", "node-a", 1, 0, "stdout", 0, False)
    assert pub.sent[0][1] == "node-a/log/acme/train"  # the node's own source: the relay checks it
    clock.t += sh.caps.partial_s  # a line without its end is sent once it waited long enough
    sh.tick()
    published(sh)
    assert pub.pieces[-1].text == "step 5 (no end yet)" and pub.pieces[-1].seq == 1


def test_utf8_split_across_reads_is_one_character_and_bad_bytes_are_replaced():
    sh, clock, pub = shipper()
    word = "naïve 日本語 🚀\n".encode()
    for i in range(len(word)):  # one byte a read: every multi-byte character split
        sh.output("acme/u", 0, 0, "stdout", word[i:i + 1], False)
    sh.output("acme/u", 0, 0, "stderr", b"bad \xff\xfe byte\n", False)
    sh.output("acme/u", 0, 0, "stderr", b"cut \xe6\x97", True)  # a character cut by the stream's end
    sh.output("acme/u", 0, 0, "stdout", b"", True)
    published(sh)
    assert pub.text("stdout") == "naïve 日本語 🚀\n"
    assert pub.text("stderr") == "bad \ufffd\ufffd byte\ncut \ufffd"


def test_pieces_end_at_line_ends_and_a_long_line_is_cut_at_the_limit():
    sh, clock, pub = shipper(LogCaps(piece_chars=16))
    sh.output("acme/l", 0, 0, "stdout", b"aaaa\nbbbbbbb\ncccccccccc\n" + b"x" * 40 + b"\n", True)
    sh.output("acme/l", 0, 0, "stderr", b"", True)
    published(sh)
    texts = [p.text for p in pub.pieces if p.stream == "stdout"]
    assert texts == ["aaaa\nbbbbbbb\n", "cccccccccc\n", "x" * 16, "x" * 16, "x" * 8 + "\n"]
    assert all(len(t) <= 16 for t in texts) and "".join(texts) == "aaaa\nbbbbbbb\ncccccccccc\n" + "x" * 40 + "\n"
    # the contract's own limit by default: a megabyte line goes out in pieces of 16384 characters
    sh, clock, pub = shipper()
    sh.output("acme/big", 0, 0, "stdout", b"y" * 40_000, True)
    published(sh)
    assert [len(p.text) for p in pub.pieces] == [16384, 16384, 40_000 - 2 * 16384]
    assert pub.pieces[-1].final and [p.seq for p in pub.pieces] == [0, 1, 2]


def test_order_and_numbering_per_stream_and_a_final_piece_for_each():
    sh, clock, pub = shipper(LogCaps(piece_chars=8))
    sh.output("acme/o", 2, 1, "stdout", b"o1\no2\n", False)
    sh.output("acme/o", 2, 1, "stderr", b"e1\n", False)
    sh.output("acme/o", 2, 1, "stdout", b"o3\no4\no5\n", False)
    clock.t += 1
    sh.tick()
    sh.output("acme/o", 2, 1, "stdout", b"", True)
    sh.output("acme/o", 2, 1, "stderr", b"", True)
    published(sh)
    out = [(p.stream, p.seq, p.text, p.final) for p in pub.pieces]
    assert [x for x in out if x[0] == "stdout"] == [("stdout", 0, "o1\no2\n", False), ("stdout", 1, "o3\no4\n", False),
                                                     ("stdout", 2, "o5\n", False), ("stdout", 3, "", True)]
    assert [x for x in out if x[0] == "stderr"] == [("stderr", 0, "e1\n", False), ("stderr", 1, "", True)]
    assert all(p.attempt == 2 and p.part == 1 for p in pub.pieces)
    # a run both of whose streams ended takes nothing more (its numbers are never reused)
    sh.output("acme/o", 2, 1, "stdout", b"late\n", True)
    published(sh)
    assert len(pub.pieces) == 6
    # another attempt is another run, numbered from 0
    sh.output("acme/o", 3, 1, "stdout", b"again\n", True)
    published(sh)
    assert (pub.pieces[-1].attempt, pub.pieces[-1].seq, pub.pieces[-1].text) == (3, 0, "again\n")


def test_the_rate_cap_cuts_marks_the_cut_on_the_next_piece_and_counts_it():
    metrics = AgentMetrics()
    sh, clock, pub = shipper(LogCaps(rate_bytes_s=100, burst_bytes=100), metrics)
    sh.output("acme/r", 0, 0, "stdout", b"a" * 59 + b"\n" + b"b" * 89 + b"\n", False)  # 150 bytes, 100 allowed
    clock.t += 0.5  # 50 bytes more allowed
    sh.output("acme/r", 0, 0, "stdout", b"c" * 29 + b"\n", False)
    clock.t += 10  # the bucket refilled, to its burst only
    sh.output("acme/r", 0, 0, "stdout", b"d" * 99 + b"\n" + b"e" * 10 + b"\n", True)
    sh.output("acme/r", 0, 0, "stderr", b"", True)
    published(sh)
    pieces = [p for p in pub.pieces if p.stream == "stdout"]
    assert [(p.text, p.dropped_bytes) for p in pieces] == [
        ("a" * 59 + "\n" + "b" * 40, 0),  # what came before the cut, as its own piece
        ("c" * 29 + "\n" + "d" * 99 + "\n", 50),  # the next piece says what is missing before it
        ("", 11),  # cut after the last text: the final piece says so
    ]
    assert pieces[-1].final
    assert sh.stats["dropped:rate"] == 61 and dropped_metric(metrics)["rate"] == 61


def test_the_size_cap_per_run_cuts_the_rest_and_the_final_piece_says_how_much():
    metrics = AgentMetrics()
    sh, clock, pub = shipper(LogCaps(max_bytes=10), metrics)
    sh.output("acme/s", 4, 0, "stdout", b"0123456\n", False)
    sh.output("acme/s", 4, 0, "stderr", b"ab\ncdef\n", False)  # the cap is the run's: both streams together
    for _ in range(3):
        clock.t += 60
        sh.output("acme/s", 4, 0, "stdout", b"more output\n", False)
    sh.output("acme/s", 4, 0, "stdout", b"", True)
    sh.output("acme/s", 4, 0, "stderr", b"", True)
    published(sh)
    out = [(p.stream, p.text, p.dropped_bytes, p.final) for p in pub.pieces]
    # 8 bytes of stdout, then the 2 of stderr that reach the cap of 10: cut there, marked at each stream's end
    assert ("stdout", "0123456\n", 0, False) in out and ("stderr", "ab", 0, False) in out
    assert out[-2:] == [("stdout", "", 36, True), ("stderr", "", 6, True)]
    assert sh.stats["dropped:size"] == 42 and dropped_metric(metrics)["size"] == 42
    # another run of the job (the next attempt) has its own allowance
    sh.output("acme/s", 5, 0, "stdout", b"0123456789", True)
    published(sh)
    assert pub.pieces[-1].text == "0123456789" and pub.pieces[-1].dropped_bytes == 0


def test_output_never_waits_on_a_stuck_broker_and_holds_only_its_buffer():
    """The runner's callback returns at once while publishing hangs; what cannot be held is dropped and counted,
    and once the broker is back the pieces go out in order with the cut marked."""
    metrics = AgentMetrics()

    async def scenario():
        gate = asyncio.Event()
        sent = []

        async def publish(payload, source, *_):
            await gate.wait()  # the broker away
            sent.append(payload)

        sh = LogShipper("node-a", publish, caps=LogCaps(buffer_chars=1000, piece_chars=100), metrics=metrics)
        sh.start()
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        for i in range(200):  # 200 x 50 bytes: far more than the buffer
            assert sh.output("acme/b", 0, 0, "stdout", (f"{i:03d}" + "." * 46 + "\n").encode(), False) is None
        assert loop.time() - t0 < 5.0  # (a generous bound: returning at once is the point, not the speed)
        await asyncio.sleep(0.6)  # the publisher tried, and waits on the broker
        assert sent == [] and sh.stats["dropped:buffer"] > 0
        held = sum(len(p.text) for _, p in sh.queue) + sum(len(s.pending) for r in sh.runs.values()
                                                           for s in r.streams.values())
        assert held <= 1000
        gate.set()  # the broker back: the queue drains, and there is room again
        deadline = loop.time() + 60
        while sh.queue:
            assert loop.time() < deadline, "the queue did not drain"
            await asyncio.sleep(0.01)
        sh.output("acme/b", 0, 0, "stdout", b"last line\n", True)
        sh.output("acme/b", 0, 0, "stderr", b"", True)
        await sh.close()
        return sh, sent

    sh, sent = asyncio.run(scenario())
    stdout = [p for p in sent if p.stream == "stdout"]
    assert [p.seq for p in stdout] == list(range(len(stdout)))  # in order, no gap in numbering
    assert stdout[-1].final and stdout[-1].text == "last line\n"
    assert sum(p.dropped_bytes for p in stdout) == sh.stats["dropped:buffer"] == dropped_metric(metrics)["buffer"]
    assert "".join(p.text for p in stdout).startswith("000" + "." * 46 + "\n")


def test_a_simulated_fleets_shipper_states_the_node_running_the_job():
    from agents.node.fleet import make_node
    from agents.node.sim_agent import Running, SimFleetAgent
    from tests.test_sim_agent import Recorder

    async def scenario():
        rec = Recorder()
        ag = SimFleetAgent(None, [make_node("n1", "A100-80GB", 1), make_node("n2", "A100-80GB", 1)], producer=rec)
        ag.nodes["n2"].running["acme/sim"] = Running("c1", (), 0, None, 0)
        out = shipper_for(ag).output  # the one line a runner is wired with
        assert shipper_for(ag) is ag.log_shipper
        out("acme/sim", 1, 0, "stdout", b"hello from n2\n", True)
        out("acme/sim", 1, 0, "stderr", b"", True)
        out("acme/nowhere", 1, 0, "stdout", b"lost\n", True)  # no node runs it: dropped, counted
        # a fleet's runner knows each run's node: the callback bound to it needs no lookup
        shipper_for(ag).for_node("n1")("acme/early", 1, 0, "stdout", b"before it is registered\n", True)
        await ag.log_shipper.close()
        return rec, ag

    rec, ag = asyncio.run(scenario())
    logs = [(t, e) for t, _, e, _ in rec.sent if e.kind == "job.log"]
    assert {t for t, _ in logs} == {"gpupool.job-logs"}  # the tests' producer: home topics (a channel in run())
    (first, *_rest) = [e for _, e in logs]
    assert first.payload.node == "n2" and first.source == "n2/log/acme/sim" and first.payload.text == "hello from n2\n"
    early = [e for _, e in logs if e.payload.job_id == "acme/early"]
    assert early[0].payload.node == "n1" and early[0].payload.text == "before it is registered\n"
    assert ag.log_shipper.stats["dropped:no_node"] == 5
    assert dropped_metric(ag.metrics)["no_node"] == 5  # the agent's own metrics, found when used
