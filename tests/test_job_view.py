from schemas.events import JobCompleted, JobPending, JobStarted, JobStopped, Reason
from streams.core.job_view import evolve
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
    from streams.core.job_view import evolve
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
    views = set()
    n = len(sched) + len(node)
    for at in combinations(range(n), len(sched)):
        a, b = iter(sched), iter(node)
        order = [req] + [next(a) if i in at else next(b) for i in range(n)]
        v = None
        for e in order:
            v = evolve(v, e)
        assert (v.state, v.reasons) == ("completed", ())
        views.add(v)
    assert len(views) == 1
    # and while it waits, the reason is the view's
    v = evolve(evolve(None, req), sched[0])
    assert (v.state, v.reasons) == ("pending", (Reason(code="NoNodes"),))
