"""The two-level quota ledger (tenant -> project): quota, used, reserved, borrowed, in integer milli-CU (and GPU
memory in MiB where a memory quota is set).

A tenant within its quota uses its own capacity; beyond it, up to quota x overcommit cap, it borrows idle capacity
from the shared pool, and that work is marked borrowed (billed on its own line, reclaimed first). A tenant with no
quota configured is unlimited: the pool's operators decide whether that is allowed by configuring quotas.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from schemas.events import JobRequested, QuotaBorrowed, QuotaChanged, QuotaReturned, QuotaSet, Reason


@dataclass(frozen=True)
class Admission:
    blocked: bool
    borrowed: bool
    reasons: tuple[Reason, ...] = ()


@dataclass
class Account:
    quota: QuotaSet | None = None
    used_milli: int = 0
    borrowed_milli: int = 0
    reserved_milli: int = 0  # of used_milli: reservation holds
    used_memory_mib: int = 0


def effective_cap_pct(cap_pct: int, used_milli: int, capacity_milli: int, near_full_pct: int) -> int:
    """The overcommit cap, lowered as the pool fills: unchanged below `near_full_pct` allocated, then linearly down
    to 100 % (no borrowing) when the pool is full, so borrowed work cannot crowd out owners who come back."""
    if capacity_milli <= 0 or cap_pct <= 100 or used_milli * 100 < near_full_pct * capacity_milli:
        return cap_pct
    headroom = max(0, capacity_milli - used_milli) * 100  # percent points of capacity still free, x capacity
    span = (100 - near_full_pct) * capacity_milli
    return 100 + (cap_pct - 100) * headroom // span


@dataclass
class Ledger:
    accounts: dict[tuple[str, str | None], Account] = field(default_factory=dict)
    near_full_pct: int = 90
    pool_used_milli: int = 0  # held by every tenant together

    def account(self, tenant: str, project: str | None = None) -> Account:
        return self.accounts.setdefault((tenant, project), Account())

    def set_quota(self, q: QuotaSet) -> None:
        self.account(q.tenant, q.project).quota = q

    def admit(self, r: JobRequested, capacity_milli: int = 0) -> Admission:
        """Own quota, borrowing up to the (possibly lowered) cap, or blocked. `capacity_milli`: the pool's
        schedulable compute, for lowering the cap near full (0: never lowered)."""
        need = r.compute_milli
        mem = r.gpu_memory_mib
        proj = self.accounts.get((r.tenant, r.project))
        if proj and proj.quota:
            cap = proj.quota.gpu_milli * proj.quota.overcommit_pct // 100
            if proj.used_milli + need > cap:
                return Admission(True, False, (Reason(
                    code="ProjectQuotaExceeded", plugin="Quota",
                    data={"used_milli": proj.used_milli, "request_milli": need, "cap_milli": cap}),))
            if proj.quota.gpu_memory_mib is not None:
                cap_mem = proj.quota.gpu_memory_mib * proj.quota.overcommit_pct // 100
                if proj.used_memory_mib + mem > cap_mem:
                    return Admission(True, False, (Reason(
                        code="ProjectQuotaExceeded", plugin="Quota", message="GPU memory",
                        data={"used_memory_mib": proj.used_memory_mib, "request_memory_mib": mem,
                              "cap_memory_mib": cap_mem}),))
        t = self.accounts.get((r.tenant, None))
        if t is None or t.quota is None:
            return Admission(False, False, (Reason(code="NoQuotaConfigured", plugin="Quota"),))
        quota = t.quota.gpu_milli
        pct = effective_cap_pct(t.quota.overcommit_pct, self.pool_used_milli, capacity_milli, self.near_full_pct)
        cap = quota * pct // 100
        data = {"used_milli": t.used_milli, "request_milli": need, "quota_milli": quota, "cap_milli": cap}
        if pct < t.quota.overcommit_pct:
            data = {**data, "cap_pct": pct, "configured_cap_pct": t.quota.overcommit_pct,
                    "pool_used_milli": self.pool_used_milli, "pool_capacity_milli": capacity_milli}
        within = t.used_milli + need <= quota
        fits_cap = t.used_milli + need <= cap
        q_mem = t.quota.gpu_memory_mib
        if q_mem is not None:  # memory is a resource of its own: beyond its quota is borrowing too
            cap_mem = q_mem * pct // 100
            data = {**data, "used_memory_mib": t.used_memory_mib, "request_memory_mib": mem,
                    "quota_memory_mib": q_mem, "cap_memory_mib": cap_mem}
            within = within and t.used_memory_mib + mem <= q_mem
            fits_cap = fits_cap and t.used_memory_mib + mem <= cap_mem
        if within:
            return Admission(False, False, (Reason(code="WithinQuota", plugin="Quota", data=data),))
        if fits_cap:
            return Admission(False, True, (Reason(code="Borrowing", plugin="Quota", data=data),))
        return Admission(True, False, (Reason(code="QuotaExceeded", plugin="Quota", data=data),))

    def _changed(self, r: JobRequested) -> list:
        out = []
        for project in (None, r.project):
            a = self.accounts.get((r.tenant, project))
            if a is not None:
                out.append(QuotaChanged(tenant=r.tenant, project=project, used_milli=a.used_milli,
                                        reserved_milli=a.reserved_milli, borrowed_milli=a.borrowed_milli,
                                        used_memory_mib=a.used_memory_mib, job_id=r.job_id))
        return out

    def hold(self, r: JobRequested, borrowed: bool, reserved: bool = False) -> list:
        self.pool_used_milli += r.compute_milli
        for project in (None, r.project):
            a = self.account(r.tenant, project)
            a.used_milli += r.compute_milli
            a.used_memory_mib += r.gpu_memory_mib
            if borrowed:
                a.borrowed_milli += r.compute_milli
            if reserved:
                a.reserved_milli += r.compute_milli
        out = self._changed(r)
        if borrowed:
            out.append(QuotaBorrowed(tenant=r.tenant, job_id=r.job_id, milli=r.compute_milli))
        return out

    def release(self, r: JobRequested, borrowed: bool, reserved: bool = False) -> list:
        self.pool_used_milli -= r.compute_milli
        for project in (None, r.project):
            a = self.account(r.tenant, project)
            a.used_milli -= r.compute_milli
            a.used_memory_mib -= r.gpu_memory_mib
            if borrowed:
                a.borrowed_milli -= r.compute_milli
            if reserved:
                a.reserved_milli -= r.compute_milli
        out = self._changed(r)
        if borrowed:
            out.append(QuotaReturned(tenant=r.tenant, job_id=r.job_id, milli=r.compute_milli))
        return out
