"""An event loop on virtual time, for tests of code that schedules by the loop's clock (`loop.time()`,
`asyncio.sleep`, `wait_for` timeouts) and does no I/O of its own: time stands still while anything is ready to run,
and when nothing is, it moves straight to the next timer. What such a test asserts about "before its delay" and
"after it" then holds however loaded the machine is -- no wall-clock window -- and the test takes no real time.

Only for code without threads or sockets that must be waited for: a wait on those would be skipped over (virtual
time would run past it at once)."""
from __future__ import annotations

import asyncio


class VirtualClockLoop(asyncio.SelectorEventLoop):
    def __init__(self) -> None:
        super().__init__()
        self._now = 0.0
        real = self._selector.select

        def select(timeout=None):
            events = real(0)
            if events or timeout == 0:
                return events
            if timeout is None:
                return real(None)  # no timer at all: only I/O (the loop's own wake-up) can move anything
            self._now += timeout  # nothing ready: the next timer is due now
            return []

        self._selector.select = select

    def time(self) -> float:
        return self._now


def run_virtual(coro, timeout: float = 600.0):
    """`asyncio.run(asyncio.wait_for(coro, timeout))` on virtual time (the timeout too)."""
    loop = VirtualClockLoop()
    try:
        asyncio.set_event_loop(loop)
        return loop.run_until_complete(asyncio.wait_for(coro, timeout))
    finally:
        try:
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            asyncio.set_event_loop(None)
            loop.close()
