"""The chat template: per-message rendering concatenates to transformers' apply_chat_template, token for token,
and generated assistant ids can be reused verbatim."""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from gyre.engines.chat_template import CHAT_TEMPLATE, ChatTemplate
from gyre.engines.errors import ChatTemplateError

TOOLS = [
    {"type": "function", "function": {"name": "calculator", "description": "Evaluate an arithmetic expression.",
                                      "parameters": {"type": "object",
                                                     "properties": {"expression": {"type": "string"}},
                                                     "required": ["expression"]}}},
    {"type": "function", "function": {"name": "read_file", "description": "Read a file.",
                                      "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}},
]


@pytest.fixture(scope="module")
def hf_tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def hf_ids(tok, messages, tools=None, add_generation_prompt=True) -> list[int]:
    out = tok.apply_chat_template(messages, tools=tools, tokenize=True, add_generation_prompt=add_generation_prompt)
    ids = out["input_ids"] if hasattr(out, "keys") else out  # transformers 5 returns a BatchEncoding
    return list(ids)


def call(name, arguments, call_id="call_0"):
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


# Text that stresses boundaries: whitespace at the edges, newlines, unicode, JSON, and markup strings.
_fragments = st.sampled_from(
    ["", " ", "\n", "\n\n", "  x", "12 + 7", "Ünïcode ✓", "中文", '{"k": [1, 2]}', "<tool_call>",
     "</tool_response>", "<|im_end|>", "path/to/file.py", "\t", "'quoted'", "end."]
)
texts = st.lists(st.one_of(_fragments, st.text(max_size=12)), max_size=5).map("".join)
json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-1000, 1000), st.text(max_size=8)),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=5), inner, max_size=3)),
    max_leaves=6,
)
arguments = st.dictionaries(st.text(min_size=1, max_size=6), json_values, max_size=3).flatmap(
    lambda args: st.sampled_from([args, json.dumps(args, ensure_ascii=False), json.dumps(args)])
)
tool_calls = st.lists(st.builds(call, st.sampled_from(["calculator", "read_file", "ünï"]), arguments), max_size=3)
messages = st.one_of(
    st.builds(lambda c: {"role": "user", "content": c}, texts),
    st.builds(lambda c, t: {"role": "assistant", "content": c, "tool_calls": t} if t else
              {"role": "assistant", "content": c}, st.one_of(texts, st.none()), tool_calls),
    st.builds(lambda c: {"role": "tool", "tool_call_id": "call_0", "content": c}, texts),
)
conversations = st.tuples(
    st.one_of(st.none(), texts),
    st.lists(messages, min_size=1, max_size=6),
    st.sampled_from([None, TOOLS[:1], TOOLS]),
    st.booleans(),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(conversations)
@example((None, [{"role": "assistant", "content": "\n"}], None, False))
@example(("", [{"role": "user", "content": " \n x"}, {"role": "assistant", "content": None,
                                                       "tool_calls": [call("f", {"a": "\n"})]}], TOOLS, True))
def test_pieces_concatenate_to_transformers(chat_template, hf_tokenizer, conversation):
    system, body, tools, add_generation_prompt = conversation
    msgs = ([{"role": "system", "content": system}] if system is not None else []) + body
    whole = chat_template.render_ids(msgs, tools, add_generation_prompt)
    assert whole == hf_ids(hf_tokenizer, msgs, tools, add_generation_prompt)
    pieces = chat_template.conversation_ids(msgs, tools, add_generation_prompt)
    assert sum(pieces, []) == whole
    assert pieces[0] == chat_template.system_ids(tools, system)
    for message, piece in zip(body, pieces[1:]):
        assert piece == chat_template.message_ids(message)
        assert piece[0] == chat_template.im_start_id
        if message["role"] == "assistant":
            header = chat_template.assistant_header_ids()
            if piece[: len(header)] != header:
                # BPE merges the header's "\n" with leading whitespace that reaches a newline: such a turn, when
                # rendered from text, does not split at the header (the proxy reuses generated ids instead).
                assert re.match(r"\s*[\r\n]", message.get("content") or "")
                continue
            output = chat_template.assistant_body_ids(piece)
            assert output[-1] == chat_template.im_end_id
            assert chat_template.assistant_turn_ids(output) == piece


def test_layout_of_a_tool_using_conversation(chat_template, hf_tokenizer):
    msgs = [
        {"role": "user", "content": "What is 12 * 7?"},
        {"role": "assistant", "content": None, "tool_calls": [call("calculator", '{"expression": "12 * 7"}')]},
        {"role": "tool", "tool_call_id": "call_0", "content": "84"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            call("calculator", {"expression": "84"}), call("read_file", {"path": "ä.txt"})]},
        {"role": "assistant", "content": "84"},
    ]
    text = chat_template.render_text(msgs, TOOLS, add_generation_prompt=False)
    assert text == hf_tokenizer.apply_chat_template(msgs, tools=TOOLS, tokenize=False)
    assert text.startswith("<|im_start|>system\nTools:\n")
    function = TOOLS[0].get("function", TOOLS[0])
    signature = f"{function['name']}({', '.join(function['parameters']['properties'])})"
    assert f"\n{signature}" in text  # one compact line per tool
    assert ("<|im_start|>assistant\n<tool_call>\n{\"name\": \"calculator\", \"arguments\": {\"expression\": "
            "\"12 * 7\"}}\n</tool_call><|im_end|>\n") in text
    assert "<|im_start|>tool\n<tool_response>\n84\n</tool_response><|im_end|>\n" in text
    assert ('Checking.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "84"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "read_file", "arguments": {"path": "ä.txt"}}\n</tool_call><|im_end|>') in text
    assert text.endswith("<|im_start|>assistant\n84<|im_end|>\n")


def test_system_without_tools_and_empty_system(chat_template):
    assert chat_template.system_ids(None, None) == []
    system = chat_template.decode(chat_template.system_ids(None, "Be brief."))
    assert system == "<|im_start|>system\nBe brief.<|im_end|>\n"
    with_tools = chat_template.decode(chat_template.system_ids(TOOLS, "Be brief."))
    assert with_tools.startswith("<|im_start|>system\nBe brief.\n\nTools:")


def test_header_trailer_and_stop_tokens(chat_template):
    assert chat_template.decode(chat_template.assistant_header_ids()) == "<|im_start|>assistant\n"
    assert chat_template.generation_prompt_ids() == chat_template.assistant_header_ids()
    assert chat_template.decode(chat_template.assistant_trailer_ids()) == "\n"
    assert chat_template.stop_token_ids == (chat_template.im_end_id, chat_template.end_of_text_id)


def test_generated_ids_are_reused_verbatim(chat_template):
    """A model may emit a non-canonical tokenization; the proxy keeps it, and the text is still the same turn."""
    text = 'Sure.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "3 + 4"}}\n</tool_call>'
    canonical = chat_template.encode(text)
    # Spell the plain-text parts one character at a time: valid ids, not what encode() would give.
    odd = []
    for token_id in canonical:
        piece = chat_template.decode([token_id])
        odd.extend(chat_template.encode(piece) if piece.startswith("<") else
                   [i for ch in piece for i in chat_template.encode(ch)])
    assert odd != canonical and chat_template.decode(odd) == text
    output = odd + [chat_template.im_end_id]
    user = {"role": "user", "content": "What is 3 + 4?"}
    tool = {"role": "tool", "tool_call_id": "c", "content": "7"}
    prompt = chat_template.message_ids(user) + chat_template.generation_prompt_ids()
    next_prompt = prompt + output + chat_template.assistant_trailer_ids() + chat_template.message_ids(tool)
    assistant = {"role": "assistant", "content": "Sure.", "tool_calls": [call("calculator", '{"expression": "3 + 4"}')]}
    rendered = chat_template.render_ids([user, assistant, tool], add_generation_prompt=False)
    assert chat_template.decode(next_prompt) == chat_template.decode(rendered)
    assert next_prompt[: len(prompt)] == prompt  # the prefix the engine already cached stays a prefix
    # The canonical output reproduces the rendered ids exactly.
    canonical_prompt = (prompt + canonical + [chat_template.im_end_id] + chat_template.assistant_trailer_ids()
                        + chat_template.message_ids(tool))
    assert canonical_prompt == rendered


def test_cut_short_output_gets_its_turn_end(chat_template):
    body = chat_template.encode("partial answer")
    turn = chat_template.assistant_turn_ids(body)
    assert turn == chat_template.message_ids({"role": "assistant", "content": "partial answer"})
    eot = chat_template.assistant_turn_ids(body + [chat_template.end_of_text_id])
    assert eot == turn


UPPER_TEMPLATE = (
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n"
    "{{ (m.content | upper) if m.role == 'assistant' else m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_the_text_after_a_turn_is_read_through_a_marker_in_its_place(chat_template):
    """What the proxy's keep_generated rule and SFT both put after a generated turn (ChatTemplate.turn_text_after)."""
    user, answer = {"role": "user", "content": "2 + 2?"}, {"role": "assistant", "content": "4"}
    messages = [user, answer, {"role": "user", "content": "And 3 + 3?"}]
    after = chat_template.turn_text_after(messages, 1, marker="gyre-m-1")
    assert after == "<|im_end|>\n<|im_start|>user\nAnd 3 + 3?<|im_end|>\n<|im_start|>assistant\n"
    assert chat_template.render_text(messages) == chat_template.render_text([user]) + "4" + after
    # A generated stop token, whichever it is, stands for the template's turn end; an output cut short (its last
    # token no stop token) keeps the template's.
    for stop in chat_template.stop_token_ids:
        assert chat_template.turn_text_after(messages, 1, marker="gyre-m-1", stop_id=stop) == after[len("<|im_end|>"):]
    four = chat_template.encode("4")[-1]
    assert chat_template.turn_text_after(messages, 1, marker="gyre-m-1", stop_id=four) == after
    # The marker must be in the render once: not where the conversation holds it too, nor where the template
    # rewrites assistant content.
    echoed = [*messages, {"role": "assistant", "content": "x"}, {"role": "user", "content": "gyre-m-1"}]
    assert chat_template.turn_text_after(echoed, 1, marker="gyre-m-1") is None
    upper = ChatTemplate(chat_template.tokenizer, source=UPPER_TEMPLATE)
    assert upper.turn_text_after(messages, 1, marker="gyre-m-1") is None
    assert upper.turn_text_after(messages, 1, marker="GYRE-M-1") == after


@pytest.mark.parametrize(
    "bad",
    [
        {"role": "robot", "content": "x"},
        {"role": "user", "content": [{"type": "text", "text": "x"}]},
        {"role": "user", "content": "x", "tool_calls": [call("f", "{}")]},
        {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"arguments": "{}"}}]},
        {"role": "assistant", "content": "", "tool_calls": [call("f", 3)]},
        "not a dict",
    ],
)
def test_bad_messages_raise(chat_template, bad):
    with pytest.raises(ChatTemplateError):
        chat_template.message_ids(bad)


def test_directory_without_tokenizer_raises(bare_model_dir):
    with pytest.raises(ChatTemplateError):
        ChatTemplate.from_model_dir(bare_model_dir)


def test_template_is_the_one_in_the_model_dir(tiny_model_dir, chat_template):
    assert json.loads((tiny_model_dir / "tokenizer_config.json").read_text())["chat_template"] == CHAT_TEMPLATE
    assert chat_template.source == CHAT_TEMPLATE


# -- the pure-Python fast path agrees with the Jinja template ---------------------------------------------------

# Beyond the common shapes: unicode (incl. astral and combining characters), markup, odd tool specs, None
# descriptions, tool calls without the "function" wrapper, and shapes the fast path must hand to Jinja.
_unusual_texts = st.one_of(texts, st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=30),
                           st.sampled_from(["😀 e\u0301", "\r\n", "{{ x }}", "{% raw %}", "\x00"]))
_tool_specs = st.one_of(
    st.sampled_from(TOOLS),
    st.builds(
        lambda name, description, properties, wrapped: (
            {"type": "function", "function": {"name": name, **description, **properties}} if wrapped
            else {"name": name, **description, **properties}),
        st.text(min_size=1, max_size=8),
        st.sampled_from([{}, {"description": None}, {"description": ""}, {"description": "Does ü things."}]),
        st.one_of(st.just({}), st.just({"parameters": {"type": "object"}}),
                  st.dictionaries(st.text(max_size=5), st.just({"type": "string"}), max_size=3).map(
                      lambda p: {"parameters": {"type": "object", "properties": p}})),
        st.booleans(),
    ),
)
_calls = st.one_of(
    st.builds(call, st.one_of(st.sampled_from(["calculator", "ünï", ""]), st.text(max_size=6)), arguments),
    st.builds(lambda n, a: {"name": n, "arguments": a}, st.text(max_size=6), arguments),  # no "function" wrapper
)
_fast_messages = st.one_of(
    st.builds(lambda r, c: {"role": r, "content": c}, st.sampled_from(["user", "system", "tool"]),
              st.one_of(_unusual_texts, st.none())),
    st.builds(lambda c, t: {"role": "assistant", "content": c, "tool_calls": t},
              st.one_of(_unusual_texts, st.none()), st.lists(_calls, max_size=4)),
    st.builds(lambda c: {"role": "assistant", "content": c}, _unusual_texts),
)


@pytest.fixture(scope="module")
def jinja_template(tiny_model_dir):
    template = ChatTemplate.from_model_dir(tiny_model_dir)
    return ChatTemplate(template.tokenizer, template.source, fast_path=False)


def _render_or_error(template, messages, tools, add_generation_prompt):
    try:
        return template.render_text(messages, tools, add_generation_prompt)
    except ChatTemplateError:
        return ChatTemplateError


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(_fast_messages, min_size=0, max_size=6), st.one_of(st.none(), st.lists(_tool_specs, max_size=3)),
       st.booleans())
@example([{"role": "assistant", "content": "", "tool_calls": [call("f", {"a": "é\n", "b": [1, None]})] * 3}],
         None, False)
@example([{"role": "system", "content": ""}, {"role": "user", "content": ""}], TOOLS, True)
def test_fast_path_writes_the_jinja_text(chat_template, jinja_template, messages, tools, add_generation_prompt):
    assert chat_template.fast_path and not jinja_template.fast_path
    fast = _render_or_error(chat_template, messages, tools, add_generation_prompt)
    assert fast == _render_or_error(jinja_template, messages, tools, add_generation_prompt)
    if fast is not ChatTemplateError:
        assert chat_template.encode(fast) == jinja_template.render_ids(messages, tools, add_generation_prompt)


@pytest.mark.parametrize(
    "messages, tools",
    [
        ([{"role": "user", "content": "plain"}], None),
        ([{"role": "tool", "tool_call_id": "c", "content": ""}], None),
        ([{"role": "system", "content": "s"}, {"role": "user", "content": "ü"}], TOOLS),
        ([{"role": "assistant", "content": None, "tool_calls": [call("f", "{}"), call("g", {"x": "中"})]}], None),
    ],
)
def test_common_shapes_take_the_fast_path(messages, tools):
    from gyre.engines.chat_template import render_builtin_text

    assert render_builtin_text(messages, tools, True) is not None


@pytest.mark.parametrize(
    "messages, tools",
    [
        ([{"role": "assistant", "content": "", "tool_calls": [call("f", ["not", "an", "object"])]}], None),
        ([{"role": "user", "content": "x"}], [{"type": "function", "function": {"name": "f", "parameters": None}}]),
        ([{"role": "user", "content": "x"}], [{"type": "function", "function": {"name": "f", "description": 3}}]),
        ([{"role": "user", "content": "x"}], [{"name": "f", "parameters": {"properties": ["a", "b"]}}]),
        ([{"role": "robot", "content": "x"}], None),
    ],
)
def test_unusual_shapes_fall_back_to_jinja(chat_template, jinja_template, messages, tools):
    from gyre.engines.chat_template import render_builtin_text

    assert render_builtin_text(messages, tools, False) is None
    assert _render_or_error(chat_template, messages, tools, False) == _render_or_error(
        jinja_template, messages, tools, False)


def test_long_texts_tokenise_without_the_gil_to_the_same_ids(chat_template):
    """Texts from ENCODE_WITHOUT_GIL_CHARS on go through encode_batch (which releases the GIL); the ids must not
    change at the threshold or beyond it."""
    from gyre.engines.chat_template import ENCODE_WITHOUT_GIL_CHARS

    unit = "calc 12+3 <|im_start|> word\n"
    for chars in (ENCODE_WITHOUT_GIL_CHARS - 1, ENCODE_WITHOUT_GIL_CHARS, 10 * ENCODE_WITHOUT_GIL_CHARS):
        text = (unit * (chars // len(unit) + 1))[:chars]
        assert chat_template.encode(text) == chat_template.tokenizer.encode(text, add_special_tokens=False).ids
