import pytest

from schemas.events import JobCompleted, JobPending, JobStarted, JobStopped, Reason
from streams.folds.job_view import evolve
from tests.builders import Clock, job


def test_lifecycle_and_preemption_count():
    c = Clock()
    v = evolve(None, c.env(job("j1"), "cli"))
    assert v.state == "pending"
    v = evolve(v, c.env(JobPending(job_id="j1", reasons=(Reason(code="InsufficientGPU"),)), "scheduler"))
    assert v.reasons[0].code == "InsufficientGPU"
    v = evolve(v, c.env(JobStarted(job_id="j1", node="n1", command_id="c1"), "n1/job/j1"))
    assert (v.state, v.node, v.reasons) == ("running", "n1", ())
    v = evolve(v, c.env(JobStopped(job_id="j1", node="n1", command_id="c2", progress_ms=500, checkpoint="k"),
                        "n1/job/j1"))
    assert (v.state, v.preemptions, v.checkpoint) == ("pending", 1, "k")
    v = evolve(v, c.env(JobCompleted(job_id="j1", node="n2", command_id="c3"), "n2/job/j1"))
    assert v.state == "completed"
    # a late stop after completion does not resurrect the job
    v2 = evolve(v, c.env(JobStopped(job_id="j1", node="n1", command_id="c9"), "n1/job/j1"))
    assert v2.state == "completed"


def test_duplicate_is_a_no_op():
    c = Clock()
    e = c.env(job("j1"), "cli")
    v = evolve(None, e)
    assert evolve(v, e) is v


def test_reports_of_an_interrupted_run_do_not_change_the_job():
    from schemas.envelope import envelope
    from schemas.events import JobCompleted, JobInterrupted, JobStarted
    from streams.folds.job_view import evolve
    from tests.builders import job

    v = evolve(None, envelope(job("j"), source="cli", seq=1, time_ms=1))
    v = evolve(v, envelope(JobStarted(job_id="j", node="n1", command_id="c1"), source="n1/job/j", seq=1, time_ms=2))
    v = evolve(v, envelope(JobInterrupted(job_id="j", node="n1", code="NodeLost", attempt=1, commands=("c1",)),
                           source="scheduler", seq=5, time_ms=3))
    assert (v.state, v.node, v.interruptions) == ("pending", "", 1)
    # n1 comes back and reports the old run completing: not the job's completion
    v = evolve(v, envelope(JobCompleted(job_id="j", node="n1", command_id="c1"), source="n1/job/j", seq=2, time_ms=4))
    assert v.state == "pending"
    v = evolve(v, envelope(JobStarted(job_id="j", node="n2", command_id="c9"), source="n2/job/j", seq=1, time_ms=5))
    v = evolve(v, envelope(JobCompleted(job_id="j", node="n2", command_id="c9"), source="n2/job/j", seq=2, time_ms=6))
    assert (v.state, v.node) == ("completed", "n2")


def test_a_moved_job_counts_a_migration_not_a_preemption_and_resumes():
    c = Clock()
    v = evolve(None, c.env(job("j1"), "cli"))
    v = evolve(v, c.env(JobStarted(job_id="j1", node="n1", command_id="c1"), "n1/job/j1"))
    v = evolve(v, c.env(JobStopped(job_id="j1", node="n1", command_id="m2", progress_ms=700, checkpoint="k",
                                   reason="migrated"), "n1/job/j1"))
    assert (v.state, v.preemptions, v.migrations, v.checkpoint) == ("pending", 0, 1, "k")
    v = evolve(v, c.env(JobStarted(job_id="j1", node="n2", command_id="c3"), "n2/job/j1"))
    assert (v.state, v.node, v.progress_ms) == ("running", "n2", 700)


def test_a_pending_read_after_the_run_it_preceded_started_does_not_stick():
    """Decisions and job events are separate topics: the live worker can read the scheduler's "no nodes" after the
    node's start. Every interleaving that keeps each source's order folds to the same view (a CI failure of
    test_integration_path's refold: the live table kept a stale NoNodes on a completed job)."""
    from itertools import combinations

    from schemas.envelope import envelope
    from schemas.events import JobCheckpointed

    req = envelope(job("j"), source="cli", seq=1, time_ms=1)
    sched = [envelope(JobPending(job_id="j", reasons=(Reason(code="NoNodes"),)), source="scheduler", seq=1,
                      time_ms=2)]
    node = [envelope(JobStarted(job_id="j", node="n1", command_id="c1"), source="n1/job/j", seq=1, time_ms=5),
            envelope(JobCheckpointed(job_id="j", node="n1", progress_ms=10), source="n1/job/j", seq=2, time_ms=6),
            envelope(JobCompleted(job_id="j", node="n1", command_id="c1"), source="n1/job/j", seq=3, time_ms=7)]
    views = []  # distinct views (a request's env is a dict: views are not hashable)
    n = len(sched) + len(node)
    for at in combinations(range(n), len(sched)):
        a, b = iter(sched), iter(node)
        order = [req] + [next(a) if i in at else next(b) for i in range(n)]
        v = None
        for e in order:
            v = evolve(v, e)
        assert (v.state, v.reasons) == ("completed", ())
        views += [] if v in views else [v]
    assert len(views) == 1
    # and while it waits, the reason is the view's
    v = evolve(evolve(None, req), sched[0])
    assert (v.state, v.reasons) == ("pending", (Reason(code="NoNodes"),))


def _merges(*streams):
    """Every interleaving of `streams` that keeps each one's own order (a source's records are read in order)."""
    streams = [s for s in streams if s]
    if not streams:
        yield []
        return
    for i, s in enumerate(streams):
        for tail in _merges(*streams[:i], s[1:], *streams[i + 1:]):
            yield [s[0], *tail]


def _node_loss(case: str, late: str, new_run_done: bool):
    """A run (placement c1, attempt 1) on n1 is ended by the scheduler (job.interrupted naming c1) and the job placed
    again (c2, attempt 2); n1's reports of c1 -- its start, a checkpoint, and an end it reports late (n1 comes back,
    or its report was still in flight) -- and the new run's reports can be read before or after the interruption.

    - "elsewhere": n1 is lost (NodeLost), the job is placed on n2; n1 reports c1's end late (`late`).
    - "same-node": a card of n1 fails (GpuFault): the job's process dies of it (a job.failed of c1 the scheduler
      heard after it had interrupted the run) and the job is placed on another card of n1 (the same source).
    - "moving": n1 is drained (a cmd.preempt, id p5, tells c1 to checkpoint and move) and lost before it stopped; it
      comes back and reports the checkpoint and the stop (naming p5, not c1) after the job runs on n2.

    Returns (the scheduler's decisions, each node's reports of the job, the scheduler's reading order: what
    happened). Decisions and job events are two topics; the job's events are one partition (keyed by job id), in
    which the nodes' reports come in any order that keeps each node's own."""
    from schemas.envelope import envelope
    from schemas.events import JobCheckpointed, JobFailed, JobInterrupted

    req = envelope(job("j"), source="cli", seq=1, time_ms=1)
    code = "GpuFault" if case == "same-node" else "NodeLost"
    sched = [envelope(JobPending(job_id="j", reasons=(Reason(code="NoNodes"),)), source="scheduler", seq=1,
                      time_ms=2),
             envelope(JobInterrupted(job_id="j", node="n1", code=code, attempt=1, billed_to_ms=20,
                                     checkpoint="ckpt:j:100" if case != "moving" else "",
                                     reasons=(Reason(code=code, nodes=("n1",)),), commands=("c1",)),
                      source="scheduler", seq=7, time_ms=40)]
    new_node = "n1" if case == "same-node" else "n2"
    new = [JobStarted(job_id="j", node=new_node, command_id="c2")] + (
        [JobCompleted(job_id="j", node=new_node, command_id="c2")] if new_run_done else [])
    if case == "elsewhere":
        end = {"completed": JobCompleted(job_id="j", node="n1", command_id="c1"),
               "failed": JobFailed(job_id="j", node="n1", reason="exit code 1", command_id="c1"),
               "stopped": JobStopped(job_id="j", node="n1", command_id="c1", progress_ms=150,
                                     checkpoint="ckpt:j:150", reason="agent restarted")}[late]
        old = [JobStarted(job_id="j", node="n1", command_id="c1"),
               JobCheckpointed(job_id="j", node="n1", progress_ms=100, checkpoint="ckpt:j:100", command_id="c1"),
               end]
        n1 = [envelope(p, source="n1/job/j", seq=i, time_ms=t) for i, (p, t) in enumerate(zip(old, (10, 20, 60)), 1)]
        n2 = [envelope(p, source="n2/job/j", seq=i, time_ms=t) for i, (p, t) in enumerate(zip(new, (45, 80)), 1)]
        return sched, [n1, n2], [req, sched[0], n1[0], n1[1], sched[1], n2[0], n1[2], *n2[1:]]
    if case == "same-node":
        old = [JobStarted(job_id="j", node="n1", command_id="c1"),
               JobCheckpointed(job_id="j", node="n1", progress_ms=100, checkpoint="ckpt:j:100", command_id="c1"),
               JobFailed(job_id="j", node="n1", reason="killed by signal 7", command_id="c1")]
        n1 = [envelope(p, source="n1/job/j", seq=i, time_ms=t)
              for i, (p, t) in enumerate(zip(old + new, (10, 20, 39, 45, 80)), 1)]
        return sched, [n1], [req, sched[0], n1[0], n1[1], sched[1], *n1[2:]]
    assert case == "moving"
    old = [JobStarted(job_id="j", node="n1", command_id="c1"),
           JobCheckpointed(job_id="j", node="n1", progress_ms=500, checkpoint="ckpt:j:500", command_id="p5"),
           JobStopped(job_id="j", node="n1", command_id="p5", progress_ms=500, checkpoint="ckpt:j:500")]
    n1 = [envelope(p, source="n1/job/j", seq=i, time_ms=t) for i, (p, t) in enumerate(zip(old, (10, 60, 60)), 1)]
    n2 = [envelope(p, source="n2/job/j", seq=i, time_ms=t) for i, (p, t) in enumerate(zip(new, (45, 80)), 1)]
    return sched, [n1, n2], [req, sched[0], n1[0], sched[1], n2[0], n1[1], n1[2], *n2[1:]]


@pytest.mark.parametrize("case, late", [("elsewhere", "completed"), ("elsewhere", "failed"),
                                        ("elsewhere", "stopped"), ("same-node", ""), ("moving", "")])
@pytest.mark.parametrize("new_run_done", [False, True], ids=["new-run-running", "new-run-completed"])
def test_reports_of_a_run_the_scheduler_interrupted_never_override_the_new_run_whatever_the_interleaving(
        case, late, new_run_done):
    """After a node loss (or a card fault) the scheduler interrupts the run (job.interrupted, on the decisions topic)
    and places the job again; the old node's reports of its run (job events, another topic) -- its start too, and an
    end it sends when it comes back -- can be read before or after the interruption and the new run's reports. The
    live worker reads the topics interleaved, the refold one after the other: every interleaving of the decisions
    with the job's events folds to the same view, and whatever order the nodes' reports reached the job's partition
    in, that view is the one reading in the scheduler's order gives: the new run's."""
    from dataclasses import fields

    sched, nodes, causal = _node_loss(case, late, new_run_done)
    req = causal[0]

    def fold(order):
        v = None
        for e in order:
            v = evolve(v, e)
        return v

    truth = fold(causal)
    new_node = "n1" if case == "same-node" else "n2"
    assert (truth.state, truth.node, truth.command_id, truth.started_ms, truth.ended_ms) == (
        ("completed", new_node, "c2", 45, 80) if new_run_done else ("running", new_node, "c2", 45, 0))
    assert (truth.interruptions, truth.preemptions, truth.migrations, truth.reasons) == (1, 0, 0, ())
    assert truth.checkpoint == sched[1].payload.checkpoint  # what the scheduler resumed the new run from
    wrong, split, n = [], [], 0
    for partition in _merges(*nodes):
        views = []  # distinct views (a Reason's data is a dict: views are not hashable)
        for order in _merges(sched, partition):
            n += 1
            v = fold([req, *order])
            views += [] if v in views else [v]
            # the job's every field; the view's own record of the runs lists them in the order the partition had
            # their first reports (the same live and refolded): compared within a partition, below
            differs = {f.name: getattr(v, f.name) for f in fields(v)
                       if f.name != "runs" and getattr(v, f.name) != getattr(truth, f.name)}
            if differs:
                wrong.append(([f"{e.source}:{e.kind}" for e in order], differs))
        if len(views) > 1:
            split.append([f"{e.source}:{e.kind}" for e in partition])
    assert n > 10
    assert not wrong, f"{len(wrong)} of {n} interleavings end elsewhere than the scheduler's order; first: {wrong[0]}"
    assert not split, f"the same partition folds to different views: {split}"
