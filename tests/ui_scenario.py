"""A populated pool for the dashboard's browser test and its screenshots: two tenants with quotas, training and
inference jobs on a simulated demo:4 fleet (A100, H100, A10, T4 nodes), a two-node gang, a preemption, and an
inference service whose load rises past its SLO (the autoscaler boosts it and adds a replica) and falls again.

`python -m tests.ui_scenario DIR [MINUTES]` runs it on a fresh stack for MINUTES of history (the charts' points are
minutes) and writes the screenshots into DIR (docs/ for the documentation's)."""
from __future__ import annotations

import sys
import time
from pathlib import Path

from schemas.events import InferenceLoad, JobRequested, ServiceDeclared, Tier
from tests.live import job_states, quotas, wait_for

TENANTS = (("alice", "acme"), ("bob", "globex"))


def start(stack) -> None:
    stack.start_worker()
    stack.start_agent("demo:4")
    for name, tenant in TENANTS:
        stack.add_user(name, "tenant", tenant)
    stack.add_user("fin", "finance")
    quotas(stack, "acme", "globex", compute=40_000)
    from importlib import resources

    from agents.cli.requests import price_rows

    stack.client().send(price_rows(resources.files("infra").joinpath("prices.yaml").read_text()))  # as `up` does
    wait_for(lambda: stack.client().api("/cluster/")["nodes"] == 4, 90, "the fleet", stack)


def submit(stack) -> dict[str, str]:
    """The jobs; returns job id -> tenant principal."""
    alice, bob = stack.client("alice"), stack.client("bob")
    alice.send([
        JobRequested(job_id="train-llm", tenant="acme", tier=Tier.ONLINE_TRAINING, compute_milli=2000,
                     gpu_memory_mib=140 * 1024, duration_s=3600, constraints={"models": ["H100-80GB"]}),
        JobRequested(job_id="finetune-7b", tenant="acme", tier=Tier.OFFLINE, compute_milli=500,
                     gpu_memory_mib=20 * 1024, duration_s=3600, checkpoint_interval_s=30),
        JobRequested(job_id="eval-small", tenant="acme", tier=Tier.OFFLINE, compute_milli=150,
                     gpu_memory_mib=6 * 1024, duration_s=3600),
    ])
    bob.send([
        JobRequested(job_id="pretrain", tenant="globex", tier=Tier.OFFLINE, compute_milli=3000,
                     gpu_memory_mib=240 * 1024, duration_s=3600, checkpoint_interval_s=30,
                     constraints={"models": ["A100-80GB"]}),
        JobRequested(job_id="batch-embed", tenant="globex", tier=Tier.OFFLINE, compute_milli=300,
                     gpu_memory_mib=10 * 1024, duration_s=3600),
        JobRequested(job_id="gang-8", tenant="globex", tier=Tier.OFFLINE, compute_milli=4000,
                     gpu_memory_mib=4 * 20 * 1024, duration_s=3600, constraints={"max_spread": "rack"}),
        JobRequested(job_id="too-big", tenant="globex", tier=Tier.OFFLINE, compute_milli=64_000,
                     gpu_memory_mib=64 * 80 * 1024, duration_s=60),
    ])
    alice.send([ServiceDeclared(service_id="chat", tenant="acme", replica_compute_milli=300,
                                replica_memory_mib=10 * 1024, boost_compute_milli=200, replica_qps=100,
                                min_replicas=1, max_replicas=3, latency_target_ms=200,
                                constraints={"models": ["A10"]})])
    jobs = {f"acme/{j}": "alice" for j in ("train-llm", "finetune-7b", "eval-small")}
    jobs.update({f"globex/{j}": "bob" for j in ("pretrain", "batch-embed", "gang-8")})
    return jobs


def running(stack, jobs: dict[str, str]) -> None:
    # most of them at least: on a loaded machine a node can miss two heartbeats and have its work requeued
    wait_for(lambda: sum(1 for j, r in job_states(stack).items() if j in jobs and r["state"] == "running") >= 4,
             240, "the jobs running", stack)


LOAD = [(60, 80, 30), (80, 120, 40), (110, 900, 60), (130, 950, 70), (120, 400, 60), (90, 150, 40), (70, 90, 30)]


def load(stack, rounds: int = 1, every_s: float = 5.0) -> None:
    """The chat service's load, reported by its tenant: quiet, over the SLO (boost, new replica), quiet again."""
    alice = stack.client("alice")
    for _ in range(rounds):
        for qps, p99, p50 in LOAD:
            alice.send([InferenceLoad(service_id="chat", qps=qps, p99_ms=p99, p50_ms=p50,
                                      queue_depth=30 if p99 > 200 else 0, util_pct=min(99, qps * 3 // 4))])
            time.sleep(every_s)


def preempt(stack) -> None:
    """An inference job of acme's on the A100 node bob's pretraining fills: bob's offline work yields."""
    stack.client("alice").send([JobRequested(job_id="serve-a100", tenant="acme", tier=Tier.INFERENCE,
                                             compute_milli=1000, gpu_memory_mib=70 * 1024, duration_s=3600,
                                             constraints={"models": ["A100-80GB"]})])


PAGES = ("cluster", "utilization", "queue", "tenants", "jobs", "job", "service")


def main(out: Path, minutes: float) -> int:
    import shutil
    import tempfile

    from agents.stack import Stack
    from infra import config
    from tests.browser import Browser, screenshots

    home = Path(tempfile.mkdtemp(prefix="gpupool-ui-"))
    stack = Stack(home=home / "gpupool", libs_home=config.load().home)
    stack.start_broker()
    try:
        start(stack)
        jobs = submit(stack)
        running(stack, jobs)
        preempt(stack)
        deadline = time.monotonic() + minutes * 60
        while time.monotonic() < deadline:
            load(stack, every_s=4.0)
        with Browser() as b:
            screenshots(b, stack, out)
    finally:
        stack.stop()
        shutil.rmtree(home, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), float(sys.argv[2]) if len(sys.argv) > 2 else 4))
