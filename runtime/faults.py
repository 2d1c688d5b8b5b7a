"""Seeded fault plans for runs in virtual time (issue 28, TigerBeetle's VOPR in miniature): kill an actor at a given
message, drop, delay or duplicate messages between two actors, cut an actor off for a while.

A plan is text, one fault per `;`:

    kill ACTOR at N TYPE              ACTOR fails (as if its process died) as its N-th TYPE message arrives; that
                                      message dies with it; its restart policy decides what follows
    drop SENDER>RECEIVER TYPE N [K]   the N-th TYPE message from SENDER to RECEIVER, and the K-1 after it, vanish
    delay SENDER>RECEIVER TYPE S      every TYPE message from SENDER to RECEIVER arrives S virtual seconds late
    duplicate SENDER>RECEIVER TYPE N  the N-th TYPE message from SENDER to RECEIVER arrives twice
    partition ACTOR FROM UNTIL        every message to or from ACTOR between virtual times FROM and UNTIL vanishes

ACTOR, SENDER, RECEIVER and TYPE may be `*` (any); TYPE matches a message's class name or wire name. Replies to
asks are never touched (an ask whose request vanished times out, which is the fault the asker sees). `random_plan`
draws a plan of one kind from a seed, so `gyre bench faults` and tests sweep kinds x seeds.

`FaultInjector` applies a plan to a node (`Node.fault_injector`, gyre.runtime.testing.run_with_faults); it counts
what it did (`applied`), so a harness can tell a fault that fired from one that never met its message.
"""

from __future__ import annotations

import collections
import math
import random
from typing import Any, Callable

import attrs

from gyre.runtime.envelope import Envelope, Kind
from gyre.runtime.errors import GyreError

__all__ = ["FAULT_KINDS", "Fault", "FaultInjector", "FaultPlanError", "InjectedFault", "parse_plan", "random_plan"]

FAULT_KINDS = ("kill", "drop", "delay", "duplicate", "partition")


class FaultPlanError(GyreError, ValueError):
    """A fault plan that does not parse or names an impossible fault."""


class InjectedFault(GyreError, RuntimeError):
    """What a killed actor fails with: the plan's doing, not a bug of the actor."""


@attrs.frozen
class Fault:
    """One fault of a plan (module docstring)."""

    kind: str = attrs.field(validator=attrs.validators.in_(FAULT_KINDS))
    actor: str = "*"
    """kill / partition: the actor; the others: the receiver."""
    sender: str = "*"
    message: str = "*"
    nth: int = 1
    count: int = 1
    delay_s: float = 0.0
    from_s: float = 0.0
    until_s: float = math.inf

    def matches(self, envelope: Envelope, type_name: str) -> bool:
        if self.message != "*" and type_name != self.message and not type_name.endswith("." + self.message):
            return False
        if self.kind == "partition":
            return self.actor in (envelope.sender, envelope.receiver) or self.actor == "*"
        return self.actor in ("*", envelope.receiver) and self.sender in ("*", envelope.sender)

    def describe(self) -> str:
        if self.kind == "kill":
            return f"kill {self.actor} at {self.nth} {self.message}"
        if self.kind == "partition":
            return f"partition {self.actor} {self.from_s:g} {self.until_s:g}"
        pair = f"{self.sender}>{self.actor} {self.message}"
        if self.kind == "drop":
            return f"drop {pair} {self.nth} {self.count}"
        if self.kind == "delay":
            return f"delay {pair} {self.delay_s:g}"
        return f"duplicate {pair} {self.nth}"


def _number(word: str, what: str, cast: Callable[[str], Any] = int) -> Any:
    try:
        value = cast(word)
    except ValueError:
        raise FaultPlanError(f"{what} must be a number, got {word!r}") from None
    if value < 0 or (cast is int and value < 1 and what != "count") or (cast is float and not math.isfinite(value)):
        raise FaultPlanError(f"{what} out of range: {word!r}")
    return value


def _pair(word: str) -> tuple[str, str]:
    sender, arrow, receiver = word.partition(">")
    if not arrow or not sender or not receiver:
        raise FaultPlanError(f"expected SENDER>RECEIVER, got {word!r}")
    return sender, receiver


def parse_plan(text: str) -> tuple[Fault, ...]:
    """The faults of a plan's text (module docstring). Raises FaultPlanError naming the bad fault."""
    faults = []
    for part in (p.strip() for p in text.split(";")):
        if not part:
            continue
        words = part.split()
        kind = words[0]
        try:
            if kind == "kill" and len(words) == 5 and words[2] == "at":
                faults.append(Fault("kill", actor=words[1], nth=_number(words[3], "N"), message=words[4]))
            elif kind == "drop" and len(words) in (4, 5):
                sender, receiver = _pair(words[1])
                faults.append(Fault("drop", actor=receiver, sender=sender, message=words[2],
                                    nth=_number(words[3], "N"),
                                    count=_number(words[4], "count") if len(words) == 5 else 1))
            elif kind == "delay" and len(words) == 4:
                sender, receiver = _pair(words[1])
                faults.append(Fault("delay", actor=receiver, sender=sender, message=words[2],
                                    delay_s=_number(words[3], "seconds", float)))
            elif kind == "duplicate" and len(words) == 4:
                sender, receiver = _pair(words[1])
                faults.append(Fault("duplicate", actor=receiver, sender=sender, message=words[2],
                                    nth=_number(words[3], "N")))
            elif kind == "partition" and len(words) == 4:
                start, end = _number(words[2], "FROM", float), _number(words[3], "UNTIL", float)
                if end <= start:
                    raise FaultPlanError(f"UNTIL must be after FROM in {part!r}")
                faults.append(Fault("partition", actor=words[1], from_s=start, until_s=end))
            else:
                raise FaultPlanError(f"unknown fault or wrong number of words (kinds: {', '.join(FAULT_KINDS)})")
        except FaultPlanError as error:
            raise FaultPlanError(f"fault {part!r}: {error}") from None
    return tuple(faults)


def random_plan(kind: str, seed: int, *, actors: tuple[str, ...], links: tuple[tuple[str, str, str], ...],
                horizon_s: float) -> str:
    """A plan of one fault of `kind` drawn from `seed`: `actors` to kill or cut off (kill: at one of their first
    messages of any type), `links` (sender, receiver, type) to drop, delay or duplicate on, within `horizon_s`."""
    rng = random.Random(f"faults:{kind}:{seed}")
    if kind == "kill":
        return f"kill {rng.choice(actors)} at {rng.randint(2, 12)} *"
    if kind == "partition":
        start = rng.uniform(0.1, 0.6) * horizon_s
        return f"partition {rng.choice(actors)} {start:.3f} {start + rng.uniform(0.25, 0.6) * horizon_s:.3f}"
    sender, receiver, message = rng.choice(links)
    if kind == "drop":
        return f"drop {sender}>{receiver} {message} {rng.randint(1, 4)} 1"
    if kind == "delay":
        return f"delay {sender}>{receiver} {message} {rng.uniform(0.05, 3.0):.3f}"
    if kind == "duplicate":
        return f"duplicate {sender}>{receiver} {message} {rng.randint(1, 4)}"
    raise FaultPlanError(f"unknown fault kind {kind!r} (kinds: {', '.join(FAULT_KINDS)})")


class FaultInjector:
    """Decides each delivery's fate under a plan. `intercept` returns what to do with one message:
    ("deliver", 0.0), ("deliver", delay_s), ("drop", 0.0), ("duplicate", 0.0) or ("kill", 0.0)."""

    def __init__(self, faults: tuple[Fault, ...], type_name_of: Callable[[type], str]) -> None:
        self.faults = faults
        self.type_name_of = type_name_of
        self.seen: collections.Counter[int] = collections.Counter()
        """Fault index -> matching messages seen so far."""
        self.applied: list[tuple[float, str, str]] = []
        """(time, the fault, the message's sender>receiver type) for every fault that fired."""

    def intercept(self, envelope: Envelope, msg: Any, now_s: float) -> tuple[str, float]:
        if envelope.kind == Kind.REPLY or envelope.receiver == "supervisor":
            return "deliver", 0.0
        type_name = self.type_name_of(type(msg))
        delay = 0.0
        for index, fault in enumerate(self.faults):
            if not fault.matches(envelope, type_name):
                continue
            if fault.kind == "partition":
                if fault.from_s <= now_s < fault.until_s:
                    return self._fired(now_s, fault, envelope, type_name, "drop")
                continue
            if fault.kind == "delay":
                delay = max(delay, fault.delay_s)
                self._note(now_s, fault, envelope, type_name)
                continue
            self.seen[index] += 1
            number = self.seen[index]
            if fault.kind == "kill" and number == fault.nth:
                return self._fired(now_s, fault, envelope, type_name, "kill")
            if fault.kind == "drop" and fault.nth <= number < fault.nth + fault.count:
                return self._fired(now_s, fault, envelope, type_name, "drop")
            if fault.kind == "duplicate" and number == fault.nth:
                return self._fired(now_s, fault, envelope, type_name, "duplicate")
        return "deliver", delay

    def _note(self, now_s: float, fault: Fault, envelope: Envelope, type_name: str) -> None:
        self.applied.append((now_s, fault.describe(), f"{envelope.sender}>{envelope.receiver} {type_name}"))

    def _fired(self, now_s: float, fault: Fault, envelope: Envelope, type_name: str, action: str) -> tuple[str, float]:
        self._note(now_s, fault, envelope, type_name)
        return action, 0.0
