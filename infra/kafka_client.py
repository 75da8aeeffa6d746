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


class CheckedProducer:
    """An idempotent producer whose deliveries are checked before the input they came from is committed.

    aiokafka's `flush()` waits for the batches in flight but does not raise when one failed: the delivery's future
    holds the error. Committing after such a flush loses the records (seen under load after a broker restart:
    `OutOfOrderSequenceNumber`, from which aiokafka's idempotent producer does not recover). So every send's future
    is kept; `flush()` says whether all were acknowledged, and if not replaces the producer (a new producer id:
    sequence numbers start afresh) so that the caller reads its input again from its last commit (`rewind`)."""

    def __init__(self, make, log):
        self._make = make  # () -> an unstarted AIOKafkaProducer
        self.log = log
        self.producer = None
        self._sent: list = []
        self.replaced = 0

    async def start(self) -> None:
        self.producer = self._make()
        await self.producer.start()

    async def send(self, topic, value=None, key=None, **kw):
        fut = await self.producer.send(topic, value=value, key=key, **kw)
        self._sent.append(fut)
        return fut

    async def flush(self) -> bool:
        """True when every record sent since the last flush was acknowledged; else the producer is replaced."""
        import asyncio

        await self.producer.flush()
        sent, self._sent = self._sent, []
        if sent:
            await asyncio.wait(sent)  # flush has waited for them; a batch still retrying is waited out here
        errors = [f.exception() for f in sent if f.cancelled() or f.exception() is not None]
        if not errors:
            return True
        self.replaced += 1
        self.log.warning("%d of %d records not acknowledged (%s): replacing the producer and reading again from "
                         "the last commit", len(errors), len(sent), type(errors[0]).__name__)
        old, self.producer = self.producer, None
        try:
            await old.stop()
        except Exception as exc:  # noqa: BLE001 - the old one is broken already
            self.log.warning("stopping the old producer: %s", exc)
        await self.start()
        return False

    async def stop(self) -> None:
        if self.producer is not None:
            await self.producer.stop()


async def rewind(consumer, partitions) -> None:
    """Read `partitions` again from their last committed offsets (after a batch whose outputs were not all
    acknowledged: every reader here re-derives the same outputs, which their consumers drop as duplicates)."""
    for tp in partitions:
        committed = await consumer.committed(tp)
        if committed is None:
            await consumer.seek_to_beginning(tp)
        else:
            consumer.seek(tp, committed)


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
