"""Qwen3 forward pass in plain torch over a paged KV pool.

One call runs one engine step: every sequence in the batch contributes its new tokens (a prefill chunk, or the one
token of a decode step). The dense parts (norms, projections, MLP) run once over all new tokens packed into one
[tokens, hidden] matrix. Attention reads keys and values through each sequence's block table:
- all sequences with one new token form one decode group, attended with one SDPA call and a padding mask. Their
  keys and values come from a staging buffer (`_Staging`): contiguous per-sequence copies that persist across
  steps and grow by one token per step, so a step does not re-gather every context from the pool. Sequences that
  join the group are copied in once; when the buffer would exceed its memory budget the group is gathered from
  the pool with one `index_select` per layer instead;
- each longer chunk attends on its own (a causal mask offset by its cached prefix); a chunk without a cached prefix
  attends to its freshly computed keys directly, without reading the pool back.
The pool stays the one source of truth: every new token's K and V are written into it in the same step.

The weights keep Hugging Face's names at the boundary (`load_hf_state_dict`) and are fused inside (q/k/v into one
projection, gate/up into one) so each layer costs few matrix multiplications. Numerics follow transformers'
Qwen3ForCausalLM (RMSNorm in float32, QK-norm on the head dim before RoPE, rotate-half RoPE).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Mapping, Sequence

import attrs
import torch
import torch.nn.functional as F

from gyre.engines.errors import ModelFormatError
from gyre.engines.kv_pool import KVPool, torch_dtype


# Tokens a staged decode group can grow before its buffer is rebuilt (see `_Staging`).
STAGING_HEADROOM_TOKENS = 32


@attrs.frozen
class Qwen3Spec:
    """The architecture numbers of a Qwen3 checkpoint (from its config.json)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    num_experts: int = 0
    """Experts per sparse layer (qwen3_moe); 0: dense."""
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    norm_topk_prob: bool = False

    def is_sparse_layer(self, index: int) -> bool:
        """transformers' Qwen3MoeDecoderLayer rule for which layers have experts."""
        return (self.num_experts > 0 and index not in self.mlp_only_layers
                and (index + 1) % self.decoder_sparse_step == 0)

    @classmethod
    def from_config(cls, config: Mapping) -> Qwen3Spec:
        if not isinstance(config, Mapping):
            raise ModelFormatError(f"config.json must hold a JSON object, got {type(config).__name__}")
        model_type = config.get("model_type")
        if model_type not in ("qwen3", "qwen3_moe"):
            raise ModelFormatError(f"config.json model_type is {model_type!r}; this engine runs 'qwen3' and "
                                   "'qwen3_moe' only")
        rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
        if not isinstance(rope, Mapping):
            raise ModelFormatError(f"rope parameters must be a JSON object, got {rope!r}")
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ModelFormatError(f"rope type {rope_type!r} is not supported (only 'default')")
        rope_theta = rope.get("rope_theta", config.get("rope_theta", 10000.0))
        if config.get("use_sliding_window"):
            raise ModelFormatError("sliding-window attention is not supported")
        if config.get("attention_bias"):
            raise ModelFormatError("attention_bias=true is not supported (Qwen3 has none)")
        if config.get("hidden_act", "silu") != "silu":
            raise ModelFormatError(f"hidden_act {config.get('hidden_act')!r} is not supported (only 'silu')")
        try:
            num_heads = int(config["num_attention_heads"])
            spec = cls(
                vocab_size=int(config["vocab_size"]),
                hidden_size=int(config["hidden_size"]),
                intermediate_size=int(config["intermediate_size"]),
                num_layers=int(config["num_hidden_layers"]),
                num_heads=num_heads,
                num_kv_heads=int(config.get("num_key_value_heads") or num_heads),
                head_dim=int(config.get("head_dim") or int(config["hidden_size"]) // num_heads),
                rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
                rope_theta=float(rope_theta),
                max_position_embeddings=int(config.get("max_position_embeddings", 32768)),
                tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
                **({} if model_type == "qwen3" else {
                    "num_experts": int(config.get("num_experts", 0)),
                    "num_experts_per_tok": int(config.get("num_experts_per_tok", 0)),
                    "moe_intermediate_size": int(config.get("moe_intermediate_size", 0)),
                    "decoder_sparse_step": int(config.get("decoder_sparse_step", 1)),
                    "mlp_only_layers": tuple(int(i) for i in config.get("mlp_only_layers") or ()),
                    "norm_topk_prob": bool(config.get("norm_topk_prob", False)),
                }),
            )
        except (KeyError, TypeError, ValueError, ZeroDivisionError) as error:
            raise ModelFormatError(f"config.json lacks or mangles a Qwen3 field: {error}") from None
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim"):
            if getattr(spec, name) <= 0:
                raise ModelFormatError(f"{name} must be positive, got {getattr(spec, name)}")
        if spec.num_experts and not (0 < spec.num_experts_per_tok <= spec.num_experts
                                     and spec.moe_intermediate_size > 0 and spec.decoder_sparse_step > 0):
            raise ModelFormatError("a qwen3_moe config needs 0 < num_experts_per_tok <= num_experts, "
                                   "moe_intermediate_size > 0 and decoder_sparse_step > 0")
        if spec.num_heads % spec.num_kv_heads:
            raise ModelFormatError(
                f"num_attention_heads {spec.num_heads} is not a multiple of num_key_value_heads {spec.num_kv_heads}"
            )
        return spec

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> Qwen3Spec:
        path = Path(model_dir) / "config.json"
        if not path.exists():
            raise ModelFormatError(f"{model_dir} has no config.json")
        try:
            config = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as error:  # ValueError covers both bad JSON and bytes that are not UTF-8
            raise ModelFormatError(f"{path} is not readable JSON: {error}") from None
        return cls.from_config(config)

    def hf_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every Hugging Face tensor name of this architecture and its shape."""
        h, hd = self.hidden_size, self.head_dim
        shapes: dict[str, tuple[int, ...]] = {
            "model.embed_tokens.weight": (self.vocab_size, h),
            "model.norm.weight": (h,),
        }
        if not self.tie_word_embeddings:
            shapes["lm_head.weight"] = (self.vocab_size, h)
        for i in range(self.num_layers):
            p = f"model.layers.{i}."
            shapes[p + "input_layernorm.weight"] = (h,)
            shapes[p + "post_attention_layernorm.weight"] = (h,)
            shapes[p + "self_attn.q_proj.weight"] = (self.num_heads * hd, h)
            shapes[p + "self_attn.k_proj.weight"] = (self.num_kv_heads * hd, h)
            shapes[p + "self_attn.v_proj.weight"] = (self.num_kv_heads * hd, h)
            shapes[p + "self_attn.o_proj.weight"] = (h, self.num_heads * hd)
            shapes[p + "self_attn.q_norm.weight"] = (hd,)
            shapes[p + "self_attn.k_norm.weight"] = (hd,)
            if self.is_sparse_layer(i):
                m = self.moe_intermediate_size
                shapes[p + "mlp.gate.weight"] = (self.num_experts, h)
                for e in range(self.num_experts):
                    shapes[f"{p}mlp.experts.{e}.gate_proj.weight"] = (m, h)
                    shapes[f"{p}mlp.experts.{e}.up_proj.weight"] = (m, h)
                    shapes[f"{p}mlp.experts.{e}.down_proj.weight"] = (h, m)
                continue
            shapes[p + "mlp.gate_proj.weight"] = (self.intermediate_size, h)
            shapes[p + "mlp.up_proj.weight"] = (self.intermediate_size, h)
            shapes[p + "mlp.down_proj.weight"] = (h, self.intermediate_size)
        return shapes


def read_safetensors_dir(model_dir: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of model.safetensors, or of the shards named by model.safetensors.index.json."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    def load(path: Path) -> dict[str, torch.Tensor]:
        try:
            return load_file(str(path))
        except (OSError, SafetensorError) as error:  # a missing shard, a truncated or foreign file
            raise ModelFormatError(f"{path} is not a readable safetensors file: {error}") from None

    root = Path(model_dir)
    single = root / "model.safetensors"
    if single.exists():
        return load(single)
    index = root / "model.safetensors.index.json"
    if index.exists():
        try:
            document = json.loads(index.read_text(encoding="utf-8"))
        except (OSError, ValueError) as error:
            raise ModelFormatError(f"{index} is not readable JSON: {error}") from None
        weight_map = document.get("weight_map") if isinstance(document, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(shard, str) for shard in weight_map.values()):
            raise ModelFormatError(f"{index} has no weight_map from tensor names to shard files")
        shards = sorted(set(weight_map.values()))
        state: dict[str, torch.Tensor] = {}
        for shard in shards:
            state.update(load(root / shard))
        return state
    raise ModelFormatError(f"{model_dir} has neither model.safetensors nor model.safetensors.index.json")


class _Layer:
    # router, expert_gate_up [E, 2m, h] and expert_down [E, h, m] are set on sparse layers only (else None).
    __slots__ = ("input_norm", "post_norm", "qkv", "o", "q_norm", "k_norm", "qk_norm", "gate_up", "down", "router",
                 "expert_gate_up", "expert_down")


@attrs.frozen
class SeqChunk:
    """One sequence's part of a forward step."""

    token_ids: Sequence[int]
    """The new tokens, whose KV this step computes and writes."""
    start_pos: int
    """Position of the first new token = number of this sequence's tokens already in the pool."""
    block_table: Sequence[int]
    """Pool blocks of the sequence, covering at least start_pos + len(token_ids) tokens."""
    logits: str = "last"
    """Which logits to return: "last" (next-token), "all" (every new token) or "none"."""
    seq_key: object = None
    """Identity of the sequence across steps (lets its decode K/V stay staged); None opts out of staging."""


class _Plan:
    """Index tensors of one step, built once and used by every layer."""

    __slots__ = (
        "tokens", "positions", "slots", "cos", "sin", "num_decode", "decode_tables", "decode_starts",
        "decode_keys", "decode_blocks", "decode_mask", "decode_context", "prefills", "logit_rows", "staged",
        "stage_rows", "stage_pos", "stage_identity", "stage_mask",
    )


class _Staging:
    """Contiguous K/V of the decode group, [layers, 2, rows, kv_heads, capacity, head_dim], kept across steps.

    Why: gathering every decoding sequence's blocks from the pool costs a copy of the whole context per layer
    per step; a decode group is stable for many steps, so a copy that only grows by one token per step turns
    that into one small write. The pool stays the source of truth (the prefix cache and exports read it).
    """

    __slots__ = ("tensor", "keys", "filled", "capacity")

    def __init__(self, tensor: torch.Tensor, keys: list, filled: list[int], capacity: int) -> None:
        self.tensor = tensor
        self.keys = keys
        self.filled = filled
        self.capacity = capacity


class Qwen3Paged:
    """Qwen3 weights plus the forward pass over a `KVPool`. Not thread-safe: one engine thread drives it."""

    def __init__(self, spec: Qwen3Spec, dtype: str = "float32", staging_max_bytes: int = 256 << 20) -> None:
        self.spec = spec
        self.staging_max_bytes = staging_max_bytes
        self._staging: _Staging | None = None
        self.dtype = torch_dtype(dtype)
        self.dtype_name = dtype
        self._layers: list[_Layer] = []
        self._embed: torch.Tensor | None = None
        self._lm_head: torch.Tensor | None = None
        self._final_norm: torch.Tensor | None = None
        self._rope_cos = torch.empty(0)
        self._rope_sin = torch.empty(0)
        self._scratch: dict[str, torch.Tensor] = {}
        self._shapes = spec.hf_shapes()

    # ---- weights ------------------------------------------------------------------------------------------

    @property
    def has_weights(self) -> bool:
        return self._embed is not None

    def allocate_weights(self) -> None:
        """Create zeroed weight tensors (before a full load)."""
        s = self.spec
        h, hd, dt = s.hidden_size, s.head_dim, self.dtype
        self._embed = torch.zeros(s.vocab_size, h, dtype=dt)
        self._lm_head = self._embed if s.tie_word_embeddings else torch.zeros(s.vocab_size, h, dtype=dt)
        self._final_norm = torch.ones(h, dtype=dt)
        self._layers = []
        for index in range(s.num_layers):
            layer = _Layer()
            layer.router = layer.expert_gate_up = layer.expert_down = None
            layer.input_norm = torch.ones(h, dtype=dt)
            layer.post_norm = torch.ones(h, dtype=dt)
            layer.qkv = torch.zeros((s.num_heads + 2 * s.num_kv_heads) * hd, h, dtype=dt)
            layer.o = torch.zeros(h, s.num_heads * hd, dtype=dt)
            layer.q_norm = torch.ones(hd, dtype=dt)
            layer.k_norm = torch.ones(hd, dtype=dt)
            if s.is_sparse_layer(index):
                m = s.moe_intermediate_size
                layer.gate_up = layer.down = None
                layer.router = torch.zeros(s.num_experts, h, dtype=dt)
                layer.expert_gate_up = torch.zeros(s.num_experts, 2 * m, h, dtype=dt)
                layer.expert_down = torch.zeros(s.num_experts, h, m, dtype=dt)
            else:
                layer.gate_up = torch.zeros(2 * s.intermediate_size, h, dtype=dt)
                layer.down = torch.zeros(h, s.intermediate_size, dtype=dt)
            self._layers.append(layer)
            self._refresh_qk_norm(layer)

    def release_weights(self) -> None:
        """Drop every weight tensor (memory goes back once nothing else holds them)."""
        self._layers = []
        self._embed = self._lm_head = self._final_norm = None
        self._scratch.clear()
        self._staging = None

    def _refresh_qk_norm(self, layer: _Layer) -> None:
        # One [heads + kv_heads, head_dim] weight so q and k are normalised in one op.
        s = self.spec
        layer.qk_norm = torch.cat(
            [layer.q_norm.expand(s.num_heads, -1), layer.k_norm.expand(s.num_kv_heads, -1)], 0
        ).contiguous()

    def _target(self, name: str) -> torch.Tensor:
        """The (view of the) internal tensor that holds HF tensor `name`."""
        s = self.spec
        if name == "model.embed_tokens.weight":
            return self._embed  # type: ignore[return-value]
        if name == "lm_head.weight":
            return self._lm_head  # type: ignore[return-value]
        if name == "model.norm.weight":
            return self._final_norm  # type: ignore[return-value]
        parts = name.split(".")
        layer = self._layers[int(parts[2])]
        leaf = ".".join(parts[3:])
        q_rows, kv_rows, inter = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim, s.intermediate_size
        if leaf == "input_layernorm.weight":
            return layer.input_norm
        if leaf == "post_attention_layernorm.weight":
            return layer.post_norm
        if leaf == "self_attn.q_proj.weight":
            return layer.qkv[:q_rows]
        if leaf == "self_attn.k_proj.weight":
            return layer.qkv[q_rows : q_rows + kv_rows]
        if leaf == "self_attn.v_proj.weight":
            return layer.qkv[q_rows + kv_rows :]
        if leaf == "self_attn.o_proj.weight":
            return layer.o
        if leaf == "self_attn.q_norm.weight":
            return layer.q_norm
        if leaf == "self_attn.k_norm.weight":
            return layer.k_norm
        if leaf == "mlp.gate.weight":
            return layer.router
        if leaf.startswith("mlp.experts."):
            expert, m = int(parts[5]), s.moe_intermediate_size
            kind = parts[6]
            if kind == "gate_proj":
                return layer.expert_gate_up[expert, :m]
            if kind == "up_proj":
                return layer.expert_gate_up[expert, m:]
            return layer.expert_down[expert]
        if leaf == "mlp.gate_proj.weight":
            return layer.gate_up[:inter]
        if leaf == "mlp.up_proj.weight":
            return layer.gate_up[inter:]
        if leaf == "mlp.down_proj.weight":
            return layer.down
        raise AssertionError(name)

    def load_hf_state_dict(self, state: Mapping[str, torch.Tensor], partial: bool = False) -> None:
        """Copy Hugging Face named tensors into the model, checking names and shapes first.

        `partial=False` demands every tensor of the architecture (a tied model may omit lm_head.weight);
        `partial=True` updates only the given ones (weight updates arrive in buckets). Nothing is written unless
        every name and shape checks out.
        """
        names = set(state)
        if self.spec.tie_word_embeddings:
            names.discard("lm_head.weight")
        unknown = sorted(n for n in names if n not in self._shapes)
        if unknown:
            raise ModelFormatError(f"unknown tensor names for this Qwen3 model: {unknown[:5]}")
        if not partial:
            missing = sorted(n for n in self._shapes if n not in names)
            if missing:
                raise ModelFormatError(f"missing tensors: {missing[:5]} ({len(missing)} in all)")
        for name in names:
            shape = tuple(state[name].shape)
            if shape != self._shapes[name]:
                raise ModelFormatError(f"{name} has shape {shape}, expected {self._shapes[name]}")
        if not self.has_weights:
            if partial:
                raise ModelFormatError("weights are released: a partial update cannot rebuild them")
            self.allocate_weights()
        touched_layers = set()
        with torch.no_grad():
            for name in names:
                self._target(name).copy_(state[name])
                if name.endswith("_norm.weight") and ".self_attn." in name:
                    touched_layers.add(int(name.split(".")[2]))
        for i in touched_layers:
            self._refresh_qk_norm(self._layers[i])

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """Copies of the weights under Hugging Face names (for tests and checkpoints)."""
        return {name: self._target(name).clone() for name in self._shapes}

    # ---- rope ---------------------------------------------------------------------------------------------

    def _rope(self, positions: torch.Tensor, max_position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and a signed sin per position, [tokens, 1, head_dim]: rotate_half(x) * sin equals
        roll(x, half) * signed_sin, which costs one op instead of four."""
        if self._rope_cos.shape[0] <= max_position:
            length = max(2 * self._rope_cos.shape[0], max_position + 1, 4096)
            hd = self.spec.head_dim
            inv_freq = 1.0 / (self.spec.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float) / hd))
            freqs = torch.arange(length, dtype=torch.float).unsqueeze(-1) * inv_freq
            emb = torch.cat((freqs, freqs), dim=-1)
            sin = emb.sin()
            sin[:, : hd // 2] *= -1
            self._rope_cos = emb.cos().to(self.dtype)
            self._rope_sin = sin.to(self.dtype)
        return self._rope_cos[positions].unsqueeze(1), self._rope_sin[positions].unsqueeze(1)

    # ---- forward ------------------------------------------------------------------------------------------

    def _plan(self, chunks: Sequence[SeqChunk], block_size: int) -> _Plan:
        plan = _Plan()
        # Decode chunks first so that their rows are one contiguous range [0, num_decode).
        order = sorted(range(len(chunks)), key=lambda i: len(chunks[i].token_ids) != 1)
        tokens: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        plan.decode_tables = []
        plan.decode_starts = []
        plan.decode_keys = []
        plan.prefills = []
        logit_rows_by_chunk: list[list[int]] = [[] for _ in chunks]
        max_position = 0
        for i in order:
            chunk = chunks[i]
            count = len(chunk.token_ids)
            if count == 0:
                raise ValueError("a chunk must hold at least one new token")
            start, end = chunk.start_pos, chunk.start_pos + count
            table = chunk.block_table
            if len(table) * block_size < end:
                raise ValueError(f"block table of {len(table)} blocks cannot hold {end} tokens")
            row0 = len(tokens)
            tokens.extend(chunk.token_ids)
            positions.extend(range(start, end))
            slots.extend(table[p // block_size] * block_size + p % block_size for p in range(start, end))
            max_position = max(max_position, end - 1)
            used_blocks = list(table[: (end + block_size - 1) // block_size])
            if count == 1:
                plan.decode_tables.append(used_blocks)
                plan.decode_starts.append(start)
                plan.decode_keys.append(chunk.seq_key)
            else:
                plan.prefills.append((row0, count, start, used_blocks))
            if chunk.logits == "last":
                logit_rows_by_chunk[i] = [row0 + count - 1]
            elif chunk.logits == "all":
                logit_rows_by_chunk[i] = list(range(row0, row0 + count))
            elif chunk.logits != "none":
                raise ValueError(f"logits must be 'last', 'all' or 'none', got {chunk.logits!r}")
        plan.tokens = torch.tensor(tokens, dtype=torch.long)
        plan.positions = torch.tensor(positions, dtype=torch.long)
        plan.slots = torch.tensor(slots, dtype=torch.long)
        plan.cos, plan.sin = self._rope(plan.positions, max_position)
        plan.num_decode = len(plan.decode_tables)
        plan.logit_rows = torch.tensor([r for rows in logit_rows_by_chunk for r in rows], dtype=torch.long)
        return plan

    def _plan_decode(self, plan: _Plan, pool: KVPool) -> None:
        """Choose how the decode group reads its keys and values: the staging buffer, or a gather per layer."""
        plan.staged = False
        if not plan.num_decode:
            return
        if self.staging_max_bytes > 0 and all(key is not None for key in plan.decode_keys):
            plan.staged = self._plan_staged(plan, pool)
        if plan.staged:
            return
        bs = pool.block_size_tokens
        width = max(len(t) for t in plan.decode_tables)
        padded = [t + [0] * (width - len(t)) for t in plan.decode_tables]  # block 0 as filler, masked out
        plan.decode_blocks = torch.tensor(padded, dtype=torch.long).view(-1)
        context = torch.tensor([start + 1 for start in plan.decode_starts], dtype=torch.long)
        plan.decode_mask = (torch.arange(width * bs).unsqueeze(0) < context.unsqueeze(1))[:, None, None, :]
        plan.decode_context = width * bs

    def _plan_staged(self, plan: _Plan, pool: KVPool) -> bool:
        """Map the decode group onto staging rows, filling rows for newcomers; False if it does not fit.

        A row stays valid while its sequence keeps decoding: it holds exactly the sequence's first `filled`
        tokens, and each step appends one. A sequence that is new to the buffer (or whose length does not match
        its row) gets a free row, filled from the pool; if none is free, or the rows would be mostly holes, or
        a sequence outgrows the capacity, the buffer is rebuilt for the current group.
        """
        keys, starts, tables = plan.decode_keys, plan.decode_starts, plan.decode_tables
        n = len(keys)
        longest = max(starts) + 1
        staging = self._staging
        rows: list[int] | None = None
        if staging is not None and longest <= staging.capacity and 2 * n >= len(staging.keys):
            row_of = {key: r for r, key in enumerate(staging.keys) if key is not None}
            rows = []
            taken: set[int] = set()
            newcomers: list[int] = []
            for b, key in enumerate(keys):
                r = row_of.get(key)
                if r is not None and staging.filled[r] == starts[b] and r not in taken:
                    rows.append(r)
                    taken.add(r)
                else:
                    rows.append(-1)
                    newcomers.append(b)
            free = [r for r in range(len(staging.keys)) if r not in taken]
            if len(newcomers) > len(free):
                rows = None
            else:
                for r in free:  # rows of sequences that left become holes
                    staging.keys[r] = None
                    staging.filled[r] = 0
                for b in newcomers:
                    rows[b] = free.pop(0)
                    self._stage_fill(staging, rows[b], tables[b], starts[b], pool)
        if rows is None:
            # Attention reads the whole buffer (SDPA is about a third faster on contiguous K/V than on a slice of
            # it), so headroom is wasted work each step and a rebuild every STAGING_HEADROOM_TOKENS steps.
            capacity = longest + STAGING_HEADROOM_TOKENS
            s = self.spec
            shape = (s.num_layers, 2, n, s.num_kv_heads, capacity, s.head_dim)
            nbytes = 2 * n * s.num_layers * s.num_kv_heads * capacity * s.head_dim * pool.tensor.element_size()
            self._staging = None
            if nbytes > self.staging_max_bytes:
                return False
            # Zeros, not empty: positions past a row's length are masked, but SDPA turns masked NaN garbage into NaN
            # outputs; stale finite values left by an earlier row are harmless once masked.
            staging = _Staging(torch.zeros(shape, dtype=self.dtype), [None] * n, [0] * n, capacity)
            self._staging = staging
            rows = list(range(n))
            for b in range(n):
                self._stage_fill(staging, b, tables[b], starts[b], pool)
        assert staging is not None
        for b, key in enumerate(keys):
            staging.keys[rows[b]] = key
            staging.filled[rows[b]] = starts[b] + 1  # the layer loop appends this step's token
        total_rows = len(staging.keys)
        plan.stage_rows = torch.tensor(rows, dtype=torch.long)
        plan.stage_pos = torch.tensor(starts, dtype=torch.long)
        plan.stage_identity = rows == list(range(total_rows))
        filled = torch.tensor([max(f, 1) for f in staging.filled], dtype=torch.long)  # holes attend to a dummy
        plan.stage_mask = (torch.arange(staging.capacity).unsqueeze(0) < filled.unsqueeze(1))[:, None, None, :]
        return True

    def _stage_fill(self, staging: _Staging, row: int, table: list[int], count: int, pool: KVPool) -> None:
        """Copy a sequence's first `count` tokens of K and V (all layers) from the pool into a staging row."""
        staging.filled[row] = count
        if count == 0:
            return
        bs = pool.block_size_tokens
        index = torch.tensor(table[: (count + bs - 1) // bs], dtype=torch.long)
        s = self.spec
        blocks = pool.tensor.index_select(2, index)  # [layers, 2, nb, bs, kvh, hd]
        tokens = blocks.view(s.num_layers, 2, -1, s.num_kv_heads, s.head_dim)[:, :, :count]
        staging.tensor[:, :, row, :, :count] = tokens.transpose(2, 3)

    def drop_staging(self) -> None:
        """Free the decode staging buffer (it is rebuilt on demand)."""
        self._staging = None

    def _buffer(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """A reusable scratch tensor of at least `shape` (avoids a fresh allocation per layer)."""
        numel = 1
        for n in shape:
            numel *= n
        buf = self._scratch.get(name)
        if buf is None or buf.numel() < numel:
            buf = torch.empty(max(numel, 2 * (0 if buf is None else buf.numel())), dtype=self.dtype)
            self._scratch[name] = buf
        return buf[:numel].view(shape)

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # The fused op computes x * rsqrt(mean(x^2) + eps) * weight like transformers' Qwen3RMSNorm; only reduced
        # precision dtypes need the float32 round trip that transformers makes explicit.
        if x.dtype == torch.float32:
            if weight.dim() == 1:
                return F.rms_norm(x, (x.shape[-1],), weight, self.spec.rms_norm_eps)
            return F.rms_norm(x, (x.shape[-1],), None, self.spec.rms_norm_eps) * weight  # per-head weights
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.spec.rms_norm_eps)
        return weight * x32.to(x.dtype)

    @staticmethod
    def _rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
        # transformers: x * cos + cat(-x2, x1) * sin; the sign lives in signed_sin (exact, no rounding change).
        return torch.addcmul(x * cos, torch.roll(x, x.shape[-1] // 2, -1), signed_sin)

    def forward(self, chunks: Sequence[SeqChunk], pool: KVPool) -> torch.Tensor:
        """Run one step: write every chunk's KV into the pool and return the requested logits (float32).

        Rows come chunk by chunk in the given order: one row for "last", len(token_ids) rows for "all".
        """
        if not self.has_weights:
            raise RuntimeError("weights are released")
        try:
            return self._forward(chunks, pool)
        except BaseException:
            self._staging = None  # a step that stopped half way leaves rows half appended
            raise

    def _forward(self, chunks: Sequence[SeqChunk], pool: KVPool) -> torch.Tensor:
        s = self.spec
        nh, kvh, hd = s.num_heads, s.num_kv_heads, s.head_dim
        bs = pool.block_size_tokens
        with torch.inference_mode():
            plan = self._plan(chunks, bs)
            self._plan_decode(plan, pool)
            num_tokens = plan.tokens.shape[0]
            n = plan.num_decode
            # Staged decode tokens reach the pool once per step after the last layer (two ops instead of two per
            # layer): nothing in this step reads them from the pool. Other tokens go in per layer, since a chunk
            # with a cached prefix reads its own new keys back from the pool.
            deferred = plan.staged
            pool_slots = plan.slots[n:] if deferred else plan.slots
            pool_rows = slice(n, None) if deferred else slice(None)
            x = self._embed.index_select(0, plan.tokens)  # type: ignore[union-attr]
            for index, layer in enumerate(self._layers):
                k_pool, v_pool = pool.layer_kv(index)
                h = self._rms_norm(x, layer.input_norm)
                qkv = F.linear(h, layer.qkv)
                qk = qkv[:, : (nh + kvh) * hd].view(num_tokens, nh + kvh, hd)
                qk = self._rotate(self._rms_norm(qk, layer.qk_norm), plan.cos, plan.sin)
                q = qk[:, :nh]
                k = qk[:, nh:]
                v = qkv[:, (nh + kvh) * hd :].view(num_tokens, kvh, hd)
                if pool_slots.numel():
                    k_pool.view(-1, kvh, hd).index_copy_(0, pool_slots, k[pool_rows])
                    v_pool.view(-1, kvh, hd).index_copy_(0, pool_slots, v[pool_rows])
                attn = self._attention(plan, index, q, k, v, k_pool, v_pool, num_tokens, bs)
                x = torch.addmm(x, attn, layer.o.t())
                h = self._rms_norm(x, layer.post_norm)
                if layer.router is not None:
                    x = x + self._experts(h, layer)
                    continue
                gate_up = F.linear(h, layer.gate_up)
                gate, up = gate_up.chunk(2, dim=-1)
                x = torch.addmm(x, F.silu(gate) * up, layer.down.t())
            if deferred:
                staging = self._staging
                assert staging is not None
                new = staging.tensor[:, :, plan.stage_rows, :, plan.stage_pos]  # [n, layers, 2, kvh, hd]
                flat = pool.tensor.view(s.num_layers, 2, -1, kvh, hd)
                flat.index_copy_(2, plan.slots[:n], new.permute(1, 2, 0, 3, 4))
            rows = x.index_select(0, plan.logit_rows)
            rows = self._rms_norm(rows, self._final_norm)
            return F.linear(rows, self._lm_head).float()

    def _experts(self, h: torch.Tensor, layer: _Layer) -> torch.Tensor:
        """A sparse layer's MLP as transformers' Qwen3MoeSparseMoeBlock computes it: softmax over every expert's
        router logit (float32), the top k, renormalised when norm_topk_prob, then the weighted sum of the chosen
        experts' gated MLPs. Tokens are grouped per expert so each expert runs one matrix product per step."""
        s = self.spec
        probs = F.softmax(F.linear(h, layer.router), dim=-1, dtype=torch.float32)
        weights, chosen = probs.topk(s.num_experts_per_tok, dim=-1)
        if s.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(h.dtype)
        out = torch.zeros_like(h)
        flat_expert = chosen.reshape(-1)
        order = flat_expert.argsort(stable=True)
        counts = torch.bincount(flat_expert, minlength=s.num_experts).tolist()
        token_of = order // s.num_experts_per_tok
        start = 0
        for expert, count in enumerate(counts):
            if not count:
                continue
            picks = order[start : start + count]
            tokens = token_of[start : start + count]
            start += count
            gate, up = F.linear(h.index_select(0, tokens), layer.expert_gate_up[expert]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, layer.expert_down[expert])
            out.index_add_(0, tokens, y * weights.reshape(-1)[picks].unsqueeze(-1))
        return out

    def _attention(
        self,
        plan: _Plan,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        num_tokens: int,
        block_size: int,
    ) -> torch.Tensor:
        s = self.spec
        nh, kvh, hd = s.num_heads, s.num_kv_heads, s.head_dim
        group = nh // kvh
        n = plan.num_decode
        # A decode-only step returns SDPA's output as is; mixed steps assemble rows in one buffer.
        out = None if n == num_tokens else torch.empty(num_tokens, nh * hd, dtype=q.dtype)
        # Decode: the `group` query heads that share a kv head ride in SDPA's query-length dimension, so K and V
        # are read once per kv head instead of being expanded to every query head.
        if n and plan.staged:
            staging = self._staging
            assert staging is not None
            k_stage, v_stage = staging.tensor[layer, 0], staging.tensor[layer, 1]  # [rows, kvh, capacity, hd]
            k_stage[plan.stage_rows, :, plan.stage_pos] = k[:n]
            v_stage[plan.stage_rows, :, plan.stage_pos] = v[:n]
            query = q[:n].reshape(n, kvh, group, hd)
            if not plan.stage_identity:
                full = torch.zeros(len(staging.keys), kvh, group, hd, dtype=q.dtype)
                full[plan.stage_rows] = query
                query = full
            result = F.scaled_dot_product_attention(query, k_stage, v_stage, attn_mask=plan.stage_mask)
            if not plan.stage_identity:
                result = result[plan.stage_rows]
            if out is None:
                return result.reshape(n, nh * hd)
            out[:n] = result.reshape(n, nh * hd)
        elif n:
            count = plan.decode_blocks.shape[0]
            block_numel = block_size * kvh * hd
            k_rows = self._buffer("k", (count, block_numel))
            v_rows = self._buffer("v", (count, block_numel))
            torch.index_select(k_pool.view(-1, block_numel), 0, plan.decode_blocks, out=k_rows)
            torch.index_select(v_pool.view(-1, block_numel), 0, plan.decode_blocks, out=v_rows)
            keys = k_rows.view(n, plan.decode_context, kvh, hd).transpose(1, 2)
            values = v_rows.view(n, plan.decode_context, kvh, hd).transpose(1, 2)
            result = F.scaled_dot_product_attention(
                q[:n].reshape(n, kvh, group, hd), keys, values, attn_mask=plan.decode_mask
            )
            if out is None:
                return result.reshape(n, nh * hd)
            out[:n] = result.reshape(n, nh * hd)
        for row0, count, start, table in plan.prefills:
            query = q[row0 : row0 + count].transpose(0, 1).unsqueeze(0)  # [1, nh, count, hd]
            if start == 0:
                keys = k[row0 : row0 + count].transpose(0, 1).unsqueeze(0)
                values = v[row0 : row0 + count].transpose(0, 1).unsqueeze(0)
                result = F.scaled_dot_product_attention(query, keys, values, is_causal=True, enable_gqa=True)
            else:
                end = start + count
                index = torch.tensor(table, dtype=torch.long)
                keys = k_pool.index_select(0, index).view(1, -1, kvh, hd)[:, :end].transpose(1, 2)
                values = v_pool.index_select(0, index).view(1, -1, kvh, hd)[:, :end].transpose(1, 2)
                mask = torch.arange(end).unsqueeze(0) <= torch.arange(start, end).unsqueeze(1)
                result = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, enable_gqa=True)
            out[row0 : row0 + count] = result[0].transpose(0, 1).reshape(count, nh * hd)  # type: ignore[index]
        assert out is not None
        return out
