"""The trainer a cell hosts: a megatron-core GPTModel in the Qwen3 layout, with flat gradients and parameters.

Cells that train claim micro-steps and run `forward_backward` on each (gradients accumulate); satellites' summed
gradients reach the core in reduction rounds over `grad_buffer()` (engines/grad_exchange.py), which the core
`add_flat_grads` before `optimizer_step()`. New weights leave as an HF
state dict (`hf_state_dict`, for rollout engines) or as one flat tensor (`flat_params`, for other trainers), so the
bulk of a move is one contiguous buffer that a transfer engine can register.

Layout in memory: every parameter is a view into one flat fp32 buffer, and every gradient a view into a second
one. Autograd accumulates into the existing gradient views in place, so the flat gradient is always current and
import/export is a single copy; the optimizer runs on two flat tensors (matrices with weight decay, vectors
without) instead of one small tensor at a time. The order of the buffer is `param_layout()`.

On a machine without CUDA, megatron-core runs on the CPU through the shims of `gyre.engines.megatron_cpu`, over a
gloo process group; plain `torch.optim.AdamW` replaces Megatron's optimizer (which hard-codes CUDA) and gives the
same updates. With data parallelism it is sharded as megatron's distributed optimizer is (ZeRO stage 1,
`TrainerConfig.shard_optimizer`): each data-parallel rank keeps the moments of its share of the flat buffer, steps
it, and broadcasts it to the other ranks. Any number of trainers may live in one process: the process group and
megatron's parallel state are set up once (a group of one unless the caller set up another) and shared.

Several processes can make one trainer: each calls `gyre.engines.parallel.init_parallel` and then builds a
MegatronTrainer as above. The trainer reads the tensor, pipeline, data and expert sizes from megatron's parallel state
and holds its rank's shard: megatron's parallel layers split the matrices (tensor), megatron's pipeline schedule runs
the stages (pipeline, one micro-batch per call so `loss_fn` still sees the whole batch), megatron's MoE layer keeps
its expert rank's experts and exchanges tokens with the other expert ranks (expert), and the gradients of the
data-parallel replicas are summed over megatron's data-parallel group before a step, an expert's over its
expert-data-parallel group (`reduce_grads`). The flat buffers then hold the rank's shard; `hf_state_dict` and
`load_hf_state_dict` take and give whole models and are collectives (every rank of the trainer calls them). Every
rank must call the compute methods with the same batch (data-parallel ranks with their own rows; with expert
parallelism a rank without rows calls `idle_pass`). One process is the size-1 case of the same code, which is how
the cells use it today.

Core attention is torch's scaled_dot_product_attention by default (memory linear in sequence length, so long
agent trajectories fit); megatron's own DotProductAttention stays available as `core_attention="local"`. With
CUDA present the model and buffers live on the GPU and megatron runs unpatched (a CPU trainer is then refused:
`trainer_device`); a trainer of several processes reduces over NCCL (engines/parallel.py), and one process runs no
collective at all (`ensure_parallel_state`). Every buffer is made on the trainer's device, everything that leaves
for the host (log-probs, checkpoints, digests, published weights) is copied there once, and no hot path reads a
device tensor through numpy. `gyre bench gpu` (benchmarks/gpu.py) is the prepared check of this path on a GPU.
"""

from __future__ import annotations

import math
import threading
from pathlib import Path
from typing import Any, Callable, Mapping

import attrs
import structlog
import torch
import torch.nn.functional as F

from gyre.engines import megatron_cpu, parallel
from gyre.engines.errors import TrainerError
from gyre.engines.model_format import ModelSpec, load_hf_state_dict, save_model_dir
from gyre.engines.weight_convert import hf_to_megatron, megatron_to_hf
from gyre.runtime.errors import ConfigError

__all__ = ["MegatronTrainer", "ParamSlot", "TrainerConfig", "TrainerError", "build_gpt_model",
           "checkpoint_state_digest", "ema_update", "ensure_parallel_state", "token_logprobs",
           "trainer_device"]

log = structlog.get_logger(__name__)

CORE_ATTENTION = ("sdpa", "local")
PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16}

LossFn = Callable[[torch.Tensor], "tuple[torch.Tensor, Mapping[str, Any]]"]


@attrs.frozen
class TrainerConfig:
    """How a trainer trains: AdamW settings, precision, device, and its parallel layout.

    Layout: tensor_parallel * pipeline_parallel * data_parallel processes, one per device (world size 1 is the
    in-process MegatronTrainer, more a TrainerGroup of engines/trainer_group.py). expert_parallel splits a qwen3_moe
    model's experts over that many of the data-parallel ranks (it adds no process). `parallel` gives the sizes as
    ParallelSizes; `check_parallel_fits` checks them against a model, a ConfigError naming what does not divide (KV
    heads, layers, vocabulary, experts), as building a trainer does."""

    lr: float = 1e-4
    """AdamW learning rate (optimizer_step can override it for one step, for schedules)."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW moment decay rates."""
    weight_decay: float = 0.0
    """Decoupled weight decay, applied to matrices only (never to norm weights)."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value before each step; 0 disables clipping."""
    num_threads: int | None = None
    """torch intra-op threads for this process (None leaves torch's setting alone)."""
    seed: int = 0
    """Seeds megatron's parameter initialisation (overwritten by the loaded weights, but kept deterministic)."""
    eps: float = 1e-8
    """AdamW epsilon."""
    core_attention: str = "sdpa"
    """"sdpa": torch's scaled_dot_product_attention (never materialises the [tokens x tokens] score matrix, so
    long agent trajectories fit in memory); "local": megatron's own DotProductAttention (the reference path)."""
    device: str | None = None
    """"cpu" or "cuda"; None picks cuda when available. The CPU path is the tested one."""
    lr_warmup_steps: int = 0
    """Ramp the learning rate linearly over the first this many versions (lr * v / n for the step that makes version
    v); 0: none. Why: Adam's first updates move every weight by about lr whatever its gradient's noise (the moment
    estimates are one sample old), a jolt to skills the run is not training. (One run of the main job with 6 gained
    +1.8 held-out points against +0.0 without: within its noise; BENCHMARKS.md, session 10.)"""
    average_decay: float = 0.0
    """Keep an exponential moving average of the weights, moved towards the new weights by (1 - decay) after each
    applied optimizer step; 0 keeps none. Why: the last weights of a short RL run carry the noise of its last few
    steps' gradients, and a small model's greedy answers flip on such changes; an average smooths that noise (on
    the main job's tasks it scored within the noise of the last weights: BENCHMARKS.md, session 10). It costs one
    more copy of the parameters, so only the cell that applies the steps (the core) should keep one."""

    precision: str = "fp32"
    """"fp32": one copy of the weights, fp32 everywhere (the CPU setting). "bf16": the model computes in bfloat16
    (weights, activations and gradients, as megatron's `bf16=True`), while the optimizer, the flat buffers and every
    import and export keep fp32 master weights and fp32 gradient sums (megatron's mixed-precision recipe): updates
    too small for bfloat16 still accumulate. Meant for GPUs; it also runs, slowly, on the CPU."""

    shard_optimizer: bool = True
    """With data parallelism (and expert parallelism 1): each data-parallel rank keeps the AdamW moments of only
    its 1/data share of the flat parameters, updates that share, and the ranks then broadcast their updated shares to
    each other (megatron's distributed optimizer, ZeRO stage 1). Why: AdamW's two fp32 moments are 8 bytes a
    parameter, twice the fp32 weights, and replicated on every data-parallel rank they set how large a model a
    device holds. The gradients are still summed by one all-reduce (gloo has no reduce-scatter), so a step moves
    the all-reduce plus one share's broadcast per rank; the updates are the same as unsharded (tests: data 2 within
    1e-5 of one process). Checkpoints hold the whole moments in the unsharded format (gathered when saved, sliced
    when loaded), so a checkpoint does not depend on the data-parallel size. With expert parallelism the moments stay
    replicated (the experts' sums run over another group)."""

    tensor_parallel: int = 1
    """Tensor-parallel size: each layer's matrices are split over this many processes (megatron's TP)."""
    pipeline_parallel: int = 1
    """Pipeline-parallel size: the layers are split into this many consecutive stages, one per process group."""
    data_parallel: int = 1
    """Data-parallel size: this many replicas train on their share of each micro-step's rows and sum gradients."""
    expert_parallel: int = 1
    """Expert-parallel size (qwen3_moe models): each sparse layer's experts are split over this many of the
    data-parallel ranks, which send each token to the ranks of its experts and back (megatron's
    expert_model_parallel_size and all-to-all token dispatcher). It must divide data_parallel and num_experts; the
    world stays tensor * pipeline * data. E.g. data_parallel=2, expert_parallel=2: two processes, each with half of
    the experts and its own rows; data_parallel=4, expert_parallel=2: four, each expert on two of them."""
    group_start_timeout_s: float = 300.0
    """A trainer of several processes (engines/trainer_group.py): how long its workers may take to start, import
    megatron, join the process group and build their shard before the group gives up naming the missing rank."""
    group_timeout_s: float = 600.0
    """A trainer of several processes: bound on every command and collective wait (a dead or hung rank fails the
    command after at most this long, usually at once: gloo and the command pipes see a dead peer's closed socket)."""

    @property
    def parallel(self) -> "parallel.ParallelSizes":
        """The tensor / pipeline / data / expert sizes as `ParallelSizes` (world size = tensor * pipeline * data)."""
        return parallel.ParallelSizes(tensor=self.tensor_parallel, pipeline=self.pipeline_parallel,
                                      data=self.data_parallel, expert=self.expert_parallel)

    def check_parallel_fits(self, spec: ModelSpec) -> None:
        """Raise ConfigError unless the parallel sizes split `spec` evenly (ParallelSizes.check_fits)."""
        try:
            self.parallel.check_fits(spec)
        except TrainerError as error:
            raise ConfigError(f"TrainerConfig tensor_parallel={self.tensor_parallel} pipeline_parallel="
                              f"{self.pipeline_parallel} data_parallel={self.data_parallel} expert_parallel="
                              f"{self.expert_parallel} does not split the model: {error}") from None

    def __attrs_post_init__(self) -> None:
        for name in ("tensor_parallel", "pipeline_parallel", "data_parallel", "expert_parallel"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ConfigError(f"TrainerConfig.{name} must be an int >= 1, got {value!r}")
        if self.data_parallel % self.expert_parallel:
            raise ConfigError(f"TrainerConfig.expert_parallel={self.expert_parallel} does not divide data_parallel="
                              f"{self.data_parallel}: megatron takes the expert-parallel ranks out of the "
                              "data-parallel ones (the world is tensor * pipeline * data)")
        if not (self.group_start_timeout_s > 0 and self.group_timeout_s > 0):
            raise ConfigError("group_start_timeout_s and group_timeout_s must be > 0")
        if self.precision not in PRECISIONS:
            raise TrainerError(f"precision must be one of {sorted(PRECISIONS)}, got {self.precision!r}")
        if self.core_attention not in CORE_ATTENTION:
            raise TrainerError(f"core_attention must be one of {sorted(CORE_ATTENTION)}, got {self.core_attention!r}")
        if self.device not in (None, "cpu", "cuda"):
            raise TrainerError(f"device must be None, 'cpu' or 'cuda', got {self.device!r}")
        if self.grad_clip < 0 or self.lr < 0 or self.weight_decay < 0:
            raise TrainerError("lr, weight_decay and grad_clip must be >= 0")
        if self.lr_warmup_steps < 0:
            raise TrainerError(f"lr_warmup_steps must be >= 0, got {self.lr_warmup_steps!r}")
        if not 0.0 <= self.average_decay < 1.0:
            raise TrainerError(f"average_decay must be in [0, 1), got {self.average_decay!r}")


@attrs.frozen
class ParamSlot:
    """Where one Megatron parameter lives in the flat buffers."""

    name: str
    """Megatron parameter name."""
    shape: tuple[int, ...]
    """Tensor shape."""
    offset: int
    """First element in the flat buffer."""
    numel: int
    """Number of elements."""


def trainer_device(config: TrainerConfig) -> torch.device:
    """The device a trainer of `config` runs on: its `device`, or CUDA where present. TrainerError for "cpu" on a
    machine with CUDA: megatron-core's CPU shims (engines/megatron_cpu.py) are installed only without CUDA, since
    they are process-wide and would take the CUDA paths from a GPU trainer in the same process, and unpatched
    megatron moves RoPE's frequencies and builds masks on the GPU, so a CPU trainer there would fail at its first
    forward with a device mismatch."""
    if config.device == "cpu" and torch.cuda.is_available():
        raise TrainerError("TrainerConfig.device='cpu' on a machine with CUDA: megatron-core runs unpatched there "
                           "and puts parts of a CPU model on the GPU; train on the GPU (device None or 'cuda'), or "
                           "hide the GPUs (CUDA_VISIBLE_DEVICES='') to train on the CPU")
    return torch.device(config.device or ("cuda" if torch.cuda.is_available() else "cpu"))


_setup_lock = threading.Lock()


def ensure_parallel_state() -> None:
    """Make sure torch.distributed and megatron's parallel state exist (a gloo group of one if nobody set up
    one, with `gyre.engines.parallel.init_parallel` for more).

    A group of one is gloo on CUDA too, and no tensor ever goes through it: at world size 1 there is nothing to
    reduce, so the trainer runs no collective (`reduce_grads` returns at once, `grad_norm` sums locally, weights are
    gathered without one; megatron itself skips its collectives at size 1, and Gyre sets none of the options that
    would run one, such as an auxiliary MoE loss), which tests/unit/engines/test_trainer.py checks by making every
    collective raise. The group only satisfies megatron's parallel state. Why not NCCL of one: it would build a
    communicator (GPU memory, seconds) for nothing, and tie the process's one group to one device kind, while a
    process may hold several trainers (a core and a satellite in a test, a CPU reference beside a GPU trainer)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    with _setup_lock:
        if not dist.is_initialized():
            # An in-process store: no port to pick, nothing that another process could join by accident.
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
            log.info("process_group_started", backend="gloo", world_size=1)
        if not parallel_state.model_parallel_is_initialized():
            parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)


def prepare_training_runtime() -> None:
    """Pay ahead of time what a process's first trainer costs beyond the trainer itself: megatron's imports, the CPU
    shims and the parallel state. That is 5 s on an idle 2-core VM and 10-13 s under load, against 0.06 s for every
    later trainer in the same process. A satellite that prepares while it starts rolling out joins its first training
    step in well under a second instead of sitting out the import in the middle of a run."""
    megatron_cpu.apply()
    ensure_parallel_state()
    from megatron.core.models.gpt import GPTModel  # noqa: F401  (the imports are the point)
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: F401
    from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: F401


def _sdpa_core_attention():
    """A megatron core-attention module that runs torch's scaled_dot_product_attention.

    Megatron's local DotProductAttention materialises the [batch*heads, tokens, tokens] scores and keeps the
    probabilities for backward: a 4k-token trajectory costs 256 MiB per layer for the tiny model. SDPA's kernels
    (CPU flash attention included) keep only per-row statistics and repeat KV heads internally (GQA). Same inputs
    and outputs as DotProductAttention ([s, b, heads, head_dim] in, [s, b, heads*head_dim] out); the parity tests
    run both. Defined lazily because importing megatron takes seconds.
    """
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class SDPACoreAttention(DotProductAttention):
        def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                    packed_seq_params=None):
            if packed_seq_params is not None or attention_bias is not None:
                raise TrainerError("SDPACoreAttention supports neither packed sequences nor attention bias")
            sq, b, heads, head_dim = query.shape
            q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))  # [b, heads, s, head_dim]
            dropout = self.attention_dropout.p if self.training else 0.0
            out = F.scaled_dot_product_attention(
                q, k, v,
                attn_mask=None if attention_mask is None else ~attention_mask,  # megatron: True = masked out
                is_causal=attention_mask is None,
                dropout_p=dropout,
                scale=self.softmax_scale * (self.layer_number if self.config.apply_query_key_layer_scaling else 1),
                enable_gqa=True,
            )
            return out.permute(2, 0, 1, 3).reshape(sq, b, heads * head_dim)

    return SDPACoreAttention


def build_gpt_model(spec: ModelSpec, seed: int = 0, core_attention: str = "sdpa", device: str = "cpu",
                    dtype: torch.dtype = torch.float32):
    """A megatron-core GPTModel with the Qwen3 layout of `spec` (fp32, CPU initialisation, no fusions): this rank's
    tensor shard of this rank's pipeline stage, as megatron's parallel state says."""
    prepare_training_runtime()  # a no-op after the first call in this process
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    if core_attention not in CORE_ATTENTION:
        raise TrainerError(f"core_attention must be one of {CORE_ATTENTION}, got {core_attention!r}")
    if device == "cuda":
        # Megatron's CUDA RNG tracker needs its states registered before any forward (dropout forks it).
        tensor_parallel.model_parallel_cuda_manual_seed(seed)

    config = TransformerConfig(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        num_attention_heads=spec.num_heads,
        num_query_groups=spec.num_kv_heads,
        kv_channels=spec.head_dim,
        ffn_hidden_size=spec.ffn_size,
        normalization="RMSNorm",
        layernorm_epsilon=spec.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        qk_layernorm=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        use_cpu_initialization=True,
        # Fused kernels are CUDA-only; the unfused paths are exact.
        masked_softmax_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
        pipeline_dtype=dtype,
        # Point-to-point sends one by one: gloo has no batched isend/irecv, and one micro-batch gains nothing.
        batch_p2p_comm=False,
        # The loss a caller's loss_fn returns is used as is (Gyre's losses carry their own normalisation).
        calculate_per_token_loss=True,
        expert_model_parallel_size=parallel_state.get_expert_model_parallel_world_size(),
        **_moe_config(spec, parallel_state.get_expert_model_parallel_world_size()),
    )
    if spec.is_moe:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

        block_spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
        layer_specs = list(block_spec.layer_specs)
        model_spec = block_spec
    else:
        model_spec = get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm")
        layer_specs = [model_spec]
    if core_attention == "sdpa":
        for layer_spec in layer_specs:
            layer_spec.submodules.self_attention.submodules.core_attention = _sdpa_core_attention()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = GPTModel(
            config=config,
            transformer_layer_spec=model_spec,
            vocab_size=spec.vocab_size,
            max_sequence_length=spec.max_position_embeddings,
            position_embedding_type="rope",
            rotary_base=spec.rope_theta,
            # Tied (Qwen3-0.6B/1.7B/4B): one matrix embeds and scores, and its gradient sums both uses.
            share_embeddings_and_output_weights=spec.tie_word_embeddings,
            pre_process=parallel_state.is_pipeline_first_stage(),
            post_process=parallel_state.is_pipeline_last_stage(),
            # Whole-vocabulary logits on every tensor rank, so token_logprobs is the same code at every size.
            parallel_output=False,
        )
    return model.to(device)


def _moe_config(spec: ModelSpec, expert_parallel: int = 1) -> dict:
    """TransformerConfig fields of a Qwen3-MoE model (none for a dense one).

    Routing as transformers' Qwen3MoeSparseMoeBlock: with norm_topk_prob the top-k weights are renormalised, which
    is megatron's top-k-then-softmax (`moe_router_pre_softmax=False`); without it they are the full softmax's
    (`pre_softmax=True`). Dropless (no capacity factor), so no token is skipped and log-probs match inference.
    Router behaviour in training: no load-balancing loss (`moe_router_load_balancing_type="none"`, coefficient 0),
    the router learns only through the policy loss, as inference routes. Why: Gyre trains with RL on trajectories
    the rollout engines scored, and an auxiliary loss would pull the router away from the routing that produced
    them; pretrained MoE checkpoints arrive balanced, and short RL runs do not unbalance them much. Router replay
    (forcing the rollout's expert choice) is not done: the trainer recomputes routing from the same weights, so the
    choice matches the engine's except where near-tied router logits flip under round-off.

    Token dispatcher: without expert parallelism megatron's "allgather" one, which then exchanges nothing (the path
    every MoE test ran first). With it, "alltoall": each rank sends each of its tokens only to the ranks of its
    experts and gets the outputs back (all_to_all_single with per-rank counts, one all_gather of the counts), which
    works over gloo as over NCCL: gloo has all_to_all_single with uneven splits and all_gather_into_tensor of equal
    sizes, which is all it needs at tensor size 1. The "allgather" dispatcher would gather every rank's tokens to every
    rank and needs equal token counts on the data-parallel ranks of an expert group (their rows differ), and "flex"
    needs DeepEP or HybridEP kernels (CUDA only)."""
    if not spec.is_moe:
        return {}
    return dict(
        num_moe_experts=spec.num_experts,
        moe_router_topk=spec.num_experts_per_tok,
        moe_ffn_hidden_size=spec.moe_ffn_size,
        moe_layer_freq=[1 if spec.is_sparse_layer(i) else 0 for i in range(spec.num_layers)],
        moe_router_pre_softmax=not spec.norm_topk_prob,
        moe_router_score_function="softmax",
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_grouped_gemm=False,
        moe_token_dispatcher_type="alltoall" if expert_parallel > 1 else "allgather",
    )


def token_logprobs(
    logits: torch.Tensor, input_ids: torch.Tensor, lengths: torch.Tensor, temperatures: torch.Tensor | None = None
) -> torch.Tensor:
    """[b, t] = log p(ids[b, t] | ids[b, :t]) for 1 <= t < lengths[b], 0 elsewhere, from logits [B, T, V].

    With `temperatures` [B, T], p is the softmax of the logits divided by temperatures[b, t]: the distribution
    token t was sampled from (engines/temperature.py)."""
    logits = logits.float()
    targets = input_ids[:, 1:].unsqueeze(-1)
    shifted = logits[:, :-1]
    if temperatures is not None:
        shifted = shifted / temperatures[:, 1:].unsqueeze(-1).to(shifted.dtype)
    picked = shifted.gather(-1, targets).squeeze(-1) - torch.logsumexp(shifted, dim=-1)
    out = F.pad(picked, (1, 0))
    positions = torch.arange(input_ids.shape[1], device=input_ids.device)
    valid = (positions[None, :] >= 1) & (positions[None, :] < lengths[:, None])
    return torch.where(valid, out, torch.zeros_like(out))


def _zero_loss(logprobs: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """A loss that depends on the log-probs with a zero gradient (MegatronTrainer.idle_pass)."""
    return logprobs.sum() * 0.0, {}


class MegatronTrainer:
    """Train one model: log-probs, forward/backward with a caller's loss, flat gradients, AdamW steps."""

    def __init__(self, model_dir: str | Path, config: TrainerConfig = TrainerConfig()) -> None:
        self.model_dir = Path(model_dir)
        self.config = config
        self.spec = ModelSpec.from_model_dir(self.model_dir)
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        self.device = trainer_device(config)
        prepare_training_runtime()
        self.sizes = parallel.current_sizes()
        """Tensor / pipeline / data parallel sizes of the process group this trainer is part of."""
        self.sizes.check_fits(self.spec)
        if config.parallel.world_size > 1 and config.parallel != self.sizes:
            raise TrainerError(f"the config asks for {config.parallel} but this process's parallel state is "
                               f"{self.sizes}: a trainer of several processes is a TrainerGroup "
                               "(engines/trainer_group.py), which sets the state up in every rank")
        self._grads_reduced = False
        """The data-parallel (and tied-embedding) gradient sums of `reduce_grads` are in the buffer."""
        self.model = build_gpt_model(self.spec, config.seed, config.core_attention, self.device.type,
                                     PRECISIONS[config.precision])
        self.version = 0
        """Weight version: bumped by each applied optimizer step, or set by the loads."""
        self._average: torch.Tensor | None = None
        """The moving average of the weights (config.average_decay), flat like the parameters; None without one."""
        self._layout, self._params, self._grads, groups = self._flatten()
        self._norm_slots = tuple(slot for slot in self._layout if self._counts_in_norm(slot.name))
        self._qk_norm_slots = tuple(s for s in self._layout if s.name.endswith(("q_layernorm.weight",
                                                                                "k_layernorm.weight")))
        self.optimizer = torch.optim.AdamW(groups, lr=config.lr, betas=config.betas, eps=config.eps,
                                           weight_decay=config.weight_decay)
        self.load_hf_state_dict(load_hf_state_dict(self.model_dir), version=0)
        log.info("trainer_ready", model_dir=str(self.model_dir), params=self._params.numel())

    # -- layout ------------------------------------------------------------------------------------------------

    def _flatten(self):
        named = [(n, p) for n, p in self.model.named_parameters()]
        # Matrices first, then vectors: two contiguous runs, one optimizer group each (decay / no decay). With expert
        # parallelism the experts' matrices end the first run: their gradients are summed over another group than
        # the dense ones' (reduce_grads), one contiguous range each. (Only then: at expert size 1 both groups are
        # the same, and the layout, which checkpoints depend on, stays what it was.)
        experts = self.sizes.expert > 1
        ordered = ([x for x in named if x[1].dim() >= 2 and not (experts and parallel.is_expert_param(x[0]))]
                   + [x for x in named if x[1].dim() >= 2 and experts and parallel.is_expert_param(x[0])]
                   + [x for x in named if x[1].dim() < 2])
        total = sum(p.numel() for _, p in ordered)
        params = torch.zeros(total, dtype=torch.float32, device=self.device)
        grads = torch.zeros(total, dtype=torch.float32, device=self.device)
        # In fp32 the model's parameters are views of the master buffers themselves; in bf16 of bf16 twins, which
        # `_sync_model_weights` refreshes from the master and `_collect_grads` empties into the fp32 sums.
        mixed = self.config.precision != "fp32"
        dtype = PRECISIONS[self.config.precision]
        self._model_params = torch.zeros(total, dtype=dtype, device=self.device) if mixed else params
        self._model_grads = torch.zeros(total, dtype=dtype, device=self.device) if mixed else grads
        layout, offset = [], 0
        for name, p in ordered:
            n = p.numel()
            params[offset : offset + n].copy_(p.data.reshape(-1))
            view = self._model_params[offset : offset + n].view_as(p)
            view.copy_(p.data)
            p.data = view
            p.grad = self._model_grads[offset : offset + n].view_as(p)
            layout.append(ParamSlot(name, tuple(p.shape), offset, n))
            offset += n
        split = sum(p.numel() for _, p in ordered if p.dim() >= 2)
        expert_slots = [slot for slot in layout if parallel.is_expert_param(slot.name)] if experts else []
        self._expert_range = ((expert_slots[0].offset, expert_slots[-1].offset + expert_slots[-1].numel)
                              if expert_slots else (split, split))
        """[start, end) of the expert parameters in the flat buffers (empty without expert parallelism)."""
        self._split = split
        self._shards = self._optimizer_shards(total)
        lo, hi = self._shards[self._shard_index] if self._shards else (0, total)
        # This rank's share of each run (all of it unsharded); a share may be empty (a zero-length tensor keeps the
        # optimizer's two groups, and so its state's indices, the same on every rank).
        m_lo, m_hi = min(lo, split), min(hi, split)
        v_lo, v_hi = max(lo, split), max(hi, split)
        matrices = torch.nn.Parameter(params[m_lo:m_hi])
        vectors = torch.nn.Parameter(params[v_lo:v_hi])
        matrices.grad, vectors.grad = grads[m_lo:m_hi], grads[v_lo:v_hi]
        groups = [{"params": [matrices]}, {"params": [vectors], "weight_decay": 0.0}]
        self._group_params = (matrices, vectors)
        self._group_ranges = ((m_lo, m_hi), (v_lo, v_hi))
        """[start, end) of the flat buffer each optimizer group updates on this rank."""
        return tuple(layout), params, grads, groups

    def _optimizer_shards(self, total: int) -> tuple[tuple[int, int], ...]:
        """Each data-parallel rank's [start, end) of the flat buffer when the optimizer is sharded (config.shard_
        optimizer, data > 1, expert 1), in data-parallel rank order; () when it is not. Equal shares of
        ceil(total / data), the last one shorter."""
        self._shard_index = 0
        if not (self.config.shard_optimizer and self.sizes.data > 1 and self.sizes.expert == 1):
            return ()
        from megatron.core import parallel_state

        self._shard_index = parallel_state.get_data_parallel_rank()
        share = -(-total // self.sizes.data)
        return tuple((min(r * share, total), min((r + 1) * share, total)) for r in range(self.sizes.data))

    def _broadcast_shards(self, buffers: list[torch.Tensor]) -> None:
        """Every data-parallel rank's shard of each flat buffer (full length) to every other rank: one broadcast per
        rank and buffer over the data-parallel group (shares may differ in length, which all-gather on gloo refuses)."""
        import torch.distributed as dist
        from megatron.core import parallel_state

        group = parallel_state.get_data_parallel_group()
        ranks = dist.get_process_group_ranks(group)
        for buffer in buffers:
            for (lo, hi), src in zip(self._shards, ranks):
                if hi > lo:
                    dist.broadcast(buffer[lo:hi], src=src, group=group)

    @property
    def _mixed(self) -> bool:
        return self._model_params is not self._params

    def _sync_model_weights(self) -> None:
        # Before every forward, not after every write: a transfer engine may write the master buffer directly
        # (param_buffer), and a bf16 cast-copy costs little next to a forward.
        if self._mixed:
            with torch.no_grad():
                self._model_params.copy_(self._params)

    def _collect_grads(self) -> None:
        if self._mixed:
            self._grads.add_(self._model_grads.float())
            self._model_grads.zero_()

    def _counts_in_norm(self, name: str) -> bool:
        """Whether this rank's copy of `name` enters the global gradient norm: a parameter replicated on the tensor
        ranks counts on rank 0 only, and a tied model's last-stage copy of the embedding not at all."""
        from megatron.core import parallel_state

        if self.spec.tie_word_embeddings and name == "output_layer.weight":
            return False
        return parallel.split_dim(name) is not None or parallel_state.get_tensor_model_parallel_rank() == 0

    def param_layout(self) -> tuple[ParamSlot, ...]:
        """The order of `flat_params` / `grads_to_flat` (Megatron names)."""
        return self._layout

    @property
    def num_params(self) -> int:
        return self._params.numel()

    # -- compute -----------------------------------------------------------------------------------------------

    def _check_batch(self, input_ids: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype != torch.long:
            raise TrainerError("input_ids must be a LongTensor [batch, tokens]")
        if not isinstance(lengths, torch.Tensor) or lengths.shape != (input_ids.shape[0],):
            raise TrainerError(f"lengths must be a tensor [batch={input_ids.shape[0]}]")
        if input_ids.numel() == 0:
            raise TrainerError("empty batch")
        lengths = lengths.to(torch.long)
        if int(lengths.min()) < 1 or int(lengths.max()) > input_ids.shape[1]:
            raise TrainerError(f"lengths must lie in [1, {input_ids.shape[1]}]")
        if int(input_ids.min()) < 0 or int(input_ids.max()) >= self.spec.vocab_size:
            raise TrainerError(f"token ids must lie in [0, {self.spec.vocab_size})")
        return input_ids.to(self.device), lengths.to(self.device)

    def _check_temperatures(self, temperatures: torch.Tensor | None, input_ids: torch.Tensor) -> torch.Tensor | None:
        if temperatures is None:
            return None
        if not isinstance(temperatures, torch.Tensor) or temperatures.shape != input_ids.shape:
            raise TrainerError(f"temperatures must be a tensor shaped like input_ids {tuple(input_ids.shape)}")
        if not bool(torch.isfinite(temperatures).all()) or float(temperatures.min()) <= 0:
            raise TrainerError("temperatures must be finite and > 0")
        return temperatures.to(self.device)

    def _pipeline(self, input_ids: torch.Tensor, lengths: torch.Tensor, temperatures: torch.Tensor | None,
                  loss_fn: LossFn | None) -> dict:
        """Run the batch through megatron's pipeline schedule as one micro-batch (backward too unless `loss_fn` is
        None) and return what the last stage computed, on every stage: `logprobs`, or `loss` and `metrics`."""
        import torch.distributed as dist
        from megatron.core import parallel_state
        from megatron.core.pipeline_parallel import get_forward_backward_func

        found: dict = {}

        def forward_step(data_iterator, model):
            output = model(next(data_iterator), position_ids=None, attention_mask=None)

            def loss_func(logits):
                logprobs = token_logprobs(logits, input_ids, lengths, temperatures)
                if loss_fn is None:
                    # On the host: broadcast_object_list pickles it, and a device tensor would unpickle onto the
                    # sender's device index on every stage.
                    found["logprobs"] = logprobs.detach().cpu()
                    return logits.sum() * 0.0, torch.ones((), dtype=torch.int), {}
                loss, metrics = self._check_loss(loss_fn(logprobs))
                found["loss"] = float(loss.detach())
                found["metrics"] = {k: (float(v.detach()) if isinstance(v, torch.Tensor) else v)
                                    for k, v in dict(metrics).items()}
                return loss, lengths.sum().to(torch.int), {}

            return output, loss_func

        get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter([input_ids]), model=[self.model], num_microbatches=1,
            seq_length=input_ids.shape[1], micro_batch_size=input_ids.shape[0], forward_only=loss_fn is None,
        )
        box = [found]
        dist.broadcast_object_list(box, src=parallel_state.get_pipeline_model_parallel_last_rank(),
                                   group=parallel_state.get_pipeline_model_parallel_group())
        return box[0]

    @staticmethod
    def _check_loss(result) -> tuple[torch.Tensor, Mapping[str, Any]]:
        if not (isinstance(result, tuple) and len(result) == 2):
            raise TrainerError("loss_fn must return (loss, metrics)")
        loss, metrics = result
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0 or not loss.requires_grad:
            raise TrainerError("loss_fn must return a scalar tensor that depends on the log-probs")
        return loss, metrics

    def _logprobs(
        self, input_ids: torch.Tensor, lengths: torch.Tensor, temperatures: torch.Tensor | None
    ) -> torch.Tensor:
        # Right padding needs no mask beyond causality: a real token never attends to a later (padding) one.
        # With attention_mask=None megatron builds the causal mask itself (the CPU shim makes it on the CPU).
        logits = self.model(input_ids, position_ids=None, attention_mask=None)
        return token_logprobs(logits, input_ids, lengths, temperatures)

    def logprobs(
        self, input_ids: torch.Tensor, lengths: torch.Tensor, temperatures: torch.Tensor | None = None
    ) -> torch.Tensor:
        """[b, t] = log p(ids[b, t] | ids[b, :t]) for 1 <= t < lengths[b], 0 elsewhere; no gradients. `temperatures`
        [B, T] (default: all 1) divides the logits that predict each token, as `token_logprobs` says."""
        source_device = input_ids.device if isinstance(input_ids, torch.Tensor) else None
        input_ids, lengths = self._check_batch(input_ids, lengths)
        temperatures = self._check_temperatures(temperatures, input_ids)
        self.model.eval()
        self._sync_model_weights()
        with torch.no_grad():
            if self.sizes.pipeline > 1:
                return self._pipeline(input_ids, lengths, temperatures, None)["logprobs"].to(source_device)
            return self._logprobs(input_ids, lengths, temperatures).to(source_device)

    def forward_backward(
        self, input_ids: torch.Tensor, lengths: torch.Tensor, loss_fn: LossFn, temperatures: torch.Tensor | None = None
    ) -> dict:
        """Compute log-probs (at `temperatures`, as in `logprobs`), `loss, metrics = loss_fn(logprobs)`, and
        accumulate d loss / d params into the gradients. Returns the metrics as floats plus `loss` and `num_tokens`
        (sum of lengths)."""
        input_ids, lengths = self._check_batch(input_ids, lengths)
        temperatures = self._check_temperatures(temperatures, input_ids)
        if self._grads_reduced:
            raise TrainerError("gradients were already reduced for a step: call optimizer_step or zero_grads first")
        self.model.train()
        self._sync_model_weights()
        if self.sizes.pipeline > 1:
            found = self._pipeline(input_ids, lengths, temperatures, loss_fn)
            self._collect_grads()
            out = {**found["metrics"], "loss": found["loss"]}
            out["num_tokens"] = int(lengths.sum())
            return out
        logprobs = self._logprobs(input_ids, lengths, temperatures)
        loss, metrics = self._check_loss(loss_fn(logprobs))
        loss.backward()
        self._collect_grads()
        out = {k: (float(v.detach()) if isinstance(v, torch.Tensor) else v) for k, v in dict(metrics).items()}
        out["loss"] = float(loss.detach())
        out["num_tokens"] = int(lengths.sum())
        return out

    def idle_pass(self, backward: bool) -> None:
        """Take part in a call that gave this rank no rows while its expert-parallel peers have some: one two-token
        row runs through the model (and back with a zero loss when `backward`), so that every MoE layer's token
        exchange, forward and backward, meets its peers' (megatron's dispatcher is a collective over the
        expert-parallel group). It adds exactly zero to the gradients. A no-op without expert parallelism, where no
        layer exchanges anything."""
        if self.sizes.expert == 1:
            return
        ids = torch.zeros((1, 2), dtype=torch.long)
        lengths = torch.tensor([2])
        if backward:
            self.forward_backward(ids, lengths, _zero_loss)
        else:
            self.logprobs(ids, lengths)

    # -- gradients ---------------------------------------------------------------------------------------------

    def grads_to_flat(self) -> torch.Tensor:
        """A copy of the accumulated gradients, fp32, 1-D, in `param_layout()` order."""
        return self._grads.clone()

    def grad_buffer(self) -> torch.Tensor:
        """The live flat fp32 gradient buffer, `param_layout()` order (a reduction round reads and then zeroes it in
        place: no copy of a model-sized buffer per round)."""
        return self._grads

    def add_flat_grads(self, flat: torch.Tensor, scale: float = 1.0) -> None:
        """grads += scale * flat (gradients another trainer computed on its micro-steps)."""
        if not isinstance(flat, torch.Tensor) or flat.shape != self._grads.shape:
            raise TrainerError(f"flat gradients must be a 1-D tensor of {self._grads.numel()} elements")
        self._grads.add_(flat.to(self.device, self._grads.dtype), alpha=scale)

    def zero_grads(self) -> None:
        self._grads.zero_()
        self._grads_reduced = False

    def reduce_grads(self) -> None:
        """Sum the gradients of the data-parallel replicas (megatron's data-parallel group, one all-reduce of the
        flat buffer, as megatron's DDP does per bucket; with expert parallelism the experts' range over megatron's
        expert-data-parallel group instead, the ranks that hold the same experts, as megatron's DDP reduces its expert
        buffer), the tensor ranks' parts of the QK-norm gradients, and, for a tied model split across pipeline stages,
        the two copies of the embedding's gradient (megatron's embedding group). Idempotent until the gradients are
        zeroed; `optimizer_step` calls it. A no-op in a single process."""
        if self._grads_reduced:
            return
        if self.sizes.world_size == 1:  # nothing to sum, and no collective on the group of one (ensure_parallel_state)
            self._grads_reduced = True
            return
        import torch.distributed as dist
        from megatron.core import parallel_state

        if self.sizes.tensor > 1 and self._qk_norm_slots:
            # QK-norm weights are replicated but each tensor rank normalises only its own heads, so each holds a
            # part of their gradient (megatron's finalize_model_grads sums them the same way).
            views = [self._grads[s.offset : s.offset + s.numel] for s in self._qk_norm_slots]
            packed = torch.cat(views)
            dist.all_reduce(packed, group=parallel_state.get_tensor_model_parallel_group())
            for view, part in zip(views, packed.split([v.numel() for v in views])):
                view.copy_(part)
        start, end = self._expert_range
        if self.sizes.data > 1:
            # The dense parameters (everything but the expert range) over the data-parallel group.
            for dense in (self._grads[:start], self._grads[end:]):
                if dense.numel():
                    dist.all_reduce(dense, group=parallel_state.get_data_parallel_group())
        if self.sizes.expert_data > 1 and end > start:
            # An expert's gradient already sums every token routed to it from its expert-parallel group (the
            # dispatcher's backward brings them); its replicas in the other groups hold the rest.
            dist.all_reduce(self._grads[start:end], group=parallel_state.get_expert_data_parallel_group())
        if self.spec.tie_word_embeddings and self.sizes.pipeline > 1 and parallel_state.is_rank_in_embedding_group():
            name = "embedding.word_embeddings.weight" if parallel_state.is_pipeline_first_stage() else \
                "output_layer.weight"
            slot = next(s for s in self._layout if s.name == name)
            view = self._grads[slot.offset : slot.offset + slot.numel]
            dist.all_reduce(view, group=parallel_state.get_embedding_group())
        self._grads_reduced = True

    def grad_norm(self) -> float:
        """The global L2 norm of the (reduced) gradients: over this rank's shard, every tensor, pipeline and expert
        rank, each parameter counted once (megatron's clip_grad_norm sums the dense and the expert parameters' squares
        over their own model-parallel groups the same way)."""
        if self.sizes.tensor == self.sizes.pipeline == self.sizes.expert == 1:
            # Squares summed in float64, a bounded chunk at a time: fp32's own norm of a large buffer is off by ~1e-4
            # relative (3.39034 against 3.39061 for the tiny model's 1.3M gradients), enough to set one process's
            # clipping apart from a tensor-parallel trainer's float64 sum over its shards. The sum stays where the
            # gradients are, read once at the end (one device sync per step, not one per chunk).
            squares = torch.zeros((), dtype=torch.float64, device=self._grads.device)
            for chunk in self._grads.split(1 << 22):
                squares += chunk.double().square().sum()
            return math.sqrt(float(squares))
        import torch.distributed as dist
        from megatron.core import parallel_state

        dense = torch.zeros((), dtype=torch.float64, device=self.device)
        expert = torch.zeros((), dtype=torch.float64, device=self.device)
        for slot in self._norm_slots:
            part = expert if parallel.is_expert_param(slot.name) else dense
            part += self._grads[slot.offset : slot.offset + slot.numel].double().square().sum()
        # Dense weights: one copy per tensor x pipeline shard (every expert rank has its own, equal, copy). Experts:
        # each on one rank of its tensor x expert x pipeline group.
        dist.all_reduce(dense, group=parallel_state.get_model_parallel_group())
        if self.spec.is_moe:
            dist.all_reduce(expert, group=parallel_state.get_expert_tensor_model_pipeline_parallel_group())
        return math.sqrt(float(dense + expert))

    def optimizer_step(self, lr: float | None = None) -> dict:
        """Clip, apply AdamW, zero the gradients and bump the version. `lr` applies to this step only (a schedule
        passes it every step); without it the config's lr is used, ramped up over `lr_warmup_steps`. A step whose
        gradient norm is not finite is skipped (weights and version unchanged) and reported with skipped=True."""
        self.reduce_grads()
        grad_norm = self.grad_norm()
        if not math.isfinite(grad_norm):
            self.zero_grads()
            log.warning("optimizer_step_skipped", grad_norm=grad_norm, version=self.version)
            return {"grad_norm": grad_norm, "skipped": True, "version": self.version}
        clip = self.config.grad_clip
        if clip > 0 and grad_norm > clip:
            self._grads.mul_(clip / (grad_norm + 1e-6))
        for group in self.optimizer.param_groups:
            group["lr"] = self.scheduled_lr() if lr is None else lr
        self.optimizer.step()
        if self._shards:  # each rank updated its share: bring the others'
            self._broadcast_shards([self._params])
        self.zero_grads()
        self.version += 1
        if self._average is not None:
            ema_update(self._average, self._params, self.config.average_decay)
        return {"grad_norm": grad_norm, "skipped": False, "version": self.version,
                "lr": self.optimizer.param_groups[0]["lr"]}

    def scheduled_lr(self) -> float:
        """The config's lr for the step that makes the next version, after the warm-up ramp."""
        warmup = self.config.lr_warmup_steps
        return self.config.lr * min(1.0, (self.version + 1) / warmup) if warmup else self.config.lr

    # -- weights -----------------------------------------------------------------------------------------------

    def flat_params(self) -> torch.Tensor:
        """A copy of all parameters, fp32, 1-D, in `param_layout()` order."""
        return self._params.detach().clone()

    def param_buffer(self) -> torch.Tensor:
        """The live flat parameter buffer (for registering with a transfer engine); write it only through
        `load_flat_params`, which also keeps the version right."""
        return self._params

    def load_flat_params(self, flat: torch.Tensor, version: int | None = None) -> None:
        if not isinstance(flat, torch.Tensor) or flat.shape != self._params.shape:
            raise TrainerError(f"flat parameters must be a 1-D tensor of {self._params.numel()} elements")
        with torch.no_grad():
            self._params.copy_(flat.to(self.device))
        if version is not None:
            self.version = version
        self._restart_average()

    def hf_state_dict(self, averaged: bool = False) -> dict[str, torch.Tensor]:
        """The weights under HF Qwen3 names (copies); `averaged` gives the moving average instead of the live ones.
        With several ranks it is a collective, and every rank gets the whole model."""
        flat = self.averaged_params() if averaged else self._params.detach()
        weights = {slot.name: flat[slot.offset : slot.offset + slot.numel].view(slot.shape) for slot in self._layout}
        return {k: v.cpu() for k, v in megatron_to_hf(parallel.gather_state(weights, self.spec), self.spec).items()}

    def iter_hf_buckets(self, bucket_bytes: int = 256 << 20, averaged: bool = False,
                        flat: torch.Tensor | None = None):
        """The weights under HF names, one bucket at a time (`parallel.bucket_plan`: whole decoder layers, at most
        `bucket_bytes` fp32 bytes unless one layer is larger): a collective generator every rank of the trainer
        iterates in step; the publishing rank (`is_publisher`) gets each bucket's tensors, the others empty dicts.
        No rank holds more than its shard plus one bucket, where `hf_state_dict` gathers the whole model. `flat`
        (a copy of this rank's flat parameters taken earlier, `param_layout()` order) is published instead of the
        live weights: a publisher snapshots under its lock and gathers later (engines/trainer_group.py)."""
        from gyre.engines.weight_convert import megatron_layer_to_hf

        if flat is None:
            flat = self.averaged_params() if averaged else self._params.detach()
        elif flat.shape != self._params.shape:
            raise TrainerError(f"a weight snapshot of {flat.numel()} elements for a shard of {self._params.numel()}")
        weights = {slot.name: flat[slot.offset : slot.offset + slot.numel].view(slot.shape) for slot in self._layout}
        for bucket in parallel.gather_buckets(weights, self.spec, bucket_bytes):
            if not bucket:
                yield {}
                continue
            out: dict[str, torch.Tensor] = {}
            if "embedding.word_embeddings.weight" in bucket:
                out["model.embed_tokens.weight"] = bucket["embedding.word_embeddings.weight"]
            layers = sorted({int(n.split(".")[2]) for n in bucket if n.startswith("decoder.layers.")})
            for i in layers:
                out.update(megatron_layer_to_hf(bucket, self.spec, i))
            if "decoder.final_layernorm.weight" in bucket:
                out["model.norm.weight"] = bucket["decoder.final_layernorm.weight"]
            if "output_layer.weight" in bucket:
                out["lm_head.weight"] = bucket["output_layer.weight"]
            yield out

    @property
    def is_publisher(self) -> bool:
        """Whether this rank is the one `iter_hf_buckets` gives the weights to."""
        if self.sizes.world_size == 1:
            return True
        import torch.distributed as dist
        from megatron.core import parallel_state

        group = parallel._shard_group()
        return parallel.is_first_replica() and dist.get_rank() == dist.get_global_rank(group, 0)

    def load_hf_state_dict(self, state: Mapping[str, torch.Tensor], version: int | None = None) -> None:
        """Load HF-named weights (optimizer moments are kept)."""
        tp_rank, pp_rank, ep_rank = parallel.shard_rank()
        converted = parallel.shard_state(hf_to_megatron(state, self.spec), self.spec, tp_rank, self.sizes.tensor,
                                         pp_rank, self.sizes.pipeline, ep_rank, self.sizes.expert)
        self.load_shard(converted, version)

    def load_shard(self, converted: Mapping[str, torch.Tensor], version: int | None = None) -> None:
        """Load this rank's shard of the weights (`parallel.shard_state` of weight_convert's megatron names), what
        `load_hf_state_dict` does after cutting; a TrainerGroup sends each rank only its shard this way."""
        # Into the fp32 master buffer by layout (the model's copy follows at the next forward): loading through the
        # bf16 model would round the weights.
        slots = {slot.name: slot for slot in self._layout}
        missing, unexpected = sorted(set(slots) - set(converted)), sorted(set(converted) - set(slots))
        if missing or unexpected:
            raise TrainerError(f"weights do not fit the model: missing {missing}, unexpected {unexpected}")
        for name, tensor in converted.items():
            if tuple(tensor.shape) != slots[name].shape:
                raise TrainerError(f"{name} has shape {tuple(tensor.shape)}, expected {slots[name].shape}")
        with torch.no_grad():
            for name, tensor in converted.items():
                slot = slots[name]
                self._params[slot.offset : slot.offset + slot.numel].copy_(tensor.reshape(-1))
        self._sync_model_weights()
        if version is not None:
            self.version = version
        self._restart_average()

    # -- checkpoints (issue 28) ---------------------------------------------------------------------------------

    def checkpoint_state(self) -> dict[str, Any]:
        """What a resumed run needs of this rank's trainer, as CPU copies: the fp32 weights (this rank's shard), the
        AdamW state (moments and step counts), the version (also the LR schedule's position: `scheduled_lr` reads
        it) and the weight average. `load_checkpoint_state` takes it back."""
        optimizer = self.optimizer.state_dict()
        state = optimizer["state"]
        if self._shards:
            state = self._whole_moments(state)  # a collective: every data-parallel rank calls checkpoint_state
        return {
            "num_params": self._params.numel(),
            "version": self.version,
            "params": parallel.host_copy(self._params),
            "optimizer": {
                "state": {index: {key: (parallel.host_copy(value) if isinstance(value, torch.Tensor) else value)
                                  for key, value in entry.items()}
                          for index, entry in state.items()},
                "param_groups": optimizer["param_groups"],
            },
            "average": None if self._average is None else parallel.host_copy(self._average),
        }

    def load_checkpoint_state(self, state: Mapping[str, Any]) -> None:
        """Restore what `checkpoint_state` gave (weights, optimizer state, version, average). Raises TrainerError for
        the state of another model or shard."""
        if state.get("num_params") != self._params.numel():
            raise TrainerError(f"the checkpoint holds {state.get('num_params')} parameters, this trainer (its shard) "
                               f"{self._params.numel()}: another model or another parallel layout")
        with torch.no_grad():
            self._params.copy_(state["params"].to(self.device))
        self._sync_model_weights()
        optimizer = state["optimizer"]
        if self._shards:  # the checkpoint holds whole moments: take this rank's share
            optimizer = {**optimizer, "state": self._moment_shares(optimizer["state"])}
        self.optimizer.load_state_dict(optimizer)
        self.version = int(state["version"])
        self.zero_grads()
        average = state.get("average")
        if self.config.average_decay > 0:
            self._average = (average.to(self.device, copy=True) if average is not None
                             else self._params.detach().clone())

    def _whole_moments(self, state: Mapping[int, Mapping[str, Any]]) -> dict[int, dict[str, Any]]:
        """The sharded optimizer's state in the unsharded format, on the host: each group's moments over its whole
        run, put together from every data-parallel rank's share (a collective over the data-parallel group; on the
        device it holds one share at a time, never the whole moments)."""
        if not state:  # no step taken yet: nothing to gather, on any rank alike
            return {}
        import torch.distributed as dist
        from megatron.core import parallel_state

        group = parallel_state.get_data_parallel_group()
        ranks = dist.get_process_group_ranks(group)
        me = dist.get_rank()
        runs = ((0, self._split), (self._split, self._params.numel()))
        whole: dict[int, dict[str, Any]] = {}
        for index, (start, end) in enumerate(runs):
            mine = state[index]
            entry: dict[str, Any] = {key: value for key, value in mine.items() if key not in ("exp_avg", "exp_avg_sq")}
            for key in ("exp_avg", "exp_avg_sq"):
                host = torch.empty(end - start, dtype=mine[key].dtype)
                for (lo, hi), src in zip(self._shards, ranks):
                    a, b = max(lo, start), min(hi, end)  # rank src's part of this run: its group's range
                    if b <= a:
                        continue
                    piece = (mine[key].contiguous() if src == me
                             else torch.empty(b - a, dtype=mine[key].dtype, device=self._params.device))
                    dist.broadcast(piece, src=src, group=group)
                    host[a - start : b - start].copy_(piece)
                entry[key] = host
            whole[index] = entry
        return whole

    def _moment_shares(self, state: Mapping[Any, Mapping[str, Any]]) -> dict[int, dict[str, Any]]:
        """This rank's share of whole (unsharded-format) optimizer state."""
        runs_start = (0, self._split)
        shares: dict[int, dict[str, Any]] = {}
        for index, entry in state.items():
            index = int(index)
            lo, hi = self._group_ranges[index]
            offset = runs_start[index]
            shares[index] = {key: (value[lo - offset : hi - offset].clone() if key in ("exp_avg", "exp_avg_sq")
                                   else value) for key, value in entry.items()}
        return shares

    # -- weight average ----------------------------------------------------------------------------------------

    def _restart_average(self) -> None:
        """Loaded weights start a new average: an average across a load would mix unrelated weights."""
        if self.config.average_decay > 0:
            self._average = self._params.detach().clone()

    @property
    def has_average(self) -> bool:
        return self._average is not None

    def averaged_params(self) -> torch.Tensor:
        """A copy of the weights' moving average, flat in `param_layout()` order. Raises TrainerError without one."""
        if self._average is None:
            raise TrainerError("this trainer keeps no weight average (TrainerConfig.average_decay is 0)")
        return self._average.detach().clone()

    def save_hf(self, model_dir: str | Path, averaged: bool = False) -> Path:
        """Write a complete model directory: config and side files of the source directory, plus the weights (their
        moving average with `averaged`)."""
        return save_model_dir(self.model_dir, model_dir, self.hf_state_dict(averaged))


def checkpoint_state_digest(state: Mapping[str, Any]) -> str:
    """SHA-256 over a `checkpoint_state`'s weights, its AdamW moments and step counts, and its version (the bytes as
    they lie in memory: host tensors are hashed in place, device ones through bounded host copies)."""
    import hashlib

    digest = hashlib.sha256(f"version={state['version']}".encode())
    _hash_tensor(digest, state["params"])
    optimizer = state["optimizer"]["state"]
    for index in sorted(optimizer):
        entry = optimizer[index]
        for key in ("exp_avg", "exp_avg_sq"):
            _hash_tensor(digest, entry[key])
        step = entry.get("step")
        digest.update(repr(float(step)).encode() if step is not None else b"-")
    return digest.hexdigest()


def _hash_tensor(digest: Any, tensor: torch.Tensor) -> None:
    """Feed `tensor`'s bytes to `digest`: a host tensor in place (no copy), a device one HASH_CHUNK_BYTES at a time
    (hashlib reads host memory only, and a whole-buffer copy would cost a model's worth of host memory)."""
    from gyre.engines.transfer import HASH_CHUNK_BYTES

    flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    if flat.device.type == "cpu":
        digest.update(flat.numpy())
        return
    for start in range(0, flat.numel(), HASH_CHUNK_BYTES):
        digest.update(flat[start : start + HASH_CHUNK_BYTES].cpu().numpy())


def ema_update(average: torch.Tensor, params: torch.Tensor, decay: float) -> None:
    """average <- decay * average + (1 - decay) * params, in place (the weight average's one step)."""
    with torch.no_grad():
        average.lerp_(params.to(average.device), 1.0 - decay)
