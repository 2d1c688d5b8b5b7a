"""One group of real executions, end to end: executor -> the real toolbox agent -> the proxy actor -> an engine
server over the embedded engine (tiny model) -> ModelCallCompleted -> trajectory builder; the evaluator with the
real toolbox scorer -> SamplesLanded whose token ids are the ones that came through the proxy.

The proxy is the real proxy actor (actors/serving/proxy.py: keys, routing, the OpenAI app); the rollout cell is a stand-in
that hosts the real engine server over the embedded engine and announces itself as a cell does. A driver actor
plays the micro-step claimer and the task source.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import attrs
import pytest
from aiohttp import web

from gyre.actors.executions.evaluator import Evaluator, EvaluatorConfig
from gyre.actors.executions.executor import Executor, ExecutorConfig
from gyre.actors.serving.proxy import Proxy, ProxyConfig
from gyre.actors.serving.http_app import ProxyHttpConfig
from gyre.actors.training.trajectory_builder import TrajectoryBuilder, TrajectoryBuilderConfig
from gyre.messages.cells import ROLLOUT, RoleChanged
from gyre.messages.executions import GroupDone, StartGroup, TaskSpec
from gyre.messages.model_calls import ModelCallCompleted
from gyre.messages.samples import ExecutionScored, SamplesLanded
from gyre.runtime import Actor, Codec, InProcessLauncher, RunOptions, Topology, handler, read_log

TOOLBOX = Path(__file__).resolve().parents[4] / "examples" / "toolbox"
MAX_CONTEXT_TOKENS = 2048


def load_toolbox(name: str) -> Any:
    """examples/toolbox/<name>.py under the private name the agent's own loader uses (nothing imports examples)."""
    qualified = f"_gyre_toolbox_{name}"
    if qualified not in sys.modules:
        spec = importlib.util.spec_from_file_location(qualified, TOOLBOX / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[qualified] = module
        spec.loader.exec_module(module)
    return sys.modules[qualified]


@attrs.frozen
class StandInCellConfig:
    model_dir: str


class StandInCell(Actor):
    """A rollout cell as far as the proxy can tell: the real engine server app over the embedded engine, announced
    with the RoleChanged a cell publishes. (The cell actor proper also trains and switches; none of that is needed
    here.)"""

    config_cls = StandInCellConfig

    async def on_start(self) -> None:
        from gyre.engines.async_engine import AsyncEngine
        from gyre.engines.embedded_engine import EmbeddedEngine, EngineConfig
        from gyre.engines.engine_server import build_engine_app

        engine_config = EngineConfig(num_blocks=512, max_context_tokens=MAX_CONTEXT_TOKENS, num_threads=1)
        self.engine = AsyncEngine(EmbeddedEngine(self.config.model_dir, engine_config))
        self.runner = web.AppRunner(build_engine_app(self.engine, None, model_path=self.config.model_dir),
                                    access_log=None)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"
        self.publish(RoleChanged(self.name, ROLLOUT, "", url, 0, 0.0, 0, False))

    async def on_stop(self) -> None:
        await self.runner.cleanup()
        await self.engine.close()


@attrs.frozen
class DriverConfig:
    group: StartGroup


class Driver(Actor):
    """Starts the group; as claimer and task source, waits for its samples and its GroupDone."""

    config_cls = DriverConfig

    async def on_start(self) -> None:
        self.tell("executor", self.config.group)

    @handler(SamplesLanded)
    def on_landed(self, msg: SamplesLanded) -> None:
        pass

    @handler(GroupDone)
    def on_done(self, msg: GroupDone) -> None:
        self.stop_topology("done")


def toolbox_spec(task: Any, agent_options: tuple[str, ...]) -> TaskSpec:
    """The TaskSpec mapping the topology file uses (see actors/executions/task_source.py)."""
    agent = load_toolbox("agent")
    return TaskSpec(
        task_id=task.task_id,
        prompt=task.prompt,
        workspace_files=dict(task.workspace_files),
        agent_argv=agent.agent_argv("")[:-1] + agent_options,
        scorer_argv=task.scorer_argv,
        timeout_s=120.0,
        scorer_timeout_s=30.0,
    )


@pytest.mark.timeout(300)
def test_one_group_through_agent_proxy_scorer_and_builder(tiny_model_dir: Path, tmp_path: Path) -> None:
    tasks = load_toolbox("tasks")
    (task,) = tasks.generate_tasks(seed=0, split="train", count=1, kinds=("write",))
    options = ("--max-tokens", "12", "--max-turns", "2", "--max-retries", "1", "--request-timeout-s", "120")
    group = StartGroup("g0", toolbox_spec(task, options), 2, 0)

    topology = Topology("execution-flow", seed=0)
    http = ProxyHttpConfig(model_names=("gyre",), max_context_tokens=MAX_CONTEXT_TOKENS)
    topology.add("proxy", Proxy, ProxyConfig(model_dir=str(tiny_model_dir), http=http))
    topology.add("cell-0", StandInCell, StandInCellConfig(str(tiny_model_dir)))
    topology.add("executor", Executor, ExecutorConfig(workspace_root=str(tmp_path / "executions"), max_concurrent=2))
    topology.add("evaluator", Evaluator, EvaluatorConfig())
    builder = TrajectoryBuilderConfig(claimer="driver", task_source="driver")
    topology.add("trajectory_builder", TrajectoryBuilder, builder)
    topology.add("driver", Driver, DriverConfig(group))
    log_path = tmp_path / "run.glog"
    result = InProcessLauncher().run(topology, RunOptions(log_path=str(log_path), until_s=240.0))
    assert result.reason == "done", result

    codec = Codec()
    calls: list[ModelCallCompleted] = []
    scores: list[ExecutionScored] = []
    landed: list[SamplesLanded] = []
    done: list[GroupDone] = []
    for record in read_log(log_path):
        receiver = record.envelope.receiver
        name = record.type_name.rsplit(".", 1)[-1]
        if name == "ModelCallCompleted" and receiver == "trajectory_builder":
            calls.append(record.decode(codec))
        elif name == "ExecutionScored" and receiver == "trajectory_builder":
            scores.append(record.decode(codec))
        elif name == "SamplesLanded":
            landed.append(record.decode(codec))
        elif name == "GroupDone":
            done.append(record.decode(codec))

    # Both executions ran the agent, which called the model through the proxy with its labels.
    assert {c.execution_id for c in calls} == {"g0.0", "g0.1"}
    assert all(c.agent_id == "main" and c.call_kind in ("turn", "summary") and c.cell == "cell-0" for c in calls)
    assert all(c.output_ids and len(c.output_logprobs) == len(c.output_ids) for c in calls)
    # The real scorer judged each workspace (no answer file from a random model: 0, or 0.2 for a stray write).
    assert sorted(s.execution_id for s in scores) == ["g0.0", "g0.1"]
    assert all(s.reward in (0.0, 0.2, 0.5, 1.0) for s in scores)

    assert done == [GroupDone("g0", True, pytest.approx(sum(s.reward for s in scores) / 2), done[0].success_rate, 2, 0,
                              done[0].work_tokens)]
    assert done[0].work_tokens > 0
    (samples,) = landed
    assert samples.group_id == "g0" and sorted(samples.execution_ids) == ["g0.0", "g0.1"]
    assert samples.samples and {s.execution_id for s in samples.samples} == {"g0.0", "g0.1"}
    # Every sample is (a prefix of) one call's prompt + output ids as the proxy produced them, and its loss tokens
    # are exactly output tokens of calls, with the behaviour log-probs the engine reported.
    by_call = {(c.execution_id, c.call_index): c for c in calls}
    # The records carry only the ids after the earlier call they extend: whole prompts rebuilt without the tree.
    from gyre.benchmarks.trajectories import full_prompts

    prompts = {(e, i): prompt for e in {c.execution_id for c in calls}
               for i, prompt in full_prompts([c for c in calls if c.execution_id == e]).items()}
    for sample in samples.samples:
        leaf = by_call[(sample.execution_id, sample.leaf_call_index)]
        path = prompts[(leaf.execution_id, leaf.call_index)] + leaf.output_ids
        assert sample.token_ids == path[: len(sample.token_ids)]
        emitted: dict[tuple[int, int], float] = {}
        for call in sorted(calls, key=lambda c: c.call_index):  # the tree keeps the earliest emitter's log-prob
            if call.execution_id != sample.execution_id:
                continue
            full = prompts[(call.execution_id, call.call_index)] + call.output_ids
            if sample.token_ids[: len(full)] == full[: len(sample.token_ids)]:
                for offset, logprob in enumerate(call.output_logprobs):
                    emitted.setdefault((call.prompt_tokens + offset, full[call.prompt_tokens + offset]), logprob)
        for position, (token, is_loss) in enumerate(zip(sample.token_ids, sample.loss_mask)):
            if is_loss:
                assert (position, token) in emitted
                assert sample.behaviour_logprobs[position] == pytest.approx(emitted[(position, token)])
    assert samples.num_tokens == sum(len(s.token_ids) for s in samples.samples)
    assert samples.num_loss_tokens == sum(sum(s.loss_mask) for s in samples.samples) > 0
