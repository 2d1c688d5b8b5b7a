"""The scripted expert: its demonstrations solve their tasks when replayed against the real tools."""

from __future__ import annotations

import collections
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

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


expert = load("expert")
tasks = load("tasks")
tools = load("tools")
prompts = load("prompts")
score = load("score")

SEED = 5
TASKS_PER_KIND = 2


@pytest.fixture(scope="module")
def demos():
    count = TASKS_PER_KIND * len(tasks.KINDS)
    return tasks.generate_tasks(SEED, "train", count), expert.demonstrations(count, SEED)


def replay(task, conversations, workspace: Path) -> None:
    """Re-run every tool call of the task's conversations against the real tools; observations must match."""
    tasks.write_workspace(task, workspace)
    sub_answers = {
        prompts.split_restart_prompt(demo.messages[1]["content"])[0]: demo.messages[-1]["content"]
        for demo in conversations
        if demo.agent_id != "main" and demo.call_kind == "turn"
    }
    for demo in conversations:
        messages = list(demo.messages)
        assert messages[0] == {"role": "system", "content": prompts.SYSTEM_PROMPT}
        assert messages[-1]["role"] == "assistant" and "tool_calls" not in messages[-1]
        results = {m["tool_call_id"]: m["content"] for m in messages if m["role"] == "tool"}
        for message in messages:
            for call in message.get("tool_calls") or ():
                name, arguments = call["function"]["name"], json.loads(call["function"]["arguments"])
                assert call["function"]["arguments"] == json.dumps(arguments, ensure_ascii=False)
                if name == "delegate":
                    # The sub-agent's own task, notes stripped, names the conversation whose answer came back.
                    assert results[call["id"]] == sub_answers[arguments["task"]]
                else:
                    assert tools.run_tool(workspace, name, arguments) == results[call["id"]]


def test_demonstrations_solve_their_tasks_when_replayed(demos, tmp_path: Path) -> None:
    chosen, conversations = demos
    by_task = collections.defaultdict(list)
    for demo in conversations:
        by_task[demo.task_id].append(demo)
    assert set(by_task) == {task.task_id for task in chosen}
    for task in chosen:
        workspace = tmp_path / task.task_id
        replay(task, by_task[task.task_id], workspace)
        verdict = score.score_workspace(workspace, tasks.ANSWER_FILE, task.expected)
        assert verdict == {"reward": 1.0, "success": True}, task
    # The scorer's command line agrees (test_toolbox_tasks covers it further; one subprocess here suffices).
    completed = subprocess.run(task.scorer_argv, cwd=workspace, capture_output=True, text=True, timeout=60)
    assert json.loads(completed.stdout) == {"reward": 1.0, "success": True}


def test_demonstrations_hold_all_four_call_kinds(demos) -> None:
    _, conversations = demos
    kinds = collections.Counter((demo.agent_id.split("-")[0], demo.call_kind) for demo in conversations)
    assert set(kinds) == {("main", "turn"), ("main", "summary"), ("sub", "turn"), ("sub", "summary")}
    for demo in conversations:
        assert demo.tools == (prompts.MAIN_TOOLS if demo.agent_id == "main" else prompts.SUB_AGENT_TOOLS)
        if demo.call_kind == "summary":
            assert demo.messages[-2] == {"role": "user", "content": prompts.SUMMARY_REQUEST}
            # Notes are smaller than the context they replace.
            assert len(demo.messages[-1]["content"]) < prompts.conversation_chars(list(demo.messages[2:-2]))


def test_context_after_a_summary_starts_from_its_notes(demos) -> None:
    _, conversations = demos
    for before, after in zip(conversations, conversations[1:]):
        if before.call_kind == "summary" and after.agent_id == before.agent_id:
            task_prompt = before.messages[1]["content"]
            assert after.messages[1]["content"] == prompts.restart_prompt(task_prompt, before.messages[-1]["content"])
            break
    else:
        pytest.fail("no summary followed by its restarted context")


def test_demonstrations_are_deterministic_and_json_ready(demos) -> None:
    _, conversations = demos
    again = expert.demonstrations(TASKS_PER_KIND * len(tasks.KINDS), SEED)
    assert again == conversations
    line = json.dumps(conversations[0].to_json())
    assert json.loads(line)["messages"] == list(conversations[0].messages)


def test_demonstrations_come_from_the_train_split_only(demos) -> None:
    chosen, _ = demos
    assert all(task.split == "train" for task in chosen)


def test_expert_reply_is_a_policy_over_messages() -> None:
    task = tasks.generate_tasks(0, "train", 1, kinds=("calc",))[0]
    messages = [{"role": "system", "content": prompts.SYSTEM_PROMPT}, {"role": "user", "content": task.prompt}]
    reply = expert.expert_reply(messages)
    expression = task.prompt.split()[1]
    assert reply["tool_calls"][0]["function"] == {
        "name": "calculator",
        "arguments": json.dumps({"expression": expression}),
    }
    # A failed observation is not knowledge: the expert makes the call again.
    messages += [reply, {"role": "tool", "tool_call_id": reply["tool_calls"][0]["id"], "content": "error: busy"}]
    assert expert.expert_reply(messages)["tool_calls"][0]["function"]["name"] == "calculator"
    with pytest.raises(expert.UnknownPrompt):
        expert.expert_reply([messages[0], {"role": "user", "content": "Tell me a joke."}])
