"""What the two API modules share, as leaf helpers (they call nothing else of the serving package): the bounded JSON
reader (which http_app uses for bodies), the fields' validators, the answer handed back to the HTTP layer, and
server-sent-event framing."""

from __future__ import annotations

import json
import re
from typing import Any, Mapping

import attrs

from gyre.actors.serving.sessions import ApiError, short_error

__all__ = [
    "JsonLimits",
    "loads_bounded",
    "check_json",
    "Answer",
    "refused",
    "failed",
    "MAX_STOP_SEQUENCES",
    "require_object",
    "number_field",
    "int_field",
    "bool_field",
    "model_field",
    "stop_field",
    "json_object_text",
    "sse",
]

MAX_STOP_SEQUENCES = 16
"""Stop strings per call at most: each one is searched for in every streamed chunk."""


@attrs.frozen
class JsonLimits:
    """Bounds on decoded JSON (ProxyHttpConfig's max_json_depth and max_json_string_chars)."""

    max_depth: int = 64
    """Nesting of arrays and objects at most."""
    max_string_chars: int = 2**20
    """Characters of one string (object keys included) at most."""


_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
"""A \\uD800-\\uDFFF escape somewhere in JSON text: only then can a decoded string hold a lone surrogate (strict
UTF-8 decoding refuses encoded surrogates, and a well-formed pair decodes to one character)."""
_SURROGATE = re.compile("[\ud800-\udfff]")


def _too_deep(limits: JsonLimits, where: str) -> ApiError:
    return ApiError("invalid_request", f"{where} nests arrays and objects deeper than {limits.max_depth} levels "
                    "(max_json_depth)")


def loads_bounded(raw: bytes | str, limits: JsonLimits, where: str = "the request body") -> Any:
    """Decode JSON within `limits`, or raise ApiError (invalid_request) naming the limit it breaks: bytes that are
    not UTF-8 (a BOM is allowed), text that is not JSON, nesting beyond max_depth (json's own recursion included), a
    string beyond max_string_chars, a lone surrogate. Every later step can then recurse, copy and tokenise it."""
    if isinstance(raw, (bytes, bytearray)):
        try:
            text = raw.decode("utf-8-sig")
        except UnicodeDecodeError as error:
            raise ApiError("invalid_request", f"{where} is not valid UTF-8 (byte {error.start}): {error.reason}") from None
    else:
        text = raw
    try:
        value = json.loads(text)
    except RecursionError:
        raise _too_deep(limits, where) from None
    except ValueError as error:
        raise ApiError("invalid_request", f"{where} is not valid JSON: {error}") from None
    # Both scans are skipped when the text itself rules them out (the text of a long conversation is long): no
    # string is longer than the text, and no surrogate escape without a backslash (a one-character search runs at
    # memory speed; the regex, or a two-character search, is ~30x slower on a 300 KB body).
    check_json(value, limits, where, surrogates="\\" in text and _SURROGATE_ESCAPE.search(text) is not None,
               strings=len(text) > limits.max_string_chars)
    return value


def check_json(
    value: Any, limits: JsonLimits, where: str, surrogates: bool = True, strings: bool = True, depth: int = 1
) -> None:
    """Raise ApiError when decoded JSON breaks `limits` or holds a lone surrogate (looked for only when
    `surrogates`; string lengths only when `strings`); `value` sits at `depth` (1: it is the whole document).
    Iterative, so a value nested far beyond the limit cannot exhaust the stack here."""

    def check_string(text: str) -> None:
        if strings and len(text) > limits.max_string_chars:
            raise ApiError("invalid_request", f"{where} holds a string of {len(text)} characters; at most "
                           f"{limits.max_string_chars} are accepted (max_json_string_chars)")
        if surrogates and _SURROGATE.search(text) is not None:
            raise ApiError("invalid_request", f"{where} holds a lone surrogate (a \\ud800-\\udfff escape without "
                           "its pair), which is not text")

    if type(value) is str:
        check_string(value)
        return
    stack: list[tuple[Any, int]] = [(value, depth)] if isinstance(value, (dict, list)) else []
    while stack:
        node, depth = stack.pop()
        if depth > limits.max_depth:
            raise _too_deep(limits, where)
        items = node.values() if type(node) is dict else node
        if type(node) is dict:
            for key in node:
                check_string(key)
        for item in items:
            kind = type(item)
            if kind is str:
                check_string(item)
            elif kind is dict or kind is list:
                stack.append((item, depth + 1))


@attrs.frozen
class Answer:
    """How a call ended, as an API module tells the HTTP layer: a status, the JSON body to send, the error behind it.

    An API module's `answer` is an async generator of the response: for a plain call, one Answer; for a streamed
    call, the server-sent-event bytes of each output chunk (b"" for a chunk that settles nothing, so that the HTTP
    layer looks at its connection on every chunk), then an Answer. When no bytes came before it, that Answer is
    the response (the API's usual error status and body); after them, its error (if any) was already sent as an
    event and its `body` is None.
    """

    status: int
    """HTTP status."""
    body: Any = None
    """The JSON body to send (None at the end of a stream)."""
    error: ApiError | None = None
    """The refusal or failure behind a non-200 status (the HTTP layer logs and counts it)."""
    cause: str | None = None
    """For a 500, the unexpected error in one line (`short_error`)."""


def refused(error: ApiError, body: Any) -> Answer:
    """The answer to a refusal, `body` its API's error shape."""
    return Answer(error.status, body, error=error)


def failed(error: Exception) -> tuple[ApiError, str]:
    """An unexpected error -> the 500 refusal the agent gets (it names only the error's type) and the one line to
    log."""
    return ApiError("server", f"internal error: {type(error).__name__}"), short_error(error)


def require_object(body: Any) -> Mapping[str, Any]:
    if not isinstance(body, Mapping):
        raise ApiError("invalid_request", "the request body must be a JSON object")
    return body


def number_field(body: Mapping[str, Any], name: str, low: float, high: float, low_open: bool = False) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ApiError("invalid_request", f"{name} must be a number", name)
    if value > high or value < low or (low_open and value == low):
        bound = "(" if low_open else "["
        raise ApiError("invalid_request", f"{name} must be in {bound}{low}, {high}], got {value}", name)
    return float(value)


def int_field(body: Mapping[str, Any], name: str, low: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ApiError("invalid_request", f"{name} must be an integer", name)
    if value < low:
        raise ApiError("invalid_request", f"{name} must be at least {low}, got {value}", name)
    return value


def bool_field(body: Mapping[str, Any], name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ApiError("invalid_request", f"{name} must be a boolean", name)
    return value


def model_field(body: Mapping[str, Any]) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ApiError("invalid_request", "model must be a non-empty string", "model")
    return model


def stop_field(value: Any, name: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) and s for s in value):
        raise ApiError("invalid_request", f"{name} must be a non-empty string or a list of them", name)
    if len(value) > MAX_STOP_SEQUENCES:
        raise ApiError("invalid_request", f"{name} holds more than {MAX_STOP_SEQUENCES} sequences", name)
    return tuple(value)


def json_object_text(arguments: Any, where: str, limits: JsonLimits) -> str:
    """Tool-call arguments as JSON object text (what the template renders verbatim); text is decoded within
    `limits`, as the body was (it is JSON inside a string, which the body's check cannot see into)."""
    if isinstance(arguments, Mapping):
        return json.dumps(arguments, ensure_ascii=False)
    if not isinstance(arguments, str):
        raise ApiError("invalid_request", f"{where} must be a JSON string", where)
    value = loads_bounded(arguments, limits, where)
    if not isinstance(value, dict):
        raise ApiError("invalid_request", f"{where} must encode a JSON object", where)
    return arguments


def sse(data: Any, event: str | None = None) -> bytes:
    """One server-sent event: optional `event:` line, one `data:` line of compact JSON (or a literal string)."""
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    prefix = f"event: {event}\n" if event else ""
    return f"{prefix}data: {text}\n\n".encode("utf-8")
