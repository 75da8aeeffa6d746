"""Small builders for tests: envelopes with explicit sources, sequence numbers and times."""
from __future__ import annotations

from agents.node.fleet import make_node
from agents.scheduler.quota import open_ledger  # noqa: F401  (re-exported for the tests)
from schemas.envelope import envelope
from schemas.events import JobCompleted, JobRequested, JobStarted, Tier


class Clock:
    def __init__(self, start: int = 1_000_000):
        self.now = start
        self.seqs: dict[str, int] = {}

    def env(self, payload, source: str, dt: int = 0):
        self.now += dt
        self.seqs[source] = self.seqs.get(source, 0) + 1
        return envelope(payload, source=source, seq=self.seqs[source], time_ms=self.now)


def inventory(name="n1", model="A100-80GB", gpus=4, **kw):
    return make_node(name, model, gpus, **kw)


def job(job_id="j1", tenant="t1", compute=500, mem_gib=10, tier=Tier.OFFLINE, duration=10, **kw):
    return JobRequested(job_id=job_id, tenant=tenant, compute_milli=compute, gpu_memory_mib=mem_gib * 1024,
                        tier=tier, duration_s=duration, **kw)


def run_to_completion(sched, clock, out_env, runtime_ms):
    """Act as the node agent for one placement: started now, completed `runtime_ms` later."""
    p = out_env.payload
    outs = sched.step(clock.env(JobStarted(job_id=p.job_id, node=p.node, command_id=p.command_id),
                                f"{p.node}/job/{p.job_id}"))
    outs += sched.step(clock.env(JobCompleted(job_id=p.job_id, node=p.node, command_id=p.command_id),
                                 f"{p.node}/job/{p.job_id}", dt=runtime_ms))
    return outs
