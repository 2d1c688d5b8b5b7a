"""The main job's command line (examples/agent_rl.py): defaults and refused values."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

AGENT_RL = Path(__file__).resolve().parents[2] / "examples" / "agent_rl.py"


@pytest.fixture(scope="module")
def agent_rl():
    spec = importlib.util.spec_from_file_location("agent_rl_under_test", AGENT_RL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_defaults(agent_rl) -> None:
    args = agent_rl.parse_args([])
    assert (args.policy, args.task_sampling, args.group_size, args.steps) == ("elastic", "signal", 16, 18)
    assert (args.clip_low, args.clip_high, args.cell_cpu_cores) == (3e-4, 4e-4, 0.0)
    assert (args.sft_epochs, args.lr) == (1, 3e-4)  # the warm start RL has room above (BENCHMARKS.md, session 7)


@pytest.mark.parametrize("argv", [
    ["--cell-cpu-cores", "-1"],
    ["--clip-low", "-0.1"],
    ["--clip-low", "1"],
    ["--clip-high", "-0.01"],
    ["--task-sampling", "random"],
    ["--copy-expression-share", "1.5"],
])
def test_bad_values_are_refused_with_a_message(agent_rl, argv, capsys) -> None:
    with pytest.raises(SystemExit) as exited:
        agent_rl.parse_args(argv)
    assert exited.value.code == 2 and argv[0] in capsys.readouterr().err
