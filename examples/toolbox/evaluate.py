"""Held-out evaluation: run the example agent on tasks against a model directory and score each workspace.

The same parts as training, minus the training: the proxy's HTTP app over the embedded engine, the real agent
program with the `openai` SDK, the task's scorer. Decoding is greedy by default, so a model's success rate is a
property of its weights, not of a sampling draw. Each task is its own execution with its own API key.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

import attrs

sys.path.insert(0, str(Path(__file__).resolve().parent))
from agent import agent_argv, load_sibling  # noqa: E402

tasks_module = load_sibling("tasks")
AGENT_PRELOAD = ("openai", "structlog", "gyre.actors.executions.sdk_warmup:openai_client",
                 str(Path(__file__).resolve().with_name("agent.py")))
"""What the warm launcher imports (and warms up) once for every toolbox agent it forks: the SDK, and agent.py itself
by path, whose import loads its siblings (prompts, tools) and argparse, so that each agent runs only its own
module body (~4.5 CPU-ms less an agent; BENCHMARKS.md, session 26)."""
SCORER_PRELOAD = tasks_module.SCORER_PRELOAD


@attrs.frozen
class TaskOutcome:
    """One held-out task's result."""

    task_id: str
    kind: str
    reward: float
    success: bool
    agent_exit_code: int
    seconds: float


@attrs.frozen
class EvalResult:
    """A model's held-out score."""

    success_rate: float
    mean_reward: float
    outcomes: tuple[TaskOutcome, ...]
    seconds: float

    @classmethod
    def of(cls, outcomes: Sequence[TaskOutcome], seconds: float) -> "EvalResult":
        """The success rate and mean reward over `outcomes` (0 for none)."""
        count = max(1, len(outcomes))
        return cls(success_rate=sum(o.success for o in outcomes) / count,
                   mean_reward=sum(o.reward for o in outcomes) / count, outcomes=tuple(outcomes), seconds=seconds)

    def to_json(self) -> dict[str, Any]:
        return attrs.asdict(self)

    def success_by_kind(self) -> dict[str, float]:
        """Success rate of each task kind, in the order the kinds first appear among the outcomes."""
        wins: dict[str, list[bool]] = {}
        for outcome in self.outcomes:
            wins.setdefault(outcome.kind, []).append(outcome.success)
        return {kind: sum(kind_wins) / len(kind_wins) for kind, kind_wins in wins.items()}


def _make_app_factory(model_dir: str, keys: dict[str, str], max_context_tokens: int, kv_blocks: int,
                      max_running_requests: int):
    async def make_app():
        from gyre.actors.serving.backends import EmbeddedBackend
        from gyre.actors.serving.http_app import ProxyHttpConfig, build_proxy_app
        from gyre.actors.serving.sessions import ProxySessions, ProxySessionsConfig
        from gyre.engines.async_engine import AsyncEngine
        from gyre.engines.chat_template import ChatTemplate
        from gyre.engines.embedded_engine import EmbeddedEngine, EngineConfig

        template = ChatTemplate.from_model_dir(model_dir)
        engine = AsyncEngine(EmbeddedEngine(model_dir, EngineConfig(
            max_context_tokens=max_context_tokens, num_blocks=kv_blocks, max_running_requests=max_running_requests)))
        sessions = ProxySessions(template, ProxySessionsConfig(max_executions=max(1, len(keys))))
        for execution_id, key in keys.items():
            sessions.issue_key(execution_id, "held-out", api_key=key)
        config = ProxyHttpConfig(model_names=("gyre",), max_context_tokens=max_context_tokens)
        app = build_proxy_app(config, sessions, EmbeddedBackend(engine, cell="eval"), lambda _: None, clock=time.time)

        async def close(_: Any) -> None:
            await engine.close()

        app.on_cleanup.append(close)
        return app

    return make_app


def _agent_env(base_url: str, key: str) -> dict[str, str]:
    return dict(os.environ, OPENAI_BASE_URL=f"{base_url}/v1", OPENAI_API_KEY=key, GYRE_MODEL="gyre")


async def _run_one(task: Any, key: str, base_url: str, temperature: float, timeout_s: float, root: Path,
                   launcher: Any) -> TaskOutcome:
    """One attempt at `task`; `root` is this attempt's own folder."""
    from gyre.actors.executions.process_groups import signal_process_group, stop_process_group

    started = time.perf_counter()
    workspace = tasks_module.write_workspace(task, root / "workspace")
    logs = root / "logs"  # beside the workspace: the scorer judges only what the agent wrote
    logs.mkdir()
    env = _agent_env(base_url, key)
    argv = [*agent_argv(task.prompt), "--temperature", str(temperature)]
    stdout, stderr = logs / "agent.stdout.log", logs / "agent.stderr.log"
    if launcher.alive and launcher.accepts(argv, workspace, env):
        process = await launcher.launch(argv, workspace, env, stdout, stderr)
    else:
        with open(stdout, "wb") as out, open(stderr, "wb") as err:
            process = await asyncio.create_subprocess_exec(*argv, cwd=workspace, env=env, stdin=subprocess.DEVNULL,
                                                           stdout=out, stderr=err, start_new_session=True)
    try:
        exit_code = await asyncio.wait_for(process.wait(), timeout_s)
    except asyncio.TimeoutError:
        await stop_process_group(process, grace_s=2.0)
        exit_code = -9  # scored on what the workspace holds, as in training
    signal_process_group(process.pid, signal.SIGKILL)  # tool processes the agent left behind
    scored = await _run_scorer(task, workspace, logs, launcher)
    verdict = json.loads(scored or b"{}") if scored is not None else {"reward": 0.0, "success": False}
    return TaskOutcome(task.task_id, task.kind, float(verdict.get("reward", 0.0)), bool(verdict.get("success")),
                       exit_code, time.perf_counter() - started)


async def _run_scorer(task: Any, workspace: Path, logs: Path, launcher: Any) -> bytes | None:
    """The scorer's stdout, or None if it failed (non-zero exit, or over 60 s). Forked from the agents' warm
    launcher when it can be (a fresh `python -S score.py` costs ~0.04 CPU-s, a fork ~0.01:
    benchmarks/studies/scorer_launch.py); exec'd as before once that launcher has died."""
    from gyre.actors.executions.process_groups import signal_process_group, stop_process_group
    from gyre.actors.executions.warm_launcher import LauncherClosed, LauncherDied

    argv, env = list(task.scorer_argv), dict(os.environ)
    process = None
    if launcher.alive and launcher.accepts(argv, workspace, env):
        stdout = logs / "scorer.stdout.log"
        try:
            process = await launcher.launch(argv, workspace, env, stdout, logs / "scorer.stderr.log")
        except (LauncherDied, LauncherClosed):
            pass
    if process is not None:
        try:
            code = await asyncio.wait_for(process.wait(), 60)
        except asyncio.TimeoutError:
            await stop_process_group(process, grace_s=2.0)
            return None
        signal_process_group(process.pid, signal.SIGKILL)
        return stdout.read_bytes() if code == 0 else None
    scorer = await asyncio.create_subprocess_exec(*argv, cwd=workspace, stdout=subprocess.PIPE,
                                                  stderr=subprocess.DEVNULL)
    try:
        scored, _ = await asyncio.wait_for(scorer.communicate(), 60)
    except asyncio.TimeoutError:
        scorer.kill()
        await scorer.wait()
        return None
    return scored if scorer.returncode == 0 else None


@attrs.frozen
class _Attempt:
    """One run of the agent at one task: which pass it belongs to, and that pass's sampling temperature."""

    task: Any
    pass_index: int
    temperature: float
    key: str


async def _run_all(attempts: Sequence[_Attempt], base_url: str, timeout_s: float, root: Path,
                   concurrency: int) -> tuple[TaskOutcome, ...]:
    """Every attempt, at most `concurrency` at once. Agents are forked from a warm launcher that imported openai once
    (gyre.actors.executions.warm_launcher): the import costs ~2 CPU-s per fresh process, more than a short task's model calls."""
    from gyre.actors.executions.warm_launcher import WarmLauncher

    launcher = WarmLauncher()
    await launcher.start(AGENT_PRELOAD)
    slots = asyncio.Semaphore(concurrency)

    async def one(attempt: _Attempt) -> TaskOutcome:
        async with slots:
            folder = root / f"pass-{attempt.pass_index}" / attempt.task.task_id
            return await _run_one(attempt.task, attempt.key, base_url, attempt.temperature, timeout_s, folder,
                                  launcher)

    try:
        return tuple(await asyncio.gather(*(one(attempt) for attempt in attempts)))
    finally:
        await launcher.close()


def evaluate_passes(
    model_dir: str | Path,
    tasks: Sequence[Any],
    temperatures: Sequence[float],
    *,
    concurrency: int = 64,
    timeout_s: float = 120.0,
    max_context_tokens: int = 4096,
    kv_blocks: int = 0,
) -> tuple[EvalResult, ...]:
    """One pass over every task for each of `temperatures` (0: greedy), all passes pooled on one engine.

    Pooled rather than one pass after another: on 2 cores an engine step of 64 requests of the tiny model costs
    little more than one of 16, so the throughput rises with the agents at once. A greedy pass over 96 held-out
    tasks took 97 s at 16 agents, 70 s at 32 and 53 s at 64, every task's outcome the same (BENCHMARKS.md,
    session 15). The engine gets room for them: a decode batch of `concurrency` (64 at least) and `kv_blocks`
    (0: 128 blocks, 2,048 tokens, an agent, 2,048 at least). Over 224 tasks at 64 agents, 2,048 blocks took
    157 s and 8,192 took 116 s. Pooling also keeps the tail of one pass from running alone. Sampled passes draw
    their seeds from one engine's seed stream, so two passes at a temperature are two independent draws (fresh
    engines, one a pass, would hand both the same stream). Each result's `seconds` is the pooled wall time."""
    from gyre.actors.serving.http_app import ServedApp

    started = time.perf_counter()
    attempts = [_Attempt(task, index, temperature, secrets.token_hex(16))
                for index, temperature in enumerate(temperatures) for task in tasks]
    keys = {f"eval-{i}": attempt.key for i, attempt in enumerate(attempts)}
    kv_blocks = kv_blocks or max(2048, 128 * concurrency)
    factory = _make_app_factory(str(model_dir), keys, max_context_tokens, kv_blocks, max(64, concurrency))
    with ServedApp(factory) as served, tempfile.TemporaryDirectory(prefix="gyre-eval-") as root:
        outcomes = asyncio.run(_run_all(attempts, served.base_url, timeout_s, Path(root), concurrency))
    seconds = time.perf_counter() - started
    per_pass = len(tasks)
    return tuple(EvalResult.of(outcomes[i * per_pass:(i + 1) * per_pass], seconds) for i in range(len(temperatures)))


def evaluate(
    model_dir: str | Path,
    tasks: Sequence[Any],
    *,
    concurrency: int = 64,
    temperature: float = 0.0,
    timeout_s: float = 120.0,
    max_context_tokens: int = 4096,
    kv_blocks: int = 0,
) -> EvalResult:
    """Run every task once against `model_dir`; greedy unless `temperature` > 0 (see evaluate_passes)."""
    return evaluate_passes(model_dir, tasks, (temperature,), concurrency=concurrency, timeout_s=timeout_s,
                           max_context_tokens=max_context_tokens, kv_blocks=kv_blocks)[0]


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="held-out success rate of a model directory")
    parser.add_argument("model_dir")
    parser.add_argument("--tasks", type=int, default=14)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    held_out = tasks_module.generate_tasks(args.seed, "heldout", args.tasks)
    result = evaluate(args.model_dir, held_out)
    print(json.dumps({"success_rate": result.success_rate, "mean_reward": result.mean_reward,
                      "seconds": round(result.seconds, 1)}))
