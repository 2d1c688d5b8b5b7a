"""Hugging Face Qwen3 <-> megatron-core GPTModel state dicts, both ways, bit-exact.

Pure tensor reshuffling (no megatron import), so the weight broker and the tests can use it anywhere. The mapping:

| HF (Qwen3ForCausalLM)                              | Megatron (GPTModel, local layer spec)                  |
|----------------------------------------------------|--------------------------------------------------------|
| model.embed_tokens.weight                          | embedding.word_embeddings.weight                       |
| layers.i.input_layernorm.weight                    | decoder.layers.i.input_layernorm.weight (*)            |
| layers.i.self_attn.{q,k,v}_proj.weight             | decoder.layers.i.self_attention.linear_qkv.weight      |
| layers.i.self_attn.o_proj.weight                   | decoder.layers.i.self_attention.linear_proj.weight     |
| layers.i.self_attn.{q,k}_norm.weight               | decoder.layers.i.self_attention.{q,k}_layernorm.weight |
| layers.i.post_attention_layernorm.weight           | decoder.layers.i.pre_mlp_layernorm.weight (*)          |
| layers.i.mlp.{gate,up}_proj.weight                 | decoder.layers.i.mlp.linear_fc1.weight                 |
| layers.i.mlp.down_proj.weight                      | decoder.layers.i.mlp.linear_fc2.weight                 |
| model.norm.weight                                  | decoder.final_layernorm.weight                         |
| lm_head.weight                                     | output_layer.weight                                    |

A sparse layer of a Qwen3-MoE model (`spec.is_sparse_layer(i)`) has instead of the MLP rows above:

| layers.i.mlp.gate.weight                           | decoder.layers.i.mlp.router.weight                     |
| layers.i.mlp.experts.e.{gate,up}_proj.weight       | decoder.layers.i.mlp.experts.local_experts.e.linear_fc1.weight |
| layers.i.mlp.experts.e.down_proj.weight            | decoder.layers.i.mlp.experts.local_experts.e.linear_fc2.weight |

(megatron's SequentialMLP, one MLP module per expert, the local spec's layout without grouped GEMM).

`linear_qkv` interleaves per KV group g: rows [q heads of g | k_g | v_g], each head head_dim rows, because
megatron splits the fused projection group by group (so tensor parallelism can shard whole groups).
`linear_fc1` is cat([gate, up]). (*) With the Transformer Engine layer spec (GPU) the two pre-norms are fused into
the linears: `linear_qkv.layer_norm_weight` and `linear_fc1.layer_norm_weight`; pass `fused_norms=True`.
A tied model (`spec.tie_word_embeddings`) has neither lm_head.weight nor output_layer.weight: megatron's GPTModel
with `share_embeddings_and_output_weights=True` computes the logits with the embedding matrix (on a pipeline's last
stage it keeps a copy that its gradient all-reduce keeps equal; that copy is the parallel code's business, not a
checkpoint's). An HF checkpoint that stores lm_head.weight for a tied model anyway is accepted when it equals
the embedding. Megatron's `*._extra_state` entries (FP8 metadata, None here) are not weights and are neither produced nor needed.
"""

from __future__ import annotations

from typing import Mapping

import torch

from gyre.engines.errors import ConversionError, ModelFormatError
from gyre.engines.model_format import ModelSpec, check_state_dict

__all__ = ["ConversionError", "hf_to_megatron", "megatron_layer_to_hf", "megatron_param_names", "megatron_to_hf"]


def _expert_names(spec: ModelSpec, i: int) -> list[tuple[str, str, str, str]]:
    """(hf prefix, megatron fc1, megatron fc2, hf router) per expert of sparse layer i."""
    d = f"decoder.layers.{i}.mlp.experts.local_experts."
    return [(f"model.layers.{i}.mlp.experts.{e}.", f"{d}{e}.linear_fc1.weight", f"{d}{e}.linear_fc2.weight",
             f"model.layers.{i}.mlp.gate.weight") for e in range(spec.num_experts)]


def _layer_names(i: int, fused_norms: bool, sparse: bool = False) -> dict[str, str]:
    d = f"decoder.layers.{i}."
    if sparse:
        return {
            "input_norm": d + ("self_attention.linear_qkv.layer_norm_weight" if fused_norms
                               else "input_layernorm.weight"),
            "qkv": d + "self_attention.linear_qkv.weight",
            "proj": d + "self_attention.linear_proj.weight",
            "q_norm": d + "self_attention.q_layernorm.weight",
            "k_norm": d + "self_attention.k_layernorm.weight",
            "mlp_norm": d + "pre_mlp_layernorm.weight",  # a MoE layer's norm is never fused into a linear
            "router": d + "mlp.router.weight",
        }
    return {
        "input_norm": d + ("self_attention.linear_qkv.layer_norm_weight" if fused_norms else "input_layernorm.weight"),
        "qkv": d + "self_attention.linear_qkv.weight",
        "proj": d + "self_attention.linear_proj.weight",
        "q_norm": d + "self_attention.q_layernorm.weight",
        "k_norm": d + "self_attention.k_layernorm.weight",
        "mlp_norm": d + ("mlp.linear_fc1.layer_norm_weight" if fused_norms else "pre_mlp_layernorm.weight"),
        "fc1": d + "mlp.linear_fc1.weight",
        "fc2": d + "mlp.linear_fc2.weight",
    }


def megatron_param_names(spec: ModelSpec, fused_norms: bool = False) -> list[str]:
    """Every Megatron weight name of `spec` (no `_extra_state`)."""
    names = ["embedding.word_embeddings.weight"]
    for i in range(spec.num_layers):
        sparse = spec.is_sparse_layer(i)
        names.extend(_layer_names(i, fused_norms, sparse).values())
        if sparse:
            for _, fc1, fc2, _ in _expert_names(spec, i):
                names.extend([fc1, fc2])
    names.append("decoder.final_layernorm.weight")
    return names if spec.tie_word_embeddings else [*names, "output_layer.weight"]


def hf_to_megatron(
    hf: Mapping[str, torch.Tensor], spec: ModelSpec, fused_norms: bool = False
) -> dict[str, torch.Tensor]:
    """Convert an HF Qwen3 state dict to GPTModel names and layouts (new tensors; `hf` is not modified)."""
    if spec.tie_word_embeddings and "lm_head.weight" in hf:
        embed = hf.get("model.embed_tokens.weight")
        if embed is None or not torch.equal(hf["lm_head.weight"], embed):
            raise ConversionError("a tied model's lm_head.weight must equal model.embed_tokens.weight (or be absent)")
        hf = {k: v for k, v in hf.items() if k != "lm_head.weight"}
    try:
        check_state_dict(spec, hf)
    except ModelFormatError as error:
        raise ConversionError(str(error)) from None
    hd, groups = spec.head_dim, spec.num_kv_heads
    per_group = spec.num_heads // groups
    out = {"embedding.word_embeddings.weight": hf["model.embed_tokens.weight"].clone()}
    for i in range(spec.num_layers):
        sparse = spec.is_sparse_layer(i)
        p, names = f"model.layers.{i}.", _layer_names(i, fused_norms, sparse)
        h = spec.hidden_size
        q = hf[p + "self_attn.q_proj.weight"].reshape(groups, per_group * hd, h)
        k = hf[p + "self_attn.k_proj.weight"].reshape(groups, hd, h)
        v = hf[p + "self_attn.v_proj.weight"].reshape(groups, hd, h)
        out[names["input_norm"]] = hf[p + "input_layernorm.weight"].clone()
        out[names["qkv"]] = torch.cat([q, k, v], dim=1).reshape(-1, h)
        out[names["proj"]] = hf[p + "self_attn.o_proj.weight"].clone()
        out[names["q_norm"]] = hf[p + "self_attn.q_norm.weight"].clone()
        out[names["k_norm"]] = hf[p + "self_attn.k_norm.weight"].clone()
        out[names["mlp_norm"]] = hf[p + "post_attention_layernorm.weight"].clone()
        if sparse:
            out[names["router"]] = hf[p + "mlp.gate.weight"].clone()
            for x, fc1, fc2, _ in _expert_names(spec, i):
                out[fc1] = torch.cat([hf[x + "gate_proj.weight"], hf[x + "up_proj.weight"]], dim=0)
                out[fc2] = hf[x + "down_proj.weight"].clone()
            continue
        out[names["fc1"]] = torch.cat([hf[p + "mlp.gate_proj.weight"], hf[p + "mlp.up_proj.weight"]], dim=0)
        out[names["fc2"]] = hf[p + "mlp.down_proj.weight"].clone()
    out["decoder.final_layernorm.weight"] = hf["model.norm.weight"].clone()
    if not spec.tie_word_embeddings:
        out["output_layer.weight"] = hf["lm_head.weight"].clone()
    return out


def megatron_to_hf(
    mg: Mapping[str, torch.Tensor], spec: ModelSpec, fused_norms: bool = False
) -> dict[str, torch.Tensor]:
    """Convert GPTModel weights to HF Qwen3 names; `_extra_state` entries are ignored."""
    expected = megatron_param_names(spec, fused_norms)
    weights = {k: v for k, v in mg.items() if not k.endswith("._extra_state")}
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected))
    if missing or unexpected:
        raise ConversionError(f"megatron state dict mismatch: missing {missing[:5]}, unexpected {unexpected[:5]}")
    out = {"model.embed_tokens.weight": weights["embedding.word_embeddings.weight"].detach().clone()}
    for i in range(spec.num_layers):
        out.update(megatron_layer_to_hf(weights, spec, i, fused_norms))
    out["model.norm.weight"] = weights["decoder.final_layernorm.weight"].detach().clone()
    if not spec.tie_word_embeddings:
        out["lm_head.weight"] = weights["output_layer.weight"].detach().clone()
    try:
        check_state_dict(spec, out)
    except ModelFormatError as error:
        raise ConversionError(str(error)) from None
    return out


def megatron_layer_to_hf(
    weights: Mapping[str, torch.Tensor], spec: ModelSpec, i: int, fused_norms: bool = False
) -> dict[str, torch.Tensor]:
    """Decoder layer `i`'s weights under HF names, from a mapping that holds at least that layer's megatron weights
    (what `megatron_to_hf` does per layer; a publisher converting bucket by bucket calls it directly)."""
    hd, groups, h = spec.head_dim, spec.num_kv_heads, spec.hidden_size
    per_group = spec.num_heads // groups
    out: dict[str, torch.Tensor] = {}
    sparse = spec.is_sparse_layer(i)
    p, names = f"model.layers.{i}.", _layer_names(i, fused_norms, sparse)
    qkv = weights[names["qkv"]].detach()
    if tuple(qkv.shape) != ((per_group + 2) * groups * hd, h):
        raise ConversionError(f"{names['qkv']} has shape {tuple(qkv.shape)}, which does not fit {spec}")
    qkv = qkv.reshape(groups, (per_group + 2) * hd, h)
    q, k, v = qkv.split([per_group * hd, hd, hd], dim=1)
    out[p + "input_layernorm.weight"] = weights[names["input_norm"]].detach().clone()
    out[p + "self_attn.q_proj.weight"] = q.reshape(-1, h).clone()
    out[p + "self_attn.k_proj.weight"] = k.reshape(-1, h).clone()
    out[p + "self_attn.v_proj.weight"] = v.reshape(-1, h).clone()
    out[p + "self_attn.o_proj.weight"] = weights[names["proj"]].detach().clone()
    out[p + "self_attn.q_norm.weight"] = weights[names["q_norm"]].detach().clone()
    out[p + "self_attn.k_norm.weight"] = weights[names["k_norm"]].detach().clone()
    out[p + "post_attention_layernorm.weight"] = weights[names["mlp_norm"]].detach().clone()
    if sparse:
        out[p + "mlp.gate.weight"] = weights[names["router"]].detach().clone()
        for x, fc1, fc2, _ in _expert_names(spec, i):
            gate, up = weights[fc1].detach().split([spec.moe_ffn_size, spec.moe_ffn_size], dim=0)
            out[x + "gate_proj.weight"], out[x + "up_proj.weight"] = gate.clone(), up.clone()
            out[x + "down_proj.weight"] = weights[fc2].detach().clone()
        return out
    gate, up = weights[names["fc1"]].detach().split([spec.ffn_size, spec.ffn_size], dim=0)
    out[p + "mlp.gate_proj.weight"] = gate.clone()
    out[p + "mlp.up_proj.weight"] = up.clone()
    out[p + "mlp.down_proj.weight"] = weights[names["fc2"]].detach().clone()
    return out
