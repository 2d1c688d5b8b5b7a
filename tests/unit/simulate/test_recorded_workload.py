"""simulate/recorded.py (`gyre simulate --workload-from LOG`): a recorded run's executions as plans, worked by hand
from an event log written here with the real writer and codec."""

from __future__ import annotations

from pathlib import Path

import pytest

from gyre.messages.executions import ExecutionStarted
from gyre.messages.model_calls import ModelCallCompleted
from gyre.messages.samples import ExecutionDropped, ExecutionScored
from gyre.runtime.codec import Codec
from gyre.runtime.envelope import Envelope, Kind
from gyre.runtime.event_log import EventLogWriter
from gyre.simulate.recorded import RecordedWorkloadError, workload_from_log


def _call(execution: str, group: str, index: int, prompt: int, output: int, started: float,
          finished: float) -> ModelCallCompleted:
    return ModelCallCompleted(
        execution_id=execution, group_id=group, call_index=index, agent_id="main", call_kind="main",
        prompt_tokens=prompt, extends_call=-1, shared_tokens=0, new_prompt_ids=tuple(range(prompt)), prompt_digest=b"",
        output_ids=tuple(range(output)), output_logprobs=(0.0,) * output, output_versions=(0,) * output,
        finish_reason="stop", cached_tokens=0, cell="sat1", started_s=started, finished_s=finished,
        sampling_temperature=1.0)


def _write(path: Path, records: list[tuple[float, object]]) -> None:
    codec = Codec()
    writer = EventLogWriter(path)
    for index, (t, msg) in enumerate(records):
        envelope = Envelope(msg_id=index + 1, sender="x", receiver="y", topic="", time_s=t, correlation_id=0,
                            causation_id=0, kind=Kind.TELL)
        writer.append(t, *codec.encode(envelope, msg))
    writer.close()


def test_a_recorded_execution_becomes_the_plan_worked_by_hand(tmp_path: Path) -> None:
    log = tmp_path / "run.glog"
    _write(log, [
        (100.0, ExecutionStarted("g1-00", "g1", "/w")),
        (100.5, ExecutionStarted("g1-00", "g1", "/w")),  # delivered twice: the earlier time counts
        # Logged out of order on purpose (calls sort by their start); the second call extends the first by 30
        # observation tokens; the third starts from a compressed context (smaller prompt: observation 0).
        (104.0, _call("g1-00", "g1", 1, 150, 10, 103.5, 104.0)),
        (103.0, _call("g1-00", "g1", 0, 100, 20, 102.0, 103.0)),
        (104.0, _call("g1-00", "g1", 1, 150, 10, 103.5, 104.0)),  # a second delivery of the same call
        (109.0, _call("g1-00", "g1", 2, 60, 5, 106.0, 109.0)),
        (121.0, ExecutionScored("g1-00", "g1", 1.0, False, "")),
        # The group's second execution; a third was dropped (evaluator crash) and one never called the model.
        (101.0, ExecutionStarted("g1-01", "g1", "/w")),
        (110.0, _call("g1-01", "g1", 0, 80, 7, 101.0, 110.0)),
        (111.0, ExecutionScored("g1-01", "g1", 0.0, False, "")),
        (101.0, ExecutionStarted("g1-02", "g1", "/w")),
        (102.0, _call("g1-02", "g1", 0, 80, 7, 101.0, 102.0)),
        (103.0, ExecutionDropped("g1-02", "g1", "scorer crashed", False)),
        (101.0, ExecutionStarted("g1-03", "g1", "/w")),
        (112.0, ExecutionScored("g1-03", "g1", 0.0, True, "")),
        # A later group.
        (200.0, ExecutionStarted("g2-00", "g2", "/w")),
        (201.0, _call("g2-00", "g2", 0, 90, 3, 201.0, 201.5)),
        (203.0, ExecutionScored("g2-00", "g2", 1.0, False, "")),
    ])
    workload = workload_from_log(log)
    assert [[p.execution_id for p in group] for group in workload.groups] == [["g1-00", "g1-01"], ["g2-00"]]
    assert workload.left_out == {"dropped": 1, "no calls": 1}
    plan = workload.groups[0][0]
    assert plan.setup_s == pytest.approx(2.0)  # started 100.0, first call 102.0
    assert plan.prompt_tokens == 100
    assert plan.output_tokens == (20, 10, 5)
    assert plan.observation_tokens == (30, 0, 0)  # 150 - 100 - 20; compressed: 0; the last is never prefilled
    assert plan.tool_s == pytest.approx((0.5, 2.0, 12.0))  # gaps between calls, then end of call -> score
    assert plan.trajectory_tokens == 100 + 35 + 30
    summary = workload.summary()
    assert summary["executions"] == 3 and summary["model_calls"] == 5 and summary["left_out_dropped"] == 1


def test_plans_cycle_a_recorded_group_to_the_asked_size_and_are_the_same_for_every_policy(tmp_path: Path) -> None:
    log = tmp_path / "run.glog"
    records: list[tuple[float, object]] = []
    for group in range(5):
        for index in range(2):
            execution = f"r{group}-{index}"
            records += [(10.0 * group, ExecutionStarted(execution, f"r{group}", "/w")),
                        (10.0 * group + 1, _call(execution, f"r{group}", 0, 50 + group, 4 + index, 10.0 * group,
                                                  10.0 * group + 1)),
                        (10.0 * group + 2, ExecutionScored(execution, f"r{group}", 0.0, False, ""))]
    _write(log, records)
    workload = workload_from_log(log)
    plans = workload.plans("sim-g7", 5, seed=3)
    assert [p.execution_id for p in plans] == [f"sim-g7-{i:02d}" for i in range(5)]
    assert len({p.prompt_tokens for p in plans}) == 1  # one recorded group...
    assert [p.output_tokens for p in plans] == [(4,), (5,), (4,), (5,), (4,)]  # ...its two executions cycled
    assert workload.plans("sim-g7", 5, seed=3) == plans  # the same group id: the same executions
    assert len({workload.plans(f"sim-g{i}", 1)[0].prompt_tokens for i in range(40)}) > 1  # groups spread


def test_a_log_without_replayable_executions_is_a_clear_error(tmp_path: Path) -> None:
    log = tmp_path / "run.glog"
    _write(log, [(1.0, ExecutionStarted("e", "g", "/w"))])
    with pytest.raises(RecordedWorkloadError, match="no scored execution with model calls"):
        workload_from_log(log)
