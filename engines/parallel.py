"""Tensor, pipeline and data parallelism for the Megatron trainer: process groups, and full <-> shard weights.

A train-role cell that spans several processes (one per device) puts them in one torch.distributed group and one
megatron `parallel_state` (`init_parallel`), then builds a `MegatronTrainer` in each process exactly as a
single-process cell does: the trainer reads the tensor / pipeline / data sizes from `parallel_state` and builds its
stage's shard of the model with megatron-core's own parallel layers (ColumnParallelLinear, RowParallelLinear,
VocabParallelEmbedding), runs pipelines with megatron's schedules, and reduces data-parallel gradients over
megatron's data-parallel group. Backend: NCCL with CUDA, gloo without (the same code; `backend_for`).

Checkpoints stay whole-model HF state dicts; this module cuts a full megatron state dict (weight_convert's names)
into one rank's shard (`shard_state`) and puts shards back together (`unshard_state`, plus `gather_state` for the
collective across ranks). The shard layout is megatron's:
- column-parallel weights split along dim 0: `linear_qkv` (whole KV groups per rank, which is why weight_convert
  orders its rows group by group), `word_embeddings` and `output_layer` (vocabulary ranges);
- `linear_fc1` (gate and up stacked) splits each half along dim 0 and stacks the halves again per rank, because
  megatron's gated MLP chunks each rank's local output into gate and up (megatron's swiglu sharded state dict);
- row-parallel weights split along dim 1: `linear_proj`, `linear_fc2`;
- everything else (norms) is replicated on every tensor-parallel rank;
- pipeline stage p holds layers [p * L / pp, (p + 1) * L / pp), numbered from 0 inside the stage (megatron's
  layer offset), the embedding on the first stage and the final norm and output layer on the last. A tied model's
  last stage keeps its own copy of the embedding as `output_layer.weight` (megatron's layout when the two ends
  live on different stages); the trainer all-reduces its gradient with the first stage's so the copies stay equal.
"""

from __future__ import annotations

import re
from typing import Mapping

import attrs
import torch

from gyre.engines.errors import TrainerError
from gyre.engines.model_format import ModelSpec

__all__ = ["ParallelSizes", "backend_for", "bucket_plan", "checkpoint_part_name", "gather_buckets", "gather_state", "init_parallel",
           "shard_state", "split_dim", "unshard_state"]

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")
_DIM0 = ("self_attention.linear_qkv.weight", "mlp.linear_fc1.weight")
_DIM1 = ("self_attention.linear_proj.weight", "mlp.linear_fc2.weight")


@attrs.frozen
class ParallelSizes:
    """How one trainer's processes split the model and the batch."""

    tensor: int = 1
    """Tensor-parallel size: each layer's matrices are split across this many ranks."""
    pipeline: int = 1
    """Pipeline-parallel size: the layers are split into this many consecutive stages."""
    data: int = 1
    """Data-parallel size: this many replicas train on different rows and sum their gradients."""

    def __attrs_post_init__(self) -> None:
        for name in ("tensor", "pipeline", "data"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise TrainerError(f"{name} parallel size must be an int >= 1, got {value!r}")

    @property
    def world_size(self) -> int:
        return self.tensor * self.pipeline * self.data

    def check_fits(self, spec: ModelSpec) -> None:
        """Raise TrainerError unless `spec` splits evenly (megatron needs whole KV groups, whole layers and
        equal vocabulary ranges per rank)."""
        problems = []
        if spec.num_kv_heads % self.tensor:
            problems.append(f"num_kv_heads {spec.num_kv_heads} is not a multiple of tensor size {self.tensor}")
        if spec.ffn_size % self.tensor:
            problems.append(f"ffn_size {spec.ffn_size} is not a multiple of tensor size {self.tensor}")
        if spec.vocab_size % self.tensor:
            problems.append(f"vocab_size {spec.vocab_size} is not a multiple of tensor size {self.tensor}")
        if spec.num_layers % self.pipeline:
            problems.append(f"num_layers {spec.num_layers} is not a multiple of pipeline size {self.pipeline}")
        if spec.is_moe and self.tensor > 1:
            # The shard layout above knows no expert weights, and expert parallelism is not wired up yet.
            problems.append("a qwen3_moe model trains at tensor size 1 only (pipeline and data parallel work)")
        if problems:
            raise TrainerError("; ".join(problems))


def backend_for(device: str) -> str:
    """NCCL for CUDA tensors, gloo for CPU ones: the only difference between the two paths."""
    return "nccl" if device == "cuda" else "gloo"


def init_parallel(rank: int, world_size: int, init_method: str, sizes: ParallelSizes, device: str = "cpu",
                  timeout_s: float | None = None) -> None:
    """Join the trainer's process group (`init_method`, e.g. "tcp://127.0.0.1:PORT") and set up megatron's
    parallel state for `sizes`. Every process of the trainer calls it once, before building its MegatronTrainer.
    `timeout_s` bounds the rendezvous and every later collective wait of the group (None: torch's default)."""
    import datetime

    import torch.distributed as dist
    from megatron.core import parallel_state

    from gyre.engines import megatron_cpu

    if sizes.world_size != world_size:
        raise TrainerError(f"tensor*pipeline*data = {sizes.world_size} but the world has {world_size} processes")
    megatron_cpu.apply()
    if device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    if not dist.is_initialized():
        extra = {} if timeout_s is None else {"timeout": datetime.timedelta(seconds=timeout_s)}
        dist.init_process_group(backend_for(device), init_method=init_method, rank=rank, world_size=world_size,
                                **extra)
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=sizes.tensor,
                                             pipeline_model_parallel_size=sizes.pipeline)


def checkpoint_part_name() -> str:
    """This rank's file in a run checkpoint: "core.tp<T>.pp<P>.pt" (rank 0 of each when there is no parallel
    state yet). Data-parallel replicas hold the same state and share the file (replica 0 writes it)."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return "core.tp0.pp0.pt"
    return (f"core.tp{parallel_state.get_tensor_model_parallel_rank()}"
            f".pp{parallel_state.get_pipeline_model_parallel_rank()}.pt")


def current_sizes() -> ParallelSizes:
    from megatron.core import parallel_state

    return ParallelSizes(tensor=parallel_state.get_tensor_model_parallel_world_size(),
                         pipeline=parallel_state.get_pipeline_model_parallel_world_size(),
                         data=parallel_state.get_data_parallel_world_size())


def split_dim(name: str) -> int | None:
    """The dimension along which tensor parallelism splits megatron weight `name`; None when replicated."""
    leaf = _LAYER.sub(r"\2", name)
    if leaf in _DIM0 or name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        return 0
    if leaf in _DIM1:
        return 1
    return None


def _tp_slice(name: str, tensor: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    dim = split_dim(name)
    if dim is None or size == 1:
        return tensor.clone()
    if name.endswith("mlp.linear_fc1.weight"):
        gate, up = tensor.chunk(2, dim=0)
        return torch.cat([gate.chunk(size, dim=0)[rank], up.chunk(size, dim=0)[rank]], dim=0).clone()
    return tensor.chunk(size, dim=dim)[rank].clone()


def _tp_join(name: str, shards: list[torch.Tensor]) -> torch.Tensor:
    dim = split_dim(name)
    if dim is None or len(shards) == 1:
        return shards[0].clone()
    if name.endswith("mlp.linear_fc1.weight"):
        halves = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])], dim=0)
    return torch.cat(shards, dim=dim)


def shard_state(full: Mapping[str, torch.Tensor], spec: ModelSpec, tp_rank: int, tp_size: int, pp_rank: int,
                pp_size: int) -> dict[str, torch.Tensor]:
    """One rank's shard of a full megatron state dict (weight_convert names, no `_extra_state`)."""
    ParallelSizes(tensor=tp_size, pipeline=pp_size).check_fits(spec)
    per_stage = spec.num_layers // pp_size
    first, last = pp_rank == 0, pp_rank == pp_size - 1
    out: dict[str, torch.Tensor] = {}
    for name, tensor in full.items():
        match = _LAYER.match(name)
        if match:
            index = int(match.group(1)) - pp_rank * per_stage
            if not 0 <= index < per_stage:
                continue
            local = f"decoder.layers.{index}.{match.group(2)}"
        elif name == "embedding.word_embeddings.weight":
            if not first and not (last and spec.tie_word_embeddings):
                continue
            local = name
        else:  # final norm and output layer
            if not last:
                continue
            local = name
        if name == "embedding.word_embeddings.weight" and not first:
            local = "output_layer.weight"  # a tied model's last-stage copy of the embedding
        out[local] = _tp_slice(name, tensor, tp_rank, tp_size)
    if first and last and spec.tie_word_embeddings:
        out.pop("output_layer.weight", None)
    return out


def unshard_state(shards: Mapping[tuple[int, int], Mapping[str, torch.Tensor]], spec: ModelSpec, tp_size: int,
                  pp_size: int) -> dict[str, torch.Tensor]:
    """The full megatron state dict from every rank's shard, keyed by (tp_rank, pp_rank)."""
    per_stage = spec.num_layers // pp_size
    out: dict[str, torch.Tensor] = {}
    for pp_rank in range(pp_size):
        stage = [shards[(t, pp_rank)] for t in range(tp_size)]
        for local in stage[0]:
            if local.endswith("._extra_state"):
                continue
            match = _LAYER.match(local)
            name = f"decoder.layers.{int(match.group(1)) + pp_rank * per_stage}.{match.group(2)}" if match else local
            if spec.tie_word_embeddings and name == "output_layer.weight":
                continue  # the last stage's copy of the embedding; the first stage's is the one exported
            out[name] = _tp_join(name, [s[local] for s in stage])
    return out


def gather_state(local: Mapping[str, torch.Tensor], spec: ModelSpec) -> dict[str, torch.Tensor]:
    """Collective over the model-parallel group: every rank passes its shard and gets the full state dict (CPU).

    It moves the whole model to every rank, fine for tests and small models; publishing weights from a large
    sharded trainer gathers per bucket instead (`gather_buckets`)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    sizes = current_sizes()
    mine = {k: v.detach().cpu() for k, v in local.items() if not k.endswith("._extra_state")}
    if sizes.tensor == sizes.pipeline == 1:
        return unshard_state({(0, 0): mine}, spec, 1, 1)
    group = parallel_state.get_model_parallel_group()
    entries: list = [None] * dist.get_world_size(group)
    key = (parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_pipeline_model_parallel_rank())
    dist.all_gather_object(entries, (key, mine), group=group)
    return unshard_state(dict(entries), spec, sizes.tensor, sizes.pipeline)


def _units(spec: ModelSpec) -> list[list[str]]:
    """The full megatron names in publishing units: the embedding, each decoder layer, the final norm (+ output
    layer). A unit is what one HF conversion needs (weight_convert.megatron_layer_to_hf takes one layer)."""
    from gyre.engines.weight_convert import megatron_param_names

    units: dict[str, list[str]] = {}
    for name in megatron_param_names(spec):
        match = _LAYER.match(name)
        key = f"layer{match.group(1)}" if match else ("embedding" if name.startswith("embedding.") else "final")
        units.setdefault(key, []).append(name)
    return list(units.values())


def _unit_bytes(spec: ModelSpec, names: list[str]) -> int:
    return sum(_full_numel(spec, name) for name in names) * 4


def _full_numel(spec: ModelSpec, name: str) -> int:
    """Elements of full megatron weight `name` (from the spec alone: every rank plans alike, nothing gathered)."""
    h, hd = spec.hidden_size, spec.head_dim
    leaf = _LAYER.sub(r"\2", name)
    if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        return spec.vocab_size * h
    if leaf == "self_attention.linear_qkv.weight":
        return (spec.num_heads + 2 * spec.num_kv_heads) * hd * h
    if leaf == "self_attention.linear_proj.weight":
        return h * spec.num_heads * hd
    if leaf in ("self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight"):
        return hd
    if leaf == "mlp.linear_fc1.weight":
        return 2 * spec.ffn_size * h
    if leaf == "mlp.linear_fc2.weight":
        return spec.ffn_size * h
    if leaf.endswith("linear_fc1.weight"):  # an expert's
        return 2 * spec.moe_ffn_size * h
    if leaf.endswith("linear_fc2.weight"):
        return spec.moe_ffn_size * h
    if leaf == "mlp.router.weight":
        return spec.num_experts * h
    return h  # norms


def bucket_plan(spec: ModelSpec, bucket_bytes: int) -> list[list[str]]:
    """Full megatron names in buckets of whole units (embedding, one decoder layer, final norm and output layer)
    of at most `bucket_bytes` fp32 bytes each; a unit larger than that is a bucket of its own. Every rank computes
    the same plan from the spec alone."""
    if bucket_bytes < 1:
        raise TrainerError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    buckets: list[list[str]] = []
    current: list[str] = []
    size = 0
    for unit in _units(spec):
        unit_size = _unit_bytes(spec, unit)
        if current and size + unit_size > bucket_bytes:
            buckets.append(current)
            current, size = [], 0
        current.extend(unit)
        size += unit_size
    if current:
        buckets.append(current)
    return buckets


def _local_name(name: str, spec: ModelSpec, pp_rank: int, pp_size: int) -> str | None:
    """What rank `pp_rank` calls full megatron weight `name`, or None when its stage does not hold it."""
    per_stage = spec.num_layers // pp_size
    match = _LAYER.match(name)
    if match:
        index = int(match.group(1)) - pp_rank * per_stage
        return f"decoder.layers.{index}.{match.group(2)}" if 0 <= index < per_stage else None
    if name == "embedding.word_embeddings.weight":
        return name if pp_rank == 0 else None  # a tied last stage's copy is not published: the first stage's is
    return name if pp_rank == pp_size - 1 else None


def gather_buckets(local: Mapping[str, torch.Tensor], spec: ModelSpec, bucket_bytes: int):
    """Collective generator over the model-parallel group: every rank iterates it in step, passing its shard; the
    group's first rank in data-parallel replica 0 gets each bucket's full megatron tensors (CPU), every other rank an
    empty dict per bucket. One bucket (`bucket_plan`) is gathered at a time, so no rank ever holds more of the model
    than its own shard plus one bucket: a publisher converts and sends each bucket, then drops it.

    How: once per iteration every rank tells the others which names it holds in which shard shape (one small object
    gather); then, per bucket, each rank that holds part of it sends its pieces as one flat tensor to the publisher,
    which receives exactly the bucket's bytes (point to point: gloo or NCCL, the tensors on the shard's device)."""
    import math

    import torch.distributed as dist
    from megatron.core import parallel_state

    sizes = current_sizes()
    plan = bucket_plan(spec, bucket_bytes)
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    single = sizes.tensor == sizes.pipeline == 1
    group = None if single else parallel_state.get_model_parallel_group()
    replica0 = parallel_state.get_data_parallel_rank() == 0
    publisher = replica0 and (single or dist.get_rank() == dist.get_global_rank(group, 0))
    held: dict[str, torch.Tensor] = {}
    for name in (n for bucket in plan for n in bucket):
        local_name = _local_name(name, spec, pp_rank, sizes.pipeline)
        if local_name is not None:
            held[name] = local[local_name].detach()
    layout: list = []
    if not single and replica0:  # another replica's group holds the same weights: nothing to gather there
        layout = [None] * dist.get_world_size(group)
        dist.all_gather_object(layout, ((tp_rank, pp_rank), {n: tuple(t.shape) for n, t in held.items()}),
                               group=group)
    for bucket in plan:
        if single:
            yield {name: held[name].cpu().clone() for name in bucket} if replica0 else {}
            continue
        if not replica0:
            yield {}
            continue
        mine = [held[name].reshape(-1) for name in bucket if name in held]
        if not publisher:
            if mine:
                dist.send(torch.cat(mine).contiguous(), dst=dist.get_global_rank(group, 0), group=group)
            yield {}
            continue
        pieces = {}
        for member, (key, shapes) in enumerate(layout):
            names = [name for name in bucket if name in shapes]
            if not names:
                continue
            if member == 0:
                data = torch.cat(mine)
            else:
                data = torch.empty(sum(math.prod(shapes[n]) for n in names), dtype=mine[0].dtype if mine else
                                   torch.float32, device=next(iter(held.values())).device)
                dist.recv(data, src=dist.get_global_rank(group, member), group=group)
            data, offset, own = data.cpu(), 0, {}
            for name in names:
                numel = math.prod(shapes[name])
                own[name] = data[offset : offset + numel].view(shapes[name])
                offset += numel
            pieces[key] = own
        full = {}
        for name in bucket:
            stage = next(p for p in range(sizes.pipeline) if _local_name(name, spec, p, sizes.pipeline) is not None)
            full[name] = _tp_join(name, [pieces[(t, stage)][name] for t in range(sizes.tensor)])
        yield full
