"""infra/gpu-check: the real script on this machine, and the same code path over the fake NVML fleet."""
from __future__ import annotations

import ctypes
import json
import os
import subprocess
from pathlib import Path

from agents.node import gpu_check
from tests.fake_pynvml import FakeNvml, NVMLError_DriverNotLoaded, mig_a100, two_card_node

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "infra" / "gpu-check"


def nvml_library_present() -> bool:
    try:
        ctypes.CDLL("libnvidia-ml.so.1")
        return True
    except OSError:
        return False


def test_gpu_check_script_on_this_machine(tmp_path):
    assert os.access(SCRIPT, os.X_OK)
    out = tmp_path / "check.json"
    proc = subprocess.run([str(SCRIPT), "--seconds", "0.2", "--interval", "0.1", "--out", str(out)],
                          capture_output=True, text=True, timeout=60, cwd=tmp_path)
    if nvml_library_present():  # a GPU host: the check must work end to end
        assert proc.returncode == 0, proc.stderr
        doc = json.loads(proc.stdout)
        assert doc["inventory"]["gpus"] and doc["telemetry"] and json.loads(out.read_text()) == doc
    else:  # this project's CI: no driver, one line saying so
        assert proc.returncode != 0
        assert proc.stdout == ""
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1, proc.stderr
        assert lines[0].startswith("no NVIDIA driver:") and "NVML Shared Library Not Found" in lines[0]
        assert not out.exists()


def test_gpu_check_over_a_fake_fleet():
    nv = FakeNvml(two_card_node() + [mig_a100()])
    rc, doc = gpu_check.run(0.15, 0.05, "n1", nvml=nv)
    assert rc == 0
    json.dumps(doc)  # what main() prints
    assert [g["uuid"] for g in doc["inventory"]["gpus"]] == ["GPU-aaaa", "GPU-bbbb", "GPU-mig0"]
    assert 2 <= len(doc["telemetry"]) <= 5
    assert all(len(t["samples"]) == 6 for t in doc["telemetry"]) and doc["health"] == []
    assert not nv.initialized  # shut down afterwards


def test_gpu_check_without_driver_or_cards(capsys):
    rc, doc = gpu_check.run(0, 1, "n1", nvml=FakeNvml([], init_error=NVMLError_DriverNotLoaded))
    assert (rc, doc) == (1, None)
    assert capsys.readouterr().err.strip() == "no NVIDIA driver: Driver Not Loaded"
    rc, doc = gpu_check.run(0, 1, "n1", nvml=FakeNvml([]))
    assert rc == 1 and doc["inventory"]["gpus"] == []
    assert "no NVIDIA GPU" in capsys.readouterr().err
