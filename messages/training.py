"""Streaming training: micro-steps claimed by train-role cells, gradients to the core, steps and weights."""

from __future__ import annotations

from gyre.messages._define import message
from gyre.messages.samples import TrainingSample


@message("gyre.training.ClaimMicroStep")
class ClaimMicroStep:
    """Train-role cell -> micro-step claimer (ask): give me work."""

    cell: str
    """The claiming cell."""
    weight_version: int
    """Weights the cell trains with (must equal the step's base version)."""


@message("gyre.training.ClaimGranted")
class ClaimGranted:
    """Claimer's reply: one micro-step, or nothing (step_id -1) with a hint when to ask again."""

    step_id: int
    """Optimizer step this micro-step belongs to (-1: no work now)."""
    microstep_index: int
    """Index of the micro-step within its step."""
    samples: tuple[TrainingSample, ...]
    """The samples to compute gradients on."""
    num_executions_in_step: int
    """Executions in the whole step (the loss normaliser: every execution weighs the same)."""
    retry_after_s: float
    """With no work: when to ask again."""


@message("gyre.training.ClaimsOpen")
class ClaimsOpen:
    """Claimer -> a train-role cell whose last claim found no work: a claim would find some now (claim at once)."""

    step_id: int
    """The claimer's current step."""


@message("gyre.training.MicroStepDone")
class MicroStepDone:
    """Cell -> claimer and core: gradients of a micro-step are ready in the cell's registered buffer."""

    cell: str
    """Cell that computed it."""
    step_id: int
    """Its step."""
    microstep_index: int
    """Its index."""
    grad_peer: str
    """Mooncake peer ("host:port") holding the flat fp32 gradient buffer; "" when the core computed it itself."""
    grad_addr: int
    """Address of the buffer in that peer."""
    grad_nbytes: int
    """Size of the buffer."""
    num_tokens: int
    """Tokens forwarded."""
    loss: float
    """Loss of this micro-step (for metrics)."""


@message("gyre.training.GradientsTaken")
class GradientsTaken:
    """Core -> cell: it has pulled (or reduced) the gradients of this micro-step; the buffer may be reused."""

    step_id: int
    """Step."""
    microstep_index: int
    """Micro-step."""


@message("gyre.training.ReleaseMicroStep")
class ReleaseMicroStep:
    """Cell -> claimer: hand a claimed micro-step back unfinished (the cell switches away); it is re-queued."""

    cell: str
    """Cell that held it."""
    step_id: int
    """Step."""
    microstep_index: int
    """Micro-step."""


@message("gyre.training.StepReady")
class StepReady:
    """Claimer -> everyone: a step's micro-steps are all queued (its samples are fixed)."""

    step_id: int
    """Step."""
    num_microsteps: int
    """Micro-steps in the step."""
    num_samples: int
    """Samples in the step."""
    num_executions: int
    """Executions in the step."""
    base_version: int
    """Weights the step's gradients must be computed with."""


@message("gyre.training.StepApplied", version=2)
class StepApplied:
    """Core -> everyone: the step's micro-steps are all in and the step is over. Normally the optimizer step ran and
    a new weight version exists; a step whose gradients were not finite is `skipped`: the weights and their version
    stay as they were, but the step still counts (its samples are used up, counted as skipped, not trained)."""

    step_id: int
    """Step."""
    version: int
    """New weight version."""
    loss: float
    """Mean micro-step loss."""
    grad_norm: float
    """Gradient norm before clipping."""
    num_tokens: int
    """Tokens trained in the step."""
    num_samples: int
    """Samples trained in the step."""
    stale_samples_dropped: int
    """Samples of the step that the core refused as too stale (0 from Gyre's cells: the claimer refuses stale samples
    before a micro-step forms and announces them in LandingsLost, why "stale", which the run monitor counts)."""
    skipped: bool = False
    """The gradients were not finite: no update was applied and `version` is the unchanged one."""


@message("gyre.training.WeightsPublished")
class WeightsPublished:
    """Weight broker -> everyone: version `version` can be pulled from `peer` at `addr`."""

    version: int
    """Weight version."""
    peer: str
    """Mooncake peer holding the flat fp32 parameter buffer."""
    addr: int
    """Buffer address there."""
    nbytes: int
    """Buffer size."""


@message("gyre.training.WeightsLoaded")
class WeightsLoaded:
    """Cell -> weight broker: it now serves or trains with `version`."""

    cell: str
    """Cell."""
    version: int
    """Version loaded."""
    seconds: float
    """Time to pull and load."""
