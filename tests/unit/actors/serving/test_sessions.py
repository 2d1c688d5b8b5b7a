"""Proxy sessions: keys, isolation, exact id reuse of generated turns, and the bounds."""

from __future__ import annotations

import pytest

from gyre.actors.serving.sessions import (
    ProxySessions,
    ProxySessionsConfig,
    SessionsFull,
    prompt_digest,
    turn_key,
)
from gyre.engines.chat_template import ChatTemplate
from gyre.engines.tokenizer import write_tokenizer_files


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> ChatTemplate:
    model_dir = tmp_path_factory.mktemp("model")
    write_tokenizer_files(model_dir)  # the template needs only the tokenizer files
    return ChatTemplate.from_model_dir(model_dir)


def char_ids(template: ChatTemplate, text: str) -> tuple[int, ...]:
    """A tokenisation the tokenizer would never produce for `text` (one piece per character), plus <|im_end|>:
    what a sampling model can emit, and what re-tokenising the text cannot give back."""
    return tuple(i for ch in text for i in template.encode(ch)) + (template.im_end_id,)


def test_keys_authenticate_their_execution_only(template: ChatTemplate) -> None:
    sessions = ProxySessions(template)
    key_a = sessions.issue_key("a", "g")
    key_b = sessions.issue_key("b", "g", api_key="key-for-b")
    assert key_b == "key-for-b"
    assert sessions.authenticate(key_a).execution_id == "a"
    assert sessions.authenticate(key_b).execution_id == "b"
    assert sessions.authenticate("wrong") is None and sessions.authenticate(None) is None
    assert sessions.revoke("a") and not sessions.revoke("a")
    assert sessions.authenticate(key_a) is None
    with pytest.raises(ValueError):
        sessions.issue_key("b", "g")  # one key per execution
    with pytest.raises(ValueError):
        sessions.issue_key("c", "g", api_key="key-for-b")  # keys are unique


def test_max_executions_is_enforced(template: ChatTemplate) -> None:
    sessions = ProxySessions(template, ProxySessionsConfig(max_executions=2))
    sessions.issue_key("a", "g")
    sessions.issue_key("b", "g")
    with pytest.raises(SessionsFull):
        sessions.issue_key("c", "g")
    sessions.revoke("a")
    sessions.issue_key("c", "g")


def test_render_matches_template_without_generated_turns(template: ChatTemplate) -> None:
    sessions = ProxySessions(template)
    session = sessions.authenticate(sessions.issue_key("a", "g"))
    tools = [{"type": "function", "function": {"name": "ls", "parameters": {"type": "object"}}}]
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "x", "type": "function", "function": {"name": "ls", "arguments": '{"p": 1}'}}]},
        {"role": "tool", "tool_call_id": "x", "content": "a b"},
    ]
    rendered = session.render(messages, tools, "be brief")
    expected = template.render_ids([{"role": "system", "content": "be brief"}, *messages], tools)
    assert list(rendered.prompt_ids) == expected
    assert rendered.reused_turns == 0 and rendered.retokenised_turns == 1
    assert rendered.prompt_digest == prompt_digest(expected)
    # Cached renderings give the same ids the second time.
    assert session.render(messages, tools, "be brief") == rendered


def test_generated_turn_is_reused_exactly_and_extends_the_prompt(template: ChatTemplate) -> None:
    sessions = ProxySessions(template)
    session = sessions.authenticate(sessions.issue_key("a", "g"))
    first = [{"role": "user", "content": "hi"}]
    prompt = session.render(first, None, None).prompt_ids
    output = char_ids(template, "hello there")
    session.record_turn(turn_key("hello there", []), prompt_digest(prompt), output)
    follow = [*first, {"role": "assistant", "content": "hello there"}, {"role": "user", "content": "more"}]
    rendered = session.render(follow, None, None)
    assert rendered.prompt_ids[: len(prompt) + len(output)] == prompt + output
    assert rendered.reused_turns == 1
    # Re-tokenising the text would have drifted: that is what the reuse prevents.
    assert list(rendered.prompt_ids) != template.render_ids(follow)
    # Another execution presenting the same text gets the template's ids, never this execution's.
    other = sessions.authenticate(sessions.issue_key("b", "g"))
    assert list(other.render(follow, None, None).prompt_ids) == template.render_ids(follow)


def test_tool_call_turn_key_ignores_ids_order_and_spacing(template: ChatTemplate) -> None:
    assert turn_key("", [("ls", '{"a": 1, "b": [2]}')]) == turn_key(None, [("ls", {"b": [2], "a": 1})])
    assert turn_key("x", [("ls", "{}")]) != turn_key("x", [("cat", "{}")])
    sessions = ProxySessions(template)
    session = sessions.authenticate(sessions.issue_key("a", "g"))
    first = [{"role": "user", "content": "hi"}]
    prompt = session.render(first, None, None).prompt_ids
    text = '<tool_call>\n{"name": "ls", "arguments": {"a": 1, "b": [2]}}\n</tool_call>'
    output = char_ids(template, text)
    session.record_turn(turn_key("", [("ls", '{"a": 1, "b": [2]}')]), prompt_digest(prompt), output)
    echoed = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_9", "type": "function", "function": {"name": "ls", "arguments": '{"b":[2],"a":1}'}}]}
    rendered = session.render([*first, echoed, {"role": "tool", "tool_call_id": "call_9", "content": "ok"}], None, None)
    assert rendered.prompt_ids[: len(prompt) + len(output)] == prompt + output


def test_length_cut_turn_gets_a_turn_end(template: ChatTemplate) -> None:
    sessions = ProxySessions(template)
    session = sessions.authenticate(sessions.issue_key("a", "g"))
    first = [{"role": "user", "content": "hi"}]
    prompt = session.render(first, None, None).prompt_ids
    output = char_ids(template, "cut sho")[:-1]  # no <|im_end|>: max_tokens ended it
    session.record_turn(turn_key("cut sho", []), prompt_digest(prompt), output)
    rendered = session.render([*first, {"role": "assistant", "content": "cut sho"}], None, None)
    n = len(prompt) + len(output)
    assert rendered.prompt_ids[:n] == prompt + output
    assert rendered.prompt_ids[n] == template.im_end_id


def test_same_text_twice_prefers_the_turn_with_the_same_prefix(template: ChatTemplate) -> None:
    sessions = ProxySessions(template)
    session = sessions.authenticate(sessions.issue_key("a", "g"))
    convo = [{"role": "user", "content": "one"}]
    prompt_1 = session.render(convo, None, None).prompt_ids
    out_1 = char_ids(template, "OK")
    session.record_turn(turn_key("OK", []), prompt_digest(prompt_1), out_1)
    convo += [{"role": "assistant", "content": "OK"}, {"role": "user", "content": "two"}]
    prompt_2 = session.render(convo, None, None).prompt_ids
    out_2 = tuple(template.encode("OK")) + (template.im_end_id,)  # the same text, other ids
    assert out_1 != out_2
    session.record_turn(turn_key("OK", []), prompt_digest(prompt_2), out_2)
    convo += [{"role": "assistant", "content": "OK"}, {"role": "user", "content": "three"}]
    prompt_3 = session.render(convo, None, None).prompt_ids
    assert prompt_3[: len(prompt_2) + len(out_2)] == prompt_2 + out_2
    assert prompt_2[: len(prompt_1) + len(out_1)] == prompt_1 + out_1


def test_stored_turns_are_bounded(template: ChatTemplate) -> None:
    config = ProxySessionsConfig(max_turns_per_execution=2, max_cached_messages_per_execution=3)
    sessions = ProxySessions(template, config)
    session = sessions.authenticate(sessions.issue_key("a", "g"))
    first = [{"role": "user", "content": "hi"}]
    prompt = session.render(first, None, None).prompt_ids
    for text in ("one", "two", "three"):
        session.record_turn(turn_key(text, []), prompt_digest(prompt), char_ids(template, text))
    assert session.stored_turns == 2
    oldest = session.render([*first, {"role": "assistant", "content": "one"}], None, None)
    newest = session.render([*first, {"role": "assistant", "content": "three"}], None, None)
    assert oldest.reused_turns == 0 and oldest.retokenised_turns == 1
    assert newest.reused_turns == 1
    for i in range(10):
        session.render([{"role": "user", "content": f"m{i}"}], None, None)
    assert session.cached_messages <= 3


# -- incremental rendering equals rendering from scratch --------------------------------------------------------

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_texts = st.sampled_from(["OK", "ls", "hello there", "", "ü ✓", "done."])
_tool_call = st.builds(
    lambda name, arg: {"id": "c", "type": "function", "function": {"name": name, "arguments": arg}},
    st.sampled_from(["ls", "cat"]), st.sampled_from(['{"p": 1}', '{"p":1}', "{}"]))
_new_message = st.one_of(
    st.builds(lambda t: {"role": "user", "content": t}, _texts),
    st.builds(lambda t: {"role": "tool", "tool_call_id": "c", "content": t}, _texts),
    st.builds(lambda t, calls: {"role": "assistant", "content": t, **({"tool_calls": calls} if calls else {})},
              _texts, st.lists(_tool_call, max_size=2)),
)
# One step: pick a conversation (or start a new one from a prefix of another), extend it, render it, and maybe
# record the reply as a generated turn (which can change how equal messages elsewhere resolve).
_steps = st.lists(
    st.tuples(st.integers(0, 3), st.integers(0, 6), st.lists(_new_message, min_size=1, max_size=3),
              st.sampled_from([None, "sys"]), st.one_of(st.none(), _texts), st.booleans()),
    min_size=1, max_size=25,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(_steps)
def test_incremental_rendering_equals_rendering_from_scratch(template: ChatTemplate, steps) -> None:
    incremental = ProxySessions(template, ProxySessionsConfig(max_conversations_per_execution=2,
                                                              max_turns_per_execution=6))
    scratch = ProxySessions(template, ProxySessionsConfig(max_conversations_per_execution=0,
                                                          max_turns_per_execution=6))
    a = incremental.authenticate(incremental.issue_key("e", "g"))
    b = scratch.authenticate(scratch.issue_key("e", "g"))
    conversations: list[list[dict]] = [[]]
    for which, cut, new, system, reply, mutate in steps:
        base = conversations[which % len(conversations)]
        if cut < len(base):
            conversations.append(base[:cut])  # a branch sharing the beginning
            base = conversations[-1]
        base.extend(new)
        got = a.render(base, None, system)
        assert got == b.render(base, None, system)
        if mutate and base[-1]["role"] == "user":
            base[-1]["content"] += "!"  # a caller editing its own dicts must not corrupt the memo
        if reply is not None:
            output = char_ids(template, reply)
            for session in (a, b):
                session.record_turn(turn_key(reply, []), got.prompt_digest, output)
