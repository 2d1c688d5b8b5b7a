"""A trajectory longer than the micro-step token budget trains correctly (issue 29, item 4).

The rule: a sample of `microstep_token_budget` tokens or more gets a micro-step of its own (the claimer never
splits a sample, and closes that micro-step at once), and in the cell a chunk of its own (`length_sorted_chunks`
never cuts a row), so it is trained as one sequence: the loss covers every one of its policy tokens and its
gradient is the one it would have in a micro-step without a budget. What bounds its length is the proxy, not the
trainer: a sample is one call's prompt + output at most, and the proxy refuses a prompt that leaves no room under
its max_context_tokens (which `check_context_fits` keeps within the model's positions). What it costs is the
memory of one sequence of that length; on GPUs, megatron context parallelism would split it (not used here).

Real parts: the claimer's ledger packs the step, the cell's TrainerHost computes each micro-step on the tiny
model (megatron-core on CPU), a Mooncake transfer agent holds its buffers as in a cell.
"""

from __future__ import annotations

import pytest
import torch

from gyre.actors.cells.train_role import TrainerHost
from gyre.actors.training.microstep_claimer import ClaimerConfig, MicroStepLedger
from gyre.engines.trainer import TrainerConfig
from gyre.engines.transfer import TransferAgent
from gyre.messages.samples import SamplesLanded, TrainingSample
from gyre.messages.training import ClaimGranted, ClaimMicroStep, StepReady

VOCAB = 2041
BUDGET = 128
"""Tokens per micro-step, and padded tokens per chunk in the cell: far below the long sample."""
LONG = 700


def sample(seed: int, n: int, execution: str) -> TrainingSample:
    g = torch.Generator().manual_seed(seed)
    ids = tuple(int(t) for t in torch.randint(1, VOCAB, (n,), generator=g))
    mask = tuple(t >= 16 and t % 5 != 0 for t in range(n))  # a prompt, then output tokens among tool results
    k = sum(mask)
    return TrainingSample(
        execution_id=execution, group_id="g", trajectory_rank=seed, trajectory_kind="main", leaf_call_index=seed,
        token_ids=ids, loss_mask=mask, behaviour_logprobs=tuple(-7.5 - 0.01 * (t % 7) if m else 0.0
                                                                for t, m in enumerate(mask)),
        advantages=(0.5 if execution != "b" else -0.5,) * n, weights=tuple(1.0 / k if m else 0.0 for m in mask),
        min_weight_version=0, max_weight_version=0, num_loss_tokens=k, sampling_temperatures=(1.0,) * n,
    )


SAMPLES = (sample(0, LONG, "long"), sample(1, 40, "a"), sample(2, 90, "a"), sample(3, 60, "b"), sample(4, 30, "b"))


def landed() -> SamplesLanded:
    ids = ("long", "a", "b")
    return SamplesLanded(
        group_id="g", samples=SAMPLES, execution_ids=ids, rewards=(1.0, 1.0, 0.0), advantages=(0.5, 0.5, -0.5),
        num_dropped=0, num_tokens=sum(len(s.token_ids) for s in SAMPLES),
        num_loss_tokens=sum(s.num_loss_tokens for s in SAMPLES), min_weight_version=0, max_weight_version=0,
    )


def microsteps(budget: int) -> list[ClaimGranted]:
    """The step's micro-steps as the claimer packs and hands them out."""
    ledger = MicroStepLedger(ClaimerConfig(groups_per_step=1, group_size=3, microstep_token_budget=budget,
                                           early_close_fraction=1.0, max_claims_per_cell=64))
    [ready] = [m for m in ledger.land(landed()) if isinstance(m, StepReady)]
    granted = [ledger.claim(ClaimMicroStep("cell", ledger.base_version), 0.0) for _ in range(ready.num_microsteps)]
    assert all(g.step_id == ready.step_id for g in granted)
    assert ledger.claim(ClaimMicroStep("cell", ledger.base_version), 0.0).step_id == -1  # nothing more
    return granted


@pytest.fixture(scope="module")
def host(tiny_model_dir):
    torch.set_num_threads(2)
    agent = TransferAgent()
    host = TrainerHost.build(str(tiny_model_dir), TrainerConfig(), agent, True, torch.zeros(1, dtype=torch.int64))
    yield host
    host.close()
    agent.close()


def test_a_sample_longer_than_the_budget_trains_alone_with_the_gradient_of_an_unbounded_micro_step(host) -> None:
    long = SAMPLES[0]
    unbounded = microsteps(10**6)
    assert len(unbounded) == 1 and len(unbounded[0].samples) == len(SAMPLES)
    host.trainer.zero_grads()
    whole = host.compute(unbounded[0].samples, unbounded[0].num_executions_in_step, 3e-4, 4e-4, 10**6)
    expected = host.trainer.grads_to_flat().clone()

    bounded = microsteps(BUDGET)
    [alone] = [g for g in bounded if long in g.samples]
    assert alone.samples == (long,)  # a micro-step of its own
    assert all(sum(len(s.token_ids) for s in g.samples) <= BUDGET for g in bounded if g is not alone)
    assert sorted(s.trajectory_rank for g in bounded for s in g.samples) == list(range(len(SAMPLES)))
    parts, got, alone_grads = [], torch.zeros_like(expected), None
    for g in bounded:  # each on its own, as the cells compute them; the core sums them
        host.trainer.zero_grads()
        parts.append(host.compute(g.samples, g.num_executions_in_step, 3e-4, 4e-4, BUDGET))
        grads = host.trainer.grads_to_flat().clone()
        got += grads
        if g is alone:
            alone_grads = grads
    host.trainer.zero_grads()

    [metrics] = [m for m, g in zip(parts, bounded) if g is alone]
    # One sequence, one chunk, the loss over every one of its policy tokens.
    assert (metrics["chunks"], metrics["num_rows"], metrics["num_tokens"]) == (1, 1, LONG)
    assert metrics["num_loss_tokens"] == sum(long.loss_mask) == long.num_loss_tokens
    assert sum(m["num_loss_tokens"] for m in parts) == whole["num_loss_tokens"]
    assert sum(m["loss"] for m in parts) == pytest.approx(whole["loss"], abs=1e-6)
    assert float(alone_grads.abs().max()) > 1e-3  # the long sample's own gradient, worth comparing
    assert float((got - expected).abs().max()) <= 1e-5
