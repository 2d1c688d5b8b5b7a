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

Device (CUDA) memory. Mooncake's CUDA build registers device buffers as they are: `register_memory` with its
wildcard location asks `cudaPointerGetAttributes` and files the range under "cuda:N" (mooncake-transfer-engine/src/
memory_location.cpp), its RDMA transport registers it for GPUDirect, and its TCP transport copies device ranges with
cudaMemcpy (tcp_transport_session_impl.h). The non-CUDA build (`mooncake-transfer-engine-non-cuda`, the one CPU
machines install) cannot touch device memory at all. `TransferConfig.device_memory` chooses: "auto" registers device
tensors where the installed build says it can (`mooncake.engine.SUPPORT_CUDA`, or the `*_on_cuda` methods of builds
before that flag) and stages them otherwise; a staged pull or push goes chunk by chunk through one registered host
buffer of `staging_bytes` (pinned where CUDA is present), so the host memory it costs is bounded whatever the
tensor's size. The choice is logged once per agent and counted (`TransferStatistics.device_memory`, `bytes_staged`,
`chunks_staged`, `bytes_device_direct`). A staged device tensor is not registered, so peers cannot read it: whoever
serves device memory to peers without a CUDA build serves a host copy (actors/cells/train_role.py's core does).
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
DEVICE_MEMORY = ("auto", "register", "stage")
"""TransferConfig.device_memory's choices (see the module doc)."""
MAX_RETIRED_STAGING = 4
"""Staging buffers an agent sets aside after failed transfers before it stops staging (each stays allocated)."""


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
    device_memory: str = "auto"
    """How device (CUDA) tensors move: "register" registers them with Mooncake (its CUDA build only; an agent asked
    for it on another build fails at start), "stage" copies them through the host staging buffer (and then any pull
    or push target outside registered memory, device or host, is staged), "auto" registers where the build can
    and stages otherwise."""
    staging_bytes: int = 64 << 20
    """Size of the one host buffer staged transfers go through, chunk by chunk (allocated at the first one). 64 MiB:
    a chunk's Mooncake round trip and host-device copy stay small next to its bytes, and the memory stays small
    next to a model."""

    def __attrs_post_init__(self) -> None:
        if self.max_batch_entries < 1:
            raise ValueError(f"max_batch_entries must be >= 1, got {self.max_batch_entries}")
        if self.init_retries < 1:
            raise ValueError(f"init_retries must be >= 1, got {self.init_retries}")
        if self.protocol not in ("tcp", "rdma"):
            raise ValueError(f"protocol must be 'tcp' or 'rdma', got {self.protocol!r}")
        if self.device_name and self.protocol != "rdma":
            raise ValueError(f"device_name {self.device_name!r} is for protocol 'rdma', not {self.protocol!r}")
        if self.device_memory not in DEVICE_MEMORY:
            raise ValueError(f"device_memory must be one of {DEVICE_MEMORY}, got {self.device_memory!r}")
        if self.staging_bytes < 1:
            raise ValueError(f"staging_bytes must be >= 1, got {self.staging_bytes}")


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
    device_memory: str
    """How this agent moves device tensors: "register" (Mooncake reads and writes them in place) or "stage"."""
    bytes_staged: int
    """Bytes of pulls and pushes that went through the host staging buffer."""
    chunks_staged: int
    """Staging-buffer round trips those took (each one Mooncake transfer and one copy)."""
    bytes_device_direct: int
    """Bytes Mooncake moved straight into or out of registered device memory."""


@attrs.frozen
class _Range:
    addr: int
    nbytes: int
    owner: Any
    """The object that owns the memory (a tensor or array), held so it cannot be freed while registered."""


def registers_device_memory(engine_module: Any) -> bool:
    """Whether this Mooncake build registers device (CUDA) memory: its `SUPPORT_CUDA` flag, or, in builds from before
    the flag (Mooncake PR #2342), the `*_on_cuda` methods that only its CUDA build compiles."""
    flag = getattr(engine_module, "SUPPORT_CUDA", None)
    if flag is not None:
        return bool(flag)
    return hasattr(getattr(engine_module, "TransferEngine", None), "batch_transfer_write_on_cuda")


def _import_engine() -> Any:
    if os.environ.get("MC_LOG_DIR"):
        raise TransferError(
            "MC_LOG_DIR is set: Mooncake initialises glog twice when it is and aborts the process on import; "
            "unset MC_LOG_DIR (Mooncake logs to stderr at MC_LOG_LEVEL)"
        )
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    try:
        from mooncake import engine
    except ImportError as error:  # the CUDA wheel on a machine without libcuda lands here
        raise TransferError(
            f"cannot import mooncake.engine ({error}); on a machine without CUDA install "
            "mooncake-transfer-engine-non-cuda and the system libraries libibverbs1 and libnuma1"
        ) from error
    return engine


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
        module = _import_engine()
        engine_cls = module.TransferEngine
        can_register = registers_device_memory(module)
        if config.device_memory == "register" and not can_register:
            raise TransferError(
                "device_memory='register' asked, but this Mooncake build cannot register device memory (a "
                "non-CUDA build: mooncake.engine.SUPPORT_CUDA is false); install mooncake-transfer-engine, the "
                "CUDA build, or use device_memory='auto' or 'stage' (device tensors then move through host memory)")
        self.device_memory = "register" if config.device_memory != "stage" and can_register else "stage"
        """"register": Mooncake moves device tensors in place; "stage": through the host staging buffer."""
        self._lock = threading.Lock()  # guards the registry and counters
        self._batch_lock = threading.Lock()  # serialises batch calls into Mooncake
        self._staging_lock = threading.Lock()  # one staged transfer at a time: they share the staging buffer
        self._staging: Any = None  # the registered host staging buffer (a uint8 tensor), made at first use
        self._retired: list[Any] = []  # staging buffers of failed transfers: registered, alive, never reused
        self._staging_failed = False
        self._starts: list[int] = []  # sorted registered start addresses
        self._ranges: dict[int, _Range] = {}
        self._closed = False
        self._counters = dict(
            bytes_read=0, bytes_written=0, entries_requested=0, entries_sent=0, batches=0, failures=0,
            bytes_staged=0, chunks_staged=0, bytes_device_direct=0,
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
        log.info("transfer_agent_ready", peer=self.peer, device_memory=self.device_memory,
                 build_registers_device_memory=can_register, staging_bytes=config.staging_bytes)

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
        """Register a contiguous torch tensor (host or, with device_memory "register", CUDA) or numpy array; returns
        (addr, nbytes). A device tensor on an agent that stages raises TransferError: pull and push into it without
        registering it (they stage), and serve peers from a host copy.

        Every host page is touched first (each page's first byte written with its own value, so contents stay): the
        first transfer into fresh memory otherwise pays for page faults inside Mooncake's copy (1.6 s for a fresh
        256 MiB np.zeros in our measurements).
        """
        addr, nbytes = buffer_range(buffer)
        if is_device_buffer(buffer):
            if not self.can_register(buffer):
                raise TransferError(
                    f"cannot register a tensor on {buffer.device}: this agent stages device memory (device_memory "
                    f"{self.config.device_memory!r}, Mooncake build without CUDA support). Pulls and pushes into it "
                    "work unregistered (staged through host memory); to let peers read it, register a host copy")
        else:
            pretouch(buffer)
        self.register(addr, nbytes, owner=buffer)
        return addr, nbytes

    def can_register(self, buffer: Any) -> bool:
        """Whether `register_tensor(buffer)` can register it: host memory always, device memory where this agent
        registers it (device_memory "register")."""
        return not is_device_buffer(buffer) or self.device_memory == "register"

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
        """Fill the tensor/array `into` with the peer's bytes starting at remote_addr: in place where `into` lies in
        registered memory, else (a device tensor on an agent that stages, or any tensor with device_memory "stage")
        through the host staging buffer."""
        return self._tensor_transfer("read", peer, remote_addr, into)

    def push_tensor(self, peer: str, remote_addr: int, source: Any) -> int:
        """Write the tensor/array `source` into the peer's memory at remote_addr (in place or staged, as
        `pull_tensor`)."""
        return self._tensor_transfer("write", peer, remote_addr, source)

    def statistics(self) -> TransferStatistics:
        with self._lock:
            registered = sum(r.nbytes for r in self._ranges.values())
            return TransferStatistics(registered_bytes=registered, device_memory=self.device_memory,
                                      **self._counters)

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
            self._staging = None
            self._retired.clear()
            del self._engine

    def __enter__(self) -> TransferAgent:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- internals ----------------------------------------------------------------------------------------

    def _tensor_transfer(self, op: str, peer: str, remote_addr: int, tensor: Any) -> int:
        addr, nbytes = buffer_range(tensor)
        device = is_device_buffer(tensor)
        with self._lock:
            registered = self._find(addr, nbytes) is not None
        # An unregistered host target is a caller's slip in "auto" and "register" (refused below, as `read` does);
        # "stage" asked for staging, and a device target the build cannot register has no other way.
        if not registered and (device or self.config.device_memory == "stage"):
            return self._staged(op, peer, remote_addr, tensor, nbytes)
        moved = self._transfer(op, peer, [addr], [remote_addr], [nbytes])
        if device:
            with self._lock:
                self._counters["bytes_device_direct"] += moved
        return moved

    def _staging_buffer(self) -> Any:
        """The registered host staging buffer (uint8, `staging_bytes`), made at first use; pinned where CUDA is
        present so that host-device copies run at full speed."""
        import torch

        if self._staging_failed:
            raise TransferError(f"staged transfers stopped: {len(self._retired)} failed, each leaving a staging "
                                "buffer that Mooncake may still write; start a new agent")
        if self._staging is None:
            pin = torch.cuda.is_available()
            staging = torch.empty(self.config.staging_bytes, dtype=torch.uint8, pin_memory=pin)
            self.register_tensor(staging)
            self._staging = staging
            log.info("transfer_staging_ready", peer=self.peer, staging_bytes=self.config.staging_bytes, pinned=pin)
        return self._staging

    def _retire_staging(self) -> None:
        """Set the staging buffer aside after a failed transfer (at most MAX_RETIRED_STAGING; then staging stops)."""
        if len(self._retired) >= MAX_RETIRED_STAGING:
            self._staging_failed = True
        self._retired.append(self._staging)
        self._staging = None

    def _staged(self, op: str, peer: str, remote_addr: int, tensor: Any, nbytes: int) -> int:
        """A pull or push of `tensor` through the staging buffer, one chunk of at most `staging_bytes` at a time (a
        chunk's host-device copy waits for its transfer: the buffer is one, so memory stays bounded)."""
        import torch

        self._check_open()
        if isinstance(tensor, np.ndarray):
            flat = torch.from_numpy(tensor.reshape(-1).view(np.uint8))
        else:
            flat = tensor.detach().reshape(-1).view(torch.uint8)
        with self._staging_lock:
            staging = self._staging_buffer()
            staging_addr = int(staging.data_ptr())
            chunks = start = 0
            try:
                for start in range(0, nbytes, staging.numel()):
                    size = min(staging.numel(), nbytes - start)
                    if op == "read":
                        self._transfer("read", peer, [staging_addr], [remote_addr + start], [size])
                        flat[start : start + size].copy_(staging[:size])
                    else:
                        staging[:size].copy_(flat[start : start + size])
                        self._transfer("write", peer, [staging_addr], [remote_addr + start], [size])
                    chunks += 1
            except TransferError as error:
                # The transport may still write into the staging buffer (a read's stragglers): it is never used
                # again, only kept registered and alive; the next staged transfer makes a fresh one.
                self._retire_staging()
                target = "this tensor" if op == "read" else "the peer's range"
                raise TransferError(
                    f"staged {op} of {nbytes} bytes failed at byte {start}: {error} ({target} from byte {start} on "
                    "is in an unknown state; the staging buffer is retired)",
                    unsafe_side=error.unsafe_side, unsafe_ranges=error.unsafe_ranges,
                ) from None
        with self._lock:
            self._counters["bytes_staged"] += nbytes
            self._counters["chunks_staged"] += chunks
        return nbytes

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


def is_device_buffer(buffer: Any) -> bool:
    """Whether `buffer` is a torch tensor in device (CUDA) memory."""
    device = getattr(buffer, "device", None)
    return getattr(device, "type", "cpu") != "cpu" and not isinstance(buffer, np.ndarray)


def buffer_range(buffer: Any) -> tuple[int, int]:
    """(address, nbytes) of a contiguous torch tensor (host or CUDA) or numpy array; a clear error for anything
    else."""
    if isinstance(buffer, np.ndarray):
        if not buffer.flags.c_contiguous:
            raise ValueError("numpy array must be C-contiguous to be transferred")
        if buffer.nbytes == 0:
            raise ValueError("cannot transfer an empty array")
        return int(buffer.ctypes.data), int(buffer.nbytes)
    if hasattr(buffer, "data_ptr") and hasattr(buffer, "element_size"):
        if buffer.device.type not in ("cpu", "cuda"):
            raise ValueError(f"tensor is on {buffer.device}; this wrapper moves host and CUDA memory only")
        if not buffer.is_contiguous():
            raise ValueError("tensor must be contiguous to be transferred")
        nbytes = buffer.numel() * buffer.element_size()
        if nbytes == 0:
            raise ValueError("cannot transfer an empty tensor")
        return int(buffer.data_ptr()), int(nbytes)
    raise TypeError(f"expected a torch.Tensor or numpy.ndarray, got {type(buffer).__name__}")


HASH_CHUNK_BYTES = 64 << 20
"""A device tensor is hashed in host copies of at most this many bytes (host memory stays bounded)."""


def host_sha256(buffer: Any) -> str:
    """Hex SHA-256 of a contiguous tensor's or array's bytes, as they lie in memory. hashlib reads host memory only,
    so a device tensor comes over in chunks of HASH_CHUNK_BYTES; a host one is hashed in place (no copy)."""
    import hashlib

    import torch

    digest = hashlib.sha256()
    if isinstance(buffer, np.ndarray):
        digest.update(np.ascontiguousarray(buffer).reshape(-1).view(np.uint8))
        return digest.hexdigest()
    flat = buffer.detach().contiguous().reshape(-1).view(torch.uint8)
    if not is_device_buffer(buffer):
        digest.update(flat.numpy())
        return digest.hexdigest()
    for start in range(0, flat.numel(), HASH_CHUNK_BYTES):
        digest.update(flat[start : start + HASH_CHUNK_BYTES].cpu().numpy())
    return digest.hexdigest()


def pretouch(buffer: Any) -> None:
    """Fault in every page of the host buffer for writing without changing its contents."""
    if is_device_buffer(buffer):
        raise ValueError(f"pretouch faults in host pages; this tensor is on {buffer.device}")
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
