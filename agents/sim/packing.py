"""The offline simulator's node-scoring packing policies over a vectorised cluster state.

Used by the FGD-protocol replay (agents/sim/fgd_protocol.py); the live scheduler does not import this module: its
score (agents/scheduler/scoring.py) applies the `gpupool` policy's terms to its own typical job shapes in pure
integer Python. FGD's measure itself (``TypicalPod``, ``FragIndex``, ``fragmentation``) lives in
streams/folds/fgd_measure.py, shared with the cluster metrics.

Pure module: stdlib + numpy only, no I/O, no clock, no global random state.
Every random choice uses a ``numpy.random.Generator`` handed in by the caller,
so a run is a function of its inputs.

Capacity arithmetic is integral: CPU in milli-cores, memory in MiB, GPU in
milli-GPU (1000 = one whole GPU).  Fragmentation is kept as an integer scaled
by the total typical-pod weight so that comparisons between candidate
placements are exact; it is only divided down when reported.

Policies (``make_policy(name, ...)``):

* ``random``  – a uniformly random feasible node and fitting GPU.
* ``bestfit`` – the FGD artifact's BestFit baseline.
* ``fgd``     – Fragmentation Gradient Descent (Weng et al., ATC'23) as the
  FGD protocol describes it: typical-pod set, fragmentation measure, sigmoid
  score and FGD's own GPU choice.
* ``gpupool`` – the product policy (default); see ``GpupoolPolicy``.  ``gpupool-cap``,
  ``gpupool-cap-stranded`` and ``gpupool-cap-scarce`` are its ablations.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np

from streams.folds.fgd_measure import GPU_MILLI, FragIndex, TypicalPod

DEFAULT_POLICY = "gpupool"
# The product policy and its ablations:
# name -> (scarcity weights, stranded GPUs counted again, typical set also covers the GPU demand,
#          multi-GPU types on oversubscribed hosts weigh their GPU count too).
GPUPOOL_VARIANTS = {
    "gpupool": (True, True, "pressure", True),  # demand types whose hosts are under pressure (``with_demand_types``),
    # multi-GPU types whose hosts the multi-GPU demand oversubscribes weigh x GPUs per pod (``oversubscribed_types``)
    "gpupool-demand": (True, True, "pressure", False),  # the product policy before oversubscription (at 5fd82cc)
    "gpupool-demand-all": (True, True, "all", False),  # every demand type (ablation)
    "gpupool-count": (True, True, None, False),  # the product policy before demand coverage (typical set by count)
    "gpupool-cap": (False, False, None, False),  # the product policy before scarcity and stranding
    "gpupool-cap-stranded": (False, True, None, False),
    "gpupool-cap-scarce": (True, False, None, False),
}
POLICY_NAMES = ("random", "bestfit", "fgd", *GPUPOOL_VARIANTS)

# BestFit normalisers from the FGD artifact: the largest node's CPU and GPU.
BESTFIT_CPU_NORM = 128_000
BESTFIT_GPU_NORM = 8_000


# --------------------------------------------------------------------------- pods


@dataclass(frozen=True)
class PodRequest:
    """What a pod asks for.  ``gpu_milli`` is per GPU; ``models`` None = any."""

    cpu_milli: int
    memory_mib: int
    num_gpu: int = 0
    gpu_milli: int = 0
    models: frozenset[str] | None = None

    def __post_init__(self) -> None:
        if self.cpu_milli < 0 or self.memory_mib < 0 or self.num_gpu < 0:
            raise ValueError("negative request")
        if self.num_gpu and not 1 <= self.gpu_milli <= GPU_MILLI:
            raise ValueError("gpu_milli must be in 1..1000 for a GPU pod")
        if self.num_gpu > 1 and self.gpu_milli != GPU_MILLI:
            raise ValueError("a multi-GPU pod must take whole GPUs")

    @classmethod
    def from_trace(
        cls, cpu_milli: int, memory_mib: int, num_gpu: int, gpu_milli: int, gpu_spec: str = ""
    ) -> PodRequest:
        """Normalise a trace row: clamp the GPU share, drop GPU fields of CPU pods."""
        if num_gpu <= 0:
            return cls(int(cpu_milli), int(memory_mib))
        milli = min(GPU_MILLI, max(1, int(gpu_milli)))
        if num_gpu > 1:
            milli = GPU_MILLI
        models = frozenset(s for s in (gpu_spec or "").split("|") if s) or None
        return cls(int(cpu_milli), int(memory_mib), int(num_gpu), milli, models)

    @property
    def gpu_demand(self) -> int:
        return self.num_gpu * self.gpu_milli

    @property
    def is_sharing(self) -> bool:
        """A fractional single-GPU pod: the only kind whose GPU choice matters."""
        return self.num_gpu == 1 and self.gpu_milli < GPU_MILLI


def typical_pods(
    pods: Iterable[PodRequest], coverage: float = 0.95, with_memory: bool = False
) -> tuple[TypicalPod, ...]:
    """FGD's typical-pod set: most frequent types until they cover ``coverage``.

    A type is (CPU request, GPU milli, GPU count, allowed models).  With
    ``with_memory`` the memory request is part of the type too; otherwise
    ``memory_mib`` carries the type's median memory request (FGD ignores it,
    the gpupool policy uses it).  Frequency ties
    are broken by the type itself so that the set is deterministic.
    """
    def key(p: PodRequest) -> tuple:
        models = tuple(sorted(p.models)) if p.models else ()
        mem = p.memory_mib if with_memory else 0
        return (p.cpu_milli, p.gpu_milli, p.num_gpu, models, mem)

    pods = list(pods)
    counts = Counter(key(p) for p in pods)
    mems: dict[tuple, list[int]] = {}
    for p in pods:
        mems.setdefault(key(p), []).append(p.memory_mib)
    total = sum(counts.values())
    chosen: list[TypicalPod] = []
    covered = 0
    for k, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
        if total and covered >= coverage * total:
            break
        cpu, milli, num, models, mem = k
        if not with_memory:
            mem = int(np.median(mems[k]))
        chosen.append(TypicalPod(cpu, milli, num, frozenset(models) or None, n, mem))
        covered += n
    return tuple(chosen)


# A type joins the typical set by its GPU demand only when that demand is at least this share of the GPUs that could
# host it (its hosts are under pressure from it); see ``with_demand_types``.
DEMAND_PRESSURE = 0.1


def with_demand_types(pods: Iterable[PodRequest], typical: Sequence[TypicalPod], coverage: float = 0.95,
                      state: "ClusterState | None" = None,
                      pressure: float = DEMAND_PRESSURE) -> tuple[TypicalPod, ...]:
    """``typical`` plus the GPU types that, taken by GPU demand (count x GPUs x milli) largest first, cover
    ``coverage`` of the workload's GPU demand; each added type weighs its count, as FGD's types do. With ``state``,
    only those whose demand share is at least ``pressure`` times the share of the fleet's GPUs that could host them
    (d_t >= pressure * S_t / C): where a type's hosts are most of the fleet (openb's 8-GPU types fit 80 % of its
    GPUs) keeping nodes whole for it costs the common types more than it saves (openb mix, 10 seeds: -0.1 point).

    FGD's set covers 95 % of the *pods*. A type of 8-GPU pods can be 1 % of the pods and 10 % of the GPUs, and is
    then invisible to the measure: nothing keeps the 4- and 8-GPU nodes whole for it, and a one-GPU pod breaks the
    last of them as readily as any other node (openb multigpu20 on the mostly 2-GPU fleet: the first 4-GPU pod
    failed at 60 % of capacity arrived instead of FGD's 112 %)."""
    have = {(t.cpu_milli, t.gpu_milli, t.num_gpu, t.models) for t in typical}
    every = sorted((t for t in typical_pods(pods, coverage=1.0) if t.num_gpu),
                   key=lambda t: (-t.weight * t.num_gpu * t.gpu_milli, t.cpu_milli, t.gpu_milli, t.num_gpu,
                                  tuple(sorted(t.models or ()))))
    total = sum(t.weight * t.num_gpu * t.gpu_milli for t in every)
    fleet = int(state.gpu_count.sum()) if state is not None else 0
    out, covered = list(typical), 0
    for t in every:
        if covered >= coverage * total:
            break
        d = t.weight * t.num_gpu * t.gpu_milli
        covered += d
        if (t.cpu_milli, t.gpu_milli, t.num_gpu, t.models) in have:
            continue
        if state is not None:
            hosts = host_gpus(t, state)
            if not hosts or d * fleet < pressure * total * hosts:
                continue  # no host (no policy places it), or hosts with room to spare
        out.append(t)
    return tuple(out)


# ------------------------------------------------------------------- cluster state


class ClusterState:
    """Free resources of every node as numpy arrays (mutated by ``place``).

    GPUs are padded to the widest node with free = 0: a padded slot never fits
    a pod (every GPU pod asks >= 1 milli), is never completely free and adds
    nothing to any sum, so no separate mask is needed.
    """

    def __init__(
        self,
        cpu_milli: Sequence[int],
        memory_mib: Sequence[int],
        gpu_count: Sequence[int],
        models: Sequence[str],
    ) -> None:
        self.cpu_free = np.array(cpu_milli, dtype=np.int64)
        self.mem_free = np.array(memory_mib, dtype=np.int64)
        self.cpu_total = self.cpu_free.copy()
        self.mem_total = self.mem_free.copy()
        self.gpu_count = np.array(gpu_count, dtype=np.int64)
        n = len(self.cpu_free)
        if not (len(self.mem_free) == len(self.gpu_count) == len(models) == n):
            raise ValueError("node columns differ in length")
        width = max(1, int(self.gpu_count.max(initial=0)))
        slots = np.arange(width)[None, :] < self.gpu_count[:, None]
        self.gpu_free = np.where(slots, GPU_MILLI, 0).astype(np.int64)
        self.model_names: tuple[str, ...] = tuple(sorted(set(models)))
        lookup = {m: i for i, m in enumerate(self.model_names)}
        self.model_idx = np.array([lookup[m] for m in models], dtype=np.int64)
        self._allowed: dict[frozenset[str], np.ndarray] = {}
        self._refresh_all()

    @property
    def n_nodes(self) -> int:
        return len(self.cpu_free)

    @property
    def gpu_width(self) -> int:
        return self.gpu_free.shape[1]

    @property
    def gpu_capacity(self) -> int:
        return int(self.gpu_count.sum()) * GPU_MILLI

    def _refresh_all(self) -> None:
        self.max_free = self.gpu_free.max(axis=1)
        self.n_full = (self.gpu_free == GPU_MILLI).sum(axis=1)
        self.gpu_free_sum = self.gpu_free.sum(axis=1)

    def _refresh(self, node: int) -> None:
        row = self.gpu_free[node]
        self.max_free[node] = row.max()
        self.n_full[node] = int((row == GPU_MILLI).sum())
        self.gpu_free_sum[node] = row.sum()

    def allowed(self, models: frozenset[str] | None) -> np.ndarray | None:
        """Bool mask of nodes whose GPU model is allowed; None = unconstrained."""
        if models is None:
            return None
        mask = self._allowed.get(models)
        if mask is None:
            ok = np.array([m in models for m in self.model_names], dtype=bool)
            mask = ok[self.model_idx] if len(ok) else np.zeros(self.n_nodes, bool)
            self._allowed[models] = mask
        return mask

    def feasible(self, pod: PodRequest) -> np.ndarray:
        """Indices of nodes that can host ``pod`` now."""
        ok = (self.cpu_free >= pod.cpu_milli) & (self.mem_free >= pod.memory_mib)
        if pod.num_gpu:
            allowed = self.allowed(pod.models)
            if allowed is not None:
                ok &= allowed
            if pod.num_gpu == 1:
                ok &= self.max_free >= pod.gpu_milli
            else:
                ok &= self.n_full >= pod.num_gpu
        return np.flatnonzero(ok)

    def place(self, node: int, pod: PodRequest, gpus: Sequence[int]) -> None:
        """Commit ``pod`` to ``node`` on ``gpus``; refuses any over-allocation."""
        if len(gpus) != pod.num_gpu:
            raise ValueError("GPU list does not match the pod's GPU count")
        if len(set(gpus)) != len(gpus):
            raise ValueError("a GPU was listed twice")
        if self.cpu_free[node] < pod.cpu_milli or self.mem_free[node] < pod.memory_mib:
            raise ValueError("node lacks CPU or memory")
        for g in gpus:
            if not 0 <= g < self.gpu_count[node] or self.gpu_free[node, g] < pod.gpu_milli:
                raise ValueError(f"GPU {g} of node {node} cannot take {pod.gpu_milli} milli")
        self.cpu_free[node] -= pod.cpu_milli
        self.mem_free[node] -= pod.memory_mib
        if gpus:
            self.gpu_free[node, list(gpus)] -= pod.gpu_milli
            self._refresh(node)


def default_gpus(state: ClusterState, pod: PodRequest, node: int) -> tuple[int, ...]:
    """Protocol GPU choice: tightest fitting GPU for a share, first free ones else."""
    if not pod.num_gpu:
        return ()
    row = state.gpu_free[node]
    if pod.is_sharing:
        fits = np.flatnonzero(row >= pod.gpu_milli)
        return (int(fits[np.argmin(row[fits])]),)
    full = np.flatnonzero(row == GPU_MILLI)
    return tuple(int(g) for g in full[: pod.num_gpu])


# ------------------------------------------------------------------ fragmentation


class FragTracker:
    """Per-node fragmentation of a ClusterState, kept current incrementally."""

    def __init__(self, index: FragIndex, state: ClusterState) -> None:
        self.index = index
        self.state = state
        self.cnt, self.ssum = index.gpu_stats(state.gpu_free)
        self.node_scaled = index.scaled(state.gpu_free_sum, self.cnt, self.ssum,
                                        state.model_idx, state.cpu_free, state.mem_free)
        self.total_scaled = int(self.node_scaled.sum())

    def refresh(self, node: int) -> None:
        st, ix = self.state, self.index
        c, s = ix.gpu_stats(st.gpu_free[node])
        self.cnt[node], self.ssum[node] = c, s
        new = ix.scaled(st.gpu_free_sum[node:node + 1], c[None], s[None], st.model_idx[node:node + 1],
                        st.cpu_free[node:node + 1], st.mem_free[node:node + 1])[0]
        self.total_scaled += int(new - self.node_scaled[node])
        self.node_scaled[node] = new

    @property
    def total_milli(self) -> float:
        return self.total_scaled / self.index.total_weight

    def after_whole(self, nodes: np.ndarray, pod: PodRequest) -> np.ndarray:
        """W * frag of each node after taking ``pod``'s whole GPUs (or none)."""
        st = self.state
        k = pod.num_gpu
        # Whole GPUs are >= every threshold: each count drops by k.
        usable_full = self.index.usable(np.array(GPU_MILLI))
        return self.index.scaled(st.gpu_free_sum[nodes] - k * GPU_MILLI, self.cnt[nodes] - k,
                                 self.ssum[nodes] - k * usable_full, st.model_idx[nodes],
                                 st.cpu_free[nodes] - pod.cpu_milli,
                                 st.mem_free[nodes] - pod.memory_mib)

    def after_sharing(self, nodes: np.ndarray, pod: PodRequest) -> np.ndarray:
        """W * frag after putting the share on each GPU; int64 max where it won't fit."""
        st, ix = self.state, self.index
        m = pod.gpu_milli
        f = st.gpu_free[nodes]
        f2 = f - m
        thr = ix.thresholds
        ge_old = f[..., None] >= thr
        ge_new = f2[..., None] >= thr
        cnt = self.cnt[nodes][:, None, :] - ge_old + ge_new
        ssum = self.ssum[nodes][:, None, :] - ix.usable(f) + ix.usable(f2)
        per = ix.scaled((st.gpu_free_sum[nodes] - m)[:, None], cnt, ssum,
                        st.model_idx[nodes][:, None],
                        (st.cpu_free[nodes] - pod.cpu_milli)[:, None],
                        (st.mem_free[nodes] - pod.memory_mib)[:, None])
        return np.where(f >= m, per, np.iinfo(np.int64).max)

    def best_after(self, nodes: np.ndarray, pod: PodRequest) -> tuple[np.ndarray, np.ndarray | None]:
        """Lowest W * frag reachable on each node, and the GPU that reaches it."""
        if pod.is_sharing:
            per = self.after_sharing(nodes, pod)
            pick = per.argmin(axis=1)  # lowest index among equals
            return per[np.arange(len(nodes)), pick], pick
        return self.after_whole(nodes, pod), None


# ----------------------------------------------------------------------- policies


class Policy:
    """A node-scoring rule.  Higher integer score wins; ties go to priority."""

    name = "policy"

    def bind(self, state: ClusterState) -> None:
        self.state = state

    def placed(self, node: int) -> None:
        """Hook after ``state.place`` so cached per-node data stays current."""

    def score(self, pod: PodRequest, nodes: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        raise NotImplementedError

    def gpus(self, pod: PodRequest, node: int, rng: np.random.Generator) -> tuple[int, ...]:
        return default_gpus(self.state, pod, node)


class RandomPolicy(Policy):
    name = "random"

    def score(self, pod, nodes, rng):
        # Distinct random scores make the priority tie-break irrelevant: uniform choice.
        return rng.permutation(len(nodes)).astype(np.int64)

    def gpus(self, pod, node, rng):
        if not pod.is_sharing:
            return default_gpus(self.state, pod, node)
        fits = np.flatnonzero(self.state.gpu_free[node] >= pod.gpu_milli)
        return (int(fits[rng.integers(len(fits))]),)


def bestfit_scores(cpu_free: np.ndarray, gpu_free_sum: np.ndarray, pod: PodRequest) -> np.ndarray:
    """trunc((1 - s) * 100) with s the mean normalised leftover of CPU and GPU.

    Evaluated exactly in integers: s * 100 * Ncpu * Ngpu =
    50 * Ngpu * cpu_left + 50 * Ncpu * gpu_left.
    """
    cpu_left = cpu_free - pod.cpu_milli
    gpu_left = gpu_free_sum - pod.gpu_demand
    denom = BESTFIT_CPU_NORM * BESTFIT_GPU_NORM
    num = 100 * denom - 50 * BESTFIT_GPU_NORM * cpu_left - 50 * BESTFIT_CPU_NORM * gpu_left
    # Truncation toward zero (the artifact converts a float to int).
    return np.where(num >= 0, num // denom, -((-num) // denom))


class BestFitPolicy(Policy):
    name = "bestfit"

    def score(self, pod, nodes, rng):
        st = self.state
        return bestfit_scores(st.cpu_free[nodes], st.gpu_free_sum[nodes], pod)


def sigmoid_score(delta_milli: np.ndarray) -> np.ndarray:
    """FGD's node score: trunc(100 * sigmoid(frag decrease / 1000))."""
    z = np.clip(np.asarray(delta_milli, dtype=np.float64) / 1000.0, -700, 700)
    return np.floor(100.0 / (1.0 + np.exp(-z))).astype(np.int64)


class FGDPolicy(Policy):
    name = "fgd"

    def __init__(self, typical: Sequence[TypicalPod]) -> None:
        self.typical = tuple(typical)

    def bind(self, state):
        super().bind(state)
        self.tracker = FragTracker(FragIndex(self.typical, state.model_names, state.gpu_width), state)

    def placed(self, node):
        self.tracker.refresh(node)

    def score(self, pod, nodes, rng):
        after, _ = self.tracker.best_after(nodes, pod)
        delta = (self.tracker.node_scaled[nodes] - after) / self.tracker.index.total_weight
        return sigmoid_score(delta)

    def gpus(self, pod, node, rng):
        if not pod.is_sharing:
            return default_gpus(self.state, pod, node)
        _, pick = self.tracker.best_after(np.array([node]), pod)
        return (int(pick[0]),)


SCARCITY_SCALE = 1000


def host_gpus(t: TypicalPod, state: ClusterState) -> int:
    """GPUs on the nodes that could host a pod of type ``t`` were they empty."""
    ok = (state.cpu_total >= t.cpu_milli) & (state.mem_total >= t.memory_mib) & (state.gpu_count >= t.num_gpu)
    allowed = state.allowed(t.models) if t.num_gpu else None
    if allowed is not None:
        ok &= allowed
    return int(state.gpu_count[ok].sum())


# A multi-GPU type weighs its GPU count too where the multi-GPU demand its hosts see is at least this many times what
# they hold (their share of the fleet's GPUs); see ``oversubscribed_types``.
OVERSUBSCRIBED = 2


def host_mask(t: TypicalPod, state: ClusterState) -> np.ndarray:
    """Bool per node: could it host a pod of type ``t`` were it empty?"""
    ok = (state.cpu_total >= t.cpu_milli) & (state.mem_total >= t.memory_mib) & (state.gpu_count >= t.num_gpu)
    allowed = state.allowed(t.models) if t.num_gpu else None
    return ok & allowed if allowed is not None else ok


def oversubscribed_types(typical: Sequence[TypicalPod], state: ClusterState, demand_milli: int,
                         factor: int = OVERSUBSCRIBED) -> frozenset[TypicalPod]:
    """The multi-GPU types whose hosts the workload's multi-GPU demand oversubscribes ``factor`` times or more.

    Each multi-GPU typical type u spreads its GPU demand d_u (count x GPUs x milli) evenly over the GPUs of its hosts
    (S_u GPUs). The load on t's hosts is what falls on them, sum_u d_u * |H_u & H_t| / S_u; t is oversubscribed when
    load / D >= factor * S_t / C (D: the workload's GPU demand, ``demand_milli``; C: the fleet's GPUs), i.e. its hosts
    would see at least ``factor`` times their share of the demand from multi-GPU pods alone. A type is judged by the
    load on its hosts, not by its own demand: on a fleet of mostly 2-GPU nodes the 32-core 4-GPU type's own demand is
    0.3 of its hosts' share, but the 8-GPU pods want the 4- and 8-GPU nodes it shares with them six times over, and
    the 4-GPU nodes only it fits are where it has to go."""
    multi = [t for t in typical if t.num_gpu > 1]
    masks = {t: host_mask(t, state) for t in multi}
    hosts = {t: int(state.gpu_count[masks[t]].sum()) for t in multi}
    fleet = int(state.gpu_count.sum())
    out = set()
    for t in multi:
        if not hosts[t] or not demand_milli:
            continue
        # load = sum_u d_u * shared_u / S_u = num / den, compared exactly: load * C >= factor * D * S_t.
        num, den = 0, 1
        for u in multi:
            if hosts[u]:
                shared = int(state.gpu_count[masks[u] & masks[t]].sum())
                num, den = num * hosts[u] + u.weight * u.num_gpu * u.gpu_milli * shared * den, den * hosts[u]
        if num * fleet >= factor * demand_milli * hosts[t] * den:
            out.add(t)
    return frozenset(out)


def scarcity_weights(typical: Sequence[TypicalPod], state: ClusterState) -> dict[TypicalPod, int]:
    """Integer weight per type: its popularity times C / S_t.

    A pod of type t can only land on the nodes able to host it, which hold S_t
    of the cluster's C GPUs; so each such node sees C / S_t times the average
    arrival rate of t, and what a node loses for t weighs in that proportion.
    A type every node can host keeps FGD's weight (times a constant); a type
    only a few nodes can host (the 120-core 8-GPU pods of openb fit only its
    39 G3 nodes) weighs as much as its demand on those nodes really is.
    """
    total = int(state.gpu_count.sum())
    out: dict[TypicalPod, int] = {}
    for t in typical:
        s = host_gpus(t, state)
        out[t] = t.weight * SCARCITY_SCALE * total // s if s else 0
    return out


class GpupoolPolicy(Policy):
    """Product policy: FGD's score over a measure that knows CPU, memory and scarcity.

    Three changes to FGD's fragmentation measure; the typical-pod set, the
    sigmoid score, the GPU choice by lowest resulting measure and ties by node
    priority are FGD's.

    1. **Capacity cap.** FGD asks, per typical type t, "does t fit on this
       node at all?" and then counts every GPU with free >= m_t as usable by t.
       A node whose CPU (or memory) hosts only n more pods of t can give t at
       most n * k_t GPUs; the rest is stranded for t like a too-small share.
       So usable_t = min(free milli on GPUs >= m_t, n * k_t * 1000), with
       n = min(free CPU // cpu_t, free memory // mem_t) (mem_t: the type's
       median memory request).
    2. **Scarcity weights** (``scarcity``): each type weighs its popularity
       times C / S_t (``scarcity_weights``), so nodes that are the only home of
       a type are not given away to work that fits anywhere.
    3. **Stranded GPUs** (``stranded``): free GPUs on a node whose free CPU
       and memory no GPU typical type fits any more are lost to every future
       pod, not only to the next one, which is all the expected measure
       prices.  The GPU milli a placement leaves stranded this way (after
       minus before) is subtracted from the score's fragmentation decrease
       once more, in full.  Without it the cap makes filling an already
       CPU-starved node look free, and such nodes end with GPUs behind
       exhausted CPU (openb multigpu variants: ~40 % more than FGD at 90 %).
       Residues smaller than every share are not counted again: the measure
       already counts them for every type.

    4. **Demand types** (``demand_pods``): FGD's typical set covers 95 % of
       the pods, so a type of 8-GPU pods that is 1 % of the pods and 10 % of
       the GPUs is invisible and nothing keeps 8-GPU nodes whole for it. The
       types covering 95 % of the GPU demand join the set (weighted by their
       count) where their demand is at least a tenth of the GPUs that could
       host them (``with_demand_types``).

    5. **Oversubscribed hosts** (``oversubscribed``): a multi-GPU type whose
       hosts the workload's multi-GPU demand oversubscribes (at least twice
       their share of the fleet, ``oversubscribed_types``) weighs its GPU
       count too. There every host GPU another pod breaks is a GPU of
       multi-GPU demand that has nowhere else to go, and a lost pod of t loses
       k_t GPUs, not one: a count weight prices a 4-GPU node kept whole as one
       arrival's worth, and the capped measure lets a small pod take a
       CPU-limited 4-GPU node for almost nothing (older-2gpu x multigpu50).

    ``scarcity=False, stranded=False`` is the earlier product policy
    (``gpupool-cap``); the other two combinations are ablations.
    """

    name = "gpupool"

    def __init__(self, typical: Sequence[TypicalPod], scarcity: bool = True, stranded: bool = True,
                 demand_pods: Sequence[PodRequest] = (), oversubscribed: bool = False) -> None:
        self.typical = tuple(typical)
        self.scarcity = scarcity
        self.stranded = stranded
        self.demand_pods = demand_pods
        self.oversubscribed = oversubscribed

    def bind(self, state):
        super().bind(state)
        if self.demand_pods:
            self.typical = with_demand_types(self.demand_pods, self.typical, state=state)
        self.index = FragIndex(self.typical, state.model_names, state.gpu_width)
        gpu_types = [t for t in self.typical if t.num_gpu > 0]
        if self.scarcity:
            weights = scarcity_weights(self.typical, state)
        else:
            weights = {t: t.weight for t in self.typical}
        if self.oversubscribed and self.demand_pods:
            for t in oversubscribed_types(self.typical, state, sum(p.gpu_demand for p in self.demand_pods)):
                weights[t] *= t.num_gpu
        self.weight_total = max(1, sum(weights.values()))
        self._m = np.array([t.gpu_milli for t in gpu_types], dtype=np.int64)
        self._k = np.array([t.num_gpu for t in gpu_types], dtype=np.int64)
        self._cpu = np.array([t.cpu_milli for t in gpu_types], dtype=np.int64)
        self._mem = np.array([t.memory_mib for t in gpu_types], dtype=np.int64)
        self._w = np.array([weights[t] for t in gpu_types], dtype=np.int64)
        self._u = np.searchsorted(self.index.thresholds, self._m)
        self._allowed = np.array(
            [[t.models is None or name in t.models for t in gpu_types] for name in state.model_names],
            dtype=bool).reshape(len(state.model_names), len(gpu_types))
        self.cnt, self.ssum = self.index.gpu_stats(state.gpu_free)
        self.node_scaled = self._scaled(state.gpu_free_sum, self.cnt, self.ssum, state.model_idx,
                                        state.cpu_free, state.mem_free)

    def _scaled(self, gfree, cnt, ssum, model, cpu, mem) -> np.ndarray:
        """W * capped fragmentation; leading axes broadcast, types are the last."""
        if not len(self._w):
            return gfree * self.weight_total
        big = np.int64(1 << 40)
        pods_cpu = np.where(self._cpu > 0, cpu[..., None] // np.maximum(self._cpu, 1), big)
        pods_mem = np.where(self._mem > 0, mem[..., None] // np.maximum(self._mem, 1), big)
        cap = np.minimum(pods_cpu, pods_mem) * self._k * GPU_MILLI
        usable = np.minimum(ssum[..., self._u], cap)
        fits = self._allowed[model] & (cnt[..., self._u] >= self._k)
        return gfree * self.weight_total - (self._w * fits * usable).sum(axis=-1)

    def placed(self, node):
        st = self.state
        c, s = self.index.gpu_stats(st.gpu_free[node])
        self.cnt[node], self.ssum[node] = c, s
        self.node_scaled[node] = self._scaled(st.gpu_free_sum[node], c, s, st.model_idx[node],
                                              st.cpu_free[node], st.mem_free[node])

    # -- GPUs stranded behind host resources

    def host_fits(self, cpu: np.ndarray, mem: np.ndarray, model: np.ndarray) -> np.ndarray:
        """Per node: could any GPU typical type still fit its free CPU and memory (and model)?"""
        fit = (cpu[:, None] >= self._cpu) & (mem[:, None] >= self._mem) & self._allowed[model]
        return fit.any(axis=1)

    def stranded_increase(self, nodes: np.ndarray, pod: PodRequest) -> np.ndarray:
        """GPU milli the pod would leave free behind host CPU/memory no GPU type fits, after minus before."""
        st = self.state
        model = st.model_idx[nodes]
        free = st.gpu_free_sum[nodes]
        before = free * ~self.host_fits(st.cpu_free[nodes], st.mem_free[nodes], model)
        after = (free - pod.gpu_demand) * ~self.host_fits(st.cpu_free[nodes] - pod.cpu_milli,
                                                          st.mem_free[nodes] - pod.memory_mib, model)
        return after - before

    # -- scoring

    def _best_after(self, nodes: np.ndarray, pod: PodRequest) -> tuple[np.ndarray, np.ndarray | None]:
        """Per node: W * measure after the best GPU choice, and that choice (None for whole GPUs)."""
        st, ix = self.state, self.index
        cpu = st.cpu_free[nodes] - pod.cpu_milli
        mem = st.mem_free[nodes] - pod.memory_mib
        if not pod.is_sharing:
            k = pod.num_gpu
            after = self._scaled(st.gpu_free_sum[nodes] - k * GPU_MILLI, self.cnt[nodes] - k,
                                 self.ssum[nodes] - k * ix.usable(np.array(GPU_MILLI)),
                                 st.model_idx[nodes], cpu, mem)
            return after, None
        m = pod.gpu_milli
        f = st.gpu_free[nodes]
        # The measure after the share depends on the node and the chosen GPU's free milli only: evaluate each
        # distinct (node, free) pair once (padded slots and equal GPUs are most of the grid), then spread back.
        rows, cols = np.nonzero(f >= m)
        pairs, back = np.unique(rows * (GPU_MILLI + 1) + f[rows, cols], return_inverse=True)
        r, fv = pairs // (GPU_MILLI + 1), pairs % (GPU_MILLI + 1)
        fv2 = fv - m
        thr = ix.thresholds
        cnt = self.cnt[nodes][r] - (fv[:, None] >= thr) + (fv2[:, None] >= thr)
        ssum = self.ssum[nodes][r] - ix.usable(fv) + ix.usable(fv2)
        val = self._scaled(st.gpu_free_sum[nodes][r] - m, cnt, ssum, st.model_idx[nodes][r], cpu[r], mem[r])
        per = np.full(f.shape, np.iinfo(np.int64).max)
        per[rows, cols] = val[back.reshape(-1)]
        pick = per.argmin(axis=1)  # lowest index among equals
        return per[np.arange(len(nodes)), pick], pick

    def score(self, pod, nodes, rng):
        after, _ = self._best_after(nodes, pod)
        delta = (self.node_scaled[nodes] - after) / self.weight_total
        if self.stranded:
            delta = delta - self.stranded_increase(nodes, pod)
        return sigmoid_score(delta)

    def gpus(self, pod, node, rng):
        if not pod.is_sharing:
            return default_gpus(self.state, pod, node)
        _, pick = self._best_after(np.array([node]), pod)
        return (int(pick[0]),)


def make_policy(name: str, typical: Sequence[TypicalPod] = (), pods: Sequence[PodRequest] = ()) -> Policy:
    """Build a policy by name; FGD-style policies need the typical-pod set, and ``gpupool`` the pods too (its set
    also covers the GPU demand: ``with_demand_types``)."""
    if name == "random":
        return RandomPolicy()
    if name == "bestfit":
        return BestFitPolicy()
    if name == "fgd":
        return FGDPolicy(typical)
    if name in GPUPOOL_VARIANTS:
        scarcity, stranded, demand, oversubscribed = GPUPOOL_VARIANTS[name]
        policy = GpupoolPolicy(typical, scarcity=scarcity, stranded=stranded,
                               demand_pods=pods if demand == "pressure" else (), oversubscribed=oversubscribed)
        if demand == "all" and pods:
            policy.typical = with_demand_types(pods, typical)
        policy.name = name
        return policy
    raise ValueError(f"unknown policy {name!r}; choose from {', '.join(POLICY_NAMES)}")


# ---------------------------------------------------------------------- scheduling


@dataclass(frozen=True)
class Placement:
    node: int
    gpus: tuple[int, ...]


def choose(
    state: ClusterState,
    pod: PodRequest,
    policy: Policy,
    priority: np.ndarray,
    rng: np.random.Generator,
) -> Placement | None:
    """Pick a node and GPUs for ``pod`` (does not commit).  None = no feasible node.

    ``priority`` holds a distinct integer per node; among equal scores the
    higher priority wins, which is how the FGD simulator breaks ties.
    """
    nodes = state.feasible(pod)
    if not len(nodes):
        return None
    scores = policy.score(pod, nodes, rng)
    key = scores * (state.n_nodes + 1) + priority[nodes]
    node = int(nodes[int(np.argmax(key))])
    return Placement(node, policy.gpus(pod, node, rng))


def schedule(
    state: ClusterState,
    pod: PodRequest,
    policy: Policy,
    priority: np.ndarray,
    rng: np.random.Generator,
) -> Placement | None:
    """Choose and commit; returns the placement or None if the pod fails."""
    placement = choose(state, pod, policy, priority, rng)
    if placement is not None:
        state.place(placement.node, pod, placement.gpus)
        policy.placed(placement.node)
    return placement
