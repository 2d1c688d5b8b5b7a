"""A small training run for `gyre run --resume` tests, in virtual time: the real task source, claimer, run monitor
and checkpointer around a scripted executor and a scripted core.

The scripted core follows the core's contract (actors/cells/core_checkpoint.py): it claims each step's micro-steps,
reports them done, publishes StepApplied, saves its part (its version and a running hash of what it trained: the
"weights") after every `--checkpoint-every` steps and tells the checkpointer; `--resume-from` restores it.
`--crash-after-step K` ends a fresh run (not a resumed one) with status 1 right after step K, as a dying core does.

    gyre run tests/integration/runtime/resume_topology.py --virtual --report R --steps 4 --crash-after-step 1
    gyre run tests/integration/runtime/resume_topology.py --virtual --report R --resume
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from pathlib import Path

import attrs

from gyre.actors.executions.task_source import TaskSource, TaskSourceConfig, groups_ahead_for_staleness
from gyre.actors.training.checkpointer import Checkpointer, CheckpointerConfig
from gyre.actors.training.microstep_claimer import ClaimerConfig, MicroStepClaimer
from gyre.actors.training.run_monitor import RunMonitor, RunMonitorConfig
from gyre.messages.checkpoints import CorePartsSaved
from gyre.messages.executions import GroupDone, StartGroup, TaskSpec
from gyre.messages.samples import SamplesLanded, TrainingSample
from gyre.messages.training import ClaimMicroStep, MicroStepDone, StepApplied, StepReady
from gyre.runtime import Actor, Topology, handler
from gyre.runtime.checkpoint import encode_json, read_actor_state, staging_dir, write_file_atomic

GROUP_SIZE = 2
TASKS = tuple(TaskSpec(f"t{i}", f"do t{i}", {}, (sys.executable, "agent.py"), (sys.executable, "score.py"), 60.0, 5.0)
              for i in range(6))


def _sample(execution: str, group: str, version: int) -> TrainingSample:
    return TrainingSample(execution, group, 0, "main", 0, (1, 2, 3, 4), (False, True, True, True), (0.0,) * 4,
                          (1.0,) * 4, (1.0,) * 4, (1 / 3,) * 4, version, version, 3)


class ScriptedExecutor(Actor):
    """Each group lands at the claimer 0.7 s after it starts, then its GroupDone reaches the task source."""

    async def on_start(self) -> None:
        self.starts: dict[str, StartGroup] = {}

    @handler(StartGroup)
    def on_start_group(self, msg: StartGroup) -> None:
        self.starts[msg.group_id] = msg
        self.send_later(0.7, GroupDone(msg.group_id, True, 1.0, 1.0, msg.group_size, 0, 10))

    @handler(GroupDone)
    def on_landed(self, msg: GroupDone) -> None:
        start = self.starts.pop(msg.group_id)
        ids = tuple(f"{msg.group_id}-{i}" for i in range(start.group_size))
        samples = tuple(_sample(e, msg.group_id, start.weight_version) for e in ids)
        self.tell("claimer", SamplesLanded(msg.group_id, samples, ids, (1.0,) * len(ids), (1.0,) * len(ids), 0,
                                           4 * len(ids), 3 * len(ids), start.weight_version, start.weight_version))
        self.tell("task_source", msg)


@attrs.frozen
class ScriptedCoreConfig:
    root: str
    every_steps: int = 1
    resume_from: str = ""
    crash_after_step: int = -1


class ScriptedCore(Actor):
    """The core's side of a step and of a checkpoint (module docstring)."""

    config_cls = ScriptedCoreConfig
    subscriptions = (StepReady,)

    async def on_start(self) -> None:
        self.version = 0
        self.weights = "0" * 64
        self.trained: list[str] = []
        if self.config.resume_from:
            state, _ = read_actor_state(self.config.resume_from, "core")
            self.version, self.weights, self.trained = state["version"], state["weights"], state["trained"]

    @handler(StepReady)
    async def on_step_ready(self, msg: StepReady) -> None:
        for _ in range(msg.num_microsteps):
            grant = await self.ask("claimer", ClaimMicroStep(self.name, self.version))
            assert grant.step_id == msg.step_id, grant
            for sample in grant.samples:
                self.trained.append(sample.execution_id)
                self.weights = hashlib.sha256((self.weights + sample.execution_id).encode()).hexdigest()
            self.tell("claimer", MicroStepDone(self.name, grant.step_id, grant.microstep_index, "", 0, 0, 4, 0.0))
        self.version += 1
        self.publish(StepApplied(msg.step_id, self.version, 0.1, 1.0, 4 * msg.num_samples, msg.num_samples, 0))
        if (msg.step_id + 1) % self.config.every_steps == 0:
            part = write_file_atomic(staging_dir(self.config.root, msg.step_id) / "core.json", encode_json(
                {"version": self.version, "weights": self.weights, "trained": self.trained}))
            self.tell("checkpointer", CorePartsSaved(self.name, msg.step_id, self.version, (part.name,),
                                                     (part.sha256,), (part.size_bytes,), self.weights))
        if msg.step_id == self.config.crash_after_step and not self.config.resume_from:
            self.stop_topology(f"the core died after step {msg.step_id}", 1)


def topology(argv: list[str]) -> Topology:
    parser = argparse.ArgumentParser()
    parser.add_argument("--report", required=True)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--checkpoint-every", type=int, default=1)
    parser.add_argument("--crash-after-step", type=int, default=-1)
    parser.add_argument("--resume-from", default="")
    args = parser.parse_args(argv)
    report = Path(args.report)
    result = Topology("resume-test", seed=3, log_path=str(report / "events.glog"))
    result.checkpoint_dir = str(report / "run_checkpoints")
    resume = args.resume_from
    result.add("executor", ScriptedExecutor)
    result.add("task_source", TaskSource, TaskSourceConfig(
        tasks=TASKS, group_size=GROUP_SIZE, groups_in_flight=3, groups_per_step=1, seed=3,
        max_groups_ahead_of_training=groups_ahead_for_staleness(1, 1), stop_topology_when_done=False,
        resume_from=resume))
    result.add("claimer", MicroStepClaimer, ClaimerConfig(groups_per_step=1, group_size=GROUP_SIZE,
                                                          resume_from=resume))
    result.add("monitor", RunMonitor, RunMonitorConfig(report_dir=str(report), steps=args.steps, cells=("core",),
                                                       core_cell="core", progress=False, resume_from=resume))
    result.add("core", ScriptedCore, ScriptedCoreConfig(str(report / "run_checkpoints"), args.checkpoint_every,
                                                        resume, args.crash_after_step))
    result.add("checkpointer", Checkpointer, CheckpointerConfig(
        root=str(report / "run_checkpoints"), participants=("task_source", "claimer", "monitor"), keep=2))
    return result
