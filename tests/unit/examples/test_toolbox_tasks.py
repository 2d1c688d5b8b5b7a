"""The toolbox task family and its scorer: determinism, disjoint splits, and judgements of workspace states."""

from __future__ import annotations

import collections
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

TOOLBOX = Path(__file__).resolve().parents[3] / "examples" / "toolbox"


def load(name: str):
    """Load examples/toolbox/<name>.py under the private name agent.load_sibling uses."""
    qualified = f"_gyre_toolbox_{name}"
    if qualified not in sys.modules:
        spec = importlib.util.spec_from_file_location(qualified, TOOLBOX / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[qualified] = module
        spec.loader.exec_module(module)
    return sys.modules[qualified]


tasks = load("tasks")
score = load("score")


def run_scorer(task, workspace: Path) -> dict:
    """Run the task's scorer command line the way the evaluator does: a subprocess in the workspace."""
    completed = subprocess.run(task.scorer_argv, cwd=workspace, capture_output=True, text=True, timeout=60)
    assert completed.returncode == 0, completed.stderr
    verdict = json.loads(completed.stdout)
    assert set(verdict) == {"reward", "success"}
    assert isinstance(verdict["reward"], float) and isinstance(verdict["success"], bool)
    return verdict


def test_same_seed_same_tasks_and_other_seed_other_tasks() -> None:
    first = tasks.generate_tasks(3, "train", 21)
    assert first == tasks.generate_tasks(3, "train", 21)
    assert [task.task_id for task in first] != [task.task_id for task in tasks.generate_tasks(4, "train", 21)]


def test_kinds_take_turns_and_ids_are_distinct() -> None:
    generated = tasks.generate_tasks(0, "heldout", 70)
    assert collections.Counter(task.kind for task in generated) == {kind: 10 for kind in tasks.KINDS}
    assert len({task.task_id for task in generated}) == 70
    assert all(task.split == "heldout" and task.task_id.startswith(task.kind + "-") for task in generated)


def test_splits_are_disjoint_across_seeds() -> None:
    train = {task.task_id: task for seed in range(3) for task in tasks.generate_tasks(seed, "train", 140)}
    heldout = {task.task_id: task for seed in range(3) for task in tasks.generate_tasks(seed, "heldout", 70)}
    assert not set(train) & set(heldout)
    as_content = lambda task: (task.prompt, tuple(sorted(task.workspace_files.items())))  # noqa: E731
    assert not {as_content(task) for task in train.values()} & {as_content(task) for task in heldout.values()}
    # The split is a function of the content: recomputing it from a task's content gives its split back.
    for task in [*train.values(), *heldout.values()]:
        assert tasks.split_of(tasks.content_digest(task.kind, task.prompt, task.workspace_files)) == task.split


def test_excluded_tasks_are_never_drawn() -> None:
    seen = tasks.generate_tasks(0, "train", 280)
    excluded = frozenset(task.task_id for task in seen)
    fresh = tasks.generate_tasks(5, "train", 140, exclude=excluded)
    assert len(fresh) == 140 and not {task.task_id for task in fresh} & excluded
    assert collections.Counter(task.kind for task in fresh) == {kind: 20 for kind in tasks.KINDS}
    assert fresh == tasks.generate_tasks(5, "train", 140, exclude=excluded)  # still deterministic
    # Without the exclusion the same seed does draw some of them (the "write" space is small).
    assert {task.task_id for task in tasks.generate_tasks(5, "train", 140)} & excluded


def test_every_task_needs_a_tool_call(tmp_path: Path) -> None:
    for task in tasks.generate_tasks(1, "train", 14):
        assert tasks.ANSWER_FILE not in task.workspace_files
        assert task.expected not in task.prompt.split()  # the answer is not handed over in the prompt
        workspace = tasks.write_workspace(task, tmp_path / task.task_id)
        assert sorted(p.name for p in workspace.iterdir()) == sorted(task.workspace_files)
        assert score.score_workspace(workspace, tasks.ANSWER_FILE, task.expected) == {"reward": 0.0, "success": False}
        assert task.scorer_argv[-2:] == ("--expected", task.expected)


def test_prompts_stay_short() -> None:
    for task in tasks.generate_tasks(2, "train", 70):
        assert len(task.prompt) <= 110
        assert all(len(text) <= 80 for text in task.workspace_files.values())


def test_bad_arguments_are_rejected() -> None:
    with pytest.raises(ValueError, match="split"):
        tasks.generate_tasks(0, "test", 1)
    with pytest.raises(ValueError, match="kinds"):
        tasks.generate_tasks(0, "train", 1, kinds=("juggle",))
    with pytest.raises(ValueError, match="count"):
        tasks.generate_tasks(0, "train", -1)
    # "sum" of a constant prompt still has many files; "write" has 30*29 word pairs: ask for more than exist.
    with pytest.raises(tasks.TaskSpaceExhausted):
        tasks.generate_tasks(0, "heldout", 1000, kinds=("write",))


def write_answer(workspace: Path, data: bytes) -> None:
    (workspace / tasks.ANSWER_FILE).write_bytes(data)


@pytest.fixture
def number_task(tmp_path: Path):
    task = tasks.generate_tasks(0, "train", 1, kinds=("sum",))[0]
    return task, tasks.write_workspace(task, tmp_path / "ws")


def test_scorer_right_answer(number_task) -> None:
    task, workspace = number_task
    write_answer(workspace, f"{task.expected}\n".encode())
    assert run_scorer(task, workspace) == {"reward": 1.0, "success": True}
    write_answer(workspace, f"{task.expected}.0".encode())  # numbers compare by value
    assert run_scorer(task, workspace) == {"reward": 1.0, "success": True}


def test_scorer_partial_and_wrong_answers(number_task) -> None:
    task, workspace = number_task
    write_answer(workspace, f"The sum is {task.expected}.".encode())
    assert run_scorer(task, workspace) == {"reward": 0.5, "success": False}
    write_answer(workspace, f"{int(task.expected) + 1}".encode())
    assert run_scorer(task, workspace) == {"reward": 0.2, "success": False}
    write_answer(workspace, f"1{task.expected}".encode())  # the digits inside a bigger number are not the answer
    assert run_scorer(task, workspace) == {"reward": 0.2, "success": False}


def test_scorer_missing_file_directory_and_garbage(number_task) -> None:
    task, workspace = number_task
    assert run_scorer(task, workspace) == {"reward": 0.0, "success": False}
    (workspace / tasks.ANSWER_FILE).mkdir()
    assert run_scorer(task, workspace) == {"reward": 0.0, "success": False}
    (workspace / tasks.ANSWER_FILE).rmdir()
    write_answer(workspace, bytes(range(256)) * 1000)
    assert run_scorer(task, workspace) == {"reward": 0.2, "success": False}


def test_scorer_words_task(tmp_path: Path) -> None:
    task = tasks.generate_tasks(0, "train", 1, kinds=("write",))[0]
    workspace = tasks.write_workspace(task, tmp_path)
    write_answer(workspace, task.expected.encode())
    assert run_scorer(task, workspace)["success"]
    write_answer(workspace, f"I wrote {task.expected.upper()} here".encode())
    assert run_scorer(task, workspace) == {"reward": 0.5, "success": False}


def test_scorer_rejects_bad_command_lines(tmp_path: Path) -> None:
    script = str(tasks.SCORE_SCRIPT)
    for argv in ([], ["--expected", "3"], ["--answer-file", "../x", "--expected", "3"]):
        completed = subprocess.run([sys.executable, script, *argv], cwd=tmp_path, capture_output=True, timeout=60)
        assert completed.returncode == 2
        assert completed.stdout == b""


def test_scorer_in_process_matches_command_line(number_task) -> None:
    task, workspace = number_task
    write_answer(workspace, b"oops")
    assert score.score_workspace(workspace, tasks.ANSWER_FILE, task.expected) == run_scorer(task, workspace)
