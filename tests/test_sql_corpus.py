"""Ad-hoc SQL (infra/sql_guard.py) against a real embedded ClickHouse: a corpus of bypass attempts, each of which
must be refused for the reason it names and leave the database as it was (rows, sums, tables, databases, no file
written, the worker's own session still writable), and a negative control of legitimate finance queries that must
answer correctly. The read-only session itself is probed too: a write hidden in a multi-statement string given
straight to it is refused by ClickHouse."""
from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest

from infra import sql_guard
from infra.clickhouse import connect

USAGE_COLUMNS = ["tenant", "project", "event_id", "job_id", "node", "gpu_model", "start_ms", "end_ms", "gpu_milli",
                 "gpu_milli_ms"]
USAGE = [["acme", "p1", "e1", "acme/a", "node-000", "A100-80GB", 0, 1000, 1000, 371_000],
         ["acme", "p2", "e2", "acme/b", "node-000", "A100-80GB", 0, 2000, 500, 500_000],
         ["globex", "", "e3", "globex/c", "node-001", "H100-80GB", 0, 3000, 1000, 3_000_000]]


def seed(writer) -> None:
    writer.insert("gpupool.usage", USAGE, column_names=USAGE_COLUMNS)
    writer.insert("gpupool_logs.job_logs", [["acme/a", 1, "stdout", 0, "acme's secret output\n"]],
                  column_names=["job_id", "attempt", "stream", "seq", "text"])
    writer.command("INSERT INTO gpupool.price_book (gpu_model, datacenter, tod_band, tier, borrowed, "
                   "micro_per_gpu_hour, valid_from) VALUES ('A100-80GB', 'dc1', 'day', 'standard', false, 2000000, 0)")


@pytest.fixture(scope="module")
def module_store(tmp_path_factory):
    """One embedded ClickHouse (chdb: one data path per process) with the pool's tables and three usage rows; the
    writer client is the worker's own kind of session."""
    base = tmp_path_factory.mktemp("sqlcorpus")
    dsn = f"chdb://{base / 'clickhouse'}"
    writer = connect(dsn)
    seed(writer)
    out = base / "out"
    out.mkdir()
    yield dsn, writer, out
    writer.close()


@pytest.fixture
def store(module_store):
    """The module's store; a test that changed it (it failed) leaves it rebuilt as it was, so that one case's
    failure does not make every later case fail too."""
    dsn, writer, out = module_store
    before = snapshot(writer, out)
    yield module_store
    try:
        if snapshot(writer, out) == before:
            return
    except Exception:  # noqa: BLE001 - a table the snapshot reads is gone: rebuild
        pass
    for db in {r[0] for r in writer.query("SELECT name FROM system.databases").result_rows} - {
            "system", "default", "INFORMATION_SCHEMA", "information_schema"}:
        writer.command(f"DROP DATABASE IF EXISTS `{db}` SYNC")
    for (t,) in writer.query("SELECT name FROM system.tables WHERE database = 'default'").result_rows:
        writer.command(f"DROP TABLE IF EXISTS default.`{t}` SYNC")
    for f in out.iterdir():
        f.unlink()
    writer.command("SET readonly = 0")
    connect(dsn).close()  # the pool's tables again
    seed(writer)


def snapshot(writer, out: Path) -> dict:
    """Everything an attempt could change, as the worker's session sees it."""
    q = writer.query
    return {
        "usage": q("SELECT count(), sum(gpu_milli_ms) FROM gpupool.usage").result_rows,
        "usage_daily": q("SELECT count(), sum(gpu_milli_ms) FROM gpupool.usage_daily").result_rows,
        "price_book": q("SELECT count() FROM gpupool.price_book").result_rows,
        "tables": sorted(q("SELECT database, name, engine FROM system.tables WHERE database NOT IN "
                           "('system', 'INFORMATION_SCHEMA', 'information_schema')").result_rows),
        "databases": sorted(q("SELECT name FROM system.databases").result_rows),
        "columns": q("SELECT count() FROM system.columns WHERE database = 'gpupool'").result_rows,
        "files": sorted(p.name for p in out.iterdir()),
        "worker_readonly": q("SELECT getSetting('readonly')").result_rows,
    }


ONE = "one statement per query"
READ_ONLY = r"read-only queries only|readonly mode"  # the statement's kind (AST), or ClickHouse's READONLY
OUTSIDE = r"reaches outside the pool's tables"
OUTFILE = "INTO OUTFILE is not allowed"
SETTINGS = r"SETTINGS clause is not allowed|Cannot modify '\w+' setting in readonly mode"
PARSE = "ClickHouse could not parse the query"
PARAMS = r"parameters are bound by ClickHouse|parameters:"
DENIED = "Not enough privileges"
LOGS = "holds programs' output, which is not for ad-hoc SQL"
WRITE = "INSERT INTO gpupool.usage (tenant, event_id, gpu_milli_ms) VALUES ('globex', 'forged', 3600000)"
OUT = "{out}"  # replaced by the test's own directory for files

# (sql, parameters, the refusal's reason: a regex over the error's text)
CORPUS: list[tuple[str, dict | None, str]] = [
    # -- more than one statement: dollar quotes, quotes, comments, unicode --------------------------------------
    (f"SELECT $$'$$; {WRITE}; SELECT '1'", None, ONE),  # the reported attack
    ("SELECT $$'$$; CREATE TABLE gpupool.evil (a Int8) ENGINE = Memory; SELECT '1'", None, ONE),
    ("SELECT $$'$$; DROP TABLE gpupool.price_book; SELECT '1'", None, ONE),
    (f"SELECT $tag$ ' $tag$; {WRITE}; SELECT 1", None, ONE),
    ("SELECT $a$;$a$; DROP TABLE gpupool.price_book", None, ONE),
    (f"SELECT \u2018'\u2019; {WRITE}; SELECT '1'", None, ONE),  # curly quotes are ClickHouse string quotes
    ("SELECT 1; DROP TABLE gpupool.price_book", None, ONE),
    ("SELECT 1;ALTER TABLE gpupool.usage DELETE WHERE 1", None, ONE),
    (f"SELECT 1 -- '\n; {WRITE}", None, ONE),
    (f"SELECT 1 # '\n; {WRITE}", None, ONE),
    (f"SELECT 1 /* ' */ ; {WRITE}", None, ONE),
    ("SELECT '\\''; DROP TABLE gpupool.price_book; SELECT 1", None, ONE),
    ("SELECT 'a'';'; DROP TABLE gpupool.price_book", None, ONE),
    ('SELECT "a;b" FROM (SELECT 1 AS "a;b"); DROP TABLE gpupool.price_book', None, ONE),
    ("SELECT `x;` FROM (SELECT 1 AS `x;`); DROP TABLE gpupool.price_book", None, ONE),
    ("SELECT 1\n;\nDROP TABLE gpupool.price_book\n;", None, ONE),
    ("SELECT 1; SET readonly = 0", None, ONE),
    (f"1; {WRITE}", None, ONE),  # the embedded engine's implicit SELECT
    ("SELECT 1\u200b; DROP TABLE gpupool.price_book", None, ONE),  # zero-width space
    ("SELECT '\u202e'; DROP TABLE gpupool.price_book; SELECT '\u202c'", None, ONE),  # right-to-left override
    ("SELECT 1\uff1b DROP TABLE gpupool.price_book", None, PARSE),  # fullwidth semicolon: not a separator
    ("SELECT 1\u037e DROP TABLE gpupool.price_book", None, PARSE),  # Greek question mark
    ("DR\u200dOP TABLE gpupool.price_book", None, PARSE),  # zero-width joiner inside a keyword
    ("SELECT 1\x00; DROP TABLE gpupool.price_book", None, PARSE),  # NUL
    ("", None, "empty query"),
    ("  -- a comment only\n/* and another */", None, "empty query"),
    # -- writes and administration as one statement -------------------------------------------------------------
    (WRITE, None, READ_ONLY),
    ("INSERT INTO gpupool.usage SELECT * FROM gpupool.usage", None, READ_ONLY),
    ("WITH x AS (SELECT 1) INSERT INTO gpupool.price_book (gpu_model) SELECT 'x' FROM x", None, READ_ONLY),
    ("INSERT INTO FUNCTION file('{out}/ins.csv', 'CSV', 'a Int') SELECT 1", None, READ_ONLY),
    ("CREATE TABLE gpupool.evil (a Int8) ENGINE = Memory", None, READ_ONLY),
    ("CREATE TEMPORARY TABLE evil (a Int8)", None, READ_ONLY),
    ("CREATE VIEW gpupool.evil AS SELECT 1", None, READ_ONLY),
    ("CREATE USER evil", None, READ_ONLY),
    ("CREATE DATABASE evil", None, READ_ONLY),
    ("DROP TABLE gpupool.price_book", None, READ_ONLY),
    ("DROP DATABASE gpupool", None, READ_ONLY),
    ("ALTER TABLE gpupool.usage DELETE WHERE 1", None, READ_ONLY),
    ("ALTER TABLE gpupool.usage UPDATE gpu_milli_ms = 0 WHERE 1", None, READ_ONLY),
    ("ALTER TABLE gpupool.usage ADD COLUMN evil Int8", None, READ_ONLY),
    ("DELETE FROM gpupool.usage WHERE 1", None, READ_ONLY),
    ("TRUNCATE TABLE gpupool.usage", None, READ_ONLY),
    ("RENAME TABLE gpupool.price_book TO gpupool.evil", None, READ_ONLY),
    ("EXCHANGE TABLES gpupool.usage AND gpupool.price_book", None, READ_ONLY),
    ("OPTIMIZE TABLE gpupool.usage FINAL", None, READ_ONLY),
    ("KILL QUERY WHERE 1", None, READ_ONLY),  # runs under readonly=1: the statement's kind refuses it
    ("SYSTEM FLUSH LOGS", None, READ_ONLY),
    ("SYSTEM STOP MERGES", None, READ_ONLY),  # runs under readonly=1: the statement's kind refuses it
    ("DETACH TABLE gpupool.price_book", None, READ_ONLY),
    ("ATTACH TABLE gpupool.evil (a Int8) ENGINE = Memory", None, READ_ONLY),
    ("GRANT ALL ON *.* TO default", None, READ_ONLY),
    ("SET readonly = 0", None, READ_ONLY),
    ("USE system", None, READ_ONLY),
    ("BACKUP TABLE gpupool.usage TO File('{out}/backup')", None, READ_ONLY),
    (f"EXPLAIN AST {WRITE}", None, READ_ONLY),
    ("EXPLAIN PIPELINE INSERT INTO gpupool.usage SELECT * FROM gpupool.usage", None, READ_ONLY),
    ("SHOW PROCESSLIST", None, READ_ONLY),
    # -- writes nested in a query: not even one statement -------------------------------------------------------
    (f"SELECT * FROM ({WRITE})", None, PARSE),
    (f"SELECT * FROM view({WRITE})", None, PARSE),
    (f"WITH x AS ({WRITE}) SELECT * FROM x", None, PARSE),
    (f"SELECT 1 WHERE 1 IN (SELECT 1 UNION ALL {WRITE})", None, PARSE),
    # -- settings ---------------------------------------------------------------------------------------------
    ("SELECT 1 SETTINGS readonly = 0", None, SETTINGS),
    ("SELECT count() FROM gpupool.usage SETTINGS max_execution_time = 1000", None, SETTINGS),
    ("SELECT 1 SETTINGS max_execution_time = 10", None, SETTINGS),  # the session's own value: still refused
    ("SELECT * FROM (SELECT 1 SETTINGS max_threads = 64)", None, SETTINGS),
    ("SHOW TABLES FROM gpupool SETTINGS max_threads = 1", None, SETTINGS),
    # -- files, URLs, other servers, programs ------------------------------------------------------------------
    ("SELECT * FROM file('/etc/passwd', 'LineAsString')", None, OUTSIDE),
    ("SELECT file('/etc/hostname')", None, OUTSIDE),  # the scalar file() reads the host under readonly=1
    ("SELECT * FROM numbers(1) WHERE 1 IN (SELECT count() FROM file('/etc/passwd', 'LineAsString'))", None,
     OUTSIDE),
    ("SELECT * FROM view(SELECT * FROM file('/etc/passwd', 'LineAsString'))", None, OUTSIDE),
    ("DESCRIBE TABLE file('/etc/passwd', 'LineAsString')", None, OUTSIDE),
    ("SELECT * FROM url('http://127.0.0.1:1/x', CSV, 'a Int')", None, OUTSIDE),
    ("SELECT * FROM remote('127.0.0.1', system.one)", None, OUTSIDE),
    ("SELECT * FROM remoteSecure('127.0.0.1', system.one)", None, OUTSIDE),
    ("SELECT * FROM cluster('default', system.one)", None, OUTSIDE),
    ("SELECT * FROM s3('http://127.0.0.1:1/bucket/x.csv', 'CSV', 'a Int')", None, OUTSIDE),
    ("SELECT * FROM executable('id', TSV, 'a String')", None, OUTSIDE),
    ("SELECT * FROM input('a Int')", None, OUTSIDE),
    ("SELECT * FROM mysql('127.0.0.1:1', 'd', 't', 'u', 'p')", None, OUTSIDE),
    ("SELECT * FROM postgresql('127.0.0.1:1', 'd', 't', 'u', 'p')", None, OUTSIDE),
    ("SELECT * FROM hdfs('hdfs://127.0.0.1:1/x', 'CSV', 'a Int')", None, OUTSIDE),
    ("SELECT * FROM dictionary('d')", None, OUTSIDE),
    ("SELECT * FROM generateRandom('a Int') LIMIT 1", None, OUTSIDE),  # not a listed pure generator
    # -- files written by the engine itself: INTO OUTFILE (the embedded engine writes it even read-only) --------
    ("SELECT * FROM gpupool.usage INTO OUTFILE '{out}/usage.csv'", None, OUTFILE),
    ("SELECT 1 INTO OUTFILE '{out}/gz' APPEND COMPRESSION 'gzip' LEVEL 3", None, OUTFILE),
    ("SELECT 1 INTO OUTFILE '{out}/both' AND STDOUT", None, OUTFILE),
    ("SHOW TABLES FROM gpupool INTO OUTFILE '{out}/tables'", None, OUTFILE),
    ("SHOW DATABASES INTO OUTFILE '{out}/dbs'", None, OUTFILE),
    ("DESCRIBE TABLE gpupool.usage INTO OUTFILE '{out}/desc'", None, OUTFILE),
    ("SHOW CREATE TABLE gpupool.usage INTO OUTFILE '{out}/create'", None, OUTFILE),
    ("SELECT $$x$$ INTO OUTFILE $$" + "{out}/dollar$$", None, OUTFILE),
    # -- programs' output: its tenant's and the operators' through `gpupool logs`, never ad-hoc SQL's ---------------
    ("SELECT text FROM gpupool_logs.job_logs", None, LOGS),
    ("SELECT l.text FROM `gpupool_logs`.`job_logs` AS l", None, LOGS),
    ("SELECT * FROM view(SELECT text FROM gpupool_logs.job_logs)", None, LOGS),
    ("SELECT count() FROM gpupool.usage WHERE job_id IN (SELECT job_id FROM gpupool_logs.job_logs)", None, LOGS),
    ("SELECT text FROM merge('gpupool_logs', '.*')", None, LOGS),
    ("SELECT text FROM merge('gpupool\\x5Flogs', '.*')", None, LOGS),  # an escape ClickHouse resolves
    ("SELECT text FROM merge(REGEXP('^gpupool'), '^job')", None, LOGS),
    ("SELECT text FROM merge(concat('gpupool', '_logs'), 'job_logs')", None, LOGS),
    ("SELECT * FROM {t:Identifier}", {"t": "gpupool_logs.job_logs"}, LOGS + r"|UNKNOWN_TABLE|Unknown table"),
    ("SHOW TABLES FROM gpupool_logs", None, LOGS),
    # -- system tables: read, except what ClickHouse's own grants refuse ----------------------------------------
    ("SELECT count() FROM system.users", None, DENIED),
    # -- parameters --------------------------------------------------------------------------------------------
    ("SELECT '%(t)s' AS t", {"t": "'; DROP TABLE gpupool.price_book; SELECT '"}, PARAMS),
    ("SELECT %(t)s AS t", {"t": "x"}, PARSE),
    ("SELECT {t:String}", ["x"], PARAMS),
    ("SELECT * FROM {t:Identifier}", {"t": "file('/etc/passwd')"}, r"UNKNOWN_TABLE|Unknown table"),
    ("SELECT * FROM {t:Identifier}", {"t": "system.users"}, r"UNKNOWN_TABLE|Unknown table|" + DENIED),
    # -- size and depth ----------------------------------------------------------------------------------------
    ("SELECT '" + "x" * sql_guard.MAX_SQL_BYTES + "'", None, "at most 65536"),
    ("SELECT 1 /*" + "x" * 60_000 + "*/; DROP TABLE gpupool.price_book", None, ONE),
    ("SELECT " + "(" * 3000 + "1" + ")" * 3000, None, r"parse depth|could not parse"),
]

# Attempts that are harmless as ClickHouse reads them: they may run, and must answer exactly this.
HARMLESS: list[tuple[str, dict | None, list[list]]] = [
    ("SELECT 1 /* a /* nested */ ; DROP TABLE gpupool.price_book */", None, [[1]]),  # one comment, one statement
    ("SELECT {t:String} AS t", {"t": "'; DROP TABLE gpupool.price_book; --"},
     [["'; DROP TABLE gpupool.price_book; --"]]),
    ("SELECT {q:String} AS q", {"q": "SELECT 2"}, [["SELECT 2"]]),  # the guard's own parameter name
    ("SELECT getSetting('readonly')", None, [[1]]),
    ("SELECT value FROM system.settings WHERE name = 'readonly'", None, [["1"]]),
    ("SELECT 1; ", None, [[1]]),
]

# Legitimate finance queries (the negative control): they must run and answer correctly.
CONTROLS: list[tuple[str, dict | None, list[list]]] = [
    ("SELECT tenant, sum(gpu_milli_ms) AS ms FROM gpupool.usage FINAL GROUP BY tenant ORDER BY tenant", None,
     [["acme", 871_000], ["globex", 3_000_000]]),
    ("SELECT sum(gpu_milli_ms) / 1e6 AS gpu_seconds FROM gpupool.usage WHERE tenant = {t:String}", {"t": "acme"},
     [[0.871]]),
    ("SELECT count() FROM gpupool.usage WHERE tenant LIKE 'ac%' AND project = {p:String}", {"p": "p2"}, [[1]]),
    ("WITH t AS (SELECT tenant, gpu_milli_ms FROM gpupool.usage) SELECT count() AS n FROM t -- rows\n", None, [[3]]),
    ("SELECT $$it's$$ AS s, 'a;b' AS t /* a ; in a comment */", None, [["it's", "a;b"]]),
    ("SELECT count() FROM gpupool.usage;", None, [[3]]),
    ("SELECT p FROM (SELECT project AS p FROM gpupool.usage WHERE tenant = 'acme' UNION ALL SELECT 'x') ORDER BY p",
     None, [["p1"], ["p2"], ["x"]]),
    ("SELECT sum(number) FROM numbers(10)", None, [[45]]),
    ("SELECT count() FROM merge('gpupool', '^usage$')", None, [[3]]),  # the pool's tables by pattern: still fine
    ("SELECT tenant, gpu_model FROM gpupool.usage WHERE gpu_milli_ms > (SELECT avg(gpu_milli_ms) FROM "
     "gpupool.usage)", None, [["globex", "H100-80GB"]]),
    ("SELECT day, tenant, sum(gpu_milli_ms) FROM gpupool.usage_daily GROUP BY day, tenant ORDER BY tenant", None,
     [["1970-01-01", "acme", 871_000], ["1970-01-01", "globex", 3_000_000]]),
    ("SELECT micro_per_gpu_hour FROM gpupool.price_book WHERE gpu_model = 'A100-80GB'", None, [[2_000_000]]),
]


def _plain(rows):
    return [[str(v) if hasattr(v, "isoformat") else v for v in r] for r in rows]


def _sql(text: str, out: Path) -> str:
    return text.replace(OUT, str(out))


@pytest.mark.parametrize("sql,params,why", CORPUS, ids=[f"c{i:02d}" for i in range(len(CORPUS))])
def test_an_attempt_is_refused_and_changes_nothing(store, sql, params, why):
    dsn, writer, out = store
    before = snapshot(writer, out)
    with pytest.raises(Exception) as refused:  # noqa: PT011 - QueryRefused or ClickHouse's own refusal
        sql_guard.run_readonly(dsn, _sql(sql, out), params)
    assert re.search(why, str(refused.value)), f"refused for another reason: {refused.value}"
    assert snapshot(writer, out) == before


@pytest.mark.parametrize("sql,params,rows", HARMLESS, ids=[f"h{i}" for i in range(len(HARMLESS))])
def test_a_harmless_reading_runs_and_changes_nothing(store, sql, params, rows):
    dsn, writer, out = store
    before = snapshot(writer, out)
    assert sql_guard.run_readonly(dsn, sql, params)[1] == rows
    assert snapshot(writer, out) == before


@pytest.mark.parametrize("sql,params,rows", CONTROLS, ids=[f"ok{i}" for i in range(len(CONTROLS))])
def test_a_finance_query_answers(store, sql, params, rows):
    dsn, writer, out = store
    before = snapshot(writer, out)
    assert _plain(sql_guard.run_readonly(dsn, sql, params)[1]) == rows
    assert snapshot(writer, out) == before


def test_the_corpus_is_large_enough():
    assert len(CORPUS) + len(HARMLESS) >= 50


def test_reading_system_tables_is_allowed(store):
    """The choice docs/security.md states: system.* is the engine's metadata and may be read."""
    dsn, _, _ = store
    names = {r[0] for r in sql_guard.run_readonly(dsn, "SELECT name FROM system.tables WHERE database = 'gpupool'")[1]}
    assert {"usage", "price_book", "events"} <= names


@pytest.mark.parametrize("write", [
    WRITE,
    "CREATE TABLE gpupool.evil (a Int8) ENGINE = Memory",
    "DROP TABLE gpupool.price_book",
    "ALTER TABLE gpupool.usage DELETE WHERE 1",
    "TRUNCATE TABLE gpupool.usage",
    "SET readonly = 0",
    "SELECT * FROM file('/etc/passwd', 'LineAsString')",
    "SELECT * FROM url('http://127.0.0.1:1/x', CSV, 'a Int')",
    "RENAME TABLE gpupool.price_book TO gpupool.evil",
    "OPTIMIZE TABLE gpupool.usage FINAL",
    "SYSTEM FLUSH LOGS",  # not every SYSTEM command: SYSTEM STOP MERGES runs read-only (its kind is refused)
    "SELECT * FROM s3('http://127.0.0.1:1/bucket/x.csv', 'CSV', 'a Int')",
    "SELECT * FROM remote('127.0.0.1', system.one)",
    "SELECT * FROM executable('id', TSV, 'a String')",
    "SELECT * FROM mysql('127.0.0.1:1', 'd', 't', 'u', 'p')",
    "SELECT * FROM dictionary('d')",
])
def test_the_session_is_read_only_before_it_reads_any_text(store, write):
    """No guard at all: the multi-statement string goes straight to the session the guard makes. The embedded
    engine runs each statement, and ClickHouse refuses the write because the session was read-only before."""
    dsn, writer, out = store
    before = snapshot(writer, out)
    client, per_query = sql_guard.session(dsn)
    try:
        with pytest.raises(Exception, match=r"readonly mode|READONLY"):  # noqa: PT011 - ClickHouse's refusal
            client.query(f"SELECT 1; {write}; SELECT 2", settings=per_query)
        with pytest.raises(Exception, match=r"readonly mode|READONLY"):  # noqa: PT011
            client.query(f"SELECT 1; SET readonly = 0; {write}", settings=per_query)
        # (the embedded handle may still hold the first SELECT's rows of a failed multi-statement string)
        raw = client.raw_query("SELECT concat('readonly=', toString(getSetting('readonly')))")
        assert raw.rstrip().endswith(b"readonly=1") and b"readonly=0" not in raw
    finally:
        client.close()
    assert snapshot(writer, out) == before


def test_the_worker_session_stays_writable(store):
    """The read-only setting is the guard's session's, never the engine's: the worker's session writes on."""
    dsn, writer, out = store
    sql_guard.run_readonly(dsn, "SELECT 1")
    writer.command("CREATE TABLE IF NOT EXISTS default.scratch (a Int8) ENGINE = Memory")
    writer.command("INSERT INTO default.scratch VALUES (1)")
    assert writer.query("SELECT count() FROM default.scratch").result_rows == [(1,)]
    writer.command("DROP TABLE default.scratch")


def test_a_text_over_the_limit_is_refused_before_any_session(tmp_path):
    never = tmp_path / "never-opened"
    with pytest.raises(sql_guard.QueryTooLarge, match="at most 65536"):
        sql_guard.run_readonly(f"chdb://{never}", "SELECT 1 -- " + "é" * 40_000)  # 80,012 bytes
    assert not never.exists()  # no session was made


def test_a_body_over_the_limit_is_refused_while_it_is_read():
    """streams.edge.api.read_body on a real aiohttp server: a 4 MB body answers 413 without being read whole."""
    from aiohttp import ClientSession, web
    from aiohttp.test_utils import TestServer

    from streams.edge import api

    seen: dict = {}

    async def handler(request):
        try:
            body = await api.read_body(request)
        except api.ApiError as exc:
            seen["read"] = request.content.total_bytes
            return web.json_response({"error": exc.message}, status=exc.status)
        return web.json_response({"n": len(body)})

    async def go():
        app = web.Application()
        app.router.add_post("/api/sql", handler)
        async with TestServer(app) as server, ClientSession() as session:
            async def chunks(n):  # no Content-Length: the reader must stop on its own
                for _ in range(n):
                    yield b"x" * 65536

            async with session.post(server.make_url("/api/sql"), data=chunks(64)) as resp:  # 4 MiB
                big = resp.status, await resp.json()
            async with session.post(server.make_url("/api/sql"), data=b"y" * (4 << 20)) as resp:  # declared
                declared = resp.status
            async with session.post(server.make_url("/api/sql"), data=b"z" * 1000) as resp:
                small = resp.status, await resp.json()
        return big, declared, small

    big, declared, small = asyncio.run(go())
    assert big[0] == 413 and "at most" in big[1]["error"]
    assert seen["read"] < 2 * api.MAX_BODY_BYTES  # stopped soon after the limit, not at 4 MiB
    assert declared == 413
    assert small == (200, {"n": 1000})
