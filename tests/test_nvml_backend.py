"""The NVML backend against a fake pynvml fleet, and the real-node command executor against real subprocesses."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from types import SimpleNamespace

import pytest

from agents.node.nvml_agent import Executor, JobProc, job_argv, visible_devices
from agents.node.runner import NodeContext
from agents.node.nvml_backend import NvmlBackend, model_name
from schemas.envelope import envelope
from schemas.events import (
    Assignment, JobCheckpointed, JobCompleted, JobFailed, JobStarted, JobStopped, MigInstance, MigrateJob,
    MigReconfigure, PlaceJob, PreemptJob, ReleaseJob,
)
from tests.fake_pynvml import (
    NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR, FakeCard, FakeMig,
    FakeNvml, FakeProcess, NVMLError_FunctionNotFound, NVMLError_GpuIsLost, NVMLError_NoPermission,
    NVMLError_NotSupported, NVMLError_Unknown, mig_a100, two_card_node,
)


def backend(cards) -> tuple[FakeNvml, NvmlBackend]:
    nv = FakeNvml(cards)
    return nv, NvmlBackend(nv, cpu_milli=32000, memory_mib=128 * 1024).open()


# ---------------------------------------------------------------- inventory

def test_inventory_of_a_two_card_nvlink_node():
    _, b = backend(two_card_node())
    inv = b.inventory("n1", rack="r7", datacenter="dc-2")
    assert (inv.node, inv.rack, inv.datacenter, inv.cpu_milli, inv.memory_mib) == ("n1", "r7", "dc-2", 32000, 131072)
    a, c = inv.gpus
    assert (a.uuid, a.index, a.model, a.memory_mib, a.compute_capability) == ("GPU-aaaa", 0, "H100-80GB", 81920, "9.0")
    assert (a.pci_bus, a.numa_node, c.pci_bus, c.numa_node) == ("0000:17:00.0", 0, "0000:2a:00.0", 1)
    assert a.nvlink_peers == ("GPU-bbbb",) and c.nvlink_peers == ("GPU-aaaa",)
    assert a.nvlink_domain == c.nvlink_domain == "n1-nvl"
    assert (a.driver_version, a.cuda_version, a.firmware_version) == ("550.54.15", "12.4", "92.00.45.00.03")
    assert not a.mig_capable and not a.mig_enabled and a.mig_layout == ()


def test_inventory_of_a_mig_enabled_a100():
    _, b = backend([mig_a100()])
    (card,) = b.inventory("n1").gpus
    assert card.model == "A100-80GB" and card.mig_capable and card.mig_enabled
    assert "3g.40gb" in card.mig_profiles and "1g.10gb" in card.mig_profiles
    assert card.mig_layout == (MigInstance(uuid="MIG-1111", profile="3g.40gb", start=0, size=4),
                               MigInstance(uuid="MIG-2222", profile="2g.20gb", start=4, size=2),
                               MigInstance(uuid="MIG-3333", profile="1g.10gb", start=6, size=1))
    assert card.nvlink_domain is None and card.nvlink_peers == ()


def test_mig_variant_profiles_map_to_the_scheduler_geometry():
    card = mig_a100()
    card.migs = [FakeMig("MIG-me", 3, 20, 0, 1, 9728)]  # 1g.10gb+me
    _, b = backend([card])
    assert b.inventory("n1").gpus[0].mig_layout[0].profile == "1g.10gb"


def test_mig_capable_card_with_mig_off_has_no_layout():
    card = mig_a100()
    card.mig_mode = 0
    _, b = backend([card])
    (g,) = b.inventory("n1").gpus
    assert g.mig_capable and not g.mig_enabled and g.mig_layout == ()


@pytest.mark.parametrize("name,mib,want", [
    ("NVIDIA A100-SXM4-80GB", 81920, "A100-80GB"), ("NVIDIA A100-PCIE-40GB", 40960, "A100-40GB"),
    ("NVIDIA A100 80GB PCIe", 81920, "A100-80GB"), ("NVIDIA H100 80GB HBM3", 81559, "H100-80GB"),
    ("NVIDIA H100 NVL", 95830, "NVIDIA H100 NVL"), ("NVIDIA H200", 143771, "H200"), ("Tesla T4", 15360, "T4"),
    ("Tesla V100-SXM2-32GB", 32768, "V100M32"), ("NVIDIA A10", 24576, "A10"), ("NVIDIA A10G", 24576, "NVIDIA A10G"),
    ("NVIDIA L4", 23034, "L4"), ("NVIDIA GeForce RTX 4090", 24564, "NVIDIA GeForce RTX 4090"),
])
def test_model_names(name, mib, want):
    assert model_name(name, mib) == want


def test_nvswitch_fabric_makes_every_card_a_peer():
    switch = "00000000:c1:00.0"  # not a card of this node
    cards = [FakeCard(f"GPU-{i}", name="NVIDIA H100 80GB HBM3", bus=f"00000000:{0x10 + i:02x}:00.0",
                      nvlinks=[switch, switch]) for i in range(3)]
    _, b = backend(cards)
    gpus = b.inventory("n1").gpus
    assert [g.nvlink_peers for g in gpus] == [("GPU-1", "GPU-2"), ("GPU-0", "GPU-2"), ("GPU-0", "GPU-1")]
    assert {g.nvlink_domain for g in gpus} == {"n1-nvl"}


def test_inventory_leaves_out_a_lost_card():
    cards = two_card_node()
    cards[1].errors["nvmlDeviceGetMemoryInfo"] = NVMLError_GpuIsLost
    _, b = backend(cards)
    assert [g.uuid for g in b.inventory("n1").gpus] == ["GPU-aaaa"]


# ---------------------------------------------------------------- telemetry

def test_telemetry_values_per_card_and_mig_instance():
    cards = two_card_node() + [mig_a100()]
    cards[0].processes = [FakeProcess(100), FakeProcess(101), FakeProcess(999)]
    _, b = backend(cards)
    tel, health = b.telemetry("n1", {100: "job-a", 101: "job-a", 4242: "job-m"})
    assert health == [] and tel.node == "n1"
    s = {(x.gpu_uuid, x.mig_uuid): x for x in tel.samples}
    assert len(s) == 6
    a = s[("GPU-aaaa", None)]
    assert (a.util_pct, a.mem_used_mib, a.mem_total_mib, a.temperature_c, a.power_mw, a.ecc_corrected,
            a.ecc_uncorrected, a.xid_errors, a.job_ids) == (70, 2048, 81920, 61, 350_000, 3, 0, (), ("job-a",))
    assert s[("GPU-bbbb", None)].job_ids == ()
    m1 = s[("GPU-mig0", "MIG-1111")]
    assert (m1.mem_used_mib, m1.mem_total_mib, m1.util_pct, m1.job_ids) == (5000, 40192, 0, ("job-m",))
    assert s[("GPU-mig0", "MIG-2222")].job_ids == () and s[("GPU-mig0", "MIG-3333")].mem_total_mib == 9728
    assert s[("GPU-mig0", None)].job_ids == ("job-m",)


def test_job_of_pid_may_be_a_callable():
    _, b = backend([mig_a100()])
    tel, _ = b.telemetry("n1", lambda pid: "job-x" if pid == 4242 else None)
    assert {x.mig_uuid: x.job_ids for x in tel.samples}["MIG-1111"] == ("job-x",)


def test_xid_79_is_a_health_event_once():
    nv, b = backend(two_card_node())
    b.telemetry("n1")  # registers the cards for XID events
    nv.inject_xid("GPU-bbbb", 79)
    nv.inject_xid("GPU-aaaa", 13)  # an application fault: reported in the sample, not a card fault
    tel, health = b.telemetry("n1")
    assert {x.gpu_uuid: x.xid_errors for x in tel.samples} == {"GPU-aaaa": (13,), "GPU-bbbb": (79,)}
    assert [(h.gpu_uuid, h.healthy) for h in health] == [("GPU-bbbb", False)]
    assert "79" in health[0].reason
    tel, health = b.telemetry("n1")
    assert health == [] and all(x.xid_errors == () for x in tel.samples)
    nv.inject_xid("GPU-bbbb", 79)  # a recurrence is news again
    assert [h.gpu_uuid for h in b.telemetry("n1")[1]] == ["GPU-bbbb"]


def test_uncorrectable_ecc_is_unhealthy_and_reported_once():
    cards = two_card_node()
    cards[0].ecc_uncorrected = 2
    _, b = backend(cards)
    tel, health = b.telemetry("n1")
    assert [(h.gpu_uuid, h.healthy, h.reason) for h in health] == [("GPU-aaaa", False, "uncorrectable ECC errors: 2")]
    assert {x.gpu_uuid: x.ecc_uncorrected for x in tel.samples} == {"GPU-aaaa": 2, "GPU-bbbb": 0}
    assert b.telemetry("n1")[1] == []


def test_row_remap_failure_and_full_retirement_table_are_unhealthy():
    cards = two_card_node()
    cards[0].remapped_rows = (10, 2, 0, 1)
    cards[1].retired_pages = {NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR: list(range(64))}
    _, b = backend(cards)
    reasons = {h.gpu_uuid: h.reason for h in b.telemetry("n1")[1]}
    assert "row remapping failed" in reasons["GPU-aaaa"] and "retired pages: 64" in reasons["GPU-bbbb"]


def test_gpu_lost_on_one_card_reports_it_and_keeps_the_other():
    cards = two_card_node()
    _, b = backend(cards)
    cards[0].errors["*"] = NVMLError_GpuIsLost
    tel, health = b.telemetry("n1")
    assert [x.gpu_uuid for x in tel.samples] == ["GPU-bbbb"]
    assert [(h.gpu_uuid, h.healthy) for h in health] == [("GPU-aaaa", False)]
    assert "GpuIsLost" in health[0].reason


def test_lost_card_uses_the_uuid_it_had_in_the_inventory():
    cards = two_card_node()
    _, b = backend(cards)
    b.inventory("n1")
    cards[1].errors["*"] = NVMLError_GpuIsLost  # now even its UUID cannot be read
    tel, health = b.telemetry("n1")
    assert [h.gpu_uuid for h in health] == ["GPU-bbbb"] and [x.gpu_uuid for x in tel.samples] == ["GPU-aaaa"]
    assert b.telemetry("n1")[1] == []  # still lost: not news


@pytest.mark.parametrize("fn", ["nvmlDeviceGetTemperature", "nvmlDeviceGetMemoryInfo", "nvmlDeviceGetPowerUsage"])
def test_unknown_error_on_any_read_makes_the_card_unhealthy(fn):
    cards = two_card_node()
    cards[1].errors[fn] = NVMLError_Unknown
    _, b = backend(cards)
    tel, health = b.telemetry("n1")
    assert [x.gpu_uuid for x in tel.samples] == ["GPU-aaaa"]
    assert [h.gpu_uuid for h in health] == ["GPU-bbbb"] and "Unknown" in health[0].reason


def test_not_supported_fields_keep_their_defaults():
    cards = two_card_node()
    for fn in ("nvmlDeviceGetTemperature", "nvmlDeviceGetPowerUsage", "nvmlDeviceGetTotalEccErrors",
               "nvmlDeviceGetUtilizationRates", "nvmlDeviceGetRemappedRows", "nvmlDeviceGetRetiredPages",
               "nvmlDeviceGetVbiosVersion", "nvmlDeviceGetNumaNodeId", "nvmlDeviceGetCudaComputeCapability",
               "nvmlDeviceGetNvLinkState"):
        cards[0].errors[fn] = NVMLError_NotSupported
    cards[0].errors["nvmlDeviceGetComputeRunningProcesses"] = NVMLError_NoPermission  # unprivileged agent
    cards[0].errors["nvmlDeviceGetMigMode"] = NVMLError_FunctionNotFound  # older driver
    cards[0].bus = "00000000:ff:00.0"  # no sysfs NUMA entry either
    _, b = backend(cards)
    tel, health = b.telemetry("n1", {1: "j"})
    assert health == []
    a = tel.samples[0]
    assert (a.gpu_uuid, a.util_pct, a.temperature_c, a.power_mw, a.ecc_corrected, a.ecc_uncorrected, a.job_ids) == \
        ("GPU-aaaa", 0, 0, 0, 0, 0, ())
    assert a.mem_total_mib == 81920
    g = b.inventory("n1").gpus[0]
    assert (g.firmware_version, g.numa_node, g.compute_capability, g.mig_capable, g.nvlink_peers) == \
        ("", 0, "9.0", False, ())  # capability from the model table


def test_telemetry_never_raises():
    cards = two_card_node()
    cards[0].errors["nvmlDeviceGetPowerUsage"] = RuntimeError("driver hiccup")
    nv, b = backend(cards)
    tel, health = b.telemetry("n1", lambda pid: 1 / 0)
    assert [h.gpu_uuid for h in health] == ["GPU-aaaa"] and [x.gpu_uuid for x in tel.samples] == ["GPU-bbbb"]
    nv.initialized = False  # every call now fails, enumeration included
    tel, health = b.telemetry("n1")
    assert tel.samples == ()


def test_reconfigure_mig_replaces_the_layout():
    nv, b = backend([mig_a100()])
    layout = (MigInstance(uuid="x", profile="4g.40gb", start=0, size=4),
              MigInstance(uuid="y", profile="3g.40gb", start=4, size=4))
    b.reconfigure_mig("GPU-mig0", layout)
    assert sorted(nv.destroyed) == [("GPU-mig0", 1), ("GPU-mig0", 5), ("GPU-mig0", 13)]
    assert nv.created == [("GPU-mig0", 5, 0, 4), ("GPU-mig0", 9, 4, 4)]
    assert [(i.profile, i.start, i.size) for i in b.inventory("n1").gpus[0].mig_layout] == \
        [("4g.40gb", 0, 4), ("3g.40gb", 4, 4)]


def test_reconfigure_mig_leaves_kept_instances_alone():
    """A carve next to running work: the 3g (busy) and 2g instances stay, only the 1g at slice 6 is replaced."""
    nv, b = backend([mig_a100()])
    layout = (MigInstance(uuid="MIG-1111", profile="3g.40gb", start=0, size=4),
              MigInstance(uuid="MIG-2222", profile="2g.20gb", start=4, size=2),
              MigInstance(uuid="new", profile="2g.20gb", start=6, size=2))
    b.reconfigure_mig("GPU-mig0", layout)
    assert nv.destroyed == [("GPU-mig0", 13)]
    assert nv.created == [("GPU-mig0", 14, 6, 2)]
    assert [(i.profile, i.start, i.size) for i in b.inventory("n1").gpus[0].mig_layout] == \
        [("3g.40gb", 0, 4), ("2g.20gb", 4, 2), ("2g.20gb", 6, 2)]


# ---------------------------------------------------------------- the executor

class Recorder:
    def __init__(self):
        self.events: list[tuple[object, str, str | None]] = []

    async def __call__(self, payload, source, cause=None):
        self.events.append((payload, source, cause))

    def kinds(self, job_id: str | None = None) -> list[str]:
        return [p.kind for p, _, _ in self.events if job_id is None or getattr(p, "job_id", None) == job_id]


_SEQ = iter(range(1, 1_000_000))


def cmd(payload, seq: int | None = None):
    return envelope(payload, source="scheduler", seq=seq if seq is not None else next(_SEQ), time_ms=0)


def place(job: str, command_id: str, assignments=None, node: str = "n1", duration_s=None, resume_from="",
          attempt: int = 0):
    return PlaceJob(command_id=command_id, job_id=job, tenant="t", node=node, duration_s=duration_s,
                    resume_from=resume_from, attempt=attempt,
                    assignments=assignments or (Assignment(gpu_uuid="GPU-aaaa", milli=1000, memory_mib=1024),))


def executor(node: str, publish, **kw) -> Executor:
    """An Executor whose stand-in runs go as the agent's own user (the tests' markers live in pytest's private temporary
    directories; tests/test_runner.py runs programs as the unprivileged job user)."""
    import tempfile
    from pathlib import Path

    root = Path(kw.pop("log_dir", None) or tempfile.mkdtemp(prefix="gpupool-exec-"))
    kw.setdefault("ctx", NodeContext(node=node, jobs_root=root, checkpoint_root=root / "checkpoints", user=None,
                                     podman=None))
    return Executor(node, publish, **kw)


def py(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 15))


def test_cuda_visible_devices_carry_the_card_and_mig_uuids(tmp_path):
    async def go():
        rec = Recorder()
        ex = executor("n1", rec, log_dir=tmp_path,
                      argv_for=lambda p: py("import os; print(os.environ['CUDA_VISIBLE_DEVICES'])"))
        two = (Assignment(gpu_uuid="GPU-aaaa", milli=1000, memory_mib=1), Assignment(gpu_uuid="GPU-bbbb", milli=1000,
                                                                                      memory_mib=1))
        mig = (Assignment(gpu_uuid="GPU-mig0", milli=428, memory_mib=1, mig_profile="3g.40gb", mig_uuid="MIG-1111"),)
        await ex.execute(cmd(place("j2", "c1", two)))
        await ex.execute(cmd(place("jm", "c2", mig)))
        await ex.drain()
        return rec

    rec = run(go())
    assert (tmp_path / "n1" / "j2" / "attempt-0.log").read_text().strip() == "GPU-aaaa,GPU-bbbb"
    assert (tmp_path / "n1" / "jm" / "attempt-0.log").read_text().strip() == "MIG-1111"
    assert rec.kinds("j2") == ["job.started", "job.completed"] and rec.kinds("jm") == ["job.started", "job.completed"]
    started = [p for p, _, _ in rec.events if isinstance(p, JobStarted)]
    assert {(p.node, p.command_id) for p in started} == {("n1", "c1"), ("n1", "c2")}
    assert {s for p, s, _ in rec.events if p.job_id == "j2"} == {"n1/job/j2"}
    assert all(c == p.command_id for p, _, c in rec.events)


def test_duplicate_place_command_runs_once(tmp_path):
    marker = tmp_path / "runs"

    async def go():
        rec = Recorder()
        ex = executor("n1", rec, argv_for=lambda p: py(f"open({str(marker)!r}, 'a').write('x')"))
        env = cmd(place("j", "c1"))
        for _ in range(3):
            await ex.execute(env)
        await ex.execute(cmd(place("j", "c1")))  # the same command id under a new envelope
        await ex.drain()
        await ex.execute(env)  # redelivered after the job ended (a consumer restart before its commit)
        await ex.drain()
        return rec

    rec = run(go())
    assert marker.read_text() == "x"
    assert rec.kinds() == ["job.started", "job.completed"]


def test_exit_code_decides_completed_or_failed():
    async def go():
        rec = Recorder()
        ex = executor("n1", rec, argv_for=lambda p: py("raise SystemExit(3)") if p.job_id == "bad" else py("pass"))
        await ex.execute(cmd(place("bad", "c1")))
        await ex.execute(cmd(place("good", "c2")))
        await ex.drain()
        return rec

    rec = run(go())
    failed = [p for p, _, _ in rec.events if isinstance(p, JobFailed)]
    assert [(p.job_id, p.reason, p.command_id) for p in failed] == [("bad", "exit code 3", "c1")]
    assert (failed[0].code, failed[0].exit_code, failed[0].signal) == ("ExitCode", 3, None)
    assert [p.job_id for p, _, _ in rec.events if isinstance(p, JobCompleted)] == ["good"]


def test_preempt_sends_sigterm_then_reports_checkpoint_and_stop():
    async def go():
        rec = Recorder()
        now = [1_000]
        ex = executor("n1", rec, argv_for=lambda p: ["sleep", "30"], clock=lambda: now[0])
        await ex.execute(cmd(place("j", "c1", resume_from="ckpt:j:500")))
        now[0] = 3_000
        await ex.execute(cmd(PreemptJob(command_id="c2", job_id="j", node="n1", grace_s=10)))
        await ex.drain()
        return rec

    rec = run(go())
    # sleep dies on SIGTERM: no grace wait, no SIGKILL -- shown by the checkpoint, which is reported only when the
    # job went on SIGTERM (terminate() True; a job killed after its grace reports none), not by a wall-clock bound
    assert rec.kinds() == ["job.started", "job.checkpointed", "job.stopped"]
    ck, stop = rec.events[1][0], rec.events[2][0]
    assert isinstance(ck, JobCheckpointed) and isinstance(stop, JobStopped)
    assert (ck.progress_ms, ck.checkpoint, ck.command_id) == (2_500, "ckpt:j:2500", "c2")
    assert (stop.progress_ms, stop.checkpoint, stop.command_id) == (2_500, "ckpt:j:2500", "c2")


def test_preempt_kills_a_job_that_ignores_sigterm(tmp_path):
    ready = tmp_path / "ready"
    code = (f"import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); open({str(ready)!r}, 'w').close();"
            " time.sleep(30)")

    async def go():
        rec = Recorder()
        ex = executor("n1", rec, argv_for=lambda p: py(code))
        await ex.execute(cmd(place("j", "c1", resume_from="ckpt:j:700")))
        while not ready.exists():
            await asyncio.sleep(0.02)
        await ex.execute(cmd(PreemptJob(command_id="c2", job_id="j", node="n1", grace_s=1)))
        await ex.drain()
        return rec, ex

    rec, ex = run(go())
    assert rec.kinds() == ["job.started", "job.stopped"]  # no checkpoint was written
    stop = rec.events[1][0]
    assert (stop.progress_ms, stop.checkpoint) == (700, "ckpt:j:700") and ex.running == {}


def test_preempt_before_place_stops_and_the_late_place_does_not_run(tmp_path):
    marker = tmp_path / "ran"

    async def go():
        rec = Recorder()
        ex = executor("n1", rec, argv_for=lambda p: py(f"open({str(marker)!r}, 'a').write('{p.command_id}')"))
        await ex.execute(cmd(PreemptJob(command_id="c2", job_id="j", node="n1"), seq=20))
        await ex.drain()
        await ex.execute(cmd(place("j", "c1"), seq=19))  # overtaken by the preemption
        await ex.drain()
        await ex.execute(cmd(place("j", "c3"), seq=21))  # the scheduler placing it again later
        await ex.drain()
        return rec

    rec = run(go())
    assert rec.kinds() == ["job.stopped", "job.started", "job.completed"]
    assert rec.events[0][0].command_id == "c2" and rec.events[1][0].command_id == "c3"
    assert marker.read_text() == "c3"


def test_release_stops_without_reports():
    async def go():
        rec = Recorder()
        ex = executor("n1", rec, argv_for=lambda p: ["sleep", "30"])
        await ex.execute(cmd(place("j", "c1")))
        await ex.execute(cmd(ReleaseJob(command_id="c2", job_id="j", node="n1")))
        await ex.drain()
        return rec, ex

    rec, ex = run(go())
    assert rec.kinds() == ["job.started"] and ex.running == {}


def test_attempts_fence_superseded_placements_and_stale_stops():
    async def go():
        rec = Recorder()
        ex = executor("n1", rec, argv_for=lambda p: ["sleep", "30"])
        await ex.execute(cmd(place("j", "c1", attempt=1)))
        await ex.execute(cmd(ReleaseJob(command_id="c2", job_id="j", node="n1", attempt=1)))  # sent when it was lost
        await ex.drain()
        await ex.execute(cmd(place("j", "c3", attempt=2)))  # the job given to this node again
        await ex.execute(cmd(place("j", "c4", attempt=1)))  # a late copy of the old placement: refused
        await ex.execute(cmd(PreemptJob(command_id="c5", job_id="j", node="n1", attempt=1)))  # stale: spares 2
        await ex.execute(cmd(ReleaseJob(command_id="c6", job_id="j", node="n1", attempt=1)))
        await asyncio.gather(*ex.tasks)  # the stops under way (not the job: it runs on)
        alive = ex.running["j"].command_id
        await ex.execute(cmd(ReleaseJob(command_id="c7", job_id="j", node="n1", attempt=2)))
        await ex.drain()
        return rec, ex, alive

    rec, ex, alive = run(go())
    assert alive == "c3" and ex.running == {}
    assert [p.command_id for p, _, _ in rec.events if isinstance(p, JobStarted)] == ["c1", "c3"]
    assert rec.kinds() == ["job.started", "job.started"]  # no JobStopped for the stale preemption


def test_shutdown_reports_stopped_with_the_placement_command():
    async def go():
        rec = Recorder()
        ex = executor("n1", rec, argv_for=lambda p: ["sleep", "30"])
        await ex.execute(cmd(place("j", "c1", attempt=4)))
        await ex.stop_all(grace_s=5)
        return rec

    rec = run(go())
    stopped = [p for p, _, _ in rec.events if isinstance(p, JobStopped)]
    assert [(p.command_id, p.reason) for p in stopped] == [("c1", "agent shutdown")]


def test_commands_for_other_nodes_are_ignored_and_missing_commands_fail():
    async def go():
        rec = Recorder()
        ex = executor("n1", rec, argv_for=lambda p: None)
        await ex.execute(cmd(place("other", "c1", node="n2")))
        await ex.execute(cmd(place("j", "c2")))
        return rec

    rec = run(go())
    assert rec.kinds() == ["job.failed"] and "GPUPOOL_JOB_COMMANDS" in rec.events[0][0].reason


def test_unstartable_command_fails_the_job():
    async def go():
        rec = Recorder()
        ex = executor("n1", rec, argv_for=lambda p: ["/nonexistent/trainer"])
        await ex.execute(cmd(place("j", "c1")))
        return rec

    rec = run(go())
    assert rec.kinds() == ["job.failed"] and "command not found" in rec.events[0][0].reason
    assert rec.events[0][0].code == "CommandNotFound"


def test_job_of_pid_maps_the_job_process_group():
    async def go():
        ex = executor("n1", Recorder(), argv_for=lambda p: ["sh", "-c", "sleep 30 & wait"])
        await ex.execute(cmd(place("j", "c1")))
        job = ex.running["j"]
        found = ex.job_of_pid(job.run.pid)
        await ex.execute(cmd(ReleaseJob(command_id="c2", job_id="j", node="n1")))
        await ex.drain()
        return found, ex.job_of_pid(1)

    assert run(go()) == ("j", None)


def test_mig_reconfigure_is_a_dry_run_unless_allowed():
    calls = []

    async def reconfigure(p):
        calls.append(p.gpu_uuid)

    async def go(allow: bool, command_id: str):
        ex = executor("n1", Recorder(), allow_mig_reconfigure=allow, reconfigure=reconfigure)
        await ex.execute(cmd(MigReconfigure(command_id=command_id, node="n1", gpu_uuid="GPU-mig0", layout=())))

    run(go(False, "c1"))
    assert calls == []
    run(go(True, "c2"))
    assert calls == ["GPU-mig0"]


def test_mig_reconfigure_refused_only_when_it_would_remove_a_running_jobs_instance():
    calls, republished = [], []

    async def reconfigure(p):
        calls.append(p.command_id)

    async def republish(cause):
        republished.append(cause)

    keep = (MigInstance(uuid="MIG-1111", profile="3g.40gb", start=0, size=4),
            MigInstance(uuid="new", profile="2g.20gb", start=4, size=2))
    drop = (MigInstance(uuid="new", profile="7g.80gb", start=0, size=8),)

    async def go(layout, command_id):
        ex = executor("n1", Recorder(), allow_mig_reconfigure=True, reconfigure=reconfigure, republish=republish)
        ex.running["j"] = JobProc("j", "c0", None, 0, 0, "", (
            Assignment(gpu_uuid="GPU-mig0", milli=428, memory_mib=40192, mig_uuid="MIG-1111"),))
        await ex.execute(cmd(MigReconfigure(command_id=command_id, node="n1", gpu_uuid="GPU-mig0", layout=layout)))

    run(go(keep, "c1"))
    assert calls == ["c1"] and republished == []
    run(go(drop, "c2"))
    assert calls == ["c1"] and republished == ["c2"]


def test_job_argv_from_the_environment_or_a_sleep(tmp_path):
    p = place("j1", "c1", duration_s=10, resume_from="ckpt:j1:4000")
    assert job_argv(p, {}) == ["sleep", "6"]
    assert job_argv(place("j1", "c1"), {}) is None
    mapping = {"j1": ["train.py", "--job", "{job_id}", "--resume", "{resume_from}"], "*": ["default", "{duration_s}"]}
    assert job_argv(p, {"GPUPOOL_JOB_COMMANDS": json.dumps(mapping)}) == \
        ["train.py", "--job", "j1", "--resume", "ckpt:j1:4000"]
    f = tmp_path / "jobs.json"
    f.write_text(json.dumps(mapping))
    assert job_argv(place("j9", "c1", duration_s=5), {"GPUPOOL_JOB_COMMANDS": str(f)}) == ["default", "5"]


def test_visible_devices_dedupes_in_order():
    a = (Assignment(gpu_uuid="G1", milli=500, memory_mib=1), Assignment(gpu_uuid="G0", milli=500, memory_mib=1),
         Assignment(gpu_uuid="G1", milli=500, memory_mib=1))
    assert visible_devices(a) == "G1,G0"


def test_fake_exposes_only_what_it_implements():
    # The backend must not lean on a pynvml function the fake silently lacks.
    with pytest.raises(AttributeError):
        FakeNvml([]).nvmlDeviceGetBrand  # noqa: B018


def test_job_of_pid_follows_ancestry_out_of_a_new_session(tmp_path):
    pidfile = tmp_path / "child"
    code = (f"import subprocess, sys, time; c = subprocess.Popen(['sleep', '30'], start_new_session=True);"
            f" open({str(pidfile)!r}, 'w').write(str(c.pid)); time.sleep(30)")

    async def go():
        ex = executor("n1", Recorder(), argv_for=lambda p: py(code))
        await ex.execute(cmd(place("j", "c1")))
        while not pidfile.exists() or not pidfile.read_text():
            await asyncio.sleep(0.02)
        child = int(pidfile.read_text())
        found = ex.job_of_pid(child)
        await ex.execute(cmd(ReleaseJob(command_id="c2", job_id="j", node="n1")))
        await ex.drain()
        os.kill(child, signal.SIGKILL)  # its own session: the release's signal did not reach it
        return found

    assert run(go()) == "j"


# ---------------------------------------------------------------- the agent's publishing, without a broker

class FakeProducer:
    def __init__(self):
        self.sent: list[tuple[str, bytes, bytes]] = []

    async def send(self, topic, key, value):
        self.sent.append((topic, key, value))

    async def flush(self):
        pass


def test_agent_publishes_inventory_on_change_telemetry_and_health_with_per_source_seqs(tmp_path):
    from agents.node.nvml_agent import NvmlAgent
    from infra.config import Config
    from schemas.envelope import decode

    cards = two_card_node()
    nv, b = backend(cards)
    cfg = Config(home=tmp_path, kafka="127.0.0.1:1", clickhouse="", kafka_port=1, web_port=1)
    args = SimpleNamespace(interval=0.01, group=None, allow_mig_reconfigure=False)

    async def go():
        agent = NvmlAgent(cfg, args, b, node="n1")
        agent.producer = FakeProducer()
        await agent.publish_inventory(force=True)
        await agent.publish_inventory()  # unchanged: nothing new
        cards[1].vbios = "96.00.99"
        await agent.publish_inventory()  # changed
        cards[0].ecc_uncorrected = 1

        async def stop_soon():  # once three telemetry records are out (waited on: no wall-clock window)
            while sum(decode(value).kind == "gpu.telemetry" for _, _, value in agent.producer.sent) < 3:
                await asyncio.sleep(0.01)
            agent.stopping.set()

        await asyncio.gather(agent.telemetry_loop(), stop_soon())
        return agent

    agent = run(go())
    envs = [(topic, key, decode(value)) for topic, key, value in agent.producer.sent]
    assert agent.group_id == "gpupool-agent-n1"
    kinds = [e.kind for _, _, e in envs]
    assert kinds[:2] == ["node.inventory", "node.inventory"] and kinds.count("gpu.telemetry") >= 3
    assert "gpu.health" not in kinds  # a node states faults in its telemetry; the worker derives the health fact
    faulty = [s for _, _, e in envs if e.kind == "gpu.telemetry" for s in e.payload.samples if s.fault]
    assert len(faulty) == 1 and faulty[0].gpu_uuid == cards[0].uuid and "ECC" in faulty[0].fault
    assert all(key == b"n1" for _, key, _ in envs)
    assert {e.source for _, _, e in envs if e.kind == "gpu.telemetry"} == {"n1/telemetry"}
    assert {e.source for _, _, e in envs if e.kind != "gpu.telemetry"} == {"n1/inventory"}
    for source in ("n1/telemetry", "n1/inventory"):
        seqs = [e.seq for _, _, e in envs if e.source == source]
        assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    # everything on the node principal's own channel (the worker relays it to gpupool.telemetry / .inventory)
    assert agent.principal == "node-n1" and {topic for topic, _, _ in envs} == {"gpupool.node.node-n1"}


def test_preempt_during_a_release_still_reports_the_stop():
    async def go():
        rec = Recorder()
        ex = executor("n1", rec, argv_for=lambda p: ["sleep", "30"])
        await ex.execute(cmd(place("j", "c1")))
        await ex.execute(cmd(ReleaseJob(command_id="c2", job_id="j", node="n1")))
        await ex.execute(cmd(PreemptJob(command_id="c3", job_id="j", node="n1", grace_s=5)))
        await ex.drain()
        return rec

    rec = run(go())
    assert rec.kinds() == ["job.started", "job.stopped"] and rec.events[1][0].command_id == "c3"


def test_migrate_checkpoints_and_stops_on_the_node_it_leaves_and_resumes_on_the_planned_one(tmp_path):
    """cmd.migrate (defragmentation, #14 item 4) on a real node: the node the job leaves sends SIGTERM (the job's own
    checkpoint handler), reports checkpointed and stopped with reason "migrated" under the move's command id; the
    planned node ignores the move itself and starts the job from that checkpoint when the scheduler places it there;
    a redelivered move, and a move naming an older attempt, change nothing."""
    async def go():
        now = [10_000]
        rec1, rec2 = Recorder(), Recorder()
        n1 = executor("n1", rec1, argv_for=lambda p: ["sleep", "30"], clock=lambda: now[0])
        n2 = executor("n2", rec2, log_dir=tmp_path, clock=lambda: now[0], argv_for=lambda p: py(
            "import os; print(os.environ['GPUPOOL_RESUME_FROM'], os.environ['GPUPOOL_ATTEMPT'])"))
        await n1.execute(cmd(place("j", "c1", attempt=2)))
        now[0] = 12_500
        stale = MigrateJob(command_id="m0", job_id="j", from_node="n1", to_node="n2", assignments=(), attempt=1)
        await n1.execute(cmd(stale))  # planned for the run before this one: this run goes on
        await asyncio.gather(*n1.tasks)
        still = "j" in n1.running
        move = MigrateJob(command_id="m1", job_id="j", from_node="n1", to_node="n2", attempt=2,
                          assignments=(Assignment(gpu_uuid="GPU-bbbb", milli=1000, memory_mib=1024),))
        await n2.execute(cmd(move))  # the planned node: nothing to do until the placement comes
        await n1.execute(cmd(move))
        await n1.execute(cmd(move))  # redelivered
        await n1.drain()
        stopped = [p for p, _, _ in rec1.events if isinstance(p, JobStopped)]
        await n2.execute(cmd(place("j", "c2", node="n2", attempt=3, resume_from=stopped[0].checkpoint,
                                   assignments=move.assignments)))
        await n2.drain()
        return rec1, rec2, still, n1

    rec1, rec2, still, n1 = run(go())
    assert still and n1.running == {}
    assert rec1.kinds() == ["job.started", "job.checkpointed", "job.stopped"]
    ck, st = rec1.events[1][0], rec1.events[2][0]
    assert (ck.command_id, st.command_id, st.reason) == ("m1", "m1", "migrated")  # a move, not a preemption
    assert (st.progress_ms, st.checkpoint) == (2_500, "ckpt:j:2500") == (ck.progress_ms, ck.checkpoint)
    assert rec2.kinds() == ["job.started", "job.completed"]  # nothing for the move itself
    assert (tmp_path / "n2" / "j" / "attempt-3.log").read_text().split() == ["ckpt:j:2500", "3"]


def test_the_nvml_agent_runs_a_tenant_slash_name_job_in_its_own_directory(tmp_path, monkeypatch):
    """The real agent used to die on the first placement of `tenant/name` (the log path's subdirectory was never
    made): placed on the NVML agent over the fake NVML, such a job runs as a program, as the job user, and its log
    lands under jobs/NODE/tenant/name/."""
    from agents.node.nvml_agent import NvmlAgent
    from infra.config import Config
    from schemas.envelope import decode
    from tests.program_helpers import need_python3, passable_dir

    _, b = backend(two_card_node())
    cfg = Config(home=tmp_path, kafka="127.0.0.1:1", clickhouse="", kafka_port=1, web_port=1)
    args = SimpleNamespace(interval=0.01, group=None, allow_mig_reconfigure=False)
    with passable_dir() as root:
        monkeypatch.setenv("GPUPOOL_JOBS_ROOT", str(root / "jobs"))
        monkeypatch.setenv("GPUPOOL_CHECKPOINT_ROOT", str(root / "checkpoints"))

        async def go():
            agent = NvmlAgent(cfg, args, b, node="n1")
            agent.producer = FakeProducer()
            await agent.publish_inventory(force=True)
            code = "import os; print(os.environ['GPUPOOL_JOB_ID'], os.environ['CUDA_VISIBLE_DEVICES'], os.getuid())"
            p = PlaceJob(command_id="c1", job_id="acme/train", tenant="acme", node="n1", attempt=1,
                         assignments=(Assignment(gpu_uuid="GPU-bbbb", milli=1000, memory_mib=1024),),
                         command=(need_python3(), "-c", code))
            await agent.executor.execute(cmd(p))
            await agent.executor.drain()
            await agent.log_shipper.close()  # the program's output, as job.log of its own node
            return agent

        agent = run(go())
        sent = [decode(v) for _, _, v in agent.producer.sent]
        kinds = [e.kind for e in sent if e.kind != "job.log"]
        assert kinds[0] == "node.inventory" and kinds[1:] == ["job.started", "job.completed"], kinds
        pieces = [e.payload for e in sent if e.kind == "job.log"]
        assert {(x.job_id, x.node, x.attempt) for x in pieces} == {("acme/train", "n1", 1)}
        assert "".join(x.text for x in pieces if x.stream == "stdout").startswith("acme/train GPU-bbbb ")
        log = (root / "jobs" / "n1" / "acme" / "train" / "attempt-1.log").read_text().split()
        assert log[:2] == ["acme/train", "GPU-bbbb"] and log[2] == ("65534" if os.geteuid() == 0 else str(os.getuid()))
