"""Gyre's model directory: a Qwen3-architecture causal LM in Hugging Face format, built from a seed.

A model directory holds config.json (Qwen3Config, fp32; the output layer tied to the embeddings or not),
model.safetensors (HF tensor names), generation_config.json, tokenizer.json and tokenizer_config.json (with the chat template). Every engine reads this
one format: the embedded engine, the Megatron trainer (through weight_convert), transformers, and SGLang at scale.
Nothing is downloaded: `init_model_dir` writes a freshly initialised model whose bytes depend only on the preset and
the seed, so tests, examples and benchmarks can build the same model anywhere.

Engines that only need token ids must work on a directory with only config.json + model.safetensors;
`ModelSpec.from_model_dir` reads just config.json for that reason.
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
from pathlib import Path
from typing import Any, Mapping

import attrs
import safetensors
import safetensors.torch
import torch

from gyre.engines.chat_template import END_OF_TEXT, IM_END
from gyre.engines.errors import ModelFormatError, ServedModelMismatch
from gyre.engines.tokenizer import MODEL_MAX_LENGTH, VOCAB_SIZE, build_tokenizer, write_tokenizer_files

__all__ = [
    "PRESETS", "ModelFormatError", "ModelSpec", "ServedModelMismatch", "check_served_model", "check_state_dict",
    "hf_param_shapes", "init_model_dir", "init_state_dict", "load_hf_state_dict", "save_hf_state_dict", "save_model_dir",
]

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
GENERATION_CONFIG_FILE = "generation_config.json"


@attrs.frozen
class ModelSpec:
    """The shape of a Qwen3 model, dense or MoE: everything an engine needs to build it (read from config.json)."""

    hidden_size: int
    """Width of the residual stream."""
    num_layers: int
    """Number of transformer blocks."""
    num_heads: int
    """Query heads per layer."""
    num_kv_heads: int
    """Key/value heads per layer (grouped-query attention: num_heads is a multiple)."""
    head_dim: int
    """Channels per attention head (Qwen3 sets it explicitly; it need not be hidden_size / num_heads)."""
    ffn_size: int
    """Width of the gated MLP (gate and up projections)."""
    vocab_size: int = VOCAB_SIZE
    """Rows of the embedding and output matrices (may exceed the tokenizer's size)."""
    max_position_embeddings: int = MODEL_MAX_LENGTH
    """Longest sequence the model is meant for."""
    rope_theta: float = 1_000_000.0
    """Base of the rotary position embedding."""
    rms_norm_eps: float = 1e-6
    """Epsilon of every RMSNorm."""
    tie_word_embeddings: bool = False
    """The output layer reuses the input embedding matrix (HF `tie_word_embeddings`; Qwen3-0.6B/1.7B/4B): the
    checkpoint has no lm_head.weight, and the trainer keeps one matrix that both ends update."""

    num_experts: int = 0
    """Experts per sparse MLP layer (HF qwen3_moe `num_experts`); 0: a dense model (model_type qwen3)."""
    num_experts_per_tok: int = 0
    """Experts the router picks per token (top-k); used only when num_experts > 0."""
    moe_ffn_size: int = 0
    """Width of each expert's gated MLP (HF `moe_intermediate_size`); dense layers keep ffn_size."""
    decoder_sparse_step: int = 1
    """Layer i is sparse when (i + 1) % decoder_sparse_step == 0 and i is not in mlp_only_layers (HF's rule)."""
    mlp_only_layers: tuple[int, ...] = attrs.field(default=(), converter=tuple)
    """Layers that keep a dense MLP in a MoE model."""
    norm_topk_prob: bool = True
    """Renormalise the top-k router probabilities to sum to one (HF `norm_topk_prob`; Qwen3-MoE: true)."""

    def __attrs_post_init__(self) -> None:
        # Sizes first: a config.json from elsewhere may hold a string or a zero, and the head check divides.
        for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "ffn_size", "vocab_size"):
            value = getattr(self, name)
            if type(value) is not int or value <= 0:
                raise ModelFormatError(f"{name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ModelFormatError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if type(self.tie_word_embeddings) is not bool:
            raise ModelFormatError(f"tie_word_embeddings must be a bool, got {self.tie_word_embeddings!r}")
        if type(self.norm_topk_prob) is not bool:
            raise ModelFormatError(f"norm_topk_prob must be a bool, got {self.norm_topk_prob!r}")
        for name in ("num_experts", "num_experts_per_tok", "moe_ffn_size", "decoder_sparse_step"):
            value = getattr(self, name)
            if type(value) is not int or value < (1 if name == "decoder_sparse_step" else 0):
                raise ModelFormatError(f"{name} must be a non-negative int (step: positive), got {value!r}")
        if self.num_experts and not (0 < self.num_experts_per_tok <= self.num_experts and self.moe_ffn_size > 0):
            raise ModelFormatError(
                f"a MoE model needs 0 < num_experts_per_tok <= num_experts and moe_ffn_size > 0, got "
                f"{self.num_experts_per_tok}, {self.num_experts}, {self.moe_ffn_size}")
        if any(type(i) is not int or not 0 <= i < self.num_layers for i in self.mlp_only_layers):
            raise ModelFormatError(f"mlp_only_layers must hold layer indices, got {self.mlp_only_layers!r}")

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_sparse_layer(self, index: int) -> bool:
        """Whether layer `index` has experts (transformers' Qwen3MoeDecoderLayer rule)."""
        return (self.is_moe and index not in self.mlp_only_layers
                and (index + 1) % self.decoder_sparse_step == 0)
    @property
    def num_params(self) -> int:
        return sum(math.prod(shape) for shape in hf_param_shapes(self).values())

    def config_dict(self, eos_token_id: int | None = None, pad_token_id: int | None = None) -> dict:
        """config.json contents (Qwen3Config). Both the new (`dtype`, `rope_parameters`) and the legacy
        (`torch_dtype`, `rope_theta`) keys are written so that older readers and SGLang find what they expect."""
        moe = {
            "num_experts": self.num_experts,
            "num_experts_per_tok": self.num_experts_per_tok,
            "moe_intermediate_size": self.moe_ffn_size,
            "decoder_sparse_step": self.decoder_sparse_step,
            "mlp_only_layers": list(self.mlp_only_layers),
            "norm_topk_prob": self.norm_topk_prob,
            # Training adds no load-balancing loss (see the trainer); inference never reads it.
            "router_aux_loss_coef": 0.0,
            "output_router_logits": False,
        } if self.is_moe else {}
        return {
            "architectures": ["Qwen3MoeForCausalLM" if self.is_moe else "Qwen3ForCausalLM"],
            "model_type": "qwen3_moe" if self.is_moe else "qwen3",
            **moe,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.ffn_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": self.max_position_embeddings,
            "initializer_range": 0.02,
            "rms_norm_eps": self.rms_norm_eps,
            "use_cache": True,
            "tie_word_embeddings": self.tie_word_embeddings,
            "rope_theta": self.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "attention_bias": False,
            "attention_dropout": 0.0,
            "use_sliding_window": False,
            "sliding_window": None,
            "max_window_layers": self.num_layers,
            "layer_types": ["full_attention"] * self.num_layers,
            "bos_token_id": None,
            "eos_token_id": eos_token_id,
            "pad_token_id": pad_token_id,
            "dtype": "float32",
            "torch_dtype": "float32",
        }

    @classmethod
    def from_config_dict(cls, config: Mapping) -> "ModelSpec":
        if not isinstance(config, Mapping):
            raise ModelFormatError(f"config.json must hold a JSON object, got {type(config).__name__}")
        model_type = config.get("model_type")
        if model_type not in ("qwen3", "qwen3_moe"):
            raise ModelFormatError(f"model_type must be 'qwen3' or 'qwen3_moe', got {model_type!r}")
        moe = {}
        if model_type == "qwen3_moe":
            moe = {"num_experts": config.get("num_experts", 0),
                   "num_experts_per_tok": config.get("num_experts_per_tok", 0),
                   "moe_ffn_size": config.get("moe_intermediate_size", 0),
                   "decoder_sparse_step": config.get("decoder_sparse_step", 1),
                   "mlp_only_layers": tuple(config.get("mlp_only_layers") or ()),
                   "norm_topk_prob": config.get("norm_topk_prob", False)}
        if config.get("attention_bias", False):
            raise ModelFormatError("attention_bias=True is not supported by Gyre's Qwen3 layout")
        if config.get("use_sliding_window", False):
            raise ModelFormatError("sliding-window attention is not supported")
        rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
        if not isinstance(rope, Mapping):
            raise ModelFormatError(f"rope parameters must be a JSON object, got {rope!r}")
        if rope.get("rope_type", rope.get("type", "default")) != "default":
            raise ModelFormatError(f"only default RoPE is supported, got {rope!r}")
        theta = rope.get("rope_theta", config.get("rope_theta", 10000.0))
        try:
            hidden = config["hidden_size"]
            heads = config["num_attention_heads"]
            return cls(
                hidden_size=hidden,
                num_layers=config["num_hidden_layers"],
                num_heads=heads,
                num_kv_heads=config.get("num_key_value_heads", heads),
                head_dim=config.get("head_dim") or hidden // heads,
                ffn_size=config["intermediate_size"],
                vocab_size=config["vocab_size"],
                max_position_embeddings=config.get("max_position_embeddings", MODEL_MAX_LENGTH),
                rope_theta=float(theta),
                rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
                tie_word_embeddings=config.get("tie_word_embeddings", False),
                **moe,
            )
        except ModelFormatError:
            raise
        except KeyError as missing:
            raise ModelFormatError(f"config.json lacks {missing}") from None
        except (TypeError, ValueError, ZeroDivisionError) as error:  # a string or a zero where a size belongs
            raise ModelFormatError(f"config.json holds a size of the wrong type or value: {error}") from None

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> "ModelSpec":
        path = Path(model_dir) / CONFIG_FILE
        if not path.is_file():
            raise ModelFormatError(f"{model_dir} has no {CONFIG_FILE}")
        try:
            config = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as error:  # ValueError covers both bad JSON and bytes that are not UTF-8
            raise ModelFormatError(f"{path} is not readable JSON: {error}") from None
        return cls.from_config_dict(config)


PRESETS: dict[str, ModelSpec] = {
    # 1.3M parameters, 0.5M of them the two 2048x128 embedding matrices; fast enough that SFT and RL of a
    # tool-using agent run in minutes on two CPU cores, deep enough (4 layers) for copying and induction.
    "tiny": ModelSpec(hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=32, ffn_size=384),
    # 5.8M parameters: the layer shape whose Megatron-on-CPU timings are in the reference notes (hidden 256,
    # head_dim 64, FFN 768), two layers deeper.
    "small": ModelSpec(hidden_size=256, num_layers=6, num_heads=4, num_kv_heads=2, head_dim=64, ffn_size=768),
    # "tiny" with one embedding matrix for input and output, the layout of Qwen3-0.6B/1.7B/4B: tests that the
    # tie survives every engine, the trainer's updates and both weight conversions.
    "tiny-tied": ModelSpec(hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=32, ffn_size=384,
                           tie_word_embeddings=True),
    # "tiny" as Qwen3-MoE: 8 experts of width 96, top-2 with renormalised weights; layer 0 stays dense and every
    # layer after it is sparse, so both MLP kinds and the mlp_only_layers rule are exercised.
    "tiny-moe": ModelSpec(hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=32, ffn_size=384,
                          num_experts=8, num_experts_per_tok=2, moe_ffn_size=96, mlp_only_layers=(0,)),
}


def hf_param_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Every tensor of Qwen3ForCausalLM by its HF name, in a fixed order (no lm_head.weight when tied: HF
    checkpoints of tied models omit it)."""
    h, q, kv = spec.hidden_size, spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (spec.vocab_size, h)}
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        shapes.update(
            {
                p + "input_layernorm.weight": (h,),
                p + "self_attn.q_proj.weight": (q, h),
                p + "self_attn.k_proj.weight": (kv, h),
                p + "self_attn.v_proj.weight": (kv, h),
                p + "self_attn.o_proj.weight": (h, q),
                p + "self_attn.q_norm.weight": (spec.head_dim,),
                p + "self_attn.k_norm.weight": (spec.head_dim,),
                p + "post_attention_layernorm.weight": (h,),
            }
        )
        if spec.is_sparse_layer(i):
            # The checkpoint layout of Qwen3-30B-A3B: one router, then each expert's three matrices.
            shapes[p + "mlp.gate.weight"] = (spec.num_experts, h)
            for e in range(spec.num_experts):
                x = f"{p}mlp.experts.{e}."
                m = spec.moe_ffn_size
                shapes.update({x + "gate_proj.weight": (m, h), x + "up_proj.weight": (m, h),
                               x + "down_proj.weight": (h, m)})
        else:
            f = spec.ffn_size
            shapes.update({p + "mlp.gate_proj.weight": (f, h), p + "mlp.up_proj.weight": (f, h),
                           p + "mlp.down_proj.weight": (h, f)})
    shapes["model.norm.weight"] = (h,)
    if not spec.tie_word_embeddings:
        shapes["lm_head.weight"] = (spec.vocab_size, h)
    return shapes


def _tensor_seed(seed: int, name: str) -> int:
    # One generator per tensor, seeded from (seed, name): a tensor's values never depend on the others' order.
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") & ((1 << 63) - 1)


def init_state_dict(spec: ModelSpec, seed: int = 0, std: float = 0.02) -> dict[str, torch.Tensor]:
    """Fresh fp32 weights: norms at one, matrices N(0, std), residual-branch outputs (o_proj, down_proj) scaled by
    1/sqrt(2 * layers) as in GPT-2 so that the residual stream's scale does not grow with depth."""
    state: dict[str, torch.Tensor] = {}
    residual_std = std / math.sqrt(2 * spec.num_layers)
    for name, shape in hf_param_shapes(spec).items():
        if len(shape) == 1:
            state[name] = torch.ones(shape, dtype=torch.float32)
            continue
        generator = torch.Generator().manual_seed(_tensor_seed(seed, name))
        scale = residual_std if name.endswith(("o_proj.weight", "down_proj.weight")) else std
        state[name] = torch.randn(shape, generator=generator, dtype=torch.float32) * scale
    return state


def check_state_dict(spec: ModelSpec, state: Mapping[str, torch.Tensor]) -> None:
    """Raise ModelFormatError unless `state` has exactly the HF tensors of `spec` with the right shapes."""
    expected = hf_param_shapes(spec)
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ModelFormatError(f"state dict mismatch: missing {missing[:5]}, unexpected {unexpected[:5]}")
    for name, shape in expected.items():
        if tuple(state[name].shape) != shape:
            raise ModelFormatError(f"{name} has shape {tuple(state[name].shape)}, expected {shape}")


def load_hf_state_dict(model_dir: str | Path) -> dict[str, torch.Tensor]:
    path = Path(model_dir) / WEIGHTS_FILE
    if not path.is_file():
        raise ModelFormatError(f"{model_dir} has no {WEIGHTS_FILE}")
    try:
        return safetensors.torch.load_file(str(path))
    except safetensors.SafetensorError as error:  # truncated or not safetensors at all; not a ValueError
        raise ModelFormatError(f"{path} is not a readable safetensors file: {error}") from None


def save_hf_state_dict(model_dir: str | Path, state: Mapping[str, torch.Tensor]) -> None:
    tensors = {name: t.detach().to("cpu", torch.float32).contiguous() for name, t in state.items()}
    safetensors.torch.save_file(tensors, str(Path(model_dir) / WEIGHTS_FILE), metadata={"format": "pt"})


SIDE_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
"""Files besides config and weights that make a directory a complete model directory (those present are kept)."""


def save_model_dir(source_dir: str | Path, target_dir: str | Path, state: Mapping[str, torch.Tensor]) -> Path:
    """Write a complete model directory: `source_dir`'s config and side files, plus these HF-named weights."""
    source, target = Path(source_dir), Path(target_dir)
    target.mkdir(parents=True, exist_ok=True)
    config = json.loads((source / CONFIG_FILE).read_text(encoding="utf-8"))
    (target / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    for name in SIDE_FILES:
        if (source / name).is_file() and (source / name).resolve() != (target / name).resolve():
            shutil.copyfile(source / name, target / name)
    save_hf_state_dict(target, state)
    return target


def write_config(model_dir: str | Path, spec: ModelSpec) -> None:
    """config.json and generation_config.json, with the token ids of this tokenizer."""
    tokenizer = build_tokenizer()
    eos, pad = tokenizer.token_to_id(IM_END), tokenizer.token_to_id(END_OF_TEXT)
    model_dir = Path(model_dir)
    (model_dir / CONFIG_FILE).write_text(json.dumps(spec.config_dict(eos, pad), indent=2) + "\n", encoding="utf-8")
    generation = {"bos_token_id": None, "eos_token_id": [eos, pad], "pad_token_id": pad, "do_sample": True,
                  "temperature": 1.0, "top_p": 1.0, "top_k": 0}
    (model_dir / GENERATION_CONFIG_FILE).write_text(json.dumps(generation, indent=2) + "\n", encoding="utf-8")


def init_model_dir(path: str | Path, preset: str | ModelSpec = "tiny", seed: int = 0) -> Path:
    """Create (or overwrite the files of) a model directory with fresh weights; bytes depend only on preset+seed."""
    if isinstance(preset, str):
        if preset not in PRESETS:
            raise ModelFormatError(f"unknown preset {preset!r}; choose from {sorted(PRESETS)}")
        spec = PRESETS[preset]
    else:
        spec = preset
    if spec.vocab_size < VOCAB_SIZE:
        raise ModelFormatError(f"vocab_size {spec.vocab_size} is smaller than the tokenizer's {VOCAB_SIZE}")
    model_dir = Path(path)
    model_dir.mkdir(parents=True, exist_ok=True)
    write_config(model_dir, spec)
    write_tokenizer_files(model_dir)
    save_hf_state_dict(model_dir, init_state_dict(spec, seed))
    return model_dir


SERVED_LAYOUT_FIELDS = ("vocab_size", "num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim", "ffn_size")
"""What must agree between an engine server's model and the model directory whose tokenizer and template are used."""


def check_served_model(info: Mapping[str, Any], spec: ModelSpec, model_dir: str) -> str:
    """Refuse (ServedModelMismatch) an engine server whose model differs from `spec` in vocabulary or layout.

    `info` is the server's /model_info answer. Gyre's engine server reports its layout there; SGLang reports its
    `model_path`, whose config.json is read when this machine sees that path. Returns how the model was checked:
    "layout", "config", or "unverified" (SGLang on another machine: the caller warns)."""
    if all(name in info for name in SERVED_LAYOUT_FIELDS):
        wrong = {name: (info[name], getattr(spec, name)) for name in SERVED_LAYOUT_FIELDS
                 if info[name] != getattr(spec, name)}
        if wrong:
            detail = ", ".join(f"{name} {got} (model_dir has {want})" for name, (got, want) in wrong.items())
            raise ServedModelMismatch(f"the engine server holds another model than {model_dir}: {detail}")
        return "layout"
    path = info.get("model_path")
    if isinstance(path, str) and (Path(path) / CONFIG_FILE).is_file():
        try:
            served = ModelSpec.from_model_dir(path)
        except ModelFormatError as error:
            raise ServedModelMismatch(f"the engine server's model {path} is not one Gyre reads: {error}") from None
        wrong_fields = [name for name in SERVED_LAYOUT_FIELDS if getattr(served, name) != getattr(spec, name)]
        if wrong_fields:
            raise ServedModelMismatch(f"the engine server serves {path}, which differs from {model_dir} in "
                                      f"{wrong_fields}")
        return "config"
    return "unverified"
