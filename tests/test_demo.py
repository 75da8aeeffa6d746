"""The demo's scenario (issue #18) as a test: `gpupool demo` on a fresh home, every step's check must hold.

The demo checks its own steps against the log, ClickHouse and the CLI (agents/demo.py) and exits non-zero naming
the step that failed; this test runs it as a user would and asks, step by step, that each printed its check."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.broker


def test_the_demo_tells_its_story_and_every_step_checks(tmp_path):
    env = {**os.environ, "GPUPOOL_HOME": str(tmp_path / "home"), "GPUPOOL_KAFKA": ""}
    libs = Path(__file__).resolve().parent.parent / ".gpupool" / "kafka"
    if libs.is_dir():  # the Kafka jars `make test` fetched: no second download
        (tmp_path / "home").mkdir()
        os.symlink(libs, tmp_path / "home" / "kafka")
    p = subprocess.run([sys.executable, "-m", "agents.cli", "demo", "--out", str(tmp_path / "out")], env=env,
                       capture_output=True, text=True, timeout=900)
    out = p.stdout
    assert p.returncode == 0, out[-6000:] + p.stderr[-3000:]
    steps = [int(n) for n in re.findall(r"^\[(\d)\] ", out, re.M)]
    assert sorted(set(steps)) == list(range(1, 10)), out
    assert "FAILED" not in out
    # each step that checks something says so (1-8), and the last leaves its picture and the dashboard's address
    blocks = re.split(r"^\[\d\] ", out, flags=re.M)[1:]
    firsts = {}
    for n, block in zip(steps, blocks):
        firsts.setdefault(n, "")
        firsts[n] += block
    for n in range(1, 9):
        assert "CHECK OK" in firsts[n], (n, firsts[n])
    assert (tmp_path / "out" / "demo-timeline.png").stat().st_size > 10_000
    assert "/ui/" in firsts[9]
    assert (tmp_path / "out" / "evidence-acme").is_dir()
