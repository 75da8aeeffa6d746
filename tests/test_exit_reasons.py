"""Exit reasons and retries as users read them (docs/jobs.md, "Exit reasons and retries"): the job view's state and
reasons over every interleaving of the scheduler's decisions with the nodes' reports, and the text of `explain` and
`history` -- the exit, the attempt, "retrying at", "failed after N runs", and the program that was asked."""
from __future__ import annotations

from schemas.envelope import envelope
from schemas.events import (
    JobCompleted, JobFailed, JobPending, JobStarted, Reason,
)
from schemas.program import Mount
from streams.folds.exits import exit_label, exit_words, failure_text
from streams.folds.job_view import evolve
from tests.builders import job
from tests.test_job_view import _merges

from agents.cli import explain

T = 1_767_000_000_000


def _fold(order):
    v = None
    for e in order:
        v = evolve(v, e)
    return v


def test_exit_words_and_labels_for_every_code():
    assert exit_label("ExitCode", 3) == "ExitCode 3" and exit_words("ExitCode", 3) == "exit code 3"
    assert exit_label("Signal", None, 9) == "Signal 9 (SIGKILL)" and exit_words("Signal", None, 64) == \
        "killed by signal 64"
    assert exit_label("OOMKilled") == "OOMKilled" and "out of memory" in exit_words("OOMKilled")
    for code in ("ImageNotFound", "CommandNotFound", "ShareExceeded", "StartFailed", "VolumeUnavailable",
                 "Simulated"):
        assert exit_label(code) == code and f"({code})" in exit_words(code)
    # a report from before exit reasons reads as it always did: its reason alone
    assert exit_label(None) == "" and failure_text(None, "exit code 1") == "exit code 1"
    assert failure_text("ExitCode", "loss is NaN", 1) == "exit code 1: loss is NaN"


def _retry_streams(final: bool):
    """A job with retries=1: run c1 (attempt 1) fails with exit code 3; the scheduler answers BackOff; run c2
    (attempt 2) starts and, with `final`, fails too (the job fails), else completes."""
    req = envelope(job("j", retries=1), source="cli", seq=1, time_ms=1)
    backoff = Reason(code="BackOff", plugin="Retry", message="run 1 of 2 failed (exit code 3: nan); retrying from "
                     "the start at 20 ms", data={"failures": 1, "retries": 1, "retry_at_ms": 20})
    sched = [envelope(JobPending(job_id="j", reasons=(backoff,)), source="scheduler", seq=5, time_ms=11)]
    end = (JobFailed(job_id="j", node="n1", command_id="c2", reason="oom", code="OOMKilled", attempt=2) if final
           else JobCompleted(job_id="j", node="n1", command_id="c2"))
    reports = [JobStarted(job_id="j", node="n1", command_id="c1"),
               JobFailed(job_id="j", node="n1", command_id="c1", reason="nan", code="ExitCode", exit_code=3,
                         attempt=1),
               JobStarted(job_id="j", node="n1", command_id="c2"), end]
    node = [envelope(p, source="n1/job/j", seq=i, time_ms=t) for i, (p, t) in
            enumerate(zip(reports, (5, 10, 25, 40)), 1)]
    return req, backoff, sched, node


def test_a_failed_run_with_a_retry_left_waits_with_the_schedulers_back_off_whatever_the_reading_order():
    req, backoff, sched, node = _retry_streams(final=False)
    views = []
    for order in _merges(sched, node[:2]):  # up to the failure: the job waits out its back-off
        v = _fold([req, *order])
        assert (v.state, v.node, v.failures, v.reasons, v.ended_ms) == ("pending", "", 1, (backoff,), 0), order
        views += [] if v in views else [v]
    assert len(views) == 1
    # before the scheduler's reason is read, the view says it in its own words
    v = _fold([req, *node[:2]])
    assert v.reasons[0].code == "BackOff" and "run 1 of 2 failed (exit code 3: nan); retrying" in v.reasons[0].message


def test_a_job_a_retry_made_completes_and_one_whose_retries_are_spent_fails_whatever_the_reading_order():
    for final in (False, True):
        req, _, sched, node = _retry_streams(final)
        views = []
        for order in _merges(sched, node):
            v = _fold([req, *order])
            views += [] if v in views else [v]
        assert len(views) == 1, views
        (v,) = views
        assert (v.state, v.command_id, v.failures) == (("failed", "c2", 2) if final else ("completed", "c2", 1))
        if final:
            (why,) = v.reasons
            assert why.code == "failed" and why.message == "killed out of memory (OOMKilled): oom; failed after 2 runs"
            assert why.data == {"runs": 2, "exit": "OOMKilled"}
        else:
            assert v.reasons == ()


def test_without_retries_a_failure_reads_as_before():
    req = envelope(job("j"), source="cli", seq=1, time_ms=1)
    v = _fold([req, envelope(JobStarted(job_id="j", node="n1", command_id="c1"), source="n1/job/j", seq=1, time_ms=2),
               envelope(JobFailed(job_id="j", node="n1", command_id="c1", reason="exit code 1"), source="n1/job/j",
                        seq=2, time_ms=3)])
    assert (v.state, v.reasons) == ("failed", (Reason(code="failed", message="exit code 1"),))


def test_a_gangs_parts_failing_in_one_run_count_as_one_failure_and_a_request_read_late_still_counts():
    req = envelope(job("j", retries=1), source="cli", seq=1, time_ms=1)
    parts = [envelope(p, source="n1/job/j" if p.node == "n1" else "n2/job/j", seq=s, time_ms=t) for p, s, t in (
        (JobStarted(job_id="j", node="n1", command_id="c1"), 1, 2),
        (JobStarted(job_id="j", node="n2", command_id="c2"), 1, 2),
        (JobFailed(job_id="j", node="n1", command_id="c1", reason="x", code="Signal", signal=6, attempt=1), 2, 5),
        (JobFailed(job_id="j", node="n2", command_id="c2", reason="x", code="Signal", signal=15, attempt=1), 2, 6))]
    v = _fold([req, *parts])
    assert (v.state, v.failures) == ("pending", 1)
    # the failures read before the request: failed then, waiting once the request says a retry is left
    v = _fold([*parts, req])
    assert (v.state, v.failures, v.reasons[0].code) == ("pending", 1, "BackOff")


# ---------------------------------------------------------------- explain and history

def ev(kind: str, dt: int = 0, at: str = "", reasons=(), actor: str = "", **payload) -> dict:
    return {"time_ms": T + dt, "kind": kind, "node": at, "actor": actor, "payload": payload, "reasons": list(reasons)}


REQ = ev("job.requested", 0, actor="alice", compute_milli=1000, gpu_memory_mib=20480, tier="offline",
         project="llm", retries=2, image="localhost/py:3.11", command=["python", "train.py", "--lr", "3e-4", "a b"],
         env={"SEED": "1", "WANDB_MODE": "off line"}, workdir="/work",
         volumes=[Mount(volume="datasets", path="/data").model_dump(), {"volume": "scratch", "path": "/scratch",
                                                                        "read_only": False}])


def _place(attempt: int, dt: int, resume: str = "") -> dict:
    return ev("cmd.place", dt, "n1", node="n1", attempt=attempt, resume_from=resume, image="localhost/py:3.11",
              command=["python", "train.py"], assignments=[{"gpu_uuid": "g0", "milli": 1000, "memory_mib": 81920}])


def _backoff(n: int, dt: int, at_ms: int, words: str) -> dict:
    return ev("job.pending", dt, reasons=[{"code": "BackOff", "plugin": "Retry", "nodes": ["n1"],
                                           "message": f"run {n} of 3 failed ({words}); retrying from ckpt:7 at "
                                                      f"{at_ms} ms",
                                           "data": {"failures": n, "retries": 2, "retry_at_ms": at_ms}}])


FAILED_TWICE = [
    REQ, _place(1, 1000), ev("job.started", 2000, "n1", node="n1", command_id="c1"),
    ev("job.failed", 9000, "n1", node="n1", reason="loss is NaN", code="ExitCode", exit_code=3, attempt=1),
    _backoff(1, 9000, T + 19000, "exit code 3: loss is NaN"),
    _place(2, 19000, "ckpt:7"), ev("job.started", 20000, "n1", node="n1", command_id="c2"),
    ev("job.failed", 25000, "n1", node="n1", reason="", code="Signal", signal=9, attempt=2),
    _backoff(2, 25000, T + 45000, "killed by signal 9 (SIGKILL)"),
]


def test_explain_shows_the_program_asked_every_exit_and_when_it_is_retried():
    lines = explain.explain_lines("acme/train", FAILED_TWICE)
    text = "\n".join(lines)
    assert "  program: python train.py --lr 3e-4 'a b'  (in image localhost/py:3.11)" in lines
    assert "  env: SEED=1, WANDB_MODE='off line'" in lines  # values too: they are the tenant's own
    assert "  volumes: datasets:/data:ro, scratch:/scratch:rw" in lines and "  workdir: /work" in lines
    assert any(ln.startswith("  retries: 2 (a failed run is placed again after 10 s") for ln in lines)
    assert "job.failed  n1 (attempt 1): exit code 3: loss is NaN" in text
    assert "job.failed  n1 (attempt 2): killed by signal 9 (SIGKILL)" in text
    assert "[Retry] BackOff: run 2 of 3 failed (killed by signal 9 (SIGKILL)); retrying from ckpt:7 at " in text
    assert str(T + 45000) not in text  # the retry time said as a time
    assert explain.when(T + 45000) in text
    assert "failed after" not in text  # a retry is left


def test_history_says_failed_after_n_runs_once_the_retries_are_spent():
    events = FAILED_TWICE + [_place(3, 45000, "ckpt:7"), ev("job.started", 46000, "n1", node="n1", command_id="c3"),
                             ev("job.failed", 50000, "n1", node="n1", reason="CUDA out of memory",
                                code="OOMKilled", attempt=3)]
    # how it ended is the jobs list's word (its view's fold: gpupool.jobs), not counted again here
    row = {"state": "failed", "failures": 3, "retries": 2, "last_exit": "OOMKilled"}
    assert not any("failed after" in ln for ln in explain.history_lines("acme/train", events))  # no row: no claim
    lines = explain.history_lines("acme/train", events, standing=row)
    text = "\n".join(lines)
    assert "failed on n1 (attempt 3): killed out of memory (OOMKilled): CUDA out of memory" in text
    assert "        program: python train.py --lr 3e-4 'a b'  (in image localhost/py:3.11)" in lines
    assert lines[-2] == ("  failed after 3 runs (2 retries spent); the last: OOMKilled: killed out of memory "
                         "(OOMKilled): CUDA out of memory")
    assert "failed after 3 runs" in "\n".join(explain.explain_lines("acme/train", events, standing=row))
    # a retry that made it: the list says completed
    done = {"state": "completed", "failures": 2, "retries": 2, "last_exit": "Signal 9"}
    assert explain.history_lines("acme/train", FAILED_TWICE, standing=done)[-2] == "  completed after 2 failed run(s)"
    waiting = {"state": "pending", "failures": 2, "retries": 2, "last_exit": "Signal 9"}
    said = "\n".join(explain.explain_lines("acme/train", FAILED_TWICE, standing=waiting))
    assert "failed after" not in said and "completed after" not in said


def test_a_failure_from_before_exit_reasons_reads_as_it_did():
    events = [ev("job.requested", 0, compute_milli=100, gpu_memory_mib=1024, tier="offline"),
              ev("job.failed", 5000, "n1", node="n1", reason="exit code 1")]
    lines = explain.history_lines("acme/x", events)
    assert lines[1].endswith("  requested 100 milli-CU, 1 GiB GPU memory, tier offline, project default, isolation "
                             "shared (the tier's default)")
    assert lines[2].endswith("  failed on n1: exit code 1") and len(lines) == 4  # no program, no ending line


def test_the_program_is_read_from_the_placement_when_the_request_is_not_on_record():
    lines = explain.header("acme/x", [_place(1, 0)])
    assert lines == ["acme/x", "  program: python train.py  (in image localhost/py:3.11)"]


def test_the_jobs_table_says_the_exit_in_one_column():
    from agents.cli.views import jobs_table

    cols = ["job_id", "state", "last_exit", "failures", "retries", "retry_at_ms"]
    rows = [["a", "pending", "ExitCode 3", 1, 2, T + 10_000], ["b", "failed", "OOMKilled", 3, 2, 0],
            ["c", "running", "", 0, 0, 0], ["d", "failed", "", 1, 0, 0]]
    got_cols, got = jobs_table(cols, rows)
    assert got_cols == ["job_id", "state", "exit"]
    assert got[0][2] == f"ExitCode 3, run 1 of 3 failed, retrying at {explain.when(T + 10_000)}"
    assert got[1][2] == "OOMKilled, failed after 3 runs"
    assert got[2][2] == "-" and got[3][2] == "failed"
