"""The lifecycle and money commands as a person types them, on the live stack (#13 items 3 and 6): cancel, node
list/show/cordon/uncordon/drain, quota show, jobs with filters and columns, history, prices show/set/load and
billing --cost; and bad input as one line, never a traceback."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from schemas.events import JobRequested, QuotaSet
from tests.live import cli, job_states, live_pool, wait_for

pytestmark = pytest.mark.broker


@pytest.fixture(scope="module")
def pool(tmp_path_factory, broker_mode, libs_home):
    # node-000: A100-80GB x4, node-001: H100-80GB x4
    with live_pool(tmp_path_factory, broker_mode, libs_home, "cli", [
            ("alice", "tenant", "acme"), ("fin", "finance", None), ("bob", "tenant", "globex")],
            quota_for=("acme",)) as s:
        yield s


def test_cancel_a_running_job_and_read_its_history(pool):
    out = cli(pool, "submit", "--compute", "1000", "--memory-gib", "40", "--duration", "300", "--job-id", "long",
              "--checkpoint-every", "2", user="alice")
    assert out.strip() == "acme/long"
    wait_for(lambda: job_states(pool, "alice").get("acme/long", {}).get("state") == "running", 60, "running", pool)
    wait_for(lambda: "checkpoint at" in cli(pool, "history", "long", user="alice"), 30, "a checkpoint", pool)
    assert cli(pool, "cancel", "long", "--reason", "wrong data", user="alice").strip() == "acme/long"
    row = wait_for(lambda: (r := job_states(pool, "alice").get("acme/long", {})).get("state") == "cancelled" and r,
                   30, "cancelled", pool)
    assert row["tier"] == "offline" and row["compute_milli"] == 1000 and row["cards"] == 1
    assert row["nodes"] in ("node-000", "node-001") and row["elapsed_s"] > 0 and row["wait_s"] >= 0
    history = wait_for(lambda: "cost so far: 0.000 GPU" not in (h := cli(pool, "history", "long", user="alice"))
                       and h, 30, "the bill in the history", pool)
    lines = history.splitlines()
    assert lines[0] == "acme/long"
    # the end of a run is billed before its cards are released: the order the scheduler wrote them (docs/billing.md)
    order = ["requested 1000 milli-CU", "placed on", "started on", "checkpoint at", "cancelled by alice: wrong data",
             "billed ", "released on"]
    at = [next(i for i, ln in enumerate(lines) if want in ln) for want in order]
    assert at == sorted(at), history
    assert "T" in lines[1].split()[0] and ("+" in lines[1].split()[0] or "Z" in lines[1])  # ISO times
    # filters
    assert [r[0] for r in pool.client("alice").rows("/api/jobs", {"state": "cancelled"})[1]] == ["acme/long"]
    assert pool.client("alice").rows("/api/jobs", {"state": "running"})[1] == []
    assert pool.client("alice").rows("/api/jobs", {"tier": "inference"})[1] == []


def test_node_commands_cordon_drain_and_show(pool):
    listing = cli(pool, "node", "list")
    assert "node-000" in listing and "ready" in listing and "A100-80GB x4" in listing
    said = cli(pool, "node", "cordon", "node-001", "--reason", "firmware")
    assert said.strip() == "node-001: cordoned", said  # the command says what it did: the node's new state
    wait_for(lambda: "cordoned" in cli(pool, "node", "list"), 30, "node-001 cordoned", pool)
    # a cordoned node has no GPUs free to take work (as `gpupool cluster` counts): its idle ones are said apart
    rows = {line.split()[0]: line for line in cli(pool, "node", "list").splitlines()[1:]}
    assert "- (" in rows["node-001"] and " idle)" in rows["node-001"] and "- (" not in rows["node-000"], rows
    # work goes elsewhere while it is cordoned
    pool.client("alice").send([JobRequested(job_id="while-cordoned", tenant="acme", compute_milli=300,
                                            gpu_memory_mib=4096, duration_s=30)])
    row = wait_for(lambda: (r := job_states(pool).get("acme/while-cordoned", {})).get("state") == "running" and r,
                   60, "placed", pool)
    assert row["nodes"] == "node-000"
    show = cli(pool, "node", "show", "node-000")
    assert "acme/while-cordoned" in show and "card 0 A100-80GB" in show
    doc = json.loads(cli(pool, "node", "show", "node-000", "--format", "json"))
    assert any("acme/while-cordoned" in g["holders"] for g in doc["cards"])
    assert cli(pool, "node", "drain", "node-000").strip() == "node-000: draining"
    wait_for(lambda: "draining" in cli(pool, "node", "list"), 30, "node-000 draining", pool)
    assert cli(pool, "node", "uncordon", "node-000", "node-001").split() == ["node-000:", "ready", "node-001:", "ready"]
    wait_for(lambda: cli(pool, "node", "list").count("ready") == 2, 30, "both ready again", pool)
    actors = {(r["kind"], r["actor"]) for r in pool.query(
        "SELECT kind, actor FROM gpupool.events FINAL WHERE kind = 'node.cordon'")}
    assert actors == {("node.cordon", "admin")}
    # a tenant may look, not act, and never sees another tenant's job names
    bad = cli(pool, "node", "cordon", "node-000", user="alice", check=False)
    assert bad.returncode == 0  # the request is sent; the gateway refuses it where alice can read it
    wait_for(lambda: pool.query("SELECT count() AS n FROM gpupool.events FINAL WHERE kind = 'request.rejected' "
                                "AND actor = 'alice'")[0]["n"] >= 1, 30, "alice's cordon refused", pool)
    assert "ready" in cli(pool, "node", "list", user="alice")


def test_quota_show_and_the_bill_in_money(pool):
    admin = pool.client()
    admin.send([QuotaSet(tenant="acme", gpu_milli=8000, overcommit_pct=150),
                QuotaSet(tenant="acme", project="research", gpu_milli=2000)])
    pool.client("alice").send([JobRequested(job_id="paid", tenant="acme", project="research", compute_milli=1000,
                                            gpu_memory_mib=40 * 1024, duration_s=2,
                                            constraints={"models": ["A100-80GB"]})])
    wait_for(lambda: job_states(pool).get("acme/paid", {}).get("state") == "completed", 60, "paid", pool)
    shown = wait_for(lambda: "research" in (q := cli(pool, "quota", "show", "acme", user="alice")) and q, 30,
                     "quota rows", pool)
    tenant_row = next(ln for ln in shown.splitlines() if ln.startswith("acme") and "(tenant)" in ln)
    assert "8000" in tenant_row and "150%" in tenant_row and "admin" in tenant_row
    assert "2000" in next(ln for ln in shown.splitlines() if "research" in ln)
    # prices: the book an operator loads, a price set for a model, and the bill priced with it
    book = pool.home / "book.yaml"
    book.write_text("prices:\n  - {gpu_model: A100-80GB, per_gpu_hour: 3.60}\n"
                    "  - {gpu_model: A100-80GB, per_gpu_hour: 7.20, borrowed: true}\n")
    cli(pool, "prices", "load", str(book), "--valid-from", "2020-01-01T00:00:00")
    cli(pool, "prices", "set", "--model", "H100-80GB", "--per-gpu-hour", "5", "--valid-from", "2020-01-01")
    prices = wait_for(lambda: "H100-80GB" in (p := cli(pool, "prices", "show", user="fin")) and p, 30, "prices",
                      pool)
    assert "3.60" in prices and "7.20" in prices and "5.00" in prices
    bill = wait_for(lambda: (rows := json.loads(cli(pool, "billing", "--cost", "--by", "job", "--format", "json",
                                                     user="fin")))
                    and any(r["job_id"] == "acme/paid" for r in rows) and rows, 30, "the priced bill", pool)
    paid = next(r for r in bill if r["job_id"] == "acme/paid")
    usage = pool.query("SELECT sum(gpu_milli_ms) AS ms FROM gpupool.usage FINAL WHERE job_id = 'acme/paid'")[0]
    # 3.60 a GPU-hour = 3,600,000 micro-units per 3,600,000,000 milli-GPU-ms: one micro-unit per 1,000 milli-GPU-ms
    assert paid["cost_micro"] == int(usage["ms"]) // 1000 > 0 and paid["unpriced_gpu_hours"] == 0
    assert paid["borrowed_cost"] == "0.00" and paid["currency"] == "USD" and paid["borrowed_micro"] == 0
    # the bill in the currency's minor unit, rounded half up from the exact micro-units (docs/billing.md)
    assert paid["cost"] == f"{(paid['cost_micro'] + 5_000) // 10_000 / 100:.2f}"
    # the tenant sees its own bill in money, not finance's view of everyone
    mine = json.loads(cli(pool, "billing", "--cost", "--format", "json", user="alice"))
    assert {r["tenant"] for r in mine} == {"acme"}


@pytest.mark.parametrize("argv,field", [
    (["quota", "set", "acme", "--compute", "100", "--overcommit-pct", "500"], "--overcommit-pct"),
    (["submit", "--tenant", "acme", "--compute", "lots", "--memory-gib", "1"], "--compute"),
    (["jobs", "--since", "yesterday-ish"], "yesterday-ish"),
    (["prices", "set", "--model", "A100-90GB", "--per-gpu-hour", "1"], "gpu_model"),
    (["prices", "load", "/nonexistent/book.yaml"], "book.yaml"),
    (["node", "show"], "node show needs one NODE"),
    (["submit", "--tenant", "acme", "--compute", "-5", "--memory-gib", "1"], "compute_milli: Input should be greater"),
    (["quota", "set", "acme", "--compute", "-3"], "gpu_milli"),
    (["explain", "acme/x", "--as", "nobody"], "no credentials for principal 'nobody'"),
])
def test_bad_input_is_one_line_naming_the_field(pool, argv, field):
    out = subprocess.run([sys.executable, "-m", "agents.cli", *argv], env={**os.environ, **pool.env},
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert "Traceback" not in out.stderr and field in out.stderr, out.stderr


def test_reserve_list_shows_a_booking_and_where_it_stands(pool):
    """A tenant sees its bookings and the scheduler's latest word on each (accepted, active on a node, used,
    cancelled...); another tenant sees none of them, an operator all."""
    import time

    start = (int(time.time()) + 3600) * 1000
    rid = cli(pool, "reserve", "book", "--compute", "1000", "--memory-gib", "10", "--start", str(start), "--hours",
              "1", user="alice").strip()
    assert rid.startswith("acme/res-")

    def listed(user, status):
        rows = json.loads(cli(pool, "reserve", "list", "--format", "json", user=user))
        return next((r for r in rows if r["reservation_id"] == rid and r["status"] == status), None)

    row = wait_for(lambda: listed("alice", "accepted"), 30, "the booking listed as accepted", pool)
    assert (row["tenant"], row["start_ms"], row["end_ms"], row["compute_milli"], row["booked_by"]) == \
        ("acme", start, start + 3_600_000, 1000, "alice") and "Booked" in row["reasons"], row
    assert "res-" in cli(pool, "reserve", "list", user="alice").splitlines()[1]  # the table: one line a booking
    assert rid in cli(pool, "reserve", "list")  # the operator
    assert rid not in cli(pool, "reserve", "list", user="bob")
    cli(pool, "reserve", "cancel", rid.split("/", 1)[1], user="alice")
    wait_for(lambda: listed("alice", "cancelled"), 30, "the booking listed as cancelled", pool)
    # one that starts now is held on a node: `node show` says so, though no command reached the node
    rid = cli(pool, "reserve", "book", "--compute", "500", "--memory-gib", "10", "--hours", "1", user="alice").strip()
    row = wait_for(lambda: listed("alice", "active"), 30, "the booking held on a node", pool)
    shown = cli(pool, "node", "show", row["node"])
    kept = next(ln for ln in shown.splitlines() if ln.strip().startswith(f"kept for reservation {rid} ("))
    assert "milli-GPU, 10 GiB on card(s) " in kept and kept.endswith("not free to other work"), shown
    # the node list and the cluster count the hold out of what is free (the node's own view shows it free)
    doc = json.loads(cli(pool, "node", "show", row["node"], "--format", "json"))
    (hold,) = doc["holds"]
    card = next(g for g in doc["cards"] if g["uuid"] in hold["cards"])
    assert hold["reservation_id"] == rid and hold["memory_mib"] == 10 * 1024 and card["reserved_milli"] == hold["milli"]
    in_list = next(ln.split() for ln in cli(pool, "node", "list").splitlines() if ln.startswith(row["node"]))
    assert in_list[5] == f"{hold['milli'] / 1000:.2f}", in_list
    assert f"kept for reservations: {hold['milli'] / 1000:.2f} GPUs" in cli(pool, "cluster")
    assert "a reservation of another tenant" in cli(pool, "node", "show", row["node"], user="bob")
    cli(pool, "reserve", "cancel", rid, user="alice")
    wait_for(lambda: listed("alice", "cancelled"), 30, "the held booking cancelled", pool)


def test_quota_set_says_whether_it_is_in_force_or_refused(pool):
    """A project quota beyond its tenant's is refused by the scheduler (quota.rejected); the command says so and
    fails, instead of returning as if the quota were set. One that fits is read back in force."""
    out = cli(pool, "quota", "set", "acme", "--project", "huge", "--compute", "900000", check=False)
    assert out.returncode == 1, out
    assert "acme/huge: refused (ProjectQuotasExceedTenant); the quota in force is still none" in out.stderr, out.stderr
    out = cli(pool, "quota", "set", "acme", "--project", "small", "--compute", "1000")
    assert out.strip() == "acme/small: quota 1000 milli-CU, cap 120%, in force"
    shown = cli(pool, "quota", "show", "acme")
    assert "small" in shown and "huge" not in shown  # an account known only by a refused set is not listed


def test_cancel_says_when_no_such_job_is_on_record(pool):
    """A tenant's member names its own tenant's jobs: "globex/x" from alice is acme's "acme/globex/x", which nobody
    submitted -- the cancel says so and fails, rather than print the name as if it were done."""
    out = cli(pool, "cancel", "globex/x", user="alice", check=False)
    assert out.returncode == 1 and out.stdout.strip() == "acme/globex/x", out
    assert "no job acme/globex/x on record" in out.stderr and "names its jobs alone" in out.stderr, out.stderr
    out = cli(pool, "cancel", "never-submitted", user="alice", check=False)
    assert out.returncode == 0 and "no job acme/never-submitted on record (yet)" in out.stderr, out.stderr


def test_a_closed_pipe_ends_quietly(pool):
    for i in range(3):
        pool.client("alice").send([JobRequested(job_id=f"pipe-{i}", tenant="acme", compute_milli=100,
                                                gpu_memory_mib=1024, duration_s=1)])
    env = {**os.environ, **pool.env}
    for argv in (["jobs"], ["history", "acme/long"], ["node", "list"]):
        cmd = f"{sys.executable} -m agents.cli {' '.join(argv)} | head -1"
        out = subprocess.run(["bash", "-c", cmd], env=env, capture_output=True, text=True, timeout=60)
        assert "Traceback" not in out.stderr and "BrokenPipe" not in out.stderr, out.stderr


def test_submit_reads_back_the_schedulers_answer(pool):
    """Like sbatch, `submit` says what became of the request -- placed where, waiting why, rejected why (exit 1) --
    on stderr, the job's name alone on stdout; the same request again is said to change nothing, a different one
    under a used id is said to be refused."""
    out = cli(pool, "submit", "--compute", "300", "--memory-gib", "4", "--duration", "600", "--job-id", "answered",
              user="alice", check=False)
    assert out.returncode == 0 and out.stdout.strip() == "acme/answered", out
    assert "gpupool submit: acme/answered: placed on node-00" in out.stderr and "milli-GPU (" in out.stderr, out
    out = cli(pool, "submit", "--compute", "300", "--memory-gib", "4", "--duration", "600", "--job-id", "answered",
              user="alice", check=False)
    assert out.returncode == 0 and "the same request is on record already" in out.stderr, out
    # where it stands, as the jobs list says it (its view's fold: gpupool.jobs), once the sink has stored it
    assert ("; running on node-00" in out.stderr or "; pending" in out.stderr
            or "; " not in out.stderr.split("already", 1)[1]), out.stderr
    out = cli(pool, "submit", "--compute", "600", "--memory-gib", "4", "--duration", "600", "--job-id", "answered",
              user="alice", check=False)
    assert out.returncode == 1 and out.stdout.strip() == "acme/answered", out
    assert "acme/answered: rejected: duplicate_job_id" in out.stderr and "[Admission] DuplicateJobId" in out.stderr
    out = cli(pool, "submit", "--compute", "300", "--memory-gib", "4", "--model", "B200", user="alice", check=False)
    assert out.returncode == 1 and "rejected: unsatisfiable" in out.stderr and "ModelNotAllowed" in out.stderr, out
    out = cli(pool, "submit", "--compute", "300", "--memory-gib", "4", user="bob", check=False)
    assert out.returncode == 0 and ": waiting" in out.stderr and "[Quota] NoQuota" in out.stderr, out
    out = cli(pool, "submit", "--compute", "300", "--memory-gib", "4", "--wait", "0", user="bob", check=False)
    assert out.returncode == 0 and out.stdout.startswith("globex/job-") and out.stderr == "", out
    # refused at the gateway's door (never stored as a request): said too, not "no answer" (#31)
    out = cli(pool, "submit", "--compute", "300", "--memory-gib", "4", "--job-id", "z" * 170, user="alice",
              check=False)
    assert out.returncode == 1 and "rejected at the gateway (invalid)" in out.stderr, out
    assert "at most 160 (the tenant's prefix included)" in out.stderr, out
    out = cli(pool, "submit", "--compute", "300", "--memory-gib", "4", "--job-id", "a\u202eb", user="alice",
              check=False)  # refused by the CLI itself, in words, the id quoted escaped
    assert out.returncode == 2 and "job_id: not an id (letters, digits" in out.stderr, out
    assert "\u202e" not in out.stderr and "a\\u202eb" in out.stderr, out
