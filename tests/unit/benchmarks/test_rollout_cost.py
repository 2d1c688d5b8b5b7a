"""benchmarks/studies/rollout_cost.py: where a run's rollout tokens went, read off an event log written here."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import msgpack
import pytest

from gyre.messages.executions import ExecutionFinished, GroupDone, TaskSpec
from gyre.messages.model_calls import ModelCallCompleted
from gyre.policies.trajectory_tree import whole_prompt_call
from gyre.messages.samples import ExecutionScored
from gyre.runtime.codec import Codec
from gyre.runtime.envelope import Envelope, Kind
from gyre.runtime.event_log import EventLogWriter



def _load():
    return importlib.import_module("gyre.benchmarks.studies.rollout_cost")


def _call(execution: str, group: str, index: int, prompt: int, cached: int, output: int) -> ModelCallCompleted:
    return whole_prompt_call(
        execution_id=execution, group_id=group, call_index=index, agent_id="main", call_kind="turn",
        prompt_ids=(1,) * prompt, output_ids=(2,) * output, output_logprobs=(0.0,) * output,
        output_versions=(0,) * output, finish_reason="stop", cached_tokens=cached, cell="sat1", started_s=0.0,
        finished_s=0.0, sampling_temperature=1.0)


def _finished(execution: str, group: str, task_id: str) -> ExecutionFinished:
    task = TaskSpec(task_id=task_id, prompt="p", workspace_files={}, agent_argv=("a",), scorer_argv=("s",),
                    timeout_s=1.0, scorer_timeout_s=1.0)
    return ExecutionFinished(execution_id=execution, group_id=group, task=task, workspace="/w", exit_code=0,
                             timed_out=False, wall_s=1.0)


def _as_version_1(header: bytes, body: bytes) -> tuple[bytes, bytes]:
    """A GroupDone record as logs before session 17 hold it: schema version 1, no work_tokens field."""
    fields = msgpack.unpackb(header, use_list=False, raw=False)
    body_fields = msgpack.unpackb(body, use_list=False, raw=False)
    return (msgpack.packb((*fields[:-1], 1), use_bin_type=True),
            msgpack.packb(body_fields[:-1], use_bin_type=True))


def _write(path: Path, messages: list[tuple[str, object]], *, group_done_version: int = 2) -> None:
    codec = Codec()
    writer = EventLogWriter(path)
    for index, (receiver, message) in enumerate(messages):
        envelope = Envelope(msg_id=index + 1, sender="x", receiver=receiver, topic="", time_s=float(index),
                            correlation_id=0, causation_id=0, kind=Kind.TELL)
        header, body = codec.encode(envelope, message)
        if isinstance(message, GroupDone) and group_done_version == 1:
            header, body = _as_version_1(header, body)
        writer.append(float(index), header, body)
    writer.close()


@pytest.fixture(params=[2, 1], ids=["GroupDone-v2", "GroupDone-v1"])
def log(tmp_path: Path, request) -> Path:
    # Group "ga" (calc) lands: a success with 2 calls (10 + 5 tokens of work, 4 of the first call's prompt cached)
    # and a failure with 3 calls. Group "gb" (helper) is dropped: one failure with 2 calls. Group "gc" is still
    # running (no GroupDone): it counts nowhere. Each message is recorded twice, as two receivers would.
    messages = [
        _call("a.0", "ga", 0, prompt=8, cached=4, output=6),   # 10
        _call("a.0", "ga", 1, prompt=3, cached=0, output=2),   # 5
        _call("a.1", "ga", 0, prompt=5, cached=0, output=5),   # 10
        _call("a.1", "ga", 1, prompt=5, cached=0, output=5),   # 10
        _call("a.1", "ga", 2, prompt=5, cached=0, output=5),   # 10
        _call("b.0", "gb", 0, prompt=20, cached=0, output=20),  # 40
        _call("b.0", "gb", 1, prompt=10, cached=0, output=5),  # 15
        _call("c.0", "gc", 0, prompt=100, cached=0, output=100),
        _finished("a.0", "ga", "calc-1"), _finished("a.1", "ga", "calc-1"), _finished("b.0", "gb", "helper-2"),
        _finished("c.0", "gc", "write-3"),
        ExecutionScored(execution_id="a.0", group_id="ga", reward=1.0, timed_out=False, detail=""),
        ExecutionScored(execution_id="a.1", group_id="ga", reward=0.2, timed_out=False, detail=""),
        ExecutionScored(execution_id="b.0", group_id="gb", reward=0.0, timed_out=False, detail=""),
        ExecutionScored(execution_id="c.0", group_id="gc", reward=0.0, timed_out=False, detail=""),
        GroupDone(group_id="ga", landed=True, mean_reward=0.6, success_rate=0.5, num_scored=2, num_dropped=0,
                  work_tokens=45),
        GroupDone(group_id="gb", landed=False, mean_reward=0.0, success_rate=0.0, num_scored=1, num_dropped=0,
                  work_tokens=55),
    ]
    path = tmp_path / "events.glog"
    _write(path, [(receiver, m) for m in messages for receiver in ("builder", "monitor")],
           group_done_version=request.param)
    return path


def test_tokens_by_kind_fate_and_outcome(log: Path) -> None:
    result = _load().rollout_cost(log)
    assert (result["executions"], result["tokens"], result["groups"], result["groups_landed"]) == (3, 100, 2, 1)
    assert result["dropped_group_token_share"] == 0.55
    assert result["by_kind"] == {
        "calc": {"groups": 1, "landed": 1, "tokens": 45, "token_share": 0.45, "landed_per_mtoken": 22222.22},
        "helper": {"groups": 1, "landed": 0, "tokens": 55, "token_share": 0.55, "landed_per_mtoken": 0.0},
    }
    assert result["by_outcome"]["success"] == {"executions": 1, "calls_per_execution": 2.0,
                                               "tokens_per_execution": 15.0, "token_share": 0.15}
    assert result["by_outcome"]["failure"]["executions"] == 2
    assert result["by_outcome"]["failure"]["calls_per_execution"] == 2.5


def test_call_budget_counts_calls_past_the_cap(log: Path) -> None:
    module = _load()
    module.CALL_BUDGETS = (1, 2, 3)
    budgets = module.rollout_cost(log)["call_budget"]
    # Past the first call: a.0's 5, a.1's 20, b.0's 15 of 100 tokens; the success made 2 calls.
    assert budgets["1"] == {"token_share_cut": 0.4, "successes_lost": 1}
    assert budgets["2"] == {"token_share_cut": 0.1, "successes_lost": 0}
    assert budgets["3"] == {"token_share_cut": 0.0, "successes_lost": 0}


def test_the_command_prints_json_and_refuses_a_missing_log(log: Path, tmp_path: Path, capsys) -> None:
    module = _load()
    assert module.main([str(log.parent), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["tokens"] == 100
    assert module.main([str(tmp_path / "nowhere")]) == 2
    assert "no event log" in capsys.readouterr().err
