"""The two-level quota ledger (tenant -> project): quota, used, reserved, borrowed, in integer milli-CU (and GPU
memory in MiB where a memory quota is set).

A tenant within its quota uses its own capacity; beyond it, up to quota x overcommit cap, it borrows idle capacity
from the shared pool, and that work is marked borrowed (billed on its own line, reclaimed first).

What is charged is what a job *holds* (`held`): the compute units of the share, MIG slice or whole cards it was given,
not what it asked for -- the same holding the bill counts (docs/billing.md). A tenant with no `quota.set` gets
`default_quota_milli` (0 by default: nothing runs until an operator gives it a quota; None: unlimited, an explicit
choice). The quotas of a tenant's projects may not add up to more than the tenant's own (`check`).
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from schemas.events import Assignment, JobRequested, QuotaBorrowed, QuotaChanged, QuotaReturned, QuotaSet, Reason
from schemas.gpu_models import MIG_COMPUTE_SLICES, GpuModel, mig_profile, model, share_for


# What a tenant's CPU-only jobs may hold at once: this many milli-CPU per milli-CU of its quota's borrowing cap
# (16: sixteen cores per A100's worth of compute, the host CPU per card of a DGX A100 / H100). They charge no GPU quota
# (no card); this bound is what keeps them within the tenant's share of the hosts (core.Scheduler._admit).
CPU_PER_CU = 16


def held(assignments: Iterable[Assignment], card_model: Callable[[str], str],
         asked_milli: int | None = None) -> tuple[int, int]:
    """What a placement holds, in the quota's units: (milli-CU, GPU memory MiB). A whole card (a 1000-milli slice)
    holds its model's compute units and all its memory; a MIG slice holds its compute slices' CU (what
    `placement._instance_holds` counts) and its memory; a software share holds what the job asked for (`asked_milli`,
    its request's compute) plus the CU of any milli-GPU it was given beyond the least share that delivers that (a
    vertical boost), rounded up, and its memory -- without `asked_milli`, its milli-GPU times the model's CU, rounded
    up. The least share is rounded up to whole milli-GPU (share_for), so it delivers up to one milli-GPU's CU more
    than was asked: that dust is the pool's granularity, not charged (two 2,000 milli-CU shares of H100s in a 4,000
    quota both stand within it). `card_model`: card uuid -> model name."""
    cu = mem = 0
    for a in assignments:
        m = model(card_model(a.gpu_uuid))
        if a.mig_profile:
            p = mig_profile(m.name, a.mig_profile)
            cu += p.compute_slices * m.cu_milli // MIG_COMPUTE_SLICES
            mem += a.memory_mib
        elif a.milli >= 1000:
            cu += m.cu_milli
            mem += m.memory_mib
        else:
            cu += share_cu(a.milli, m, asked_milli)
            mem += a.memory_mib
    return cu, mem


def share_cu(milli: int, m: GpuModel, asked_milli: int | None = None) -> int:
    """The milli-CU a software share of `milli` milli-GPU of a card of model `m` holds (`held`)."""
    if asked_milli is not None:
        least = share_for(asked_milli, m)
        if milli >= least:
            return asked_milli + -(-(milli - least) * m.cu_milli // 1000)
    return -(-milli * m.cu_milli // 1000)


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
    quota_version: int = 0  # moves whenever a quota is set: standings worked out before it are stale
    version: int = 0  # moves on every change (a quota set, a holding charged or given back): admit's answers hold
    # The quota of a tenant no quota.set names (milli-CU, no borrowing): 0 = it must be given one; None = unlimited.
    default_quota_milli: int | None = 0

    def __post_init__(self) -> None:
        if self.default_quota_milli is not None and self.default_quota_milli < 0:
            raise ValueError("default_quota_milli must be >= 0 (or None: unlimited)")

    def account(self, tenant: str, project: str | None = None) -> Account:
        return self.accounts.setdefault((tenant, project), Account())

    def tenant_quota(self, tenant: str) -> QuotaSet | None:
        """The tenant's quota in force: its own, else the default (None: unlimited)."""
        a = self.accounts.get((tenant, None))
        if a is not None and a.quota is not None:
            return a.quota
        if self.default_quota_milli is None:
            return None
        return QuotaSet(tenant=tenant, gpu_milli=self.default_quota_milli, overcommit_pct=100)

    def check(self, q: QuotaSet) -> tuple[Reason, ...]:
        """Why `q` cannot be set (empty: it can): the projects' quotas of a tenant add up to at most the tenant's,
        for compute and (where the tenant limits it) GPU memory. Lowering a tenant below its projects is refused
        the same way: shrink the projects first."""
        projects = {p: a.quota for (t, p), a in self.accounts.items()
                    if t == q.tenant and p is not None and a.quota is not None}
        if q.project is not None:
            projects[q.project] = q
            tenant = self.tenant_quota(q.tenant)
            code = "ProjectQuotasExceedTenant"
        else:
            tenant, code = q, "TenantQuotaBelowProjects"
        if tenant is None or not projects:
            return ()
        out = []
        total = sum(p.gpu_milli for p in projects.values())
        if total > tenant.gpu_milli:
            out.append(Reason(code=code, plugin="Quota", message=(
                f"the projects of {q.tenant} would have {total} milli-CU of quota, the tenant {tenant.gpu_milli}"),
                data={"tenant_quota_milli": tenant.gpu_milli, "projects_quota_milli": total,
                      "request_milli": q.gpu_milli}))
        if tenant.gpu_memory_mib is not None:
            mem = sum(p.gpu_memory_mib or 0 for p in projects.values())
            if mem > tenant.gpu_memory_mib:
                out.append(Reason(code=code, plugin="Quota", message=(
                    f"the projects of {q.tenant} would have {mem} MiB of GPU-memory quota, the tenant "
                    f"{tenant.gpu_memory_mib}"), data={"tenant_quota_memory_mib": tenant.gpu_memory_mib,
                                                       "projects_quota_memory_mib": mem}))
        return tuple(out)

    def set_quota(self, q: QuotaSet) -> tuple[Reason, ...]:
        """Set `q` unless `check` refuses it; returns the refusal's reasons (empty: set)."""
        why = self.check(q)
        if not why:
            self.account(q.tenant, q.project).quota = q
            self.quota_version += 1
            self.version += 1
        return why

    def admit(self, r: JobRequested, capacity_milli: int = 0, need: int | None = None,
              mem: int | None = None, freed: dict | None = None) -> Admission:
        """Own quota, borrowing up to the (possibly lowered) cap, or blocked. `capacity_milli`: the pool's
        schedulable compute, for lowering the cap near full (0: never lowered). `need`, `mem`: what the placement
        would hold (`held`); the request's compute and memory by default (a lower bound: a holding is never less).
        `freed`: (tenant, project or None) -> (milli, MiB) counted as no longer used (work about to stop)."""
        need = r.compute_milli if need is None else need
        mem = r.gpu_memory_mib if mem is None else mem
        freed = freed or {}
        proj = self.accounts.get((r.tenant, r.project))
        if proj and freed.get((r.tenant, r.project)):
            f = freed[(r.tenant, r.project)]
            proj = Account(proj.quota, proj.used_milli - f[0], proj.borrowed_milli, proj.reserved_milli,
                           proj.used_memory_mib - f[1])
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
        q = self.tenant_quota(r.tenant)
        if q is None:
            return Admission(False, False, (Reason(code="NoQuotaConfigured", plugin="Quota"),))
        t = self.accounts.get((r.tenant, None)) or Account()
        pool_used = self.pool_used_milli
        if freed.get((r.tenant, None)):
            f = freed[(r.tenant, None)]
            t = Account(t.quota, t.used_milli - f[0], t.borrowed_milli, t.reserved_milli, t.used_memory_mib - f[1])
            pool_used -= f[0]
        if q.gpu_milli == 0 and (t.quota is None):
            return Admission(True, False, (Reason(
                code="NoQuota", plugin="Quota", message=f"tenant {r.tenant} has no quota: an operator gives it one "
                f"(quota.set; `gpupool quota set {r.tenant} --compute N`)", data={"request_milli": need}),))
        quota = q.gpu_milli
        pct = effective_cap_pct(q.overcommit_pct, pool_used, capacity_milli, self.near_full_pct)
        cap = quota * pct // 100
        data = {"used_milli": t.used_milli, "request_milli": need, "quota_milli": quota, "cap_milli": cap}
        if need != r.compute_milli:
            data["asked_milli"] = r.compute_milli  # what it holds (charged) differs from what it asked for
        if t.quota is None:
            data["default_quota"] = 1
        if pct < q.overcommit_pct:
            data = {**data, "cap_pct": pct, "configured_cap_pct": q.overcommit_pct,
                    "pool_used_milli": pool_used, "pool_capacity_milli": capacity_milli}
        within = t.used_milli + need <= quota
        fits_cap = t.used_milli + need <= cap
        q_mem = q.gpu_memory_mib
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
        # the cap as configured, whatever the pool's use lowers it to
        full = quota * q.overcommit_pct // 100
        full_mem = q_mem * q.overcommit_pct // 100 if q_mem is not None else None
        if (need > full or (full_mem is not None and mem > full_mem)) and need != r.compute_milli \
                and r.compute_milli <= full and (full_mem is None or r.gpu_memory_mib <= full_mem):
            # the cards found would hold more than the whole cap, the request itself would not: cheaper cards
            # (core.Scheduler._within_quota tried those free now) may take it once they free up
            return Admission(True, False, (Reason(code="QuotaExceeded", plugin="Quota", message=(
                f"the cards free for it now would hold {need} milli-CU, beyond {r.tenant}'s whole borrowing cap "
                f"({full} milli-CU) and no cheaper cards are free: it waits for cards that hold less, or an operator "
                f"raising the quota (gpupool quota set {r.tenant} --compute N)"), data={**data, "holding_over_cap": 1}),))
        if need > full or (full_mem is not None and mem > full_mem):
            # no release of its own work will ever make room: say who can (waiting "until its usage falls" would
            # never end)
            return Admission(True, False, (Reason(code="QuotaExceeded", plugin="Quota", message=(
                f"asks more than {r.tenant}'s whole borrowing cap ({full} milli-CU"
                + (f", {full_mem} MiB" if full_mem is not None else "")
                + f") even with nothing of it running: it waits until an operator raises the quota (gpupool quota "
                f"set {r.tenant} --compute N)"), data={**data, "never_fits_cap": 1}),))
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

    def hold(self, r: JobRequested, borrowed: bool, reserved: bool = False, milli: int | None = None,
             memory: int | None = None) -> list:
        """Charge `r`'s tenant and project for a holding (`held`; the request's amounts by default)."""
        return self._move(r, borrowed, reserved, milli, memory, 1)

    def release(self, r: JobRequested, borrowed: bool, reserved: bool = False, milli: int | None = None,
                memory: int | None = None) -> list:
        """Give back what `hold` charged (the same amounts)."""
        return self._move(r, borrowed, reserved, milli, memory, -1)

    def _move(self, r: JobRequested, borrowed: bool, reserved: bool, milli: int | None, memory: int | None,
              sign: int) -> list:
        milli = r.compute_milli if milli is None else milli
        memory = r.gpu_memory_mib if memory is None else memory
        self.version += 1
        self.pool_used_milli += sign * milli
        for project in (None, r.project):
            a = self.account(r.tenant, project)
            a.used_milli += sign * milli
            a.used_memory_mib += sign * memory
            if borrowed:
                a.borrowed_milli += sign * milli
            if reserved:
                a.reserved_milli += sign * milli
        out = self._changed(r)
        if borrowed and milli:
            out.append((QuotaBorrowed if sign > 0 else QuotaReturned)(tenant=r.tenant, job_id=r.job_id, milli=milli))
        return out


def open_ledger() -> Ledger:
    """A ledger for an open pool, where a tenant without a quota is unlimited (the product's default is 0: nothing
    runs until an operator gives the tenant a quota). For simulations and tests about anything but quotas."""
    return Ledger(default_quota_milli=None)
