"""FGD's fragmentation measure (Weng et al., USENIX ATC'23) for one node: shared by the cluster metrics
(streams/folds/cluster_metrics.py) and the offline simulator's anchor policies (agents/sim/packing.py).

Pure module: stdlib + numpy only. Capacity arithmetic is integral (CPU in milli-cores, memory in MiB, GPU in
milli-GPU, 1000 = one whole GPU); the measure is kept as an integer scaled by the total typical-pod weight so that
comparisons between candidate placements are exact, and only divided down when reported.

The live scheduler's score (agents/scheduler/scoring.py) is not this measure: it is the `gpupool` policy's capped
measure with stranded GPUs and scarcity weights, in pure integer Python on its own typical job shapes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

GPU_MILLI = 1000


@dataclass(frozen=True)
class TypicalPod:
    """One pod type of the workload with its (integer) frequency weight."""

    cpu_milli: int
    gpu_milli: int
    num_gpu: int
    models: frozenset[str] | None
    weight: int
    memory_mib: int = 0


class FragIndex:
    """FGD's fragmentation measure, precomputed as a lookup table.

    For a node with free GPU milli G, F_t = G unless type t fits (model allowed,
    >= k_t GPUs with free >= m_t, enough CPU [and memory]), in which case F_t is
    the free milli on GPUs with free < m_t, i.e. G - S(m_t) with S(m) the free
    milli on GPUs with free >= m.  Hence

        W * frag = G * W - sum_u S(u) * w(u, model, cnt(u), cpu, mem)

    where u runs over the distinct m_t, cnt(u) is the number of GPUs with free
    >= u, and w(...) is the total weight of the types with m_t = u that fit
    given those counts: a table indexed by model, count and CPU/memory bucket.
    That turns the per-type loop into a few gathers per threshold.
    """

    def __init__(
        self,
        typical: Sequence[TypicalPod],
        model_names: Sequence[str],
        gpu_width: int,
        use_memory: bool = False,
        residue: bool = False,
    ) -> None:
        self.residue = residue
        self.total_weight = int(sum(t.weight for t in typical)) or 1
        gpu_types = [t for t in typical if t.num_gpu > 0]
        self.thresholds = np.array(sorted({t.gpu_milli for t in gpu_types}), dtype=np.int64)
        self.cpu_cuts = np.array(sorted({t.cpu_milli for t in gpu_types}), dtype=np.int64)
        mems = {t.memory_mib for t in gpu_types} if use_memory else {0}
        self.mem_cuts = np.array(sorted(mems), dtype=np.int64)
        self.use_memory = use_memory
        n_models = max(1, len(model_names))
        shape = (len(self.thresholds), n_models, gpu_width + 1,
                 len(self.cpu_cuts) + 1, len(self.mem_cuts) + 1)
        table = np.zeros(shape, dtype=np.int64)
        for t in gpu_types:
            if t.num_gpu > gpu_width:
                continue
            u = int(np.searchsorted(self.thresholds, t.gpu_milli))
            c = int(np.searchsorted(self.cpu_cuts, t.cpu_milli)) + 1
            m = int(np.searchsorted(self.mem_cuts, t.memory_mib if use_memory else 0)) + 1
            for mi, name in enumerate(model_names):
                if t.models is None or name in t.models:
                    table[u, mi, t.num_gpu, c, m] += t.weight
        # "at least k GPUs / at least this much CPU and memory" = prefix sums.
        for axis in (2, 3, 4):
            table = np.cumsum(table, axis=axis)
        self._flat = table.ravel()
        s = table.strides
        item = table.itemsize
        self._stride = tuple(x // item for x in s)
        self._u_base = np.arange(len(self.thresholds), dtype=np.int64) * self._stride[0]

    def _weights(self, cnt: np.ndarray, model: np.ndarray, cb: np.ndarray, mb: np.ndarray) -> np.ndarray:
        """Fitting weight per threshold; cnt has a trailing threshold axis."""
        _, sm, sc, scb, smb = self._stride
        base = model * sm + cb * scb + mb * smb
        return self._flat[self._u_base + cnt * sc + base[..., None]]

    def buckets(self, cpu: np.ndarray, mem: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        cb = np.searchsorted(self.cpu_cuts, cpu, side="right")
        if self.use_memory:
            mb = np.searchsorted(self.mem_cuts, mem, side="right")
        else:
            mb = np.ones_like(cb)
        return cb, mb

    def usable(self, gpu_free: np.ndarray) -> np.ndarray:
        """Free milli of each GPU that a type of each threshold can use.

        FGD: all of it once free >= m.  With ``residue``, only whole multiples
        of m: what is left after packing that type as tightly as possible is
        waste too (a full GPU still strands 190 milli for 810-milli pods).
        """
        f = gpu_free[..., None]
        if self.residue:
            return (f // self.thresholds) * self.thresholds
        return f * (f >= self.thresholds)

    def gpu_stats(self, gpu_free: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per threshold: GPUs with free >= it, and their usable free milli."""
        ge = gpu_free[..., None] >= self.thresholds
        return ge.sum(axis=-2), self.usable(gpu_free).sum(axis=-2)

    def scaled(self, gfree: np.ndarray, cnt: np.ndarray, ssum: np.ndarray,
               model: np.ndarray, cpu: np.ndarray, mem: np.ndarray) -> np.ndarray:
        """W * frag for nodes described by their threshold statistics."""
        cb, mb = self.buckets(cpu, mem)
        fit = (ssum * self._weights(cnt, model, cb, mb)).sum(axis=-1)
        return gfree * self.total_weight - fit

    def to_milli(self, scaled) -> np.ndarray | int:
        w = self.total_weight
        return (2 * np.asarray(scaled) + w) // (2 * w)


def fragmentation(
    gpu_free_milli: Sequence[int],
    free_cpu_milli: int,
    free_memory_mib: int,
    typical: Sequence[TypicalPod],
    model: str | None = None,
) -> int:
    """FGD fragmentation (milli-GPU) of one node for a typical-pod set.

    ``model`` None means "allowed for every type".  FGD's measure looks at CPU
    only; memory is accepted so callers can pass a node's whole free vector
    (and keep working if the measure learns about memory).
    """
    free = np.asarray(list(gpu_free_milli), dtype=np.int64)
    if (free < 0).any():
        raise ValueError("negative free GPU milli")
    names = (model,) if model is not None else ("",)
    any_model = [
        TypicalPod(t.cpu_milli, t.gpu_milli, t.num_gpu,
                   None if model is None else t.models, t.weight, t.memory_mib)
        for t in typical
    ]
    index = FragIndex(any_model, names, max(1, len(free)))
    padded = np.zeros(max(1, len(free)), dtype=np.int64)
    padded[: len(free)] = free
    cnt, ssum = index.gpu_stats(padded[None, :])
    scaled = index.scaled(padded.sum()[None], cnt, ssum, np.zeros(1, np.int64),
                          np.array([free_cpu_milli]), np.array([free_memory_mib]))
    return int(index.to_milli(scaled)[0])
