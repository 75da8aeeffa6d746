"""A waiting job's explanation (placement._unschedulable) keeps each node's answer per view object and job shape
(NodeIndex.why_cache): whatever was kept from earlier explanations, it says what a pass without anything kept says."""
import random

from hypothesis import given, settings, strategies as st

from agents.scheduler import placement
from agents.scheduler.node_index import NodeIndex
from agents.scheduler.placement import Placement, Unschedulable, place
from agents.scheduler.scoring import Workload
from schemas.envelope import envelope
from schemas.events import Constraints, NodeCordon, PlaceJob, ReleaseJob, Tier
from streams.folds import node_view
from tests.builders import inventory, job

SHAPES = [(100, 8), (250, 20), (500, 40), (1000, 80), (2000, 160), (4000, 320), (8000, 640), (500, 150), (2000, 60)]
NODES = [("a0", "A100-80GB", 2), ("a1", "A100-80GB", 4), ("h0", "H100-80GB", 4), ("h1", "H100-80GB", 2),
         ("a2", "A100-80GB", 2), ("a3", "A100-80GB", 1), ("h2", "H100-80GB", 1), ("m0", "A100-80GB", 1)]
MIG = {"m0": ["1g.10gb"] * 7}
ISOLATION = (None, None, "shared", "exclusive", "mig")



def _ops(rng: random.Random, n: int) -> list[tuple]:
    """A run that fills the nodes (placements three times as often as anything else) and asks for explanations."""
    tiers = list(Tier)
    out = []
    for _ in range(n):
        kind = rng.choice(("place", "place", "place", "release", "cordon", "explain", "explain", "by hand"))
        if kind == "place":
            out.append(("place", rng.choice(SHAPES), rng.choice(tiers), rng.randint(1, 50), rng.choice(ISOLATION)))
        elif kind == "release":
            out.append(("release", rng.randrange(1000)))
        elif kind == "by hand":  # a view set without the index seeing it: what was kept for the old one is not read
            out.append(("by hand", rng.randrange(len(NODES))))
        elif kind == "cordon":
            out.append(("cordon", rng.randrange(len(NODES)), rng.random() < 0.5))
        else:
            out.append(("explain", rng.choice(SHAPES), rng.choice(tiers), rng.random() < 0.2, rng.choice(ISOLATION)))
    return out


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2 ** 32), limit=st.integers(1, 8))
def test_an_explanation_from_kept_answers_is_the_one_worked_out_afresh(seed, limit):
    old_limit = placement.EXPLAIN_LIMIT
    placement.EXPLAIN_LIMIT = limit  # small: the nodes beyond it are counted, not checked
    try:
        _run(_ops(random.Random(seed), 150))
    finally:
        placement.EXPLAIN_LIMIT = old_limit


def _run(ops):
    views, index, w = {}, NodeIndex(), Workload()
    seq = [0]

    def apply(name, payload, update=True):
        seq[0] += 1
        v = views[name] = node_view.evolve(views[name], envelope(payload, source="s", seq=seq[0], time_ms=seq[0]))
        if update:
            index.update(v)

    for name, model, gpus in NODES:
        views[name] = node_view.evolve(None, envelope(inventory(name, model=model, gpus=gpus, mig=MIG.get(name)),
                                                      source=f"{name}/inv", seq=1, time_ms=1))
        index.update(views[name])
    held: list[tuple[str, str]] = []
    for i, o in enumerate(ops):
        if o[0] == "place":
            (compute, gib), tier, duration, iso = o[1], o[2], o[3], o[4]
            j = job(f"p{i}", compute=compute, mem_gib=gib, tier=tier, duration=duration, isolation=iso)
            w.observe(j)
            got = place(index, views, j, w)
            if isinstance(got, Placement):
                for part in got.parts:
                    apply(part.node, PlaceJob(command_id=f"c{i}", job_id=j.job_id, tenant="t", node=part.node,
                                              assignments=part.assignments, cpu_milli=part.cpu_milli,
                                              memory_mib=part.memory_mib, duration_s=duration))
                    held.append((j.job_id, part.node))
        elif o[0] == "release" and held:
            j, name = held.pop(o[1] % len(held))
            apply(name, ReleaseJob(command_id=f"r{i}", job_id=j, node=name))
        elif o[0] == "by hand":  # cordoned behind the index's back: the node's answers change, its buckets do not
            name = NODES[o[1]][0]
            apply(name, NodeCordon(node=name, cordoned=not views[name].cordoned), update=False)
        elif o[0] == "cordon":
            apply(NODES[o[1]][0], NodeCordon(node=NODES[o[1]][0], cordoned=o[2]))
        elif o[0] == "explain":
            (compute, gib), tier, constrained, iso = o[1], o[2], o[3], o[4]
            kw = {"constraints": Constraints(models=("H100-80GB",))} if constrained else {}
            j = job(f"e{i}", compute=compute, mem_gib=gib, tier=tier, isolation=iso, **kw)
            got = place(index, views, j, w)
            if not isinstance(got, Unschedulable):
                continue
            kept = got.reasons  # read from what earlier explanations kept, and kept for later ones
            placement.EXPLAIN_MEMO = False
            try:
                again = place(index, views, j, w).reasons  # every node's answer worked out
            finally:
                placement.EXPLAIN_MEMO = True
            assert again == kept
