"""`gyre bench policies --equal-work` on the real main job, at the smallest size that trains: one frozen run (two
would take over a minute), read back by the bench, its work checked against what the run itself recorded.

That two policies run the same executions is measured, not tested here (it takes two runs): BENCHMARKS.md and
benchmarks/policies.py; the check that tells unequal work is tested in tests/unit/benchmarks/."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gyre.benchmarks.policies import PolicyBenchConfig, RunSpec, read_work, run_policy_bench

ROOT = Path(__file__).resolve().parents[2]
TINY = ("--group-size", "2", "--groups-per-step", "1", "--cells", "2", "--engine-kind", "embedded",
        "--train-tasks", "8", "--min-reward-spread", "0")
"""Two groups of 2 over two steps on a core and one satellite, every group kept."""


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_frozen_run_trains_without_changing_the_weights_and_its_work_is_read_back(tmp_path, monkeypatch) -> None:
    from safetensors.torch import load_file

    monkeypatch.setenv("GYRE_CACHE", str(tmp_path / "cache"))
    config = PolicyBenchConfig(topology=str(ROOT / "examples" / "agent_rl.py"), steps=2, out_dir=str(tmp_path / "out"),
                               policies=("elastic",), topology_args=TINY, equal_work=True, run_timeout_s=240)
    result = run_policy_bench(config, cwd=tmp_path)
    report = tmp_path / "out" / "elastic"
    summary = json.loads((report / "summary.json").read_text())
    assert (summary["frozen_policy"], summary["lr"], summary["task_sampling"]) == (True, 0.0, "epoch")
    # Two optimizer steps ran at learning rate 0 and the weights came through them bit for bit.
    final = load_file(report / "final_model" / "model.safetensors")
    warm = load_file(Path(summary["warm_start"]) / "model.safetensors")
    assert sorted(final) == sorted(warm) and all(final[name].equal(warm[name]) for name in warm)
    # The work read off the event log is what the core reported it trained, step by step.
    work = read_work(report, RunSpec("elastic"))
    steps = json.loads((report / "run.json").read_text())["steps"]
    for step in steps:
        trained = [e for e in work.executions.values() if e.step_id == step["step"]]
        assert (sum(e.samples for e in trained), sum(e.tokens for e in trained)) == (step["samples"], step["tokens"])
        assert len(trained) == 2  # a step is groups_per_step * group_size executions
    (check,) = result["equal_work_by_round"]
    assert check["work_equal"] and check["runs"]["elastic"]["fixed_work_s"] == steps[-1]["t_s"]
    assert result["elastic_fixed_work_s"] == steps[-1]["t_s"] and result["work_equal"]
