"""Liveness on the log's time (streams/core/liveness.py): no stall of the worker, the broker or a query makes a live node
look dead; a dead node is found; an "alive again" always comes after the "silent" it answers. The worker probes the
log's clock every second (`watch` plays those probes)."""
from streams.core.liveness import Liveness

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
    # nothing for 20 s (the worker cannot ask the log's time: it judges nobody, streams/app.py); then the log is back
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
