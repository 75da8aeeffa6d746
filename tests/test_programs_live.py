"""Real programs on the real broker and worker with the simulated fleet (issue #32 items 2, 3, 5, 7 and 8): a job
submitted with a command and environment runs as a real process, as the job user, with the pool's environment and
its own; each exit reason reaches `job.failed`; a drain sends SIGTERM, waits the grace period, SIGKILLs, reports the
last checkpoint the program's manifest named, and the job resumes from it on the other node; a container sees only
the device nodes of its own cards.

The fleet's node names are unique to the run, so that the CDI spec the container test writes to /var/run/cdi (where
podman 4.3 reads specs) cannot collide with another run's. Needs podman, runc and catatonit (`make podman`)."""
from __future__ import annotations

import json
import os
import re
import textwrap
from pathlib import Path

import pytest

from schemas.envelope import decode
from schemas.topics import JOB_EVENTS
from tests.live import cli, job_states, live_pool, read_topic, wait_for
from tests.program_helpers import busybox_image, cdi_spec, need_python3, passable_dir, podman

pytestmark = pytest.mark.broker

TAG = os.urandom(3).hex()
NODES = (f"p{TAG}-a", f"p{TAG}-b")


@pytest.fixture(scope="module")
def roots():
    with passable_dir("gpupool-live-") as d:
        yield d


@pytest.fixture(scope="module")
def pool(tmp_path_factory, broker_mode, libs_home, roots):
    podman()  # the image tests need it; fail at once saying what to install
    fleet = roots / "fleet.yaml"
    fleet.write_text("nodes:\n" + "".join(f"  - {{name: {n}, model: A100-80GB, gpus: 2}}\n" for n in NODES))
    env = {"GPUPOOL_JOBS_ROOT": str(roots / "jobs"), "GPUPOOL_CHECKPOINT_ROOT": str(roots / "checkpoints"),
           "GPUPOOL_GRACE_S": "2",
           # allowed at the gateway, missing on every node: VolumeUnavailable
           "GPUPOOL_VOLUMES": f"datasets={roots / 'no-such-volume'}:ro"}
    with live_pool(tmp_path_factory, broker_mode, libs_home, "programs", [("alice", "tenant", "acme"),
                                                                          ("bob", "tenant", "globex")],
                   fleet=str(fleet), quota_for=("acme",), extra_env=env) as s:
        wait_for(lambda: s.stats()["scheduler"]["nodes"] == len(NODES), 60, "both nodes in the scheduler", s)
        yield s


def submit(pool, name: str, *argv: str, opts: tuple[str, ...] = ()) -> str:
    out = cli(pool, "submit", "--compute", "1000", "--memory-gib", "1", "--job-id", name, *opts, "--", *argv,
              user="alice")
    assert out.strip() == f"acme/{name}", out
    return f"acme/{name}"


def state(pool, job: str) -> str | None:
    return job_states(pool, "alice").get(job, {}).get("state")


def job_events(pool, job: str) -> list:
    return [e.payload for e in (decode(m.value) for m in read_topic(pool, JOB_EVENTS.name))
            if getattr(e.payload, "job_id", None) == job]


def run_log(roots: Path, job: str, attempt: int) -> tuple[str, str]:
    """(node, text) of the attempt's log file, wherever the job ran."""
    tenant, name = job.split("/")
    for node in NODES:
        f = roots / "jobs" / node / tenant / name / f"attempt-{attempt}.log"
        if f.exists():
            return node, f.read_text()
    return "", ""


def test_the_command_and_environment_reach_the_program(pool, roots):
    code = textwrap.dedent("""
        import json, os, sys
        seen = {"env": dict(os.environ), "argv": sys.argv[1:], "uid": os.getuid()}
        open(os.environ["GPUPOOL_CHECKPOINT_DIR"] + "/seen.json", "w").write(json.dumps(seen))
        print("hello from", os.environ["GPUPOOL_NODE"])
    """)
    job = submit(pool, "probe", need_python3(), "-c", code, "a b", "$(id); rm -rf /",
                 opts=("--env", "LR=3e-4", "--env", "EPOCHS=2"))
    wait_for(lambda: state(pool, job) == "completed", 90, "the probe to complete", pool)
    seen = json.loads((roots / "checkpoints/acme/probe/seen.json").read_text())
    env = seen["env"]
    assert seen["argv"] == ["a b", "$(id); rm -rf /"]  # as given, never through a shell
    assert (env["LR"], env["EPOCHS"]) == ("3e-4", "2")
    assert (env["GPUPOOL_JOB_ID"], env["GPUPOOL_TENANT"], env["GPUPOOL_ATTEMPT"]) == ("acme/probe", "acme", "1")
    assert env["GPUPOOL_NODE"] in NODES and env["GPUPOOL_CHECKPOINT_DIR"] == str(roots / "checkpoints/acme/probe")
    assert re.fullmatch(rf"GPU-{env['GPUPOOL_NODE']}-[01]", env["CUDA_VISIBLE_DEVICES"])  # one simulated card
    assert env["NVIDIA_VISIBLE_DEVICES"] == env["CUDA_VISIBLE_DEVICES"]
    assert not {"GPUPOOL_HOME", "GPUPOOL_KAFKA", "GPUPOOL_USER", "GPUPOOL_VOLUMES"} & set(env)  # not the agent's
    assert seen["uid"] == (65534 if os.geteuid() == 0 else os.getuid())
    node, text = run_log(roots, job, 1)
    assert node == env["GPUPOOL_NODE"] and text == f"hello from {node}\n"
    kinds = [p.kind for p in job_events(pool, job)]
    assert kinds[0] == "job.started" and kinds[-1] == "job.completed"


def test_a_programs_output_is_its_tenants_to_read_and_no_one_elses(pool, roots):
    """Item 6 end to end: what a real program writes to stdout and stderr reaches `gpupool logs` of its owner, in
    order, through the node's job.log, the relay, the sink and the API; another tenant gets nothing."""
    code = "import sys\nfor i in range(3): print('step', i, flush=True)\nprint('a warning', file=sys.stderr)"
    job = submit(pool, "talks", need_python3(), "-c", code)
    wait_for(lambda: state(pool, job) == "completed", 90, "the program to complete", pool)

    def shown():
        out = cli(pool, "logs", "talks", "-q", user="alice", check=False)
        return out.returncode == 0 and "a warning" in out.stdout and "step 2" in out.stdout and out.stdout

    out = wait_for(shown, 90, "the program's output through `gpupool logs`", pool)
    lines = out.splitlines()
    assert [ln for ln in lines if ln.startswith("step")] == ["step 0", "step 1", "step 2"]
    assert "a warning" in lines
    for asked in ("talks", "acme/talks"):
        other = cli(pool, "logs", asked, user="bob", check=False)
        assert other.returncode == 1 and "step" not in other.stdout + other.stderr, other


def test_a_cpu_only_job_runs_its_program_with_no_card(pool, roots):
    """A CPU-only job (`--compute 0 --memory-gib 0`: data preparation beside the GPU work) runs as a real process with
    no device (CUDA_VISIBLE_DEVICES empty, NVIDIA_VISIBLE_DEVICES void), completes, its output reaches `logs`, the
    scheduler says where and why (HostFit), and no GPU time is billed for it."""
    code = "import os\nprint('devices', repr(os.environ['CUDA_VISIBLE_DEVICES']), os.environ['NVIDIA_VISIBLE_DEVICES'])"
    out = cli(pool, "submit", "--compute", "0", "--memory-gib", "0", "--cpu", "2000", "--job-id", "prep", "--",
              need_python3(), "-c", code, user="alice")
    job = out.strip()
    assert job == "acme/prep", out
    wait_for(lambda: state(pool, job) == "completed", 90, "the CPU-only job to complete", pool)
    node, text = run_log(roots, job, 1)
    assert node in NODES and text == "devices '' void\n"
    place = next(p for p in job_events(pool, job) if p.kind == "job.started")
    assert place.node == node
    explained = cli(pool, "explain", "prep", user="alice")
    assert "HostFit" in explained and f"cmd.place  {node}: CPU-only, 2000 milli-CPU" in explained, explained
    billed = cli(pool, "billing", "--by", "job", user="alice")
    assert "acme/prep" not in billed, billed


def test_each_exit_reason_reaches_job_failed(pool, roots):
    py = need_python3()
    cases = {
        "exit3": (("--", py, "-c", "raise SystemExit(3)"), "ExitCode", ("exit_code", 3)),
        "killed": (("--", py, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"), "Signal",
                   ("signal", 9)),
        "nocmd": (("--", "no-such-trainer", "--lr", "1"), "CommandNotFound", None),
        "oom": (("--host-memory-mib", "48", "--", py, "-c", "x = []\nwhile True: x.append(bytearray(8 << 20))"),
                "OOMKilled", ("signal", 9)),
        "novol": (("--volume", "datasets:/data:ro", "--image", busybox_image(), "--", "true"), "VolumeUnavailable",
                  None),
        "noimage": (("--image", "localhost/gpupool-no-such-image:0", "--", "true"), "ImageNotFound", None),
        "nodir": (("--workdir", "/nonexistent/dir", "--", py, "-c", "pass"), "StartFailed", None),
    }
    for name, (argv, _, _) in cases.items():
        split = argv.index("--")
        submit(pool, name, *argv[split + 1:], opts=argv[:split])
    wait_for(lambda: all(state(pool, f"acme/{n}") == "failed" for n in cases), 120, "every job to fail", pool)
    events = [e.payload for e in (decode(m.value) for m in read_topic(pool, JOB_EVENTS.name))]
    for name, (_, code, detail) in cases.items():
        (failed,) = [p for p in events if p.kind == "job.failed" and p.job_id == f"acme/{name}"]
        assert failed.code == code and failed.attempt == 1 and failed.node in NODES, failed
        if detail:
            assert getattr(failed, detail[0]) == detail[1], failed
    # the reason a user reads
    assert "exit code 3" in cli(pool, "history", "exit3", user="alice")


def test_a_drain_sends_sigterm_waits_the_grace_then_kills_and_the_job_resumes_elsewhere(pool, roots):
    code = textwrap.dedent("""
        import json, os, signal, time
        d = os.environ["GPUPOOL_CHECKPOINT_DIR"]
        attempt = os.environ["GPUPOOL_ATTEMPT"]
        def term(*_):
            open(d + "/got-term-" + attempt, "w").write(str(time.time()))
        signal.signal(signal.SIGTERM, term)  # and go on: the agent must SIGKILL after the grace period
        open(d + "/node-" + attempt, "w").write(os.environ["GPUPOOL_NODE"])
        open(d + "/resumed-" + attempt, "w").write(os.environ["GPUPOOL_RESUME_FROM"])
        open(d + "/.m", "w").write(json.dumps({"path": "step-%s.ckpt" % attempt, "progress_ms": 1000}))
        os.rename(d + "/.m", d + "/checkpoint.json")
        while True:
            time.sleep(0.2)
    """)
    job = submit(pool, "stubborn", need_python3(), "-c", code)
    ckdir = roots / "checkpoints/acme/stubborn"
    wait_for(lambda: (ckdir / "resumed-1").exists(), 90, "the first run", pool)
    wait_for(lambda: any(p.kind == "job.checkpointed" and p.checkpoint == "step-1.ckpt" for p in job_events(pool, job)),
             60, "the manifest reported", pool)
    first = job_states(pool, "alice")[job]["nodes"]
    assert first in NODES
    cli(pool, "node", "drain", first)
    try:
        stopped = wait_for(lambda: [p for p in job_events(pool, job) if p.kind == "job.stopped"], 90, "the stop", pool)
        assert stopped[0].checkpoint == "step-1.ckpt" and stopped[0].node == first
        assert (ckdir / "got-term-1").exists()  # SIGTERM came first; the program ignored it and was killed
        wait_for(lambda: (ckdir / "resumed-2").exists(), 90, "the second run", pool)
        assert (ckdir / "resumed-2").read_text() == str(ckdir / "step-1.ckpt")
        assert (ckdir / "node-1").read_text() == first
        assert (ckdir / "node-2").read_text() in NODES and (ckdir / "node-2").read_text() != first  # drained
        cli(pool, "cancel", job, user="alice")
        wait_for(lambda: state(pool, job) == "cancelled", 60, "cancelled", pool)
    finally:
        cli(pool, "node", "uncordon", first)


def test_a_container_sees_only_the_device_nodes_of_its_own_cards(pool, roots):
    image = busybox_image()
    uuids = [f"GPU-{n}-{i}" for n in NODES for i in range(2)]
    with cdi_spec(uuids, roots):
        jobs = [submit(pool, f"dev{i}", "sh", "-c", "echo $CUDA_VISIBLE_DEVICES; ls /dev; id -u",
                       opts=("--image", image)) for i in range(2)]
        wait_for(lambda: all(state(pool, j) in ("completed", "failed") for j in jobs), 120, "both containers", pool)
        assert [state(pool, j) for j in jobs] == ["completed", "completed"], [job_events(pool, j) for j in jobs]
    seen = []
    for j in jobs:
        _, text = run_log(roots, j, 1)
        lines = text.split()
        card, devs, uid = lines[0], {x for x in lines[1:-1] if x.startswith("nvidia")}, lines[-1]
        assert devs == {f"nvidia{uuids.index(card)}"}, text  # its own card's node, nobody else's
        assert uid == ("65534" if os.geteuid() == 0 else str(os.getuid()))
        seen.append(card)
