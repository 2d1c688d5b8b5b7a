"""The actor base class: handlers declared per message type, and the few things a handler may do.

A handler is a method marked `@handler(SomeMessage)`; it may be `def` or `async def`. When the message was an ask,
the handler's return value (a message) is the reply; a handler that raises on an ask sends the error back to the
asker and the actor goes on; a handler that raises on a tell fails the actor and its supervision policy decides
(restart, stop it, or stop the topology). Handlers of one actor run one at a time, in arrival order.

Actors never read the wall clock or global randomness: `self.clock` and `self.rng` are the runtime's, so a run
can be replayed and a whole topology can run in virtual time.
"""

from __future__ import annotations

import asyncio
import random
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Coroutine, TypeVar

import attrs
import structlog

from gyre.messages.runtime_control import StatisticsAsked
from gyre.runtime.clock import Clock
from gyre.runtime.errors import NoHandler

if TYPE_CHECKING:
    from gyre.runtime.node import ActorSlot

M = TypeVar("M")
R = TypeVar("R")


def handler(*message_types: type) -> Callable[[Callable], Callable]:
    """Mark a method as the handler of the given message types."""

    def mark(fn: Callable) -> Callable:
        fn.__gyre_handles__ = message_types  # type: ignore[attr-defined]
        return fn

    return mark


@attrs.frozen
class NoConfig:
    """The config of an actor that needs none."""


class Actor:
    """Subclass, declare `config_cls`, mark handlers with `@handler`, list published types in `subscriptions`."""

    config_cls: ClassVar[type] = NoConfig
    #: Published message types this actor receives (on top of messages addressed to it).
    subscriptions: ClassVar[tuple[type, ...]] = ()
    #: message type -> name of the method that handles it; built per class from the @handler marks.
    handler_table: ClassVar[dict[type, str]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        table: dict[type, str] = {}
        for klass in reversed(cls.__mro__):
            for name, value in vars(klass).items():
                for message_type in getattr(value, "__gyre_handles__", ()):
                    table[message_type] = name
        cls.handler_table = table

    def __init__(self, slot: "ActorSlot") -> None:
        self._slot = slot
        self.name: str = slot.name
        self.config = slot.config
        self.clock: Clock = slot.node.clock
        self.rng: random.Random = slot.rng
        self.log = structlog.get_logger(type(self).__module__).bind(actor=slot.name)

    # ---- hooks ----------------------------------------------------------------------------------------------------
    async def on_start(self) -> None:
        """Called before the first message is handled (and again after each restart)."""

    async def on_stop(self) -> None:
        """Called once when the actor stops (not when it fails)."""

    def statistics(self) -> Any:
        """This actor's counters as one frozen record, `<Actor>Statistics` (trio's `statistics()`): the answer to
        `StatisticsAsked`. Override it in an actor that keeps counters; it must not block or change state."""
        raise NoHandler(f"{type(self).__name__} keeps no statistics")

    @handler(StatisticsAsked)
    def on_statistics_asked(self, msg: StatisticsAsked) -> Any:
        return self.statistics()

    # ---- what a handler may do ------------------------------------------------------------------------------------
    def tell(self, to: str, msg: Any) -> None:
        """Send without waiting. Raises UnknownAddress for a name not in the topology, Backpressure if its queue is full."""
        self._slot.node.send_from(self._slot, to, msg)

    async def send(self, to: str, msg: Any, timeout_s: float | None = None) -> None:
        """Send, waiting (up to `timeout_s`, default the node's bound) while the receiver's queue is full."""
        await self._slot.node.send_waiting(self._slot, to, msg, timeout_s)

    def publish(self, msg: Any) -> None:
        """Deliver to every actor subscribed to this message's type (none is fine)."""
        self._slot.node.publish_from(self._slot, msg)

    async def ask(self, to: str, msg: Any, timeout_s: float | None = None) -> Any:
        """Send and wait for the reply. Raises AskTimeout, ActorDead, NoHandler or RemoteError."""
        return await self._slot.node.ask_from(self._slot, to, msg, timeout_s)

    def send_later(self, delay_s: float, msg: Any) -> asyncio.TimerHandle:
        """Deliver `msg` to this actor after `delay_s` of runtime-clock time (a timer). Cancel with `.cancel()`."""
        return self._slot.node.schedule_self(self._slot, delay_s, msg)

    async def offload(self, fn: Callable[..., R], *args: Any) -> R:
        """Run blocking compute off the event loop (inline in virtual time, so runs stay deterministic)."""
        return await self._slot.node.offload(fn, *args)

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str | None = None) -> asyncio.Task:
        """Run a background task owned by this actor: cancelled when it stops; if it raises, the actor fails."""
        return self._slot.spawn(coro, name)

    def stop_topology(self, reason: str, exit_code: int = 0) -> None:
        """Ask the supervisor to end the whole run."""
        self._slot.node.request_topology_stop(self._slot, reason, exit_code)

    @property
    def restarts(self) -> int:
        """Times this actor was restarted on its node after a failure (0 in its first life): an on_start that can
        rebuild state tells a restart from a fresh start by it."""
        return self._slot.restarts

    @property
    def current_message_id(self) -> int:
        """msg_id of the message being handled now (0 outside handlers)."""
        return self._slot.current_msg_id

