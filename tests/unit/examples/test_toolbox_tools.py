"""The toolbox agent's workspace tools: observations for good and bad calls, confinement to the workspace."""

from __future__ import annotations

import importlib.util
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


tools = load("tools")


def test_read_and_write_round_trip(tmp_path: Path) -> None:
    assert tools.run_tool(tmp_path, "write_file", {"path": "sub/answer.txt", "content": "42"}) == "ok"
    assert (tmp_path / "sub" / "answer.txt").read_text() == "42"
    assert tools.run_tool(tmp_path, "read_file", {"path": "sub/answer.txt"}) == "42"


def test_read_is_bounded(tmp_path: Path) -> None:
    (tmp_path / "big.txt").write_text("x" * (tools.MAX_READ_CHARS + 50))
    observation = tools.run_tool(tmp_path, "read_file", {"path": "big.txt"})
    assert observation == "x" * tools.MAX_READ_CHARS + "\n[truncated]"


@pytest.mark.parametrize(
    ("name", "arguments", "expected"),
    [
        ("read_file", {"path": "missing.txt"}, "error: no such file: missing.txt"),
        ("read_file", {"path": "../outside.txt"}, "error: path leaves the workspace: ../outside.txt"),
        ("read_file", {"path": "/etc/hostname"}, "error: path must be relative: /etc/hostname"),
        ("read_file", {}, "error: path must be a non-empty string"),
        ("read_file", ["data.txt"], "error: arguments must be a JSON object"),
        ("write_file", {"path": "a.txt", "content": 5}, "error: content must be a string"),
        (
            "write_file",
            {"path": "x/../../escape.txt", "content": "hi"},
            "error: path leaves the workspace: x/../../escape.txt",
        ),
        (
            "calculator",
            {"expression": "__import__('os')"},
            "error: only numbers, + - * / // % ** and parentheses are allowed",
        ),
        ("calculator", {"expression": "1/0"}, "error: division by zero"),
        ("calculator", {"expression": "9**9**9"}, "error: power too large"),
        ("calculator", {"expression": "2 +"}, "error: cannot parse: 2 +"),
        ("delete_everything", {}, "error: unknown tool: delete_everything"),
    ],
)
def test_bad_calls_become_error_observations(tmp_path: Path, name: str, arguments, expected: str) -> None:
    assert tools.run_tool(tmp_path, name, arguments) == expected
    assert not (tmp_path.parent / "escape.txt").exists()


def test_write_refuses_oversized_content(tmp_path: Path) -> None:
    too_long = "x" * (tools.MAX_WRITE_CHARS + 1)
    observation = tools.run_tool(tmp_path, "write_file", {"path": "a.txt", "content": too_long})
    assert observation.startswith("error: content longer than")
    assert not (tmp_path / "a.txt").exists()


@pytest.mark.parametrize(
    ("expression", "value"),
    [
        ("12+7+30", "49"),
        ("17*5", "85"),
        ("3-10", "-7"),
        ("12/3", "4"),
        ("7/2", "3.5"),
        ("(2+3)*4", "20"),
        ("1/3", "0.333333"),
        ("-2**2", "-4"),
    ],
)
def test_calculator_values(expression: str, value: str) -> None:
    assert tools.calculator(expression) == value
