"""Scripted expert for the toolbox tasks: the policy that writes the warm-start demonstrations.

The expert is a policy over conversations, like the model: `expert_reply(messages)` reads the task from the user
message (with the notes of a compressed context, if any) and the tool results so far, and answers with the next
assistant message in OpenAI form. To make demonstrations it drives agent.py's own loop (Agent) with the real
tools in a temporary workspace, so the demonstrations carry exactly the agent's system prompt, tool schemas,
summary protocol and sub-agent prompts: main turns, summary calls (the tasks of kinds "total" and "helper" pass
the context budget), and delegate sub-agents ("cost" and "helper"). A demonstration that does not solve its task
is a bug in the expert and raises ExpertFailed.

    python expert.py --tasks 20 --seed 0 --stats        # sizes of the demonstrations
    python expert.py --tasks 300 --seed 0 --jsonl demos.jsonl
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import re
import statistics
import string
import sys
import tempfile
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

import attrs
import structlog


def _load_sibling(name: str) -> ModuleType:
    """Same loader as agent.load_sibling (one private module name per file), needed before agent is loaded."""
    qualified = f"_gyre_toolbox_{name}"
    module = sys.modules.get(qualified)
    if module is None:
        spec = importlib.util.spec_from_file_location(qualified, Path(__file__).resolve().with_name(f"{name}.py"))
        assert spec is not None and spec.loader is not None, name
        module = importlib.util.module_from_spec(spec)
        sys.modules[qualified] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[qualified]
            raise
    return module


agent = _load_sibling("agent")
prompts = agent.load_sibling("prompts")
tasks = agent.load_sibling("tasks")
score = agent.load_sibling("score")

_QUIET = structlog.wrap_logger(
    structlog.PrintLogger(sys.stderr), wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING)
)
"""The agent loop's logger while the expert plays it: only warnings (hundreds of runs would flood the log)."""

SUBTASKS: dict[str, str] = {
    "price": "Find the price of {item} in prices.json.",
    "add": "Add the numbers in a.txt, b.txt, c.txt and d.txt.",
}
"""What the expert asks its sub-agents (the model learns to write these as delegate arguments)."""


class UnknownPrompt(ValueError):
    """The conversation's task is not one of the toolbox prompts."""


class ExpertFailed(RuntimeError):
    """The expert's conversation did not solve its task: a bug in the expert, never a model outcome."""


Values = dict[str, str]
"""What the expert knows, by name: a file's text under its path, "result" of the calculator, "answer" of a
sub-agent, "answer.txt" = "ok" once written. Summaries are these values as "name: value" lines."""


@attrs.frozen
class Step:
    """One tool call of a plan; its observation becomes the value `name`."""

    name: str
    tool: str
    needs: tuple[str, ...]
    arguments: Callable[[Values], dict[str, str]]


@attrs.frozen
class Plan:
    """A fixed sequence of tool calls, then a final text."""

    steps: tuple[Step, ...]
    final: Callable[[Values], str]
    final_needs: tuple[str, ...] = ()


def _numbers(text: str) -> list[str]:
    return re.findall(r"-?\d+", text)


def _price(prices_json: str, item: str) -> str:
    return str(json.loads(prices_json)[item])


def _read(path: str) -> Step:
    return Step(path, "read_file", (), lambda values: {"path": path})


def _calculate(expression: Callable[[Values], str], needs: tuple[str, ...] = ()) -> Step:
    return Step("result", "calculator", needs, lambda values: {"expression": expression(values)})


def _delegate(task: str) -> Step:
    return Step("answer", "delegate", (), lambda values: {"task": task})


def _write(content: Callable[[Values], str], needs: tuple[str, ...] = ()) -> Step:
    answer = tasks.ANSWER_FILE
    return Step(answer, "write_file", needs, lambda values: {"path": answer, "content": content(values)})


def _done(values: Values) -> str:
    return prompts.FINAL_TEXT


def _add_files(paths: tuple[str, ...]) -> tuple[Step, ...]:
    def expression(values: Values) -> str:
        return "+".join(number for path in paths for number in _numbers(values[path]))

    return (*(_read(path) for path in paths), _calculate(expression, paths))


_WRITE_RESULT = _write(lambda v: v["result"], ("result",))

_MAIN_PLANS: dict[str, Callable[[dict[str, str]], Plan]] = {
    "write": lambda p: Plan((_write(lambda v: p["words"]),), _done),
    "calc": lambda p: Plan((_calculate(lambda v: p["expression"]), _WRITE_RESULT), _done),
    "sum": lambda p: Plan(
        (_read("data.txt"), _calculate(lambda v: "+".join(_numbers(v["data.txt"])), ("data.txt",)), _WRITE_RESULT),
        _done,
    ),
    "lookup": lambda p: Plan(
        (_read("prices.json"), _write(lambda v: _price(v["prices.json"], p["item"]), ("prices.json",))), _done
    ),
    "cost": lambda p: Plan(
        (
            _delegate(SUBTASKS["price"].format(item=p["item"])),
            _calculate(lambda v: f"{v['answer']}*{p['quantity']}", ("answer",)),
            _WRITE_RESULT,
        ),
        _done,
    ),
    "total": lambda p: Plan((*_add_files(("a.txt", "b.txt", "c.txt")), _WRITE_RESULT), _done),
    "helper": lambda p: Plan((_delegate(SUBTASKS["add"]), _write(lambda v: v["answer"], ("answer",))), _done),
}
_SUB_PLANS: dict[str, Callable[[dict[str, str]], Plan]] = {
    "price": lambda p: Plan(
        (_read("prices.json"),), lambda v: _price(v["prices.json"], p["item"]), ("prices.json",)
    ),
    "add": lambda p: Plan(_add_files(("a.txt", "b.txt", "c.txt", "d.txt")), lambda v: v["result"], ("result",)),
}


def _template_regex(template: str) -> re.Pattern[str]:
    pattern = ""
    for literal, field, _, _ in string.Formatter().parse(template):
        pattern += re.escape(literal)
        if field is not None:
            pattern += f"(?P<{field}>.+?)"
    return re.compile(pattern)


_PATTERNS = [
    (_template_regex(template), plans[kind])
    for templates, plans in ((tasks.PROMPTS, _MAIN_PLANS), (SUBTASKS, _SUB_PLANS))
    for kind, template in templates.items()
]


def plan_for(task_prompt: str) -> Plan:
    """The expert's plan for a main task prompt or one of its own sub-agent tasks."""
    for pattern, make_plan in _PATTERNS:
        match = pattern.fullmatch(task_prompt)
        if match:
            return make_plan(match.groupdict())
    raise UnknownPrompt(f"not a toolbox task: {task_prompt!r}")


def _known_values(plan: Plan, notes: str, messages: list[dict[str, Any]]) -> Values:
    """Values from the notes of a compressed context, then from this context's tool results, in order."""
    values: Values = {}
    for line in notes.splitlines():
        name, separator, value = line.partition(": ")
        if separator:
            values[name] = value
    calls: dict[str, tuple[str, Any]] = {}
    for message in messages:
        for call in message.get("tool_calls") or ():
            try:
                calls[call["id"]] = (call["function"]["name"], json.loads(call["function"]["arguments"]))
            except (KeyError, json.JSONDecodeError):
                continue
        if message.get("role") != "tool" or message.get("tool_call_id") not in calls:
            continue
        result = message.get("content") or ""
        if result.startswith("error:"):  # a failed call is not knowledge; the plan makes it again
            continue
        tool, arguments = calls[message["tool_call_id"]]
        for step in plan.steps:
            if step.tool == tool and all(need in values for need in step.needs) and step.arguments(values) == arguments:
                values[step.name] = result
                break
    return values


def _progress(plan: Plan, values: Values) -> int:
    """Index of the last step whose value is known (-1 before the first)."""
    return max((index for index, step in enumerate(plan.steps) if step.name in values), default=-1)


def _summary(plan: Plan, values: Values) -> str:
    """Notes that let the plan go on: the last value reached and every value a remaining step needs."""
    last = _progress(plan, values)
    needed = {need for step in plan.steps[last + 1 :] for need in step.needs} | set(plan.final_needs)
    if last >= 0:
        needed.add(plan.steps[last].name)
    names = [step.name for step in plan.steps if step.name in needed and step.name in values]
    return "\n".join(f"{name}: {values[name]}" for name in dict.fromkeys(names))


def expert_reply(messages: list[dict[str, Any]]) -> dict[str, Any]:
    """The expert's next assistant message (OpenAI form) for a toolbox conversation.

    messages[1] is the agent's first user message: a task prompt, possibly followed by the notes of a compressed
    context. A last user message equal to prompts.SUMMARY_REQUEST asks for notes.
    """
    if len(messages) < 2 or messages[1].get("role") != "user":
        raise UnknownPrompt("a toolbox conversation starts with a system and a user message")
    task_prompt, notes = prompts.split_restart_prompt(messages[1]["content"])
    plan = plan_for(task_prompt)
    values = _known_values(plan, notes, messages)
    if messages[-1].get("role") == "user" and messages[-1].get("content") == prompts.SUMMARY_REQUEST:
        return {"role": "assistant", "content": _summary(plan, values)}
    last = _progress(plan, values)
    if last + 1 >= len(plan.steps):
        return {"role": "assistant", "content": plan.final(values)}
    step = plan.steps[last + 1]
    number = sum(1 for message in messages if message.get("role") == "tool") + 1
    call = {
        "id": f"call_{number}",
        "type": "function",
        "function": {"name": step.tool, "arguments": prompts.tool_arguments_json(step.arguments(values))},
    }
    return {"role": "assistant", "content": "", "tool_calls": [call]}


def reply_from_message(message: dict[str, Any]) -> Any:
    """An assistant message in OpenAI form as agent.ModelReply."""
    calls = tuple(
        agent.ToolCall(call["id"], call["function"]["name"], call["function"]["arguments"])
        for call in message.get("tool_calls") or ()
    )
    return agent.ModelReply(message.get("content") or "", calls, "tool_calls" if calls else "stop")


@attrs.frozen
class Demonstration:
    """One conversation to fine-tune on: every assistant message in it is a target."""

    task_id: str
    agent_id: str
    """"main" or "sub-N", as the agent labels its calls."""
    call_kind: str
    """Kind of the conversation's last call: "turn", or "summary" when it ends with a compression."""
    messages: tuple[dict[str, Any], ...]
    """OpenAI-style messages: system, user, assistant (with tool_calls), tool, ... ending with an assistant."""
    tools: tuple[dict[str, Any], ...]
    """OpenAI tool schemas the conversation was made with (rendered into the system prompt)."""

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (one JSONL line)."""
        return {
            "task_id": self.task_id,
            "agent_id": self.agent_id,
            "call_kind": self.call_kind,
            "messages": list(self.messages),
            "tools": list(self.tools),
        }


class _RecordingExpert:
    """agent.CallModel played by the expert; remembers every call with its reply."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, tuple[dict[str, Any], ...], tuple[dict[str, Any], ...]]] = []

    def __call__(
        self, messages: list[dict[str, Any]], tools_: tuple[dict[str, Any], ...], agent_id: str, call_kind: str
    ) -> Any:
        reply = reply_from_message(expert_reply(messages))
        self.calls.append((agent_id, call_kind, tuple(messages) + (reply.message(),), tools_))
        return reply


def _maximal(calls: list[tuple[str, str, tuple[dict[str, Any], ...], tuple[dict[str, Any], ...]]]) -> list[int]:
    """Indices of calls whose conversation is not a prefix of a later one (those are covered by it)."""
    kept = []
    for index, (_, _, conversation, tools_) in enumerate(calls):
        covered = any(
            other_tools == tools_ and len(other) > len(conversation) and other[: len(conversation)] == conversation
            for _, _, other, other_tools in calls
        )
        if not covered:
            kept.append(index)
    return kept


def solve(task: Any, workspace: Path, config: Any = None) -> tuple[Any, tuple[Demonstration, ...]]:
    """Run agent.Agent on `task` with the expert as its model, in `workspace` (filled with the task's files).

    Returns the main agent's result and the demonstrations (maximal conversations, in the order they ended).
    Raises ExpertFailed if the workspace does not score as a success.
    """
    tasks.write_workspace(task, workspace)
    model = _RecordingExpert()
    config = config if config is not None else agent.AgentConfig()
    result = agent.Agent(model, workspace, config, logger=_QUIET).run(task.prompt)
    verdict = score.score_workspace(workspace, tasks.ANSWER_FILE, task.expected)
    if not (result.finished and verdict["success"]):
        raise ExpertFailed(f"expert did not solve {task.task_id}: finished={result.finished} score={verdict}")
    demonstrations = tuple(
        Demonstration(task.task_id, agent_id, call_kind, conversation, tools_)
        for agent_id, call_kind, conversation, tools_ in (model.calls[i] for i in _maximal(model.calls))
    )
    return result, demonstrations


def demonstrations(
    n: int, seed: int, *, config: Any = None, kinds: tuple[str, ...] | None = None
) -> list[Demonstration]:
    """Demonstrations for `n` training tasks generated from `seed` (1 to 3 conversations per task).

    Only the train split is used, so held-out evaluation never sees a demonstrated task.
    """
    chosen = tasks.generate_tasks(seed, "train", n, kinds=kinds if kinds is not None else tasks.KINDS)
    result: list[Demonstration] = []
    for task in chosen:
        with tempfile.TemporaryDirectory(prefix="toolbox-expert-") as directory:
            result.extend(solve(task, Path(directory), config)[1])
    return result


def _stats(demos: list[Demonstration]) -> dict[str, Any]:
    by_kind: dict[str, list[int]] = {}
    for demo in demos:
        key = f"{demo.agent_id.split('-')[0]}-{demo.call_kind}"
        by_kind.setdefault(key, []).append(prompts.conversation_chars(list(demo.messages)))
    whole = [len(json.dumps(demo.to_json()["messages"], ensure_ascii=False)) for demo in demos]
    return {
        "conversations": len(demos),
        "tools_json_chars": len(json.dumps(list(prompts.MAIN_TOOLS))),
        "messages_json_chars_median": statistics.median(whole),
        "messages_json_chars_max": max(whole),
        "content_chars_by_kind": {
            key: {"count": len(sizes), "median": statistics.median(sizes), "max": max(sizes)}
            for key, sizes in sorted(by_kind.items())
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Write toolbox demonstrations made by the scripted expert.")
    parser.add_argument("--tasks", type=int, default=20, help="number of training tasks")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--jsonl", type=Path, help="write one demonstration per line here")
    parser.add_argument("--stats", action="store_true", help="print sizes as JSON")
    args = parser.parse_args(argv)
    demos = demonstrations(args.tasks, args.seed)
    if args.jsonl is not None:
        with args.jsonl.open("w", encoding="utf-8") as handle:
            for demo in demos:
                handle.write(json.dumps(demo.to_json(), ensure_ascii=False) + "\n")
    if args.stats or args.jsonl is None:
        print(json.dumps(_stats(demos), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
