"""Every job's whole life through failures (issue #13), beyond the scenarios in tests/scenarios/: a stack stopped and
started again bills from the log what ran in between, once; an agent's own stop is an interruption, not a
preemption; the quota and the bill count the same holding; the elastic layer says once that a replica can never be
placed instead of asking again and again."""
from __future__ import annotations

from agents.scheduler.core import Scheduler, replay
from agents.scheduler.core import ElasticScheduler
from agents.scheduler.elastic import ElasticConfig
from agents.scheduler.quota import Ledger, held, open_ledger
from schemas.events import (
    InferenceLoad, JobCompleted, JobStarted, JobStopped, QuotaSet, SchedulerTick, ServiceDeclared,
)
from tests.builders import Clock, inventory, job


def _feed(s, log, env):
    log.append(env)
    return s.step(env)


def test_a_stack_stopped_and_started_again_bills_what_ran_in_between_once():
    c = Clock(start=0)
    log: list = []
    s = Scheduler()
    out: list = []
    out += _feed(s, log, c.env(inventory("n1", gpus=2), "n1/inventory"))
    out += _feed(s, log, c.env(QuotaSet(tenant="t1", gpu_milli=4000), "operator"))
    out += _feed(s, log, c.env(job("j", compute=1000, mem_gib=70, duration=None), "cli/j"))
    place = next(e.payload for e in out if e.kind == "cmd.place")
    out += _feed(s, log, c.env(JobStarted(job_id="j", node="n1", command_id=place.command_id), "n1/job/j", dt=1000))
    for _ in range(3):  # the ticker: 90 s of log time, one usage tick at 60 s
        out += _feed(s, log, c.env(SchedulerTick(now_ms=c.now + 30_000), "ticker", dt=30_000))
    billed = [e.payload for e in out if e.kind == "usage.accrued"]
    assert [(u.start_ms, u.end_ms) for u in billed] == [(1000, 61_000)]  # running work is on the bill already
    # `gpupool down`: the agent checkpoints the job and reports it stopped (agents/node/sim_agent.py), then
    # everything stops; the stopped record is in the log when the stack comes back
    stop = _feed(s, log, c.env(JobStopped(job_id="j", node="n1", command_id=place.command_id, progress_ms=95_000,
                                          checkpoint="ckpt:j:95000", reason="agent shutdown"), "n1/job/j", dt=5000))
    out += stop
    # requeued and placed again at once: the command waits in the log for the agent to come back
    resumed = next(e.payload for e in stop if e.kind == "cmd.place")
    assert resumed.resume_from == "ckpt:j:95000" and resumed.attempt == 2
    # `gpupool up`: a new scheduler rebuilds its state from the input log and goes on
    again, replayed = replay(log)
    assert [e.model_dump() for e in replayed] == [e.model_dump() for e in out]  # the same events, the same ids
    later: list = []
    later += _feed(again, log, c.env(inventory("n1", gpus=2), "n1/inventory", dt=600_000))  # the agent is back
    assert [e for e in later if e.kind != "job.pending"] == []
    later += _feed(again, log, c.env(JobStarted(job_id="j", node="n1", command_id=resumed.command_id), "n1/job/j",
                                     dt=1000))
    rec = again.jobs["j"]  # the record while it is live (once done it gives way to a compact one)
    later += _feed(again, log, c.env(JobCompleted(job_id="j", node="n1", command_id=resumed.command_id), "n1/job/j",
                                     dt=20_000))
    usage = [e for e in out + later if e.kind == "usage.accrued"]
    assert len({e.event_id for e in usage}) == len(usage)  # nothing billed twice
    spans = [(u.payload.attempt, u.payload.start_ms, u.payload.end_ms) for u in usage]
    # the first run to its stop at 96,000 (not to the restart: the down time is not billed), then the second
    assert spans == [(1, 1000, 61_000), (1, 61_000, 96_000), (2, 697_000, 717_000)]
    assert sum(u.payload.gpu_milli_ms for u in usage) == 1000 * (95_000 + 20_000)
    assert again.phase_of("j") == rec.phase == "done" and "j" not in again.jobs
    assert rec.preemptions == 0 and rec.interruptions == 1  # a stop of its own


def test_an_agents_own_stop_is_an_interruption_resumed_first_not_a_preemption():
    c = Clock(start=0)
    s = Scheduler(ledger=open_ledger())
    s.step(c.env(inventory("n1", gpus=1), "n1/inventory"))
    s.step(c.env(inventory("n2", gpus=1), "n2/inventory"))
    (p,) = [e.payload for e in s.step(c.env(job("a", compute=1000, mem_gib=70), "cli/a")) if e.kind == "cmd.place"]
    s.step(c.env(job("b", compute=1000, mem_gib=70), "cli/b"))
    s.step(c.env(job("w", compute=1000, mem_gib=70), "cli/w"))  # waits
    s.step(c.env(JobStarted(job_id="a", node=p.node, command_id=p.command_id), f"{p.node}/job/a"))
    # a's agent restarts: a is reported stopped of the agent's own accord (no cmd.preempt asked for it); it is
    # queued before newer work of its tier and gets its card back, w waits on (drain_empties_node.yaml shows an
    # interrupted job going even before work that arrived before it)
    out = s.step(c.env(JobStopped(job_id="a", node=p.node, command_id=p.command_id, reason="agent restarted"),
                       f"{p.node}/job/a", dt=10))
    assert [e.payload.job_id for e in out if e.kind == "cmd.place"] == ["a"]
    assert [r.request.job_id for r in s.pending_order()] == ["w"]
    assert s.jobs["a"].interruptions == 1 and s.jobs["a"].preemptions == 0


def test_quota_is_charged_what_is_held_and_the_bill_carries_it():
    models = {"GPU-h": "H100-80GB", "GPU-a": "A100-80GB", "GPU-m": "A100-80GB"}.__getitem__
    from schemas.events import Assignment
    share = (Assignment(gpu_uuid="GPU-h", milli=316, memory_mib=10 * 1024),)
    whole = tuple(Assignment(gpu_uuid="GPU-h", milli=1000, memory_mib=75 * 1024) for _ in range(4))
    mig = (Assignment(gpu_uuid="GPU-m", milli=428, memory_mib=40 * 1024, mig_profile="3g.40gb", mig_uuid="M"),)
    assert held(share, models) == (1002, 10 * 1024)  # without the ask: ceil(316 x 3,170 / 1,000)
    # with it: 316 milli-GPU is the least share that delivers 1,000 milli-CU (1,001.72): it holds what was asked, the
    # rounding dust is not charged; a share grown beyond the least one (a boost) holds the extra's CU on top
    assert held(share, models, 1000) == (1000, 10 * 1024)
    assert held(share, models, 1001) == (1001, 10 * 1024)  # 316 is also the least share for 1,001
    boosted = (Assignment(gpu_uuid="GPU-h", milli=316 + 79, memory_mib=10 * 1024),)
    assert held(boosted, models, 1000) == (1000 + 251, 10 * 1024)  # ceil(79 x 3.17) = 251
    shrunk = (Assignment(gpu_uuid="GPU-h", milli=300, memory_mib=10 * 1024),)
    assert held(shrunk, models, 1000) == (951, 10 * 1024)  # below the least share: its own CU, ceil(300 x 3.17)
    assert held(whole, models) == (4 * 3170, 4 * 80 * 1024)  # whole cards: their compute and all their memory
    assert held(mig, models) == (3 * 1000 // 7, 40 * 1024)
    # a request is never charged less than it asked for
    assert held((Assignment(gpu_uuid="GPU-a", milli=250, memory_mib=1),), models)[0] == 250


def test_a_project_quota_beyond_the_default_of_a_tenant_without_one_is_refused():
    ledger = Ledger()  # default 0
    why = ledger.set_quota(QuotaSet(tenant="acme", project="p", gpu_milli=1000))
    assert [r.code for r in why] == ["ProjectQuotasExceedTenant"]
    assert ledger.accounts.get(("acme", "p")) is None
    assert open_ledger().set_quota(QuotaSet(tenant="acme", project="p", gpu_milli=1000)) == ()  # unlimited tenant


def test_a_replica_that_can_never_be_placed_is_said_once_not_requested_again_and_again():
    c = Clock(start=0)
    s = ElasticScheduler(ElasticConfig(warm_pool=0), ledger=open_ledger())
    s.step(c.env(inventory("n1", model="T4", gpus=1), "n1/inventory"))
    s.step(c.env(SchedulerTick(now_ms=20_000), "ticker", dt=20_000))  # the fleet has settled
    out = s.step(c.env(ServiceDeclared(service_id="big", tenant="t1", replica_compute_milli=2000,
                                       replica_memory_mib=40 * 1024, replica_qps=10), "cli/service/big"))
    (scaled,) = [e.payload for e in out if e.kind == "service.scaled"]
    assert scaled.jobs == () and [r.code for r in scaled.reasons][-1] == "Unsatisfiable"
    assert not [e for e in out if e.kind == "job.requested"]
    for _ in range(3):
        quiet = s.step(c.env(InferenceLoad(service_id="big", qps=50, p99_ms=900, queue_depth=5), "load/big",
                             dt=10_000))
        quiet += s.step(c.env(SchedulerTick(now_ms=c.now), "ticker"))
        assert [e for e in quiet if e.kind in ("job.requested", "job.rejected", "service.scaled")] == []


def test_a_replica_on_a_lost_node_is_requeued_and_placed_elsewhere():
    from schemas.events import NodeLiveness

    c = Clock(start=0)
    s = ElasticScheduler(ElasticConfig(warm_pool=0), ledger=open_ledger())
    s.step(c.env(inventory("n1", gpus=1), "n1/inventory"))
    s.step(c.env(inventory("n2", gpus=1), "n2/inventory"))
    out = s.step(c.env(ServiceDeclared(service_id="chat", tenant="t1", replica_compute_milli=300,
                                       replica_memory_mib=10 * 1024, replica_qps=10), "cli/service/chat"))
    (p,) = [e.payload for e in out if e.kind == "cmd.place"]
    s.step(c.env(JobStarted(job_id=p.job_id, node=p.node, command_id=p.command_id), f"{p.node}/job/{p.job_id}"))
    out = s.step(c.env(NodeLiveness(node=p.node, alive=False, last_heartbeat_ms=c.now + 500), f"{p.node}/liveness",
                       dt=3000))
    assert [e.payload.code for e in out if e.kind == "job.interrupted"] == ["NodeLost"]
    (again,) = [e.payload for e in out if e.kind == "cmd.place"]
    assert again.job_id == p.job_id and again.node != p.node and again.attempt == 2
    assert s.autoscaler.services["chat"].serving() == [p.job_id]  # still the service's replica, starting again
    assert s.h.train_milli == 0 and s.h.train_held == {}  # an inference replica is not training's share
