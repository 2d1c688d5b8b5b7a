"""`gyre bench proxy`: what the proxy costs per call, and how many sessions it holds at once.

Overhead is measured per call in the same run: the client times each HTTP call end to end (a raw aiohttp client,
so the SDKs' own cost is not charged to the proxy) and the backend times its own `generate`; the difference is
everything the proxy adds (HTTP both ways, auth, validation, rendering with id reuse, decoding, tool-call parsing,
the ModelCallCompleted emission). Each call continues a multi-turn conversation, so rendering and reuse are on the
measured path. The backend is a zero-latency scripted one (the default: isolates the proxy), the real embedded
engine on a tiny model (`--engine embedded`), or an engine server over SGLang's HTTP API: one that runs already
(`--engine-url URL`, e.g. SGLang on a GPU node; MODEL_DIR must be its model) or Gyre's engine server, which the
bench starts as a child process on the model (`--engine server`). Then the backend's time is a whole /generate
round trip, so the overhead is what the proxy adds over calling /generate directly, and the direct latency (the
same prompt ids and sampling parameters sent straight to the engine) is reported too.

Concurrency: `concurrent_sessions` executions each send one call at the same moment; the backend holds every call
until all of them are in flight (or a deadline passes), so they are provably open together; the result counts the
calls that completed with 200 and the peak number in flight.

Hostile (`--hostile`, the Hardening issue's done-when): the proxy (default ProxyHttpConfig, scripted backend, the
model's real template) runs in a process of its own, so that its resident memory is its own. Rounds of bad requests
go at it at once: tool parameters nested 500 deep, 10 MB prompts, a 3 MB prompt (under the body bound, over the
character bound), a 300K-character prompt (within the character bound: tokenised on a worker thread, then too many
tokens), JSON nested 990 deep, a lone surrogate, connections that never finish their request head. Meanwhile
/health is asked every 20 ms. Reported: /health's latency at rest and under attack, each bad request's status,
and the server's RSS before, at its peak and after.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import secrets
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import attrs

from gyre.actors.serving.backends import BackendRequest, BackendResult, GenerateBackend
from gyre.actors.serving.http_app import PROXY_SERVICE, ProxyHttpConfig, build_proxy_app
from gyre.actors.serving.sessions import ProxySessions, ProxySessionsConfig

__all__ = [
    "ProxyBenchConfig",
    "ProxyBenchResult",
    "HostileBenchConfig",
    "HostileBenchResult",
    "ScriptedBackend",
    "run_proxy_bench",
    "run_hostile_bench",
    "register",
]


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
    """"zero" (scripted, zero latency), "embedded" (the real in-process engine on a tiny model), "server" (Gyre's
    engine server, started by the bench) or "url" (the server at `engine_url`)."""
    max_new_tokens: int = 16
    engine_url: str = ""
    """With engine "url": the server's base URL."""
    engine_api_key_file: str | None = None
    """With engine "url": the file holding the server's key (SGLang's --api-key); None: Gyre's run token."""


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
        self.last_prompt_ids: Any = ()

    async def generate(self, request: BackendRequest) -> BackendResult:
        self.last_prompt_ids = request.prompt_ids  # a reference: nothing copied inside the timed call
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
                    request = BackendRequest(
                        rid=f"direct-{i}",
                        execution_id="direct",
                        session_key="direct",
                        prompt_ids=timed.last_prompt_ids,
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
    if config.engine == "url":
        from gyre.actors.serving.backends import SGLangBackend
        from gyre.engines.sglang_client import ClientConfig, SGLangClient

        if not config.engine_url:
            raise ValueError("engine 'url' needs an engine_url")
        client = SGLangClient(config.engine_url, config=ClientConfig(api_key_file=config.engine_api_key_file))
        return SGLangBackend({"engine": client}), client.close
    raise ValueError(f"engine must be 'zero', 'embedded', 'server' or 'url', got {config.engine!r}")


class _EngineServerProcess:
    """Gyre's engine server on `model_dir` as a child process (engine "server"), checking the run's engine token
    (what the bench's client sends by default). `start` returns its URL once it answers /health."""

    STARTUP_TIMEOUT_S = 180.0  # importing torch and loading the tiny model takes seconds; a bound, not a figure

    def __init__(self, model_dir: Path) -> None:
        self.model_dir = model_dir
        self.process: Any = None

    async def start(self) -> str:
        import os
        import socket
        import subprocess
        import sys

        from gyre.engines.sglang_client import SGLangClient
        from gyre.runtime.run_secrets import run_token

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        argv = [sys.executable, "-m", "gyre.engines.engine_server", "--model-dir", str(self.model_dir),
                "--port", str(port), "--num-threads", "1"]
        env = dict(os.environ, GYRE_ENGINE_API_KEY=run_token("engine"))
        self.process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
        url = f"http://127.0.0.1:{port}"
        async with SGLangClient(url) as client:
            await client.wait_healthy(self.STARTUP_TIMEOUT_S)
        return url

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except Exception:
                self.process.kill()


async def _run(config: ProxyBenchConfig, model_dir: Path) -> ProxyBenchResult:
    from gyre.engines.chat_template import ChatTemplate

    template = ChatTemplate.from_model_dir(model_dir)
    server = None
    if config.engine == "server":
        server = _EngineServerProcess(model_dir)
        try:
            config = attrs.evolve(config, engine="url", engine_url=await server.start())
        except BaseException:
            server.stop()
            raise
    try:
        return await _run_on(config, model_dir, template)
    finally:
        if server is not None:
            server.stop()


async def _run_on(config: ProxyBenchConfig, model_dir: Path, template: Any) -> ProxyBenchResult:
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


@attrs.frozen
class HostileBenchConfig:
    rounds: int = 5
    """Rounds of bad requests; each round sends them all at once."""
    huge_prompts_per_round: int = 2
    """10 MB prompts per round (finding 2)."""
    nested_per_round: int = 4
    """Requests per round whose tool parameters nest 500 levels (finding 1)."""
    slow_connections: int = 50
    """Connections that send half a request head and wait (finding 8); the server closes them after
    `header_read_timeout_s`, so the attack lasts at least that long."""
    header_read_timeout_s: float = ProxyHttpConfig().header_read_timeout_s
    """The server's header_read_timeout_s (its default; the other bounds are always the defaults)."""
    health_interval_s: float = 0.02
    """How often /health is asked during the attack."""
    settle_s: float = 2.0
    """Wait after the attack before the last RSS reading."""


@attrs.frozen
class HostileBenchResult:
    health_p50_ms_at_rest: float
    health_p50_ms_under_attack: float
    health_p99_ms_under_attack: float
    health_max_ms_under_attack: float
    health_answers_under_attack: int
    """/health answers received while bad requests were in flight."""
    statuses: dict[str, list[int]]
    """Bad request kind -> the statuses it got (a 5xx is a finding)."""
    slow_connections_closed: int
    """Of the half-sent request heads, how many the server closed."""
    rss_start_mb: float
    """The server process's resident memory before the attack."""
    rss_peak_mb: float
    """The highest reading during the attack (sampled with /health)."""
    rss_after_mb: float
    """After the attack and `settle_s`."""
    rss_growth_mb: float
    """rss_after_mb - rss_start_mb."""
    attack_s: float
    """Wall time of the attack."""


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def _hostile_server(model_dir: str, api_key: str, header_read_timeout_s: float, pipe: Any) -> None:
    """The proxy as a server process: default HTTP config, the scripted backend; sends its port, serves until told."""
    from gyre.engines.chat_template import ChatTemplate
    from gyre.runtime.logs import configure_logging

    configure_logging("warning")

    async def serve() -> None:
        from aiohttp import web

        from gyre.actors.serving.http_app import runner_options

        template = ChatTemplate.from_model_dir(model_dir)
        backend = ScriptedBackend(tuple(template.encode("ok")) + (template.stop_token_ids[0],))
        sessions = ProxySessions(template)
        sessions.issue_key("hostile", "bench", api_key=api_key)
        config = ProxyHttpConfig(header_read_timeout_s=header_read_timeout_s)
        app = build_proxy_app(config, sessions, backend, lambda m: None, clock=time.monotonic)
        runner = web.AppRunner(app, access_log=None, **runner_options(config))
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        pipe.send(runner.addresses[0][1])
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, pipe.recv)  # until the bench says stop
        await runner.cleanup()

    asyncio.run(serve())


def _hostile_bodies() -> dict[str, bytes]:
    def chat(content: str) -> bytes:
        return json.dumps({"model": "gyre", "max_tokens": 4, "messages": [{"role": "user", "content": content}]}).encode()

    opening = '{"type": "object", "x": ' * 500
    nested_tool = ('{"model": "gyre", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "tools": '
                   '[{"type": "function", "function": {"name": "f", "parameters": ' + opening + '"leaf"' + "}" * 500
                   + "}}]}").encode()
    return {
        "nested_tool_parameters": nested_tool,
        "prompt_10mb": chat("w " * (5 * 2**20)),
        "prompt_3mb": chat("w " * (3 * 2**19)),
        "prompt_300k_chars": chat("word " * 60_000),
        "json_990_deep": b'{"model": "gyre", "messages": [], "x": ' + b"[" * 990 + b"]" * 990 + b"}",
        "lone_surrogate": b'{"model": "gyre", "max_tokens": 4, "messages": [{"role": "user", "content": "\\ud800"}]}',
    }


async def _attack(config: HostileBenchConfig, base_url: str, api_key: str, pid: int) -> HostileBenchResult:
    import aiohttp

    bodies = _hostile_bodies()
    timeout = aiohttp.ClientTimeout(total=600)
    health_rest: list[float] = []
    health_attack: list[float] = []
    rss_readings: list[float] = []
    statuses: dict[str, list[int]] = {name: [] for name in bodies}
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as http:

        async def health() -> float:
            start = time.perf_counter()
            async with http.get(base_url + "/health") as response:
                await response.read()
            return time.perf_counter() - start

        for _ in range(50):
            health_rest.append(await health())
            await asyncio.sleep(config.health_interval_s)
        rss_start = _rss_mb(pid)

        async def bad(name: str) -> None:
            headers = {"Authorization": f"Bearer {api_key}", "Content-Type": "application/json"}
            try:
                async with http.post(base_url + "/v1/chat/completions", data=bodies[name], headers=headers) as response:
                    await response.read()
                    statuses[name].append(response.status)
            except aiohttp.ClientError:
                statuses[name].append(0)  # the server closed the connection (413 with the body unread)

        async def slow_connection() -> bool:
            host, port = base_url.removeprefix("http://").split(":")
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: proxy\r\n")
            await writer.drain()
            closed = await reader.read(1) == b""
            writer.close()
            return closed

        async def rounds() -> None:
            names = (["nested_tool_parameters"] * config.nested_per_round + ["prompt_10mb"]
                     * config.huge_prompts_per_round + ["prompt_3mb", "prompt_300k_chars", "json_990_deep",
                                                        "lone_surrogate"])
            for _ in range(config.rounds):
                await asyncio.gather(*(bad(name) for name in names))

        started = time.perf_counter()
        slow = [asyncio.ensure_future(slow_connection()) for _ in range(config.slow_connections)]
        attack = asyncio.ensure_future(rounds())
        # /health throughout: while the rounds run and until the server has closed every half-sent head.
        while not attack.done() or not all(task.done() for task in slow):
            health_attack.append(await health())
            rss_readings.append(_rss_mb(pid))
            await asyncio.sleep(config.health_interval_s)
        await attack
        closed = sum(await asyncio.gather(*slow))
        attack_s = time.perf_counter() - started
        await asyncio.sleep(config.settle_s)
        rss_after = _rss_mb(pid)
    return HostileBenchResult(
        health_p50_ms_at_rest=_percentile_ms(health_rest, 0.5),
        health_p50_ms_under_attack=_percentile_ms(health_attack, 0.5),
        health_p99_ms_under_attack=_percentile_ms(health_attack, 0.99),
        health_max_ms_under_attack=max(health_attack) * 1000.0,
        health_answers_under_attack=len(health_attack),
        statuses=statuses,
        slow_connections_closed=closed,
        rss_start_mb=round(rss_start, 1),
        rss_peak_mb=round(max(rss_readings + [rss_after]), 1),
        rss_after_mb=round(rss_after, 1),
        rss_growth_mb=round(rss_after - rss_start, 1),
        attack_s=round(attack_s, 2),
    )


def run_hostile_bench(
    config: HostileBenchConfig = HostileBenchConfig(), model_dir: str | Path | None = None
) -> HostileBenchResult:
    """Bad requests against a proxy server process (see the module doc); builds a tiny model when `model_dir` is
    None."""
    if model_dir is None:
        from gyre.engines.model_format import init_model_dir

        with tempfile.TemporaryDirectory(prefix="gyre-proxy-bench-") as tmp:
            return run_hostile_bench(config, init_model_dir(Path(tmp) / "model", "tiny", seed=0))
    api_key = "bench-" + secrets.token_urlsafe(18)
    context = multiprocessing.get_context("spawn")
    ours, theirs = context.Pipe()
    server = context.Process(target=_hostile_server, args=(str(model_dir), api_key, config.header_read_timeout_s, theirs), daemon=True)
    server.start()
    try:
        if not ours.poll(300):
            raise RuntimeError("the proxy server did not start")
        port = ours.recv()
        return asyncio.run(_attack(config, f"http://127.0.0.1:{port}", api_key, server.pid))
    finally:
        ours.send("stop")
        server.join(30)
        if server.is_alive():
            server.kill()


def _handle(args: argparse.Namespace) -> int:
    from gyre.runtime.logs import configure_logging

    configure_logging("warning")  # logs go to stderr; stdout carries only the result
    result: Any
    if args.hostile:
        result = run_hostile_bench(HostileBenchConfig(rounds=args.rounds), args.model_dir)
    else:
        engine = "url" if args.engine_url else args.engine
        config = ProxyBenchConfig(
            calls=args.calls, concurrent_sessions=args.sessions, engine=engine, max_new_tokens=args.max_new_tokens,
            engine_url=args.engine_url or "", engine_api_key_file=args.engine_api_key_file,
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
    p.add_argument("--engine", choices=("zero", "embedded", "server"), default="zero",
                   help="zero-latency scripted backend (default), the real embedded engine, or Gyre's engine server "
                   "started as a child process and reached over HTTP")
    p.add_argument("--engine-url", default=None, metavar="URL",
                   help="an engine server that runs already (SGLang or Gyre's), reached over SGLang's HTTP API; "
                   "--model-dir must be its model")
    p.add_argument("--engine-api-key-file", default=None, metavar="PATH",
                   help="with --engine-url: the file holding the server's key")
    p.add_argument("--model-dir", default=None, help="model directory (default: a fresh tiny model)")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--hostile", action="store_true",
                   help="bad requests instead: /health latency and server memory under attack (see the module doc)")
    p.add_argument("--rounds", type=int, default=5, help="rounds of bad requests with --hostile (default 5)")
    p.set_defaults(func=_handle)
