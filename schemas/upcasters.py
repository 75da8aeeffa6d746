"""Upcasters: each lifts a document of version N to N+1, so folds only ever see the current contract.

Version 1 (the first wire format) named the event time `time_ms` and asked for GPU memory in whole GiB
(`gpu_memory_gib`) on job requests; version 2 uses `event_time_ms` and MiB everywhere; version 3 adds the
gateway's `actor` and `claimed_time_ms`.
"""
from __future__ import annotations

from typing import Callable

SCHEMA_VERSION = 3  # the current contract: the version after the last upcaster (schemas.envelope stamps it)


def _v1_to_v2(doc: dict) -> dict:
    doc = dict(doc)
    if "time_ms" in doc and "event_time_ms" not in doc:
        doc["event_time_ms"] = doc.pop("time_ms")
    payload = doc.get("payload")
    if isinstance(payload, dict) and "gpu_memory_gib" in payload:
        payload = dict(payload)
        gib = payload.pop("gpu_memory_gib")
        payload["gpu_memory_mib"] = gib * 1024 if type(gib) is int else gib  # (a bool stays one: refused)
        doc["payload"] = payload
    doc["schema_version"] = 2
    return doc


def _v2_to_v3(doc: dict) -> dict:
    # Version 3 adds the gateway's `actor` and `claimed_time_ms` (both absent before: no request was authenticated).
    return {**doc, "schema_version": 3}


UPCASTERS: dict[int, Callable[[dict], dict]] = {1: _v1_to_v2, 2: _v2_to_v3}
assert sorted(UPCASTERS) == list(range(1, SCHEMA_VERSION)), "one upcaster per version below the current one"


def upcast(doc: dict) -> dict:
    version = doc.get("schema_version", 1)
    while version < SCHEMA_VERSION:
        doc = UPCASTERS[version](doc)
        version = doc["schema_version"]
    return doc
