"""bench.scaling (#35 item 5) runs bench.placement once per fleet size in a child process and reports what a
decision costs there and the child's peak memory: on two tiny fleets every row is filled from its own run (no
figure asserted: speed is measured by the script, not by tests)."""
from __future__ import annotations

import json

from bench import scaling


def test_the_scaling_table_has_a_row_per_fleet_size_each_from_its_own_run(capsys):
    assert scaling.main(["--sizes", "30,60", "--jobs-per-node", "2", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    rows = doc["rows"]
    assert [r["nodes"] for r in rows] == [30, 60]
    for r in rows:
        assert r["requests"] == 2 * r["nodes"] and r["gpus"] == 8 * r["nodes"]
        assert 0 < r["placed"] <= r["requests"]
        assert r["us_per_request_cpu"] > 0 and r["peak_rss_mib"] > 10  # an interpreter with the scheduler loaded
        assert abs(r["peak_rss_per_node_kib"] * r["nodes"] - r["peak_rss_mib"] * 1024) < r["nodes"] + 103
        int(r["digest"], 16)
        assert r["step_ms_p50"] <= r["step_ms_p99"] <= r["step_ms_max"]
    assert rows[0]["digest"] != rows[1]["digest"]  # two fleets, two runs: not one result printed twice
    table = scaling.table(rows)
    assert "| 30 |" in table and "| 60 |" in table and "cost per request at 60 nodes / at 30" in table
