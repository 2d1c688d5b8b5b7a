"""Actor behaviour over every transport: the same tests run in one node, in virtual time, and across ZeroMQ nodes.

Each test builds a small topology, drives it through `gyre.runtime.testing.run_actors`, and checks what the
runtime promises: tell/ask and their errors, timers, publish, supervision (restart, stop_actor, escalation),
asks on dead actors, bounded mailboxes with explicit backpressure, and compute off the event loop.
"""

from __future__ import annotations

import asyncio
import threading

import attrs
import pytest

from gyre.messages._define import message
from gyre.runtime import (
    Actor,
    ActorDead,
    AskTimeout,
    Backpressure,
    NodeConfig,
    NoHandler,
    RemoteError,
    RestartPolicy,
    Topology,
    UnknownAddress,
    handler,
    read_log,
)
from gyre.runtime.testing import TRANSPORTS, Harness, capture_logs, run_actors
from gyre.runtime.zmq_transport import ZmqConfig

pytestmark = pytest.mark.timeout(60)


# ---- the conversation of these tests -----------------------------------------------------------------------------
@message("gyre.test.actors.Add")
class Add:
    """Add to the worker's total."""

    amount: int
    """How much."""


@message("gyre.test.actors.GetTotal")
class GetTotal:
    """Ask for a total."""


@message("gyre.test.actors.Total")
class Total:
    """A total."""

    value: int
    """The value."""


@message("gyre.test.actors.Crash")
class Crash:
    """A tell whose handler raises."""

    why: str
    """Text of the error."""


@message("gyre.test.actors.Fail")
class Fail:
    """An ask whose handler raises."""


@message("gyre.test.actors.Stall")
class Stall:
    """An ask whose handler takes long."""

    delay_s: float
    """How long."""


@message("gyre.test.actors.DieWhileAsked")
class DieWhileAsked:
    """An ask during which a background task of the actor raises."""


@message("gyre.test.actors.Unhandled")
class Unhandled:
    """A type no actor handles."""


@message("gyre.test.actors.Item")
class Item:
    """One message of a flood."""

    number: int
    """Position in the flood, from 0."""


@message("gyre.test.actors.Flood")
class Flood:
    """Ask the flooder to send `count` items to `to`."""

    to: str
    """Receiver."""
    count: int
    """Items to send at most."""
    wait: bool
    """True: `await send` each (wait for room); False: `tell` until Backpressure."""


@message("gyre.test.actors.Flooded")
class Flooded:
    """What the flooder managed."""

    sent: int
    """Items accepted by the bus."""
    saw_backpressure: bool
    """Whether a tell raised Backpressure."""


@message("gyre.test.actors.Forward")
class Forward:
    """Ask the relay to ask `to` for its total."""

    to: str
    """Whom to ask."""
    timeout_s: float = 10.0
    """Timeout of the relay's ask."""


@message("gyre.test.actors.Announcement")
class Announcement:
    """A published event."""

    text: str
    """Content."""


@message("gyre.test.actors.Tick")
class Tick:
    """A timer."""

    number: int
    """Ticks before this one."""


@message("gyre.test.actors.BlockingWork")
class BlockingWork:
    """Offload a call that blocks until the test opens a gate."""

    gate: str
    """Key of the gate in this module's registry."""


@message("gyre.test.actors.WorkDone")
class WorkDone:
    """Result of BlockingWork."""

    gate_opened: bool
    """True when the gate opened before the blocking call gave up."""


# ---- actors -------------------------------------------------------------------------------------------------------
class Worker(Actor):
    """Keeps a total; can be made to fail in every way the runtime distinguishes."""

    async def on_start(self) -> None:
        self.total = 0

    @handler(Add)
    def on_add(self, msg: Add) -> None:
        self.total += msg.amount

    @handler(GetTotal)
    def on_get(self, msg: GetTotal) -> Total:
        return Total(self.total)

    @handler(Crash)
    def on_crash(self, msg: Crash) -> None:
        raise RuntimeError(msg.why)

    @handler(Fail)
    def on_fail(self, msg: Fail) -> Total:
        raise ValueError("cannot answer that")

    @handler(Stall)
    async def on_stall(self, msg: Stall) -> Total:
        await asyncio.sleep(msg.delay_s)
        return Total(-1)

    @handler(DieWhileAsked)
    async def on_die(self, msg: DieWhileAsked) -> Total:
        async def explode() -> None:
            await asyncio.sleep(0)
            raise RuntimeError("background task broke")

        self.spawn(explode())
        await asyncio.sleep(3600)
        return Total(-1)


class Sink(Actor):
    """Takes items slowly and remembers their order."""

    async def on_start(self) -> None:
        self.received: list[int] = []

    @handler(Item)
    async def on_item(self, msg: Item) -> None:
        await asyncio.sleep(0.0005)
        self.received.append(msg.number)

    @handler(GetTotal)
    def on_get(self, msg: GetTotal) -> Total:
        return Total(len(self.received))


class Flooder(Actor):
    """Sends a flood of items on request, either telling until the bus refuses or waiting for room."""

    @handler(Flood)
    async def on_flood(self, msg: Flood) -> Flooded:
        for number in range(msg.count):
            if msg.wait:
                await self.send(msg.to, Item(number), timeout_s=30.0)
                continue
            try:
                self.tell(msg.to, Item(number))
            except Backpressure:
                return Flooded(number, True)
        return Flooded(msg.count, False)


class Relay(Actor):
    """Asks another actor on behalf of its asker."""

    @handler(Forward)
    async def on_forward(self, msg: Forward) -> Total:
        answer = await self.ask(msg.to, GetTotal(), timeout_s=msg.timeout_s)
        return Total(answer.value)


class Listener(Actor):
    """Collects announcements."""

    subscriptions = (Announcement,)

    async def on_start(self) -> None:
        self.heard: list[str] = []

    @handler(Announcement)
    def on_announcement(self, msg: Announcement) -> None:
        self.heard.append(msg.text)

    @handler(Forward)
    def on_forward(self, msg: Forward) -> None:
        self.publish(Announcement(f"relayed to {msg.to}"))


@attrs.frozen
class TickerConfig:
    """Ticker's bound."""

    ticks: int = 3
    """Ticks before it ends the run."""
    interval_s: float = 0.01
    """Timer period."""


class Ticker(Actor):
    """Counts its own timer ticks and ends the run after `ticks`."""

    config_cls = TickerConfig

    async def on_start(self) -> None:
        self.seen: list[int] = []
        self.send_later(self.config.interval_s, Tick(0))

    @handler(Tick)
    def on_tick(self, msg: Tick) -> None:
        self.seen.append(msg.number)
        if len(self.seen) >= self.config.ticks:
            self.stop_topology(f"ticked {len(self.seen)} times", 3)
            return
        self.send_later(self.config.interval_s, Tick(msg.number + 1))


_GATES: dict[str, threading.Event] = {}


class Computer(Actor):
    """Runs blocking calls through `offload`."""

    @handler(BlockingWork)
    async def on_work(self, msg: BlockingWork) -> WorkDone:
        opened = await self.offload(_GATES[msg.gate].wait, 20.0)
        return WorkDone(bool(opened))


# ---- the fixture: one parametrized transport for every test -------------------------------------------------------
@pytest.fixture(params=TRANSPORTS)
def transport(request: pytest.FixtureRequest) -> str:
    """Every actor test runs in one node, in virtual time, and across ZeroMQ nodes in this process."""
    return request.param


def _topology(**restart: RestartPolicy) -> Topology:
    topology = Topology("actors-test", seed=7)
    topology.add("worker", Worker, restart=restart.get("worker", RestartPolicy()))
    topology.add("relay", Relay)
    return topology


def _supervisor_failures(h: Harness) -> list:
    return list(h.actor("supervisor").failures)


# ---- tell and ask -------------------------------------------------------------------------------------------------
def test_tell_then_ask_sees_every_tell_in_order(transport: str) -> None:
    async def driver(h: Harness) -> int:
        for amount in range(1, 11):
            h.tell("worker", Add(amount))
        return (await h.ask("worker", GetTotal(), timeout_s=10.0)).value

    assert run_actors(_topology(), driver, transport=transport).value == 55


def test_actor_asks_another_actor(transport: str) -> None:
    async def driver(h: Harness) -> int:
        h.tell("worker", Add(4))
        return (await h.ask("relay", Forward("worker"), timeout_s=10.0)).value

    assert run_actors(_topology(), driver, transport=transport).value == 4


def test_ask_handler_error_returns_to_asker_and_actor_goes_on(transport: str) -> None:
    async def driver(h: Harness) -> tuple:
        with pytest.raises(RemoteError) as caught:
            await h.ask("worker", Fail(), timeout_s=10.0)
        h.tell("worker", Add(2))
        total = await h.ask("worker", GetTotal(), timeout_s=10.0)
        return caught.value.error_type, caught.value.actor, total.value, h.status("worker")

    assert run_actors(_topology(), driver, transport=transport).value == ("ValueError", "worker", 2, "running")


def test_ask_timeout_and_late_reply_are_harmless(transport: str) -> None:
    async def driver(h: Harness) -> tuple:
        with pytest.raises(AskTimeout):
            await h.ask("worker", Stall(0.2), timeout_s=0.05)
        # An actor's own ask that times out comes back to its asker as a RemoteError naming AskTimeout.
        with pytest.raises(RemoteError) as caught:
            await h.ask("relay", Forward("worker", 0.01), timeout_s=10.0)
        # The stalled handler answers at last: the late reply is counted and dropped, the worker serves again.
        await h.wait_until(lambda: h.statistics()["late_replies"] >= 2, 10.0, "the late replies")
        total = await h.ask("worker", GetTotal(), timeout_s=10.0)
        return caught.value.error_type, total.value

    assert run_actors(_topology(), driver, transport=transport).value == ("AskTimeout", 0)


def test_no_handler(transport: str) -> None:
    async def driver(h: Harness) -> int:
        with pytest.raises(NoHandler):
            await h.ask("worker", Unhandled(), timeout_s=10.0)
        h.tell("worker", Unhandled())  # a tell nobody handles is logged and counted; the actor goes on
        h.tell("worker", Add(1))
        total = await h.ask("worker", GetTotal(), timeout_s=10.0)
        return total.value

    result = run_actors(_topology(), driver, transport=transport)
    assert result.value == 1
    assert sum(stats.get("no_handler", 0) for stats in result.statistics.values()) == 2


def test_unknown_address_is_the_senders_error(transport: str) -> None:
    async def driver(h: Harness) -> bool:
        with pytest.raises(UnknownAddress):
            h.tell("nobody", Add(1))
        with pytest.raises(UnknownAddress):
            await h.ask("nobody", GetTotal(), timeout_s=10.0)
        return True

    assert run_actors(_topology(), driver, transport=transport).value is True


def test_publish_reaches_every_subscriber_once(transport: str) -> None:
    topology = Topology("publish-test", seed=1)
    topology.add("a", Listener)
    topology.add("b", Listener)
    topology.add("worker", Worker)

    async def driver(h: Harness) -> tuple:
        h.publish(Announcement("from outside"))
        h.tell("a", Forward("b"))  # a publishes too; it hears its own announcement as a subscriber
        await h.wait_until(lambda: len(h.actor("a").heard) == 2 and len(h.actor("b").heard) == 2, 10.0, "both heard")
        return sorted(h.actor("a").heard), sorted(h.actor("b").heard)

    heard_a, heard_b = run_actors(topology, driver, transport=transport).value
    assert heard_a == heard_b == ["from outside", "relayed to b"]


def test_timers_and_stop_topology(transport: str) -> None:
    topology = Topology("timer-test", seed=1)
    topology.add("ticker", Ticker, TickerConfig(ticks=4, interval_s=0.01))

    async def driver(h: Harness) -> tuple:
        reason, code = await h.wait_stopped(10.0)
        return reason, code, list(h.actor("ticker").seen)

    result = run_actors(topology, driver, transport=transport)
    assert result.value == ("ticked 4 times", 3, [0, 1, 2, 3])
    assert (result.stop_reason, result.exit_code) == ("ticked 4 times", 3)


# ---- supervision --------------------------------------------------------------------------------------------------
def test_restart_gives_a_fresh_instance_and_keeps_the_queue(transport: str) -> None:
    async def driver(h: Harness) -> tuple:
        first = h.actor("worker")
        h.tell("worker", Add(5))
        h.tell("worker", Crash("boom"))
        h.tell("worker", Add(3))  # queued behind the crash: handled by the restarted instance
        total = await h.ask("worker", GetTotal(), timeout_s=10.0)
        failures = await _wait_failures(h, 1)
        return total.value, h.actor("worker") is not first, h.status("worker"), failures

    result = run_actors(_topology(worker=RestartPolicy("restart", 3)), driver, transport=transport)
    total, fresh, status, failures = result.value
    assert (total, fresh, status) == (3, True, "running")
    assert [(f.actor, f.error_type, f.message, f.action) for f in failures] == [
        ("worker", "RuntimeError", "boom", "restarted")
    ]
    assert result.stop_reason is None


async def _wait_failures(h: Harness, count: int) -> list:
    await h.wait_until(lambda: len(_supervisor_failures(h)) >= count, 10.0, f"{count} failure notices")
    return _supervisor_failures(h)


def test_stop_actor_policy_fails_later_and_queued_asks_with_actor_dead(transport: str) -> None:
    async def driver(h: Harness) -> tuple:
        h.tell("worker", Crash("boom"))
        queued = asyncio.ensure_future(h.ask("worker", GetTotal(), timeout_s=10.0))
        with pytest.raises(ActorDead):
            await queued
        with pytest.raises(ActorDead):
            await h.ask("worker", GetTotal(), timeout_s=10.0)
        failures = await _wait_failures(h, 1)
        still_running = not h.nodes["launcher"].stop_requested.done()
        return h.status("worker"), [f.action for f in failures], still_running

    result = run_actors(_topology(worker=RestartPolicy("stop_actor")), driver, transport=transport)
    assert result.value == ("dead", ["stopped"], True)


def test_tells_to_a_stopped_actor_are_all_counted_and_logged_at_powers_of_two(transport: str) -> None:
    # While a topology stops, cells that stopped first kept receiving a published message per model call, one
    # warning each (a hundred lines at the end of every main-job run).
    async def driver(h: Harness) -> tuple:
        h.tell("worker", Crash("boom"))
        await _wait_failures(h, 1)
        with capture_logs() as logs:
            for amount in range(9):
                h.tell("worker", Add(amount))
            await h.wait_until(lambda: h.statistics()["refused"] >= 9, 10.0, "nine refusals")
            await asyncio.sleep(0.2)  # room for a tenth that should not come
        lines = [entry["refused"] for entry in logs if entry["event"] == "message_for_a_dead_actor"]
        return h.statistics()["refused"], lines

    result = run_actors(_topology(worker=RestartPolicy("stop_actor")), driver, transport=transport)
    assert result.value == (9, [1, 2, 4, 8])


def test_ask_being_handled_when_the_actor_dies_fails_with_actor_dead(transport: str) -> None:
    async def driver(h: Harness) -> str:
        with pytest.raises(ActorDead):
            await h.ask("worker", DieWhileAsked(), timeout_s=20.0)
        return h.status("worker")

    assert run_actors(_topology(worker=RestartPolicy("stop_actor")), driver, transport=transport).value == "dead"


def test_stop_topology_policy_ends_the_run_with_status_1(transport: str) -> None:
    async def driver(h: Harness) -> tuple:
        h.tell("worker", Crash("fatal"))
        return await h.wait_stopped(10.0)

    result = run_actors(_topology(worker=RestartPolicy("stop_topology")), driver, transport=transport)
    reason, code = result.value
    assert code == 1 and "worker failed: RuntimeError: fatal" in reason
    assert result.exit_code == 1


def test_restarts_exhausted_escalate(transport: str) -> None:
    async def driver(h: Harness) -> tuple:
        h.tell("worker", Crash("one"))
        h.tell("worker", Crash("two"))
        reason, code = await h.wait_stopped(10.0)
        failures = await _wait_failures(h, 2)
        return code, [f.action for f in failures], reason

    code, actions, reason = run_actors(
        _topology(worker=RestartPolicy("restart", max_restarts=1)), driver, transport=transport
    ).value
    assert code == 1 and actions == ["restarted", "escalated"] and "two" in reason


# ---- bounded queues -----------------------------------------------------------------------------------------------
_SMALL = NodeConfig(mailbox_size=8)
_SMALL_ZMQ = ZmqConfig(send_hwm=16, recv_hwm=16)


def _flood_topology() -> Topology:
    topology = Topology("flood-test", seed=3)
    topology.add("flooder", Flooder)
    topology.add("sink", Sink)
    return topology


def test_full_mailbox_raises_backpressure_and_drops_nothing(transport: str) -> None:
    async def driver(h: Harness) -> tuple:
        flooded = await h.ask("flooder", Flood("sink", 1_000_000, wait=False), timeout_s=30.0)
        await h.wait_until(lambda: len(h.actor("sink").received) == flooded.sent, 30.0, "the sink took every item")
        return flooded, list(h.actor("sink").received)

    result = run_actors(
        _flood_topology(), driver, transport=transport, node_config=_SMALL, zmq_config=_SMALL_ZMQ, timeout_s=60.0
    )
    flooded, received = result.value
    assert flooded.saw_backpressure and 8 <= flooded.sent < 1_000_000
    assert received == list(range(flooded.sent))


def test_send_waits_for_room_so_every_message_is_handled_in_order(transport: str, tmp_path) -> None:
    count = 300
    log_path = tmp_path / "flood.glog"

    async def driver(h: Harness) -> tuple:
        flooded = await h.ask("flooder", Flood("sink", count, wait=True), timeout_s=60.0)
        # The last items may still sit in the sink's mailbox (or a socket): wait until it took them all.
        await h.wait_until(lambda: len(h.actor("sink").received) >= count, 30.0, "the sink took every item")
        total = await h.ask("sink", GetTotal(), timeout_s=30.0)
        return flooded, total.value, list(h.actor("sink").received)

    result = run_actors(
        _flood_topology(), driver, transport=transport, node_config=_SMALL, zmq_config=_SMALL_ZMQ,
        log_path=log_path, timeout_s=60.0,
    )
    flooded, total, received = result.value
    assert (flooded.sent, flooded.saw_backpressure, total) == (count, False, count)
    assert received == list(range(count))
    logged = [r for r in read_log(log_path) if r.type_name == "gyre.test.actors.Item"]
    assert [r.envelope.receiver for r in logged] == ["sink"] * count
    assert [r.envelope.sequence for r in logged] == sorted(r.envelope.sequence for r in logged)


# ---- compute off the loop -----------------------------------------------------------------------------------------
def test_offload_keeps_the_loop_serving(transport: str, request: pytest.FixtureRequest) -> None:
    if transport == "virtual":
        pytest.skip("virtual time runs offloaded compute inline by design (determinism)")
    gate = request.node.name
    _GATES[gate] = threading.Event()
    topology = _topology()
    topology.add("computer", Computer)

    async def driver(h: Harness) -> bool:
        work = asyncio.ensure_future(h.ask("computer", BlockingWork(gate), timeout_s=30.0))
        await asyncio.sleep(0.01)
        await h.ask("worker", GetTotal(), timeout_s=10.0)  # answered while the blocking call holds a thread
        _GATES[gate].set()
        return (await work).gate_opened

    try:
        assert run_actors(topology, driver, transport=transport).value is True
    finally:
        _GATES.pop(gate, None)


# ---- logging ------------------------------------------------------------------------------------------------------
def test_one_debug_line_per_handled_message(transport: str) -> None:
    async def driver(h: Harness) -> None:
        h.tell("worker", Add(1))
        await h.ask("worker", GetTotal(), timeout_s=10.0)

    with capture_logs() as events:
        run_actors(_topology(), driver, transport=transport)
    handled = [(e["actor"], e["type"]) for e in events if e.get("event") == "handle" and e.get("actor") == "worker"]
    assert handled == [("worker", "Add"), ("worker", "GetTotal")]
    assert all(isinstance(e["seq"], int) for e in events if e.get("event") == "handle")


# ---- restarts that begin outside a handler ------------------------------------------------------------------------
class FlakyStart(Actor):
    """Its first on_start raises (the class counts starts); later instances start and serve."""

    starts = 0

    async def on_start(self) -> None:
        type(self).starts += 1
        if type(self).starts == 1:
            raise RuntimeError("first start fails")
        self.total = 100

    @handler(GetTotal)
    def on_get(self, msg: GetTotal) -> Total:
        return Total(self.total)


def test_failed_first_start_is_restarted_and_serves(transport: str) -> None:
    class Flaky(FlakyStart):  # a fresh class per run: the start counter begins at 0
        starts = 0

    topology = Topology("flaky-start", seed=2)
    topology.add("flaky", Flaky, restart=RestartPolicy("restart", 2))

    async def driver(h: Harness) -> tuple:
        total = await h.ask("flaky", GetTotal(), timeout_s=10.0)
        failures = await _wait_failures(h, 1)
        return total.value, [f.action for f in failures]

    assert run_actors(topology, driver, transport=transport).value == (100, ["restarted"])


def test_background_failure_during_an_ask_restarts_and_answers_the_asker(transport: str) -> None:
    async def driver(h: Harness) -> tuple:
        h.tell("worker", Add(9))
        with pytest.raises(RemoteError) as caught:
            await h.ask("worker", DieWhileAsked(), timeout_s=20.0)
        h.tell("worker", Add(1))
        total = await h.ask("worker", GetTotal(), timeout_s=10.0)
        return caught.value.error_type, total.value, h.status("worker")

    result = run_actors(_topology(worker=RestartPolicy("restart", 3)), driver, transport=transport)
    assert result.value == ("RuntimeError", 1, "running")


def test_waiting_sends_keep_ids_gap_free_so_replay_matches(tmp_path) -> None:
    from gyre.runtime.replay import replay_actor

    log_path = tmp_path / "flood.glog"

    async def driver(h: Harness) -> int:
        await h.ask("flooder", Flood("sink", 100, wait=True), timeout_s=60.0)
        await h.wait_until(lambda: len(h.actor("sink").received) == 100, 30.0, "the sink took every item")
        return h.statistics()["send_waits"]

    waits = run_actors(_flood_topology(), driver, transport="virtual", node_config=_SMALL, log_path=log_path).value
    assert waits > 0  # the flooder did wait for room
    result = replay_actor(log_path, "flooder")
    assert result.identical and result.compared == 101  # 100 items and the reply
