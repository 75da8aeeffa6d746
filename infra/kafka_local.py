"""A real single-node Apache Kafka 4.x broker (KRaft) from Maven Central, run on 127.0.0.1.

fetch: resolves org.apache.kafka:kafka_2.13 and its runtime dependencies into $GPUPOOL_HOME/kafka/libs (once).
start: formats KRaft storage on first use, starts the broker detached, waits until it answers. Idempotent.
stop: SIGTERM, then waits for a clean shutdown.
"""
from __future__ import annotations

import asyncio
import os
import secrets
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
    from contextlib import nullcontext

    from infra.progress import status

    argv = ["mvn", "-q", "-B", "-f", str(pom), "dependency:copy-dependencies", "-DincludeScope=runtime",
            f"-DoutputDirectory={tmp}"]
    with nullcontext() if quiet else status(f"fetching Apache Kafka and its dependencies from Maven Central into "
                                            f"{libs}"):
        subprocess.run(argv, check=True)
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


SUPER_USER = "broker"  # the broker's own principal (inter-broker traffic and the bootstrap of principals)
CONTROLLER_USER = "controller"  # the KRaft controller listener's principal (SASL/PLAIN, loopback only)


@dataclass
class LocalBroker:
    """One KRaft node (broker and controller) on 127.0.0.1. Its only client listener is SASL (SCRAM-SHA-512, or
    SASL_SSL with `tls`), and Kafka's StandardAuthorizer denies whatever no ACL allows; the broker and controller
    principals are the only super users. Their passwords live in `data` (mode 0600); `bootstrap_conn()` is the
    broker principal's connection, used once to create the project's principals (infra/principals.py)."""
    libs: Path
    data: Path  # KRaft logs, config, pid file, secrets and broker log live here
    port: int
    controller_port: int = 0
    tls: bool = False

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def pidfile(self) -> Path:
        return self.data / "broker.pid"

    def _secret(self, name: str) -> str:
        path = self.data / "secrets" / name
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            os.chmod(path.parent, 0o700)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_urlsafe(24))
        return path.read_text().strip()

    def bootstrap_conn(self):
        from infra.security import KafkaConn

        return KafkaConn(self.bootstrap, SUPER_USER, self._secret(SUPER_USER),
                         protocol="SASL_SSL" if self.tls else "SASL_PLAINTEXT",
                         cafile=str(self.data / "tls" / "ca.pem") if self.tls else None)

    def _properties(self) -> Path:
        cport = self.controller_port or self.port + 1
        broker_pw, controller_pw = self._secret(SUPER_USER), self._secret(CONTROLLER_USER)
        protocol = "SASL_SSL" if self.tls else "SASL_PLAINTEXT"
        lines = [
            "process.roles=broker,controller", "node.id=1", f"controller.quorum.voters=1@127.0.0.1:{cport}",
            f"listeners=BROKER://127.0.0.1:{self.port},CONTROLLER://127.0.0.1:{cport}",
            f"advertised.listeners=BROKER://127.0.0.1:{self.port}", "controller.listener.names=CONTROLLER",
            "inter.broker.listener.name=BROKER",
            f"listener.security.protocol.map=BROKER:{protocol},CONTROLLER:SASL_PLAINTEXT",
            "sasl.enabled.mechanisms=SCRAM-SHA-512", "sasl.mechanism.inter.broker.protocol=SCRAM-SHA-512",
            "listener.name.broker.sasl.enabled.mechanisms=SCRAM-SHA-512",
            "listener.name.broker.scram-sha-512.sasl.jaas.config=org.apache.kafka.common.security.scram."
            f'ScramLoginModule required username="{SUPER_USER}" password="{broker_pw}";',
            "sasl.mechanism.controller.protocol=PLAIN", "listener.name.controller.sasl.enabled.mechanisms=PLAIN",
            "listener.name.controller.plain.sasl.jaas.config=org.apache.kafka.common.security.plain."
            f'PlainLoginModule required username="{CONTROLLER_USER}" password="{controller_pw}" '
            f'user_{CONTROLLER_USER}="{controller_pw}";',
            "authorizer.class.name=org.apache.kafka.metadata.authorizer.StandardAuthorizer",
            "allow.everyone.if.no.acl.found=false", f"super.users=User:{SUPER_USER};User:{CONTROLLER_USER}",
            f"log.dirs={self.data / 'logs'}", "num.partitions=1", "offsets.topic.replication.factor=1",
            "offsets.topic.num.partitions=8", "transaction.state.log.replication.factor=1",
            "transaction.state.log.min.isr=1", "group.initial.rebalance.delay.ms=0",
            # topics are created from the one specification (ensure_topics), never by a client's first write
            "auto.create.topics.enable=false", "log.retention.check.interval.ms=300000",
            "message.max.bytes=2097152",
        ]
        if self.tls:
            tls = self._tls_files()
            lines += ["ssl.keystore.type=PEM", f"ssl.keystore.location={tls['key']}",
                      "ssl.truststore.type=PEM", f"ssl.truststore.location={tls['ca']}",
                      "ssl.endpoint.identification.algorithm=https"]
        props = self.data / "server.properties"
        fd = os.open(props, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write("\n".join(lines) + "\n")
        return props

    def _tls_files(self) -> dict[str, Path]:
        """A CA and a server certificate for 127.0.0.1/localhost, made once (infra/tls.py)."""
        from infra.tls import make_ca_and_server

        return make_ca_and_server(self.data / "tls")

    def _java(self, *args: str, **kw) -> subprocess.CompletedProcess:
        return subprocess.run(["java", "-Xmx256m", "-cp", f"{self.libs}/*", *args], **kw)

    def running_pid(self) -> int | None:
        try:
            pid = int(self.pidfile.read_text())
            os.kill(pid, 0)
        except (OSError, ValueError):
            return None
        return pid if _is_kafka(pid) else None  # a stale pid file must never make us signal another process

    def start(self, timeout: float = 90.0) -> "LocalBroker":
        if self.running_pid() and port_open("127.0.0.1", self.port):
            return self
        self.data.mkdir(parents=True, exist_ok=True)
        props = self._properties()
        if not (self.data / "logs" / "meta.properties").exists():
            # The broker principal's SCRAM credential goes into the metadata log at format time (KIP-900): the
            # broker needs it to authenticate to itself before any admin request could create it.
            self._java("kafka.tools.StorageTool", "format", "-t", str(uuid.uuid4().hex[:22]), "-c", str(props),
                       "--add-scram", f"SCRAM-SHA-512=[name={SUPER_USER},password={self._secret(SUPER_USER)}]",
                       check=True, capture_output=True)
        log4j = resources.files("infra").joinpath("log4j2.yaml")
        with open(self.data / "broker.log", "ab") as log:
            proc = subprocess.Popen(
                ["java", "-Xmx768m", "-XX:+UseG1GC", f"-Dlog4j2.configurationFile={log4j}",
                 "-cp", f"{self.libs}/*", "kafka.Kafka", str(props)],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        self.pidfile.write_text(str(proc.pid))
        deadline = time.monotonic() + timeout
        conn = self.bootstrap_conn()
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"Kafka exited with {proc.returncode}; see {self.data / 'broker.log'}")
            if port_open("127.0.0.1", self.port) and asyncio.run(_answers(conn)):
                return self
            time.sleep(0.3)
        self.stop()
        raise TimeoutError(f"Kafka did not answer on {self.bootstrap} within {timeout}s")

    def stop(self, timeout: float = 30.0) -> None:
        pid = self.running_pid()
        if pid is None:
            self.pidfile.unlink(missing_ok=True)
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


def _is_kafka(pid: int) -> bool:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return True  # no /proc: trust the pid file
    return b"kafka.Kafka" in cmdline


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


async def _answers(conn) -> bool:
    from aiokafka.admin import AIOKafkaAdminClient

    admin = AIOKafkaAdminClient(**conn.options(), request_timeout_ms=3000)
    try:
        await admin.start()
        await admin.list_topics()
        return True
    except Exception:  # noqa: BLE001 - any failure means "not ready yet"
        return False
    finally:
        await admin.close()


async def ensure_topics(conn, specs: tuple[TopicSpec, ...] = ALL_TOPICS) -> list[str]:
    """Create the missing topics from the one specification; returns the names created. `conn`: a principal allowed
    to create them (infra.security.KafkaConn)."""
    from aiokafka.admin import AIOKafkaAdminClient, NewTopic
    from aiokafka.errors import TopicAlreadyExistsError

    admin = AIOKafkaAdminClient(**conn.options())
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
    """The project's own broker under $GPUPOOL_HOME; GPUPOOL_KAFKA_SECURITY=SASL_SSL gives it a TLS listener."""
    return LocalBroker(libs=libs_dir(cfg.home), data=cfg.home / "kafka" / "data", port=cfg.kafka_port,
                       tls=cfg.kafka_protocol == "SASL_SSL")
