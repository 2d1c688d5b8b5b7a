"""One prefix-shared token tree per execution, built from the proxy's `ModelCallCompleted` messages.

Why a tree: an agent that compresses its context, spawns sub-agents and retries turns one execution into many
calls whose token sequences share long prefixes. Stored as a radix tree, each shared prefix is kept once, and a
token is identified by its *position in the tree* (the exact prefix that precedes it), which is what lets the
trajectory processor train every shared token once.

Tokens
------
Every call inserts the path prompt + output from the root. A record carries its prompt incrementally (messages/
model_calls.py): the first `shared_tokens` of the path of the earlier call it names (`extends_call`), then its
`new_prompt_ids`. The tree finds that point on the earlier call's path (walking up from its end: a few nodes) and
inserts only the new ids and the output from there, so adding a call costs its new tokens, not its context. The
whole prompt's SHA-256 (`prompt_digest`) is checked against a running hash: each call keeps the hash state after its
prompt and after its output, so a call that extends a whole earlier path (the common case) hashes only its new
ids; a call that branches from inside an earlier path hashes its prefix again (branches are few). A mismatch raises
`PromptMismatch` and the call is not added. A call whose earlier call has not arrived yet waits (bounded:
`TreeConfig.max_pending_calls`) and is added when it does; `pending_calls` counts those still waiting.
 A token is *policy-emitted* if some call
generated it at that position (it was in that call's `output_ids`); otherwise it is a prompt token (system text,
user text, tool results, chat-template glue). Policy tokens of an earlier call re-appear inside the prompts of later
calls that extend it: they sit at the same tree position, so they stay policy-emitted with their original
behaviour log-prob and weight version. If several calls emitted the token at the same position (e.g. a retry that
sampled the same text), the call with the lowest `call_index` supplies the log-prob and version. The tree does not
depend on the order in which calls are added.

Chains
------
Calls are grouped into chains, processed in `call_index` order. A call *extends* an earlier call when its prompt
starts with the earlier call's whole prompt + output.

* A call is *labelled* if its `agent_id` or `call_kind` is non-empty; its label is
  (`agent_id` or "main", `call_kind` or "turn"); `call_kind` must be "turn" or "summary".
* A labelled call continues the chain with the same label whose last call it extends (the deepest such call;
  ties go to the latest); otherwise it starts a new chain with that label.
* An unlabelled call continues any chain whose last call it extends (deepest, then latest); otherwise it starts a
  new chain.
* A new chain whose first prompt starts with the whole prompt of an earlier call is a *branch*: a retry from an
  earlier prefix, or a resample of that very call. `Chain.branched_from` names the chain of the earlier call whose
  prompt (or prompt + output) reaches deepest into the new prompt.

Kinds
-----
* labelled chains: agent "main" -> "main" (turns) or "main-summary" (summaries); any other agent ->
  "sub-agent" or "sub-agent-summary".
* unlabelled chains: a branch takes the kind of the chain it branches from; a fresh chain (not a branch) is
  "main" if the execution has no "main" chain yet (the first chain is the main one), else "sub-agent". Without
  labels a summary call simply continues the chain it summarises, and the chain that resumes after a compression
  (a fresh context) counts as a sub-agent: agents should label their calls to get the intended ranking.

Trajectories
------------
A trajectory is a root-to-leaf path: the prompt + output of the last call of a chain. A chain whose last call is a
prefix of another chain's last call (e.g. the main chain just before a summary call that extends it) is carried by
that longer trajectory rather than standing alone; identical paths become one trajectory (represented by the
latest call). A trajectory's `kind` for ranking is the best kind among the chains it carries, in the order
main > main-summary > sub-agent > sub-agent-summary; `leaf_kind` is the kind of the chain that ends at its leaf.
"""

from __future__ import annotations

import hashlib
import math
import sys
from array import array
from collections.abc import Iterable, Sequence
from typing import Any

import attrs
import numpy as np

from gyre.messages.model_calls import ModelCallCompleted
from gyre.policies.errors import PromptMismatch, TrajectoryError, TreeFull

MAIN = "main"
MAIN_SUMMARY = "main-summary"
SUB_AGENT = "sub-agent"
SUB_AGENT_SUMMARY = "sub-agent-summary"
KINDS: tuple[str, ...] = (MAIN, MAIN_SUMMARY, SUB_AGENT, SUB_AGENT_SUMMARY)
"""Trajectory kinds, most important first."""
KIND_RANK: dict[str, int] = {kind: rank for rank, kind in enumerate(KINDS)}
"""Kind -> rank (0 = most important)."""
CALL_KINDS: tuple[str, ...] = ("turn", "summary")
"""Values a labelled call's `call_kind` may take."""
MAIN_AGENT = "main"
"""The agent id of the top-level agent."""


@attrs.frozen
class TreeConfig:
    """Bounds of one execution's tree."""

    max_calls: int = attrs.field(default=8192, validator=attrs.validators.gt(0))
    """Calls one execution may make."""
    max_stored_tokens: int = attrs.field(default=8_000_000, validator=attrs.validators.gt(0))
    """Distinct tree positions (tokens stored once) one execution may hold."""
    max_pending_calls: int = attrs.field(default=256, validator=attrs.validators.gt(0))
    """Calls held until the earlier call they extend arrives: a lost record must not let a tree hold calls without
    end (past it, TreeFull)."""


@attrs.frozen
class Chain:
    """A sequence of calls each of which extends the previous one (see the module docstring)."""

    chain_id: int
    """0-based, in order of the chain's first call."""
    kind: str
    """One of KINDS."""
    agent_id: str
    """The label's agent ("main" or a sub-agent id); "" for a chain started by an unlabelled call."""
    call_indices: tuple[int, ...]
    """Its calls, in call_index order; the last one ends the chain's trajectory."""
    branched_from: int | None
    """Chain this one branches from (a retry from an earlier prefix); None for a fresh context."""


@attrs.frozen
class Trajectory:
    """A root-to-leaf path of the tree: the prompt + output of one chain's last call."""

    leaf_call_index: int
    """The call whose prompt + output is this path."""
    kind: str
    """Best kind among `chain_ids`: what the trajectory ranks as."""
    leaf_kind: str
    """Kind of the chain that ends at the leaf."""
    chain_ids: tuple[int, ...]
    """Chains whose last call lies on this path (the leaf's own chain included)."""
    num_tokens: int
    """Length of the path."""


@attrs.frozen
class TreePath:
    """Per-token view of one root-to-leaf path, plus where each stretch of it is stored in the tree."""

    token_ids: tuple[int, ...]
    """Token ids from the root."""
    policy_mask: tuple[bool, ...]
    """True where the policy emitted the token at this position."""
    logprobs: tuple[float, ...]
    """Behaviour log-prob of policy tokens; 0.0 elsewhere."""
    versions: tuple[int, ...]
    """Weight version of policy tokens; -1 elsewhere."""
    temperatures: tuple[float, ...]
    """Temperature each policy token was sampled (and its log-prob taken) at, that of the call that emitted it; 1.0
    elsewhere."""
    segments: tuple[tuple[int, int, int], ...]
    """(node_id, start, length): path positions start..start+length-1 are that node's tokens 0..length-1. Two paths
    share a token exactly when they cover the same node offset, which is how the processor trains it once. Node ids
    are stable only while no call is added."""


@attrs.frozen
class TreeStatistics:
    """Sizes of one tree."""

    num_calls: int
    """Calls added."""
    num_nodes: int
    """Radix-tree nodes (the root excluded)."""
    stored_tokens: int
    """Distinct positions stored: shared prefixes counted once."""
    call_tokens: int
    """Sum over calls of len(prompt + output): what storing every call separately would cost."""
    policy_tokens: int
    """Distinct positions the policy emitted."""


INT32 = "i" if array("i").itemsize == 4 else "l"
"""Typecode of the tree's integer arrays (token ids, emitting call, weight version): 4 bytes each, which every id,
call index and version fits (`_validate` refuses one that does not)."""
INT32_MAX = 2**31 - 1


class _Node:
    """A stretch of tokens without a branch. Per-token arrays are aligned with `tokens` (32-bit integers, float64
    log-probs: 20 bytes a stored token)."""

    __slots__ = (
        "node_id", "depth", "parent", "tokens", "emitter", "logprobs", "versions", "children", "ends", "prompt_ends"
    )

    def __init__(self, node_id: int, depth: int, parent: _Node | None, length: int) -> None:
        self.node_id = node_id
        self.depth = depth  # path position of tokens[0]
        self.parent = parent
        self.tokens = array(INT32)
        self.emitter = array(INT32, [-1]) * length  # call_index of the call that emitted the token; -1: prompt token
        self.logprobs = array("d", [0.0]) * length
        self.versions = array(INT32, [-1]) * length
        self.children: dict[int, _Node] = {}
        self.ends: dict[int, list[int]] = {}  # offset -> call indices whose prompt + output ends at that token
        self.prompt_ends: dict[int, list[int]] = {}  # offset -> call indices whose prompt ends at that token


@attrs.frozen
class _Call:
    index: int
    prompt_len: int
    total_len: int
    label: tuple[str, str] | None
    digest: int
    temperature: float
    prompt_hash: Any = attrs.field(eq=False, repr=False)
    """SHA-256 state after the prompt (copied, never updated in place)."""
    path_hash: Any = attrs.field(eq=False, repr=False)
    """SHA-256 state after the prompt + output."""


def ids_bytes(ids: Sequence[int]) -> bytes:
    """Token ids as the bytes a `prompt_digest` hashes: 8-byte little-endian integers."""
    packed = ids if isinstance(ids, array) and ids.typecode == "q" else array("q", ids)
    if sys.byteorder != "little":
        packed = array("q", packed)
        packed.byteswap()
    return packed.tobytes()


def prompt_ids_digest(ids: Sequence[int]) -> bytes:
    """The `ModelCallCompleted.prompt_digest` of a whole prompt."""
    return hashlib.sha256(ids_bytes(ids)).digest()


def whole_prompt_call(**fields: Any) -> ModelCallCompleted:
    """A record that carries its whole prompt: `prompt_ids=...` in place of the incremental fields (what a producer
    with no earlier call to name sends: a scripted benchmark, a test, a replayed recording)."""
    prompt = tuple(fields.pop("prompt_ids"))
    fields.setdefault("prompt_digest", prompt_ids_digest(prompt))
    return ModelCallCompleted(
        prompt_tokens=len(prompt), extends_call=-1, shared_tokens=0, new_prompt_ids=prompt, **fields
    )


class TrajectoryTree:
    """The token tree of one execution. Add calls with `add_call`; read chains, trajectories and paths."""

    def __init__(self, execution_id: str, group_id: str, config: TreeConfig = TreeConfig()) -> None:
        self.execution_id = execution_id
        self.group_id = group_id
        self.config = config
        self._root = _Node(0, 0, None, 0)
        self._next_node_id = 1
        self._calls: dict[int, _Call] = {}
        # extends_call -> calls waiting for it (record, label, digest); call_index -> digest of each waiting one
        self._pending: dict[int, list[tuple[ModelCallCompleted, tuple[str, str] | None, int]]] = {}
        self._pending_digest: dict[int, int] = {}
        self._end_node: dict[int, _Node] = {}
        self._stored_tokens = 0
        self._call_tokens = 0
        self._chains: tuple[Chain, ...] | None = None

    # -- building -----------------------------------------------------------------------------------------------

    def add_call(self, call: ModelCallCompleted) -> None:
        """Insert one call (or hold it until the earlier call it extends arrives). Re-adding an identical call (a
        redelivered message) is a no-op. Raises TrajectoryError (PromptMismatch, TreeFull) and adds nothing."""
        label = self._validate(call)
        digest = hash((call.extends_call, call.shared_tokens, call.new_prompt_ids, call.prompt_digest,
                       call.output_ids, call.output_logprobs, call.output_versions, label, call.sampling_temperature))
        known = self._calls.get(call.call_index)
        if known is None and call.call_index in self._pending_digest:
            known_digest = self._pending_digest[call.call_index]
        else:
            known_digest = known.digest if known is not None else None
        if known_digest is not None:
            if known_digest != digest:
                raise TrajectoryError(
                    f"execution {self.execution_id}: call_index {call.call_index} was already added with other content"
                )
            return
        if len(self._calls) + len(self._pending_digest) >= self.config.max_calls:
            raise TreeFull(f"execution {self.execution_id}: more than {self.config.max_calls} calls")
        if call.extends_call >= 0 and call.extends_call not in self._calls:
            if len(self._pending_digest) >= self.config.max_pending_calls:
                raise TreeFull(
                    f"execution {self.execution_id}: more than {self.config.max_pending_calls} calls wait for the "
                    "earlier calls they extend"
                )
            self._pending.setdefault(call.extends_call, []).append((call, label, digest))
            self._pending_digest[call.call_index] = digest
            return
        self._add(call, label, digest)
        ready = self._pending.pop(call.call_index, [])
        while ready:
            waiting, waiting_label, waiting_digest = ready.pop()
            del self._pending_digest[waiting.call_index]
            self._add(waiting, waiting_label, waiting_digest)
            ready.extend(self._pending.pop(waiting.call_index, []))

    @property
    def pending_calls(self) -> int:
        """Calls still waiting for the earlier call they extend (a tree with any is incomplete)."""
        return len(self._pending_digest)

    def _add(self, call: ModelCallCompleted, label: tuple[str, str] | None, digest: int) -> None:
        where = f"execution {self.execution_id}, call {call.call_index}"
        new_prompt = array("q", call.new_prompt_ids)
        shared = call.shared_tokens
        if call.extends_call < 0:
            start, offset = self._root, 0
            prompt_hash = hashlib.sha256(ids_bytes(new_prompt))
        else:
            base = self._calls[call.extends_call]
            if shared > base.total_len:
                raise TrajectoryError(
                    f"{where}: shares {shared} tokens of call {call.extends_call}, whose path has {base.total_len}"
                )
            start, offset = self._locate(call.extends_call, shared)
            if shared == base.total_len:
                prompt_hash = base.path_hash.copy()
            elif shared == base.prompt_len:
                prompt_hash = base.prompt_hash.copy()
            else:  # a branch from inside the earlier path: hash its prefix again (branches are few)
                prompt_hash = hashlib.sha256(ids_bytes(self._prefix_ids(start, offset)))
            prompt_hash.update(ids_bytes(new_prompt))
        if (call.prompt_digest or call.extends_call >= 0) and prompt_hash.digest() != call.prompt_digest:
            raise PromptMismatch(
                f"{where}: the prompt rebuilt from call {call.extends_call} ({shared} shared tokens + "
                f"{len(new_prompt)} new) does not match the record's prompt digest"
            )
        prompt_len = call.prompt_tokens
        seq = array(INT32, new_prompt)  # ids past 32 bits were refused by _validate
        seq.extend(call.output_ids)
        total = shared + len(seq)
        node = self._insert(seq, shared, start, offset, prompt_len, call.output_logprobs, call.output_versions,
                            call.call_index)
        node.ends.setdefault(total - 1 - node.depth, []).append(call.call_index)
        self._end_node[call.call_index] = node
        prompt_last = prompt_len - 1
        while node.depth > prompt_last:
            node = node.parent
        node.prompt_ends.setdefault(prompt_last - node.depth, []).append(call.call_index)
        path_hash = prompt_hash.copy()
        path_hash.update(ids_bytes(call.output_ids))
        self._calls[call.call_index] = _Call(call.call_index, prompt_len, total, label, digest,
                                             call.sampling_temperature, prompt_hash, path_hash)
        self._call_tokens += total
        self._chains = None

    def _locate(self, call_index: int, depth: int) -> tuple[_Node, int]:
        """(node, m): the node of `call_index`'s path that holds path position depth - 1, and m = depth - its
        depth (its first m tokens lie on the path); (root, 0) for depth 0. Walks up from the call's end node."""
        if depth == 0:
            return self._root, 0
        node = self._end_node[call_index]
        while node.depth > depth - 1:
            node = node.parent
        return node, depth - node.depth

    @staticmethod
    def _prefix_ids(node: _Node, m: int) -> array:
        """The path from the root through node's first m tokens."""
        pieces = [node.tokens[:m]]
        node = node.parent
        while node is not None and node.parent is not None:
            pieces.append(node.tokens)
            node = node.parent
        ids = array(INT32)
        for piece in reversed(pieces):
            ids.extend(piece)
        return ids

    def _validate(self, call: ModelCallCompleted) -> tuple[str, str] | None:
        where = f"execution {self.execution_id}, call {call.call_index}"
        if call.execution_id != self.execution_id:
            raise TrajectoryError(f"{where}: the call belongs to execution {call.execution_id!r}")
        if call.group_id != self.group_id:
            raise TrajectoryError(f"{where}: group {call.group_id!r} differs from the tree's {self.group_id!r}")
        if call.call_index < 0 or call.call_index > INT32_MAX:
            raise TrajectoryError(f"{where}: call_index outside [0, {INT32_MAX}]")
        if call.prompt_tokens < 1:
            raise TrajectoryError(f"{where}: empty prompt (the first token of a path can carry no log-prob)")
        if call.extends_call >= call.call_index or call.extends_call < -1:
            raise TrajectoryError(f"{where}: extends call {call.extends_call}, which is not an earlier call")
        if call.shared_tokens < 0 or (call.extends_call < 0 and call.shared_tokens != 0):
            raise TrajectoryError(f"{where}: {call.shared_tokens} shared tokens of call {call.extends_call}")
        if call.shared_tokens + len(call.new_prompt_ids) != call.prompt_tokens:
            raise TrajectoryError(
                f"{where}: {call.shared_tokens} shared + {len(call.new_prompt_ids)} new prompt ids but "
                f"prompt_tokens {call.prompt_tokens}"
            )
        n = len(call.output_ids)
        if len(call.output_logprobs) != n or len(call.output_versions) != n:
            raise TrajectoryError(
                f"{where}: {n} output ids but {len(call.output_logprobs)} log-probs and "
                f"{len(call.output_versions)} versions"
            )
        for name, values in (("prompt id", call.new_prompt_ids), ("output id", call.output_ids),
                             ("weight version", call.output_versions)):
            if values and (min(values) < -INT32_MAX - 1 or max(values) > INT32_MAX):
                raise TrajectoryError(f"{where}: a {name} outside 32 bits (the tree stores them as int32)")
        if not all(math.isfinite(lp) for lp in call.output_logprobs):
            # A NaN or infinite behaviour log-prob (a broken engine) would turn the whole step's loss into NaN.
            raise TrajectoryError(f"{where}: non-finite behaviour log-prob")
        temperature = call.sampling_temperature
        if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature > 0):
            # The trainer divides its logits by it.
            raise TrajectoryError(f"{where}: sampling_temperature must be finite and > 0, got {temperature!r}")
        if not call.agent_id and not call.call_kind:
            return None
        kind = call.call_kind or "turn"
        if kind not in CALL_KINDS:
            raise TrajectoryError(f"{where}: call_kind {call.call_kind!r} is not one of {CALL_KINDS}")
        return (call.agent_id or MAIN_AGENT, kind)

    def _new_node(self, parent: _Node, depth: int, length: int) -> _Node:
        if self._stored_tokens + length > self.config.max_stored_tokens:
            raise TreeFull(f"execution {self.execution_id}: more than {self.config.max_stored_tokens} stored tokens")
        node = _Node(self._next_node_id, depth, parent, length)
        self._next_node_id += 1
        self._stored_tokens += length
        return node

    def _insert(
        self,
        seq: array,
        depth0: int,
        node: _Node,
        m: int,
        prompt_len: int,
        logprobs: Sequence[float],
        versions: Sequence[int],
        call_index: int,
    ) -> _Node:
        """Walk/extend the tree along `seq`, the path's tokens from position depth0 on, starting inside `node` whose
        first m tokens are the path's positions up to depth0 - 1 (the root and 0 for a whole path); return the node
        that holds the path's last token.

        Policy flags are written only once the walk has succeeded, so that a TreeFull leaves the tree's content as it
        was (a split that happened on the way changes the layout, not the content)."""
        n = depth0 + len(seq)  # path length
        p = depth0  # path position of the next token of seq to place
        walked: list[tuple[_Node, int]] = []  # (node, its first `stop` tokens lie on the path)
        while p < n:
            if m < len(node.tokens):
                matched = _common_prefix(node.tokens, m, seq, p - depth0, min(len(node.tokens) - m, n - p))
                walked.append((node, m + matched))  # a split at m + matched keeps these tokens in `node`
                p += matched
                if p == n:
                    break
                if m + matched < len(node.tokens):
                    self._split(node, m + matched)
            child = node.children.get(seq[p - depth0])
            if child is None:
                fresh = self._new_node(node, p, n - p)
                fresh.tokens = seq[p - depth0 :]
                node.children[seq[p - depth0]] = fresh
                walked.append((fresh, n - p))
                node = fresh
                break
            node, m = child, 0
        for stretch, stop in walked:
            self._mark_emitted(stretch, stop, stretch.depth, prompt_len, logprobs, versions, call_index)
        return node

    @staticmethod
    def _mark_emitted(
        node: _Node,
        stop: int,
        seq_start: int,
        prompt_len: int,
        logprobs: Sequence[float],
        versions: Sequence[int],
        call_index: int,
    ) -> None:
        """Record that `call_index` emitted those of node tokens 0..stop-1 that lie in its output (seq_start = the
        path position of node token 0). The lowest call_index wins, so the result does not depend on arrival order."""
        for k in range(max(0, prompt_len - seq_start), stop):
            current = node.emitter[k]
            if current < 0 or current > call_index:
                out = seq_start + k - prompt_len
                node.emitter[k] = call_index
                node.logprobs[k] = logprobs[out]
                node.versions[k] = versions[out]

    def _split(self, node: _Node, at: int) -> None:
        """Cut `node` after `at` tokens; the tail becomes its only child. Ids of existing nodes do not change."""
        tail = _Node(self._next_node_id, node.depth + at, node, 0)
        self._next_node_id += 1
        tail.tokens, node.tokens = node.tokens[at:], node.tokens[:at]
        tail.emitter, node.emitter = node.emitter[at:], node.emitter[:at]
        tail.logprobs, node.logprobs = node.logprobs[at:], node.logprobs[:at]
        tail.versions, node.versions = node.versions[at:], node.versions[:at]
        tail.children, node.children = node.children, {tail.tokens[0]: tail}
        for grandchild in tail.children.values():
            grandchild.parent = tail
        ends, node.ends = node.ends, {}
        for offset, calls in ends.items():
            if offset < at:
                node.ends[offset] = calls
            else:
                tail.ends[offset - at] = calls
                for c in calls:
                    self._end_node[c] = tail
        prompt_ends, node.prompt_ends = node.prompt_ends, {}
        for offset, calls in prompt_ends.items():
            if offset < at:
                node.prompt_ends[offset] = calls
            else:
                tail.prompt_ends[offset - at] = calls

    # -- reading ------------------------------------------------------------------------------------------------

    @property
    def num_calls(self) -> int:
        return len(self._calls)

    def call_indices(self) -> tuple[int, ...]:
        """The calls added, in call_index order."""
        return tuple(sorted(self._calls))

    def statistics(self) -> TreeStatistics:
        nodes, policy = 0, 0
        stack = list(self._root.children.values())
        while stack:
            node = stack.pop()
            nodes += 1
            policy += sum(1 for e in node.emitter if e >= 0)
            stack.extend(node.children.values())
        return TreeStatistics(len(self._calls), nodes, self._stored_tokens, self._call_tokens, policy)

    def _ends_on_path(self, call_index: int, limit: int, prompts: bool = False) -> list[tuple[int, int]]:
        """(depth of last token, call) for every call whose prompt + output (or, with `prompts`, whose prompt) is a
        prefix of `call_index`'s path and no longer than limit + 1 tokens."""
        node: _Node | None = self._end_node[call_index]
        limit = min(limit, self._calls[call_index].total_len - 1)
        found = []
        while node is not None and node is not self._root:
            for offset, calls in (node.prompt_ends if prompts else node.ends).items():
                depth = node.depth + offset
                if depth <= limit:
                    found.extend((depth, c) for c in calls)
            node = node.parent
        return found

    def chains(self) -> tuple[Chain, ...]:
        """Chains of the calls added so far (rules in the module docstring), in order of their first call."""
        if self._chains is None:
            self._chains = self._assign_chains()
        return self._chains

    def _assign_chains(self) -> tuple[Chain, ...]:
        kinds: list[str] = []
        labels: list[tuple[str, str] | None] = []
        members: list[list[int]] = []
        branched: list[int | None] = []
        chain_of: dict[int, int] = {}
        for index in sorted(self._calls):
            call = self._calls[index]
            extended = [(d, c) for d, c in self._ends_on_path(index, call.prompt_len - 1) if c < index]
            best: tuple[int, int] | None = None
            for depth, c in extended:
                chain = chain_of[c]
                if members[chain][-1] != c:
                    continue
                if call.label is not None and labels[chain] != call.label:
                    continue
                if best is None or (depth, c) > best:
                    best = (depth, c)
            if best is not None:
                chain = chain_of[best[1]]
                members[chain].append(index)
                chain_of[index] = chain
                continue
            reached = extended + [(d, c) for d, c in self._ends_on_path(index, call.prompt_len - 1, True) if c < index]
            source = chain_of[max(reached)[1]] if reached else None
            if call.label is not None:
                agent, call_kind = call.label
                if agent == MAIN_AGENT:
                    kind = MAIN if call_kind == "turn" else MAIN_SUMMARY
                else:
                    kind = SUB_AGENT if call_kind == "turn" else SUB_AGENT_SUMMARY
            elif source is not None:
                kind = kinds[source]
            else:
                kind = SUB_AGENT if MAIN in kinds else MAIN
            chain_of[index] = len(members)
            kinds.append(kind)
            labels.append(call.label)
            members.append([index])
            branched.append(source)
        return tuple(
            Chain(i, kinds[i], labels[i][0] if labels[i] else "", tuple(members[i]), branched[i])
            for i in range(len(members))
        )

    def trajectories(self) -> tuple[Trajectory, ...]:
        """Root-to-leaf trajectories (one per chain end not carried by a longer one), in leaf call_index order."""
        chains = self.chains()
        chain_of_end = {chain.call_indices[-1]: chain for chain in chains}
        on_path: dict[int, list[int]] = {}
        carried: set[int] = set()
        for end in chain_of_end:
            total = self._calls[end].total_len
            ends = [(d, c) for d, c in self._ends_on_path(end, total - 1) if c in chain_of_end]
            on_path[end] = [c for _, c in ends]
            for depth, c in ends:
                # c lies on end's path: end carries it if end is longer, or equally long and later.
                if c != end and (depth < total - 1 or c < end):
                    carried.add(c)
        result = []
        for end in sorted(chain_of_end):
            if end in carried:
                continue
            chain_ids = tuple(sorted(chain_of_end[c].chain_id for c in on_path[end]))
            kind = min((chain_of_end[c].kind for c in on_path[end]), key=KIND_RANK.__getitem__)
            result.append(
                Trajectory(end, kind, chain_of_end[end].kind, chain_ids, self._calls[end].total_len)
            )
        return tuple(result)

    def prompt_ids(self, call_index: int) -> tuple[int, ...]:
        """The whole prompt of one call, rebuilt from the tree."""
        if call_index not in self._calls:
            raise KeyError(f"execution {self.execution_id} has no call {call_index}")
        call = self._calls[call_index]
        node, m = self._locate(call_index, call.prompt_len)
        return tuple(self._prefix_ids(node, m))

    def path(self, call_index: int) -> TreePath:
        """The path of one call's prompt + output, with each token's policy flag, log-prob, version and sampling
        temperature."""
        if call_index not in self._calls:
            raise KeyError(f"execution {self.execution_id} has no call {call_index}")
        total = self._calls[call_index].total_len
        node: _Node | None = self._end_node[call_index]
        pieces: list[tuple[_Node, int]] = []
        stop = total - node.depth  # tokens of the end node on the path
        while node is not None and node is not self._root:
            pieces.append((node, stop))
            node = node.parent
            if node is not None:
                stop = len(node.tokens)
        pieces.reverse()
        tokens, emitter, logprobs, versions = array(INT32), array(INT32), array("d"), array(INT32)
        segments = []
        for node, length in pieces:
            segments.append((node.node_id, node.depth, length))
            tokens.extend(node.tokens[:length])
            emitter.extend(node.emitter[:length])
            logprobs.extend(node.logprobs[:length])
            versions.extend(node.versions[:length])
        assert len(tokens) == total, "a call's path must be as long as its prompt + output"
        temperatures = tuple(self._calls[e].temperature if e >= 0 else 1.0 for e in emitter)
        return TreePath(
            tuple(tokens), tuple(e >= 0 for e in emitter), tuple(logprobs), tuple(versions), temperatures,
            tuple(segments),
        )


class PromptRebuilder:
    """Whole prompts of incremental records, rebuilt (and checked against their digests) through one tree per
    execution: for readers that want them (a recording, a test, a report). Holds what its trees hold; `forget` an
    execution that is done."""

    def __init__(self, config: TreeConfig = TreeConfig()) -> None:
        self.config = config
        self._trees: dict[str, TrajectoryTree] = {}

    def add(self, call: ModelCallCompleted) -> None:
        """Take one record (any order; TrajectoryError as from `TrajectoryTree.add_call`)."""
        tree = self._trees.get(call.execution_id)
        if tree is None:
            tree = self._trees[call.execution_id] = TrajectoryTree(call.execution_id, call.group_id, self.config)
        tree.add_call(call)

    def prompt_ids(self, call: ModelCallCompleted) -> tuple[int, ...]:
        """The whole prompt of a record taken; TrajectoryError if it still waits for the call it extends."""
        tree = self._trees.get(call.execution_id)
        try:
            if tree is None:
                raise KeyError(call.execution_id)
            return tree.prompt_ids(call.call_index)
        except KeyError:
            raise TrajectoryError(
                f"execution {call.execution_id}, call {call.call_index}: not taken, or it extends a call not taken"
            ) from None

    def forget(self, execution_id: str) -> None:
        self._trees.pop(execution_id, None)


def rebuild_prompts(calls: Iterable[ModelCallCompleted], config: TreeConfig = TreeConfig()) -> list[tuple[int, ...]]:
    """The whole prompt of each call, in the order given (see `PromptRebuilder`)."""
    calls = list(calls)
    rebuilder = PromptRebuilder(config)
    for call in calls:
        rebuilder.add(call)
    return [rebuilder.prompt_ids(call) for call in calls]


def build_tree(
    calls: Iterable[ModelCallCompleted], config: TreeConfig = TreeConfig()
) -> TrajectoryTree:
    """A tree from one execution's calls (at least one), in any order."""
    calls = list(calls)
    if not calls:
        raise TrajectoryError("build_tree needs at least one call")
    tree = TrajectoryTree(calls[0].execution_id, calls[0].group_id, config)
    for call in calls:
        tree.add_call(call)
    return tree


def _common_prefix(stored: array, at: int, seq: array, start: int, limit: int) -> int:
    """How many of stored[at:at+limit] equal seq[start:start+limit]. Slices compare in C; on a mismatch numpy finds
    it."""
    if stored[at : at + limit] == seq[start : start + limit]:
        return limit
    a = np.asarray(stored[at : at + limit], dtype=np.int64)
    b = np.asarray(seq[start : start + limit], dtype=np.int64)
    return int(np.flatnonzero(a != b)[0])
