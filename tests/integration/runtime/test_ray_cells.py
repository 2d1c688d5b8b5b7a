"""Cells under the Ray launcher on a real two-node Ray cluster on this machine (`ray.cluster_utils.Cluster`, 1 CPU
per node, on 127.0.0.1 only): a core and a satellite placed on two nodes serve agent calls through the proxy while
they switch roles (sessions migrating between the nodes), with no call lost; a satellite whose process dies under
load is handled by its RestartPolicy: restarted by the launcher while its calls resume on the core, or the run ends
with status 1 naming it. The topology is ray_cells_topology.py."""

from __future__ import annotations

import os
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


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    if ray.is_initialized():
        ray.shutdown()
    nodes = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "node_ip_address": "127.0.0.1", "include_dashboard": False})
    nodes.add_node(num_cpus=1, node_ip_address="127.0.0.1")
    nodes.wait_for_nodes()
    ray.init(address=nodes.address, log_to_driver=False)
    try:
        addresses = {node["NodeManagerAddress"] for node in ray.nodes() if node["Alive"]}
        assert addresses == {"127.0.0.1"}, f"Ray left loopback: {addresses} (was ray imported before this module?)"
        yield nodes
    finally:
        ray.shutdown()
        nodes.shutdown()


def _launch(argv: list[str], log_path: Path) -> tuple[RayLauncher, object]:
    launcher = RayLauncher(str(TOPOLOGY), tuple(argv), None, "connected",
                           RayLaunchConfig(place_timeout_s=30.0, start_timeout_s=180.0))
    result = launcher.run(load_topology_file(TOPOLOGY, argv), RunOptions(log_path=str(log_path), until_s=360.0))
    return launcher, result


def _records(log_path: Path, type_name: str, receiver: str | None = None) -> list:
    """The messages of `type_name` (that `receiver` handled: a published one is recorded once per receiver)."""
    return [r.decode(Codec()) for r in read_log(log_path, Codec())
            if r.type_name == type_name and receiver in (None, r.envelope.receiver)]


def test_a_core_and_a_satellite_on_two_nodes_switch_under_agent_calls_and_lose_none(
        cluster, tmp_path: Path, tiny_model_dir: Path) -> None:
    log_path = tmp_path / "switch.glog"
    launcher, result = _launch(["--model-dir", str(tiny_model_dir), "--mode", "switch"], log_path)
    assert result.exit_code == 0, result.reason
    assert result.reason.startswith("8 of 8 agent calls completed, 0 lost; switches sat->core,core->sat"), result.reason
    # 0.75 CPU a cell on nodes of 1 CPU: the cells can only be on two different nodes.
    alive = {node["NodeID"] for node in ray.nodes() if node["Alive"]}
    assert {launcher.placement["core"].node_id, launcher.placement["sat"].node_id} == alive
    assert launcher.restarts == {}
    changes = _records(log_path, "gyre.cells.RoleChanged", "load")
    to_train = [(m.cell, m.sessions_migrated) for m in changes if m.role == "train" and m.previous_role]
    assert [cell for cell, _ in to_train] == ["sat", "core"]
    assert all(migrated >= 1 for _, migrated in to_train), to_train  # sessions moved across nodes each time
    placed = _records(log_path, "gyre.cells.SessionPlaced", "load")
    assert {m.cell for m in placed} == {"core", "sat"}
    calls = [m for m in _records(log_path, "gyre.model_calls.ModelCallCompleted", "proxy") if m.execution_id.startswith("exec")]
    assert len(calls) == 8
    assert {m.cell for m in calls} == {"core", "sat"}


def test_a_satellite_that_dies_with_stop_topology_ends_the_run_naming_it(
        cluster, tmp_path: Path, tiny_model_dir: Path) -> None:
    argv = ["--model-dir", str(tiny_model_dir), "--mode", "kill", "--satellite-restart", "stop_topology"]
    launcher, result = _launch(argv, tmp_path / "stop.glog")
    assert result.exit_code == 1
    assert "process group sat died on node 127.0.0.1" in result.reason, result.reason
    assert '"actor": "sat"' in result.reason  # its last lines (pulled twice a second before it died)
    assert launcher.restarts == {}
