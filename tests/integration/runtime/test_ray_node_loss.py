"""A lost node under the Ray launcher: a three-node Ray cluster on this machine's loopback (127.0.0.1, .2, .3; 1 CPU
each), ping pinned to the head, pong to one of two nodes that offer a `pong_slot`. The node pong runs on is removed
(its raylet and workers killed, as when a machine goes away); pong's RestartPolicy is "restart", so the launcher
starts it again in its bundle, which Ray has placed on the other `pong_slot` node, whose address differs: pong binds
a fresh endpoint there, ping and the launcher are moved to it, and the rally goes on to its end."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Iterator

import pytest

# Read once when ray is imported: keeps every raylet, the GCS and our driver on loopback (reference/ray.md).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import ray  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

from gyre.runtime import Codec, read_log  # noqa: E402
from gyre.runtime.launch import RunOptions  # noqa: E402
from gyre.runtime.ray_launcher import RayLaunchConfig, RayLauncher  # noqa: E402
from gyre.runtime.topology import load_topology_file  # noqa: E402

pytestmark = pytest.mark.timeout(240)

CRASH = Path(__file__).with_name("ray_crash_topology.py")
#: How long the test waits for pong's first segment bytes (its start) before it removes the node.
START_WAIT_S = 120.0


@pytest.fixture
def cluster() -> Iterator[tuple[Cluster, dict[str, object]]]:
    if ray.is_initialized():
        ray.shutdown()
    nodes = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "node_ip_address": "127.0.0.1", "include_dashboard": False, "resources": {"ping_slot": 1},
        # A lost node is noticed after 3 missed health checks 1 s apart (Ray's default waits longer), which is what
        # the rally below must outlast.
        "_system_config": {"health_check_period_ms": 1000, "health_check_failure_threshold": 3}})
    slots = {ip: nodes.add_node(num_cpus=1, node_ip_address=ip, resources={"pong_slot": 1})
             for ip in ("127.0.0.2", "127.0.0.3")}
    nodes.wait_for_nodes()
    ray.init(address=nodes.address, log_to_driver=False)
    try:
        assert {node["NodeManagerAddress"] for node in ray.nodes() if node["Alive"]} == {
            "127.0.0.1", "127.0.0.2", "127.0.0.3"}
        yield nodes, slots
    finally:
        ray.shutdown()
        nodes.shutdown()


def test_a_group_whose_node_is_lost_restarts_on_another_node_and_its_peers_follow(cluster, tmp_path: Path) -> None:
    nodes, slots = cluster
    log_path = tmp_path / "lost.glog"
    # 30 s of rally: the lost node is noticed (missed health checks) and pong restarted well within it, so ping's
    # last ask reaches the second pong.
    argv = ["--rounds", "600", "--interval-s", "0.05", "--ask-every", "1000", "--ping-needs", "ping_slot",
            "--pong-needs", "pong_slot", "--mode", "restart"]
    launcher = RayLauncher(str(CRASH), tuple(argv), None, "connected", RayLaunchConfig(place_timeout_s=30.0))
    outcome: dict[str, object] = {}
    run = threading.Thread(target=lambda: outcome.update(result=launcher.run(
        load_topology_file(CRASH, argv), RunOptions(log_path=str(log_path), until_s=120.0))))
    run.start()
    try:
        first_part = Path(str(log_path) + ".parts") / "pong.0.glog"
        started = threading.Event()
        for _ in range(int(START_WAIT_S / 0.1)):  # pong's start record pulled: it runs, and the rally is under way
            if first_part.exists() and first_part.stat().st_size > 0 and "pong" in launcher.placement:
                started.set()
                break
            if not run.is_alive():
                break
            started.wait(0.1)
        assert started.is_set(), outcome
        first = launcher.placement["pong"]
        assert first.node_ip in slots
        nodes.remove_node(slots[first.node_ip], allow_graceful=False)
    finally:
        run.join(timeout=200)
    assert not run.is_alive()
    result = outcome["result"]
    assert launcher.restarts == {"pong": 1}
    assert result.exit_code == 0, result.reason
    assert result.reason.startswith("rally over: pong returned ")
    second = launcher.placement["pong"]
    assert second.node_ip in slots and second.node_ip != first.node_ip  # the other pong_slot node
    records = list(read_log(log_path, Codec()))
    started_actors = [r.decode(Codec()).actor for r in records if r.type_name == "gyre.runtime.ActorStarted"]
    assert started_actors.count("pong") == 2 and started_actors.count("ping") == 1
    # Balls reached the second pong (ping's socket was moved to its new endpoint) and came back to ping.
    returned = int(result.reason.removeprefix("rally over: pong returned ").split(" of ")[0])
    assert returned > 0
