"""The proxy's HTTP face: OpenAI and Anthropic chat APIs over token-in/token-out generation.

Every call: authenticate the execution's API key -> validate the body -> render the prompt ids (reusing the ids of
turns this execution generated) -> one `GenerateBackend.generate` -> decode, parse tool calls -> remember the turn
-> emit `ModelCallCompleted` -> answer in the API's shape (JSON, or server-sent events when `stream` is set).

Streaming (`stream: true`) sends content and tool calls while the turn is generated when the backend has
`generate_streaming` (every Gyre backend does): `gyre.actors.serving.streaming.TurnStreamer` turns output ids into deltas
that never need taking back, and the ids, log-probs, recorded turn and ModelCallCompleted are exactly those of a
non-streamed call (token-in/token-out does not change). The 200 header goes out with the first delta, so a call that
fails before any output still gets its API's usual error status; a failure after it becomes an error event in the
stream. A client that disconnects mid-stream has its generation aborted and the call dropped: neither recorded nor
emitted (counted in `calls_disconnected`), the same rule as for any call whose generation did not complete. A call
whose generation did complete is recorded and emitted even if the client is gone before reading the end. A backend
without `generate_streaming` streams the whole answer at the end.

Robustness: every refusal is an `ApiError` rendered in the API's own error shape with its usual status; anything
unexpected becomes a 500 in that shape and is logged; the number of calls in flight is bounded (503 beyond, which
the SDKs retry). Isolation: a call reaches only the `ExecutionSession` of its own key.
"""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import json
import threading
from typing import Any, Awaitable, Callable, Protocol

import attrs
import structlog
from aiohttp import web

from gyre.actors.serving import anthropic_api, openai_api
from gyre.actors.serving.openai_api import ApiError, ChatOutcome, ChatRequest, sse
from gyre.actors.serving.sessions import ExecutionSession, ProxySessions, RenderedPrompt, turn_key
from gyre.actors.serving.streaming import Delta, TextDelta, TurnStreamer
from gyre.engines.temperature import logprob_temperature
from gyre.engines.tool_calls import ParsedOutput, parse_tool_calls
from gyre.messages.model_calls import ModelCallCompleted

__all__ = [
    "ProxyHttpConfig",
    "BackendRequest",
    "BackendResult",
    "BackendRejected",
    "BackendUnavailable",
    "GenerateBackend",
    "StreamingBackend",
    "OnOutput",
    "ClientGone",
    "ProxyStatistics",
    "ProxyService",
    "PROXY_SERVICE",
    "build_proxy_app",
    "ServedApp",
    "final_text",
]

log = structlog.get_logger(__name__)

AGENT_HEADER = "X-Gyre-Agent"
CALL_HEADER = "X-Gyre-Call"
CALL_KINDS = ("turn", "summary")
MAX_AGENT_ID_CHARS = 256


@attrs.frozen
class ProxyHttpConfig:
    model_names: tuple[str, ...] = ("gyre",)
    """Model ids the proxy serves (GET /v1/models); a call naming another model gets 404."""
    max_context_tokens: int = 32768
    """Prompt + output tokens of one call at most. A prompt that leaves no room gets 400; a max_tokens that does
    not fit is lowered to what fits (agents ask for large budgets by habit)."""
    default_max_tokens: int = 4096
    """Output budget of an OpenAI call that names none."""
    max_body_bytes: int = 64 * 2**20
    """Request bodies above this get 413."""
    max_in_flight: int = 1024
    """Calls being generated at once; more get 503 (which the SDKs retry with backoff)."""
    owned_by: str = "gyre"


@attrs.frozen
class BackendRequest:
    """One generation the proxy asks of a rollout engine."""

    rid: str
    """Request id, unique per call ("<execution_id>/<call_index>"), for aborts."""
    execution_id: str
    session_key: str
    """Sticky-routing key: calls with the same key share a prefix and should go to the same cell."""
    prompt_ids: tuple[int, ...]
    sampling_params: dict[str, Any]
    """SGLang's sampling_params form: max_new_tokens, temperature, top_p, top_k, stop, stop_token_ids,
    sampling_seed."""


@attrs.frozen
class BackendResult:
    output_ids: tuple[int, ...]
    output_logprobs: tuple[float, ...]
    output_versions: tuple[int, ...]
    finish_reason: str
    """"stop", "length" or "abort"."""
    cached_tokens: int
    cell: str
    matched_stop: int | str | None = None
    """The stop token id or stop string that ended the output, when the engine says."""


class BackendRejected(ValueError):
    """The engine refused the request as invalid (the proxy answers 400)."""


class BackendUnavailable(RuntimeError):
    """No engine can take the request now (the proxy answers 503; the SDKs retry)."""


class GenerateBackend(Protocol):
    async def generate(self, request: BackendRequest) -> BackendResult: ...


OnOutput = Callable[[tuple[int, ...]], Awaitable[None]]
"""Receives output ids as they are generated: each id once, in order, across resubmissions of the call."""


class StreamingBackend(GenerateBackend, Protocol):
    async def generate_streaming(self, request: BackendRequest, on_output: OnOutput) -> BackendResult:
        """Like `generate` (the same result), calling `on_output` with new ids as they come. An exception raised by
        `on_output` aborts the generation and propagates."""
        ...


class ClientGone(ConnectionResetError):
    """The agent closed a streamed call's connection: the generation is aborted and the call dropped."""


@attrs.frozen
class ProxyStatistics:
    calls_completed: int
    calls_rejected: int
    """Calls answered with a 4xx."""
    calls_failed: int
    """Calls answered with a 5xx."""
    emit_failures: int
    """ModelCallCompleted messages that `on_call_completed` failed to take (logged each time)."""
    in_flight: int
    in_flight_peak: int
    calls_disconnected: int = 0
    """Streamed calls whose client left before the generation finished (aborted, neither recorded nor emitted)."""


@attrs.frozen
class _PreparedCall:
    """A validated call, ready for the backend."""

    chat: ChatRequest
    session: ExecutionSession
    rendered: RenderedPrompt
    call_index: int
    agent_id: str
    call_kind: str
    backend_request: BackendRequest
    response_id: str
    call_id_prefix: str


OnCallCompleted = Callable[[ModelCallCompleted], "Awaitable[None] | None"]


def _short_digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:12]


def final_text(
    template: Any, result: BackendResult, stop: tuple[str, ...], parse_tools: bool
) -> tuple[str, ParsedOutput | None, str | None]:
    """A finished turn's output ids -> (text after the stop-string cut, its tool-call split when the call offered
    tools, the matched stop string). The answer's content is the split's content, or the text without tools."""
    ids = list(result.output_ids)
    if ids and ids[-1] in template.stop_token_ids:
        ids.pop()
    text = template.decode(ids)
    matched: str | None = None
    if result.finish_reason == "stop" and stop:
        # A stop string ends the text before it (OpenAI and Anthropic both leave it out); the ids keep it, since
        # the policy did emit those tokens.
        candidates = [result.matched_stop] if isinstance(result.matched_stop, str) else list(stop)
        found = [(text.find(s), s) for s in candidates if s in stop and s in text]
        if found:
            position, matched = min(found)
            text = text[:position]
    return text, (parse_tool_calls(text) if parse_tools else None), matched


class ProxyService:
    """The request handlers and their counters; `build_proxy_app` mounts them on an aiohttp application."""

    def __init__(
        self,
        config: ProxyHttpConfig,
        sessions: ProxySessions,
        backend: GenerateBackend,
        on_call_completed: OnCallCompleted,
        clock: Callable[[], float],
    ) -> None:
        self.config = config
        self.sessions = sessions
        self.backend = backend
        self.on_call_completed = on_call_completed
        self.clock = clock
        self.template = sessions.template
        self._completed = self._rejected = self._failed = self._emit_failures = self._disconnected = 0
        self._in_flight = self._in_flight_peak = 0

    def statistics(self) -> ProxyStatistics:
        return ProxyStatistics(
            calls_completed=self._completed,
            calls_rejected=self._rejected,
            calls_failed=self._failed,
            emit_failures=self._emit_failures,
            in_flight=self._in_flight,
            in_flight_peak=self._in_flight_peak,
            calls_disconnected=self._disconnected,
        )

    # -- request plumbing ----------------------------------------------------------------------------------------

    def _authenticate(self, request: web.Request) -> ExecutionSession:
        key = request.headers.get("x-api-key")
        authorization = request.headers.get("Authorization", "")
        if not key and authorization[:7].lower() == "bearer ":
            key = authorization[7:].strip()
        session = self.sessions.authenticate(key)
        if session is None:
            raise ApiError("authentication", "missing or invalid API key" if key else "no API key was presented")
        return session

    async def _read_json(self, request: web.Request) -> Any:
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise ApiError("too_large", f"the request body exceeds {self.config.max_body_bytes} bytes") from None
        try:
            return json.loads(raw)
        except (ValueError, UnicodeDecodeError) as error:
            raise ApiError("invalid_request", f"the request body is not valid JSON: {error}") from None

    def _check_model(self, model: str) -> None:
        if model not in self.config.model_names:
            served = ", ".join(self.config.model_names)
            raise ApiError("not_found", f"model {model!r} does not exist; served: {served}", "model")

    @staticmethod
    def _labels(request: web.Request) -> tuple[str, str]:
        agent = request.headers.get(AGENT_HEADER, "")
        if len(agent) > MAX_AGENT_ID_CHARS:
            raise ApiError("invalid_request", f"{AGENT_HEADER} is longer than {MAX_AGENT_ID_CHARS} characters")
        kind = request.headers.get(CALL_HEADER, "").strip().lower()
        if kind and kind not in CALL_KINDS:
            raise ApiError("invalid_request", f"{CALL_HEADER} must be one of {CALL_KINDS}, got {kind!r}")
        return agent, kind

    def _render(self, session: ExecutionSession, chat: ChatRequest) -> RenderedPrompt:
        try:
            rendered = session.render(chat.messages, chat.tools, chat.system_text)
        except ValueError as error:  # the template's ChatTemplateError, or bad tool-call arguments
            raise ApiError("invalid_request", f"cannot render the conversation: {error}", "messages") from None
        if len(rendered.prompt_ids) >= self.config.max_context_tokens:
            raise ApiError(
                "context_length",
                f"the prompt has {len(rendered.prompt_ids)} tokens; this model's context holds "
                f"{self.config.max_context_tokens} (prompt + output)",
                "messages",
            )
        return rendered

    def _sampling_params(self, chat: ChatRequest, prompt_tokens: int) -> dict[str, Any]:
        room = self.config.max_context_tokens - prompt_tokens
        wanted = chat.max_tokens if chat.max_tokens is not None else self.config.default_max_tokens
        params: dict[str, Any] = {
            "max_new_tokens": min(wanted, room),
            "temperature": 1.0 if chat.temperature is None else chat.temperature,
            "top_p": 1.0 if chat.top_p is None else chat.top_p,
            "stop_token_ids": list(self.template.stop_token_ids),
        }
        if chat.top_k is not None:
            params["top_k"] = chat.top_k
        if chat.stop:
            params["stop"] = list(chat.stop)
        if chat.seed is not None:
            params["sampling_seed"] = chat.seed
        return params

    # -- the call ------------------------------------------------------------------------------------------------

    def _prepare(self, request: web.Request, chat: ChatRequest, session: ExecutionSession, api: str) -> _PreparedCall:
        """Everything that can refuse the call before generation: labels, model, rendering, the in-flight bound."""
        agent_id, call_kind = self._labels(request)
        self._check_model(chat.model)
        rendered = self._render(session, chat)
        prompt_ids = rendered.prompt_ids
        if self._in_flight >= self.config.max_in_flight:
            raise ApiError("overloaded", f"{self._in_flight} calls are in flight; retry later")
        call_index = session.next_call_index()
        tag = _short_digest(session.execution_id)
        if api == "openai":
            response_id, call_id_prefix = f"chatcmpl-{tag}-{call_index}", f"call_{tag}_{call_index}_"
        else:
            response_id, call_id_prefix = f"msg_{tag}_{call_index}", f"toolu_{tag}_{call_index}_"
        return _PreparedCall(
            chat=chat,
            session=session,
            rendered=rendered,
            call_index=call_index,
            agent_id=agent_id,
            call_kind=call_kind,
            backend_request=BackendRequest(
                rid=f"{session.execution_id}/{call_index}",
                execution_id=session.execution_id,
                session_key=f"{session.execution_id}/{agent_id}",
                prompt_ids=prompt_ids,
                sampling_params=self._sampling_params(chat, len(prompt_ids)),
            ),
            response_id=response_id,
            call_id_prefix=call_id_prefix,
        )

    async def _generate(self, call: _PreparedCall, on_output: OnOutput | None = None) -> BackendResult:
        """One generation through the backend, streamed to `on_output` when given and the backend can."""
        self._in_flight += 1
        self._in_flight_peak = max(self._in_flight_peak, self._in_flight)
        streaming = getattr(self.backend, "generate_streaming", None) if on_output is not None else None
        try:
            if streaming is not None:
                result = await streaming(call.backend_request, on_output)
            else:
                result = await self.backend.generate(call.backend_request)
        except BackendRejected as error:
            raise ApiError("invalid_request", f"the engine refused the request: {error}") from None
        except BackendUnavailable as error:
            raise ApiError("overloaded", f"no engine is available: {error}") from None
        finally:
            self._in_flight -= 1
        if result.finish_reason == "abort":
            # The agent never sees an aborted turn, so it is neither recorded nor emitted; the SDK retries the 503.
            raise ApiError("overloaded", "the generation was aborted (engine paused or drained); retry")
        if not (len(result.output_ids) == len(result.output_logprobs) == len(result.output_versions)):
            raise RuntimeError(
                f"backend returned {len(result.output_ids)} ids, {len(result.output_logprobs)} log-probs and "
                f"{len(result.output_versions)} versions"
            )
        return result

    async def _finish(
        self, call: _PreparedCall, result: BackendResult, started_s: float
    ) -> tuple[ChatOutcome, str, ParsedOutput | None]:
        """Decode, record the turn, emit ModelCallCompleted; the answer, the final text and its tool-call split."""
        chat, session = call.chat, call.session
        text, parsed, matched = self._final_text(chat, result)
        content, calls = (parsed.content, parsed.tool_calls) if parsed is not None else (text, ())
        if matched is not None:
            finish = "stop_sequence"
        elif result.finish_reason == "length":
            finish = "length"
        elif calls:
            finish = "tool_calls"
        else:
            finish = "stop"
        call_ids = tuple(f"{call.call_id_prefix}{i}" for i in range(len(calls)))
        session.record_turn(
            turn_key(content, [(c.name, c.arguments_json) for c in calls]),
            call.rendered.prompt_digest,
            result.output_ids,
        )
        token_logprobs = None
        if chat.logprobs:
            token_logprobs = tuple(
                (self.template.decode([token]), float(lp))
                for token, lp in zip(result.output_ids, result.output_logprobs)
            )
        finished_s = self.clock()
        prompt_ids = call.rendered.prompt_ids
        await self._emit(
            ModelCallCompleted(
                execution_id=session.execution_id,
                group_id=session.group_id,
                call_index=call.call_index,
                agent_id=call.agent_id,
                call_kind=call.call_kind,
                prompt_ids=prompt_ids,
                output_ids=tuple(result.output_ids),
                output_logprobs=tuple(float(x) for x in result.output_logprobs),
                output_versions=tuple(int(v) for v in result.output_versions),
                finish_reason=result.finish_reason,
                cached_tokens=int(result.cached_tokens),
                cell=result.cell,
                started_s=started_s,
                finished_s=finished_s,
                sampling_temperature=logprob_temperature(float(call.backend_request.sampling_params["temperature"])),
            )
        )
        outcome = ChatOutcome(
            response_id=call.response_id,
            model=chat.model,
            created_s=int(finished_s),
            content=content,
            tool_calls=calls,
            tool_call_ids=call_ids,
            finish=finish,
            matched_stop=matched,
            prompt_tokens=len(prompt_ids),
            completion_tokens=len(result.output_ids),
            cached_tokens=int(result.cached_tokens),
            token_logprobs=token_logprobs,
        )
        return outcome, text, parsed

    async def _complete(
        self, request: web.Request, chat: ChatRequest, session: ExecutionSession, api: str, started_s: float
    ) -> ChatOutcome:
        """Generate one turn, record it, emit ModelCallCompleted; return what to answer."""
        call = self._prepare(request, chat, session, api)
        result = await self._generate(call)
        outcome, _, _ = await self._finish(call, result, started_s)
        return outcome

    def _final_text(self, chat: ChatRequest, result: BackendResult) -> tuple[str, ParsedOutput | None, str | None]:
        return final_text(self.template, result, chat.stop, bool(chat.tools))

    async def _emit(self, message: ModelCallCompleted) -> None:
        try:
            outcome = self.on_call_completed(message)
            if inspect.isawaitable(outcome):
                await outcome
        except Exception:
            # The agent still gets its answer; the lost record is counted and logged, never silent.
            self._emit_failures += 1
            log.exception("model_call_emit_failed", execution_id=message.execution_id, call_index=message.call_index)

    # -- handlers ------------------------------------------------------------------------------------------------

    def _error_response(self, error: ApiError, api: str) -> web.Response:
        if error.status >= 500:
            self._failed += 1
        else:
            self._rejected += 1
        body = openai_api.error_body(error) if api == "openai" else anthropic_api.error_body(error)
        return web.json_response(body, status=error.status)

    async def _guarded(
        self, request: web.Request, api: str, handler: Callable[[], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        try:
            return await handler()
        except ApiError as error:
            log.info("proxy_call_refused", path=request.path, kind=error.kind, reason=error.message)
            return self._error_response(error, api)
        except ConnectionResetError:
            log.info("proxy_client_gone", path=request.path)
            raise
        except Exception as error:
            log.exception("proxy_call_failed", path=request.path)
            return self._error_response(ApiError("server", f"internal error: {type(error).__name__}"), api)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        started_s = self.clock()

        async def handle() -> web.StreamResponse:
            session = self._authenticate(request)
            chat = openai_api.parse_chat_request(await self._read_json(request))
            if chat.stream:
                return await self._stream_call(request, chat, session, "openai", started_s)
            outcome = await self._complete(request, chat, session, "openai", started_s)
            self._completed += 1
            return web.json_response(openai_api.completion_body(outcome))

        return await self._guarded(request, "openai", handle)

    async def messages(self, request: web.Request) -> web.StreamResponse:
        started_s = self.clock()

        async def handle() -> web.StreamResponse:
            session = self._authenticate(request)
            chat = anthropic_api.parse_messages_request(await self._read_json(request))
            if chat.stream:
                return await self._stream_call(request, chat, session, "anthropic", started_s)
            outcome = await self._complete(request, chat, session, "anthropic", started_s)
            self._completed += 1
            return web.json_response(anthropic_api.message_body(outcome))

        return await self._guarded(request, "anthropic", handle)

    async def _stream_call(
        self, request: web.Request, chat: ChatRequest, session: ExecutionSession, api: str, started_s: float
    ) -> web.StreamResponse:
        """A streamed call: deltas as the turn is generated (see the module doc)."""
        call = self._prepare(request, chat, session, api)
        writer = _SseWriter(request, call, api, int(started_s))
        streamer = TurnStreamer(
            self.template.decode, self.template.stop_token_ids, chat.stop, parse_tools=bool(chat.tools)
        )

        async def on_output(ids: tuple[int, ...]) -> None:
            if writer.client_gone():
                raise ClientGone("the client closed the stream")
            deltas = streamer.feed(ids)
            if deltas:
                await writer.send(writer.deltas(deltas))

        try:
            result = await self._generate(call, on_output)
        except ApiError as error:
            if not writer.started:
                raise  # nothing sent yet: the API's usual error status
            log.info("proxy_stream_failed", path=request.path, kind=error.kind, reason=error.message)
            self._failed += 1
            await writer.error(error)
            return writer.response
        except ConnectionResetError:  # ClientGone, or aiohttp's own reset while writing
            self._disconnected += 1
            log.info("proxy_client_gone", path=request.path, rid=call.backend_request.rid)
            raise
        except Exception as error:
            if not writer.started:
                raise
            log.exception("proxy_stream_failed", path=request.path)
            self._failed += 1
            await writer.error(ApiError("server", f"internal error: {type(error).__name__}"))
            return writer.response
        outcome, text, parsed = await self._finish(call, result, started_s)
        self._completed += 1
        events = writer.deltas(streamer.finish(text, parsed)) + writer.end(outcome)
        await writer.send(events)
        await writer.response.write_eof()
        return writer.response

    async def count_tokens(self, request: web.Request) -> web.StreamResponse:
        async def handle() -> web.StreamResponse:
            session = self._authenticate(request)
            chat = anthropic_api.parse_count_tokens_request(await self._read_json(request))
            self._check_model(chat.model)
            try:
                rendered = session.render(chat.messages, chat.tools, chat.system_text)
            except ValueError as error:
                raise ApiError("invalid_request", f"cannot render the conversation: {error}", "messages") from None
            return web.json_response({"input_tokens": len(rendered.prompt_ids)})

        return await self._guarded(request, "anthropic", handle)

    async def models(self, request: web.Request) -> web.StreamResponse:
        async def handle() -> web.StreamResponse:
            self._authenticate(request)
            created = int(self.clock())
            body = openai_api.models_body(self.config.model_names, created, self.config.owned_by)
            name = request.match_info.get("model")
            if name is None:
                return web.json_response(body)
            self._check_model(name)
            return web.json_response(next(m for m in body["data"] if m["id"] == name))

        return await self._guarded(request, "openai", handle)

    async def health(self, request: web.Request) -> web.StreamResponse:
        return web.json_response({"status": "ok"})



class _SseWriter:
    """One streamed answer: the API's event shapes (openai_api.CompletionStream or anthropic_api.MessageStream) as
    server-sent events, with the 200 header sent lazily before the first event."""

    def __init__(self, request: web.Request, call: _PreparedCall, api: str, created_s: int) -> None:
        self.request = request
        self.call = call
        self.api = api
        self.response = web.StreamResponse(
            status=200, headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        self.started = False
        chat = call.chat
        self.shapes: Any
        if api == "openai":
            self.shapes = openai_api.CompletionStream(call.response_id, chat.model, created_s, chat.include_usage)
        else:
            self.shapes = anthropic_api.MessageStream(call.response_id, chat.model, len(call.rendered.prompt_ids))

    def _events(self, shapes: list[Any]) -> list[bytes]:
        if self.api == "openai":
            return [sse(chunk) for chunk in shapes]
        return [sse(data, event=name) for name, data in shapes]

    def client_gone(self) -> bool:
        transport = self.request.transport
        return transport is None or transport.is_closing()

    def deltas(self, deltas: list[Delta]) -> list[bytes]:
        """Events for content and tool-call deltas; call ids are the answer's (the same as non-streamed)."""
        shapes: list[Any] = []
        for delta in deltas:
            if isinstance(delta, TextDelta):
                shapes += self.shapes.text(delta.text)
            else:
                shapes += self.shapes.tool_call(delta.index, delta.call, f"{self.call.call_id_prefix}{delta.index}")
        return self._events(shapes)

    def end(self, outcome: ChatOutcome) -> list[bytes]:
        events = self._events(self.shapes.end(outcome))
        return events + [sse("[DONE]")] if self.api == "openai" else events

    async def send(self, events: list[bytes]) -> None:
        if not events:
            return
        if not self.started:
            self.started = True
            await self.response.prepare(self.request)
            events = self._events(self.shapes.start()) + events
        for event in events:
            await self.response.write(event)

    async def error(self, error: ApiError) -> None:
        """A failure after the header went out: the API's error event (the SDKs raise it), then the end."""
        if self.api == "openai":
            events = [sse(openai_api.error_body(error))]
        else:
            events = [sse(anthropic_api.error_body(error), event="error")]
        await self.send(events)
        await self.response.write_eof()


PROXY_SERVICE: web.AppKey[ProxyService] = web.AppKey("gyre_proxy_service", ProxyService)


def _route_api(path: str) -> str:
    return "anthropic" if path.startswith("/v1/messages") else "openai"


@web.middleware
async def _http_errors_in_api_shape(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """Unknown routes and wrong methods answer in the API's error shape instead of aiohttp's plain text."""
    try:
        return await handler(request)
    except web.HTTPException as error:
        if error.status < 400:
            raise
        kind = {401: "authentication", 404: "not_found", 413: "too_large"}.get(error.status, "invalid_request")
        api_error = ApiError(kind, f"{request.method} {request.path}: {error.reason}")
        if _route_api(request.path) == "openai":
            body = openai_api.error_body(api_error)
        else:
            body = anthropic_api.error_body(api_error)
        return web.json_response(body, status=error.status)


def build_proxy_app(
    config: ProxyHttpConfig,
    sessions: ProxySessions,
    backend: GenerateBackend,
    on_call_completed: OnCallCompleted,
    *,
    clock: Callable[[], float],
) -> web.Application:
    """The proxy's aiohttp application. `clock` is the runtime clock (timings in ModelCallCompleted, `created`);
    `on_call_completed` may be a plain or an async function. `app[PROXY_SERVICE].statistics()` reads the counters."""
    service = ProxyService(config, sessions, backend, on_call_completed, clock)
    app = web.Application(client_max_size=config.max_body_bytes, middlewares=[_http_errors_in_api_shape])
    app[PROXY_SERVICE] = service
    app.router.add_post("/v1/chat/completions", service.chat_completions)
    app.router.add_get("/v1/models", service.models)
    app.router.add_get("/v1/models/{model}", service.models)
    app.router.add_post("/v1/messages", service.messages)
    app.router.add_post("/v1/messages/count_tokens", service.count_tokens)
    app.router.add_get("/health", service.health)
    return app


class ServedApp:
    """An aiohttp application served from a background thread with its own event loop.

    For synchronous programs that embed the proxy (tests with the real SDKs' sync clients, notebooks): `make_app`
    runs inside that loop, so engines and sessions it creates belong to it. Use as a context manager.
    """

    def __init__(
        self,
        make_app: Callable[[], "web.Application | Awaitable[web.Application]"],
        host: str = "127.0.0.1",
        port: int = 0,
        start_timeout_s: float = 60.0,
    ) -> None:
        self._make_app = make_app
        self._host = host
        self._port = port
        self._start_timeout_s = start_timeout_s
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.app: web.Application | None = None
        self.base_url = ""

    def __enter__(self) -> "ServedApp":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        started = threading.Event()
        failure: list[BaseException] = []

        async def serve() -> None:
            app = self._make_app()
            if inspect.isawaitable(app):
                app = await app
            self.app = app
            self._runner = web.AppRunner(app, access_log=None)
            await self._runner.setup()
            site = web.TCPSite(self._runner, self._host, self._port)
            await site.start()
            port = self._runner.addresses[0][1]
            self.base_url = f"http://{self._host}:{port}"

        def run() -> None:
            self.loop = asyncio.new_event_loop()
            try:
                self.loop.run_until_complete(serve())
            except BaseException as error:  # reported to the starting thread below
                failure.append(error)
                started.set()
                return
            started.set()
            self.loop.run_forever()

        self._thread = threading.Thread(target=run, name="gyre-served-app", daemon=True)
        self._thread.start()
        if not started.wait(self._start_timeout_s):
            raise TimeoutError(f"the app did not start within {self._start_timeout_s} s")
        if failure:
            raise failure[0]

    def call(self, coroutine: Awaitable[Any], timeout_s: float = 300.0) -> Any:
        """Run a coroutine on the app's loop and wait for its result."""
        assert self.loop is not None, "start() first"
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout_s)  # type: ignore[arg-type]

    def close(self) -> None:
        if self.loop is None or self._thread is None:
            return
        if self._runner is not None:
            self.call(self._runner.cleanup())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(30)
        self.loop.close()
        self.loop = None
