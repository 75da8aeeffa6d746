"""The demo's inference peak with real HTTP traffic (issue #33 item 6): a benchmark, not a test.

    .venv/bin/python -m bench.serving [--base-qps 8] [--peak-qps 45] [--base-s 25] [--peak-s 60] [--after-s 60]

A fresh local stack (broker, worker, a simulated node of two A100s running real processes) serves globex's `chat`
service with the shipped model server (infra/programs/model_server.py: 0.3-CU replicas, a vertical boost of 0.2 CU,
the seed's elastic settings: warm pool, 15 s scale-in windows), behind `gpupool router` (nginx, weights ramped over
GPUPOOL_ROUTER_RAMP_S = 5 s). An open-loop client sends requests through nginx at `base-qps`, then `peak-qps`, then
`base-qps` again (arrivals on a fixed schedule: a slow answer does not slow the arrivals, as real users do not wait
for each other), and records each request's latency and which replica answered.

The load the autoscaler sees is only what the node scraped from the replicas (`replica.metrics` -> `inference.load`,
source autoscaler): nothing is reported by hand. Printed:

- every elastic action (`service.scaled`) with the client-measured p99 over the 10 s before it and the 10 s after it
  (after its `took_ms`);
- the time from the load crossing its threshold (the first scraped sample whose p99 is over the SLO) to the vertical
  boost, and to the first request a replica added by the scale-out answered through nginx;
- p50/p99 per phase (before the peak, during it, after it) and per 5 s window.

The last line is `RESULT {json}`. Numbers depend on the machine: on a small shared one the stack itself competes with
the model servers for the CPU.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import orjson

from agents.node.serving import free_port
from agents.stack import Stack
from infra import config as config_mod
from infra.programs import model_server
from schemas.events import QuotaSet, ServiceDeclared
from schemas.program import Serve

SERVICE = "globex/chat"
TARGET_MS = 250


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return round(s[min(len(s) - 1, int(q * len(s)))], 1)


class Client:
    """Open-loop arrivals through the router: each request at its scheduled time, on a pool of threads."""

    def __init__(self, url: str):
        self.url = url
        self.results: list[tuple[float, float, int, str]] = []  # (sent wall s, latency ms, status, replica)
        self.lock = threading.Lock()
        self.pool = ThreadPoolExecutor(max_workers=128)

    def _one(self, sent: float) -> None:
        try:
            with urllib.request.urlopen(urllib.request.Request(self.url, data=b"{}", method="POST"), timeout=60) as r:
                doc = json.loads(r.read())
                status, replica = r.status, doc.get("replica", "")
        except urllib.error.HTTPError as exc:
            status, replica = exc.code, ""
        except OSError:
            status, replica = 0, ""
        with self.lock:
            self.results.append((sent, (time.time() - sent) * 1000, status, replica))

    def phase(self, qps: float, seconds: float) -> None:
        start = time.monotonic()
        n = int(qps * seconds)
        for i in range(n):
            delay = start + i / qps - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            self.pool.submit(self._one, time.time())


def events(stack: Stack, kinds: tuple[str, ...]) -> list[dict]:
    rows = stack.query("SELECT kind, source, event_time_ms, payload FROM gpupool.events FINAL WHERE kind IN "
                       "{k:Array(String)} ORDER BY event_time_ms", {"k": list(kinds)})
    return [{"kind": r["kind"], "source": r["source"], "t": int(r["event_time_ms"]) / 1000,
             **orjson.loads(r["payload"])} for r in rows]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-qps", type=float, default=8)
    ap.add_argument("--peak-qps", type=float, default=45)
    ap.add_argument("--base-s", type=float, default=25)
    ap.add_argument("--peak-s", type=float, default=60)
    ap.add_argument("--after-s", type=float, default=60)
    ap.add_argument("--keep", action="store_true", help="keep the stack's directory")
    args = ap.parse_args(argv)

    roots = Path(tempfile.mkdtemp(prefix="gpupool-bench-serving-", dir="/tmp"))
    os.chmod(roots, 0o711)
    script = roots / "model_server.py"
    shutil.copy(model_server.__file__, script)
    os.chmod(script, 0o644)
    stack = Stack(home=roots / "home", libs_home=config_mod.load().home)
    stack.extra_env.update({"GPUPOOL_JOBS_ROOT": str(roots / "jobs"), "GPUPOOL_CHECKPOINT_ROOT": str(roots / "ckpt"),
                            "GPUPOOL_DRAIN_S": "5", "GPUPOOL_ROUTER_RAMP_S": "5", "GPUPOOL_PROBE_S": "0.3",
                            "GPUPOOL_GRACE_S": "inference=10"})
    router_dir = roots / "router"
    try:
        stack.start_broker()
        fleet = roots / "fleet.yaml"
        fleet.write_text("nodes:\n  - {name: a100-1, model: A100-80GB, gpus: 2}\n")
        stack.start_worker()
        stack.start_agent(str(fleet))
        stack.add_user("bob", "tenant", "globex")
        stack.client().send([QuotaSet(tenant="globex", gpu_milli=4000)])
        deadline = time.monotonic() + 120
        while stack.stats()["scheduler"]["nodes"] < 1 and time.monotonic() < deadline:
            time.sleep(0.5)
        bob = stack.client("bob")
        bob.send([ServiceDeclared(
            service_id="chat", tenant="globex", replica_compute_milli=300, replica_memory_mib=8 * 1024,
            boost_compute_milli=200, replica_qps=15, min_replicas=1, max_replicas=5, latency_target_ms=TARGET_MS,
            scale_in_stable_s=15, scale_in_cooldown_s=15,
            command=("python3", str(script), "--warmup-s", "6", "--base-ms", "20", "--slots", "4"),
            serve=Serve(metrics="vllm"))])
        listen = free_port()
        stack.spawn("router", "router", "--service", SERVICE, "--listen", str(listen), "--prefix", str(router_dir))
        url = f"http://127.0.0.1:{listen}/{SERVICE}/v1/completions"
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(url, data=b"{}", timeout=10) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            time.sleep(0.5)
        else:
            raise SystemExit("the service never answered through the router")
        time.sleep(5)  # the warm pool settles
        client = Client(url)
        marks = {"start": time.time()}
        client.phase(args.base_qps, args.base_s)
        marks["peak"] = time.time()
        client.phase(args.peak_qps, args.peak_s)
        marks["after"] = time.time()
        client.phase(args.base_qps, args.after_s)
        marks["end"] = time.time()
        client.pool.shutdown(wait=True)
        time.sleep(3)
        report(stack, client, marks)
    finally:
        stack.stop_process("router")
        pid = router_dir / "nginx.pid"
        if pid.exists():
            try:
                os.kill(int(pid.read_text().strip()), 9)
            except (OSError, ValueError):
                pass
        stack.stop()
        if not args.keep:
            shutil.rmtree(roots, ignore_errors=True)
    return 0


def report(stack: Stack, client: Client, marks: dict) -> None:
    res = sorted(client.results)
    ok = [r for r in res if r[2] == 200]
    errors = len(res) - len(ok)

    def window(a: float, b: float) -> list[float]:
        return [lat for sent, lat, status, _ in ok if a <= sent < b]

    actions = [e for e in events(stack, ("service.scaled",)) if e["t"] >= marks["start"]]
    loads = [e for e in events(stack, ("inference.load",)) if e["source"] == "autoscaler" and e["t"] >= marks["start"]]
    print(f"{len(res)} requests through nginx, {errors} not answered 200; SLO p99 {TARGET_MS} ms")
    print("\nelastic actions (client-measured p99 through the router, 10 s before / 10 s after):")
    rows = []
    for a in actions:
        before = window(a["t"] - 10, a["t"])
        after = window(a["t"] + a["took_ms"] / 1000, a["t"] + a["took_ms"] / 1000 + 10)
        rows.append({"at_s": round(a["t"] - marks["peak"], 1), "action": a["action"], "jobs": a["jobs"],
                     "replicas": a["replicas"], "took_ms": a["took_ms"], "p99_before_ms": pct(before, 0.99),
                     "p99_after_ms": pct(after, 0.99), "reasons": [r["code"] for r in a["reasons"]]})
        r = rows[-1]
        print(f"  {r['at_s']:+7.1f}s  {r['action']:<16} {','.join(j.rsplit('/', 1)[-1] for j in r['jobs']):<10} "
              f"serving {r['replicas']}  took {r['took_ms']:>6} ms  p99 {r['p99_before_ms']} -> {r['p99_after_ms']} ms"
              f"  ({', '.join(r['reasons'])})")
    hot = next((e for e in loads if e["t"] >= marks["peak"] and e["p99_ms"] > TARGET_MS), None)
    boost = next((a for a in actions if a["action"] == "vertical_up"), None)
    up = next((a for a in actions if a["action"] == "horizontal_up" and a["t"] >= marks["peak"]), None)
    new = set(up["jobs"]) if up else set()
    first_new = next((sent + lat / 1000 for sent, lat, _, rep in ok if rep in new and sent >= up["t"] - 1), None) \
        if up else None
    crossing = {"threshold_crossed_s": round(hot["t"] - marks["peak"], 1) if hot else None,
                "boost_after_crossing_s": round(boost["t"] - hot["t"], 1) if hot and boost else None,
                "scale_out_after_crossing_s": round(up["t"] - hot["t"], 1) if hot and up else None,
                "new_replica_serving_after_crossing_s": round(first_new - hot["t"], 1) if hot and first_new else None}
    print("\nfrom the load crossing its threshold (first scraped sample with p99 over the SLO, "
          f"{crossing['threshold_crossed_s']} s into the peak):")
    print(f"  vertical boost after {crossing['boost_after_crossing_s']} s; scale-out decided after "
          f"{crossing['scale_out_after_crossing_s']} s; first request answered by a new replica after "
          f"{crossing['new_replica_serving_after_crossing_s']} s")
    phases = {name: window(a, b) for name, a, b in (("before", marks["start"], marks["peak"]),
                                                     ("peak", marks["peak"], marks["after"]),
                                                     ("after", marks["after"], marks["end"]))}
    print("\nper phase (client-measured through nginx):")
    summary = {}
    for name, lats in phases.items():
        summary[name] = {"requests": len(lats), "p50_ms": pct(lats, 0.5), "p99_ms": pct(lats, 0.99)}
        print(f"  {name:<7} {len(lats):>5} requests  p50 {summary[name]['p50_ms']} ms  p99 {summary[name]['p99_ms']} ms")
    print("\nper 5 s window from the peak's start: (s, requests, p99 ms, replicas answering)")
    timeline = []
    t = marks["start"]
    while t < marks["end"]:
        lats = window(t, t + 5)
        reps = sorted({rep.rsplit("/", 1)[-1] for sent, _, _, rep in ok if t <= sent < t + 5})
        timeline.append([round(t - marks["peak"]), len(lats), pct(lats, 0.99), reps])
        print(f"  {timeline[-1][0]:+5d}s  {len(lats):>4}  {pct(lats, 0.99)!s:>8}  {' '.join(reps)}")
        t += 5
    print("RESULT " + json.dumps({"actions": rows, "crossing": crossing, "phases": summary, "errors": errors,
                                  "timeline": timeline}))


if __name__ == "__main__":
    raise SystemExit(main())
