"""`gpupool up` / `down` as a person uses them (#13 item 7): up says what it waits for and fails naming the part that
died; a crashed worker is restarted; a second up says the stack runs; down stops exactly what up started, and a
stale pid file never makes it signal another process."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from infra import kafka_local

pytestmark = pytest.mark.broker


def _env(home: Path) -> dict:
    kafka = kafka_local.free_port_run()  # the broker's port and its controller's, the one after it
    web = kafka_local.free_port()
    while web in (kafka, kafka + 1):
        web = kafka_local.free_port()
    return {**os.environ, "GPUPOOL_HOME": str(home), "GPUPOOL_KAFKA_PORT": str(kafka),
            "GPUPOOL_WEB_PORT": str(web), "GPUPOOL_KAFKA": "", "GPUPOOL_USER": "admin"}


def _gpupool(env: dict, *argv: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "agents.cli", *argv], env=env, capture_output=True, text=True,
                          timeout=timeout)


def _processes_of(home: Path) -> list[int]:
    """Pids of processes whose command line or environment names this home."""
    out = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            text = (proc / "cmdline").read_bytes() + (proc / "environ").read_bytes()
        except OSError:
            continue
        if str(home).encode() in text:
            out.append(int(proc.name))
    return out


@pytest.fixture
def home(tmp_path, libs_home):
    h = tmp_path / "gp"
    (h / "kafka").mkdir(parents=True)
    (h / "kafka" / "libs").symlink_to(kafka_local.fetch(libs_home))  # the shared jar cache
    yield h
    for pid in _processes_of(h):  # whatever a failed test left behind
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def test_up_waits_restarts_refuses_twice_and_down_stops_only_its_own(home):
    env = _env(home)
    up = _gpupool(env, "up", "--simulate", "demo:2")
    assert up.returncode == 0, up.stdout + up.stderr
    # what it waits for is progress, on stderr (infra/progress.py); the result is on stdout
    assert "waiting for the worker" in up.stderr and "waiting for the simulated fleet's 2 node(s)" in up.stderr
    assert "gpupool up: kafka" in up.stdout
    again = _gpupool(env, "up")
    assert again.returncode == 0 and "already up" in again.stdout
    nodes = _gpupool(env, "node", "list")
    assert nodes.stdout.count("ready") == 2, nodes.stdout + nodes.stderr

    state = json.loads((home / "run" / "state.json").read_text())
    os.kill(state["worker"]["pid"], signal.SIGKILL)  # a crash
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        state = json.loads((home / "run" / "state.json").read_text())
        if state["worker"]["exits"] >= 1 and _gpupool(env, "node", "list").stdout.count("ready") == 2:
            break
        time.sleep(1)
    assert state["worker"]["exits"] == 1 and state["worker"]["last_exit"] == -signal.SIGKILL
    submit = _gpupool(env, "submit", "--tenant", "acme", "--compute", "100", "--memory-gib", "1", "--duration", "1")
    assert submit.returncode == 0, submit.stderr  # the restarted worker takes requests

    down = _gpupool(env, "down")
    assert down.returncode == 0 and "supervisor" in down.stdout and "broker" in down.stdout
    time.sleep(1)
    assert _processes_of(home) == []

    # a stale pid file naming some other process: down must leave it alone
    bystander = subprocess.Popen(["sleep", "300"])
    try:
        (home / "run" / "supervisor.pid").write_text(str(bystander.pid))
        (home / "kafka" / "data" / "broker.pid").write_text(str(bystander.pid))
        stale = _gpupool(env, "down")
        assert stale.returncode == 0 and "nothing of this home was running" in stale.stdout
        assert bystander.poll() is None
    finally:
        bystander.kill()


def test_up_fails_naming_the_part_that_died(home):
    env = _env(home)
    fleet = home / "fleet.yaml"
    fleet.write_text("nodes:\n  - {name: n1, model: A100-80GB, gpus: 2}\nfaults:\n  - {at: 0, fault: 'lose:nope'}\n")
    up = _gpupool(env, "up", "--simulate", str(fleet))
    try:
        assert up.returncode == 1, up.stdout + up.stderr
        assert "the agent died at start" in up.stderr and "nope" in up.stderr  # its log's last lines
        assert "Traceback (most recent call last)" not in up.stderr.splitlines()[0]
        supervisor_left = [p for p in _processes_of(home) if b"supervise" in Path(f"/proc/{p}/cmdline").read_bytes()]
        assert supervisor_left == []
    finally:
        _gpupool(env, "down")
