"""A software share of a card: the limits a job on it is given, and the watch that stops a job holding more.

Pure: no I/O, no clock. The node agent (agents/node/share_enforcer.py) feeds it; docs/jobs.md ("Shares of a card")
and docs/operators.md ("Share enforcement") say what a job and an operator see.

A *share* is an Assignment with milli < 1000 that is not a MIG instance: the scheduler put other jobs on the same
card, and nothing in the hardware keeps them apart. (A MIG instance is kept apart by the card itself; a whole card,
milli == 1000, has no neighbour -- a gang's whole cards carry memory_mib = its memory over the cards, which is a
request, not a limit.)

Two things stand for the share:
  * its limits in the environment, in the form the node's configured enforcement reads (`share_env`):
      - "hami": HAMi-core's `CUDA_DEVICE_MEMORY_LIMIT_<i>` ("8192m") and `CUDA_DEVICE_SM_LIMIT_<i>` (percent), i the
        index of the device among the job's visible devices (HAMi-core, src/multiprocess/multiprocess_memory_limit.c,
        reads `<NAME>_<i>` for each CUDA device i it enumerates, falling back to the un-suffixed name; a value takes a
        g/m/k suffix). Needs libvgpu.so preloaded, which the pool does from node configuration.
      - "mps": NVIDIA MPS's `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE` (one percentage for the client's devices) and
        `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT` ("<device ordinal>=<value>,...", e.g. "0=8192M"; NVIDIA MPS guide,
        "Environment Variables"). Needs the node's MPS control daemon.
      - "none": nothing; the watch alone keeps the share.
  * the watch (`ShareWatch`): each telemetry round's per-card memory of each job, from NVML's per-process counts;
    a job above its share on a card for K samples in a row is reported once (`ShareBreach`, code ShareExceeded), and
    only it: its neighbours are not looked at. A sample back within the share starts the count again.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import ClassVar

from schemas.events import Assignment, GpuCard

MODES = ("hami", "mps", "none")
DEFAULT_MODE = "none"
DEFAULT_WATCH_SAMPLES = 3
DEFAULT_STOP_GRACE_S = 5.0
# Where the pool mounts HAMi-core's library in a container (HAMi's own device plugin uses the same place).
HAMI_LIBRARY_IN_CONTAINER = "/usr/local/vgpu/libvgpu.so"
HAMI_CACHE_IN_CONTAINER = "/tmp/gpupool-hami.cache"
HAMI_CACHE_FILE = "hami.cache"
# HAMi-core's lock directory, shared by the processes on the node's cards (sticky and world-writable, like /tmp): HAMi's
# device plugin mounts the host's into every container it limits.
HAMI_LOCK_DIRECTORY = "/tmp/vgpulock"
MPS_DEFAULT_PIPE_DIRECTORY = "/tmp/nvidia-mps"

ENV_MODE = "GPUPOOL_SHARE_ENFORCEMENT"
ENV_HAMI_LIBRARY = "GPUPOOL_HAMI_LIBRARY"
ENV_MPS_PIPE = "GPUPOOL_MPS_PIPE_DIRECTORY"
ENV_MPS_SHM = "GPUPOOL_MPS_SHM_DIRECTORY"
ENV_WATCH_SAMPLES = "GPUPOOL_SHARE_WATCH_SAMPLES"
ENV_SLACK_MIB = "GPUPOOL_SHARE_SLACK_MIB"
ENV_STOP_GRACE_S = "GPUPOOL_SHARE_STOP_GRACE_S"


# ---------------------------------------------------------------- node configuration

@dataclass(frozen=True)
class ShareConfig:
    """How this node keeps shares (docs/operators.md, "Share enforcement"); from the agent's environment."""
    mode: str = DEFAULT_MODE
    hami_library: str = ""  # host path of libvgpu.so (mode "hami")
    mps_pipe_directory: str = ""  # the MPS control daemon's CUDA_MPS_PIPE_DIRECTORY; "" = MPS's default
    mps_shm_directory: str = ""  # the host directory the MPS daemon has as /dev/shm (containers need it); "" = none
    watch_samples: int = DEFAULT_WATCH_SAMPLES  # K; 0 turns the watch off
    slack_mib: int = 0  # a job may hold this much above its share before a sample counts as over
    stop_grace_s: float = DEFAULT_STOP_GRACE_S  # SIGTERM, then SIGKILL after this long

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"{ENV_MODE}={self.mode!r}: one of {', '.join(MODES)}")
        if self.mode == "hami" and not self.hami_library:
            raise ValueError(f"{ENV_MODE}=hami needs {ENV_HAMI_LIBRARY}: the host path of HAMi-core's libvgpu.so")
        if self.hami_library and not self.hami_library.startswith("/"):
            raise ValueError(f"{ENV_HAMI_LIBRARY}={self.hami_library!r}: an absolute path")
        for name, path in ((ENV_MPS_PIPE, self.mps_pipe_directory), (ENV_MPS_SHM, self.mps_shm_directory)):
            if path and not path.startswith("/"):
                raise ValueError(f"{name}={path!r}: an absolute path")
        if self.watch_samples < 0 or self.slack_mib < 0 or self.stop_grace_s < 0:
            raise ValueError(f"{ENV_WATCH_SAMPLES}, {ENV_SLACK_MIB} and {ENV_STOP_GRACE_S} are not negative")

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> "ShareConfig":
        def number(name: str, default, kind):
            text = (environ.get(name) or "").strip()
            try:
                return kind(text) if text else default
            except ValueError:
                raise ValueError(f"{name}={text!r}: a number") from None

        return cls(mode=(environ.get(ENV_MODE) or DEFAULT_MODE).strip().lower(),
                   hami_library=(environ.get(ENV_HAMI_LIBRARY) or "").strip(),
                   mps_pipe_directory=(environ.get(ENV_MPS_PIPE) or "").strip(),
                   mps_shm_directory=(environ.get(ENV_MPS_SHM) or "").strip(),
                   watch_samples=number(ENV_WATCH_SAMPLES, DEFAULT_WATCH_SAMPLES, int),
                   slack_mib=number(ENV_SLACK_MIB, 0, int),
                   stop_grace_s=number(ENV_STOP_GRACE_S, DEFAULT_STOP_GRACE_S, float))


# ---------------------------------------------------------------- what a job on a share is given

def is_share(a: Assignment, card: GpuCard | None = None) -> bool:
    """Part of a card that other jobs may hold too, kept apart by software only."""
    return a.milli < 1000 and a.mig_uuid is None and not (card is not None and card.mig_enabled)


def visible_order(assignments: Iterable[Assignment]) -> list[str]:
    """The job's devices in CUDA's order: as CUDA_VISIBLE_DEVICES lists them (agents/node/nvml_agent.py,
    visible_devices: a MIG slice by its own UUID, a card by the card's, order kept, duplicates dropped)."""
    seen: dict[str, None] = {}
    for a in assignments:
        seen.setdefault(a.mig_uuid or a.gpu_uuid, None)
    return list(seen)


def _cards(cards: Mapping[str, GpuCard] | Iterable[GpuCard] | None) -> dict[str, GpuCard]:
    if cards is None:
        return {}
    if isinstance(cards, Mapping):
        return dict(cards)
    return {c.uuid: c for c in cards}


@dataclass(frozen=True)
class DeviceShare:
    index: int  # among the job's visible devices
    gpu_uuid: str
    milli: int
    memory_mib: int

    @property
    def percent(self) -> int:
        """The compute share as a whole percentage, rounded up (a share is never given less than it holds)."""
        return max(1, min(100, math.ceil(self.milli / 10)))


def device_shares(assignments: Iterable[Assignment],
                  cards: Mapping[str, GpuCard] | Iterable[GpuCard] | None = None) -> list[DeviceShare]:
    """The job's shared devices with their index among its visible devices; several slices of one card add up."""
    assignments = tuple(assignments)
    known = _cards(cards)
    index = {uuid: i for i, uuid in enumerate(visible_order(assignments))}
    out: dict[str, DeviceShare] = {}
    for a in assignments:
        card = known.get(a.gpu_uuid)
        if not is_share(a, card):
            continue
        prev = out.get(a.gpu_uuid)
        milli = min(1000, a.milli + (prev.milli if prev else 0))
        mib = a.memory_mib + (prev.memory_mib if prev else 0)
        if card is not None:
            mib = min(mib, card.memory_mib)
        out[a.gpu_uuid] = DeviceShare(index[a.gpu_uuid], a.gpu_uuid, milli, mib)
    return sorted(out.values(), key=lambda d: d.index)


def share_limits(assignments: Iterable[Assignment],
                 cards: Mapping[str, GpuCard] | Iterable[GpuCard] | None = None) -> dict[str, int]:
    """card uuid -> the MiB the job may hold on it, for its shared cards only (what the watch compares with)."""
    return {d.gpu_uuid: d.memory_mib for d in device_shares(assignments, cards)}


def share_env(assignments: Iterable[Assignment], cards: Mapping[str, GpuCard] | Iterable[GpuCard] | None = None,
              mode: str = DEFAULT_MODE) -> dict[str, str]:
    """The share limits as the node's enforcement reads them; {} for a job with no share, or in mode "none" ("" is
    the default mode)."""
    mode = mode or DEFAULT_MODE
    if mode not in MODES:
        raise ValueError(f"share enforcement {mode!r}: one of {', '.join(MODES)}")
    shares = device_shares(assignments, cards)
    if not shares or mode == "none":
        return {}
    if mode == "hami":
        env: dict[str, str] = {}
        for d in shares:
            env[f"CUDA_DEVICE_MEMORY_LIMIT_{d.index}"] = f"{d.memory_mib}m"
            env[f"CUDA_DEVICE_SM_LIMIT_{d.index}"] = str(d.percent)
        return env
    # MPS: one active-thread percentage for all of the client's devices (the scheduler gives a job on a share that
    # card only; were there several, the smallest share binds them all).
    return {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": str(min(d.percent for d in shares)),
            "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": ",".join(f"{d.index}={d.memory_mib}M" for d in shares)}


def share_environment(assignments: Iterable[Assignment], cards: Mapping[str, GpuCard] | Iterable[GpuCard] | None,
                      config: ShareConfig, *, job_dir: str | None = None, in_container: bool = False
                      ) -> dict[str, str]:
    """Everything the pool adds to a job's environment for its shares: `share_env`, and what the mechanism needs to
    read it -- HAMi-core preloaded (LD_PRELOAD, never the job's to set) with a cache file of the job's own (HAMi-core
    sums the memory of the processes that share one cache file: one per job, so one job's processes count together
    and another job's do not); the MPS daemon's pipe directory when the node moved it. {} for a job with no share."""
    assignments = tuple(assignments)
    env = share_env(assignments, cards, config.mode)
    if not env:
        return env
    if config.mode == "hami":
        env["LD_PRELOAD"] = HAMI_LIBRARY_IN_CONTAINER if in_container else config.hami_library
        if in_container:
            env["CUDA_DEVICE_MEMORY_SHARED_CACHE"] = HAMI_CACHE_IN_CONTAINER  # the container's own /tmp
        elif job_dir:
            env["CUDA_DEVICE_MEMORY_SHARED_CACHE"] = f"{job_dir.rstrip('/')}/{HAMI_CACHE_FILE}"
    elif config.mode == "mps" and config.mps_pipe_directory:
        env["CUDA_MPS_PIPE_DIRECTORY"] = config.mps_pipe_directory
    return env


@dataclass(frozen=True)
class ShareMount:
    host_path: str
    container_path: str
    read_only: bool


def share_mounts(assignments: Iterable[Assignment], cards: Mapping[str, GpuCard] | Iterable[GpuCard] | None,
                 config: ShareConfig) -> list[ShareMount]:
    """What a container on a share needs from the host: HAMi-core's library (read-only) and lock directory, or the
    MPS pipe directory (the client talks to the node's MPS daemon through it) and, when the node names it, the
    daemon's shared memory as the container's /dev/shm (NVIDIA's device plugin gives MPS clients the same). None for
    a job with no share."""
    if not device_shares(assignments, cards):
        return []
    if config.mode == "hami":
        return [ShareMount(config.hami_library, HAMI_LIBRARY_IN_CONTAINER, True),
                ShareMount(HAMI_LOCK_DIRECTORY, HAMI_LOCK_DIRECTORY, False)]
    if config.mode == "mps":
        pipe = config.mps_pipe_directory or MPS_DEFAULT_PIPE_DIRECTORY
        shm = [ShareMount(config.mps_shm_directory, "/dev/shm", False)] if config.mps_shm_directory else []
        return [ShareMount(pipe, pipe, False)] + shm
    return []


# ---------------------------------------------------------------- the watch

def usage_by_job(per_pid: Mapping[int, Mapping[str, int]], job_of_pid: Callable[[int], str | None]
                 ) -> dict[str, dict[str, int]]:
    """pid -> card -> MiB (NVML's per-process counts) to job -> card -> MiB, the job's processes added up.
    A pid of no job (another user's program, the MPS server) is left out."""
    out: dict[str, dict[str, int]] = {}
    for pid, cards in per_pid.items():
        try:
            job = job_of_pid(pid)
        except Exception:  # noqa: BLE001 - a process that exits while it is looked up belongs to no one
            job = None
        if not job:
            continue
        mine = out.setdefault(job, {})
        for card, mib in cards.items():
            mine[card] = mine.get(card, 0) + max(0, int(mib))
    return out


@dataclass(frozen=True)
class GpuMemoryUsage:
    """One telemetry round's GPU memory per job and card, and which cards' process lists could be read completely:
    a card missing from `cards` tells nothing about its jobs this round (neither over nor within)."""
    by_job: Mapping[str, Mapping[str, int]] = field(default_factory=dict)
    cards: frozenset[str] = frozenset()


@dataclass(frozen=True)
class ShareBreach:
    job_id: str
    gpu_uuid: str
    used_mib: int
    allowed_mib: int
    samples: int
    code: ClassVar[str] = "ShareExceeded"

    @property
    def message(self) -> str:
        return (f"share exceeded: held {self.used_mib} MiB of GPU memory on card {self.gpu_uuid}, more than its "
                f"share of {self.allowed_mib} MiB, in {self.samples} samples in a row")


class ShareWatch:
    """Counts, per job, the telemetry samples in a row in which it held more than its share on one of its shared
    cards; at `samples` such samples it is reported, once. A sample in which every one of its shared cards was read
    and it held no more than its share on each starts the count again; a sample in which one of them was not read
    changes nothing. A job no longer in `allowed` (it ended, or holds no share now) is forgotten."""

    def __init__(self, samples: int = DEFAULT_WATCH_SAMPLES, slack_mib: int = 0):
        if samples < 0 or slack_mib < 0:
            raise ValueError("samples and slack_mib are not negative")
        self.samples = samples
        self.slack_mib = slack_mib
        self.over: dict[str, int] = {}
        self.reported: set[str] = set()

    def observe(self, usage: Mapping[str, Mapping[str, int]], allowed: Mapping[str, Mapping[str, int]],
                read_cards: Collection[str] | None = None) -> list[ShareBreach]:
        """One round. usage: job -> card -> MiB held; allowed: job -> card -> MiB of its share (shared cards only);
        read_cards: the cards whose processes were read this round (None: all)."""
        for job in set(self.over) | self.reported:
            if job not in allowed:
                self.forget(job)
        if self.samples == 0:
            return []
        out: list[ShareBreach] = []
        for job in sorted(allowed):
            shares = allowed[job]
            if not shares:
                self.forget(job)
                continue
            held = usage.get(job, {})
            worst: tuple[int, str, int, int] | None = None  # (excess, card, used, allowed)
            complete = True
            for card in sorted(shares):
                if read_cards is not None and card not in read_cards:
                    complete = False
                    continue
                used, limit = int(held.get(card, 0)), int(shares[card])
                excess = used - limit
                if excess > self.slack_mib and (worst is None or excess > worst[0]):
                    worst = (excess, card, used, limit)
            if worst is None:
                if complete:
                    self.over.pop(job, None)
                continue
            count = self.over.get(job, 0) + 1
            self.over[job] = count
            if count >= self.samples and job not in self.reported:
                self.reported.add(job)
                out.append(ShareBreach(job, worst[1], worst[2], worst[3], count))
        return out

    def forget(self, job: str) -> None:
        self.over.pop(job, None)
        self.reported.discard(job)
