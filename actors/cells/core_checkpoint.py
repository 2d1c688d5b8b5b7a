"""The core's part of a run's full checkpoint (issue 28): its trainer state written after a step, read back at resume.

When: after every `every_steps`-th step the core ends (applied or skipped: either way the claimer moved to the next
step), and once more as the cell stops if the newest step is not saved yet. What: `MegatronTrainer.checkpoint_state`
(fp32 weights, AdamW moments and step counts, the version, which is also the LR schedule's position, the weight
average), one file per trainer shard, `core.tp<T>.pp<P>.pt` (data-parallel replicas hold the same state; rank 0 of
them writes). A core whose trainer is a group of processes (engines/trainer_group.py) has each rank write and, at
resume, read and check its own shard's file (`TrainerGroup.save_sharded_checkpoint`, under the compute lock so the
shards are of one moment); the digest is then one over the shards' digests. How: the state is copied under the cell's compute lock (no optimizer step runs meanwhile, and steps
apply one at a time in the cell's handler, so the copy is exactly the state after that step), then written off the
lock into the step's staging folder (gyre.runtime.checkpoint: temp file, fsync, rename), then the checkpointer is
told `CorePartsSaved` with each file's digest; it gathers the other actors' parts and commits.

At resume the cell, given the committed checkpoint's folder, loads its shard into the freshly built trainer, sets
the fence to the restored version (peers pull the restored weights as that version) and marks the steps up to the
checkpoint's as applied, before it registers with the weight broker. A satellite given the checkpoint starts its
engine only on the checkpoint's weights (`resumed_engine_weights`), pulled from the restored core. `state_digest` hashes weights and moments, so
a test (or an operator reading the log) can check that the moments after resume equal those saved.

Explicit inputs, no cell: the roots and names, the compute lock, offload and tell; the trainer host and step
tracker are passed to each call.
"""

from __future__ import annotations

import asyncio
import io
import json
from pathlib import Path
from typing import Any, Awaitable, Callable, Mapping

import torch

from gyre.actors.cells.train_role import Offload, StepTracker, TrainerHost
from gyre.actors.errors import ActorError
from gyre.engines.parallel import checkpoint_part_name
from gyre.engines.trainer import checkpoint_state_digest
from gyre.engines.trainer_group import TrainerGroup, TrainerGroupCommandError
from gyre.messages.checkpoints import CorePartsSaved
from gyre.messages.training import StepApplied
from gyre.runtime import GyreError
from gyre.runtime.checkpoint import MANIFEST, open_checkpoint, staging_dir, write_core_record, write_file_atomic

__all__ = ["CoreCheckpoints", "ResumedWeightsUnavailable", "checkpoint_weight_version", "core_part_name",
           "resumed_engine_weights", "state_digest"]

RESUMED_WEIGHTS_TIMEOUT_S = 600.0
"""How long a resumed satellite waits for the checkpoint's weights before it fails: the core restores (and registers
them) only once it has read its whole shard, minutes for a large model on a slow disk."""


class ResumedWeightsUnavailable(ActorError, RuntimeError):
    """A resumed satellite did not get the checkpoint's weights in time (the core did not restore or register)."""


def checkpoint_weight_version(resume_from: str) -> int:
    """The weight version a checkpoint holds, from its manifest alone (a satellite needs no part of it)."""
    return int(json.loads((Path(resume_from) / MANIFEST).read_text(encoding="utf-8"))["weight_version"])


async def resumed_engine_weights(
    newest: Callable[[], Awaitable[tuple[Any, int]]], first: tuple[Any, int], resume_from: str, *, retry_s: float,
    clock: Callable[[], float], timeout_s: float = RESUMED_WEIGHTS_TIMEOUT_S,
) -> tuple[Any, int]:
    """A satellite of a resumed run starts its engine on the checkpoint's weights (its version or newer), never on
    the model folder's, which would pass for version 0: the claimer would refuse every sample of them as too stale,
    and the task source would wait for ever for those groups to train. `first` is what `newest()` gave already."""
    wanted = checkpoint_weight_version(resume_from)
    weights, version = first
    deadline = clock() + timeout_s
    while version < wanted:
        if clock() > deadline:
            raise ResumedWeightsUnavailable(f"no weights of version {wanted} (the checkpoint's) within {timeout_s} s; "
                                            f"the newest offered is {version}")
        await asyncio.sleep(retry_s)
        weights, version = await newest()
    return weights, version


def core_part_name() -> str:
    """This rank's file in a checkpoint: "core.tp<T>.pp<P>.pt"; None-rank (no parallel state yet) is 0."""
    return checkpoint_part_name()


def _writes_part() -> bool:
    """Only data-parallel rank 0 writes (the replicas' states are equal)."""
    from megatron.core import parallel_state

    return not parallel_state.model_parallel_is_initialized() or parallel_state.get_data_parallel_rank() == 0


state_digest = checkpoint_state_digest
"""SHA-256 over a trainer checkpoint state's weights, its AdamW moments and step counts, and its version (a trainer
group's digest is one over its shards' digests: TrainerGroup.save_sharded_checkpoint)."""


def _encode(state: Mapping[str, Any]) -> bytes:
    buffer = io.BytesIO()
    torch.save(dict(state), buffer)
    return buffer.getvalue()


class CoreCheckpoints:
    """Saves the core's part after every `every_steps`-th step and restores it at start (module docstring)."""

    def __init__(
        self, *, root: str, every_steps: int, resume_from: str, me: str, checkpointer: str,
        compute_lock: asyncio.Lock, offload: Offload, tell: Callable[[str, Any], None], log: Any,
    ) -> None:
        self.root = root
        self.every_steps = every_steps
        self.resume_from = resume_from
        self.me = me
        self.checkpointer = checkpointer
        self.compute_lock = compute_lock
        self.offload = offload
        self.tell = tell
        self.log = log
        self.last_step_ended = -1
        """The newest step the core ended (applied or skipped)."""
        self.last_saved_step = -1
        self.saved = 0
        self.failed = 0
        self.restored_state_digest = ""
        """`state_digest` of the state restored at start ("" when the run started afresh)."""

    async def restore(self, host: TrainerHost, tracker: StepTracker) -> int:
        """Load this rank's part of `resume_from` into `host`'s trainer; returns the checkpoint's step (-1 when
        there is nothing to resume). Raises CheckpointError / TrainerError: a core that cannot restore must not
        train on as if it had."""
        if not self.resume_from:
            return -1
        checkpoint = await self.offload(open_checkpoint, self.resume_from)
        if isinstance(host.trainer, TrainerGroup):  # every rank reads and checks its own shard's file
            async with self.compute_lock:
                self.restored_state_digest = await self.offload(host.trainer.load_sharded_checkpoint,
                                                                str(checkpoint.path))
                host.fence[0] = host.trainer.version
            return self._restored(host, tracker, checkpoint)
        data = await self.offload(checkpoint.read_part, core_part_name())
        state = await self.offload(lambda: torch.load(io.BytesIO(data), weights_only=True))
        async with self.compute_lock:
            await self.offload(host.trainer.load_checkpoint_state, state)
            host.fence[0] = host.trainer.version
            await self.offload(host.sync_served)  # a host copy peers pull from (device weights) takes them too
        self.restored_state_digest = await self.offload(state_digest, state)
        return self._restored(host, tracker, checkpoint)

    def _restored(self, host: TrainerHost, tracker: StepTracker, checkpoint: Any) -> int:
        tracker.applied_through = checkpoint.step_id
        self.last_step_ended = self.last_saved_step = checkpoint.step_id
        self.log.info("core_restored", checkpoint=str(checkpoint.path), step_id=checkpoint.step_id,
                      version=host.trainer.version, state_digest=self.restored_state_digest)
        return checkpoint.step_id

    async def after_step(self, host: TrainerHost, applied: StepApplied) -> None:
        """The core ended `applied.step_id`: save its part if the step is a checkpoint step."""
        self.last_step_ended = max(self.last_step_ended, applied.step_id)
        if self.root and (applied.step_id + 1) % self.every_steps == 0:
            await self.save(host, applied.step_id)

    async def on_stop(self, host: TrainerHost) -> None:
        """The cell stops (SIGTERM, SIGINT, the run's end): save the newest step's part if it is not saved yet.
        Whether it becomes a checkpoint depends on the checkpointer still running to commit it; if not, the
        staging folder stays uncommitted and a resume uses the last committed checkpoint."""
        if self.root and self.last_step_ended > self.last_saved_step:
            await self.save(host, self.last_step_ended)

    async def save(self, host: TrainerHost, step_id: int) -> CorePartsSaved | None:
        """Copy the trainer state under the compute lock, write it off the lock, tell the checkpointer. A failure
        (a full disk) is logged and counted, not raised: a lost checkpoint must not stop the run."""
        if isinstance(host.trainer, TrainerGroup):
            return await self._save_sharded(host.trainer, step_id)
        async with self.compute_lock:
            state = await self.offload(host.trainer.checkpoint_state)
        name = core_part_name()
        try:
            if not _writes_part():
                return None
            folder = staging_dir(self.root, step_id)
            record = await self.offload(lambda: write_file_atomic(Path(folder) / name, _encode(state)))
        except OSError as error:
            self.failed += 1
            self.log.error("core_checkpoint_part_failed", step_id=step_id, error=str(error))
            return None
        digest = await self.offload(state_digest, state)
        return await self._saved(folder, CorePartsSaved(self.me, step_id, int(state["version"]), (record.name,),
                                                        (record.sha256,), (record.size_bytes,), digest))

    async def _save_sharded(self, group: TrainerGroup, step_id: int) -> CorePartsSaved | None:
        """A trainer group: every rank writes its own shard's file into the staging folder, under the compute lock
        (the ranks' states must be those of one moment; writing each shard is the copy)."""
        try:
            folder = staging_dir(self.root, step_id)
            async with self.compute_lock:
                records, digest = await self.offload(group.save_sharded_checkpoint, folder)
                version = group.version
        except (OSError, TrainerGroupCommandError) as error:
            self.failed += 1
            self.log.error("core_checkpoint_part_failed", step_id=step_id, error=str(error))
            return None
        return await self._saved(folder, CorePartsSaved(
            self.me, step_id, version, tuple(r.name for r in records), tuple(r.sha256 for r in records),
            tuple(r.size_bytes for r in records), digest))

    async def _saved(self, folder: Path, saved: CorePartsSaved) -> CorePartsSaved:
        step_id = saved.step_id
        try:
            await self.offload(write_core_record, folder, saved)  # for a checkpointer that is stopping
        except OSError as error:
            self.log.warning("core_record_not_written", step_id=step_id, error=str(error))
        self.last_saved_step = max(self.last_saved_step, step_id)
        self.saved += 1
        self.log.info("core_checkpoint_part_saved", step_id=step_id, version=saved.weight_version,
                      parts=len(saved.part_names), bytes=sum(saved.part_bytes), state_digest=saved.state_digest)
        try:
            self.tell(self.checkpointer, saved)
        except GyreError as error:  # the checkpointer stopped or is absent: the part stays uncommitted
            self.log.warning("checkpointer_not_told", step_id=step_id, error=str(error))
        return saved
