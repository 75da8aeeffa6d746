"""The worker's placement metrics do not depend on which of a request and its placement the folds read first.

The gateway hands a request to the scheduler's input and to `gpupool.job-requests` at once (docs/architecture.md,
data flow step 1), so the node fold can read a job's `cmd.place` before the job fold reads its `job.requested`.
Either order gives the same placement count, tier, queue wait and decision latency, and leaves no job "waiting".
"""
from __future__ import annotations

import pytest

from schemas.envelope import envelope
from schemas.events import Assignment, JobCompleted, JobRequested, PlaceJob, Tier
from streams.edge.metrics import WorkerMetrics

REQUESTED_MS, PLACED_MS = 1_000_000, 1_000_120


def request(job="acme/j1", seq=1, at=REQUESTED_MS):
    return envelope(JobRequested(job_id=job, tenant="acme", compute_milli=500, gpu_memory_mib=1024,
                                 tier=Tier.INFERENCE), source=f"in/alice/{job}", seq=seq, time_ms=at)


def place(job="acme/j1", command="c1"):
    return envelope(PlaceJob(command_id=command, job_id=job, tenant="acme", node="n1",
                             assignments=(Assignment(gpu_uuid="g0", milli=500, memory_mib=1024),)),
                    source="scheduler", seq=int(command[1:]), time_ms=PLACED_MS)


def completed(job="acme/j1"):
    return envelope(JobCompleted(job_id=job, node="n1", command_id="c1"), source=f"n1/job/{job}", seq=1,
                    time_ms=PLACED_MS + 5000)


def sample(m: WorkerMetrics, name: str, **labels) -> float:
    return m.registry.get_sample_value(name, labels) or 0.0


def observed(m: WorkerMetrics) -> tuple:
    return (sample(m, "gpupool_placements_total", tier="inference", gpu_model="A100-80GB"),
            sample(m, "gpupool_decision_latency_seconds_count", tier="inference"),
            sample(m, "gpupool_decision_latency_seconds_sum", tier="inference"),
            sample(m, "gpupool_queue_wait_seconds_count", tier="inference"), dict(m.waiting()))


@pytest.mark.parametrize("order", ["request first", "placement first"])
def test_either_order_counts_the_placement_once_with_its_tier_and_latency(order):
    m = WorkerMetrics()
    if order == "request first":
        m.job_fact(request())
        assert "acme/j1" in m.waiting()
        m.command(place(), PLACED_MS, "A100-80GB")
    else:
        m.command(place(), PLACED_MS, "A100-80GB")
        assert sample(m, "gpupool_placements_total", tier="unknown", gpu_model="A100-80GB") == 0
        m.job_fact(request())
    assert observed(m) == (1.0, 1.0, pytest.approx(0.12), 1.0, {})


def test_a_placement_whose_request_never_comes_is_counted_when_the_job_ends():
    """A worker restarted after the request was committed and before the placement: no tier, no latency."""
    m = WorkerMetrics()
    m.command(place(), PLACED_MS, "A100-80GB")
    m.job_fact(completed())
    assert sample(m, "gpupool_placements_total", tier="unknown", gpu_model="A100-80GB") == 1
    assert sample(m, "gpupool_decision_latency_seconds_count", tier="unknown") == 0
    assert m.waiting() == {}


def test_a_retried_request_of_a_running_job_is_not_a_new_wait():
    m = WorkerMetrics()
    m.job_fact(request())
    m.command(place(), PLACED_MS, "A100-80GB")
    m.job_fact(request(seq=7, at=PLACED_MS + 50))  # the client sent it again
    assert m.waiting() == {}
    assert observed(m)[:2] == (1.0, 1.0)
