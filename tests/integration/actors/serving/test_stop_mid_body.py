"""The proxy stopping while a call's body is still arriving (proxy.py's stop, the defined outcome): the connection is
closed without an answer (the SDKs retry such a call), the stop completes within its shutdown timeout, and nothing is
recorded for the call. The client is a raw socket, so the body can be cut exactly."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

from aiohttp import web

from gyre.actors.serving.backends import BackendRequest, BackendResult
from gyre.actors.serving.http_app import PROXY_SERVICE, ProxyHttpConfig, build_proxy_app, runner_options
from gyre.actors.serving.sessions import ProxySessions
from gyre.engines.chat_template import ChatTemplate


class AnswersAtOnce:
    """The engine, an outer edge: one fixed short answer (never reached in this test: the body never completes)."""

    def __init__(self, ids: tuple[int, ...]) -> None:
        self.ids = ids
        self.calls = 0

    async def generate(self, request: BackendRequest) -> BackendResult:
        self.calls += 1
        return BackendResult(self.ids, (-1.0,) * len(self.ids), (0,) * len(self.ids), "stop", 0, "engine")


async def stop_mid_body(model_dir: Path) -> tuple[bytes, list, int, int]:
    template = ChatTemplate.from_model_dir(model_dir)
    sessions = ProxySessions(template)
    key = sessions.issue_key("exec-1", "group-0")
    backend = AnswersAtOnce(tuple(template.encode("done")) + (template.stop_token_ids[0],))
    emitted: list = []
    config = ProxyHttpConfig()
    app = build_proxy_app(config, sessions, backend, emitted.append, clock=time.monotonic)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0, **runner_options(config))
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    port = runner.addresses[0][1]
    body = json.dumps({"model": "gyre", "messages": [{"role": "user", "content": "hello " * 200}],
                       "max_tokens": 4}).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {key}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(head + body[: len(body) // 2])
    await writer.drain()
    service = app[PROXY_SERVICE]
    while service.statistics().in_flight < 1:  # the proxy has the call; its body is half there
        await asyncio.sleep(0.01)
    stopping = asyncio.ensure_future(runner.cleanup())
    await asyncio.sleep(0.2)
    writer.write(body[len(body) // 2:])  # the rest arrives after the stop began: the server reads no more
    try:
        await writer.drain()
    except ConnectionError:
        pass
    try:
        answer = await asyncio.wait_for(reader.read(), 30)
    except ConnectionError:
        answer = b""
    await asyncio.wait_for(stopping, 30)
    writer.close()
    return answer, emitted, backend.calls, service.statistics().calls_completed


def test_a_call_whose_body_is_still_arriving_at_stop_ends_with_a_closed_connection(tiny_model_dir: Path) -> None:
    answer, emitted, engine_calls, completed = asyncio.run(stop_mid_body(tiny_model_dir))
    assert answer == b""  # closed, no answer: not a 200 with a made-up result, not a hang
    assert emitted == [] and engine_calls == 0 and completed == 0
