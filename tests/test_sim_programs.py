"""The simulated fleet runs real programs (issue #32 item 8), without a broker: a placement that carries a command runs
it as a real process with the simulated cards' UUIDs as its devices; what the process does is what the fleet reports;
faults and shutdown act on the process. A placement without a command keeps the stand-in run (tests/test_sim_agent.py).
The broker-and-worker version is tests/test_programs_live.py."""
from __future__ import annotations

import asyncio
import json
import os
import textwrap
from pathlib import Path

import pytest

from agents.node.fleet import make_node
from agents.node.runner import NodeContext, work_dir
from agents.node.sim_agent import SimFleetAgent
from schemas.events import (
    Assignment, JobCheckpointed, JobCompleted, JobFailed, JobStarted, JobStopped, MigrateJob, PlaceJob, PreemptJob,
    ReleaseJob, Tier,
)
from tests.program_helpers import need_python3, passable_dir
from tests.test_sim_agent import Recorder, cmd

# A program that reports what it sees, checkpoints every step and on SIGTERM, and runs until told (or `steps` done).
TRAINER = textwrap.dedent("""
    import json, os, signal, sys, time
    d = os.environ["GPUPOOL_CHECKPOINT_DIR"]
    steps = int(sys.argv[1])
    def manifest(step):
        open(d + "/.m", "w").write(json.dumps({"path": "step-%d" % step, "progress_ms": step * 100, "step": step}))
        os.rename(d + "/.m", d + "/checkpoint.json")
    def term(*_):
        manifest(999)
        sys.exit(0)
    signal.signal(signal.SIGTERM, term)
    print(json.dumps({k: v for k, v in os.environ.items() if k.startswith(("GPUPOOL_", "CUDA_", "NVIDIA_"))}),
          flush=True)
    open(d + "/pid", "w").write(str(os.getpid()))
    manifest(1)
    open(d + "/ready", "w").write("1")
    for step in range(2, steps + 1):
        time.sleep(0.2)
        manifest(step)
    if steps < 1000:
        sys.exit(int(os.environ.get("EXIT_WITH", "0")))
    while True:
        time.sleep(1)
""")


@pytest.fixture
def root():
    with passable_dir() as d:
        yield d


def sim(root: Path, **kw):
    ctx = NodeContext(node="", jobs_root=root / "jobs", checkpoint_root=root / "checkpoints", podman=None,
                      manifest_poll_s=0.05, user=(65534, 65534) if os.geteuid() == 0 else None, grace={"*": 20})
    rec = Recorder()
    nodes = [make_node("n1", "A100-80GB", 2), make_node("n2", "A100-80GB", 2)]
    return SimFleetAgent(None, nodes, producer=rec, ctx=ctx, **kw), rec


def program(job, cid, steps, node="n1", card="GPU-n1-1", attempt=1, env=None, **kw) -> PlaceJob:
    return PlaceJob(command_id=cid, job_id=job, tenant=job.split("/")[0], node=node, attempt=attempt,
                    assignments=(Assignment(gpu_uuid=card, milli=1000, memory_mib=1024),),
                    command=(need_python3(), "-c", TRAINER, str(steps)), env=env or {}, **kw)


def run(coro, timeout=90):
    return asyncio.run(asyncio.wait_for(coro, timeout))


async def until(pred, what: str, timeout: float = 60):
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not pred():
        assert loop.time() < end, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[1].split()[0] != "Z"
    except OSError:
        return False


def ready(root: Path, p: PlaceJob) -> bool:
    d = root / "checkpoints" / p.job_id
    return (d / "ready").exists() and (d / "pid").exists()


def pid_of(root: Path, p: PlaceJob) -> int:
    return int((root / "checkpoints" / p.job_id / "pid").read_text())


def test_a_placed_command_runs_for_real_with_the_simulated_cards(root):
    async def go():
        ag, rec = sim(root)
        ok = program("acme/ok", "c1", 3, env={"LR": "3e-4"})
        bad = program("acme/bad", "c2", 2, card="GPU-n2-0", node="n2", env={"EXIT_WITH": "4"}, attempt=3)
        await ag.execute(cmd(ok))
        await ag.execute(cmd(bad))
        await until(lambda: not any(n.running for n in ag.nodes.values()), "both programs to end")
        return ag, rec, ok

    ag, rec, ok = run(go())
    kinds = {j: [type(p).__name__ for p in rec.payloads(JobStarted, JobCheckpointed, JobCompleted, JobFailed)
                 if p.job_id == j] for j in ("acme/ok", "acme/bad")}
    assert kinds["acme/ok"][0] == "JobStarted" and kinds["acme/ok"][-1] == "JobCompleted"
    assert "JobCheckpointed" in kinds["acme/ok"]
    cks = [p for p in rec.payloads(JobCheckpointed) if p.job_id == "acme/ok"]
    assert [c.checkpoint for c in cks] == [f"step-{i}" for i in range(1, len(cks) + 1)][:len(cks)]
    assert cks[-1].checkpoint == "step-3" and cks[-1].progress_ms == 300 and cks[-1].command_id == "c1"
    (failed,) = [p for p in rec.payloads(JobFailed)]
    assert (failed.job_id, failed.code, failed.exit_code, failed.attempt, failed.node) == ("acme/bad", "ExitCode", 4,
                                                                                           3, "n2")
    seen = json.loads((work_dir(ok, ag.ctx.for_node("n1")).with_suffix(".log")).read_text().splitlines()[0])
    assert seen["CUDA_VISIBLE_DEVICES"] == seen["NVIDIA_VISIBLE_DEVICES"] == "GPU-n1-1"
    assert (seen["GPUPOOL_NODE"], seen["GPUPOOL_JOB_ID"], seen["GPUPOOL_TENANT"]) == ("n1", "acme/ok", "acme")
    assert seen["GPUPOOL_CHECKPOINT_DIR"] == str(root / "checkpoints/acme/ok")
    # the simulated node's telemetry shows the program's card busy while it ran: not asserted on timing here


def test_preemption_stops_the_program_with_sigterm_and_reports_its_last_checkpoint(root):
    async def go():
        ag, rec = sim(root)
        p = program("acme/long", "c1", 100000, attempt=2)
        await ag.execute(cmd(p))
        await until(lambda: ready(root, p), "the program to start")
        pid = pid_of(root, p)
        await ag.execute(cmd(PreemptJob(command_id="c2", job_id="acme/long", node="n1", grace_s=30, attempt=1)))
        stale_left_it = "acme/long" in ag.nodes["n1"].running  # a stop of an older attempt spares this run
        await ag.execute(cmd(PreemptJob(command_id="c3", job_id="acme/long", node="n1", grace_s=30, attempt=2)))
        await until(lambda: rec.payloads(JobStopped), "the stop")
        return rec, pid, stale_left_it

    rec, pid, stale_left_it = run(go())
    assert stale_left_it and not alive(pid)
    (stop,) = rec.payloads(JobStopped)
    assert (stop.command_id, stop.checkpoint, stop.progress_ms) == ("c3", "step-999", 99900)  # written on SIGTERM
    assert rec.payloads(JobCheckpointed)[-1].checkpoint == "step-999"
    assert not rec.payloads(JobFailed) and not rec.payloads(JobCompleted)


def test_a_move_resumes_the_program_on_the_other_node_from_the_shared_checkpoint(root):
    async def go():
        ag, rec = sim(root)
        first = program("acme/mv", "c1", 100000, attempt=1)
        await ag.execute(cmd(first))
        await until(lambda: ready(root, first), "the program to start")
        await ag.execute(cmd(MigrateJob(command_id="m1", job_id="acme/mv", from_node="n1", to_node="n2", attempt=1,
                                        assignments=())))
        await until(lambda: rec.payloads(JobStopped), "the move's stop")
        (stop,) = rec.payloads(JobStopped)
        (root / "checkpoints/acme/mv/ready").unlink()
        again = program("acme/mv", "c2", 100000, node="n2", card="GPU-n2-0", attempt=2, resume_from=stop.checkpoint)
        await ag.execute(cmd(again))
        await until(lambda: ready(root, again), "the program to start again")
        await ag.execute(cmd(ReleaseJob(command_id="r1", job_id="acme/mv", node="n2", attempt=2)))
        await until(lambda: not ag.nodes["n2"].running, "the release")
        return ag, stop, again

    ag, stop, again = run(go())
    assert (stop.reason, stop.checkpoint) == ("migrated", "step-999")
    seen = json.loads(work_dir(again, ag.ctx.for_node("n2")).with_suffix(".log").read_text().splitlines()[0])
    assert seen["GPUPOOL_RESUME_FROM"] == str(root / "checkpoints/acme/mv/step-999") and seen["GPUPOOL_NODE"] == "n2"


def test_faults_act_on_the_real_processes(root):
    async def go():
        ag, rec = sim(root)
        lost = program("acme/lost", "c1", 100000, node="n2", card="GPU-n2-0")
        restarted = program("acme/restarted", "c2", 100000)
        failed = program("acme/failed", "c3", 100000, card="GPU-n1-0")
        for p in (lost, restarted, failed):
            await ag.execute(cmd(p))
        await until(lambda: all(ready(root, p) for p in (lost, restarted, failed)), "three programs")
        pids = {p.job_id: pid_of(root, p) for p in (lost, restarted, failed)}
        await ag.apply("lose:n2")
        await ag.apply("fail:acme/failed")
        await ag.apply("restart:n1")
        await until(lambda: not any(alive(pid) for pid in pids.values()), "every process to end")
        await until(lambda: rec.payloads(JobStopped) and rec.payloads(JobFailed), "the reports")
        return rec, pids

    rec, pids = run(go())
    assert not [p for p in rec.payloads(JobStopped, JobFailed, JobCompleted, JobCheckpointed)
                if p.job_id == "acme/lost" and p.kind != "job.checkpointed"]  # a lost node tells nothing of its end
    (stop,) = rec.payloads(JobStopped)
    assert (stop.job_id, stop.reason, stop.checkpoint, stop.command_id) == ("acme/restarted", "agent restarted",
                                                                             "step-999", "c2")
    (fail,) = rec.payloads(JobFailed)
    assert (fail.job_id, fail.code, fail.signal) == ("acme/failed", "Simulated", 9)


def test_shutdown_stops_programs_with_their_grace_and_reports_them_stopped(root):
    async def go():
        ag, rec = sim(root)
        p = program("acme/sd", "c1", 100000, tier=Tier.ONLINE_TRAINING)
        await ag.execute(cmd(p))
        await until(lambda: ready(root, p), "the program")
        pid = pid_of(root, p)
        await ag.stop_jobs()
        return rec, pid

    rec, pid = run(go())
    (stop,) = rec.payloads(JobStopped)
    assert (stop.reason, stop.checkpoint, stop.command_id) == ("agent shutdown", "step-999", "c1") and not alive(pid)


def test_a_program_that_cannot_start_fails_with_its_reason(root):
    async def go():
        ag, rec = sim(root)
        p = PlaceJob(command_id="c1", job_id="acme/nope", tenant="acme", node="n1", attempt=1,
                     assignments=(Assignment(gpu_uuid="GPU-n1-0", milli=1000, memory_mib=1024),),
                     command=("no-such-trainer",))
        await ag.execute(cmd(p))
        img = p.model_copy(update={"command_id": "c2", "job_id": "acme/img", "image": "localhost/x:1"})
        await ag.execute(cmd(img))
        return ag, rec

    ag, rec = run(go())
    assert [(p.job_id, p.code) for p in rec.payloads(JobFailed)] == [("acme/nope", "CommandNotFound"),
                                                                     ("acme/img", "StartFailed")]
    assert not rec.payloads(JobStarted) and not ag.nodes["n1"].running
    assert "podman" in rec.payloads(JobFailed)[1].reason
