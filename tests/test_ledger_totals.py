"""The ledger of a scripted scenario, borrowing and a reclaim preemption included, equals the hand-computed totals."""
from agents.scheduler.core import Scheduler
from schemas.events import JobCompleted, JobStarted, JobStopped, QuotaSet
from tests.builders import Clock, inventory, job


def test_ledger_totals_with_borrowing_and_preemption():
    c = Clock(start=0)
    s = Scheduler()
    out = []

    def at(t, payload, source):
        c.now = t
        c.seqs[source] = c.seqs.get(source, 0) + 1
        from schemas.envelope import envelope
        res = s.step(envelope(payload, source=source, seq=c.seqs[source], time_ms=t))
        out.extend(res)
        return res

    def cmd(job_id):
        return next(e.payload for e in reversed(out) if e.kind == "cmd.place" and e.payload.job_id == job_id)

    def agent(t, cls, job_id, **kw):
        p = cmd(job_id)
        return at(t, cls(job_id=job_id, node=p.node, command_id=p.command_id, **kw), f"{p.node}/job/{job_id}")

    at(0, inventory("n1", model="A100-80GB", gpus=2), "n1/inventory")
    at(0, QuotaSet(tenant="owner", gpu_milli=1000), "operator")
    at(0, QuotaSet(tenant="lender", gpu_milli=1000, overcommit_pct=200), "operator")
    at(1, job("own", tenant="lender", compute=1000, mem_gib=70, duration=5), "cli/own")
    agent(10, JobStarted, "own")
    at(15, job("extra", tenant="lender", compute=1000, mem_gib=70, duration=2), "cli/extra")
    assert cmd("extra").borrowed
    agent(20, JobStarted, "extra")
    preempts = at(1000, job("mine", tenant="owner", compute=1000, mem_gib=70, duration=3), "cli/mine")
    assert [e.payload.job_id for e in preempts if e.kind == "cmd.preempt"] == ["extra"]
    agent(1500, JobStopped, "extra", checkpoint="ckpt:extra:1480")      # borrowed: 1000 x 1480 ms
    assert not cmd("mine").borrowed and cmd("mine").node == "n1"
    agent(1510, JobStarted, "mine")
    agent(4510, JobCompleted, "mine")                                   # owner, own: 1000 x 3000 ms
    assert cmd("extra").resume_from == "ckpt:extra:1480" and cmd("extra").borrowed
    agent(4520, JobStarted, "extra")
    agent(5010, JobCompleted, "own")                                    # lender, own: 1000 x 5000 ms
    agent(6520, JobCompleted, "extra")                                  # borrowed: 1000 x 2000 ms

    usage = [e.payload for e in out if e.kind == "usage.accrued"]
    totals: dict[tuple[str, bool], int] = {}
    for u in usage:
        totals[(u.tenant, u.borrowed)] = totals.get((u.tenant, u.borrowed), 0) + u.gpu_milli_ms
    assert totals == {
        ("lender", False): 1000 * 5000,
        ("lender", True): 1000 * 1480 + 1000 * 2000,
        ("owner", False): 1000 * 3000,
    }
    borrowed = [e.payload for e in out if e.kind == "quota.borrowed"]
    returned = [e.payload for e in out if e.kind == "quota.returned"]
    assert [b.job_id for b in borrowed] == ["extra", "extra"] and [r.job_id for r in returned] == ["extra", "extra"]
    acct = s.ledger.accounts[("lender", None)]
    assert acct.used_milli == 0 and acct.borrowed_milli == 0
