"""The simulated fleet agent without a broker: commands go in through execute(), everything it writes lands in a
recording producer. Durations are whole simulated seconds; `speedup` makes a simulated second a few wall ms."""
from __future__ import annotations

import asyncio

import pytest

from agents.node.fleet import make_node
from agents.node.sim_agent import SimFleetAgent
from schemas.envelope import decode
from schemas.events import (
    Assignment, GpuHealth, JobCheckpointed, JobCompleted, JobFailed, JobStarted, JobStopped, MigInstance,
    MigrateJob, MigReconfigure, NodeInventory, PlaceJob, PreemptJob, ReleaseJob, ResizeJob,
)
from schemas.topics import INVENTORY, JOB_EVENTS, TELEMETRY
from streams.folds.node_view import evolve
from tests.builders import Clock
from tests.virtual_clock import run_virtual

SPEEDUP = 50  # one simulated second = 20 ms


class Recorder:
    """A producer stand-in: keeps every envelope sent, with the topic, key and the loop time it was sent at."""

    def __init__(self):
        self.sent = []
        self.flushes = 0

    async def send(self, topic, key=None, value=None):
        self.sent.append((topic, key, decode(value), asyncio.get_running_loop().time()))

    async def flush(self):
        self.flushes += 1

    def envs(self, *types):
        return [e for _, _, e, _ in self.sent if not types or isinstance(e.payload, types)]

    def payloads(self, *types):
        return [e.payload for e in self.envs(*types)]

    def telemetry(self, node):
        return [e for e in self.envs() if e.kind == "gpu.telemetry" and e.payload.node == node]


def fleet():
    return [make_node("n1", "A100-80GB", 2), make_node("n2", "H100-80GB", 1, mig=["3g.40gb", "2g.20gb", "1g.10gb"])]


def agent(speedup=SPEEDUP, nodes=None, **kw):
    rec = Recorder()
    return SimFleetAgent(None, nodes or fleet(), producer=rec, speedup=speedup, **kw), rec


CLOCK = Clock()


def cmd(payload):
    return CLOCK.env(payload, "scheduler")


def whole(uuid, milli=1000, mib=1024, **kw):
    return (Assignment(gpu_uuid=uuid, milli=milli, memory_mib=mib, **kw),)


def place(job, cid, node="n1", card="GPU-n1-0", duration=1, **kw):
    a = kw.pop("assignments", None) or whole(card)
    return PlaceJob(command_id=cid, job_id=job, tenant="t", node=node, assignments=a, duration_s=duration, **kw)


async def settle(ag: SimFleetAgent, timeout=5.0):
    """Wait until no simulated job is running any more."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while any(n.running for n in ag.nodes.values()):
        assert loop.time() < end, "jobs still running"
        await asyncio.sleep(0.005)


async def stop(ag: SimFleetAgent):
    for t in list(ag._tasks):
        t.cancel()
    await asyncio.sleep(0)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 20))


def check_lifecycle_causes(rec: Recorder):
    """Every lifecycle event carries the command that caused it, in the payload and as the causation id."""
    for e in rec.envs(JobStarted, JobCompleted, JobCheckpointed, JobStopped, JobFailed):
        assert e.payload.command_id and e.causation_id == e.payload.command_id
        assert e.source == f"{e.payload.node}/job/{e.payload.job_id}"


# ---------------------------------------------------------------- telemetry

def test_telemetry_follows_work_on_cards_and_mig_instances():
    async def go():
        ag, rec = agent()
        await ag.execute(cmd(place("big", "c1", card="GPU-n1-0", duration=None,
                                   assignments=whole("GPU-n1-0", 600, 20480))))
        await ag.execute(cmd(place("small", "c2", duration=None, assignments=whole("GPU-n1-0", 300, 4096))))
        await ag.execute(cmd(place("m", "c3", node="n2", duration=None, assignments=whole(
            "GPU-n2-0", 428, 30000, mig_profile="3g.40gb", mig_uuid="MIG-n2-0-0"))))
        await ag.publish_telemetry()
        await stop(ag)
        return rec

    rec = run(go())
    (t1,) = rec.telemetry("n1")
    (t2,) = rec.telemetry("n2")
    s1 = {s.gpu_uuid: s for s in t1.payload.samples}
    assert (s1["GPU-n1-0"].util_pct, s1["GPU-n1-0"].mem_used_mib, s1["GPU-n1-0"].job_ids) == (90, 24576,
                                                                                                ("big", "small"))
    assert (s1["GPU-n1-1"].util_pct, s1["GPU-n1-1"].mem_used_mib, s1["GPU-n1-1"].job_ids) == (0, 0, ())
    assert s1["GPU-n1-0"].mem_total_mib == 80 * 1024 and s1["GPU-n1-0"].mig_uuid is None
    s2 = {s.mig_uuid: s for s in t2.payload.samples}
    assert set(s2) == {"MIG-n2-0-0", "MIG-n2-0-1", "MIG-n2-0-2"}  # one sample per MIG instance, none for the card
    m = s2["MIG-n2-0-0"]
    assert (m.gpu_uuid, m.util_pct, m.mem_used_mib, m.mem_total_mib, m.job_ids) == ("GPU-n2-0", 42, 30000, 40 * 1024,
                                                                                     ("m",))
    assert (s2["MIG-n2-0-1"].mem_total_mib, s2["MIG-n2-0-1"].job_ids, s2["MIG-n2-0-2"].mem_total_mib) == (
        20 * 1024, (), 10 * 1024)
    assert t1.source == "n1/telemetry" and {topic for topic, *_ in rec.sent if _[1].kind == "gpu.telemetry"} == {
        TELEMETRY.name}


def test_ecc_fault_reaches_telemetry_and_takes_the_card_out_of_the_node_view():
    async def go():
        ag, rec = agent()
        await ag.publish_telemetry()
        ag.inject("ecc:n1:1")
        await ag.publish_telemetry()
        ag.inject("clear:n1:1")
        await ag.publish_telemetry()
        return ag, rec

    ag, rec = run(go())
    before, faulty, cleared = rec.telemetry("n1")
    assert all(s.ecc_uncorrected == 0 for s in before.payload.samples)
    assert {s.gpu_uuid: s.ecc_uncorrected > 0 for s in faulty.payload.samples} == {"GPU-n1-0": False,
                                                                                    "GPU-n1-1": True}
    assert all(s.ecc_uncorrected == 0 for s in cleared.payload.samples)
    c = Clock()
    view = evolve(None, c.env(ag.nodes["n1"].inventory, "n1/inventory"))
    view = evolve(view, before)
    assert view.unhealthy == {}
    view = evolve(view, faulty)
    assert set(view.unhealthy) == {"GPU-n1-1"} and not view.card_free()[1].healthy and view.card_free()[0].healthy
    view = evolve(view, cleared)
    assert set(view.unhealthy) == {"GPU-n1-1"}  # by design: out until an operator says otherwise
    view = evolve(view, envelope_after(cleared, GpuHealth(node="n1", gpu_uuid="GPU-n1-1", healthy=True)))
    assert view.unhealthy == {}


def envelope_after(env, payload):
    from schemas.envelope import envelope
    return envelope(payload, source="operator", seq=1, time_ms=env.event_time_ms + 1)


def test_lost_node_is_silent_and_recovers():
    async def go():
        ag, rec = agent()
        await ag.execute(cmd(place("j", "c1", node="n2", card="GPU-n2-0", duration=None,
                                   assignments=whole("GPU-n2-0", 428, 1024, mig_uuid="MIG-n2-0-0"))))
        ag.inject("lose:n2")
        await ag.publish_telemetry()
        await ag.execute(cmd(place("k", "c2", node="n2", card="GPU-n2-0")))  # sent to a node that is gone
        await ag.apply("recover:n2")
        await ag.publish_telemetry()
        await stop(ag)
        return rec

    rec = run(go())
    assert [e.payload.node for e in rec.envs() if e.kind == "gpu.telemetry"] == ["n1", "n1", "n2"]
    assert [p.job_id for p in rec.payloads(JobStarted)] == ["j"]  # nothing from n2 while it was gone
    assert not rec.payloads(JobCompleted, JobStopped)
    assert [p.node for p in rec.payloads(NodeInventory)] == ["n2"]  # back: the inventory again
    (tel,) = rec.telemetry("n2")
    assert all(s.job_ids == () for s in tel.payload.samples)  # its jobs died with it


def test_bad_faults_are_refused():
    ag, _ = agent()
    for bad in ("melt:n1", "ecc:n9:0", "ecc:n1:2", "ecc:n1", "slow:n1:0", "slow:n1:fast", "lose:n1@soon",
                "lose:n1@-1"):
        with pytest.raises(ValueError):
            ag.inject(bad)
    assert not ag.nodes["n1"].lost and not ag.nodes["n1"].ecc_faults


# ---------------------------------------------------------------- job lifecycle

def test_place_runs_to_completion_stamped_start_plus_duration():
    async def go():
        ag, rec = agent()
        await ag.execute(cmd(place("j", "c1", duration=2)))
        await settle(ag)
        return rec

    rec = run(go())
    started, completed = rec.envs(JobStarted, JobCompleted)
    assert isinstance(started.payload, JobStarted) and isinstance(completed.payload, JobCompleted)
    assert completed.event_time_ms - started.event_time_ms == 2000
    assert started.payload.command_id == completed.payload.command_id == "c1"
    assert {t for t, *_ in rec.sent if _[1].kind.startswith("job.")} == {JOB_EVENTS.name}
    assert completed.seq > started.seq
    check_lifecycle_causes(rec)


def test_slow_node_scales_the_run_time():
    async def go():
        ag, rec = agent()
        ag.inject("slow:n1:3")
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await ag.execute(cmd(place("slow", "c1", duration=1)))
        await ag.execute(cmd(place("fast", "c2", node="n2",
                                   assignments=whole("GPU-n2-0", 428, 1, mig_uuid="MIG-n2-0-0"))))
        await settle(ag)
        return rec, loop.time() - t0

    rec, wall = run(go())
    times = {e.payload.job_id: [] for e in rec.envs(JobStarted)}
    for e in rec.envs(JobStarted, JobCompleted):
        times[e.payload.job_id].append(e.event_time_ms)
    assert times["slow"][1] - times["slow"][0] == 3000
    assert times["fast"][1] - times["fast"][0] == 1000
    assert wall >= 3.0 / SPEEDUP  # it really ran that long
    assert [p.job_id for p in rec.payloads(JobCompleted)] == ["fast", "slow"]


def test_duplicate_commands_run_once_and_a_running_job_is_not_placed_twice():
    async def go():
        ag, rec = agent()
        env = cmd(place("j", "c1", duration=1))
        for _ in range(3):
            await ag.execute(env)
        await ag.execute(cmd(place("j", "c1", duration=1)))  # the same command id in a new envelope
        await ag.execute(cmd(place("j", "c9", duration=1)))  # another placement of a job already running here
        await settle(ag)
        await ag.execute(env)  # redelivered after the job ended
        await asyncio.sleep(2 / SPEEDUP)
        return rec

    rec = run(go())
    assert [(type(p).__name__, p.command_id) for p in rec.payloads(JobStarted, JobCompleted)] == [
        ("JobStarted", "c1"), ("JobCompleted", "c1")]


def test_preempt_checkpoints_and_stops_then_resume_runs_only_the_rest():
    async def go():
        ag, rec = agent()
        await ag.execute(cmd(PreemptJob(command_id="p0", job_id="j", node="n1")))  # not running: nothing happens
        await ag.execute(cmd(place("j", "c1", duration=10)))
        await asyncio.sleep(1.5 / SPEEDUP)
        await ag.execute(cmd(PreemptJob(command_id="p1", job_id="j", node="n1")))
        await ag.execute(cmd(PreemptJob(command_id="p2", job_id="j", node="n1")))  # already stopped
        await asyncio.sleep(11 / SPEEDUP)  # the cancelled run must not complete
        stopped = rec.payloads(JobStopped)
        assert not rec.payloads(JobCompleted) and len(stopped) == 1
        await ag.execute(cmd(place("j", "c2", duration=10, resume_from=stopped[0].checkpoint)))
        await settle(ag)
        return rec

    rec = run(go())
    ck, st = rec.payloads(JobCheckpointed, JobStopped)
    assert isinstance(ck, JobCheckpointed) and isinstance(st, JobStopped)
    assert ck.command_id == st.command_id == "p1"
    assert 1500 <= st.progress_ms < 10000 and ck.progress_ms == st.progress_ms
    assert st.checkpoint == ck.checkpoint == f"ckpt:j:{st.progress_ms}"
    s1, s2 = rec.envs(JobStarted)
    (done,) = rec.envs(JobCompleted)
    assert (s2.payload.command_id, done.payload.command_id) == ("c2", "c2")
    assert done.event_time_ms - s2.event_time_ms == 10000 - st.progress_ms
    check_lifecycle_causes(rec)


def test_migrate_checkpoints_and_stops_on_the_node_it_leaves_fenced_by_attempt():
    """cmd.migrate (defragmentation) is carried out by the node the job leaves: checkpoint and stop, answered with
    the move's command id; a move naming an older attempt leaves the newer run alone; another node ignores it."""
    async def go():
        ag, rec = agent()
        await ag.execute(cmd(place("j", "c1", duration=10)))
        await asyncio.sleep(1.5 / SPEEDUP)
        await ag.execute(cmd(MigrateJob(command_id="m0", job_id="j", from_node="n9", to_node="n1", assignments=(),
                                        attempt=1)))  # not the node it leaves: not ours
        await ag.execute(cmd(MigrateJob(command_id="m1", job_id="j", from_node="n1", to_node="n2", assignments=(),
                                        attempt=1)))
        await asyncio.sleep(11 / SPEEDUP)
        return rec

    rec = run(go())
    assert not rec.payloads(JobCompleted)
    ck, st = rec.payloads(JobCheckpointed, JobStopped)
    assert ck.command_id == st.command_id == "m1" and st.checkpoint == f"ckpt:j:{st.progress_ms}"
    assert st.reason == "migrated"  # the job view counts a move, not a preemption


def test_release_and_resize():
    async def go():
        ag, rec = agent()
        await ag.execute(cmd(place("j", "c1", duration=None)))
        await ag.execute(cmd(ResizeJob(command_id="r1", job_id="j", node="n1",
                                       assignments=whole("GPU-n1-1", 250, 2048))))
        await ag.publish_telemetry()
        await ag.execute(cmd(ReleaseJob(command_id="r2", job_id="j", node="n1")))
        await ag.execute(cmd(ReleaseJob(command_id="r3", job_id="nope", node="n1")))
        await ag.publish_telemetry()
        return ag, rec

    ag, rec = run(go())
    t1, t2 = rec.telemetry("n1")
    assert {s.gpu_uuid: s.job_ids for s in t1.payload.samples} == {"GPU-n1-0": (), "GPU-n1-1": ("j",)}
    assert all(s.job_ids == () for s in t2.payload.samples)
    assert not ag.nodes["n1"].running and not rec.payloads(JobCompleted, JobStopped)


def test_periodic_checkpoints_every_interval():
    async def go():
        ag, rec = agent()
        ag.inject("slow:n2:2")
        await ag.execute(cmd(place("j", "c1", duration=5, checkpoint_interval_s=1)))
        await ag.execute(cmd(place("r", "c2", duration=5, checkpoint_interval_s=1, resume_from="ckpt:r:2500",
                                   card="GPU-n1-1")))
        await ag.execute(cmd(place("s", "c3", node="n2", duration=3, checkpoint_interval_s=1,
                                   assignments=whole("GPU-n2-0", 428, 1, mig_uuid="MIG-n2-0-0"))))
        await ag.execute(cmd(place("none", "c4", node="n2", duration=1,
                                   assignments=whole("GPU-n2-0", 285, 1, mig_uuid="MIG-n2-0-1"))))
        await settle(ag)
        return rec

    rec = run(go())
    start = {e.payload.job_id: e.event_time_ms for e in rec.envs(JobStarted)}

    def marks(job):
        return [(e.event_time_ms - start[job], e.payload.progress_ms, e.payload.checkpoint, e.payload.command_id)
                for e in rec.envs(JobCheckpointed) if e.payload.job_id == job]

    assert marks("j") == [(1000 * k, 1000 * k, f"ckpt:j:{1000 * k}", "c1") for k in (1, 2, 3, 4)]
    assert marks("r") == [(1000, 3500, "ckpt:r:3500", "c2"), (2000, 4500, "ckpt:r:4500", "c2")]
    assert marks("s") == [(2000, 1000, "ckpt:s:1000", "c3"), (4000, 2000, "ckpt:s:2000", "c3")]  # slow node
    assert marks("none") == []
    done = {e.payload.job_id: e.event_time_ms - start[e.payload.job_id] for e in rec.envs(JobCompleted)}
    assert done == {"j": 5000, "r": 2500, "s": 6000, "none": 2000}  # n2 runs at half speed
    check_lifecycle_causes(rec)


# ---------------------------------------------------------------- faults over time

def test_timed_fault_applies_only_after_its_delay(tmp_path):
    """On the loop's virtual time (tests/virtual_clock.py): the agent's delays are measured on its loop's clock, so
    "not at 0.05 s, applied by 0.45 s" is a statement about that clock, not a wall-clock window a loaded machine can
    miss (it did: the 0.05 s sleep woke after the faults' 0.2 s)."""
    async def go():
        ag, rec = agent(speedup=1.0, telemetry_interval_s=0.01, faults=["ecc:n1:0@0.2"])
        ag.inject("slow:n2:4@0.3")
        task = asyncio.create_task(ag.run(consume_commands=False))
        await asyncio.sleep(0.05)
        assert asyncio.get_running_loop().time() - ag.started_mono < 0.2  # the virtual clock: exactly 0.05 s on
        assert ag.nodes["n2"].slow_factor == 1.0 and not ag.nodes["n1"].ecc_faults
        await asyncio.sleep(0.4)
        ag.stopping.set()
        await task
        return ag, rec

    ag, rec = run_virtual(go(), 20)
    assert ag.nodes["n2"].slow_factor == 4.0
    t0 = ag.started_mono
    flagged = [(at - t0, any(s.ecc_uncorrected for s in e.payload.samples))
               for _, _, e, at in rec.sent if e.kind == "gpu.telemetry" and e.payload.node == "n1"]
    assert any(not f for _, f in flagged) and any(f for _, f in flagged)
    assert all(dt >= 0.2 for dt, f in flagged if f)  # never before its time
    first = next(i for i, (_, f) in enumerate(flagged) if f)
    assert all(f for _, f in flagged[first:])  # and from then on
    assert [p.node for p in rec.payloads(NodeInventory)] == ["n1", "n2"]  # run() starts with the inventories
    assert rec.flushes > 0


def test_from_spec_schedules_the_fleet_files_faults(tmp_path):
    spec = tmp_path / "fleet.yaml"
    spec.write_text("nodes:\n  - {prefix: node, count: 2, model: A100-80GB, gpus: 2}\n"
                    "faults:\n  - {at: 10, fault: \"ecc:node-1:0\"}\n  - {at: 0.5, fault: \"lose:node-0\"}\n")
    ag = SimFleetAgent.from_spec(None, str(spec), telemetry_interval_s=0.5, faults=["slow:node-1:2@1"])
    assert sorted(ag.nodes) == ["node-0", "node-1"] and ag.interval == 0.5
    assert [str(f) for f in ag.timed_faults] == ["ecc:node-1:0@10", "lose:node-0@0.5", "slow:node-1:2@1"]
    assert not ag.nodes["node-0"].lost  # nothing applied before the agent runs
    with pytest.raises(ValueError, match="no node 'node-7'"):
        spec.write_text("nodes:\n  - {name: a, model: T4, gpus: 1}\nfaults:\n  - {at: 1, fault: \"lose:node-7\"}\n")
        SimFleetAgent.from_spec(None, str(spec))


def test_restart_stops_running_jobs_at_their_last_checkpoint_and_republishes_the_inventory():
    async def go():
        ag, rec = agent()
        await ag.execute(cmd(place("a", "c1", duration=2)))
        await ag.execute(cmd(place("b", "c2", card="GPU-n1-1", duration=None, checkpoint_interval_s=1)))
        await ag.execute(cmd(place("m", "c3", node="n2", duration=2,
                                   assignments=whole("GPU-n2-0", 428, 1, mig_uuid="MIG-n2-0-0"))))
        await asyncio.sleep(1.5 / SPEEDUP)  # b has checkpointed once (at 1 s)
        await ag.apply("restart:n1")
        await ag.publish_telemetry()
        await asyncio.sleep(3 / SPEEDUP)  # past a's duration: it must not complete any more
        await settle(ag)
        return ag, rec

    ag, rec = run(go())
    assert rec.envs(JobFailed) == []
    stopped = rec.envs(JobStopped)
    # lost with the agent: reported stopped at the last checkpoint (the scheduler requeues them from there), with the
    # placement's command id (no command asked for the stop)
    assert [(e.payload.job_id, e.payload.node, e.payload.reason, e.payload.command_id, e.payload.checkpoint)
            for e in stopped] == [("a", "n1", "agent restarted", "c1", ""),
                                  ("b", "n1", "agent restarted", "c2", "ckpt:b:1000")]
    (inv,) = rec.envs(NodeInventory)
    assert inv.payload == ag.nodes["n1"].inventory and inv.source == "n1/inventory"
    assert inv.event_time_ms >= stopped[-1].event_time_ms
    assert [p.job_id for p in rec.payloads(JobCompleted)] == ["m"]  # the other node's job is untouched
    (tel,) = rec.telemetry("n1")
    assert all(s.job_ids == () for s in tel.payload.samples)
    check_lifecycle_causes(rec)


def test_a_superseded_attempt_is_never_run_and_a_stop_of_an_old_attempt_spares_the_new_run():
    async def go():
        ag, rec = agent()
        await ag.execute(cmd(place("j", "c1", duration=None, attempt=1)))
        # the node was lost: the release of attempt 1 (sent then) arrives, then attempt 2 is placed here again
        await ag.execute(cmd(ReleaseJob(command_id="c2", job_id="j", node="n1", attempt=1)))
        assert "j" not in ag.nodes["n1"].running
        await ag.execute(cmd(place("j", "c3", duration=None, attempt=2)))
        assert ag.nodes["n1"].running["j"].attempt == 2
        # a late or redelivered placement of attempt 1 is refused; a late stop of attempt 1 leaves attempt 2 alone
        await ag.execute(cmd(place("j", "c4", duration=None, attempt=1)))
        await ag.execute(cmd(PreemptJob(command_id="c5", job_id="j", node="n1", attempt=1)))
        await ag.execute(cmd(ReleaseJob(command_id="c6", job_id="j", node="n1", attempt=1)))
        await ag.execute(cmd(ResizeJob(command_id="c7", job_id="j", node="n1", attempt=1,
                                       assignments=whole("GPU-n1-0", 300))))
        run2 = ag.nodes["n1"].running["j"]
        assert (run2.attempt, run2.command_id, run2.assignments[0].milli) == (2, "c3", 1000)
        # a placement of attempt 3 while attempt 2 still runs (its release never came): 3 replaces 2, once
        await ag.execute(cmd(place("j", "c8", duration=None, attempt=3)))
        assert ag.nodes["n1"].running["j"].command_id == "c8"
        # the release of attempt 3 ends it; a placement of 3 after it does not start
        await ag.execute(cmd(ReleaseJob(command_id="c9", job_id="j", node="n1", attempt=3)))
        await ag.execute(cmd(place("j", "c10", duration=None, attempt=3)))
        assert "j" not in ag.nodes["n1"].running
        await stop(ag)
        return rec

    rec = run(go())
    assert [p.command_id for p in rec.payloads(JobStarted)] == ["c1", "c3", "c8"]
    assert rec.payloads(JobStopped) == []  # the stale preemption stopped nothing, so it reports nothing


def test_shutdown_checkpoints_and_reports_every_running_job_stopped():
    async def go():
        ag, rec = agent(speedup=1.0, telemetry_interval_s=0.05)
        task = asyncio.create_task(ag.run(consume_commands=False))
        await asyncio.sleep(0.05)
        await ag.execute(cmd(place("j", "c1", duration=None)))
        await asyncio.sleep(0.1)
        ag.stopping.set()
        await task
        return ag, rec

    ag, rec = run(go())
    (stopped,) = rec.payloads(JobStopped)
    (ckpt,) = rec.payloads(JobCheckpointed)
    assert (stopped.job_id, stopped.command_id, stopped.reason) == ("j", "c1", "agent shutdown")
    assert stopped.checkpoint == ckpt.checkpoint == f"ckpt:j:{stopped.progress_ms}" and stopped.progress_ms >= 100
    assert not ag.nodes["n1"].running
    check_lifecycle_causes(rec)


def test_mig_reconfigure_updates_and_republishes_the_inventory():
    layout = (MigInstance(uuid="MIG-new-0", profile="4g.40gb", start=0, size=4),
              MigInstance(uuid="MIG-new-1", profile="3g.40gb", start=4, size=4))

    async def go():
        ag, rec = agent()
        env = cmd(MigReconfigure(command_id="mr1", node="n1", gpu_uuid="GPU-n1-1", layout=layout))
        await ag.execute(env)
        await ag.execute(env)  # once per command id
        await ag.publish_telemetry()
        return ag, rec

    ag, rec = run(go())
    (inv,) = rec.envs(NodeInventory)
    assert inv.causation_id == "mr1" and [t for t, *_ in rec.sent if _[1].kind == "node.inventory"] == [INVENTORY.name]
    card0, card1 = inv.payload.gpus
    assert card1.mig_enabled and card1.mig_layout == layout
    assert not card0.mig_enabled and card0.mig_layout == ()
    assert ag.nodes["n1"].inventory == inv.payload
    (tel,) = rec.telemetry("n1")
    assert [(s.gpu_uuid, s.mig_uuid, s.mem_total_mib) for s in tel.payload.samples] == [
        ("GPU-n1-0", None, 80 * 1024), ("GPU-n1-1", "MIG-new-0", 40 * 1024), ("GPU-n1-1", "MIG-new-1", 40 * 1024)]


def test_commands_for_other_nodes_are_ignored():
    async def go():
        ag, rec = agent()
        await ag.execute(cmd(place("x", "c1", node="elsewhere")))
        return rec

    rec = run(go())
    assert rec.sent == []


def test_faults_from_the_control_file_are_applied_while_the_agent_runs(tmp_path):
    """`gpupool agent inject` appends to the control file; the running agent applies each new line: a job's failure
    here, and a bad line is skipped without stopping the fleet."""
    import asyncio

    from agents.node.sim_agent import SimFleetAgent
    from infra.config import Config
    from schemas.envelope import decode, envelope
    from schemas.events import Assignment, PlaceJob

    class Producer:
        def __init__(self):
            self.sent = []

        async def send(self, topic, key=None, value=None):
            self.sent.append(decode(value))

        async def flush(self):
            pass

    fleet = tmp_path / "fleet.yaml"
    fleet.write_text("nodes:\n  - {name: n1, model: A100-80GB, gpus: 2}\n")
    control = tmp_path / "faults"
    control.write_text("")
    cfg = Config(home=tmp_path, kafka="unused:1", clickhouse="", kafka_port=0, web_port=0)

    async def go():
        agent = SimFleetAgent.from_spec(cfg, str(fleet), producer=Producer(), control=control,
                                        telemetry_interval_s=0.1)
        task = asyncio.create_task(agent.run(consume_commands=False))
        await asyncio.sleep(0.3)
        for i in range(2):
            await agent.execute(envelope(PlaceJob(
                command_id=f"c{i}", job_id=f"t/j{i}", tenant="t", node="n1", attempt=1, duration_s=100,
                assignments=(Assignment(gpu_uuid=f"GPU-n1-{i}", milli=1000, memory_mib=1000),)),
                source="scheduler", seq=i + 1, time_ms=1))
        control.write_text("fail:t/j0\nnonsense:x\n")
        while not any(e.kind == "job.failed" for e in agent.producer.sent):  # the control file is read every
            await asyncio.sleep(0.05)  # 0.5 s: waited on, not on a wall-clock window (go() has a deadline)
        running = sorted(agent.nodes["n1"].running)
        agent.stopping.set()
        await task
        return agent.producer.sent, running

    sent, running = asyncio.run(asyncio.wait_for(go(), 60))
    failed = [e.payload for e in sent if e.kind == "job.failed"]
    assert [(f.job_id, f.reason) for f in failed] == [("t/j0", "simulated failure: exit status 1")]
    assert running == ["t/j1"]  # the other job on the node runs on
