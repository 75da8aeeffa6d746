"""How the CLI prints: tables, JSON, CSV, times a person reads; and parsing the times a person types."""
from __future__ import annotations

import csv
import io
import json
from datetime import datetime

from agents.client import parse_time  # noqa: F401 - the CLI's commands read times with it


def emit(columns, rows, fmt: str) -> None:
    if fmt == "json":
        print(json.dumps([dict(zip(columns, r)) for r in rows], default=str))
    elif fmt == "csv":
        buf = io.StringIO()
        w = csv.writer(buf)
        w.writerow(columns)
        w.writerows(rows)
        print(buf.getvalue(), end="")
    elif not rows:
        print("(none)")
    else:
        widths = [max(len(str(c)), *(len(str(r[i])) for r in rows)) for i, c in enumerate(columns)]
        print("  ".join(str(c).ljust(w) for c, w in zip(columns, widths)).rstrip())
        for r in rows:
            print("  ".join(str(v).ljust(w) for v, w in zip(r, widths)).rstrip())


def when(ms: int | None) -> str:
    """Epoch milliseconds as local ISO time with its offset, to the millisecond."""
    if not ms or ms < 0:
        return "-"
    return datetime.fromtimestamp(ms / 1000).astimezone().isoformat(timespec="milliseconds")


def duration(ms: int) -> str:
    s = ms / 1000
    if s < 120:
        return f"{s:.1f}s"
    if s < 7200:
        return f"{s / 60:.1f}min"
    return f"{s / 3600:.2f}h"


def mib(n: int) -> str:
    return f"{n / 1024:g} GiB" if n % 1024 == 0 or n >= 10240 else f"{n} MiB"
