"""The paged KV cache: one contiguous tensor of fixed-size blocks, and a ref-counted block allocator.

Why one tensor: Mooncake moves bytes between registered ranges, and registering one range per engine is cheap and
stable, while a tensor per layer would need a registration each. The layout [layers, 2 (k, v), blocks, block_size,
kv_heads, head_dim] makes each (layer, kind, block) a contiguous run of `block_nbytes`, so one block of one layer
is one transfer entry and consecutive block ids merge into one run.

Why ref counts: a block can be owned by several parties at once (the radix cache, each request whose block table
holds it, an export pinned for migration). A block returns to the free list only when its last owner lets go, so
no party needs to know about the others.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import attrs
import torch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class OutOfBlocks(RuntimeError):
    """The pool has fewer free blocks than asked for; the caller evicts, waits or retracts."""


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype for a config name ("float32", "bfloat16", "float16"); ValueError for anything else."""
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unsupported dtype {name!r}; expected one of {sorted(_DTYPES)}") from None


@attrs.frozen
class KVLayout:
    """Where the pool lives in memory and how it is cut, so a peer can address any block of it directly."""

    base_addr: int
    """Address of the first byte of the pool tensor."""
    nbytes: int
    """Size of the whole pool tensor."""
    num_layers: int
    """Transformer layers; the outermost dimension."""
    num_blocks: int
    """Blocks per (layer, kind)."""
    block_size_tokens: int
    """Tokens per block."""
    block_nbytes: int
    """Bytes of one (layer, kind, block): block_size * kv_heads * head_dim * element size."""
    dtype: str
    """Element type name, e.g. "float32"."""

    def block_addr(self, layer: int, kind: int, block_id: int) -> int:
        """Address of one (layer, kind, block); kind 0 is K, 1 is V."""
        return self.base_addr + ((layer * 2 + kind) * self.num_blocks + block_id) * self.block_nbytes

    def block_addrs(self, block_ids: Sequence[int]) -> list[int]:
        """Every (layer, kind, block) address of `block_ids`, layer-major then kind then the given block order.

        Two engines that call this with corresponding block lists get corresponding address lists, which is what a
        transfer needs: entry i of the source maps to entry i of the target.
        """
        for block_id in block_ids:
            if not 0 <= block_id < self.num_blocks:
                raise ValueError(f"block id {block_id} outside [0, {self.num_blocks})")
        return [
            self.block_addr(layer, kind, block_id)
            for layer in range(self.num_layers)
            for kind in (0, 1)
            for block_id in block_ids
        ]

    def compatible_with(self, other: KVLayout) -> bool:
        """Whether blocks of `other` can be copied byte for byte into blocks of this layout."""
        return (
            self.num_layers == other.num_layers
            and self.block_size_tokens == other.block_size_tokens
            and self.block_nbytes == other.block_nbytes
            and self.dtype == other.dtype
        )


class KVPool:
    """The block pool tensor plus its allocator.

    `tensor[layer, kind]` is [num_blocks, block_size, kv_heads, head_dim]; `slot = block * block_size + offset`
    addresses one token in the flattened [num_blocks * block_size, kv_heads, head_dim] view of it.
    """

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size_tokens: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: str = "float32",
    ) -> None:
        if num_blocks < 1 or block_size_tokens < 1:
            raise ValueError(f"num_blocks and block_size_tokens must be >= 1, got {num_blocks}, {block_size_tokens}")
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size_tokens = block_size_tokens
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.tensor = torch.zeros(
            (num_layers, 2, num_blocks, block_size_tokens, num_kv_heads, head_dim), dtype=torch_dtype(dtype)
        )
        self._ref_counts = [0] * num_blocks
        # A stack: recently freed blocks are reused first (warm in cache). Reversed so block 0 goes out first.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))

    # ---- allocator ----------------------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self, count: int) -> list[int]:
        """Take `count` free blocks, each with ref count 1. OutOfBlocks (and nothing taken) if too few are free."""
        if count < 0:
            raise ValueError(f"cannot allocate {count} blocks")
        if count > len(self._free):
            raise OutOfBlocks(f"asked for {count} blocks, {len(self._free)} of {self.num_blocks} free")
        taken = [self._free.pop() for _ in range(count)]
        for block_id in taken:
            self._ref_counts[block_id] = 1
        return taken

    def incref(self, block_ids: Iterable[int]) -> None:
        """Add an owner to blocks that are already allocated."""
        for block_id in block_ids:
            if self._ref_counts[block_id] <= 0:
                raise RuntimeError(f"incref of free block {block_id}")
            self._ref_counts[block_id] += 1

    def decref(self, block_ids: Iterable[int]) -> None:
        """Drop an owner; a block whose last owner leaves returns to the free list."""
        for block_id in block_ids:
            count = self._ref_counts[block_id]
            if count <= 0:
                raise RuntimeError(f"decref of free block {block_id}")
            self._ref_counts[block_id] = count - 1
            if count == 1:
                self._free.append(block_id)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    # ---- memory -------------------------------------------------------------------------------------------

    def layer_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views [num_blocks, block_size, kv_heads, head_dim] of one layer's K and V."""
        return self.tensor[layer, 0], self.tensor[layer, 1]

    def layout(self) -> KVLayout:
        element_size = self.tensor.element_size()
        return KVLayout(
            base_addr=int(self.tensor.data_ptr()),
            nbytes=int(self.tensor.numel() * element_size),
            num_layers=self.num_layers,
            num_blocks=self.num_blocks,
            block_size_tokens=self.block_size_tokens,
            block_nbytes=self.block_size_tokens * self.num_kv_heads * self.head_dim * element_size,
            dtype=self.dtype,
        )

    def read_blocks(self, block_ids: Sequence[int]) -> torch.Tensor:
        """A copy [layers, 2, len(block_ids), block_size, kv_heads, head_dim] of the given blocks."""
        index = torch.as_tensor(list(block_ids), dtype=torch.long)
        return self.tensor.index_select(2, index)

    def write_blocks(self, block_ids: Sequence[int], data: torch.Tensor) -> None:
        """Overwrite the given blocks with `data` shaped like `read_blocks` returns."""
        index = torch.as_tensor(list(block_ids), dtype=torch.long)
        expected = (self.num_layers, 2, len(index), self.block_size_tokens, self.num_kv_heads, self.head_dim)
        if tuple(data.shape) != expected:
            raise ValueError(f"block data has shape {tuple(data.shape)}, expected {expected}")
        self.tensor.index_copy_(2, index, data.to(self.tensor.dtype))
