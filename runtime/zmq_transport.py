"""ZeroMQ transport: one PULL socket bound per node, one PUSH socket per peer node, frames = (header, body).

Sends never block: a full peer queue (the PUSH high-water mark) raises Backpressure to the sender. The reader
drains the PULL socket from the event loop's reader callback (no polling thread) and waits for mailbox room before
taking the next frame, so a slow actor makes ZeroMQ's queues fill and its senders feel it.
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable, Coroutine

import attrs
import zmq

from gyre.runtime.errors import Backpressure, UnknownAddress


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
    """Messages taken per reader wake-up before yielding to the actors."""


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
        self._reader: asyncio.Task | None = None
        self._wake: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
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
        try:
            self._socket_for(node).send_multipart(frames, flags=zmq.NOBLOCK, copy=len(frames[1]) < 65536)
        except zmq.Again:
            raise Backpressure(f"the queue towards node {node!r} is full ({self.config.send_hwm} messages)") from None

    def start(self, on_frames: Callable[[list[bytes]], Coroutine[Any, Any, None]]) -> None:
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        self._loop.add_reader(self._pull.getsockopt(zmq.FD), self._wake.set)
        self._reader = self._loop.create_task(self._read(on_frames), name="zmq-reader")

    async def _read(self, on_frames: Callable[[list[bytes]], Coroutine[Any, Any, None]]) -> None:
        assert self._wake is not None
        pull = self._pull
        batch = self.config.drain_batch
        while True:
            # ZeroMQ's FD is edge-triggered: after a wake-up, drain until EVENTS says nothing is left.
            taken = 0
            while pull.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                await on_frames(pull.recv_multipart(zmq.NOBLOCK))
                taken += 1
                if taken >= batch:
                    await asyncio.sleep(0)
                    taken = 0
            self._wake.clear()
            if pull.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                continue
            await self._wake.wait()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._loop is not None and not self._loop.is_closed():
            try:
                self._loop.remove_reader(self._pull.getsockopt(zmq.FD))
            except Exception:
                pass
        if self._reader is not None:
            self._reader.cancel()
        for socket in self._push.values():
            socket.close()
        self._pull.close()
