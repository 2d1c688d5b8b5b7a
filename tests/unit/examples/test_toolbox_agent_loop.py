"""The toolbox agent's loop, in process, with a scripted model: retries, compression, sub-agents, bounds."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any, Callable

import pytest

TOOLBOX = Path(__file__).resolve().parents[3] / "examples" / "toolbox"


def load(name: str):
    """Load examples/toolbox/<name>.py under the private name agent.load_sibling uses."""
    qualified = f"_gyre_toolbox_{name}"
    if qualified not in sys.modules:
        spec = importlib.util.spec_from_file_location(qualified, TOOLBOX / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[qualified] = module
        spec.loader.exec_module(module)
    return sys.modules[qualified]


agent = load("agent")
prompts = load("prompts")


def call(name: str, arguments: Any, call_id: str = "c1"):
    text = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return agent.ModelReply("", (agent.ToolCall(call_id, name, text),), "tool_calls")


def text(content: str):
    return agent.ModelReply(content)


class Script:
    """A stand-in model: answers each call with decide(messages, agent_id, call_kind) and records the call."""

    def __init__(self, decide: Callable[[list[dict], str, str], Any]) -> None:
        self.decide = decide
        self.calls: list[tuple[list[dict], tuple[dict, ...], str, str]] = []

    def __call__(self, messages, tools, agent_id, call_kind):
        self.calls.append((messages, tools, agent_id, call_kind))
        return self.decide(messages, agent_id, call_kind)


def sequence(*replies):
    """decide() that plays replies in order."""
    pending = list(replies)
    return lambda messages, agent_id, call_kind: pending.pop(0)


def test_finishes_after_tools_and_keeps_the_model_messages(tmp_path: Path) -> None:
    (tmp_path / "data.txt").write_text("3 4")
    script = Script(
        sequence(
            call("read_file", {"path": "data.txt"}),
            call("calculator", {"expression": "3+4"}, "c2"),
            call("write_file", {"path": "answer.txt", "content": "7"}, "c3"),
            text("Done."),
        )
    )
    result = agent.Agent(script, tmp_path).run("Add the numbers in data.txt and write the sum to answer.txt.")
    assert result == agent.AgentResult("main", True, "Done.", 4, 0, 0)
    assert (tmp_path / "answer.txt").read_text() == "7"
    last_messages = script.calls[-1][0]
    roles = [m["role"] for m in last_messages]
    assert roles == ["system", "user", "assistant", "tool", "assistant", "tool", "assistant", "tool"]
    assert last_messages[2] == {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "read_file", "arguments": '{"path": "data.txt"}'}}
        ],
    }
    assert [m["content"] for m in last_messages if m["role"] == "tool"] == ["3 4", "7", "ok"]
    labels = [(agent_id, kind, tools) for _, tools, agent_id, kind in script.calls]
    assert labels == [("main", "turn", prompts.MAIN_TOOLS)] * 4


@pytest.mark.parametrize(
    "malformed",
    [
        text('<tool_call>\n{"name": "read_file", "arguments": {"path": \n</tool_call>'),
        call("rm", {"path": "x"}),
        call("read_file", '{"path": '),
        call("read_file", '["data.txt"]'),
    ],
    ids=["unparsed-text", "unknown-tool", "bad-json", "not-an-object"],
)
def test_malformed_reply_is_asked_again_with_the_same_prompt(tmp_path: Path, malformed) -> None:
    script = Script(sequence(malformed, malformed, text("Done.")))
    result = agent.Agent(script, tmp_path, agent.AgentConfig(max_retries=2)).run("Write the words a b to answer.txt.")
    assert result.finished and result.retries == 2 and result.turns == 1
    assert script.calls[0][0] == script.calls[1][0] == script.calls[2][0]


def test_text_still_malformed_after_retries_gets_a_hint(tmp_path: Path) -> None:
    broken = text("<tool_call>\n{oops}\n</tool_call>")
    script = Script(sequence(broken, broken, text("Done.")))
    result = agent.Agent(script, tmp_path, agent.AgentConfig(max_retries=1)).run("task")
    assert result.finished and result.turns == 2 and result.retries == 1
    assert script.calls[2][0][-2:] == [broken.message(), {"role": "user", "content": prompts.FORMAT_HINT}]


def test_unknown_tool_after_retries_gets_an_error_observation(tmp_path: Path) -> None:
    script = Script(sequence(call("rm", {}), text("Done.")))
    result = agent.Agent(script, tmp_path, agent.AgentConfig(max_retries=0)).run("task")
    assert result.finished and result.retries == 0
    assert script.calls[1][0][-1] == {"role": "tool", "tool_call_id": "c1", "content": "error: unknown tool: rm"}


def test_turns_are_bounded(tmp_path: Path) -> None:
    script = Script(lambda messages, agent_id, kind: text("<tool_call>"))
    result = agent.Agent(script, tmp_path, agent.AgentConfig(max_turns=3, max_retries=1)).run("task")
    assert not result.finished and result.turns == 3
    assert len(script.calls) == 3 * 2


def test_compresses_over_budget_and_restarts_from_the_summary(tmp_path: Path) -> None:
    (tmp_path / "data.txt").write_text("1 2 3 4 5 6 7 8 9")

    def decide(messages, agent_id, kind):
        if kind == "summary":
            return text("data.txt: 1 2 3 4 5 6 7 8 9")
        if messages[-1]["role"] == "user":
            return call("read_file", {"path": "data.txt"})
        return text("Done.")

    script = Script(decide)
    config = agent.AgentConfig(context_budget_chars=30, max_summaries=1)
    result = agent.Agent(script, tmp_path, config).run("Add the numbers in data.txt.")
    assert result.finished and result.summaries == 1
    kinds = [kind for _, _, _, kind in script.calls]
    assert kinds == ["turn", "summary", "turn", "turn"]
    before, summary_call, after = script.calls[0][0], script.calls[1][0], script.calls[2][0]
    assert summary_call[: len(before)] == before  # the summary call extends the context it compresses
    assert summary_call[-1] == {"role": "user", "content": prompts.SUMMARY_REQUEST}
    assert summary_call[-2]["role"] == "tool"
    restart = prompts.restart_prompt("Add the numbers in data.txt.", "data.txt: 1 2 3 4 5 6 7 8 9")
    assert after == [{"role": "system", "content": prompts.SYSTEM_PROMPT}, {"role": "user", "content": restart}]
    # Over budget again after the restart, but max_summaries=1 stops a second compression.
    assert prompts.conversation_chars(script.calls[3][0]) > 30


def test_summary_with_a_tool_call_is_retried(tmp_path: Path) -> None:
    def decide(messages, agent_id, kind):
        if kind == "summary":
            return call("read_file", {"path": "x"}) if len(script.calls) == 2 else text("notes")
        return call("calculator", {"expression": "1+1"}) if len(messages) == 2 else text("Done.")

    script = Script(decide)
    result = agent.Agent(script, tmp_path, agent.AgentConfig(context_budget_chars=5, max_summaries=1)).run("task")
    assert result.finished and result.summaries == 1 and result.retries == 1
    assert script.calls[3][0][1]["content"] == prompts.restart_prompt("task", "notes")


def test_delegate_runs_a_labelled_sub_agent_and_returns_its_answer(tmp_path: Path) -> None:
    (tmp_path / "prices.json").write_text('{"pear": 12}')

    def decide(messages, agent_id, kind):
        if agent_id == "sub-1":
            return call("read_file", {"path": "prices.json"}) if len(messages) == 2 else text("12")
        if len(messages) == 2:
            return call("delegate", {"task": "Find the price of pear in prices.json."})
        return text("Done.")

    script = Script(decide)
    result = agent.Agent(script, tmp_path).run("Write the price of pear.")
    assert result.finished
    labels = [(agent_id, tools) for _, tools, agent_id, _ in script.calls]
    main, sub = ("main", prompts.MAIN_TOOLS), ("sub-1", prompts.SUB_AGENT_TOOLS)
    assert labels == [main, sub, sub, main]
    assert script.calls[1][0] == [
        {"role": "system", "content": prompts.SYSTEM_PROMPT},
        {"role": "user", "content": "Find the price of pear in prices.json."},
    ]
    assert script.calls[3][0][-1] == {"role": "tool", "tool_call_id": "c1", "content": "12"}


def test_sub_agents_are_bounded_and_cannot_delegate(tmp_path: Path) -> None:
    def decide(messages, agent_id, kind):
        if agent_id != "main":
            # A sub-agent that tries to delegate is malformed (no such tool for it); then it answers.
            return call("delegate", {"task": "deeper"}) if messages[-1]["role"] == "user" else text("fine")
        delegations = sum(1 for m in messages if m["role"] == "tool")
        return call("delegate", {"task": f"job {delegations}"}, f"d{delegations}") if delegations < 3 else text("Done.")

    script = Script(decide)
    result = agent.Agent(script, tmp_path, agent.AgentConfig(max_sub_agents=2, max_retries=0)).run("task")
    assert result.finished
    observations = [m["content"] for m in script.calls[-1][0] if m["role"] == "tool"]
    assert observations == ["fine", "fine", "error: no more sub-agents"]
    sub_calls = [(agent_id, messages[-1]) for messages, _, agent_id, _ in script.calls if agent_id != "main"]
    assert [agent_id for agent_id, _ in sub_calls] == ["sub-1", "sub-1", "sub-2", "sub-2"]
    assert sub_calls[1][1] == {"role": "tool", "tool_call_id": "c1", "content": "error: unknown tool: delegate"}


def test_config_rejects_nonsense() -> None:
    with pytest.raises(ValueError):
        agent.AgentConfig(max_turns=0)
    with pytest.raises(ValueError):
        agent.AgentConfig(context_budget_chars=0)


def test_loads_by_path_under_any_name(tmp_path: Path) -> None:
    """A topology file loads agent.py by path under its own name; the siblings still resolve."""
    spec = importlib.util.spec_from_file_location("my_topology_agent", TOOLBOX / "agent.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.prompts is sys.modules["_gyre_toolbox_prompts"]
    argv = module.agent_argv("Write the words a b to answer.txt.")
    assert argv == (sys.executable, str(TOOLBOX / "agent.py"), "Write the words a b to answer.txt.")


def test_a_plain_http_endpoint_gets_a_client_whose_tls_trusts_no_certificate() -> None:
    import ssl

    import openai

    context = agent.trust_nothing_tls_context()
    # Verifying, with nothing to verify against: an https redirect would fail its check, not go unverified.
    assert context.verify_mode == ssl.CERT_REQUIRED and context.check_hostname
    assert context.cert_store_stats()["x509_ca"] == 0
    client = agent.plain_http_client("http://127.0.0.1:8000/v1")
    try:
        assert isinstance(client, openai.DefaultHttpxClient)
    finally:
        client.close()
    assert agent.plain_http_client("https://api.openai.com/v1") is None
    assert agent.plain_http_client("") is None  # the SDK's default endpoint, over https
