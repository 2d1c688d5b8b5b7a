"""A cell's side of the weights: find the newest version at the broker and pull it cleanly from the core.

Weights never travel on the bus. The core registers its live flat parameter buffer (the trainer's own, no copy)
and an int64 *fence* beside it with its transfer agent, and tells the broker once where both are (`WeightSource`,
with the buffer's layout; `source_from_layout` builds it). A cell that wants the weights asks the broker for the
newest source (`WeightsQuery`) and pulls with `pull_weights`; `WeightPuller` does both and retries what can be
retried. A cell without a trainer turns the flat buffer into a Hugging Face state dict for its engine with
`flat_to_hf`.

Why a fence instead of a copy per version: the core's parameters change only inside an optimizer step, so a pull
that starts and ends while the fence shows the version it wants read a clean buffer. The core writes -1 into
the fence before the step and the new version after it; a puller reads the fence, the buffer, then the fence again,
and retries (with the newest source) when either read differs from its version. Versions only grow, so the same
value twice means no step ran in between. Readers never block the core, and the core keeps no extra copy. (Relies
on the core's stores becoming visible in program order, true on x86; a weakly ordered CPU needs a fence
instruction around the -1 store.)
"""

from __future__ import annotations

import asyncio
import math
from typing import Any, Awaitable, Callable, Sequence

import torch

from gyre.actors.errors import ActorError
from gyre.engines.model_format import ModelSpec
from gyre.engines.trainer_group import TrainerGroupCommandError
from gyre.engines.transfer import TransferError
from gyre.engines.weight_convert import megatron_to_hf
from gyre.messages.cell_internal import WeightSource
from gyre.runtime import GyreError, UnknownAddress

__all__ = [
    "StaleWeights",
    "WeightLayoutError",
    "WeightPuller",
    "WeightsUnavailable",
    "flat_to_hf",
    "pull_weight_shards",
    "pull_weights",
    "read_fence",
    "source_from_layout",
]

AskSource = Callable[[], Awaitable[WeightSource]]
"""Ask the broker for the newest WeightSource; raises the runtime's ask errors (UnknownAddress: no broker)."""


class StaleWeights(ActorError):
    """The fence shows another version than the one being pulled: a newer one, or -1 while a step writes it.
    The pulled bytes are not a clean copy of `wanted`; ask the broker for the newest source and pull again."""

    def __init__(self, wanted: int, found: int) -> None:
        super().__init__(f"wanted weight version {wanted}, the core's fence shows {found}")
        self.wanted = wanted
        self.found = found


class WeightsUnavailable(ActorError, RuntimeError):
    """No clean pull of the newest weights in the allowed attempts (the broker or the core did not answer)."""


class WeightLayoutError(ActorError, ValueError):
    """A pull target, staging buffer or weight layout that does not fit the flat buffer it describes."""


def source_from_layout(
    cell: str, version: int, peer: str, params: torch.Tensor, fence: torch.Tensor, layout: Sequence[Any],
    shards: Sequence[tuple[str, int, int]] = (), training_layout: tuple[int, int, int, int] = (1, 1, 1, 1),
) -> WeightSource:
    """The WeightSource of a trainer's flat buffer `params` (layout: the trainer's ParamSlot records); a trainer of
    several processes adds every rank's shard (`TrainerGroup.shard_sources`) and its training layout."""
    return WeightSource(
        cell=cell,
        version=version,
        peer=peer,
        addr=int(params.data_ptr()),
        nbytes=params.numel() * params.element_size(),
        fence_addr=int(fence.data_ptr()),
        param_names=tuple(slot.name for slot in layout),
        param_shapes=tuple(tuple(int(d) for d in slot.shape) for slot in layout),
        param_offsets=tuple(int(slot.offset) for slot in layout),
        shards=tuple((str(peer_), int(addr), int(nbytes)) for peer_, addr, nbytes in shards),
        layout=tuple(int(size) for size in training_layout),
    )


def read_fence(agent: Any, source: WeightSource, scratch: torch.Tensor) -> int:
    """The core's fence value, read into `scratch` (a registered int64 tensor of one element). Blocking."""
    agent.pull_tensor(source.peer, source.fence_addr, scratch)
    return int(scratch[0])


def pull_weights(agent: Any, source: WeightSource, into: torch.Tensor, scratch: torch.Tensor) -> int:
    """Copy the core's flat parameters of `source.version` into `into` (registered with `agent`, same size).

    Blocking (call it off the event loop). Raises StaleWeights when the fence shows another version before or
    after the copy (the bytes in `into` are then not that version), TransferError when Mooncake fails,
    WeightLayoutError when `into` is not the source's size.
    """
    tensor, pipeline, _, expert = source.layout
    if len(source.shards) > 1 and (tensor, pipeline, expert) != (1, 1, 1):
        # Data parallel alone keeps a whole replica on every rank: rank 0's buffer (the one above) is the model.
        # Expert parallelism takes its ranks out of the data-parallel ones, so then rank 0 holds only its experts.
        raise WeightLayoutError(
            f"the core's weights are sharded over {len(source.shards)} ranks ({_layout_name(source.layout)}): a "
            "one-process trainer or staging buffer cannot pull them whole (the cells of a step share one training "
            "layout: a satellite of the core's layout pulls each shard, pull_weight_shards)")
    nbytes = into.numel() * into.element_size()
    if nbytes != source.nbytes:
        raise WeightLayoutError(f"pull target holds {nbytes} bytes, the weight source {source.nbytes}")
    found = read_fence(agent, source, scratch)
    if found != source.version:
        raise StaleWeights(source.version, found)
    moved = agent.pull_tensor(source.peer, source.addr, into)
    found = read_fence(agent, source, scratch)
    if found != source.version:
        raise StaleWeights(source.version, found)
    return moved


def _layout_name(layout: Sequence[int]) -> str:
    return "tp{}.pp{}.dp{}.ep{}".format(*layout)


def pull_weight_shards(agent: Any, source: WeightSource, trainer: Any, layout: tuple[int, int, int, int],
                       lane_numels: Sequence[int], scratch: torch.Tensor) -> int:
    """A trainer of several processes (`trainer`: a TrainerGroup) pulls the core's weights of `source.version`, every
    rank its own shard from the core's rank of the same place (`TrainerGroup.pull_shards`, all ranks at once), between
    two reads of the core's fence as `pull_weights` does. Blocking. Raises WeightLayoutError when the core trains
    another layout or its shards have other sizes, StaleWeights, TransferError (also for a worker rank whose pull
    failed, so that WeightPuller retries it as it retries rank 0's)."""
    if tuple(source.layout) != tuple(layout) or len(source.shards) != len(lane_numels):
        raise WeightLayoutError(
            f"the core trains {_layout_name(source.layout)} ({len(source.shards) or 1} shards), this trainer "
            f"{_layout_name(layout)}: the cells of a step share one training layout")
    for rank, ((_, _, nbytes), numel) in enumerate(zip(source.shards, lane_numels)):
        if nbytes != numel * 4:
            raise WeightLayoutError(f"the core's shard {rank} holds {nbytes} bytes, this trainer's {numel * 4} "
                                    "(another model)")
    found = read_fence(agent, source, scratch)
    if found != source.version:
        raise StaleWeights(source.version, found)
    try:
        moved = trainer.pull_shards(agent, source.shards)
    except TrainerGroupCommandError as error:  # a worker's Mooncake pull failed; the group is still in step
        raise TransferError(f"a rank's shard pull failed: {error}") from error
    found = read_fence(agent, source, scratch)
    if found != source.version:
        raise StaleWeights(source.version, found)
    return moved


def flat_to_hf(flat: torch.Tensor, source: WeightSource, spec: ModelSpec) -> dict[str, torch.Tensor]:
    """Hugging Face named tensors (copies) from a flat buffer laid out as `source` says."""
    megatron: dict[str, torch.Tensor] = {}
    for name, shape, offset in zip(source.param_names, source.param_shapes, source.param_offsets):
        count = math.prod(shape)
        if offset < 0 or offset + count > flat.numel():
            raise WeightLayoutError(
                f"parameter {name} at {offset}+{count} lies outside the flat buffer ({flat.numel()})")
        megatron[name] = flat[offset : offset + count].view(shape)
    return megatron_to_hf(megatron, spec)


class WeightPuller:
    """Find the newest weights and pull them cleanly, retrying what can be retried (a torn or stale read, a step in
    progress, a broker or core that does not answer now), at most `attempts` times, `retry_s` apart.

    Takes how to ask the broker (`ask_source`) rather than an actor, so it holds no state of the cell it serves:
    the caller decides what a pulled version means for it."""

    def __init__(self, ask_source: AskSource, who: str, attempts: int, retry_s: float, log: Any) -> None:
        self.ask_source = ask_source
        self.who = who
        """Name of the pulling cell (for the error that ends its attempts)."""
        self.attempts = attempts
        self.retry_s = retry_s
        self.log = log

    async def pull(
        self, held: Callable[[], int], pull_into: Callable[[WeightSource], Awaitable[Any]]
    ) -> WeightSource | None:
        """If the broker knows a newer version than `held()` (-1, holding none, counts as the model directory's
        version 0), pull it with `pull_into(source)` (which raises StaleWeights or TransferError when the copy is
        not clean) and return its source. None when there is nothing newer, or no broker in the topology (everyone
        keeps the model directory's weights). WeightsUnavailable after `attempts` failed tries."""
        for _ in range(self.attempts):
            try:
                source = await self.ask_source()
            except UnknownAddress:
                return None
            except GyreError as error:
                self.log.warning("broker_unavailable", error=str(error))
                source = None
            if source is not None:
                if source.version <= max(held(), 0):
                    return None
                try:
                    await pull_into(source)
                    return source
                except StaleWeights as stale:
                    self.log.debug("weights_stale_retry", wanted=stale.wanted, found=stale.found)
                except TransferError as error:  # the core is gone or restarting: maybe it is back soon
                    self.log.warning("weights_pull_failed_retry", version=source.version, error=str(error))
            await asyncio.sleep(self.retry_s)
        raise WeightsUnavailable(f"{self.who}: no clean weight pull in {self.attempts} attempts")
