"""The evaluator with real scorer subprocesses, and the executor + evaluator pair on a timed-out agent.

A driver actor stands in for the trajectory builder (and, with the executor, for the proxy); what the actors sent
is read back from the run's event log.
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

from gyre.actors.executions.evaluator import DROP_KINDS, Evaluator, EvaluatorConfig, ScorerOutputError, parse_scorer_output
from gyre.actors.executions.executor import Executor, ExecutorConfig
from gyre.messages.runtime_control import StatisticsAsked
from gyre.messages.executions import ExecutionFinished, IssueKey, KeyIssued, RevokeKey, StartGroup, TaskSpec
from gyre.messages.samples import ExecutionDropped, ExecutionScored
from gyre.runtime import Actor, Codec, InProcessLauncher, RunOptions, Topology, handler, read_log


@attrs.frozen
class DriverConfig:
    finished: tuple[ExecutionFinished, ...] = ()
    """Sent to the evaluator at start."""
    groups: tuple[StartGroup, ...] = ()
    """Sent to the executor at start."""
    expected_outcomes: int = 0
    """ExecutionScored + ExecutionDropped to wait for before stopping."""


class Driver(Actor):
    """The trajectory builder (and proxy) as far as the evaluator (and executor) can tell."""

    config_cls = DriverConfig

    async def on_start(self) -> None:
        self.outcomes = 0
        for msg in self.config.finished:
            self.tell("evaluator", msg)
        for group in self.config.groups:
            self.tell("executor", group)

    @handler(IssueKey)
    def on_issue_key(self, msg: IssueKey) -> KeyIssued:
        return KeyIssued(f"key-{msg.execution_id}", "http://127.0.0.1:9/v1", "http://127.0.0.1:9")

    @handler(RevokeKey)
    def on_revoke(self, msg: RevokeKey) -> None:
        pass

    @handler(ExecutionScored, ExecutionDropped)
    async def on_outcome(self, msg: Any) -> None:
        self.outcomes += 1
        if self.outcomes == self.config.expected_outcomes:
            await self.ask("evaluator", StatisticsAsked())
            self.stop_topology("done")


def run(tmp_path: Path, driver: DriverConfig, with_executor: bool = False, **evaluator: Any) -> dict[str, list[Any]]:
    topology = Topology("evaluator-test", seed=0)
    topology.add("evaluator", Evaluator, EvaluatorConfig(builder="driver", **evaluator))
    if with_executor:
        topology.add("executor", Executor, ExecutorConfig(workspace_root=str(tmp_path / "executions"), proxy="driver",
                                                           builder="driver", kill_grace_s=0.3))
    topology.add("driver", Driver, driver)
    log_path = tmp_path / "run.glog"
    result = InProcessLauncher().run(topology, RunOptions(log_path=str(log_path), until_s=60.0))
    assert result.reason == "done", result
    codec = Codec()
    received: dict[str, list[Any]] = {}
    for record in read_log(log_path):
        if record.envelope.receiver == "driver":
            received.setdefault(record.type_name.rsplit(".", 1)[-1], []).append(record.decode(codec))
    return received


def scorer(tmp_path: Path, script: str) -> tuple[str, ...]:
    """A scorer script in a file of its own, run as `python -S FILE` (the shape the warm launcher accepts)."""
    folder = tmp_path / "scorers"
    folder.mkdir(exist_ok=True)
    path = folder / f"scorer_{len(list(folder.iterdir()))}.py"
    path.write_text(textwrap.dedent(script))
    return (sys.executable, "-S", str(path))


def finished(tmp_path: Path, name: str, scorer_argv: tuple[str, ...], *, timed_out: bool = False,
             scorer_timeout_s: float = 20.0, answer: str | None = "17", workspace: Path | None = None
             ) -> ExecutionFinished:
    if workspace is None:
        workspace = tmp_path / name / "workspace"
        workspace.mkdir(parents=True)
        if answer is not None:
            (workspace / "answer.txt").write_text(answer)
    spec = TaskSpec(name, "prompt", {}, (sys.executable, "-c", "pass"), scorer_argv, 10.0, scorer_timeout_s)
    return ExecutionFinished(name, "grp", spec, str(workspace), -9 if timed_out else 0, timed_out, 1.0)


READ_ANSWER = """
import json, pathlib, sys
print("scoring...")   # a log line before the JSON is fine
answer = pathlib.Path("answer.txt").read_text()
print(json.dumps({"reward": 1.0 if answer == "17" else 0.25, "success": answer == "17", "seen": answer,
                  "warm": "colorsys" in sys.modules}))
"""
WARM = {"warm_launcher_preload": ("colorsys",)}  # a stdlib module nothing here imports: its presence proves a fork

HANG = """
import pathlib, signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
pathlib.Path("scorer-child.pid").write_text(str(child.pid))
time.sleep(600)
"""


def _dies(pid: int, within_s: float = 10.0) -> bool:
    deadline = time.monotonic() + within_s
    while True:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return True
        if state in ("Z", "X"):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)


@pytest.mark.parametrize("warm", [False, True], ids=["plain", "warm"])
def test_scores_and_drops(tmp_path: Path, warm: bool) -> None:
    cases = (
        finished(tmp_path, "good", scorer(tmp_path, READ_ANSWER)),
        finished(tmp_path, "partial-after-timeout", scorer(tmp_path, READ_ANSWER), timed_out=True, answer="1"),
        finished(tmp_path, "crash", scorer(tmp_path, "import sys; print('boom', file=sys.stderr); sys.exit(1)")),
        finished(tmp_path, "not-json", scorer(tmp_path, "print('reward: 1')")),
        finished(tmp_path, "no-reward", scorer(tmp_path, "print('{\"score\": 1}')")),
        finished(tmp_path, "nan-reward", scorer(tmp_path, "print('{\"reward\": NaN}')")),
        finished(tmp_path, "bool-reward", scorer(tmp_path, "print('{\"reward\": true}')")),
        finished(tmp_path, "hang", scorer(tmp_path, HANG), scorer_timeout_s=2.0),
        finished(tmp_path, "lost", scorer(tmp_path, READ_ANSWER), workspace=tmp_path / "nowhere"),
        finished(tmp_path, "no-program", (str(tmp_path / "no-such-scorer"),)),
    )
    got = run(tmp_path, DriverConfig(finished=cases, expected_outcomes=len(cases)), kill_grace_s=0.3,
              max_concurrent=3, **(WARM if warm else {}))
    scored = {m.execution_id: m for m in got["ExecutionScored"]}
    dropped = {m.execution_id: m for m in got["ExecutionDropped"]}
    assert sorted(scored) == ["good", "partial-after-timeout"]
    good = scored["good"]
    assert (good.reward, good.timed_out, good.group_id) == (1.0, False, "grp")
    assert json.loads(good.detail) == {"reward": 1.0, "success": True, "seen": "17", "warm": warm}
    late = scored["partial-after-timeout"]
    assert (late.reward, late.timed_out) == (0.25, True)  # a timed-out agent's workspace is scored
    assert dropped["crash"].reason == "scorer crashed: exit 1: boom"
    for name in ("not-json", "no-reward", "nan-reward", "bool-reward"):
        assert dropped[name].reason.startswith("scorer output unusable"), dropped[name]
    assert dropped["hang"].reason == "scorer timed out after 2.0 s"
    assert _dies(int((tmp_path / "hang" / "workspace" / "scorer-child.pid").read_text()))
    assert dropped["lost"].reason.startswith("workspace lost")
    assert dropped["no-program"].reason.startswith("scorer did not start")
    assert not any(m.reward == 0.0 for m in got["ExecutionScored"])  # a failed scorer never becomes a zero
    (stats,) = got["EvaluatorStatistics"]
    assert stats.scored == 2 and stats.dropped == 8 and (stats.running, stats.queued) == (0, 0)
    assert stats.dropped_by_kind == {
        "crashed": 1, "timed_out": 1, "bad_output": 4, "workspace_lost": 1, "failed_to_start": 1, "no_room": 0,
    }
    assert set(stats.dropped_by_kind) == set(DROP_KINDS)
    # Eight scorers ran (the lost workspace and the missing program never started); "no-program" is not
    # `python script` and was tried the plain way.
    assert (stats.warm_scorer_runs, stats.plain_scorer_runs) == ((8, 0) if warm else (0, 8))


def test_a_dead_warm_launcher_drops_its_scorers_run_and_the_rest_run_plain(tmp_path: Path,
                                                                           kills_its_warm_launcher: str) -> None:
    cases = (
        finished(tmp_path, "killer", scorer(tmp_path, kills_its_warm_launcher)),
        finished(tmp_path, "after", scorer(tmp_path, READ_ANSWER)),
    )
    got = run(tmp_path, DriverConfig(finished=cases, expected_outcomes=2), max_concurrent=1, **WARM)
    (dropped,) = got["ExecutionDropped"]
    assert (dropped.execution_id, dropped.reason) == ("killer", "scorer crashed: exit -9")
    (scored,) = got["ExecutionScored"]
    assert json.loads(scored.detail)["warm"] is False and scored.reward == 1.0
    (stats,) = got["EvaluatorStatistics"]
    assert (stats.warm_scorer_runs, stats.plain_scorer_runs) == (1, 1)


def test_a_preload_that_is_not_a_module_name_is_refused() -> None:
    with pytest.raises(ValueError, match="warm_launcher_preload"):
        EvaluatorConfig(warm_launcher_preload=("not a module",))


def test_workspace_removed_after_scoring_when_asked(tmp_path: Path) -> None:
    case = finished(tmp_path, "good", scorer(tmp_path, READ_ANSWER))
    (tmp_path / "good" / "logs").mkdir()
    got = run(tmp_path, DriverConfig(finished=(case,), expected_outcomes=1), remove_workspace=True)
    assert got["ExecutionScored"][0].reward == 1.0
    assert not Path(case.workspace).exists() and (tmp_path / "good" / "logs").is_dir()


AGENT_PARTIAL_THEN_HANG = """
import pathlib, signal, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
pathlib.Path("answer.txt").write_text("1")     # a partial answer ...
time.sleep(600)                                # ... then it hangs
"""


def test_timed_out_agent_is_killed_then_scored_on_its_workspace(tmp_path: Path) -> None:
    spec = TaskSpec(
        "t", "prompt", {}, (sys.executable, "-c", AGENT_PARTIAL_THEN_HANG), scorer(tmp_path, READ_ANSWER), 4.0, 20.0
    )
    got = run(tmp_path, DriverConfig(groups=(StartGroup("grp", spec, 2, 0),), expected_outcomes=2), with_executor=True)
    scored = sorted(got["ExecutionScored"], key=lambda m: m.execution_id)
    assert [(m.execution_id, m.reward, m.timed_out) for m in scored] == [("grp.0", 0.25, True), ("grp.1", 0.25, True)]
    assert "ExecutionDropped" not in got


@pytest.mark.parametrize(
    "stdout, reward",
    [(b'{"reward": 2}', 2.0), (b'log\n\n{"reward": -0.5, "x": [1]}\n', -0.5), (b' {"reward": 0} ', 0.0)],
)
def test_parse_scorer_output(stdout: bytes, reward: float) -> None:
    assert parse_scorer_output(stdout)[0] == reward


@pytest.mark.parametrize(
    "stdout", [b"", b"[1]", b'{"reward": "1"}', b'{"reward": Infinity}', b'{"reward": 1}\ntrailing', b"\xff\xfe"]
)
def test_parse_scorer_output_refuses(stdout: bytes) -> None:
    with pytest.raises(ScorerOutputError):
        parse_scorer_output(stdout)
