"""An asyncio event loop that runs in virtual time: when nothing is ready, it jumps to the next timer.

The same actor code runs under the real loop and under this one. Nothing here touches sockets: in virtual mode
every actor lives in one process and messages move through in-memory queues, so an idle loop means "advance the
clock", and a loop with no timers and nothing ready means the whole topology is quiescent.
"""

from __future__ import annotations

import asyncio
import selectors

from gyre.runtime.clock import VirtualClock
from gyre.runtime.errors import Quiescent

__all__ = ["Quiescent", "VirtualEventLoop", "run_virtual"]


class _TimeJumpSelector(selectors.BaseSelector):
    """A selector with no file descriptors to watch: waiting `timeout` seconds means advancing the clock by it."""

    def __init__(self, clock: VirtualClock) -> None:
        self._clock = clock
        self._keys: dict[int, selectors.SelectorKey] = {}
        self.next_timer_s = None  # set by the loop: exact time of its earliest timer

    def register(self, fileobj, events, data=None):  # the loop's self-pipe; never reported ready
        fd = fileobj if isinstance(fileobj, int) else fileobj.fileno()
        key = selectors.SelectorKey(fileobj, fd, events, data)
        self._keys[fd] = key
        return key

    def unregister(self, fileobj):
        fd = fileobj if isinstance(fileobj, int) else fileobj.fileno()
        return self._keys.pop(fd)

    def select(self, timeout=None):
        if timeout is None:
            raise Quiescent()
        if timeout > 0:
            # Jump exactly to the earliest timer. Adding `timeout` instead can fall short by rounding at large
            # times (epoch seconds), and a loop that never reaches its timer never ends.
            target = self.next_timer_s() if self.next_timer_s is not None else None
            self._clock.set(target if target is not None else self._clock.now() + timeout)
        return []

    def get_map(self):
        return self._keys

    def close(self) -> None:
        self._keys.clear()


class VirtualEventLoop(asyncio.SelectorEventLoop):
    """asyncio's selector loop with `time()` read from a VirtualClock that jumps when the loop would sleep."""

    def __init__(self, clock: VirtualClock) -> None:
        self.virtual_clock = clock
        selector = _TimeJumpSelector(clock)
        super().__init__(selector=selector)
        selector.next_timer_s = self._earliest_timer_s
        # asyncio runs a timer once `when < now + resolution`; at epoch-sized times the default 1e-9 vanishes in
        # rounding and a timer due exactly now would never run. One microsecond is far above float spacing there.
        self._clock_resolution = 1e-6

    def _earliest_timer_s(self) -> float | None:
        scheduled = self._scheduled  # asyncio's timer heap; its head is what the wait timeout was computed from
        return scheduled[0].when() if scheduled else None

    def time(self) -> float:
        return self.virtual_clock.now()


def run_virtual(main, clock: VirtualClock):
    """Run coroutine `main` on a fresh virtual loop; returns its result, or raises Quiescent if the run stalls."""
    loop = VirtualEventLoop(clock)
    try:
        asyncio.set_event_loop(loop)
        return loop.run_until_complete(main)
    finally:
        asyncio.set_event_loop(None)
        loop.close()
