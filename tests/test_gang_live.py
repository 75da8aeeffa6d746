"""Issue #33 items 1-3 on the real broker, worker and simulated fleet: a gang of three parts runs the shipped
distributed program (infra/programs/allreduce_train.py) on three simulated nodes, each advertising a loopback address
of its own (127.0.0.2, 127.0.0.3, ...). The parts rendezvous over TCP at the master address and port the scheduler put
in every placement and all-reduce a value every step; then rank 0's node is lost (`lose:NODE`: its process is
SIGKILLed, the node falls silent): the scheduler declares it lost, releases the two other parts (they are stopped:
SIGTERM, a checkpoint, exit 0), and places the gang again on the three nodes left (the fleet has four), with a new
master; the new attempt rendezvous there, resumes from the step every part has, and ends with the digest of an
uninterrupted run. Each part is billed for what ran: one usage line per part, from the run's start to its end (the
lost run: to the node's last heartbeat), nothing between the runs.

A node loss is no failure: the job asked for no retries and still completes. Waits are on conditions."""
from __future__ import annotations

import json
import os
import re
import shutil
import socket
from pathlib import Path

import orjson
import pytest

from agents.node.sim_agent import loopback
from infra.programs import allreduce_train
from schemas.events import JobRequested, QuotaSet
from tests.live import cli, job_states, wait_for
from tests.program_helpers import need_python3, passable_dir, program_fleet

pytestmark = pytest.mark.broker

PROGRAM = Path(allreduce_train.__file__)
STEPS = 600
ARGS = ("--steps", str(STEPS), "--every", "5", "--step-ms", "50")  # 30 s of work, a checkpoint every 250 ms
JOB = "acme/gang"
NODES = ("n1", "n2", "n3", "n4")
ADDRESS = {n: loopback(i) for i, n in enumerate(NODES)}  # the simulated fleet's, in the fleet file's order
GIB = 1024


def _free_range(size: int = 8) -> tuple[int, int]:
    """Ports free on every node address: the rendezvous range the test's worker gives the scheduler (tests pick
    their own ports)."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + size > 65535:
            continue
        try:
            for port in range(base, base + size):
                for addr in ADDRESS.values():
                    with socket.socket() as t:
                        t.bind((addr, port))
        except OSError:
            continue
        return base, base + size - 1
    pytest.fail("no free port range on the loopback addresses")


def _events(stack, kinds: tuple[str, ...], job: str = JOB) -> list[dict]:
    rows = stack.query("SELECT kind, event_time_ms, payload FROM gpupool.events FINAL WHERE job_id = {j:String} AND "
                       "kind IN {k:Array(String)} ORDER BY event_time_ms, topic, partition, offset",
                       {"j": job, "k": list(kinds)})
    return [{"kind": r["kind"], "t": int(r["event_time_ms"]), **orjson.loads(r["payload"])} for r in rows]


def _places(stack, attempt: int) -> list[dict]:
    return sorted((p for p in _events(stack, ("cmd.place",)) if p["attempt"] == attempt),
                  key=lambda p: p["gang_index"])


def _all_checkpointed(stack, attempt: int) -> list[dict] | None:
    """The attempt's placements once every part reported a checkpoint past the start (the parts met and
    all-reduced)."""
    row = job_states(stack, "admin").get(JOB, {})
    assert row.get("state") != "completed", f"the program ended before the scenario was through: {row}"
    places = _places(stack, attempt)
    if len(places) != 3:
        return None
    cmds = {p["command_id"] for p in places}
    seen = {e["command_id"] for e in _events(stack, ("job.checkpointed",))
            if e["command_id"] in cmds and e["progress_ms"] > 0}
    return places if seen == cmds else None


def _logs(stack) -> dict[tuple[int, int], str]:
    out = cli(stack, "logs", "gang", "--format", "json", user="alice")
    runs: dict[tuple[int, int], str] = {}
    for line in out.splitlines():
        p = json.loads(line)
        runs[(p["attempt"], p["part"])] = runs.get((p["attempt"], p["part"]), "") + p["text"]
    return runs


def _pool(stack, roots: Path, first: int, last: int, nodes=NODES, retries: int = 0) -> Path:
    """Worker, a simulated fleet of 1-card nodes (a fault control file, returned), acme, and the gang's request."""
    python = need_python3()
    script = roots / "allreduce_train.py"
    shutil.copy(PROGRAM, script)
    os.chmod(script, 0o644)
    control = program_fleet(stack, roots, nodes, 1, GPUPOOL_GRACE_S="offline=10",
                            GPUPOOL_RENDEZVOUS_PORTS=f"{first}-{last}")
    stack.add_user("alice", "tenant", "acme")
    stack.client().send([QuotaSet(tenant="acme", gpu_milli=8000)])
    wait_for(lambda: stack.stats()["scheduler"]["nodes"] == len(nodes), 60, "the fleet in the scheduler", stack)
    stack.client("alice").send([JobRequested(
        job_id="gang", tenant="acme", compute_milli=3000, gpu_memory_mib=3 * 8 * GIB, cpu_milli=2000,
        memory_mib=2048, retries=retries, command=(python, str(script), *ARGS))])
    return control


def test_a_three_part_gang_rendezvous_all_reduces_loses_a_node_and_resumes(stack):
    first, last = _free_range()
    with passable_dir("gpupool-gang-") as roots:
        control = _pool(stack, roots, first, last)

        # 1. rendezvous: every part is told the same master -- rank 0's node address -- and a port of the range,
        # and the parts met there (each reported a checkpoint: it all-reduced steps with the others)
        places = wait_for(lambda: _all_checkpointed(stack, 1), 180, "the three parts met and checkpointing", stack)
        master = places[0]["node"]
        assert {p["master_addr"] for p in places} == {ADDRESS[master]}, places
        (port,) = {p["master_port"] for p in places}
        assert first <= port <= last
        assert len({p["node"] for p in places}) == 3 and {p["gang_size"] for p in places} == {3}
        # host CPU and memory are per part, as asked
        assert {(p["cpu_milli"], p["memory_mib"]) for p in places} == {(2000, 2048)}, places

        # 2. rank 0's node is lost: the two other parts are stopped, the gang requeued once and placed again
        with control.open("a") as f:
            f.write(f"lose:{master}\n")
        (lost,) = wait_for(lambda: _events(stack, ("job.interrupted",)), 90, "the node declared lost", stack)
        assert lost["code"] == "NodeLost" and lost["attempt"] == 1
        assert set(lost["commands"]) == {p["command_id"] for p in places}
        releases = [r for r in _events(stack, ("cmd.release",)) if r["attempt"] == 1]
        assert {r["node"] for r in releases} == {p["node"] for p in places}, releases
        again = wait_for(lambda: (a := _places(stack, 2)) and len(a) == 3 and a, 90, "the second attempt", stack)
        assert master not in {p["node"] for p in again} and len({p["node"] for p in again}) == 3
        new_master = again[0]["node"]
        assert {p["master_addr"] for p in again} == {ADDRESS[new_master]}, again
        assert len({p["master_port"] for p in again}) == 1 and first <= again[0]["master_port"] <= last
        assert all(p["resume_from"] for p in again), again
        wait_for(lambda: job_states(stack, "admin").get(JOB, {}).get("state") == "completed", 240,
                 "the gang's end", stack)
        want = allreduce_train.expected(STEPS, 3)
        for k in range(3):
            result = json.loads((roots / "checkpoints" / "acme" / "gang" / f"part-{k}" / "result.json").read_text())
            assert (result["digest"], result["steps"], result["world"]) == (want, STEPS, 3)

    # 3. the logs: the first attempt met and started from step 0; the two survivors were stopped by the pool; the
    # second attempt met again, resumed from a step past 0 agreed by the three, and ended with the uninterrupted digest
    logs = _logs(stack)
    for k in range(3):
        first_run = logs[(1, k)]
        assert f"of 3: meeting at {ADDRESS[master]}:{port}" in first_run, first_run[:300]
        assert "starting from step 0" in first_run, first_run[:300]
    for k in (1, 2):  # the lost node's part said nothing more; the others lost their peer and were stopped
        assert "peer lost at step" in logs[(1, k)], logs[(1, k)][-400:]
        assert re.search(r"^stopped by SIGTERM at step \d+$", logs[(1, k)], re.M), logs[(1, k)][-400:]
    resumed = set()
    for k in range(3):
        run = logs[(2, k)]
        assert f"meeting at {ADDRESS[new_master]}:{again[0]['master_port']}" in run, run[:300]
        m = re.search(r"^resumed from step (\d+) \(agreed by 3 parts\)$", run, re.M)
        assert m and int(m[1]) > 0, run[:300]
        resumed.add(int(m[1]))
        assert re.findall(r"^digest ([0-9a-f]{64})$", run, re.M) == [want], run[-300:]
    assert len(resumed) == 1, resumed

    # 4. billed per part for what ran: each attempt's parts each have their own lines, on their own node, from the
    # run's start to its end (the lost run: to the lost node's last heartbeat), nothing between the runs
    started = {1: set(), 2: set()}
    for e in _events(stack, ("job.started",)):
        started[1 if e["command_id"] in {p["command_id"] for p in places} else 2].add(e["t"])
    done = _events(stack, ("job.completed",))
    assert len(done) == 3 and {d["parts"] for d in done} == {3} and {d["part"] for d in done} == {0, 1, 2}
    usage = wait_for(lambda: (u := _events(stack, ("usage.accrued",))) and max(x["end_ms"] for x in u) >= min(
        d["t"] for d in done) and u, 60, "the last run billed", stack)
    spans = {}
    for attempt, run_places in ((1, places), (2, again)):
        mine = [u for u in usage if u["attempt"] == attempt]
        assert {u["node"] for u in mine} == {p["node"] for p in run_places}, (attempt, mine)
        # the run: from its first part's start (as the scheduler read the starts) to its end -- the lost node's
        # last heartbeat; the last part's completion
        start, end = min(u["start_ms"] for u in mine), max(u["end_ms"] for u in mine)
        assert start in started[attempt], (start, started[attempt])
        assert end == lost["billed_to_ms"] if attempt == 1 else end in {d["t"] for d in done}, (attempt, end)
        for p in run_places:
            lines = sorted((u for u in mine if u["node"] == p["node"]), key=lambda u: u["start_ms"])
            assert sum(u["end_ms"] - u["start_ms"] for u in lines) == end - start, lines
            assert all(a["end_ms"] == b["start_ms"] for a, b in zip(lines, lines[1:])), lines
            assert all(u["gpu_milli"] == 1000 for u in lines)
        spans[attempt] = (start, end)
    assert spans[1][1] <= spans[2][0], "nothing billed between the runs"
    ends, starts = {a: e for a, (_, e) in spans.items()}, {a: s for a, (s, _) in spans.items()}
    print(f"gang met at {ADDRESS[master]}:{port}, then at {ADDRESS[new_master]}:{again[0]['master_port']}; resumed "
          f"from step {resumed}; billed {ends[1] - starts[1]} + {ends[2] - starts[2]} ms per part")


def test_a_part_that_fails_stops_the_other_parts_and_the_gang_retries_as_one(stack):
    """One part's process dies (`fail:JOB`: SIGKILLed, reported failed, code Simulated): the run has failed -- every
    other part is released and stopped, the gang counts one failure, waits its back-off and is placed again as a
    whole, resuming from its checkpoint to the uninterrupted digest. Three nodes: the same ones take it again."""
    first, last = _free_range()
    with passable_dir("gpupool-gang-") as roots:
        control = _pool(stack, roots, first, last, nodes=NODES[:3], retries=1)
        places = wait_for(lambda: _all_checkpointed(stack, 1), 180, "the three parts met and checkpointing", stack)
        with control.open("a") as f:
            f.write(f"fail:{JOB}\n")
        (failed,) = wait_for(lambda: _events(stack, ("job.failed",)), 60, "a part's failure", stack)
        assert failed["code"] == "Simulated" and failed["attempt"] == 1
        dead = failed["node"]
        # every part released for the failure (a stopped part's last checkpoint report, of the ended run, is answered
        # by another release naming the run: `Superseded`)
        releases = wait_for(lambda: (r := [x for x in _events(stack, ("cmd.release",)) if x["attempt"] == 1
                                           and x["reasons"][0]["code"] == "Failed"]) and len(r) == 3 and r, 60,
                            "every part released", stack)
        assert {r["node"] for r in releases} == {p["node"] for p in places}
        again = wait_for(lambda: (a := _places(stack, 2)) and len(a) == 3 and a, 90, "the retry, after its back-off",
                         stack)
        assert all(p["resume_from"] for p in again) and len({(p["master_addr"], p["master_port"]) for p in again}) == 1
        wait_for(lambda: job_states(stack, "admin").get(JOB, {}).get("state") == "completed", 240,
                 "the gang's end", stack)
        row = job_states(stack, "admin")[JOB]
        assert row["failures"] == 1, row  # one failed run, however many of its parts ended badly
    logs = _logs(stack)
    want = allreduce_train.expected(STEPS, 3)
    dead_part = next(p["gang_index"] for p in places if p["node"] == dead)
    for k in range(3):
        if k != dead_part:  # stopped by the pool (SIGTERM, after its peer went away or while still running)
            assert re.search(r"^stopped by SIGTERM at step \d+$", logs[(1, k)], re.M), logs[(1, k)][-400:]
        run = logs[(2, k)]
        assert re.search(r"^resumed from step [1-9]\d* \(agreed by 3 parts\)$", run, re.M), run[:300]
        assert re.findall(r"^digest ([0-9a-f]{64})$", run, re.M) == [want], run[-300:]
