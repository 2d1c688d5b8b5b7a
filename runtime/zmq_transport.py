"""ZeroMQ transport: one PULL socket bound per node, one PUSH socket per peer node, frames = (header, body).

Sends never block: a full peer queue (the PUSH high-water mark) raises Backpressure to the sender. The reader is
the event loop's reader callback on the PULL socket's file descriptor (no polling thread, no reader task): it takes
the frames that are there and hands each set to the node, up to `drain_batch` per turn of the loop. When the node
answers that a mailbox is full (it returns an awaitable), reading stops until that message is in, so a slow actor
makes ZeroMQ's queues fill and its senders feel it, and nothing is dropped or reordered.

The hot path uses plain-int flags and socket options: pyzmq's enum wrappers cost several microseconds per call,
which adds up at tens of thousands of messages a second.

Keeping processes outside the run out (Hardening, finding 6: a forged StopTopology pushed by another process of the
same uid used to end a run). Every socket of the bus speaks ZeroMQ CURVE, on tcp:// always and on ipc:// too unless
`ZmqConfig.curve_on_ipc` is off (the benchmark's plain baseline): a node's PULL socket is a CURVE server, each PUSH
socket a CURVE client that must know the server's public key, and a ZAP handler (`_ZapHandler`, one thread per
ZeroMQ context) lets a client in only if its public key is one of the run's, and names the connection after the
node that key belongs to. The keys come from the launcher, one fresh pair per process (`generate_bus_keys`), handed
to each child through the spawn pipe with its run secret, never through the environment, argv, configs or logs; a
transport given no keys derives them from the run secret (`derived_bus_keys`: processes of one run that share only
the secret, and the in-process test harness). Each message's first frame then carries the connection's node name
("User-Id"), which the node checks against the envelope's self-declared sender: a frame that claims an actor its
connection does not host is counted and dropped. With launcher-made keys a child holds only its own secret key, so
"authenticated as node P" means P (or the launcher); with derived keys it means "a member of the run".
Handshakes the bus refuses (no CURVE, a wrong server key, a client key outside the run) are seen on the PULL
socket's monitor and counted by the node. ipc:// socket files are made 0600 (their folder is the launcher's 0700
temporary directory) as a second fence, not the first: permissions do not stop a process of the same uid.
Cost: one CURVE box per message each way, the connection name read off each first frame (BENCHMARKS.md, "Bus with
CURVE").
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import itertools
import os
import tempfile
import threading
from pathlib import Path
from typing import Awaitable, Callable, Iterable, Mapping

import attrs
import structlog
import zmq
import zmq.utils.z85
from zmq.utils.monitor import parse_monitor_message

from gyre.runtime.errors import Backpressure, ConfigError, GyreError, UnknownAddress
from gyre.runtime.run_secrets import run_secret

log = structlog.get_logger("gyre.runtime.zmq")

_NOBLOCK = int(zmq.NOBLOCK)
_SNDMORE_NOBLOCK = int(zmq.SNDMORE | zmq.NOBLOCK)
_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)
_MAX_PARTS = 16  # a frame set longer than this is garbage: read it out and hand over only its start
_USER_ID = "User-Id"  # the message property ZeroMQ fills with the name our ZAP handler gave the connection
_ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # fixed by ZeroMQ's ZAP specification (RFC 27)
_REFUSALS = int(
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
_DERIVED_PURPOSE = "bus-curve-secret:"

#: The node's receive hook: (frames, the node its connection is authenticated as, None without CURVE) -> None when
#: the frames were taken, else an awaitable that completes once they are in.
FramesHook = Callable[[list, "str | None"], "Awaitable[None] | None"]
#: The node's hook for a connection the bus refused: (why, endpoint), called on the event loop.
RefusedHook = Callable[[str, str], None]


class BusSecurityUnavailable(GyreError, RuntimeError):
    """This pyzmq's libzmq was built without CURVE (libsodium): the bus will not run unauthenticated."""


@attrs.frozen
class ZmqConfig:
    """Socket bounds."""

    send_hwm: int = 10_000
    """Messages queued towards one peer before senders see Backpressure."""
    recv_hwm: int = 10_000
    """Messages queued in the node's inbound socket."""
    linger_ms: int = 1000
    """How long close() waits to flush queued outbound messages."""
    drain_batch: int = 256
    """Frame sets taken per turn of the event loop before letting the actors run."""
    curve_on_ipc: bool = True
    """Whether ipc:// endpoints speak CURVE as tcp:// ones always do. Off leaves only the socket file's mode between
    the run and any process of the same uid: for measuring what CURVE costs, not for runs."""


@attrs.frozen
class BusKeys:
    """One node's CURVE keys for a run: its own key pair and the public key of every node it may talk to."""

    node: str
    """The node these keys belong to (the name its connections are authenticated as)."""
    public_key: bytes = attrs.field(repr=False)
    """This node's public key (Z85, 40 bytes)."""
    secret_key: bytes = attrs.field(repr=False)
    """This node's secret key (Z85, 40 bytes); never logged (repr=False), never in a config or the environment."""
    public_keys: Mapping[str, bytes] = attrs.field(repr=False)
    """Node name -> public key (Z85) of every node of the run, this one included."""

    def __attrs_post_init__(self) -> None:
        for name, key in [("public_key", self.public_key), ("secret_key", self.secret_key),
                          *((f"public_keys[{node!r}]", key) for node, key in self.public_keys.items())]:
            if not isinstance(key, bytes) or len(key) != 40:
                raise ConfigError(f"BusKeys of {self.node!r}: {name} must be a 40-byte Z85 key")
        if self.public_keys.get(self.node) != self.public_key:
            raise ConfigError(f"BusKeys of {self.node!r}: public_keys must hold this node's own public key")


def _require_curve() -> None:
    if not zmq.has("curve"):
        raise BusSecurityUnavailable(
            "pyzmq's libzmq has no CURVE support (built without libsodium); install a pyzmq wheel that has it"
        )


def generate_bus_keys(nodes: Iterable[str]) -> dict[str, BusKeys]:
    """Fresh key pairs, one per node (the launcher): each node is handed only its own secret key."""
    _require_curve()
    pairs = {node: zmq.curve_keypair() for node in sorted(set(nodes))}
    public_keys = {node: public for node, (public, _) in pairs.items()}
    return {node: BusKeys(node, public, secret, public_keys) for node, (public, secret) in pairs.items()}


def derived_bus_keys(node: str, nodes: Iterable[str]) -> BusKeys:
    """Keys computed from the run secret (HMAC per node name): every process holding the secret gets the same ones,
    so the connection's name proves membership of the run, not which member."""
    _require_curve()

    def secret_of(name: str) -> bytes:
        digest = hmac.new(run_secret(), (_DERIVED_PURPOSE + name).encode("utf-8"), hashlib.sha256).digest()
        return zmq.utils.z85.encode(digest)

    public_keys = {name: zmq.curve_public(secret_of(name)) for name in sorted(set(nodes) | {node})}
    return BusKeys(node, public_keys[node], secret_of(node), public_keys)


#: The longest ipc:// path the OS takes (sockaddr_un.sun_path less its NUL: 107 on Linux); a longer one fails bind().
IPC_PATH_MAX_CHARS = getattr(zmq, "IPC_PATH_MAX_LEN", 107) or 107
#: Room the run folder leaves for a socket file's name ("launcher.sock", "123.sock").
_SOCKET_NAME_CHARS = 16
#: Where a run folder goes when the temp folder's path is too long for sockets (a deep $TMPDIR, a test's tmp_path).
_SHORT_TEMP_ROOT = "/tmp"


def ipc_socket_folder(prefix: str) -> Path:
    """A new 0700 folder for a run's ipc:// socket files, in the temp folder ($TMPDIR) when its path leaves room for
    a socket name within IPC_PATH_MAX_CHARS, else in /tmp (a deep $TMPDIR would otherwise fail every bind with
    "longer than 107 characters"). Raises ConfigError when neither fits."""
    for root in (tempfile.gettempdir(), _SHORT_TEMP_ROOT):
        # mkdtemp adds 8 characters and a separator to prefix; check before making anything.
        if len(os.path.join(root, prefix)) + 9 + 1 + _SOCKET_NAME_CHARS <= IPC_PATH_MAX_CHARS and os.path.isdir(root):
            return Path(tempfile.mkdtemp(prefix=prefix, dir=root))
    raise ConfigError(f"no temp folder leaves room for ipc:// socket paths of at most {IPC_PATH_MAX_CHARS} "
                      f"characters (tried {tempfile.gettempdir()!r} and {_SHORT_TEMP_ROOT!r}); set TMPDIR to a "
                      "short path or use --bus tcp")


def _uses_curve(endpoint: str, config: ZmqConfig) -> bool:
    return config.curve_on_ipc or not endpoint.startswith(("ipc://", "inproc://"))


class _ZapHandler:
    """ZeroMQ's authentication hook for one context: a thread answering ZAP requests from the context's CURVE
    servers. Each transport registers its socket's ZAP domain with the client keys it accepts; a key outside the run
    (or a domain nobody registered) is refused. It runs in a thread, not on the event loop, so a handshake never
    waits for a busy handler; handshakes are rare (one per peer connection), so it costs nothing per message."""

    _lock = threading.Lock()
    _by_context: dict[int, "_ZapHandler"] = {}

    @classmethod
    def register(cls, context: zmq.Context, domain: str, allowed: dict[bytes, str]) -> None:
        with cls._lock:
            handler = cls._by_context.get(id(context))
            if handler is None:
                handler = cls._by_context[id(context)] = _ZapHandler(context)
            handler._domains[domain.encode()] = dict(allowed)

    @classmethod
    def unregister(cls, context: zmq.Context, domain: str) -> None:
        with cls._lock:
            handler = cls._by_context.get(id(context))
            if handler is None:
                return
            handler._domains.pop(domain.encode(), None)
            if not handler._domains:
                del cls._by_context[id(context)]
                handler._stop()

    def __init__(self, context: zmq.Context) -> None:
        self._context = context
        self._domains: dict[bytes, dict[bytes, str]] = {}
        self._control_endpoint = f"inproc://gyre-zap-control-{id(self)}"
        self._control = context.socket(zmq.PAIR)
        self._control.setsockopt(zmq.LINGER, 0)
        self._control.bind(self._control_endpoint)
        self._ready = threading.Event()
        self._failure: BaseException | None = None
        self._thread = threading.Thread(target=self._serve, name="gyre-zap", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._failure is not None:
            self._control.close()
            raise BusSecurityUnavailable(f"could not start the bus's ZAP handler: {self._failure!r}")

    def _serve(self) -> None:
        try:
            rep = self._context.socket(zmq.REP)
            rep.setsockopt(zmq.LINGER, 0)
            rep.bind(_ZAP_ENDPOINT)  # before any CURVE server exists: none can be let in by default
            control = self._context.socket(zmq.PAIR)
            control.setsockopt(zmq.LINGER, 0)
            control.connect(self._control_endpoint)
        except Exception as error:  # whatever it is, the transport waiting on _ready must hear of it
            self._failure = error
            self._ready.set()
            return
        self._ready.set()
        poller = zmq.Poller()
        poller.register(rep, zmq.POLLIN)
        poller.register(control, zmq.POLLIN)
        try:
            while True:
                ready = dict(poller.poll())
                if control in ready:
                    return
                if rep in ready:
                    request = rep.recv_multipart()
                    try:
                        reply = self._answer(request)
                    except Exception as error:  # a REP socket must answer, and the thread must live on
                        log.error("zap_request_unanswerable", error=repr(error))
                        reply = [b"1.0", request[1] if len(request) > 1 else b"", b"500", b"internal error", b"", b""]
                    rep.send_multipart(reply)
        finally:
            rep.close()
            control.close()

    def _answer(self, request: list[bytes]) -> list[bytes]:
        """One ZAP reply (RFC 27): 200 with the node's name as user id, or 400."""
        if len(request) < 6:
            return [b"1.0", b"", b"500", b"malformed request", b"", b""]
        version, request_id, domain, _address, _identity, mechanism = request[:6]
        credentials = request[6:]
        allowed = self._domains.get(domain, {})
        node = allowed.get(credentials[0]) if mechanism == b"CURVE" and len(credentials) == 1 else None
        if node is None:
            return [version, request_id, b"400", b"not a key of this run", b"", b""]
        return [version, request_id, b"200", b"OK", node.encode(), b""]

    def _stop(self) -> None:
        self._control.send(b"")
        self._thread.join(timeout=5.0)
        self._control.close()


class ZmqTransport:
    """Moves frame pairs between nodes over ipc:// or tcp:// endpoints, CURVE-authenticated (module docstring)."""

    _domains = itertools.count()

    def __init__(
        self,
        bind_endpoint: str,
        peers: dict[str, str],
        config: ZmqConfig = ZmqConfig(),
        keys: BusKeys | None = None,
    ) -> None:
        self.config = config
        self._context = zmq.Context.instance()
        self._peers = dict(peers)
        self._curve_server = _uses_curve(bind_endpoint, config)
        if keys is None and any(_uses_curve(e, config) for e in [bind_endpoint, *self._peers.values()]):
            own = [name for name, endpoint in self._peers.items() if endpoint == bind_endpoint]
            if len(own) != 1:
                raise ConfigError(
                    f"no BusKeys given and no single peer binds {bind_endpoint!r}: cannot tell which node this is"
                )
            keys = derived_bus_keys(own[0], self._peers)
        self._keys = keys
        self._pull = self._context.socket(zmq.PULL)
        self._pull.setsockopt(zmq.RCVHWM, config.recv_hwm)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._zap_domain = ""
        self._monitor: zmq.Socket | None = None
        if self._curve_server:
            assert keys is not None
            self._zap_domain = f"gyre-{os.getpid()}-{next(self._domains)}"
            allowed = {zmq.utils.z85.decode(key): node for node, key in keys.public_keys.items()}
            _ZapHandler.register(self._context, self._zap_domain, allowed)
            self._pull.setsockopt(zmq.CURVE_SERVER, 1)
            self._pull.setsockopt(zmq.CURVE_PUBLICKEY, keys.public_key)
            self._pull.setsockopt(zmq.CURVE_SECRETKEY, keys.secret_key)
            self._pull.setsockopt(zmq.ZAP_DOMAIN, self._zap_domain.encode())
            # Events queue in an inproc pair (high-water mark 1000) until start() reads them; past that a flood of
            # refusals is undercounted, never blocking the socket.
            self._monitor = self._pull.get_monitor_socket(_REFUSALS)
        try:
            self._pull.bind(bind_endpoint)
        except zmq.ZMQError:
            self._release()
            raise
        self.endpoint = self._pull.getsockopt_string(zmq.LAST_ENDPOINT)
        if self.endpoint.startswith("ipc://") and not self.endpoint.startswith("ipc://@"):
            os.chmod(self.endpoint[len("ipc://"):], 0o600)
        self._push: dict[str, zmq.Socket] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._on_frames: FramesHook | None = None
        self._on_refused: RefusedHook | None = None
        self._blocked = False  # the node is waiting for mailbox room: leave the rest in the socket
        self._waiter: asyncio.Task | None = None
        self._closed = False

    def _socket_for(self, node: str) -> zmq.Socket:
        socket = self._push.get(node)
        if socket is None:
            endpoint = self._peers.get(node)
            if endpoint is None:
                raise UnknownAddress(f"no endpoint known for node {node!r}")
            socket = self._context.socket(zmq.PUSH)
            socket.setsockopt(zmq.SNDHWM, self.config.send_hwm)
            socket.setsockopt(zmq.LINGER, self.config.linger_ms)
            socket.setsockopt(zmq.IMMEDIATE, 0)  # queue for a peer that has not bound yet (start-up order is free)
            if _uses_curve(endpoint, self.config):
                server_key = self._keys.public_keys.get(node) if self._keys is not None else None
                if server_key is None:
                    socket.close()
                    raise UnknownAddress(f"no public key known for node {node!r}")
                socket.setsockopt(zmq.CURVE_SERVERKEY, server_key)
                socket.setsockopt(zmq.CURVE_PUBLICKEY, self._keys.public_key)
                socket.setsockopt(zmq.CURVE_SECRETKEY, self._keys.secret_key)
            socket.connect(endpoint)
            self._push[node] = socket
        return socket

    def move_peer(self, node: str, endpoint: str) -> None:
        """Node `node` binds `endpoint` from now on (its process group was started again on another machine, with
        the same keys): later sends go there. What was queued towards the old endpoint is dropped, as it would have
        been had the old process taken it and died. Call on the transport's event loop (sockets are not threadsafe)."""
        if node not in self._peers:
            raise UnknownAddress(f"no endpoint known for node {node!r}")
        if self._peers[node] == endpoint:
            return
        old, self._peers[node] = self._peers[node], endpoint
        socket = self._push.pop(node, None)
        if socket is not None:
            socket.close(linger=0)
        log.info("peer_moved", node=node, old=old, endpoint=endpoint)

    def send_nowait(self, node: str, frames: tuple[bytes, bytes]) -> None:
        socket = self._push.get(node) or self._socket_for(node)
        header, body = frames
        try:
            socket.send(header, _SNDMORE_NOBLOCK)
        except zmq.Again:
            raise Backpressure(f"the queue towards node {node!r} is full ({self.config.send_hwm} messages)") from None
        # ZeroMQ checks the high-water mark on a message's first part only: the rest of an accepted message always
        # goes in, so this send does not block.
        socket.send(body, 0, copy=len(body) < 65536)

    def start(self, on_frames: FramesHook, on_refused: RefusedHook | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        self._on_frames = on_frames
        self._on_refused = on_refused
        self._loop.add_reader(self._pull.getsockopt(zmq.FD), self._drain)
        self._loop.call_soon(self._drain)  # frames that arrived before we watched the descriptor
        if self._monitor is not None:
            self._loop.add_reader(self._monitor.getsockopt(zmq.FD), self._drain_monitor)
            self._loop.call_soon(self._drain_monitor)

    def _drain(self) -> None:
        """Hand over the frames waiting on the socket (ZeroMQ's descriptor is edge-triggered: read until empty)."""
        if self._blocked or self._closed:
            return
        pull = self._pull
        on_frames = self._on_frames
        curve = self._curve_server
        for _ in range(self.config.drain_batch):
            # Asking EVENTS (not reading until zmq.Again) also re-arms the descriptor, and an exception per wake-up
            # costs more than the question.
            if not pull.getsockopt(_EVENTS) & _POLLIN:
                return
            # Frames, not bytes: `frame.more` answers what getsockopt(RCVMORE) would, without its option lookup.
            frame = pull.recv(_NOBLOCK, copy=False)
            peer = frame.get(_USER_ID) if curve else None
            frames = [frame.bytes]
            while frame.more:
                frame = pull.recv(_NOBLOCK, copy=False)
                if len(frames) < _MAX_PARTS:
                    frames.append(frame.bytes)
            try:
                waiting = on_frames(frames, peer)
            except Exception as error:  # the node must never lose its reader to one bad frame set
                log.error("frame_handler_raised_frames_dropped", error=repr(error))
                continue
            if waiting is not None:
                self._blocked = True
                self._waiter = self._loop.create_task(self._resume_after(waiting), name="zmq-reader-wait")
                return
        self._loop.call_soon(self._drain)  # more may be waiting: let the actors run first, then come back

    def _drain_monitor(self) -> None:
        """Report each refused handshake the monitor saw (edge-triggered too: read until empty)."""
        monitor = self._monitor
        if monitor is None or self._closed:
            return
        while monitor.getsockopt(_EVENTS) & _POLLIN:
            try:
                event = parse_monitor_message(monitor.recv_multipart(_NOBLOCK))
            except (zmq.Again, ValueError):
                return
            why = _refusal_reason(event["event"], event["value"])
            endpoint = event["endpoint"].decode("utf-8", "replace")
            if self._on_refused is not None:
                try:
                    self._on_refused(why, endpoint)
                except Exception as error:
                    log.error("refusal_hook_raised", error=repr(error))

    async def _resume_after(self, waiting: Awaitable[None]) -> None:
        try:
            await waiting
        except Exception as error:
            log.error("frame_handler_raised_frames_dropped", error=repr(error))
        self._blocked = False
        self._drain()

    def _release(self) -> None:
        if self._monitor is not None:
            try:
                self._pull.disable_monitor()
            except zmq.ZMQError:
                pass
            self._monitor.close()
        if self._zap_domain:
            _ZapHandler.unregister(self._context, self._zap_domain)
        self._pull.close()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._loop is not None and not self._loop.is_closed():
            for socket in (self._pull, self._monitor):
                if socket is None:
                    continue
                try:
                    self._loop.remove_reader(socket.getsockopt(zmq.FD))
                except Exception:
                    pass
        if self._waiter is not None:
            self._waiter.cancel()
        for socket in self._push.values():
            socket.close()
        self._release()


def _refusal_reason(event: int, value: int) -> str:
    """A short name for a refused handshake (what a log line or a test can match)."""
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return "key_not_of_this_run"
    if value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
        return "no_curve"
    if value == zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC:
        return "wrong_server_key"
    return "handshake_failed"
