"""The pieces of placement that are easiest to get subtly wrong, checked by hand-computed numbers."""
from agents.scheduler import topology
from agents.scheduler.node_index import NodeIndex
from agents.scheduler.placement import Placement, place
from agents.scheduler.scoring import Shape, Workload, fragmentation
from schemas.envelope import envelope
from schemas.events import Assignment, PlaceJob
from streams import node_view
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
    assert list(index.whole_nodes("A100-80GB", 2)) == ["x"]
    v = views["x"]
    cmd = PlaceJob(command_id="c", job_id="j", tenant="t", node="x",
                   assignments=(Assignment(gpu_uuid=v.inventory.gpus[0].uuid, milli=1000, memory_mib=1024),))
    v = node_view.evolve(v, envelope(cmd, source="s2", seq=1, time_ms=3))
    index.update(v)
    assert list(index.whole_nodes("A100-80GB", 2)) == []
    assert list(index.whole_nodes("A100-80GB", 1)) == ["x"]
    assert index.capacity_milli == 2000
