"""A serving replica's Prometheus endpoint, read by its node (issue #33 item 5, docs/serving.md, "Load from the
replicas"). Pure: the text exposition format in, the integers of a `replica.metrics` out; the node agents
(agents/node/serving.py) fetch the text.

Which series are read depends on the service's `serve.metrics`:

| field | vllm | sglang |
|---|---|---|
| requests_total (counter) | `vllm:request_success_total` (all labels summed) | `sglang:num_requests_total` |
| running (gauge) | `vllm:num_requests_running` | `sglang:num_running_reqs` |
| waiting (gauge) | `vllm:num_requests_waiting` | `sglang:num_queue_reqs` |
| latency histogram | `vllm:e2e_request_latency_seconds` | `sglang:e2e_request_latency_seconds` |
| kv_cache_permille (gauge, 0..1) | `vllm:kv_cache_usage_perc` (else `vllm:gpu_cache_usage_perc`) | `sglang:token_usage` |

Series with several label sets (a model name, a finish reason) are summed; histogram buckets are summed per bound.
A series that is missing reads 0. Bounds are kept in whole milliseconds (rounded up), counts as integers.
"""
from __future__ import annotations

import math
import re

FLAVOURS: dict[str, dict[str, tuple[str, ...]]] = {
    "vllm": {"requests_total": ("vllm:request_success_total",), "running": ("vllm:num_requests_running",),
             "waiting": ("vllm:num_requests_waiting",), "latency": ("vllm:e2e_request_latency_seconds",),
             "kv_cache": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")},
    "sglang": {"requests_total": ("sglang:num_requests_total",), "running": ("sglang:num_running_reqs",),
               "waiting": ("sglang:num_queue_reqs",), "latency": ("sglang:e2e_request_latency_seconds",),
               "kv_cache": ("sglang:token_usage",)},
}

_LINE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{(.*)\})?\s+(\S+)(\s+\S+)?$")
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"')
MAX_TEXT = 4 << 20  # a metrics page beyond this is not read (a replica's own page is kilobytes)


def parse(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """name -> [(labels, value)] of every sample line; comments, blank and malformed lines are skipped."""
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for line in text[:MAX_TEXT].splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = _LINE.match(line)
        if not m:
            continue
        try:
            value = float(m[4])
        except ValueError:
            continue
        labels = dict(_LABEL.findall(m[3])) if m[3] else {}
        out.setdefault(m[1], []).append((labels, value))
    return out


def _sum(samples, names: tuple[str, ...], suffix: str = "") -> float | None:
    """The sum over label sets of the first of `names` (+ suffix) present; a counter `X_total` is also found as `X`
    (older clients expose it without the suffix). None: none present."""
    for name in names:
        got = samples.get(name + suffix)
        if got is None and name.endswith("_total") and not suffix:
            got = samples.get(name[:-len("_total")])
        if got is not None:
            return sum(v for _, v in got if math.isfinite(v))
    return None


def _int(x: float | None) -> int:
    return max(0, int(round(x))) if x is not None and math.isfinite(x) else 0


def replica_metrics(flavour: str, text: str) -> dict[str, object]:
    """The fields of a `replica.metrics` (all but the ids and the time) from one scrape's text."""
    names = FLAVOURS.get(flavour)
    if names is None:
        raise ValueError(f"metrics flavour {flavour!r}: one of {', '.join(FLAVOURS)}")
    s = parse(text)
    buckets: dict[int, float] = {}
    for labels, v in s.get(names["latency"][0] + "_bucket", []):
        le = labels.get("le", "")
        try:
            bound = float(le)
        except ValueError:
            continue
        if math.isfinite(bound) and math.isfinite(v):
            ms = int(math.ceil(bound * 1000 - 1e-9))
            buckets[ms] = buckets.get(ms, 0.0) + v
    kv = _sum(s, names["kv_cache"])
    return {
        "requests_total": _int(_sum(s, names["requests_total"])),
        "running": _int(_sum(s, names["running"])),
        "waiting": _int(_sum(s, names["waiting"])),
        "latency_buckets": tuple((b, _int(buckets[b])) for b in sorted(buckets)),
        "latency_count": _int(_sum(s, names["latency"], "_count")),
        "latency_sum_ms": _int((_sum(s, names["latency"], "_sum") or 0.0) * 1000),
        "kv_cache_permille": min(1000, _int((kv or 0.0) * 1000)),
    }
