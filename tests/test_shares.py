"""Software shares of a card (issue #32 item 4): the limits a job on a share is given, the watch that stops a job
holding more than its share, NVML's per-process memory (fake NVML), and the real agent stopping a real process."""
from __future__ import annotations

import asyncio
import itertools
import os
import shutil
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agents.node.share_enforcer import ShareEnforcer, share_problems
from agents.node.shares import (
    HAMI_LIBRARY_IN_CONTAINER, GpuMemoryUsage, ShareConfig, ShareMount, ShareWatch, share_env, share_environment,
    share_limits, share_mounts, usage_by_job,
)
from agents.node.nvml_backend import NvmlBackend
from schemas.envelope import decode, envelope
from schemas.events import Assignment, GpuCard, JobFailed, PlaceJob, ReleaseJob
from schemas.program import reserved_env
from tests.fake_pynvml import FakeCard, FakeNvml, FakeProcess, NVMLError_NoPermission, two_card_node

SHARE = Assignment(gpu_uuid="GPU-aaaa", milli=250, memory_mib=8192)
WHOLE = Assignment(gpu_uuid="GPU-bbbb", milli=1000, memory_mib=81920)
MIG = Assignment(gpu_uuid="GPU-mig0", milli=428, memory_mib=40192, mig_profile="3g.40gb", mig_uuid="MIG-1111")


# ---------------------------------------------------------------- the limits in the environment

def test_hami_limits_per_visible_device():
    assert share_env((SHARE,), mode="hami") == {"CUDA_DEVICE_MEMORY_LIMIT_0": "8192m", "CUDA_DEVICE_SM_LIMIT_0": "25"}


def test_mps_limits():
    assert share_env((SHARE,), mode="mps") == {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "25",
                                               "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=8192M"}


@pytest.mark.parametrize("mode", ["hami", "mps", "none"])
def test_whole_cards_and_mig_instances_carry_no_share_limits(mode):
    assert share_env((WHOLE,), mode=mode) == {}
    assert share_env((MIG,), mode=mode) == {}
    assert share_env((SHARE,), mode="none") == {}
    mig_card = GpuCard(uuid="GPU-aaaa", index=0, model="A100-80GB", memory_mib=81920, mig_capable=True,
                       mig_enabled=True)
    assert share_env((SHARE,), [mig_card], mode=mode) == {}  # a card in MIG mode is never shared in software


def test_the_index_is_the_devices_place_among_the_jobs_visible_devices():
    """CUDA numbers a job's devices in CUDA_VISIBLE_DEVICES order: a share listed second is device 1."""
    other = Assignment(gpu_uuid="GPU-cccc", milli=500, memory_mib=4096)
    job = (WHOLE, SHARE, WHOLE, other)  # GPU-bbbb, GPU-aaaa, GPU-cccc
    assert share_env(job, mode="hami") == {
        "CUDA_DEVICE_MEMORY_LIMIT_1": "8192m", "CUDA_DEVICE_SM_LIMIT_1": "25",
        "CUDA_DEVICE_MEMORY_LIMIT_2": "4096m", "CUDA_DEVICE_SM_LIMIT_2": "50"}
    # MPS: one thread percentage for the client (the smallest share binds), a memory limit per shared device
    assert share_env(job, mode="mps") == {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "25",
                                          "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "1=8192M,2=4096M"}


@pytest.mark.parametrize("milli,pct", [(1, "1"), (100, "10"), (333, "34"), (999, "100")])
def test_compute_share_rounds_up_to_a_whole_percent(milli, pct):
    a = Assignment(gpu_uuid="GPU-aaaa", milli=milli, memory_mib=1)
    assert share_env((a,), mode="hami")["CUDA_DEVICE_SM_LIMIT_0"] == pct


def test_slices_of_one_card_add_up_and_memory_stays_within_the_card():
    card = GpuCard(uuid="GPU-aaaa", index=0, model="T4", memory_mib=15360)
    two = (Assignment(gpu_uuid="GPU-aaaa", milli=300, memory_mib=10000),
           Assignment(gpu_uuid="GPU-aaaa", milli=200, memory_mib=10000))
    assert share_limits(two) == {"GPU-aaaa": 20000}
    assert share_limits(two, [card]) == {"GPU-aaaa": 15360}
    assert share_env(two, {"GPU-aaaa": card}, "hami") == {"CUDA_DEVICE_MEMORY_LIMIT_0": "15360m",
                                                         "CUDA_DEVICE_SM_LIMIT_0": "50"}


def test_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="one of hami, mps, none"):
        share_env((SHARE,), mode="vgpu")
    assert share_env((SHARE,), mode="") == {}  # not configured: the default, none


def test_node_configuration_from_the_environment():
    assert ShareConfig.from_env({}) == ShareConfig(mode="none", watch_samples=3, slack_mib=0, stop_grace_s=5.0)
    cfg = ShareConfig.from_env({"GPUPOOL_SHARE_ENFORCEMENT": "HAMI", "GPUPOOL_HAMI_LIBRARY": "/opt/vgpu/libvgpu.so",
                                "GPUPOOL_SHARE_WATCH_SAMPLES": "5", "GPUPOOL_SHARE_SLACK_MIB": "256",
                                "GPUPOOL_SHARE_STOP_GRACE_S": "2.5"})
    assert (cfg.mode, cfg.hami_library, cfg.watch_samples, cfg.slack_mib, cfg.stop_grace_s) == \
        ("hami", "/opt/vgpu/libvgpu.so", 5, 256, 2.5)
    for bad, why in (({"GPUPOOL_SHARE_ENFORCEMENT": "hami"}, "GPUPOOL_HAMI_LIBRARY"),
                     ({"GPUPOOL_SHARE_ENFORCEMENT": "gpu-slicing"}, "one of"),
                     ({"GPUPOOL_SHARE_WATCH_SAMPLES": "three"}, "a number"),
                     ({"GPUPOOL_SHARE_SLACK_MIB": "-1"}, "not negative"),
                     ({"GPUPOOL_SHARE_ENFORCEMENT": "hami", "GPUPOOL_HAMI_LIBRARY": "libvgpu.so"}, "absolute"),
                     ({"GPUPOOL_MPS_PIPE_DIRECTORY": "mps"}, "absolute"),
                     ({"GPUPOOL_MPS_SHM_DIRECTORY": "shm"}, "absolute")):
        with pytest.raises(ValueError, match=why):
            ShareConfig.from_env(bad)


def test_share_problems_name_a_missing_library_or_mps_daemon(tmp_path, monkeypatch):
    import agents.node.share_enforcer as enforcer

    monkeypatch.setattr(enforcer, "HAMI_LOCK_DIRECTORY", str(tmp_path / "vgpulock"))
    lib = tmp_path / "libvgpu.so"
    problems = share_problems(ShareConfig(mode="hami", hami_library=str(lib)))
    assert len(problems) == 2 and "not a file" in problems[0] and "mkdir -m 1777" in problems[1]
    lib.write_bytes(b"\x7fELF")
    (tmp_path / "vgpulock").mkdir()
    assert share_problems(ShareConfig(mode="hami", hami_library=str(lib))) == []
    assert "no MPS control daemon" in share_problems(ShareConfig(mode="mps", mps_pipe_directory=str(tmp_path / "x")))[0]
    assert share_problems(ShareConfig(mode="mps", mps_pipe_directory=str(tmp_path))) == []
    assert share_problems(ShareConfig()) == []


def test_hami_mode_preloads_the_library_with_a_cache_of_the_jobs_own():
    cfg = ShareConfig(mode="hami", hami_library="/opt/vgpu/libvgpu.so")
    plain = share_environment((SHARE,), None, cfg, job_dir="/var/lib/gpupool/jobs/acme/train/")
    assert plain == {"CUDA_DEVICE_MEMORY_LIMIT_0": "8192m", "CUDA_DEVICE_SM_LIMIT_0": "25",
                     "LD_PRELOAD": "/opt/vgpu/libvgpu.so",
                     "CUDA_DEVICE_MEMORY_SHARED_CACHE": "/var/lib/gpupool/jobs/acme/train/hami.cache"}
    boxed = share_environment((SHARE,), None, cfg, in_container=True)
    assert boxed["LD_PRELOAD"] == HAMI_LIBRARY_IN_CONTAINER
    assert boxed["CUDA_DEVICE_MEMORY_SHARED_CACHE"].startswith("/tmp/")  # the container's own /tmp
    assert share_mounts((SHARE,), None, cfg) == [ShareMount("/opt/vgpu/libvgpu.so", HAMI_LIBRARY_IN_CONTAINER, True),
                                                 ShareMount("/tmp/vgpulock", "/tmp/vgpulock", False)]
    # a job with no share gets nothing: no preload, no mount
    assert share_environment((WHOLE,), None, cfg, job_dir="/j") == {} and share_mounts((WHOLE,), None, cfg) == []


def test_mps_mode_gives_the_daemons_pipe_directory_when_the_node_moved_it():
    assert "CUDA_MPS_PIPE_DIRECTORY" not in share_environment((SHARE,), None, ShareConfig(mode="mps"))
    cfg = ShareConfig(mode="mps", mps_pipe_directory="/run/nvidia-mps")
    assert share_environment((SHARE,), None, cfg)["CUDA_MPS_PIPE_DIRECTORY"] == "/run/nvidia-mps"
    assert share_mounts((SHARE,), None, cfg) == [ShareMount("/run/nvidia-mps", "/run/nvidia-mps", False)]
    assert share_mounts((SHARE,), None, ShareConfig(mode="mps")) == [ShareMount("/tmp/nvidia-mps", "/tmp/nvidia-mps",
                                                                                 False)]
    with_shm = ShareConfig(mode="mps", mps_shm_directory="/run/nvidia/mps/shm")
    assert share_mounts((SHARE,), None, with_shm)[1] == ShareMount("/run/nvidia/mps/shm", "/dev/shm", False)
    assert ShareConfig.from_env({"GPUPOOL_MPS_SHM_DIRECTORY": "/run/nvidia/mps/shm"}).mps_shm_directory == \
        "/run/nvidia/mps/shm"


@pytest.mark.parametrize("cfg", [ShareConfig(mode="hami", hami_library="/l/libvgpu.so"),
                                 ShareConfig(mode="mps", mps_pipe_directory="/p"), ShareConfig()])
def test_every_name_the_pool_sets_for_a_share_is_one_a_request_may_not_set(cfg):
    """schemas/program.py refuses a request that sets any of them (issue #32 item 1): the limits are the pool's."""
    for in_container in (False, True):
        env = share_environment((WHOLE, SHARE), None, cfg, job_dir="/j", in_container=in_container)
        assert all(reserved_env(name) for name in env), env


# ---------------------------------------------------------------- the watch

def test_a_job_over_its_share_for_k_samples_is_reported_once_with_the_numbers():
    w = ShareWatch(samples=3)
    allowed = {"a": {"GPU-aaaa": 8192}, "b": {"GPU-aaaa": 8192}}
    over = {"a": {"GPU-aaaa": 4000}, "b": {"GPU-aaaa": 9000}}
    assert w.observe(over, allowed) == [] and w.observe(over, allowed) == []
    (breach,) = w.observe(over, allowed)
    assert (breach.job_id, breach.gpu_uuid, breach.used_mib, breach.allowed_mib, breach.samples, breach.code) == \
        ("b", "GPU-aaaa", 9000, 8192, 3, "ShareExceeded")
    assert "9000 MiB" in breach.message and "8192 MiB" in breach.message and "3 samples" in breach.message
    assert w.observe(over, allowed) == []  # reported once; the stop is under way


def test_a_sample_back_within_the_share_starts_the_count_again():
    w = ShareWatch(samples=3)
    allowed = {"b": {"GPU-aaaa": 8192}}
    over, within = {"b": {"GPU-aaaa": 9000}}, {"b": {"GPU-aaaa": 8192}}  # exactly the share is within it
    seq = [over, over, within, over, over]
    assert [w.observe(u, allowed) for u in seq] == [[]] * 5
    assert [b.job_id for b in w.observe(over, allowed)] == ["b"]


def test_a_round_that_could_not_read_the_card_changes_nothing():
    w = ShareWatch(samples=2)
    allowed = {"b": {"GPU-aaaa": 100}}
    over = {"b": {"GPU-aaaa": 200}}
    assert w.observe(over, allowed) == []
    assert w.observe({}, allowed, read_cards=frozenset()) == []  # neither within (no reset) nor over
    assert [b.job_id for b in w.observe(over, allowed, read_cards={"GPU-aaaa"})] == ["b"]


def test_slack_and_off():
    assert ShareWatch(samples=1, slack_mib=500).observe({"b": {"g": 8600}}, {"b": {"g": 8192}}) == []
    assert len(ShareWatch(samples=1, slack_mib=500).observe({"b": {"g": 8700}}, {"b": {"g": 8192}})) == 1
    assert ShareWatch(samples=0).observe({"b": {"g": 10 ** 6}}, {"b": {"g": 1}}) == []


def test_a_job_that_leaves_is_forgotten_and_one_without_a_share_never_watched():
    w = ShareWatch(samples=2)
    over = {"b": {"g": 200}, "whole": {"g": 10 ** 6}}
    w.observe(over, {"b": {"g": 100}})
    w.observe(over, {})  # b ended
    assert w.over == {} and w.observe(over, {"b": {"g": 100}}) == []  # placed again: counted from the start
    assert [b.job_id for b in w.observe(over, {"b": {"g": 100}})] == ["b"]


def test_usage_by_job_adds_up_a_jobs_processes_and_leaves_out_the_rest():
    def lookup(pid):
        if pid == 13:
            raise ProcessLookupError  # exited while looked up
        return {10: "a", 11: "a", 12: "b"}.get(pid)

    per_pid = {10: {"g0": 100, "g1": 5}, 11: {"g0": 50}, 12: {"g0": 7}, 13: {"g0": 1}, 99: {"g0": 1000}}
    assert usage_by_job(per_pid, lookup) == {"a": {"g0": 150, "g1": 5}, "b": {"g0": 7}}


jobs_ = st.sampled_from(["a", "b", "c"])
cards_ = st.sampled_from(["g0", "g1"])
rounds = st.lists(st.tuples(
    st.dictionaries(jobs_, st.dictionaries(cards_, st.integers(0, 20_000), max_size=2), max_size=3),  # usage
    st.frozensets(cards_)),  # cards read this round
    max_size=25)


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 5), st.integers(0, 300), st.dictionaries(cards_, st.integers(1, 10_000), min_size=1), rounds,
       st.data())
def test_a_job_never_over_its_share_is_never_stopped(k, slack, share, seq, data):
    """Property: whatever its neighbours do and whichever cards each round reads, a job that never holds more than
    its share is never reported; a neighbour is reported at most once while it runs."""
    w = ShareWatch(samples=k, slack_mib=slack)
    allowed = {"a": share, "b": {"g0": 8192}, "c": {"g0": 4096, "g1": 4096}}
    reported: list[str] = []
    for usage, read in seq:
        usage = dict(usage)
        usage["a"] = {card: data.draw(st.one_of(st.just(mib), st.integers(0, mib)))  # its whole share, often
                      for card, mib in share.items()}
        reported += [b.job_id for b in w.observe(usage, allowed, read)]
    assert "a" not in reported
    assert len(reported) == len(set(reported))


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 5), st.lists(st.sampled_from(["over", "within", "unread"]), max_size=30))
def test_a_job_is_reported_exactly_when_k_read_samples_in_a_row_were_over(k, seq):
    """Property against the rule in words: the k-th over sample counting from the last within one (unread rounds
    skipped) reports the job, once."""
    w = ShareWatch(samples=k)
    allowed = {"b": {"g0": 100}}
    run, reported_at = 0, []
    expected = None
    for i, what in enumerate(seq):
        usage = {"b": {"g0": 101 if what == "over" else 100}}
        got = w.observe(usage, allowed, frozenset() if what == "unread" else {"g0"})
        if got:
            reported_at.append(i)
        if what == "over":
            run += 1
            if run == k and expected is None:
                expected = i
        elif what == "within":
            run = 0
    assert reported_at == ([] if expected is None else [expected])


# ---------------------------------------------------------------- NVML's per-process memory (fake NVML)

def backend(cards):
    nv = FakeNvml(cards)
    return nv, NvmlBackend(nv, cpu_milli=32000, memory_mib=128 * 1024).open()


def test_backend_reads_each_jobs_memory_per_card_from_every_process_list():
    cards = two_card_node()
    cards[0].processes = [FakeProcess(100, 3000), FakeProcess(101, 1000, kind="graphics"),
                          FakeProcess(101, 1000, kind="compute"),  # one process on two lists: counted once
                          FakeProcess(200, 2500, kind="mps"), FakeProcess(999, 40_000)]  # 999: no job's
    cards[1].processes = [FakeProcess(102, 512)]
    _, b = backend(cards)
    tel, _ = b.telemetry("n1", {100: "a", 101: "a", 102: "a", 200: "b"})
    assert b.last_usage == GpuMemoryUsage(by_job={"a": {"GPU-aaaa": 4000, "GPU-bbbb": 512}, "b": {"GPU-aaaa": 2500}},
                                          cards=frozenset({"GPU-aaaa", "GPU-bbbb"}))
    assert {s.gpu_uuid: s.job_ids for s in tel.samples} == {"GPU-aaaa": ("a", "b"), "GPU-bbbb": ("a",)}


def test_a_card_whose_processes_cannot_be_counted_says_nothing_about_its_jobs():
    cards = two_card_node()
    cards[0].processes = [FakeProcess(100, 3000)]
    cards[0].errors["nvmlDeviceGetComputeRunningProcesses"] = NVMLError_NoPermission  # an unprivileged agent
    cards[1].processes = [FakeProcess(101, None)]  # NVML: not available
    _, b = backend(cards)
    tel, health = b.telemetry("n1", {100: "a", 101: "b"})
    assert health == [] and b.last_usage.cards == frozenset()
    assert {s.gpu_uuid: s.job_ids for s in tel.samples} == {"GPU-aaaa": (), "GPU-bbbb": ("b",)}


def test_with_the_fake_nvml_the_watch_stops_the_job_that_grows_past_its_share_only():
    """Two jobs share a card; one allocates past its share: K samples later the watch names it, not its neighbour."""
    card = FakeCard("GPU-aaaa", name="NVIDIA A100-SXM4-80GB",
                    processes=[FakeProcess(100, 6000), FakeProcess(200, 6000)])
    _, b = backend([card])
    jobs = {100: "a", 200: "b"}
    running = {"a": (Assignment(gpu_uuid="GPU-aaaa", milli=500, memory_mib=8192),),
               "b": (Assignment(gpu_uuid="GPU-aaaa", milli=500, memory_mib=8192),)}
    found = []
    enforcer = ShareEnforcer(ShareConfig(watch_samples=3), running=lambda: running,
                             stop=lambda breach, grace: asyncio.sleep(0, found.append((breach, grace))),
                             cards=lambda: b.inventory("n1").gpus)

    def round_():
        b.telemetry("n1", jobs)
        return asyncio.run(enforcer.enforce(b.last_usage))

    assert round_() == []
    card.grow(200, 3000)  # b: 9000 MiB of its 8192
    assert b.last_usage.by_job["b"]["GPU-aaaa"] == 6000  # not read yet
    assert round_() == [] and round_() == []
    (breach,) = round_()
    assert (breach.job_id, breach.used_mib, breach.allowed_mib) == ("b", 9000, 8192)
    assert [(f.job_id, g) for f, g in found] == [("b", 5.0)]
    card.grow(100, 4000)  # a now over too: its own count starts
    assert round_() == [] and found[-1][0].job_id == "b"


def test_the_share_stop_also_drives_a_runner_shaped_job():
    """The runner branch's executor keeps a Run per job (`job.run`: running, stop(grace) -> how it ended): the same
    stop ends it through that and reports the signal it ended on."""
    from agents.node.share_enforcer import stop_job_for_share
    from agents.node.shares import ShareBreach

    class FakeRun:
        running, stopped_with = True, None

        async def stop(self, grace_s):
            self.stopped_with, self.running = grace_s, False
            return SimpleNamespace(signal=15, exit_code=None)

    sent = []

    async def publish(payload, source, cause=None):
        sent.append((payload, source, cause))

    job = SimpleNamespace(job_id="b", command_id="c9", attempt=2, stopping=False, run=FakeRun())
    neighbour = SimpleNamespace(job_id="a", command_id="c8", attempt=0, stopping=False, run=FakeRun())
    executor = SimpleNamespace(node="n1", running={"b": job, "a": neighbour}, publish=publish)
    breach = ShareBreach("b", "GPU-aaaa", 9000, 8192, 3)
    asyncio.run(stop_job_for_share(executor, breach, 2.0))
    asyncio.run(stop_job_for_share(executor, breach, 2.0))  # again: nothing more
    assert job.run.stopped_with == 2.0 and neighbour.run.running and list(executor.running) == ["a"]
    ((failed, source, cause),) = sent
    assert (failed.job_id, failed.code, failed.signal, failed.attempt, failed.command_id, source, cause) == \
        ("b", "ShareExceeded", 15, 2, "c9", "n1/job/b", "c9")


# ---------------------------------------------------------------- the real agent, a real process, the fake NVML

class FakeProducer:
    def __init__(self):
        self.sent: list = []

    async def send(self, topic, key, value):
        self.sent.append(decode(value))

    async def flush(self):
        pass


_seq = itertools.count(1)


def cmd(payload):
    return envelope(payload, source="scheduler", seq=next(_seq), time_ms=0)


def share_place(job: str, command_id: str) -> PlaceJob:
    return PlaceJob(command_id=command_id, job_id=job, tenant="acme", node="n1", duration_s=60, attempt=1,
                    assignments=(Assignment(gpu_uuid="GPU-aaaa", milli=500, memory_mib=8192),))


@pytest.fixture
def passable_jobs_root(monkeypatch):
    """Job directories the unprivileged job user can reach when the tests run as root (pytest's tmp dirs are 0700):
    GPUPOOL_JOBS_ROOT / GPUPOOL_CHECKPOINT_ROOT, which the runner's node context reads (main's agent ignores them)."""
    root = Path(tempfile.mkdtemp(prefix="gpupool-shares-"))
    os.chmod(root, 0o711)
    monkeypatch.setenv("GPUPOOL_JOBS_ROOT", str(root / "jobs"))
    monkeypatch.setenv("GPUPOOL_CHECKPOINT_ROOT", str(root / "checkpoints"))
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def make_agent(tmp_path, monkeypatch):
    from agents.node.nvml_agent import NvmlAgent
    from infra.config import Config

    monkeypatch.setenv("GPUPOOL_SHARE_WATCH_SAMPLES", "3")
    monkeypatch.setenv("GPUPOOL_SHARE_STOP_GRACE_S", "5")
    monkeypatch.delenv("GPUPOOL_SHARE_ENFORCEMENT", raising=False)
    cards = two_card_node()
    nv, b = backend(cards)
    cfg = Config(home=tmp_path, kafka="127.0.0.1:1", clickhouse="", kafka_port=1, web_port=1)
    agent = NvmlAgent(cfg, SimpleNamespace(interval=0.01, group=None, allow_mig_reconfigure=False), b, node="n1")
    agent.producer = FakeProducer()
    return agent, cards[0], b


def pid_of(job) -> int:
    """The job's process (group) id: main's executor keeps an asyncio process, the runner's a Run."""
    return job.run.pid if getattr(job, "run", None) is not None else job.proc.pid


def alive(job) -> bool:
    return job.run.running if getattr(job, "run", None) is not None else job.proc.returncode is None


async def start_two_jobs_on_one_card(agent, card):
    # (job ids without a tenant/ prefix: main's agent cannot yet open such a job's log file, issue #32 item 8)
    await agent.publish_inventory(force=True)
    await agent.executor.execute(cmd(share_place("small", "c1")))
    await agent.executor.execute(cmd(share_place("greedy", "c2")))
    small, greedy = agent.executor.running["small"], agent.executor.running["greedy"]
    # NVML names the real processes (sleep 60, each in its own process group) on the shared card
    card.processes = [FakeProcess(pid_of(small), 4000), FakeProcess(pid_of(greedy), 4000)]
    return small, greedy


async def wait_for(cond, what: str, deadline_s: float = 30.0):
    async def poll():
        while not cond():
            await asyncio.sleep(0.01)
    try:
        await asyncio.wait_for(poll(), deadline_s)
    except asyncio.TimeoutError:
        raise AssertionError(f"not seen: {what}") from None


def failures(agent) -> list[JobFailed]:
    return [e.payload for e in agent.producer.sent if isinstance(e.payload, JobFailed)]


def test_the_agent_stops_the_real_process_over_its_share_and_its_neighbour_runs_on(tmp_path, monkeypatch,
                                                                                    passable_jobs_root):
    agent, card, b = make_agent(tmp_path, monkeypatch)

    async def go():
        small, greedy = await start_two_jobs_on_one_card(agent, card)

        async def round_():
            await asyncio.to_thread(b.telemetry, "n1", agent.executor.job_lookup())
            return await agent.enforce_shares(b.last_usage)

        assert await round_() == []
        card.grow(pid_of(greedy), 5000)  # 9000 MiB of its 8192
        assert await round_() == [] and await round_() == []
        (breach,) = await round_()
        await wait_for(lambda: failures(agent), "job.failed for the greedy job")
        await wait_for(lambda: not alive(greedy), "the greedy job's process ended")
        small_alive = alive(small) and "small" in agent.executor.running
        await agent.executor.execute(cmd(ReleaseJob(command_id="c3", job_id="small", node="n1", attempt=1)))
        await agent.executor.drain()
        return breach, greedy, small_alive

    breach, greedy, small_alive = asyncio.run(asyncio.wait_for(go(), 60))
    assert breach.job_id == "greedy" and small_alive
    (failed,) = failures(agent)
    assert (failed.job_id, failed.code, failed.command_id, failed.attempt, failed.node) == \
        ("greedy", "ShareExceeded", "c2", 1, "n1")
    assert failed.signal == 15  # SIGTERM sufficed: sleep does not catch it
    assert "9000 MiB" in failed.reason and "8192 MiB" in failed.reason and "GPU-aaaa" in failed.reason
    assert "greedy" not in agent.executor.running


def test_the_telemetry_loop_enforces_shares_after_k_telemetry_rounds(tmp_path, monkeypatch, passable_jobs_root):
    agent, card, b = make_agent(tmp_path, monkeypatch)

    async def go():
        small, greedy = await start_two_jobs_on_one_card(agent, card)
        card.grow(pid_of(greedy), 5000)

        async def stop_when_failed():
            await wait_for(lambda: failures(agent), "job.failed from the telemetry loop")
            agent.stopping.set()

        await asyncio.gather(agent.telemetry_loop(), stop_when_failed())
        small_alive = alive(small)
        await agent.executor.stop_all(grace_s=5)
        return small_alive

    assert asyncio.run(asyncio.wait_for(go(), 60))
    kinds = [e.kind for e in agent.producer.sent]
    first_failure = kinds.index("job.failed")
    assert kinds[:first_failure].count("gpu.telemetry") >= 3  # K rounds over its share before the stop
    assert [(f.job_id, f.code) for f in failures(agent)] == [("greedy", "ShareExceeded")]
