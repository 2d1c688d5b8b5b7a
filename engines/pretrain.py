"""Synthetic pretraining: teach a freshly initialised model to copy what it has read.

Agents carry values from one place to the next: a number from a tool's answer into a calculator expression, a word
from the task into a file. A real base model learned to copy in pretraining; `gyre model init` gives random weights,
and supervised fine-tuning on a few hundred demonstrations teaches the tiny model the tool-call format but not the
copying (measured: teacher-forced accuracy on argument tokens stayed at the marginal guess after 800 SFT steps,
on training and held-out tasks alike). Copying is the induction circuit, and it forms quickly on short sequences
made for it. So before SFT the model reads a synthetic corpus of short examples, loss only on the second half:

    span   <items>\\n<the same items>\\n                     plain copy
    join   <items>\\n<the same items joined by + or ,>\\n     copy with a changed separator
    look   {"k1": v1, "k2": v2, ...} k2\\n<v2>\\n             look a key up in a JSON object
    quote  <lead-in> <items>\\n"<the same items>"\\n         a span from inside a line into a quoted string

"quote" (opt-in through `kinds`) is there for the tokenizer: a word inside a line is one token sequence with its
leading space (" st" "one"), the same word right after a quote is another ("st" "one"). An agent writing a task's
words into a JSON argument makes exactly that jump for the first word, and a model that only ever copied line
starts to line starts wrote the second word alone (BENCHMARKS.md, session 6).

With `expression_share` some items are calculator expressions ("53-8", "7*120"): copied verbatim they teach the
operator and operands of any length, where a model that copied only lone numbers wrote "53*8" for "53-8" and
"2*5" for "22*5" (BENCHMARKS.md, session 6).

With `max_gap_items` a line of unrelated items follows the source, so the copy reaches back past it (agents copy
from a prompt hundreds of tokens back). Items are numbers and words from a vocabulary the caller gives (a topology
passes the words its tasks use). The corpus is a function of the seed; the result is a model directory like any
other, so it is cached by a digest of the base model and the config.
"""

from __future__ import annotations

import hashlib
import json
import random
import time
from pathlib import Path
from typing import Callable

import attrs
import structlog

from gyre.engines.chat_template import ChatTemplate
from gyre.engines.sft import SFTExample, batch_tensors
from gyre.engines.trainer import MegatronTrainer, TrainerConfig

log = structlog.get_logger(__name__)

__all__ = ["CopyPretrainConfig", "CopyPretrainResult", "copy_examples", "copy_pretrain_digest", "run_copy_pretrain"]

KINDS = ("span", "join", "look", "quote")
DEFAULT_KINDS = ("span", "join", "look")
"""The kinds a config trains unless told otherwise (the first three; caches made before "quote" keep their key)."""
DECAY_FLOOR = 0.05
"""Share of the peak learning rate that the decay ends at."""
QUOTE_LEAD_INS = ("the words", "write", "say", "text:", "copy")
"""Phrases that open a quote example's source line; the items follow them."""


@attrs.frozen
class CopyPretrainConfig:
    """Knobs of the synthetic pretraining."""

    steps: int = attrs.field(default=600, validator=attrs.validators.ge(1))
    """Optimizer steps (each on a fresh batch: the corpus is unbounded)."""
    batch_size: int = attrs.field(default=24, validator=attrs.validators.ge(1))
    """Examples per step."""
    lr: float = 1e-3
    """Peak AdamW learning rate (linear warm-up, constant, then the decay of `decay_steps`)."""
    warmup_steps: int = 50
    """Steps of linear warm-up."""
    decay_steps: int = attrs.field(default=0, validator=attrs.validators.ge(0))
    """Final steps over which the learning rate falls linearly to `DECAY_FLOOR` of its peak (0: constant to the
    end). At a constant rate the copy skill of the last step is a draw from a noisy walk: with it the model settles
    (BENCHMARKS.md, session 12)."""
    max_items: int = attrs.field(default=8, validator=attrs.validators.ge(1))
    """Longest span of items to copy."""
    words: tuple[str, ...] = attrs.field(default=("alpha", "beta", "gamma", "delta"), converter=tuple)
    """Vocabulary of word items (numbers 1..999 are the other items)."""
    number_share: float = 0.6
    """Share of items that are numbers."""
    max_gap_items: int = attrs.field(default=0, validator=attrs.validators.ge(0))
    """Longest line of unrelated items between an example's source and its target (0: adjacent). An agent copies
    from far back: a task's words sit a system prompt and tool schemas away from the call that needs them, and a
    model that only ever copied from the line above does not."""
    expression_share: float = 0.0
    """Share of items that are expressions "<a><op><b>" (op one of + - *; operands 1..999) instead of a number or
    a word."""
    kinds: tuple[str, ...] = attrs.field(default=DEFAULT_KINDS, converter=tuple)
    """Example kinds the corpus draws from, uniformly (a subset of KINDS)."""
    seed: int = 0
    """Corpus and initialisation of the order."""
    num_threads: int | None = None
    """Torch threads (None: torch's default)."""

    def __attrs_post_init__(self) -> None:
        if len(self.words) < 2:
            raise ValueError("words needs at least two entries (the lookup kind samples distinct keys)")
        if not 0.0 <= self.number_share <= 1.0:
            raise ValueError(f"number_share must be in [0, 1], got {self.number_share}")
        if not 0.0 <= self.expression_share <= 1.0:
            raise ValueError(f"expression_share must be in [0, 1], got {self.expression_share}")
        if not self.kinds or set(self.kinds) - set(KINDS):
            raise ValueError(f"kinds must be a non-empty subset of {KINDS}, got {self.kinds!r}")
        if self.decay_steps > self.steps:
            raise ValueError(f"decay_steps must be at most steps ({self.steps}), got {self.decay_steps}")

    def lr_at(self, step: int) -> float:
        """Learning rate of 1-based `step`: linear warm-up, constant, then the linear decay of the last steps."""
        warmup = min(1.0, step / max(1, self.warmup_steps))
        decay_from = self.steps - self.decay_steps
        if step <= decay_from:
            return self.lr * warmup
        return self.lr * warmup * max(DECAY_FLOOR, 1.0 - (step - decay_from) / self.decay_steps)


@attrs.frozen
class CopyPretrainResult:
    """What a pretraining run did."""

    out_dir: str
    steps: int
    first_loss: float
    last_loss: float
    last_accuracy: float
    """Share of target tokens the model gave probability > 1/2 in the last step's batch."""
    seconds: float


def _number(rng: random.Random) -> int:
    return rng.randint(1, 10 ** rng.randint(1, 3) - 1)  # as many 1-, 2- and 3-digit draws


def _item(rng: random.Random, config: CopyPretrainConfig) -> str:
    if config.expression_share > 0 and rng.random() < config.expression_share:
        return f"{_number(rng)}{rng.choice('+-*')}{_number(rng)}"
    return str(rng.randint(1, 999)) if rng.random() < config.number_share else rng.choice(config.words)


def copy_examples(template: ChatTemplate, config: CopyPretrainConfig, rng: random.Random, count: int) -> list[SFTExample]:
    """`count` examples; each is (source text, target text) tokenised separately, loss on the target only."""
    examples = []
    for _ in range(count):
        kind = rng.choice(config.kinds)
        items = [_item(rng, config) for _ in range(rng.randint(1, config.max_items))]
        if kind == "span":
            source, target = " ".join(items), " ".join(items)
        elif kind == "join":
            source, target = " ".join(items), rng.choice("+,").join(items)
        elif kind == "quote":
            source, target = f"{rng.choice(QUOTE_LEAD_INS)} {' '.join(items)}", f'"{" ".join(items)}"'
        else:
            keys = rng.sample(config.words, min(len(config.words), rng.randint(2, 6)))
            values = {key: rng.randint(1, 99) for key in keys}
            key = rng.choice(keys)
            source, target = f"{json.dumps(values)} {key}", str(values[key])
        if config.max_gap_items > 0:
            gap = [_item(rng, config) for _ in range(rng.randint(0, config.max_gap_items))]
            source = f"{source}\n{' '.join(gap)}"
        source_ids = template.encode(source + "\n")
        target_ids = template.encode(target + "\n")
        examples.append(SFTExample(tuple(source_ids + target_ids),
                                   tuple([False] * len(source_ids) + [True] * len(target_ids))))
    return examples


def copy_pretrain_digest(base_dir: str | Path, config: CopyPretrainConfig) -> str:
    """A cache key: the same base model and config give the same pretrained model."""
    digest = hashlib.sha256((Path(base_dir) / "model.safetensors").read_bytes())
    fields = attrs.asdict(config)
    # Fields added later leave the key as it was while they hold their defaults, and so the caches made before them.
    if fields["max_gap_items"] == 0:
        del fields["max_gap_items"]
    if tuple(fields["kinds"]) == DEFAULT_KINDS:
        del fields["kinds"]
    if fields["expression_share"] == 0.0:
        del fields["expression_share"]
    if fields["decay_steps"] == 0:
        del fields["decay_steps"]
    digest.update(json.dumps(fields, sort_keys=True).encode())
    return digest.hexdigest()[:16]


def run_copy_pretrain(
    base_dir: str | Path,
    out_dir: str | Path,
    config: CopyPretrainConfig = CopyPretrainConfig(),
    progress: Callable[[int, int, float, float], None] | None = None,
) -> CopyPretrainResult:
    """Train the model in `base_dir` on the synthetic copy corpus; save a full model directory to `out_dir`.

    `progress(step, total, loss, accuracy)` is called after every step.
    """
    started = time.perf_counter()
    template = ChatTemplate.from_model_dir(base_dir)
    trainer = MegatronTrainer(base_dir, TrainerConfig(lr=config.lr, num_threads=config.num_threads, seed=config.seed))
    rng = random.Random(f"copy-pretrain:{config.seed}")
    first_loss = last_loss = last_accuracy = float("nan")
    for step in range(config.steps):
        ids, lengths, mask = batch_tensors(copy_examples(template, config, rng, config.batch_size))
        targets = mask.sum().clamp_min(1.0)

        def loss_fn(logprobs, mask=mask, targets=targets):
            accuracy = ((logprobs > -0.6931).float() * mask).sum() / targets
            return -(logprobs * mask).sum() / targets, {"accuracy": accuracy}

        metrics = trainer.forward_backward(ids, lengths, loss_fn)
        trainer.optimizer_step(lr=config.lr_at(step + 1))
        trainer.zero_grads()
        last_loss, last_accuracy = float(metrics["loss"]), float(metrics["accuracy"])
        first_loss = last_loss if step == 0 else first_loss
        if progress is not None:
            progress(step + 1, config.steps, last_loss, last_accuracy)
    trainer.save_hf(out_dir)
    result = CopyPretrainResult(str(out_dir), config.steps, first_loss, last_loss, last_accuracy,
                                time.perf_counter() - started)
    (Path(out_dir) / "copy_pretrain.json").write_text(json.dumps(attrs.asdict(result), indent=2) + "\n")
    log.info("copy_pretrain_done", **attrs.asdict(result))
    return result
