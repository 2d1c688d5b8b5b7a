"""Supervised fine-tuning on demonstrations: the warm start that lets RL begin from a model that sometimes succeeds.

A demonstration is a conversation in OpenAI message form plus its tools. It is rendered with the model's own chat
template, piece by piece, so that exactly the assistant turns' bodies (the ids between `<|im_start|>assistant\\n`
and the trailing newline, `<|im_end|>` included) carry loss, the same tokens the proxy would later record as
policy-emitted. Training runs on the megatron-core trainer, the one RL uses.
"""

from __future__ import annotations

import hashlib
import json
import random
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import attrs
import structlog
import torch

from gyre.engines.chat_template import ChatTemplate
from gyre.engines.errors import SFTError
from gyre.engines.trainer import MegatronTrainer, TrainerConfig

log = structlog.get_logger(__name__)


@attrs.frozen
class SFTConfig:
    """Fine-tuning knobs."""

    epochs: int = 6
    """Passes over the demonstrations."""
    lr: float = 2e-3
    """AdamW learning rate (peak; linear decay to 10% over the run)."""
    batch_tokens: int = 2048
    """Padded tokens per optimizer step (batches group conversations of similar length). Small batches: a tiny
    model learns the tool-call format from many small steps far better than from a few large ones."""
    max_tokens: int = 1536
    """Longest conversation kept; longer ones are skipped and counted."""
    seed: int = 0
    """Order of batches."""
    num_threads: int | None = None
    """Torch threads (None: torch's default)."""


@attrs.frozen
class SFTExample:
    """One tokenised demonstration."""

    token_ids: tuple[int, ...]
    """The whole conversation."""
    loss_mask: tuple[bool, ...]
    """True where a token is an assistant body token (a training target)."""


@attrs.frozen
class SFTResult:
    """What a fine-tuning run did."""

    out_dir: str
    examples: int
    skipped: int
    steps: int
    target_tokens: int
    first_loss: float
    last_loss: float
    seconds: float


def tokenize_demonstration(
    template: ChatTemplate, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None
) -> SFTExample:
    """Render piece by piece; assistant pieces are header + body + trailer, and only the body is a target."""
    pieces = template.conversation_ids(messages, tools, add_generation_prompt=False)
    header = template.assistant_header_ids()
    trailer = template.assistant_trailer_ids()
    non_system = [m for m in messages if m.get("role") != "system"]
    ids: list[int] = list(pieces[0])
    mask: list[bool] = [False] * len(pieces[0])
    for message, piece in zip(non_system, pieces[1:-1]):
        if message.get("role") == "assistant":
            if piece[: len(header)] != header or piece[len(piece) - len(trailer) :] != trailer:
                raise SFTError("an assistant turn does not split into header, body and trailer")
            body = len(piece) - len(header) - len(trailer)
            mask.extend([False] * len(header) + [True] * body + [False] * len(trailer))
        else:
            mask.extend([False] * len(piece))
        ids.extend(piece)
    if not any(mask):
        raise SFTError("a demonstration without assistant turns has nothing to learn")
    return SFTExample(tuple(ids), tuple(mask))


def _batches(examples: list[SFTExample], batch_tokens: int, rng: random.Random) -> list[list[SFTExample]]:
    ordered = sorted(examples, key=lambda e: len(e.token_ids))
    batches: list[list[SFTExample]] = []
    current: list[SFTExample] = []
    for example in ordered:
        longest = max([len(e.token_ids) for e in current] + [len(example.token_ids)])
        if current and longest * (len(current) + 1) > batch_tokens:
            batches.append(current)
            current = []
        current.append(example)
    if current:
        batches.append(current)
    rng.shuffle(batches)
    return batches


def batch_tensors(batch: list[SFTExample]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids [B, T] right-padded, lengths [B], loss mask [B, T] as floats) for the trainer's forward_backward."""
    width = max(len(e.token_ids) for e in batch)
    ids = torch.zeros((len(batch), width), dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.float32)
    lengths = torch.tensor([len(e.token_ids) for e in batch], dtype=torch.long)
    for row, example in enumerate(batch):
        ids[row, : len(example.token_ids)] = torch.tensor(example.token_ids)
        mask[row, : len(example.loss_mask)] = torch.tensor(example.loss_mask, dtype=torch.float32)
    mask[:, 0] = 0.0  # the first token has no log-prob
    return ids, lengths, mask


def run_sft(
    base_dir: str | Path,
    demonstrations: Iterable[tuple[Sequence[Mapping[str, Any]], Sequence[Mapping[str, Any]] | None]],
    out_dir: str | Path,
    config: SFTConfig = SFTConfig(),
    progress: Callable[[int, int, float], None] | None = None,
) -> SFTResult:
    """Fine-tune the model in `base_dir` on (messages, tools) pairs and save a full model directory to `out_dir`."""
    started = time.perf_counter()
    template = ChatTemplate.from_model_dir(base_dir)
    examples: list[SFTExample] = []
    skipped = 0
    for messages, tools in demonstrations:
        example = tokenize_demonstration(template, messages, tools)
        if len(example.token_ids) > config.max_tokens:
            skipped += 1
            continue
        examples.append(example)
    if not examples:
        raise SFTError("no demonstration fits the token limit")
    trainer = MegatronTrainer(base_dir, TrainerConfig(lr=config.lr, num_threads=config.num_threads, seed=config.seed))
    rng = random.Random(config.seed)
    plan = [_batches(examples, config.batch_tokens, rng) for _ in range(config.epochs)]
    total_steps = sum(len(epoch) for epoch in plan)
    step = 0
    first_loss = last_loss = float("nan")
    for epoch in plan:
        for batch in epoch:
            ids, lengths, mask = batch_tensors(batch)
            targets = mask.sum().clamp_min(1.0)

            def loss_fn(logprobs: torch.Tensor, mask=mask, targets=targets):
                return -(logprobs * mask).sum() / targets, {}

            metrics = trainer.forward_backward(ids, lengths, loss_fn)
            # Linear decay keeps late epochs from undoing early progress on such a small model.
            lr = config.lr * (1.0 - 0.9 * step / max(1, total_steps - 1))
            trainer.optimizer_step(lr=lr)
            trainer.zero_grads()
            last_loss = metrics["loss"]
            first_loss = last_loss if step == 0 else first_loss
            step += 1
            if progress is not None:
                progress(step, total_steps, last_loss)
    trainer.save_hf(out_dir)
    result = SFTResult(
        str(out_dir), len(examples), skipped, step, sum(sum(e.loss_mask) for e in examples), first_loss, last_loss,
        time.perf_counter() - started,
    )
    (Path(out_dir) / "sft.json").write_text(json.dumps(attrs.asdict(result), indent=2) + "\n", encoding="utf-8")
    log.info("sft_done", **attrs.asdict(result))
    return result


def demonstrations_digest(lines: Iterable[str], base_dir: str | Path, config: SFTConfig) -> str:
    """A cache key: the same demonstrations, base model and config give the same fine-tuned model."""
    digest = hashlib.sha256()
    for line in lines:
        digest.update(line.encode())
    digest.update((Path(base_dir) / "model.safetensors").read_bytes())
    digest.update(json.dumps(attrs.asdict(config), sort_keys=True).encode())
    return digest.hexdigest()[:16]
