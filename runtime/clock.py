"""Clocks behind one interface (TigerBeetle's Time/TimeSim, trio's MockClock): actors read time only through these."""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    """What an actor may ask about time."""

    def now(self) -> float:
        """Seconds since an arbitrary epoch; monotonic within one run."""
        ...


class RealClock:
    """Wall-clock seconds since the Unix epoch (so event logs read as dates), made monotonic within the process."""

    def __init__(self) -> None:
        self._last = 0.0

    def now(self) -> float:
        current = time.time()
        if current < self._last:  # the system clock stepped back: never let a run see time reverse
            current = self._last
        self._last = current
        return current


class VirtualClock:
    """Time that moves only when the deterministic runner advances it (to the next scheduled event)."""

    def __init__(self, start_s: float = 0.0) -> None:
        self._now = start_s

    def now(self) -> float:
        return self._now

    def advance(self, delta_s: float) -> None:
        if delta_s < 0:
            raise ValueError(f"virtual time cannot go back (delta {delta_s})")
        self._now += delta_s

    def set(self, when_s: float) -> None:
        """Jump to `when_s`; a jump into the past is ignored so that time stays monotonic."""
        if when_s > self._now:
            self._now = when_s
