"""Cells under the Ray launcher on a real two-node Ray cluster on this machine (`ray.cluster_utils.Cluster`, 1 CPU
per node, on loopback only: the second node at 127.0.0.2, so that an address hard-coded to 127.0.0.1 shows).

- A core and a satellite placed on the two nodes serve agent calls through the proxy while each in turn switches to
  training and back, its sessions migrated to the other node; no call is lost; each cell's engine and Mooncake
  endpoint are on its node's address.
- A satellite whose process dies while it generates is handled by its RestartPolicy: "restart" starts its group
  again (the launcher) while the calls it held resume on the core and complete; "stop_topology" ends the run with
  status 1 naming its node and its last lines. Neither hangs.

The topology is ray_cells_topology.py; one cluster for the module (Ray's start-up is a good part of each test)."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Iterator

import pytest

# Read once when ray is imported: keeps every raylet, the GCS and our driver on 127.0.0.1 (reference/ray.md).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import ray  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

from gyre.runtime import Codec, read_log  # noqa: E402
from gyre.runtime.launch import RunOptions  # noqa: E402
from gyre.runtime.ray_launcher import RayLaunchConfig, RayLauncher  # noqa: E402
from gyre.runtime.topology import load_topology_file  # noqa: E402

pytestmark = pytest.mark.timeout(420)

TOPOLOGY = Path(__file__).with_name("ray_cells_topology.py")
#: Both on this machine's loopback interface (all of 127.0.0.0/8 is), each a node address of its own to Ray.
NODE_IPS = ("127.0.0.1", "127.0.0.2")


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    if ray.is_initialized():
        ray.shutdown()
    nodes = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "node_ip_address": "127.0.0.1", "include_dashboard": False})
    nodes.add_node(num_cpus=1, node_ip_address="127.0.0.2")
    nodes.wait_for_nodes()
    ray.init(address=nodes.address, log_to_driver=False)
    try:
        addresses = {node["NodeManagerAddress"] for node in ray.nodes() if node["Alive"]}
        assert addresses == set(NODE_IPS), f"Ray left loopback: {addresses} (was ray imported before this module?)"
        yield nodes
    finally:
        ray.shutdown()
        nodes.shutdown()


def _launch(argv: list[str], log_path: Path) -> tuple[RayLauncher, object]:
    launcher = RayLauncher(str(TOPOLOGY), tuple(argv), None, "connected",
                           RayLaunchConfig(place_timeout_s=30.0, start_timeout_s=180.0))
    result = launcher.run(load_topology_file(TOPOLOGY, argv), RunOptions(log_path=str(log_path), until_s=360.0))
    return launcher, result


def _verdict_calls(reason: str) -> int:
    """The calls the load actor made, from its verdict, which must say that each completed and none was lost."""
    found = re.match(r"(\d+) of (\d+) agent calls completed, 0 lost;", reason)
    assert found and found[1] == found[2], reason
    return int(found[2])


def _records(log_path: Path, type_name: str, receiver: str | None = None) -> list:
    """The messages of `type_name` (that `receiver` handled: a published one is recorded once per receiver)."""
    return [r.decode(Codec()) for r in read_log(log_path, Codec())
            if r.type_name == type_name and receiver in (None, r.envelope.receiver)]


def test_a_core_and_a_satellite_on_two_nodes_switch_under_agent_calls_and_lose_none(
        cluster, tmp_path: Path, tiny_model_dir: Path) -> None:
    log_path = tmp_path / "switch.glog"
    launcher, result = _launch(["--model-dir", str(tiny_model_dir), "--mode", "switch"], log_path)
    assert result.exit_code == 0, result.reason
    calls = _verdict_calls(result.reason)
    assert "; switches sat->core,core->sat;" in result.reason
    # 0.75 CPU a cell on nodes of 1 CPU: the cells can only be on two different nodes.
    alive = {node["NodeID"] for node in ray.nodes() if node["Alive"]}
    assert {launcher.placement["core"].node_id, launcher.placement["sat"].node_id} == alive
    assert {launcher.placement["core"].node_ip, launcher.placement["sat"].node_ip} == set(NODE_IPS)
    assert launcher.restarts == {}
    changes = _records(log_path, "gyre.cells.RoleChanged", "load")
    # Each cell's engine and Mooncake endpoint are on its node's address (runtime.launch.node_address), not loopback's
    # 127.0.0.1: the proxy, the migrator and the satellite reached them there.
    for change in changes:
        if change.engine_url:
            assert change.engine_url.startswith(f"http://{launcher.placement[change.cell].node_ip}:"), change
    assert {change.cell for change in changes if change.engine_url} == {"core", "sat"}
    sources = _records(log_path, "gyre.cell_internal.WeightSource", "weight_broker")
    assert sources and all(m.peer.startswith(launcher.placement["core"].node_ip + ":") for m in sources)
    to_train = [(m.cell, m.sessions_migrated) for m in changes if m.role == "train" and m.previous_role]
    assert [cell for cell, _ in to_train] == ["sat", "core"]
    assert all(migrated >= 1 for _, migrated in to_train), to_train  # sessions moved across nodes each time
    placed = _records(log_path, "gyre.cells.SessionPlaced", "load")
    assert {m.cell for m in placed} == {"core", "sat"}
    completed = _records(log_path, "gyre.model_calls.ModelCallCompleted", "proxy")
    assert len(completed) == calls >= 8
    assert {m.cell for m in completed} == {"core", "sat"}


def test_a_satellite_that_dies_under_load_is_restarted_and_its_calls_move_to_the_core(
        cluster, tmp_path: Path, tiny_model_dir: Path) -> None:
    log_path = tmp_path / "kill.glog"
    launcher, result = _launch(["--model-dir", str(tiny_model_dir), "--mode", "kill"], log_path)
    assert launcher.restarts == {"sat": 1}
    assert result.exit_code == 0, result.reason
    calls = _verdict_calls(result.reason)
    # The satellite was generating when it died: its calls resumed on the core, on the other node, and completed.
    assert "; the calls in flight at the death completed on core" in result.reason
    assert int(re.search(r"generations resumed (\d+)", result.reason)[1]) >= 1
    assert launcher.placement["sat"].node_id != launcher.placement["core"].node_id
    started = [m.actor for m in _records(log_path, "gyre.runtime.ActorStarted")]
    assert started.count("sat") == 2 and started.count("core") == 1
    completed = _records(log_path, "gyre.model_calls.ModelCallCompleted", "proxy")
    assert len(completed) == calls >= 8


def test_a_satellite_that_dies_with_stop_topology_ends_the_run_naming_it(
        cluster, tmp_path: Path, tiny_model_dir: Path) -> None:
    argv = ["--model-dir", str(tiny_model_dir), "--mode", "kill", "--satellite-restart", "stop_topology"]
    launcher, result = _launch(argv, tmp_path / "stop.glog")
    assert result.exit_code == 1
    assert f"process group sat died on node {launcher.placement['sat'].node_ip}" in result.reason, result.reason
    assert '"actor": "sat"' in result.reason  # its last lines (pulled twice a second before it died)
    assert launcher.restarts == {}
