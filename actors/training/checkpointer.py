"""The checkpointer: sequences a run's full checkpoints (issue 28) and writes every part but the core's.

Sequence of one checkpoint of step s:
1. the core ends step s (applied or skipped), copies its trainer state under its compute lock, writes it into the
   staging folder of s and tells the checkpointer `CorePartsSaved` (actors/cells/core_checkpoint.py);
2. the checkpointer asks each participant, in `participants` order, `CheckpointAsked(s)`; each answers
   `CheckpointState` with its state as of s's end and the groups in it not trained by then; the checkpointer
   writes each state as the part `<actor>.json` (gyre.runtime.checkpoint.write_file_atomic);
3. it commits: the manifest goes last, with every part's digest, the core's weight version and state digest, the
   union of the groups not trained (`reroll_groups`: what a resumed run runs again) and the run's arguments
   (`ROOT/run_args.json`, which `gyre run` writes at a fresh start: the topology arguments a resume must keep);
   then the newest `keep` are kept, and `CheckpointCommitted` is published.
Any failure (a participant that does not answer or no longer holds step s, a full disk) abandons that checkpoint
(logged, counted; its staging folder is removed by a later commit) and the run goes on: the previous checkpoint
stays the resume point.

Why the order matters: the trajectory builder sends a group's SamplesLanded to the claimer before its GroupDone to
the task source, so asking the task source before the claimer means every group the task source already counts as
done is known to the claimer when the claimer answers (and named as not trained if it was not). A group finishing
in between is in flight for the task source: re-rolled either way. So `reroll_groups` never misses a group whose
samples are not in the checkpointed weights. The participants that keep nothing of their own (executor, evaluator,
proxy, scheduler, broker, migrator) are not asked: their in-flight work re-rolls with its group.

At a stop (SIGTERM, SIGINT, the run's end) the core saves the newest step's part if it is not saved yet, and leaves
its CorePartsSaved as a file beside it (gyre.runtime.checkpoint.CORE_RECORD): a stopping checkpointer no longer
takes messages. The checkpointer, stopping, waits up to `final_wait_s` for that file of the newest step that ended
(StepApplied), then asks the participants (still running: they stop after it, being lower in the topology, or in
other processes) and commits: the final checkpoint. If the core's part does not come in time, or a participant
has stopped already, nothing is committed and the last periodic checkpoint stays the resume point. The wait is
kept under the local-process launcher's 10 s stop limit; a large model's state may take longer to write, and then
only the periodic checkpoints count.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import attrs

from gyre.messages.checkpoints import (
    CheckpointAsked,
    CheckpointCommitted,
    CheckpointerStatistics,
    CheckpointState,
    CorePartsSaved,
)
from gyre.messages.training import StepApplied
from gyre.runtime import Actor, GyreError, handler
from gyre.runtime.checkpoint import (
    CORE_RECORD,
    PartRecord,
    actor_part_name,
    commit,
    file_sha256,
    read_core_record,
    staging_dir,
    write_file_atomic,
)
from gyre.runtime.validators import count, positive

__all__ = ["RUN_ARGS", "Checkpointer", "CheckpointerConfig"]

RUN_ARGS = "run_args.json"
"""The run's arguments in a checkpoint root, written by `gyre run` (runtime/cli_run.py) and copied into each
manifest as its "run" record."""


def _record_of(path: Path) -> PartRecord:
    return PartRecord(path.name, file_sha256(path), path.stat().st_size)


def _names(instance: object, attribute: attrs.Attribute, value: tuple) -> None:
    if not isinstance(value, tuple) or len(set(value)) != len(value) or not all(isinstance(v, str) and v for v in value):
        raise ValueError(f"{attribute.name} must be a tuple of distinct actor names, got {value!r}")


@attrs.frozen
class CheckpointerConfig:
    """Where checkpoints go, whom to ask, how many to keep."""

    root: str
    """The checkpoint root (step-NNNNNNNN folders)."""
    participants: tuple[str, ...] = attrs.field(
        default=("task_source", "trajectory_builder", "claimer", "monitor"), validator=_names)
    """Actors asked for their state, in this order (the task source before the claimer: module docstring)."""
    keep: int = attrs.field(default=3, validator=count)
    """Checkpoints kept (the newest); older ones are deleted after each commit."""
    ask_timeout_s: float = attrs.field(default=60.0, validator=positive)
    """How long one participant may take to answer before the checkpoint is abandoned."""
    final_wait_s: float = attrs.field(default=5.0, validator=attrs.validators.ge(0.0))
    """Stopping: how long to wait for the core's final part (module docstring); 0 takes no final checkpoint. Under
    the local-process launcher's 10 s stop limit, with room for the asks and the commit."""


class Checkpointer(Actor):
    """Gathers the parts of each checkpoint the core starts, and commits it (module docstring)."""

    config_cls = CheckpointerConfig
    subscriptions = (StepApplied,)

    async def on_start(self) -> None:
        self.committed = 0
        self.abandoned = 0
        self.last_step_id = -1
        self.last_seconds = 0.0
        self.newest_step_ended = -1
        self._one_at_a_time = asyncio.Lock()
        """A stop's final checkpoint may come while the handler still gathers the same step's parts: they would
        write into one staging folder, and the second would find it committed (renamed) under it."""

    @handler(StepApplied)
    def on_step_applied(self, msg: StepApplied) -> None:
        self.newest_step_ended = max(self.newest_step_ended, msg.step_id)

    async def on_stop(self) -> None:
        """The final checkpoint (module docstring)."""
        step = self.newest_step_ended
        if step <= self.last_step_id or self.config.final_wait_s <= 0:
            return
        folder = Path(self.config.root) / f".staging-step-{step:08d}"
        deadline = self.clock.now() + self.config.final_wait_s
        while (saved := await self.offload(read_core_record, folder)) is None:
            if self.clock.now() >= deadline:
                self.log.warning("final_checkpoint_missed", step_id=step, waited_s=self.config.final_wait_s,
                                 why="the core's part of the newest step did not come")
                return
            await asyncio.sleep(0.05)
        self.log.info("final_checkpoint", step_id=step)
        await self._checkpoint(saved)

    def _run_args(self) -> dict | None:
        path = Path(self.config.root) / RUN_ARGS
        try:
            return json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return None

    @handler(CorePartsSaved)
    async def on_core_parts_saved(self, msg: CorePartsSaved) -> None:
        await self._checkpoint(msg)

    async def _checkpoint(self, msg: CorePartsSaved) -> None:
        async with self._one_at_a_time:
            await self._checkpoint_now(msg)

    async def _checkpoint_now(self, msg: CorePartsSaved) -> None:
        started = self.clock.now()
        step = msg.step_id
        if step <= self.last_step_id:
            self.log.info("checkpoint_already_committed", step_id=step, newest=self.last_step_id)
            return
        parts = {name: PartRecord(name, sha, size)
                 for name, sha, size in zip(msg.part_names, msg.part_sha256, msg.part_bytes, strict=True)}
        reroll: set[str] = set()
        try:
            folder = staging_dir(self.config.root, step)
            if (folder / CORE_RECORD).is_file():
                record = await self.offload(_record_of, folder / CORE_RECORD)
                parts[record.name] = record
            for actor in self.config.participants:
                reply: CheckpointState = await self.ask(actor, CheckpointAsked(step),
                                                        timeout_s=self.config.ask_timeout_s)
                if reply.step_id != step:
                    raise GyreError(f"{actor} answered for step {reply.step_id}, not {step}")
                record = await self.offload(write_file_atomic, folder / actor_part_name(actor), reply.state)
                parts[record.name] = record
                reroll.update(reply.groups_not_trained)
            meta = {
                "weight_version": msg.weight_version, "core": msg.cell, "core_state_digest": msg.state_digest,
                "reroll_groups": sorted(reroll), "participants": list(self.config.participants),
                "run": await self.offload(self._run_args), "created_s": self.clock.now(),
            }
            path = await self.offload(commit, self.config.root, step, parts, meta, self.config.keep)
        except (GyreError, OSError, ValueError) as error:
            self.abandoned += 1
            self.log.error("checkpoint_abandoned", step_id=step, error=f"{type(error).__name__}: {error}")
            return
        self.committed += 1
        self.last_step_id = step
        self.last_seconds = self.clock.now() - started
        self.log.info("checkpoint_committed", step_id=step, version=msg.weight_version, path=str(path),
                      parts=len(parts), reroll_groups=len(reroll), seconds=round(self.last_seconds, 4))
        self.publish(CheckpointCommitted(step, msg.weight_version, str(path), len(parts), len(reroll),
                                         self.last_seconds))

    def statistics(self) -> CheckpointerStatistics:
        return CheckpointerStatistics(self.committed, self.abandoned, self.last_step_id, self.last_seconds)
