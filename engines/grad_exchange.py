"""Gradients between training cells by collectives: a ring among the satellites, then each reduced chunk to the core.

The cells that train one optimizer step are the core (rank 0: it keeps the optimizer state and its own gradients in
its trainer) and the satellites that hold gradients of the step (ranks 1..m). A *reduction round* sums the
satellites' flat gradient buffers into the core with torch.distributed point-to-point operations over a process
group of exactly those cells (gloo on CPU, NCCL on CUDA: the same code, `backend_for`):
1. reduce-scatter over a ring of the m satellites: the buffer is cut into m chunks; in m - 1 steps each satellite
   sends one chunk to the next and adds the chunk it receives from the previous one; then satellite j holds the sum
   of chunk (j + 1) mod m over all satellites;
2. gather: each satellite sends its summed chunk to the core, which receives the whole sum (m chunks, S bytes).
Bytes per round, for a buffer of S bytes: a satellite sends S and receives (m - 1) / m * S, the core receives S,
whatever m is. A parameter server (the core pulling each satellite's buffer) receives m * S. `ring_bytes` and
`parameter_server_bytes` give both; `reduce_to_core` counts what it really moved.

The group is formed per membership (`ReductionMember.group`): the core runs a TCPStore (`RendezvousServer`), every
member connects to it once, and each membership gets a `ProcessGroupGloo`/`ProcessGroupNCCL` built on a
`PrefixStore` of its group id (gloo connects every pair, so forming a group of k costs k - 1 TCP connections per
member plus the store's round trips; measured by `gyre bench gradients`). A group is reused while the membership
stays the same and dropped on any failure. Every wait is bounded by the group's timeout, and a member that dies
makes its peers' waits fail (gloo reports the closed connection) rather than hang.

The round also carries each member's list of the micro-steps in its buffer through the store (`publish_held`,
`read_held`): the core counts exactly what the sum contains, even micro-steps whose report is still on the bus.

Lanes: cells whose trainers span several processes (engines/trainer_group.py) share one training layout, so global
rank g of every cell holds the same shard. A round then runs one ring per *lane* g, among the cells' ranks g, each
lane over a process group of its own (`lane` in `ReductionMember.group`, the store prefix `.../lane<g>`), all lanes
at once in their own processes: the core's rank g receives its shard's S_g bytes, each satellite's rank g sends S_g,
and a cell moves the sum over its ranks, whatever the number of cells. A one-process cell is lane 0 only.
"""

from __future__ import annotations

import datetime
import time
from typing import Any

import attrs
import torch

from gyre.engines.errors import EngineError
from gyre.engines.parallel import backend_for

__all__ = ["GradientExchangeError", "ReductionBytes", "ReductionMember", "RendezvousServer", "chunk_bounds",
           "parameter_server_bytes", "reduce_to_core", "ring_bytes"]

_KEY = "gyre/grads"
MAX_HELD_BYTES = 1 << 20
"""A held list bigger than this is refused: it names micro-steps of one step (a few hundred at most)."""


class GradientExchangeError(EngineError, RuntimeError):
    """A reduction round could not run or finish (a member missing, dead or too slow, a bad buffer)."""


@attrs.frozen
class ReductionBytes:
    """Bytes one member moved in one round (tensor payloads; gloo's own framing is a few bytes per message)."""

    sent: int
    received: int

    @property
    def total(self) -> int:
        return self.sent + self.received


def ring_bytes(nbytes: int, satellites: int, element_size: int = 4) -> dict[str, ReductionBytes]:
    """What `reduce_to_core` moves for a buffer of `nbytes` and `satellites` members besides the core: the core's
    and each satellite's figure (a satellite's chunk sizes differ by at most one element; the largest is given)."""
    if satellites < 1:
        raise ValueError(f"a round needs at least one satellite, got {satellites}")
    numel = nbytes // element_size
    sizes = [(b - a) * element_size for a, b in chunk_bounds(numel, satellites)]
    # Satellite j sends every chunk once (m - 1 in the ring, its own reduced one to the core) and receives every
    # chunk but its own (chunk j) in the ring.
    return {
        "core": ReductionBytes(0, sum(sizes)),
        "satellite": ReductionBytes(sum(sizes), sum(sizes) - min(sizes)),
    }


def parameter_server_bytes(nbytes: int, satellites: int) -> dict[str, ReductionBytes]:
    """The old path: the core pulls each satellite's whole buffer (Mooncake), one per satellite micro-step."""
    return {"core": ReductionBytes(0, nbytes * satellites), "satellite": ReductionBytes(nbytes, 0)}


def chunk_bounds(numel: int, parts: int) -> list[tuple[int, int]]:
    """[start, end) of `parts` nearly equal chunks of `numel` elements (the first ones one element longer)."""
    if parts < 1 or numel < parts:
        raise GradientExchangeError(f"cannot cut {numel} elements into {parts} non-empty chunks")
    base, extra = divmod(numel, parts)
    bounds, start = [], 0
    for i in range(parts):
        end = start + base + (1 if i < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def _wait(works: list[Any], what: str) -> None:
    for work in works:
        try:
            work.wait()
        except RuntimeError as error:  # gloo: a closed connection or the group's timeout
            raise GradientExchangeError(f"{what}: {error}") from error


def _exchange(group: Any, backend: str, device: torch.device, send: torch.Tensor, to: int, recv: torch.Tensor,
              frm: int, tag: int) -> None:
    if backend == "nccl":
        # NCCL point-to-point kernels wait for their peer: a ring whose every rank sends first would hang unless
        # the send and the receive are launched as one group (what torch's batch_isend_irecv does).
        group._start_coalescing(device)
        group.send([send], to, tag)
        group.recv([recv], frm, tag)
        _wait([group._end_coalescing(device)], f"ring step {tag}")
        return
    _wait([group.send([send], to, tag), group.recv([recv], frm, tag)], f"ring step {tag}")


def reduce_to_core(group: Any, rank: int, size: int, flat: torch.Tensor, backend: str = "gloo") -> ReductionBytes:
    """One round over `group` (ranks 0..size-1, rank 0 the core). A satellite passes its 1-D gradient buffer, used
    as the ring's work space (its contents are meaningless afterwards: zero it). The core passes a 1-D buffer of the
    same size, overwritten with the sum of the satellites' buffers. Returns the bytes this rank moved. Raises
    GradientExchangeError when a peer fails or the group's timeout passes."""
    if size < 2:
        raise GradientExchangeError(f"a reduction round needs the core and a satellite, got size {size}")
    if not 0 <= rank < size:
        raise GradientExchangeError(f"rank {rank} is outside a group of {size}")
    if flat.dim() != 1 or not flat.is_contiguous():
        raise GradientExchangeError("the gradient buffer must be one contiguous 1-D tensor")
    try:
        return _reduce(group, rank, size, flat, backend)
    except RuntimeError as error:  # gloo raises as it posts an operation on a connection its peer closed, too
        if isinstance(error, GradientExchangeError):
            raise
        raise GradientExchangeError(f"rank {rank} of {size}: {error}") from error


def _reduce(group: Any, rank: int, size: int, flat: torch.Tensor, backend: str) -> ReductionBytes:
    m = size - 1
    bounds = chunk_bounds(flat.numel(), m)
    gather_tag = m
    item = flat.element_size()
    if rank == 0:
        works = []
        for j in range(m):
            start, end = bounds[(j + 1) % m]
            works.append(group.recv([flat[start:end]], 1 + j, gather_tag))
        _wait(works, "gathering the reduced chunks")
        return ReductionBytes(0, flat.numel() * item)
    j = rank - 1
    after, before = 1 + (j + 1) % m, 1 + (j - 1) % m
    scratch = torch.empty(bounds[0][1] - bounds[0][0], dtype=flat.dtype, device=flat.device)
    sent = received = 0
    for step in range(m - 1):
        (s0, s1), (r0, r1) = bounds[(j - step) % m], bounds[(j - step - 1) % m]
        incoming = scratch[: r1 - r0]
        _exchange(group, backend, flat.device, flat[s0:s1], after, incoming, before, step)
        flat[r0:r1].add_(incoming)
        sent += (s1 - s0) * item
        received += (r1 - r0) * item
    start, end = bounds[(j + 1) % m]
    _wait([group.send([flat[start:end]], 0, gather_tag)], "sending the reduced chunk to the core")
    return ReductionBytes(sent + (end - start) * item, received)


def _timeout(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


class RendezvousServer:
    """The core's TCPStore: where the members of each round find each other and leave their held lists."""

    def __init__(self, host: str, timeout_s: float) -> None:
        import torch.distributed as dist

        self.host = host
        self.store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=_timeout(timeout_s))
        self.port = int(self.store.port)


def _held_key(round_id: int, rank: int) -> str:
    return f"{_KEY}/round{round_id}/held{rank}"


class ReductionMember:
    """One cell's side of the rounds: its store client and its current group. Blocking; one round at a time."""

    def __init__(self, device: str = "cpu", timeout_s: float = 60.0, store: Any = None) -> None:
        self.device = device
        self.backend = backend_for(device)
        self.timeout_s = timeout_s
        self._store = store
        """The core passes its RendezvousServer's store; a satellite connects on its first round."""
        self._store_address: tuple[str, int] | None = None
        self._groups: dict[int, tuple[tuple, Any]] = {}
        """Lane -> (its group's key, the group): one per lane this process reduces (a one-process cell has lane 0;
        a member that joins with zeros for a trainer it no longer has holds every lane)."""
        self.groups_formed = 0
        self.last_join_s = 0.0
        """Seconds the last group formation took (0 when the round reused the group)."""

    def store(self, host: str, port: int) -> Any:
        import torch.distributed as dist

        if self._store is None or (self._store_address not in (None, (host, port))):
            try:
                self._store = dist.TCPStore(host, port, is_master=False, timeout=_timeout(self.timeout_s))
            except (RuntimeError, dist.DistStoreError) as error:
                raise GradientExchangeError(f"cannot reach the round's store at {host}:{port}: {error}") from error
            self._store_address = (host, port)
        return self._store

    def group(self, host: str, port: int, group_id: int, rank: int, size: int, lane: int = 0) -> Any:
        """The process group `group_id` of `lane` (rank of size), formed now unless this member holds it already.
        Forming waits until every member joined (bounded by the timeout)."""
        import torch.distributed as dist

        key = (host, port, group_id, rank, size)
        held = self._groups.get(lane)
        if held is not None and held[0] == key:
            self.last_join_s = 0.0
            return held[1]
        self.drop(lane)
        prefix = f"{_KEY}/group{group_id}" + (f"/lane{lane}" if lane else "")
        store = dist.PrefixStore(prefix, self.store(host, port))
        started = time.perf_counter()
        try:
            if self.backend == "nccl":
                group = dist.ProcessGroupNCCL(store, rank, size)
            else:
                group = dist.ProcessGroupGloo(store, rank, size, _timeout(self.timeout_s))
        except (RuntimeError, dist.DistStoreError) as error:
            raise GradientExchangeError(f"group {group_id} (rank {rank} of {size}) did not form: {error}") from error
        self.last_join_s = time.perf_counter() - started
        self.groups_formed += 1
        self._groups[lane] = (key, group)
        return group

    def reduce(self, host: str, port: int, group_id: int, rank: int, size: int, flat: torch.Tensor,
               lane: int = 0) -> ReductionBytes:
        """Form or reuse the group of `lane` and run `reduce_to_core`; on any failure the lane's group is dropped
        (the next round forms a fresh one) and GradientExchangeError raised."""
        group = self.group(host, port, group_id, rank, size, lane)
        try:
            return reduce_to_core(group, rank, size, flat, self.backend)
        except GradientExchangeError:
            self.drop(lane)
            raise

    def publish_held(self, host: str, port: int, round_id: int, rank: int, payload: bytes) -> None:
        """Leave this member's list of the micro-steps in its buffer for the core to read after the round."""
        if len(payload) > MAX_HELD_BYTES:
            raise GradientExchangeError(f"held list of {len(payload)} bytes (max {MAX_HELD_BYTES})")
        try:
            self.store(host, port).set(_held_key(round_id, rank), payload)
        except RuntimeError as error:
            raise GradientExchangeError(f"cannot leave the held list of round {round_id}: {error}") from error

    def read_held(self, round_id: int, rank: int) -> bytes:
        """Core: member `rank`'s held list of `round_id` (waits for it, bounded), removed from the store once read."""
        assert self._store is not None, "only a member with a store reads held lists"
        key = _held_key(round_id, rank)
        try:
            payload = self._store.get(key)
        except RuntimeError as error:
            raise GradientExchangeError(f"held list of rank {rank} in round {round_id} never came: {error}") from error
        self._store.delete_key(key)
        return bytes(payload)

    def drop(self, lane: int | None = None) -> None:
        """Forget the group of `lane` (None: of every lane); its connections close when the last reference goes."""
        if lane is None:
            self._groups.clear()
        else:
            self._groups.pop(lane, None)
