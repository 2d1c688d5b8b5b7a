"""A step whose gradients are not finite is skipped without stalling the run.

A real core cell trains the tiny model; a scripted executor lands each group the task source starts straight at the
micro-step claimer. The first group's samples carry NaN advantages, so step 0's gradients are NaN and the trainer
skips the update (weights and version unchanged). The task source gates rollouts on groups ahead of training with
staleness 0 (one group ahead): it may start the second group only once step 0 is over. Before skipped steps were
announced as such, its gate counted versions, the version never moved, and the run waited for ever. Checked:
- all three groups run and three steps end: step 0 skipped (version 0 kept), steps 1 and 2 applied (versions 1, 2);
- the broker publishes only real versions, and the core's weights are those of version 2 (finite);
- the claimer's ledger counts step 0's samples as skipped, the others as trained, and balances.
"""

from __future__ import annotations

import math
import sys

import torch

from gyre.actors.cells.cell import Cell, CellConfig
from gyre.actors.training.microstep_claimer import ClaimerConfig, MicroStepClaimer, check_exactly_once
from gyre.actors.executions.task_source import TaskSource, TaskSourceConfig, groups_ahead_for_staleness
from gyre.actors.cells.weight_broker import WeightBroker
from gyre.engines.embedded_engine import EngineConfig
from gyre.engines.trainer import TrainerConfig
from gyre.messages.cells import TRAIN
from gyre.messages.runtime_control import StatisticsAsked
from gyre.messages.executions import GroupDone, StartGroup, TaskSpec
from gyre.messages.samples import SamplesLanded, TrainingSample
from gyre.messages.training import StepApplied, WeightsPublished
from gyre.runtime import Actor, Topology, handler
from gyre.runtime.testing import run_actors

GROUP_SIZE = 2
GROUPS = 3
TOKENS = 24


def sample(execution: str, group: str, seed: int, advantage: float) -> TrainingSample:
    g = torch.Generator().manual_seed(seed)
    ids = tuple(int(t) for t in torch.randint(1, 2000, (TOKENS,), generator=g))
    mask = tuple(t >= TOKENS // 2 for t in range(TOKENS))
    k = sum(mask)
    return TrainingSample(
        execution_id=execution, group_id=group, trajectory_rank=0, trajectory_kind="main", leaf_call_index=0,
        token_ids=ids, loss_mask=mask, behaviour_logprobs=tuple(-7.0 if m else 0.0 for m in mask),
        advantages=(advantage,) * TOKENS, weights=tuple(1.0 / k if m else 0.0 for m in mask), min_weight_version=0,
        max_weight_version=0, num_loss_tokens=k, sampling_temperatures=(1.0,) * TOKENS,
    )


class ScriptedExecutor(Actor):
    """Lands every group it is asked to run at once; the first group's advantages are NaN."""

    async def on_start(self) -> None:
        self.groups: list[str] = []

    @handler(StartGroup)
    def on_start_group(self, msg: StartGroup) -> None:
        advantage = math.nan if not self.groups else 1.0
        self.groups.append(msg.group_id)
        executions = tuple(f"{msg.group_id}-{i}" for i in range(msg.group_size))
        samples = tuple(sample(e, msg.group_id, len(self.groups) * 10 + i, advantage)
                        for i, e in enumerate(executions))
        self.tell("claimer", SamplesLanded(msg.group_id, samples, executions, (1.0,) * len(executions),
                                           (advantage,) * len(executions), 0, TOKENS * len(samples),
                                           sum(s.num_loss_tokens for s in samples), 0, 0))
        self.tell("task_source", GroupDone(msg.group_id, True, 1.0, 1.0, msg.group_size, 0, 0))


class Recorder(Actor):
    subscriptions = (StepApplied, WeightsPublished)

    async def on_start(self) -> None:
        self.steps: list[StepApplied] = []
        self.published: list[int] = []

    @handler(StepApplied)
    def on_step(self, msg: StepApplied) -> None:
        self.steps.append(msg)

    @handler(WeightsPublished)
    def on_published(self, msg: WeightsPublished) -> None:
        self.published.append(msg.version)


def test_a_skipped_step_ends_its_step_and_the_run_goes_on(tiny_model_dir):
    torch.set_num_threads(1)
    task = TaskSpec("t0", "do t0", {}, (sys.executable, "agent.py"), (sys.executable, "score.py"), 60.0, 5.0)
    topology = Topology("skipped-step", seed=0)
    topology.add("recorder", Recorder)
    topology.add("executor", ScriptedExecutor)
    topology.add("task_source", TaskSource, TaskSourceConfig(
        tasks=(task,), group_size=GROUP_SIZE, groups_in_flight=2, max_groups=GROUPS, groups_per_step=1,
        max_groups_ahead_of_training=groups_ahead_for_staleness(0, 1), stop_topology_when_done=False))
    topology.add("claimer", MicroStepClaimer, ClaimerConfig(groups_per_step=1, group_size=GROUP_SIZE,
                                                            retry_after_s=0.05))
    topology.add("weight_broker", WeightBroker)
    topology.add("core", Cell, CellConfig(
        model_dir=str(tiny_model_dir), is_core=True, initial_role=TRAIN, trainer=TrainerConfig(num_threads=1),
        engine=EngineConfig(num_blocks=64, max_context_tokens=512, max_prefill_tokens=256, num_threads=1),
        claim_retry_s=0.05))

    async def driver(h):
        recorder = h.actor("recorder")
        # Without the skipped-step semantics this waits for ever: the task source holds the second group.
        await h.wait_until(lambda: len(recorder.steps) == GROUPS, timeout_s=120, what="three steps over")
        source = await h.ask("task_source", StatisticsAsked())
        claimer = await h.ask("claimer", StatisticsAsked())
        broker = await h.ask("weight_broker", StatisticsAsked())
        core = await h.ask("core", StatisticsAsked())
        params = h.actor("core").training.params.clone()
        return source, claimer, broker, core, params, list(recorder.steps), list(recorder.published)

    run = run_actors(topology, driver, timeout_s=180)
    source, claimer, broker, core, params, steps, published = run.value
    assert [(s.step_id, s.version, s.skipped) for s in steps] == [(0, 0, True), (1, 1, False), (2, 2, False)]
    assert math.isnan(steps[0].grad_norm) and all(math.isfinite(s.grad_norm) for s in steps[1:])
    assert source.groups_started == source.groups_done == GROUPS and source.weight_version == 2
    assert published == [0, 1, 2] and broker.version == 2  # 0: the core's registration; no copy of 0 re-announced
    assert core.weight_version == 2 and core.steps_applied == 3
    assert bool(torch.isfinite(params).all())
    assert (claimer.samples_skipped, claimer.samples_trained, claimer.steps_skipped) == (GROUP_SIZE, 2 * GROUP_SIZE, 1)
    assert claimer.steps_applied == 3 and claimer.base_version == 2
    check_exactly_once(claimer)
