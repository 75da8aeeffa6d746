"""ClickHouse through clickhouse-connect only: the embedded chdb engine by default, any server by URL."""
from __future__ import annotations

from importlib import resources

import clickhouse_connect


def statements() -> list[str]:
    sql = resources.files("infra").joinpath("ddl.sql").read_text()
    lines = [ln for ln in sql.splitlines() if not ln.lstrip().startswith("--")]
    return [s.strip() for s in "\n".join(lines).split(";") if s.strip()]


def connect(dsn: str, apply_ddl: bool = True, settings: dict | None = None):
    """A client for `dsn` (chdb:///path or http(s)://...). chdb allows one process per data path. `settings`: the
    session's (chdb: SET, in order, as the client is made; a server: sent with every request)."""
    if dsn.startswith("chdb://"):
        path = dsn[len("chdb://"):]
        if path.startswith("/") or path.startswith("."):
            import os
            from pathlib import Path
            Path(path).mkdir(parents=True, exist_ok=True)
            os.chmod(path, 0o700)  # the embedded engine's files (every bill) are the service's user's only
    client = clickhouse_connect.get_client(dsn=dsn, settings=settings)
    if apply_ddl:
        for stmt in statements():
            client.command(stmt)
    return client
