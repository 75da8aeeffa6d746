"""Progress on stderr (infra/progress.py): plain lines when stderr is no terminal (logs, pipes, tests), a rich bar
or spinner when it is one."""
from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from infra.progress import Bar, status

SNIPPET = """
from infra.progress import Bar, status
with status("gpupool up: waiting for the worker") as step:
    step("gpupool up: waiting for the fleet")
with Bar("replay") as bar:
    for i in range(4):
        bar(i + 1, 4)
"""


def test_plain_lines_when_stderr_is_not_a_terminal(capsys):
    with status("gpupool up: waiting for the worker") as step:
        step("gpupool up: waiting for the fleet")
    with Bar("replay") as bar:
        for i in range(4):
            bar(i + 1, 4)
    err = capsys.readouterr().err.splitlines()
    assert err[:2] == ["gpupool up: waiting for the worker ...", "gpupool up: waiting for the fleet ..."]
    assert err[2] == "replay: 10% (1/4)" and err[-1] == "replay: 100% (4/4)" and "\x1b" not in "".join(err)


@pytest.mark.skipif(shutil.which("script") is None, reason="needs script(1) for a pseudo-terminal")
def test_a_bar_on_a_terminal():
    out = subprocess.run(["script", "-qc", f"{sys.executable} -c '{SNIPPET}'", "/dev/null"], capture_output=True,
                         text=True, timeout=60)
    assert "4/4" in out.stdout and "\x1b[" in out.stdout  # rich's bar with its count, drawn with escapes
    assert "replay: 10%" not in out.stdout
