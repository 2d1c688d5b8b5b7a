"""SWE-bench-style instances: a good instance loads into the TaskSpec the sandbox runs (the repository at /testbed,
the problem statement as the instruction, the scorer carrying the test patch, the snapshot's version of the files it
touches and both id lists); a broken one is refused with the file and the reason."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from gyre.actors.executions.swe import (
    APPLY_SCRIPT,
    SweInstanceError,
    is_swe_task_set,
    load_swe_instance,
    load_swe_instances,
    patched_files,
    swe_task_spec,
)

SHIPPED = Path(__file__).resolve().parents[4] / "examples" / "swe"
TEST_PATCH = ("--- a/tests/test_m.py\n+++ b/tests/test_m.py\n@@ -1 +1,2 @@\n x = 1\n+y = 2\n"
              "--- /dev/null\n+++ b/tests/test_new.py\n@@ -0,0 +1 @@\n+z = 3\n")


def make_instance(root: Path, **overrides: object) -> Path:
    data: dict[str, object] = {
        "instance_id": "demo-1", "repo": "x/demo", "base_commit": "0" * 40, "problem_statement": "Fix m.\n",
        "FAIL_TO_PASS": ["tests/test_new.py::test_z"], "PASS_TO_PASS": json.dumps(["tests/test_m.py::test_x"]),
        "test_patch": TEST_PATCH, "patch": "--- a/m.py\n+++ b/m.py\n@@ -1 +1 @@\n-a\n+b\n",
    }
    data.update(overrides)
    directory = root / "demo-1"
    (directory / "repo" / "tests").mkdir(parents=True, exist_ok=True)
    (directory / "repo" / "m.py").write_text("a\n")
    (directory / "repo" / "tests" / "test_m.py").write_text("x = 1\n")
    (directory / "repo" / "__pycache__").mkdir(exist_ok=True)
    (directory / "repo" / "__pycache__" / "m.cpython-311.pyc").write_bytes(b"\x00\xff")
    (directory / "instance.json").write_text(json.dumps({k: v for k, v in data.items() if v is not None}))
    return directory


def test_a_good_instance_loads_into_a_task_spec(tmp_path: Path) -> None:
    instance = load_swe_instance(make_instance(tmp_path))
    assert instance.instance_id == "demo-1" and instance.problem_statement == "Fix m.\n"
    assert instance.fail_to_pass == ("tests/test_new.py::test_z",)
    assert instance.pass_to_pass == ("tests/test_m.py::test_x",)  # SWE-bench's JSON-encoded list, decoded
    assert instance.repo_files == {"m.py": "a\n", "tests/test_m.py": "x = 1\n"}  # caches left out
    spec = swe_task_spec(instance, ("my-agent",), {"A": "1"})
    assert spec.workdir == "/testbed" and spec.prompt == "Fix m.\n" and spec.agent_argv == ("my-agent",)
    assert spec.env == {"A": "1"} and spec.workspace_files == instance.repo_files
    payload = json.loads(spec.scorer_argv[-1])
    # The touched files' snapshot versions: an existing test file as it was, a new one as absent.
    assert payload["originals"] == {"tests/test_m.py": "x = 1\n", "tests/test_new.py": None}
    assert payload["fail_to_pass"] == ["tests/test_new.py::test_z"] and payload["test_patch"] == TEST_PATCH
    oracle = swe_task_spec(instance, None)
    assert oracle.agent_argv[1:3] == ("-c", APPLY_SCRIPT) and oracle.agent_argv[3] == instance.patch


def test_patched_files_reads_both_sides_of_a_diff() -> None:
    assert patched_files(TEST_PATCH) == ("tests/test_m.py", "tests/test_new.py")
    assert patched_files("not a diff") == ()


@pytest.mark.parametrize(("overrides", "reason"), [
    ({"instance_id": "../x"}, "instance_id"),
    ({"problem_statement": ""}, "problem_statement must be a non-empty string"),
    ({"FAIL_TO_PASS": []}, "FAIL_TO_PASS is empty"),
    ({"FAIL_TO_PASS": "[not json"}, "FAIL_TO_PASS is a string but not a JSON list"),
    ({"PASS_TO_PASS": ["--collect-only"]}, "PASS_TO_PASS must be a list of test ids"),
    ({"test_patch": "hello"}, "test_patch touches no file"),
    ({"test_patch": None}, "test_patch must be a non-empty string"),
    ({"patch": 3}, "patch must be a string"),
    ({"agent_timeout_sec": 0}, "agent_timeout_sec must be a number > 0"),
    ({"test_patch": "--- a/x\n+++ b/x\n" + "+" * 100_000}, "test_patch is larger than"),
])
def test_a_broken_instance_is_refused_with_the_file_and_the_reason(tmp_path: Path, overrides: dict,
                                                                     reason: str) -> None:
    directory = make_instance(tmp_path, **overrides)
    with pytest.raises(SweInstanceError, match=reason) as caught:
        load_swe_instance(directory)
    assert str(directory / "instance.json") in str(caught.value)


def test_broken_files_are_refused(tmp_path: Path) -> None:
    directory = make_instance(tmp_path)
    (directory / "instance.json").write_text("{")
    with pytest.raises(SweInstanceError, match="not a readable JSON file"):
        load_swe_instance(directory)
    directory = make_instance(tmp_path)
    (directory / "repo" / "blob.bin").write_bytes(b"\xff\xfe")
    with pytest.raises(SweInstanceError, match="blob.bin: not UTF-8 text"):
        load_swe_instance(directory)
    shutil.rmtree(directory / "repo")
    with pytest.raises(SweInstanceError, match="repo: missing"):
        load_swe_instance(directory)
    # A test patch that reaches outside the repository is refused when the spec is made.
    directory = make_instance(tmp_path / "b", test_patch="--- a/../escape.py\n+++ b/../escape.py\n@@ -0,0 +1 @@\n+x\n")
    with pytest.raises(SweInstanceError, match="outside the repository"):
        swe_task_spec(load_swe_instance(directory), ("true",))
    # The oracle needs a gold patch.
    directory = make_instance(tmp_path / "c", patch="")
    with pytest.raises(SweInstanceError, match="no patch"):
        swe_task_spec(load_swe_instance(directory), None)


def test_a_set_of_instances_and_its_mistakes(tmp_path: Path) -> None:
    assert [i.instance_id for i in load_swe_instances(SHIPPED)] == ["intervals-1", "textstats-1"]
    assert is_swe_task_set(SHIPPED) and is_swe_task_set(SHIPPED / "textstats-1")
    assert not is_swe_task_set(SHIPPED.parent / "tasks")
    make_instance(tmp_path)
    (tmp_path / "stray").mkdir()
    with pytest.raises(SweInstanceError, match="stray/instance.json: missing"):
        load_swe_instances(tmp_path)
    with pytest.raises(SweInstanceError, match="not a directory"):
        load_swe_instances(tmp_path / "nowhere")
