"""The README holds on a fresh machine (#36 item 4): every command of its "Using it" block is run as written, in
order, by bash (in a directory holding the checkout's .venv), against a stack of its own (`gpupool up` to `gpupool
down`, a fresh home, free ports). Only the README's placeholders are filled: JOB with the job the first submit printed, RES with the
reservation `reserve book` printed. Each command must succeed and say what it did; the job it submits runs its
program, whose output `logs JOB -f` prints before it returns."""
from __future__ import annotations

import os
import re
import signal
import subprocess
from pathlib import Path

import pytest

from infra import kafka_local

pytestmark = pytest.mark.broker

REPO = Path(__file__).resolve().parent.parent


def readme_commands(text: str) -> list[str]:
    """The commands of the README's `## Using it` sh block: comments dropped, one command a line."""
    section = text.split("## Using it", 1)[1]
    block = section.split("```sh\n", 1)[1].split("```", 1)[0]
    out = []
    for line in block.splitlines():
        cmd = re.sub(r"(^|\s)#.*$", "", line).strip() if not line.lstrip().startswith("#") else ""
        if cmd:
            out.append(cmd)
    return out


def test_the_readme_block_is_what_this_test_runs():
    cmds = readme_commands((REPO / "README.md").read_text())
    assert cmds[0] == ".venv/bin/gpupool up" and cmds[-1] == ".venv/bin/gpupool down"
    assert all(c.startswith(".venv/bin/gpupool ") for c in cmds), cmds
    assert any(" JOB" in c for c in cmds) and any("RES" in c for c in cmds)


@pytest.fixture
def env(tmp_path, libs_home):
    home = tmp_path / "gp"
    (home / "kafka").mkdir(parents=True)
    (home / "kafka" / "libs").symlink_to(kafka_local.fetch(libs_home))  # the shared jar cache
    kafka = kafka_local.free_port_run()
    web = kafka_local.free_port()
    while web in (kafka, kafka + 1):
        web = kafka_local.free_port()
    e = {**os.environ, "GPUPOOL_HOME": str(home), "GPUPOOL_KAFKA_PORT": str(kafka), "GPUPOOL_WEB_PORT": str(web),
         "GPUPOOL_KAFKA": "", "GPUPOOL_USER": "admin"}
    for k in ("GPUPOOL_TOKEN", "GPUPOOL_PASSWORD"):
        e.pop(k, None)
    yield e
    subprocess.run([str(REPO / ".venv/bin/gpupool"), "down"], env=e, cwd=REPO, capture_output=True, timeout=120)
    for proc in Path("/proc").iterdir():  # whatever a failed run left behind
        try:
            if proc.name.isdigit() and str(home).encode() in (proc / "environ").read_bytes():
                os.kill(int(proc.name), signal.SIGKILL)
        except OSError:
            pass


def test_every_command_of_the_readme_runs_on_a_fresh_stack(env, tmp_path):
    assert (REPO / ".venv/bin/gpupool").exists(), "make test installs the project into .venv"
    cwd = tmp_path / "user"  # a user's directory holding the checkout's .venv: what the commands write stays here
    cwd.mkdir()
    (cwd / ".venv").symlink_to(REPO / ".venv")
    found: dict[str, str] = {}
    said = []
    for cmd in readme_commands((REPO / "README.md").read_text()):
        if " JOB" in cmd:
            cmd = cmd.replace(" JOB", " " + found["JOB"])
        if "RES" in cmd:
            cmd = cmd.replace("RES", found["RES"])
        out = subprocess.run(["bash", "-c", cmd], env=env, cwd=cwd, capture_output=True, text=True, timeout=300)
        said.append((cmd, out.returncode, out.stdout[-1500:], out.stderr[-1500:]))
        print(f"$ {cmd}\n{out.stdout}{out.stderr}")  # shown with -s, or when the test fails
        assert out.returncode == 0, said[-1]
        assert (out.stdout + out.stderr).strip(), f"{cmd} said nothing"
        if " submit " in cmd and "JOB" not in found and "hello from the pool" in cmd:
            found["JOB"] = out.stdout.split()[0]
            assert found["JOB"].startswith("acme/"), said[-1]
        if " reserve book " in cmd:
            found["RES"] = out.stdout.split()[0]
            assert found["RES"].startswith("acme/"), said[-1]
        if "--isolation mig" in cmd:  # the default fleet has cards in MIG mode: a hardware slice is placed at once
            assert "placed on node-004" in out.stderr, said[-1]
        if " logs " in cmd:
            assert "hello from the pool" in out.stdout, said[-1]
        if " explain " in cmd:
            assert found["JOB"] in out.stdout, said[-1]
        if " reserve list" in cmd:
            assert found["RES"] in out.stdout and "accepted" in out.stdout, said[-1]
    assert [c for c, *_ in said][-1].endswith("gpupool down")
