"""What the benchmarks share: CPU time of a process, and a clean exit under `timeout`."""
from __future__ import annotations

import os
from pathlib import Path

CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int | None) -> float:
    """utime + stime of one process (children not included), in seconds."""
    if not pid:
        return 0.0
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / CLK_TCK
    except (OSError, IndexError, ValueError):
        return 0.0


def exit_on_signal(signum, frame):
    raise SystemExit(128 + signum)  # runs the `finally` that stops the broker and the worker (e.g. under `timeout`)
