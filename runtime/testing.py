"""Public test helpers (trio.testing, structlog.testing): run a topology with a driver coroutine, capture logs.

`run_actors(topology, driver, transport=...)` starts the topology's actors in this process, hands the driver a
`Harness` (a client identity inside the topology plus views of the nodes), and stops everything when the driver
returns. The same test runs over every transport by changing one argument, which is what the `transport` fixture
of the runtime's tests does:

- "inproc": one node, real time; messages move through in-memory mailboxes.
- "zmq": one node per process group of the topology plus a "launcher" node (supervisor and driver), each with its
  own ZeroMQ transport over ipc://, all on this process's event loop. Every message between groups is encoded,
  crosses a real socket and is decoded, as in a multi-process run, but a test can still look inside every node.
- "virtual": the deterministic runner's set-up (one node, virtual time, seeded delivery order, offload inline).

The driver is an `async def driver(h: Harness)`; whatever it returns comes back in `ActorsRun.value`.

`gyre_cli(argv)` runs the runtime's own subcommands (run, replay, log) the way `gyre` does, without importing the
other layers' plug-ins (which the full command line loads, at seconds per call).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import logging
import shutil
from pathlib import Path
from typing import Any, Awaitable, Callable, Iterator, Mapping

import attrs
import structlog

from gyre.runtime.actor import Actor
from gyre.runtime.clock import RealClock, VirtualClock
from gyre.runtime.codec import Codec
from gyre.runtime.event_log import EventLogWriter, ReadReport, merge_segments
from gyre.runtime.fault_run import FaultRun, run_with_faults
from gyre.runtime.launch import LAUNCHER_NODE, supervisor_spec
from gyre.runtime.node import Node, NodeConfig
from gyre.runtime.topology import SUPERVISOR, Directory, Topology
from gyre.runtime.virtual_loop import VirtualEventLoop
from gyre.runtime.zmq_transport import ZmqConfig, ZmqTransport, ipc_socket_folder

__all__ = ["TRANSPORTS", "ActorsRun", "FaultRun", "Harness", "capture_logs", "gyre_cli", "run_actors",
           "run_with_faults"]

#: The transports `run_actors` knows; tests parametrize over these.
TRANSPORTS = ("inproc", "virtual", "zmq")


@attrs.frozen
class ActorsRun:
    """How a `run_actors` call ended."""

    value: Any
    """What the driver returned."""
    stop_reason: str | None
    """Why the topology asked to stop (supervisor escalation, `stop_topology`), None if it never did."""
    exit_code: int | None
    """The exit status that came with the stop request, None if there was none."""
    statistics: dict[str, dict[str, int]]
    """Per node: the node's counters (sent, received, bad_frames, refused, failures, ...) at the end."""
    log_report: ReadReport | None = None
    """What merging the event log segments found (zmq runs with a log only)."""


class Harness:
    """What a driver gets: a client inside the topology (tell/ask/send/publish) and read-only views of the nodes."""

    def __init__(self, transport: str, nodes: dict[str, Node], client_node: Node, endpoints: dict[str, str]) -> None:
        self.transport = transport
        self.nodes = nodes
        self._client_node = client_node
        self._endpoints = endpoints

    # ---- talking to actors ----------------------------------------------------------------------------------------
    def tell(self, to: str, msg: Any) -> None:
        """Send without waiting (UnknownAddress, Backpressure as for an actor)."""
        self._client_node.tell(to, msg)

    async def send(self, to: str, msg: Any, timeout_s: float | None = None) -> None:
        """Send, waiting while the receiver's queue is full."""
        await self._client_node.send_waiting(self._client_node._client, to, msg, timeout_s)  # noqa: SLF001

    def publish(self, msg: Any) -> None:
        self._client_node.publish(msg)

    async def ask(self, to: str, msg: Any, timeout_s: float | None = None) -> Any:
        """Ask and wait for the reply (AskTimeout, ActorDead, NoHandler, RemoteError as for an actor)."""
        return await self._client_node.ask(to, msg, timeout_s)

    # ---- looking inside -------------------------------------------------------------------------------------------
    def node_of(self, actor: str) -> Node:
        for node in self.nodes.values():
            if actor in node.slots:
                return node
        raise KeyError(f"no node hosts an actor named {actor!r}")

    def actor(self, name: str) -> Actor:
        """The live instance of an actor (a new one after each restart)."""
        instance = self.node_of(name).slots[name].actor
        if instance is None:
            raise KeyError(f"{name} has not started")
        return instance

    def status(self, name: str) -> str:
        """"new", "running", "stopped" or "dead"."""
        return self.node_of(name).slots[name].status

    def endpoint(self, node: str) -> str:
        """The ZeroMQ endpoint a node binds (zmq transport only): where a test can push raw frames."""
        if node not in self._endpoints:
            raise KeyError(f"node {node!r} has no ZeroMQ endpoint in a {self.transport} run")
        return self._endpoints[node]

    def statistics(self) -> collections.Counter:
        """The counters of every node, summed."""
        total: collections.Counter = collections.Counter()
        for node in self.nodes.values():
            total.update(node.statistics)
        return total

    def now(self) -> float:
        """The runtime clock (virtual seconds under the virtual transport)."""
        return self._client_node.clock.now()

    async def wait_stopped(self, timeout_s: float = 10.0) -> tuple[str, int]:
        """Wait until the topology asks to stop (supervisor escalation, an actor's stop_topology); (reason, code)."""
        stop = self.nodes[LAUNCHER_NODE].stop_requested
        assert stop is not None, "the nodes have not started"
        try:
            return await asyncio.wait_for(asyncio.shield(stop), timeout_s)
        except asyncio.TimeoutError:
            raise TimeoutError(f"the topology did not ask to stop within {timeout_s}s") from None

    async def wait_until(self, predicate: Callable[[], bool], timeout_s: float = 10.0, what: str = "") -> None:
        """Poll `predicate` until it holds; TimeoutError (naming `what`) if it does not within `timeout_s`."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        delay_s = 0.001
        while not predicate():
            if loop.time() >= deadline:
                raise TimeoutError(f"waited {timeout_s}s for {what or predicate!r}")
            await asyncio.sleep(delay_s)
            delay_s = min(delay_s * 2, 0.05)


Driver = Callable[[Harness], Awaitable[Any]]


def run_actors(
    topology: Topology,
    driver: Driver,
    *,
    transport: str = "inproc",
    log_path: str | Path | None = None,
    node_config: NodeConfig = NodeConfig(),
    zmq_config: ZmqConfig = ZmqConfig(),
    codecs: Mapping[str, Codec] | None = None,
    timeout_s: float = 30.0,
) -> ActorsRun:
    """Run `topology` in this process, call `driver(harness)`, stop every node when it returns; see the module doc.

    `codecs` maps node names to the codec that node uses (default: every registered class), so a test can give two
    nodes different views of the message registry (an unknown type, another schema version). Under "zmq" the node
    names are the topology's process groups plus "launcher"; otherwise the single node is "launcher". A driver that
    runs longer than `timeout_s` (runtime-clock seconds) raises TimeoutError; the nodes are stopped either way.
    """
    if transport not in TRANSPORTS:
        raise ValueError(f"unknown transport {transport!r}; choose one of {TRANSPORTS}")
    codecs = dict(codecs or {})
    if transport == "virtual":
        node_config = attrs.evolve(node_config, shuffle_seed=topology.seed, offload_inline=True)
    run_dir = ipc_socket_folder("gyre-test-") if transport == "zmq" else None
    placement = {
        spec.name: (spec.process if transport == "zmq" else LAUNCHER_NODE) for spec in topology.specs
    }
    node_names = sorted(set(placement.values()) | {LAUNCHER_NODE})
    endpoints = (
        {name: f"ipc://{run_dir}/{number}.sock" for number, name in enumerate(node_names)} if run_dir else {}
    )
    log_path = Path(log_path) if log_path is not None else None
    parts_dir = Path(str(log_path) + ".parts") if (log_path is not None and transport == "zmq") else None
    if parts_dir is not None:
        shutil.rmtree(parts_dir, ignore_errors=True)
        parts_dir.mkdir(parents=True)
    clock = VirtualClock(0.0) if transport == "virtual" else RealClock()
    directory = Directory.build(topology, placement, endpoints, Codec().type_name_of, LAUNCHER_NODE)
    specs_by_node: dict[str, list] = collections.defaultdict(list)
    for spec in topology.specs:
        specs_by_node[placement[spec.name]].append(spec)

    def build_nodes() -> dict[str, Node]:
        nodes: dict[str, Node] = {}
        for name in node_names:
            if parts_dir is not None:
                recorder = EventLogWriter(parts_dir / f"{name}.glog")
            elif log_path is not None:
                recorder = EventLogWriter(log_path)
            else:
                recorder = None
            node = Node(
                name,
                directory,
                clock=clock,
                codec=codecs.get(name) or Codec(),
                transport=ZmqTransport(endpoints[name], endpoints, zmq_config) if run_dir else None,
                recorder=recorder,
                config=node_config,
            )
            if name == LAUNCHER_NODE:
                node.add_actor(supervisor_spec(), topology.actor_seed(SUPERVISOR))
            for spec in specs_by_node.get(name, ()):
                node.add_actor(spec, topology.actor_seed(spec.name))
            nodes[name] = node
        return nodes

    async def main() -> ActorsRun:
        nodes = build_nodes()
        harness = Harness(transport, nodes, nodes[LAUNCHER_NODE], endpoints)
        try:
            for node in nodes.values():
                await node.start()
            # Not wait_for: its TimeoutError would be confused with the driver's own (AskTimeout is one).
            task = asyncio.ensure_future(driver(harness))
            done, _ = await asyncio.wait([task], timeout=timeout_s)
            if not done:
                task.cancel()
                await asyncio.wait([task])
                raise TimeoutError(f"the driver did not finish within {timeout_s}s")
            value = task.result()
        finally:
            for node in nodes.values():
                await node.stop()
        stop = nodes[LAUNCHER_NODE].stop_requested
        reason, code = stop.result() if stop is not None and stop.done() else (None, None)
        return ActorsRun(value, reason, code, {name: dict(node.statistics) for name, node in nodes.items()})

    try:
        if transport == "virtual":
            loop = VirtualEventLoop(clock)  # type: ignore[arg-type]
            asyncio.set_event_loop(loop)
            try:
                result = loop.run_until_complete(main())
            finally:
                asyncio.set_event_loop(None)
                loop.close()
        else:
            result = asyncio.run(main())
    finally:
        if run_dir is not None:
            shutil.rmtree(run_dir, ignore_errors=True)
    if parts_dir is not None and log_path is not None:
        report = merge_segments(sorted(parts_dir.glob("*.glog")), log_path)
        shutil.rmtree(parts_dir, ignore_errors=True)
        result = attrs.evolve(result, log_report=report)
    return result


@contextlib.contextmanager
def capture_logs(level: int = logging.DEBUG) -> Iterator[list[dict[str, Any]]]:
    """Collect every structlog event at `level` or above emitted inside the block, as dicts, then restore the config.

    Loggers bound before the block (an actor's `self.log` is bound when the actor is built) keep their old
    configuration: start the actors inside the block.
    """
    events: list[dict[str, Any]] = []

    def keep(logger: Any, method_name: str, event_dict: dict[str, Any]) -> Any:
        event_dict.setdefault("level", method_name)
        events.append(dict(event_dict))
        raise structlog.DropEvent

    saved = structlog.get_config()
    structlog.configure(
        processors=[structlog.contextvars.merge_contextvars, keep],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        cache_logger_on_first_use=False,
    )
    try:
        yield events
    finally:
        structlog.configure(**saved)


def gyre_cli(argv: list[str]) -> int:
    """`gyre ARGV` for the runtime's subcommands only (run, replay, log); everything after "--" goes to the
    topology, as with `gyre`. Returns the exit status. Usable in-process or as `python -c` in a subprocess."""
    from gyre.runtime import cli_log, cli_replay, cli_run

    argv = list(argv)
    passthrough: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, passthrough = argv[:cut], argv[cut + 1 :]
    parser = argparse.ArgumentParser(prog="gyre")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in (cli_run, cli_replay, cli_log):
        module.register(commands)
    args, extra = parser.parse_known_args(argv)
    if extra and not getattr(args, "accepts_extra_args", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.passthrough = extra + passthrough  # as `gyre`: a command that takes extra arguments hands them on
    return int(args.func(args) or 0)
