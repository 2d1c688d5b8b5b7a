"""Task sampling policies (policies/task_sampling.py): families, the weights, and the contract check."""

from __future__ import annotations

import math

import attrs
import pytest

from gyre.policies.errors import TaskSamplingError
from gyre.policies.task_sampling import (
    EpochOrder,
    GroupOutcome,
    SignalPerToken,
    SignalWeighted,
    TaskSampling,
    checked_weights,
    family_of,
)


def test_a_family_is_the_id_before_the_separator() -> None:
    assert family_of("lookup-3fa2c1", "-") == "lookup"
    assert family_of("cost-a-b", "-") == "cost"
    assert family_of("plain", "-") == "plain"
    assert family_of("lookup-3fa2c1", "") == "lookup-3fa2c1"


def outcomes(*landed: bool, tokens: int = 100) -> list[GroupOutcome]:
    return [GroupOutcome(flag, tokens) for flag in landed]


def test_epoch_order_has_no_preference() -> None:
    assert checked_weights(EpochOrder(), {"a": outcomes(False, False), "b": []}) is None


def test_signal_weighted_follows_the_recent_landed_share_above_a_floor() -> None:
    policy = SignalWeighted(window_groups=4, min_groups=2, floor=0.2)
    weights = checked_weights(policy, {
        "new": [], "young": outcomes(False), "flat": outcomes(*[False] * 9), "half": outcomes(True, False, True, False),
        "recovered": outcomes(*[False] * 6 + [True] * 4), "all": outcomes(True, True, True, tokens=900),
    })
    assert weights == {"new": 1.0, "young": 1.0, "flat": pytest.approx(0.2), "half": pytest.approx(0.6),
                       "recovered": pytest.approx(1.0), "all": pytest.approx(1.0)}


def test_signal_per_token_divides_the_token_share_by_the_tokens_a_group() -> None:
    policy = SignalPerToken(window_groups=4, min_groups=2, floor=0.2)
    weights = checked_weights(policy, {
        "new": [], "young": outcomes(False, tokens=50), "free": outcomes(True, True, tokens=0),
        # judged: token shares 0.2, 0.6 and 1.0 at 300, 100 and 200 tokens a group (mean 200)
        "flat": outcomes(*[False] * 9, tokens=300), "half": outcomes(True, False, True, False),
        "all": [GroupOutcome(True, 900)] * 5 + outcomes(True, True, True, True, tokens=200),  # the window: 200 each
    })
    assert weights == {"new": 1.0, "young": 1.0, "free": 1.0, "flat": pytest.approx(0.2 * 200 / 300),
                       "half": pytest.approx(0.6 * 200 / 100), "all": pytest.approx(1.0)}
    # Families of equal cost keep SignalWeighted's weights.
    same = {"flat": outcomes(False, False), "half": outcomes(True, False)}
    assert checked_weights(policy, same) == pytest.approx(
        checked_weights(SignalWeighted(window_groups=4, min_groups=2, floor=0.2), same))


@pytest.mark.parametrize("policy", [SignalWeighted, SignalPerToken])
@pytest.mark.parametrize("change", [{"window_groups": 0}, {"min_groups": 0}, {"floor": 0.0}, {"floor": 1.5},
                                    {"floor": True}, {"window_groups": 2.5}])
def test_bad_settings_are_refused(policy: type, change: dict) -> None:
    with pytest.raises((ValueError, TypeError)):
        policy(**change)


@attrs.frozen
class Broken:
    answer: object
    family_separator: str = "-"

    def family_weights(self, outcomes_by_family):
        return self.answer


@pytest.mark.parametrize("answer, match", [
    ({"a": 1.0}, "no weight for families"),
    ({"a": -1.0, "b": 1.0}, "need a finite number"),
    ({"a": math.nan, "b": 1.0}, "need a finite number"),
    ({"a": math.inf, "b": 1.0}, "need a finite number"),
    ({"a": "1", "b": 1.0}, "need a finite number"),
    ({"a": 0.0, "b": 0}, "weight of 0"),
])
def test_a_broken_policy_fails_loudly(answer: dict, match: str) -> None:
    assert isinstance(Broken(answer), TaskSampling)
    with pytest.raises(TaskSamplingError, match=match):
        checked_weights(Broken(answer), {"a": [], "b": outcomes(True)})
