"""Seeing the pool, on the live stack (docs/observability.md): the worker's /metrics scraped and parsed with
prometheus_client's own parser, a node agent's metrics, the telemetry history in ClickHouse, and the dashboard driven
in headless Chromium: every page loads without a console error and shows the jobs the test submitted, each role sees
its own, and a tenant's session cannot open another tenant's job."""
from __future__ import annotations

import os
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from agents.stack import Stack
from tests import ui_scenario
from tests.browser import Browser, chromium_path, screenshots
from tests.live import job_states, wait_for

pytestmark = pytest.mark.broker
REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def pool(tmp_path_factory, broker_mode, libs_home):
    from agents.node.metrics import AgentMetrics  # noqa: F401 - the agent serves it (GPUPOOL_AGENT_METRICS_PORT)
    from infra.kafka_local import free_port

    agent_port = free_port()
    s = Stack(home=tmp_path_factory.mktemp("dashboard") / "gpupool", libs_home=libs_home,
              bootstrap=os.environ["GPUPOOL_KAFKA"] if broker_mode == "env" else None,
              extra_env={"GPUPOOL_AGENT_METRICS_PORT": str(agent_port)})
    s.agent_metrics_port = agent_port
    s.start_broker()
    try:
        ui_scenario.start(s)
        s.jobs = ui_scenario.submit(s)
        ui_scenario.running(s, s.jobs)
        ui_scenario.preempt(s)
        ui_scenario.load(s, every_s=1.0)
        yield s
    finally:
        s.stop()


def _get(url: str, token: str | None = None) -> tuple[int, str]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def _families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


# ---------------------------------------------------------------- Prometheus


def test_metrics_are_scraped_with_a_token_and_parse(pool):
    url = f"http://127.0.0.1:{pool.web_port}/metrics"
    assert _get(url)[0] == 401  # no token
    assert _get(url, pool.client("alice").creds.token)[0] == 403  # a tenant may not scrape the pool
    assert _get(url, pool.client("fin").creds.token)[0] == 403

    def scraped():
        status, text = _get(url, pool.client().creds.token)
        assert status == 200
        fams = _families(text)
        placed = sum(s.value for s in fams["gpupool_placements"].samples if s.name == "gpupool_placements_total")
        lag = [s for s in fams["gpupool_consumer_lag_records"].samples]
        return placed >= 5 and lag and fams

    fams = wait_for(scraped, 90, "placements and consumer lag in /metrics", pool)
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in fams.values() for s in f.samples}

    def value(name: str, **labels) -> float:
        return sum(v for (n, ls), v in samples.items() if n == name and all(dict(ls).get(k) == w
                                                                            for k, w in labels.items()))

    # allocation by model and data center, and capacity that matches the fleet (demo:4: 16 cards)
    assert value("gpupool_gpu_capacity") == 16 and value("gpupool_gpu_allocated") > 0
    assert value("gpupool_gpu_capacity", gpu_model="H100-80GB") == 4
    assert "gpupool_fragmented_gpus" in fams and "gpupool_fragmentation_ratio" in fams
    # queue by tier, rejections with their reason (the request no node could hold), decision latency histogram
    assert {s.labels["tier"] for s in fams["gpupool_queue_length"].samples} >= {"inference", "offline"}
    assert value("gpupool_rejections_total", reason="unsatisfiable") >= 1
    assert value("gpupool_decision_latency_seconds_count") >= 1
    assert fams["gpupool_decision_latency_seconds"].type == "histogram"
    assert value("gpupool_queue_wait_seconds_count") >= 5
    # per-tenant quota and use in compute units
    assert value("gpupool_tenant_quota_compute_units", tenant="acme") == 40
    assert value("gpupool_tenant_used_compute_units", tenant="globex") > 0
    # consumer lag per group and topic, the sink's progress, the gateway
    assert any(s.labels["group"] == "gpupool-sink" for s in fams["gpupool_consumer_lag_records"].samples)
    assert value("gpupool_sink_rows_total") > 0
    assert value("gpupool_gateway_requests_total", outcome="accepted") > 0
    assert "gpupool_dead_letters" in fams and "gpupool_preemptions" in fams and "gpupool_migrations" in fams


def test_a_node_agent_serves_its_cards_on_loopback(pool):
    url = f"http://127.0.0.1:{pool.agent_metrics_port}/metrics"
    def busy():  # cards with work on them (a stalled machine can have the jobs requeued for a moment)
        status, text = _get(url)
        fams = _families(text) if status == 200 and "gpupool_node_gpu_utilization_ratio{" in text else {}
        util = fams.get("gpupool_node_gpu_utilization_ratio")
        return util and max(s.value for s in util.samples) > 0 and text

    text = wait_for(busy, 90, "the agent's metrics with busy cards", pool)
    fams = _families(text)
    util = [s for s in fams["gpupool_node_gpu_utilization_ratio"].samples]
    assert len(util) == 16 and max(s.value for s in util) > 0 and all(0 <= s.value <= 1 for s in util)
    assert sum(s.value for s in fams["gpupool_node_jobs_running"].samples) >= 5
    assert sum(s.value for s in fams["gpupool_node_records_published"].samples
               if s.labels.get("kind") == "gpu.telemetry") > 0
    assert fams["gpupool_node_gpu_memory_used_bytes"].type == "gauge"


def test_telemetry_history_reaches_clickhouse_split_by_workload_and_tenant(pool):
    # the first full minutes of log time close within a few minutes of the fleet's start: on a loaded machine a
    # tenant's jobs may start (or be requeued) after the first minute has closed, so wait for both tenants' use
    rows = wait_for(lambda: (rs := pool.query("SELECT workload, tenant, sum(util_permille) AS u FROM "
                                              "gpupool.telemetry_by_job GROUP BY workload, tenant ORDER BY workload, "
                                              "tenant")) and {r["tenant"] for r in rs} >= {"acme", "globex"} and rs,
                    240, "closed minutes of telemetry of both tenants' jobs", pool)
    assert {r["workload"] for r in rows} >= {"training"}
    assert all(r["u"] > 0 for r in rows)
    # every card, idle ones included (each node's minute closes on that node's next batch)
    wait_for(lambda: pool.query("SELECT uniqExact(gpu_uuid, mig_uuid) AS n FROM gpupool.telemetry_minutes FINAL")[0][
        "n"] == 16, 90, "a minute of every card", pool)
    alice = pool.client("alice").api("/api/telemetry", {"by": "tenant"})
    assert {r[1] for r in alice["rows"]} == {"acme"} and "pool" not in alice  # a tenant sees its own use only
    # a minute with the whole fleet's capacity (capacity_milli): on a starved machine a node's heartbeats may be late
    # enough for it to be judged silent in some minute, which then rightly counts less
    pool_doc = wait_for(lambda: [r for r in pool.client().api("/api/pool")["rows"] if r[1] == 16_000], 90,
                        "a pool minute with the whole fleet's capacity", pool)
    assert pool_doc and all(r[1] <= 16_000 for r in pool.client().api("/api/pool")["rows"])


# ---------------------------------------------------------------- the dashboard in a real browser


@pytest.fixture(scope="module")
def browser():
    if chromium_path() is None:
        pytest.fail("no chromium: `make browser` installs Debian's (apt-get install chromium), or set "
                    "GPUPOOL_CHROMIUM")
    with Browser() as b:
        yield b


def test_every_page_loads_without_errors_and_shows_the_jobs(pool, browser):
    base = f"http://127.0.0.1:{pool.web_port}"
    browser.sign_in(base, "admin", pool.client().creds.token)

    def shown():  # every job running now is on the cluster page, on its card
        running = [j for j, r in job_states(pool).items() if r["state"] == "running" and j in pool.jobs]
        text = browser.open(base, "cluster")
        return len(running) >= 3 and all(j in text for j in running) and text

    cluster = wait_for(shown, 120, "the running jobs on the cluster page", pool)
    assert "acme/" in cluster and "globex/" in cluster
    assert browser.eval("document.querySelectorAll('#cluster-grid .card').length") == 16
    assert browser.eval("document.querySelectorAll('#cluster-grid .card.full, #cluster-grid .card.part').length") >= 5
    for route, want in (("utilization", "Training vs inference"), ("queue", "Waiting jobs"),
                        ("tenants", "acme"), ("jobs", "acme/finetune-7b"), ("services", "acme/chat")):
        text = browser.open(base, route)
        assert want in text, (route, text[:1500])
        assert browser.eval("!document.getElementById('page-error')"), text[:500]
    jobs = browser.open(base, "jobs")
    assert all(j in jobs for j in pool.jobs)
    job = browser.open(base, "job/acme%2Ftrain-llm")
    assert "H100-80GB" in job and "cmd.place" in job and "Timeline" in job and "slowdown" in job
    service = browser.open(base, "service/acme%2Fchat")
    assert "Elastic actions" in service and "horizontal_up" in service
    assert browser.errors == []


def test_each_role_sees_its_own_and_a_tenant_cannot_open_another_tenants_job(pool, browser):
    base = f"http://127.0.0.1:{pool.web_port}"
    browser.sign_in(base, "alice", pool.client("alice").creds.token, "jobs")
    mine = browser.text("#page")
    assert "acme/train-llm" in mine and "globex/" not in mine
    cluster = browser.open(base, "cluster")
    assert "acme/train-llm" in cluster and "globex" not in cluster and "a job of another tenant" in cluster
    tenants = browser.open(base, "tenants")
    assert "acme" in tenants and "globex" not in tenants
    other = browser.open(base, "job/globex%2Fpretrain")
    assert "Not found" in other and "pretrain" not in browser.text("#job-timeline")
    assert browser.eval("document.getElementById('nav-tenants') !== null")
    # finance: bills and the pool, no job pages
    browser.sign_in(base, "fin", pool.client("fin").creds.token, "tenants")
    assert "globex" in browser.text("#page") and "acme" in browser.text("#page")
    assert "Not for your role" in browser.open(base, "job/acme%2Ftrain-llm")
    # a wrong token is refused at sign-in and nothing is shown
    browser.goto(f"{base}/ui/")
    browser.eval("sessionStorage.clear(); true")
    browser.expected = (401, 404)
    browser.sign_in_attempt = None
    browser.goto(f"{base}/ui/#/cluster")
    browser.eval("document.getElementById('signin-name').value = 'alice';"
                 "document.getElementById('signin-token').value = 'not-her-token';"
                 "document.getElementById('signin-submit').click(); true")
    browser.wait_for("document.getElementById('signin-error').textContent.length > 0")
    assert browser.eval("document.getElementById('page').children.length") == 0
    assert [e for e in browser.errors if "401" not in e] == []


def test_static_files_hold_no_data_and_stay_inside(pool):
    base = f"http://127.0.0.1:{pool.web_port}"
    status, body = _get(f"{base}/ui/")
    assert status == 200 and "Sign in" in body and "acme" not in body
    for bad in ("/ui/../api.py", "/ui/__init__.py", "/ui/vendor/../../app.py", "/ui/%2e%2e/app.py"):
        assert _get(base + bad)[0] == 404, bad
    assert _get(f"{base}/ui/vendor/uplot/uPlot.iife.min.js")[0] == 200


def test_screenshots(pool, browser, tmp_path):
    """Every page renders to a real picture (GPUPOOL_SCREENSHOTS=DIR keeps them; docs/ has those of
    `python -m tests.ui_scenario docs`)."""
    shots = screenshots(browser, pool, Path(os.environ.get("GPUPOOL_SCREENSHOTS") or tmp_path))
    assert len(shots) >= 7 and all(p.stat().st_size > 10_000 for p in shots)


# ---------------------------------------------------------------- explanations on the live stack


def test_explain_and_history_read_at_a_glance_and_a_closed_pipe_is_quiet(pool):
    import subprocess
    import sys

    from tests.live import cli

    text = cli(pool, "explain", "train-llm", user="alice")
    lines = text.splitlines()
    assert lines[0].startswith("acme/train-llm  tier online-training") and "isolation" in lines[0]
    assert "cmd.place" in text and "[GpuFit]" in text and "H100-80GB" in text
    assert not any(ln.rstrip().endswith(":") for ln in lines)  # no reason printed as a bare "Code:"
    assert lines[-1].startswith("cost so far: ") and "GPU-seconds" in lines[-1]
    history = cli(pool, "history", "train-llm", user="alice")
    assert "placed on node-" in history and "cost so far" in history
    # another tenant's job named by a tenant's member: read as one of its own, and said so -- nothing of globex's
    for verb in ("explain", "history"):
        out = cli(pool, verb, "globex/pretrain", user="alice", check=False)
        assert out.returncode == 1 and "pretrain" in out.stdout, out
        assert out.stdout.strip() == ("no job acme/globex/pretrain on record: alice is a member of tenant 'acme' and "
                                      "names its jobs alone, so 'globex/pretrain' was read as acme's job "
                                      "'globex/pretrain'"), out.stdout
    env = {**os.environ, **pool.env, "GPUPOOL_USER": "alice"}
    for argv in (["explain", "train-llm"], ["history", "train-llm"], ["jobs"]):
        out = subprocess.run(["bash", "-c", "set -o pipefail; " + " ".join([sys.executable, "-m", "agents.cli", *argv])
                              + " | head -1"], env=env, capture_output=True, text=True, timeout=120)
        assert "Traceback" not in out.stderr and "BrokenPipe" not in out.stderr, out.stderr
