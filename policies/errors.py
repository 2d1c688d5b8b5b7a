"""The policies layer's errors: one base, `PolicyError`, under the runtime's `GyreError`.

Policies import only messages and plain data, and this module: `gyre.runtime.errors` depends on nothing. Each
error also keeps the builtin it always was (mostly `ValueError`), so older `except ValueError` clauses still work.
The policy modules import their errors from here and re-export them (`from gyre.policies.loss import
LossInputError` keeps working); new code imports from `gyre.policies.errors`.
"""

from __future__ import annotations

from gyre.runtime.errors import GyreError

__all__ = [
    "GroupFilterError",
    "LossInputError",
    "PolicyContractError",
    "PolicyError",
    "ProcessorError",
    "PromptMismatch",
    "RoutingContractError",
    "SchedulingConfigError",
    "StalenessPolicyError",
    "TaskSamplingError",
    "TrajectoryError",
    "TreeFull",
]


class PolicyError(GyreError):
    """Base of every error the policies layer raises on purpose (a bad input, a policy breaking its contract)."""


# Routing (routing).


class RoutingContractError(PolicyError, RuntimeError):
    """A routing policy broke its contract (a programmer error in the policy)."""


# Scheduling and staleness (scheduling, staleness).


class PolicyContractError(PolicyError, ValueError):
    """A policy returned decisions that break the contract, or is not a valid policy object."""


class SchedulingConfigError(PolicyError, ValueError):
    """A policy configured in a way that cannot work (e.g. a fixed split that leaves the core out of training)."""


class StalenessPolicyError(PolicyError, ValueError):
    """A staleness policy that is misconfigured or breaks the contract."""


# Tasks and groups (task_sampling, group_filter).


class TaskSamplingError(PolicyError, ValueError):
    """A policy gave weights that cannot be sampled from (negative, not finite, missing, or all zero)."""


class GroupFilterError(PolicyError, ValueError):
    """A policy gave an answer outside 1..group_size, or was asked about a group without executions."""


# Trajectories and the loss (trajectory_tree, trajectory_processor, loss).


class TrajectoryError(PolicyError, ValueError):
    """A call that cannot enter the tree: wrong execution, inconsistent lengths, empty prompt, bad label."""


class TreeFull(TrajectoryError):
    """The tree hit a bound of its `TreeConfig`; the call was not added. The builder should drop the execution rather
    than let its tree grow without end."""


class PromptMismatch(TrajectoryError):
    """An incremental call's prompt, rebuilt from the earlier call it names, does not hash to the digest it carries
    (a lost or reordered record, a proxy and builder that disagree): the execution must not train."""


class ProcessorError(PolicyError, ValueError):
    """Inputs the processor cannot use: a non-finite advantage, scores that do not match the trees."""


class LossInputError(PolicyError, ValueError):
    """Tensors of the wrong shape, mismatched lengths, non-finite rewards or invalid clip ranges."""
