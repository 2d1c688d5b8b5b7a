"""The `<tool_call>` format: rendering matches the agreed text exactly; parsing never fails and flags broken blocks."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from gyre.engines.tool_calls import (
    ParsedOutput,
    ToolCall,
    canonical_arguments_json,
    parse_tool_calls,
    render_tool_call,
    render_tool_calls,
)


def test_render_is_the_agreed_text() -> None:
    text = render_tool_calls("I will look.", [ToolCall("read", '{"path": "é.txt"}'), ToolCall("ls", "{}")])
    assert text == (
        'I will look.\n<tool_call>\n{"name": "read", "arguments": {"path": "é.txt"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "ls", "arguments": {}}\n</tool_call>'
    )
    assert render_tool_calls("", [ToolCall("ls", "{}")]) == '<tool_call>\n{"name": "ls", "arguments": {}}\n</tool_call>'


def test_plain_text_is_content() -> None:
    assert parse_tool_calls("  hello\nworld \n") == ParsedOutput("hello\nworld", (), False)


def test_parse_content_and_calls() -> None:
    text = 'Let me check.\n<tool_call>\n{"name": "grep", "arguments": {"pattern": "x", "n": 3}}\n</tool_call>'
    parsed = parse_tool_calls(text)
    assert parsed.content == "Let me check."
    assert parsed.tool_calls == (ToolCall("grep", '{"pattern": "x", "n": 3}'),)
    assert parsed.tool_calls[0].arguments == {"pattern": "x", "n": 3}
    assert not parsed.malformed


def test_invalid_json_stays_as_text() -> None:
    bad = '<tool_call>\n{"name": "grep", "arguments": {oops}\n</tool_call>'
    good = '<tool_call>\n{"name": "ls", "arguments": {}}\n</tool_call>'
    parsed = parse_tool_calls(f"{bad}\n{good}")
    assert parsed.malformed
    assert parsed.content == bad
    assert parsed.tool_calls == (ToolCall("ls", "{}"),)


def test_unclosed_block_cut_by_length_stays_as_text() -> None:
    text = 'ok\n<tool_call>\n{"name": "ls", "argu'
    parsed = parse_tool_calls(text)
    assert parsed == ParsedOutput(text, (), True)


def test_unclosed_block_does_not_swallow_the_next_good_one() -> None:
    text = '<tool_call>\n{"name": \n<tool_call>\n{"name": "ls", "arguments": {}}\n</tool_call>'
    parsed = parse_tool_calls(text)
    assert parsed.tool_calls == (ToolCall("ls", "{}"),)
    assert parsed.malformed
    assert parsed.content == '<tool_call>\n{"name":'


def test_missing_name_or_bad_arguments_are_malformed() -> None:
    for body in ('{"arguments": {}}', '{"name": "", "arguments": {}}', '{"name": "x", "arguments": [1]}', "[1, 2]"):
        parsed = parse_tool_calls(f"<tool_call>\n{body}\n</tool_call>")
        assert parsed.malformed and parsed.tool_calls == (), body


def test_stray_closing_tag_is_malformed() -> None:
    parsed = parse_tool_calls("done </tool_call>")
    assert parsed == ParsedOutput("done </tool_call>", (), True)


def test_double_encoded_arguments_and_missing_arguments() -> None:
    parsed = parse_tool_calls('<tool_call>\n{"name": "a", "arguments": "{\\"k\\": 1}"}\n</tool_call>')
    assert parsed.tool_calls == (ToolCall("a", '{"k": 1}'),)
    parsed = parse_tool_calls('<tool_call>\n{"name": "a"}\n</tool_call>')
    assert parsed.tool_calls == (ToolCall("a", "{}"),)


def test_canonical_arguments_ignores_order_and_spacing() -> None:
    assert canonical_arguments_json('{"b": 1, "a": "é"}') == canonical_arguments_json({"a": "\u00e9", "b": 1})
    assert canonical_arguments_json('{"a":1}') != canonical_arguments_json('{"a":2}')


_json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(10**6), 10**6) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)
_calls = st.lists(
    st.builds(
        lambda name, args: ToolCall(name, json.dumps(args, ensure_ascii=False)),
        st.text(st.characters(codec="utf-8", exclude_characters="<>"), min_size=1, max_size=10),
        st.dictionaries(st.text(max_size=6), _json_values, max_size=4),
    ),
    max_size=3,
)
_content = st.text(st.characters(codec="utf-8", exclude_characters="<>"), max_size=40).map(str.strip)


@settings(max_examples=200, deadline=None)
@given(_content, _calls)
def test_render_then_parse_round_trips(content: str, calls: list[ToolCall]) -> None:
    text = render_tool_calls(content, calls)
    parsed = parse_tool_calls(text)
    assert parsed.tool_calls == tuple(calls)
    assert not parsed.malformed
    assert parsed.content == content
    for call in calls:
        assert render_tool_call(call.name, call.arguments) in text


def test_arguments_nested_past_the_recursion_limit_stay_as_text() -> None:
    """Model output is untrusted input too: JSON nested ~5000 deep makes json raise RecursionError, which must leave
    the block as text (like any invalid call), never escape as a 500 from the proxy."""
    body = '{"name": "calc", "arguments": ' + "[" * 5000 + "]" * 5000 + "}"
    parsed = parse_tool_calls(f"<tool_call>{body}</tool_call>")
    assert parsed.tool_calls == ()
    assert body in parsed.content
    wrapped = json.dumps({"name": "calc", "arguments": '{"a": ' + "[" * 5000 + "]" * 5000 + "}"})
    assert parse_tool_calls(f"<tool_call>{wrapped}</tool_call>").tool_calls == ()
