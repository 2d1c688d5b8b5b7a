"""The temperature a token's log-prob is taken at: one rule, shared by the engine, the proxy and the trainer.

A sampled token's behaviour log-prob is log-softmax(logits / temperature) at that token, the distribution it was
drawn from (SGLang's default too); a greedy request's is taken at temperature 1, because dividing by ~0 means
nothing. The proxy records this temperature with each model call and the trainer divides its logits by it, so that
RL trains the policy that produced the samples (engines/sampling.py explains why). No torch here: the proxy uses it.
"""

from __future__ import annotations

GREEDY_TEMPERATURE = 1e-5
"""Below this a request is greedy (argmax): dividing the logits by it would overflow float32 for no visible change."""


def logprob_temperature(temperature: float) -> float:
    """The temperature that a request sampled at `temperature` reports its log-probs at: itself, or 1 when greedy."""
    return 1.0 if temperature < GREEDY_TEMPERATURE else float(temperature)
