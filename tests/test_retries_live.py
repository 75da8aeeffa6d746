"""Retries and grace periods on the real broker, worker and simulated fleet (docs/jobs.md, "Exit reasons and
retries", "Stops and grace periods"): a job asking for one retry whose run dies is requeued after its back-off and
resumes from its checkpoint; a drain stops it with the operator's grace for its tier (GPUPOOL_GRACE_S, through the
ticks); its second death ends it failed after 2 runs, as `gpupool jobs` and `explain` say; and it was billed only
for what ran."""
from __future__ import annotations

import orjson
import pytest

from schemas.events import JobRequested
from tests.live import cli, job_states, quotas, wait_for

pytestmark = pytest.mark.broker

JOB = "acme/flaky"


def _events(stack, kind: str) -> list[dict]:
    rows = stack.query("SELECT event_time_ms, payload FROM gpupool.events FINAL WHERE job_id = {j:String} AND "
                       "kind = {k:String} ORDER BY event_time_ms, topic, partition, offset", {"j": JOB, "k": kind})
    return [{"t": int(r["event_time_ms"]), **orjson.loads(r["payload"])} for r in rows]


def _state(stack) -> dict:
    return job_states(stack, "alice").get(JOB, {})


def test_a_failed_run_is_retried_after_its_back_off_stopped_with_its_tiers_grace_and_billed_for_what_ran(stack):
    stack.extra_env["GPUPOOL_GRACE_S"] = "inference=5,offline=45"
    control = stack.home / "faults"
    control.write_text("")
    fleet = stack.home / "fleet.yaml"
    fleet.write_text("nodes:\n  - {name: n1, model: A100-80GB, gpus: 1}\n")
    stack.start_worker()
    stack.start_agent(str(fleet), "--control", str(control))
    stack.add_user("alice", "tenant", "acme")
    quotas(stack, "acme")
    stack.client("alice").send([JobRequested(job_id="flaky", tenant="acme", compute_milli=1000, gpu_memory_mib=8192,
                                             duration_s=3600, checkpoint_interval_s=1, retries=1)])
    wait_for(lambda: _state(stack).get("state") == "running", 90, "the first run", stack)
    wait_for(lambda: _events(stack, "job.checkpointed"), 60, "a checkpoint", stack)

    # 1. its process dies: requeued, waiting out the back-off, with the exit and when it is retried
    with control.open("a") as f:
        f.write(f"fail:{JOB}\n")
    # the list is the job view's fold (gpupool.jobs): it reads the node's failure and the scheduler's BackOff decision
    # (which says when) in whichever order they come, so the row says when the job is retried once both are read
    row = wait_for(lambda: (s := _state(stack)).get("failures") == 1 and (s["state"] != "pending" or s["retry_at_ms"])
                   and s, 60, "the failure listed with its retry time", stack)
    if row["state"] == "pending":  # (the back-off may already be over when the list is read)
        assert row["retry_at_ms"] > 0, row
    (backoff,) = wait_for(lambda: [p for p in _events(stack, "job.pending") if p["reasons"][0]["code"] == "BackOff"],
                          60, "the BackOff decision", stack)
    assert backoff["reasons"][0]["message"].startswith("run 1 of 2 failed (simulated failure: exit status 1); "
                                                      "retrying from ckpt:acme/flaky:")
    wait_for(lambda: _state(stack).get("state") == "running", 120, "the second run", stack)
    places = _events(stack, "cmd.place")
    assert [p["attempt"] for p in places] == [1, 2] and places[1]["resume_from"].startswith("ckpt:acme/flaky:")
    (failed,) = _events(stack, "job.failed")
    retry_at = backoff["reasons"][0]["data"]["retry_at_ms"]
    assert retry_at == backoff["t"] + 10_000 and places[1]["t"] >= retry_at  # not placed before its back-off ended

    # 2. a drain stops it with the offline tier's grace, the operator's, carried by the ticks
    cli(stack, "node", "drain", "n1")
    (stop,) = wait_for(lambda: _events(stack, "cmd.preempt"), 60, "the drain's stop", stack)
    assert stop["grace_s"] == 45 and stop["reasons"][0]["code"] == "Drain"
    wait_for(lambda: _events(stack, "job.stopped"), 60, "the stop", stack)
    cli(stack, "node", "uncordon", "n1")
    wait_for(lambda: _state(stack).get("state") == "running", 120, "the third run", stack)

    # 3. its second death spends the retry: failed after 2 runs
    with control.open("a") as f:
        f.write(f"fail:{JOB}\n")
    row = wait_for(lambda: (s := _state(stack)).get("state") == "failed" and s, 60, "the job failed", stack)
    assert (row["failures"], row["retries"], row["retry_at_ms"]) == (2, 1, 0), row
    text = cli(stack, "explain", "flaky", user="alice")
    assert "[Retry] BackOff: run 1 of 2 failed (simulated failure: exit status 1)" in text
    assert "failed after 2 runs (1 retries spent)" in text
    table = cli(stack, "jobs", user="alice")
    assert "failed after 2 runs" in table

    # 4. the bill: each run from its start to its failure or stop, nothing for the back-off
    starts = [e["t"] for e in _events(stack, "job.started")]
    ends = sorted([e["t"] for e in _events(stack, "job.failed")] + [e["t"] for e in _events(stack, "job.stopped")])
    assert len(starts) == len(ends) == 3
    usage = wait_for(lambda: (u := _events(stack, "usage.accrued")) and max(x["end_ms"] for x in u) == ends[-1] and u,
                     60, "the last run billed", stack)
    assert sum(u["gpu_milli_ms"] for u in usage) == sum(1000 * (e - s) for s, e in zip(starts, ends))
    waits = [(ends[0], places[1]["t"])]
    assert not [u for u in usage for a, b in waits if u["start_ms"] < b and u["end_ms"] > a], usage
