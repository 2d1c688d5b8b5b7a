"""The proxy's hardening findings, each reproduced over HTTP against the real application.

1. Tool `parameters` nested 500 levels deep (3 KB) made `_frozen_copy` recurse into RecursionError, logged with a
   rich traceback with locals: now a 400 naming the limit and one short log line.
2. The whole prompt was tokenised on the event loop before any length check: now bodies are capped per route, the
   prompt's characters are counted before tokenising, and a large render runs off the event loop (shown by
   /health answering while a render is held inside the tokenizer; no timed assertion).
3. A lone surrogate in content, a tool name or count_tokens (TypeError in the tokenizer) and JSON nested ~990 levels
   (RecursionError) were 500s: now 400s.
8. Slow clients: a connection that does not finish its request head, or its body, in time is closed / gets 408.

The engine is the outer edge: a scripted backend answers; the template, sessions and HTTP stack are real. The
template is observed (its `encode` records what it is asked and can hold a long text until released), not faked.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from typing import Any, Iterator

import aiohttp
import pytest

from gyre.actors.serving.backends import BackendRequest, BackendResult
from gyre.actors.serving.http_app import PROXY_SERVICE, ProxyHttpConfig, ServedApp, build_proxy_app
from gyre.actors.serving.sessions import ProxySessions
from gyre.engines.chat_template import ChatTemplate
from gyre.engines.tokenizer import write_tokenizer_files
from gyre.runtime.testing import capture_logs

HELD_CHARS = 60_000
"""Texts at least this long are held inside `encode` while the test's gate is closed."""


class ObservedTemplate(ChatTemplate):
    """The real template; `encode` records the length of every text and holds long ones while `gate` is closed."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.encoded_chars: list[int] = []
        self.gate = threading.Event()
        self.gate.set()
        self.holding = threading.Event()
        """Set while a long text waits at the gate."""
        self.threads: list[str] = []
        super().__init__(*args, **kwargs)

    def encode(self, text: str) -> list[int]:
        self.encoded_chars.append(len(text))
        if len(text) >= HELD_CHARS:
            self.threads.append(threading.current_thread().name)
            self.holding.set()
            assert self.gate.wait(120), "the test never released the gate"
            self.holding.clear()
        return super().encode(text)


class Scripted:
    """The engine's stand-in: "ok" and the turn's end."""

    def __init__(self, template: ChatTemplate) -> None:
        self.ids = tuple(template.encode("ok")) + (template.im_end_id,)

    async def generate(self, request: BackendRequest) -> BackendResult:
        n = len(self.ids)
        return BackendResult(self.ids, (-0.5,) * n, (0,) * n, "stop", 0, "scripted")


class Server:
    def __init__(self, template: ObservedTemplate, config: ProxyHttpConfig) -> None:
        self.template = template
        self.calls: list[Any] = []
        self.sessions = ProxySessions(template)
        self.served = ServedApp(lambda: build_proxy_app(config, self.sessions, Scripted(template), self.calls.append,
                                                        clock=lambda: 0.0))

    def key(self, name: str) -> str:
        async def issue() -> str:
            return self.sessions.issue_key(name, "group")

        return self.served.call(issue())

    def post(self, path: str, key: str, body: Any = None, data: bytes | None = None) -> tuple[int, Any]:
        async def send() -> tuple[int, Any]:
            async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {key}"}) as http:
                async with http.post(self.served.base_url + path, json=body, data=data) as response:
                    return response.status, await response.json(content_type=None)

        return asyncio.run(send())


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> ObservedTemplate:
    model_dir = tmp_path_factory.mktemp("tokenizer")
    write_tokenizer_files(model_dir)
    plain = ChatTemplate.from_model_dir(model_dir)
    return ObservedTemplate(plain.tokenizer, plain.source)


# Short read timeouts for the slow-client tests, long enough that a loaded machine does not close a real client.
CONFIG = ProxyHttpConfig(max_context_tokens=4096, header_read_timeout_s=2.0, body_read_timeout_s=1.0)


@pytest.fixture(scope="module")
def server(template: ObservedTemplate) -> Iterator[Server]:
    server = Server(template, CONFIG)
    with server.served:
        yield server


def nested_tool_body(levels: int) -> bytes:
    """A chat body whose one tool's `parameters` nest `levels` JSON objects deep (written as text: json.dumps would
    itself recurse that deep)."""
    opening, closing = '{"type": "object", "x": ' * levels, "}" * levels
    tool = '{"type": "function", "function": {"name": "f", "parameters": ' + opening + '"leaf"' + closing + "}}"
    return ('{"model": "gyre", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "tools": [' + tool
            + "]}").encode()


def chat_body(content: Any = "hi", tools: Any = None) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "gyre", "messages": [{"role": "user", "content": content}], "max_tokens": 4}
    if tools is not None:
        body["tools"] = tools
    return body


# -- 1: deeply nested tool parameters ------------------------------------------------------------------------------


def test_tool_parameters_nested_500_deep_get_400_naming_the_limit_and_one_short_log_line(server: Server) -> None:
    body = nested_tool_body(500)
    assert len(body) < 16_000
    with capture_logs() as logs:
        status, answer = server.post("/v1/chat/completions", server.key("nested"), data=body)
    assert status == 400, answer
    assert "max_json_depth" in answer["error"]["message"]
    lines = [entry for entry in logs if entry["event"].startswith("proxy_call")]
    assert [entry["event"] for entry in lines] == ["proxy_call_refused"]
    assert all("exc_info" not in entry for entry in logs)
    assert len(repr(lines[0])) < 600


def test_json_nested_990_levels_anywhere_gets_400(server: Server) -> None:
    key = server.key("deep-json")
    for levels in (990, 100_000):
        deep = b'{"model": "gyre", "messages": [{"role": "user", "content": "x"}], "metadata": ' + (
            b"[" * levels + b"]" * levels + b"}")
        status, answer = server.post("/v1/chat/completions", key, data=deep)
        assert status == 400 and "max_json_depth" in answer["error"]["message"], (levels, answer)
    arguments = "[" * 990 + "]" * 990
    body = {"model": "gyre", "max_tokens": 4, "messages": [
        {"role": "user", "content": "x"},
        {"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                              "function": {"name": "f", "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": "c", "content": "done"}]}
    status, answer = server.post("/v1/chat/completions", key, body)
    assert status == 400 and "max_json_depth" in answer["error"]["message"], answer
    assert server.calls == [] or all(c.execution_id != "deep-json" for c in server.calls)


# -- 3: lone surrogates --------------------------------------------------------------------------------------------


def test_lone_surrogates_get_400_not_500(server: Server) -> None:
    key = server.key("surrogates")
    in_content = b'{"model": "gyre", "max_tokens": 4, "messages": [{"role": "user", "content": "a\\ud800b"}]}'
    in_tool_name = (b'{"model": "gyre", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}], '
                    b'"tools": [{"type": "function", "function": {"name": "f\\udfff"}}]}')
    raw_bytes = '{"model": "gyre", "max_tokens": 4, "messages": [{"role": "user", "content": "\ud800"}]}'.encode(
        "utf-8", "surrogatepass")  # a surrogate encoded as UTF-8 bytes is not valid UTF-8
    for path, body in [("/v1/chat/completions", in_content), ("/v1/chat/completions", in_tool_name),
                       ("/v1/chat/completions", raw_bytes), ("/v1/messages/count_tokens", in_content),
                       ("/v1/messages", in_content)]:
        status, answer = server.post(path, key, data=body)
        assert status == 400, (path, body, answer)
    # A surrogate pair is one character (an emoji), not a lone surrogate: accepted.
    status, _ = server.post("/v1/chat/completions", key,
                            data=b'{"model": "gyre", "max_tokens": 4, "messages": [{"role": "user", '
                                 b'"content": "\\ud83d\\ude00"}]}')
    assert status == 200


def test_an_agent_label_that_is_not_text_gets_400(server: Server) -> None:
    key = server.key("label")
    body = json.dumps(chat_body()).encode()
    connection = _connect(server)
    connection.sendall(  # a header byte that is not UTF-8 (aiohttp hands it on as a lone surrogate)
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: proxy\r\nContent-Type: application/json\r\n"
        + f"Authorization: Bearer {key}\r\nContent-Length: {len(body)}\r\nConnection: close\r\n".encode()
        + b"X-Gyre-Agent: a\xffb\r\n\r\n" + body
    )
    answer = _read_all(connection)
    assert answer.startswith(b"HTTP/1.1 400"), answer[:300]
    assert b"X-Gyre-Agent must be printable text" in answer


# -- 2: long prompts -----------------------------------------------------------------------------------------------


def test_a_prompt_over_the_character_bound_is_refused_before_tokenising(server: Server) -> None:
    bound = CONFIG.max_context_tokens * CONFIG.max_prompt_chars_per_token
    server.template.encoded_chars.clear()
    status, answer = server.post("/v1/chat/completions", server.key("long-chars"), chat_body("x" * (bound + 1)))
    assert status == 400 and "max_prompt_chars_per_token" in answer["error"]["message"], answer
    assert answer["error"]["code"] == "context_length_exceeded"
    assert all(chars < bound for chars in server.template.encoded_chars)  # the long text was never tokenised


def test_a_body_over_the_route_bound_gets_413_without_being_parsed(template: ObservedTemplate) -> None:
    server = Server(template, ProxyHttpConfig())  # the defaults
    with server.served:
        template.encoded_chars.clear()
        huge = "y" * (10 * 2**20)
        status, answer = server.post("/v1/chat/completions", server.key("ten-mb"), chat_body(huge))
        assert status == 413, answer
        assert template.encoded_chars == []


def test_health_answers_while_a_large_prompt_is_being_tokenised(server: Server) -> None:
    key = server.key("large-render")
    template = server.template
    template.gate.clear()
    outcome: list[Any] = []
    call = threading.Thread(target=lambda: outcome.append(
        server.post("/v1/chat/completions", key, chat_body("z" * (HELD_CHARS + 10)))))
    call.start()
    try:
        assert template.holding.wait(60), "the render never reached the tokenizer"

        async def health() -> int:
            timeout = aiohttp.ClientTimeout(total=60)  # a bound against a hang, not a measurement
            async with aiohttp.ClientSession(timeout=timeout) as http:
                async with http.get(server.served.base_url + "/health") as response:
                    return response.status

        assert asyncio.run(health()) == 200  # answered while the render is held inside the tokenizer
        assert template.threads[-1] != "gyre-served-app"  # the render runs off the event loop's thread
    finally:
        template.gate.set()
        call.join(120)
    [(status, answer)] = outcome
    assert status == 400 and answer["error"]["code"] == "context_length_exceeded"  # 60K tokens > 4096


# -- 8: slow clients -----------------------------------------------------------------------------------------------


def _connect(server: Server) -> socket.socket:
    host, port = server.served.base_url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=60)  # the timeout bounds a hang, it measures nothing


def _read_all(connection: socket.socket) -> bytes:
    answer = b""
    while chunk := connection.recv(65536):
        answer += chunk
    connection.close()
    return answer


def test_connections_that_do_not_finish_their_headers_are_closed(server: Server) -> None:
    slow = [_connect(server) for _ in range(20)]
    for connection in slow:
        connection.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: proxy\r\n")  # and nothing more
    # The server closes every one of them (recv returns b""); the socket timeout bounds a hang, it measures nothing.
    for connection in slow:
        assert connection.recv(1024) == b""
        connection.close()


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages", "/v1/messages/count_tokens"])
def test_a_body_that_does_not_arrive_in_time_gets_408(server: Server, path: str) -> None:
    key = server.key(f"slow-body{path}")
    connection = _connect(server)
    connection.sendall(
        f"POST {path} HTTP/1.1\r\n".encode() + b"Host: proxy\r\nContent-Type: application/json\r\n"
        + f"Authorization: Bearer {key}\r\nContent-Length: 100000\r\n\r\n".encode() + b'{"model": "gyre"'
    )
    answer = _read_all(connection)
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    stats = server.served.app[PROXY_SERVICE].statistics()
    assert stats.in_flight == 0
