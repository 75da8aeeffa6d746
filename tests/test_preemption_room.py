"""Preemption's arithmetic fit (`Room`) against the trial on a scratch view it replaces: on random nodes, holdings,
jobs and victim sets the two must agree, and a plan search using it must choose what the trial-based search chose."""
from __future__ import annotations

from dataclasses import replace

from hypothesis import event, given, settings
from hypothesis import strategies as st

from agents.scheduler.placement import FILTERS, gang_room
from agents.scheduler.preemption import (
    Plan, Room, Victim, _could_fit, disruption_order, fits, gang_room_after, plan_over, released,
)
from schemas.envelope import envelope
from schemas.events import Assignment, GpuHealth, JobRequested, Constraints, PlaceJob
from schemas.gpu_models import model
from streams.folds import node_view
from tests.builders import inventory

MODELS = ("A100-80GB", "H100-80GB", "T4")


@st.composite
def nodes(draw, name="n1"):
    """A node view with random holdings: whole cards, shares and (on MIG nodes) instances; some cards faulty."""
    m = draw(st.sampled_from(MODELS + ("A100-40GB",)))
    gpus = draw(st.integers(1, 8))
    mig = ["3g.20gb", "1g.5gb", "1g.5gb"] if m == "A100-40GB" and draw(st.booleans()) else None
    inv = inventory(name, model=m, gpus=gpus, cpu_milli=draw(st.sampled_from([4000, 16000, 64000])),
                    memory_mib=draw(st.sampled_from([16384, 65536, 262144])), mig=mig,
                    driver=draw(st.sampled_from(["535.0", "550.54.15"])))
    seq = 1
    view = node_view.evolve(None, envelope(inv, source=f"{name}/inventory", seq=seq, time_ms=1))
    mem = model(m).memory_mib
    free = {g.uuid: [1000, g.memory_mib] for g in inv.gpus}
    free_inst = [(g.uuid, i) for g in inv.gpus for i in g.mig_layout]
    cpu_left, host_left = inv.cpu_milli, inv.memory_mib
    for k in range(draw(st.integers(0, 12))):
        slices = []
        kind = draw(st.sampled_from(["share", "share", "whole", "whole", "mig"]))
        if kind == "mig" and free_inst:
            uuid, inst = free_inst.pop(draw(st.integers(0, len(free_inst) - 1)))
            slices.append(Assignment(gpu_uuid=uuid, milli=100, memory_mib=5120, mig_profile=inst.profile,
                                     mig_uuid=inst.uuid))
        elif kind == "whole":
            n = draw(st.sampled_from([1, 1, 2, 4]))
            for uuid, (milli, memory) in list(free.items()):
                if len(slices) < n and milli == 1000 and memory == mem and not mig:
                    slices.append(Assignment(gpu_uuid=uuid, milli=1000, memory_mib=mem))
        elif not mig:
            uuid = draw(st.sampled_from(sorted(free)))
            milli = draw(st.sampled_from([100, 250, 500, 750]))
            memory = draw(st.sampled_from([1024, 8192, 20480, 40960]))
            if free[uuid][0] >= milli and free[uuid][1] >= memory:
                slices.append(Assignment(gpu_uuid=uuid, milli=milli, memory_mib=memory))
        if not slices:
            continue
        cpu, host = draw(st.sampled_from([0, 500, 2000])), draw(st.sampled_from([0, 2048, 8192]))
        if cpu > cpu_left or host > host_left:
            continue
        cpu_left, host_left = cpu_left - cpu, host_left - host
        for a in slices:
            if not a.mig_uuid:
                free[a.gpu_uuid][0] -= a.milli
                free[a.gpu_uuid][1] -= a.memory_mib
        seq += 1
        view = node_view.evolve(view, envelope(PlaceJob(command_id=f"c{k}", job_id=f"v{k}", tenant="t", node=name,
                                                        assignments=tuple(slices), cpu_milli=cpu, memory_mib=host),
                                               source="scheduler", seq=seq, time_ms=2))
    for g in inv.gpus:
        if draw(st.integers(0, 9)) == 0:
            seq += 1
            view = node_view.evolve(view, envelope(GpuHealth(node=name, gpu_uuid=g.uuid, healthy=False, reason="x"),
                                                   source="scheduler", seq=seq, time_ms=3))
    return view


@st.composite
def jobs(draw):
    compute = draw(st.sampled_from([100, 250, 500, 1000, 2000, 2000, 3000, 4000]))
    models = draw(st.sampled_from([(), ("H100-80GB",), ("A100-80GB", "T4")]))
    return JobRequested(
        job_id="w", tenant="t2", compute_milli=compute, gpu_memory_mib=draw(st.sampled_from([1, 8, 20, 40, 80, 200]))
        * 1024, cpu_milli=draw(st.sampled_from([0, 1000, 8000])), memory_mib=draw(st.sampled_from([0, 4096, 32768])),
        gang=draw(st.booleans()),
        constraints=Constraints(models=models, min_driver=draw(st.sampled_from([None, "550.0"])),
                                   mig_allowed=draw(st.booleans())))


def victims(view, picks) -> list[Victim]:
    """Distinct candidate victims (as `_victims_on` gives them), now and then one no longer on the node."""
    ids = sorted(view.allocations) + ["gone"]  # a job no longer on the node frees nothing
    return [Victim(ids[i], view.node, 2, i % 2 == 0, 1000 * (i * 7 % 5), "tier")
            for i in sorted({p % len(ids) for p in picks})]


@settings(max_examples=1500, deadline=None)
@given(view=nodes(), job=jobs(), picks=st.lists(st.integers(0, 40), max_size=14))
def test_room_fits_exactly_where_the_trial_fits(view, job, picks):
    if any(f(view, job) for name, f in FILTERS if name != "HostResources"):
        return  # plan_over never asks about such a node
    vs = victims(view, picks)
    trial = fits(released(view, [v.job_id for v in vs]), job)
    room = Room(view, job)
    event(f"fits={trial} mig={room.mig} gang-sized={bool(room.whole)} victims>0={bool(vs)}")
    assert room.fits(vs) == trial
    if trial:
        assert _could_fit(view, job, vs)  # the cheap check stays a necessary condition


def _plan_over_by_trials(job, pairs, limit=None):
    """plan_over as it was before Room: every check a trial on a scratch view."""
    best, found = None, 0

    def ok(view, chosen):
        return _could_fit(view, job, chosen) and fits(released(view, [c.job_id for c in chosen]), job)

    for view, vs in pairs:
        if not vs or any(f(view, job) for name, f in FILTERS if name != "HostResources"):
            continue
        if not _could_fit(view, job, vs):
            continue
        chosen = []
        for v in sorted(vs, key=disruption_order):
            chosen.append(v)
            if ok(view, chosen):
                for extra in sorted(chosen, key=disruption_order, reverse=True):
                    rest = [c for c in chosen if c is not extra]
                    if ok(view, rest):
                        chosen = rest
                if not chosen:
                    break  # it fits with nobody stopped: no plan (preemption.least_disruptive)
                plan = Plan(view.node, tuple(sorted(chosen, key=disruption_order)))
                if best is None or plan.cost < best.cost:
                    best = plan
                found += 1
                break
        if limit is not None and found >= limit:
            break
    return best


@settings(max_examples=200, deadline=None)
@given(views=st.lists(nodes(), min_size=1, max_size=5), job=jobs(),
       picks=st.lists(st.lists(st.integers(0, 40), max_size=14), min_size=5, max_size=5),
       limit=st.sampled_from([None, 1, 2]))
def test_plan_over_chooses_what_the_trials_chose(views, job, picks, limit):
    views = [replace(v, node=f"n{i}") for i, v in enumerate(views)]
    pairs = [(v, victims(v, p)) for v, p in zip(views, picks)]
    assert plan_over(job, pairs, limit) == _plan_over_by_trials(job, pairs, limit)


@settings(max_examples=800, deadline=None)
@given(view=nodes(), job=jobs(), picks=st.lists(st.integers(0, 40), max_size=14),
       model_name=st.sampled_from(MODELS + ("A100-40GB",)), cpu_per=st.sampled_from([0, 500, 4000]),
       mem_per=st.sampled_from([0, 2048, 65536]))
def test_gang_room_after_is_the_room_on_a_scratch_view(view, job, picks, model_name, cpu_per, mem_per):
    ids = [v.job_id for v in victims(view, picks)]
    assert gang_room_after(view, job, model_name, cpu_per, mem_per, ids) == \
        gang_room(released(view, ids), job, model_name, cpu_per, mem_per)


@settings(max_examples=300, deadline=None)
@given(view=nodes(), job=jobs(), steps=st.lists(st.tuples(st.booleans(), st.integers(0, 40)), max_size=20),
       model_name=st.sampled_from(MODELS), cpu_per=st.sampled_from([0, 500]), mem_per=st.sampled_from([0, 2048]))
def test_gang_tally_follows_adds_and_take_backs(view, job, steps, model_name, cpu_per, mem_per):
    """A running tally (as the gang plan prunes its victims) always says what a fresh count of the same set says."""
    from agents.scheduler.preemption import GangTally

    ids = sorted(view.allocations) + ["gone"]
    tally, held = GangTally(view, job, model_name, cpu_per, mem_per), []
    for add, i in steps:
        j = ids[i % len(ids)]
        if add and j not in held:
            held.append(j)
            tally.add(j)
        elif not add and j in held:
            held.remove(j)
            tally.add(j, -1)
        assert tally.room() == gang_room_after(view, job, model_name, cpu_per, mem_per, held) == \
            gang_room(released(view, held), job, model_name, cpu_per, mem_per)
