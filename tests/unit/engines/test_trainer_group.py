"""ServedParams (engines/trainer_group.py): how one trainer rank's weights are served to peers through a transfer
agent, in place or from a host copy, the same mechanism for a cell's rank 0 and a trainer group's other ranks. The
group's use of it, every rank at once, is tested in tests/integration/engines/test_trainer_group.py."""

from __future__ import annotations

import pytest
import torch

from gyre.engines.trainer_group import ServedParams
from gyre.engines.transfer import TransferAgent


class CannotRegisterLargeBuffers(TransferAgent):
    """A real agent that says it cannot register anything larger than a fence: what a Mooncake build without CUDA
    says of device parameters (this machine has no GPU, so host memory stands in for them)."""

    def can_register(self, buffer) -> bool:
        return buffer.numel() <= 1


def test_parameters_are_served_in_place_or_from_a_host_copy_that_each_refresh_brings_up_to_date():
    with TransferAgent() as agent, CannotRegisterLargeBuffers() as cannot, TransferAgent() as reader:
        into = torch.zeros(1000)
        reader.register_tensor(into)

        def pull(served: ServedParams) -> torch.Tensor:
            peer, addr, nbytes = served.source()
            assert nbytes == into.numel() * 4
            reader.pull_tensor(peer, addr, into)
            return into.clone()

        params = torch.arange(1000, dtype=torch.float32)
        assert ServedParams.choose(params, agent, serve=True) == ServedParams.choose(params, agent, False) == "live"
        live = ServedParams(params, agent, "live", version=0)
        assert live.buffer is params and live.source() == (agent.peer, params.data_ptr(), 4000)
        params.mul_(2)  # in place: a peer reads the live weights, nothing to refresh
        assert torch.equal(pull(live), params) and not live.stale(5)
        live.close()
        assert agent.statistics().registered_bytes == 0

        # Device weights on a build without CUDA: a core serves a host copy, a satellite registers nothing.
        assert ServedParams.choose(params, cannot, serve=True) == "copy"
        assert ServedParams.choose(params, cannot, serve=False) == "none"
        copy = ServedParams(params, cannot, "copy", version=3)
        assert copy.buffer is not params and copy.buffer.data_ptr() != params.data_ptr()
        assert copy.source() == (cannot.peer, copy.buffer.data_ptr(), 4000)
        assert cannot.statistics().registered_bytes == 4000  # the copy, not the parameters
        before = params.clone()
        params.add_(1)  # a step: the copy still holds version 3 until its refresh
        assert torch.equal(pull(copy), before) and copy.stale(4) and not copy.stale(3)
        copy.refresh(4)
        assert torch.equal(pull(copy), params) and not copy.stale(4) and copy.version == 4
        copy.close()
        copy.close()  # idempotent
        none = ServedParams(params, cannot, "none", version=0)
        assert none.buffer is None and none.source() == (cannot.peer, params.data_ptr(), 4000)
        assert cannot.statistics().registered_bytes == 0 and not none.stale(9)
        none.refresh(9)
        assert none.version == 9
        with pytest.raises(ValueError, match="how must be one of"):
            ServedParams(params, agent, "pinned", version=0)
