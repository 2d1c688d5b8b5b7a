"""`gyre bench policies`: the same short training under elastic, async at every split, and colocate.

The comparison only means something if everything but the scheduling policy is held fixed: the same topology file,
seed, cells, staleness bound, group size and number of steps. So the bench does not build a topology of its own; it
runs a training topology file (by default the main job, `examples/agent_rl.py`) once per configuration with
`gyre run`, each in fresh processes, and reads the `run.json` that the run monitor writes.

The topology file must accept these flags (the main job does): `--report DIR`, `--policy elastic|async|colocate`,
`--async-train-cells A,B` (the cells that train under async), `--steps N` and `--skip-eval`; and its run monitor must
record `cells` and `core_cell` in run.json. Any further flags given after `--` go to every run unchanged.

Async runs at every split that keeps the core training and leaves at least one cell rolling out: with a core and
two satellites, 1 train + 2 rollout and 2 train + 1 rollout. The headline figure per configuration is the steady
wall time per optimizer step, (time of the last step - time of the first) / (steps - 1): start-up (processes, model
loads) is the same for all policies and would otherwise drown the difference in a short run. The time to the first
step, which does depend on the policy (colocate's first barrier, for one), is reported beside it.

`--repeats N` runs N rounds, each of every configuration in the same order. A shared machine has slow spells of
minutes; within a round they fall on neighbouring configurations, across rounds on all of them. So each
configuration's figure is its median over the rounds, and elastic's speed-ups are the median of each round's own
ratio (elastic against the round's best async split and its colocate), with every round's ratio reported.

On one CPU machine all cells share the cores, so a cell that idles gives its CPU to the others and the policies
look alike. The main job's `--cell-cpu-cores C` (after `--`) caps each cell process at C cores with a cgroup quota,
which gives each cell a device of its own as on a cluster (runtime/cpu_limits.py; BENCHMARKS.md, session 5).

    gyre bench policies --steps 4 --json
    gyre bench policies --steps 8 --json -- --min-reward-spread 0 --cell-cpu-cores 0.4
    gyre bench policies --steps 6 --repeats 3 --json -- --min-reward-spread 0 --cell-cpu-cores 0.4
    gyre bench policies --topology examples/agent_rl.py --out /tmp/policies -- --group-size 8
"""

from __future__ import annotations

import argparse
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

log = structlog.get_logger(__name__)

__all__ = [
    "PolicyBenchConfig",
    "PolicyBenchError",
    "PolicyRun",
    "RunSpec",
    "async_splits",
    "read_run",
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


def read_run(report_dir: Path, spec: RunSpec) -> PolicyRun:
    """Read a finished run's run.json."""
    path = report_dir / "run.json"
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as error:
        raise PolicyBenchError(f"{spec.name}: no readable run.json in {report_dir}: {error}") from error
    steps = record.get("steps") or []
    if len(steps) < 2:
        raise PolicyBenchError(f"{spec.name}: the run applied {len(steps)} steps; at least 2 are needed")
    times = [float(step["t_s"]) for step in steps]
    first_roles = {change["cell"] for change in record.get("role_changes", []) if not change.get("previous")}
    switches = sum(1 for change in record.get("role_changes", []) if change.get("previous"))
    return PolicyRun(
        name=spec.name,
        policy=spec.policy,
        train_cells=spec.train_cells,
        steps=len(steps),
        steady_s_per_step=(times[-1] - times[0]) / (len(times) - 1),
        first_step_s=times[0],
        elapsed_s=float(record.get("elapsed_s", times[-1])),
        samples=sum(int(step.get("samples", 0)) for step in steps),
        tokens=sum(int(step.get("tokens", 0)) for step in steps),
        role_switches=switches if first_roles else 0,
        cells=tuple(record.get("cells", ())),
        core_cell=str(record.get("core_cell", "")),
    )


def _round_summary(runs: Sequence[PolicyRun]) -> dict[str, Any]:
    """One round's figures: each policy's seconds per step (async at the round's best split) and the speed-ups."""
    best: dict[str, PolicyRun] = {}
    for run in runs:
        if run.policy not in best or run.steady_s_per_step < best[run.policy].steady_s_per_step:
            best[run.policy] = run
    result: dict[str, Any] = {f"{policy}_s_per_step": run.steady_s_per_step for policy, run in best.items()}
    if "async" in best:
        result["async_best_split"] = list(best["async"].train_cells)
    elastic = result.get("elastic_s_per_step")
    for other in ("async", "colocate"):
        if elastic and f"{other}_s_per_step" in result:
            result[f"elastic_speedup_vs_{other}"] = result[f"{other}_s_per_step"] / elastic
    return result


def summarize(runs: Sequence[PolicyRun], rounds: Sequence[Sequence[PolicyRun]] = ()) -> dict[str, Any]:
    """The bench's result: per configuration its median seconds per step over the rounds; per policy the best
    configuration's median (async: its best split); elastic's speed-ups as the median of each round's own ratio.

    `rounds` groups `runs` by round (each round runs every configuration once); empty means one round of `runs`.
    """
    rounds = [list(r) for r in rounds] if rounds else [list(runs)]
    by_name: dict[str, list[PolicyRun]] = {}
    for run in runs:
        by_name.setdefault(run.name, []).append(run)
    median_by_name = {name: statistics.median([r.steady_s_per_step for r in group]) for name, group in by_name.items()}
    result: dict[str, Any] = {"rounds": len(rounds)}
    by_policy: dict[str, list[str]] = {}
    for name, group in by_name.items():
        by_policy.setdefault(group[0].policy, []).append(name)
    best_by_policy = {policy: min(names, key=median_by_name.__getitem__) for policy, names in by_policy.items()}
    for policy, best in best_by_policy.items():
        result[f"{policy}_s_per_step"] = median_by_name[best]
        result[f"{policy}_first_step_s"] = statistics.median([r.first_step_s for r in by_name[best]])
    if "async" in by_policy:
        result["async_best_split"] = list(by_name[best_by_policy["async"]][0].train_cells)
        result["async_splits_s_per_step"] = {name: median_by_name[name] for name in by_policy["async"]}
    per_round = [_round_summary(r) for r in rounds]
    for other in ("async", "colocate"):
        key = f"elastic_speedup_vs_{other}"
        ratios = [r[key] for r in per_round if key in r]
        if ratios:
            result[key] = statistics.median(ratios)
            result[f"{key}_by_round"] = ratios
    result["s_per_step_by_round"] = {name: [r.steady_s_per_step for r in group] for name, group in by_name.items()}
    result["runs"] = [attrs.asdict(run) for run in runs]
    return result


def _run_one(config: PolicyBenchConfig, spec: RunSpec, report_dir: Path, cwd: Path) -> PolicyRun:
    argv = [
        *GYRE_RUN, *config.run_options, config.topology, "--report", str(report_dir), "--steps", str(config.steps), "--skip-eval",
        *spec.argv(), *config.topology_args,
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
) -> dict[str, Any]:
    """Run every configuration in turn, `config.repeats` rounds of them (elastic first: its run.json names the cells
    for the async splits). With more than one round, round r's reports go under `out/round{r}/`."""
    cwd = cwd if cwd is not None else Path.cwd()
    with tempfile.TemporaryDirectory(prefix="gyre-policies-") as scratch:
        out = Path(config.out_dir) if config.out_dir else Path(scratch)
        rounds: list[list[PolicyRun]] = []
        cells: tuple[str, ...] = ()
        core = ""
        ordered = sorted(config.policies, key=("elastic", "colocate", "async").index)
        for round_index in range(config.repeats):
            folder = out / f"round{round_index}" if config.repeats > 1 else out
            runs: list[PolicyRun] = []
            for policy in ordered:
                if policy != "async":
                    specs = [RunSpec(policy)]
                else:
                    if not cells:  # async alone: a colocate-free, elastic-free bench still needs the cell names
                        probe = run_one(config, RunSpec("colocate"), folder / "probe", cwd)
                        cells, core = probe.cells, probe.core_cell
                    specs = [RunSpec("async", split) for split in async_splits(cells, core)]
                for spec in specs:
                    run = run_one(config, spec, folder / spec.name.replace("[", "-").replace("]", ""), cwd)
                    runs.append(run)
                    cells, core = cells or run.cells, core or run.core_cell
            rounds.append(runs)
            log.info("policy_round_done", round=round_index, **{
                k: round(v, 3) for k, v in _round_summary(runs).items() if isinstance(v, float)})
        return summarize([run for r in rounds for run in r], rounds)


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
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.set_defaults(func=_command, accepts_extra_args=True)


def _command(args: argparse.Namespace) -> int:
    from gyre.runtime.logs import configure_logging

    configure_logging()  # progress lines to stderr: stdout carries only the result (JSON with --json)
    try:
        config = PolicyBenchConfig(
            topology=args.topology, steps=args.steps, out_dir=args.out,
            policies=tuple(p for p in args.policies.split(",") if p), topology_args=tuple(args.passthrough),
            repeats=args.repeats,
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
        print(f"{run['name']:<24} {run['steady_s_per_step']:7.1f} s/step  first step at {run['first_step_s']:6.1f} s"
              f"  samples {run['samples']:5d}  switches {run['role_switches']}")
    for other in ("async", "colocate"):
        key = f"elastic_speedup_vs_{other}"
        if key in result:
            rounds = ", ".join(f"{ratio:.2f}x" for ratio in result[f"{key}_by_round"])
            print(f"elastic vs {other}{' (best split)' if other == 'async' else ''}: {result[key]:.2f}x"
                  + (f" (median of the rounds: {rounds})" if result["rounds"] > 1 else ""))
    return 0
