"""runtime.launch.node_address: the address a process's node is reached at (what a cell binds its engine server and
Mooncake endpoint on): the launcher's GYRE_NODE_ADDRESS where set (the Ray launcher sets it in each host), else
127.0.0.1; a cell's config takes it as its default host where the config is made."""

from __future__ import annotations

import pytest

from gyre.actors.cells.cell import CellConfig
from gyre.runtime.launch import NODE_ADDRESS_ENV, node_address


def test_node_address_is_the_launchers_else_loopback(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(NODE_ADDRESS_ENV, raising=False)
    assert node_address() == "127.0.0.1"
    monkeypatch.setenv(NODE_ADDRESS_ENV, " ")
    assert node_address() == "127.0.0.1"
    monkeypatch.setenv(NODE_ADDRESS_ENV, "10.1.2.3")
    assert node_address() == "10.1.2.3"
    assert CellConfig(model_dir="m").host == "10.1.2.3"
    assert CellConfig(model_dir="m", host="10.9.9.9").host == "10.9.9.9"  # an explicit host wins
