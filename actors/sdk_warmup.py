"""Warm-ups for the agents' SDK clients, run once in the warm launcher's server before it forks any agent.

Why: importing `openai` is not the whole cost. The first request of a client imports ~140 more modules (the chat
resources, the HTTP stack, the JSON parser), about 0.13 CPU-s, which every forked agent would pay again: more than
the ~0.05 CPU-s a short agent's model calls cost once they are warm. Each warm-up here builds a client and sends one
request to a local port that refuses the connection, so every import on the request path happens in the server and
no byte leaves the machine. Use as preload entries: `gyre.actors.sdk_warmup:openai_client`.

A warm-up starts no thread and leaves no socket open (the server forks afterwards; see warm_launcher_server).
"""

from __future__ import annotations

import socket
from contextlib import contextmanager
from typing import Iterator

WARMUP_TIMEOUT_S = 5.0
"""Bound on the refused request (a refusal is immediate; the bound only matters on a misconfigured host)."""


@contextmanager
def _refusing_url() -> Iterator[str]:
    """A base URL whose port is bound but not listening, so a connection to it is refused at once."""
    holder = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        holder.bind(("127.0.0.1", 0))
        yield f"http://127.0.0.1:{holder.getsockname()[1]}"
    finally:
        holder.close()


_TOOL = {"type": "function", "function": {"name": "noop", "description": "warm-up",
                                          "parameters": {"type": "object", "properties": {}}}}


def openai_client() -> None:
    """One refused chat-completions call (with a tool, as agents send) through a fresh `openai.OpenAI` client."""
    import openai

    with _refusing_url() as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="warm-up", max_retries=0, timeout=WARMUP_TIMEOUT_S)
        try:
            client.chat.completions.create(model="warm-up", messages=[{"role": "user", "content": "hi"}],
                                           tools=[_TOOL])
        except openai.APIConnectionError:
            pass
        finally:
            client.close()


def anthropic_client() -> None:
    """One refused messages call (with a tool) through a fresh `anthropic.Anthropic` client."""
    import anthropic

    with _refusing_url() as url:
        client = anthropic.Anthropic(base_url=url, api_key="warm-up", max_retries=0, timeout=WARMUP_TIMEOUT_S)
        try:
            client.messages.create(model="warm-up", max_tokens=1, messages=[{"role": "user", "content": "hi"}],
                                   tools=[{"name": "noop", "description": "warm-up",
                                           "input_schema": {"type": "object", "properties": {}}}])
        except anthropic.APIConnectionError:
            pass
        finally:
            client.close()
