"""Telemetry history (streams/folds/telemetry_history.py): per card and minute on the log's time, each job's part of a card,
rows for ClickHouse, and the tables and view behind the dashboards (infra/ddl.sql) on the embedded engine."""
from __future__ import annotations

import time

import orjson
import pytest

from schemas.envelope import encode, envelope
from schemas.events import GpuSample, GpuTelemetry
from schemas.routing import route
from schemas.topics import TELEMETRY_MINUTES
from streams.folds.rows import COLUMNS, rows_for
from streams.folds.telemetry_history import TelemetryMinutes

T0 = int(time.time()) // 60 * 60_000  # a minute boundary, recent enough for the tables' 30-day TTL


def s(uuid: str, util: int, mem: int = 1000, jobs: tuple[str, ...] = (), mig: str | None = None, temp: int = 40,
      power: int = 100_000) -> GpuSample:
    return GpuSample(gpu_uuid=uuid, mig_uuid=mig, util_pct=util, mem_used_mib=mem, mem_total_mib=80_000,
                     temperature_c=temp, power_mw=power, job_ids=jobs)


def info(job: str) -> tuple[str, str]:
    return job.split("/")[0], {"acme/train": "offline", "globex/serve": "inference"}.get(job, "")


def test_a_minute_closes_when_the_logs_time_passes_it_with_means_and_maxima():
    agg = TelemetryMinutes(job_info=info)
    assert agg.add("n1", T0 + 1_000, [s("g0", 20, 1000, temp=40), s("g1", 0)], models={"g0": "A100-80GB"},
                   datacenter="dc-1") == []
    assert agg.add("n1", T0 + 31_000, [s("g0", 60, 3000, temp=50), s("g1", 0)]) == []
    (m,) = agg.add("n1", T0 + 61_000, [s("g0", 100)])  # the next minute: the first one is closed
    assert (m.node, m.datacenter, m.minute_ms) == ("n1", "dc-1", T0)
    g0, g1 = m.cards
    assert (g0.gpu_uuid, g0.gpu_model, g0.samples) == ("g0", "A100-80GB", 2)
    assert (g0.util_mean_permille, g0.util_max_pct) == (400, 60)
    assert (g0.mem_used_mean_mib, g0.mem_used_max_mib, g0.temperature_mean_c, g0.temperature_max_c) == (
        2000, 3000, 45, 50)
    assert g1.util_mean_permille == 0 and g1.jobs == ()
    assert agg.close_before(T0 + 120_000 + 4_000) == []  # within the grace
    (late,) = agg.close_before(T0 + 125_000)  # the node went silent: its minute closes on the log's time
    assert late.minute_ms == T0 + 60_000 and late.cards[0].samples == 1


def test_each_job_gets_its_part_of_a_shared_card_and_its_tenant_and_tier():
    agg = TelemetryMinutes(job_info=info)
    agg.add("n1", T0, [s("g0", 80, 4000, jobs=("acme/train", "globex/serve"))])
    agg.add("n1", T0 + 10_000, [s("g0", 40, 2000, jobs=("acme/train",))])
    (m,) = agg.flush()
    (card,) = m.cards
    assert card.util_mean_permille == 600
    by = {j.job_id: j for j in card.jobs}
    assert by["acme/train"].tenant == "acme" and by["acme/train"].tier == "offline"
    assert by["globex/serve"].tier == "inference" and by["globex/serve"].samples == 1
    # 80 % split in two, then 40 % alone: (400 + 400) / 2 samples; the other job (400 + 0) / 2
    assert by["acme/train"].util_permille == 400 and by["globex/serve"].util_permille == 200
    assert sum(j.util_permille for j in card.jobs) == card.util_mean_permille
    assert by["acme/train"].mem_used_mib == 2000 and by["globex/serve"].mem_used_mib == 1000


def test_mig_instances_are_rows_of_their_own():
    agg = TelemetryMinutes()
    agg.add("n1", T0, [s("g0", 30, mig="mig-a", jobs=("acme/a",)), s("g0", 0, mig="mig-b")])
    (m,) = agg.flush()
    assert [(c.gpu_uuid, c.mig_uuid) for c in m.cards] == [("g0", "mig-a"), ("g0", "mig-b")]
    assert m.cards[0].jobs[0].tenant == "acme" and m.cards[0].jobs[0].tier == ""  # the default: the id's prefix


def test_rows_route_and_the_tables_behind_the_dashboards(tmp_path):
    from infra.clickhouse import connect

    agg = TelemetryMinutes(job_info=info)
    agg.add("n1", T0, [s("g0", 80, jobs=("acme/train",)), s("g1", 40, jobs=("globex/serve",)), s("g2", 0)],
            models={"g0": "A100-80GB", "g1": "A100-80GB", "g2": "H100-80GB"})
    (m,) = agg.flush()
    env = envelope(m, source="n1/telemetry-minutes", seq=m.minute_ms, time_ms=m.minute_ms + 60_000)
    assert route(env) == (TELEMETRY_MINUTES, b"n1")
    tables = rows_for(env, TELEMETRY_MINUTES.name, 0, 0)
    assert set(tables) == {"telemetry_minutes"} and len(tables["telemetry_minutes"]) == 3  # not mirrored in events
    client = connect(f"chdb://{tmp_path / 'ch'}")
    rows = tables["telemetry_minutes"]
    client.insert("gpupool.telemetry_minutes", rows, column_names=list(COLUMNS["telemetry_minutes"]))
    # the same minute again with fewer samples (re-read after a restart): FINAL keeps the fuller row
    partial = [list(r) for r in rows]
    for r in partial:
        r[COLUMNS["telemetry_minutes"].index("samples")] = 0
    client.insert("gpupool.telemetry_minutes", partial, column_names=list(COLUMNS["telemetry_minutes"]))
    got = client.query("SELECT count(), min(samples) FROM gpupool.telemetry_minutes FINAL").result_rows[0]
    assert got == (3, 1)
    split = dict(client.query("SELECT workload, sum(util_permille) FROM gpupool.telemetry_by_job "
                              "GROUP BY workload").result_rows)
    assert split == {"training": 800, "inference": 400}
    from streams.edge.api import POOL_UTIL_SQL, TELEMETRY_GROUPS, TELEMETRY_SQL

    sql = TELEMETRY_SQL.replace("{group}", TELEMETRY_GROUPS["tenant"]).replace("{where}", "1")
    by_tenant = {r[1]: r[2] for r in client.query(sql, parameters={"since": 0}).result_rows}
    assert by_tenant == {"acme": 80.0, "globex": 40.0}
    (pool,) = client.query(POOL_UTIL_SQL, parameters={"since": 0}).result_rows
    assert pool[1] == 40.0 and pool[2] == 3  # (80 + 40 + 0) / 3 cards


def test_a_node_whose_records_are_not_read_that_far_keeps_its_minute_open_until_they_are():
    """A worker catching up a backlog: the log's time is past the minute, but n1's partition is read only to
    within it; its minute closes once, whole, when the rest is read (closing it early would publish a partial row
    and then a second, partial one for the same minute). n2's partition is read to now: it closes on time."""
    agg = TelemetryMinutes()
    agg.add("n1", T0 + 1_000, [s("g0", 10)])
    agg.add("n2", T0 + 1_000, [s("g0", 20)])
    now = T0 + 200_000
    read_to = {"n1": T0 + 30_000, "n2": now}
    assert [m.node for m in agg.close_before(now, read_to.get)] == ["n2"]
    agg.add("n1", T0 + 50_000, [s("g0", 30)])  # the rest of n1's minute, read later
    assert agg.close_before(now, lambda n: None) == []  # not known how far: not closed
    (m,) = agg.close_before(now, lambda n: T0 + 66_000)
    assert m.node == "n1" and m.cards[0].samples == 2 and m.cards[0].util_mean_permille == 200


# ---------------------------------------------------------------- one validation a node-minute (issue #16)

def _minute_model_by_model(node: str, minute: int, dc: str, buckets: dict, job_info) -> "TelemetryMinute":
    """The minute as it was built before one validation a node-minute: every JobMinute and CardMinute on its own."""
    from schemas.events import CardMinute, JobMinute, TelemetryMinute

    cards = []
    for _, b in sorted(buckets.items()):
        if not b.n:
            continue
        n = b.n
        jobs = tuple(JobMinute(job_id=job, tenant=job_info(job)[0], tier=job_info(job)[1], samples=count,
                               util_permille=util // n, mem_used_mib=mem // n)
                     for job, (count, util, mem) in sorted(b.jobs.items()))
        cards.append(CardMinute(
            gpu_uuid=b.gpu_uuid, mig_uuid=b.mig_uuid, gpu_model=b.gpu_model, samples=n,
            util_mean_permille=b.util_sum * 10 // n, util_max_pct=b.util_max, mem_used_mean_mib=b.mem_sum // n,
            mem_used_max_mib=b.mem_max, mem_total_mib=b.mem_total, temperature_mean_c=round(b.temp_sum / n),
            temperature_max_c=b.temp_max, power_mean_mw=b.power_sum // n, power_max_mw=b.power_max,
            ecc_corrected=b.ecc_corrected, ecc_uncorrected=b.ecc_uncorrected, xid_errors=tuple(sorted(b.xids)),
            jobs=jobs))
    return TelemetryMinute(node=node, datacenter=dc, minute_ms=minute, cards=tuple(cards))


from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_samples = st.builds(
    GpuSample, gpu_uuid=st.sampled_from(["g0", "g1", "g2"]), mig_uuid=st.none() | st.sampled_from(["m0", "m1"]),
    util_pct=st.integers(0, 100), mem_used_mib=st.integers(0, 90_000), mem_total_mib=st.integers(0, 90_000),
    temperature_c=st.integers(-40, 120), power_mw=st.integers(0, 700_000), ecc_corrected=st.integers(0, 5),
    ecc_uncorrected=st.integers(0, 5), xid_errors=st.lists(st.integers(0, 99), max_size=2).map(tuple),
    job_ids=st.lists(st.sampled_from(["acme/train", "globex/serve", "solo", "x/y"]), max_size=3).map(tuple))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 150_000), st.lists(_samples, max_size=4)), min_size=1, max_size=8),
       st.booleans())
def test_a_closed_minute_is_the_one_built_model_by_model(batches, models):
    agg = TelemetryMinutes(job_info=info)
    want, got = [], []
    for t, samples in sorted(batches, key=lambda b: b[0]):
        current = agg._open.get("n1")
        if current is not None and current[0] != agg.minute_of(T0 + t):
            want.append(_minute_model_by_model("n1", current[0], current[1], current[2], info))
        got += agg.add("n1", T0 + t, samples, models={"g0": "A100-80GB"} if models else None, datacenter="dc-2")
    minute, dc, buckets = agg._open["n1"]
    want.append(_minute_model_by_model("n1", minute, dc, buckets, info))
    got += agg.flush()
    assert got == want
    assert [m.model_dump_json() for m in got] == [m.model_dump_json() for m in want]  # field order and all
    assert [m.model_fields_set for m in got] == [m.model_fields_set for m in want]


@pytest.mark.parametrize("job", ["", "j" * 201])
def test_a_job_id_no_minute_could_hold_is_refused_where_the_record_comes_in(job):
    """A sample naming a job "" (or longer than any job id) is refused by the contract, so decode dead-letters the
    record instead of the worker's minute close raising on it later (in the liveness timer, for every minute after)."""
    from pydantic import ValidationError

    from schemas.envelope import DecodeError, decode, decode_telemetry

    with pytest.raises(ValidationError):
        s("g0", 50, jobs=(job,))
    good = encode(envelope(GpuTelemetry(node="n1", samples=(s("g0", 50, jobs=("acme/train",)),)), source="n1/telemetry",
                           seq=1, time_ms=T0))
    bad = good.replace(b'"acme/train"', orjson.dumps(job))
    for fn in (decode, decode_telemetry):
        with pytest.raises(DecodeError) as exc:
            fn(bad)
        assert exc.value.code == "invalid"
        assert fn(good).payload.samples[0].job_ids == ("acme/train",)
