"""A pending job's standing (claims.standing_now) is kept with by how much it holds (claims.within_by) and read again
while the holders ahead of it moved by less than that (Sums.holds_since): over random changes to its accounts' sums
(its tenant's and its project's, as holdings._sum makes them), it is what `within` works out afresh every time."""
from hypothesis import given, settings, strategies as st

from agents.scheduler.claims import standing_now, within
from agents.scheduler.holdings import GROUPS, Holdings, JobRecord
from agents.scheduler.quota import Ledger
from schemas.events import QuotaSet, Tier
from tests.builders import job

TIERS = (Tier.INFERENCE, Tier.ONLINE_TRAINING, Tier.OFFLINE)

# coarse amounts, so that a standing often sits exactly at a quota's edge
milli = st.integers(-6, 6).map(lambda n: 500 * n)
gib = st.integers(-4, 4).map(lambda n: 40 * n)
change = st.tuples(st.sampled_from(("p", "q")), st.integers(0, GROUPS - 1), st.integers(1, 12), milli, gib)
pending = st.tuples(st.sampled_from(TIERS), st.integers(1, 12), st.integers(1, 6).map(lambda n: 500 * n),
                    st.integers(1, 4).map(lambda n: 40 * n))
quota = st.tuples(st.integers(0, 16).map(lambda n: 500 * n), st.one_of(st.none(), st.integers(0, 12).map(
    lambda n: 40 * n)))


@settings(max_examples=400, deadline=None)
@given(tenant_quota=quota, project_quota=st.one_of(st.none(), quota),
       jobs=st.lists(pending, min_size=1, max_size=4), steps=st.lists(st.lists(change, max_size=5), max_size=40))
def test_a_kept_standing_is_the_one_worked_out_afresh(tenant_quota, project_quota, jobs, steps):
    ledger = Ledger(default_quota_milli=None)
    ledger.set_quota(QuotaSet(tenant="t", gpu_milli=tenant_quota[0], gpu_memory_mib=tenant_quota[1] and
                              tenant_quota[1] * 1024, overcommit_pct=300))
    if project_quota is not None:
        ledger.set_quota(QuotaSet(tenant="t", project="p", gpu_milli=project_quota[0],
                                  gpu_memory_mib=project_quota[1] and project_quota[1] * 1024, overcommit_pct=300))
    h = Holdings()
    recs = [JobRecord(request=job(f"j{i}", "t", milli, gib, tier=tier, project="p"), arrival=arrival)
            for i, (tier, arrival, milli, gib) in enumerate(jobs)]
    for batch in [[]] + steps:
        for project, g, arrival, milli, gib in batch:
            for key in (("t", None), ("t", project)):  # what holdings._sum does for a holder of this project
                s = h.sums.get(key)
                if s is None:
                    from agents.scheduler.holdings import Sums
                    s = h.sums[key] = Sums()
                s.add(g, arrival, milli, gib * 1024)
        for rec in recs:
            r = rec.request
            assert standing_now(h, ledger, rec) == within(h, ledger, r, rec.group, r.compute_milli, r.gpu_memory_mib,
                                                          arrival=rec.arrival)
