"""The executor with real agent subprocesses; a driver actor stands in for the proxy, the evaluator and the builder.

What the executor did is read back from the run's event log (every delivered message is recorded there).
"""

from __future__ import annotations

import json
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import attrs
import pytest

from gyre.actors.executions.executor import (
    AGENT_STDERR,
    AGENT_STDOUT,
    Executor,
    ExecutorConfig,
    PROXY_STOPPED,
    safe_path_component,
    task_problem,
)
from gyre.messages.execution_stats import ExecutorStatistics
from gyre.messages.runtime_control import StatisticsAsked
from gyre.messages.executions import (
    ExecutionFinished,
    ExecutionEnded,
    ExecutionStarted,
    IssueKey,
    KeyIssued,
    RevokeKey,
    StartGroup,
    TaskSpec,
)
from gyre.messages.groups import GroupStarted
from gyre.messages.samples import ExecutionDropped
from gyre.runtime import (
    Actor, ActorDead, Codec, InProcessLauncher, RestartPolicy, RunOptions, Topology, handler, read_log,
)
from gyre.runtime.testing import capture_logs

ENV_KEYS = (
    "OPENAI_BASE_URL", "OPENAI_API_KEY", "ANTHROPIC_BASE_URL", "ANTHROPIC_API_KEY", "GYRE_EXECUTION_ID",
    "GYRE_GROUP_ID", "EXTRA_FOR_AGENT",
)


@attrs.frozen
class DriverConfig:
    groups: tuple[StartGroup, ...]
    """Sent to the executor at start."""
    expected_outcomes: int
    """ExecutionFinished + ExecutionDropped + refused GroupStarted to wait for before stopping."""
    refuse_keys: bool = False
    """Answer IssueKey with an error."""
    release_file: str = ""
    """If set: after `release_after_started` ExecutionStarted, ask the executor's statistics, then create this file."""
    release_after_started: int = 0


class Driver(Actor):
    """The proxy, evaluator and builder as far as the executor can tell; stops the run when all is heard."""

    config_cls = DriverConfig
    subscriptions = (GroupStarted, ExecutionStarted, ExecutionEnded)

    async def on_start(self) -> None:
        self.outcomes = 0
        self.started = 0
        for group in self.config.groups:
            self.tell("executor", group)

    @handler(IssueKey)
    def on_issue_key(self, msg: IssueKey) -> KeyIssued:
        if self.config.refuse_keys:
            raise ValueError("no keys today")
        return KeyIssued(f"key-{msg.execution_id}", "http://127.0.0.1:9/v1", "http://127.0.0.1:9")

    @handler(RevokeKey)
    def on_revoke(self, msg: RevokeKey) -> None:
        pass

    @handler(ExecutionEnded)
    def on_ended(self, msg: ExecutionEnded) -> None:
        pass

    @handler(ExecutionStarted)
    async def on_started(self, msg: ExecutionStarted) -> None:
        self.started += 1
        if self.config.release_file and self.started == self.config.release_after_started:
            await self.ask("executor", StatisticsAsked())
            Path(self.config.release_file).write_text("go")

    @handler(GroupStarted)
    async def on_group(self, msg: GroupStarted) -> None:
        if msg.refused:
            await self._outcome()

    @handler(ExecutionFinished, ExecutionDropped)
    async def on_outcome(self, msg: Any) -> None:
        await self._outcome()

    async def _outcome(self) -> None:
        self.outcomes += 1
        if self.outcomes == self.config.expected_outcomes:
            await self.ask("executor", StatisticsAsked())
            self.stop_topology("done")


def run(tmp_path: Path, driver: DriverConfig, **executor: Any) -> tuple[Path, dict[str, list[Any]]]:
    """Run executor + driver; return the log path and the messages the driver (or the executor) received, by type."""
    root = tmp_path / "executions"
    topology = Topology("executor-test", seed=0)
    topology.add("executor", Executor, ExecutorConfig(workspace_root=str(root), proxy="driver", evaluator="driver",
                                                       builder="driver", **executor))
    topology.add("driver", Driver, driver)
    log_path = tmp_path / "run.glog"
    result = InProcessLauncher().run(topology, RunOptions(log_path=str(log_path), until_s=60.0))
    assert result.reason == "done", result
    codec = Codec()
    received: dict[str, list[Any]] = {}
    for record in read_log(log_path):
        if record.envelope.receiver in ("driver", "~client.launcher") or record.type_name.endswith("Statistics"):
            received.setdefault(record.type_name.rsplit(".", 1)[-1], []).append(record.decode(codec))
    return root, received


def task(agent_script: str, *, timeout_s: float = 30.0, files: dict[str, str] | None = None,
         agent_argv: tuple[str, ...] | None = None) -> TaskSpec:
    return TaskSpec(
        task_id="t1",
        prompt="do the thing",
        workspace_files=files or {},
        agent_argv=agent_argv or (sys.executable, "-c", textwrap.dedent(agent_script)),
        scorer_argv=(sys.executable, "-c", "print('{\"reward\": 1}')"),
        timeout_s=timeout_s,
        scorer_timeout_s=5.0,
    )


RECORD_ENV = f"""
import json, os, pathlib, sys
keys = {ENV_KEYS!r}
pathlib.Path("seen.json").write_text(json.dumps({{
    "argv": sys.argv[1:], "cwd": os.getcwd(), "env": {{k: os.environ.get(k) for k in keys}},
    "files": sorted(str(p) for p in pathlib.Path(".").rglob("*")),
}}))
print("to stdout")
print("to stderr", file=sys.stderr)
"""


def test_group_runs_agents_in_fresh_workspaces_with_the_proxy_env(tmp_path: Path) -> None:
    spec = task(RECORD_ENV, files={"data/in.txt": "42", "top.txt": "x"})
    root, got = run(
        tmp_path, DriverConfig((StartGroup("grp", spec, 3, 7),), expected_outcomes=3),
        extra_env={"EXTRA_FOR_AGENT": "yes", "OPENAI_API_KEY": "must be overridden"},
    )
    (announced,) = got["GroupStarted"]
    assert announced == GroupStarted("grp", "t1", 3, ("grp.0", "grp.1", "grp.2"), 7, "")
    finished = {m.execution_id: m for m in got["ExecutionFinished"]}
    assert sorted(finished) == ["grp.0", "grp.1", "grp.2"]
    assert sorted(m.execution_id for m in got["RevokeKey"]) == sorted(finished)
    assert sorted(m.execution_id for m in got["ExecutionStarted"]) == sorted(finished)
    assert sorted((m.execution_id, m.group_id) for m in got["ExecutionEnded"]) == [(e, "grp") for e in sorted(finished)]
    workspaces = set()
    for execution_id, msg in finished.items():
        assert (msg.exit_code, msg.timed_out, msg.group_id, msg.task) == (0, False, "grp", spec)
        workspace = Path(msg.workspace)
        assert workspace.is_dir() and root in workspace.parents
        workspaces.add(workspace)
        seen = json.loads((workspace / "seen.json").read_text())
        assert seen["argv"] == ["do the thing"]
        assert Path(seen["cwd"]).resolve() == workspace.resolve()
        assert seen["env"] == {
            "OPENAI_BASE_URL": "http://127.0.0.1:9/v1",
            "OPENAI_API_KEY": f"key-{execution_id}",
            "ANTHROPIC_BASE_URL": "http://127.0.0.1:9",
            "ANTHROPIC_API_KEY": f"key-{execution_id}",
            "GYRE_EXECUTION_ID": execution_id,
            "GYRE_GROUP_ID": "grp",
            "EXTRA_FOR_AGENT": "yes",
        }
        assert seen["files"] == ["data", "data/in.txt", "top.txt"]  # fresh: only the task's files
        logs = workspace.parent / "logs"
        assert (logs / AGENT_STDOUT).read_text() == "to stdout\n"
        assert (logs / AGENT_STDERR).read_text() == "to stderr\n"
        assert not any(p.name.endswith(".log") for p in workspace.rglob("*"))  # logs are not in the workspace
    assert len(workspaces) == 3
    (stats,) = got["ExecutorStatistics"]
    assert (stats.groups_started, stats.executions_launched, stats.executions_finished, stats.running) == (1, 3, 3, 0)


HANG_AFTER_PARTIAL_ANSWER = """
import pathlib, signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)   # only SIGKILL ends it
child = subprocess.Popen([sys.executable, "-c",
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"])
pathlib.Path("child.pid").write_text(str(child.pid))
pathlib.Path("answer.txt").write_text("partial")
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")


def _dies(pid: int, within_s: float = 10.0) -> bool:
    """Whether the process is gone (or a zombie) within `within_s`: a SIGKILL is delivered asynchronously."""
    deadline = time.monotonic() + within_s
    while _alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_timeout_kills_the_whole_process_group_and_keeps_the_workspace(tmp_path: Path) -> None:
    hang = task(HANG_AFTER_PARTIAL_ANSWER, timeout_s=4.0)
    fail = attrs.evolve(task("import sys; sys.exit(3)"), task_id="t2")
    _, got = run(
        tmp_path,
        DriverConfig((StartGroup("hang", hang, 1, 0), StartGroup("fail", fail, 1, 0)), expected_outcomes=2),
        kill_grace_s=0.3,
    )
    finished = {m.group_id: m for m in got["ExecutionFinished"]}
    assert (finished["fail"].exit_code, finished["fail"].timed_out) == (3, False)
    timed_out = finished["hang"]
    assert timed_out.timed_out and timed_out.exit_code == -9  # SIGTERM ignored: SIGKILL after the grace time
    workspace = Path(timed_out.workspace)
    assert (workspace / "answer.txt").read_text() == "partial"  # preserved for scoring
    assert _dies(int((workspace / "child.pid").read_text()))  # the agent's own subprocess died with it
    assert sorted(m.execution_id for m in got["RevokeKey"]) == ["fail.0", "hang.0"]
    assert got["ExecutorStatistics"][0].executions_timed_out == 1


WAIT_FOR_RELEASE = """
import os, pathlib, time
release = pathlib.Path(os.environ["RELEASE_FILE"])
while not release.exists():
    time.sleep(0.02)
"""


def test_concurrency_is_bounded(tmp_path: Path) -> None:
    release = tmp_path / "release"
    _, got = run(
        tmp_path,
        DriverConfig(
            (StartGroup("g", task(WAIT_FOR_RELEASE), 5, 0),),
            expected_outcomes=5,
            release_file=str(release),
            release_after_started=2,
        ),
        max_concurrent=2,
        extra_env={"RELEASE_FILE": str(release)},
    )
    first = got["ExecutorStatistics"][0]  # asked when two agents were running and none could finish
    assert (first.running, first.queued, first.executions_launched) == (2, 3, 2)
    assert sorted(m.execution_id for m in got["ExecutionFinished"]) == [f"g.{i}" for i in range(5)]
    assert all(m.exit_code == 0 for m in got["ExecutionFinished"])


def test_no_key_drops_the_executions_without_running_anything(tmp_path: Path) -> None:
    spec = task("import pathlib; pathlib.Path('ran').write_text('')")
    root, got = run(tmp_path, DriverConfig((StartGroup("g", spec, 2, 0),), expected_outcomes=2, refuse_keys=True))
    dropped = got["ExecutionDropped"]
    assert sorted(m.execution_id for m in dropped) == ["g.0", "g.1"]
    assert all("no API key" in m.reason and "no keys today" in m.reason for m in dropped)
    assert "ExecutionFinished" not in got and "ExecutionStarted" not in got and "RevokeKey" not in got
    assert "ExecutionEnded" not in got  # no key, no session anywhere
    assert not list(root.rglob("ran"))
    assert got["ExecutorStatistics"][0].executions_failed == 2


class StoppedProxy(Actor):
    """A proxy that stops as it starts: every IssueKey it is asked fails with ActorDead, as at a run's end."""

    async def on_start(self) -> None:
        raise RuntimeError("stopped before any key")


class DriverAfterTheProxy(Driver):
    async def on_start(self) -> None:
        try:  # queued behind the proxy's failing start: by the time this returns the proxy is dead
            await self.ask("proxy", IssueKey("probe", "probe"))
        except ActorDead:
            pass
        await super().on_start()


def test_a_stopped_proxy_drops_the_executions_with_a_line_at_powers_of_two(tmp_path: Path) -> None:
    # At the end of a main-job run the proxy stops before the executor's queue is empty; each queued execution
    # then failed to get a key and logged an error line (166 at the end of one run).
    spec = task("import pathlib; pathlib.Path('ran').write_text('')")
    root = tmp_path / "executions"
    topology = Topology("executor-test", seed=0)
    topology.add("executor", Executor, ExecutorConfig(workspace_root=str(root), proxy="proxy", evaluator="driver",
                                                       builder="driver"))
    topology.add("proxy", StoppedProxy, restart=RestartPolicy("stop_actor"))
    topology.add("driver", DriverAfterTheProxy, DriverConfig((StartGroup("g", spec, 5, 0),), expected_outcomes=5))
    log_path = tmp_path / "run.glog"
    with capture_logs() as logs:
        result = InProcessLauncher().run(topology, RunOptions(log_path=str(log_path), until_s=60.0))
    assert result.reason == "done", result
    codec = Codec()
    dropped = [r.decode(codec) for r in read_log(log_path) if r.type_name.endswith("ExecutionDropped")]
    assert sorted(m.execution_id for m in dropped) == [f"g.{i}" for i in range(5)]
    assert {m.reason for m in dropped} == {PROXY_STOPPED}
    events = [e for e in logs if e["event"].startswith("execution")]
    thinned = [("executions_not_started_proxy_stopped", n) for n in (1, 2, 4)]
    assert [(e["event"], e["count"]) for e in events] == thinned
    assert not list(root.rglob("ran"))
    stats = [r.decode(codec) for r in read_log(log_path) if r.type_name.endswith("ExecutorStatistics")]
    assert stats[-1].executions_failed == 5


def test_agent_that_cannot_start_is_dropped_and_its_key_revoked(tmp_path: Path) -> None:
    spec = task("", agent_argv=(str(tmp_path / "no-such-agent"),))
    _, got = run(tmp_path, DriverConfig((StartGroup("g", spec, 1, 0),), expected_outcomes=1))
    (dropped,) = got["ExecutionDropped"]
    assert dropped.execution_id == "g.0" and "agent did not start" in dropped.reason
    assert [m.execution_id for m in got["RevokeKey"]] == ["g.0"]
    assert [m.execution_id for m in got["ExecutionEnded"]] == ["g.0"]  # its key was out: cells may have seen it


def test_bad_groups_are_refused_and_announced(tmp_path: Path) -> None:
    good = task("pass")
    escaping = attrs.evolve(good, workspace_files={"../outside.txt": "x"})
    groups = (
        StartGroup("escape", escaping, 2, 0),
        StartGroup("empty", good, 0, 0),
        StartGroup("huge", good, 10, 0),
        StartGroup("ok", good, 1, 0),
    )
    _, got = run(tmp_path, DriverConfig(groups, expected_outcomes=4), max_group_size=8)
    refused = {m.group_id: m.refused for m in got["GroupStarted"] if m.refused}
    assert sorted(refused) == ["empty", "escape", "huge"]
    assert "not a relative path inside the workspace" in refused["escape"]
    assert [m.execution_id for m in got["ExecutionFinished"]] == ["ok.0"]
    assert not (tmp_path / "outside.txt").exists()
    stats = got["ExecutorStatistics"][0]
    assert (stats.groups_started, stats.groups_refused) == (1, 3)


@pytest.mark.parametrize(
    "change, problem",
    [
        ({"agent_argv": ()}, "agent_argv"),
        ({"scorer_argv": ("",)}, "scorer_argv"),
        ({"timeout_s": 0.0}, "timeout_s"),
        ({"scorer_timeout_s": float("inf")}, "scorer_timeout_s"),
        ({"workspace_files": {"/etc/x": ""}}, "relative path"),
        ({"workspace_files": {"a/../../x": ""}}, "relative path"),
    ],
)
def test_task_problems(change: dict[str, Any], problem: str) -> None:
    assert task_problem(task("pass")) is None
    found = task_problem(attrs.evolve(task("pass"), **change))
    assert found is not None and problem in found


def test_safe_path_component() -> None:
    assert safe_path_component("g000001") == "g000001"
    assert safe_path_component("..") != ".."
    odd = safe_path_component("a/b c")
    assert "/" not in odd and odd != safe_path_component("a_b c") and odd != safe_path_component("a/b_c")


def test_warm_launches_give_the_same_outcomes_as_plain_ones(tmp_path: Path) -> None:
    """The fork server on: `python agent.py` agents are forked warm (preload already imported), with the same argv,
    env, workspace, logs, exit codes and group kill at the time limit; a `-c` agent is exec'd the plain way."""
    record = RECORD_ENV + "pathlib.Path('preloaded').write_text(str('colorsys' in sys.modules))\n"

    def script_task(task_id: str, body: str, timeout_s: float = 30.0) -> TaskSpec:
        return attrs.evolve(task("", files={"agent.py": textwrap.dedent(body), "data/in.txt": "42"},
                                 agent_argv=(sys.executable, "agent.py"), timeout_s=timeout_s), task_id=task_id)

    groups = (
        StartGroup("rec", script_task("t1", record), 2, 0),
        StartGroup("fail", script_task("t2", "import sys; sys.exit(3)"), 1, 0),
        StartGroup("hang", script_task("t3", HANG_AFTER_PARTIAL_ANSWER, timeout_s=4.0), 1, 0),
        StartGroup("cold", attrs.evolve(task("import sys; sys.exit(5)"), task_id="t4"), 1, 0),
    )
    _, got = run(tmp_path, DriverConfig(groups, expected_outcomes=5), kill_grace_s=0.3,
                 extra_env={"EXTRA_FOR_AGENT": "yes"}, warm_launcher_preload=("colorsys",))
    finished = {m.execution_id: m for m in got["ExecutionFinished"]}
    assert sorted(finished) == ["cold.0", "fail.0", "hang.0", "rec.0", "rec.1"]
    for execution_id in ("rec.0", "rec.1"):
        msg = finished[execution_id]
        assert (msg.exit_code, msg.timed_out) == (0, False)
        workspace = Path(msg.workspace)
        seen = json.loads((workspace / "seen.json").read_text())
        assert seen["argv"] == ["do the thing"]
        assert Path(seen["cwd"]).resolve() == workspace.resolve()
        assert seen["env"]["GYRE_EXECUTION_ID"] == execution_id
        assert seen["env"]["OPENAI_API_KEY"] == f"key-{execution_id}" and seen["env"]["EXTRA_FOR_AGENT"] == "yes"
        assert seen["files"] == ["agent.py", "data", "data/in.txt"]
        assert (workspace / "preloaded").read_text() == "True"
        logs = workspace.parent / "logs"
        assert (logs / AGENT_STDOUT).read_text() == "to stdout\n"
        assert (logs / AGENT_STDERR).read_text() == "to stderr\n"
    assert (finished["fail.0"].exit_code, finished["fail.0"].timed_out) == (3, False)
    assert (finished["cold.0"].exit_code, finished["cold.0"].timed_out) == (5, False)
    hang = finished["hang.0"]
    assert hang.timed_out and hang.exit_code == -9  # SIGTERM ignored: SIGKILL after the grace time
    assert (Path(hang.workspace) / "answer.txt").read_text() == "partial"
    assert _dies(int((Path(hang.workspace) / "child.pid").read_text()))
    (stats,) = got["ExecutorStatistics"]
    assert (stats.executions_launched, stats.executions_finished, stats.executions_timed_out) == (5, 5, 1)
    assert (stats.warm_launches, stats.cold_launches) == (4, 1)


def test_warm_launcher_preload_must_be_module_names() -> None:
    with pytest.raises(ValueError, match="warm_launcher_preload"):
        ExecutorConfig(warm_launcher_preload=("openai,structlog",))
    with pytest.raises(ValueError, match="warm_launcher_preload"):
        ExecutorConfig(warm_launcher_preload="openai")  # type: ignore[arg-type]


def test_a_dead_warm_launcher_kills_its_agents_and_the_rest_run_cold(tmp_path: Path,
                                                                      kills_its_warm_launcher: str) -> None:
    def script_task(task_id: str, body: str) -> TaskSpec:
        spec = task("", files={"agent.py": textwrap.dedent(body)}, agent_argv=(sys.executable, "agent.py"))
        return attrs.evolve(spec, task_id=task_id)

    groups = (
        StartGroup("killer", script_task("t1", kills_its_warm_launcher), 1, 0),
        StartGroup("after", script_task("t2", "import sys; sys.exit(4)"), 2, 0),
    )
    _, got = run(tmp_path, DriverConfig(groups, expected_outcomes=3), max_concurrent=1,
                 warm_launcher_preload=("colorsys",))
    finished = {m.execution_id: (m.exit_code, m.timed_out) for m in got["ExecutionFinished"]}
    assert finished == {"killer.0": (-9, False), "after.0": (4, False), "after.1": (4, False)}
    (stats,) = got["ExecutorStatistics"]
    assert (stats.warm_launches, stats.cold_launches, stats.executions_failed) == (1, 2, 0)
