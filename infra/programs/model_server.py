#!/usr/bin/env python3
"""A small stand-in model server for a serving replica (issue #33 item 6, docs/serving.md). Pure standard library:
it runs as a plain process or in any image with python3.

HTTP on $PORT (the pool sets it for a replica of a service that declares `serve`; --port wins):

- `POST /v1/completions` (or `GET /generate`): one "inference". At most --slots requests run at once, the rest wait
  in a queue (first come, first served). A request's service time is
  `base_ms x 1000 / share_milli x (1 + (running - 1) / slots)`: it grows with the requests running beside it and
  shrinks with the replica's compute share. The answer is JSON: {"replica", "latency_ms", "queued_ms"}.
- `GET /health`: 200 once the warm-up (--warmup-s: "loading the model") is over, 503 before it and while draining.
- `GET /metrics`: Prometheus text with vLLM's names: `vllm:num_requests_running`, `vllm:num_requests_waiting`,
  `vllm:e2e_request_latency_seconds` (histogram), `vllm:kv_cache_usage_perc` (running / slots),
  `vllm:request_success_total`.

The compute share: --share-milli, else the file named by $GPUPOOL_SHARE_FILE (the node rewrites it when the replica is
resized: a vertical boost is felt by the next request), else $GPUPOOL_COMPUTE_MILLI, else 1000.

On SIGTERM it answers 503 on /health, takes no new request (503), lets the running and queued ones finish (at most
--drain-s) and exits 0.

    python3 model_server.py [--port N] [--base-ms 40] [--slots 4] [--warmup-s 2] [--share-milli M]
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 20.0)
MODEL = "gpupool-stand-in"


class State:
    def __init__(self, args):
        self.args = args
        self.lock = threading.Condition()
        self.running = 0
        self.waiting = 0
        self.success = 0
        self.buckets = [0] * len(BUCKETS_S)
        self.count = 0
        self.total_s = 0.0
        self.ready_at = time.monotonic() + args.warmup_s
        self.draining = False
        self.name = os.environ.get("GPUPOOL_JOB_ID", "model-server")

    def share_milli(self) -> int:
        if self.args.share_milli:
            return self.args.share_milli
        path = os.environ.get("GPUPOOL_SHARE_FILE")
        if path:
            try:
                with open(path) as f:
                    v = int(f.read().strip() or 0)
                if v > 0:
                    return v
            except (OSError, ValueError):
                pass
        try:
            v = int(os.environ.get("GPUPOOL_COMPUTE_MILLI", "0"))
        except ValueError:
            v = 0
        return v if v > 0 else 1000

    def ready(self) -> bool:
        return not self.draining and time.monotonic() >= self.ready_at

    def serve(self) -> tuple[float, float]:
        """One request: wait for a slot, work, give it back. (latency s, queued s)."""
        t0 = time.monotonic()
        with self.lock:
            self.waiting += 1
            while self.running >= self.args.slots:
                self.lock.wait()
            self.waiting -= 1
            self.running += 1
            running = self.running
        t1 = time.monotonic()
        work = self.args.base_ms / 1000 * 1000 / self.share_milli() * (1 + (running - 1) / self.args.slots)
        time.sleep(work)
        t2 = time.monotonic()
        latency = t2 - t0
        with self.lock:
            self.running -= 1
            self.success += 1
            self.count += 1
            self.total_s += latency
            for i, b in enumerate(BUCKETS_S):
                if latency <= b:
                    self.buckets[i] += 1
            self.lock.notify()
        return latency, t1 - t0

    def metrics(self) -> str:
        with self.lock:
            running, waiting, success = self.running, self.waiting, self.success
            buckets, count, total = list(self.buckets), self.count, self.total_s
        lab = f'model_name="{MODEL}"'
        out = [
            "# HELP vllm:num_requests_running Number of requests currently running on GPU.",
            "# TYPE vllm:num_requests_running gauge", f"vllm:num_requests_running{{{lab}}} {running}",
            "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.",
            "# TYPE vllm:num_requests_waiting gauge", f"vllm:num_requests_waiting{{{lab}}} {waiting}",
            "# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.",
            "# TYPE vllm:kv_cache_usage_perc gauge",
            f"vllm:kv_cache_usage_perc{{{lab}}} {min(1.0, running / self.args.slots):.4f}",
            "# HELP vllm:request_success_total Count of successfully processed requests.",
            "# TYPE vllm:request_success_total counter",
            f'vllm:request_success_total{{{lab},finished_reason="stop"}} {success}',
            "# HELP vllm:e2e_request_latency_seconds Histogram of end to end request latency in seconds.",
            "# TYPE vllm:e2e_request_latency_seconds histogram",
        ]
        for b, n in zip(BUCKETS_S, buckets):
            out.append(f'vllm:e2e_request_latency_seconds_bucket{{{lab},le="{b}"}} {n}')
        out.append(f'vllm:e2e_request_latency_seconds_bucket{{{lab},le="+Inf"}} {count}')
        out.append(f"vllm:e2e_request_latency_seconds_sum{{{lab}}} {total:.6f}")
        out.append(f"vllm:e2e_request_latency_seconds_count{{{lab}}} {count}")
        return "\n".join(out) + "\n"


def handler(state: State):
    class H(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt, *a):  # quiet: a replica's log is its own output, not an access log
            pass

        def _send(self, code: int, body: bytes, ctype: str = "application/json") -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _infer(self) -> None:
            n = int(self.headers.get("Content-Length") or 0)
            if n:
                self.rfile.read(min(n, 1 << 20))
            if state.draining:
                return self._send(503, b'{"error": "draining"}')
            latency, queued = state.serve()
            self._send(200, json.dumps({"replica": state.name, "latency_ms": round(latency * 1000, 1),
                                        "queued_ms": round(queued * 1000, 1)}).encode())

        def do_GET(self):  # noqa: N802 - http.server's name
            path = self.path.split("?", 1)[0]
            if path == "/health":
                return self._send(200 if state.ready() else 503, b'{"ready": %s}' % (b"true" if state.ready()
                                                                                     else b"false"))
            if path == "/metrics":
                return self._send(200, state.metrics().encode(), "text/plain; version=0.0.4")
            if path in ("/generate", "/v1/completions"):
                return self._infer()
            self._send(404, b'{"error": "not found"}')

        def do_POST(self):  # noqa: N802
            if self.path.split("?", 1)[0] in ("/v1/completions", "/generate"):
                return self._infer()
            self._send(404, b'{"error": "not found"}')

    return H


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--port", type=int, default=int(os.environ.get("PORT") or os.environ.get("GPUPOOL_PORT") or 0))
    ap.add_argument("--host", default="0.0.0.0")
    ap.add_argument("--base-ms", type=float, default=40.0)
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--warmup-s", type=float, default=2.0)
    ap.add_argument("--share-milli", type=int, default=0)
    ap.add_argument("--drain-s", type=float, default=30.0)
    args = ap.parse_args(argv)
    if args.port <= 0 or args.slots <= 0 or args.base_ms <= 0:
        print("model_server: want --port (or $PORT), --slots and --base-ms > 0", file=sys.stderr)
        return 2
    state = State(args)
    server = ThreadingHTTPServer((args.host, args.port), handler(state))
    server.daemon_threads = True

    def term(*_):
        state.draining = True

        def finish():
            deadline = time.monotonic() + args.drain_s
            while time.monotonic() < deadline:
                with state.lock:
                    if state.running == 0 and state.waiting == 0:
                        break
                time.sleep(0.05)
            server.shutdown()
        threading.Thread(target=finish, daemon=True).start()

    signal.signal(signal.SIGTERM, term)
    print(f"serving on {args.host}:{args.port} (share {state.share_milli()} milli, {args.slots} slots, "
          f"warm-up {args.warmup_s} s)", flush=True)
    server.serve_forever()
    print(f"stopped after {state.success} requests", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
