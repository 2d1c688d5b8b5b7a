"""CPU replacements for the CUDA-only spots of megatron-core, in one place.

megatron-core assumes a GPU in a handful of spots on the path Gyre uses (GPTModel with the local layer spec,
tensor-parallel layers of size 1, plain torch.optim). Each one fails on a machine without CUDA; each replacement
below keeps the original behaviour but on the CPU. They are applied only when `torch.cuda.is_available()` is
False, so the GPU path runs megatron-core unchanged, and `apply()` is idempotent (safe to call from every trainer).

Checked against megatron-core 0.16.1 (the spots are still present in 0.19.2); see
/work/shared/reference/megatron-cpu.md. Megatron's own DDP wrapper and get_megatron_optimizer also hard-code CUDA,
but Gyre does not use them on CPU: plain torch.optim.AdamW over GPTModel.parameters() gives the same updates.

The shims:
1. `GlobalMemoryBuffer.get_tensor` allocates its scratch buffer (the attention score buffer) on
   `torch.cuda.current_device()`. CPU: a fresh CPU tensor per call; allocation is cheap on CPU, and no buffer is
   shared between trainers that live in one process.
2. `CudaRNGStatesTracker.fork` swaps in a CUDA RNG state around dropout ("cuda rng state model-parallel-rng is not
   added"). CPU: a no-op context; dropout (zero in Gyre's configs) draws from torch's default CPU generator.
3. `RotaryEmbedding.get_emb` moves `inv_freq` to the CUDA device on the first forward. CPU: leave it where it is.
4. `get_default_causal_mask` / `get_sliding_window_causal_mask` build masks with device="cuda" (only when no mask
   is passed). CPU: the same masks on the CPU. `fused_softmax` imports them by name, so it is patched too.
5. `model_parallel_cuda_manual_seed` seeds CUDA generators. CPU: seed torch's CPU generator (the trainer does not
   call it, but shared megatron code might).
"""

from __future__ import annotations

import contextlib
import functools

import structlog
import torch

__all__ = ["apply", "is_applied"]

log = structlog.get_logger(__name__)

_applied = False


def _cpu_get_tensor(self, tensor_shape, dtype, name, mem_alloc_context=None):
    return torch.empty(tuple(tensor_shape), dtype=dtype, device="cpu", requires_grad=False)


def _cpu_fork(self, name=None):
    return contextlib.nullcontext()


def _cpu_get_emb(self, max_seq_len: int, offset: int = 0) -> torch.Tensor:
    # Same as RotaryEmbedding.get_emb minus the move of inv_freq to CUDA.
    freqs = self.get_freqs_non_repeated(max_seq_len, offset)
    if not self.rotary_interleaved:
        emb = torch.cat((freqs, freqs), dim=-1)
    else:
        emb = torch.stack((freqs.view(-1, 1), freqs.view(-1, 1)), dim=-1).view(freqs.shape[0], -1)
    return emb[:, None, None, :]


@functools.lru_cache(maxsize=16)
def _cpu_causal_mask(sq: int) -> torch.Tensor:
    return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)


def _cpu_sliding_window_mask(sq, skv, window_size):
    m = torch.ones(sq, skv, dtype=torch.bool)
    mu = torch.triu(m, diagonal=skv - sq - window_size[0])
    return ~torch.tril(mu, diagonal=skv - sq + window_size[1])


def _cpu_manual_seed(seed: int, *args, **kwargs) -> None:
    torch.manual_seed(seed)


def apply() -> bool:
    """Install the CPU shims if there is no CUDA device. Returns True when they are (or already were) installed."""
    global _applied
    if torch.cuda.is_available():
        return False
    if _applied:
        return True
    from megatron.core import utils as core_utils
    from megatron.core.fusions import fused_softmax
    from megatron.core.models.common.embeddings import rotary_pos_embedding
    from megatron.core.tensor_parallel import random as tp_random
    from megatron.core.transformer import utils as transformer_utils

    core_utils.GlobalMemoryBuffer.get_tensor = _cpu_get_tensor
    tp_random.CudaRNGStatesTracker.fork = _cpu_fork
    rotary_pos_embedding.RotaryEmbedding.get_emb = _cpu_get_emb
    # The forward is lru-cached per instance and length; entries made before the patch would be CUDA ones, but
    # none can exist because forward fails without CUDA until now.
    transformer_utils.get_default_causal_mask = _cpu_causal_mask
    transformer_utils.get_sliding_window_causal_mask = _cpu_sliding_window_mask
    fused_softmax.get_default_causal_mask = _cpu_causal_mask
    fused_softmax.get_sliding_window_causal_mask = _cpu_sliding_window_mask
    tp_random.model_parallel_cuda_manual_seed = _cpu_manual_seed
    import megatron.core.tensor_parallel as tensor_parallel

    if hasattr(tensor_parallel, "model_parallel_cuda_manual_seed"):
        tensor_parallel.model_parallel_cuda_manual_seed = _cpu_manual_seed
    _applied = True
    log.info("megatron_cpu_shims_applied", shims=5)
    return True


def is_applied() -> bool:
    return _applied
