"""The train role of a cell: its trainer and shared buffers, the claim loop, and the core's step bookkeeping.

Gradient exchange, end to end:
- every train-role cell runs a claim loop: ClaimMicroStep -> forward/backward on the granted samples (the loss
  normalised by the whole step's execution count, so summed micro-steps give the step's mean) -> report;
- the core's own gradients accumulate straight into its trainer and it reports `MicroStepDone(grad_peer="")` to
  itself; a satellite copies its gradients into a registered send buffer, zeroes its trainer and tells the core
  `MicroStepDone` with the buffer's descriptor; it reuses the buffer only after the core's `GradientsTaken`, and
  meanwhile already computes the next micro-step;
- the core pulls a satellite's gradients through Mooncake and adds them, and only then forwards the
  `MicroStepDone` to the claimer (and frees the satellite's buffer with GradientsTaken). So the claimer counts a
  micro-step done exactly when its gradients are in the core: if the pull fails (the satellite died or switched
  away) the core hands the micro-step back with `ReleaseMicroStep` and it is trained again elsewhere;
- the core adds each (step, micro-step) once: a second copy (the claimer re-queued a micro-step whose gradients
  were on their way) is dropped, and a micro-step the core computes itself is reserved before its compute starts,
  because its gradients land in the trainer as they are computed and could not be taken out again;
- when the claimer's `StepReady` has fixed the step's size and all its micro-steps are in, the core runs the
  optimizer step (fence -1 while it writes, see actors/cells/weight_broker.py) and publishes `StepApplied`; the broker
  announces the new weights;
- a step whose summed gradients are not finite is skipped by the trainer (weights and version unchanged). It is still
  announced, as `StepApplied(skipped=True)` with the unchanged version: the step is over and its samples are used
  up, so the claimer moves to the next step (same base version), the task source's gate counts the step (it counts
  steps, not versions) and the broker publishes nothing (no new weights). Bumping the version instead would tag
  identical weights as new and make every rollout engine reload them.
A cell can only claim micro-steps whose base version equals its weights (the claimer enforces it), so the core's
gradient buffer never mixes two steps.
"""

from __future__ import annotations

import asyncio
import hashlib
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import attrs
import torch

from gyre.actors.cells.weight_broker import pull_weights, source_from_layout
from gyre.engines.trainer import MegatronTrainer, TrainerConfig
from gyre.messages.cell_internal import WeightSource
from gyre.messages.samples import TrainingSample
from gyre.messages.training import (
    ClaimGranted,
    ClaimMicroStep,
    GradientsTaken,
    MicroStepDone,
    ReleaseMicroStep,
    StepApplied,
    StepReady,
)
from gyre.policies.loss import (
    PackedBatch,
    combine_chunk_metrics,
    length_sorted_chunks,
    loss_from_samples,
    pack_samples,
)
from gyre.runtime import GyreError

if TYPE_CHECKING:
    from gyre.actors.cells.cell import Cell

__all__ = ["ClaimLoop", "CoreSteps", "StepProgress", "StepTracker", "TrainerHost"]


class TrainerHost:
    """A MegatronTrainer plus the memory it shares through the cell's transfer agent.

    Registered: the live flat parameter buffer (the core serves pulls from it; a satellite pulls into it), on the
    core the fence and a gradient receive buffer, on a satellite a gradient send buffer. Every method blocks: the
    cell calls them off the event loop, one at a time (under its compute lock).
    """

    def __init__(self, trainer: MegatronTrainer, agent: Any, is_core: bool, fence_scratch: torch.Tensor) -> None:
        self.trainer = trainer
        self.agent = agent
        self.is_core = is_core
        self.fence_scratch = fence_scratch
        self.params = trainer.param_buffer()
        self._registered: list[torch.Tensor] = []
        self._register(self.params)
        numel = self.params.numel()
        self.fence = torch.full((1,), trainer.version, dtype=torch.int64)
        self.grads_in = torch.zeros(numel, dtype=torch.float32) if is_core else None
        self.grads_out = None if is_core else torch.zeros(numel, dtype=torch.float32)
        for buffer in (self.fence if is_core else None, self.grads_in, self.grads_out):
            if buffer is not None:
                self._register(buffer)

    @classmethod
    def build(
        cls, model_dir: str, config: TrainerConfig, agent: Any, is_core: bool, fence_scratch: torch.Tensor
    ) -> TrainerHost:
        return cls(MegatronTrainer(model_dir, config), agent, is_core, fence_scratch)

    def _register(self, buffer: torch.Tensor) -> None:
        self.agent.register_tensor(buffer)
        self._registered.append(buffer)

    @property
    def version(self) -> int:
        return self.trainer.version

    # ---- compute ------------------------------------------------------------------------------------------

    def compute(
        self, samples: Sequence[TrainingSample], num_executions: int, clip_low: float, clip_high: float,
        chunk_padded_tokens: int,
    ) -> dict[str, Any]:
        """Forward/backward of one micro-step, in length-sorted chunks (policies.loss.length_sorted_chunks) so that
        little compute goes into padding; gradients accumulate into the trainer. Returns the micro-step's metrics."""
        parts = []
        for chunk in length_sorted_chunks(samples, chunk_padded_tokens):
            batch = pack_samples(chunk)

            def loss_fn(logprobs: torch.Tensor, batch: PackedBatch = batch):
                return loss_from_samples(logprobs, batch, num_executions=num_executions, clip_low=clip_low,
                                         clip_high=clip_high)

            parts.append(self.trainer.forward_backward(batch.input_ids, batch.lengths, loss_fn, batch.temperatures))
        return combine_chunk_metrics(parts)

    # ---- gradients ----------------------------------------------------------------------------------------

    def export_grads(self) -> tuple[int, int]:
        """Satellite: move the accumulated gradients into the send buffer and zero the trainer's.
        Returns the buffer's (addr, nbytes). The caller must know the previous contents were taken."""
        assert self.grads_out is not None, "only a satellite exports gradients"
        self.grads_out.copy_(self.trainer.grads_to_flat())
        self.trainer.zero_grads()
        return int(self.grads_out.data_ptr()), self.grads_out.numel() * self.grads_out.element_size()

    def renew_grads_out(self) -> None:
        """Satellite: give up the send buffer (its reader never confirmed) and register a fresh one, so that a late
        reader fails loudly instead of reading new gradients as old ones."""
        assert self.grads_out is not None
        self.agent.unregister_tensor(self.grads_out)
        self._registered.remove(self.grads_out)
        self.grads_out = torch.zeros_like(self.grads_out)
        self._register(self.grads_out)

    def take_grads(self, peer: str, addr: int, nbytes: int) -> int:
        """Core: pull a satellite's flat gradients and add them to the step's. Raises TransferError, ValueError."""
        assert self.grads_in is not None, "only the core takes gradients"
        expected = self.grads_in.numel() * self.grads_in.element_size()
        if nbytes != expected:
            raise ValueError(f"gradient buffer of {nbytes} bytes from {peer}; this model's is {expected}")
        moved = self.agent.pull_tensor(peer, addr, self.grads_in)
        self.trainer.add_flat_grads(self.grads_in)
        return moved

    def apply_step(self) -> dict[str, Any]:
        """Core: the optimizer step, with the fence showing -1 while the parameters change."""
        self.fence[0] = -1
        try:
            return self.trainer.optimizer_step()
        finally:
            self.fence[0] = self.trainer.version

    # ---- weights ------------------------------------------------------------------------------------------

    def source(self, cell: str) -> WeightSource:
        """Core: where peers pull these weights from."""
        return source_from_layout(cell, self.version, self.agent.peer, self.params, self.fence,
                                  self.trainer.param_layout())

    def pull(self, source: WeightSource) -> int:
        """Satellite: pull `source` straight into the live parameter buffer. The version reads -1 until the pull
        succeeds, so a failed or torn pull never passes for a real version. Raises StaleWeights, TransferError."""
        self.trainer.version = -1
        moved = pull_weights(self.agent, source, self.params, self.fence_scratch)
        self.trainer.version = source.version
        return moved

    def digest(self) -> str:
        return hashlib.sha256(self.params.numpy().tobytes()).hexdigest()

    def close(self) -> None:
        """Unregister every buffer (peers' transfers into them fail from now on)."""
        for buffer in self._registered:
            self.agent.unregister_tensor(buffer)
        self._registered.clear()


@attrs.define
class StepProgress:
    """What the core knows of one optimizer step."""

    step_id: int
    ready: StepReady | None = None
    """The claimer's StepReady (the step's size), once it came."""
    done: dict[int, MicroStepDone] = attrs.field(factory=dict)
    """Micro-step index -> its report, for micro-steps whose gradients are in."""
    reserved: set[int] = attrs.field(factory=set)
    """Micro-steps the core is computing itself: their gradients land in its trainer as they are computed, so a
    satellite's copy of the same micro-step (the claimer re-queued it) must not be added too."""

    @property
    def complete(self) -> bool:
        return self.ready is not None and len(self.done) >= self.ready.num_microsteps


class StepTracker:
    """The core's count of micro-steps per step: which are in, and which step can be applied next (in order)."""

    def __init__(self, max_open_steps: int = 64) -> None:
        self.max_open_steps = max_open_steps
        self.open: dict[int, StepProgress] = {}
        self.applied_through = -1
        """Highest step id applied."""

    def _progress(self, step_id: int) -> StepProgress | None:
        if step_id <= self.applied_through:
            return None
        progress = self.open.get(step_id)
        if progress is None:
            if len(self.open) >= self.max_open_steps:
                raise ValueError(f"{len(self.open)} steps open at once (max {self.max_open_steps})")
            progress = self.open[step_id] = StepProgress(step_id)
        return progress

    def on_ready(self, msg: StepReady) -> bool:
        """Record a step's size. False for a step already applied."""
        progress = self._progress(msg.step_id)
        if progress is None:
            return False
        progress.ready = msg
        return True

    def _fits(self, progress: StepProgress | None, index: int) -> bool:
        if progress is None or index < 0 or index in progress.done:
            return False
        return progress.ready is None or index < progress.ready.num_microsteps

    def reserve(self, step_id: int, microstep_index: int) -> bool:
        """The core is about to compute this micro-step itself. False when its gradients are already in (or it is
        reserved, applied, outside the step): the core must then not compute it."""
        progress = self._progress(step_id)
        if not self._fits(progress, microstep_index) or microstep_index in progress.reserved:
            return False
        progress.reserved.add(microstep_index)
        return True

    def unreserve(self, step_id: int, microstep_index: int) -> None:
        progress = self.open.get(step_id)
        if progress is not None:
            progress.reserved.discard(microstep_index)

    def accept(self, msg: MicroStepDone, own: bool = False) -> bool:
        """Count a micro-step in (`own`: the core computed it). False (nothing recorded) for an applied step, a
        duplicate, an index outside the step, or another cell's copy of a micro-step the core computes itself."""
        progress = self._progress(msg.step_id)
        if not self._fits(progress, msg.microstep_index):
            return False
        if msg.microstep_index in progress.reserved:
            if not own:
                return False
            progress.reserved.discard(msg.microstep_index)
        progress.done[msg.microstep_index] = msg
        return True

    def forget(self, step_id: int, microstep_index: int) -> None:
        """Undo `accept` (the gradients never arrived)."""
        progress = self.open.get(step_id)
        if progress is not None:
            progress.done.pop(microstep_index, None)

    def next_complete(self) -> StepProgress | None:
        """The lowest open step, if all its micro-steps are in (steps apply in order)."""
        if not self.open:
            return None
        progress = self.open[min(self.open)]
        return progress if progress.complete else None

    def mark_applied(self, step_id: int) -> None:
        self.open.pop(step_id, None)
        self.applied_through = max(self.applied_through, step_id)


class CoreSteps:
    """The core's side of gradient exchange: take gradients in, apply complete steps, announce them."""

    def __init__(self, cell: Cell) -> None:
        self.cell = cell
        self.tracker = StepTracker()
        self.steps_applied = 0
        self.steps_skipped = 0

    async def on_done(self, msg: MicroStepDone) -> None:
        cell, config = self.cell, self.cell.config
        host = cell.training
        assert host is not None
        if not self.tracker.accept(msg, own=msg.cell == cell.name):
            cell.log.warning("microstep_done_ignored", from_cell=msg.cell, step_id=msg.step_id,
                             index=msg.microstep_index, applied_through=self.tracker.applied_through)
            if msg.grad_peer:
                await cell.send(msg.cell, GradientsTaken(msg.step_id, msg.microstep_index))
            return
        if msg.grad_peer:
            try:
                async with cell.compute_lock:
                    await cell.offload(host.take_grads, msg.grad_peer, msg.grad_addr, msg.grad_nbytes)
            except (ValueError, RuntimeError) as error:  # TransferError is a RuntimeError
                self.tracker.forget(msg.step_id, msg.microstep_index)
                cell.log.error("gradients_lost_requeued", from_cell=msg.cell, step_id=msg.step_id,
                               index=msg.microstep_index, error=str(error))
                await cell.send(config.claimer, ReleaseMicroStep(msg.cell, msg.step_id, msg.microstep_index))
                return
        # The claimer hears first, the satellite second: a satellite that switches away after GradientsTaken then
        # announces it only after the claimer already counted its last micro-step (no needless re-queue).
        await cell.send(config.claimer, msg)
        if msg.grad_peer:
            await cell.send(msg.cell, GradientsTaken(msg.step_id, msg.microstep_index))
        await self.apply_ready()

    async def on_ready(self, msg: StepReady) -> None:
        if self.tracker.on_ready(msg):
            await self.apply_ready()

    async def apply_ready(self) -> None:
        cell = self.cell
        host = cell.training
        assert host is not None
        while (progress := self.tracker.next_complete()) is not None:
            async with cell.compute_lock:
                result = await cell.offload(host.apply_step)
            self.tracker.mark_applied(progress.step_id)
            self.steps_applied += 1
            skipped = bool(result.get("skipped"))
            reports = list(progress.done.values())
            ready = progress.ready
            assert ready is not None
            applied = StepApplied(
                step_id=progress.step_id,
                version=host.version,
                loss=sum(r.loss for r in reports) / max(1, len(reports)),
                grad_norm=float(result["grad_norm"]),
                num_tokens=sum(r.num_tokens for r in reports),
                num_samples=ready.num_samples,
                stale_samples_dropped=0,  # the claimer refuses stale samples; the core never sees them
                skipped=skipped,
            )
            if skipped:
                self.steps_skipped += 1
                cell.log.warning("optimizer_step_skipped", step_id=progress.step_id, grad_norm=result["grad_norm"],
                                 version=applied.version)
            cell.log.info("step_applied", step_id=applied.step_id, version=applied.version, loss=applied.loss,
                          grad_norm=applied.grad_norm, microsteps=len(reports), skipped=skipped)
            cell.publish(applied)
            if not skipped:
                cell.on_core_weights_changed()
                if cell.config.checkpoint_dir and applied.version % cell.config.checkpoint_every_steps == 0:
                    await self.save_checkpoint(applied.version)

    async def save_checkpoint(self, version: int) -> None:
        """The weights of `version` to `<checkpoint_dir>/v<version>`; a failure (a full disk) is logged, not raised:
        a lost checkpoint must not stop the run."""
        cell = self.cell
        host = cell.training
        assert host is not None
        path = Path(cell.config.checkpoint_dir) / f"v{version:05d}"
        try:
            async with cell.compute_lock:  # no step changes the weights while they are copied out
                await cell.offload(host.trainer.save_hf, path)
        except OSError as error:
            cell.log.error("checkpoint_failed", path=str(path), version=version, error=str(error))
            return
        cell.log.info("checkpoint_saved", path=str(path), version=version)


class ClaimLoop:
    """The train role's loop: claim a micro-step, compute it, hand its gradients on; until told to halt.

    Halting lets a micro-step whose compute started finish and report (it is one forward/backward); a grant that
    arrives after the halt was asked for is handed back with ReleaseMicroStep, untouched.
    """

    def __init__(self, cell: Cell) -> None:
        self.cell = cell
        self._halt = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.computed = 0
        self.released = 0
        self._outstanding: tuple[int, int] | None = None
        self._grads_free = asyncio.Event()
        self._grads_free.set()

    def start(self) -> None:
        assert self._task is None or self._task.done(), "the claim loop is running"
        self._halt.clear()
        self._task = self.cell.spawn(self.cell.guarded(self._run()), name=f"{self.cell.name}.claims")

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    async def halt(self) -> None:
        """Stop claiming and wait for the loop to end (a micro-step in compute finishes and reports first)."""
        self._halt.set()
        if self._task is not None:
            await asyncio.shield(self._task)

    def on_gradients_taken(self, msg: GradientsTaken) -> None:
        if self._outstanding == (msg.step_id, msg.microstep_index):
            self._outstanding = None
            self._grads_free.set()

    async def wait_grads_taken(self) -> bool:
        """Satellite: wait until the core took the last gradients sent (bounded). False on timeout."""
        try:
            await asyncio.wait_for(self._grads_free.wait(), self.cell.config.grads_taken_timeout_s)
            return True
        except asyncio.TimeoutError:
            return False

    async def _pause(self, seconds: float) -> None:
        try:
            await asyncio.wait_for(self._halt.wait(), max(seconds, 0.001))
        except asyncio.TimeoutError:
            pass

    async def _run(self) -> None:
        cell, config = self.cell, self.cell.config
        while not self._halt.is_set():
            if not config.is_core:
                await cell.catch_up_trainer()
            host = cell.training
            assert host is not None
            try:
                grant: ClaimGranted = await cell.ask(
                    config.claimer, ClaimMicroStep(cell.name, host.version), timeout_s=config.claim_timeout_s
                )
            except GyreError as error:  # claimer slow, restarting or absent: try again later
                cell.log.warning("claim_failed", error=str(error))
                await self._pause(config.claim_retry_s)
                continue
            if grant.step_id < 0:
                await self._pause(grant.retry_after_s if grant.retry_after_s > 0 else config.claim_retry_s)
                continue
            if self._halt.is_set() or not grant.samples:
                self.released += 1
                if not grant.samples:
                    cell.log.error("empty_microstep_released", step_id=grant.step_id, index=grant.microstep_index)
                await cell.send(config.claimer, ReleaseMicroStep(cell.name, grant.step_id, grant.microstep_index))
                continue
            await self._compute_and_report(grant)

    async def _compute_and_report(self, grant: ClaimGranted) -> None:
        cell, config = self.cell, self.cell.config
        host = cell.training
        assert host is not None
        core_steps = cell.core_steps
        if core_steps is not None and not core_steps.tracker.reserve(grant.step_id, grant.microstep_index):
            # A satellite's gradients for it reached the core already (the claimer re-queued it in between).
            cell.log.info("microstep_already_in", step_id=grant.step_id, index=grant.microstep_index)
            return
        try:
            async with cell.compute_lock:
                metrics = await cell.offload(host.compute, grant.samples, grant.num_executions_in_step,
                                             config.clip_low, config.clip_high, config.train_chunk_padded_tokens)
        except ValueError as error:  # bad samples (LossInputError, TrainerError): hand it back, say loudly why
            if core_steps is not None:
                core_steps.tracker.unreserve(grant.step_id, grant.microstep_index)
            self.released += 1
            cell.log.error("microstep_failed_released", step_id=grant.step_id, index=grant.microstep_index,
                           error=str(error))
            if not config.is_core:
                host.trainer.zero_grads()
            await cell.send(config.claimer, ReleaseMicroStep(cell.name, grant.step_id, grant.microstep_index))
            return
        self.computed += 1
        tokens, loss = int(metrics["num_tokens"]), float(metrics["loss"])
        # How far the trained policy is from the behaviour policy, per micro-step: a clip fraction near 1 says
        # the clip range is too tight for this staleness and learning rate (GSPO clips the sequence ratio).
        cell.log.info("microstep_computed", step_id=grant.step_id, index=grant.microstep_index, tokens=tokens,
                      loss=loss, clip_fraction=round(float(metrics.get("clip_fraction", 0.0)), 4),
                      seq_log_ratio_abs_max=float(metrics.get("seq_log_ratio_abs_max", 0.0)))
        if config.is_core:
            await cell.send(cell.name, MicroStepDone(cell.name, grant.step_id, grant.microstep_index, "", 0, 0, tokens,
                                                     loss))
            return
        if not await self.wait_grads_taken():
            cell.log.error("gradients_never_taken", outstanding=self._outstanding)
            async with cell.compute_lock:
                await cell.offload(host.renew_grads_out)
        async with cell.compute_lock:
            addr, nbytes = await cell.offload(host.export_grads)
        self._outstanding = (grant.step_id, grant.microstep_index)
        self._grads_free.clear()
        await cell.send(config.core, MicroStepDone(cell.name, grant.step_id, grant.microstep_index, host.agent.peer,
                                                   addr, nbytes, tokens, loss))
