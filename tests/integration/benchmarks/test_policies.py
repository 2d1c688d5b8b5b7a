"""`gyre bench policies`: orchestration over real `gyre run` subprocesses, and the arithmetic of its summary."""

from __future__ import annotations

import json
from pathlib import Path

import attrs
import pytest

from gyre.benchmarks.policies import (
    ExecutionWork,
    PolicyBenchConfig,
    PolicyBenchError,
    PolicyRun,
    RunSpec,
    RunWork,
    async_splits,
    read_run,
    run_policy_bench,
    summarize,
)

STAND_IN = Path(__file__).with_name("policy_bench_topology.py")


def test_async_splits_keep_the_core_training_and_one_cell_rolling_out():
    assert async_splits(("core", "sat1", "sat2"), "core") == (("core",), ("core", "sat1"))
    assert async_splits(("a", "core"), "core") == (("core",),)
    with pytest.raises(PolicyBenchError, match="not among"):
        async_splits(("sat1", "sat2"), "core")
    with pytest.raises(PolicyBenchError, match="at least one satellite"):
        async_splits(("core",), "core")


def _write_run(folder: Path, step_times: list[float], role_changes=()) -> Path:
    folder.mkdir(parents=True)
    steps = [{"t_s": t, "step": i, "samples": 3, "tokens": 50} for i, t in enumerate(step_times)]
    record = {"cells": ["core", "sat1"], "core_cell": "core", "elapsed_s": step_times[-1] if step_times else 0,
              "steps": steps, "role_changes": list(role_changes)}
    (folder / "run.json").write_text(json.dumps(record))
    return folder


def test_read_run_measures_steady_steps_and_counts_switches(tmp_path):
    changes = [{"cell": "core", "previous": "", "t_s": 3.0}, {"cell": "sat1", "previous": "", "t_s": 4.5},
               {"cell": "sat1", "previous": "rollout", "t_s": 9.0}, {"cell": "sat1", "previous": "train", "t_s": 12.0}]
    run = read_run(_write_run(tmp_path / "r", [10.0, 14.0, 20.0], changes), RunSpec("elastic"))
    assert run.steady_s_per_step == pytest.approx(5.0)
    assert run.steady_tokens_per_s == pytest.approx(100 / 10.0)  # the two steps after the first, 50 tokens each
    assert run.cells_ready_s == 4.5 and run.fixed_work_s is None
    assert run.first_step_s == 10.0
    assert (run.samples, run.tokens, run.role_switches) == (9, 150, 2)
    assert (run.cells, run.core_cell) == (("core", "sat1"), "core")


def test_read_run_refuses_runs_without_two_steps_or_run_json(tmp_path):
    with pytest.raises(PolicyBenchError, match="at least 2"):
        read_run(_write_run(tmp_path / "one", [3.0]), RunSpec("colocate"))
    with pytest.raises(PolicyBenchError, match="no readable run.json"):
        read_run(tmp_path / "missing", RunSpec("colocate"))


def _run(name: str, policy: str, s_per_step: float, train_cells=()) -> PolicyRun:
    return PolicyRun(name, policy, tuple(train_cells), 3, s_per_step, 1.0, 10.0, 6, 60, 0, ("core", "sat1"), "core")


def test_summary_takes_async_at_its_best_split_and_divides_by_elastic():
    result = summarize([
        _run("elastic", "elastic", 2.0), _run("async[core]", "async", 4.0, ["core"]),
        _run("async[core+sat1]", "async", 3.0, ["core", "sat1"]), _run("colocate", "colocate", 5.0),
    ])
    assert result["async_s_per_step"] == 3.0 and result["async_best_split"] == ["core", "sat1"]
    assert result["elastic_speedup_vs_async"] == pytest.approx(1.5)
    assert result["elastic_speedup_vs_colocate"] == pytest.approx(2.5)
    assert result["async_splits_s_per_step"] == {"async[core]": 4.0, "async[core+sat1]": 3.0}


def test_rounds_give_medians_per_configuration_and_the_median_of_each_rounds_own_ratio():
    rounds = [
        # round 0: a slow spell hit elastic and async[core+sat1] alike
        [_run("elastic", "elastic", 4.0), _run("async[core]", "async", 9.0, ["core"]),
         _run("async[core+sat1]", "async", 5.0, ["core", "sat1"]), _run("colocate", "colocate", 6.0)],
        [_run("elastic", "elastic", 2.0), _run("async[core]", "async", 4.0, ["core"]),
         _run("async[core+sat1]", "async", 3.0, ["core", "sat1"]), _run("colocate", "colocate", 2.5)],
        [_run("elastic", "elastic", 2.5), _run("async[core]", "async", 2.0, ["core"]),
         _run("async[core+sat1]", "async", 3.5, ["core", "sat1"]), _run("colocate", "colocate", 3.0)],
    ]
    result = summarize([run for r in rounds for run in r], rounds)
    assert result["rounds"] == 3
    assert result["s_per_step_by_round"]["elastic"] == [4.0, 2.0, 2.5]
    assert result["elastic_s_per_step"] == 2.5 and result["colocate_s_per_step"] == 3.0
    # async's figure is its best split by median (core+sat1: 3.5, core: 4.0) ...
    assert result["async_best_split"] == ["core", "sat1"] and result["async_s_per_step"] == 3.5
    assert result["async_splits_s_per_step"] == {"async[core]": 4.0, "async[core+sat1]": 3.5}
    # ... while each round's ratio takes that round's best split: 5/4, 3/2, 2/2.5.
    assert result["elastic_speedup_vs_async_by_round"] == pytest.approx([1.25, 1.5, 0.8])
    assert result["elastic_speedup_vs_async"] == pytest.approx(1.25)
    assert result["elastic_speedup_vs_colocate_by_round"] == pytest.approx([1.5, 1.25, 1.2])
    assert result["elastic_speedup_vs_colocate"] == pytest.approx(1.25)


def test_repeats_run_every_configuration_each_round_into_its_own_folder(tmp_path):
    calls = []

    def run_one(config, spec, folder, cwd):
        calls.append((spec.name, folder.relative_to(tmp_path).as_posix()))
        run = _run(spec.name, spec.policy, 1.0 + len(calls), spec.train_cells)
        return attrs.evolve(run, cells=("core", "sat1", "sat2"))

    config = PolicyBenchConfig(steps=2, out_dir=str(tmp_path), repeats=2)
    result = run_policy_bench(config, cwd=tmp_path, run_one=run_one)
    order = ["elastic", "colocate", "async[core]", "async[core+sat1]"]
    folders = ["elastic", "colocate", "async-core", "async-core+sat1"]
    assert calls == [(n, f"round{r}/{f}") for r in range(2) for n, f in zip(order, folders)]
    assert result["rounds"] == 2 and len(result["runs"]) == 8
    with pytest.raises(ValueError):
        PolicyBenchConfig(repeats=0)


def test_equal_work_times_each_round_on_the_executions_all_its_runs_trained(tmp_path):
    # Each run trained e0..e3 in two steps; its steps come at the times below (elastic fastest on the fixed work,
    # though async[core+sat1] has the best s/step), and round 1's colocate trained one execution differently.
    step_times = {"elastic": (4.0, 8.0), "colocate": (6.0, 12.0), "async[core]": (5.0, 11.0),
                  "async[core+sat1]": (9.0, 11.0)}
    calls = []

    def run_one(config, spec, folder, cwd):
        calls.append(spec.name)
        first, last = step_times[spec.name]
        return PolicyRun(spec.name, spec.policy, spec.train_cells, 2, last - first, first, last, 8, 800, 0,
                         ("core", "sat1", "sat2"), "core")

    def work_reader(folder, spec):
        unequal = spec.name == "colocate" and folder.parent.name == "round1"
        executions = {f"e{i}": ExecutionWork("g0", i // 2, 2, 200, "other" if unequal and i == 3 else "same", "c")
                      for i in range(4)}
        return RunWork(spec.name, dict(enumerate(step_times[spec.name])), executions)

    config = PolicyBenchConfig(steps=2, out_dir=str(tmp_path), repeats=2, equal_work=True)
    result = run_policy_bench(config, cwd=tmp_path, run_one=run_one, work_reader=work_reader)
    assert len(calls) == 8
    assert [run["fixed_work_s"] for run in result["runs"][:4]] == [8.0, 12.0, 11.0, 11.0]
    assert result["elastic_fixed_work_s"] == 8.0 and result["colocate_fixed_work_s"] == 12.0
    assert result["async_fixed_work_s"] == 11.0 and result["async_fixed_work_best_split"] == ["core"]
    assert result["elastic_fixed_work_speedup_vs_async"] == pytest.approx(11.0 / 8.0)
    assert result["elastic_fixed_work_speedup_vs_colocate_by_round"] == pytest.approx([1.5, 1.5])
    # s/step still says what it said: async[core+sat1]'s 2 s a step beats elastic's 4.
    assert result["async_best_split"] == ["core", "sat1"] and result["elastic_speedup_vs_async"] == 0.5
    assert not result["work_equal"]
    first, second = result["equal_work_by_round"]
    assert first["work_equal"] and first["executions_identical"] == 4
    assert not second["work_equal"] and "(first: e3;" in second["why_unequal"][0]
    assert PolicyBenchConfig().equal_work is False and "fixed_work_s" not in summarize([_run("e", "elastic", 1.0)])


def test_equal_work_runs_the_topology_frozen(tmp_path):
    echo = tmp_path / "echo.py"
    echo.write_text("def topology(argv):\n    raise SystemExit('argv: ' + ' '.join(argv))\n")
    config = PolicyBenchConfig(topology=str(echo), steps=2, out_dir=str(tmp_path / "out"), policies=("colocate",),
                               equal_work=True, topology_args=("--group-size", "8"))
    with pytest.raises(PolicyBenchError, match="--policy colocate --frozen-policy --group-size 8"):
        run_policy_bench(config, cwd=tmp_path)


def test_config_refuses_unknown_policies_and_single_step_runs():
    with pytest.raises(ValueError, match="subset"):
        PolicyBenchConfig(policies=("elastic", "greedy"))
    with pytest.raises(ValueError):
        PolicyBenchConfig(steps=1)


def test_bench_runs_every_configuration_through_gyre_run(tmp_path):
    # Virtual time: the stand-in's step intervals are exact, so the comparison below cannot flake under load.
    config = PolicyBenchConfig(topology=str(STAND_IN), steps=3, out_dir=str(tmp_path), run_timeout_s=120,
                               run_options=("--virtual",))
    result = run_policy_bench(config, cwd=tmp_path)
    names = [run["name"] for run in result["runs"]]
    assert names == ["elastic", "colocate", "async[core]", "async[core+sat1]"]
    assert all((tmp_path / n.replace("[", "-").replace("]", "") / "run.json").is_file() for n in names)
    # The stand-in's step intervals differ by policy (elastic 0.05 s < async best 0.1 s < colocate 0.2 s).
    assert result["async_best_split"] == ["core", "sat1"]
    assert result["elastic_s_per_step"] == pytest.approx(0.05, abs=1e-3)
    assert result["colocate_s_per_step"] == pytest.approx(0.2, abs=1e-3)
    assert result["elastic_speedup_vs_async"] > 1.0 and result["elastic_speedup_vs_colocate"] > 1.0


def test_a_failing_run_is_reported_with_its_output(tmp_path):
    broken = tmp_path / "broken.py"
    broken.write_text("def topology(argv):\n    raise SystemExit('this topology refuses to start')\n")
    config = PolicyBenchConfig(topology=str(broken), steps=2, out_dir=str(tmp_path / "out"), policies=("elastic",))
    with pytest.raises(PolicyBenchError, match="refuses to start"):
        run_policy_bench(config, cwd=tmp_path)


def test_the_cli_imports_only_the_chosen_subcommand():
    from gyre.runtime.cli import chosen_command

    assert chosen_command(["bench", "policies", "--json"]) == "bench.policies"
    assert chosen_command(["run", "examples/x.py", "--report", "r"]) == "run"
    assert chosen_command(["--help"]) is None and chosen_command(["bench"]) is None


def test_the_command_line_refuses_a_missing_topology_and_bad_policies(tmp_path, monkeypatch):
    from gyre.runtime.cli import main

    monkeypatch.chdir(tmp_path)  # no examples/agent_rl.py here: the default topology is missing
    assert main(["bench", "policies", "--steps", "2"]) == 2
    assert main(["bench", "policies", "--policies", "elastic,greedy"]) == 2
    assert main(["bench", "policies", "--equal-work", "--work-tolerance", "1.5"]) == 2
