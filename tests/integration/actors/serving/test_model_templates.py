"""The proxy on checkpoints' own chat templates, through the real `openai` and `anthropic` SDKs over HTTP, with
transformers' apply_chat_template as the oracle.

The templates (tests/unit/engines/test_hf_templates.py) have the traits of the common ones: Qwen3-style (tools as
JSON, `<tool_call>` JSON, tool results grouped in a user turn, `<think>` blocks dropped from assistant turns before
the last user message) and Llama-style (BOS, role headers, a default system prompt when none is given). The model
server is scripted: it answers with chosen texts tokenised one character at a time (a tokenisation the tokenizer
never produces, as a sampling model may), so any re-tokenisation of a generated turn would show.

The oracle for a call: apply_chat_template's text of the conversation the agent sent, tokenised by transformers,
with each generated turn the rule keeps standing for its generated ids (`substituted`). keep_generated (the default)
keeps every one: where the template re-renders an earlier turn (drops its thinking), the prompt is the previous
call's prompt + output + the template's text after that turn. follow_template keeps a generated turn's ids only
where the template's text still holds it verbatim.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
from pathlib import Path
from typing import Any, Iterator

import anthropic
import openai
import pytest

from gyre.actors.serving.backends import BackendRequest, BackendResult
from gyre.actors.serving.http_app import ProxyHttpConfig, ServedApp, build_proxy_app
from gyre.actors.serving.sessions import FOLLOW_TEMPLATE, KEEP_GENERATED, ProxySessions, ProxySessionsConfig
from gyre.engines.chat_template import ChatTemplate
from gyre.messages.model_calls import ModelCallCompleted
from gyre.policies.trajectory_tree import PromptRebuilder, build_tree

_spec = importlib.util.spec_from_file_location(
    "hf_templates", Path(__file__).parents[3] / "unit" / "engines" / "test_hf_templates.py"
)
hf_templates = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(hf_templates)

TOOLS = hf_templates.TOOLS


class ScriptedModel:
    """Answers each call with the next scripted text as character-level ids, ended by the template's stop token
    (none: the answer was cut at its length limit)."""

    def __init__(self, template: ChatTemplate, stop_id: int | None) -> None:
        self.template = template
        self.stop_id = stop_id
        self.script: list[str] = []
        self.requests: list[BackendRequest] = []

    async def generate(self, request: BackendRequest) -> BackendResult:
        self.requests.append(request)
        text = self.script.pop(0)
        ids = [i for ch in text for i in self.template.encode(ch)]
        if self.stop_id is not None:
            ids.append(self.stop_id)
        return BackendResult(
            output_ids=tuple(ids), output_logprobs=tuple(-0.5 for _ in ids), output_versions=tuple(1 for _ in ids),
            finish_reason="stop" if self.stop_id is not None else "length", cached_tokens=0, cell="scripted",
        )


class Proxy:
    def __init__(self, model_dir: Path, earlier_turns: str) -> None:
        self.model_dir = model_dir
        self.template = ChatTemplate.from_model_dir(model_dir)
        self.sessions = ProxySessions(self.template, ProxySessionsConfig(earlier_turns=earlier_turns))
        self.calls: list[ModelCallCompleted] = []
        self.rebuilder = PromptRebuilder()
        self.prompts: list[tuple[int, ...]] = []
        stop_id = self.template.tokenizer.token_to_id("<|eot_id|>") or self.template.im_end_id
        self.backend = ScriptedModel(self.template, stop_id)
        ticks = itertools.count()
        config = ProxyHttpConfig(model_names=("m",), max_context_tokens=4096, max_body_bytes=2**20)
        self.served = ServedApp(
            lambda: build_proxy_app(config, self.sessions, self.backend, self.take, clock=lambda: float(next(ticks)))
        )

    def take(self, call: ModelCallCompleted) -> None:
        self.rebuilder.add(call)
        self.prompts.append(self.rebuilder.prompt_ids(call))
        self.calls.append(call)

    def key(self, execution_id: str) -> str:
        async def issue() -> str:
            return self.sessions.issue_key(execution_id, "group")

        return self.served.call(issue())


@pytest.fixture(scope="module")
def template_dirs(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return hf_templates.write_template_dirs(tiny_model_dir, tmp_path_factory.mktemp("templates"))


@pytest.fixture(scope="module")
def hf_tokenizers(template_dirs: dict[str, Path]) -> dict[str, Any]:
    from transformers import AutoTokenizer

    return {name: AutoTokenizer.from_pretrained(path) for name, path in template_dirs.items()}


@pytest.fixture
def proxy(request: pytest.FixtureRequest, template_dirs: dict[str, Path]) -> Iterator[Proxy]:
    name, earlier_turns = request.param
    served = Proxy(template_dirs[name], earlier_turns)
    with served.served:
        yield served


def hf_text(tokenizer: Any, messages: list[dict[str, Any]], tools: Any) -> str:
    return tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)


def hf_ids(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def substituted(tokenizer: Any, text: str, generated: list[tuple[str, tuple[int, ...]]]) -> tuple[int, ...]:
    """`text` tokenised by transformers, except that each generated turn (its decoded text and ids, in order) found
    verbatim in it, after the previous one found, stands for its generated ids."""
    ids: list[int] = []
    at = 0
    for turn_text, turn_ids in generated:
        found = text.find(turn_text, at)
        if found < 0:
            continue
        ids += hf_ids(tokenizer, text[at:found]) + list(turn_ids)
        at = found + len(turn_text)
    return tuple(ids + hf_ids(tokenizer, text[at:]))


def qwen3_agent(client: openai.OpenAI, proxy: Proxy) -> list[list[dict[str, Any]]]:
    """A tool loop with thinking on every turn, then two more user messages; the conversations of its calls."""
    script = proxy.backend.script
    script += [
        '<think>\nLook at the file first.\n</think>\n\nLet me look.\n<tool_call>\n'
        '{"name": "run", "arguments": {"cmd": "cat parser.py"}}\n</tool_call>',
        '<think>\nNow run the tests.\n</think>\n\n<tool_call>\n{"name": "run", "arguments": {"cmd": "pytest -q"}}'
        '\n</tool_call>\n<tool_call>\n{"name": "run", "arguments": {"cmd": "git diff"}}\n</tool_call>',
        "<think>\nint() of '3.0' fails.\n</think>\n\nUse float(x).",
        "<think>\nExplain briefly.\n</think>\n\nfloat() parses decimals.",
        "<think>\nDone.\n</think>\n\nYou are welcome ✓",
    ]
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You fix bugs."},
        {"role": "user", "content": "Tests fail in parser.py; fix them."},
    ]
    conversations = []
    followups = [None, None, "Why float?", "Thanks!", None]
    for followup in followups:
        conversations.append(json.loads(json.dumps(messages)))
        answer = client.chat.completions.create(model="m", messages=messages, tools=TOOLS)
        message = answer.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        for index, call in enumerate(message.tool_calls or []):
            messages.append({"role": "tool", "tool_call_id": call.id, "content": f"result {index} of {call.id}"})
        if followup:
            messages.append({"role": "user", "content": followup})
    return conversations


def llama_agent(client: openai.OpenAI, proxy: Proxy) -> list[list[dict[str, Any]]]:
    """Plain turns without a system message (the template inserts its default one)."""
    proxy.backend.script += ["Hello there.", "2 + 2 = 4.", "Bye ✓"]
    messages: list[dict[str, Any]] = [{"role": "user", "content": "  hi  "}]
    conversations = []
    for followup in ["what is 2+2?", "thanks", "ok"]:
        conversations.append(json.loads(json.dumps(messages)))
        answer = client.chat.completions.create(model="m", messages=messages)
        messages += [{"role": "assistant", "content": answer.choices[0].message.content},
                     {"role": "user", "content": followup}]
    return conversations


AGENTS = {"qwen3": (qwen3_agent, TOOLS), "llama": (llama_agent, None)}
CASES = [(name, mode) for name in AGENTS for mode in (KEEP_GENERATED, FOLLOW_TEMPLATE)]


def generated_turns(proxy: Proxy, count: int) -> list[tuple[str, tuple[int, ...]]]:
    """The first `count` calls' outputs: decoded text (stop token included) and ids."""
    return [(proxy.template.decode(c.output_ids), tuple(c.output_ids)) for c in proxy.calls[:count]]


@pytest.mark.parametrize("proxy", CASES, indirect=True, ids=[f"{n}-{m}" for n, m in CASES])
def test_prompts_are_the_templates_with_the_generated_ids(proxy: Proxy, hf_tokenizers: dict[str, Any]) -> None:
    name = proxy.model_dir.name.removeprefix("template-")
    agent, tools = AGENTS[name]
    tokenizer = hf_tokenizers[name]
    client = openai.OpenAI(base_url=proxy.served.base_url + "/v1", api_key=proxy.key(f"{name}-x"), max_retries=0)
    conversations = agent(client, proxy)
    keep = proxy.sessions.config.earlier_turns == KEEP_GENERATED
    calls, prompts = proxy.calls, proxy.prompts
    assert len(calls) == len(conversations)
    # What the engine was given is what the record says (rebuilt from the incremental records, digests checked).
    assert [tuple(r.prompt_ids) for r in proxy.backend.requests] == prompts
    # The first prompt is apply_chat_template's, token for token.
    assert prompts[0] == tuple(tokenizer.apply_chat_template(conversations[0], tools=tools,
                                                              add_generation_prompt=True, tokenize=True,
                                                              return_dict=False))
    dropped = []
    for k in range(1, len(calls)):
        text = hf_text(tokenizer, conversations[k], tools)
        previous = prompts[k - 1] + tuple(calls[k - 1].output_ids)
        kept_verbatim = proxy.template.decode(calls[k - 1].output_ids) in text
        if kept_verbatim or keep:
            # The call conditions on the previous call's prompt and generated ids, exactly.
            assert prompts[k][: len(previous)] == previous
            assert calls[k].extends_call == calls[k - 1].call_index
            assert calls[k].shared_tokens == len(previous)
        if kept_verbatim:
            assert prompts[k] == substituted(tokenizer, text, generated_turns(proxy, k))
            continue
        dropped.append(k)
        if keep:
            # The template re-rendered the earlier turns (dropped their thinking); the prompt keeps the generated
            # ids and appends the template's text after the last generated turn.
            visible = proxy.template.decode(calls[k - 1].output_ids).split("</think>")[-1].lstrip("\n")
            after = text[text.rindex(visible) + len(visible):]
            assert prompts[k] == previous + tuple(hf_ids(tokenizer, after))
        else:
            # The template's text exactly; ids of generated turns only where it still holds them verbatim.
            assert prompts[k] == substituted(tokenizer, text, generated_turns(proxy, k))
            assert calls[k].extends_call == calls[k - 1].call_index
            assert calls[k].shared_tokens < len(previous)  # a branch, from where the render departs
    # The calls after a new user message: the template dropped the thinking of the turns before it.
    assert dropped == ([3, 4] if name == "qwen3" else [])

    # What is trained: the tree over the records.
    tree = build_tree(calls)
    outputs = [len(c.output_ids) for c in calls]
    last = tree.path(calls[-1].call_index)
    if keep or not dropped:
        # One trajectory: every generated token in the context it was generated in, trained once.
        assert len(tree.trajectories()) == 1
        assert sum(last.policy_mask) == sum(outputs) == tree.statistics().policy_tokens
    else:
        # The re-rendered conversation branches: the earlier turns stay on the first trajectory (with their
        # thinking), the later calls' trajectory sees the template's re-render as prompt.
        trajectories = tree.trajectories()
        assert [t.leaf_call_index for t in trajectories] == [k - 1 for k in dropped] + [calls[-1].call_index]
        assert sum(last.policy_mask) == outputs[-1]
        assert tree.statistics().policy_tokens == sum(outputs)


@pytest.mark.parametrize("proxy", [("llama", KEEP_GENERATED)], indirect=True)
def test_anthropic_messages_on_a_llama_style_template(proxy: Proxy, hf_tokenizers: dict[str, Any]) -> None:
    tokenizer = hf_tokenizers["llama"]
    client = anthropic.Anthropic(base_url=proxy.served.base_url, api_key=proxy.key("anthropic"), max_retries=0)
    proxy.backend.script += ["Hello there, how are you?", "Four, of course."]
    messages: list[dict[str, Any]] = [{"role": "user", "content": "hello"}]
    reply = client.messages.create(model="m", system="Be brief.", max_tokens=50, messages=messages)
    messages += [{"role": "assistant", "content": reply.content[0].text}, {"role": "user", "content": "2+2?"}]
    client.messages.create(model="m", system="Be brief.", max_tokens=50, messages=messages)
    conversation = [{"role": "system", "content": "Be brief."}, *messages]
    first, second = proxy.prompts
    assert first == tuple(tokenizer.apply_chat_template(conversation[:2], add_generation_prompt=True,
                                                         tokenize=True, return_dict=False))
    text = hf_text(tokenizer, conversation, None)
    assert second == substituted(tokenizer, text, generated_turns(proxy, 1))
    assert second[: len(first) + len(proxy.calls[0].output_ids)] == first + proxy.calls[0].output_ids


def run_tool_loop(proxy: Proxy, answers: list[str], tools: Any = TOOLS) -> list[list[dict[str, Any]]]:
    """An agent that sends each answer back with a tool result per tool call; the conversations of its calls."""
    client = openai.OpenAI(base_url=proxy.served.base_url + "/v1", api_key=proxy.key("loop"), max_retries=0)
    proxy.backend.script += answers
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You fix bugs."},
                                      {"role": "user", "content": "Fix parser.py."}]
    conversations = []
    for _ in answers:
        conversations.append(json.loads(json.dumps(messages)))
        message = client.chat.completions.create(model="m", messages=messages, tools=tools).choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls or []:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": f"output of {call.id}"})
    return conversations


def tool_answer(cmd: str, spacing: str = " ") -> str:
    return f'<tool_call>\n{{"name": "run", "arguments": {{"cmd":{spacing}"{cmd}"}}}}\n</tool_call>'


def spy_on(proxy: Proxy) -> tuple[list[str], list[int]]:
    """The texts the proxy tokenises and the number of messages of each render, from now on."""
    tokenised: list[str] = []
    rendered: list[int] = []
    encode, render = proxy.template.encode_with_cuts, proxy.template.render_text

    def spy_encode(text: str) -> Any:
        tokenised.append(text)
        return encode(text)

    def spy_render(messages: Any, *args: Any, **kwargs: Any) -> str:
        rendered.append(len(messages))
        return render(messages, *args, **kwargs)

    proxy.template.encode_with_cuts = spy_encode  # type: ignore[method-assign]
    proxy.template.render_text = spy_render  # type: ignore[method-assign]
    return tokenised, rendered


@pytest.mark.parametrize("proxy", [("qwen3", KEEP_GENERATED)], indirect=True)
def test_a_call_tokenises_and_renders_only_what_is_new(proxy: Proxy, hf_tokenizers: dict[str, Any]) -> None:
    tokenised, rendered = spy_on(proxy)
    calls = 9
    conversations = run_tool_loop(proxy, [tool_answer(f"step {i}") for i in range(calls)])
    assert len(tokenised) == calls
    assert "You fix bugs." in tokenised[0]
    for k, text in enumerate(tokenised[1:], 1):
        # The previous answer's tool result and the generation prompt, nothing before.
        assert text == f"\n<|im_start|>user\n<tool_response>\noutput of {conversations[k][-1]['tool_call_id']}\n" \
                       "</tool_response><|im_end|>\n<|im_start|>assistant\n"
    # Renders: the first call whole; then a window (system, the answer's marker, the tool result), checked against
    # the whole conversation on the first four windowed calls; after that, windows only.
    whole = [len(c) for c in conversations]
    assert rendered == [whole[0], *itertools.chain.from_iterable((3, whole[k]) for k in range(1, 5)),
                        *(3 for _ in range(5, calls))]
    assert not proxy.sessions.window_check.disabled
    tokenizer = hf_tokenizers["qwen3"]
    for k in range(calls):
        text = hf_text(tokenizer, conversations[k], TOOLS)
        assert proxy.prompts[k] == substituted(tokenizer, text, generated_turns(proxy, k))


def test_a_template_that_renders_a_window_otherwise_is_rendered_whole(
    template_dirs: dict[str, Path], tmp_path: Path, hf_tokenizers: dict[str, Any]
) -> None:
    """A template that numbers tool results by their message's position: a window renders other numbers, which the
    first check finds; from then on the proxy renders whole, and every prompt is the template's."""
    import shutil

    from transformers import AutoTokenizer

    numbered = tmp_path / "template-numbered"
    shutil.copytree(template_dirs["qwen3"], numbered)
    config = json.loads((numbered / "tokenizer_config.json").read_text())
    old = r"'\n<tool_response>\n'"
    assert old in config["chat_template"]
    new = r"'\n<tool_response>' + (loop.index0 | string) + '\n'"
    config["chat_template"] = config["chat_template"].replace(old, new)
    (numbered / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer = AutoTokenizer.from_pretrained(numbered)
    proxy = Proxy(numbered, KEEP_GENERATED)
    with proxy.served:
        _, rendered = spy_on(proxy)
        conversations = run_tool_loop(proxy, [tool_answer(f"step {i}") for i in range(4)])
    assert proxy.sessions.window_check.disabled
    whole = [len(c) for c in conversations]
    assert rendered == [whole[0], 3, whole[1], whole[2], whole[3]]
    for k in range(4):
        text = hf_text(tokenizer, conversations[k], TOOLS)
        assert f"<tool_response>{2 * k + 1}\n" in text or k == 0
        assert proxy.prompts[k] == substituted(tokenizer, text, generated_turns(proxy, k))


@pytest.mark.parametrize("proxy", [("qwen3", KEEP_GENERATED), ("qwen3", FOLLOW_TEMPLATE)], indirect=True,
                         ids=["keep", "follow"])
def test_a_turn_the_template_writes_otherwise(proxy: Proxy, hf_tokenizers: dict[str, Any]) -> None:
    """The model wrote its arguments without a space; the proxy answers them as JSON (json.dumps), which the
    template writes back with one: not the text the model generated."""
    tokenizer = hf_tokenizers["qwen3"]
    conversations = run_tool_loop(proxy, [tool_answer("ls", spacing=""), "Done."])
    first, second = proxy.prompts
    path = first + proxy.calls[0].output_ids
    text = hf_text(tokenizer, conversations[1], TOOLS)
    assert proxy.template.decode(proxy.calls[0].output_ids) not in text
    if proxy.sessions.config.earlier_turns == KEEP_GENERATED:
        after = text[text.rindex("</tool_call><|im_end|>") + len("</tool_call><|im_end|>"):]
        assert second == path + tuple(hf_ids(tokenizer, after))
    else:
        assert second == tuple(hf_ids(tokenizer, text))  # the template's tokens, exactly
        assert proxy.calls[1].extends_call == 0 and proxy.calls[1].shared_tokens < len(path)
        assert second[: proxy.calls[1].shared_tokens] == path[: proxy.calls[1].shared_tokens]


@pytest.mark.parametrize("proxy", [("qwen3", KEEP_GENERATED)], indirect=True)
def test_a_cut_short_answer_gets_the_templates_turn_end(proxy: Proxy, hf_tokenizers: dict[str, Any]) -> None:
    tokenizer = hf_tokenizers["qwen3"]
    client = openai.OpenAI(base_url=proxy.served.base_url + "/v1", api_key=proxy.key("cut"), max_retries=0)
    proxy.backend.stop_id = None
    proxy.backend.script.append("An answer that ran out")
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Go on."}]
    answer = client.chat.completions.create(model="m", messages=messages)
    assert answer.choices[0].finish_reason == "length"
    messages += [{"role": "assistant", "content": answer.choices[0].message.content},
                 {"role": "user", "content": "and?"}]
    proxy.backend.stop_id = proxy.template.im_end_id
    proxy.backend.script.append("More.")
    client.chat.completions.create(model="m", messages=messages)
    first, second = proxy.prompts
    output = proxy.calls[0].output_ids
    assert output[-1] not in proxy.template.stop_token_ids
    assert second[: len(first) + len(output)] == first + output
    assert second == substituted(tokenizer, hf_text(tokenizer, messages, None), generated_turns(proxy, 1))


@pytest.mark.parametrize("proxy", [("qwen3", KEEP_GENERATED)], indirect=True)
def test_the_same_conversation_twice_gets_the_same_prompt(proxy: Proxy) -> None:
    client = openai.OpenAI(base_url=proxy.served.base_url + "/v1", api_key=proxy.key("retry"), max_retries=0)
    proxy.backend.script += [tool_answer("ls"), "Done.", "Done again."]
    messages: list[dict[str, Any]] = [{"role": "user", "content": "List."}]
    message = client.chat.completions.create(model="m", messages=messages, tools=TOOLS).choices[0].message
    messages += [message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "a.txt"}]
    client.chat.completions.create(model="m", messages=messages, tools=TOOLS)
    client.chat.completions.create(model="m", messages=messages, tools=TOOLS)  # a retry
    first, second, retry = proxy.prompts
    assert second == retry and second[: len(first)] == first
    assert proxy.calls[2].extends_call == 0 and proxy.calls[2].shared_tokens == len(first) + len(
        proxy.calls[0].output_ids)


def test_a_template_that_rewrites_assistant_content_follows_the_template(
    template_dirs: dict[str, Path], tmp_path: Path, hf_tokenizers: dict[str, Any]
) -> None:
    """A template that writes assistant content in capitals: the generated text is nowhere in its render (nor is
    the marker keep_generated looks for), so the prompt is the template's, tokenised from where it departs from
    the previous call's prompt; and what the engine is given is what the record says."""
    import shutil

    from transformers import AutoTokenizer

    upper = tmp_path / "template-upper"
    shutil.copytree(template_dirs["qwen3"], upper)
    config = json.loads((upper / "tokenizer_config.json").read_text())
    source = config["chat_template"]
    assert "'<|im_start|>assistant\\n' + content }}" in source
    config["chat_template"] = source.replace("'<|im_start|>assistant\\n' + content }}",
                                             "'<|im_start|>assistant\\n' + content | upper }}")
    (upper / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer = AutoTokenizer.from_pretrained(upper)
    proxy = Proxy(upper, KEEP_GENERATED)
    with proxy.served:
        client = openai.OpenAI(base_url=proxy.served.base_url + "/v1", api_key=proxy.key("upper"), max_retries=0)
        proxy.backend.script += ["Hello there, friend.", "Sure."]
        messages: list[dict[str, Any]] = [{"role": "user", "content": "hi"}]
        answer = client.chat.completions.create(model="m", messages=messages)
        messages += [{"role": "assistant", "content": answer.choices[0].message.content},
                     {"role": "user", "content": "again"}]
        client.chat.completions.create(model="m", messages=messages)
    first, second = proxy.prompts
    assert "HELLO THERE, FRIEND." in hf_text(tokenizer, messages, None)
    assert second == tuple(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                          return_dict=False))
    assert [tuple(r.prompt_ids) for r in proxy.backend.requests] == [first, second]
    path = first + proxy.calls[0].output_ids
    shared = proxy.calls[1].shared_tokens
    assert proxy.calls[1].extends_call == 0 and len(first) - 3 <= shared < len(path)  # a branch, inside the answer
    assert second[:shared] == path[:shared] and second[shared] != path[shared]


@pytest.mark.parametrize("proxy", [("qwen3", KEEP_GENERATED)], indirect=True)
def test_anthropic_tool_loop_streamed_on_a_qwen3_style_template(proxy: Proxy, hf_tokenizers: dict[str, Any]) -> None:
    tokenizer = hf_tokenizers["qwen3"]
    client = anthropic.Anthropic(base_url=proxy.served.base_url, api_key=proxy.key("anthropic-tools"), max_retries=0)
    tools = [{"name": "run", "description": "Run a shell command.",
              "input_schema": TOOLS[0]["function"]["parameters"]}]
    proxy.backend.script += ["<think>\nList first.\n</think>\n\nLooking.\n" + tool_answer("ls"),
                             "<think>\nFound it.\n</think>\n\nThere is a.txt.", "Bye."]
    messages: list[dict[str, Any]] = [{"role": "user", "content": "What is here?"}]
    conversations = []
    for followup in ("tool", "user", None):
        conversations.append(json.loads(json.dumps(messages)))
        with client.messages.stream(model="m", system="Be brief.", max_tokens=200, messages=messages,
                                    tools=tools) as stream:
            reply = stream.get_final_message()
        messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in reply.content]})
        if followup == "tool":
            [use] = [b for b in reply.content if b.type == "tool_use"]
            assert use.input == {"cmd": "ls"}
            messages.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                          "content": "a.txt"}]})
        elif followup == "user":
            messages.append({"role": "user", "content": "Thanks."})
    first, second, third = proxy.prompts
    outputs = [c.output_ids for c in proxy.calls]
    assert first == tuple(tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is here?"}],
        tools=TOOLS, add_generation_prompt=True, tokenize=True, return_dict=False))
    # The tool loop: the template keeps the thinking, so its text holds the generated turn verbatim.
    assert second[: len(first) + len(outputs[0])] == first + outputs[0]
    tool_turn = "\n<|im_start|>user\n<tool_response>\na.txt\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert second == first + outputs[0] + tuple(hf_ids(tokenizer, tool_turn))
    as_openai = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is here?"},
                 {"role": "assistant", "content": "<think>\nList first.\n</think>\n\nLooking.",
                  "tool_calls": [hf_templates.call("run", {"cmd": "ls"})]},
                 {"role": "tool", "content": "a.txt"}]
    assert second == substituted(tokenizer, hf_text(tokenizer, as_openai, TOOLS), generated_turns(proxy, 1))
    # After the new user message the template drops the thinking; the prompt keeps the generated ids.
    assert third == second + outputs[1] + tuple(hf_ids(
        tokenizer, "\n<|im_start|>user\nThanks.<|im_end|>\n<|im_start|>assistant\n"))
    assert len(build_tree(proxy.calls).trajectories()) == 1


def test_real_engine_on_a_qwen3_style_template(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Nothing faked: the embedded engine on the tiny model, whose directory brings the Qwen3-style template.
    Whatever the random model writes, each call extends the previous call's prompt + output exactly, and the
    first prompt is apply_chat_template's."""
    import shutil

    import torch
    from transformers import AutoTokenizer

    from gyre.actors.serving.backends import EmbeddedBackend
    from gyre.engines.async_engine import AsyncEngine
    from gyre.engines.embedded_engine import EmbeddedEngine, EngineConfig

    model_dir = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model_dir)
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    config["chat_template"] = hf_templates.QWEN3_STYLE
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config))
    torch.set_num_threads(1)
    template = ChatTemplate.from_model_dir(model_dir)
    assert not template.decomposable
    sessions = ProxySessions(template)
    calls: list[ModelCallCompleted] = []
    rebuilder = PromptRebuilder()
    prompts: list[tuple[int, ...]] = []

    def take(call: ModelCallCompleted) -> None:
        rebuilder.add(call)
        prompts.append(rebuilder.prompt_ids(call))
        calls.append(call)

    holder: dict[str, Any] = {}

    def make_app() -> Any:
        engine = EmbeddedEngine(model_dir, EngineConfig(num_blocks=64, max_context_tokens=1024, num_threads=1))
        holder["backend"] = EmbeddedBackend(AsyncEngine(engine), cell="cell-0")
        ticks = itertools.count()
        return build_proxy_app(ProxyHttpConfig(max_context_tokens=1024), sessions, holder["backend"], take,
                               clock=lambda: float(next(ticks)))

    served = ServedApp(make_app)
    with served:
        async def issue() -> str:
            return sessions.issue_key("real", "group")

        client = openai.OpenAI(base_url=served.base_url + "/v1", api_key=served.call(issue()), max_retries=0)
        messages: list[dict[str, Any]] = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "hi"}]
        conversations = []
        for turn in range(3):
            conversations.append(json.loads(json.dumps(messages)))
            answer = client.chat.completions.create(model="gyre", messages=messages, max_tokens=10, seed=turn)
            messages += [{"role": "assistant", "content": answer.choices[0].message.content},
                         {"role": "user", "content": f"go {turn}"}]
        served.call(holder["backend"].engine.close())
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert prompts[0] == tuple(tokenizer.apply_chat_template(conversations[0], add_generation_prompt=True,
                                                              tokenize=True, return_dict=False))
    for k in range(1, 3):
        previous = prompts[k - 1] + tuple(calls[k - 1].output_ids)
        assert prompts[k][: len(previous)] == previous
        assert calls[k].extends_call == k - 1 and calls[k].shared_tokens == len(previous)
    assert len(build_tree(calls).trajectories()) == 1


@pytest.mark.parametrize("proxy", [("qwen3", KEEP_GENERATED)], indirect=True)
def test_an_answer_ended_by_another_stop_token_keeps_one_turn_end(proxy: Proxy, hf_tokenizers: dict[str, Any]) -> None:
    """The model ended its turn with <|endoftext|> where the template writes <|im_end|>: the generated ids stay, and
    the generated turn end stands for the template's (not both)."""
    tokenizer = hf_tokenizers["qwen3"]
    client = openai.OpenAI(base_url=proxy.served.base_url + "/v1", api_key=proxy.key("eot"), max_retries=0)
    proxy.backend.stop_id = proxy.template.end_of_text_id
    proxy.backend.script += ["First answer.", "Second."]
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Go."}]
    answer = client.chat.completions.create(model="m", messages=messages)
    assert answer.choices[0].message.content == "First answer."
    messages += [{"role": "assistant", "content": "First answer."}, {"role": "user", "content": "More."}]
    client.chat.completions.create(model="m", messages=messages)
    first, second = proxy.prompts
    output = proxy.calls[0].output_ids
    assert output[-1] == proxy.template.end_of_text_id
    text = hf_text(tokenizer, messages, None)
    after = text[text.rindex("First answer.<|im_end|>") + len("First answer.<|im_end|>"):]
    assert second == first + output + tuple(hf_ids(tokenizer, after))


@pytest.mark.parametrize("proxy", [("qwen3", KEEP_GENERATED)], indirect=True)
def test_a_main_agent_and_a_sub_agent_interleaved(proxy: Proxy, hf_tokenizers: dict[str, Any]) -> None:
    """Two conversations of one execution (other system texts), their calls interleaved: each call extends the
    previous call of its own conversation, and each prompt is its conversation's template render."""
    tokenizer = hf_tokenizers["qwen3"]
    client = openai.OpenAI(base_url=proxy.served.base_url + "/v1", api_key=proxy.key("agents"), max_retries=0)
    conversations: dict[str, list[dict[str, Any]]] = {
        "main": [{"role": "system", "content": "You lead."}, {"role": "user", "content": "Plan."}],
        "sub": [{"role": "system", "content": "You search."}, {"role": "user", "content": "Find x."}],
    }
    order = ["main", "sub", "main", "sub", "sub", "main"]
    sent = []
    for index, agent in enumerate(order):
        messages = conversations[agent]
        sent.append((agent, json.loads(json.dumps(messages))))
        proxy.backend.script.append(f"{agent} answer {index}.\n" + tool_answer(f"{agent} {index}"))
        message = client.chat.completions.create(model="m", messages=messages, tools=TOOLS).choices[0].message
        messages += [message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": f"done {index}"}]
    for k, (agent, messages) in enumerate(sent):
        earlier = [j for j in range(k) if sent[j][0] == agent]
        text = hf_text(tokenizer, messages, TOOLS)
        assert proxy.prompts[k] == substituted(tokenizer, text, [generated_turns(proxy, k)[j] for j in earlier])
        if earlier:
            j = earlier[-1]
            assert proxy.calls[k].extends_call == j
            assert proxy.calls[k].shared_tokens == len(proxy.prompts[j]) + len(proxy.calls[j].output_ids)
