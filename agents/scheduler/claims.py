"""One claim order for tier preemption, quota reclaim and borrowing (docs/scheduler.md, "The claim order").

A job's claim is `(standing, tier, reserved)`, compared field by field, the larger the stronger:

- standing: 1 when it stands within quota, 0 when it borrows. A job's standing is worked out from the claim order
  itself, not from the order jobs were admitted in: in its account (tenant, and project where the project has a
  quota) the holders ahead of it -- every stronger claim group's, and those of its own group that arrived before
  it (the tie-break) -- plus the job, fit the quota (compute, and GPU memory where limited). A later arrival of
  its own group thus never changes a job's standing. So a tenant's quota goes to its strongest work first: its inference stands within quota
  before its training does, and what a tenant holds beyond its quota is its weakest work. A tenant without a limit
  (open pool) always stands within; a job on its reservation, and a reservation's hold, always do (the booking was
  the admission);
- tier: inference 2, online training 1, offline 0;
- reserved: 1 for a job on its own reservation.

Then a stable tie-break orders equals: the pending queue by arrival (work that was stopped before newer work), the
victims by the work they lose. `may_stop(a, b)` -- A may stop B -- when B's claim is strictly below A's.

Both claims are taken in the same state: A's as if it were admitted (what it would hold on the node's cards added
to its account), B's as if it came back now, after the plan: its own holding and every other victim of the plan
gone from its account, A's holding added to it. Amounts are what the quota charges: what A would hold on that
node's cards, and, for B coming back, what it asked for (a lower bound of any holding: a share is rounded up, a card
holds all its compute). So the relation is antisymmetric in every reachable state: after A stops B, B's claim can
only be lower than it was (its account holds at least A now, and what it would hold is at least what it asked) and
A's, should B try to stop it, only higher (its account lost the plan's victims, and A counts with what it asked) --
if A may stop B, B may not stop A until something else changes (a job ends, a quota changes, a node goes).
tests/test_claims.py holds the code to this.
"""
from __future__ import annotations

from agents.scheduler.holdings import GROUPS, Holdings, JobRecord, group
from agents.scheduler.node_index import cards_needed
from agents.scheduler.quota import Ledger
from schemas.events import TIER_RANK, JobRequested, Tier
from schemas.gpu_models import model, share_for

Claim = tuple[int, int, int]  # (standing, tier, reserved)


def claim(within: bool, tier: Tier, reserved: bool) -> Claim:
    """The claim: the one order tier preemption, quota reclaim and borrowing are decided by."""
    return (1 if within else 0, 2 - TIER_RANK[tier], 1 if reserved else 0)


def may_stop(a: Claim, b: Claim) -> bool:
    """Whether work of claim `a` may stop work of claim `b`: b is strictly weaker."""
    return b < a


def claim_of_group(within: bool, g: int) -> Claim:
    return (1 if within else 0, g // 2, g % 2)


def holding_on(r: JobRequested, model_name: str) -> tuple[int, int]:
    """What `r` would hold on cards of this model, in the quota's units (quota.held): a share of one card what it
    asked (compute and memory), whole cards all their compute and memory."""
    m = model(model_name)
    if r.compute_milli <= m.cu_milli and r.gpu_memory_mib <= m.memory_mib and r.isolation_asked != "exclusive":
        if share_for(r.compute_milli, m) < 1000:
            return r.compute_milli, r.gpu_memory_mib  # a share holds what it asked (quota.held)
        return m.cu_milli, m.memory_mib
    n = cards_needed(r.compute_milli, r.gpu_memory_mib, model_name)
    return n * m.cu_milli, n * m.memory_mib


def _quotas(ledger: Ledger, r: JobRequested):
    """The quotas that bound r's standing: (account key, QuotaSet) for its tenant (unless unlimited) and its project
    (when the project has a quota)."""
    out = []
    q = ledger.tenant_quota(r.tenant)
    if q is not None:
        out.append(((r.tenant, None), q))
    pa = ledger.accounts.get((r.tenant, r.project))
    if pa is not None and pa.quota is not None:
        out.append(((r.tenant, r.project), pa.quota))
    return out


def within(h: Holdings, ledger: Ledger, r: JobRequested, g: int, milli: int, memory: int, adjust=(),
           arrival: int = 1 << 62) -> bool:
    """Whether a job of claim group `g`, the `arrival`-th to arrive, that would hold (milli, memory) stands within
    quota: the holders ahead of it in its account (stronger groups, and its own group's earlier arrivals: the
    tie-break), plus it, fit. `adjust`: (tenant, project, group, arrival, milli, memory) added to the holders
    (negative: taken away) -- the state after a plan; an entry counts when it is ahead of the job."""
    return within_by(h, ledger, r, g, milli, memory, adjust, arrival)[0]


NO_LIMIT = 1 << 62


def within_by(h: Holdings, ledger: Ledger, r: JobRequested, g: int, milli: int, memory: int, adjust=(),
              arrival: int = 1 << 62, at: dict | None = None) -> tuple[bool, int, int]:
    """`within`, and by how much, in (milli, MiB): while within, how much more the holders ahead of it could hold
    with it still within (the least slack of its quotas, in each unit; NO_LIMIT where none limits); while beyond,
    how much less they would have to hold for it to come within in one unit (the most any quota is exceeded by in
    that unit; 0 or less in a unit no quota is exceeded in) -- it stays beyond while they give back less than
    that in either unit. `at`: the holders as they were when their sums were at these versions (account key ->
    Sums.version; an account not in it held nothing then; `Sums.ahead_at`)."""
    slack_m = slack_mem = NO_LIMIT
    for key, q in _quotas(ledger, r):
        s = h.sums.get(key)
        if at is None:
            m, mem = s.ahead_of(g, arrival) if s is not None else (0, 0)
        else:
            v = at.get(key)
            m, mem = s.ahead_at(v, g, arrival) if s is not None and v is not None else (0, 0)
        for tenant, project, gg, aa, am, amem in adjust:
            if (gg > g or gg == g and aa < arrival) and tenant == key[0] and (key[1] is None or key[1] == project):
                m += am
                mem += amem
        slack_m = min(slack_m, q.gpu_milli - m - milli)
        if q.gpu_memory_mib is not None:
            slack_mem = min(slack_mem, q.gpu_memory_mib - mem - memory)
    if slack_m >= 0 and slack_mem >= 0:
        return True, slack_m, slack_mem
    return False, -slack_m, -slack_mem


def standing_now(h: Holdings, ledger: Ledger, rec: JobRecord) -> bool:
    """A pending job's standing with what it asked for (the queue's order; a lower bound of any holding's)."""
    if rec.reserved or rec.hold is not None:
        return True
    r = rec.request
    # the queue's order asks for it many times a cycle (every job's key, every nominated job's against each job
    # behind it): worked out again only when any quota moved, or the holders ahead of it in its accounts (what
    # `within` sums) took more than its slack while it stood within, or gave back as much as it is beyond by while
    # it did not (`within_by`). The tenant's sums tell: every change to a project's sums changes its tenant's too,
    # for the same holder and amounts (holdings._sum, the one writer, counts a holder in both), so what the
    # tenant's holders ahead took or gave back bounds what its project's did
    t = h.sums.get((r.tenant, None))
    version = t.version if t is not None else -1
    memo = rec.standing_memo  # (tenant's sums version, quota version, standing, (by how much: within_by))
    if memo and memo[1] == ledger.quota_version:
        if memo[0] == version:
            return memo[2]
        if memo[0] >= 0 and t is not None:
            left = t.holds_since(memo[0], rec.group, rec.arrival, memo[2], memo[3])
            if left is not None:
                h.note(rec, standing_memo=(version, memo[1], memo[2], left))
                return memo[2]
    got, m, mem = within_by(h, ledger, r, rec.group, r.compute_milli, r.gpu_memory_mib, arrival=rec.arrival)
    h.note(rec, standing_memo=(version, ledger.quota_version, got, (m, mem)))
    return got


def standing_at(h: Holdings, ledger: Ledger, rec: JobRecord, versions: dict) -> bool:
    """`standing_now` as it was when its account's sums were at `versions` (account key -> Sums version; an account
    not in it held nothing then), the quotas as they are: `within_by` over the holders ahead of it then (from the
    changes since, which a pin keeps in the sums' log)."""
    if rec.reserved or rec.hold is not None:
        return True
    r = rec.request
    return within_by(h, ledger, r, rec.group, r.compute_milli, r.gpu_memory_mib, arrival=rec.arrival, at=versions)[0]


class Search:
    """The claim order as one preemptor's search sees it: its claim on each card model (what it would hold there),
    who may be stopped for it, and whether a plan's victims still stand beyond quota once the plan is done."""

    def __init__(self, h: Holdings, ledger: Ledger, rec: JobRecord):
        self.h, self.ledger, self.rec = h, ledger, rec
        self.r = rec.request
        self.g = rec.group
        self.sure = rec.reserved or rec.hold is not None  # within, whatever it holds
        r = self.r
        self._mine = ((r.tenant, r.project, self.g, rec.arrival, r.compute_milli, r.gpu_memory_mib),)
        self._keys: dict[str, Claim] = {}
        self._over: dict[tuple[str, int], bool] = {}
        self._bounded: dict[tuple[str, str], bool] = {}  # (tenant, project) -> whether any quota bounds it
        self.bounded = self._bounded  # read as is by core.Scheduler._plan_nodes
        self._slack: dict[tuple[str, str, int], tuple[int, int]] = {}  # surely_within's
        self.slack = self._slack  # read as is by core.Scheduler._plan_nodes
        self._back: dict[str, Claim] = {}  # job -> its claim coming back after the preemptor alone (victim_claim)
        self._tables: dict[Claim, frozenset[tuple[str, int]]] = {}
        self._accounts: dict[str, list] | None = None  # tenant -> [(project, its sums)], for _group_over

    def key(self, model_name: str | None = None) -> Claim:
        """The preemptor's claim as if admitted with what it would hold on this model's cards (None: what it asked)."""
        k = self._keys.get(model_name or "")
        if k is None:
            r = self.r
            amount = holding_on(r, model_name) if model_name else (r.compute_milli, r.gpu_memory_mib)
            ok = self.sure or within(self.h, self.ledger, r, self.g, *amount, arrival=self.rec.arrival)
            k = self._keys[model_name or ""] = claim(ok, r.tier, self.sure)
        return k

    def node_key(self, view) -> Claim:
        """Its claim on this node: with the most it could hold on any of the node's card models (the weakest)."""
        models = {g.model for g in view.cards()}
        if not models:
            return self.key()
        return min(self.key(m) for m in models)

    @property
    def mine(self) -> tuple:
        """The preemptor in its account after the plan, counted with what it asked for (a lower bound of what it will
        hold): the victims' claims are taken no weaker than they will be."""
        return self._mine

    def victim_claim(self, other: JobRecord, mine: tuple = (), others: tuple = ()) -> Claim:
        """`other`'s claim if it came back now, after the plan: its holding and the other victims' gone from its
        account, the preemptor's added (`mine`), counted with what it asked for."""
        o = other.request
        if other.reserved:
            return claim(True, o.tier, True)
        b = self._bounded.get((o.tenant, o.project))
        if b is None:
            b = self._bounded[(o.tenant, o.project)] = bool(_quotas(self.ledger, o))
        if not b:
            return claim(True, o.tier, False)  # no quota bounds its account: it always stands within
        if mine is self._mine and not others:
            got = self._back.get(o.job_id)
            if got is None:
                # the preemptor counts in its own tenant's accounts only: another tenant's job stands as it stands
                # now (standing_now, whose memo outlives this search)
                ok = within(self.h, self.ledger, o, other.group, o.compute_milli, o.gpu_memory_mib, mine,
                            other.arrival) if o.tenant == self.r.tenant else standing_now(self.h, self.ledger, other)
                got = self._back[o.job_id] = claim(ok, o.tier, False)
            return got
        # its own holding is not ahead of it (within its group, only earlier arrivals are)
        return claim(within(self.h, self.ledger, o, other.group, o.compute_milli, o.gpu_memory_mib, mine + others,
                            other.arrival), o.tier, False)

    def surely_within(self, tenant: str, project: str, g: int) -> tuple[int, int]:
        """What a job of (tenant, project) and claim group g may ask, (milli, MiB), and be sure to stand within quota
        coming back after the preemptor alone (`victim_claim(.., self.mine)`), whatever its arrival: every quota of
        its account holds what its holders of group g and above hold (all of those ahead of it, and more: holdings
        are never negative), the preemptor's ask (whether or not it is ahead) and the job's. (-1, -1) when that
        much is already over a quota. Worked out once per search and account and group."""
        k = (tenant, project, g)
        got = self._slack.get(k)
        if got is None:
            r = self.r
            milli, memory = 1 << 62, 1 << 62
            for key, q in self._quota_keys(tenant, project):
                s = self.h.sums.get(key)
                m, mem = s.at_least(g) if s is not None else (0, 0)
                if tenant == r.tenant and (key[1] is None or key[1] == r.project):
                    m, mem = m + r.compute_milli, mem + r.gpu_memory_mib
                milli = min(milli, q.gpu_milli - m)
                if q.gpu_memory_mib is not None:
                    memory = min(memory, q.gpu_memory_mib - mem)
            got = self._slack[k] = (milli, memory) if milli >= 0 and memory >= 0 else (-1, -1)
        return got

    def _quota_keys(self, tenant: str, project: str):
        """`_quotas` for an account named by tenant and project."""
        out = []
        q = self.ledger.tenant_quota(tenant)
        if q is not None:
            out.append(((tenant, None), q))
        pa = self.ledger.accounts.get((tenant, project))
        if pa is not None and pa.quota is not None:
            out.append(((tenant, project), pa.quota))
        return out

    def rule(self, other: JobRecord, key: Claim, below: bool | None = None) -> str | None:
        """Whether `other` may be stopped for the preemptor of claim `key`, judged on its own (the plan's other
        victims aside): "tier" (its claim is below the preemptor's whatever its standing: `below`), "reclaim" (only
        while it stands beyond quota: `valid` checks that holds for the whole plan), or None. Its claim coming back
        is never above its within-quota one, so a "tier" victim's standing is not worked out. `below`: what
        `below(other, key)` says, when the caller knows it already."""
        if below if below is not None else self.below(other, key):
            return "tier"
        return "reclaim" if may_stop(key, self.victim_claim(other, self.mine)) else None

    @staticmethod
    def below(other: JobRecord, key: Claim) -> bool:
        """Whether `other`'s claim is below `key` whatever its standing (rule "tier"): a function of its tier and
        whether it is on its reservation alone, facts that stay as they are while it holds capacity."""
        return may_stop(key, claim(True, other.request.tier, other.reserved))

    def groups(self, key: Claim) -> list[tuple[str, int]]:
        """The (tenant, claim group) tables of the victim index that may hold a victim: groups whose weakest claim
        (borrowed) is below the preemptor's and, unless even their within-quota claim is, whose account holds more
        than its quota at that group (a superset: each job is judged on its own)."""
        out = []
        for (tenant, g), nodes in self.h.victims.by_group.items():
            if not nodes:
                continue
            if may_stop(key, claim_of_group(True, g)):
                out.append((tenant, g))
            elif may_stop(key, claim_of_group(False, g)) and self._group_over(tenant, g):
                out.append((tenant, g))
        return out

    def tables(self, key: Claim) -> frozenset[tuple[str, int]]:
        """`groups(key)` as a set, worked out once per claim."""
        got = self._tables.get(key)
        if got is None:
            got = self._tables[key] = frozenset(self.groups(key))
        return got

    def _group_over(self, tenant: str, g: int) -> bool:
        """Whether some job of (tenant, group g) could stand beyond quota: what its account holds at g and above
        (the preemptor's holding added when it is of the same tenant and at least as strong) is over a quota."""
        k = (tenant, g)
        got = self._over.get(k)
        if got is None:
            r = self.r
            extra = (r.compute_milli, r.gpu_memory_mib) if tenant == r.tenant and self.g >= g else (0, 0)
            got = False
            if self._accounts is None:  # each tenant's accounts, found in one pass over the sums for the search
                self._accounts = {}
                for (t, project), s in self.h.sums.items():
                    self._accounts.setdefault(t, []).append((project, s))
            for project, s in self._accounts.get(tenant, ()):
                q = self.ledger.tenant_quota(tenant) if project is None else (
                    self.ledger.accounts[(tenant, project)].quota if (tenant, project) in self.ledger.accounts
                    else None)
                if q is None:
                    continue
                m, mem = s.at_least(g)
                if m + extra[0] > q.gpu_milli or (q.gpu_memory_mib is not None and mem + extra[1] > q.gpu_memory_mib):
                    got = True
                    break
            self._over[k] = got
        return got

    def valid(self, chosen, v, key: Claim) -> bool:
        """Whether victim `v` (rule "reclaim") and the "reclaim" victims already `chosen` of its tenant all still
        stand beyond quota once every victim of the plan is gone: stopping more of one account's work brings it
        back within its quota, and a victim that would then stand within it may not be stopped."""
        jobs = self.h.jobs
        mine = self.mine
        rec = jobs[v.job_id]
        tenant = rec.request.tenant
        same = [jobs[c.job_id] for c in chosen if jobs[c.job_id].request.tenant == tenant] + [rec]
        gone = tuple((o.request.tenant, o.request.project, o.group, o.arrival, -o.held_milli, -o.held_memory_mib)
                     for o in same)
        # the account's work already told to stop (an earlier plan's victims, a drain's) is gone too: two plans of
        # one cycle must not each count the same overage and stop twice what brings the account back within quota
        # (the second victim would then stand within it, come back and stop its preemptor by tier: a storm)
        ids = {o.request.job_id for o in same}
        stopping = tuple((o.request.tenant, o.request.project, o.group, o.arrival, -o.held_milli, -o.held_memory_mib)
                         for o in (jobs.get(j) for j in self.h.stopping)
                         if o is not None and o.request.tenant == tenant and o.request.job_id not in ids
                         and o.migration is None)
        for i, o in enumerate(same):
            c = chosen[[x.job_id for x in chosen].index(o.request.job_id)] if o is not rec else v
            if c.rule != "reclaim":
                continue
            others = gone[:i] + gone[i + 1:] + stopping
            if not may_stop(key, self.victim_claim(o, mine, others)):
                return False
        return True


__all__ = ["Claim", "GROUPS", "Search", "claim", "group", "holding_on", "may_stop", "standing_at", "standing_now",
           "within"]
