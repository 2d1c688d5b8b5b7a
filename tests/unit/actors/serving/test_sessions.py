"""Proxy sessions: keys, isolation, exact id reuse of generated turns, and the bounds."""

from __future__ import annotations

import attrs
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
    from gyre.policies.trajectory_tree import TrajectoryTree

    tree = TrajectoryTree("e", "g")  # what the builder rebuilds from `a`'s incremental records
    conversations: list[list[dict]] = [[]]
    for index, (which, cut, new, system, reply, mutate) in enumerate(steps):
        base = conversations[which % len(conversations)]
        if cut < len(base):
            conversations.append(base[:cut])  # a branch sharing the beginning
            base = conversations[-1]
        base.extend(new)
        got = a.render(base, None, system)
        # The same prompt; only the record's incremental fields differ (`b` keeps no conversation to name).
        assert attrs.evolve(got, extends_call=-1, shared_tokens=0, new_prompt_ids=got.prompt_ids) == b.render(
            base, None, system)
        if mutate and base[-1]["role"] == "user":
            base[-1]["content"] += "!"  # a caller editing its own dicts must not corrupt the memo
        output = char_ids(template, reply) if reply is not None else ()
        if reply is not None:
            for session in (a, b):
                session.record_turn(turn_key(reply, []), got.prompt_digest, output)
        a.note_call(got, index, output)
        tree.add_call(_record(a, index, got, output))
        assert tree.prompt_ids(index) == got.prompt_ids


# -- incremental records (issue 29) ----------------------------------------------------------------------------------


def _record(session, index: int, rendered, output: tuple[int, ...]):
    from gyre.messages.model_calls import ModelCallCompleted

    return ModelCallCompleted(
        session.execution_id, session.group_id, index, "", "", len(rendered.prompt_ids), rendered.extends_call,
        rendered.shared_tokens, rendered.new_prompt_ids, rendered.prompt_digest, output, (-0.5,) * len(output),
        (0,) * len(output), "stop", 0, "c", 0.0, 0.0, 1.0,
    )


@pytest.mark.parametrize("seed", range(6))
def test_records_name_the_call_they_extend_and_rebuild_every_prompt(template: ChatTemplate, seed: int) -> None:
    """A scripted agent with tool turns, repeated answers (which cut memos), retries, compressions (a fresh history
    under the same system prompt) and sub-agents (another system prompt), as CallRunner drives a session: each
    call's record, rebuilt through a tree from the earlier records alone, gives exactly the prompt the engine got,
    and most records carry only their new ids."""
    import random

    from gyre.policies.trajectory_tree import TrajectoryTree

    rng = random.Random(seed)
    config = ProxySessionsConfig(max_conversations_per_execution=3 if seed % 2 else 8)
    sessions = ProxySessions(template, config)
    session = sessions.authenticate(sessions.issue_key("a", "g"))
    tree = TrajectoryTree("a", "g")
    carried = whole = 0

    def call(messages, system):
        nonlocal carried, whole
        rendered = session.render(messages, None, system)
        index = session.next_call_index()
        text = rng.choice(["OK", "done", f"step {rng.randrange(50)}", "OK"])
        output = char_ids(template, text)
        session.record_turn(turn_key(text, []), rendered.prompt_digest, output)
        session.note_call(rendered, index, output)
        record = _record(session, index, rendered, output)
        tree.add_call(record)
        assert tree.prompt_ids(index) == rendered.prompt_ids
        carried += len(record.new_prompt_ids)
        whole += record.prompt_tokens
        return text

    main = [{"role": "user", "content": "task"}]
    for turn in range(30):
        draw = rng.random()
        if draw < 0.1 and len(main) > 3:  # retry: drop the last exchange
            main = main[:-2]
        elif draw < 0.2:  # compression: summarise, then a fresh history
            summary = call([*main, {"role": "user", "content": "summarise"}], "sys")
            main = [{"role": "user", "content": f"task; so far: {summary}"}]
        elif draw < 0.3:  # a sub-agent with its own system prompt
            sub = [{"role": "user", "content": f"sub {turn}"}]
            for _ in range(rng.randint(1, 3)):
                sub += [{"role": "assistant", "content": call(sub, "sub-agent")}, {"role": "user", "content": "go"}]
        text = call(main, "sys")
        main += [{"role": "assistant", "content": text}, {"role": "user", "content": f"tool {turn} " * 5}]
    assert tree.pending_calls == 0
    assert carried < whole / 3, (carried, whole)


def test_a_record_that_was_not_handed_on_is_never_named(template: ChatTemplate) -> None:
    sessions = ProxySessions(template)
    session = sessions.authenticate(sessions.issue_key("a", "g"))
    first = [{"role": "user", "content": "hi"}]
    rendered = session.render(first, None, None)
    assert (rendered.extends_call, rendered.shared_tokens) == (-1, 0)
    assert rendered.new_prompt_ids == rendered.prompt_ids
    output = char_ids(template, "hello")
    session.record_turn(turn_key("hello", []), rendered.prompt_digest, output)  # no note_call: its emit failed
    follow = [*first, {"role": "assistant", "content": "hello"}, {"role": "user", "content": "more"}]
    again = session.render(follow, None, None)
    assert again.extends_call == -1 and again.new_prompt_ids == again.prompt_ids
    session.note_call(again, 1, output)
    third = session.render([*follow, {"role": "assistant", "content": "hello"}, {"role": "user", "content": "x"}],
                           None, None)
    assert third.extends_call == 1
    assert third.shared_tokens == len(again.prompt_ids) + len(output)
    assert third.prompt_ids[third.shared_tokens:] == third.new_prompt_ids


def test_a_rendered_prompt_is_a_view_over_its_parts_not_a_copy(template: ChatTemplate) -> None:
    from gyre.actors.serving.prompt_ids import PromptIds

    ids = PromptIds([(1, 2), (), (3,), (4, 5, 6)])
    assert len(ids) == 6 and tuple(ids) == (1, 2, 3, 4, 5, 6) and list(ids) == [1, 2, 3, 4, 5, 6]
    assert [ids[i] for i in range(6)] == [1, 2, 3, 4, 5, 6] and ids[-1] == 6
    assert ids[1:4] == (2, 3, 4) and ids + (7,) == (1, 2, 3, 4, 5, 6, 7) and (0,) + ids == (0, 1, 2, 3, 4, 5, 6)
    assert ids == (1, 2, 3, 4, 5, 6) and (1, 2, 3, 4, 5, 6) == ids and ids != (1, 2) and ids != [1, 2, 3, 4, 5, 6]
    assert hash(ids) == hash((1, 2, 3, 4, 5, 6))
    with pytest.raises(IndexError):
        ids[6]
    # A session's rendering shares the ids of its messages with the session's cache: nothing per call copies them.
    sessions = ProxySessions(template)
    session = sessions.authenticate(sessions.issue_key("a", "g"))
    long_text = "word " * 2000
    messages = [{"role": "user", "content": long_text}]
    first = session.render(messages, None, None)
    assert session.unrendered_chars(messages, None, None) == 0  # all of it is in a conversation the session holds
    messages = [*messages, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"}]
    assert session.unrendered_chars(messages, None, None) == len("ok") + len("more")
    second = session.render(messages, None, None)
    assert second.prompt_ids._parts[1] is first.prompt_ids._parts[1]  # the long message's ids, shared
    assert list(second.prompt_ids) == template.render_ids(messages)
