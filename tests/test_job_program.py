"""The job spec carries the program (issue #32 item 1): what a request may ask to run, what the gateway refuses and
why, what a placement carries to the node, and the CLI's flags and job file."""
from __future__ import annotations

import orjson
import pytest
from hypothesis import given, settings, strategies as st
from pydantic import ValidationError

from agents.cli import parser
from agents.cli.requests import job_request
from agents.scheduler.core import Scheduler
from infra.config import Volume, parse_volumes
from schemas.events import JobRequested, PlaceJob, QuotaSet
from schemas.program import Mount, reserved_env
from streams.folds import gateway
from tests.builders import Clock, inventory

ALICE = gateway.Principal("alice", "tenant", "acme")
VOLUMES = {"datasets": Volume("datasets", "/srv/datasets", True), "scratch": Volume("scratch", "/srv/scratch", False)}


def _admit(**program):
    doc = {"kind": "job.requested", "job_id": "j1", "compute_milli": 1000, "gpu_memory_mib": 1024, **program}
    return gateway.admit(ALICE, "alice", orjson.dumps(doc), 7, 1_000, volumes=VOLUMES)


def _refusal(out) -> tuple[str, str]:
    assert out.accepted is None and out.rejected is not None, out
    p = out.rejected.payload
    return p.code, p.reasons[0].message


def test_a_program_is_admitted_with_its_image_argv_env_workdir_volumes_and_retries():
    out = _admit(image="localhost/train:1", command=["python", "train.py", "--lr", "3e-4; rm -rf /"],
                 env={"LR": "3e-4", "HF_HOME": "/data/hf"}, workdir="/workspace",
                 volumes=[{"volume": "datasets", "path": "/data"}, {"volume": "scratch", "path": "/scratch",
                                                                    "read_only": False}], retries=2)
    r = out.accepted.payload
    # an argument that looks like shell is only an argument: nothing runs a shell over the argv
    assert r.command == ("python", "train.py", "--lr", "3e-4; rm -rf /") and r.image == "localhost/train:1"
    assert r.env == {"LR": "3e-4", "HF_HOME": "/data/hf"} and r.workdir == "/workspace" and r.retries == 2
    assert r.volumes == (Mount(volume="datasets", path="/data"), Mount(volume="scratch", path="/scratch",
                                                                       read_only=False))


@pytest.mark.parametrize("name", ["GPUPOOL_JOB_ID", "GPUPOOL_ANYTHING", "CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES",
                                  "LD_PRELOAD", "CUDA_DEVICE_MEMORY_LIMIT_0", "CUDA_DEVICE_SM_LIMIT",
                                  "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "PET_NNODES", "MASTER_ADDR", "RANK"])
def test_a_name_the_pool_sets_itself_is_refused_with_a_reason(name):
    code, why = _refusal(_admit(command=["python", "train.py"], env={name: "x"}))
    assert code == "invalid" and f"env: {name} is set by the pool itself" in why


def test_a_host_path_is_never_a_volume():
    # the contract takes names only: a path where the name goes is not a volume's name
    code, why = _refusal(_admit(command=["true"], volumes=[{"volume": "/etc", "path": "/x"}]))
    assert code == "invalid" and why.startswith("volumes.0.volume")
    # a name off the operator's list, and a read-only volume asked read-write
    code, why = _refusal(_admit(command=["true"], volumes=[{"volume": "home", "path": "/x"}]))
    assert code == "unknown_volume" and "'home' is not on the operator's list" in why and "datasets, scratch" in why
    code, why = _refusal(_admit(command=["true"], volumes=[{"volume": "datasets", "path": "/x", "read_only": False}]))
    assert code == "read_only_volume"
    # nor over a system directory or the pool's own
    for path in ("/", "/proc", "/etc/passwd", "/dev/nvidia0", "/gpupool/checkpoints", "/data/../etc"):
        code, why = _refusal(_admit(command=["true"], volumes=[{"volume": "datasets", "path": path}]))
        assert code == "invalid", path


@pytest.mark.parametrize("argv0", ["python train.py; rm -rf /", "sh -c id", "$(id)", "`id`", "a|b", "x>y", ""])
def test_a_shell_line_as_the_program_is_refused_with_a_reason(argv0):
    code, why = _refusal(_admit(command=[argv0, "x"]))
    assert code == "invalid" and "is not a program name" in why and "never through a shell" in why


def test_sizes_and_characters_are_bounded():
    assert _refusal(_admit(command=["echo"] + ["x"] * 1024))[1].startswith("command: at most 1024 arguments")
    assert "NUL" in _refusal(_admit(command=["echo", "a\x00b"]))[1]
    assert "not a variable name" in _refusal(_admit(command=["true"], env={"1X": "y"}))[1]
    assert "at most 128 variables" in _refusal(_admit(command=["true"], env={f"V{i}": "" for i in range(129)}))[1]
    assert _refusal(_admit(command=["true"], workdir="relative/dir"))[0] == "invalid"
    assert "need a command" in _refusal(_admit(env={"A": "1"}))[1]
    assert _refusal(_admit(command=["true"], retries=11))[0] == "invalid"
    assert _refusal(_admit(command=["true"], retries=True))[0] == "invalid"
    assert _refusal(_admit(image="UPPER CASE", command=["true"]))[0] == "invalid"


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.text(min_size=1, max_size=12), st.text(max_size=20), max_size=4),
       st.lists(st.text(max_size=20), min_size=1, max_size=4))
def test_every_program_is_admitted_or_refused_with_a_reason(env, argv):
    out = _admit(command=argv, env=env)
    if out.accepted is not None:
        r = out.accepted.payload
        assert not any(reserved_env(k) for k in r.env) and r.command == tuple(argv)
    else:
        assert out.rejected.payload.reasons[0].message


def test_the_placement_carries_the_program_to_the_node():
    clock = Clock()
    s = Scheduler()
    s.step(clock.env(QuotaSet(tenant="acme", gpu_milli=100_000), "in/admin/acme"))
    s.step(clock.env(inventory("n1", gpus=2), "n1/inventory"))
    out = s.step(clock.env(JobRequested(job_id="acme/j", tenant="acme", tier="online-training", compute_milli=500,
                                        gpu_memory_mib=4096, image="localhost/train:1",
                                        command=("python", "train.py"), env={"LR": "1"}, workdir="/w",
                                        volumes=(Mount(volume="datasets", path="/data"),)), "in/alice/acme/j"))
    place = next(e.payload for e in out if isinstance(e.payload, PlaceJob))
    assert (place.image, place.command, place.env, place.workdir, place.volumes, place.tier) == (
        "localhost/train:1", ("python", "train.py"), {"LR": "1"}, "/w", (Mount(volume="datasets", path="/data"),),
        "online-training")


def _cli(argv: list[str]) -> JobRequested:
    program = []
    if "--" in argv:
        argv, program = argv[:argv.index("--")], argv[argv.index("--") + 1:]
    args, _ = parser().parse_known_args(argv)
    args.program = program
    return job_request(args, "j1", "acme")


def test_the_cli_takes_the_program_after_the_double_dash_and_a_job_file(tmp_path):
    r = _cli(["submit", "--compute", "500", "--memory-gib", "8", "--image", "localhost/t:1", "--env", "A=1=2",
              "--volume", "datasets:/data", "--", "python", "train.py", "--lr", "3e-4"])
    assert r.command == ("python", "train.py", "--lr", "3e-4") and r.env == {"A": "1=2"}
    assert r.volumes == (Mount(volume="datasets", path="/data", read_only=True),) and r.image == "localhost/t:1"
    job = tmp_path / "job.yaml"
    job.write_text("compute: 250\nmemory-gib: 2\ntier: online-training\nimage: localhost/t:2\n"
                   "command: [python, -c, 'print(1)']\nenv: {SEED: 7}\nvolumes: ['scratch:/s:rw']\nretries: 3\n"
                   "workdir: /w\n")
    r = _cli(["submit", "-f", str(job)])
    assert (r.compute_milli, r.gpu_memory_mib, r.tier, r.image, r.command, r.env, r.retries, r.workdir) == (
        250, 2048, "online-training", "localhost/t:2", ("python", "-c", "print(1)"), {"SEED": "7"}, 3, "/w")
    assert r.volumes == (Mount(volume="scratch", path="/s", read_only=False),)
    # a flag on the command line wins over the file's key, the argv after -- over the file's command
    r = _cli(["submit", "-f", str(job), "--retries", "0", "--compute", "100", "--", "echo", "hi"])
    assert (r.retries, r.compute_milli, r.command, r.image) == (0, 100, ("echo", "hi"), "localhost/t:2")


def test_a_job_file_with_an_unknown_key_or_a_shell_string_is_refused_in_words(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text("compute: 250\nmemory-gib: 2\nimgae: x\n")
    with pytest.raises(SystemExit, match="unknown key 'imgae'"):
        _cli(["submit", "-f", str(job)])
    job.write_text("compute: 250\nmemory-gib: 2\ncommand: python train.py\n")
    with pytest.raises(SystemExit, match="a list of arguments"):
        _cli(["submit", "-f", str(job)])
    with pytest.raises(SystemExit, match="--compute is required"):
        _cli(["submit", "--memory-gib", "1", "--", "true"])
    with pytest.raises(SystemExit, match="never a host path"):
        _cli(["submit", "--compute", "1", "--memory-gib", "1", "--volume", "/etc:/x", "--", "true"])
    with pytest.raises(ValidationError, match="set by the pool itself"):
        _cli(["submit", "--compute", "1", "--memory-gib", "1", "--env", "LD_PRELOAD=/x.so", "--", "true"])


def test_the_operators_volume_list_is_read_strictly():
    assert parse_volumes("datasets=/srv/d:ro, scratch=/srv/s:rw,models=/m") == {
        "datasets": Volume("datasets", "/srv/d", True), "scratch": Volume("scratch", "/srv/s", False),
        "models": Volume("models", "/m", True)}
    assert parse_volumes('{"d": {"host_path": "/srv/d", "read_only": false}}') == {"d": Volume("d", "/srv/d", False)}
    for bad in ("datasets", "d=relative", "d=/x:rx"):
        with pytest.raises(ValueError):
            parse_volumes(bad)
