"""Streaming a turn: the deltas assemble to exactly the non-streamed content and tool calls, and nothing sent is
ever taken back, whatever the chunking, unicode split across tokens, stop strings or tool-call blocks."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from gyre.actors.serving.backends import BackendResult
from gyre.actors.serving.sessions import final_text
from gyre.actors.serving.streaming import TextDelta, ToolCallDelta, TurnStreamer
from gyre.engines.chat_template import ChatTemplate
from gyre.engines.tokenizer import write_tokenizer_files


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> ChatTemplate:
    model_dir = tmp_path_factory.mktemp("model")
    write_tokenizer_files(model_dir)
    return ChatTemplate.from_model_dir(model_dir)


def good_call(name: str, arguments: dict) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False) + "\n</tool_call>"


_pieces = st.one_of(
    st.sampled_from(["Let me look.", " ", "\n", "\n\n", "ünï ✓ 中文 😀", "STOP", "ST", "<tool", "<tool_call>",
                     "</tool_call>", "<tool_call>{not json}</tool_call>", "<tool_call>\n{\"name\": \"ls\"",
                     "done", "e\u0301", "<|im_start|>"]),
    st.builds(good_call, st.sampled_from(["ls", "read_file", "ünï"]),
              st.dictionaries(st.sampled_from(["path", "n", "ü"]), st.one_of(st.integers(), st.text(max_size=4)),
                              max_size=2)),
    st.text(max_size=6),
)


def token_ids(template: ChatTemplate, text: str, per_char: bool) -> list[int]:
    """The turn's ids: canonical BPE, or one piece per character (as a sampling model may emit)."""
    if not per_char:
        return template.encode(text)
    return [i for ch in text for i in template.encode(ch)]


def engine_run(template: ChatTemplate, text: str, per_char: bool, stop: tuple[str, ...], ending: str):
    """What an engine would return: ids up to the token that completes a stop string (finish "stop", matched),
    else the whole text with the turn end ("stop") or cut short ("length")."""
    ids = token_ids(template, text, per_char)
    if stop:
        for n in range(1, len(ids) + 1):
            decoded = template.decode(ids[:n])
            hits = [s for s in stop if s in decoded]
            if hits:
                return BackendResult(tuple(ids[:n]), (0.0,) * n, (0,) * n, "stop", 0, "c", hits[0])
    if ending == "stop":
        ids = ids + [template.im_end_id]
        return BackendResult(tuple(ids), (0.0,) * len(ids), (0,) * len(ids), "stop", 0, "c", template.im_end_id)
    return BackendResult(tuple(ids), (0.0,) * len(ids), (0,) * len(ids), "length", 0, "c")


def stream(template: ChatTemplate, result: BackendResult, sizes: list[int], stop: tuple[str, ...], tools: bool):
    streamer = TurnStreamer(template.decode, template.stop_token_ids, stop, parse_tools=tools)
    ids, deltas, early = list(result.output_ids), [], 0
    position, turn = 0, 0
    while position < len(ids):
        size = sizes[turn % len(sizes)] if sizes else 1
        deltas += streamer.feed(ids[position : position + size])
        position += size
        turn += 1
    early = len(deltas)
    text, parsed, _ = final_text(template, result, stop, tools)
    deltas += streamer.finish(text, parsed)
    return streamer, deltas, early, text, parsed


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    st.lists(_pieces, max_size=8).map("".join),
    st.booleans(),
    st.sampled_from([(), ("STOP",), ("STOP", "\n\n")]),
    st.booleans(),
    st.sampled_from(["stop", "length"]),
    st.lists(st.integers(1, 4), min_size=1, max_size=4),
)
@example("Let me look.\n" + good_call("ls", {"path": "."}) + "\nthen more", True, (), True, "stop", [1])
@example("ünï ✓", True, ("STOP",), False, "length", [1])
def test_deltas_assemble_to_the_final_answer(template, text, per_char, stop, tools, ending, sizes) -> None:
    result = engine_run(template, text, per_char, stop, ending)
    streamer, deltas, _, final, parsed = stream(template, result, sizes, stop, tools)
    content = parsed.content if parsed is not None else final
    calls = list(parsed.tool_calls) if parsed is not None else []
    assert streamer.consistent
    assert "".join(d.text for d in deltas if isinstance(d, TextDelta)) == content
    assert [d.call for d in deltas if isinstance(d, ToolCallDelta)] == calls
    assert [d.index for d in deltas if isinstance(d, ToolCallDelta)] == list(range(len(calls)))
    # Text and calls come in the order the model wrote them: the text before each call is what parsing the text
    # up to that call gives (joined, that is what an agent echoing the turn sends back).
    seen = ""
    for delta in deltas:
        if isinstance(delta, TextDelta):
            seen += delta.text
        else:
            assert content.startswith(seen)


def test_text_streams_before_the_end_and_tool_calls_wait_for_their_block(template) -> None:
    call = good_call("read_file", {"path": "a.txt"})
    text = "I will read the file now, then answer." + "\n" + call
    result = engine_run(template, text, per_char=True, stop=(), ending="stop")
    streamer = TurnStreamer(template.decode, template.stop_token_ids, (), parse_tools=True)
    ids = list(result.output_ids)
    opened = text.index("<tool_call>")
    sent_before_open = None
    deltas = []
    for i, token in enumerate(ids):
        deltas += streamer.feed([token])
        decoded = template.decode(ids[: i + 1])
        if sent_before_open is None and len(decoded) > opened + len("<tool_call>") + 3:
            sent_before_open = list(deltas)
        if "</tool_call>" not in decoded and len(decoded) > opened:
            # Inside the block nothing of it is sent: no text from the tag on, no call yet.
            assert all(isinstance(d, TextDelta) and "<" not in d.text for d in deltas)
    texts = [d for d in sent_before_open if isinstance(d, TextDelta)]
    assert len(texts) > 5 and "".join(d.text for d in texts) == "I will read the file now, then answer."
    assert [d for d in deltas if isinstance(d, ToolCallDelta)][0].call.name == "read_file"  # before finish
    final, parsed, _ = final_text(template, result, (), True)
    assert streamer.finish(final, parsed) == []


def test_malformed_block_is_sent_as_text_once_known(template) -> None:
    text = "Try: <tool_call>{broken</tool_call> ok"
    result = engine_run(template, text, per_char=True, stop=(), ending="stop")
    streamer, deltas, early, final, parsed = stream(template, result, [1], (), True)
    assert parsed.malformed and not parsed.tool_calls
    sent = "".join(d.text for d in deltas[:early] if isinstance(d, TextDelta))
    assert "<tool_call>{broken</tool_call>" in sent  # known malformed when it closed, before the end
    assert "".join(d.text for d in deltas if isinstance(d, TextDelta)) == parsed.content


def test_stop_string_is_never_sent(template) -> None:
    result = engine_run(template, "answer is 42 STOP and more", per_char=True, stop=("STOP",), ending="stop")
    streamer, deltas, _, final, _ = stream(template, result, [1], ("STOP",), False)
    assert final == "answer is 42 " and "".join(d.text for d in deltas) == final
    assert not any("S" in d.text for d in deltas)


def test_a_stop_token_in_the_middle_is_text(template) -> None:
    ids = template.encode("a") + [template.im_end_id] + template.encode("b")
    result = BackendResult(tuple(ids), (0.0,) * len(ids), (0,) * len(ids), "length", 0, "c")
    streamer, deltas, _, final, _ = stream(template, result, [1], (), False)
    assert final == "a<|im_end|>b" == "".join(d.text for d in deltas)
