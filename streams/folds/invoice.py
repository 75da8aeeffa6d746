"""Invoices from the priced usage of a period (docs/billing.md, "Invoices"). Pure: rows in, documents out.

A row is one group of the period's usage (streams/edge/api.py INVOICE_SQL): tenant, currency, project, card model,
tier, kind of time (`quota`: the tenant's own quota; `reserved`: on its own reservation; `borrowed`: beyond its
quota), the unit price (micro-units per GPU-hour), whether a price applied, the GPU time (milli-GPU-ms) and the exact
bill numerator (sum of gpu_milli_ms x micro_per_gpu_hour). A tenant's invoice has, per currency (never summed across
currencies), one line per project, model, tier, kind of time and unit price, and a total equal to what `billing
--cost` prints for the tenant and period (both: the numerator's sum cut to micro-units, rounded half up to the minor
unit). Line amounts are that total apportioned (schemas.money.apportion), so the lines add up to it exactly. Usage no
price matched is listed apart, with its GPU time, and priced at nothing."""
from __future__ import annotations

from schemas.money import apportion, micro_of, minor_of

TIME_ORDER = {"quota": 0, "reserved": 1, "borrowed": 2}
HOUR_MILLI_MS = 3_600_000_000  # milli-GPU-ms in one GPU-hour


def gpu_hours(milli_gpu_ms: int, places: int = 4) -> str:
    """GPU time as GPU-hours, rounded half up to `places` decimals (a quantity shown; money is never computed
    from it)."""
    step = HOUR_MILLI_MS // 10 ** places
    n = (milli_gpu_ms + step // 2) // step
    return f"{n // 10 ** places}.{n % 10 ** places:0{places}d}"


def line_key(row: dict) -> tuple:
    return (row["project"], row["gpu_model"], row["tier"], TIME_ORDER.get(row["time"], 9), row["time"],
            row["micro_per_gpu_hour"])


def tenant_invoice(tenant: str, rows: list[dict], since_ms: int, until_ms: int) -> dict:
    """One tenant's invoice for [since_ms, until_ms) from its rows (any order; rows of the same line are merged)."""
    priced: dict[str, dict[tuple, dict]] = {}
    unpriced: dict[tuple, dict] = {}
    for r in rows:
        if r["tenant"] != tenant:
            raise ValueError(f"a row of tenant {r['tenant']!r} on {tenant!r}'s invoice")
        key = line_key(r)
        if not r["priced"] or not r["currency"]:
            u = unpriced.setdefault(key[:5], {"project": r["project"], "gpu_model": r["gpu_model"], "tier": r["tier"],
                                              "time": r["time"], "milli_gpu_ms": 0, "jobs": 0})
            u["milli_gpu_ms"] += int(r["milli_gpu_ms"])
            u["jobs"] += int(r.get("jobs", 0))
            continue
        line = priced.setdefault(r["currency"], {}).setdefault(key, {
            "project": r["project"], "gpu_model": r["gpu_model"], "tier": r["tier"], "time": r["time"],
            "micro_per_gpu_hour": int(r["micro_per_gpu_hour"]), "milli_gpu_ms": 0, "numerator": 0, "jobs": 0})
        line["milli_gpu_ms"] += int(r["milli_gpu_ms"])
        line["numerator"] += int(r["numerator"])
        line["jobs"] += int(r.get("jobs", 0))
    sections = []
    for currency in sorted(priced):
        lines = [priced[currency][k] for k in sorted(priced[currency])]
        amounts = apportion([ln["numerator"] for ln in lines], currency)
        for ln, minor in zip(lines, amounts):
            ln["micro"] = micro_of(ln["numerator"])
            ln["amount_minor"] = minor
            ln["numerator"] = str(ln["numerator"])  # JSON: may be past 64 bits
        total_num = sum(int(ln["numerator"]) for ln in lines)
        borrowed_num = sum(int(ln["numerator"]) for ln in lines if ln["time"] == "borrowed")
        reserved_num = sum(int(ln["numerator"]) for ln in lines if ln["time"] == "reserved")
        sections.append({
            "currency": currency, "lines": lines,
            "milli_gpu_ms": sum(ln["milli_gpu_ms"] for ln in lines),
            "total_micro": micro_of(total_num), "total_minor": minor_of(micro_of(total_num), currency),
            # as billing --cost prints them (each rounded on its own): borrowed_cost, and the reserved part of own
            "borrowed_minor": minor_of(micro_of(borrowed_num), currency),
            "reserved_minor": minor_of(micro_of(reserved_num), currency),
        })
    return {"tenant": tenant, "since_ms": since_ms, "until_ms": until_ms, "currencies": sections,
            "unpriced": [unpriced[k] for k in sorted(unpriced)]}


def invoices(rows: list[dict], since_ms: int, until_ms: int, tenants: list[str] | None = None) -> list[dict]:
    """One invoice per tenant: those of `tenants` (each, usage or none), else every tenant with usage in the rows."""
    by_tenant: dict[str, list[dict]] = {}
    for r in rows:
        by_tenant.setdefault(r["tenant"], []).append(r)
    names = sorted(set(tenants)) if tenants is not None else sorted(by_tenant)
    return [tenant_invoice(t, by_tenant.get(t, []), since_ms, until_ms) for t in names]

