"""Real GPUs through NVML: one node's inventory and telemetry in the project's contracts.

The pynvml module is a constructor argument so that tests can hand in a fake fleet (tests/fake_pynvml.py); nothing
here touches the library except through `self.nv`.

Error policy. NVML answers "not supported" for many fields on many cards (utilization of a MIG parent, ECC on a
consumer card, NUMA id on an old driver); such a field keeps its contract default. NoPermission and FunctionNotFound
are treated the same way: an unprivileged agent or an older driver is a property of the host, not a fault of the
card, and turning them into health events would take healthy cards out of service. Every other NVML error while
reading a card (GpuIsLost, Unknown, ResetRequired, ...) means the card cannot be trusted: it is left out of the
samples and reported once as a GpuHealth(healthy=False) event. telemetry() never raises.

Per-process GPU memory. Each telemetry pass also reads, per card, the memory NVML counts for each process (compute,
graphics and MPS-client process lists, usedGpuMemory), maps the pids to jobs with the same lookup as the samples'
job_ids, and keeps the result as `last_usage` (agents/node/shares.py GpuMemoryUsage: job -> card -> MiB, and the
cards whose lists were read completely): what the node agent's share watch compares with each job's share. A card
whose compute list cannot be read (NoPermission: an unprivileged agent) or that names a process without a count
(NVML's "not available") is left out of `last_usage.cards`: that round says nothing about its jobs.

MIG instances are enumerated through MIG device handles (nvmlDeviceGetMigDeviceHandleByIndex) rather than through
nvmlDeviceGetGpuInstances: a MIG device handle is one compute instance and carries the UUID that CUDA_VISIBLE_DEVICES
needs, and its GPU instance (nvmlDeviceGetGpuInstanceById / nvmlGpuInstanceGetInfo) gives the placement.
"""
from __future__ import annotations

import ctypes
import logging
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from agents.node.shares import GpuMemoryUsage, usage_by_job
from schemas.events import GpuCard, GpuHealth, GpuSample, GpuTelemetry, MigInstance, NodeInventory
from schemas.gpu_models import MIG_MEMORY_SLICES, MODELS
from streams.folds.node_view import FATAL_XIDS

log = logging.getLogger("gpupool.nvml")

MIB = 1 << 20
# NVIDIA's InfoROM holds at most this many retired pages; a full table is the documented replace-the-board signal.
RETIRED_PAGES_LIMIT = 64
# NVML reports "no MIG instance" in process and event records with this sentinel.
NO_INSTANCE = 0xFFFFFFFF
_EVENT_DRAIN_MAX = 1024  # a storm of XIDs must not stall one telemetry tick

JobOfPid = Mapping[int, str] | Callable[[int], "str | None"]


class CardFault(Exception):
    """A card-level failure: the card is skipped and reported unhealthy."""


def _text(v) -> str:
    return v.decode(errors="replace") if isinstance(v, (bytes, bytearray)) else str(v)


def normalize_bus_id(bus: str) -> str:
    """NVML writes `00000000:17:00.0`; the inventory uses the 4-digit-domain form `0000:17:00.0`."""
    bus = _text(bus).strip().lower()
    domain, _, rest = bus.partition(":")
    if not rest:
        return bus
    try:
        return f"{int(domain, 16):04x}:{rest}"
    except ValueError:
        return bus


_NAME_RULES: tuple[tuple[str, Callable[[int], str | None]], ...] = (
    (r"\bA100\b", lambda mib: "A100-80GB" if mib > 48 * 1024 else "A100-40GB"),
    # H100 NVL / 94 GB / 96 GB parts have other MIG memory profiles than H100-80GB: they keep their NVML name.
    (r"\bH100\b", lambda mib: "H100-80GB" if mib <= 82 * 1024 else None),
    (r"\bH200\b", lambda mib: "H200"),
    (r"\bV100\b", lambda mib: "V100M32" if mib > 20 * 1024 else "V100M16"),
    (r"\bP100\b", lambda mib: "P100"),
    (r"\bT4\b", lambda mib: "T4"),
    (r"\bA10\b(?!\w)", lambda mib: "A10"),
    (r"\bL4\b", lambda mib: "L4"),
)


def model_name(nvml_name: str, memory_mib: int) -> str:
    """Map NVML's product name onto schemas/gpu_models.py; unrecognised cards keep the NVML name."""
    for pattern, pick in _NAME_RULES:
        if re.search(pattern, nvml_name):
            picked = pick(memory_mib)
            if picked:
                return picked
            break
    return nvml_name


def _mig_profile_name(raw: str, model: str, slices: int, mem_slices: int) -> str:
    """NVML says `MIG 1g.10gb+me`; the scheduler knows the geometry `1g.10gb` from gpu_models.

    Variants (+me, +gfx, -me) share a base profile's geometry; a name the model's table lacks is replaced by the
    table's profile of the same geometry, because the scheduler looks each instance's profile up by name.
    """
    name = raw.removeprefix("MIG ").strip()
    base = re.split(r"[+-]", name, maxsplit=1)[0]
    known = MODELS.get(model)
    if known is None:
        return base or name
    names = {p.name for p in known.mig_profiles}
    if base in names:
        return base
    for p in known.mig_profiles:
        if p.compute_slices == slices and p.memory_slices == mem_slices:
            return p.name
    return base or name


@dataclass
class _Mig:
    handle: object
    uuid: str
    gi_id: int
    ci_id: int
    profile: str
    start: int
    size: int


@dataclass
class _CardRead:
    """What one telemetry pass learned about one card."""
    uuid: str
    samples: list[GpuSample] = field(default_factory=list)
    faults: list[str] = field(default_factory=list)
    pid_mib: dict[int, int] | None = None  # GPU memory per process on the card; None: not read completely


class NvmlBackend:
    def __init__(self, nvml=None, *, cpu_milli: int | None = None, memory_mib: int | None = None):
        if nvml is None:
            import pynvml as nvml
        self.nv = nvml
        self.cpu_milli = cpu_milli if cpu_milli is not None else (os.cpu_count() or 1) * 1000
        self.memory_mib = memory_mib if memory_mib is not None else _host_memory_mib()
        self._open = False
        self._events = None
        self._registered: set[str] = set()
        self._uuid_by_index: dict[int, str] = {}
        self._reported: dict[str, str] = {}  # card -> last fault reported, so a lasting fault is one event
        self._profiles: dict[str, dict[int, tuple[str, int]]] = {}  # card -> GI profile id -> (NVML name, slices)
        self._skip_fields = (nvml.NVMLError_NotSupported, nvml.NVMLError_NoPermission,
                             nvml.NVMLError_FunctionNotFound)
        self.last_usage = GpuMemoryUsage()  # per job and card, from the last telemetry pass

    # ---------------------------------------------------------------- lifecycle

    def open(self) -> "NvmlBackend":
        """nvmlInit; raises the NVML error (LibraryNotFound, DriverNotLoaded, ...) when there is no usable driver."""
        if not self._open:
            self.nv.nvmlInit()
            self._open = True
            # Remember each card's UUID while it can still be read: a card that is lost later answers nothing,
            # and its health event must name it.
            for index, h in self._handles_or_none():
                try:
                    self._uuid_by_index[index] = _text(self.nv.nvmlDeviceGetUUID(h))
                except self.nv.NVMLError:
                    pass
            try:
                self._events = self.nv.nvmlEventSetCreate()
            except self.nv.NVMLError as exc:
                log.warning("no NVML event set, XIDs will not be reported: %s", exc)
                self._events = None
        return self

    def close(self) -> None:
        if not self._open:
            return
        if self._events is not None:
            try:
                self.nv.nvmlEventSetFree(self._events)
            except self.nv.NVMLError:
                pass
        self._events = None
        self._registered.clear()
        try:
            self.nv.nvmlShutdown()
        except self.nv.NVMLError:
            pass
        self._open = False

    def __enter__(self) -> "NvmlBackend":
        return self.open()

    def __exit__(self, *exc) -> None:
        self.close()

    # ---------------------------------------------------------------- helpers

    def _opt(self, default, fn: str, *args):
        """A field NVML may not support: the default then, any other NVML error propagates (a card fault)."""
        try:
            return getattr(self.nv, fn)(*args)
        except self._skip_fields:
            return default

    def _handles(self) -> list[tuple[int, object]]:
        return [(i, self.nv.nvmlDeviceGetHandleByIndex(i)) for i in range(self.nv.nvmlDeviceGetCount())]

    def _system_versions(self) -> tuple[str, str]:
        driver = _text(self._opt("", "nvmlSystemGetDriverVersion"))
        cuda = self._opt(0, "nvmlSystemGetCudaDriverVersion_v2")
        return driver, f"{cuda // 1000}.{(cuda % 1000) // 10}" if cuda else ""

    def _gi_profiles(self, uuid: str, h) -> dict[int, tuple[str, int]]:
        """GPU-instance profile id -> (NVML name, compute slices), probed once per card."""
        if uuid in self._profiles:
            return self._profiles[uuid]
        out: dict[int, tuple[str, int]] = {}
        for p in range(getattr(self.nv, "NVML_GPU_INSTANCE_PROFILE_COUNT", 0)):
            try:
                info = self.nv.nvmlDeviceGetGpuInstanceProfileInfo(h, p)
            except self.nv.NVMLError:
                continue  # profiles a card lacks answer NotSupported or InvalidArgument
            name = _text(getattr(info, "name", b"")) or f"{info.sliceCount}g.{round(info.memorySizeMB / 1024)}gb"
            out[int(info.id)] = (name, int(info.sliceCount))
        self._profiles[uuid] = out
        return out

    def _migs(self, uuid: str, h, model: str) -> list[_Mig]:
        count = self._opt(0, "nvmlDeviceGetMaxMigDeviceCount", h)
        profiles = self._gi_profiles(uuid, h) if count else {}
        out = []
        for i in range(count):
            try:
                mh = self.nv.nvmlDeviceGetMigDeviceHandleByIndex(h, i)
            except self.nv.NVMLError_NotFound:
                continue  # sparse: unused indices answer NotFound
            gi_id = int(self.nv.nvmlDeviceGetGpuInstanceId(mh))
            ci_id = int(self._opt(0, "nvmlDeviceGetComputeInstanceId", mh))
            info = self.nv.nvmlGpuInstanceGetInfo(self.nv.nvmlDeviceGetGpuInstanceById(h, gi_id))
            start, size = int(info.placement.start), int(info.placement.size)
            raw, slices = profiles.get(int(info.profileId), (f"profile-{info.profileId}", 0))
            out.append(_Mig(mh, _text(self.nv.nvmlDeviceGetUUID(mh)), gi_id, ci_id,
                            _mig_profile_name(raw, model, slices, size), start, max(size, 1)))
        return sorted(out, key=lambda m: (m.start, m.uuid))

    # ---------------------------------------------------------------- inventory

    def inventory(self, node: str, rack: str = "rack-0", datacenter: str = "dc-0",
                  labels: dict[str, str] | None = None) -> NodeInventory:
        """The node as NVML sees it now. A card that cannot be read is left out (telemetry reports it)."""
        driver, cuda = self._system_versions()
        cards: list[dict] = []
        links: dict[str, tuple[set[str], bool]] = {}  # bus -> (remote buses, has an active link)
        for index, h in self._handles_or_none():
            try:
                cards.append(self._card(index, h, driver, cuda, links))
            except self.nv.NVMLError as exc:
                log.warning("card %d left out of the inventory: %s: %s", index, type(exc).__name__, exc)
        peers, domains = _nvlink_topology(node, links)
        by_bus = {c["pci_bus"]: c["uuid"] for c in cards if c["pci_bus"]}
        gpus = tuple(GpuCard(**c, nvlink_domain=domains.get(c["pci_bus"]),
                             nvlink_peers=tuple(sorted(by_bus[b] for b in peers.get(c["pci_bus"], ()) if b in by_bus)))
                     for c in cards)
        return NodeInventory(node=node, rack=rack, datacenter=datacenter, cpu_milli=self.cpu_milli,
                             memory_mib=self.memory_mib, gpus=gpus, labels=dict(labels or {}))

    def _handles_or_none(self) -> list[tuple[int, object]]:
        try:
            return self._handles()
        except self.nv.NVMLError as exc:
            log.error("NVML cannot enumerate cards: %s", exc)
            return []

    def _card(self, index: int, h, driver: str, cuda: str, links: dict) -> dict:
        nv = self.nv
        uuid = _text(nv.nvmlDeviceGetUUID(h))
        self._uuid_by_index[index] = uuid
        memory_mib = int(nv.nvmlDeviceGetMemoryInfo(h).total // MIB)
        model = model_name(_text(nv.nvmlDeviceGetName(h)), memory_mib)
        cc = self._opt(None, "nvmlDeviceGetCudaComputeCapability", h)
        pci = self._opt(None, "nvmlDeviceGetPciInfo", h)
        bus = normalize_bus_id(pci.busId) if pci is not None else ""
        mig_mode = self._opt(None, "nvmlDeviceGetMigMode", h)
        mig_enabled = bool(mig_mode) and mig_mode[0] == nv.NVML_DEVICE_MIG_ENABLE
        layout = tuple(MigInstance(uuid=m.uuid, profile=m.profile, start=m.start, size=m.size)
                       for m in self._migs(uuid, h, model)) if mig_enabled else ()
        known = MODELS.get(model)
        remotes, active = set(), False
        for link in range(getattr(nv, "NVML_NVLINK_MAX_LINKS", 0)):
            try:
                if not nv.nvmlDeviceGetNvLinkState(h, link):
                    continue
            except (nv.NVMLError_NotSupported, nv.NVMLError_InvalidArgument):
                break  # no NVLink, or past the card's last link
            active = True
            remote = self._opt(None, "nvmlDeviceGetNvLinkRemotePciInfo", h, link)
            if remote is not None:
                remotes.add(normalize_bus_id(remote.busId))
        if bus:
            links[bus] = (remotes, active)
        return dict(
            uuid=uuid, index=index, model=model, memory_mib=max(memory_mib, 1),
            compute_capability=f"{cc[0]}.{cc[1]}" if cc else (known.compute_capability if known else "8.0"),
            pci_bus=bus, numa_node=self._numa(h, bus), mig_capable=mig_mode is not None, mig_enabled=mig_enabled,
            mig_profiles=tuple(p.name for p in known.mig_profiles) if known and mig_mode is not None else (),
            mig_layout=layout, driver_version=driver, cuda_version=cuda,
            firmware_version=_text(self._opt("", "nvmlDeviceGetVbiosVersion", h)))

    def _numa(self, h, bus: str) -> int:
        node = self._opt(None, "nvmlDeviceGetNumaNodeId", h) if hasattr(self.nv, "nvmlDeviceGetNumaNodeId") else None
        if node is None and bus:
            try:  # drivers before 535 lack the NVML call; the kernel knows
                node = int(open(f"/sys/bus/pci/devices/{bus}/numa_node").read())
            except (OSError, ValueError):
                node = None
        return node if isinstance(node, int) and node >= 0 else 0

    # ---------------------------------------------------------------- telemetry

    def _register_events(self, uuid: str, h) -> None:
        if self._events is None or uuid in self._registered:
            return
        try:
            self.nv.nvmlDeviceRegisterEvents(h, self.nv.nvmlEventTypeXidCriticalError, self._events)
        except self.nv.NVMLError as exc:
            log.info("card %s: XID events unavailable: %s", uuid, exc)
        self._registered.add(uuid)  # one attempt per card: a refusal does not change between ticks

    def _drain_xids(self) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {}
        if self._events is None:
            return out
        for _ in range(_EVENT_DRAIN_MAX):
            try:
                data = self.nv.nvmlEventSetWait(self._events, 0)
            except self.nv.NVMLError_Timeout:
                break
            except self.nv.NVMLError as exc:
                log.warning("XID event wait failed: %s", exc)
                break
            if not data.eventType & self.nv.nvmlEventTypeXidCriticalError:
                continue
            try:
                uuid = _text(self.nv.nvmlDeviceGetUUID(data.device))
            except self.nv.NVMLError:
                uuid = "unknown"  # a card that fell off the bus; its own read below reports it
            out.setdefault(uuid, []).append(int(data.eventData))
        return out

    def telemetry(self, node: str, job_of_pid: JobOfPid | None = None) -> tuple[GpuTelemetry, list[GpuHealth]]:
        """One sample per card and per MIG instance, and GpuHealth events for faults first seen now."""
        jobs = _job_lookup(job_of_pid)
        samples: list[GpuSample] = []
        health: list[GpuHealth] = []
        try:
            handles = self._handles()
        except Exception as exc:  # noqa: BLE001 - telemetry never raises; an empty batch still beats
            log.error("NVML cannot enumerate cards: %s", exc)
            handles = []
        reads: list[_CardRead] = []
        for index, h in handles:
            uuid = self._uuid_by_index.get(index, f"GPU-index-{index}")
            try:
                uuid = _text(self.nv.nvmlDeviceGetUUID(h))
                self._uuid_by_index[index] = uuid
                self._register_events(uuid, h)
                reads.append(self._read_card(uuid, h, jobs))
            except Exception as exc:  # noqa: BLE001 - any failure is this card's, never the node's
                name = type(exc).__name__
                reads.append(_CardRead(uuid, faults=[f"NVML error on card {index}: {name}: {exc}"]))
        try:
            xids = self._drain_xids()
        except Exception as exc:  # noqa: BLE001
            log.warning("XID drain failed: %s", exc)
            xids = {}
        for r in reads:
            card_xids = tuple(xids.pop(r.uuid, ()))
            if r.samples and card_xids:
                r.samples[0] = r.samples[0].model_copy(update={"xid_errors": card_xids})
            fatal = sorted(set(card_xids) & FATAL_XIDS)
            if fatal:
                r.faults.append(f"XID {fatal[0]}")
            samples.extend(r.samples)
            health.extend(self._report(node, r.uuid, r.faults))
        for uuid in xids:
            log.warning("XIDs %s for card %s which was not read this tick", xids[uuid], uuid)
        per_pid: dict[int, dict[str, int]] = {}
        for r in reads:
            for pid, mib in (r.pid_mib or {}).items():
                per_pid.setdefault(pid, {})[r.uuid] = mib
        self.last_usage = GpuMemoryUsage(by_job=usage_by_job(per_pid, jobs),
                                         cards=frozenset(r.uuid for r in reads if r.pid_mib is not None))
        return GpuTelemetry(node=node, samples=tuple(samples)), health

    def _report(self, node: str, uuid: str, faults: list[str]) -> list[GpuHealth]:
        if not faults:
            self._reported.pop(uuid, None)  # a recurrence after recovery is a new event
            return []
        reason = "; ".join(faults)
        if self._reported.get(uuid) == reason:
            return []
        self._reported[uuid] = reason
        return [GpuHealth(node=node, gpu_uuid=uuid, healthy=False, reason=reason)]

    def _read_card(self, uuid: str, h, jobs: Callable[[int], str | None]) -> _CardRead:
        nv = self.nv
        read = _CardRead(uuid)
        mem = nv.nvmlDeviceGetMemoryInfo(h)
        util = self._opt(None, "nvmlDeviceGetUtilizationRates", h)
        temp = self._opt(0, "nvmlDeviceGetTemperature", h, nv.NVML_TEMPERATURE_GPU)
        power = self._opt(0, "nvmlDeviceGetPowerUsage", h)
        ecc_c = self._opt(0, "nvmlDeviceGetTotalEccErrors", h, nv.NVML_MEMORY_ERROR_TYPE_CORRECTED,
                          nv.NVML_VOLATILE_ECC)
        ecc_u = self._opt(0, "nvmlDeviceGetTotalEccErrors", h, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                          nv.NVML_VOLATILE_ECC)
        if ecc_u:
            read.faults.append(f"uncorrectable ECC errors: {ecc_u}")
        retired = sum(len(self._opt([], "nvmlDeviceGetRetiredPages", h, cause)) for cause in (
            nv.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS,
            nv.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR))
        if retired >= RETIRED_PAGES_LIMIT:
            read.faults.append(f"retired pages: {retired}")
        remap = self._opt(None, "nvmlDeviceGetRemappedRows", h)
        if remap is not None and remap[3]:
            read.faults.append(f"row remapping failed (corrected {remap[0]}, uncorrected {remap[1]})")
        procs, read.pid_mib = self._processes(h)
        mig_mode = self._opt(None, "nvmlDeviceGetMigMode", h)
        migs = self._migs(uuid, h, "") if mig_mode and mig_mode[0] == nv.NVML_DEVICE_MIG_ENABLE else []
        card_jobs = _jobs_of(procs, jobs)
        common = dict(gpu_uuid=uuid, temperature_c=int(temp), power_mw=max(0, int(power)),
                      ecc_corrected=max(0, int(ecc_c)), ecc_uncorrected=max(0, int(ecc_u)))
        read.samples.append(GpuSample(
            **common, util_pct=_pct(util.gpu if util is not None else 0), mem_used_mib=int(mem.used // MIB),
            mem_total_mib=int(mem.total // MIB), job_ids=card_jobs))
        for m in migs:
            mmem = nv.nvmlDeviceGetMemoryInfo(m.handle)
            mutil = self._opt(None, "nvmlDeviceGetUtilizationRates", m.handle)
            # The parent's process list names each process's instance; the MIG handle's own list often needs root.
            own = [p for p in procs if (getattr(p, "gpuInstanceId", NO_INSTANCE), getattr(p, "computeInstanceId",
                                                                                           NO_INSTANCE))
                   == (m.gi_id, m.ci_id)] or self._opt([], "nvmlDeviceGetComputeRunningProcesses", m.handle)
            read.samples.append(GpuSample(
                **common, mig_uuid=m.uuid, util_pct=_pct(mutil.gpu if mutil is not None else 0),
                mem_used_mib=int(mmem.used // MIB), mem_total_mib=int(mmem.total // MIB),
                job_ids=_jobs_of(own, jobs)))
        return read

    def _processes(self, h) -> tuple[list, dict[int, int] | None]:
        """The card's processes (compute, graphics and MPS clients; one record per pid) and the GPU memory of each in
        MiB -- None when the compute list could not be read or a count was not available (a round that tells
        nothing, rather than one that says zero)."""
        complete = True
        try:
            procs = list(self.nv.nvmlDeviceGetComputeRunningProcesses(h) or ())
        except self._skip_fields:
            procs, complete = [], False
        for fn in ("nvmlDeviceGetGraphicsRunningProcesses", "nvmlDeviceGetMPSComputeRunningProcesses"):
            procs += self._opt([], fn, h) or []  # NotSupported (no graphics, no MPS) is an empty list
        by_pid: dict[int, object] = {}
        mib: dict[int, int] = {}
        for p in procs:
            pid = int(p.pid)
            by_pid.setdefault(pid, p)
            used = getattr(p, "usedGpuMemory", None)
            if used is None:
                complete = False  # NVML_VALUE_NOT_AVAILABLE: pynvml gives None
                continue
            # A process on two lists is one process: its count, not twice its count.
            mib[pid] = max(mib.get(pid, 0), int(used) // MIB)
        return list(by_pid.values()), (mib if complete else None)

    # ---------------------------------------------------------------- MIG reconfiguration

    def reconfigure_mig(self, gpu_uuid: str, layout: tuple[MigInstance, ...]) -> None:
        """Make the card's instances `layout`: an instance the layout keeps (same profile at the same placement) is
        left alone, with whatever runs on it; the others are destroyed (their compute instances first) and the
        missing ones created (GPU instance with placement + one full compute instance each). Needs root and MIG
        mode already on; the caller makes sure nothing runs on an instance that goes. NVML errors propagate."""
        nv = self.nv
        h = nv.nvmlDeviceGetHandleByUUID(gpu_uuid)
        mode = nv.nvmlDeviceGetMigMode(h)
        if mode[0] != nv.NVML_DEVICE_MIG_ENABLE:
            raise CardFault(f"{gpu_uuid}: MIG mode is off (turning it on needs a GPU reset, left to the operator)")
        model = model_name(_text(nv.nvmlDeviceGetName(h)), int(nv.nvmlDeviceGetMemoryInfo(h).total // MIB))
        wanted = {(i.profile, i.start, i.size) for i in layout}
        for inst in layout:
            if inst.start + inst.size > MIG_MEMORY_SLICES:
                raise CardFault(f"{gpu_uuid}: placement {inst.start}+{inst.size} is off the card")
        gis: dict[int, list[int]] = {}
        kept: set[tuple[str, int, int]] = set()
        for m in self._migs(gpu_uuid, h, model):
            if (m.profile, m.start, m.size) in wanted:
                kept.add((m.profile, m.start, m.size))
            else:
                gis.setdefault(m.gi_id, []).append(m.ci_id)
        for gi_id, cis in gis.items():
            gi = nv.nvmlDeviceGetGpuInstanceById(h, gi_id)
            for ci_id in cis:
                nv.nvmlComputeInstanceDestroy(nv.nvmlGpuInstanceGetComputeInstanceById(gi, ci_id))
            nv.nvmlGpuInstanceDestroy(gi)
        by_name = {_mig_profile_name(name, model, slices, 0): (pid, slices)
                   for pid, (name, slices) in self._gi_profiles(gpu_uuid, h).items() if "+" not in name}
        for inst in sorted(layout, key=lambda i: i.start):
            if (inst.profile, inst.start, inst.size) in kept:
                continue
            if inst.profile not in by_name:
                raise CardFault(f"{gpu_uuid}: no MIG profile {inst.profile} on {model}")
            pid, slices = by_name[inst.profile]
            placement = nv.c_nvmlGpuInstancePlacement_t(inst.start, inst.size)
            gi = nv.nvmlDeviceCreateGpuInstanceWithPlacement(h, pid, ctypes.byref(placement))
            ci_profile = nv.nvmlGpuInstanceGetComputeInstanceProfileInfo(
                gi, _CI_PROFILE_BY_SLICES[slices], nv.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED)
            nv.nvmlGpuInstanceCreateComputeInstance(gi, ci_profile.id)


# compute slices of a GPU instance -> the NVML compute-instance profile that spans all of it
_CI_PROFILE_BY_SLICES = {1: 0x0, 2: 0x1, 3: 0x2, 4: 0x3, 7: 0x4, 8: 0x5, 6: 0x6}


def _pct(v) -> int:
    return max(0, min(100, int(v)))


def _job_lookup(job_of_pid: JobOfPid | None) -> Callable[[int], str | None]:
    if job_of_pid is None:
        return lambda pid: None
    if callable(job_of_pid):
        return job_of_pid
    return job_of_pid.get


def _jobs_of(procs, jobs: Callable[[int], str | None]) -> tuple[str, ...]:
    out = set()
    for p in procs or ():
        try:
            job = jobs(int(p.pid))
        except Exception:  # noqa: BLE001 - a racing process exit must not drop the sample
            job = None
        if job:
            out.add(job)
    return tuple(sorted(out))


def _nvlink_topology(node: str, links: dict[str, tuple[set[str], bool]]
                     ) -> tuple[dict[str, set[str]], dict[str, str]]:
    """Peers and domains by bus id. A link whose far end is not one of this node's cards goes to an NVSwitch, and
    every card on the switch fabric reaches every other; direct links connect only their two ends."""
    cards = set(links)
    switched = {b for b, (remotes, active) in links.items() if active and remotes - cards}
    peers: dict[str, set[str]] = {b: {r for r in remotes if r in cards and r != b}
                                  for b, (remotes, _) in links.items()}
    for b in switched:
        peers[b] |= switched - {b}
    for b in list(peers):  # a link seen from one end only still joins both
        for r in peers[b]:
            peers.setdefault(r, set()).add(b)
    domains: dict[str, str] = {}
    components = 0
    for b in sorted(peers):
        if b in domains or not peers[b]:
            continue
        components += 1
        stack = [b]
        while stack:
            cur = stack.pop()
            if cur in domains:
                continue
            domains[cur] = str(components)
            stack.extend(peers[cur] - set(domains))
    name = {k: f"{node}-nvl" if components == 1 else f"{node}-nvl{v}" for k, v in domains.items()}
    return peers, name


def _host_memory_mib() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // MIB
    except (ValueError, OSError, AttributeError):
        return 0
