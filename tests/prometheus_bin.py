"""Debian's `prometheus` and `promtool` for the tests (`make prometheus` installs them): GPUPOOL_PROMETHEUS and
GPUPOOL_PROMTOOL name other binaries. Missing, the tests that need them fail saying what to install (never skip)."""
from __future__ import annotations

import os
import shutil
from importlib import resources
from pathlib import Path


def binary(name: str) -> str:
    exe = os.environ.get(f"GPUPOOL_{name.upper()}") or shutil.which(name)
    if not exe:
        raise AssertionError(f"no `{name}`: run `make prometheus` (apt-get install prometheus, as root) or set "
                             f"GPUPOOL_{name.upper()} to a {name} binary")
    return exe


def rules_dir() -> Path:
    """The shipped rules (infra/prometheus/, package data), as installed."""
    return Path(str(resources.files("infra").joinpath("prometheus")))
