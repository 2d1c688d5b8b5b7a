"""The task source's part of a checkpoint, in virtual time: a resumed task source re-rolls the groups the checkpoint
names first, as new groups of the same tasks, then goes on with the very tasks an uninterrupted run would have run
next (its shuffled cycles and random draws come back); its counters and gate continue (issue 28)."""

from __future__ import annotations

import sys
from pathlib import Path

import attrs
import pytest

from gyre.actors.executions.task_source import TaskSource, TaskSourceConfig, TaskSourceResumeError
from gyre.messages.checkpoints import CheckpointAsked
from gyre.messages.executions import GroupDone, StartGroup, TaskSpec
from gyre.messages.runtime_control import StatisticsAsked
from gyre.policies.task_sampling import SignalWeighted
from gyre.runtime import Actor, Codec, RunOptions, Topology, VirtualLauncher, handler, read_log
from gyre.runtime.checkpoint import actor_part_name, commit, open_checkpoint, staging_dir, write_file_atomic


def spec(task_id: str) -> TaskSpec:
    return TaskSpec(task_id, f"do {task_id}", {}, (sys.executable, "agent.py"), (sys.executable, "score.py"), 60.0, 5.0)


TASKS = tuple(spec(f"{family}-{i}") for family in ("sum", "copy", "calc") for i in range(4))


@attrs.frozen
class DriverConfig:
    root: str = ""
    """Where to write the checkpoint ("" = never)."""
    checkpoint_after_done: int = 0
    """Checkpoint (as step 0, version 1) and stop once this many groups are done."""
    also_reroll: int = 0
    """Also name this many of the groups done last as not trained (landed, waiting at the claimer)."""
    stop_after_starts: int = 0
    """Stop once this many groups were started (0: never)."""


class Driver(Actor):
    """Plays the executor and the builder: each group is done a moment after it starts; every third is dropped."""

    config_cls = DriverConfig

    async def on_start(self) -> None:
        self.started = 0
        self.done: list[str] = []

    @handler(StartGroup)
    def on_start_group(self, msg: StartGroup) -> None:
        self.started += 1
        landed = self.started % 3 != 0
        self.send_later(1.0 + self.started % 2, GroupDone(msg.group_id, landed, 0.5, 0.5, 4, 0, 100))
        if self.started == self.config.stop_after_starts:
            self.stop_topology("started enough")

    @handler(GroupDone)
    async def on_done(self, msg: GroupDone) -> None:
        self.tell("task_source", msg)
        self.done.append(msg.group_id)
        if len(self.done) == self.config.checkpoint_after_done:
            reply = await self.ask("task_source", CheckpointAsked(0))
            staging = staging_dir(self.config.root, 0)
            part = write_file_atomic(staging / actor_part_name("task_source"), reply.state)
            reroll = sorted({*reply.groups_not_trained, *self.done[-self.config.also_reroll:]}
                            if self.config.also_reroll else set(reply.groups_not_trained))
            commit(self.config.root, 0, {part.name: part}, {"weight_version": 1, "reroll_groups": reroll}, keep=2)
            self.stop_topology("checkpointed")


def run(tmp_path: Path, name: str, config: TaskSourceConfig, driver: DriverConfig) -> tuple[list[StartGroup], object]:
    topology = Topology("task-source-resume", seed=0)
    topology.add("task_source", TaskSource, attrs.evolve(config, executor="driver"))
    topology.add("driver", Driver, driver)
    log_path = tmp_path / f"{name}.glog"
    VirtualLauncher().run(topology, RunOptions(log_path=str(log_path), until_s=10_000.0))
    codec = Codec()
    starts = [r.decode(codec) for r in read_log(log_path)
              if r.type_name.endswith(".StartGroup") and r.envelope.receiver == "driver"]
    return starts, codec


@pytest.mark.parametrize("sampling", ["epoch", "signal"])
def test_a_resumed_task_source_rerolls_then_continues_the_same_order(tmp_path: Path, sampling: str) -> None:
    base = TaskSourceConfig(TASKS, group_size=4, groups_in_flight=3, seed=5,
                            **({"sampling": SignalWeighted(min_groups=1)} if sampling == "signal" else {}))
    reference, _ = run(tmp_path, "reference", base, DriverConfig(stop_after_starts=20))
    root = tmp_path / "checkpoints"
    first, _ = run(tmp_path, "first", base, DriverConfig(root=str(root), checkpoint_after_done=6, also_reroll=2))
    assert [m.task.task_id for m in first] == [m.task.task_id for m in reference[:len(first)]]
    resumed, _ = run(tmp_path, "resumed", attrs.evolve(base, resume_from=str(root / "step-00000000")),
                     DriverConfig(stop_after_starts=12))
    # The checkpoint names the groups in flight (3 at once) and 2 done ones whose samples never trained.
    checkpoint = open_checkpoint(root / "step-00000000")
    reroll = checkpoint.manifest["reroll_groups"]
    state = checkpoint.read_json("task_source.json")
    assert len(reroll) == 5 and len(state["in_flight"]) == 3
    by_id = {m.group_id: m.task.task_id for m in first}
    assert [m.task.task_id for m in resumed[:5]] == [by_id[group] for group in sorted(reroll)]
    # New ids only, continuing the old counter; after the re-rolls, the tasks an uninterrupted run ran next.
    started = state["next_group_number"]
    assert [m.group_id for m in resumed] == [f"g{i:06d}r1" for i in range(started, started + 12)]
    assert [m.task.task_id for m in resumed[5:]] == [m.task.task_id for m in reference[started:started + 7]]
    assert all(m.weight_version == 1 for m in resumed)  # the checkpoint's version


def test_a_checkpoint_of_another_task_list_is_refused(tmp_path: Path) -> None:
    base = TaskSourceConfig(TASKS, group_size=4, groups_in_flight=2, seed=5)
    root = tmp_path / "checkpoints"
    run(tmp_path, "first", base, DriverConfig(root=str(root), checkpoint_after_done=2))
    other = attrs.evolve(base, tasks=tuple(spec(f"other-{i}") for i in range(3)),
                         resume_from=str(root / "step-00000000"))
    topology = Topology("task-source-resume", seed=0)
    topology.add("task_source", TaskSource, attrs.evolve(other, executor="driver"))
    topology.add("driver", Driver, DriverConfig())
    result = VirtualLauncher().run(topology, RunOptions(until_s=100.0))
    assert result.exit_code == 1 and "TaskSourceResumeError" in result.reason and "task families" in result.reason
    assert issubclass(TaskSourceResumeError, ValueError)
