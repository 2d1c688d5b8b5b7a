"""KVPool: the allocator's ref counting and the layout's addresses (which Mooncake transfers rely on)."""

from __future__ import annotations

import ctypes

import attrs
import pytest
import torch

from gyre.engines.errors import OutOfBlocks
from gyre.engines.kv_pool import KVLayout, KVPool, KVStaging


def make_pool(num_blocks: int = 8) -> KVPool:
    return KVPool(num_layers=3, num_blocks=num_blocks, block_size_tokens=4, num_kv_heads=2, head_dim=5)


def test_alloc_and_free_by_ref_count() -> None:
    pool = make_pool()
    first = pool.alloc(3)
    assert len(set(first)) == 3 and pool.num_free == 5
    pool.incref(first[:1])
    pool.decref(first)
    assert pool.num_free == 7  # the block with a second owner stays taken
    assert pool.ref_count(first[0]) == 1
    pool.decref(first[:1])
    assert pool.num_free == 8
    with pytest.raises(RuntimeError, match="decref of free block"):
        pool.decref(first[:1])
    with pytest.raises(RuntimeError, match="incref of free block"):
        pool.incref(first[:1])


def test_alloc_beyond_free_takes_nothing() -> None:
    pool = make_pool(4)
    pool.alloc(3)
    with pytest.raises(OutOfBlocks):
        pool.alloc(2)
    assert pool.num_free == 1
    assert len(pool.alloc(1)) == 1
    with pytest.raises(ValueError):
        pool.alloc(-1)


def test_layout_addresses_match_the_tensor() -> None:
    pool = make_pool()
    layout = pool.layout()
    tensor = pool.tensor
    assert tensor.shape == (3, 2, 8, 4, 2, 5)
    assert layout.base_addr == tensor.data_ptr()
    assert layout.nbytes == tensor.numel() * 4
    assert layout.block_nbytes == 4 * 2 * 5 * 4
    for layer in range(3):
        for kind in (0, 1):
            for block in (0, 5, 7):
                assert layout.block_addr(layer, kind, block) == tensor[layer, kind, block].data_ptr()
    addrs = layout.block_addrs([5, 2])
    assert len(addrs) == 3 * 2 * 2
    assert addrs[:4] == [
        tensor[0, 0, 5].data_ptr(),
        tensor[0, 0, 2].data_ptr(),
        tensor[0, 1, 5].data_ptr(),
        tensor[0, 1, 2].data_ptr(),
    ]
    with pytest.raises(ValueError, match="outside"):
        layout.block_addrs([8])


def test_layout_compatibility() -> None:
    layout = make_pool().layout()
    assert layout.compatible_with(make_pool(num_blocks=20).layout())
    other = KVPool(num_layers=3, num_blocks=8, block_size_tokens=8, num_kv_heads=2, head_dim=5).layout()
    assert not layout.compatible_with(other)
    assert KVLayout(**attrs.asdict(layout)) == layout  # what /gyre/kv/export sends rebuilds the layout


def test_read_and_write_blocks_round_trip() -> None:
    pool = make_pool()
    pool.tensor.copy_(torch.randn(pool.tensor.shape))
    data = pool.read_blocks([1, 6])
    assert torch.equal(data[:, :, 0], pool.tensor[:, :, 1])
    target = make_pool()
    target.write_blocks([3, 0], data)
    assert torch.equal(target.tensor[:, :, 3], pool.tensor[:, :, 1])
    assert torch.equal(target.tensor[:, :, 0], pool.tensor[:, :, 6])
    with pytest.raises(ValueError, match="shape"):
        target.write_blocks([3], data)


def test_unsupported_dtype_is_rejected() -> None:
    with pytest.raises(ValueError, match="unsupported dtype"):
        KVPool(1, 1, 1, 1, 1, dtype="int8")


def memory(addr: int, nbytes: int) -> bytes:
    return ctypes.string_at(addr, nbytes)


def test_staged_region_holds_the_blocks_in_block_addrs_order() -> None:
    """A peer reads a region as one range and expects what a per-block read of block_addrs would give."""
    pool = make_pool(num_blocks=10)
    pool.tensor.copy_(torch.randn(pool.tensor.shape))
    staging = KVStaging(pool, capacity_blocks=6)
    assert staging.slot_nbytes == 3 * 2 * pool.layout().block_nbytes
    blocks = [7, 2, 9, 3]
    region = staging.reserve(len(blocks))
    assert region is not None and region.nbytes == 4 * staging.slot_nbytes
    staging.gather(pool, blocks, region)
    layout = pool.layout()
    per_block = b"".join(memory(addr, layout.block_nbytes) for addr in layout.block_addrs(blocks))
    assert memory(region.addr, region.nbytes) == per_block

    target = KVPool(num_layers=3, num_blocks=10, block_size_tokens=4, num_kv_heads=2, head_dim=5)
    staging.scatter(region, target, [0, 5, 1, 8])
    for source_block, target_block in zip(blocks, [0, 5, 1, 8]):
        assert torch.equal(target.tensor[:, :, target_block], pool.tensor[:, :, source_block])
    untouched = [b for b in range(10) if b not in (0, 5, 1, 8)]
    assert not target.tensor[:, :, untouched].any()
    # Mostly consecutive targets take the copy-per-run path; the bytes land the same way.
    many = KVPool(num_layers=3, num_blocks=40, block_size_tokens=4, num_kv_heads=2, head_dim=5)
    staging_many = KVStaging(many, capacity_blocks=20)
    many.tensor.copy_(torch.randn(many.tensor.shape))
    sources, targets = [39, 3, 7, 0, 12, 5, 8, 1, 2, 33, 34, 35, 29, 28, 27, 26, 6], [*range(10, 26), 30]
    wide = staging_many.reserve(len(sources))
    staging_many.gather(many, sources, wide)
    copy = many.tensor.clone()
    staging_many.scatter(wide, many, targets)
    for source_block, target_block in zip(sources, targets):
        assert torch.equal(many.tensor[:, :, target_block], copy[:, :, source_block])
    others = [b for b in range(40) if b not in targets]
    assert torch.equal(many.tensor[:, :, others], copy[:, :, others])
    with pytest.raises(ValueError, match="do not"):
        staging.gather(pool, [1, 2], region)
    with pytest.raises(ValueError, match="do not"):
        staging.scatter(region, target, [1])


def test_staging_regions_are_first_fit_bounded_and_quarantinable() -> None:
    staging = KVStaging(make_pool(), capacity_blocks=8)
    first, second = staging.reserve(3), staging.reserve(3)
    assert first is not None and second is not None
    assert (first.start_slot, second.start_slot) == (0, 3)
    assert second.addr == first.addr + first.nbytes
    assert staging.reserve(3) is None  # 2 slots left: too small, and nothing else is taken
    assert staging.reserve(9) is None
    assert staging.free_blocks == 2
    staging.release(first)
    again = staging.reserve(2)
    assert again is not None and again.start_slot == 0  # the first gap that fits
    staging.release(again)
    staging.quarantine(second)
    staging.release(second)  # a quarantined region stays taken
    assert staging.free_blocks == 5 and staging.quarantined_blocks == 3
    assert staging.reserve(4) is None  # the free slots are split around the quarantined region
    assert staging.reserve(3) is not None
    with pytest.raises(RuntimeError, match="not taken"):
        staging.release(first)
    with pytest.raises(ValueError):
        staging.reserve(0)
    with pytest.raises(ValueError):
        KVStaging(make_pool(), capacity_blocks=0)
