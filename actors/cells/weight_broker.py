"""The weight broker: weight versions, and how a cell pulls the core's weights through Mooncake.

Weights never travel on the bus. The core registers its live flat parameter buffer (the trainer's own, no copy)
and an int64 *fence* beside it with its transfer agent, and tells the broker once where both are
(`WeightSource`, with the buffer's layout). After every optimizer step the core publishes `StepApplied`; the
broker turns it into `WeightsPublished(version, peer, addr, nbytes)` for everyone (a skipped step, whose weights did
not change, publishes nothing). A cell that wants the weights
asks the broker for the newest source (`WeightsQuery`) and pulls with `pull_weights` (`WeightPuller` does both and
retries what can be retried); cells then tell the broker `WeightsLoaded`, and the broker keeps who holds which
version (`WeightsStatusQuery`).

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
from collections import OrderedDict
from typing import Any, Awaitable, Callable, Sequence

import attrs
import torch

from gyre.engines.model_format import ModelSpec
from gyre.engines.transfer import TransferError
from gyre.engines.weight_convert import megatron_to_hf
from gyre.messages.cell_internal import WeightSource, WeightsQuery, WeightsStatus, WeightsStatusQuery
from gyre.messages.training import StepApplied, WeightsLoaded, WeightsPublished
from gyre.runtime import Actor, GyreError, UnknownAddress, handler

__all__ = [
    "NO_SOURCE",
    "StaleWeights",
    "WeightBroker",
    "WeightBrokerConfig",
    "WeightPuller",
    "WeightsUnavailable",
    "flat_to_hf",
    "pull_weights",
    "read_fence",
    "source_from_layout",
]

#: The broker's answer before the core registered: nothing to pull, every cell holds the model directory's weights.
NO_SOURCE = WeightSource("", -1, "", 0, 0, 0, (), (), ())


class StaleWeights(Exception):
    """The fence shows another version than the one being pulled: a newer one, or -1 while a step writes it.
    The pulled bytes are not a clean copy of `wanted`; ask the broker for the newest source and pull again."""

    def __init__(self, wanted: int, found: int) -> None:
        super().__init__(f"wanted weight version {wanted}, the core's fence shows {found}")
        self.wanted = wanted
        self.found = found


def source_from_layout(
    cell: str, version: int, peer: str, params: torch.Tensor, fence: torch.Tensor, layout: Sequence[Any]
) -> WeightSource:
    """The WeightSource of a trainer's flat buffer `params` (layout: the trainer's ParamSlot records)."""
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
    )


def read_fence(agent: Any, source: WeightSource, scratch: torch.Tensor) -> int:
    """The core's fence value, read into `scratch` (a registered int64 tensor of one element). Blocking."""
    agent.pull_tensor(source.peer, source.fence_addr, scratch)
    return int(scratch[0])


def pull_weights(agent: Any, source: WeightSource, into: torch.Tensor, scratch: torch.Tensor) -> int:
    """Copy the core's flat parameters of `source.version` into `into` (registered with `agent`, same size).

    Blocking (call it off the event loop). Raises StaleWeights when the fence shows another version before or
    after the copy (the bytes in `into` are then not that version), TransferError when Mooncake fails.
    """
    nbytes = into.numel() * into.element_size()
    if nbytes != source.nbytes:
        raise ValueError(f"pull target holds {nbytes} bytes, the weight source {source.nbytes}")
    found = read_fence(agent, source, scratch)
    if found != source.version:
        raise StaleWeights(source.version, found)
    moved = agent.pull_tensor(source.peer, source.addr, into)
    found = read_fence(agent, source, scratch)
    if found != source.version:
        raise StaleWeights(source.version, found)
    return moved


class WeightsUnavailable(RuntimeError):
    """No clean pull of the newest weights in the allowed attempts (the broker or the core did not answer)."""


class WeightPuller:
    """A cell's side of the broker: find the newest weights and pull them cleanly, retrying what can be retried
    (a torn or stale read, a step in progress, a broker or core that does not answer now), boundedly."""

    def __init__(self, actor: Actor, broker: str, timeout_s: float, attempts: int, retry_s: float) -> None:
        self.actor = actor
        self.broker = broker
        self.timeout_s = timeout_s
        self.attempts = attempts
        self.retry_s = retry_s

    async def pull(
        self, held: Callable[[], int], pull_into: Callable[[WeightSource], Awaitable[Any]]
    ) -> WeightSource | None:
        """If the broker knows a newer version than `held()` (-1, holding none, counts as the model directory's
        version 0), pull it with `pull_into(source)` (which raises StaleWeights or TransferError when the copy is
        not clean) and return its source. None when there is nothing newer, or no broker in the topology (everyone
        keeps the model directory's weights). WeightsUnavailable after `attempts` failed tries."""
        log = self.actor.log
        for _ in range(self.attempts):
            try:
                source = await self.actor.ask(self.broker, WeightsQuery(self.actor.name), timeout_s=self.timeout_s)
            except UnknownAddress:
                return None
            except GyreError as error:
                log.warning("broker_unavailable", error=str(error))
                source = None
            if source is not None:
                if source.version <= max(held(), 0):
                    return None
                try:
                    await pull_into(source)
                    return source
                except StaleWeights as stale:
                    log.debug("weights_stale_retry", wanted=stale.wanted, found=stale.found)
                except TransferError as error:  # the core is gone or restarting: maybe it is back soon
                    log.warning("weights_pull_failed_retry", version=source.version, error=str(error))
            await asyncio.sleep(self.retry_s)
        raise WeightsUnavailable(f"{self.actor.name}: no clean weight pull in {self.attempts} attempts")


def flat_to_hf(flat: torch.Tensor, source: WeightSource, spec: ModelSpec) -> dict[str, torch.Tensor]:
    """Hugging Face named tensors (copies) from a flat buffer laid out as `source` says."""
    megatron: dict[str, torch.Tensor] = {}
    for name, shape, offset in zip(source.param_names, source.param_shapes, source.param_offsets):
        count = math.prod(shape)
        if offset < 0 or offset + count > flat.numel():
            raise ValueError(f"parameter {name} at {offset}+{count} lies outside the flat buffer ({flat.numel()})")
        megatron[name] = flat[offset : offset + count].view(shape)
    return megatron_to_hf(megatron, spec)


@attrs.frozen
class WeightBrokerConfig:
    """Bounds of the broker's bookkeeping."""

    max_cells: int = 4096
    """Cells whose loaded version is tracked at most; the least recently reporting one is forgotten beyond it."""


class WeightBroker(Actor):
    """Versions the core's weights and tells everyone where to pull them; see the module docstring."""

    config_cls = WeightBrokerConfig
    subscriptions = (StepApplied,)

    async def on_start(self) -> None:
        self.source: WeightSource = NO_SOURCE
        self.published = 0
        self.loads = 0
        self.cell_versions: OrderedDict[str, int] = OrderedDict()
        self.last_load_s: dict[str, float] = {}

    def _publish(self) -> None:
        source = self.source
        self.publish(WeightsPublished(source.version, source.peer, source.addr, source.nbytes))
        self.published += 1
        self.log.info("weights_published", version=source.version, nbytes=source.nbytes, peer=source.peer)

    @handler(WeightSource)
    def on_source(self, msg: WeightSource) -> None:
        shapes_fit = len(msg.param_names) == len(msg.param_shapes) == len(msg.param_offsets)
        if not msg.cell or msg.version < 0 or msg.nbytes <= 0 or not msg.peer or not shapes_fit:
            self.log.error("weight_source_refused", cell=msg.cell, version=msg.version, nbytes=msg.nbytes)
            return
        if self.source.cell and self.source.cell != msg.cell:
            self.log.warning("weight_source_replaced", old=self.source.cell, new=msg.cell)
        self.source = msg
        self._publish()

    @handler(StepApplied)
    def on_step_applied(self, msg: StepApplied) -> None:
        if msg.skipped:  # the weights did not change: nothing new to pull (see actors/cells/train_role.py)
            self.log.info("step_skipped_weights_unchanged", step_id=msg.step_id, version=msg.version)
            return
        if not self.source.cell:
            self.log.error("step_applied_without_source", step_id=msg.step_id, version=msg.version)
            return
        if msg.version <= self.source.version:
            self.log.warning("step_applied_not_newer", version=msg.version, current=self.source.version)
            return
        self.source = attrs.evolve(self.source, version=msg.version)
        self._publish()

    @handler(WeightsQuery)
    def on_query(self, msg: WeightsQuery) -> WeightSource:
        return self.source

    @handler(WeightsLoaded)
    def on_loaded(self, msg: WeightsLoaded) -> None:
        self.loads += 1
        self.cell_versions[msg.cell] = msg.version
        self.cell_versions.move_to_end(msg.cell)
        self.last_load_s[msg.cell] = msg.seconds
        while len(self.cell_versions) > self.config.max_cells:
            forgotten, _ = self.cell_versions.popitem(last=False)
            self.last_load_s.pop(forgotten, None)
        behind = self.source.version - msg.version
        self.log.info("weights_loaded", cell=msg.cell, version=msg.version, seconds=round(msg.seconds, 4),
                      behind=behind)

    @handler(WeightsStatusQuery)
    def on_status(self, msg: WeightsStatusQuery) -> WeightsStatus:
        return self.statistics()

    def statistics(self) -> WeightsStatus:
        return WeightsStatus(
            version=self.source.version,
            published=self.published,
            cell_versions=dict(self.cell_versions),
            last_load_s=dict(self.last_load_s),
            loads=self.loads,
        )

