"""CPU limits per process group (runtime/cpu_limits.py): finding the cgroup CPU controller in both layouts, the
quota files a limit writes, a real limit on a real process where this machine allows it, and the clear error where
it does not."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from gyre.runtime.cpu_limits import PERIOD_US, CgroupCpu, CpuLimitsUnavailable, RunCpuGroups, find_cgroup_cpu
from gyre.runtime.actor import Actor
from gyre.runtime.errors import TopologyError
from gyre.runtime.topology import Topology

V1_MOUNTS = """\
tmpfs /sys/fs/cgroup tmpfs rw,relatime,mode=755 0 0
cgroup /sys/fs/cgroup/cpu,cpuacct cgroup rw,relatime,cpu,cpuacct 0 0
cgroup /sys/fs/cgroup/memory cgroup rw,relatime,memory 0 0
"""
V1_CGROUP = "4:memory:/a\n3:cpu,cpuacct:/jobs/7\n0::/\n"


def test_v1_controller_is_found_under_this_process_own_group() -> None:
    found = find_cgroup_cpu(V1_MOUNTS, V1_CGROUP)
    assert found == CgroupCpu(Path("/sys/fs/cgroup/cpu,cpuacct/jobs/7"), 1)


def test_v2_controller_needs_cpu_among_the_groups_controllers(tmp_path) -> None:
    group = tmp_path / "user.slice"
    group.mkdir()
    mounts = f"cgroup2 {tmp_path} cgroup2 rw,nosuid 0 0\n"
    (group / "cgroup.controllers").write_text("memory pids\n")
    with pytest.raises(CpuLimitsUnavailable, match="none is mounted"):
        find_cgroup_cpu(mounts, "0::/user.slice\n")
    (group / "cgroup.controllers").write_text("cpu memory pids\n")
    assert find_cgroup_cpu(mounts, "0::/user.slice\n") == CgroupCpu(group, 2)


def test_no_controller_is_a_clear_error() -> None:
    with pytest.raises(CpuLimitsUnavailable, match="cgroup CPU controller"):
        find_cgroup_cpu("proc /proc proc rw 0 0\n", "0::/\n")


@pytest.mark.parametrize("version, file, text", [(1, "cpu.cfs_quota_us", "25000"), (2, "cpu.max", f"25000 {PERIOD_US}")])
def test_a_limit_writes_its_quota_per_process_group(tmp_path, version: int, file: str, text: str) -> None:
    groups = RunCpuGroups({"sat1": 0.25}, CgroupCpu(tmp_path, version))
    groups.create()
    assert groups.run_group is not None and groups.run_group.parent == tmp_path
    assert (groups.run_group / "sat1" / file).read_text() == text
    if version == 1:
        assert (groups.run_group / "sat1" / "cpu.cfs_period_us").read_text() == str(PERIOD_US)
    else:  # cpu is enabled for the children of our own group and of the run's group
        assert (tmp_path / "cgroup.subtree_control").read_text() == "+cpu"
        assert (groups.run_group / "cgroup.subtree_control").read_text() == "+cpu"


def test_an_unwritable_controller_fails_at_create_and_leaves_nothing(tmp_path) -> None:
    missing = tmp_path / "not-a-cgroup"
    with pytest.raises(CpuLimitsUnavailable, match="cannot make a cgroup"):
        RunCpuGroups({"core": 1.0}, CgroupCpu(missing, 1)).create()
    assert not missing.exists()


def test_limits_must_be_positive() -> None:
    with pytest.raises(ValueError, match="positive"):
        RunCpuGroups({"core": 0.0})


def test_no_limits_touch_nothing() -> None:
    groups = RunCpuGroups({}, CgroupCpu(Path("/nonexistent"), 1))
    groups.create()
    groups.add_process("core", os.getpid())
    groups.remove()
    assert groups.run_group is None


class Idle(Actor):
    """An actor that handles nothing: enough to give a topology process groups."""


def test_topology_limit_cpu_checks_the_process_and_the_cores() -> None:
    topology = Topology("t")
    topology.add("ping", Idle)
    topology.add("pong", Idle, process="far")
    topology.limit_cpu("far", 0.5)
    assert topology.cpu_cores_by_process == {"far": 0.5}
    with pytest.raises(TopologyError, match="no process group 'pong'"):
        topology.limit_cpu("pong", 0.5)
    with pytest.raises(TopologyError, match="positive"):
        topology.limit_cpu("ping", -1)


def test_a_real_limit_throttles_a_busy_process_and_is_removed_after_it(writable_cgroup_cpu: CgroupCpu) -> None:
    groups = RunCpuGroups({"busy": 0.2}, writable_cgroup_cpu)
    groups.create()
    assert groups.run_group is not None
    run_group = groups.run_group
    pid = os.fork()
    if pid == 0:  # a busy child: spin until killed
        while True:
            pass
    try:
        groups.add_process("busy", pid)
        assert f"/{run_group.name}/busy" in Path(f"/proc/{pid}/cgroup").read_text()
        stat = run_group / "busy" / ("cpu.stat")
        deadline = time.monotonic() + 30.0
        while "nr_throttled 0\n" in stat.read_text() and time.monotonic() < deadline:
            time.sleep(0.1)  # waits for an event, asserts no duration
        assert "nr_throttled 0\n" not in stat.read_text(), "a spinning process over its quota is throttled"
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    groups.remove()
    assert not run_group.exists()
