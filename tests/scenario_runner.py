"""Declarative scheduler scenarios (Volcano/KAI style): a cluster and a script of events in YAML, the expected
commands out. Each `expect` lists (a subset of fields of) the envelopes the previous step must emit, in order;
`expect: []` asserts the step emitted nothing (a converged state stays converged).

`scheduler: elastic` (with an optional `elastic:` mapping of ElasticConfig fields) runs the scenario on the
ElasticScheduler and enables the steps `declare` (ServiceDeclared fields; tenant defaults to t1), `load`
(InferenceLoad fields) and `remove_service`.

A scenario describes an open pool unless it says otherwise: tenants without a quota are unlimited
(`default_quota: null`); `default_quota: N` gives them N milli-CU (0: the product's default, nothing runs without a
quota). `usage_tick_ms` sets the scheduler's usage tick (default: the product's, 60 s); `preemption:` sets
PreemptionConfig fields (e.g. `migrations_per_hour`, the defragmentation budget); `grace_s:` the grace period of each
tier's stops (tier -> seconds).

Lifecycle steps: `node_down: NODE` or `{node, heartbeat_ago_ms}` (node.liveness alive=false, last heartbeat that long
ago), `node_up: NODE` (the node reports its inventory again), `drain`, `uncordon`, `remove`, `readd` (node.removed),
`fail: JOB` (`complete: JOB` completes every part of its run), `quota: {tenant, project?, compute}`, and `stale:
{job, attempt, report: started|checkpointed|completed}` (a report from an earlier run of the job: the command of its
`attempt`-th placement).

`log_time: true` steps every input at its log time (the scenario clock, as the broker stamps it) and lets a step say
`skew_ms: N`: its producer's clock is N ms off (the event time it claims), which must not move the scheduler."""
from __future__ import annotations

from pathlib import Path

import yaml

from agents.node.fleet import make_node
from agents.scheduler.core import ElasticScheduler, Scheduler
from agents.scheduler.elastic import ElasticConfig
from agents.scheduler.preemption import PreemptionConfig
from agents.scheduler.quota import Ledger
from schemas.events import (
    Constraints, GpuHealth, ReservationCancelled, ReservationRequested, JobCancelled, JobCheckpointed, JobCompleted,
    JobFailed, JobStarted, JobStopped, NodeCordon, NodeLiveness, NodeRemoved, QuotaSet, SchedulerTick,
)
from schemas.events import InferenceLoad, ServiceDeclared, ServiceRemoved
from tests.builders import Clock, job


def _match(env, want: dict) -> bool:
    p = env.payload
    for key, value in want.items():
        if key == "kind":
            got = p.kind
        elif key == "reason":
            got = value if any(r.code == value for r in getattr(p, "reasons", ())) else None
        elif key == "expected_free":  # the node the ExpectedFree reason points at
            got = next((r.nodes[0] for r in getattr(p, "reasons", ()) if r.code == "ExpectedFree"), None)
        elif key == "cards":
            got = len(p.assignments)
        elif key == "milli":
            got = [a.milli for a in p.assignments]
        elif key == "mig":
            got = p.assignments[0].mig_profile
        elif key == "isolation":  # what the Placed reason says was given
            got = next((r.data.get("isolation") for r in getattr(p, "reasons", ()) if r.code == "Placed"), None)
        else:
            got = getattr(p, key, None)
            got = got.value if hasattr(got, "value") else got
            got = list(got) if isinstance(got, tuple) else got
        if got != value:
            return False
    return True


def run(path: Path) -> None:
    doc = yaml.safe_load(path.read_text())
    clock = Clock()
    kw = dict(ledger=Ledger(default_quota_milli=doc.get("default_quota")),
              usage_tick_ms=doc.get("usage_tick_ms", Scheduler.usage_tick_ms))
    if "preemption" in doc:  # PreemptionConfig fields (e.g. migrations_per_hour)
        kw["preemption"] = PreemptionConfig(**doc["preemption"])
    if "grace_s" in doc:  # tier -> the grace period its stops wait (docs/jobs.md, "Stops and grace periods")
        kw["grace_s"] = doc["grace_s"]
    s = ElasticScheduler(ElasticConfig(**doc.get("elastic", {})), **kw) if doc.get("scheduler") == "elastic" \
        else Scheduler(**kw)
    placed: dict[str, object] = {}
    attempts: dict[tuple[str, int], object] = {}  # (job, attempt) -> the first part's cmd.place
    parts_of: dict[str, list] = {}  # job -> every part of its latest placement (a gang completes with all of them)
    sent: list = []
    last: list = []
    for n in doc.get("nodes", []):
        inv = make_node(n["name"], n["model"], n["gpus"], cpu_milli=n.get("cpu_milli", 64000),
                        memory_mib=n.get("memory_mib", 256 * 1024), rack=n.get("rack", "rack-0"), mig=n.get("mig"),
                        driver=n.get("driver", "550.54.15"), datacenter=n.get("datacenter", "dc-0"))
        s.step(clock.env(inv, f"{inv.node}/inventory"))
    for q in doc.get("quotas", []):
        s.step(clock.env(QuotaSet(tenant=q["tenant"], project=q.get("project"), gpu_milli=q["compute"],
                                  gpu_memory_mib=q["mem_gib"] * 1024 if "mem_gib" in q else None,
                                  overcommit_pct=q.get("overcommit_pct", 120)), "operator"))
    step = s.step
    if doc.get("log_time"):
        # the scheduler's clock is the log's (each input at the scenario clock, its append time), whatever a step's
        # `skew_ms` says the producer's clock was
        skew = {"ms": 0}

        def step(env):
            log_ms = env.event_time_ms
            if skew["ms"]:
                env = env.model_copy(update={"event_time_ms": env.event_time_ms + skew["ms"]})
            return s.step(env, log_ms)
    for i, st in enumerate(doc["steps"]):
        st = dict(st)
        dt = st.pop("after", 0)
        if doc.get("log_time"):
            skew["ms"] = st.pop("skew_ms", 0)
        ((op, arg),) = st.items()
        if op == "expect_none":  # none of the previous step's envelopes matches any of these
            for w in arg:
                hit = [e.payload for e in last if _match(e, w)]
                assert not hit, f"{path.name} step {i}: {w} unexpected in {hit}"
            continue
        if op == "expect":
            want = arg or []
            assert len(last) >= len(want) if want else not last, \
                f"{path.name} step {i}: expected {want}, got {[e.payload for e in last]}"
            pos = 0
            for w in want:
                while pos < len(last) and not _match(last[pos], w):
                    pos += 1
                assert pos < len(last), f"{path.name} step {i}: {w} not in {[e.payload for e in last]}"
                pos += 1
            continue
        if op == "submit":
            a = dict(arg)
            cons = Constraints(**a.pop("constraints", {}))
            req = job(a.pop("job_id"), a.pop("tenant", "t1"), a.pop("compute"), a.pop("mem_gib"),
                      constraints=cons, **a)
            last = step(clock.env(req, f"cli/{req.job_id}"))
        elif op in ("start", "complete", "stop", "fail"):
            cmd = placed[arg].payload
            src = f"{cmd.node}/job/{arg}"
            ev = {"start": JobStarted, "complete": JobCompleted}.get(op)
            if op == "complete":  # every part of the run exits 0: a gang completes with its last part (docs/jobs.md)
                last = []
                for i, part in enumerate(parts_of.get(arg, [cmd])):
                    last += step(clock.env(JobCompleted(job_id=arg, node=part.node, command_id=part.command_id,
                                                        attempt=part.attempt, part=part.gang_index,
                                                        parts=part.gang_size), f"{part.node}/job/{arg}",
                                           dt=dt if i == 0 else 0))
            elif ev:
                last = step(clock.env(ev(job_id=arg, node=cmd.node, command_id=cmd.command_id), src, dt=dt))
            elif op == "fail":
                last = step(clock.env(JobFailed(job_id=arg, node=cmd.node, command_id=cmd.command_id,
                                                  reason="exit code 1"), src, dt=dt))
            else:
                last = step(clock.env(JobStopped(job_id=arg, node=cmd.node, command_id=cmd.command_id,
                                                   checkpoint=f"ckpt:{arg}:1000"), src, dt=dt))
        elif op == "checkpoint":
            cmd = placed[arg].payload
            last = step(clock.env(JobCheckpointed(job_id=arg, node=cmd.node, progress_ms=1000,
                                                    checkpoint=f"ckpt:{arg}:1000"), f"{cmd.node}/job/{arg}", dt=dt))
        elif op == "cancel":
            last = step(clock.env(JobCancelled(job_id=arg), f"cli/{arg}", dt=dt))
        elif op == "declare":
            last = step(clock.env(ServiceDeclared(**{"tenant": "t1", **arg}), f"cli/service/{arg['service_id']}"))
        elif op == "load":
            last = step(clock.env(InferenceLoad(**arg), f"load/{arg['service_id']}", dt=dt))
        elif op == "remove_service":
            last = step(clock.env(ServiceRemoved(service_id=arg), f"cli/service/{arg}"))
        elif op == "tick":
            last = step(clock.env(SchedulerTick(now_ms=clock.now + arg), "ticker", dt=arg))
        elif op == "reserve":
            a = dict(arg)
            last = step(clock.env(ReservationRequested(
                reservation_id=a["reservation_id"], tenant=a.get("tenant", "t1"), tier=a.get("tier", "online-training"),
                compute_milli=a["compute"], gpu_memory_mib=a["mem_gib"] * 1024,
                start_ms=clock.now + a["start_s"] * 1000, end_ms=clock.now + a["end_s"] * 1000), "cli/reserve", dt=dt))
        elif op == "cancel_reservation":
            last = step(clock.env(ReservationCancelled(reservation_id=arg), "cli/reserve", dt=dt))
        elif op == "mig_done":
            # the node agent applied the last MIG reconfigure sent to this node and reports its inventory again
            cmd = next(e.payload for e in reversed(sent) if e.payload.kind == "cmd.mig_reconfigure"
                       and e.payload.node == arg)
            inv = s.nodes[arg].inventory
            gpus = tuple(g.model_copy(update={"mig_layout": cmd.layout, "mig_enabled": True})
                         if g.uuid == cmd.gpu_uuid else g for g in inv.gpus)
            last = step(clock.env(inv.model_copy(update={"gpus": gpus}), f"{arg}/inventory", dt=dt or 1))
        elif op == "cordon":
            last = step(clock.env(NodeCordon(node=arg), "operator", dt=dt))
        elif op == "drain":
            last = step(clock.env(NodeCordon(node=arg, drain=True, reason="maintenance"), "operator", dt=dt))
        elif op == "uncordon":
            last = step(clock.env(NodeCordon(node=arg, cordoned=False), "operator", dt=dt))
        elif op in ("remove", "readd"):
            last = step(clock.env(NodeRemoved(node=arg, removed=op == "remove"), "operator", dt=dt))
        elif op == "node_down":
            a = arg if isinstance(arg, dict) else {"node": arg}
            clock.now += dt
            last = step(clock.env(NodeLiveness(node=a["node"], alive=False,
                                                 last_heartbeat_ms=clock.now - a.get("heartbeat_ago_ms", 0)),
                                    f"{a['node']}/liveness"))
        elif op == "node_up":
            last = step(clock.env(s.nodes[arg].inventory, f"{arg}/inventory", dt=dt or 1))
        elif op == "quota":
            last = step(clock.env(QuotaSet(tenant=arg["tenant"], project=arg.get("project"),
                                             gpu_milli=arg["compute"]), "operator", dt=dt))
        elif op == "stale":
            cmd = attempts[(arg["job"], arg["attempt"])].payload
            kind = {"started": JobStarted, "completed": JobCompleted}.get(arg["report"])
            src = f"{cmd.node}/job/{arg['job']}"
            if kind is not None:
                rep = kind(job_id=arg["job"], node=cmd.node, command_id=cmd.command_id)
            else:
                rep = JobCheckpointed(job_id=arg["job"], node=cmd.node, progress_ms=2000, command_id=cmd.command_id,
                                      checkpoint=f"ckpt:{arg['job']}:2000")
            last = step(clock.env(rep, src, dt=dt))
        elif op == "gpu_fault":
            node, idx = arg.split(":")
            uuid = s.nodes[node].inventory.gpus[int(idx)].uuid
            last = step(clock.env(GpuHealth(node=node, gpu_uuid=uuid, healthy=False, reason="ecc"), f"{node}/health",
                                    dt=dt))
        else:
            raise ValueError(f"unknown step {op}")
        sent.extend(last)
        for e in last:
            if e.payload.kind == "cmd.place":
                if e.payload.gang_index == 0:
                    parts_of[e.payload.job_id] = []
                parts_of.setdefault(e.payload.job_id, []).append(e.payload)
            if e.payload.kind == "cmd.place" and e.payload.gang_index == 0:
                placed[e.payload.job_id] = e
                attempts[(e.payload.job_id, e.payload.attempt)] = e


def scenario_files() -> list[Path]:
    return sorted((Path(__file__).parent / "scenarios").glob("*.yaml"))
