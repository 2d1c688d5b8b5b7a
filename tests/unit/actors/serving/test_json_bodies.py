"""Request bodies decoded from where they differ from the session's earlier ones (json_bodies.py): whatever the
sequence of bodies (appended, forked or edited conversations, other members before and after the messages, any
formatting, a BOM, text beyond ASCII, values beyond the bounds, broken JSON), each decodes to what `loads_bounded`
makes of it alone, or is refused as it refuses it; a growing conversation is in fact decoded incrementally, and its
OpenAI messages are converted once each."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gyre.actors.serving._api_common import JsonLimits, loads_bounded
from gyre.actors.serving.json_bodies import BodyCache, BodyCacheConfig
from gyre.actors.serving.anthropic_api import parse_messages_request
from gyre.actors.serving.openai_api import parse_chat_request
from gyre.actors.serving.sessions import ApiError

LIMITS = JsonLimits(max_depth=6, max_string_chars=40)
ALL_BODIES = BodyCacheConfig(max_bytes=1 << 20, max_bodies_per_session=3, min_body_bytes=0)


def verdict(decode: Any) -> tuple[str, Any]:
    try:
        return "ok", decode()
    except ApiError as error:
        return "refused", error.kind


plain = st.text(max_size=12)
texts = st.one_of(plain, plain, plain, plain, plain,
                  st.sampled_from(["\ud800", "é\u2028", "x" * 41, "\\", '"messages"']))
scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False, allow_infinity=False), texts)
nested = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                       st.dictionaries(texts, inner, max_size=3)), max_leaves=12)
messages = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "tool"]), "content": texts}),
    st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "tool"]), "content": texts}),
    st.fixed_dictionaries({"role": st.just("assistant"), "content": texts, "tool_calls": nested}),
    nested,
)
members = st.dictionaries(st.sampled_from(["model", "max_tokens", "stream", "tools", "temperature"]),
                          st.one_of(scalars, scalars, nested), max_size=3)
steps = st.tuples(
    st.sampled_from(["append", "fork", "edit", "again", "members", "broken"]),
    st.lists(messages, min_size=1, max_size=3),
    st.integers(0, 30),
    members,
    st.booleans(),
)
styles = st.sampled_from([{}, {"ensure_ascii": False}, {"indent": 1}, {"separators": (",", ":")}])


def body_bytes(head: dict[str, Any], conversation: list[Any], tail: dict[str, Any], style: dict[str, Any],
               bom: bool) -> bytes:
    body = {**head, "messages": conversation, **{k: v for k, v in tail.items() if k not in head}}
    return (b"\xef\xbb\xbf" if bom else b"") + json.dumps(body, **style).encode("utf-8", "surrogatepass")


@settings(max_examples=150, deadline=None)
@given(st.lists(messages, min_size=1, max_size=4), st.lists(steps, min_size=4, max_size=12), styles, members, members)
def test_every_body_decodes_as_it_would_alone(first: list[Any], script: list[Any], style: dict[str, Any],
                                              head: dict[str, Any], tail: dict[str, Any]) -> None:
    cache = BodyCache(LIMITS, ALL_BODIES)
    conversations = [list(first)]
    for op, new, where, other_members, bom in script:
        conversation = conversations[-1]
        if op == "append":
            conversation += new
        elif op == "fork":
            conversation = conversation[: where % (len(conversation) + 1)] + new
            conversations.append(conversation)
        elif op == "edit":
            conversation[where % len(conversation)] = new[0]
        elif op == "again":
            conversation = conversations[where % len(conversations)]
            conversations.append(conversation)
        elif op == "members":
            tail = other_members
        raw = body_bytes(head, conversation, tail, style, bom)
        if op == "broken":
            raw = raw[: len(raw) - 1 - where % 3] + b"\xff,]"[: where % 4]
        expected = verdict(lambda: loads_bounded(raw, LIMITS))
        assert verdict(lambda: cache.loads(raw, "session")) == expected
    kept = cache.statistics()
    assert kept.bodies_kept <= ALL_BODIES.max_bodies_per_session
    assert kept.bytes_kept <= ALL_BODIES.max_bytes


def test_a_growing_conversation_is_decoded_after_what_it_repeats() -> None:
    cache = BodyCache(JsonLimits(), ALL_BODIES)
    conversation: list[dict[str, Any]] = [{"role": "system", "content": "You are terse. " * 20}]
    previous: Any = None
    for turn in range(40):
        conversation.append({"role": "user" if turn % 2 else "assistant", "content": f"turn {turn} " + "é" * turn})
        raw = json.dumps({"model": "gyre", "messages": conversation, "max_tokens": 8}, ensure_ascii=turn % 3 == 0)
        body = cache.loads(raw.encode(), "execution")
        assert body == json.loads(raw)
        if previous is not None:  # the repeated messages are the earlier decoding's, not parsed again
            assert body["messages"][0] is previous["messages"][0]
        previous = body
    statistics = cache.statistics()
    # ensure_ascii changes every turn's bytes from the second message on: those bodies reuse the system message only
    assert statistics.incremental == 39 and statistics.whole == 1
    assert statistics.reused_bytes > 39 * len(json.dumps(conversation[0]))


def test_sessions_do_not_share_decodings_and_the_bounds_hold() -> None:
    cache = BodyCache(JsonLimits(), BodyCacheConfig(max_bytes=3000, max_bodies_per_session=2, min_body_bytes=0))
    conversation = [{"role": "user", "content": "x" * 400}]
    raw = json.dumps({"messages": conversation}).encode()
    one, two = cache.loads(raw, "a"), cache.loads(raw, "b")
    assert one == two and one["messages"][0] is not two["messages"][0]
    for n in range(8):
        conversation.append({"role": "user", "content": f"{n}" * 300})
        cache.loads(json.dumps({"messages": conversation}).encode(), "c")
        assert cache.statistics().bytes_kept <= 3000
    cache.forget("c")
    assert cache.statistics().bodies_kept == 0


@pytest.mark.parametrize(
    ("tail", "kind_of_refusal"),
    [
        (', {"role": "user", "content": "\\ud800"}]}', "lone surrogate"),
        (', [[[[["deep"]]]]]]}', "max_json_depth"),
        (', {"role": "user", "content": "' + "y" * 50 + '"}]}', "max_json_string_chars"),
        (', {"role": "user", "content": "open}]}', "not valid JSON"),
        (', {"role": "user"}], "stream": [[[[[[1]]]]]]}', "max_json_depth"),
        (b', {"role": "user", "content": "\xc3"}]}', "not valid UTF-8"),
    ],
)
def test_a_new_message_beyond_the_bounds_is_refused_as_alone(tail: str | bytes, kind_of_refusal: str) -> None:
    cache = BodyCache(LIMITS, ALL_BODIES)
    start = b'{"model": "gyre", "messages": [{"role": "user", "content": "hello"}'
    cache.loads(start + b"]}", "session")
    raw = start + (tail if isinstance(tail, bytes) else tail.encode())
    with pytest.raises(ApiError) as alone:
        loads_bounded(raw, LIMITS)
    with pytest.raises(ApiError) as refused:
        cache.loads(raw, "session")
    assert refused.value.message == alone.value.message and kind_of_refusal in refused.value.message
    assert cache.statistics().bodies_kept == 1  # a refused body is not kept


def test_a_second_messages_member_is_decoded_as_json_decodes_it() -> None:
    cache = BodyCache(JsonLimits(), ALL_BODIES)
    first = b'{"messages": [{"role": "user", "content": "a"}]}'
    cache.loads(first, "s")
    raw = b'{"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], "messages": [1]}'
    assert cache.loads(raw, "s") == json.loads(raw) == {"messages": [1]}


def test_the_openai_messages_of_a_growing_conversation_are_converted_once_each() -> None:
    cache = BodyCache(JsonLimits(), ALL_BODIES)
    conversation: list[dict[str, Any]] = [{"role": "system", "content": "Be brief."}]
    previous = None
    for turn in range(12):
        if turn % 3 == 2:
            call = {"id": f"c{turn}", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
            conversation.append({"role": "assistant", "content": None, "tool_calls": [call]})
            conversation.append({"role": "tool", "tool_call_id": f"c{turn}", "content": "done"})
        else:
            conversation.append({"role": "user" if turn % 2 else "assistant", "content": f"turn {turn}"})
        raw = json.dumps({"model": "gyre", "messages": conversation}).encode()
        chat = parse_chat_request(cache.loads(raw, "execution"))
        assert chat == parse_chat_request(json.loads(raw))  # the same request as from the whole body
        if previous is not None:  # the messages it repeats are the earlier call's conversions, not new ones
            assert all(a is b for a, b in zip(chat.messages, previous.messages))
        previous = chat
    # An edited history converts again from the edit on.
    conversation[3] = {"role": "user", "content": "edited"}
    raw = json.dumps({"model": "gyre", "messages": conversation}).encode()
    chat = parse_chat_request(cache.loads(raw, "execution"))
    assert chat == parse_chat_request(json.loads(raw))
    assert chat.messages[1] is previous.messages[1] and chat.messages[2] == {"role": "user", "content": "edited"}


def test_the_anthropic_messages_of_a_growing_conversation_are_converted_once_each() -> None:
    cache = BodyCache(JsonLimits(), ALL_BODIES)
    conversation: list[dict[str, Any]] = []
    previous = None
    for turn in range(10):
        if turn % 2:
            conversation.append({"role": "assistant", "content": [
                {"type": "text", "text": f"calling {turn}"},
                {"type": "tool_use", "id": f"t{turn}", "name": "read", "input": {"path": f"/{turn}"}}]})
        else:
            results = [{"type": "tool_result", "tool_use_id": f"t{turn - 1}", "content": "ok"}] if turn else []
            conversation.append({"role": "user", "content": results + [{"type": "text", "text": f"go {turn}"}]})
        body = {"model": "gyre", "max_tokens": 8, "system": "Be brief.", "messages": conversation}
        raw = json.dumps(body).encode()
        chat = parse_messages_request(cache.loads(raw, "execution"))
        assert chat == parse_messages_request(json.loads(raw))
        if previous is not None:  # a user turn with a tool result gives two neutral messages: all of them reused
            assert all(a is b for a, b in zip(chat.messages, previous.messages))
        previous = chat
    assert len(previous.messages) == 14
