"""HF <-> Megatron weight conversion: exact both ways, and the fused-QKV layout megatron expects."""

from __future__ import annotations

import pytest
import torch

from gyre.engines.errors import ConversionError
from gyre.engines.model_format import PRESETS, ModelSpec, init_state_dict, load_hf_state_dict
from gyre.engines.weight_convert import hf_to_megatron, megatron_param_names, megatron_to_hf

SPECS = [
    PRESETS["tiny"],
    # Several query heads per group, head_dim != hidden / heads, odd sizes.
    ModelSpec(hidden_size=48, num_layers=2, num_heads=6, num_kv_heads=2, head_dim=8, ffn_size=40, vocab_size=50),
    # Multi-head attention (one query head per group).
    ModelSpec(hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=4, head_dim=8, ffn_size=24, vocab_size=20),
    PRESETS["tiny-tied"],
    PRESETS["tiny-moe"],
    # MoE with every second layer sparse and unnormalised top-k weights.
    ModelSpec(hidden_size=32, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=8, ffn_size=24, vocab_size=20,
              num_experts=3, num_experts_per_tok=1, moe_ffn_size=8, decoder_sparse_step=2, norm_topk_prob=False),
]


@pytest.mark.parametrize("spec", SPECS, ids=["tiny", "gqa3", "mha", "tied", "moe", "moe-step2"])
@pytest.mark.parametrize("fused_norms", [False, True])
def test_round_trip_is_bit_exact(spec, fused_norms):
    hf = init_state_dict(spec, seed=7)
    mg = hf_to_megatron(hf, spec, fused_norms=fused_norms)
    assert sorted(mg) == sorted(megatron_param_names(spec, fused_norms))
    back = megatron_to_hf(mg, spec, fused_norms=fused_norms)
    assert back.keys() == hf.keys()
    for name in hf:
        assert torch.equal(back[name], hf[name]), name
    # And the other way round.
    again = hf_to_megatron(back, spec, fused_norms=fused_norms)
    for name in mg:
        assert torch.equal(again[name], mg[name]), name


def test_qkv_rows_are_grouped_q_then_k_then_v():
    spec = SPECS[1]  # 6 query heads, 2 groups, head_dim 8
    hf = init_state_dict(spec, seed=0)
    p = "model.layers.0.self_attn."
    hd, h = spec.head_dim, spec.hidden_size
    # Label every row by (kind, head) so the layout can be read off the fused matrix.
    for kind, heads in (("q", 6), ("k", 2), ("v", 2)):
        code = {"q": 0, "k": 100, "v": 200}[kind]
        hf[p + f"{kind}_proj.weight"] = torch.tensor(
            [[float(code + head)] * h for head in range(heads) for _ in range(hd)])
    qkv = hf_to_megatron(hf, spec)["decoder.layers.0.self_attention.linear_qkv.weight"]
    labels = [int(qkv[row, 0]) for row in range(0, qkv.shape[0], hd)]
    assert labels == [0, 1, 2, 100, 200, 3, 4, 5, 101, 201]


def test_fc1_is_gate_then_up():
    spec = SPECS[2]
    hf = init_state_dict(spec, seed=0)
    fc1 = hf_to_megatron(hf, spec)["decoder.layers.0.mlp.linear_fc1.weight"]
    assert torch.equal(fc1[: spec.ffn_size], hf["model.layers.0.mlp.gate_proj.weight"])
    assert torch.equal(fc1[spec.ffn_size :], hf["model.layers.0.mlp.up_proj.weight"])


def test_extra_state_is_ignored_and_mismatches_raise():
    spec = SPECS[2]
    hf = init_state_dict(spec, seed=0)
    mg = hf_to_megatron(hf, spec)
    mg["output_layer._extra_state"] = None
    assert torch.equal(megatron_to_hf(mg, spec)["lm_head.weight"], hf["lm_head.weight"])
    with pytest.raises(ConversionError):
        hf_to_megatron({k: v for k, v in hf.items() if k != "lm_head.weight"}, spec)
    with pytest.raises(ConversionError):
        megatron_to_hf({**mg, "decoder.layers.9.mlp.linear_fc2.weight": torch.zeros(1)}, spec)
    with pytest.raises(ConversionError):
        megatron_to_hf(mg, SPECS[1])
    bad = dict(mg)
    bad["decoder.layers.0.self_attention.linear_qkv.weight"] = torch.zeros(3, spec.hidden_size)
    with pytest.raises(ConversionError):
        megatron_to_hf(bad, spec)


def test_names_match_megatron_gpt_model(tiny_model_dir):
    """The converted dict loads into a real GPTModel with nothing missing but `_extra_state`."""
    from gyre.engines.trainer import build_gpt_model

    spec = PRESETS["tiny"]
    model = build_gpt_model(spec)
    result = model.load_state_dict(hf_to_megatron(load_hf_state_dict(tiny_model_dir), spec), strict=False)
    assert not result.unexpected_keys
    assert all(k.endswith("._extra_state") for k in result.missing_keys)
    back = megatron_to_hf(model.state_dict(), spec)
    original = load_hf_state_dict(tiny_model_dir)
    assert all(torch.equal(back[k], original[k]) for k in original)


def test_tied_models_have_no_output_layer_and_accept_an_equal_lm_head():
    spec = PRESETS["tiny-tied"]
    hf = init_state_dict(spec, seed=3)
    mg = hf_to_megatron(hf, spec)
    assert "output_layer.weight" not in mg and "lm_head.weight" not in megatron_to_hf(mg, spec)
    # Some tied checkpoints store the (equal) output matrix anyway: accepted, and it changes nothing.
    with_head = {**hf, "lm_head.weight": hf["model.embed_tokens.weight"].clone()}
    assert all(torch.equal(hf_to_megatron(with_head, spec)[k], v) for k, v in mg.items())
    with pytest.raises(ConversionError):  # an lm_head that differs would be silently dropped: refuse it
        hf_to_megatron({**hf, "lm_head.weight": torch.zeros_like(hf["model.embed_tokens.weight"])}, spec)
    with pytest.raises(ConversionError):  # a megatron state with an output layer is not the tied layout
        megatron_to_hf({**mg, "output_layer.weight": mg["embedding.word_embeddings.weight"]}, spec)
