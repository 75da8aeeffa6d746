"""CPU-only jobs (compute_milli 0: data preparation, evaluation, tokenizers beside the GPU work) and how the scheduler
places them: on the node whose free cards their CPU and memory strand least; plus the typical set and the whole-card
walk the FGD protocol's live row measures (docs/evaluation.md)."""
import pytest
from pydantic import ValidationError

from agents.scheduler.core import Scheduler
from agents.scheduler.node_index import NodeIndex
from agents.scheduler.placement import Placement, host_delta, place
from agents.scheduler.quota import open_ledger
from agents.scheduler.scoring import Workload
from schemas.envelope import envelope
from schemas.events import Assignment, JobCompleted, JobRequested, JobStarted, PlaceJob, Tier
from streams.folds import node_view
from tests.builders import Clock, inventory, job


def cpu_job(job_id="c1", cpu=8000, mem=16 * 1024, tenant="t1", **kw):
    return JobRequested(job_id=job_id, tenant=tenant, compute_milli=0, gpu_memory_mib=0, cpu_milli=cpu, memory_mib=mem,
                        **kw)


def test_a_cpu_only_request_is_both_zero_and_asks_for_cpu():
    assert cpu_job().cpu_only and not job().cpu_only
    assert cpu_job().isolation_asked == "shared"
    assert cpu_job(tier=Tier.INFERENCE).isolation_asked == "shared"  # not the inference tier's exclusive card
    for bad in ({"compute_milli": 0, "gpu_memory_mib": 1024}, {"compute_milli": 500, "gpu_memory_mib": 0}):
        with pytest.raises(ValidationError, match="both positive"):
            JobRequested(job_id="x", tenant="t", **bad)
    with pytest.raises(ValidationError, match="cpu_milli > 0"):
        cpu_job(cpu=0)
    for extra in ({"isolation": "exclusive"}, {"isolation": "mig"}, {"reservation_id": "r1"}):
        with pytest.raises(ValidationError, match="no card"):
            cpu_job(**extra)


def _node(name, gpus, cpu, used=()):
    """A node's view with `used` (card index, milli) taken by GPU jobs."""
    v = node_view.evolve(None, envelope(inventory(name, gpus=gpus, cpu_milli=cpu), source=f"{name}/inv", seq=1,
                                        time_ms=1))
    for i, milli in used:  # one command each, its own seq (a repeated seq is a duplicate the fold drops)
        cmd = PlaceJob(command_id=f"{name}{i}", job_id=f"{name}-{i}", tenant="t", node=name, cpu_milli=1000,
                       memory_mib=1024, assignments=(Assignment(gpu_uuid=v.inventory.gpus[i].uuid, milli=milli,
                                                                memory_mib=1024),))
        v = node_view.evolve(v, envelope(cmd, source="s", seq=10 + i, time_ms=2))
    return v


def _workload(index, shapes):
    w = Workload()
    for i, (compute, cpu) in enumerate(shapes):
        w.observe(job(f"w{i}", compute=compute, cpu_milli=cpu))
    w.fleet(index)
    return w


def test_a_cpu_only_job_goes_where_its_cpu_strands_no_card():
    """'roomy': 4 free cards, 64 cores; 'tight': 4 free cards, 12 cores; 'full': every card taken, 64 cores. The
    workload's jobs take a card and 8 cores each. 8 cores on 'tight' leave it 4 cores: no typical job fits any more and
    its 4 free cards are stranded; on 'roomy' 56 cores still host 7 such jobs (all 4 cards usable); on 'full' there is
    no free card to strand. The job never lands on 'tight', and the reason names the plugin and the measure."""
    views, index = {}, NodeIndex()
    for v in (_node("tight", 4, 12_000), _node("roomy", 4, 64_000),
              _node("full", 4, 64_000, used=[(i, 1000) for i in range(4)])):
        views[v.node] = v
        index.update(v)
    w = _workload(index, [(1000, 8000)] * 20)
    c = cpu_job(cpu=8000)
    assert host_delta(views["tight"], c, w) > 0 == host_delta(views["roomy"], c, w) == host_delta(views["full"], c, w)
    got = place(index, views, c, w)
    assert isinstance(got, Placement) and got.node in ("roomy", "full") and got.assignments == ()
    r = got.reasons[0]
    assert (r.code, r.plugin, r.data["cpu_only"], r.data["frag_delta_milli"]) == ("Placed", "HostFit", True, 0)
    # the only node with the host room is the tight one: placed there, and the measure says what it cost
    only = place(index, views, c, w, exclude=frozenset({"roomy", "full"}))
    assert isinstance(only, Placement) and only.node == "tight" and only.reasons[0].data["frag_delta_milli"] > 0
    # no node with the CPU: unschedulable, with the host plugin's reason
    none = place(index, views, cpu_job(cpu=128_000), w)
    assert not isinstance(none, Placement)
    assert any(x.code == "InsufficientCPU" for x in none.reasons)


def test_a_cpu_only_run_holds_host_room_and_bills_no_gpu_time():
    """Through the scheduler: placed with no card, the node's CPU is held (a second such job goes elsewhere), and the
    usage ticks bill GPU time for the GPU job only."""
    clock = Clock()
    s = Scheduler(ledger=open_ledger(), usage_tick_ms=1000)
    for name in ("a", "b"):
        s.step(clock.env(inventory(name, gpus=2, cpu_milli=10_000), f"{name}/inventory"))
    out = s.step(clock.env(cpu_job("c1", cpu=8000), "u/c1"))
    place1 = [o.payload for o in out if o.kind == "cmd.place"]
    assert len(place1) == 1 and place1[0].assignments == () and place1[0].cpu_milli == 8000
    out = s.step(clock.env(cpu_job("c2", cpu=8000), "u/c2"))
    place2 = [o.payload for o in out if o.kind == "cmd.place"]
    assert len(place2) == 1 and place2[0].node != place1[0].node  # 8 of 10 cores taken: no room for another 8
    for p in place1 + place2:
        s.step(clock.env(JobStarted(job_id=p.job_id, node=p.node, command_id=p.command_id), f"{p.node}/job/{p.job_id}"))
    out = s.step(clock.env(job("g1", compute=500, cpu_milli=1000), "u/g1"))
    g = [o.payload for o in out if o.kind == "cmd.place"][0]
    s.step(clock.env(JobStarted(job_id="g1", node=g.node, command_id=g.command_id), f"{g.node}/job/g1"))
    usage = []
    for p in place1 + place2 + [g]:  # each run ends 5 s later: its usage is accrued when it is released
        out = s.step(clock.env(JobCompleted(job_id=p.job_id, node=p.node, command_id=p.command_id),
                               f"{p.node}/job/{p.job_id}", dt=5000))
        assert any(o.kind == "cmd.release" for o in out)
        usage += [o.payload for o in out if o.kind == "usage.accrued"]
    assert usage and {u.job_id for u in usage} == {"g1"} and all(u.gpu_milli_ms > 0 for u in usage)


def test_typical_types_are_cpu_and_gpu_with_the_median_host_memory():
    """FGD's typical type is a request's CPU and GPU; host memory only caps how many fit a host, so one type's
    requests with different host memory are one type, and it carries their median."""
    w = Workload()
    for i, mem in enumerate([1024, 2048, 2048, 4096, 65536]):
        w.observe(job(f"j{i}", compute=1000, cpu_milli=4000, memory_mib=mem))
    w.observe(cpu_job("c", cpu=2000, mem=512))
    shapes = sorted(w.shapes("A100-80GB"), key=lambda s: s.cards)
    assert [(s.cards, s.cpu_milli, s.memory_mib) for s in shapes] == [(0, 2000, 512), (1, 4000, 2048)]


def test_whole_card_walk_takes_one_node_of_each_free_count_in_turn():
    views, index = {}, NodeIndex()
    specs = [("f1a", 1), ("f1b", 1), ("f1c", 1), ("f3a", 3), ("f3b", 3), ("f4a", 4)]
    for name, free in specs:
        v = _node(name, 4, 64_000, used=[(i, 1000) for i in range(4 - free)])
        views[name] = v
        index.update(v)
    assert list(index.whole_nodes_spread("A100-80GB", 1)) == ["f1a", "f3a", "f4a", "f1b", "f3b", "f1c"]
    assert list(index.whole_nodes_spread("A100-80GB", 3)) == ["f3a", "f4a", "f3b"]
    # every node with that many free cards, each once
    assert sorted(index.whole_nodes_spread("A100-80GB", 2)) == ["f3a", "f3b", "f4a"]
    assert [c.milli for c in views["f1a"].card_free()] == [0, 0, 0, 1000]


def test_a_fleet_change_that_moves_no_weight_keeps_the_scorers_results():
    """The epoch (what cached fragmentation is valid under) moves when the weighed shapes do, not whenever a host's
    inventory does: another node like the others changes no type's scarcity multiplier."""
    index = NodeIndex()
    views = {}
    for name in ("a", "b"):
        views[name] = _node(name, 4, 64_000)
        index.update(views[name])
    w = _workload(index, [(1000, 8000)] * 4)
    before = w.version()
    c = _node("c", 4, 64_000)
    index.update(c)
    w.fleet(index)
    assert w.version() == before
    d = node_view.evolve(None, envelope(inventory("d", gpus=4, cpu_milli=4000), source="d/inv", seq=1, time_ms=1))
    index.update(d)  # a node no typical job fits: the type's hosts are a smaller share of the cards
    w.fleet(index)
    assert w.version() != before


def test_one_tenants_cpu_only_jobs_are_bounded_by_its_quota_and_not_anothers():
    """CPU-only jobs charge no GPU quota; what keeps one tenant's many of them from taking every host's CPU (and
    stranding the cards other tenants' jobs need) is CPU_PER_CU milli-CPU per milli-CU of its quota's cap. acme has
    1,000 milli-CU (16,000 milli-CPU of CPU-only work); its third 8-core job waits with the reason and the numbers,
    globex's job is placed meanwhile, and acme's waiting job is placed once one of its own ends. The tally is what
    `rebuilt` derives afresh."""
    from agents.scheduler.holdings import rebuilt
    from agents.scheduler.quota import CPU_PER_CU
    from schemas.events import QuotaSet

    clock = Clock()
    s = Scheduler()
    for name in ("a", "b"):
        s.step(clock.env(inventory(name, gpus=2, cpu_milli=64_000), f"{name}/inventory"))
    for tenant in ("acme", "globex"):
        s.step(clock.env(QuotaSet(tenant=tenant, gpu_milli=1000, overcommit_pct=100), f"in/admin/{tenant}"))
    assert 1000 * CPU_PER_CU == 16_000
    placed = {}
    for i in range(3):
        out = s.step(clock.env(cpu_job(f"acme/c{i}", cpu=8000, tenant="acme"), f"u/acme/c{i}"))
        placed.update({o.payload.job_id: o.payload for o in out if o.kind == "cmd.place"})
        waiting = [o.payload for o in out if o.kind == "job.pending"]
    assert sorted(placed) == ["acme/c0", "acme/c1"]
    (w,) = waiting
    why = next(r for r in w.reasons if r.code == "CpuOnlyCapExceeded")
    assert (why.plugin, why.data["used_cpu_milli"], why.data["cap_cpu_milli"]) == ("Quota", 16_000, 16_000)
    assert s.h.host_cpu == {"acme": 16_000}
    out = s.step(clock.env(cpu_job("globex/g0", cpu=8000, tenant="globex"), "u/globex/g0"))
    assert [o.payload.job_id for o in out if o.kind == "cmd.place"] == ["globex/g0"]
    assert s.h.state() == rebuilt(s.h.nodes, s.h.jobs).state()
    p = placed["acme/c0"]
    s.step(clock.env(JobStarted(job_id=p.job_id, node=p.node, command_id=p.command_id), f"{p.node}/job/{p.job_id}"))
    out = s.step(clock.env(JobCompleted(job_id=p.job_id, node=p.node, command_id=p.command_id),
                           f"{p.node}/job/{p.job_id}", dt=1000))
    out += s.step(clock.env(job("x", tenant="globex", compute=100), "u/x", dt=s.full_cycle_ms))  # a later cycle
    assert "acme/c2" in [o.payload.job_id for o in out if o.kind == "cmd.place"]
    assert s.h.host_cpu == {"acme": 16_000, "globex": 8000}
