"""A command-line agent described only by a spec file (its command and the variables that carry the proxy's URL
and the key, here names of its own) runs unchanged in the bubblewrap sandbox and calls Gyre's real proxy with the
real openai and anthropic SDKs; every call is captured token-in/token-out as ModelCallCompleted for its execution,
and without X-Gyre-* labels the trajectory builder groups them by inferred chains into the group's samples."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import attrs
import pytest
from aiohttp import web

from gyre.actors.executions.agents import load_agent_spec, spec_argv
from gyre.actors.executions.evaluator import Evaluator, EvaluatorConfig
from gyre.actors.executions.executor import Executor, ExecutorConfig
from gyre.actors.executions.sandbox import SandboxConfig
from gyre.actors.serving.http_app import ProxyHttpConfig
from gyre.actors.serving.proxy import Proxy, ProxyConfig
from gyre.actors.training.trajectory_builder import TrajectoryBuilder, TrajectoryBuilderConfig
from gyre.messages.cells import ROLLOUT, RoleChanged
from gyre.messages.executions import GroupDone, StartGroup, TaskSpec
from gyre.messages.samples import SamplesLanded
from gyre.runtime import Actor, Codec, InProcessLauncher, RunOptions, Topology, handler, read_log

MAX_CONTEXT_TOKENS = 4096
AGENT = '''
import os, sys
import anthropic, openai
assert not any(name.startswith("MYAGENT_") and not value for name, value in os.environ.items())
chat = openai.OpenAI(base_url=os.environ["MYAGENT_OPENAI_URL"], api_key=os.environ["MYAGENT_KEY"], max_retries=0)
messages = [{"role": "user", "content": sys.argv[-1]}]
first = chat.chat.completions.create(model="gyre", messages=messages, max_tokens=6)
messages += [{"role": "assistant", "content": first.choices[0].message.content or ""},
             {"role": "user", "content": "go on"}]
chat.chat.completions.create(model="gyre", messages=messages, max_tokens=6)
claude = anthropic.Anthropic(base_url=os.environ["MYAGENT_ANTHROPIC_URL"], api_key=os.environ["MYAGENT_KEY"],
                             max_retries=0)
claude.messages.create(model="gyre", max_tokens=6, messages=[{"role": "user", "content": "summarise"}])
open("done.txt", "w").write(os.environ["MYAGENT_MODE"])
'''
SPEC = f'''
command = ["{sys.executable}", "/app/agent.py"]
[base_url_env]
MYAGENT_OPENAI_URL = "openai"
MYAGENT_ANTHROPIC_URL = "anthropic"
[api_key_env]
names = ["MYAGENT_KEY"]
[env]
MYAGENT_MODE = "done"
'''
# Execution .0 scores 1 if the agent finished, .1 scores 0: rewards differ, so the group lands.
SCORER = ("import os; done = os.path.exists('done.txt') and open('done.txt').read() == 'done'; "
          "print('{\"reward\": %d}' % (done and os.environ['GYRE_EXECUTION_ID'].endswith('.0')))")


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


@pytest.mark.skipif(shutil.which("bwrap") is None or os.geteuid() != 0, reason="needs bwrap and root")
@pytest.mark.timeout(300)
def test_a_spec_described_agent_is_captured_and_trains_through_inferred_chains(tiny_model_dir: Path,
                                                                               tmp_path: Path) -> None:
    (tmp_path / "agent.toml").write_text(SPEC)
    agent = load_agent_spec(tmp_path / "agent.toml")
    task = TaskSpec(task_id="spec-agent", prompt="write done.txt", workspace_files={"agent.py": AGENT},
                    agent_argv=spec_argv(agent), scorer_argv=(sys.executable, "-c", SCORER), timeout_s=120.0,
                    scorer_timeout_s=30.0, workdir="/app", env=dict(agent.env))
    sandbox = SandboxConfig(kind="bubblewrap")
    topology = Topology("spec-agent", seed=0)
    http = ProxyHttpConfig(model_names=("gyre",), max_context_tokens=MAX_CONTEXT_TOKENS)
    topology.add("proxy", Proxy, ProxyConfig(model_dir=str(tiny_model_dir), http=http))
    topology.add("cell-0", StandInCell, StandInCellConfig(str(tiny_model_dir)))
    topology.add("executor", Executor, ExecutorConfig(workspace_root=str(tmp_path / "executions"), sandbox=sandbox))
    topology.add("evaluator", Evaluator, EvaluatorConfig(sandbox=sandbox))
    topology.add("trajectory_builder", TrajectoryBuilder, TrajectoryBuilderConfig(claimer="driver",
                                                                                 task_source="driver"))
    topology.add("driver", Driver, DriverConfig(StartGroup("g0", task, 2, 0)))
    log_path = tmp_path / "run.glog"
    result = InProcessLauncher().run(topology, RunOptions(log_path=str(log_path), until_s=240.0))
    assert result.reason == "done", result

    codec = Codec()
    calls, scored, landed = [], [], []
    for record in read_log(log_path):
        name = record.type_name.rsplit(".", 1)[-1]
        if record.envelope.receiver == "trajectory_builder" and name == "ModelCallCompleted":
            calls.append(record.decode(codec))
        elif record.envelope.receiver == "trajectory_builder" and name == "ExecutionScored":
            scored.append(record.decode(codec))
        elif record.envelope.receiver == "driver" and name == "SamplesLanded":
            landed.append(record.decode(codec))
    # Three calls an execution (two OpenAI, one Anthropic), each token-in/token-out, none labelled.
    assert sorted(c.execution_id for c in calls) == ["g0.0"] * 3 + ["g0.1"] * 3
    assert all(c.prompt_tokens and c.output_ids and len(c.output_logprobs) == len(c.output_ids) for c in calls)
    assert {(c.agent_id, c.call_kind) for c in calls} == {("", "")}
    assert sorted((s.execution_id, s.reward) for s in scored) == [("g0.0", 1.0), ("g0.1", 0.0)]
    # The inferred chains became the group's samples: both executions train, with opposite advantages.
    (group,) = landed
    assert sorted(set(group.execution_ids)) == ["g0.0", "g0.1"] and group.samples
    by_execution = dict(zip(group.execution_ids, group.advantages))
    assert by_execution["g0.0"] > 0 > by_execution["g0.1"]
    assert {s.execution_id for s in group.samples} == {"g0.0", "g0.1"}
    # The first chain is the main one; the Anthropic call shares no prefix with it: a chain of its own.
    assert {s.trajectory_kind for s in group.samples if s.trajectory_rank == 0} == {"main"}
