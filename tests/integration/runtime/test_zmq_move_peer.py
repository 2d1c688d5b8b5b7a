"""ZmqTransport.move_peer: a peer node that binds another endpoint (its process group started again on another
machine, with the same keys) is reached there from then on; what was queued for the dead endpoint is dropped, not
delivered late; an unknown node is refused. Real ZeroMQ sockets over tcp:// with CURVE."""

from __future__ import annotations

import asyncio

import pytest

from gyre.runtime.errors import UnknownAddress
from gyre.runtime.zmq_transport import ZmqTransport, generate_bus_keys

pytestmark = pytest.mark.timeout(60)

#: Bound on waiting for a frame set to arrive (a loaded machine; the wait ends as soon as it is there).
ARRIVAL_S = 20.0


def _receiver(transport: ZmqTransport) -> list[tuple[list[bytes], str | None]]:
    got: list[tuple[list[bytes], str | None]] = []
    transport.start(lambda frames, peer: got.append((frames, peer)))
    return got


async def _arrived(got: list, count: int) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + ARRIVAL_S
    while len(got) < count:
        assert loop.time() < deadline, f"{len(got)} of {count} frame sets came"
        await asyncio.sleep(0.01)


def test_a_moved_peer_is_reached_at_its_new_endpoint_and_the_old_queue_is_dropped() -> None:
    async def main() -> None:
        keys = generate_bus_keys(["a", "b"])
        first = ZmqTransport("tcp://127.0.0.1:0", {}, keys=keys["b"])
        sender = ZmqTransport("tcp://127.0.0.1:0", {"b": first.endpoint}, keys=keys["a"])
        sender.start(lambda frames, peer: None)
        got_first = _receiver(first)
        sender.send_nowait("b", (b"h1", b"to the first"))
        await _arrived(got_first, 1)
        assert got_first == [([b"h1", b"to the first"], "a")]
        first.close()  # b's process is gone
        sender.send_nowait("b", (b"h2", b"queued for the dead one"))
        second = ZmqTransport("tcp://127.0.0.2:0", {}, keys=keys["b"])  # b again, same keys, another address
        got_second = _receiver(second)
        with pytest.raises(UnknownAddress):
            sender.move_peer("c", second.endpoint)
        sender.move_peer("b", second.endpoint)
        sender.send_nowait("b", (b"h3", b"to the second"))
        sender.move_peer("b", second.endpoint)  # the same endpoint again: nothing changes
        sender.send_nowait("b", (b"h4", b"still there"))
        await _arrived(got_second, 2)
        # One socket towards b, in order: the frame set queued for the dead endpoint would have come first.
        assert got_second == [([b"h3", b"to the second"], "a"), ([b"h4", b"still there"], "a")]
        sender.close()
        second.close()

    asyncio.run(main())
