"""`gpupool audit`: replay --verify against the log and ClickHouse, with negative controls; export.

The comparison logic is tested without a broker; the rest runs on a real broker, worker and simulated fleet.
"""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import pytest
from agents.audit_compare import compare_bill, compare_outputs, replay_records, usage_row
from agents.audit_log import Recorded
from agents.scheduler.core import Scheduler
from schemas.envelope import decode, encode
from schemas.events import JobCompleted, JobStarted, QuotaSet, SchedulerTick
from schemas.topics import COMMANDS, LEDGER
from tests.builders import Clock, inventory, job
from tests.live import cli, job_states, produce, read_topic, wait_for

# ---------------------------------------------------------------- the comparison, no broker


def _run():
    clock = Clock()
    inputs = [clock.env(inventory("n1"), "n1/inventory"), clock.env(QuotaSet(tenant="t1", gpu_milli=4000), "operator"),
              clock.env(job("j1"), "cli/j1"), clock.env(job("j2", compute=300), "cli/j2")]
    s = Scheduler()
    places = [o for e in inputs for o in s.step(e) if o.kind == "cmd.place"]
    for p in places:  # act as the node agent: each placement starts, then completes 1.5 s later
        src = f"{p.payload.node}/job/{p.payload.job_id}"
        inputs.append(clock.env(JobStarted(job_id=p.payload.job_id, node=p.payload.node,
                                           command_id=p.payload.command_id), src))
        inputs.append(clock.env(JobCompleted(job_id=p.payload.job_id, node=p.payload.node,
                                             command_id=p.payload.command_id), src, dt=1500))
    inputs.append(clock.env(SchedulerTick(now_ms=clock.now + 10), "ticker"))
    replayed = replay_records([(i, encode(e), e.event_time_ms) for i, e in enumerate(inputs)])
    return inputs, replayed


def _recorded(envs):
    topic = {True: COMMANDS.name}
    return [Recorded(topic.get(e.is_command, LEDGER.name if e.kind.startswith(("usage", "quota")) else
                               "gpupool.job-events"), 0, i, encode(e)) for i, e in enumerate(envs)]


def test_comparison_logic_without_a_broker():
    inputs, replayed = _run()
    outs = [e for _, e in replayed]
    kinds = {e.kind for e in outs}
    assert {"cmd.place", "cmd.release", "usage.accrued"} <= kinds
    committed = len(inputs)

    assert compare_outputs(replayed, _recorded(outs), committed).ok
    # a re-emitted duplicate (same envelope, another offset) is fine
    assert compare_outputs(replayed, _recorded(outs + outs[:2]), committed).ok

    # tampered command: same event id, another node
    place = next(e for e in outs if e.kind == "cmd.place")
    forged = place.model_copy(update={"payload": place.payload.model_copy(update={"node": "n9"})})
    rep = compare_outputs(replayed, _recorded(outs + [forged]), committed)
    assert not rep.ok and len(rep.different) == 1 and place.event_id in rep.different[0]
    assert "payload.node" in rep.different[0] and "n9" in rep.different[0]

    # a lost output is missing only when its cause lies before the committed offset
    last_off, last = replayed[-1]
    rest = [e for e in outs if e.event_id != last.event_id]
    rep = compare_outputs(replayed, _recorded(rest), committed)
    assert rep.missing and last.event_id in rep.missing[0]
    assert compare_outputs(replayed, _recorded(rest), last_off).ok  # not processed yet: in flight

    # an output the replay never makes, and a command from a foreign source
    alien = place.model_copy(update={"event_id": "scheduler:999", "seq": 999})
    foreign = place.model_copy(update={"event_id": "mallory:1", "source": "mallory"})
    rep = compare_outputs(replayed, _recorded(outs + [alien, foreign]), committed)
    assert len(rep.extra) == 2 and "scheduler:999" in rep.extra[0] and "mallory" in rep.extra[1]

    # the window: only outputs with event time in [from, to) are compared
    t_place = place.event_time_ms
    rep = compare_outputs(replayed, _recorded(outs + [forged]), committed, (t_place + 1, None))
    assert rep.ok and rep.compared < len(outs)

    # the bill
    usage = [e for e in outs if e.kind == "usage.accrued"]
    rows = [dict(usage_row(e)) for e in usage]
    assert compare_bill(usage, rows).ok
    rows[0] = dict(rows[0], gpu_milli_ms=rows[0]["gpu_milli_ms"] + 1)
    rep = compare_bill(usage, rows)
    assert len(rep.different) == 1 and usage[0].event_id in rep.different[0] and "gpu_milli_ms" in rep.different[0]
    rep = compare_bill(usage, [dict(usage_row(usage[0]), event_id="scheduler:777")] + rows[1:])
    assert len(rep.extra) == 1 and "scheduler:777" in rep.extra[0]
    assert len(rep.missing) == 1 and usage[0].event_id in rep.missing[0]
    assert compare_bill(usage[1:], rows[1:], not_yet_sunk={usage[0].event_id}).ok


# ---------------------------------------------------------------- on the real broker


def audit(stack, *argv: str, user: str = "aud") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "agents.audit", *argv],
                          env={**os.environ, **stack.env, "GPUPOOL_USER": user},
                          capture_output=True, text=True, timeout=120)


@pytest.mark.broker
def test_replay_verify_export_and_negative_controls(stack, tmp_path):
    stack.start_worker()
    stack.start_agent("demo:2")
    stack.add_user("aud", "auditor")
    for tenant in ("acme", "zeta"):  # without a quota a tenant runs nothing (default_quota_milli 0)
        cli(stack, "quota", "set", tenant, "--compute", "100000")
    for i, (tenant, compute, dur) in enumerate([("acme", 500, 1), ("acme", 2000, 2), ("zeta", 250, 1)]):
        cli(stack, "submit", "--tenant", tenant, "--compute", str(compute), "--memory-gib", "8", "--duration",
            str(dur), "--job-id", f"au-{i}", "--model", "A100-80GB")
    wait_for(lambda: (s := job_states(stack)) and len(s) == 3 and all(v["state"] == "completed" for v in s.values()),
             90, "three completed jobs", stack)
    # every job's usage is in (a usage tick may have cut a run in two: count the rows, do not assume three)
    wait_for(lambda: stack.query("SELECT uniqExact(job_id) AS n FROM gpupool.usage FINAL")[0]["n"] == 3, 30,
             "usage rows", stack)
    n_usage = stack.query("SELECT count() AS n FROM gpupool.usage FINAL")[0]["n"]
    n_acme = stack.query("SELECT count() AS n FROM gpupool.usage FINAL WHERE tenant = 'acme'")[0]["n"]

    # the log is the auditor's to read: an operator may not
    denied = audit(stack, "replay", "--verify", user="admin")
    assert denied.returncode == 1 and "only auditor principals" in denied.stderr, denied.stderr[-2000:]

    # untouched: everything matches
    ok = audit(stack, "replay", "--verify")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "OK" in ok.stdout and "100%" in ok.stderr
    assert f"bill (gpupool.usage FINAL): compared {n_usage}, matched {n_usage}" in ok.stdout
    late = audit(stack, "replay", "--verify", "--from", "2999-01-01T00:00:00")
    assert late.returncode == 0 and "scheduler outputs: compared 0" in late.stdout, late.stdout

    # export: the evidence pack -- sections, summary, the verification over the period, a signed manifest
    out_dir = tmp_path / "evidence"
    ex = audit(stack, "export", "--tenant", "acme", "--out", str(out_dir))
    assert ex.returncode == 0, ex.stderr
    manifest = json.loads((out_dir / "manifest.json").read_text())
    secs = manifest["sections"]
    assert set(secs) == {"resources", "jobs", "quota", "decisions", "faults", "actions", "usage", "cost"}
    assert secs["resources"]["rows"] == 8  # demo:2: two nodes of four cards
    assert secs["usage"]["rows"] == n_acme >= 2
    n_events = stack.query("SELECT count() AS n FROM gpupool.events FINAL WHERE job_id IN ('acme/au-0', 'acme/au-1')")[0]["n"]
    assert secs["jobs"]["rows"] == n_events > 0
    n_dec = stack.query("SELECT count() AS n FROM gpupool.scheduling FINAL WHERE job_id IN ('acme/au-0', 'acme/au-1')")[0]["n"]
    assert secs["decisions"]["rows"] == n_dec >= 4  # two places, two releases
    n_quota = stack.query("SELECT count() AS n FROM gpupool.quota_events FINAL WHERE tenant = 'acme'")[0]["n"]
    assert secs["quota"]["rows"] == n_quota
    for name, sec in secs.items():
        for ext in ("csv", "json"):
            want = manifest["files"][f"{name}.{ext}"]["sha256"]
            assert hashlib.sha256((out_dir / f"{name}.{ext}").read_bytes()).hexdigest() == want
        assert len(json.loads((out_dir / f"{name}.json").read_text())) == sec["rows"]
        assert len((out_dir / f"{name}.csv").read_text().splitlines()) == sec["rows"] + 1
    summary = json.loads((out_dir / "summary.json").read_text())
    assert summary["tenant"] == "acme" and summary["jobs"] == 2 and summary["verification"]["ok"] is True
    assert summary["gpu_hours"] > 0 and json.loads((out_dir / "verification.json").read_text())["ok"] is True
    usage = json.loads((out_dir / "usage.json").read_text())
    assert usage[0]["start"].endswith("Z") and "T" in usage[0]["start"]  # ISO-8601 UTC
    everything = "".join(p.read_text() for p in out_dir.iterdir() if p.suffix in (".csv", ".json"))
    assert "zeta" not in everything  # another tenant's jobs and names stay out of acme's pack
    checked = audit(stack, "verify-export", str(out_dir), "--pubkey",
                    str(stack.home / "keys" / "evidence-ed25519.pub.pem"))
    assert checked.returncode == 0 and "OK" in checked.stdout, checked.stdout
    # tampering: one changed row, one removed file, a pack re-signed by someone else
    rows = (out_dir / "usage.csv").read_text().splitlines()
    rows[1] = rows[1].replace(",", ",9", 1)
    (out_dir / "usage.csv").write_text("\n".join(rows) + "\n")
    (out_dir / "quota.json").unlink()
    bad = audit(stack, "verify-export", str(out_dir))
    assert bad.returncode == 1 and "changed: usage.csv" in bad.stdout and "missing: quota.json" in bad.stdout
    other_key = tmp_path / "other.pem"
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    other_key.write_bytes(Ed25519PrivateKey.generate().private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    forged = tmp_path / "forged"
    assert audit(stack, "export", "--tenant", "acme", "--out", str(forged), "--key", str(other_key)).returncode == 0
    assert audit(stack, "verify-export", str(forged)).returncode == 0  # intact, but whose?
    who = audit(stack, "verify-export", str(forged), "--pubkey", str(stack.home / "keys" / "evidence-ed25519.pub.pem"))
    assert who.returncode == 1 and "signer:" in who.stdout

    # negative control 1: one usage row tampered in ClickHouse (the worker owns chdb: stop it first)
    stack.stop_process("agent")
    stack.stop_process("worker")
    victim = next(decode(m.value) for m in read_topic(stack, LEDGER.name)
                  if decode(m.value).kind == "usage.accrued" and decode(m.value).payload.job_id == "acme/au-1")
    tamper = ("import sys; from infra.clickhouse import connect; c = connect(sys.argv[1]); "
              "c.command(\"ALTER TABLE gpupool.usage UPDATE gpu_milli_ms = gpu_milli_ms + 1 WHERE event_id = "
              "{e:String}\", parameters={'e': sys.argv[2]}, settings={'mutations_sync': 2})")
    done = subprocess.run([sys.executable, "-c", tamper, stack.env["GPUPOOL_CLICKHOUSE"], victim.event_id],
                          env={**os.environ, **stack.env}, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    bad = audit(stack, "replay", "--verify")
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert f"different: usage row {victim.event_id}" in bad.stdout and "gpu_milli_ms" in bad.stdout
    assert "scheduler outputs: compared" in bad.stdout and "different 0" in bad.stdout.splitlines()[0]

    # negative control 2: a recorded cmd.place produced again with another node, same event id
    place = next(decode(m.value) for m in read_topic(stack, COMMANDS.name)
                 if decode(m.value).kind == "cmd.place" and decode(m.value).payload.job_id == "acme/au-0")
    other = "node-001" if place.payload.node != "node-001" else "node-000"
    forged = place.model_copy(update={"payload": place.payload.model_copy(update={"node": other})})
    produce(stack, COMMANDS.name, [encode(forged)], keys=[other.encode()])  # only a broken service could
    bad = audit(stack, "replay", "--verify")
    assert bad.returncode == 1, bad.stdout + bad.stderr
    line = next(ln for ln in bad.stdout.splitlines() if ln.strip().startswith("different:") and "cmd.place" in ln)
    assert place.event_id in line and place.payload.command_id in line and other in line
