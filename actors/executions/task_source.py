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

(dropped groups never train, so they do not count, nor do groups the claimer announces lost in `LandingsLost`:
their landing never reached it, or died with a restarted claimer; each step uses up `groups_per_step` groups). Steps, not
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

Checkpoints (issue 28). `CheckpointAsked` gets the task source's position: its counters, the groups in flight, every
shuffled cycle of tasks (its random generator's state, the epoch's order, the place in it), the family draws'
generator and the recent outcomes the sampling policy weighs. A run resumed from a checkpoint (`resume_from`) takes
that back, sets the steps done and the weight version to the checkpoint's, and re-rolls the groups the checkpoint
names (`reroll_groups` in its manifest: those in flight here, and those whose samples had landed but were not trained
by the checkpoint's step): each runs again, before any new task, as a new group of the same task. Group ids never
repeat: after the k-th resume they end in "r<k>" (g000004r1), since the crashed run may have started groups past
the checkpoint under the plain numbers; so nothing of the old run is taken for the new one, in the run or its logs. A re-rolled group is counted once in `started`
(when it starts again) and in `groups_rerolled`; one whose task the source no longer knows is counted in
`groups_lost_on_resume` and logged.

For a Harbor task directory (or a directory of them), `gyre.actors.executions.harbor` makes the TaskSpecs:
`harbor_task_spec(task, agent_argv)` for each of `load_harbor_tasks(path)`; they need an executor and an evaluator
with the bubblewrap sandbox (the `none` sandbox refuses their groups: it cannot mount the workspace at /app).
`gyre.actors.executions.agents.task_set_specs(path, agent)` does it for either task format (Harbor directories or
SWE-bench-style instances, `swe.py`) and any agent; the main job takes it as `--tasks DIR [--agent NAME]`.
"""

from __future__ import annotations

import collections
import random

import attrs

from gyre.actors.errors import ActorError
from gyre.messages.checkpoints import CheckpointAsked, CheckpointState
from gyre.messages.execution_stats import GroupRecord, TaskSourceStatistics
from gyre.messages.executions import GroupDone, GroupOverdue, StartGroup, TaskSpec
from gyre.messages.samples import LandingsLost
from gyre.messages.scheduling import TrainingBacklog
from gyre.messages.training import StepApplied
from gyre.policies.task_sampling import EpochOrder, GroupOutcome, TaskSampling, checked_weights, family_of
from gyre.runtime import Actor, handler
from gyre.runtime.checkpoint import encode_json, read_actor_state, to_tuples
from gyre.runtime.validators import count, optional_count

__all__ = ["TaskSourceConfig", "TaskSource", "TaskSourceResumeError", "groups_ahead_for_staleness"]

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


class TaskSourceResumeError(ActorError, ValueError):
    """A checkpoint's task-source state does not fit this task source (another task list)."""


class _Cycle:
    """Tasks in epochs, each epoch shuffled from `seed_text` (or in list order), with a state a checkpoint keeps."""

    def __init__(self, tasks: tuple[TaskSpec, ...] | list[TaskSpec], seed_text: str, shuffle: bool) -> None:
        self.tasks = tuple(tasks)
        self.by_id = {task.task_id: task for task in self.tasks}
        self.rng = random.Random(seed_text)
        self.shuffle = shuffle
        self.epoch: list[TaskSpec] = []
        self.position = 0

    def next(self) -> TaskSpec:
        if self.position >= len(self.epoch):
            self.epoch = list(self.tasks)
            if self.shuffle:
                self.rng.shuffle(self.epoch)
            self.position = 0
        task = self.epoch[self.position]
        self.position += 1
        return task

    def state(self) -> dict:
        return {"rng": self.rng.getstate(), "epoch": [task.task_id for task in self.epoch], "position": self.position}

    def restore(self, state: dict) -> None:
        unknown = sorted(set(state["epoch"]) - set(self.by_id))
        if unknown or (state["epoch"] and len(state["epoch"]) != len(self.tasks)):
            raise TaskSourceResumeError(f"the checkpoint's task cycle does not fit this task list (unknown task ids "
                                        f"{unknown[:5]}, {len(state['epoch'])} tasks against {len(self.tasks)})")
        self.rng.setstate(to_tuples(state["rng"]))
        self.epoch = [self.by_id[task_id] for task_id in state["epoch"]]
        self.position = int(state["position"])


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
    group_deadline_s: float | None = None
    """A group whose GroupDone has not come this long after it started is given up: counted dropped and overdue,
    its slot freed (its StartGroup or its GroupDone was lost: a partition, a dead process); a GroupDone that comes
    later is counted unknown. None: wait for ever."""
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
    resume_from: str = ""
    """A committed checkpoint folder to continue from ("" = start afresh; module docstring, Checkpoints)."""


class TaskSource(Actor):
    """Feeds groups to the executor (module docstring)."""

    config_cls = TaskSourceConfig
    subscriptions = (StepApplied, LandingsLost, TrainingBacklog)

    async def on_start(self) -> None:
        self.order = self._order(self.config.tasks, "")
        self.tasks_by_id = {task.task_id: task for task in self.config.tasks}
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
        self.overdue = 0
        self.in_flight: dict[str, tuple[str, int]] = {}  # group id -> (task id, weight version)
        self.history: collections.deque[GroupRecord] = collections.deque(maxlen=self.config.history_size)
        self.stopping = False
        self.next_group_number = 0
        """Group ids are the prefix and this counter (and the resume count after a resume): never reused."""
        self.resumes = 0
        self.reroll_queue: collections.deque[tuple[str, str]] = collections.deque()
        """(old group id, task id) of groups to run again before any new task (module docstring, Checkpoints)."""
        self.rerolled = 0
        self.lost_on_resume = 0
        if self.config.resume_from:
            state, checkpoint = await self.offload(read_actor_state, self.config.resume_from, self.name)
            self._restore(state, checkpoint.step_id, int(checkpoint.manifest["weight_version"]),
                          tuple(checkpoint.manifest.get("reroll_groups", ())))
            self.log.info("task_source_restored", checkpoint=str(checkpoint.path), steps_done=self.steps_done,
                          weight_version=self.version, to_reroll=len(self.reroll_queue),
                          lost=self.lost_on_resume)
        self._fill()

    def _order(self, tasks: tuple[TaskSpec, ...] | list[TaskSpec], family: str) -> _Cycle:
        return _Cycle(tasks, f"task_source:{self.config.seed}" + (f":{family}" if family else ""),
                      self.config.shuffle)

    # ---- checkpoints ----------------------------------------------------------------------------------------------
    def checkpoint_state(self) -> dict:
        """The task source's position (module docstring, Checkpoints); `_restore` takes it back."""
        return {
            "next_group_number": self.next_group_number, "started": self.started, "done": self.done,
            "landed": self.landed, "dropped": self.dropped, "unknown_done": self.unknown_done,
            "steps_skipped": self.steps_skipped, "rerolled": self.rerolled, "lost_on_resume": self.lost_on_resume,
            "resumes": self.resumes,
            "in_flight": {group: [task, version] for group, (task, version) in self.in_flight.items()},
            "reroll_queue": [list(entry) for entry in self.reroll_queue],
            "history": [attrs.astuple(record) for record in self.history],
            "outcomes_by_family": {family: [[o.landed, o.work_tokens] for o in outcomes]
                                   for family, outcomes in self.outcomes_by_family.items()},
            "family_rng": self.family_rng.getstate(),
            "order": self.order.state(),
            "family_orders": {family: cycle.state() for family, cycle in self.family_orders.items()},
        }

    def groups_not_trained(self) -> tuple[str, ...]:
        """Groups whose samples cannot have been trained yet: in flight, or waiting to be re-rolled."""
        return tuple(sorted({*self.in_flight, *(group for group, _ in self.reroll_queue)}))

    def _restore(self, state: dict, step_id: int, version: int, reroll: tuple[str, ...]) -> None:
        if set(state["family_orders"]) != set(self.family_orders):
            raise TaskSourceResumeError(f"the checkpoint's task families {sorted(state['family_orders'])} are not "
                                        f"this task list's {sorted(self.family_orders)}")
        for key in ("next_group_number", "started", "done", "landed", "dropped", "unknown_done", "steps_skipped",
                    "rerolled", "lost_on_resume"):
            setattr(self, key, int(state[key]))
        self.resumes = int(state.get("resumes", 0)) + 1
        self.order.restore(state["order"])
        for family, cycle in self.family_orders.items():
            cycle.restore(state["family_orders"][family])
        self.family_rng.setstate(to_tuples(state["family_rng"]))
        for family, outcomes in state["outcomes_by_family"].items():
            self.outcomes_by_family[family].extend(GroupOutcome(bool(a), int(b)) for a, b in outcomes)
        self.history.extend(GroupRecord(*record) for record in state["history"])
        in_flight = {group: (task, int(v)) for group, (task, v) in state["in_flight"].items()}
        queued = {group: task for group, task in state["reroll_queue"]}
        done = {record.group_id: record for record in self.history}
        # Steps and version are the checkpoint's: this state may have been read a little after its step ended.
        self.steps_done = step_id + 1 - self.config.first_step_id
        self.version = version
        for group in sorted(set(reroll) | set(in_flight) | set(queued)):
            if group in in_flight:
                task, _ = in_flight.pop(group)
                self.started -= 1  # counted again when it starts anew
            elif group in queued:
                task = queued[group]  # re-rolled at an earlier resume, never started since
            elif group in done:
                record = done[group]
                task = record.task_id
                self.started -= 1
                self.done -= 1
                if record.landed:
                    self.landed -= 1
                else:
                    self.dropped -= 1
            else:
                self.lost_on_resume += 1
                self.log.error("group_to_reroll_unknown", group_id=group,
                               why=f"not in flight, queued or among the last {self.config.history_size} groups done")
                continue
            if task not in self.tasks_by_id:
                self.lost_on_resume += 1
                self.log.error("task_to_reroll_unknown", group_id=group, task_id=task)
                continue
            self.reroll_queue.append((group, task))

    @handler(CheckpointAsked)
    def on_checkpoint_asked(self, msg: CheckpointAsked) -> CheckpointState:
        return CheckpointState(self.name, msg.step_id, encode_json(self.checkpoint_state()), self.groups_not_trained())

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
            rerolls = ""
            if self.reroll_queue:
                rerolls, task_id = self.reroll_queue.popleft()
                task = self.tasks_by_id[task_id]
                self.rerolled += 1
            else:
                task = self._next_task()
            resumed = f"r{self.resumes}" if self.resumes else ""
            group_id = f"{cfg.group_id_prefix}{self.next_group_number:06d}{resumed}"
            self.next_group_number += 1
            self.started += 1
            self.in_flight[group_id] = (task.task_id, self.version)
            self.log.info("group_sent", group_id=group_id, task_id=task.task_id, weight_version=self.version,
                          **({"rerolls": rerolls} if rerolls else {}))
            self.tell(cfg.executor, StartGroup(group_id, task, cfg.group_size, self.version))
            if cfg.group_deadline_s is not None:
                self.send_later(cfg.group_deadline_s, GroupOverdue(group_id))

    def _next_task(self) -> TaskSpec:
        weights = checked_weights(self.config.sampling, self.outcomes_by_family)
        if weights is None:
            return self.order.next()
        families = sorted(weights)
        family = self.family_rng.choices(families, [weights[f] for f in families])[0]
        self.log.debug("family_drawn", family=family, weights={f: round(w, 3) for f, w in weights.items()})
        return self.family_orders[family].next()

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
        self._next()

    def _next(self) -> None:
        """After a group ended: stop the run once `max_groups` are done, else start what may start."""
        max_groups = self.config.max_groups
        if max_groups is not None and self.done >= max_groups and not self.in_flight:
            if self.config.stop_topology_when_done and not self.stopping:
                self.stopping = True
                self.stop_topology(f"task source: {self.done} groups done ({self.landed} landed)")
            return
        self._fill()

    @handler(GroupOverdue)
    def on_group_overdue(self, msg: GroupOverdue) -> None:
        if self.in_flight.pop(msg.group_id, None) is None:
            return  # done in time
        self.done += 1
        self.dropped += 1
        self.overdue += 1
        self.log.warning("group_overdue_given_up", group_id=msg.group_id, deadline_s=self.config.group_deadline_s)
        self._next()

    @handler(LandingsLost)
    def on_landings_lost(self, msg: LandingsLost) -> None:
        self.dropped += msg.groups  # they will never train: the gate must not wait for them (module docstring)
        self.log.warning("landed_groups_lost_after_landing", groups=msg.groups, samples=msg.samples, why=msg.why)
        self._catch_up(msg.step_id - self.config.first_step_id, msg.base_version)
        self._fill()

    def _catch_up(self, steps_done: int, version: int) -> None:
        """The claimer's step and weights, when they are ahead of ours (a StepApplied we missed)."""
        if steps_done > self.steps_done or version > self.version:
            self.log.warning("caught_up_from_the_claimer", steps_done=steps_done, version=version,
                             was=(self.steps_done, self.version))
            self.steps_done = max(self.steps_done, steps_done)
            self.version = max(self.version, version)

    @handler(TrainingBacklog)
    def on_backlog(self, msg: TrainingBacklog) -> None:
        """The claimer's current step says which steps are over (a StepApplied lost on its way here is caught up
        by the next backlog: the gate would otherwise wait for ever, or start groups on old weights)."""
        before = (self.steps_done, self.version)
        self._catch_up(msg.step_id - self.config.first_step_id, msg.base_version)
        if (self.steps_done, self.version) != before:
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
            groups_rerolled=self.rerolled,
            groups_lost_on_resume=self.lost_on_resume,
        )
