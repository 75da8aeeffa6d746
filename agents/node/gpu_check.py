"""`infra/gpu-check`: run the NVML backend on this machine for a few seconds, without Kafka, and print what the node
agent would publish (inventory, telemetry batches, health events) as one JSON document.

Exit status: 0 when NVML answered and saw at least one card; 1 otherwise, with a one-line explanation on stderr, so
that a provisioning script can tell "no driver" from "driver but no card" from "works".
"""
from __future__ import annotations

import argparse
import json
import socket
import sys
import time
from pathlib import Path


def _fail(message: str) -> int:
    print(message.replace("\n", " "), file=sys.stderr)
    return 1


def run(seconds: float, interval: float, node: str, nvml=None) -> tuple[int, dict | None]:
    try:
        from agents.node.nvml_backend import NvmlBackend

        backend = NvmlBackend(nvml)
    except ImportError as exc:
        return _fail(f"pynvml is not installed (pip install nvidia-ml-py): {exc}"), None
    try:
        backend.open()
    except Exception as exc:  # noqa: BLE001 - every NVML init error means the same thing here: no usable driver
        name = type(exc).__name__
        if name in ("NVMLError_LibraryNotFound", "NVMLError_DriverNotLoaded"):
            return _fail(f"no NVIDIA driver: {exc}"), None
        return _fail(f"NVML unusable: {name}: {exc}"), None
    try:
        inventory = backend.inventory(node)
        batches, health = [], []
        deadline = time.monotonic() + seconds
        while True:
            t0 = time.monotonic()
            tel, events = backend.telemetry(node)
            batches.append({"time_ms": time.time_ns() // 1_000_000, **tel.model_dump(mode="json")})
            health.extend(e.model_dump(mode="json") for e in events)
            if t0 + interval > deadline:
                break
            time.sleep(max(0.0, interval - (time.monotonic() - t0)))
    finally:
        backend.close()
    doc = {"node": node, "seconds": seconds, "inventory": inventory.model_dump(mode="json"),
           "telemetry": batches, "health": health}
    if not inventory.gpus:
        return _fail("no NVIDIA GPU: the driver answers but NVML lists no usable card"), doc
    return 0, doc


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="gpu-check", description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=10.0, help="how long to sample telemetry (default 10)")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between telemetry samples")
    p.add_argument("--node", default=socket.gethostname())
    p.add_argument("--out", type=Path, help="also write the JSON document here")
    args = p.parse_args(argv)
    rc, doc = run(max(0.0, args.seconds), max(0.05, args.interval), args.node)
    if doc is not None:
        text = json.dumps(doc, indent=1)
        print(text)
        if args.out:
            args.out.write_text(text + "\n")
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
