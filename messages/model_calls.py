"""What the proxy tells the trajectory builder after every model call: token-in/token-out, the birth of training data.

Records are incremental (issue 29): an agent resends its whole conversation on every call, so a call's prompt mostly
repeats an earlier call's prompt + output. A record names that earlier call (`extends_call`), how many of its path's
tokens the prompt starts with (`shared_tokens`), and carries only the ids after them (`new_prompt_ids`), plus the
SHA-256 of the whole prompt (`prompt_digest`) so that a receiver that rebuilds the prompt from its own copy of the
earlier call detects any mismatch instead of training on it. A call that extends no earlier call (the first one, a
fresh sub-agent, a proxy that no longer remembers the conversation) has `extends_call` -1 and carries its whole
prompt; a call that branches from an earlier point (a compression that keeps the system prompt, a retry, a
sub-agent started from the main conversation) names the call it branches from with a `shared_tokens` short of that
call's path. What the bus moves per call is then proportional to its new tokens, not to its context.
"""

from __future__ import annotations

from gyre.messages._define import message


@message("gyre.model_calls.ModelCallCompleted", version=3)
class ModelCallCompleted:
    """One finished model call of one execution, with the exact token ids and behaviour log-probs."""

    execution_id: str
    """The execution (one agent run on one task) that made the call; its API key identified it."""
    group_id: str
    """The GSPO group (one task, G executions) the execution belongs to."""
    call_index: int
    """0-based order of this call among the execution's calls, as the proxy received them."""
    agent_id: str
    """Who called: "main" for the top-level agent, else the sub-agent id from the X-Gyre-Agent header; "" if
    unlabelled."""
    call_kind: str
    """"turn" for an ordinary call, "summary" for a context-compression call (X-Gyre-Call: summary); "" if
    unlabelled."""
    prompt_tokens: int
    """Length of the prompt the model was conditioned on (earlier generated assistant turns reused exactly)."""
    extends_call: int
    """call_index of the earlier call of this execution whose prompt + output the prompt starts with (its first
    `shared_tokens` tokens); -1 when the prompt extends no earlier call and `new_prompt_ids` is the whole prompt.
    Always lower than `call_index`."""
    shared_tokens: int
    """Prompt tokens taken from `extends_call`'s path (prompt + output): all of it when the prompt extends that call,
    fewer at a branch point; 0 when `extends_call` is -1."""
    new_prompt_ids: tuple[int, ...]
    """The prompt's ids after the shared prefix: prompt = path(extends_call)[:shared_tokens] + new_prompt_ids."""
    prompt_digest: bytes
    """SHA-256 of the whole prompt's ids as 8-byte little-endian integers (gyre.policies.trajectory_tree's
    `prompt_ids_digest`); b"" is allowed only for a record that carries its whole prompt (`extends_call` -1), where
    there is nothing to rebuild."""
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

