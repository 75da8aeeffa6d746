"""Liveness on the log's time (streams/liveness.py): no stall of the worker, the broker or a query makes a live node
look dead; a dead node is found; an "alive again" always comes after the "silent" it answers."""
from streams.liveness import Liveness

T = 1_000_000


def heard(lv: Liveness, node: str, partition: int, offset: int, t: int) -> None:
    lv.heard_from(node, partition, offset, t)


def test_a_node_silent_for_two_intervals_of_log_time_is_found():
    lv = Liveness(interval_ms=1000)
    heard(lv, "n1", 0, 0, T)
    heard(lv, "n2", 1, 0, T + 1900)
    # both partitions read to their end (next offset 1 == highwater 1): read up to the log's now
    assert lv.silent(["n1", "n2"], T + 2000, {0: 1, 1: 1}) == []
    assert lv.silent(["n1", "n2"], T + 2001, {0: 1, 1: 1}) == ["n1"]


def test_a_worker_behind_on_a_partition_judges_it_by_what_it_has_read():
    """Restart, slow query, burst: records wait unread; the partition's clock is the last one folded."""
    lv = Liveness(interval_ms=1000)
    heard(lv, "n1", 0, 10, T)
    heard(lv, "n2", 1, 5, T)
    # 60 s of log time later, partition 0 has 50 unread records (highwater 61 > next offset 11): n1 is not judged
    assert lv.silent(["n1", "n2"], T + 60_000, {0: 61, 1: 6}) == ["n2"]
    # reading the backlog shows n1's heartbeats: still alive once read up to now
    for off in range(11, 61):
        heard(lv, "n1", 0, off, T + (off - 10) * 1200)
    assert lv.silent(["n1"], T + 60_500, {0: 61}) == []


def test_a_broker_outage_moves_no_log_time():
    lv = Liveness(interval_ms=1000)
    heard(lv, "n1", 0, 0, T)
    assert lv.silent(["n1"], T + 500, {0: 1}) == []
    # the broker is away 20 s: the worker cannot ask the log's time and judges nobody (streams/app.py); afterwards
    # the nodes' buffered heartbeats are appended after the outage, so in log time they were never silent
    heard(lv, "n1", 0, 1, T + 900)
    assert lv.silent(["n1"], T + 1200, {0: 2}) == []


def test_a_node_not_heard_since_the_worker_started():
    lv = Liveness(interval_ms=1000)
    heard(lv, "n2", 1, 0, T)
    # n1 has said nothing since this worker started; partition 0 not yet known (no fetch yet): nobody unheard judged
    assert lv.silent(["n1"], T, {0: None, 1: 1}) == []
    assert lv.silent(["n1"], T + 5000, {0: None, 1: 1}) == []
    lv.start[0] = 7  # this worker began partition 0 at its group's committed offset 7, and nothing came since
    assert lv.silent(["n1"], T + 5001, {0: 7, 1: 1}) == ["n1"]
    # while a partition is still behind, an unheard node may be in it: not judged
    lv2 = Liveness(interval_ms=1000, start={0: 0})
    assert lv2.silent(["n1"], T, {0: 5}) == [] and lv2.silent(["n1"], T + 10_000, {0: 5}) == []


def test_alive_again_always_has_a_later_sequence_than_the_silence_it_answers():
    lv = Liveness()
    silent = lv.next_seq("n1", T + 5000)
    # the heartbeat that revives the node was appended a moment before the probe that declared it silent
    alive = lv.next_seq("n1", T + 4999)
    assert alive > silent
    # a restarted worker (no memory) still numbers above: the log's time has moved on
    assert Liveness().next_seq("n1", T + 6000) > alive
