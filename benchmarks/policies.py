"""`gyre bench policies`: the same short training under elastic, async at every split, and colocate.

The comparison only means something if everything but the scheduling policy is held fixed: the same topology file,
seed, cells, staleness bound, group size and number of steps. So the bench does not build a topology of its own; it
runs a training topology file (by default the main job, `examples/agent_rl.py`) once per configuration with
`gyre run`, each in fresh processes, and reads the `run.json` that the run monitor writes.

The topology file must accept these flags (the main job does): `--report DIR`, `--policy elastic|async|colocate`,
`--async-train-cells A,B` (the cells that train under async), `--steps N` and `--skip-eval`; and its run monitor must
record `cells` and `core_cell` in run.json. Any further flags given after `--` go to every run unchanged. With
`--equal-work` it must also accept `--frozen-policy` and write its event log to REPORT/events.glog.

Async runs at every split that keeps the core training and leaves at least one cell rolling out: with a core and
two satellites, 1 train + 2 rollout and 2 train + 1 rollout. The headline figure per configuration is the steady
wall time per optimizer step, (time of the last step - time of the first) / (steps - 1): start-up (processes, model
loads) is the same for all policies and would otherwise drown the difference in a short run. The time to the first
step, which does depend on the policy (colocate's first barrier, for one), is reported beside it.

`--repeats N` runs N rounds, each of every configuration in the same order. A shared machine has slow spells of
minutes; within a round they fall on neighbouring configurations, across rounds on all of them. So each
configuration's figure is its median over the rounds, and elastic's speed-ups are the median of each round's own
ratio (elastic against the round's best async split and its colocate), with every round's ratio reported.

Equal work (`--equal-work`). In an ordinary run what the policy learns changes the rollouts, the task sampler
follows the groups that land, and the asynchronous order decides which groups go stale, so each configuration trains
a different workload and s/step compares unequal work (issue 30: elastic trained 1,123 samples / 296K tokens in 4
steps against 953 / 237K for async[core]). With `--equal-work` every run gets the topology's `--frozen-policy`: the
optimizer step runs at learning rate 0, so the weights never drift, and the tasks come in a fixed seeded order, group
id by group id. Each model call is already sampled with a seed of its execution and call index (the proxy's rid,
actors/serving/routing.py `call_seed`), and the engine draws each token's noise from (seed, position)
(engines/sampling.py), so the same weights give the same tokens whatever the batching, up to the last bits of the
logits; SGLang gets there only with `--enable-deterministic-inference` (docs.sglang.io, "Deterministic Inference").
The staleness bound stays as configured: nothing is stale in content, but the scheduling is the one being compared.
Measured on the embedded engine (`gyre bench policies --steps 2 --equal-work -- --group-size 4 --groups-per-step 2
--train-tasks 20 --min-reward-spread 0`): all four configurations trained the same 16 executions, token for token;
the core's weights after two steps at learning rate 0 equal the warm start's bit for bit.

The bench then reads each run's event log (REPORT/events.glog): which executions every applied step trained
(`ClaimGranted`: the claimer fills a step with `groups_per_step * group_size` executions, so a group can straddle
two steps), a digest of what was trained of each (token ids, loss masks, advantages) and of its model calls and
reward. Per round, the fixed work is the executions that every run trained; a run's time for it, `fixed_work_s`, is
the time of the step that trained the last of them (from the run monitor's start, so start-up and the first step
count). The ends of the runs differ by design (which of the groups in flight land first is the scheduling), and so do
executions the staleness bound refused (a call that straddled a weight update is as old as its oldest token): those
are each run's other work. The check (`compare_work`) reports each run's samples and tokens, whether the runs
trained the same groups and executions, how many of the common executions were trained alike, and how much other
work each had trained by its fixed-work time; `work_equal` holds when every common execution was trained alike in
every run and the tokens the runs had trained by their fixed-work times lie within `work_tolerance` of each other.

On one CPU machine all cells share the cores, so a cell that idles gives its CPU to the others and the policies
look alike. The main job's `--cell-cpu-cores C` (after `--`) caps each cell process at C cores with a cgroup quota,
which gives each cell a device of its own as on a cluster (runtime/cpu_limits.py; BENCHMARKS.md, session 5).

    gyre bench policies --steps 4 --json
    gyre bench policies --steps 8 --json -- --min-reward-spread 0 --cell-cpu-cores 0.4
    gyre bench policies --steps 6 --repeats 3 --json -- --min-reward-spread 0 --cell-cpu-cores 0.4
    gyre bench policies --topology examples/agent_rl.py --out /tmp/policies -- --group-size 8
    gyre bench policies --steps 6 --equal-work --json -- --min-reward-spread 0 --cell-cpu-cores 0.4
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import attrs
import structlog

from gyre.runtime.codec import Codec
from gyre.runtime.errors import GyreError
from gyre.runtime.event_log import read_log

log = structlog.get_logger(__name__)

__all__ = [
    "ExecutionWork",
    "PolicyBenchConfig",
    "PolicyBenchError",
    "PolicyRun",
    "RunSpec",
    "RunWork",
    "async_splits",
    "compare_work",
    "read_run",
    "read_work",
    "run_policy_bench",
    "summarize",
    "register",
]

GYRE_RUN = (sys.executable, "-c", "import sys; from gyre.runtime.cli import main; sys.exit(main())", "run")
"""`gyre run` in the current interpreter (independent of whether the console script is on PATH)."""


class PolicyBenchError(RuntimeError):
    """A configuration's run failed or left no usable run.json."""


@attrs.frozen
class PolicyBenchConfig:
    """What to run and where."""

    topology: str = "examples/agent_rl.py"
    """Training topology file (see the module docstring for the flags it must accept)."""
    steps: int = attrs.field(default=4, validator=attrs.validators.ge(2))
    """Optimizer steps per run; at least 2, since the headline is the time between the first and last step."""
    out_dir: str = ""
    """Folder for each run's report; "" makes a temporary one (removed afterwards)."""
    policies: tuple[str, ...] = attrs.field(default=("elastic", "async", "colocate"), converter=tuple)
    """Which policies to run ("async" expands to every split)."""
    topology_args: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    """Extra flags passed to every run."""
    run_timeout_s: float = 3600.0
    """A run taking longer than this is killed and reported as failed."""
    run_options: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    """Options of `gyre run` itself (e.g. `--virtual` to run a stand-in topology in virtual time)."""
    repeats: int = attrs.field(default=1, validator=attrs.validators.ge(1))
    """Rounds: each runs every configuration once, in the same order, so that a slow spell of a shared machine
    falls on every configuration of a round alike. The headline figures are medians over the rounds."""
    equal_work: bool = False
    """Run every configuration on the same work (module docstring, Equal work): pass `--frozen-policy` to the
    topology, read each run's event log, time the work every run of a round trained and check it was equal."""
    work_tolerance: float = attrs.field(default=0.05, validator=[attrs.validators.ge(0.0), attrs.validators.le(1.0)])
    """Equal work: how far apart (a share of the least) the tokens the runs had trained by their fixed-work times
    may be for their work to count as equal (module docstring)."""

    def __attrs_post_init__(self) -> None:
        unknown = set(self.policies) - {"elastic", "async", "colocate"}
        if unknown or not self.policies:
            raise ValueError(f"policies must be a non-empty subset of elastic, async, colocate; got {self.policies}")


@attrs.frozen
class RunSpec:
    """One configuration: a policy and, for async, the cells that train."""

    policy: str
    train_cells: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return self.policy if not self.train_cells else f"async[{'+'.join(self.train_cells)}]"

    def argv(self) -> tuple[str, ...]:
        extra = ("--async-train-cells", ",".join(self.train_cells)) if self.train_cells else ()
        return ("--policy", self.policy, *extra)


@attrs.frozen
class PolicyRun:
    """What one configuration's run.json says."""

    name: str
    policy: str
    train_cells: tuple[str, ...]
    steps: int
    steady_s_per_step: float
    """(last step time - first step time) / (steps - 1)."""
    first_step_s: float
    """Seconds from the run monitor's start to the first applied step."""
    elapsed_s: float
    samples: int
    tokens: int
    role_switches: int
    """Role changes after every cell's first role."""
    cells: tuple[str, ...]
    core_cell: str
    steady_tokens_per_s: float = 0.0
    """Tokens trained in the steps after the first, over (last step time - first step time)."""
    fixed_work_s: float | None = None
    """Equal work: seconds from the run monitor's start to the step that trained the last execution of the round's
    common work (module docstring); None otherwise."""
    cells_ready_s: float | None = None
    """Seconds from the run monitor's start until every cell had taken its first role (its start-up, which the
    policy does not decide: on a loaded machine it varies from run to run and is inside `fixed_work_s`); None when
    run.json records no role."""


@attrs.frozen
class ExecutionWork:
    """What one run trained of one execution, read off its event log."""

    group_id: str
    """Its GSPO group."""
    step_id: int
    """The applied step that trained it (all of its samples go to one step)."""
    samples: int
    """Its samples trained."""
    tokens: int
    """Their tokens, prompt and generated (as StepApplied counts them)."""
    samples_digest: str
    """Digest of what was trained: each sample's rank, token ids, loss mask and advantages (not its behaviour
    log-probs, whose last bits follow the batch the engine computed them in)."""
    calls_digest: str
    """Digest of its model calls (prompts and outputs, call by call) and of its reward."""


@attrs.frozen(eq=False)
class RunWork:
    """What one configuration's run trained, execution by execution, and when (equal-work mode)."""

    name: str
    """The configuration (RunSpec.name)."""
    step_times_s: dict[int, float]
    """Applied step id -> seconds from the run monitor's start (run.json)."""
    executions: dict[str, ExecutionWork]
    """Execution id -> what the applied steps trained of it."""


def async_splits(cells: Sequence[str], core_cell: str) -> tuple[tuple[str, ...], ...]:
    """Every split of `cells` for async: the core plus the first k satellites train, k = 0 .. satellites - 1.

    Cells are interchangeable apart from the core, so splits differ by how many cells train, not which.
    """
    if core_cell not in cells:
        raise PolicyBenchError(f"the core {core_cell!r} is not among the cells {list(cells)}")
    satellites = [cell for cell in cells if cell != core_cell]
    if not satellites:
        raise PolicyBenchError("async needs at least one satellite to roll out")
    return tuple((core_cell, *satellites[:k]) for k in range(len(satellites)))


def _run_record(report_dir: Path, spec: RunSpec) -> dict[str, Any]:
    path = report_dir / "run.json"
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as error:
        raise PolicyBenchError(f"{spec.name}: no readable run.json in {report_dir}: {error}") from error
    steps = record.get("steps") or []
    if len(steps) < 2:
        raise PolicyBenchError(f"{spec.name}: the run applied {len(steps)} steps; at least 2 are needed")
    return record


def read_run(report_dir: Path, spec: RunSpec) -> PolicyRun:
    """Read a finished run's run.json."""
    record = _run_record(report_dir, spec)
    steps = record["steps"]
    times = [float(step["t_s"]) for step in steps]
    steady_s = times[-1] - times[0]
    first_role_s: dict[str, float] = {}
    for change in record.get("role_changes", []):
        if not change.get("previous"):
            first_role_s.setdefault(change["cell"], float(change["t_s"]))
    switches = sum(1 for change in record.get("role_changes", []) if change.get("previous"))
    return PolicyRun(
        name=spec.name,
        policy=spec.policy,
        train_cells=spec.train_cells,
        steps=len(steps),
        steady_s_per_step=steady_s / (len(times) - 1),
        first_step_s=times[0],
        elapsed_s=float(record.get("elapsed_s", times[-1])),
        samples=sum(int(step.get("samples", 0)) for step in steps),
        tokens=sum(int(step.get("tokens", 0)) for step in steps),
        role_switches=switches if first_role_s else 0,
        cells=tuple(record.get("cells", ())),
        core_cell=str(record.get("core_cell", "")),
        steady_tokens_per_s=sum(int(step.get("tokens", 0)) for step in steps[1:]) / steady_s if steady_s > 0 else 0.0,
        cells_ready_s=max(first_role_s.values()) if first_role_s else None,
    )


WORK_TYPES = frozenset({"gyre.training.ClaimGranted", "gyre.model_calls.ModelCallCompleted",
                        "gyre.samples.ExecutionScored"})
"""The event-log records read_work reads."""


def _digest(parts: Sequence[object]) -> str:
    # repr of ints, bools, strings and floats round-trips exactly: equal digests mean equal values.
    hasher = hashlib.blake2b(digest_size=16)
    for part in parts:
        hasher.update(repr(part).encode())
        hasher.update(b"\0")
    return hasher.hexdigest()


def read_work(report_dir: Path, spec: RunSpec) -> RunWork:
    """What a finished run trained of each execution, from its run.json (step times) and REPORT/events.glog (the
    micro-steps granted, the model calls, the rewards). Micro-steps of steps the run monitor did not record as
    applied (the one under way when the run stopped) are left out; a micro-step granted twice (released by a cell
    that switched away, then granted again) counts once."""
    record = _run_record(report_dir, spec)
    step_times = {int(step["step"]): float(step["t_s"]) for step in record["steps"]}
    log_path = report_dir / "events.glog"
    if not log_path.exists():
        raise PolicyBenchError(f"{spec.name}: no event log {log_path} to read the work from (equal-work mode needs "
                               f"the topology to record it there)")
    codec = Codec()
    seen: set[bytes] = set()
    samples_by_microstep: dict[tuple[int, int], tuple] = {}
    calls: dict[str, dict[int, str]] = {}
    group_of: dict[str, str] = {}
    rewards: dict[str, tuple[float, bool]] = {}
    try:
        for entry in read_log(log_path, codec):
            if entry.type_name not in WORK_TYPES:
                continue
            # One message handled by several actors (every cell hears every call) is logged once by each.
            body_key = hashlib.blake2b(entry.body, digest_size=16).digest()
            if body_key in seen:
                continue
            seen.add(body_key)
            message = entry.decode(codec)
            if entry.type_name == "gyre.training.ClaimGranted":
                if message.step_id in step_times:
                    samples_by_microstep.setdefault((message.step_id, message.microstep_index), message.samples)
            elif entry.type_name == "gyre.model_calls.ModelCallCompleted":
                group_of[message.execution_id] = message.group_id
                calls.setdefault(message.execution_id, {})[message.call_index] = _digest((
                    message.extends_call, message.shared_tokens, message.new_prompt_ids, message.output_ids,
                    message.finish_reason))
            else:
                rewards[message.execution_id] = (message.reward, message.timed_out)
    except GyreError as error:
        raise PolicyBenchError(f"{spec.name}: cannot read {log_path}: {error}") from error
    trained: dict[str, list] = {}
    step_of: dict[str, int] = {}
    for (step_id, _), samples in sorted(samples_by_microstep.items()):
        for sample in samples:
            trained.setdefault(sample.execution_id, []).append(sample)
            step_of[sample.execution_id] = step_id
    executions = {}
    for execution, samples in trained.items():
        samples.sort(key=lambda sample: sample.trajectory_rank)
        executions[execution] = ExecutionWork(
            group_id=samples[0].group_id, step_id=step_of[execution], samples=len(samples),
            tokens=sum(len(sample.token_ids) for sample in samples),
            samples_digest=_digest([(sample.trajectory_rank, sample.token_ids, sample.loss_mask, sample.advantages)
                                    for sample in samples]),
            calls_digest=_digest([*sorted(calls.get(execution, {}).items()), rewards.get(execution)]),
        )
    return RunWork(spec.name, step_times, executions)


def compare_work(works: Sequence[RunWork], tolerance: float = 0.05) -> dict[str, Any]:
    """How equal the work of one round's runs was, and each run's time for the work they share.

    The fixed work is the executions every run trained. `runs[name]` gives each run's totals (groups, executions,
    samples, tokens trained in its applied steps), its `fixed_work_s` (the time of the step that trained the last
    common execution), the samples and tokens of the common executions as it trained them, `tokens_by_fixed_work`
    (all it had trained by then) and `extra_share` (the share of those that were other executions'). Of the common
    executions, `executions_identical` were trained alike in every run (same samples: token ids, loss masks,
    advantages) and `calls_identical` made the same model calls and got the same reward. `work_equal` holds when
    every common execution was trained alike and the runs' `tokens_by_fixed_work` lie within `tolerance` of the
    least; `why_unequal` says what failed."""
    if not works:
        raise ValueError("compare_work needs at least one run")
    common = sorted(set.intersection(*(set(work.executions) for work in works)))
    differing = [e for e in common if len({work.executions[e].samples_digest for work in works}) > 1]
    calls_identical = sum(len({work.executions[e].calls_digest for work in works}) == 1 for e in common)
    runs: dict[str, dict[str, Any]] = {}
    for work in works:
        done = work.executions.values()
        row: dict[str, Any] = {"groups": len({e.group_id for e in done}), "executions": len(work.executions),
                               "samples": sum(e.samples for e in done), "tokens": sum(e.tokens for e in done)}
        if common:
            fixed_step = max(work.executions[e].step_id for e in common)
            by_then = sum(e.tokens for e in done if e.step_id <= fixed_step)
            fixed_tokens = sum(work.executions[e].tokens for e in common)
            row.update(fixed_work_s=work.step_times_s[fixed_step], fixed_work_step=fixed_step,
                       fixed_work_samples=sum(work.executions[e].samples for e in common),
                       fixed_work_tokens=fixed_tokens, tokens_by_fixed_work=by_then,
                       extra_share=(by_then - fixed_tokens) / by_then if by_then else 0.0)
        runs[work.name] = row
    why: list[str] = []
    if not common:
        why.append("no execution was trained by every run")
    else:
        if differing:
            why.append(f"{len(differing)} of the {len(common)} executions every run trained were trained "
                       f"differently (first: {differing[0]}; {calls_identical} of the {len(common)} made the same "
                       f"calls and got the same reward)")
        by_then = {name: row["tokens_by_fixed_work"] for name, row in runs.items()}
        least, most = min(by_then.values()), max(by_then.values())
        if most > least * (1.0 + tolerance):
            why.append(f"by their fixed-work times the runs had trained {least} to {most} tokens "
                       f"({most / least - 1.0:.0%} apart, more than {tolerance:.0%}): "
                       + ", ".join(f"{name} {tokens}" for name, tokens in by_then.items()))
    groups = [{e.group_id for e in work.executions.values()} for work in works]
    return {
        "work_equal": not why, "why_unequal": why, "common_executions": len(common),
        "executions_identical": len(common) - len(differing), "calls_identical": calls_identical,
        "same_executions": all(set(work.executions) == set(works[0].executions) for work in works),
        "same_groups": all(g == groups[0] for g in groups), "runs": runs,
    }


MEASURES = {"s_per_step": "steady_s_per_step", "fixed_work_s": "fixed_work_s"}
"""Figure name in the result -> the PolicyRun field it is taken from; the lower, the faster."""


def _round_summary(runs: Sequence[PolicyRun], label: str = "s_per_step") -> dict[str, Any]:
    """One round's figures for one measure (MEASURES): each policy's (async at the round's best split) and elastic's
    speed-ups. `s_per_step` keeps the names the bench always had; other measures' names carry theirs."""
    field = MEASURES[label]
    best: dict[str, PolicyRun] = {}
    for run in runs:
        value = getattr(run, field)
        if value is not None and (run.policy not in best or value < getattr(best[run.policy], field)):
            best[run.policy] = run
    result: dict[str, Any] = {f"{policy}_{label}": getattr(run, field) for policy, run in best.items()}
    prefix = "" if label == "s_per_step" else f"{label.removesuffix('_s')}_"
    if "async" in best:
        result[f"async_{prefix}best_split"] = list(best["async"].train_cells)
    elastic = result.get(f"elastic_{label}")
    for other in ("async", "colocate"):
        if elastic and f"{other}_{label}" in result:
            result[f"elastic_{prefix}speedup_vs_{other}"] = result[f"{other}_{label}"] / elastic
    return result


def _summarize_measure(runs: Sequence[PolicyRun], rounds: Sequence[Sequence[PolicyRun]], label: str) -> dict[str, Any]:
    field = MEASURES[label]
    prefix = "" if label == "s_per_step" else f"{label.removesuffix('_s')}_"
    by_name: dict[str, list[PolicyRun]] = {}
    for run in runs:
        if getattr(run, field) is not None:
            by_name.setdefault(run.name, []).append(run)
    median_by_name = {name: statistics.median([getattr(r, field) for r in group]) for name, group in by_name.items()}
    result: dict[str, Any] = {}
    by_policy: dict[str, list[str]] = {}
    for name, group in by_name.items():
        by_policy.setdefault(group[0].policy, []).append(name)
    best_by_policy = {policy: min(names, key=median_by_name.__getitem__) for policy, names in by_policy.items()}
    for policy, best in best_by_policy.items():
        result[f"{policy}_{label}"] = median_by_name[best]
        if label == "s_per_step":
            result[f"{policy}_first_step_s"] = statistics.median([r.first_step_s for r in by_name[best]])
    if "async" in by_policy:
        result[f"async_{prefix}best_split"] = list(by_name[best_by_policy["async"]][0].train_cells)
        result[f"async_splits_{label}"] = {name: median_by_name[name] for name in by_policy["async"]}
    per_round = [_round_summary(r, label) for r in rounds]
    for other in ("async", "colocate"):
        key = f"elastic_{prefix}speedup_vs_{other}"
        ratios = [r[key] for r in per_round if key in r]
        if ratios:
            result[key] = statistics.median(ratios)
            result[f"{key}_by_round"] = ratios
    result[f"{label}_by_round"] = {name: [getattr(r, field) for r in group] for name, group in by_name.items()}
    return result


def summarize(runs: Sequence[PolicyRun], rounds: Sequence[Sequence[PolicyRun]] = (),
              work_checks: Sequence[dict[str, Any]] = ()) -> dict[str, Any]:
    """The bench's result: per configuration its median seconds per step over the rounds; per policy the best
    configuration's median (async: its best split); elastic's speed-ups as the median of each round's own ratio.

    `rounds` groups `runs` by round (each round runs every configuration once); empty means one round of `runs`.
    With equal work, `work_checks` holds each round's `compare_work` and the runs carry `fixed_work_s`: the same
    figures are given for the time of the fixed work (`{policy}_fixed_work_s`, `elastic_fixed_work_speedup_vs_*`),
    with `work_equal` (every round's work was equal) and the checks as `equal_work_by_round`.
    """
    rounds = [list(r) for r in rounds] if rounds else [list(runs)]
    result: dict[str, Any] = {"rounds": len(rounds), **_summarize_measure(runs, rounds, "s_per_step")}
    if work_checks:
        result.update(_summarize_measure(runs, rounds, "fixed_work_s"))
        result["work_equal"] = all(check["work_equal"] for check in work_checks)
        result["equal_work_by_round"] = list(work_checks)
    result["runs"] = [attrs.asdict(run) for run in runs]
    return result


def _run_one(config: PolicyBenchConfig, spec: RunSpec, report_dir: Path, cwd: Path) -> PolicyRun:
    # Everything after the bare "--" is the topology's own (gyre run would otherwise take an option it also has,
    # such as --seed, for itself).
    argv = [
        *GYRE_RUN, *config.run_options, config.topology, "--", "--report", str(report_dir), "--steps", str(config.steps),
        "--skip-eval", *spec.argv(), *(("--frozen-policy",) if config.equal_work else ()), *config.topology_args,
    ]
    log.info("policy_run_started", run=spec.name, argv=argv[4:])
    started = time.perf_counter()
    try:
        completed = subprocess.run(argv, cwd=cwd, timeout=config.run_timeout_s, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT)
    except subprocess.TimeoutExpired as error:
        raise PolicyBenchError(f"{spec.name}: no result within {config.run_timeout_s} s") from error
    if completed.returncode != 0:
        tail = completed.stdout.decode(errors="replace")[-3000:]
        raise PolicyBenchError(f"{spec.name}: gyre run exited {completed.returncode}; its output ends:\n{tail}")
    run = read_run(report_dir, spec)
    log.info("policy_run_done", run=spec.name, steady_s_per_step=round(run.steady_s_per_step, 2),
             wall_s=round(time.perf_counter() - started, 1))
    return run


def run_policy_bench(
    config: PolicyBenchConfig,
    *,
    cwd: Path | None = None,
    run_one: Callable[[PolicyBenchConfig, RunSpec, Path, Path], PolicyRun] = _run_one,
    work_reader: Callable[[Path, RunSpec], RunWork] = read_work,
) -> dict[str, Any]:
    """Run every configuration in turn, `config.repeats` rounds of them (elastic first: its run.json names the cells
    for the async splits). With more than one round, round r's reports go under `out/round{r}/`. With
    `config.equal_work`, `work_reader` reads each run's work and each round's is compared (`compare_work`)."""
    cwd = cwd if cwd is not None else Path.cwd()
    with tempfile.TemporaryDirectory(prefix="gyre-policies-") as scratch:
        out = Path(config.out_dir) if config.out_dir else Path(scratch)
        rounds: list[list[PolicyRun]] = []
        checks: list[dict[str, Any]] = []
        cells: tuple[str, ...] = ()
        core = ""
        ordered = sorted(config.policies, key=("elastic", "colocate", "async").index)
        for round_index in range(config.repeats):
            folder = out / f"round{round_index}" if config.repeats > 1 else out
            runs: list[PolicyRun] = []
            works: list[RunWork] = []
            for policy in ordered:
                if policy != "async":
                    specs = [RunSpec(policy)]
                else:
                    if not cells:  # async alone: a colocate-free, elastic-free bench still needs the cell names
                        probe = run_one(config, RunSpec("colocate"), folder / "probe", cwd)
                        cells, core = probe.cells, probe.core_cell
                    specs = [RunSpec("async", split) for split in async_splits(cells, core)]
                for spec in specs:
                    report = folder / spec.name.replace("[", "-").replace("]", "")
                    run = run_one(config, spec, report, cwd)
                    runs.append(run)
                    if config.equal_work:
                        works.append(work_reader(report, spec))
                    cells, core = cells or run.cells, core or run.core_cell
            if config.equal_work:
                check = compare_work(works, config.work_tolerance)
                checks.append(check)
                runs = [attrs.evolve(run, fixed_work_s=check["runs"][run.name].get("fixed_work_s")) for run in runs]
                log.info("policy_round_work", round=round_index, work_equal=check["work_equal"],
                         common_executions=check["common_executions"], why_unequal=check["why_unequal"])
            rounds.append(runs)
            figures = {**_round_summary(runs), **(_round_summary(runs, "fixed_work_s") if config.equal_work else {})}
            log.info("policy_round_done", round=round_index, **{
                k: round(v, 3) for k, v in figures.items() if isinstance(v, float)})
        return summarize([run for r in rounds for run in r], rounds, checks)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "policies", help="wall time per step under elastic, async (every split) and colocate, same seed and cells"
    )
    defaults = PolicyBenchConfig()
    parser.add_argument("--topology", default=defaults.topology, help="training topology file")
    parser.add_argument("--steps", type=int, default=defaults.steps, help="optimizer steps per run")
    parser.add_argument("--policies", default="elastic,async,colocate", help="comma-separated subset")
    parser.add_argument("--out", default="", help="keep each run's report folder here")
    parser.add_argument("--repeats", type=int, default=defaults.repeats,
                        help="rounds of every configuration (medians over them; the machine's slow spells fall on "
                        "every configuration of a round alike)")
    parser.add_argument("--equal-work", action="store_true",
                        help="every run on the same work: the topology's --frozen-policy (learning rate 0, a fixed "
                        "task order), then the time each took for the groups all of a round trained, and a check "
                        "that the work was equal (samples, tokens, the same groups trained alike)")
    parser.add_argument("--work-tolerance", type=float, default=defaults.work_tolerance,
                        help="with --equal-work: how far apart (a share of the least) the tokens the runs had trained "
                        "by their fixed-work times may be for the work to count as equal")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.set_defaults(func=_command, accepts_extra_args=True)


def _command(args: argparse.Namespace) -> int:
    from gyre.runtime.logs import configure_logging

    configure_logging()  # progress lines to stderr: stdout carries only the result (JSON with --json)
    try:
        config = PolicyBenchConfig(
            topology=args.topology, steps=args.steps, out_dir=args.out,
            policies=tuple(p for p in args.policies.split(",") if p), topology_args=tuple(args.passthrough),
            repeats=args.repeats, equal_work=args.equal_work, work_tolerance=args.work_tolerance,
        )
    except ValueError as error:
        print(f"gyre bench policies: {error}", file=sys.stderr)
        return 2
    if not Path(config.topology).is_file():
        print(f"gyre bench policies: no topology file {config.topology!r} (run from the repository root, or pass "
              "--topology)", file=sys.stderr)
        return 2
    try:
        result = run_policy_bench(config)
    except PolicyBenchError as error:
        print(f"gyre bench policies: {error}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    for run in result["runs"]:
        fixed = ""
        if run["fixed_work_s"] is not None:
            ready = run["cells_ready_s"]
            fixed = f"  fixed work at {run['fixed_work_s']:6.1f} s" + (
                f" (cells ready at {ready:5.1f} s)" if ready is not None else "")
        print(f"{run['name']:<24} {run['steady_s_per_step']:7.1f} s/step  first step at {run['first_step_s']:6.1f} s"
              f"  samples {run['samples']:5d}  tokens {run['tokens']:7d}  {run['steady_tokens_per_s']:7.1f} tokens/s"
              f"  switches {run['role_switches']}{fixed}")
    for measure, what in (("", "per step"), ("fixed_work_", "on the fixed work")):
        for other in ("async", "colocate"):
            key = f"elastic_{measure}speedup_vs_{other}"
            if key in result:
                rounds = ", ".join(f"{ratio:.2f}x" for ratio in result[f"{key}_by_round"])
                print(f"elastic vs {other}{' (best split)' if other == 'async' else ''} {what}: {result[key]:.2f}x"
                      + (f" (median of the rounds: {rounds})" if result["rounds"] > 1 else ""))
    for index, check in enumerate(result.get("equal_work_by_round", ())):
        verdict = "equal" if check["work_equal"] else "NOT equal: " + "; ".join(check["why_unequal"])
        print(f"round {index} work {verdict} ({check['common_executions']} executions trained by every run, "
              f"{check['executions_identical']} of them alike; same executions: {check['same_executions']}, same "
              f"groups: {check['same_groups']})")
    return 0
