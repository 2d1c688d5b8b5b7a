"""The main job on a task set (examples/agent_rl.py --tasks DIR): the task source runs the set's tasks with the
chosen agent, agents and verifiers run in the bubblewrap sandbox, and a broken task set or agent is refused at the
command line with the file and the reason."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
AGENT_RL = EXAMPLES / "agent_rl.py"


@pytest.fixture(scope="module")
def agent_rl():
    spec = importlib.util.spec_from_file_location("agent_rl_task_sets_under_test", AGENT_RL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _topology(agent_rl, tmp_path: Path, *argv: str):
    (tmp_path / "prepare.json").write_text('{"model_dir": "unused: the topology is only built"}')
    return agent_rl.topology(["--report", str(tmp_path), *argv])


def test_a_harbor_task_set_runs_sandboxed_with_the_chosen_agent(agent_rl, tmp_path: Path) -> None:
    topology = _topology(agent_rl, tmp_path, "--tasks", str(EXAMPLES / "tasks"), "--agent", "noop")
    tasks = topology.spec("task_source").config.tasks
    assert sorted(t.task_id for t in tasks) == sorted(p.name for p in (EXAMPLES / "tasks").iterdir())
    assert all(t.agent_argv == ("true",) and t.workdir == "/app" for t in tasks)
    assert topology.spec("executor").config.sandbox.kind == "bubblewrap"
    assert topology.spec("evaluator").config.sandbox.kind == "bubblewrap"
    assert topology.spec("executor").config.warm_launcher_preload == ()  # sandboxed agents are never forked warm
    assert agent_rl.parse_args(["--tasks", str(EXAMPLES / "tasks")]).skip_eval  # held-out scoring is the toolbox's
    # Without --tasks: the toolbox tasks, trusted, forked warm.
    toolbox = _topology(agent_rl, tmp_path)
    assert toolbox.spec("executor").config.sandbox.kind == "none"
    assert toolbox.spec("executor").config.warm_launcher_preload != ()


def test_swe_instances_and_mini_swe_agent_at_the_rollout_temperature(agent_rl, tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("shutil.which", lambda name: "/opt/bin/mini" if name == "mini" else None)
    topology = _topology(agent_rl, tmp_path, "--tasks", str(EXAMPLES / "swe"), "--rollout-temperature", "0.9",
                         "--agent-option", "agent.step_limit=5")
    tasks = topology.spec("task_source").config.tasks
    assert [t.task_id for t in tasks] == ["intervals-1", "textstats-1"] and tasks[0].workdir == "/testbed"
    argv = tasks[0].agent_argv
    assert "/opt/bin/mini" in argv and "model.model_kwargs.temperature=0.9" in argv and "agent.step_limit=5" in argv


@pytest.mark.parametrize(("argv", "reason"), [
    (["--tasks", "/nowhere"], "not a directory"),
    (["--tasks", str(EXAMPLES)], "task.toml: missing"),  # examples/ holds other folders than tasks
    (["--tasks", str(EXAMPLES / "tasks"), "--agent", "noop", "--agent-option", "a=b"], "for mini-swe-agent"),
    (["--tasks", str(EXAMPLES / "tasks"), "--agent", "/nowhere/agent.toml"], "cannot be read"),
])
def test_a_broken_task_set_or_agent_is_refused(agent_rl, argv: list[str], reason: str, capsys) -> None:
    with pytest.raises(SystemExit) as exited:
        agent_rl.parse_args(argv)
    assert exited.value.code == 2 and reason in capsys.readouterr().err
