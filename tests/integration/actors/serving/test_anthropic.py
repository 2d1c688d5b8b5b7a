"""The proxy's Anthropic face, driven by the real `anthropic` SDK over HTTP on 127.0.0.1.

As in test_proxy_openai.py: one server over the real embedded engine on a tiny random model (end to end), one over
a scripted model server (the outer edge, standing in for the engine) for tool_use and stop sequences; the scripted
ids are a character-level tokenisation, so re-tokenisation drift would show.
"""

from __future__ import annotations

import asyncio
import itertools
from pathlib import Path
from typing import Any, Iterator

import aiohttp
import anthropic
import pytest
import torch

from gyre.actors.serving.backends import BackendRequest, BackendResult, EmbeddedBackend
from gyre.actors.serving.http_app import ProxyHttpConfig, ServedApp, build_proxy_app
from gyre.actors.serving.sessions import ProxySessions
from gyre.engines.async_engine import AsyncEngine
from gyre.engines.chat_template import ChatTemplate
from gyre.engines.embedded_engine import EmbeddedEngine, EngineConfig
from gyre.engines.model_format import init_model_dir
from gyre.messages.model_calls import ModelCallCompleted
from gyre.policies.trajectory_tree import PromptRebuilder

MAX_CONTEXT_TOKENS = 1024
TOOLS = [
    {
        "name": "run",
        "description": "Run a shell command",
        "input_schema": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]},
    }
]


class ScriptedModel:
    """The model server's stand-in: the next scripted text as character-level token ids."""

    def __init__(self, template: ChatTemplate) -> None:
        self.template = template
        self.script: list[tuple[str, str]] = []
        self.requests: list[BackendRequest] = []

    def say(self, text: str, finish: str = "stop") -> None:
        self.script.append((text, finish))

    async def generate(self, request: BackendRequest) -> BackendResult:
        self.requests.append(request)
        text, finish = self.script.pop(0)
        ids = [i for ch in text for i in self.template.encode(ch)]
        if finish == "stop":
            ids.append(self.template.im_end_id)
        return BackendResult(
            output_ids=tuple(ids),
            output_logprobs=tuple(-0.5 for _ in ids),
            output_versions=tuple(1 for _ in ids),
            finish_reason="stop" if finish == "stop_string" else finish,
            cached_tokens=0,
            cell="scripted-cell",
            matched_stop="###" if finish == "stop_string" else None,
        )

    async def generate_streaming(self, request: BackendRequest, on_output: Any) -> BackendResult:
        """The same answer, passed on one token at a time (a streaming engine's per-step output)."""
        result = await self.generate(request)
        for token in result.output_ids:
            await on_output((token,))
        return result


class Proxy:
    def __init__(self, template: ChatTemplate, backend_factory: Any, config: ProxyHttpConfig) -> None:
        self.template = template
        self.calls: list[ModelCallCompleted] = []
        self.rebuilder = PromptRebuilder()
        self.sessions = ProxySessions(template)
        self.backend: Any = None
        ticks = itertools.count()

        def make_app() -> Any:
            self.backend = backend_factory()
            def clock() -> float:  # a deterministic runtime clock: 0, 1, 2, ...
                return float(next(ticks))

            return build_proxy_app(config, self.sessions, self.backend, self.take, clock=clock)

        self.served = ServedApp(make_app)

    def take(self, call: ModelCallCompleted) -> None:
        """The proxy's on_call_completed: keep the record, and its whole prompt rebuilt (`prompt_of`)."""
        self.rebuilder.add(call)
        _WHOLE_PROMPTS[id(call)] = self.rebuilder.prompt_ids(call)
        self.calls.append(call)

    def key(self, execution_id: str) -> str:
        async def issue() -> str:
            return self.sessions.issue_key(execution_id, "group")

        return self.served.call(issue())

    def client(self, key: str) -> anthropic.Anthropic:
        return anthropic.Anthropic(base_url=self.served.base_url, api_key=key, max_retries=0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model_dir(tmp_path_factory.mktemp("model") / "tiny", "tiny", seed=1)


@pytest.fixture(scope="module")
def template(model_dir: Path) -> ChatTemplate:
    return ChatTemplate.from_model_dir(model_dir)


@pytest.fixture(scope="module")
def real(model_dir: Path, template: ChatTemplate) -> Iterator[Proxy]:
    torch.set_num_threads(1)
    engine_config = EngineConfig(num_blocks=128, max_context_tokens=MAX_CONTEXT_TOKENS, num_threads=1)
    proxy = Proxy(
        template,
        lambda: EmbeddedBackend(AsyncEngine(EmbeddedEngine(model_dir, engine_config)), cell="cell-0"),
        ProxyHttpConfig(model_names=("tiny",), max_context_tokens=MAX_CONTEXT_TOKENS),
    )
    with proxy.served:
        yield proxy
        proxy.served.call(proxy.backend.engine.close())


@pytest.fixture(scope="module")
def scripted(template: ChatTemplate) -> Iterator[Proxy]:
    proxy = Proxy(template, lambda: ScriptedModel(template), ProxyHttpConfig(max_context_tokens=MAX_CONTEXT_TOKENS))
    with proxy.served:
        yield proxy


_WHOLE_PROMPTS: dict[int, tuple[int, ...]] = {}


def prompt_of(call: ModelCallCompleted) -> tuple[int, ...]:
    """The whole prompt of a record a proxy harness took (its records carry only the ids after a shared prefix)."""
    return _WHOLE_PROMPTS[id(call)]


def extends(later: ModelCallCompleted, earlier: ModelCallCompleted) -> bool:
    n = earlier.prompt_tokens + len(earlier.output_ids)
    return prompt_of(later)[:n] == prompt_of(earlier) + earlier.output_ids


# -- fully real, end to end ----------------------------------------------------------------------------------------


def test_real_engine_messages_multi_turn_and_stream(real: Proxy) -> None:
    client = real.client(real.key("real"))
    messages: list[dict[str, Any]] = [{"role": "user", "content": "hello"}]
    first = len(real.calls)
    reply = client.messages.create(model="tiny", system="Be brief.", max_tokens=10, messages=messages)
    assert reply.role == "assistant" and reply.stop_reason in ("end_turn", "max_tokens")
    assert reply.usage.output_tokens == len(real.calls[-1].output_ids)
    messages += [{"role": "assistant", "content": reply.content}, {"role": "user", "content": "and then?"}]
    with client.messages.stream(model="tiny", system="Be brief.", max_tokens=10, messages=messages) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert final.stop_reason in ("end_turn", "max_tokens")
    assert "".join(b.text for b in final.content if b.type == "text") == streamed
    calls = real.calls[first:]
    assert [c.call_index for c in calls] == [0, 1]
    assert extends(calls[1], calls[0])
    # The system text is rendered as the template's system turn.
    system_ids = real.template.system_ids(None, "Be brief.")
    assert list(prompt_of(calls[0])[: len(system_ids)]) == system_ids


# -- tool_use / tool_result (scripted model server) ---------------------------------------------------------------


def test_tool_use_round_trip_reuses_the_generated_ids(scripted: Proxy) -> None:
    client = scripted.client(scripted.key("tools"))
    scripted.backend.say('On it.\n<tool_call>\n{"name": "run", "arguments": {"cmd": "ls -la"}}\n</tool_call>')
    messages: list[Any] = [{"role": "user", "content": "list files"}]
    reply = client.messages.create(model="gyre", max_tokens=100, messages=messages, tools=TOOLS)
    assert reply.stop_reason == "tool_use"
    text, use = reply.content
    assert text.type == "text" and text.text == "On it."
    assert use.type == "tool_use" and use.name == "run" and use.input == {"cmd": "ls -la"}
    first = scripted.calls[-1]

    scripted.backend.say("Two files.")
    messages += [
        {"role": "assistant", "content": [block.model_dump(exclude_none=True) for block in reply.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "a b"}]},
    ]
    reply = client.messages.create(model="gyre", max_tokens=100, messages=messages, tools=TOOLS)
    assert reply.stop_reason == "end_turn" and reply.content[0].text == "Two files."
    second = scripted.calls[-1]
    assert extends(second, first)
    # The tool result is rendered as a tool turn right after the reused assistant turn.
    tool_turn = scripted.template.message_ids({"role": "tool", "tool_call_id": use.id, "content": "a b"})
    start = len(prompt_of(first)) + len(first.output_ids) + len(scripted.template.assistant_trailer_ids())
    assert list(prompt_of(second)[start : start + len(tool_turn)]) == tool_turn


def test_streamed_tool_use_accumulates_in_the_sdk(scripted: Proxy) -> None:
    client = scripted.client(scripted.key("tools-stream"))
    scripted.backend.say('<tool_call>\n{"name": "run", "arguments": {"cmd": "pwd", "n": [1, 2]}}\n</tool_call>')
    with client.messages.stream(
        model="gyre", max_tokens=100, messages=[{"role": "user", "content": "where?"}], tools=TOOLS
    ) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "content_block_start" in kinds and "message_delta" in kinds
    [use] = final.content
    assert use.type == "tool_use" and use.input == {"cmd": "pwd", "n": [1, 2]}
    assert final.stop_reason == "tool_use"


def test_stop_sequence_and_sampling_params(scripted: Proxy) -> None:
    client = scripted.client(scripted.key("stop"))
    scripted.backend.say("alpha ###", finish="stop_string")
    reply = client.messages.create(
        model="gyre",
        max_tokens=9,
        messages=[{"role": "user", "content": "go"}],
        stop_sequences=["###"],
        extra_body={"temperature": 0.3, "top_k": 5},  # this SDK version no longer names them; the API takes them
    )
    assert reply.stop_reason == "stop_sequence" and reply.stop_sequence == "###"
    assert reply.content[0].text == "alpha "
    params = scripted.backend.requests[-1].sampling_params
    assert params["stop"] == ["###"] and params["top_k"] == 5 and params["temperature"] == 0.3
    assert params["max_new_tokens"] == 9


def test_headers_label_agent_and_call_kind(scripted: Proxy) -> None:
    client = scripted.client(scripted.key("labels"))
    scripted.backend.say("short")
    client.messages.create(
        model="gyre",
        max_tokens=5,
        messages=[{"role": "user", "content": "compress"}],
        extra_headers={"X-Gyre-Agent": "main", "X-Gyre-Call": "summary"},
    )
    assert (scripted.calls[-1].agent_id, scripted.calls[-1].call_kind) == ("main", "summary")


def test_count_tokens(scripted: Proxy) -> None:
    client = scripted.client(scripted.key("count"))
    messages = [{"role": "user", "content": "how many?"}]
    counted = client.messages.count_tokens(model="gyre", messages=messages, system="sys")
    expected = scripted.template.render_ids([{"role": "system", "content": "sys"}, *messages])
    assert counted.input_tokens == len(expected)


# -- refusals ---------------------------------------------------------------------------------------------------------


def test_missing_and_wrong_keys_get_401(scripted: Proxy) -> None:
    with pytest.raises(anthropic.AuthenticationError) as error:
        messages = [{"role": "user", "content": "x"}]
        scripted.client("not-a-key").messages.create(model="gyre", max_tokens=5, messages=messages)
    assert error.value.body["error"]["type"] == "authentication_error"

    async def no_key() -> tuple[int, Any]:
        async with aiohttp.ClientSession() as http:
            async with http.post(scripted.served.base_url + "/v1/messages", json={}) as response:
                return response.status, await response.json()

    status, body = asyncio.run(no_key())
    assert status == 401 and body["type"] == "error" and body["error"]["type"] == "authentication_error"


def test_unknown_model_gets_404(scripted: Proxy) -> None:
    client = scripted.client(scripted.key("model"))
    with pytest.raises(anthropic.NotFoundError) as error:
        client.messages.create(model="claude-opus", max_tokens=5, messages=[{"role": "user", "content": "x"}])
    assert error.value.body["error"]["type"] == "not_found_error"


@pytest.mark.parametrize(
    "extra",
    [
        {"temperature": 1.5},
        {"max_tokens": 0},
        {"top_k": 0},
        {"messages": []},
        {"messages": [{"role": "system", "content": "x"}]},
        {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
        {"messages": [{"role": "user", "content": [{"type": "tool_result"}]}]},
        {"messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "run", "input": 3}]}]},
        {"tools": [{"name": "run"}]},
        {"tools": [{"type": "bash_20250124", "name": "bash"}]},
        {"tool_choice": {"type": "any"}},
        {"system": 5},
    ],
)
def test_bad_parameters_get_400(scripted: Proxy, extra: dict[str, Any]) -> None:
    client = scripted.client(scripted.key(f"bad-{len(scripted.sessions)}"))
    with pytest.raises(anthropic.BadRequestError) as error:
        # extra_body overrides the valid fields given here (and carries those this SDK version does not name).
        messages = [{"role": "user", "content": "x"}]
        client.messages.create(model="gyre", max_tokens=5, messages=messages, extra_body=extra)
    assert error.value.body["error"]["type"] == "invalid_request_error"


def test_malformed_json_missing_max_tokens_and_over_long_prompt(scripted: Proxy) -> None:
    key = scripted.key("raw")

    async def post(data: bytes) -> tuple[int, Any]:
        async with aiohttp.ClientSession(headers={"x-api-key": key}) as http:
            async with http.post(scripted.served.base_url + "/v1/messages", data=data) as response:
                return response.status, await response.json()

    status, body = asyncio.run(post(b"{not json"))
    assert status == 400 and body["error"]["type"] == "invalid_request_error"
    status, body = asyncio.run(post(b'{"model": "gyre", "messages": [{"role": "user", "content": "x"}]}'))
    assert status == 400 and "max_tokens" in body["error"]["message"]
    client = scripted.client(key)
    long_text = " ".join(f"w{i}" for i in range(MAX_CONTEXT_TOKENS))
    with pytest.raises(anthropic.BadRequestError) as error:
        client.messages.create(model="gyre", max_tokens=5, messages=[{"role": "user", "content": long_text}])
    assert "context" in error.value.body["error"]["message"]


# -- incremental streaming -------------------------------------------------------------------------------------------


def test_real_engine_stream_arrives_in_pieces_and_equals_the_non_streamed_message(real: Proxy) -> None:
    messages = [{"role": "user", "content": "tell me a long story about the river"}]
    plain = real.client(real.key("greedy-plain")).messages.create(
        model="tiny", max_tokens=24, messages=messages, extra_body={"temperature": 0})
    plain_call = real.calls[-1]
    client = real.client(real.key("greedy-stream"))
    with client.messages.stream(model="tiny", max_tokens=24, messages=messages, extra_body={"temperature": 0}) as stream:
        pieces = [text for text in stream.text_stream if text]
        final = stream.get_final_message()
    streamed_call = real.calls[-1]
    assert streamed_call.execution_id == "greedy-stream"
    assert len(plain_call.output_ids) >= 8 and len(pieces) >= 3  # several deltas, not one answer at the end
    assert [(b.type, b.text) for b in final.content] == [(b.type, b.text) for b in plain.content]
    assert final.stop_reason == plain.stop_reason
    assert final.usage.output_tokens == plain.usage.output_tokens
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == (
        plain.usage.input_tokens + plain.usage.cache_read_input_tokens)
    assert streamed_call.output_ids == plain_call.output_ids
    assert streamed_call.output_logprobs == pytest.approx(plain_call.output_logprobs, abs=1e-4)


def test_streamed_text_and_tool_use_equal_the_non_streamed_message(scripted: Proxy) -> None:
    text = 'On it, listing the files now.\n<tool_call>\n{"name": "run", "arguments": {"cmd": "ls -la"}}\n</tool_call>'
    messages = [{"role": "user", "content": "list files"}]
    scripted.backend.say(text)
    plain = scripted.client(scripted.key("mixed-plain")).messages.create(
        model="gyre", max_tokens=100, messages=messages, tools=TOOLS)
    scripted.backend.say(text)
    client = scripted.client(scripted.key("mixed-stream"))
    with client.messages.stream(model="gyre", max_tokens=100, messages=messages, tools=TOOLS) as stream:
        events = list(stream)
        final = stream.get_final_message()
    deltas = [e for e in events if e.type == "content_block_delta"]
    text_deltas = [e.delta.text for e in deltas if e.delta.type == "text_delta"]
    assert len(text_deltas) > 5 and not any("<tool" in t for t in text_deltas)
    assert "".join(text_deltas) == "On it, listing the files now."
    # The tool_use block comes after the text block, whole (one input_json_delta).
    assert [e.delta.type for e in deltas][-1] == "input_json_delta"
    assert [(b.type, getattr(b, "text", None), getattr(b, "name", None), getattr(b, "input", None))
            for b in final.content] == [
        (b.type, getattr(b, "text", None), getattr(b, "name", None), getattr(b, "input", None)) for b in plain.content]
    assert final.stop_reason == plain.stop_reason == "tool_use"
