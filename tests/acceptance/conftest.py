"""Seed 004's four acceptance groups, run against the live stack: a real broker, the worker, simulated fleets.

One stack serves the four suites (tests/acceptance/fleet.yaml: each group has its own pool, so one group's work and
faults do not disturb another's). Every test says which group and which of the seed's questions it answers
(`@answers`), and records its evidence (`evidence.table`, `.events`, `.note`); the plugin below writes the results
with their evidence to $GPUPOOL_ACCEPTANCE_OUT (default: tests/acceptance/.results/results.json), which
`gpupool acceptance report` turns into the buyer's report (agents/acceptance.py).
"""
from __future__ import annotations

import json
import os
import shutil
import time
from importlib import resources
from pathlib import Path

import pytest

from agents.acceptance import EIGHT, GROUPS
from agents.client import price_rows
from agents.node.runner import passable_roots
from agents.stack import Stack
from tests.live import quotas, wait_for

HERE = Path(__file__).resolve().parent
RESULTS: list[dict] = []

pytestmark = pytest.mark.broker


def answers(group: int, question: str, eight: tuple[int, ...] = ()):
    """The seed's group and question a test answers, and which of the eight buyer's questions (1-8) it proves."""
    assert group in GROUPS and all(1 <= q <= len(EIGHT) for q in eight)

    def mark(fn):
        fn.acceptance = {"group": group, "question": question, "eight": list(eight)}
        return fn
    return mark


class Evidence:
    """What a check shows a buyer: tables of rows, event timelines, notes; plain data (JSON)."""

    def __init__(self):
        self.items: list[dict] = []

    def note(self, text: str) -> None:
        self.items.append({"type": "note", "text": text})

    def table(self, title: str, columns: list[str], rows: list[list]) -> None:
        self.items.append({"type": "table", "title": title, "columns": list(columns),
                           "rows": [[v if isinstance(v, (int, float, str, bool, type(None))) else str(v) for v in r]
                                    for r in rows]})

    def events(self, title: str, events: list[dict]) -> None:
        self.items.append({"type": "events", "title": title, "events": events})

    def series(self, title: str, name: str, points: list[tuple]) -> None:
        """Points (x, y[, label]) the report plots as a figure."""
        self.items.append({"type": "series", "title": title, "name": name, "points": [list(p) for p in points]})


@pytest.fixture
def evidence(request) -> Evidence:
    e = Evidence()
    request.node.acceptance_evidence = e
    return e


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    meta = getattr(getattr(item, "function", None), "acceptance", None)
    if meta is None or report.when != "call" and not (report.when == "setup" and report.failed):
        return
    ev = getattr(item, "acceptance_evidence", None)
    RESULTS.append({
        "test": item.nodeid, "name": item.name, "doc": (item.function.__doc__ or "").strip(), **meta,
        "outcome": report.outcome, "seconds": round(report.duration, 1),
        "failure": str(report.longrepr)[-3000:] if report.failed else "", "evidence": ev.items if ev else []})


def pytest_sessionfinish(session, exitstatus):
    if not RESULTS:
        return
    out = Path(os.environ.get("GPUPOOL_ACCEPTANCE_OUT") or HERE / ".results" / "results.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"finished_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                               "results": RESULTS}, indent=1))


@pytest.fixture(scope="session")
def pool(tmp_path_factory, broker_mode, libs_home):
    """The stack: broker, worker, the main simulated fleet (groups 1, 2 and 4) and one agent per fault node (group
    3), each with a control file for faults; principals: admin (operator), alice (acme), bob (globex), fin
    (finance), aud (auditor); quotas for both tenants; the shipped price book."""
    s = Stack(home=tmp_path_factory.mktemp("acceptance") / "gpupool", libs_home=libs_home,
              bootstrap=os.environ["GPUPOOL_KAFKA"] if broker_mode == "env" else None)
    # jobs that carry a command run as real processes, as the job user (65534 under root): their directories where
    # that user reaches them (pytest's temporary directories are root's own), as `gpupool up` makes them
    roots = passable_roots(s.home)
    s.extra_env.update(roots)
    s.start_broker()
    try:
        s.start_worker()
        s.controls = {}
        for name, fleet in (("agent", "fleet.yaml"), ("agent-f1", "fault-1.yaml"), ("agent-f2", "fault-2.yaml")):
            control = s.home / f"{name}.faults"
            control.touch()
            s.controls[name] = control
            s.spawn(name, "agent", "--simulate", str(HERE / fleet), "--group", f"gpupool-agent-{name}",
                    "--control", str(control))
        for name, role, tenant in (("alice", "tenant", "acme"), ("bob", "tenant", "globex"), ("fin", "finance", None),
                                   ("aud", "auditor", None)):
            s.add_user(name, role, tenant)
        quotas(s, "acme", "globex", compute=200_000)
        # the shipped price book, as `gpupool up` loads it: the cost-allocation pack (group 4) carries real money
        s.client().send(price_rows(resources.files("infra").joinpath("prices.yaml").read_text()))
        wait_for(lambda: s.stats()["scheduler"]["nodes"] == 8, 90, "the eight acceptance nodes", s)
        yield s
    finally:
        s.stop()
        logs = HERE / ".results" / "logs"  # for whoever reads a failure
        logs.mkdir(parents=True, exist_ok=True)
        for name in ("worker", "agent", "agent-f1", "agent-f2"):
            (logs / f"{name}.log").write_text(s.log(name)[-200_000:])
        if roots:
            shutil.rmtree(Path(roots["GPUPOOL_JOBS_ROOT"]).parent, ignore_errors=True)


def inject(pool: Stack, agent: str, *faults: str) -> None:
    """Break a simulated node while it runs (the agent applies each line of its control file)."""
    with pool.controls[agent].open("a") as f:
        for fault in faults:
            f.write(fault + "\n")
