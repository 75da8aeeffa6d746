"""The node index kept incrementally must equal one rebuilt from the final views, and its lookups must return
exactly the nodes that have room -- after any sequence of placements, releases, faults, cordons and new nodes."""
from __future__ import annotations

from hypothesis import given, settings, strategies as st

from agents.scheduler.node_index import NodeIndex, _share_entry
from agents.scheduler.placement import place
from agents.scheduler.scoring import Workload
from schemas.envelope import envelope
from schemas.events import Assignment, GpuHealth, NodeCordon, PlaceJob, ReleaseJob
from schemas.gpu_models import model, share_for
from streams.folds import node_view
from tests.builders import inventory, job

NODES = (("a", "A100-80GB", 4, None), ("b", "H100-80GB", 2, None), ("c", "A100-80GB", 2, ["1g.10gb"] * 7),
         ("d", "H200", 3, None), ("e", "A100-80GB", 4, None))
SHARES = ((100, 8), (250, 20), (500, 40), (1000, 80), (300, 1), (70, 60), (100, 75))  # (milli of the card, GiB)

op = st.one_of(
    st.tuples(st.just("place"), st.integers(0, len(NODES) - 1), st.integers(0, 3), st.integers(0, len(SHARES) - 1)),
    st.tuples(st.just("release"), st.integers(0, 200)),
    st.tuples(st.just("fault"), st.integers(0, len(NODES) - 1), st.integers(0, 3), st.booleans()),
    st.tuples(st.just("cordon"), st.integers(0, len(NODES) - 1), st.booleans()),
)


class Fleet:
    def __init__(self):
        self.views: dict[str, node_view.NodeView] = {}
        self.index = NodeIndex()
        self.seq = 0
        self.jobs: list[tuple[str, str]] = []  # (job id, node)

    def apply(self, payload, node: str) -> None:
        self.seq += 1
        self.views[node] = node_view.evolve(self.views.get(node), envelope(payload, source="t", seq=self.seq,
                                                                            time_ms=self.seq))
        self.index.update(self.views[node])

    def add(self, i: int) -> None:
        name, m, gpus, mig = NODES[i]
        self.apply(inventory(name, m, gpus, mig=mig, rack=f"r{i % 2}"), name)

    def step(self, o) -> None:
        if o[0] == "place":
            name = NODES[o[1]][0]
            if name not in self.views:
                self.add(o[1])
                return
            v = self.views[name]
            cards = [c for c in v.card_free() if not c.mig]
            if not cards:
                return
            c = cards[o[2] % len(cards)]
            milli, gib = SHARES[o[3]]
            milli, mem = min(milli, c.milli), min(gib * 1024, c.memory_mib)
            if milli <= 0 or mem <= 0:
                return
            jid = f"j{self.seq}"
            self.apply(PlaceJob(command_id=jid, job_id=jid, tenant="t", node=name, cpu_milli=1000, memory_mib=1024,
                                assignments=(Assignment(gpu_uuid=c.uuid, milli=milli, memory_mib=mem),)), name)
            self.jobs.append((jid, name))
        elif o[0] == "release" and self.jobs:
            jid, name = self.jobs.pop(o[1] % len(self.jobs))
            self.apply(ReleaseJob(command_id=f"r{jid}", job_id=jid, node=name), name)
        elif o[0] == "fault":
            name = NODES[o[1]][0]
            if name in self.views:
                cards = self.views[name].cards()
                self.apply(GpuHealth(node=name, gpu_uuid=cards[o[2] % len(cards)].uuid, healthy=o[3],
                                     reason="xid 79"), name)
        elif o[0] == "cordon":
            name = NODES[o[1]][0]
            if name in self.views:
                self.apply(NodeCordon(node=name, cordoned=o[2]), name)


def rebuilt(views) -> NodeIndex:
    index = NodeIndex()
    for v in views.values():
        index.update(v)
    return index


def live(index: NodeIndex) -> dict[tuple, set[str]]:
    return {k: set(b) for k, b in index.buckets.items() if b}


def fitting(views, model_name: str, milli: int, mem: int) -> set[str]:
    return {n for n, v in views.items() if v.schedulable and any(
        c.model == model_name and c.healthy and not c.mig and c.milli >= milli and c.memory_mib >= mem
        for c in v.card_free())}


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, len(NODES) - 1), min_size=1, max_size=5), st.lists(op, min_size=5, max_size=80),
       st.integers(0, 20))
def test_incremental_index_equals_rebuilt(first, ops, early):
    f = Fleet()
    for i in first:
        f.add(i)
    for n, o in enumerate(ops):
        if n == early:  # the sorted share states are built on first use and kept current from then on
            list(f.index.share_nodes("A100-80GB", 1, 1))
        f.step(o)
    again = rebuilt(f.views)
    assert live(f.index) == live(again)
    assert f.index.keys == again.keys and f.index.models == again.models
    assert f.index.cu == again.cu and f.index.capacity_milli == again.capacity_milli
    # the sorted share states kept incrementally are those of the non-empty buckets, and a copy rebuilds them alike
    for m in f.index.models:
        states = sorted(_share_entry(m, k[2], k[3]) for k in live(again) if k[0] == "share" and k[1] == m)
        assert list(f.index._share_states(m)) == states
        assert list(f.index.copy()._share_states(m)) == states
        assert list(NodeIndex(buckets={k: dict(b) for k, b in f.index.buckets.items()})._share_states(m)) == states
    # no share bucket is left empty (lookups never walk a state nobody has)
    assert all(b for k, b in f.index.buckets.items() if k[0] == "share")
    # lookups: exactly the nodes with a card that has room, each state's nodes tightest first
    for m in f.index.models:
        for milli, gib in SHARES:
            need = share_for(milli, model(m)) if milli <= 1000 else milli
            got = list(f.index.share_nodes(m, need, gib * 1024))
            assert set(got) == fitting(f.views, m, need, gib * 1024) == set(again.share_nodes(m, need, gib * 1024))
        for n in range(1, 5):
            whole = {name for name, v in f.views.items() if v.schedulable and sum(
                1 for c in v.card_free() if c.model == m and c.healthy and not c.mig and c.milli == 1000
                and c.memory_mib == model(m).memory_mib) >= n}
            assert set(f.index.whole_nodes_spread(m, n)) == whole


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, len(NODES) - 1), min_size=2, max_size=5), st.lists(op, min_size=5, max_size=40),
       st.lists(st.tuples(st.sampled_from((100, 250, 500, 1000, 2000, 4000, 8000)), st.sampled_from((8, 20, 40, 80, 160)),
                          st.booleans(), st.sampled_from((1000, 60000, 200000))), min_size=1, max_size=6))
def test_cached_placement_equals_uncached(first, ops, shapes):
    """The same job shapes placed against the same views give the same answer with the fit cache warm or cold, so
    the cache never changes a decision or a reason."""
    f = Fleet()
    for i in first:
        f.add(i)
    for o in ops:
        f.step(o)
    w = Workload()
    jobs = [job(f"x{i}", compute=c, mem_gib=g, gang=gang, cpu_milli=cpu) for i, (c, g, gang, cpu) in enumerate(shapes)]
    for j in jobs:
        w.observe(j)
    for j in jobs:
        warm = [place(f.index, f.views, j, w) for _ in range(2)]
        f.index.fit_cache.clear()
        cold = place(f.index, f.views, j, w)
        assert warm[0] == warm[1] == cold
    # and after the fleet changes, what was cached for the old views is not used
    for o in ops[::-1]:
        f.step(o)
    for j in jobs:
        warm = place(f.index, f.views, j, w)
        f.index.fit_cache.clear()
        assert warm == place(f.index, f.views, j, w)


def test_gang_room_is_cached_per_part_size():
    """What a node can give one part of a gang depends on the host CPU and memory each card's part needs: a cached
    answer for a lighter gang must not let a heavier one through."""
    f = Fleet()
    f.add(0)
    f.add(4)  # two 4-card A100 nodes, one rack
    w = Workload()
    light = job("light", compute=8000, mem_gib=320, gang=True, cpu_milli=60000)
    heavy = job("heavy", compute=8000, mem_gib=320, gang=True, cpu_milli=200000)
    w.observe(light)
    got = place(f.index, f.views, light, w)
    assert len(got.parts) == 2 and got.reasons[1].data["level"] == "rack"
    warm = place(f.index, f.views, heavy, w)  # 25,000 CPU a card: two cards a node, four in all
    f.index.fit_cache.clear()
    assert warm == place(f.index, f.views, heavy, w) and not hasattr(warm, "parts")


def test_gang_tries_the_next_model_when_one_is_spread_too_wide():
    """Enough H200 cards in all, but only across data centers (beyond the job's max_spread): the gang goes to the
    next model that has room within one rack, instead of giving up."""
    views, index = {}, NodeIndex()
    for name, m, dc in (("h1", "H200", "dc-0"), ("h2", "H200", "dc-1"), ("a1", "A100-80GB", "dc-0"),
                        ("a2", "A100-80GB", "dc-0")):
        views[name] = node_view.evolve(None, envelope(inventory(name, m, 2, rack=f"{dc}-r", datacenter=dc),
                                                      source=f"{name}/inv", seq=1, time_ms=1))
        index.update(views[name])
    w = Workload()
    j = job("g", compute=4000, mem_gib=320, gang=True)  # 3 H200 cards (first choice) or 4 A100s
    w.observe(j)
    got = place(index, views, j, w)
    assert hasattr(got, "parts") and {p.node for p in got.parts} == {"a1", "a2"}
    assert got.reasons[1].data["level"] == "rack"


def test_fit_cache_is_bounded_per_node(monkeypatch):
    from agents.scheduler import placement
    monkeypatch.setattr(placement, "FIT_CACHE_SHAPES", 2)
    f = Fleet()
    for i in range(len(NODES)):
        f.add(i)
    w = Workload()
    jobs = [job(f"s{i}", compute=100 + 50 * i, mem_gib=4 + i) for i in range(6)]
    for j in jobs:
        w.observe(j)
    for j in jobs * 2:
        warm = place(f.index, f.views, j, w)
        assert all(len(entry[3]) <= 2 for entry in f.index.fit_cache.values())
        assert warm == place(f.index, f.views, j, w)


def test_intern_gives_one_object_per_key_and_starts_again_past_its_bound(monkeypatch):
    """The per-view memos are keyed by one object per job shape (hashed by identity, not field by field): equal
    keys give the same object, different keys different ones; past INTERNED_MAX the table starts again and the
    explanation's memo keyed by the old objects goes with it (no answer is found again under a stale key)."""
    from agents.scheduler import node_index

    idx = node_index.NodeIndex()
    a, b = idx.intern((1000, 40960, (), "shared")), idx.intern((1000, 40960, (), "shared"))
    assert a is b and a.key == (1000, 40960, (), "shared")
    assert idx.intern((500, 40960, (), "shared")) is not a
    monkeypatch.setattr(node_index, "INTERNED_MAX", 3)
    idx.why_cache["n0"] = ("view", {a: ("GpuFit", "InsufficientGPU")})
    idx.intern(("third",))
    assert idx.why_cache and idx.intern((1000, 40960, (), "shared")) is a  # three keys: still the same table
    fresh = idx.intern(("fourth",))  # a fourth: the table starts again
    assert idx.why_cache == {} and fresh.key == ("fourth",)
    assert idx.intern((1000, 40960, (), "shared")) is not a


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, len(NODES) - 1), min_size=1, max_size=5), st.lists(op, min_size=5, max_size=80),
       st.integers(1, 40), st.sampled_from((0, 1024, 64 * 1024)))
def test_the_gang_memo_equals_a_read_of_the_whole_fleet(first, ops, every, host_mem):
    """What a gang reads of the fleet (placement._gang_avail: per node, the whole cards one part could take) is kept
    and brought up to date from the nodes that changed since (#35 item 1): after any sequence of placements,
    releases, faults, cordons and new nodes, read every few steps, it equals a read of every node afresh -- also
    when more nodes changed than the change window keeps (node_index.CHANGES_KEPT, made small here)."""
    from agents.scheduler import node_index, placement
    f = Fleet()
    f.index.views = f.views  # the views the index is kept in step with, as Holdings sets it
    for i in dict.fromkeys(first):
        f.add(i)
    gang = job("g", compute=4000, mem_gib=320, gang=True, memory_mib=host_mem)
    keep = node_index.CHANGES_KEPT
    node_index.CHANGES_KEPT = 6
    try:
        for n, o in enumerate(ops):
            f.step(o)
            if n % every:
                continue
            for m in ("A100-80GB", "H100-80GB", "H200"):
                key = ("gang", m, gang.cpu_milli, gang.memory_mib)
                got = dict(placement._gang_avail(f.index, f.views, gang, m, key))
                fresh = NodeIndex()
                for v in f.views.values():
                    fresh.update(v)
                assert got == placement._gang_avail(fresh, f.views, gang, m, key), (m, n)
    finally:
        node_index.CHANGES_KEPT = keep
