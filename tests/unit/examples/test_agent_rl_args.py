"""The main job's command line (examples/agent_rl.py): defaults and refused values."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

AGENT_RL = Path(__file__).resolve().parents[3] / "examples" / "agent_rl.py"


@pytest.fixture(scope="module")
def agent_rl():
    spec = importlib.util.spec_from_file_location("agent_rl_under_test", AGENT_RL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_defaults(agent_rl) -> None:
    args = agent_rl.parse_args([])
    assert (args.policy, args.task_sampling, args.group_size, args.steps) == ("elastic", "signal-per-token", 16, 18)
    assert (args.clip_low, args.clip_high, args.cell_cpu_cores) == (3e-4, 4e-4, 0.0)
    assert (args.sft_epochs, args.lr) == (1, 3e-4)  # the warm start RL has room above (BENCHMARKS.md, session 7)
    assert args.min_reward_spread == 0.25  # drop groups that differ only by the written-file reward (session 8)
    assert args.heldout_tasks == 224  # runs gaining +6.7 on 224 read +3.6 to +10.7 on 56 (session 8)
    # From session 12's warm start (900 demonstrations after the decayed copy pretraining) RL at 0.7 gained +11.6
    # and +9.8 points, at 1.0 +6.7 (samples of the kinds the greedy model half solves rarely succeed at 1.0).
    assert (args.rollout_temperature, args.sft_tasks) == (0.7, 900)
    # 8 groups a step: +11.4 to +14.0 sampled in six runs, against +5.6 to +9.6 with 4 (sessions 12 and 13).
    assert (args.groups_per_step, args.sampled_eval_samples) == (8, 2)
    assert (args.copy_steps, args.copy_decay_steps, args.copy_gap_steps, args.copy_gap_decay_steps) == (
        3000, 600, 1200, 400)  # a copier that settles: quotes a task's words in 0.98 of held-out examples (0.39)


def test_the_cells_engines_take_every_agent_the_executor_runs_with_room_to_spare(agent_rl) -> None:
    args = agent_rl.parse_args([])
    assert args.agents_at_once == 32  # two groups of 16
    engine = agent_rl.cell_engine(args)
    assert (engine.max_running_requests, engine.num_blocks) == (48, 1024)  # 0.9 * 48 >= 32: one cell takes all
    wide = agent_rl.cell_engine(agent_rl.parse_args(["--agents-at-once", "64"]))
    assert (wide.max_running_requests, wide.num_blocks) == (96, 2048)
    assert agent_rl.parse_args(["--group-size", "8"]).agents_at_once == 16


def test_the_policy_flags_choose_the_scheduling_policy(agent_rl) -> None:
    from gyre.policies.scheduling import AsyncPolicy, ColocatePolicy, ElasticPolicy

    elastic = agent_rl._policy(agent_rl.parse_args([]))
    assert isinstance(elastic, ElasticPolicy) and elastic.idle_rollout_trains
    assert not agent_rl._policy(agent_rl.parse_args(["--elastic-keep-a-rollout-cell"])).idle_rollout_trains
    split = agent_rl._policy(agent_rl.parse_args(["--policy", "async", "--async-train-cells", "core,sat1"]))
    assert split == AsyncPolicy(train_cells=("core", "sat1"))
    assert isinstance(agent_rl._policy(agent_rl.parse_args(["--policy", "colocate"])), ColocatePolicy)


@pytest.mark.parametrize("choice, policy", [("signal", "SignalWeighted"), ("signal-per-token", "SignalPerToken"),
                                            ("epoch", "EpochOrder")])
def test_the_task_source_samples_with_the_chosen_policy(agent_rl, tmp_path: Path, choice: str, policy: str) -> None:
    (tmp_path / "prepare.json").write_text('{"model_dir": "unused: the topology is only built"}')
    topology = agent_rl.topology(["--report", str(tmp_path), "--task-sampling", choice])
    assert type(topology.spec("task_source").config.sampling).__name__ == policy


def test_a_frozen_policy_trains_at_learning_rate_0_on_tasks_in_a_fixed_order(agent_rl, tmp_path: Path) -> None:
    args = agent_rl.parse_args(["--frozen-policy"])
    assert (args.lr, args.lr_warmup_steps, args.task_sampling) == (0.0, 0, "epoch")
    assert agent_rl.parse_args(["--frozen-policy", "--task-sampling", "epoch"]).task_sampling == "epoch"
    assert not agent_rl.parse_args([]).frozen_policy  # off by default
    (tmp_path / "prepare.json").write_text('{"model_dir": "unused: the topology is only built"}')
    topology = agent_rl.topology(["--report", str(tmp_path), "--frozen-policy"])
    assert type(topology.spec("task_source").config.sampling).__name__ == "EpochOrder"
    assert {topology.spec(cell).config.trainer.lr for cell in ("core", "sat1", "sat2")} == {0.0}


@pytest.mark.parametrize("argv", [["--lr", "1e-4"], ["--lr-warmup-steps", "2"], ["--task-sampling", "signal"]])
def test_a_frozen_policy_refuses_flags_that_would_change_the_work(agent_rl, argv, capsys) -> None:
    with pytest.raises(SystemExit) as exited:
        agent_rl.parse_args(["--frozen-policy", *argv])
    assert exited.value.code == 2 and f"drop {argv[0]}" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [
    ["--cell-cpu-cores", "-1"],
    ["--clip-low", "-0.1"],
    ["--clip-low", "1"],
    ["--clip-high", "-0.01"],
    ["--task-sampling", "random"],
    ["--copy-expression-share", "1.5"],
    ["--weight-average-decay", "1"],
    ["--weight-average-decay", "-0.5"],
    ["--checkpoint-every", "-1"],
    ["--lr-warmup-steps", "-2"],
    ["--copy-decay-steps", "-1"],
    ["--copy-gap-decay-steps", "-5"],
    ["--agents-at-once", "-1"],
])
def test_bad_values_are_refused_with_a_message(agent_rl, argv, capsys) -> None:
    with pytest.raises(SystemExit) as exited:
        agent_rl.parse_args(argv)
    assert exited.value.code == 2 and argv[0] in capsys.readouterr().err


def test_held_out_score_splits_success_by_kind(agent_rl) -> None:
    import evaluate  # examples/toolbox, on the path once agent_rl is loaded

    outcome = lambda kind, success: evaluate.TaskOutcome(  # noqa: E731
        task_id=f"{kind}-0", kind=kind, reward=1.0 if success else 0.2, success=success, agent_exit_code=0, seconds=1.0)
    result = evaluate.EvalResult(
        success_rate=0.5, mean_reward=0.6, seconds=4.0,
        outcomes=(outcome("sum", True), outcome("sum", False), outcome("write", False), outcome("calc", True)))
    score = agent_rl.held_out_score(result)
    assert score == {"success_rate": 0.5, "mean_reward": 0.6,
                     "success_by_kind": {"sum": 0.5, "write": 0.0, "calc": 1.0}}


def test_an_interrupted_run_writes_its_report_without_the_held_out_scoring(agent_rl, tmp_path, capsys) -> None:
    # Ctrl-C ends the run with 128 + SIGINT: finish writes the report of what ran but does not start minutes of
    # held-out scoring (a final model is there; loading this fake one would fail if it tried).
    import json
    import signal

    from gyre.runtime.launch import RunResult

    report = tmp_path / "report"
    (report / "final_model").mkdir(parents=True)
    (report / "final_model" / "model.safetensors").write_bytes(b"not a model")
    before = {"success_rate": 0.25, "mean_reward": 0.4, "success_by_kind": {"sum": 0.25}}
    sampled_before = {"temperature": 0.7, "samples": 2, "success_rate": 0.125, "mean_reward": 0.3,
                      "success_by_kind": {"sum": 0.125}}
    (report / "prepare.json").write_text(json.dumps({"before": before, "sampled_before": sampled_before,
                                                     "started_at": 0.0, "model_dir": "warm"}))
    run = {"cells": ["core"], "core_cell": "core", "elapsed_s": 5.0, "switch_requests": 0,
           "steps": [{"t_s": 2.0, "step": 0, "version": 1, "loss": 0.1, "grad_norm": 0.3, "tokens": 50, "samples": 2,
                      "stale_dropped": 0, "skipped": False}],
           "groups": [{"t_s": 1.0, "group_id": "g0", "landed": True, "mean_reward": 0.5, "success_rate": 0.5,
                       "scored": 16, "dropped": 0}],
           "role_changes": [{"t_s": 0.1, "cell": "core", "role": "train", "previous": "", "switch_s": 0.0,
                             "sessions_migrated": 0}]}
    (report / "run.json").write_text(json.dumps(run))
    interrupted = RunResult(128 + signal.SIGINT, "signal SIGINT")
    assert interrupted.interrupted and not RunResult(0, "trained 18 steps").interrupted
    assert RunResult(128 + signal.SIGTERM, "signal SIGTERM").interrupted and not RunResult(1, "crashed").interrupted

    assert agent_rl.finish(["--report", str(report)], interrupted) == 128 + signal.SIGINT
    summary = json.loads((report / "summary.json").read_text())
    # The headline is the sampled score (NaN after: not scored), the greedy one sits beside it.
    assert summary["success_rate_before"] == 0.125 and summary["success_rate_after"] != summary["success_rate_after"]
    assert summary["success_by_kind_before"] == {"sum": 0.125} and summary["success_by_kind_after"] == {}
    assert summary["exit_reason"] == "signal SIGINT" and summary["steps"] == 1
    assert summary["greedy_success_rate_before"] == 0.25
    assert summary["greedy_success_rate_after"] != summary["greedy_success_rate_after"]
    assert summary["success_measure"] == "sampled at temperature 0.7, mean of 2 attempts a task"
    assert summary["sampled_temperature"] == 0.7 and summary["sampled_per_task"] == 2
    assert (report / "reward_curve.png").is_file()
    assert "interrupted; the report leaves out the held-out score" in capsys.readouterr().err


def test_the_held_out_scores_pool_a_greedy_pass_and_every_sampled_attempt_in_one_evaluation(agent_rl) -> None:
    import evaluate  # examples/toolbox, on the path once agent_rl is loaded

    calls = []
    draws = {0.0: [(False, False, True)], 0.7: [(True, False, False), (True, True, False)]}

    def fake_evaluate_passes(model_dir, tasks, temperatures):
        calls.append((model_dir, tuple(tasks), tuple(temperatures)))
        return tuple(evaluate.EvalResult(success_rate=sum(wins) / 3, mean_reward=0.5, seconds=9.0, outcomes=tuple(
            evaluate.TaskOutcome(task_id=f"{kind}-{i}", kind=kind, reward=1.0, success=win, agent_exit_code=0,
                                 seconds=1.0)
            for i, (kind, win) in enumerate(zip(("calc", "calc", "write"), wins))))
            for wins in (draws[t].pop(0) for t in temperatures))

    greedy, sampled = agent_rl.held_out_scores("model", ["t0", "t1", "t2"], greedy=True, temperature=0.7, samples=2,
                                               evaluate_passes=fake_evaluate_passes)
    assert calls == [("model", ("t0", "t1", "t2"), (0.0, 0.7, 0.7))]  # one evaluation: greedy, then two sampled
    assert greedy == {"success_rate": 1 / 3, "mean_reward": 0.5, "success_by_kind": {"calc": 0.0, "write": 1.0}}
    assert sampled == {"temperature": 0.7, "samples": 2, "success_rate": 0.5, "mean_reward": 1.0,
                       "success_by_kind": {"calc": 0.75, "write": 0.0}}
    # What a cache already holds is not scored again; with nothing left to score, no evaluation starts.
    draws[0.7] = [(True, True, True)]
    greedy, sampled = agent_rl.held_out_scores("model", ["t0", "t1", "t2"], greedy=False, temperature=0.7, samples=1,
                                               evaluate_passes=fake_evaluate_passes)
    assert greedy is None and sampled["success_rate"] == 1.0 and calls[-1][2] == (0.7,)
    assert agent_rl.held_out_scores("model", ["t0"], greedy=False, temperature=0.7, samples=0,
                                    evaluate_passes=None) == (None, None)
    assert len(calls) == 2
    assert agent_rl.parse_args([]).sampled_eval_samples == 2
    with pytest.raises(SystemExit):
        agent_rl.parse_args(["--sampled-eval-samples", "-1"])


def test_the_headline_is_the_sampled_score_when_measured_else_the_greedy_one(agent_rl) -> None:
    greedy_before = {"success_rate": 0.1, "mean_reward": 0.3, "success_by_kind": {"calc": 0.0}}
    greedy_after = {"success_rate": 0.2, "mean_reward": 0.5, "success_by_kind": {"calc": 0.5}}
    sampled_before = {"temperature": 0.7, "samples": 4, "success_rate": 0.05, "mean_reward": 0.25,
                      "success_by_kind": {"calc": 0.1}}
    sampled_after = {"temperature": 0.7, "samples": 4, "success_rate": 0.3, "mean_reward": 0.6,
                     "success_by_kind": {"calc": 0.9}}

    scores = agent_rl.headline_scores(greedy_before, greedy_after, sampled_before, sampled_after)
    assert (scores["before"], scores["after"]) == (sampled_before, sampled_after)
    assert scores["extra"]["success_measure"] == "sampled at temperature 0.7, mean of 4 attempts a task"
    assert (scores["extra"]["greedy_success_rate_before"], scores["extra"]["greedy_success_rate_after"]) == (0.1, 0.2)
    assert scores["extra"]["greedy_success_by_kind_after"] == {"calc": 0.5}

    greedy_only = agent_rl.headline_scores(greedy_before, greedy_after, None, None)
    assert (greedy_only["before"], greedy_only["after"]) == (greedy_before, greedy_after)
    assert greedy_only["extra"]["success_measure"] == "greedy" and "sampled_temperature" not in greedy_only["extra"]
    nothing = agent_rl.headline_scores(agent_rl.NOT_SCORED, agent_rl.NOT_SCORED, None, None)  # --skip-eval
    assert nothing["extra"]["success_measure"] == "not scored"


def test_every_cells_trainer_takes_the_layout_and_precision_asked_for(agent_rl, tmp_path: Path) -> None:
    from gyre.engines.model_format import init_model_dir

    model = init_model_dir(tmp_path / "tiny-moe", "tiny-moe", seed=0)
    (tmp_path / "prepare.json").write_text(json.dumps({"model_dir": str(model)}))
    default = agent_rl.topology(["--report", str(tmp_path)]).spec("core").config.trainer
    assert default.parallel.world_size == 1 and default.precision == "fp32"
    topology = agent_rl.topology(["--report", str(tmp_path), "--trainer-layout", "1,2,2,2", "--trainer-precision",
                                  "bf16"])
    trainers = {topology.spec(cell).config.trainer for cell in ("core", "sat1", "sat2")}
    assert len(trainers) == 1  # the cells of a step share one layout
    (trainer,) = trainers
    assert (trainer.tensor_parallel, trainer.pipeline_parallel, trainer.data_parallel, trainer.expert_parallel,
            trainer.precision) == (1, 2, 2, 2, "bf16")
    # A layout the model cannot take is refused before any process starts, naming what does not divide.
    with pytest.raises(SystemExit, match="--trainer-layout 1,1,3,3: .*num_experts 8"):
        agent_rl.topology(["--report", str(tmp_path), "--trainer-layout", "1,1,3,3"])


@pytest.mark.parametrize("argv", [["--trainer-layout", "2,1,1"], ["--trainer-layout", "0,1,1,1"],
                                  ["--trainer-layout", "1,1,a,1"], ["--trainer-layout", "1,1,2,4"]])
def test_bad_trainer_layouts_are_refused(agent_rl, argv: list[str], capsys) -> None:
    with pytest.raises(SystemExit) as exited:
        agent_rl.parse_args(argv)
    assert exited.value.code == 2 and "--trainer-layout" in capsys.readouterr().err


def test_the_cells_come_from_the_arguments_three_by_default(agent_rl) -> None:
    assert agent_rl.parse_args([]).cell_names == ("core", "sat1", "sat2")
    assert agent_rl.parse_args([]).cell_resources == {}
    many = agent_rl.parse_args(["--cells", "64", "--cell-resources", "CPU=4,GPU=1,gpu_node=1"])
    assert len(many.cell_names) == 64 and many.cell_names[0] == "core" and many.cell_names[-1] == "sat63"
    assert many.cell_resources == {"CPU": 4.0, "GPU": 1.0, "gpu_node": 1.0}
    assert agent_rl.parse_args(["--cells", "1"]).cell_names == ("core",)


@pytest.mark.parametrize("argv", [["--cells", "0"], ["--cell-resources", "CPU"], ["--cell-resources", "GPU=-1"],
                                  ["--cell-resources", "CPU=1,CPU=2"], ["--cell-resources", "CPU=nan"],
                                  ["--cells", "2", "--policy", "async", "--async-train-cells", "core,sat2"]])
def test_bad_cell_arguments_are_refused(agent_rl, argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        agent_rl.parse_args(argv)
    assert exit_info.value.code == 2


def test_the_topology_has_the_cells_asked_for_with_their_resources(agent_rl, tmp_path: Path) -> None:
    (tmp_path / "prepare.json").write_text('{"model_dir": "%s"}' % (tmp_path / "model"))
    argv = ["--report", str(tmp_path), "--cells", "5", "--cell-resources", "CPU=2,GPU=1,big=1"]
    topology = agent_rl.topology(argv)
    cells = [spec.name for spec in topology.specs if spec.actor_cls.__name__ == "Cell"]
    assert cells == ["core", "sat1", "sat2", "sat3", "sat4"]
    assert {name: topology.resources_of(name).as_bundle() for name in cells} == {
        name: {"CPU": 2.0, "GPU": 1.0, "big": 1.0} for name in cells}
    assert topology.resources_of("control").as_bundle() == {"CPU": 1.0}
    assert topology.spec("scheduler").config.expected_cells == tuple(cells)
    assert topology.spec("monitor").config.cells == tuple(cells)
    default = agent_rl.topology(["--report", str(tmp_path)])
    assert [s.name for s in default.specs if s.actor_cls.__name__ == "Cell"] == ["core", "sat1", "sat2"]
    assert default.resources_by_process == {}


def test_the_score_before_rl_is_the_cached_one_with_the_most_attempts_a_task(agent_rl, tmp_path) -> None:
    import json

    name = "eval-sampled-pooled-224-0-t0.7-k2.json"
    assert agent_rl.most_attempts_cached(tmp_path, name, 2) is None  # nothing cached: the run scores it
    k2 = {"temperature": 0.7, "samples": 2, "success_rate": 0.094, "mean_reward": 0.26, "success_by_kind": {}}
    k16 = dict(k2, samples=16, success_rate=0.075)
    (tmp_path / name).write_text(json.dumps(k2))
    assert agent_rl.most_attempts_cached(tmp_path, name, 2) == k2
    (tmp_path / "eval-sampled-pooled-224-0-t0.7-k16.json").write_text(json.dumps(k16))
    (tmp_path / "eval-sampled-pooled-224-0-t1.0-k32.json").write_text(json.dumps(dict(k2, samples=32)))  # not 0.7
    (tmp_path / "eval-sampled-pooled-96-0-t0.7-k32.json").write_text(json.dumps(dict(k2, samples=32)))  # not 224
    assert agent_rl.most_attempts_cached(tmp_path, name, 2) == k16
    assert agent_rl.most_attempts_cached(tmp_path, name.replace("-k2", "-k32"), 32) is None  # fewer than asked
    (tmp_path / "eval-sampled-pooled-224-0-t0.7-k8.json").write_text(json.dumps(dict(k2, samples=4)))
    with pytest.raises(ValueError, match="k8.json: its name says 8 attempts a task, its content 4"):
        agent_rl.most_attempts_cached(tmp_path, name, 2)

    # The summary says how many attempts each side had.
    greedy = {"success_rate": 0.1, "mean_reward": 0.3, "success_by_kind": {}}
    scores = agent_rl.headline_scores(greedy, greedy, k16, dict(k2, success_rate=0.19))
    assert scores["extra"]["success_measure"] == "sampled at temperature 0.7, mean of 2 attempts a task (16 before RL)"
    assert (scores["extra"]["sampled_per_task"], scores["extra"]["sampled_per_task_before"]) == (2, 16)
