"""An invoice document (streams/folds/invoice.py) as the files a person keeps: CSV and a printable HTML page
(docs/billing.md, "Invoices"). Amounts are printed in each currency's minor unit (schemas.money); times ISO 8601 UTC.
The page is self-contained (inline style, no script, no external load) and escapes every value."""
from __future__ import annotations

import csv
import html
import io
from datetime import datetime, timezone

from schemas.money import show_minor, show_rate
from streams.folds.invoice import gpu_hours

TIME_LABEL = {"quota": "own quota", "reserved": "reserved", "borrowed": "borrowed (beyond quota)"}
CSV_COLUMNS = ("invoice", "tenant", "period_from", "period_to", "record", "currency", "project", "gpu_model", "tier",
               "time", "gpu_hours", "unit_price_per_gpu_hour", "amount", "jobs")


def iso(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def period_label(since_ms: int, until_ms: int) -> str:
    """'2026-11' for a calendar month (UTC), else 'FROM to TO'."""
    a = datetime.fromtimestamp(since_ms / 1000, timezone.utc)
    b = datetime.fromtimestamp(until_ms / 1000, timezone.utc)
    nxt = (a.replace(year=a.year + 1, month=1) if a.month == 12 else a.replace(month=a.month + 1))
    if a == a.replace(day=1, hour=0, minute=0, second=0, microsecond=0) and b == nxt:
        return f"{a:%Y-%m}"
    return f"{iso(since_ms)} to {iso(until_ms)}"


def number(inv: dict) -> str:
    """The invoice's reference: the tenant and the period (the same request gives the same number)."""
    label = period_label(inv["since_ms"], inv["until_ms"])
    if " to " in label:
        a = datetime.fromtimestamp(inv["since_ms"] / 1000, timezone.utc)
        b = datetime.fromtimestamp(inv["until_ms"] / 1000, timezone.utc)
        label = f"{a:%Y%m%dT%H%M%S}-{b:%Y%m%dT%H%M%S}"
    return f"INV-{inv['tenant']}-{label}"


def file_stem(inv: dict) -> str:
    return "invoice-" + number(inv)[len("INV-"):]


def csv_rows(inv: dict) -> list[list]:
    head = [number(inv), inv["tenant"], iso(inv["since_ms"]), iso(inv["until_ms"])]
    out = []
    for sec in inv["currencies"]:
        cur = sec["currency"]
        for ln in sec["lines"]:
            out.append([*head, "line", cur, ln["project"], ln["gpu_model"], ln["tier"], ln["time"],
                        gpu_hours(ln["milli_gpu_ms"]), show_rate(ln["micro_per_gpu_hour"], cur),
                        show_minor(ln["amount_minor"], cur), ln["jobs"]])
        out.append([*head, "total", cur, "", "", "", "", gpu_hours(sec["milli_gpu_ms"]), "",
                    show_minor(sec["total_minor"], cur), ""])
    for u in inv["unpriced"]:
        out.append([*head, "unpriced", "", u["project"], u["gpu_model"], u["tier"], u["time"],
                    gpu_hours(u["milli_gpu_ms"]), "", "", u["jobs"]])
    return out


def csv_text(invoices: list[dict]) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(CSV_COLUMNS)
    for inv in invoices:
        w.writerows(csv_rows(inv))
    return buf.getvalue()


STYLE = """
body { font-family: "DejaVu Sans", Arial, sans-serif; color: #111; margin: 2.5em auto; max-width: 60em;
       font-size: 11pt; }
h1 { font-size: 20pt; margin: 0 0 .2em; } .muted { color: #555; }
header { display: flex; justify-content: space-between; border-bottom: 2px solid #111; padding-bottom: .8em; }
table { border-collapse: collapse; width: 100%; margin: 1.2em 0; }
th, td { border-bottom: 1px solid #ccc; padding: .35em .5em; text-align: left; vertical-align: top; }
th { background: #f0f0f0; white-space: nowrap; } td.n, th.n { text-align: right; font-variant-numeric: tabular-nums; }
tr.total td { font-weight: bold; border-top: 2px solid #111; border-bottom: none; }
.note { font-size: 9pt; color: #444; }
@media print { body { margin: 0; max-width: none; } th { background: none; } @page { size: A4; margin: 18mm; } }
"""


def html_page(inv: dict, issued_ms: int | None = None, pool: str = "gpupool") -> str:
    e = html.escape
    title = f"Invoice {number(inv)}"
    parts = [f"<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>{e(title)}</title>",
             f"<style>{STYLE}</style></head><body>",
             "<header><div>",
             f"<h1>Invoice</h1><div class=\"muted\">{e(number(inv))}</div></div>",
             f"<div><div><b>Billed to:</b> tenant <span id=\"tenant\">{e(inv['tenant'])}</span></div>",
             f"<div><b>Period:</b> {e(period_label(inv['since_ms'], inv['until_ms']))}</div>",
             f"<div class=\"muted\">{e(iso(inv['since_ms']))} to {e(iso(inv['until_ms']))} (UTC, end excluded)</div>",
             (f"<div class=\"muted\">issued {e(iso(issued_ms))} by {e(pool)}</div>" if issued_ms else ""),
             "</div></header>"]
    if not inv["currencies"] and not inv["unpriced"]:
        parts.append("<p>No GPU time was used in this period.</p>")
    for sec in inv["currencies"]:
        cur = e(sec["currency"])
        parts.append(f"<h2>Charges in {cur}</h2><table class=\"lines\" data-currency=\"{cur}\"><thead><tr>"
                     "<th>project</th><th>card model</th><th>tier</th><th>time</th><th class=\"n\">GPU-hours</th>"
                     f"<th class=\"n\">{cur} per GPU-hour</th><th class=\"n\">jobs</th>"
                     f"<th class=\"n\">amount ({cur})</th></tr></thead><tbody>")
        for ln in sec["lines"]:
            parts.append(f"<tr><td>{e(ln['project'])}</td><td>{e(ln['gpu_model'])}</td><td>{e(ln['tier'])}</td>"
                         f"<td>{e(TIME_LABEL.get(ln['time'], ln['time']))}</td>"
                         f"<td class=\"n\">{gpu_hours(ln['milli_gpu_ms'])}</td>"
                         f"<td class=\"n\">{e(show_rate(ln['micro_per_gpu_hour'], sec['currency']))}</td>"
                         f"<td class=\"n\">{ln['jobs']}</td>"
                         f"<td class=\"n\">{e(show_minor(ln['amount_minor'], sec['currency']))}</td></tr>")
        parts.append(f"<tr class=\"total\"><td colspan=\"4\">Total</td><td class=\"n\">{gpu_hours(sec['milli_gpu_ms'])}"
                     f"</td><td></td><td></td><td class=\"n\"><span class=\"total\" data-currency=\"{cur}\">"
                     f"{e(show_minor(sec['total_minor'], sec['currency']))}</span> {cur}</td></tr></tbody></table>")
        parts.append(f"<p class=\"note\">of which borrowed beyond quota: "
                     f"{e(show_minor(sec['borrowed_minor'], sec['currency']))} {cur}; on reservations: "
                     f"{e(show_minor(sec['reserved_minor'], sec['currency']))} {cur}.</p>")
    if inv["unpriced"]:
        parts.append("<h2>GPU time no price applied to</h2><table class=\"unpriced\"><thead><tr><th>project</th>"
                     "<th>card model</th><th>tier</th><th>time</th><th class=\"n\">GPU-hours</th></tr></thead><tbody>")
        for u in inv["unpriced"]:
            parts.append(f"<tr><td>{e(u['project'])}</td><td>{e(u['gpu_model'])}</td><td>{e(u['tier'])}</td>"
                         f"<td>{e(TIME_LABEL.get(u['time'], u['time']))}</td>"
                         f"<td class=\"n\">{gpu_hours(u['milli_gpu_ms'])}</td></tr>")
        parts.append("</tbody></table><p class=\"note\">Not charged: the price book had no price for it.</p>")
    parts.append("<p class=\"note\">GPU time is priced per usage interval at the price book's most specific row in "
                 "force at the interval's end; an interval across the period's bounds counts only its part inside. "
                 "Amounts are exact to the micro-unit and rounded half up to the currency's minor unit once, on the "
                 "total; line amounts are the total apportioned by largest remainder, so they add up to it. "
                 "The total equals <code>gpupool billing --cost</code> for the same tenant and period.</p>")
    parts.append("</body></html>\n")
    return "".join(parts)
