"""Money: ISO 4217 currencies and the one rounding rule from micro-units to a currency's minor unit (docs/billing.md).

Amounts are integers end to end. A price is in micro-units of its currency (1 unit = 1,000,000 micro-units: 2.50 USD
a GPU-hour = 2,500,000); a bill's exact value is sum(gpu_milli_ms x micro_per_gpu_hour) / 3.6e9 micro-units, kept as
that integer numerator until it is cut to a whole micro-unit (`micro_of`: towards zero) and, only when printed,
rounded to the minor unit half up (`minor_of`). Rounding the truncated micro-units half up gives the same minor
amount as rounding the exact value half up (the half-way point is a whole number of micro-units), so the bill, the
invoice and any query that keeps `cost_micro` agree to the minor unit. Pure: no I/O."""
from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator, Field

MICRO = 1_000_000  # micro-units per unit of a currency
# the bill's exact numerator: gpu_milli_ms x micro_per_gpu_hour; one micro-unit is 3.6e9 of it (1000 milli-GPU x
# 3,600,000 ms in a GPU-hour)
PER_MICRO = 3_600_000_000

# ISO 4217 codes the pool prices in, with the exponent of their minor unit (ISO 4217's "minor unit" column)
CURRENCIES: dict[str, int] = {
    "AED": 2, "ARS": 2, "AUD": 2, "BHD": 3, "BRL": 2, "CAD": 2, "CHF": 2, "CLP": 0, "CNY": 2, "COP": 2, "CZK": 2,
    "DKK": 2, "EGP": 2, "EUR": 2, "GBP": 2, "HKD": 2, "HUF": 2, "IDR": 2, "ILS": 2, "INR": 2, "ISK": 0, "JOD": 3,
    "JPY": 0, "KRW": 0, "KWD": 3, "MXN": 2, "MYR": 2, "NOK": 2, "NZD": 2, "OMR": 3, "PHP": 2, "PLN": 2, "QAR": 2,
    "RON": 2, "SAR": 2, "SEK": 2, "SGD": 2, "THB": 2, "TND": 3, "TRY": 2, "TWD": 2, "UAH": 2, "USD": 2, "VND": 0,
    "ZAR": 2,
}
DEFAULT_CURRENCY = "USD"  # a price.set written before prices carried a currency was in US dollars (infra/prices.yaml)


def check_currency(code: str) -> str:
    """An ISO 4217 code this pool knows (three upper-case letters, listed in CURRENCIES), or ValueError."""
    if not (isinstance(code, str) and len(code) == 3 and code.isascii() and code.isalpha() and code.isupper()):
        raise ValueError(f"currency: an ISO 4217 code of three upper-case letters (USD, EUR, JPY), not {code!r}")
    if code not in CURRENCIES:
        raise ValueError(f"currency: {code!r} is not an ISO 4217 code this pool knows ({', '.join(CURRENCIES)})")
    return code


Currency = Annotated[str, Field(pattern="^[A-Z]{3}$", json_schema_extra={"enum": sorted(CURRENCIES)},
                                 description="ISO 4217 code of the price's currency"),
                     AfterValidator(check_currency)]


def exponent(currency: str) -> int:
    return CURRENCIES[check_currency(currency)]


def micro_of(numerator: int) -> int:
    """The exact bill numerator (sum of gpu_milli_ms x micro_per_gpu_hour) in whole micro-units, cut towards zero."""
    if numerator < 0:
        raise ValueError("a bill is never negative")
    return numerator // PER_MICRO


def minor_of(micro: int, currency: str) -> int:
    """Micro-units in the currency's minor unit (cents; yen), rounded half up: (micro + step/2) // step with
    step = 10^(6 - exponent)."""
    if micro < 0:
        raise ValueError("a bill is never negative")
    step = 10 ** (6 - exponent(currency))
    return (micro + step // 2) // step


def show_minor(minor: int, currency: str) -> str:
    """A minor-unit amount as a person reads it: 1234 USD cents -> '12.34', 1234 JPY -> '1234'."""
    e = exponent(currency)
    if e == 0:
        return str(minor)
    return f"{minor // 10 ** e}.{minor % 10 ** e:0{e}d}"


def show_micro(micro: int, currency: str) -> str:
    """Micro-units printed in the minor unit (the one place money is rounded for people)."""
    return show_minor(minor_of(micro, currency), currency)


def show_rate(micro: int, currency: str) -> str:
    """A unit price in micro-units, exactly: at least the minor unit's digits, more when the price has them
    (2,500,000 USD -> '2.50'; 345,600 -> '0.3456')."""
    e = exponent(currency)
    whole, frac = divmod(micro, MICRO)
    digits = f"{frac:06d}".rstrip("0")
    digits = digits.ljust(e, "0")
    return f"{whole}.{digits}" if digits else str(whole)


def apportion(numerators: list[int], currency: str) -> list[int]:
    """Minor-unit amounts for invoice lines whose exact values are `numerators` (bill numerators), summing exactly to
    the total's minor amount (`minor_of(micro_of(sum))`): each line gets its exact value cut down to the minor unit,
    and the minor units left go one each to the lines with the largest remainders (ties: the earlier line). So the
    lines add up to the total the bill prints, and each differs from its exact value by less than one minor unit."""
    step = PER_MICRO * 10 ** (6 - exponent(currency))
    total = minor_of(micro_of(sum(numerators)), currency)
    base = [n // step for n in numerators]
    left = total - sum(base)
    order = sorted(range(len(numerators)), key=lambda i: (-(numerators[i] % step), i))
    for i in order[:left]:
        base[i] += 1
    return base
