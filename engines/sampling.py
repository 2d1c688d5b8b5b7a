"""Choosing the next token, and deciding when a request stops.

Reproducibility: the noise of each sampled token is one uniform number derived from (the request's seed, the
token's absolute position in the sequence, prompt included) by a counter-based hash (splitmix64), not drawn from a
stream. The token is found by inverting the CDF of that request's own row of logits. So the same seed gives the same
tokens whichever other requests share the batch, and a generation cut off after k tokens and resubmitted anywhere
as prompt + those k tokens with the same seed (and the remaining budget) goes on with exactly the tokens it would
have produced: token k+1 sits at the same absolute position either way. A stream per request could not do that
without shipping its state along (the proxy's resubmission after a role switch relies on it; see
actors/serving/proxy.py). The cost is that two requests with the same seed whose sequences share positions get the same
noise at those positions; give different requests different seeds (the engine and the proxy do).

Log-probs: `output_logprobs` are log-softmax of the logits divided by the request's temperature (no top-p or top-k)
at the chosen token, and of the raw logits for a greedy request (temperature 0 counts as 1: `logprob_temperature`).
That is SGLang's convention (its default log-probs are taken after temperature scaling) and the distribution the
token was drawn from, so it is the policy that RL trains: the trainer divides its logits by the same temperature
(TrainingSample.sampling_temperatures) and behaviour and trainer log-probs are directly comparable (importance
ratios, staleness checks). Taken at temperature 1 instead, samples drawn at 0.7 would train the temperature-1
policy on another policy's samples, and SGLang's behaviour log-probs would not match the trainer's at all. Top-p
and top-k are not folded in (SGLang does not either): RL rollouts should leave them off.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Sequence

import attrs
import torch

from gyre.engines.temperature import GREEDY_TEMPERATURE, logprob_temperature

# Beyond this a stop string cannot be checked cheaply, and nobody needs it.
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 64


def _check_stop(instance: object, attribute: attrs.Attribute, value: tuple) -> None:
    if not isinstance(value, tuple) or not all(isinstance(s, str) and s for s in value):
        raise ValueError("stop must be a tuple of non-empty strings")
    if len(value) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_STRING_CHARS for s in value):
        raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings of at most {MAX_STOP_STRING_CHARS} characters")


def _check_stop_ids(instance: object, attribute: attrs.Attribute, value: tuple) -> None:
    if not isinstance(value, tuple) or not all(type(t) is int and t >= 0 for t in value):
        raise ValueError("stop_token_ids must be a tuple of non-negative ints")
    if len(value) > MAX_STOP_TOKEN_IDS:
        raise ValueError(f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids")


def _to_tuple(value: object) -> object:
    if isinstance(value, (list, tuple)):
        return tuple(value)
    if isinstance(value, str):  # SGLang accepts one stop string as a bare string
        return (value,)
    return value


def _real(value: object, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return float(value)


@attrs.frozen
class SamplingParams:
    """How one request samples and when it stops. Invalid values raise ValueError at construction."""

    max_new_tokens: int = 128
    """Tokens to generate at most; the request finishes with reason "length" when it reaches them."""
    temperature: float = 1.0
    """0 (or below 1e-5) means greedy (argmax); otherwise logits are divided by it before top-k/top-p."""
    top_p: float = 1.0
    """Nucleus sampling: keep the fewest most likely tokens whose probability reaches top_p (0 < top_p <= 1)."""
    top_k: int = -1
    """Keep only the k most likely tokens; -1 (or 0) keeps all."""
    stop: tuple[str, ...] = attrs.field(default=(), converter=_to_tuple, validator=_check_stop)
    """Stop strings; needs tokenizer.json in the model dir. The matching tokens stay in the output ids."""
    stop_token_ids: tuple[int, ...] = attrs.field(default=(), converter=_to_tuple, validator=_check_stop_ids)
    """Tokens that end the request (kept as the last output token); they apply even with ignore_eos."""
    seed: int | None = None
    """Seed of this request's sampling noise (one number per (seed, position), see the module doc); None lets the
    engine pick one from its own seeded sequence."""
    ignore_eos: bool = False
    """Do not stop at the model's end-of-sequence tokens (generation_config / config eos_token_id)."""

    def __attrs_post_init__(self) -> None:
        if type(self.max_new_tokens) is not int or self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be an int >= 0, got {self.max_new_tokens!r}")
        temperature = _real(self.temperature, "temperature")
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        top_p = _real(self.top_p, "top_p")
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        if type(self.top_k) is not int or (self.top_k < 0 and self.top_k != -1):
            raise ValueError(f"top_k must be -1, 0 or a positive int, got {self.top_k!r}")
        if self.seed is not None and (type(self.seed) is not int or not 0 <= self.seed < 2**63):
            raise ValueError(f"seed must be None or an int in [0, 2**63), got {self.seed!r}")
        if type(self.ignore_eos) is not bool:
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")

    @property
    def logprob_temperature(self) -> float:
        """The temperature the output log-probs are taken at (see the module doc)."""
        return logprob_temperature(self.temperature)

    @property
    def greedy(self) -> bool:
        # Below GREEDY_TEMPERATURE dividing the logits overflows float32 for no visible change: argmax it is.
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def filtered(self) -> bool:
        """Whether top-k or top-p cut the distribution (these rows are sampled one by one)."""
        return self.top_k > 1 or self.top_p < 1


_MASK64 = (1 << 64) - 1


def _mix64(value: int) -> int:
    """splitmix64's finaliser: a bijection of 64-bit ints whose outputs pass statistical tests of randomness."""
    z = (value + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def _uniform(key: int, position: int) -> float:
    if position < 0:
        raise ValueError(f"position must be >= 0, got {position}")
    return (_mix64(key ^ (position & _MASK64)) >> 11) * (1.0 / (1 << 53))


def position_uniform(seed: int, position: int) -> float:
    """The noise of the token at absolute sequence `position` of a request seeded `seed`: uniform in [0, 1), 53 bits."""
    return _uniform(_mix64(seed & _MASK64), position)


class RequestSampler:
    """One request's sampling params and seed; its noise is a function of (seed, position), see the module doc."""

    __slots__ = ("params", "seed", "_key")

    def __init__(self, params: SamplingParams, seed: int) -> None:
        self.params = params
        self.seed = seed
        self._key = _mix64(seed & _MASK64)

    def uniform(self, position: int) -> float:
        """The uniform number of the token sampled at absolute sequence `position` (= `position_uniform`)."""
        return _uniform(self._key, position)


def _inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Index of the first entry whose cumulative probability exceeds u * total, per row ([B, V], [B] -> [B])."""
    cdf = probs.to(torch.float64).cumsum(-1)
    targets = (uniforms * cdf[:, -1]).unsqueeze(-1)
    picked = torch.searchsorted(cdf, targets, right=True).squeeze(-1)
    return picked.clamp_(max=probs.shape[-1] - 1)


def _sample_filtered(row: torch.Tensor, params: SamplingParams, uniform: float) -> int:
    """Top-k then top-p on one row of temperature-scaled logits."""
    vocab = row.shape[-1]
    k = params.top_k if params.top_k > 0 else vocab
    values, indices = torch.topk(row, min(k, vocab))  # sorted, largest first
    probs = torch.softmax(values, -1)
    if params.top_p < 1:
        before = probs.cumsum(-1) - probs  # mass of strictly more likely tokens
        keep = before < params.top_p  # the most likely token always stays
        probs = torch.where(keep, probs, torch.zeros_like(probs))
    index = _inverse_cdf(probs.unsqueeze(0), torch.tensor([uniform], dtype=torch.float64))
    return int(indices[int(index)])


def sample_next(
    logits: torch.Tensor, samplers: Sequence[RequestSampler], positions: Sequence[int]
) -> tuple[list[int], list[float]]:
    """Pick one token per row of `logits` [B, V]; returns the tokens and their log-probs at each row's
    `logprob_temperature` (see the module doc).

    `positions[b]` is the absolute sequence position (prompt included) the token of row b will take: its noise is
    derived from it and the row's seed."""
    logits = logits.float()
    batch = logits.shape[0]
    assert batch == len(samplers) == len(positions)
    tokens = [0] * batch
    plain_rows: list[int] = []
    plain_uniforms: list[float] = []
    greedy_rows = [b for b, s in enumerate(samplers) if s.params.greedy]
    if greedy_rows:
        picked = logits[greedy_rows].argmax(-1).tolist()
        for b, token in zip(greedy_rows, picked):
            tokens[b] = token
    for b, sampler in enumerate(samplers):
        params = sampler.params
        if params.greedy:
            continue
        if params.filtered:
            tokens[b] = _sample_filtered(logits[b] / params.temperature, params, sampler.uniform(positions[b]))
        else:
            plain_rows.append(b)
            plain_uniforms.append(sampler.uniform(positions[b]))
    if plain_rows:
        temperatures = torch.tensor([samplers[b].params.temperature for b in plain_rows], dtype=logits.dtype)
        probs = torch.softmax(logits[plain_rows] / temperatures.unsqueeze(-1), -1)
        picked = _inverse_cdf(probs, torch.tensor(plain_uniforms, dtype=torch.float64)).tolist()
        for b, token in zip(plain_rows, picked):
            tokens[b] = token
    index = torch.tensor(tokens, dtype=torch.long)
    scales = [s.params.logprob_temperature for s in samplers]
    if any(scale != 1.0 for scale in scales):
        logits = logits / torch.tensor(scales, dtype=logits.dtype).unsqueeze(-1)
    logprobs = torch.log_softmax(logits, -1).gather(-1, index.unsqueeze(-1)).squeeze(-1).tolist()
    return tokens, logprobs


# ---- stopping -------------------------------------------------------------------------------------------------


def load_tokenizer(model_dir: str | Path) -> object | None:
    """The model dir's tokenizer.json as a `tokenizers.Tokenizer`, or None when the dir has none."""
    path = Path(model_dir) / "tokenizer.json"
    if not path.exists():
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path))


def _ids(value: object) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int)]
    return []


def load_eos_token_ids(model_dir: str | Path) -> frozenset[int]:
    """End-of-sequence ids named by generation_config.json and config.json (either may list several)."""
    ids: set[int] = set()
    for name in ("generation_config.json", "config.json"):
        path = Path(model_dir) / name
        if path.exists():
            ids.update(_ids(json.loads(path.read_text()).get("eos_token_id")))
    return frozenset(ids)


@attrs.frozen
class StopResult:
    """Why a request finished."""

    finish_reason: str
    """"stop" or "length"."""
    matched: int | str | None
    """The stop token id or stop string that matched; None for "length"."""


class StopChecker:
    """Checks one request's output after each new token: stop tokens, stop strings, then the length limit."""

    __slots__ = ("_stop_ids", "_stop_strings", "_tokenizer", "_tail_tokens", "_max_new_tokens")

    def __init__(
        self, params: SamplingParams, eos_token_ids: frozenset[int], tokenizer: object | None, max_new_tokens: int
    ) -> None:
        if params.stop and tokenizer is None:
            raise ValueError("stop strings need tokenizer.json in the model dir; this model dir has none")
        self._stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else eos_token_ids)
        self._stop_strings = params.stop
        self._tokenizer = tokenizer
        # A stop string that ends at the newest token spans at most this many tokens: each token decodes to at
        # least one byte, and a character is at most 4 bytes of byte-level BPE.
        self._tail_tokens = 4 * max((len(s) for s in params.stop), default=0) + 4
        self._max_new_tokens = max_new_tokens

    def check(self, output_ids: Sequence[int]) -> StopResult | None:
        if not output_ids:
            return None
        last = output_ids[-1]
        if last in self._stop_ids:
            return StopResult("stop", last)
        if self._stop_strings:
            tail_ids = list(output_ids[-self._tail_tokens :])
            tail = self._tokenizer.decode(tail_ids, skip_special_tokens=False)  # type: ignore[attr-defined]
            for stop in self._stop_strings:
                if stop in tail:
                    return StopResult("stop", stop)
        if len(output_ids) >= self._max_new_tokens:
            return StopResult("length", None)
        return None
