"""The one topic specification: infra scripts, workers, tests and the audit replayer all read it."""
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

    def config(self) -> dict[str, str]:
        cfg = {"cleanup.policy": self.cleanup}
        if self.cleanup == "delete":
            cfg["retention.ms"] = str(self.retention_ms)
        return cfg


INVENTORY = TopicSpec("gpupool.inventory", 8, key="node id", cleanup="compact")
TELEMETRY = TopicSpec("gpupool.telemetry", 8, key="node id", retention_ms=DAY_MS)
JOB_REQUESTS = TopicSpec("gpupool.job-requests", 4, key="job id")
JOB_EVENTS = TopicSpec("gpupool.job-events", 4, key="job id")
# One partition: the scheduler needs a single, totally ordered, replayable input (docs/architecture.md).
SCHEDULER_INPUT = TopicSpec("gpupool.scheduler-input", 1, key="source")
COMMANDS = TopicSpec("gpupool.commands", 8, key="node id")
LEDGER = TopicSpec("gpupool.ledger", 4, key="tenant")
DEAD_LETTERS = TopicSpec("gpupool.dead-letters", 1, key="source topic", retention_ms=30 * DAY_MS)

# Changelogs of the Faust tables (app id "gpupool"), created up front with the partition count of their source
# topics: Faust would create them itself, but a table written before its changelog's metadata arrives fails.
NODE_VIEW_CHANGELOG = TopicSpec("gpupool-node-view-changelog", 8, key="node id", cleanup="compact")
JOB_VIEW_CHANGELOG = TopicSpec("gpupool-job-view-changelog", 4, key="job id", cleanup="compact")

# inventory, telemetry and commands are co-partitioned (same key, same count): one Faust table folds all three.
ALL_TOPICS: tuple[TopicSpec, ...] = (
    INVENTORY, TELEMETRY, JOB_REQUESTS, JOB_EVENTS, SCHEDULER_INPUT, COMMANDS, LEDGER, DEAD_LETTERS,
    NODE_VIEW_CHANGELOG, JOB_VIEW_CHANGELOG,
)


def by_name(name: str) -> TopicSpec:
    for spec in ALL_TOPICS:
        if spec.name == name:
            return spec
    raise KeyError(name)
