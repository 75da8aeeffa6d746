"""Small aiokafka helpers shared by the edges."""
from __future__ import annotations

import functools

import asyncio


async def stop_consumer(consumer) -> None:
    """Stop an aiokafka consumer. aiokafka 0.14 can leak the CancelledError of its own committed-offset task when
    stop() follows start() closely; that must not cancel the caller. A real cancellation of the caller still
    propagates."""
    try:
        await consumer.stop()
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise


async def commit_or_reread(consumer, offsets, log) -> bool:
    """Commit what was carried out; when a rebalance took the partitions away meanwhile (a coordinator lost on a
    loaded machine, another member joining), say so and go on: whoever owns them next re-reads from the last commit,
    and every reader here is idempotent on a re-read (the gateway re-derives the same envelopes, the sink's rows
    replace themselves, commands are idempotent by id). Crashing the worker over it would be the worse outcome."""
    from aiokafka.errors import CommitFailedError, IllegalStateError

    try:
        await consumer.commit(offsets)
        return True
    except (CommitFailedError, IllegalStateError) as exc:
        log.warning("commit refused after a rebalance (%s): the records are read again", type(exc).__name__)
        return False


async def consume_commands(conn, group_id: str, stopping: asyncio.Event, execute, log) -> None:
    """The node agents' command loop: each command in order, undecodable ones skipped with a warning, offsets
    committed after the batch is carried out (commands are idempotent by id, so a redelivery is harmless)."""
    from aiokafka import AIOKafkaConsumer

    from schemas.envelope import DecodeError, decode
    from schemas.topics import COMMANDS

    consumer = AIOKafkaConsumer(COMMANDS.name, **conn.options(), group_id=group_id,
                                enable_auto_commit=False, auto_offset_reset="earliest")
    await consumer.start()
    try:
        while not stopping.is_set():
            batches = await consumer.getmany(timeout_ms=200)
            for tp, msgs in batches.items():
                for msg in msgs:
                    try:
                        env = decode(msg.value)
                    except DecodeError as exc:
                        log.warning("skipping undecodable command at %s/%d: %s", tp, msg.offset, exc)
                        continue
                    if not env.is_command:
                        log.warning("skipping %s at %s/%d: not a command", env.kind, tp, msg.offset)
                        continue
                    await execute(env)
            if batches:
                await commit_or_reread(consumer, None, log)
    finally:
        await stop_consumer(consumer)


@functools.lru_cache(maxsize=1 << 16)
def partition_of(key: bytes, partitions: int) -> int:
    """The partition Kafka's default partitioner (murmur2, as the Java client and aiokafka) gives `key`: where a
    node's records are, so which worker owns the node."""
    from aiokafka.partitioner import murmur2

    return (murmur2(key) & 0x7FFFFFFF) % partitions
