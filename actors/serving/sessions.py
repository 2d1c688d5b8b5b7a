"""Per-execution state of the proxy, and the model call itself: render, generate, decode, record, emit.

A call reaches this module as Gyre's neutral form (`ChatRequest`, whatever API it came through) and leaves it as a
`ChatOutcome` that the API module shapes; a refusal is an `ApiError` that the API module renders in its own shape.
`CallRunner` does the work in between: the prompt ids (`ExecutionSession.render`), one generation through the
backend (routing.py / backends.py), the decoded text split into content and tool calls, the turn recorded for id
reuse, and the `ModelCallCompleted` record handed to the proxy.

Token-in/token-out hinges on one rule: an assistant message that this execution's model generated earlier is
rendered with the exact ids the model produced, never by re-tokenising its text (text -> ids is not the inverse of
ids -> text: "ab" may have been generated as "a"+"b" and re-tokenise as "ab", and the trainer would then score a
sequence the policy never sampled). So every answered call stores its output ids under the normalised assistant
message the agent will send back (content + tool calls, tool-call ids ignored, arguments compared as JSON), and the
renderer swaps those ids in. The turn is rendered as generation prompt + output ids (+ `<|im_end|>` if the output
was cut short) + trailer, so the next call's prompt extends the previous call's prompt + output ids exactly.

When the same message was generated twice (two "OK" turns), the stored turn whose prompt equals the conversation so
far is preferred (a running SHA-256 over the ids makes that check O(new ids)); otherwise the latest one is used.

Each call sends the whole conversation again, so rendering is incremental: per conversation (a few per execution,
for sub-agents) the session keeps the last rendering's messages with the ids and running digest after each; a call
whose messages start with those renders only the messages after the common prefix. A stored turn that changes how
an assistant message resolves cuts the memo before the first such message, so the result always equals a rendering
from scratch: a message that resolved to the turn generated from its very prefix changes only when that turn is
replaced or evicted; one that took the latest turn with its key (or its text) changes with any turn of that key. So
an agent that answers "OK" many times does not make every later call re-render its conversation.

Incremental records (issue 29): a conversation's memo also knows the latest call rendered from it whose record was
handed on (its base) and how many of its parts that call's prompt had; the next call's record names that call
(`extends_call`), the tokens of its path the new prompt starts with (the parts, then as much of the base's generation
prompt + output as the new parts repeat: all of it when the agent sent the answer back) and only the ids after them,
with the running SHA-256 of the whole prompt the session computes anyway. Finding them costs the ids after the base's
parts, the messages new since that call. A cut of the memo (a turn that changes how an assistant message resolves)
or a fork (a retry, a sub-agent sharing the beginning) keeps the base but only for the parts still on its path; a
fresh conversation with the same system part (a compressed history, a new sub-agent) branches from a known call
after that part; a conversation with none carries its whole prompt.

A checkpoint's own chat template (issue 26): everything above relies on Gyre's template being decomposable per
message (a conversation's ids are its messages' ids, concatenated). A template a checkpoint brings need not be: a
default system prompt when none is given, a BOS only at the start, tool results grouped into one turn, Qwen3
dropping the `<think>` block of assistant turns before the last user message. For such a template
(`ChatTemplate.decomposable` false) a session renders the conversation's text through Jinja on every call (whole,
or a window: below) and tokenises only the text that is new: it remembers its
recent calls (`_Path`: messages, prompt ids in parts, the text they stand for in pieces, the places after special
tokens where the text may be cut and each side tokenised alone, the output), bounded by max_paths_per_execution.
Splitting a text right after a special token tokenises as the whole does for byte-level BPE tokenizers (the
tokenizer splits on special tokens first); `ChatTemplate.splits_at_special_tokens` probes it at load, and without
it every prompt is tokenised whole. What the prompt holds where the template re-renders a generated turn is
`ProxySessionsConfig.earlier_turns`:

- keep_generated (the default): when the conversation is a remembered call's conversation followed by that call's
  answer (the turn key, as above), the prompt is that call's prompt + output ids + the template's text after the
  answer, tokenised. That text is found by rendering the conversation with the answer replaced by a marker message
  (assistant, content a random token): what follows the marker is what the template writes after that turn, its
  turn end first (dropped when the output ended with a stop token, which stands for it, whichever stop token each
  is; kept when the output was cut short).
  So every call extends the previous call's prompt + output exactly, even after a new user message makes the
  template drop earlier thinking: the model's context holds its own earlier thinking, the execution's tree is one
  path, and each generated token is trained once, in the context it was generated in. The prompt then differs from
  apply_chat_template's (which has the thinking dropped): by design, and the record carries the prompt that was
  given. The marker render is a window: the system message, the marker and the messages after it (what the text
  after the marker depends on, for templates that render a message from itself and its neighbours), so a call
  costs its new messages, not its context (at 71K tokens, 1.5 ms a call against 40 ms for a whole render). That is
  checked, not assumed: the first four windowed renders of a ProxySessions and every 64th after also render whole
  (`WindowCheck`), and a difference or a window the template refuses (one that wants roles to alternate from a
  user message, say) switches windows off for good, logged; `window_renders=False` renders whole always.
- follow_template: the prompt's text is the template's render of the whole conversation, exactly. The ids of the remembered call sharing the
  most leading messages (its prompt + output) are kept up to the last special token before the point where the
  render departs from that call's text, and the rest is tokenised: a generated turn keeps its ids while the
  template writes it verbatim; once the template re-renders it (thinking dropped, tool-call arguments rewritten)
  the call branches there in the execution's tree, and the trajectory processor's rule (at most 5 trajectories,
  ranked main > summary > sub-agent) applies to the branches.

keep_generated falls back to the follow_template rendering when the conversation does not extend a remembered
call by its answer (the first call, an edited answer, a call evicted) or when the marker is not in the render once
(a template that rewrites assistant content). Either way the record's prompt ids are the ids the engine was given.
Tests: tests/integration/actors/serving/test_model_templates.py, with transformers' apply_chat_template as the oracle.

Streaming: `CallRunner.stream` runs the generation as its own task, which hands output ids to a bounded channel
instead of calling anything above it; the stream's reader takes them out one chunk at a time and gets the deltas
that `streaming.TurnStreamer` settles. The ids, log-probs, recorded turn and ModelCallCompleted are exactly those of
a non-streamed call. When the reader leaves (the agent closed the connection), the generation's next output raises
`ClientGone`, which aborts it; such a call is neither recorded nor emitted, unless its generation had completed.

Isolation: every piece of state hangs off one `ExecutionSession`, reachable only through that execution's API key;
no lookup crosses executions. Everything is bounded: the number of executions, the stored turns and the cached
message renderings per execution (least recently used go first).
"""

from __future__ import annotations

import asyncio
import bisect
import concurrent.futures
import functools
import hashlib
import hmac
import inspect
import json
import secrets
import sys
from array import array
from collections import OrderedDict, deque
from itertools import chain
from typing import Any, AsyncIterator, Awaitable, Callable, Hashable, Iterable, Mapping, Protocol, Sequence

import attrs
import structlog

from gyre.actors.errors import ActorError
from gyre.actors.serving.backends import (
    BackendRejected,
    BackendRequest,
    BackendResult,
    BackendUnavailable,
    GenerateBackend,
    OnOutput,
)
from gyre.actors.serving.prompt_ids import PromptIds
from gyre.actors.serving.streaming import Delta, TurnStreamer
from gyre.engines.temperature import logprob_temperature
from gyre.engines.tool_calls import ParsedOutput, ToolCall, canonical_arguments_json, parse_tool_calls
from gyre.messages.model_calls import ModelCallCompleted

__all__ = [
    "ApiError",
    "ChatRequest",
    "ChatOutcome",
    "CallContext",
    "IdFormat",
    "StreamStart",
    "StreamEnd",
    "ClientGone",
    "CallRunner",
    "OnCallCompleted",
    "StreamItem",
    "final_text",
    "prompt_chars",
    "short_error",
    "ProxySessionsConfig",
    "ProxySessions",
    "ExecutionSession",
    "WindowCheck",
    "RenderedPrompt",
    "PromptIds",
    "SessionsFull",
    "TemplateLike",
    "turn_key",
    "prompt_digest",
]

log = structlog.get_logger(__name__)


# -- the neutral call form ---------------------------------------------------------------------------------------


class ApiError(ActorError):
    """A request the proxy refuses; each API renders it in its own error shape.

    `kind` is one of: invalid_request (400), context_length (400), authentication (401), not_found (404),
    timeout (408), too_large (413), overloaded (503), server (500).
    """

    STATUS = {
        "invalid_request": 400,
        "context_length": 400,
        "authentication": 401,
        "not_found": 404,
        "timeout": 408,
        "too_large": 413,
        "overloaded": 503,
        "server": 500,
    }

    def __init__(self, kind: str, message: str, param: str | None = None) -> None:
        assert kind in self.STATUS, kind
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.param = param

    @property
    def status(self) -> int:
        return self.STATUS[self.kind]


class ClientGone(ActorError, ConnectionResetError):
    """The agent closed a streamed call's connection: the generation is aborted and the call dropped."""


@attrs.frozen
class ChatRequest:
    """One chat call, whatever API it came through; messages and tools in the OpenAI-style form of the template."""

    model: str
    """The model the call names (one of the served names, else 404)."""
    system_text: str | None
    """The leading system (or developer) message's text; None when there is none."""
    messages: tuple[dict[str, Any], ...]
    """The other messages: role user/assistant/tool/system, content str (or None), tool_calls, tool_call_id."""
    tools: tuple[dict[str, Any], ...] | None
    """Function tools as {"type": "function", "function": {...}}; None when absent or removed by tool_choice."""
    max_tokens: int | None
    """Output budget; None takes the proxy's default."""
    temperature: float | None
    """Sampling temperature; None is 1."""
    top_p: float | None
    """Nucleus sampling mass; None is 1."""
    top_k: int | None
    """Top-k sampling; None is off."""
    stop: tuple[str, ...]
    """Stop strings (the answer's content ends before the first one matched)."""
    seed: int | None
    """Sampling seed; None derives one from the call's rid."""
    stream: bool
    """Answer with server-sent events while the turn is generated."""
    include_usage: bool = False
    """OpenAI stream_options.include_usage: a last chunk with usage and no choices."""
    logprobs: bool = False
    """Return each output token's log-prob."""


@attrs.frozen
class ChatOutcome:
    """What the proxy answers, whatever API it answers in."""

    response_id: str
    """The answer's id (chatcmpl-... or msg_...)."""
    model: str
    """The model the call named."""
    created_s: int
    """Runtime-clock time the answer was made."""
    content: str
    """The answer's text, without tool-call blocks and cut before a matched stop string."""
    tool_calls: tuple[ToolCall, ...]
    """The well-formed tool calls the model wrote, in order."""
    tool_call_ids: tuple[str, ...]
    """An id per tool call."""
    finish: str
    """"stop", "length", "tool_calls" or "stop_sequence" (a requested stop string matched)."""
    matched_stop: str | None
    """The stop string that matched, if one did."""
    prompt_tokens: int
    """Prompt ids sent to the engine."""
    completion_tokens: int
    """Output ids generated."""
    cached_tokens: int
    """Prompt tokens the engine found in its prefix cache."""
    token_logprobs: tuple[tuple[str, float], ...] | None = None
    """(token text, log-prob) per output token when the call asked for logprobs."""


@attrs.frozen
class IdFormat:
    """How an API names its answers and tool calls; `tag` is a digest of the execution id, `index` the call's."""

    response: str
    """Format of the answer's id, e.g. "chatcmpl-{tag}-{index}"."""
    call_prefix: str
    """Format of the tool-call ids' prefix (the call's position follows), e.g. "call_{tag}_{index}_"."""


@attrs.frozen
class CallContext:
    """What the HTTP layer knows of a call before its body is parsed: whose it is, from which agent, since when."""

    session: "ExecutionSession"
    """The session of the key the call presented."""
    agent_id: str
    """The X-Gyre-Agent label ("" when absent)."""
    call_kind: str
    """The X-Gyre-Call label: "turn", "summary" or ""."""
    started_s: float
    """Runtime-clock time the call arrived."""


@attrs.frozen
class StreamStart:
    """First item of a streamed call, once its prompt is rendered and accepted: what the answer's head needs."""

    response_id: str
    """The answer's id."""
    call_id_prefix: str
    """Tool-call ids are this prefix + the call's position."""
    prompt_tokens: int
    """Prompt ids sent to the engine."""


@attrs.frozen
class StreamEnd:
    """Last item of a streamed call: the deltas still to send and the outcome (recorded and emitted by then)."""

    deltas: tuple[Delta, ...]
    """What the final text settles beyond the deltas already given."""
    outcome: ChatOutcome
    """The answer, as a non-streamed call would have given it."""


def final_text(
    template: Any, result: BackendResult, stop: tuple[str, ...], parse_tools: bool
) -> tuple[str, ParsedOutput | None, str | None]:
    """A finished turn's output ids -> (text after the stop-string cut, its tool-call split when the call offered
    tools, the matched stop string). The answer's content is the split's content, or the text without tools."""
    ids = list(result.output_ids)
    if ids and ids[-1] in template.stop_token_ids:
        ids.pop()
    text = template.decode(ids)
    matched: str | None = None
    if result.finish_reason == "stop" and stop:
        # A stop string ends the text before it (OpenAI and Anthropic both leave it out); the ids keep it, since
        # the policy did emit those tokens.
        candidates = [result.matched_stop] if isinstance(result.matched_stop, str) else list(stop)
        found = [(text.find(s), s) for s in candidates if s in stop and s in text]
        if found:
            position, matched = min(found)
            text = text[:position]
    return text, (parse_tool_calls(text) if parse_tools else None), matched


# -- per-execution state -----------------------------------------------------------------------------------------



class TemplateLike(Protocol):
    """What the sessions need of `gyre.engines.chat_template.ChatTemplate`."""

    stop_token_ids: tuple[int, ...]

    def system_ids(
        self, tools: Sequence[Mapping[str, Any]] | None = None, system_text: str | None = None
    ) -> list[int]: ...

    def message_ids(self, message: Mapping[str, Any]) -> list[int]: ...

    def generation_prompt_ids(self) -> list[int]: ...

    def assistant_trailer_ids(self) -> list[int]: ...

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str: ...


class SessionsFull(ActorError, RuntimeError):
    """No room for another execution: the executor must end some before issuing more keys."""


KEEP_GENERATED = "keep_generated"
FOLLOW_TEMPLATE = "follow_template"
EARLIER_TURNS = (KEEP_GENERATED, FOLLOW_TEMPLATE)


@attrs.frozen
class ProxySessionsConfig:
    max_executions: int = 4096
    """Executions with a live API key at once (a key is revoked when its execution ends)."""
    max_turns_per_execution: int = 2048
    """Generated assistant turns remembered per execution for exact id reuse; the oldest go first."""
    max_cached_messages_per_execution: int = 4096
    """Rendered non-generated messages (user, tool, system) kept per execution so a long conversation is not
    re-tokenised on every call; least recently used go first."""
    max_conversations_per_execution: int = 8
    """Conversations (main agent, sub-agents, summaries) whose last rendering is kept for incremental rendering;
    0 renders every call from scratch (through the per-message cache)."""
    earlier_turns: str = attrs.field(default=KEEP_GENERATED, validator=attrs.validators.in_(EARLIER_TURNS))
    """A checkpoint's own template (not Gyre's): what the prompt holds where the template re-renders a turn the
    model generated (Qwen3 drops the `<think>` block of turns before the last user message). "keep_generated":
    the generated ids, always (the prompt extends the previous call's prompt + output; each turn is trained once,
    in the context it was generated in). "follow_template": the template's text exactly, tokenised, from where it
    departs from the previous call's prompt + output (that call's ids are kept up to there; the call branches
    there in the execution's tree). See the module doc."""
    window_renders: bool = True
    """keep_generated on a checkpoint's template: render the system message, the answer and what follows it instead
    of the whole conversation (checked against whole renders, see WindowCheck); False renders whole."""
    max_paths_per_execution: int = 16
    """Calls of a checkpoint's own template remembered per execution (prompt, output, text) for id reuse; the
    least recently used go first."""


def turn_key(content: str | None, tool_calls: Iterable[tuple[str, str | Mapping[str, Any]]]) -> Hashable:
    """The normalised identity of an assistant message: its text and its calls' names and arguments.

    `tool_calls` holds (name, arguments) pairs, arguments as JSON text or a dict; ids are not part of the key (the
    template does not render them). The key is a tuple (no JSON for plain text: it is computed for every assistant
    message of every call). Raises ValueError when some arguments are not a JSON object.
    """
    return (content or "", tuple((name, canonical_arguments_json(arguments)) for name, arguments in tool_calls))


def _ids_bytes(ids: Sequence[int]) -> bytes:
    """Ids as 8-byte little-endian integers: what ModelCallCompleted.prompt_digest hashes, on any machine."""
    packed = array("q", ids)
    if sys.byteorder != "little":
        packed.byteswap()
    return packed.tobytes()


@attrs.frozen
class RenderedPrompt:
    """A request's prompt ids and how they were obtained."""

    prompt_ids: Sequence[int]
    """System turn + every message's ids + the generation prompt (a `PromptIds` view when rendered by a session)."""
    prompt_digest: bytes
    """SHA-256 of the prompt ids (as int64 bytes): the identity under which a turn generated from it is stored."""
    reused_turns: int
    """Assistant messages rendered from stored generated ids."""
    retokenised_turns: int
    """Assistant messages this execution did not generate (or no longer remembers), rendered from text."""
    extends_call: int = -1
    """The earlier call of this session whose prompt + output the prompt starts with (-1: none known)."""
    shared_tokens: int = 0
    """How many of that call's path tokens the prompt starts with."""
    new_prompt_ids: tuple[int, ...] = ()
    """The prompt's ids after those: what the call's record carries."""
    memo: Any = attrs.field(default=None, eq=False, repr=False)
    """The conversation memo the prompt was rendered in, its cut count then and its parts (`note_call`)."""
    memo_cuts: int = attrs.field(default=0, eq=False, repr=False)
    memo_parts: int = attrs.field(default=0, eq=False, repr=False)


def prompt_digest(prompt_ids: Sequence[int]) -> bytes:
    """The digest `RenderedPrompt.prompt_digest` holds for these ids."""
    return hashlib.sha256(_ids_bytes(prompt_ids)).digest()


@attrs.define(eq=False)
class _StoredTurn:
    key: Hashable
    prefix_digest: bytes
    output_ids: tuple[int, ...]
    piece: tuple[int, ...]
    """The ids the turn renders to: generation prompt + output (+ turn end if cut short) + trailer."""
    piece_bytes: bytes


_PLAIN_KEYS = frozenset(("role", "content", "tool_call_id"))


@attrs.define(eq=False)
class _Memo:
    """The last rendering of one conversation. Index 0 of `pieces`, `hashers`, `reused` and `retokenised` is the
    system part; index i + 1 is after `messages[i]`. Stored hashers are never updated in place (copies are)."""

    tools: list[Any] | None
    system_text: str | None
    messages: list[Mapping[str, Any]]
    pieces: list[tuple[int, ...]]
    """Each part's ids (shared with the render cache and the stored turns, not copied)."""
    hashers: list[Any]
    """SHA-256 over the ids up to and including each part."""
    reused: list[int]
    """Cumulative count of assistant messages rendered from stored generated ids."""
    retokenised: list[int]
    turn_keys: dict[Hashable, int]
    """Assistant message key -> index (into `messages`) of its first occurrence that did not resolve to the stored
    turn generated from that very prefix (it took the latest turn with the key, or its text): any new or evicted
    turn with the key may change it."""
    ends: list[int]
    """Tokens of the parts up to and including each part."""
    base_call: int = -1
    """The latest call known to extend this conversation: its path (prompt + output) starts with the first
    `base_parts` parts (-1: none; the next call's record carries its whole prompt)."""
    base_parts: int = 0
    base_tail: tuple[int, ...] | None = None
    """That call's path after those parts (generation prompt + output), when the parts are its whole prompt; None
    when only the parts are known to be on its path (after a cut or a fork inside its prompt)."""
    cuts: int = 0
    """How many times the memo was cut: a call rendered before a cut may not become its base."""
    exact_turns: dict[tuple[Hashable, bytes], int] = attrs.field(factory=dict)
    """(key, prefix digest) -> index of the first message that resolved to exactly that stored turn: only that
    turn's replacement or eviction changes it (a repeated "OK" answer with another prefix does not)."""

    def cut(self, count: int) -> None:
        """Keep the first `count` messages."""
        del self.messages[count:]
        del self.pieces[count + 1 :], self.hashers[count + 1 :], self.ends[count + 1 :]
        del self.reused[count + 1 :], self.retokenised[count + 1 :]
        self.turn_keys = {key: index for key, index in self.turn_keys.items() if index < count}
        self.exact_turns = {key: index for key, index in self.exact_turns.items() if index < count}
        self.cuts += 1
        if self.base_parts > count + 1:
            self.base_parts, self.base_tail = count + 1, None

    def fork(self, count: int) -> "_Memo":
        """A copy holding the first `count` messages (another conversation sharing this one's beginning)."""
        end = count + 1
        base_parts, tail = (self.base_parts, self.base_tail) if self.base_parts <= end else (end, None)
        return _Memo(
            self.tools, self.system_text, self.messages[:count], self.pieces[:end], self.hashers[:end],
            self.reused[:end], self.retokenised[:end],
            {key: index for key, index in self.turn_keys.items() if index < count}, self.ends[:end],
            self.base_call, base_parts, tail, 0,
            {key: index for key, index in self.exact_turns.items() if index < count},
        )


@attrs.define
class WindowCheck:
    """Whether keep_generated may render a window (system message, the answer's marker and what follows it) instead
    of the whole conversation; shared by the sessions of one ProxySessions (one template). The first
    `first_checks` windowed renders, and every `every`-th after, render the whole conversation too; a difference
    (or a window the template refuses) switches windows off for good (logged), and the whole render is used."""

    first_checks: int = 4
    every: int = 64
    windowed: int = 0
    """Windowed renders so far."""
    disabled: bool = False

    def due(self) -> bool:
        return self.windowed < self.first_checks or self.windowed % self.every == 0


@attrs.define(eq=False)
class _Path:
    """One call rendered whole through a checkpoint's own template: what it was rendered from, its prompt, and
    (once answered) its output. The next call of the conversation reuses these ids."""

    tools: list[Any] | None
    system_text: str | None
    messages: list[Mapping[str, Any]]
    """The call's messages (frozen copies), without the system message."""
    parts: tuple[tuple[int, ...], ...]
    """The prompt's ids in parts (shared with the path it extends, not copied)."""
    ends: tuple[int, ...]
    hasher: Any
    """SHA-256 over the prompt ids (as int64 bytes)."""
    text: tuple[str, ...] | None
    """The text the prompt ids stand for (the template's, with generated turns as decoded), in pieces shared with
    the path it extends (never one string per call: a long conversation's paths would each hold a copy), or
    None when unknown."""
    text_chars: int
    """Characters of `text`."""
    cuts: tuple[tuple[tuple[int, int], ...], ...]
    """(characters, ids) of the prompt up to and including each special token: where a later render that agrees
    with `text` so far may take these ids and tokenise only the rest. In segments (ascending), shared with the
    path it extends."""
    reused_turns: int = 0
    output: tuple[int, ...] | None = None
    key: Hashable | None = None
    call_index: int = -1
    """The call whose record was handed on with this prompt (-1: none, a later record cannot name it)."""
    output_text: str = ""

    @property
    def prompt_tokens(self) -> int:
        return self.ends[-1] if self.ends else 0

    def path_ids(self) -> Iterable[int]:
        """Prompt + output."""
        return chain(chain.from_iterable(self.parts), self.output or ())



def _frozen_copy(value: Any) -> Any:
    """A copy of JSON-like data deep enough that a caller mutating its messages later cannot corrupt a memo."""
    kind = type(value)
    if kind is str or kind is int or kind is float or value is None:
        return value
    if kind is dict or isinstance(value, Mapping):
        return {key: _frozen_copy(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_frozen_copy(item) for item in value]
    if isinstance(value, tuple):
        return tuple(_frozen_copy(item) for item in value)
    return value


def _common_prefix(known: Sequence[Mapping[str, Any]], messages: Sequence[Mapping[str, Any]]) -> int:
    count, limit = 0, min(len(known), len(messages))
    if list(known[:limit]) == list(messages[:limit]):  # the usual case (the agent appended), compared in C
        return limit
    while count < limit and known[count] == messages[count]:
        count += 1
    return count


def _message_key(message: Mapping[str, Any]) -> Any:
    """A cheap, exact cache key for a message: plain text messages (the bulk of a long conversation) key on their
    strings directly; anything else on its canonical JSON."""
    if message.keys() <= _PLAIN_KEYS:
        return ("m", message.get("role"), message.get("content"), message.get("tool_call_id"))
    return ("j", json.dumps(message, ensure_ascii=False, sort_keys=True))


class ExecutionSession:
    """One execution's proxy state; reachable only through its API key."""

    def __init__(
        self, execution_id: str, group_id: str, config: ProxySessionsConfig, template: TemplateLike,
        window_check: WindowCheck | None = None,
    ) -> None:
        self.execution_id = execution_id
        self.group_id = group_id
        self._config = config
        self._template = template
        self._generation_prompt = tuple(template.generation_prompt_ids())
        self._generation_prompt_bytes = _ids_bytes(self._generation_prompt)
        self._trailer = tuple(template.assistant_trailer_ids())
        self._calls = 0
        # (key, prefix digest) -> turn, in insertion order for eviction; key -> latest turn with that key.
        self._turns: OrderedDict[tuple[str, bytes], _StoredTurn] = OrderedDict()
        self._latest: dict[str, _StoredTurn] = {}
        # message key -> (ids, ids as bytes for the running digest)
        self._rendered: OrderedDict[Any, tuple[tuple[int, ...], bytes]] = OrderedDict()
        # The latest renderings of a few conversations, most recently used last (see the module doc).
        self._memos: list[_Memo] = []
        # A checkpoint's own template: calls rendered whole, most recently used last (see the module doc).
        self._whole = not getattr(template, "decomposable", True)
        self._paths: OrderedDict[int, _Path] = OrderedDict()
        self._sentinel = "gyreturn" + secrets.token_hex(12)
        self._window_check = window_check if window_check is not None else WindowCheck()
        self.lock = asyncio.Lock()
        """Held by `CallRunner` around each render and record: a large render runs on a worker thread, and no other
        render or record of this execution may touch its state meanwhile."""

    # -- call counter ----------------------------------------------------------------------------------------

    def next_call_index(self) -> int:
        """The 0-based index of a call, in the order the proxy received them."""
        index = self._calls
        self._calls += 1
        return index

    @property
    def calls(self) -> int:
        return self._calls

    @property
    def stored_turns(self) -> int:
        return len(self._turns)

    @property
    def cached_messages(self) -> int:
        return len(self._rendered)

    # -- rendering -------------------------------------------------------------------------------------------

    def _cached_ids(self, cache_key: Any, render: Any) -> tuple[tuple[int, ...], bytes]:
        entry = self._rendered.get(cache_key)
        if entry is None:
            ids = tuple(render())
            entry = (ids, _ids_bytes(ids))
            self._rendered[cache_key] = entry
            while len(self._rendered) > self._config.max_cached_messages_per_execution:
                self._rendered.popitem(last=False)
        else:
            self._rendered.move_to_end(cache_key)
        return entry

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None,
        system_text: str | None,
    ) -> RenderedPrompt:
        """Prompt ids for OpenAI-style `messages` (no leading system message: pass its text as `system_text`).

        Raises whatever the template raises for a message it cannot render (a ValueError subclass), and ValueError
        for an assistant message whose tool-call arguments are not a JSON object.
        """
        tools_list = list(tools) if tools else None
        if self._whole:
            return self._render_whole(messages, tools_list, system_text)
        memo, known = self._memo_for(tools_list, system_text, messages)
        for message in messages[known:]:
            hasher = memo.hashers[-1].copy()
            entry: tuple[tuple[int, ...], bytes] | None = None
            reused = retokenised = 0
            if message.get("role") == "assistant":
                key = turn_key(message.get("content"), _message_calls(message))
                stored = self._latest.get(key)
                exact = None
                if stored is not None:
                    probe = hasher.copy()
                    probe.update(self._generation_prompt_bytes)
                    exact = self._turns.get((key, probe.digest()))
                    stored = exact or stored
                    entry = (stored.piece, stored.piece_bytes)
                    reused = 1
                else:
                    retokenised = 1
                if exact is not None:
                    memo.exact_turns.setdefault((key, exact.prefix_digest), len(memo.messages))
                else:
                    memo.turn_keys.setdefault(key, len(memo.messages))
            if entry is None:
                entry = self._cached_ids(_message_key(message), lambda m=message: self._template.message_ids(m))
            hasher.update(entry[1])
            memo.messages.append(_frozen_copy(message))
            memo.pieces.append(entry[0])
            memo.ends.append(memo.ends[-1] + len(entry[0]))
            memo.hashers.append(hasher)
            memo.reused.append(memo.reused[-1] + reused)
            memo.retokenised.append(memo.retokenised[-1] + retokenised)
        final = memo.hashers[-1].copy()
        final.update(self._generation_prompt_bytes)
        extends, shared, new_ids = self._after_base(memo)
        return RenderedPrompt(
            prompt_ids=PromptIds(
                (*memo.pieces, self._generation_prompt), (*memo.ends, memo.ends[-1] + len(self._generation_prompt))
            ),
            prompt_digest=final.digest(),
            reused_turns=memo.reused[-1],
            retokenised_turns=memo.retokenised[-1],
            extends_call=extends,
            shared_tokens=shared,
            new_prompt_ids=new_ids,
            memo=memo,
            memo_cuts=memo.cuts,
            memo_parts=len(memo.pieces),
        )

    def _after_base(self, memo: _Memo) -> tuple[int, int, tuple[int, ...]]:
        """(extends_call, shared tokens, ids after them) of the prompt `memo` renders now; O(ids after the base's
        parts), which are the messages new since that call (the base's output among them)."""
        rest = chain(chain.from_iterable(memo.pieces[memo.base_parts :]), self._generation_prompt)
        if memo.base_call < 0:
            return -1, 0, tuple(rest)
        shared = memo.ends[memo.base_parts - 1]
        pending: list[int] = []
        for expected in memo.base_tail or ():
            token = next(rest, None)
            if token != expected:
                if token is not None:
                    pending.append(token)
                break
            shared += 1
        return memo.base_call, shared, tuple(chain(pending, rest))

    def note_call(self, rendered: RenderedPrompt, call_index: int, output_ids: Sequence[int]) -> None:
        """Call `call_index`, rendered as `rendered`, was answered with `output_ids` and its record handed on: the
        next call of its conversation may name it (a memo cut since the rendering keeps its older base)."""
        memo = rendered.memo
        if isinstance(memo, _Path):
            memo.call_index = call_index
            return
        if memo is None or memo.cuts != rendered.memo_cuts or len(memo.pieces) < rendered.memo_parts:
            return
        if call_index < memo.base_call:
            return  # a later call of this conversation was noted first
        memo.base_call, memo.base_parts = call_index, rendered.memo_parts
        memo.base_tail = self._generation_prompt + tuple(output_ids)

    def unrendered_chars(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None,
        system_text: str | None,
    ) -> int:
        """Characters `render` would tokenise or look up for these messages: those after the longest conversation
        it already holds (everything, system part and tools included, when it holds none). Changes nothing."""
        tools_list = list(tools) if tools else None
        if self._whole:  # Jinja renders the whole conversation every call
            return _messages_chars(messages) + len(system_text or "") + (
                len(json.dumps(tools_list, ensure_ascii=False)) if tools_list else 0)
        known = -1
        for memo in self._memos:
            if memo.system_text == system_text and memo.tools == tools_list:
                known = max(known, _common_prefix(memo.messages, messages))
        chars = _messages_chars(messages[max(known, 0) :])
        if known <= 0:
            chars += len(system_text or "") + (len(json.dumps(tools_list, ensure_ascii=False)) if tools_list else 0)
        return chars

    def _memo_for(
        self, tools: list[Any] | None, system_text: str | None, messages: Sequence[Mapping[str, Any]]
    ) -> tuple[_Memo, int]:
        """The memo to extend for this conversation and how many of its messages are already rendered in it."""
        best: _Memo | None = None
        best_known = -1
        for memo in self._memos:
            if memo.system_text == system_text and memo.tools == tools:
                known = _common_prefix(memo.messages, messages)
                if known >= best_known:
                    best, best_known = memo, known
        if best is not None and best_known > 0:
            self._memos.remove(best)
            if best_known < len(best.messages):
                # Another conversation with the same beginning (a sub-agent, a retry, a compressed history):
                # keep both, the old one may come back.
                self._memos.append(best)
                best = best.fork(best_known)
        else:
            template = self._template
            system_key = ("s", json.dumps(tools, ensure_ascii=False, sort_keys=True), system_text)
            system_ids, system_bytes = self._cached_ids(system_key, lambda: template.system_ids(tools, system_text))
            hasher = hashlib.sha256(system_bytes)
            fresh = _Memo(_frozen_copy(tools), system_text, [], [system_ids], [hasher], [0], [0], {}, [len(system_ids)])
            if best is not None and best.base_call >= 0 and best.base_parts >= 1:
                # Same system part, other first message (a compressed history, a fresh sub-agent): the new
                # conversation branches from that call after the system part.
                fresh.base_call, fresh.base_parts = best.base_call, 1
            best, best_known = fresh, 0
        self._memos.append(best)
        while len(self._memos) > self._config.max_conversations_per_execution:
            self._memos.pop(0)
        return best, best_known

    # -- a checkpoint's own template: rendered whole ----------------------------------------------------------

    def _render_whole(
        self, messages: Sequence[Mapping[str, Any]], tools: list[Any] | None, system_text: str | None
    ) -> RenderedPrompt:
        """Prompt ids for a template that is not decomposable per message (see the module doc)."""
        template: Any = self._template
        full = ([{"role": "system", "content": system_text}] if system_text is not None else []) + list(messages)
        if self._config.earlier_turns == KEEP_GENERATED and template.splits_at_special_tokens:
            base, count = self._generated_base(tools, system_text, messages)
            if base is not None:
                rendered = self._extend_generated(base, count, full, messages, tools, system_text)
                if rendered is not None:
                    return rendered
        text = template.render_text(full, tools, True)
        base = self._text_base(tools, system_text, messages) if template.splits_at_special_tokens else None
        head: tuple[tuple[int, ...], ...] = ()
        head_ends: tuple[int, ...] = ()
        head_cuts: tuple[tuple[tuple[int, int], ...], ...] = ()
        head_text: tuple[str, ...] = ()
        chars = tokens = reused = 0
        hasher = None
        known = 0
        if base is not None:
            known = _common_prefix(base.messages, messages)
            ends_with_stop = bool(base.output) and base.output[-1] in template.stop_token_ids
            path_text = (*base.text, base.output_text) if ends_with_stop else base.text
            agree = _agreeing_chars(text, path_text)
            cuts = base.cuts
            if ends_with_stop:
                cuts = (*cuts, ((base.text_chars + len(base.output_text), base.prompt_tokens + len(base.output)),))
            head_cuts = _cuts_up_to(cuts, agree)
            if head_cuts:
                chars, tokens = head_cuts[-1][-1]
                head_text = _head_text(path_text, chars)
                if tokens > base.prompt_tokens:  # the whole prompt and the whole output
                    head, head_ends = (*base.parts, base.output), (*base.ends, tokens)
                    hasher = base.hasher.copy()
                    hasher.update(_ids_bytes(base.output))
                    reused = base.reused_turns + 1
                else:
                    head, head_ends = _head_parts(base.parts, base.ends, tokens)
                    reused = base.reused_turns if tokens == base.prompt_tokens else 0
        if hasher is None:
            hasher = hashlib.sha256()
            for part in head:
                hasher.update(_ids_bytes(part))
        rest, rest_cuts = template.encode_with_cuts(text[chars:])
        rest = tuple(rest)
        hasher.update(_ids_bytes(rest))
        path = _Path(
            _frozen_copy(tools), system_text,
            (base.messages[:known] if base is not None else []) + [_frozen_copy(m) for m in messages[known:]],
            (*head, rest), (*head_ends, tokens + len(rest)), hasher, (*head_text, text[chars:]), len(text),
            (*head_cuts, tuple((c + chars, i + tokens) for c, i in rest_cuts)), reused,
        )
        return self._whole_prompt(path, base, messages, tokens)

    def _generated_base(
        self, tools: list[Any] | None, system_text: str | None, messages: Sequence[Mapping[str, Any]]
    ) -> tuple[_Path | None, int]:
        """The remembered call whose messages this conversation starts with, followed by that call's answer (the
        longest such, the latest of equals), and how many messages it had."""
        best: _Path | None = None
        best_count = -1
        keys: dict[int, Hashable] = {}
        for path in reversed(self._paths.values()):
            count = len(path.messages)
            if count <= best_count or count >= len(messages) or path.tools != tools or path.system_text != system_text:
                continue
            message = messages[count]
            if message.get("role") != "assistant":
                continue
            if count not in keys:
                keys[count] = turn_key(message.get("content"), _message_calls(message))
            if keys[count] == path.key and _common_prefix(path.messages, messages) == count:
                best, best_count = path, count
        if best is not None:
            self._paths.move_to_end(id(best))
        return best, best_count

    def _text_base(
        self, tools: list[Any] | None, system_text: str | None, messages: Sequence[Mapping[str, Any]]
    ) -> _Path | None:
        """The remembered call (with a known text) sharing the most leading messages with this conversation."""
        best: _Path | None = None
        best_known = -1
        for path in reversed(self._paths.values()):
            if path.text is None or path.tools != tools or path.system_text != system_text:
                continue
            known = _common_prefix(path.messages, messages)
            if known > best_known:
                best, best_known = path, known
        return best

    def _extend_generated(
        self, base: _Path, count: int, full: list[Mapping[str, Any]], messages: Sequence[Mapping[str, Any]],
        tools: list[Any] | None, system_text: str | None,
    ) -> RenderedPrompt | None:
        """keep_generated: the prompt is `base`'s prompt + output + the template's text after the answer (found by
        rendering the conversation with the answer replaced by a marker); None when the marker is not found once."""
        template: Any = self._template
        system_part = len(full) - len(messages)
        at = system_part + count
        output = base.output or ()
        stop = template.stop_text(output[-1]) if output else None
        # The generated turn end (if the output has one) stands for the template's: turn_text_after drops it.
        after_turn = functools.partial(template.turn_text_after, tools=tools, marker=self._sentinel,
                                       stop_id=output[-1] if output else None)
        check = self._window_check
        if not self._config.window_renders or check.disabled or at == system_part:
            after = after_turn(full, at)
        else:
            # Only the system message, the marker and what follows it: the text after the marker is the same for
            # templates that render a message from itself and its neighbours (checked: see WindowCheck).
            try:
                after = after_turn([*full[:system_part], *full[at:]], system_part)
            except ValueError:
                after = None
            if after is None or check.due():
                whole = after_turn(full, at)
                if whole is not None and whole != after:
                    check.disabled = True
                    log.warning("chat_template_window_disabled", execution_id=self.execution_id,
                                reason="the window rendered otherwise than the whole conversation")
                after = whole
            check.windowed += 1
        if after is None:
            return None
        rest, rest_cuts = template.encode_with_cuts(after)
        rest = tuple(rest)
        hasher = base.hasher.copy()
        hasher.update(_ids_bytes(output))
        hasher.update(_ids_bytes(rest))
        tokens = base.prompt_tokens + len(output)
        text_now = cuts = None
        chars = base.text_chars + len(base.output_text)
        if base.text is not None:
            cuts = (*base.cuts, ((chars, tokens),) if stop is not None else (),
                    tuple((c + chars, i + tokens) for c, i in rest_cuts))
            text_now = (*base.text, base.output_text, after)
        path = _Path(
            base.tools, system_text, base.messages + [_frozen_copy(m) for m in messages[count:]],
            (*base.parts, output, rest), (*base.ends, tokens, tokens + len(rest)), hasher, text_now, chars + len(after),
            cuts or (), base.reused_turns + 1,
        )
        return self._whole_prompt(path, base, messages, tokens)

    def _whole_prompt(
        self, path: _Path, base: _Path | None, messages: Sequence[Mapping[str, Any]], reused_tokens: int
    ) -> RenderedPrompt:
        """The RenderedPrompt of `path`, whose prompt is `base`'s path ids up to `reused_tokens`, then its last part
        (tokenised now); the record's shared tokens are found in O(that part)."""
        prompt = PromptIds(path.parts, path.ends)
        rest = path.parts[-1]
        extends, shared, new_ids = -1, 0, tuple(prompt) if reused_tokens else rest
        if base is not None and base.call_index >= 0:
            extends, shared = base.call_index, reused_tokens
            for token, expected in zip(rest, _path_window(base, reused_tokens, len(rest))):
                if token != expected:
                    break
                shared += 1
            new_ids = rest[shared - reused_tokens :]
        assistants = sum(1 for m in messages if m.get("role") == "assistant")
        return RenderedPrompt(
            prompt_ids=prompt,
            prompt_digest=path.hasher.digest(),
            reused_turns=path.reused_turns,
            retokenised_turns=max(0, assistants - path.reused_turns),
            extends_call=extends,
            shared_tokens=shared,
            new_prompt_ids=new_ids,
            memo=path,
        )

    def _store_path(self, path: _Path, key: Hashable, output: tuple[int, ...]) -> None:
        path.key, path.output = key, output
        path.output_text = self._template.decode(output)
        self._paths[id(path)] = path
        while len(self._paths) > self._config.max_paths_per_execution:
            self._paths.popitem(last=False)

    def _forget_resolutions(self, key: Hashable, prefix_digest: bytes) -> None:
        """The stored turn (key, prefix digest) came, was replaced or went: messages that resolved to it, and those
        with that key that did not resolve to their own prefix's turn, may now resolve to other ids."""
        for memo in self._memos:
            loose = memo.turn_keys.get(key)
            exact = memo.exact_turns.get((key, prefix_digest))
            if loose is not None or exact is not None:
                memo.cut(min(i for i in (loose, exact) if i is not None))

    def record_turn(
        self, key: Hashable, prompt_digest: bytes, output_ids: Sequence[int], rendered: RenderedPrompt | None = None
    ) -> None:
        """Remember a generated turn: `key` from `turn_key` of the message as the agent was answered,
        `prompt_digest` from the RenderedPrompt it was generated from (`rendered` itself, for a template rendered
        whole)."""
        output = tuple(output_ids)
        if self._whole:
            if rendered is not None and isinstance(rendered.memo, _Path):
                self._store_path(rendered.memo, key, output)
            return
        turn_end = self._template.stop_token_ids[0]
        ending = () if output and output[-1] == turn_end else (turn_end,)
        piece = self._generation_prompt + output + ending + self._trailer
        turn = _StoredTurn(key, prompt_digest, output, piece, _ids_bytes(piece))
        self._turns.pop((key, prompt_digest), None)
        self._turns[(key, prompt_digest)] = turn
        self._latest[key] = turn
        self._forget_resolutions(key, prompt_digest)
        while len(self._turns) > self._config.max_turns_per_execution:
            _, old = self._turns.popitem(last=False)
            if self._latest.get(old.key) is old:
                del self._latest[old.key]
            self._forget_resolutions(old.key, old.prefix_digest)


def _agreeing_chars(text: str, pieces: Sequence[str]) -> int:
    """How many leading characters `text` shares with the concatenation of `pieces` (C-speed compares: whole
    pieces, then halving ranges inside the first piece that differs)."""
    at = 0
    for piece in pieces:
        if text.startswith(piece, at):
            at += len(piece)
            continue
        low, high = 0, min(len(text) - at, len(piece))  # piece[:low] agrees; it differs before high + 1
        while low < high:
            middle = (low + high + 1) // 2
            if text.startswith(piece[low:middle], at + low):
                low = middle
            else:
                high = middle - 1
        return at + low
    return at


def _path_window(path: _Path, start: int, count: int) -> tuple[int, ...]:
    """Ids `start` to `start + count` of a path's prompt + output, from its parts (no pass over the rest)."""
    parts, ends = (*path.parts, path.output or ()), (*path.ends, path.prompt_tokens + len(path.output or ()))
    window: list[int] = []
    index, at = bisect.bisect_right(ends, start), start
    while index < len(parts) and len(window) < count:
        offset = at - (ends[index - 1] if index else 0)  # 0 after the first part
        taken = parts[index][offset : offset + count - len(window)]
        window.extend(taken)
        at += len(taken)
        index += 1
    return tuple(window)


def _cuts_up_to(
    segments: tuple[tuple[tuple[int, int], ...], ...], chars: int
) -> tuple[tuple[tuple[int, int], ...], ...]:
    """The cut segments up to the last cut at or before `chars` (empty when there is none); walks back from the
    end, where a later render usually departs."""
    for index in range(len(segments) - 1, -1, -1):
        segment = segments[index]
        if segment and segment[0][0] <= chars:
            at = bisect.bisect_right(segment, (chars, sys.maxsize))
            return (*segments[:index], segment[:at])
    return ()


def _head_text(pieces: Sequence[str], chars: int) -> tuple[str, ...]:
    """The first `chars` characters of a text in pieces, as pieces (whole pieces shared, the last one cut)."""
    head: list[str] = []
    for piece in pieces:
        if chars <= 0:
            break
        head.append(piece if len(piece) <= chars else piece[:chars])
        chars -= len(piece)
    return tuple(head)


def _head_parts(
    parts: tuple[tuple[int, ...], ...], ends: tuple[int, ...], tokens: int
) -> tuple[tuple[tuple[int, ...], ...], tuple[int, ...]]:
    """The first `tokens` ids of a prompt in parts, as parts (whole parts shared, the last one cut)."""
    if tokens <= 0:
        return (), ()
    index = bisect.bisect_left(ends, tokens)
    start = ends[index - 1] if index else 0
    last = parts[index] if ends[index] == tokens else parts[index][: tokens - start]
    return (*parts[:index], last), (*ends[:index], tokens)


def _message_calls(message: Mapping[str, Any]) -> list[tuple[str, Any]]:
    calls = []
    for call in message.get("tool_calls") or ():
        function = call.get("function", call) if isinstance(call, Mapping) else {}
        calls.append((function.get("name", ""), function.get("arguments", {})))
    return calls


class ProxySessions:
    """The API key registry and every execution's session.

    Keys are stored as SHA-256 digests (a leaked table does not leak keys; lookups compare digests in constant
    time through the dict). The executor issues a key per execution and revokes it when the execution ends.
    """

    def __init__(self, template: TemplateLike, config: ProxySessionsConfig = ProxySessionsConfig()) -> None:
        self.template = template
        self.config = config
        self.window_check = WindowCheck()
        """keep_generated's windowed renders of a checkpoint's template, for every session (see WindowCheck)."""
        self._by_key_digest: dict[bytes, ExecutionSession] = {}
        self._by_execution: dict[str, tuple[bytes, ExecutionSession]] = {}

    @staticmethod
    def _digest(api_key: str) -> bytes:
        return hashlib.sha256(api_key.encode("utf-8")).digest()

    def issue_key(self, execution_id: str, group_id: str, api_key: str | None = None) -> str:
        """A new API key for `execution_id` (random unless given). Raises SessionsFull or ValueError (reuse)."""
        if not execution_id:
            raise ValueError("execution_id must be non-empty")
        if execution_id in self._by_execution:
            raise ValueError(f"execution {execution_id!r} already has a key")
        if len(self._by_execution) >= self.config.max_executions:
            raise SessionsFull(f"{len(self._by_execution)} executions are live (max_executions)")
        key = api_key if api_key is not None else "gyre-" + secrets.token_urlsafe(24)
        if not key:
            raise ValueError("an API key must be non-empty")
        digest = self._digest(key)
        if digest in self._by_key_digest:
            raise ValueError("this API key is already in use")
        session = ExecutionSession(execution_id, group_id, self.config, self.template, self.window_check)
        self._by_key_digest[digest] = session
        self._by_execution[execution_id] = (digest, session)
        log.debug("proxy_key_issued", execution_id=execution_id, group_id=group_id)
        return key

    def revoke(self, execution_id: str) -> bool:
        """Forget an execution: its key stops working and its stored turns go. False if it was unknown."""
        entry = self._by_execution.pop(execution_id, None)
        if entry is None:
            return False
        self._by_key_digest.pop(entry[0], None)
        log.debug("proxy_key_revoked", execution_id=execution_id)
        return True

    def authenticate(self, api_key: str | None) -> ExecutionSession | None:
        """The session of a presented key, or None (missing, unknown or revoked)."""
        if not api_key:
            return None
        presented = self._digest(api_key)
        session = self._by_key_digest.get(presented)
        if session is None:
            return None
        # Defence in depth: the digest table and the execution table must agree.
        digest, current = self._by_execution.get(session.execution_id, (b"", None))
        if current is not session or not hmac.compare_digest(digest, presented):
            return None
        return session

    def __len__(self) -> int:
        return len(self._by_execution)


# -- the call ----------------------------------------------------------------------------------------------------

OnCallCompleted = Callable[[ModelCallCompleted], "Awaitable[None] | None"]
"""Takes each finished call's record (the proxy actor sends it to itself, `gyre serve` logs it); plain or async."""

StreamItem = StreamStart | list[Delta] | StreamEnd
"""What `CallRunner.stream` yields: a StreamStart, then the deltas of each output chunk (often none), then a
StreamEnd."""


def short_error(error: BaseException) -> str:
    """An unexpected error in one line for a log: its type, its message cut to 200 characters, and where it was
    raised (file:line in function). Never a traceback: a RecursionError's would be a thousand frames, and a console
    renderer that prints locals would print the request (megabytes) in every one of them."""
    message = str(error)
    if len(message) > 200:
        message = message[:200] + "..."
    where = ""
    tb = error.__traceback__
    if tb is not None:
        while tb.tb_next is not None:
            tb = tb.tb_next
        code = tb.tb_frame.f_code
        where = f" ({code.co_filename.rsplit('/', 1)[-1]}:{tb.tb_lineno} in {code.co_name})"
    return f"{type(error).__name__}: {message}{where}"


def prompt_chars(chat: ChatRequest) -> int:
    """Characters of everything a call's prompt renders: system text, messages' content, tool calls, tools (as
    JSON). Cheap next to tokenising them, which is what it is for."""
    total = len(chat.system_text or "") + _messages_chars(chat.messages)
    if chat.tools:
        total += len(json.dumps(chat.tools, ensure_ascii=False))
    return total


def _messages_chars(messages: Iterable[Mapping[str, Any]]) -> int:
    total = 0
    for message in messages:
        total += len(message.get("content") or "")
        for call in message.get("tool_calls") or ():
            function = call.get("function") or {}
            arguments = function.get("arguments") or ""
            total += len(function.get("name") or "") + (len(arguments) if isinstance(arguments, str) else 0)
    return total


def _short_digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:12]


@attrs.frozen
class _PreparedCall:
    """A rendered and accepted call, ready for the backend."""

    chat: ChatRequest
    context: CallContext
    rendered: RenderedPrompt
    call_index: int
    backend_request: BackendRequest
    response_id: str
    call_id_prefix: str


class _OutputChannel:
    """Output ids from a streamed call's generation task to its reader. At most `max_chunks` wait in it: a reader
    slower than the engine makes the generation wait (the engine's stream is read no further, so TCP pushes back)
    instead of piling ids up in memory. Once the reader has left (`close`), `put` raises ClientGone."""

    def __init__(self, max_chunks: int) -> None:
        self._chunks: deque[tuple[int, ...]] = deque()
        self._max_chunks = max_chunks
        self._readable = asyncio.Event()
        self._writable = asyncio.Event()
        self._writable.set()
        self._closed = False

    async def put(self, ids: tuple[int, ...]) -> None:
        """The generation's OnOutput."""
        while len(self._chunks) >= self._max_chunks and not self._closed:
            self._writable.clear()
            await self._writable.wait()
        if self._closed:
            raise ClientGone("the client closed the stream")
        self._chunks.append(ids)
        self._readable.set()

    def wake(self, _: Any = None) -> None:
        """The generation ended (a done-callback of its task): the reader must look."""
        self._readable.set()

    async def get(self, generation: asyncio.Future) -> tuple[int, ...] | None:
        """The next chunk, or None once `generation` has ended and every chunk was taken."""
        while not self._chunks:
            if generation.done():
                return None
            self._readable.clear()
            await self._readable.wait()
        self._writable.set()
        return self._chunks.popleft()

    def close(self) -> None:
        """The reader left: drop what waits, and make the generation's next output raise ClientGone."""
        self._closed = True
        self._chunks.clear()
        self._writable.set()


class CallRunner:
    """Runs model calls: render the prompt in the caller's session, generate once through the backend, decode and
    split tool calls, record the turn, hand on its ModelCallCompleted. One per application, shared by every
    execution (the state is in the sessions).

    `model_names` are the served model ids; `max_context_tokens` bounds prompt + output (a prompt that leaves no
    room gets 400, an output budget that does not fit is lowered); `default_max_tokens` is the budget of a call that
    names none; a prompt of more than `max_prompt_chars` characters is refused before it is tokenised, one that adds
    more than `offload_render_chars` to what its session has rendered is rendered on one of `render_threads` worker
    threads; `stream_buffer_chunks` bounds
    the output chunks a streamed call holds for a slow reader. `close` ends the worker threads.
    """

    def __init__(
        self,
        template: TemplateLike,
        backend: GenerateBackend,
        on_call_completed: OnCallCompleted,
        clock: Callable[[], float],
        *,
        model_names: tuple[str, ...],
        max_context_tokens: int,
        default_max_tokens: int,
        max_prompt_chars: int | None = None,
        offload_render_chars: int = 32 * 2**10,
        render_threads: int = 2,
        stream_buffer_chunks: int = 64,
    ) -> None:
        self.template = template
        self.backend = backend
        self.on_call_completed = on_call_completed
        self.clock = clock
        self.model_names = model_names
        self.max_context_tokens = max_context_tokens
        self.default_max_tokens = default_max_tokens
        self.max_prompt_chars = max_prompt_chars if max_prompt_chars is not None else 16 * max_context_tokens
        self.offload_render_chars = offload_render_chars
        self.stream_buffer_chunks = stream_buffer_chunks
        self._render_threads = render_threads
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self.emit_failures = 0
        """ModelCallCompleted records that `on_call_completed` failed to take (each one logged)."""

    # -- entry points --------------------------------------------------------------------------------------------

    def close(self) -> None:
        """End the worker threads (a render under way finishes; its call has ended with the application)."""
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None

    def check_model(self, model: str) -> None:
        if model not in self.model_names:
            served = ", ".join(self.model_names)
            raise ApiError("not_found", f"model {model!r} does not exist; served: {served}", "model")

    async def count_tokens(self, chat: ChatRequest, session: ExecutionSession) -> int:
        """The prompt tokens `chat` would be sent with (nothing generated, nothing recorded)."""
        self.check_model(chat.model)
        return len((await self._render(session, chat)).prompt_ids)

    async def complete(self, chat: ChatRequest, context: CallContext, ids: IdFormat) -> ChatOutcome:
        """Generate one turn, record it, emit its ModelCallCompleted; return what to answer."""
        call = await self._prepare(chat, context, ids)
        result = await self._generate(call, None)
        outcome, _, _ = await self._finish(call, result)
        return outcome

    async def stream(self, chat: ChatRequest, context: CallContext, ids: IdFormat) -> AsyncIterator[StreamItem]:
        """The same call, streamed: a StreamStart, the deltas of each output chunk, a StreamEnd (see the module
        doc). Refusals and failures raise, as from `complete`. Close it (aclose) when the reader leaves."""
        call = await self._prepare(chat, context, ids)
        yield StreamStart(call.response_id, call.call_id_prefix, len(call.rendered.prompt_ids))
        streamer = TurnStreamer(
            self.template.decode, self.template.stop_token_ids, chat.stop, parse_tools=bool(chat.tools)
        )
        channel = _OutputChannel(self.stream_buffer_chunks)
        generation = asyncio.ensure_future(self._generate(call, channel.put))
        generation.add_done_callback(channel.wake)
        finishing = False
        try:
            while (chunk := await channel.get(generation)) is not None:
                yield streamer.feed(chunk)
            result = generation.result()  # the generation's refusal or failure is the call's
            finishing = True
            outcome, text, parsed = await self._finish(call, result)
            yield StreamEnd(tuple(streamer.finish(text, parsed)), outcome)
        except asyncio.CancelledError:
            generation.cancel()
            raise
        finally:
            if not finishing:
                # The reader left (or this stream failed) before the end: the generation stops at its next output;
                # one that had completed all the same is recorded and emitted, as the module doc says.
                channel.close()
                try:
                    result = await generation
                except BaseException:  # ClientGone, cancelled, or its own refusal or failure: nothing to record
                    pass
                else:
                    await self._finish(call, result)

    # -- the steps -----------------------------------------------------------------------------------------------

    async def _render(self, session: ExecutionSession, chat: ChatRequest) -> RenderedPrompt:
        """The prompt ids, after the character bound; a large prompt is rendered on a worker thread (the event loop
        goes on: other calls, /health), holding the session's lock until the thread is done with its state."""
        chars = prompt_chars(chat)
        if chars > self.max_prompt_chars:
            raise ApiError(
                "context_length",
                f"the prompt has {chars} characters; at most {self.max_prompt_chars} are accepted before tokenising "
                "(max_context_tokens x max_prompt_chars_per_token)",
                "messages",
            )
        async with session.lock:
            try:
                # What is new since the conversation's last rendering decides: a long conversation that adds one
                # tool result renders it in a fraction of a millisecond, a thread hand-off would only add to that.
                if session.unrendered_chars(chat.messages, chat.tools, chat.system_text) <= self.offload_render_chars:
                    return session.render(chat.messages, chat.tools, chat.system_text)
                if self._executor is None:
                    self._executor = concurrent.futures.ThreadPoolExecutor(
                        self._render_threads, thread_name_prefix="gyre-render"
                    )
                loop = asyncio.get_running_loop()
                rendering = loop.run_in_executor(
                    self._executor, session.render, chat.messages, chat.tools, chat.system_text
                )
                try:
                    return await asyncio.shield(rendering)
                except asyncio.CancelledError:
                    while not rendering.done():  # the thread still uses the session: keep the lock until it ends
                        try:
                            await asyncio.wait({rendering})
                        except asyncio.CancelledError:
                            pass
                    raise
            except ValueError as error:  # the template's ChatTemplateError, or bad tool-call arguments
                raise ApiError("invalid_request", f"cannot render the conversation: {error}", "messages") from None

    async def _prepare(self, chat: ChatRequest, context: CallContext, ids: IdFormat) -> _PreparedCall:
        """Everything that can refuse the call before generation: the model, the rendering, the context length."""
        self.check_model(chat.model)
        session = context.session
        rendered = await self._render(session, chat)
        prompt_ids = rendered.prompt_ids
        if len(prompt_ids) >= self.max_context_tokens:
            raise ApiError(
                "context_length",
                f"the prompt has {len(prompt_ids)} tokens; this model's context holds {self.max_context_tokens} "
                "(prompt + output)",
                "messages",
            )
        call_index = session.next_call_index()
        tag = _short_digest(session.execution_id)
        return _PreparedCall(
            chat=chat,
            context=context,
            rendered=rendered,
            call_index=call_index,
            backend_request=BackendRequest(
                rid=f"{session.execution_id}/{call_index}",
                execution_id=session.execution_id,
                session_key=f"{session.execution_id}/{context.agent_id}",
                prompt_ids=prompt_ids,
                sampling_params=self._sampling_params(chat, len(prompt_ids)),
            ),
            response_id=ids.response.format(tag=tag, index=call_index),
            call_id_prefix=ids.call_prefix.format(tag=tag, index=call_index),
        )

    def _sampling_params(self, chat: ChatRequest, prompt_tokens: int) -> dict[str, Any]:
        room = self.max_context_tokens - prompt_tokens
        wanted = chat.max_tokens if chat.max_tokens is not None else self.default_max_tokens
        params: dict[str, Any] = {
            "max_new_tokens": min(wanted, room),
            "temperature": 1.0 if chat.temperature is None else chat.temperature,
            "top_p": 1.0 if chat.top_p is None else chat.top_p,
            "stop_token_ids": list(self.template.stop_token_ids),
        }
        if chat.top_k is not None:
            params["top_k"] = chat.top_k
        if chat.stop:
            params["stop"] = list(chat.stop)
        if chat.seed is not None:
            params["sampling_seed"] = chat.seed
        return params

    async def _generate(self, call: _PreparedCall, on_output: OnOutput | None) -> BackendResult:
        """One generation through the backend, streamed to `on_output` when given (a backend without
        `generate_streaming` passes the whole output on at the end)."""
        streaming = getattr(self.backend, "generate_streaming", None) if on_output is not None else None
        try:
            if streaming is not None:
                result = await streaming(call.backend_request, on_output)
            else:
                result = await self.backend.generate(call.backend_request)
        except BackendRejected as error:
            raise ApiError("invalid_request", f"the engine refused the request: {error}") from None
        except BackendUnavailable as error:
            raise ApiError("overloaded", f"no engine is available: {error}") from None
        if result.finish_reason == "abort":
            # The agent never sees an aborted turn, so it is neither recorded nor emitted; the SDK retries the 503.
            raise ApiError("overloaded", "the generation was aborted (engine paused or drained); retry")
        if not (len(result.output_ids) == len(result.output_logprobs) == len(result.output_versions)):
            raise RuntimeError(
                f"backend returned {len(result.output_ids)} ids, {len(result.output_logprobs)} log-probs and "
                f"{len(result.output_versions)} versions"
            )
        if on_output is not None and streaming is None and result.output_ids:
            await on_output(tuple(result.output_ids))
        return result

    async def _finish(self, call: _PreparedCall, result: BackendResult) -> tuple[ChatOutcome, str, ParsedOutput | None]:
        """Decode, record the turn, emit ModelCallCompleted; the answer, the final text and its tool-call split."""
        chat, session = call.chat, call.context.session
        text, parsed, matched = final_text(self.template, result, chat.stop, bool(chat.tools))
        content, calls = (parsed.content, parsed.tool_calls) if parsed is not None else (text, ())
        if matched is not None:
            finish = "stop_sequence"
        elif result.finish_reason == "length":
            finish = "length"
        elif calls:
            finish = "tool_calls"
        else:
            finish = "stop"
        async with session.lock:
            session.record_turn(
                turn_key(content, [(c.name, c.arguments_json) for c in calls]),
                call.rendered.prompt_digest,
                result.output_ids,
                call.rendered,
            )
        token_logprobs = None
        if chat.logprobs:
            token_logprobs = tuple(
                (self.template.decode([token]), float(lp))
                for token, lp in zip(result.output_ids, result.output_logprobs)
            )
        finished_s = self.clock()
        rendered = call.rendered
        prompt_tokens = len(rendered.prompt_ids)
        output_ids = tuple(result.output_ids)
        emitted = await self._emit(
            ModelCallCompleted(
                execution_id=session.execution_id,
                group_id=session.group_id,
                call_index=call.call_index,
                agent_id=call.context.agent_id,
                call_kind=call.context.call_kind,
                prompt_tokens=prompt_tokens,
                extends_call=rendered.extends_call,
                shared_tokens=rendered.shared_tokens,
                new_prompt_ids=rendered.new_prompt_ids,
                prompt_digest=rendered.prompt_digest,
                output_ids=output_ids,
                output_logprobs=tuple(float(x) for x in result.output_logprobs),
                output_versions=tuple(int(v) for v in result.output_versions),
                finish_reason=result.finish_reason,
                cached_tokens=int(result.cached_tokens),
                cell=result.cell,
                started_s=call.context.started_s,
                finished_s=finished_s,
                sampling_temperature=logprob_temperature(float(call.backend_request.sampling_params["temperature"])),
            )
        )
        if emitted:  # a record that never left must not be named by the next one
            async with session.lock:
                session.note_call(rendered, call.call_index, output_ids)
        outcome = ChatOutcome(
            response_id=call.response_id,
            model=chat.model,
            created_s=int(finished_s),
            content=content,
            tool_calls=calls,
            tool_call_ids=tuple(f"{call.call_id_prefix}{i}" for i in range(len(calls))),
            finish=finish,
            matched_stop=matched,
            prompt_tokens=prompt_tokens,
            completion_tokens=len(result.output_ids),
            cached_tokens=int(result.cached_tokens),
            token_logprobs=token_logprobs,
        )
        return outcome, text, parsed

    async def _emit(self, message: ModelCallCompleted) -> bool:
        """Hand the record on; False (counted, logged) when `on_call_completed` failed to take it."""
        try:
            outcome = self.on_call_completed(message)
            if inspect.isawaitable(outcome):
                await outcome
            return True
        except Exception as error:
            # The agent still gets its answer; the lost record is counted and logged, never silent.
            self.emit_failures += 1
            log.error("model_call_emit_failed", execution_id=message.execution_id, call_index=message.call_index,
                      error=short_error(error))
            return False
