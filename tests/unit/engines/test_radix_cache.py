"""RadixCache: block-granular prefix matching, sharing through ref counts, locks and LRU eviction."""

from __future__ import annotations

import random

import pytest

from gyre.engines.kv_pool import KVPool
from gyre.engines.radix_cache import RadixCache

BS = 4


def make(num_blocks: int = 32) -> tuple[KVPool, RadixCache]:
    pool = KVPool(num_layers=1, num_blocks=num_blocks, block_size_tokens=BS, num_kv_heads=1, head_dim=2)
    return pool, RadixCache(pool, BS)


def cache_sequence(pool: KVPool, cache: RadixCache, tokens: list[int]) -> list[int]:
    """What a finishing request does: allocate, insert, then drop its own refs."""
    blocks = pool.alloc(len(tokens) // BS)
    match = cache.insert(tokens, blocks)
    pool.decref(blocks)
    return list(match.block_ids)


def test_match_uses_whole_blocks_only() -> None:
    pool, cache = make()
    tokens = list(range(10))  # two full blocks and a partial one
    blocks = cache_sequence(pool, cache, tokens)
    assert len(blocks) == 2 and cache.num_cached_blocks == 2
    assert list(cache.match_prefix(tokens).block_ids) == blocks
    assert list(cache.match_prefix(tokens[:7]).block_ids) == blocks[:1]
    assert list(cache.match_prefix(tokens, max_blocks=1).block_ids) == blocks[:1]
    assert cache.match_prefix([0, 1, 2, 99, 4, 5, 6, 7]).block_ids == ()
    assert list(cache.match_prefix(tokens[:4] + [50, 51, 52, 53]).block_ids) == blocks[:1]
    # Blocks are held by the tree alone: one ref each.
    assert [pool.ref_count(b) for b in blocks] == [1, 1]


def test_insert_keeps_existing_blocks_and_shares_prefixes() -> None:
    pool, cache = make()
    first = cache_sequence(pool, cache, [1, 2, 3, 4, 5, 6, 7, 8])
    duplicate = pool.alloc(2)
    match = cache.insert([1, 2, 3, 4, 5, 6, 7, 8, 9, 9, 9, 9], duplicate + pool.alloc(1))
    assert list(match.block_ids[:2]) == first  # the tree keeps its own copy of a known prefix
    assert pool.ref_count(duplicate[0]) == 1  # only the caller holds its duplicate; dropping it frees it
    pool.decref(duplicate)
    assert cache.num_cached_blocks == 3
    branch = cache_sequence(pool, cache, [1, 2, 3, 4, 0, 0, 0, 0])
    assert branch[0] == first[0] and branch[1] != first[1]
    assert cache.num_cached_blocks == 4
    with pytest.raises(ValueError):
        cache.insert([1, 2, 3], pool.alloc(1))


def test_eviction_is_lru_over_unlocked_leaves() -> None:
    pool, cache = make(num_blocks=8)
    old = cache_sequence(pool, cache, list(range(0, 8)))
    new = cache_sequence(pool, cache, list(range(100, 108)))
    cache.match_prefix(list(range(100, 108)))  # touch: `new` is the most recently used
    free_before = pool.num_free
    assert cache.evict(1) == 1
    assert pool.num_free == free_before + 1
    assert pool.ref_count(old[1]) == 0  # the older leaf went first
    assert cache.evict(1) == 1
    assert pool.ref_count(old[0]) == 0  # then its parent, now a leaf
    assert cache.num_cached_blocks == 2
    assert list(cache.match_prefix(list(range(100, 108))).block_ids) == new


def test_locked_nodes_and_their_ancestors_survive_eviction() -> None:
    pool, cache = make()
    cache_sequence(pool, cache, list(range(12)))
    cache_sequence(pool, cache, list(range(50, 58)))
    match = cache.match_prefix(list(range(8)))
    cache.lock(match.node)
    assert cache.num_evictable_blocks() == 3  # the third block of the first sequence and the other sequence
    assert cache.evict(100) == 3
    assert list(cache.match_prefix(list(range(8))).block_ids) == list(match.block_ids)
    cache.unlock(match.node)
    assert cache.evict(100) == 2
    assert cache.num_cached_blocks == 0 and pool.num_free == 32
    cache_sequence(pool, cache, list(range(8)))
    with pytest.raises(RuntimeError, match="unlock of unlocked"):
        cache.unlock(cache.match_prefix(list(range(8))).node)


def test_reset_drops_tree_refs_and_detaches_locked_nodes() -> None:
    pool, cache = make()
    tokens = list(range(8))
    cache_sequence(pool, cache, tokens)
    match = cache.match_prefix(tokens)
    cache.lock(match.node)
    pool.incref(match.block_ids)  # a request holding the blocks
    assert cache.reset() == 2
    assert cache.num_cached_blocks == 0
    assert cache.match_prefix(tokens).block_ids == ()
    assert [pool.ref_count(b) for b in match.block_ids] == [1, 1]  # alive through the request
    cache.unlock(match.node)  # harmless on a detached node
    pool.decref(match.block_ids)
    assert pool.num_free == 32


def test_random_operations_keep_ref_counts_consistent() -> None:
    """Requests come and go over a small vocabulary (lots of sharing); at the end every block is free again."""
    rng = random.Random(7)
    pool, cache = make(num_blocks=64)
    live: list[tuple[list[int], object]] = []
    for _ in range(400):
        op = rng.random()
        if op < 0.5:
            tokens = [rng.randrange(3) for _ in range(rng.randrange(1, 20))]
            match = cache.match_prefix(tokens)
            cache.lock(match.node)
            pool.incref(match.block_ids)
            own_needed = len(tokens) // BS - len(match.block_ids)
            if pool.num_free < own_needed:
                cache.evict(own_needed - pool.num_free)
            if pool.num_free < own_needed:
                cache.unlock(match.node)
                pool.decref(match.block_ids)
                continue
            table = list(match.block_ids) + pool.alloc(own_needed)
            live.append((table, match.node))
            inserted = cache.insert(tokens, table)
            for i, tree_block in enumerate(inserted.block_ids):
                if table[i] != tree_block:
                    pool.incref([tree_block])
                    pool.decref([table[i]])
                    table[i] = tree_block
            cache.lock(inserted.node)
            cache.unlock(match.node)
            live[-1] = (table, inserted.node)
        elif op < 0.85 and live:
            table, node = live.pop(rng.randrange(len(live)))
            pool.decref(table)
            cache.unlock(node)  # type: ignore[arg-type]
        elif op < 0.95:
            cache.evict(rng.randrange(1, 6))
        else:
            cache.reset()
        in_tree = cache.num_cached_blocks
        held = {b for table, _ in live for b in table}
        assert pool.num_blocks - pool.num_free <= in_tree + len(held)
    for table, node in live:
        pool.decref(table)
        cache.unlock(node)  # type: ignore[arg-type]
    cache.evict(10_000)
    assert cache.num_cached_blocks == 0
    assert pool.num_free == pool.num_blocks
