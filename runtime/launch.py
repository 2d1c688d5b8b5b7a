"""Launchers: put a Topology's actors somewhere and run them until the supervisor ends the run.

`Launcher` is the interface (`run(topology, options) -> exit status`); actors never know which one placed them.
- `InProcessLauncher`: every actor on one node in this process, real time (tests, small tools).
- `VirtualLauncher`: the deterministic runner: one process, virtual time, seeded delivery order; the same topology
  and seed give a byte-identical event log.
- `LocalProcessLauncher`: one OS process per `process` group, ZeroMQ over ipc:// (or tcp:// on 127.0.0.1) between
  them, CURVE-authenticated with a fresh key pair per process, a supervisor in the launcher's own process; clean
  shutdown on Ctrl-C or SIGTERM, no orphans (children die with the parent). A process that exits ends the run,
  unless its group is named in `restart_processes` and every actor of it is in RestartPolicy mode "restart": then
  it is started again (same endpoint and keys, up to the smallest `max_restarts` of its actors; its event-log
  segment continues in a new part). Named, not implied by the policies (as under Ray): a group whose actors keep
  the run's state (the task source, the claimer) starts empty in a new process, which would not continue the run.
- `RayLauncher` (runtime/ray_launcher.py, imported only when asked: importing ray takes seconds): each process
  group one Ray actor placed by a placement group, tcp:// + CURVE on each node's address.
"""

from __future__ import annotations

import asyncio
import ctypes
import multiprocessing
import os
import shutil
import signal
import socket
from pathlib import Path
from typing import Protocol

import attrs
import structlog

from gyre.runtime.clock import RealClock, VirtualClock
from gyre.runtime.codec import Codec
from gyre.runtime.cpu_limits import RunCpuGroups
from gyre.runtime.errors import ConfigError
from gyre.runtime.event_log import EventLogWriter, merge_segments
from gyre.runtime.node import Node, NodeConfig
from gyre.runtime.run_secrets import install_run_secret, run_secret
from gyre.runtime.supervisor import Supervisor, SupervisorConfig
from gyre.runtime.topology import SUPERVISOR, ActorSpec, Directory, RestartPolicy, Topology, load_topology_file
from gyre.runtime.virtual_loop import Quiescent, VirtualEventLoop
from gyre.runtime.zmq_transport import BusKeys, ZmqConfig, ZmqTransport, generate_bus_keys, ipc_socket_folder

log = structlog.get_logger("gyre.launch")

LAUNCHER_NODE = "launcher"

#: Environment variable that holds the address other machines reach this process's node at; the Ray launcher sets it
#: in each host (the node's address as Ray knows it), and children inherit it (an engine server).
NODE_ADDRESS_ENV = "GYRE_NODE_ADDRESS"
#: This machine, where no launcher said otherwise: every launcher but Ray's puts all processes on it.
LOCAL_ADDRESS = "127.0.0.1"


def node_address() -> str:
    """The address this process's node is reached at by the run's other nodes: what binds an engine server or a
    Mooncake endpoint (cells' `host`). `NODE_ADDRESS_ENV` where a launcher set it, else 127.0.0.1."""
    return os.environ.get(NODE_ADDRESS_ENV, "").strip() or LOCAL_ADDRESS


@attrs.frozen
class RunOptions:
    """How to run a topology."""

    log_path: str | None = None
    """Event log to write; None records nothing."""
    until_s: float | None = None
    """Stop after this much runtime-clock time (virtual seconds under the deterministic runner)."""
    node: NodeConfig = NodeConfig()
    """Bounds of every node."""


@attrs.frozen
class RunResult:
    """How a run ended."""

    exit_code: int
    reason: str

    @property
    def interrupted(self) -> bool:
        """Stopped by Ctrl-C or SIGTERM (the launchers exit with 128 + the signal's number): a `finish` step should
        save what the run made and skip long work the user did not wait for."""
        return self.exit_code in (128 + signal.SIGINT, 128 + signal.SIGTERM)


class Launcher(Protocol):
    def run(self, topology: Topology, options: RunOptions) -> RunResult: ...


def supervisor_spec() -> ActorSpec:
    return ActorSpec(SUPERVISOR, Supervisor, SupervisorConfig(), LAUNCHER_NODE, RestartPolicy("restart", 1000), 0)


def _single_node(topology: Topology, clock, options: RunOptions, node_config: NodeConfig) -> Node:
    codec = Codec()
    placement = {spec.name: LAUNCHER_NODE for spec in topology.specs}
    directory = Directory.build(topology, placement, {}, codec.type_name_of, LAUNCHER_NODE)
    recorder = EventLogWriter(options.log_path) if options.log_path else None
    node = Node(LAUNCHER_NODE, directory, clock=clock, codec=codec, recorder=recorder, config=node_config)
    node.add_actor(supervisor_spec(), topology.actor_seed(SUPERVISOR))
    for spec in topology.specs:
        node.add_actor(spec, topology.actor_seed(spec.name))
    return node


async def _run_node(node: Node, until_s: float | None) -> tuple[str, int]:
    await node.start()
    assert node.stop_requested is not None
    if until_s is not None:
        asyncio.get_running_loop().call_later(until_s, node.resolve_stop, f"time limit of {until_s}s reached", 0)
    return await node.stop_requested


def _warn_limits_not_applied(topology: Topology, launcher: str) -> None:
    if topology.cpu_cores_by_process:
        log.warning("cpu_limits_not_applied", launcher=launcher, limits=topology.cpu_cores_by_process,
                    why="one process runs every actor; only the local-process launcher limits process groups")


class InProcessLauncher:
    """All actors on one node in this process, in real time."""

    def run(self, topology: Topology, options: RunOptions = RunOptions()) -> RunResult:
        _warn_limits_not_applied(topology, "in-process")
        node = _single_node(topology, RealClock(), options, options.node)

        async def main() -> tuple[str, int]:
            loop = asyncio.get_running_loop()
            for signum in (signal.SIGINT, signal.SIGTERM):
                try:
                    loop.add_signal_handler(signum, node.resolve_stop, f"signal {signum}", 128 + signum)
                except (RuntimeError, ValueError):  # not the main thread
                    pass
            try:
                return await _run_node(node, options.until_s)
            finally:
                await node.stop()

        reason, code = asyncio.run(main())
        return RunResult(code, reason)


class VirtualLauncher:
    """The deterministic runner: one process, virtual time, seeded delivery order, compute inline."""

    def run(self, topology: Topology, options: RunOptions = RunOptions()) -> RunResult:
        clock = VirtualClock(0.0)
        node_config = attrs.evolve(options.node, shuffle_seed=topology.seed, offload_inline=True)
        node = _single_node(topology, clock, options, node_config)
        loop = VirtualEventLoop(clock)
        asyncio.set_event_loop(loop)
        try:
            try:
                reason, code = loop.run_until_complete(_run_node(node, options.until_s))
            except Quiescent:
                reason, code = "quiescent: no actor has anything left to do", 0
            loop.run_until_complete(node.stop())
        finally:
            asyncio.set_event_loop(None)
            loop.close()
        return RunResult(code, reason)


# ---- local processes ----------------------------------------------------------------------------------------------
def _die_with_parent() -> None:
    """Linux: deliver SIGTERM to this process when its parent dies, so a killed launcher leaves no orphans."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _name_process(process: str) -> None:
    """Linux: name this process gyre:<group> (/proc/PID/comm, what top and ps -o comm show), so the processes of a
    run can be told apart (benchmarks/studies/cpu_by_process.py sums their CPU by kind); spawn gives them all
    python's. The kernel keeps 15 bytes."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(15, f"gyre:{process}".encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except OSError:
        pass


def _child_main(
    topology_file: str, argv: list[str], seed: int | None, process: str, endpoints: dict[str, str],
    log_dir: str | None, node_config: NodeConfig, secret: bytes, bus_keys: BusKeys, zmq_config: ZmqConfig,
    incarnation: int = 0,
) -> None:
    _die_with_parent()
    _name_process(process)
    # The secret and this process's bus keys come through the spawn pipe, never the environment, argv or a config
    # (see runtime/run_secrets.py and runtime/zmq_transport.py).
    install_run_secret(secret)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the launcher, which stops us in order
    from gyre.runtime.logs import configure_logging

    configure_logging()
    topology = load_topology_file(topology_file, argv)
    if seed is not None:
        topology.seed = seed
    codec = Codec()
    placement = {spec.name: spec.process for spec in topology.specs}
    directory = Directory.build(topology, placement, endpoints, codec.type_name_of, LAUNCHER_NODE)
    transport = ZmqTransport(endpoints[process], endpoints, zmq_config, bus_keys)
    segment = f"{process}.glog" if not incarnation else f"{process}.r{incarnation}.glog"
    recorder = EventLogWriter(Path(log_dir) / segment) if log_dir else None
    node = Node(process, directory, clock=RealClock(), codec=codec, transport=transport, recorder=recorder,
                config=node_config)
    for spec in topology.processes()[process]:
        node.add_actor(spec, topology.actor_seed(spec.name))

    async def main() -> None:
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        await node.start()
        flusher = asyncio.get_running_loop().create_task(_flush_periodically(node))
        await stop.wait()
        flusher.cancel()
        await node.stop()

    asyncio.run(main())


async def _flush_periodically(node: Node, every_s: float = 0.5) -> None:
    while True:
        await asyncio.sleep(every_s)
        if node.recorder is not None:
            node.recorder.flush()


def _free_loopback_ports(count: int) -> list[int]:
    """`count` distinct TCP ports on 127.0.0.1 that nothing listens on now (the probes stay open together, so the
    kernel cannot hand one port out twice). Another process may take one before its node binds it: that node then
    fails to start and the run ends with its exit status, never silently on another port."""
    probes = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(count)]
    try:
        for probe in probes:
            probe.bind(("127.0.0.1", 0))
        return [probe.getsockname()[1] for probe in probes]
    finally:
        for probe in probes:
            probe.close()


def _bus_endpoints(scheme: str, run_dir: Path, groups: list[str]) -> dict[str, str]:
    """Node name -> the endpoint it binds: ipc:// files in the run's 0700 folder, or loopback TCP ports."""
    names = [*sorted(groups), LAUNCHER_NODE]
    if scheme == "ipc":
        files = {name: f"{index}.sock" for index, name in enumerate(sorted(groups))}
        files[LAUNCHER_NODE] = "launcher.sock"
        return {name: f"ipc://{run_dir}/{files[name]}" for name in names}
    return {name: f"tcp://127.0.0.1:{port}" for name, port in zip(names, _free_loopback_ports(len(names)))}


def _check_bus(instance: object, attribute: attrs.Attribute, value: str) -> None:
    if value not in ("ipc", "tcp"):
        raise ConfigError(f"{attribute.name} must be 'ipc' or 'tcp', got {value!r}")


@attrs.frozen
class LocalProcessLauncher:
    """One OS process per process group of the topology; the topology file is re-imported in each child."""

    topology_file: str
    argv: tuple[str, ...] = ()
    seed: int | None = None
    stop_timeout_s: float = 10.0
    bus: str = attrs.field(default="ipc", validator=_check_bus)
    """"ipc": sockets in a private folder; "tcp": loopback ports (what a run across machines uses, on one). CURVE
    on both (tcp always; ipc unless `zmq_config.curve_on_ipc` is off)."""
    zmq_config: ZmqConfig = ZmqConfig()
    """Socket bounds and CURVE on ipc, the same in every process of the run."""
    restart_processes: tuple[str, ...] = ()
    """Process groups started again when they die and their actors' restart policies allow it (module docstring),
    e.g. the satellites; any other process that exits ends the run."""

    def run(self, topology: Topology, options: RunOptions = RunOptions()) -> RunResult:
        cpu_groups = RunCpuGroups(topology.cpu_cores_by_process)
        cpu_groups.create()  # before anything starts: a machine that cannot limit CPU fails the run here
        try:
            return self._run(topology, options, cpu_groups)
        finally:
            cpu_groups.remove()

    def _run(self, topology: Topology, options: RunOptions, cpu_groups: RunCpuGroups) -> RunResult:
        run_dir = ipc_socket_folder("gyre-run-")  # mode 0700: the ipc:// socket files are 0600 in it
        groups = topology.processes()
        endpoints = _bus_endpoints(self.bus, run_dir, list(groups))
        # One fresh pair per process, handed through the spawn pipe: a child holds only its own secret key, so a
        # connection authenticated as node P is P (zmq_transport.py).
        bus_keys = generate_bus_keys(endpoints)
        parts_dir = Path(options.log_path + ".parts") if options.log_path else None
        if parts_dir is not None:
            shutil.rmtree(parts_dir, ignore_errors=True)
            parts_dir.mkdir(parents=True)
        context = multiprocessing.get_context("spawn")

        def child(name: str, incarnation: int = 0) -> multiprocessing.Process:
            return context.Process(
                target=_child_main,
                args=(self.topology_file, list(self.argv), self.seed, name, endpoints,
                      str(parts_dir) if parts_dir else None, options.node, run_secret(), bus_keys[name],
                      self.zmq_config, incarnation),
                name=f"gyre:{name}",
                daemon=False,
            )

        children = {name: child(name) for name in sorted(groups)}
        restarts: dict[str, int] = {}

        def restart(name: str) -> bool:
            """Start a dead group again if it may be (module docstring); False when the run must end."""
            specs = groups[name]
            allowed = min(spec.restart.max_restarts for spec in specs)
            if name not in self.restart_processes or any(spec.restart.mode != "restart" for spec in specs):
                return False
            if restarts.get(name, 0) >= allowed:
                return False
            restarts[name] = restarts.get(name, 0) + 1
            fresh = children[name] = child(name, restarts[name])
            fresh.start()
            assert fresh.pid is not None
            cpu_groups.add_process(name, fresh.pid)
            log.warning("process_group_restarted", process=name, restarts=restarts[name], allowed=allowed,
                        pid=fresh.pid)
            return True

        codec = Codec()
        placement = {spec.name: spec.process for spec in topology.specs}
        directory = Directory.build(topology, placement, endpoints, codec.type_name_of, LAUNCHER_NODE)
        transport = ZmqTransport(endpoints[LAUNCHER_NODE], endpoints, self.zmq_config, bus_keys[LAUNCHER_NODE])
        recorder = EventLogWriter(parts_dir / f"{LAUNCHER_NODE}.glog") if parts_dir else None
        node = Node(LAUNCHER_NODE, directory, clock=RealClock(), codec=codec, transport=transport,
                    recorder=recorder, config=options.node)
        node.add_actor(supervisor_spec(), topology.actor_seed(SUPERVISOR))

        async def main() -> tuple[str, int]:
            loop = asyncio.get_running_loop()
            for signum in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(signum, node.resolve_stop, f"signal {signal.Signals(signum).name}", 128 + signum)
            await node.start()
            watcher = loop.create_task(self._watch_children(node, children, restart))
            try:
                for name, child in children.items():
                    child.start()
                    assert child.pid is not None
                    cpu_groups.add_process(name, child.pid)
                if options.until_s is not None:
                    loop.call_later(options.until_s, node.resolve_stop, f"time limit of {options.until_s}s reached", 0)
                assert node.stop_requested is not None
                return await node.stop_requested
            finally:
                watcher.cancel()
                await self._stop_children(children)
                await node.stop()

        try:
            reason, code = asyncio.run(main())
        finally:
            for child in children.values():
                if child.is_alive():
                    child.kill()
                    child.join(timeout=5.0)
            shutil.rmtree(run_dir, ignore_errors=True)
        if parts_dir is not None and options.log_path:
            report = merge_segments(sorted(parts_dir.glob("*.glog")), Path(options.log_path))
            if report.torn_tail_bytes:
                log.warning("a_process_left_a_torn_record_it_was_skipped", bytes=report.torn_tail_bytes)
            shutil.rmtree(parts_dir, ignore_errors=True)
        return RunResult(code, reason)

    @staticmethod
    async def _watch_children(node: Node, children: dict[str, multiprocessing.Process], restart) -> None:
        while True:
            await asyncio.sleep(0.2)
            for name, child in list(children.items()):
                if child.exitcode is None:
                    continue
                code = child.exitcode
                log.error("process_group_exited", process=name, status=code)
                child.join(timeout=1.0)
                if not restart(name):
                    node.resolve_stop(f"process {name} exited with status {code}", 1)
                    return

    async def _stop_children(self, children: dict[str, multiprocessing.Process]) -> None:
        for child in children.values():
            if child.is_alive():
                os.kill(child.pid, signal.SIGTERM)
        deadline = asyncio.get_running_loop().time() + self.stop_timeout_s
        while any(child.is_alive() for child in children.values()):
            if asyncio.get_running_loop().time() > deadline:
                for child in children.values():
                    if child.is_alive():
                        log.error("process_did_not_stop_in_time_killing_it", process=child.name)
                        child.kill()
                break
            await asyncio.sleep(0.05)
        for child in children.values():
            if child.pid is not None:
                child.join(timeout=1.0)
