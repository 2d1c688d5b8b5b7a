"""The task source: keeps a few groups of executions running, one task per group, and records how each went.

It sends `StartGroup` to the executor until `groups_in_flight` groups are running, starts the next one on each
`GroupDone` (from the trajectory builder), and after `max_groups` groups are done stops the run (when told to).
Which task runs next is the `sampling` policy's call (policies/task_sampling.py): by default tasks are taken in
epochs, every epoch visiting each task once in an order shuffled from `seed`; `SignalWeighted` instead draws a
task family by how often its recent groups landed (a group whose rewards are all equal is dropped and teaches
nothing), then that family's next task from its own shuffled cycle.

Staleness hook. Rollouts must not run too far ahead of training, or their samples are too stale to train on when
their step comes (the micro-step claimer refuses them, which wastes the rollout). The task source subscribes
`StepApplied` to know the weight version and the steps done, and bounds the groups *ahead of training*:

    started - dropped - groups_per_step * steps_done < max_groups_ahead_of_training

(dropped groups never train, so they do not count; each step uses up `groups_per_step` groups). Steps, not
versions: a step the core skips for non-finite gradients (`StepApplied.skipped`) uses its groups up without bumping
the version, and a gate on versions would then wait for ever. `steps_done` is the newest applied step id + 1 -
`first_step_id`. With `max_groups_ahead_of_training = (s + 1) * groups_per_step`
(`groups_ahead_for_staleness(s, groups_per_step)`), a group started after k steps is among the first
(k + s + 1) * groups_per_step trainable groups, so it lands in step k + s at the latest; the version moves at most
one per step, so that step's base version is at most v + s for the version v the group started with: its samples
are at most s versions stale. None disables the bound.

TaskSpec mapping (actors never import examples; the topology file converts). For an examples/toolbox `Task`:

    TaskSpec(task_id=task.task_id, prompt=task.prompt, workspace_files=dict(task.workspace_files),
             agent_argv=agent.agent_argv("")[:-1] + (agent options...),   # the agent command without the prompt
             scorer_argv=task.scorer_argv, timeout_s=..., scorer_timeout_s=...)

The executor appends the prompt as the last argument, so options of the agent go before it.

For a Harbor task directory (or a directory of them), `gyre.actors.executions.harbor` makes the TaskSpecs:
`harbor_task_spec(task, agent_argv)` for each of `load_harbor_tasks(path)`; they need an executor and an evaluator
with the bubblewrap sandbox (the `none` sandbox refuses their groups: it cannot mount the workspace at /app).
"""

from __future__ import annotations

import collections
import random
from typing import Iterator

import attrs

from gyre.messages.execution_stats import GroupRecord, TaskSourceStatistics
from gyre.messages.executions import GroupDone, StartGroup, TaskSpec
from gyre.messages.training import StepApplied
from gyre.policies.task_sampling import EpochOrder, GroupOutcome, TaskSampling, checked_weights, family_of
from gyre.runtime import Actor, handler
from gyre.runtime.validators import count, optional_count

__all__ = ["TaskSourceConfig", "TaskSource", "groups_ahead_for_staleness"]

def _tasks(instance: object, attribute: attrs.Attribute, value: tuple) -> None:
    if not isinstance(value, tuple) or not value:
        raise ValueError("tasks must be a non-empty tuple of TaskSpec")
    for task in value:
        if not isinstance(task, TaskSpec):
            raise TypeError(f"tasks must hold TaskSpec, got {type(task).__qualname__}")
    ids = [task.task_id for task in value]
    if len(set(ids)) != len(ids):
        raise ValueError("task ids must be unique")


def _sampling(instance: object, attribute: attrs.Attribute, value: object) -> None:
    if not isinstance(value, TaskSampling) or not attrs.has(type(value)):
        raise TypeError(f"sampling must be a TaskSampling attrs object, got {type(value).__qualname__}")


def groups_ahead_for_staleness(max_staleness_steps: int, groups_per_step: int) -> int:
    """`max_groups_ahead_of_training` that keeps samples at most `max_staleness_steps` versions stale."""
    if max_staleness_steps < 0 or groups_per_step < 1:
        raise ValueError("max_staleness_steps must be >= 0 and groups_per_step >= 1")
    return (max_staleness_steps + 1) * groups_per_step


@attrs.frozen
class TaskSourceConfig:
    """The tasks, how many groups run, and the staleness bound."""

    tasks: tuple[TaskSpec, ...] = attrs.field(validator=_tasks)
    """The task list (unique task ids)."""
    group_size: int = attrs.field(default=16, validator=count)
    """G: executions per group."""
    groups_in_flight: int = attrs.field(default=2, validator=count)
    """Groups running at once."""
    max_groups: int | None = attrs.field(default=None, validator=optional_count)
    """Groups to run in all; None: no end."""
    seed: int = 0
    """Seeds the task order."""
    shuffle: bool = True
    """Shuffle the tasks in each epoch (False: the list's order)."""
    executor: str = "executor"
    """Actor that runs groups."""
    groups_per_step: int = attrs.field(default=1, validator=count)
    """Groups one optimizer step trains (the micro-step claimer's setting)."""
    max_groups_ahead_of_training: int | None = attrs.field(default=None, validator=optional_count)
    """Bound on groups started and not yet trained (module docstring); None: no bound."""
    initial_weight_version: int = 0
    """Weight version before the first step."""
    first_step_id: int = 0
    """Id of the first step (the micro-step claimer's `first_step_id`)."""
    stop_topology_when_done: bool = True
    """Stop the run once `max_groups` groups are done."""
    history_size: int = attrs.field(default=1024, validator=count)
    """Group records kept (the newest)."""
    group_id_prefix: str = "g"
    """Group ids are the prefix plus a 6-digit counter."""
    sampling: TaskSampling = attrs.field(default=EpochOrder(), validator=_sampling)
    """Which task runs next (policies/task_sampling.py)."""


class TaskSource(Actor):
    """Feeds groups to the executor (module docstring)."""

    config_cls = TaskSourceConfig
    subscriptions = (StepApplied,)

    async def on_start(self) -> None:
        self.order = self._order(self.config.tasks, "")
        separator = self.config.sampling.family_separator
        families: dict[str, list[TaskSpec]] = collections.defaultdict(list)
        for task in self.config.tasks:
            families[family_of(task.task_id, separator)].append(task)
        self.family_orders = {family: self._order(tasks, family) for family, tasks in families.items()}
        self.outcomes_by_family: dict[str, collections.deque[GroupOutcome]] = {
            family: collections.deque(maxlen=self.config.history_size) for family in families
        }
        self.family_rng = random.Random(f"task_source:{self.config.seed}:families")
        self.version = self.config.initial_weight_version
        self.steps_done = 0
        self.steps_skipped = 0
        self.started = 0
        self.done = 0
        self.landed = 0
        self.dropped = 0
        self.unknown_done = 0
        self.in_flight: dict[str, tuple[str, int]] = {}  # group id -> (task id, weight version)
        self.history: collections.deque[GroupRecord] = collections.deque(maxlen=self.config.history_size)
        self.stopping = False
        self._fill()

    def _order(self, tasks: tuple[TaskSpec, ...] | list[TaskSpec], family: str) -> Iterator[TaskSpec]:
        rng = random.Random(f"task_source:{self.config.seed}" + (f":{family}" if family else ""))
        while True:
            epoch = list(tasks)
            if self.config.shuffle:
                rng.shuffle(epoch)
            yield from epoch

    def _ahead_of_training(self) -> int:
        trained = self.config.groups_per_step * self.steps_done
        return self.started - self.dropped - trained

    def _held_by_staleness(self) -> bool:
        bound = self.config.max_groups_ahead_of_training
        return bound is not None and self._ahead_of_training() >= bound

    def _fill(self) -> None:
        cfg = self.config
        while (
            len(self.in_flight) < cfg.groups_in_flight
            and (cfg.max_groups is None or self.started < cfg.max_groups)
            and not self._held_by_staleness()
        ):
            task = self._next_task()
            group_id = f"{cfg.group_id_prefix}{self.started:06d}"
            self.started += 1
            self.in_flight[group_id] = (task.task_id, self.version)
            self.log.info("group_sent", group_id=group_id, task_id=task.task_id, weight_version=self.version)
            self.tell(cfg.executor, StartGroup(group_id, task, cfg.group_size, self.version))

    def _next_task(self) -> TaskSpec:
        weights = checked_weights(self.config.sampling, self.outcomes_by_family)
        if weights is None:
            return next(self.order)
        families = sorted(weights)
        family = self.family_rng.choices(families, [weights[f] for f in families])[0]
        self.log.debug("family_drawn", family=family, weights={f: round(w, 3) for f, w in weights.items()})
        return next(self.family_orders[family])

    @handler(GroupDone)
    def on_group_done(self, msg: GroupDone) -> None:
        entry = self.in_flight.pop(msg.group_id, None)
        if entry is None:
            self.unknown_done += 1
            self.log.warning("group_done_for_unknown_group", group_id=msg.group_id)
            return
        task_id, version = entry
        self.done += 1
        if msg.landed:
            self.landed += 1
        else:
            self.dropped += 1
        family = family_of(task_id, self.config.sampling.family_separator)
        self.outcomes_by_family[family].append(GroupOutcome(msg.landed, msg.work_tokens))
        self.history.append(
            GroupRecord(
                msg.group_id, task_id, version, msg.landed, msg.mean_reward, msg.success_rate, msg.num_scored,
                msg.num_dropped,
            )
        )
        self.log.info(
            "group_done",
            group_id=msg.group_id,
            task_id=task_id,
            landed=msg.landed,
            mean_reward=round(msg.mean_reward, 4),
            success_rate=round(msg.success_rate, 4),
            done=self.done,
        )
        max_groups = self.config.max_groups
        if max_groups is not None and self.done >= max_groups and not self.in_flight:
            if self.config.stop_topology_when_done and not self.stopping:
                self.stopping = True
                self.stop_topology(f"task source: {self.done} groups done ({self.landed} landed)")
            return
        self._fill()

    @handler(StepApplied)
    def on_step_applied(self, msg: StepApplied) -> None:
        steps_done = msg.step_id + 1 - self.config.first_step_id
        if steps_done <= self.steps_done and msg.version <= self.version:
            return  # a repeat, or out of order: nothing new
        if msg.skipped and steps_done > self.steps_done:
            self.steps_skipped += 1
            self.log.warning("step_skipped", step_id=msg.step_id, version=msg.version)
        self.steps_done = max(self.steps_done, steps_done)
        self.version = max(self.version, msg.version)
        self._fill()

    def statistics(self) -> TaskSourceStatistics:
        return TaskSourceStatistics(
            groups_started=self.started,
            groups_done=self.done,
            groups_landed=self.landed,
            groups_in_flight=len(self.in_flight),
            weight_version=self.version,
            held_by_staleness=self._held_by_staleness()
            and len(self.in_flight) < self.config.groups_in_flight
            and (self.config.max_groups is None or self.started < self.config.max_groups),
            history=tuple(self.history),
        )
