"""A run checkpointed after every step and resumed from its last checkpoint, with a real core cell (issue 28).

A real core cell trains the tiny model; a scripted executor plays executor, evaluator and trajectory builder: each
group the task source starts lands at the claimer a moment later (and its GroupDone reaches the task source). The
checkpointer gathers the task source's, claimer's and run monitor's parts after each step the core saved its own.
Run 1 trains steps 0-1 and stops; run 2 resumes from step 1's checkpoint and trains steps 2-3. Checked:
- a checkpoint after each step, each with the core's shard, the three actors' parts and a manifest whose digests
  hold, and a final one as the run stops (the core's part saved in its on_stop);
- the restored core holds exactly the saved weights and AdamW moments (state digest), at version 2;
- run 2 goes on at step 2 (versions 3, 4), its groups have new ids (none of run 1 lands again), the groups not
  trained at the checkpoint re-roll first, as the same tasks;
- the claimer's ledger continues (trained samples of both runs, the in-flight ones counted re-rolled) and balances;
- the monitor's history continues: run.json holds steps 0-3 and one resume.
"""

from __future__ import annotations

import json
import sys

import torch

from gyre.actors.cells.cell import Cell, CellConfig
from gyre.actors.cells.weight_broker import WeightBroker
from gyre.actors.executions.task_source import TaskSource, TaskSourceConfig, groups_ahead_for_staleness
from gyre.actors.training.checkpointer import Checkpointer, CheckpointerConfig
from gyre.actors.training.microstep_claimer import ClaimerConfig, MicroStepClaimer, check_exactly_once
from gyre.actors.training.run_monitor import RunMonitor, RunMonitorConfig
from gyre.engines.embedded_engine import EngineConfig
from gyre.engines.trainer import TrainerConfig
from gyre.messages.cells import TRAIN
from gyre.messages.checkpoints import CheckpointCommitted
from gyre.messages.executions import GroupDone, StartGroup, TaskSpec
from gyre.messages.runtime_control import StatisticsAsked
from gyre.messages.samples import SamplesLanded, TrainingSample
from gyre.messages.training import StepApplied
from gyre.runtime import Actor, Topology, handler
from gyre.runtime.checkpoint import list_steps, load_latest, step_dir
from gyre.runtime.testing import run_actors

GROUP_SIZE = 2
TOKENS = 24
TASKS = tuple(TaskSpec(f"t{i}", f"do t{i}", {}, (sys.executable, "agent.py"), (sys.executable, "score.py"), 60.0, 5.0)
              for i in range(5))


def sample(execution: str, group: str, seed: int, version: int) -> TrainingSample:
    g = torch.Generator().manual_seed(seed)
    ids = tuple(int(t) for t in torch.randint(1, 2000, (TOKENS,), generator=g))
    mask = tuple(t >= TOKENS // 2 for t in range(TOKENS))
    k = sum(mask)
    return TrainingSample(
        execution_id=execution, group_id=group, trajectory_rank=0, trajectory_kind="main", leaf_call_index=0,
        token_ids=ids, loss_mask=mask, behaviour_logprobs=tuple(-7.0 if m else 0.0 for m in mask),
        advantages=(1.0,) * TOKENS, weights=tuple(1.0 / k if m else 0.0 for m in mask), min_weight_version=version,
        max_weight_version=version, num_loss_tokens=k, sampling_temperatures=(1.0,) * TOKENS,
    )


class ScriptedExecutor(Actor):
    """Lands each group a moment after it starts (the moment keeps a group or two in flight at each step's end)."""

    async def on_start(self) -> None:
        self.groups: list[StartGroup] = []

    @handler(StartGroup)
    def on_start_group(self, msg: StartGroup) -> None:
        self.groups.append(msg)
        self.send_later(0.3, GroupDone(msg.group_id, True, 1.0, 1.0, msg.group_size, 0, 0))

    @handler(GroupDone)
    def on_landed(self, msg: GroupDone) -> None:
        start = next(g for g in self.groups if g.group_id == msg.group_id)
        executions = tuple(f"{msg.group_id}-{i}" for i in range(start.group_size))
        samples = tuple(sample(e, msg.group_id, hash(e) % 10_000, start.weight_version) for e in executions)
        self.tell("claimer", SamplesLanded(msg.group_id, samples, executions, (1.0,) * len(executions),
                                           (1.0,) * len(executions), 0, TOKENS * len(samples),
                                           sum(s.num_loss_tokens for s in samples), start.weight_version,
                                           start.weight_version))
        self.tell("task_source", msg)  # after the landing, as the trajectory builder orders them


class Recorder(Actor):
    subscriptions = (StepApplied, CheckpointCommitted)

    async def on_start(self) -> None:
        self.steps: list[StepApplied] = []
        self.committed: list[CheckpointCommitted] = []

    @handler(StepApplied)
    def on_step(self, msg: StepApplied) -> None:
        self.steps.append(msg)

    @handler(CheckpointCommitted)
    def on_committed(self, msg: CheckpointCommitted) -> None:
        self.committed.append(msg)


def topology(tiny_model_dir, report, resume_from: str = "", every: int = 1) -> Topology:
    root = str(report / "run_checkpoints")
    result = Topology("resume", seed=0)
    result.add("recorder", Recorder)
    result.add("executor", ScriptedExecutor)
    result.add("task_source", TaskSource, TaskSourceConfig(
        tasks=TASKS, group_size=GROUP_SIZE, groups_in_flight=3, groups_per_step=1,
        max_groups_ahead_of_training=groups_ahead_for_staleness(1, 1), stop_topology_when_done=False,
        resume_from=resume_from))
    result.add("claimer", MicroStepClaimer, ClaimerConfig(groups_per_step=1, group_size=GROUP_SIZE,
                                                          retry_after_s=0.05, resume_from=resume_from))
    result.add("monitor", RunMonitor, RunMonitorConfig(report_dir=str(report), steps=4, cells=("core",),
                                                       core_cell="core", progress=False, resume_from=resume_from))
    result.add("weight_broker", WeightBroker)
    result.add("checkpointer", Checkpointer, CheckpointerConfig(
        root=root, participants=("task_source", "claimer", "monitor"), keep=4))
    # The core after the checkpointer: on one node actors stop in reverse order, so the core leaves its final part
    # before the checkpointer, stopping, looks for it.
    result.add("core", Cell, CellConfig(
        model_dir=str(tiny_model_dir), is_core=True, initial_role=TRAIN,
        trainer=TrainerConfig(num_threads=1, lr=1e-3), claim_retry_s=0.05,
        engine=EngineConfig(num_blocks=64, max_context_tokens=512, max_prefill_tokens=256, num_threads=1),
        run_checkpoint_dir=root, run_checkpoint_every_steps=every, resume_from=resume_from))
    return result


def _run(topology_, steps_wanted: int, commits_wanted: int | None = None):
    commits_wanted = steps_wanted if commits_wanted is None else commits_wanted

    async def driver(h):
        recorder = h.actor("recorder")
        await h.wait_until(lambda: len(recorder.steps) >= steps_wanted and len(recorder.committed) >= commits_wanted,
                           timeout_s=240, what=f"{steps_wanted} steps applied and checkpointed")
        core = h.actor("core")
        stats = {name: await h.ask(name, StatisticsAsked()) for name in ("claimer", "task_source", "checkpointer")}
        return (list(recorder.steps), list(recorder.committed), list(h.actor("executor").groups), stats,
                core.run_checkpoints.restored_state_digest)

    return run_actors(topology_, driver, timeout_s=300).value


def test_a_run_resumes_from_its_checkpoint_with_the_same_state(tiny_model_dir, tmp_path):
    torch.set_num_threads(1)
    report = tmp_path / "report"
    root = report / "run_checkpoints"
    steps, committed, groups1, stats1, restored = _run(topology(tiny_model_dir, report), 2)
    assert [(s.step_id, s.version) for s in steps[:2]] == [(0, 1), (1, 2)] and restored == ""
    assert [c.step_id for c in committed[:2]] == [0, 1] and stats1["checkpointer"].abandoned == 0
    assert 1 in list_steps(root)
    checkpoint = json.loads((step_dir(root, 1) / "manifest.json").read_text())
    assert sorted(checkpoint["parts"]) == ["claimer.json", "core.record.json", "core.tp0.pp0.pt", "monitor.json",
                                           "task_source.json"]
    assert checkpoint["weight_version"] == 2

    latest, skipped = load_latest(root)
    assert skipped == []
    resume = step_dir(root, 1)
    steps2, committed2, groups2, stats2, restored2 = _run(topology(tiny_model_dir, report, str(resume)), 2)
    # The restored trainer holds exactly what was saved: weights, moments, step counts, version.
    assert restored2 == checkpoint["core_state_digest"]
    assert [(s.step_id, s.version) for s in steps2[:2]] == [(2, 3), (3, 4)]
    # Only new group ids; the groups the checkpoint names as not trained run first, as the same tasks.
    old_ids = {g.group_id for g in groups1}
    assert not old_ids & {g.group_id for g in groups2}
    task_of = {g.group_id: g.task.task_id for g in groups1}
    reroll = checkpoint["reroll_groups"]
    assert reroll and [g.task.task_id for g in groups2[:len(reroll)]] == [task_of[r] for r in sorted(reroll)]
    assert all(g.weight_version >= 2 for g in groups2)
    assert stats2["task_source"].groups_rerolled == len(reroll) and stats2["task_source"].groups_lost_on_resume == 0
    # The ledger continues: 2 steps of run 1, 2 of run 2, one group of 2 samples each; the rest re-rolled or in flight.
    claimer = stats2["claimer"]
    assert claimer.step_id >= 4 and claimer.samples_trained >= 4 * GROUP_SIZE
    assert claimer.samples_trained_twice == 0 and claimer.samples_lost == 0
    check_exactly_once(claimer)
    run = json.loads((report / "run.json").read_text())
    assert [s["step"] for s in run["steps"]][:4] == [0, 1, 2, 3]  # a step may end as the run stops
    assert [r["from_step"] for r in run["resumes"]] == [1]


def test_a_stopping_run_leaves_a_final_checkpoint(tiny_model_dir, tmp_path):
    """Checkpoints every 2 steps, stopped after step 0: the final checkpoint (the core's part saved as it stopped,
    found by the stopping checkpointer) is step 0's, and a resume starts at step 1."""
    torch.set_num_threads(1)
    report = tmp_path / "report"
    root = report / "run_checkpoints"
    steps, committed, _, _, _ = _run(topology(tiny_model_dir, report, every=2), 1, 0)
    assert committed == [] or committed[0].step_id >= 1  # nothing periodic at step 0
    latest, skipped = load_latest(root)
    assert skipped == [] and latest is not None and latest.step_id == steps[-1].step_id
    assert latest.has_part("core.record.json") and latest.manifest["weight_version"] == steps[-1].version
