"""Ad-hoc SQL for finance, auditors and operators (`gpupool sql`, POST /api/sql), kept harmless by ClickHouse itself.

No lexer of ours decides what a text means: ClickHouse's parser does, on a session that is read-only before it sees
a byte of the text.
1. Size: a text over MAX_SQL_BYTES is refused before anything parses it (QueryTooLarge; the API answers 413), and
   ClickHouse's own `max_query_size` bounds every parse below.
2. A read-only session: the embedded engine gets a fresh client whose session settings (the limits, then
   `readonly=1`, last) are SET when it is created, before any query; a server gets the same settings with every
   request, which it applies before it parses the text. Either way ClickHouse refuses writes, DDL, any change of a
   setting (`SET readonly = 0` included) and the table functions that create or reach out (file, url, s3, remote,
   executable, ...), whatever the text hides; not everything: KILL QUERY and SYSTEM STOP MERGES run read-only, and
   the embedded engine writes INTO OUTFILE's file on the host (4 refuses those). The session is asked for its
   `readonly` before it is used.
3. One statement, by ClickHouse's parser, never executed while being checked: the text goes as a bound String
   parameter to `formatQuerySingleLine`, which parses it and fails on a second statement (dollar quotes, comments,
   nested comments: the parser's own rules). Its output is the canonical text of that one statement, which is
   parsed once more the same way; from here on only the canonical text is used (no comment, no dollar quote left).
4. `EXPLAIN AST` of the canonical text (it parses, it does not run the statement) must show a SELECT, SHOW or
   DESCRIBE; no SETTINGS clause; nothing on the statement but its select list, tables, names and format (a literal
   there is INTO OUTFILE, on SELECT, SHOW and DESCRIBE alike); no table function but pure generators; no function
   that reads files, URLs or other servers (the scalar `file()` reads host files even under readonly).
5. Parameters are bound by ClickHouse only (`{name:Type}` placeholders): text that clickhouse-connect would bind
   itself (`%(name)s`) is refused, so the text that runs is the text that was checked.
6. The canonical text runs, on the same read-only session, under ClickHouse's limits: time, rows read, result rows,
   memory, query size. The caller runs it off the event loop (a thread), so no query can stall folding or scheduling.

Programs' output is not the pool's record: the database `gpupool_logs` (infra/ddl.sql) is never named, and no
table function reaches it by pattern (`merge()` takes a database by its literal name only, never REGEXP() or an
expression). A job's output is its tenant's and the operators' to read, through `gpupool logs` (/api/logs).

Reading `system.*` is allowed: it is the engine's own metadata (the roles that may run SQL read every pool table
anyway), and what the engine's default user may not read (`system.users`: SHOW USERS) ClickHouse refuses itself.
"""
from __future__ import annotations

from dataclasses import dataclass

MAX_SQL_BYTES = 64 * 1024  # the longest SQL text accepted, in UTF-8 bytes (the API answers 413 above it)
LIMITS = {
    "max_execution_time": 10,
    "max_rows_to_read": 200_000_000,
    "max_result_rows": 100_000,
    "result_overflow_mode": "throw",
    "max_memory_usage": 2 << 30,
    "max_query_size": MAX_SQL_BYTES,
}
ALLOWED_STATEMENTS = frozenset({"SelectWithUnionQuery", "ShowTables", "DescribeQuery", "ShowCreateTableQuery",
                                "ShowDatabases", "ShowColumns"})
# What may hang right under the statement in its AST: the select list, a table, names, the output format.
# A Literal there is INTO OUTFILE (or its COMPRESSION), a Set is a SETTINGS clause; anything else is refused too.
TOP_CHILDREN = frozenset({"ExpressionList", "Identifier", "TableExpression", "TableIdentifier"})
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
# The database of programs' output (docs/jobs.md, "Logs"): out of ad-hoc SQL's reach (7. above)
LOGS_DATABASE = "gpupool_logs"
LOGS_REFUSED = (f"{LOGS_DATABASE} holds programs' output, which is not for ad-hoc SQL: `gpupool logs JOB` shows a "
                "job's output to its tenant and to operators")
# Parses the text (a bound parameter: never part of the query text) into one statement's canonical text, and that
# text once more; `getSetting` shows the session is read-only before anything else runs on it.
CANONICAL_SQL = ("SELECT formatQuerySingleLine({q:String}) AS canonical, formatQuerySingleLine(canonical) AS again, "
                 "getSetting('readonly') AS readonly")


class QueryRefused(ValueError):
    pass


class QueryTooLarge(QueryRefused):
    pass


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
        if node.depth == nodes[0].depth + 1 and words[0] not in TOP_CHILDREN:
            if words[0] == "Literal":
                raise QueryRefused("INTO OUTFILE is not allowed")
            raise QueryRefused(f"a {words[0]} clause on the statement is not allowed")
        if LOGS_DATABASE in node.label:  # a table, a name or a literal (canonical: its escapes resolved)
            raise QueryRefused(LOGS_REFUSED)
        if words[0] == "Function" and len(words) > 1:
            name = words[1]
            parent = next((p for p in reversed(nodes[:k]) if p.depth < node.depth), None)
            is_table = parent is not None and parent.label.startswith("TableExpression")
            if name in OUTSIDE_FUNCTIONS or (is_table and name not in SAFE_TABLE_FUNCTIONS):
                raise QueryRefused(f"{name}() reaches outside the pool's tables and is not allowed")
            if name.upper() == "REGEXP":  # databases by pattern (merge's first argument): programs' output too
                raise QueryRefused("REGEXP() (databases by pattern) is not allowed: " + LOGS_REFUSED)
            if name == "merge":
                inside = []
                for later in nodes[k + 1:]:
                    if later.depth <= node.depth:
                        break
                    inside.append(later)
                args = [a for a in inside if a.depth == node.depth + 2]
                if len(args) >= 2 and args[0].label.split(" ")[0] != "Literal":
                    raise QueryRefused("merge() takes its database by name only (a string literal): "
                                       + LOGS_REFUSED)


def check_size(sql: str) -> None:
    n = len(sql.encode("utf-8", "surrogatepass"))
    if n > MAX_SQL_BYTES:
        raise QueryTooLarge(f"the SQL text is {n} bytes: at most {MAX_SQL_BYTES} are accepted")


def session(dsn: str, limits: dict | None = None):
    """A fresh read-only session: (a client, the settings each of its queries must carry). The embedded engine: a
    new client (its own session) whose settings are SET as it is made, before any query, `readonly` last (it
    forbids any later change); a server: the settings ride with every request, applied before the text is parsed."""
    from infra.clickhouse import connect

    settings = {**LIMITS, **(limits or {}), "readonly": 1}
    if dsn.startswith("chdb:"):
        return connect(dsn, apply_ddl=False, settings=settings), None
    return connect(dsn, apply_ddl=False), settings


def canonical(client, sql: str, per_query: dict | None) -> str:
    """The one statement `sql` holds, as ClickHouse formats it; QueryRefused for none, several, or a session that
    is not read-only. Nothing of `sql` is executed: it is a value that formatQuerySingleLine parses."""
    from clickhouse_connect.driver.exceptions import DatabaseError

    if not sql.strip():
        raise QueryRefused("empty query")
    try:
        r = client.query(CANONICAL_SQL, parameters={"q": sql}, settings=per_query)
    except DatabaseError as exc:  # ClickHouse's parser said no: say why
        msg = str(exc)
        if "Multi-statements are not allowed" in msg:
            raise QueryRefused("one statement per query: ClickHouse's parser found more than one") from None
        if "Empty query" in msg:
            raise QueryRefused("empty query") from None
        raise QueryRefused(f"ClickHouse could not parse the query: {msg.splitlines()[0][:1500]}") from None
    text, _, readonly = r.result_rows[0]
    if int(readonly) < 1:  # never expected: the session was made read-only before this query
        raise RuntimeError("the SQL session is not read-only: nothing is run")
    return text


def check_parameters(text: str, parameters: dict | None) -> None:
    """Parameters must be ClickHouse's to bind: refuse any that clickhouse-connect would paste into the text."""
    if not parameters:
        return
    if not isinstance(parameters, dict):
        raise QueryRefused("parameters: an object of name -> value")
    from clickhouse_connect.driver.binding import bind_query

    try:
        bound, _ = bind_query(text, parameters)
    except Exception as exc:  # noqa: BLE001 - the client could not bind them: the caller's mistake
        raise QueryRefused(f"parameters: {exc}") from None
    if bound != text:
        raise QueryRefused("parameters are bound by ClickHouse: write them as {name:Type} placeholders")


def run_readonly(dsn: str, sql: str, parameters: dict | None = None, limits: dict | None = None):
    """Check and run one read-only statement on a fresh read-only session; returns (column names, rows). Blocking:
    call it from a thread."""
    check_size(sql)
    client, per_query = session(dsn, limits)
    try:
        text = canonical(client, sql, per_query)
        check_parameters(text, parameters)
        # raw: no FORMAT clause appended (a statement that takes none, SYSTEM ..., would not parse with one)
        ast = client.raw_query(f"EXPLAIN AST {text}", parameters=parameters or None, settings=per_query)
        check_ast(ast.decode("utf-8", "replace").split("\n"))  # TSV: a literal's own line breaks are escaped
        result = client.query(text, parameters=parameters or None, settings=per_query)
        return list(result.column_names), [list(r) for r in result.result_rows]
    finally:
        client.close()
