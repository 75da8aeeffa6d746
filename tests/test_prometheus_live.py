"""Prometheus for real (issue #36 item 3; docs/observability.md, "Scraping with Prometheus"): Debian's `prometheus`,
with a config as the docs give it (the worker's /metrics with an auditor principal's bearer token from a file, the
node agent's loopback endpoint without one), scrape interval 1 s, the shipped alerting rules loaded, scrapes a live
worker and a simulated node agent; the series are read back through its query API. Without a token (or with a
tenant's) the worker's target is down and /api/v1/targets says why. The rules are evaluated on what was scraped: the
tenant at its quota, the card with uncorrected ECC errors and the node lost (faults injected through the simulated
agent's control file) are seen by their alerts."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.parse
import urllib.request

import pytest
import yaml

from agents.stack import Stack
from infra.kafka_local import free_port
from schemas.events import JobRequested, Tier
from tests.live import job_states, quotas, wait_for
from tests.prometheus_bin import binary, rules_dir

pytestmark = pytest.mark.broker

FLEET = {"nodes": [{"name": "node-a", "model": "A100-80GB", "gpus": 2}, {"name": "node-b", "model": "T4", "gpus": 1}]}


@pytest.fixture(scope="module")
def pool(tmp_path_factory, broker_mode, libs_home):
    home = tmp_path_factory.mktemp("prometheus")
    agent_port = free_port()
    s = Stack(home=home / "gpupool", libs_home=libs_home,
              bootstrap=os.environ["GPUPOOL_KAFKA"] if broker_mode == "env" else None,
              extra_env={"GPUPOOL_AGENT_METRICS_PORT": str(agent_port)})
    s.agent_metrics_port = agent_port
    s.start_broker()
    try:
        s.start_worker()
        fleet = home / "fleet.yaml"
        fleet.write_text(yaml.safe_dump(FLEET))
        s.faults = home / "faults"  # the agent applies each line appended (`gpupool agent inject`)
        s.faults.write_text("")
        s.start_agent(str(fleet), "--control", str(s.faults))
        # the token as docs/observability.md makes it: `gpupool user add prom --role auditor`, then
        # `gpupool user token prom > /etc/prometheus/gpupool.token`
        env = {**os.environ, **s.env}
        out = subprocess.run([sys.executable, "-m", "agents.cli", "user", "add", "prom", "--role", "auditor"],
                             capture_output=True, text=True, timeout=120, env=env)
        assert out.returncode == 0, out.stdout + out.stderr
        out = subprocess.run([sys.executable, "-m", "agents.cli", "user", "token", "prom"], capture_output=True,
                             text=True, timeout=120, env=env)
        assert out.returncode == 0, out.stdout + out.stderr
        s.prom_token = out.stdout.strip()
        assert s.prom_token, out.stdout
        s.tenant_token = s.add_user("alice", "tenant", "acme").token
        quotas(s, "acme", compute=1000)  # one compute unit: one A100
        wait_for(lambda: s.client().api("/cluster/")["nodes"] == 2, 90, "the fleet", s)
        s.client("alice").send([JobRequested(job_id="acme/train", tenant="acme", tier=Tier.OFFLINE,
                                             compute_milli=1000, gpu_memory_mib=40 * 1024, duration_s=3600,
                                             constraints={"models": ["A100-80GB"]})])
        wait_for(lambda: job_states(s).get("acme/train", {}).get("state") == "running", 120, "the job running", s)
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def prom(pool, tmp_path_factory):
    """Debian's prometheus on its own port and storage, scraping the pool every second."""
    d = tmp_path_factory.mktemp("prom")
    token_file = d / "gpupool.token"
    token_file.write_text(pool.prom_token + "\n")
    token_file.chmod(0o600)
    worker = [f"127.0.0.1:{pool.web_port}"]
    config = {
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(rules_dir() / "alerts.yml")],
        "scrape_configs": [
            # the two jobs as docs/observability.md gives them
            {"job_name": "gpupool", "authorization": {"credentials_file": str(token_file)},
             "static_configs": [{"targets": worker}]},
            {"job_name": "gpupool-agents", "static_configs": [{"targets": [f"127.0.0.1:{pool.agent_metrics_port}"]}]},
            # and the worker scraped without a token, and with a tenant's: both refused
            {"job_name": "gpupool-no-token", "static_configs": [{"targets": worker}]},
            {"job_name": "gpupool-tenant-token", "authorization": {"credentials": pool.tenant_token},
             "static_configs": [{"targets": worker}]},
        ],
    }
    (d / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    log = open(d / "prometheus.log", "ab")
    proc = subprocess.Popen([binary("prometheus"), f"--config.file={d / 'prometheus.yml'}",
                             f"--storage.tsdb.path={d / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)

    class Prom:
        url = f"http://127.0.0.1:{port}"

        @staticmethod
        def log() -> str:
            return (d / "prometheus.log").read_text(errors="replace")[-4000:]

        def api(self, path: str, **params) -> dict:
            assert proc.poll() is None, f"prometheus exited {proc.returncode}: {self.log()}"
            q = f"?{urllib.parse.urlencode(params)}" if params else ""
            try:
                with urllib.request.urlopen(f"{self.url}/api/v1/{path}{q}", timeout=30) as resp:
                    doc = json.loads(resp.read())
            except OSError:
                return {}  # not listening yet
            assert doc["status"] == "success", doc
            return doc["data"]

        def query(self, expr: str) -> list[dict]:
            return (self.api("query", query=expr) or {}).get("result", [])

        def value(self, expr: str) -> float | None:
            r = self.query(expr)
            return float(r[0]["value"][1]) if r else None

        def wait(self, expr: str, what: str, timeout: float = 90) -> list[dict]:
            try:
                return wait_for(lambda: self.query(expr), timeout, what, pool)
            except AssertionError as exc:
                raise AssertionError(f"{exc}\nprometheus: {self.log()}") from None

    try:
        yield Prom()
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        log.close()


def test_prometheus_scrapes_the_worker_with_the_token_and_a_node_agent(pool, prom):
    prom.wait('up{job="gpupool"} == 1', "the worker's target up (scraped with the auditor's token)")
    prom.wait('up{job="gpupool-agents"} == 1', "the node agent's target up")
    # the worker's series, read back from Prometheus' storage: placements, the fleet, the tenant's ledger
    prom.wait('sum(gpupool_placements_total{job="gpupool"}) >= 1', "the placement counted")
    states = prom.wait('gpupool_node_state{job="gpupool"} == 1', "the nodes' states")
    assert {r["metric"]["node"] for r in states} == {"node-a", "node-b"}, states
    assert prom.value('sum(gpupool_gpu_capacity{job="gpupool"})') == 3
    prom.wait('gpupool_tenant_quota_compute_units{job="gpupool",tenant="acme"} == 1', "acme's quota")
    prom.wait('gpupool_tenant_used_compute_units{job="gpupool",tenant="acme"} == 1', "acme's use")
    prom.wait('gpupool_consumer_lag_records{job="gpupool",group="gpupool-sink"}', "the sink's lag")
    # the node agent's: each card's utilization, the job it runs
    util = prom.wait('gpupool_node_gpu_utilization_ratio{job="gpupool-agents"}', "the cards' utilization")
    assert len(util) == 3 and all(0 <= float(r["value"][1]) <= 1 for r in util), util
    prom.wait('sum(gpupool_node_jobs_running{job="gpupool-agents"}) == 1', "the job running on the agent")
    # a range query over what was stored: the series has more than one sample (Prometheus kept scraping)
    prom.wait('count_over_time(gpupool_placements_total{job="gpupool"}[1m]) > 1', "several scrapes stored")


def test_without_the_token_the_target_is_down_and_says_why(pool, prom):
    prom.wait('up{job="gpupool-no-token"} == 0', "the worker scraped without a token down")
    prom.wait('up{job="gpupool-tenant-token"} == 0', "the worker scraped with a tenant's token down")

    def targets():
        got = {t["scrapePool"]: t for t in (prom.api("targets", state="active") or {}).get("activeTargets", [])}
        return got if {"gpupool-no-token", "gpupool-tenant-token"} <= set(got) and all(
            got[p]["lastError"] for p in ("gpupool-no-token", "gpupool-tenant-token")) else None

    got = wait_for(targets, 60, "the refused targets' errors", pool)
    assert got["gpupool-no-token"]["health"] == "down"
    assert "401" in got["gpupool-no-token"]["lastError"], got["gpupool-no-token"]
    assert got["gpupool-tenant-token"]["health"] == "down"
    assert "403" in got["gpupool-tenant-token"]["lastError"], got["gpupool-tenant-token"]
    assert got["gpupool"]["health"] == "up" or prom.wait('up{job="gpupool"} == 1', "the worker up")
    # the shipped rule sees it: pending for its 2 minutes
    prom.wait('ALERTS{alertname="GpupoolTargetDown",job="gpupool-no-token"}', "GpupoolTargetDown pending")


def test_the_shipped_rules_are_evaluated_on_what_was_scraped(pool, prom):
    def loaded():
        groups = (prom.api("rules") or {}).get("groups", [])
        rules = [r for g in groups for r in g["rules"]]
        return rules if rules and all(r.get("lastEvaluation", "").startswith("2") and r["health"] == "ok"
                                      for r in rules) else None

    rules = wait_for(loaded, 60, "every rule evaluated without error", pool)
    assert {r["name"] for r in rules if r["type"] == "alerting"} >= {"GpupoolNodeLost", "GpupoolTenantAtQuota",
                                                                      "GpupoolSinkStalled"}
    # acme holds its whole quota: the alert is pending (it fires after 15 minutes)
    at_quota = prom.wait('ALERTS{alertname="GpupoolTenantAtQuota",tenant="acme"}', "GpupoolTenantAtQuota for acme")
    assert at_quota[0]["metric"]["alertstate"] in ("pending", "firing")
    # a fault once Prometheus has stored node-b's card without errors: the card counts uncorrected ECC errors (the
    # agent) and goes out of service (the worker)
    prom.wait('gpupool_node_gpu_ecc_errors_total{node="node-b",type="uncorrected"} == 0',
              "node-b's card without errors")
    assert prom.value('gpupool_card_healthy{job="gpupool",node="node-b"}') == 1
    with open(pool.faults, "a") as f:
        f.write("ecc:node-b:0\n")
    prom.wait('ALERTS{alertname="GpupoolGpuUncorrectedEcc",node="node-b",alertstate="firing"}',
              "GpupoolGpuUncorrectedEcc firing for node-b's card")
    prom.wait('gpupool_card_healthy{job="gpupool",node="node-b"} == 0', "node-b's card out of service")
    prom.wait('ALERTS{alertname="GpupoolCardUnhealthy",node="node-b"}', "GpupoolCardUnhealthy for node-b's card")
    # and nothing about what is well: node-a's cards, the nodes, the scheduler
    assert not prom.query('ALERTS{alertname="GpupoolCardUnhealthy",node="node-a"}')
    assert not prom.query('ALERTS{alertname=~"GpupoolNodeLost|GpupoolNoLiveScheduler"}')
    # node-b lost: the worker states it down, and the alert names it
    with open(pool.faults, "a") as f:
        f.write("lose:node-b\n")
    prom.wait('gpupool_node_state{job="gpupool",node="node-b",state="down"} == 1', "node-b down")
    lost = prom.wait('ALERTS{alertname="GpupoolNodeLost"}', "GpupoolNodeLost for node-b")
    assert {r["metric"]["node"] for r in lost} == {"node-b"}, lost
