"""Counterfactual re-runs (`gyre replay LOG --control-plane --policy elastic|async|colocate [--split K]`): a
recorded run's control plane re-run in virtual time with a policy swapped in, on the run's own executions, over
emulated cells calibrated from the same log.

What comes from the log (`read_recorded_run`, one pass, and recorded.py's for the executions):
- the control plane itself: the scheduler's, micro-step claimer's and task source's configs as the run started them
  (`ActorStarted`), so the same real actors run with the same settings (groups per step, group size, staleness,
  micro-step budget, groups in flight, task sampling, group ids); only the scheduler's policy is swapped;
- the executor's bound on agents at once (its config's `max_concurrent`), kept by the emulated agents;
- the cells: their names, which is the core, the role each first announced and when (`RoleChanged` after the
  topology's first `ActorStarted`: the boot the emulated cell waits before it announces);
- the executions (recorded.py, each recorded group id running its own executions) and the cells' cost model
  (calibrated.py: decode, prefill, per-call latency, training per token, optimizer step, switches, weight sync);
- the recorded figures: each step's `StepApplied` time after the start, so the report sets the re-run beside them.

What stays emulated (cells.py, agents.py): the time things take, from the calibrated model. What is decided (who
trains, which micro-step, which step a sample joins, when a step is fixed, which group starts next) is the real
actors' business, as in `gyre simulate`. How the calibration is applied: an execution holds its agent slot until
the agent exits and its scoring runs outside the slot (as the executor does); each call starts after the fitted
per-call latency plus its own prefill (its recorded prefilled tokens at the fitted rate; `CallOverhead`), and the
emulated engine's iterations are the fitted decode's, shared by the calls on the cell. Differences the emulation
has from the run it re-plays: a call's decode time depends only on how many calls share its cell (not context nor
what else runs on the machine at that moment), the trajectory builder's work takes no time, and a cell role
switch direction the run never made takes the cells' boot time into that role (calibrated.py). Every emulated cell
streams micro-steps (claims before a step is fixed), as the real cells do.

Checked (tests/integration/simulate/test_control_plane_replay.py, BENCHMARKS.md): recorded main-job runs under
elastic, async and colocate re-run under their own policy within 3% of their time and 15% of every step's.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import attrs
import msgpack

from gyre.actors.executions.task_source import TaskSource
from gyre.actors.training.microstep_claimer import MicroStepClaimer
from gyre.actors.training.scheduler import Scheduler
from gyre.messages.cells import ROLLOUT, TRAIN, LoadReport, RoleChanged
from gyre.messages.executions import IssueKey
from gyre.messages.model_calls import ModelCallCompleted
from gyre.messages.runtime_control import ActorStarted
from gyre.messages.training import (
    ClaimGranted,
    MicroStepDone,
    StepApplied,
    StepReady,
    WeightsLoaded,
    WeightsPublished,
)
from gyre.policies.scheduling import AsyncPolicy, ColocatePolicy, ElasticPolicy
from gyre.runtime import Codec, read_log
from gyre.runtime.config_codec import CodeTrust, decode_config
from gyre.runtime.errors import CodecError, GyreError
from gyre.runtime.launch import RunOptions, VirtualLauncher
from gyre.runtime.topology import RestartPolicy, Topology
from gyre.simulate.agents import EmulatedAgents, EmulatedAgentsConfig
from gyre.simulate.calibrated import CalibratedCellModel, CallRecord, MicroStepRecord, fit_cell_model
from gyre.simulate.cells import EmulatedCell, EmulatedCellConfig
from gyre.simulate.record import RunRecord
from gyre.simulate.recorded import RecordedWorkload, workload_from_log
from gyre.simulate.workloads import ExecutionPlan

__all__ = ["CounterfactualError", "RecordedRun", "read_recorded_run", "policy_for", "replay_control_plane",
           "CallOverhead"]

_SCHEDULER = "gyre.actors.training.scheduler:Scheduler"
_CLAIMER = "gyre.actors.training.microstep_claimer:MicroStepClaimer"
_TASK_SOURCE = "gyre.actors.executions.task_source:TaskSource"
_EXECUTOR = "gyre.actors.executions.executor:Executor"
POLICIES = ("elastic", "async", "colocate")


class CounterfactualError(GyreError, ValueError):
    """A log that cannot drive a control-plane re-run (what it lacks is said)."""


@attrs.frozen
class RecordedRun:
    """What a recorded run's log says about its control plane, its cells and its figures."""

    path: str
    names: dict[str, str]
    """Actor names: scheduler, claimer, task_source, executor."""
    scheduler: Any
    claimer: Any
    task_source: Any
    max_concurrent: int
    """The executor's bound on agents at once (0: none)."""
    cells: tuple[str, ...]
    core: str
    initial_roles: dict[str, str]
    boot_s: dict[str, float]
    """Seconds from the topology's start to each cell's first RoleChanged."""
    step_times_s: tuple[float, ...]
    """Each applied step's StepApplied, seconds after the topology's start."""
    first_group_s: float
    """The first execution's start (its IssueKey), seconds after the topology's start."""
    switches: int
    """Role switches the run made (RoleChanged after a first role)."""
    model: CalibratedCellModel
    workload: RecordedWorkload
    cells_woken: bool = True
    """The run's claimer woke waiting train cells (ClaimsOpen; its recorded config names `waiting_retry_after_s`):
    a run recorded before wake-ups had its cells poll, and its re-run's cells poll likewise."""

    @property
    def steps(self) -> int:
        return len(self.step_times_s)

    @property
    def policy_name(self) -> str:
        return _policy_name(self.scheduler.policy)

    def figures(self) -> dict[str, Any]:
        end = self.step_times_s[-1]
        return {"policy": self.policy_name, "steps": self.steps, "run_s": end, "switches": self.switches,
                "seconds_per_step": end / self.steps,
                "seconds_per_step_after_first": _after_first(list(self.step_times_s)),
                "step_times_s": list(self.step_times_s), "step_durations_s": _durations(self.step_times_s)}


def _policy_name(policy: Any) -> str:
    if isinstance(policy, AsyncPolicy):
        return f"async[{','.join(policy.train_cells)}]"
    if isinstance(policy, ColocatePolicy):
        return "colocate"
    if isinstance(policy, ElasticPolicy):
        return "elastic"
    return type(policy).__name__


def _after_first(times: list[float]) -> float | None:
    """Seconds per step from the first step's end on: the steady state, without the cells' start-up."""
    return (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None


def _durations(times: tuple[float, ...] | list[float]) -> list[float]:
    return [b - a for a, b in zip([0.0, *times[:-1]], times)]


def read_recorded_run(path: str | Path, trust: CodeTrust | None = None) -> RecordedRun:
    """The recorded run (module docstring); CounterfactualError when the log lacks what a re-run needs."""
    codec = Codec()
    types = {t.__gyre_type__: t for t in (ActorStarted, RoleChanged, ModelCallCompleted, ClaimGranted,
                                          MicroStepDone, StepReady, StepApplied, WeightsLoaded, WeightsPublished,
                                          LoadReport, IssueKey)}
    origin: float | None = None
    configs: dict[str, tuple[str, Any]] = {}
    start_blobs: dict[str, bytes] = {}  # every actor's recorded config, for the cells' engine settings
    seen: set[tuple[str, int]] = set()
    first_role: dict[str, tuple[float, str, bool]] = {}
    switches: dict[tuple[str, str], list[float]] = {}
    calls: dict[tuple[str, int], CallRecord] = {}
    grants: dict[tuple[str, int, int], float] = {}
    done: dict[tuple[str, int, int], tuple[float, int]] = {}
    ready: dict[int, float] = {}
    applied: dict[int, float] = {}
    loads: list[float] = []
    weight_bytes = capacity = 0
    first_key: float | None = None
    cells_woken = True
    try:
        records = read_log(path, codec)
        for record in records:
            cls = types.get(record.type_name)
            if cls is None:
                continue
            envelope = record.envelope
            if cls is ClaimGranted:  # a reply: one delivery, to the asking cell
                msg = record.decode(codec)
                if msg.step_id >= 0:
                    grants.setdefault((envelope.receiver, msg.step_id, msg.microstep_index), record.handled_s)
                continue
            key = (envelope.sender, envelope.msg_id)
            if key in seen:  # one message delivered to several actors is logged once per delivery
                continue
            seen.add(key)
            msg = record.decode(codec)
            t = record.handled_s
            if cls is ActorStarted:
                if msg.incarnation != 0:
                    continue
                origin = t if origin is None else min(origin, t)
                start_blobs.setdefault(msg.actor, msg.config_blob)
                if msg.class_path == _CLAIMER:
                    cells_woken = _names_field(msg.config_blob, "waiting_retry_after_s")
                if msg.class_path in (_SCHEDULER, _CLAIMER, _TASK_SOURCE, _EXECUTOR):
                    try:
                        configs[msg.class_path] = (msg.actor, decode_config(msg.config_blob, trust))
                    except CodecError as error:
                        raise CounterfactualError(f"the config of {msg.actor} cannot be read: {error}") from error
            elif cls is RoleChanged:
                if msg.cell not in first_role:
                    first_role[msg.cell] = (t, msg.role, msg.is_core)
                switches.setdefault((msg.previous_role, msg.role), []).append(msg.switch_s)
            elif cls is ModelCallCompleted:
                calls.setdefault((msg.execution_id, msg.call_index), CallRecord(
                    msg.cell, msg.started_s, msg.finished_s, len(msg.output_ids),
                    max(0, msg.prompt_tokens - msg.cached_tokens)))
            elif cls is MicroStepDone:
                done.setdefault((msg.cell, msg.step_id, msg.microstep_index), (t, msg.num_tokens))
            elif cls is StepReady:
                ready.setdefault(msg.step_id, t)
            elif cls is StepApplied:
                if not msg.skipped:
                    applied.setdefault(msg.step_id, t)
            elif cls is WeightsLoaded:
                if msg.version > 0:
                    loads.append(msg.seconds)
            elif cls is WeightsPublished:
                weight_bytes = max(weight_bytes, msg.nbytes)
            elif cls is LoadReport:
                if msg.role == ROLLOUT:
                    capacity = max(capacity, msg.capacity_requests)
            elif cls is IssueKey:
                first_key = t if first_key is None else min(first_key, t)
    except (OSError, GyreError) as error:
        if isinstance(error, CounterfactualError):
            raise
        raise CounterfactualError(f"{path}: cannot read the log: {error}") from error
    missing = [name for name, cls_path in (("scheduler", _SCHEDULER), ("micro-step claimer", _CLAIMER),
                                           ("task source", _TASK_SOURCE)) if cls_path not in configs]
    if missing or origin is None:
        raise CounterfactualError(f"{path}: no start record of the {', '.join(missing) or 'topology'}: not a "
                                  "main-job log (gyre run examples/agent_rl.py --report DIR writes DIR/events.glog)")
    if not applied:
        raise CounterfactualError(f"{path}: the run applied no optimizer step: no step time to re-run")
    if not first_role:
        raise CounterfactualError(f"{path}: no cell announced a role (RoleChanged)")
    steps = sorted(applied)
    if steps != list(range(steps[0], steps[0] + len(steps))):
        raise CounterfactualError(f"{path}: the applied steps are not consecutive ({steps}): a resumed run?")
    microsteps = [MicroStepRecord(cell, tokens, t_done - grants[(cell, step, index)])
                  for (cell, step, index), (t_done, tokens) in done.items() if (cell, step, index) in grants]
    optimizer = []
    for step, t_applied in applied.items():
        lasts = [t for (_, s, _), (t, _) in done.items() if s == step]
        if lasts and step in ready:
            optimizer.append(max(0.0, t_applied - max(max(lasts), ready[step])))
    cells = tuple(sorted(first_role, key=lambda c: first_role[c][0]))
    cores = [c for c in cells if first_role[c][2]]
    if len(cores) != 1:
        raise CounterfactualError(f"{path}: {len(cores)} cells announced themselves as the core")
    engine = _engine_config(start_blobs, trust, cells)
    kv_tokens = engine.block_size_tokens * engine.num_blocks if engine is not None else 1 << 20
    running = engine.max_running_requests if engine is not None else 1024
    try:
        model = fit_cell_model(list(calls.values()), microsteps, optimizer, switches, loads, weight_bytes, capacity,
                               kv_tokens, running)
        workload = attrs.evolve(workload_from_log(path), by_recorded_id=True)
    except ValueError as error:
        raise CounterfactualError(f"{path}: {error}") from error
    scheduler_name, scheduler = configs[_SCHEDULER]
    claimer_name, claimer = configs[_CLAIMER]
    source_name, source = configs[_TASK_SOURCE]
    executor_name, executor = configs.get(_EXECUTOR, (source.executor, None))
    return RecordedRun(
        path=str(path), names={"scheduler": scheduler_name, "claimer": claimer_name, "task_source": source_name,
                               "executor": source.executor},
        scheduler=scheduler, claimer=claimer, task_source=source,
        max_concurrent=getattr(executor, "max_concurrent", 0) if executor is not None else 0,
        cells=cells, core=cores[0], initial_roles={c: first_role[c][1] for c in cells},
        boot_s={c: first_role[c][0] - origin for c in cells},
        step_times_s=tuple(applied[s] - origin for s in steps),
        first_group_s=(first_key - origin) if first_key is not None else 0.0,
        switches=sum(len(v) for (previous, _), v in switches.items() if previous), model=model, workload=workload,
        cells_woken=cells_woken,
    )


def _names_field(config_blob: bytes, field: str) -> bool:
    """Whether a recorded config (runtime/config_codec.py's msgpack map) has `field` among its own fields."""
    try:
        value = msgpack.unpackb(config_blob, raw=False)
    except Exception:  # decode_config reports a bad blob; here it only means "not known"
        return False
    return isinstance(value, dict) and isinstance(value.get("fields"), dict) and field in value["fields"]


def _engine_config(start_blobs: dict[str, bytes], trust: CodeTrust | None, cells: tuple[str, ...]) -> Any:
    """A rollout cell's EngineConfig from its start record (KV blocks, running-request bound), or None."""
    for cell in cells:
        if cell not in start_blobs:
            continue
        try:
            engine = getattr(decode_config(start_blobs[cell], trust), "engine", None)
        except CodecError:
            return None
        if engine is not None and hasattr(engine, "num_blocks"):
            return engine
    return None


@attrs.frozen
class CallOverhead:
    """A workload whose every call starts later by the calibrated latency the fit found outside the shared decode:
    `seconds` plus `prefill_s_per_token` x the tokens the call prefilled (as recorded; for a plan without them,
    the prompt for the first call and the previous observation after), added to the setup before the first call and
    to the tool time before each later one. The
    fit prices a call's prefill into that call's own time only (calibrated.py), so the replay does too; the
    emulated engine then prefills at no cost and its iterations are the fitted decode's."""

    workload: Any
    seconds: float
    prefill_s_per_token: float = 0.0

    @property
    def name(self) -> str:
        return self.workload.name

    def plans(self, group_id: str, group_size: int, seed: int = 0) -> list[ExecutionPlan]:
        out = []
        per_token = self.prefill_s_per_token
        for plan in self.workload.plans(group_id, group_size, seed):
            prefilled = plan.prefilled_tokens or (plan.prompt_tokens, *plan.observation_tokens[:-1])
            tools = tuple(t + self.seconds + per_token * prefilled[i + 1] if i < plan.turns - 1 else t
                          for i, t in enumerate(plan.tool_s))
            setup = plan.setup_s + self.seconds + per_token * prefilled[0]
            out.append(attrs.evolve(plan, setup_s=setup, tool_s=tools))
        return out


def policy_for(run: RecordedRun, name: str | None, split: str = "") -> tuple[str, Any]:
    """The policy to swap in: None, the recorded policy itself; else the recorded policy object when it is of the
    kind asked (its own settings), or a default one; async trains the `split` cells (a count, core first in the
    cells' order, or names), by default the recorded split or the core alone."""
    recorded = run.scheduler.policy
    if split and name != "async":
        raise CounterfactualError("--split goes with --policy async")
    if name is None:
        policy = recorded
    elif name == "elastic":
        policy = recorded if isinstance(recorded, ElasticPolicy) else ElasticPolicy()
    elif name == "colocate":
        policy = recorded if isinstance(recorded, ColocatePolicy) else ColocatePolicy()
    elif name == "async":
        order = (run.core, *[c for c in run.cells if c != run.core])
        if split:
            if split.isdigit():
                count = int(split)
                if not 1 <= count < len(order) + 1:
                    raise CounterfactualError(f"--split {split}: between 1 and {len(order)} train cells")
                train = order[:count]
            else:
                train = tuple(s for s in split.split(",") if s)
                unknown = sorted(set(train) - set(order))
                if unknown:
                    raise CounterfactualError(f"--split: no cell named {', '.join(unknown)} (cells: {', '.join(order)})")
                if run.core not in train:
                    raise CounterfactualError(f"--split: the core {run.core} must train (it applies the step)")
            policy = AsyncPolicy(train)
        else:
            policy = recorded if isinstance(recorded, AsyncPolicy) else AsyncPolicy((run.core,))
    else:
        raise CounterfactualError(f"no policy {name!r} (choose from {', '.join(POLICIES)})")
    return _policy_name(policy), policy


def build_topology(run: RecordedRun, policy: Any, record: RunRecord, tick_s: float = 0.05,
                   seed: int | None = None) -> Topology:
    names = run.names
    topology = Topology("replay-control-plane", seed=run.task_source.seed if seed is None else seed)
    stop = RestartPolicy("stop_topology")
    topology.add(names["scheduler"], Scheduler, attrs.evolve(run.scheduler, policy=policy), restart=stop)
    topology.add(names["claimer"], MicroStepClaimer, attrs.evolve(
        run.claimer, cell_silence_limit_s=None, journal_path="", resume_from=""), restart=stop)
    topology.add(names["task_source"], TaskSource, attrs.evolve(
        run.task_source, stop_topology_when_done=False, resume_from=""), restart=stop)
    topology.add(names["executor"], EmulatedAgents, EmulatedAgentsConfig(
        CallOverhead(run.workload, run.model.call_overhead_s, run.model.prefill_s_per_token), claimer=names["claimer"],
        task_source=names["task_source"], record=record, max_concurrent=run.max_concurrent), restart=stop)
    mean_context = statistics.mean(p.trajectory_tokens for g in run.workload.groups for p in g) / 2
    engine_model = attrs.evolve(run.model, prefill_s_per_token=0.0)  # prefill is in each call's latency
    for cell in run.cells:
        topology.add(cell, EmulatedCell, EmulatedCellConfig(
            model=engine_model, initial_role=run.initial_roles[cell], is_core=cell == run.core,
            mean_context_tokens=mean_context, tick_s=tick_s, claimer=names["claimer"], core=run.core,
            agents=names["executor"], stream_microsteps=True, last_step_id=run.task_source.first_step_id + run.steps - 1,
            record=record, boot_s=run.boot_s[cell], wake_on_claims_open=run.cells_woken,
        ), restart=stop)
    return topology


def default_tick_s(run: RecordedRun) -> float:
    """The emulated cells' tick: 1/200 of the recorded seconds per step after the first (the resolution of a
    session's end), within 0.01-2 s, so a long run's re-run stays a few thousand ticks a step."""
    times = list(run.step_times_s)
    per_step = _after_first(times) or times[-1]
    return min(2.0, max(0.01, per_step / 200))


def replay_control_plane(run: RecordedRun, policy_name: str | None, split: str = "", tick_s: float | None = None,
                         until_s: float | None = None) -> dict[str, Any]:
    """Re-run `run`'s control plane with the policy asked; the re-run's figures beside the recorded ones."""
    label, policy = policy_for(run, policy_name, split)
    tick_s = tick_s if tick_s is not None else default_tick_s(run)
    record = RunRecord()
    started = time.perf_counter()
    horizon = until_s if until_s is not None else max(3600.0, 20 * run.step_times_s[-1])
    result = VirtualLauncher().run(build_topology(run, policy, record, tick_s), RunOptions(until_s=horizon))
    if result.exit_code != 0:
        raise CounterfactualError(f"the re-run under {label} failed: {result.reason}")
    first = run.task_source.first_step_id
    times = [record.step_times_s[s] for s in range(first, first + run.steps) if s in record.step_times_s]
    finished = len(times) == run.steps
    end = times[-1] if times else horizon
    recorded = run.figures()
    out: dict[str, Any] = {
        "policy": label, "finished": finished, "run_s": end, "seconds_per_step": end / max(1, len(times)),
        "seconds_per_step_after_first": _after_first(times),
        "step_times_s": times, "step_durations_s": _durations(times),
        "switches": sum(1 for _, _, role in record.role_changes if role == "switching")
        - sum(1 for cell in run.cells if run.boot_s[cell] > 0),
        "executions": record.executions_finished, "trained_tokens": record.trained_tokens,
        "wall_s": time.perf_counter() - started, "recorded": recorded,
    }
    out["vs_recorded"] = end / recorded["run_s"] if finished else None
    out["_record"] = record
    return out


def calibration_summary(run: RecordedRun) -> dict[str, Any]:
    """The fitted cell model and the run's settings, for the report."""
    model = run.model
    fields = {f.name: getattr(model, f.name) for f in attrs.fields(CalibratedCellModel) if f.name != "fit"}
    claimer = run.claimer
    return {
        "cells": list(run.cells), "core": run.core, "initial_roles": run.initial_roles,
        "boot_s": {c: round(s, 3) for c, s in run.boot_s.items()},
        "groups_per_step": claimer.groups_per_step, "group_size": claimer.group_size,
        "staleness": repr(claimer.staleness), "microstep_token_budget": claimer.microstep_token_budget,
        "groups_in_flight": run.task_source.groups_in_flight, "agents_at_once": run.max_concurrent,
        "first_execution_s": round(run.first_group_s, 3), "tick_s": default_tick_s(run),
        "steps": run.steps, "model": fields, "fit_from": model.fit, "workload": run.workload.summary(),
    }
