"""The SDK warm-ups: each makes one call to a one-shot server on loopback, builds the reply types' schemas, returns
quietly, and leaves no thread behind (the warm launcher forks right after them)."""

from __future__ import annotations

import subprocess
import sys

import pytest

WARMUPS = ("openai_client", "anthropic_client")


@pytest.mark.parametrize("name", WARMUPS)
def test_a_warm_up_builds_the_request_and_reply_paths_and_leaves_no_thread(name: str) -> None:
    # A fresh interpreter: in this one the SDKs' modules may already be imported by other tests.
    code = f"""
import sys, threading
from gyre.actors.executions import sdk_warmup
sdk = "openai" if "{name}".startswith("openai") else "anthropic"
resource = {{"openai": "openai.resources.chat.completions", "anthropic": "anthropic.resources.messages"}}[sdk]
if sdk == "openai":
    from openai.types.chat import ChatCompletion as Reply
else:
    from anthropic.types import Message as Reply
assert not Reply.__pydantic_complete__  # the SDKs defer building a reply type's schema to its first use
sdk_warmup.{name}()
assert resource in sys.modules, sorted(m for m in sys.modules if m.startswith(sdk + ".resources"))
assert Reply.__pydantic_complete__, "the warm-up's reply was not parsed"
assert threading.active_count() == 1, threading.enumerate()
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


def test_the_openai_warm_up_teaches_the_sdk_every_message_kind_an_agent_sends() -> None:
    # The SDK caches each TypedDict's type hints as it transforms a request; after the warm-up, an agent's
    # conversation (system, user, assistant with a tool call, tool result; tools and sampling parameters) finds
    # every one of them cached, so a forked agent computes none.
    code = """
from gyre.actors.executions import sdk_warmup
sdk_warmup.openai_client()
from openai._utils._transform import get_type_hints, maybe_transform
from openai.types.chat import completion_create_params
conversation = [
    {"role": "system", "content": "s"}, {"role": "user", "content": "u"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
    {"role": "tool", "tool_call_id": "c", "content": "o"},
]
tools = [{"type": "function", "function": {"name": "f", "description": "d", "parameters": {"type": "object"}}}]
misses = get_type_hints.cache_info().misses
maybe_transform({"messages": conversation, "model": "m", "tools": tools, "temperature": 0.7, "max_tokens": 5},
                completion_create_params.CompletionCreateParamsNonStreaming)
print(get_type_hints.cache_info().misses - misses)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "0"
