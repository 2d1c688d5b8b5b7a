"""Staleness: which samples may still train at a given step.

Every scheduling policy (elastic, async, colocate) runs under one bound s: a sample generated with weights of
version v may train in a step whose gradients are computed with base version t only if t - v <= s. A sample's v is
its `min_weight_version` (the oldest weights that sampled one of its loss tokens): an execution that ran for hours
spans several versions, and its oldest token is the one the importance ratio has to correct the most.

The policy is a typed Protocol so a topology can swap in another rule (e.g. a bound in wall time, or one that grows
with the step); `check_staleness_policy` is the contract every implementation must pass. Policies are frozen attrs
classes so that an actor's config (which holds one) can be recorded in the event log and rebuilt by replay.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import attrs

from gyre.policies.errors import StalenessPolicyError


@runtime_checkable
class StalenessPolicy(Protocol):
    """Decides whether data sampled with weights `sample_version` may train on top of weights `base_version`.

    Contract (`check_staleness_policy`): pure and deterministic; fresh data (sample_version == base_version) is always
    admitted; admission is monotone: data that is admitted stays admitted if it were newer or the base were older.
    """

    def admits(self, sample_version: int, base_version: int) -> bool:
        """True if a sample whose oldest loss token came from `sample_version` may train at `base_version`."""
        ...


@attrs.frozen
class MaxVersionLag:
    """The default bound: admit when base_version - sample_version <= max_lag.

    max_lag 0 is fully on-policy (every sample comes from the weights it trains on); 1 lets rollouts of step t overlap
    training of step t. A sample newer than the base (it cannot happen when versions only grow, but a restarted
    claimer may see it) has a negative lag and is admitted: it is not stale.
    """

    max_lag: int = 1
    """s: the largest version lag a sample may have."""

    def __attrs_post_init__(self) -> None:
        if isinstance(self.max_lag, bool) or not isinstance(self.max_lag, int) or self.max_lag < 0:
            raise StalenessPolicyError(f"max_lag must be an int >= 0, got {self.max_lag!r}")

    def admits(self, sample_version: int, base_version: int) -> bool:
        return base_version - sample_version <= self.max_lag


def check_staleness_policy(policy: object, versions: range = range(0, 12)) -> None:
    """The contract test: raise StalenessPolicyError unless `policy` behaves like a StalenessPolicy on `versions`.

    Checked: `admits` exists and returns a real bool; the same question gets the same answer; fresh data is always
    admitted; admission is monotone in both arguments (newer data or an older base never turns a yes into a no).
    Policies must be frozen attrs classes: actor configs hold them and the event log records configs.
    """
    if not attrs.has(type(policy)):
        raise StalenessPolicyError(f"{type(policy).__qualname__} is not an attrs class; configs must be recordable")
    if not isinstance(policy, StalenessPolicy):
        raise StalenessPolicyError(f"{type(policy).__qualname__} has no admits(sample_version, base_version)")
    answers: dict[tuple[int, int], bool] = {}
    for base in versions:
        for sample in versions:
            answer = policy.admits(sample, base)
            if not isinstance(answer, bool):
                raise StalenessPolicyError(f"admits({sample}, {base}) returned {answer!r}, not a bool")
            if policy.admits(sample, base) != answer:
                raise StalenessPolicyError(f"admits({sample}, {base}) is not deterministic")
            answers[(sample, base)] = answer
    for base in versions:
        if not answers[(base, base)]:
            raise StalenessPolicyError(f"fresh data refused: admits({base}, {base}) is False")
        for sample in versions:
            if not answers[(sample, base)]:
                continue
            if sample + 1 in versions and not answers[(sample + 1, base)]:
                raise StalenessPolicyError(
                    f"not monotone: admits({sample}, {base}) but not admits({sample + 1}, {base})")
            if base - 1 in versions and not answers[(sample, base - 1)]:
                raise StalenessPolicyError(
                    f"not monotone: admits({sample}, {base}) but not admits({sample}, {base - 1})")
