"""A satellite switches into training while a step is under way and its gradients join the step by reduction rounds.

The core and satellite `sat_a` train from the start; `sat_b` serves rollouts. Step 0 is made of two groups: the
first lands, then `sat_b` switches to training (the step cannot be complete before the second group lands, so the
switch always overtakes it), then the second group lands. Step 1 (one group, base version 1) is trained by all
three. Real trainers, claimer, broker and gloo groups, every actor on its own node with ZeroMQ between them:
- the core's weights equal one trainer's trained on the union of each step's micro-steps, and every micro-step
  counted exactly once;
- `sat_b` computed micro-steps and took part in a round with `sat_a`: a group of three (core + two satellites)
  formed when it joined;
- in every round the core received one gradient buffer's bytes, and each satellite sent one buffer per round
  whatever the round's size: bytes per cell do not grow with the number of training cells.
"""

from __future__ import annotations

import random

import pytest
import torch

from gyre.actors.cells.cell import Cell, CellConfig
from gyre.actors.cells.weight_broker import WeightBroker
from gyre.actors.training.microstep_claimer import ClaimerConfig, MicroStepClaimer, check_exactly_once
from gyre.engines.embedded_engine import EngineConfig
from gyre.engines.trainer import MegatronTrainer, TrainerConfig
from gyre.messages.cells import ROLLOUT, TRAIN, RoleChanged, SwitchRole
from gyre.messages.runtime_control import StatisticsAsked
from gyre.messages.samples import SamplesLanded, TrainingSample
from gyre.messages.training import StepApplied
from gyre.policies.loss import loss_from_samples, pack_samples
from gyre.runtime import Actor, Topology, handler
from gyre.runtime.testing import run_actors

VOCAB = 2041  # ordinary ids of the tiny tokenizer
EXECUTIONS_PER_STEP = 4
"""Per group; a step is two groups."""
TRAINER = TrainerConfig(lr=1e-3, eps=1e-6, num_threads=1)
"""As tests/integration/actors/cells/test_weights.py: a missing micro-step moves a weight by ~2e-3, noise by far less
than 1e-5."""


def make_group(name: str, seed: int, version: int) -> SamplesLanded:
    """EXECUTIONS_PER_STEP executions, one sample each, longer than the claimer's token budget (a micro-step each)."""
    rng = random.Random(seed)
    samples = []
    for i in range(EXECUTIONS_PER_STEP):
        n = rng.randrange(30, 50)
        mask = tuple(t >= n // 2 for t in range(n))
        loss_tokens = sum(mask)
        samples.append(TrainingSample(
            execution_id=f"{name}.{i}", group_id=name, trajectory_rank=0, trajectory_kind="main", leaf_call_index=0,
            token_ids=tuple(rng.randrange(1, VOCAB) for _ in range(n)), loss_mask=mask,
            behaviour_logprobs=tuple(rng.uniform(-8.0, -6.0) if m else 0.0 for m in mask),
            advantages=(1.0 if i % 2 == 0 else -1.0,) * n, weights=tuple(1.0 / loss_tokens if m else 0.0 for m in mask),
            min_weight_version=version, max_weight_version=version, num_loss_tokens=loss_tokens,
            sampling_temperatures=(1.0,) * n,
        ))
    return SamplesLanded(
        group_id=name, samples=tuple(samples), execution_ids=tuple(s.execution_id for s in samples),
        rewards=tuple(float(i % 2 == 0) for i in range(len(samples))),
        advantages=tuple(s.advantages[0] for s in samples), num_dropped=0,
        num_tokens=sum(len(s.token_ids) for s in samples), num_loss_tokens=sum(s.num_loss_tokens for s in samples),
        min_weight_version=version, max_weight_version=version,
    )


class Recorder(Actor):
    subscriptions = (RoleChanged, StepApplied)

    async def on_start(self) -> None:
        self.events: list = []

    @handler(RoleChanged, StepApplied)
    def on_event(self, msg) -> None:
        self.events.append(msg)


def topology(model_dir: str) -> Topology:
    engine = EngineConfig(num_blocks=64, max_context_tokens=512, max_prefill_tokens=256, num_threads=1)
    common = dict(model_dir=model_dir, engine=engine, trainer=TRAINER, report_interval_s=0.5)
    result = Topology("gradient-rounds", seed=0)
    result.add("recorder", Recorder)
    result.add("claimer", MicroStepClaimer, ClaimerConfig(
        groups_per_step=2, group_size=EXECUTIONS_PER_STEP, microstep_token_budget=30, retry_after_s=0.05))
    result.add("weight_broker", WeightBroker)
    result.add("core", Cell, CellConfig(is_core=True, initial_role=TRAIN, **common))
    result.add("sat_a", Cell, CellConfig(initial_role=TRAIN, **common))
    result.add("sat_b", Cell, CellConfig(initial_role=ROLLOUT, **common))
    return result


@pytest.fixture(scope="module")
def trained(tiny_model_dir):
    torch.set_num_threads(1)
    steps = [[make_group("j0", 10, 0), make_group("j1", 11, 0)], [make_group("j2", 12, 1), make_group("j3", 13, 1)]]

    async def driver(h):
        recorder = h.actor("recorder")

        def seen(kind, **fields):
            return [e for e in recorder.events if isinstance(e, kind)
                    and all(getattr(e, k) == v for k, v in fields.items())]

        await h.wait_until(lambda: len(seen(RoleChanged)) >= 3, timeout_s=180, what="three cells up")
        h.tell("claimer", steps[0][0])
        # The step cannot complete before its second group lands: the switch always joins it under way.
        h.tell("sat_b", SwitchRole("sat_b", TRAIN, "test: join the step under way", migrate_sessions=False))
        await h.wait_until(lambda: seen(RoleChanged, cell="sat_b", role=TRAIN), timeout_s=120, what="sat_b trains")
        joined_before_step = not seen(StepApplied, step_id=0)
        h.tell("claimer", steps[0][1])
        await h.wait_until(lambda: seen(StepApplied, step_id=0), timeout_s=120, what="step 0 applied")
        for group in steps[1]:
            h.tell("claimer", group)
        await h.wait_until(lambda: seen(StepApplied, step_id=1), timeout_s=120, what="step 1 applied")
        core = h.actor("core")
        return {
            "joined_before_step": joined_before_step,
            "core_params": core.training.trainer.flat_params(),
            "numel": core.training.numel,
            "rounds": list(core.core_steps.history),
            "status": {name: await h.ask(name, StatisticsAsked()) for name in ("core", "sat_a", "sat_b")},
            "claimer": await h.ask("claimer", StatisticsAsked()),
        }

    run = run_actors(topology(str(tiny_model_dir)), driver, transport="zmq", timeout_s=400)
    assert run.stop_reason is None, run.stop_reason
    return steps, run.value


def test_the_joined_step_gives_one_trainers_weights_on_the_union(trained, tiny_model_dir):
    steps, seen = trained
    assert seen["joined_before_step"]
    reference = MegatronTrainer(tiny_model_dir, TRAINER)
    initial = reference.flat_params()
    for groups in steps:
        samples = [s for group in groups for s in group.samples]
        batch = pack_samples(samples)
        reference.forward_backward(batch.input_ids, batch.lengths, lambda lp, batch=batch: loss_from_samples(
            lp, batch, num_executions=len(groups) * EXECUTIONS_PER_STEP))
        reference.optimizer_step()
    assert float((seen["core_params"] - initial).abs().max()) > 1e-4
    assert float((seen["core_params"] - reference.flat_params()).abs().max()) < 1e-5


def test_every_micro_step_counted_once_and_the_joiner_trained(trained):
    steps, seen = trained
    check_exactly_once(seen["claimer"])
    total = sum(len(group.samples) for groups in steps for group in groups)
    computed = {name: s.microsteps_computed for name, s in seen["status"].items()}
    assert sum(computed.values()) == seen["claimer"].microsteps_done == total, computed
    assert computed["sat_b"] >= 1 and computed["sat_a"] >= 1, computed


def test_a_group_of_three_formed_when_the_satellite_joined_and_bytes_do_not_grow_with_it(trained):
    _, seen = trained
    rounds = seen["rounds"]
    assert all(r.counted for r in rounds), rounds
    sizes = {len(r.members) for r in rounds}
    assert 2 in sizes, rounds  # a round with both satellites: the joiner's group
    groups = {r.group_id: r.members for r in rounds}
    assert ("sat_a", "sat_b") in groups.values()
    buffer_bytes = seen["numel"] * 4
    assert {r.received_bytes for r in rounds} == {buffer_bytes}  # the core: one buffer a round, 1 or 2 satellites
    for name in ("sat_a", "sat_b"):  # CellStatistics: one buffer sent a round, whatever the round's size
        stats = seen["status"][name]
        assert stats.gradient_rounds >= 1 and stats.gradient_rounds_failed == 0
        assert stats.gradient_bytes_sent == stats.gradient_rounds * buffer_bytes
        assert stats.gradient_bytes_received < stats.gradient_rounds * buffer_bytes
    core = seen["status"]["core"]
    assert core.gradient_rounds == len(rounds) and core.gradient_bytes_received == len(rounds) * buffer_bytes
