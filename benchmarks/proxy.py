"""`gyre bench proxy`: what the proxy costs per call, and how many sessions it holds at once.

Overhead is measured per call in the same run: the client times each HTTP call end to end (a raw aiohttp client,
so the SDKs' own cost is not charged to the proxy) and the backend times its own `generate`; the difference is
everything the proxy adds (HTTP both ways, auth, validation, rendering with id reuse, decoding, tool-call parsing,
the ModelCallCompleted emission). Each call continues a multi-turn conversation, so rendering and reuse are on the
measured path. The backend is either a zero-latency scripted one (the default: isolates the proxy) or the real
embedded engine on a tiny model (`--engine embedded`), in which case the direct engine latency is reported too.

Concurrency: `concurrent_sessions` executions each send one call at the same moment; the backend holds every call
until all of them are in flight (or a deadline passes), so they are provably open together; the result counts the
calls that completed with 200 and the peak number in flight.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import attrs
import structlog

from gyre.actors.serving.backends import BackendRequest, BackendResult, GenerateBackend
from gyre.actors.serving.http_app import PROXY_SERVICE, ProxyHttpConfig, build_proxy_app
from gyre.actors.serving.sessions import ProxySessions, ProxySessionsConfig

__all__ = ["ProxyBenchConfig", "ProxyBenchResult", "ScriptedBackend", "run_proxy_bench", "register"]


@attrs.frozen
class ProxyBenchConfig:
    calls: int = 300
    """Measured calls (after warm-up), sequential, in conversations of `turns_per_conversation` calls."""
    warmup_calls: int = 20
    turns_per_conversation: int = 8
    concurrent_sessions: int = 500
    """Executions that each hold one call open at the same time."""
    hold_timeout_s: float = 60.0
    """How long the concurrency backend waits for every call to arrive before releasing them anyway."""
    engine: str = "zero"
    """"zero" (scripted, zero latency) or "embedded" (the real in-process engine on a tiny model)."""
    max_new_tokens: int = 16


@attrs.frozen
class ProxyBenchResult:
    proxy_overhead_p50_ms: float
    proxy_overhead_p99_ms: float
    proxy_overhead_cpu_p50_ms: float
    """CPU time of the event-loop thread per call minus the backend's: unaffected by other processes on the
    machine; it includes the benchmark client's own HTTP work, so it is an upper bound."""
    proxy_overhead_cpu_p99_ms: float
    proxy_call_p50_ms: float
    """End-to-end latency of a call through the proxy."""
    backend_call_p50_ms: float
    """The backend's own time inside those calls."""
    direct_call_p50_ms: float
    """Latency of calling the backend directly with the same prompts, no proxy."""
    calls: int
    concurrent_sessions: int
    """Calls held open at once that completed with 200."""
    concurrent_sessions_requested: int
    concurrent_in_flight_peak: int
    engine: str


class ScriptedBackend:
    """A zero-latency backend: answers every call with the same ids (a short text and the turn's end token).

    The model server is the outer edge faked here; everything on the proxy's side of it is real.
    """

    def __init__(self, output_ids: tuple[int, ...], cell: str = "scripted") -> None:
        self.output_ids = output_ids
        self.cell = cell

    async def generate(self, request: BackendRequest) -> BackendResult:
        n = len(self.output_ids)
        return BackendResult(self.output_ids, (-1.0,) * n, (0,) * n, "stop", 0, self.cell)


class _TimedBackend:
    """Times the wrapped backend's generate per call, in wall time and in this thread's CPU time, so that
    overhead = call time - backend time (the CPU figure stays honest on a machine shared with other work)."""

    def __init__(self, inner: GenerateBackend) -> None:
        self.inner = inner
        self.last_s = 0.0
        self.last_cpu_s = 0.0

    async def generate(self, request: BackendRequest) -> BackendResult:
        start, start_cpu = time.perf_counter(), time.thread_time()
        try:
            return await self.inner.generate(request)
        finally:
            self.last_s = time.perf_counter() - start
            self.last_cpu_s = time.thread_time() - start_cpu


class _HoldingBackend:
    """Holds every call until `expected` calls are in flight (or the deadline passes), then answers them all."""

    def __init__(self, inner: GenerateBackend, expected: int, timeout_s: float) -> None:
        self.inner = inner
        self.expected = expected
        self.timeout_s = timeout_s
        self.arrived = 0
        self.all_arrived = asyncio.Event()

    async def generate(self, request: BackendRequest) -> BackendResult:
        self.arrived += 1
        if self.arrived >= self.expected:
            self.all_arrived.set()
        try:
            await asyncio.wait_for(self.all_arrived.wait(), self.timeout_s)
        except asyncio.TimeoutError:
            pass  # release anyway: the count of completed calls then shows how many were held
        return await self.inner.generate(request)


def _percentile_ms(values_s: list[float], q: float) -> float:
    ordered = sorted(values_s)
    index = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[index] * 1000.0


def _user_text(turn: int) -> str:
    return f"Step {turn}: list the files in the project, then read the file number {turn} and summarise it."


async def _serve(app: Any) -> tuple[Any, str]:
    from aiohttp import web

    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


async def _measure_overhead(
    config: ProxyBenchConfig, template: Any, backend: GenerateBackend
) -> tuple[list[float], list[float], list[float], list[float]]:
    import aiohttp

    timed = _TimedBackend(backend)
    sessions = ProxySessions(template, ProxySessionsConfig(max_executions=config.calls + config.warmup_calls + 8))
    emitted: list[Any] = []
    app = build_proxy_app(ProxyHttpConfig(), sessions, timed, emitted.append, clock=time.monotonic)
    runner, base_url = await _serve(app)
    call_s: list[float] = []
    backend_s: list[float] = []
    direct_s: list[float] = []
    cpu_overhead_s: list[float] = []
    try:
        async with aiohttp.ClientSession() as client:
            key = ""
            messages: list[dict[str, Any]] = []
            for i in range(config.warmup_calls + config.calls):
                turn = i % config.turns_per_conversation
                if turn == 0:
                    key = sessions.issue_key(f"bench-{i}", "bench")
                    messages = [{"role": "system", "content": "You are a careful coding agent."}]
                messages.append({"role": "user", "content": _user_text(turn)})
                body = {"model": "gyre", "messages": messages, "max_tokens": config.max_new_tokens, "temperature": 1.0}
                start, start_cpu = time.perf_counter(), time.thread_time()
                async with client.post(
                    base_url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}
                ) as response:
                    answer = await response.json()
                elapsed, elapsed_cpu = time.perf_counter() - start, time.thread_time() - start_cpu
                if response.status != 200:
                    raise RuntimeError(f"bench call failed: {response.status} {answer}")
                messages.append({"role": "assistant", "content": answer["choices"][0]["message"]["content"]})
                if i >= config.warmup_calls:
                    call_s.append(elapsed)
                    backend_s.append(timed.last_s)
                    cpu_overhead_s.append(elapsed_cpu - timed.last_cpu_s)
                    # The same generation, straight to the backend (same prompt ids and params as the proxy used).
                    sent = emitted[-1]
                    request = BackendRequest(
                        rid=f"direct-{i}",
                        execution_id="direct",
                        session_key="direct",
                        prompt_ids=sent.prompt_ids,
                        sampling_params={"max_new_tokens": config.max_new_tokens, "temperature": 1.0, "top_p": 1.0,
                                         "stop_token_ids": list(template.stop_token_ids)},
                    )
                    start = time.perf_counter()
                    await backend.generate(request)
                    direct_s.append(time.perf_counter() - start)
    finally:
        await runner.cleanup()
    return call_s, backend_s, direct_s, cpu_overhead_s


async def _measure_concurrency(config: ProxyBenchConfig, template: Any, backend: GenerateBackend) -> tuple[int, int]:
    import aiohttp

    holding = _HoldingBackend(backend, config.concurrent_sessions, config.hold_timeout_s)
    sessions = ProxySessions(template, ProxySessionsConfig(max_executions=config.concurrent_sessions + 8))
    app = build_proxy_app(
        ProxyHttpConfig(max_in_flight=config.concurrent_sessions + 8), sessions, holding, lambda m: None,
        clock=time.monotonic,
    )
    service = app[PROXY_SERVICE]
    runner, base_url = await _serve(app)
    keys = [sessions.issue_key(f"concurrent-{i}", "bench") for i in range(config.concurrent_sessions)]

    async def one(client: Any, key: str, i: int) -> bool:
        body = {"model": "gyre", "messages": [{"role": "user", "content": _user_text(i)}],
                "max_tokens": config.max_new_tokens}
        async with client.post(
            base_url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}
        ) as response:
            await response.read()
            return response.status == 200

    try:
        connector = aiohttp.TCPConnector(limit=0)
        timeout = aiohttp.ClientTimeout(total=config.hold_timeout_s + 600)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as client:
            results = await asyncio.gather(
                *(one(client, key, i) for i, key in enumerate(keys)), return_exceptions=True
            )
    finally:
        await runner.cleanup()
    completed = sum(1 for r in results if r is True)
    return completed, service.statistics().in_flight_peak


def _build_backend(
    config: ProxyBenchConfig, model_dir: Path, template: Any
) -> tuple[GenerateBackend, Callable[[], Any]]:
    if config.engine == "zero":
        text_ids = template.encode("The project has three files; file one defines the command line.")
        return ScriptedBackend(tuple(text_ids) + (template.stop_token_ids[0],)), lambda: None
    if config.engine == "embedded":
        from gyre.actors.serving.backends import EmbeddedBackend
        from gyre.engines.async_engine import AsyncEngine
        from gyre.engines.embedded_engine import EmbeddedEngine, EngineConfig

        engine = AsyncEngine(EmbeddedEngine(model_dir, EngineConfig(num_threads=1)))
        return EmbeddedBackend(engine, cell="embedded"), getattr(engine, "close", lambda: None)
    raise ValueError(f"engine must be 'zero' or 'embedded', got {config.engine!r}")


async def _run(config: ProxyBenchConfig, model_dir: Path) -> ProxyBenchResult:
    from gyre.engines.chat_template import ChatTemplate

    template = ChatTemplate.from_model_dir(model_dir)
    backend, close = _build_backend(config, model_dir, template)
    try:
        call_s, backend_s, direct_s, cpu_overhead_s = await _measure_overhead(config, template, backend)
        completed, peak = await _measure_concurrency(config, template, backend)
    finally:
        closing = close()
        if asyncio.iscoroutine(closing):
            await closing
    overhead_s = [c - b for c, b in zip(call_s, backend_s)]
    return ProxyBenchResult(
        proxy_overhead_p50_ms=_percentile_ms(overhead_s, 0.50),
        proxy_overhead_p99_ms=_percentile_ms(overhead_s, 0.99),
        proxy_overhead_cpu_p50_ms=_percentile_ms(cpu_overhead_s, 0.50),
        proxy_overhead_cpu_p99_ms=_percentile_ms(cpu_overhead_s, 0.99),
        proxy_call_p50_ms=_percentile_ms(call_s, 0.50),
        backend_call_p50_ms=_percentile_ms(backend_s, 0.50),
        direct_call_p50_ms=_percentile_ms(direct_s, 0.50),
        calls=len(call_s),
        concurrent_sessions=completed,
        concurrent_sessions_requested=config.concurrent_sessions,
        concurrent_in_flight_peak=peak,
        engine=config.engine,
    )


def run_proxy_bench(
    config: ProxyBenchConfig = ProxyBenchConfig(), model_dir: str | Path | None = None
) -> ProxyBenchResult:
    """Measure proxy overhead and concurrency; builds a tiny model directory when `model_dir` is None."""
    if model_dir is not None:
        return asyncio.run(_run(config, Path(model_dir)))
    from gyre.engines.model_format import init_model_dir

    with tempfile.TemporaryDirectory(prefix="gyre-proxy-bench-") as tmp:
        return asyncio.run(_run(config, init_model_dir(Path(tmp) / "model", "tiny", seed=0)))


def _handle(args: argparse.Namespace) -> int:
    # Keep stdout for the result (structlog prints to stdout by default) and the per-key lines out of the way.
    structlog.configure(
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING),
    )
    config = ProxyBenchConfig(
        calls=args.calls, concurrent_sessions=args.sessions, engine=args.engine, max_new_tokens=args.max_new_tokens
    )
    result = run_proxy_bench(config, args.model_dir)
    if args.json:
        print(json.dumps(attrs.asdict(result), indent=2))
    else:
        for name, value in attrs.asdict(result).items():
            print(f"{name:32s} {value:.3f}" if isinstance(value, float) else f"{name:32s} {value}")
    return 0


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("proxy", help="per-call proxy overhead (p50/p99) and concurrent sessions held")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--calls", type=int, default=300, help="measured calls (default 300)")
    p.add_argument("--sessions", type=int, default=500, help="concurrent sessions to hold (default 500)")
    p.add_argument("--engine", choices=("zero", "embedded"), default="zero",
                   help="zero-latency scripted backend (default) or the real embedded engine")
    p.add_argument("--model-dir", default=None, help="model directory (default: a fresh tiny model)")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.set_defaults(func=_handle)
