"""Tensor, pipeline, data and expert parallelism for the Megatron trainer: process groups, full <-> shard weights.

A train-role cell that spans several processes (one per device) puts them in one torch.distributed group and one
megatron `parallel_state` (`init_parallel`), then builds a `MegatronTrainer` in each process exactly as a
single-process cell does: the trainer reads the tensor / pipeline / data sizes from `parallel_state` and builds its
stage's shard of the model with megatron-core's own parallel layers (ColumnParallelLinear, RowParallelLinear,
VocabParallelEmbedding), runs pipelines with megatron's schedules, and reduces data-parallel gradients over
megatron's data-parallel group. Backend: NCCL with CUDA, gloo without (the same code; `backend_for`).

Expert parallelism (MoE models) is megatron's own: `expert_model_parallel_size` in `initialize_model_parallel`
takes the expert-parallel ranks out of the data-parallel ones (the world stays tensor * pipeline * data; megatron's
rank order "tp-cp-ep-dp-pp" makes neighbouring data-parallel ranks one expert-parallel group), each rank holds
num_experts / expert of every sparse layer's experts (megatron's local experts: rank e holds global experts
[e * n, (e + 1) * n), numbered from 0 locally), and megatron's token dispatcher sends each token to the ranks of its
experts and back. The dense weights stay replicated over all data-parallel ranks; an expert's replicas are the ranks
of megatron's expert-data-parallel group (data / expert of them), which is where its gradient is summed.

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
  live on different stages); the trainer all-reduces its gradient with the first stage's so the copies stay equal;
- expert-parallel rank e holds experts [e * n, (e + 1) * n) of each sparse layer (n = num_experts / expert) as
  `mlp.experts.local_experts.0 .. n-1`, and every dense weight (the router too) whole.
A shard is named by its (tensor, pipeline, expert) ranks (`shard_rank`); the ranks that hold the same shard are its
replicas, and the first of them (`is_first_replica`) writes its checkpoint file and takes part in publishing.
"""

from __future__ import annotations

import re
from typing import Mapping

import attrs
import torch

from gyre.engines.errors import TrainerError
from gyre.engines.model_format import ModelSpec

__all__ = ["ParallelSizes", "backend_for", "bucket_plan", "checkpoint_part_name", "gather_buckets", "gather_state",
           "host_copy", "init_parallel", "is_expert_param", "is_first_replica", "shard_rank", "shard_state",
           "split_dim", "unshard_state"]

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")
_EXPERT = re.compile(r"^(.*\.mlp\.experts\.local_experts\.)(\d+)(\..*)$")
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
    expert: int = 1
    """Expert-parallel size (MoE models): each sparse layer's experts are split over this many of the data-parallel
    ranks (megatron's expert_model_parallel_size; it must divide `data`), which exchange tokens with each other."""

    def __attrs_post_init__(self) -> None:
        for name in ("tensor", "pipeline", "data", "expert"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise TrainerError(f"{name} parallel size must be an int >= 1, got {value!r}")

    @property
    def world_size(self) -> int:
        """Processes: tensor * pipeline * data (the expert-parallel ranks are data-parallel ones)."""
        return self.tensor * self.pipeline * self.data

    @property
    def expert_data(self) -> int:
        """How many ranks hold each expert (megatron's expert-data-parallel size): data / expert, with experts
        split over tensor ranks as the dense layers are (megatron's default expert_tensor_parallel_size)."""
        return self.data // self.expert

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
            # The shard layout above splits no expert weight along tensor ranks, and megatron's expert tensor
            # parallelism with expert parallelism wants sequence parallelism and uneven all-gathers (gloo has none).
            problems.append("a qwen3_moe model trains at tensor size 1 only (pipeline, data and expert parallel work)")
        if self.expert > 1 and not spec.is_moe:
            problems.append(f"expert size {self.expert} needs a qwen3_moe model; this one is dense (no experts)")
        if spec.is_moe and spec.num_experts % self.expert:
            problems.append(f"num_experts {spec.num_experts} is not a multiple of expert size {self.expert}")
        if self.data % self.expert:
            # megatron's initialize_model_parallel: tensor * expert * pipeline must divide the world.
            problems.append(f"data size {self.data} is not a multiple of expert size {self.expert} (megatron takes the "
                            "expert-parallel ranks out of the data-parallel ones)")
        if problems:
            raise TrainerError("; ".join(problems))


def host_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A CPU copy of `tensor`, detached: one copy whether it lies on the host (`.cpu()` would alias it) or on a
    device (`.cpu().clone()` would copy twice)."""
    return tensor.detach().to("cpu", copy=True)


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
                                             pipeline_model_parallel_size=sizes.pipeline,
                                             expert_model_parallel_size=sizes.expert)


def shard_rank() -> tuple[int, int, int]:
    """This rank's shard: its (tensor, pipeline, expert) ranks; (0, 0, 0) when there is no parallel state yet."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return (0, 0, 0)
    return (parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_pipeline_model_parallel_rank(),
            parallel_state.get_expert_model_parallel_rank())


def is_first_replica() -> bool:
    """Whether this rank is the first of the ranks that hold its shard: data-parallel replica 0, or with expert
    parallelism expert-data-parallel rank 0 (the ranks of one expert-parallel group hold the same dense weights but
    different experts, so each of them is the first holder of its shard). It writes the shard's checkpoint file and
    takes part in publishing."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return True
    if parallel_state.get_expert_model_parallel_world_size() > 1:
        return parallel_state.get_expert_data_parallel_rank() == 0
    return parallel_state.get_data_parallel_rank() == 0


def checkpoint_part_name() -> str:
    """This rank's file in a run checkpoint: "core.tp<T>.pp<P>.pt", with expert parallelism
    "core.tp<T>.pp<P>.ep<E>.pt" (rank 0 of each when there is no parallel state yet). The replicas of a shard hold
    the same state and share the file (the first replica writes it: `is_first_replica`)."""
    from megatron.core import parallel_state

    tp, pp, ep = shard_rank()
    if parallel_state.model_parallel_is_initialized() and parallel_state.get_expert_model_parallel_world_size() > 1:
        return f"core.tp{tp}.pp{pp}.ep{ep}.pt"
    return f"core.tp{tp}.pp{pp}.pt"


def current_sizes() -> ParallelSizes:
    from megatron.core import parallel_state

    return ParallelSizes(tensor=parallel_state.get_tensor_model_parallel_world_size(),
                         pipeline=parallel_state.get_pipeline_model_parallel_world_size(),
                         data=parallel_state.get_data_parallel_world_size(),
                         expert=parallel_state.get_expert_model_parallel_world_size())


def _shard_group():
    """The group of ranks that together hold one copy of every shard: megatron's model-parallel group (tensor x
    pipeline), with expert parallelism its expert-tensor-model-pipeline group (which spans the expert-parallel
    ranks as well; with experts split over tensor ranks as the dense layers are, its tensor ranks are theirs)."""
    from megatron.core import parallel_state

    if parallel_state.get_expert_model_parallel_world_size() > 1:
        return parallel_state.get_expert_tensor_model_pipeline_parallel_group()
    return parallel_state.get_model_parallel_group()


def is_expert_param(name: str) -> bool:
    """Whether megatron weight `name` belongs to an expert (held by its expert-parallel rank alone)."""
    return _EXPERT.match(name) is not None


def _expert_slice(name: str, spec: ModelSpec, ep_rank: int, ep_size: int, to_local: bool) -> str | None:
    """An expert weight's name on expert-parallel rank `ep_rank` (`to_local`: from the global expert number to the
    rank's local one, None when another rank holds it; else back); any other name unchanged."""
    match = _EXPERT.match(name)
    if match is None or ep_size == 1:
        return name
    per_rank = spec.num_experts // ep_size
    index = int(match.group(2))
    if to_local:
        if index // per_rank != ep_rank:
            return None
        index -= ep_rank * per_rank
    else:
        index += ep_rank * per_rank
    return f"{match.group(1)}{index}{match.group(3)}"


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
                pp_size: int, ep_rank: int = 0, ep_size: int = 1) -> dict[str, torch.Tensor]:
    """One rank's shard of a full megatron state dict (weight_convert names, no `_extra_state`)."""
    # data=ep_size: the fewest data-parallel ranks that hold ep_size expert ranks (data does not shape a shard).
    ParallelSizes(tensor=tp_size, pipeline=pp_size, data=ep_size, expert=ep_size).check_fits(spec)
    per_stage = spec.num_layers // pp_size
    first, last = pp_rank == 0, pp_rank == pp_size - 1
    out: dict[str, torch.Tensor] = {}
    for name, tensor in full.items():
        match = _LAYER.match(name)
        if match:
            index = int(match.group(1)) - pp_rank * per_stage
            if not 0 <= index < per_stage:
                continue
            local = _expert_slice(f"decoder.layers.{index}.{match.group(2)}", spec, ep_rank, ep_size, to_local=True)
            if local is None:  # another expert-parallel rank's expert
                continue
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


def unshard_state(shards: Mapping[tuple[int, ...], Mapping[str, torch.Tensor]], spec: ModelSpec, tp_size: int,
                  pp_size: int, ep_size: int = 1) -> dict[str, torch.Tensor]:
    """The full megatron state dict from every rank's shard, keyed by (tp_rank, pp_rank, ep_rank) (or by
    (tp_rank, pp_rank) without expert parallelism). Dense weights come from expert rank 0's shards."""
    shards = {key if len(key) == 3 else (*key, 0): shard for key, shard in shards.items()}
    per_stage = spec.num_layers // pp_size
    out: dict[str, torch.Tensor] = {}
    for pp_rank in range(pp_size):
        for ep_rank in range(ep_size):
            stage = [shards[(t, pp_rank, ep_rank)] for t in range(tp_size)]
            for local in stage[0]:
                if local.endswith("._extra_state") or (ep_rank > 0 and not is_expert_param(local)):
                    continue
                match = _LAYER.match(local)
                name = (f"decoder.layers.{int(match.group(1)) + pp_rank * per_stage}.{match.group(2)}" if match
                        else local)
                name = _expert_slice(name, spec, ep_rank, ep_size, to_local=False)
                if spec.tie_word_embeddings and name == "output_layer.weight":
                    continue  # the last stage's copy of the embedding; the first stage's is the one exported
                out[name] = _tp_join(name, [s[local] for s in stage])
    return out


def gather_state(local: Mapping[str, torch.Tensor], spec: ModelSpec) -> dict[str, torch.Tensor]:
    """Collective over the ranks that hold one copy of every shard (`_shard_group`): every rank passes its shard and
    gets the full state dict (CPU).

    It moves the whole model to every rank, fine for tests and small models; publishing weights from a large
    sharded trainer gathers per bucket instead (`gather_buckets`)."""
    import torch.distributed as dist

    sizes = current_sizes()
    # On the host: all_gather_object pickles them, and a device tensor would unpickle onto the sender's device index.
    mine = {k: v.detach().cpu() for k, v in local.items() if not k.endswith("._extra_state")}
    if sizes.tensor == sizes.pipeline == sizes.expert == 1:
        return unshard_state({(0, 0, 0): mine}, spec, 1, 1)
    group = _shard_group()
    entries: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(entries, (shard_rank(), mine), group=group)
    return unshard_state(dict(entries), spec, sizes.tensor, sizes.pipeline, sizes.expert)


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


def _local_name(name: str, spec: ModelSpec, pp_rank: int, pp_size: int, ep_rank: int = 0,
                ep_size: int = 1) -> str | None:
    """What a rank at pipeline rank `pp_rank` and expert rank `ep_rank` calls full megatron weight `name` when it is
    the one to send it for publishing, else None: its stage holds it and, for a dense weight, it is expert rank 0
    (the other expert ranks hold copies)."""
    per_stage = spec.num_layers // pp_size
    if not is_expert_param(name) and ep_rank > 0:
        return None
    match = _LAYER.match(name)
    if match:
        index = int(match.group(1)) - pp_rank * per_stage
        if not 0 <= index < per_stage:
            return None
        return _expert_slice(f"decoder.layers.{index}.{match.group(2)}", spec, ep_rank, ep_size, to_local=True)
    if name == "embedding.word_embeddings.weight":
        return name if pp_rank == 0 else None  # a tied last stage's copy is not published: the first stage's is
    return name if pp_rank == pp_size - 1 else None


def gather_buckets(local: Mapping[str, torch.Tensor], spec: ModelSpec, bucket_bytes: int):
    """Collective generator over the ranks that hold one copy of every shard (`_shard_group`): every rank iterates
    it in step, passing its shard; the group's first rank among the first replicas (`is_first_replica`) gets each
    bucket's full megatron tensors (CPU), every other rank an empty dict per bucket. One bucket (`bucket_plan`) is
    gathered at a time, so no rank ever holds more of the model than its own shard plus one bucket: a publisher
    converts and sends each bucket, then drops it.

    How: once per iteration every rank tells the others which names it sends in which shard shape (one small object
    gather); then, per bucket, each rank that holds part of it sends its pieces as one flat tensor to the publisher,
    which receives exactly the bucket's bytes (point to point: gloo or NCCL, the tensors on the shard's device). A
    dense weight comes from expert rank 0 only; each expert from the expert rank that holds it."""
    import math

    import torch.distributed as dist

    sizes = current_sizes()
    plan = bucket_plan(spec, bucket_bytes)
    tp_rank, pp_rank, ep_rank = shard_rank()
    single = sizes.tensor == sizes.pipeline == sizes.expert == 1
    group = None if single else _shard_group()
    first = is_first_replica()
    publisher = first and (single or dist.get_rank() == dist.get_global_rank(group, 0))
    held: dict[str, torch.Tensor] = {}
    for name in (n for bucket in plan for n in bucket):
        local_name = _local_name(name, spec, pp_rank, sizes.pipeline, ep_rank, sizes.expert)
        if local_name is not None:
            held[name] = local[local_name].detach()
    layout: list = []
    if not single and first:  # another replica's group holds the same weights: nothing to gather there
        layout = [None] * dist.get_world_size(group)
        dist.all_gather_object(layout, (tp_rank, {n: tuple(t.shape) for n, t in held.items()}), group=group)
    for bucket in plan:
        if single:
            yield {name: host_copy(held[name]) for name in bucket} if first else {}
            continue
        if not first:
            yield {}
            continue
        mine = [held[name].reshape(-1) for name in bucket if name in held]
        if not publisher:
            if mine:
                dist.send(torch.cat(mine).contiguous(), dst=dist.get_global_rank(group, 0), group=group)
            yield {}
            continue
        pieces: dict[str, dict[int, torch.Tensor]] = {}  # name -> tensor rank -> piece
        for member, (member_tp, shapes) in enumerate(layout):
            names = [name for name in bucket if name in shapes]
            if not names:
                continue
            if member == 0:
                data = torch.cat(mine)
            else:
                data = torch.empty(sum(math.prod(shapes[n]) for n in names), dtype=mine[0].dtype if mine else
                                   torch.float32, device=next(iter(held.values())).device)
                dist.recv(data, src=dist.get_global_rank(group, member), group=group)
            data, offset = data.cpu(), 0
            for name in names:
                numel = math.prod(shapes[name])
                pieces.setdefault(name, {})[member_tp] = data[offset : offset + numel].view(shapes[name])
                offset += numel
        yield {name: _tp_join(name, [pieces[name][t] for t in range(sizes.tensor)]) for name in bucket}
