"""Reduction rounds over real gloo process groups, the members on threads of this process (gloo's waits release
the GIL, so one process stands in for several cells as the cells' one-process tests do)."""

from __future__ import annotations

import gc
import threading

import pytest
import torch

from gyre.engines.grad_exchange import (
    GradientExchangeError,
    ReductionBytes,
    ReductionMember,
    RendezvousServer,
    chunk_bounds,
    parameter_server_bytes,
    reduce_to_core,
    ring_bytes,
)

NUMEL = 1001  # not a multiple of 2 or 3: chunks of unequal length


def run_round(server: RendezvousServer, members: list[ReductionMember], buffers: list[torch.Tensor], group_id: int,
              size: int | None = None) -> list:
    """Every member's reduce() on its own thread; each slot gets the ReductionBytes or the exception raised."""
    size = len(members) if size is None else size
    results: list = [None] * len(members)

    def work(rank: int) -> None:
        try:
            results[rank] = members[rank].reduce(server.host, server.port, group_id, rank, size, buffers[rank])
        except Exception as error:  # noqa: BLE001 - the test inspects it
            results[rank] = error

    threads = [threading.Thread(target=work, args=(rank,)) for rank in range(len(members))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not any(thread.is_alive() for thread in threads), "a member never returned"
    return results


@pytest.fixture
def server():
    return RendezvousServer("127.0.0.1", timeout_s=10.0)


def members_for(server: RendezvousServer, size: int, timeout_s: float = 10.0) -> list[ReductionMember]:
    return [ReductionMember(timeout_s=timeout_s, store=server.store)] + [
        ReductionMember(timeout_s=timeout_s) for _ in range(size - 1)]


@pytest.mark.parametrize("size", [2, 3, 4])
def test_the_core_gets_the_satellites_sum_and_no_cell_moves_more_with_more_cells(server, size):
    generator = torch.Generator().manual_seed(size)
    grads = [torch.randn(NUMEL, generator=generator) for _ in range(size - 1)]
    buffers = [torch.full((NUMEL,), float("nan"))] + [g.clone() for g in grads]
    results = run_round(server, members_for(server, size), buffers, group_id=1)
    assert all(isinstance(r, ReductionBytes) for r in results), results
    assert torch.allclose(buffers[0], torch.stack(grads).sum(0), atol=1e-6)
    nbytes = NUMEL * 4
    expected = ring_bytes(nbytes, size - 1)
    assert results[0] == expected["core"] == ReductionBytes(0, nbytes)  # the core receives S, whatever the size
    for satellite in results[1:]:
        assert satellite.sent == nbytes and satellite.received <= expected["satellite"].received < nbytes
    # The parameter server's core received one buffer per satellite.
    assert parameter_server_bytes(nbytes, size - 1)["core"].received == (size - 1) * nbytes


def test_a_group_is_reused_while_the_membership_stays_and_formed_again_for_a_new_one(server):
    members = members_for(server, 3)
    for group_id in (1, 1, 2):
        buffers = [torch.zeros(NUMEL), torch.ones(NUMEL), torch.full((NUMEL,), 2.0)]
        results = run_round(server, members, buffers, group_id)
        assert all(isinstance(r, ReductionBytes) for r in results), results
        assert torch.equal(buffers[0], torch.full((NUMEL,), 3.0))
    assert [m.groups_formed for m in members] == [2, 2, 2]
    assert members[1].last_join_s > 0


def test_lanes_reduce_each_shard_with_the_same_rank_of_the_other_cells(server):
    """Three cells of two ranks each (a shared training layout): lane g sums rank g's shard of every cell, on a group
    of its own, all lanes at once; the core's rank g receives its shard's bytes only. The third cell has no trainer
    any more: one member brings zeros on both lanes, one lane after the other (`join_round_with_zeros`)."""
    numels = (NUMEL, NUMEL // 2)  # two shards of different sizes (a pipeline's stages)
    generator = torch.Generator().manual_seed(5)
    shards = [[torch.randn(n, generator=generator) for n in numels] for _ in range(2)]  # satellites 1 and 2
    cores = [ReductionMember(timeout_s=10.0, store=server.store)] + [ReductionMember(timeout_s=10.0)]
    ranks = [ReductionMember(timeout_s=10.0) for _ in numels]  # satellite 1: one member per rank (process)
    leaver = ReductionMember(timeout_s=10.0)  # satellite 2: gone from training, one process for both lanes
    sums = [torch.full((n,), float("nan")) for n in numels]
    sent = [shard.clone() for shard in shards[0]]
    results: dict = {}

    def work(key, member, rank, buffer, lane) -> None:
        try:
            results[key] = member.reduce(server.host, server.port, 4, rank, 3, buffer, lane)
        except Exception as error:  # noqa: BLE001 - the test inspects it
            results[key] = error

    def zeros() -> None:
        # What join_round_with_zeros does, with the leaver's zeros replaced by its shards: both lanes from one member.
        for lane, shard in enumerate(shards[1]):
            work(("leaver", lane), leaver, 2, shard.clone(), lane)

    threads = [threading.Thread(target=work, args=(("core", g), cores[g], 0, sums[g], g)) for g in range(2)]
    threads += [threading.Thread(target=work, args=(("sat", g), ranks[g], 1, sent[g], g)) for g in range(2)]
    threads.append(threading.Thread(target=zeros))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not any(thread.is_alive() for thread in threads), "a lane never finished"
    assert all(isinstance(r, ReductionBytes) for r in results.values()), results
    for g, n in enumerate(numels):
        assert torch.allclose(sums[g], shards[0][g] + shards[1][g], atol=1e-6)
        assert results[("core", g)] == ReductionBytes(0, 4 * n)  # rank g receives its own shard, once
        assert results[("sat", g)].sent == results[("leaver", g)].sent == 4 * n
    assert sorted(leaver._groups) == [0, 1] and leaver.groups_formed == 2  # one group per lane
    leaver.drop(1)
    assert sorted(leaver._groups) == [0]
    leaver.drop()
    assert not leaver._groups


def test_held_lists_travel_through_the_store_and_are_removed_once_read(server):
    core, satellite = members_for(server, 2)
    satellite.publish_held(server.host, server.port, 7, 1, b'[[0, 3, 12, 0.5]]')
    assert core.read_held(7, 1) == b'[[0, 3, 12, 0.5]]'
    assert not server.store.check(["gyre/grads/round7/held1"])
    with pytest.raises(GradientExchangeError, match="max"):
        satellite.publish_held(server.host, server.port, 8, 1, b"x" * (2 << 20))


def test_a_member_that_never_joins_fails_the_round_within_the_timeout(server):
    members = members_for(server, 3, timeout_s=1.0)[:2]  # rank 2 never comes
    results = run_round(server, members, [torch.zeros(NUMEL), torch.ones(NUMEL)], group_id=1, size=3)
    assert all(isinstance(r, GradientExchangeError) for r in results), results
    assert "did not form" in str(results[0])


def test_a_member_that_goes_away_after_joining_fails_its_peers_not_hangs(server):
    members = members_for(server, 2, timeout_s=5.0)
    groups: list = [None, None]

    def join(rank: int) -> None:
        groups[rank] = members[rank].group(server.host, server.port, 1, rank, 2)

    threads = [threading.Thread(target=join, args=(rank,)) for rank in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    members[1].drop()
    groups[1] = None
    gc.collect()  # the satellite's group and its connections are gone
    with pytest.raises(GradientExchangeError):
        reduce_to_core(groups[0], 0, 2, torch.zeros(NUMEL))


def test_bad_inputs_are_refused():
    with pytest.raises(GradientExchangeError, match="chunks"):
        chunk_bounds(2, 3)
    assert chunk_bounds(7, 3) == [(0, 3), (3, 5), (5, 7)]
    with pytest.raises(GradientExchangeError, match="size 1"):
        reduce_to_core(None, 0, 1, torch.zeros(4))
    with pytest.raises(GradientExchangeError, match="1-D"):
        reduce_to_core(None, 1, 2, torch.zeros(2, 2))
    with pytest.raises(ValueError):
        ring_bytes(400, 0)
