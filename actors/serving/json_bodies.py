"""Request bodies decoded in time proportional to what is new since the session's earlier bodies.

An agent re-sends its whole conversation on every call, so a body at a 128K-token context is ~350 KB of JSON of
which the last few KB are new. Decoding all of it (the stdlib parser, ~1 ms per MB) was the part of a call's proxy
time that grew with the context. `BodyCache` keeps, per session, the last few bodies it decoded with the byte
offset after each element of their top-level `messages` array. A new body that starts with the same bytes as an
earlier one up to the end of its k-th message (`bytes.startswith`, at memory speed) is in the same parser state
there: the members before `messages` and the first k messages decode to the same values, so they are taken from
the earlier decoding and only the bytes after them are parsed (the stdlib's C scanner, one value at a time), then
checked against the bounds (depth, string length, lone surrogates) as `loads_bounded` checks a whole body.

The API modules convert messages the same way (`converted_before`, `keep_converted`): a `DecodedBody` knows which
of its messages are the earlier body's very objects, and the earlier body keeps what each API made of them, so only
the new messages are normalised. The result always equals `loads_bounded` of the whole body; anything the
incremental walk does not expect (not an object, a second `messages` member, invalid JSON, bytes that are not
UTF-8) goes to `loads_bounded`, which also words the refusals. Decoded values and conversions are shared between
bodies of the same session, never across sessions, and are read only (the API modules build their own dicts from
the decoded values, and copy the lists). Bounded: bodies kept per session and bytes kept in all (least recently used
sessions go first); a body smaller than `min_body_bytes` is decoded whole and not kept.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import Any, Hashable

import attrs

from gyre.actors.errors import ActorError
from gyre.actors.serving._api_common import _SURROGATE_ESCAPE, JsonLimits, check_json, loads_bounded
from gyre.runtime.errors import ConfigError
from gyre.runtime.validators import count

__all__ = ["BodyCacheConfig", "BodyCache", "BodyCacheStatistics", "DecodedBody", "converted_before", "keep_converted",
           "not_negative"]

_WHITESPACE = json.decoder.WHITESPACE
_SCAN_VALUE = json.JSONDecoder().scan_once  # the C scanner: (text, index) -> (value, index after it)
_SCAN_STRING = json.decoder.scanstring  # (text, index after the opening quote) -> (string, index after it)
_BOM = b"\xef\xbb\xbf"


def not_negative(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"{attribute.name} must be an int >= 0, got {value!r}")


@attrs.frozen
class BodyCacheConfig:
    max_bytes: int = attrs.field(default=256 * 2**20, validator=not_negative)
    """Bytes of bodies kept in all sessions together (0: every body is decoded whole)."""
    max_bodies_per_session: int = attrs.field(default=8, validator=count)
    """Bodies kept per session: one per conversation it interleaves (main agent, sub-agents, summaries)."""
    min_body_bytes: int = attrs.field(default=16 * 2**10, validator=not_negative)
    """Bodies below this are decoded whole and not kept (the walk's bookkeeping would cost more than it saves)."""


@attrs.frozen
class BodyCacheStatistics:
    bodies_kept: int
    bytes_kept: int
    incremental: int
    """Bodies decoded from an earlier one's prefix."""
    whole: int
    """Bodies decoded whole (first of a conversation, small, or not of the expected shape)."""
    reused_bytes: int
    """Bytes taken from earlier decodings instead of being parsed."""


class DecodedBody(dict):
    """A body decoded by `BodyCache`: the dict `json.loads` makes of it, plus what it repeats of an earlier body of
    its session: its first `repeated` messages are the very objects of that body's messages, and `derived` holds
    what the API modules made of its messages (`keep_converted`), for the next body."""

    __slots__ = ("repeated", "earlier_messages", "earlier_derived", "derived")

    def __init__(self, body: dict[str, Any], repeated: int, earlier: "_Body | None", kept: "_Body") -> None:
        super().__init__(body)
        self.repeated = repeated
        self.earlier_messages = earlier.messages if earlier is not None else []
        self.earlier_derived = earlier.derived if earlier is not None else {}
        self.derived = kept.derived


def converted_before(body: Any, key: str) -> list[Any]:
    """What an API module made (under `key`, its name) of the first messages of `body` that the session's earlier
    body had: the very same message objects, so the same conversions (each a pure function of its message). A new
    list, empty when `body` repeats nothing; the API converts the messages after them and hands the whole list to
    `keep_converted`. The conversions are shared with later bodies: read only."""
    if type(body) is not DecodedBody:
        return []
    earlier = body.earlier_derived.get(key)
    count = min(body.repeated, len(earlier)) if earlier is not None else 0
    # The same objects (a list comparison stops at identity), unless something replaced them since.
    if not count or body["messages"][:count] != body.earlier_messages[:count]:
        return []
    return earlier[:count]


def keep_converted(body: Any, key: str, converted: list[Any]) -> None:
    """Keep what the API module under `key` made of every message of `body`, for the session's next body."""
    if type(body) is DecodedBody:
        body.derived[key] = list(converted)


class _NotPlain(ActorError):
    """The body is not of the shape the walk handles: decode it whole (never leaves this module)."""


@attrs.define(eq=False)
class _Body:
    raw: bytes
    head: list[tuple[str, Any]]
    """Members before `messages`, in order."""
    messages: list[Any]
    ends: list[int]
    """Byte offset in `raw` just after each message."""
    derived: dict[str, Any] = attrs.field(factory=dict)
    """What the API modules made of the messages (`keep_converted`)."""


def _skip(text: str, index: int) -> int:
    return _WHITESPACE.match(text, index).end()


def _messages_rest(text: str, index: int, messages: list[Any], ends: list[int]) -> int:
    """`text[index:]` continues a messages array after an element: the further elements (appended, with the index
    after each), then the closing bracket; the index after it."""
    while True:
        index = _skip(text, index)
        char = text[index : index + 1]
        if char == "]":
            return index + 1
        if char != ",":
            raise _NotPlain
        value, index = _SCAN_VALUE(text, _skip(text, index + 1))
        messages.append(value)
        ends.append(index)


def _member(text: str, index: int) -> tuple[str, int]:
    """A member's key at `index` (after whitespace) and the index of its value."""
    if text[index : index + 1] != '"':
        raise _NotPlain
    key, index = _SCAN_STRING(text, index + 1)
    index = _skip(text, index)
    if text[index : index + 1] != ":":
        raise _NotPlain
    return key, _skip(text, index + 1)


def _object_rest(text: str, index: int, after: list[tuple[str, Any]]) -> None:
    """`text[index:]` continues the top-level object after a member: further members (none named messages), the
    closing brace and nothing but whitespace."""
    while True:
        index = _skip(text, index)
        char = text[index : index + 1]
        if char == "}":
            if _skip(text, index + 1) != len(text):
                raise _NotPlain
            return
        if char != ",":
            raise _NotPlain
        key, index = _member(text, _skip(text, index + 1))
        if key == "messages":
            raise _NotPlain
        value, index = _SCAN_VALUE(text, index)
        after.append((key, value))


def _walk_whole(text: str) -> tuple[list[tuple[str, Any]], list[Any], list[int], list[tuple[str, Any]]]:
    """A whole body: (members before messages, messages, the index after each, members after)."""
    index = _skip(text, 0)
    if text[index : index + 1] != "{":
        raise _NotPlain
    index = _skip(text, index + 1)
    head: list[tuple[str, Any]] = []
    while True:
        key, index = _member(text, index)
        if key == "messages":
            break
        value, index = _SCAN_VALUE(text, index)
        head.append((key, value))
        index = _skip(text, index)
        if text[index : index + 1] != ",":
            raise _NotPlain  # the end of the object, or not JSON: no messages array to walk
        index = _skip(text, index + 1)
    if text[index : index + 1] != "[":
        raise _NotPlain
    index = _skip(text, index + 1)
    if text[index : index + 1] == "]":
        raise _NotPlain  # no messages: nothing to keep
    value, index = _SCAN_VALUE(text, index)
    messages, ends = [value], [index]
    index = _messages_rest(text, index, messages, ends)
    after: list[tuple[str, Any]] = []
    _object_rest(text, index, after)
    keys = [key for key, _ in head] + [key for key, _ in after]
    if len(set(keys)) < len(keys):
        raise _NotPlain  # a member given twice: every kept member must be one the whole body's check saw
    return head, messages, ends, after


def _byte_ends(text: str, ends: list[int], base: int) -> list[int]:
    """Character indexes in `text` -> byte offsets in the body (`text` decoded from the body at byte `base`)."""
    if text.isascii():
        return [base + end for end in ends]
    out, previous, position = [], 0, base
    for end in ends:
        position += len(text[previous:end].encode("utf-8"))
        out.append(position)
        previous = end
    return out


def _assemble(head: list[tuple[str, Any]], messages: list[Any], after: list[tuple[str, Any]]) -> dict[str, Any]:
    """The object `json.loads` makes of these members (a later duplicate key wins, in its first place)."""
    body = dict(head)
    body["messages"] = messages
    for key, value in after:
        body[key] = value
    return body


class BodyCache:
    """Decodes request bodies, each within `limits`, reusing the session's earlier decodings (module doc)."""

    def __init__(self, limits: JsonLimits, config: BodyCacheConfig = BodyCacheConfig()) -> None:
        self.limits = limits
        self.config = config
        self._sessions: OrderedDict[Hashable, list[_Body]] = OrderedDict()
        self._bytes = 0
        self._incremental = self._whole = self._reused_bytes = 0

    def statistics(self) -> BodyCacheStatistics:
        return BodyCacheStatistics(
            bodies_kept=sum(len(bodies) for bodies in self._sessions.values()),
            bytes_kept=self._bytes,
            incremental=self._incremental,
            whole=self._whole,
            reused_bytes=self._reused_bytes,
        )

    def forget(self, session: Hashable) -> None:
        """Drop what is kept for `session` (its execution ended)."""
        for body in self._sessions.pop(session, ()):
            self._bytes -= len(body.raw)

    def loads(self, raw: bytes, session: Hashable) -> Any:
        """`loads_bounded(raw, limits)`, in time proportional to the bytes after the longest prefix of whole
        messages it shares with a body kept for `session`."""
        config = self.config
        if config.max_bytes == 0 or len(raw) < config.min_body_bytes or len(raw) > config.max_bytes:
            self._whole += 1
            return loads_bounded(raw, self.limits)
        bodies = self._sessions.get(session, [])
        earlier, shared = self._longest_prefix(raw, bodies)
        try:
            if earlier is None:
                body, kept = self._decode_whole(raw)
            else:
                body, kept = self._decode_after(raw, earlier, shared)
        except (_NotPlain, ValueError, StopIteration, RecursionError):
            self._whole += 1
            return loads_bounded(raw, self.limits)  # the whole body's verdict: its value or its refusal
        if earlier is None:
            self._whole += 1
        else:
            self._incremental += 1
            self._reused_bytes += earlier.ends[shared - 1]
            if shared == len(earlier.messages):
                self._drop(session, earlier)  # the new body extends it: it would never be the longer match again
        self._keep(session, kept)
        return DecodedBody(body, shared, earlier, kept)

    # -- matching ------------------------------------------------------------------------------------------------

    @staticmethod
    def _longest_prefix(raw: bytes, bodies: list[_Body]) -> tuple[_Body | None, int]:
        """The kept body whose first k messages' bytes `raw` starts with, for the largest k >= 1, and k."""
        best, best_count = None, 0
        for body in reversed(bodies):  # the most recent first: it is usually extended whole
            view = memoryview(body.raw)
            ends = body.ends
            if raw.startswith(view[: ends[-1]]):
                count = len(ends)
            elif not raw.startswith(view[: ends[0]]):
                continue
            else:  # a fork or an edit: the longest whole-message prefix, by bisection
                low, high = 1, len(ends) - 1  # ends[low - 1] matches, ends[high] does not
                while low <= high:
                    middle = (low + high) // 2
                    if raw.startswith(view[: ends[middle]]):
                        low = middle + 1
                    else:
                        high = middle - 1
                count = low
            if count > best_count:
                best, best_count = body, count
        return best, best_count

    # -- decoding ------------------------------------------------------------------------------------------------

    def _decode_whole(self, raw: bytes) -> tuple[dict[str, Any], _Body]:
        base = len(_BOM) if raw.startswith(_BOM) else 0
        text = raw[base:].decode("utf-8")
        head, messages, ends, after = _walk_whole(text)
        limits = self.limits
        body = _assemble(head, messages, after)
        check_json(body, limits, "the request body",
                   surrogates="\\" in text and _SURROGATE_ESCAPE.search(text) is not None,
                   strings=len(text) > limits.max_string_chars)
        return body, _Body(raw, head, messages, _byte_ends(text, ends, base))

    def _decode_after(self, raw: bytes, earlier: _Body, shared: int) -> tuple[dict[str, Any], _Body]:
        start = earlier.ends[shared - 1]
        text = raw[start:].decode("utf-8")  # `start` follows a "}" or "]": a character boundary
        fresh: list[Any] = []
        fresh_ends: list[int] = []
        index = _messages_rest(text, 0, fresh, fresh_ends)
        after: list[tuple[str, Any]] = []
        _object_rest(text, index, after)
        limits = self.limits
        # The bounds, on what was parsed now (the rest was checked when it came): the new messages sit at depth 3.
        surrogates = "\\" in text and _SURROGATE_ESCAPE.search(text) is not None
        strings = len(text) > limits.max_string_chars
        for message in fresh:
            check_json(message, limits, "the request body", surrogates=surrogates, strings=strings, depth=3)
        check_json(dict(after), limits, "the request body", surrogates=surrogates, strings=strings)
        messages = earlier.messages[:shared] + fresh
        ends = earlier.ends[:shared] + _byte_ends(text, fresh_ends, start)
        return _assemble(earlier.head, messages, after), _Body(raw, earlier.head, messages, ends)

    # -- bounds --------------------------------------------------------------------------------------------------

    def _drop(self, session: Hashable, body: _Body) -> None:
        bodies = self._sessions.get(session)
        if bodies is not None and body in bodies:
            bodies.remove(body)
            self._bytes -= len(body.raw)

    def _keep(self, session: Hashable, body: _Body) -> None:
        bodies = self._sessions.setdefault(session, [])
        self._sessions.move_to_end(session)
        bodies.append(body)
        self._bytes += len(body.raw)
        while len(bodies) > self.config.max_bodies_per_session:
            self._bytes -= len(bodies.pop(0).raw)
        while self._bytes > self.config.max_bytes and self._sessions:
            oldest = next(iter(self._sessions))
            old_bodies = self._sessions[oldest]
            self._bytes -= len(old_bodies.pop(0).raw)
            if not old_bodies:
                del self._sessions[oldest]
