"""Supervised fine-tuning on demonstrations: the warm start that lets RL begin from a model that sometimes succeeds.

A demonstration is a conversation in OpenAI message form plus its tools, tokenised with the model's own chat
template so that exactly the tokens the model would generate in its assistant turns carry loss: the same tokens the
proxy records as policy-emitted when the model plays that conversation out (actors/serving/sessions.py). Training
runs on the megatron-core trainer, the one RL uses.

Gyre's own template is decomposable per message (engines/chat_template.py): it is rendered piece by piece, and an
assistant piece's body (between `<|im_start|>assistant\n` and the trailing newline, `<|im_end|>` included) is the
target. A template a checkpoint brings (`ChatTemplate.decomposable` false: a Jinja template in its
tokenizer_config.json or chat_template.jinja) is rendered through the template, whole, never piece by piece
(`tokenize_rendered`):
- what the model generates in assistant turn k is the template's render of the conversation up to and including
  message k (no generation prompt) minus its render up to message k with the generation prompt, up to and including
  the first stop token (`<|im_end|>`, Llama's `<|eot_id|>`: `ChatTemplate.stop_token_ids`); what follows the stop
  token in the template's text (a newline) is not generated and carries no loss;
- the context before turn k is what the proxy's default `keep_generated` rule gives a rollout: the previous turn's
  generated tokens stand as generated, followed by the template's text after that turn (found by rendering with the
  turn replaced by a marker message, its leading turn end dropped: the generated stop token stands for it).
So where a template re-renders an earlier turn otherwise than it was generated (Qwen3 drops the `<think>` blocks of
assistant turns before the last user message), each turn is trained as the model generated it, its thinking
included, in the context it was generated in, and the sequence is one path: exactly the prompt and outputs a
rollout of that conversation records (tests/integration/engines/test_sft_templates.py plays it through the proxy's
sessions, with transformers' apply_chat_template as the oracle of each turn's text). The alternative, the template's
whole render (thinking dropped from earlier turns) with its assistant spans as targets, would train turns the model
never generated. Messages after the last assistant turn carry no loss and are left out.
"""

from __future__ import annotations

import hashlib
import json
import random
import secrets
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
    """The demonstration's ids and loss mask: piece by piece for Gyre's own template (`tokenize_pieces`), through
    the template for a checkpoint's own (`tokenize_rendered`)."""
    if template.decomposable:
        return tokenize_pieces(template, messages, tools)
    return tokenize_rendered(template, messages, tools)


def tokenize_pieces(
    template: ChatTemplate, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None
) -> SFTExample:
    """Gyre's template, piece by piece; assistant pieces are header + body + trailer, and only the body is a
    target."""
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


def tokenize_rendered(
    template: ChatTemplate, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None
) -> SFTExample:
    """Any template, rendered through it: each assistant turn's generated tokens are targets, in the context the
    proxy's keep_generated rule gives a rollout (see the module doc). SFTError for a demonstration without assistant
    turns, or a template whose renders do not show what a turn generates (a turn that does not follow its generation
    prompt, one with no stop token, assistant content the template rewrites so that a marker cannot be found)."""
    messages = list(messages)
    turns = [k for k, message in enumerate(messages) if isinstance(message, Mapping)
             and message.get("role") == "assistant"]
    if not turns:
        raise SFTError("a demonstration without assistant turns has nothing to learn")
    stops = frozenset(template.stop_token_ids)
    ids: list[int] = []
    mask: list[bool] = []
    previous = previous_stop = -1
    for k in turns:
        prompt = _render(template, messages[:k], tools, True)
        turn = _render(template, messages[: k + 1], tools, False)
        if not turn.startswith(prompt):
            raise SFTError(
                f"message {k} (assistant): the template does not render it after its generation prompt, so what "
                "the model would generate there is unknown")
        generated = template.encode(turn[len(prompt) :])
        end = next((i for i, token in enumerate(generated) if token in stops), None)
        if end is None:
            raise SFTError(
                f"message {k} (assistant): the template ends the turn with none of the stop tokens "
                f"{sorted(template.decode([t]) for t in stops)}, so the model would never learn to end it")
        context = prompt if previous < 0 else _text_after_turn(template, messages[:k], previous, previous_stop, tools)
        context_ids = template.encode(context)
        ids += context_ids + generated[: end + 1]
        mask += [False] * len(context_ids) + [True] * (end + 1)
        previous, previous_stop = k, generated[end]
    return SFTExample(tuple(ids), tuple(mask))


def _render(template: ChatTemplate, messages: Sequence[Mapping[str, Any]], tools: Any, generation: bool) -> str:
    try:
        return template.render_text(messages, tools, add_generation_prompt=generation)
    except ValueError as error:  # ChatTemplateError: the template refused the conversation
        raise SFTError(f"the chat template cannot render this demonstration: {error}") from None


def _text_after_turn(template: ChatTemplate, messages: Sequence[Mapping[str, Any]], index: int, stop: int,
                     tools: Any) -> str:
    """The template's text after assistant message `index` of `messages`, generation prompt included, as the
    proxy's keep_generated rule finds it (`ChatTemplate.turn_text_after`: a marker in the turn's place, its leading
    turn end dropped since the generated stop token `stop` stands for it)."""
    try:
        after = template.turn_text_after(messages, index, tools, marker="gyre-sft-marker-" + secrets.token_hex(8),
                                         stop_id=stop)
    except ValueError as error:  # ChatTemplateError: the template refused the conversation
        raise SFTError(f"the chat template cannot render this demonstration: {error}") from None
    if after is None:
        raise SFTError(
            f"message {index} (assistant): the template rewrites assistant content (a marker put in its place is "
            "not in the render once), so the text after the turn cannot be told apart")
    return after


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
