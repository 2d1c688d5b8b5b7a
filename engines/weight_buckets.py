"""A weight version as HF-named buckets made one at a time, and a safetensors file written from them.

A trainer of several processes (engines/trainer_group.py) publishes each version from its shards: `HFBuckets`
iterates the version's buckets (`parallel.bucket_plan`: whole decoder layers, at most `bucket_bytes` fp32 bytes
unless one layer is larger), each gathered from the ranks only when the iteration reaches it and dropped by the
consumer before the next. The bound: the publishing process holds one bucket of the model at a time (plus its own
shard and a snapshot copy of it), never the whole model; every other rank holds its shard, its snapshot and nothing
of the others'. An HFBuckets can be iterated again (a broadcast that failed falls back to disk): each pass gathers
anew from the same snapshot, so every pass gives the same version.

Consumers: `write_safetensors` streams the buckets into one `model.safetensors` (tensor data to a temporary file
as the buckets come, then the header and the data: bounded memory, one extra sequential copy on disk), which the disk
path of engine servers loads; `BroadcastSender.send` (engines/weight_broadcast.py) broadcasts bucket by bucket; an
in-process engine, which holds the whole model anyway, takes `whole()`.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import tempfile
from pathlib import Path
from typing import Callable, Iterator, Mapping

import torch

__all__ = ["HFBuckets", "as_state_dict", "write_safetensors"]

_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64",
           torch.int64: "I64", torch.int32: "I32"}


class HFBuckets:
    """One weight version as an iterable of {HF name: tensor} buckets, each made when the iteration reaches it."""

    def __init__(self, make: Callable[[], Iterator[dict[str, torch.Tensor]]], version: int, num_buckets: int,
                 total_bytes: int) -> None:
        self._make = make
        self.version = version
        """The weight version the buckets hold."""
        self.num_buckets = num_buckets
        self.total_bytes = total_bytes
        """Bytes of the whole model (fp32), for logs."""

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        return iter(self._make())

    def whole(self) -> dict[str, torch.Tensor]:
        """Every bucket in one dict: the whole model in this process (an in-process engine's load)."""
        out: dict[str, torch.Tensor] = {}
        for bucket in self:
            out.update(bucket)
        return out


def as_state_dict(weights: Mapping[str, torch.Tensor] | HFBuckets) -> Mapping[str, torch.Tensor]:
    """A state dict for consumers that need one (an in-process engine): HFBuckets made whole, a dict as it is."""
    return weights.whole() if isinstance(weights, HFBuckets) else weights


def write_safetensors(path: str | os.PathLike, buckets: HFBuckets | Mapping[str, torch.Tensor],
                      metadata: Mapping[str, str] | None = None) -> int:
    """Write the buckets as one safetensors file at `path`, holding one bucket in memory at a time. Returns the
    bytes of tensor data written."""
    path = Path(path)
    parts = buckets if isinstance(buckets, HFBuckets) else [dict(buckets)]
    header: dict = {"__metadata__": dict(metadata or {"format": "pt"})}
    offset = 0
    fd, data_name = tempfile.mkstemp(prefix=".data-", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as data:
            for bucket in parts:
                for name, tensor in bucket.items():
                    if name in header:
                        raise ValueError(f"tensor {name} comes twice")
                    t = tensor.detach().cpu().contiguous()  # a device tensor comes over once, a bucket's part
                    if t.dtype not in _DTYPES:
                        raise ValueError(f"tensor {name} has dtype {t.dtype}, which this writer does not write")
                    nbytes = t.numel() * t.element_size()
                    if nbytes:
                        data.write(t.reshape(-1).view(torch.uint8).numpy())  # the tensor's memory, no bytes copy
                    header[name] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape),
                                    "data_offsets": [offset, offset + nbytes]}
                    offset += nbytes
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)  # safetensors pads the header to 8 bytes
        with open(path, "wb") as out, open(data_name, "rb") as data:
            out.write(struct.pack("<Q", len(encoded)))
            out.write(encoded)
            shutil.copyfileobj(data, out, 16 << 20)
            out.flush()
            os.fsync(out.fileno())
    finally:
        os.unlink(data_name)
    return offset
