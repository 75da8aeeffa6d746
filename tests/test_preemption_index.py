"""The victim index against what it stands for: after every step of random scheduler runs (every tier and size,
quotas with borrowing, reservations, preemption and requeue), the incrementally kept index equals one rebuilt from
the node views, every node where someone may be stopped for a pending job is among the nodes it names, and it names
them in the scheduler's node order (the order the walk over every node used, so plans and tie-breaks stay the same).
Who may be stopped is checked against a reference: each job's claim worked out by a walk over every job record
(claims.py's standings from scratch) -- also as the claim search keeps it per node view across steps. The inherited teardown replays the inputs into a fresh scheduler that never
syncs between steps: the same outputs show the lazy sync does not change decisions."""
from hypothesis import settings
from hypothesis.stateful import invariant

from agents.scheduler.claims import Search
from agents.scheduler.preemption import Victim, protected
from agents.scheduler.victims import VictimIndex, rebuilt
from schemas.events import TIER_RANK
from tests.test_scheduler_invariants import SchedulerMachine


def _reference_within(s, r, g, milli, memory, gone=(), plus=(), arrival=1 << 62):
    """A job's standing by the claim order, from a walk over every job record (not the holdings' sums): what its
    account's holders ahead of it hold (stronger groups, and its own group's earlier arrivals) -- less the jobs
    `gone`, plus (request, group, arrival) `plus` counted with what they asked -- and it, fit every quota of its
    account."""
    quotas = []
    q = s.ledger.tenant_quota(r.tenant)
    if q is not None:
        quotas.append((None, q))
    pa = s.ledger.accounts.get((r.tenant, r.project))
    if pa is not None and pa.quota is not None:
        quotas.append((r.project, pa.quota))
    for project, q in quotas:
        m = mem = 0
        for o in s.jobs.values():
            if o.placement is None or o.request.tenant != r.tenant or o.request.job_id in gone:
                continue
            if project is not None and o.request.project != project:
                continue
            if o.group > g or o.group == g and o.arrival < arrival:
                m, mem = m + o.held_milli, mem + o.held_memory_mib
        for req, gg, aa in plus:
            if req.tenant == r.tenant and (project is None or req.project == project) and (
                    gg > g or gg == g and aa < arrival):
                m, mem = m + req.compute_milli, mem + req.gpu_memory_mib
        if m + milli > q.gpu_milli or (q.gpu_memory_mib is not None and mem + memory > q.gpu_memory_mib):
            return False
    return True


def victims_by_walk(s, view, rec, key):
    """Who on the node may be stopped for `rec` of claim `key`, by a walk over the view's allocations and a
    reference standing: every job whose claim, were it to come back now with `rec` placed, is below `key`."""
    from agents.scheduler.claims import claim, may_stop

    out = []
    for j in view.allocations:
        other = s.jobs.get(j)
        if other is None or other.phase not in ("placed", "running") or other.placement is None or \
                other.hold is not None:
            continue
        o = other.request
        if protected(other.preempted_at, s.now_ms, s.preemption):
            continue
        if other.reserved:
            theirs = claim(True, o.tier, True)
        else:
            theirs = claim(_reference_within(s, o, other.group, o.compute_milli, o.gpu_memory_mib, gone={j},
                                             plus=((rec.request, rec.group, rec.arrival),),
                                             arrival=other.arrival), o.tier, False)
        if not may_stop(key, theirs):
            continue
        rule = "tier" if may_stop(key, claim(True, o.tier, other.reserved)) else "reclaim"
        since = max(other.started_ms, other.checkpoint_ms) if other.phase == "running" else s.now_ms
        out.append(Victim(o.job_id, view.node, TIER_RANK[o.tier], rule == "reclaim" or not theirs[0],
                          max(0, s.now_ms - since), rule))
    return out


class VictimIndexMachine(SchedulerMachine):
    @invariant()
    def index_is_the_rebuilt_index(self):
        s = self.s
        assert s.victim_index.state() == rebuilt(s.nodes, s.jobs).state()
        assert list(s.victim_index.pos) == list(s.nodes)

    @invariant()
    def index_names_every_node_with_a_victim_in_node_order(self):
        from agents.scheduler.claims import Search, claim

        s = self.s
        order = list(s.nodes)
        for rec in list(s.jobs.values()):
            if rec.phase != "pending":
                continue
            search = Search(s.h, s.ledger, rec)
            r = rec.request
            keys = {search.key(), *(search.key(m) for m in s.index.models)}
            for key in sorted(keys):
                # the preemptor's claim by the reference walk agrees with the search's (on what it asked)
                if key == search.key() and not (rec.reserved or rec.hold is not None):
                    assert key == claim(_reference_within(s, r, rec.group, r.compute_milli, r.gpu_memory_mib,
                                                          arrival=rec.arrival), r.tier, False)
                named = list(s._victim_nodes(search, key))
                assert named == [n for n in order if n in set(named)]
                for n in order:
                    view = s.nodes[n]
                    walk = victims_by_walk(s, view, rec, key)
                    assert sorted(s._victims_on(view, search, key), key=lambda v: v.job_id) == sorted(
                        walk, key=lambda v: v.job_id)
                    # and what the search keeps of them per view (Scheduler._stoppable_kept, _victim_ids_on: kept
                    # across these steps while the node's view and job records stand still) says the same
                    assert sorted(s._victim_ids_on(view, search, key)) == sorted(v.job_id for v in walk)
                    kept, _ = s._stoppable_kept(view, search, key)
                    assert [(o.request.job_id, rule) for o, rule in kept] == [
                        (o.request.job_id, rule) for o, rule in s._stoppable_on(view, search, key)]
                with_victims = [n for n in order if victims_by_walk(s, s.nodes[n], rec, key)]
                assert set(with_victims) <= set(named), (rec.request.job_id, key)
                # and the index is tight: a node it names holds work of a (tenant, group) the search picked
                picked = set(search.groups(key))
                for n in named:
                    assert any((o.request.tenant, o.group) in picked
                               for o in (s.jobs[j] for j in s.nodes[n].allocations) if o.hold is None)


class TooBigMachine(SchedulerMachine):
    """A job too big for every node's cards of every model (a multi-node gang) gets no single-node plan whatever is
    stopped: `_preempt_for` skips `plan_over` for it, and this holds the skip to what `plan_over` would say."""

    @invariant()
    def no_single_node_plan_for_a_job_too_big_for_every_node(self):
        from agents.scheduler.node_index import cards_needed
        from agents.scheduler.preemption import plan_over
        s = self.s
        for rec in list(s.jobs.values()):
            r = rec.request
            if rec.phase != "pending" or not s.index.models or not all(
                    cards_needed(r.compute_milli, r.gpu_memory_mib, m) > n for m, n in s.index.models.items()):
                continue
            # every job on every node offered as a victim: the most any plan could free
            everyone = {n: [Victim(j, n, 2, True, 0, "tier") for j in v.allocations] for n, v in s.nodes.items()}
            assert plan_over(r, ((s.nodes[n], vs) for n, vs in everyone.items())) is None


def test_views_set_by_hand_are_read_in_full():
    """A scheduler whose views were set by hand (never folded) finds the same victim nodes as the one that folded
    them: the next search reads every view."""
    from agents.scheduler.core import Scheduler
    from schemas.events import Tier
    from tests.builders import Clock, inventory, job, open_ledger

    clock, s = Clock(), Scheduler(ledger=open_ledger())
    for i in range(3):
        s.step(clock.env(inventory(f"n{i}", gpus=2), f"n{i}/inventory"))
    for k in range(6):
        s.step(clock.env(job(f"o{k}", compute=1000, mem_gib=80, tier=Tier.OFFLINE), f"cli/o{k}", dt=1))
    by_hand = Scheduler(nodes=dict(s.nodes), jobs=s.jobs)
    hi = by_hand.jobs["o0"].__class__(request=job("hi", tier=Tier.INFERENCE), arrival=99)
    mine, theirs = Search(by_hand.h, by_hand.ledger, hi), Search(s.h, s.ledger, hi)
    assert list(by_hand._victim_nodes(mine, mine.key())) == list(s._victim_nodes(theirs, theirs.key())) == [
        "n0", "n1", "n2"]
    assert by_hand.victim_index.state() == s.victim_index.state() == rebuilt(s.nodes, s.jobs).state()
    assert VictimIndex().state() == ({}, {})


VictimIndexMachine.TestCase.settings = settings(max_examples=40, stateful_step_count=40, deadline=None)
TestVictimIndex = VictimIndexMachine.TestCase
TooBigMachine.TestCase.settings = settings(max_examples=20, stateful_step_count=40, deadline=None)
TestTooBig = TooBigMachine.TestCase


def test_protected_and_stopping_work_is_no_victim():
    """A job preempted max_preemptions times within the window is protected; a stopping one is on its way out:
    neither is offered, on the node that still holds them, and the walk agrees."""
    from agents.scheduler.core import Scheduler
    from schemas.events import Tier
    from tests.builders import Clock, inventory, job, open_ledger

    clock, s = Clock(), Scheduler(ledger=open_ledger())
    s.step(clock.env(inventory("n0", gpus=4), "n0/inventory"))
    for k in range(4):
        s.step(clock.env(job(f"o{k}", compute=1000, mem_gib=80, tier=Tier.OFFLINE), f"cli/o{k}", dt=1))
    s.jobs["o1"].preempted_at = (s.now_ms - 3, s.now_ms - 2, s.now_ms - 1)
    s.jobs["o2"].phase = "stopping"
    hi = s.jobs["o0"].__class__(request=job("hi", tier=Tier.INFERENCE), arrival=99)
    search = Search(s.h, s.ledger, hi)
    got = s._victims_on(s.nodes["n0"], search, search.key())
    assert sorted(v.job_id for v in got) == ["o0", "o3"]
    assert got == victims_by_walk(s, s.nodes["n0"], hi, search.key())
    s.now_ms += s.preemption.protect_ms + 1  # protection runs out
    assert sorted(v.job_id for v in s._victims_on(s.nodes["n0"], search, search.key())) == ["o0", "o1", "o3"]


def test_views_set_by_hand_then_folded_are_read_in_full():
    """Views set by hand, then changed through the fold before any search (so the index has met every node): the
    index still reads them all on the next search."""
    from agents.scheduler.core import Scheduler
    from schemas.events import NodeCordon, Tier
    from tests.builders import Clock, inventory, job, open_ledger

    clock, s = Clock(), Scheduler(ledger=open_ledger())
    for i in range(2):
        s.step(clock.env(inventory(f"n{i}", gpus=2), f"n{i}/inventory"))
    for k in range(4):
        s.step(clock.env(job(f"o{k}", compute=1000, mem_gib=80, tier=Tier.OFFLINE), f"cli/o{k}", dt=1))
    by_hand = Scheduler(nodes=dict(s.nodes), jobs=s.jobs, applied=dict(s.applied), out_seq=s.out_seq)
    for i in range(2):  # every node folded once more, in reverse order, before any search
        by_hand.step(clock.env(NodeCordon(node=f"n{1 - i}", cordoned=False), "operator", dt=1))
    hi = s.jobs["o0"].__class__(request=job("hi", tier=Tier.INFERENCE), arrival=99)
    search = Search(by_hand.h, by_hand.ledger, hi)
    assert list(by_hand._victim_nodes(search, search.key())) == ["n0", "n1"]
    assert by_hand.victim_index.state() == rebuilt(by_hand.nodes, by_hand.jobs).state()


def test_lazy_victims_work_each_node_out_once_and_only_when_asked():
    from agents.scheduler.victims import LazyVictims

    asked = []
    lazy = LazyVictims(iter(["n2", "n0"]), lambda n: asked.append(n) or ([n] if n != "n0" else []))
    assert list(lazy) == ["n2", "n0"] and len(lazy) == 2 and asked == []
    assert lazy["n2"] == ["n2"] and lazy.get("n2") == ["n2"] and asked == ["n2"]
    assert lazy.get("n0", ()) == [] and lazy.get("n9", ()) == () and "n9" not in lazy
    assert asked == ["n2", "n0"]
