"""The alerting rules shipped in infra/prometheus/alerts.yml (docs/observability.md, "Alerts"): `promtool check rules`
accepts them, `promtool test rules` runs alerts_test.yml (each alert with a case where it fires and one where it does
not), a rule changed against its test fails that test, and every gpupool series a rule reads is one the worker or a
node agent exports (a renamed metric would otherwise leave an alert silent for ever)."""
from __future__ import annotations

import re
import shutil
import subprocess

import yaml
from prometheus_client.exposition import generate_latest

from tests.prometheus_bin import binary, rules_dir


def promtool(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([binary("promtool"), *args], capture_output=True, text=True, timeout=120, cwd=cwd)


def rules() -> list[dict]:
    doc = yaml.safe_load((rules_dir() / "alerts.yml").read_text())
    return [r for g in doc["groups"] for r in g["rules"]]


def test_promtool_checks_the_rules():
    out = promtool("check", "rules", str(rules_dir() / "alerts.yml"))
    assert out.returncode == 0 and "SUCCESS" in out.stdout, out.stdout + out.stderr


def test_promtool_unit_tests_pass():
    out = promtool("test", "rules", "alerts_test.yml", cwd=rules_dir())
    assert out.returncode == 0 and "SUCCESS" in out.stdout, out.stdout + out.stderr


def test_every_alert_has_a_firing_and_a_quiet_case():
    tests = yaml.safe_load((rules_dir() / "alerts_test.yml").read_text())["tests"]
    cases: dict[str, set[bool]] = {}
    for t in tests:
        for case in t.get("alert_rule_test", ()):
            cases.setdefault(case["alertname"], set()).add(bool(case.get("exp_alerts")))
    alerts = {r["alert"] for r in rules() if "alert" in r}
    assert alerts >= {"GpupoolNodeLost", "GpupoolCardUnhealthy", "GpupoolJobWaitingTooLong", "GpupoolTenantAtQuota",
                      "GpupoolConsumerLag", "GpupoolDeadLettersRising", "GpupoolSinkBehind"}
    assert {a: cases.get(a, set()) for a in alerts} == {a: {True, False} for a in alerts}


def test_a_rule_changed_against_its_test_fails_it(tmp_path):
    """The unit tests can fail: the quota alert waiting 5 minutes instead of 15 fires where its test says quiet."""
    for name in ("alerts.yml", "alerts_test.yml"):
        shutil.copy(rules_dir() / name, tmp_path / name)
    text = (tmp_path / "alerts.yml").read_text()
    at_quota = text.index("alert: GpupoolTenantAtQuota")
    changed = text[:at_quota] + text[at_quota:].replace("for: 15m", "for: 5m", 1)
    assert changed != text
    (tmp_path / "alerts.yml").write_text(changed)
    out = promtool("test", "rules", "alerts_test.yml", cwd=tmp_path)
    assert out.returncode != 0 and "GpupoolTenantAtQuota" in out.stdout + out.stderr, out.stdout + out.stderr


def exported_names() -> set[str]:
    """Every sample name the worker's and a node agent's registries expose, each scrape-time source present."""
    from agents.node.metrics import AgentMetrics
    from streams.edge.metrics import WorkerMetrics

    m = WorkerMetrics()
    m.source("nodes", lambda: [])
    m.source("queue", lambda: (0, []))
    m.source("sink", lambda: {"inserted_rows": 0, "retries": 0, "positions": {}})
    m.source("scheduler", lambda: {"position": 0, "live": True})
    names: set[str] = set()
    for registry in (m.registry, AgentMetrics().registry):
        for line in generate_latest(registry).decode().splitlines():
            if line.startswith("# TYPE "):
                _, _, name, kind = line.split()
                # a counter's TYPE line names it with its _total; a histogram's names its base
                names |= {f"{name}_bucket", f"{name}_count", f"{name}_sum"} if kind == "histogram" else {name}
    return names


def test_the_rules_read_only_series_the_exporters_export():
    exported = exported_names()
    assert "gpupool_node_state" in exported and "gpupool_node_gpu_ecc_errors_total" in exported
    read = {n for r in rules() for n in re.findall(r"\bgpupool_[a-z0-9_]+", r["expr"] if isinstance(r["expr"], str)
                                                  else str(r["expr"]))}
    assert read and read <= exported, read - exported
