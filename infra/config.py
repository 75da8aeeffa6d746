"""Configuration from the environment; every process reads the same variables (docs/security.md for the Kafka ones)."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, replace
from pathlib import Path


@dataclass(frozen=True)
class Config:
    home: Path
    kafka: str | None  # bootstrap servers; None: the project runs its own local broker
    clickhouse: str
    kafka_port: int
    web_port: int
    user: str = "admin"  # the principal this process acts as (GPUPOOL_USER, or a command's --as)
    web_bind: str = "127.0.0.1"  # the interface the worker's HTTP API listens on
    kafka_protocol: str = "SASL_PLAINTEXT"  # or SASL_SSL
    kafka_mechanism: str = "SCRAM-SHA-512"
    kafka_cafile: str | None = None  # CA bundle for SASL_SSL (None: the system's, or the local broker's own CA)
    max_skew_ms: int = 5 * 60_000  # a request whose client time is further off is flagged (docs/security.md)
    sql_timeout_s: int = 10  # ClickHouse's max_execution_time for people's own SQL
    kafka_brokers: int = 1  # the local cluster's size (`gpupool up --brokers N` records it under the home)
    rate_window_ms: int = 10_000  # the gateway's rate window per principal (streams/folds/gateway.py, RateLimit)
    rate_per_window: int = 200  # requests a principal may send per window; the rest are refused `rate_limited`
    volumes: dict[str, "Volume"] = field(default_factory=dict, hash=False)  # the mountable volumes (load_volumes)
    # seconds a stopped job gets between SIGTERM and SIGKILL, per tier (GPUPOOL_GRACE_S, parse_grace); the ticker puts
    # them on the scheduler's input log (SchedulerTick.grace_s), so every replay decides with the same ones
    grace_s: dict[str, int] = field(default_factory=dict, hash=False)
    # the ports a gang's rendezvous master port is chosen from (GPUPOOL_RENDEZVOUS_PORTS, parse_ports; first, last);
    # carried by the ticks to the scheduler like the grace periods (SchedulerTick.rendezvous_ports)
    rendezvous_ports: tuple[int, int] = (29500, 29999)
    # A program's output (docs/jobs.md, "Logs"): the node agent's caps per run (attempt and part) -- a rate with a
    # burst, a total, and what it may hold unsent -- and how long ClickHouse keeps the logs
    log_rate_bytes_s: int = 1 << 20  # GPUPOOL_LOG_RATE
    log_burst_bytes: int = 4 << 20  # GPUPOOL_LOG_BURST
    log_max_bytes: int = 64 << 20  # GPUPOOL_LOG_MAX_BYTES
    log_buffer_bytes: int = 4 << 20  # GPUPOOL_LOG_BUFFER
    log_retention_days: int = 7  # GPUPOOL_LOG_RETENTION_DAYS

    @property
    def bootstrap(self) -> str:
        """GPUPOOL_KAFKA, else every broker of the local cluster (ports kafka_port, +2, +4...): a client finds the
        cluster through any one of them."""
        return self.kafka or ",".join(f"127.0.0.1:{self.kafka_port + 2 * i}" for i in range(self.kafka_brokers))

    def acting_as(self, user: str | None) -> "Config":
        return self if not user or user == self.user else replace(self, user=user)


def cluster_file(home: Path) -> Path:
    return home / "kafka" / "cluster.json"


@dataclass(frozen=True)
class Volume:
    """A named volume of the operator's allow-list: a job asks for it by name (`--volume datasets:/data:ro`); the
    node agent mounts `host_path` there. `read_only`: a job may mount it read-only only."""
    name: str
    host_path: str
    read_only: bool = True


def parse_volumes(text: str) -> dict[str, Volume]:
    """GPUPOOL_VOLUMES: `NAME=HOST_PATH[:ro|rw],...` (read-only unless `:rw`), or a JSON object
    {NAME: {"host_path": ..., "read_only": ...}}. A malformed entry raises ValueError: an operator's typo must not
    silently narrow or widen what jobs may mount."""
    text = text.strip()
    if not text:
        return {}
    if text.startswith("{"):
        doc = json.loads(text)
        return {name: Volume(name, str(v["host_path"]), bool(v.get("read_only", True))) for name, v in doc.items()}
    out = {}
    for item in text.split(","):
        name, eq, rest = item.strip().partition("=")
        path, _, mode = rest.partition(":")
        if not eq or not name or not path.startswith("/") or mode not in ("", "ro", "rw"):
            raise ValueError(f"GPUPOOL_VOLUMES entry {item!r}: want NAME=/HOST/PATH[:ro|rw]")
        out[name] = Volume(name, path, mode != "rw")
    return out


def load_volumes(home: Path) -> dict[str, Volume]:
    """The allow-list: GPUPOOL_VOLUMES, else $GPUPOOL_HOME/volumes.json, else none (docs/operators.md). The gateway
    refuses a request naming another volume; a node agent mounts only these."""
    text = os.environ.get("GPUPOOL_VOLUMES")
    if text is None:
        try:
            text = (home / "volumes.json").read_text()
        except OSError:
            return {}
    return parse_volumes(text)


def parse_grace(text: str) -> dict[str, int]:
    """GPUPOOL_GRACE_S: `TIER=SECONDS,...` (e.g. `inference=10,online-training=30,offline=60`), or one number for
    every tier; tiers not named keep the default (30 s). A malformed entry raises ValueError: an operator's typo must
    not silently give a job less time to checkpoint than meant."""
    from schemas.events import GRACE_MAX_S, Tier

    text = text.strip()
    if not text:
        return {}
    if "=" not in text:
        items = [f"{t.value}={text}" for t in Tier]
    else:
        items = [x for x in text.split(",") if x.strip()]
    out: dict[str, int] = {}
    tiers = {t.value for t in Tier}
    for item in items:
        name, eq, value = item.strip().partition("=")
        name, value = name.strip(), value.strip()
        if not eq or name not in tiers or not value.isdigit() or int(value) > GRACE_MAX_S:
            raise ValueError(f"GPUPOOL_GRACE_S entry {item.strip()!r}: want TIER=SECONDS with TIER one of "
                             f"{', '.join(sorted(tiers))} and 0 <= SECONDS <= {GRACE_MAX_S}")
        out[name] = int(value)
    return out


def parse_ports(text: str) -> tuple[int, int]:
    """GPUPOOL_RENDEZVOUS_PORTS: `FIRST-LAST` (inclusive, e.g. `29500-29999`) or one port; empty: the default range
    (schemas/events.DEFAULT_RENDEZVOUS_PORTS). A malformed range raises ValueError: no `gpupool` command starts."""
    from schemas.events import DEFAULT_RENDEZVOUS_PORTS

    text = text.strip()
    if not text:
        return DEFAULT_RENDEZVOUS_PORTS
    first, _, last = text.partition("-")
    first, last = first.strip(), (last.strip() or first.strip())
    if not first.isdigit() or not last.isdigit() or not 1 <= int(first) <= int(last) <= 65535:
        raise ValueError(f"GPUPOOL_RENDEZVOUS_PORTS {text!r}: want FIRST-LAST with 1 <= FIRST <= LAST <= 65535")
    return int(first), int(last)


_UNITS = {"": 1, "k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20, "g": 1 << 30, "gib": 1 << 30}


def parse_bytes(text: str) -> int:
    """A size as an operator writes it: `1048576`, `512KiB`, `1MiB`, `64M`, `2GiB` (binary units); ValueError
    otherwise or when negative."""
    t = text.strip().lower().replace(" ", "")
    digits = len(t) - len(t.lstrip("0123456789"))
    if not digits or t[digits:] not in _UNITS:
        raise ValueError(f"{text!r}: a size in bytes, optionally with KiB, MiB or GiB")
    return int(t[:digits]) * _UNITS[t[digits:]]


def _size(name: str, default: int) -> int:
    text = os.environ.get(name)
    return default if not text else parse_bytes(text)


def local_brokers(home: Path) -> int:
    """How many local brokers this home runs: what `gpupool up --brokers N` recorded, else one."""
    try:
        return int(json.loads(cluster_file(home).read_text())["brokers"])
    except (OSError, ValueError, KeyError, TypeError):
        return 1


def load() -> Config:
    home = Path(os.environ.get("GPUPOOL_HOME", "./.gpupool")).resolve()
    return Config(
        home=home,
        kafka=os.environ.get("GPUPOOL_KAFKA") or None,
        clickhouse=os.environ.get("GPUPOOL_CLICKHOUSE") or f"chdb://{home / 'clickhouse'}",
        kafka_port=int(os.environ.get("GPUPOOL_KAFKA_PORT", "19092")),
        web_port=int(os.environ.get("GPUPOOL_WEB_PORT", "16066")),
        user=os.environ.get("GPUPOOL_USER") or "admin",
        web_bind=os.environ.get("GPUPOOL_WEB_BIND") or "127.0.0.1",
        kafka_protocol=os.environ.get("GPUPOOL_KAFKA_SECURITY") or "SASL_PLAINTEXT",
        kafka_mechanism=os.environ.get("GPUPOOL_KAFKA_MECHANISM") or "SCRAM-SHA-512",
        kafka_cafile=os.environ.get("GPUPOOL_KAFKA_CAFILE") or None,
        max_skew_ms=int(os.environ.get("GPUPOOL_MAX_SKEW_MS", str(5 * 60_000))),
        sql_timeout_s=int(os.environ.get("GPUPOOL_SQL_TIMEOUT_S", "10")),
        kafka_brokers=local_brokers(home),
        rate_window_ms=int(os.environ.get("GPUPOOL_RATE_WINDOW_MS", "10000")),
        rate_per_window=int(os.environ.get("GPUPOOL_RATE_PER_WINDOW", "200")),
        volumes=load_volumes(home),
        grace_s=parse_grace(os.environ.get("GPUPOOL_GRACE_S", "")),
        rendezvous_ports=parse_ports(os.environ.get("GPUPOOL_RENDEZVOUS_PORTS", "")),
        log_rate_bytes_s=_size("GPUPOOL_LOG_RATE", 1 << 20),
        log_burst_bytes=_size("GPUPOOL_LOG_BURST", 4 << 20),
        log_max_bytes=_size("GPUPOOL_LOG_MAX_BYTES", 64 << 20),
        log_buffer_bytes=_size("GPUPOOL_LOG_BUFFER", 4 << 20),
        log_retention_days=int(os.environ.get("GPUPOOL_LOG_RETENTION_DAYS", "7")),
    )
