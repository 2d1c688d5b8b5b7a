"""A prefix cache over token ids at block granularity: requests that share a prefix share its KV blocks.

The tree is a trie whose every edge is exactly one full block of `block_size` token ids (a radix tree whose
edges are cut at block boundaries). Only full blocks are cached: a partial block is still being written by its
request, and a block is immutable once full, so sharing it needs no copy-on-write.

Ownership: the tree holds one ref (see `KVPool`) on each node's block. A request that uses cached blocks adds its
own refs and `lock`s the deepest node it uses, which pins that node and its ancestors. `evict` drops leaves whose
lock count is zero in least-recently-used order; such a block has no owner but the tree, so evicting it frees it.

Recency is a counter bumped on each match or insert, not wall-clock time: eviction order depends only on the order
of calls, so a replayed run evicts the same blocks.
"""

from __future__ import annotations

import heapq
from typing import Protocol, Sequence

import attrs


class BlockOwnerPool(Protocol):
    """The part of `KVPool` the cache needs."""

    def incref(self, block_ids: Sequence[int]) -> None: ...

    def decref(self, block_ids: Sequence[int]) -> None: ...


class RadixNode:
    """One cached block: the `block_size` token ids that lead to it from its parent, and the block holding their KV."""

    __slots__ = ("key", "block_id", "parent", "children", "lock_ref", "last_access", "depth_blocks")

    def __init__(self, key: tuple[int, ...], block_id: int, parent: RadixNode | None, depth_blocks: int) -> None:
        self.key = key
        self.block_id = block_id
        self.parent = parent
        self.children: dict[tuple[int, ...], RadixNode] = {}
        self.lock_ref = 0
        self.last_access = 0
        self.depth_blocks = depth_blocks

    def __repr__(self) -> str:
        return f"RadixNode(block={self.block_id}, depth={self.depth_blocks}, lock={self.lock_ref})"


@attrs.frozen
class PrefixMatch:
    """The cached blocks for the longest cached prefix of a token sequence."""

    block_ids: tuple[int, ...]
    """Blocks holding the KV of the first len(block_ids) * block_size tokens, in order."""
    node: RadixNode
    """The deepest matched node (the root when nothing matched); lock it to keep the blocks cached."""


class RadixCache:
    """Block-granular prefix tree with ref-counted sharing, node locks and LRU eviction."""

    def __init__(self, pool: BlockOwnerPool, block_size_tokens: int) -> None:
        if block_size_tokens < 1:
            raise ValueError(f"block_size_tokens must be >= 1, got {block_size_tokens}")
        self.pool = pool
        self.block_size_tokens = block_size_tokens
        self._tick = 0
        self.root = RadixNode((), -1, None, 0)
        self._leaves: set[RadixNode] = set()
        self._num_blocks = 0

    # ---- queries ------------------------------------------------------------------------------------------

    @property
    def num_cached_blocks(self) -> int:
        return self._num_blocks

    def num_evictable_blocks(self) -> int:
        """Blocks that `evict` could free now: nodes whose lock count is zero (none of their descendants is locked).

        A walk over the tree: call it for statistics and admission decisions, not in a per-token loop.
        """
        count = 0
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            if node.lock_ref == 0:
                count += 1
            stack.extend(node.children.values())
        return count

    def match_prefix(self, token_ids: Sequence[int], max_blocks: int | None = None) -> PrefixMatch:
        """The longest cached prefix of `token_ids` in whole blocks (at most `max_blocks`); marks it recently used."""
        size = self.block_size_tokens
        limit = len(token_ids) // size
        if max_blocks is not None:
            limit = min(limit, max_blocks)
        self._tick += 1
        node = self.root
        blocks: list[int] = []
        for i in range(limit):
            child = node.children.get(tuple(token_ids[i * size : (i + 1) * size]))
            if child is None:
                break
            child.last_access = self._tick
            blocks.append(child.block_id)
            node = child
        return PrefixMatch(tuple(blocks), node)

    # ---- updates ------------------------------------------------------------------------------------------

    def insert(self, token_ids: Sequence[int], block_ids: Sequence[int]) -> PrefixMatch:
        """Cache `block_ids` as the KV of the first len(block_ids) full blocks of `token_ids`.

        Where the tree already holds a block for the same tokens it keeps its own: the returned block ids are the
        tree's, and a caller holding a different block for that position may switch to the tree's and drop its
        duplicate. The tree adds a ref to each block it newly takes.
        """
        size = self.block_size_tokens
        if len(block_ids) * size > len(token_ids):
            raise ValueError(f"{len(block_ids)} blocks need {len(block_ids) * size} tokens, got {len(token_ids)}")
        self._tick += 1
        node = self.root
        tree_blocks: list[int] = []
        for i, block_id in enumerate(block_ids):
            key = tuple(token_ids[i * size : (i + 1) * size])
            child = node.children.get(key)
            if child is None:
                self.pool.incref([block_id])
                child = RadixNode(key, block_id, node, node.depth_blocks + 1)
                if not node.children and node is not self.root:
                    self._leaves.discard(node)
                node.children[key] = child
                self._leaves.add(child)
                self._num_blocks += 1
            child.last_access = self._tick
            tree_blocks.append(child.block_id)
            node = child
        return PrefixMatch(tuple(tree_blocks), node)

    def lock(self, node: RadixNode) -> None:
        """Pin `node` and its ancestors against eviction (counted: each lock needs one unlock)."""
        while node.parent is not None:  # the root (of this tree or a reset one) has no parent
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: RadixNode) -> None:
        """Undo one `lock`. Harmless on a node that `reset` already detached from the tree."""
        while node.parent is not None:
            if node.lock_ref <= 0:
                raise RuntimeError(f"unlock of unlocked node {node!r}")
            node.lock_ref -= 1
            node = node.parent

    def evict(self, num_blocks: int) -> int:
        """Drop up to `num_blocks` unlocked leaves, least recently used first; returns how many were dropped."""
        if num_blocks <= 0:
            return 0
        heap = [(leaf.last_access, id(leaf), leaf) for leaf in self._leaves if leaf.lock_ref == 0]
        heapq.heapify(heap)
        dropped = 0
        while dropped < num_blocks and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            assert parent is not None
            del parent.children[leaf.key]
            self._leaves.discard(leaf)
            leaf.parent = None
            self._num_blocks -= 1
            self.pool.decref([leaf.block_id])
            dropped += 1
            if parent is not self.root and not parent.children:
                self._leaves.add(parent)
                if parent.lock_ref == 0:
                    heapq.heappush(heap, (parent.last_access, id(parent), parent))
        return dropped

    def reset(self) -> int:
        """Forget every node and drop the tree's refs (locked blocks stay alive through their other owners).

        Used when cached KV becomes wrong, e.g. after a weight update. Returns how many blocks the tree held.
        Nodes that callers still hold are detached: unlocking them later changes nothing in the new tree.
        """
        dropped = 0
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            self.pool.decref([node.block_id])
            dropped += 1
        self.root = RadixNode((), -1, None, 0)
        self._leaves.clear()
        self._num_blocks = 0
        return dropped
