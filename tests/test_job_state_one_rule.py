"""One rule for a job's state (docs/jobs.md, "A job's state"): the job view's fold (streams/folds/job_view.py) decides
it; the sink stores the fold's result (gpupool.jobs, from the job view's changelog); the jobs list (`/api/jobs`, which
`gpupool jobs`, `gpupool submit` and the dashboard read) says what is stored. For histories of one job drawn at
random -- requests with retries, placements of one part or a gang of two, starts, completions, failures with exit
reasons, stops, interruptions whose nodes report late, back-offs, cancels, rejections and refused duplicates -- the
list says what the fold says; a changelog delivered twice changes nothing; refolding the events rebuilds the stored
row; and a refold that reads one topic after the other gives the same row. Real sink, embedded ClickHouse."""
from __future__ import annotations

import itertools

import pytest
from hypothesis import HealthCheck, find, given, settings
from hypothesis import strategies as st

from schemas.envelope import envelope
from schemas.events import (
    Assignment, JobCancelled, JobCompleted, JobFailed, JobInterrupted, JobPending, JobStarted, JobStopped, PlaceJob,
    Reason, Rejected,
)
from schemas.routing import route
from schemas.topics import DECISIONS, JOB_EVENTS, JOB_REQUESTS
from streams.edge.api import jobs_sql
from streams.folds import job_view
from streams.folds.rows import COLUMNS, job_rows
from tests.builders import job
from tests.job_store import Changelog, chdb_sink, store

JOB_COLUMNS = [c for c in COLUMNS["jobs"] if c != "version"]
_ids = itertools.count()


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    client, sink = chdb_sink(tmp_path_factory.mktemp("onerule"))
    yield client, sink, Changelog()
    client.close()


# ---------------------------------------------------------------- histories

ATTEMPTS = (1, 2, 3)
step = st.one_of(
    st.tuples(st.just("request"), st.integers(0, 2)),
    st.tuples(st.just("place"), st.sampled_from(ATTEMPTS), st.sampled_from((1, 2))),
    st.tuples(st.sampled_from(("start", "complete", "stop")), st.sampled_from(ATTEMPTS), st.sampled_from((0, 1))),
    st.tuples(st.just("fail"), st.sampled_from(ATTEMPTS), st.sampled_from((0, 1)),
              st.sampled_from((("ExitCode", 3, None), ("Signal", None, 9), ("OOMKilled", None, None)))),
    st.tuples(st.just("interrupt"), st.sampled_from(ATTEMPTS)),
    st.tuples(st.just("pending"), st.booleans()),
    st.tuples(st.just("cancel")),
    st.tuples(st.just("reject"), st.sampled_from(("unsatisfiable", "duplicate_job_id"))),
)
histories = st.lists(step, min_size=1, max_size=14)


def envelopes(job_id: str, steps) -> list:
    """The records a history puts on the log, in the order the live worker reads them. A placement of attempt A has
    `parts` parts (command ids c-A-PART on nodes nA-PART); a node's report of a part never placed still names it (a
    report may be read before the placement)."""
    seqs: dict[str, int] = {}
    t = [1_000_000]
    parts = {a: 1 for a in ATTEMPTS}
    first_request: list = []

    def env(payload, source, causation=None):
        seqs[source] = seqs.get(source, 0) + 1
        t[0] += 1000
        return envelope(payload, source=source, seq=seqs[source], time_ms=t[0], causation_id=causation,
                        tenant=job_id.split("/")[0])

    out = []
    for s in steps:
        kind = s[0]
        if kind == "request":
            e = env(job(job_id, job_id.split("/")[0], 500, 10, retries=s[1]), f"cli/{job_id}")
            first_request.append(e.event_id)
            out.append(e)
        elif kind == "place":
            a, n = s[1], s[2]
            parts[a] = n
            out += [env(PlaceJob(command_id=f"c-{a}-{i}", job_id=job_id, tenant=job_id.split("/")[0],
                                 node=f"n{a}-{i}", assignments=(Assignment(gpu_uuid=f"GPU-{a}-{i}", milli=500,
                                                                           memory_mib=1024),),
                                 gang_size=n, gang_index=i), "scheduler") for i in range(n)]
        elif kind in ("start", "complete", "stop", "fail"):
            a, i = s[1], min(s[2], parts[s[1]] - 1)
            node, cmd = f"n{a}-{i}", f"c-{a}-{i}"
            src = f"{node}/job/{job_id}"
            if kind == "start":
                out.append(env(JobStarted(job_id=job_id, node=node, command_id=cmd), src))
            elif kind == "complete":
                out.append(env(JobCompleted(job_id=job_id, node=node, command_id=cmd, attempt=a, part=i,
                                            parts=parts[a]), src))
            elif kind == "stop":
                out.append(env(JobStopped(job_id=job_id, node=node, command_id=cmd, checkpoint=f"ck-{a}"), src))
            else:
                code, exit_code, signal = s[3]
                out.append(env(JobFailed(job_id=job_id, node=node, command_id=cmd, attempt=a, part=i,
                                         reason="the program's own words", code=code, exit_code=exit_code,
                                         signal=signal), src))
        elif kind == "interrupt":
            a = s[1]
            out.append(env(JobInterrupted(job_id=job_id, node=f"n{a}-0", code="NodeLost", attempt=a,
                                          commands=tuple(f"c-{a}-{i}" for i in range(parts[a])),
                                          reasons=(Reason(code="NodeLost", plugin="Lifecycle"),)), "scheduler"))
        elif kind == "pending":
            reason = (Reason(code="BackOff", plugin="Retry", data={"failures": 1, "retries": 2,
                                                                  "retry_at_ms": t[0] + 30_000})
                      if s[1] else Reason(code="InsufficientGPU", plugin="Capacity"))
            out.append(env(JobPending(job_id=job_id, reasons=(reason,)), "scheduler"))
        elif kind == "cancel":
            out.append(env(JobCancelled(job_id=job_id, reason="enough"), f"owner/{job_id}"))
        elif kind == "reject":
            # a rejection answers the job's first request (its event id, read before or after it); a duplicate is
            # refused about a later request under the id, so only once the first is on the log
            if s[1] == "duplicate_job_id" and not first_request:
                continue
            causation = f"cli/{job_id}:1" if s[1] != "duplicate_job_id" else f"cli/{job_id}:99"
            out.append(env(Rejected(job_id=job_id, code=s[1], reasons=(Reason(code=s[1]),)), "scheduler", causation))
    return out


def fold(envs):
    view = None
    for e in envs:
        if getattr(e.payload, "job_id", None) and route(e)[0].name in (JOB_REQUESTS.name, JOB_EVENTS.name,
                                                                        DECISIONS.name):
            view = job_view.evolve(view, e)
    return view


def listed(client, job_id: str) -> dict | None:
    sql, params = jobs_sql(None, {"job": job_id})
    res = client.query(sql, parameters=params)
    rows = [dict(zip(res.column_names, r)) for r in res.result_rows]
    assert len(rows) <= 1, rows
    return rows[0] if rows else None


def _timeless(row: dict) -> dict:
    """A listed row less what is counted to the moment of the query (a run not ended runs until now)."""
    return {k: v for k, v in row.items() if k not in ("wait_s", "elapsed_s")}


def stored(client, job_id: str) -> dict | None:
    res = client.query(f"SELECT {', '.join(JOB_COLUMNS)} FROM gpupool.jobs FINAL WHERE job_id = {{j:String}}",
                       parameters={"j": job_id})
    rows = [dict(zip(res.column_names, r)) for r in res.result_rows]
    return rows[0] if rows else None


# ---------------------------------------------------------------- the properties


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.too_slow])
@given(steps=histories)
def test_the_jobs_list_says_what_the_fold_says_and_a_replay_rebuilds_the_row(pool, steps):
    client, sink, changelog = pool
    n = next(_ids)
    job_id = f"p/j{n}"
    envs = envelopes(job_id, steps)
    # each history on a partition of its own (the sink drops a batch at offsets already written)
    start = changelog.next_offset
    store(sink, changelog, envs, part=n % 30000)
    view = fold(envs)
    row = listed(client, job_id)
    submitted = any(e.kind in ("job.requested", "job.rejected") for e in envs)
    if view is None or not submitted:
        assert row is None, row  # nothing submitted or refused: no job to list
        return
    assert row is not None, (steps, view)
    want = {"state": view.state, "failures": view.failures, "last_exit": job_view.last_exit(view),
            "retry_at_ms": job_view.retry_at_ms(view), "retries": view.request.retries if view.request else 0,
            "tenant": "p", "tier": view.request.tier.value if view.request else "",
            "compute_milli": view.request.compute_milli if view.request else 0}
    assert {k: row[k] for k in want} == want, (steps, row)
    if view.state == "pending":
        assert (row["cards"], row["nodes"]) == (0, ""), row
    # the changelog delivered again (a sink that crashed before its commit), in other batches: nothing changes
    redelivered = Changelog()
    redelivered.next_offset = start
    again = redelivered.records(envs, 30000 + n % 30000)
    if again:
        for batch in (again[:1], again[1:]):
            if batch:
                sink._insert_batch(batch[0].topic, batch[0].partition, batch)
    assert _timeless(listed(client, job_id)) == _timeless(row)
    # a replay rebuilds the stored row: the events refolded as the log holds them (audit, a fresh worker)
    rebuilt = job_rows(fold(envs), 0)["jobs"][0]
    assert dict(zip(JOB_COLUMNS, rebuilt[:-1])) == stored(client, job_id), steps


TOPIC_ORDER = [JOB_REQUESTS.name, JOB_EVENTS.name, DECISIONS.name, "gpupool.commands"]


@settings(max_examples=300, deadline=None)
@given(steps=histories)
def test_a_refold_one_topic_after_the_other_gives_the_same_row(steps):
    """The fold must come out the same for every reading order that keeps each topic's order (job_view's promise):
    the row the live worker stored and the row a refold reading one topic after the other makes are one -- also
    when a cancel or a rejection (requests and decisions) and a run's end (job events) race: the earlier by its time
    closes the job."""
    envs = envelopes("p/order", steps)
    view = fold(envs)
    by_topic = sorted(envs, key=lambda e: TOPIC_ORDER.index(route(e)[0].name))
    if view is None:
        assert fold(by_topic) is None
        return
    assert _decided(fold(by_topic)) == _decided(view), steps


def _decided(view) -> dict:
    """A job's row less why it waits (its reasons, and the back-off's end they say) and its checkpoint: these are the
    latest reason read and the latest checkpoint reported (a scheduler's decisions and a node's reports are on
    different topics), so they may differ with the reading order (found by this test; the scheduler's placement says
    what a run resumes from). Its state, node, run, times and counts may not."""
    return {k: v for k, v in zip(COLUMNS["jobs"], job_rows(view, 0)["jobs"][0])
            if k not in ("reasons", "retry_at_ms", "checkpoint")}


def test_a_changelog_delivered_twice_or_out_of_its_batches_keeps_the_latest_view(pool):
    """At-least-once: the sink crashes after writing the jobs rows but before committing, and the changelog is read
    again with other batch boundaries; or an older change is written again after a newer one. FINAL keeps the row
    of the latest change (the highest changelog offset), which is the fold's answer."""
    from tests.test_sink_exactness import Rec

    client, sink, changelog = pool
    job_id = f"p/twice{next(_ids)}"
    steps = [("request", 1), ("place", 1, 1), ("start", 1, 0), ("fail", 1, 0, ("ExitCode", 3, None)),
             ("pending", True), ("place", 2, 1), ("start", 2, 0), ("complete", 2, 0)]
    envs = envelopes(job_id, steps)
    start = changelog.next_offset
    store(sink, changelog, envs, part=60001)
    row = listed(client, job_id)
    assert (row["state"], row["failures"], row["last_exit"]) == ("completed", 1, "ExitCode 3"), row
    # the same changes again, at the same offsets, in two other batches
    replay = Changelog()
    replay.next_offset = start
    changes = replay.records(envs, 60002)
    sink._insert_batch(changes[0].topic, 60002, changes[: len(changes) // 2])
    sink._insert_batch(changes[0].topic, 60002, changes[len(changes) // 2:])
    # and the oldest change once more, last, at its own (low) offset
    first = changes[0]
    sink._insert_batch(first.topic, 60003, [Rec(first.topic, 60003, first.offset, first.value, first.key)])
    row = listed(client, job_id)
    assert (row["state"], row["failures"], row["last_exit"]) == ("completed", 1, "ExitCode 3"), row


def _last_event_rule(envs) -> str:
    """The rule the CLI and the dashboard used to follow: the state the job's last event names."""
    names = {"job.started": "running", "job.completed": "completed", "job.failed": "failed",
             "job.cancelled": "cancelled", "job.rejected": "rejected", "job.stopped": "pending",
             "job.interrupted": "pending", "job.pending": "pending", "job.requested": "pending"}
    last = [e.kind for e in envs if e.kind in names]
    return names[last[-1]] if last else "unknown"


def test_the_last_event_rule_is_not_the_jobs_state():
    """Negative control: the histories above tell the rules apart -- a history exists where the last event's name
    (the CLI's and the dashboard's old rule) is not the job's state."""
    found = find(histories, lambda steps: (v := fold(envs := envelopes("p/neg", steps))) is not None
                 and v.state != _last_event_rule(envs))
    assert found


@pytest.mark.parametrize("cancel_first", [True, False])
def test_a_cancel_and_a_runs_end_race_the_earlier_by_its_time_closes_the_job(cancel_first):
    """A tenant's cancel (job-requests) and a node's report that the run completed (job-events) are read in either
    order: the one that happened first, by its time, says how the job ended -- as the live worker and a refold
    read them alike."""
    def run(cancel_at: int, done_at: int, reading_cancel_first: bool):
        req = envelope(job("p/race", "p", 500, 10), source="cli/p/race", seq=1, time_ms=1000)
        start = envelope(JobStarted(job_id="p/race", node="n1", command_id="c1"), source="n1/job/p/race", seq=1,
                         time_ms=2000)
        cancel = envelope(JobCancelled(job_id="p/race"), source="owner/p/race", seq=1, time_ms=cancel_at)
        done = envelope(JobCompleted(job_id="p/race", node="n1", command_id="c1"), source="n1/job/p/race", seq=2,
                        time_ms=done_at)
        return fold([req, start, cancel, done] if reading_cancel_first else [req, start, done, cancel])

    late_cancel, early_cancel = run(9000, 5000, cancel_first), run(5000, 9000, cancel_first)
    assert (late_cancel.state, late_cancel.ended_ms, late_cancel.node) == ("completed", 5000, "n1")
    assert (early_cancel.state, early_cancel.ended_ms, early_cancel.node) == ("cancelled", 5000, "n1")
