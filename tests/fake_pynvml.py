"""A stand-in for the pynvml module, backed by a configurable fake fleet.

Error classes, constants and ctypes structures are the real ones from pynvml (importing pynvml does not load the
driver library), so the backend's `except` clauses are tested against what NVML really raises. Each card can be
told to raise any error from any function: `card.errors["nvmlDeviceGetTemperature"] = pynvml.NVMLError_NotSupported`.

Processes: a card's `processes` are listed by the process list of their `kind` (compute, graphics, or MPS clients),
each with its GPU memory (`used_mib`; None is NVML's "not available"). `card.grow(pid, mib)` makes a process (a job's,
when the test's pid lookup says so) hold more, as a program allocating past its share would.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from types import SimpleNamespace

import pynvml as _real
# noqa below: tests import these from here; FakeNvml serves the rest of pynvml's names via __getattr__
from pynvml import (  # noqa: F401
    NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED, NVML_DEVICE_MIG_DISABLE, NVML_DEVICE_MIG_ENABLE,
    NVML_GPU_INSTANCE_PROFILE_COUNT, NVML_MEMORY_ERROR_TYPE_CORRECTED, NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
    NVML_NVLINK_MAX_LINKS, NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR,
    NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS, NVML_TEMPERATURE_GPU, NVML_VOLATILE_ECC, NVMLError,
    NVMLError_DriverNotLoaded, NVMLError_FunctionNotFound, NVMLError_GpuIsLost, NVMLError_InvalidArgument,
    NVMLError_LibraryNotFound,
    NVMLError_NoPermission, NVMLError_NotFound, NVMLError_NotSupported, NVMLError_Timeout, NVMLError_Unknown,
    NVMLError_Uninitialized, c_nvmlGpuInstancePlacement_t, nvmlEventTypeXidCriticalError,
)

MIB = 1 << 20

# NVML's GPU-instance profiles of an 80 GB A100: profile index -> (profile id, compute slices, memory MB, name)
A100_80GB_PROFILES = {
    0: (19, 1, 9728, "MIG 1g.10gb"), 1: (14, 2, 19968, "MIG 2g.20gb"), 2: (9, 3, 40192, "MIG 3g.40gb"),
    3: (5, 4, 40192, "MIG 4g.40gb"), 4: (0, 7, 80000, "MIG 7g.80gb"), 7: (20, 1, 9728, "MIG 1g.10gb+me"),
    9: (15, 1, 19968, "MIG 1g.20gb"),
}


@dataclass
class FakeProcess:
    pid: int
    used_mib: int | None = 100  # None: NVML_VALUE_NOT_AVAILABLE (pynvml reports usedGpuMemory=None)
    gi_id: int = 0xFFFFFFFF
    ci_id: int = 0xFFFFFFFF
    kind: str = "compute"  # which list names it: "compute", "graphics" or "mps"


@dataclass
class FakeMig:
    uuid: str
    gi_id: int
    profile_id: int
    start: int
    size: int
    mem_total_mib: int
    mem_used_mib: int = 0
    ci_id: int = 0


@dataclass
class FakeCard:
    uuid: str
    name: str = "NVIDIA A100-SXM4-80GB"
    memory_mib: int = 81920
    mem_used_mib: int = 0
    cc: tuple[int, int] = (8, 0)
    bus: str = "00000000:17:00.0"
    numa: int | None = 0
    util: int = 0
    temperature: int = 40
    power_mw: int = 60_000
    ecc_corrected: int = 0
    ecc_uncorrected: int = 0
    retired_pages: dict[int, list[int]] = field(default_factory=dict)
    remapped_rows: tuple[int, int, int, int] | None = (0, 0, 0, 0)
    vbios: str = "92.00.45.00.03"
    mig_mode: int | None = None  # None: not MIG-capable (NotSupported)
    profiles: dict[int, tuple[int, int, int, str]] = field(default_factory=dict)
    migs: list[FakeMig] = field(default_factory=list)
    nvlinks: list[str | None] = field(default_factory=list)  # remote bus id per link, None = inactive
    processes: list[FakeProcess] = field(default_factory=list)
    errors: dict[str, type[NVMLError] | NVMLError] = field(default_factory=dict)

    def process(self, pid: int) -> FakeProcess:
        return next(p for p in self.processes if p.pid == pid)

    def grow(self, pid: int, mib: int) -> FakeProcess:
        """The process `pid` allocates `mib` more (a new process when the card lists none with that pid); the card's
        used memory grows with it."""
        try:
            p = self.process(pid)
        except StopIteration:
            p = FakeProcess(pid, 0)
            self.processes.append(p)
        p.used_mib = (p.used_mib or 0) + mib
        self.mem_used_mib = min(self.memory_mib, self.mem_used_mib + mib)
        return p


@dataclass(frozen=True)
class Handle:
    index: int
    mig: int | None = None


@dataclass(frozen=True)
class GpuInstance:
    index: int
    gi_id: int


class FakeNvml:
    """Module-shaped: `NvmlBackend(FakeNvml(cards))`. Calls are recorded in `calls`."""

    def __init__(self, cards: list[FakeCard], *, driver: str = "550.54.15", cuda: int = 12040,
                 init_error: type[NVMLError] | None = None):
        self.cards = cards
        self.driver = driver
        self.cuda = cuda
        self.init_error = init_error
        self.initialized = False
        self.events: deque[tuple[str, int]] = deque()
        self.registered: set[int] = set()
        self.calls: list[str] = []
        self.created: list[tuple[str, int, int, int]] = []  # (card uuid, profile id, start, size)
        self.destroyed: list[tuple[str, int]] = []

    def __getattr__(self, name):
        # Constants the fake does not list still come from pynvml; functions it lacks must fail loudly.
        if name.startswith("nvml") and not name.startswith("nvmlEventType"):
            raise AttributeError(f"fake pynvml has no {name}")
        return getattr(_real, name)

    # ------------------------------------------------------------ plumbing

    def _card(self, fn: str, h: Handle) -> FakeCard:
        self.calls.append(fn)
        if not self.initialized:
            raise NVMLError_Uninitialized()
        card = self.cards[h.index]
        err = card.errors.get(fn) or card.errors.get("*")
        if err is not None:
            raise err() if isinstance(err, type) else err
        return card

    def _mig(self, fn: str, h: Handle) -> FakeMig:
        card = self._card(fn, h)
        return card.migs[h.mig]

    def inject_xid(self, uuid: str, xid: int) -> None:
        self.events.append((uuid, xid))

    # ------------------------------------------------------------ system

    def nvmlInit(self):
        if self.init_error is not None:
            raise self.init_error()
        self.initialized = True

    def nvmlShutdown(self):
        self.initialized = False

    def nvmlSystemGetDriverVersion(self):
        return self.driver

    def nvmlSystemGetCudaDriverVersion_v2(self):
        return self.cuda

    def nvmlDeviceGetCount(self):
        if not self.initialized:
            raise NVMLError_Uninitialized()
        return len(self.cards)

    def nvmlDeviceGetHandleByIndex(self, i):
        if not 0 <= i < len(self.cards):
            raise NVMLError_InvalidArgument()
        return Handle(i)

    def nvmlDeviceGetHandleByUUID(self, uuid):
        for i, c in enumerate(self.cards):
            if c.uuid == uuid:
                return Handle(i)
        raise NVMLError_NotFound()

    # ------------------------------------------------------------ static card facts

    def nvmlDeviceGetUUID(self, h):
        if h.mig is not None:
            return self._mig("nvmlDeviceGetUUID", h).uuid
        return self._card("nvmlDeviceGetUUID", h).uuid

    def nvmlDeviceGetName(self, h):
        return self._card("nvmlDeviceGetName", h).name

    def nvmlDeviceGetMemoryInfo(self, h):
        if h.mig is not None:
            m = self._mig("nvmlDeviceGetMemoryInfo", h)
            total, used = m.mem_total_mib, m.mem_used_mib
        else:
            c = self._card("nvmlDeviceGetMemoryInfo", h)
            total, used = c.memory_mib, c.mem_used_mib
        return SimpleNamespace(total=total * MIB, used=used * MIB, free=(total - used) * MIB)

    def nvmlDeviceGetCudaComputeCapability(self, h):
        return self._card("nvmlDeviceGetCudaComputeCapability", h).cc

    def nvmlDeviceGetPciInfo(self, h):
        return SimpleNamespace(busId=self._card("nvmlDeviceGetPciInfo", h).bus.encode())

    def nvmlDeviceGetNumaNodeId(self, h):
        c = self._card("nvmlDeviceGetNumaNodeId", h)
        if c.numa is None:
            raise NVMLError_NotSupported()
        return c.numa

    def nvmlDeviceGetVbiosVersion(self, h):
        return self._card("nvmlDeviceGetVbiosVersion", h).vbios

    def nvmlDeviceGetNvLinkState(self, h, link):
        c = self._card("nvmlDeviceGetNvLinkState", h)
        if not c.nvlinks:
            raise NVMLError_NotSupported()
        if link >= len(c.nvlinks):
            raise NVMLError_InvalidArgument()
        return 1 if c.nvlinks[link] else 0

    def nvmlDeviceGetNvLinkRemotePciInfo(self, h, link):
        c = self._card("nvmlDeviceGetNvLinkRemotePciInfo", h)
        return SimpleNamespace(busId=c.nvlinks[link].encode())

    # ------------------------------------------------------------ MIG

    def nvmlDeviceGetMigMode(self, h):
        c = self._card("nvmlDeviceGetMigMode", h)
        if c.mig_mode is None:
            raise NVMLError_NotSupported()
        return [c.mig_mode, c.mig_mode]

    def nvmlDeviceGetGpuInstanceProfileInfo(self, h, profile, version=2):
        c = self._card("nvmlDeviceGetGpuInstanceProfileInfo", h)
        if profile not in c.profiles:
            raise NVMLError_NotSupported()
        pid, slices, mem_mb, name = c.profiles[profile]
        return SimpleNamespace(id=pid, sliceCount=slices, memorySizeMB=mem_mb, name=name.encode())

    def nvmlDeviceGetMaxMigDeviceCount(self, h):
        c = self._card("nvmlDeviceGetMaxMigDeviceCount", h)
        if c.mig_mode is None:
            raise NVMLError_NotSupported()
        return 7

    def nvmlDeviceGetMigDeviceHandleByIndex(self, h, i):
        c = self._card("nvmlDeviceGetMigDeviceHandleByIndex", h)
        if i >= len(c.migs):
            raise NVMLError_NotFound()
        return Handle(h.index, i)

    def nvmlDeviceGetGpuInstanceId(self, h):
        return self._mig("nvmlDeviceGetGpuInstanceId", h).gi_id

    def nvmlDeviceGetComputeInstanceId(self, h):
        return self._mig("nvmlDeviceGetComputeInstanceId", h).ci_id

    def nvmlDeviceGetGpuInstanceById(self, h, gi_id):
        c = self._card("nvmlDeviceGetGpuInstanceById", h)
        if not any(m.gi_id == gi_id for m in c.migs):
            raise NVMLError_NotFound()
        return GpuInstance(h.index, gi_id)

    def nvmlGpuInstanceGetInfo(self, gi):
        c = self._card("nvmlGpuInstanceGetInfo", Handle(gi.index))
        m = next(m for m in c.migs if m.gi_id == gi.gi_id)
        return SimpleNamespace(id=m.gi_id, profileId=m.profile_id,
                               placement=SimpleNamespace(start=m.start, size=m.size))

    def nvmlGpuInstanceGetComputeInstanceById(self, gi, ci_id):
        self._card("nvmlGpuInstanceGetComputeInstanceById", Handle(gi.index))
        return (gi, ci_id)

    def nvmlComputeInstanceDestroy(self, ci):
        gi, ci_id = ci
        self._card("nvmlComputeInstanceDestroy", Handle(gi.index))

    def nvmlGpuInstanceDestroy(self, gi):
        c = self._card("nvmlGpuInstanceDestroy", Handle(gi.index))
        c.migs = [m for m in c.migs if m.gi_id != gi.gi_id]
        self.destroyed.append((c.uuid, gi.gi_id))

    def nvmlDeviceCreateGpuInstanceWithPlacement(self, h, profile_id, placement_ref):
        c = self._card("nvmlDeviceCreateGpuInstanceWithPlacement", h)
        placement = placement_ref._obj
        gi_id = max((m.gi_id for m in c.migs), default=0) + 1
        mem_mb = next(p[2] for p in c.profiles.values() if p[0] == profile_id)
        c.migs.append(FakeMig(f"MIG-{c.uuid}-{gi_id}", gi_id, profile_id, placement.start, placement.size,
                              mem_mb))
        self.created.append((c.uuid, profile_id, placement.start, placement.size))
        return GpuInstance(h.index, gi_id)

    def nvmlGpuInstanceGetComputeInstanceProfileInfo(self, gi, profile, eng_profile, version=2):
        self._card("nvmlGpuInstanceGetComputeInstanceProfileInfo", Handle(gi.index))
        return SimpleNamespace(id=profile, sliceCount=0)

    def nvmlGpuInstanceCreateComputeInstance(self, gi, profile_id):
        self._card("nvmlGpuInstanceCreateComputeInstance", Handle(gi.index))
        return (gi, 0)

    # ------------------------------------------------------------ telemetry

    def nvmlDeviceGetUtilizationRates(self, h):
        if h.mig is not None:
            self._mig("nvmlDeviceGetUtilizationRates", h)
            raise NVMLError_NotSupported()  # as on real MIG devices
        c = self._card("nvmlDeviceGetUtilizationRates", h)
        if c.mig_mode == NVML_DEVICE_MIG_ENABLE:
            raise NVMLError_NotSupported()
        return SimpleNamespace(gpu=c.util, memory=0)

    def nvmlDeviceGetTemperature(self, h, sensor):
        return self._card("nvmlDeviceGetTemperature", h).temperature

    def nvmlDeviceGetPowerUsage(self, h):
        return self._card("nvmlDeviceGetPowerUsage", h).power_mw

    def nvmlDeviceGetTotalEccErrors(self, h, error_type, counter_type):
        c = self._card("nvmlDeviceGetTotalEccErrors", h)
        return c.ecc_corrected if error_type == NVML_MEMORY_ERROR_TYPE_CORRECTED else c.ecc_uncorrected

    def nvmlDeviceGetRetiredPages(self, h, cause):
        return list(self._card("nvmlDeviceGetRetiredPages", h).retired_pages.get(cause, []))

    def nvmlDeviceGetRemappedRows(self, h):
        c = self._card("nvmlDeviceGetRemappedRows", h)
        if c.remapped_rows is None:
            raise NVMLError_NotSupported()
        return c.remapped_rows

    def _processes(self, fn: str, h, kind: str):
        c = self._card(fn, h)
        procs = [p for p in c.processes if p.kind == kind]
        if h.mig is not None:
            m = c.migs[h.mig]
            procs = [p for p in procs if (p.gi_id, p.ci_id) == (m.gi_id, m.ci_id)]
        return [SimpleNamespace(pid=p.pid, usedGpuMemory=None if p.used_mib is None else p.used_mib * MIB,
                                gpuInstanceId=p.gi_id, computeInstanceId=p.ci_id) for p in procs]

    def nvmlDeviceGetComputeRunningProcesses(self, h):
        return self._processes("nvmlDeviceGetComputeRunningProcesses", h, "compute")

    def nvmlDeviceGetGraphicsRunningProcesses(self, h):
        return self._processes("nvmlDeviceGetGraphicsRunningProcesses", h, "graphics")

    def nvmlDeviceGetMPSComputeRunningProcesses(self, h):
        return self._processes("nvmlDeviceGetMPSComputeRunningProcesses", h, "mps")

    # ------------------------------------------------------------ events

    def nvmlEventSetCreate(self):
        return object()

    def nvmlEventSetFree(self, es):
        pass

    def nvmlDeviceRegisterEvents(self, h, types, es):
        self._card("nvmlDeviceRegisterEvents", h)
        if types & nvmlEventTypeXidCriticalError:
            self.registered.add(h.index)

    def nvmlEventSetWait(self, es, timeout_ms):
        while self.events:
            uuid, xid = self.events.popleft()
            index = next(i for i, c in enumerate(self.cards) if c.uuid == uuid)
            if index in self.registered:
                return SimpleNamespace(device=Handle(index), eventType=nvmlEventTypeXidCriticalError, eventData=xid,
                                       gpuInstanceId=0xFFFFFFFF, computeInstanceId=0xFFFFFFFF)
        raise NVMLError_Timeout()


def two_card_node() -> list[FakeCard]:
    """Two H100s joined by NVLink (two links each, direct)."""
    a, b = "00000000:17:00.0", "00000000:2A:00.0"
    return [
        FakeCard("GPU-aaaa", name="NVIDIA H100 80GB HBM3", bus=a, cc=(9, 0), numa=0, util=70, mem_used_mib=2048,
                 temperature=61, power_mw=350_000, ecc_corrected=3, nvlinks=[b, b, None]),
        FakeCard("GPU-bbbb", name="NVIDIA H100 80GB HBM3", bus=b, cc=(9, 0), numa=1, util=5, mem_used_mib=512,
                 temperature=38, power_mw=90_000, nvlinks=[a, a, None]),
    ]


def mig_a100() -> FakeCard:
    """An A100-80GB in MIG mode: 3g.40gb at slice 0, 2g.20gb at 4, 1g.10gb at 6 (a job on the 3g instance)."""
    return FakeCard(
        "GPU-mig0", name="NVIDIA A100-SXM4-80GB", bus="00000000:07:00.0", mig_mode=NVML_DEVICE_MIG_ENABLE,
        profiles=dict(A100_80GB_PROFILES), mem_used_mib=6000,
        migs=[FakeMig("MIG-1111", 1, 9, 0, 4, 40192, 5000), FakeMig("MIG-2222", 5, 14, 4, 2, 19968, 1000),
              FakeMig("MIG-3333", 13, 19, 6, 1, 9728)],
        processes=[FakeProcess(4242, 5000, gi_id=1, ci_id=0)])
