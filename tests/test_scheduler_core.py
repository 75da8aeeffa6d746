import random

from agents.scheduler.core import Scheduler, replay
from schemas.events import SchedulerTick, UsageAccrued
from tests.builders import Clock, inventory, job, open_ledger, run_to_completion


def test_usage_is_exact_integer_gpu_time_from_event_times():
    c = Clock()
    s = Scheduler(ledger=open_ledger())
    s.step(c.env(inventory("n1", model="A100-80GB", gpus=2), "n1/inventory"))
    (place,) = [e for e in s.step(c.env(job("j", compute=250, mem_gib=5), "cli")) if e.kind == "cmd.place"]
    outs = run_to_completion(s, c, place, runtime_ms=7_321)
    (usage,) = [e.payload for e in outs if isinstance(e.payload, UsageAccrued)]
    assert usage.gpu_milli == 250 and usage.gpu_milli_ms == 250 * 7_321
    assert usage.end_ms - usage.start_ms == 7_321 and usage.gpu_model == "A100-80GB"
    assert any(e.kind == "cmd.release" for e in outs)
    assert s.nodes["n1"].card_free()[0].milli == 1000  # released


def test_duplicate_input_emits_nothing():
    c = Clock()
    s = Scheduler(ledger=open_ledger())
    s.step(c.env(inventory(), "n1/inventory"))
    req = c.env(job("j"), "cli")
    assert s.step(req)
    assert s.step(req) == []


def _random_inputs(seed: int):
    rng = random.Random(seed)
    c = Clock()
    inputs = [c.env(inventory(f"n{i}", model=rng.choice(["A100-80GB", "T4", "H100-80GB"]), gpus=4), f"n{i}/inventory")
              for i in range(3)]
    for k in range(30):
        inputs.append(c.env(job(f"j{k}", tenant=rng.choice(["a", "b"]), compute=rng.choice([100, 500, 1000, 3000]),
                                mem_gib=rng.choice([2, 10, 40])), f"cli/{k}", dt=rng.randint(0, 50)))
        if k % 5 == 0:
            inputs.append(c.env(SchedulerTick(now_ms=c.now), "ticker", dt=1000))
    return inputs


def test_replaying_the_recorded_input_reproduces_every_output():
    inputs = _random_inputs(3)
    _, first = replay(inputs, ledger=open_ledger())
    _, second = replay(inputs, ledger=open_ledger())
    assert first and [e.model_dump() for e in first] == [e.model_dump() for e in second]


def test_no_card_is_over_allocated():
    s, _ = replay(_random_inputs(11), ledger=open_ledger())
    for v in s.nodes.values():
        for card in v.card_free():
            assert card.milli >= 0 and card.memory_mib >= 0


def test_converged_state_stays_converged():
    s, _ = replay(_random_inputs(5), ledger=open_ledger())
    c = Clock(s.now_ms)
    for _ in range(3):
        assert s.step(c.env(SchedulerTick(now_ms=c.now), "ticker2", dt=1000)) == []


def test_a_request_beyond_the_whole_borrowing_cap_says_only_an_operator_can_make_room():
    """A tenant's request larger than its quota's cap with nothing of it running: waiting "until its usage falls"
    would never end, so the reason names the cap and who can raise it; a request that fits the cap once the tenant's
    own work ends keeps the plain QuotaExceeded."""
    from agents.scheduler.quota import Ledger
    from schemas.events import JobPending, QuotaSet

    clock = Clock()
    s = Scheduler(ledger=Ledger())
    s.step(clock.env(inventory("n0", gpus=8), "n0/inventory"))
    s.step(clock.env(QuotaSet(tenant="zeta", gpu_milli=2000, overcommit_pct=120), "operator"))
    out = s.step(clock.env(job("big", "zeta", 3000, 200), "cli/big"))
    [why] = [o.payload for o in out if isinstance(o.payload, JobPending)]
    r = why.reasons[0]
    assert r.code == "QuotaExceeded" and "2400 milli-CU" in r.message and "quota set zeta" in r.message, r
    s.step(clock.env(job("a", "zeta", 2000, 80), "cli/a"))
    out = s.step(clock.env(job("b", "zeta", 1000, 40), "cli/b"))
    [why] = [o.payload for o in out if isinstance(o.payload, JobPending)]
    assert why.reasons[0].code == "QuotaExceeded" and not why.reasons[0].message


def _over_cap_on_h100(free_a100: bool):
    """globex (4,000 milli-CU, cap 120 %) asks 3,000 milli-CU and 100 GiB: two whole H100s (the best fit: fewest
    cards) would hold 2 x 3,170 = 6,340 milli-CU, three A100s 3,000."""
    from agents.scheduler.quota import Ledger
    from schemas.events import QuotaSet

    clock = Clock()
    s = Scheduler(ledger=Ledger())
    s.step(clock.env(inventory("h1", "H100-80GB", gpus=4), "h1/inventory"))
    s.step(clock.env(inventory("a1", "A100-80GB", gpus=4), "a1/inventory"))
    s.step(clock.env(QuotaSet(tenant="globex", gpu_milli=4000, overcommit_pct=120), "operator"))
    s.step(clock.env(QuotaSet(tenant="acme", gpu_milli=8000, overcommit_pct=120), "operator"))
    if not free_a100:
        placed = s.step(clock.env(job("fill", "acme", 4000, 300), "cli/fill"))
        assert [o.payload.node for o in placed if o.kind == "cmd.place"] == ["a1"]
    return s, clock, s.step(clock.env(job("big", "globex", 3000, 100), "cli/big"))


def test_a_placement_over_the_quota_tries_cheaper_cards_before_the_job_waits():
    """Cards are charged by their model's compute units, so the best fit may hold more than the quota allows where
    another model's would not (Kueue's "try the next flavor"): the job takes the cheaper cards, and its placement
    says what was passed over and why."""
    s, clock, out = _over_cap_on_h100(free_a100=True)
    [place] = [o.payload for o in out if o.kind == "cmd.place"]
    assert place.node == "a1" and len(place.assignments) == 3
    [why] = [r for r in place.reasons if r.code == "CheaperCards"]
    assert why.data["passed_over"] == "H100-80GB" and why.data["passed_over_milli"] == 6340
    assert why.data["held_milli"] == 3000 and "beyond what globex's quota allows" in why.message
    held = [o.payload for o in out if o.kind == "quota.changed"]
    assert held and held[-1].used_milli == 3000


def test_a_job_whose_only_free_cards_hold_too_much_waits_for_cheaper_ones_not_for_an_operator():
    """When the only cards free now would hold more than the whole cap but the request itself fits it, the reason
    says it waits for cards that hold less (never that only an operator can help); once the A100s free up, it runs
    there."""
    from schemas.events import JobPending

    s, clock, out = _over_cap_on_h100(free_a100=False)
    [why] = [o.payload for o in out if isinstance(o.payload, JobPending)]
    r = why.reasons[0]
    assert r.code == "QuotaExceeded" and "no cheaper cards are free" in r.message and "never_fits_cap" not in r.data
    assert r.data["holding_over_cap"] == 1 and r.data["request_milli"] == 6340
    fill = s.jobs["fill"].placement
    from schemas.events import JobCompleted, JobStarted
    s.step(clock.env(JobStarted(job_id="fill", node="a1", command_id=fill.command_id), "a1/job/fill"))
    out = s.step(clock.env(JobCompleted(job_id="fill", node="a1", command_id=fill.command_id), "a1/job/fill", dt=5000))
    [place] = [o.payload for o in out if o.kind == "cmd.place"]
    assert place.job_id == "big" and place.node == "a1"
