"""Ad-hoc SQL for finance, auditors and operators (`gpupool sql`, POST /api/sql), kept harmless by ClickHouse itself.

1. One statement: a small lexer (quotes, back-quotes, comments) finds any `;` that is not the last character. The
   embedded engine runs every statement of a multi-statement string, so this check comes first.
2. ClickHouse parses it (`EXPLAIN AST`): the statement must be a SELECT, SHOW, DESCRIBE or EXPLAIN; table functions
   other than pure generators (numbers, zeros, values, ...) and functions that reach files, URLs or other servers
   are refused, as are INTO OUTFILE and a SETTINGS clause.
3. It runs with `readonly=1` (ClickHouse refuses any write, also one hidden in WITH or a subquery, and any change
   of a setting), on a fresh session (the embedded engine keeps settings per session, so the worker's own session
   never becomes read-only), under ClickHouse's own limits: time, rows read, result rows, memory.
4. The caller runs it off the event loop (a thread), so no query can stall folding or scheduling.
"""
from __future__ import annotations

from dataclasses import dataclass

LIMITS = {
    "max_execution_time": 10,
    "max_rows_to_read": 200_000_000,
    "max_result_rows": 100_000,
    "result_overflow_mode": "throw",
    "max_memory_usage": 2 << 30,
}
ALLOWED_STATEMENTS = frozenset({"SelectWithUnionQuery", "ShowTables", "DescribeQuery", "ShowCreateTableQuery",
                                "ShowDatabases", "ShowColumns"})
# Table functions that read nothing but what they generate.
SAFE_TABLE_FUNCTIONS = frozenset({"numbers", "numbers_mt", "zeros", "zeros_mt", "generate_series",
                                  "generateSeries", "values", "null", "view", "merge"})
# Functions (scalar or table) that reach the host, the network or other servers.
OUTSIDE_FUNCTIONS = frozenset({
    "file", "url", "urlCluster", "fileCluster", "remote", "remoteSecure", "cluster", "clusterAllReplicas", "s3",
    "s3Cluster", "gcs", "hdfs", "hdfsCluster", "azureBlobStorage", "azureBlobStorageCluster", "mysql", "postgresql",
    "mongodb", "redis", "sqlite", "jdbc", "odbc", "executable", "executablePool", "input", "iceberg", "icebergS3",
    "deltaLake", "hudi", "hive", "dictionary", "format", "loop", "fuzzJSON", "fuzzQuery", "ytsaurus", "arrowFlight",
    "mergeTreeIndex", "mergeTreeProjection", "paimon", "filesystem", "prometheusQuery", "timeSeriesData",
})


class QueryRefused(ValueError):
    pass


def single_statement(sql: str) -> str:
    """The statement without a trailing `;`; QueryRefused when there is more than one."""
    i, n = 0, len(sql)
    last_semicolon = -1
    while i < n:
        c = sql[i]
        if c in ("'", '"', "`"):
            j = i + 1
            while j < n and sql[j] != c:
                j += 2 if sql[j] == "\\" else 1
            i = j + 1
            continue
        if sql.startswith("--", i) or sql.startswith("#", i):
            j = sql.find("\n", i)
            i = n if j < 0 else j + 1
            continue
        if sql.startswith("/*", i):
            j = sql.find("*/", i + 2)
            i = n if j < 0 else j + 2
            continue
        if c == ";":
            if last_semicolon >= 0 or sql[i + 1:].strip():
                raise QueryRefused("one statement per query: found a ';' followed by more")
            last_semicolon = i
        i += 1
    body = sql[:last_semicolon] if last_semicolon >= 0 else sql
    if not body.strip():
        raise QueryRefused("empty query")
    return body.strip()


@dataclass(frozen=True)
class Node:
    label: str
    depth: int


def _ast(lines: list[str]) -> list[Node]:
    return [Node(line.strip(), len(line) - len(line.lstrip(" "))) for line in lines if line.strip()]


def check_ast(lines: list[str]) -> None:
    """Refuse what the statement's AST (ClickHouse's `EXPLAIN AST` lines) shows it would reach or change."""
    nodes = _ast(lines)
    if not nodes:
        raise QueryRefused("ClickHouse could not parse the query")
    top = nodes[0].label.split(" ")[0]
    if top not in ALLOWED_STATEMENTS:
        raise QueryRefused(f"read-only queries only (SELECT, SHOW, DESCRIBE): this is a {top}")
    for k, node in enumerate(nodes):
        words = node.label.split()
        if words[0] == "Set" or words[0] == "SetQuery":
            raise QueryRefused("a SETTINGS clause is not allowed: the limits are the server's")
        if words[0] == "Function" and len(words) > 1:
            name = words[1]
            parent = next((p for p in reversed(nodes[:k]) if p.depth < node.depth), None)
            is_table = parent is not None and parent.label.startswith("TableExpression")
            if name in OUTSIDE_FUNCTIONS or (is_table and name not in SAFE_TABLE_FUNCTIONS):
                raise QueryRefused(f"{name}() reaches outside the pool's tables and is not allowed")
    if top == "SelectWithUnionQuery":
        children = [n for n in nodes[1:] if n.depth == nodes[1].depth]
        if any(n.label.startswith("Literal") for n in children):
            raise QueryRefused("INTO OUTFILE is not allowed")


def run_readonly(dsn: str, sql: str, parameters: dict | None = None, limits: dict | None = None):
    """Check and run one read-only statement on a fresh session; returns (column names, rows). Blocking: call it
    from a thread."""
    from infra.clickhouse import connect

    body = single_statement(sql)
    settings = {**LIMITS, **(limits or {})}
    client = connect(dsn, apply_ddl=False)
    try:
        # EXPLAIN AST only parses (one statement: checked above). The query then runs with the limits and readonly
        # last, as the session's first settings: a read-only session refuses any later change of a setting.
        ast = client.query(f"EXPLAIN AST {body}", parameters=parameters or None)
        check_ast([r[0] for r in ast.result_rows])
        result = client.query(body, parameters=parameters or None, settings={**settings, "readonly": 1})
        return list(result.column_names), [list(r) for r in result.result_rows]
    finally:
        client.close()
