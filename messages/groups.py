"""Groups of executions: the executor announces each group it accepts, so the trajectory builder knows when a
group is complete (every announced execution scored or dropped) without counting on arrival order."""

from __future__ import annotations

from gyre.messages._define import message


@message("gyre.groups.GroupStarted")
class GroupStarted:
    """Executor -> everyone interested (published): a StartGroup was accepted (or refused) and these are its
    executions; the group is complete once each of them is scored or dropped."""

    group_id: str
    """The group."""
    task_id: str
    """Its task."""
    group_size: int
    """Executions in the group (len(execution_ids)); 0 when refused."""
    execution_ids: tuple[str, ...]
    """Ids of the group's executions, in index order."""
    weight_version: int
    """Weight version the task source stamped on the group."""
    refused: str
    """Why the executor refused the group (bad task, bad size); "" when accepted. A refused group runs nothing and
    is complete (dropped) at once."""
