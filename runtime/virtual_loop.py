"""An asyncio event loop that runs in virtual time: when nothing is ready, it jumps to the next timer.

The same actor code runs under the real loop and under this one. Nothing here touches sockets: in virtual mode
every actor lives in one process and messages move through in-memory queues, so an idle loop means "advance the
clock", and a loop with no timers and nothing ready means the whole topology is quiescent.
"""

from __future__ import annotations

import asyncio
import contextvars
import heapq
import selectors

from gyre.runtime.clock import VirtualClock
from gyre.runtime.errors import Quiescent

__all__ = ["Quiescent", "VirtualEventLoop", "run_virtual"]

# asyncio's own bounds (base_events.py), which _run_once below keeps: a heap of over 100 timers, more than half of
# them cancelled, is rebuilt; no select waits longer than a day.
_MIN_SCHEDULED_TIMER_HANDLES = 100
_MIN_CANCELLED_FRACTION = 0.5
_MAXIMUM_SELECT_TIMEOUT = 24 * 3600

# Handles are built slot by slot below where asyncio's are the ones this was written against (CPython 3.11): their
# __init__ and the get_debug() it calls are two Python calls per callback, and a virtual run schedules two or three
# callbacks per message. Any other layout of the classes is built by asyncio's own constructors.
_SLOTTED_HANDLES = (
    tuple(asyncio.Handle.__slots__) == ("_callback", "_args", "_cancelled", "_loop", "_source_traceback", "_repr",
                                        "__weakref__", "_context")
    and tuple(asyncio.TimerHandle.__slots__) == ("_scheduled", "_when")
)
_Handle, _TimerHandle, _copy_context, _object_new = (asyncio.Handle, asyncio.TimerHandle, contextvars.copy_context,
                                                     object.__new__)


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

    # call_soon and call_at as asyncio's, without its four Python calls per callback (_check_closed, _call_soon,
    # Handle.__init__ and the get_debug() in it): every message takes two or three of them (a timer, the node's
    # flush, a mailbox task's wake-up). The handle gets Handle.__init__'s fields, in its order; the source traceback
    # it records only in debug mode, which keeps asyncio's own path.
    def call_soon(self, callback, *args, context=None):  # noqa: ANN001, ANN201 - asyncio's signature
        if self._debug or not _SLOTTED_HANDLES:
            return super().call_soon(callback, *args, context=context)
        if self._closed:
            raise RuntimeError("Event loop is closed")
        handle = _object_new(_Handle)
        handle._context = _copy_context() if context is None else context
        handle._loop = self
        handle._callback = callback
        handle._args = args
        handle._cancelled = False
        handle._repr = None
        handle._source_traceback = None
        self._ready.append(handle)
        return handle

    def call_at(self, when, callback, *args, context=None):  # noqa: ANN001, ANN201 - asyncio's signature
        if self._debug or when is None or not _SLOTTED_HANDLES:
            return super().call_at(when, callback, *args, context=context)
        if self._closed:
            raise RuntimeError("Event loop is closed")
        timer = _object_new(_TimerHandle)
        timer._context = _copy_context() if context is None else context
        timer._loop = self
        timer._callback = callback
        timer._args = args
        timer._cancelled = False
        timer._repr = None
        timer._source_traceback = None
        timer._when = when
        heapq.heappush(self._scheduled, timer)
        timer._scheduled = True
        return timer

    def create_future(self) -> asyncio.Future:
        return asyncio.Future(loop=self)

    def _run_once(self) -> None:
        """One turn of the loop: asyncio's `BaseEventLoop._run_once` (Python 3.11), step for step in the same order,
        less what a loop without file descriptors never needs: with a callback ready the base loop polls its
        selector with timeout 0 and processes no events, which here does nothing; it is skipped. A virtual run
        turns this loop once or twice per message, so the saved calls show (BENCHMARKS.md, gyre simulate, session
        26). Debug mode keeps the base loop's own turn (slow-callback warnings)."""
        if self._debug:
            super()._run_once()
            return
        scheduled = self._scheduled
        count = len(scheduled)
        if count > _MIN_SCHEDULED_TIMER_HANDLES and self._timer_cancelled_count / count > _MIN_CANCELLED_FRACTION:
            # Too many cancelled timers: drop them all and rebuild the heap.
            kept = []
            for handle in scheduled:
                if handle._cancelled:
                    handle._scheduled = False
                else:
                    kept.append(handle)
            heapq.heapify(kept)
            self._scheduled = scheduled = kept
            self._timer_cancelled_count = 0
        else:
            while scheduled and scheduled[0]._cancelled:
                self._timer_cancelled_count -= 1
                handle = heapq.heappop(scheduled)
                handle._scheduled = False
        ready = self._ready
        if not ready and not self._stopping:
            # Nothing to run: the selector jumps the clock to the earliest timer, or raises Quiescent if none is left.
            timeout = None
            if scheduled:
                timeout = min(max(0, scheduled[0]._when - self.time()), _MAXIMUM_SELECT_TIMEOUT)
            self._selector.select(timeout)
        end_time = self.time() + self._clock_resolution
        while scheduled:
            if scheduled[0]._when >= end_time:
                break
            handle = heapq.heappop(scheduled)
            handle._scheduled = False
            ready.append(handle)
        # Only what is ready now runs in this turn; what these callbacks schedule runs in the next one.
        for _ in range(len(ready)):
            handle = ready.popleft()
            if handle._cancelled:
                continue
            handle._run()
        handle = None  # break the cycle an exception's traceback would make


def run_virtual(main, clock: VirtualClock):
    """Run coroutine `main` on a fresh virtual loop; returns its result, or raises Quiescent if the run stalls."""
    loop = VirtualEventLoop(clock)
    try:
        asyncio.set_event_loop(loop)
        return loop.run_until_complete(main)
    finally:
        asyncio.set_event_loop(None)
        loop.close()
