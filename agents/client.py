"""The one client of the control plane, shared by the CLI, the audit and the demo: it acts as one principal, sends
that principal's requests to its inbox (the gateway turns them into facts), and asks the worker's HTTP API with the
principal's token. Nothing here decides anything."""
from __future__ import annotations

import asyncio
import base64
import json
import os
import time
import urllib.error
import urllib.parse
import urllib.request
from datetime import datetime, timezone
from pathlib import Path

import yaml

from infra import security
from infra.config import Config
from schemas.envelope import encode, envelope
from schemas.topics import inbox


class ApiFailure(SystemExit):
    """The worker refused or failed a request: one line, exit status 1."""


class WorkerDown(ApiFailure):
    """Nothing answers on the worker's port."""


SQL_ROLES = ("finance", "auditor", "operator")


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def supervisor_pid(cfg: Config) -> int | None:
    """The pid of this home's running `gpupool supervise`, or None: a stale or foreign pid file counts as none."""
    try:
        pid = int((cfg.home / "run" / "supervisor.pid").read_text())
        line = Path(f"/proc/{pid}/cmdline").read_bytes()
        os.kill(pid, 0)
    except (OSError, ValueError):
        return None
    ours = b"agents.cli\x00supervise\x00" in line and f"--home\x00{cfg.home}\x00".encode() in line
    return pid if ours else None


class Client:
    def __init__(self, cfg: Config, user: str | None = None):
        self.cfg = cfg.acting_as(user)
        self._creds: security.Credentials | None = None

    @property
    def creds(self) -> security.Credentials:
        if self._creds is None:
            self._creds = security.load(self.cfg)
        return self._creds

    @property
    def name(self) -> str:
        return self.cfg.user

    def conn(self) -> security.KafkaConn:
        return security.kafka_conn(self.cfg)

    def qualify(self, tenant: str, ident: str) -> str:
        """The id the gateway will give a request's subject: "NAME" of tenant T is "T/NAME"."""
        return ident if ident.startswith(f"{tenant}/") else f"{tenant}/{ident}"

    def job_ref(self, job: str) -> str:
        """A job as its caller names it: a tenant names its own jobs with or without the tenant (a service replica
        "chat/r2" is acme's "acme/chat/r2"); operators and the others name TENANT/NAME."""
        return self.qualify(self.creds.tenant, job) if self.creds.role == "tenant" else job

    def own_tenant(self, asked: str | None) -> str:
        """The tenant a request is for: a tenant principal's own (default), or the one an operator names."""
        role, mine = self.creds.role, self.creds.tenant
        if role == "tenant":
            if asked and asked != mine:
                raise SystemExit(f"{self.name} is a member of tenant {mine!r} and acts for it alone, not {asked!r}")
            return mine
        if not asked:
            raise SystemExit(f"{self.name} ({role or 'operator'}) acts for any tenant: name one with --tenant")
        return asked

    # ---------------------------------------------------------------- requests

    def send(self, payloads) -> None:
        """Produce requests to this principal's inbox, in order. The envelope's source, seq and time are the
        client's own claims: the gateway replaces them with what the broker owns."""
        from aiokafka import AIOKafkaProducer
        from aiokafka.errors import KafkaError

        topic = inbox(self.name).name
        base = time.time_ns() // 1000

        async def go():
            producer = AIOKafkaProducer(**self.conn().options(), acks="all", enable_idempotence=True)
            try:
                await producer.start()
                for i, p in enumerate(payloads):
                    env = envelope(p, source=f"cli/{self.name}", seq=base + i, time_ms=now_ms())
                    await producer.send(topic, key=(getattr(p, "job_id", None) or "").encode(), value=encode(env))
                await producer.flush()
            except KafkaError as exc:
                raise SystemExit(f"could not send to {topic} as {self.name}: {type(exc).__name__}: {exc}") from None
            finally:
                await producer.stop()

        asyncio.run(go())

    # ---------------------------------------------------------------- the worker's API

    def _url(self, path: str, params: dict | None = None) -> str:
        q = urllib.parse.urlencode({k: v for k, v in (params or {}).items() if v is not None})
        return f"http://127.0.0.1:{self.cfg.web_port}{path}" + (f"?{q}" if q else "")

    def api(self, path: str, params: dict | None = None, body: dict | None = None, timeout: float = 60.0) -> dict:
        auth = base64.b64encode(f"{self.name}:{self.creds.token}".encode()).decode()
        req = urllib.request.Request(self._url(path, params), method="POST" if body is not None else "GET",
                                     data=json.dumps(body).encode() if body is not None else None,
                                     headers={"Authorization": f"Basic {auth}", "Content-Type": "application/json"})
        for attempt in range(60):
            try:
                with urllib.request.urlopen(req, timeout=timeout) as resp:
                    return json.loads(resp.read())
            except urllib.error.HTTPError as exc:
                if exc.code == 503 and attempt < 59:
                    time.sleep(0.5)  # the worker is (re)starting and says so: ask again
                    continue
                try:
                    msg = json.loads(exc.read()).get("error", "")
                except ValueError:
                    msg = ""
                raise ApiFailure(f"{path}: {exc.code} {msg}".rstrip()) from None
            except (urllib.error.URLError, OSError) as exc:
                if supervisor_pid(self.cfg) is not None and attempt < 59:
                    time.sleep(0.5)  # a supervisor runs this home's stack: the worker is being restarted
                    continue
                raise WorkerDown(f"the worker does not answer on port {self.cfg.web_port} ({exc}): start it with "
                                 f"`gpupool up`") from None
        raise AssertionError("unreachable")

    def rows(self, path: str, params: dict | None = None) -> tuple[list[str], list[list]]:
        doc = self.api(path, params)
        return doc["columns"], doc["rows"]

    def sql(self, sql: str, parameters: dict | None = None) -> tuple[list[str], list[list]]:
        """One read-only statement through the worker; with the worker down and the embedded engine, on its files
        directly (whoever may read $GPUPOOL_HOME/clickhouse may read the bill), under the same guard."""
        try:
            doc = self.api("/api/sql", body={"sql": sql, "parameters": parameters or {}})
        except WorkerDown:
            if not self.cfg.clickhouse.startswith("chdb://") or self.creds.role not in SQL_ROLES:
                raise
            from infra import sql_guard

            try:
                return sql_guard.run_readonly(self.cfg.clickhouse, sql, parameters)
            except sql_guard.QueryRefused as exc:
                raise ApiFailure(f"refused: {exc}") from None
        return doc["columns"], doc["rows"]

    def records(self, sql: str, parameters: dict | None = None) -> list[dict]:
        cols, rows = self.sql(sql, parameters)
        return [dict(zip(cols, r)) for r in rows]

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self._url("/healthz"), timeout=2) as resp:
                return json.loads(resp.read()).get("ok", False)
        except (OSError, ValueError):
            return False


# ---------------------------------------------------------------- what a principal types, as the pool reads it


def parse_time(s: str | None) -> int | None:
    """ISO 8601 (UTC unless it says otherwise) or epoch milliseconds -> epoch milliseconds."""
    if s is None:
        return None
    if s.isdigit():
        return int(s)
    try:
        dt = datetime.fromisoformat(s)
    except ValueError:
        raise SystemExit(f"time {s!r}: ISO 8601 (2026-12-01T09:00) or epoch milliseconds") from None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=timezone.utc)
    return int(dt.timestamp() * 1000)


def price_rows(text: str, valid_from_ms: int = 0) -> list:
    """A price book file (YAML: `currency: USD` and `prices: [{gpu_model, per_gpu_hour, borrowed?, datacenter?,
    tod_band?, tier?, currency?}]`) as price.set requests; a one-line error naming the row and field otherwise. The
    book's `currency` (ISO 4217; USD when absent) applies to each row that names none. `per_gpu_hour` is read as a
    decimal (no float rounding) and must be a whole number of micro-units."""
    from decimal import Decimal, InvalidOperation

    from pydantic import ValidationError

    from schemas.events import PriceSet
    from schemas.gpu_models import MODELS
    from schemas.money import DEFAULT_CURRENCY, MICRO, check_currency

    try:
        doc = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        raise SystemExit(f"price book: not YAML: {exc}") from None
    rows = doc.get("prices") if isinstance(doc, dict) else None
    if not isinstance(rows, list) or not rows:
        raise SystemExit("price book: a `prices:` list of rows is needed")
    try:
        book_currency = check_currency(doc.get("currency", DEFAULT_CURRENCY))
    except ValueError as exc:
        raise SystemExit(f"price book: {exc}") from None
    out = []
    for i, row in enumerate(rows, 1):
        if not isinstance(row, dict):
            raise SystemExit(f"price book row {i}: a mapping, not {row!r}")
        row = dict(row)
        price = row.pop("per_gpu_hour", None)
        try:
            micro = Decimal(str(price)) * MICRO if isinstance(price, (int, float, str)) else None
        except InvalidOperation:
            micro = None
        if micro is None or not micro.is_finite() or micro < 0:
            raise SystemExit(f"price book row {i}: per_gpu_hour must be a number >= 0, not {price!r}")
        if micro != micro.to_integral_value():
            raise SystemExit(f"price book row {i}: per_gpu_hour {price!r} is finer than a micro-unit (6 decimals)")
        if row.get("gpu_model") not in MODELS:
            raise SystemExit(f"price book row {i}: gpu_model {row.get('gpu_model')!r} is not a known card model "
                             f"({', '.join(sorted(MODELS))})")
        row.setdefault("currency", book_currency)
        try:
            out.append(PriceSet(micro_per_gpu_hour=int(micro), valid_from_ms=valid_from_ms, **row))
        except ValidationError as exc:
            first = exc.errors()[0]
            raise SystemExit(f"price book row {i}: {'.'.join(str(p) for p in first['loc'])}: {first['msg']}") from None
    return out
