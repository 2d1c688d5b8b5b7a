"""benchmarks/policies.py's equal-work mode: what a run trained, read off an event log written here, and the check
that tells equal work from unequal."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gyre.benchmarks.policies import GroupWork, PolicyBenchError, RunSpec, RunWork, compare_work, read_work
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


def test_read_work_takes_the_applied_steps_groups_once_each(tmp_path: Path) -> None:
    work = read_work(_report(tmp_path / "r", [10.0, 14.0], _run_records()), RunSpec("elastic"))
    assert work.name == "elastic" and work.step_times_s == {0: 10.0, 1: 14.0}
    assert sorted(work.groups) == ["g1", "g2"]  # g3's step was not applied
    g1, g2 = work.groups["g1"], work.groups["g2"]
    assert (g1.step_id, g1.samples, g1.tokens) == (0, 2, 9)
    assert (g2.step_id, g2.samples, g2.tokens) == (1, 1, 4)
    assert [execution for execution, _ in g1.executions] == ["e1", "e2"]


def test_the_same_run_read_twice_is_equal_work_and_one_token_makes_it_unequal(tmp_path: Path) -> None:
    same = [read_work(_report(tmp_path / name, [10.0, 14.0], _run_records()), RunSpec(name))
            for name in ("elastic", "colocate")]
    check = compare_work(same)
    assert check["work_equal"] and check["why_unequal"] == [] and check["same_groups"]
    assert (check["common_groups"], check["groups_identical"], check["executions_identical"]) == (2, 2, 3)
    assert check["runs"]["colocate"]["fixed_work_s"] == 14.0 and check["runs"]["elastic"]["extra_share"] == 0.0
    # The same groups, but e1 sampled another token: its call and the sample it became differ.
    other = read_work(_report(tmp_path / "async", [10.0, 16.0], _run_records(output_of_e1=(7, 5))),
                      RunSpec("async[core]"))
    check = compare_work([same[0], other])
    assert not check["work_equal"] and check["same_groups"]
    assert (check["groups_identical"], check["executions"], check["executions_identical"]) == (1, 3, 2)
    assert "1 of the 2 groups every run trained were trained differently (first: g1" in check["why_unequal"][0]
    # What was trained can differ where the calls do not: g2's call is alike, its sample not.
    trimmed = read_work(_report(tmp_path / "trimmed", [10.0, 16.0], _run_records(tokens_of_e3=(1, 2, 3, 5))),
                        RunSpec("colocate"))
    check = compare_work([same[0], trimmed])
    assert not check["work_equal"] and check["groups_identical"] == 1 and "first: g2" in check["why_unequal"][0]
    assert check["executions_identical"] == 3


def test_read_work_says_when_a_run_left_no_event_log(tmp_path: Path) -> None:
    folder = _report(tmp_path / "r", [1.0, 2.0], [])
    (folder / "events.glog").unlink()
    with pytest.raises(PolicyBenchError, match="no event log"):
        read_work(folder, RunSpec("elastic"))
    (folder / "events.glog").write_bytes(b"not a log")
    with pytest.raises(PolicyBenchError, match="cannot read"):
        read_work(folder, RunSpec("elastic"))


def _group(step: int, tokens: int, digest: str = "same", executions=(("e", "calls"),)) -> GroupWork:
    return GroupWork(step_id=step, samples=tokens // 10, tokens=tokens, samples_digest=digest,
                     executions=tuple(executions))


def test_the_fixed_work_is_what_every_run_trained_and_its_time_the_step_that_finished_it() -> None:
    # elastic trained g0, g1 in step 0 and g2, g4 in step 1; colocate g0, g2 then g1, g3: g0-g2 are common.
    elastic = RunWork("elastic", {0: 5.0, 1: 9.0}, {
        "g0": _group(0, 100), "g1": _group(0, 100), "g2": _group(1, 100), "g4": _group(1, 100)})
    colocate = RunWork("colocate", {0: 6.0, 1: 12.0}, {
        "g0": _group(0, 100), "g2": _group(0, 100), "g1": _group(1, 100), "g3": _group(1, 100)})
    check = compare_work([elastic, colocate], max_extra_share=0.3)
    assert check["common_groups"] == 3 and not check["same_groups"] and check["work_equal"]
    assert check["runs"]["elastic"] == {"groups": 4, "samples": 40, "tokens": 400, "fixed_work_s": 9.0,
                                        "fixed_work_step": 1, "fixed_work_samples": 30, "fixed_work_tokens": 300,
                                        "extra_share": 0.25}
    assert check["runs"]["colocate"]["fixed_work_s"] == 12.0
    # The same runs judged with a tighter bound on the other work done by the fixed-work time: unequal, and why.
    tight = compare_work([elastic, colocate], max_extra_share=0.1)
    assert not tight["work_equal"]
    assert [line.split(":")[0] for line in tight["why_unequal"]] == ["elastic", "colocate"]
    assert "25% of the tokens" in tight["why_unequal"][0]


def test_runs_with_nothing_in_common_are_unequal_work() -> None:
    a = RunWork("elastic", {0: 1.0}, {"g0": _group(0, 10)})
    b = RunWork("colocate", {0: 1.0}, {"g1": _group(0, 10)})
    check = compare_work([a, b])
    assert not check["work_equal"] and check["why_unequal"] == ["no group was trained by every run"]
    assert "fixed_work_s" not in check["runs"]["elastic"]
    with pytest.raises(ValueError):
        compare_work([])
