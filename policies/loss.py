"""Group-normalised advantages and the GSPO objective (Zheng et al. 2025, "Group Sequence Policy Optimization").

Advantage of execution i in its group: A_i = (r_i - mean(r)) / (std(r) + eps), std with Bessel's correction; a
group of one has no baseline to compare against, so its advantage is 0.

GSPO clips a *sequence* ratio instead of per-token ratios:

    s_i = exp( (1/|y_i|) * sum_t [log pi(y_i,t) - log pi_old(y_i,t)] )      (mean over the sample's loss tokens)

and uses the GSPO-token form, which allows a per-token advantage A_i,t:

    s_i,t = sg[s_i] * pi(y_i,t) / sg[pi(y_i,t)]                              (value s_i; gradient s_i * grad log pi)
    J_i   = mean_t min( s_i,t * A_i,t , clip(s_i,t, 1 - clip_low, 1 + clip_high) * A_i,t )

With A_i,t = A_i its value and gradient equal sequence-level GSPO's. The loss is -J, averaged first within each
execution (over its loss tokens) and then over executions, so that an execution with a big tree does not weigh more
than one with a small tree. The paper's clip ranges are 3e-4 (low) and 4e-4 (high): a sequence ratio is a
geometric mean over many tokens, so it strays far less from 1 than token ratios do.

Tensors are [B, T] rows aligned with token positions (the trainer's `logprobs[b, t] = log p(ids[b, t] | ids[b, :t])`);
`advantages` may be [B] (one per row) or [B, T] (per token); `loss_mask` is bool or 0/1. Rows without loss tokens are
ignored. Metrics are plain floats.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence

import attrs
import torch

from gyre.messages.samples import TrainingSample
from gyre.policies.errors import LossInputError


def group_advantages(
    rewards: Sequence[float] | torch.Tensor, group_ids: Sequence[Hashable] | torch.Tensor, eps: float = 1e-6
) -> torch.Tensor:
    """(r - group mean) / (group sample std (Bessel) + eps) for each entry; 0 for a group of one, and exactly 0 for a
    group whose rewards are all equal. Returns a float tensor [N] (the rewards' dtype if they are a floating tensor,
    else float32).

    The arithmetic runs in float64 and equal rewards are special-cased: in float32 sixteen rewards of 0.2 have a
    mean 1.5e-8 off and a std of 1.5e-8, so with eps = 1e-6 every member got an advantage of -0.015. That is a
    uniform push down on everything a group without signal produced, and a normalising optimizer (Adam) turns even
    so small a gradient into a full-size step."""
    given = torch.as_tensor(rewards)
    if given.ndim != 1:
        raise LossInputError(f"rewards must be 1-D, got shape {tuple(given.shape)}")
    out_dtype = given.dtype if given.is_floating_point() else torch.float32
    values = given.to(torch.float64)
    ids = group_ids.tolist() if isinstance(group_ids, torch.Tensor) else list(group_ids)
    if len(ids) != values.shape[0]:
        raise LossInputError(f"{values.shape[0]} rewards but {len(ids)} group ids")
    if not bool(torch.isfinite(values).all()):
        raise LossInputError("rewards must be finite")
    if eps < 0:
        raise LossInputError(f"eps must be >= 0, got {eps}")
    members: dict[Hashable, list[int]] = {}
    for i, gid in enumerate(ids):
        members.setdefault(gid, []).append(i)
    advantages = torch.zeros_like(values)
    for rows in members.values():
        index = torch.tensor(rows)
        group = values[index]
        if len(rows) < 2 or bool((group == group[0]).all()):
            continue
        advantages[index] = (group - group.mean()) / (group.std(unbiased=True) + eps)
    return advantages.to(out_dtype)


@attrs.frozen
class _Terms:
    objective: torch.Tensor  # [B, T] per-token clipped surrogate, zero outside the mask
    mask: torch.Tensor  # [B, T] float
    tokens_per_row: torch.Tensor  # [B]
    seq_log_ratio: torch.Tensor  # [B], detached
    clipped: torch.Tensor  # [B, T] bool: loss tokens whose gradient clipping removed


def _gspo_terms(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    clip_low: float,
    clip_high: float,
) -> _Terms:
    if log_probs.ndim != 2:
        raise LossInputError(f"log_probs must be [B, T], got shape {tuple(log_probs.shape)}")
    shape = log_probs.shape
    for name, t in (("old_log_probs", old_log_probs), ("loss_mask", loss_mask)):
        if t.shape != shape:
            raise LossInputError(f"{name} has shape {tuple(t.shape)}, log_probs {tuple(shape)}")
    if advantages.shape == shape[:1]:
        advantages = advantages[:, None].expand(shape)
    elif advantages.shape != shape:
        raise LossInputError(f"advantages must be [B] or [B, T]; got {tuple(advantages.shape)} for {tuple(shape)}")
    if not 0.0 <= clip_low < 1.0 or clip_high < 0.0:
        raise LossInputError(f"need 0 <= clip_low < 1 and clip_high >= 0; got {clip_low}, {clip_high}")
    dtype = log_probs.dtype
    mask = loss_mask.to(dtype)
    old = old_log_probs.to(dtype).detach()
    advantages = advantages.to(dtype).detach()
    tokens_per_row = mask.sum(dim=1)
    # where() rather than a product keeps garbage (e.g. -inf) in padded positions out of the sums.
    token_log_ratio = torch.where(mask > 0, log_probs - old, torch.zeros_like(log_probs))
    seq_log_ratio = (token_log_ratio.sum(dim=1) / tokens_per_row.clamp(min=1.0)).detach()
    # GSPO-token: the value is the sequence ratio, the gradient flows through this token's own log-prob only.
    safe_log_probs = torch.where(mask > 0, log_probs, torch.zeros_like(log_probs))
    ratio = torch.exp(seq_log_ratio[:, None] + safe_log_probs - safe_log_probs.detach())
    unclipped = ratio * advantages
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * advantages
    objective = torch.minimum(unclipped, clipped) * mask
    with torch.no_grad():
        r = ratio.detach()
        cut = ((advantages > 0) & (r > 1.0 + clip_high)) | ((advantages < 0) & (r < 1.0 - clip_low))
        cut = cut & (mask > 0)
    return _Terms(objective, mask, tokens_per_row, seq_log_ratio, cut)


def _metrics(terms: _Terms, loss: torch.Tensor, num_executions: int) -> dict[str, float]:
    rows = terms.tokens_per_row > 0
    num_tokens = float(terms.tokens_per_row.sum())
    ratios = torch.exp(terms.seq_log_ratio[rows])
    return {
        "loss": float(loss.detach()),
        "num_loss_tokens": num_tokens,
        "num_rows": float(rows.sum()),
        "num_executions": float(num_executions),
        "clip_fraction": float(terms.clipped.sum()) / num_tokens if num_tokens else 0.0,
        "seq_ratio_mean": float(ratios.mean()) if ratios.numel() else 1.0,
        "seq_log_ratio_abs_max": float(terms.seq_log_ratio[rows].abs().max()) if ratios.numel() else 0.0,
    }


def _execution_index(execution_ids: Sequence[Hashable] | torch.Tensor, rows: int) -> torch.Tensor:
    ids = execution_ids.tolist() if isinstance(execution_ids, torch.Tensor) else list(execution_ids)
    if len(ids) != rows:
        raise LossInputError(f"{len(ids)} execution ids for {rows} rows")
    slots: dict[Hashable, int] = {}
    return torch.tensor([slots.setdefault(e, len(slots)) for e in ids], dtype=torch.long)


def gspo_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    execution_ids: Sequence[Hashable] | torch.Tensor | None = None,
    *,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
) -> tuple[torch.Tensor, dict[str, float]]:
    """GSPO loss (-J, see the module docstring) over [B, T] tensors.

    execution_ids None: each row is its own execution, loss = mean over rows of the row's token mean. Otherwise rows
    with equal ids form one execution: loss = mean over executions of the mean over all their loss tokens.
    """
    terms = _gspo_terms(log_probs, old_log_probs, advantages, loss_mask, clip_low, clip_high)
    row_sums = terms.objective.sum(dim=1)
    if execution_ids is None:
        index = torch.arange(log_probs.shape[0])
    else:
        index = _execution_index(execution_ids, log_probs.shape[0])
    slots = int(index.max()) + 1 if index.numel() else 0
    sums = torch.zeros(slots, dtype=row_sums.dtype).index_add(0, index, row_sums)
    tokens = torch.zeros(slots, dtype=row_sums.dtype).index_add(0, index, terms.tokens_per_row)
    present = tokens > 0
    num_executions = int(present.sum())
    if num_executions == 0:
        loss = (log_probs * 0.0).sum()  # keeps the graph: backward works and adds nothing
    else:
        loss = -(sums[present] / tokens[present]).mean()
    return loss, _metrics(terms, loss, num_executions)


@attrs.frozen
class PackedBatch:
    """Training samples padded into [B, T] tensors (padding: token 0, no loss, weight 0)."""

    input_ids: torch.Tensor
    """LongTensor [B, T]."""
    lengths: torch.Tensor
    """LongTensor [B]: real length of each row."""
    loss_mask: torch.Tensor
    """BoolTensor [B, T]."""
    old_log_probs: torch.Tensor
    """Float64 [B, T]: behaviour log-probs."""
    advantages: torch.Tensor
    """Float64 [B, T]."""
    weights: torch.Tensor
    """Float64 [B, T]: per-token loss weights; each execution's weights sum to 1 over all of its samples."""
    execution_ids: tuple[str, ...]
    """Execution of each row."""
    temperatures: torch.Tensor
    """Float32 [B, T]: the sampling temperature of each token (1 for padding); the trainer divides by it the logits
    that predict the token (MegatronTrainer.forward_backward)."""


def pack_samples(samples: Sequence[TrainingSample], pad_to: int | None = None, pad_id: int = 0) -> PackedBatch:
    """Stack samples into a PackedBatch (T = longest sample, or pad_to if given and not shorter)."""
    if not samples:
        raise LossInputError("pack_samples needs at least one sample")
    longest = max(len(s.token_ids) for s in samples)
    width = longest if pad_to is None else pad_to
    if width < longest:
        raise LossInputError(f"pad_to={pad_to} is shorter than the longest sample ({longest} tokens)")
    rows = len(samples)
    input_ids = torch.full((rows, width), pad_id, dtype=torch.long)
    loss_mask = torch.zeros((rows, width), dtype=torch.bool)
    old = torch.zeros((rows, width), dtype=torch.float64)
    adv = torch.zeros((rows, width), dtype=torch.float64)
    weights = torch.zeros((rows, width), dtype=torch.float64)
    temperatures = torch.ones((rows, width), dtype=torch.float32)
    for b, s in enumerate(samples):
        n = len(s.token_ids)
        fields = (s.loss_mask, s.behaviour_logprobs, s.advantages, s.weights, s.sampling_temperatures)
        if any(len(f) != n for f in fields):
            raise LossInputError(f"sample {b} of execution {s.execution_id}: per-token fields differ in length")
        if not all(math.isfinite(t) and t > 0 for t in s.sampling_temperatures):
            raise LossInputError(f"sample {b} of execution {s.execution_id}: sampling temperatures must be finite, > 0")
        input_ids[b, :n] = torch.tensor(s.token_ids, dtype=torch.long)
        loss_mask[b, :n] = torch.tensor(s.loss_mask, dtype=torch.bool)
        old[b, :n] = torch.tensor(s.behaviour_logprobs, dtype=torch.float64)
        adv[b, :n] = torch.tensor(s.advantages, dtype=torch.float64)
        weights[b, :n] = torch.tensor(s.weights, dtype=torch.float64)
        temperatures[b, :n] = torch.tensor(s.sampling_temperatures, dtype=torch.float32)
    lengths = torch.tensor([len(s.token_ids) for s in samples], dtype=torch.long)
    return PackedBatch(input_ids, lengths, loss_mask, old, adv, weights, tuple(s.execution_id for s in samples),
                       temperatures)


def length_sorted_chunks(samples: Sequence[TrainingSample], max_padded_tokens: int) -> list[list[TrainingSample]]:
    """The samples sorted by length and cut into chunks of at most `max_padded_tokens` once padded (a sample longer
    than that gets a chunk of its own).

    Why: a micro-step is filled in landing order, and padding every row to the longest one costs ~40% more
    forward/backward compute than the real tokens in the main job (samples of 120 to 640 tokens). The loss is a sum
    over rows (each execution's weights are fixed before batching), so chunks' gradients add up to the whole
    micro-step's."""
    if max_padded_tokens < 1:
        raise LossInputError(f"max_padded_tokens must be >= 1, got {max_padded_tokens}")
    chunks: list[list[TrainingSample]] = []
    current: list[TrainingSample] = []
    for sample in sorted(samples, key=lambda s: len(s.token_ids)):
        if current and len(sample.token_ids) * (len(current) + 1) > max_padded_tokens:
            chunks.append(current)
            current = []
        current.append(sample)
    if current:
        chunks.append(current)
    return chunks


def combine_chunk_metrics(parts: Sequence[dict[str, float]]) -> dict[str, float]:
    """One micro-step's metrics from its chunks' (`loss_from_samples` metrics plus the trainer's `num_tokens`): sums
    of losses and counts, the clip fraction weighted by loss tokens, the mean sequence ratio weighted by rows, the
    largest |sequence log-ratio|."""
    if not parts:
        raise LossInputError("combine_chunk_metrics needs at least one chunk")
    loss_tokens = sum(part["num_loss_tokens"] for part in parts)
    rows = sum(part["num_rows"] for part in parts)
    return {
        "loss": sum(part["loss"] for part in parts),
        "num_tokens": sum(part["num_tokens"] for part in parts),
        "num_loss_tokens": loss_tokens,
        "num_rows": rows,
        "num_executions": parts[0]["num_executions"],
        "clip_fraction": sum(part["clip_fraction"] * part["num_loss_tokens"] for part in parts) / loss_tokens
        if loss_tokens else 0.0,
        "seq_ratio_mean": sum(part["seq_ratio_mean"] * part["num_rows"] for part in parts) / rows if rows else 1.0,
        "seq_log_ratio_abs_max": max(part["seq_log_ratio_abs_max"] for part in parts),
        "chunks": len(parts),
    }


def loss_from_samples(
    log_probs: torch.Tensor,
    batch: PackedBatch,
    *,
    num_executions: int | None = None,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
) -> tuple[torch.Tensor, dict[str, float]]:
    """GSPO loss of a packed batch using the samples' own per-token weights: -sum(weight * J_t) / num_executions.

    The processor's weights make each execution's weights sum to 1, so with whole executions in the batch this is
    `gspo_loss(..., execution_ids)`. When one optimizer step's executions are spread over several micro-steps, pass
    the step's total `num_executions` to every micro-step: the accumulated gradients then sum to the step's mean over
    executions. By default it is the number of distinct executions in the batch.
    """
    if log_probs.shape != batch.loss_mask.shape:
        raise LossInputError(f"log_probs {tuple(log_probs.shape)} vs batch {tuple(batch.loss_mask.shape)}")
    terms = _gspo_terms(log_probs, batch.old_log_probs, batch.advantages, batch.loss_mask, clip_low, clip_high)
    executions = len(set(batch.execution_ids)) if num_executions is None else num_executions
    if executions <= 0:
        raise LossInputError(f"num_executions must be positive, got {executions}")
    weights = batch.weights.to(log_probs.dtype) * terms.mask
    loss = -(terms.objective * weights).sum() / executions
    return loss, _metrics(terms, loss, executions)
