"""bf16 with fp32 master weights: the model computes in bfloat16, the optimizer and every import/export stay fp32."""

from __future__ import annotations

import pytest
import torch

from gyre.engines.errors import TrainerError
from gyre.engines.model_format import load_hf_state_dict
from gyre.engines.trainer import MegatronTrainer, TrainerConfig


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return torch.randint(0, 2041, (3, 20), generator=g), torch.tensor([20, 14, 9])


def mean_nll(lp: torch.Tensor):
    return -lp.sum() / 40.0, {}


def test_bf16_computes_in_bf16_and_keeps_fp32_master_weights(tiny_model_dir):
    torch.set_num_threads(2)
    fp32 = MegatronTrainer(tiny_model_dir)
    bf16 = MegatronTrainer(tiny_model_dir, TrainerConfig(precision="bf16", grad_clip=0.0))
    assert all(p.dtype == torch.bfloat16 for p in bf16.model.parameters())
    assert bf16.param_buffer().dtype == torch.float32 and bf16.grads_to_flat().dtype == torch.float32
    # Loaded weights are the checkpoint's fp32 values exactly, not their bf16 rounding.
    assert torch.equal(bf16.flat_params(), fp32.flat_params())
    ids, lengths = batch()
    gap = (bf16.logprobs(ids, lengths) - fp32.logprobs(ids, lengths)).abs().max()
    assert 0 < gap < 0.1  # bf16 arithmetic: close to fp32, and not secretly fp32
    # Gradients land in the fp32 sums; bf16 copies are emptied after each backward.
    bf16.forward_backward(ids, lengths, mean_nll)
    bf16.forward_backward(ids, lengths, mean_nll)
    fp32.forward_backward(ids, lengths, mean_nll)
    fp32.forward_backward(ids, lengths, mean_nll)
    cosine = torch.nn.functional.cosine_similarity(bf16.grads_to_flat(), fp32.grads_to_flat(), dim=0)
    assert cosine > 0.99
    # An update far below bf16's resolution of the weights still moves the fp32 master.
    before = bf16.flat_params()
    bf16.optimizer_step(lr=1e-6)
    moved = bf16.flat_params() - before
    assert (moved != 0).float().mean() > 0.5
    assert float(moved.abs().max()) < 2e-6
    saved = bf16.hf_state_dict()
    assert all(t.dtype == torch.float32 for t in saved.values())
    reference = load_hf_state_dict(tiny_model_dir)
    assert max(float((saved[k] - reference[k]).abs().max()) for k in reference) > 0


def test_losses_go_down_in_bf16(tiny_model_dir):
    trainer = MegatronTrainer(tiny_model_dir, TrainerConfig(precision="bf16"))
    ids, lengths = batch()
    losses = []
    for _ in range(6):
        losses.append(trainer.forward_backward(ids, lengths, mean_nll)["loss"])
        trainer.optimizer_step(lr=3e-3)
    assert losses[-1] < losses[0] - 0.5, losses


def test_unknown_precision_is_refused():
    with pytest.raises(TrainerError):
        TrainerConfig(precision="fp16")
