"""How a message class is declared: frozen, slotted attrs plus a stable wire name and a schema version.

Messages are data only. The decorator records the wire name and version as class attributes and adds the class to
`REGISTERED`; the codec in `gyre.runtime` reads both. Sequences in messages are tuples (the codec decodes msgpack
arrays as tuples), so a decoded message equals the one that was sent.
"""

from __future__ import annotations

from typing import Callable, TypeVar

import attrs

T = TypeVar("T")

# Every message class, in declaration order. The codec builds its registry from this list.
REGISTERED: list[type] = []


def message(type_name: str, version: int = 1) -> Callable[[type[T]], type[T]]:
    """Declare a message class: `@message("gyre.ping.Ping")` above a class with annotated fields.

    `type_name` is the stable name on the wire and in event logs: never reuse one for a different shape; bump
    `version` when fields change, so that an old log or peer is rejected with a clear error instead of misread.
    """

    def wrap(cls: type[T]) -> type[T]:
        framed = attrs.frozen(slots=True, kw_only=False)(cls)
        framed.__gyre_type__ = type_name  # type: ignore[attr-defined]
        framed.__gyre_version__ = version  # type: ignore[attr-defined]
        REGISTERED.append(framed)
        return framed

    return wrap
