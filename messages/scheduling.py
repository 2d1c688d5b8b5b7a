"""The scheduler's view of training work, and the statistics of the micro-step claimer and the scheduler.

The micro-step claimer publishes `TrainingBacklog` whenever its queue changes (not on a timer): the scheduler needs
to know whether micro-steps are waiting, and who holds claims, to move cells between rollout and training. The
timer ticks are messages too, so that they appear in the event log and a replay sees the same inputs.
"""

from __future__ import annotations

from gyre.messages._define import message


@message("gyre.scheduling.TrainingBacklog")
class TrainingBacklog:
    """Micro-step claimer -> everyone: the state of the step being trained and of the data waiting for later steps."""

    step_id: int
    """The step whose micro-steps can be claimed now."""
    base_version: int
    """Weights that step trains with."""
    step_fixed: bool
    """True once the step has all its executions (StepReady was published); False while it still fills."""
    claimable_microsteps: int
    """Micro-steps of the step that are queued and not claimed."""
    claimed_microsteps: int
    """Micro-steps of the step held by cells."""
    done_microsteps: int
    """Micro-steps of the step whose gradients are done."""
    open_tokens: int
    """Tokens packed into micro-steps that are not closed yet (claimable once full or once the step is fixed)."""
    executions_in_step: int
    """Executions assigned to the step so far."""
    executions_per_step: int
    """Executions a step takes (groups_per_step * group_size)."""
    pending_executions: int
    """Executions landed after the step was fixed, waiting for the next one."""
    claims_by_cell: dict[str, int]
    """Cell -> micro-steps it holds."""
    time_s: float
    """Claimer's runtime-clock time."""


@message("gyre.scheduling.ClaimerTick")
class ClaimerTick:
    """Claimer -> itself: check whether a cell holding claims has gone silent, and whether a fixed step's StepReady
    is due again."""


@message("gyre.scheduling.SchedulerTick")
class SchedulerTick:
    """Scheduler -> itself: re-evaluate the policy even if no event came (dwell times and grace periods expire)."""


@message("gyre.scheduling.ClaimerStatistics", version=5)
class ClaimerStatistics:
    """The claimer's exactly-once ledger: every landed sample is trained once, dropped with a reason, or in flight."""

    samples_landed: int
    """Samples received in SamplesLanded (duplicates included)."""
    samples_trained: int
    """Samples whose micro-step is done (MicroStepDone, or the core's StepApplied for a claimed one)."""
    samples_skipped: int
    """Samples of steps the core skipped (their gradients were not finite): used up, never trained."""
    samples_dropped_stale: int
    """Samples of executions refused by the staleness policy."""
    samples_dropped_overflow: int
    """Samples of executions dropped because the pending queue was full (oldest first)."""
    samples_duplicate: int
    """Samples of an execution that had already landed (refused)."""
    samples_lost: int
    """Samples of micro-steps the core applied without them being claimed: must stay 0."""
    samples_in_flight: int
    """Samples pending, packed or claimed: neither trained nor dropped yet."""
    samples_trained_twice: int
    """Samples that a done micro-step held although they had been trained before: must stay 0."""
    executions_landed: int
    """Executions (with at least one sample) received."""
    executions_assigned: int
    """Executions placed into a step."""
    executions_dropped_stale: int
    """Executions refused by the staleness policy."""
    microsteps_closed: int
    """Micro-steps made claimable."""
    microsteps_granted: int
    """Claims granted (a re-queued micro-step counts again)."""
    microsteps_done: int
    """Micro-steps done."""
    microsteps_requeued: int
    """Micro-steps put back in the queue (released, or their cell left training, restarted or went silent)."""
    duplicate_dones: int
    """MicroStepDone for a micro-step already done (ignored)."""
    stray_messages: int
    """MicroStepDone or ReleaseMicroStep from a cell that never held that micro-step, or for another step (ignored)."""
    claims_refused: int
    """Claims answered with no work because of the cell's role, weight version or claim limit."""
    steps_ready: int
    """Steps fixed (StepReady published)."""
    steps_applied: int
    """StepApplied seen for the claimer's current step (skipped steps included)."""
    steps_skipped: int
    """Of those, steps the core skipped for non-finite gradients."""
    step_id: int
    """The current step."""
    base_version: int
    """Its base weight version."""
    samples_rerolled: int = 0
    """Samples in flight when the checkpoint a resumed run started from was taken: never trained, their groups ran
    again (version 3; see actors/training/checkpointer.py)."""
    samples_dropped_in_transit: int = 0
    """Samples of landings that never arrived (a gap in SamplesLanded.landing_seq), or arrived after the gap was
    counted (version 4)."""
    samples_dropped_restart: int = 0
    """Samples in flight when the claimer restarted: its memory of them died with it (version 4)."""
    step_ready_resends: int = 0
    """StepReady published again for a fixed step whose StepApplied had not come (version 4)."""
    wakeups_sent: int = 0
    """ClaimsOpen told to cells waiting for work (version 5; microstep_claimer.py, Wake-ups)."""


@message("gyre.scheduling.SchedulerStatistics")
class SchedulerStatistics:
    """What the scheduler has done so far."""

    policy: str
    """Class name of the hosted policy."""
    evaluations: int
    """Times the policy was asked for decisions."""
    switches_sent: int
    """SwitchRole messages sent."""
    switches_to_train: int
    """Of which to the train role."""
    switches_to_rollout: int
    """Of which to the rollout role."""
    switch_timeouts: int
    """Switches that no RoleChanged confirmed within the timeout (the cell's reported role was taken as truth)."""
    cells: dict[str, str]
    """Cell -> role as the scheduler sees it now ("switching" while a switch is pending)."""
