"""The offline simulator's node-scoring packing policies over a vectorised cluster state.

Used by the FGD-protocol replay (agents/sim/fgd_protocol.py) for the anchors' rows: the product's row is the live
scheduler itself (agents/sim/live_protocol.py feeds it the trace's events); nothing of its policy is copied here.
FGD's measure itself (``TypicalPod``, ``FragIndex``, ``fragmentation``) lives in
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
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np

from streams.folds.fgd_measure import GPU_MILLI, FragIndex, TypicalPod

POLICY_NAMES = ("random", "bestfit", "fgd")  # the anchors; the product row is the live scheduler

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


def make_policy(name: str, typical: Sequence[TypicalPod] = (), pods: Sequence[PodRequest] = ()) -> Policy:
    """Build an anchor's policy by name; FGD needs the typical-pod set."""
    if name == "random":
        return RandomPolicy()
    if name == "bestfit":
        return BestFitPolicy()
    if name == "fgd":
        return FGDPolicy(typical)
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
