"""`gyre simulate --workload-from LOG`: the executions of a recorded run, as the emulated agents' workload.

A run's event log (`gyre run ... --log`, or REPORT/events.glog) holds every model call an agent made
(`ModelCallCompleted`: prompt and output token counts, start and end on the run's wall clock), when each execution
started (`ExecutionStarted`) and when it was scored (`ExecutionScored`). Each scored execution becomes one
`ExecutionPlan` (workloads.py), the same shape the published-workload presets draw:

- setup: from the execution's start (`ExecutionStarted`; in a log without it, the executor's `IssueKey` for it,
  the moment it took an execution slot) to its first call;
- per call, in order of start: the output tokens it generated; the tokens the context grew by before the next call
  (the next prompt minus this prompt and output, never below 0) as the observation; the time from this call's end
  to the next one's start as the tool time;
- the last call's tool time: from its end to the agent's exit (`AgentExited`), and the scorer's time from there to
  the score as `scoring_s` (the executor frees the agent's slot at its exit); without an exit record, all of it
  from the last call's end to the score;
- the first call's prompt as the prompt;
- the tokens its samples carried to training (`SamplesLanded`: every trajectory of its tree), when they landed.

A recorded execution is a tree (compressions, sub-agents, retries); the plan flattens its calls into one chain in
order of start, so a compression shows as an observation of 0 and the emulated context only grows: the emulation
is then pessimistic about the context (prefill and KV) of executions that compress. Dropped executions (an
evaluator crash) and executions with no call are left out, and counted.

Groups: the recorded groups, in the order their first execution started. The emulation's group `group_id` takes
recorded group `hash(seed, group_id) mod n`, its executions cycled to the asked group size, so every policy compared
runs exactly the same executions for the same group id (as the presets' seeded draws do). With `by_recorded_id`
(`gyre replay --control-plane`, whose task source names groups as the recorded one did) a recorded group id takes
its own group, and only ids the run never had are hashed. Bound: the reader keeps
four numbers per call and decodes only the four message types it needs; a log of a million calls is ~100 MB of
plans in memory.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import attrs

from gyre.messages.execution_reports import AgentExited
from gyre.messages.executions import ExecutionStarted, IssueKey
from gyre.messages.model_calls import ModelCallCompleted
from gyre.messages.samples import ExecutionDropped, ExecutionScored, SamplesLanded
from gyre.runtime import Codec, read_log
from gyre.runtime.errors import GyreError
from gyre.simulate.workloads import ExecutionPlan

__all__ = ["RecordedWorkload", "RecordedWorkloadError", "workload_from_log"]


class RecordedWorkloadError(GyreError, ValueError):
    """A log that holds no execution the emulation can replay."""


@attrs.frozen
class RecordedWorkload:
    """The scored executions of one recorded run, by group (the interface of workloads.Workload)."""

    name: str
    groups: tuple[tuple[ExecutionPlan, ...], ...]
    """Recorded groups, each its executions' plans (ids as recorded)."""
    left_out: dict[str, int] = attrs.field(factory=dict)
    """Executions not replayed, by reason ("dropped", "no calls", "not scored")."""
    group_ids: tuple[str, ...] = ()
    """The recorded id of each of `groups`."""
    by_recorded_id: bool = False
    """A group id the run recorded takes its own group (module docstring)."""

    def plans(self, group_id: str, group_size: int, seed: int = 0) -> list[ExecutionPlan]:
        if self.by_recorded_id and group_id in self.group_ids:
            recorded = self.groups[self.group_ids.index(group_id)]
        else:
            digest = hashlib.blake2b(f"{seed}:{group_id}".encode(), digest_size=8).digest()
            recorded = self.groups[int.from_bytes(digest, "little") % len(self.groups)]
        return [attrs.evolve(recorded[index % len(recorded)], execution_id=f"{group_id}-{index:02d}")
                for index in range(group_size)]

    def summary(self) -> dict[str, float]:
        plans = [plan for group in self.groups for plan in group]
        turns = sorted(plan.turns for plan in plans)
        return {"groups": len(self.groups), "executions": len(plans), "model_calls": sum(turns),
                "median_turns": turns[len(turns) // 2],
                "mean_trajectory_tokens": sum(p.trajectory_tokens for p in plans) / len(plans),
                **{f"left_out_{reason.replace(' ', '_')}": count for reason, count in sorted(self.left_out.items())}}


@attrs.define
class _Execution:
    group_id: str
    started_s: float | None = None
    scored_s: float | None = None
    dropped: bool = False
    key_issued_s: float | None = None
    exited_s: float | None = None
    trained_tokens: int = 0
    calls: dict[int, tuple[float, float, int, int]] = attrs.field(factory=dict)
    """call_index -> (started_s, finished_s, prompt_tokens, output_tokens, cached_tokens)."""


def _earliest(current: float | None, time_s: float) -> float:
    """The earlier of a kept time and a new one (a virtual-time log starts at 0.0, so None, not 0, means unset)."""
    return time_s if current is None else min(current, time_s)


def workload_from_log(path: str | Path, name: str | None = None) -> RecordedWorkload:
    """The recorded run's executions as a workload; RecordedWorkloadError when none can be replayed."""
    wanted = {ModelCallCompleted.__gyre_type__, ExecutionStarted.__gyre_type__, IssueKey.__gyre_type__,
              AgentExited.__gyre_type__,
              ExecutionScored.__gyre_type__, ExecutionDropped.__gyre_type__, SamplesLanded.__gyre_type__}
    codec = Codec()
    executions: dict[str, _Execution] = {}
    order: list[str] = []  # group ids in the order their first execution started
    landed: set[str] = set()
    for record in read_log(path, codec):
        if record.type_name not in wanted:
            continue
        msg = record.decode(codec)
        if isinstance(msg, SamplesLanded):
            if msg.group_id not in landed:  # first delivery only
                landed.add(msg.group_id)
                for sample in msg.samples:
                    executions.setdefault(sample.execution_id, _Execution(msg.group_id)).trained_tokens += len(
                        sample.token_ids)
            continue
        if isinstance(msg, AgentExited):  # no group id: the execution's own record, when it has one
            if msg.execution_id in executions and executions[msg.execution_id].exited_s is None:
                executions[msg.execution_id].exited_s = record.handled_s
            continue
        execution = executions.get(msg.execution_id)
        if execution is None:
            execution = executions[msg.execution_id] = _Execution(msg.group_id)
        # A message delivered to several actors is logged once per delivery: keep the earliest time.
        if isinstance(msg, ModelCallCompleted):
            execution.calls.setdefault(msg.call_index, (msg.started_s, msg.finished_s, msg.prompt_tokens,
                                                        len(msg.output_ids), msg.cached_tokens))
        elif isinstance(msg, IssueKey):
            if execution.key_issued_s is None and msg.group_id not in order:
                order.append(msg.group_id)
            execution.key_issued_s = _earliest(execution.key_issued_s, record.handled_s)
        elif isinstance(msg, ExecutionStarted):
            if execution.started_s is None and execution.key_issued_s is None:
                if msg.group_id not in order:
                    order.append(msg.group_id)
            execution.started_s = _earliest(execution.started_s, record.handled_s)
        elif isinstance(msg, ExecutionScored):
            execution.scored_s = _earliest(execution.scored_s, record.handled_s)
        else:
            execution.dropped = True
    left_out: dict[str, int] = {}
    by_group: dict[str, list[ExecutionPlan]] = {}
    for execution_id, execution in executions.items():
        reason = ("dropped" if execution.dropped else "no calls" if not execution.calls
                  else "not scored" if execution.scored_s is None else None)
        if reason is not None:
            left_out[reason] = left_out.get(reason, 0) + 1
            continue
        by_group.setdefault(execution.group_id, []).append(plan_of(execution_id, execution))
    ids = [g for g in [*order, *sorted(set(by_group) - set(order))] if g in by_group]
    groups = tuple(tuple(sorted(by_group[g], key=lambda p: p.execution_id)) for g in ids)
    if not groups:
        raise RecordedWorkloadError(f"{path}: no scored execution with model calls to replay "
                                    f"(left out: {left_out or 'nothing recorded'})")
    return RecordedWorkload(name or f"log:{Path(path).name}", groups, left_out, tuple(ids))


def plan_of(execution_id: str, execution: _Execution) -> ExecutionPlan:
    """One recorded execution as a chain of calls (module docstring)."""
    calls = sorted(execution.calls.values())
    first_started = calls[0][0]
    started_s = execution.started_s if execution.started_s is not None else execution.key_issued_s
    setup_s = max(0.0, first_started - started_s) if started_s is not None else 0.0
    outputs, observations, tools = [], [], []
    scoring_s = 0.0
    prefilled = tuple(max(0, prompt_tokens - cached) for _, _, prompt_tokens, _, cached in calls)
    for index, (started_s, finished_s, prompt_tokens, output_tokens, _) in enumerate(calls):
        outputs.append(max(1, output_tokens))
        if index + 1 < len(calls):
            next_started, _, next_prompt, _, _ = calls[index + 1]
            observations.append(max(0, next_prompt - prompt_tokens - output_tokens))
            tools.append(max(0.0, next_started - finished_s))
        else:
            observations.append(0)
            exited_s = execution.exited_s
            if exited_s is not None and finished_s <= exited_s <= execution.scored_s:
                tools.append(exited_s - finished_s)
                scoring_s = execution.scored_s - exited_s
            else:
                tools.append(max(0.0, execution.scored_s - finished_s))
    return ExecutionPlan(execution_id, setup_s, tuple(outputs), tuple(observations), tuple(tools),
                         max(1, calls[0][2]), execution.trained_tokens, prefilled, scoring_s)
