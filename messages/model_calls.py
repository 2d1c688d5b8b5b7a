"""What the proxy tells the trajectory builder after every model call: token-in/token-out, the birth of training data."""

from __future__ import annotations

from gyre.messages._define import message


@message("gyre.model_calls.ModelCallCompleted", version=2)
class ModelCallCompleted:
    """One finished model call of one execution, with the exact token ids and behaviour log-probs."""

    execution_id: str
    """The execution (one agent run on one task) that made the call; its API key identified it."""
    group_id: str
    """The GSPO group (one task, G executions) the execution belongs to."""
    call_index: int
    """0-based order of this call among the execution's calls, as the proxy received them."""
    agent_id: str
    """Who called: "main" for the top-level agent, else the sub-agent id from the X-Gyre-Agent header; "" if unlabelled."""
    call_kind: str
    """"turn" for an ordinary call, "summary" for a context-compression call (X-Gyre-Call: summary); "" if unlabelled."""
    prompt_ids: tuple[int, ...]
    """Token ids the model was conditioned on, with earlier generated assistant turns reused exactly."""
    output_ids: tuple[int, ...]
    """Token ids the policy emitted, stop token included when it ended the turn."""
    output_logprobs: tuple[float, ...]
    """Behaviour log-probability of each output token under the weights that produced it, taken at
    `sampling_temperature`."""
    output_versions: tuple[int, ...]
    """Weight version that produced each output token (a call can straddle a weight update)."""
    finish_reason: str
    """"stop", "length" or "abort"."""
    cached_tokens: int
    """Prompt tokens that the rollout engine served from its prefix cache."""
    cell: str
    """Name of the rollout cell that served the call (the last one, if the session moved mid-call)."""
    started_s: float
    """Runtime-clock time when the proxy received the call."""
    finished_s: float
    """Runtime-clock time when the proxy answered the call."""
    sampling_temperature: float
    """Temperature the output tokens were drawn at, and the one their log-probs are taken at: the trainer divides
    its logits by it (1.0 for greedy decoding: engines/temperature.py)."""
