"""`gyre eval TASKS --agent NAME [--model DIR [--engine-url URL] | --model-url URL] [--sandbox bubblewrap|none]
[--report DIR] [--json]`: run an agent on every task of a task set (Harbor task directories or SWE-bench-style
instances; no training) and report the success rate, each task's outcome, its tokens and its time, and (--report)
a picture.

It composes the executions wing (executor, evaluator) with a driver that plays the parts the executor and evaluator
talk to: the task source (one StartGroup of size `--attempts` per task), the trajectory builder (it collects
ExecutionScored / ExecutionDropped, and the ModelCallCompleted of the proxy) and, without a model, the key issuer
(the built-in agents need no model, so the key it hands out leads nowhere: the sandbox has no network but the
proxy). It lives at the top of actors/ because no wing imports another.

With `--model DIR` the agent's model is served through Gyre, as in training: the serving wing's proxy (each
execution its own key, every call captured token-in/token-out) in front of one engine server, Gyre's own
(`--engine-preset gyre`, CPU) or SGLang (`--engine-preset sglang`, a GPU node), which the eval launches as a child
process with the run's engine key and stops at the end; or, with `--engine-url URL`, a server already running
there. The proxy sends that server the key in `--engine-api-key-file PATH` (the --api-key SGLang was started
with), or else the run's engine token (as to any in-run server: fine for a server that checks no key). The driver starts the tasks once the engine answers /health. Each task's tokens (calls, prompt, output and cached prompt tokens) come from those calls. With
`--model-url URL` instead, agents call an OpenAI-compatible server directly (no key, nothing captured: no tokens).

Agents (gyre.actors.executions.agents): `oracle` (each task's reference solution), `noop` (does nothing: a task
set's verifiers must give it 0), `mini-swe-agent` (the PyPI package's `mini`, unchanged, its litellm model
`openai/<--model-name>`; `--agent-option KEY=VALUE` sets its own configuration), an agent spec file (`*.toml`:
command and the variables that carry the proxy's URL and key) or a command line, run in the task's workdir with the
instruction appended as its last argument.

A task counts as a success when every attempt's reward is >= 1 (Harbor's "resolved"); a dropped execution (the
verifier crashed or hung) is reported as such and counts as a failure in the success rate, which is over all tasks.
A task's time is from its first agent's launch to its last outcome (`wall_s`: agents and verifiers) and the
agents' own run time (`agent_s`, the longest attempt).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import attrs

from gyre.actors.cells.engine_process import PRESETS, EngineProcess, EngineServerConfig, free_port, server_command
from gyre.actors.executions.evaluator import Evaluator, EvaluatorConfig
from gyre.actors.executions.executor import Executor, ExecutorConfig
from gyre.actors.executions.agents import BUILTIN_AGENTS, MINI_SWE_AGENT_ENV, task_set_specs
from gyre.actors.executions.harbor import HarborTaskError
from gyre.actors.executions.sandbox import SANDBOX_KINDS, SandboxConfig
from gyre.actors.serving.http_app import ProxyHttpConfig
from gyre.actors.serving.proxy import Proxy, ProxyConfig
from gyre.actors.serving.routing import RoutingConfig
from gyre.engines.embedded_engine import EngineConfig
from gyre.engines.sglang_client import ClientConfig
from gyre.messages.cells import ROLLOUT, RoleChanged
from gyre.messages.executions import IssueKey, KeyIssued, RevokeKey, StartGroup, TaskSpec
from gyre.messages.groups import GroupStarted
from gyre.messages.model_calls import ModelCallCompleted
from gyre.messages.samples import ExecutionDropped, ExecutionScored
from gyre.runtime import Actor, Codec, InProcessLauncher, RunOptions, Topology, handler, read_log
from gyre.runtime.logs import configure_logging
from gyre.runtime.run_secrets import run_token
from gyre.runtime.validators import count, positive

__all__ = ["BUILTIN_AGENTS", "EvalDriver", "EvalDriverConfig", "EvalEngine", "EvalEngineConfig", "MINI_SWE_AGENT_ENV",
           "agent_task_specs", "register", "run_eval", "write_report"]

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
    wait_for_engine: bool = False
    """Start the tasks only once a rollout engine is announced (RoleChanged): a model served through the proxy."""


class EvalDriver(Actor):
    """Task source, key issuer and result collector of an eval run (module docstring)."""

    config_cls = EvalDriverConfig
    subscriptions = (GroupStarted, RoleChanged, ModelCallCompleted)

    async def on_start(self) -> None:
        self.waiting = len(self.config.tasks) * self.config.attempts
        self.started = False
        if not self.config.wait_for_engine:
            self._start_tasks()

    def _start_tasks(self) -> None:
        self.started = True
        for index, task in enumerate(self.config.tasks):
            self.tell("executor", StartGroup(f"eval{index:05d}", task, self.config.attempts, 0))

    @handler(RoleChanged)
    def on_role_changed(self, msg: RoleChanged) -> None:
        if msg.role == ROLLOUT and msg.engine_url and not self.started:
            self._start_tasks()

    @handler(ModelCallCompleted)
    def on_call(self, msg: ModelCallCompleted) -> None:
        pass  # recorded in the event log, which the report reads

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


@attrs.frozen
class EvalEngineConfig:
    """The engine server an eval serves its model from (module docstring)."""

    model_dir: str
    """The model (an HF directory)."""
    engine_url: str = ""
    """A server already running there; "" launches one."""
    preset: str = attrs.field(default="gyre", validator=attrs.validators.in_(PRESETS))
    """The server launched: Gyre's engine server or SGLang."""
    engine: EngineConfig = EngineConfig()
    """Sizes of Gyre's engine server (its command-line flags)."""
    startup_timeout_s: float = attrs.field(default=300.0, validator=positive)
    """How long the server may take to answer /health (a large model on a GPU loads for minutes)."""


class EvalEngine(Actor):
    """Launches (or finds) the engine server, waits for /health, announces it as a rollout engine, stops it."""

    config_cls = EvalEngineConfig

    async def on_start(self) -> None:
        from gyre.engines.sglang_client import SGLangClient

        config = self.config
        self.process: EngineProcess | None = None
        url = config.engine_url.rstrip("/")
        if not url:
            port = free_port("127.0.0.1")
            server = EngineServerConfig(preset=config.preset, startup_timeout_s=config.startup_timeout_s)
            command = server_command(server, config.model_dir, "127.0.0.1", port, config.engine)
            self.process = EngineProcess.for_key(command, run_token("engine"), server)
            await self.process.launch()
            url = f"http://127.0.0.1:{port}"
        client = SGLangClient(url)
        try:
            deadline = self.clock.now() + config.startup_timeout_s
            while not await client.health():
                if self.process is not None and self.process.exit_code is not None:
                    raise RuntimeError(f"the engine server exited ({self.process.exit_code}) before it was healthy: "
                                       + " | ".join(self.process.last_output()[-5:]))
                if self.clock.now() > deadline:
                    raise RuntimeError(f"the engine server at {url} did not answer /health within "
                                       f"{config.startup_timeout_s} s")
                await asyncio.sleep(0.2)
        finally:
            await client.close()
        self.log.info("eval_engine_ready", url=url, launched=self.process is not None)
        self.publish(RoleChanged(self.name, ROLLOUT, "", url, 0, 0.0, 0, False))

    async def on_stop(self) -> None:
        if self.process is not None:
            await self.process.stop()


def run_eval(task_dir: str | Path, agent: str, sandbox: str = "bubblewrap", *, attempts: int = 1,
             max_concurrent: int = 4, workspace_root: str = "", log_path: str = "", model_url: str = "",
             model_name: str = "gyre", model_dir: str = "", engine_url: str = "", engine_preset: str = "gyre",
             max_context_tokens: int = 8192, agent_options: tuple[str, ...] = (),
             engine_api_key_file: str | None = None) -> dict[str, Any]:
    """Run `agent` on the task set; {"success_rate", "mean_reward", "tasks": [{task_id, reward, success, tokens,
    wall_s, agent_s, ...}], ...}. With `model_dir` the model is served through the proxy (module docstring)."""
    if engine_url and not model_dir:
        raise ValueError("--engine-url needs --model (the proxy tokenises with the model's tokenizer)")
    if engine_api_key_file and not engine_url:
        raise ValueError("--engine-api-key-file needs --engine-url (a server the eval launches gets the run's key)")
    if model_dir and model_url:
        raise ValueError("--model serves the model through Gyre; --model-url calls a server directly: not both")
    specs = agent_task_specs(task_dir, agent, model_name, agent_options)
    with tempfile.TemporaryDirectory(prefix="gyre-eval-") as scratch:
        log_file = log_path or str(Path(scratch) / "eval.glog")
        root = workspace_root or str(Path(scratch) / "executions")
        sandbox_config = SandboxConfig(kind=sandbox)
        topology = Topology("eval", seed=0)
        topology.add("executor", Executor, ExecutorConfig(
            workspace_root=root, proxy="proxy" if model_dir else "driver", evaluator="evaluator", builder="driver",
            max_concurrent=max_concurrent, sandbox=sandbox_config))
        topology.add("evaluator", Evaluator, EvaluatorConfig(builder="driver", max_concurrent=max_concurrent,
                                                             sandbox=sandbox_config))
        topology.add("driver", EvalDriver, EvalDriverConfig(specs, attempts, model_url, wait_for_engine=bool(model_dir)))
        limit_s = sum(s.timeout_s + s.scorer_timeout_s for s in specs) * attempts + 60.0
        if model_dir:
            # Room for every execution at once at the longest context (the engine refuses a context it can never
            # hold); the proxy checks max_context_tokens against the model's max_position_embeddings at start.
            blocks = max(1024, max_concurrent * -(-max_context_tokens // 16))
            engine = EngineConfig(num_blocks=blocks, max_context_tokens=max_context_tokens,
                                  max_running_requests=max(2 * max_concurrent, 8), num_threads=1)
            topology.add("engine", EvalEngine, EvalEngineConfig(model_dir, engine_url, engine_preset, engine))
            http = ProxyHttpConfig(model_names=(model_name,), max_context_tokens=max_context_tokens)
            routing = RoutingConfig(client=ClientConfig(api_key_file=engine_api_key_file))
            topology.add("proxy", Proxy, ProxyConfig(model_dir=model_dir, http=http, routing=routing))
            limit_s += 300.0  # the engine's start
        result = InProcessLauncher().run(topology, RunOptions(log_path=log_file, until_s=limit_s))
        report = _report(specs, attempts, log_file, result.reason)
        report.update(agent=agent, sandbox=sandbox, model=model_dir or model_url or "", tasks_dir=str(task_dir))
        return report


def _report(specs: tuple[TaskSpec, ...], attempts: int, log_file: str, reason: str) -> dict[str, Any]:
    codec = Codec()
    by_group = {f"eval{i:05d}": spec.task_id for i, spec in enumerate(specs)}
    outcomes: dict[str, list[dict[str, Any]]] = {spec.task_id: [] for spec in specs}
    refused: dict[str, str] = {}
    tokens = {spec.task_id: {"calls": 0, "prompt": 0, "output": 0, "cached": 0} for spec in specs}
    agent_s = {spec.task_id: 0.0 for spec in specs}
    started_s: dict[str, float] = {}
    ended_s: dict[str, float] = {}
    for record in read_log(log_file):
        name = record.type_name.rsplit(".", 1)[-1]
        receiver = record.envelope.receiver
        if receiver == "executor" and name in ("AgentLaunched", "AgentExited"):
            msg = record.decode(codec)
            task_id = by_group.get(msg.execution_id.rsplit(".", 1)[0])
            if task_id is None:
                continue
            if name == "AgentLaunched":  # the first attempt's launch: time waiting for a slot is not the task's
                started_s.setdefault(task_id, record.handled_s)
            else:
                agent_s[task_id] = max(agent_s[task_id], msg.wall_s)
            continue
        if receiver != "driver" or name not in ("ExecutionScored", "ExecutionDropped", "GroupStarted",
                                                "ModelCallCompleted"):
            continue
        msg = record.decode(codec)
        task_id = by_group.get(msg.group_id)
        if task_id is None:
            continue
        if name == "ModelCallCompleted":
            counts = tokens[task_id]
            counts["calls"] += 1
            counts["prompt"] += msg.prompt_tokens
            counts["output"] += len(msg.output_ids)
            counts["cached"] += msg.cached_tokens
            continue
        if name == "ExecutionScored":
            outcomes[task_id].append({"reward": msg.reward, "agent_timed_out": msg.timed_out, "detail": msg.detail})
        elif name == "ExecutionDropped":
            outcomes[task_id].append({"reward": None, "dropped": msg.reason})
        elif msg.refused:
            refused[task_id] = msg.refused
        if name != "GroupStarted" or msg.refused:
            ended_s[task_id] = record.handled_s
    tasks = []
    for spec in specs:
        runs = outcomes[spec.task_id]
        rewards = [r["reward"] for r in runs if r["reward"] is not None]
        entry: dict[str, Any] = {
            "task_id": spec.task_id,
            "reward": sum(rewards) / attempts if rewards else 0.0,
            "success": bool(runs) and len(rewards) == attempts and all(r >= 1.0 for r in rewards),
            "runs": runs,
            "tokens": tokens[spec.task_id],
            "agent_s": round(agent_s[spec.task_id], 3),
            "wall_s": round(ended_s[spec.task_id] - started_s[spec.task_id], 3)
            if spec.task_id in ended_s and spec.task_id in started_s else None,
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
        "tokens": {key: sum(t["tokens"][key] for t in tasks) for key in ("calls", "prompt", "output", "cached")},
        "ended": reason,
        "tasks": tasks,
    }


def write_report(report: dict[str, Any], directory: str | Path) -> Path:
    """report.json and eval.png (one bar a task: its time, coloured by outcome, with its reward and tokens) in
    `directory`; returns the picture's path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "report.json").write_text(json.dumps(report, indent=1, sort_keys=True))
    tasks = report["tasks"]
    colours = ["tab:green" if t["success"] else "tab:gray" if t.get("refused") or any("dropped" in r for r in
               t["runs"]) else "tab:red" for t in tasks]
    height = max(2.5, 0.32 * len(tasks) + 1.4)
    figure, (times, rewards) = plt.subplots(1, 2, figsize=(11, height), sharey=True,
                                            gridspec_kw={"width_ratios": [3, 1]})
    rows = range(len(tasks))
    times.barh(rows, [t["wall_s"] or 0.0 for t in tasks], color=colours, alpha=0.45, label="task (launch to score)")
    times.barh(rows, [t["agent_s"] for t in tasks], color=colours, label="agent")
    for row, task in zip(rows, tasks):
        used = task["tokens"]
        if used["calls"]:
            times.text((task["wall_s"] or 0.0), row, f" {used['calls']} calls, {used['prompt']}+{used['output']} tok",
                       va="center", fontsize=7)
    times.set_yticks(list(rows), [t["task_id"] for t in tasks], fontsize=8)
    times.invert_yaxis()
    times.set_xlabel("seconds (dark: the agent; light: until scored)")
    rewards.barh(rows, [t["reward"] for t in tasks], color=colours)
    rewards.set_xlim(0, 1.05)
    rewards.set_xlabel("reward")
    figure.suptitle(f"gyre eval: {report.get('agent', '')} on {Path(report.get('tasks_dir', '')).name}: success "
                    f"{report['success_rate']:.2f} of {report['num_tasks']} (green: success, red: failed, grey: "
                    "dropped or refused)", fontsize=9)
    figure.tight_layout()
    picture = folder / "eval.png"
    figure.savefig(picture, dpi=110)
    plt.close(figure)
    return picture


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("eval", help="run an agent on a task set (Harbor or SWE-style; no training) and "
                                   "report")
    parser.add_argument("tasks", help="a Harbor task directory or SWE-bench-style instance, or a directory of them")
    parser.add_argument("--agent", default="oracle",
                        help="oracle (each task's solution), noop, mini-swe-agent, an agent spec file (*.toml), or a "
                        "command line")
    parser.add_argument("--agent-option", action="append", default=[], metavar="KEY=VALUE",
                        help="mini-swe-agent: a setting of its own configuration (repeatable)")
    parser.add_argument("--sandbox", choices=SANDBOX_KINDS, default="bubblewrap")
    parser.add_argument("--attempts", type=int, default=1, help="executions per task")
    parser.add_argument("--max-concurrent", type=int, default=4, help="executions (and verifiers) at once")
    parser.add_argument("--model", default="", metavar="DIR",
                        help="serve this model (an HF directory) through Gyre's proxy: tokens captured per task")
    parser.add_argument("--engine-url", default="",
                        help="with --model: an engine server already running there (its key: --engine-api-key-file); "
                        "default: launch one")
    parser.add_argument("--engine-api-key-file", default=None, metavar="PATH",
                        help="with --engine-url: the file holding that server's key (SGLang's --api-key)")
    parser.add_argument("--engine-preset", choices=PRESETS, default="gyre",
                        help="with --model: the server launched (gyre: CPU; sglang: a GPU node)")
    parser.add_argument("--max-context-tokens", type=int, default=8192, help="with --model: prompt + output bound")
    parser.add_argument("--model-url", default="",
                        help="instead of --model: an OpenAI-compatible base URL (…/v1) agents call directly")
    parser.add_argument("--model-name", default="gyre", help="the model name agents ask for")
    parser.add_argument("--report", default="", metavar="DIR", help="write report.json and eval.png there")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.set_defaults(func=_command)


def _command(args: argparse.Namespace) -> int:
    if "GYRE_LOG_LEVEL" not in os.environ:  # a report, not a run log: only problems are worth a line
        configure_logging("warning")
    if args.attempts < 1 or args.max_concurrent < 1 or args.max_context_tokens < 1:
        print("gyre eval: --attempts, --max-concurrent and --max-context-tokens must be >= 1", file=sys.stderr)
        return 2
    if args.model and not (Path(args.model) / "config.json").is_file():
        print(f"gyre eval: --model {args.model}: no config.json there (an HF model directory)", file=sys.stderr)
        return 2
    try:
        report = run_eval(args.tasks, args.agent, args.sandbox, attempts=args.attempts,
                          max_concurrent=args.max_concurrent, model_url=args.model_url, model_name=args.model_name,
                          model_dir=args.model, engine_url=args.engine_url, engine_preset=args.engine_preset,
                          max_context_tokens=args.max_context_tokens, agent_options=tuple(args.agent_option),
                          engine_api_key_file=args.engine_api_key_file)
    except (HarborTaskError, ValueError, OSError) as error:
        print(f"gyre eval: {error}", file=sys.stderr)
        return 2
    picture = write_report(report, args.report) if args.report else None
    if args.json:
        print(json.dumps(report, sort_keys=True))
        return 0
    for task in report["tasks"]:
        status = "ok" if task["success"] else task.get("refused") and "refused" or "FAIL"
        detail = task.get("refused") or next((r["dropped"] for r in task["runs"] if "dropped" in r), "")
        used = task["tokens"]
        cost = f"{task['wall_s'] or 0.0:6.1f} s" + (f"  {used['prompt']}+{used['output']} tokens in {used['calls']} "
                                                    "calls" if used["calls"] else "")
        print(f"{status:8s} {task['reward']:.2f}  {task['task_id']:32s} {cost}" + (f"  ({detail})" if detail else ""))
    print(f"success rate {report['success_rate']:.3f} over {report['num_tasks']} tasks "
          f"(mean reward {report['mean_reward']:.3f}; agent {args.agent}, sandbox {args.sandbox})")
    if picture is not None:
        print(f"report: {picture} and {picture.parent / 'report.json'}")
    return 0
