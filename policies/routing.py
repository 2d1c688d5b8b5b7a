"""Routing: which rollout cell serves a session's next model call.

A session (one agent of one execution) makes many calls whose prompts extend each other, so the cell that holds its
prefix in its KV cache should keep serving it: anywhere else the whole context is prefilled again. New sessions
spread by load. A cell that is draining (switching to training) or not in the rollout role takes no new calls; its
sessions wait for the KV migrator's placement or move to another cell.

The proxy hands a policy a snapshot of its view (`CellView`s) and the session's current holder, and enforces the
contract with `checked_choice`: a policy that names an ineligible or unknown cell, or gives up while a cell could
serve, is a bug that must fail loudly, not a call that quietly lands on a cell about to stop serving.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import attrs

from gyre.messages.cells import ROLLOUT
from gyre.policies.errors import RoutingContractError

__all__ = ["CellView", "RoutingPolicy", "RoutingContractError", "checked_choice", "StickyLeastLoaded"]


@attrs.frozen
class CellView:
    """What the proxy knows of one cell when it routes a call."""

    name: str
    """Cell name."""
    role: str
    """"rollout", "train" or "switching" (from RoleChanged and LoadReport)."""
    draining: bool
    """Announced CellDraining and has not come back to rollout since."""
    engine_url: str
    """Inference server URL; "" when it has none."""
    sessions: int = 0
    """Sessions the proxy has placed on it."""
    in_flight: int = 0
    """Generations the proxy has running on it now."""
    queued_requests: int = 0
    """Running + waiting generations in the cell's last LoadReport (other clients included)."""
    capacity_requests: int = 0
    """Concurrent generations the cell can run (0: not reported yet)."""
    free_kv_blocks: int = 0
    """Free KV blocks in its last LoadReport."""
    total_kv_blocks: int = 0
    """KV blocks in its pool (0: not reported yet)."""

    @property
    def accepts_new_calls(self) -> bool:
        """A rollout cell with an engine that is not draining."""
        return self.role == ROLLOUT and not self.draining and bool(self.engine_url)


class RoutingPolicy(Protocol):
    """Chooses the cell for a session's next call.

    Contract (enforced by `checked_choice`): return the name of a cell in `cells` that `accepts_new_calls`, or None
    exactly when no cell accepts new calls. `holder` is the cell that holds the session's prefix (None for a new
    session); it may be draining, gone, or in another role. Must not keep references to `cells`.
    """

    def choose(self, session: str, holder: str | None, cells: Sequence[CellView]) -> str | None: ...


def checked_choice(policy: RoutingPolicy, session: str, holder: str | None, cells: Sequence[CellView]) -> str | None:
    """`policy.choose(...)`, with its contract checked; raises RoutingContractError when broken."""
    choice = policy.choose(session, holder, cells)
    eligible = {cell.name for cell in cells if cell.accepts_new_calls}
    if choice is None:
        if eligible:
            raise RoutingContractError(
                f"{type(policy).__name__} returned None for session {session!r} while {sorted(eligible)} accept calls"
            )
        return None
    if not isinstance(choice, str):
        raise RoutingContractError(f"{type(policy).__name__} returned {choice!r}, not a cell name or None")
    if choice not in eligible:
        known = {cell.name: cell for cell in cells}
        why = "is not a known cell" if choice not in known else _why_ineligible(known[choice])
        raise RoutingContractError(f"{type(policy).__name__} routed session {session!r} to {choice!r}, which {why}")
    return choice


def _why_ineligible(cell: CellView) -> str:
    if cell.draining:
        return "is draining"
    if cell.role != ROLLOUT:
        return f"is in the {cell.role!r} role"
    return "has no engine URL"


@attrs.frozen
class StickyLeastLoaded:
    """The default: a session stays on the cell that holds its prefix while that cell accepts calls; a new (or
    displaced) session goes to the eligible cell with the fewest sessions per unit of capacity, then the fewest
    generations in flight per unit of capacity, then the first name (so a tie always breaks the same way).

    Sessions come first because an agent session is long-lived: counting only calls in flight would pile sessions
    onto whichever cell happens to be idle between turns. A cell that has not reported its capacity counts as 1.
    """

    def choose(self, session: str, holder: str | None, cells: Sequence[CellView]) -> str | None:
        eligible = [cell for cell in cells if cell.accepts_new_calls]
        if not eligible:
            return None
        if holder is not None and any(cell.name == holder for cell in eligible):
            return holder
        return min(eligible, key=_load_key).name


def _load_key(cell: CellView) -> tuple[float, float, str]:
    capacity = max(cell.capacity_requests, 1)
    busy = max(cell.in_flight, cell.queued_requests)
    return (cell.sessions / capacity, busy / capacity, cell.name)
