"""Turning a scored execution's token tree into a bounded set of training samples.

The default `RankedTrajectoryProcessor`:

1. ranks the tree's trajectories (root-to-leaf paths, see `trajectory_tree`) by kind, main > main-summary >
   sub-agent > sub-agent-summary; within a kind the trajectory whose leaf call came later ranks first (the later
   branch is the one the agent went on with, and its leaf carries the most recent state);
2. walks them in that order and gives loss to every policy-emitted token that no earlier kept trajectory already
   trains (a token in a prefix shared by two kept trajectories is trained once, by the higher-ranked one); prompt
   tokens never carry loss;
3. keeps a trajectory only if it still has a loss token (a retry whose policy tokens were all trained elsewhere
   adds forward cost and no signal, so it does not take one of the K slots) and stops at K (default 5);
4. trims each kept sample after its last loss token: later tokens cannot change earlier log-probs (causal model);
5. weights every loss token 1 / (loss tokens of the execution), so that each execution's loss is the mean over its
   own trained tokens however large its tree is.

`AllChainsProcessor` is the baseline it is measured against (`gyre bench trajectories`): every chain's trajectory
becomes a sample, uncapped, with every policy token trained in each sample that holds it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Protocol, runtime_checkable

import attrs

from gyre.messages.samples import ExecutionScored, SamplesLanded, TrainingSample
from gyre.policies.errors import ProcessorError
from gyre.policies.loss import group_advantages
from gyre.policies.trajectory_tree import KIND_RANK, Trajectory, TrajectoryTree, TreePath


@runtime_checkable
class TrajectoryProcessor(Protocol):
    """Chooses and masks the training samples of one scored execution.

    Contract (checked by tests/unit/test_trajectory_processor.py for every implementation): samples come from the
    given tree; each sample's tokens are a prefix of one of the tree's call paths; only policy-emitted tokens carry
    loss, with the tree's behaviour log-probs; each sample has at least one loss token; the weights of an execution's
    loss tokens sum to 1 and are 0 elsewhere; every token carries the given advantage.
    """

    def process(self, tree: TrajectoryTree, advantage: float) -> tuple[TrainingSample, ...]:
        """The samples of one execution whose group-normalised advantage is `advantage`."""
        ...


@attrs.frozen
class ProcessorConfig:
    """Knobs of the default processor."""

    max_trajectories: int = attrs.field(default=5, validator=attrs.validators.gt(0))
    """K: trajectories kept per execution."""
    trim_after_last_loss_token: bool = True
    """Drop the tokens after a sample's last loss token (they cost forward time and change nothing)."""


def rank_key(trajectory: Trajectory) -> tuple[int, int]:
    """Sort key of the default ranking: kind first, then the later leaf call first."""
    return (KIND_RANK[trajectory.kind], -trajectory.leaf_call_index)


@attrs.frozen
class _Kept:
    trajectory: Trajectory
    path: TreePath
    loss_mask: tuple[bool, ...]
    num_loss_tokens: int


class RankedTrajectoryProcessor:
    """Top-K trajectories by kind, shared tokens trained once, per-execution weights (module docstring)."""

    def __init__(self, config: ProcessorConfig = ProcessorConfig()) -> None:
        self.config = config

    def rank(self, tree: TrajectoryTree) -> tuple[Trajectory, ...]:
        """All trajectories of the tree, most important first."""
        return tuple(sorted(tree.trajectories(), key=rank_key))

    def process(self, tree: TrajectoryTree, advantage: float) -> tuple[TrainingSample, ...]:
        _check_advantage(advantage)
        claimed: dict[int, int] = {}  # node id -> its first n tokens are trained by a kept sample
        kept: list[_Kept] = []
        for trajectory in self.rank(tree):
            if len(kept) == self.config.max_trajectories:
                break
            path = tree.path(trajectory.leaf_call_index)
            mask = [False] * len(path.token_ids)
            count = 0
            for node_id, start, length in path.segments:
                for k in range(claimed.get(node_id, 0), length):
                    if path.policy_mask[start + k]:
                        mask[start + k] = True
                        count += 1
            if count == 0:
                continue
            for node_id, _, length in path.segments:
                if length > claimed.get(node_id, 0):
                    claimed[node_id] = length
            kept.append(_Kept(trajectory, path, tuple(mask), count))
        total = sum(k.num_loss_tokens for k in kept)
        samples = []
        for rank, k in enumerate(kept):
            stop = len(k.loss_mask)
            if self.config.trim_after_last_loss_token:
                stop = max(i for i, m in enumerate(k.loss_mask) if m) + 1
            samples.append(
                _sample(tree, k.trajectory, rank, k.path, k.loss_mask, stop, advantage, 1.0 / total, k.num_loss_tokens)
            )
        return tuple(samples)


class AllChainsProcessor:
    """Baseline: one sample per chain (its last call's prompt + output), no cap, no dedup, no trimming.

    A policy token shared by several chains is trained in each of them; weights still make each execution's loss the
    mean over its (repeated) trained tokens, so that the baseline is a fair loss, just an expensive one.
    """

    def process(self, tree: TrajectoryTree, advantage: float) -> tuple[TrainingSample, ...]:
        _check_advantage(advantage)
        by_leaf = {t.leaf_call_index: t for t in tree.trajectories()}
        picked = []
        for chain in tree.chains():
            leaf = chain.call_indices[-1]
            path = tree.path(leaf)
            count = sum(path.policy_mask)
            if count == 0:
                continue
            trajectory = by_leaf.get(leaf)
            if trajectory is None:  # a chain carried by a longer trajectory: here it stands alone
                trajectory = Trajectory(leaf, chain.kind, chain.kind, (chain.chain_id,), len(path.token_ids))
            picked.append((trajectory, path, count))
        total = sum(count for _, _, count in picked)
        return tuple(
            _sample(tree, t, rank, path, path.policy_mask, len(path.token_ids), advantage, 1.0 / total, count)
            for rank, (t, path, count) in enumerate(picked)
        )


def _check_advantage(advantage: float) -> None:
    if not math.isfinite(advantage):
        raise ProcessorError(f"advantage must be finite, got {advantage}")


def _sample(
    tree: TrajectoryTree,
    trajectory: Trajectory,
    rank: int,
    path: TreePath,
    loss_mask: Sequence[bool],
    stop: int,
    advantage: float,
    weight: float,
    num_loss_tokens: int,
) -> TrainingSample:
    mask = tuple(loss_mask[:stop])
    versions = [v for v, m in zip(path.versions, mask) if m]
    return TrainingSample(
        execution_id=tree.execution_id,
        group_id=tree.group_id,
        trajectory_rank=rank,
        trajectory_kind=trajectory.kind,
        leaf_call_index=trajectory.leaf_call_index,
        token_ids=path.token_ids[:stop],
        loss_mask=mask,
        behaviour_logprobs=tuple(lp if m else 0.0 for lp, m in zip(path.logprobs, mask)),
        sampling_temperatures=tuple(t if m else 1.0 for t, m in zip(path.temperatures, mask)),
        advantages=(float(advantage),) * stop,
        weights=tuple(weight if m else 0.0 for m in mask),
        min_weight_version=min(versions),
        max_weight_version=max(versions),
        num_loss_tokens=num_loss_tokens,
    )


def build_group_samples(
    group_id: str,
    trees: Mapping[str, TrajectoryTree],
    scores: Sequence[ExecutionScored],
    processor: TrajectoryProcessor,
    *,
    num_dropped: int = 0,
    eps: float = 1e-6,
) -> SamplesLanded:
    """Advantages over the group's scored executions, then each execution's samples from `processor`.

    `trees` maps execution id -> tree and must hold every scored execution (it may hold more: dropped ones are
    ignored). Executions appear in the order of `scores`.
    """
    seen: set[str] = set()
    for score in scores:
        if score.group_id != group_id:
            raise ProcessorError(f"execution {score.execution_id} is in group {score.group_id!r}, not {group_id!r}")
        if score.execution_id in seen:
            raise ProcessorError(f"execution {score.execution_id} was scored twice")
        if score.execution_id not in trees:
            raise ProcessorError(f"execution {score.execution_id} has no tree")
        seen.add(score.execution_id)
    rewards = [float(s.reward) for s in scores]
    advantages = group_advantages(rewards, [group_id] * len(rewards), eps=eps).tolist() if rewards else []
    samples: list[TrainingSample] = []
    for score, advantage in zip(scores, advantages):
        tree = trees[score.execution_id]
        if tree.execution_id != score.execution_id:
            raise ProcessorError(f"tree under {score.execution_id!r} belongs to {tree.execution_id!r}")
        samples.extend(processor.process(tree, advantage))
    versions_min = [s.min_weight_version for s in samples]
    versions_max = [s.max_weight_version for s in samples]
    return SamplesLanded(
        group_id=group_id,
        samples=tuple(samples),
        execution_ids=tuple(s.execution_id for s in scores),
        rewards=tuple(rewards),
        advantages=tuple(float(a) for a in advantages),
        num_dropped=num_dropped,
        num_tokens=sum(len(s.token_ids) for s in samples),
        num_loss_tokens=sum(s.num_loss_tokens for s in samples),
        min_weight_version=min(versions_min, default=-1),
        max_weight_version=max(versions_max, default=-1),
    )
