"""What the executor and the evaluator tell themselves when background work ends.

Agents and scorers run in child tasks (`Actor.spawn`) so that waiting on a subprocess never blocks a mailbox; the
child reports back with one of these, and the handler makes the state change, so that the change is a recorded
message like any other.
"""

from __future__ import annotations

from gyre.messages._define import message


@message("gyre.execution_reports.AgentLaunched")
class AgentLaunched:
    """Executor -> itself: the agent process of an execution runs."""

    execution_id: str
    """Which execution."""
    workspace: str
    """Its workspace directory."""
    pid: int
    """Process id (also the id of its process group)."""


@message("gyre.execution_reports.AgentExited")
class AgentExited:
    """Executor -> itself: the agent process ended by itself or was killed at its time limit."""

    execution_id: str
    """Which execution."""
    exit_code: int
    """Exit status (negative: the signal that ended it)."""
    timed_out: bool
    """True when the executor killed it at the task's time limit."""
    wall_s: float
    """Runtime-clock time from launch to exit."""


@message("gyre.execution_reports.LaunchFailed")
class LaunchFailed:
    """Executor -> itself: no agent process could be started (no API key, workspace not writable, bad argv)."""

    execution_id: str
    """Which execution."""
    reason: str
    """What went wrong."""
    key_issued: bool
    """Whether the proxy had issued a key that must now be revoked."""


@message("gyre.execution_reports.ScoringEnded")
class ScoringEnded:
    """Evaluator -> itself: a scorer run ended with a reward or a reason to drop the execution."""

    execution_id: str
    """Which execution."""
    reward: float | None
    """The scorer's reward; None when the execution is to be dropped."""
    detail: str
    """The scorer's JSON object, compact (kept for the builder's success flag); "" when dropped."""
    drop_kind: str
    """"" when scored, else one of gyre.actors.executions.evaluator.DROP_KINDS."""
    reason: str
    """Human-readable reason for a drop; "" when scored."""
