"""mini-swe-agent, unchanged, in the bubblewrap sandbox, calls the model through Gyre's real proxy (its key and
base URL from the executor, through the sandbox's forwarder) and every call is captured as ModelCallCompleted for
its execution; the verifier then scores the workspace. The model is the tiny one (its replies are noise, so the
agent stops at the step limit that its own configuration sets); the cell is the stand-in of test_execution_flow."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import attrs
import pytest
from aiohttp import web

from gyre.actors.eval_cli import MINI_SWE_AGENT_ENV
from gyre.actors.executions.evaluator import Evaluator, EvaluatorConfig
from gyre.actors.executions.executor import Executor, ExecutorConfig
from gyre.actors.executions.harbor import harbor_task_spec, load_harbor_task
from gyre.actors.executions.sandbox import SandboxConfig
from gyre.actors.serving.http_app import ProxyHttpConfig
from gyre.actors.serving.proxy import Proxy, ProxyConfig
from gyre.actors.training.trajectory_builder import TrajectoryBuilder, TrajectoryBuilderConfig
from gyre.messages.cells import ROLLOUT, RoleChanged
from gyre.messages.executions import GroupDone, StartGroup
from gyre.messages.samples import SamplesLanded
from gyre.runtime import Actor, Codec, InProcessLauncher, RunOptions, Topology, handler, read_log

SHIPPED = Path(__file__).resolve().parents[4] / "examples" / "tasks"
MAX_CONTEXT_TOKENS = 4096


@attrs.frozen
class StandInCellConfig:
    model_dir: str


class StandInCell(Actor):
    """The real engine server app over the embedded engine, announced as a rollout cell announces itself."""

    config_cls = StandInCellConfig

    async def on_start(self) -> None:
        from gyre.engines.async_engine import AsyncEngine
        from gyre.engines.embedded_engine import EmbeddedEngine, EngineConfig
        from gyre.engines.engine_server import build_engine_app

        engine_config = EngineConfig(num_blocks=1024, max_context_tokens=MAX_CONTEXT_TOKENS, num_threads=1)
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
    config_cls = DriverConfig

    async def on_start(self) -> None:
        self.tell("executor", self.config.group)

    @handler(SamplesLanded)
    def on_landed(self, msg: SamplesLanded) -> None:
        pass

    @handler(GroupDone)
    def on_done(self, msg: GroupDone) -> None:
        self.stop_topology("done")


@pytest.mark.skipif(shutil.which("mini") is None, reason="needs the PyPI package mini-swe-agent (.ci/setup)")
@pytest.mark.skipif(shutil.which("bwrap") is None or os.geteuid() != 0, reason="needs bwrap and root")
@pytest.mark.timeout(300)
def test_mini_swe_agent_calls_are_captured_through_the_proxy(tiny_model_dir: Path, tmp_path: Path) -> None:
    argv = (sys.executable, shutil.which("mini"), "--yolo", "--exit-immediately", "--model", "openai/gyre",
            # mini-swe-agent's own configuration: its default config, short replies, two steps.
            "-c", "mini.yaml", "-c", "model.model_kwargs.max_tokens=8", "-c", "agent.step_limit=2",
            "--output", "/tmp/mini.traj.json", "--task")
    spec = attrs.evolve(harbor_task_spec(load_harbor_task(SHIPPED / "fix-add"), argv), env=dict(MINI_SWE_AGENT_ENV))
    sandbox = SandboxConfig(kind="bubblewrap")
    topology = Topology("mini-swe-agent", seed=0)
    http = ProxyHttpConfig(model_names=("gyre",), max_context_tokens=MAX_CONTEXT_TOKENS)
    topology.add("proxy", Proxy, ProxyConfig(model_dir=str(tiny_model_dir), http=http))
    topology.add("cell-0", StandInCell, StandInCellConfig(str(tiny_model_dir)))
    topology.add("executor", Executor, ExecutorConfig(workspace_root=str(tmp_path / "executions"), sandbox=sandbox))
    topology.add("evaluator", Evaluator, EvaluatorConfig(sandbox=sandbox))
    topology.add("trajectory_builder", TrajectoryBuilder, TrajectoryBuilderConfig(claimer="driver",
                                                                                 task_source="driver"))
    topology.add("driver", Driver, DriverConfig(StartGroup("g0", spec, 1, 0)))
    log_path = tmp_path / "run.glog"
    result = InProcessLauncher().run(topology, RunOptions(log_path=str(log_path), until_s=240.0))
    assert result.reason == "done", result

    codec = Codec()
    calls, scored = [], []
    for record in read_log(log_path):
        name = record.type_name.rsplit(".", 1)[-1]
        if record.envelope.receiver == "trajectory_builder" and name == "ModelCallCompleted":
            calls.append(record.decode(codec))
        elif record.envelope.receiver == "trajectory_builder" and name == "ExecutionScored":
            scored.append(record.decode(codec))
    assert calls and {c.execution_id for c in calls} == {"g0.0"}
    assert all(c.prompt_tokens and c.output_ids and len(c.output_logprobs) == len(c.output_ids) for c in calls)
    assert [s.reward for s in scored] == [0.0]  # noise did not fix calc.py; the verifier judged the workspace
