"""Topologies: which actors run, with which configs and policies, grouped into which processes.

A topology file is plain Python that defines `topology(argv: list[str]) -> Topology`; `gyre run FILE -- ARGS` calls
it with ARGS. The same Topology object drives every launcher (local processes, the deterministic runner, Ray), so
actors never know how they were placed.
"""

from __future__ import annotations

import hashlib
import importlib.util
import math
import sys
from pathlib import Path
from typing import Any, Callable, Mapping

import attrs

from gyre.runtime.actor import Actor
from gyre.runtime.errors import TopologyError

#: The built-in supervisor's name and index; user actors get indices 1, 2, ...
SUPERVISOR = "supervisor"
#: Indices from here on belong to clients (code outside the topology that tells or asks), one per node.
CLIENT_INDEX_BASE = 1 << 20


@attrs.frozen
class RestartPolicy:
    """What a node does when a handler of a tell raises."""

    mode: str = "restart"
    """"restart" the actor (up to max_restarts), "stop_actor" (it stays dead), or "stop_topology" (end the run)."""
    max_restarts: int = 3
    """Restarts allowed before the failure escalates to stopping the topology."""

    def __attrs_post_init__(self) -> None:
        if self.mode not in ("restart", "stop_actor", "stop_topology"):
            raise TopologyError(f"unknown restart mode {self.mode!r}")


#: Ray placement group strategies a topology may name for spreading its cells (Ray's own four).
PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


@attrs.frozen
class ProcessResources:
    """What one process group reserves on the node that hosts it (the Ray launcher's scheduling request)."""

    cpu: float = 1.0
    """CPU cores reserved (Ray's "CPU"); Ray's own default for an actor is 1."""
    gpu: float = 0.0
    """GPUs reserved (Ray's "GPU")."""
    custom: Mapping[str, float] = attrs.field(factory=dict, converter=lambda value: dict(value or {}))
    """Custom Ray resources reserved (e.g. {"cell_core": 1} to pin a group to the node that offers it)."""

    def as_bundle(self) -> dict[str, float]:
        """This reservation as a Ray placement-group bundle (zero amounts left out: Ray refuses them)."""
        bundle = {"CPU": self.cpu, "GPU": self.gpu, **self.custom}
        return {key: amount for key, amount in bundle.items() if amount > 0}


def _amount(process: str, key: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise TopologyError(f"resources: {process}: {key} must be a finite number >= 0, got {value!r}")
    return float(value)


@attrs.frozen
class ActorSpec:
    """One actor of a topology."""

    name: str
    actor_cls: type
    config: Any
    process: str
    """Actors with the same process name share one OS process under the local-process launcher."""
    restart: RestartPolicy
    index: int
    """Position in the topology (1-based); message ids are derived from it."""

    @property
    def class_path(self) -> str:
        return f"{self.actor_cls.__module__}:{self.actor_cls.__qualname__}"

    def subscription_names(self, type_name_of: Callable[[type], str]) -> tuple[str, ...]:
        return tuple(type_name_of(t) for t in self.actor_cls.subscriptions)


class Topology:
    """An ordered set of actor specs plus the run's seed."""

    def __init__(self, name: str, seed: int = 0, log_path: str = "") -> None:
        self.name = name
        self.seed = seed
        self.log_path = log_path
        """Where `gyre run` records the event log when not told otherwise (`--log`); "" records none."""
        self.checkpoint_dir = ""
        """The root of the run's full checkpoints (gyre.runtime.checkpoint), where `gyre run --resume` looks; ""
        when the topology keeps none."""
        self._specs: dict[str, ActorSpec] = {}
        self.cpu_cores_by_process: dict[str, float] = {}
        """Process group -> cores it may use at most (`limit_cpu`); the local-process launcher applies them."""
        self.resources_by_process: dict[str, ProcessResources] = {}
        """Process group -> what it reserves on its node (`resources`); the Ray launcher applies them (1 CPU when
        not declared)."""
        self.packs: dict[str, tuple[str, ...]] = {}
        """Name -> process groups placed together on one node (`pack`): a cell and its engine processes."""
        self.placement_strategy = "SPREAD"
        """How the Ray launcher spreads packs over nodes (a Ray placement-group strategy, `place_packs`)."""

    def add(
        self,
        name: str,
        actor_cls: type,
        config: Any = None,
        *,
        process: str | None = None,
        restart: RestartPolicy = RestartPolicy(),
    ) -> ActorSpec:
        if not (isinstance(actor_cls, type) and issubclass(actor_cls, Actor)):
            raise TopologyError(f"{name}: {actor_cls!r} is not an Actor subclass")
        if name in self._specs or name == SUPERVISOR or not name or name.startswith("~"):
            raise TopologyError(f"actor name {name!r} is taken or reserved")
        if config is None:
            config = actor_cls.config_cls()
        if not isinstance(config, actor_cls.config_cls):
            raise TopologyError(
                f"{name}: config is a {type(config).__qualname__}, {actor_cls.__qualname__} takes "
                f"{actor_cls.config_cls.__qualname__}"
            )
        spec = ActorSpec(name, actor_cls, config, process or name, restart, len(self._specs) + 1)
        self._specs[name] = spec
        return spec

    def limit_cpu(self, process: str, cores: float) -> None:
        """Cap a process group at `cores` CPU cores (a cgroup quota, runtime/cpu_limits.py): on one CPU machine this
        gives each cell a device of its own, whose capacity the other cells cannot take."""
        if process not in self.processes():
            raise TopologyError(f"limit_cpu: no process group {process!r}; add its actors first")
        if not (isinstance(cores, (int, float)) and cores > 0):
            raise TopologyError(f"limit_cpu: {process}: cores must be a positive number, got {cores!r}")
        self.cpu_cores_by_process[process] = float(cores)

    def resources(
        self, process: str, *, CPU: float = 1.0, GPU: float = 0.0, custom: Mapping[str, float] | None = None,
    ) -> ProcessResources:
        """Declare what process group `process` reserves on its node under the Ray launcher (Ray's names: CPU, GPU,
        custom resources). The other launchers run every group on this machine and ignore it."""
        if process not in self.processes():
            raise TopologyError(f"resources: no process group {process!r}; add its actors first")
        custom = dict(custom or {})
        for key in custom:
            if not isinstance(key, str) or not key or key in ("CPU", "GPU"):
                raise TopologyError(f"resources: {process}: custom resource names are non-empty strings other than "
                                    f"CPU and GPU, got {key!r}")
        declared = ProcessResources(
            _amount(process, "CPU", CPU), _amount(process, "GPU", GPU),
            {key: _amount(process, key, amount) for key, amount in custom.items()},
        )
        if not declared.as_bundle():
            raise TopologyError(f"resources: {process}: reserves nothing; Ray cannot place an empty bundle")
        self.resources_by_process[process] = declared
        return declared

    def resources_of(self, process: str) -> ProcessResources:
        """What `process` reserves: its declaration, else 1 CPU."""
        return self.resources_by_process.get(process, ProcessResources())

    def pack(self, name: str, processes: list[str] | tuple[str, ...]) -> None:
        """Place `processes` on one node (one Ray placement-group bundle holding all their resources)."""
        groups = self.processes()
        if not name or name in self.packs:
            raise TopologyError(f"pack: name {name!r} is empty or taken")
        if not processes:
            raise TopologyError(f"pack {name}: names no process group")
        for process in processes:
            if process not in groups:
                raise TopologyError(f"pack {name}: no process group {process!r}; add its actors first")
            for other, members in self.packs.items():
                if process in members:
                    raise TopologyError(f"pack {name}: process group {process!r} is already in pack {other!r}")
        self.packs[name] = tuple(processes)

    def place_packs(self, strategy: str) -> None:
        """How packs spread over nodes: "SPREAD" (default: over as many nodes as fit), "STRICT_SPREAD" (one node
        each), "PACK" or "STRICT_PACK" (Ray's placement-group strategies)."""
        if strategy not in PLACEMENT_STRATEGIES:
            raise TopologyError(f"place_packs: strategy must be one of {', '.join(PLACEMENT_STRATEGIES)}, "
                                f"got {strategy!r}")
        self.placement_strategy = strategy

    def placement_units(self) -> list[tuple[str, tuple[str, ...]]]:
        """Every process group in exactly one unit that goes on one node: the declared packs, then each group left
        over on its own (named after it), in topology order."""
        units = [(name, members) for name, members in self.packs.items()]
        packed = {process for members in self.packs.values() for process in members}
        units += [(process, (process,)) for process in self.processes() if process not in packed]
        return units

    @property
    def specs(self) -> tuple[ActorSpec, ...]:
        return tuple(self._specs.values())

    def spec(self, name: str) -> ActorSpec:
        return self._specs[name]

    def processes(self) -> dict[str, list[ActorSpec]]:
        groups: dict[str, list[ActorSpec]] = {}
        for spec in self._specs.values():
            groups.setdefault(spec.process, []).append(spec)
        return groups

    def actor_seed(self, name: str) -> int:
        """A per-actor seed derived from the run's seed and the name (stable across Python versions and runs)."""
        digest = hashlib.blake2b(f"{self.seed}:{name}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "little")


@attrs.frozen
class Directory:
    """Where every actor lives and who listens to which published type; the same in every process of a run."""

    actor_node: dict[str, str]
    """Actor name -> name of the node (process) that hosts it."""
    actor_index: dict[str, int]
    """Actor name -> index (message id prefix)."""
    subscribers: dict[str, tuple[str, ...]]
    """Wire type name -> actors that receive it when published."""
    node_endpoint: dict[str, str]
    """Node name -> ZeroMQ endpoint it binds (empty for in-process runs)."""

    @staticmethod
    def build(
        topology: Topology,
        placement: dict[str, str],
        endpoints: dict[str, str],
        type_name_of: Callable[[type], str],
        supervisor_node: str,
    ) -> "Directory":
        actor_node = {SUPERVISOR: supervisor_node}
        actor_index = {SUPERVISOR: 0}
        subscribers: dict[str, list[str]] = {}
        for spec in topology.specs:
            actor_node[spec.name] = placement[spec.name]
            actor_index[spec.name] = spec.index
            for type_name in spec.subscription_names(type_name_of):
                subscribers.setdefault(type_name, []).append(spec.name)
        nodes = sorted(set(actor_node.values()))
        for number, node in enumerate(nodes):
            actor_node[client_name(node)] = node
            actor_index[client_name(node)] = CLIENT_INDEX_BASE + number
        return Directory(actor_node, actor_index, {k: tuple(v) for k, v in subscribers.items()}, dict(endpoints))


def client_name(node: str) -> str:
    """The address of code outside the topology that tells or asks through `node`."""
    return f"~client.{node}"


def load_topology_file(path: str | Path, argv: list[str]) -> Topology:
    """Import a topology file and call its `topology(argv)`; the file's folder is importable from it."""
    return build_topology(load_topology_module(path), argv)


def build_topology(module: Any, argv: list[str]) -> Topology:
    """Call a loaded topology file's `topology(argv)` and check what it returns."""
    build = getattr(module, "topology", None)
    if not callable(build):
        raise TopologyError(f"{module.__file__} defines no function topology(argv) -> Topology")
    result = build(list(argv))
    if not isinstance(result, Topology):
        raise TopologyError(f"{module.__file__}: topology(argv) returned {type(result).__qualname__}, not a Topology")
    return result


def load_topology_module(path: str | Path) -> Any:
    """Import a topology file as a module (once per process). Besides `topology(argv)` it may define
    `prepare(argv)` and `finish(argv, result)`, which `gyre run` calls once, in the launcher's process only, before
    and after the run (e.g. to build a model the cells load, or to write a report)."""
    path = Path(path).resolve()
    if not path.is_file():
        raise TopologyError(f"no topology file at {path}")
    folder = str(path.parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    module_name = f"gyre_topology_{path.stem}"
    if module_name in sys.modules and getattr(sys.modules[module_name], "__file__", None) == str(path):
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return module
