"""The embedded engine's context limit is its config (`EngineConfig.max_context_tokens`), and a prompt over it is a
clear 400 at the proxy (issue 29, item 4), also when the proxy's own bound is larger (a cell whose engine holds less
than the proxy allows): the agent's SDK raises BadRequestError naming the engine's limit, nothing is recorded, and
the next call that fits is answered. A prompt over the proxy's own bound is refused before the engine sees it, with
OpenAI's context_length_exceeded.

Real parts: the `openai` SDK over HTTP, the proxy app, the embedded engine on the tiny model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import openai
import pytest
import torch

from gyre.actors.serving.backends import EmbeddedBackend
from gyre.actors.serving.http_app import ProxyHttpConfig, ServedApp, build_proxy_app
from gyre.actors.serving.sessions import ProxySessions
from gyre.engines.async_engine import AsyncEngine
from gyre.engines.chat_template import ChatTemplate
from gyre.engines.embedded_engine import EmbeddedEngine, EngineConfig
from gyre.messages.model_calls import ModelCallCompleted

ENGINE_CONTEXT_TOKENS = 256
PROXY_CONTEXT_TOKENS = 1024


@pytest.fixture(scope="module")
def served(tiny_model_dir: Path) -> Iterator[tuple[ServedApp, ProxySessions, list[ModelCallCompleted], ChatTemplate]]:
    torch.set_num_threads(1)
    template = ChatTemplate.from_model_dir(tiny_model_dir)
    sessions = ProxySessions(template)
    calls: list[ModelCallCompleted] = []
    engines: list[Any] = []

    def make_app() -> Any:
        config = EngineConfig(num_blocks=64, max_context_tokens=ENGINE_CONTEXT_TOKENS, num_threads=1)
        engines.append(AsyncEngine(EmbeddedEngine(tiny_model_dir, config)))
        return build_proxy_app(ProxyHttpConfig(max_context_tokens=PROXY_CONTEXT_TOKENS), sessions,
                               EmbeddedBackend(engines[0], cell="cell-0"), calls.append, clock=lambda: 0.0)

    with ServedApp(make_app) as app:
        yield app, sessions, calls, template
        app.call(engines[0].close())


def client(app: ServedApp, sessions: ProxySessions, execution: str) -> openai.OpenAI:
    async def issue() -> str:
        return sessions.issue_key(execution, "group")

    return openai.OpenAI(base_url=app.base_url + "/v1", api_key=app.call(issue()), max_retries=0)


def words(template: ChatTemplate, tokens: int) -> str:
    """Text of about `tokens` tokens."""
    text = ""
    while len(template.encode(text)) < tokens:
        text += "alpha beta gamma delta "
    return text


def test_a_prompt_over_the_engines_context_is_a_400_naming_its_limit(served) -> None:
    app, sessions, calls, template = served
    agent = client(app, sessions, "over-the-engine")
    long = words(template, ENGINE_CONTEXT_TOKENS + 40)  # over the engine's 256, well within the proxy's 1024
    with pytest.raises(openai.BadRequestError) as refused:
        agent.chat.completions.create(model="gyre", messages=[{"role": "user", "content": long}], max_tokens=4)
    assert refused.value.status_code == 400
    message = refused.value.body["message"]
    assert "max_context_tokens" in message and str(ENGINE_CONTEXT_TOKENS) in message, message
    assert calls == []  # a refused call is not recorded
    answer = agent.chat.completions.create(model="gyre", messages=[{"role": "user", "content": "short"}],
                                           max_tokens=4)
    assert answer.choices[0].finish_reason in ("stop", "length") and len(calls) == 1


def test_a_prompt_over_the_proxys_context_never_reaches_the_engine(served) -> None:
    app, sessions, calls, template = served
    agent = client(app, sessions, "over-the-proxy")
    before = len(calls)
    longer = words(template, PROXY_CONTEXT_TOKENS + 10)
    with pytest.raises(openai.BadRequestError) as refused:
        agent.chat.completions.create(model="gyre", messages=[{"role": "user", "content": longer}], max_tokens=4)
    assert refused.value.body["code"] == "context_length_exceeded"
    assert str(PROXY_CONTEXT_TOKENS) in refused.value.body["message"]
    assert len(calls) == before
