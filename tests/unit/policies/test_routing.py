"""Routing policy contract: valid policies pass on any view of cells; invalid ones fail loudly.

`checked_choice` is what the proxy calls, so a contract test here is what stands between a policy bug and calls
landing on a cell that is about to stop serving.
"""

from __future__ import annotations

from typing import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gyre.messages.cells import ROLLOUT, SWITCHING, TRAIN
from gyre.policies.errors import RoutingContractError
from gyre.policies.routing import (
    CellView,
    RoutingPolicy,
    StickyLeastLoaded,
    checked_choice,
)


class FirstEligible:
    """A valid alternative: ignores prefixes and load, takes the first eligible cell by name."""

    def choose(self, session: str, holder: str | None, cells: Sequence[CellView]) -> str | None:
        eligible = sorted(c.name for c in cells if c.accepts_new_calls)
        return eligible[0] if eligible else None


class AlwaysHolder:
    """Invalid: stays with the holder even when it drains or leaves rollout."""

    def choose(self, session: str, holder: str | None, cells: Sequence[CellView]) -> str | None:
        return holder if holder is not None else FirstEligible().choose(session, holder, cells)


class IgnoresDraining:
    """Invalid: least loaded among rollout cells, draining ones included."""

    def choose(self, session: str, holder: str | None, cells: Sequence[CellView]) -> str | None:
        rollout = [c for c in cells if c.role == ROLLOUT and c.engine_url]
        return min(rollout, key=lambda c: (c.sessions, c.name)).name if rollout else None


class GivesUp:
    """Invalid: never routes."""

    def choose(self, session: str, holder: str | None, cells: Sequence[CellView]) -> str | None:
        return None


class InventsCells:
    """Invalid: names a cell it was not shown."""

    def choose(self, session: str, holder: str | None, cells: Sequence[CellView]) -> str | None:
        return "cell-that-does-not-exist"


class AnyRole:
    """Invalid: routes to the first cell whatever its role."""

    def choose(self, session: str, holder: str | None, cells: Sequence[CellView]) -> str | None:
        return cells[0].name if cells else None


def cell(name: str, role: str = ROLLOUT, draining: bool = False, url: str = "http://x", **load: int) -> CellView:
    return CellView(name=name, role=role, draining=draining, engine_url=url, **load)


cell_views = st.builds(
    CellView,
    name=st.sampled_from(["a", "b", "c", "d", "e"]),
    role=st.sampled_from([ROLLOUT, ROLLOUT, TRAIN, SWITCHING]),
    draining=st.booleans(),
    engine_url=st.sampled_from(["http://127.0.0.1:1", "http://127.0.0.1:2", ""]),
    sessions=st.integers(0, 50),
    in_flight=st.integers(0, 20),
    queued_requests=st.integers(0, 20),
    capacity_requests=st.integers(0, 64),
    free_kv_blocks=st.integers(0, 100),
    total_kv_blocks=st.integers(0, 100),
).filter(lambda c: c.free_kv_blocks <= c.total_kv_blocks)
views = st.lists(cell_views, max_size=5, unique_by=lambda c: c.name)
holders = st.one_of(st.none(), st.sampled_from(["a", "b", "c", "d", "e", "gone"]))


@pytest.mark.parametrize("policy", [StickyLeastLoaded(), FirstEligible()], ids=lambda p: type(p).__name__)
@settings(max_examples=100, deadline=None)
@given(cells=views, holder=holders)
def test_valid_policies_keep_the_contract(policy: RoutingPolicy, cells: list[CellView], holder: str | None) -> None:
    choice = checked_choice(policy, "exec-1/main", holder, cells)
    eligible = {c.name for c in cells if c.accepts_new_calls}
    assert (choice is None) == (not eligible)
    assert choice is None or choice in eligible


@pytest.mark.parametrize(
    "policy, cells, holder, complaint",
    [
        (AlwaysHolder(), [cell("a", draining=True), cell("b")], "a", "draining"),
        (AlwaysHolder(), [cell("a", role=TRAIN), cell("b")], "a", "'train' role"),
        (IgnoresDraining(), [cell("a", draining=True), cell("b", sessions=3)], None, "draining"),
        (GivesUp(), [cell("a")], None, "returned None"),
        (InventsCells(), [cell("a")], None, "not a known cell"),
        (AnyRole(), [cell("a", url="")], None, "no engine URL"),
        (AnyRole(), [cell("a", role=SWITCHING), cell("b")], None, "'switching' role"),
    ],
)
def test_invalid_policies_fail_loudly(policy, cells, holder, complaint) -> None:
    with pytest.raises(RoutingContractError, match=complaint):
        checked_choice(policy, "exec-1/main", holder, cells)


def test_a_policy_returning_garbage_fails_loudly() -> None:
    class ReturnsIndex:
        def choose(self, session, holder, cells):
            return 0

    with pytest.raises(RoutingContractError, match="not a cell name"):
        checked_choice(ReturnsIndex(), "s", None, [cell("a")])


def test_sticky_keeps_a_session_on_the_cell_that_holds_its_prefix() -> None:
    policy = StickyLeastLoaded()
    cells = [cell("a", sessions=40, in_flight=9, capacity_requests=8), cell("b", capacity_requests=8)]
    assert policy.choose("s", "a", cells) == "a"  # busier, but it holds the prefix


def test_new_sessions_go_to_the_least_loaded_rollout_cell() -> None:
    policy = StickyLeastLoaded()
    cells = [
        cell("a", sessions=4, capacity_requests=8),
        cell("b", sessions=5, capacity_requests=16),  # more sessions, but fewer per unit of capacity
        cell("c", role=TRAIN),
        cell("d", draining=True),
    ]
    assert policy.choose("s", None, cells) == "b"
    # Same sessions per capacity: fewer generations in flight wins, then the name.
    tie = [cell("a", sessions=2, in_flight=3), cell("b", sessions=2, in_flight=1), cell("c", sessions=2, in_flight=1)]
    assert policy.choose("s", None, tie) == "b"


def test_a_displaced_session_moves_to_the_least_loaded_cell() -> None:
    policy = StickyLeastLoaded()
    cells = [cell("a", draining=True), cell("b", sessions=2), cell("c", sessions=1)]
    assert policy.choose("s", "a", cells) == "c"
    cells = [cell("a", role=TRAIN), cell("b", sessions=2), cell("c", sessions=1)]
    assert policy.choose("s", "a", cells) == "c"
    assert policy.choose("s", "gone", cells) == "c"


def test_no_cell_accepts_calls() -> None:
    policy = StickyLeastLoaded()
    assert checked_choice(policy, "s", "a", [cell("a", draining=True), cell("b", role=TRAIN)]) is None
    assert checked_choice(policy, "s", None, []) is None


@settings(max_examples=60, deadline=None)
@given(cells=views)
def test_sticky_least_loaded_spreads_new_sessions_evenly(cells: list[CellView]) -> None:
    """Placing sessions one by one on equal cells never lets two cells differ by more than one session."""
    policy = StickyLeastLoaded()
    current = [
        CellView(name=c.name, role=c.role, draining=c.draining, engine_url=c.engine_url, capacity_requests=8)
        for c in cells
    ]
    for index in range(12):
        choice = checked_choice(policy, f"s{index}", None, current)
        if choice is None:
            return
        current = [
            CellView(
                name=c.name,
                role=c.role,
                draining=c.draining,
                engine_url=c.engine_url,
                capacity_requests=8,
                sessions=c.sessions + (c.name == choice),
            )
            for c in current
        ]
    counts = [c.sessions for c in current if c.accepts_new_calls]
    assert max(counts) - min(counts) <= 1
    assert all(c.sessions == 0 for c in current if not c.accepts_new_calls)
