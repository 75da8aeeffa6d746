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
    stack.extra_env["GPUPOOL_SNAPSHOT_EVERY"] = "10"
    stack.extra_env["GPUPOOL_SNAPSHOT_AUDIT_EVERY"] = "25"  # the audit's checkpoints: segments of ~25 records
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
    # a log long enough for two audit checkpoints and the latest snapshots after them, however fast this machine ran
    # the jobs (the ticker adds a record a second)
    wait_for(lambda: stack.stats()["scheduler"]["position"] >= 70, 240, "70 scheduler input records", stack)
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


def test_an_upgrade_stops_cleanly_and_the_new_code_goes_on_from_the_old_codes_state(stack, tmp_path):
    """An upgrade on a live stack: the worker is stopped cleanly (SIGTERM), which writes the state at the offset the
    scheduler stopped at; a worker with other scheduler code (here: a copy of the sources with a changed comment in
    core.py -- another code version, the same state layout) takes over from that snapshot of the old code's,
    replays nothing, finds the running jobs where the old code put them, and writes a snapshot of its own code at
    that offset, where an audit with the new code starts (docs/reliability.md, upgrades)."""
    import shutil
    from pathlib import Path

    from streams.edge import scheduler_snapshot as snapshot

    stack.extra_env["GPUPOOL_SNAPSHOT_EVERY"] = "100000"  # no snapshot falls due on the way: only the stop writes one
    stack.start_worker(240)
    stack.start_agent("demo:2")
    quotas(stack, "acme")
    for i in range(3):
        cli(stack, "submit", "--tenant", "acme", "--compute", "250", "--memory-gib", "4", "--duration", "600",
            "--job-id", f"s-{i}")
    ids = {f"acme/s-{i}" for i in range(3)}

    def where():
        states = job_states(stack)
        return {j: (states.get(j, {}).get("state"), states.get(j, {}).get("nodes")) for j in sorted(ids)}

    wait_for(lambda: {s for s, _ in where().values()} == {"running"}, 240, "the jobs running", stack)
    placed = where()
    before = stack.stats()["scheduler"]
    assert before["snapshots"]["written"] == 0
    stack.procs["worker"].send_signal(signal.SIGTERM)
    stack.procs.pop("worker").wait(60)
    # the new code: the sources copied, one comment changed in the scheduler's core
    new = tmp_path / "v2"
    root = Path(__file__).resolve().parents[1]
    for pkg in ("agents", "streams", "schemas", "infra"):
        shutil.copytree(root / pkg, new / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    core = new / "agents" / "scheduler" / "core.py"
    core.write_text(core.read_text() + "\n# upgraded\n")
    stack.extra_env.update(PYTHONSAFEPATH="1", PYTHONPATH=str(new))  # the copy, not the checkout, is imported
    stack.start_worker(240)
    took = wait_for(lambda: (s := stack.stats()["scheduler"]) and s["live"] and s, 240, "the scheduler live", stack)
    t = took["takeover"]
    assert t["snapshot_code"] == snapshot.code_version() != t["code"], t  # the old code's snapshot, new code running
    assert t["snapshot_offset"] == t["committed"] >= before["position"] and t["replayed"] == 0, t
    assert took["snapshots"]["written"] == 1 and took["snapshots"]["last_offset"] == t["committed"], took["snapshots"]
    assert where() == placed
    # the audit (here with the old code, the test's own) reads on the record where the new code took over
    stack.add_user("aud", "auditor")
    out = cli(stack, "audit", "replay", "--verify", user="aud", check=False)
    assert (f"at input offset {t['committed']} scheduler code {t['code']} took over from code "
            f"{snapshot.code_version()}") in out.stdout, out.stdout + out.stderr[-2000:]
