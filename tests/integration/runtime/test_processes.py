"""The command line end to end: `gyre run` across real processes over ZeroMQ (clean exit, merged log, clean
shutdown on SIGTERM/SIGINT with no orphans), seeded virtual runs that give byte-identical logs, and `gyre replay`
(identical, and a changed handler reported at the right message)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest
import structlog

from gyre.messages.ping_pong import Ball
from gyre.runtime import Codec, read_log
from gyre.runtime.event_log import MAGIC
from gyre.runtime.testing import gyre_cli

pytestmark = pytest.mark.timeout(180)

REPO = Path(__file__).resolve().parents[3]
PING_PONG = REPO / "examples" / "ping_pong.py"


def _gyre_command() -> list[str]:
    script = shutil.which("gyre")
    return [script] if script else [sys.executable, "-m", "gyre.runtime.cli"]


def _cli(argv: list[str]) -> int:
    """`gyre ARGV` in this process, runtime subcommands only (the full `gyre` imports every layer's plug-ins)."""
    return gyre_cli(argv)


#: A launcher process like `gyre`, minus the other layers' plug-ins (seconds of imports per start on 2 cores).
_LIGHT_GYRE = [sys.executable, "-c", "import sys; from gyre.runtime.testing import gyre_cli; sys.exit(gyre_cli(sys.argv[1:]))"]


@pytest.fixture(autouse=True)
def _keep_logging_config():
    """The subcommands configure structlog for a terminal; give the next test the configuration it had."""
    saved = structlog.get_config()
    yield
    structlog.configure(**saved)


# ---- processes ----------------------------------------------------------------------------------------------------
def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(state, parent pid) of a process from /proc, None if it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    rest = text.rsplit(")", 1)[1].split()
    return rest[0], int(rest[1])


def _descendants(root: int) -> set[int]:
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            stat = _proc_stat(int(entry))
            if stat is not None:
                parents.setdefault(stat[1], []).append(int(entry))
    found, frontier = set(), [root]
    while frontier:
        for child in parents.get(frontier.pop(), []):
            if child not in found:
                found.add(child)
                frontier.append(child)
    return found


def _comm(pid: int) -> str:
    """A process's name (/proc/PID/comm), "" if it is gone."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except (FileNotFoundError, ProcessLookupError):
        return ""


def _alive(pid: int) -> bool:
    stat = _proc_stat(pid)
    return stat is not None and stat[0] not in ("Z", "X")


def _wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout_s}s for {what}")
        time.sleep(0.05)


def _balls_in(segment: Path) -> int:
    """Balls recorded so far in a segment that its process is still writing (a torn tail is normal then)."""
    if not segment.exists() or segment.stat().st_size <= len(MAGIC):
        return 0
    return sum(1 for r in read_log(segment) if r.type_name == Ball.__gyre_type__)


def test_gyre_run_across_processes_exits_cleanly_with_a_merged_replayable_log(tmp_path, capsys) -> None:
    log = tmp_path / "run.glog"
    done = subprocess.run(
        [*_gyre_command(), "run", str(PING_PONG), "--log", str(log), "--", "--rounds", "10"],
        capture_output=True, text=True, timeout=150, cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert "rally over: pong returned 10 of 10 (exit 0)" in done.stderr
    assert not Path(str(log) + ".parts").exists()
    records = list(read_log(log))
    times = [r.handled_s for r in records]
    assert times == sorted(times)  # merged by time
    codec = Codec()
    started = sorted(r.decode(codec).actor for r in records if r.type_name == "gyre.runtime.ActorStarted")
    assert started == ["ping", "pong", "supervisor"]
    balls = [(r.envelope.sender, r.envelope.receiver, r.decode(codec)) for r in records if r.type_name == Ball.__gyre_type__]
    to_pong = [b for s, r, b in balls if r == "pong"]
    to_ping = [b for s, r, b in balls if r == "ping"]
    assert [b.number for b in to_pong] == [b.number for b in to_ping] == list(range(1, 11))
    assert [b.spin for b in to_ping] == [b.spin + 1 for b in to_pong]
    assert any(r.type_name == "gyre.runtime.StopTopology" for r in records)
    for actor in ("pong", "ping"):
        assert _cli(["replay", str(log), "--actor", actor]) == 0
        assert capsys.readouterr().out.startswith(f"identical: {actor} re-handled")
    assert _cli(["log", "stats", str(log)]) == 0
    assert f"records: {len(records)} " in capsys.readouterr().out


@contextlib.contextmanager
def _long_rally(topology_file: Path, log: Path, folder: Path) -> Iterator[subprocess.Popen]:
    """`gyre run` of a ping-pong topology with a rally that outlasts the test (stderr in folder/stderr.txt); the
    launcher's whole session is killed if the test leaves it running."""
    with open(folder / "stderr.txt", "wb") as stderr:
        launcher = subprocess.Popen(
            [*_LIGHT_GYRE, "run", str(topology_file), "--log", str(log), "--", "--rounds", "1000000"],
            stdout=subprocess.DEVNULL, stderr=stderr, cwd=folder, start_new_session=True,
        )
    try:
        yield launcher
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_to_the_launcher_shuts_everything_down_and_keeps_the_log(tmp_path, signum: int) -> None:
    log = tmp_path / "long.glog"
    with _long_rally(PING_PONG, log, tmp_path) as launcher:
        pong_segment = Path(str(log) + ".parts") / "pong.glog"
        # Running for real: pong's process has handled balls and flushed them to its segment of the log.
        _wait_for(lambda: _balls_in(pong_segment) > 0, 120.0, "pong to record its first balls")
        family = _descendants(launcher.pid)
        assert len(family) >= 2  # ping's and pong's processes (and multiprocessing's resource tracker)
        # Each group's process names itself, so that ps, top and benchmarks/studies/cpu_by_process.py tell them apart.
        assert {"gyre:ping", "gyre:pong"} <= {_comm(pid) for pid in family}
        launcher.send_signal(signum)
        assert launcher.wait(timeout=60) == 128 + signum
        _wait_for(lambda: not any(_alive(pid) for pid in family), 15.0, "every child process to end")
    stderr_text = (tmp_path / "stderr.txt").read_text()
    assert f"signal {signal.Signals(signum).name}" in stderr_text
    assert "Traceback" not in stderr_text
    assert not Path(str(log) + ".parts").exists()
    records = list(read_log(log))
    assert sum(1 for r in records if r.type_name == Ball.__gyre_type__ and r.envelope.receiver == "pong") >= 1


LIMITED_PING_PONG = """
import sys
sys.path.insert(0, {examples!r})
from ping_pong import topology as ping_pong_topology


def topology(argv):
    result = ping_pong_topology(argv)
    result.limit_cpu("pong", 0.5)
    return result
"""


def _cpu_group_of(pid: int) -> str:
    """The cgroup v1 `cpu` (or v2) path a process is in, "" if it is gone."""
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except (FileNotFoundError, ProcessLookupError):
        return ""
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "cpu" in controllers.split(",") or controllers == "":
            return path
    return ""


def test_a_cpu_limited_process_group_runs_in_its_own_cgroup_which_is_removed_after_the_run(
    tmp_path, writable_cgroup_cpu
) -> None:
    controller = writable_cgroup_cpu
    topology_file = tmp_path / "limited.py"
    topology_file.write_text(LIMITED_PING_PONG.format(examples=str(PING_PONG.parent)))
    log = tmp_path / "limited.glog"
    with _long_rally(topology_file, log, tmp_path) as launcher:
        _wait_for(lambda: _balls_in(Path(str(log) + ".parts") / "pong.glog") > 0, 120.0, "pong to handle balls")
        groups = {pid: _cpu_group_of(pid) for pid in _descendants(launcher.pid)}
        limited = [path for path in groups.values() if "/gyre-" in path]
        assert len(limited) == 1 and limited[0].endswith("/pong"), groups  # pong's process only, not ping's
        group_dir = controller.own_group / Path(limited[0]).parent.name / "pong"  # the run's group is ours' child
        quota_file = group_dir / ("cpu.cfs_quota_us" if controller.version == 1 else "cpu.max")
        assert quota_file.read_text().split()[0] == "50000"
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(timeout=60) == 128 + signal.SIGTERM
    assert not group_dir.exists() and not group_dir.parent.exists()
    assert "Traceback" not in (tmp_path / "stderr.txt").read_text()


# ---- determinism and replay ---------------------------------------------------------------------------------------
def test_seeded_virtual_runs_are_byte_identical(tmp_path) -> None:
    logs = {}
    for name, seed in (("a", 3), ("b", 3), ("c", 4)):
        logs[name] = tmp_path / f"{name}.glog"
        assert _cli(["run", str(PING_PONG), "--virtual", "--seed", str(seed), "--log", str(logs[name])]) == 0
    assert logs["a"].read_bytes() == logs["b"].read_bytes()
    assert logs["a"].read_bytes() != logs["c"].read_bytes()  # the seed reaches the actors' generators


def test_replay_reports_a_changed_handler_at_the_first_differing_message(tmp_path, capsys, monkeypatch) -> None:
    topology_file = tmp_path / "pp_changed.py"
    original = PING_PONG.read_text()
    topology_file.write_text(original)
    log = tmp_path / "v.glog"
    assert _cli(["run", str(topology_file), "--virtual", "--seed", "1", "--log", str(log)]) == 0
    module_name = "gyre_topology_pp_changed"
    monkeypatch.chdir(tmp_path)  # the topology file sits under the current directory, unchanged: it loads as it is
    for actor in ("ping", "pong"):
        assert _cli(["replay", str(log), "--actor", actor]) == 0
    capsys.readouterr()

    # The config is part of the log: another default for PongConfig.spin does not change the replay.
    topology_file.write_text(original.replace("    spin: int = 1\n", "    spin: int = 5\n"))
    sys.modules.pop(module_name, None)
    assert _cli(["replay", str(log), "--actor", "pong"]) == 2  # changed since the run: only --code loads it
    assert f"pass --code {topology_file}" in capsys.readouterr().err
    assert module_name not in sys.modules
    assert _cli(["replay", str(log), "--actor", "pong", "--code", str(topology_file)]) == 0
    capsys.readouterr()

    # A handler that answers ball 7 differently is caught at pong's 8th output (5 balls, a score reply, 2 balls).
    old_line = "self.tell(\"ping\", Ball(msg.number, msg.spin + self.config.spin))"
    assert old_line in original
    topology_file.write_text(original.replace(
        old_line, "self.tell(\"ping\", Ball(msg.number, msg.spin + self.config.spin + (1 if msg.number == 7 else 0)))"
    ))
    sys.modules.pop(module_name, None)
    codec = Codec()
    sent = {r.decode(codec).number: r.decode(codec).spin for r in read_log(log)
            if r.type_name == Ball.__gyre_type__ and r.envelope.sender == "pong"}
    assert _cli(["replay", str(log), "--actor", "pong", "--code", str(topology_file)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "DIFFERENT at output #7 of pong:"
    assert out[1].strip() == f"expected (log):  TELL to ping: Ball(number=7, spin={sent[7]})"
    assert out[2].strip() == f"got (replay):    TELL to ping: Ball(number=7, spin={sent[7] + 1})"
    assert _cli(["replay", str(log), "--actor", "ping", "--code", str(topology_file)]) == 0  # on the recorded balls
    sys.modules.pop(module_name, None)
    assert _cli(["replay", str(log), "--actor", "nobody"]) == 2
