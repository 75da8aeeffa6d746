"""The one topic specification: infra scripts, workers, tests, the ACLs and the audit replayer all read it.

Each topic has exactly one writing role (`writer`), and each kind of record has exactly one home topic
(schemas/routing.py): so the broker's ACLs decide who may state which fact, and a consumer that finds a kind off its
home topic drops it (docs/security.md). Requests from people arrive on per-principal inboxes (`gpupool.in.NAME`):
the topic a record was written to names the principal that wrote it.
"""
from __future__ import annotations

from dataclasses import dataclass

DAY_MS = 24 * 3600 * 1000


@dataclass(frozen=True)
class TopicSpec:
    name: str
    partitions: int
    key: str  # what the record key holds; documents co-partitioning
    cleanup: str = "delete"  # "delete" | "compact"
    retention_ms: int = -1  # -1: keep forever (the log is the truth)
    writer: str = "service"  # the one role whose principals may write it (infra/principals.py turns this into ACLs)
    log_append_time: bool = False  # the broker stamps each record's time: readers take time from the log
    extra: tuple[tuple[str, str], ...] = ()  # further topic configs

    def replication(self, brokers: int) -> "Replication":
        return replication(brokers)

    def config(self, brokers: int = 1) -> dict[str, str]:
        cfg = {"cleanup.policy": self.cleanup, "min.insync.replicas": str(replication(brokers).min_insync)}
        if self.cleanup == "delete":
            cfg["retention.ms"] = str(self.retention_ms)
        if self.log_append_time:
            cfg["message.timestamp.type"] = "LogAppendTime"
        cfg.update(self.extra)
        return cfg


@dataclass(frozen=True)
class Replication:
    factor: int
    min_insync: int


def replication(brokers: int) -> Replication:
    """How many copies each partition keeps on a cluster of `brokers`: three where there are three or more (and a
    write, acks=all, needs two in sync: one broker may fail without losing an acknowledged record or stopping the
    writers), else one each on the brokers there are."""
    if brokers < 1:
        raise ValueError("a cluster has at least one broker")
    factor = min(3, brokers)
    return Replication(factor, 2 if factor >= 3 else 1)


# What node agents report, relayed by the worker from each node principal's own channel (`gpupool.node.NAME`, below)
# once it checked that the report is about a node the principal speaks for (streams/folds/node_relay.py)
INVENTORY = TopicSpec("gpupool.inventory", 8, key="node id", cleanup="compact")
# the broker stamps telemetry: a node's heartbeats are judged on the log's time, not the node's or the worker's
TELEMETRY = TopicSpec("gpupool.telemetry", 8, key="node id", retention_ms=DAY_MS, log_append_time=True)
JOB_EVENTS = TopicSpec("gpupool.job-events", 4, key="job id")  # what a node did with a job
# what a job's program wrote to stdout and stderr (job.log), relayed from its node's channel; kept a week here and for
# the retention of the ClickHouse table it lands in (docs/jobs.md, "Logs")
JOB_LOGS = TopicSpec("gpupool.job-logs", 4, key="job id", retention_ms=7 * DAY_MS)
# Written by the service (worker, scheduler, sink): what was asked (after the gateway), decided and commanded
JOB_REQUESTS = TopicSpec("gpupool.job-requests", 4, key="job id")
DECISIONS = TopicSpec("gpupool.decisions", 4, key="job id")  # pending reasons, rejections, reservation/service answers
NODE_CONTROL = TopicSpec("gpupool.node-control", 8, key="node id")  # cordon/drain, card health, liveness
# History a minute at a time, measured by the worker (docs/observability.md): telemetry downsampled per card
# (telemetry.minute, keyed by node) and the pool's allocation, fragmentation and queue (pool.minute, keyed by worker).
# The sink writes them to ClickHouse, which keeps them as long as this topic does.
TELEMETRY_MINUTES = TopicSpec("gpupool.telemetry-minutes", 8, key="node id", retention_ms=30 * DAY_MS)
# One partition: the scheduler needs a single, totally ordered, replayable input (docs/architecture.md); its clock is
# the broker's append time of each record, so no producer's clock moves it.
SCHEDULER_INPUT = TopicSpec("gpupool.scheduler-input", 1, key="source", log_append_time=True)
# the scheduler's state every N input records or T s of log time, keyed by the input offset it covers
# (streams/edge/scheduler_snapshot.py); compacted: older snapshots are deleted by tombstones
SCHEDULER_SNAPSHOTS = TopicSpec("gpupool.scheduler-snapshots", 1, key="input offset (20 digits)", cleanup="compact",
                                extra=(("max.message.bytes", str(64 << 20)), ("segment.ms", str(600_000)),
                                       ("min.cleanable.dirty.ratio", "0.1")))
COMMANDS = TopicSpec("gpupool.commands", 8, key="node id")
LEDGER = TopicSpec("gpupool.ledger", 4, key="tenant")
DEAD_LETTERS = TopicSpec("gpupool.dead-letters", 1, key="source topic", retention_ms=30 * DAY_MS)
# The log's clock: each worker appends an empty record every second and reads the broker's append time back, its
# "now" for judging liveness in log time (streams/folds/liveness.py). Nobody consumes it.
CLOCK = TopicSpec("gpupool.clock", 1, key="worker", retention_ms=3600 * 1000, log_append_time=True)
# Written by operators: who is who (name -> role, tenant, HTTP token digest)
PRINCIPALS = TopicSpec("gpupool.principals", 1, key="principal", cleanup="compact", writer="operator")

# Changelogs of the Faust tables (app id "gpupool"), created up front with the partition count of their source
# topics: Faust would create them itself, but a table written before its changelog's metadata arrives fails.
NODE_VIEW_CHANGELOG = TopicSpec("gpupool-node-view-changelog", 8, key="node id", cleanup="compact")
JOB_VIEW_CHANGELOG = TopicSpec("gpupool-job-view-changelog", 4, key="job id", cleanup="compact")

# inventory, telemetry, node-control and commands are co-partitioned (same key, same count): one Faust table folds
# them; job-requests, decisions and job-events likewise.
ALL_TOPICS: tuple[TopicSpec, ...] = (
    INVENTORY, TELEMETRY, JOB_EVENTS, JOB_LOGS, JOB_REQUESTS, DECISIONS, NODE_CONTROL, SCHEDULER_INPUT, COMMANDS, LEDGER,
    DEAD_LETTERS, CLOCK, PRINCIPALS, NODE_VIEW_CHANGELOG, JOB_VIEW_CHANGELOG, TELEMETRY_MINUTES, SCHEDULER_SNAPSHOTS,
)

INBOX_PREFIX = "gpupool.in."
NODE_CHANNEL_PREFIX = "gpupool.node."  # not to be confused with gpupool.node-control: the dot is the difference


def inbox(principal: str) -> TopicSpec:
    """The request topic of one principal (tenant or operator role): only it may write there, so the gateway takes
    the principal, and so the tenant, from the topic. The broker stamps the time."""
    return TopicSpec(f"{INBOX_PREFIX}{principal}", 1, key="request subject", writer=f"principal {principal}",
                     log_append_time=True)


def inbox_owner(topic: str) -> str | None:
    return topic[len(INBOX_PREFIX):] if topic.startswith(INBOX_PREFIX) else None


def node_channel(principal: str) -> TopicSpec:
    """What one node principal reports (inventory, telemetry, its jobs' events): only it may write there, so the
    worker's relay takes the principal, and so the nodes it may speak for, from the topic."""
    return TopicSpec(f"{NODE_CHANNEL_PREFIX}{principal}", 1, key="node id", retention_ms=DAY_MS,
                     writer=f"principal {principal}", log_append_time=True)


def channel_owner(topic: str) -> str | None:
    return topic[len(NODE_CHANNEL_PREFIX):] if topic.startswith(NODE_CHANNEL_PREFIX) else None


def by_name(name: str) -> TopicSpec:
    for spec in ALL_TOPICS:
        if spec.name == name:
            return spec
    if inbox_owner(name):
        return inbox(inbox_owner(name))
    if channel_owner(name):
        return node_channel(channel_owner(name))
    raise KeyError(name)
