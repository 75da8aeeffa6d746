"""Fixtures. The broker, in this order: GPUPOOL_KAFKA if set; a testcontainers Kafka if a Docker daemon answers;
else the project's own local broker (Apache Kafka from Maven Central), fresh for each test that needs one."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from agents.stack import Stack
from infra import config as config_mod

REPO = Path(__file__).resolve().parent.parent
BROKER_KINDS_USED: list[str] = []


def docker_answers() -> bool:
    if shutil.which("docker") is None:
        return False
    try:
        return subprocess.run(["docker", "info"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.fixture(scope="session")
def broker_mode() -> str:
    if os.environ.get("GPUPOOL_KAFKA"):
        return "env"
    if docker_answers():
        return "testcontainers"
    return "local"


@pytest.fixture(scope="session")
def libs_home() -> Path:
    """The Kafka jar cache is shared by every test broker (fetched once by `make test`)."""
    return config_mod.load().home


@pytest.fixture
def stack(tmp_path, broker_mode, libs_home):
    """A fresh broker (unless one is configured), ready topics; the test starts the worker/agents it needs."""
    container = None
    bootstrap = None
    if broker_mode == "env":
        bootstrap = os.environ["GPUPOOL_KAFKA"]
    elif broker_mode == "testcontainers":
        from testcontainers.kafka import KafkaContainer

        container = KafkaContainer("apache/kafka:4.1.1").with_kraft()
        container.start()
        bootstrap = container.get_bootstrap_server()
    s = Stack(home=tmp_path / "gpupool", libs_home=libs_home, bootstrap=bootstrap)
    s.start_broker()
    BROKER_KINDS_USED.append(broker_mode)
    try:
        yield s
    finally:
        s.stop()
        if container is not None:
            container.stop()


def pytest_terminal_summary(terminalreporter):
    if BROKER_KINDS_USED:
        kinds = {k: BROKER_KINDS_USED.count(k) for k in sorted(set(BROKER_KINDS_USED))}
        terminalreporter.write_line(f"tests that ran on a real Kafka broker: {len(BROKER_KINDS_USED)} {kinds}")
