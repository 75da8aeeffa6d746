"""Issue #33 items 4-6 on the real broker, worker and simulated fleet, with real processes: the shipped model server
(infra/programs/model_server.py) as acme's service's replicas, the router's nginx in front of them.

1. readiness: a replica that runs but whose /health does not answer yet (its warm-up) is not an endpoint; once its
   node's probe got a 200 (replica.ready) and the autoscaler shifted traffic to it, it is, with its address and port;
2. the router: `gpupool router` renders nginx's upstream from the endpoints; a request through nginx reaches the
   ready, serving replica, never the warm one beside it;
3. scraped load: traffic through nginx saturates the replica; its node scrapes vLLM's names into replica.metrics,
   the autoscaler folds them into inference.load (source autoscaler) and scales out on them; the new replica takes
   traffic through nginx once it is shifted to;
4. drain: the service removed, its replicas leave the endpoints (and nginx) while their processes still answer (the
   node's drain period, GPUPOOL_DRAIN_S), and only then are stopped;
5. tenants: globex cannot read acme's endpoints, by either path or by its own name for them.

Waits are on conditions; the drain period (15 s) is far longer than the sink's lag, which is what item 4 rests on."""
from __future__ import annotations

import json
import os
import shutil
import threading
import urllib.error
import urllib.request
from pathlib import Path

import orjson
import pytest

from agents.client import ApiFailure
from agents.node.serving import free_port
from agents.node.sim_agent import loopback
from infra.programs import model_server
from schemas.events import ServiceRemoved
from tests.live import cli, quotas, wait_for
from tests.program_helpers import need_python3, passable_dir

pytestmark = pytest.mark.broker

SERVICE = "acme/chat"
NODE_ADDRESS = loopback(0)  # the fleet's one node advertises 127.0.0.2: replicas are reached there
GIB = 1024


def _events(stack, kinds: tuple[str, ...]) -> list[dict]:
    rows = stack.query("SELECT kind, source, event_time_ms, payload FROM gpupool.events FINAL WHERE kind IN "
                       "{k:Array(String)} AND (JSONExtractString(payload, 'service_id') = {s:String} OR "
                       "startsWith(job_id, concat({s:String}, '/'))) ORDER BY event_time_ms, topic, partition, offset",
                       {"k": list(kinds), "s": SERVICE})
    return [{"kind": r["kind"], "source": r["source"], "t": int(r["event_time_ms"]), **orjson.loads(r["payload"])}
            for r in rows]


def _get(url: str, timeout: float = 30) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as exc:
        return exc.code, {}
    except (OSError, ValueError):
        return 0, {}


class Load:
    """`n` clients sending requests through the router back to back, counting which replica answered."""

    def __init__(self, url: str, n: int):
        self.url, self.n = url, n
        self.stop = threading.Event()
        self.by_replica: dict[str, int] = {}
        self.errors = 0
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._client, daemon=True) for _ in range(n)]

    def _client(self):
        while not self.stop.is_set():
            code, doc = _get(self.url)
            with self.lock:
                if code == 200:
                    self.by_replica[doc["replica"]] = self.by_replica.get(doc["replica"], 0) + 1
                else:
                    self.errors += 1

    def __enter__(self):
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for t in self.threads:
            t.join(60)


def test_a_service_served_through_nginx_from_ready_replicas_scaled_on_scraped_load(stack):
    need_python3()
    with passable_dir("gpupool-serve-") as roots:
        script = roots / "model_server.py"
        shutil.copy(model_server.__file__, script)
        os.chmod(script, 0o644)
        router_dir = roots / "router"
        try:
            _scenario(stack, roots, script, router_dir)
        finally:
            stack.stop_process("router")
            pid_file = router_dir / "nginx.pid"  # the router stops its nginx; if it could not, the test does
            if pid_file.exists():
                try:
                    os.kill(int(pid_file.read_text().strip()), 9)
                except (OSError, ValueError):
                    pass


def _scenario(stack, roots: Path, script: Path, router_dir: Path) -> None:
    stack.extra_env.update({"GPUPOOL_JOBS_ROOT": str(roots / "jobs"), "GPUPOOL_CHECKPOINT_ROOT": str(roots / "ckpt"),
                            "GPUPOOL_DRAIN_S": "15", "GPUPOOL_ROUTER_RAMP_S": "2", "GPUPOOL_PROBE_S": "0.3"})
    fleet = roots / "fleet.yaml"
    fleet.write_text("nodes:\n  - {name: n1, model: A100-80GB, gpus: 2}\n")
    stack.start_worker()
    stack.start_agent(str(fleet))
    stack.add_user("alice", "tenant", "acme")
    stack.add_user("bob", "tenant", "globex")
    quotas(stack, "acme", "globex")
    wait_for(lambda: stack.stats()["scheduler"]["nodes"] == 1, 60, "the fleet in the scheduler", stack)
    alice, bob = stack.client("alice"), stack.client("bob")
    # a replica: 2 requests at a time, 40 ms of work at a whole card (80 ms at its half), a 5 s warm-up; declared
    # with the CLI, the replicas' program after `--`
    cli(stack, "service", "declare", "chat", "--compute", "500", "--memory-gib", "8", "--replica-qps", "8",
        "--min-replicas", "1", "--max-replicas", "2", "--latency-ms", "150", "--scale-in-stable-s", "5",
        "--scale-in-cooldown-s", "5", "--port", "0", "--metrics", "vllm", "--",
        "python3", str(script), "--warmup-s", "5", "--base-ms", "40", "--slots", "2", user="alice")
    (declared,) = [e for e in _events(stack, ("service.declared",))] or [None]
    assert declared is None or (declared["serve"]["metrics"] == "vllm" and declared["command"][0] == "python3")

    def endpoints(client=alice, name="chat"):
        return client.api("/api/service/endpoints", {"service": name})

    # 1. readiness: running (job.started heard) is not ready; the probe's answer and the shift make the endpoint
    seen_running_not_ready = []

    def first_ready():
        try:
            doc = endpoints()
        except ApiFailure as exc:  # the declaration not in the store yet
            assert "404" in str(exc), exc
            return None
        started = {e["job_id"] for e in _events(stack, ("job.started",))}
        shifted = {j for e in _events(stack, ("service.scaled",)) if e["action"] == "traffic_shift" for j in e["jobs"]}
        if not doc["ready"] and started & shifted == set() and started:
            seen_running_not_ready.append(sorted(started))
        return doc["ready"]
    (r1,) = wait_for(first_ready, 120, "the first replica ready and serving", stack)
    assert seen_running_not_ready, "never saw a started replica before its readiness: the warm-up is too short"
    assert r1["job_id"] == f"{SERVICE}/r1" and r1["address"] == NODE_ADDRESS and r1["port"] > 0, r1
    (ready,) = [e for e in _events(stack, ("replica.ready",)) if e["job_id"] == r1["job_id"]]
    (started,) = [e for e in _events(stack, ("job.started",)) if e["job_id"] == r1["job_id"]]
    assert ready["port"] == r1["port"] and ready["t"] - started["t"] >= 4000, (started, ready)  # after the warm-up
    shift = next(e for e in _events(stack, ("service.scaled",)) if e["action"] == "traffic_shift")
    assert shift["jobs"] == [r1["job_id"]] and shift["t"] >= ready["t"], shift
    assert _get(f"http://{NODE_ADDRESS}:{r1['port']}/health")[0] == 200  # the replica itself, on its port

    # 2. the router: nginx follows the endpoints; a request through it reaches the serving replica only
    listen = free_port()
    stack.spawn("router", "router", "--service", SERVICE, "--listen", str(listen), "--prefix", str(router_dir))
    url = f"http://127.0.0.1:{listen}/{SERVICE}/v1/completions"
    wait_for(lambda: _get(url)[0] == 200, 60, "a request through nginx answered", stack)
    conf = (router_dir / "nginx.conf").read_text()
    assert f"server {NODE_ADDRESS}:{r1['port']} weight=" in conf, conf
    warm = [r for r in endpoints()["replicas"] if r["state"] == "warm"]
    answers = {_get(url)[1].get("replica") for _ in range(20)}
    assert answers == {r1["job_id"]}, (answers, warm)  # the warm replica beside it takes none

    # 3. scraped load drives a scale-out: 10 clients through nginx saturate r1 (2 slots: kv-cache use 100 %)
    with Load(url, 10) as load:
        up = wait_for(lambda: [e for e in _events(stack, ("service.scaled",)) if e["action"] == "horizontal_up"
                               and any(r["code"] in ("UtilizationHigh", "LatencyOverTarget") for r in e["reasons"])],
                      120, "a scale-out on the scraped load", stack)[0]
        new = up["jobs"]
        assert new and r1["job_id"] not in new, up
        loads = [e for e in _events(stack, ("inference.load",)) if e["source"] == "autoscaler" and e["t"] <= up["t"]]
        assert loads and loads[-1]["qps"] > 0 and loads[-1]["util_pct"] >= 85, loads[-3:]
        assert _events(stack, ("replica.metrics",)), "no scrape relayed"
        wait_for(lambda: any(e["action"] == "traffic_shift" and set(new) <= set(e["jobs"])
                             for e in _events(stack, ("service.scaled",))), 120, "the new replica shifted to", stack)
        wait_for(lambda: all(load.by_replica.get(j, 0) > 0 for j in new), 60,
                 "the new replica answering through nginx", stack)
    assert load.by_replica.get(r1["job_id"], 0) > 0, load.by_replica
    serving = [r for r in endpoints()["ready"]]
    assert {r["job_id"] for r in serving} == {r1["job_id"], *new}, serving

    # 5. tenants: globex reads none of acme's endpoints, by path, by parameter, or by its own name for them
    for call in (lambda: endpoints(bob, SERVICE), lambda: endpoints(bob, "chat"),
                 lambda: bob.api(f"/api/service/{SERVICE}/endpoints")):
        with pytest.raises(ApiFailure, match="404"):
            call()
    assert alice.api(f"/api/service/{SERVICE}/endpoints")["ready"]  # the path form, for its owner
    table = cli(stack, "service", "endpoints", "chat", user="alice")
    assert r1["job_id"] in table and str(r1["port"]) in table and "serving" in table, table
    assert cli(stack, "service", "endpoints", "acme/chat", user="bob", check=False).returncode != 0

    # 4. drain: removed, the replicas leave the endpoints and nginx while their processes still answer
    ports = {r["job_id"]: r["port"] for r in serving}
    alice.send([ServiceRemoved(service_id="chat")])
    wait_for(lambda: not endpoints()["ready"], 60, "the replicas out of the endpoints", stack)
    wait_for(lambda: f"/{SERVICE}/ {{ return 503" in (router_dir / "nginx.conf").read_text(), 30,
             "nginx without upstream servers", stack)
    alive = {j: _get(f"http://127.0.0.1:{p}/health", 5)[0] for j, p in ports.items()}
    assert all(code == 200 for code in alive.values()), alive  # still running: left before the stop
    def drained():  # every replica's drain said (the nodes say each in its own time)
        got = [e for e in _events(stack, ("replica.unready",)) if e["reason"] == "draining"]
        return got if {e["job_id"] for e in got} >= set(ports) else None
    draining = wait_for(drained, 60, "every replica's drain", stack)
    assert {e["job_id"] for e in draining} >= set(ports), draining
    wait_for(lambda: all(_get(f"http://127.0.0.1:{p}/health", 2)[0] == 0 for p in ports.values()), 90,
             "the replicas stopped after their drain", stack)
