"""benchmarks/policies.py's equal-work mode: what a run trained, read off an event log written here, and the check
that tells equal work from unequal."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gyre.benchmarks.policies import ExecutionWork, PolicyBenchError, RunSpec, RunWork, compare_work, read_work
from gyre.messages.model_calls import ModelCallCompleted
from gyre.messages.samples import ExecutionScored, TrainingSample
from gyre.messages.training import ClaimGranted
from gyre.policies.trajectory_tree import whole_prompt_call
from gyre.runtime.codec import Codec
from gyre.runtime.envelope import Envelope, Kind
from gyre.runtime.event_log import EventLogWriter


def _sample(execution: str, group: str, tokens: tuple[int, ...], advantage: float = 0.5) -> TrainingSample:
    n = len(tokens)
    return TrainingSample(
        execution_id=execution, group_id=group, trajectory_rank=0, trajectory_kind="main", leaf_call_index=0,
        token_ids=tokens, loss_mask=(False,) + (True,) * (n - 1), behaviour_logprobs=(0.0,) * n,
        sampling_temperatures=(1.0,) * n, advantages=(advantage,) * n, weights=(0.0,) + (1.0 / (n - 1),) * (n - 1),
        min_weight_version=0, max_weight_version=0, num_loss_tokens=n - 1)


def _granted(step: int, index: int, *samples: TrainingSample) -> ClaimGranted:
    return ClaimGranted(step_id=step, microstep_index=index, samples=samples, num_executions_in_step=len(samples),
                        retry_after_s=0.0)


def _call(execution: str, group: str, index: int, output: tuple[int, ...]) -> ModelCallCompleted:
    return whole_prompt_call(
        execution_id=execution, group_id=group, call_index=index, agent_id="main", call_kind="turn",
        prompt_ids=(1, 2, 3), output_ids=output, output_logprobs=(0.0,) * len(output),
        output_versions=(0,) * len(output), finish_reason="stop", cached_tokens=0, cell="sat1", started_s=0.0,
        finished_s=0.0, sampling_temperature=0.7)


def _scored(execution: str, group: str, reward: float) -> ExecutionScored:
    return ExecutionScored(execution_id=execution, group_id=group, reward=reward, timed_out=False, detail="")


def _report(folder: Path, step_times: list[float], records: list[tuple[str, object]]) -> Path:
    """A report folder as a run leaves it: run.json with the applied steps, events.glog with `records` (receiver,
    message), each written through the real codec and log writer."""
    folder.mkdir(parents=True)
    steps = [{"t_s": t, "step": i, "samples": 0, "tokens": 0} for i, t in enumerate(step_times)]
    (folder / "run.json").write_text(json.dumps({"cells": ["core"], "core_cell": "core", "steps": steps}))
    codec = Codec()
    writer = EventLogWriter(folder / "events.glog")
    for index, (receiver, message) in enumerate(records):
        envelope = Envelope(msg_id=index + 1, sender="x", receiver=receiver, topic="", time_s=float(index),
                            correlation_id=0, causation_id=0, kind=Kind.TELL)
        writer.append(float(index), *codec.encode(envelope, message))
    writer.close()
    return folder


def _run_records(output_of_e1: tuple[int, ...] = (7, 8), tokens_of_e3: tuple[int, ...] = (1, 2, 3, 4)):
    """Two applied steps: g1 (executions e1, e2) in step 0, g2 (e3) in step 1; step 2 was under way at the end."""
    g1 = (_sample("e1", "g1", (1, 2, 3) + output_of_e1), _sample("e2", "g1", (1, 2, 3, 9), -0.5))
    g2 = (_sample("e3", "g2", tokens_of_e3),)
    return [
        ("proxy", _call("e1", "g1", 0, output_of_e1)),
        ("sat1", _call("e1", "g1", 0, output_of_e1)),  # every cell hears every call: one call, logged twice
        ("proxy", _call("e2", "g1", 0, (9,))),
        ("proxy", _call("e3", "g2", 0, (4,))),
        ("trajectory_builder", _scored("e1", "g1", 1.0)),
        ("trajectory_builder", _scored("e2", "g1", 0.0)),
        ("trajectory_builder", _scored("e3", "g2", 1.0)),
        ("core", _granted(0, 0, *g1)),
        ("sat1", _granted(0, 0, *g1)),  # released by a cell that switched away, granted again: counts once
        ("core", _granted(-1, -1)),  # "no work now"
        ("core", _granted(1, 0, *g2)),
        ("core", _granted(2, 0, _sample("e4", "g3", (1, 2)))),  # its step was never applied
    ]


def test_read_work_takes_the_applied_steps_executions_once_each(tmp_path: Path) -> None:
    work = read_work(_report(tmp_path / "r", [10.0, 14.0], _run_records()), RunSpec("elastic"))
    assert work.name == "elastic" and work.step_times_s == {0: 10.0, 1: 14.0}
    assert sorted(work.executions) == ["e1", "e2", "e3"]  # e4's step was not applied
    e1, e2, e3 = (work.executions[e] for e in ("e1", "e2", "e3"))
    assert (e1.group_id, e1.step_id, e1.samples, e1.tokens) == ("g1", 0, 1, 5)
    assert (e2.group_id, e2.step_id, e2.tokens) == ("g1", 0, 4)
    assert (e3.group_id, e3.step_id, e3.tokens) == ("g2", 1, 4)
    assert len({e1.calls_digest, e2.calls_digest, e3.calls_digest}) == 3


def test_the_same_run_read_twice_is_equal_work_and_one_token_makes_it_unequal(tmp_path: Path) -> None:
    same = [read_work(_report(tmp_path / name, [10.0, 14.0], _run_records()), RunSpec(name))
            for name in ("elastic", "colocate")]
    check = compare_work(same)
    assert check["work_equal"] and check["why_unequal"] == [] and check["same_executions"] and check["same_groups"]
    assert (check["common_executions"], check["executions_identical"], check["calls_identical"]) == (3, 3, 3)
    assert check["runs"]["colocate"]["fixed_work_s"] == 14.0 and check["runs"]["elastic"]["extra_share"] == 0.0
    # The same executions, but e1 sampled another token: its call and the sample it became differ.
    other = read_work(_report(tmp_path / "async", [10.0, 16.0], _run_records(output_of_e1=(7, 5))),
                      RunSpec("async[core]"))
    check = compare_work([same[0], other])
    assert not check["work_equal"] and check["same_executions"]
    assert (check["executions_identical"], check["calls_identical"]) == (2, 2)
    assert check["why_unequal"][0].startswith("1 of the 3 executions every run trained were trained differently "
                                              "(first: e1; 2 of the 3 made the same calls")
    # What was trained can differ where the calls do not: e3's call is alike, its sample not.
    trimmed = read_work(_report(tmp_path / "trimmed", [10.0, 16.0], _run_records(tokens_of_e3=(1, 2, 3, 5))),
                        RunSpec("colocate"))
    check = compare_work([same[0], trimmed])
    assert not check["work_equal"] and "(first: e3; 3 of the 3 made the same calls" in check["why_unequal"][0]
    assert (check["executions_identical"], check["calls_identical"]) == (2, 3)


def test_read_work_says_when_a_run_left_no_event_log(tmp_path: Path) -> None:
    folder = _report(tmp_path / "r", [1.0, 2.0], [])
    (folder / "events.glog").unlink()
    with pytest.raises(PolicyBenchError, match="no event log"):
        read_work(folder, RunSpec("elastic"))
    (folder / "events.glog").write_bytes(b"not a log")
    with pytest.raises(PolicyBenchError, match="cannot read"):
        read_work(folder, RunSpec("elastic"))


def _execution(group: str, step: int, tokens: int, digest: str = "same") -> ExecutionWork:
    return ExecutionWork(group_id=group, step_id=step, samples=tokens // 10, tokens=tokens, samples_digest=digest,
                         calls_digest="calls")


def test_the_fixed_work_is_what_every_run_trained_and_its_time_the_step_that_finished_it() -> None:
    # elastic trained e0, e1 in step 0 and e2, e4 in step 1; colocate e0, e2 then e1, e3 (e3 a longer one):
    # e0-e2 are the common work, done at each run's step 1, beside one execution of other work each.
    elastic = RunWork("elastic", {0: 5.0, 1: 9.0}, {
        "e0": _execution("g0", 0, 100), "e1": _execution("g0", 0, 100), "e2": _execution("g1", 1, 100),
        "e4": _execution("g2", 1, 100)})
    colocate = RunWork("colocate", {0: 6.0, 1: 12.0}, {
        "e0": _execution("g0", 0, 100), "e2": _execution("g1", 0, 100), "e1": _execution("g0", 1, 100),
        "e3": _execution("g1", 1, 120)})
    check = compare_work([elastic, colocate], tolerance=0.05)
    assert check["common_executions"] == 3 and not check["same_executions"] and not check["same_groups"]
    assert check["runs"]["elastic"] == {"groups": 3, "executions": 4, "samples": 40, "tokens": 400, "fixed_work_s": 9.0,
                                        "fixed_work_step": 1, "fixed_work_samples": 30, "fixed_work_tokens": 300,
                                        "tokens_by_fixed_work": 400, "extra_share": 0.25}
    assert check["runs"]["colocate"]["fixed_work_s"] == 12.0
    assert check["runs"]["colocate"]["tokens_by_fixed_work"] == 420
    # By their fixed-work times the runs had trained 400 and 420 tokens: 5% apart, equal within 5%, not within 4%.
    assert check["work_equal"]
    tight = compare_work([elastic, colocate], tolerance=0.04)
    assert not tight["work_equal"]
    assert tight["why_unequal"] == ["by their fixed-work times the runs had trained 400 to 420 tokens (5% apart, more "
                                    "than 4%): elastic 400, colocate 420"]


def test_runs_with_nothing_in_common_are_unequal_work() -> None:
    a = RunWork("elastic", {0: 1.0}, {"e0": _execution("g0", 0, 10)})
    b = RunWork("colocate", {0: 1.0}, {"e1": _execution("g0", 0, 10)})
    check = compare_work([a, b])
    assert not check["work_equal"] and check["why_unequal"] == ["no execution was trained by every run"]
    assert "fixed_work_s" not in check["runs"]["elastic"] and check["same_groups"]
    with pytest.raises(ValueError):
        compare_work([])
