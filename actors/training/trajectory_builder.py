"""The trajectory builder: one token tree per execution, and a group's training samples once the group is complete.

It hears three things:
- `ModelCallCompleted` (published by the proxy): the call goes into its execution's `TrajectoryTree`;
- `GroupStarted` (published by the executor): which executions make up a group;
- `ExecutionScored` / `ExecutionDropped` (from the evaluator, or the executor for executions that never ran).
Arrival order across senders is not assumed: outcomes and calls may come before the group's announcement.

A group is complete when every announced execution is scored or dropped. Its *survivors* are the scored
executions with a usable tree (an execution that made no model call, or whose tree was refused, has nothing to
train). If the group filter policy is satisfied (`survivors >= policy.min_survivors(G)`), the samples are built
with `build_group_samples` (group-normalised advantages over the survivors' rewards, the trajectory processor per
execution) and sent to the micro-step claimer as one `SamplesLanded`; otherwise the whole group is dropped.
With `min_reward_spread` > 0 a group whose survivors' rewards all lie within that spread is dropped too (DAPO's
"dynamic sampling", Yu et al. 2025): its group-normalised advantages are all zero, so it would cost a micro-step and
move the weights only through the optimizer's momentum; dropped, it frees the step for a group that teaches. The
task source's staleness gate does not count dropped groups, so it starts another in its place.
Either way the task source hears `GroupDone`: mean reward and success rate over every scored execution (success:
reward >= `success_reward`, or the scorer's JSON detail says "success": true), the counts, and the group's work
tokens (what its calls cost the engines, refused calls included: compute spent whether or not it trains).

Calls arrive as incremental records (messages/model_calls.py): each names the earlier call it extends and carries
the ids after the shared prefix and the whole prompt's digest; the tree rebuilds the prompt from its copy of the
earlier call. A call whose rebuilt prompt does not match its digest refuses its execution (it cannot survive, so
nothing of it trains), counted as `prompt_mismatches`; a scored execution whose tree still waits for a call that
some call extends (a lost record) is refused at its group's end, counted as `incomplete_trees`.

Memory is bounded: trees of a finished group are deleted at once; live trees and tracked groups are capped (a call
beyond the cap is refused, counted and logged, and its execution cannot survive); finished group ids are
remembered (bounded) so that a call that arrives late (an agent killed mid-call) is ignored, not turned into a
tree that never ends.

Checkpoints (issue 28): the builder keeps only its counters in a checkpoint. Its trees and incomplete groups follow
the re-roll rule: they are named in `groups_not_trained` (the task source also has them in flight), and a resumed
run runs their tasks again as new groups, so nothing half-built is carried across.
"""

from __future__ import annotations

import collections
import json
from typing import Any

import attrs

from gyre.messages.checkpoints import CheckpointAsked, CheckpointState
from gyre.messages.execution_stats import BuilderStatistics
from gyre.messages.executions import GroupDone
from gyre.messages.groups import GroupStarted
from gyre.messages.model_calls import ModelCallCompleted
from gyre.messages.samples import ExecutionDropped, ExecutionScored, SamplesLanded
from gyre.policies.group_filter import FractionOfGroup, GroupFilter, survivors_needed
from gyre.policies.loss import LossInputError
from gyre.policies.trajectory_processor import (
    ProcessorConfig,
    ProcessorError,
    RankedTrajectoryProcessor,
    build_group_samples,
)
from gyre.policies.trajectory_tree import PromptMismatch, TrajectoryError, TrajectoryTree, TreeConfig
from gyre.runtime import Actor, handler
from gyre.runtime.checkpoint import encode_json, read_actor_state
from gyre.runtime.validators import count

__all__ = ["TrajectoryBuilderConfig", "TrajectoryBuilder", "scored_success", "call_work_tokens"]

def _group_filter(instance: object, attribute: attrs.Attribute, value: object) -> None:
    if not isinstance(value, GroupFilter) or not attrs.has(type(value)):
        raise TypeError(f"group_filter must be a GroupFilter attrs class (it travels in the config), got {value!r}")


@attrs.frozen
class TrajectoryBuilderConfig:
    """Whom to tell, the policies, and the bounds."""

    claimer: str = "claimer"
    """Actor that receives SamplesLanded."""
    task_source: str = "task_source"
    """Actor that receives GroupDone."""
    group_filter: Any = attrs.field(default=FractionOfGroup(), validator=_group_filter)
    """A `gyre.policies.group_filter.GroupFilter` (an attrs class): survivors a group needs to land."""
    processor: ProcessorConfig = ProcessorConfig()
    """Knobs of the trajectory processor (K trajectories per execution, trimming)."""
    tree: TreeConfig = TreeConfig()
    """Bounds of one execution's tree; an execution over them is refused and cannot survive."""
    success_reward: float = 1.0
    """A reward at or above this counts as a success (as does the scorer's "success": true)."""
    advantage_eps: float = 1e-6
    """eps of the group-normalised advantage."""
    min_reward_spread: float = attrs.field(default=0.0, validator=attrs.validators.ge(0.0))
    """A group whose survivors' rewards span no more than this is dropped (all advantages ~0); 0 keeps every group
    (a group whose rewards are all equal then trains with zero advantages)."""
    max_live_executions: int = attrs.field(default=4096, validator=count)
    """Trees held at once."""
    max_live_groups: int = attrs.field(default=1024, validator=count)
    """Groups tracked at once; a group announced beyond it is dropped at once."""
    finished_groups_remembered: int = attrs.field(default=65536, validator=count)
    """Finished group ids kept to recognise late messages."""
    resume_from: str = ""
    """A committed checkpoint folder whose counters this builder continues ("" = start afresh)."""


def scored_success(score: ExecutionScored, success_reward: float = 1.0) -> bool:
    """Whether a scored execution succeeded: reward >= success_reward, or detail is a JSON object with
    "success": true (the evaluator puts the scorer's object there)."""
    if score.reward >= success_reward:
        return True
    try:
        detail = json.loads(score.detail) if score.detail else None
    except ValueError:
        return False
    return isinstance(detail, dict) and detail.get("success") is True


def call_work_tokens(call: ModelCallCompleted) -> int:
    """What a call cost its engine, in tokens: prompt tokens not served from the prefix cache plus output tokens."""
    return max(0, call.prompt_tokens - call.cached_tokens) + len(call.output_ids)


@attrs.define(eq=False)
class _Group:
    group_id: str
    task_id: str = ""
    execution_ids: tuple[str, ...] | None = None  # None until GroupStarted
    refused: str = ""
    scores: dict[str, ExecutionScored] = attrs.field(factory=dict)
    drops: dict[str, ExecutionDropped] = attrs.field(factory=dict)


class TrajectoryBuilder(Actor):
    """Trees per execution, samples per complete group (module docstring)."""

    config_cls = TrajectoryBuilderConfig
    subscriptions = (ModelCallCompleted, GroupStarted)

    async def on_start(self) -> None:
        self.processor = RankedTrajectoryProcessor(self.config.processor)
        self.trees: dict[str, TrajectoryTree] = {}
        self.broken: collections.OrderedDict[str, str] = collections.OrderedDict()  # execution -> why refused
        self.groups: dict[str, _Group] = {}
        self.finished: collections.OrderedDict[str, None] = collections.OrderedDict()
        self.work_tokens: dict[str, int] = {}  # group -> prompt tokens not cached + output tokens of its calls
        self.counts: collections.Counter[str] = collections.Counter()
        self.landings_sent = self.landing_samples_sent = 0  # numbers landings for the claimer, afresh each start
        if self.config.resume_from:
            state, _ = await self.offload(read_actor_state, self.config.resume_from, self.name)
            self.counts.update({key: int(value) for key, value in state["counts"].items()})

    @handler(CheckpointAsked)
    def on_checkpoint_asked(self, msg: CheckpointAsked) -> CheckpointState:
        """The counters; the groups being built re-roll (module docstring)."""
        groups = {*self.groups, *(tree.group_id for tree in self.trees.values())}
        return CheckpointState(self.name, msg.step_id, encode_json({"counts": dict(self.counts)}),
                               tuple(sorted(groups)))

    # ---- calls --------------------------------------------------------------------------------------------------
    @handler(ModelCallCompleted)
    def on_call(self, call: ModelCallCompleted) -> None:
        execution = call.execution_id
        if call.group_id in self.finished:
            self.counts["late_messages"] += 1
            return
        self._count_work(call)
        if execution in self.broken:
            self.counts["messages_refused"] += 1
            return
        group = self.groups.get(call.group_id)
        if group is not None:
            if execution in group.drops:  # its tree is gone; nothing of it will train
                self.counts["late_messages"] += 1
                return
            if group.execution_ids is not None and execution not in group.execution_ids:
                self._refuse(execution, f"execution is not part of group {call.group_id}")
                return
        tree = self.trees.get(execution)
        if tree is None:
            if len(self.trees) >= self.config.max_live_executions:
                self._refuse(execution, f"more than {self.config.max_live_executions} live executions")
                return
            tree = self.trees[execution] = TrajectoryTree(execution, call.group_id, self.config.tree)
        try:
            tree.add_call(call)
        except TrajectoryError as error:
            if isinstance(error, PromptMismatch):
                self.counts["prompt_mismatches"] += 1
            del self.trees[execution]
            self._refuse(execution, str(error))
            return
        self.counts["calls_added"] += 1

    def _count_work(self, call: ModelCallCompleted) -> None:
        """Add the call's cost to its group's work tokens (bounded like the groups: past the cap, a group not yet
        counted is not counted)."""
        group = call.group_id
        if group in self.work_tokens or len(self.work_tokens) < self.config.max_live_groups:
            self.work_tokens[group] = self.work_tokens.get(group, 0) + call_work_tokens(call)

    def _refuse(self, execution: str, reason: str) -> None:
        self.counts["messages_refused"] += 1
        self.log.error("execution_tree_refused", execution_id=execution, reason=reason)
        self.broken[execution] = reason
        while len(self.broken) > self.config.max_live_executions:
            self.broken.popitem(last=False)

    # ---- groups and outcomes ------------------------------------------------------------------------------------
    @handler(GroupStarted)
    async def on_group_started(self, msg: GroupStarted) -> None:
        if msg.group_id in self.finished:
            self.counts["late_messages"] += 1
            self.log.error("group_announced_after_it_finished", group_id=msg.group_id)
            return
        group = self.groups.get(msg.group_id)
        if group is None:
            if len(self.groups) >= self.config.max_live_groups:
                group = _Group(msg.group_id, msg.task_id, msg.execution_ids)
                group.refused = f"the builder already tracks {self.config.max_live_groups} groups"
                self.log.error("group_not_tracked", group_id=msg.group_id, reason=group.refused)
                await self._finish(group)
                return
            group = self.groups[msg.group_id] = _Group(msg.group_id)
        elif group.execution_ids is not None:
            self.log.error("group_announced_twice", group_id=msg.group_id)
            return
        group.task_id, group.execution_ids, group.refused = msg.task_id, msg.execution_ids, msg.refused
        announced = set(msg.execution_ids)
        for outcomes in (group.scores, group.drops):
            for execution in [e for e in outcomes if e not in announced]:
                self.log.error("outcome_for_unknown_execution", group_id=msg.group_id, execution_id=execution)
                self.counts["messages_refused"] += 1
                del outcomes[execution]
        await self._maybe_complete(group)

    @handler(ExecutionScored)
    async def on_scored(self, msg: ExecutionScored) -> None:
        self.counts["executions_scored"] += 1
        group = self._group_for_outcome(msg.group_id, msg.execution_id)
        if group is not None:
            group.scores[msg.execution_id] = msg
            await self._maybe_complete(group)

    @handler(ExecutionDropped)
    async def on_dropped(self, msg: ExecutionDropped) -> None:
        self.counts["executions_dropped"] += 1
        group = self._group_for_outcome(msg.group_id, msg.execution_id)
        if group is not None:
            group.drops[msg.execution_id] = msg
            self.trees.pop(msg.execution_id, None)
            await self._maybe_complete(group)

    def _group_for_outcome(self, group_id: str, execution: str) -> _Group | None:
        if group_id in self.finished:
            self.counts["late_messages"] += 1
            self.log.warning("outcome_after_group_finished", group_id=group_id, execution_id=execution)
            return None
        group = self.groups.get(group_id)
        if group is None:
            if len(self.groups) >= self.config.max_live_groups:
                self.counts["messages_refused"] += 1
                self.log.error("outcome_for_untracked_group", group_id=group_id, execution_id=execution)
                return None
            group = self.groups[group_id] = _Group(group_id)
        if group.execution_ids is not None and execution not in group.execution_ids:
            self.counts["messages_refused"] += 1
            self.log.error("outcome_for_unknown_execution", group_id=group_id, execution_id=execution)
            return None
        if execution in group.scores or execution in group.drops:
            self.counts["messages_refused"] += 1
            self.log.error("second_outcome_ignored", group_id=group_id, execution_id=execution)
            return None
        return group

    async def _maybe_complete(self, group: _Group) -> None:
        ids = group.execution_ids
        if ids is None:
            return
        if not group.refused and any(e not in group.scores and e not in group.drops for e in ids):
            return
        await self._finish(group)

    async def _finish(self, group: _Group) -> None:
        """Land or drop a complete (or refused) group, forget its trees, and tell the task source."""
        ids = group.execution_ids or ()
        scores = [group.scores[e] for e in ids if e in group.scores]
        for score in scores:
            tree = self.trees.get(score.execution_id)
            if tree is not None and tree.pending_calls:
                # A call names an earlier call that never came (a lost record): its prompt is unknown.
                self.counts["incomplete_trees"] += 1
                del self.trees[score.execution_id]
                self._refuse(score.execution_id, f"{tree.pending_calls} calls extend calls that never arrived")
        survivors = [s for s in scores if s.execution_id in self.trees]
        landing: SamplesLanded | None = None
        if group.refused:
            why = f"refused: {group.refused}"
        elif not survivors:
            why = f"no survivors of {len(ids)}"
        else:
            needed = survivors_needed(self.config.group_filter, len(ids))
            why = f"{len(survivors)} of {len(ids)} executions survived, {needed} needed"
            spread = max(s.reward for s in survivors) - min(s.reward for s in survivors)
            if len(survivors) >= needed and self.config.min_reward_spread > 0 and (
                spread <= self.config.min_reward_spread
            ):
                why = f"reward spread {spread:g} <= {self.config.min_reward_spread:g}: nothing to learn"
            elif len(survivors) >= needed:
                trees = {s.execution_id: self.trees[s.execution_id] for s in survivors}
                try:
                    num_dropped = len(ids) - len(survivors)
                    landing = await self.offload(self._build, group.group_id, trees, survivors, num_dropped)
                except (ProcessorError, LossInputError) as error:
                    why = f"samples could not be built: {error}"
                if landing is not None and not landing.samples:
                    landing, why = None, "no policy-emitted token to train"
        self.groups.pop(group.group_id, None)
        self.finished[group.group_id] = None
        while len(self.finished) > self.config.finished_groups_remembered:
            self.finished.popitem(last=False)
        for execution in ids:
            self.trees.pop(execution, None)
            self.broken.pop(execution, None)
        # Calls that named this group for an execution it never announced made trees nobody will finish.
        for execution in [e for e, tree in self.trees.items() if tree.group_id == group.group_id]:
            self.log.error("tree_of_unannounced_execution_dropped", group_id=group.group_id, execution_id=execution)
            del self.trees[execution]
        if landing is not None:
            self.counts["groups_landed"] += 1
            self.counts["samples_landed"] += len(landing.samples)
            self.counts["tokens_landed"] += landing.num_tokens
            self.log.info(
                "group_landed",
                group_id=group.group_id,
                executions=len(landing.execution_ids),
                samples=len(landing.samples),
                tokens=landing.num_tokens,
                loss_tokens=landing.num_loss_tokens,
            )
            self.landings_sent += 1
            self.landing_samples_sent += len(landing.samples)
            landing = attrs.evolve(landing, landing_seq=self.landings_sent, samples_sent=self.landing_samples_sent)
            await self.send(self.config.claimer, landing)
        else:
            self.counts["groups_dropped"] += 1
            self.log.warning("group_dropped", group_id=group.group_id, reason=why)
        rewards = [s.reward for s in scores]
        successes = [scored_success(s, self.config.success_reward) for s in scores]
        done = GroupDone(
            group_id=group.group_id,
            landed=landing is not None,
            mean_reward=sum(rewards) / len(rewards) if rewards else 0.0,
            success_rate=sum(successes) / len(successes) if successes else 0.0,
            num_scored=len(scores),
            num_dropped=len(group.drops),
            work_tokens=self.work_tokens.pop(group.group_id, 0),
        )
        await self.send(self.config.task_source, done)
        self.publish(done)  # for observers (progress, reports); the task source gets its own copy above

    def _build(
        self, group_id: str, trees: dict[str, TrajectoryTree], survivors: list[ExecutionScored], num_dropped: int
    ) -> SamplesLanded:
        return build_group_samples(
            group_id, trees, survivors, self.processor, num_dropped=num_dropped, eps=self.config.advantage_eps
        )

    def statistics(self) -> BuilderStatistics:
        c = self.counts
        return BuilderStatistics(
            groups_landed=c["groups_landed"],
            groups_dropped=c["groups_dropped"],
            executions_scored=c["executions_scored"],
            executions_dropped=c["executions_dropped"],
            calls_added=c["calls_added"],
            messages_refused=c["messages_refused"],
            late_messages=c["late_messages"],
            live_trees=len(self.trees),
            live_groups=len(self.groups),
            samples_landed=c["samples_landed"],
            tokens_landed=c["tokens_landed"],
            prompt_mismatches=c["prompt_mismatches"],
            incomplete_trees=c["incomplete_trees"],
        )
