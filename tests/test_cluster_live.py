"""Fault tests on a real 3-broker KRaft cluster (replication 3, min.insync.replicas 2) with two Faust workers
(docs/reliability.md; `make chaos`). One module-scoped cluster; the faults run in order, each checked by the same
checkers, and each checker has a negative control: it is shown a doctored record of what happened (a job lost, a job
placed twice, a row written twice) and must fail on it.

Heavy (three JVMs, two workers, an agent on this machine): `make chaos` runs it, not `make test`. Waits are generous
but bounded; nothing here times anything."""
from __future__ import annotations

import os
import signal
import time
from collections import Counter

import pytest

from agents.stack import Stack
from schemas.envelope import decode
from schemas.topics import ALL_TOPICS, COMMANDS, JOB_EVENTS
from streams.edge.sink import outage_switch
from tests.live import cli, job_states, quotas, read_topic, replication, wait_for

pytestmark = [pytest.mark.broker, pytest.mark.chaos]

WAIT = 300  # seconds: a loaded 2-core machine runs three brokers, two workers and an agent here


# ---------------------------------------------------------------- checkers (each with a negative control below)

def lost_jobs(submitted: set[str], states: dict[str, dict]) -> set[str]:
    """Jobs submitted that the job view does not have completed."""
    return {j for j in submitted if states.get(j, {}).get("state") != "completed"}


def placed_twice(commands: list) -> dict[str, int]:
    """Jobs with more than one placement command per (job, attempt, node): a second decision for the same run.
    (Commands re-emitted with the same event id after a crash are the same command, counted once.)"""
    seen = {}
    for env in commands:
        if env.kind == "cmd.place":
            p = env.payload
            seen.setdefault((p.job_id, p.attempt, p.node), set()).add(env.event_id)
    return {f"{j}#{a}@{n}": len(ids) for (j, a, n), ids in seen.items() if len(ids) > 1}


def doubled_rows(rows: list[dict]) -> dict[str, int]:
    """Log records (topic, partition, offset) written to ClickHouse more than once (before FINAL merges them away).
    Not event ids: a fact can be in the log twice (a producer's retry, a gateway's redelivery after a rebalance) and
    is then two records, each sunk once; readers drop the repeat by its id."""
    c = Counter(f"{r['topic']}/{r['partition']}@{r['offset']}" for r in rows)
    return {e: n for e, n in c.items() if n > 1}


def test_negative_controls_each_checker_fails_on_a_doctored_record():
    from schemas.envelope import envelope
    from schemas.events import Assignment, PlaceJob

    assert lost_jobs({"a/j1", "a/j2"}, {"a/j1": {"state": "completed"}}) == {"a/j2"}
    assert lost_jobs({"a/j1"}, {"a/j1": {"state": "running"}}) == {"a/j1"}
    place = PlaceJob(job_id="a/j1", tenant="a", node="n0", command_id="c1", attempt=1,
                     assignments=(Assignment(gpu_uuid="GPU-0", milli=500, memory_mib=1024),))
    one = envelope(place, source="scheduler", seq=1, time_ms=1)
    again = envelope(place.model_copy(update={"command_id": "c2"}), source="scheduler", seq=2, time_ms=2)
    assert placed_twice([one, one]) == {}  # the same command re-emitted after a crash: one decision
    assert placed_twice([one, again]) == {"a/j1#1@n0": 2}
    row = {"topic": "t", "partition": 0, "offset": 5}
    assert doubled_rows([row, {**row, "offset": 6}, row]) == {"t/0@5": 2}
    assert doubled_rows([row, {**row, "offset": 6}]) == {}  # the same fact at two offsets is not a double insert


# ---------------------------------------------------------------- the cluster

@pytest.fixture(scope="module")
def cluster(tmp_path_factory, libs_home):
    if os.environ.get("GPUPOOL_KAFKA"):
        pytest.skip("the fault tests run their own local cluster")
    s = Stack(home=tmp_path_factory.mktemp("cluster") / "gpupool", libs_home=libs_home,
              extra_env={"GPUPOOL_CHAOS": "1", "GPUPOOL_SNAPSHOT_EVERY": "25"})
    s.start_broker(brokers=3)
    try:
        s.start_worker(WAIT)
        s.start_worker(WAIT, name="worker-2")
        s.start_agent("demo:2")
        quotas(s, "acme")
        s.add_user("aud", "auditor")  # the audit reads every topic: only an auditor may
        s.submitted = set()
        yield s
    finally:
        s.stop()


def submit(stack, prefix: str, n: int, duration: int = 2) -> set[str]:
    ids = set()
    for i in range(n):
        job = f"{prefix}-{i}"
        cli(stack, "submit", "--tenant", "acme", "--compute", "250", "--memory-gib", "4", "--duration",
            str(duration), "--job-id", job)
        ids.add(f"acme/{job}")
    stack.submitted |= ids
    return ids


def all_completed(stack, ids, what):
    return wait_for(lambda: not lost_jobs(ids, job_states(stack)) and True, WAIT, what, stack)


def completed_in_log(stack) -> set[str]:
    return {e.payload.job_id for e in (decode(m.value) for m in read_topic(stack, JOB_EVENTS.name))
            if e.kind == "job.completed"}


def commands(stack) -> list:
    return [decode(m.value) for m in read_topic(stack, COMMANDS.name)]


def audit_ok(stack) -> None:
    """`gpupool audit replay --verify` exits 0: the replay of the log (by segments from the snapshots on record,
    each snapshot checked; docs/billing.md) gives the recorded outputs, and the bill in ClickHouse is the replay's
    usage (it may take a while for the sink to catch up)."""
    last = {}

    def ok():
        last["out"] = cli(stack, "audit", "replay", "--verify", user="aud", check=False)
        return last["out"].returncode == 0

    deadline = time.monotonic() + WAIT
    while not ok():
        assert time.monotonic() < deadline, last["out"].stdout[-4000:] + last["out"].stderr[-2000:]
        time.sleep(5)
    assert "audit replay --verify: OK" in last["out"].stdout


def scheduler_owner(stack) -> str | None:
    for name in ("worker", "worker-2"):
        try:
            sched = stack.stats(name)["scheduler"]
        except (SystemExit, OSError, KeyError):
            continue
        if sched and sched["live"]:
            return name
    return None


def test_topics_are_replicated_three_times_with_two_in_sync(cluster):
    replicas, insync = replication(cluster.conn("service"))
    assert replicas == {s.name: {3} for s in ALL_TOPICS}
    assert insync == {"2"}


def test_one_worker_owns_the_scheduler_and_the_other_stands_by(cluster):
    # exactly one live, the other standing by (a rebalance while the second worker joins may move it first)
    wait_for(lambda: sorted(cluster.stats(n)["scheduler"]["live"] for n in ("worker", "worker-2")) == [False, True],
             WAIT, "one live scheduler and one standing by", cluster)
    ids = submit(cluster, "warm", 4)
    all_completed(cluster, ids, "jobs on the cluster")


def test_kill_9_the_scheduler_owner_the_other_takes_over_from_a_snapshot(cluster):
    before = scheduler_owner(cluster)
    other = "worker-2" if before == "worker" else "worker"
    ids = submit(cluster, "k9", 30, duration=3)  # > 25 input records: a snapshot is due
    wait_for(lambda: (cluster.stats(before)["scheduler"]["snapshots"] or {}).get("written"), WAIT,
             "a scheduler snapshot", cluster)
    cluster.procs[before].send_signal(signal.SIGKILL)
    cluster.procs.pop(before).wait(30)
    ids |= submit(cluster, "k9b", 5)
    took = wait_for(lambda: (s := cluster.stats(other)["scheduler"]) and s["live"] and s, WAIT,
                    f"{other} to take the scheduler over", cluster)
    assert took["takeover"]["snapshot_offset"] is not None and took["takeover"]["snapshot_offset"] > 0
    assert took["takeover"]["replayed"] < took["takeover"]["committed"]
    # the killed one comes back (as the supervisor would restart it); the sink and ClickHouse live in "worker"
    cluster.start_worker(WAIT, name=before) if before != "worker" else cluster.start_worker(WAIT)
    all_completed(cluster, ids, "every job, across the takeover")
    assert placed_twice(commands(cluster)) == {}
    audit_ok(cluster)


def test_kill_one_broker_jobs_go_on_nothing_lost(cluster):
    victim = cluster.broker.nodes[2]
    victim.kill()
    try:
        ids = submit(cluster, "b1", 6)
        all_completed(cluster, ids, "jobs with one broker down")
    finally:
        cluster.broker.start(WAIT)
    assert placed_twice(commands(cluster)) == {}
    assert not lost_jobs(cluster.submitted, job_states(cluster))


def test_clickhouse_unavailable_60s_the_sink_pauses_and_resumes_nothing_lost_or_doubled(cluster):
    switch = outage_switch(cluster.home)
    switch.parent.mkdir(parents=True, exist_ok=True)
    retries0 = cluster.stats()["sink"]["retries"]
    switch.touch()
    try:
        ids = submit(cluster, "ch", 4)
        # work goes on: the jobs complete, as the log says (the job pages read ClickHouse, which is away)
        wait_for(lambda: ids <= completed_in_log(cluster), WAIT, "jobs completed while ClickHouse is away", cluster)
        time.sleep(60)  # the outage lasts 60 s (the fault, not a measurement)
        assert cluster.stats()["sink"]["retries"] > retries0  # it tried, and waited
    finally:
        switch.unlink(missing_ok=True)

    def sunk():
        rows = cluster.query("SELECT DISTINCT job_id FROM gpupool.events WHERE kind = 'job.completed'")
        return {r["job_id"] for r in rows} >= cluster.submitted

    wait_for(sunk, WAIT, "every completed job in ClickHouse after the outage", cluster)
    rows = cluster.query("SELECT topic, partition, offset FROM gpupool.events")  # not FINAL: a double would show
    assert doubled_rows(rows) == {}


def test_whole_stack_stopped_and_started_same_view_and_bill(cluster):
    def view():
        nodes = {n["node"]: (n["state"], n["jobs"], [(c["uuid"], c["healthy"], c["free_milli"], c["holders"])
                                                      for c in n["cards"]])
                 for n in cluster.client().api("/api/nodes")["nodes"]}
        jobs = {j: s["state"] for j, s in job_states(cluster).items()}
        bill = cli(cluster, "billing", "--by", "tenant", "--format", "json")
        return nodes, jobs, bill

    all_completed(cluster, cluster.submitted, "quiet before the stop")
    audit_ok(cluster)
    before = view()
    for name in ("agent", "worker-2", "worker"):
        cluster.stop_process(name)
    cluster.broker.stop()
    cluster.broker.start(WAIT)
    cluster.start_worker(WAIT)
    cluster.start_worker(WAIT, name="worker-2")
    after = wait_for(lambda: (v := view()) and v[1] == before[1] and v, WAIT, "the job view back", cluster)
    assert after[1] == before[1] and after[2] == before[2]
    assert {n: v[1:] for n, v in after[0].items()} == {n: v[1:] for n, v in before[0].items()}
