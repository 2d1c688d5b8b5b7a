"""The deterministic runner's message path: messages that become ready together reach their receivers in an
interleaving drawn from the topology's seed, each sender's order kept, and one seed gives one order, draw for draw
as `random.Random(seed).randrange` would pick it (recorded virtual runs and `gyre simulate`'s figures depend on that
order staying what it was); the envelopes and handles it builds on its fast paths are Envelope's and asyncio's."""

from __future__ import annotations

import asyncio
import collections
import contextvars
import random
from typing import Any

import attrs
import pytest

from gyre.runtime import Actor, handler
from gyre.runtime.clock import VirtualClock
from gyre.runtime.envelope import Envelope, Kind, _new_envelope
from gyre.runtime.launch import RunOptions, VirtualLauncher
from gyre.runtime.node import _randbelow
from gyre.runtime.topology import Topology
from gyre.runtime.virtual_loop import VirtualEventLoop


@pytest.mark.parametrize("seed", [0, 1, 7, 2**40 + 3])
def test_randbelow_draws_as_randrange_does(seed: int) -> None:
    ours, theirs = random.Random(seed), random.Random(seed)
    for n in [1, 1, 2, 3, 1, 4, 5, 7, 8, 9, 16, 17, 31, 32, 33, 100, 1000, 1, 2] * 20:
        assert _randbelow(ours.getrandbits, n) == theirs.randrange(n)
    assert ours.getstate() == theirs.getstate()  # as many bits drawn, rejections included


@attrs.frozen
class _Go:
    pass


@attrs.frozen
class _Item:
    sender: str
    index: int


@attrs.frozen
class _Config:
    seen: Any = None
    """The sink appends (sender, index) here as it handles each item."""
    per_sender: int = 4


class _Sender(Actor):
    config_cls = _Config

    async def on_start(self) -> None:
        self.send_later(1.0, _Go())

    @handler(_Go)
    def on_go(self, msg: _Go) -> None:
        for index in range(self.config.per_sender):
            self.tell("sink", _Item(self.name, index))


class _Sink(Actor):
    config_cls = _Config

    @handler(_Item)
    def on_item(self, msg: _Item) -> None:
        self.config.seen.append((msg.sender, msg.index))
        if len(self.config.seen) == 3 * self.config.per_sender:
            self.stop_topology("all seen")


def _run(seed: int) -> list[tuple[str, int]]:
    seen: list[tuple[str, int]] = []
    topology = Topology("shuffle", seed=seed)
    topology.add("sink", _Sink, _Config(seen))
    for name in ("a", "b", "c"):
        topology.add(name, _Sender, _Config(seen))
    assert VirtualLauncher().run(topology, RunOptions(until_s=10.0)).exit_code == 0
    return seen


def _expected(seed: int, per_sender: int = 4) -> list[tuple[str, int]]:
    """The order as randrange picks it: the three timers fire together (one batch of three senders' _Go), then the
    senders' twelve items arrive together (one batch, each sender's queue in name order)."""
    rng = random.Random(seed)
    for n in (3, 2, 1):
        rng.randrange(n)
    queues = [collections.deque((name, i) for i in range(per_sender)) for name in ("a", "b", "c")]
    order = []
    while queues:
        index = rng.randrange(len(queues))
        order.append(queues[index].popleft())
        if not queues[index]:
            del queues[index]
    return order


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_one_seed_gives_one_interleaving_each_sender_in_order(seed: int) -> None:
    seen = _run(seed)
    assert seen == _run(seed) == _expected(seed)
    for name in ("a", "b", "c"):
        assert [i for sender, i in seen if sender == name] == [0, 1, 2, 3]


def test_seeds_interleave_differently() -> None:
    assert len({tuple(_run(seed)) for seed in range(6)}) > 1


def test_the_fast_envelope_is_the_envelope() -> None:
    fields = (2**40 * 3 + 7, "a", "b", "gyre.x.Y", 12.5, 5, 6, Kind.EVENT)
    fast, plain = _new_envelope(*fields), Envelope(*fields)
    assert fast == plain and repr(fast) == repr(plain) and hash(fast) == hash(plain)
    assert attrs.astuple(fast, recurse=False) == fields
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        fast.receiver = "c"  # type: ignore[misc]


def test_the_virtual_loops_handles_are_asyncios() -> None:
    """VirtualEventLoop builds its handles slot by slot (virtual_loop.py): each is the Handle or TimerHandle that
    asyncio's own call_soon / call_at would build, every slot set, and runs and cancels as one."""
    loop = VirtualEventLoop(VirtualClock(5.0))
    try:
        ran: list[tuple[str, int]] = []
        soon = loop.call_soon(lambda x: ran.append(("soon", x)), 1)
        later = loop.call_at(7.5, lambda x: ran.append(("later", x)), 2)
        cancelled = loop.call_at(6.0, lambda x: ran.append(("cancelled", x)), 3)
        cancelled.cancel()
        for handle, cls in ((soon, asyncio.Handle), (later, asyncio.TimerHandle), (cancelled, asyncio.TimerHandle)):
            assert type(handle) is cls
            for klass in cls.__mro__[:-1]:
                for slot in klass.__slots__:
                    if slot != "__weakref__":
                        getattr(handle, slot)  # set, or AttributeError
        assert later.when() == 7.5 and not later.cancelled() and cancelled.cancelled()
        assert soon._source_traceback is None and isinstance(soon._context, contextvars.Context)
        loop.run_until_complete(asyncio.sleep(3.0))
        assert ran == [("soon", 1), ("later", 2)]
        assert loop.time() == 8.0
    finally:
        loop.close()
