"""The proxy's HTTP face: OpenAI and Anthropic chat APIs over token-in/token-out generation.

This layer is HTTP only: the routes, the bounds (ProxyHttpConfig lists them all: request heads and bodies in size
and time, JSON depth and strings, calls in flight), the API key, the X-Gyre-* labels, and
the response (JSON, or server-sent events written as the API module yields them). It hands the decoded body to the
API module (`openai_api.answer`, `anthropic_api.answer`), which parses it, makes the call through the sessions'
`CallRunner` and shapes the answer; the path as a whole is in the package doc (gyre.actors.serving).

Streaming (`stream: true`): the 200 header goes out with the first event, so a call that fails before any output
still gets its API's usual error status; a failure after it becomes an error event in the stream. The connection is
looked at on every output chunk; a client that has left has its generation aborted and the call dropped (counted in
`calls_disconnected`; see sessions.py for when such a call is still recorded).

Robustness: every refusal is an `ApiError` rendered in the API's own error shape with its usual status; anything
unexpected becomes a 500 in that shape and one short log line; the number of calls in flight is bounded (503
beyond, which the SDKs retry). Isolation: a call reaches only the `ExecutionSession` of its own key.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import threading
from contextlib import aclosing
from pathlib import Path
from types import ModuleType
from typing import Any, Awaitable, Callable

import attrs
import structlog
from aiohttp import web

from gyre.actors.serving import anthropic_api, openai_api
from gyre.actors.serving._api_common import Answer, JsonLimits
from gyre.actors.serving.backends import GenerateBackend
from gyre.actors.serving.json_bodies import BodyCache, BodyCacheConfig, not_negative
from gyre.actors.serving.sessions import (
    ApiError,
    CallContext,
    CallRunner,
    ClientGone,
    ExecutionSession,
    OnCallCompleted,
    ProxySessions,
    short_error,
)
from gyre.runtime.errors import ConfigError
from gyre.runtime.validators import count, positive

__all__ = [
    "ProxyHttpConfig",
    "HttpStatistics",
    "check_context_fits",
    "runner_options",
    "ProxyService",
    "PROXY_SERVICE",
    "build_proxy_app",
    "ServedApp",
]

log = structlog.get_logger(__name__)

AGENT_HEADER = "X-Gyre-Agent"
CALL_HEADER = "X-Gyre-Call"
CALL_KINDS = ("turn", "summary")
MAX_AGENT_ID_CHARS = 256


@attrs.frozen
class ProxyHttpConfig:
    """The HTTP face's behaviour and its bounds. Every request meets the bounds before any work is done for it.

    The limits, in the order a call meets them (each refusal names the field):
    - `header_read_timeout_s` (10 s): a connection must deliver a complete request head within this of connecting
      or of its previous answer; else it is closed (slow clients holding connections open; also the idle
      keep-alive time).
    - the API key (401), then `max_in_flight` (1024 calls handled at once; 503 beyond, which the SDKs retry).
    - `max_body_bytes` (4 MiB) per POST route (chat completions, messages, count_tokens; the GET routes read no
      body): 413, read no further. `body_read_timeout_s` (30 s): the whole body, once its head is in; 408.
    - `max_json_depth` (64 levels) and `max_json_string_chars` (1 Mi characters), checked on the decoded body
      before anything reads it, tool-call arguments (JSON inside a string) included; invalid UTF-8 and lone
      surrogates (which no tokenizer takes) are refused the same way: 400.
    - `body_cache_bytes` (256 MiB), `body_cache_per_session` (8): bodies kept so that the next body of the same
      conversation, which repeats it, is decoded from where it differs (json_bodies.py); bytes kept in all and
      bodies per session.
    - `max_prompt_chars_per_token` (16): a prompt of more than max_context_tokens x this many characters is
      refused (400, context_length) before it is tokenised.
    - `max_context_tokens`: prompt + output tokens (400 for a prompt that leaves no room).
    - `offload_render_chars` (32 Ki): a prompt that adds more characters than this to what its session has
      rendered is rendered and tokenised on one of `render_threads` worker threads, so the event loop (other
      calls, /health) goes on meanwhile.
    - `stream_buffer_chunks` (64): output chunks a streamed call holds for a reader slower than the engine.
    """

    model_names: tuple[str, ...] = ("gyre",)
    """Model ids the proxy serves (GET /v1/models); a call naming another model gets 404."""
    max_context_tokens: int = attrs.field(default=32768, validator=count)
    """Prompt + output tokens of one call at most. A prompt that leaves no room gets 400; a max_tokens that does
    not fit is lowered to what fits (agents ask for large budgets by habit). At most the model's
    max_position_embeddings (`check_context_fits`)."""
    default_max_tokens: int = attrs.field(default=4096, validator=count)
    """Output budget of an OpenAI call that names none."""
    max_body_bytes: int = attrs.field(default=4 * 2**20, validator=count)
    """Bodies of the POST routes above this get 413. 4 MiB is ~8x the JSON of a full 128K-token conversation."""
    body_read_timeout_s: float = attrs.field(default=30.0, validator=positive)
    """How long a request's body may take to arrive once its head is in; 408 beyond."""
    header_read_timeout_s: float = attrs.field(default=10.0, validator=positive)
    """How long a connection may take to send a complete request head (after connecting, or after its previous
    answer: this is also how long an idle keep-alive connection is kept); it is closed beyond."""
    max_json_depth: int = attrs.field(default=64, validator=count)
    """Nesting of arrays and objects in a body (and in tool-call arguments) at most; 400 beyond. Real tool schemas
    nest ~10 deep; the bound keeps every recursive step after parsing (copies, canonical JSON) far from Python's
    recursion limit."""
    max_json_string_chars: int = attrs.field(default=2**20, validator=count)
    """Characters of one string in a body (keys included) at most; 400 beyond."""
    body_cache_bytes: int = attrs.field(default=256 * 2**20, validator=not_negative)
    """Request bodies kept, all sessions together, so that a conversation's next body is decoded only after the
    messages it repeats (0: every body decoded whole)."""
    body_cache_per_session: int = attrs.field(default=8, validator=count)
    """Bodies kept per session (one per conversation it interleaves)."""
    max_prompt_chars_per_token: int = attrs.field(default=16, validator=count)
    """A prompt of more than max_context_tokens x this many characters (messages, system text, tools) gets 400
    without being tokenised: real text averages 3-5 characters per token, so 16 leaves room for whitespace-heavy
    code while a prompt that long could not fit anyway."""
    offload_render_chars: int = attrs.field(default=32 * 2**10, validator=count)
    """Prompts of more characters are rendered on a worker thread (see `render_threads`); smaller ones inline, where
    a thread hop would cost more than the render."""
    render_threads: int = attrs.field(default=2, validator=count)
    """Worker threads for large renders. Renders of one execution still run one at a time (they share its state)."""
    max_in_flight: int = attrs.field(default=1024, validator=count)
    """Calls being handled at once; more get 503 (which the SDKs retry with backoff)."""
    stream_buffer_chunks: int = attrs.field(default=64, validator=count)
    """Output chunks a streamed call holds for a reader slower than the engine; beyond, the generation waits."""
    owned_by: str = "gyre"
    """The `owned_by` of GET /v1/models."""


def check_context_fits(model_dir: str | Path, max_context_tokens: int) -> None:
    """ConfigError when `max_context_tokens` exceeds the model's `max_position_embeddings` (config.json): a prompt
    past the model's positions would be answered with 200 and garbage."""
    config_file = Path(model_dir) / "config.json"
    try:
        positions = json.loads(config_file.read_text(encoding="utf-8")).get("max_position_embeddings")
    except (OSError, ValueError) as error:
        raise ConfigError(f"cannot read {config_file}: {error}") from None
    if isinstance(positions, int) and max_context_tokens > positions:
        raise ConfigError(
            f"max_context_tokens {max_context_tokens} exceeds the model's max_position_embeddings {positions} "
            f"({config_file})"
        )


def runner_options(config: ProxyHttpConfig) -> dict[str, Any]:
    """aiohttp AppRunner / run_app options the bounds need: aiohttp closes a connection that has no complete request
    head when its keep-alive time runs out (counted from connecting, then from each answer), which makes
    keepalive_timeout the header read timeout. After answering a call whose body it did not read to the end (408,
    413), aiohttp goes on reading and discarding that body for `lingering_time` (its default 10 s), so that a client
    still sending gets the answer rather than a reset; that wait is bounded by the same header read timeout: a
    client has that long to send its next bytes, whatever they are."""
    return {"keepalive_timeout": config.header_read_timeout_s, "lingering_time": config.header_read_timeout_s}


@attrs.frozen
class HttpStatistics:
    """The HTTP face's counters."""

    calls_completed: int
    """Calls answered with a result."""
    calls_rejected: int
    """Calls answered with a 4xx."""
    calls_failed: int
    """Calls answered with a 5xx."""
    emit_failures: int
    """ModelCallCompleted records that `on_call_completed` failed to take (logged each time)."""
    in_flight: int
    """Model calls being handled now (from the body read to the answer's last byte)."""
    in_flight_peak: int
    """The most model calls handled at once."""
    calls_disconnected: int = 0
    """Streamed calls whose client left before the generation finished (aborted, neither recorded nor emitted)."""


TRIM_AFTER_BODY_BYTES = 2**20
"""After a call whose body was larger, freed heap memory is handed back to the OS (`_release_freed_memory`)."""


def _load_malloc_trim() -> Callable[[int], int] | None:
    try:
        import ctypes

        return ctypes.CDLL("libc.so.6").malloc_trim  # glibc only; elsewhere nothing to do
    except (OSError, AttributeError):
        return None


_MALLOC_TRIM = _load_malloc_trim()


def _release_freed_memory() -> None:
    """glibc keeps freed memory for reuse, and once a large block was freed it serves the next large ones from the
    heap instead of mmap, so a few megabyte-sized bodies leave the process that much bigger for good; malloc_trim
    returns the free pages (a few ms, only after large bodies)."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


def _client_gone(request: web.Request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


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
        self.clock = clock
        self.runner = CallRunner(
            sessions.template,
            backend,
            on_call_completed,
            clock,
            model_names=config.model_names,
            max_context_tokens=config.max_context_tokens,
            default_max_tokens=config.default_max_tokens,
            max_prompt_chars=config.max_context_tokens * config.max_prompt_chars_per_token,
            offload_render_chars=config.offload_render_chars,
            render_threads=config.render_threads,
            stream_buffer_chunks=config.stream_buffer_chunks,
        )
        self.json_limits = JsonLimits(config.max_json_depth, config.max_json_string_chars)
        self.bodies = BodyCache(
            self.json_limits, BodyCacheConfig(config.body_cache_bytes, config.body_cache_per_session)
        )
        self._completed = self._rejected = self._failed = self._disconnected = 0
        self._in_flight = self._in_flight_peak = 0

    def statistics(self) -> HttpStatistics:
        return HttpStatistics(
            calls_completed=self._completed,
            calls_rejected=self._rejected,
            calls_failed=self._failed,
            emit_failures=self.runner.emit_failures,
            in_flight=self._in_flight,
            in_flight_peak=self._in_flight_peak,
            calls_disconnected=self._disconnected,
        )

    # -- bounds and authentication -------------------------------------------------------------------------------

    def _authenticate(self, request: web.Request) -> ExecutionSession:
        key = request.headers.get("x-api-key")
        authorization = request.headers.get("Authorization", "")
        if not key and authorization[:7].lower() == "bearer ":
            key = authorization[7:].strip()
        session = self.sessions.authenticate(key)
        if session is None:
            raise ApiError("authentication", "missing or invalid API key" if key else "no API key was presented")
        return session

    @staticmethod
    def _labels(request: web.Request) -> tuple[str, str]:
        agent = request.headers.get(AGENT_HEADER, "")
        if len(agent) > MAX_AGENT_ID_CHARS:
            raise ApiError("invalid_request", f"{AGENT_HEADER} is longer than {MAX_AGENT_ID_CHARS} characters")
        if not agent.isprintable():  # also the bytes aiohttp could not decode, which no log or record can carry
            raise ApiError("invalid_request", f"{AGENT_HEADER} must be printable text")
        kind = request.headers.get(CALL_HEADER, "").strip().lower()
        if kind and kind not in CALL_KINDS:
            raise ApiError("invalid_request", f"{CALL_HEADER} must be one of {CALL_KINDS}, got {kind!r}")
        return agent, kind

    async def _read_json(self, request: web.Request, session: ExecutionSession) -> Any:
        """The body, decoded within the bounds (see ProxyHttpConfig), from where it differs from the session's
        earlier bodies; ApiError otherwise."""
        config = self.config
        try:
            async with asyncio.timeout(config.body_read_timeout_s):
                raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise ApiError("too_large", f"the request body exceeds {config.max_body_bytes} bytes (max_body_bytes)") from None
        except TimeoutError:
            raise ApiError(
                "timeout", f"the request body did not arrive within {config.body_read_timeout_s} s (body_read_timeout_s)"
            ) from None
        return self.bodies.loads(raw, session.execution_id)

    # -- answers -------------------------------------------------------------------------------------------------

    def _count(self, answer: Answer, request: web.Request) -> None:
        """Count a finished call and log its refusal or failure (one line, never a traceback)."""
        if answer.status < 400:
            self._completed += 1
            return
        if answer.status >= 500:
            self._failed += 1
        else:
            self._rejected += 1
        error = answer.error
        if answer.cause is not None:
            log.error("proxy_call_failed", path=request.path, error=answer.cause)
        elif error is not None:
            log.info("proxy_call_refused", path=request.path, kind=error.kind, reason=error.message)

    def _refuse(self, request: web.Request, api: ModuleType, error: ApiError, cause: str | None = None) -> web.Response:
        """A refusal from this layer, in the API's error shape."""
        answer = Answer(error.status, api.error_body(error), error=error, cause=cause)
        self._count(answer, request)
        response = web.json_response(answer.body, status=answer.status)
        if error.kind in ("too_large", "timeout"):
            response.force_close()  # the rest of the body is not worth reading: close instead
        return response

    def _enter(self) -> None:
        if self._in_flight >= self.config.max_in_flight:
            raise ApiError("overloaded", f"{self._in_flight} calls are in flight; retry later")
        self._in_flight += 1
        self._in_flight_peak = max(self._in_flight_peak, self._in_flight)

    # -- handlers ------------------------------------------------------------------------------------------------

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._model_call(request, openai_api)

    async def messages(self, request: web.Request) -> web.StreamResponse:
        return await self._model_call(request, anthropic_api)

    async def _model_call(self, request: web.Request, api: ModuleType) -> web.StreamResponse:
        """One model call: bounds and key here, then the API module's `answer` (see the module doc)."""
        started_s = self.clock()
        try:
            session = self._authenticate(request)
            agent_id, call_kind = self._labels(request)
            self._enter()
        except ApiError as error:
            return self._refuse(request, api, error)
        try:
            body = await self._read_json(request, session)
            context = CallContext(session, agent_id, call_kind, started_s)
            return await self._respond(request, api.answer(body, context, self.runner, self.json_limits))
        except ApiError as error:
            return self._refuse(request, api, error)
        except ConnectionResetError:  # ClientGone, or aiohttp's own reset while writing
            self._disconnected += 1
            log.info("proxy_client_gone", path=request.path)
            raise
        except Exception as error:  # this layer's own failure: the API modules answer for theirs
            refusal = ApiError("server", f"internal error: {type(error).__name__}")
            return self._refuse(request, api, refusal, short_error(error))
        finally:
            self._in_flight -= 1
            if (request.content_length or 0) > TRIM_AFTER_BODY_BYTES:
                _release_freed_memory()

    async def _respond(self, request: web.Request, answer: Any) -> web.StreamResponse:
        """Send what the API module's `answer` yields: an Answer alone as JSON; stream bytes as server-sent events,
        the 200 header with the first of them, the connection looked at on every chunk."""
        response: web.StreamResponse | None = None
        async with aclosing(answer):  # leaving early closes the call's stream, which aborts its generation
            async for item in answer:
                if isinstance(item, Answer):  # how the call ended
                    self._count(item, request)
                    if response is None:
                        return web.json_response(item.body, status=item.status)
                    break
                if _client_gone(request):
                    raise ClientGone("the client closed the stream")
                if not item:
                    continue
                if response is None:
                    response = web.StreamResponse(
                        status=200, headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
                    )
                    await response.prepare(request)
                await response.write(item)
        assert response is not None, "an answer ends with an Answer"
        await response.write_eof()
        return response

    async def count_tokens(self, request: web.Request) -> web.StreamResponse:
        try:
            session = self._authenticate(request)
            body = await self._read_json(request, session)
            answer = await anthropic_api.count_tokens_answer(body, session, self.runner)
        except ApiError as error:
            return self._refuse(request, anthropic_api, error)
        except Exception as error:  # this layer's own failure (the API module answers for its own)
            refusal = ApiError("server", f"internal error: {type(error).__name__}")
            return self._refuse(request, anthropic_api, refusal, short_error(error))
        if answer.status >= 400:
            self._count(answer, request)
        return web.json_response(answer.body, status=answer.status)

    async def models(self, request: web.Request) -> web.StreamResponse:
        try:
            self._authenticate(request)
            created = int(self.clock())
            body = openai_api.models_body(self.config.model_names, created, self.config.owned_by)
            name = request.match_info.get("model")
            if name is None:
                return web.json_response(body)
            self.runner.check_model(name)
            return web.json_response(next(m for m in body["data"] if m["id"] == name))
        except ApiError as error:
            return self._refuse(request, openai_api, error)

    async def health(self, request: web.Request) -> web.StreamResponse:
        return web.json_response({"status": "ok"})


PROXY_SERVICE: web.AppKey[ProxyService] = web.AppKey("gyre_proxy_service", ProxyService)


def _route_api(path: str) -> ModuleType:
    return anthropic_api if path.startswith("/v1/messages") else openai_api


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
        return web.json_response(_route_api(request.path).error_body(api_error), status=error.status)


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

    async def close(_: web.Application) -> None:
        service.runner.close()

    app.on_cleanup.append(close)
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
            service = app.get(PROXY_SERVICE)
            options = runner_options(service.config) if service is not None else {}
            self._runner = web.AppRunner(app, access_log=None, **options)
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
