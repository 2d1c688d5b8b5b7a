"""Checkpoints' own chat templates render token-exactly as transformers' apply_chat_template (the oracle).

The templates are written for these tests with the traits of the common ones: Qwen3-style (tools as JSON in the
system turn, `<tool_call>` JSON in assistant turns, tool results grouped in a user turn, `<think>` blocks dropped
from assistant turns before the last user message, an `enable_thinking` switch), and Llama-style (a
`{{ bos_token }}` opening, role headers, a default system prompt when none is given, `ipython` tool results).
Both run over the tiny tokenizer, so every piece of markup is tokenized for real.
"""

from __future__ import annotations

import json
import shutil

import pytest

from gyre.engines.chat_template import ChatTemplate, ChatTemplateError

QWEN3_STYLE = r"""
{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}{{- messages[0].content + '\n\n' }}{%- endif %}
    {{- "# Tools\n<tools>" }}
    {%- for tool in tools %}{{- "\n" }}{{- tool | tojson }}{%- endfor %}
    {{- "\n</tools><|im_end|>\n" }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- set ns = namespace(last_query=-1) %}
{%- for message in messages %}
    {%- if message.role == 'user' %}{%- set ns.last_query = loop.index0 %}{%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
    {%- elif message.role == 'assistant' %}
        {%- set content = message.content or '' %}
        {%- if '</think>' in content %}
            {%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\n') %}
        {%- else %}
            {%- set reasoning = '' %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query and reasoning %}
            {{- '<|im_start|>assistant\n<think>\n' + reasoning + '\n</think>\n\n' + content }}
        {%- else %}
            {{- '<|im_start|>assistant\n' + content }}
        {%- endif %}
        {%- for call in message.tool_calls or [] %}
            {%- if call.function %}{%- set call = call.function %}{%- endif %}
            {%- if loop.first and content %}{{- '\n' }}{%- elif not loop.first %}{{- '\n' }}{%- endif %}
            {{- '<tool_call>\n{"name": "' + call.name + '", "arguments": ' }}
            {%- if call.arguments is string %}{{- call.arguments }}{%- else %}{{- call.arguments | tojson }}{%- endif %}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
        {{- '\n<tool_response>\n' + message.content + '\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\n\n</think>\n\n' }}{%- endif %}
{%- endif %}
"""

LLAMA_STYLE = r"""
{{- bos_token }}
{%- if messages[0].role == 'system' %}
    {%- set system = messages[0].content | trim %}{%- set messages = messages[1:] %}
{%- else %}
    {%- set system = 'You are a helpful assistant.' %}
{%- endif %}
{{- '<|start_header_id|>system<|end_header_id|>\n\n' + system }}
{%- if tools %}{{- '\n\nYou can call these functions:\n' }}{%- for t in tools %}{{- t | tojson(indent=4) + '\n' }}{%- endfor %}{%- endif %}
{{- '<|eot_id|>' }}
{%- for message in messages %}
    {%- if message.role == 'tool' %}
        {{- '<|start_header_id|>ipython<|end_header_id|>\n\n' + message.content | trim + '<|eot_id|>' }}
    {%- elif message.tool_calls %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
        {%- for call in message.tool_calls %}
            {{- '{"name": "' + call.function.name + '", "parameters": ' + call.function.arguments | tojson + '}' }}
        {%- endfor %}
        {{- '<|eot_id|>' }}
    {%- else %}
        {{- '<|start_header_id|>' + message.role + '<|end_header_id|>\n\n' + message.content | trim + '<|eot_id|>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif %}
"""

TOOLS = [{"type": "function", "function": {"name": "run", "description": "Run a shell command.",
                                           "parameters": {"type": "object", "properties": {
                                               "cmd": {"type": "string", "description": "the command"}}}}}]


def call(name: str, arguments: dict) -> dict:
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


CONVERSATIONS = {
    "tool_loop_with_thinking": [
        {"role": "system", "content": "You fix bugs."},
        {"role": "user", "content": "Tests fail in parser.py; fix them."},
        {"role": "assistant", "content": "<think>\nLook at the file first.\n</think>\n\nLet me look.",
         "tool_calls": [call("run", {"cmd": "cat parser.py"})]},
        {"role": "tool", "content": "def parse(x):\n    return int(x)"},
        {"role": "assistant", "content": "", "tool_calls": [call("run", {"cmd": "pytest -q"}),
                                                             call("run", {"cmd": "git diff"})]},
        {"role": "tool", "content": "1 failed"},
        {"role": "tool", "content": "(no diff)"},
        {"role": "user", "content": "Still failing? Ünïcödé ✓"},
        {"role": "assistant", "content": "<think>\nint() of ' 3' works; '3.0' does not.\n</think>\n\nUse float."},
    ],
    "no_system_two_turns": [
        {"role": "user", "content": "  hi  "},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "what is 2+2?"},
    ],
}


LLAMA_SPECIAL_TOKENS = ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>")


def write_template_dirs(tiny_model_dir, root) -> dict:
    """Model directories with the tiny tokenizer and each test template: the Llama-style one's markup is added to
    the tokenizer as special tokens (as in Llama 3), its eos_token is `<|eot_id|>` (generation_config.json:
    `<|eom_id|>` and `<|eot_id|>`) and its bos_token the tiny tokenizer's `<|endoftext|>`. Used by the proxy's template tests too (tests/integration/actors/serving)."""
    from tokenizers import AddedToken, Tokenizer

    dirs = {}
    for name, source in {"qwen3": QWEN3_STYLE, "llama": LLAMA_STYLE}.items():
        path = root / f"template-{name}"
        path.mkdir(parents=True, exist_ok=True)
        for f in ("tokenizer.json", "tokenizer_config.json", "config.json"):
            shutil.copy(tiny_model_dir / f, path / f)
        config = json.loads((path / "tokenizer_config.json").read_text())
        config["chat_template"] = source
        config["bos_token"] = "<|endoftext|>"  # the Llama-style template opens with it
        if name == "llama":
            tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
            tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in LLAMA_SPECIAL_TOKENS])
            tokenizer.save(str(path / "tokenizer.json"))
            for token in LLAMA_SPECIAL_TOKENS:
                config["added_tokens_decoder"][str(tokenizer.token_to_id(token))] = {
                    "content": token, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                    "special": True}
            config["eos_token"] = "<|eot_id|>"
            generation = {"eos_token_id": [tokenizer.token_to_id("<|eom_id|>"), tokenizer.token_to_id("<|eot_id|>")]}
            (path / "generation_config.json").write_text(json.dumps(generation))
        (path / "tokenizer_config.json").write_text(json.dumps(config))
        dirs[name] = path
    return dirs


@pytest.fixture(scope="module")
def template_dirs(tiny_model_dir, tmp_path_factory):
    return write_template_dirs(tiny_model_dir, tmp_path_factory.mktemp("templates"))


def oracle_ids(model_dir, messages, tools, add_generation_prompt, **kwargs) -> list[int]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    text = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                         tokenize=False, **kwargs)
    ids = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                        tokenize=True, return_dict=False, **kwargs)
    return text, list(ids)


@pytest.mark.parametrize("template", ["qwen3", "llama"])
@pytest.mark.parametrize("conversation", sorted(CONVERSATIONS))
@pytest.mark.parametrize("with_tools", [False, True])
@pytest.mark.parametrize("add_generation_prompt", [False, True])
def test_renders_as_transformers(template_dirs, template, conversation, with_tools, add_generation_prompt):
    messages = CONVERSATIONS[conversation]
    tools = TOOLS if with_tools else None
    text, ids = oracle_ids(template_dirs[template], messages, tools, add_generation_prompt)
    chat = ChatTemplate.from_model_dir(template_dirs[template])
    assert chat.render_text(messages, tools, add_generation_prompt) == text
    assert chat.render_ids(messages, tools, add_generation_prompt) == ids


def test_template_variables_reach_the_template(template_dirs):
    messages = CONVERSATIONS["no_system_two_turns"]
    chat = ChatTemplate.from_model_dir(template_dirs["qwen3"])
    text, ids = oracle_ids(template_dirs["qwen3"], messages, None, True, enable_thinking=False)
    assert text.endswith("<think>\n\n</think>\n\n")
    assert chat.render_ids(messages, None, True, enable_thinking=False) == ids
    llama = ChatTemplate.from_model_dir(template_dirs["llama"])
    assert llama.render_text(messages, None, True).startswith("<|endoftext|><|start_header_id|>system")


def test_a_template_that_drops_earlier_thinking_is_not_prefix_stable(template_dirs):
    """Why the proxy cannot build a Qwen3-style conversation by appending per-turn renders: the last assistant
    turn's `<think>` block is kept while it follows the last user message and dropped once a new user message
    arrives, so the earlier render is not a prefix of the later one. (So the proxy renders such templates whole;
    what it does with the dropped thinking is ProxySessionsConfig.earlier_turns, tested in
    tests/integration/actors/serving/test_model_templates.py.)"""
    chat = ChatTemplate.from_model_dir(template_dirs["qwen3"])
    turns = CONVERSATIONS["tool_loop_with_thinking"]
    before = chat.render_ids(turns, None, add_generation_prompt=False)
    after = chat.render_ids([*turns, {"role": "user", "content": "thanks"}], None, add_generation_prompt=True)
    assert after[: len(before)] != before
    assert "<think>" in chat.render_text(turns, None, False).split("Ünïcödé")[-1]
    assert "<think>" not in chat.render_text([*turns, {"role": "user", "content": "x"}], None, False).split(
        "Ünïcödé")[-1]


def test_a_checkpoints_template_is_not_decomposable_and_stops_on_its_eos(template_dirs, chat_template):
    qwen3 = ChatTemplate.from_model_dir(template_dirs["qwen3"])
    llama = ChatTemplate.from_model_dir(template_dirs["llama"])
    assert chat_template.decomposable and not qwen3.decomposable and not llama.decomposable
    eot = llama.tokenizer.token_to_id("<|eot_id|>")
    eom = llama.tokenizer.token_to_id("<|eom_id|>")
    assert eot in llama.stop_token_ids and llama.stop_text(eot) == "<|eot_id|>"
    assert eom in llama.stop_token_ids and llama.stop_text(eom) == "<|eom_id|>"
    assert qwen3.stop_token_ids == chat_template.stop_token_ids  # <|im_end|>, <|endoftext|>: its eos is <|im_end|>
    assert qwen3.splits_at_special_tokens and llama.splits_at_special_tokens
    with pytest.raises(ChatTemplateError, match="not decomposable"):  # per-piece renders are not its render
        qwen3.conversation_ids(CONVERSATIONS["tool_loop_with_thinking"], TOOLS)
    text = llama.render_text(CONVERSATIONS["no_system_two_turns"], TOOLS, True)
    ids, cuts = llama.encode_with_cuts(text)
    assert ids == llama.render_ids(CONVERSATIONS["no_system_two_turns"], TOOLS, True)
    assert cuts and all(ids[i - 1] in llama._special_ids for _, i in cuts)
    for chars, tokens in cuts:  # a cut after a special token tokenises as the whole
        assert llama.encode(text[:chars]) + llama.encode(text[chars:]) == ids
        assert llama.encode(text[:chars]) == ids[:tokens]
