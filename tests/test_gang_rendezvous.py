"""A gang's rendezvous and its life as one (issue #33 items 1-2; docs/jobs.md "Gangs"): the pure scheduler's
choice of the master address and port, the whole gang's completion, failure, node loss and requeue; the runner's
rendezvous variables; the job view's and the operator's settings."""
from __future__ import annotations

import pytest

from agents.node.runner import pool_environment, rendezvous_environment, run_id
from agents.node.sim_agent import SimFleetAgent, loopback
from agents.scheduler.core import Scheduler
from agents.scheduler.quota import open_ledger
from infra.config import parse_ports
from schemas.events import (
    DEFAULT_RENDEZVOUS_PORTS, JobCheckpointed, JobCompleted, JobFailed, JobStarted, NodeLiveness, PlaceJob,
    SchedulerTick,
)
from streams.folds.job_view import evolve
from tests.builders import Clock, inventory, job

T0 = 1_767_000_000_000
NODES = ("n1", "n2", "n3")
ADDRS = {"n1": "10.0.0.11", "n2": "10.0.0.12", "n3": "10.0.0.13"}
PROGRAM = ("python3", "train.py")


def _places(out):
    return [o.payload for o in out if o.kind == "cmd.place"]


def _releases(out):
    return [o.payload for o in out if o.kind == "cmd.release"]


def _fleet(c: Clock, s: Scheduler, nodes=NODES, gpus=1):
    for n in nodes:
        inv = inventory(n, gpus=gpus).model_copy(update={"address": ADDRS.get(n, "")})
        s.step(c.env(inv, f"{n}/inventory"))


def _gang(c: Clock, s: Scheduler, j="t/g", cards=3, retries=0, command=PROGRAM):
    out = s.step(c.env(job(j, "t", 1000 * cards, 80 * cards, retries=retries, command=command), f"cli/{j}"))
    parts = sorted(_places(out), key=lambda p: p.gang_index)
    return parts


def _start_all(c, s, parts):
    for p in parts:
        s.step(c.env(JobStarted(job_id=p.job_id, node=p.node, command_id=p.command_id), f"{p.node}/job/{p.job_id}",
                     dt=10))


def _setup(**kw):
    c = Clock(T0)
    s = Scheduler(ledger=open_ledger())
    _fleet(c, s)
    parts = _gang(c, s, **kw)
    assert len(parts) == 3 and [p.gang_index for p in parts] == [0, 1, 2]
    return c, s, parts


def test_every_part_is_told_the_same_master_address_and_a_port_of_the_range():
    c, s, parts = _setup()
    master = parts[0].node
    addrs = {p.master_addr for p in parts}
    ports = {p.master_port for p in parts}
    assert addrs == {ADDRS[master]}, "rank 0's node address, as its inventory advertises it"
    (port,) = ports
    assert DEFAULT_RENDEZVOUS_PORTS[0] <= port <= DEFAULT_RENDEZVOUS_PORTS[1]
    assert all(p.gang_size == 3 and p.gang_nodes == parts[0].gang_nodes for p in parts)


def test_a_stand_in_without_a_program_gets_no_rendezvous():
    c = Clock(T0)
    s = Scheduler(ledger=open_ledger())
    _fleet(c, s)
    parts = _gang(c, s, command=())
    assert len(parts) == 3 and {(p.master_addr, p.master_port) for p in parts} == {("", 0)}


def test_a_node_without_an_address_is_named_and_the_range_comes_from_the_ticks():
    c = Clock(T0)
    s = Scheduler(ledger=open_ledger())
    for n in NODES:
        s.step(c.env(inventory(n, gpus=1), f"{n}/inventory"))
    s.step(c.env(SchedulerTick(now_ms=c.now + 1, rendezvous_ports=(40000, 40001)), "ticker", dt=1))
    parts = _gang(c, s)
    assert {p.master_addr for p in parts} == {parts[0].node}
    assert {p.master_port for p in parts} <= {40000, 40001}
    with pytest.raises(ValueError):
        SchedulerTick(now_ms=1, rendezvous_ports=(40001, 40000))


def test_two_programs_with_their_master_on_one_node_get_different_ports():
    c = Clock(T0)
    s = Scheduler(ledger=open_ledger())
    s.step(c.env(SchedulerTick(now_ms=c.now + 1, rendezvous_ports=(40000, 40001)), "ticker", dt=1))
    s.step(c.env(inventory("big", gpus=2).model_copy(update={"address": "10.0.0.9"}), "big/inventory"))
    (a,) = _places(s.step(c.env(job("t/a", "t", 1000, 80, command=PROGRAM), "cli/a")))
    (b,) = _places(s.step(c.env(job("t/b", "t", 1000, 80, command=PROGRAM), "cli/b")))
    assert a.node == b.node == "big" and a.master_addr == b.master_addr == "10.0.0.9"
    assert {a.master_port, b.master_port} == {40000, 40001}


def test_the_gang_completes_when_its_last_part_does_not_its_first():
    c, s, parts = _setup()
    _start_all(c, s, parts)
    for p in parts[:2]:
        out = s.step(c.env(JobCompleted(job_id=p.job_id, node=p.node, command_id=p.command_id, attempt=p.attempt,
                                        part=p.gang_index, parts=3), f"{p.node}/job/{p.job_id}", dt=1000))
        assert not _releases(out) and s.phase_of("t/g") == "running", "the other parts still run"
    # the same part again (a redelivery) does not count twice
    p = parts[1]
    assert not _releases(s.step(c.env(JobCompleted(job_id=p.job_id, node=p.node, command_id=p.command_id,
                                                   attempt=p.attempt, part=1, parts=3),
                                      f"{p.node}/job/{p.job_id}/again", dt=10)))
    last = parts[2]
    out = s.step(c.env(JobCompleted(job_id=last.job_id, node=last.node, command_id=last.command_id,
                                    attempt=last.attempt, part=2, parts=3), f"{last.node}/job/t/g", dt=1000))
    rel = _releases(out)
    assert sorted(r.node for r in rel) == sorted(NODES) and {r.reasons[0].code for r in rel} == {"Completed"}
    assert s.phase_of("t/g") == "done"
    # billed per part: one line per node, each for the whole run
    usage = [o.payload for o in out if o.kind == "usage.accrued"]
    assert sorted(u.node for u in usage) == sorted(NODES) and len({(u.start_ms, u.end_ms) for u in usage}) == 1


def test_one_part_failing_stops_every_part_and_requeues_the_gang_once_from_its_checkpoint():
    c, s, parts = _setup(retries=1)
    _start_all(c, s, parts)
    p0 = parts[0]
    s.step(c.env(JobCheckpointed(job_id="t/g", node=p0.node, progress_ms=500, checkpoint="state-000000010.json",
                                 command_id=p0.command_id), f"{p0.node}/job/t/g", dt=500))
    bad = parts[1]
    out = s.step(c.env(JobFailed(job_id="t/g", node=bad.node, command_id=bad.command_id, reason="exit 1",
                                 code="ExitCode", exit_code=1, attempt=bad.attempt, part=1), f"{bad.node}/job/t/g",
                       dt=100))
    rel = _releases(out)
    assert sorted(r.node for r in rel) == sorted(NODES), "every part of the attempt is stopped"
    assert {r.attempt for r in rel} == {1} and {r.reasons[0].code for r in rel} == {"Failed"}
    assert s.phase_of("t/g") == "pending" and s.jobs["t/g"].failures == 1
    usage = [o.payload for o in out if o.kind == "usage.accrued"]
    assert sorted(u.node for u in usage) == sorted(NODES), "billed per part up to the failure"
    # the other parts, stopped, fail too as their peer went away: one failed run, not three
    for p in (parts[0], parts[2]):
        late = s.step(c.env(JobFailed(job_id="t/g", node=p.node, command_id=p.command_id, reason="peer lost",
                                      code="ExitCode", exit_code=1, attempt=1, part=p.gang_index),
                            f"{p.node}/job/t/g", dt=10))
        assert not _places(late) and not _releases(late)
    assert s.jobs["t/g"].failures == 1 and s.phase_of("t/g") == "pending"
    again = _places(s.step(c.env(SchedulerTick(now_ms=c.now + 10_000), "ticker", dt=10_000)))
    assert len(again) == 3 and {p.attempt for p in again} == {2}
    assert {p.resume_from for p in again} == {"state-000000010.json"}
    assert len({(p.master_addr, p.master_port) for p in again}) == 1
    assert again[0].master_port != parts[0].master_port or again[0].node != parts[0].node, \
        "a new attempt does not reuse the port its released run may still hold"


def test_a_part_that_cannot_start_ends_the_run_of_every_part():
    c, s, parts = _setup(retries=0)
    bad = parts[2]
    out = s.step(c.env(JobFailed(job_id="t/g", node=bad.node, command_id=bad.command_id, reason="no podman",
                                 code="StartFailed", attempt=1, part=2), f"{bad.node}/job/t/g", dt=10))
    assert sorted(r.node for r in _releases(out)) == sorted(NODES) and s.phase_of("t/g") == "done"


def test_a_lost_node_stops_the_other_parts_and_requeues_the_gang():
    c, s, parts = _setup()
    _start_all(c, s, parts)
    lost = parts[1].node
    out = s.step(c.env(NodeLiveness(node=lost, alive=False, last_heartbeat_ms=c.now + 500), f"{lost}/liveness",
                       dt=3000))
    assert sorted(r.node for r in _releases(out)) == sorted(NODES)
    (intr,) = [o.payload for o in out if o.kind == "job.interrupted"]
    assert set(intr.commands) == {p.command_id for p in parts}
    assert s.phase_of("t/g") == "pending" and s.jobs["t/g"].failures == 0, "a lost node is no failure"


# ---------------------------------------------------------------- the node side

def _place(**kw) -> PlaceJob:
    base = dict(command_id="c1", job_id="acme/train", tenant="acme", node="n2", assignments=(), attempt=3,
                gang_size=3, gang_index=1, gang_nodes=("n1", "n2", "n3"), command=PROGRAM,
                master_addr="10.0.0.11", master_port=29517)
    base.update(kw)
    return PlaceJob(**base)


def test_the_runner_gives_torchrun_and_plain_pytorch_what_they_need():
    from schemas.events import Assignment

    p = _place(assignments=(Assignment(gpu_uuid="GPU-a", milli=1000, memory_mib=81920),
                            Assignment(gpu_uuid="GPU-b", milli=1000, memory_mib=81920)))
    assert rendezvous_environment(p) == {
        "PET_NNODES": "3", "PET_NODE_RANK": "1", "PET_NPROC_PER_NODE": "2", "PET_MASTER_ADDR": "10.0.0.11",
        "PET_MASTER_PORT": "29517", "TORCHELASTIC_RUN_ID": "acme_train-a3", "MASTER_ADDR": "10.0.0.11",
        "MASTER_PORT": "29517", "WORLD_SIZE": "3", "RANK": "1"}
    assert run_id(p) != run_id(_place(attempt=4))
    assert rendezvous_environment(_place(master_port=0)) == {}, "a placement that carries none"


def test_the_pool_wins_over_a_users_rendezvous_variables(tmp_path):
    from agents.node.runner import NodeContext

    ctx = NodeContext.from_env("n2", tmp_path)
    env = pool_environment(_place(), ctx)
    assert env["RANK"] == "1" and env["MASTER_PORT"] == "29517" and env["GPUPOOL_PART"] == "1"


def test_the_simulated_fleet_advertises_a_distinct_loopback_address_per_node():
    invs = [inventory(n, gpus=1) for n in ("a", "b", "c")] + [
        inventory("d", gpus=1).model_copy(update={"address": "192.0.2.7"})]
    agent = SimFleetAgent(None, invs, producer=object())
    got = {n: v.inventory.address for n, v in agent.nodes.items()}
    assert got == {"a": "127.0.0.2", "b": "127.0.0.3", "c": "127.0.0.4", "d": "192.0.2.7"}
    assert loopback(254) == "127.0.1.0"


def test_ports_setting():
    assert parse_ports("") == DEFAULT_RENDEZVOUS_PORTS
    assert parse_ports("30000-30009") == (30000, 30009) and parse_ports("30000") == (30000, 30000)
    for bad in ("30009-30000", "x", "0-10", "1-70000"):
        with pytest.raises(ValueError):
            parse_ports(bad)


def test_the_job_view_completes_a_gang_with_its_last_part():
    from schemas.envelope import envelope

    c = Clock(T0)
    v = evolve(None, c.env(job("t/g", "t", 3000, 240, command=PROGRAM), "cli/t/g"))
    for i in range(3):
        v = evolve(v, c.env(JobStarted(job_id="t/g", node=f"n{i}", command_id=f"c{i}"), f"n{i}/job/t/g", dt=10))
    for i in range(2):
        v = evolve(v, c.env(JobCompleted(job_id="t/g", node=f"n{i}", command_id=f"c{i}", attempt=1, part=i,
                                         parts=3), f"n{i}/job/t/g", dt=10))
        assert v.state == "running"
    v = evolve(v, c.env(JobCompleted(job_id="t/g", node="n2", command_id="c2", attempt=1, part=2, parts=3),
                        "n2/job/t/g", dt=10))
    assert v.state == "completed"
    assert envelope  # the builders' envelopes are the worker's


def test_host_cpu_and_memory_are_per_part_as_asked_not_split_across_nodes():
    c = Clock(T0)
    s = Scheduler(ledger=open_ledger())
    for n in NODES:
        s.step(c.env(inventory(n, gpus=1, cpu_milli=8000, memory_mib=16384), f"{n}/inventory"))
    # a fourth node with a free card but less host memory than one part asks: not used
    s.step(c.env(inventory("small", gpus=1, cpu_milli=8000, memory_mib=4096), "small/inventory"))
    out = s.step(c.env(job("t/g", "t", 3000, 240, command=PROGRAM, cpu_milli=6000, memory_mib=8192), "cli/t/g"))
    parts = _places(out)
    assert sorted(p.node for p in parts) == sorted(NODES)
    assert {(p.cpu_milli, p.memory_mib) for p in parts} == {(6000, 8192)}, "each part gets what was asked"
    # a gang whose part asks more host memory than any node has is never placed (and says why)
    out = s.step(c.env(job("t/big", "t", 3000, 240, command=PROGRAM, memory_mib=32768), "cli/t/big"))
    assert not _places(out)


def test_a_real_node_advertises_the_operators_address_else_its_route_to_kafka():
    from agents.node.nvml_agent import node_address

    assert node_address("broker:9092", {"GPUPOOL_NODE_ADDRESS": "10.1.2.3"}) == "10.1.2.3"
    assert node_address("127.0.0.1:19092,127.0.0.1:19094", {}) == "127.0.0.1"


def test_a_completion_that_does_not_say_its_parts_ends_the_gang_as_before():
    """A producer from before gangs' completions (the colocation simulator, the benches) reports a gang's first part
    only, without `parts`: that ends the job, as it always did."""
    c, s, parts = _setup()
    _start_all(c, s, parts)
    p = parts[0]
    out = s.step(c.env(JobCompleted(job_id=p.job_id, node=p.node, command_id=p.command_id), f"{p.node}/job/t/g",
                       dt=1000))
    assert sorted(r.node for r in _releases(out)) == sorted(NODES) and s.phase_of("t/g") == "done"
