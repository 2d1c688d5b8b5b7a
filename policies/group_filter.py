"""When a group with dropped executions still trains: the minimum number of surviving executions.

Group-normalised advantages compare each execution with its group's mean. Executions whose scorer crashed or hung
are dropped (never a reward of 0), so a group can end with fewer rewards than it started with; with too few left,
the baseline is noise (a group of one has no baseline at all) and the group is better dropped whole. The trajectory
builder asks its `GroupFilter` how many survivors a group of a given size needs.

Policies are frozen attrs classes, so that they travel inside an actor's config (and so into the event log).
`survivors_needed` is how callers use one: it checks the answer, so that a broken policy fails loudly.
"""

from __future__ import annotations

import math
from typing import Protocol, runtime_checkable

import attrs

from gyre.policies.errors import GroupFilterError

__all__ = ["GroupFilter", "GroupFilterError", "FractionOfGroup", "AtLeast", "survivors_needed"]


@runtime_checkable
class GroupFilter(Protocol):
    """Contract (tests/unit/test_group_filter.py): for every group_size >= 1, `min_survivors` returns an int in
    1..group_size, the same for the same size."""

    def min_survivors(self, group_size: int) -> int:
        """Scored executions (with a usable token tree) a group of `group_size` needs to land its samples."""
        ...


def _fraction(instance: object, attribute: attrs.Attribute, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < value <= 1.0:
        raise ValueError(f"{attribute.name} must be a number in (0, 1], got {value!r}")


@attrs.frozen
class FractionOfGroup:
    """At least `fraction` of the group (rounded up), and at least one execution. The default: half."""

    fraction: float = attrs.field(default=0.5, validator=_fraction)
    """Share of the group that must survive."""

    def min_survivors(self, group_size: int) -> int:
        # The small slack keeps 0.5 * 16 = 8 from rounding up to 9 through float error.
        return min(group_size, max(1, math.ceil(self.fraction * group_size - 1e-9)))


@attrs.frozen
class AtLeast:
    """A fixed count, capped at the group's size (a group smaller than `count` needs all of its executions)."""

    count: int = attrs.field(default=2, validator=[attrs.validators.instance_of(int), attrs.validators.ge(1)])
    """Survivors needed."""

    def min_survivors(self, group_size: int) -> int:
        return min(self.count, group_size)


def survivors_needed(policy: GroupFilter, group_size: int) -> int:
    """`policy.min_survivors(group_size)`, checked: raises GroupFilterError for a non-int or out-of-range answer."""
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise GroupFilterError(f"group_size must be an int >= 1, got {group_size!r}")
    answer = policy.min_survivors(group_size)
    if isinstance(answer, bool) or not isinstance(answer, int):
        raise GroupFilterError(f"{type(policy).__qualname__}.min_survivors returned {answer!r}, not an int")
    if not 1 <= answer <= group_size:
        raise GroupFilterError(
            f"{type(policy).__qualname__}.min_survivors({group_size}) returned {answer}, outside 1..{group_size}"
        )
    return answer
