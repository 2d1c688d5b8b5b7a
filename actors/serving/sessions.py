"""Per-execution state of the proxy: API keys, call counters, and the ids of the turns the model generated.

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
an assistant message resolves (a new or evicted turn with the same key) cuts the memo before the first message with
that key, so the result always equals a rendering from scratch.

Isolation: every piece of state hangs off one `ExecutionSession`, reachable only through that execution's API key;
no lookup crosses executions. Everything is bounded: the number of executions, the stored turns and the cached
message renderings per execution (least recently used go first).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
from array import array
from collections import OrderedDict
from itertools import chain
from typing import Any, Hashable, Iterable, Mapping, Protocol, Sequence

import attrs
import structlog

from gyre.engines.tool_calls import canonical_arguments_json

__all__ = [
    "ProxySessionsConfig",
    "ProxySessions",
    "ExecutionSession",
    "RenderedPrompt",
    "SessionsFull",
    "TemplateLike",
    "turn_key",
    "prompt_digest",
]

log = structlog.get_logger(__name__)


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


class SessionsFull(RuntimeError):
    """No room for another execution: the executor must end some before issuing more keys."""


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


def turn_key(content: str | None, tool_calls: Iterable[tuple[str, str | Mapping[str, Any]]]) -> Hashable:
    """The normalised identity of an assistant message: its text and its calls' names and arguments.

    `tool_calls` holds (name, arguments) pairs, arguments as JSON text or a dict; ids are not part of the key (the
    template does not render them). The key is a tuple (no JSON for plain text: it is computed for every assistant
    message of every call). Raises ValueError when some arguments are not a JSON object.
    """
    return (content or "", tuple((name, canonical_arguments_json(arguments)) for name, arguments in tool_calls))


def _ids_bytes(ids: Sequence[int]) -> bytes:
    return array("q", ids).tobytes()


@attrs.frozen
class RenderedPrompt:
    """A request's prompt ids and how they were obtained."""

    prompt_ids: tuple[int, ...]
    """System turn + every message's ids + the generation prompt."""
    prompt_digest: bytes
    """SHA-256 of the prompt ids (as int64 bytes): the identity under which a turn generated from it is stored."""
    reused_turns: int
    """Assistant messages rendered from stored generated ids."""
    retokenised_turns: int
    """Assistant messages this execution did not generate (or no longer remembers), rendered from text."""


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
    """Assistant message key -> index (into `messages`) of its first occurrence."""

    def cut(self, count: int) -> None:
        """Keep the first `count` messages."""
        del self.messages[count:]
        del self.pieces[count + 1 :], self.hashers[count + 1 :]
        del self.reused[count + 1 :], self.retokenised[count + 1 :]
        self.turn_keys = {key: index for key, index in self.turn_keys.items() if index < count}

    def fork(self, count: int) -> "_Memo":
        """A copy holding the first `count` messages (another conversation sharing this one's beginning)."""
        end = count + 1
        return _Memo(
            self.tools, self.system_text, self.messages[:count], self.pieces[:end], self.hashers[:end],
            self.reused[:end], self.retokenised[:end],
            {key: index for key, index in self.turn_keys.items() if index < count},
        )


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

    def __init__(self, execution_id: str, group_id: str, config: ProxySessionsConfig, template: TemplateLike) -> None:
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
        memo, known = self._memo_for(tools_list, system_text, messages)
        for message in messages[known:]:
            hasher = memo.hashers[-1].copy()
            entry: tuple[tuple[int, ...], bytes] | None = None
            reused = retokenised = 0
            if message.get("role") == "assistant":
                key = turn_key(message.get("content"), _message_calls(message))
                stored = self._latest.get(key)
                if stored is not None:
                    probe = hasher.copy()
                    probe.update(self._generation_prompt_bytes)
                    stored = self._turns.get((key, probe.digest())) or stored
                    entry = (stored.piece, stored.piece_bytes)
                    reused = 1
                else:
                    retokenised = 1
                memo.turn_keys.setdefault(key, len(memo.messages))
            if entry is None:
                entry = self._cached_ids(_message_key(message), lambda m=message: self._template.message_ids(m))
            hasher.update(entry[1])
            memo.messages.append(_frozen_copy(message))
            memo.pieces.append(entry[0])
            memo.hashers.append(hasher)
            memo.reused.append(memo.reused[-1] + reused)
            memo.retokenised.append(memo.retokenised[-1] + retokenised)
        final = memo.hashers[-1].copy()
        final.update(self._generation_prompt_bytes)
        return RenderedPrompt(
            prompt_ids=tuple(chain.from_iterable(memo.pieces)) + self._generation_prompt,
            prompt_digest=final.digest(),
            reused_turns=memo.reused[-1],
            retokenised_turns=memo.retokenised[-1],
        )

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
            best, best_known = _Memo(_frozen_copy(tools), system_text, [], [system_ids], [hasher], [0], [0], {}), 0
        self._memos.append(best)
        while len(self._memos) > self._config.max_conversations_per_execution:
            self._memos.pop(0)
        return best, best_known

    def _forget_resolutions(self, key: Hashable) -> None:
        """A stored turn with `key` came or went: messages with that key may now resolve to other ids."""
        for memo in self._memos:
            index = memo.turn_keys.get(key)
            if index is not None:
                memo.cut(index)

    def record_turn(self, key: Hashable, prompt_digest: bytes, output_ids: Sequence[int]) -> None:
        """Remember a generated turn: `key` from `turn_key` of the message as the agent was answered,
        `prompt_digest` from the RenderedPrompt it was generated from."""
        output = tuple(output_ids)
        turn_end = self._template.stop_token_ids[0]
        ending = () if output and output[-1] == turn_end else (turn_end,)
        piece = self._generation_prompt + output + ending + self._trailer
        turn = _StoredTurn(key, prompt_digest, output, piece, _ids_bytes(piece))
        self._turns.pop((key, prompt_digest), None)
        self._turns[(key, prompt_digest)] = turn
        self._latest[key] = turn
        self._forget_resolutions(key)
        while len(self._turns) > self._config.max_turns_per_execution:
            _, old = self._turns.popitem(last=False)
            if self._latest.get(old.key) is old:
                del self._latest[old.key]
            self._forget_resolutions(old.key)


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
        session = ExecutionSession(execution_id, group_id, self.config, self.template)
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
