"""The bus lets nothing in from outside the run (Hardening, finding 6): a forged StopTopology pushed to a running
launcher's socket by another process of the same uid has no effect; a socket without the run's keys gets nothing
through, on ipc:// and tcp://; a member of the run that claims another node's actor as sender is dropped; every
refusal is counted in the node's statistics."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import structlog
import zmq

from gyre.messages.ping_pong import Ball, Echo
from gyre.messages.runtime_control import ActorFailed, StopTopology
from gyre.runtime import Actor, Codec, Envelope, Kind, Topology, handler, read_log
from gyre.runtime.envelope import ID_STRIDE
from gyre.runtime.event_log import MAGIC
from gyre.runtime.testing import Harness, run_actors
from gyre.runtime.zmq_transport import BusKeys, ZmqConfig, ZmqTransport, derived_bus_keys, generate_bus_keys

pytestmark = pytest.mark.timeout(180)

assert zmq.has("curve"), "the bus needs a pyzmq built with libsodium (CURVE)"

REPO = Path(__file__).resolve().parents[3]
PING_PONG = REPO / "examples" / "ping_pong.py"
#: A launcher process like `gyre`, minus the other layers' plug-ins (as in test_processes.py).
_LIGHT_GYRE = [
    sys.executable, "-c", "import sys; from gyre.runtime.testing import gyre_cli; sys.exit(gyre_cli(sys.argv[1:]))"
]


@pytest.fixture(autouse=True)
def _keep_logging_config():
    saved = structlog.get_config()
    yield
    structlog.configure(**saved)


def _wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout_s}s for {what}")
        time.sleep(0.05)


def _balls_in(segment: Path) -> int:
    if not segment.exists() or segment.stat().st_size <= len(MAGIC):
        return 0
    return sum(1 for r in read_log(segment) if r.type_name == Ball.__gyre_type__)


def _forged_stop(codec: Codec) -> list[bytes]:
    """What the finding's attacker pushed: a StopTopology to the supervisor, claiming to come from ping."""
    envelope = Envelope(ID_STRIDE + 1, "ping", "supervisor", "", 0.0, 0, 0, Kind.TELL)
    return list(codec.encode(envelope, StopTopology("forged stop", 0)))


def test_a_forged_stop_topology_from_outside_the_run_does_not_end_it(tmp_path) -> None:
    # A short folder: under tmp_path (deep with xdist) the socket paths would not fit, and the launcher would put
    # its run folder in /tmp instead (ipc_socket_folder), out of this test's sight.
    run_tmp = Path(tempfile.mkdtemp(prefix="gyre-t-", dir="/tmp"))
    log = tmp_path / "run.glog"
    stderr_path = tmp_path / "stderr.txt"
    # TMPDIR: the launcher's run folder (and so its sockets) lands where this test can find it, as an attacker
    # listing /tmp would.
    env = dict(os.environ, TMPDIR=str(run_tmp))
    with open(stderr_path, "wb") as stderr:
        launcher = subprocess.Popen(
            [*_LIGHT_GYRE, "run", str(PING_PONG), "--log", str(log), "--", "--rounds", "1000000"],
            stdout=subprocess.DEVNULL, stderr=stderr, cwd=tmp_path, env=env, start_new_session=True,
        )
    try:
        pong_segment = Path(str(log) + ".parts") / "pong.glog"
        _wait_for(lambda: _balls_in(pong_segment) > 0, 120.0, "pong to record its first balls")
        sockets = list(run_tmp.glob("gyre-run-*/launcher.sock"))
        assert len(sockets) == 1, sockets
        assert sockets[0].stat().st_mode & 0o777 == 0o600
        assert sockets[0].parent.stat().st_mode & 0o777 == 0o700
        context = zmq.Context()
        push = context.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 0)
        # Bounded: once the launcher has refused the handshake, the PUSH socket has no peer and a send would block
        # for good; which comes first (the send queued on the new pipe, or the refusal) is the scheduler's choice.
        push.setsockopt(zmq.SNDTIMEO, 5000)
        push.connect(f"ipc://{sockets[0]}")
        try:
            try:
                push.send_multipart(_forged_stop(Codec()))
            except zmq.Again:
                pass  # refused before the send: the forged stop never left this process, as good an outcome
            _wait_for(lambda: "bus_connection_refused" in stderr_path.read_text(), 60.0,
                      "the launcher to refuse the forged connection")
            before = _balls_in(pong_segment)
            _wait_for(lambda: _balls_in(pong_segment) > before or launcher.poll() is not None, 60.0,
                      "pong to go on (or the run to end)")
            assert launcher.poll() is None, stderr_path.read_text()  # the forged stop was not handled
        finally:
            context.destroy(linger=0)
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(timeout=60) == 128 + signal.SIGTERM
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
        shutil.rmtree(run_tmp, ignore_errors=True)
    text = stderr_path.read_text()
    assert "forged stop" not in text
    assert "Traceback" not in text


# ---- the transport: nothing from outside the run, on ipc:// and tcp:// ---------------------------------------------
def _endpoints(scheme: str, folder: Path) -> dict[str, str]:
    if scheme == "ipc":
        return {"a": f"ipc://{folder}/a.sock", "b": f"ipc://{folder}/b.sock"}
    probes = [socket.socket() for _ in range(2)]  # both open at once: two distinct ports
    try:
        for probe in probes:
            probe.bind(("127.0.0.1", 0))
        ports = [probe.getsockname()[1] for probe in probes]
    finally:
        for probe in probes:
            probe.close()
    return {"a": f"tcp://127.0.0.1:{ports[0]}", "b": f"tcp://127.0.0.1:{ports[1]}"}


def _outsider(endpoint: str, keys: tuple[bytes, bytes] | None, server_key: bytes | None) -> zmq.Socket:
    """A PUSH socket of a process outside the run: plain, or with CURVE keys of its own."""
    push = zmq.Context.instance().socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.setsockopt(zmq.SNDTIMEO, 10_000)  # a send that cannot be queued fails (zmq.Again) instead of hanging
    if keys is not None:
        push.setsockopt(zmq.CURVE_SERVERKEY, server_key)
        push.setsockopt(zmq.CURVE_PUBLICKEY, keys[0])
        push.setsockopt(zmq.CURVE_SECRETKEY, keys[1])
    push.connect(endpoint)
    return push


async def _until(predicate, timeout_s: float, what: str) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise TimeoutError(f"waited {timeout_s}s for {what}")
        await asyncio.sleep(0.01)


#: (who is outside, how): a plain socket; a key pair of its own with b's real public key (as if that leaked); a key
#: pair of its own with a guessed server key.
OUTSIDERS = ("no_curve", "key_not_of_this_run", "wrong_server_key")


@pytest.mark.parametrize("scheme", ["ipc", "tcp"])
@pytest.mark.parametrize("outsider", OUTSIDERS)
def test_a_socket_without_the_runs_keys_gets_nothing_through_and_is_counted(tmp_path, scheme, outsider) -> None:
    endpoints = _endpoints(scheme, tmp_path)
    keys = generate_bus_keys(endpoints)
    frames = _forged_stop(Codec())

    async def main() -> tuple[list, list]:
        got: list = []
        refused: list = []
        a = ZmqTransport(endpoints["a"], endpoints, ZmqConfig(), keys["a"])
        b = ZmqTransport(endpoints["b"], endpoints, ZmqConfig(), keys["b"])
        b.start(lambda frames, peer: got.append((frames, peer)), lambda why, endpoint: refused.append(why))
        a.start(lambda frames, peer: None)
        own = zmq.curve_keypair()
        how = {
            "no_curve": (None, None),
            "key_not_of_this_run": (own, keys["b"].public_key),
            "wrong_server_key": (own, zmq.curve_keypair()[0]),
        }[outsider]
        stranger = _outsider(endpoints["b"], *how)
        try:
            try:
                stranger.send_multipart(frames, zmq.NOBLOCK)
            except zmq.Again:  # its connection already refused, nowhere to queue: refused all the same
                pass
            await _until(lambda: refused, 30.0, "the stranger's handshake to be refused")
            a.send_nowait("b", tuple(frames))  # a member's message after the refusal: it arrives, alone
            await _until(lambda: got, 30.0, "the member's frames")
        finally:
            stranger.close()
            a.close()
            b.close()
        return got, refused

    got, refused = asyncio.run(main())
    assert got == [(frames, "a")]  # authenticated as node a; the stranger's copy never arrived
    assert set(refused) == {outsider}


def test_ipc_socket_files_are_owner_only(tmp_path) -> None:
    endpoints = _endpoints("ipc", tmp_path)
    transport = ZmqTransport(endpoints["a"], endpoints, ZmqConfig(), generate_bus_keys(endpoints)["a"])
    try:
        assert (tmp_path / "a.sock").stat().st_mode & 0o777 == 0o600
    finally:
        transport.close()


def test_bus_keys_never_show_their_secret() -> None:
    keys = generate_bus_keys(["a", "b"])
    assert keys["a"].secret_key not in repr(keys["a"]).encode()
    assert keys["a"].public_keys == keys["b"].public_keys
    assert keys["a"].secret_key != keys["b"].secret_key
    assert derived_bus_keys("a", ["a", "b"]) == derived_bus_keys("a", ["b", "a"])  # the run secret decides
    with pytest.raises(ValueError, match="own public key"):
        BusKeys("a", keys["a"].public_key, keys["a"].secret_key, {"b": keys["b"].public_key})
    with pytest.raises(ValueError, match="40-byte"):
        BusKeys("a", b"short", keys["a"].secret_key, {"a": b"short"})


# ---- the node: a member posing as another node's actor is dropped; a stranger's stop changes nothing --------------
class Keeper(Actor):
    """Echoes."""

    @handler(Echo)
    def on_echo(self, msg: Echo) -> Echo:
        return msg


def _topology() -> Topology:
    topology = Topology("bus-security", seed=3)
    topology.add("keeper", Keeper)  # node "keeper"; the supervisor is on node "launcher"
    return topology


def test_a_member_that_claims_another_nodes_actor_as_sender_is_counted_and_dropped() -> None:
    codec = Codec()
    # Node keeper's connection, claiming to be the launcher's client: a stop it must not be able to order.
    forged = codec.encode(Envelope(ID_STRIDE + 7, "~client.launcher", "supervisor", "", 0.0, 0, 0, Kind.TELL),
                          StopTopology("forged by a member", 0))
    honest = codec.encode(Envelope(ID_STRIDE + 8, "keeper", "supervisor", "", 0.0, 0, 0, Kind.TELL),
                          ActorFailed("keeper", "ValueError", "a test", 0, "restarted"))

    async def driver(h: Harness) -> tuple:
        launcher = h.nodes["launcher"]
        keys = derived_bus_keys("keeper", h.nodes)
        member = _outsider(h.endpoint("launcher"), (keys.public_key, keys.secret_key), keys.public_keys["launcher"])
        try:
            member.send_multipart(forged)
            member.send_multipart(honest)  # the same connection keeps order: once this is in, so was the forgery
            await h.wait_until(lambda: len(h.actor("supervisor").failures) == 1, 20.0, "the honest frame")
        finally:
            member.close()
        echo = await h.ask("keeper", Echo(1, b"on"), timeout_s=10.0)
        return launcher.statistics["forged_frames"], launcher.stop_requested.done(), echo

    forged_count, stopped, echo = run_actors(_topology(), driver, transport="zmq").value
    assert (forged_count, stopped, echo) == (1, False, Echo(1, b"on"))


def test_a_strangers_stop_topology_is_refused_and_counted_by_the_node() -> None:
    async def driver(h: Harness) -> tuple:
        launcher = h.nodes["launcher"]
        stranger = _outsider(h.endpoint("launcher"), None, None)
        try:
            stranger.send_multipart(_forged_stop(Codec()))
            await h.wait_until(lambda: launcher.statistics["refused_connections"] >= 1, 20.0, "the refusal")
        finally:
            stranger.close()
        echo = await h.ask("keeper", Echo(2, b"on"), timeout_s=10.0)
        return launcher.stop_requested.done(), launcher.statistics["received"], echo

    stopped, received, echo = run_actors(_topology(), driver, transport="zmq").value
    assert (stopped, echo) == (False, Echo(2, b"on"))
    assert received == 1  # the echo's reply, nothing else
