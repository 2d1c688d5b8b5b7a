"""A rendered prompt's ids without a copy of the context: sessions.py renders them, the backends read them.

A leaf of the serving files (like streaming.py): the call path's stages use it and it calls none of them.
"""

from __future__ import annotations

import bisect
from itertools import chain
from typing import Any, Iterator, Sequence

__all__ = ["PromptIds"]


class PromptIds(Sequence):
    """A rendered prompt's ids as a view over its parts (the ids of its messages, shared with the session's caches
    and stored turns), not a copy: a call at a long context costs no pass over its whole prompt in the proxy; the
    backend reads it once, in its own form (a list for the embedded engine, JSON for a server). Compares and hashes
    as the tuple of its ids; a slice is a tuple."""

    __slots__ = ("_parts", "_ends")

    def __init__(self, parts: Sequence[tuple[int, ...]], ends: Sequence[int] | None = None) -> None:
        self._parts = tuple(parts)
        if ends is None:
            total, cumulative = 0, []
            for part in self._parts:
                total += len(part)
                cumulative.append(total)
            ends = cumulative
        self._ends = tuple(ends)  # tokens up to and including each part

    def __len__(self) -> int:
        return self._ends[-1] if self._ends else 0

    def __iter__(self) -> Iterator[int]:
        return chain.from_iterable(self._parts)

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return tuple(self)[index]
        n = len(self)
        if index < 0:
            index += n
        if not 0 <= index < n:
            raise IndexError("prompt index out of range")
        part = bisect.bisect_right(self._ends, index)
        start = self._ends[part - 1] if part else 0
        return self._parts[part][index - start]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (tuple, PromptIds)):
            return len(self) == len(other) and tuple(self) == tuple(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __add__(self, other: Sequence[int]) -> tuple[int, ...]:
        return tuple(self) + tuple(other)

    def __radd__(self, other: Sequence[int]) -> tuple[int, ...]:
        return tuple(other) + tuple(self)

    def __repr__(self) -> str:
        return f"PromptIds({len(self)} ids in {len(self._parts)} parts)"
