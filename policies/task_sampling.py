"""Which task the next group runs: every task in turn, or more often the families whose groups still teach.

A GSPO group teaches only when its rewards differ: the trajectory builder drops a group whose 16 rewards are all
the same (DAPO's dynamic sampling), and its rollouts were spent for nothing. On the main job's toolbox tasks that
was about half of all groups (BENCHMARKS.md, sessions 5 and 6): every agent already solves one family ("sum"),
none solves another yet ("write"), and both keep their full share of the rollouts. `SignalWeighted` moves that
share to the families whose recent groups landed, while a floor keeps every family sampled, so a family that
starts to split its group (the model begins to solve it, or forgets it) comes back. Measured once against epochs
(session 6): it changed the mix as meant ("sum" 21 -> 10 groups) but not the share of dropped groups, because
most families split or not by the task drawn rather than by family.

`SignalPerToken` is the same rule measured in compute instead of draws. An agent's failing rollouts run long (on
the main job 8.6 model calls and 400 tokens each, against 3.5 calls and 125 tokens for a success: benchmarks/
rollout_cost.py), so a family that rarely lands and whose groups cost three times as much ("helper") took 14% of
the engines' tokens with weight at the floor, and 60% of all rollout tokens went to dropped groups. Here each
family's share of the *tokens* follows its landed share (with the floor as a share of tokens too), and a group is
drawn with that share divided by the family's recent tokens per group.

A task's family is the part of its id before `family_separator` ("lookup-3fa2..." is in "lookup"); an id without
the separator is a family of its own. Policies are frozen attrs classes, so they travel inside the task source's
config and into the event log; the task source keeps the state (each family's recent outcomes and its own
shuffled cycle of tasks) and asks `family_weights` before each group.
"""

from __future__ import annotations

from typing import Mapping, Protocol, Sequence, runtime_checkable

import attrs

from gyre.policies.errors import TaskSamplingError

__all__ = ["TaskSampling", "GroupOutcome", "EpochOrder", "SignalWeighted", "SignalPerToken", "TaskSamplingError",
           "family_of", "checked_weights"]


@attrs.frozen
class GroupOutcome:
    """How one finished group of a family went, as the task source tells its policy."""

    landed: bool
    """Its samples landed (its rewards differed); False: dropped."""
    work_tokens: int
    """What its rollouts cost the engines (GroupDone.work_tokens)."""


@runtime_checkable
class TaskSampling(Protocol):
    """Contract (tests/unit/test_task_sampling.py): `family_weights` returns a finite weight >= 0 for every family it
    is given, at least one of them > 0; None means "no preference: run the tasks in shuffled epochs"."""

    family_separator: str

    def family_weights(self, outcomes_by_family: Mapping[str, Sequence[GroupOutcome]]) -> dict[str, float] | None:
        """Relative chance of each family to run next, from its finished groups' outcomes, oldest first."""
        ...


def family_of(task_id: str, separator: str) -> str:
    """The family of a task id: its text before the first `separator` (the whole id when there is none)."""
    return task_id.split(separator, 1)[0] if separator else task_id


@attrs.frozen
class EpochOrder:
    """Every task once per epoch, in an order shuffled from the seed. The default."""

    family_separator: str = "-"

    def family_weights(self, outcomes_by_family: Mapping[str, Sequence[GroupOutcome]]) -> dict[str, float] | None:
        return None


def _share(instance: object, attribute: attrs.Attribute, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < value <= 1.0:
        raise ValueError(f"{attribute.name} must be a number in (0, 1], got {value!r}")


@attrs.frozen
class SignalWeighted:
    """A family's weight is `floor` plus the share of its last `window_groups` groups that landed, scaled into
    [floor, 1]; a family with fewer than `min_groups` finished groups has weight 1 (not judged yet)."""

    window_groups: int = attrs.field(default=6, validator=[attrs.validators.instance_of(int), attrs.validators.ge(1)])
    """Recent groups of a family that its weight looks at."""
    min_groups: int = attrs.field(default=2, validator=[attrs.validators.instance_of(int), attrs.validators.ge(1)])
    """Groups a family must have finished before its weight moves off 1."""
    floor: float = attrs.field(default=0.15, validator=_share)
    """Weight of a family none of whose recent groups landed: kept above 0 so a change in it is seen."""
    family_separator: str = "-"

    def family_weights(self, outcomes_by_family: Mapping[str, Sequence[GroupOutcome]]) -> dict[str, float] | None:
        weights = {}
        for family, outcomes in outcomes_by_family.items():
            recent = list(outcomes)[-self.window_groups:]
            if len(recent) < self.min_groups:
                weights[family] = 1.0
            else:
                weights[family] = self.floor + (1.0 - self.floor) * _landed_share(recent)
        return weights


def _landed_share(outcomes: Sequence[GroupOutcome]) -> float:
    return sum(outcome.landed for outcome in outcomes) / len(outcomes)


@attrs.frozen
class SignalPerToken(SignalWeighted):
    """SignalWeighted's rule over the engines' tokens: a judged family's share of the tokens (not of the draws) is
    `floor` plus its recent landed share scaled into [floor, 1], and its weight is that share divided by its mean
    tokens per group over the same window, relative to the mean over all judged families (so a family of average
    cost keeps SignalWeighted's weight). A family with fewer than `min_groups` finished groups, or whose groups cost
    nothing, has weight 1 (not judged yet). The settings are SignalWeighted's."""

    def family_weights(self, outcomes_by_family: Mapping[str, Sequence[GroupOutcome]]) -> dict[str, float] | None:
        judged: dict[str, tuple[float, float]] = {}  # family -> (token share, mean tokens a group)
        weights = {}
        for family, outcomes in outcomes_by_family.items():
            recent = list(outcomes)[-self.window_groups:]
            tokens = sum(outcome.work_tokens for outcome in recent) / len(recent) if recent else 0.0
            if len(recent) < self.min_groups or tokens <= 0:
                weights[family] = 1.0
            else:
                judged[family] = (self.floor + (1.0 - self.floor) * _landed_share(recent), tokens)
        if judged:
            mean_tokens = sum(tokens for _, tokens in judged.values()) / len(judged)
            for family, (share, tokens) in judged.items():
                weights[family] = share * mean_tokens / tokens
        return weights


def checked_weights(
    policy: TaskSampling, outcomes_by_family: Mapping[str, Sequence[GroupOutcome]]
) -> dict[str, float] | None:
    """`policy.family_weights(...)`, checked against the contract: raises TaskSamplingError on a broken answer."""
    weights = policy.family_weights(outcomes_by_family)
    if weights is None:
        return None
    name = type(policy).__qualname__
    missing = sorted(set(outcomes_by_family) - set(weights))
    if missing:
        raise TaskSamplingError(f"{name} gave no weight for families {missing}")
    for family, weight in weights.items():
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0.0 <= weight < float("inf"):
            raise TaskSamplingError(f"{name} gave family {family!r} the weight {weight!r}; need a finite number >= 0")
    if outcomes_by_family and not any(weights[family] > 0 for family in outcomes_by_family):
        raise TaskSamplingError(f"{name} gave every family a weight of 0: no task can run")
    return {family: float(weights[family]) for family in outcomes_by_family}
