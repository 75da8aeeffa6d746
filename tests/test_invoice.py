"""Money and invoices without a stack (docs/billing.md, "Currency" and "Invoices"): ISO 4217 codes and their minor
units, the one rounding rule (micro-units cut towards zero, then half up to the minor unit), the invoice's lines per
project, model, tier, kind of time and unit price, apportioned so they add up to the total billing --cost prints;
currencies kept apart; the CSV and HTML renderings; a price book's currency."""
from __future__ import annotations

import csv
import io
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from agents.client import price_rows
from schemas.events import PriceSet
from schemas.money import (CURRENCIES, PER_MICRO, apportion, check_currency, micro_of, minor_of, show_micro,
                           show_minor, show_rate)
from streams.edge import invoice_render
from streams.folds.invoice import gpu_hours, invoices, tenant_invoice

NOV = 1_793_491_200_000  # 2026-11-01T00:00:00Z
DEC = 1_796_083_200_000  # 2026-12-01T00:00:00Z


def row(tenant="acme", currency="USD", project="default", model="A100-80GB", tier="offline", time="quota",
        price=2_500_000, ms=3_600_000_000, priced=True, jobs=1) -> dict:
    return {"tenant": tenant, "currency": currency if priced else "", "project": project, "gpu_model": model,
            "tier": tier, "time": time, "micro_per_gpu_hour": price if priced else 0, "priced": int(priced),
            "milli_gpu_ms": str(ms), "numerator": str(ms * price if priced else 0), "jobs": jobs}


# ---------------------------------------------------------------- currencies and rounding

def test_currency_codes_are_iso_4217_with_their_minor_units():
    assert CURRENCIES["USD"] == CURRENCIES["EUR"] == CURRENCIES["CNY"] == 2
    assert CURRENCIES["JPY"] == CURRENCIES["KRW"] == 0 and CURRENCIES["KWD"] == 3
    assert check_currency("EUR") == "EUR"
    for bad in ("usd", "US", "USDX", "XYZ", "", "U$D"):
        with pytest.raises(ValueError):
            check_currency(bad)


def test_price_set_carries_a_currency_and_old_events_read_as_usd():
    old = PriceSet.model_validate_json(b'{"kind": "price.set", "gpu_model": "H100-80GB", "micro_per_gpu_hour": 1}')
    assert old.currency == "USD"
    assert PriceSet(gpu_model="H100-80GB", micro_per_gpu_hour=1, currency="JPY").currency == "JPY"
    for bad in ("usd", "XYZ"):
        with pytest.raises(ValidationError):
            PriceSet(gpu_model="H100-80GB", micro_per_gpu_hour=1, currency=bad)


def test_rounding_rule_examples():
    assert minor_of(4_999, "USD") == 0 and minor_of(5_000, "USD") == 1 and minor_of(14_999, "USD") == 1
    assert minor_of(2_500_000, "USD") == 250 and show_micro(2_504_999, "USD") == "2.50"
    assert show_micro(2_505_000, "USD") == "2.51"
    assert minor_of(499_999, "JPY") == 0 and minor_of(500_000, "JPY") == 1 and show_micro(1_500_000, "JPY") == "2"
    assert minor_of(500, "KWD") == 1 and show_minor(1234, "KWD") == "1.234"
    assert show_minor(5, "USD") == "0.05" and show_minor(0, "EUR") == "0.00"
    assert show_rate(2_500_000, "USD") == "2.50" and show_rate(345_600, "USD") == "0.3456"
    assert show_rate(150_000_000, "JPY") == "150" and show_rate(150_500_000, "JPY") == "150.5"
    assert micro_of(PER_MICRO * 7 + PER_MICRO - 1) == 7


@settings(max_examples=400)
@given(st.integers(min_value=0, max_value=10 ** 30), st.sampled_from(sorted(CURRENCIES)))
def test_cutting_to_micro_then_half_up_is_half_up_of_the_exact_value(numerator, currency):
    """The bill keeps cost_micro (cut towards zero) and prints it half up: the same minor amount as rounding the
    exact value half up, so no second rounding can move a cent."""
    exact = Fraction(numerator, PER_MICRO * 10 ** (6 - CURRENCIES[currency]))
    assert minor_of(micro_of(numerator), currency) == int(exact + Fraction(1, 2))


@settings(max_examples=400)
@given(st.lists(st.integers(min_value=0, max_value=10 ** 22), max_size=30), st.sampled_from(["USD", "JPY", "KWD"]))
def test_apportioned_lines_add_up_to_the_total_and_stay_within_a_minor_unit(nums, currency):
    lines = apportion(nums, currency)
    assert sum(lines) == minor_of(micro_of(sum(nums)), currency)
    step = PER_MICRO * 10 ** (6 - CURRENCIES[currency])
    for n, amount in zip(nums, lines):
        assert abs(Fraction(n, step) - amount) < 1


def test_apportion_gives_left_units_to_the_largest_remainders_first():
    cent = PER_MICRO * 10_000  # one US cent in bill numerator units
    # three lines of 0.4 cent each: 1.2 cents in all, printed 1; the first line (ties: earlier) gets it
    assert apportion([4 * cent // 10] * 3, "USD") == [1, 0, 0]
    # 0.3 + 0.6 + 0.6 = 1.5 -> 2 cents: the two larger remainders
    assert apportion([3 * cent // 10, 6 * cent // 10, 6 * cent // 10], "USD") == [0, 1, 1]


# ---------------------------------------------------------------- invoices

def test_lines_per_project_model_tier_time_and_price_with_the_total_of_the_bill():
    rows = [row(project="p1", time="quota"), row(project="p1", time="borrowed", price=3_000_000),
            row(project="p1", time="reserved", ms=1_800_000_000),
            row(project="p2", model="H100-80GB", tier="inference", price=4_000_000, ms=1_000_000),
            row(project="p1", time="quota", ms=1_000)]  # the same line as the first: merged
    inv = tenant_invoice("acme", rows, NOV, DEC)
    [usd] = inv["currencies"]
    keys = [(ln["project"], ln["gpu_model"], ln["tier"], ln["time"]) for ln in usd["lines"]]
    assert keys == [("p1", "A100-80GB", "offline", "quota"), ("p1", "A100-80GB", "offline", "reserved"),
                    ("p1", "A100-80GB", "offline", "borrowed"), ("p2", "H100-80GB", "inference", "quota")]
    assert usd["lines"][0]["milli_gpu_ms"] == 3_600_001_000
    total = sum(int(r["numerator"]) for r in rows)
    assert usd["total_micro"] == total // PER_MICRO
    assert usd["total_minor"] == minor_of(total // PER_MICRO, "USD") == sum(ln["amount_minor"] for ln in usd["lines"])
    assert usd["borrowed_minor"] == 300 and usd["reserved_minor"] == 125
    assert [ln["amount_minor"] for ln in usd["lines"]] == [250, 125, 300, 0]


def test_currencies_are_kept_apart_never_summed():
    rows = [row(currency="USD"), row(currency="EUR", model="H100-80GB", price=4_000_000), row(model="L4", priced=False)]
    inv = tenant_invoice("acme", rows, NOV, DEC)
    assert [(s["currency"], s["total_minor"]) for s in inv["currencies"]] == [("EUR", 400), ("USD", 250)]
    assert [(u["gpu_model"], u["milli_gpu_ms"]) for u in inv["unpriced"]] == [("L4", 3_600_000_000)]
    text = invoice_render.csv_text([inv])
    recs = list(csv.DictReader(io.StringIO(text)))
    totals = {r["currency"]: r["amount"] for r in recs if r["record"] == "total"}
    assert totals == {"EUR": "4.00", "USD": "2.50"}
    assert [r["gpu_model"] for r in recs if r["record"] == "unpriced"] == ["L4"]


def test_one_invoice_per_tenant_and_a_named_tenant_without_usage_gets_an_empty_one():
    rows = [row(tenant="globex", ms=7_200_000_000), row(tenant="acme")]
    assert [i["tenant"] for i in invoices(rows, NOV, DEC)] == ["acme", "globex"]
    [only] = invoices([], NOV, DEC, ["initech"])
    assert only["currencies"] == [] and only["unpriced"] == []
    with pytest.raises(ValueError):
        tenant_invoice("acme", [row(tenant="globex")], NOV, DEC)


def test_gpu_hours_shown_half_up():
    assert gpu_hours(3_600_000_000) == "1.0000" and gpu_hours(180_000) == "0.0001" and gpu_hours(179_999) == "0.0000"


def test_renderings_name_the_month_escape_and_print_minor_units():
    inv = tenant_invoice("acme", [row(project="<script>x</script>", price=2_505_000, ms=3_600_000_000)], NOV, DEC)
    assert invoice_render.period_label(NOV, DEC) == "2026-11" and invoice_render.number(inv) == "INV-acme-2026-11"
    page = invoice_render.html_page(inv, issued_ms=DEC)
    assert "<script>" not in page and "&lt;script&gt;" in page
    assert '<span class="total" data-currency="USD">2.51</span> USD' in page
    assert invoice_render.period_label(NOV + 1, DEC) == "2026-11-01T00:00:00.001Z to 2026-12-01T00:00:00.000Z"
    recs = list(csv.DictReader(io.StringIO(invoice_render.csv_text([inv]))))
    assert [r["record"] for r in recs] == ["line", "total"]
    assert recs[0]["unit_price_per_gpu_hour"] == "2.505" and recs[0]["amount"] == recs[1]["amount"] == "2.51"
    assert recs[0]["period_from"] == "2026-11-01T00:00:00.000Z"


# ---------------------------------------------------------------- the price book's currency

def test_price_book_currency_from_the_file_and_per_row_and_exact_decimals():
    rows = price_rows("currency: EUR\nprices:\n  - {gpu_model: A10, per_gpu_hour: 4.20}\n"
                      "  - {gpu_model: T4, per_gpu_hour: 150, currency: JPY}\n")
    assert [(r.currency, r.micro_per_gpu_hour) for r in rows] == [("EUR", 4_200_000), ("JPY", 150_000_000)]
    assert price_rows("prices:\n  - {gpu_model: A10, per_gpu_hour: '0.1'}\n")[0].currency == "USD"
    with pytest.raises(SystemExit, match="currency"):
        price_rows("currency: usd\nprices:\n  - {gpu_model: A10, per_gpu_hour: 1}\n")
    with pytest.raises(SystemExit, match="currency"):
        price_rows("prices:\n  - {gpu_model: A10, per_gpu_hour: 1, currency: XYZ}\n")
    with pytest.raises(SystemExit, match="micro-unit"):
        price_rows("prices:\n  - {gpu_model: A10, per_gpu_hour: 0.0000001}\n")


def test_billing_rows_get_their_amounts_in_the_minor_unit_and_an_empty_bill_stays_empty():
    from streams.edge.api import with_money

    cols = ["tenant", "currency", "own_micro", "borrowed_micro", "cost_micro"]
    out_cols, out = with_money(cols, [["acme", "USD", 4_999, 5_000, 9_999], ["acme", "JPY", 0, 500_000, 500_000],
                                      ["acme", "", 0, 0, 0]])
    assert out_cols[-3:] == ["own_cost", "borrowed_cost", "cost"]
    assert [r[-3:] for r in out] == [["0.00", "0.01", "0.01"], ["0", "1", "1"], ["", "", ""]]
    assert with_money([], []) == ([], [])  # the embedded engine names no columns for an empty answer
