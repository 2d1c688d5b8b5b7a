"""The main job: an agent that learns, end to end on one CPU machine.

    gyre run examples/agent_rl.py --report report                   # elastic cells (the default)
    gyre run examples/agent_rl.py --report report --policy async    # the baselines, same cells and staleness
    gyre run examples/agent_rl.py --report report --policy colocate
    gyre run examples/agent_rl.py --report report --cell-cpu-cores 0.4  # each cell capped: a device of its own
    gyre run examples/agent_rl.py --report report --frozen-policy --skip-eval  # lr 0, fixed task order: equal work
    gyre run examples/agent_rl.py --report report --checkpoint-every 2  # full checkpoints every 2 steps
    gyre run examples/agent_rl.py --report report --resume              # after a crash: continue from the newest
    gyre run examples/agent_rl.py --report report --restart-processes sat1,sat2  # a dead satellite restarts in place
    gyre run examples/agent_rl.py --report report --tasks examples/tasks   # Harbor tasks, mini-swe-agent, sandboxed

What happens:
1. prepare (once, in the launcher): the warm start. By default the one that ships in examples/warm_start (a
   1.3M-parameter HF directory whose files are checked against its manifest's digests, with its held-out scores
   cached beside it, so RL starts at once; its README says what built it). `--warm-start DIR` takes any other HF
   model directory (its manifest checked when it has one: engines/model_manifest.py); `--warm-start rebuild` builds
   one here: a tiny Qwen3-layout model is initialised; a short synthetic pretraining teaches
   it to copy spans and look values up, first adjacent, then past a line of unrelated items, into quoted strings
   and with calculator expressions among the items, each stage ending in a learning-rate decay
   (engines/pretrain.py: what a real base model brings and a random one lacks);
   the scripted expert's demonstrations warm-start it with one epoch of SFT on 900 tasks (a model that sometimes
   succeeds and whose failures RL can still fix; see --sft-tasks); each stage is cached under ~/.cache/gyre, keyed by
   its inputs (the base model's bytes among them: copy pretraining is not bit-reproducible across CPUs, so a
   rebuild on another machine gives another warm start, and the RL gain depends on it: BENCHMARKS.md, session 10,
   which is why one ships). The warm-started model is scored on held-out tasks (cached: the shipped one's scores
   come with it), sampled at the rollout temperature (the headline: the mean of two attempts a task) and greedy.
2. the topology: one core cell and two satellites (each its own process; the core holds weights and optimizer),
   the proxy, the KV migrator, the weight broker, the micro-step claimer, the scheduler with the chosen policy, the
   executor, the evaluator, the trajectory builder, the task source and the run monitor. GSPO with groups of 16
   runs until `--steps` optimizer steps are applied; the core saves the final weights (and, when asked, a
   checkpoint every `--checkpoint-every` steps and the weights' moving average, `--weight-average-decay`). With
   `--checkpoint-every N` the run also keeps full checkpoints in REPORT/run_checkpoints (the core's weights and
   optimizer moments, the claimer's ledger, the task source's position, the run monitor's history: the checkpointer,
   actors/training/checkpointer.py), from which `gyre run ... --report REPORT --resume` continues the run. The
   task source runs the task kinds whose groups still teach (rewards that differ) more often, weighed by what
   their groups cost the engines in tokens (policies/task_sampling.py, SignalPerToken).
3. finish: the final model is scored on the same held-out tasks the same two ways and the report is written:
   summary.json (`success_rate_before/after` are the sampled score, `greedy_success_rate_*` the greedy one: see
   headline_scores), the reward curve, each cell's role over time.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import attrs

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "toolbox"))
sys.path.insert(0, str(HERE))

from gyre.actors.cells.cell import Cell, CellConfig  # noqa: E402
from gyre.actors.cells.engine_process import EngineServerConfig  # noqa: E402
from gyre.actors.executions.evaluator import Evaluator, EvaluatorConfig  # noqa: E402
from gyre.actors.executions.executor import Executor, ExecutorConfig  # noqa: E402
from gyre.actors.executions.sandbox import SandboxConfig  # noqa: E402
from gyre.actors.cells.kv_migrator import KVMigrator, KVMigratorConfig  # noqa: E402
from gyre.actors.training.microstep_claimer import ClaimerConfig, MicroStepClaimer  # noqa: E402
from gyre.actors.serving.proxy import Proxy, ProxyConfig  # noqa: E402
from gyre.actors.training.checkpointer import Checkpointer, CheckpointerConfig  # noqa: E402
from gyre.actors.training.run_monitor import RunMonitor, RunMonitorConfig  # noqa: E402
from gyre.actors.training.scheduler import Scheduler, SchedulerConfig  # noqa: E402
from gyre.actors.executions.task_source import TaskSource, TaskSourceConfig  # noqa: E402
from gyre.actors.training.trajectory_builder import TrajectoryBuilder, TrajectoryBuilderConfig  # noqa: E402
from gyre.actors.cells.weight_broker import WeightBroker, WeightBrokerConfig  # noqa: E402
from gyre.engines.embedded_engine import EngineConfig  # noqa: E402
from gyre.engines.model_format import ModelSpec  # noqa: E402
from gyre.engines.trainer import TrainerConfig  # noqa: E402
from gyre.messages.executions import TaskSpec  # noqa: E402
from gyre.policies.scheduling import AsyncPolicy, ColocatePolicy, ElasticPolicy  # noqa: E402
from gyre.policies.staleness import MaxVersionLag  # noqa: E402
from gyre.policies.task_sampling import EpochOrder, SignalPerToken, SignalWeighted  # noqa: E402
from gyre.runtime import RestartPolicy, Topology  # noqa: E402
from gyre.runtime.errors import ConfigError  # noqa: E402
SHIPPED_WARM_START = HERE / "warm_start"
"""The warm start that ships with the project (`--warm-start shipped`, the default): examples/warm_start/README.md
says what built it; its manifest holds the files' digests, the command and commit, and its held-out scores."""

# examples/toolbox: what agents and scorers are forked warm with
from evaluate import AGENT_PRELOAD, SCORER_PRELOAD  # noqa: E402

def cell_names(count: int) -> tuple[str, ...]:
    """The cells of a run of `count` (--cells): the core, then satellites sat1, sat2, ..."""
    return ("core", *(f"sat{number}" for number in range(1, count)))


def parse_resources(text: str) -> dict[str, float]:
    """--cell-resources: "CPU=4,GPU=1,node_kind=1" -> {"CPU": 4.0, "GPU": 1.0, "node_kind": 1.0}."""
    resources: dict[str, float] = {}
    for item in (part.strip() for part in text.split(",") if part.strip()):
        name, equals, amount = item.partition("=")
        try:
            value = float(amount)
        except ValueError:
            value = -1.0
        if not equals or not name.strip() or not (value >= 0.0 and math.isfinite(value)) or name.strip() in resources:
            raise argparse.ArgumentTypeError(f"expected NAME=AMOUNT[,NAME=AMOUNT...] with amounts >= 0, each NAME "
                                             f"once, got {text!r}")
        resources[name.strip()] = value
    return resources

def parse_layout(text: str) -> tuple[int, int, int, int]:
    """--trainer-layout: "TP,PP,DP,EP", e.g. "2,1,2,1" -> (2, 1, 2, 1): every cell's trainer as tensor x pipeline x
    data processes (one per device), experts split over EP of the data-parallel ranks."""
    parts = [part.strip() for part in text.split(",")]
    if len(parts) != 4 or not all(part.isdigit() and int(part) >= 1 for part in parts):
        raise argparse.ArgumentTypeError(f"expected TP,PP,DP,EP as four integers >= 1, got {text!r}")
    tensor, pipeline, data, expert = (int(part) for part in parts)
    return tensor, pipeline, data, expert


TASK_SAMPLING = {"signal": SignalWeighted, "signal-per-token": SignalPerToken, "epoch": EpochOrder}
"""--task-sampling's choices: policies/task_sampling.py."""


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="agent_rl", description="GSPO on the toolbox tasks with elastic cells")
    parser.add_argument("--report", default="report", help="report folder")
    parser.add_argument("--policy", choices=("elastic", "async", "colocate"), default="elastic")
    parser.add_argument("--async-train-cells", default="core", help="comma-separated train cells for --policy async")
    parser.add_argument("--elastic-keep-a-rollout-cell", action="store_true",
                        help="elastic: keep one cell rolling out even while the rollout has nothing to do (a whole "
                        "step waiting behind the one in training); by default that cell trains too")
    parser.add_argument("--steps", type=int, default=18, help="optimizer steps to train")
    parser.add_argument("--group-size", type=int, default=16, help="executions per GSPO group")
    parser.add_argument("--groups-per-step", type=int, default=8,
                        help="GSPO groups a step trains on. From session 12's warm start, 8 (573-676 s of RL) gained "
                        "+11.4 to +14.0 held-out points sampled in six runs (greedy median +11.6); 4 (about half the "
                        "time) +5.6 to +9.6 in four, losing more of the write task (BENCHMARKS.md, sessions 12, 13)")
    parser.add_argument("--agents-at-once", type=int, default=0,
                        help="executions running at once (0: two groups, 2 x --group-size). Each cell decodes up to "
                        "1.5 times as many, so one cell can take every live session while the others train. 64 "
                        "instead of 32 made no clear difference: 64.7 and 62.4 s a step against 71.2 and 61.6 "
                        "(BENCHMARKS.md, session 15)")
    parser.add_argument("--staleness", type=int, default=1, help="max weight-version lag of a trained sample")
    parser.add_argument("--lr", type=float, default=3e-4,
                        help="RL learning rate (3e-4: from the sessions 7-9 warm start ten runs scored on 224 "
                        "held-out tasks gained +4.0 to +12.5 points, from session 10's -1.8 and +0.0; "
                        "4e-4 collapsed once: BENCHMARKS.md, sessions 7 to 10)")
    parser.add_argument("--lr-warmup-steps", type=int, default=0,
                        help="ramp the learning rate up linearly over the first N steps (0: none)")
    parser.add_argument("--clip-low", type=float, default=3e-4, help="GSPO lower clip range of the sequence ratio")
    parser.add_argument("--clip-high", type=float, default=4e-4, help="GSPO upper clip range of the sequence ratio")
    parser.add_argument("--rollout-temperature", type=float, default=0.7,
                        help="the agents' sampling temperature in training; behaviour and trainer log-probs are taken "
                        "at it (held-out evaluation: greedy, and sampled at it). From session 12's warm start, at "
                        "1.0 the samples of kinds the greedy model solves a third of rarely succeed, and RL unlearns "
                        "them (BENCHMARKS.md, session 12)")
    parser.add_argument("--min-reward-spread", type=float, default=0.25,
                        help="drop groups whose rewards span no more than this (DAPO dynamic sampling; 0: keep all). "
                        "0.25 also drops groups that differ only by the 0.2 written-file reward, so the task sampling "
                        "moves rollouts to kinds that can succeed: +9.4 to +12.1 held-out points in four runs "
                        "(median +10.05), against +6.7 twice at 0.01 (BENCHMARKS.md, sessions 8 and 9)")
    parser.add_argument("--task-sampling", choices=tuple(TASK_SAMPLING), default="signal-per-token",
                        help="signal-per-token (the default): run task kinds more often while their groups still "
                        "land, i.e. their 16 rewards differ, by their share of the engines' tokens, so kinds whose "
                        "groups run long and rarely land get fewer groups (policies/task_sampling.py; session 17: "
                        "585-738 s after the prepare and +10.7 to +12.9 sampled in three runs, against 754-981 s and "
                        "+9.6 to +11.4 for signal in four; from the shipped warm start, session 23: BENCHMARKS.md); "
                        "signal: the same rule over groups drawn; epoch: every training task in turn")
    parser.add_argument("--frozen-policy", action="store_true",
                        help="every optimizer step runs at learning rate 0, so the weights (and what the rollouts "
                        "sample) never change, and the tasks come in a fixed seeded order (--task-sampling epoch): "
                        "runs at the same seed run the same executions whatever their scheduling policy (each call "
                        "is sampled with a seed of its execution and call index), so `gyre bench policies "
                        "--equal-work` times the policies on equal work. Learns nothing; refuses --lr, "
                        "--lr-warmup-steps and --task-sampling other than epoch")
    parser.add_argument("--train-tasks", type=int, default=400)
    parser.add_argument("--train-kinds", default="", help="comma-separated task kinds RL trains on (default: all; "
                        "held-out evaluation always covers every kind)")
    parser.add_argument("--heldout-tasks", type=int, default=224,
                        help="held-out tasks scored before and after RL (32 of each kind). Three RL runs that all "
                        "gain +6.7 points on 224 read +3.6, +8.9 and +10.7 on the first 56 (BENCHMARKS.md, session 8)")
    parser.add_argument("--sampled-eval-samples", type=int, default=2,
                        help="score the held-out tasks this many times each, sampled at the rollout temperature: "
                        "the report's headline success rate, the policy RL trains, which greedy decoding can miss (a "
                        "run gained +1.3 points greedy and +14.0 sampled: BENCHMARKS.md, session 12). Each attempt "
                        "more costs a minute or more after RL; 0: score greedy only, and make it the headline")
    parser.add_argument("--warm-start", default="shipped", metavar="shipped|rebuild|DIR",
                        help="the model RL starts from: `shipped` (the default: examples/warm_start, the warm start "
                        "the README's figures are measured from, its digest checked against its manifest and its "
                        "held-out scores cached beside it, so the run starts learning at once), `rebuild` (copy "
                        "pretraining and SFT here from the flags below, cached: 30-60 minutes on 2 cores the first "
                        "time, and not the same bytes on another CPU, so not the same RL gain), or any HF model "
                        "directory (its manifest.json, when it has one, is checked)")
    parser.add_argument("--sft-tasks", type=int, default=900,
                        help="expert demonstrations for the warm start (one epoch). After the copy pretraining 900 "
                        "give a model that solves ~0.1 of the held-out tasks and skips the calculator, which RL "
                        "fixes; 1,200 give ~0.46, whose failures RL barely moves (BENCHMARKS.md, session 12)")
    parser.add_argument("--sft-epochs", type=int, default=1,
                        help="SFT epochs of the warm start: more give a stronger model whose failures are copy errors "
                        "that 18 RL steps do not move (BENCHMARKS.md, session 7)")
    parser.add_argument("--copy-steps", type=int, default=3000,
                        help="synthetic copy-pretraining steps (0: none). 600 at a constant rate (and 400 past a "
                        "gap) left a model that copied a task's words into a quoted argument in 0.36 of held-out "
                        "examples; 3,000 ending in a decay (and 1,200), 0.98 (BENCHMARKS.md, session 12)")
    parser.add_argument("--copy-decay-steps", type=int, default=600,
                        help="the last N copy steps decay the learning rate linearly to 5%% (0: constant)")
    parser.add_argument("--copy-gap-steps", type=int, default=1200,
                        help="then steps of copying past a line of unrelated items (0: none): the long-range copy an "
                        "agent needs across its context (BENCHMARKS.md, sessions 5 and 12)")
    parser.add_argument("--copy-gap-decay-steps", type=int, default=400,
                        help="the last N of those steps decay the learning rate linearly to 5%% (0: constant)")
    parser.add_argument("--copy-gap-items", type=int, default=40, help="longest gap of those steps, in items")
    parser.add_argument("--copy-expression-share", type=float, default=0.2,
                        help="share of the gap stage's items that are calculator expressions like 53-8 (0: none)")
    parser.add_argument("--trainer-layout", type=parse_layout, default=(1, 1, 1, 1), metavar="TP,PP,DP,EP",
                        help="every cell's trainer: tensor, pipeline and data-parallel processes (one per device; "
                        "their product is the cell's world size) and the expert-parallel size of a qwen3_moe model; "
                        "the cells of a step share one layout (default 1,1,1,1: one process)")
    parser.add_argument("--trainer-precision", choices=("fp32", "bf16"), default="fp32",
                        help="bf16 computes in bfloat16 with fp32 master weights (for GPUs; fp32 is the CPU setting)")
    parser.add_argument("--cells", type=int, default=3,
                        help="cells: the core and N-1 satellites (3 on this machine; as many as the cluster has)")
    parser.add_argument("--cell-resources", type=parse_resources, default={}, metavar="CPU=N,GPU=N,NAME=N",
                        help="what each cell reserves on its node under `gyre run --ray` (Ray's resource names; "
                        "default 1 CPU)")
    parser.add_argument("--transfer-protocol", choices=("tcp", "rdma"), default="tcp",
                        help="Mooncake transport of the cells' weights, gradients and KV: rdma where every cell's node "
                        "has an RDMA NIC (a cell on a node without one fails at start, saying so)")
    parser.add_argument("--cell-cpu-cores", type=float, default=0.0,
                        help="cap each cell's process at this many cores (a cgroup quota: one device per cell, as on "
                        "a GPU cluster; 0: no cap)")
    parser.add_argument("--weight-average-decay", type=float, default=0.0,
                        help="the core keeps an exponential moving average of its weights (this decay per step) and "
                        "the held-out score after RL is the average's (0: the last weights')")
    parser.add_argument("--checkpoint-every", type=int, default=0,
                        help="save the weights every N steps to REPORT/checkpoints/vNNNNN (0: never); "
                        "benchmarks/studies/average_checkpoints.py averages them afterwards")
    parser.add_argument("--keep-checkpoints", type=int, default=3,
                        help="full checkpoints kept in REPORT/run_checkpoints (the newest; with --checkpoint-every N)")
    parser.add_argument("--resume-from", default="", metavar="CHECKPOINT",
                        help="set by `gyre run --resume`: the checkpoint folder the actors restore from")
    parser.add_argument("--engine-kind", choices=("server", "embedded"), default="server",
                        help="each cell's engine: a server child process driven over SGLang's HTTP API (default) or "
                        "in the cell's own process")
    parser.add_argument("--engine-preset", choices=("gyre", "sglang"), default="gyre",
                        help="the server the cells launch with --engine-kind server: Gyre's engine server (CPU) or "
                        "SGLang (python -m sglang.launch_server, on a GPU node)")
    parser.add_argument("--engine-arg", action="append", default=[], metavar="ARG",
                        help="an argument passed through to every engine server's command line (repeatable), e.g. "
                        "--engine-arg=--mem-fraction-static --engine-arg=0.6")
    parser.add_argument("--tasks", default="",
                        help="train on a task set instead of the toolbox tasks: a Harbor task directory, SWE-bench-style "
                        "instances, or a directory of either (examples/tasks, examples/swe); agents and verifiers run "
                        "in the bubblewrap sandbox, and the toolbox's held-out evaluation is skipped")
    parser.add_argument("--agent", default="mini-swe-agent",
                        help="with --tasks: the agent (mini-swe-agent, noop, an agent spec file *.toml, or a command "
                        "line; gyre.actors.executions.agents)")
    parser.add_argument("--agent-option", action="append", default=[], metavar="KEY=VALUE",
                        help="with --tasks and mini-swe-agent: a setting of its own configuration (repeatable), e.g. "
                        "agent.step_limit=8; its sampling temperature is --rollout-temperature")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-eval", action="store_true", help="skip the held-out evaluations (smoke tests)")
    parser.add_argument("--cache", default=os.environ.get("GYRE_CACHE", str(Path.home() / ".cache" / "gyre")))
    args = parser.parse_args(argv)
    if args.cell_cpu_cores < 0:
        parser.error(f"--cell-cpu-cores must be >= 0 (0: no cap), got {args.cell_cpu_cores}")
    if not 0.0 <= args.copy_expression_share <= 1.0:
        parser.error(f"--copy-expression-share must be in [0, 1], got {args.copy_expression_share}")
    if not 0.0 <= args.weight_average_decay < 1.0:
        parser.error(f"--weight-average-decay must be in [0, 1), got {args.weight_average_decay}")
    if args.copy_decay_steps < 0 or args.copy_gap_decay_steps < 0:
        parser.error("--copy-decay-steps and --copy-gap-decay-steps must be >= 0 (0: a constant rate; more than the "
                     "stage's steps: the whole stage decays)")
    if args.sampled_eval_samples < 0:
        parser.error(f"--sampled-eval-samples must be >= 0 (0: greedy only), got {args.sampled_eval_samples}")
    if args.agents_at_once < 0:
        parser.error(f"--agents-at-once must be >= 0 (0: two groups), got {args.agents_at_once}")
    if args.agents_at_once == 0:
        args.agents_at_once = 2 * args.group_size
    if args.cells < 1:
        parser.error(f"--cells must be >= 1 (the core), got {args.cells}")
    if args.trainer_layout[2] % args.trainer_layout[3]:
        parser.error(f"--trainer-layout: the expert-parallel size {args.trainer_layout[3]} must divide the "
                     f"data-parallel size {args.trainer_layout[2]} (megatron takes the expert ranks out of the "
                     "data-parallel ones)")
    args.cell_names = cell_names(args.cells)
    unknown = set(c for c in args.async_train_cells.split(",") if c) - set(args.cell_names)
    if unknown:
        parser.error(f"--async-train-cells names cells the run does not have: {', '.join(sorted(unknown))}")
    if args.frozen_policy:
        # A frozen run exists to run the same executions as another frozen run at the same seed: a learning rate
        # would drift the rollouts, and an adaptive task sampler would follow the order in which groups land.
        conflicting = [f"--{name.replace('_', '-')}" for name in ("lr", "lr_warmup_steps", "task_sampling")
                       if getattr(args, name) != parser.get_default(name)
                       and not (name == "task_sampling" and args.task_sampling == "epoch")]
        if conflicting:
            parser.error(f"--frozen-policy sets the learning rate to 0 and the task order to epoch; drop "
                         f"{', '.join(conflicting)}")
        args.lr, args.task_sampling = 0.0, "epoch"
    if args.lr_warmup_steps < 0:
        parser.error(f"--lr-warmup-steps must be >= 0 (0: none), got {args.lr_warmup_steps}")
    if args.checkpoint_every < 0:
        parser.error(f"--checkpoint-every must be >= 0 (0: never), got {args.checkpoint_every}")
    if args.keep_checkpoints < 1:
        parser.error(f"--keep-checkpoints must be >= 1, got {args.keep_checkpoints}")
    if not 0.0 <= args.clip_low < 1.0 or args.clip_high < 0.0:
        parser.error(f"need 0 <= --clip-low < 1 and --clip-high >= 0, got {args.clip_low} and {args.clip_high}")
    if args.warm_start != "rebuild":
        shaping = [f"--{name.replace('_', '-')}" for name in WARM_START_FLAGS
                   if getattr(args, name) != parser.get_default(name)]
        if shaping:
            parser.error(f"{', '.join(shaping)} shape the warm start that --warm-start rebuild builds; "
                         f"the {args.warm_start} one is built already (drop them, or add --warm-start rebuild)")
        if args.warm_start == "shipped":
            args.warm_start = str(SHIPPED_WARM_START)
            if not (SHIPPED_WARM_START / "config.json").is_file():
                parser.error(f"the shipped warm start {SHIPPED_WARM_START} is missing (a partial checkout?): "
                             f"restore it from git, or build one with --warm-start rebuild")
        elif not (Path(args.warm_start) / "config.json").is_file():
            parser.error(f"--warm-start {args.warm_start}: not an HF model directory (no config.json), nor "
                         f"shipped or rebuild")
    if args.tasks:
        args.skip_eval = True  # the held-out evaluation scores toolbox tasks; `gyre eval` scores a task set
        try:
            args.task_set = _task_set(args)
        except ValueError as error:  # HarborTaskError, SweInstanceError, AgentSpecError
            parser.error(f"--tasks {args.tasks}: {error}")
    return args


def _task_set(args: argparse.Namespace) -> tuple[TaskSpec, ...]:
    """--tasks: the task set's TaskSpecs running --agent (mini-swe-agent at the rollout temperature)."""
    from gyre.actors.executions.agents import task_set_specs

    options = tuple(args.agent_option)
    if args.agent == "mini-swe-agent":
        options = (f"model.model_kwargs.temperature={args.rollout_temperature}", *options)
    elif options:
        raise ValueError("--agent-option is for mini-swe-agent")
    return task_set_specs(args.tasks, args.agent, "gyre", options)


def _toolbox():
    from agent import load_sibling

    return load_sibling("tasks"), load_sibling("agent"), load_sibling("expert")


# ---- prepare: base model, warm start, held-out score before RL ----------------------------------------------------
WARM_START_FLAGS = ("sft_tasks", "sft_epochs", "copy_steps", "copy_decay_steps", "copy_gap_steps",
                    "copy_gap_decay_steps", "copy_gap_items", "copy_expression_share")
"""The flags that shape a rebuilt warm start (refused with --warm-start DIR: they would change nothing)."""
NOT_SCORED = {"success_rate": float("nan"), "mean_reward": float("nan")}
"""The held-out score of a run that skips evaluation (--skip-eval)."""


def held_out_score(result) -> dict:
    """What the report keeps of a held-out evaluation: success rate and mean reward over all tasks, and the success
    rate of each task kind (which kinds RL moved, and which it could not)."""
    return {
        "success_rate": result.success_rate, "mean_reward": result.mean_reward,
        "success_by_kind": result.success_by_kind(),
    }


def held_out_scores(model_dir: Path, held_out, *, greedy: bool, temperature: float, samples: int,
                    evaluate_passes=None) -> tuple[dict | None, dict | None]:
    """The greedy score (when `greedy`) and the sampled one (when `samples` > 0), from one pooled evaluation.

    The sampled score is the mean success of `samples` attempts at each held-out task (and per kind) at
    `temperature`: the policy that RL trains, sampled as in training, where a greedy decode can take a path no sample
    takes. Every pass runs on one engine at once (evaluate.evaluate_passes): after RL a greedy pass and two sampled
    ones took 261 s together against 345 s one after another (BENCHMARKS.md, session 15)."""
    from evaluate import EvalResult

    if evaluate_passes is None:
        from evaluate import evaluate_passes
    temperatures = ((0.0,) if greedy else ()) + (temperature,) * samples
    if not temperatures:
        return None, None
    passes = list(evaluate_passes(model_dir, held_out, temperatures))
    greedy_score = held_out_score(passes.pop(0)) if greedy else None
    if not samples:
        return greedy_score, None
    pooled = EvalResult.of([outcome for one_pass in passes for outcome in one_pass.outcomes], passes[0].seconds)
    return greedy_score, {"temperature": temperature, "samples": samples, "success_rate": pooled.success_rate,
                          "mean_reward": pooled.mean_reward, "success_by_kind": pooled.success_by_kind()}


def headline_scores(greedy_before: dict, greedy_after: dict, sampled_before: dict | None,
                    sampled_after: dict | None) -> dict:
    """Which held-out score the report's `success_rate_before/after` are, and the other one beside them.

    The headline is the sampled score when the run measured one: the mean success of the policy RL trains, sampled
    as in training, over several attempts a task (pass@1 estimated from k samples, as DeepSeek-R1 reports it:
    arXiv:2501.12948 v1, section 3, "Evaluation Setup", where greedy decoding varied too much across checkpoints).
    Here a greedy decode is one brittle path per task: six runs with 8 groups a step gained +1.3 to +15.6 points
    greedy and +11.4 to +14.0 sampled, the greedy "write" score alone ranging 6 to 18 of 32 (BENCHMARKS.md,
    sessions 12 and 13). The greedy score stays in the summary as `greedy_*`; without a sampled score
    (--sampled-eval-samples 0) the headline is the greedy one. Returns {"before", "after", "extra"}: the headline's
    two scores and the summary's other keys.
    """
    extra = {
        "greedy_success_rate_before": greedy_before["success_rate"],
        "greedy_success_rate_after": greedy_after["success_rate"],
        "greedy_success_by_kind_before": greedy_before.get("success_by_kind", {}),
        "greedy_success_by_kind_after": greedy_after.get("success_by_kind", {}),
    }
    if sampled_before is None:
        measure = "not scored" if math.isnan(greedy_before["success_rate"]) else "greedy"  # NaN: --skip-eval
        return {"before": greedy_before, "after": greedy_after, "extra": {"success_measure": measure, **extra}}
    after_k = (sampled_after or {}).get("samples", sampled_before["samples"])
    measure = f"sampled at temperature {sampled_before['temperature']}, mean of {after_k} attempts a task"
    if sampled_before["samples"] != after_k:
        measure += f" ({sampled_before['samples']} before RL)"
    return {"before": sampled_before, "after": sampled_after or NOT_SCORED, "extra": {
        "success_measure": measure, "sampled_temperature": sampled_before["temperature"],
        "sampled_per_task": after_k, "sampled_per_task_before": sampled_before["samples"], **extra}}


def _copy_pretrain_stage(base: Path, cache: Path, what: str, config) -> Path:
    """One stage of synthetic copy pretraining on `base`, cached under a digest of both."""
    from gyre.engines.pretrain import copy_pretrain_digest, run_copy_pretrain

    out = cache / f"copy-{copy_pretrain_digest(base, config)}"
    if not (out / "copy_pretrain.json").is_file():
        print(f"agent_rl: {what}, {config.steps} steps (cached in {out})", file=sys.stderr)
        run_copy_pretrain(base, out, config, progress=lambda step, total, loss, accuracy: print(
            f"  copy step {step}/{total} loss {loss:.3f} accuracy {accuracy:.2f}", file=sys.stderr)
            if step % 25 == 0 or step == total else None)
    return out


def built_warm_start(source: Path, cache: Path, *, require_manifest: bool = False) -> Path:
    """A built warm start (any HF directory) as the cache folder the run reads and writes its held-out scores in:
    copied once into `cache`/warm-<digest>, with the score files that came with it. A directory with a manifest is
    checked against it first (ManifestError naming a file that differs); `require_manifest` (the shipped warm
    start) refuses one without."""
    import shutil

    from gyre.engines.model_manifest import MANIFEST_FILE, file_digests, model_digest, verify

    checked = require_manifest or (source / MANIFEST_FILE).is_file()
    files = verify(source)["files"] if checked else file_digests(source)
    target = cache / f"warm-{model_digest(files)[:16]}"
    if not (target / "model.safetensors").is_file():
        staging = cache / f".{target.name}.partial"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        for path in source.iterdir():
            if path.is_file() and (path.name in files or path.name.startswith("eval-") or path.name == MANIFEST_FILE):
                shutil.copy2(path, staging / path.name)
        os.replace(staging, target)
    for path in source.glob("eval-*.json"):  # scores shipped after this cache was made (e.g. more attempts a task)
        if not (target / path.name).is_file():
            shutil.copy2(path, target / f".{path.name}.partial")
            os.replace(target / f".{path.name}.partial", target / path.name)
    return target


def prepare(argv: list[str]) -> None:
    from gyre.engines.model_format import init_model_dir
    from gyre.engines.pretrain import KINDS as COPY_KINDS, CopyPretrainConfig
    from gyre.engines.sft import SFTConfig, demonstrations_digest, run_sft

    args = parse_args(argv)
    started = time.perf_counter()
    report = Path(args.report)
    report.mkdir(parents=True, exist_ok=True)
    cache = Path(args.cache) / "agent_rl"
    if args.warm_start != "rebuild":
        cache.mkdir(parents=True, exist_ok=True)
        source = Path(args.warm_start).resolve()
        _score_and_record(args, report, built_warm_start(
            source, cache, require_manifest=source == SHIPPED_WARM_START.resolve()), started)
        return
    print("agent_rl: --warm-start rebuild: copy pretraining and SFT on this machine, each stage cached under "
          f"{cache}; from an empty cache 30-60 minutes on 2 cores, and the warm start (so the RL gain) may differ "
          "from the shipped one on another CPU", file=sys.stderr)
    base = cache / "base-tiny"
    if not (base / "model.safetensors").is_file():
        init_model_dir(base, "tiny", seed=args.seed)
    tasks, _, expert = _toolbox()
    if args.copy_steps > 0:
        # Every kind, "quote" among them: the task's words go from inside the prompt into a JSON string argument.
        base = _copy_pretrain_stage(base, cache, "synthetic copy pretraining", CopyPretrainConfig(
            steps=args.copy_steps, words=tasks.WORDS + tasks.ITEMS, seed=args.seed, kinds=COPY_KINDS,
            decay_steps=min(args.copy_decay_steps, args.copy_steps)))
        if args.copy_gap_steps > 0:
            # Then past a gap, with expressions among the items (a "calc" task's expression goes into the
            # calculator's argument).
            base = _copy_pretrain_stage(base, cache, "copy past a gap", CopyPretrainConfig(
                steps=args.copy_gap_steps, words=tasks.WORDS + tasks.ITEMS, seed=args.seed,
                max_gap_items=args.copy_gap_items, kinds=COPY_KINDS, expression_share=args.copy_expression_share,
                decay_steps=min(args.copy_gap_decay_steps, args.copy_gap_steps)))
    demos = expert.demonstrations(args.sft_tasks, seed=args.seed)
    lines = [json.dumps(d.to_json(), sort_keys=True) for d in demos]
    config = SFTConfig(epochs=args.sft_epochs, seed=args.seed)
    key = demonstrations_digest(lines, base, config)
    sft_dir = cache / f"sft-{key}"
    if not (sft_dir / "sft.json").is_file():
        print(f"agent_rl: warm start on {len(demos)} demonstrations (cached for later runs in {sft_dir})",
              file=sys.stderr)
        pairs = [(d.messages, d.tools) for d in demos]
        run_sft(base, pairs, sft_dir, config,
                progress=lambda step, total, loss: print(f"  sft step {step}/{total} loss {loss:.3f}", file=sys.stderr)
                if step % 10 == 0 or step == total else None)
    _score_and_record(args, report, sft_dir, started)


def most_attempts_cached(sft_dir: Path, name: str, samples: int) -> dict | None:
    """The cached sampled score named like `name` (eval-sampled-pooled-...-k<samples>.json) with the most attempts a
    task, at least `samples`; None when there is none.

    More attempts estimate the same quantity (the warm start's pass@1 at that temperature) with less noise, and
    the warm start is scored once while every run's gain is measured from it: two k=2 scores of the shipped warm start
    read 0.069 and 0.094 (sessions 15 and 21) where 16 attempts a task read 0.074-0.075 (BENCHMARKS.md, session 22),
    so a k=2 "before" moved every run's gain by up to 2.5 points. The score after RL keeps the run's own k."""
    stem = name.removesuffix(f"-k{samples}.json")
    best: tuple[int, dict] | None = None
    for path in sft_dir.glob(f"{stem}-k*.json"):
        k_text = path.name[len(stem) + 2:-len(".json")]
        if not k_text.isdigit() or int(k_text) < samples:
            continue
        score = json.loads(path.read_text())
        if score.get("samples") != int(k_text):
            raise ValueError(f"{path}: its name says {k_text} attempts a task, its content {score.get('samples')}")
        if best is None or int(k_text) > best[0]:
            best = (int(k_text), score)
    return None if best is None else best[1]


def _score_and_record(args: argparse.Namespace, report: Path, sft_dir: Path, started: float) -> None:
    """The warm start's held-out scores (cached in `sft_dir`, computed once) and prepare.json."""
    tasks, _, _ = _toolbox()
    before, sampled_before = NOT_SCORED, None
    held_out = () if args.skip_eval else tasks.generate_tasks(args.seed + 1, "heldout", args.heldout_tasks)
    if not args.skip_eval:
        greedy_cache = sft_dir / f"eval-{args.heldout_tasks}-{args.seed}.json"
        # "pooled": the sampled passes drew from one engine's seed stream, as the score after RL does (scores taken
        # one pass an engine, before session 15, are not reused).
        sampled_cache = sft_dir / (f"eval-sampled-pooled-{args.heldout_tasks}-{args.seed}-t{args.rollout_temperature}"
                                   f"-k{args.sampled_eval_samples}.json")
        if greedy_cache.is_file():
            before = json.loads(greedy_cache.read_text())
        if args.sampled_eval_samples > 0:
            sampled_before = most_attempts_cached(sft_dir, sampled_cache.name, args.sampled_eval_samples)
        score_greedy = "success_by_kind" not in before  # not scored yet, or scored before the per-kind split was kept
        sample = args.sampled_eval_samples if sampled_before is None else 0
        greedy_score, sampled = held_out_scores(sft_dir, held_out, greedy=score_greedy,
                                                temperature=args.rollout_temperature, samples=sample)
        if greedy_score is not None:
            before = greedy_score
            greedy_cache.write_text(json.dumps(before))
        if sampled is not None:
            sampled_before = sampled
            sampled_cache.write_text(json.dumps(sampled_before))
        print(f"agent_rl: held-out success before RL, greedy: {before['success_rate']:.2f}", file=sys.stderr)
        if sampled_before is not None:
            print(f"agent_rl: held-out success before RL, sampled at {args.rollout_temperature} "
                  f"({sampled_before['samples']} attempts a task; the report's headline): "
                  f"{sampled_before['success_rate']:.2f}", file=sys.stderr)
    started_at = time.time()
    if args.resume_from and (report / "prepare.json").is_file():
        started_at = json.loads((report / "prepare.json").read_text())["started_at"]  # the run goes on
    (report / "prepare.json").write_text(json.dumps({
        "model_dir": str(sft_dir), "before": before, "sampled_before": sampled_before,
        "prepare_s": time.perf_counter() - started,
        "started_at": started_at,
    }, indent=1))


# ---- the topology --------------------------------------------------------------------------------------------------
def _task_specs(args: argparse.Namespace) -> tuple[TaskSpec, ...]:
    if args.tasks:
        return args.task_set
    tasks, agent, _ = _toolbox()
    command = agent.agent_argv("")[:-1] + ("--temperature", str(args.rollout_temperature))
    return tuple(
        TaskSpec(
            task_id=t.task_id, prompt=t.prompt, workspace_files=dict(t.workspace_files), agent_argv=command,
            scorer_argv=tuple(t.scorer_argv), timeout_s=180.0, scorer_timeout_s=30.0,
        )
        for t in rl_tasks(args, tasks)
    )


RL_TASK_SEED_OFFSET = 1000
"""RL tasks come from seed + this: another stream than the warm start's (seed) and the held-out set's (seed + 1)."""


def rl_tasks(args: argparse.Namespace, tasks) -> tuple:
    """Training-split tasks the warm start never saw. The expert's demonstrations are the first `sft_tasks` tasks of
    `seed`; RL on those would reward recall of memorised answers, not behaviour that carries over to held-out tasks."""
    demonstrated = frozenset(t.task_id for t in tasks.generate_tasks(args.seed, "train", args.sft_tasks))
    return tasks.generate_tasks(args.seed + RL_TASK_SEED_OFFSET, "train", args.train_tasks,
                                kinds=_train_kinds(args, tasks), exclude=demonstrated)


def _train_kinds(args: argparse.Namespace, tasks) -> tuple[str, ...]:
    kinds = tuple(kind for kind in args.train_kinds.split(",") if kind) or tasks.KINDS
    unknown = sorted(set(kinds) - set(tasks.KINDS))
    if unknown:
        raise SystemExit(f"agent_rl: unknown task kinds {unknown}; the kinds are {', '.join(tasks.KINDS)}")
    return kinds


def _policy(args: argparse.Namespace):
    if args.policy == "async":
        return AsyncPolicy(train_cells=tuple(c for c in args.async_train_cells.split(",") if c))
    if args.policy == "colocate":
        return ColocatePolicy()
    return ElasticPolicy(min_dwell_s=5.0, dry_grace_s=3.0, idle_rollout_trains=not args.elastic_keep_a_rollout_cell)


def cell_engine(args: argparse.Namespace) -> EngineConfig:
    """Each cell's engine: 1.5 concurrent generations for each agent the executor runs (48 for 32), because the
    elastic policy lets a satellite train only while the cells that stay can take every live session with 10% to
    spare (0.9 * 48 >= 32); and 32 KV blocks (512 tokens) an agent, 1,024 at least."""
    return EngineConfig(num_blocks=max(1024, 32 * args.agents_at_once), max_context_tokens=4096,
                        max_running_requests=math.ceil(1.5 * args.agents_at_once), num_threads=1)


def topology(argv: list[str]) -> Topology:
    args = parse_args(argv)
    prepared = Path(args.report) / "prepare.json"
    if not prepared.is_file():
        raise SystemExit(f"agent_rl: {prepared} is missing: run this file with `gyre run`, which prepares it")
    model_dir = json.loads(prepared.read_text())["model_dir"]
    # The event log goes into the report: `gyre replay` / `gyre log` debug the very run the report describes.
    result = Topology("agent_rl", seed=args.seed, log_path=str(Path(args.report) / "events.glog"))
    result.checkpoint_dir = str(Path(args.report) / "run_checkpoints")  # where `gyre run --resume` looks
    run_checkpoints = result.checkpoint_dir if args.checkpoint_every else ""
    resume = args.resume_from
    engine = cell_engine(args)
    engine_server = EngineServerConfig(preset=args.engine_preset, extra_args=tuple(args.engine_arg))
    tensor, pipeline, data, expert = args.trainer_layout
    trainer = TrainerConfig(lr=args.lr, lr_warmup_steps=args.lr_warmup_steps, num_threads=1, seed=args.seed,
                            tensor_parallel=tensor, pipeline_parallel=pipeline, data_parallel=data,
                            expert_parallel=expert, precision=args.trainer_precision)
    if args.trainer_layout != (1, 1, 1, 1):  # one process fits any model
        try:
            trainer.check_parallel_fits(ModelSpec.from_model_dir(model_dir))  # here, not in a cell mid-run
        except ConfigError as error:
            raise SystemExit(f"agent_rl: --trainer-layout {','.join(map(str, args.trainer_layout))}: {error}") from None
    report = Path(args.report)
    for name in args.cell_names:
        # Satellites import megatron while they start rolling out, so a first switch into training is quick.
        # Only the core applies steps, so only the core keeps a weight average and saves weights.
        saves = {}
        if name == "core":
            saves = {"save_dir": str(report / "final_model"), "checkpoint_every_steps": max(1, args.checkpoint_every),
                     "checkpoint_dir": str(report / "checkpoints") if args.checkpoint_every else "",
                     "run_checkpoint_dir": run_checkpoints, "run_checkpoint_every_steps": max(1, args.checkpoint_every)}
            if args.weight_average_decay > 0:
                saves["average_save_dir"] = str(report / "final_model_average")
        cell_trainer = attrs.evolve(trainer, average_decay=args.weight_average_decay) if name == "core" else trainer
        # The core's weights and optimizer live only in it: its failure ends the run (resume from the last full
        # checkpoint). A satellite holds nothing the run needs: `gyre run ... --restart-processes sat1,sat2` starts
        # a dead one's process again and the run goes on (its claimed micro-steps are handed out again).
        restart = RestartPolicy("stop_topology") if name == "core" else RestartPolicy("restart")
        result.add(name, Cell, CellConfig(model_dir=model_dir, is_core=(name == "core"), engine=engine,
                                          engine_kind=args.engine_kind, engine_server=engine_server,
                                          trainer=cell_trainer, prepare_trainer_at_start=True, resume_from=resume,
                                          clip_low=args.clip_low, clip_high=args.clip_high,
                                          transfer_protocol=args.transfer_protocol, **saves), restart=restart)
        if args.cell_cpu_cores > 0:
            result.limit_cpu(name, args.cell_cpu_cores)
        if args.cell_resources:
            custom = {key: value for key, value in args.cell_resources.items() if key not in ("CPU", "GPU")}
            result.resources(name, CPU=args.cell_resources.get("CPU", 1.0), GPU=args.cell_resources.get("GPU", 0.0),
                             custom=custom)
    result.add("proxy", Proxy, ProxyConfig(model_dir=model_dir))
    result.add("kv_migrator", KVMigrator, KVMigratorConfig(), process="control")
    result.add("weight_broker", WeightBroker, WeightBrokerConfig(), process="control")
    result.add("claimer", MicroStepClaimer, ClaimerConfig(
        groups_per_step=args.groups_per_step, group_size=args.group_size, microstep_token_budget=8192,
        staleness=MaxVersionLag(args.staleness), resume_from=resume,
        # A claimer restarted after a crash continues from its journal (actors/training/microstep_claimer.py).
        journal_path=str(report / "claimer.journal")), process="control")
    result.add("scheduler", Scheduler, SchedulerConfig(policy=_policy(args), expected_cells=args.cell_names),
               process="control")
    # A task set (--tasks) runs its agents and verifiers in the bubblewrap sandbox (the workspace at the task's
    # workdir, no network but the proxy); sandboxed commands are never forked warm.
    sandbox = SandboxConfig(kind="bubblewrap" if args.tasks else "none")
    result.add("executor", Executor, ExecutorConfig(
        workspace_root=str(Path(args.report) / "workspaces"), max_concurrent=args.agents_at_once, sandbox=sandbox,
        # The agent imports openai (~2 CPU-s a process): forked from a server that imported it once, it starts in
        # ~0.1 s, which on 2 cores is about half of a step's CPU. The warm-up also pays, once, the ~0.13 CPU-s of
        # imports that a client's first request triggers (an agent's model calls cost ~0.05 CPU-s after it).
        warm_launcher_preload=() if args.tasks else AGENT_PRELOAD), process="runs")
    # A scorer exec'd fresh costs ~0.04 CPU-s even with -S, at ~250 scorers a step; forked from a server that
    # imported score.py's modules, ~0.01 (benchmarks/studies/scorer_launch.py).
    result.add("evaluator", Evaluator, EvaluatorConfig(
        remove_workspace=True, sandbox=sandbox, warm_launcher_preload=() if args.tasks else SCORER_PRELOAD),
        process="runs")
    result.add("trajectory_builder", TrajectoryBuilder, TrajectoryBuilderConfig(
        min_reward_spread=args.min_reward_spread, resume_from=resume), process="control")
    result.add("task_source", TaskSource, TaskSourceConfig(
        tasks=_task_specs(args), group_size=args.group_size, groups_in_flight=args.groups_per_step * 2,
        groups_per_step=args.groups_per_step, max_groups_ahead_of_training=args.groups_per_step * (args.staleness + 1),
        seed=args.seed, stop_topology_when_done=False,
        sampling=TASK_SAMPLING[args.task_sampling](), resume_from=resume,
        # A group whose GroupDone never comes (a message lost) is given up after 30 minutes; a group here takes 1-5.
        group_deadline_s=1800.0), process="control")
    monitor = RunMonitorConfig(report_dir=args.report, steps=args.steps, cells=args.cell_names,
                               core_cell=args.cell_names[0], resume_from=resume)
    result.add("monitor", RunMonitor, monitor, process="control")
    if run_checkpoints:
        result.add("checkpointer", Checkpointer, CheckpointerConfig(
            root=run_checkpoints, participants=("task_source", "trajectory_builder", "claimer", "monitor"),
            keep=args.keep_checkpoints), process="control")
    # Agents reach the proxy at the 127.0.0.1 URL it issues with their keys: under `gyre run --ray` the executor's
    # and evaluator's group goes on the proxy's node.
    result.pack("front", ["proxy", "runs"])
    return result


# ---- finish: held-out score after RL, the report ------------------------------------------------------------------
def finish(argv: list[str], run_result) -> int:
    from report import write_report

    args = parse_args(argv)
    report = Path(args.report)
    prepared = json.loads((report / "prepare.json").read_text())
    # The model the report scores: the weights' moving average when the core kept one, else the last weights.
    final_model = report / ("final_model_average" if args.weight_average_decay > 0 else "final_model")
    after, sampled_after = NOT_SCORED, None
    if run_result.interrupted and not args.skip_eval:
        # Scoring takes minutes; whoever pressed Ctrl-C wants the run to end, not to wait (score it later).
        print(f"agent_rl: interrupted; the report leaves out the held-out score of {final_model} (score it with "
              f"python3 examples/toolbox/evaluate.py {final_model} --tasks {args.heldout_tasks} "
              f"--seed {args.seed + 1})", file=sys.stderr)
    elif not args.skip_eval and (final_model / "model.safetensors").is_file():
        tasks, _, _ = _toolbox()
        held_out = tasks.generate_tasks(args.seed + 1, "heldout", args.heldout_tasks)
        samples = args.sampled_eval_samples if prepared.get("sampled_before") is not None else 0
        after, sampled_after = held_out_scores(final_model, held_out, greedy=True,
                                               temperature=args.rollout_temperature, samples=samples)
    scores = headline_scores(prepared["before"], after, prepared.get("sampled_before"), sampled_after)
    summary = write_report(report, scores["before"], scores["after"], {
        "wall_s": time.time() - prepared["started_at"], "policy": args.policy,
        "elastic_keeps_a_rollout_cell": args.elastic_keep_a_rollout_cell, "group_size": args.group_size,
        "groups_per_step": args.groups_per_step, "agents_at_once": args.agents_at_once, "staleness": args.staleness,
        "cell_cpu_cores": args.cell_cpu_cores,
        "engine_kind": args.engine_kind,
        "task_sampling": args.task_sampling, "lr": args.lr, "lr_warmup_steps": args.lr_warmup_steps,
        "frozen_policy": args.frozen_policy,
        "sft_epochs": args.sft_epochs,
        "weight_average_decay": args.weight_average_decay, "scored_model": final_model.name,
        "warm_start": prepared["model_dir"], "exit_reason": run_result.reason,
        "tasks": args.tasks or "toolbox", "agent": args.agent if args.tasks else "toolbox", **scores["extra"],
    })
    print(json.dumps(summary, indent=1))
    return run_result.exit_code
