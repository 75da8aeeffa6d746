"""A whole local stack in child processes: broker, Faust worker, simulated fleet. Used by the demo and the tests."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from infra import kafka_local
from infra.config import Config


def web_query(port: int, sql: str, parameters: dict | None = None) -> tuple[list[str], list[list]]:
    """A read-only query through the worker's API (the worker owns the embedded ClickHouse)."""
    req = urllib.request.Request(f"http://127.0.0.1:{port}/query/", method="POST",
                                 data=json.dumps({"sql": sql, "parameters": parameters or {}}).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            doc = json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        raise RuntimeError(exc.read().decode()[:2000]) from None
    return doc["columns"], doc["rows"]


@dataclass
class Stack:
    home: Path
    libs_home: Path  # where the Kafka jar cache lives (shared between stacks)
    bootstrap: str | None = None  # an existing broker; None: start a fresh local one under `home`
    web_port: int = 0
    broker: kafka_local.LocalBroker | None = None
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)

    def __post_init__(self):
        self.home.mkdir(parents=True, exist_ok=True)
        self.web_port = self.web_port or kafka_local.free_port()

    @property
    def env(self) -> dict[str, str]:
        env = {"GPUPOOL_HOME": str(self.home), "GPUPOOL_KAFKA": self.bootstrap or "",
               "GPUPOOL_WEB_PORT": str(self.web_port), "PYTHONUNBUFFERED": "1"}
        if not os.environ.get("GPUPOOL_CLICKHOUSE"):
            env["GPUPOOL_CLICKHOUSE"] = f"chdb://{self.home / 'clickhouse'}"
        return env

    @property
    def config(self) -> Config:
        return Config(home=self.home, kafka=self.bootstrap, clickhouse=self.env["GPUPOOL_CLICKHOUSE"],
                      kafka_port=0, web_port=self.web_port)

    def start_broker(self) -> str:
        if self.bootstrap is None:
            libs = kafka_local.fetch(self.libs_home)
            port = kafka_local.free_port()
            self.broker = kafka_local.LocalBroker(libs, self.home / "kafka-data", port,
                                                  controller_port=kafka_local.free_port()).start()
            self.bootstrap = self.broker.bootstrap
        asyncio.run(kafka_local.ensure_topics(self.bootstrap))
        return self.bootstrap

    def spawn(self, name: str, *argv: str) -> subprocess.Popen:
        log = open(self.home / f"{name}.log", "ab")
        proc = subprocess.Popen([sys.executable, "-m", "agents.cli", *argv], stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env={**os.environ, **self.env}, start_new_session=True)
        self.procs[name] = proc
        return proc

    def start_worker(self, timeout: float = 120.0, *extra: str) -> None:
        proc = self.spawn("worker", "worker", *extra)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"worker exited {proc.returncode}: {self.log('worker')[-3000:]}")
            try:
                self.query("SELECT 1")
                return
            except (OSError, RuntimeError):
                time.sleep(0.5)
        raise TimeoutError(f"worker did not answer: {self.log('worker')[-3000:]}")

    def start_agent(self, fleet: str, *extra: str) -> None:
        self.spawn("agent", "agent", "--simulate", fleet, *extra)

    def log(self, name: str) -> str:
        try:
            return (self.home / f"{name}.log").read_text(errors="replace")
        except OSError:
            return ""

    def query(self, sql: str, parameters: dict | None = None) -> list[dict]:
        columns, rows = web_query(self.web_port, sql, parameters)
        return [dict(zip(columns, r)) for r in rows]

    def stats(self) -> dict:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.web_port}/stats/", timeout=10) as resp:
            return json.loads(resp.read())

    def stop_process(self, name: str, sig: int = signal.SIGTERM, timeout: float = 30.0) -> None:
        proc = self.procs.pop(name, None)
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(sig)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)

    def stop(self) -> None:
        for name in list(self.procs):
            self.stop_process(name)
        if self.broker is not None:
            self.broker.stop()
