"""Small aiokafka helpers shared by the edges."""
from __future__ import annotations

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
