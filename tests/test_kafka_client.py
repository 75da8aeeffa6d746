"""infra/kafka_client.commit_or_reread: a commit a rebalance refuses is said and survived, never a crash."""
from __future__ import annotations

import asyncio
import logging

import pytest
from aiokafka.errors import CommitFailedError, IllegalStateError, KafkaConnectionError

from infra.kafka_client import commit_or_reread


class Consumer:
    def __init__(self, exc=None):
        self.exc, self.committed = exc, []

    async def commit(self, offsets=None):
        if self.exc is not None:
            raise self.exc
        self.committed.append(offsets)


def test_a_commit_goes_through():
    c = Consumer()
    assert asyncio.run(commit_or_reread(c, {"tp": 5}, logging.getLogger("t")))
    assert c.committed == [{"tp": 5}]


@pytest.mark.parametrize("exc", [IllegalStateError("No partitions assigned"), CommitFailedError("rebalanced")])
def test_a_commit_refused_after_a_rebalance_is_said_and_survived(exc, caplog):
    assert not asyncio.run(commit_or_reread(Consumer(exc), {"tp": 5}, logging.getLogger("t")))
    assert "read again" in caplog.text


def test_other_failures_still_propagate():
    with pytest.raises(KafkaConnectionError):
        asyncio.run(commit_or_reread(Consumer(KafkaConnectionError()), {"tp": 5}, logging.getLogger("t")))
