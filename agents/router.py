"""The serving router (issue #33 item 4, docs/serving.md, "The router"): Debian's nginx in front of the services'
ready replicas, its `upstream` blocks rendered from their endpoints and reloaded when the rendering changes.

`gpupool router --service acme/chat [--service ...] [--listen PORT]` asks the HTTP API for each service's endpoints
(`/api/service/NAME/endpoints`, as the principal it runs as: an operator or the service principal for any service, a
tenant for its own) every GPUPOOL_ROUTER_POLL_S (0.5 s) and keeps an nginx of its own (its own prefix directory,
configuration, pid file and port) proxying `http://HOST:PORT/SERVICE/...` to the service's replicas:

- only replicas that take traffic are upstream servers: ready (their probe answered) and shifted to by the
  autoscaler; a draining one (scaled in, its stop sent, or its node said it is draining) is left out at once, before
  its node stops it (the node waits GPUPOOL_DRAIN_S first);
- a new replica's weight ramps from 1 to 100 over GPUPOOL_ROUTER_RAMP_S (10 s), in steps of `WEIGHT_STEP`, so the
  configuration changes a bounded number of times during a ramp; nginx's weights are relative, so a replica at
  weight 10 beside one at 100 gets about a tenth of the other's share;
- a service with no replica taking traffic answers 503 from nginx itself;
- the configuration is written beside the old one, checked (`nginx -t`), moved in place and nginx reloaded
  (`nginx -s reload`: new workers take the new upstreams, old ones finish their requests) only when the rendering
  changed.

`render` is pure (endpoint documents in, the configuration's text out); `NginxRouter` does the files and processes.
"""
from __future__ import annotations

import logging
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

log = logging.getLogger("gpupool.router")

WEIGHT_STEP = 10
POLL_S = 0.5


def nginx_binary() -> str:
    exe = os.environ.get("GPUPOOL_NGINX") or shutil.which("nginx") or ("/usr/sbin/nginx" if os.access(
        "/usr/sbin/nginx", os.X_OK) else None)
    if exe is None:
        raise RuntimeError("no nginx: install Debian's nginx-light (`make nginx`, or apt-get install nginx-light) or "
                           "set GPUPOOL_NGINX")
    return exe


def upstream_name(service: str) -> str:
    return "svc_" + re.sub(r"[^A-Za-z0-9_]", "_", service)


def stepped(weight: int) -> int:
    """A ramping weight in steps of WEIGHT_STEP (at least 1): fewer distinct renderings, fewer reloads."""
    return max(1, weight // WEIGHT_STEP * WEIGHT_STEP) if weight < 100 else 100


def render(docs: dict[str, dict], listen_port: int, prefix: Path, listen_host: str = "127.0.0.1") -> str:
    """nginx.conf for the services' endpoint documents (`/api/service/NAME/endpoints`), keyed by service id."""
    p = str(prefix)
    lines = [
        "# written by gpupool router (agents/router.py); do not edit: rewritten from the services' endpoints",
        "worker_processes 1;", f"pid {p}/nginx.pid;", f"error_log {p}/error.log warn;",
        "events { worker_connections 1024; }", "http {",
        f"  access_log {p}/access.log;", f"  client_body_temp_path {p}/tmp/body;",
        f"  proxy_temp_path {p}/tmp/proxy;", f"  fastcgi_temp_path {p}/tmp/fastcgi;",
        f"  uwsgi_temp_path {p}/tmp/uwsgi;", f"  scgi_temp_path {p}/tmp/scgi;",
        "  proxy_http_version 1.1;", '  proxy_set_header Connection "";',
        "  proxy_next_upstream error timeout http_502 http_503 non_idempotent;", "  proxy_read_timeout 120s;",
    ]
    locations = []
    for service in sorted(docs):
        ready = sorted(docs[service].get("ready", []), key=lambda r: r["job_id"])
        name = upstream_name(service)
        if ready:
            lines.append(f"  upstream {name} {{")
            for r in ready:
                lines.append(f"    server {r['address']}:{r['port']} weight={stepped(r['weight'])};"
                             f"  # {r['job_id']}")
            lines.append("    keepalive 16;")
            lines.append("  }")
            locations.append(f"    location /{service}/ {{ proxy_pass http://{name}/; }}")
        else:
            locations.append(f"    location /{service}/ {{ return 503 'no ready replica of {service}\\n'; }}")
    lines += ["  server {", f"    listen {listen_host}:{listen_port};",
              "    location = /healthz { return 200 'ok\\n'; }", *locations, "  }", "}"]
    return "\n".join(lines) + "\n"


class NginxRouter:
    """An nginx of its own under `prefix`, listening on `listen_port`."""

    def __init__(self, prefix: Path, listen_port: int, listen_host: str = "127.0.0.1"):
        self.prefix = Path(prefix)
        self.listen_port = listen_port
        self.listen_host = listen_host
        self.conf = self.prefix / "nginx.conf"
        self.exe = nginx_binary()
        self.proc: subprocess.Popen | None = None
        self.rendered = ""
        self.reloads = 0

    def _nginx(self, *args: str, conf: Path | None = None) -> subprocess.CompletedProcess:
        return subprocess.run([self.exe, "-p", str(self.prefix), "-c", str(conf or self.conf), *args],
                              capture_output=True, text=True, timeout=30)

    def start(self, docs: dict[str, dict]) -> None:
        for d in ("tmp/body", "tmp/proxy", "tmp/fastcgi", "tmp/uwsgi", "tmp/scgi", "logs"):
            (self.prefix / d).mkdir(parents=True, exist_ok=True)
        self.rendered = render(docs, self.listen_port, self.prefix, self.listen_host)
        self.conf.write_text(self.rendered)
        checked = self._nginx("-t")
        if checked.returncode != 0:
            raise RuntimeError(f"nginx refused its configuration: {checked.stderr.strip()}")
        # in the foreground (daemon off): the router's own child, stopped by its pid, never by name
        self.proc = subprocess.Popen([self.exe, "-p", str(self.prefix), "-c", str(self.conf), "-g", "daemon off;"],
                                     stdout=subprocess.DEVNULL, stderr=open(self.prefix / "nginx.out", "ab"),
                                     start_new_session=True)

    def update(self, docs: dict[str, dict]) -> bool:
        """Render; when it differs from what runs: check, move in place, reload. True when reloaded."""
        text = render(docs, self.listen_port, self.prefix, self.listen_host)
        if text == self.rendered:
            return False
        new = self.conf.with_name("nginx.conf.new")
        new.write_text(text)
        checked = self._nginx("-t", conf=new)
        if checked.returncode != 0:
            log.error("nginx refused a rendering; keeping the running one: %s", checked.stderr.strip()[-500:])
            return False
        os.replace(new, self.conf)
        reloaded = self._nginx("-s", "reload")
        if reloaded.returncode != 0:
            log.error("nginx -s reload failed: %s", reloaded.stderr.strip()[-500:])
            return False
        self.rendered = text
        self.reloads += 1
        return True

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGQUIT)  # graceful: finish the requests in flight
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


def run(cfg, services: list[str], listen_port: int, prefix: Path, user: str | None = None,
        poll_s: float | None = None, once: bool = False) -> int:
    """The router's loop: poll the endpoints, keep nginx's configuration in step, until SIGTERM/SIGINT."""
    from agents.client import ApiFailure, Client

    client = Client(cfg, user) if user else Client(cfg)
    poll_s = poll_s if poll_s is not None else float(os.environ.get("GPUPOOL_ROUTER_POLL_S") or POLL_S)
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(1))
    signal.signal(signal.SIGINT, lambda *_: stopping.append(1))

    def docs() -> dict[str, dict]:
        out = {}
        for s in services:
            try:
                out[s] = client.api("/api/service/endpoints", {"service": s}, timeout=10)
            except ApiFailure as exc:  # not declared yet, or not the caller's: no replicas
                log.info("%s: %s", s, exc)
                out[s] = {"ready": []}
        return out

    router = NginxRouter(prefix, listen_port)
    router.start(docs())
    print(f"router on http://127.0.0.1:{listen_port}/SERVICE/ for {', '.join(services)} (nginx under {prefix})",
          flush=True)
    try:
        while not stopping and not once:
            time.sleep(poll_s)
            try:
                if router.update(docs()):
                    print(f"reloaded ({router.reloads}): " + "; ".join(
                        f"{line.strip()}" for line in router.rendered.splitlines() if line.strip().startswith(
                            "server ") and "#" in line), flush=True)
            except Exception as exc:  # noqa: BLE001 - the API away for a moment: keep the running configuration
                log.warning("endpoints not read: %s", exc)
    finally:
        router.stop()
    return 0
