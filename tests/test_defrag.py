"""Defragmentation (agents/scheduler/defrag.py) moves a job only where it may resume: never onto a node its quiet
window bars it from (a node preemption freed for a claim at least as strong as its own, `Scheduler._barred`).
Seen while writing tests/test_digest_live.py: a reclaimed job was moved onto the node freed for its preemptor and,
once stopped for the move, waited `FreedForStronger` -- the move was a stop."""
from agents.scheduler.core import Scheduler
from schemas.events import JobCancelled, JobStarted, JobStopped, QuotaSet, Tier, Constraints
from tests.builders import Clock, inventory, job


def _placed(outs):
    return {o.payload.job_id: o.payload for o in outs if o.kind == "cmd.place"}


def test_a_move_never_takes_a_reclaimed_job_to_the_node_freed_for_its_preemptor():
    clock, s = Clock(), Scheduler()
    out = []

    def feed(payload, source, dt=10):
        got = s.step(clock.env(payload, source, dt=dt))
        out.extend(got)
        for o in got:
            if o.kind == "cmd.place":
                s.step(clock.env(JobStarted(job_id=o.payload.job_id, node=o.payload.node,
                                            command_id=o.payload.command_id), f"{o.payload.node}/job", dt=1))
        return got

    for n in ("n1", "n2"):
        feed(inventory(n, gpus=2), f"{n}/inventory")
    feed(QuotaSet(tenant="acme", gpu_milli=500, overcommit_pct=300), "operator")
    feed(QuotaSet(tenant="globex", gpu_milli=4000), "operator")
    feed(job("acme/o", tenant="acme", compute=1000, checkpoint_interval_s=1, duration=None), "cli/o")
    x = _placed(out)["acme/o"].node
    for g in ("g1", "g2", "g3"):
        feed(job(f"globex/{g}", tenant="globex", compute=1000, duration=None), f"cli/{g}")
    y = ({"n1", "n2"} - {x}).pop()
    beside = {p.job_id for p in _placed(out).values() if p.node == x} - {"acme/o"}
    others = sorted(j for j, p in _placed(out).items() if p.node == y)
    # globex, within its quota, asks for a card of the full pool: acme's borrowed job is reclaimed on x
    got = feed(job("globex/g4", tenant="globex", compute=1000, duration=None), "cli/g4")
    (stop,) = [o.payload for o in got if o.kind == "cmd.preempt"]
    assert stop.job_id == "acme/o" and stop.node == x
    feed(JobStopped(job_id="acme/o", node=x, command_id=stop.command_id, checkpoint="ckpt:o:1"), f"{x}/job")
    assert _placed(out)["globex/g4"].node == x
    # the card beside g4 frees: o may not take it (x was freed for a stronger claim, its quiet window runs)
    feed(JobCancelled(job_id=beside.pop()), "cli/cancel")
    assert s.jobs["acme/o"].phase == "pending"
    feed(JobCancelled(job_id=others[0]), "cli/cancel")  # a card on y frees: o resumes there
    assert _placed(out)["acme/o"].node == y
    feed(JobCancelled(job_id=others[1]), "cli/cancel")  # one free card on each node
    # a 2-card block for an online-training job: o is the only movable work, and x is barred to it
    n = len(out)
    feed(job("globex/g5", tenant="globex", compute=2000, tier=Tier.ONLINE_TRAINING, duration=None,
                   constraints=Constraints(max_spread="node")), "cli/g5")
    moves = [o.payload for o in out[n:] if o.kind == "cmd.migrate"]
    for m in moves:  # a move emitted resumes on its planned node once stopped
        feed(JobStopped(job_id=m.job_id, node=m.from_node, command_id=m.command_id, checkpoint="ckpt:o:2",
                        reason="migrated"), f"{m.from_node}/job")
        rec = s.jobs[m.job_id]
        assert rec.phase in ("placed", "running") and rec.placement.node == m.to_node, (m, rec.phase)
    assert not [m for m in moves if m.job_id == "acme/o" and m.to_node == x], moves
    # instead g5 takes its block by preemption (o is offline, g5 online training) and o waits, saying why
    assert [(o.payload.job_id, o.payload.node) for o in out[n:] if o.kind == "cmd.preempt"] == [("acme/o", y)]
    (stop,) = [o.payload for o in out[n:] if o.kind == "cmd.preempt"]
    m = len(out)
    feed(JobStopped(job_id="acme/o", node=y, command_id=stop.command_id, checkpoint="ckpt:o:3"), f"{y}/job")
    assert _placed(out[m:])["globex/g5"].node == y
    said = [o.payload for o in out[m:] if o.kind == "job.pending" and o.payload.job_id == "acme/o"]
    assert said and {r.code for r in said[-1].reasons} & {"FreedForStronger", "RecentlyPreempted"}, said
