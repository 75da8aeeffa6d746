"""Invoices on a live stack (#36 item 1; docs/billing.md "Invoices"): real Kafka, the worker's sink into the embedded
ClickHouse, the HTTP API and the CLI as a person types it.

The bill of two past months is laid on the ledger as usage.accrued records (the scheduler only bills the present,
so usage in October and November 2026 is written by the test, as the scheduler writes it: one record per interval,
on gpupool.ledger, through the service principal); the sink, the price book, the queries, the invoice and billing
are the real ones. One interval of each tenant runs across the month boundary. For each month and tenant the
invoice's total equals `billing --cost` for the same period to the minor unit, and equals the bill computed here
from the records and the price book; the two months' GPU time adds up to the whole of it; currencies are kept
apart; a tenant gets its own invoice and never another's; the HTML page is rendered by Chromium (a screenshot in
docs/invoice.png with GPUPOOL_SHOTS_DIR=docs, and a PDF printed from it). A job run now is invoiced for the
current period too."""
from __future__ import annotations

import base64
import csv
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from datetime import datetime, timezone
from pathlib import Path

import pytest

from schemas.envelope import encode, envelope
from schemas.events import JobRequested, Tier, UsageAccrued
from schemas.money import PER_MICRO, micro_of, minor_of, show_minor
from schemas.routing import route
from tests.browser import Browser, chromium_path
from tests.live import cli, job_states, live_pool, produce, wait_for

pytestmark = pytest.mark.broker

REPO = Path(__file__).resolve().parent.parent


def ms(text: str) -> int:
    return int(datetime.fromisoformat(text).replace(tzinfo=timezone.utc).timestamp() * 1000)


OCT, NOV, DEC = ms("2026-10-01T00:00"), ms("2026-11-01T00:00"), ms("2026-12-01T00:00")

# the book (valid since 2020): USD for the A100 and H100 (own, borrowed, off-peak own), EUR for the T4; no L4 price
BOOK = """currency: USD
prices:
  - {gpu_model: A100-80GB, per_gpu_hour: 2.50}
  - {gpu_model: A100-80GB, per_gpu_hour: 3.00, borrowed: true}
  - {gpu_model: A100-80GB, per_gpu_hour: 1.75, tod_band: offpeak}
  - {gpu_model: H100-80GB, per_gpu_hour: 4.00}
  - {gpu_model: H100-80GB, per_gpu_hour: 4.80, borrowed: true}
  - {gpu_model: T4, per_gpu_hour: 0.35, currency: EUR}
"""
PRICE = {("A100-80GB", False, "peak"): 2_500_000, ("A100-80GB", True, "peak"): 3_000_000,
         ("A100-80GB", False, "offpeak"): 1_750_000, ("A100-80GB", True, "offpeak"): 3_000_000,
         ("H100-80GB", False, "peak"): 4_000_000, ("H100-80GB", False, "offpeak"): 4_000_000,
         ("H100-80GB", True, "peak"): 4_800_000, ("T4", False, "peak"): 350_000}
CURRENCY = {"A100-80GB": "USD", "H100-80GB": "USD", "T4": "EUR"}

# (tenant, project, model, tier, start, end, milli-GPU, borrowed, reserved)
USAGE = [
    ("acme", "train", "A100-80GB", "offline", "2026-10-31T23:00", "2026-11-01T01:00:00.001", 2000, False, False),
    ("acme", "train", "A100-80GB", "offline", "2026-11-01T10:00", "2026-11-01T10:37:13.457", 1000, True, False),
    ("acme", "serve", "H100-80GB", "inference", "2026-10-31T12:00", "2026-10-31T12:20:00.001", 333, False, True),
    ("acme", "serve", "H100-80GB", "inference", "2026-11-02T12:00", "2026-11-02T12:00:41.003", 333, False, True),
    ("acme", "train", "T4", "offline", "2026-11-02T09:00", "2026-11-02T09:10:00.007", 1000, False, False),
    ("acme", "train", "L4", "offline", "2026-11-03T09:00", "2026-11-03T09:05", 500, False, False),
    ("globex", "etl", "A100-80GB", "offline", "2026-10-31T23:30", "2026-11-01T00:30:00.003", 4000, True, False),
    ("globex", "etl", "H100-80GB", "online-training", "2026-11-15T08:00", "2026-11-15T08:00:07.777", 1000, False,
     False),
]


def band(start_ms: int) -> str:
    return "peak" if 8 <= datetime.fromtimestamp(start_ms / 1000, timezone.utc).hour < 20 else "offpeak"


def expected(tenant: str, since: int, until: int) -> dict[str, tuple[int, int]]:
    """The bill computed here from the records and the book: currency -> (GPU time in milli-GPU-ms, minor units)."""
    num: dict[str, int] = {}
    gpu: dict[str, int] = {}
    for t, _, model, _, a, b, milli, borrowed, _ in USAGE:
        s, e = ms(a), ms(b)
        part = milli * max(0, min(e, until) - max(s, since))
        if t != tenant or (model, borrowed, band(s)) not in PRICE or not (e > since and s < until):
            continue
        cur = CURRENCY[model]
        num[cur] = num.get(cur, 0) + part * PRICE[(model, borrowed, band(s))]
        gpu[cur] = gpu.get(cur, 0) + part
    return {c: (gpu[c], minor_of(micro_of(n), c)) for c, n in num.items()}


@pytest.fixture(scope="module")
def pool(tmp_path_factory, broker_mode, libs_home):
    with live_pool(tmp_path_factory, broker_mode, libs_home, "invoice", [
            ("alice", "tenant", "acme"), ("bob", "tenant", "globex"), ("fin", "finance", None)],
            quota_for=("acme", "globex")) as s:
        book = s.home / "book.yaml"
        book.write_text(BOOK)
        out = cli(s, "prices", "load", str(book), "--valid-from", "2020-01-01T00:00:00")
        assert "6 price(s) in EUR, USD from 2020-01-01T" in out, out  # an ISO time, not epoch ms
        records, keys = [], []
        for i, (t, project, model, tier, a, b, milli, borrowed, reserved) in enumerate(USAGE, 1):
            s_ms, e_ms = ms(a), ms(b)
            env = envelope(UsageAccrued(tenant=t, project=project, job_id=f"{t}/past-{i}", tier=Tier(tier),
                                        node="node-000", gpu_model=model, datacenter="dc-0", start_ms=s_ms,
                                        end_ms=e_ms, gpu_milli=milli, gpu_milli_ms=milli * (e_ms - s_ms),
                                        borrowed=borrowed, reserved=reserved, attempt=1),
                           source="invoice-test", seq=i, time_ms=e_ms)
            spec, key = route(env)
            records.append(encode(env))
            keys.append(key)
        produce(s, spec.name, records, keys=keys)
        wait_for(lambda: s.query("SELECT count() AS n FROM gpupool.usage FINAL WHERE startsWith(event_id, "
                                 "'invoice-test:')")[0]["n"] == len(USAGE), 60, "the past usage in ClickHouse", s)
        wait_for(lambda: s.query("SELECT count() AS n FROM gpupool.price_book FINAL")[0]["n"] == 6, 60,
                 "the price book in ClickHouse", s)
        yield s


def billed(pool, user: str, since: int, until: int) -> dict[tuple[str, str], dict]:
    rows = json.loads(cli(pool, "billing", "--cost", "--by", "tenant", "--since", str(since), "--until", str(until),
                          "--format", "json", user=user))
    return {(r["tenant"], r["currency"]): r for r in rows}


def invoice_csv(path: Path) -> list[dict]:
    with path.open() as f:
        return list(csv.DictReader(f))


def test_each_months_invoice_totals_equal_billing_and_the_bill_of_the_records(pool, tmp_path):
    whole = billed(pool, "fin", OCT, DEC)
    for month, (since, until) in {"2026-10": (OCT, NOV), "2026-11": (NOV, DEC)}.items():
        out = tmp_path / month
        said = cli(pool, "invoice", "--month", month, "--out", str(out), user="fin")
        files = sorted(p.name for p in out.iterdir())
        assert files == [f"invoice-{t}-{month}.{x}" for t in ("acme", "globex") for x in ("csv", "html")], said
        bill = billed(pool, "fin", since, until)
        for tenant in ("acme", "globex"):
            recs = invoice_csv(out / f"invoice-{tenant}-{month}.csv")
            totals = {r["currency"]: r["amount"] for r in recs if r["record"] == "total"}
            want = expected(tenant, since, until)
            # the invoice, billing --cost and the bill of the records agree to the minor unit, per currency
            assert totals == {c: bill[(tenant, c)]["cost"] for c in totals}, (month, tenant, totals, bill)
            assert totals == {c: show_minor(m, c) for c, (_, m) in want.items()}, (month, tenant, totals, want)
            assert f"{tenant} " + ", ".join(f"{totals[c]} {c}" for c in sorted(totals)) in said
            for cur, amount in totals.items():  # the lines add up to the total
                lines = [r for r in recs if r["record"] == "line" and r["currency"] == cur]
                minor = sum(int(r["amount"].replace(".", "")) for r in lines)
                assert minor == int(amount.replace(".", ""))
            assert all(r["period_from"] == datetime.fromtimestamp(since / 1000, timezone.utc).strftime(
                "%Y-%m-%dT%H:%M:%S.000Z") for r in recs)
    # across the boundary: each month holds its part of the straddling intervals, and the two add up to the whole
    doc = {m: pool.client("fin").api("/api/invoice", {"month": m})["invoices"] for m in ("2026-10", "2026-11")}
    for tenant in ("acme", "globex"):
        for cur in ("USD",):
            parts = [next(s for i in doc[m] if i["tenant"] == tenant for s in i["currencies"] if s["currency"] == cur)
                     for m in ("2026-10", "2026-11")]
            assert sum(p["milli_gpu_ms"] for p in parts) == expected(tenant, OCT, DEC)[cur][0]
            assert all(p["milli_gpu_ms"] > 0 for p in parts)
            # money: the months' micro-units are each cut once, so they add up to the whole's or one less
            assert whole[(tenant, cur)]["cost_micro"] - sum(p["total_micro"] for p in parts) in (0, 1)
    # the straddling A100 interval of acme: 1 h (+0.001 s) of 2 cards in October's 23:00 hour, off-peak
    oct_acme = next(i for i in doc["2026-10"] if i["tenant"] == "acme")
    train = [ln for s in oct_acme["currencies"] for ln in s["lines"] if ln["project"] == "train"]
    assert [(ln["gpu_model"], ln["time"], ln["milli_gpu_ms"], ln["micro_per_gpu_hour"]) for ln in train] == [
        ("A100-80GB", "quota", 2000 * 3_600_000, 1_750_000)]


def test_lines_per_project_model_tier_and_time_with_currencies_apart(pool):
    [inv] = pool.client("fin").api("/api/invoice", {"month": "2026-11", "tenant": "acme"})["invoices"]
    by_cur = {s["currency"]: s for s in inv["currencies"]}
    assert sorted(by_cur) == ["EUR", "USD"]  # the T4's EUR is never added to the USD
    assert [(ln["project"], ln["gpu_model"], ln["tier"], ln["time"]) for ln in by_cur["USD"]["lines"]] == [
        ("serve", "H100-80GB", "inference", "reserved"),
        ("train", "A100-80GB", "offline", "quota"), ("train", "A100-80GB", "offline", "borrowed")]
    assert [(ln["gpu_model"], ln["micro_per_gpu_hour"]) for ln in by_cur["EUR"]["lines"]] == [("T4", 350_000)]
    assert [(u["gpu_model"], u["milli_gpu_ms"]) for u in inv["unpriced"]] == [("L4", 500 * 300_000)]
    bill = billed(pool, "fin", NOV, DEC)
    assert bill[("acme", "")]["unpriced_gpu_hours"] == round(500 * 300_000 / 3.6e9, 4)
    assert by_cur["USD"]["borrowed_minor"] == int(bill[("acme", "USD")]["borrowed_cost"].replace(".", ""))
    for s in inv["currencies"]:
        exact = sum(int(ln["numerator"]) for ln in s["lines"])
        assert s["total_micro"] == exact // PER_MICRO == bill[("acme", s["currency"])]["cost_micro"]


def _get(pool, user: str, params: str) -> tuple[int, dict, bytes]:
    token = pool.client(user).creds.token
    req = urllib.request.Request(f"http://127.0.0.1:{pool.web_port}/api/invoice?{params}", headers={
        "Authorization": "Basic " + base64.b64encode(f"{user}:{token}".encode()).decode()})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def test_a_tenant_gets_its_own_invoice_and_never_another_tenants(pool, tmp_path):
    said = cli(pool, "invoice", "--month", "2026-11", "--out", str(tmp_path), user="alice")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["invoice-acme-2026-11.csv", "invoice-acme-2026-11.html"]
    assert "globex" not in said and "globex" not in (tmp_path / "invoice-acme-2026-11.csv").read_text()
    bad = cli(pool, "invoice", "--month", "2026-11", "--tenant", "globex", "--out", str(tmp_path / "x"),
              user="alice", check=False)
    assert bad.returncode != 0 and "403" in bad.stderr and "Traceback" not in bad.stderr
    assert not (tmp_path / "x").exists() or not any((tmp_path / "x").iterdir())
    for user, other in (("alice", "globex"), ("bob", "acme")):
        for fmt in ("json", "csv", "html"):
            code, _, body = _get(pool, user, f"month=2026-11&tenant={other}&format={fmt}")
            assert code == 403 and b"INV-" not in body and b"invoices" not in body, body
    # a tenant's own, asked without naming it, is its own alone
    code, _, body = _get(pool, "bob", "month=2026-11")
    assert code == 200 and [i["tenant"] for i in json.loads(body)["invoices"]] == ["globex"]
    # finance renders one tenant's page through the API, with the headers that keep it inert
    code, headers, body = _get(pool, "fin", "month=2026-11&tenant=globex&format=html")
    assert code == 200 and headers["Content-Type"].startswith("text/html")
    assert "default-src 'none'" in headers["Content-Security-Policy"] and b"INV-globex-2026-11" in body
    code, headers, body = _get(pool, "fin", "month=2026-11&tenant=globex&format=csv")
    assert code == 200 and headers["Content-Type"].startswith("text/csv") and body.startswith(b"invoice,tenant,")
    assert _get(pool, "fin", "month=2026-11&format=html")[0] == 400  # one page is one tenant's
    assert _get(pool, "fin", "month=2026-13")[0] == 400


def test_the_html_invoice_in_a_browser(pool, tmp_path):
    if chromium_path() is None:
        pytest.fail("no chromium: `make browser` installs it (the invoice page is checked in a real browser)")
    cli(pool, "invoice", "--month", "2026-11", "--tenant", "acme", "--out", str(tmp_path), user="fin")
    recs = invoice_csv(tmp_path / "invoice-acme-2026-11.csv")
    totals = {r["currency"]: r["amount"] for r in recs if r["record"] == "total"}
    with Browser(width=1000, height=900) as b:
        b.goto((tmp_path / "invoice-acme-2026-11.html").as_uri())
        shown = b.eval("Object.fromEntries([...document.querySelectorAll('span.total')]"
                       ".map(e => [e.dataset.currency, e.textContent]))")
        assert shown == totals
        assert b.text("#tenant") == "acme" and "2026-11" in b.text("header")
        assert b.eval("document.querySelectorAll('table.lines tbody tr').length") == len(
            [r for r in recs if r["record"] in ("line", "total")])
        assert not b.errors, b.errors
        # docs/invoice.png is this screenshot: GPUPOOL_SHOTS_DIR=docs writes it there (a plain run leaves the checkout)
        shot = b.screenshot(Path(os.environ.get("GPUPOOL_SHOTS_DIR") or tmp_path) / "invoice.png")
        pdf = base64.b64decode(b.send("Page.printToPDF", printBackground=False)["data"])
    png = shot.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")
    assert width == 1000 and height > 400 and len(png) > 20_000
    assert pdf.startswith(b"%PDF") and len(pdf) > 5_000


def test_the_dashboard_downloads_the_invoice_a_role_may_read(pool, tmp_path):
    """The Tenants page's invoice buttons fetch /api/invoice with the signed-in principal's token: finance downloads
    any tenant's page for the month chosen; a tenant has only its own row, and a forged request for another tenant's
    invoice from its session is refused (403) and downloads nothing."""
    if chromium_path() is None:
        pytest.fail("no chromium: `make browser` installs it")
    base = f"http://127.0.0.1:{pool.web_port}"
    cli(pool, "invoice", "--month", "2026-11", "--tenant", "globex", "--out", str(tmp_path / "cli"), user="fin")
    want = (tmp_path / "cli" / "invoice-globex-2026-11.csv").read_text()
    downloads = tmp_path / "downloads"
    downloads.mkdir()
    with Browser() as b:
        b.send("Browser.setDownloadBehavior", behavior="allow", downloadPath=str(downloads))
        b.sign_in(base, "fin", pool.client("fin").creds.token, "tenants")
        b.eval("document.getElementById('invoice-month').value = '2026-11'; "
               "document.querySelector('button.invoice[data-tenant=\"globex\"][data-format=\"csv\"]').click(); true")
        b.wait_for("document.getElementById('invoice-status').textContent.includes('downloaded')")
        got = wait_for(lambda: (f := downloads / "invoice-globex-2026-11.csv").exists() and f.stat().st_size and f,
                       30, "the downloaded invoice", pool)
        assert got.read_text() == want  # the very file the CLI writes
        b.sign_in(base, "alice", pool.client("alice").creds.token, "tenants")
        assert b.eval("[...document.querySelectorAll('button.invoice')].map(e => e.dataset.tenant)") == ["acme", "acme"]
        b.expected = (403,)
        b.eval("document.getElementById('invoice-month').value = '2026-11'; downloadInvoice('globex', 'html'); true")
        status = b.wait_for("(t => t.includes('403') && t)(document.getElementById('invoice-status').textContent)")
        assert "globex" in status and not (downloads / "invoice-globex-2026-11.html").exists()
        assert not b.errors, b.errors


def test_a_job_run_now_is_invoiced_as_billed(pool, tmp_path):
    pool.client("alice").send([JobRequested(job_id="now", tenant="acme", project="train", compute_milli=1000,
                                            gpu_memory_mib=40 * 1024, duration_s=2,
                                            constraints={"models": ["A100-80GB"]})])
    wait_for(lambda: job_states(pool).get("acme/now", {}).get("state") == "completed", 90, "acme/now", pool)
    wait_for(lambda: pool.query("SELECT count() AS n FROM gpupool.usage FINAL WHERE job_id = 'acme/now'")[0]["n"],
             30, "its usage", pool)
    since = pool.query("SELECT min(start_ms) AS s FROM gpupool.usage FINAL WHERE job_id = 'acme/now'")[0]["s"] - 1
    until = int(time.time() * 1000) + 3_600_000
    said = cli(pool, "invoice", "--period", str(since), str(until), "--out", str(tmp_path), user="alice")
    [csv_file] = sorted(tmp_path.glob("*.csv"))
    totals = {r["currency"]: r["amount"] for r in invoice_csv(csv_file) if r["record"] == "total"}
    bill = billed(pool, "alice", since, until)
    assert totals == {"USD": bill[("acme", "USD")]["cost"]} and "INV-acme-" in said
    assert bill[("acme", "USD")]["cost_micro"] > 0


def test_bad_invoice_requests_are_one_line(pool):
    for argv, field in ((["invoice"], "--month"), (["invoice", "--month", "2026-13"], "month"),
                        (["invoice", "--period", "2026-11-02", "2026-11-01"], "FROM before TO"),
                        (["prices", "set", "--model", "T4", "--per-gpu-hour", "1", "--currency", "usd"],
                         "currency")):
        out = subprocess.run([sys.executable, "-m", "agents.cli", *argv], env={**os.environ, **pool.env,
                                                                               "GPUPOOL_USER": "fin"},
                             capture_output=True, text=True, timeout=60)
        assert out.returncode != 0 and field in out.stderr and "Traceback" not in out.stderr, (argv, out.stderr)
