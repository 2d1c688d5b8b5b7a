"""Weights by broadcast: SGLang's `init_weights_update_group` + `update_weights_from_distributed`, both ends.

The protocol, as SGLang serves it (python/sglang/srt/model_executor/model_runner.py, and as slime, verl and SkyRL
drive it):
1. The sender (a trainer, or a cell holding the new weights) picks a free port on its address and POSTs
   /init_weights_update_group {master_address, master_port, rank_offset, world_size, group_name, backend} to every
   engine; meanwhile it joins the group itself as rank 0. Each engine joins as rank `rank_offset + its tp rank`.
   Joining is a rendezvous (torch.distributed's `tcp://` store, prefixed by the group name, then a process group
   of that backend over it), so every HTTP call returns only once all `world_size` ranks have joined.
2. Per bucket of tensors, the sender POSTs /update_weights_from_distributed {names, dtypes, shapes, group_name,
   flush_cache, weight_version} to every engine and, while those calls wait, broadcasts each tensor of the bucket
   from rank 0 in the order of `names`. Each engine receives into fresh tensors of the named dtype and shape,
   loads them, and answers.
3. /destroy_weights_update_group {group_name} ends it (the sender destroys its side too); an engine that restarts
   has lost its group, and the sender forms a new one.

The groups are not torch.distributed's default group: a trainer has its own (megatron's), and an engine server may
have none. `join_group` forms one apart, by the rendezvous above; `broadcast` and `receive` use it explicitly.
A sharded trainer's version comes as `HFBuckets` (engines/weight_buckets.py): `send` gathers each of its buckets
off the event loop only when the broadcast reaches it, so the sender holds one bucket of the model at a time.
Backends: "gloo" (CPU tensors; what Gyre's engine server and the tests use) and "nccl" (CUDA tensors, what SGLang
on GPUs uses: the sender's tensors must then live on its GPU). Every wait has a deadline (`timeout_s`): a peer that
never joins or never receives fails the update rather than hanging the cell.
"""

from __future__ import annotations

import asyncio
import datetime
import socket
import uuid
from typing import Any, Iterator, Mapping, Sequence

import structlog

import torch
import torch.distributed as dist

from gyre.engines.errors import EngineError
from gyre.engines.weight_buckets import HFBuckets

__all__ = [
    "BACKENDS",
    "BroadcastSender",
    "DEFAULT_BUCKET_BYTES",
    "WeightGroupError",
    "buckets",
    "broadcast",
    "dtype_name",
    "free_port",
    "join_group",
    "leave_group",
    "parse_dtype",
    "receive",
]

BACKENDS = ("gloo", "nccl")
DEFAULT_BUCKET_BYTES = 512 * 2**20
"""Bytes of tensors per /update_weights_from_distributed call: big enough that the HTTP round trip per bucket is
noise next to the broadcast (a 8B model is ~32 buckets in bf16), small enough that the engine's receive buffers
stay a small fraction of its memory."""
log = structlog.get_logger(__name__)
_DTYPES = {name: getattr(torch, name) for name in ("float32", "float16", "bfloat16", "float64", "int64", "int32",
                                                     "int8", "uint8", "bool")}


class WeightGroupError(EngineError, RuntimeError):
    """A weight-update group could not be formed, or a broadcast into it failed or timed out."""


def free_port(host: str) -> int:
    """A port free on `host` now (another process may take it before the rendezvous binds: the join then fails
    with WeightGroupError and the caller forms a new group)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def dtype_name(dtype: torch.dtype) -> str:
    """SGLang's spelling of a dtype in /update_weights_from_distributed ("bfloat16", not "torch.bfloat16")."""
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
    """The torch dtype an update names (with or without the "torch." prefix); WeightGroupError otherwise."""
    dtype = _DTYPES.get(str(name).removeprefix("torch."))
    if dtype is None:
        raise WeightGroupError(f"unknown dtype {name!r} (one of {sorted(_DTYPES)})")
    return dtype


def join_group(master_address: str, master_port: int, rank: int, world_size: int, group_name: str,
               backend: str, timeout_s: float) -> dist.ProcessGroup:
    """Join the weight-update group `group_name` as `rank` of `world_size`; returns once all ranks joined (rank 0
    hosts the rendezvous store). Blocking: call it from a worker thread in async code."""
    if backend not in BACKENDS:
        raise WeightGroupError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if not 0 <= rank < world_size:
        raise WeightGroupError(f"rank {rank} is outside a group of {world_size}")
    if not group_name:
        raise WeightGroupError("a weight-update group needs a name")
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world, rendezvous

    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        store, rank, world_size = next(rendezvous(f"tcp://{master_address}:{master_port}", rank, world_size,
                                                  timeout=timeout))
        store.set_timeout(timeout)
        # The prefix keeps this group's keys apart from any other user of the same store.
        group, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), PrefixStore(group_name, store),
                                             group_name=group_name, timeout=timeout)
    except (RuntimeError, ValueError, OSError) as error:  # torch raises DistStoreError (a RuntimeError) on timeout
        raise WeightGroupError(f"could not join weight-update group {group_name!r} at {master_address}:"
                               f"{master_port} as rank {rank}/{world_size}: {error}") from None
    # Ranks of this group are its own: the identity map lets torch.distributed's collectives take src=0.
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def leave_group(group: dist.ProcessGroup) -> None:
    """Destroy `group` (both ends do, at /destroy_weights_update_group or when an engine goes away)."""
    try:
        dist.destroy_process_group(group)
    except (RuntimeError, ValueError, KeyError):
        pass  # already gone with its peer: nothing left to free


def broadcast(group: dist.ProcessGroup, tensors: Sequence[torch.Tensor]) -> int:
    """Send `tensors` (contiguous) from rank 0 to every rank of `group`, in order; returns the bytes sent."""
    try:
        handles = [dist.broadcast(t if t.is_contiguous() else t.contiguous(), src=0, group=group, async_op=True)
                   for t in tensors]
        for handle in handles:
            handle.wait()
    except RuntimeError as error:
        raise WeightGroupError(f"weight broadcast failed: {error}") from None
    return sum(t.numel() * t.element_size() for t in tensors)


def receive(group: dist.ProcessGroup, names: Sequence[str], dtypes: Sequence[str], shapes: Sequence[Sequence[int]],
            device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """Receive one bucket broadcast from rank 0: fresh tensors of the named dtypes and shapes, in `names` order."""
    if not (len(names) == len(dtypes) == len(shapes)):
        raise WeightGroupError(f"names, dtypes and shapes differ in length ({len(names)}, {len(dtypes)}, "
                               f"{len(shapes)})")
    tensors = [torch.empty(tuple(int(d) for d in shape), dtype=parse_dtype(dtype), device=device)
               for dtype, shape in zip(dtypes, shapes)]
    try:
        handles = [dist.broadcast(t, src=0, group=group, async_op=True) for t in tensors]
        for handle in handles:
            handle.wait()
    except RuntimeError as error:
        raise WeightGroupError(f"weight receive failed: {error}") from None
    return dict(zip(names, tensors))


def _leave_if_formed(joining: "asyncio.Future[dist.ProcessGroup]") -> None:
    """Done-callback of a join whose peers failed: leave the group if it formed after all."""
    if not joining.cancelled() and joining.exception() is None:
        leave_group(joining.result())


def buckets(weights: Mapping[str, torch.Tensor], bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> Iterator[list[str]]:
    """The names of `weights` in buckets of at most `bucket_bytes` (a tensor bigger than that is a bucket alone),
    in the mapping's order."""
    bucket: list[str] = []
    size = 0
    for name, tensor in weights.items():
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append(name)
        size += nbytes
    if bucket:
        yield bucket


class BroadcastSender:
    """Rank 0 of a weight-update group over the engine servers behind `clients` (SGLangClients), the sender's half
    of the protocol in the module doc. `ranks_per_engine` is each server's number of ranks (its TP size; 1 for
    Gyre's server). Not safe for concurrent `send`s: its owner sequences updates."""

    def __init__(self, clients: Sequence[Any], master_address: str, backend: str = "gloo",
                 ranks_per_engine: Sequence[int] | None = None, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 timeout_s: float = 120.0) -> None:
        if not clients:
            raise WeightGroupError("a broadcast needs at least one engine")
        self.clients = list(clients)
        self.master_address = master_address
        self.backend = backend
        self.ranks_per_engine = list(ranks_per_engine or [1] * len(self.clients))
        if len(self.ranks_per_engine) != len(self.clients) or min(self.ranks_per_engine) < 1:
            raise WeightGroupError("ranks_per_engine needs one positive count per engine")
        self.bucket_bytes = bucket_bytes
        self.timeout_s = timeout_s
        self.group_name = ""
        self._group: dist.ProcessGroup | None = None
        self.bytes_sent = 0

    @property
    def connected(self) -> bool:
        return self._group is not None

    async def connect(self) -> None:
        """Form the group: every engine joins (its HTTP call returns once all have) while this side joins as rank 0.
        WeightGroupError (with the group left) if any side fails."""
        from gyre.engines.errors import SGLangError

        port = free_port(self.master_address)
        name = f"gyre-weights-{uuid.uuid4().hex[:12]}"
        world = 1 + sum(self.ranks_per_engine)
        offsets = [1 + sum(self.ranks_per_engine[:i]) for i in range(len(self.clients))]
        joining = asyncio.get_running_loop().run_in_executor(
            None, join_group, self.master_address, port, 0, world, name, self.backend, self.timeout_s)
        calls = [
            asyncio.ensure_future(client.init_weights_update_group(
                self.master_address, port, offset, world, name, self.backend))
            for client, offset in zip(self.clients, offsets)
        ]
        # The engines' calls return once every rank joined, or fail at once (a refused request): then this side's
        # join is left to time out in its thread, and the group it may still form is left as soon as it does.
        answers = await asyncio.gather(*calls, return_exceptions=True)
        failures = [a for a in answers if isinstance(a, BaseException)]
        if failures:
            joining.add_done_callback(_leave_if_formed)
            first = failures[0]
            if isinstance(first, SGLangError):
                raise WeightGroupError(f"could not form weight-update group {name}: {first}") from None
            raise first
        try:
            group = await joining
        except WeightGroupError as error:
            raise WeightGroupError(f"could not form weight-update group {name}: {error}") from None
        self._group, self.group_name = group, name
        log.info("weight_group_formed", group_name=name, world_size=world, backend=self.backend,
                 engines=len(self.clients))

    async def _batches(self, weights: Mapping[str, torch.Tensor] | HFBuckets):
        """(source, names) per broadcast bucket. HFBuckets (a sharded trainer's version) are gathered one of theirs
        at a time, off the event loop, and cut to this sender's bucket size: the whole model is never in memory."""
        if not isinstance(weights, HFBuckets):
            for names in buckets(weights, self.bucket_bytes):
                yield weights, names
            return
        loop = asyncio.get_running_loop()
        parts = iter(weights)
        done = object()
        try:
            while (part := await loop.run_in_executor(None, next, parts, done)) is not done:
                for names in buckets(part, self.bucket_bytes):
                    yield part, names
        finally:
            close = getattr(parts, "close", None)
            if close is not None:
                await loop.run_in_executor(None, close)  # a pass left early still ends on the trainer's side

    async def send(self, weights: Mapping[str, torch.Tensor] | HFBuckets, version: int) -> int:
        """Broadcast `weights` (HF names, a state dict or HFBuckets) bucket by bucket, each engine loading each
        bucket; returns bytes sent. WeightGroupError (the group is then closed: the next send forms a new one) if a
        bucket fails."""
        batches = self._batches(weights)
        try:
            return await self._send(batches, version)
        finally:
            await batches.aclose()

    async def _send(self, batches, version: int) -> int:
        from gyre.engines.errors import SGLangError

        if self._group is None:
            await self.connect()
        assert self._group is not None
        loop = asyncio.get_running_loop()
        total = 0
        async for source, names in batches:
            # nccl moves CUDA tensors only: the bucket goes to this process's GPU first (one bucket at a time).
            device = "cuda" if self.backend == "nccl" else "cpu"
            tensors = [source[name].detach().to(device).contiguous() for name in names]
            calls = [asyncio.ensure_future(client.update_weights_from_distributed(
                names, [dtype_name(t.dtype) for t in tensors], [list(t.shape) for t in tensors], self.group_name,
                flush_cache=True, weight_version=version)) for client in self.clients]
            sending = loop.run_in_executor(None, broadcast, self._group, tensors)
            answers = await asyncio.gather(*calls, return_exceptions=True)
            failures = [a for a in answers if isinstance(a, BaseException)]
            if failures:
                # An engine refused or lost the bucket: the broadcast waits for it in vain until its timeout, so the
                # group is given up now (never reused) and left once the broadcast returns.
                group, self._group = self._group, None
                sending.add_done_callback(lambda _, group=group: leave_group(group))
                await self._destroy_on_engines()
                if isinstance(failures[0], SGLangError):
                    raise WeightGroupError(f"weight broadcast of version {version} failed: {failures[0]}") from None
                raise failures[0]
            try:
                sent = await sending
            except WeightGroupError:
                await self.close()
                raise
            total += sent
        self.bytes_sent += total
        return total

    async def close(self) -> None:
        """Destroy the group on every engine (best effort: one that went away has lost it) and here."""
        group, self._group = self._group, None
        if group is None:
            return
        await self._destroy_on_engines()
        leave_group(group)

    async def _destroy_on_engines(self) -> None:
        from gyre.engines.errors import SGLangError

        for client in self.clients:
            try:
                await client.destroy_weights_update_group(self.group_name)
            except SGLangError as error:
                log.info("weight_group_destroy_failed", group_name=self.group_name, error=str(error))
