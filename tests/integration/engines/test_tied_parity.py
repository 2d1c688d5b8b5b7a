"""A tied model (`tie_word_embeddings: true`, the layout of Qwen3-0.6B/1.7B/4B) in every engine, against transformers.

transformers' Qwen3ForCausalLM on the same HF directory is the oracle: the Megatron trainer (both core attentions)
and the embedded engine give its log-probs within 1e-4, the trainer's gradient of the one shared matrix is the sum of
both its uses (as transformers' is), and after a few optimizer steps the exported weights are still tied and still
score the same in all three.
"""

from __future__ import annotations

import pytest
import torch

from gyre.engines.model_format import PRESETS, ModelSpec, init_model_dir, save_hf_state_dict
from gyre.engines.testing import spread_state_dict
from gyre.engines.trainer import MegatronTrainer, TrainerConfig, token_logprobs

ATOL = 1e-4
VOCAB = 2041


@pytest.fixture(scope="module")
def tied_dir(tmp_path_factory):
    torch.set_num_threads(2)
    path = init_model_dir(tmp_path_factory.mktemp("tied-model"), "tiny-tied", seed=0)
    # A wider spread than init and random norm weights, so a dropped tie or a wrong mapping shows far above 1e-4.
    state = spread_state_dict(PRESETS["tiny-tied"], seed=21)
    save_hf_state_dict(path, state)
    return path


def hf_model(model_dir):
    from transformers import Qwen3ForCausalLM

    model = Qwen3ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # transformers ties too
    return model


def padded(lengths: list[int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    for row, n in enumerate(lengths):
        ids[row, :n] = torch.randint(0, VOCAB, (n,), generator=g)
    return ids, torch.tensor(lengths)


def reference(model, ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return torch.cat([token_logprobs(model(ids[i : i + 1, :n]).logits, ids[i : i + 1, :n], lengths[i : i + 1])
                          .squeeze(0).index_select(0, torch.arange(1, n)) for i, n in enumerate(lengths.tolist())])


def flat_valid(lp: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    return torch.cat([lp[i, 1:n] for i, n in enumerate(lengths.tolist())])


@pytest.mark.parametrize("core_attention", ["sdpa", "local"])
def test_trainer_and_embedded_engine_match_transformers(tied_dir, core_attention):
    from gyre.engines.embedded_engine import EmbeddedEngine

    assert ModelSpec.from_model_dir(tied_dir).tie_word_embeddings
    model = hf_model(tied_dir)
    ids, lengths = padded([90, 33, 4], seed=1)
    expected = reference(model, ids, lengths)
    assert expected.std() > 0.3  # not near-uniform: the comparison means something
    trainer = MegatronTrainer(tied_dir, TrainerConfig(core_attention=core_attention))
    assert "output_layer.weight" not in trainer.model.state_dict()  # one matrix, not two equal ones
    got = flat_valid(trainer.logprobs(ids, lengths), lengths)
    assert (got - expected).abs().max() < ATOL
    engine = EmbeddedEngine(tied_dir)
    for i, n in enumerate(lengths.tolist()):
        scored = torch.tensor(engine.prompt_logprobs(ids[i, :n].tolist()))
        torch.testing.assert_close(scored, reference(model, ids[i : i + 1], lengths[i : i + 1]), atol=ATOL, rtol=0)


def test_shared_matrix_gradient_and_training_keep_the_tie(tied_dir, tmp_path):
    from gyre.engines.embedded_engine import EmbeddedEngine

    ids, lengths = padded([40, 25, 31], seed=2)

    def nll(lp: torch.Tensor):
        loss = -lp.sum() / (lengths - 1).sum()
        return loss, {}

    # The gradient of the shared matrix is d/dW of both the embedding lookup and the output layer, as in HF.
    model = hf_model(tied_dir).train()
    lp = torch.zeros(ids.shape)
    for i, n in enumerate(lengths.tolist()):
        row = ids[i : i + 1, :n]
        lp[i, :n] = token_logprobs(model(row).logits, row, lengths[i : i + 1])[0]
    nll(lp)[0].backward()
    trainer = MegatronTrainer(tied_dir, TrainerConfig(lr=3e-3, grad_clip=0.0))
    losses = [trainer.forward_backward(ids, lengths, nll)["loss"]]
    grads = {slot.name: trainer.grads_to_flat()[slot.offset : slot.offset + slot.numel].view(slot.shape)
             for slot in trainer.param_layout()}
    embed_grad = model.model.embed_tokens.weight.grad
    assert embed_grad.abs().max() > 1e-3
    assert (grads["embedding.word_embeddings.weight"] - embed_grad).abs().max() < 1e-5

    for _ in range(3):
        trainer.optimizer_step()
        losses.append(trainer.forward_backward(ids, lengths, nll)["loss"])
    trainer.zero_grads()
    assert losses[-1] < losses[0], losses

    exported = trainer.hf_state_dict()
    assert "lm_head.weight" not in exported
    saved = trainer.save_hf(tmp_path / "trained")
    expected = reference(hf_model(saved), ids, lengths)
    assert (flat_valid(trainer.logprobs(ids, lengths), lengths) - expected).abs().max() < ATOL
    engine = EmbeddedEngine(tied_dir)
    engine.load_weights(exported, version=trainer.version)
    scored = torch.tensor(engine.prompt_logprobs(ids[0, : lengths[0]].tolist()))
    torch.testing.assert_close(scored, reference(hf_model(saved), ids[:1], lengths[:1]), atol=ATOL, rtol=0)
