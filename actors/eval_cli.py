"""`gyre eval TASKS --agent oracle|noop|CMD [--sandbox bubblewrap|none] [--json]`: run an agent once on every task
of a Harbor task set (no training) and report the success rate and each task's outcome.

It composes the executions wing (executor, evaluator) with a driver that plays the three parts the executor and
evaluator talk to: the task source (one StartGroup of size `--attempts` per task), the key issuer (the built-in
agents need no model, so the key it hands out leads nowhere: the sandbox has no network but the proxy, and here
there is no proxy) and the trajectory builder (it collects ExecutionScored / ExecutionDropped). It lives at the top
of actors/ because no wing imports another; an eval that serves a model through the proxy composes the serving wing
here too (not built yet: `--agent` names only agents that need no model).

Built-in agents: `oracle` runs each task's solution/solve.sh (mounted read-only at /solution), `noop` does nothing
(a task set's verifiers must give it 0), `mini-swe-agent` runs the PyPI package's `mini` command unchanged (yolo
mode, exit when done) with its litellm model `openai/<--model-name>` pointed at `--model-url` through the variables
litellm reads (OPENAI_BASE_URL, OPENAI_API_KEY); inside the bubblewrap sandbox that URL is reached through the
sandbox's forwarder, the only network there is. Any other value is a command line (split like a shell would), run
in the task's workdir with the instruction appended as its last argument. `--model-url` names an OpenAI-compatible
server that needs no per-execution key (training runs give each execution its own key through the proxy).

A task counts as a success when its reward is >= 1 (Harbor's "resolved"); a dropped execution (the verifier
crashed or hung) is reported as such and counts as a failure in the success rate, which is over all tasks.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import attrs

from gyre.actors.executions.evaluator import Evaluator, EvaluatorConfig
from gyre.actors.executions.executor import Executor, ExecutorConfig
from gyre.actors.executions.agents import BUILTIN_AGENTS, MINI_SWE_AGENT_ENV, task_set_specs
from gyre.actors.executions.harbor import HarborTaskError
from gyre.actors.executions.sandbox import SANDBOX_KINDS, SandboxConfig
from gyre.messages.executions import IssueKey, KeyIssued, RevokeKey, StartGroup, TaskSpec
from gyre.messages.groups import GroupStarted
from gyre.messages.samples import ExecutionDropped, ExecutionScored
from gyre.runtime import Actor, Codec, InProcessLauncher, RunOptions, Topology, handler, read_log
from gyre.runtime.logs import configure_logging
from gyre.runtime.validators import count

__all__ = ["BUILTIN_AGENTS", "EvalDriver", "EvalDriverConfig", "MINI_SWE_AGENT_ENV", "agent_task_specs", "register",
           "run_eval"]

NO_MODEL_URL = "http://127.0.0.1:9/v1"
"""What the built-in agents get as their model URL: port 9 (discard) on loopback, where nothing answers."""


def agent_task_specs(task_dir: str | Path, agent: str, model_name: str = "gyre",
                     mini_options: tuple[str, ...] = ()) -> tuple[TaskSpec, ...]:
    """The task set at `task_dir` (Harbor tasks or SWE-bench-style instances) as TaskSpecs that run `agent`
    (gyre.actors.executions.agents). Raises HarborTaskError, SweInstanceError or AgentSpecError."""
    return task_set_specs(task_dir, agent, model_name, mini_options)


@attrs.frozen
class EvalDriverConfig:
    """The tasks to run once each (or `attempts` times)."""

    tasks: tuple[TaskSpec, ...]
    """The task set."""
    attempts: int = attrs.field(default=1, validator=count)
    """Executions per task."""
    model_url: str = ""
    """OpenAI-compatible base URL (ending in /v1) handed to agents; "" = none (the built-in agents need none)."""


class EvalDriver(Actor):
    """Task source, key issuer and result collector of an eval run (module docstring)."""

    config_cls = EvalDriverConfig
    subscriptions = (GroupStarted,)

    async def on_start(self) -> None:
        self.waiting = len(self.config.tasks) * self.config.attempts
        for index, task in enumerate(self.config.tasks):
            self.tell("executor", StartGroup(f"eval{index:05d}", task, self.config.attempts, 0))

    @handler(IssueKey)
    def on_issue_key(self, msg: IssueKey) -> KeyIssued:
        url = self.config.model_url or NO_MODEL_URL
        return KeyIssued("no-model", url, url.removesuffix("/v1"))

    @handler(RevokeKey)
    def on_revoke_key(self, msg: RevokeKey) -> None:
        pass

    @handler(GroupStarted)
    def on_group_started(self, msg: GroupStarted) -> None:
        if msg.refused:  # nothing of this group will run: its executions count as done (reported as refused)
            self.log.error("eval_task_refused", task_id=msg.task_id, reason=msg.refused)
            self._done(self.config.attempts)

    @handler(ExecutionScored)
    def on_scored(self, msg: ExecutionScored) -> None:
        self._done(1)

    @handler(ExecutionDropped)
    def on_dropped(self, msg: ExecutionDropped) -> None:
        self._done(1)

    def _done(self, executions: int) -> None:
        self.waiting -= executions
        if self.waiting <= 0:
            self.stop_topology("eval done")


def run_eval(task_dir: str | Path, agent: str, sandbox: str = "bubblewrap", *, attempts: int = 1,
             max_concurrent: int = 4, workspace_root: str = "", log_path: str = "", model_url: str = "",
             model_name: str = "gyre") -> dict[str, Any]:
    """Run `agent` on the task set; {"success_rate", "mean_reward", "tasks": [{task_id, reward, success, ...}]}."""
    specs = agent_task_specs(task_dir, agent, model_name)
    with tempfile.TemporaryDirectory(prefix="gyre-eval-") as scratch:
        log_file = log_path or str(Path(scratch) / "eval.glog")
        root = workspace_root or str(Path(scratch) / "executions")
        sandbox_config = SandboxConfig(kind=sandbox)
        topology = Topology("eval", seed=0)
        topology.add("executor", Executor, ExecutorConfig(
            workspace_root=root, proxy="driver", evaluator="evaluator", builder="driver",
            max_concurrent=max_concurrent, sandbox=sandbox_config))
        topology.add("evaluator", Evaluator, EvaluatorConfig(builder="driver", max_concurrent=max_concurrent,
                                                             sandbox=sandbox_config))
        topology.add("driver", EvalDriver, EvalDriverConfig(specs, attempts, model_url))
        limit_s = sum(s.timeout_s + s.scorer_timeout_s for s in specs) * attempts + 60.0
        result = InProcessLauncher().run(topology, RunOptions(log_path=log_file, until_s=limit_s))
        return _report(specs, attempts, log_file, result.reason)


def _report(specs: tuple[TaskSpec, ...], attempts: int, log_file: str, reason: str) -> dict[str, Any]:
    codec = Codec()
    by_group = {f"eval{i:05d}": spec.task_id for i, spec in enumerate(specs)}
    outcomes: dict[str, list[dict[str, Any]]] = {spec.task_id: [] for spec in specs}
    refused: dict[str, str] = {}
    for record in read_log(log_file):
        name = record.type_name.rsplit(".", 1)[-1]
        if record.envelope.receiver != "driver" or name not in ("ExecutionScored", "ExecutionDropped",
                                                                  "GroupStarted"):
            continue
        msg = record.decode(codec)
        task_id = by_group.get(msg.group_id)
        if task_id is None:
            continue
        if name == "ExecutionScored":
            outcomes[task_id].append({"reward": msg.reward, "agent_timed_out": msg.timed_out, "detail": msg.detail})
        elif name == "ExecutionDropped":
            outcomes[task_id].append({"reward": None, "dropped": msg.reason})
        elif msg.refused:
            refused[task_id] = msg.refused
    tasks = []
    for spec in specs:
        runs = outcomes[spec.task_id]
        rewards = [r["reward"] for r in runs if r["reward"] is not None]
        entry: dict[str, Any] = {
            "task_id": spec.task_id,
            "reward": sum(rewards) / attempts if rewards else 0.0,
            "success": bool(runs) and len(rewards) == attempts and all(r >= 1.0 for r in rewards),
            "runs": runs,
        }
        if spec.task_id in refused:
            entry["refused"] = refused[spec.task_id]
        elif len(runs) < attempts:
            entry["unfinished"] = attempts - len(runs)
        tasks.append(entry)
    n = len(tasks)
    return {
        "success_rate": sum(t["success"] for t in tasks) / n,
        "mean_reward": sum(t["reward"] for t in tasks) / n,
        "num_tasks": n,
        "ended": reason,
        "tasks": tasks,
    }


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("eval", help="run an agent on a Harbor task set (no training) and report")
    parser.add_argument("tasks", help="a Harbor task directory, or a directory of them")
    parser.add_argument("--agent", default="oracle",
                        help="oracle (each task's solution/solve.sh), noop, mini-swe-agent, or a command line")
    parser.add_argument("--sandbox", choices=SANDBOX_KINDS, default="bubblewrap")
    parser.add_argument("--attempts", type=int, default=1, help="executions per task")
    parser.add_argument("--max-concurrent", type=int, default=4, help="executions (and verifiers) at once")
    parser.add_argument("--model-url", default="", help="OpenAI-compatible base URL (…/v1) for agents that need a model")
    parser.add_argument("--model-name", default="gyre", help="the model name agents ask for")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.set_defaults(func=_command)


def _command(args: argparse.Namespace) -> int:
    if "GYRE_LOG_LEVEL" not in os.environ:  # a report, not a run log: only problems are worth a line
        configure_logging("warning")
    try:
        report = run_eval(args.tasks, args.agent, args.sandbox, attempts=args.attempts,
                          max_concurrent=args.max_concurrent, model_url=args.model_url, model_name=args.model_name)
    except (HarborTaskError, ValueError, OSError) as error:
        print(f"gyre eval: {error}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report, sort_keys=True))
        return 0
    for task in report["tasks"]:
        status = "ok" if task["success"] else task.get("refused") and "refused" or "FAIL"
        detail = task.get("refused") or next((r["dropped"] for r in task["runs"] if "dropped" in r), "")
        print(f"{status:8s} {task['reward']:.2f}  {task['task_id']}" + (f"  ({detail})" if detail else ""))
    print(f"success rate {report['success_rate']:.3f} over {report['num_tasks']} tasks "
          f"(mean reward {report['mean_reward']:.3f}; agent {args.agent}, sandbox {args.sandbox})")
    return 0
