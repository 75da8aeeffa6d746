"""Reservations: capacity booked for a time window (seed 000: 预留 with a lock whose strength grows with priority and
with how early it was booked).

The book is pure bookkeeping; the scheduler turns an accepted reservation into a *hold* when its window opens: a
placement of the booked shape that emits no command (nothing runs), keeps its capacity from every other job, and is
never a preemption victim. The job that names the reservation takes the hold's capacity (its node is tried first).

Admission at booking time is a calendar: at every instant of the new window, the live bookings covering that instant
plus the new one must fit the pool's schedulable compute (two bookings that overlap the new window but not each
other are never counted together). When they do not, bookings weaker than the new one are displaced, weakest
first, and only those booked at an instant that is still over capacity: each displacement is needed. Weaker = a
lower tier, or the same tier booked later. A new booking is never stronger than an earlier one of its own tier, so
among equals the first booked keeps its lock.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from schemas.events import TIER_RANK, JobRequested, Reason, ReservationRequested


LIVE = ("accepted", "queued", "active")


@dataclass
class Booking:
    request: ReservationRequested
    order: int  # booking order: earlier locks harder
    status: str = "accepted"  # accepted | queued (window open, hold not yet placed) | active | used | expired |
    #                           cancelled | displaced | rejected

    @property
    def strength(self) -> tuple[int, int]:
        """Smaller is stronger: tier first, then booking time."""
        return (TIER_RANK[self.request.tier], self.order)

    @property
    def hold_id(self) -> str:
        return f"{self.request.reservation_id}#hold"  # the reservation's id is the tenant's: so is its hold's

    def hold_request(self) -> JobRequested:
        r = self.request
        return JobRequested(job_id=self.hold_id, tenant=r.tenant, project=r.project, tier=r.tier,
                            compute_milli=r.compute_milli, gpu_memory_mib=r.gpu_memory_mib, cpu_milli=r.cpu_milli,
                            memory_mib=r.memory_mib, constraints=r.constraints)


def _overlaps(a: ReservationRequested, b: ReservationRequested) -> bool:
    return a.start_ms < b.end_ms and b.start_ms < a.end_ms


def _overlaps_span(a: ReservationRequested, span: tuple[int, int]) -> bool:
    return a.start_ms < span[1] and span[0] < a.end_ms


def peak_load(bookings: list[Booking], start_ms: int, end_ms: int, limit: int) -> tuple[int, list[tuple[int, int]]]:
    """Most compute booked at once within [start, end), and the spans where it exceeds ``limit``."""
    cuts = sorted({start_ms, end_ms, *(t for b in bookings for t in (b.request.start_ms, b.request.end_ms)
                                      if start_ms < t < end_ms)})
    peak, over = 0, []
    for lo, hi in zip(cuts, cuts[1:]):
        load = sum(b.request.compute_milli for b in bookings if b.request.start_ms < hi and lo < b.request.end_ms)
        peak = max(peak, load)
        if load > limit:
            over.append((lo, hi))
    return peak, over


@dataclass
class Book:
    bookings: dict[str, Booking] = field(default_factory=dict)
    booked: int = 0

    def decide(self, r: ReservationRequested, capacity_milli: int) -> tuple[Booking, list[Booking], tuple[Reason, ...]]:
        """Book `r`; returns its booking, the bookings it displaced, and the reasons."""
        self.booked += 1
        new = Booking(r, self.booked)
        self.bookings[r.reservation_id] = new
        if r.end_ms <= r.start_ms:
            new.status = "rejected"
            return new, [], (Reason(code="InvalidWindow", plugin="Reservation", message="end must follow start"),)
        live = [b for b in self.bookings.values()
                if b is not new and b.status in LIVE and _overlaps(b.request, r)]
        need = capacity_milli - r.compute_milli
        peak, over = peak_load(live, r.start_ms, r.end_ms, need)
        data = {"booked_milli": peak, "request_milli": r.compute_milli, "capacity_milli": capacity_milli}
        if not over:
            return new, [], (Reason(code="Booked", plugin="Reservation", data=data),)
        kept = list(live)
        displaced = []
        for b in sorted((b for b in live if b.strength > new.strength), key=lambda b: b.strength, reverse=True):
            if not over:
                break
            if any(_overlaps_span(b.request, span) for span in over):
                kept.remove(b)
                displaced.append(b)
                _, over = peak_load(kept, r.start_ms, r.end_ms, need)
        if over:
            new.status = "rejected"
            return new, [], (Reason(code="ReservationConflict", plugin="Reservation", data=data,
                                    message="overlapping reservations at least as strong hold the capacity"),)
        for b in displaced:
            b.status = "displaced"
        return new, displaced, (Reason(code="Booked", plugin="Reservation",
                                       data={**data, "displaced": len(displaced)}),)

    def opening(self, now_ms: int) -> list[Booking]:
        """Accepted bookings whose window has opened (strongest first)."""
        return sorted((b for b in self.bookings.values()
                       if b.status == "accepted" and b.request.start_ms <= now_ms < b.request.end_ms),
                      key=lambda b: b.strength)

    def closing(self, now_ms: int) -> list[Booking]:
        """Bookings still holding or waiting whose window has passed unused."""
        return [b for b in self.bookings.values()
                if b.status in LIVE and now_ms >= b.request.end_ms]
