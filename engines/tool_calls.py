"""The `<tool_call>` text format: how a Qwen3-style model writes tool calls, and how the chat template renders them.

A model emits tool calls as text, one block per call, after any ordinary content:

    I will look.
    <tool_call>
    {"name": "read", "arguments": {"path": "a.txt"}}
    </tool_call>
    <tool_call>
    {"name": "ls", "arguments": {}}
    </tool_call>

`render_tool_calls` writes exactly this (json.dumps with default separators, ensure_ascii=False; content, then "\n"
before each block); the chat template renders the same text for an assistant message with tool calls, so a parsed
turn re-renders to what the model wrote. `parse_tool_calls` reads it back. The parser never fails: a model under
training writes broken blocks (cut off by max_tokens, invalid JSON, no name), and an agent must see those as text
rather than as an error, so a malformed block stays in the content verbatim and `malformed` says so.
"""

from __future__ import annotations

import json
import re
from typing import Any, Iterable

import attrs

__all__ = [
    "TOOL_CALL_OPEN",
    "TOOL_CALL_CLOSE",
    "ToolCall",
    "ParsedOutput",
    "parse_tool_calls",
    "render_tool_call",
    "render_tool_calls",
    "canonical_arguments_json",
]

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"

# One block: an opening tag, a body with no other opening tag, the first closing tag. Non-greedy so that two blocks
# in a row are two matches; the body may not hold an opening tag so that an unclosed block does not swallow the good
# block after it; DOTALL because the JSON may span lines.
_BLOCK = re.compile(
    re.escape(TOOL_CALL_OPEN) + r"((?:(?!" + re.escape(TOOL_CALL_OPEN) + r").)*?)" + re.escape(TOOL_CALL_CLOSE),
    re.DOTALL,
)


@attrs.frozen(slots=True)
class ToolCall:
    """One well-formed tool call: the tool's name and its arguments as a JSON object text."""

    name: str
    """The tool's name, as the model wrote it (whether the tool exists is the agent's business)."""
    arguments_json: str
    """The arguments, a JSON object rendered with json.dumps(ensure_ascii=False) (OpenAI's `arguments` field)."""

    @property
    def arguments(self) -> dict[str, Any]:
        """The arguments as a dict (Anthropic's `input` field)."""
        return json.loads(self.arguments_json)


@attrs.frozen(slots=True)
class ParsedOutput:
    """A model's output text split into ordinary content and tool calls."""

    content: str
    """Text outside well-formed blocks, stripped of surrounding whitespace; malformed blocks stay here verbatim."""
    tool_calls: tuple[ToolCall, ...]
    """The well-formed calls, in the order the model wrote them."""
    malformed: bool
    """True when some `<tool_call>` or `</tool_call>` tag did not form a valid call (it was left in `content`)."""


def _parse_block(body: str) -> ToolCall | None:
    """One block's body -> a call, or None when it is not {"name": str, "arguments": object}."""
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):  # model output nested past Python's recursion limit is no call either
        return None
    if not isinstance(value, dict):
        return None
    name = value.get("name")
    if not isinstance(name, str) or not name:
        return None
    arguments = value.get("arguments", {})
    if isinstance(arguments, str):
        # Some models double-encode the arguments; accept a string that holds a JSON object.
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):
            return None
    if not isinstance(arguments, dict):
        return None
    try:
        arguments_json = json.dumps(arguments, ensure_ascii=False)
    except (ValueError, RecursionError):
        return None
    return ToolCall(name=name, arguments_json=arguments_json)


def parse_tool_calls(text: str) -> ParsedOutput:
    """Split `text` into content and tool calls; malformed blocks are kept as text and flagged, never raised."""
    if TOOL_CALL_OPEN not in text and TOOL_CALL_CLOSE not in text:
        return ParsedOutput(content=text.strip(), tool_calls=(), malformed=False)
    calls: list[ToolCall] = []
    kept: list[str] = []
    malformed = False
    position = 0
    for match in _BLOCK.finditer(text):
        call = _parse_block(match.group(1))
        if call is None:
            malformed = True
            continue  # the block stays in the text between `position` and the next good block
        kept.append(text[position : match.start()])
        calls.append(call)
        position = match.end()
    kept.append(text[position:])
    # Tags outside any good block (an unclosed block cut off by max_tokens, a stray closing tag) are malformed.
    rest = "".join(kept)
    if TOOL_CALL_OPEN in rest or TOOL_CALL_CLOSE in rest:
        malformed = True
    # The "\n" separators that render_tool_calls puts around blocks are not content.
    content = "\n".join(piece.strip("\n") for piece in kept if piece.strip()).strip()
    return ParsedOutput(content=content, tool_calls=tuple(calls), malformed=malformed)


def render_tool_call(name: str, arguments: dict[str, Any] | str) -> str:
    """One block, exactly as the model is trained to write it (arguments as a dict or a JSON object text)."""
    if isinstance(arguments, str):
        arguments = json.loads(arguments)
    body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"{TOOL_CALL_OPEN}\n{body}\n{TOOL_CALL_CLOSE}"


def render_tool_calls(content: str, tool_calls: Iterable[ToolCall]) -> str:
    """An assistant turn's text: the content, then each call's block, "\n" between the parts."""
    parts = [content] if content else []
    parts.extend(render_tool_call(call.name, call.arguments_json) for call in tool_calls)
    return "\n".join(parts)


def canonical_arguments_json(arguments: dict[str, Any] | str) -> str:
    """A stable text for comparing arguments that a client may have re-serialised (key order, spacing, escapes).

    Raises ValueError when `arguments` is a string that is not a JSON object.
    """
    if isinstance(arguments, str):
        arguments = json.loads(arguments)
    if not isinstance(arguments, dict):
        raise ValueError("tool call arguments must be a JSON object")
    return json.dumps(arguments, ensure_ascii=False, sort_keys=True, separators=(",", ":"))
