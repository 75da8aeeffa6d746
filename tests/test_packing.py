"""Packing policies: feasibility, scores and fragmentation on hand-checked cases."""

import numpy as np
import pytest

from streams.folds.fgd_measure import TypicalPod, fragmentation
from agents.sim.packing import (
    BestFitPolicy,
    ClusterState,
    FGDPolicy,
    GpupoolPolicy,
    PodRequest,
    scarcity_weights,
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


def test_gpupool_counts_gpus_stranded_by_cpu():
    """8 free GPUs but CPU for one pod of the only type: 7 GPUs are fragments for it."""
    typ = [TypicalPod(10_000, 1000, 1, None, 1, 0)]
    st = one_node([1000] * 8, cpu=12_000)
    fgd, ours = FGDPolicy(typ), GpupoolPolicy(typ)
    fgd.bind(st)
    ours.bind(st)
    assert fgd.tracker.node_scaled[0] == 0
    assert ours.node_scaled[0] == 7000 * ours.weight_total
    st2 = one_node([1000] * 8, cpu=12_000, mem=2048)
    mem_typ = [TypicalPod(10_000, 1000, 1, None, 1, 4096)]
    ours2 = GpupoolPolicy(mem_typ)
    ours2.bind(st2)
    assert ours2.node_scaled[0] == 8000 * ours2.weight_total  # no memory for even one pod


def test_scarcity_weights_scale_popularity_by_the_share_of_gpus_that_can_host_a_type():
    # 3 nodes of 8 GPUs; only the 128-core node hosts the 120-core type.
    st = ClusterState([96_000, 96_000, 128_000], [1 << 20] * 3, [8, 8, 8], ["G2", "G2", "G3"])
    anywhere = TypicalPod(4_000, 1000, 1, None, 30, 0)
    big = TypicalPod(120_000, 1000, 8, None, 2, 0)
    never = TypicalPod(200_000, 1000, 8, None, 5, 0)
    w = scarcity_weights([anywhere, big, never], st)
    assert w[anywhere] == 30 * 1000  # all 24 GPUs can host it: C / S = 1
    assert w[big] == 2 * 1000 * 24 // 8  # 8 of 24 GPUs: three times its popularity
    assert w[never] == 0  # no node could ever host it


def test_scarcity_keeps_the_only_home_of_a_big_type_for_it():
    """A 4-GPU pod fits every node; only the G3 node can ever host the 120-core 8-GPU type.

    On a G2 node the pod leaves too little memory for more than one of the small
    type, so the capped measure alone prefers to break the G3 node (openb's
    multigpu variants lost their 120-core pods exactly this way).
    """
    small = TypicalPod(11_300, 1000, 1, None, 40, 49_152)
    big = TypicalPod(120_000, 1000, 8, None, 5, 737_280)
    st = ClusterState([96_000] * 7 + [128_000], [393_216] * 7 + [786_432], [8] * 8, ["G2"] * 7 + ["G3"])
    pod = PodRequest(60_200, 320_512, 4, 1000)
    prio = np.arange(8)
    rng = np.random.default_rng(0)
    plain = GpupoolPolicy([small, big], scarcity=False, stranded=False)
    plain.bind(st)
    assert choose(st, pod, plain, prio, rng).node == 7
    scarce = GpupoolPolicy([small, big], scarcity=True, stranded=False)
    scarce.bind(st)
    assert choose(st, pod, scarce, prio, rng).node != 7


def test_stranded_counts_free_gpus_behind_cpu_and_memory_no_gpu_type_fits():
    typ = [TypicalPod(4_000, 500, 1, None, 1, 1024), TypicalPod(2_000, 1000, 2, None, 1, 512)]
    st = ClusterState([6_000, 64_000], [8_192, 8_192], [3, 3], ["T4", "T4"])
    st.gpu_free[0] = [1000, 400, 200]
    st._refresh_all()
    ours = GpupoolPolicy(typ)
    ours.bind(st)
    nodes = np.array([0, 1])
    assert ours.host_fits(st.cpu_free[nodes], st.mem_free[nodes], st.model_idx[nodes]).tolist() == [True, True]
    # 5 cores on node 0 leave 1 core: no type fits, the 1,500 milli left are stranded; node 1 keeps 59 cores.
    assert ours.stranded_increase(nodes, PodRequest(5_000, 0, 1, 100)).tolist() == [1500, 0]
    # Memory too: 8,000 MiB asked leaves 192, too little for either type on both nodes.
    assert ours.stranded_increase(nodes, PodRequest(1_000, 8_000, 1, 1000)).tolist() == [600, 2000]
    # A node already stranded stays so: placing there frees nothing, strands nothing new but what it takes.
    st.cpu_free[0] = 1_000
    assert ours.stranded_increase(np.array([0]), PodRequest(500, 0, 1, 200)).tolist() == [-200]


def test_make_policy_names():
    for name in ("random", "bestfit", "fgd", "gpupool", "gpupool-count"):
        assert make_policy(name, ()).name == name
    ablation = make_policy("gpupool-cap", ())
    assert (ablation.scarcity, ablation.stranded) == (False, False)
    with pytest.raises(ValueError):
        make_policy("tetris")


def test_stranded_keeps_a_pod_off_a_node_whose_last_cores_it_would_take():
    """Node 0's CPU hosts one small pod for two free GPUs: the capped measure already counts one GPU lost,
    so taking its last cores looks free (a tie, broken by priority).  It leaves a GPU no type could use."""
    typ = [TypicalPod(3_000, 1000, 1, None, 1, 0)]
    st = ClusterState([4_000, 64_000], [1 << 20] * 2, [2, 8], ["T4", "T4"])
    pod = PodRequest(3_500, 0, 1, 1000)
    prio = np.array([1, 0])  # ties go to node 0
    rng = np.random.default_rng(0)
    cap_only = GpupoolPolicy(typ, scarcity=False, stranded=False)
    cap_only.bind(st)
    assert choose(st, pod, cap_only, prio, rng).node == 0
    ours = GpupoolPolicy(typ)
    ours.bind(st)
    assert ours.stranded_increase(np.array([0, 1]), pod).tolist() == [1000, 0]
    assert choose(st, pod, ours, prio, rng).node == 1


def test_demand_coverage_adds_rare_multi_gpu_types_that_hold_the_gpus():
    """95 one-GPU pods of two shapes and 5 eight-GPU pods: by count the 8-GPU type (5 % of pods) is left out, by
    GPU demand (40 of 117.5 GPUs) it is not; the pods' own types are not repeated, and weights stay counts."""
    from agents.sim.packing import typical_pods, with_demand_types
    pods = [PodRequest(4000, 1024, 1, 1000)] * 60 + [PodRequest(2000, 1024, 1, 500)] * 35 \
        + [PodRequest(64000, 1024, 8, 1000)] * 5
    typical = typical_pods(pods)
    assert [(t.num_gpu, t.weight) for t in typical] == [(1, 60), (1, 35)]
    got = with_demand_types(pods, typical)
    assert got[:2] == typical and [(t.num_gpu, t.cpu_milli, t.weight) for t in got[2:]] == [(8, 64000, 5)]
    assert with_demand_types(pods, got) == got
    assert make_policy("gpupool-demand-all", typical, pods).typical == got
    assert make_policy("gpupool-count", typical, pods).typical == typical
    # Pressure: the 8-GPU type is 40 of the 117.5 GPUs of demand (0.34); one 8-GPU node among 2-GPU ones holds 8 of
    # the 48 GPUs (0.17) that could host it: 0.34 / 0.17 = 2.04, so it joins at the default bar (0.1) and at 2, not
    # at 2.1.
    # With no node that could host it, it never joins.
    few = ClusterState([64000] * 1 + [8000] * 20, [1 << 20] * 21, [8] + [2] * 20, ["T4"] * 21)
    assert with_demand_types(pods, typical, state=few) == got
    assert with_demand_types(pods, typical, state=few, pressure=2.1) == typical
    assert with_demand_types(pods, typical, state=few, pressure=2.0) == got
    none = ClusterState([8000] * 4, [1 << 20] * 4, [2] * 4, ["T4"] * 4)
    assert with_demand_types(pods, typical, state=none, pressure=0.0) == typical
    policy = make_policy("gpupool", typical, pods)
    assert policy.typical == typical
    policy.bind(few)
    assert policy.typical == got


def _oversubscribed_case(n_small=20):
    """Heavy and light one-GPU pods, a few 32-core 4-GPU pods and many 8-GPU pods, on ``n_small`` 2-GPU nodes with
    plenty of CPU, one CPU-limited 4-GPU node (32 cores, 128 GiB) and one 8-GPU node (nodes 0.. are 2-GPU ones)."""
    pods = [PodRequest(11300, 49152, 1, 1000)] * 60 + [PodRequest(3152, 5600, 1, 810)] * 30 \
        + [PodRequest(32000, 131072, 4, 1000)] * 3 + [PodRequest(64000, 262144, 8, 1000)] * 12

    def fleet():
        return ClusterState([104000] * n_small + [32000, 64000], [524288] * n_small + [131072, 262144],
                            [2] * n_small + [4, 8], ["T4"] * (n_small + 2))
    return pods, fleet


def test_oversubscribed_types_are_judged_by_the_multi_gpu_load_on_their_hosts():
    """20 2-GPU nodes, one 4-GPU and one 8-GPU node (52 GPUs; 192.3 GPUs of demand). The 8-GPU type's hosts (8 GPUs,
    0.15 of the fleet) get its 96 GPUs and 8/12 of the 4-GPU type's 12: 104 GPUs, 0.54 of the demand, 3.5 times their
    share. The 4-GPU type's own demand is 0.06 of the total on 0.23 of the fleet (0.27 times), but its hosts also get
    all of the 8-GPU pods: 108 GPUs, 2.4 times their share. Both are oversubscribed at 2 (neither at 4). With 10 2-GPU
    nodes (32 GPUs) the 8-GPU type's hosts see 2.2 times their share, the 4-GPU type's 1.5: only the 8-GPU type is."""
    from agents.sim.packing import oversubscribed_types, with_demand_types
    pods, fleet = _oversubscribed_case()
    demand = sum(p.gpu_demand for p in pods)
    typical = with_demand_types(pods, typical_pods(pods), state=fleet())
    got = oversubscribed_types(typical, fleet(), demand)
    assert sorted((t.num_gpu, t.cpu_milli) for t in got) == [(4, 32000), (8, 64000)]
    assert oversubscribed_types(typical, fleet(), demand, factor=4) == frozenset()
    _, few = _oversubscribed_case(n_small=10)
    assert sorted((t.num_gpu, t.cpu_milli) for t in oversubscribed_types(typical, few(), demand)) == [(8, 64000)]
    # weights: the oversubscribed types weigh x GPUs per pod on top of their scarcity weight, the others do not
    new, old = make_policy("gpupool", typical_pods(pods), pods), make_policy("gpupool-demand", typical_pods(pods), pods)
    new.bind(fleet()), old.bind(fleet())
    assert sorted(int(w) for w in new._w) == sorted(int(w) * (k if k > 1 else 1) for w, k in zip(old._w, old._k))


def test_a_light_pod_no_longer_takes_the_cpu_limited_4_gpu_node_the_oversubscribed_4_gpu_pods_need():
    """The capped measure already counts two of the 32-core 4-GPU node's GPUs as lost to the heavy one-GPU pods (its
    CPU hosts two of them), so a light pod there looks cheaper than on a 2-GPU node, and the count weight of the
    4-GPU type (3 pods in 105) does not outweigh that: the previous policy (``gpupool-demand``) puts it there, the
    4-GPU pod then breaks the 8-GPU node, and the 8-GPU pod fails. With the 4- and 8-GPU types weighed by their GPUs
    (their hosts are oversubscribed), the light pod goes to a 2-GPU node and all three are placed."""
    pods, fleet = _oversubscribed_case()
    light, four, eight = PodRequest(3152, 5600, 1, 810), PodRequest(32000, 131072, 4, 1000), pods[-1]
    got = {}
    for name in ("gpupool-demand", "gpupool"):
        st = fleet()
        policy = make_policy(name, typical_pods(pods), pods)
        policy.bind(st)
        prio = np.arange(st.n_nodes)[::-1].copy()  # 2-GPU nodes first on ties: the scores decide, not priority
        rng = np.random.default_rng(0)
        got[name] = [None if p is None else p.node for p in (schedule(st, pod, policy, prio, rng)
                                                             for pod in (light, four, eight))]
    assert got["gpupool-demand"] == [20, 21, None]
    assert got["gpupool"][0] < 20 and got["gpupool"][1:] == [20, 21]
