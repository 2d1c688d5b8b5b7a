"""Task sampling policies (policies/task_sampling.py): families, the weights, and the contract check."""

from __future__ import annotations

import math

import attrs
import pytest

from gyre.policies.task_sampling import (
    EpochOrder,
    SignalWeighted,
    TaskSampling,
    TaskSamplingError,
    checked_weights,
    family_of,
)


def test_a_family_is_the_id_before_the_separator() -> None:
    assert family_of("lookup-3fa2c1", "-") == "lookup"
    assert family_of("cost-a-b", "-") == "cost"
    assert family_of("plain", "-") == "plain"
    assert family_of("lookup-3fa2c1", "") == "lookup-3fa2c1"


def test_epoch_order_has_no_preference() -> None:
    assert checked_weights(EpochOrder(), {"a": [False, False], "b": []}) is None


def test_signal_weighted_follows_the_recent_landed_share_above_a_floor() -> None:
    policy = SignalWeighted(window_groups=4, min_groups=2, floor=0.2)
    weights = checked_weights(policy, {
        "new": [], "young": [False], "flat": [False] * 9, "half": [True, False, True, False],
        "recovered": [False] * 6 + [True] * 4, "all": [True] * 3,
    })
    assert weights == {"new": 1.0, "young": 1.0, "flat": pytest.approx(0.2), "half": pytest.approx(0.6),
                       "recovered": pytest.approx(1.0), "all": pytest.approx(1.0)}


@pytest.mark.parametrize("change", [{"window_groups": 0}, {"min_groups": 0}, {"floor": 0.0}, {"floor": 1.5},
                                    {"floor": True}, {"window_groups": 2.5}])
def test_bad_settings_are_refused(change: dict) -> None:
    with pytest.raises((ValueError, TypeError)):
        SignalWeighted(**change)


@attrs.frozen
class Broken:
    answer: object
    family_separator: str = "-"

    def family_weights(self, landed_by_family):
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
        checked_weights(Broken(answer), {"a": [], "b": [True]})
