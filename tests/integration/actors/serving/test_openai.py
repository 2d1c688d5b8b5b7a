"""The proxy's OpenAI face, driven by the real `openai` SDK over HTTP on 127.0.0.1.

Two servers: one over the real embedded engine on a tiny random model (end to end, nothing faked), and one over a
scripted model server for the paths a random model cannot reach on purpose (tool calls, stop strings). The scripted
backend is the outer edge: it stands in for the engine and returns the token ids of a chosen text, tokenised one
character at a time (a tokenisation the tokenizer never produces, as a sampling model may), so that any
re-tokenisation drift would show. Everything between the SDK and the engine is real.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from pathlib import Path
from typing import Any, Iterator

import aiohttp
import openai
import pytest
import torch

from gyre.actors.serving.backends import BackendRequest, BackendResult, EmbeddedBackend
from gyre.actors.serving.http_app import PROXY_SERVICE, ProxyHttpConfig, ServedApp, build_proxy_app
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
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
        },
    }
]


class ScriptedModel:
    """The model server's stand-in: answers each call with the next scripted text as character-level token ids."""

    def __init__(self, template: ChatTemplate) -> None:
        self.template = template
        self.script: list[tuple[str, str]] = []
        self.requests: list[BackendRequest] = []

    def say(self, text: str, finish: str = "stop") -> None:
        self.script.append((text, finish))

    async def generate(self, request: BackendRequest) -> BackendResult:
        self.requests.append(request)
        if not self.script:
            raise RuntimeError("the script is empty")  # the proxy must answer 500 and survive
        text, finish = self.script.pop(0)
        ids = [i for ch in text for i in self.template.encode(ch)]
        if finish == "stop":
            ids.append(self.template.im_end_id)
        if finish == "raise":
            raise RuntimeError("scripted crash")
        return BackendResult(
            output_ids=tuple(ids),
            output_logprobs=tuple(-0.25 for _ in ids),
            output_versions=tuple(3 for _ in ids),
            finish_reason="stop" if finish == "stop_string" else finish,
            cached_tokens=0,
            cell="scripted-cell",
        )

    async def generate_streaming(self, request: BackendRequest, on_output: Any) -> BackendResult:
        """The same answer, passed on one token at a time (a streaming engine's per-step output)."""
        result = await self.generate(request)
        for token in result.output_ids:
            await on_output((token,))
        return result


class Proxy:
    """A proxy served on 127.0.0.1 in a background thread, with the calls it emitted."""

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

    def key(self, execution_id: str, group_id: str = "group") -> str:
        async def issue() -> str:  # on the server's loop: sessions belong to it
            return self.sessions.issue_key(execution_id, group_id)

        return self.served.call(issue())

    def client(self, key: str, **kwargs: Any) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.served.base_url + "/v1", api_key=key, max_retries=0, **kwargs)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model_dir(tmp_path_factory.mktemp("model") / "tiny", "tiny", seed=0)


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
        ProxyHttpConfig(max_context_tokens=MAX_CONTEXT_TOKENS),
    )
    with proxy.served:
        yield proxy
        proxy.served.call(proxy.backend.engine.close())


@pytest.fixture(scope="module")
def scripted(template: ChatTemplate) -> Iterator[Proxy]:
    config = ProxyHttpConfig(model_names=("gyre", "other"), max_context_tokens=MAX_CONTEXT_TOKENS, max_body_bytes=2**20)
    proxy = Proxy(template, lambda: ScriptedModel(template), config)
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


def test_real_engine_multi_turn_is_drift_free(real: Proxy) -> None:
    client = real.client(real.key("real-multi"))
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "hi"},
    ]
    first = len(real.calls)
    for turn in range(3):
        answer = client.chat.completions.create(model="gyre", messages=messages, max_tokens=12, seed=turn)
        choice = answer.choices[0]
        assert choice.message.role == "assistant" and choice.finish_reason in ("stop", "length")
        assert answer.usage.completion_tokens == len(real.calls[-1].output_ids)
        messages += [
            {"role": "assistant", "content": choice.message.content},
            {"role": "user", "content": f"go {turn}"},
        ]
    calls = real.calls[first:]
    assert [c.call_index for c in calls] == [0, 1, 2]
    assert all(c.execution_id == "real-multi" and c.group_id == "group" and c.cell == "cell-0" for c in calls)
    for earlier, later in zip(calls, calls[1:]):
        assert extends(later, earlier)
    for call in calls:
        assert len(call.output_ids) == len(call.output_logprobs) == len(call.output_versions) > 0
        assert all(lp <= 0.0 for lp in call.output_logprobs) and set(call.output_versions) == {0}
        assert call.started_s < call.finished_s
        assert call.agent_id == "" and call.call_kind == ""
    # The later turns found the earlier ones in the engine's prefix cache.
    assert calls[-1].cached_tokens > 0


def test_real_engine_calls_record_the_temperature_of_their_log_probs(real: Proxy) -> None:
    # The trainer divides its logits by the recorded temperature (engines/temperature.py); greedy counts as 1.
    client = real.client(real.key("real-temperature"))
    messages = [{"role": "user", "content": "warm or cold?"}]
    first = len(real.calls)
    for temperature in (0.6, 1.3, 0.0):
        client.chat.completions.create(model="gyre", messages=messages, max_tokens=4, seed=3, temperature=temperature)
    client.chat.completions.create(model="gyre", messages=messages, max_tokens=4, seed=3)  # the API's default: 1
    assert [c.sampling_temperature for c in real.calls[first:]] == [0.6, 1.3, 1.0, 1.0]


def test_real_engine_streaming(real: Proxy) -> None:
    client = real.client(real.key("real-stream"))
    stream = client.chat.completions.create(
        model="gyre",
        messages=[{"role": "user", "content": "count"}],
        max_tokens=8,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish in (["stop"], ["length"])
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == len(real.calls[-1].output_ids)
    call = real.calls[-1]
    ids = list(call.output_ids)
    if ids and ids[-1] in real.template.stop_token_ids:
        ids.pop()
    assert text == real.template.decode(ids)


def test_real_engine_rejects_a_seed_it_cannot_use(real: Proxy) -> None:
    client = real.client(real.key("real-bad-seed"))
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="gyre", messages=[{"role": "user", "content": "x"}], max_tokens=2, seed=-1)


# -- tool calls (scripted model server) ----------------------------------------------------------------------------


def test_tool_call_round_trip_reuses_the_generated_ids(scripted: Proxy) -> None:
    client = scripted.client(scripted.key("tools"))
    scripted.backend.say(
        'Let me look.\n<tool_call>\n{"name": "read_file", "arguments": {"path": "a.txt"}}\n</tool_call>'
    )
    messages: list[Any] = [{"role": "user", "content": "what is in a.txt?"}]
    answer = client.chat.completions.create(model="gyre", messages=messages, tools=TOOLS)
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me look."
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "read_file"
    assert json.loads(call.function.arguments) == {"path": "a.txt"}
    first = scripted.calls[-1]
    assert prompt_of(first) == tuple(scripted.template.render_ids(messages, TOOLS))

    scripted.backend.say("It says hello.")
    messages += [
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "hello"},
    ]
    answer = client.chat.completions.create(model="gyre", messages=messages, tools=TOOLS)
    assert answer.choices[0].message.content == "It says hello."
    assert answer.choices[0].finish_reason == "stop"
    second = scripted.calls[-1]
    assert extends(second, first)
    # Rendering the text again would not have given the ids the model emitted.
    assert list(prompt_of(second)) != scripted.template.render_ids(messages, TOOLS)


def test_streamed_tool_calls_accumulate_in_the_sdk(scripted: Proxy) -> None:
    client = scripted.client(scripted.key("tools-stream"))
    scripted.backend.say(
        '<tool_call>\n{"name": "read_file", "arguments": {"path": "a"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "read_file", "arguments": {"path": "b"}}\n</tool_call>'
    )
    chunks = list(
        client.chat.completions.create(
            model="gyre", messages=[{"role": "user", "content": "read a and b"}], tools=TOOLS, stream=True
        )
    )
    calls: dict[int, dict[str, str]] = {}
    for chunk in chunks:
        for delta in chunk.choices[0].delta.tool_calls or ():
            entry = calls.setdefault(delta.index, {"id": "", "name": "", "arguments": ""})
            entry["id"] += delta.id or ""
            entry["name"] += delta.function.name or ""
            entry["arguments"] += delta.function.arguments or ""
    assert [json.loads(calls[i]["arguments"]) for i in (0, 1)] == [{"path": "a"}, {"path": "b"}]
    assert calls[0]["id"] != calls[1]["id"]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_malformed_tool_call_comes_back_as_text(scripted: Proxy) -> None:
    client = scripted.client(scripted.key("tools-bad"))
    text = '<tool_call>\n{"name": "read_file", "arguments": {"path": \n</tool_call>'
    scripted.backend.say(text)
    answer = client.chat.completions.create(model="gyre", messages=[{"role": "user", "content": "go"}], tools=TOOLS)
    assert answer.choices[0].message.content == text
    assert not answer.choices[0].message.tool_calls
    assert answer.choices[0].finish_reason == "stop"


def test_tool_choice_none_removes_the_tools(scripted: Proxy) -> None:
    client = scripted.client(scripted.key("tools-none"))
    text = '<tool_call>\n{"name": "read_file", "arguments": {}}\n</tool_call>'
    scripted.backend.say(text)
    messages = [{"role": "user", "content": "go"}]
    answer = client.chat.completions.create(model="gyre", messages=messages, tools=TOOLS, tool_choice="none")
    assert answer.choices[0].message.content == text and not answer.choices[0].message.tool_calls
    assert prompt_of(scripted.calls[-1]) == tuple(scripted.template.render_ids(messages))
    # A named tool_choice must name a known tool.
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(
            model="gyre", messages=messages, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}
        )


def test_stop_string_cuts_the_content_and_sampling_params_reach_the_engine(scripted: Proxy) -> None:
    client = scripted.client(scripted.key("stop"))
    scripted.backend.say("one two END", finish="stop_string")
    answer = client.chat.completions.create(
        model="gyre",
        messages=[{"role": "user", "content": "count"}],
        stop=["END"],
        temperature=0.5,
        top_p=0.9,
        max_completion_tokens=7,
        seed=11,
        logprobs=True,
    )
    assert answer.choices[0].message.content == "one two "
    assert answer.choices[0].finish_reason == "stop"
    params = scripted.backend.requests[-1].sampling_params
    assert params["stop"] == ["END"] and params["temperature"] == 0.5 and params["top_p"] == 0.9
    assert params["max_new_tokens"] == 7 and params["sampling_seed"] == 11
    assert params["stop_token_ids"] == list(scripted.template.stop_token_ids)
    logprobs = answer.choices[0].logprobs.content
    assert len(logprobs) == len(scripted.calls[-1].output_ids) and logprobs[0].logprob == -0.25


def test_length_finish(scripted: Proxy) -> None:
    client = scripted.client(scripted.key("length"))
    scripted.backend.say("cut sh", finish="length")
    answer = client.chat.completions.create(model="gyre", messages=[{"role": "user", "content": "x"}], max_tokens=6)
    assert answer.choices[0].finish_reason == "length" and answer.choices[0].message.content == "cut sh"


# -- labels, isolation ----------------------------------------------------------------------------------------------


def test_headers_label_agent_and_call_kind(scripted: Proxy) -> None:
    client = scripted.client(scripted.key("labels"))
    scripted.backend.say("summary text")
    client.chat.completions.create(
        model="gyre",
        messages=[{"role": "user", "content": "summarise"}],
        extra_headers={"X-Gyre-Agent": "sub-1", "X-Gyre-Call": "summary"},
    )
    call = scripted.calls[-1]
    assert (call.agent_id, call.call_kind) == ("sub-1", "summary")
    assert scripted.backend.requests[-1].session_key == "labels/sub-1"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(
            model="gyre", messages=[{"role": "user", "content": "x"}], extra_headers={"X-Gyre-Call": "bogus"}
        )


def test_executions_cannot_reach_each_others_turns(scripted: Proxy) -> None:
    client_a = scripted.client(scripted.key("iso-a"))
    client_b = scripted.client(scripted.key("iso-b"))
    scripted.backend.say("secret plan")
    first = [{"role": "user", "content": "plan"}]
    client_a.chat.completions.create(model="gyre", messages=first)
    a_call = scripted.calls[-1]
    follow = [*first, {"role": "assistant", "content": "secret plan"}, {"role": "user", "content": "next"}]
    scripted.backend.say("b answer")
    client_b.chat.completions.create(model="gyre", messages=follow)
    b_call = scripted.calls[-1]
    assert b_call.execution_id == "iso-b" and b_call.call_index == 0
    assert not extends(b_call, a_call)  # b's prompt was rendered from text, not from a's ids
    assert list(prompt_of(b_call)) == scripted.template.render_ids(follow)


# -- refusals: 401, 404, 400, 413, 5xx ------------------------------------------------------------------------------


def test_missing_wrong_and_revoked_keys_get_401(scripted: Proxy) -> None:
    messages = [{"role": "user", "content": "x"}]
    with pytest.raises(openai.AuthenticationError) as error:
        scripted.client("wrong-key").chat.completions.create(model="gyre", messages=messages)
    assert error.value.status_code == 401 and error.value.body["code"] == "invalid_api_key"
    key = scripted.key("revoked")

    async def revoke() -> None:
        scripted.sessions.revoke("revoked")

    scripted.served.call(revoke())
    with pytest.raises(openai.AuthenticationError):
        scripted.client(key).chat.completions.create(model="gyre", messages=messages)

    async def no_key() -> tuple[int, Any]:
        async with aiohttp.ClientSession() as http:
            async with http.post(scripted.served.base_url + "/v1/chat/completions", json={}) as response:
                return response.status, await response.json()

    status, body = asyncio.run(no_key())
    assert status == 401 and body["error"]["type"] == "invalid_request_error"


def test_models_and_unknown_model(scripted: Proxy) -> None:
    client = scripted.client(scripted.key("models"))
    assert [m.id for m in client.models.list()] == ["gyre", "other"]
    assert client.models.retrieve("other").id == "other"
    with pytest.raises(openai.NotFoundError) as error:
        client.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "x"}])
    assert error.value.body["code"] == "model_not_found"


@pytest.mark.parametrize(
    "extra",
    [
        {"temperature": 3},
        {"temperature": "hot"},
        {"top_p": 0},
        {"max_tokens": 0},
        {"n": 2},
        {"stop": [""]},
        {"presence_penalty": 1.0},
        {"top_logprobs": 3, "logprobs": True},
        {"response_format": {"type": "json_object"}},
        {"messages": []},
        {"messages": [{"role": "wizard", "content": "x"}]},
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        {"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                       "function": {"name": "f", "arguments": "not json"}}]}]},
        {"tools": [{"type": "retrieval"}]},
        {"tool_choice": "required"},
    ],
)
def test_bad_parameters_get_400(scripted: Proxy, extra: dict[str, Any]) -> None:
    client = scripted.client(scripted.key(f"bad-{len(scripted.sessions)}"))
    body = {"model": "gyre", "messages": [{"role": "user", "content": "x"}], **extra}
    calls_before = len(scripted.calls)
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(**body)
    assert error.value.body["type"] == "invalid_request_error"
    assert len(scripted.calls) == calls_before


def test_malformed_json_and_unknown_routes(scripted: Proxy) -> None:
    key = scripted.key("raw")

    async def post(path: str, data: bytes) -> tuple[int, Any]:
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {key}"}) as http:
            async with http.post(scripted.served.base_url + path, data=data) as response:
                return response.status, await response.json()

    status, body = asyncio.run(post("/v1/chat/completions", b'{"model": "gyre", "messages": [}'))
    assert status == 400 and "not valid JSON" in body["error"]["message"]
    status, body = asyncio.run(post("/v1/chat/completions", b'["a list"]'))
    assert status == 400 and body["error"]["type"] == "invalid_request_error"
    status, body = asyncio.run(post("/v1/nothing", b"{}"))
    assert status == 404 and "error" in body


def test_over_long_prompt_and_over_large_body(scripted: Proxy) -> None:
    client = scripted.client(scripted.key("long"))
    long_text = " ".join(f"w{i}" for i in range(MAX_CONTEXT_TOKENS))
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model="gyre", messages=[{"role": "user", "content": long_text}])
    assert error.value.body["code"] == "context_length_exceeded"
    huge = "x" * (2**20 + 10)
    with pytest.raises(openai.APIStatusError) as error:
        client.chat.completions.create(model="gyre", messages=[{"role": "user", "content": huge}])
    assert error.value.status_code == 413
    # A max_tokens beyond the room left is lowered to fit rather than refused.
    scripted.backend.say("ok")
    client.chat.completions.create(model="gyre", messages=[{"role": "user", "content": "x"}], max_tokens=10**6)
    assert scripted.backend.requests[-1].sampling_params["max_new_tokens"] == MAX_CONTEXT_TOKENS - len(
        prompt_of(scripted.calls[-1])
    )


def test_engine_failures_become_5xx_and_the_proxy_survives(scripted: Proxy) -> None:
    client = scripted.client(scripted.key("crash"))
    messages = [{"role": "user", "content": "x"}]
    calls_before = len(scripted.calls)
    scripted.backend.say("", finish="raise")
    with pytest.raises(openai.InternalServerError):
        client.chat.completions.create(model="gyre", messages=messages)
    scripted.backend.say("partial", finish="abort")
    with pytest.raises(openai.APIStatusError) as error:
        client.chat.completions.create(model="gyre", messages=messages)
    assert error.value.status_code == 503
    assert len(scripted.calls) == calls_before  # neither failure produced training data
    scripted.backend.say("fine again")
    answer = client.chat.completions.create(model="gyre", messages=messages)
    assert answer.choices[0].message.content == "fine again"
    stats = scripted.served.app[PROXY_SERVICE].statistics()
    assert stats.calls_failed >= 2 and stats.in_flight == 0


def test_gyre_serve_app_requires_its_key(model_dir: Path) -> None:
    from gyre.actors.serving.cli import ServeConfig, make_app

    config = ServeConfig(model_dir=str(model_dir), api_key="serve-key", model_name="tiny", max_context_tokens=512,
                         num_threads=1)
    with ServedApp(lambda: make_app(config)) as served:
        client = openai.OpenAI(base_url=served.base_url + "/v1", api_key="serve-key", max_retries=0)
        messages = [{"role": "user", "content": "hi"}]
        answer = client.chat.completions.create(model="tiny", messages=messages, max_tokens=3)
        assert answer.usage.completion_tokens == 3 or answer.choices[0].finish_reason == "stop"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=served.base_url + "/v1", api_key="other", max_retries=0).models.list()


def test_proxy_over_engine_servers_through_the_sglang_client(model_dir: Path, template: ChatTemplate) -> None:
    """The at-scale path, all real: proxy -> SGLangBackend -> SGLangClient -> two engine servers (two cells)."""
    from aiohttp import web

    from gyre.actors.serving.backends import SGLangBackend
    from gyre.engines.engine_server import build_engine_app
    from gyre.engines.sglang_client import SGLangClient

    calls: list[ModelCallCompleted] = []
    rebuilder = PromptRebuilder()

    def take(call: ModelCallCompleted) -> None:
        rebuilder.add(call)
        _WHOLE_PROMPTS[id(call)] = rebuilder.prompt_ids(call)
        calls.append(call)

    sessions = ProxySessions(template)
    engine_config = EngineConfig(num_blocks=64, max_context_tokens=MAX_CONTEXT_TOKENS, num_threads=1)

    async def make_app() -> web.Application:
        runners, clients, engines = [], {}, []
        for cell in ("cell-a", "cell-b"):
            engine = AsyncEngine(EmbeddedEngine(model_dir, engine_config))
            runner = web.AppRunner(build_engine_app(engine))
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", 0).start()
            runners.append(runner)
            engines.append(engine)
            clients[cell] = SGLangClient(f"http://127.0.0.1:{runner.addresses[0][1]}")
        app = build_proxy_app(
            ProxyHttpConfig(max_context_tokens=MAX_CONTEXT_TOKENS), sessions, SGLangBackend(clients), take,
            clock=lambda: 0.0,
        )

        async def close(_: web.Application) -> None:
            for client in clients.values():
                await client.close()
            for runner in runners:
                await runner.cleanup()
            for engine in engines:
                await engine.close()

        app.on_cleanup.append(close)
        return app

    with ServedApp(make_app) as served:

        async def issue(name: str) -> str:
            return sessions.issue_key(name, "group")

        client = openai.OpenAI(base_url=served.base_url + "/v1", api_key=served.call(issue("http-a")), max_retries=0)
        other = openai.OpenAI(base_url=served.base_url + "/v1", api_key=served.call(issue("http-b")), max_retries=0)
        messages: list[dict[str, Any]] = [{"role": "user", "content": "hello"}]
        answer = client.chat.completions.create(model="gyre", messages=messages, max_tokens=6, seed=1)
        messages += [{"role": "assistant", "content": answer.choices[0].message.content},
                     {"role": "user", "content": "more"}]
        other.chat.completions.create(model="gyre", messages=[{"role": "user", "content": "x"}], max_tokens=4)
        client.chat.completions.create(model="gyre", messages=messages, max_tokens=6, seed=2)
    first, _, second = calls
    assert extends(second, first)
    assert first.cell == second.cell  # the session stuck to its cell
    assert len(first.output_versions) == len(first.output_ids) and set(first.output_versions) == {0}
    assert all(lp <= 0.0 for lp in first.output_logprobs)


def test_proxy_bench_runs_and_holds_every_session(model_dir: Path) -> None:
    from gyre.benchmarks.proxy import ProxyBenchConfig, run_proxy_bench

    result = run_proxy_bench(ProxyBenchConfig(calls=20, warmup_calls=2, concurrent_sessions=120), model_dir)
    assert result.calls == 20 and result.proxy_overhead_p50_ms > 0
    assert result.concurrent_sessions == 120 and result.concurrent_in_flight_peak == 120


# -- incremental streaming -------------------------------------------------------------------------------------------


def content_chunks(chunks: list[Any]) -> list[str]:
    return [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]


def test_real_engine_stream_arrives_in_pieces_and_equals_the_non_streamed_call(real: Proxy) -> None:
    messages = [{"role": "user", "content": "tell me a long story about the river"}]
    plain = real.client(real.key("greedy-plain")).chat.completions.create(
        model="gyre", messages=messages, max_tokens=24, temperature=0)
    plain_call = real.calls[-1]
    chunks = list(real.client(real.key("greedy-stream")).chat.completions.create(
        model="gyre", messages=messages, max_tokens=24, temperature=0, stream=True))
    streamed_call = real.calls[-1]
    assert streamed_call.execution_id == "greedy-stream"
    pieces = content_chunks(chunks)
    assert len(plain_call.output_ids) >= 8 and len(pieces) >= 3  # several deltas, not one answer at the end
    assert "".join(pieces) == plain.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == plain.choices[0].finish_reason
    # Token-in/token-out is unchanged by streaming: the same ids, log-probs and versions are recorded.
    assert prompt_of(streamed_call) == prompt_of(plain_call)
    assert streamed_call.output_ids == plain_call.output_ids
    assert streamed_call.output_logprobs == pytest.approx(plain_call.output_logprobs, abs=1e-4)
    assert streamed_call.output_versions == plain_call.output_versions


def test_streamed_text_then_tool_call_equals_the_non_streamed_answer(scripted: Proxy) -> None:
    text = ('I will read the file first, then answer.\n'
            '<tool_call>\n{"name": "read_file", "arguments": {"path": "ä.txt"}}\n</tool_call>')
    messages = [{"role": "user", "content": "what is in ä.txt?"}]
    scripted.backend.say(text)
    plain = scripted.client(scripted.key("mixed-plain")).chat.completions.create(
        model="gyre", messages=messages, tools=TOOLS)
    scripted.backend.say(text)
    chunks = list(scripted.client(scripted.key("mixed-stream")).chat.completions.create(
        model="gyre", messages=messages, tools=TOOLS, stream=True))
    pieces = content_chunks(chunks)
    call_chunks = [i for i, c in enumerate(chunks) if c.choices and c.choices[0].delta.tool_calls]
    assert len(pieces) > 5 and "".join(pieces) == plain.choices[0].message.content == "I will read the file first, then answer."
    # The call arrives whole, after all the text before it, never as text.
    assert len(call_chunks) == 1 and not any("<tool" in p for p in pieces)
    [delta] = chunks[call_chunks[0]].choices[0].delta.tool_calls
    [expected] = plain.choices[0].message.tool_calls
    assert (delta.function.name, json.loads(delta.function.arguments)) == (
        expected.function.name, json.loads(expected.function.arguments))
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_sdk_stream_accumulator_gets_the_non_streamed_message(scripted: Proxy) -> None:
    text = 'Checking both.\n<tool_call>\n{"name": "read_file", "arguments": {"path": "a"}}\n</tool_call>'
    messages = [{"role": "user", "content": "read a"}]
    scripted.backend.say(text)
    plain = scripted.client(scripted.key("acc-plain")).chat.completions.create(
        model="gyre", messages=messages, tools=TOOLS)
    scripted.backend.say(text)
    client = scripted.client(scripted.key("acc-stream"))
    with client.chat.completions.stream(model="gyre", messages=messages, tools=TOOLS) as stream:
        events = [event.type for event in stream]
        final = stream.get_final_completion()
    assert events.count("content.delta") > 3
    message, expected = final.choices[0].message, plain.choices[0].message
    assert message.content == expected.content
    assert [(c.function.name, c.function.arguments) for c in message.tool_calls] == [
        (c.function.name, c.function.arguments) for c in expected.tool_calls]  # ids name the execution
    assert final.choices[0].finish_reason == plain.choices[0].finish_reason


class SlowStream(ScriptedModel):
    """Streams one token, then waits until the test has closed the connection before offering the rest."""

    def __init__(self, template: ChatTemplate) -> None:
        super().__init__(template)
        self.go_on = asyncio.Event()
        self.outcome = ""

    async def generate_streaming(self, request: BackendRequest, on_output: Any) -> BackendResult:
        result = await self.generate(request)
        try:
            await on_output(result.output_ids[:3])
            await asyncio.wait_for(self.go_on.wait(), 30)
            for token in result.output_ids[3:]:
                await on_output((token,))
                await asyncio.sleep(0.01)  # the engine's next step; the proxy notices the closed connection
        except BaseException as error:
            self.outcome = type(error).__name__  # what an engine sees: the generation is abandoned (aborted)
            raise
        self.outcome = "finished"
        return result


@pytest.fixture
def slow(template: ChatTemplate) -> Iterator[Proxy]:
    proxy = Proxy(template, lambda: SlowStream(template), ProxyHttpConfig(max_context_tokens=MAX_CONTEXT_TOKENS))
    with proxy.served:
        yield proxy


def test_a_client_leaving_mid_stream_aborts_the_generation_and_drops_the_call(slow: Proxy) -> None:
    key = slow.key("leaver")
    slow.backend.say("a fairly long answer that the agent will never read to the end")

    async def leave_early() -> str:
        async with aiohttp.ClientSession() as http:
            body = {"model": "gyre", "messages": [{"role": "user", "content": "hi"}], "stream": True}
            response = await http.post(slow.served.base_url + "/v1/chat/completions", json=body,
                                       headers={"Authorization": f"Bearer {key}"})
            first = await response.content.readline()  # the first delta arrived: the turn is being generated
            response.close()  # the agent goes away mid-turn
        return first.decode()

    first = asyncio.run(leave_early())
    assert first.startswith("data: ")

    async def release() -> None:
        slow.backend.go_on.set()
        for _ in range(3000):
            if slow.backend.outcome:
                return
            await asyncio.sleep(0.01)

    slow.served.call(release())
    assert slow.backend.outcome == "ClientGone"
    stats = slow.served.app[PROXY_SERVICE].statistics()
    assert stats.calls_disconnected == 1 and stats.calls_completed == 0 and stats.in_flight == 0
    assert slow.calls == []  # dropped: neither emitted ...
    session = slow.served.call(_session_of(slow, key))
    assert session.stored_turns == 0  # ... nor recorded


async def _session_of(proxy: Proxy, key: str) -> Any:
    return proxy.sessions.authenticate(key)

