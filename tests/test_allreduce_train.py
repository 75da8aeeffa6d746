"""The shipped distributed example (infra/programs/allreduce_train.py) without the pool: three real processes on this
machine meet over TCP at the master's address, all-reduce every step and end with the digest an uninterrupted run
computes; one killed mid-run, the others say their peer is lost, stop on SIGTERM with a checkpoint, and a new attempt
resumes from the step every part has (docs/jobs.md, "Gangs")."""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from infra.programs import allreduce_train

PROGRAM = Path(allreduce_train.__file__)
WORLD = 3


def _free_port(addr: str = "127.0.0.2") -> int:
    with socket.socket() as s:
        s.bind((addr, 0))
        return s.getsockname()[1]


def _start(tmp: Path, rank: int, port: int, run: str, *args: str, resume: str = "") -> subprocess.Popen:
    d = tmp / f"part-{rank}"
    d.mkdir(exist_ok=True)
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "RANK": str(rank), "WORLD_SIZE": str(WORLD),
           "MASTER_ADDR": "127.0.0.2", "MASTER_PORT": str(port), "TORCHELASTIC_RUN_ID": run,
           "GPUPOOL_CHECKPOINT_DIR": str(d), "GPUPOOL_RESUME_FROM": resume}
    out = tmp / f"part-{rank}-{run}.out"  # a file, so a test can wait on what a part said while it runs
    with open(out, "w") as f:
        p = subprocess.Popen([sys.executable, str(PROGRAM), *args], env=env, stdout=f, stderr=subprocess.STDOUT)
    p.out_path = out
    return p


def _said(p: subprocess.Popen) -> str:
    return p.out_path.read_text()


def _wait_for(what, timeout: float, desc: str):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = what()
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {desc}")


def _manifest_step(d: Path) -> int:
    try:
        return json.loads((d / "checkpoint.json").read_text())["step"]
    except (OSError, ValueError, KeyError):
        return 0


def _finish(procs, timeout=120) -> list[str]:
    outs = []
    for p in procs:
        try:
            p.wait(timeout=timeout)
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
        outs.append(_said(p))
    return outs


def test_three_parts_all_reduce_to_the_uninterrupted_digest(tmp_path):
    port = _free_port()
    procs = [_start(tmp_path, r, port, "t-a1", "--steps", "30", "--every", "5", "--step-ms", "5")
             for r in (2, 1, 0)]  # the others come first: they retry until rank 0 listens
    outs = _finish(procs)
    want = allreduce_train.expected(30, WORLD)
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out
        assert "starting from step 0" in out and re.findall(r"^digest ([0-9a-f]{64})$", out, re.M) == [want], out
    for r in range(WORLD):
        assert json.loads((tmp_path / f"part-{r}" / "result.json").read_text())["digest"] == want
    # the digest depends on every rank's values: two ranks would not give three's
    assert allreduce_train.expected(30, 2) != want


def test_a_killed_part_stops_the_others_and_the_next_attempt_resumes_from_their_common_step(tmp_path):
    port = _free_port()
    args = ("--steps", "400", "--every", "7", "--step-ms", "10", "--peer-wait-s", "60")
    procs = [_start(tmp_path, r, port, "t-a1", *args) for r in range(WORLD)]
    try:
        _wait_for(lambda: all(_manifest_step(tmp_path / f"part-{r}") >= 14 for r in range(WORLD)), 60,
                  "two checkpoints in every part")
        procs[1].send_signal(signal.SIGKILL)  # its node is lost
        procs[1].wait(timeout=10)
        # the others notice and wait for the pool's stop; the pool's stop is a SIGTERM
        for r in (0, 2):
            assert procs[r].poll() is None, "a lost peer is no reason to fail at once"
        _wait_for(lambda: all("peer lost at step" in _said(procs[r]) for r in (0, 2)), 60,
                  "the other parts to notice their peer is gone")
        for r in (0, 2):
            procs[r].send_signal(signal.SIGTERM)
        outs = _finish(procs, timeout=30)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for r in (0, 2):
        assert procs[r].returncode == 0, outs[r]
        assert "peer lost at step" in outs[r] and re.search(r"^stopped by SIGTERM at step \d+$", outs[r], re.M)
    assert procs[1].returncode == -signal.SIGKILL
    steps = [_manifest_step(tmp_path / f"part-{r}") for r in range(WORLD)]
    # the next attempt: told to resume from the newest checkpoint any part reported (rank 0's), as the pool does
    resume = json.loads((tmp_path / "part-0" / "checkpoint.json").read_text())["path"]
    port = _free_port()
    procs = [_start(tmp_path, r, port, "t-a2", *args[:-2], resume=resume) for r in range(WORLD)]
    outs = _finish(procs)
    want = allreduce_train.expected(400, WORLD)
    agreed = set()
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out
        m = re.search(r"^resumed from step (\d+) \(agreed by 3 parts\)$", out, re.M)
        assert m, out[:300]
        agreed.add(int(m[1]))
        assert re.findall(r"^digest ([0-9a-f]{64})$", out, re.M) == [want], out[-300:]
    (step,) = agreed
    assert 0 < step <= min(steps), (step, steps)


def test_a_part_of_another_attempt_is_not_let_in_and_the_rendezvous_times_out(tmp_path):
    port = _free_port()
    args = ("--steps", "5", "--step-ms", "1", "--rendezvous-s", "3")
    procs = [_start(tmp_path, 0, port, "t-a2", *args), _start(tmp_path, 1, port, "t-a1", *args),
             _start(tmp_path, 2, port, "t-a2", *args)]
    outs = _finish(procs, timeout=60)
    assert procs[0].returncode == 4 and "rendezvous failed" in outs[0], outs[0]
    assert "digest" not in "".join(outs)


def test_without_the_rendezvous_variables_it_says_so(tmp_path):
    p = subprocess.run([sys.executable, str(PROGRAM), "--dir", str(tmp_path)], env={"PATH": "/usr/bin:/bin"},
                       capture_output=True, text=True, timeout=30)
    assert p.returncode == 2 and "RANK" in p.stderr


@pytest.mark.parametrize("rank", [0, 1])
def test_sigterm_before_the_parts_meet_exits_0(tmp_path, rank):
    p = _start(tmp_path, rank, _free_port(), "t-a1", "--steps", "5")
    _wait_for(lambda: _said(p).startswith("rank "), 30, "the program up")
    p.send_signal(signal.SIGTERM)
    (out,) = _finish([p], timeout=30)
    assert p.returncode == 0 and "stopped by SIGTERM at step 0" in out, out
