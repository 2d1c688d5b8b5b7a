"""CPU limits per process group: a Linux cgroup CPU quota, so one process cannot run on more than N cores.

Why: on a GPU cluster every cell owns its accelerator. A cell that waits idles its own hardware, and another cell
cannot borrow it. On one CPU machine all processes share the cores, so a cell that stops working hands its CPU to
the others and every scheduling policy looks alike. `Topology.limit_cpu(process, cores)` gives a process group a
fixed budget of cores (a CFS bandwidth quota) and makes the CPU machine behave like separate devices: a cell's
throughput depends on its own work, not on what the other cells are doing. The local-process launcher applies the
limits; a single-process launcher cannot, and says so in its log.

Both cgroup layouts are handled. cgroup v1: the `cpu` controller's own mount, with `cpu.cfs_period_us` and
`cpu.cfs_quota_us`. cgroup v2: the unified hierarchy, `cpu.max`, with `cpu` enabled in the parent's
`cgroup.subtree_control`. The groups are made beneath the launcher's own cgroup, one folder per run
(`gyre-<pid>-<n>`), one subfolder per limited process, and removed when the run ends. Without a writable
controller (no root, a container that hides it) `CpuLimitsUnavailable` says so before any process starts.
"""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import attrs
import structlog

from gyre.runtime.errors import CpuLimitsUnavailable

log = structlog.get_logger("gyre.cpu_limits")

__all__ = ["CpuLimitsUnavailable", "CgroupCpu", "RunCpuGroups", "find_cgroup_cpu"]

PERIOD_US = 100_000
"""CFS period; the quota is `cores * PERIOD_US` microseconds of CPU per period."""
MIN_QUOTA_US = 1_000
"""The kernel's smallest quota (1 ms)."""

_RUN_NUMBERS = itertools.count()


@attrs.frozen
class CgroupCpu:
    """Where this process's cgroup CPU controller is, and which layout it has."""

    own_group: Path
    """The folder of the cgroup this process is in, under the controller's mount."""
    version: int
    """1 (the `cpu` controller mounted on its own) or 2 (the unified hierarchy)."""


def _mounts(mounts_text: str) -> list[tuple[str, str, set[str]]]:
    rows = []
    for line in mounts_text.splitlines():
        fields = line.split()
        if len(fields) >= 4:
            rows.append((fields[1], fields[2], set(fields[3].split(","))))
    return rows


def find_cgroup_cpu(mounts_text: str | None = None, cgroup_text: str | None = None) -> CgroupCpu:
    """The CPU controller of this process's cgroup, from /proc/self/mounts and /proc/self/cgroup (or the texts
    given, for tests). Raises CpuLimitsUnavailable when there is none."""
    mounts_text = Path("/proc/self/mounts").read_text() if mounts_text is None else mounts_text
    cgroup_text = Path("/proc/self/cgroup").read_text() if cgroup_text is None else cgroup_text
    own_paths: dict[str, str] = {}
    for line in cgroup_text.splitlines():
        _, _, rest = line.partition(":")  # "<hierarchy id>:<controllers>:<path>"; v2's controllers are empty
        controllers, _, path = rest.partition(":")
        for controller in controllers.split(",") if controllers else ["<v2>"]:
            own_paths[controller] = path
    for mount_point, fs_type, options in _mounts(mounts_text):
        if fs_type == "cgroup" and "cpu" in options and "cpu" in own_paths:
            return CgroupCpu(Path(mount_point) / own_paths["cpu"].lstrip("/"), 1)
    for mount_point, fs_type, _ in _mounts(mounts_text):
        if fs_type == "cgroup2" and "<v2>" in own_paths:
            group = Path(mount_point) / own_paths["<v2>"].lstrip("/")
            controllers = (group / "cgroup.controllers")
            if controllers.is_file() and "cpu" in controllers.read_text().split():
                return CgroupCpu(group, 2)
    raise CpuLimitsUnavailable(
        "CPU limits need a cgroup CPU controller (cgroup v1 `cpu`, or v2 with `cpu` available); none is mounted "
        "for this process"
    )


def _write(path: Path, text: str) -> None:
    try:
        path.write_text(text)
    except OSError as error:
        raise CpuLimitsUnavailable(f"cannot write {path}: {error.strerror or error}; CPU limits need write access "
                                   "to the cgroup CPU controller (root, or a delegated cgroup)") from error


class RunCpuGroups:
    """The cgroups of one run: one per limited process group, made by `create`, joined by `add_process`, removed by
    `remove`. Nothing is touched before `create`."""

    def __init__(self, cores_by_process: dict[str, float], controller: CgroupCpu | None = None) -> None:
        for process, cores in cores_by_process.items():
            if not cores > 0:
                raise ValueError(f"{process}: a CPU limit must be a positive number of cores, got {cores!r}")
        self.cores_by_process = dict(cores_by_process)
        self._controller = controller
        self.run_group: Path | None = None

    def create(self) -> None:
        """Make the run's folder and a limited group per process; on failure nothing is left behind."""
        if not self.cores_by_process:
            return
        controller = self._controller or find_cgroup_cpu()
        if controller.version == 2:
            _delegate_cpu(controller.own_group)
        self.run_group = controller.own_group / f"gyre-{os.getpid()}-{next(_RUN_NUMBERS)}"
        try:
            self.run_group.mkdir()
        except OSError as error:
            self.run_group = None
            raise CpuLimitsUnavailable(f"cannot make a cgroup under {controller.own_group}: "
                                       f"{error.strerror or error}") from error
        try:
            if controller.version == 2:
                _write(self.run_group / "cgroup.subtree_control", "+cpu")
            for process, cores in self.cores_by_process.items():
                group = self.run_group / process
                group.mkdir()
                quota_us = max(MIN_QUOTA_US, round(cores * PERIOD_US))
                if controller.version == 1:
                    _write(group / "cpu.cfs_period_us", str(PERIOD_US))
                    _write(group / "cpu.cfs_quota_us", str(quota_us))
                else:
                    _write(group / "cpu.max", f"{quota_us} {PERIOD_US}")
        except BaseException:
            self.remove()
            raise
        log.info("cpu_limits_created", group=str(self.run_group), cores=self.cores_by_process)

    def add_process(self, process: str, pid: int) -> None:
        """Move a running OS process (all its threads; its later children too) into its group's limit."""
        if process not in self.cores_by_process:
            return
        assert self.run_group is not None, "create() first"
        _write(self.run_group / process / "cgroup.procs", str(pid))

    def remove(self) -> None:
        """Remove the run's groups. Their processes must have exited (a group with members cannot be removed; it is
        then left in place and logged)."""
        if self.run_group is None:
            return
        for group in sorted(self.run_group.iterdir(), reverse=True) if self.run_group.is_dir() else []:
            if group.is_dir():
                _rmdir_quietly(group)
        _rmdir_quietly(self.run_group)
        self.run_group = None


def _delegate_cpu(group: Path) -> None:
    """cgroup v2: a child group gets `cpu.max` only if its parent enables `cpu` for its children. The kernel refuses
    that for a non-root group that holds processes itself, which surfaces here as CpuLimitsUnavailable."""
    subtree = group / "cgroup.subtree_control"
    enabled = subtree.read_text().split() if subtree.is_file() else []
    if "cpu" not in enabled:
        _write(subtree, "+cpu")


def _rmdir_quietly(group: Path) -> None:
    try:
        group.rmdir()
    except OSError as error:
        log.warning("cpu_limit_group_not_removed", group=str(group), error=str(error))
