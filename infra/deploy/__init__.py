"""A production layout on existing engines, rendered from the project's one specification (docs/deployment.md).

    python -m infra.deploy render [DIR]     # default: infra/deploy (the committed files)

What is rendered, so that the cluster's topics, users and ACLs cannot drift from the code that the tests run:
* `kafka/topics.yaml`: a Strimzi `KafkaTopic` per topic of `schemas.topics.ALL_TOPICS` (partitions, replicas and
  min.insync.replicas from `schemas.topics.replication` for a 3-broker cluster, cleanup, retention, timestamps);
* `kafka/users.yaml`: a Strimzi `KafkaUser` (SCRAM-SHA-512, simple authorization) for each principal the stack
  needs (service, node, admin as operator, an auditor), its ACLs exactly `infra.principals.acls_for`;
* `clickhouse/replicated.sql`: `infra/ddl.sql` for a ClickHouse cluster: `ON CLUSTER '{cluster}'`, the
  Replicated* family of each engine keyed by `{shard}`/`{replica}` macros, `replicated_deduplication_window`
  where the embedded engine needs `non_replicated_deduplication_window` (the sink's insert tokens work the same).
The hand-written files beside them (kafka/cluster.yaml, k8s/*.yaml, systemd/*) are not rendered.
`tests/test_deployment.py` fails when a committed rendered file differs from what this renders.
"""
from __future__ import annotations

import re
import sys
from importlib import resources
from pathlib import Path

import yaml

from infra.principals import acls_for
from schemas.topics import ALL_TOPICS, TopicSpec

HERE = Path(__file__).resolve().parent
CLUSTER = "gpupool-kafka"  # the Strimzi Kafka resource's name (kafka/cluster.yaml)
BROKERS = 3
PRINCIPALS = (("service", "service"), ("node", "node"), ("admin", "operator"), ("auditor", "auditor"))
HEADER = "# Rendered by `python -m infra.deploy render` from {src}; do not edit (tests/test_deployment.py).\n"

# Strimzi's names for Kafka's ACL operations and pattern types
_OPS = {"read": "Read", "write": "Write", "describe": "Describe", "describe_configs": "DescribeConfigs",
        "create": "Create", "alter": "Alter", "all": "All", "delete": "Delete"}
_PATTERN = {"literal": "literal", "prefixed": "prefix"}


def _k8s_name(topic: str) -> str:
    return re.sub(r"[^a-z0-9-]", "-", topic.lower())


def kafka_topic(spec: TopicSpec, brokers: int = BROKERS) -> dict:
    return {"apiVersion": "kafka.strimzi.io/v1beta2", "kind": "KafkaTopic",
            "metadata": {"name": _k8s_name(spec.name), "labels": {"strimzi.io/cluster": CLUSTER}},
            "spec": {"topicName": spec.name, "partitions": spec.partitions,
                     "replicas": spec.replication(brokers).factor, "config": spec.config(brokers)}}


def kafka_user(name: str, role: str) -> dict:
    acls = []
    for a in acls_for(name, role):
        resource = {"type": a.resource}
        if a.resource != "cluster":
            resource.update(name=a.name, patternType=_PATTERN[a.pattern])
        acl = {"resource": resource, "operations": [_OPS[a.operation]], "host": a.host}
        if a.permission == "deny":
            acl["type"] = "deny"
        acls.append(acl)
    return {"apiVersion": "kafka.strimzi.io/v1beta2", "kind": "KafkaUser",
            "metadata": {"name": name, "labels": {"strimzi.io/cluster": CLUSTER, "gpupool.io/role": role}},
            "spec": {"authentication": {"type": "scram-sha-512"},
                     "authorization": {"type": "simple", "acls": acls}}}


def _docs(docs: list[dict]) -> str:
    return "".join("---\n" + yaml.safe_dump(d, sort_keys=False, width=120) for d in docs)


def topics_yaml() -> str:
    return HEADER.format(src="schemas/topics.py") + _docs([kafka_topic(s) for s in ALL_TOPICS])


def users_yaml() -> str:
    return HEADER.format(src="infra/principals.py") + _docs([kafka_user(n, r) for n, r in PRINCIPALS])


_CREATE_TABLE = re.compile(r"^CREATE TABLE IF NOT EXISTS (gpupool(?:_logs)?\.\w+) \(", re.M)
_ENGINE = re.compile(r"ENGINE = (ReplacingMergeTree|SummingMergeTree|MergeTree)(\(([^)]*)\))?")


def replicated_ddl(ddl: str) -> str:
    """`infra/ddl.sql` for a ClickHouse cluster (one statement per `;`, comments kept)."""
    out = []
    for stmt in _statements(ddl):
        s = stmt
        s = re.sub(r"^CREATE DATABASE IF NOT EXISTS (gpupool\w*);",
                   r"CREATE DATABASE IF NOT EXISTS \1 ON CLUSTER '{cluster}';", s, flags=re.M)
        table = _CREATE_TABLE.search(s) or re.search(r"CREATE (?:MATERIALIZED )?VIEW IF NOT EXISTS (gpupool\.\w+)", s)
        if table is not None:
            name = table.group(1)
            s = s.replace(name, f"{name} ON CLUSTER '{{cluster}}'", 1)

            def engine(m, name=name):
                args = f", {m.group(3)}" if m.group(3) else ""
                path = f"'/clickhouse/tables/{{shard}}/{name.replace('.', '/')}', '{{replica}}'"
                return f"ENGINE = Replicated{m.group(1)}({path}{args})"
            s = _ENGINE.sub(engine, s, count=1)
        s = re.sub(r"^ALTER TABLE (gpupool(?:_logs)?\.\w+) ", r"ALTER TABLE \1 ON CLUSTER '{cluster}' ", s, flags=re.M)
        s = "\n".join(ln if ln.lstrip().startswith("--") else
                      ln.replace("non_replicated_deduplication_window", "replicated_deduplication_window")
                      for ln in s.splitlines()) + "\n"
        out.append(s)
    return HEADER.format(src="infra/ddl.sql").replace("# ", "-- ", 1) + "".join(out)


def _statements(ddl: str) -> list[str]:
    """Statements with the comment lines before each, split at a `;` that ends a line."""
    parts, cur = [], []
    for line in ddl.splitlines():
        cur.append(line)
        if line.rstrip().endswith(";"):
            parts.append("\n".join(cur) + "\n")
            cur = []
    if any(ln.strip() for ln in cur):
        parts.append("\n".join(cur) + "\n")
    return parts


def statements_only(sql: str) -> list[str]:
    """The statements of a rendered file, without comments (for a parser)."""
    out = []
    for part in _statements(sql):
        body = "\n".join(ln for ln in part.splitlines() if not ln.lstrip().startswith("--")).strip()
        if body:
            out.append(body.rstrip(";"))
    return out


def rendered() -> dict[str, str]:
    ddl = resources.files("infra").joinpath("ddl.sql").read_text()
    return {"kafka/topics.yaml": topics_yaml(), "kafka/users.yaml": users_yaml(),
            "clickhouse/replicated.sql": replicated_ddl(ddl)}


def render(out: Path = HERE) -> list[Path]:
    written = []
    for rel, text in rendered().items():
        path = out / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        written.append(path)
    return written


def main(argv: list[str]) -> int:
    if not argv or argv[0] != "render":
        print(__doc__)
        return 2
    for path in render(Path(argv[1]) if len(argv) > 1 else HERE):
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
