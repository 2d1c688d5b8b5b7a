"""`run_with_faults`: a topology in virtual time under a seeded fault plan (gyre.runtime.faults), and how it ended.

Public through gyre.runtime.testing (the testing helpers) and used by `gyre run --virtual --faults PLAN`; it lives
in a module of its own so that the CLI and the testing helpers (whose `gyre_cli` drives the CLI) do not import each
other.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, Awaitable, Callable

import attrs

from gyre.runtime.clock import VirtualClock
from gyre.runtime.codec import Codec
from gyre.runtime.event_log import EventLogWriter
from gyre.runtime.faults import FaultInjector, parse_plan
from gyre.runtime.launch import LAUNCHER_NODE, supervisor_spec
from gyre.runtime.node import Node, NodeConfig
from gyre.runtime.topology import SUPERVISOR, Directory, Topology
from gyre.runtime.virtual_loop import Quiescent, VirtualEventLoop

__all__ = ["FaultRun", "run_with_faults"]


@attrs.frozen
class FaultRun:
    """How a `run_with_faults` run ended."""

    reason: str
    """Why it stopped (the topology's stop, the time limit, or quiescence)."""
    exit_code: int
    applied: tuple[tuple[float, str, str], ...]
    """(virtual time, the fault, the message it hit) for every fault that fired, in order."""
    value: Any
    """What `inspect` returned (None without one)."""
    statistics: dict[str, int]
    """The node's counters (fault_drop, fault_kill, fault_deliver for delays, failures, ...)."""


def run_with_faults(
    topology: Topology, plan: str, *, until_s: float, log_path: str | Path | None = None,
    inspect: Callable[[Node], Awaitable[Any]] | None = None,
) -> FaultRun:
    """Run `topology` in virtual time (one node, seeded delivery order, offload inline) under the fault `plan`
    (gyre.runtime.faults: kill, drop, delay, duplicate, partition), until it stops or `until_s` virtual seconds.
    `inspect(node)` runs once the run asked to stop, before any actor stops: ask the actors what an invariant needs.
    Raises FaultPlanError for a plan that does not parse."""
    faults = parse_plan(plan)
    clock = VirtualClock(0.0)
    codec = Codec()
    placement = {spec.name: LAUNCHER_NODE for spec in topology.specs}
    directory = Directory.build(topology, placement, {}, codec.type_name_of, LAUNCHER_NODE)
    recorder = EventLogWriter(log_path) if log_path else None
    node = Node(LAUNCHER_NODE, directory, clock=clock, codec=codec, recorder=recorder,
                config=NodeConfig(shuffle_seed=topology.seed, offload_inline=True))
    node.add_actor(supervisor_spec(), topology.actor_seed(SUPERVISOR))
    for spec in topology.specs:
        node.add_actor(spec, topology.actor_seed(spec.name))
    injector = node.fault_injector = FaultInjector(faults, codec.type_name_of)

    async def main() -> tuple[str, int, Any]:
        await node.start()
        assert node.stop_requested is not None
        asyncio.get_running_loop().call_later(until_s, node.resolve_stop, f"time limit of {until_s}s reached", 1)
        reason, code = await node.stop_requested
        value = await inspect(node) if inspect is not None else None
        return reason, code, value

    loop = VirtualEventLoop(clock)
    asyncio.set_event_loop(loop)
    try:
        try:
            reason, code, value = loop.run_until_complete(main())
        except Quiescent:
            reason, code, value = "quiescent: no actor has anything left to do", 1, None
        loop.run_until_complete(node.stop())
    finally:
        asyncio.set_event_loop(None)
        loop.close()
    return FaultRun(reason, code, tuple(injector.applied), value, dict(node.statistics))
