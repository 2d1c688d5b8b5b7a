"""TransferAgent between two real processes over Mooncake TCP on loopback."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import torch

from gyre.engines.errors import TransferError
from gyre.engines.transfer import TransferAgent, TransferConfig, merge_runs, registers_device_memory

# The peer process: one agent with one registered buffer holding a known pattern. It answers line commands on stdin:
# "get OFFSET N" prints the buffer's bytes as hex, "quit" ends it. Answers start with "@@" (logs share stdout).
PEER = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    from gyre.engines.transfer import TransferAgent
    size = int(sys.argv[1])
    agent = TransferAgent()
    buf = (np.arange(size, dtype=np.uint64) * 2654435761 % 251).astype(np.uint8)
    addr, nbytes = agent.register_tensor(buf)
    print("@@" + json.dumps({"peer": agent.peer, "addr": addr, "nbytes": nbytes}), flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if cmd[0] == "get":
            off, n = int(cmd[1]), int(cmd[2])
            print("@@" + buf[off:off + n].tobytes().hex(), flush=True)
        else:
            break
    agent.close()
    """
)
PEER_BYTES = 1 << 20


def pattern(size: int) -> np.ndarray:
    return (np.arange(size, dtype=np.uint64) * 2654435761 % 251).astype(np.uint8)


class Peer:
    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", PEER, str(PEER_BYTES)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        hello = json.loads(self._answer())
        self.name, self.addr, self.nbytes = hello["peer"], hello["addr"], hello["nbytes"]

    def get(self, offset: int, n: int) -> bytes:
        self.proc.stdin.write(f"get {offset} {n}\n")
        self.proc.stdin.flush()
        return bytes.fromhex(self._answer())

    def _answer(self) -> str:
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError("peer process ended")
            if line.startswith("@@"):
                return line[2:].strip()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.flush()
            self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def peer():
    p = Peer()
    yield p
    p.stop()


@pytest.fixture(scope="module")
def agent():
    # A small batch limit makes the split path run with few entries.
    a = TransferAgent(TransferConfig(max_batch_entries=64))
    yield a
    a.close()


def test_read_whole_buffer(peer, agent):
    local = np.zeros(PEER_BYTES, dtype=np.uint8)
    agent.register_tensor(local)
    try:
        assert agent.pull_tensor(peer.name, peer.addr, local) == PEER_BYTES
        np.testing.assert_array_equal(local, pattern(PEER_BYTES))
    finally:
        agent.unregister_tensor(local)


def test_write_then_read_back(peer, agent):
    # Writes near the end of the peer's buffer; the other tests read its first 200 KiB and expect the pattern.
    at = PEER_BYTES - 8192
    src = torch.arange(1024, dtype=torch.int32)  # 4 KiB
    agent.register_tensor(src)
    try:
        assert agent.push_tensor(peer.name, peer.addr + at, src) == 4096
        assert peer.get(at, 4096) == src.numpy().tobytes()
        # Bytes around the written range are untouched.
        assert peer.get(at - 16, 16) == pattern(PEER_BYTES)[at - 16 : at].tobytes()
        back = torch.zeros(1024, dtype=torch.int32)
        agent.register_tensor(back)
        agent.pull_tensor(peer.name, peer.addr + at, back)
        assert torch.equal(back, src)
        agent.unregister_tensor(back)
    finally:
        agent.unregister_tensor(src)


def test_scattered_batch_over_the_entry_limit(peer, agent):
    # 1000 non-adjacent 64-byte pieces in reverse order: nothing merges, so 1000 entries go out in 16 batches of 64.
    n, piece = 1000, 64
    local = np.zeros(n * piece * 2, dtype=np.uint8)
    agent.register_tensor(local)
    try:
        before = agent.statistics()
        locals_ = [local.ctypes.data + 2 * i * piece for i in range(n)][::-1]
        remotes = [peer.addr + 3 * i * piece for i in range(n)][::-1]
        assert agent.read(peer.name, locals_, remotes, [piece] * n) == n * piece
        want = pattern(PEER_BYTES)
        for i in (0, 1, 517, n - 1):
            got = local[2 * i * piece : (2 * i + 1) * piece]
            np.testing.assert_array_equal(got, want[3 * i * piece : (3 * i + 1) * piece])
        after = agent.statistics()
        assert after.batches - before.batches == 16
        assert after.entries_sent - before.entries_sent == n
    finally:
        agent.unregister_tensor(local)


def test_contiguous_runs_merge_into_one_entry(peer, agent):
    n, piece = 500, 256
    local = np.zeros(n * piece, dtype=np.uint8)
    agent.register_tensor(local)
    try:
        before = agent.statistics()
        order = list(range(n))[::-1]  # given out of order; contiguous once sorted
        agent.read(
            peer.name,
            [local.ctypes.data + i * piece for i in order],
            [peer.addr + 16384 + i * piece for i in order],
            [piece] * n,
        )
        np.testing.assert_array_equal(local, pattern(PEER_BYTES)[16384 : 16384 + n * piece])
        after = agent.statistics()
        assert after.entries_sent - before.entries_sent == 1
        assert after.entries_requested - before.entries_requested == n
    finally:
        agent.unregister_tensor(local)


def test_threads_sharing_an_agent_stay_under_the_peer_queue_limit(peer):
    # Four threads, each with a full 1024-entry batch to the same peer: together they would pass Mooncake's
    # per-peer queue limit (~2048 entries) if their batches were in flight at once.
    import threading

    shared = TransferAgent()
    n, piece = 1024, 16
    buffers = [np.zeros(2 * n * piece, dtype=np.uint8) for _ in range(4)]
    errors: list[BaseException] = []

    def work(buf: np.ndarray) -> None:
        try:
            shared.read(
                peer.name,
                [buf.ctypes.data + 2 * i * piece for i in range(n)],
                [peer.addr + 2 * i * piece for i in range(n)],
                [piece] * n,
            )
        except BaseException as error:  # reported below
            errors.append(error)

    try:
        for buf in buffers:
            shared.register_tensor(buf)
        threads = [threading.Thread(target=work, args=(buf,)) for buf in buffers]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        want = pattern(PEER_BYTES)
        for buf in buffers:
            np.testing.assert_array_equal(buf[: piece], want[:piece])
            last = 2 * (n - 1) * piece
            np.testing.assert_array_equal(buf[last : last + piece], want[last : last + piece])
    finally:
        shared.close()


def test_remote_range_not_registered_raises(peer, agent):
    local = np.zeros(4096, dtype=np.uint8)
    agent.register_tensor(local)
    try:
        with pytest.raises(TransferError, match="do not free or reuse the local") as info:
            agent.read(peer.name, [local.ctypes.data], [peer.addr + PEER_BYTES - 100], [4096])
        assert info.value.unsafe_side == "local"
        assert info.value.unsafe_ranges == ((local.ctypes.data, 4096),)
        assert agent.statistics().failures >= 1
    finally:
        agent.unregister_tensor(local)


def test_unreachable_peer_raises(agent):
    local = np.zeros(4096, dtype=np.uint8)
    agent.register_tensor(local)
    try:
        with pytest.raises(TransferError, match="127.0.0.1:1") as info:
            agent.write("127.0.0.1:1", [local.ctypes.data], [0x10000], [4096])
        assert info.value.unsafe_side == "remote" and info.value.unsafe_ranges == ((0x10000, 4096),)
    finally:
        agent.unregister_tensor(local)


def test_unregistered_local_range_is_refused(peer, agent):
    local = np.zeros(4096, dtype=np.uint8)
    with pytest.raises(TransferError, match="not inside memory registered"):
        agent.read(peer.name, [local.ctypes.data], [peer.addr], [4096])


def test_registration_errors(agent):
    buf = np.zeros(8192, dtype=np.uint8)
    addr, _ = agent.register_tensor(buf)
    try:
        with pytest.raises(TransferError, match="overlaps"):
            agent.register(addr + 4096, 100)
    finally:
        agent.unregister(addr)
    with pytest.raises(TransferError, match="no range registered"):
        agent.unregister(addr)
    with pytest.raises(ValueError, match="contiguous"):
        agent.register_tensor(torch.zeros(4, 4).t())
    with pytest.raises(TypeError):
        agent.register_tensor(b"bytes")


def test_merge_runs_validation():
    assert merge_runs([100, 104, 200], [1000, 1004, 2000], [4, 4, 8]) == ([100, 200], [1000, 2000], [8, 8])
    # Contiguous locally but not remotely: stays two entries.
    assert merge_runs([100, 104], [1000, 1008], [4, 4]) == ([100, 104], [1000, 1008], [4, 4])
    with pytest.raises(ValueError, match="differ in length"):
        merge_runs([1], [1, 2], [1])
    with pytest.raises(ValueError, match="overlaps"):
        merge_runs([100, 102], [1000, 2000], [4, 4])
    with pytest.raises(ValueError, match="positive"):
        merge_runs([100], [1000], [0])
    # One entry takes a path without numpy; it checks the same things.
    assert merge_runs([100], [1000], [4]) == ([100], [1000], [4])
    with pytest.raises(ValueError, match="null address"):
        merge_runs([0], [1000], [4])
    with pytest.raises(ValueError, match="non-negative ints"):
        merge_runs([-8], [1000], [4])
    with pytest.raises(ValueError, match="non-negative ints"):
        merge_runs([1.5], [1000], [4])


def test_closed_agent_refuses_work():
    a = TransferAgent()
    assert a.peer.startswith("127.0.0.1:")
    a.close()
    a.close()
    with pytest.raises(TransferError, match="closed"):
        a.register(0x1000, 10)


def test_config_validation():
    with pytest.raises(ValueError):
        TransferConfig(max_batch_entries=0)
    with pytest.raises(ValueError):
        TransferConfig(protocol="udp")
    with pytest.raises(ValueError, match="device_memory"):
        TransferConfig(device_memory="pinned")
    with pytest.raises(ValueError, match="staging_bytes"):
        TransferConfig(staging_bytes=0)


def test_staged_pulls_and_pushes_go_chunk_by_chunk_through_one_bounded_buffer(peer):
    # What a device tensor takes on a Mooncake build without CUDA, run here on host tensors: device_memory "stage"
    # stages every unregistered target. 4 KiB of staging for a 1 MiB pull: 256 round trips, one buffer registered.
    with TransferAgent(TransferConfig(device_memory="stage", staging_bytes=4096)) as staged:
        assert staged.device_memory == "stage"
        into = torch.zeros(PEER_BYTES // 4, dtype=torch.float32)  # unregistered, and not bytes: viewed as bytes
        assert staged.pull_tensor(peer.name, peer.addr, into) == PEER_BYTES
        kept = PEER_BYTES - 8192  # test_write_then_read_back writes after this
        assert into.numpy().view(np.uint8)[:kept].tobytes() == pattern(PEER_BYTES)[:kept].tobytes()
        stats = staged.statistics()
        assert (stats.bytes_staged, stats.chunks_staged, stats.bytes_read) == (PEER_BYTES, 256, PEER_BYTES)
        assert stats.registered_bytes == 4096 and stats.bytes_device_direct == 0
        # A push of a size that is no multiple of the chunk, into the middle of the peer's buffer, then back.
        at, size = PEER_BYTES - 20_000, 9000
        source = np.arange(size, dtype=np.uint8) ^ 0x5A
        assert staged.push_tensor(peer.name, peer.addr + at, source) == size
        assert peer.get(at, size) == source.tobytes()
        assert peer.get(at - 8, 8) == pattern(PEER_BYTES)[at - 8 : at].tobytes()  # nothing around it moved
        back = np.zeros(size, dtype=np.uint8)
        staged.pull_tensor(peer.name, peer.addr + at, back)
        np.testing.assert_array_equal(back, source)
        peer_restore = pattern(PEER_BYTES)[at : at + size]  # the other tests read the pattern
        staged.push_tensor(peer.name, peer.addr + at, peer_restore.copy())
        assert staged.statistics().chunks_staged == 256 + 3 + 3 + 3
        # A registered target moves in place, not staged.
        local = torch.zeros(1024, dtype=torch.uint8)
        staged.register_tensor(local)
        staged.pull_tensor(peer.name, peer.addr, local)
        assert staged.statistics().bytes_staged == PEER_BYTES + 3 * size


def test_a_failed_staged_transfer_retires_its_staging_buffer():
    from gyre.engines.transfer import MAX_RETIRED_STAGING

    with TransferAgent(TransferConfig(device_memory="stage", staging_bytes=4096)) as staged:
        into = torch.zeros(10_000, dtype=torch.uint8)
        for failures in range(1, MAX_RETIRED_STAGING + 2):
            with pytest.raises(TransferError, match="staged read of 10000 bytes failed at byte 0") as info:
                staged.pull_tensor("127.0.0.1:1", 0x10000, into)
            assert info.value.unsafe_side == "local"
            # Each failed buffer stays registered and alive (Mooncake may still write it); a fresh one serves next.
            assert staged.statistics().registered_bytes == 4096 * failures
        with pytest.raises(TransferError, match="staged transfers stopped"):
            staged.pull_tensor("127.0.0.1:1", 0x10000, into)


def test_an_unregistered_host_target_is_refused_unless_staging_was_asked(peer, agent):
    with pytest.raises(TransferError, match="not inside memory registered"):
        agent.pull_tensor(peer.name, peer.addr, torch.zeros(64, dtype=torch.uint8))


def test_the_build_decides_whether_device_memory_registers():
    from types import SimpleNamespace

    import mooncake.engine

    class CudaEngineBeforeTheFlag:
        def batch_transfer_write_on_cuda(self): ...

    assert registers_device_memory(SimpleNamespace(SUPPORT_CUDA=True, TransferEngine=object))
    assert not registers_device_memory(SimpleNamespace(SUPPORT_CUDA=False, TransferEngine=CudaEngineBeforeTheFlag))
    assert registers_device_memory(SimpleNamespace(TransferEngine=CudaEngineBeforeTheFlag))
    assert not registers_device_memory(SimpleNamespace(TransferEngine=object))
    if registers_device_memory(mooncake.engine):
        pytest.skip("this machine's Mooncake is the CUDA build")
    # The non-CUDA build (every CPU machine's): "auto" stages, "register" is refused at start with the way out.
    with TransferAgent() as auto:
        assert auto.device_memory == "stage" and auto.statistics().device_memory == "stage"
    with pytest.raises(TransferError, match="mooncake-transfer-engine, the CUDA build"):
        TransferAgent(TransferConfig(device_memory="register"))


def test_only_host_and_cuda_tensors_have_a_range():
    from gyre.engines.transfer import buffer_range, pretouch

    with pytest.raises(ValueError, match="host and CUDA memory only"):
        buffer_range(torch.empty(4, device="meta"))
    assert buffer_range(torch.zeros(3, dtype=torch.int64))[1] == 24
    pretouch(np.zeros(3 * 4096 + 5, dtype=np.uint8))


def test_a_digest_is_of_the_bytes_in_memory_whatever_the_dtype():
    import hashlib

    from gyre.engines.transfer import host_sha256

    weights = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    assert host_sha256(weights) == hashlib.sha256(weights.numpy().tobytes()).hexdigest()
    halves = weights.to(torch.bfloat16)  # no numpy dtype: hashed through a byte view
    assert host_sha256(halves) == hashlib.sha256(halves.view(torch.int16).numpy().tobytes()).hexdigest()
    assert host_sha256(weights.numpy()) == host_sha256(weights) != host_sha256(weights * 2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_device_tensor_pulls_and_pushes_registered_or_staged(peer):
    with TransferAgent(TransferConfig(staging_bytes=1 << 16)) as device_agent:
        into = torch.zeros(PEER_BYTES, dtype=torch.uint8, device="cuda")
        if device_agent.device_memory == "register":
            device_agent.register_tensor(into)
        else:
            with pytest.raises(TransferError, match="cannot register a tensor on cuda"):
                device_agent.register_tensor(into)
        assert device_agent.pull_tensor(peer.name, peer.addr, into) == PEER_BYTES
        kept = PEER_BYTES - 8192  # test_write_then_read_back writes after this
        assert into[:kept].cpu().numpy().tobytes() == pattern(PEER_BYTES)[:kept].tobytes()
        stats = device_agent.statistics()
        moved = stats.bytes_device_direct if device_agent.device_memory == "register" else stats.bytes_staged
        assert moved == PEER_BYTES


@given(
    st.lists(
        st.tuples(st.integers(1, 64), st.integers(0, 3), st.integers(0, 3)),  # size, local gap, remote gap
        min_size=1,
        max_size=40,
    ),
    st.randoms(use_true_random=False),
)
@settings(max_examples=200, deadline=None)
def test_merge_runs_preserves_the_byte_mapping(pieces, rnd):
    # Lay the pieces out with random gaps on both sides, shuffle them, and check that the merged entries map
    # exactly the same local bytes to exactly the same remote bytes, with no two mergeable neighbours left.
    local_addrs, remote_addrs, sizes = [], [], []
    local, remote = 4096, 1 << 20
    for size, local_gap, remote_gap in pieces:
        local += local_gap
        remote += remote_gap
        local_addrs.append(local)
        remote_addrs.append(remote)
        sizes.append(size)
        local += size
        remote += size
    order = list(range(len(sizes)))
    rnd.shuffle(order)
    got = merge_runs([local_addrs[i] for i in order], [remote_addrs[i] for i in order], [sizes[i] for i in order])

    def byte_map(ls, rs, ns):
        return {l + k: r + k for l, r, n in zip(ls, rs, ns) for k in range(n)}

    assert byte_map(*got) == byte_map(local_addrs, remote_addrs, sizes)
    ls, rs, ns = got
    assert ls == sorted(ls)
    for i in range(len(ls) - 1):
        assert not (ls[i] + ns[i] == ls[i + 1] and rs[i] + ns[i] == rs[i + 1])
