"""The colocation protocol (agents/sim/colocation.py) on the vendored samples, never /work/shared: a small fleet run
both ways, the metrics on hand-checkable cases, the node-agent model against a scripted scheduler, determinism."""
from __future__ import annotations

import io
import json
from contextlib import redirect_stdout
from datetime import datetime

import numpy as np
import pytest

from agents.sim import colocation as co
from agents.sim import colocation_traces as tr
from schemas.envelope import envelope
from schemas.events import (
    Assignment, JobCheckpointed, JobCompleted, JobRequested, JobStopped, PlaceJob, PreemptJob, ReleaseJob,
    SchedulerTick,
)

SMALL = ["--gpus", "64", "--hours", "3", "--seed", "7", "--json"]


def run_json(argv: list[str]) -> dict:
    buf = io.StringIO()
    with redirect_stdout(buf):
        assert co.run_cli(argv) == 0
    return json.loads(buf.getvalue().strip().splitlines()[-1])


@pytest.fixture(scope="module")
def small() -> dict:
    return run_json(SMALL)


# ---------------------------------------------------------------- the samples and the loaders

def test_samples_are_vendored_and_small():
    assert tr.QPS_SAMPLE.exists() and tr.PHILLY_SAMPLE.exists()
    assert tr.QPS_SAMPLE.stat().st_size + tr.PHILLY_SAMPLE.stat().st_size < 250_000
    q = tr.load_qps(tr.QPS_SAMPLE)
    assert set(q.series) == {"genai-api", "genai-generative"}
    assert 20 * 3600 < q.span_s < 24 * 3600  # the whole ~22 h curve, on the 57 s grid
    jobs = tr.load_philly(tr.PHILLY_SAMPLE)
    assert len(jobs) > 1000 and all(j.submitted >= datetime(2017, 10, 10) for j in jobs)


def test_qps_is_summed_over_containers_per_grid_step(tmp_path):
    f = tmp_path / "q.csv"
    f.write_text("timestamp_anon,value,container_ip,request_type\n"
                 "1000.0,0.5,a,Generative Requests\n1000.0,0.25,b,Generative Requests\n"
                 "1114.0,1.0,a,Generative Requests\n1057.0,2.0,,API Requests\n")
    q = tr.load_qps(f)
    assert q.step_s == 57 and q.t0 == 1000.0
    assert list(q.series["genai-generative"]) == [0.75, 0.0, 1.0]
    assert list(q.series["genai-api"]) == [0.0, 2.0, 0.0]
    f.write_text("timestamp_anon,value,container_ip,request_type\n1000.0,1,a,X\n1010.0,1,a,X\n")
    with pytest.raises(ValueError, match="grid"):
        tr.load_qps(f)


def test_backlog_takes_jobs_until_the_target_and_compresses_their_arrivals():
    t = datetime(2017, 10, 10)
    rows = [tr.PhillyJob(t.replace(hour=h), d, g, "c") for h, d, g in ((0, 3600, 1), (2, 100_000, 16), (4, 3600, 2),
                                                                       (6, 60, 1))]
    # work: 1 h x 1, then capped 2 h x one node's 8 GPUs, then 1 h x 2 -> 19 GPU-h after three jobs
    b = tr.training_backlog(rows, t, span_s=1800, target_gpu_s=18 * 3600, max_duration_s=7200, max_gpus=8)
    assert [j.gpus for j in b.jobs] == [1, 8, 2] and [j.duration_s for j in b.jobs] == [3600, 7200, 3600]
    assert b.offered_gpu_s == 19 * 3600 and b.passes == 1
    assert b.compression == pytest.approx(4 * 3600 / 1799)  # four trace hours into the span (last job at span - 1 s)
    assert [round(j.submit_s) for j in b.jobs] == [0, 900, 1799]
    # a target beyond the file replays it after itself
    b2 = tr.training_backlog(rows, t, span_s=1800, target_gpu_s=30 * 3600, max_duration_s=7200, max_gpus=8)
    assert b2.passes == 2 and len(b2.jobs) == 6  # 19.02 GPU-h per pass; 1 + 16 more GPU-h of the second


def test_demand_peak_is_scaled_to_the_fleet_share():
    p = co.Params(gpus=128, hours=22, seed=1)
    w = co.build_workload(p, tr.load_qps(tr.QPS_SAMPLE), None)
    assert w.peak_gpus == pytest.approx(0.6 * 128)
    # the Poisson noise moves the per-tick demand a little around the scaled curve, never far above its peak
    assert 0.55 * 128 < w.demand_gpus().sum(axis=1).max() < 0.7 * 128
    assert co.split_sizes(p, w) == (10, 6)  # 76.8 GPUs -> 10 nodes of 8; the rest trains


# ---------------------------------------------------------------- metrics on hand-checkable cases

def _steps(*pairs):
    return [(co.T0_MS + int(t * 1000), c) for t, c in pairs]


def test_served_within_grace_and_unmet_on_a_step():
    shapes = {"s": co.ServiceShape(1000, 1024, 10, 500)}
    demand = np.full((10, 1), 1.0)  # 1 GPU of demand for 100 s (ticks of 10 s)
    late = co.demand_coverage(demand, {"s": _steps((0, 0.0), (20, 10.0))}, ["s"], shapes, 10, 100, 30)
    assert late["served_pct"] == pytest.approx(100.0) and late["unmet_pct"] == pytest.approx(20.0)
    later = co.demand_coverage(demand, {"s": _steps((0, 0.0), (40, 10.0))}, ["s"], shapes, 10, 100, 30)
    # seconds 0..9 see no capacity within 30 s; from second 10 on, the capacity of second 40 counts
    assert later["served_pct"] == pytest.approx(90.0) and later["unmet_pct"] == pytest.approx(40.0)
    half = co.demand_coverage(demand, {"s": _steps((0, 5.0))}, ["s"], shapes, 10, 100, 30)
    assert half["served_pct"] == pytest.approx(50.0) and half["unmet_pct"] == pytest.approx(50.0)


def _training_only(p: co.Params, jobs) -> co.Workload:
    n = -(-p.span_s // p.tick_s)
    return co.Workload((), {}, np.zeros((n, 0)), tuple(jobs), 1.0, 0.0, 0.0, None)


def _job(i, submit_s, gpus=8, duration_s=1000):
    return tr.TrainingJob(f"j{i}", "t", submit_s, gpus, duration_s, gpus, duration_s)


@pytest.mark.parametrize("label", ["split", "unified"])
def test_one_job_queueing_and_jct_are_exact(label):
    p = co.Params(gpus=8, hours=1, start_jitter=0.0)
    w = _training_only(p, [_job(0, 100)])
    r = co.FleetSim(p, w, co.make_pools(label, p, w), label).run()
    # placed at 100 s, started after the 60 s training start, runs its 1000 s, released at 1160 s
    assert r["training_mean_queueing_s"] == 60.0 and r["training_p99_queueing_s"] == 60.0
    assert r["training_mean_jct_s"] == 1060.0
    assert r["allocated_gpu_hours_pct"] == pytest.approx(100 * 8 * 1060 / (8 * 3600), abs=1e-3)
    assert r["preemptions"] == 0 and r["migrations"] == 0 and r["training_completed"] == 1


def test_two_jobs_on_one_node_queue_behind_each_other():
    p = co.Params(gpus=8, hours=1, start_jitter=0.0)
    w = _training_only(p, [_job(0, 100), _job(1, 100)])
    r = co.FleetSim(p, w, co.make_pools("unified", p, w), "unified").run()
    # j1 is placed when j0 completes (1160 s), starts at 1220 s, completes at 2220 s
    assert r["training_mean_queueing_s"] == (60 + 1120) / 2
    assert r["training_p99_queueing_s"] == pytest.approx(60 + 0.99 * 1060, abs=0.1)
    assert r["training_mean_jct_s"] == (1060 + 2120) / 2
    assert r["allocated_gpu_hours_pct"] == pytest.approx(100 * (1060 + 1060) / 3600, abs=1e-3)


class Scripted:
    """A scheduler that places every request on n0, preempts it once at 300 s and places it again when it stops."""

    def __init__(self):
        self.seq = 0
        self.ckpt = ""
        self.preempted = False
        self.seen: list[tuple[str, int]] = []
        self.ckpts: list[tuple[int, str]] = []

    def out(self, payload, t):
        self.seq += 1
        return envelope(payload, source="scripted", seq=self.seq, time_ms=t)

    def place(self, job: JobRequested, t):
        return self.out(PlaceJob(command_id=f"c{self.seq + 1}", job_id=job.job_id, tenant=job.tenant, node="n0",
                                 assignments=(Assignment(gpu_uuid="GPU-n0-0", milli=1000, memory_mib=1024),),
                                 duration_s=job.duration_s, checkpoint_interval_s=job.checkpoint_interval_s,
                                 resume_from=self.ckpt), t)

    def step(self, env):
        p, t = env.payload, env.event_time_ms
        self.seen.append((p.kind, t - co.T0_MS))
        if isinstance(p, JobRequested):
            self.job = p
            return [self.place(p, t)]
        if isinstance(p, SchedulerTick) and t - co.T0_MS >= 300_000 and not self.preempted:
            self.preempted = True
            return [self.out(PreemptJob(command_id="pre", job_id=self.job.job_id, node="n0", grace_s=30), t)]
        if isinstance(p, JobCheckpointed):
            self.ckpt = p.checkpoint
            self.ckpts.append((t - co.T0_MS, p.checkpoint))
        if isinstance(p, JobStopped):
            return [self.out(ReleaseJob(command_id="rel1", job_id=p.job_id, node="n0"), t), self.place(self.job, t)]
        if isinstance(p, JobCompleted):
            return [self.out(ReleaseJob(command_id="rel2", job_id=p.job_id, node="n0"), t)]
        return []


def test_node_agent_checkpoints_on_preempt_and_resumes_what_is_left():
    p = co.Params(gpus=8, hours=1, start_jitter=0.0, checkpoint_s=100)
    w = _training_only(p, [_job(0, 0, gpus=1)])
    s = Scripted()
    sim = co.FleetSim(p, w, [co.Pool("fleet", s, ["n0"], [], True)], "unified")
    r = sim.run()
    # started at 60 s: periodic checkpoints at 160, 260; the preempt at 300 s stops it at 330 s with 270 s done
    assert s.ckpts[:3] == [(160_000, "ckpt:j0:100000"), (260_000, "ckpt:j0:200000"), (330_000, "ckpt:j0:270000")]
    # the resumed run checkpoints from where it resumed: started at 390 s, 270 s + 100 s done at 490 s
    assert s.ckpts[3] == (490_000, "ckpt:j0:370000")
    assert ("job.stopped", 330_000) in s.seen
    # placed again at 330 s, started at 390 s, 730 s of work left: completed at 1120 s
    assert ("job.completed", 1_120_000) in s.seen
    assert r["training_mean_jct_s"] == 1120.0 and r["training_mean_queueing_s"] == 60.0
    assert r["preemptions"] == 1 and r["migrations"] == 0
    # held from 0 to 330 s and from 330 s to 1120 s
    assert r["allocated_gpu_hours_pct"] == pytest.approx(100 * 1 * 1120 / (8 * 3600), abs=1e-3)


# ---------------------------------------------------------------- the small fleet, both ways

def test_json_has_every_key_in_sane_ranges(small):
    assert set(small) == {"split", "unified"}
    for m in ("split", "unified"):
        r = small[m]
        for k in co.REQUIRED_KEYS:
            assert k in r, (m, k)
        assert 0 < r["allocated_gpu_hours_pct"] <= 100
        assert 0 <= r["unmet_inference_pct"] <= 100 and 0 <= r["inference_served_within_30s_pct"] <= 100
        assert r["inference_served_within_30s_pct"] + r["unmet_inference_pct"] >= 100 - 1e-6
        assert 0 < r["training_mean_queueing_s"] <= 3 * 3600 and 0 < r["training_p99_queueing_s"] <= 3 * 3600
        assert r["training_completed"] == 0 or 60 * 0.8 < r["training_mean_jct_s"] <= 3 * 3600
        assert r["preemptions"] >= 0 and r["migrations"] >= 0
        assert r["fleet_gpus"] == 64 and sum(r["pools"].values()) == 64
    assert small["split"]["preemptions"] == 0  # nothing to preempt: the pools do not mix


def test_unified_allocates_more_than_split_on_the_sample(small):
    u, s = small["unified"], small["split"]
    assert u["allocated_gpu_hours_pct"] > s["allocated_gpu_hours_pct"]
    assert u["allocated_training_gpu_hours"] > s["allocated_training_gpu_hours"]
    assert u["training_started"] >= s["training_started"]


def test_allocation_agrees_with_the_schedulers_usage_ledger():
    """The allocation integral (commands) bounds the usage the scheduler bills (job.started .. end): usage is the
    allocation less start latencies and the open runs at the end."""
    p = co.Params(gpus=32, hours=2, seed=3)
    w = co.build_workload(p, tr.load_qps(tr.QPS_SAMPLE), tr.load_philly(tr.PHILLY_SAMPLE))
    sim = co.FleetSim(p, w, co.make_pools("unified", p, w), "unified")
    r = sim.run()
    billed_h = sum(sim.usage_milli_ms.values()) / 1000 / 3_600_000
    held_h = r["allocated_inference_gpu_hours"] + r["allocated_training_gpu_hours"]
    assert 0.5 * held_h < billed_h <= held_h + 0.1


def test_same_seed_same_json_and_another_seed_differs(small):
    assert run_json(SMALL) == small
    other = run_json(SMALL[:-2] + ["8", "--json"])
    assert other != small


def test_plots_are_written(tmp_path):
    argv = ["--gpus", "16", "--hours", "1", "--plots", str(tmp_path), "--json"]
    run_json(argv)
    for name in ("colocation_load.png", "colocation_allocation.png", "colocation_queue.png"):
        assert (tmp_path / name).stat().st_size > 10_000


def test_cli_simulate_protocol_colocation(capsys):
    from agents.cli import main

    assert main(["simulate", "--protocol", "colocation", "--gpus", "16", "--hours", "1", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(doc) == {"split", "unified"}
