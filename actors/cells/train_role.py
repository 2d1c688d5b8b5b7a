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
  optimizer step (fence -1 while it writes, see actors/cells/weight_pull.py) and publishes `StepApplied`; the broker
  announces the new weights;
- a step whose summed gradients are not finite is skipped by the trainer (weights and version unchanged). It is still
  announced, as `StepApplied(skipped=True)` with the unchanged version: the step is over and its samples are used
  up, so the claimer moves to the next step (same base version), the task source's gate counts the step (it counts
  steps, not versions) and the broker publishes nothing (no new weights). Bumping the version instead would tag
  identical weights as new and make every rollout engine reload them.
A cell can only claim micro-steps whose base version equals its weights (the claimer enforces it), so the core's
gradient buffer never mixes two steps.

Who does what: `TrainerHost`, `CoreSteps` and `ClaimLoop` never see the cell. They take explicit inputs (values,
`ClaimSettings`, the cell's compute lock, `offload`/`send`/`ask` callables, the trainer host) and return results;
the cell (actors/cells/cell.py) owns all state and sequences: it runs the claim loop, publishes each StepApplied
`CoreSteps.apply_next` returns, and decides what follows a step (its engine's weights, a checkpoint).
`StepTracker` is the core's ledger of micro-steps, with no I/O.
"""

from __future__ import annotations

import asyncio
import hashlib
from pathlib import Path
from typing import Any, Awaitable, Callable, Sequence

import attrs
import torch

from gyre.actors.cells.weight_pull import pull_weights, source_from_layout
from gyre.actors.errors import ActorError
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

__all__ = ["Ask", "ClaimLoop", "ClaimSettings", "CoreSteps", "GradientBufferError", "Offload", "Send",
           "StepProgress", "StepTracker", "TrainerHost"]

Offload = Callable[..., Awaitable[Any]]
"""Run a blocking call off the event loop: `await offload(fn, *args)` (the actor's `offload`)."""
Send = Callable[[str, Any], Awaitable[None]]
"""Send a message to an actor, waiting while its queue is full (the actor's `send`)."""
Ask = Callable[..., Awaitable[Any]]
"""Ask an actor and wait for the reply: `await ask(to, msg, timeout_s=...)` (the actor's `ask`)."""



class GradientBufferError(ActorError, ValueError):
    """A satellite's gradient buffer is not the size of this model's (another model, or a corrupt report)."""


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
        """Core: pull a satellite's flat gradients and add them to the step's. Raises TransferError,
        GradientBufferError."""
        assert self.grads_in is not None, "only the core takes gradients"
        expected = self.grads_in.numel() * self.grads_in.element_size()
        if nbytes != expected:
            raise GradientBufferError(f"gradient buffer of {nbytes} bytes from {peer}; this model's is {expected}")
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
    """The core's side of gradient exchange: take gradients in, apply complete steps in order.

    Explicit inputs, no cell: the core's trainer host, the names it talks to, the cell's compute lock, and how to
    offload blocking work and send a message. It sends what the exchange itself needs (GradientsTaken to a
    satellite, ReleaseMicroStep or the MicroStepDone itself to the claimer) and returns what the cell acts on:
    whether a micro-step counted in (then the cell applies what is complete), and each applied step's StepApplied
    (the cell publishes it and decides what follows: the engine's weights, a checkpoint).
    """

    def __init__(
        self, host: TrainerHost, *, me: str, claimer: str, checkpoint_dir: str, compute_lock: asyncio.Lock,
        offload: Offload, send: Send, log: Any,
    ) -> None:
        self.host = host
        self.me = me
        """The core's own name: a MicroStepDone from it is the core's own compute (its gradients are in already)."""
        self.claimer = claimer
        self.checkpoint_dir = checkpoint_dir
        self.compute_lock = compute_lock
        self.offload = offload
        self.send = send
        self.log = log
        self.tracker = StepTracker()
        self.steps_applied = 0
        self.steps_skipped = 0

    async def on_done(self, msg: MicroStepDone) -> bool:
        """Count a micro-step in: pull a satellite's gradients and add them, tell the claimer and the satellite.
        True when it counted (a step may be complete now); False for a duplicate or stale report, or gradients
        that could not be pulled (the micro-step then goes back to the claimer)."""
        host = self.host
        if not self.tracker.accept(msg, own=msg.cell == self.me):
            self.log.warning("microstep_done_ignored", from_cell=msg.cell, step_id=msg.step_id,
                             index=msg.microstep_index, applied_through=self.tracker.applied_through)
            if msg.grad_peer:
                await self.send(msg.cell, GradientsTaken(msg.step_id, msg.microstep_index))
            return False
        if msg.grad_peer:
            try:
                async with self.compute_lock:
                    await self.offload(host.take_grads, msg.grad_peer, msg.grad_addr, msg.grad_nbytes)
            except (ValueError, RuntimeError) as error:  # TransferError is a RuntimeError
                self.tracker.forget(msg.step_id, msg.microstep_index)
                self.log.error("gradients_lost_requeued", from_cell=msg.cell, step_id=msg.step_id,
                               index=msg.microstep_index, error=str(error))
                await self.send(self.claimer, ReleaseMicroStep(msg.cell, msg.step_id, msg.microstep_index))
                return False
        # The claimer hears first, the satellite second: a satellite that switches away after GradientsTaken then
        # announces it only after the claimer already counted its last micro-step (no needless re-queue).
        await self.send(self.claimer, msg)
        if msg.grad_peer:
            await self.send(msg.cell, GradientsTaken(msg.step_id, msg.microstep_index))
        return True

    def on_ready(self, msg: StepReady) -> bool:
        """Record a step's size. True when it is news (a step may be complete now); False for a step applied."""
        return self.tracker.on_ready(msg)

    async def apply_next(self) -> StepApplied | None:
        """Apply the lowest open step if all its micro-steps are in (steps apply in order) and return its
        StepApplied, for the cell to publish; None when no step is complete."""
        progress = self.tracker.next_complete()
        if progress is None:
            return None
        host = self.host
        async with self.compute_lock:
            result = await self.offload(host.apply_step)
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
            self.log.warning("optimizer_step_skipped", step_id=progress.step_id, grad_norm=result["grad_norm"],
                             version=applied.version)
        self.log.info("step_applied", step_id=applied.step_id, version=applied.version, loss=applied.loss,
                      grad_norm=applied.grad_norm, microsteps=len(reports), skipped=skipped)
        return applied

    async def save_checkpoint(self, version: int) -> bool:
        """The weights of `version` to `<checkpoint_dir>/v<version>`; a failure (a full disk) is logged, not raised:
        a lost checkpoint must not stop the run. Returns whether it was saved."""
        path = Path(self.checkpoint_dir) / f"v{version:05d}"
        try:
            async with self.compute_lock:  # no step changes the weights while they are copied out
                await self.offload(self.host.trainer.save_hf, path)
        except OSError as error:
            self.log.error("checkpoint_failed", path=str(path), version=version, error=str(error))
            return False
        self.log.info("checkpoint_saved", path=str(path), version=version)
        return True


@attrs.frozen
class ClaimSettings:
    """What claiming needs to know of its cell (the cell builds it from its config)."""

    cell: str
    """The claiming cell's name."""
    is_core: bool
    """The core reports to itself and its gradients stay in its trainer; a satellite sends them to `core`."""
    claimer: str
    """Actor name of the micro-step claimer."""
    core: str
    """Actor name of the core cell."""
    claim_timeout_s: float
    """How long a ClaimMicroStep waits for the claimer."""
    claim_retry_s: float
    """Pause before claiming again after a failed claim."""
    grads_taken_timeout_s: float
    """How long a satellite waits for GradientsTaken before giving its send buffer up."""
    clip_low: float
    """GSPO lower clip range."""
    clip_high: float
    """GSPO upper clip range."""
    chunk_padded_tokens: int
    """Most padded tokens per compute chunk of a micro-step."""


class ClaimLoop:
    """The body of the train role's loop: claim a micro-step, compute it, hand its gradients on (`claim_once`).
    The cell runs it over and over (a satellite first catches its trainer up) until it asks the loop to halt.

    Halting lets a micro-step whose compute started finish and report (it is one forward/backward); a grant that
    arrives after the halt was asked for is handed back with ReleaseMicroStep, untouched. A satellite's send buffer
    is reused only after the core's GradientsTaken for what it last sent.

    Explicit inputs, no cell: its settings, how to ask, send and offload, the cell's compute lock; each claim gets
    the trainer host to compute with, and on the core the StepTracker to reserve its own micro-steps in.
    """

    def __init__(
        self, settings: ClaimSettings, *, ask: Ask, send: Send, offload: Offload, compute_lock: asyncio.Lock,
        log: Any,
    ) -> None:
        self.settings = settings
        self.ask = ask
        self.send = send
        self.offload = offload
        self.compute_lock = compute_lock
        self.log = log
        self._halt = asyncio.Event()
        self.computed = 0
        self.released = 0
        self._outstanding: tuple[int, int] | None = None
        self._grads_free = asyncio.Event()
        self._grads_free.set()

    def resume(self) -> None:
        """Claim again (the cell entered the train role)."""
        self._halt.clear()

    def stop_claiming(self) -> None:
        """No new claim; a grant that comes after this goes back. The cell then waits for its loop to end."""
        self._halt.set()

    @property
    def halting(self) -> bool:
        return self._halt.is_set()

    def on_gradients_taken(self, msg: GradientsTaken) -> None:
        if self._outstanding == (msg.step_id, msg.microstep_index):
            self._outstanding = None
            self._grads_free.set()

    async def wait_grads_taken(self) -> bool:
        """Satellite: wait until the core took the last gradients sent (bounded). False on timeout."""
        try:
            await asyncio.wait_for(self._grads_free.wait(), self.settings.grads_taken_timeout_s)
            return True
        except asyncio.TimeoutError:
            return False

    async def _pause(self, seconds: float) -> None:
        try:
            await asyncio.wait_for(self._halt.wait(), max(seconds, 0.001))
        except asyncio.TimeoutError:
            pass

    async def claim_once(self, host: TrainerHost, tracker: StepTracker | None) -> None:
        """One claim with `host`'s weight version: compute what is granted and report it, hand back what cannot be
        trained, or pause when there is nothing (or the claimer does not answer)."""
        settings = self.settings
        try:
            grant: ClaimGranted = await self.ask(
                settings.claimer, ClaimMicroStep(settings.cell, host.version), timeout_s=settings.claim_timeout_s
            )
        except GyreError as error:  # claimer slow, restarting or absent: try again later
            self.log.warning("claim_failed", error=str(error))
            await self._pause(settings.claim_retry_s)
            return
        if grant.step_id < 0:
            await self._pause(grant.retry_after_s if grant.retry_after_s > 0 else settings.claim_retry_s)
            return
        if self._halt.is_set() or not grant.samples:
            self.released += 1
            if not grant.samples:
                self.log.error("empty_microstep_released", step_id=grant.step_id, index=grant.microstep_index)
            await self.send(settings.claimer, ReleaseMicroStep(settings.cell, grant.step_id, grant.microstep_index))
            return
        await self._compute_and_report(grant, host, tracker)

    async def _compute_and_report(self, grant: ClaimGranted, host: TrainerHost, tracker: StepTracker | None) -> None:
        settings = self.settings
        if tracker is not None and not tracker.reserve(grant.step_id, grant.microstep_index):
            # A satellite's gradients for it reached the core already (the claimer re-queued it in between).
            self.log.info("microstep_already_in", step_id=grant.step_id, index=grant.microstep_index)
            return
        try:
            async with self.compute_lock:
                metrics = await self.offload(host.compute, grant.samples, grant.num_executions_in_step,
                                             settings.clip_low, settings.clip_high, settings.chunk_padded_tokens)
        except ValueError as error:  # bad samples (LossInputError, TrainerError): hand it back, say loudly why
            if tracker is not None:
                tracker.unreserve(grant.step_id, grant.microstep_index)
            self.released += 1
            self.log.error("microstep_failed_released", step_id=grant.step_id, index=grant.microstep_index,
                           error=str(error))
            if not settings.is_core:
                host.trainer.zero_grads()
            await self.send(settings.claimer, ReleaseMicroStep(settings.cell, grant.step_id, grant.microstep_index))
            return
        self.computed += 1
        tokens, loss = int(metrics["num_tokens"]), float(metrics["loss"])
        # How far the trained policy is from the behaviour policy, per micro-step: a clip fraction near 1 says
        # the clip range is too tight for this staleness and learning rate (GSPO clips the sequence ratio).
        self.log.info("microstep_computed", step_id=grant.step_id, index=grant.microstep_index, tokens=tokens,
                      loss=loss, clip_fraction=round(float(metrics.get("clip_fraction", 0.0)), 4),
                      seq_log_ratio_abs_max=float(metrics.get("seq_log_ratio_abs_max", 0.0)))
        if settings.is_core:
            await self.send(settings.cell, MicroStepDone(settings.cell, grant.step_id, grant.microstep_index, "", 0, 0,
                                                         tokens, loss))
            return
        if not await self.wait_grads_taken():
            self.log.error("gradients_never_taken", outstanding=self._outstanding)
            async with self.compute_lock:
                await self.offload(host.renew_grads_out)
        async with self.compute_lock:
            addr, nbytes = await self.offload(host.export_grads)
        self._outstanding = (grant.step_id, grant.microstep_index)
        self._grads_free.clear()
        await self.send(settings.core, MicroStepDone(settings.cell, grant.step_id, grant.microstep_index,
                                                     host.agent.peer, addr, nbytes, tokens, loss))
