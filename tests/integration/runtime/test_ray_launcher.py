"""The Ray launcher on a real two-node Ray cluster on this machine (`ray.cluster_utils.Cluster`, 1 CPU per node,
on 127.0.0.1 only): ping and pong as two Ray actors on two nodes, the log gathered from both, merged and replayable;
a process group whose worker dies ends the run with status 1 naming its node and last lines, or is started again
by its RestartPolicy. One cluster for the module: Ray's start-up is most of each test's time."""

from __future__ import annotations

import os
import subprocess
import sys
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
from gyre.runtime.testing import gyre_cli  # noqa: E402
from gyre.runtime.topology import load_topology_file  # noqa: E402

pytestmark = pytest.mark.timeout(120)

REPO = Path(__file__).resolve().parents[3]
PING_PONG = REPO / "examples" / "ping_pong.py"
CRASH = Path(__file__).with_name("ray_crash_topology.py")


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    if ray.is_initialized():
        ray.shutdown()
    nodes = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "node_ip_address": "127.0.0.1", "include_dashboard": False})
    nodes.add_node(num_cpus=1, node_ip_address="127.0.0.1", resources={"node_b": 1})
    nodes.wait_for_nodes()
    ray.init(address=nodes.address, log_to_driver=False)
    try:
        addresses = {node["NodeManagerAddress"] for node in ray.nodes() if node["Alive"]}
        assert addresses == {"127.0.0.1"}, f"Ray left loopback: {addresses} (was ray imported before this module?)"
        yield nodes
    finally:
        ray.shutdown()
        nodes.shutdown()


def _launch(file: Path, argv: list[str], log_path: Path, place_timeout_s: float = 30.0) -> tuple[RayLauncher, object]:
    launcher = RayLauncher(str(file), tuple(argv), None, "connected", RayLaunchConfig(place_timeout_s=place_timeout_s))
    result = launcher.run(load_topology_file(file, argv), RunOptions(log_path=str(log_path), until_s=60.0))
    return launcher, result


def test_ping_and_pong_run_on_two_nodes_and_their_log_is_merged_and_replayable(cluster, tmp_path: Path) -> None:
    log_path = tmp_path / "ping.glog"
    launcher, result = _launch(PING_PONG, [], log_path)
    assert (result.exit_code, result.reason) == (0, "rally over: pong returned 20 of 20")
    # Each node has 1 CPU and each group reserves 1: the SPREAD bundles can only land one per node.
    assert launcher.placement["ping"].node_id != launcher.placement["pong"].node_id
    alive = {node["NodeID"] for node in ray.nodes() if node["Alive"]}
    assert {launcher.placement["ping"].node_id, launcher.placement["pong"].node_id} == alive
    # The GCS agrees on where the hosts ran (they are dead now; the table keeps them).
    ran_on = {row["Address"]["NodeID"] for row in ray._private.state.actors().values()
              if row.get("Name", "").endswith((":ping:0", ":pong:0"))}
    assert ran_on == alive
    records = list(read_log(log_path, Codec()))
    handlers = {record.envelope.receiver for record in records}
    assert {"ping", "pong", "supervisor"} <= handlers
    balls = [r for r in records if r.type_name == "gyre.ping_pong.Ball"]
    assert len(balls) == 40  # 20 served (handled by pong) + 20 returned (handled by ping), from both nodes' segments
    assert [r.handled_s for r in records] == sorted(r.handled_s for r in records)
    assert not log_path.with_name("ping.glog.parts").exists()
    assert gyre_cli(["replay", str(log_path), "--actor", "pong"]) == 0


def test_a_dead_process_group_with_stop_topology_ends_the_run_naming_its_node(cluster, tmp_path: Path) -> None:
    marker = tmp_path / "died"
    argv = ["--marker", str(marker), "--mode", "stop_topology", "--crash-at", "20"]
    launcher, result = _launch(CRASH, argv, tmp_path / "crash.glog")
    assert marker.exists()
    assert result.exit_code == 1
    assert "process group pong died on node 127.0.0.1" in result.reason
    assert launcher.placement["pong"].node_id[:12] in result.reason
    assert "crashing_pong_armed" in result.reason  # its last lines, pulled before it died
    assert launcher.restarts == {}
    # What pong recorded before the launcher's last pull was gathered: at least its start, pulled first.
    started = [r.decode(Codec()).actor for r in read_log(tmp_path / "crash.glog", Codec())
               if r.type_name == "gyre.runtime.ActorStarted"]
    assert sorted(started) == ["ping", "pong", "supervisor"]


def test_a_dead_process_group_with_restart_is_started_again_and_the_run_completes(cluster, tmp_path: Path) -> None:
    marker = tmp_path / "died"
    # No asks during the rally: an ask sent to the dead pong would wait out its 30 s timeout.
    argv = ["--marker", str(marker), "--mode", "restart", "--crash-at", "10", "--rounds", "60", "--ask-every", "1000"]
    launcher, result = _launch(CRASH, argv, tmp_path / "restart.glog")
    assert marker.exists()
    assert launcher.restarts == {"pong": 1}
    assert result.exit_code == 0, result.reason
    assert result.reason.startswith("rally over: pong returned ")
    records = list(read_log(tmp_path / "restart.glog", Codec()))
    started = [r.decode(Codec()).actor for r in records if r.type_name == "gyre.runtime.ActorStarted"]
    assert started.count("pong") == 2  # each incarnation's start, pulled before anything else
    after = [r for r in records if r.envelope.receiver == "pong" and r.type_name == "gyre.ping_pong.Ball"
             and r.decode(Codec()).number > 10]
    assert after  # the second pong's segment was gathered too


def test_gyre_run_with_ray_address_runs_against_the_cluster_as_it_is(cluster, tmp_path: Path) -> None:
    log_path = tmp_path / "cli.glog"
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    completed = subprocess.run(
        [sys.executable, "-m", "gyre.runtime.cli", "run", str(PING_PONG), "--ray", cluster.address,
         "--log", str(log_path), "--", "--rounds", "8"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=90,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert "rally over: pong returned 8 of 8 (exit 0)" in completed.stderr
    assert sum(r.type_name == "gyre.ping_pong.Ball" for r in read_log(log_path, Codec())) == 16


def test_gyre_run_refuses_virtual_with_ray() -> None:
    assert gyre_cli(["run", str(PING_PONG), "--virtual", "--ray", "local"]) == 2


def _node_with(resource: str) -> str:
    return next(node["NodeID"] for node in ray.nodes() if node["Alive"] and resource in node["Resources"])


def test_a_custom_resource_pins_a_group_and_a_pack_shares_one_node(cluster, tmp_path: Path) -> None:
    launcher, result = _launch(CRASH, ["--rounds", "5", "--pong-needs", "node_b"], tmp_path / "pinned.glog")
    assert result.exit_code == 0, result.reason
    assert launcher.placement["pong"].node_id == _node_with("node_b")
    assert launcher.placement["ping"].node_id != launcher.placement["pong"].node_id  # 1 CPU a node
    launcher, result = _launch(CRASH, ["--rounds", "5", "--pack"], tmp_path / "packed.glog")
    assert result.exit_code == 0, result.reason
    assert launcher.placement["ping"].node_id == launcher.placement["pong"].node_id


def test_resources_the_cluster_lacks_end_the_run_with_a_message_instead_of_waiting(cluster, tmp_path: Path) -> None:
    launcher, result = _launch(CRASH, ["--pong-gpus", "1"], tmp_path / "gpu.glog", place_timeout_s=3.0)
    assert result.exit_code == 1
    assert "could not reserve" in result.reason and "'GPU': 1.0" in result.reason
    assert launcher.placement == {}
    assert not (tmp_path / "gpu.glog.parts").exists()
    # The reservation was given back: the next run places as usual.
    launcher, result = _launch(CRASH, ["--rounds", "3"], tmp_path / "after.glog")
    assert result.exit_code == 0, result.reason



def test_gyre_run_ray_local_starts_a_loopback_ray_that_offers_what_the_topology_reserves(tmp_path: Path) -> None:
    # A custom resource no machine has: `local` offers the topology's own demand, so any topology runs on one machine.
    completed = subprocess.run(
        [sys.executable, "-m", "gyre.runtime.cli", "run", str(CRASH), "--ray", "local", "--log",
         str(tmp_path / "local.glog"), "--", "--rounds", "5", "--pong-needs", "made_up_accelerator"],
        cwd=tmp_path, env={k: v for k, v in os.environ.items() if not k.startswith("RAY_")},
        capture_output=True, text=True, timeout=90,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert "rally over: pong returned 5 of 5 (exit 0)" in completed.stderr
    assert '"node_ip": "127.0.0.1"' in completed.stderr and "process_group_placed" in completed.stderr
