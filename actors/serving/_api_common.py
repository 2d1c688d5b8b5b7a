"""What the two API modules share, as leaf helpers (they call nothing else of the serving package): the fields'
validators, the answer handed back to the HTTP layer, and server-sent-event framing."""

from __future__ import annotations

import json
from typing import Any, Mapping

import attrs

from gyre.actors.serving.sessions import ApiError, short_error

__all__ = [
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


def json_object_text(arguments: Any, where: str) -> str:
    """Tool-call arguments as JSON object text (what the template renders verbatim)."""
    if isinstance(arguments, Mapping):
        return json.dumps(arguments, ensure_ascii=False)
    if not isinstance(arguments, str):
        raise ApiError("invalid_request", f"{where} must be a JSON string", where)
    try:
        value = json.loads(arguments)
    except ValueError:
        raise ApiError("invalid_request", f"{where} is not valid JSON", where) from None
    if not isinstance(value, dict):
        raise ApiError("invalid_request", f"{where} must encode a JSON object", where)
    return arguments



def sse(data: Any, event: str | None = None) -> bytes:
    """One server-sent event: optional `event:` line, one `data:` line of compact JSON (or a literal string)."""
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    prefix = f"event: {event}\n" if event else ""
    return f"{prefix}data: {text}\n\n".encode("utf-8")
