"""Serving replicas, pure parts (issue #33 items 4 and 5, docs/serving.md): the Prometheus scrape parser for vLLM's and
SGLang's names, the fold of scrapes into a service's inference.load, the endpoints fold (ready only after the probe,
traffic only after the shift, ramped weights, drained before a stop), the autoscaler counting a serving replica ready
only once its probe answered and scaling out on scraped load, and the schema rules (PORT is the pool's)."""
from __future__ import annotations

import time

import pytest
from pydantic import ValidationError

from agents.node.fleet import make_node
from agents.node.scrape import parse, replica_metrics
from agents.scheduler.core import ElasticScheduler
from agents.scheduler.elastic import ElasticConfig
from agents.scheduler.quota import open_ledger
from infra.programs import model_server
from schemas.envelope import envelope
from schemas.events import (
    JobCancelled, JobRequested, JobStarted, JobStopped, PlaceJob, ReleaseJob, ReplicaMetrics, ReplicaReady,
    ReplicaUnready, ServiceDeclared, ServiceScaled,
)
from schemas.program import Serve
from streams.folds.serving import FULL_WEIGHT, Endpoints, LoadFold, quantile_ms

VLLM = """# HELP vllm:num_requests_running Number of requests currently running on GPU.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="m"} 3.0
vllm:num_requests_waiting{model_name="m"} 5.0
vllm:kv_cache_usage_perc{model_name="m"} 0.625
vllm:request_success_total{finished_reason="stop",model_name="m"} 100.0
vllm:request_success_total{finished_reason="length",model_name="m"} 20.0
vllm:e2e_request_latency_seconds_bucket{le="0.1",model_name="m"} 50.0
vllm:e2e_request_latency_seconds_bucket{le="0.5",model_name="m"} 110.0
vllm:e2e_request_latency_seconds_bucket{le="+Inf",model_name="m"} 120.0
vllm:e2e_request_latency_seconds_sum{model_name="m"} 30.5
vllm:e2e_request_latency_seconds_count{model_name="m"} 120.0
garbage line here
"""

SGLANG = """# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="m"} 7
sglang:num_queue_reqs{model_name="m"} 2
sglang:token_usage{model_name="m"} 0.5
sglang:num_requests_total{model_name="m"} 42
sglang:e2e_request_latency_seconds_bucket{le="0.25",model_name="m"} 40
sglang:e2e_request_latency_seconds_bucket{le="+Inf",model_name="m"} 42
sglang:e2e_request_latency_seconds_count{model_name="m"} 42
sglang:e2e_request_latency_seconds_sum{model_name="m"} 5.0
"""


def test_the_scrape_reads_vllm_names_summing_label_sets():
    m = replica_metrics("vllm", VLLM)
    assert m == {"requests_total": 120, "running": 3, "waiting": 5, "latency_buckets": ((100, 50), (500, 110)),
                 "latency_count": 120, "latency_sum_ms": 30500, "kv_cache_permille": 625}
    assert "garbage" not in parse(VLLM)


def test_the_scrape_reads_sglang_names():
    m = replica_metrics("sglang", SGLANG)
    assert (m["requests_total"], m["running"], m["waiting"], m["kv_cache_permille"]) == (42, 7, 2, 500)
    assert m["latency_buckets"] == ((250, 40),) and m["latency_count"] == 42
    # the other flavour's names are not read: a vLLM page read as SGLang is all zeros
    assert replica_metrics("sglang", VLLM)["requests_total"] == 0
    with pytest.raises(ValueError):
        replica_metrics("tgi", VLLM)


def test_the_model_servers_own_page_parses():
    class Args:
        slots, warmup_s, share_milli = 4, 0.0, 500
    st = model_server.State(Args())
    st.success, st.count, st.running, st.waiting = 9, 9, 2, 1
    st.buckets = [0, 0, 0, 4, 9, 9] + [9] * (len(model_server.BUCKETS_S) - 6)
    m = replica_metrics("vllm", st.metrics())
    assert (m["requests_total"], m["running"], m["waiting"], m["kv_cache_permille"]) == (9, 2, 1, 500)
    assert dict(m["latency_buckets"])[50] == 4 and dict(m["latency_buckets"])[75] == 9


def _rm(job, at, total, waiting=0, running=0, buckets=(), count=0, cmd="c1", kv=0):
    return ReplicaMetrics(job_id=job, node="n1", command_id=cmd, scraped_ms=at, requests_total=total,
                          waiting=waiting, running=running, latency_buckets=buckets, latency_count=count,
                          kv_cache_permille=kv)


def test_scrapes_fold_into_one_service_sample_per_interval():
    f = LoadFold(interval_ms=2000)
    assert f.observe("acme/web", _rm("acme/web/r1", 0, 0), "c1", 0) is None  # nothing to compare with yet
    assert f.observe("acme/web", _rm("acme/web/r2", 0, 0, cmd="c2"), "c2", 100) is None
    assert f.observe("acme/web", _rm("acme/web/r1", 1000, 30, buckets=((100, 20), (500, 30)), count=30),
                     "c1", 1000) is None  # the first sample covers a whole interval
    s = f.observe("acme/web", _rm("acme/web/r2", 1000, 20, waiting=4, buckets=((100, 10), (500, 19)), count=20,
                                  cmd="c2", kv=900), "c2", 2100)
    assert s is not None and s.service_id == "acme/web" and not s.replica
    # 30 + 20 done in 1 s, plus r2's 4 waiting that were not there before: 54 offered requests/s
    assert s.qps == 54 and s.queue_depth == 4 and s.util_pct == 90
    assert s.p50_ms == 100 and s.p99_ms == 500  # 30 of 50 under 100 ms; 49 of 50 under 500 ms, the 50th beyond
    assert f.observe("acme/web", _rm("acme/web/r1", 2000, 60), "c1", 2500) is None  # within the interval
    # a restarted program (a counter that went back): its counters start over, no negative rate
    s2 = f.observe("acme/web", _rm("acme/web/r1", 3000, 5), "c1", 4200)
    assert s2 is None or s2.qps >= 0
    assert quantile_ms([], 0, 990) == 0 and quantile_ms([(10, 1)], 5, 990) == 10


def _env(payload, source, seq, t):
    return envelope(payload, source=source, seq=seq, time_ms=t)


def test_endpoints_appear_only_when_ready_and_shifted_ramp_up_and_drain_before_the_stop():
    e = Endpoints()
    serve = Serve(port=0, metrics="vllm")
    n = iter(range(1, 1000))
    fold = lambda p, t: e.fold(_env(p, "x", next(n), t))  # noqa: E731
    fold(ServiceDeclared(service_id="acme/web", tenant="acme", replica_compute_milli=500, replica_memory_mib=1024,
                         replica_qps=10, serve=serve, command=("python3", "s.py")), 0)
    fold(ServiceScaled(service_id="acme/web", action="horizontal_up", replicas=0, jobs=("acme/web/r1",)), 10)
    fold(PlaceJob(command_id="c1", job_id="acme/web/r1", tenant="acme", node="n1", assignments=(), serve=serve), 20)
    svc = e.of("acme/web")
    assert svc.doc(30, 0)["ready"] == [] and svc.doc(30, 0)["replicas"][0]["state"] == "starting"
    fold(JobStarted(job_id="acme/web/r1", node="n1", command_id="c1"), 40)
    fold(ReplicaReady(job_id="acme/web/r1", node="n1", command_id="c0", address="10.0.0.1", port=9000), 50)
    assert svc.doc(60, 0)["replicas"][0]["state"] == "starting"  # a superseded placement's word counts for nothing
    fold(ReplicaReady(job_id="acme/web/r1", node="n1", command_id="c1", address="10.0.0.1", port=9000), 1000)
    assert svc.doc(1000, 0)["ready"] == [] and svc.doc(1000, 0)["replicas"][0]["state"] == "warm"
    fold(ServiceScaled(service_id="acme/web", action="traffic_shift", replicas=1, jobs=("acme/web/r1",)), 2000)
    doc = svc.doc(2000, 10_000)
    (r,) = doc["ready"]
    assert (r["address"], r["port"], r["weight"]) == ("10.0.0.1", 9000, 1)
    assert svc.doc(7000, 10_000)["ready"][0]["weight"] == FULL_WEIGHT // 2
    assert svc.doc(12_000, 10_000)["ready"][0]["weight"] == FULL_WEIGHT
    # scaled in: out of rotation at once (draining), before the stop is even sent
    fold(ServiceScaled(service_id="acme/web", action="scale_in", replicas=0, jobs=("acme/web/r1",)), 20_000)
    doc = svc.doc(20_000, 10_000)
    assert doc["ready"] == [] and doc["replicas"][0]["state"] == "draining"
    fold(JobCancelled(job_id="acme/web/r1"), 20_001)
    fold(ReleaseJob(command_id="c2", job_id="acme/web/r1", node="n1"), 20_002)
    fold(ReplicaUnready(job_id="acme/web/r1", node="n1", command_id="c1", reason="draining", drain_ms=3000), 20_003)
    assert svc.doc(23_002, 0)["replicas"][0]["state"] == "draining"  # released: listed until its drain is over
    assert svc.doc(23_003, 0)["replicas"] == []  # no end is reported for a release: its drain period's end
    fold(JobStopped(job_id="acme/web/r1", node="n1", command_id="c1", progress_ms=0), 25_000)
    assert svc.doc(25_000, 0)["replicas"] == []
    # a node's report names the address the node advertises in its inventory, whatever else it says
    from schemas.events import NodeInventory
    fold(NodeInventory(node="n2", cpu_milli=1, memory_mib=1, address="10.9.9.9"), 25_500)
    fold(PlaceJob(command_id="c5", job_id="acme/web/r1", tenant="acme", node="n2", assignments=(), attempt=2), 25_600)
    fold(ReplicaReady(job_id="acme/web/r1", node="n2", command_id="c5", address="evil.example", port=7), 25_700)
    assert svc.doc(25_800, 0)["replicas"][0]["address"] == "10.9.9.9"
    # another tenant's replicas never enter acme's service
    fold(PlaceJob(command_id="c9", job_id="globex/web/r1", tenant="globex", node="n1", assignments=()), 26_000)
    assert e.of("globex/web") is None and [r["job_id"] for r in svc.doc(26_000, 0)["replicas"]] == ["acme/web/r1"]


def test_kept_warm_is_not_draining():
    e = Endpoints()
    seq = iter(range(1, 100))
    f = lambda p, t: e.fold(_env(p, "x", next(seq), t))  # noqa: E731
    f(ServiceDeclared(service_id="a/s", tenant="a", replica_compute_milli=500, replica_memory_mib=1, replica_qps=1,
                      serve=Serve()), 0)
    f(PlaceJob(command_id="c1", job_id="a/s/r1", tenant="a", node="n1", assignments=()), 1)
    f(ReplicaReady(job_id="a/s/r1", node="n1", command_id="c1", address="h", port=1), 2)
    f(ServiceScaled(service_id="a/s", action="traffic_shift", replicas=1, jobs=("a/s/r1",)), 3)
    from schemas.events import Reason
    f(ServiceScaled(service_id="a/s", action="scale_in", replicas=0, jobs=("a/s/r1",),
                    reasons=(Reason(code="KeptWarm", data={"jobs": "a/s/r1"}),)), 4)
    assert e.of("a/s").doc(5, 0)["replicas"][0]["state"] == "warm"


# ---------------------------------------------------------------- the autoscaler

def _sched(nodes=(("n1", "A100-80GB", 2),)):
    s = ElasticScheduler(ElasticConfig(warm_pool=0, training_share_pct=0, load_interval_ms=2000), ledger=open_ledger())
    seqs: dict[str, int] = {}
    out: list = []

    def feed(payload, source, t):
        seqs[source] = seqs.get(source, 0) + 1
        got = s.step(envelope(payload, source=source, seq=seqs[source], time_ms=t))
        out.extend(got)
        return got
    for n in nodes:
        inv = make_node(*n)
        feed(inv, f"{inv.node}/inventory", 0)
    return s, feed, out


def _decl(**kw):
    return ServiceDeclared(service_id="acme/web", tenant="acme", replica_compute_milli=500, replica_memory_mib=4096,
                           replica_qps=10, min_replicas=1, max_replicas=4, latency_target_ms=200,
                           command=("python3", "model_server.py"), serve=Serve(metrics="vllm"), **kw)


def test_a_serving_replica_is_ready_only_once_its_probe_answered_and_its_request_carries_the_program():
    s, feed, out = _sched()
    got = feed(_decl(), "gateway/acme", 1000)
    (req,) = [o.payload for o in got if o.kind == "job.requested"]
    assert req.serve == Serve(metrics="vllm") and req.command == ("python3", "model_server.py")
    (place,) = [o.payload for o in got if o.kind == "cmd.place"]
    assert place.serve == Serve(metrics="vllm") and place.command == ("python3", "model_server.py")
    src = f"n1/job/{place.job_id}"
    got = feed(JobStarted(job_id=place.job_id, node="n1", command_id=place.command_id), src, 2000)
    assert not [o for o in got if o.kind == "service.scaled"]  # started is not ready: no traffic yet
    got = feed(ReplicaReady(job_id=place.job_id, node="n1", command_id="other", address="h", port=5), src, 2500)
    assert not [o for o in got if o.kind == "service.scaled"]  # another placement's word
    got = feed(ReplicaReady(job_id=place.job_id, node="n1", command_id=place.command_id, address="h", port=5),
               src, 3000)
    (shift,) = [o.payload for o in got if o.kind == "service.scaled"]
    assert shift.action == "traffic_shift" and shift.jobs == (place.job_id,) and shift.took_ms == 2000


def _started_replica(feed):
    """acme/web declared at 1000 ms: its one replica placed on n1 and started at 1500 ms; (placement, its source)."""
    got = feed(_decl(), "gateway/acme", 1000)
    (place,) = [o.payload for o in got if o.kind == "cmd.place"]
    src = f"n1/job/{place.job_id}"
    feed(JobStarted(job_id=place.job_id, node="n1", command_id=place.command_id), src, 1500)
    return place, src


def test_scraped_metrics_become_inference_load_and_drive_a_scale_out():
    s, feed, out = _sched()
    place, src = _started_replica(feed)
    feed(ReplicaReady(job_id=place.job_id, node="n1", command_id=place.command_id, address="h", port=5), src, 2000)
    loads = []
    total, waiting = 0, 0
    for i in range(8):  # 30 requests/s on a replica made for 10, the queue growing, p99 well over 200 ms
        t = 3000 + i * 1000
        total += 30
        waiting += 5
        got = feed(ReplicaMetrics(job_id=place.job_id, node="n1", command_id=place.command_id, scraped_ms=t,
                                  requests_total=total, waiting=waiting, running=4,
                                  latency_buckets=((100, 0), (1000, total)), latency_count=total,
                                  kv_cache_permille=1000), src, t)
        loads += [o for o in got if o.kind == "inference.load"]
        if any(o.kind == "service.scaled" and o.payload.action == "horizontal_up" for o in got):
            break
    assert loads and all(o.source == "autoscaler" and not o.payload.replica for o in loads)
    assert loads[-1].payload.qps >= 30 and loads[-1].payload.p99_ms == 1000
    ups = [o.payload for o in out if o.kind == "service.scaled" and o.payload.action == "horizontal_up"
           and o.payload.jobs != (place.job_id,)]
    assert ups and ups[-1].jobs, [o.payload for o in out if o.kind == "service.scaled"]
    # the new replica's placement carries the program and the serving spec too
    new = [o.payload for o in out if o.kind == "cmd.place" and o.payload.job_id in ups[-1].jobs]
    assert new and all(p.serve is not None and p.command for p in new)


def test_replay_gives_the_same_samples():
    def run():
        s, feed, out = _sched()
        place, src = _started_replica(feed)
        for i in range(5):
            feed(ReplicaMetrics(job_id=place.job_id, node="n1", command_id=place.command_id, scraped_ms=i * 1000,
                                requests_total=i * 7), src, 2000 + i * 1000)
        return [(o.kind, o.payload) for o in out]
    assert run() == run()


# ---------------------------------------------------------------- schemas

def test_port_is_the_pools_and_serve_is_a_replicas():
    with pytest.raises(ValidationError, match="PORT"):
        JobRequested(job_id="j", tenant="t", compute_milli=1, gpu_memory_mib=1, command=("x",), env={"PORT": "1"})
    with pytest.raises(ValidationError, match="service_id"):
        JobRequested(job_id="j", tenant="t", compute_milli=1, gpu_memory_mib=1, serve=Serve())
    with pytest.raises(ValidationError):
        ServiceDeclared(service_id="s", tenant="t", replica_compute_milli=1, replica_memory_mib=1, replica_qps=1,
                        command=("x",), env={"GPUPOOL_PORT": "1"})
    with pytest.raises(ValidationError):
        Serve(readiness_path="health")  # a path, from the root
    with pytest.raises(ValidationError):
        Serve(metrics="tgi")


# ---------------------------------------------------------------- the router (nginx)

def test_the_rendering_holds_only_replicas_taking_traffic_with_stepped_weights(tmp_path):
    from agents.router import render

    docs = {"acme/chat": {"ready": [{"job_id": "acme/chat/r2", "address": "10.0.0.2", "port": 9002, "weight": 37},
                                    {"job_id": "acme/chat/r1", "address": "10.0.0.1", "port": 9001, "weight": 100}]},
            "acme/idle": {"ready": []}}
    text = render(docs, 8088, tmp_path)
    assert "server 10.0.0.1:9001 weight=100;" in text and "server 10.0.0.2:9002 weight=30;" in text
    assert text.index("10.0.0.1") < text.index("10.0.0.2")  # a stable order: no reload for a reordering
    assert "location /acme/idle/ { return 503" in text and "upstream svc_acme_idle" not in text
    assert render(docs, 8088, tmp_path) == text
    docs["acme/chat"]["ready"][0]["weight"] = 39  # within the same step: the same text, no reload
    assert render(docs, 8088, tmp_path) == text


def test_nginx_follows_the_endpoints_and_a_request_reaches_the_ready_replica(tmp_path):
    import http.server
    import threading
    import urllib.error
    import urllib.request

    from agents.router import NginxRouter
    from agents.node.serving import free_port

    class Backend(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            body = f"r1 {self.path}".encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass
    backend = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Backend)
    threading.Thread(target=backend.serve_forever, daemon=True).start()
    router = NginxRouter(tmp_path / "router", free_port())
    url = f"http://127.0.0.1:{router.listen_port}/acme/chat/v1/completions"

    def get():
        try:
            with urllib.request.urlopen(url, timeout=10) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, ""
        except OSError:
            return 0, ""
    def settled(code: int) -> tuple[int, str]:
        """The answer once three in a row are `code`: a reload's old workers may answer a moment longer."""
        deadline = time.monotonic() + 60
        run = 0
        got = get()
        while time.monotonic() < deadline:
            got = get()
            run = run + 1 if got[0] == code else 0
            if run >= 3:
                break
            time.sleep(0.1)
        return got
    try:
        router.start({"acme/chat": {"ready": []}})
        assert settled(503)[0] == 503  # no replica takes traffic yet
        ready = {"job_id": "acme/chat/r1", "address": "127.0.0.1", "port": backend.server_address[1], "weight": 100}
        assert router.update({"acme/chat": {"ready": [ready]}}) and router.reloads == 1
        assert not router.update({"acme/chat": {"ready": [ready]}})  # unchanged: no reload
        assert settled(200) == (200, "r1 /v1/completions")
        assert router.update({"acme/chat": {"ready": []}})  # drained: out of rotation
        assert settled(503)[0] == 503
    finally:
        router.stop()
        backend.shutdown()


# ---------------------------------------------------------------- a real node's executor (the NVML agent's)

def test_the_nvml_executor_gives_a_replica_its_port_probes_scrapes_and_drains_it(tmp_path, monkeypatch):
    """The shipped model server as a replica on the NVML agent's executor (fake NVML not needed: the executor
    alone): PORT set, replica.ready only after the warm-up, replica.metrics from its vLLM page, and on a release
    replica.unready (draining) while it still answers, then the stop."""
    import asyncio
    import sys

    from schemas.events import Assignment
    from tests.test_nvml_backend import Recorder, cmd, executor

    monkeypatch.setenv("GPUPOOL_PROBE_S", "0.1")
    monkeypatch.setenv("GPUPOOL_SCRAPE_S", "0.2")
    monkeypatch.setenv("GPUPOOL_DRAIN_S", "1")
    from agents.node.serving import http_get

    async def go():
        rec = Recorder()
        ex = executor("n1", rec, log_dir=tmp_path)
        p = PlaceJob(command_id="c1", job_id="acme/chat/r1", tenant="acme", node="n1", tier="inference",
                     assignments=(Assignment(gpu_uuid="GPU-aaaa", milli=500, memory_mib=1024),),
                     command=(sys.executable, model_server.__file__, "--warmup-s", "1"),
                     serve=Serve(metrics="vllm"))
        await ex.execute(cmd(p))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 30
        while "replica.metrics" not in rec.kinds() and loop.time() < deadline:
            await asyncio.sleep(0.05)
        (ready,) = [e for e, _, _ in rec.events if e.kind == "replica.ready"]
        status, _ = await http_get("127.0.0.1", ready.port, "/v1/completions")
        assert status == 200
        while not any(e.kind == "replica.metrics" and e.requests_total for e, _, _ in rec.events) \
                and loop.time() < deadline:
            await asyncio.sleep(0.05)
        before = len(rec.events)
        await ex.execute(cmd(ReleaseJob(command_id="c2", job_id=p.job_id, node="n1")))
        while "replica.unready" not in rec.kinds() and loop.time() < deadline:
            await asyncio.sleep(0.02)
        still, _ = await http_get("127.0.0.1", ready.port, "/health")  # drained, not yet stopped
        await ex.drain()
        gone, _ = await http_get("127.0.0.1", ready.port, "/health", timeout=1)
        return rec, ready, before, still, gone, p

    rec, ready, before, still, gone, p = asyncio.run(asyncio.wait_for(go(), 60))
    kinds = rec.kinds(p.job_id)
    assert kinds.index("job.started") < kinds.index("replica.ready") < kinds.index("replica.metrics")
    assert ready.address == "127.0.0.1" and ready.port > 0 and ready.command_id == "c1"
    metrics = [e for e, _, _ in rec.events if e.kind == "replica.metrics"]
    assert metrics[-1].requests_total >= 1 and metrics[-1].latency_count >= 1
    (unready,) = [e for e, _, _ in rec.events if e.kind == "replica.unready"]
    assert unready.reason == "draining" and still == 200 and gone == 0
    assert all(src == f"n1/job/{p.job_id}" for _, src, _ in rec.events)  # the job's own source, in order
