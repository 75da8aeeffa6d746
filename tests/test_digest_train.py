"""The example program (infra/programs/digest_train.py, docs/jobs.md "An example program") run as a real subprocess:
uninterrupted, stopped by SIGTERM and resumed, killed by SIGKILL and resumed from its last manifest checkpoint -- the
final digest is the same every time, and its output says where it resumed. No assertion on timing: every wait is on
a condition, with a generous deadline."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from infra.programs import digest_train

PROGRAM = Path(digest_train.__file__)
STEPS, EVERY, STEP_MS = 60, 5, 10
SLOW_MS = 250  # a run about to be stopped: slow enough that it is still running when the signal comes, however
# loaded the machine (the time a step sleeps is no part of the digest: the resumed run goes at STEP_MS)
DEADLINE_S = 120


class Run:
    """The program as a subprocess, its stdout read line by line as it comes."""

    def __init__(self, ckpt: Path, *args: str, env: dict | None = None, step_ms: int = STEP_MS):
        self.lines: list[str] = []
        self.proc = subprocess.Popen(
            [sys.executable, str(PROGRAM), "--steps", str(STEPS), "--every", str(EVERY), "--step-ms", str(step_ms),
             *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env={"PATH": os.environ.get("PATH", ""), "GPUPOOL_CHECKPOINT_DIR": str(ckpt), **(env or {})})
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def wait_line(self, pred) -> str:
        end = time.monotonic() + DEADLINE_S
        while time.monotonic() < end:
            hit = next((ln for ln in list(self.lines) if pred(ln)), None)
            if hit is not None:
                return hit
            if self.proc.poll() is not None and not self._reader.is_alive():
                break
            time.sleep(0.01)
        raise AssertionError(f"no such line; output so far: {self.lines}")

    def finish(self) -> int:
        rc = self.proc.wait(timeout=DEADLINE_S)
        self._reader.join(timeout=DEADLINE_S)
        return rc

    def digest(self) -> str:
        return next(ln.split()[1] for ln in self.lines if ln.startswith("digest "))


def _manifest(ckpt: Path) -> dict:
    return json.loads((ckpt / "checkpoint.json").read_text())


def test_an_uninterrupted_run_prints_and_writes_the_digest_of_every_step(tmp_path):
    run = Run(tmp_path)
    assert run.finish() == 0
    assert run.lines[0] == "starting from step 0"
    assert run.digest() == digest_train.expected(STEPS)
    assert json.loads((tmp_path / "result.json").read_text()) == {"digest": digest_train.expected(STEPS),
                                                                  "steps": STEPS, "seed": 0}
    m = _manifest(tmp_path)
    assert m == {"path": "state-000000060.json", "step": STEPS, "progress_ms": STEPS * STEP_MS}
    assert (tmp_path / m["path"]).exists()
    assert not [p for p in tmp_path.iterdir() if ".tmp." in p.name]  # written by rename: nothing half-written left
    # a different seed is a different digest (the digest says which work was done)
    assert digest_train.expected(STEPS, seed=1) != digest_train.expected(STEPS)


def test_sigterm_checkpoints_and_exits_0_and_the_resumed_run_ends_with_the_same_digest(tmp_path):
    run = Run(tmp_path, step_ms=SLOW_MS)
    run.wait_line(lambda ln: ln == "checkpoint at step 15")
    run.proc.send_signal(signal.SIGTERM)
    assert run.finish() == 0
    stopped = run.wait_line(lambda ln: ln.startswith("stopped by SIGTERM at step "))
    at = int(stopped.rsplit(" ", 1)[1])
    assert 15 <= at < STEPS and not any(ln.startswith("digest ") for ln in run.lines)
    assert _manifest(tmp_path)["step"] == at  # checkpointed where it stopped, not at the last multiple of K
    again = Run(tmp_path)
    assert again.finish() == 0
    assert again.lines[0] == f"resumed from step {at} (checkpoint.json)"
    assert again.digest() == digest_train.expected(STEPS)


def test_sigkill_loses_only_the_steps_since_the_last_manifest_and_the_resumed_run_ends_with_the_same_digest(tmp_path):
    run = Run(tmp_path, step_ms=SLOW_MS)
    run.wait_line(lambda ln: ln == "checkpoint at step 20")
    run.proc.send_signal(signal.SIGKILL)
    assert run.finish() == -signal.SIGKILL
    last = _manifest(tmp_path)["step"]
    assert last >= 20 and last % EVERY == 0
    again = Run(tmp_path)
    assert again.finish() == 0
    assert again.lines[0] == f"resumed from step {last} (checkpoint.json)"
    assert again.digest() == digest_train.expected(STEPS)


@pytest.mark.parametrize("point", ["state", "manifest", "dir"])
def test_gpupool_resume_from_names_the_checkpoint_to_resume_from(tmp_path, point):
    """$GPUPOOL_RESUME_FROM wins over the directory's manifest: here an older run's checkpoint in another directory
    (shared storage, another node's directory), named as its state file, its manifest or its directory."""
    old = tmp_path / "old"
    run = Run(old, "--steps", "30")  # a shorter run: its final checkpoint is at step 30
    assert run.finish() == 0
    name = _manifest(old)["path"]
    target = {"state": old / name, "manifest": old / "checkpoint.json", "dir": old}[point]
    new = tmp_path / "new"
    again = Run(new, env={"GPUPOOL_RESUME_FROM": str(target)})
    assert again.finish() == 0
    assert again.lines[0] == f"resumed from step 30 ({target})"
    assert again.digest() == digest_train.expected(STEPS)


def test_a_resume_point_that_is_no_file_is_passed_over_for_the_manifest(tmp_path):
    run = Run(tmp_path, env={"GPUPOOL_RESUME_FROM": "ckpt:acme/train:1234"})
    assert run.finish() == 0
    assert run.lines[0] == "starting from step 0" and run.digest() == digest_train.expected(STEPS)


def test_sigterm_while_a_long_step_sleeps_is_answered_at_once_without_finishing_the_step(tmp_path):
    """A step of 10 minutes: SIGTERM does not wait for it (the pool's grace is shorter), and the checkpoint is of the
    last step done."""
    proc = subprocess.Popen([sys.executable, str(PROGRAM), "--steps", "3", "--step-ms", "600000"],
                            stdout=subprocess.PIPE, text=True,
                            env={"PATH": os.environ.get("PATH", ""), "GPUPOOL_CHECKPOINT_DIR": str(tmp_path)})
    assert proc.stdout.readline().strip() == "starting from step 0"
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=DEADLINE_S)
    assert proc.returncode == 0 and "stopped by SIGTERM at step 0" in out
    assert not (tmp_path / "checkpoint.json").exists()  # nothing done, nothing to save
