"""The envelope: metadata that travels with every message, apart from the message itself (pykka, zguide Clone)."""

from __future__ import annotations

import enum

import attrs

#: Message ids are actor_index * ID_STRIDE + per-actor sequence: unique, deterministic, and their order per sender
#: is the sender's order.
ID_STRIDE = 2**40


class Kind(enum.IntEnum):
    """What a frame is for."""

    TELL = 0
    ASK = 1
    REPLY = 2
    EVENT = 3  # a published message, delivered to every subscriber of its type


@attrs.frozen(slots=True)
class Envelope:
    """Who sent what to whom, when, and because of which earlier message."""

    msg_id: int
    """Unique id: sender index * ID_STRIDE + sender sequence."""
    sender: str
    """Name of the sending actor ("" for a client outside the topology)."""
    receiver: str
    """Name of the receiving actor (for an event, the subscriber it was delivered to)."""
    topic: str
    """Wire type name of a published event; "" for an addressed message."""
    time_s: float
    """Sender's runtime-clock time when it sent the message."""
    correlation_id: int
    """For a reply: the msg_id of the ask it answers; else 0."""
    causation_id: int
    """msg_id of the message the sender was handling when it sent this one; 0 if none."""
    kind: Kind
    """TELL, ASK, REPLY or EVENT."""

    @property
    def sender_index(self) -> int:
        return self.msg_id // ID_STRIDE

    @property
    def sequence(self) -> int:
        return self.msg_id % ID_STRIDE
