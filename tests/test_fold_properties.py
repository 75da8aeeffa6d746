"""Any delivery of per-source-ordered events, with duplicates, redeliveries and cross-source interleavings, folds to
the same view as the clean sequence."""
from hypothesis import given, settings
from hypothesis import strategies as st

from schemas.envelope import envelope
from schemas.events import (
    Assignment, GpuHealth, GpuSample, GpuTelemetry, NodeCordon, NodeHeartbeat, NodeLiveness, NodeRemoved, PlaceJob,
    ReleaseJob,
)
from streams.folds import job_view, node_view
from tests.builders import inventory

INV = inventory("n1", gpus=2)
CARDS = [g.uuid for g in INV.gpus]


def payloads_for(source: str):
    if source == "n1/inventory":
        return st.sampled_from([INV, inventory("n1", gpus=2, cpu_milli=32000)])
    if source == "n1/telemetry":
        sample = st.builds(lambda card, ecc, xid: GpuSample(gpu_uuid=card, util_pct=50, mem_used_mib=10,
                                                            mem_total_mib=100, ecc_uncorrected=ecc,
                                                            xid_errors=xid),
                           st.sampled_from(CARDS), st.sampled_from([0, 0, 0, 1]), st.sampled_from([(), (), (79,)]))
        return st.one_of(st.just(NodeHeartbeat(node="n1")),
                         st.lists(sample, min_size=1, max_size=2).map(
                             lambda s: GpuTelemetry(node="n1", samples=tuple(s))))
    if source == "op":
        return st.one_of(st.builds(lambda c, d: NodeCordon(node="n1", cordoned=c, drain=d), st.booleans(),
                                   st.booleans()),
                         st.builds(lambda card: GpuHealth(node="n1", gpu_uuid=card, healthy=True, reason="cleared"),
                                   st.sampled_from(CARDS)),
                         st.builds(lambda r: NodeRemoved(node="n1", removed=r), st.booleans()))
    if source == "n1/liveness":
        return st.builds(lambda t: NodeLiveness(node="n1", alive=False, last_heartbeat_ms=t),
                         st.integers(0, 3000))
    # the scheduler: placements and releases of a few jobs, of several attempts (a release of an older one leaves a
    # newer placement)
    return st.one_of(
        st.builds(lambda j, card, m, a: PlaceJob(command_id=f"c-{j}-{m}-{a}", job_id=j, tenant="t", node="n1",
                                                 assignments=(Assignment(gpu_uuid=card, milli=m, memory_mib=100),),
                                                 attempt=a),
                  st.sampled_from(["a", "b", "c"]), st.sampled_from(CARDS), st.integers(1, 1000), st.integers(0, 3)),
        st.builds(lambda j, a: ReleaseJob(command_id=f"r-{j}-{a}", job_id=j, node="n1", attempt=a),
                  st.sampled_from(["a", "b", "c"]), st.integers(0, 3)))


SOURCES = ["n1/inventory", "n1/telemetry", "op", "n1/liveness", "scheduler"]


@st.composite
def per_source_streams(draw):
    streams = {}
    for src in SOURCES:
        payloads = draw(st.lists(payloads_for(src), max_size=6))
        t = draw(st.integers(0, 1000))
        envs = []
        for i, p in enumerate(payloads, start=1):
            t += draw(st.integers(1, 500))
            envs.append(envelope(p, source=src, seq=i, time_ms=t))
        streams[src] = envs
    return streams


@st.composite
def delivery(draw, streams):
    """A random merge that keeps each source's order, plus duplicates of already-delivered records."""
    cursors = {s: 0 for s in streams}
    out = []
    while any(cursors[s] < len(streams[s]) for s in streams):
        live = [s for s in SOURCES if cursors[s] < len(streams[s])]
        src = draw(st.sampled_from(live))
        out.append(streams[src][cursors[src]])
        cursors[src] += 1
        if out and draw(st.integers(0, 3)) == 0:
            out.append(draw(st.sampled_from(out)))  # at-least-once: a redelivery, possibly stale
    return out


def fold(mod, envs):
    v = None
    for e in envs:
        v = mod.evolve(v, e)
    return v


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_node_view_is_independent_of_delivery(data):
    streams = data.draw(per_source_streams())
    clean = sorted((e for s in streams.values() for e in s), key=lambda e: (e.event_time_ms, e.source, e.seq))
    # the clean order must itself keep per-source order (times increase within a source)
    messy = data.draw(delivery(streams))
    assert fold(node_view, messy) == fold(node_view, clean)


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_job_view_ignores_duplicates_and_stale_redelivery(data):
    from tests.builders import job
    from schemas.events import JobStarted, JobCheckpointed, JobCompleted

    events = [envelope(job("j"), source="cli", seq=1, time_ms=1)]
    n = data.draw(st.integers(0, 4))
    for i in range(n):
        events.append(envelope(JobCheckpointed(job_id="j", node="n1", progress_ms=100 * (i + 1)),
                               source="n1/job/j", seq=2 + i, time_ms=10 + i))
    events.insert(1, envelope(JobStarted(job_id="j", node="n1", command_id="c1"), source="n1/job/j", seq=1, time_ms=5))
    events.append(envelope(JobCompleted(job_id="j", node="n1", command_id="c1"), source="n1/job/j", seq=99,
                           time_ms=1000))
    messy = []
    for e in events:
        messy.append(e)
        for _ in range(data.draw(st.integers(0, 2))):
            messy.append(data.draw(st.sampled_from(messy)))
    assert fold(job_view, messy) == fold(job_view, events)
