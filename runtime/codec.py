"""The wire codec: msgpack frames for envelopes and messages, a registry of stable type names and schema versions.

A message travels as two frames. The header is a msgpack array with the envelope and the message's type name and
version, so a receiver can answer (or log) a message whose body it cannot read. The body is a msgpack array of the
message's fields in declaration order; nested messages are msgpack extension objects. Decoding checks each field
against its annotation, so a garbage frame becomes a `MalformedFrame` error instead of a message with wrong types.
"""

from __future__ import annotations

import operator
import types
import typing
from typing import Any, Callable, Iterable

import attrs
import msgpack

from gyre.messages import REGISTERED
from gyre.runtime.envelope import Envelope, Kind
from gyre.runtime.errors import MalformedFrame, SchemaVersionMismatch, UnknownMessageType

FORMAT_VERSION = 1
_NESTED_EXT = 1
_KINDS = tuple(sorted(Kind, key=int))  # wire value -> Kind, without the enum's slow call

Checker = Callable[[Any], bool]


def _checker_for(annotation: Any) -> Checker:
    """A cheap isinstance test for one field's annotation (only the shapes the wire allows)."""
    origin = typing.get_origin(annotation)
    if annotation is Any:
        return lambda value: True
    if annotation is type(None) or annotation is None:
        return lambda value: value is None
    if annotation is float:
        return lambda value: isinstance(value, (float, int)) and not isinstance(value, bool)
    if annotation is int:
        return lambda value: isinstance(value, int) and not isinstance(value, bool)
    if annotation in (str, bytes, bool):
        return lambda value: isinstance(value, annotation)
    if origin in (typing.Union, types.UnionType):
        options = [_checker_for(arg) for arg in typing.get_args(annotation)]
        return lambda value: any(check(value) for check in options)
    if origin is tuple or annotation is tuple:
        args = typing.get_args(annotation)
        if len(args) == 2 and args[1] is Ellipsis:
            item = _checker_for(args[0])
            return lambda value: isinstance(value, tuple) and all(item(v) for v in value)
        if args:
            items = [_checker_for(a) for a in args]
            return lambda value: (
                isinstance(value, tuple) and len(value) == len(items) and all(c(v) for c, v in zip(items, value))
            )
        return lambda value: isinstance(value, tuple)
    if origin is dict or annotation is dict:
        args = typing.get_args(annotation)
        if len(args) == 2 and args[1] is not Any:
            item = _checker_for(args[1])
            return lambda value: isinstance(value, dict) and all(
                isinstance(k, str) and item(v) for k, v in value.items()
            )
        return lambda value: isinstance(value, dict) and all(isinstance(k, str) for k in value)
    if isinstance(annotation, type) and hasattr(annotation, "__gyre_type__"):
        return lambda value: isinstance(value, annotation)
    if isinstance(annotation, type) and issubclass(annotation, int):  # IntEnum and friends
        return lambda value: isinstance(value, int)
    raise TypeError(f"field type {annotation!r} cannot travel on the wire")


@attrs.frozen
class _Entry:
    cls: type
    type_name: str
    version: int
    field_names: tuple[str, ...]
    checkers: tuple[Checker, ...]
    values: Callable[[Any], tuple]
    """The message's field values in declaration order (an attrgetter: a Python loop costs more per message)."""


def _values_getter(names: tuple[str, ...]) -> Callable[[Any], tuple]:
    if not names:
        return lambda msg: ()
    if len(names) == 1:
        name = names[0]
        return lambda msg: (getattr(msg, name),)
    return operator.attrgetter(*names)


class Codec:
    """Encodes and decodes (envelope, message) pairs for every registered message class.

    A codec reuses its msgpack packers (building one per call costs more than the packing of a small message), so
    one instance must not be used from two threads at once; each node has its own.
    """

    def __init__(self, classes: Iterable[type] | None = None) -> None:
        self._by_name: dict[str, _Entry] = {}
        self._by_class: dict[type, _Entry] = {}
        self._header_packer = msgpack.Packer(use_bin_type=True)
        self._body_packer = msgpack.Packer(default=self._default, use_bin_type=True)
        for cls in REGISTERED if classes is None else classes:
            self.register(cls)

    def register(self, cls: type) -> None:
        name = getattr(cls, "__gyre_type__", None)
        if name is None:
            raise TypeError(f"{cls.__qualname__} is not declared with @message")
        if name in self._by_name and self._by_name[name].cls is not cls:
            raise TypeError(f"two message classes claim the wire name {name!r}")
        hints = typing.get_type_hints(cls)
        fields = attrs.fields(cls)
        names = tuple(f.name for f in fields)
        entry = _Entry(
            cls=cls,
            type_name=name,
            version=cls.__gyre_version__,
            field_names=names,
            checkers=tuple(_checker_for(hints[f.name]) for f in fields),
            values=_values_getter(names),
        )
        self._by_name[name] = entry
        self._by_class[cls] = entry

    @property
    def type_names(self) -> tuple[str, ...]:
        return tuple(self._by_name)

    def type_name_of(self, cls: type) -> str:
        return self._entry_for_class(cls).type_name

    def class_of(self, type_name: str) -> type:
        entry = self._by_name.get(type_name)
        if entry is None:
            raise UnknownMessageType(f"unknown message type {type_name!r}")
        return entry.cls

    # ---- messages -------------------------------------------------------------------------------------------------
    def _entry_for_class(self, cls: type) -> _Entry:
        entry = self._by_class.get(cls)
        if entry is None:
            raise UnknownMessageType(f"{cls.__qualname__} is not a registered message class")
        return entry

    def _default(self, value: Any) -> Any:
        entry = self._by_class.get(type(value))
        if entry is None:
            raise MalformedFrame(f"cannot encode a value of type {type(value).__qualname__}")
        # A fresh packer: this runs inside the body packer, which must not be re-entered.
        packed = msgpack.packb(
            (entry.type_name, entry.version, entry.values(value)), default=self._default, use_bin_type=True
        )
        return msgpack.ExtType(_NESTED_EXT, packed)

    def _ext_hook(self, code: int, data: bytes) -> Any:
        if code != _NESTED_EXT:
            raise MalformedFrame(f"unknown msgpack extension code {code}")
        decoded = msgpack.unpackb(data, use_list=False, raw=False, ext_hook=self._ext_hook, strict_map_key=True)
        if not isinstance(decoded, tuple) or len(decoded) != 3:
            raise MalformedFrame("a nested message is not a [type, version, fields] triple")
        name, version, fields = decoded
        return self._build(self._lookup(name, version), fields)

    def _lookup(self, type_name: Any, version: Any) -> _Entry:
        if not isinstance(type_name, str):
            raise MalformedFrame(f"message type name must be a string, got {type(type_name).__name__}")
        entry = self._by_name.get(type_name)
        if entry is None:
            raise UnknownMessageType(f"unknown message type {type_name!r}")
        if version != entry.version:
            raise SchemaVersionMismatch(
                f"{type_name} arrived at schema version {version!r}; this process speaks version {entry.version}"
            )
        return entry

    def _build(self, entry: _Entry, fields: Any) -> Any:
        if not isinstance(fields, tuple) or len(fields) != len(entry.field_names):
            raise MalformedFrame(
                f"{entry.type_name} needs {len(entry.field_names)} fields, got "
                f"{len(fields) if isinstance(fields, tuple) else type(fields).__name__}"
            )
        for name, check, value in zip(entry.field_names, entry.checkers, fields):
            if not check(value):
                raise MalformedFrame(f"{entry.type_name}.{name} has the wrong type: {type(value).__name__}")
        try:
            return entry.cls(*fields)
        except Exception as error:  # a class that validates its fields: wire input it refuses is a bad frame
            raise MalformedFrame(f"{entry.type_name} refused its fields: {type(error).__name__}: {error}") from error

    def encode_body(self, msg: Any) -> bytes:
        entry = self._by_class.get(type(msg)) or self._entry_for_class(type(msg))
        return self._body_packer.pack(entry.values(msg))

    def decode_body(self, type_name: str, version: int, body: bytes) -> Any:
        entry = self._lookup(type_name, version)
        try:
            fields = msgpack.unpackb(body, use_list=False, raw=False, ext_hook=self._ext_hook, strict_map_key=True)
        except (MalformedFrame, UnknownMessageType, SchemaVersionMismatch):
            raise
        except Exception as error:  # msgpack raises several unrelated types for garbage
            raise MalformedFrame(f"{type_name} body is not valid msgpack: {error}") from error
        return self._build(entry, fields)

    def encode_message(self, msg: Any) -> bytes:
        """A standalone message (no envelope): type, version and fields in one frame."""
        entry = self._entry_for_class(type(msg))
        return msgpack.packb((entry.type_name, entry.version, self.encode_body(msg)), use_bin_type=True)

    def decode_message(self, frame: bytes) -> Any:
        try:
            decoded = msgpack.unpackb(frame, use_list=False, raw=False)
        except Exception as error:
            raise MalformedFrame(f"not a message frame: {error}") from error
        if not isinstance(decoded, tuple) or len(decoded) != 3 or not isinstance(decoded[2], bytes):
            raise MalformedFrame("a message frame is a [type, version, body] triple")
        return self.decode_body(decoded[0], decoded[1], decoded[2])

    # ---- envelopes ------------------------------------------------------------------------------------------------
    def encode(self, envelope: Envelope, msg: Any) -> tuple[bytes, bytes]:
        entry = self._by_class.get(type(msg)) or self._entry_for_class(type(msg))
        header = self._header_packer.pack(
            (
                FORMAT_VERSION,
                envelope.msg_id,
                envelope.sender,
                envelope.receiver,
                envelope.topic,
                envelope.time_s,
                envelope.correlation_id,
                envelope.causation_id,
                int(envelope.kind),
                entry.type_name,
                entry.version,
            )
        )
        return header, self._body_packer.pack(entry.values(msg))

    def decode_header(self, header: bytes) -> tuple[Envelope, str, int]:
        """The envelope plus the body's type name and version; the body is left for `decode_body`."""
        try:
            fields = msgpack.unpackb(header, use_list=False, raw=False)
        except Exception as error:
            raise MalformedFrame(f"header is not valid msgpack: {error}") from error
        if type(fields) is not tuple or len(fields) != 11:
            raise MalformedFrame("header must be an 11-item array")
        if fields[0] != FORMAT_VERSION:
            raise SchemaVersionMismatch(f"frame format {fields[0]!r}; this process speaks {FORMAT_VERSION}")
        _, msg_id, sender, receiver, topic, time_s, correlation, causation, kind, type_name, version = fields
        # Exact types (msgpack gives exactly these), so bool never passes for int; one check per message.
        if not (
            type(msg_id) is int
            and type(sender) is str
            and type(receiver) is str
            and type(topic) is str
            and (type(time_s) is float or type(time_s) is int)
            and type(correlation) is int
            and type(causation) is int
            and type(type_name) is str
            and type(version) is int
            and type(kind) is int
            and 0 <= kind < len(_KINDS)
        ):
            raise MalformedFrame("header fields have the wrong types")
        envelope = Envelope(msg_id, sender, receiver, topic, float(time_s), correlation, causation, _KINDS[kind])
        return envelope, type_name, version

    def decode(self, header: bytes, body: bytes) -> tuple[Envelope, Any]:
        envelope, type_name, version = self.decode_header(header)
        return envelope, self.decode_body(type_name, version, body)

