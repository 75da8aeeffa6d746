"""The FGD-protocol simulator on the vendored openb sample (never the full trace)."""

import json
from pathlib import Path

import numpy as np
import pytest

from agents.sim.packing import PodRequest
from agents.sim import fgd_protocol as fp

DATA = Path(fp.__file__).parent / "data"
NODES_CSV = str(DATA / "openb_nodes_sample.csv")
PODS_CSV = str(DATA / "openb_pods_sample.csv")
SEEDS = [42, 43, 44]


@pytest.fixture(scope="module")
def sample():
    return fp.load_nodes(NODES_CSV), fp.load_pods(PODS_CSV)


@pytest.fixture(scope="module")
def runs(sample):
    nodes, pods = sample
    return {p: fp.run(nodes, pods, p, SEEDS, processes=1) for p in ("random", "bestfit", "fgd", "gpupool")}


def test_sample_is_small_and_loads(sample):
    nodes, pods = sample
    assert len(nodes.names) == 60 and nodes.gpu_capacity == 298_000
    assert len(pods) == 400
    assert sum((DATA / f).stat().st_size for f in ("openb_nodes_sample.csv", "openb_pods_sample.csv")) < 100_000


def test_cpu_only_nodes_are_left_out(tmp_path):
    csv = tmp_path / "n.csv"
    csv.write_text("sn,cpu_milli,memory_mib,gpu,model\na,32000,1024,0,\nb,64000,2048,2,T4\n")
    nodes = fp.load_nodes(str(csv))
    assert nodes.names == ("b",) and nodes.gpu_capacity == 2000


def test_pods_sorted_by_name(tmp_path):
    csv = tmp_path / "p.csv"
    csv.write_text("name,cpu_milli,memory_mib,num_gpu,gpu_milli\np2,2,1,1,1200\np1,1,1,0,0\n")
    pods = fp.load_pods(str(csv))
    assert [p.cpu_milli for p in pods] == [1, 2] and pods[1].gpu_milli == 1000


def test_arrival_sequence_shuffle_then_tail_with_stop_rule():
    pods = [PodRequest(1, 1, 1, 300), PodRequest(1, 1, 0, 0), PodRequest(1, 1, 2, 1000), PodRequest(1, 1, 1, 700)]
    demand = np.array([p.gpu_demand for p in pods])
    share = np.array([p.gpu_milli if p.num_gpu else 0 for p in pods])
    capacity = 5000
    seq = fp.arrival_sequence(pods, capacity, np.random.default_rng(7))
    # Replay the generator by hand: permutation first, then draws until the stop rule fires.
    rng = np.random.default_rng(7)
    assert list(seq[:4]) == list(rng.permutation(4))
    draws = rng.integers(0, 4, size=fp.DRAW_BATCH)
    total = demand.sum()
    for i, d in enumerate(draws):
        if total + share[d] > 1.3 * capacity:  # the check uses m, not m*k
            break
        total += demand[d]
    assert list(seq[4:]) == list(draws[:i])
    assert demand[seq].sum() == total <= 1.3 * capacity
    again = fp.arrival_sequence(pods, capacity, np.random.default_rng(7))
    assert np.array_equal(seq, again)
    assert not np.array_equal(seq, fp.arrival_sequence(pods, capacity, np.random.default_rng(8)))


def test_arrival_sequence_on_sample(sample):
    nodes, pods = sample
    seq = fp.arrival_sequence(pods, nodes.gpu_capacity, np.random.default_rng(42))
    assert sorted(seq[: len(pods)]) == list(range(len(pods)))
    total = sum(pods[i].gpu_demand for i in seq)
    assert 1.3 * nodes.gpu_capacity - 1000 < total <= 1.3 * nodes.gpu_capacity


def test_bucket_means_borrow_neighbours_when_empty():
    x = np.array([0, 0, 2, 2, 3])
    y = np.array([1.0, 3.0, 10.0, 20.0, 40.0])
    out = fp.bucket_means(x, y, max_x=3)
    assert out[0] == 2.0 and out[2] == 15.0 and out[3] == 40.0
    assert out[1] == pytest.approx((1 + 3 + 10 + 20) / 4)


def test_no_gpu_over_allocated_and_curves_sane(runs):
    for policy, results in runs.items():
        for r in results:
            assert not r.over_allocated, policy
            assert np.all(np.diff(r.allocation) >= -1e-9), policy  # allocation never shrinks
            assert 0 < r.allocation[130] <= 100 and r.failures > 0
            assert np.all((r.frag_ratio >= 0) & (r.frag_ratio <= 100))


def test_same_seed_same_result(sample, runs):
    nodes, pods = sample
    for policy in ("random", "gpupool"):
        again = fp.run_seed(nodes, pods, policy, 43)
        first = runs[policy][1]
        assert np.array_equal(first.allocation, again.allocation)
        assert np.array_equal(first.frag_ratio, again.frag_ratio, equal_nan=True)
    other = fp.run_seed(nodes, pods, "random", 44)
    assert not np.array_equal(runs["random"][1].allocation, other.allocation)


def test_product_policy_allocates_at_least_bestfit(runs):
    ours = np.mean([r.allocation[130] for r in runs["gpupool"]])
    bestfit = np.mean([r.allocation[130] for r in runs["bestfit"]])
    assert ours >= bestfit


def test_parse_seeds():
    assert fp.parse_seeds("42-45") == [42, 43, 44, 45]
    assert fp.parse_seeds("1,5-6") == [1, 5, 6]


def test_cli_last_line_is_json(capsys):
    rc = fp.run_cli(["--nodes", NODES_CSV, "--pods", PODS_CSV, "--seeds", "42-43", "--processes", "1", "--json"])
    assert rc == 0
    out = capsys.readouterr().out.strip().splitlines()
    summary = json.loads(out[-1])
    for key in ("allocation_pct_at_100", "allocation_pct_at_130", "per_seed",
                "frag_ratio_at_90", "frag_ratio_at_100", "frag_ratio_at_130"):
        assert key in summary
    assert summary["policy"] == "gpupool" and len(summary["per_seed"]) == 2
    assert summary["allocation_pct_at_130"] == pytest.approx(
        np.mean([s["allocation_pct_at_130"] for s in summary["per_seed"]]), abs=1e-3)


def test_cli_table_and_bad_input(capsys):
    assert fp.run_cli(["--nodes", NODES_CSV, "--pods", PODS_CSV, "--policy", "bestfit",
                       "--seeds", "42", "--processes", "1"]) == 0
    assert "alloc@130" in capsys.readouterr().out
    assert fp.run_cli(["--nodes", "/nonexistent.csv", "--pods", PODS_CSV]) == 2
    assert fp.run_cli(["--nodes", NODES_CSV, "--pods", PODS_CSV, "--policy", "nope"]) != 0


def test_arrivals_past_the_last_bucket_are_not_attempted_and_change_nothing(sample):
    nodes, pods = sample
    # A fleet of half the sample's nodes: the shuffled pod list alone runs far past 130 % of its capacity.
    half = fp.NodeTable(*(col[: len(nodes.names) // 2] for col in
                          (nodes.names, nodes.cpu_milli, nodes.memory_mib, nodes.gpu_count, nodes.models)))
    for policy in ("random", "gpupool"):
        cut = fp.run_seed(half, pods, policy, 42)
        whole = fp.run_seed(half, pods, policy, 42, whole=True)
        assert cut.attempts < whole.attempts
        for a, b in ((cut.allocation, whole.allocation), (cut.frag_ratio, whole.frag_ratio),
                     (cut.frag_amount, whole.frag_amount)):
            np.testing.assert_array_equal(a, b)
    # On the whole sample the pod list stops below 130 %: nothing is cut.
    seq = fp.arrival_sequence(pods, nodes.gpu_capacity, np.random.default_rng(0))
    assert fp.horizon(pods, seq, nodes.gpu_capacity) == len(seq)


# ------------------------------------------------------------- the product row is the live scheduler


def test_the_product_row_is_the_live_scheduler_and_nothing_else(sample):
    """The protocol's `gpupool` row is produced by agents.scheduler.core.Scheduler: handed any other policy object
    (the simulator's FGD, or a look-alike) it refuses, and the scheduler it was handed is the one that decided."""
    from agents.scheduler.core import Scheduler
    from agents.scheduler.quota import open_ledger
    from agents.sim.packing import FGDPolicy, typical_pods

    nodes, pods = sample
    for other in (FGDPolicy(typical_pods(pods)), object()):
        with pytest.raises(TypeError, match="agents.scheduler.core.Scheduler"):
            fp.run_seed(nodes, pods, fp.PRODUCT, 42, scheduler=other)
    s = Scheduler(ledger=open_ledger())
    got = fp.run_seed(nodes, pods, fp.PRODUCT, 42, scheduler=s)
    # the scheduler handed in is the one that decided: it saw every GPU arrival, and what it holds is what the row
    # counted as placed (failures were withdrawn: nothing of theirs is held or waits)
    gpu_arrivals = s.arrivals
    held = sum(a.milli for rec in s.jobs.values() if rec.phase in ("placed", "running")
               for part in rec.parts for a in part.assignments)
    assert gpu_arrivals > 0 and not s.pending and held > 0
    assert sum(1 for rec in s.jobs.values() if rec.phase in ("placed", "running")) <= got.attempts - got.failures


def test_protocol_replay_decides_what_scheduler_replay_decides_for_the_same_events(sample):
    """The row's decisions are the live scheduler's: replaying the very events the protocol fed it
    (`agents.scheduler.core.replay`, the worker's rebuild and the audit's entry) on a fresh Scheduler gives the same
    outputs, record for record, and the placements the row counted are the cmd.place commands among them."""
    from agents.scheduler.core import replay
    from agents.scheduler.quota import open_ledger
    from agents.sim.live_protocol import run_live

    nodes, pods = sample
    rng = np.random.default_rng(7)
    seq = fp.arrival_sequence(pods, nodes.gpu_capacity, rng)
    outcomes = []
    run = run_live(nodes, pods, seq, lambda pod, node: outcomes.append(node))
    assert len(outcomes) == len(seq)
    kinds = {e.kind for e in run.inputs}
    assert {"node.inventory", "job.requested", "job.started"} <= kinds
    _, again = replay(run.inputs, ledger=open_ledger())
    live = [o for outs in run.outputs for o in outs]
    assert [o.payload for o in again] == [o.payload for o in live]
    placed = {o.payload.job_id: (o.payload.node, tuple((a.gpu_uuid, a.milli) for a in o.payload.assignments))
              for o in again if o.kind == "cmd.place"}
    # every pod the row counted as placed, CPU-only ones too, is a cmd.place of the scheduler
    assert placed == run.placed and len(placed) == sum(1 for o in outcomes if o is not None)
    assert any(not pods[pi].num_gpu for pi in seq) and all(not a for j, (_, a) in placed.items()
                                                           if not pods[seq[int(j[1:])]].num_gpu)
