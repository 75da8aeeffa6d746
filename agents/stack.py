"""A whole local stack in child processes: an authenticated broker, Faust worker, simulated fleet. Used by the demo
and the tests; its principals' credentials live under its own home, as `gpupool up` keeps them."""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from agents.client import Client
from infra import kafka_local, principals, security
from infra.config import Config


@dataclass
class Stack:
    home: Path
    libs_home: Path  # where the Kafka jar cache lives (shared between stacks)
    bootstrap: str | None = None  # an existing broker; None: start a fresh local one under `home`
    web_port: int = 0
    broker: kafka_local.LocalBroker | kafka_local.LocalCluster | None = None
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    web_ports: dict[str, int] = field(default_factory=dict)  # worker name -> its HTTP port (the first: web_port)
    extra_env: dict[str, str] = field(default_factory=dict)  # for the processes it spawns (tests' settings)

    def __post_init__(self):
        self.home.mkdir(parents=True, exist_ok=True)
        self.web_port = self.web_port or kafka_local.free_port()

    @property
    def env(self) -> dict[str, str]:
        env = {"GPUPOOL_HOME": str(self.home), "GPUPOOL_KAFKA": self.bootstrap or "",
               "GPUPOOL_WEB_PORT": str(self.web_port), "PYTHONUNBUFFERED": "1", "GPUPOOL_USER": security.ADMIN}
        if not os.environ.get("GPUPOOL_CLICKHOUSE"):
            env["GPUPOOL_CLICKHOUSE"] = f"chdb://{self.home / 'clickhouse'}"
        if self.broker is not None and self.broker.tls:
            env["GPUPOOL_KAFKA_SECURITY"] = "SASL_SSL"
            env["GPUPOOL_KAFKA_CAFILE"] = str(self.broker.data / "tls" / "ca.pem")
        return {**env, **self.extra_env}

    @property
    def config(self) -> Config:
        return Config(home=self.home, kafka=self.bootstrap, clickhouse=self.env["GPUPOOL_CLICKHOUSE"],
                      kafka_port=0, web_port=self.web_port,
                      kafka_protocol="SASL_SSL" if self.broker is not None and self.broker.tls else "SASL_PLAINTEXT",
                      kafka_cafile=str(self.broker.data / "tls" / "ca.pem") if self.broker and self.broker.tls
                      else None)

    def start_broker(self, tls: bool = False, brokers: int = 1) -> str:
        """A fresh local SASL broker, or a KRaft cluster of `brokers` (unless `bootstrap` names one), the topics,
        and the principals `gpupool up` makes (service, node, admin) with their credentials under `home`."""
        if self.bootstrap is None:
            libs = kafka_local.fetch(self.libs_home)
            port = kafka_local.free_port()
            if brokers > 1:
                ports = [(kafka_local.free_port(), kafka_local.free_port()) for _ in range(brokers)]
                self.broker = kafka_local.LocalCluster(libs, self.home / "kafka-cluster", brokers,
                                                       ports=ports).start()
            else:
                self.broker = kafka_local.LocalBroker(libs, self.home / "kafka-data", port,
                                                      controller_port=kafka_local.free_port(), tls=tls).start()
            self.bootstrap = self.broker.bootstrap
            conn = self.broker.bootstrap_conn()
        else:  # an external broker: an operator's credentials come from the environment
            conn = security.kafka_conn(self.config, os.environ.get("GPUPOOL_USER") or security.ADMIN)
        asyncio.run(principals.bootstrap(self.config, conn))
        return self.bootstrap

    def client(self, user: str = security.ADMIN, worker: str = "worker") -> Client:
        cfg = self.config
        if worker != "worker":
            from dataclasses import replace

            cfg = replace(cfg, web_port=self.web_ports[worker])
        return Client(cfg, user)

    def conn(self, user: str = security.ADMIN) -> security.KafkaConn:
        return security.kafka_conn(self.config, user)

    def add_user(self, name: str, role: str, tenant: str | None = None) -> security.Credentials:
        """A principal made by the admin operator, as `gpupool user add` does."""
        creds = security.new_credentials(name, role, tenant)
        asyncio.run(principals.add(self.conn(security.ADMIN), creds))
        security.save(self.home, creds)
        return creds

    def spawn(self, name: str, *argv: str, env: dict[str, str] | None = None) -> subprocess.Popen:
        log = open(self.home / f"{name}.log", "ab")
        proc = subprocess.Popen([sys.executable, "-m", "agents.cli", *argv], stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env={**os.environ, **self.env, **(env or {})},
                                start_new_session=True)
        self.procs[name] = proc
        return proc

    def start_worker(self, timeout: float = 120.0, *extra: str, name: str = "worker") -> None:
        """A worker; one named otherwise than "worker" is another of the same app (its own HTTP port, no sink:
        the embedded ClickHouse is the first worker's), sharing the partitions with the first."""
        env = None
        if name != "worker":
            self.web_ports.setdefault(name, kafka_local.free_port())
            env = {"GPUPOOL_WEB_PORT": str(self.web_ports[name])}
            extra = ("--no-sink", "--name", name, *extra)
        self.web_ports.setdefault("worker", self.web_port)
        proc = self.spawn(name, "worker", *extra, env=env)
        deadline = time.monotonic() + timeout
        c = self.client(worker=name)
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited {proc.returncode}: {self.log(name)[-3000:]}")
            if c.healthy():
                return
            time.sleep(0.5)
        raise TimeoutError(f"{name} did not answer: {self.log(name)[-3000:]}")

    def start_agent(self, fleet: str, *extra: str) -> None:
        self.spawn("agent", "agent", "--simulate", fleet, *extra)

    def log(self, name: str) -> str:
        try:
            return (self.home / f"{name}.log").read_text(errors="replace")
        except OSError:
            return ""

    def query(self, sql: str, parameters: dict | None = None, user: str = security.ADMIN) -> list[dict]:
        """One read-only statement through the worker's API (the worker owns the embedded ClickHouse)."""
        return self.client(user).records(sql, parameters)

    def stats(self, worker: str = "worker") -> dict:
        return self.client(worker=worker).api("/stats/")

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
