"""Topology's placement declarations (what the Ray launcher reserves and packs): defaults, bundles, validation."""

from __future__ import annotations

import pytest

from gyre.runtime import Actor, Topology
from gyre.runtime.errors import TopologyError
from gyre.runtime.topology import ProcessResources


class Idle(Actor):
    """Does nothing."""


def _topology() -> Topology:
    result = Topology("t")
    result.add("core", Idle)
    result.add("core.engine", Idle, process="core_engine")
    result.add("satellite", Idle)
    return result


def test_undeclared_groups_reserve_one_cpu_and_each_is_its_own_unit() -> None:
    topology = _topology()
    assert topology.resources_of("core") == ProcessResources(1.0, 0.0, {})
    assert topology.placement_units() == [("core", ("core",)), ("core_engine", ("core_engine",)),
                                          ("satellite", ("satellite",))]
    assert topology.placement_strategy == "SPREAD"


def test_declared_resources_become_a_bundle_without_zero_amounts() -> None:
    topology = _topology()
    declared = topology.resources("core_engine", CPU=2, GPU=8, custom={"cell_core": 1, "unused": 0})
    assert declared.as_bundle() == {"CPU": 2.0, "GPU": 8.0, "cell_core": 1.0}
    assert topology.resources_of("core_engine") is declared
    assert topology.resources("satellite", CPU=0, custom={"edge": 0.5}).as_bundle() == {"edge": 0.5}


def test_packs_come_first_and_leftover_groups_follow_in_topology_order() -> None:
    topology = _topology()
    topology.pack("cell0", ["core", "core_engine"])
    topology.place_packs("STRICT_SPREAD")
    assert topology.placement_units() == [("cell0", ("core", "core_engine")), ("satellite", ("satellite",))]
    assert topology.placement_strategy == "STRICT_SPREAD"


@pytest.mark.parametrize("call, message", [
    (lambda t: t.resources("nobody"), "no process group 'nobody'"),
    (lambda t: t.resources("core", CPU=-1), "CPU must be a finite number >= 0"),
    (lambda t: t.resources("core", GPU=float("nan")), "GPU must be a finite number >= 0"),
    (lambda t: t.resources("core", CPU=True), "CPU must be a finite number >= 0"),
    (lambda t: t.resources("core", CPU=0), "reserves nothing"),
    (lambda t: t.resources("core", custom={"GPU": 1}), "custom resource names"),
    (lambda t: t.pack("cell0", []), "names no process group"),
    (lambda t: t.pack("cell0", ["core", "ghost"]), "no process group 'ghost'"),
    (lambda t: t.place_packs("ANYWHERE"), "strategy must be one of PACK, SPREAD"),
])
def test_bad_declarations_are_refused_with_a_clear_error(call, message) -> None:
    topology = _topology()
    with pytest.raises(TopologyError, match=message):
        call(topology)
    assert topology.resources_by_process == {} and topology.packs == {}


def test_a_group_belongs_to_one_pack_and_a_pack_name_to_one_pack() -> None:
    topology = _topology()
    topology.pack("cell0", ["core"])
    with pytest.raises(TopologyError, match="already in pack 'cell0'"):
        topology.pack("cell1", ["core_engine", "core"])
    with pytest.raises(TopologyError, match="empty or taken"):
        topology.pack("cell0", ["satellite"])
    assert topology.packs == {"cell0": ("core",)}
