"""Where the parts of a multi-card gang sit, and what that costs its collective communication.

Preference: one node (one NVLink domain within it) > one rack > one data center > anywhere, bounded by the job's
`max_spread`. The estimate is a ring all-reduce, whose time is set by the slowest link on the ring: per-GPU bandwidth
of the widest level spanned, against the narrowest level the gang could have had on this fleet. The bandwidths are
stated assumptions (nominal figures for A100/H100-class pools), not measurements:

    NVLink within a node    300 GB/s  (A100 NVLink3, one direction)
    PCIe within a node       32 GB/s  (PCIe 4.0 x16)
    across nodes, one rack   25 GB/s  (200 Gb/s InfiniBand per GPU)
    across racks, one DC     12 GB/s  (2:1 oversubscribed spine)
    across data centers       1 GB/s  (WAN)
"""
from __future__ import annotations

LEVELS = ("nvlink", "node", "rack", "datacenter", "any")
BANDWIDTH_GBPS = {"nvlink": 300, "node": 32, "rack": 25, "datacenter": 12, "any": 1}
SPREAD_LIMIT = {"node": "nvlink", "nvlink": "nvlink", "rack": "rack", "datacenter": "datacenter", "any": "any"}
WORDS = {"nvlink": "one NVLink domain", "node": "one node (PCIe)", "rack": "one rack", "datacenter": "one data center",
         "any": "several data centers"}


def level_of(parts: list[tuple[str, str, tuple[str | None, ...]]]) -> str:
    """The widest level a placement spans; parts are (rack, datacenter, NVLink domains of its cards)."""
    if len(parts) == 1:
        domains = set(parts[0][2])
        return "nvlink" if len(domains) == 1 and None not in domains else "node"
    if len({p[0] for p in parts}) == 1 and len({p[1] for p in parts}) == 1:
        return "rack"
    if len({p[1] for p in parts}) == 1:
        return "datacenter"
    return "any"


def slowdown_pct(actual: str, ideal: str) -> int:
    """Estimated extra all-reduce time of `actual` against `ideal`, in percent (0 when they are the same level)."""
    return max(0, BANDWIDTH_GBPS[ideal] * 100 // BANDWIDTH_GBPS[actual] - 100)


def allowed(level: str, max_spread: str) -> bool:
    return LEVELS.index(level) <= LEVELS.index(SPREAD_LIMIT[max_spread])


def explain(actual: str, ideal: str, parts: int) -> str:
    if actual == ideal:
        return f"{parts} part(s) within {WORDS[actual]}: the ideal placement"
    return (f"placed across {WORDS[actual]} in {parts} part(s): ~{slowdown_pct(actual, ideal)}% slower all-reduce "
            f"than {WORDS[ideal]}")
