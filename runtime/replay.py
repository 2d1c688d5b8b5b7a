"""Replay: rebuild one actor from its recorded config and re-feed its recorded inbox in virtual time.

The log holds every delivered message in the order its receiver handled it, plus an ActorStarted record with the
actor's class, config and seed. Replay builds the actor on a node whose sends are captured instead of delivered,
sets the virtual clock to each record's handled-at time, feeds the record (asks, tells, events, the actor's own
timers and the replies to its asks, exactly as they came), and lets the actor run until it settles. Then it
compares what the actor sent with what the log says it sent, message by message in id order: same kind, same
receiver (or topic), same type, same body bytes. Time stamps are not compared.

Replay is exact for deterministic runs (`gyre run --virtual`). In a real-time run, a handler that reads the clock
after awaiting compute saw a later time than replay gives it; outputs that depend on that can differ.

A log is data: the classes it names (the actor's and its config's) load only through `config_codec.load_class`,
that is from gyre itself, from files the caller names (`code_paths`, `gyre replay --code PATH`) and from files under
the current directory whose SHA-256 matches the one the run recorded; the actor class must be a `gyre.runtime.Actor`.
A log from before ActorStarted version 2 records no hashes: its start records are read from their version-1 fields,
so its gyre actors replay as before, and one defined in a topology file replays when that file is named with --code.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any, Iterable

import attrs

from gyre.messages.runtime_control import ActorStarted
from gyre.runtime.actor import Actor
from gyre.runtime.clock import VirtualClock
from gyre.runtime.codec import Codec
from gyre.runtime.config_codec import CodeTrust, decode_config, load_class
from gyre.runtime.envelope import Envelope, Kind
from gyre.runtime.errors import CodecError, ReplayError
from gyre.runtime.event_log import EventLogError, LogRecord, ReadReport, read_log
from gyre.runtime.node import Node, NodeConfig
from gyre.runtime.topology import ActorSpec, Directory, RestartPolicy
from gyre.runtime.virtual_loop import Quiescent, VirtualEventLoop

_REPLAY_NODE = "replay"
_ELSEWHERE = "elsewhere"


@attrs.frozen(slots=True)
class _ActorStartedV1:
    """ActorStarted as logs before version 2 hold it (no source hash); decoded by a codec of its own."""

    actor: str
    class_path: str
    source_path: str
    config_blob: bytes
    seed: int
    index: int
    subscriptions: tuple[str, ...]
    incarnation: int


_ActorStartedV1.__gyre_type__ = ActorStarted.__gyre_type__  # type: ignore[attr-defined]
_ActorStartedV1.__gyre_version__ = 1  # type: ignore[attr-defined]
_V1_CODEC = Codec([_ActorStartedV1])


def _start_record(record: LogRecord, codec: Codec) -> ActorStarted:
    if record.version == 1:
        old = _V1_CODEC.decode_body(record.type_name, 1, record.body)
        return ActorStarted(old.actor, old.class_path, old.source_path, "", old.config_blob, old.seed, old.index,
                            old.subscriptions, old.incarnation)
    return record.decode(codec)


@attrs.frozen
class Output:
    """One message the actor sent, in a comparable form."""

    msg_id: int
    kind: str
    to: str
    type_name: str
    body: bytes
    summary: str

    def same_as(self, other: "Output") -> bool:
        return (self.kind, self.to, self.type_name, self.body) == (other.kind, other.to, other.type_name, other.body)


@attrs.frozen
class ReplayResult:
    """What replay found."""

    actor: str
    inbox_size: int
    compared: int
    identical: bool
    expected: Output | None = None
    got: Output | None = None
    position: int = -1
    """Index (0-based) of the first differing output, -1 when identical."""
    unverified: int = 0
    """Outputs replay produced after the log's last recorded one (sent but never delivered before the run ended)."""


def _output(codec: Codec, envelope: Envelope, type_name: str, body: bytes, msg: Any) -> Output:
    to = envelope.topic if envelope.kind == Kind.EVENT else envelope.receiver
    return Output(envelope.msg_id, envelope.kind.name, to, type_name, body, repr(msg))


def replay_actor(
    log_path: str | Path, actor: str, codec: Codec | None = None, code_paths: Iterable[str | os.PathLike] = (),
) -> ReplayResult:
    """Replay `actor` from the log at `log_path`; `code_paths` are files or folders whose code the caller trusts
    as it is now (see the module docstring for what loads without them)."""
    codec = codec or Codec()
    trust = CodeTrust(tuple(code_paths))
    report = ReadReport()
    try:
        records = list(read_log(log_path, codec, report))
    except (EventLogError, OSError) as error:
        raise ReplayError(f"cannot read the log: {error}") from error
    start: ActorStarted | None = None
    start_s = 0.0
    started_type = codec.type_name_of(ActorStarted)
    for record in records:
        if record.type_name == started_type and record.envelope.receiver == actor:
            try:
                started = _start_record(record, codec)
            except CodecError as error:
                raise ReplayError(f"the start record of {actor} cannot be read: {error}") from error
            if started.incarnation == 0:
                start, start_s = started, record.handled_s
                break
    if start is None:
        raise ReplayError(f"the log has no start record for an actor named {actor!r}")
    try:
        actor_cls = load_class(start.class_path, start.source_path, start.source_sha256, trust)
        config = decode_config(start.config_blob, trust)
    except CodecError as error:
        raise ReplayError(f"cannot rebuild {actor}: {error}") from error
    if not issubclass(actor_cls, Actor):
        raise ReplayError(f"cannot rebuild {actor}: {start.class_path} is not an actor class")

    # decoded before the run, so that a bad record stops replay before any actor code runs
    inbox = [(r, _decoded(r, codec)) for r in records if r.envelope.receiver == actor and r.type_name != started_type]
    expected: dict[int, Output] = {}
    for record in records:
        if record.envelope.sender == actor and record.envelope.msg_id not in expected:
            msg = _decoded(record, codec)
            expected[record.envelope.msg_id] = _output(codec, record.envelope, record.type_name, record.body, msg)

    got = _run(actor, actor_cls, config, start, start_s, inbox, records, codec)
    ordered_expected = [expected[k] for k in sorted(expected)]
    last_expected = ordered_expected[-1].msg_id if ordered_expected else 0
    compared = 0
    for position, produced in enumerate(got):
        if position >= len(ordered_expected):
            if produced.msg_id > last_expected:
                return ReplayResult(actor, len(inbox), compared, True, unverified=len(got) - position)
            return ReplayResult(actor, len(inbox), compared, False, None, produced, position)
        wanted = ordered_expected[position]
        if wanted.msg_id != produced.msg_id or not wanted.same_as(produced):
            return ReplayResult(actor, len(inbox), compared, False, wanted, produced, position)
        compared += 1
    if len(got) < len(ordered_expected):
        return ReplayResult(actor, len(inbox), compared, False, ordered_expected[len(got)], None, len(got))
    return ReplayResult(actor, len(inbox), compared, True)


def _run(
    actor: str, actor_cls: type, config: Any, start: ActorStarted, start_s: float,
    inbox: list[tuple[LogRecord, Any]], records: list[LogRecord], codec: Codec,
) -> list[Output]:
    names = {r.envelope.sender for r in records} | {r.envelope.receiver for r in records}
    actor_node = {name: _ELSEWHERE for name in names if name}
    actor_node[actor] = _REPLAY_NODE
    directory = Directory(actor_node, {actor: start.index}, {}, {})
    clock = VirtualClock(start_s)
    node = Node(
        _REPLAY_NODE, _with_client(directory), clock=clock, codec=codec,
        config=NodeConfig(offload_inline=True, mailbox_size=max(16, len(inbox) + 1)),
    )
    spec = ActorSpec(actor, actor_cls, config, _REPLAY_NODE, RestartPolicy("restart", 1_000_000), start.index)
    slot = node.add_actor(spec, start.seed)
    captured: list[tuple[Envelope, Any]] = []
    node._capture = captured  # noqa: SLF001 - replay is the runtime's own tool

    async def feed() -> None:
        await node.start()
        loop = asyncio.get_running_loop()
        for record, msg in inbox:
            delay = record.handled_s - clock.now()
            if delay > 0:
                await asyncio.sleep(delay)
            clock.set(record.handled_s)
            node._deliver_local_nowait(record.envelope, msg)  # noqa: SLF001
            await _settle(loop)
        await _settle(loop)

    loop = VirtualEventLoop(clock)
    asyncio.set_event_loop(loop)
    try:
        try:
            loop.run_until_complete(feed())
        except Quiescent:
            pass
        node._capture = None  # noqa: SLF001
        loop.run_until_complete(node.stop())
    finally:
        asyncio.set_event_loop(None)
        loop.close()
    del slot
    outputs = []
    for envelope, msg in sorted(captured, key=lambda pair: pair[0].msg_id):
        if envelope.sender != actor:  # e.g. the node's own notice to the supervisor
            continue
        outputs.append(_output(codec, envelope, codec.type_name_of(type(msg)), codec.encode_body(msg), msg))
    return outputs


def _decoded(record: LogRecord, codec: Codec) -> Any:
    try:
        return record.decode(codec)
    except CodecError as error:
        envelope = record.envelope
        raise ReplayError(f"a {record.type_name} record from {envelope.sender} to {envelope.receiver} (id "
                          f"{envelope.msg_id}) cannot be decoded: {error}") from error


def _with_client(directory: Directory) -> Directory:
    from gyre.runtime.topology import CLIENT_INDEX_BASE, client_name

    actor_node = dict(directory.actor_node)
    actor_index = dict(directory.actor_index)
    actor_node[client_name(_REPLAY_NODE)] = _REPLAY_NODE
    actor_index[client_name(_REPLAY_NODE)] = CLIENT_INDEX_BASE + 999
    return Directory(actor_node, actor_index, directory.subscribers, directory.node_endpoint)


async def _settle(loop: asyncio.AbstractEventLoop, rounds: int = 8) -> None:
    """Let ready callbacks run until none is left (handlers finish or block on something in the log)."""
    for _ in range(rounds):
        await asyncio.sleep(0)
    ready = getattr(loop, "_ready", None)
    while ready:
        await asyncio.sleep(0)
