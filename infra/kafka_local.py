"""A real Apache Kafka 4.x (KRaft) from Maven Central, run on 127.0.0.1: one node, or a cluster of several.

fetch: resolves org.apache.kafka:kafka_2.13 and its runtime dependencies into $GPUPOOL_HOME/kafka/libs (once).
start: formats KRaft storage on first use, starts the broker detached, waits until it answers. Idempotent.
stop: SIGTERM, then waits for a clean shutdown.

`LocalCluster` runs N such nodes (each broker and controller, a static quorum of all of them) that share one
cluster id and the broker principal's password: replication factor min(3, N) and min.insync.replicas 2 once N >= 3
(`schemas.topics.TopicSpec.replication`), for the topics and for Kafka's own (offsets, transactions).
"""
from __future__ import annotations

import asyncio
import os
import random
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


LISTEN_FLOOR = 20000  # listeners are picked from here up to the kernel's ephemeral range


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range for the local ports of outgoing connections (Linux's default where it cannot be read)."""
    try:
        lo, hi = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(lo), int(hi)
    except (OSError, ValueError):
        return 32768, 60999


def free_port() -> int:
    """A port a listener of ours can bind now, below the kernel's ephemeral range. One the kernel hands out for
    bind(0) lies inside that range, where any outgoing connection (a Kafka client's, a test's HTTP call) may take it
    before the listener binds it -- a CI run once lost a worker's web port that way ("address already in use").
    Outside the range only another listener can."""
    lo, _ = ephemeral_range()
    rng = random.SystemRandom()
    if lo - LISTEN_FLOOR > 1000:
        for _ in range(200):
            p = rng.randrange(LISTEN_FLOOR, lo)
            if port_free(p):
                return p
    with socket.socket() as s:  # no room below the range (an unusual kernel setting): the kernel's pick
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_free(port: int) -> bool:
    """Whether a listener could bind `port` now. SO_REUSEADDR as the JVM sets it: a port whose last connections
    linger in TIME_WAIT (a broker just killed) is free; one another process listens on is not."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def free_port_run(brokers: int = 1) -> int:
    """A port p with p .. p+2·brokers-1 free: a broker's controller listens on the port after its client port, and a
    local cluster's brokers sit two apart (GPUPOOL_KAFKA_PORT names only the first). One free port alone is not
    enough: the controller's bind then fails on whatever holds p+1, and Kafka exits with 1."""
    for _ in range(100):
        p = free_port()
        if p + 2 * brokers < 65536 and all(port_free(p + k) for k in range(2 * brokers)):
            return p
    raise RuntimeError(f"no run of {2 * brokers} free ports on 127.0.0.1")


def _log_tail(path: Path, lines: int = 15) -> str:
    """What a broker that exited said last: the error lines if it logged any, else its last lines."""
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no broker log)"
    errors = [ln for ln in text if "ERROR" in ln or "Exception" in ln or "Error:" in ln]
    return "\n".join((errors or text)[-lines:])


SUPER_USER = "broker"  # the broker's own principal (inter-broker traffic and the bootstrap of principals)
CONTROLLER_USER = "controller"  # the KRaft controller listener's principal (SASL/PLAIN, loopback only)


# As Kafka's own bin/kafka-run-class.sh starts a broker (KAFKA_JVM_PERFORMANCE_OPTS): G1 held to 20 ms pauses,
# not its 200 ms default, since every pause is a stall of every request in flight (issue #16's latency tail).
JVM_PERFORMANCE_OPTS = ("-server", "-XX:+UseG1GC", "-XX:MaxGCPauseMillis=20", "-XX:InitiatingHeapOccupancyPercent=35",
                        "-XX:+ExplicitGCInvokesConcurrent", "-XX:MaxInlineLevel=15", "-Djava.awt.headless=true")


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
    node_id: int = 1
    voters: str = ""  # controller.quorum.voters of a cluster ("1@127.0.0.1:PORT,..."); "" = this node alone
    cluster_size: int = 1  # how many brokers the cluster has (replication of Kafka's own topics)
    secrets_dir: Path | None = None  # shared by a cluster's nodes (one broker principal); default data/secrets
    heap: str = "-Xmx768m"

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def pidfile(self) -> Path:
        return self.data / "broker.pid"

    def _secret(self, name: str) -> str:
        path = (self.secrets_dir or self.data / "secrets") / name
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
        rf = replication_for(self.cluster_size)
        lines = [
            "process.roles=broker,controller", f"node.id={self.node_id}",
            f"controller.quorum.voters={self.voters or f'{self.node_id}@127.0.0.1:{cport}'}",
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
            f"log.dirs={self.data / 'logs'}", "num.partitions=1", f"offsets.topic.replication.factor={rf.factor}",
            "offsets.topic.num.partitions=8", f"transaction.state.log.replication.factor={rf.factor}",
            f"transaction.state.log.min.isr={rf.min_insync}", f"default.replication.factor={rf.factor}",
            f"min.insync.replicas={rf.min_insync}", "group.initial.rebalance.delay.ms=0",
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

    def all_running(self) -> bool:
        return self.running_pid() is not None

    def running_pid(self) -> int | None:
        try:
            pid = int(self.pidfile.read_text())
            os.kill(pid, 0)
        except (OSError, ValueError):
            return None
        return pid if _is_kafka(pid) else None  # a stale pid file must never make us signal another process

    def start(self, timeout: float = 90.0, cluster_id: str | None = None) -> "LocalBroker":
        if self.running_pid() and port_open("127.0.0.1", self.port):
            return self
        taken = [p for p in (self.port, self.controller_port or self.port + 1) if not port_free(p)]
        if taken:  # say so before the JVM does it in a log line nobody reads
            raise RuntimeError(f"cannot start Kafka on 127.0.0.1:{self.port}: port(s) {taken} are held by another "
                               f"process (the controller listens on the port after the client's); choose another "
                               f"GPUPOOL_KAFKA_PORT")
        proc = self.launch(cluster_id)
        deadline = time.monotonic() + timeout
        conn = self.bootstrap_conn()
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                log = self.data / "broker.log"
                raise RuntimeError(f"Kafka exited with {proc.returncode} (ports {self.port}, "
                                   f"{self.controller_port or self.port + 1}); see {log}; it said:\n{_log_tail(log)}")
            if port_open("127.0.0.1", self.port) and asyncio.run(_answers(conn)):
                return self
            time.sleep(0.3)
        self.stop()
        raise TimeoutError(f"Kafka did not answer on {self.bootstrap} within {timeout}s")

    def launch(self, cluster_id: str | None = None) -> subprocess.Popen:
        """Format the storage on first use (a cluster's nodes with its one id) and start the process detached."""
        self.data.mkdir(parents=True, exist_ok=True)
        os.chmod(self.data, 0o700)  # every inbox and every bill is in there: the service's user's only
        umask = os.umask(0o077)  # what is written below (storage format, log, pid file) too: 0600
        try:
            return self._launch(cluster_id)
        finally:
            os.umask(umask)

    def _launch(self, cluster_id: str | None) -> subprocess.Popen:
        props = self._properties()
        if not (self.data / "logs" / "meta.properties").exists():
            # The broker principal's SCRAM credential goes into the metadata log at format time (KIP-900): the
            # broker needs it to authenticate to itself before any admin request could create it.
            self._java("kafka.tools.StorageTool", "format", "-t", cluster_id or str(uuid.uuid4().hex[:22]), "-c",
                       str(props), "--add-scram",
                       f"SCRAM-SHA-512=[name={SUPER_USER},password={self._secret(SUPER_USER)}]",
                       check=True, capture_output=True)
        log4j = resources.files("infra").joinpath("log4j2.yaml")
        with open(self.data / "broker.log", "ab") as log:
            proc = subprocess.Popen(
                ["java", self.heap, *JVM_PERFORMANCE_OPTS, f"-Dlog4j2.configurationFile={log4j}",
                 "-cp", f"{self.libs}/*", "kafka.Kafka", str(props)],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        self.pidfile.write_text(str(proc.pid))
        return proc

    def kill(self) -> None:
        """SIGKILL (a fault test's crash): no clean shutdown."""
        pid = self.running_pid()
        if pid is not None:
            os.kill(pid, signal.SIGKILL)
            _reap(pid)
            deadline = time.monotonic() + 10
            while self.running_pid() is not None and time.monotonic() < deadline:
                time.sleep(0.1)
        self.pidfile.unlink(missing_ok=True)

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


def replication_for(brokers: int):
    from schemas.topics import replication

    return replication(brokers)


@dataclass
class LocalCluster:
    """N KRaft nodes on 127.0.0.1, each broker and controller (a static quorum of all N). Node i lives in
    `home/node-i`, listens on `base_port + 2(i-1)` (clients) and the port after it (controller). `bootstrap` names
    every broker, so clients find the cluster with any one of them down."""
    libs: Path
    home: Path
    size: int
    base_port: int = 0
    heap: str = "-Xmx384m"  # three JVMs share the machine with everything else
    ports: list[tuple[int, int]] | None = None  # (client, controller) per node; default from base_port

    def __post_init__(self):
        if self.size < 1:
            raise ValueError("a cluster has at least one broker")
        ports = self.ports or [(self.base_port + 2 * i, self.base_port + 2 * i + 1) for i in range(self.size)]
        voters = ",".join(f"{i}@127.0.0.1:{c}" for i, (_, c) in enumerate(ports, start=1))
        self.nodes = [LocalBroker(self.libs, self.home / f"node-{i}", p, controller_port=c, node_id=i, voters=voters,
                                  cluster_size=self.size, secrets_dir=self.home / "secrets", heap=self.heap)
                      for i, (p, c) in enumerate(ports, start=1)]

    @property
    def bootstrap(self) -> str:
        return ",".join(n.bootstrap for n in self.nodes)

    @property
    def tls(self) -> bool:
        return False

    @property
    def data(self) -> Path:
        return self.home

    def bootstrap_conn(self):
        from infra.security import KafkaConn

        return KafkaConn(self.bootstrap, SUPER_USER, self.nodes[0]._secret(SUPER_USER))

    def cluster_id(self) -> str:
        path = self.home / "cluster.id"
        if not path.exists():
            self.home.mkdir(parents=True, exist_ok=True)
            path.write_text(uuid.uuid4().hex[:22])
        return path.read_text().strip()

    def running_pid(self) -> int | None:
        """A node's pid while any node runs."""
        return next((pid for n in self.nodes if (pid := n.running_pid()) is not None), None)

    def all_running(self) -> bool:
        return all(n.running_pid() is not None for n in self.nodes)

    def start(self, timeout: float = 180.0) -> "LocalCluster":
        """Start every node that is not running (they need each other for a quorum), then wait for all."""
        cid = self.cluster_id()
        procs = {n.node_id: n.launch(cid) for n in self.nodes
                 if not (n.running_pid() and port_open("127.0.0.1", n.port))}
        deadline = time.monotonic() + timeout
        from infra.security import KafkaConn

        password = self.nodes[0]._secret(SUPER_USER)
        for n in self.nodes:
            one = KafkaConn(n.bootstrap, SUPER_USER, password)  # each node on its own, not the cluster's bootstrap
            while True:
                proc = procs.get(n.node_id)
                if proc is not None and proc.poll() is not None:
                    raise RuntimeError(f"Kafka node {n.node_id} exited with {proc.returncode}; see "
                                       f"{n.data / 'broker.log'}")
                if port_open("127.0.0.1", n.port) and asyncio.run(_answers(one)):
                    break
                if time.monotonic() > deadline:
                    self.stop()
                    raise TimeoutError(f"Kafka node {n.node_id} did not answer on {n.bootstrap} within {timeout}s")
                time.sleep(0.5)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        for n in self.nodes:  # SIGTERM each, then wait: the last of a quorum cannot shut down cleanly alone
            pid = n.running_pid()
            if pid is not None:
                os.kill(pid, signal.SIGTERM)
        for n in self.nodes:
            n.stop(timeout)


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
            brokers = len((await admin.describe_cluster())["brokers"])
            try:
                await admin.create_topics([NewTopic(s.name, s.partitions, s.replication(brokers).factor,
                                                    topic_configs=s.config(brokers)) for s in missing])
            except TopicAlreadyExistsError:
                pass
        return [s.name for s in missing]
    finally:
        await admin.close()


async def cluster_size(conn) -> int:
    """How many brokers the cluster behind `conn` has."""
    from aiokafka.admin import AIOKafkaAdminClient

    admin = AIOKafkaAdminClient(**conn.options())
    await admin.start()
    try:
        return len((await admin.describe_cluster())["brokers"])
    finally:
        await admin.close()


def default_broker(cfg) -> LocalBroker | LocalCluster:
    """The project's own broker under $GPUPOOL_HOME (GPUPOOL_KAFKA_SECURITY=SASL_SSL gives it a TLS listener), or
    its cluster when the home was brought up with `gpupool up --brokers N` (N > 1; cfg.kafka_brokers)."""
    if cfg.kafka_brokers > 1:
        if cfg.kafka_protocol == "SASL_SSL":
            raise SystemExit("a local cluster runs SASL_PLAINTEXT on loopback; TLS is for the one-node broker")
        return LocalCluster(libs=libs_dir(cfg.home), home=cfg.home / "kafka" / "cluster", size=cfg.kafka_brokers,
                            base_port=cfg.kafka_port)
    return LocalBroker(libs=libs_dir(cfg.home), data=cfg.home / "kafka" / "data", port=cfg.kafka_port,
                       tls=cfg.kafka_protocol == "SASL_SSL")
