"""The production layout's rendered files (infra/deploy, docs/deployment.md) are what the code says: the Strimzi
topics and users from schemas/topics.py and infra/principals.py, the replicated DDL from infra/ddl.sql; and each
replicated statement is one ClickHouse's own parser accepts (no Keeper here to run it)."""
from __future__ import annotations

import base64

import yaml

from infra import deploy
from infra.principals import acls_for
from schemas.topics import ALL_TOPICS


def test_committed_files_are_what_the_specification_renders():
    for rel, text in deploy.rendered().items():
        assert (deploy.HERE / rel).read_text() == text, f"{rel} is stale: run `python -m infra.deploy render`"


def test_topics_are_replicated_three_times_with_two_in_sync():
    docs = [d for d in yaml.safe_load_all((deploy.HERE / "kafka/topics.yaml").read_text()) if d]
    assert {d["spec"]["topicName"] for d in docs} == {s.name for s in ALL_TOPICS}
    for d in docs:
        assert d["spec"]["replicas"] == 3 and d["spec"]["config"]["min.insync.replicas"] == "2"


def test_users_carry_exactly_their_roles_acls():
    docs = [d for d in yaml.safe_load_all((deploy.HERE / "kafka/users.yaml").read_text()) if d]
    for d in docs:
        name, role = d["metadata"]["name"], d["metadata"]["labels"]["gpupool.io/role"]
        assert len(d["spec"]["authorization"]["acls"]) == len(acls_for(name, role))
        assert d["spec"]["authentication"]["type"] == "scram-sha-512"


def test_replicated_ddl_parses():
    import chdb

    statements = deploy.statements_only((deploy.HERE / "clickhouse/replicated.sql").read_text())
    assert len(statements) > 10
    for stmt in statements:
        b64 = base64.b64encode(stmt.encode()).decode()
        out = chdb.query(f"SELECT formatQuery(base64Decode('{b64}'))", "CSV").bytes().decode()
        assert "Replicated" in out or "ON CLUSTER" in out, stmt
