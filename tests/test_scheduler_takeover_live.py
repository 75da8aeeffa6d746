"""The scheduler's takeover from a snapshot on a live stack (one broker, one worker, killed with SIGKILL and started
again): it loads a snapshot and replays only the tail, places nothing twice, loses no job, and the audit's replay of
the whole log agrees with what was decided and billed -- by segments from the snapshots on record, each
snapshot checked to be the state its segment derives (#16 item 2), and by the full replay from offset 0 (#16 item
1; the two-worker version on a 3-broker cluster is tests/test_cluster_live.py)."""
from __future__ import annotations

import signal

import pytest

from schemas.envelope import decode
from schemas.topics import COMMANDS
from tests.live import cli, job_states, quotas, read_topic, wait_for
from tests.test_cluster_live import lost_jobs, placed_twice

pytestmark = pytest.mark.broker


def test_a_killed_scheduler_comes_back_from_a_snapshot_and_the_audit_agrees(stack):
    stack.extra_env["GPUPOOL_SNAPSHOT_EVERY"] = "25"
    stack.extra_env["GPUPOOL_SNAPSHOT_AUDIT_EVERY"] = "60"  # the audit's checkpoints: segments of ~60 records
    stack.start_worker(240)
    stack.start_agent("demo:2")
    quotas(stack, "acme")
    stack.add_user("aud", "auditor")  # the audit reads every topic: only an auditor may
    ids = set()
    for i in range(12):
        cli(stack, "submit", "--tenant", "acme", "--compute", "250", "--memory-gib", "4", "--duration", "2",
            "--job-id", f"t-{i}")
        ids.add(f"acme/t-{i}")
    wait_for(lambda: (stack.stats()["scheduler"]["snapshots"] or {}).get("written"), 240, "a snapshot", stack)
    stack.procs["worker"].send_signal(signal.SIGKILL)
    stack.procs.pop("worker").wait(30)
    stack.start_worker(240)
    took = wait_for(lambda: (s := stack.stats()["scheduler"]) and s["live"] and s, 240, "the scheduler live", stack)
    assert took["takeover"]["snapshot_offset"] and took["takeover"]["replayed"] < took["takeover"]["committed"]
    wait_for(lambda: not lost_jobs(ids, job_states(stack)), 240, "every job completed", stack)
    assert placed_twice([decode(m.value) for m in read_topic(stack, COMMANDS.name)]) == {}
    last = {}

    def audited():
        last["out"] = cli(stack, "audit", "replay", "--verify", user="aud", check=False)
        return last["out"].returncode == 0

    try:
        wait_for(audited, 240, "audit replay --verify OK", stack)
    finally:
        print(last.get("out") and (last["out"].stdout[-3000:] + last["out"].stderr[-2000:]))
    # by segments (the default), in two processes: the snapshots on record were checked, none differs
    state = next(ln for ln in last["out"].stdout.splitlines() if ln.startswith("scheduler state:"))
    checked = int(state.split()[2])
    assert checked >= 2 and state.endswith(", 0 different"), last["out"].stdout
    assert "segment(s), --jobs" in last["out"].stdout
    # the full replay from offset 0 in one process gives the same verdict on the same outputs
    full = cli(stack, "audit", "replay", "--verify", "--full", user="aud", check=False)
    assert full.returncode == 0, full.stdout + full.stderr[-2000:]
    seg_outputs = next(ln for ln in last["out"].stdout.splitlines() if ln.startswith("scheduler outputs:"))
    full_outputs = next(ln for ln in full.stdout.splitlines() if ln.startswith("scheduler outputs:"))
    assert int(seg_outputs.split()[3].rstrip(",")) <= int(full_outputs.split()[3].rstrip(","))
