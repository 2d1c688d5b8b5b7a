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
from typing import Any, Iterable, Mapping, Protocol, Sequence

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


def turn_key(content: str | None, tool_calls: Iterable[tuple[str, str | Mapping[str, Any]]]) -> str:
    """The normalised identity of an assistant message: its text and its calls' names and arguments.

    `tool_calls` holds (name, arguments) pairs, arguments as JSON text or a dict; ids are not part of the key (the
    template does not render them). Raises ValueError when some arguments are not a JSON object.
    """
    calls = [[name, canonical_arguments_json(arguments)] for name, arguments in tool_calls]
    return json.dumps([content or "", calls], ensure_ascii=False, separators=(",", ":"))


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
    key: str
    prefix_digest: bytes
    output_ids: tuple[int, ...]
    piece: tuple[int, ...]
    """The ids the turn renders to: generation prompt + output (+ turn end if cut short) + trailer."""
    piece_bytes: bytes


def _message_key(message: Mapping[str, Any]) -> Any:
    """A cheap, exact cache key for a message: plain text messages (the bulk of a long conversation) key on their
    strings directly; anything else on its canonical JSON."""
    if message.keys() <= {"role", "content", "tool_call_id"}:
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
        template = self._template
        tools_list = list(tools) if tools else None
        system_key = ("s", json.dumps(tools_list, ensure_ascii=False, sort_keys=True), system_text)
        system_ids, system_bytes = self._cached_ids(system_key, lambda: template.system_ids(tools_list, system_text))
        ids: list[int] = list(system_ids)
        hasher = hashlib.sha256(system_bytes)
        reused = retokenised = 0
        for message in messages:
            entry: tuple[tuple[int, ...], bytes] | None = None
            if message.get("role") == "assistant":
                key = turn_key(message.get("content"), _message_calls(message))
                probe = hasher.copy()
                probe.update(self._generation_prompt_bytes)
                stored = self._turns.get((key, probe.digest())) or self._latest.get(key)
                if stored is not None:
                    entry = (stored.piece, stored.piece_bytes)
                    reused += 1
                else:
                    retokenised += 1
            if entry is None:
                entry = self._cached_ids(_message_key(message), lambda m=message: template.message_ids(m))
            ids.extend(entry[0])
            hasher.update(entry[1])
        ids.extend(self._generation_prompt)
        hasher.update(self._generation_prompt_bytes)
        return RenderedPrompt(
            prompt_ids=tuple(ids), prompt_digest=hasher.digest(), reused_turns=reused, retokenised_turns=retokenised
        )

    def record_turn(self, key: str, prompt_digest: bytes, output_ids: Sequence[int]) -> None:
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
        while len(self._turns) > self._config.max_turns_per_execution:
            _, old = self._turns.popitem(last=False)
            if self._latest.get(old.key) is old:
                del self._latest[old.key]


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
        session = self._by_key_digest.get(self._digest(api_key))
        if session is None:
            return None
        # Defence in depth: the digest table and the execution table must agree.
        digest, current = self._by_execution.get(session.execution_id, (b"", None))
        if current is not session or not hmac.compare_digest(digest, self._digest(api_key)):
            return None
        return session

    def __len__(self) -> int:
        return len(self._by_execution)
