"""Packing policies: feasibility, scores and fragmentation on hand-checked cases."""

import numpy as np
import pytest

from streams.folds.fgd_measure import TypicalPod, fragmentation
from agents.sim.packing import (
    BestFitPolicy,
    ClusterState,
    FGDPolicy,
    PodRequest,
    bestfit_scores,
    choose,
    default_gpus,
    make_policy,
    schedule,
    sigmoid_score,
    typical_pods,
)


def one_node(gpu_free, cpu=64_000, mem=262_144, model="T4"):
    st = ClusterState([cpu], [mem], [len(gpu_free)], [model])
    st.gpu_free[0, : len(gpu_free)] = gpu_free
    st._refresh_all()
    return st


def test_pod_from_trace_clamps_share_and_parses_models():
    p = PodRequest.from_trace(4000, 1024, 1, 1500, "V100M16|T4")
    assert p.gpu_milli == 1000 and p.models == frozenset({"V100M16", "T4"})
    assert PodRequest.from_trace(4000, 1024, 1, 0).gpu_milli == 1
    cpu_only = PodRequest.from_trace(4000, 1024, 0, 500, "T4")
    assert cpu_only.num_gpu == 0 and cpu_only.models is None and cpu_only.gpu_demand == 0
    assert PodRequest.from_trace(1, 1, 4, 1000).gpu_demand == 4000


def test_typical_pods_most_frequent_until_coverage():
    pods = [PodRequest(1000, 10, 1, 500)] * 6 + [PodRequest(2000, 10, 1, 1000)] * 3 + [PodRequest(0, 10)]
    typ = typical_pods(pods, coverage=0.9)
    assert [(t.cpu_milli, t.gpu_milli, t.weight) for t in typ] == [(1000, 500, 6), (2000, 1000, 3)]
    assert len(typical_pods(pods, coverage=1.0)) == 3


def test_feasibility_model_cpu_memory_and_whole_gpus():
    st = ClusterState([32_000, 32_000, 8_000], [65_536, 65_536, 65_536], [4, 4, 4], ["T4", "V100M16", "T4"])
    st.gpu_free[0] = [1000, 1000, 300, 0]
    st.gpu_free[1] = [1000, 1000, 1000, 1000]
    st.gpu_free[2] = [1000, 1000, 1000, 1000]
    st._refresh_all()
    assert list(st.feasible(PodRequest(4000, 1024, 1, 500, frozenset({"V100M16"})))) == [1]
    assert list(st.feasible(PodRequest(4000, 1024, 2, 1000))) == [0, 1, 2]
    assert list(st.feasible(PodRequest(4000, 1024, 3, 1000))) == [1, 2]
    assert list(st.feasible(PodRequest(16_000, 1024, 3, 1000))) == [1]
    assert list(st.feasible(PodRequest(1000, 70_000, 1, 100))) == []
    assert list(st.feasible(PodRequest(1000, 1024, 1, 1000))) == [0, 1, 2]
    st.gpu_free[0] = [900, 900, 300, 0]
    st._refresh_all()
    assert list(st.feasible(PodRequest(1000, 1024, 1, 950))) == [1, 2]


def test_place_refuses_over_allocation():
    st = one_node([1000, 300])
    with pytest.raises(ValueError):
        st.place(0, PodRequest(1000, 10, 1, 500), (1,))
    with pytest.raises(ValueError):
        st.place(0, PodRequest(1000, 10, 2, 1000), (0, 1))
    st.place(0, PodRequest(1000, 10, 1, 500), (0,))
    assert list(st.gpu_free[0]) == [500, 300] and st.cpu_free[0] == 63_000


def test_default_gpu_choice_tightest_share_and_first_free_gpus():
    st = one_node([1000, 400, 600, 400, 1000, 1000])
    assert default_gpus(st, PodRequest(0, 0, 1, 350), 0) == (1,)
    assert default_gpus(st, PodRequest(0, 0, 1, 500), 0) == (2,)
    assert default_gpus(st, PodRequest(0, 0, 2, 1000), 0) == (0, 4)


def test_bestfit_score_hand_computed():
    # s = 0.5*48000/128000 + 0.5*1000/8000 = 0.25 -> 75;  s = 0.375 + 0.4375 -> trunc(18.75) = 18
    cpu = np.array([64_000, 100_000])
    gpu = np.array([1_500, 8_000])
    scores = bestfit_scores(cpu, gpu, PodRequest(16_000, 0, 1, 500))
    assert scores[0] == 75
    assert bestfit_scores(cpu[1:], gpu[1:], PodRequest(4_000, 0, 1, 1000))[0] == 18


def test_fgd_fragmentation_hand_computed():
    typ = [
        TypicalPod(4_000, 500, 1, None, 2),  # fits: counts the 200-milli GPU only
        TypicalPod(20_000, 1000, 1, None, 1),  # not enough CPU: everything is a fragment
        TypicalPod(1_000, 0, 0, None, 1),  # CPU-only: everything is a fragment
    ]
    # (2*200 + 1*1800 + 1*1800) / 4
    assert fragmentation([1000, 600, 200], 10_000, 0, typ) == 1000
    only_t4 = [TypicalPod(4_000, 500, 1, frozenset({"T4"}), 2)] + typ[1:]
    assert fragmentation([1000, 600, 200], 10_000, 0, only_t4, model="V100M16") == 1800
    assert fragmentation([1000, 600, 200], 10_000, 0, only_t4, model="T4") == 1000
    whole = [TypicalPod(0, 1000, 2, None, 1)]
    assert fragmentation([1000, 1000, 300], 0, 0, whole) == 300
    assert fragmentation([1000, 900, 300], 0, 0, whole) == 2200


def test_sigmoid_score():
    assert list(sigmoid_score(np.array([0.0, 1000.0, -1000.0, 1e9, -1e9]))) == [50, 73, 26, 100, 0]


def test_fgd_chooses_gpu_by_fragmentation_not_tightness():
    typ = [TypicalPod(0, 600, 1, None, 1)]
    pod = PodRequest(0, 0, 1, 400)
    for policy, expected in ((FGDPolicy(typ), (0,)), (BestFitPolicy(), (1,))):
        st = one_node([1000, 600])
        policy.bind(st)
        placed = schedule(st, pod, policy, np.array([0]), np.random.default_rng(0))
        assert placed.gpus == expected


def test_fgd_prefers_node_where_fragmentation_drops():
    typ = [TypicalPod(0, 600, 1, None, 1)]
    st = ClusterState([64_000] * 2, [1024] * 2, [1, 1], ["T4", "T4"])
    st.gpu_free[:, 0] = [1000, 700]
    st._refresh_all()
    policy = FGDPolicy(typ)
    policy.bind(st)
    # 600 on the 700-GPU leaves 100 (frag 700 -> 100); on the full GPU frag goes 700 -> 400+700.
    placed = choose(st, PodRequest(0, 0, 1, 600), policy, np.array([1, 0]), np.random.default_rng(0))
    assert placed.node == 1


def test_priority_breaks_ties():
    st = ClusterState([64_000] * 3, [1024] * 3, [1, 1, 1], ["T4"] * 3)
    policy = BestFitPolicy()
    policy.bind(st)
    rng = np.random.default_rng(0)
    assert choose(st, PodRequest(0, 0, 1, 500), policy, np.array([0, 2, 1]), rng).node == 1
    assert choose(st, PodRequest(0, 0, 1, 500), policy, np.array([2, 0, 1]), rng).node == 0


def test_make_policy_names():
    for name in ("random", "bestfit", "fgd"):
        assert make_policy(name, ()).name == name
    # the product's row is the live scheduler (agents/sim/live_protocol.py): packing.py holds no copy of its policy
    for name in ("tetris", "gpupool", "gpupool-cap"):
        with pytest.raises(ValueError):
            make_policy(name)
