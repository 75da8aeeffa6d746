"""Principals, their stored credentials, and the connection options every Kafka client and the HTTP API use.

A principal is a SCRAM-SHA-512 user of the broker with one role (docs/security.md). What the CLI needs to act as it
(the SCRAM password and the HTTP token) lives in $GPUPOOL_HOME/credentials/NAME.json, mode 0600, in a directory of
mode 0700. GPUPOOL_PASSWORD / GPUPOOL_TOKEN override the file, for principals made elsewhere (an external broker).
"""
from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import secrets
import ssl
from dataclasses import asdict, dataclass
from pathlib import Path

from infra.config import Config

ROLES = ("tenant", "operator", "finance", "auditor", "node", "service")
# Names become parts of topic names and ACLs: lower-case letters, digits and '-', starting with a letter or digit.
NAME_RE = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")
# The principals `gpupool up` creates: the worker and one operator; and one node principal per simulated node
# (`node_principal`). NODE: the default name of a node agent's principal (`--principal`).
SERVICE, NODE, ADMIN = "service", "node", "admin"


class CredentialsError(SystemExit):
    """A one-line error for the CLI (SystemExit prints it and exits 1)."""


def check_name(what: str, name: str) -> str:
    if not NAME_RE.match(name or ""):
        raise CredentialsError(f"{what} {name!r}: use 1-63 lower-case letters, digits and '-', starting with a "
                               f"letter or digit")
    return name


@dataclass(frozen=True)
class Credentials:
    name: str
    role: str
    tenant: str | None
    password: str
    token: str
    nodes: tuple[str, ...] = ()  # node role: the nodes it speaks for
    auto_admit: bool = False  # node role: its nodes take work when first heard, without `gpupool node admit`

    def __post_init__(self):
        object.__setattr__(self, "nodes", tuple(self.nodes))  # a list when read back from JSON

    @property
    def token_sha256(self) -> str:
        return token_digest(self.token)


def token_digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def same_token(token: str, digest: str) -> bool:
    return hmac.compare_digest(token_digest(token), digest)


def new_credentials(name: str, role: str, tenant: str | None = None, nodes: tuple[str, ...] | list[str] = (),
                    auto_admit: bool = False) -> Credentials:
    check_name("principal", name)
    if role not in ROLES:
        raise CredentialsError(f"role {role!r}: one of {', '.join(ROLES)}")
    if (role == "tenant") != (tenant is not None):
        raise CredentialsError("--tenant is required for the tenant role, and only for it")
    if tenant is not None:
        check_name("tenant", tenant)
    if role == "node" and not nodes:
        raise CredentialsError("--node NODE is required for the node role: the node(s) the principal speaks for")
    if role != "node" and (nodes or auto_admit):
        raise CredentialsError("--node and --auto-admit are for the node role only")
    for n in nodes:
        if not NODE_RE.match(n or ""):
            raise CredentialsError(f"node {n!r}: use 1-200 letters, digits, '.', '_' or '-'")
    return Credentials(name, role, tenant, secrets.token_urlsafe(24), secrets.token_urlsafe(32),
                       tuple(dict.fromkeys(nodes)), auto_admit)


NODE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$")


def node_principal(node: str) -> str:
    """The principal `gpupool up` (and the test stacks) make for one simulated node: `node-NODE` where the node's
    name makes a principal name, else `node-` and a digest of it."""
    name = f"node-{node}"
    if NAME_RE.match(name):
        return name
    return f"node-{hashlib.sha256(node.encode()).hexdigest()[:16]}"


def credentials_dir(home: Path) -> Path:
    return home / "credentials"


def _private_dir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, 0o700)
    return path


def save(home: Path, creds: Credentials) -> Path:
    path = _private_dir(credentials_dir(home)) / f"{creds.name}.json"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(asdict(creds), f)
    os.chmod(path, 0o600)
    return path


def forget(home: Path, name: str) -> None:
    (credentials_dir(home) / f"{name}.json").unlink(missing_ok=True)


def stored(home: Path, name: str) -> Credentials | None:
    try:
        doc = json.loads((credentials_dir(home) / f"{name}.json").read_text())
    except (OSError, ValueError):
        return None
    return Credentials(**doc)


def stored_all(home: Path) -> list[Credentials]:
    d = credentials_dir(home)
    return sorted((c for p in d.glob("*.json") if (c := stored(home, p.stem)) is not None),
                  key=lambda c: c.name) if d.is_dir() else []


def load(cfg: Config, name: str | None = None) -> Credentials:
    """The credentials of `name` (default: the configured user): the stored file, overridden by the environment."""
    name = name or cfg.user
    creds = stored(cfg.home, name)
    password, token = os.environ.get("GPUPOOL_PASSWORD"), os.environ.get("GPUPOOL_TOKEN")
    if name != cfg.user:  # the environment speaks for the configured user only
        password = token = None
    if creds is None:
        if password is None:
            raise CredentialsError(
                f"no credentials for principal {name!r} under {credentials_dir(cfg.home)}: run `gpupool up` (which "
                f"creates admin, service and node) or `gpupool user add {name} --role ROLE`, or set GPUPOOL_PASSWORD")
        return Credentials(name, os.environ.get("GPUPOOL_ROLE", ""), os.environ.get("GPUPOOL_TENANT") or None,
                           password, token or "")
    if password is not None or token is not None:
        creds = Credentials(creds.name, creds.role, creds.tenant, password or creds.password, token or creds.token,
                            creds.nodes, creds.auto_admit)
    return creds


# ---------------------------------------------------------------- Kafka connection options


@dataclass(frozen=True)
class KafkaConn:
    """Everything an aiokafka or Faust client needs to reach the broker as one principal."""
    bootstrap: str
    username: str
    password: str
    mechanism: str = "SCRAM-SHA-512"
    protocol: str = "SASL_PLAINTEXT"
    cafile: str | None = None

    def ssl_context(self) -> ssl.SSLContext | None:
        if self.protocol != "SASL_SSL":
            return None
        ctx = ssl.create_default_context(cafile=self.cafile)
        return ctx

    def options(self) -> dict:
        """Keyword arguments for AIOKafkaProducer / AIOKafkaConsumer / AIOKafkaAdminClient."""
        return {"bootstrap_servers": self.bootstrap, "security_protocol": self.protocol,
                "sasl_mechanism": self.mechanism, "sasl_plain_username": self.username,
                "sasl_plain_password": self.password, "ssl_context": self.ssl_context()}

    def faust_credentials(self):
        import faust

        return faust.SASLCredentials(username=self.username, password=self.password, mechanism=self.mechanism,
                                     ssl_context=self.ssl_context())

    def as_user(self, username: str, password: str) -> "KafkaConn":
        return KafkaConn(self.bootstrap, username, password, self.mechanism, self.protocol, self.cafile)


def local_cafile(cfg: Config) -> str | None:
    """The local broker's own CA, when it runs with TLS."""
    path = cfg.home / "kafka" / "data" / "tls" / "ca.pem"
    return str(path) if path.exists() else None


def kafka_conn(cfg: Config, name: str | None = None) -> KafkaConn:
    creds = load(cfg, name)
    cafile = cfg.kafka_cafile or (local_cafile(cfg) if cfg.kafka_protocol == "SASL_SSL" else None)
    return KafkaConn(cfg.bootstrap, creds.name, creds.password, cfg.kafka_mechanism, cfg.kafka_protocol, cafile)
