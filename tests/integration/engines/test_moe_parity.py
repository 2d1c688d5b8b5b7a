"""Qwen3-MoE (`qwen3_moe`) in the embedded engine and the trainer against transformers' Qwen3MoeForCausalLM on the same directory.

The tiny-moe preset keeps layer 0 dense (mlp_only_layers) and makes the others sparse (8 experts, top 2,
renormalised); a second model makes every other layer sparse with unnormalised top-1 weights, so each of the three
routing options changes the answer. Weights are spread wider than init so a wrong router or expert mapping shows
far above the 1e-4 tolerance. Both prefill (prompt scoring) and decoding (greedy generation) are checked, then the
Megatron trainer (megatron-core's MoE layer: router, SequentialMLP experts, allgather dispatcher, dropless) on the
same directory, and a few training steps whose exported weights all three engines still score alike.
"""

from __future__ import annotations

import pytest
import torch

from gyre.engines.model_format import PRESETS, ModelSpec, init_model_dir, save_hf_state_dict
from gyre.engines.testing import spread_state_dict
from gyre.engines.trainer import token_logprobs

ATOL = 1e-4
SPECS = {
    "tiny-moe": PRESETS["tiny-moe"],
    "step2-top1": ModelSpec(hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=32, ffn_size=384,
                            num_experts=4, num_experts_per_tok=1, moe_ffn_size=64, decoder_sparse_step=2,
                            norm_topk_prob=False),
}


@pytest.fixture(scope="module", params=sorted(SPECS))
def moe_dir(request, tmp_path_factory):
    torch.set_num_threads(2)
    spec = SPECS[request.param]
    path = init_model_dir(tmp_path_factory.mktemp("moe-model"), spec, seed=0)
    state = spread_state_dict(spec, seed=41)
    save_hf_state_dict(path, state)
    return path


@pytest.fixture(scope="module")
def hf_model(moe_dir):
    from transformers import Qwen3MoeForCausalLM

    return Qwen3MoeForCausalLM.from_pretrained(moe_dir, dtype=torch.float32).eval()


def reference(model, ids: list[int]) -> torch.Tensor:
    batch = torch.tensor([ids])
    with torch.no_grad():
        return token_logprobs(model(batch).logits, batch, torch.tensor([len(ids)]))[0, 1:]


def random_ids(seed: int, n: int) -> list[int]:
    return torch.randint(0, 2041, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_spec_reads_the_moe_config(moe_dir):
    spec = ModelSpec.from_model_dir(moe_dir)
    assert spec.is_moe and any(spec.is_sparse_layer(i) for i in range(spec.num_layers))
    assert not all(spec.is_sparse_layer(i) for i in range(spec.num_layers))  # a dense layer too


@pytest.mark.parametrize("length", [3, 64])
def test_embedded_prompt_logprobs_match(moe_dir, hf_model, length):
    from gyre.engines.embedded_engine import EmbeddedEngine

    ids = random_ids(length, length)
    expected = reference(hf_model, ids)
    if length > 10:
        assert expected.std() > 0.3
    got = torch.tensor(EmbeddedEngine(moe_dir).prompt_logprobs(ids))
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


def test_embedded_greedy_generation_matches(moe_dir, hf_model):
    from gyre.engines.embedded_engine import EmbeddedEngine, SamplingParams

    engine = EmbeddedEngine(moe_dir)
    prompts = {"a": random_ids(1, 30), "b": random_ids(2, 11)}  # two decode rows route through the experts together
    for rid, prompt in prompts.items():
        engine.submit(rid, prompt, SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True), True)
    outputs = {}
    while engine.has_work():
        for event in engine.step():
            if event.finished is not None:
                outputs[event.rid] = event.finished
    for rid, prompt in prompts.items():
        out = outputs[rid]
        full = reference(hf_model, prompt + list(out.output_ids))
        torch.testing.assert_close(torch.tensor(out.output_logprobs), full[len(prompt) - 1 :], atol=ATOL, rtol=0)


@pytest.mark.parametrize("core_attention", ["sdpa", "local"])
def test_megatron_trainer_matches_transformers(moe_dir, hf_model, core_attention):
    from gyre.engines.trainer import MegatronTrainer, TrainerConfig

    trainer = MegatronTrainer(moe_dir, TrainerConfig(core_attention=core_attention))
    rows = [random_ids(7, 45), random_ids(8, 12)]
    ids = torch.zeros(2, 45, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row)
    lp = trainer.logprobs(ids, torch.tensor([len(r) for r in rows]))
    for i, row in enumerate(rows):
        torch.testing.assert_close(lp[i, 1 : len(row)], reference(hf_model, row), atol=ATOL, rtol=0)


def test_training_steps_move_router_and_experts_and_export_scores_the_same(moe_dir, tmp_path):
    from transformers import Qwen3MoeForCausalLM

    from gyre.engines.embedded_engine import EmbeddedEngine
    from gyre.engines.trainer import MegatronTrainer, TrainerConfig

    trainer = MegatronTrainer(moe_dir, TrainerConfig(lr=2e-3))
    ids = torch.tensor([random_ids(9, 40), random_ids(10, 40)])
    lengths = torch.tensor([40, 33])

    def nll(lp):
        loss = -lp.sum() / (lengths - 1).sum()
        return loss, {}

    before = trainer.hf_state_dict()
    losses = []
    for _ in range(4):
        losses.append(trainer.forward_backward(ids, lengths, nll)["loss"])
        trainer.optimizer_step()
    assert losses[-1] < losses[0], losses
    after = trainer.hf_state_dict()
    sparse = next(i for i in range(trainer.spec.num_layers) if trainer.spec.is_sparse_layer(i))
    router = f"model.layers.{sparse}.mlp.gate.weight"
    assert not torch.equal(before[router], after[router])  # the router learns through the policy loss alone
    saved = trainer.save_hf(tmp_path / "trained")
    model = Qwen3MoeForCausalLM.from_pretrained(saved, dtype=torch.float32).eval()
    row = ids[0].tolist()
    expected = reference(model, row)
    torch.testing.assert_close(trainer.logprobs(ids[:1], lengths[:1])[0, 1:], expected, atol=ATOL, rtol=0)
    engine = EmbeddedEngine(moe_dir)
    engine.load_weights(after, version=trainer.version)
    torch.testing.assert_close(torch.tensor(engine.prompt_logprobs(row)), expected, atol=ATOL, rtol=0)
