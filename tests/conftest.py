"""Fixtures. The broker: GPUPOOL_KAFKA if set (with an operator's credentials in GPUPOOL_USER / GPUPOOL_PASSWORD),
else the project's own local broker (Apache Kafka from Maven Central, SASL/SCRAM and the StandardAuthorizer), fresh
for each test that needs one. A container image's broker would have neither the listener nor the ACLs the tests
probe, so there is no Docker path."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from agents.stack import Stack
from infra import config as config_mod

REPO = Path(__file__).resolve().parent.parent
BROKER_KINDS_USED: list[str] = []
# `make check` (the fast target: unit, property and scenario tests) runs with GPUPOOL_CHECK=1 and deselects the
# tests marked `broker`; a test that starts a broker or a browser without the mark fails here, saying so, rather
# than slipping a broker into the fast target.
FAST = os.environ.get("GPUPOOL_CHECK") == "1"


@pytest.fixture(autouse=True)
def _no_broker_in_the_fast_target(monkeypatch):
    if FAST:
        from infra import kafka_local
        from tests import browser

        def refused(*_a, **_k):
            raise RuntimeError("`make check` starts no broker or browser: mark this test `broker` "
                               "(pytestmark = pytest.mark.broker); `make test` runs it")
        monkeypatch.setattr(kafka_local.LocalBroker, "start", refused)
        monkeypatch.setattr(kafka_local.LocalCluster, "start", refused)
        monkeypatch.setattr(browser.Browser, "__enter__", refused)
    yield


@pytest.fixture(scope="session")
def broker_mode() -> str:
    return "env" if os.environ.get("GPUPOOL_KAFKA") else "local"


@pytest.fixture(scope="session")
def libs_home() -> Path:
    """The Kafka jar cache is shared by every test broker (fetched once by `make test`)."""
    return config_mod.load().home


@pytest.fixture
def stack(tmp_path, broker_mode, libs_home):
    """A fresh broker (unless one is configured), ready topics; the test starts the worker/agents it needs."""
    bootstrap = os.environ["GPUPOOL_KAFKA"] if broker_mode == "env" else None
    s = Stack(home=tmp_path / "gpupool", libs_home=libs_home, bootstrap=bootstrap)
    s.start_broker()
    BROKER_KINDS_USED.append(broker_mode)
    try:
        yield s
    finally:
        s.stop()


FAST_EXAMPLES = 4  # `make check` runs each property test with a quarter of its examples (at least 10); `make test` all


def _fewer_examples(s):
    from hypothesis import settings

    return settings(s, max_examples=max(10, s.max_examples // FAST_EXAMPLES))


def pytest_collection_modifyitems(config, items):
    """A test that takes the `stack` fixture needs a broker: marked so, whether or not its module says it. In the
    fast target, property tests (Hypothesis) draw a quarter of the examples they ask for: the same properties, fewer
    cases; `make test` draws them all."""
    seen = set()
    for item in items:
        if "stack" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.broker)
        if not FAST:
            continue
        fn = getattr(item, "obj", None)
        s = getattr(fn, "_hypothesis_internal_use_settings", None)
        if s is not None and id(fn) not in seen:
            seen.add(id(fn))
            fn._hypothesis_internal_use_settings = _fewer_examples(s)
        cls = getattr(item, "cls", None)
        machine_settings = getattr(cls, "settings", None) if cls is not None else None
        if machine_settings is not None and hasattr(machine_settings, "stateful_step_count") and id(cls) not in seen:
            seen.add(id(cls))
            cls.settings = _fewer_examples(machine_settings)


def pytest_terminal_summary(terminalreporter):
    if BROKER_KINDS_USED:
        kinds = {k: BROKER_KINDS_USED.count(k) for k in sorted(set(BROKER_KINDS_USED))}
        terminalreporter.write_line(f"tests that ran on a real Kafka broker: {len(BROKER_KINDS_USED)} {kinds}")
