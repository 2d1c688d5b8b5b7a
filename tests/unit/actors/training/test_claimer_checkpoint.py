"""The claimer's part of a checkpoint: the ledger at a step's end, the groups not trained by then, and a restore
that continues the step ids and counts the in-flight samples as re-rolled (issue 28)."""

from __future__ import annotations

import pytest

from gyre.actors.training.microstep_claimer import (
    MAX_BOUNDARIES,
    CheckpointUnavailable,
    MicroStepLedger,
    check_exactly_once,
)
from gyre.actors.training.microstep_claimer import ClaimerConfig
from gyre.messages.samples import SamplesLanded, TrainingSample
from gyre.messages.training import ClaimMicroStep, MicroStepDone, StepApplied
from gyre.runtime.checkpoint import decode_json, encode_json


def group(name: str, tokens_per_execution: list[list[int]], version: int = 0) -> SamplesLanded:
    """A landed group: execution i of `name` has one sample per entry of tokens_per_execution[i]."""
    samples = tuple(
        TrainingSample(f"{name}.{i}", name, rank, "main", rank, tuple(range(n)), (False,) + (True,) * (n - 1),
                       (0.0,) * n, (1.0,) * n, (1.0,) * n, (1.0 / (n - 1),) * n, version, version, n - 1)
        for i, sizes in enumerate(tokens_per_execution) for rank, n in enumerate(sizes)
    )
    ids = tuple(f"{name}.{i}" for i in range(len(tokens_per_execution)))
    return SamplesLanded(name, samples, ids, (0.0,) * len(ids), (0.0,) * len(ids), 0,
                         sum(len(s.token_ids) for s in samples), sum(s.num_loss_tokens for s in samples),
                         version, version)


def config(**overrides) -> ClaimerConfig:
    base = dict(groups_per_step=2, group_size=2, microstep_token_budget=100, early_close_fraction=1.0,
                max_claims_per_cell=1, retry_after_s=0.25)
    base.update(overrides)
    return ClaimerConfig(**base)


def claim(ledger: MicroStepLedger):
    return ledger.claim(ClaimMicroStep("c", ledger.base_version), 0.0)


def done(ledger: MicroStepLedger, granted) -> None:
    ledger.done(MicroStepDone("c", granted.step_id, granted.microstep_index, "", 0, 0, 1, 0.0), 0.0)


def _train_step(ledger: MicroStepLedger, version: int) -> None:
    while (granted := claim(ledger)).step_id >= 0:
        done(ledger, granted)
    ledger.step_applied(StepApplied(ledger.step_id, version, 0.0, 1.0, 1, 1, 0, False))


def test_the_boundary_of_a_step_is_what_a_resume_continues_from():
    ledger = MicroStepLedger(config())  # steps of 2 groups x 2 executions
    ledger.land(group("g0", [[10], [10]]))
    ledger.land(group("g1", [[10], [10]]))
    ledger.land(group("g2", [[10], [10]]))  # pending: waits for step 1
    _train_step(ledger, 1)
    state, groups = ledger.checkpoint_state(0)
    assert state["step_id"] == 1 and state["base_version"] == 1 and groups == ("g2",)
    # Later landings are not trained by step 0's end either; their groups join the boundary's list.
    ledger.land(group("g3", [[10], [10]]))
    assert ledger.checkpoint_state(0)[1] == ("g2", "g3")
    _train_step(ledger, 2)  # step 1 trains g2 and g3 in this run, but the checkpoint of step 0 still re-rolls them
    assert ledger.checkpoint_state(0)[1] == ("g2", "g3") and ledger.checkpoint_state(1)[1] == ()

    resumed = MicroStepLedger(config())
    resumed.restore(decode_json(encode_json(state)))
    stats = resumed.statistics()
    assert stats.step_id == 1 and stats.base_version == 1
    assert stats.samples_trained == 4 and stats.samples_rerolled == 2 and stats.samples_in_flight == 0
    check_exactly_once(stats)  # landed 6 = trained 4 + re-rolled 2
    # The resumed ledger goes on: the re-rolled groups land again under new ids and train in step 1.
    resumed.land(group("g4", [[10], [10]]))
    resumed.land(group("g5", [[10], [10]]))
    _train_step(resumed, 2)
    stats = resumed.statistics()
    assert stats.step_id == 2 and stats.samples_trained == 8 and stats.samples_trained_twice == 0
    check_exactly_once(stats)


def test_a_step_whose_boundary_is_gone_cannot_be_checkpointed():
    ledger = MicroStepLedger(config(groups_per_step=1, group_size=1))
    with pytest.raises(CheckpointUnavailable, match="not 0"):
        ledger.checkpoint_state(0)
    for step in range(MAX_BOUNDARIES + 1):
        ledger.land(group(f"g{step}", [[10]], version=step))
        _train_step(ledger, step + 1)
    with pytest.raises(CheckpointUnavailable):
        ledger.checkpoint_state(0)
    assert ledger.checkpoint_state(MAX_BOUNDARIES)[0]["step_id"] == MAX_BOUNDARIES + 1
