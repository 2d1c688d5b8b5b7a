"""A node: the actors of one process, their mailboxes, and the routing of every message they send.

The message path, from `tell` to handler:
1. `Actor.tell` -> `Node.send_from`: the node stamps an Envelope (id = sender index * 2**40 + sequence, sender,
   receiver, time, causation = the message being handled) and looks the receiver up in the Directory
   (UnknownAddress if absent).
2. Same node: the (envelope, message) pair goes straight into the receiver's bounded mailbox (Backpressure if full).
   Other node: the codec encodes two frames (header, body) and the transport pushes them without blocking
   (Backpressure if the peer's queue is full); the peer's reader decodes and waits for mailbox room, so a slow
   receiver slows its senders down instead of dropping anything.
3. The receiver's mailbox task takes the pair, appends it to the event log (if recording), and calls the handler
   for the message's type. An ask's return value goes back as a REPLY that resolves the asker's future directly
   (replies never queue behind other messages). A message from another node that finds its actor idle (empty
   mailbox, mailbox task parked) is handled the same way straight from the transport's reader callback, which
   saves a turn of the event loop per message; an async handler started there is finished by the mailbox task.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import random
from typing import Any, Awaitable, Callable, Coroutine, Protocol

import attrs
import structlog

from gyre.messages.runtime_control import ActorFailed, ActorStarted, AskFailed, StopTopology
from gyre.runtime.actor import Actor
from gyre.runtime.clock import Clock
from gyre.runtime.codec import Codec
from gyre.runtime.config_codec import class_source, encode_config
from gyre.runtime.envelope import ID_STRIDE, Envelope, Kind, _new_envelope
from gyre.runtime.errors import (
    ActorDead,
    AskTimeout,
    Backpressure,
    CodecError,
    NoHandler,
    RemoteError,
    UnknownAddress,
)
from gyre.runtime.event_log import EventLogWriter
from gyre.runtime.faults import InjectedFault
from gyre.runtime.topology import SUPERVISOR, ActorSpec, Directory, RestartPolicy, client_name

log = structlog.get_logger("gyre.runtime")

_ERRORS_BY_NAME = {"ActorDead": ActorDead, "NoHandler": NoHandler, "UnknownAddress": UnknownAddress}
# Enum members as module constants: `Kind.ASK` is a descriptor lookup (~0.4 us on Python 3.11), paid several times
# per message on the hot path.
_TELL, _ASK, _REPLY, _EVENT = Kind.TELL, Kind.ASK, Kind.REPLY, Kind.EVENT
#: Mailbox marker: (envelope, _STARTED, coroutine) is an async handler started outside the mailbox task.
_STARTED = object()
_Future = asyncio.Future


class Transport(Protocol):
    """Moves encoded frames between nodes."""

    def send_nowait(self, node: str, frames: tuple[bytes, bytes]) -> None:
        """Queue the frames for `node` or raise Backpressure; never blocks."""
        ...

    def start(
        self,
        on_frames: Callable[[list[bytes], str | None], Awaitable[None] | None],
        on_refused: Callable[[str, str], None] | None = None,
    ) -> None:
        """Hand every arriving frame set to `on_frames` with the node its connection is authenticated as (None when
        the transport authenticates nothing); when it returns an awaitable (a full mailbox), stop reading until that
        completes, so frames are neither dropped nor reordered. Call `on_refused(why, endpoint)` for each connection
        the transport refused."""
        ...

    def close(self) -> None: ...


@attrs.frozen
class NodeConfig:
    """Bounds and modes of one node."""

    mailbox_size: int = 4096
    """Messages an actor's mailbox holds before senders see Backpressure."""
    ask_timeout_s: float = 30.0
    """Default time an ask waits for its reply."""
    send_wait_s: float = 10.0
    """How long `Actor.send` waits for room before raising Backpressure."""
    shuffle_seed: int | None = None
    """If set, local messages that become ready together are delivered in a seeded random interleaving (per-sender
    order kept), so hidden order assumptions fail early and one seed always gives one order."""
    offload_inline: bool = False
    """Run offloaded compute inline (virtual time, where threads would break determinism)."""
    offload_threads: int = 2
    """Worker threads for offloaded compute."""


class Mailbox:
    """A bounded FIFO with a single consumer (the actor's mailbox task).

    asyncio.Queue's interface where the node uses it, without what it does not need on every message (task_done
    accounting, an Event to clear, a queue of getters): the mailbox is on the path of every message.
    """

    __slots__ = ("maxsize", "_items", "_getter", "_putters")

    def __init__(self, maxsize: int) -> None:
        self.maxsize = maxsize
        self._items: collections.deque = collections.deque()
        self._getter: asyncio.Future | None = None
        self._putters: collections.deque[asyncio.Future] = collections.deque()

    def qsize(self) -> int:
        return len(self._items)

    def empty(self) -> bool:
        return not self._items

    def full(self) -> bool:
        return len(self._items) >= self.maxsize

    def consumer_waiting(self) -> bool:
        """Whether the consumer is parked in `get` on an empty mailbox (and not yet woken)."""
        getter = self._getter
        return getter is not None and not getter.done()

    def put_nowait(self, item: Any) -> None:
        if len(self._items) >= self.maxsize:
            raise asyncio.QueueFull
        self._items.append(item)
        getter = self._getter
        if getter is not None:
            self._getter = None
            if not getter.done():
                getter.set_result(None)

    async def put(self, item: Any) -> None:
        """Wait for room, then put."""
        while len(self._items) >= self.maxsize:
            putter = asyncio.get_running_loop().create_future()
            self._putters.append(putter)
            try:
                await putter
            except BaseException:
                putter.cancel()
                if putter in self._putters:
                    self._putters.remove(putter)
                self._wake_putter()  # a wake-up this putter got but cannot use goes to the next one
                raise
        self.put_nowait(item)

    def peek(self) -> Any:
        """The next item, left in place (None when empty)."""
        return self._items[0] if self._items else None

    def get_nowait(self) -> Any:
        if not self._items:
            raise asyncio.QueueEmpty
        item = self._items.popleft()
        if self._putters:
            self._wake_putter()
        return item

    async def get(self) -> Any:
        while not self._items:
            getter = asyncio.get_running_loop().create_future()
            self._getter = getter
            try:
                await getter
            finally:
                if self._getter is getter:
                    self._getter = None
        return self.get_nowait()

    def _wake_putter(self) -> None:
        while self._putters and len(self._items) < self.maxsize:
            putter = self._putters.popleft()
            if not putter.done():
                putter.set_result(None)
                return


class ActorSlot:
    """The runtime's side of one actor: its mailbox, sequence counter, status and the current instance."""

    def __init__(self, node: "Node", spec: ActorSpec, seed: int) -> None:
        self.node = node
        self.spec = spec
        self.name = spec.name
        self.index = spec.index
        self.config = spec.config
        self.seed = seed
        self.rng = random.Random(seed)
        self.mailbox = Mailbox(node.config.mailbox_size)  # of (envelope, message, frames or None)
        self.sequence = 0
        self.current_msg_id = 0
        #: The ask or tell being handled now (None between messages): an ask interrupted by a failure is answered.
        self.current_envelope: Envelope | None = None
        #: A restart's on_start in progress; the mailbox waits for it before handing the new instance a message.
        self.restarting: asyncio.Task | None = None
        self.status = "new"  # new -> running -> (stopped | dead); sets `alive`
        self.incarnation = 0
        self.restarts = 0
        self.actor: Actor | None = None
        self.task: asyncio.Task | None = None
        self.children: set[asyncio.Task] = set()
        self.handled = 0

    def next_id(self) -> int:
        self.sequence += 1
        return self.index * ID_STRIDE + self.sequence

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str | None) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro, name=name or f"{self.name}.child")
        self.children.add(task)
        task.add_done_callback(self._child_done)
        return task

    def _child_done(self, task: asyncio.Task) -> None:
        self.children.discard(task)
        if task.cancelled() or task.exception() is None:
            return
        self.node._fail_actor(self, task.exception())

    @property
    def status(self) -> str:
        return self._status

    @status.setter
    def status(self, value: str) -> None:
        self._status = value
        #: "new" or "running": kept as a plain attribute, read several times per message, set a few times per life.
        self.alive = value in ("new", "running")


class Node:
    """Hosts actors and routes their messages; see the module docstring for the path of a message."""

    def __init__(
        self,
        name: str,
        directory: Directory,
        *,
        clock: Clock,
        codec: Codec | None = None,
        transport: Transport | None = None,
        recorder: EventLogWriter | None = None,
        config: NodeConfig = NodeConfig(),
    ) -> None:
        self.name = name
        self.directory = directory
        self.clock = clock
        self.codec = codec or Codec()
        self.transport = transport
        self.recorder = recorder
        self.config = config
        self.slots: dict[str, ActorSlot] = {}
        self.stop_requested: asyncio.Future[tuple[str, int]] | None = None
        self.statistics = collections.Counter()
        #: Tells refused per stopped actor (the log's thinning; their sum is statistics["refused"]).
        self._refused_by_actor: collections.Counter[str] = collections.Counter()
        self._pending: dict[int, tuple[asyncio.Future, str]] = {}
        self._client = _ClientIdentity(client_name(name), directory.actor_index[client_name(name)])
        self._shuffle = random.Random(config.shuffle_seed) if config.shuffle_seed is not None else None
        self._batch: list[tuple[Envelope, Any]] = []
        self._batched_for: collections.Counter[str] = collections.Counter()
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._capture: list[tuple[Envelope, Any]] | None = None
        self._flush_scheduled = False
        self._debug = False
        #: The loop the node was started on, for the paths every message takes (asyncio.get_running_loop() costs
        #: ~0.2 us a call, several times a message's share of a virtual run); None before start.
        self._loop: asyncio.AbstractEventLoop | None = None
        self.fault_injector: Any = None
        """Tests only (gyre.runtime.faults, gyre.runtime.testing.run_with_faults): decides each local delivery's
        fate under a fault plan; None (always, outside fault runs) delivers as usual."""

    # ---- set-up ---------------------------------------------------------------------------------------------------
    def add_actor(self, spec: ActorSpec, seed: int) -> ActorSlot:
        slot = ActorSlot(self, spec, seed)
        self.slots[spec.name] = slot
        return slot

    async def start(self) -> None:
        self._debug = _debug_enabled()  # checked once: per-message lines are free when off
        loop = self._loop = asyncio.get_running_loop()
        self.stop_requested = loop.create_future()
        if self.transport is not None:
            self.transport.start(self._on_frames, self._on_refused)
        for slot in sorted(self.slots.values(), key=lambda s: s.index):
            await self._start_actor(slot)

    async def _start_actor(self, slot: ActorSlot) -> None:
        slot.actor = slot.spec.actor_cls(slot)
        self._record_start(slot)
        slot.status = "running"
        try:
            await slot.actor.on_start()
        except Exception as error:
            self._fail_actor(slot, error)  # a restart starts the mailbox once the new instance's on_start is done
            return
        self._ensure_mailbox_task(slot)

    def _ensure_mailbox_task(self, slot: ActorSlot) -> None:
        if slot.alive and (slot.task is None or slot.task.done()):
            slot.task = asyncio.get_running_loop().create_task(self._run_mailbox(slot), name=f"{slot.name}.mailbox")

    def _record_start(self, slot: ActorSlot) -> None:
        if self.recorder is None:
            return
        source_path, source_sha256 = class_source(slot.spec.actor_cls)
        started = ActorStarted(
            actor=slot.name,
            class_path=slot.spec.class_path,
            source_path=source_path,
            source_sha256=source_sha256,
            config_blob=encode_config(slot.config),
            seed=slot.seed,
            index=slot.index,
            subscriptions=slot.spec.subscription_names(self.codec.type_name_of),
            incarnation=slot.incarnation,
        )
        envelope = Envelope(self._client.next_id(), self._client.name, slot.name, "", self.clock.now(), 0, 0, _TELL)
        header, body = self.codec.encode(envelope, started)
        self.recorder.append(self.clock.now(), header, body)

    async def stop(self) -> None:
        """Stop every actor (on_stop hooks run), fail the asks still waiting here, close the transport and log."""
        for slot in sorted(self.slots.values(), key=lambda s: -s.index):
            await self._stop_actor(slot)
        for future, target in self._pending.values():
            if not future.done():
                future.set_exception(ActorDead(f"{target}: the node {self.name} stopped before the reply came"))
        self._pending.clear()
        if self.transport is not None:
            self.transport.close()
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
        if self.recorder is not None:
            self.recorder.close()

    async def _stop_actor(self, slot: ActorSlot) -> None:
        was_running = slot.status == "running"
        slot.status = "stopped"
        for task in list(slot.children) + ([slot.task] if slot.task else []):
            task.cancel()
        for task in list(slot.children) + ([slot.task] if slot.task else []):
            try:
                await task
            except (asyncio.CancelledError, Exception):
                pass
        if was_running and slot.actor is not None:
            try:
                await slot.actor.on_stop()
            except Exception as error:
                log.error("on_stop_raised", actor=slot.name, error=repr(error))
        self._refuse_mailbox(slot, "stopped")

    # ---- sending --------------------------------------------------------------------------------------------------
    def _envelope(self, sender: Any, to: str, topic: str, kind: Kind, correlation: int = 0) -> Envelope:
        return _new_envelope(
            sender.next_id(), sender.name, to, topic, self.clock.now(), correlation,
            getattr(sender, "current_msg_id", 0), kind,
        )

    def _route(self, envelope: Envelope, msg: Any) -> None:
        if self._capture is not None:  # replay: outputs are compared, not delivered
            self._capture.append((envelope, msg))
            return
        node = self.directory.actor_node.get(envelope.receiver)
        if node is None:
            raise UnknownAddress(f"no actor named {envelope.receiver!r} in this topology")
        if node == self.name:
            self._deliver_local_nowait(envelope, msg)
        else:
            if self.transport is None:
                raise UnknownAddress(f"{envelope.receiver!r} lives on node {node!r}, which this node cannot reach")
            self.transport.send_nowait(node, self.codec.encode(envelope, msg))
        self.statistics["sent"] += 1

    def send_from(self, slot: Any, to: str, msg: Any, kind: Kind = Kind.TELL) -> Envelope:
        envelope = self._envelope(slot, to, "", kind)
        self._route_or_give_back(slot, envelope, msg)
        return envelope

    def _route_or_give_back(self, sender: Any, envelope: Envelope, msg: Any) -> None:
        """Route; if the bus refuses (Backpressure, UnknownAddress), the message never left: hand its id back while
        it is still the sender's latest, so ids stay gap-free. Replay, where sends never fail, compares ids."""
        try:
            self._route(envelope, msg)
        except (Backpressure, UnknownAddress):
            if sender.index * ID_STRIDE + sender.sequence == envelope.msg_id:
                sender.sequence -= 1
            raise

    async def send_waiting(self, slot: Any, to: str, msg: Any, timeout_s: float | None) -> None:
        deadline = self.clock_loop_time() + (self.config.send_wait_s if timeout_s is None else timeout_s)
        # One envelope (one id) for every attempt: the message is sent once, however long it waited for room.
        envelope = self._envelope(slot, to, "", _TELL)
        delay = 0.0005
        while True:
            try:
                self._route(envelope, msg)
                return
            except Backpressure:
                self.statistics["send_waits"] += 1
                if self.clock_loop_time() >= deadline:
                    if slot.index * ID_STRIDE + slot.sequence == envelope.msg_id:
                        slot.sequence -= 1
                    raise
                await asyncio.sleep(delay)
                # Polling, capped low: room can come back any moment, and a sender asleep for long after it did
                # throttles a fast stream (a 5 ms cap costs at most 200 wake-ups a second while blocked).
                delay = min(delay * 2, 0.005)
            except UnknownAddress:
                if slot.index * ID_STRIDE + slot.sequence == envelope.msg_id:
                    slot.sequence -= 1
                raise

    def publish_from(self, slot: Any, msg: Any) -> None:
        topic = self.codec.type_name_of(type(msg))
        subscribers = self.directory.subscribers.get(topic, ())
        if self._capture is not None:
            self._capture.append((self._envelope(slot, "", topic, _EVENT), msg))
            return
        # One id for all copies: the log shows one published message delivered to several subscribers. Each copy is
        # built directly, with the fields _envelope would give (attrs.evolve of one built first re-read the class's
        # fields on every call: a tenth of a virtual run's bus time).
        msg_id, sender, time_s = slot.next_id(), slot.name, self.clock.now()
        causation = getattr(slot, "current_msg_id", 0)
        for subscriber in subscribers:
            self._route(_new_envelope(msg_id, sender, subscriber, topic, time_s, 0, causation, _EVENT), msg)

    async def ask_from(self, slot: Any, to: str, msg: Any, timeout_s: float | None) -> Any:
        envelope = self._envelope(slot, to, "", _ASK)
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._pending[envelope.msg_id] = (future, to)
        timeout = self.config.ask_timeout_s if timeout_s is None else timeout_s
        try:
            self._route_or_give_back(slot, envelope, msg)
            # One timer that fails the future: asyncio.wait_for would add a task-like waiter and callbacks per ask,
            # and its TimeoutError could not be told from one the reply carried.
            timer = loop.call_later(timeout, _expire_ask, future, to, msg, timeout)
            try:
                return await future
            finally:
                timer.cancel()
        finally:
            self._pending.pop(envelope.msg_id, None)

    def schedule_self(self, slot: ActorSlot, delay_s: float, msg: Any) -> asyncio.TimerHandle:
        causation = slot.current_msg_id
        # The id is taken now, not when the timer fires, so ids do not depend on how firing interleaves with other
        # messages (replay and virtual runs rely on that). A bound method and its arguments rather than a closure:
        # timers are most of a virtual run's messages, and a closure costs a function object and five cells each.
        # `call_at(time() + delay)` is what `call_later(delay)` does, one call less.
        loop = self._loop or asyncio.get_running_loop()
        return loop.call_at(loop.time() + max(0.0, delay_s), self._fire_timer, slot, slot.next_id(), causation, msg)

    def _fire_timer(self, slot: ActorSlot, msg_id: int, causation: int, msg: Any) -> None:
        if not slot.alive:
            return
        name = slot.name
        envelope = _new_envelope(msg_id, name, name, "", self.clock.now(), 0, causation, _TELL)
        try:
            self._route(envelope, msg)
        except Backpressure:
            # A timer must not vanish: try again shortly (the mailbox is the actor's own, so it drains).
            asyncio.get_running_loop().call_later(0.001, self._fire_timer, slot, msg_id, causation, msg)

    async def offload(self, fn: Callable[..., Any], *args: Any) -> Any:
        if self.config.offload_inline:
            return fn(*args)
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(self.config.offload_threads, f"{self.name}-compute")
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def request_topology_stop(self, slot: Any, reason: str, exit_code: int) -> None:
        self.send_from(slot, SUPERVISOR, StopTopology(reason, exit_code))

    def resolve_stop(self, reason: str, exit_code: int) -> None:
        """Called by the supervisor: the launcher waiting on `stop_requested` ends the run."""
        if self.stop_requested is not None and not self.stop_requested.done():
            self.stop_requested.set_result((reason, exit_code))

    # ---- clients (code outside the topology) ---------------------------------------------------------------------
    def tell(self, to: str, msg: Any) -> None:
        self.send_from(self._client, to, msg)

    def publish(self, msg: Any) -> None:
        self.publish_from(self._client, msg)

    async def ask(self, to: str, msg: Any, timeout_s: float | None = None) -> Any:
        return await self.ask_from(self._client, to, msg, timeout_s)

    def clock_loop_time(self) -> float:
        return asyncio.get_running_loop().time()

    # ---- receiving ------------------------------------------------------------------------------------------------
    def _deliver_local_nowait(self, envelope: Envelope, msg: Any, frames: tuple[bytes, bytes] | None = None) -> None:
        if envelope.kind == _REPLY:
            self._resolve(envelope, msg, frames)
            return
        slot = self.slots.get(envelope.receiver)
        if slot is None:
            raise UnknownAddress(f"{envelope.receiver!r} is not hosted on node {self.name}")
        if not slot.alive:
            self._refuse(slot, envelope, msg)
            return
        if self.fault_injector is not None and self._injected(slot, envelope, msg, frames):
            return
        self._enqueue(slot, envelope, msg, frames)

    def _injected(self, slot: ActorSlot, envelope: Envelope, msg: Any, frames: tuple[bytes, bytes] | None) -> bool:
        """Apply the fault plan to one delivery (gyre.runtime.faults); True when the plan took the message over."""
        action, delay_s = self.fault_injector.intercept(envelope, msg, self.clock.now())
        if action == "deliver" and delay_s <= 0:
            return False
        self.statistics[f"fault_{action}"] += 1
        if action == "kill":
            self._fail_actor(slot, InjectedFault(f"the fault plan killed {slot.name} at {type(msg).__name__}"))
        elif action == "duplicate":
            self._enqueue(slot, envelope, msg, frames)
            self._enqueue(slot, envelope, msg, frames)
        elif action == "deliver":  # late

            def arrive() -> None:
                if slot.alive:
                    try:
                        self._enqueue(slot, envelope, msg, frames)
                    except Backpressure:
                        self.statistics["fault_delayed_refused"] += 1

            asyncio.get_running_loop().call_later(delay_s, arrive)
        return True

    def _enqueue(self, slot: ActorSlot, envelope: Envelope, msg: Any, frames: tuple[bytes, bytes] | None) -> None:
        if self._shuffle is not None and frames is None:
            name = slot.name
            batched_for = self._batched_for
            pending = batched_for.get(name, 0)
            mailbox = slot.mailbox
            if len(mailbox._items) + pending >= mailbox.maxsize:
                raise Backpressure(f"mailbox of {name} is full ({mailbox.maxsize})")
            self._batch.append((envelope, msg))
            batched_for[name] = pending + 1
            if not self._flush_scheduled:
                self._flush_scheduled = True
                (self._loop or asyncio.get_running_loop()).call_soon(self._flush_batch)
            return
        try:
            slot.mailbox.put_nowait((envelope, msg, frames))
        except asyncio.QueueFull:
            raise Backpressure(f"mailbox of {slot.name} is full ({slot.mailbox.maxsize})") from None

    def _flush_batch(self) -> None:
        """Deliver the messages that became ready together in a seeded interleaving that keeps each sender's order."""
        self._flush_scheduled = False
        batch = self._batch
        self._batch = []
        self._batched_for.clear()
        getrandbits = self._shuffle.getrandbits
        slots = self.slots
        if len(batch) == 1:  # the common case under virtual time: one message, one sender (the draw is still made)
            while getrandbits(1):  # _randbelow(getrandbits, 1), inline: one bit at a time until a 0
                pass
            envelope, msg = batch[0]
            slot = slots[envelope.receiver]
            if slot.alive:
                slot.mailbox.put_nowait((envelope, msg, None))
            else:
                self._refuse(slot, envelope, msg)
            return
        by_sender: dict[str, collections.deque] = {}
        for item in batch:
            queue = by_sender.get(item[0].sender)
            if queue is None:
                by_sender[item[0].sender] = queue = collections.deque()
            queue.append(item)
        queues = [by_sender[name] for name in sorted(by_sender)]
        while queues:
            index = _randbelow(getrandbits, len(queues))
            queue = queues[index]
            envelope, msg = queue.popleft()
            if not queue:
                del queues[index]
            slot = slots[envelope.receiver]
            if slot.alive:
                slot.mailbox.put_nowait((envelope, msg, None))
            else:
                self._refuse(slot, envelope, msg)

    def _on_refused(self, why: str, endpoint: str) -> None:
        """A connection the transport refused (no CURVE, a key outside the run): nothing of it reached an actor."""
        self.statistics["refused_connections"] += 1
        count = self.statistics["refused_connections"]
        if count & (count - 1) == 0:  # 1, 2, 4, 8...: a peer retrying forever cannot flood the log
            log.warning("bus_connection_refused", node=self.name, why=why, endpoint=endpoint, refused=count)

    def _on_frames(self, frames: list[bytes], peer: str | None = None) -> Awaitable[None] | None:
        """A frame set from another node. Bad frames are logged and counted; an ask still gets an error reply.

        `peer` is the node the connection is authenticated as (None without authentication): a frame whose
        envelope names a sender that node does not host is forged (a member of the run posing as another) and is
        counted and dropped before its body is read; a forged ask gets no reply, which would go to the claimed
        sender. Returns None when the message was taken, or an awaitable that completes once a full mailbox had room
        for it: the transport reads nothing more until then, so the backpressure reaches ZeroMQ and the senders."""
        self.statistics["received"] += 1
        if len(frames) != 2:
            self.statistics["bad_frames"] += 1
            log.error("dropped_a_frame_set_of_the_wrong_shape", node=self.name, parts=len(frames))
            return None
        header, body = frames
        try:
            envelope, type_name, version = self.codec.decode_header(header)
        except CodecError as error:
            self.statistics["bad_frames"] += 1
            log.error("dropped_an_undecodable_header", node=self.name, error=str(error))
            return None
        if peer is not None and self.directory.actor_node.get(envelope.sender) != peer:
            self.statistics["forged_frames"] += 1
            count = self.statistics["forged_frames"]
            if count & (count - 1) == 0:  # 1, 2, 4, 8...: bounded, like refused connections
                log.error("dropped_a_frame_whose_sender_its_connection_does_not_host", node=self.name, peer=peer,
                          sender=envelope.sender, forged=count)
            return None
        try:
            msg = self.codec.decode_body(type_name, version, body)
        except CodecError as error:
            self.statistics["bad_frames"] += 1
            log.error("dropped_an_undecodable_body", node=self.name, type=type_name, error=str(error))
            if envelope.kind == _ASK:
                self._reply_error(envelope, type(error).__name__, str(error))
            elif envelope.kind == _REPLY:
                self._fail_pending(envelope.correlation_id, RemoteError(envelope.sender, type(error).__name__, str(error)))
            return None
        if envelope.kind == _REPLY:
            self._resolve(envelope, msg, (header, body))
            return None
        slot = self.slots.get(envelope.receiver)
        if slot is None:
            self.statistics["misrouted"] += 1
            log.error("message_for_an_actor_this_node_does_not_host", node=self.name, receiver=envelope.receiver)
            if envelope.kind == _ASK:
                self._reply_error(envelope, "UnknownAddress", f"{envelope.receiver} is not on node {self.name}")
            return None
        if not slot.alive:
            self._refuse(slot, envelope, msg)
            return None
        if slot.mailbox.consumer_waiting() and slot.task is not None and slot.status == "running":
            self._dispatch_now(slot, envelope, msg, (header, body))
            return None
        item = (envelope, msg, (header, body))
        try:
            slot.mailbox.put_nowait(item)
        except asyncio.QueueFull:
            return slot.mailbox.put(item)  # the transport waits for room: backpressure reaches the sender
        return None

    def _resolve(self, envelope: Envelope, msg: Any, frames: tuple[bytes, bytes] | None) -> None:
        if self.recorder is not None:
            self._record(envelope, msg, frames)
        entry = self._pending.get(envelope.correlation_id)
        if entry is None:
            self.statistics["late_replies"] += 1
            return
        future, target = entry
        if future.done():
            return
        if isinstance(msg, AskFailed):
            error_cls = _ERRORS_BY_NAME.get(msg.error_type)
            error = error_cls(msg.message) if error_cls else RemoteError(msg.actor, msg.error_type, msg.message)
            future.set_exception(error)
        else:
            future.set_result(msg)

    def _fail_pending(self, correlation_id: int, error: Exception) -> None:
        entry = self._pending.get(correlation_id)
        if entry is not None and not entry[0].done():
            entry[0].set_exception(error)

    def _reply(self, slot: Any, ask: Envelope, msg: Any) -> None:
        envelope = _new_envelope(
            slot.next_id(), slot.name, ask.sender, "", self.clock.now(), ask.msg_id, ask.msg_id, _REPLY
        )
        try:
            self._route(envelope, msg)
        except (UnknownAddress, Backpressure) as error:
            log.error("could_not_deliver_a_reply", actor=slot.name, to=ask.sender, error=str(error))

    def _reply_error(self, ask: Envelope, error_type: str, message: str) -> None:
        replier = self.slots.get(ask.receiver) or self._client
        self._reply(replier, ask, AskFailed(ask.receiver, error_type, message))

    def _refuse(self, slot: ActorSlot, envelope: Envelope, msg: Any) -> None:
        """A message for a stopped or dead actor: asks fail at once; tells are counted, and logged at the 1st, 2nd,
        4th, 8th... refusal for that actor."""
        if envelope.kind == _ASK:
            self._reply_error(envelope, "ActorDead", f"{slot.name} is {slot.status}")
        else:
            self.statistics["refused"] += 1
            self._refused_by_actor[slot.name] += 1
            count = self._refused_by_actor[slot.name]
            # 1, 2, 4, 8... a stopped actor's: while a topology stops, its published messages (a ModelCallCompleted
            # for every call) keep arriving at cells that stopped first, and one line each swamped a run's end.
            if count & (count - 1) == 0:
                log.warning("message_for_a_dead_actor", actor=slot.name, status=slot.status,
                            type=type(msg).__name__, refused=count)

    def _refuse_mailbox(self, slot: ActorSlot, why: str) -> None:
        while not slot.mailbox.empty():
            envelope, msg, frames = slot.mailbox.get_nowait()
            if msg is _STARTED:  # a handler started but never run: its ask is answered like a queued one
                frames.close()
                slot.current_msg_id, slot.current_envelope = 0, None
                if envelope.kind == _ASK:
                    self._reply_error(envelope, "ActorDead", f"{slot.name} is {slot.status}")
                continue
            self._refuse(slot, envelope, msg)

    def _record(self, envelope: Envelope, msg: Any, frames: tuple[bytes, bytes] | None) -> None:
        if self.recorder is None:
            return
        header, body = frames if frames is not None else self.codec.encode(envelope, msg)
        self.recorder.append(self.clock.now(), header, body)

    # ---- the mailbox loop -----------------------------------------------------------------------------------------
    async def _run_mailbox(self, slot: ActorSlot) -> None:
        mailbox = slot.mailbox
        items = mailbox._items
        loop = asyncio.get_running_loop()
        while True:
            if slot.restarting is not None and not slot.restarting.done():
                # The new instance's on_start comes before its first message (waiting before taking one, so a
                # restart that fails again cannot lose it).
                await asyncio.wait([slot.restarting])
                if not slot.alive:
                    return
            # Mailbox.get, inline: the coroutine it would create per message is a measurable share of a virtual run.
            while not items:
                getter = _Future(loop=loop)  # loop.create_future(), one call less
                mailbox._getter = getter
                try:
                    await getter
                finally:
                    if mailbox._getter is getter:
                        mailbox._getter = None
            envelope, msg, frames = items.popleft() if not mailbox._putters else mailbox.get_nowait()
            if msg is _STARTED:  # a handler the transport started while this loop was idle: finish it here
                running = frames
            else:
                running = self._dispatch(slot, envelope, msg, frames)
            if running is not None:
                await self._finish(slot, envelope, running)
            if not slot.alive:
                return

    def _dispatch(self, slot: ActorSlot, envelope: Envelope, msg: Any, frames: tuple[bytes, bytes] | None) -> Any:
        """Start handling one message: log it, find its handler, call it. Returns the coroutine of an async handler
        (the mailbox task awaits it, then `_finish`), or None when the message is done with."""
        recorder = self.recorder
        if recorder is not None:
            header, body = frames if frames is not None else self.codec.encode(envelope, msg)
            recorder.append(self.clock.now(), header, body)
        slot.handled += 1
        actor = slot.actor
        method_name = type(actor).handler_table.get(type(msg))
        if method_name is None:
            self.statistics["no_handler"] += 1
            if envelope.kind == _ASK:
                self._reply_error(envelope, "NoHandler", f"{slot.name} has no handler for {type(msg).__qualname__}")
            else:
                log.error("no_handler", actor=slot.name, type=type(msg).__qualname__, seq=envelope.msg_id)
            return None
        if self._debug:
            log.debug("handle", actor=slot.name, type=type(msg).__name__, seq=envelope.msg_id, sender=envelope.sender)
        slot.current_msg_id = envelope.msg_id
        slot.current_envelope = envelope
        try:
            result = getattr(actor, method_name)(msg)
        except Exception as error:
            self._handler_failed(slot, envelope, error)
            return None
        # Most handlers return None; asyncio.iscoroutine(None) walks an ABC check first.
        if result is not None and asyncio.iscoroutine(result):
            return result  # still the message being handled (current_msg_id stays) until _finish
        if envelope.kind == _ASK:
            self._handler_done(slot, envelope, result)
        else:  # _handler_done for a tell, inline (most messages)
            slot.current_msg_id, slot.current_envelope = 0, None
        return None

    async def _finish(self, slot: ActorSlot, envelope: Envelope, running: Any) -> None:
        try:
            result = await running
        except asyncio.CancelledError:
            slot.current_msg_id, slot.current_envelope = 0, None
            raise
        except Exception as error:
            self._handler_failed(slot, envelope, error)
        else:
            self._handler_done(slot, envelope, result)

    def _handler_done(self, slot: ActorSlot, envelope: Envelope, result: Any) -> None:
        slot.current_msg_id, slot.current_envelope = 0, None
        if envelope.kind == _ASK:
            if result is None or not hasattr(type(result), "__gyre_type__"):
                self._reply_error(envelope, "TypeError", f"handler returned {type(result).__name__}, not a message")
            else:
                self._reply(slot, envelope, result)

    def _handler_failed(self, slot: ActorSlot, envelope: Envelope, error: Exception) -> None:
        """An ask's error goes back to the asker and the actor goes on; a tell's error fails the actor."""
        slot.current_msg_id, slot.current_envelope = 0, None  # nothing left to answer for this message
        if envelope.kind == _ASK:
            self._reply_error(envelope, type(error).__name__, str(error))
        else:
            self._fail_actor(slot, error)

    def _dispatch_now(self, slot: ActorSlot, envelope: Envelope, msg: Any, frames: tuple[bytes, bytes]) -> None:
        """Handle a message from the transport right here, in the reader's callback, when the actor is idle.

        Handing it to the mailbox task would cost one more turn of the event loop (a system call) per message, a
        large share of a round trip between processes. It is the same handling, in the same order: the mailbox is
        empty and its task is parked waiting for mail, so no handler of this actor is running, and a sync handler
        runs to its end before anything else can. An async handler's coroutine goes to the mailbox task to finish,
        ahead of any later message.
        """
        running = self._dispatch(slot, envelope, msg, frames)
        if running is None:
            return
        if slot.alive and slot.task is not None:
            slot.mailbox.put_nowait((envelope, _STARTED, running))
        else:  # the actor ended while the handler started; its coroutine never runs
            running.close()

    def _fail_actor(self, slot: ActorSlot, error: BaseException) -> None:
        """Supervision: restart, stop, or escalate, by the actor's RestartPolicy.

        The failure comes either from a handler of a tell (we are in the mailbox task, which goes on with the next
        message) or from a background task or on_start (then a handler of the failed instance may still be running:
        it is cancelled, and if it was answering an ask, the asker gets an error reply instead of waiting forever).
        """
        if not slot.alive:  # e.g. a background task that raised while the actor was being stopped
            log.warning("failure_after_the_actor_ended", actor=slot.name, status=slot.status, error=repr(error))
            return
        policy: RestartPolicy = slot.spec.restart
        log.error("actor_failed", actor=slot.name, error=repr(error), restarts=slot.restarts, policy=policy.mode)
        self.statistics["failures"] += 1
        in_mailbox = slot.task is not None and asyncio.current_task() is slot.task
        interrupted = None if in_mailbox else slot.current_envelope
        if not in_mailbox and slot.task is not None:
            slot.task.cancel()  # the failed instance's handler (if any) must not go on; a restart starts a new loop
            slot.task = None
            head = slot.mailbox.peek()
            if head is not None and head[1] is _STARTED:  # a started handler of the failed instance: never runs
                slot.mailbox.get_nowait()
                head[2].close()
        for task in list(slot.children):
            task.cancel()
        if policy.mode == "restart" and slot.restarts < policy.max_restarts:
            slot.restarts += 1
            slot.incarnation += 1
            action = "restarted"
            slot.actor = slot.spec.actor_cls(slot)
            self._record_start(slot)
            restart = asyncio.get_running_loop().create_task(self._restart_hook(slot), name=f"{slot.name}.restart")
            slot.restarting = restart
            slot.children.add(restart)
            restart.add_done_callback(slot.children.discard)
        else:
            action = "stopped" if policy.mode == "stop_actor" else "escalated"
            slot.status = "dead"
            self._refuse_mailbox(slot, "dead")
            for entry_id, (future, target) in list(self._pending.items()):
                if target == slot.name and not future.done():
                    future.set_exception(ActorDead(f"{slot.name} died before answering"))
        if interrupted is not None and interrupted.kind == _ASK:
            if action == "restarted":
                self._reply_error(interrupted, type(error).__name__, f"{slot.name} failed and restarted: {error}")
            else:
                self._reply_error(interrupted, "ActorDead", f"{slot.name} died while answering: {error!r}")
        notice = ActorFailed(slot.name, type(error).__name__, str(error), slot.restarts, action)
        if slot.name != SUPERVISOR:
            try:
                self.send_from(self._client, SUPERVISOR, notice)
            except Exception as send_error:  # the supervisor unreachable must not hide the failure
                log.error("could_not_tell_the_supervisor", actor=slot.name, error=repr(send_error))

    async def _restart_hook(self, slot: ActorSlot) -> None:
        try:
            await slot.actor.on_start()
        except Exception as error:
            slot.restarting = None
            self._fail_actor(slot, error)
            return
        self._ensure_mailbox_task(slot)


def _randbelow(getrandbits: Callable[[int], int], n: int) -> int:
    """`random.Random.randrange(n)` for n >= 1, draw for draw: CPython's `_randbelow_with_getrandbits` (rejection
    sampling on `n.bit_length()` bits), without randrange's argument checks and two Python calls per message. The
    shuffled delivery order of a seed depends on it drawing exactly as randrange does (test_virtual_path.py)."""
    k = n.bit_length()
    r = getrandbits(k)
    while r >= n:
        r = getrandbits(k)
    return r


def _expire_ask(future: asyncio.Future, to: str, msg: Any, timeout_s: float) -> None:
    if not future.done():
        future.set_exception(AskTimeout(f"{to} did not answer {type(msg).__qualname__} within {timeout_s}s"))


def _debug_enabled() -> bool:
    """Whether per-message lines are on (checked once per mailbox loop, not per message)."""
    try:
        return bool(structlog.get_logger("gyre.runtime").is_enabled_for(10))
    except AttributeError:  # a logger without level filtering: say nothing per message
        return False


class _ClientIdentity:
    """The sender identity of code outside the topology (tests, CLIs) that talks through a node."""

    def __init__(self, name: str, index: int) -> None:
        self.name = name
        self.index = index
        self.sequence = 0
        self.current_msg_id = 0

    def next_id(self) -> int:
        self.sequence += 1
        return self.index * ID_STRIDE + self.sequence
