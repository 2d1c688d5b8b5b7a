"""The words the toolbox agent and its scripted expert share: system prompt, tool schemas, summary protocol.

Why one module: supervised warm-start only helps if the demonstrations look token for token like what the agent
sends at run time. agent.py and expert.py both take every string and schema from here, so they cannot drift.

Everything is kept short on purpose: the tiny model has a small context, and the system prompt with the tool
schemas is rendered into every call.
"""

from __future__ import annotations

import json
from typing import Any

SYSTEM_PROMPT = "You are an agent in a workspace. Use the tools. Say Done. when finished."
"""System message of the main agent and of every sub-agent."""

SUMMARY_REQUEST = "Summarize your progress as notes."
"""User message appended to the conversation for a context-compression call (X-Gyre-Call: summary)."""

NOTES_HEADER = "\nNotes:\n"
"""Joins the original task and the summary in the user message that restarts a compressed context."""

FORMAT_HINT = "error: malformed tool call"
"""User message after a reply whose tool calls stayed malformed through every retry."""

FINAL_TEXT = "Done."
"""The main agent's last message once the answer is written."""


def _function(name: str, description: str, **properties: str) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": {key: {"type": kind} for key, kind in properties.items()},
                "required": list(properties),
            },
        },
    }


READ_FILE = _function("read_file", "Read a file.", path="string")
WRITE_FILE = _function("write_file", "Write a file.", path="string", content="string")
CALCULATOR = _function("calculator", "Evaluate arithmetic.", expression="string")
DELEGATE = _function("delegate", "Give a task to a sub-agent; returns its answer.", task="string")

MAIN_TOOLS: tuple[dict[str, Any], ...] = (READ_FILE, WRITE_FILE, CALCULATOR, DELEGATE)
"""Tools of the main agent."""

SUB_AGENT_TOOLS: tuple[dict[str, Any], ...] = (READ_FILE, WRITE_FILE, CALCULATOR)
"""Tools of a sub-agent: no delegate, so sub-agents cannot spawn sub-agents (bounds the tree's depth at two)."""


def tool_names(tools: tuple[dict[str, Any], ...]) -> frozenset[str]:
    """Names of the functions in OpenAI tool schemas."""
    return frozenset(tool["function"]["name"] for tool in tools)


def tool_arguments_json(arguments: dict[str, Any]) -> str:
    """Arguments as the model writes them inside <tool_call> (json.dumps defaults, non-ASCII kept)."""
    return json.dumps(arguments, ensure_ascii=False)


def restart_prompt(task_prompt: str, summary: str) -> str:
    """The user message that replaces a compressed context: the task, then the model's own notes."""
    return task_prompt + NOTES_HEADER + summary


def split_restart_prompt(text: str) -> tuple[str, str]:
    """Inverse of restart_prompt: (task prompt, notes); notes are "" for a first, uncompressed context."""
    task_prompt, _, notes = text.partition(NOTES_HEADER)
    return task_prompt, notes


def conversation_chars(messages: list[dict[str, Any]]) -> int:
    """Size of a conversation as the compression rule counts it: every message's text except the system prompt.

    The system prompt and tool schemas are the same in every call, so they are left out: the budget measures
    what the agent accumulated. Tool calls count their name and JSON arguments.
    """
    total = 0
    for message in messages:
        if message.get("role") == "system":
            continue
        total += len(message.get("content") or "")
        for call in message.get("tool_calls") or ():
            function = call.get("function", {})
            total += len(function.get("name", "")) + len(function.get("arguments", ""))
    return total
