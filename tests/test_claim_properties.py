"""Properties of the claim order and of storm-free preemption (#14 items 1-3), over random fleets, quotas (with and
without borrowing), tiers, reservations aside, and arrival orders. The node agents are modelled as prompt: a
`cmd.place` is answered by `job.started`, a `cmd.preempt` by `job.stopped` with a checkpoint a little later; nothing
completes, so the only thing that changes the state is the scheduler's own decisions and the arrivals.

- no job is preempted more than PreemptionConfig.max_preemptions times within protect_ms (protection on log time);
- preemption decisions (distinct preemptors) before convergence are bounded by the number of requests, and only a
  request that arrived, never a requeued victim within its quiet window, makes one (no chains);
- if A stopped B, B stops A only by reclaim, once work of A's own tenant at least as strong as A took capacity and
  put A beyond its quota -- or by any rule when A had reclaimed B and a third job has since stopped other work of
  B's account, so B comes back within its quota (antisymmetry in every state: nothing ends in these runs, so
  nothing else moves a claim);
- a converged state emits nothing on a tick.
"""
from __future__ import annotations

from collections import deque

from hypothesis import event, given, settings
from hypothesis import strategies as st

from agents.node.fleet import make_node
from agents.scheduler.core import Scheduler
from agents.scheduler.preemption import PreemptionConfig
from agents.scheduler.quota import Ledger
from schemas.events import TIER_RANK, JobStarted, JobStopped, PlaceJob, PreemptJob, QuotaSet, SchedulerTick, Tier
from tests.builders import Clock, job

TIERS = (Tier.INFERENCE, Tier.ONLINE_TRAINING, Tier.OFFLINE)
SIZES = ((250, 10), (500, 20), (1000, 40), (1000, 70), (2000, 140))  # (milli-CU, GiB): shares, a card, two cards

fleets = st.lists(st.sampled_from((1, 2, 4)), min_size=1, max_size=3)  # GPUs per node
quotas = st.dictionaries(st.sampled_from(("a", "b", "c")),
                         st.tuples(st.sampled_from((0, 500, 1000, 2000, 4000)), st.sampled_from((100, 150, 200))),
                         max_size=3)
requests = st.lists(st.tuples(st.sampled_from(("a", "b", "c")), st.sampled_from(TIERS), st.sampled_from(SIZES),
                              st.integers(0, 3)),  # gap before it arrives, in steps of the agents' loop
                    min_size=1, max_size=12)


def agent_answer(s, p, stop_delay_ms: int = 500):
    """A prompt node agent's answer to the scheduler's output `p`: (payload, source, delay in ms), or None. A
    `cmd.place` is answered by `job.started`, a `cmd.preempt` by `job.stopped` with a checkpoint."""
    if isinstance(p, PlaceJob):
        return JobStarted(job_id=p.job_id, node=p.node, command_id=p.command_id), f"{p.node}/job/{p.job_id}", 10
    if isinstance(p, PreemptJob):
        rec = s.jobs[p.job_id]
        place_cmd = next(part.command_id for part in rec.parts if part.node == p.node)
        return (JobStopped(job_id=p.job_id, node=p.node, command_id=place_cmd, checkpoint=f"ckpt:{p.job_id}"),
                f"{p.node}/job/{p.job_id}", stop_delay_ms)
    return None


def drive(fleet, quota, reqs, stop_delay_ms=500):
    """Run the scheduler with prompt agents until nothing is left to answer; returns (scheduler, clock, outputs
    in order with their log time, the number of requests). `fleet`: GPUs per node, or (GPUs, rack); `reqs`:
    (tenant, tier, (milli-CU, GiB)[, project], gap before it arrives in steps of the agents' loop)."""
    clock = Clock()
    s = Scheduler(ledger=Ledger(default_quota_milli=None), usage_tick_ms=10**12)
    cfg = s.preemption
    for i, spec in enumerate(fleet):
        gpus, rack = spec if isinstance(spec, tuple) else (spec, 0)  # GPUs, or (GPUs, rack)
        s.step(clock.env(make_node(f"n{i}", "A100-80GB", gpus, rack=f"rack-{rack}"), f"n{i}/inventory"))
    for tenant, (milli, pct) in sorted(quota.items()):
        s.step(clock.env(QuotaSet(tenant=tenant, gpu_milli=milli, overcommit_pct=pct), "operator"))
    log: list[tuple[int, object]] = []
    answers: deque = deque()
    pending_reqs = deque(reqs)
    n = 0
    steps = 0
    quiet_ticks = 0
    while pending_reqs or answers or quiet_ticks < 2:
        steps += 1
        assert steps < 5000, "no convergence"
        if not pending_reqs and not answers:
            # past every victim's quiet window (and protection): what it may do then, it does now
            clock.now += max(cfg.victim_quiet_ms, cfg.protect_ms) + 1
            env = clock.env(SchedulerTick(now_ms=clock.now), "tick")
            quiet_ticks += 1
        elif pending_reqs and (not answers or pending_reqs[0][-1] == 0):
            tenant, tier, (milli, gib), *project, _ = pending_reqs.popleft()
            n += 1
            env = clock.env(job(f"j{n}", tenant, milli, gib, tier=tier, duration=None, checkpoint_interval_s=60,
                                **({"project": project[0]} if project else {})), f"cli/j{n}", dt=1000)
        else:
            if pending_reqs:
                pending_reqs[0] = (*pending_reqs[0][:-1], pending_reqs[0][-1] - 1)
            payload, src, dt = answers.popleft()
            env = clock.env(payload, src, dt=dt)
        outs = s.step(env)
        if outs and isinstance(env.payload, SchedulerTick):
            quiet_ticks = 0  # it moved: settle again
        for o in outs:
            log.append((clock.now, o.payload))
            got = agent_answer(s, o.payload, stop_delay_ms)
            if got is not None:
                answers.append(got)
    return s, clock, log, n


@settings(max_examples=120, deadline=None)
@given(fleets, quotas, requests)
def test_preemption_is_bounded_antisymmetric_and_converges(fleet, quota, reqs):
    log = storm_free(fleet, quota, reqs)[2]
    event(f"preemptions: {min(sum(isinstance(p, PreemptJob) for _, p in log), 3)}+")


# multi-node gangs: small nodes over a few racks filled with offline work first, then gangs of four and eight cards
# among other requests (a gang's plan counts free cards on some of its nodes as well as the ones its victims free)
@st.composite
def gang_scenarios(draw):
    fleet = draw(st.lists(st.tuples(st.sampled_from((1, 2, 4)), st.integers(0, 3)), min_size=2, max_size=6))
    fill = []
    for gpus, _ in fleet:
        milli, gib = draw(st.sampled_from([s for s in SIZES if s[0] <= gpus * 1000]))
        fill += [(draw(st.sampled_from(("a", "b", "c"))), Tier.OFFLINE, (milli, gib), 0)] * (gpus * 1000 // milli)
    more = draw(st.lists(st.tuples(st.sampled_from(("a", "b", "c")), st.sampled_from(TIERS),
                                   st.sampled_from(SIZES + ((4000, 280), (8000, 560)) * 2), st.integers(0, 3)),
                         min_size=1, max_size=8))
    return fleet, fill + more


@settings(max_examples=150, deadline=None)
@given(gang_scenarios(), quotas)
def test_multi_node_gang_preemption_is_bounded_and_converges(scenario, quota):
    fleet, reqs = scenario
    log = storm_free(fleet, quota, reqs)[2]
    event(f"preemptions: {min(sum(isinstance(p, PreemptJob) for _, p in log), 3)}+")


def test_a_gang_claims_the_free_cards_it_counts_on_so_its_victims_do_not_take_them_back():
    """Found by the property above's search (a hypothesis example; 1,432 preemptions in 3,000 steps before the
    fix): a 4-card online-training gang over 1- and 2-card nodes full of offline shares stops work on two nodes; an
    inference share takes part of one freed card, so the gang plans again, counting a card already free on one node
    and stopping work on another. It claimed only the nodes it stopped work on, so its requeued victims took the free
    card back, and it stopped them again, for ever. It claims every node its plan takes cards on."""
    O, T, I = Tier.OFFLINE, Tier.ONLINE_TRAINING, Tier.INFERENCE
    reqs = ([("a", O, (250, 10), 0)] * 4 + [("a", O, (1000, 40), 0)] * 2 + [("a", O, (500, 20), 0)] * 6
            + [("a", T, (4000, 280), 0), ("a", I, (250, 10), 0)])
    s, clock, log, n = storm_free([(1, 0), (2, 0), (1, 0), (2, 0)], {}, reqs)
    places = {p.node for _, p in log if isinstance(p, PlaceJob) and p.job_id == "j13"}
    assert len(places) == 3 and s.jobs["j13"].phase == "running"
    assert sum(isinstance(p, PreemptJob) for _, p in log) <= 12


def test_a_preemptor_is_stopped_back_only_by_reclaim_once_its_own_tenants_stronger_work_puts_it_beyond_quota():
    """Found by the gang property's search (CI, 2026-12-06): c's online-training share j7 stops a's offline share j4
    by tier (c within its quota of 1,000); c's 1,000 milli inference j14 then takes a card (stopping a's j1), and c's
    quota goes to its stronger work first: j7 stands beyond it. After its quiet window, j4 (a has no quota: within)
    takes that capacity back by reclaim -- once; j7, beyond quota, does not stop j4 again."""
    O, T, I = Tier.OFFLINE, Tier.ONLINE_TRAINING, Tier.INFERENCE
    reqs = ([("a", O, (1000, 40), 0)] * 2 + [("a", O, (250, 10), 0)] * 4 + [("c", T, (250, 10), 3)]
            + [("a", I, (250, 10), 0)] * 6 + [("c", I, (1000, 40), 0)])
    s, clock, log, n = storm_free([(2, 0), (1, 0)], {"b": (0, 100), "c": (1000, 150)}, reqs)
    stops = [(p.reasons[0].data["for_job"], p.job_id, p.reasons[0].data["rule"]) for _, p in log
             if isinstance(p, PreemptJob)]
    assert ("j7", "j4", "tier") in stops and ("j14", "j1", "tier") in stops
    assert stops[-1] == ("j4", "j7", "reclaim") and stops.count(("j4", "j7", "reclaim")) == 1
    assert s.jobs["j4"].phase == "running" and s.jobs["j7"].phase == "pending"


def test_a_gang_stopped_on_several_nodes_at_once_is_preempted_once():
    """Found by the gang property's search (seed 13): an 8-card training gang over four nodes is stopped for an
    8-card inference gang -- one cmd.preempt on each of its nodes, in one decision, which the property once counted
    as four preemptions (more than max_preemptions) of one job."""
    O, T, I = Tier.OFFLINE, Tier.ONLINE_TRAINING, Tier.INFERENCE
    reqs = [("a", O, (250, 10), 0)] * 36 + [("a", I, (250, 10), 0), ("a", T, (8000, 560), 0), ("a", I, (8000, 560), 0)]
    s, clock, log, n = storm_free([(2, 0), (2, 0), (4, 0), (1, 0)], {}, reqs)
    stops = [(t, p.node) for t, p in log if isinstance(p, PreemptJob) and p.job_id == "j38"]
    assert len(stops) > PreemptionConfig.max_preemptions and len({t for t, _ in stops}) == 1
    assert s.jobs["j38"].preemptions == 1 and s.jobs["j39"].phase == "running"


def storm_free(fleet, quota, reqs):
    """The module's properties for one run (drive); returns drive's result."""
    s, clock, log, n = drive(fleet, quota, reqs)
    cfg = s.preemption
    preempts = [(t, p) for t, p in log if isinstance(p, PreemptJob)]
    # who stopped whom: if B stopped A, A stops B only once B's claim has fallen -- by reclaim (B stands beyond its
    # quota then), after work of B's tenant at least as strong as B took capacity -- or A's has risen: B reclaimed A
    # (A stood beyond its quota) and since then a third job stopped other work of A's account, so A comes back
    # within it (nothing ends in these runs, so nothing else moves a standing)
    stops = [(t, p.reasons[0].data["for_job"], p.job_id, p.reasons[0].data["rule"]) for t, p in preempts
             if p.reasons[0].code == "PreemptedFor"]
    first: dict[tuple[str, str], tuple[int, str]] = {}
    for t, a, b, rule in stops:
        first.setdefault((a, b), (t, rule))
    places = [(t, p.job_id) for t, p in log if isinstance(p, PlaceJob)]
    for t, a, b, rule in stops:
        t0, rule0 = first.get((b, a), (None, None))
        if t0 is None or t0 > t:
            continue
        ra = s.jobs[a].request
        if rule != "reclaim" and rule0 == "reclaim" and any(
                t0 < tp <= t and by != b and j != a and s.jobs[j].request.tenant == ra.tenant
                for tp, by, j, _ in stops):
            continue  # A's claim rose: its account lost other work to a third job after B reclaimed A
        assert rule == "reclaim", f"{b} stopped {a} and {a} stopped {b} by {rule}"
        rb = s.jobs[b].request
        assert any(t0 < tp <= t and s.jobs[j].request.tenant == rb.tenant
                   and TIER_RANK[s.jobs[j].request.tier] <= TIER_RANK[rb.tier] for tp, j in places), \
            f"{b} stopped {a} and {a} stopped {b} back, and nothing of {rb.tenant}'s at least as strong as {b} came"
    # no job preempted more than k times within T (a gang spread over nodes is told to stop on each of them, one
    # cmd.preempt a part, in one decision: one preemption)
    by_job: dict[str, set[int]] = {}
    for t, p in preempts:
        by_job.setdefault(p.job_id, set()).add(t)
    for j, stopped in by_job.items():
        times = sorted(stopped)
        for i in range(len(times)):
            within = [x for x in times[i:] if x - times[i] <= cfg.protect_ms]
            assert len(within) <= cfg.max_preemptions, (j, times)
    # preemption decisions are bounded by the requests, and no requeued victim in its quiet window makes one
    deciders = [p.reasons[0].data["for_job"] for _, p in preempts]
    decisions = len({(t, d) for (t, _), d in zip(preempts, deciders)})
    assert decisions <= n, (decisions, n)
    stopped_at: dict[str, int] = {}
    for (t, p), d in zip(preempts, deciders):
        if d in stopped_at:
            assert t - stopped_at[d] >= cfg.victim_quiet_ms, f"victim {d} preempted {p.job_id} in its quiet window"
        stopped_at[p.job_id] = t
    # a converged state emits nothing (drive ended on two quiet ticks past every window): nor does a later tick
    for dt in (1000, cfg.protect_ms + 1):
        clock.now += dt
        assert s.step(clock.env(SchedulerTick(now_ms=clock.now), "tick")) == []
    return s, clock, log, n


def test_a_victim_may_not_stop_its_preemptor_back_whatever_the_quota():
    """The issue's ping-pong: svc borrows (quota 500, cap 200%) a card for inference, batch (quota 1000) reclaims it
    for offline work; then svc's inference may not preempt batch's offline job by tier, on any later tick."""
    s, clock, log, n = drive([1], {"svc": (500, 200), "batch": (1000, 100)},
                             [("svc", Tier.INFERENCE, (1000, 70), 0), ("batch", Tier.OFFLINE, (1000, 70), 0)])
    preempts = [p for _, p in log if isinstance(p, PreemptJob)]
    assert [(p.job_id, p.reasons[0].data["for_job"]) for p in preempts] == [("j1", "j2")]
    for _ in range(5):
        clock.now += PreemptionConfig.victim_quiet_ms
        out = s.step(clock.env(SchedulerTick(now_ms=clock.now), "tick"))
        assert not any(isinstance(o.payload, PreemptJob) for o in out)


def test_quota_freed_for_a_waiting_job_is_not_taken_back_by_its_victims():
    """A tenant's inference waits on its own quota (500, held by its offline and training work) and stops both; the
    first to stop, requeued, does not take back the quota it freed while the other still stops -- it would, and the
    inference would stop it again on every tick, without end (found by the property above)."""
    s, clock, log, n = drive([1, 1], {"c": (500, 100)},
                             [("c", Tier.OFFLINE, (250, 10), 0), ("c", Tier.ONLINE_TRAINING, (250, 10), 0),
                              ("c", Tier.INFERENCE, (500, 20), 0)])
    got = [(type(p).__name__, p.job_id) for _, p in log if isinstance(p, (PlaceJob, PreemptJob))]
    assert got == [("PlaceJob", "j1"), ("PlaceJob", "j2"), ("PreemptJob", "j1"), ("PreemptJob", "j2"),
                   ("PlaceJob", "j3")]
    assert s.jobs["j3"].phase == "running" and s.jobs["j1"].phase == s.jobs["j2"].phase == "pending"


def test_two_reclaims_in_one_cycle_stop_only_what_brings_the_account_within_quota():
    """Found by the multi-node property's search in CI (2026-12-07): four 1-card nodes full of offline shares of
    tenants a and b; b's inference work then borrows (2,500 milli-CU held on a quota of 2,000). In one cycle two of
    a's requeued jobs each reclaimed from b -- j19 (1,000) and j21 (250) -- each plan counting b's whole overage, so
    b went 750 below its quota; j21, back within it, then stopped a's j7 by tier: j7 stopped j21 and j21 stopped j7.
    Work already told to stop counts as gone when a later plan asks whether a reclaim victim stands beyond quota."""
    O, I = Tier.OFFLINE, Tier.INFERENCE
    reqs = [("a", O, (250, 10), 0)] * 8 + [("b", O, (250, 10), 0)] * 4 + [("a", O, (250, 10), 0)] * 4 + [
        ("b", I, (250, 10), 0), ("b", I, (1000, 40), 0), ("b", I, (1000, 40), 0), ("a", I, (1000, 40), 0),
        ("b", I, (250, 10), 0)]
    s, _, log, _ = storm_free([(1, 0)] * 4, {"b": (2000, 150)}, reqs)
    reclaimed = [p.job_id for _, p in log if isinstance(p, PreemptJob) and p.reasons[0].data.get("rule") == "reclaim"]
    # (since the reclaim action stops its own account's work only to stand within quota, b's inference no longer
    # borrows by stopping b's offline shares, and a reclaims those instead: the storm is gone either way)
    assert reclaimed and {s.jobs[j].request.tenant for j in reclaimed} == {"b"}
    assert len(reclaimed) == len(set(reclaimed))


def test_a_job_that_reclaims_its_own_accounts_work_to_borrow_is_not_reclaimed_in_a_cycle():
    """One 4-card node; c (quota 500, cap 200 %) runs a 250 training share (j1) and asks for a 1,000 inference share
    (j2); a's offline j5 reclaims j2 (c beyond its quota), j1 stops j5 by tier, j2 stops its own account's j1 to come
    back borrowing, j5 reclaims j2 again: j5 -> j2 -> j1 -> j5 every protection window, for ever (drive's
    convergence bound); found by the single-node property's search on 2026-12-07, present at 5dd4a21. A job stops
    its own account's work only to stand within its quota, not to borrow: j2 waits, and the run converges."""
    T, I, O = Tier.ONLINE_TRAINING, Tier.INFERENCE, Tier.OFFLINE
    reqs = [("c", T, (250, 10), 0), ("c", I, (1000, 40), 0), ("a", I, (1000, 40), 0), ("b", I, (2000, 140), 0),
            ("a", O, (1000, 70), 0)]
    storm_free([4], {"b": (4000, 100), "a": (2000, 100), "c": (500, 200)}, reqs)
