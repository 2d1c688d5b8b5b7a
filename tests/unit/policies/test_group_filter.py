"""Contract test of the group-filter policy: valid implementations pass, broken ones fail loudly."""

from __future__ import annotations

import attrs
import pytest

from gyre.policies.errors import GroupFilterError
from gyre.policies.group_filter import AtLeast, FractionOfGroup, GroupFilter, survivors_needed

VALID = [FractionOfGroup(), FractionOfGroup(0.25), FractionOfGroup(1.0), AtLeast(1), AtLeast(3)]


@pytest.mark.parametrize("policy", VALID, ids=repr)
def test_contract_valid_policies(policy: GroupFilter) -> None:
    assert isinstance(policy, GroupFilter)
    for size in range(1, 65):
        needed = survivors_needed(policy, size)
        assert 1 <= needed <= size
        assert survivors_needed(policy, size) == needed  # deterministic
    assert attrs.has(type(policy)), "policies travel in actor configs: they must be attrs classes"


def test_fraction_rounds_up_without_float_drift() -> None:
    assert FractionOfGroup().min_survivors(16) == 8
    assert FractionOfGroup().min_survivors(15) == 8
    assert FractionOfGroup().min_survivors(1) == 1
    assert FractionOfGroup(0.1).min_survivors(3) == 1
    assert FractionOfGroup(0.3).min_survivors(10) == 3
    assert AtLeast(4).min_survivors(2) == 2


@attrs.frozen
class _Returns:
    value: object

    def min_survivors(self, group_size: int) -> object:
        return self.value


@pytest.mark.parametrize("value", [0, -1, 17, 2.0, True, None, "3"])
def test_contract_invalid_answers_fail_loudly(value: object) -> None:
    with pytest.raises(GroupFilterError):
        survivors_needed(_Returns(value), 16)  # type: ignore[arg-type]


@pytest.mark.parametrize("size", [0, -3, 2.0, True])
def test_group_size_must_be_positive_int(size: object) -> None:
    with pytest.raises(GroupFilterError):
        survivors_needed(FractionOfGroup(), size)  # type: ignore[arg-type]


@pytest.mark.parametrize("fraction", [0.0, -0.5, 1.5, True, "half"])
def test_bad_fraction_rejected(fraction: object) -> None:
    with pytest.raises((ValueError, TypeError)):
        FractionOfGroup(fraction)  # type: ignore[arg-type]


def test_bad_count_rejected() -> None:
    with pytest.raises((ValueError, TypeError)):
        AtLeast(0)
    with pytest.raises((ValueError, TypeError)):
        AtLeast(1.5)  # type: ignore[arg-type]
