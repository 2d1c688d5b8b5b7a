"""What simulate/recorded.py reads for the control-plane replay, worked by hand: an execution's start from the
executor's IssueKey when the log has no ExecutionStarted, the agent's exit splitting the last tool time from the
scorer's, each call's prefilled tokens, the tokens its samples trained, and groups taken by their recorded id."""

from __future__ import annotations

from pathlib import Path

import attrs
import pytest

from gyre.messages.execution_reports import AgentExited
from gyre.messages.executions import IssueKey
from gyre.messages.model_calls import ModelCallCompleted
from gyre.messages.samples import ExecutionScored, SamplesLanded, TrainingSample
from gyre.runtime.codec import Codec
from gyre.runtime.envelope import Envelope, Kind
from gyre.runtime.event_log import EventLogWriter
from gyre.simulate.recorded import workload_from_log


def _call(execution: str, index: int, prompt: int, cached: int, output: int, started: float, finished: float):
    return ModelCallCompleted(
        execution_id=execution, group_id="g7", call_index=index, agent_id="main", call_kind="turn",
        prompt_tokens=prompt, extends_call=-1, shared_tokens=0, new_prompt_ids=(), prompt_digest=b"",
        output_ids=(0,) * output, output_logprobs=(), output_versions=(), finish_reason="stop", cached_tokens=cached,
        cell="sat1", started_s=started, finished_s=finished, sampling_temperature=1.0)


def _sample(execution: str, tokens: int) -> TrainingSample:
    return TrainingSample(execution_id=execution, group_id="g7", trajectory_rank=0, trajectory_kind="main",
                          leaf_call_index=0, token_ids=(0,) * tokens, loss_mask=(), behaviour_logprobs=(),
                          sampling_temperatures=(), advantages=(), weights=(), min_weight_version=0,
                          max_weight_version=0, num_loss_tokens=1)


def _write(path: Path, records: list[tuple[float, object]]) -> None:
    codec, writer = Codec(), EventLogWriter(path)
    for index, (t, msg) in enumerate(records):
        envelope = Envelope(msg_id=index + 1, sender="x", receiver="y", topic="", time_s=t, correlation_id=0,
                            causation_id=0, kind=Kind.TELL)
        writer.append(t, *codec.encode(envelope, msg))
    writer.close()


def test_start_exit_scoring_prefill_and_trained_tokens_by_hand(tmp_path: Path) -> None:
    log = tmp_path / "run.glog"
    samples = (_sample("g7.0", 300), _sample("g7.0", 120))  # a sub-agent's trajectory too: 420 trained tokens
    _write(log, [
        (10.0, IssueKey("g7.0", "g7")),                      # the slot taken: the start
        (11.0, _call("g7.0", 0, 152, 144, 40, 10.5, 11.0)),  # 8 tokens prefilled (the rest was cached)
        (12.0, _call("g7.0", 1, 200, 192, 9, 11.25, 12.0)),  # 200 - 152 - 40 = 8 observation tokens
        (12.5, AgentExited("g7.0", 0, False, 2.5)),
        (14.0, ExecutionScored("g7.0", "g7", 1.0, False, "")),
        (14.1, SamplesLanded("g7", samples, ("g7.0",), (1.0,), (0.0,), 0, 420, 49, 0, 0)),
        (14.2, SamplesLanded("g7", samples[:1], ("g7.0",), (1.0,), (0.0,), 0, 300, 40, 0, 0)),  # a second delivery
    ])
    workload = workload_from_log(log)
    plan = workload.groups[0][0]
    assert plan.setup_s == pytest.approx(0.5)                # IssueKey 10.0 -> first call 10.5
    assert plan.prefilled_tokens == (8, 8)
    assert plan.observation_tokens == (8, 0)
    assert plan.tool_s == pytest.approx((0.25, 0.5))         # the last: call end 12.0 -> agent exit 12.5
    assert plan.scoring_s == pytest.approx(1.5)              # exit 12.5 -> score 14.0
    assert plan.trained_tokens == 420 and plan.trajectory_tokens == 152 + 49 + 8
    assert workload.group_ids == ("g7",)


def test_groups_by_recorded_id_only_when_asked(tmp_path: Path) -> None:
    log = tmp_path / "run.glog"
    records: list[tuple[float, object]] = []
    for group in range(6):
        execution = f"g{group}.0"
        records += [(10.0 * group, IssueKey(execution, f"g{group}")),
                    (10.0 * group + 1, attrs.evolve(_call(execution, 0, 50 + group, 0, 4, 10.0 * group,
                                                          10.0 * group + 1), group_id=f"g{group}")),
                    (10.0 * group + 2, ExecutionScored(execution, f"g{group}", 0.0, False, ""))]
    _write(log, records)
    workload = attrs.evolve(workload_from_log(log), by_recorded_id=True)
    assert [workload.plans(f"g{g}", 2)[0].prompt_tokens for g in range(6)] == [50, 51, 52, 53, 54, 55]
    assert [p.execution_id for p in workload.plans("g3", 2)] == ["g3-00", "g3-01"]
    assert workload.plans("g99", 1)[0].prompt_tokens in range(50, 56)  # never recorded: hashed as before
    hashed = attrs.evolve(workload, by_recorded_id=False)
    assert [hashed.plans(f"g{g}", 1)[0].prompt_tokens for g in range(6)] != [50, 51, 52, 53, 54, 55]
