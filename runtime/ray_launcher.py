"""The Ray launcher: each process group of a topology is one Ray actor, placed by a Ray placement group; the bus
between them is ZeroMQ over tcp:// + CURVE on each node's address; the supervisor runs in the launcher's process.

Placement. `Topology.placement_units()` turns the topology into units that must share a node: each `Topology.pack`
(a cell and its engine processes) and each process group left over. One placement group holds one bundle per unit,
the sum of its groups' `Topology.resources` (1 CPU each when undeclared); a bundle is always on one node, so a
unit's groups share one, and the placement group's strategy (`Topology.place_packs`, default SPREAD) spreads units
over nodes. Each group's Ray actor asks for its own resources inside its unit's bundle. This is how verl's
`RayResourcePool` and slime's `create_placement_groups` place workers (bundles per node, actors by bundle index);
Gyre's unit is a cell instead of a GPU.

Keys. The launcher makes the run's secret and one CURVE key pair per process group (and its own) and hands each
host actor its `BusKeys` and the secret as constructor arguments: Ray carries them in the actor's creation task,
never in the environment, a command line, a config or a log (runtime/run_secrets.py, runtime/zmq_transport.py).
Ray's own channel is the cluster's trust boundary: anyone who can submit Ray tasks to the cluster can read them.

Endpoints. Each host reserves a free TCP port on its node's address (`ray.util.get_node_ip_address()`) and reports
it; once every host has one the launcher hands out the whole table and the nodes start. The host also puts that
address in its environment (`runtime.launch.node_address()`), so what its actors bind besides the bus (a cell's
engine server and Mooncake endpoint) is on the node's address too, never on loopback. A port taken by another
process in between makes that node fail to start, and the run ends with a message naming it.

Event log. Each host records its segment in a temporary folder on its node. The launcher pulls what is new in every
segment twice a second (`pull_every_s`) into `<log>.parts/`, and once more after the stop, then merges the parts as
the local launcher does; a group that dies leaves what was pulled before (a torn last record is skipped). Each pull
also brings the host's last stderr lines, so a death can be reported with them.

Death. A host whose actor dies (a killed worker, a lost node: `RayActorError` on its `serve` call) is handled by
its actors' `RestartPolicy`: if every actor of the group is in mode "restart", the group is started again in the
same bundle (where Ray put it, which is another node when the node is gone) with the same keys, up to the smallest
`max_restarts` of its actors. It binds its old endpoint where it can (same node, port still free); else a fresh
one on its node, and before it starts the launcher moves every other host's socket towards it
(`ZmqTransport.move_peer`; what was queued for the dead one is dropped). Otherwise, or when that fails, the run
ends with status 1 and a reason naming the group, its node and its last log lines. Every wait on Ray is bounded,
so a run never hangs on a dead node.
"""

from __future__ import annotations

import asyncio
import collections
import math
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any, Callable

import attrs
import structlog

from gyre.runtime.clock import RealClock
from gyre.runtime.codec import Codec
from gyre.runtime.errors import GyreError
from gyre.runtime.event_log import EventLogWriter, merge_segments
from gyre.runtime.launch import LAUNCHER_NODE, NODE_ADDRESS_ENV, RunOptions, RunResult, supervisor_spec
from gyre.runtime.node import Node, NodeConfig
from gyre.runtime.run_secrets import install_run_secret, run_secret
from gyre.runtime.topology import SUPERVISOR, Directory, Topology, load_topology_file
from gyre.runtime.validators import positive
from gyre.runtime.zmq_transport import BusKeys, ZmqConfig, ZmqTransport, generate_bus_keys

log = structlog.get_logger("gyre.ray_launcher")

#: stderr lines a host keeps for a death report: enough for a traceback's end, small enough to pull twice a second.
LAST_LINES = 40
#: Pause between attempts at starting a dead group again (`RayLauncher._recreate`): Ray notices a lost node within
#: seconds (missed heartbeats), so a few attempts suffice; each one is a Ray actor creation.
RESTART_PAUSE_S = 1.0
#: Concurrent calls into one host actor: `serve` blocks for the whole run while `pull` and `stop` come in.
HOST_CONCURRENCY = 4


class RayLaunchError(GyreError, RuntimeError):
    """Ray could not place or start the run (resources the cluster does not have, a host that failed to start)."""


def start_ray(address: str, demand: dict[str, float] | None = None) -> bool:
    """Connect this driver to Ray: `address` of a running cluster ("auto" finds one), or "local" to start one on
    this machine on 127.0.0.1 only, offering at least `demand` (the topology's total CPU and custom resources:
    "local" runs any topology on one machine, as the local launcher does, Ray's CPUs being scheduling tokens; GPUs
    are what Ray finds). Returns whether this call connected (so the caller disconnects at the end); a driver
    already connected (a test's cluster) is left as it is."""
    on_loopback = address == "local" or address.rpartition(":")[0] in ("127.0.0.1", "localhost")
    if on_loopback and "ray" not in sys.modules:
        # Read once when ray is imported: without it Ray rewrites 127.0.0.1 to the machine's interface address and
        # a local cluster listening on loopback is never found (../shared/reference/ray.md, benchmarks/bus.py).
        # Never for a cluster elsewhere: the driver's own address would then be 127.0.0.1, which its hosts on other
        # machines cannot reach.
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    import ray

    if ray.is_initialized():
        return False
    if address == "local":
        demand = dict(demand or {})
        cpus = max(os.cpu_count() or 1, math.ceil(demand.pop("CPU", 0.0)))
        demand.pop("GPU", None)
        # address="local": a fresh instance even where a cluster already runs on this machine (Ray would join it).
        ray.init(address="local", include_dashboard=False, configure_logging=False, num_cpus=cpus,
                 resources=demand or None)
    else:
        check_ray_address(address)
        # Each host's stderr comes to the driver's, prefixed with its Ray worker, as local children's do.
        ray.init(address=address, configure_logging=False)
    return True


#: How long a cluster address may take to accept a TCP connection; ray.init itself retries a dead address for minutes.
CONNECT_TIMEOUT_S = 10.0


def check_ray_address(address: str) -> None:
    """A HOST:PORT address must accept a connection now (ray.init would retry for minutes without saying why)."""
    host, colon, port = address.rpartition(":")
    if not colon or not port.isdigit() or "://" in address:
        return  # "auto", ray://..., and the like: Ray's own resolution
    try:
        socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S).close()
    except OSError as error:
        raise ConnectionError(f"no Ray cluster answers at {address} ({error})") from error


@attrs.frozen
class HostPlan:
    """What a host actor needs to build its node: the topology (file and source) and the group it runs."""

    topology_file: str
    """The topology file's path on the driver (used on a node where the same file exists)."""
    topology_source: bytes = attrs.field(repr=False)
    """The file's bytes: written to a node-local file where the path does not hold the same file."""
    argv: tuple[str, ...]
    """The topology's arguments."""
    seed: int | None
    """The seed override, if any."""
    process: str
    """The process group this host runs."""
    node_config: NodeConfig
    """Bounds of the node."""
    zmq_config: ZmqConfig
    """Socket bounds, the same in every process of the run."""


@attrs.frozen
class HostPlace:
    """Where Ray put a host actor."""

    node_id: str
    """Ray's node id."""
    node_ip: str
    """The node's address, which the bus binds on."""
    pid: int
    """The host's worker process."""


def _free_endpoint(address: str, port: int) -> str:
    """tcp://ADDRESS:PORT where nothing listens now (port 0: one the OS picks); OSError where it is taken."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind((address, port))
        return f"tcp://{address}:{probe.getsockname()[1]}"


class _LastLines:
    """A text stream that passes writes on and keeps the last `LAST_LINES` lines (bounded: a deque)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self._lines: collections.deque[str] = collections.deque(maxlen=LAST_LINES)
        self._partial = ""
        self._lock = threading.Lock()

    def write(self, text: str) -> int:
        with self._lock:
            parts = (self._partial + text).split("\n")
            self._partial = parts.pop()[-4096:]  # a line without its end is bounded too
            self._lines.extend(part[-4096:] for part in parts)
        return self._inner.write(text)

    def flush(self) -> None:
        self._inner.flush()

    def isatty(self) -> bool:
        return False

    def fileno(self) -> int:
        return self._inner.fileno()

    def lines(self) -> list[str]:
        with self._lock:
            return [*self._lines, *([self._partial] if self._partial else [])]


def _node_topology_file(plan: HostPlan) -> str:
    path = Path(plan.topology_file)
    if path.is_file() and path.read_bytes() == plan.topology_source:
        return str(path)
    # Another machine: the driver's file is not here. Same name, so the recorded code hash and module name hold.
    folder = Path(tempfile.mkdtemp(prefix="gyre-topology-"))
    copy = folder / path.name
    copy.write_bytes(plan.topology_source)
    return str(copy)


class GroupHost:
    """One process group as a Ray actor (threaded: `serve` blocks for the run while `pull` and `stop` come in).
    The node runs on its own thread with its own event loop."""

    def __init__(self, plan: HostPlan, secret: bytes, bus_keys: BusKeys) -> None:
        import ray

        install_run_secret(secret)
        # What the group's actors bind on (runtime.launch.node_address: an engine server, a Mooncake endpoint), as
        # the bus does: this worker process is the group's alone, and its children inherit it.
        os.environ[NODE_ADDRESS_ENV] = ray.util.get_node_ip_address()
        self._plan = plan
        self._keys = bus_keys
        self._stderr = _LastLines(sys.stderr)
        sys.stderr = self._stderr
        from gyre.runtime.logs import configure_logging

        configure_logging(json=True)
        self._folder = Path(tempfile.mkdtemp(prefix=f"gyre-segment-{plan.process}-"))
        self._segment = self._folder / f"{plan.process}.glog"
        self._started = threading.Event()
        self._finished = threading.Event()
        self._error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._transport: ZmqTransport | None = None
        self._thread: threading.Thread | None = None

    def where(self) -> HostPlace:
        import ray

        return HostPlace(ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address(), os.getpid())

    def reserve_endpoint(self, wanted: str | None) -> str:
        """A tcp:// endpoint on this node's address that nothing listens on now: `wanted` (a restart's old one)
        where it is on this node and still free, else a fresh port (the launcher then moves its peers to it)."""
        import ray

        address = ray.util.get_node_ip_address()
        if wanted is not None:
            host, _, wanted_port = wanted[len("tcp://"):].rpartition(":")
            if host == address:
                try:
                    return _free_endpoint(address, int(wanted_port))
                except OSError:  # taken since: any port will do
                    pass
        return _free_endpoint(address, 0)

    def move_peer(self, node: str, endpoint: str, timeout_s: float) -> None:
        """Node `node` binds `endpoint` from now on (a group started again elsewhere); applied on the node's loop."""
        if self._loop is None or self._transport is None:
            raise RayLaunchError(f"{self._plan.process}: its node is not running")

        async def move() -> None:
            assert self._transport is not None
            self._transport.move_peer(node, endpoint)

        asyncio.run_coroutine_threadsafe(move(), self._loop).result(timeout_s)

    def start(self, endpoints: dict[str, str], start_timeout_s: float) -> None:
        """Build the node and start its actors; returns once they started (raises what stopped them)."""
        self._thread = threading.Thread(target=self._run, args=(endpoints,), name=f"gyre:{self._plan.process}",
                                        daemon=True)
        self._thread.start()
        if not self._started.wait(start_timeout_s):
            raise RayLaunchError(f"{self._plan.process}: its node did not start within {start_timeout_s}s")
        if self._error is not None:
            raise RayLaunchError(f"{self._plan.process}: its node failed to start: {self._error!r}")

    def serve(self) -> str:
        """Wait until the node stopped; returns how (raises when it failed)."""
        self._finished.wait()
        if self._error is not None:
            raise RayLaunchError(f"{self._plan.process}: {self._error!r}")
        return "stopped"

    def pull(self, offset: int) -> tuple[bytes, list[str]]:
        """The segment's bytes from `offset` on (what the node flushed so far) and the last stderr lines."""
        data = b""
        if self._segment.exists():
            with open(self._segment, "rb") as segment:
                segment.seek(offset)
                data = segment.read()
        return data, self._stderr.lines()

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        else:
            self._finished.set()

    def _run(self, endpoints: dict[str, str]) -> None:
        try:
            asyncio.run(_host_main(self._plan, self._keys, endpoints, self._segment, self._node_started))
        except BaseException as error:  # the thread's end: keep it for serve(), never lose it
            self._error = self._error or error
        finally:
            self._started.set()
            self._finished.set()

    def _node_started(self, loop: asyncio.AbstractEventLoop, stop: asyncio.Event, transport: ZmqTransport) -> None:
        self._loop, self._stop, self._transport = loop, stop, transport
        self._started.set()


# Not a method: Ray makes a class with any `async def` an async actor, whose calls share one event loop, and
# `serve` blocks for the whole run.
async def _host_main(plan: HostPlan, keys: BusKeys, endpoints: dict[str, str], segment: Path,
                     started: Callable[[asyncio.AbstractEventLoop, asyncio.Event, ZmqTransport], None]) -> None:
    """Build the group's node, start it, tell `started` how to stop it, flush its segment until told to stop."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    topology = load_topology_file(_node_topology_file(plan), list(plan.argv))
    if plan.seed is not None:
        topology.seed = plan.seed
    codec = Codec()
    placement = {spec.name: spec.process for spec in topology.specs}
    directory = Directory.build(topology, placement, endpoints, codec.type_name_of, LAUNCHER_NODE)
    transport = ZmqTransport(endpoints[plan.process], endpoints, plan.zmq_config, keys)
    node = Node(plan.process, directory, clock=RealClock(), codec=codec, transport=transport,
                recorder=EventLogWriter(segment), config=plan.node_config)
    for spec in topology.processes()[plan.process]:
        node.add_actor(spec, topology.actor_seed(spec.name))
    await node.start()
    if node.recorder is not None:
        node.recorder.flush()  # the start records are on disk before the launcher's first pull
    started(loop, stop, transport)
    try:
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), 0.25)
            except asyncio.TimeoutError:
                pass
            if node.recorder is not None:
                node.recorder.flush()  # what is flushed is what the launcher can pull
    finally:
        await node.stop()


@attrs.frozen
class _Host:
    name: str
    handle: Any
    serving: Any
    place: HostPlace
    endpoint: str
    incarnation: int


@attrs.frozen
class RayLaunchConfig:
    """The Ray launcher's bounds: every wait on Ray has one, so a lost node ends the run instead of hanging it."""

    place_timeout_s: float = attrs.field(default=60.0, validator=positive)
    """How long the cluster may take to reserve every bundle (longer: a run that waits for an autoscaler)."""
    start_timeout_s: float = attrs.field(default=60.0, validator=positive)
    """How long a host may take to start, import the topology and start its actors."""
    stop_timeout_s: float = attrs.field(default=10.0, validator=positive)
    """How long the hosts may take to stop before they are killed."""
    pull_every_s: float = attrs.field(default=0.5, validator=positive)
    """Segment and last-lines pulls; a dead group's log ends at most this long before its death."""
    zmq: ZmqConfig = ZmqConfig()
    """Socket bounds, the same in every process of the run."""


class RayLauncher:
    """Each process group as a Ray actor (module docstring); the same `Launcher` interface as the others.

    After `run`, `placement` maps each process group to where it ran last, and `restarts` counts the groups
    started again after their host died."""

    def __init__(
        self, topology_file: str, argv: tuple[str, ...] = (), seed: int | None = None, address: str = "local",
        config: RayLaunchConfig = RayLaunchConfig(),
    ) -> None:
        self.topology_file = str(Path(topology_file).resolve())
        self.argv = tuple(argv)
        self.seed = seed
        self.address = address
        self.config = config
        self.placement: dict[str, HostPlace] = {}
        self.restarts: dict[str, int] = {}

    def run(self, topology: Topology, options: RunOptions = RunOptions()) -> RunResult:
        if topology.cpu_cores_by_process:
            log.warning("cpu_limits_not_applied", launcher="ray", limits=topology.cpu_cores_by_process,
                        why="Ray reserves CPU per group (Topology.resources); cgroup quotas are the local launcher's")
        demand: dict[str, float] = {}
        for process in topology.processes():
            for key, amount in topology.resources_of(process).as_bundle().items():
                demand[key] = demand.get(key, 0.0) + amount
        try:
            connected = start_ray(self.address, demand)
        except (ConnectionError, RuntimeError, ValueError) as error:  # what ray.init raises for a cluster not there
            return RunResult(1, f"could not connect to Ray at {self.address!r}: {error}")
        try:
            return self._run(topology, options)
        finally:
            if connected:
                import ray

                ray.shutdown()

    def _run(self, topology: Topology, options: RunOptions) -> RunResult:
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        groups = topology.processes()
        units = topology.placement_units()
        unit_of = {process: index for index, (_, members) in enumerate(units) for process in members}
        bundles = []
        for name, members in units:
            bundle: dict[str, float] = {}
            for process in members:
                for key, amount in topology.resources_of(process).as_bundle().items():
                    bundle[key] = bundle.get(key, 0.0) + amount
            bundles.append(bundle)
        group = placement_group(bundles, strategy=topology.placement_strategy,
                                name=f"gyre-{topology.name}-{os.getpid()}")
        parts_dir = Path(options.log_path + ".parts") if options.log_path else None
        hosts: dict[str, _Host] = {}
        try:
            ready, _ = ray.wait([group.ready()], timeout=self.config.place_timeout_s)
            if not ready:
                raise RayLaunchError(
                    f"Ray could not reserve {bundles} ({topology.placement_strategy}) within "
                    f"{self.config.place_timeout_s}s; the cluster has {ray.cluster_resources()}"
                )
            if parts_dir is not None:
                shutil.rmtree(parts_dir, ignore_errors=True)
                parts_dir.mkdir(parents=True)
            secret = run_secret()
            bus_keys = generate_bus_keys([*groups, LAUNCHER_NODE])
            source = Path(self.topology_file).read_bytes()
            remote_host = ray.remote(GroupHost)

            def create(process: str, incarnation: int, wanted: str | None) -> _Host:
                resources = topology.resources_of(process)
                plan = HostPlan(self.topology_file, source, self.argv, self.seed, process, options.node,
                                self.config.zmq)
                handle = remote_host.options(
                    name=f"gyre:{topology.name}:{os.getpid()}:{process}:{incarnation}",
                    num_cpus=resources.cpu, num_gpus=resources.gpu, resources=dict(resources.custom) or None,
                    max_restarts=0, max_concurrency=HOST_CONCURRENCY,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(group, unit_of[process]),
                ).remote(plan, secret, bus_keys[process])
                try:
                    place = ray.get(handle.where.remote(), timeout=self.config.start_timeout_s)
                    endpoint = ray.get(handle.reserve_endpoint.remote(wanted), timeout=self.config.start_timeout_s)
                except BaseException:
                    ray.kill(handle, no_restart=True)  # never leave a half-made host holding its bundle
                    raise
                return _Host(process, handle, None, place, endpoint, incarnation)

            for process in sorted(groups):
                hosts[process] = create(process, 0, None)
                log.info("process_group_placed", process=process, node_id=hosts[process].place.node_id,
                         node_ip=hosts[process].place.node_ip, endpoint=hosts[process].endpoint)
            self.placement = {name: host.place for name, host in hosts.items()}
            driver_ip = ray.util.get_node_ip_address()
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
                probe.bind((driver_ip, 0))
                launcher_endpoint = f"tcp://{driver_ip}:{probe.getsockname()[1]}"
            endpoints = {name: host.endpoint for name, host in hosts.items()}
            endpoints[LAUNCHER_NODE] = launcher_endpoint
            reason, code = asyncio.run(self._drive(topology, options, hosts, endpoints, bus_keys, parts_dir, create))
        except (RayLaunchError, ray.exceptions.RayError, ray.exceptions.GetTimeoutError) as error:
            reason, code = f"the Ray launch failed: {error}", 1
            log.error("ray_launch_failed", reason=str(error))
        finally:
            for host in hosts.values():
                ray.kill(host.handle, no_restart=True)
            remove_placement_group(group)
        if parts_dir is not None and options.log_path and parts_dir.exists():
            report = merge_segments(sorted(parts_dir.glob("*.glog")), Path(options.log_path))
            if report.torn_tail_bytes:
                log.warning("a_process_left_a_torn_record_it_was_skipped", bytes=report.torn_tail_bytes)
            shutil.rmtree(parts_dir, ignore_errors=True)
        return RunResult(code, reason)

    async def _drive(self, topology, options, hosts, endpoints, bus_keys, parts_dir, create) -> tuple[str, int]:
        import ray

        codec = Codec()
        placement = {spec.name: spec.process for spec in topology.specs}
        directory = Directory.build(topology, placement, endpoints, codec.type_name_of, LAUNCHER_NODE)
        transport = ZmqTransport(endpoints[LAUNCHER_NODE], endpoints, self.config.zmq, bus_keys[LAUNCHER_NODE])
        recorder = EventLogWriter(parts_dir / f"{LAUNCHER_NODE}.glog") if parts_dir else None
        node = Node(LAUNCHER_NODE, directory, clock=RealClock(), codec=codec, transport=transport,
                    recorder=recorder, config=options.node)
        node.add_actor(supervisor_spec(), topology.actor_seed(SUPERVISOR))
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            try:
                loop.add_signal_handler(signum, node.resolve_stop, f"signal {signal.Signals(signum).name}",
                                        128 + signum)
            except (RuntimeError, ValueError):  # not the main thread (a test's driver)
                pass
        pulled: dict[tuple[str, int], int] = {}
        last_lines: dict[str, list[str]] = {}
        # One pull at a time per host, never abandoned: on a loaded node a pull can take longer than the wait for
        # it, and a pull given up on would lose its lines (a death report without them) and be asked again.
        pulling: dict[tuple[str, int], tuple[asyncio.Future, int]] = {}

        async def pull(host: _Host, wait_s: float | None = None) -> None:
            key = (host.name, host.incarnation)
            if key not in pulling:
                offset = pulled.get(key, 0)
                pulling[key] = (asyncio.wrap_future(host.handle.pull.remote(offset).future()), offset)
            future, offset = pulling[key]
            done, _ = await asyncio.wait([future], timeout=self.config.pull_every_s * 4 if wait_s is None else wait_s)
            if not done:
                return  # still on its way: taken on a later turn
            del pulling[key]
            try:
                data, lines = future.result()
            except ray.exceptions.RayError as error:
                log.debug("pull_failed", process=host.name, error=repr(error))
                return  # a dead host is seen on its serve call
            last_lines[host.name] = lines
            if data and parts_dir is not None:
                with open(parts_dir / f"{host.name}.{host.incarnation}.glog", "ab") as part:
                    part.write(data)
                pulled[(host.name, host.incarnation)] = offset + len(data)

        async def start(host: _Host) -> _Host:
            await asyncio.wrap_future(host.handle.start.remote(endpoints, self.config.start_timeout_s).future())
            return attrs.evolve(host, serving=host.handle.serve.remote())

        async def move(name: str, endpoint: str) -> None:
            """Group `name` binds `endpoint` now: the table later starts hand out, this node and every other host
            send there. A host that cannot be told is dying or dead; its own serve call says so, and its restart
            gets the new table."""
            endpoints[name] = endpoint
            transport.move_peer(name, endpoint)
            told = [(other, asyncio.wait_for(asyncio.wrap_future(
                        host.handle.move_peer.remote(name, endpoint, self.config.start_timeout_s).future()),
                        self.config.start_timeout_s * 2))
                    for other, host in hosts.items() if other != name]
            results = await asyncio.gather(*(waiting for _, waiting in told), return_exceptions=True)
            for (other, _), result in zip(told, results):
                if isinstance(result, BaseException):
                    log.warning("peer_move_not_applied", process=other, moved=name, error=repr(result))

        await node.start()
        try:
            for name in sorted(hosts):
                hosts[name] = await asyncio.wait_for(start(hosts[name]), self.config.start_timeout_s * 2)
            if options.until_s is not None:
                loop.call_later(options.until_s, node.resolve_stop, f"time limit of {options.until_s}s reached", 0)
            assert node.stop_requested is not None
            while not node.stop_requested.done():
                # Pull first: what a group logged while starting is then known even if it dies at once.
                await asyncio.gather(*(pull(host) for host in hosts.values()))
                await self._check_hosts(topology, node, hosts, last_lines, create, start, move)
                await asyncio.wait([node.stop_requested], timeout=self.config.pull_every_s)
            return await node.stop_requested
        except (RayLaunchError, ray.exceptions.RayError, asyncio.TimeoutError) as error:
            return f"the Ray launch failed: {error!r}", 1
        finally:
            for host in hosts.values():
                host.handle.stop.remote()
            serving = [host.serving for host in hosts.values() if host.serving is not None]
            if serving:
                await asyncio.to_thread(ray.wait, serving, num_returns=len(serving), timeout=self.config.stop_timeout_s)
            # A pull under way may predate the stop: take it, then the rest.
            for _ in range(2):
                await asyncio.gather(*(pull(host, self.config.stop_timeout_s) for host in hosts.values()))
            await node.stop()

    async def _recreate(self, create, host: _Host) -> _Host:
        """A new host for a dead one's group, in its bundle. Where the node itself is lost, Ray may place the first
        attempt on it still (its death is noticed only when its heartbeats stop), and that attempt dies: try again,
        RESTART_PAUSE_S apart, until `place_timeout_s + start_timeout_s` have passed (Ray then has placed the bundle
        on another node, or the cluster has no room and the run ends)."""
        import ray

        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.place_timeout_s + self.config.start_timeout_s
        incarnation = host.incarnation
        while True:
            incarnation += 1  # each attempt its own actor name and log part
            try:
                return await asyncio.to_thread(create, host.name, incarnation, host.endpoint)
            except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError) as error:
                if loop.time() + RESTART_PAUSE_S >= deadline:
                    raise
                log.warning("restart_attempt_failed", process=host.name, incarnation=incarnation,
                            error=str(error).splitlines()[0] if str(error) else type(error).__name__)
                await asyncio.sleep(RESTART_PAUSE_S)

    async def _check_hosts(self, topology, node, hosts, last_lines, create, start, move) -> None:
        import ray

        for name, host in list(hosts.items()):
            ready, _ = ray.wait([host.serving], timeout=0)
            if not ready:
                continue
            try:
                ray.get(host.serving, timeout=self.config.stop_timeout_s)
                why = "its node stopped by itself"
            except ray.exceptions.RayError as error:
                why = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
            specs = topology.processes()[name]
            restartable = all(spec.restart.mode == "restart" for spec in specs)
            allowed = min(spec.restart.max_restarts for spec in specs)
            where = f"node {host.place.node_ip} (Ray node {host.place.node_id[:12]}, pid {host.place.pid})"
            lines = last_lines.get(name, [])
            log.error("process_group_died", process=name, node_ip=host.place.node_ip, node_id=host.place.node_id,
                      why=why, last_lines=lines[-10:])
            if restartable and self.restarts.get(name, 0) < allowed:
                self.restarts[name] = self.restarts.get(name, 0) + 1
                try:
                    ray.kill(host.handle, no_restart=True)
                    fresh = await self._recreate(create, host)
                    if fresh.endpoint != host.endpoint:
                        # Another node (Ray placed the bundle elsewhere: the old node is gone) or the old port is
                        # taken: everyone sends there before it starts (a PUSH socket queues until it binds).
                        await move(name, fresh.endpoint)
                    hosts[name] = await asyncio.wait_for(start(fresh), self.config.start_timeout_s * 2)
                    self.placement[name] = fresh.place
                    log.warning("process_group_restarted", process=name, restarts=self.restarts[name],
                                node_ip=fresh.place.node_ip, node_id=fresh.place.node_id, endpoint=fresh.endpoint,
                                moved=fresh.endpoint != host.endpoint)
                    continue
                except (RayLaunchError, ray.exceptions.RayError, ray.exceptions.GetTimeoutError,
                        asyncio.TimeoutError) as error:
                    why += f"; restarting it failed: {error}"
            tail = "\n    ".join(lines[-10:]) or "(no output pulled)"
            node.resolve_stop(f"process group {name} died on {where}: {why}; its last log lines:\n    {tail}", 1)
            return
