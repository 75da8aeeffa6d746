"""The two-level quota ledger (tenant -> project): quota, used, borrowed, in integer milli-CU.

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


@dataclass
class Ledger:
    accounts: dict[tuple[str, str | None], Account] = field(default_factory=dict)

    def account(self, tenant: str, project: str | None = None) -> Account:
        return self.accounts.setdefault((tenant, project), Account())

    def set_quota(self, q: QuotaSet) -> None:
        self.account(q.tenant, q.project).quota = q

    def admit(self, r: JobRequested) -> Admission:
        need = r.compute_milli
        proj = self.accounts.get((r.tenant, r.project))
        if proj and proj.quota:
            cap = proj.quota.gpu_milli * proj.quota.overcommit_pct // 100
            if proj.used_milli + need > cap:
                return Admission(True, False, (Reason(
                    code="ProjectQuotaExceeded", plugin="Quota",
                    data={"used_milli": proj.used_milli, "request_milli": need, "cap_milli": cap}),))
        t = self.accounts.get((r.tenant, None))
        if t is None or t.quota is None:
            return Admission(False, False, (Reason(code="NoQuotaConfigured", plugin="Quota"),))
        quota = t.quota.gpu_milli
        cap = quota * t.quota.overcommit_pct // 100
        data = {"used_milli": t.used_milli, "request_milli": need, "quota_milli": quota, "cap_milli": cap}
        if t.used_milli + need <= quota:
            return Admission(False, False, (Reason(code="WithinQuota", plugin="Quota", data=data),))
        if t.used_milli + need <= cap:
            return Admission(False, True, (Reason(code="Borrowing", plugin="Quota", data=data),))
        return Admission(True, False, (Reason(code="QuotaExceeded", plugin="Quota", data=data),))

    def _changed(self, r: JobRequested) -> list:
        out = []
        for project in (None, r.project):
            a = self.accounts.get((r.tenant, project))
            if a is not None:
                out.append(QuotaChanged(tenant=r.tenant, project=project, used_milli=a.used_milli,
                                        borrowed_milli=a.borrowed_milli, job_id=r.job_id))
        return out

    def hold(self, r: JobRequested, borrowed: bool) -> list:
        for project in (None, r.project):
            a = self.account(r.tenant, project)
            a.used_milli += r.compute_milli
            if borrowed:
                a.borrowed_milli += r.compute_milli
        out = self._changed(r)
        if borrowed:
            out.append(QuotaBorrowed(tenant=r.tenant, job_id=r.job_id, milli=r.compute_milli))
        return out

    def release(self, r: JobRequested, borrowed: bool) -> list:
        for project in (None, r.project):
            a = self.account(r.tenant, project)
            a.used_milli -= r.compute_milli
            if borrowed:
                a.borrowed_milli -= r.compute_milli
        out = self._changed(r)
        if borrowed:
            out.append(QuotaReturned(tenant=r.tenant, job_id=r.job_id, milli=r.compute_milli))
        return out
