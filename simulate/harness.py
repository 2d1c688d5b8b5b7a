"""One emulated run per policy: the real scheduler (with the policy), micro-step claimer and task source, over
emulated cells and agents, in virtual time (VirtualLauncher); and the comparison of every policy at one budget.

Same GPU budget: every policy gets the same N cells of G GPUs. Same staleness: the claimer's MaxVersionLag(s) and
the task source's bound `groups_ahead_for_staleness(s, groups_per_step)` are the same for all. Same work: the
executions are drawn per group id (workloads.py), so group g000042 is the same in every run.

The lower bound (`lower_bound`) no schedule beats: the larger of (a) all cell-time the work needs at the cells'
best rates (decode at the most concurrent sequences the KV holds at the workload's mean context, prefill at its
compute roofline, training at its utilization), spread over all N cells, and (b) the chain every run must walk:
the shortest execution of the first step, then every step's training on all N cells plus its optimizer step.
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import time
from typing import Any

import attrs

from gyre.actors.executions.task_source import TaskSource, TaskSourceConfig, groups_ahead_for_staleness
from gyre.actors.training.microstep_claimer import ClaimerConfig, MicroStepClaimer
from gyre.actors.training.scheduler import Scheduler, SchedulerConfig
from gyre.messages.cells import ROLLOUT, TRAIN
from gyre.messages.executions import TaskSpec
from gyre.policies.scheduling import AsyncPolicy, ColocatePolicy, ElasticPolicy
from gyre.policies.staleness import MaxVersionLag
from gyre.runtime.errors import GyreError
from gyre.runtime.launch import RunOptions, VirtualLauncher
from gyre.runtime.topology import RestartPolicy, Topology
from gyre.simulate.accounting import account, best_decode_tokens_per_s, packed_hours
from gyre.simulate.agents import EmulatedAgents, EmulatedAgentsConfig
from gyre.simulate.cells import EmulatedCell, EmulatedCellConfig
from gyre.simulate.hardware import HARDWARE, CellModel, ModelProfile
from gyre.simulate.record import RunRecord
from gyre.simulate.workloads import WORKLOADS, Workload

class SimulationError(GyreError, RuntimeError):
    """An emulated run that broke (an actor failed): a bug in the emulation or in the actor it drives."""


SHARED_PLANS_MAX = 100_000
"""Most executions whose plans a comparison draws once for all its runs (`compare`): ~4 KB each, so the preset's
20k take ~80 MB, which forked workers inherit. A larger comparison lets each run draw its own, as a lone run does."""

IDLE_POLL_S = 30.0
"""How long an emulated train cell that waits for a ClaimsOpen lets pass before asking again anyway. Wake-ups are
never lost in virtual time, so this poll only bounds a missed case; at the claimer's 1 s default, idle trainers'
polls were most of a 16-policy comparison's run time (BENCHMARKS.md, gyre simulate, session 23)."""

__all__ = ["SimulationError", "Setup", "PolicyRun", "run_policy", "compare", "lower_bound", "policy_variants"]


@attrs.frozen
class Setup:
    """Everything one comparison holds fixed."""

    workload: Workload = WORKLOADS["terminalbench"]
    hardware: str = "h200"
    cells: int = 8
    gpus_per_cell: int = 8
    model: ModelProfile = ModelProfile()
    groups: int = 64
    """Groups per step."""
    group_size: int = 16
    staleness: int = 1
    steps: int = 20
    seed: int = 0
    tick_s: float = 2.0
    """Emulated cells' tick (engine.py)."""
    microstep_tokens_per_gpu: int = 32768
    """A micro-step's token budget per GPU of a cell (a cell's data-parallel ranks each take ~32k tokens)."""
    admit_up_to_capacity: bool = False
    """The emulated agents' admission bound (agents.py)."""
    rebalance_on_join: bool = False
    """The emulated agents' rebalancing onto a cell that joins rollout (agents.py)."""
    elastic_work_per_switch: float = 8.0
    """The "elastic" run's ElasticPolicy.work_per_switch (its cost-aware rules); "elastic-sessions" runs the
    policy's defaults (capacity and demand in sessions), as the main job does."""
    until_s: float = 30 * 86400.0
    """Virtual-time guard: a run that has not finished by then is reported unfinished."""

    def cell_model(self) -> CellModel:
        return CellModel(HARDWARE[self.hardware], self.gpus_per_cell, self.model)

    @property
    def cell_names(self) -> tuple[str, ...]:
        return tuple(f"cell{index:02d}" for index in range(self.cells))

    def mean_context_tokens(self) -> float:
        """Context a live session holds on average: half the mean trajectory (contexts grow linearly)."""
        plans = self.workload.plans("calibration", 256, self.seed)
        return sum(p.trajectory_tokens for p in plans) / len(plans) / 2


@attrs.frozen
class PolicyRun:
    """One policy's emulated run."""

    name: str
    finished: bool
    hours: float
    seconds_per_step: float
    rollout_share: float
    """Cell-time in the rollout role over all cell-time."""
    busy_cell_hours: float
    idle_cell_hours: float
    switching_cell_hours: float
    switches: int
    executions: int
    model_calls: int
    trained_tokens: int
    wall_s: float
    intervals: tuple[tuple[str, str, float, float], ...] = ()
    time_accounts: dict[str, Any] = attrs.field(factory=dict)
    """Where the cell-hours went and the run's own work packed perfectly (accounting.py)."""

    def summary(self) -> dict[str, Any]:
        return {k: v for k, v in attrs.asdict(self).items() if k != "intervals"}


def policy_variants(setup: Setup) -> list[tuple[str, Any, bool, dict[str, str]]]:
    """(name, policy, streaming, initial roles) for elastic, colocate and async at every split, with and without
    streaming micro-steps."""
    names = setup.cell_names
    elastic_roles = {n: TRAIN if i == 0 else ROLLOUT for i, n in enumerate(names)}
    variants: list[tuple[str, Any, bool, dict[str, str]]] = [
        ("elastic", ElasticPolicy(work_per_switch=setup.elastic_work_per_switch), True, elastic_roles),
        ("elastic-sessions", ElasticPolicy(), True, elastic_roles),
        ("colocate", ColocatePolicy(), True, {n: ROLLOUT for n in names}),
    ]
    for train in range(1, setup.cells):
        roles = {n: TRAIN if i < train else ROLLOUT for i, n in enumerate(names)}
        policy = AsyncPolicy(names[:train])
        variants.append((f"async[{train}t/{setup.cells - train}r]", policy, False, roles))
        variants.append((f"async-streaming[{train}t/{setup.cells - train}r]", policy, True, roles))
    return variants


#: The plans a comparison drew once for all its runs (compare fills it before its runs start, or fork their workers,
#: and empties it after): {"workload": the workload drawn from, "plans": {(group id, group size, seed): plans}}.
_shared_plans: dict[str, Any] = {}


@attrs.frozen
class _SharedPlans:
    """The emulated agents' workload in a comparison: a group's plans come from the comparison's draw when it drew
    them (the same objects: plans are immutable), else from the workload. Every run of a comparison draws the same
    groups, and drawing them (~50 us a plan with numpy) was 3-5% of a run."""

    workload: Any

    def plans(self, group_id: str, group_size: int, seed: int = 0) -> list[Any]:
        drawn = _shared_plans.get("plans", {}).get((group_id, group_size, seed))
        if drawn is None or _shared_plans.get("workload") is not self.workload:
            return self.workload.plans(group_id, group_size, seed)
        return list(drawn)


def _step_groups(setup: Setup, step: int) -> list[str]:
    """The group ids of a step, as the task source numbers them."""
    return [f"g{step * setup.groups + g:06d}" for g in range(setup.groups)]


def _draw_shared_plans(setup: Setup) -> None:
    """Draw every step's groups once for a comparison's runs (module-level, so forked workers inherit them)."""
    _shared_plans.clear()
    if setup.steps * setup.groups * setup.group_size > SHARED_PLANS_MAX:
        return
    _shared_plans["workload"] = setup.workload
    _shared_plans["plans"] = {
        (group_id, setup.group_size, setup.seed): tuple(setup.workload.plans(group_id, setup.group_size, setup.seed))
        for step in range(setup.steps) for group_id in _step_groups(setup, step)
    }


def build_topology(setup: Setup, policy: Any, streaming: bool, roles: dict[str, str], record: RunRecord) -> Topology:
    model = setup.cell_model()
    context = setup.mean_context_tokens()
    topology = Topology("simulate", seed=setup.seed)
    stop = RestartPolicy("stop_topology")
    names = setup.cell_names
    topology.add("scheduler", Scheduler, SchedulerConfig(policy=policy, tick_s=5.0, expected_cells=names),
                 restart=stop)
    per_step = setup.groups * setup.group_size
    topology.add("claimer", MicroStepClaimer, ClaimerConfig(
        groups_per_step=setup.groups, group_size=setup.group_size,
        microstep_token_budget=setup.microstep_tokens_per_gpu * setup.gpus_per_cell,
        staleness=MaxVersionLag(setup.staleness), max_pending_executions=per_step * (setup.staleness + 2),
        cell_silence_limit_s=None, waiting_retry_after_s=IDLE_POLL_S,
    ), restart=stop)
    tasks = tuple(TaskSpec(f"{setup.workload.name}-{i:04d}", "emulated", {}, ("agent",), ("scorer",), 3600.0, 1200.0)
                  for i in range(max(1, setup.groups)))
    ahead = groups_ahead_for_staleness(setup.staleness, setup.groups)
    topology.add("task_source", TaskSource, TaskSourceConfig(
        tasks=tasks, group_size=setup.group_size, groups_in_flight=ahead, executor="agents",
        groups_per_step=setup.groups, max_groups_ahead_of_training=ahead, stop_topology_when_done=False,
        seed=setup.seed,
    ), restart=stop)
    workload = _SharedPlans(setup.workload) if _shared_plans.get("workload") is setup.workload else setup.workload
    topology.add("agents", EmulatedAgents, EmulatedAgentsConfig(workload, setup.seed, record=record,
                                                                admit_up_to_capacity=setup.admit_up_to_capacity,
                                                                rebalance_on_join=setup.rebalance_on_join),
                 restart=stop)
    for index, name in enumerate(names):
        topology.add(name, EmulatedCell, EmulatedCellConfig(
            model=model, initial_role=roles[name], is_core=index == 0, mean_context_tokens=context,
            tick_s=setup.tick_s, core=names[0], stream_microsteps=streaming, last_step_id=setup.steps - 1,
            record=record,
        ), restart=stop)
    return topology


def run_policy(setup: Setup, name: str, policy: Any, streaming: bool, roles: dict[str, str]) -> PolicyRun:
    record = RunRecord()
    started = time.perf_counter()
    result = VirtualLauncher().run(build_topology(setup, policy, streaming, roles, record),
                                   RunOptions(until_s=setup.until_s))
    if result.exit_code != 0:
        raise SimulationError(f"{name}: the emulated run failed: {result.reason}")
    wall_s = time.perf_counter() - started
    last = setup.steps - 1
    finished = last in record.step_times_s
    end_s = record.step_times_s.get(last, max(record.step_times_s.values(), default=setup.until_s))
    intervals = record.role_intervals(end_s)
    total = setup.cells * end_s
    by_role = {ROLLOUT: 0.0, TRAIN: 0.0, "switching": 0.0}
    for _, role, start, end in intervals:
        by_role[role] = by_role.get(role, 0.0) + end - start
    busy = min(total, sum(record.busy_s.values()))
    switches = sum(1 for _, _, role in record.role_changes if role == "switching")
    accounts = account(record.seconds, setup.cells, end_s, by_role["switching"], setup.cell_model(),
                       setup.mean_context_tokens())
    accounts.update(packed_hours(accounts, setup.cells))
    return PolicyRun(
        name=name, finished=finished, hours=end_s / 3600, seconds_per_step=end_s / max(1, len(record.step_times_s)),
        rollout_share=by_role[ROLLOUT] / total if total else 0.0, busy_cell_hours=busy / 3600,
        idle_cell_hours=(total - busy - by_role["switching"]) / 3600, switching_cell_hours=by_role["switching"] / 3600,
        switches=switches, executions=record.executions_finished, model_calls=record.model_calls,
        trained_tokens=record.trained_tokens, wall_s=wall_s, intervals=tuple(intervals), time_accounts=accounts,
    )


def lower_bound(setup: Setup) -> dict[str, float]:
    """Hours no schedule beats (module docstring), with its two terms."""
    model = setup.cell_model()
    context = setup.mean_context_tokens()
    decode_rate = best_decode_tokens_per_s(model, context)
    rollout_s = train_s = 0.0
    step_train_s: list[float] = []
    shortest_first_step = float("inf")
    workload = _SharedPlans(setup.workload)
    for step in range(setup.steps):
        step_tokens = 0
        for group_id in _step_groups(setup, step):
            for plan in workload.plans(group_id, setup.group_size, setup.seed):
                output = sum(plan.output_tokens)
                prefill = plan.prompt_tokens + sum(plan.observation_tokens[:-1])
                rollout_s += output / decode_rate + prefill / model.prefill_tokens_per_s
                step_tokens += plan.trajectory_tokens
                if step == 0:
                    latency = plan.setup_s + sum(plan.tool_s) + output / model.decode_tokens_per_s(
                        1, plan.trajectory_tokens / 2)
                    shortest_first_step = min(shortest_first_step, latency)
        step_train_s.append(model.train_s(step_tokens))
        train_s += step_train_s[-1]
    work_s = (rollout_s + train_s) / setup.cells
    chain_s = shortest_first_step + sum(t / setup.cells + model.optimizer_step_s for t in step_train_s)
    return {"lower_bound_hours": max(work_s, chain_s) / 3600, "work_bound_hours": work_s / 3600,
            "chain_bound_hours": chain_s / 3600, "rollout_cell_hours": rollout_s / 3600,
            "train_cell_hours": train_s / 3600}


def compare(setup: Setup, only: tuple[str, ...] = (), jobs: int = 1) -> dict[str, Any]:
    """Every policy variant (or those whose name starts with one of `only`), the lower bound, and the headline.

    `jobs` > 1 runs the variants in that many forked worker processes: each run is its own topology under its own
    VirtualLauncher, seeded by the setup alone, so its figures do not depend on the process it ran in (the tests
    compare a parallel comparison with a serial one); only wall_s differs."""
    if jobs < 1:
        raise ValueError(f"jobs must be >= 1, got {jobs}")
    started = time.perf_counter()
    chosen = [variant for variant in policy_variants(setup) if not only or variant[0].startswith(only)]
    _draw_shared_plans(setup)
    try:
        bound = lower_bound(setup)
        if jobs == 1 or len(chosen) < 2:
            runs = [run_policy(setup, *variant) for variant in chosen]
        else:
            # fork, not spawn: the workers inherit the caller's log configuration, imports and drawn plans.
            context = multiprocessing.get_context("fork")
            # Longest first, so that no long run starts last on an otherwise idle pool: a run's cost follows its
            # virtual length, longest where rollout is starved (colocate's thrash, the splits with the fewest rollout
            # cells).
            order = sorted(range(len(chosen)), key=lambda i: _expected_cost(chosen[i]), reverse=True)
            with concurrent.futures.ProcessPoolExecutor(min(jobs, len(chosen)), mp_context=context) as pool:
                futures = {i: pool.submit(_run_variant, (setup, chosen[i])) for i in order}
                runs = [futures[i].result() for i in range(len(chosen))]
    finally:
        _shared_plans.clear()
    by_name = {run.name: run for run in runs}
    result: dict[str, Any] = {"setup": _setup_summary(setup), **bound}

    def best(prefix: str) -> PolicyRun | None:
        candidates = [r for r in runs if r.name.startswith(prefix + "[") and r.finished]
        return min(candidates, key=lambda r: r.hours) if candidates else None

    for key, run in (("elastic", by_name.get("elastic")), ("colocate", by_name.get("colocate")),
                     ("async_best", best("async")), ("async_streaming_best", best("async-streaming"))):
        result[f"{key}_hours"] = run.hours if run is not None and run.finished else None
        if key.startswith("async"):
            result[f"{key}_split"] = run.name[run.name.index("[") + 1:-1] if run is not None else None
    elastic, colocate, strongest = result["elastic_hours"], result["colocate_hours"], result["async_streaming_best_hours"]
    result["elastic_vs_colocate"] = colocate / elastic if elastic and colocate else None
    result["elastic_vs_async_streaming_best"] = strongest / elastic if elastic and strongest else None
    result["accounting"] = _accounting_summary(result, by_name.get("elastic"), best("async-streaming"))
    result["policies"] = [run.summary() for run in runs]
    result["wall_s"] = time.perf_counter() - started
    result["_runs"] = runs
    return result


TARGET_VS_ASYNC = 1.15
"""Issue 30's bar for elastic against the strongest async (its best streaming split)."""


def _accounting_summary(result: dict[str, Any], elastic: PolicyRun | None, strongest: PolicyRun | None
                        ) -> dict[str, Any]:
    """How far the bar is from what a perfect packing of the runs' own work reaches (accounting.py)."""
    summary: dict[str, Any] = {"target_vs_async_streaming_best": TARGET_VS_ASYNC}
    if strongest is not None and strongest.finished:
        summary["target_hours"] = strongest.hours / TARGET_VS_ASYNC
    for key, run in (("elastic", elastic), ("async_streaming_best", strongest)):
        if run is not None and run.time_accounts:
            summary[f"{key}_packed_hours"] = run.time_accounts["packed_hours"]
            summary[f"{key}_packed_best_decode_hours"] = run.time_accounts["packed_best_decode_hours"]
    return summary


def _expected_cost(variant: tuple[str, Any, bool, dict[str, str]]) -> tuple[int, int]:
    """Sort key, larger first: colocate, then the fewer cells a run starts with in rollout the longer it runs."""
    name, _, streaming, roles = variant
    return (name == "colocate", -sum(1 for role in roles.values() if role == ROLLOUT), not streaming)


def _run_variant(job: tuple[Setup, tuple[str, Any, bool, dict[str, str]]]) -> PolicyRun:
    setup, variant = job
    return run_policy(setup, *variant)


def _setup_summary(setup: Setup) -> dict[str, Any]:
    model = setup.cell_model()
    return {
        "workload": setup.workload.name, "hardware": setup.hardware, "cells": setup.cells,
        "gpus_per_cell": setup.gpus_per_cell, "active_params": setup.model.active_params,
        "total_params": setup.model.total_params, "groups": setup.groups, "group_size": setup.group_size,
        "staleness": setup.staleness, "steps": setup.steps, "admit_up_to_capacity": setup.admit_up_to_capacity,
        "rebalance_on_join": setup.rebalance_on_join, "kv_capacity_tokens_per_cell": model.kv_capacity_tokens,
        "capacity_sessions_per_cell": model.capacity_sessions(setup.mean_context_tokens()),
        "weight_sync_s": round(model.weight_sync_s, 2), "prefill_tokens_per_s_per_cell": round(model.prefill_tokens_per_s),
        **({"recorded_workload": setup.workload.summary()} if hasattr(setup.workload, "summary") else {}),
    }
