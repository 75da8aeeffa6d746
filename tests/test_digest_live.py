"""Issue #32 item 9 on the real broker, worker and simulated fleet: the shipped example program
(infra/programs/digest_train.py) runs once uninterrupted, and once as a job that goes through a reclaim, a
migration and a node loss; the final digest is the same, its logs show where each run resumed, and the bill counts
each run once.

The uninterrupted run is the program itself as a subprocess, with the same arguments, beside the stack. The job,
acme's, runs on borrowed capacity (beyond acme's quota) on a fleet of two 2-card A100 nodes:

1. a migration: globex fills the pool with three 1-card stand-ins, cancels the one beside the job and one on the
   other node, and asks for a 2-card block on one node; the free cards are one per node and the job is the only
   movable work (globex's stand-ins have no checkpoints), so defragmentation moves it, deterministically, to the
   other node (cmd.migrate): SIGTERM, it checkpoints and stops, and resumes there;
2. a reclaim: the pool is full and globex, within its own quota, asks for one more card: the borrowed job is the
   victim (cmd.preempt, PreemptedFor reclaim), SIGTERM'd, it checkpoints and stops; globex's block is cancelled and
   it resumes on the first node;
3. a node loss: globex's work is cancelled and the job's node is lost (`lose:NODE` in the fleet's control file): the
   program is SIGKILLed, the scheduler declares the node lost after two silent heartbeats and the job resumes on the
   other node from the last checkpoint it heard of (the program, finding a newer manifest in the shared checkpoint
   directory, or the state file named, resumes from there), and runs to its end.

The migration comes first: a job reclaimed is barred, for the victims' quiet window, from the node its preemptor
freed while that one holds it, and defragmentation moves it nowhere it is barred (tests/test_defrag.py: found while
writing this test), so a migration right after the reclaim may not find a node to move it to.

Waits are on conditions; the program's step count leaves room for the phases (a run's work is 40 s, the phases take
a few seconds of it), and each phase first checks the job has not finished."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import orjson
import pytest

from infra.programs import digest_train
from schemas.events import JobCancelled, JobRequested, QuotaSet, Tier
from tests.live import cli, job_states, wait_for
from tests.program_helpers import need_python3, passable_dir, program_fleet

pytestmark = pytest.mark.broker

PROGRAM = Path(digest_train.__file__)
ARGS = ("--steps", "800", "--every", "5", "--step-ms", "50")  # 40 s of work, a checkpoint every 250 ms
STEPS = 800
JOB = "acme/digest"
NODES = ("n1", "n2")
GIB = 1024


def _events(stack, kinds: tuple[str, ...], job: str = JOB) -> list[dict]:
    rows = stack.query("SELECT kind, event_time_ms, payload FROM gpupool.events FINAL WHERE job_id = {j:String} AND "
                       "kind IN {k:Array(String)} ORDER BY event_time_ms, topic, partition, offset",
                       {"j": job, "k": list(kinds)})
    return [{"kind": r["kind"], "t": int(r["event_time_ms"]), **orjson.loads(r["payload"])} for r in rows]


def _job(stack, job: str = JOB) -> dict:
    return job_states(stack, "admin").get(job, {})


def _checkpoints_of(stack, attempt: int) -> list[dict]:
    """The checkpoints the pool heard of during `attempt` (a checkpoint event names the placement's command)."""
    cmds = {p["command_id"] for p in _events(stack, ("cmd.place",)) if p["attempt"] == attempt}
    return [e for e in _events(stack, ("job.checkpointed",)) if e["command_id"] in cmds and e["progress_ms"] > 0]


def _running(stack, attempt: int) -> dict | None:
    """The job's row once its `attempt` runs and has checkpointed at least once past where it started."""
    row = _job(stack)
    assert row.get("state") != "completed", f"the program ended before the scenario was through: {row}"
    places = _events(stack, ("cmd.place",))
    if row.get("state") == "running" and places and places[-1]["attempt"] == attempt \
            and _checkpoints_of(stack, attempt):
        return {**row, "node": places[-1]["node"]}
    return None


def _logs_by_attempt(stack) -> dict[int, str]:
    out = cli(stack, "logs", "digest", "--format", "json", user="alice")
    runs: dict[int, str] = {}
    for line in out.splitlines():
        p = json.loads(line)
        runs[p["attempt"]] = runs.get(p["attempt"], "") + p["text"]
    return runs


def test_the_digest_program_resumes_through_a_reclaim_a_migration_and_a_node_loss(stack):
    python = need_python3()
    with passable_dir("gpupool-digest-") as roots:
        script = roots / "digest_train.py"
        shutil.copy(PROGRAM, script)
        os.chmod(script, 0o644)
        # the uninterrupted run, beside the stack: the same program and arguments, its own checkpoint directory
        alone = roots / "alone"
        alone.mkdir()
        reference = subprocess.Popen([python, str(script), *ARGS, "--dir", str(alone)], stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
        try:
            _scenario(stack, roots, script)
            out, _ = reference.communicate(timeout=300)
        finally:
            if reference.poll() is None:
                reference.kill()
                reference.wait()
        assert reference.returncode == 0, out
        (uninterrupted,) = re.findall(r"^digest ([0-9a-f]{64})$", out, re.M)
        assert "resumed" not in out and uninterrupted == digest_train.expected(STEPS)

        # 1. the same final digest, in the job's output and in its result file
        runs = _logs_by_attempt(stack)
        assert sorted(runs) == [1, 2, 3, 4], runs
        assert re.findall(r"^digest ([0-9a-f]{64})$", runs[4], re.M) == [uninterrupted], runs[4]
        result = json.loads((roots / "checkpoints" / "acme" / "digest" / "result.json").read_text())
        assert (result["digest"], result["steps"]) == (uninterrupted, STEPS)

    # 2. its logs show where each run resumed: the first from step 0, each later one from a step past 0
    assert runs[1].startswith("starting from step 0\n"), runs[1][:200]
    resumed = []
    for attempt in (2, 3, 4):
        m = re.match(r"resumed from step (\d+) \(", runs[attempt])
        assert m and int(m[1]) > 0, (attempt, runs[attempt][:200])
        resumed.append(int(m[1]))
    assert resumed == sorted(resumed), resumed  # never back before a checkpoint it had
    for attempt in (1, 2):  # the reclaim's and the move's SIGTERM: stopped with a checkpoint where it was
        assert re.search(r"^stopped by SIGTERM at step \d+$", runs[attempt], re.M), runs[attempt][-300:]
    text = cli(stack, "logs", "digest", user="alice")
    assert all(f"==> attempt {a}, part 0 on " in text for a in (1, 2, 3, 4)), text[:500]

    # 3. the bill counts each run once: each run billed from its start to its end, nothing between runs
    starts = [e["t"] for e in _events(stack, ("job.started",))]
    stops = _events(stack, ("job.stopped",))
    (lost,) = _events(stack, ("job.interrupted",))
    (done,) = _events(stack, ("job.completed",))
    ends = [stops[0]["t"], stops[1]["t"], lost["billed_to_ms"], done["t"]]
    assert len(starts) == 4 and len(stops) == 2 and lost["code"] == "NodeLost" and stops[0]["reason"] == "migrated"
    usage = wait_for(lambda: (u := _events(stack, ("usage.accrued",))) and max(x["end_ms"] for x in u) == ends[-1]
                     and u, 60, "the last run billed", stack)
    for attempt, (s, e) in enumerate(zip(starts, ends), 1):
        mine = [u for u in usage if u["attempt"] == attempt]
        assert mine and all(s <= u["start_ms"] <= u["end_ms"] <= e for u in mine), (attempt, s, e, mine)
        assert sum(u["end_ms"] - u["start_ms"] for u in mine) == e - s, (attempt, s, e, mine)
        assert sum(u["gpu_milli_ms"] for u in mine) == sum(u["gpu_milli"] * (u["end_ms"] - u["start_ms"])
                                                           for u in mine)
    spans = sorted((u["start_ms"], u["end_ms"]) for u in usage)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), spans  # nothing billed twice
    gaps = list(zip(ends, starts[1:]))
    assert not [u for u in usage for a, b in gaps if u["start_ms"] < b and u["end_ms"] > a], (gaps, usage)
    assert sum(u["end_ms"] - u["start_ms"] for u in usage) == sum(e - s for s, e in zip(starts, ends))
    assert all(u["borrowed"] for u in usage)  # beyond acme's quota throughout: on its own line of the bill
    print(f"digest {uninterrupted[:16]}... after 4 runs, resumed from steps {resumed}; billed "
          f"{[e - s for s, e in zip(starts, ends)]} ms in {len(usage)} usage rows, gaps {[b - a for a, b in gaps]} ms")


def _scenario(stack, roots: Path, script: Path) -> None:
    control = program_fleet(stack, roots, NODES, 2, GPUPOOL_GRACE_S="offline=10")
    stack.add_user("alice", "tenant", "acme")
    stack.add_user("bob", "tenant", "globex")
    # acme's quota is half a card (it may borrow up to 1.5): its 1-card job runs on borrowed capacity
    stack.client().send([QuotaSet(tenant="acme", gpu_milli=500, overcommit_pct=300),
                         QuotaSet(tenant="globex", gpu_milli=4000)])
    wait_for(lambda: stack.stats()["scheduler"]["nodes"] == len(NODES), 60, "the fleet in the scheduler", stack)
    alice, bob = stack.client("alice"), stack.client("bob")
    alice.send([JobRequested(job_id="digest", tenant="acme", compute_milli=1000, gpu_memory_mib=8 * GIB,
                             checkpoint_interval_s=1, command=("python3", str(script), *ARGS))])
    first = wait_for(lambda: _running(stack, 1), 120, "the program's first run with a checkpoint", stack)
    (place,) = _events(stack, ("cmd.place",))
    assert place["borrowed"] and place["command"][-len(ARGS):] == list(ARGS), place
    (other,) = [n for n in NODES if n != first["node"]]

    # 1. defragmentation moves it: globex fills the pool, then leaves one free card on each node and asks for two
    # cards on one node; the job is the only movable work (globex's stand-ins have no checkpoints)
    fillers = [f"fill-{i}" for i in range(3)]
    bob.send([JobRequested(job_id=f, tenant="globex", compute_milli=1000, gpu_memory_mib=8 * GIB, duration_s=3600)
              for f in fillers])
    wait_for(lambda: all(_job(stack, f"globex/{f}").get("state") == "running" for f in fillers), 90,
             "globex's three jobs running", stack)
    where = {f: _job(stack, f"globex/{f}")["nodes"] for f in fillers}
    gone = [next(f for f in fillers if where[f] == first["node"]), next(f for f in fillers if where[f] == other)]
    (kept,) = [f for f in fillers if f not in gone]
    bob.send([JobCancelled(job_id=f, reason="leave the free cards apart") for f in gone])
    wait_for(lambda: all(_job(stack, f"globex/{f}").get("state") == "cancelled" for f in gone), 60,
             "two cards free, one on each node", stack)
    assert _running(stack, 1)
    bob.send([JobRequested(job_id="block", tenant="globex", tier=Tier.INFERENCE, compute_milli=2000,
                           gpu_memory_mib=2 * 80 * GIB, isolation="exclusive", duration_s=3600,
                           constraints={"max_spread": "node", "models": ["A100-80GB"]})])
    (move,) = wait_for(lambda: _events(stack, ("cmd.migrate",)), 90, "the move", stack)
    assert (move["from_node"], move["to_node"], move["attempt"]) == (first["node"], other, 1), move
    second = wait_for(lambda: _running(stack, 2), 120, "the second run, moved, with a checkpoint", stack)
    assert second["node"] == other
    wait_for(lambda: _job(stack, "globex/block").get("state") == "running", 60, "the block placed", stack)

    # 2. the lender's demand reclaims the borrowed run: the pool is full and globex asks for one more card
    bob.send([JobRequested(job_id="more", tenant="globex", compute_milli=1000, gpu_memory_mib=8 * GIB,
                           duration_s=3600)])
    (preempt,) = wait_for(lambda: _events(stack, ("cmd.preempt",)), 90, "the reclaim", stack)
    assert preempt["node"] == other and preempt["attempt"] == 2, preempt
    assert preempt["reasons"][0]["code"] == "PreemptedFor" and preempt["reasons"][0]["data"]["rule"] == "reclaim"
    wait_for(lambda: len(_events(stack, ("job.stopped",))) == 2, 60, "the reclaimed run stopped", stack)
    wait_for(lambda: _job(stack, "globex/more").get("state") == "running", 60, "globex's job in its place", stack)
    bob.send([JobCancelled(job_id="block", reason="room for acme")])
    third = wait_for(lambda: _running(stack, 3), 120, "the third run with a checkpoint", stack)
    assert third["node"] == first["node"]

    # 3. its node is lost (globex's work on the other node cancelled first, so that the job has room there)
    bob.send([JobCancelled(job_id=f, reason="room for acme") for f in (kept, "more")])
    wait_for(lambda: all(_job(stack, f"globex/{f}").get("state") == "cancelled" for f in (kept, "more")), 60,
             "globex's work gone", stack)
    assert _running(stack, 3)
    with control.open("a") as f:
        f.write(f"lose:{third['node']}\n")
    wait_for(lambda: _events(stack, ("job.interrupted",)), 90, "the node declared lost", stack)
    wait_for(lambda: _job(stack).get("state") == "completed", 180, "the program's end", stack)
    (last,) = [p for p in _events(stack, ("cmd.place",)) if p["attempt"] == 4]
    assert last["node"] == other and last["resume_from"], last
