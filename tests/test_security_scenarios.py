"""The trust rules in the pure core, without a broker: what the gateway makes of a client's claims, and what the
scheduler makes of the log's time (docs/security.md). Each has a negative control that shows the old behaviour."""
from __future__ import annotations

import orjson

from agents.scheduler.core import Scheduler
from schemas.envelope import encode, envelope
from schemas.events import JobRequested, QuotaSet, Rejected, ReservationRequested
from streams.folds import gateway, job_view
from tests.builders import Clock, inventory

ALICE = gateway.Principal("alice", "tenant", "acme")
DAY = 86_400_000


def _client_doc(payload: dict, *, source="my-laptop", seq=1, time_ms=0, event_id="e-1") -> bytes:
    return orjson.dumps({"schema_version": 3, "event_id": event_id, "source": source, "seq": seq,
                         "event_time_ms": time_ms, "payload": payload})


def _booked(now: int) -> tuple[Scheduler, Clock]:
    clock = Clock(now)
    s = Scheduler()
    s.step(clock.env(inventory("n1", gpus=4), "n1/inventory"), now)
    s.step(clock.env(QuotaSet(tenant="acme", gpu_milli=4000), "in/admin/acme"), now)
    out = s.step(clock.env(ReservationRequested(reservation_id="acme/r1", tenant="acme", compute_milli=1000,
                                                gpu_memory_mib=10 * 1024, start_ms=now + 60_000,
                                                end_ms=now + 3_600_000), "in/admin/acme/r1"), now)
    assert [o.payload.status for o in out if o.kind == "reservation.decided"] == ["accepted"]
    return s, clock


def test_a_request_dated_two_days_ahead_moves_neither_the_clock_nor_a_reservation():
    now = 1_796_000_000_000
    s, _ = _booked(now)
    doc = _client_doc({"kind": "job.requested", "job_id": "j1", "tenant": "acme", "compute_milli": 100,
                       "gpu_memory_mib": 1024}, time_ms=now + 2 * DAY)
    env = gateway.admit(ALICE, "alice", doc, offset=0, log_ms=now + 5).accepted
    assert env.event_time_ms == now + 5 and env.claimed_time_ms == now + 2 * DAY  # kept as data, not as time
    out = s.step(env, now + 6)  # the scheduler input's append time
    assert s.now_ms == now + 6
    assert not [o for o in out if o.kind == "reservation.decided"]
    assert s.book.bookings["acme/r1"].status == "accepted"
    assert [o.payload.job_id for o in out if o.kind == "cmd.place"] == ["acme/j1"]


def test_negative_control_a_producers_clock_would_have_expired_it():
    now = 1_796_000_000_000
    s, clock = _booked(now)
    raw = envelope(JobRequested(job_id="acme/j1", tenant="acme", compute_milli=100, gpu_memory_mib=1024),
                   source="my-laptop", seq=1, time_ms=now + 2 * DAY)
    out = s.step(raw)  # no log time: the event time stands in, as in the old code
    assert [o.payload.status for o in out if o.kind == "reservation.decided"] == ["expired"]


def test_two_requests_that_reuse_a_clients_sequence_number_are_both_scheduled():
    now = 1_796_000_000_000
    clock = Clock(now)
    s = Scheduler()
    s.step(clock.env(inventory("n1", gpus=4), "n1/inventory"), now)
    s.step(clock.env(QuotaSet(tenant="acme", gpu_milli=4000), "in/admin/acme"), now)
    placed = []
    for offset, job_id in enumerate(("a", "b")):  # same source, seq and event id: the client's own counter reset
        doc = _client_doc({"kind": "job.requested", "job_id": job_id, "tenant": "acme", "compute_milli": 100,
                           "gpu_memory_mib": 1024}, source="sdk", seq=7, event_id="sdk:7")
        env = gateway.admit(ALICE, "alice", doc, offset=offset, log_ms=now + offset).accepted
        placed += [o.payload.job_id for o in s.step(env, now + offset) if o.kind == "cmd.place"]
    assert placed == ["acme/a", "acme/b"]
    # negative control: trusting the client's (source, seq) loses the second
    s2 = Scheduler()
    s2.step(clock.env(inventory("n1", gpus=4), "n1/inventory"), now)
    s2.step(clock.env(QuotaSet(tenant="acme", gpu_milli=4000), "in/admin/acme"), now)
    lost = []
    for job_id in ("a", "b"):
        env = envelope(JobRequested(job_id=f"acme/{job_id}", tenant="acme", compute_milli=100, gpu_memory_mib=1024),
                       source="sdk", seq=7, time_ms=now)
        lost += [o.payload.job_id for o in s2.step(env, now) if o.kind == "cmd.place"]
    assert lost == ["acme/a"]


def test_a_reused_job_id_with_other_content_is_rejected_the_same_request_is_a_no_op():
    now = 1_796_000_000_000
    clock = Clock(now)
    s = Scheduler()
    s.step(clock.env(inventory("n1", gpus=4), "n1/inventory"), now)
    s.step(clock.env(QuotaSet(tenant="acme", gpu_milli=4000), "in/admin/acme"), now)
    first = {"kind": "job.requested", "job_id": "train", "tenant": "acme", "compute_milli": 100,
             "gpu_memory_mib": 1024}
    view = None
    answers = []
    for offset, payload in enumerate((first, first, {**first, "compute_milli": 900})):
        env = gateway.admit(ALICE, "alice", orjson.dumps(payload), offset=offset, log_ms=now + offset).accepted
        view = job_view.evolve(view, env)
        for o in s.step(env, now + offset):
            view = job_view.evolve(view, o) if getattr(o.payload, "job_id", None) == "acme/train" else view
            answers.append((offset, o.kind, getattr(o.payload, "code", None)))
    assert [a for a in answers if a[1] == "cmd.place"] == [(0, "cmd.place", None)]
    assert [a for a in answers if a[1] == "job.rejected"] == [(2, "job.rejected", "duplicate_job_id")]
    assert s.jobs["acme/train"].request.compute_milli == 100  # the first one stands
    assert view.request.compute_milli == 100 and view.state == "pending" and view.refused == ("duplicate_job_id",)


def test_a_rejection_changes_only_the_job_it_answers():
    """A refusal of a later request under a job's id leaves the job as it is; one that answers the request that
    made the job rejects it."""
    req = envelope(JobRequested(job_id="acme/x", tenant="acme", compute_milli=1, gpu_memory_mib=1),
                   source="in/alice/acme/x", seq=0, time_ms=1, event_id="in/alice:0")
    view = job_view.evolve(None, req)
    other = envelope(Rejected(job_id="acme/x", code="duplicate_job_id"), source="scheduler", seq=1, time_ms=2,
                     causation_id="in/alice:5")
    assert job_view.evolve(view, other).state == "pending"
    answer = envelope(Rejected(job_id="acme/x", code="unsatisfiable"), source="scheduler", seq=2, time_ms=3,
                      causation_id="in/alice:0")
    assert job_view.evolve(view, answer).state == "rejected"


def test_the_gateway_refuses_what_a_role_may_not_state():
    def out(principal, payload):
        return gateway.admit(principal, principal.name if principal else "ghost", encode(envelope(
            payload, source="x", seq=1, time_ms=1)), offset=3, log_ms=10)

    quota = QuotaSet(tenant="acme", gpu_milli=10 ** 6)
    assert out(ALICE, quota).rejected.payload.code == "forbidden"  # a tenant may not set quotas
    assert out(gateway.Principal("ops", "operator"), quota).accepted.actor == "ops"
    assert out(None, quota).rejected.payload.code == "unknown_principal"
    node = gateway.Principal("node", "node")
    assert out(node, quota).rejected.payload.code == "forbidden"
    replica = JobRequested(job_id="r", tenant="acme", compute_milli=1, gpu_memory_mib=1, service_id="acme/chat")
    assert out(ALICE, replica).rejected.payload.code == "forbidden"  # only the autoscaler makes replicas
