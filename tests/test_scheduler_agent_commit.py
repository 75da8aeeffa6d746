"""The scheduler agent commits its input offset after a batch's outputs are acknowledged. A rebalance may take the
partition away while the batch is sent (a second worker joins, a coordinator moves): the commit then finds the
partition no longer this consumer's. The agent stands by -- the owner now rebuilds from the offset last committed and
decides that batch again, the same outputs deduplicated downstream -- instead of the whole worker crashing, which is
what CI's chaos suite saw (streams/edge/scheduler_agent.py `_commit`). On a real broker: a consumer of the scheduler's
group that holds no partition commits as one whose partition was just taken."""
from __future__ import annotations

import asyncio

from aiokafka import AIOKafkaConsumer

from infra.kafka_client import stop_consumer
from infra.security import SERVICE
from streams.edge.scheduler_agent import GROUP, SchedulerAgent


def test_a_commit_after_the_partition_moved_stands_by_instead_of_crashing(stack):
    async def go():
        conn = stack.conn(SERVICE)
        consumer = AIOKafkaConsumer(**conn.options(), group_id=GROUP, enable_auto_commit=False)
        await consumer.start()
        try:
            agent = SchedulerAgent(stack.config, conn)
            agent.live, agent.position = True, 7
            assert await agent._commit(consumer) is False
            assert agent.live is False  # it stands by; the loop rebuilds when the partition is its own again
        finally:
            await stop_consumer(consumer)

    asyncio.run(go())
