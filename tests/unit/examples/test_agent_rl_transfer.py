"""The main job on several nodes: its cells name their Mooncake protocol from the command line (--transfer-protocol,
TCP by default) and bind on their node's address (CellConfig.host's default, runtime.launch.node_address); the
agents' group is packed with the proxy's, whose URLs are on loopback."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from gyre.runtime.launch import NODE_ADDRESS_ENV

AGENT_RL = Path(__file__).resolve().parents[3] / "examples" / "agent_rl.py"


@pytest.fixture(scope="module")
def agent_rl():
    spec = importlib.util.spec_from_file_location("agent_rl_transfer_under_test", AGENT_RL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _cells(topology) -> list:
    return [spec.config for spec in topology.specs if spec.actor_cls.__name__ == "Cell"]


def test_cells_take_the_protocol_asked_for_and_the_nodes_address(agent_rl, tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "prepare.json").write_text('{"model_dir": "%s"}' % (tmp_path / "model"))
    monkeypatch.delenv(NODE_ADDRESS_ENV, raising=False)
    default = _cells(agent_rl.topology(["--report", str(tmp_path)]))
    assert [(c.transfer_protocol, c.host) for c in default] == [("tcp", "127.0.0.1")] * 3
    monkeypatch.setenv(NODE_ADDRESS_ENV, "10.0.0.7")  # as a Ray host on that node sets it before it makes the topology
    rdma = _cells(agent_rl.topology(["--report", str(tmp_path), "--cells", "2", "--transfer-protocol", "rdma"]))
    assert [(c.transfer_protocol, c.host) for c in rdma] == [("rdma", "10.0.0.7")] * 2
    with pytest.raises(SystemExit):
        agent_rl.parse_args(["--transfer-protocol", "ib"])


def test_the_agents_group_shares_the_proxys_node(agent_rl, tmp_path: Path) -> None:
    # The proxy issues 127.0.0.1 URLs: under the Ray launcher the executor's group must be on its node.
    (tmp_path / "prepare.json").write_text('{"model_dir": "%s"}' % (tmp_path / "model"))
    topology = agent_rl.topology(["--report", str(tmp_path)])
    assert topology.spec("executor").process == topology.spec("evaluator").process == "runs"
    assert topology.packs == {"front": ("proxy", "runs")}
    units = dict(topology.placement_units())
    assert units["front"] == ("proxy", "runs") and "runs" not in units
