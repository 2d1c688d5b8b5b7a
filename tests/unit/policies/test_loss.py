"""Group advantages and the GSPO loss, checked against the paper's equations on cases worked out by hand.

Notation (GSPO paper): s = exp(mean over loss tokens of (log pi - log pi_old)); per token
J_t = min(s * A_t, clip(s, 1 - 3e-4, 1 + 4e-4) * A_t); a row's objective is the mean of J_t; loss = -objective.
GSPO-token gradient: d loss / d log pi_t = -(1/n) * s * A_t when the unclipped branch is the minimum, else 0.
"""

from __future__ import annotations

import math

import pytest
import torch

from gyre.messages.samples import TrainingSample
from gyre.policies.errors import LossInputError
from gyre.policies.loss import (
    combine_chunk_metrics,
    group_advantages,
    gspo_loss,
    length_sorted_chunks,
    loss_from_samples,
    pack_samples,
)

LOW, HIGH = 1 - 3e-4, 1 + 4e-4
F64 = torch.float64


def rows(deltas, masks, base=-1.0):
    """log_probs (requiring grad) and old_log_probs whose difference is `deltas` on the mask; float64."""
    old = torch.full((len(deltas), len(deltas[0])), base, dtype=F64)
    old[:, 0] = -3.0
    lp = (old + torch.tensor(deltas, dtype=F64)).requires_grad_(True)
    return lp, old, torch.tensor(masks, dtype=torch.bool)


# -- advantages -----------------------------------------------------------------------------------------------------


def test_advantages_of_one_group_by_hand():
    adv = group_advantages([1.0, 0.0, 0.0, 1.0], ["a"] * 4, eps=1e-6)
    # mean 0.5; Bessel variance = 4 * 0.25 / 3 = 1/3.
    expected = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    assert adv.tolist() == pytest.approx([expected, -expected, -expected, expected], rel=1e-6)


def test_advantages_of_interleaved_groups_by_hand():
    adv = group_advantages(torch.tensor([1.0, 5.0, 0.0, 7.0, 2.0, 9.0]), ["a", "b", "a", "b", "a", "c"], eps=0.0)
    # a: [1, 0, 2], mean 1, std sqrt((0 + 1 + 1) / 2) = 1.  b: [5, 7], mean 6, std sqrt(2).  c: a group of one.
    r = 1 / math.sqrt(2)
    assert adv.tolist() == pytest.approx([0.0, -r, -1.0, r, 1.0, 0.0], abs=1e-6)


def test_group_of_one_and_equal_rewards_get_zero():
    assert group_advantages([3.0], ["g"]).tolist() == [0.0]
    assert group_advantages([2.0, 2.0, 2.0], [1, 1, 1]).tolist() == [0.0, 0.0, 0.0]
    assert group_advantages(torch.tensor([1, 3]), torch.tensor([7, 8])).tolist() == [0.0, 0.0]
    # 0.2 is not exact in binary: float32 rounding once made these -0.015 each (a uniform push down).
    assert group_advantages([0.2] * 16, ["g"] * 16).tolist() == [0.0] * 16
    assert group_advantages(torch.tensor([0.1] * 5, dtype=torch.float32), ["g"] * 5).tolist() == [0.0] * 5


def test_advantages_of_a_group_sum_to_zero_in_float32_input():
    rewards = [0.2] * 15 + [0.5]
    adv = group_advantages(rewards, ["g"] * 16)
    assert abs(float(adv.double().sum())) < 1e-5
    assert adv[-1] > 0 and all(a < 0 for a in adv[:-1].tolist())


def test_advantages_keep_float_dtype_and_accept_int_rewards():
    assert group_advantages(torch.tensor([0.0, 1.0], dtype=F64), [0, 0]).dtype == F64
    assert group_advantages([0, 1], [0, 0]).dtype == torch.float32


@pytest.mark.parametrize(
    "rewards, ids",
    [([1.0, 2.0], ["a"]), ([float("nan"), 1.0], ["a", "a"]), ([[1.0, 2.0]], ["a"])],
)
def test_bad_advantage_inputs_raise(rewards, ids):
    with pytest.raises(LossInputError):
        group_advantages(rewards, ids)


# -- GSPO: one row per case ------------------------------------------------------------------------------------------

# Each case: deltas (log pi - log pi_old) on the mask, mask, advantage, expected loss, expected gradient per token.
S_UP = math.exp(1e-3)  # 1.0010005: above 1 + 4e-4
S_DOWN = math.exp(-1e-3)  # 0.9990005: below 1 - 3e-4
S_IN = math.exp(1e-4)  # 1.0001: inside the clip range
CASES = {
    "inside, A=2": ([0, 1e-4, -2e-4, 4e-4], [0, 1, 1, 1], 2.0, -2 * S_IN, [0] + [-2 * S_IN / 3] * 3),
    "above, A=+1 (clipped)": ([0, 1e-3, 1e-3, 0], [0, 1, 1, 0], 1.0, -HIGH, [0, 0, 0, 0]),
    "above, A=-1 (not clipped)": ([0, 3e-3, 0, 0], [0, 1, 1, 1], -1.0, S_UP, [0, S_UP / 3, S_UP / 3, S_UP / 3]),
    "below, A=+1 (not clipped)": ([0, -1e-3, 0, 0], [0, 1, 0, 0], 1.0, -S_DOWN, [0, -S_DOWN, 0, 0]),
    "below, A=-1 (clipped)": ([0, -5e-4, -1.5e-3, 0], [0, 1, 1, 0], -1.0, LOW, [0, 0, 0, 0]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_gspo_single_row_by_hand(name):
    deltas, mask, advantage, loss_expected, grad_expected = CASES[name]
    lp, old, m = rows([deltas], [mask])
    loss, metrics = gspo_loss(lp, old, torch.tensor([advantage], dtype=F64), m)
    assert loss.item() == pytest.approx(loss_expected, rel=1e-12)
    loss.backward()
    assert lp.grad[0].tolist() == pytest.approx(grad_expected, rel=1e-9, abs=1e-15)
    assert metrics["clip_fraction"] == (1.0 if "(clipped)" in name else 0.0)


def test_gspo_batch_is_the_mean_of_row_losses():
    names = list(CASES)
    lp, old, m = rows([CASES[n][0] for n in names], [CASES[n][1] for n in names])
    adv = torch.tensor([CASES[n][2] for n in names], dtype=F64)
    loss, metrics = gspo_loss(lp, old, adv, m)
    expected = (-2 * S_IN - HIGH + S_UP - S_DOWN + LOW) / 5
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    loss.backward()
    for b, n in enumerate(names):
        assert lp.grad[b].tolist() == pytest.approx([g / 5 for g in CASES[n][4]], rel=1e-9, abs=1e-15)
    # Loss tokens whose gradient clipping removed: 2 (row 2) + 2 (row 5) of 3 + 2 + 3 + 1 + 2.
    assert metrics["clip_fraction"] == pytest.approx(4 / 11)
    assert metrics["num_loss_tokens"] == 11 and metrics["num_rows"] == 5 and metrics["num_executions"] == 5


def test_gspo_per_token_advantages():
    lp, old, m = rows([[0, 1e-4, 1e-4]], [[0, 1, 1]])
    loss, _ = gspo_loss(lp, old, torch.tensor([[0.0, 1.0, 3.0]], dtype=F64), m)
    # J = (s * 1 + s * 3) / 2.
    assert loss.item() == pytest.approx(-2 * S_IN, rel=1e-12)
    loss.backward()
    assert lp.grad[0].tolist() == pytest.approx([0, -S_IN / 2, -3 * S_IN / 2], rel=1e-9)


def test_gspo_per_token_advantages_of_both_signs_clip_per_token():
    lp, old, m = rows([[0, 1e-3, 1e-3]], [[0, 1, 1]])
    loss, metrics = gspo_loss(lp, old, torch.tensor([[0.0, 1.0, -1.0]], dtype=F64), m)
    # s = e^0.001 > 1 + 4e-4: token 1 (A=+1) takes the clipped 1.0004, token 2 (A=-1) keeps -s.
    assert loss.item() == pytest.approx(-(HIGH - S_UP) / 2, rel=1e-9)
    loss.backward()
    assert lp.grad[0].tolist() == pytest.approx([0, 0, S_UP / 2], rel=1e-9)
    assert metrics["clip_fraction"] == 0.5


def test_gspo_averages_within_executions_then_over_executions():
    deltas = [[0, 1e-4, 1e-4, 0], [0, 2e-4, 2e-4, 2e-4], [0, 0, 0, 0]]
    masks = [[0, 1, 1, 0], [0, 1, 1, 1], [0, 1, 0, 0]]
    adv = torch.tensor([1.0, 1.0, -1.0], dtype=F64)
    s_a, s_b = math.exp(1e-4), math.exp(2e-4)
    lp, old, m = rows(deltas, masks)
    loss, metrics = gspo_loss(lp, old, adv, m, execution_ids=["x", "x", "y"])
    # x: its 5 tokens -> -(2 s_a + 3 s_b) / 5; y: s = 1, J = -1 -> loss 1; then the mean of the two.
    assert loss.item() == pytest.approx((-(2 * s_a + 3 * s_b) / 5 + 1.0) / 2, rel=1e-12)
    assert metrics["num_executions"] == 2
    loss.backward()
    assert lp.grad[0, 1].item() == pytest.approx(-s_a / 5 / 2, rel=1e-9)
    assert lp.grad[1, 1].item() == pytest.approx(-s_b / 5 / 2, rel=1e-9)
    assert lp.grad[2, 1].item() == pytest.approx(1 / 2, rel=1e-9)
    # Without execution ids each row is its own execution: the mean of row means.
    lp2, old2, m2 = rows(deltas, masks)
    loss2, _ = gspo_loss(lp2, old2, adv, m2)
    assert loss2.item() == pytest.approx((-s_a - s_b + 1.0) / 3, rel=1e-12)
    # Integer tensors work as execution ids too.
    loss3, _ = gspo_loss(lp2, old2, adv, m2, execution_ids=torch.tensor([4, 4, 9]))
    assert loss3.item() == pytest.approx(loss.item(), rel=1e-12)


def test_rows_without_loss_tokens_are_ignored_and_padding_garbage_stays_out():
    lp, old, m = rows([[0, 1e-4, -2e-4, 4e-4], [0, 0, 0, 0]], [[0, 1, 1, 1], [0, 0, 0, 0]])
    with torch.no_grad():
        lp[1, 2] = -math.inf  # e.g. a padded position
    loss, metrics = gspo_loss(lp, old, torch.tensor([2.0, 5.0], dtype=F64), m)
    assert loss.item() == pytest.approx(-2 * S_IN, rel=1e-12)
    loss.backward()
    assert torch.isfinite(lp.grad).all() and lp.grad[1].abs().sum() == 0
    assert metrics["num_rows"] == 1


def test_no_loss_tokens_at_all_gives_zero_and_a_working_backward():
    lp, old, m = rows([[0, 0.1, 0.2]], [[0, 0, 0]])
    loss, metrics = gspo_loss(lp, old, torch.tensor([1.0], dtype=F64), m)
    loss.backward()
    assert loss.item() == 0.0 and lp.grad.abs().sum() == 0 and metrics["num_executions"] == 0


def test_gspo_token_matches_sequence_level_gspo_in_value_and_gradient():
    """With one advantage per sequence, GSPO-token equals the paper's sequence-level objective (eq. of J_GSPO), whose
    ratio is differentiated through: written here independently, with autograd, on a random batch that clips some
    rows and not others."""
    gen = torch.Generator().manual_seed(0)
    old = -torch.rand((6, 7), generator=gen, dtype=F64) * 3
    offsets = torch.tensor([1e-3, 1e-3, 0.0, -1e-3, -1e-3, 0.0], dtype=F64)[:, None]
    lp = (old + offsets + torch.randn((6, 7), generator=gen, dtype=F64) * 1e-4).requires_grad_(True)
    mask = torch.rand((6, 7), generator=gen) < 0.7
    mask[:, 0] = False
    mask[:, 1] = True
    adv = torch.tensor([1.0, -1.0, 0.5, -2.0, 1.5, -0.5], dtype=F64)
    loss, _ = gspo_loss(lp, old, adv, mask)
    (grad,) = torch.autograd.grad(loss, lp)

    lp_ref = lp.detach().clone().requires_grad_(True)
    n = mask.sum(1).to(F64)
    s = torch.exp(((lp_ref - old) * mask).sum(1) / n)  # no stop-gradient: the sequence-level form
    j = torch.minimum(s * adv, torch.clamp(s, LOW, HIGH) * adv)
    ref = -j.mean()
    (ref_grad,) = torch.autograd.grad(ref, lp_ref)
    assert loss.item() == pytest.approx(ref.item(), rel=1e-12)
    assert torch.allclose(grad, ref_grad, rtol=1e-9, atol=1e-15)
    clipped = ((s > HIGH) & (adv > 0)) | ((s < LOW) & (adv < 0))
    assert int(clipped.sum()) == 2, "the batch should exercise both branches"


@pytest.mark.parametrize(
    "make",
    [
        lambda lp: gspo_loss(lp, lp.detach(), torch.zeros(3), torch.ones(2, 3, dtype=torch.bool)),
        lambda lp: gspo_loss(lp, lp.detach()[:1], torch.zeros(2), torch.ones(2, 3, dtype=torch.bool)),
        lambda lp: gspo_loss(lp, lp.detach(), torch.zeros(2), torch.ones(2, 2, dtype=torch.bool)),
        lambda lp: gspo_loss(lp[0], lp.detach()[0], torch.zeros(1), torch.ones(3, dtype=torch.bool)),
        lambda lp: gspo_loss(lp, lp.detach(), torch.zeros(2), torch.ones(2, 3, dtype=torch.bool), ["a"]),
        lambda lp: gspo_loss(lp, lp.detach(), torch.zeros(2), torch.ones(2, 3, dtype=torch.bool), clip_low=1.5),
    ],
)
def test_bad_loss_inputs_raise(make):
    with pytest.raises(LossInputError):
        make(torch.zeros(2, 3, requires_grad=True))


# -- samples --------------------------------------------------------------------------------------------------------


def sample(execution, tokens, mask, logprobs, advantage, weight, temperatures=None):
    n = len(tokens)
    return TrainingSample(
        execution_id=execution,
        group_id="g",
        trajectory_rank=0,
        trajectory_kind="main",
        leaf_call_index=0,
        token_ids=tuple(tokens),
        loss_mask=tuple(bool(x) for x in mask),
        behaviour_logprobs=tuple(logprobs),
        advantages=(advantage,) * n,
        weights=tuple(weight if x else 0.0 for x in mask),
        min_weight_version=0,
        max_weight_version=0,
        num_loss_tokens=sum(mask),
        sampling_temperatures=(1.0,) * n if temperatures is None else tuple(temperatures),
    )


def test_pack_and_loss_from_samples_by_hand():
    # Execution x: two samples with 2 + 1 loss tokens (weights 1/3); execution y: one sample, one loss token.
    samples = [
        sample("x", [5, 6, 7], [0, 1, 1], [0.0, -1.0, -2.0], 1.0, 1 / 3),
        sample("x", [5, 6, 9, 4], [0, 0, 0, 1], [0.0, 0.0, 0.0, -0.5], 1.0, 1 / 3),
        sample("y", [8, 3], [0, 1], [0.0, -0.25], -1.0, 1.0),
    ]
    batch = pack_samples(samples)
    assert batch.input_ids.tolist() == [[5, 6, 7, 0], [5, 6, 9, 4], [8, 3, 0, 0]]
    assert batch.lengths.tolist() == [3, 4, 2]
    assert batch.execution_ids == ("x", "x", "y")
    assert batch.temperatures.tolist() == [[1.0] * 4] * 3
    deltas = torch.tensor([[0, 1e-4, 1e-4, 0], [0, 0, 0, 2e-4], [0, 0, 0, 0]], dtype=F64)
    lp = (batch.old_log_probs + deltas).requires_grad_(True)
    loss, _ = loss_from_samples(lp, batch)
    s1, s2 = math.exp(1e-4), math.exp(2e-4)
    # x: (2 * s1 + s2) / 3; y: -1; loss = -(x + y) / 2.
    expected = -(((2 * s1 + s2) / 3) + -1.0) / 2
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    loss.backward()
    assert lp.grad[0, 1].item() == pytest.approx(-s1 / 3 / 2, rel=1e-9)
    assert lp.grad[2, 1].item() == pytest.approx(0.5, rel=1e-9)
    # The same batch through gspo_loss with execution ids: the weights encode the same averaging.
    same, _ = gspo_loss(lp.detach(), batch.old_log_probs, batch.advantages, batch.loss_mask, batch.execution_ids)
    assert same.item() == pytest.approx(expected, rel=1e-12)
    # A step spread over micro-steps divides by the step's executions.
    quarter, _ = loss_from_samples(lp.detach(), batch, num_executions=4)
    assert quarter.item() == pytest.approx(expected / 2, rel=1e-12)


def test_pack_samples_rejects_bad_input():
    good = sample("x", [1, 2], [0, 1], [0.0, -1.0], 1.0, 1.0)
    with pytest.raises(LossInputError):
        pack_samples([])
    with pytest.raises(LossInputError):
        pack_samples([good], pad_to=1)
    assert pack_samples([good], pad_to=5).input_ids.shape == (1, 5)
    with pytest.raises(LossInputError):
        loss_from_samples(torch.zeros(1, 2), pack_samples([good]), num_executions=0)
    for temperatures in ([1.0], [1.0, 0.0], [1.0, float("inf")], [1.0, -0.7]):
        with pytest.raises(LossInputError):
            pack_samples([sample("x", [1, 2], [0, 1], [0.0, -1.0], 1.0, 1.0, temperatures)])


def test_pack_samples_carries_each_tokens_temperature_and_pads_with_one():
    samples = [sample("x", [1, 2, 3], [0, 1, 1], [0.0, -1.0, -0.5], 1.0, 0.5, [1.0, 0.7, 0.7]),
               sample("y", [4, 5], [0, 1], [0.0, -0.2], -1.0, 1.0, [1.0, 0.3])]
    batch = pack_samples(samples, pad_to=4)
    assert batch.temperatures.dtype == torch.float32
    expected = torch.tensor([[1.0, 0.7, 0.7, 1.0], [1.0, 0.3, 1.0, 1.0]], dtype=torch.float32)
    assert torch.equal(batch.temperatures, expected)


def test_length_sorted_chunks_bound_the_padded_size_and_keep_every_sample():
    lengths = [7, 3, 12, 3, 5, 30, 4]
    samples = [sample(f"e{i}", [1] * n, [1] * n, [0.0] * n, 1.0, 1.0) for i, n in enumerate(lengths)]
    chunks = length_sorted_chunks(samples, 12)
    assert [[len(s.token_ids) for s in chunk] for chunk in chunks] == [[3, 3, 4], [5], [7], [12], [30]]
    assert sorted(id(s) for chunk in chunks for s in chunk) == sorted(id(s) for s in samples)
    assert length_sorted_chunks(samples, 1000) == [sorted(samples, key=lambda s: len(s.token_ids))]
    assert length_sorted_chunks([], 10) == []
    with pytest.raises(LossInputError):
        length_sorted_chunks(samples, 0)


def test_chunk_metrics_add_counts_and_weight_the_averages():
    parts = [
        {"loss": 0.5, "num_tokens": 30, "num_loss_tokens": 10.0, "num_rows": 2.0, "num_executions": 4.0,
         "clip_fraction": 0.5, "seq_ratio_mean": 1.0, "seq_log_ratio_abs_max": 0.1},
        {"loss": -0.25, "num_tokens": 50, "num_loss_tokens": 30.0, "num_rows": 6.0, "num_executions": 4.0,
         "clip_fraction": 0.1, "seq_ratio_mean": 1.2, "seq_log_ratio_abs_max": 0.3},
    ]
    combined = combine_chunk_metrics(parts)
    assert combined["loss"] == 0.25 and combined["num_tokens"] == 80 and combined["num_rows"] == 8.0
    assert combined["clip_fraction"] == pytest.approx((0.5 * 10 + 0.1 * 30) / 40)
    assert combined["seq_ratio_mean"] == pytest.approx((1.0 * 2 + 1.2 * 6) / 8)
    assert combined["seq_log_ratio_abs_max"] == 0.3 and combined["chunks"] == 2
    with pytest.raises(LossInputError):
        combine_chunk_metrics([])
