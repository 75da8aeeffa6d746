"""The pieces of placement that are easiest to get subtly wrong, checked by hand-computed numbers."""
from agents.scheduler import topology
from agents.scheduler.node_index import NodeIndex
from agents.scheduler.placement import Placement, place
from agents.scheduler.scoring import Shape, Workload, fragmentation
from schemas.envelope import envelope
from schemas.events import Assignment, PlaceJob, ReleaseJob
from streams.folds import node_view
from tests.builders import inventory, job


def test_fragmentation_by_hand():
    shapes = (Shape(500, 1, 1000, 1024, 1), Shape(1000, 1, 1000, 1024, 1))
    # free 1500: the 500-type can use both cards (0 fragment); the 1000-type only the full one (500 fragment)
    assert fragmentation([1000, 500, 0], 64000, 1 << 20, shapes) == 500
    # CPU for one pod only: the 500-type can use at most one card's worth -> 500 stranded for it too
    assert fragmentation([1000, 500, 0], 1000, 1 << 20, shapes) == 1000
    # no CPU at all: every free milli is a fragment for both types, and stranded (counted again, weight 2)
    assert fragmentation([1000, 500], 0, 1 << 20, shapes) == 3000 + 3000
    # memory alone can strand too
    assert fragmentation([1000, 500], 64000, 512, shapes) == 6000


def test_slowdown_estimates():
    assert topology.slowdown_pct("nvlink", "nvlink") == 0
    assert topology.slowdown_pct("rack", "nvlink") == 1100  # 300 GB/s against 25 GB/s
    assert topology.slowdown_pct("datacenter", "rack") == 108
    assert "~1100% slower all-reduce" in topology.explain("rack", "nvlink", 2)
    assert topology.allowed("rack", "datacenter") and not topology.allowed("datacenter", "rack")


def _views(*specs):
    views, index = {}, NodeIndex()
    for name, used in specs:
        v = node_view.evolve(None, envelope(inventory(name, gpus=2), source=f"{name}/inv", seq=1, time_ms=1))
        for i, milli in enumerate(used):
            if milli:
                cmd = PlaceJob(command_id=f"{name}{i}", job_id=f"{name}-{i}", tenant="t", node=name,
                               assignments=(Assignment(gpu_uuid=v.inventory.gpus[i].uuid, milli=milli,
                                                       memory_mib=1024),))
                v = node_view.evolve(v, envelope(cmd, source="s", seq=len(v.applied) + 10, time_ms=2))
        views[name] = v
        index.update(v)
    return views, index


def test_score_prefers_less_fragmentation_over_tightest_fit():
    # x: cards free [1000, 600]; y: [1000, 1000]. The workload is mostly 500-milli jobs. Best fit would put a
    # 400-milli job on x's 600 (leaving 200 no typical job can use); FGD's measure puts it on y (600 left, usable).
    views, index = _views(("x", (0, 400)), ("y", (0, 0)))
    w = Workload()
    for i in range(9):
        w.observe(job(f"w{i}", compute=500))
    w.observe(job("w9", compute=1000))
    got = place(index, views, job("new", compute=400), w)
    assert isinstance(got, Placement) and got.node == "y"
    # y: only the 1000-type (weight 1 of 10) loses the 600 left on the card -> +60; x would be +140
    assert got.reasons[0].data["frag_delta_milli"] == 60
    # scoring one node only (k=1) takes the first in bucket order, whatever it costs
    first = place(index, views, job("new", compute=400), w, k=1)
    assert isinstance(first, Placement)


def test_index_moves_nodes_between_buckets():
    views, index = _views(("x", (0, 0)))
    assert list(index.whole_nodes_spread("A100-80GB", 2)) == ["x"]
    v = views["x"]
    cmd = PlaceJob(command_id="c", job_id="j", tenant="t", node="x",
                   assignments=(Assignment(gpu_uuid=v.inventory.gpus[0].uuid, milli=1000, memory_mib=1024),))
    v = node_view.evolve(v, envelope(cmd, source="s2", seq=1, time_ms=3))
    index.update(v)
    assert list(index.whole_nodes_spread("A100-80GB", 2)) == []
    assert list(index.whole_nodes_spread("A100-80GB", 1)) == ["x"]
    assert index.capacity_milli == 2000


def test_live_weights_scale_with_how_scarce_a_shapes_hosts_are():
    """Three 96-core nodes and one 128-core node of 8 cards: a 120-core 8-card shape has 8 of 32 cards that could
    host it, so it weighs 4x its count; a shape every node hosts keeps its count (x 1000)."""
    index = NodeIndex()
    for i, cpu in enumerate((96_000, 96_000, 96_000, 128_000)):
        v = node_view.evolve(None, envelope(inventory(f"n{i}", gpus=8, cpu_milli=cpu), source=f"n{i}/inv", seq=1,
                                            time_ms=1))
        index.update(v)
    w = Workload()
    for i in range(6):
        w.observe(job(f"s{i}", compute=500, cpu_milli=4_000))
    for i in range(2):
        w.observe(job(f"b{i}", compute=8000, mem_gib=600, cpu_milli=120_000))
    w.fleet(index)
    small, big = (500, 10 * 1024, 4_000, 0), (8000, 600 * 1024, 120_000, 0)
    assert w.multiplier(small) == 1000 and w.multiplier(big) == 4000
    # the 8-card shape's 16 of 19 cards of demand fall on 8 of 32 cards: 3.4 times their share, so it also weighs its
    # 8 cards per job (oversubscribed hosts)
    assert w.weight == 6 * 1000 + 2 * 4000 * 8
    before = w.version()
    w.fleet(index)
    assert w.version() == before  # same inventories: nothing recomputed, cached fragmentation still good
    index.update(node_view.evolve(None, envelope(inventory("n4", gpus=8, cpu_milli=128_000), source="n4/inv", seq=1,
                                                 time_ms=1)))
    w.fleet(index)
    assert w.version() != before and w.multiplier(big) == 40 * 1000 // 16


def test_a_rare_many_card_shape_is_typical_because_it_holds_the_gpu_demand():
    """198 one-card requests and 2 eight-card ones: by count the 8-card shape is 1 % (left out at 99 % coverage), by
    cards it is 16 of 214. It is a typical shape, so breaking the only 8-card node for a one-card job is priced."""
    views, index = {}, NodeIndex()
    for name, cards in (("small", 2), ("small2", 2), ("small3", 2), ("big", 8)):
        views[name] = node_view.evolve(None, envelope(inventory(name, gpus=cards), source=f"{name}/inv", seq=1,
                                                      time_ms=1))
        index.update(views[name])
    w = Workload()
    for i in range(198):
        w.observe(job(f"s{i}", compute=1000))
    for i in range(2):
        w.observe(job(f"b{i}", compute=8000))
    assert sorted(s.cards for s in w.shapes("A100-80GB")) == [1]  # no fleet known: no pressure to judge
    w.fleet(index)  # 8 of the 14 cards could host the 8-card shape; its 16 of 214 cards of demand are >= 1/10 of 8/14
    assert sorted(s.cards for s in w.shapes("A100-80GB")) == [1, 8]
    got = place(index, views, job("new", compute=1000), w)
    assert isinstance(got, Placement) and got.node.startswith("small")
    forced = place(index, views, job("new", compute=1000), w, exclude=frozenset({"small", "small2", "small3"}))
    assert isinstance(forced, Placement) and forced.node == "big"
    # the 8-card shape loses the big node's other 7 cards: a fragmentation increase, where the small node's is not
    assert forced.reasons[0].data["frag_delta_milli"] > 0 >= got.reasons[0].data["frag_delta_milli"]


def test_a_light_job_keeps_off_the_cpu_limited_4_card_node_when_many_card_demand_oversubscribes_it(monkeypatch):
    """20 two-card nodes with CPU to spare, one 4-card node with 32 cores and 128 GiB, one 8-card node; heavy one-card
    jobs (11.3 cores, 48 GiB), light shares, three 4-card jobs (32 cores) and twelve 8-card jobs. The 4-card node's
    CPU hosts only two heavy jobs, so the capped measure already counts two of its cards as lost to them and a light
    share there looks cheaper than on a two-card node; the 4-card shape's weight (3 of 105 jobs, x 52/12 for its
    hosts) does not outweigh that. The many-card demand on its hosts (the 4- and 8-card nodes, 12 of 52 cards) is 108
    of 192.3 cards, 2.4 times their share: the 4- and 8-card shapes weigh their cards too, and the share goes to a
    two-card node. With the rule off (a factor no load reaches) the share takes the 4-card node."""
    from agents.scheduler import scoring
    views, index = {}, NodeIndex()
    specs = [(f"two{i}", 2, 104_000, 512) for i in range(20)] + [("four", 4, 32_000, 128), ("eight", 8, 64_000, 256)]
    for name, cards, cpu, gib in specs:
        views[name] = node_view.evolve(None, envelope(inventory(name, gpus=cards, cpu_milli=cpu,
                                                                memory_mib=gib * 1024), source=f"{name}/inv", seq=1,
                                                      time_ms=1))
        index.update(views[name])

    def workload():
        w = Workload()
        for prefix, n, compute, cpu, mem in (("h", 60, 1000, 11_300, 48 * 1024), ("l", 30, 810, 3_152, 5_600),
                                             ("f", 3, 4000, 32_000, 128 * 1024), ("e", 12, 8000, 64_000, 256 * 1024)):
            for i in range(n):
                w.observe(job(f"{prefix}{i}", compute=compute, cpu_milli=cpu, memory_mib=mem))
        return w

    light = job("new", compute=810, cpu_milli=3_152, memory_mib=5_600)
    w = workload()
    got = place(index, views, light, w, k=50)
    assert sorted((s.cards, s.weight) for s in w.shapes("A100-80GB") if s.cards > 1) == [(4, 4 * 3 * 4333),
                                                                                         (8, 8 * 12 * 6500)]
    assert isinstance(got, Placement) and got.node.startswith("two")
    monkeypatch.setattr(scoring, "OVERSUBSCRIBED", 1000)
    w = workload()
    before = place(index, views, light, w, k=50)
    assert sorted((s.cards, s.weight) for s in w.shapes("A100-80GB") if s.cards > 1) == [(4, 3 * 4333), (8, 12 * 6500)]
    assert isinstance(before, Placement) and before.node == "four"


def test_expected_free_from_the_per_view_cache_is_what_a_fresh_pass_says():
    """ExpectedFree (a waiting job's explanation) reads each node's sorted free times from a cache kept per view
    object (NodeIndex.free_at_cache): the same answer as a pass over the cards, and a new view is read afresh."""
    from agents.scheduler.placement import _expected_free
    views, index = _views(("x", (1000, 0)), ("y", (1000, 1000)))
    big = job("big", compute=2000, mem_gib=160)  # two whole cards
    order = ["A100-80GB"]
    fresh = _expected_free(views, big, order, ["x", "y"])
    assert _expected_free(views, big, order, ["x", "y"], index) == fresh  # fills the cache
    assert _expected_free(views, big, order, ["x", "y"], index) == fresh  # read from it
    assert set(index.free_at_cache) == {"x", "y"}
    # x frees its held card: the cache must not answer for the old view
    v = views["x"]
    held = next(iter(v.allocations))
    v = node_view.evolve(v, envelope(ReleaseJob(command_id="r", job_id=held, node="x"), source="s3", seq=1,
                                     time_ms=5))
    views["x"] = v
    index.update(v)
    assert "x" not in index.free_at_cache
    after = _expected_free(views, big, order, ["x", "y"], index)
    assert after == _expected_free(views, big, order, ["x", "y"]) and after != fresh
    assert after.nodes == ("x",) and after.data["at_ms"] == 0
