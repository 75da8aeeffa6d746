"""The fleet generator: every named shape has the shape it claims (checked on generated fleets, never /work/shared)."""

import csv
import json
from collections import Counter
from pathlib import Path

import pytest

from agents.sim import fgd_protocol as fp
from agents.sim import openb_fleets as of
from agents.sim.packing import PodRequest

DATA = Path(of.__file__).parent / "data"
SEEDS = (0, 1, 2)


def gpus(nodes):
    return sum(t.gpus for t in nodes)


@pytest.fixture(scope="module")
def fleets():
    return {(s, seed): of.generate(s, seed) for s in of.SHAPES for seed in SEEDS}


def test_catalogue_is_openb_and_holds_the_vendored_sample():
    assert sum(of.OPENB_TYPES.values()) == 1213 and of.OPENB_GPUS == 6212
    sample = Counter(of.read_fleet(str(DATA / "openb_nodes_sample.csv")))
    assert set(sample) <= set(of.OPENB_TYPES)  # every sampled openb node is one of the catalogue's types
    for t, n in sample.items():
        assert n <= of.OPENB_TYPES[t]


def test_every_fleet_has_the_gpus_asked_and_only_openb_types_up_to_its_transform(fleets):
    for (shape, _), nodes in fleets.items():
        spec = of.SHAPES[shape]
        assert of.OPENB_GPUS <= gpus(nodes) < of.OPENB_GPUS + 8 * len(spec.groups), shape
        catalogue = {spec.transform(t) for t in of.OPENB_TYPES}
        assert set(nodes) <= catalogue, shape


def test_older_2gpu_is_mostly_2gpu_nodes_of_older_models_with_hosts_for_multi_gpu_pods(fleets):
    for seed in SEEDS:
        nodes = fleets[("older-2gpu", seed)]
        assert {t.model for t in nodes} <= {"P100", "T4", "V100M16", "V100M32"}
        two = sum(t.gpus for t in nodes if t.gpus == 2)
        assert two == round(0.8 * of.OPENB_GPUS)  # the group stops at the first node reaching 80 % (2 GPUs a step)
        assert abs(two / gpus(nodes) - 0.8) < 8 / gpus(nodes)  # the rest: to within one 8-GPU node
        assert all(t.gpus in (2, 4, 8) for t in nodes)
        assert any(t.gpus == 8 for t in nodes) and any(t.gpus == 4 for t in nodes)


def test_8gpu_only_has_only_8gpu_nodes(fleets):
    for seed in SEEDS:
        nodes = fleets[("8gpu-only", seed)]
        assert {t.gpus for t in nodes} == {8}
        assert {t.model for t in nodes} <= {"G2", "G3", "V100M16", "V100M32"}
        assert Counter(t.model for t in nodes).most_common(1)[0][0] == "G2"  # 549 of openb's 617 8-GPU nodes


def test_cpu_shapes_scale_host_resources_of_the_same_draw(fleets):
    """cpu-lean, cpu-poor and cpu-rich are openb-resampled's draw with CPU (and for cpu-rich memory) scaled."""
    for seed in SEEDS:
        base = fleets[("openb-resampled", seed)]
        lean, poor, rich = (fleets[(s, seed)] for s in ("cpu-lean", "cpu-poor", "cpu-rich"))
        assert len(base) == len(lean) == len(poor) == len(rich)
        for b, l, p, r in zip(base, lean, poor, rich):
            assert (b.model, b.gpus) == (l.model, l.gpus) == (p.model, p.gpus) == (r.model, r.gpus)
            assert (l.cpu_milli, l.memory_mib) == (b.cpu_milli * 3 // 4, b.memory_mib)
            assert (p.cpu_milli, p.memory_mib) == (b.cpu_milli // 2, b.memory_mib)
            assert (r.cpu_milli, r.memory_mib) == (b.cpu_milli * 2, b.memory_mib * 2)
        # cores per GPU against openb's 17.2 and the 14 the default workload asks per GPU of demand
        assert 12 < of.summary(lean)["cores_per_gpu"] < 14 and of.summary(poor)["cores_per_gpu"] < 9.5
        assert of.summary(rich)["cores_per_gpu"] > 30


def test_resampled_mix_is_close_to_openb(fleets):
    real = of.summary([t for t, n in of.OPENB_TYPES.items() for _ in range(n)])
    for seed in SEEDS:
        got = of.summary(fleets[("openb-resampled", seed)])
        for size, pct in real["gpu_pct_by_node_gpus"].items():
            assert abs(got["gpu_pct_by_node_gpus"].get(size, 0.0) - pct) < 4, (seed, size)


def test_deterministic_for_a_seed_and_seed_matters():
    for shape in of.SHAPES:
        assert of.generate(shape, 5) == of.generate(shape, 5)
        assert of.generate(shape, 5) != of.generate(shape, 6)
    small = of.generate("older-2gpu", 0, gpus=100)
    assert 100 <= gpus(small) < 116
    with pytest.raises(ValueError):
        of.generate("tiny", 0)
    with pytest.raises(ValueError):
        of.generate("cpu-poor", 0, gpus=0)


def test_unhostable_demand():
    nodes = [of.NodeType("T4", 2, 16_000, 65_536)]
    pods = [PodRequest(4_000, 1024, 1, 500), PodRequest(4_000, 1024, 4, 1000), PodRequest(32_000, 1024, 1, 1000),
            PodRequest(1_000, 10)]
    assert of.unhostable_demand_pct(nodes, pods) == round(100 * 5000 / 5500, 2)


def test_cli_writes_a_node_list_the_simulator_reads(tmp_path, capsys):
    out = tmp_path / "f.csv"
    assert of.run_cli(["--shape", "8gpu-only", "--seed", "3", "--gpus", "200", "--out", str(out)]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["gpu_pct_by_node_gpus"] == {"8": 100.0} and report["gpus"] == 200
    with open(out, newline="") as fh:
        assert next(csv.reader(fh)) == list(of.FIELDS)
    nodes = fp.load_nodes(str(out))
    assert nodes.gpu_capacity == 200_000 and set(nodes.gpu_count) == {8}
    out2 = tmp_path / "f2.csv"
    assert of.run_cli(["--shape", "8gpu-only", "--seed", "3", "--gpus", "200", "--out", str(out2)]) == 0
    assert out.read_bytes() == out2.read_bytes()
    assert of.run_cli(["--stats", str(out), "--pods", str(DATA / "openb_pods_sample.csv")]) == 0
    stats = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(stats["unhostable_demand_pct"].values()) == {0.0}  # 8-GPU G2/G3/V100 nodes host every sample pod
    assert of.run_cli(["--shape", "cpu-poor"]) == 2  # no --out


def test_protocol_runs_on_a_small_generated_fleet():
    nodes = fp.load_nodes(str(DATA / "openb_nodes_sample.csv"))
    pods = fp.load_pods(str(DATA / "openb_pods_sample.csv"))
    fleet = of.generate("cpu-poor", 0, gpus=nodes.gpu_capacity // 1000)
    table = fp.NodeTable(tuple(f"n{i}" for i in range(len(fleet))), tuple(t.cpu_milli for t in fleet),
                         tuple(t.memory_mib for t in fleet), tuple(t.gpus for t in fleet), tuple(t.model for t in fleet))
    res = fp.run_seed(table, pods, "gpupool", 42)
    assert not res.over_allocated and 0 < res.allocation[130] <= 100
