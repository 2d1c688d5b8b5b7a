"""Streaming a turn while it is generated: content and tool-call deltas that never have to be taken back.

The proxy answers a streamed call with the same content and tool calls as a non-streamed one (`ProxyService._decode`:
decode the ids, cut at a matched stop string, split `<tool_call>` blocks out of the text). Nothing sent can be
unsent, so `TurnStreamer` only sends text that is *settled*: certain to be a prefix of that final content whatever
tokens come next. It holds back
- bytes of a character that is not complete yet (the decode ends with U+FFFD),
- a trailing stop token (the final text drops it) and, with stop strings, everything from the first occurrence of
  one, and a tail that could be the beginning of one,
- with tools, everything from a `<tool_call>` that is not closed yet (or a tail that could begin one): when the block
  closes it is either a call (sent as a tool-call delta) or malformed (it stays in the content as text, as in a
  non-streamed answer), and trailing whitespace (the parser strips the content).
Settled text without open tags only grows by appending, and the parser's content of a prefix of it is a prefix of the
parser's content of the whole (pieces are stripped of newlines and joined by "\\n"), so deltas are the new suffix of
`parse_tool_calls(settled).content`. Each `<tool_call>` position is a checkpoint, so a call is sent after the text
before it and before the text after it. At the end, `finish` takes the final text and sends what is left.

Decoding is incremental (the new ids are decoded together with the previous chunk's, and the difference taken, as
vLLM's detokenizer does), so a long turn does not re-decode its whole output on every chunk.
"""

from __future__ import annotations

from typing import Callable, Iterable, Sequence

import attrs
import structlog

from gyre.engines.tool_calls import TOOL_CALL_CLOSE, TOOL_CALL_OPEN, ParsedOutput, ToolCall, parse_tool_calls

__all__ = ["TextDelta", "ToolCallDelta", "TurnStreamer"]

log = structlog.get_logger(__name__)


@attrs.frozen
class TextDelta:
    text: str
    """Content to append to what was sent before."""


@attrs.frozen
class ToolCallDelta:
    index: int
    """0-based position of the call in the turn's tool calls."""
    call: ToolCall


Delta = TextDelta | ToolCallDelta


def _partial_start(text: str, token: str) -> int:
    """Where the longest suffix of `text` that is a proper prefix of `token` begins (len(text) if none)."""
    for size in range(min(len(token) - 1, len(text)), 0, -1):
        if text.endswith(token[:size]):
            return len(text) - size
    return len(text)


def _open_tag_hold(text: str) -> int:
    """Where text that may still become part of a tool-call block begins: the last `<tool_call>` without a closing
    tag after it (an earlier unclosed one can never close: a block may not contain an opening tag), or a tail that
    could begin an opening tag."""
    cut = _partial_start(text, TOOL_CALL_OPEN)
    last_open = text.rfind(TOOL_CALL_OPEN)
    if last_open >= 0 and text.find(TOOL_CALL_CLOSE, last_open) < 0:
        cut = min(cut, last_open)
    return cut


class TurnStreamer:
    """Turns a growing list of output ids into deltas of the final content and tool calls (see the module doc).

    `decode(ids)` is the template's decode (special tokens kept, as the proxy decodes); `stop_token_ids` end a turn
    and are not text; `stop` are the call's stop strings; `parse_tools` is whether the call offered tools.
    """

    def __init__(
        self,
        decode: Callable[[list[int]], str],
        stop_token_ids: Iterable[int],
        stop: Sequence[str] = (),
        parse_tools: bool = False,
    ) -> None:
        self._decode = decode
        self._stop_ids = frozenset(stop_token_ids)
        self._stop = tuple(stop)
        self._parse_tools = parse_tools
        self._ids: list[int] = []
        self._held_stop_id: int | None = None
        self._prefix_offset = 0
        self._read_offset = 0
        self._text = ""
        self._settled_length = -1
        self._checkpoint = 0
        """Text position up to which every `<tool_call>` checkpoint has been handled."""
        self.sent_content = ""
        self.sent_calls: list[ToolCall] = []
        self.consistent = True
        """False when the final answer did not extend what was streamed (then the rest could not be sent)."""

    # -- feeding ---------------------------------------------------------------------------------------------

    def feed(self, ids: Iterable[int]) -> list[Delta]:
        """New output ids (in order, never repeated) -> the deltas they settle."""
        new = list(ids)
        if not new:
            return []
        if self._held_stop_id is not None:
            new.insert(0, self._held_stop_id)  # not the last token after all: it is text like any other
            self._held_stop_id = None
        if new[-1] in self._stop_ids:
            self._held_stop_id = new.pop()
        if not new:
            return []
        self._ids.extend(new)
        self._decode_new()
        return self._settle(self._settled_text(), final=False)

    def finish(self, final_text: str, parsed: ParsedOutput | None) -> list[Delta]:
        """The end: `final_text` is the turn's text after the stop-string cut, `parsed` its tool-call split (None
        when the call had no tools: the content is the text). Returns what is left to send."""
        self._text = final_text
        deltas = self._settle(final_text, final=True)
        final_content = parsed.content if parsed is not None else final_text
        final_calls = list(parsed.tool_calls) if parsed is not None else []
        if self.sent_content != final_content or self.sent_calls != final_calls:
            # Cannot happen when the settled text is a prefix of the final one; if a tokenizer's decode is not
            # prefix-stable it might: the client then assembles something other than what was recorded.
            self.consistent = False
            log.warning("streamed_turn_does_not_extend_to_the_final_answer", sent=len(self.sent_content),
                        final=len(final_content), sent_calls=len(self.sent_calls), final_calls=len(final_calls))
        return deltas

    # -- internals -------------------------------------------------------------------------------------------

    def _decode_new(self) -> None:
        ids = self._ids
        before = self._decode(ids[self._prefix_offset : self._read_offset])
        after = self._decode(ids[self._prefix_offset :])
        if after.endswith("\ufffd"):
            return  # a character split across tokens: wait for its remaining bytes
        if after.startswith(before):
            self._text += after[len(before) :]
        else:  # pragma: no cover - a decoder whose output is not prefix-stable (never for byte-level BPE)
            self._text = self._decode(ids)
        self._prefix_offset = self._read_offset
        self._read_offset = len(ids)

    def _settled_text(self) -> str:
        text = self._text
        cut = len(text)
        for stop in self._stop:
            found = text.find(stop)
            if found >= 0:
                cut = min(cut, found)
            cut = min(cut, _partial_start(text, stop))
        if self._parse_tools:
            cut = min(cut, _open_tag_hold(text), _open_tag_hold(text[:cut]))
        return text[:cut]

    def _settle(self, settled: str, final: bool) -> list[Delta]:
        if len(settled) == self._settled_length and not final:
            return []
        self._settled_length = len(settled)
        if not self._parse_tools:
            return self._content_to(settled, strip=False)
        deltas: list[Delta] = []
        if TOOL_CALL_OPEN in settled or TOOL_CALL_CLOSE in settled:
            # One checkpoint per opening tag: the text before a block goes before its call.
            position = settled.find(TOOL_CALL_OPEN, self._checkpoint)
            while position >= 0:
                deltas.extend(self._parsed_to(parse_tool_calls(settled[:position])))
                self._checkpoint = position + 1
                position = settled.find(TOOL_CALL_OPEN, self._checkpoint)
            deltas.extend(self._parsed_to(parse_tool_calls(settled)))
            return deltas
        return self._content_to(settled, strip=True)

    def _content_to(self, content: str, strip: bool) -> list[Delta]:
        if strip:
            content = content.strip()
        if len(content) <= len(self.sent_content) or not content.startswith(self.sent_content):
            return []
        delta = content[len(self.sent_content) :]
        self.sent_content = content
        return [TextDelta(delta)]

    def _parsed_to(self, parsed: ParsedOutput) -> list[Delta]:
        deltas: list[Delta] = []
        calls = parsed.tool_calls
        if tuple(self.sent_calls) != calls[: len(self.sent_calls)]:
            return []  # pragma: no cover - closed blocks never change; see the module doc
        for index in range(len(self.sent_calls), len(calls)):
            deltas.append(ToolCallDelta(index, calls[index]))
            self.sent_calls.append(calls[index])
        deltas.extend(self._content_to(parsed.content, strip=False))
        return deltas
