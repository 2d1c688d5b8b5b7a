"""Held-out evaluation: run the example agent on tasks against a model directory and score each workspace.

The same parts as training, minus the training: the proxy's HTTP app over the embedded engine, the real agent
program with the `openai` SDK, the task's scorer. Decoding is greedy by default, so a model's success rate is a
property of its weights, not of a sampling draw. Each task is its own execution with its own API key.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import secrets
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

    def to_json(self) -> dict[str, Any]:
        return attrs.asdict(self)


def _make_app_factory(model_dir: str, keys: dict[str, str], max_context_tokens: int):
    async def make_app():
        from gyre.actors.engine_backend import EmbeddedBackend
        from gyre.actors.proxy_http import ProxyHttpConfig, build_proxy_app
        from gyre.actors.proxy_sessions import ProxySessions, ProxySessionsConfig
        from gyre.engines.async_engine import AsyncEngine
        from gyre.engines.chat_template import ChatTemplate
        from gyre.engines.embedded_engine import EmbeddedEngine, EngineConfig

        template = ChatTemplate.from_model_dir(model_dir)
        engine = AsyncEngine(EmbeddedEngine(model_dir, EngineConfig(max_context_tokens=max_context_tokens)))
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


def _run_one(task: Any, key: str, base_url: str, temperature: float, timeout_s: float, root: Path) -> TaskOutcome:
    started = time.perf_counter()
    workspace = tasks_module.write_workspace(task, root / task.task_id)
    env = dict(os.environ, OPENAI_BASE_URL=f"{base_url}/v1", OPENAI_API_KEY=key, GYRE_MODEL="gyre")
    argv = [*agent_argv(task.prompt), "--temperature", str(temperature)]
    try:
        agent = subprocess.run(argv, cwd=workspace, env=env, capture_output=True, timeout=timeout_s)
        exit_code = agent.returncode
    except subprocess.TimeoutExpired:
        exit_code = -9  # scored on what the workspace holds, as in training
    scored = subprocess.run(list(task.scorer_argv), cwd=workspace, capture_output=True, timeout=60)
    verdict = json.loads(scored.stdout or b"{}") if scored.returncode == 0 else {"reward": 0.0, "success": False}
    return TaskOutcome(task.task_id, task.kind, float(verdict.get("reward", 0.0)), bool(verdict.get("success")),
                       exit_code, time.perf_counter() - started)


def evaluate(
    model_dir: str | Path,
    tasks: Sequence[Any],
    *,
    concurrency: int = 4,
    temperature: float = 0.0,
    timeout_s: float = 120.0,
    max_context_tokens: int = 4096,
) -> EvalResult:
    """Run every task once against `model_dir`; greedy unless `temperature` > 0."""
    from gyre.actors.proxy_http import ServedApp

    started = time.perf_counter()
    keys = {f"eval-{i}": secrets.token_hex(16) for i in range(len(tasks))}
    factory = _make_app_factory(str(model_dir), keys, max_context_tokens)
    with ServedApp(factory) as served, tempfile.TemporaryDirectory(prefix="gyre-eval-") as root:
        with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
            futures = [
                pool.submit(_run_one, task, keys[f"eval-{i}"], served.base_url, temperature, timeout_s, Path(root))
                for i, task in enumerate(tasks)
            ]
            outcomes = tuple(f.result() for f in futures)
    count = max(1, len(outcomes))
    return EvalResult(
        success_rate=sum(o.success for o in outcomes) / count,
        mean_reward=sum(o.reward for o in outcomes) / count,
        outcomes=outcomes,
        seconds=time.perf_counter() - started,
    )


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
