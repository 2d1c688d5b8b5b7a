"""SFT on a checkpoint's own chat template (engines/sft.py): the whole conversation is rendered through the template
and exactly the tokens the model would generate in its assistant turns carry loss.

The templates are the test templates of tests/unit/engines/test_hf_templates.py (Qwen3-style: tools as JSON,
`<tool_call>` JSON, tool results grouped in a user turn, `<think>` dropped from assistant turns before the last user
message; Llama-style: BOS, role headers, a default system prompt) plus the Llama-style one with transformers'
`{% generation %}` marks around what the assistant generates. Oracles: transformers' apply_chat_template (its text
of each turn, its ids, and on the marked template its own assistant mask), and the proxy's sessions playing the
conversation out as a rollout (keep_generated): SFT trains exactly the prompt and outputs that rollout records.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest

from gyre.actors.serving.sessions import KEEP_GENERATED, ProxySessions, ProxySessionsConfig, turn_key
from gyre.engines.chat_template import CHAT_TEMPLATE, ChatTemplate
from gyre.engines.errors import SFTError
from gyre.engines.sft import SFTConfig, run_sft, tokenize_demonstration, tokenize_pieces, tokenize_rendered

_spec = importlib.util.spec_from_file_location(
    "hf_templates", Path(__file__).parents[2] / "unit" / "engines" / "test_hf_templates.py"
)
hf_templates = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(hf_templates)

TOOLS = hf_templates.TOOLS
call = hf_templates.call

# The Llama-style template with transformers' marks around what the assistant generates (its text and turn end).
LLAMA_MARKED = hf_templates.LLAMA_STYLE.replace(
    """        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
        {%- for call in message.tool_calls %}
            {{- '{"name": "' + call.function.name + '", "parameters": ' + call.function.arguments | tojson + '}' }}
        {%- endfor %}
        {{- '<|eot_id|>' }}""",
    """        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
        {%- generation %}
        {%- for call in message.tool_calls %}
            {{- '{"name": "' + call.function.name + '", "parameters": ' + call.function.arguments | tojson + '}' }}
        {%- endfor %}
        {{- '<|eot_id|>' }}
        {%- endgeneration %}""",
).replace(
    """    {%- else %}
        {{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' + message.content | trim + '<|eot_id|>' }}""",
    """    {%- elif message.role == 'assistant' %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
        {%- generation %}{{- message.content | trim + '<|eot_id|>' }}{%- endgeneration %}
    {%- else %}
        {{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' + message.content | trim + '<|eot_id|>' }}""",
)
assert LLAMA_MARKED.count("generation %}") == 4

QWEN3_CONVERSATION = [
    *hf_templates.CONVERSATIONS["tool_loop_with_thinking"],
    {"role": "user", "content": "Thanks. Why float?"},
    {"role": "assistant", "content": "<think>\nExplain briefly.\n</think>\n\nfloat() parses decimals."},
]
LLAMA_CONVERSATION = [  # no system message: the template writes its default one
    {"role": "user", "content": "List the files."},
    {"role": "assistant", "content": "", "tool_calls": [call("run", '{"cmd": "ls"}')]},
    {"role": "tool", "content": "a.py b.py"},
    {"role": "assistant", "content": "Two files: a.py and b.py."},
    {"role": "user", "content": "Thanks ✓"},
    {"role": "assistant", "content": "You are welcome."},
]


@pytest.fixture(scope="module")
def template_dirs(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    dirs = hf_templates.write_template_dirs(tiny_model_dir, tmp_path_factory.mktemp("sft-templates"))
    marked = hf_templates.write_template_dirs(tiny_model_dir, tmp_path_factory.mktemp("sft-marked"))["llama"]
    config = json.loads((marked / "tokenizer_config.json").read_text())
    config["chat_template"] = LLAMA_MARKED
    (marked / "tokenizer_config.json").write_text(json.dumps(config))
    return {**dirs, "llama-marked": marked}


def hf_tokenizer(model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def spans(mask: tuple[bool, ...]) -> list[tuple[int, int]]:
    """The [start, end) runs of True in `mask`."""
    found, start = [], None
    for i, bit in enumerate((*mask, False)):
        if bit and start is None:
            start = i
        elif not bit and start is not None:
            found.append((start, i))
            start = None
    return found


def generated_text(tokenizer: Any, messages: list[dict[str, Any]], k: int, tools: Any, stop: str) -> str:
    """transformers' text of what assistant message k generates: its render as the newest message after the
    generation prompt, through the first turn end."""
    prompt = tokenizer.apply_chat_template(messages[:k], tools=tools, add_generation_prompt=True, tokenize=False)
    turn = tokenizer.apply_chat_template(messages[: k + 1], tools=tools, add_generation_prompt=False, tokenize=False)
    assert turn.startswith(prompt)
    text = turn[len(prompt) :]
    return text[: text.index(stop) + len(stop)]


def play_through_the_proxy(template: ChatTemplate, messages: list[dict[str, Any]], tools: Any,
                           outputs: list[tuple[int, ...]]) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The conversation as a rollout through the proxy's sessions (keep_generated): each assistant turn is a call
    whose output is the given ids; the (prompt ids, output ids) of every call."""
    sessions = ProxySessions(template, ProxySessionsConfig(earlier_turns=KEEP_GENERATED))
    session = sessions.authenticate(sessions.issue_key("demo", "group"))
    system_text = messages[0]["content"] if messages[0]["role"] == "system" else None
    rest = messages[1:] if system_text is not None else messages
    calls = []
    for index, k in enumerate(i for i, m in enumerate(rest) if m["role"] == "assistant"):
        rendered = session.render(rest[:k], tools, system_text)
        answer = rest[k]
        key = turn_key(answer.get("content"), [(c["function"]["name"], c["function"]["arguments"])
                                               for c in answer.get("tool_calls") or ()])
        session.record_turn(key, rendered.prompt_digest, outputs[index], rendered)
        session.note_call(rendered, index, outputs[index])
        calls.append((tuple(rendered.prompt_ids), outputs[index]))
    return calls


def check_it_is_the_rollout(template: ChatTemplate, messages: list[dict[str, Any]], tools: Any, example) -> None:
    outputs = [example.token_ids[a:b] for a, b in spans(example.loss_mask)]
    calls = play_through_the_proxy(template, messages, tools, outputs)
    prompt, output = calls[-1]
    assert prompt + output == example.token_ids  # one path: the last call's prompt holds every earlier turn
    for (prompt, output), (start, end) in zip(calls, spans(example.loss_mask)):
        assert (len(prompt), len(prompt) + len(output)) == (start, end)  # each call's output, and only that, trains


def test_a_template_that_drops_earlier_thinking_trains_each_turn_as_it_was_generated(template_dirs):
    template = ChatTemplate.from_model_dir(template_dirs["qwen3"])
    tokenizer = hf_tokenizer(template_dirs["qwen3"])
    messages = QWEN3_CONVERSATION
    example = tokenize_demonstration(template, messages, TOOLS)
    turns = [k for k, m in enumerate(messages) if m["role"] == "assistant"]
    found = spans(example.loss_mask)
    assert len(found) == len(turns) == 4
    for (start, end), k in zip(found, turns):
        # Each target is what transformers renders for that turn as the newest message, through <|im_end|>, in
        # the tokenizer's own ids; the earlier thinking included.
        text = generated_text(tokenizer, messages, k, TOOLS, "<|im_end|>")
        assert template.decode(example.token_ids[start:end]) == text
        assert list(example.token_ids[start:end]) == tokenizer.encode(text, add_special_tokens=False)
    # The first prompt is apply_chat_template's, token for token.
    assert list(example.token_ids[: found[0][0]]) == tokenizer.apply_chat_template(
        messages[: turns[0]], tools=TOOLS, add_generation_prompt=True, tokenize=True, return_dict=False)
    # The template's own render of the whole conversation drops the first turns' thinking; what is trained keeps
    # it where it was generated.
    whole = tokenizer.apply_chat_template(messages, tools=TOOLS, tokenize=False)
    assert "Look at the file first." not in whole and "int() of ' 3' works" not in whole
    trained = template.decode(example.token_ids)
    assert "Look at the file first." in trained and "int() of ' 3' works" in trained
    check_it_is_the_rollout(template, messages, TOOLS, example)


@pytest.mark.parametrize("name", ["llama", "llama-marked"])
def test_a_prefix_stable_template_trains_its_assistant_tokens_exactly(template_dirs, name):
    template = ChatTemplate.from_model_dir(template_dirs[name])
    tokenizer = hf_tokenizer(template_dirs[name])
    for tools in (None, TOOLS):
        example = tokenize_demonstration(template, LLAMA_CONVERSATION, tools)
        # A template that never re-renders a turn: the sequence is apply_chat_template's, id for id (its default
        # system prompt and BOS included).
        oracle = tokenizer.apply_chat_template(LLAMA_CONVERSATION, tools=tools, tokenize=True, return_dict=True,
                                               return_assistant_tokens_mask=(name == "llama-marked"))
        assert list(example.token_ids) == list(oracle["input_ids"])
        assert template.decode(example.token_ids).startswith("<|endoftext|><|start_header_id|>system")
        if name == "llama-marked":
            # transformers' own mask from the template's {% generation %} marks.
            assert [bool(b) for b in oracle["assistant_masks"]] == list(example.loss_mask)
        targets = [template.decode(example.token_ids[a:b]) for a, b in spans(example.loss_mask)]
        assert targets == ['{"name": "run", "parameters": "{\\"cmd\\": \\"ls\\"}"}<|eot_id|>',
                           "Two files: a.py and b.py.<|eot_id|>", "You are welcome.<|eot_id|>"]
        check_it_is_the_rollout(template, LLAMA_CONVERSATION, tools, example)


def test_gyres_own_template_gives_the_same_through_the_template_as_piece_by_piece(chat_template):
    assert chat_template.source == CHAT_TEMPLATE
    conversations = [
        (QWEN3_CONVERSATION, TOOLS),
        (LLAMA_CONVERSATION, None),
        ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
          {"role": "assistant", "content": "hello"}, {"role": "user", "content": "bye"}], None),
    ]
    for messages, tools in conversations:
        pieces = tokenize_pieces(chat_template, messages, tools)
        rendered = tokenize_rendered(chat_template, messages, tools)
        # The same ids and targets; piece by piece also carries the newline after the last turn end and any
        # messages after the last assistant turn, none of them a target.
        n = len(rendered.token_ids)
        assert pieces.token_ids[:n] == rendered.token_ids and pieces.loss_mask[:n] == rendered.loss_mask
        assert not any(pieces.loss_mask[n:])
        assert tokenize_demonstration(chat_template, messages, tools) == pieces  # Gyre's template: piece by piece


def test_demonstrations_and_templates_that_cannot_show_what_is_generated_are_refused(template_dirs, tmp_path):
    template = ChatTemplate.from_model_dir(template_dirs["qwen3"])
    with pytest.raises(SFTError, match="without assistant turns"):
        tokenize_rendered(template, [{"role": "user", "content": "hi"}], None)
    with pytest.raises(SFTError, match="cannot render"):
        tokenize_rendered(template, [{"role": "user", "content": "hi"}, {"role": "robot", "content": "x"},
                                     {"role": "assistant", "content": "y"}], None)

    def with_template(source: str) -> ChatTemplate:
        path = tmp_path / str(abs(hash(source)))
        path.mkdir()
        for f in ("tokenizer.json", "tokenizer_config.json"):
            (path / f).write_bytes((template_dirs["qwen3"] / f).read_bytes())
        config = json.loads((path / "tokenizer_config.json").read_text())
        config["chat_template"] = source
        (path / "tokenizer_config.json").write_text(json.dumps(config))
        return ChatTemplate.from_model_dir(path)

    body = ("{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + CONTENT + END }}{%- endfor %}"
            "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
    demo = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
            {"role": "user", "content": "and?"}, {"role": "assistant", "content": "done"}]
    no_turn_end = with_template(body.replace("CONTENT", "m.content").replace("END", "'\\n\\n'"))
    with pytest.raises(SFTError, match="none of the stop tokens"):
        tokenize_rendered(no_turn_end, demo, None)
    rewrites = with_template(body.replace("CONTENT", "(m.content | upper)").replace("END", "'<|im_end|>\\n'"))
    with pytest.raises(SFTError, match="rewrites assistant content"):
        tokenize_rendered(rewrites, demo, None)
    own_prompt = with_template(body.replace("CONTENT", "m.content").replace("END", "'<|im_end|>\\n'").replace(
        "'<|im_start|>assistant\\n' }}", "'<|im_start|>assistant\\n<think>\\n' }}"))
    with pytest.raises(SFTError, match="not render it after its generation prompt"):
        tokenize_rendered(own_prompt, demo, None)


def test_sft_fine_tunes_a_checkpoint_with_its_own_template(template_dirs, tiny_model_dir, tmp_path):
    import shutil

    base = Path(shutil.copytree(template_dirs["qwen3"], tmp_path / "base"))
    shutil.copy(tiny_model_dir / "model.safetensors", base / "model.safetensors")
    demos = [(QWEN3_CONVERSATION, TOOLS), (hf_templates.CONVERSATIONS["no_system_two_turns"][:2], None)]
    template = ChatTemplate.from_model_dir(base)
    targets = sum(sum(tokenize_demonstration(template, m, t).loss_mask) for m, t in demos)
    result = run_sft(base, demos, tmp_path / "out", SFTConfig(epochs=3, lr=5e-4, num_threads=2))
    assert (result.examples, result.steps, result.target_tokens) == (2, 3, targets)
    assert result.last_loss < result.first_loss, result
