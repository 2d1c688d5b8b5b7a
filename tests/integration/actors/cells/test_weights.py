"""Streaming training across cells and the weight broker, with real trainers, engines and Mooncake.

One core and one satellite train, a third cell serves rollouts, the micro-step claimer hands out work and the
broker announces weights; every actor runs on its own node with ZeroMQ between them (one process, so the test can
look inside). Three steps of synthetic samples are trained (in the third the satellite switches to rollout mid-step):
- (a) the core's weights after them equal one trainer's trained on the union of each step's micro-steps, and
  every micro-step was computed exactly once;
- (b) after each step the rollout cell pulls the new weights through Mooncake (the same bytes as the core's) and its
  engine's output tokens carry the new version;
- (c) the core saved a checkpoint of every version, and when it stopped its last weights and their moving average.
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import attrs
import pytest
import torch

from gyre.actors.cells.engine_process import EngineServerConfig
from gyre.actors.cells.cell import Cell, CellConfig
from gyre.actors.training.microstep_claimer import ClaimerConfig, MicroStepClaimer, check_exactly_once
from gyre.actors.cells.weight_broker import WeightBroker
from gyre.engines.embedded_engine import EngineConfig
from gyre.engines.model_format import load_hf_state_dict
from gyre.engines.sglang_client import SGLangClient
from gyre.engines.trainer import MegatronTrainer, TrainerConfig
from gyre.messages.cell_internal import WeightsDigestAsked
from gyre.messages.cells import ROLLOUT, RoleChanged, SwitchRole
from gyre.messages.samples import SamplesLanded, TrainingSample
from gyre.messages.runtime_control import StatisticsAsked
from gyre.messages.training import StepApplied, WeightsPublished
from gyre.policies.loss import loss_from_samples, pack_samples
from gyre.runtime import Actor, Topology, handler
from gyre.runtime.testing import run_actors

VOCAB = 2041  # ordinary ids of the tiny tokenizer
EXECUTIONS_PER_STEP = 4
TRAINER = TrainerConfig(lr=1e-3, eps=1e-6, num_threads=1)
"""lr well above the tolerance, eps well above float noise: a gradient component that differs in sign (a missing
micro-step) moves a weight by ~2e-3, while rounding noise near zero moves it by far less than 1e-5."""
AVERAGE_DECAY = 0.5
"""The core's weight average (only the core keeps one)."""


class Recorder(Actor):
    """Keeps every announcement it hears, in arrival order, for the driver to read."""

    subscriptions = (RoleChanged, StepApplied, WeightsPublished)

    async def on_start(self) -> None:
        self.events: list = []

    @handler(RoleChanged, StepApplied, WeightsPublished)
    def on_event(self, msg) -> None:
        self.events.append(msg)


def make_group(name: str, seed: int, version: int) -> SamplesLanded:
    """One group of EXECUTIONS_PER_STEP executions, one sample each, random ids, half the tokens carrying loss.
    Every sample is longer than the claimer's token budget, so each is a micro-step of its own."""
    rng = random.Random(seed)
    samples = []
    for i in range(EXECUTIONS_PER_STEP):
        n = rng.randrange(30, 50)
        mask = tuple(t >= n // 2 for t in range(n))
        loss_tokens = sum(mask)
        advantage = 1.0 if i % 2 == 0 else -1.0
        samples.append(TrainingSample(
            execution_id=f"{name}.{i}", group_id=name, trajectory_rank=0, trajectory_kind="main", leaf_call_index=0,
            token_ids=tuple(rng.randrange(1, VOCAB) for _ in range(n)), loss_mask=mask,
            behaviour_logprobs=tuple(rng.uniform(-8.0, -6.0) if m else 0.0 for m in mask),
            advantages=(advantage,) * n, weights=tuple(1.0 / loss_tokens if m else 0.0 for m in mask),
            min_weight_version=version, max_weight_version=version, num_loss_tokens=loss_tokens,
            sampling_temperatures=(1.0,) * n,
        ))
    ids = tuple(s.execution_id for s in samples)
    return SamplesLanded(
        group_id=name, samples=tuple(samples), execution_ids=ids,
        rewards=tuple(float(i % 2 == 0) for i in range(len(ids))),
        advantages=tuple(s.advantages[0] for s in samples), num_dropped=0,
        num_tokens=sum(len(s.token_ids) for s in samples), num_loss_tokens=sum(s.num_loss_tokens for s in samples),
        min_weight_version=version, max_weight_version=version,
    )


def topology(model_dir: str, save_dir: Path, engine_kind: str = "embedded") -> Topology:
    """`engine_kind` "server-distributed": server engines that take their weights by broadcast."""
    engine = EngineConfig(num_blocks=128, max_context_tokens=1024, max_prefill_tokens=512, num_threads=1)
    weight_path = "distributed" if engine_kind == "server-distributed" else "disk"
    common = dict(model_dir=model_dir, engine=engine, trainer=TRAINER, report_interval_s=0.5,
                  engine_kind=engine_kind.removesuffix("-distributed"),
                  engine_server=EngineServerConfig(weight_path=weight_path))
    result = Topology("weights", seed=0)
    result.add("recorder", Recorder)
    result.add("claimer", MicroStepClaimer, ClaimerConfig(
        groups_per_step=1, group_size=EXECUTIONS_PER_STEP, microstep_token_budget=30, retry_after_s=0.05))
    result.add("weight_broker", WeightBroker)
    core = dict(common, trainer=attrs.evolve(TRAINER, average_decay=AVERAGE_DECAY))
    result.add("core", Cell, CellConfig(is_core=True, initial_role="train", save_dir=str(save_dir / "model"),
                                        average_save_dir=str(save_dir / "average"),
                                        checkpoint_dir=str(save_dir / "checkpoints"), **core))
    result.add("satellite", Cell, CellConfig(initial_role="train", **common))
    result.add("roller", Cell, CellConfig(initial_role="rollout", **common))
    return result


async def generate_versions(url: str) -> list[int]:
    async with SGLangClient(url) as client:
        out = await client.generate([5, 6, 7, 8, 9], {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True})
    return out["meta_info"]["output_token_versions"]


async def roller_loaded(h, version: int, timeout_s: float = 60.0) -> None:
    """Until the broker hears that the rollout cell loaded `version` (the test's assertions say if it never did)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while loop.time() < deadline:
        if (await h.ask("weight_broker", StatisticsAsked())).cell_versions.get("roller") == version:
            return
        await asyncio.sleep(0.05)


@pytest.fixture(scope="module", params=["embedded", "server", "server-distributed"])
def trained(request, tiny_model_dir, tmp_path_factory):
    """Run the topology through three steps, with engines in the cells' processes or as engine server child
    processes (weights then reach them through update_weights_from_disk, or by broadcast over a gloo group with
    init_weights_update_group + update_weights_from_distributed); return what the driver saw."""
    torch.set_num_threads(1)
    groups = [make_group("g0", 0, version=0), make_group("g1", 1, version=0), make_group("g2", 2, version=1)]

    async def driver(h):
        recorder = h.actor("recorder")

        def seen(kind, **fields):
            return [e for e in recorder.events if isinstance(e, kind)
                    and all(getattr(e, k) == v for k, v in fields.items())]

        await h.wait_until(lambda: len(seen(RoleChanged)) >= 3, timeout_s=180, what="three cells up")
        roller_url = seen(RoleChanged, cell="roller")[0].engine_url
        result = {"versions": [await generate_versions(roller_url)], "digests": []}
        for step, group in enumerate(groups[:2]):
            h.tell("claimer", group)
            await h.wait_until(lambda: seen(StepApplied, step_id=step), timeout_s=120, what=f"step {step} applied")

            await roller_loaded(h, step + 1)
            result["versions"].append(await generate_versions(roller_url))
            core = await h.ask("core", WeightsDigestAsked())
            roller = await h.ask("roller", WeightsDigestAsked())
            result["digests"].append((core.sha256, roller.sha256, core.weight_version, roller.weight_version))
        # Step 2: the satellite leaves for rollout while the step is under way (holding a claim if it got one).
        h.tell("claimer", groups[2])
        ledger = h.actor("claimer").ledger
        await h.wait_until(lambda: ledger.backlog(0.0).claims_by_cell.get("satellite", 0) > 0
                           or seen(StepApplied, step_id=2), timeout_s=120, what="satellite claims in step 2")
        result["switched_holding_claim"] = not seen(StepApplied, step_id=2)
        h.tell("satellite", SwitchRole("satellite", ROLLOUT, "test: away mid-step"))
        await h.wait_until(lambda: seen(StepApplied, step_id=2), timeout_s=120, what="step 2 applied")
        await h.wait_until(lambda: seen(RoleChanged, cell="satellite", role=ROLLOUT), timeout_s=120,
                           what="satellite serving")
        await roller_loaded(h, 3)
        result["core_params"] = h.actor("core").training.trainer.flat_params()
        result["status"] = {name: await h.ask(name, StatisticsAsked())
                            for name in ("core", "satellite", "roller")}
        result["claimer"] = await h.ask("claimer", StatisticsAsked())
        result["broker"] = await h.ask("weight_broker", StatisticsAsked())
        result["events"] = list(recorder.events)
        return result

    save_dir = tmp_path_factory.mktemp("final")
    run = run_actors(topology(str(tiny_model_dir), save_dir, request.param), driver, transport="zmq",
                     timeout_s=400)
    assert run.stop_reason is None, run.stop_reason
    return groups, dict(run.value, save_dir=save_dir, engine_kind=request.param)


def test_core_weights_equal_one_trainer_on_the_union(trained, tiny_model_dir):
    groups, seen = trained
    reference = MegatronTrainer(tiny_model_dir, attrs.evolve(TRAINER, average_decay=AVERAGE_DECAY))
    initial = reference.flat_params()
    checkpoints = []
    for group in groups:
        batch = pack_samples(group.samples)
        reference.forward_backward(
            batch.input_ids, batch.lengths,
            lambda lp, batch=batch: loss_from_samples(lp, batch, num_executions=EXECUTIONS_PER_STEP),
        )
        reference.optimizer_step()
        checkpoints.append(reference.hf_state_dict())
    core = seen["core_params"]
    assert float((core - initial).abs().max()) > 1e-4  # the steps did move the weights
    assert float((core - reference.flat_params()).abs().max()) < 1e-5
    save_dir = seen["save_dir"]
    # When it stopped the core saved its weights and their moving average; after each step, a checkpoint.
    saved = {name: load_hf_state_dict(save_dir / name) for name in ("model", "average")}
    saved.update({f"v{i + 1:05d}": load_hf_state_dict(save_dir / "checkpoints" / f"v{i + 1:05d}") for i in range(3)})
    assert sorted(p.name for p in (save_dir / "checkpoints").iterdir()) == ["v00001", "v00002", "v00003"]
    expected = {"model": reference.hf_state_dict(), "average": reference.hf_state_dict(averaged=True)}
    expected.update({f"v{i + 1:05d}": state for i, state in enumerate(checkpoints)})
    for name, state in expected.items():
        assert saved[name].keys() == state.keys(), name
        assert max(float((saved[name][k] - state[k]).abs().max()) for k in state) < 1e-5, name
    # The average is not the last weights: it lags them (decay 0.5 over three steps).
    assert max(float((expected["average"][k] - expected["model"][k]).abs().max()) for k in state) > 1e-4


def test_micro_steps_were_shared_and_counted_once(trained):
    _, seen = trained
    stats = seen["claimer"]
    check_exactly_once(stats)
    assert stats.samples_trained == 3 * EXECUTIONS_PER_STEP and stats.steps_applied == 3
    computed = {name: s.microsteps_computed for name, s in seen["status"].items()}
    assert computed["core"] >= 1 and computed["satellite"] >= 1, computed
    # Every micro-step computed once, even the one the satellite held when it left (finished or handed back).
    assert computed["core"] + computed["satellite"] == stats.microsteps_done == 3 * EXECUTIONS_PER_STEP
    assert seen["status"]["core"].steps_applied == 3
    for name in ("roller", "satellite"):  # rollout satellites hold no trainer
        assert seen["status"][name].role == ROLLOUT and not seen["status"][name].has_trainer
    print(f"\nsatellite left step 2 holding a claim: {seen['switched_holding_claim']}")


def test_rollout_cell_pulls_each_version(trained):
    _, seen = trained
    assert seen["versions"] == [[0] * 4, [1] * 4, [2] * 4]
    for core_digest, roller_digest, core_version, roller_version in seen["digests"]:
        assert core_digest and core_digest == roller_digest
        assert core_version == roller_version
    published = [e.version for e in seen["events"] if isinstance(e, WeightsPublished)]
    assert published == [0, 1, 2, 3]
    assert seen["broker"].cell_versions["roller"] == 3



def test_each_engine_update_records_its_path_and_time(trained):
    _, seen = trained
    roller = seen["status"]["roller"]
    assert roller.engine_kind == seen["engine_kind"].removesuffix("-distributed")
    assert roller.engine_weight_updates == 3  # versions 1, 2, 3 while serving
    paths = {"embedded": "memory", "server": "disk", "server-distributed": "distributed"}
    assert roller.last_weight_update_path == paths[seen["engine_kind"]]
    assert roller.last_weight_update_s > 0
    print(f"\n{seen['engine_kind']}: last weight update {roller.last_weight_update_s:.4f} s "
          f"({roller.last_weight_update_path})")
