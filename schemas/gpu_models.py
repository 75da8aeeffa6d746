"""The compute profile of each card model (seed 001's 算力规格画像) and the real MIG profile tables.

A compute unit: 1000 milli-CU = the dense FP16/BF16 tensor throughput of one A100 (312 TFLOP/s). A card's CU is its
dense tensor throughput relative to that, so users ask for compute and memory and never name a model.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MigProfile:
    name: str
    compute_slices: int  # of 7
    memory_slices: int  # of 8
    starts: tuple[int, ...]  # allowed first memory slice (NVIDIA's placement table)
    memory_mib: int


@dataclass(frozen=True)
class GpuModel:
    name: str
    cu_milli: int
    memory_mib: int
    generation: int  # larger is newer
    compute_capability: str
    mig_profiles: tuple[MigProfile, ...] = ()

    @property
    def mig_capable(self) -> bool:
        return bool(self.mig_profiles)


def _mig(gb_1g: int, gb_1g_big: int, gb_2g: int, gb_3g: int, gb_4g: int, gb_7g: int, mib_per_gb: int = 1024):
    """The A100/H100/H200 family share one slice geometry; only the memory per slice differs."""
    return (
        MigProfile(f"1g.{gb_1g}gb", 1, 1, (0, 1, 2, 3, 4, 5, 6), gb_1g * mib_per_gb),
        MigProfile(f"1g.{gb_1g_big}gb", 1, 2, (0, 2, 4, 6), gb_1g_big * mib_per_gb),
        MigProfile(f"2g.{gb_2g}gb", 2, 2, (0, 2, 4), gb_2g * mib_per_gb),
        MigProfile(f"3g.{gb_3g}gb", 3, 4, (0, 4), gb_3g * mib_per_gb),
        MigProfile(f"4g.{gb_4g}gb", 4, 4, (0,), gb_4g * mib_per_gb),
        MigProfile(f"7g.{gb_7g}gb", 7, 8, (0,), gb_7g * mib_per_gb),
    )


MODELS: dict[str, GpuModel] = {m.name: m for m in (
    GpuModel("P100", 67, 16 * 1024, 6, "6.0"),
    GpuModel("V100M16", 400, 16 * 1024, 7, "7.0"),
    GpuModel("V100M32", 400, 32 * 1024, 7, "7.0"),
    GpuModel("T4", 208, 15 * 1024, 7, "7.5"),
    GpuModel("A10", 400, 24 * 1024, 8, "8.6"),
    GpuModel("G2", 400, 24 * 1024, 7, "7.5"),  # undisclosed openb models: assumed V100-class
    GpuModel("G3", 400, 32 * 1024, 7, "7.5"),
    GpuModel("L4", 388, 24 * 1024, 9, "8.9"),
    GpuModel("A100-40GB", 1000, 40 * 1024, 8, "8.0", _mig(5, 10, 10, 20, 20, 40)),
    GpuModel("A100-80GB", 1000, 80 * 1024, 8, "8.0", _mig(10, 20, 20, 40, 40, 80)),
    GpuModel("H100-80GB", 3170, 80 * 1024, 9, "9.0", _mig(10, 20, 20, 40, 40, 80)),
    GpuModel("H200", 3170, 141 * 1024, 9, "9.0", _mig(18, 35, 35, 71, 71, 141)),
)}

MIG_MEMORY_SLICES = 8
MIG_COMPUTE_SLICES = 7
MIG_COMPUTE_SLICES = 7


def model(name: str) -> GpuModel:
    """Unknown models are accepted (new cards auto-register) and get a conservative profile."""
    return MODELS.get(name) or GpuModel(name, 400, 16 * 1024, 7, "7.0")


def mig_profile(model_name: str, profile: str) -> MigProfile:
    """The profile from the model's table; for a card we have no table for (a new model reporting MIG instances),
    what the name itself says ("<g>g.<gb>gb"), with no placements, so the scheduler uses but never creates it."""
    for p in model(model_name).mig_profiles:
        if p.name == profile:
            return p
    try:
        g, gb = profile.split("+")[0].split(".")
        compute = int(g.rstrip("g"))
        return MigProfile(profile, compute, compute, (), int(gb.rstrip("gb")) * 1024)
    except ValueError:
        raise KeyError(f"{model_name} has no MIG profile {profile}") from None


def mig_share_milli(p: MigProfile) -> int:
    """A MIG instance's share of its card, in milli-GPU (compute slices of 7)."""
    return p.compute_slices * 1000 // MIG_COMPUTE_SLICES


def share_for(compute_milli: int, gpu_model: GpuModel) -> int:
    """milli-GPU of this model needed to deliver `compute_milli` CU (rounded up)."""
    return -(-compute_milli * 1000 // gpu_model.cu_milli)


def version_tuple(v: str | None) -> tuple[int, ...]:
    if not v:
        return ()
    out = []
    for part in v.split("."):
        digits = "".join(ch for ch in part if ch.isdigit())
        out.append(int(digits) if digits else 0)
    return tuple(out)
