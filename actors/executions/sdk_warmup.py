"""Warm-ups for the agents' SDK clients, run once in the warm launcher's server before it forks any agent.

Why: importing `openai` is not the whole cost. A client's first request imports ~140 more modules (the chat
resources, the HTTP stack, the JSON parser), about 0.13 CPU-s, and its first response builds the pydantic schemas of
the reply types (`ChatCompletion` and what it nests: the SDK defers them to first use); every forked agent would pay
both again. Left to each agent, the schemas alone raised a short run from 48.4 to 68.8 CPU-ms (agent_warmup_cost.py in
benchmarks/; BENCHMARKS.md, session 17). Each warm-up here builds a client and makes one call, with a tool, to a
one-shot server on loopback that answers with a canned reply carrying a tool call, so every import and schema on
the request and response paths is built in the server and no byte leaves the machine. Use as preload entries:
`gyre.actors.executions.sdk_warmup:openai_client`.

A warm-up leaves no thread or socket behind: its one-shot server's thread is joined before it returns (the server
forks afterwards; see warm_launcher_server).
"""

from __future__ import annotations

import json
import socket
import threading
from contextlib import contextmanager
from typing import Any, Iterator

WARMUP_TIMEOUT_S = 5.0
"""Bound on the warm-up call and on its server's wait for it (both are immediate on a sane host)."""


def _read_request(connection: socket.socket) -> bool:
    """Read one HTTP request (head and Content-Length body); False when the peer closed early."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = connection.recv(65536)
        if not chunk:
            return False
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value.strip())
    while len(body) < length:
        chunk = connection.recv(65536)
        if not chunk:
            return False
        body += chunk
    return True


def _answer_once(listener: socket.socket, reply: bytes) -> None:
    try:
        connection, _ = listener.accept()
    except OSError:  # closed by _answering_url: the call never came
        return
    with connection:
        connection.settimeout(WARMUP_TIMEOUT_S)
        try:
            if _read_request(connection):
                connection.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                                   b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(reply) + reply)
        except (OSError, ValueError):  # the client went away, or sent a Content-Length that is not a number
            pass


@contextmanager
def _answering_url(reply: dict[str, Any]) -> Iterator[str]:
    """A base URL on loopback whose first connection gets `reply` as a JSON 200 response; on exit the listening
    socket is closed and the serving thread joined."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(WARMUP_TIMEOUT_S)
    server = threading.Thread(target=_answer_once, args=(listener, json.dumps(reply).encode()),
                              name="sdk-warmup-server", daemon=True)
    server.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        listener.close()
        server.join(WARMUP_TIMEOUT_S)


_TOOL = {"type": "function", "function": {"name": "noop", "description": "warm-up",
                                          "parameters": {"type": "object", "properties": {}}}}
_CHAT_COMPLETION = {
    "id": "warm-up", "object": "chat.completion", "created": 0, "model": "warm-up",
    "choices": [{"index": 0, "finish_reason": "tool_calls", "logprobs": None, "message": {
        "role": "assistant", "content": None,
        "tool_calls": [{"id": "call-0", "type": "function", "function": {"name": "noop", "arguments": "{}"}}]}}],
    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
}
"""What an OpenAI-compatible server answers to a chat call with tools: one tool call."""
_MESSAGE = {
    "id": "warm-up", "type": "message", "role": "assistant", "model": "warm-up", "stop_reason": "tool_use",
    "stop_sequence": None, "content": [{"type": "tool_use", "id": "toolu-0", "name": "noop", "input": {}}],
    "usage": {"input_tokens": 1, "output_tokens": 1},
}
"""What an Anthropic-compatible server answers to a messages call with tools: one tool_use block."""


_CONVERSATION = [
    {"role": "system", "content": "warm-up"},
    {"role": "user", "content": "hi"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call-0", "type": "function", "function": {"name": "noop", "arguments": "{}"}}]},
    {"role": "tool", "tool_call_id": "call-0", "content": "done"},
]
"""A conversation with every kind of message an agent's later calls carry: the SDK walks each message's type to
transform the request and caches what it learns per type (typing.get_type_hints of each TypedDict), so an agent
forked after this call finds every type it sends known already: an agent's first transform of such a conversation
took 1.9 CPU-ms instead of 2.6 (median of 40 forks; BENCHMARKS.md, session 26)."""


def openai_client() -> None:
    """One chat-completions call through a fresh `openai.OpenAI` client, as agents make them (a conversation of every
    message kind, a tool, sampling parameters and extra headers), answered with a tool call."""
    import openai

    with _answering_url(_CHAT_COMPLETION) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="warm-up", max_retries=0, timeout=WARMUP_TIMEOUT_S)
        try:
            client.chat.completions.create(model="warm-up", messages=_CONVERSATION, tools=[_TOOL], temperature=1.0,
                                           max_tokens=1, extra_headers={"X-Warm-Up": "1"})
        except openai.OpenAIError:  # a host that routes loopback through a proxy: less warmed, not broken
            pass
        finally:
            client.close()


def anthropic_client() -> None:
    """One messages call (with a tool) through a fresh `anthropic.Anthropic` client, answered with a tool_use."""
    import anthropic

    with _answering_url(_MESSAGE) as url:
        client = anthropic.Anthropic(base_url=url, api_key="warm-up", max_retries=0, timeout=WARMUP_TIMEOUT_S)
        try:
            client.messages.create(model="warm-up", max_tokens=1, messages=[{"role": "user", "content": "hi"}],
                                   tools=[{"name": "noop", "description": "warm-up",
                                           "input_schema": {"type": "object", "properties": {}}}])
        except anthropic.AnthropicError:  # see openai_client
            pass
        finally:
            client.close()
