"""The path of a model call through the serving files, traced: each stage file is entered once, and nothing calls
up into a file above it (the package doc of gyre.actors.serving writes the path out).

Everything is real: the proxy application over a `RoutedBackend`, an `SGLangClient` and an engine server with the
embedded engine on the tiny model, in one process. A profile hook on the server's thread records every new Python
frame and the frame that called it; an edge is (caller's file, callee's file) between two different serving files.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path
from typing import Any, Iterator

import aiohttp
import anthropic
import openai
import pytest

from gyre.actors.serving.http_app import ProxyHttpConfig, ServedApp, build_proxy_app
from gyre.actors.serving.routing import RoutedBackend, RoutingConfig
from gyre.actors.serving.sessions import ProxySessions
from gyre.engines.async_engine import AsyncEngine
from gyre.engines.chat_template import ChatTemplate
from gyre.engines.embedded_engine import EmbeddedEngine, EngineConfig
from gyre.engines.sglang_client import SGLangClient
from gyre.messages.cells import ROLLOUT, RoleChanged
from gyre.messages.model_calls import ModelCallCompleted

SERVING = Path(__file__).resolve().parents[4] / "actors" / "serving"
CLIENT = Path(__file__).resolve().parents[4] / "engines" / "sglang_client.py"
STAGES = ["http_app", "api", "sessions", "routing", "backends", "sglang_client"]
"""The stages, top to bottom."""


def stage_of(filename: str) -> str | None:
    path = Path(filename)
    if path == CLIENT:
        return "sglang_client"
    if path.parent != SERVING:
        return None
    name = path.stem
    return "api" if name in ("openai_api", "anthropic_api") else name  # _api_common, streaming: leaves


class PathTrace:
    """New frames in serving files and who called them, recorded by a profile hook on one thread."""

    def __init__(self) -> None:
        self.seen: dict[int, Any] = {}  # id -> frame; the frames are kept alive so that no id is reused
        self.edges: Counter[tuple[str, str, str]] = Counter()
        """(caller stage, callee stage, callee function) -> new frames."""

    def hook(self, frame: Any, event: str, arg: Any) -> None:
        if event != "call" or id(frame) in self.seen:
            return  # a coroutine or generator resumed is the same frame, not a new entry
        self.seen[id(frame)] = frame
        callee = stage_of(frame.f_code.co_filename)
        if callee is None or frame.f_back is None:
            return
        caller = stage_of(frame.f_back.f_code.co_filename)
        if caller is not None and caller != callee:
            self.edges[(caller, callee, frame.f_code.co_name)] += 1

    def upward(self) -> list[tuple[str, str, str]]:
        """Edges from a stage to one above it, and from a leaf helper back into a stage."""
        out = []
        for caller, callee, name in self.edges:
            if caller in STAGES and callee in STAGES and STAGES.index(callee) < STAGES.index(caller):
                out.append((caller, callee, name))
            elif caller not in STAGES and callee in STAGES:
                out.append((caller, callee, name))
        return out

    def entries(self) -> dict[tuple[str, str], int]:
        """New frames along each step of the chain (stage i -> stage i + 1)."""
        chain = set(zip(STAGES, STAGES[1:]))
        counts: Counter[tuple[str, str]] = Counter()
        for (caller, callee, _), count in self.edges.items():
            if (caller, callee) in chain:
                counts[(caller, callee)] += count
        return dict(counts)

    def skips(self) -> set[tuple[str, str, str]]:
        """Edges that jump over a stage."""
        return {
            (caller, callee, name) for caller, callee, name in self.edges
            if caller in STAGES and callee in STAGES and STAGES.index(callee) > STAGES.index(caller) + 1
        }


class Served:
    def __init__(self, model_dir: Path) -> None:
        self.calls: list[ModelCallCompleted] = []
        template = ChatTemplate.from_model_dir(model_dir)
        self.sessions = ProxySessions(template)
        self.trace: PathTrace | None = None

        async def make_app() -> Any:
            from aiohttp import web

            from gyre.engines.engine_server import build_engine_app

            engine = AsyncEngine(EmbeddedEngine(model_dir, EngineConfig(num_blocks=64, max_context_tokens=512,
                                                                        num_threads=1)))
            runner = web.AppRunner(build_engine_app(engine))
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", 0).start()
            http = aiohttp.ClientSession()
            backend = RoutedBackend(RoutingConfig(), lambda url: SGLangClient(url, session=http))
            url = f"http://127.0.0.1:{runner.addresses[0][1]}"
            backend.role_changed(RoleChanged("cell-a", ROLLOUT, "", url, 0, 0.0, 0, False))
            app = build_proxy_app(ProxyHttpConfig(max_context_tokens=512), self.sessions, backend,
                                  self.calls.append, clock=lambda: 0.0)

            async def close(_: Any) -> None:
                await backend.close()
                await http.close()
                await runner.cleanup()
                await engine.close()

            app.on_cleanup.append(close)
            return app

        self.served = ServedApp(make_app)

    def key(self, name: str) -> str:
        async def issue() -> str:
            return self.sessions.issue_key(name, "group")

        return self.served.call(issue())

    def traced(self, call: Any) -> PathTrace:
        trace = PathTrace()

        async def start() -> None:
            sys.setprofile(trace.hook)  # the server's thread: the one running its event loop

        async def stop() -> None:
            sys.setprofile(None)

        self.served.call(start())
        try:
            call()
        finally:
            self.served.call(stop())
        return trace


@pytest.fixture(scope="module")
def served(tiny_model_dir: Path) -> Iterator[Served]:
    served = Served(tiny_model_dir)
    with served.served:
        yield served


CHAIN = {(a, b): 1 for a, b in zip(STAGES, STAGES[1:])}
AUTHENTICATE = {("http_app", "sessions", "authenticate")}
"""The one call that skips a stage: http_app looks the key up in the sessions' table before reading the body."""


def test_a_call_enters_each_file_once_and_nothing_calls_up(served: Served) -> None:
    client = openai.OpenAI(base_url=served.served.base_url + "/v1", api_key=served.key("path-openai"), max_retries=0)
    trace = served.traced(lambda: client.chat.completions.create(
        model="gyre", messages=[{"role": "user", "content": "hi"}], max_tokens=4))
    assert len(served.calls) == 1
    assert trace.entries() == CHAIN
    assert trace.upward() == []
    assert trace.skips() == AUTHENTICATE


def test_an_anthropic_call_takes_the_same_path(served: Served) -> None:
    client = anthropic.Anthropic(base_url=served.served.base_url, api_key=served.key("path-anthropic"), max_retries=0)
    trace = served.traced(lambda: client.messages.create(
        model="gyre", messages=[{"role": "user", "content": "hi"}], max_tokens=4))
    assert trace.entries() == CHAIN
    assert trace.upward() == []
    assert trace.skips() == AUTHENTICATE


def test_a_streamed_call_goes_down_once_and_only_the_channel_is_called_from_below(served: Served) -> None:
    client = openai.OpenAI(base_url=served.served.base_url + "/v1", api_key=served.key("path-stream"), max_retries=0)
    trace = served.traced(lambda: list(client.chat.completions.create(
        model="gyre", messages=[{"role": "user", "content": "hi"}], max_tokens=6, stream=True)))
    assert trace.entries() == CHAIN  # the generation runs as a task of its own, but its frames are the session's
    tokens = len(served.calls[-1].output_ids)
    # Up from the generation side: only the channel's put, once per output chunk (the engine streams per token).
    assert set(trace.upward()) == {("backends", "sessions", "put")}
    assert 1 <= trace.edges[("backends", "sessions", "put")] <= tokens
    assert trace.skips() == AUTHENTICATE
