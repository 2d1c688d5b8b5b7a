"""The rollout side of `gyre bench faults` in real time: an agent process killed in the middle of a model call, and
the evaluator's scorer process killed (benchmarks/fault_rollouts.py). Each death has its defined outcome and no
agent call is lost: every call the agents sent ended at the proxy (completed, failed, rejected or disconnected),
every completed one reached the builder, and every execution got exactly one outcome."""

from __future__ import annotations

from pathlib import Path

import pytest

from gyre.benchmarks.fault_rollouts import run_rollout_case


@pytest.mark.timeout(300)
def test_an_agent_killed_mid_call_loses_no_call_and_the_groups_end(tiny_model_dir: Path) -> None:
    row = run_rollout_case("agent-mid-call", str(tiny_model_dir))
    assert row["fired"] and row["finished"], row
    assert row["lost_calls"] == 0 and row["calls_sent"] == 11, row
    assert row["executions_without_one_outcome"] == 0 and row["groups_without_group_done"] == 0, row


@pytest.mark.timeout(300)
def test_a_killed_scorer_drops_its_execution_and_the_run_goes_on(tiny_model_dir: Path) -> None:
    row = run_rollout_case("scorer-killed", str(tiny_model_dir))
    assert row["fired"] and row["finished"], row
    assert row["lost_calls"] == 0 and row["calls_completed"] == 12, row
    assert row["executions_without_one_outcome"] == 0 and row["groups_without_group_done"] == 0, row
    assert row["groups_landed"] + row["groups_dropped"] == 2, row
