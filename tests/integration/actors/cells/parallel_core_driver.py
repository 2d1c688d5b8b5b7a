"""A core cell whose trainer spans processes, for test_parallel_core.py:
`python3 parallel_core_driver.py MODEL OUT SAVE_DIR CHECKPOINT_ROOT tp2|dp2`.

`run(model_dir, tensor, save_dir, checkpoint_root)` builds the topology of test_skipped_step.py (a scripted executor
landing each group at the micro-step claimer, the task source, the broker, one core cell in the train role) with
the core's trainer at tensor-parallel size `tensor`, waits for STEPS applied steps, switches the core to rollout
(its engine starts on the trainer's newest weights, which a trainer group publishes from its shards) and stops the
run (the core saves its weights to `save_dir`, and every step's sharded checkpoint part goes under
`checkpoint_root`). The pytest process runs it at tensor 1; this file's main runs it at tensor 2 (or data 2) in a fresh process
(a trainer group's rank 0 needs a process whose first torch.distributed group is the group's), then `resume`s a
fresh TP=2 core from the last step's sharded checkpoint, saving the records.
"""

from __future__ import annotations

import sys

import torch

from gyre.actors.cells.cell import Cell, CellConfig
from gyre.actors.cells.weight_broker import WeightBroker
from gyre.actors.executions.task_source import TaskSource, TaskSourceConfig, groups_ahead_for_staleness
from gyre.actors.training.microstep_claimer import ClaimerConfig, MicroStepClaimer
from gyre.engines.embedded_engine import EngineConfig
from gyre.engines.trainer import TrainerConfig
from gyre.messages.cells import ROLLOUT, TRAIN, SwitchRole
from gyre.messages.executions import GroupDone, StartGroup, TaskSpec
from gyre.messages.runtime_control import StatisticsAsked
from gyre.messages.samples import SamplesLanded, TrainingSample
from gyre.messages.training import StepApplied
from gyre.runtime import Actor, Topology, handler
from gyre.runtime.testing import run_actors

GROUP_SIZE = 2
STEPS = 2
LR = 5e-5  # see trainer_group_driver.py on Adam and round-off


def sample(execution: str, group: str, seed: int, length: int) -> TrainingSample:
    g = torch.Generator().manual_seed(seed)
    ids = tuple(int(t) for t in torch.randint(1, 2000, (length,), generator=g))
    mask = tuple(t >= length // 3 for t in range(length))
    k = sum(mask)
    advantage = float(torch.randn((), generator=g))
    return TrainingSample(
        execution_id=execution, group_id=group, trajectory_rank=0, trajectory_kind="main", leaf_call_index=0,
        token_ids=ids, loss_mask=mask, behaviour_logprobs=tuple(-7.0 if m else 0.0 for m in mask),
        advantages=(advantage,) * length, weights=tuple(1.0 / k if m else 0.0 for m in mask), min_weight_version=0,
        max_weight_version=0, num_loss_tokens=k, sampling_temperatures=(1.0,) * length,
    )


class ScriptedExecutor(Actor):
    """Lands every group it is asked to run at once (fixed samples per group, whatever the run)."""

    async def on_start(self) -> None:
        self.groups = 0

    @handler(StartGroup)
    def on_start_group(self, msg: StartGroup) -> None:
        self.groups += 1
        executions = tuple(f"{msg.group_id}-{i}" for i in range(msg.group_size))
        samples = tuple(sample(e, msg.group_id, 100 * self.groups + i, 12 + 9 * i) for i, e in enumerate(executions))
        self.tell("claimer", SamplesLanded(msg.group_id, samples, executions, (1.0,) * len(executions),
                                           (1.0,) * len(executions), 0, sum(len(s.token_ids) for s in samples),
                                           sum(s.num_loss_tokens for s in samples), 0, 0))
        self.tell("task_source", GroupDone(msg.group_id, True, 1.0, 1.0, msg.group_size, 0, 0))


class Recorder(Actor):
    subscriptions = (StepApplied,)

    async def on_start(self) -> None:
        self.steps: list[StepApplied] = []

    @handler(StepApplied)
    def on_step(self, msg: StepApplied) -> None:
        self.steps.append(msg)


def run(model_dir: str, tensor: int, save_dir: str, checkpoint_root: str, data: int = 1) -> dict:
    task = TaskSpec("t0", "do t0", {}, (sys.executable, "agent.py"), (sys.executable, "score.py"), 60.0, 5.0)
    topology = Topology(f"parallel-core-tp{tensor}-dp{data}", seed=0)
    topology.add("recorder", Recorder)
    topology.add("executor", ScriptedExecutor)
    topology.add("task_source", TaskSource, TaskSourceConfig(
        tasks=(task,), group_size=GROUP_SIZE, groups_in_flight=1, max_groups=STEPS, groups_per_step=1,
        max_groups_ahead_of_training=groups_ahead_for_staleness(0, 1), stop_topology_when_done=False))
    topology.add("claimer", MicroStepClaimer, ClaimerConfig(groups_per_step=1, group_size=GROUP_SIZE,
                                                            retry_after_s=0.05))
    topology.add("weight_broker", WeightBroker)
    topology.add("core", Cell, CellConfig(
        model_dir=model_dir, is_core=True, initial_role=TRAIN,
        trainer=TrainerConfig(num_threads=1, lr=LR, tensor_parallel=tensor, data_parallel=data),
        engine=EngineConfig(num_blocks=64, max_context_tokens=512, max_prefill_tokens=256, num_threads=1),
        claim_retry_s=0.05, clip_low=0.9, clip_high=10.0, save_dir=save_dir, run_checkpoint_dir=checkpoint_root))

    async def driver(h):
        recorder = h.actor("recorder")
        await h.wait_until(lambda: len(recorder.steps) == STEPS, timeout_s=240, what="steps applied")
        h.tell("core", SwitchRole("core", ROLLOUT, "test: serve the trained weights"))
        await h.wait_until(lambda: h.actor("core").role == ROLLOUT, timeout_s=120, what="core serving")
        core = await h.ask("core", StatisticsAsked())
        return [(s.step_id, s.version, s.loss, s.grad_norm, s.skipped) for s in recorder.steps], core

    steps, core = run_actors(topology, driver, timeout_s=400).value
    return {"steps": steps, "engine_version": core.weight_version, "role": core.role,
            "steps_applied": core.steps_applied}


def resume(model_dir: str, tensor: int, checkpoint_root: str, step_id: int) -> dict:
    """Commit the core's parts of `step_id` (as the checkpointer would, from the record the core left), then start a
    fresh core from that checkpoint in the rollout role: it restores every shard and its engine starts on the
    restored weights."""
    from gyre.runtime.checkpoint import PartRecord, commit, read_core_record, staging_dir

    record = read_core_record(staging_dir(checkpoint_root, step_id))
    parts = {name: PartRecord(name, sha, size)
             for name, sha, size in zip(record.part_names, record.part_sha256, record.part_bytes)}
    path = commit(checkpoint_root, step_id, parts, {"weight_version": record.weight_version}, keep=4)
    topology = Topology(f"parallel-core-resume-tp{tensor}", seed=0)
    topology.add("weight_broker", WeightBroker)
    topology.add("core", Cell, CellConfig(
        model_dir=model_dir, is_core=True, initial_role=ROLLOUT,
        trainer=TrainerConfig(num_threads=1, lr=LR, tensor_parallel=tensor),
        engine=EngineConfig(num_blocks=64, max_context_tokens=512, max_prefill_tokens=256, num_threads=1),
        resume_from=str(path)))

    async def driver(h):
        await h.wait_until(lambda: getattr(h.actor("core"), "role", "") == ROLLOUT, timeout_s=240,
                           what="resumed core serving")
        core = h.actor("core")
        stats = await h.ask("core", StatisticsAsked())
        return core.run_checkpoints.restored_state_digest, core.training.version, stats.weight_version

    restored, trainer_version, engine_version = run_actors(topology, driver, timeout_s=300).value
    return {"saved_digest": record.state_digest, "restored_digest": restored, "saved_version": record.weight_version,
            "trainer_version": trainer_version, "engine_version": engine_version}


def main() -> None:
    model_dir, out, save_dir, checkpoint_root, layout = sys.argv[1:6]
    torch.set_num_threads(1)
    if layout == "dp2":  # two data-parallel replicas: TrainerHost.compute deals each chunk's rows to them
        torch.save(run(model_dir, 1, save_dir, checkpoint_root, data=2), out)
        return
    records = run(model_dir, 2, save_dir, checkpoint_root)
    from gyre.runtime.checkpoint import read_core_record, staging_dir

    records["staged"] = {}  # what each step's staging folder holds before the commit below
    for step in range(STEPS):
        folder = staging_dir(checkpoint_root, step)
        records["staged"][step] = (sorted(p.name for p in folder.glob("core.tp*.pt")),
                                   read_core_record(folder).part_names)
    records["resumed"] = resume(model_dir, 2, checkpoint_root, STEPS - 1)
    torch.save(records, out)


if __name__ == "__main__":
    main()
