"""Fair admission under bursts (issue #31 item 2), in the pure core: the gateway's rate window per principal, the
inboxes' turns in the gateway, and the scheduler's cap on a tenant's waiting jobs. The live burst is in
tests/test_tenant_isolation_live.py; the figures in bench/burst.py."""
from __future__ import annotations

import orjson
from aiokafka import TopicPartition

from agents.scheduler.core import Scheduler
from schemas.events import JobCancelled, JobRequested, QuotaSet
from streams.edge.app import fair_turns
from streams.folds import gateway
from tests.builders import Clock, inventory

ALICE = gateway.Principal("alice", "tenant", "acme")
LIMIT = gateway.RateLimit(window_ms=10_000, per_window=3)


def _job(job_id: str) -> bytes:
    return orjson.dumps({"kind": "job.requested", "job_id": job_id, "compute_milli": 1000, "gpu_memory_mib": 1024})


def test_the_rate_window_refuses_the_requests_past_its_count_and_says_when_to_send_again():
    # offsets 10..14 in one window that starts at offset 10: three admitted, the fourth and fifth refused
    outs = [gateway.admit(ALICE, "alice", _job(f"j{o}"), o, 20_500, window_first=10, limit=LIMIT)
            for o in range(10, 15)]
    assert [o.accepted is not None for o in outs] == [True, True, True, False, False]
    refused = outs[3].rejected.payload
    assert refused.kind == "job.rejected" and refused.job_id == "acme/j13" and refused.code == "rate_limited"
    assert "more than 3 requests in 10 s" in refused.reasons[0].message and "from 30000 ms" in refused.reasons[0].message
    # the next window starts counting afresh; without a window (the broker could not say) nothing is counted
    assert gateway.admit(ALICE, "alice", _job("j15"), 15, 30_000, window_first=15, limit=LIMIT).accepted
    assert gateway.admit(ALICE, "alice", _job("j16"), 99, 30_000, limit=LIMIT).accepted


def test_a_refusal_for_the_rate_is_the_same_on_a_second_reading():
    """The count is the inbox's offsets, not a counter in memory: a re-run after a crash decides the same."""
    first = [gateway.admit(ALICE, "alice", _job(f"j{o}"), o, 1_000, window_first=0, limit=LIMIT) for o in range(5)]
    again = [gateway.admit(ALICE, "alice", _job(f"j{o}"), o, 1_000, window_first=0, limit=LIMIT) for o in range(5)]
    assert first == again


def test_inboxes_take_turns_so_a_burst_does_not_go_ahead_of_a_single_request():
    alice, bob = TopicPartition("gpupool.in.alice", 0), TopicPartition("gpupool.in.bob", 0)
    batches = {alice: [("alice", i) for i in range(20)], bob: [("bob", 0)]}
    order = [msg for _, msg in fair_turns(batches, 4)]
    assert sorted(order) == sorted(batches[alice] + batches[bob])  # every record, once
    assert order.index(("bob", 0)) == 4  # after alice's first turn, not after her 20 records
    assert [m for m in order if m[0] == "alice"] == batches[alice]  # each inbox's own order kept


def _scheduler(max_pending: int) -> tuple[Scheduler, Clock]:
    clock = Clock(1_796_000_000_000)
    s = Scheduler(max_pending=max_pending)
    s.step(clock.env(inventory("n1", gpus=1), "n1/inventory"))
    for tenant in ("acme", "globex"):
        s.step(clock.env(QuotaSet(tenant=tenant, gpu_milli=100_000), f"in/admin/{tenant}"))
    return s, clock


def _request(s: Scheduler, clock: Clock, tenant: str, name: str, source: str | None = None):
    job = JobRequested(job_id=f"{tenant}/{name}", tenant=tenant, compute_milli=1000, gpu_memory_mib=1024)
    return s.step(clock.env(job, source or f"in/{tenant}-user/{tenant}/{name}"))


def test_a_tenant_past_its_waiting_jobs_cap_is_refused_and_another_tenant_is_not():
    s, clock = _scheduler(max_pending=3)
    _request(s, clock, "acme", "runs")  # takes the one card
    for i in range(3):
        _request(s, clock, "acme", f"w{i}")  # wait
    assert s.h.pending_of == {"acme": 3}
    out = _request(s, clock, "acme", "w3")
    refused = [o.payload for o in out if o.kind == "job.rejected"]
    assert [(r.job_id, r.code) for r in refused] == [("acme/w3", "too_many_pending")]
    assert refused[0].reasons[0].data == {"pending": 3, "max_pending": 3}
    assert "acme/w3" not in s.jobs
    # another tenant's request is taken (it waits for the card like anyone, it is not refused)
    assert not [o for o in _request(s, clock, "globex", "g0") if o.kind == "job.rejected"]
    assert s.h.pending_of == {"acme": 3, "globex": 1}
    # once one of acme's waiting jobs goes, acme may send one more
    s.step(clock.env(JobCancelled(job_id="acme/w0"), "in/acme-user/acme/w0"))
    assert s.h.pending_of["acme"] == 2
    assert not [o for o in _request(s, clock, "acme", "w4") if o.kind == "job.rejected"]


def test_the_cap_is_on_requests_through_the_gateway_only():
    """Simulations and benchmarks feed the scheduler directly (no gateway source): their queues are theirs."""
    s, clock = _scheduler(max_pending=1)
    _request(s, clock, "acme", "runs", source="bench/acme")
    for i in range(3):
        assert not [o for o in _request(s, clock, "acme", f"w{i}", source=f"bench/{i}") if o.kind == "job.rejected"]
    assert s.h.pending_of == {"acme": 3}
