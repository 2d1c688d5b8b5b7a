"""OpenAI chat completions: the body into Gyre's neutral call form (sessions.ChatRequest), the call through the
session's `CallRunner`, and the outcome in OpenAI's shapes (`answer`).

The neutral form speaks OpenAI-style messages because the chat template does; the Anthropic translation produces
the same form.

What we enforce, and what we only accept:
- `tool_choice: "none"` removes the tools (they are not rendered, and the output is not parsed for tool calls).
  `"auto"`, `"required"` and a named function are accepted and the tools are rendered, but nothing constrains the
  decoding: the answer holds whatever calls the model wrote (none, or other tools). A named function must be one
  of `tools` (400 otherwise). The policy under training must learn to call tools; the proxy does not fake it.
- `n` must be 1; `logprobs: true` returns the behaviour log-prob of each output token; `top_logprobs`, non-zero
  penalties, `logit_bias` and non-text `response_format` are refused with 400 rather than silently ignored.
- `user`, `metadata`, `store`, `parallel_tool_calls`, `service_tier`, `reasoning_effort` and unknown fields are
  ignored (agents send them by habit; none changes what a local model can do).
- Message content may be a string or a list of text parts; images, audio and files get 400.
"""

from __future__ import annotations

from contextlib import aclosing
from typing import Any, AsyncIterator, Mapping, Sequence

from gyre.actors.serving._api_common import (
    Answer,
    JsonLimits,
    bool_field,
    failed,
    int_field,
    json_object_text,
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
    IdFormat,
    StreamEnd,
    StreamStart,
)
from gyre.actors.serving.streaming import Delta, TextDelta
from gyre.engines.tool_calls import ToolCall

__all__ = [
    "IDS",
    "answer",
    "parse_chat_request",
    "completion_body",
    "completion_chunks",
    "CompletionStream",
    "models_body",
    "error_body",
]

IDS = IdFormat(response="chatcmpl-{tag}-{index}", call_prefix="call_{tag}_{index}_")
"""OpenAI's id shapes: chatcmpl-... answers, call_... tool calls."""


# -- the call ----------------------------------------------------------------------------------------------------


async def answer(
    body: Any, context: CallContext, runner: CallRunner, limits: JsonLimits = JsonLimits()
) -> AsyncIterator[bytes | Answer]:
    """A POST /v1/chat/completions body (decoded JSON) -> its answer: parse, one call through `runner`, shape.

    Yields the response (see `_api_common.Answer`): one Answer for a plain call; for a streamed one, the SSE bytes
    of each output chunk and then an Answer that says how it ended. The role chunk goes out with the first delta,
    so a call refused before any output still gets its usual error status."""
    started = False
    try:
        chat = parse_chat_request(body, limits)
        if not chat.stream:
            yield Answer(200, completion_body(await runner.complete(chat, context, IDS)))
            return
        shapes: CompletionStream | None = None
        prefix = ""
        async with aclosing(runner.stream(chat, context, IDS)) as turn:
            async for item in turn:
                if isinstance(item, StreamStart):
                    shapes = CompletionStream(item.response_id, chat.model, int(context.started_s), chat.include_usage)
                    prefix = item.call_id_prefix
                    continue
                assert shapes is not None, "a stream starts with StreamStart"
                if isinstance(item, StreamEnd):
                    chunks = _delta_chunks(shapes, item.deltas, prefix) + shapes.end(item.outcome)
                    head = [] if started else shapes.start()
                    started = True
                    yield b"".join(sse(chunk) for chunk in head + chunks) + sse("[DONE]")
                    yield Answer(200)
                    return
                chunks = _delta_chunks(shapes, item, prefix)
                if chunks and not started:
                    started = True
                    chunks = shapes.start() + chunks
                yield b"".join(sse(chunk) for chunk in chunks)
    except ApiError as error:
        if not started:
            yield refused(error, error_body(error))
            return
        yield sse(error_body(error))  # after the header: an error event, which the SDKs raise
        yield Answer(error.status, error=error)
    except Exception as error:
        refusal, cause = failed(error)
        if not started:
            yield Answer(500, error_body(refusal), error=refusal, cause=cause)
            return
        yield sse(error_body(refusal))
        yield Answer(500, error=refusal, cause=cause)


def _delta_chunks(shapes: "CompletionStream", deltas: Sequence[Delta], call_id_prefix: str) -> list[dict[str, Any]]:
    """Chunks for content and tool-call deltas; call ids are the answer's (the same as non-streamed)."""
    chunks: list[dict[str, Any]] = []
    for delta in deltas:
        if isinstance(delta, TextDelta):
            chunks += shapes.text(delta.text)
        else:
            chunks += shapes.tool_call(delta.index, delta.call, f"{call_id_prefix}{delta.index}")
    return chunks


# -- requests --------------------------------------------------------------------------------------------------


def _text_content(content: Any, where: str, allow_none: bool) -> str | None:
    if content is None:
        if allow_none:
            return None
        raise ApiError("invalid_request", f"{where} is required", where)
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                raise ApiError("invalid_request", f"{where}: only text parts are supported, got {kind!r}", where)
            texts.append(part["text"])
        return "".join(texts)
    raise ApiError("invalid_request", f"{where} must be a string or a list of text parts", where)


def _plain_message(raw: Any) -> dict[str, Any] | None:
    """The common shapes (string content, no extras to check) without the general path's per-field checks: every
    call re-sends the whole conversation, so this runs for every message of every call. None: take the general
    path (which also produces the errors)."""
    if type(raw) is not dict:
        return None
    content = raw.get("content")
    if type(content) is not str:
        return None
    role = raw.get("role")
    if role == "user" or role == "system":
        return {"role": role, "content": content}
    if role == "tool":
        call_id = raw.get("tool_call_id")
        if type(call_id) is str and call_id:
            return {"role": "tool", "tool_call_id": call_id, "content": content}
    elif role == "assistant" and not raw.get("tool_calls") and raw.get("function_call") is None:
        return {"role": "assistant", "content": content}
    return None


def _message(index: int, raw: Any, limits: JsonLimits) -> dict[str, Any]:
    plain = _plain_message(raw)
    if plain is not None:
        return plain
    where = f"messages[{index}]"
    if not isinstance(raw, Mapping):
        raise ApiError("invalid_request", f"{where} must be an object", where)
    role = raw.get("role")
    if role in ("system", "developer"):
        return {"role": "system", "content": _text_content(raw.get("content"), f"{where}.content", False)}
    if role == "user":
        return {"role": "user", "content": _text_content(raw.get("content"), f"{where}.content", False)}
    if role == "tool":
        call_id = raw.get("tool_call_id")
        if not isinstance(call_id, str) or not call_id:
            raise ApiError("invalid_request", f"{where}.tool_call_id must be a non-empty string", where)
        content = _text_content(raw.get("content"), f"{where}.content", False)
        return {"role": "tool", "tool_call_id": call_id, "content": content}
    if role == "assistant":
        if raw.get("function_call") is not None:
            raise ApiError("invalid_request", f"{where}.function_call is not supported; use tool_calls", where)
        message: dict[str, Any] = {
            "role": "assistant",
            "content": _text_content(raw.get("content"), f"{where}.content", True) or "",
        }
        calls = raw.get("tool_calls")
        if calls:
            if not isinstance(calls, list):
                raise ApiError("invalid_request", f"{where}.tool_calls must be a list", where)
            checked = []
            for j, call in enumerate(calls):
                cwhere = f"{where}.tool_calls[{j}]"
                function = call.get("function") if isinstance(call, Mapping) else None
                if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
                    raise ApiError("invalid_request", f"{cwhere}.function.name must be a string", cwhere)
                checked.append(
                    {
                        "id": str(call.get("id") or ""),
                        "type": "function",
                        "function": {
                            "name": function["name"],
                            "arguments": json_object_text(
                                function.get("arguments", "{}"), f"{cwhere}.function.arguments", limits
                            ),
                        },
                    }
                )
            message["tool_calls"] = checked
        return message
    raise ApiError("invalid_request", f"{where}.role {role!r} is not supported", where)


def _tools(raw: Any) -> tuple[dict[str, Any], ...] | None:
    if raw is None:
        return None
    if not isinstance(raw, list):
        raise ApiError("invalid_request", "tools must be a list", "tools")
    tools = []
    for i, tool in enumerate(raw):
        where = f"tools[{i}]"
        function = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(tool, Mapping) or tool.get("type") != "function" or not isinstance(function, Mapping):
            raise ApiError("invalid_request", f"{where} must be {{'type': 'function', 'function': {{...}}}}", where)
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise ApiError("invalid_request", f"{where}.function.name must be a non-empty string", where)
        spec: dict[str, Any] = {"name": name}
        if function.get("description") is not None:
            if not isinstance(function["description"], str):
                raise ApiError("invalid_request", f"{where}.function.description must be a string", where)
            spec["description"] = function["description"]
        if function.get("parameters") is not None:
            if not isinstance(function["parameters"], Mapping):
                raise ApiError("invalid_request", f"{where}.function.parameters must be an object", where)
            spec["parameters"] = function["parameters"]
        tools.append({"type": "function", "function": spec})
    return tuple(tools) or None


def _apply_tool_choice(choice: Any, tools: tuple[dict[str, Any], ...] | None) -> tuple[dict[str, Any], ...] | None:
    if choice is None or choice == "auto":
        return tools
    if choice == "none":
        return None
    if choice == "required":
        if not tools:
            raise ApiError("invalid_request", "tool_choice 'required' needs tools", "tool_choice")
        return tools
    if isinstance(choice, Mapping) and choice.get("type") == "function":
        name = (choice.get("function") or {}).get("name") if isinstance(choice.get("function"), Mapping) else None
        if not tools or name not in {t["function"]["name"] for t in tools}:
            raise ApiError("invalid_request", f"tool_choice names a function not in tools: {name!r}", "tool_choice")
        return tools
    raise ApiError(
        "invalid_request", "tool_choice must be 'none', 'auto', 'required' or a named function", "tool_choice"
    )


def parse_chat_request(body: Any, limits: JsonLimits = JsonLimits()) -> ChatRequest:
    """Validate a POST /v1/chat/completions body (tool-call arguments decoded within `limits`). Raises ApiError
    (invalid_request) on anything malformed."""
    body = require_object(body)
    model = model_field(body)
    raw_messages = body.get("messages")
    if not isinstance(raw_messages, list) or not raw_messages:
        raise ApiError("invalid_request", "messages must be a non-empty list", "messages")
    # Each message's normal form (a pure function of it); those repeated from the session's earlier body are taken
    # from it, so a call converts only its new messages. Shared between calls: read only.
    messages = converted_before(body, "openai")
    messages += [_message(i, m, limits) for i, m in enumerate(raw_messages[len(messages) :], len(messages))]
    keep_converted(body, "openai", messages)
    system_text = None
    if messages[0]["role"] == "system":
        system_text = messages.pop(0)["content"]
    tools = _apply_tool_choice(body.get("tool_choice"), _tools(body.get("tools")))

    if int_field(body, "n", 1) not in (None, 1):
        raise ApiError("invalid_request", "only n=1 is supported", "n")
    for name in ("presence_penalty", "frequency_penalty"):
        if number_field(body, name, -2.0, 2.0) not in (None, 0.0):
            raise ApiError("invalid_request", f"{name} is not supported (must be 0)", name)
    if body.get("logit_bias"):
        raise ApiError("invalid_request", "logit_bias is not supported", "logit_bias")
    if int_field(body, "top_logprobs", 0) not in (None, 0):
        raise ApiError("invalid_request", "top_logprobs is not supported", "top_logprobs")
    response_format = body.get("response_format")
    if response_format is not None and (
        not isinstance(response_format, Mapping) or response_format.get("type") != "text"
    ):
        raise ApiError("invalid_request", "only response_format {'type': 'text'} is supported", "response_format")
    stream_options = body.get("stream_options")
    if stream_options is not None and not isinstance(stream_options, Mapping):
        raise ApiError("invalid_request", "stream_options must be an object", "stream_options")
    max_tokens = int_field(body, "max_completion_tokens", 1)
    legacy_max = int_field(body, "max_tokens", 1)
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise ApiError("invalid_request", "seed must be an integer", "seed")
    return ChatRequest(
        model=model,
        system_text=system_text,
        messages=tuple(messages),
        tools=tools,
        max_tokens=max_tokens if max_tokens is not None else legacy_max,
        temperature=number_field(body, "temperature", 0.0, 2.0),
        top_p=number_field(body, "top_p", 0.0, 1.0, low_open=True),
        top_k=None,
        stop=stop_field(body.get("stop"), "stop"),
        seed=seed,
        stream=bool_field(body, "stream"),
        include_usage=bool((stream_options or {}).get("include_usage", False)),
        logprobs=bool_field(body, "logprobs"),
    )


# -- answers ---------------------------------------------------------------------------------------------------


def _finish_reason(outcome: ChatOutcome) -> str:
    return "stop" if outcome.finish == "stop_sequence" else outcome.finish


def _usage(outcome: ChatOutcome) -> dict[str, Any]:
    return {
        "prompt_tokens": outcome.prompt_tokens,
        "completion_tokens": outcome.completion_tokens,
        "total_tokens": outcome.prompt_tokens + outcome.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": outcome.cached_tokens},
    }


def _logprobs(outcome: ChatOutcome) -> dict[str, Any] | None:
    if outcome.token_logprobs is None:
        return None
    return {
        "content": [
            {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8")), "top_logprobs": []}
            for token, logprob in outcome.token_logprobs
        ],
        "refusal": None,
    }


def _tool_calls_json(outcome: ChatOutcome) -> list[dict[str, Any]]:
    return [
        {"id": call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments_json}}
        for call, call_id in zip(outcome.tool_calls, outcome.tool_call_ids)
    ]


def completion_body(outcome: ChatOutcome) -> dict[str, Any]:
    """The non-streaming answer (`chat.completion`)."""
    message: dict[str, Any] = {"role": "assistant", "content": outcome.content, "refusal": None}
    if outcome.tool_calls:
        message["tool_calls"] = _tool_calls_json(outcome)
        if not outcome.content:
            message["content"] = None
    return {
        "id": outcome.response_id,
        "object": "chat.completion",
        "created": outcome.created_s,
        "model": outcome.model,
        "system_fingerprint": None,
        "choices": [
            {"index": 0, "message": message, "logprobs": _logprobs(outcome), "finish_reason": _finish_reason(outcome)}
        ],
        "usage": _usage(outcome),
    }


class CompletionStream:
    """The streaming answer as `chat.completion.chunk` objects, built while the turn is generated (each is sent as
    `data: {...}`, then `data: [DONE]`).

    Shapes as OpenAI sends them: a first delta with the role, content deltas, one delta per tool call (id, type,
    name and the whole arguments), a last delta with finish_reason (carrying the log-probs when asked: they are
    known per token only at the end), and with include_usage a final chunk whose choices are empty and usage is set
    (every earlier chunk then carries usage: null).
    """

    def __init__(self, response_id: str, model: str, created_s: int, include_usage: bool) -> None:
        self._head = {"id": response_id, "object": "chat.completion.chunk", "created": created_s, "model": model,
                      "system_fingerprint": None}
        self._include_usage = include_usage

    def _chunk(self, delta: dict[str, Any], finish: str | None = None, logprobs: Any = None) -> dict[str, Any]:
        body = {**self._head, "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}
        if self._include_usage:
            body["usage"] = None
        return body

    def start(self) -> list[dict[str, Any]]:
        return [self._chunk({"role": "assistant", "content": "", "refusal": None})]

    def text(self, text: str) -> list[dict[str, Any]]:
        return [self._chunk({"content": text})] if text else []

    def tool_call(self, index: int, call: ToolCall, call_id: str) -> list[dict[str, Any]]:
        function = {"name": call.name, "arguments": call.arguments_json}
        return [self._chunk({"tool_calls": [{"index": index, "id": call_id, "type": "function", "function": function}]})]

    def end(self, outcome: ChatOutcome) -> list[dict[str, Any]]:
        chunks = [self._chunk({}, finish=_finish_reason(outcome), logprobs=_logprobs(outcome))]
        if self._include_usage:
            chunks.append({**self._head, "choices": [], "usage": _usage(outcome)})
        return chunks


def completion_chunks(outcome: ChatOutcome, include_usage: bool) -> list[dict[str, Any]]:
    """The whole streaming answer of a finished turn (see `CompletionStream`)."""
    stream = CompletionStream(outcome.response_id, outcome.model, outcome.created_s, include_usage)
    chunks = stream.start() + stream.text(outcome.content)
    for index, (call, call_id) in enumerate(zip(outcome.tool_calls, outcome.tool_call_ids)):
        chunks += stream.tool_call(index, call, call_id)
    return chunks + stream.end(outcome)


def models_body(model_names: Sequence[str], created_s: int, owned_by: str) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [{"id": name, "object": "model", "created": created_s, "owned_by": owned_by} for name in model_names],
    }


_CODES = {
    "authentication": "invalid_api_key",
    "not_found": "model_not_found",
    "context_length": "context_length_exceeded",
}
_TYPES = {"overloaded": "server_error", "server": "server_error"}


def error_body(error: ApiError) -> dict[str, Any]:
    """OpenAI's error shape: {"error": {"message", "type", "param", "code"}}."""
    return {
        "error": {
            "message": error.message,
            "type": _TYPES.get(error.kind, "invalid_request_error"),
            "param": error.param,
            "code": _CODES.get(error.kind),
        }
    }
