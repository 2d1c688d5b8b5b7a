"""The ping-pong example's conversation (examples/ping_pong.py); also used by the runtime's tests and benchmark."""

from __future__ import annotations

from gyre.messages._define import message


@message("gyre.ping_pong.Tick")
class Tick:
    """A timer firing in ping."""

    number: int
    """How many ticks came before this one."""


@message("gyre.ping_pong.Ball")
class Ball:
    """A ball in play."""

    number: int
    """Serve number, from 1."""
    spin: int
    """Some state that each hit changes."""


@message("gyre.ping_pong.ScoreAsked")
class ScoreAsked:
    """Ask pong how many balls it returned."""


@message("gyre.ping_pong.Score")
class Score:
    """Pong's answer."""

    returned: int
    """Balls returned so far."""


@message("gyre.ping_pong.Echo")
class Echo:
    """A payload to bounce back unchanged (benchmarks and tests)."""

    sequence: int
    """Caller's counter."""
    payload: bytes
    """Opaque bytes."""
