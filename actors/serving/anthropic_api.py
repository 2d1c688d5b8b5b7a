"""Anthropic messages: the body into Gyre's neutral call form (sessions.ChatRequest), the call through the session's
`CallRunner`, and the outcome in Anthropic's shapes (`answer`; `count_tokens_answer` for /v1/messages/count_tokens).

Translation to the template's OpenAI-style messages:
- `system` (a string or text blocks) becomes the system text.
- A user message's `tool_result` blocks become one `tool` message each (in order, before the message's text, which
  is where Anthropic requires them), its text blocks one `user` message.
- An assistant message's text blocks become its content (joined), its `tool_use` blocks its tool calls
  (`input` rendered as JSON). `thinking` / `redacted_thinking` blocks are dropped: the proxy never produces them.
- `tools` ({name, description, input_schema}) become function tools; server tools (a `type` other than "custom")
  get 400. `tool_choice` {"type": "none"} removes the tools; "auto", "any" and "tool" (named) are accepted and
  not enforced (see `gyre.actors.serving.openai_api`). `thinking`, `metadata` and `cache_control` are ignored.
- Images and documents get 400.
"""

from __future__ import annotations

import json
from contextlib import aclosing
from itertools import chain
from typing import Any, AsyncIterator, Mapping, Sequence

from gyre.actors.serving._api_common import (
    Answer,
    JsonLimits,
    bool_field,
    failed,
    int_field,
    model_field,
    number_field,
    refused,
    require_object,
    sse,
    stop_field,
)
from gyre.actors.serving.json_bodies import converted_before, keep_converted
from gyre.actors.serving.sessions import (
    ApiError,
    CallContext,
    CallRunner,
    ChatOutcome,
    ChatRequest,
    ExecutionSession,
    IdFormat,
    StreamEnd,
    StreamStart,
)
from gyre.actors.serving.streaming import Delta, TextDelta
from gyre.engines.tool_calls import ToolCall

__all__ = [
    "IDS",
    "answer",
    "count_tokens_answer",
    "parse_messages_request",
    "parse_count_tokens_request",
    "message_body",
    "message_events",
    "MessageStream",
    "error_body",
]

IDS = IdFormat(response="msg_{tag}_{index}", call_prefix="toolu_{tag}_{index}_")
"""Anthropic's id shapes: msg_... answers, toolu_... tool uses."""


# -- the call ----------------------------------------------------------------------------------------------------


async def answer(
    body: Any, context: CallContext, runner: CallRunner, limits: JsonLimits = JsonLimits()
) -> AsyncIterator[bytes | Answer]:
    """A POST /v1/messages body (decoded JSON) -> its answer: parse, one call through `runner`, shape. `limits` bounds
    JSON inside strings, which this API has none of (tool inputs are objects, checked with the body): it is taken
    for the signature both API modules share.

    Yields the response (see `_api_common.Answer`): one Answer for a plain call; for a streamed one, the SSE bytes
    of each output chunk and then an Answer that says how it ended. message_start goes out with the first delta,
    so a call refused before any output still gets its usual error status."""
    started = False
    try:
        chat = parse_messages_request(body)
        if not chat.stream:
            yield Answer(200, message_body(await runner.complete(chat, context, IDS)))
            return
        shapes: MessageStream | None = None
        prefix = ""
        async with aclosing(runner.stream(chat, context, IDS)) as turn:
            async for item in turn:
                if isinstance(item, StreamStart):
                    shapes = MessageStream(item.response_id, chat.model, item.prompt_tokens)
                    prefix = item.call_id_prefix
                    continue
                assert shapes is not None, "a stream starts with StreamStart"
                if isinstance(item, StreamEnd):
                    events = _delta_events(shapes, item.deltas, prefix) + shapes.end(item.outcome)
                    head = [] if started else shapes.start()
                    started = True
                    yield _sse_events(head + events)
                    yield Answer(200)
                    return
                events = _delta_events(shapes, item, prefix)
                if events and not started:
                    started = True
                    events = shapes.start() + events
                yield _sse_events(events)
    except ApiError as error:
        if not started:
            yield refused(error, error_body(error))
            return
        yield sse(error_body(error), event="error")  # after the header: an error event, which the SDKs raise
        yield Answer(error.status, error=error)
    except Exception as error:
        refusal, cause = failed(error)
        if not started:
            yield Answer(500, error_body(refusal), error=refusal, cause=cause)
            return
        yield sse(error_body(refusal), event="error")
        yield Answer(500, error=refusal, cause=cause)


async def count_tokens_answer(body: Any, session: ExecutionSession, runner: CallRunner) -> Answer:
    """A POST /v1/messages/count_tokens body -> {"input_tokens": n}, the prompt tokens the call would send."""
    try:
        chat = parse_count_tokens_request(body)
        return Answer(200, {"input_tokens": await runner.count_tokens(chat, session)})
    except ApiError as error:
        return refused(error, error_body(error))
    except Exception as error:
        refusal, cause = failed(error)
        return Answer(500, error_body(refusal), error=refusal, cause=cause)


def _sse_events(events: list["Event"]) -> bytes:
    return b"".join(sse(data, event=name) for name, data in events)


def _delta_events(shapes: "MessageStream", deltas: Sequence[Delta], call_id_prefix: str) -> list["Event"]:
    """Events for content and tool-use deltas; tool-use ids are the answer's (the same as non-streamed)."""
    events: list[Event] = []
    for delta in deltas:
        if isinstance(delta, TextDelta):
            events += shapes.text(delta.text)
        else:
            events += shapes.tool_call(delta.index, delta.call, f"{call_id_prefix}{delta.index}")
    return events


# -- requests --------------------------------------------------------------------------------------------------


def _system_text(raw: Any) -> str | None:
    if raw is None:
        return None
    if isinstance(raw, str):
        return raw
    if isinstance(raw, list):
        texts = []
        for block in raw:
            if not isinstance(block, Mapping) or block.get("type") != "text" or not isinstance(block.get("text"), str):
                raise ApiError("invalid_request", "system must be a string or a list of text blocks", "system")
            texts.append(block["text"])
        return "\n".join(texts)
    raise ApiError("invalid_request", "system must be a string or a list of text blocks", "system")


def _blocks(content: Any, where: str) -> list[Mapping[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise ApiError("invalid_request", f"{where} must be a string or a list of content blocks", where)
    for j, block in enumerate(content):
        if not isinstance(block, Mapping) or not isinstance(block.get("type"), str):
            raise ApiError("invalid_request", f"{where}[{j}] must be a content block with a type", where)
    return content


def _text(block: Mapping[str, Any], where: str) -> str:
    text = block.get("text")
    if not isinstance(text, str):
        raise ApiError("invalid_request", f"{where}.text must be a string", where)
    return text


def _tool_result_text(block: Mapping[str, Any], where: str) -> str:
    content = block.get("content", "")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for k, part in enumerate(content):
            if not isinstance(part, Mapping) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                raise ApiError("invalid_request", f"{where}.content[{k}]: only text is supported, got {kind!r}", where)
            texts.append(_text(part, f"{where}.content[{k}]"))
        return "\n".join(texts)
    raise ApiError("invalid_request", f"{where}.content must be a string or text blocks", where)


def _messages(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The body's messages in the neutral form; those repeated from the session's earlier body (a `DecodedBody`)
    take what was made of them then, so a call converts only its new messages (shared between calls: read only)."""
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise ApiError("invalid_request", "messages must be a non-empty list", "messages")
    converted = converted_before(body, "anthropic")
    converted += [_message(i, message) for i, message in enumerate(raw[len(converted) :], len(converted))]
    keep_converted(body, "anthropic", converted)
    return list(chain.from_iterable(converted))


def _message(i: int, message: Any) -> list[dict[str, Any]]:
    """One Anthropic message -> its neutral messages (a user message with tool results gives one per result)."""
    out: list[dict[str, Any]] = []
    where = f"messages[{i}]"
    if not isinstance(message, Mapping):
        raise ApiError("invalid_request", f"{where} must be an object", where)
    role = message.get("role")
    blocks = _blocks(message.get("content"), f"{where}.content")
    if role == "user":
        texts: list[str] = []
        for j, block in enumerate(blocks):
            bwhere = f"{where}.content[{j}]"
            kind = block["type"]
            if kind == "text":
                texts.append(_text(block, bwhere))
            elif kind == "tool_result":
                call_id = block.get("tool_use_id")
                if not isinstance(call_id, str) or not call_id:
                    raise ApiError("invalid_request", f"{bwhere}.tool_use_id must be a non-empty string", bwhere)
                out.append({"role": "tool", "tool_call_id": call_id, "content": _tool_result_text(block, bwhere)})
            else:
                raise ApiError("invalid_request", f"{bwhere}: block type {kind!r} is not supported", bwhere)
        if texts or not any(b["type"] == "tool_result" for b in blocks):
            out.append({"role": "user", "content": "".join(texts)})
    elif role == "assistant":
        texts = []
        calls = []
        for j, block in enumerate(blocks):
            bwhere = f"{where}.content[{j}]"
            kind = block["type"]
            if kind == "text":
                texts.append(_text(block, bwhere))
            elif kind == "tool_use":
                name, tool_input = block.get("name"), block.get("input", {})
                if not isinstance(name, str) or not name:
                    raise ApiError("invalid_request", f"{bwhere}.name must be a non-empty string", bwhere)
                if not isinstance(tool_input, Mapping):
                    raise ApiError("invalid_request", f"{bwhere}.input must be an object", bwhere)
                calls.append(
                    {
                        "id": str(block.get("id") or ""),
                        "type": "function",
                        "function": {"name": name, "arguments": json.dumps(tool_input, ensure_ascii=False)},
                    }
                )
            elif kind in ("thinking", "redacted_thinking"):
                continue
            else:
                raise ApiError("invalid_request", f"{bwhere}: block type {kind!r} is not supported", bwhere)
        assistant: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
        if calls:
            assistant["tool_calls"] = calls
        out.append(assistant)
    else:
        raise ApiError("invalid_request", f"{where}.role must be 'user' or 'assistant', got {role!r}", where)
    return out


def _tools(raw: Any, choice: Any) -> tuple[dict[str, Any], ...] | None:
    if raw is None:
        tools: list[dict[str, Any]] = []
    elif not isinstance(raw, list):
        raise ApiError("invalid_request", "tools must be a list", "tools")
    else:
        tools = []
        for i, tool in enumerate(raw):
            where = f"tools[{i}]"
            if not isinstance(tool, Mapping):
                raise ApiError("invalid_request", f"{where} must be an object", where)
            if tool.get("type") not in (None, "custom"):
                raise ApiError("invalid_request", f"{where}: server tool {tool.get('type')!r} is not supported", where)
            name, schema = tool.get("name"), tool.get("input_schema")
            if not isinstance(name, str) or not name:
                raise ApiError("invalid_request", f"{where}.name must be a non-empty string", where)
            if not isinstance(schema, Mapping):
                raise ApiError("invalid_request", f"{where}.input_schema must be an object", where)
            spec: dict[str, Any] = {"name": name}
            if tool.get("description") is not None:
                if not isinstance(tool["description"], str):
                    raise ApiError("invalid_request", f"{where}.description must be a string", where)
                spec["description"] = tool["description"]
            spec["parameters"] = schema
            tools.append({"type": "function", "function": spec})
    if choice is not None:
        kind = choice.get("type") if isinstance(choice, Mapping) else None
        if kind not in ("auto", "any", "tool", "none"):
            raise ApiError("invalid_request", "tool_choice.type must be auto, any, tool or none", "tool_choice")
        if kind == "none":
            return None
        if kind in ("any", "tool") and not tools:
            raise ApiError("invalid_request", f"tool_choice {kind!r} needs tools", "tool_choice")
        if kind == "tool" and choice.get("name") not in {t["function"]["name"] for t in tools}:
            name = choice.get("name")
            raise ApiError("invalid_request", f"tool_choice names a tool not in tools: {name!r}", "tool_choice")
    return tuple(tools) or None


def parse_messages_request(body: Any) -> ChatRequest:
    """Validate a POST /v1/messages body. Raises ApiError (invalid_request) on anything malformed."""
    body = require_object(body)
    model = model_field(body)
    max_tokens = int_field(body, "max_tokens", 1)
    if max_tokens is None:
        raise ApiError("invalid_request", "max_tokens is required", "max_tokens")
    top_k = int_field(body, "top_k", 1)
    return ChatRequest(
        model=model,
        system_text=_system_text(body.get("system")),
        messages=tuple(_messages(body)),
        tools=_tools(body.get("tools"), body.get("tool_choice")),
        max_tokens=max_tokens,
        temperature=number_field(body, "temperature", 0.0, 1.0),
        top_p=number_field(body, "top_p", 0.0, 1.0, low_open=True),
        top_k=top_k,
        stop=stop_field(body.get("stop_sequences"), "stop_sequences"),
        seed=None,
        stream=bool_field(body, "stream"),
    )


def parse_count_tokens_request(body: Any) -> ChatRequest:
    """Validate a POST /v1/messages/count_tokens body (a messages body without max_tokens)."""
    body = require_object(body)
    return ChatRequest(
        model=model_field(body),
        system_text=_system_text(body.get("system")),
        messages=tuple(_messages(body)),
        tools=_tools(body.get("tools"), body.get("tool_choice")),
        max_tokens=None,
        temperature=None,
        top_p=None,
        top_k=None,
        stop=(),
        seed=None,
        stream=False,
    )


# -- answers ---------------------------------------------------------------------------------------------------

_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "stop_sequence": "stop_sequence"}


def _content_blocks(outcome: ChatOutcome) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    if outcome.content or not outcome.tool_calls:
        blocks.append({"type": "text", "text": outcome.content})
    for call, call_id in zip(outcome.tool_calls, outcome.tool_call_ids):
        blocks.append({"type": "tool_use", "id": call_id, "name": call.name, "input": call.arguments})
    return blocks


def _usage(outcome: ChatOutcome, output_tokens: int) -> dict[str, Any]:
    return {
        "input_tokens": outcome.prompt_tokens - outcome.cached_tokens,
        "output_tokens": output_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": outcome.cached_tokens,
    }


def message_body(outcome: ChatOutcome) -> dict[str, Any]:
    """The non-streaming answer (a `message` object)."""
    return {
        "id": outcome.response_id,
        "type": "message",
        "role": "assistant",
        "model": outcome.model,
        "content": _content_blocks(outcome),
        "stop_reason": _STOP_REASONS[outcome.finish],
        "stop_sequence": outcome.matched_stop if outcome.finish == "stop_sequence" else None,
        "usage": _usage(outcome, outcome.completion_tokens),
    }


Event = tuple[str, dict[str, Any]]


class MessageStream:
    """The streaming answer as (event name, data) pairs, built while the turn is generated, in the order the SDK's
    stream accumulator expects: message_start, per block content_block_start / _delta / _stop (text_delta, or
    input_json_delta carrying the whole input), message_delta (stop reason and the final usage), message_stop.

    Content and tool calls come in the order the model wrote them, so text after a tool call opens a new text
    block (a non-streamed answer puts all text in one block first; the texts joined are the same content, which
    is what the proxy compares when the agent sends the turn back). A turn with neither text nor calls gets one
    empty text block, as non-streamed.
    """

    def __init__(self, response_id: str, model: str, prompt_tokens: int) -> None:
        self._response_id = response_id
        self._model = model
        self._prompt_tokens = prompt_tokens
        self._blocks = 0
        self._open: str | None = None

    def start(self) -> list[Event]:
        message = {
            "id": self._response_id, "type": "message", "role": "assistant", "model": self._model, "content": [],
            "stop_reason": None, "stop_sequence": None,
            # Cached tokens are known only at the end: message_delta carries the final input counts.
            "usage": {"input_tokens": self._prompt_tokens, "output_tokens": 0, "cache_creation_input_tokens": 0,
                      "cache_read_input_tokens": 0},
        }
        return [("message_start", {"type": "message_start", "message": message})]

    def _close(self) -> list[Event]:
        if self._open is None:
            return []
        self._open = None
        return [("content_block_stop", {"type": "content_block_stop", "index": self._blocks - 1})]

    def _begin(self, block: dict[str, Any]) -> list[Event]:
        events = self._close()
        self._open = block["type"]
        self._blocks += 1
        events.append(("content_block_start",
                       {"type": "content_block_start", "index": self._blocks - 1, "content_block": block}))
        return events

    def text(self, text: str) -> list[Event]:
        if not text:
            return []
        events = [] if self._open == "text" else self._begin({"type": "text", "text": ""})
        delta = {"type": "text_delta", "text": text}
        events.append(("content_block_delta", {"type": "content_block_delta", "index": self._blocks - 1,
                                               "delta": delta}))
        return events

    def tool_call(self, index: int, call: ToolCall, call_id: str) -> list[Event]:
        events = self._begin({"type": "tool_use", "id": call_id, "name": call.name, "input": {}})
        delta = {"type": "input_json_delta", "partial_json": json.dumps(call.arguments, ensure_ascii=False)}
        events.append(("content_block_delta", {"type": "content_block_delta", "index": self._blocks - 1,
                                               "delta": delta}))
        return events + self._close()

    def end(self, outcome: ChatOutcome) -> list[Event]:
        events = self._begin({"type": "text", "text": ""}) if self._blocks == 0 else []
        events += self._close()
        usage = {**_usage(outcome, outcome.completion_tokens)}
        events.append((
            "message_delta",
            {
                "type": "message_delta",
                "delta": {
                    "stop_reason": _STOP_REASONS[outcome.finish],
                    "stop_sequence": outcome.matched_stop if outcome.finish == "stop_sequence" else None,
                },
                "usage": usage,
            },
        ))
        events.append(("message_stop", {"type": "message_stop"}))
        return events


def message_events(outcome: ChatOutcome) -> list[Event]:
    """The whole streaming answer of a finished turn (see `MessageStream`)."""
    stream = MessageStream(outcome.response_id, outcome.model, outcome.prompt_tokens)
    events = stream.start() + stream.text(outcome.content)
    for index, (call, call_id) in enumerate(zip(outcome.tool_calls, outcome.tool_call_ids)):
        events += stream.tool_call(index, call, call_id)
    return events + stream.end(outcome)


_ERROR_TYPES = {
    "invalid_request": "invalid_request_error",
    "context_length": "invalid_request_error",
    "authentication": "authentication_error",
    "not_found": "not_found_error",
    "too_large": "request_too_large",
    "overloaded": "overloaded_error",
    "timeout": "invalid_request_error",
    "server": "api_error",
}


def error_body(error: ApiError) -> dict[str, Any]:
    """Anthropic's error shape: {"type": "error", "error": {"type", "message"}}."""
    return {"type": "error", "error": {"type": _ERROR_TYPES[error.kind], "message": error.message}}
