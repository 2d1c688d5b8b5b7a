"""The rollout side of `gyre bench faults` in real time (issue 28): an agent process killed in the middle of a model
call, and the evaluator's scorer process killed, with the zero-lost-calls check.

The run: the real proxy actor (keys, routing, the OpenAI app) in front of a rollout cell stand-in that hosts Gyre's
engine server over the embedded engine on the tiny model, the real executor running a small agent script per
execution (three chat calls over HTTP), the real evaluator running a small scorer script, the real trajectory
builder, and a driver that plays the task source and the claimer: it starts `groups` groups of 2 and waits for their
GroupDone. In each case one process dies for real (SIGKILL of itself, the first to claim a marker file):
- "agent-mid-call": an agent sends its second call and dies 50 ms later, while the engine generates. Defined
  outcome: the proxy ends the call (answered into a closed socket, or counted disconnected), the executor sees the
  agent die, the evaluator scores what the workspace holds, the builder lands or drops the group with the calls
  that completed; nothing waits for ever.
- "scorer-killed": a scorer dies before printing; the evaluator drops that execution ("crashed"), the builder lands
  the group from the execution that survived (or drops it), and the run goes on.
Invariants, all 0 when it holds: lost_calls (calls the proxy took and never ended: its `in_flight` once every
execution ended; calls it counted completed without a ModelCallCompleted reaching the builder; calls the agents
sent, 3 each and 2 for the killed one, beyond those the proxy ended: completed, rejected, failed or disconnected),
executions without exactly one outcome (ExecutionScored or ExecutionDropped), groups without a GroupDone.
"""

from __future__ import annotations

import json
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

import attrs

from gyre.actors.executions.evaluator import Evaluator, EvaluatorConfig
from gyre.actors.executions.executor import Executor, ExecutorConfig
from gyre.actors.serving.http_app import ProxyHttpConfig
from gyre.actors.serving.proxy import Proxy, ProxyConfig
from gyre.actors.training.trajectory_builder import TrajectoryBuilder, TrajectoryBuilderConfig
from gyre.messages.cells import ROLLOUT, RoleChanged
from gyre.messages.executions import GroupDone, StartGroup, TaskSpec
from gyre.messages.runtime_control import StatisticsAsked
from gyre.messages.samples import SamplesLanded
from gyre.runtime import Actor, Codec, GyreError, InProcessLauncher, RunOptions, Topology, handler, read_log

CASES = ("agent-mid-call", "scorer-killed")
MAX_CONTEXT_TOKENS = 1024

AGENT = textwrap.dedent('''
    """Three chat calls; with --die-once MARKER the first agent to create MARKER dies during its second call."""
    import http.client, json, os, sys, time, urllib.parse

    base, key = urllib.parse.urlsplit(os.environ["OPENAI_BASE_URL"]), os.environ["OPENAI_API_KEY"]
    marker = sys.argv[sys.argv.index("--die-once") + 1] if "--die-once" in sys.argv else ""

    def send(i):
        body = {"model": "gyre", "max_tokens": 48, "temperature": 1.0,
                "messages": [{"role": "user", "content": f"say something, round {i}"}]}
        connection = http.client.HTTPConnection(base.hostname, base.port, timeout=120)
        connection.request("POST", base.path.rstrip("/") + "/chat/completions", json.dumps(body),
                           {"Authorization": "Bearer " + key, "Content-Type": "application/json"})
        return connection  # the whole request is written: the proxy has it

    def call(i):
        response = send(i).getresponse()
        response.read()
        return response.status

    def claim(path):
        try:
            handle = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except OSError:
            return False
        os.write(handle, json.dumps([os.environ.get("GYRE_EXECUTION_ID", ""), time.time()]).encode())
        os.close(handle)
        return True

    for i in range(3):
        if i == 1 and marker and claim(marker):
            send(i)
            time.sleep(0.05)  # the engine generates its answer
            os.kill(os.getpid(), 9)
        print("call", i, call(i), flush=True)
    open("answer.txt", "w").write("done")
''')

SCORER = textwrap.dedent('''
    """Reward 1 for a workspace with answer.txt; with --die-once MARKER the first scorer to create it dies."""
    import json, os, sys, time

    if "--die-once" in sys.argv:
        try:
            handle = os.open(sys.argv[sys.argv.index("--die-once") + 1], os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            os.write(handle, json.dumps(["", time.time()]).encode())
            os.close(handle)
            os.kill(os.getpid(), 9)
        except FileExistsError:
            pass
    print(json.dumps({"reward": 1.0 if os.path.exists("answer.txt") else 0.0}))
''')


@attrs.frozen
class StandInCellConfig:
    model_dir: str


class StandInCell(Actor):
    """A rollout cell as the proxy sees one: Gyre's engine server over the embedded engine, announced with the
    RoleChanged a cell publishes (as in tests/integration/actors/executions/test_execution_flow.py)."""

    config_cls = StandInCellConfig

    async def on_start(self) -> None:
        from aiohttp import web

        from gyre.engines.async_engine import AsyncEngine
        from gyre.engines.embedded_engine import EmbeddedEngine, EngineConfig
        from gyre.engines.engine_server import build_engine_app

        config = EngineConfig(num_blocks=256, max_context_tokens=MAX_CONTEXT_TOKENS, num_threads=1)
        self.engine = AsyncEngine(EmbeddedEngine(self.config.model_dir, config))
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
    groups: tuple[StartGroup, ...]
    report_file: str
    """Where the proxy's statistics are written once every group is done."""


class Driver(Actor):
    """Task source and claimer in one: starts the groups, waits for each GroupDone, then asks the proxy what it
    counted and stops the run."""

    config_cls = DriverConfig

    async def on_start(self) -> None:
        self.waiting = {group.group_id for group in self.config.groups}
        for group in self.config.groups:
            self.tell("executor", group)

    @handler(SamplesLanded)
    def on_landed(self, msg: SamplesLanded) -> None:
        pass

    @handler(GroupDone)
    async def on_done(self, msg: GroupDone) -> None:
        self.waiting.discard(msg.group_id)
        if not self.waiting:
            try:
                statistics = await self.ask("proxy", StatisticsAsked(), timeout_s=10.0)
                Path(self.config.report_file).write_text(json.dumps(attrs.asdict(statistics)))
            except GyreError as error:
                self.log.error("proxy_statistics_not_had", error=str(error))
            self.stop_topology("every group done")


def rollout_topology(case: str, work: Path, model_dir: str, groups: int = 2) -> Topology:
    (work / "agent.py").write_text(AGENT)
    (work / "score.py").write_text(SCORER)
    marker = str(work / "killed")
    agent_argv = (sys.executable, str(work / "agent.py")) + (("--die-once", marker) if case == "agent-mid-call"
                                                             else ())
    scorer_argv = (sys.executable, str(work / "score.py")) + (("--die-once", marker) if case == "scorer-killed"
                                                              else ())
    task = TaskSpec("t0", "chat a little", {}, agent_argv, scorer_argv, 120.0, 30.0)
    result = Topology(f"fault-rollouts-{case}", seed=0)
    http = ProxyHttpConfig(model_names=("gyre",), max_context_tokens=MAX_CONTEXT_TOKENS)
    result.add("proxy", Proxy, ProxyConfig(model_dir=model_dir, http=http))
    result.add("cell-0", StandInCell, StandInCellConfig(model_dir))
    result.add("executor", Executor, ExecutorConfig(workspace_root=str(work / "executions"), max_concurrent=2))
    result.add("evaluator", Evaluator, EvaluatorConfig())
    result.add("trajectory_builder", TrajectoryBuilder, TrajectoryBuilderConfig(claimer="driver",
                                                                                task_source="driver"))
    result.add("driver", Driver, DriverConfig(tuple(StartGroup(f"g{i}", task, 2, 0) for i in range(groups)),
                                              str(work / "proxy.json")))
    return result


def run_rollout_case(case: str, model_dir: str = "", *, groups: int = 2, timeout_s: float = 150.0) -> dict:
    """One case of CASES in real time; its invariants (module docstring). Without `model_dir`, the tiny model is
    made in a temporary folder first."""
    if case not in CASES:
        raise ValueError(f"unknown rollout case {case!r}; the cases are {', '.join(CASES)}")
    with tempfile.TemporaryDirectory(prefix="gyre-faults-rollouts-") as folder:
        work = Path(folder)
        if not model_dir:
            from gyre.engines.model_format import init_model_dir

            model_dir = str(init_model_dir(work / "model", preset="tiny", seed=0))
        started = time.monotonic()
        log_path = work / "events.glog"
        topology = rollout_topology(case, work, model_dir, groups)
        result = InProcessLauncher().run(topology, RunOptions(log_path=str(log_path), until_s=timeout_s))
        wall_s = time.monotonic() - started
        codec = Codec()
        calls_recorded = 0
        outcomes: dict[str, int] = {}
        ended_s: dict[str, tuple[str, float]] = {}  # execution -> (its outcome's type, when it was handled)
        group_done: set[str] = set()
        landed = dropped_groups = 0
        proxy = json.loads((work / "proxy.json").read_text()) if (work / "proxy.json").exists() else None
        for record in read_log(log_path, codec):
            name, receiver = record.type_name.rsplit(".", 1)[-1], record.envelope.receiver
            if name == "ModelCallCompleted" and receiver == "trajectory_builder":
                calls_recorded += 1
            elif name in ("ExecutionScored", "ExecutionDropped") and receiver == "trajectory_builder":
                execution = record.decode(codec).execution_id
                outcomes[execution] = outcomes.get(execution, 0) + 1
                ended_s.setdefault(execution, (name, record.handled_s))
            elif name == "GroupDone" and receiver == "driver":
                msg = record.decode(codec)
                group_done.add(msg.group_id)
                landed += msg.landed
                dropped_groups += not msg.landed
        executions = {f"g{g}.{i}" for g in range(groups) for i in range(2)}
        row: dict[str, Any] = {
            "kind": case, "seed": 0, "plan": case, "fired": int((work / "killed").exists()),
            "finished": result.reason == "every group done", "reason": result.reason, "resumed": False,
            "groups_landed": landed, "groups_dropped": dropped_groups,
            "executions_without_one_outcome": sum(1 for e in executions if outcomes.get(e, 0) != 1),
            "groups_without_group_done": groups - len(group_done), "calls_recorded": calls_recorded,
            "wall_s": round(wall_s, 1),
        }
        if proxy is None:
            row["lost_calls"] = None
            row["proxy"] = "no statistics (the run did not end by itself)"
        else:
            keys = ("calls_completed", "calls_rejected", "calls_failed", "calls_disconnected")
            row.update({key: proxy[key] for key in keys})
            # A call lost: one the proxy still holds though every execution ended, or one it completed whose record
            # never reached the builder (its trajectory would silently miss a turn).
            # And one an agent sent that the proxy never ended: every agent sends 3, the killed one 2.
            sent = 3 * len(executions) - (1 if case == "agent-mid-call" and row["fired"] else 0)
            ended = sum(proxy[key] for key in keys)
            row["calls_sent"] = sent
            row["lost_calls"] = (proxy["in_flight"] + max(0, proxy["calls_completed"] - proxy["emit_failures"]
                                                          - calls_recorded) + max(0, sent - ended))
        if (work / "killed").exists():
            # Time to recover: from the death to the outcome of the execution it hit (the agent names its own; a
            # scorer's is the execution dropped).
            killed, kill_s = json.loads((work / "killed").read_text())
            hit = [s for e, (n, s) in ended_s.items() if e == killed or (not killed and n == "ExecutionDropped")]
            row["killed_execution"] = killed
            row["recover_s"] = round(min(hit) - kill_s, 3) if hit else None
        row["outcome"] = "kept" if row["finished"] else "hung"
    return row
