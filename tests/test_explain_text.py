"""`explain` and `history` as a person reads them (agents/cli/explain.py): local ISO times, every reason a sentence,
one block per gang with its parts, the isolation asked for, the cost so far; and no traceback on a closed pipe."""
from __future__ import annotations

import subprocess
import sys

from agents.cli import explain

T = 1_767_000_000_000


def ev(kind: str, dt: int = 0, at: str = "", reasons=(), actor: str = "", **payload) -> dict:
    return {"time_ms": T + dt, "kind": kind, "node": at, "actor": actor, "payload": payload,
            "reasons": list(reasons)}


def place(part: int, node: str, dt: int = 2000) -> dict:
    return ev("cmd.place", dt, node, [{"code": "Topology", "plugin": "Topology", "message": "",
                                       "data": {"level": "rack", "slowdown_pct": 40}}],
              node=node, attempt=1, gang_size=2, gang_index=part,
              assignments=[{"gpu_uuid": f"{node}-g{i}", "milli": 1000, "memory_mib": 81920} for i in range(4)])


EVENTS = [
    ev("job.requested", 0, actor="alice", compute_milli=8000, gpu_memory_mib=8 * 81920, tier="offline",
       project="llm", isolation="exclusive"),
    ev("job.pending", 1000, reasons=[{"code": "QuotaExceeded", "plugin": "Quota", "message": "",
                                      "data": {"used_milli": 8000, "quota_milli": 8000}}]),
    place(1, "node-001"), place(0, "node-000"),
    ev("job.started", 3000, "node-000", node="node-000", command_id="c1"),
    ev("usage.accrued", 63000, "node-000", node="node-000", gpu_milli_ms=4000 * 60_000, gpu_model="A100-80GB",
       start_ms=T + 3000, end_ms=T + 63000, gpu_milli=4000),
]
CARDS = {f"node-00{n}-g{i}": {"model": "A100-80GB", "generation": 8} for n in (0, 1) for i in range(4)}


def test_explain_says_every_reason_and_shows_a_gang_as_one_block_with_its_parts():
    lines = explain.explain_lines("acme/big", EVENTS, CARDS, cost="1.23 at the price book's rates")
    text = "\n".join(lines)
    assert lines[0].startswith("acme/big  tier offline, 8000 milli-CU") and "isolation exclusive" in lines[0]
    # an empty message is never a bare "Code:": the code's meaning and its data
    assert "[Quota] QuotaExceeded: over the tenant's quota" in text and "used_milli=8000" in text
    assert not any(ln.rstrip().endswith(":") for ln in lines)
    assert text.count("cmd.place") == 1 and "gang of 2 parts" in text
    parts = [ln.strip() for ln in lines if ln.strip().startswith("part ")]
    assert parts == ["part 1/2 on node-000: 4 card(s), 4000 milli-GPU (A100-80GB)",
                     "part 2/2 on node-001: 4 card(s), 4000 milli-GPU (A100-80GB)"]
    assert text.count("slowdown_pct=40") == 1  # the same reason on both parts is said once
    stamp = lines[1].split()[0]
    assert "T" in stamp and ("+" in stamp or "-" in stamp[10:] or stamp.endswith("Z"))  # local ISO time
    assert str(T) not in text  # never raw epoch milliseconds
    assert lines[-1] == "cost so far: 240.000 GPU-seconds, 1.23 at the price book's rates"


def test_history_lists_the_gang_once_and_the_bill():
    lines = explain.history_lines("acme/big", EVENTS, CARDS)
    text = "\n".join(lines)
    assert lines[0] == "acme/big"
    assert "isolation exclusive" in text and text.count("placed on") == 1 and "gang of 2 parts" in text
    assert "billed 240.000 GPU-s on node-000 (A100-80GB)" in text
    assert lines[-1] == "  cost so far: 240.000 GPU-seconds"


def test_isolation_absent_is_said_as_the_tiers_default():
    (line,) = explain.header("acme/x", [ev("job.requested", compute_milli=100, gpu_memory_mib=1024, tier="offline")])
    assert line.endswith("isolation shared (the tier's default)")


def test_a_closed_pipe_ends_quietly():
    # `gpupool --help | head -1`: the reader goes away; no BrokenPipeError traceback
    cmd = f"{sys.executable} -m agents.cli simulate --protocol fgd --help | head -1"
    out = subprocess.run(["bash", "-c", f"set -o pipefail; {cmd}"], capture_output=True, text=True, timeout=60)
    assert "Traceback" not in out.stderr and "BrokenPipe" not in out.stderr


def test_instants_inside_reasons_are_times_not_epoch_milliseconds():
    text = explain.reason_text({"code": "NodeLost", "plugin": "Lifecycle",
                                "message": f"node-1 has been silent for two heartbeats (last at {T} ms)",
                                "data": {"last_heartbeat_ms": T, "took_ms": 3136}})
    assert str(T) not in text and "took_ms=3136" in text  # a duration stays a number
    assert text.count("T") >= 2 and "last at 20" in text


def test_a_tenant_names_its_own_jobs_with_or_without_the_tenant_and_a_replica_with_its_service():
    """`gpupool --as alice explain chat/r2` is acme's service replica acme/chat/r2 (the id `gpupool jobs` lists),
    not a job "chat/r2" of nobody; an operator names TENANT/NAME as it is."""
    from pathlib import Path

    from agents.client import Client
    from infra.config import Config
    from infra.security import Credentials

    def client(role, tenant):
        c = Client(Config(home=Path("/nonexistent"), kafka=None, clickhouse="", kafka_port=0, web_port=0))
        c._creds = Credentials(name="x", role=role, tenant=tenant, password="", token="")
        return c

    alice = client("tenant", "acme")
    assert [alice.job_ref(j) for j in ("train", "acme/train", "chat/r2", "acme/chat/r2")] == \
        ["acme/train", "acme/train", "acme/chat/r2", "acme/chat/r2"]
    assert client("operator", None).job_ref("acme/chat/r2") == "acme/chat/r2"


def test_a_gang_placed_again_says_which_checkpoint_it_resumes_from():
    """A gang interrupted (a card fault on one part) is placed again, whole, from its last checkpoint: the block
    says so as a single job's placement does (found on the live stack: the gang's line said only "attempt 2")."""
    again = [dict(place(i, f"node-00{i}", 9000), payload={**place(i, f"node-00{i}")["payload"], "attempt": 2,
                                                           "resume_from": "ckpt:acme/big:20000"}) for i in (0, 1)]
    for lines in (explain.explain_lines("acme/big", EVENTS + again, CARDS),
                  explain.history_lines("acme/big", EVENTS + again, CARDS)):
        [line] = [ln for ln in lines if "(attempt 2)" in ln]
        assert line.endswith("gang of 2 parts (attempt 2), resuming from ckpt:acme/big:20000"), line
