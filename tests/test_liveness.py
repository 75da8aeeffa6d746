"""Liveness on the log's time (streams/folds/liveness.py): no stall of the worker, the broker or a query makes a live node
look dead; a dead node is found; an "alive again" always comes after the "silent" it answers. The worker probes the
log's clock every second (`watch` plays those probes)."""
from streams.folds.liveness import Liveness

T = 1_000_000


def heard(lv: Liveness, node: str, partition: int, offset: int, t: int) -> None:
    lv.heard_from(node, partition, offset, t)


def watch(lv: Liveness, nodes: list[str], since: int, until: int, highwaters: dict) -> list[str]:
    """The worker's probes, one a second from `since` to `until`: what the last one declares silent."""
    out = []
    t = since
    while t <= until:
        out = lv.silent(nodes, t, highwaters)
        t += 1000
    if t - 1000 != until:
        out = lv.silent(nodes, until, highwaters)
    return out


def test_a_node_silent_for_two_intervals_of_log_time_is_found():
    lv = Liveness(interval_ms=1000, recovery_ms=0)
    lv.silent([], T, {})  # the worker starts watching at T
    heard(lv, "n1", 0, 0, T)
    heard(lv, "n2", 1, 0, T + 1900)
    # both partitions read to their end (next offset 1 == highwater 1): read up to the log's now
    assert watch(lv, ["n1", "n2"], T + 1000, T + 2000, {0: 1, 1: 1}) == []
    assert lv.silent(["n1", "n2"], T + 2001, {0: 1, 1: 1}) == ["n1"]


def test_a_worker_behind_on_a_partition_judges_it_by_what_it_has_read():
    """Restart, slow query, burst: records wait unread; the partition's clock is the last one folded."""
    lv = Liveness(interval_ms=1000, recovery_ms=0)
    lv.silent([], T, {})
    heard(lv, "n1", 0, 10, T)
    heard(lv, "n2", 1, 5, T)
    # 60 s of log time later, partition 0 has 50 unread records (highwater 61 > next offset 11): n1 is not judged
    assert watch(lv, ["n1", "n2"], T + 1000, T + 60_000, {0: 61, 1: 6}) == ["n2"]
    # reading the backlog shows n1's heartbeats: still alive once read up to now
    for off in range(11, 61):
        heard(lv, "n1", 0, off, T + (off - 10) * 1200)
    assert lv.silent(["n1"], T + 60_500, {0: 61}) == []


def test_a_gap_in_the_workers_view_of_the_log_gives_every_node_time_to_be_heard_again():
    """A broker outage of 20 s (or a worker stalled that long): the probes of the log's clock stop; when they come
    back the nodes' producers are still reconnecting. Nobody is judged for `recovery_ms` after the gap's end."""
    lv = Liveness(interval_ms=1000, recovery_ms=10_000)
    heard(lv, "n1", 0, 0, T)
    watch(lv, ["n1"], T - 15_000, T, {0: 1})  # the worker has watched for a while
    # nothing for 20 s (the worker cannot ask the log's time: it judges nobody, streams/edge/app.py); then the log is back
    assert lv.silent(["n1"], T + 20_000, {0: 1}) == []
    assert watch(lv, ["n1"], T + 21_000, T + 29_000, {0: 1}) == []  # reconnecting: 9 s and still not judged
    heard(lv, "n1", 0, 1, T + 29_500)  # its buffered telemetry arrives
    assert watch(lv, ["n1"], T + 30_000, T + 31_000, {0: 2}) == []
    # a node that really died during the gap is found once the recovery window has passed
    lv2 = Liveness(interval_ms=1000, recovery_ms=10_000)
    heard(lv2, "n1", 0, 0, T)
    watch(lv2, ["n1"], T - 15_000, T, {0: 1})
    assert lv2.silent(["n1"], T + 20_000, {0: 1}) == []
    assert watch(lv2, ["n1"], T + 21_000, T + 29_000, {0: 1}) == []
    assert watch(lv2, ["n1"], T + 30_000, T + 30_000, {0: 1}) == ["n1"]
    # a restarted worker gives the same window from its start
    lv3 = Liveness(interval_ms=1000, recovery_ms=10_000)
    heard(lv3, "n1", 0, 0, T)
    assert watch(lv3, ["n1"], T + 5000, T + 14_000, {0: 1}) == []
    assert lv3.silent(["n1"], T + 15_000, {0: 1}) == ["n1"]


def test_a_node_not_heard_since_the_worker_started():
    lv = Liveness(interval_ms=1000, recovery_ms=0)
    heard(lv, "n2", 1, 0, T)
    # n1 has said nothing since this worker started; partition 0 not yet known (no fetch yet): nobody unheard judged
    assert watch(lv, ["n1"], T, T + 5000, {0: None, 1: 1}) == []
    lv.start[0] = 7  # this worker began partition 0 at its group's committed offset 7, and nothing came since
    assert lv.silent(["n1"], T + 5001, {0: 7, 1: 1}) == ["n1"]
    # while a partition is still behind, an unheard node may be in it: not judged
    lv2 = Liveness(interval_ms=1000, recovery_ms=0, start={0: 0})
    assert watch(lv2, ["n1"], T, T + 10_000, {0: 5}) == []


def test_alive_again_always_has_a_later_sequence_than_the_silence_it_answers():
    lv = Liveness()
    silent = lv.next_seq("n1", T + 5000)
    # the heartbeat that revives the node was appended a moment before the probe that declared it silent
    alive = lv.next_seq("n1", T + 4999)
    assert alive > silent
    # a restarted worker (no memory) still numbers above: the log's time has moved on
    assert Liveness().next_seq("n1", T + 6000) > alive


def test_a_node_revived_by_its_inventory_is_not_declared_silent_again_before_two_intervals():
    """n1 went silent (its last heartbeat at T); 20 s later its agent comes back and reports its inventory first
    (the nodes topic), which makes its view alive again, and its heartbeats follow. The silence counts from that
    record: a probe right after it found n1's last heartbeat 20 s old and declared it silent again (a live run showed
    the flap: the job just placed on it was interrupted and placed once more)."""
    lv = Liveness(interval_ms=1000, recovery_ms=0)
    lv.silent([], T, {})
    heard(lv, "n1", 0, 0, T)
    assert watch(lv, ["n1"], T + 1000, T + 2001, {0: 1}) == ["n1"]
    lv.revived("n1", 0, T + 20_000)  # its inventory, read back alive at T + 20 s
    assert watch(lv, ["n1"], T + 20_000, T + 21_900, {0: 1}) == []
    heard(lv, "n1", 0, 1, T + 21_000)  # its first heartbeat
    assert lv.silent(["n1"], T + 22_500, {0: 2}) == []
    # and if no heartbeat follows, it is silent two intervals after the last thing heard from it
    assert lv.silent(["n1"], T + 23_001, {0: 2}) == ["n1"]


# ---------------------------------------------------------------- a busy or paused worker (issue #31 item 3)

def test_a_paused_or_busy_worker_is_judged_by_the_end_offset_asked_after_its_probe():
    """The worker read partition 0 to its end (offset 10, n1's heartbeat at T), then stopped for 5 s (SIGSTOP, or a
    tenant's burst holding its loop). n1 went on writing a record a second. The probe after the stall says the log's
    time is T+5500 and -- asked after that probe -- that the partition ends at 16: five records unread, so the
    partition is read to T+500 only (the probe before the stall, whose end it reached) and nobody is silent. (The
    worker used to pair that probe with the highwater of its last fetch, 11, from before the stall: "read to its
    end" at T+5500, and n1 silent for five seconds.)"""
    lv = Liveness(interval_ms=1000, recovery_ms=0)
    lv.silent([], T - 10_000, {0: 0})
    for off in range(11):
        heard(lv, "n1", 0, off, T - 10_000 + off * 1000)
    assert lv.silent(["n1"], T + 500, {0: 11}) == []
    # the stall: 5 s, no probe, no fold; then a probe whose end is asked after it (and a gap: the worker did not
    # watch, so the recovery window runs again -- with recovery 0 the stale highwater alone would have decided)
    assert lv.silent(["n1"], T + 5_500, {0: 16}) == []
    assert lv.clock(0) == T + 500  # read to the last probe whose end it reached, not to this one
    # still behind (the burst keeps the fold busy): later probes, later ends, n1 unread -- still not silent
    assert watch(lv, ["n1"], T + 6_500, T + 20_500, {0: 30}) == []
    # the fold reads the backlog: n1 wrote every second, alive
    for off in range(11, 30):
        heard(lv, "n1", 0, off, T + (off - 10) * 1000)
    assert lv.silent(["n1"], T + 21_000, {0: 30}) == []


def test_a_node_that_really_stopped_is_found_while_the_worker_is_still_behind():
    """A probe's end offset, once the fold reaches it, says the partition is read up to that probe's time: n1
    stopped at T; n2 (same partition) goes on; the worker is behind, and as it reads past the end of each probe
    n1's silence grows in the log's time, found before the backlog is all read."""
    lv = Liveness(interval_ms=1000, recovery_ms=0)
    lv.silent([], T - 5_000, {0: 0})
    heard(lv, "n1", 0, 0, T)
    heard(lv, "n2", 0, 1, T)
    # probes at T+1000..T+4000: ends 3, 5, 7, 9 (n2's records only); the fold read nothing more yet
    for i, end in enumerate((3, 5, 7, 9), start=1):
        assert lv.silent(["n1", "n2"], T + i * 1000, {0: end}) == []
    # the fold reads n2's records up to offset 4: past the ends of the probes at T+1000 and T+2000
    for off in range(2, 5):
        heard(lv, "n2", 0, off, T + (off - 1) * 500)
    assert lv.clock(0) == T + 2000
    assert lv.silent(["n1", "n2"], T + 5000, {0: 11}) == []  # 2 s of log time read: not more than two intervals
    for off in range(5, 7):
        heard(lv, "n2", 0, off, T + (off - 1) * 500)
    assert lv.clock(0) == T + 3000  # past the end of the probe at T+3000 (7)
    assert lv.silent(["n1", "n2"], T + 6000, {0: 13}) == ["n1"]


def test_a_worker_that_cannot_ask_the_end_judges_nobody_on_that_partition():
    lv = Liveness(interval_ms=1000, recovery_ms=0)
    lv.silent([], T - 5_000, {0: None})
    heard(lv, "n1", 0, 0, T - 5000)
    # the end offset not known (the request failed): only what was folded counts, and that is n1's own record
    assert watch(lv, ["n1"], T, T + 10_000, {0: None}) == []


def test_a_verdict_is_numbered_above_the_views_last_liveness_fact():
    """A restarted worker (its counters empty) answers a "silent" written by its predecessor at a later log time
    than the telemetry it re-reads: the "alive again" must still be the newer fact, or the view drops it."""
    lv = Liveness()
    silent_seq = (T + 60_000) * 1000  # the predecessor's verdict, at a later log time
    assert lv.next_seq("n1", T, applied=silent_seq) == silent_seq + 1
    assert lv.next_seq("n1", T) == silent_seq + 2


# ---------------------------------------------------------------- the scheduler's readiness is the node view's

import heapq  # noqa: E402

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from schemas.envelope import envelope  # noqa: E402
from schemas.events import NodeInventory, NodeLiveness  # noqa: E402
from streams.folds import node_view  # noqa: E402
from streams.folds.liveness import alive_again, forward_to_scheduler, liveness_source  # noqa: E402
from tests.builders import inventory  # noqa: E402
from schemas.events import NodeHeartbeat  # noqa: E402

INV = inventory("n1", gpus=2)


class Pool:
    """The worker's node view of one node, the node-control topic's records in flight, and the scheduler's view
    folded from what the folds forward -- the paths of streams/edge/app.py (fold_nodes, check_liveness) and
    streams/edge/telemetry.py (_derive), with their rules (`forward`, `answer`) as parameters."""

    def __init__(self, forward=forward_to_scheduler, answer=alive_again, floor=True):
        self.forward = forward
        self.answer = answer
        self.floor = floor
        self.judge = Liveness()
        self.view = None
        self.sched = None
        self.flight: list = []  # node-control records written, not yet read back by fold-nodes (in order)
        self.t = 1_000_000
        self.hb_seq = 0
        self.inv_seq = 0

    def _seq(self, log_ms):
        applied = self.view.applied.get(liveness_source("n1"), -1) if self.floor and self.view else -1
        return self.judge.next_seq("n1", log_ms, applied)

    def _answer(self, before, after, env, log_ms):
        if self.answer(before, after, env):
            self.flight.append(envelope(NodeLiveness(node="n1", alive=True, last_heartbeat_ms=after.last_heartbeat_ms),
                                        source=liveness_source("n1"), seq=self._seq(log_ms), time_ms=log_ms))

    def heartbeat(self, dt: int):  # telemetry, folded by the telemetry task
        self.t += dt
        self.hb_seq += 1
        env = envelope(NodeHeartbeat(node="n1"), source="n1/telemetry", seq=self.hb_seq, time_ms=self.t)
        before, self.view = self.view, node_view.fold_telemetry(self.view, [env])
        self._answer(before, self.view, env, self.t)

    def inventory(self, dt: int):  # the nodes topic, folded by fold-nodes and forwarded
        self.t += dt
        self.inv_seq += 1
        env = envelope(INV, source="n1/inventory", seq=self.inv_seq, time_ms=self.t)
        self._fold_nodes(env)

    def judge_silent(self, dt: int, restarted: bool):  # the liveness timer, on the view as it is now
        self.t += dt
        if restarted:
            self.judge = Liveness()  # a new worker: its counters start again, the view comes from the changelog
        if self.view is not None and self.view.alive and self.view.inventory is not None:
            self.flight.append(envelope(NodeLiveness(node="n1", alive=False,
                                                     last_heartbeat_ms=self.view.last_heartbeat_ms),
                                        source=liveness_source("n1"), seq=self._seq(self.t + 60_000), time_ms=self.t))

    def read_back(self):  # fold-nodes reads the oldest record of node control
        if self.flight:
            self._fold_nodes(self.flight.pop(0))

    def _fold_nodes(self, env):
        before = self.view
        after = node_view.evolve(before, env)
        if after is before:
            if isinstance(env.payload, NodeLiveness):  # dropped as not newer: answered where needed
                self._answer(before, before, env, self.t)
            return
        self.view = after
        if self.forward(env, after):
            self.sched = node_view.evolve(self.sched, env)
        self._answer(before, after, env, self.t)

    def settle(self, limit: int = 1000):
        """Read back what is in flight (a rule that answers for ever -- a negative control's -- stops at `limit`)."""
        while self.flight and limit:
            self.read_back()
            limit -= 1

    def ready(self) -> tuple[bool, bool]:
        return (self.view is not None and self.view.alive, self.sched is not None and self.sched.alive)


STEPS = st.lists(st.one_of(
    st.tuples(st.just("heartbeat"), st.integers(1, 3000)),
    st.tuples(st.just("inventory"), st.integers(1, 3000)),
    st.tuples(st.just("judge"), st.integers(0, 3000), st.booleans()),
    st.tuples(st.just("read")),
), max_size=40)


def play(pool: Pool, steps) -> None:
    pool.inventory(1)
    for step in steps:
        if step[0] == "heartbeat":
            pool.heartbeat(step[1])
        elif step[0] == "inventory":
            pool.inventory(step[1])
        elif step[0] == "judge":
            pool.judge_silent(step[1], step[2])
        else:
            pool.read_back()


@settings(max_examples=1000, deadline=None)
@given(STEPS)
def test_the_schedulers_readiness_is_the_node_views(steps):
    """Whatever the order in which heartbeats, inventories, verdicts (true or false, by this worker or a restarted
    one) and their reading back come, once the records in flight are read the scheduler holds the node ready exactly
    when the node view does (`gpupool node list`), with nothing restarted; and a silence the view disproves never
    reaches the scheduler (no job is interrupted for it)."""
    pool = Pool()
    play(pool, steps)
    pool.settle()
    assert pool.flight == []  # the answers end
    view_ready, sched_ready = pool.ready()
    assert view_ready == sched_ready


def test_the_race_of_issue_31_and_the_readiness_check_can_fail():
    """The race seen: the judge declares n1 silent after its heartbeat H; before fold-nodes reads the silence back,
    the telemetry task folds a newer heartbeat. The view stays alive (node list: ready), so no "alive again" is ever
    sent. Forwarded as before (negative control), the silence makes the scheduler drop the node for good; with the
    rule, the scheduler keeps it."""
    steps = [("heartbeat", 1000), ("judge", 2500, False), ("heartbeat", 100), ("read",)]
    old = Pool(forward=lambda env, after: True, answer=old_answer)
    play(old, steps)
    old.settle()
    assert old.ready() == (True, False)  # the divergence: node list ready, the scheduler refusing it
    new = Pool()
    play(new, steps)
    new.settle()
    assert new.ready() == (True, True)
    # a restarted worker's "alive again" numbered by its own counter only: dropped as older than the silence
    steps = [("heartbeat", 1000), ("judge", 2500, False), ("read",), ("judge", 0, True), ("heartbeat", 100)]
    for floor, expect in ((False, (True, False)), (True, (True, True))):
        pool = Pool(floor=floor)
        play(pool, steps)
        pool.settle()
        assert pool.ready() == expect
    # two verdicts on the same heartbeat (one in flight when the worker restarts); the restarted worker's "alive
    # again" takes the number of the second, which is read first, disproved -- and, unanswered, the first silence
    # stands at the scheduler (hypothesis found this one)
    steps = [("judge", 0, False), ("judge", 0, False), ("read",), ("judge", 0, True), ("heartbeat", 1)]
    for answer, expect in ((old_answer, (True, False)), (alive_again, (True, True))):
        pool = Pool(answer=answer)
        play(pool, steps)
        pool.settle()
        assert pool.ready() == expect


def old_answer(before, after, env) -> bool:
    """The rule before issue #31: an "alive again" only where the view went from silent to alive."""
    return before is not None and not before.alive and after.alive and not isinstance(env.payload, NodeLiveness)
