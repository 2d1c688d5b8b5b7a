"""Counters of the execution actors (executor, evaluator, trajectory builder, task source), for progress displays,
reports and tests: ask an actor `StatisticsAsked` (gyre.messages.runtime_control) and it answers with its own
record."""

from __future__ import annotations

from gyre.messages._define import message


@message("gyre.execution_stats.ExecutorStatistics", version=2)
class ExecutorStatistics:
    """The executor's counters."""

    groups_started: int
    """StartGroup messages accepted."""
    groups_refused: int
    """StartGroup messages refused (bad task or size, or no room)."""
    executions_launched: int
    """Agent processes started."""
    executions_finished: int
    """Agent processes that ended (timed-out ones included)."""
    executions_timed_out: int
    """Agent processes killed at their time limit."""
    executions_failed: int
    """Executions that never got a process (no key, unwritable workspace, argv that does not run)."""
    running: int
    """Executions holding a slot now (asking for a key, or an agent process alive)."""
    queued: int
    """Executions waiting for a slot."""
    warm_launches: int
    """Agents forked from the warm launcher's server (their imports already done)."""
    cold_launches: int
    """Agents started as fresh processes (warm launcher off, an argv it cannot fork, or its server gone)."""


@message("gyre.execution_stats.EvaluatorStatistics", version=2)
class EvaluatorStatistics:
    """The evaluator's counters."""

    scored: int
    """Executions that got a reward."""
    dropped: int
    """Executions dropped (sum of `dropped_by_kind`)."""
    dropped_by_kind: dict[str, int]
    """Drops per kind (every kind of gyre.actors.executions.evaluator.DROP_KINDS, zeros included)."""
    running: int
    """Scorers running now."""
    queued: int
    """Executions waiting for a scorer slot."""
    warm_scorer_runs: int
    """Scorers forked from the warm launcher."""
    plain_scorer_runs: int
    """Scorers exec'd as fresh processes."""


@message("gyre.execution_stats.BuilderStatistics", version=2)
class BuilderStatistics:
    """The trajectory builder's counters."""

    groups_landed: int
    """Groups whose samples went to the claimer."""
    groups_dropped: int
    """Groups dropped whole (too few survivors, refused, or nothing trainable)."""
    executions_scored: int
    """ExecutionScored messages taken."""
    executions_dropped: int
    """ExecutionDropped messages taken."""
    calls_added: int
    """Model calls added to trees."""
    messages_refused: int
    """Calls or outcomes that could not be taken (bad call, tree full, unknown execution, duplicate outcome, too
    many live executions or groups); each is logged."""
    late_messages: int
    """Calls or outcomes for groups already finished (ignored)."""
    live_trees: int
    """Token trees held now."""
    live_groups: int
    """Groups being tracked now."""
    samples_landed: int
    """Training samples sent."""
    tokens_landed: int
    """Tokens over all samples sent."""
    prompt_mismatches: int
    """Calls whose prompt, rebuilt from the earlier call they name, did not match their digest (their executions
    were refused; issue 29)."""
    incomplete_trees: int
    """Scored executions refused because a call of theirs extends a call that never arrived."""


@message("gyre.execution_stats.GroupRecord")
class GroupRecord:
    """How one group ended, as the task source recorded it."""

    group_id: str
    """The group."""
    task_id: str
    """Its task."""
    weight_version: int
    """Weight version when it started."""
    landed: bool
    """Whether its samples landed."""
    mean_reward: float
    """Mean reward over its scored executions."""
    success_rate: float
    """Fraction of scored executions judged successful."""
    num_scored: int
    """Executions scored."""
    num_dropped: int
    """Executions dropped."""


@message("gyre.execution_stats.TaskSourceStatistics", version=2)
class TaskSourceStatistics:
    """The task source's counters and its recent group records."""

    groups_started: int
    """StartGroup messages sent."""
    groups_done: int
    """GroupDone messages taken."""
    groups_landed: int
    """Groups done whose samples landed."""
    groups_in_flight: int
    """Groups started and not done."""
    weight_version: int
    """Newest weight version seen (StepApplied)."""
    held_by_staleness: bool
    """True when the staleness bound is what keeps the next group from starting."""
    history: tuple[GroupRecord, ...]
    """Records of the most recent groups done, oldest first (bounded by the task source's config)."""
    groups_rerolled: int = 0
    """Groups started again after a resume, their samples not trained by the checkpoint's step (version 2)."""
    groups_lost_on_resume: int = 0
    """Groups a resume was to re-roll whose task the task source no longer knew: must stay 0."""
