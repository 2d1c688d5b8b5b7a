"""Held-out evaluation (examples/toolbox/evaluate.py) end to end: proxy over the embedded engine, the real agent
forked from the warm launcher, the task's scorer. A random tiny model never solves a task, so this checks the
plumbing and the outcomes' invariants, not a success rate."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

TOOLBOX = Path(__file__).resolve().parents[3] / "examples" / "toolbox"


def load(name: str):
    qualified = f"_gyre_toolbox_{name}"
    if qualified not in sys.modules:
        spec = importlib.util.spec_from_file_location(qualified, TOOLBOX / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[qualified] = module
        spec.loader.exec_module(module)
    return sys.modules[qualified]


def test_every_task_gets_an_outcome_and_a_hung_agent_is_scored_on_its_workspace(tiny_model_dir: Path) -> None:
    tasks, evaluate = load("tasks"), load("evaluate")
    chosen = tasks.generate_tasks(1, "heldout", 3, kinds=("write", "calc", "lookup"))
    result = evaluate.evaluate(tiny_model_dir, chosen, concurrency=2, timeout_s=4.0)
    assert [o.task_id for o in result.outcomes] == [t.task_id for t in chosen]
    assert [o.kind for o in result.outcomes] == ["write", "calc", "lookup"]
    for outcome in result.outcomes:
        # 0: the agent finished, 3: it spent its turns, -9: the time limit killed it. Never 1 (the endpoint
        # failed) or 2 (bad usage): both would mean the evaluation's own plumbing is broken.
        assert outcome.agent_exit_code in (0, 3, -9), outcome
        assert outcome.reward in (0.0, 0.2, 0.5, 1.0) and outcome.success == (outcome.reward == 1.0)
    assert result.success_rate == sum(o.success for o in result.outcomes) / 3
    assert result.mean_reward == sum(o.reward for o in result.outcomes) / 3


def test_pooled_passes_each_score_every_task_in_their_own_workspaces(tiny_model_dir: Path) -> None:
    tasks, evaluate = load("tasks"), load("evaluate")
    chosen = tasks.generate_tasks(1, "heldout", 2, kinds=("write", "calc"))
    greedy, sampled = evaluate.evaluate_passes(tiny_model_dir, chosen, (0.0, 0.7), concurrency=4, timeout_s=4.0)
    for one_pass in (greedy, sampled):
        # The same task twice at once: had the passes shared a folder, the second attempt could not make its logs.
        assert [o.task_id for o in one_pass.outcomes] == [t.task_id for t in chosen]
        assert all(o.agent_exit_code in (0, 3, -9) for o in one_pass.outcomes)
    assert greedy.seconds == sampled.seconds  # one pooled wall time


def test_a_scorer_is_exec_d_when_the_warm_launcher_has_died(tmp_path: Path) -> None:
    import asyncio

    from gyre.actors.executions.warm_launcher import LauncherDied, WarmLauncher

    tasks, evaluate = load("tasks"), load("evaluate")
    (task,) = tasks.generate_tasks(1, "heldout", 1)
    workspace = tasks.write_workspace(task, tmp_path / "workspace")
    (workspace / tasks.ANSWER_FILE).write_text("nothing right")
    logs = tmp_path / "logs"
    logs.mkdir()

    async def score_after_the_server_died() -> bytes | None:
        launcher = WarmLauncher()
        await launcher.start(evaluate.SCORER_PRELOAD)
        try:
            async def died(*args, **kwargs):  # the server went between `alive` and the launch
                raise LauncherDied("the warm launcher's server died")

            launcher.launch = died
            return await evaluate._run_scorer(task, workspace, logs, launcher)
        finally:
            await launcher.close()

    scored = asyncio.run(score_after_the_server_died())
    assert scored is not None and b'"reward": 0.2' in scored  # the file exists but holds no answer
    assert not (logs / "scorer.stdout.log").exists()  # it ran the plain way
