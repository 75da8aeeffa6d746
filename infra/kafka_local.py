"""A real single-node Apache Kafka 4.x broker (KRaft) from Maven Central, run on 127.0.0.1.

fetch: resolves org.apache.kafka:kafka_2.13 and its runtime dependencies into $GPUPOOL_HOME/kafka/libs (once).
start: formats KRaft storage on first use, starts the broker detached, waits until it answers. Idempotent.
stop: SIGTERM, then waits for a clean shutdown.
"""
from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from schemas.topics import ALL_TOPICS, TopicSpec


def libs_dir(home: Path) -> Path:
    return home / "kafka" / "libs"


def fetch(home: Path, quiet: bool = False) -> Path:
    libs = libs_dir(home)
    if libs.is_dir() and any(libs.glob("kafka_2.13-*.jar")):
        return libs
    if shutil.which("mvn") is None:
        raise SystemExit("Maven (mvn) is needed to fetch Kafka from Maven Central; install it (apt-get install maven)")
    work = home / "kafka"
    work.mkdir(parents=True, exist_ok=True)
    pom = work / "pom.xml"
    pom.write_text(resources.files("infra").joinpath("kafka-pom.xml").read_text())
    tmp = work / "libs.partial"
    shutil.rmtree(tmp, ignore_errors=True)
    if not quiet:
        print(f"fetching Apache Kafka and its dependencies from Maven Central into {libs} ...", file=sys.stderr)
    subprocess.run(["mvn", "-q", "-B", "-f", str(pom), "dependency:copy-dependencies", "-DincludeScope=runtime",
                    f"-DoutputDirectory={tmp}"], check=True)
    tmp.rename(libs)  # atomic: a half-finished fetch never looks complete
    return libs


def port_open(host: str, port: int, timeout: float = 0.5) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class LocalBroker:
    libs: Path
    data: Path  # KRaft logs, config, pid file and broker log live here
    port: int
    controller_port: int = 0

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def pidfile(self) -> Path:
        return self.data / "broker.pid"

    def _properties(self) -> Path:
        cport = self.controller_port or self.port + 1
        props = self.data / "server.properties"
        props.write_text("\n".join([
            "process.roles=broker,controller", "node.id=1", f"controller.quorum.voters=1@127.0.0.1:{cport}",
            f"listeners=PLAINTEXT://127.0.0.1:{self.port},CONTROLLER://127.0.0.1:{cport}",
            f"advertised.listeners=PLAINTEXT://127.0.0.1:{self.port}", "controller.listener.names=CONTROLLER",
            "listener.security.protocol.map=CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT",
            f"log.dirs={self.data / 'logs'}", "num.partitions=1", "offsets.topic.replication.factor=1",
            "offsets.topic.num.partitions=8", "transaction.state.log.replication.factor=1",
            "transaction.state.log.min.isr=1", "group.initial.rebalance.delay.ms=0",
            "auto.create.topics.enable=true", "log.retention.check.interval.ms=300000",
            "message.max.bytes=2097152", "",
        ]))
        return props

    def _java(self, *args: str, **kw) -> subprocess.CompletedProcess:
        return subprocess.run(["java", "-Xmx256m", "-cp", f"{self.libs}/*", *args], **kw)

    def running_pid(self) -> int | None:
        try:
            pid = int(self.pidfile.read_text())
            os.kill(pid, 0)
            return pid
        except (OSError, ValueError):
            return None

    def start(self, timeout: float = 90.0) -> "LocalBroker":
        if self.running_pid() and port_open("127.0.0.1", self.port):
            return self
        self.data.mkdir(parents=True, exist_ok=True)
        props = self._properties()
        if not (self.data / "logs" / "meta.properties").exists():
            self._java("kafka.tools.StorageTool", "format", "-t", str(uuid.uuid4().hex[:22]), "-c", str(props),
                       check=True, capture_output=True)
        log4j = resources.files("infra").joinpath("log4j2.yaml")
        with open(self.data / "broker.log", "ab") as log:
            proc = subprocess.Popen(
                ["java", "-Xmx768m", "-XX:+UseG1GC", f"-Dlog4j2.configurationFile={log4j}",
                 "-cp", f"{self.libs}/*", "kafka.Kafka", str(props)],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        self.pidfile.write_text(str(proc.pid))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"Kafka exited with {proc.returncode}; see {self.data / 'broker.log'}")
            if port_open("127.0.0.1", self.port) and asyncio.run(_answers(self.bootstrap)):
                return self
            time.sleep(0.3)
        self.stop()
        raise TimeoutError(f"Kafka did not answer on {self.bootstrap} within {timeout}s")

    def stop(self, timeout: float = 30.0) -> None:
        pid = self.running_pid()
        if pid is None:
            return
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except OSError:
                break
            _reap(pid)
            time.sleep(0.2)
        else:
            os.kill(pid, signal.SIGKILL)
        _reap(pid)
        self.pidfile.unlink(missing_ok=True)


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


async def _answers(bootstrap: str) -> bool:
    from aiokafka.admin import AIOKafkaAdminClient

    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=3000)
    try:
        await admin.start()
        await admin.list_topics()
        return True
    except Exception:  # noqa: BLE001 - any failure means "not ready yet"
        return False
    finally:
        await admin.close()


async def ensure_topics(bootstrap: str, specs: tuple[TopicSpec, ...] = ALL_TOPICS) -> list[str]:
    """Create the missing topics from the one specification; returns the names created."""
    from aiokafka.admin import AIOKafkaAdminClient, NewTopic
    from aiokafka.errors import TopicAlreadyExistsError

    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        existing = set(await admin.list_topics())
        missing = [s for s in specs if s.name not in existing]
        if missing:
            try:
                await admin.create_topics([NewTopic(s.name, s.partitions, 1, topic_configs=s.config())
                                           for s in missing])
            except TopicAlreadyExistsError:
                pass
        return [s.name for s in missing]
    finally:
        await admin.close()


def default_broker(cfg) -> LocalBroker:
    return LocalBroker(libs=libs_dir(cfg.home), data=cfg.home / "kafka" / "data", port=cfg.kafka_port)
