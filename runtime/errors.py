"""The runtime's error types: one family, so callers can tell closed (you did it) from broken (something outside did)."""

from __future__ import annotations


class GyreError(Exception):
    """Base of every error the runtime raises on purpose."""


class CodecError(GyreError):
    """A frame could not be encoded or decoded."""


class UnknownMessageType(CodecError):
    """A frame names a message type this process does not know."""


class SchemaVersionMismatch(CodecError):
    """A frame carries a known type at a schema version this process does not speak."""


class MalformedFrame(CodecError):
    """A frame is truncated, garbage, or its fields do not fit the declared type."""


class UnknownAddress(GyreError):
    """A message was sent to an actor name that the topology does not contain."""


class Backpressure(GyreError):
    """The receiver's bounded queue is full: the sender must slow down (nothing was dropped)."""


class AskTimeout(GyreError, TimeoutError):
    """An ask got no reply within its timeout."""


class ActorDead(GyreError):
    """The actor asked is stopped or failed, so the ask can never be answered."""


class RemoteError(GyreError):
    """The actor asked raised while handling the ask; carries the remote error's type name and message."""

    def __init__(self, actor: str, error_type: str, message: str) -> None:
        super().__init__(f"{actor} raised {error_type}: {message}")
        self.actor = actor
        self.error_type = error_type
        self.message = message


class NoHandler(GyreError):
    """An actor received a message type it declares no handler for."""


class ConfigError(GyreError, ValueError):
    """A config field holds a value it cannot take (raised as the config is built, before anything starts)."""


class TopologyError(GyreError):
    """A topology is malformed: duplicate names, a config of the wrong class, an unknown policy."""


class ReplayError(GyreError):
    """A log cannot drive a replay of that actor: not in the log, its code untrusted or gone, the log unreadable."""


class CpuLimitsUnavailable(GyreError):
    """The topology asks for CPU limits and this machine gives no writable cgroup CPU controller."""


class Quiescent(GyreError):
    """The virtual loop has nothing ready and no timer pending: the topology can never act again.

    A control-flow signal, not a failure: `VirtualEventLoop` raises it out of its own selector, so it reaches only
    the caller of `run_until_complete`, never a coroutine. The launcher and replay catch it to end a run that has gone
    idle; a caller that does not expect the run to stall sees it as the reason the run stopped.
    """
