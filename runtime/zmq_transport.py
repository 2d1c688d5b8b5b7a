"""ZeroMQ transport: one PULL socket bound per node, one PUSH socket per peer node, frames = (header, body).

Sends never block: a full peer queue (the PUSH high-water mark) raises Backpressure to the sender. The reader is
the event loop's reader callback on the PULL socket's file descriptor (no polling thread, no reader task): it takes
the frames that are there and hands each set to the node, up to `drain_batch` per turn of the loop. When the node
answers that a mailbox is full (it returns an awaitable), reading stops until that message is in, so a slow actor
makes ZeroMQ's queues fill and its senders feel it, and nothing is dropped or reordered.

The hot path uses plain-int flags and socket options: pyzmq's enum wrappers cost several microseconds per call,
which adds up at tens of thousands of messages a second.
"""

from __future__ import annotations

import asyncio
from typing import Awaitable, Callable

import attrs
import structlog
import zmq

from gyre.runtime.errors import Backpressure, UnknownAddress

log = structlog.get_logger("gyre.runtime.zmq")

_NOBLOCK = int(zmq.NOBLOCK)
_SNDMORE_NOBLOCK = int(zmq.SNDMORE | zmq.NOBLOCK)
_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)
_MAX_PARTS = 16  # a frame set longer than this is garbage: read it out and hand over only its start

#: The node's receive hook: None when the frames were taken, else an awaitable that completes once they are in.
FramesHook = Callable[[list], "Awaitable[None] | None"]


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


class ZmqTransport:
    """Moves frame pairs between nodes over ipc:// or tcp:// endpoints."""

    def __init__(self, bind_endpoint: str, peers: dict[str, str], config: ZmqConfig = ZmqConfig()) -> None:
        self.config = config
        self._context = zmq.Context.instance()
        self._pull = self._context.socket(zmq.PULL)
        self._pull.setsockopt(zmq.RCVHWM, config.recv_hwm)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.bind(bind_endpoint)
        self.endpoint = self._pull.getsockopt_string(zmq.LAST_ENDPOINT)
        self._peers = dict(peers)
        self._push: dict[str, zmq.Socket] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._on_frames: FramesHook | None = None
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
            socket.connect(endpoint)
            self._push[node] = socket
        return socket

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

    def start(self, on_frames: FramesHook) -> None:
        self._loop = asyncio.get_running_loop()
        self._on_frames = on_frames
        self._loop.add_reader(self._pull.getsockopt(zmq.FD), self._drain)
        self._loop.call_soon(self._drain)  # frames that arrived before we watched the descriptor

    def _drain(self) -> None:
        """Hand over the frames waiting on the socket (ZeroMQ's descriptor is edge-triggered: read until empty)."""
        if self._blocked or self._closed:
            return
        pull = self._pull
        on_frames = self._on_frames
        for _ in range(self.config.drain_batch):
            # Asking EVENTS (not reading until zmq.Again) also re-arms the descriptor, and an exception per wake-up
            # costs more than the question.
            if not pull.getsockopt(_EVENTS) & _POLLIN:
                return
            # Frames, not bytes: `frame.more` answers what getsockopt(RCVMORE) would, without its option lookup.
            frame = pull.recv(_NOBLOCK, copy=False)
            frames = [frame.bytes]
            while frame.more:
                frame = pull.recv(_NOBLOCK, copy=False)
                if len(frames) < _MAX_PARTS:
                    frames.append(frame.bytes)
            try:
                waiting = on_frames(frames)
            except Exception as error:  # the node must never lose its reader to one bad frame set
                log.error("frame_handler_raised_frames_dropped", error=repr(error))
                continue
            if waiting is not None:
                self._blocked = True
                self._waiter = self._loop.create_task(self._resume_after(waiting), name="zmq-reader-wait")
                return
        self._loop.call_soon(self._drain)  # more may be waiting: let the actors run first, then come back

    async def _resume_after(self, waiting: Awaitable[None]) -> None:
        try:
            await waiting
        except Exception as error:
            log.error("frame_handler_raised_frames_dropped", error=repr(error))
        self._blocked = False
        self._drain()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._loop is not None and not self._loop.is_closed():
            try:
                self._loop.remove_reader(self._pull.getsockopt(zmq.FD))
            except Exception:
                pass
        if self._waiter is not None:
            self._waiter.cancel()
        for socket in self._push.values():
            socket.close()
        self._pull.close()
