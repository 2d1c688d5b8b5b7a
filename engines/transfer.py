"""Bulk memory transfer between processes through the Mooncake Transfer Engine.

KV blocks, weights and gradients never travel on the bus: the bus carries a descriptor (peer, address, size) and
the bytes move between registered buffers through Mooncake (TCP on loopback here, RDMA at scale). `TransferAgent`
wraps one `mooncake.engine.TransferEngine` in P2P-handshake mode (no metadata server) and handles the traps that
the raw engine leaves to its caller (see shared/reference/mooncake.md):

- the P2P RPC port is drawn at random, so `initialize` can clash with a port in use: retry with a fresh engine;
- a TCP batch of more than ~2048 entries to one peer fails at once: split batches at `max_batch_entries`;
- many small entries are slow: merge entries that are contiguous on both sides into one;
- a failed transfer (-1) does not mean the bytes stopped moving: `TransferError` says which buffers are in an
  unknown state, so that nobody frees or reuses them silently;
- the first write into fresh memory pays for page faults: `register_tensor` pre-touches every page;
- logging: MC_LOG_LEVEL defaults to ERROR; MC_LOG_DIR makes the library abort the process on import, so it is
  refused with a clear error instead.

Local ranges must lie inside registered memory for both directions. TCP would accept an unregistered local range,
RDMA would not; checking it here keeps one behaviour across protocols and catches stale pointers early.
"""

from __future__ import annotations

import bisect
import mmap
import operator
import os
import threading
import time
from typing import Any, Sequence

import attrs
import numpy as np
import structlog

from gyre.engines.errors import TransferError

log = structlog.get_logger(__name__)

_PAGE_BYTES = mmap.PAGESIZE


@attrs.frozen
class TransferConfig:
    """How a `TransferAgent` reaches its peers."""

    hostname: str = "127.0.0.1"
    """Address peers use to reach this process."""
    protocol: str = "tcp"
    """Mooncake transport: "tcp" (any machine) or "rdma"."""
    metadata_server: str = "P2PHANDSHAKE"
    """"P2PHANDSHAKE" needs no server: peers exchange segment metadata on first contact."""
    device_name: str = ""
    """RDMA devices to use, comma-separated (e.g. "mlx5_0,mlx5_1"; Mooncake's filter); empty: every device the node
    has. Must be empty for TCP."""
    max_batch_entries: int = 1024
    """Entries per batch call; Mooncake's TCP lane queue rejects batches above ~2048 entries to one peer."""
    init_retries: int = 5
    """Attempts at `initialize` (each with a fresh engine) before giving up; a clash on the random port fails one."""
    init_backoff_s: float = 0.05
    """Pause between initialize attempts, doubled after each failure."""

    def __attrs_post_init__(self) -> None:
        if self.max_batch_entries < 1:
            raise ValueError(f"max_batch_entries must be >= 1, got {self.max_batch_entries}")
        if self.init_retries < 1:
            raise ValueError(f"init_retries must be >= 1, got {self.init_retries}")
        if self.protocol not in ("tcp", "rdma"):
            raise ValueError(f"protocol must be 'tcp' or 'rdma', got {self.protocol!r}")
        if self.device_name and self.protocol != "rdma":
            raise ValueError(f"device_name {self.device_name!r} is for protocol 'rdma', not {self.protocol!r}")


#: Where the kernel lists RDMA devices (one entry per device: mlx5_0, ...), as `ibv_devices` reads them.
RDMA_DEVICES_DIR = "/sys/class/infiniband"


def rdma_devices(root: str = RDMA_DEVICES_DIR) -> tuple[str, ...]:
    """The RDMA devices of this node (sorted names); () where it has none."""
    try:
        return tuple(sorted(entry.name for entry in os.scandir(root)))
    except OSError:  # no such folder: no RDMA stack, no device
        return ()


def check_rdma(config: TransferConfig, root: str = RDMA_DEVICES_DIR) -> None:
    """For protocol "rdma": the node must have an RDMA device, and every one `device_name` names; TransferError
    saying what is missing otherwise (Mooncake itself fails later, with a log line but no reason for the caller)."""
    if config.protocol != "rdma":
        return
    found = rdma_devices(root)
    if not found:
        raise TransferError(
            f"transfer protocol 'rdma' asked, but this node has no RDMA device ({root} lists none): use protocol "
            f"'tcp' here, or run where an RDMA NIC and its driver are present"
        )
    missing = [name for name in config.device_name.split(",") if name.strip() and name.strip() not in found]
    if missing:
        raise TransferError(f"RDMA devices {missing} not on this node; it has {list(found)}")


@attrs.frozen
class TransferStatistics:
    """Counters of one agent since it started (trio-style `statistics()` record)."""

    bytes_read: int
    bytes_written: int
    entries_requested: int
    """Entries callers asked for, before merging."""
    entries_sent: int
    """Entries handed to Mooncake, after merging contiguous runs."""
    batches: int
    failures: int
    registered_bytes: int


@attrs.frozen
class _Range:
    addr: int
    nbytes: int
    owner: Any
    """The object that owns the memory (a tensor or array), held so it cannot be freed while registered."""


def _import_engine() -> Any:
    if os.environ.get("MC_LOG_DIR"):
        raise TransferError(
            "MC_LOG_DIR is set: Mooncake initialises glog twice when it is and aborts the process on import; "
            "unset MC_LOG_DIR (Mooncake logs to stderr at MC_LOG_LEVEL)"
        )
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    try:
        from mooncake.engine import TransferEngine
    except ImportError as error:  # the CUDA wheel on a machine without libcuda lands here
        raise TransferError(
            f"cannot import mooncake.engine ({error}); on a machine without CUDA install "
            "mooncake-transfer-engine-non-cuda and the system libraries libibverbs1 and libnuma1"
        ) from error
    return TransferEngine


def merge_runs(
    local_addrs: Sequence[int], remote_addrs: Sequence[int], sizes: Sequence[int]
) -> tuple[list[int], list[int], list[int]]:
    """Sort entries by local address and merge those contiguous on both sides into one entry.

    KV blocks of consecutive ids, or the layers of one block in a [layer, kind, block] pool, often sit next to each
    other on both sides; one entry per run costs far less than one per block (Mooncake's TCP transport pays tens of
    microseconds per entry). Vectorised: a KV move can hand in tens of thousands of entries.
    """
    if not (len(local_addrs) == len(remote_addrs) == len(sizes)):
        raise ValueError(
            "local_addrs, remote_addrs and sizes differ in length: "
            f"{len(local_addrs)}, {len(remote_addrs)}, {len(sizes)}"
        )
    if len(sizes) == 0:
        return [], [], []
    if len(sizes) == 1:  # a staged KV move or a tensor pull: skip numpy's fixed cost (~40 us), check the same way
        try:
            entry = tuple(operator.index(v) for v in (local_addrs[0], remote_addrs[0], sizes[0]))
        except TypeError:
            entry = ()
        if len(entry) != 3 or not all(0 <= v < 2**63 for v in entry):
            raise ValueError("addresses and sizes must be non-negative ints below 2**63: "
                             f"{local_addrs[0]!r}, {remote_addrs[0]!r}, {sizes[0]!r}")
        if entry[2] <= 0:
            raise ValueError(f"entry 0 has size {entry[2]}; sizes must be positive")
        if entry[0] == 0 or entry[1] == 0:
            raise ValueError(f"entry 0 has a null address (local {entry[0]:#x}, remote {entry[1]:#x})")
        return [entry[0]], [entry[1]], [entry[2]]
    try:
        local = np.asarray(local_addrs, dtype=np.int64)
        remote = np.asarray(remote_addrs, dtype=np.int64)
        size = np.asarray(sizes, dtype=np.int64)
    except (OverflowError, TypeError, ValueError) as error:
        raise ValueError(f"addresses and sizes must be non-negative ints below 2**63: {error}") from None
    if local.ndim != 1 or remote.ndim != 1 or size.ndim != 1:
        raise ValueError("addresses and sizes must be flat sequences of ints")
    bad = np.flatnonzero(size <= 0)
    if bad.size:
        raise ValueError(f"entry {int(bad[0])} has size {int(size[bad[0]])}; sizes must be positive")
    bad = np.flatnonzero((local <= 0) | (remote <= 0))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"entry {i} has a null address (local {int(local[i]):#x}, remote {int(remote[i]):#x})")
    order = np.argsort(local, kind="stable")
    local, remote, size = local[order], remote[order], size[order]
    overlap = np.flatnonzero(local[1:] < local[:-1] + size[:-1])
    if overlap.size:
        i = int(overlap[0]) + 1
        raise ValueError(f"entry {int(order[i])} overlaps another local range at {int(local[i]):#x}")
    joins = (local[1:] == local[:-1] + size[:-1]) & (remote[1:] == remote[:-1] + size[:-1])
    starts = np.concatenate(([0], np.flatnonzero(~joins) + 1))
    merged = np.add.reduceat(size, starts)
    return local[starts].tolist(), remote[starts].tolist(), merged.tolist()


class TransferAgent:
    """One Mooncake endpoint of this process: registers memory and moves bytes to and from peers.

    `peer` is the name other agents use to reach this one ("127.0.0.1:PORT"). Calls block (Mooncake spins a core
    while it waits and releases the GIL); call them from a worker thread when on an event loop.
    """

    def __init__(self, config: TransferConfig = TransferConfig()) -> None:
        self.config = config
        check_rdma(config)
        engine_cls = _import_engine()
        self._lock = threading.Lock()  # guards the registry and counters
        self._batch_lock = threading.Lock()  # serialises batch calls into Mooncake
        self._starts: list[int] = []  # sorted registered start addresses
        self._ranges: dict[int, _Range] = {}
        self._closed = False
        self._counters = dict(
            bytes_read=0, bytes_written=0, entries_requested=0, entries_sent=0, batches=0, failures=0
        )
        backoff_s = config.init_backoff_s
        for attempt in range(1, config.init_retries + 1):
            engine = engine_cls()
            rc = engine.initialize(config.hostname, config.metadata_server, config.protocol, config.device_name)
            if rc == 0:
                self._engine = engine
                break
            log.warning("mooncake_initialize_failed_retrying", attempt=attempt, rc=rc)
            del engine
            if attempt < config.init_retries:
                time.sleep(backoff_s)
                backoff_s *= 2
        else:
            raise TransferError(
                f"Mooncake initialize({config.hostname!r}, {config.metadata_server!r}, {config.protocol!r}) failed "
                f"{config.init_retries} times (a clash on the random P2P port, or the protocol is unavailable)"
            )
        self.peer = f"{config.hostname}:{self._engine.get_rpc_port()}"
        log.debug("transfer_agent_ready", peer=self.peer)

    # ---- registration -------------------------------------------------------------------------------------

    def register(self, addr: int, nbytes: int, owner: Any = None) -> None:
        """Make [addr, addr+nbytes) reachable by peers and usable as a local range. `owner` is kept alive."""
        self._check_open()
        if addr <= 0 or nbytes <= 0:
            raise ValueError(f"cannot register addr={addr:#x} nbytes={nbytes}")
        with self._lock:
            if self._find(addr, nbytes, any_overlap=True) is not None:
                raise TransferError(f"range {addr:#x}+{nbytes} overlaps memory already registered with {self.peer}")
            rc = self._engine.register_memory(addr, nbytes)
            if rc != 0:
                raise TransferError(f"Mooncake register_memory({addr:#x}, {nbytes}) returned {rc}")
            bisect.insort(self._starts, addr)
            self._ranges[addr] = _Range(addr, nbytes, owner)

    def unregister(self, addr: int) -> None:
        """Forget a range registered at exactly `addr`. Peers' transfers into it fail from now on."""
        self._check_open()
        with self._lock:
            if addr not in self._ranges:
                raise TransferError(f"no range registered at {addr:#x} with {self.peer}")
            rc = self._engine.unregister_memory(addr)
            del self._ranges[addr]
            self._starts.remove(addr)
        if rc != 0:
            raise TransferError(f"Mooncake unregister_memory({addr:#x}) returned {rc}")

    def register_tensor(self, buffer: Any) -> tuple[int, int]:
        """Register a contiguous CPU torch tensor or numpy array; returns (addr, nbytes).

        Every page is touched first (each page's first byte written with its own value, so contents stay): the first
        transfer into fresh memory otherwise pays for page faults inside Mooncake's copy (1.6 s for a fresh 256 MiB
        np.zeros in our measurements).
        """
        addr, nbytes = buffer_range(buffer)
        pretouch(buffer)
        self.register(addr, nbytes, owner=buffer)
        return addr, nbytes

    def unregister_tensor(self, buffer: Any) -> None:
        self.unregister(buffer_range(buffer)[0])

    # ---- transfers ----------------------------------------------------------------------------------------

    def read(self, peer: str, local_addrs: Sequence[int], remote_addrs: Sequence[int], sizes: Sequence[int]) -> int:
        """Copy the peer's remote ranges into our local ranges; returns bytes moved. Raises TransferError."""
        return self._transfer("read", peer, local_addrs, remote_addrs, sizes)

    def write(self, peer: str, local_addrs: Sequence[int], remote_addrs: Sequence[int], sizes: Sequence[int]) -> int:
        """Copy our local ranges into the peer's remote ranges; returns bytes moved. Raises TransferError."""
        return self._transfer("write", peer, local_addrs, remote_addrs, sizes)

    def pull_tensor(self, peer: str, remote_addr: int, into: Any) -> int:
        """Fill the registered tensor/array `into` with the peer's bytes starting at remote_addr."""
        addr, nbytes = buffer_range(into)
        return self.read(peer, [addr], [remote_addr], [nbytes])

    def push_tensor(self, peer: str, remote_addr: int, source: Any) -> int:
        """Write the registered tensor/array `source` into the peer's memory at remote_addr."""
        addr, nbytes = buffer_range(source)
        return self.write(peer, [addr], [remote_addr], [nbytes])

    def statistics(self) -> TransferStatistics:
        with self._lock:
            registered = sum(r.nbytes for r in self._ranges.values())
            return TransferStatistics(registered_bytes=registered, **self._counters)

    def close(self) -> None:
        """Unregister everything and drop the engine (its threads and ports go with it). Idempotent."""
        if self._closed:
            return
        with self._lock:
            for addr in list(self._ranges):
                self._engine.unregister_memory(addr)
            self._ranges.clear()
            self._starts.clear()
            self._closed = True
            del self._engine

    def __enter__(self) -> TransferAgent:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- internals ----------------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise TransferError("transfer agent is closed")

    def _find(self, addr: int, nbytes: int, any_overlap: bool = False) -> _Range | None:
        """The registered range that contains [addr, addr+nbytes) (or, with any_overlap, that touches it)."""
        i = bisect.bisect_right(self._starts, addr + nbytes - 1 if any_overlap else addr) - 1
        if i < 0:
            return None
        found = self._ranges[self._starts[i]]
        if any_overlap:
            return found if found.addr + found.nbytes > addr else None
        return found if addr + nbytes <= found.addr + found.nbytes else None

    def _check_registered(self, op: str, local: list[int], sizes: list[int]) -> None:
        """Every local range must lie inside one registered range (vectorised: one searchsorted per call)."""
        if len(local) == 1:
            with self._lock:
                inside = self._find(local[0], sizes[0]) is not None
            if not inside:
                raise TransferError(
                    f"{op}: local range {local[0]:#x}+{sizes[0]} is not inside memory registered with {self.peer}"
                )
            return
        with self._lock:
            starts = np.asarray(self._starts, dtype=np.int64)
            ends = np.asarray([self._ranges[a].addr + self._ranges[a].nbytes for a in self._starts], dtype=np.int64)
        addrs = np.asarray(local, dtype=np.int64)
        if starts.size == 0:
            inside = np.zeros(addrs.size, dtype=bool)
        else:
            index = np.searchsorted(starts, addrs, side="right") - 1
            ends_of = ends[np.maximum(index, 0)]
            inside = (index >= 0) & (addrs + np.asarray(sizes, dtype=np.int64) <= ends_of)
        bad = np.flatnonzero(~inside)
        if bad.size:
            i = int(bad[0])
            raise TransferError(
                f"{op}: local range {local[i]:#x}+{sizes[i]} is not inside memory registered with {self.peer}"
            )

    def _transfer(
        self, op: str, peer: str, local_addrs: Sequence[int], remote_addrs: Sequence[int], sizes: Sequence[int]
    ) -> int:
        self._check_open()
        if not isinstance(peer, str) or ":" not in peer:
            raise ValueError(f"peer must be 'host:port', got {peer!r}")
        local, remote, merged = merge_runs(local_addrs, remote_addrs, sizes)
        if not merged:
            return 0
        self._check_registered(op, local, merged)
        call = self._engine.batch_transfer_sync_read if op == "read" else self._engine.batch_transfer_sync_write
        step = self.config.max_batch_entries
        done_bytes = 0
        batches = 0
        for start in range(0, len(merged), step):
            end = start + step
            batch_sizes = merged[start:end]
            # One batch in flight per agent: two threads' batches together could pass Mooncake's per-peer queue
            # limit (~2048 entries) and fail at once; sync calls spin a core each, so overlap would gain little.
            with self._batch_lock:
                rc = call(peer, local[start:end], remote[start:end], batch_sizes)
            batches += 1
            if rc != 0:
                with self._lock:
                    self._counters["failures"] += 1
                    self._counters["batches"] += batches
                # Which side may still be written depends on the direction: a read lands in our memory, a write in
                # the peer's. Mooncake gives no way to wait for stragglers of a failed batch.
                side = "local" if op == "read" else "remote"
                addrs = (local if op == "read" else remote)[start:end]
                raise TransferError(
                    f"Mooncake batch {op} with {peer} failed (rc={rc}) on batch {batches} "
                    f"(entries {start}..{min(end, len(merged)) - 1} of {len(merged)} after merging, "
                    f"{sum(batch_sizes)} bytes; {done_bytes} bytes done before it). Causes: peer unreachable or "
                    f"gone, remote range not registered there, or its queue full. The transport may still be "
                    f"moving bytes of this batch: do not free or reuse the {side} ranges of this batch "
                    f"({len(addrs)} ranges from {addrs[0]:#x}, see .unsafe_ranges); treat their contents as unknown.",
                    unsafe_side=side,
                    unsafe_ranges=tuple(zip(addrs, batch_sizes)),
                )
            done_bytes += sum(batch_sizes)
        with self._lock:
            self._counters["bytes_read" if op == "read" else "bytes_written"] += done_bytes
            self._counters["entries_requested"] += len(sizes)
            self._counters["entries_sent"] += len(merged)
            self._counters["batches"] += batches
        return done_bytes


def buffer_range(buffer: Any) -> tuple[int, int]:
    """(address, nbytes) of a contiguous CPU torch tensor or numpy array; a clear error for anything else."""
    if isinstance(buffer, np.ndarray):
        if not buffer.flags.c_contiguous:
            raise ValueError("numpy array must be C-contiguous to be transferred")
        if buffer.nbytes == 0:
            raise ValueError("cannot transfer an empty array")
        return int(buffer.ctypes.data), int(buffer.nbytes)
    if hasattr(buffer, "data_ptr") and hasattr(buffer, "element_size"):
        if buffer.device.type != "cpu":
            raise ValueError(f"tensor is on {buffer.device}; this wrapper moves CPU memory only")
        if not buffer.is_contiguous():
            raise ValueError("tensor must be contiguous to be transferred")
        nbytes = buffer.numel() * buffer.element_size()
        if nbytes == 0:
            raise ValueError("cannot transfer an empty tensor")
        return int(buffer.data_ptr()), int(nbytes)
    raise TypeError(f"expected a torch.Tensor or numpy.ndarray, got {type(buffer).__name__}")


def pretouch(buffer: Any) -> None:
    """Fault in every page of the buffer for writing without changing its contents."""
    addr, nbytes = buffer_range(buffer)
    if isinstance(buffer, np.ndarray):
        flat = buffer.reshape(-1).view(np.uint8)
    else:
        import torch

        with torch.no_grad():
            flat = buffer.detach().reshape(-1).view(torch.uint8).numpy()
    first = (-addr) % _PAGE_BYTES  # first byte of the second page; byte 0 covers the first page
    flat[0] = flat[0]
    flat[first::_PAGE_BYTES] = flat[first::_PAGE_BYTES]
    flat[nbytes - 1] = flat[nbytes - 1]
