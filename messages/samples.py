"""What flows into the trajectory builder when an execution ends, and what it hands on to training.

The evaluator ends every execution with exactly one of `ExecutionScored` (a reward, possibly for a timed-out run
whose workspace survived) or `ExecutionDropped` (no reward: the scorer crashed or hung; never a reward of 0). Once
a group is complete the builder turns each scored execution's token tree into `TrainingSample`s and lands them,
group by group, in one `SamplesLanded`: group-normalised advantages need every reward of the group.

Per-token fields of a `TrainingSample` are aligned with `token_ids`: entry t describes token t, so a trainer that
returns `logprobs[t] = log p(token_ids[t] | token_ids[:t])` can use them as they are. Token 0 never carries loss.
"""

from __future__ import annotations

from gyre.messages._define import message


@message("gyre.samples.ExecutionScored")
class ExecutionScored:
    """The scorer ran on an execution's workspace and returned a reward."""

    execution_id: str
    """The execution that was scored."""
    group_id: str
    """The GSPO group (one task, G executions) the execution belongs to."""
    reward: float
    """The scorer's reward; finite."""
    timed_out: bool
    """True if the agent hit its time limit and the preserved workspace was scored anyway."""
    detail: str
    """Free-form note from the scorer (e.g. "3/4 tests pass"); "" if none."""


@message("gyre.samples.ExecutionDropped")
class ExecutionDropped:
    """An execution that will never get a reward; its tree is discarded and it is left out of its group."""

    execution_id: str
    """The execution that was dropped."""
    group_id: str
    """The GSPO group the execution belonged to."""
    reason: str
    """Why, e.g. "scorer crashed: exit 1", "scorer timed out", "workspace lost"."""
    timed_out: bool
    """True if the agent had also hit its time limit."""


@message("gyre.samples.TrainingSample", version=2)
class TrainingSample:
    """One root-to-leaf trajectory of an execution's token tree, ready for forward-backward."""

    execution_id: str
    """The execution whose tree the trajectory comes from."""
    group_id: str
    """The execution's GSPO group."""
    trajectory_rank: int
    """0-based place of this trajectory among the ones the processor kept for the execution (0 = most important)."""
    trajectory_kind: str
    """Kind it ranked as: "main", "main-summary", "sub-agent" or "sub-agent-summary" (see policies/trajectory_tree)."""
    leaf_call_index: int
    """call_index of the model call whose prompt + output is this trajectory (the sample may end earlier: trimmed)."""
    token_ids: tuple[int, ...]
    """Token ids of the trajectory, prompt and generated tokens alike, from the root of the tree."""
    loss_mask: tuple[bool, ...]
    """True where the token carries loss: emitted by the policy and not trained by another sample of the execution."""
    behaviour_logprobs: tuple[float, ...]
    """Log-probability of each policy-emitted token under the weights that sampled it, taken at its sampling
    temperature; 0.0 for other tokens."""
    sampling_temperatures: tuple[float, ...]
    """Temperature each loss token was sampled at (1.0 for greedy and for other tokens): the trainer divides the
    logits that predict token t by entry t, so its log-probs are those of the distribution that drew the token."""
    advantages: tuple[float, ...]
    """Advantage of each token: the execution's group-normalised advantage, on every token."""
    weights: tuple[float, ...]
    """Loss weight of each token: 1 / (loss tokens of the whole execution) where loss_mask is True, else 0.0."""
    min_weight_version: int
    """Oldest weight version that sampled one of this sample's loss tokens."""
    max_weight_version: int
    """Newest weight version that sampled one of this sample's loss tokens."""
    num_loss_tokens: int
    """Number of True entries in loss_mask (at least 1)."""


@message("gyre.samples.SamplesLanded", version=2)
class SamplesLanded:
    """Every training sample of one finished group, with the group's rewards and advantages."""

    group_id: str
    """The GSPO group that finished."""
    samples: tuple[TrainingSample, ...]
    """The samples of all scored executions of the group, execution by execution, in rank order within each."""
    execution_ids: tuple[str, ...]
    """The scored executions of the group, in the order of `rewards` and `advantages`."""
    rewards: tuple[float, ...]
    """Reward of each scored execution."""
    advantages: tuple[float, ...]
    """Group-normalised advantage of each scored execution."""
    num_dropped: int
    """Executions of the group that were dropped (no reward) and so contribute nothing."""
    num_tokens: int
    """Total tokens over all samples: what forward-backward will process."""
    num_loss_tokens: int
    """Total loss-bearing tokens over all samples."""
    min_weight_version: int
    """Oldest weight version among all loss tokens; -1 if there are no samples."""
    max_weight_version: int
    """Newest weight version among all loss tokens; -1 if there are no samples."""
    landing_seq: int = 0
    """The builder's number for this landing, 1, 2, ... (0: not numbered). A gap tells the claimer that landings
    never reached it (version 2; actors/training/microstep_claimer.py, Lost messages)."""
    samples_sent: int = 0
    """Samples the builder has landed so far, this landing's included: a gap's sample count."""


@message("gyre.samples.LandingsLost")
class LandingsLost:
    """Claimer -> everyone (the task source): groups whose samples never reached the claimer, died with a restarted
    claimer, or were refused as too stale; they are counted as dropped (never trained), so the task source's gate
    stops waiting for them, and it catches up on the claimer's step and weights (a StepApplied it missed)."""

    groups: int
    """Groups (landings) lost; -1 for one counted lost that arrived after all ("arrived late")."""
    samples: int
    """Their samples (negative with the groups)."""
    why: str
    """"in transit", "claimer restarted", "stale" or "arrived late"."""
    step_id: int = -1
    """The claimer's current step (-1: not said)."""
    base_version: int = -1
    """Its base weight version (-1: not said)."""
