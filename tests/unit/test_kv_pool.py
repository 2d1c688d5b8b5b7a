"""KVPool: the allocator's ref counting and the layout's addresses (which Mooncake transfers rely on)."""

from __future__ import annotations

import attrs
import pytest
import torch

from gyre.engines.kv_pool import KVLayout, KVPool, OutOfBlocks


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
