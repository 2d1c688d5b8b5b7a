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
6. Parallel paths: the pipeline schedules (`pipeline_parallel.schedules`) count tokens in
   `torch.zeros(..., device="cuda")`; the point-to-point layer (`pipeline_parallel.p2p_communication`) allocates
   receive buffers on `torch.cuda.current_device()` and calls `torch.cuda.synchronize()`; the tensor-parallel
   gathers (`tensor_parallel.mappings`) and layers (`tensor_parallel.layers`) allocate their outputs on
   `torch.cuda.current_device()`; the MoE router, experts and helpers (`transformer.moe.router`, `.experts`,
   `.moe_utils`) move the router weight and allocate on it too. CPU: those modules see `torch` through `_CpuTorch`, which forwards everything to
   torch except that a CUDA device in a tensor factory becomes the CPU, `cuda.current_device()` answers "cpu" and
   `cuda.synchronize()` does nothing. Only those modules' name `torch` is rebound: the rest of the process (and
   what they evaluated at import) keeps the real module.
7. `LanguageModule.setup_embeddings_and_output_layer` moves a tied model's embedding to CUDA (`weight.data.cuda()`)
   before summing the first and last pipeline stages' copies. CPU: the original method runs with `Tensor.cuda`
   answering the tensor itself for the length of the call (without CUDA it could only have raised).
8. Without Transformer Engine, `transformer.moe.moe_utils` never defines `te_general_gemm` but its router GEMM
   tests `te_general_gemm is not None` (a NameError in megatron-core 0.16.1). CPU: define it as None, which
   selects the plain torch path that was meant.
9. The all-to-all token dispatcher of expert parallelism (`transformer.moe.token_dispatcher`) makes a CUDA stream
   when it is built (`torch.cuda.Stream()`) and copies its token counts to the host on that stream
   (`torch.cuda.current_stream()`, `torch.cuda.stream(...)`, `record_event()`, `event.synchronize()`). CPU: the
   module sees `_CpuTorch` too, whose `cuda` answers with a stream that stands for the CPU's one program order
   (waits and events do nothing: every CPU op has finished when it returns). Its host copies go through
   `maybe_move_tensor_to_cpu`, which leaves a CPU tensor as it is even where the caller asked for numpy; the split
   sizes then reach `all_to_all_single` as tensors, which it refuses. CPU: the dispatcher's copy of that function
   gives numpy for CPU tensors too, as the original does for CUDA ones.
10. megatron's parallel state makes ~20 process groups (tensor, pipeline, data, context, expert, embedding, ... and
   their gloo twins), and on the CPU every one is a gloo group. torch gives each gloo group a TCP device of its
   own, and each device runs a loop thread that wakes every 10 ms whether or not anything is sent (gloo's
   tcp/loop.cc), so a trainer of one process kept 21 such threads: 2,000 wake-ups and ~0.02 CPU-s a second while
   idle, ~2% of a core per cell under load (BENCHMARKS.md, session 26). CPU: a group of one rank, which never
   connects to anyone, gets one device shared by all such groups of the process (`_LoneRankGlooGroups`); a
   group of several ranks keeps a device of its own, as before. Gloo multiplexes any number of contexts on a
   device; the one shared here carries no traffic at all.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import threading

import structlog
import torch

__all__ = ["apply", "is_applied"]

log = structlog.get_logger(__name__)

_applied = False
_apply_lock = threading.Lock()
"""apply() runs once even when two threads call it at once (a cell prepares its training runtime in one thread while
a trainer is built in another): twice, shim 10 wrapped its own subclass, and a group made between the two swaps
failed c10d's isinstance check ("Expected ProcessGroupGloo, got <class '...ProcessGroupGloo'>")."""


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


_FACTORIES = frozenset({"zeros", "empty", "ones", "full", "tensor", "zeros_like", "empty_like", "ones_like"})


def _cpu_device(device):
    if device is None:
        return None
    if isinstance(device, int) or (isinstance(device, (str, torch.device)) and str(device).startswith("cuda")):
        return torch.device("cpu")
    return device


def _lone_rank_gloo_groups(base: type) -> type:
    """A subclass of torch's ProcessGroupGloo whose single-rank groups share one device (shim 10); c10d builds its
    gloo groups from the name this replaces, and its type checks use the same name, so they still hold."""
    devices: list = []
    lock = threading.Lock()

    class _LoneRankGlooGroups(base):
        def __init__(self, store, rank, size, timeout=datetime.timedelta(seconds=1800)) -> None:
            # `timeout`: a timedelta (how c10d calls it) or the backend's options (the constructor's other form).
            if size != 1:
                super().__init__(store, rank, size, timeout)
                return
            with lock:
                if not devices:
                    devices.append(base.create_default_device())
            if isinstance(timeout, datetime.timedelta):
                options = base._Options()
                options._timeout = timeout
            else:
                options = timeout
            options._devices = [devices[0]]
            super().__init__(store, rank, size, options)

    _LoneRankGlooGroups._gyre_lone_rank_groups = True
    _LoneRankGlooGroups.__name__ = _LoneRankGlooGroups.__qualname__ = base.__name__
    _LoneRankGlooGroups.__module__ = base.__module__
    return _LoneRankGlooGroups


class _CpuEvent:
    """A CUDA event on the CPU: the work before it is done by the time anyone can ask (shim 9)."""

    def synchronize(self) -> None:
        return None

    def wait(self, stream=None) -> None:
        return None


class _CpuStream:
    """A CUDA stream on the CPU: the process's one program order (shim 9)."""

    def wait_stream(self, stream) -> None:
        return None

    def wait_event(self, event) -> None:
        return None

    def record_event(self, event=None) -> _CpuEvent:
        return _CpuEvent()

    def synchronize(self) -> None:
        return None


_CPU_STREAM = _CpuStream()


class _CpuCuda:
    """torch.cuda as the pipeline and MoE code sees it on a machine without CUDA."""

    def current_device(self) -> str:
        return "cpu"

    def synchronize(self, device=None) -> None:
        return None

    def Stream(self, *args, **kwargs) -> _CpuStream:  # noqa: N802 (torch.cuda's name)
        return _CPU_STREAM

    def current_stream(self, device=None) -> _CpuStream:
        return _CPU_STREAM

    def stream(self, stream) -> contextlib.nullcontext:
        return contextlib.nullcontext()

    def __getattr__(self, name):
        return getattr(torch.cuda, name)


class _CpuTorch:
    """torch with CUDA tensor factories redirected to the CPU (shim 6)."""

    cuda = _CpuCuda()

    def __getattr__(self, name):
        value = getattr(torch, name)
        if name in _FACTORIES:
            @functools.wraps(value)
            def factory(*args, **kwargs):
                if "device" in kwargs:
                    kwargs["device"] = _cpu_device(kwargs["device"])
                return value(*args, **kwargs)

            return factory
        return value


def _cpu_move_to_cpu(original):
    @functools.wraps(original)
    def move(tensor, as_numpy: bool = False, record_stream: bool = False):
        if torch.is_tensor(tensor) and not tensor.is_cuda and as_numpy:
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    return move


def _cpu_setup_embeddings(original):
    @functools.wraps(original)
    def setup(self, *args, **kwargs):
        real_cuda = torch.Tensor.cuda
        torch.Tensor.cuda = lambda tensor, *a, **k: tensor
        try:
            return original(self, *args, **kwargs)
        finally:
            torch.Tensor.cuda = real_cuda

    return setup


def apply() -> bool:
    """Install the CPU shims if there is no CUDA device. Returns True when they are (or already were) installed."""
    if torch.cuda.is_available():
        return False
    with _apply_lock:
        return _apply_once()


def _apply_once() -> bool:
    global _applied
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
    from megatron.core.pipeline_parallel import p2p_communication, schedules
    from megatron.core.tensor_parallel import layers as tp_layers
    from megatron.core.tensor_parallel import mappings as tp_mappings

    from megatron.core.models.common.language_module.language_module import LanguageModule

    LanguageModule.setup_embeddings_and_output_layer = _cpu_setup_embeddings(
        LanguageModule.setup_embeddings_and_output_layer)
    from megatron.core.transformer.moe import experts as moe_experts
    from megatron.core.transformer.moe import moe_utils
    from megatron.core.transformer.moe import router as moe_router
    from megatron.core.transformer.moe import token_dispatcher as moe_dispatcher

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    moe_dispatcher.maybe_move_tensor_to_cpu = _cpu_move_to_cpu(moe_dispatcher.maybe_move_tensor_to_cpu)
    cpu_torch = _CpuTorch()
    for module in (schedules, p2p_communication, tp_mappings, tp_layers, moe_router, moe_experts, moe_utils,
                   moe_dispatcher):
        module.torch = cpu_torch
    from torch.distributed import distributed_c10d

    if getattr(distributed_c10d, "ProcessGroupGloo", None) is not None:  # a torch built without gloo has none
        if not getattr(distributed_c10d.ProcessGroupGloo, "_gyre_lone_rank_groups", False):  # never wrapped twice
            distributed_c10d.ProcessGroupGloo = _lone_rank_gloo_groups(distributed_c10d.ProcessGroupGloo)
    _applied = True
    log.info("megatron_cpu_shims_applied", shims=10)
    return True


def is_applied() -> bool:
    return _applied
