"""The jobs list (`/api/jobs`, `gpupool jobs`) is a query over what the sink stored: each job's state as its view's
fold decided it (gpupool.jobs, from the job view's changelog) and its timeline from the events. Its state must be the
job's, also when node agents report runs the scheduler has already interrupted. Real scheduler outputs, stored by the
real sink into an embedded ClickHouse, listed by the API's query."""
from __future__ import annotations

import pytest

from agents.scheduler.core import Scheduler
from agents.scheduler.quota import open_ledger
from schemas.events import GpuHealth, JobStarted
from streams.edge.api import jobs_sql
from streams.edge.sink import Sink
from tests.builders import Clock, inventory, job
from tests.job_store import Changelog, chdb_sink, store as store_envs


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    client, sink = chdb_sink(tmp_path_factory.mktemp("jobsch"))
    yield client, sink
    client.close()


_CHANGELOG = Changelog()  # the worker's job table, kept over this module's tests (a job stored in two calls)


def _store(sink: Sink, envs, part: int = 0) -> None:
    store_envs(sink, _CHANGELOG, envs, part)


def _faulted_run():
    """A 3-card job on a 4-card node whose four cards fail one after another (one telemetry record's faults): each
    fault interrupts the run it lands on and the job is placed again on the cards left, until none is; then the node
    agent reports, late, the starts of the runs that were interrupted meanwhile."""
    c = Clock()
    s = Scheduler(ledger=open_ledger())
    logged = [c.env(inventory("n0", "A100-80GB", gpus=4), "n0/inventory"), c.env(job("t/j", "t", 3000, 100), "cli/j")]
    for e in logged[:2]:
        logged += s.step(e)
    first = next(o.payload for o in logged if o.kind == "cmd.place")
    started = c.env(JobStarted(job_id="t/j", node="n0", command_id=first.command_id), "n0/job/t/j", dt=100)
    logged += [started] + s.step(started)
    for i in range(4):
        e = c.env(GpuHealth(node="n0", gpu_uuid=f"GPU-n0-{i}", healthy=False, reason="ecc"), f"n0/health/GPU-n0-{i}")
        logged += [e] + s.step(e)
    late = [o.payload for o in logged if o.kind == "cmd.place" and o.payload.command_id != first.command_id]
    assert late, "the faults should have placed the job again before the last card failed"
    for p in late:
        e = c.env(JobStarted(job_id="t/j", node=p.node, command_id=p.command_id), "n0/job/t/j", dt=50)
        logged += [e] + s.step(e)
    return s, logged


def test_a_job_interrupted_while_its_node_reports_late_starts_is_listed_pending_like_the_scheduler_says(store):
    client, sink = store
    s, logged = _faulted_run()
    assert s.phase_of("t/j") == "pending"
    _store(sink, logged)
    sql, params = jobs_sql(None)
    res = client.query(sql, parameters=params)
    [row] = [dict(zip(res.column_names, r)) for r in res.result_rows if r[0] == "t/j"]
    assert row["state"] == "pending" and row["cards"] == 0 and row["nodes"] == ""
    # negative control: the old rule -- the last start, stop or interruption, whichever run it was of -- says running
    turns = [e.kind for e in logged if e.kind in ("job.started", "job.stopped", "job.interrupted")
             and getattr(e.payload, "job_id", "") == "t/j"]
    assert turns[-1] == "job.started"


def _lost_node_run(job_id: str, out_seq: int | None = None):
    """A job placed on one of two 1-card nodes and started; then its node is lost. Returns the clock, the scheduler,
    everything logged, the first placement and the loss's outputs (`out_seq`: the scheduler's seq before the loss)."""
    from schemas.events import NodeLiveness

    c = Clock()
    s = Scheduler(ledger=open_ledger())
    logged = [c.env(inventory("n0", "A100-80GB", gpus=1), "n0/inventory"),
              c.env(inventory("n1", "A100-80GB", gpus=1), "n1/inventory"), c.env(job(job_id, "t", 1000, 40), "cli/j")]
    for e in list(logged):
        logged += s.step(e)
    first = next(o.payload for o in logged if o.kind == "cmd.place")
    e = c.env(JobStarted(job_id=job_id, node=first.node, command_id=first.command_id), f"{first.node}/job/{job_id}",
              dt=100)
    logged += [e] + s.step(e)
    if out_seq is not None:
        s.out_seq = out_seq
    e = c.env(NodeLiveness(node=first.node, alive=False, last_heartbeat_ms=c.now + 500), f"{first.node}/liveness",
              dt=3000)
    out = s.step(e)
    return c, s, logged + [e] + out, first, out


def test_a_late_completion_of_a_run_on_a_lost_node_does_not_end_the_job_running_elsewhere(store):
    """The job runs on n0; n0 is lost, the scheduler interrupts the run and places the job on n1, where it starts;
    then n0 comes back and reports the old run completed. The scheduler ignores it (the job still runs); the list
    must too (the view does: streams/folds/job_view.py), and not show an end time."""
    from schemas.events import JobCompleted

    client, sink = store
    c, s, logged, first, out = _lost_node_run("t/k")
    (again,) = [o.payload for o in out if o.kind == "cmd.place"]
    assert again.node != first.node
    for p, src in ((JobStarted(job_id="t/k", node=again.node, command_id=again.command_id), f"{again.node}/job/t/k"),
                   (JobCompleted(job_id="t/k", node=first.node, command_id=first.command_id),
                    f"{first.node}/job/t/k")):
        e = c.env(p, src, dt=100)
        logged += [e] + s.step(e)
    assert s.phase_of("t/k") == "running"
    _store(sink, logged, part=1)  # a partition of its own: the sink drops a batch at offsets already written
    sql, params = jobs_sql(None)
    res = client.query(sql, parameters=params)
    [row] = [dict(zip(res.column_names, r)) for r in res.result_rows if r[0] == "t/k"]
    assert row["state"] == "running" and row["nodes"] == again.node, row
    assert row["elapsed_s"] > 0


def test_history_and_explain_list_one_step_of_the_scheduler_in_the_order_it_decided(store):
    """A node loss interrupts a run, bills it, releases it and places the job again: four records of the scheduler
    at one log time, on four topics. `gpupool history` and `explain` list them in the scheduler's order (its seq),
    not by topic (which put the new placement before the interruption that caused it) nor by event id as text
    ("scheduler:100" before "scheduler:99")."""
    from streams.edge.api import EXPLAIN_SQL, HISTORY_SQL

    client, sink = store
    _, _, logged, _, out = _lost_node_run("t/h", out_seq=97)  # the loss's records cross from two digits to three
    mine = [o for o in out if o.payload.__dict__.get("job_id") == "t/h"]
    assert {o.kind for o in mine} >= {"job.interrupted", "usage.accrued", "cmd.release", "cmd.place"}
    assert len({o.event_time_ms for o in mine}) == 1 and mine[0].seq < 100 <= mine[-1].seq
    _store(sink, logged, part=7)  # a partition of its own (the sink drops a batch at offsets already written)
    at = mine[0].event_time_ms
    rows = client.query(HISTORY_SQL, parameters={"job": "t/h"}).result_rows
    assert [r[1] for r in rows if r[0] == at] == [o.kind for o in mine]
    shown = {"cmd.place", "cmd.release", "job.interrupted"}  # what the scheduling table holds of these
    rows = client.query(EXPLAIN_SQL, parameters={"job": "t/h"}).result_rows
    assert [r[1] for r in rows if r[0] == at] == [o.kind for o in mine if o.kind in shown]


def test_a_reservation_hold_is_not_listed_as_a_job(store):
    """A reservation's hold is charged to the quota while it holds (quota.changed records name it "RES#hold"), but
    nobody submitted it: the jobs list shows the job that took the reservation, not a pending pseudo-job submitted
    in 1970 (found on the live stack)."""
    from schemas.events import ReservationRequested, SchedulerTick

    client, sink = store
    c = Clock()
    s = Scheduler(ledger=open_ledger())
    logged = [c.env(inventory("n0", "A100-80GB", gpus=2), "n0/inventory"),
              c.env(ReservationRequested(reservation_id="t/r1", tenant="t", tier="online-training", compute_milli=1000,
                                         gpu_memory_mib=40 * 1024, start_ms=c.now + 1000, end_ms=c.now + 600_000),
                    "cli/reserve")]
    for e in list(logged):
        logged += s.step(e)
    tick = c.env(SchedulerTick(now_ms=c.now + 2000), "scheduler/tick", dt=2000)
    logged += s.step(tick)  # the scheduler's own input, stored nowhere
    assert any(o.payload.__dict__.get("job_id") == "t/r1#hold" for o in logged), "the hold should be charged"
    e = c.env(job("t/on-r1", "t", 1000, 40, tier="online-training", reservation_id="t/r1"), "cli/on-r1", dt=100)
    logged += [e] + s.step(e)
    _store(sink, logged, part=8)
    sql, params = jobs_sql("t")
    res = client.query(sql, parameters=params)
    ids = [r[0] for r in res.result_rows]
    assert "t/on-r1" in ids and not any("#hold" in j for j in ids), ids


def test_elapsed_is_the_time_its_runs_ran_and_the_rest_is_waiting(store):
    """A job runs 3 s on n0, n0 is lost (the run is interrupted, billed to its last heartbeat), it is placed again
    on n1 and runs 2 s more to completion; then n0 comes back and reports the old run's start and stop, late. The
    list says it ran 5 s (sacct's Elapsed, summed over its runs) and waited the rest of its life -- not 5 s plus
    the requeue, nor from its first start to its end."""
    from schemas.events import JobCompleted, JobStopped

    client, sink = store
    c, s, logged, first, out = _lost_node_run("t/e")
    (again,) = [o.payload for o in out if o.kind == "cmd.place"]
    submitted = logged[2].event_time_ms
    e = c.env(JobStarted(job_id="t/e", node=again.node, command_id=again.command_id), f"{again.node}/job/t/e",
              dt=1000)
    logged += [e] + s.step(e)
    restarted = c.now
    for p, src in ((JobCompleted(job_id="t/e", node=again.node, command_id=again.command_id), f"{again.node}/job/t/e"),
                   (JobStarted(job_id="t/e", node=first.node, command_id=first.command_id), f"{first.node}/job/t/e"),
                   (JobStopped(job_id="t/e", node=first.node, command_id=first.command_id), f"{first.node}/job/t/e")):
        e = c.env(p, src, dt=2000)
        logged += [e] + s.step(e)
    assert s.phase_of("t/e") == "done"
    _store(sink, logged, part=3)
    sql, params = jobs_sql(None)
    res = client.query(sql, parameters=params)
    [row] = [dict(zip(res.column_names, r)) for r in res.result_rows if r[0] == "t/e"]
    started = next(x.event_time_ms for x in logged if x.kind == "job.started")
    lost = next(x.event_time_ms for x in logged if x.kind == "job.interrupted")
    ended = restarted + 2000
    assert row["state"] == "completed", row
    assert row["elapsed_s"] == round(((lost - started) + (ended - restarted)) / 1000, 1) == 5.0, row
    assert row["wait_s"] == round((ended - submitted) / 1000 - row["elapsed_s"], 1), row


def _retried_run(job_id: str, retries: int, ends: list):
    """A job asking for `retries`, on one 1-card node: each placement starts, runs 3 s and ends as `ends` says, in
    turn -- a JobFailed's fields (code, exit_code, signal), or "completed"; after a failure, ticks every second
    until it is placed again. Returns the scheduler and everything logged, as the sink would store it."""
    from schemas.events import JobCompleted, JobFailed, SchedulerTick

    c = Clock()
    s = Scheduler(ledger=open_ledger())
    logged = [c.env(inventory("n0", "A100-80GB", gpus=1), "n0/inventory"),
              c.env(job(job_id, "t", 1000, 40, retries=retries), "cli/j")]
    for e in list(logged):
        logged += s.step(e)
    src = f"n0/job/{job_id}"
    for end in ends:
        p = next(o.payload for o in reversed(logged) if o.kind == "cmd.place")
        e = c.env(JobStarted(job_id=job_id, node="n0", command_id=p.command_id), src, dt=100)
        logged += [e] + s.step(e)
        if end == "completed":
            e = c.env(JobCompleted(job_id=job_id, node="n0", command_id=p.command_id), src, dt=3000)
        else:
            e = c.env(JobFailed(job_id=job_id, node="n0", command_id=p.command_id, attempt=p.attempt,
                                reason="the program's own words", **end), src, dt=3000)
        logged += [e] + s.step(e)
        if end is not ends[-1]:
            for _ in range(600):
                e = c.env(SchedulerTick(now_ms=c.now + 1000), "ticker", dt=1000)
                got = s.step(e)  # the scheduler's own input, stored nowhere
                logged += got
                if any(o.kind == "cmd.place" for o in got):
                    break
            else:
                raise AssertionError("not placed again within 10 minutes of log time")
    return s, logged


def _row(client, job_id: str) -> dict:
    sql, params = jobs_sql(None)
    res = client.query(sql, parameters=params)
    [row] = [dict(zip(res.column_names, r)) for r in res.result_rows if r[0] == job_id]
    return row


def test_a_failed_run_with_a_retry_left_is_listed_waiting_with_its_exit_and_when_it_is_retried(store):
    client, sink = store
    s, logged = _retried_run("t/r-wait", 2, [{"code": "ExitCode", "exit_code": 3}])
    assert s.phase_of("t/r-wait") == "pending"
    _store(sink, logged, part=11)
    row = _row(client, "t/r-wait")
    backoff = next(o.payload.reasons[0] for o in logged if o.kind == "job.pending")
    assert (row["state"], row["last_exit"], row["failures"], row["retries"]) == ("pending", "ExitCode 3", 1, 2), row
    assert row["retry_at_ms"] == backoff.data["retry_at_ms"] > 0
    assert row["elapsed_s"] == 3.0 and row["cards"] == 0, row  # its one run ran 3 s; the wait since is waiting


def test_a_job_whose_retries_are_spent_is_listed_failed_with_the_last_exit_and_every_run_counted(store):
    client, sink = store
    s, logged = _retried_run("t/r-fail", 2, [{"code": "ExitCode", "exit_code": 1}, {"code": "Signal", "signal": 9},
                                             {"code": "OOMKilled"}])
    assert s.phase_of("t/r-fail") == "done"
    _store(sink, logged, part=12)
    row = _row(client, "t/r-fail")
    assert (row["state"], row["last_exit"], row["failures"], row["retry_at_ms"]) == ("failed", "OOMKilled", 3, 0), row
    assert row["elapsed_s"] == 9.0, row  # three runs of 3 s; the back-offs are waiting


def test_a_job_a_retry_made_is_listed_completed_and_one_without_retries_fails_at_once(store):
    client, sink = store
    _, logged = _retried_run("t/r-ok", 1, [{"code": "Signal", "signal": 11}, "completed"])
    _, once = _retried_run("t/r-once", 0, [{"code": "ExitCode", "exit_code": 2}])
    _store(sink, logged + once, part=13)
    ok, failed = _row(client, "t/r-ok"), _row(client, "t/r-once")
    assert (ok["state"], ok["failures"], ok["last_exit"], ok["elapsed_s"]) == ("completed", 1, "Signal 11", 6.0), ok
    assert (failed["state"], failed["failures"], failed["last_exit"]) == ("failed", 1, "ExitCode 2"), failed
    # and as the jobs table says it (agents/cli/views.py)
    from agents.cli.views import exit_cell
    assert exit_cell(failed) == "ExitCode 2" and exit_cell(ok).startswith("Signal 11 (run 1 of 2 failed)")


def test_a_gang_is_listed_running_until_its_last_part_completes(store):
    """A gang of three parts over three nodes (docs/jobs.md, "Gangs"): two parts complete and the third still runs;
    the list says running, as the scheduler does; once the third completes, completed."""
    from schemas.events import JobCompleted

    client, sink = store
    c = Clock()
    s = Scheduler(ledger=open_ledger())
    logged = [c.env(inventory(n, "A100-80GB", gpus=1), f"{n}/inventory") for n in ("g1", "g2", "g3")]
    logged.append(c.env(job("t/gang", "t", 3000, 100, command=("python3", "x.py")), "cli/gang"))
    for e in list(logged):
        logged += s.step(e)
    parts = sorted((o.payload for o in logged if o.kind == "cmd.place"), key=lambda p: p.gang_index)
    assert len(parts) == 3
    for p in parts:
        e = c.env(JobStarted(job_id="t/gang", node=p.node, command_id=p.command_id), f"{p.node}/job/t/gang", dt=10)
        logged += [e] + s.step(e)

    def done(p):
        e = c.env(JobCompleted(job_id="t/gang", node=p.node, command_id=p.command_id, attempt=p.attempt,
                               part=p.gang_index, parts=3), f"{p.node}/job/t/gang", dt=100)
        return [e] + s.step(e)

    def row():
        sql, params = jobs_sql(None)
        res = client.query(sql, parameters=params)
        [r] = [dict(zip(res.column_names, r)) for r in res.result_rows if r[0] == "t/gang"]
        return r

    for p in parts[:2]:
        logged += done(p)
    assert s.phase_of("t/gang") == "running"
    _store(sink, logged, part=21)  # partitions of its own (the sink drops a batch at offsets already written)
    assert row()["state"] == "running"
    _store(sink, done(parts[2]), part=22)
    assert s.phase_of("t/gang") == "done" and row()["state"] == "completed"
