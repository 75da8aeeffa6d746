"""The openb variant generator on the vendored 400-pod sample (never the full trace)."""

import csv
import json
from collections import Counter
from pathlib import Path

import pytest

from agents.sim import fgd_protocol as fp
from agents.sim import openb_variants as ov

DATA = Path(ov.__file__).parent / "data"
PODS_CSV = str(DATA / "openb_pods_sample.csv")


@pytest.fixture(scope="module")
def source():
    fields, rows = ov.read_rows(PODS_CSV)
    return fields, rows


def demand_share(rows, cls):
    total = sum(ov.gpu_demand(r) for r in rows)
    return sum(ov.gpu_demand(r) for r in rows if ov.pod_class(r) == cls) / total


def keys(rows, cls=None):
    return Counter(ov.content_key(r) for r in rows if cls is None or ov.pod_class(r) == cls)


def test_sample_has_every_class(source):
    _, rows = source
    s = ov.summary(rows)
    assert (s["pods"], s["cpu_only"], s["sharing_pods"], s["whole_gpu_pods"], s["multi_gpu_pods"]) == (400, 41, 357 - 173, 173, 2)
    assert 0.2 < s["sharing_demand_pct"] / 100 < 0.5  # so both a lower and a higher target are real changes


@pytest.mark.parametrize("pct", [10, 20, 60, 80, 100])
def test_gpushare_reaches_target_keeps_counts_and_draws_from_source(source, pct):
    _, rows = source
    out = ov.gpushare_variant(rows, pct, seed=3)
    # pod count, CPU-only pods (same rows, same order) and the number of GPU pods are kept
    assert len(out) == len(rows)
    cpu_src = [ov.content_key(r) for r in rows if ov.pod_class(r) == "cpu"]
    assert [ov.content_key(r) for r in out[: len(cpu_src)]] == cpu_src
    assert sum(ov.pod_class(r) != "cpu" for r in out) == sum(ov.pod_class(r) != "cpu" for r in rows)
    # the requested share of GPU demand is reached, overshooting by at most one swap
    share = demand_share(out, "share")
    assert share >= pct / 100
    total = sum(ov.gpu_demand(r) for r in out)
    max_swap = max(ov.gpu_demand(r) for r in rows if ov.pod_class(r) != "cpu") + 1000
    assert share - pct / 100 <= max_swap / total
    # every pod is a pod of the source, with its class unchanged
    src = keys(rows)
    assert set(keys(out)) <= set(src)
    # names are fresh and unique, in output order
    assert [r["name"] for r in out] == [f"openb-pod-{i:04d}" for i in range(len(out))]


def test_gpushare_is_minimal(source):
    """With one sharing pod fewer (and the next other pod in its place) the target is missed."""
    _, rows = source
    for pct in (20, 45, 70):
        cpu, s_stream, w_stream, n = ov.gpushare_plan(rows, pct, seed=11)
        n_gpu = len(rows) - len(cpu)

        def share(k):
            s = sum(ov.gpu_demand(r) for r in s_stream[:k])
            return s / (s + sum(ov.gpu_demand(r) for r in w_stream[: n_gpu - k]))

        assert share(n - 1) < pct / 100 <= share(n)
        out = ov.gpushare_variant(rows, pct, seed=11)
        assert [ov.content_key(r) for r in out] == [ov.content_key(r) for r in cpu + s_stream[:n] + w_stream[: n_gpu - n]]


def test_shrinking_class_is_a_subsample_growing_class_is_resampled(source):
    """As in the artifact's gpushare40: the class that shrinks has no repeated pod, the one that grows does."""
    _, rows = source
    n_share_src = sum(ov.pod_class(r) == "share" for r in rows)
    n_gpu = sum(ov.pod_class(r) != "cpu" for r in rows)
    cases = {70: "sharing grows", 10: "sharing shrinks"}
    for pct in cases:
        cpu, s_stream, w_stream, n = ov.gpushare_plan(rows, pct, seed=5)
        taken_s, taken_w = s_stream[:n], w_stream[: n_gpu - n]
        growing, shrinking = (taken_s, taken_w) if n > n_share_src else (taken_w, taken_s)
        assert len(growing) > len({id(r) for r in growing})  # drawn with replacement: repeats
        assert len(shrinking) == len({id(r) for r in shrinking})  # a subsample: no source pod twice
    # and the counts move the right way
    assert sum(ov.pod_class(r) == "share" for r in ov.gpushare_variant(rows, 70, seed=5)) > n_share_src
    assert sum(ov.pod_class(r) == "share" for r in ov.gpushare_variant(rows, 10, seed=5)) < n_share_src


def test_deterministic_for_a_seed_and_seed_matters(source):
    _, rows = source
    for kind, pct in (("gpushare", 60), ("multigpu", 30)):
        a = ov.make_variant(rows, kind, pct, seed=1)
        b = ov.make_variant(rows, kind, pct, seed=1)
        c = ov.make_variant(rows, kind, pct, seed=2)
        assert a == b
        assert a != c


@pytest.mark.parametrize("pct", [10, 30, 50])
def test_multigpu_appends_multi_gpu_pods_until_target(source, pct):
    _, rows = source
    out = ov.multigpu_variant(rows, pct, seed=4)
    n = len(rows)
    assert len(out) > n
    assert [ov.content_key(r) for r in out[:n]] == [ov.content_key(r) for r in rows]  # source kept, in order
    extra = out[n:]
    assert all(ov.pod_class(r) == "multi" for r in extra)
    assert set(keys(extra)) <= set(keys(rows, "multi"))
    share = demand_share(out, "multi")
    assert share >= pct / 100
    # the first crossing: without the last appended pod the share is below target
    total = sum(ov.gpu_demand(r) for r in out)
    multi = sum(ov.gpu_demand(r) for r in out if ov.pod_class(r) == "multi")
    last = ov.gpu_demand(extra[-1])
    assert (multi - last) / (total - last) < pct / 100
    assert [r["name"] for r in out] == [f"openb-pod-{i:04d}" for i in range(len(out))]


def test_bad_requests_are_refused(source):
    _, rows = source
    with pytest.raises(ValueError):
        ov.gpushare_variant(rows, 101, seed=0)
    with pytest.raises(ValueError):
        ov.multigpu_variant(rows, 0.1, seed=0)  # below the sample's own multi-GPU share: cannot only add
    with pytest.raises(ValueError):
        ov.multigpu_variant(rows, 100, seed=0)
    with pytest.raises(ValueError):
        ov.make_variant(rows, "gpuspec", 20, seed=0)
    no_share = [r for r in rows if ov.pod_class(r) != "share"]
    with pytest.raises(ValueError):
        ov.gpushare_variant(no_share, 40, seed=0)


def test_cli_writes_a_pod_list_the_simulator_reads(tmp_path, capsys):
    out = tmp_path / "v.csv"
    rc = ov.run_cli(["--pods", PODS_CSV, "--kind", "gpushare", "--pct", "60", "--seed", "0", "--out", str(out)])
    assert rc == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["pods"] == 400 and report["sharing_demand_pct"] >= 60
    with open(out, newline="") as fh:
        header = next(csv.reader(fh))
    assert header == ov.read_rows(PODS_CSV)[0]  # same columns as the source
    pods = fp.load_pods(str(out))
    assert len(pods) == 400
    share = sum(p.gpu_demand for p in pods if p.is_sharing) / sum(p.gpu_demand for p in pods)
    assert share >= 0.6
    # the same call again gives byte-identical output
    out2 = tmp_path / "v2.csv"
    assert ov.run_cli(["--pods", PODS_CSV, "--kind", "gpushare", "--pct", "60", "--seed", "0", "--out", str(out2)]) == 0
    assert out.read_bytes() == out2.read_bytes()
    assert ov.run_cli(["--stats", str(out)]) == 0
    assert ov.run_cli(["--pods", PODS_CSV, "--kind", "gpushare"]) == 2  # missing --pct/--out
