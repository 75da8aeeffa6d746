"""The sweep driver on the vendored sample: one JSON per (fleet, workload, policy), resumable, tabulated per fleet."""

import json
from pathlib import Path

from agents.sim import fgd_sweep as sw

DATA = Path(sw.__file__).parent / "data"
NODES = str(DATA / "openb_nodes_sample.csv")
PODS = str(DATA / "openb_pods_sample.csv")


def test_sweep_writes_resumes_and_tabulates(tmp_path, capsys):
    out = tmp_path / "res"
    argv = ["run", "--fleets", NODES, "--workloads", PODS, "--policies", "bestfit", "fgd", "--seeds", "42-44",
            "--processes", "1", "--out", str(out)]
    assert sw.run_cli(argv) == 0
    files = sorted(p.name for p in out.iterdir())
    assert files == ["openb_nodes_sample__openb_pods_sample__bestfit.json",
                     "openb_nodes_sample__openb_pods_sample__fgd.json"]
    first = (out / files[0]).read_text()
    assert sw.run_cli(argv) == 0  # resumes: nothing is rerun
    assert (out / files[0]).read_text() == first
    results = sw.load_results(out)
    fgd = results[("openb_nodes_sample", "openb_pods_sample", "fgd")]
    bestfit = results[("openb_nodes_sample", "openb_pods_sample", "bestfit")]
    d, se, wins, n = sw.paired(fgd, bestfit)
    per = [a["allocation_pct_at_130"] - b["allocation_pct_at_130"] for a, b in zip(fgd["per_seed"], bestfit["per_seed"])]
    assert n == 3 and abs(d - sum(per) / 3) < 1e-9 and wins == sum(x > 0 for x in per) and se >= 0
    capsys.readouterr()
    assert sw.run_cli(["table", str(out), "--policies", "fgd", "bestfit", "--against", "bestfit"]) == 0
    text = capsys.readouterr().out
    assert "### openb_nodes_sample" in text and f"{wins}/3" in text
    assert json.loads(first)["commit"]


def test_short_names():
    assert sw.short_name("/x/openb_node_list_gpu_node.csv") == "openb"
    assert sw.short_name("/x/openb_pod_list_default.csv") == "default"
    assert sw.short_name("/tmp/v/multigpu50.csv") == "multigpu50"
