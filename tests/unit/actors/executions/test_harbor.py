"""The Harbor task loader: a good task loads into the TaskSpec the sandbox runs; a broken one is refused with the
file and the reason; an environment the bubblewrap sandbox cannot provide is refused, never run wrongly."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from gyre.actors.executions.harbor import (
    HarborTaskError,
    harbor_task_spec,
    load_harbor_task,
    load_harbor_tasks,
)

SHIPPED = Path(__file__).resolve().parents[4] / "examples" / "tasks"


def make_task(root: Path, name: str = "t1", **overrides: str) -> Path:
    files = {
        "instruction.md": "Fix calc.py.\n",
        "task.toml": "version = \"1.0\"\n[agent]\ntimeout_sec = 30\n[verifier]\ntimeout_sec = 20\n"
                     "env = { LEVEL = \"strict\" }\n[environment]\ncpus = 2\nmemory = \"1G\"\n",
        "environment/Dockerfile": "# base\nFROM python:3.11-slim\nWORKDIR /app\nENV MODE=test\n"
                                  "COPY app/ /app/\nCOPY extra.txt notes/\nCMD [\"sleep\", \"infinity\"]\n",
        "environment/app/calc.py": "x = 1\n",
        "environment/app/pkg/mod.py": "y = 2\n",
        "environment/extra.txt": "extra\n",
        "tests/test.sh": "#!/bin/bash\necho 1 > /logs/verifier/reward.txt\n",
        "solution/solve.sh": "#!/bin/bash\ntrue\n",
    }
    files.update(overrides)
    directory = root / name
    for relative, content in files.items():
        if content is None:
            continue
        path = directory / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content)
    return directory


def test_a_good_task_loads(tmp_path: Path) -> None:
    task = load_harbor_task(make_task(tmp_path))
    assert task.task_id == "t1" and task.instruction == "Fix calc.py.\n"
    assert task.workdir == "/app"
    assert task.workspace_files == {"calc.py": "x = 1\n", "pkg/mod.py": "y = 2\n", "notes/extra.txt": "extra\n"}
    assert task.env == {"MODE": "test"} and task.verifier_env == {"LEVEL": "strict"}
    assert (task.agent_timeout_s, task.verifier_timeout_s, task.cpus, task.memory_mb) == (30.0, 20.0, 2.0, 1024)
    spec = harbor_task_spec(task, ("bash", "/solution/solve.sh"), with_solution=True)
    assert spec.workdir == "/app" and spec.timeout_s == 30.0 and spec.scorer_timeout_s == 20.0
    assert spec.agent_mounts == ((str(tmp_path / "t1" / "solution"), "/solution"),)
    assert spec.scorer_mounts == ((str(tmp_path / "t1" / "tests"), "/tests"),)
    assert spec.scorer_output_dir == "/logs/verifier" and spec.scorer_argv[-1] == "LEVEL=strict"
    assert harbor_task_spec(task, ("true",)).agent_mounts == ()


@pytest.mark.parametrize(
    ("overrides", "file", "reason"),
    [
        ({"instruction.md": None}, "instruction.md", "missing"),
        ({"instruction.md": "  \n"}, "instruction.md", "empty"),
        ({"task.toml": None}, "task.toml", "missing"),
        ({"task.toml": "[agent\ntimeout_sec = 1"}, "task.toml", "malformed TOML"),
        ({"task.toml": "[agent]\ntimeout_sec = -5\n"}, "task.toml", "timeout_sec must be a number > 0"),
        ({"task.toml": "[environment]\nmemory = \"lots\"\n"}, "task.toml", "memory must look like"),
        ({"task.toml": "[verifier]\nenv = { A = 1 }\n"}, "task.toml", "env must map"),
        ({"tests/test.sh": None}, "test.sh", "missing (the verifier)"),
        ({"environment/Dockerfile": None}, "Dockerfile", "missing"),
        ({"environment/Dockerfile": "FROM ubuntu:24.04\nWORKDIR /app\n"}, "Dockerfile:1", "cannot be provided"),
        ({"environment/Dockerfile": "FROM python:3.11-slim\nWORKDIR /app\nRUN pip install numpy\n"},
         "Dockerfile:3", "RUN needs an image build"),
        ({"environment/Dockerfile": "FROM python:3.11-slim\nCOPY app/ /app/\n"}, "Dockerfile:2", "COPY before WORKDIR"),
        ({"environment/Dockerfile": "FROM python:3.11-slim\nWORKDIR /app\nCOPY extra.txt /etc/\n"},
         "Dockerfile:3", "outside WORKDIR"),
        ({"environment/Dockerfile": "FROM python:3.11-slim\nWORKDIR /app\nCOPY missing.txt /app/\n"},
         "Dockerfile:3", "does not exist"),
        ({"environment/Dockerfile": "FROM python:3.11-slim\n"}, "Dockerfile", "no WORKDIR"),
        ({"environment/docker-compose.yaml": "services: {}\n"}, "docker-compose.yaml", "multi-container"),
    ],
)
def test_a_broken_task_is_refused_naming_the_file(tmp_path: Path, overrides: dict, file: str, reason: str) -> None:
    with pytest.raises(HarborTaskError) as caught:
        load_harbor_task(make_task(tmp_path, **overrides))
    assert file in str(caught.value) and reason in str(caught.value)


def test_binary_workspace_files_and_missing_solutions_are_refused(tmp_path: Path) -> None:
    directory = make_task(tmp_path, **{"solution/solve.sh": None})
    (directory / "environment" / "app" / "blob.bin").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(HarborTaskError, match="blob.bin: not UTF-8"):
        load_harbor_task(directory)
    (directory / "environment" / "app" / "blob.bin").unlink()
    task = load_harbor_task(directory)
    with pytest.raises(HarborTaskError, match="solve.sh: missing"):
        harbor_task_spec(task, ("bash", "/solution/solve.sh"), with_solution=True)


def test_a_task_set_is_every_task_directory(tmp_path: Path) -> None:
    make_task(tmp_path, "b")
    make_task(tmp_path, "a")
    assert [t.task_id for t in load_harbor_tasks(tmp_path)] == ["a", "b"]
    assert [t.task_id for t in load_harbor_tasks(tmp_path / "a")] == ["a"]
    (tmp_path / "c").mkdir()
    with pytest.raises(HarborTaskError, match="c/task.toml: missing"):
        load_harbor_tasks(tmp_path)
    shutil.rmtree(tmp_path / "c")
    with pytest.raises(HarborTaskError, match="no task directories"):
        load_harbor_tasks(tmp_path / "a" / "tests")


def test_the_shipped_task_set_loads() -> None:
    tasks = load_harbor_tasks(SHIPPED)
    assert len(tasks) >= 24
    assert all(t.has_solution and t.workdir == "/app" and t.workspace_files for t in tasks)
    kinds = {t.task_id.split("-")[0] for t in tasks}
    assert {"fix", "implement", "repair", "edit"} <= kinds
