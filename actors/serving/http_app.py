"""The proxy's HTTP face: OpenAI and Anthropic chat APIs over token-in/token-out generation.

This layer is HTTP only: the routes, the bounds (bodies, calls in flight), the API key, the X-Gyre-* labels, and
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
from types import ModuleType
from typing import Any, Awaitable, Callable

import attrs
import structlog
from aiohttp import web

from gyre.actors.serving import anthropic_api, openai_api
from gyre.actors.serving._api_common import Answer
from gyre.actors.serving.backends import GenerateBackend
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

__all__ = [
    "ProxyHttpConfig",
    "HttpStatistics",
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
    """The HTTP face's behaviour and bounds."""

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
    """Calls being handled at once; more get 503 (which the SDKs retry with backoff)."""
    stream_buffer_chunks: int = 64
    """Output chunks a streamed call holds for a reader slower than the engine; beyond, the generation waits."""
    owned_by: str = "gyre"
    """The `owned_by` of GET /v1/models."""


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
            stream_buffer_chunks=config.stream_buffer_chunks,
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
        kind = request.headers.get(CALL_HEADER, "").strip().lower()
        if kind and kind not in CALL_KINDS:
            raise ApiError("invalid_request", f"{CALL_HEADER} must be one of {CALL_KINDS}, got {kind!r}")
        return agent, kind

    async def _read_json(self, request: web.Request) -> Any:
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise ApiError("too_large", f"the request body exceeds {self.config.max_body_bytes} bytes") from None
        try:
            return json.loads(raw)
        except (ValueError, UnicodeDecodeError) as error:
            raise ApiError("invalid_request", f"the request body is not valid JSON: {error}") from None

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
        return web.json_response(answer.body, status=answer.status)

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
            body = await self._read_json(request)
            context = CallContext(session, agent_id, call_kind, started_s)
            return await self._respond(request, api.answer(body, context, self.runner))
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
            body = await self._read_json(request)
        except ApiError as error:
            return self._refuse(request, anthropic_api, error)
        answer = await anthropic_api.count_tokens_answer(body, session, self.runner)
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
