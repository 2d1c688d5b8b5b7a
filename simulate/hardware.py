"""Hardware and model profiles, and the cost models an emulated cell runs on. Every constant names its source.

Sources (tags as in shared/reference/agent-workloads.md: V verified primary, S secondary, D derived, U unverified):
- H100 SXM and H200: ~989 TFLOP/s dense BF16 each (NVIDIA H100 datasheet; the H200 has the same GH100 compute),
  HBM 80 GB at 3.35 TB/s (H100) vs 141 GB at 4.8 TB/s (H200) (NVIDIA H200 datasheet) [V]; so ~1.4x decode [D].
- Network: 400 Gb/s (50 GB/s) per GPU, the ConnectX-7 NIC of a DGX H100/H200 node [V]. Weight sync is calibrated on
  checkpoint-engine's Qwen3-235B update, 6.22 s on 8xH800 [V]: 470 GB of BF16 over 8 x 50 GB/s at 30% link
  efficiency is 3.9 s, plus a 2 s fixed cost (pause, reload, resume) = 5.9 s.
- Training utilization: Megatron MoE training reaches ~368-468 TFLOP/s per H100 [V/S], 37-47% of peak; we take 35%
  for long-context RL micro-steps (dynamic shapes, padding).
- Decode: memory-bound. One engine iteration reads the weights once (all experts of a MoE are touched at batch
  sizes above ~64) and every running sequence's KV; iteration time = bytes / (HBM bandwidth x 70%) (the fraction
  that SGLang/vLLM decode kernels reach, e.g. FlashInfer's reported 70-80%) plus a 5 ms scheduling overhead per
  iteration (SGLang's CPU overhead per batch, order of ms) [D]. It also caps at the compute roofline.
- Prefill: compute-bound at 2 x active params FLOPs per token, 50% utilization [D]; chunked prefill mixes at most
  8,192 prompt tokens into each iteration (SGLang's default `chunked_prefill_size` for large GPUs) [V: SGLang
  server_args]. Attention's quadratic term is left out (small against the MLP at these context lengths) [D].
- KV memory: 90% of HBM is the engine's (SGLang's `mem_fraction_static` ~0.88-0.9) minus the weights [V/D];
  Qwen3-235B-A22B: 94 layers, 4 KV heads, head dim 128 -> 94 x 4 x 128 x 2 (K,V) x 2 bytes = 192,512 bytes a
  token (its config.json) [V].
- Role switches: 8.52 s rollout -> train, 3.46 s train -> rollout (the seed's measurement) [U].
"""

from __future__ import annotations

import math

import attrs

from gyre.runtime.errors import GyreError
from gyre.runtime.validators import positive

__all__ = ["HARDWARE", "GpuProfile", "ModelProfile", "CellModel", "HardwareError"]


class HardwareError(GyreError, ValueError):
    """A cell that cannot hold the model."""


@attrs.frozen
class GpuProfile:
    """One GPU type."""

    name: str
    """Profile name (h100, h200)."""
    bf16_flops: float = attrs.field(validator=positive)
    """Dense BF16 FLOP/s."""
    hbm_bytes: float = attrs.field(validator=positive)
    """Memory."""
    hbm_bytes_per_s: float = attrs.field(validator=positive)
    """Memory bandwidth."""
    nic_bytes_per_s: float = attrs.field(default=50e9, validator=positive)
    """Network bandwidth per GPU (400 Gb/s ConnectX-7)."""


HARDWARE = {
    "h100": GpuProfile("h100", bf16_flops=989e12, hbm_bytes=80e9, hbm_bytes_per_s=3.35e12),
    "h200": GpuProfile("h200", bf16_flops=989e12, hbm_bytes=141e9, hbm_bytes_per_s=4.8e12),
}


@attrs.frozen
class ModelProfile:
    """The model being trained (defaults: Qwen3-235B-A22B)."""

    active_params: float = attrs.field(default=22e9, validator=positive)
    """Parameters a token passes through (drives FLOPs)."""
    total_params: float = attrs.field(default=235e9, validator=positive)
    """All parameters (drives weight bytes, memory and sync)."""
    kv_bytes_per_token: float = attrs.field(default=192_512.0, validator=positive)
    """KV cache bytes a token occupies."""
    weight_bytes_per_param: float = attrs.field(default=2.0, validator=positive)
    """BF16 weights."""

    @property
    def weight_bytes(self) -> float:
        return self.total_params * self.weight_bytes_per_param


@attrs.frozen
class CellModel:
    """Cost model of one cell of `gpus` GPUs: what each of its operations takes, in seconds."""

    gpu: GpuProfile
    """GPU type."""
    gpus: int = attrs.field(validator=positive)
    """GPUs in the cell (one engine with tensor/expert parallelism across them)."""
    model: ModelProfile = ModelProfile()
    """The model."""
    train_utilization: float = 0.35
    """Fraction of peak FLOP/s a training micro-step reaches (module docstring)."""
    prefill_utilization: float = 0.5
    """Fraction of peak a prefill reaches."""
    decode_bandwidth_fraction: float = 0.7
    """Fraction of HBM bandwidth a decode iteration reaches."""
    iteration_overhead_s: float = 0.005
    """Scheduling overhead of one engine iteration."""
    chunked_prefill_tokens: int = 8192
    """Prompt tokens one iteration takes at most."""
    engine_memory_fraction: float = 0.9
    """Share of HBM the engine may use (weights + KV)."""
    max_running_requests: int = 1024
    """Engine bound on sequences decoding at once."""
    rollout_to_train_s: float = 8.52
    """Role switch into training (seed's measurement)."""
    train_to_rollout_s: float = 3.46
    """Role switch back into rollout."""
    sync_fixed_s: float = 2.0
    """Fixed cost of a weight update on a rollout cell (pause, reload, resume)."""
    link_efficiency: float = 0.3
    """Share of the NIC bandwidth a weight broadcast reaches (calibrated on checkpoint-engine, module docstring)."""
    optimizer_step_s: float = 2.0
    """The core's optimizer step on its shard (Adam over the parameters; a few seconds) [D]."""

    def __attrs_post_init__(self) -> None:
        if self.kv_capacity_tokens < 1:
            raise HardwareError(
                f"{self.model.weight_bytes / 1e9:.0f} GB of weights leave no KV room on {self.gpus} x {self.gpu.name}"
            )

    # ---- memory ---------------------------------------------------------------------------------------------------
    @property
    def kv_capacity_tokens(self) -> int:
        """Tokens of KV the cell holds: engine memory minus weights, over KV bytes per token."""
        free = self.gpus * self.gpu.hbm_bytes * self.engine_memory_fraction - self.model.weight_bytes
        return int(free // self.model.kv_bytes_per_token) if free > 0 else 0

    # ---- rollout --------------------------------------------------------------------------------------------------
    def decode_iteration_s(self, sequences: int, context_tokens: float) -> float:
        """One decode iteration for `sequences` running sequences holding `context_tokens` of KV in all."""
        bandwidth = self.gpus * self.gpu.hbm_bytes_per_s * self.decode_bandwidth_fraction
        memory_s = (self.model.weight_bytes + context_tokens * self.model.kv_bytes_per_token) / bandwidth
        compute_s = sequences * 2 * self.model.active_params / (self.gpus * self.gpu.bf16_flops * 0.5)
        return max(memory_s, compute_s) + self.iteration_overhead_s

    def decode_tokens_per_s(self, sequences: int, context_tokens: float) -> float:
        """Output tokens a second over all `sequences` (each gets one per iteration)."""
        if sequences <= 0:
            return 0.0
        return sequences / self.decode_iteration_s(sequences, context_tokens)

    @property
    def prefill_tokens_per_s(self) -> float:
        """Prompt tokens a second when the cell only prefills."""
        return self.gpus * self.gpu.bf16_flops * self.prefill_utilization / (2 * self.model.active_params)

    def mixed_iteration_s(self, sequences: int, context_tokens: float, prefill_tokens: float) -> float:
        """An iteration that decodes `sequences` and prefills `prefill_tokens` (at most one chunk)."""
        chunk = min(prefill_tokens, self.chunked_prefill_tokens)
        decode_s = self.decode_iteration_s(sequences, context_tokens) if sequences else self.iteration_overhead_s
        return decode_s + chunk / self.prefill_tokens_per_s

    # ---- training -------------------------------------------------------------------------------------------------
    def train_s(self, tokens: int) -> float:
        """Forward-backward (6 x active x tokens) plus the log-prob pass (2 x active x tokens) at the stated
        utilization."""
        flops = 8 * self.model.active_params * tokens
        return flops / (self.gpus * self.gpu.bf16_flops * self.train_utilization)

    # ---- weights --------------------------------------------------------------------------------------------------
    @property
    def weight_bytes(self) -> float:
        """Bytes of one published version (the model's weights)."""
        return self.model.weight_bytes

    @property
    def weight_sync_s(self) -> float:
        """A rollout or satellite cell loading a new version: BF16 weights over its NICs, plus the fixed cost."""
        return self.sync_fixed_s + self.model.weight_bytes / (self.gpus * self.gpu.nic_bytes_per_s * self.link_efficiency)

    @property
    def gradient_reduce_s(self) -> float:
        """Satellites' gradients reduced into the core once a step (FP32, ring all-reduce moves ~2x the bytes)."""
        return 2 * self.model.total_params * 4 / (self.gpus * self.gpu.nic_bytes_per_s * self.link_efficiency)

    def capacity_sessions(self, mean_context_tokens: float) -> int:
        """Sessions whose KV the cell keeps at `mean_context_tokens` each (what it reports as capacity)."""
        return max(1, min(self.max_running_requests, math.floor(self.kv_capacity_tokens / max(1.0, mean_context_tokens))))
