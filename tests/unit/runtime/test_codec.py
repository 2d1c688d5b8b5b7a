"""The wire codec: every registered message round-trips; bad frames of every kind give typed errors, never others."""

from __future__ import annotations

import enum
import types
import typing
from typing import Any

import attrs
import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gyre.messages import REGISTERED
from gyre.messages.ping_pong import Ball, Echo, ScoreAsked
from gyre.messages.runtime_control import ActorStarted
from gyre.runtime import (
    Codec,
    CodecError,
    Envelope,
    Kind,
    MalformedFrame,
    SchemaVersionMismatch,
    UnknownMessageType,
)
from gyre.runtime.codec import FORMAT_VERSION

_INT64 = st.integers(min_value=-(2**63), max_value=2**64 - 1)
# Few examples per class (there are dozens of classes and two slow cores); the garbage tests below take more.
_SETTINGS = settings(max_examples=10, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])


def strategy_for(annotation: Any) -> st.SearchStrategy:
    """Values of one field, generated from its annotation (only the shapes the wire allows)."""
    origin = typing.get_origin(annotation)
    if annotation is type(None) or annotation is None:
        return st.none()
    if annotation is bool:
        return st.booleans()
    if annotation is int:
        return _INT64
    if annotation is float:
        return st.floats(allow_nan=False)  # NaN never equals itself; the bytes still round-trip
    if annotation is str:
        return st.text(max_size=20)
    if annotation is bytes:
        return st.binary(max_size=40)
    if annotation is Any:
        return st.one_of(st.none(), st.booleans(), _INT64, st.text(max_size=8))
    if origin in (typing.Union, types.UnionType):
        return st.one_of(*[strategy_for(arg) for arg in typing.get_args(annotation)])
    if origin is tuple or annotation is tuple:
        args = typing.get_args(annotation)
        if len(args) == 2 and args[1] is Ellipsis:
            return st.lists(strategy_for(args[0]), max_size=4).map(tuple)
        if args:
            return st.tuples(*[strategy_for(arg) for arg in args])
        return st.lists(_INT64, max_size=4).map(tuple)
    if origin is dict or annotation is dict:
        args = typing.get_args(annotation)
        values = strategy_for(args[1]) if len(args) == 2 else st.text(max_size=8)
        return st.dictionaries(st.text(max_size=8), values, max_size=4)
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return st.sampled_from(list(annotation))
    if isinstance(annotation, type) and hasattr(annotation, "__gyre_type__"):
        return message_strategy(annotation)
    raise TypeError(f"no strategy for {annotation!r}: the codec would refuse it too")


def message_strategy(cls: type) -> st.SearchStrategy:
    hints = typing.get_type_hints(cls)
    return st.builds(cls, **{f.name: strategy_for(hints[f.name]) for f in attrs.fields(cls)})


_envelopes = st.builds(
    Envelope,
    msg_id=st.integers(min_value=0, max_value=2**62),
    sender=st.text(max_size=12),
    receiver=st.text(max_size=12),
    topic=st.text(max_size=12),
    time_s=st.floats(allow_nan=False),
    correlation_id=st.integers(min_value=0, max_value=2**62),
    causation_id=st.integers(min_value=0, max_value=2**62),
    kind=st.sampled_from(list(Kind)),
)

CODEC = Codec()


# Declared without @message so that the global registry stays as the product declares it.
@attrs.frozen(slots=True)
class Inner:
    value: int


@attrs.frozen(slots=True)
class Outer:
    inner: Inner
    many: tuple[Inner, ...]
    table: dict[str, int]
    maybe: float | None


for _cls, _name in ((Inner, "gyre.test.codec.Inner"), (Outer, "gyre.test.codec.Outer")):
    _cls.__gyre_type__, _cls.__gyre_version__ = _name, 1
# Every class of gyre.messages (test modules may register more; those are covered by the next test).
_PRODUCT_CLASSES = [cls for cls in REGISTERED if cls.__module__.startswith("gyre.messages")]


def test_every_registered_class_is_known_to_the_codec_with_a_unique_name() -> None:
    codec = Codec()
    names = [cls.__gyre_type__ for cls in REGISTERED]
    assert len(names) == len(set(names))
    assert set(codec.type_names) == set(names)
    assert len(_PRODUCT_CLASSES) >= 30  # the import of gyre.messages pulled every module in
    for cls in REGISTERED:
        assert codec.class_of(codec.type_name_of(cls)) is cls
        message_strategy(cls)  # every field of every class has a wire shape the generator (and codec) knows


@pytest.mark.parametrize("cls", _PRODUCT_CLASSES, ids=lambda cls: cls.__gyre_type__)
@_SETTINGS
@given(data=st.data())
def test_every_message_class_round_trips(cls: type, data: st.DataObject) -> None:
    msg = data.draw(message_strategy(cls))
    envelope = data.draw(_envelopes)
    header, body = CODEC.encode(envelope, msg)
    got_envelope, got = CODEC.decode(header, body)
    assert got == msg and type(got) is cls
    assert got_envelope == envelope
    assert CODEC.encode(got_envelope, got) == (header, body)
    assert CODEC.decode_message(CODEC.encode_message(msg)) == msg


# ---- bad frames ---------------------------------------------------------------------------------------------------
_ENVELOPE = Envelope(7, "a", "b", "", 1.5, 0, 3, Kind.ASK)


def _frames(msg: Any = Ball(1, 2)) -> tuple[bytes, bytes]:
    return CODEC.encode(_ENVELOPE, msg)


def _header_fields(msg: Any = Ball(1, 2)) -> list:
    return list(msgpack.unpackb(_frames(msg)[0]))


def test_unknown_type_is_typed() -> None:
    fields = _header_fields()
    fields[9] = "gyre.nobody.Knows"
    header = msgpack.packb(fields)
    envelope, type_name, version = CODEC.decode_header(header)  # the header alone is fine: an ask can be answered
    assert (envelope, type_name) == (_ENVELOPE, "gyre.nobody.Knows")
    with pytest.raises(UnknownMessageType):
        CODEC.decode(header, _frames()[1])
    with pytest.raises(UnknownMessageType):
        CODEC.class_of("gyre.nobody.Knows")

    @attrs.frozen
    class NotAMessage:
        x: int

    with pytest.raises(UnknownMessageType):
        CODEC.encode(_ENVELOPE, NotAMessage(1))


def test_bad_schema_version_and_frame_format_are_typed() -> None:
    fields = _header_fields()
    fields[10] = 2
    with pytest.raises(SchemaVersionMismatch, match="version 2"):
        CODEC.decode(msgpack.packb(fields), _frames()[1])
    fields = _header_fields()
    fields[0] = FORMAT_VERSION + 1
    with pytest.raises(SchemaVersionMismatch):
        CODEC.decode_header(msgpack.packb(fields))


def _versioned(version: int) -> type:
    """Ball's wire name at another schema version, declared without touching the global registry."""

    @attrs.frozen(slots=True)
    class BallV:
        number: int
        spin: int

    BallV.__gyre_type__ = Ball.__gyre_type__
    BallV.__gyre_version__ = version
    return BallV


def test_a_peer_speaking_another_version_is_refused() -> None:
    ball_v2 = _versioned(2)
    newer = Codec([ball_v2, ActorStarted])
    header, body = newer.encode(_ENVELOPE, ball_v2(1, 2))
    with pytest.raises(SchemaVersionMismatch):
        CODEC.decode(header, body)
    with pytest.raises(SchemaVersionMismatch):
        newer.decode(*_frames())


@pytest.mark.parametrize("msg", [Ball(3, -4), ScoreAsked(), Echo(9, b"\x00" * 50)], ids=repr)
def test_every_truncation_is_a_malformed_frame(msg: Any) -> None:
    header, body = _frames(msg)
    for cut in range(len(header)):
        with pytest.raises(MalformedFrame):
            CODEC.decode(header[:cut], body)
    for cut in range(len(body)):
        with pytest.raises(MalformedFrame):
            CODEC.decode(header, body[:cut])
    with pytest.raises(MalformedFrame):
        CODEC.decode(header, body + b"\x00")  # trailing bytes are not ignored either
    frame = CODEC.encode_message(msg)
    for cut in range(len(frame)):
        with pytest.raises(MalformedFrame):
            CODEC.decode_message(frame[:cut])


@pytest.mark.parametrize(
    ("body", "why"),
    [
        (msgpack.packb([1]), "needs 2 fields"),
        (msgpack.packb([1, 2, 3]), "needs 2 fields"),
        (msgpack.packb(["one", 2]), "Ball.number has the wrong type"),
        (msgpack.packb([True, 2]), "Ball.number has the wrong type"),  # bool is not an int on the wire
        (msgpack.packb({"number": 1, "spin": 2}), "needs 2 fields"),
        (b"\xc1", "not valid msgpack"),
        (msgpack.packb([1, msgpack.ExtType(9, b"")]), "extension code 9"),
        (msgpack.packb([1, msgpack.ExtType(1, b"\x93")]), "not valid msgpack"),
        (msgpack.packb([1, msgpack.ExtType(1, msgpack.packb(["gyre.nobody", 1, []]))]), "unknown message type"),
    ],
)
def test_bodies_that_do_not_fit_the_class_are_refused(body: bytes, why: str) -> None:
    with pytest.raises(CodecError, match=why):
        CODEC.decode_body(Ball.__gyre_type__, Ball.__gyre_version__, body)


def test_nested_messages_and_container_fields_are_checked() -> None:
    codec = Codec([Inner, Outer])
    good = Outer(Inner(1), (Inner(2), Inner(3)), {"a": 1}, None)
    assert codec.decode(*codec.encode(_ENVELOPE, good))[1] == good
    name, version = "gyre.test.codec.Outer", 1
    inner = codec._default(Inner(1))  # noqa: SLF001 - the codec's own nested encoding
    bad_bodies = {
        "inner": [1, (inner,), {"a": 1}, None],
        "many": [inner, (1,), {"a": 1}, None],
        "table": [inner, (inner,), {"a": "one"}, None],
        "maybe": [inner, (inner,), {"a": 1}, "x"],
    }
    for field, fields in bad_bodies.items():
        with pytest.raises(MalformedFrame, match=f"Outer.{field} has the wrong type"):
            codec.decode_body(name, version, msgpack.packb(fields, default=codec._default))  # noqa: SLF001
    with pytest.raises(MalformedFrame):  # non-string map keys
        codec.decode_body(name, version, msgpack.packb([inner, (inner,), {1: 1}, None], strict_types=False))


def test_a_field_the_wire_cannot_carry_is_refused_on_encode() -> None:
    with pytest.raises(CodecError):
        CODEC.encode(_ENVELOPE, Echo(1, {1, 2}))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="cannot travel on the wire"):

        @attrs.frozen(slots=True)
        class Holder:
            values: set[int]

        Holder.__gyre_type__, Holder.__gyre_version__ = "gyre.test.codec.Holder", 1
        Codec([Holder])


@settings(max_examples=150, deadline=None, database=None)
@given(header=st.binary(max_size=80), body=st.binary(max_size=80))
def test_garbage_frames_raise_only_codec_errors(header: bytes, body: bytes) -> None:
    try:
        CODEC.decode(header, body)
    except CodecError:
        pass
    try:
        CODEC.decode_message(header)
    except CodecError:
        pass


_SCALARS = st.one_of(st.none(), st.booleans(), _INT64, st.floats(), st.text(max_size=5), st.binary(max_size=5))


@settings(max_examples=60, deadline=None, database=None)
@given(
    cls=st.sampled_from(_PRODUCT_CLASSES),
    values=st.lists(st.one_of(_SCALARS, st.lists(_INT64, max_size=3)), max_size=8),
)
def test_well_formed_msgpack_of_the_wrong_shape_raises_only_codec_errors(cls: type, values: list) -> None:
    try:
        msg = CODEC.decode_body(cls.__gyre_type__, cls.__gyre_version__, msgpack.packb(values))
    except CodecError:
        return
    assert type(msg) is cls  # if it decodes, it is a message of the declared class


@settings(max_examples=80, deadline=None, database=None)
@given(data=st.data())
def test_mutated_headers_raise_only_codec_errors(data: st.DataObject) -> None:
    fields = _header_fields()
    position = data.draw(st.integers(min_value=0, max_value=len(fields) - 1))
    fields[position] = data.draw(st.one_of(_SCALARS, st.lists(_INT64, max_size=2)))
    if data.draw(st.booleans()):
        fields = fields[: data.draw(st.integers(min_value=0, max_value=len(fields)))]
    try:
        envelope, _ = CODEC.decode(msgpack.packb(fields), _frames()[1])
    except CodecError:
        return
    assert isinstance(envelope, Envelope)
