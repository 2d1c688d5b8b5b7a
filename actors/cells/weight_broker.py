"""The weight broker: which weight version is newest, where to pull it, and who holds which.

Weights never travel on the bus. The core tells the broker once where its live flat parameter buffer and its fence
are (`WeightSource`, with the buffer's layout). After every optimizer step the core publishes `StepApplied`; the
broker turns it into `WeightsPublished(version, peer, addr, nbytes)` for everyone (a skipped step, whose weights did
not change, publishes nothing). A cell that wants the weights asks the broker for the newest source
(`WeightsQuery`) and pulls it from the core itself (actors/cells/weight_pull.py, which also explains the fence);
cells then tell the broker `WeightsLoaded`, and the broker keeps who holds which version (its statistics,
`WeightBrokerStatistics`, the answer to `StatisticsAsked`).
"""

from __future__ import annotations

from collections import OrderedDict

import attrs

from gyre.messages.cell_internal import WeightBrokerStatistics, WeightSource, WeightsQuery
from gyre.messages.training import StepApplied, WeightsLoaded, WeightsPublished
from gyre.runtime import Actor, handler
from gyre.runtime.validators import count

__all__ = ["NO_SOURCE", "WeightBroker", "WeightBrokerConfig"]

#: The broker's answer before the core registered: nothing to pull, every cell holds the model directory's weights.
NO_SOURCE = WeightSource("", -1, "", 0, 0, 0, (), (), ())


@attrs.frozen
class WeightBrokerConfig:
    """Bounds of the broker's bookkeeping."""

    max_cells: int = attrs.field(default=4096, validator=count)
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

    def statistics(self) -> WeightBrokerStatistics:
        return WeightBrokerStatistics(
            version=self.source.version,
            published=self.published,
            cell_versions=dict(self.cell_versions),
            last_load_s=dict(self.last_load_s),
            loads=self.loads,
        )

