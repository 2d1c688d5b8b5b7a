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


# Envelope(...) for the paths every message takes (node.py): an envelope is built per message and per subscriber,
# and attrs' frozen __init__ goes through object.__setattr__ by name for each of the eight fields (1.35 us here);
# setting the slots through their descriptors is the same object for half of that. A field added to Envelope must be
# added here too: the check below refuses to import otherwise.
_FIELDS = ("msg_id", "sender", "receiver", "topic", "time_s", "correlation_id", "causation_id", "kind")
if tuple(field.name for field in attrs.fields(Envelope)) != _FIELDS:
    raise RuntimeError("Envelope's fields changed: update envelope._FIELDS and _new_envelope")
(_set_msg_id, _set_sender, _set_receiver, _set_topic, _set_time_s, _set_correlation_id, _set_causation_id,
 _set_kind) = (Envelope.__dict__[name].__set__ for name in _FIELDS)
_object_new = object.__new__


def _new_envelope(msg_id: int, sender: str, receiver: str, topic: str, time_s: float, correlation_id: int,
                  causation_id: int, kind: Kind) -> Envelope:
    """`Envelope(msg_id, sender, ...)`, equal to it in every field, at half the cost (see above)."""
    envelope = _object_new(Envelope)
    _set_msg_id(envelope, msg_id)
    _set_sender(envelope, sender)
    _set_receiver(envelope, receiver)
    _set_topic(envelope, topic)
    _set_time_s(envelope, time_s)
    _set_correlation_id(envelope, correlation_id)
    _set_causation_id(envelope, causation_id)
    _set_kind(envelope, kind)
    return envelope
