"""The runner every node agent shares (agents/node/runner.py): what a placement runs and how, on real processes and
real podman containers (issue #32 items 2, 3, 5 and 7, node side).

Pure parts first (names, the environment contract, the manifest, exit classification, the podman command line), then
plain processes as the unprivileged job user, then containers with CDI devices. The container tests need podman,
runc and catatonit (`make podman`): without them they fail saying so (tests/program_helpers.py)."""
from __future__ import annotations

import asyncio
import json
import os
import textwrap
from pathlib import Path

import pytest

from agents.node.runner import (
    DEFAULT_GRACE_S,
    CONTAINER_CHECKPOINT_DIR, Exit, NodeContext, Run, cdi_devices, cdi_known, checkpoint_dir, container_name,
    exit_of_container, exit_of_status, job_path, parse_grace, parse_ulimits, parse_user, pool_environment,
    program_environment, read_manifest, work_dir,
)
from infra.config import Volume
from schemas.events import Assignment, PlaceJob, Tier
from schemas.program import Mount
from tests.program_helpers import busybox_image, cdi_spec, need_python3, passable_dir, podman

GPU = (Assignment(gpu_uuid="GPU-aaaa", milli=1000, memory_mib=1024),)
MIG = (Assignment(gpu_uuid="GPU-mig0", milli=428, memory_mib=40960, mig_profile="3g.40gb", mig_uuid="MIG-1111"),)


def place(job="acme/train", command=(), *, image=None, assignments=GPU, attempt=1, env=None, **kw) -> PlaceJob:
    return PlaceJob(command_id=f"c-{attempt}", job_id=job, tenant=job.split("/")[0], node="n1",
                    assignments=assignments, attempt=attempt, command=tuple(command), image=image, env=env or {}, **kw)


def ctx_at(root: Path, **kw) -> NodeContext:
    kw.setdefault("podman", None)
    kw.setdefault("manifest_poll_s", 0.1)
    return NodeContext(node="n1", jobs_root=root / "jobs", checkpoint_root=root / "checkpoints", **kw)


def run(coro, timeout: float = 120):
    return asyncio.run(asyncio.wait_for(coro, timeout))


class Collect:
    """An Output and an on_checkpoint that keep what they get."""

    def __init__(self):
        self.data: dict[str, bytes] = {"stdout": b"", "stderr": b""}
        self.eof: list[str] = []
        self.checkpoints: list[tuple[str, int]] = []
        self.keys: set[tuple] = set()

    async def __call__(self, job_id, attempt, part, stream, data, eof):
        self.keys.add((job_id, attempt, part))
        self.data[stream] += data
        if eof:
            self.eof.append(stream)

    def checkpoint(self, ckpt, ms):
        self.checkpoints.append((ckpt, ms))


async def start_and_wait(p: PlaceJob, ctx: NodeContext, out: Collect | None = None) -> tuple[Exit, Run]:
    out = out or Collect()
    r = Run(p, ctx, output=out, on_checkpoint=out.checkpoint)
    failed = await r.start()
    return (failed if failed is not None else await r.wait()), r


async def wait_file(path: Path, timeout: float = 60) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not path.exists() or not path.stat().st_size:
        if loop.time() > end:
            raise AssertionError(f"{path} never appeared")
        await asyncio.sleep(0.05)


# ---------------------------------------------------------------- pure

def test_job_path_keeps_tenant_dirs_and_never_climbs():
    assert job_path("acme/train") == Path("acme/train")
    assert job_path("acme/../../etc") == Path("acme/%2E%2E/%2E%2E/etc")
    assert job_path("/abs") == Path("%/abs") and job_path("a//b") == Path("a/%/b")
    assert job_path("a b") == Path("a%20b") and job_path("a%b") == Path("a%25b") != job_path("a%25b")
    assert job_path("数据/x") == Path("%E6%95%B0%E6%8D%AE/x")
    long = job_path("t/" + "x" * 190)
    assert len(long.parts[1]) <= 120 and long != job_path("t/" + "x" * 189 + "y")
    assert all(part not in (".", "..", "") for part in job_path("./..").parts)


def test_run_places_per_node_job_attempt_and_part(tmp_path):
    ctx = ctx_at(tmp_path)
    p = place(attempt=3)
    assert work_dir(p, ctx) == tmp_path / "jobs/n1/acme/train/attempt-3"
    gang = place(attempt=2, gang_size=2, gang_index=1, gang_nodes=("n0", "n1"))
    assert work_dir(gang, ctx) == tmp_path / "jobs/n1/acme/train/attempt-2-part-1"
    assert checkpoint_dir(p, ctx) == tmp_path / "checkpoints/acme/train"  # one per job: attempts resume from it
    assert checkpoint_dir(gang, ctx) == tmp_path / "checkpoints/acme/train/part-1"


def test_container_name_is_per_job_attempt_and_part():
    a, b = container_name("acme/train", 1), container_name("acme/train", 2)
    assert a.startswith("gpupool-acme-train-") and a.endswith("-a1-p0") and a != b
    assert container_name("acme/train", 1, 1) != a and container_name("acme/train!", 1) != a
    assert all(c.isalnum() or c in "_.-" for c in container_name("数据/../x y", 7))


def test_pool_environment_is_the_contract(tmp_path):
    ctx = ctx_at(tmp_path)
    env = pool_environment(place(resume_from="step-40.ckpt", gang_size=2, gang_index=1, gang_nodes=("n0", "n1"),
                                 tier=Tier.ONLINE_TRAINING), ctx)
    ck = str(tmp_path / "checkpoints/acme/train/part-1")
    assert env == {"GPUPOOL_JOB_ID": "acme/train", "GPUPOOL_TENANT": "acme", "GPUPOOL_ATTEMPT": "1",
                   "GPUPOOL_PART": "1", "GPUPOOL_PARTS": "2", "GPUPOOL_NODE": "n1", "GPUPOOL_TIER": "online-training",
                   "GPUPOOL_CHECKPOINT_DIR": ck, "GPUPOOL_RESUME_FROM": f"{ck}/step-40.ckpt",
                   "CUDA_VISIBLE_DEVICES": "GPU-aaaa", "NVIDIA_VISIBLE_DEVICES": "GPU-aaaa"}
    assert pool_environment(place(assignments=MIG), ctx)["CUDA_VISIBLE_DEVICES"] == "MIG-1111"
    # a job given no card sees none, and says so the way the NVIDIA container stack reads it
    none = pool_environment(place(assignments=()), ctx)
    assert (none["CUDA_VISIBLE_DEVICES"], none["NVIDIA_VISIBLE_DEVICES"]) == ("", "void")
    # in a container the checkpoint directory is where it is mounted; an absolute checkpoint stays as it was
    c = pool_environment(place(image="img", resume_from="/data/ck/7"), ctx)
    assert (c["GPUPOOL_CHECKPOINT_DIR"], c["GPUPOOL_RESUME_FROM"]) == (CONTAINER_CHECKPOINT_DIR, "/data/ck/7")
    assert pool_environment(place(), ctx)["GPUPOOL_RESUME_FROM"] == ""


def test_a_plain_process_gets_only_the_pool_and_its_own_variables(tmp_path, monkeypatch):
    monkeypatch.setenv("AGENT_SECRET", "x")
    env = program_environment(place(env={"LR": "3e-4", "PATH": "/opt/mine"}), ctx_at(tmp_path), "/w")
    assert "AGENT_SECRET" not in env and env["LR"] == "3e-4" and env["PATH"] == "/opt/mine"
    assert env["HOME"] == "/w" and env["GPUPOOL_JOB_ID"] == "acme/train"
    assert set(env) - set(pool_environment(place(), ctx_at(tmp_path))) == {"LR", "PATH", "HOME", "LANG"}


def test_cdi_names_of_cards_and_mig_instances():
    assert cdi_devices(GPU + (Assignment(gpu_uuid="GPU-bbbb", milli=500, memory_mib=1),)) == \
        ["nvidia.com/gpu=GPU-aaaa", "nvidia.com/gpu=GPU-bbbb"]
    assert cdi_devices(MIG) == ["nvidia.com/gpu=MIG-1111"] and cdi_devices(()) == []


def test_cdi_known_reads_json_and_yaml_specs(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps({"cdiVersion": "0.5.0", "kind": "nvidia.com/gpu",
                                                 "devices": [{"name": "GPU-1", "containerEdits": {}}]}))
    (tmp_path / "b.yaml").write_text("cdiVersion: 0.5.0\nkind: nvidia.com/gpu\ndevices:\n- name: MIG-2\n"
                                     "  containerEdits: {}\n")
    (tmp_path / "bad.json").write_text("{")
    assert cdi_known((tmp_path, tmp_path / "missing")) == {"nvidia.com/gpu=GPU-1", "nvidia.com/gpu=MIG-2"}


def test_configuration_parsing_and_its_errors():
    # the scheduler's grammar (infra/config.py): one number for every tier, or TIER=SECONDS
    assert parse_grace("") == {} and parse_grace("25") == {"inference": 25, "online-training": 25, "offline": 25}
    assert parse_grace("offline=60,inference=5") == {"offline": 60, "inference": 5}
    ctx = NodeContext.from_env("n1", Path("/tmp"), environ={"GPUPOOL_GRACE_S": "offline=60"})
    assert ctx.grace_for("offline") == 60 and ctx.grace_for("inference") == DEFAULT_GRACE_S
    assert ctx.grace_for("offline", 5) == 5  # a command's grace, set by the scheduler from the tier's, wins
    for bad in ("batch=5", "offline=-1", "offline", "*=20"):
        with pytest.raises(ValueError):
            parse_grace(bad)
    assert parse_ulimits("nofile=8192") == {"nofile": 8192, "nproc": 4096, "core": 0}
    with pytest.raises(ValueError):
        parse_ulimits("stack=1")
    assert parse_user("1000:1001") == (1000, 1001) and parse_user("4242") == (4242, 4242)
    for bad in ("0:0", "root", "1000:0"):
        with pytest.raises(ValueError):
            parse_user(bad)
    ctx = NodeContext(node="n", jobs_root=Path("/j"), checkpoint_root=Path("/c"), grace={"offline": 60})
    assert (ctx.grace_for(Tier.OFFLINE), ctx.grace_for("inference")) == (60.0, DEFAULT_GRACE_S)
    assert ctx.grace_for("offline", 15.0) == 15.0  # a command's grace (the scheduler's, from the tier's) wins
    bare = NodeContext(node="n", jobs_root=Path("/j"), checkpoint_root=Path("/c"))
    assert (bare.grace_for("offline"), bare.grace_for("offline", 12.0)) == (DEFAULT_GRACE_S, 12.0)


def test_node_context_from_the_environment(tmp_path):
    env = {"GPUPOOL_CHECKPOINT_ROOT": "/shared/ck", "GPUPOOL_PODMAN": "none", "GPUPOOL_GRACE_S": "offline=45",
           "GPUPOOL_JOB_NETWORK": "host", "GPUPOOL_CDI_SPEC_DIRS": "/a:/b", "GPUPOOL_PULL": "1"}
    ctx = NodeContext.from_env("n7", tmp_path, environ=env)
    assert (ctx.jobs_root, ctx.checkpoint_root, ctx.podman, ctx.network, ctx.pull) == \
        (tmp_path / "jobs", Path("/shared/ck"), None, "host", True)
    assert ctx.cdi_spec_dirs == (Path("/a"), Path("/b")) and ctx.grace_for("offline") == 45.0
    assert ctx.user == ((65534, 65534) if os.geteuid() == 0 else None)
    if os.geteuid() == 0:
        with pytest.raises(ValueError, match="GPUPOOL_JOB_USER"):
            NodeContext.from_env("n7", tmp_path, environ={"GPUPOOL_JOB_USER": "0:0"})
    with pytest.raises(ValueError, match="GPUPOOL_GRACE_S"):
        NodeContext.from_env("n7", tmp_path, environ={"GPUPOOL_GRACE_S": "batch=3"})


def test_read_manifest(tmp_path):
    m = tmp_path / "checkpoint.json"
    assert read_manifest(m) is None
    for text, want in [('{"path": "step-40.pt", "progress_ms": 4000, "step": 40}', ("step-40.pt", 4000)),
                       ('{"path": "/data/ck/9"}', ("/data/ck/9", 0)),
                       ('{"path": "x", "progress_ms": -5}', ("x", 0)),
                       ('{"path": "x", "progress_ms": true}', ("x", 0)),
                       ('{"path": ""}', None), ('{"path": "a\\nb"}', None), ('{"step": 3}', None),
                       ('["x"]', None), ('{"path": "half', None)]:
        m.write_text(text)
        assert read_manifest(m) == want, text
    # never through a symbolic link (the directory is the job's; the agent reading it may be root)
    target = tmp_path / "elsewhere.json"
    target.write_text('{"path": "secret"}')
    m.unlink()
    m.symlink_to(target)
    assert read_manifest(m) is None
    m.unlink()
    m.mkdir()
    assert read_manifest(m) is None


def test_exit_classification():
    assert exit_of_status(0).ok
    assert exit_of_status(3) == Exit("ExitCode", "exit code 3", exit_code=3)
    assert exit_of_status(-9) == Exit("Signal", "killed by signal 9 (SIGKILL)", signal=9)
    assert exit_of_status(-9, oom=True).code == "OOMKilled"
    assert exit_of_container(0, {"ExitCode": 0}, "").ok
    assert exit_of_container(137, {"ExitCode": 137, "OOMKilled": True}, "").code == "OOMKilled"
    assert exit_of_container(139, {"ExitCode": 139}, "") == Exit("Signal", "killed by signal 11 (SIGSEGV)", signal=11)
    assert exit_of_container(4, {"ExitCode": 4}, "Error: not podman's, the program's\n").code == "ExitCode"
    nf = exit_of_container(1, {"ExitCode": 1}, "ERROR (catatonit:6): failed to exec pid1: No such file or directory\n")
    assert nf.code == "CommandNotFound"
    assert exit_of_container(127, {}, "Error: crun: executable file `nope` not found in $PATH: OCI runtime "
                                      "attempted to invoke a command that was not found\n").code == "CommandNotFound"
    assert exit_of_container(125, {}, "Error: something broke\n").code == "StartFailed"
    assert exit_of_container(1, {"ExitCode": 1}, "plain output\n") == Exit("ExitCode", "exit code 1", exit_code=1)


def test_podman_command_line(tmp_path):
    vols = {"datasets": Volume("datasets", str(tmp_path), True)}
    ctx = ctx_at(tmp_path, podman="/usr/bin/podman", init_path="/usr/libexec/podman/catatonit", volumes=vols,
                 user=(65534, 65534))
    p = place(image="localhost/img:1", command=("python", "train.py", "--lr", "3e-4; rm -rf /"), attempt=4,
              env={"LR": "1"}, workdir="/work", volumes=(Mount(volume="datasets", path="/data"),), memory_mib=512,
              assignments=GPU + MIG)
    r = Run(p, ctx)
    argv = r.container_argv([(vols["datasets"], "/data", True)])
    pairs = list(zip(argv, argv[1:]))
    assert argv[:2] == ["/usr/bin/podman", "run"] and "--privileged" not in argv and "--rm" not in argv
    for want in [("--runtime", "runc"), ("--user", "65534:65534"), ("--cap-drop", "all"),
                 ("--security-opt", "no-new-privileges"), ("--network", "none"), ("--ulimit", "nofile=4096:4096"),
                 ("--ulimit", "nproc=4096:4096"), ("--pull", "never"), ("--name", r.name), ("-w", "/work"),
                 ("--device", "nvidia.com/gpu=GPU-aaaa"), ("--device", "nvidia.com/gpu=MIG-1111"),
                 ("-v", f"{tmp_path}:/data:ro"), ("-v", f"{r.ckpt_dir}:{CONTAINER_CHECKPOINT_DIR}:rw"),
                 ("--memory", "512m"), ("--init-path", "/usr/libexec/podman/catatonit"), ("-e", "LR=1"),
                 ("-e", "GPUPOOL_CHECKPOINT_DIR=/gpupool/checkpoint"), ("-e", "GPUPOOL_ATTEMPT=4")]:
        assert want in pairs, want
    # the argv goes to podman as separate items after the image, never through a shell
    assert argv[-5:] == ["localhost/img:1", "python", "train.py", "--lr", "3e-4; rm -rf /"]
    assert r.name == container_name("acme/train", 4)


# ---------------------------------------------------------------- plain processes

PROBE = textwrap.dedent("""
    import json, os, resource, sys
    status = dict(l.split(":", 1) for l in open("/proc/self/status") if ":" in l)
    print(json.dumps({
        "uid": os.getuid(), "gid": os.getgid(), "groups": os.getgroups(), "cwd": os.getcwd(),
        "env": dict(os.environ), "nnp": status.get("NoNewPrivs", "").strip(),
        "sid_is_pid": os.getsid(0) == os.getpid(), "pgid_is_pid": os.getpgid(0) == os.getpid(),
        "nofile": resource.getrlimit(resource.RLIMIT_NOFILE), "core": resource.getrlimit(resource.RLIMIT_CORE),
        "argv": sys.argv[1:], "ckpt_writable": os.access(os.environ["GPUPOOL_CHECKPOINT_DIR"], os.W_OK),
        "cap_eff": status.get("CapEff", "").strip()}))
    print("to stderr", file=sys.stderr)
""")


@pytest.fixture
def root():
    with passable_dir() as d:
        yield d


def test_a_plain_process_runs_as_the_job_user_with_only_its_environment(root, monkeypatch):
    python = need_python3()
    monkeypatch.setenv("AGENT_SECRET", "hunter2")
    ctx = ctx_at(root, user=(65534, 65534), ulimits={"nofile": 512, "nproc": 4096, "core": 0})
    p = place("acme/probe", (python, "-c", PROBE, "a b", "$(id)", "; echo"), env={"LR": "3e-4"}, attempt=2)
    out = Collect()
    ended, r = run(start_and_wait(p, ctx, out))
    assert ended.ok, (ended, out.data)
    seen = json.loads(out.data["stdout"])
    assert (seen["uid"], seen["gid"], seen["groups"]) == (65534, 65534, []) or os.geteuid() != 0
    assert seen["cwd"] == str(root / "jobs/n1/acme/probe/attempt-2")
    assert seen["argv"] == ["a b", "$(id)", "; echo"]  # as given: no shell ever saw them
    assert "AGENT_SECRET" not in seen["env"] and seen["env"]["LR"] == "3e-4"
    assert seen["env"]["GPUPOOL_JOB_ID"] == "acme/probe" and seen["env"]["GPUPOOL_ATTEMPT"] == "2"
    assert seen["env"]["CUDA_VISIBLE_DEVICES"] == seen["env"]["NVIDIA_VISIBLE_DEVICES"] == "GPU-aaaa"
    assert seen["env"]["GPUPOOL_CHECKPOINT_DIR"] == str(root / "checkpoints/acme/probe") and seen["ckpt_writable"]
    assert seen["nnp"] == "1" and seen["cap_eff"] == "0000000000000000"
    assert seen["sid_is_pid"] and seen["pgid_is_pid"]
    assert seen["nofile"] == [512, 512] and seen["core"] == [0, 0]
    assert out.data["stderr"] == b"to stderr\n" and sorted(out.eof) == ["stderr", "stdout"]
    assert out.keys == {("acme/probe", 2, 0)}


def test_default_output_is_the_attempts_log_file(root):
    python = need_python3()
    ctx = ctx_at(root, user=(65534, 65534))
    p = place("acme/logs", (python, "-c", "import sys; print('out'); sys.stdout.flush(); print('err', file=sys.stderr)"))

    async def go():
        r = Run(p, ctx)
        assert await r.start() is None
        return await r.wait()

    assert run(go()).ok
    log = root / "jobs/n1/acme/logs/attempt-1.log"
    assert sorted(log.read_text().split()) == ["err", "out"] and (log.stat().st_mode & 0o777) == 0o600


@pytest.mark.parametrize("code,want", [
    ("raise SystemExit(7)", Exit("ExitCode", "exit code 7", exit_code=7)),
    ("import os, signal; os.kill(os.getpid(), signal.SIGSEGV)", Exit("Signal", "killed by signal 11 (SIGSEGV)",
                                                                    signal=11)),
])
def test_exit_code_and_signal_of_a_plain_process(root, code, want):
    ended, _ = run(start_and_wait(place(command=(need_python3(), "-c", code)), ctx_at(root, user=(65534, 65534))))
    assert ended == want
    f = ended.failed(place(attempt=1), "n1")
    assert (f.code, f.exit_code, f.signal, f.attempt, f.part) == (want.code, want.exit_code, want.signal, 1, 0)


def test_command_not_found_and_start_failures(root):
    ctx = ctx_at(root, user=(65534, 65534))
    ended, _ = run(start_and_wait(place(command=("no-such-trainer", "--x")), ctx))
    assert ended.code == "CommandNotFound" and "no-such-trainer" in ended.reason
    ended, _ = run(start_and_wait(place(command=("/opt/none/train",)), ctx))
    assert ended.code == "CommandNotFound"
    plain = root / "not-a-program"
    plain.write_text("data")
    os.chmod(plain, 0o644)
    ended, _ = run(start_and_wait(place(command=(str(plain),)), ctx))  # not executable
    assert ended.code == "StartFailed" and "Permission denied" in ended.reason
    ended, _ = run(start_and_wait(place(command=("true",), workdir="/nonexistent/dir"), ctx))
    assert ended.code == "StartFailed" and "/nonexistent/dir" in ended.reason


def test_volume_unavailable_and_a_plain_process_takes_no_volume(root):
    have = root / "datasets"
    have.mkdir()
    ctx = ctx_at(root, user=(65534, 65534), volumes={"datasets": Volume("datasets", str(have)),
                                                     "gone": Volume("gone", str(root / "missing"))})
    for mount, code, words in [(Mount(volume="gone", path="/data"), "VolumeUnavailable", "does not exist"),
                               (Mount(volume="other", path="/data"), "VolumeUnavailable", "allow-list"),
                               (Mount(volume="datasets", path="/data", read_only=False), "VolumeUnavailable",
                                "read-only"),
                               (Mount(volume="datasets", path="/data"), "StartFailed", "give the job an image")]:
        ended, _ = run(start_and_wait(place(command=("true",), volumes=(mount,)), ctx))
        assert (ended.code, words in ended.reason) == (code, True), ended


def test_an_image_without_podman_fails_saying_podman_is_needed(root):
    ended, _ = run(start_and_wait(place(image="localhost/x:1", command=("true",)), ctx_at(root, podman=None)))
    assert ended.code == "StartFailed" and "podman" in ended.reason and "runc" in ended.reason


def test_a_job_user_that_cannot_reach_its_directories_is_told_why(tmp_path):
    # pytest's tmp_path is root's own (0700): nobody cannot pass through it
    ended, _ = run(start_and_wait(place(command=("true",)), ctx_at(tmp_path, user=(65534, 65534))))
    if os.geteuid() == 0:
        assert ended.code == "StartFailed" and "cannot reach" in ended.reason and "GPUPOOL_JOBS_ROOT" in ended.reason


def test_out_of_memory_kill_of_a_plain_process(root):
    """The placement's memory is the run's memory cgroup limit; the kernel's kill is told apart from a signal."""
    code = "x = []\nwhile True: x.append(bytearray(8 << 20))"
    ended, r = run(start_and_wait(place(command=(need_python3(), "-c", code), memory_mib=48),
                                  ctx_at(root, user=(65534, 65534))))
    assert ended.code == "OOMKilled" and ended.signal == 9, ended


def test_stop_sigterm_grace_then_sigkill_and_the_manifest_reread_after_exit(root):
    """A program that checkpoints on SIGTERM and exits is a graceful stop; one that ignores SIGTERM is killed after
    the grace period. Either way the last manifest it wrote is the checkpoint, read again after it exited."""
    python = need_python3()
    polite = textwrap.dedent("""
        import json, os, signal, sys, time
        d = os.environ["GPUPOOL_CHECKPOINT_DIR"]
        def write(name, ms):
            open(d + "/m.tmp", "w").write(json.dumps({"path": name, "progress_ms": ms}))
            os.rename(d + "/m.tmp", d + "/checkpoint.json")
        def term(*_):
            write("on-term.ckpt", 900)
            sys.exit(0)
        signal.signal(signal.SIGTERM, term)
        write("step-1.ckpt", 100)
        open(d + "/ready", "w").write("1")
        time.sleep(300)
    """)
    stubborn = textwrap.dedent("""
        import json, os, signal, time
        d = os.environ["GPUPOOL_CHECKPOINT_DIR"]
        def term(*_):
            open(d + "/got-term", "w").write("TERM")
        signal.signal(signal.SIGTERM, term)
        open(d + "/m.tmp", "w").write(json.dumps({"path": "step-2.ckpt", "progress_ms": 200}))
        os.rename(d + "/m.tmp", d + "/checkpoint.json")
        open(d + "/ready", "w").write("1")
        while True:
            time.sleep(1)
    """)
    ctx = ctx_at(root, user=(65534, 65534))

    async def go(job, code, grace):
        out = Collect()
        p = place(job, (python, "-c", code))
        r = Run(p, ctx, output=out, on_checkpoint=out.checkpoint)
        assert await r.start() is None
        await wait_file(checkpoint_dir(p, ctx) / "ready")
        ended = await r.stop(grace)
        return ended, out, r

    ended, out, r = run(go("acme/polite", polite, 60))
    assert ended.stopped and ended.graceful and ended.code is None
    assert r.checkpoint == "on-term.ckpt" and out.checkpoints[-1] == ("on-term.ckpt", 900)
    ended, out, r = run(go("acme/stubborn", stubborn, 1))
    assert ended.stopped and not ended.graceful and ended.signal == 9  # SIGKILL after the grace period
    assert (checkpoint_dir(place("acme/stubborn"), ctx) / "got-term").read_text() == "TERM"  # SIGTERM came first
    assert r.checkpoint == "step-2.ckpt" and ("step-2.ckpt", 200) in out.checkpoints


def test_a_stale_manifest_of_an_earlier_attempt_is_not_reported_again(root):
    ctx = ctx_at(root, user=(65534, 65534))
    p = place("acme/again", (need_python3(), "-c", "import time; time.sleep(0.5)"), attempt=2,
              resume_from="old.ckpt")
    d = checkpoint_dir(p, ctx)
    d.mkdir(parents=True)
    (d / "checkpoint.json").write_text('{"path": "old.ckpt"}')
    out = Collect()
    ended, r = run(start_and_wait(p, ctx, out))
    assert ended.ok and out.checkpoints == [] and r.checkpoint == ""


def test_the_jobs_leftover_processes_die_with_it(root):
    """A program that leaves a child behind: the child (its process group) is killed when the program ends, and its
    output pipe does not keep the run open."""
    pidfile = "pid"
    code = (f"import subprocess; c = subprocess.Popen(['sleep', '300']); open('{pidfile}', 'w').write(str(c.pid))")
    ctx = ctx_at(root, user=(65534, 65534))
    p = place("acme/leftover", (need_python3(), "-c", code))
    ended, r = run(start_and_wait(p, ctx))
    assert ended.ok
    child = int((work_dir(p, ctx) / pidfile).read_text())

    def alive(pid):
        try:
            return Path(f"/proc/{pid}/stat").read_text().split(")")[1].split()[0] != "Z"
        except OSError:
            return False

    async def gone():
        while alive(child):
            await asyncio.sleep(0.05)

    run(gone(), 30)


def test_kill_is_immediate_and_reports_stopped_without_grace(root):
    ctx = ctx_at(root, user=(65534, 65534))
    p = place("acme/lost", (need_python3(), "-c", "import signal, time; signal.signal(signal.SIGTERM, "
                                                  "signal.SIG_IGN); time.sleep(300)"))

    async def go():
        r = Run(p, ctx)
        assert await r.start() is None
        await r.kill()
        return await r.wait()

    ended = run(go(), 30)
    assert ended.stopped and ended.signal == 9


# ---------------------------------------------------------------- containers

@pytest.fixture
def image():
    podman()
    return busybox_image()


def container_ctx(root: Path, **kw) -> NodeContext:
    from agents.node.runner import find_init

    return ctx_at(root, podman=podman(), init_path=find_init(os.environ), user=(65534, 65534), **kw)


def test_a_container_sees_its_own_devices_and_not_another_jobs(root, image):
    """Two jobs on one node, each given one card: each container has its card's device node (from the CDI spec) and
    not the other's, runs as 65534 without capabilities, and sees the pool's environment."""
    tag = os.urandom(4).hex()
    a_uuid, b_uuid = f"GPU-test-{tag}-a", f"GPU-test-{tag}-b"
    show = ("sh", "-c", "ls /dev; echo; id -u; id -g; grep CapEff /proc/self/status; env | sort; "
                        "touch $GPUPOOL_CHECKPOINT_DIR/w && echo ckpt-writable")
    with cdi_spec([a_uuid, b_uuid], root):
        ctx = container_ctx(root, cdi_spec_dirs=(Path("/var/run/cdi"),))
        a = place("acme/a", show, image=image, assignments=(Assignment(gpu_uuid=a_uuid, milli=1000, memory_mib=1),))
        b = place("acme/b", show, image=image, assignments=(Assignment(gpu_uuid=b_uuid, milli=1000, memory_mib=1),))
        none = place("acme/none", show, image=image, assignments=())

        outs = []
        for p in (a, b, none):
            out = Collect()
            ended, _ = run(start_and_wait(p, ctx, out))
            assert ended.ok, (ended, out.data)
            outs.append(out.data["stdout"].decode())
    devs = [o.split("\n\n")[0].split() for o in outs]
    assert "nvidia0" in devs[0] and "nvidia1" not in devs[0]
    assert "nvidia1" in devs[1] and "nvidia0" not in devs[1]
    assert not any(d.startswith("nvidia") for d in devs[2])
    for o in outs:
        lines = o.split("\n\n", 1)[1].splitlines()
        assert lines[:3] == ["65534", "65534", "CapEff:\t0000000000000000"] and "ckpt-writable" in lines
    assert f"CUDA_VISIBLE_DEVICES={a_uuid}" in outs[0] and "GPUPOOL_CHECKPOINT_DIR=/gpupool/checkpoint" in outs[0]
    assert "NVIDIA_VISIBLE_DEVICES=void" in outs[2] and "CUDA_VISIBLE_DEVICES=\n" in outs[2]


def test_a_container_with_a_device_the_node_has_no_spec_for_does_not_start(root, image):
    ctx = container_ctx(root, cdi_spec_dirs=(root / "no-specs",))
    ended, _ = run(start_and_wait(place(command=("true",), image=image), ctx))
    assert ended.code == "StartFailed" and "nvidia-ctk cdi generate" in ended.reason


@pytest.mark.parametrize("command,code,detail", [
    (("sh", "-c", "exit 5"), "ExitCode", ("exit_code", 5)),
    (("sh", "-c", "kill -SEGV $$"), "Signal", ("signal", 11)),
    (("no-such-trainer",), "CommandNotFound", ("exit_code", 127)),
    (("sh", "-c", "x=$(head -c 200000000 /dev/zero | tr '\\0' a); echo ${#x}"), "OOMKilled", ("signal", 9)),
])
def test_container_exit_reasons(root, image, command, code, detail):
    ctx = container_ctx(root)
    ended, _ = run(start_and_wait(place(command=command, image=image, assignments=(), memory_mib=24), ctx))
    assert ended.code == code and getattr(ended, detail[0]) == detail[1], ended


def test_image_not_found_without_pulling(root, image):
    ended, _ = run(start_and_wait(place(command=("true",), image="localhost/gpupool-no-such-image:0", assignments=()),
                                  container_ctx(root)))
    assert ended.code == "ImageNotFound" and "does not pull" in ended.reason


def test_a_container_gets_its_allow_listed_volume_read_only(root, image):
    data = root / "datasets"
    data.mkdir()
    (data / "x.txt").write_text("hello\n")
    os.chmod(data, 0o755)
    os.chmod(data / "x.txt", 0o644)
    ctx = container_ctx(root, volumes={"datasets": Volume("datasets", str(data))})
    out = Collect()
    p = place(command=("sh", "-c", "cat /data/x.txt; touch /data/y 2>/dev/null && echo WROTE || echo read-only"),
              image=image, assignments=(), volumes=(Mount(volume="datasets", path="/data"),), workdir="/data")
    ended, _ = run(start_and_wait(p, ctx, out))
    assert ended.ok and out.data["stdout"].split() == [b"hello", b"read-only"]
    ended, _ = run(start_and_wait(p.model_copy(update={"volumes": (Mount(volume="scratch", path="/s"),)}), ctx))
    assert ended.code == "VolumeUnavailable"


def test_a_container_stop_reaches_the_program_then_kills_after_the_grace(root, image):
    """`podman stop -t GRACE`: SIGTERM reaches the program (not PID 1: catatonit forwards it); a program that ignores
    it is killed when the grace period is over. The manifest written on SIGTERM is the checkpoint."""
    polite = ("sh", "-c", "trap 'echo {\\\"path\\\": \\\"term.ckpt\\\", \\\"progress_ms\\\": 7} "
                          "> $GPUPOOL_CHECKPOINT_DIR/checkpoint.json; exit 0' TERM; "
                          "touch $GPUPOOL_CHECKPOINT_DIR/ready; while true; do sleep 1; done")
    stubborn = ("sh", "-c", "trap 'echo TERM > $GPUPOOL_CHECKPOINT_DIR/got-term' TERM; "
                            "touch $GPUPOOL_CHECKPOINT_DIR/ready; while true; do sleep 1; done")
    ctx = container_ctx(root)

    async def go(job, command, grace):
        p = place(job, command, image=image, assignments=())
        out = Collect()
        r = Run(p, ctx, output=out, on_checkpoint=out.checkpoint)
        assert await r.start() is None
        loop = asyncio.get_running_loop()
        end = loop.time() + 60
        while not (checkpoint_dir(p, ctx) / "ready").exists():
            assert loop.time() < end, out.data
            await asyncio.sleep(0.05)
        return await r.stop(grace), r, p

    ended, r, _ = run(go("acme/cpolite", polite, 30))
    assert ended.stopped and ended.graceful and r.checkpoint == "term.ckpt" and r.progress_ms == 7
    ended, r, p = run(go("acme/cstubborn", stubborn, 1))
    assert ended.stopped and not ended.graceful
    assert (checkpoint_dir(p, ctx) / "got-term").read_text().strip() == "TERM"
    gone = os.popen(f"{podman()} container exists {r.name}; echo $?").read().strip()
    assert gone == "1"  # removed after it ended


def test_a_job_on_a_share_gets_its_limits_and_the_mechanisms_mounts(tmp_path):
    """The share hook: the runner hands a job on a software share the limits agents/node/shares.py computes for the
    node's enforcement (HAMi-core here), in its environment and, in a container, the library and lock directory."""
    from agents.node.fleet import make_node
    from agents.node.shares import ShareConfig

    cards = make_node("n1", "A100-80GB", 1).gpus
    share = (Assignment(gpu_uuid=cards[0].uuid, milli=250, memory_mib=8192),)
    ctx = ctx_at(tmp_path, cards=cards, podman="/usr/bin/podman", user=(65534, 65534),
                 shares=ShareConfig(mode="hami", hami_library="/usr/local/vgpu/libvgpu.so"))
    env = pool_environment(place(assignments=share), ctx)
    assert (env["CUDA_DEVICE_MEMORY_LIMIT_0"], env["CUDA_DEVICE_SM_LIMIT_0"]) == ("8192m", "25")
    assert env["LD_PRELOAD"] == "/usr/local/vgpu/libvgpu.so"
    assert env["CUDA_DEVICE_MEMORY_SHARED_CACHE"].startswith(str(work_dir(place(assignments=share), ctx)))
    whole = pool_environment(place(assignments=(Assignment(gpu_uuid=cards[0].uuid, milli=1000, memory_mib=1),)), ctx)
    assert not any(k.startswith("CUDA_DEVICE_") or k == "LD_PRELOAD" for k in whole)
    argv = Run(place(image="localhost/img:1", command=("true",), assignments=share), ctx).container_argv([])
    pairs = list(zip(argv, argv[1:]))
    assert ("-v", "/usr/local/vgpu/libvgpu.so:/usr/local/vgpu/libvgpu.so:ro") in pairs
    assert ("-v", "/tmp/vgpulock:/tmp/vgpulock:rw") in pairs
    assert ("-e", "LD_PRELOAD=/usr/local/vgpu/libvgpu.so") in pairs
