"""Emulated cells calibrated from a recorded run: what the run's own cells did, fit from its event log.

`gyre replay LOG --control-plane` (counterfactual.py) re-runs a recorded run's control plane over emulated cells;
a GPU hardware profile (hardware.py) would say what an H200 does, not what the recorded cells did. This module fits,
by pure functions, a `CalibratedCellModel` with the interface an emulated cell and its engine use (the methods of
`hardware.CellModel`), from these messages of the log:

- decode: `ModelCallCompleted` (cell, started_s, finished_s, output tokens, prompt and cached tokens). For each
  call, the time-averaged number of calls in flight on its cell while it ran (itself included) is `n`
  (`time_averaged_concurrency`); the call's duration is fit by non-negative least squares (`fit_nonnegative`) as
  `call_overhead_s + output x (decode_base_s + decode_per_sequence_s x n) + prefilled x prefill_s_per_token`,
  prefilled = prompt - cached tokens. So one decode iteration of n sequences takes `decode_base_s +
  decode_per_sequence_s x n` (each sequence gets one token an iteration, as in engine.py); the per-call overhead
  (HTTP, tokenising, first-token latency) and a call's prefill are in that call's own time only, so the replay adds
  them as latency before each call (counterfactual.CallOverhead) and runs the engine with prefill at no cost (the
  model's own `mixed_iteration_s` still prices prefill per token, for other uses). Context length is not a term (the recorded CPU cells' contexts are
  short; a log of long contexts would want one).
- training: a micro-step's time, the cell's `ClaimGranted` reply (handled at the cell) to its `MicroStepDone`
  (the first delivery), against `MicroStepDone.num_tokens`: `train_fixed_s + train_s_per_token x tokens`.
- the optimizer step: the core's `StepApplied` minus the later of the step's `StepReady` and its last
  `MicroStepDone` (median).
- role switches: `RoleChanged.switch_s` by direction (median); a direction the run never switched falls back to
  the cells' boot into that role (the first `RoleChanged`, previous role ""), else to the other direction.
- weight sync: `WeightsLoaded.seconds` of versions after 0 (median; version 0 is the boot's load), bytes from
  `WeightsPublished.nbytes`.
- capacity: the largest `LoadReport.capacity_requests` a rollout cell reported; KV tokens and the engine's bound
  on running requests from the cells' recorded configs (`EngineConfig`), when the log has them.

Bounds: the fit keeps five numbers per call and per micro-step; `time_averaged_concurrency` is a sort and a sweep.
"""

from __future__ import annotations

import itertools
import math
import statistics
from typing import Iterable, Sequence

import attrs
import numpy as np

from gyre.messages.cells import ROLLOUT, TRAIN

__all__ = ["CalibratedCellModel", "CallRecord", "MicroStepRecord", "fit_nonnegative", "time_averaged_concurrency",
           "fit_decode", "fit_train", "fit_cell_model"]


@attrs.frozen
class CallRecord:
    """One model call as the fit needs it."""

    cell: str
    started_s: float
    finished_s: float
    output_tokens: int
    prefilled_tokens: int
    """Prompt tokens the engine computed (prompt minus those served from its prefix cache)."""


@attrs.frozen
class MicroStepRecord:
    """One trained micro-step: tokens and seconds (grant to done)."""

    cell: str
    tokens: int
    seconds: float


@attrs.frozen
class CalibratedCellModel:
    """A cell's cost model fit from a recorded run (module docstring); the interface of `hardware.CellModel`."""

    decode_base_s: float = 0.0
    """A decode iteration's time independent of how many sequences it decodes."""
    decode_per_sequence_s: float = 0.0
    """A decode iteration's time per running sequence."""
    prefill_s_per_token: float = 0.0
    """Prefill time per computed prompt token."""
    call_overhead_s: float = 0.0
    """Fixed latency of every call outside the engine's iterations (added before each call by the replay)."""
    train_fixed_s: float = 0.0
    """A micro-step's time independent of its tokens."""
    train_s_per_token: float = 0.0
    """A micro-step's time per token."""
    optimizer_step_s: float = 0.0
    """The core's optimizer step after a step's last micro-step."""
    rollout_to_train_s: float = 0.0
    train_to_rollout_s: float = 0.0
    weight_sync_s: float = 0.0
    """A rollout cell loading a new version (generation paused)."""
    gradient_reduce_s: float = 0.0
    """Satellites' gradients into the core: part of the recorded optimizer step times, so 0 here."""
    weight_bytes: int = 0
    """Bytes of one published version."""
    kv_capacity_tokens: int = 1 << 20
    """KV tokens one rollout cell holds."""
    max_running_requests: int = 1024
    """The engine's bound on sequences decoding at once."""
    capacity: int = 0
    """Sessions a rollout cell reported it keeps (0: KV tokens over the mean context)."""
    chunked_prefill_tokens: int = 1 << 30
    """Prompt tokens one iteration takes at most (no chunking: the fit prices prefill per token)."""
    fit: dict = attrs.field(factory=dict, eq=False)
    """What each figure was fit from (counts, medians), for the report."""

    # ---- rollout --------------------------------------------------------------------------------------------------
    def decode_iteration_s(self, sequences: int, context_tokens: float) -> float:
        return self.decode_base_s + self.decode_per_sequence_s * max(1, sequences)

    def decode_tokens_per_s(self, sequences: int, context_tokens: float) -> float:
        if sequences <= 0:
            return 0.0
        iteration_s = self.decode_iteration_s(sequences, context_tokens)
        return sequences / iteration_s if iteration_s > 0 else float("inf")

    @property
    def prefill_tokens_per_s(self) -> float:
        return 1.0 / self.prefill_s_per_token if self.prefill_s_per_token > 0 else float("inf")

    def mixed_iteration_s(self, sequences: int, context_tokens: float, prefill_tokens: float) -> float:
        decode_s = self.decode_iteration_s(sequences, context_tokens) if sequences else self.decode_base_s
        prefill_s = min(prefill_tokens, self.chunked_prefill_tokens) * self.prefill_s_per_token
        # An iteration that does nothing measurable still advances (the engine divides by it).
        return max(decode_s + prefill_s, 1e-6)

    def capacity_sessions(self, mean_context_tokens: float) -> int:
        if self.capacity > 0:
            return self.capacity
        return max(1, min(self.max_running_requests,
                          math.floor(self.kv_capacity_tokens / max(1.0, mean_context_tokens))))

    # ---- training -------------------------------------------------------------------------------------------------
    def train_s(self, tokens: int) -> float:
        return self.train_fixed_s + self.train_s_per_token * tokens


def fit_nonnegative(rows: Sequence[Sequence[float]], targets: Sequence[float]) -> tuple[float, ...]:
    """Least squares `rows @ x ~ targets` with every coefficient >= 0: the best unconstrained fit over every subset
    of the columns whose solution is non-negative (exact for the few columns the fits here use)."""
    a = np.asarray(rows, dtype=float)
    y = np.asarray(targets, dtype=float)
    if a.ndim != 2 or len(a) != len(y) or len(y) == 0:
        raise ValueError("fit_nonnegative: rows and targets must be non-empty and of the same length")
    columns = a.shape[1]
    best: tuple[float, np.ndarray] | None = None
    for size in range(1, columns + 1):
        for subset in itertools.combinations(range(columns), size):
            solution, *_ = np.linalg.lstsq(a[:, subset], y, rcond=None)
            if (solution < -1e-12).any():
                continue
            x = np.zeros(columns)
            x[list(subset)] = np.maximum(solution, 0.0)
            error = float(np.sum((a @ x - y) ** 2))
            if best is None or error < best[0] - 1e-15:
                best = (error, x)
    if best is None:
        return (0.0,) * columns
    return tuple(float(v) for v in best[1])


def time_averaged_concurrency(intervals: Sequence[tuple[float, float]]) -> list[float]:
    """For each interval, the mean number of the intervals (itself included) open while it is open. Intervals of
    zero length get the count at their instant."""
    if not intervals:
        return []
    points = sorted({t for interval in intervals for t in interval})
    index = {t: i for i, t in enumerate(points)}
    delta = np.zeros(len(points))
    for start, end in intervals:
        delta[index[start]] += 1
        delta[index[end]] -= 1
    open_after = np.cumsum(delta)  # intervals open on [points[i], points[i+1])
    widths = np.diff(np.asarray(points))
    integral = np.concatenate([[0.0], np.cumsum(open_after[:-1] * widths)])
    out = []
    for start, end in intervals:
        if end > start:
            out.append(float((integral[index[end]] - integral[index[start]]) / (end - start)))
        else:
            out.append(float(max(1.0, open_after[index[start]] + 1)))
    return out


def fit_decode(calls: Iterable[CallRecord]) -> dict[str, float]:
    """call_overhead_s, decode_base_s, decode_per_sequence_s and prefill_s_per_token (module docstring)."""
    by_cell: dict[str, list[CallRecord]] = {}
    for call in calls:
        if call.finished_s >= call.started_s and call.output_tokens > 0:
            by_cell.setdefault(call.cell, []).append(call)
    rows, targets = [], []
    for cell_calls in by_cell.values():
        concurrency = time_averaged_concurrency([(c.started_s, c.finished_s) for c in cell_calls])
        for call, n in zip(cell_calls, concurrency):
            rows.append((1.0, call.output_tokens, call.output_tokens * n, call.prefilled_tokens))
            targets.append(call.finished_s - call.started_s)
    if not rows:
        raise ValueError("no model call with output tokens to fit decode from")
    overhead, base, per_sequence, prefill = fit_nonnegative(rows, targets)
    return {"call_overhead_s": overhead, "decode_base_s": base, "decode_per_sequence_s": per_sequence,
            "prefill_s_per_token": prefill, "calls": len(rows)}


def fit_train(microsteps: Iterable[MicroStepRecord]) -> dict[str, float]:
    """train_fixed_s and train_s_per_token; one micro-step (or all of one size) gives a rate through the origin."""
    records = [m for m in microsteps if m.seconds >= 0 and m.tokens > 0]
    if not records:
        raise ValueError("no trained micro-step to fit training time from")
    if len({m.tokens for m in records}) == 1:
        rate = statistics.median(m.seconds for m in records) / records[0].tokens
        return {"train_fixed_s": 0.0, "train_s_per_token": rate, "microsteps": len(records)}
    fixed, per_token = fit_nonnegative([(1.0, m.tokens) for m in records], [m.seconds for m in records])
    return {"train_fixed_s": fixed, "train_s_per_token": per_token, "microsteps": len(records)}


def _median(values: Sequence[float], default: float) -> float:
    return float(statistics.median(values)) if values else default


def fit_cell_model(
    calls: Sequence[CallRecord], microsteps: Sequence[MicroStepRecord], optimizer_s: Sequence[float],
    switches: dict[tuple[str, str], list[float]], weight_loads_s: Sequence[float], weight_bytes: int = 0,
    capacity: int = 0, kv_capacity_tokens: int = 1 << 20, max_running_requests: int = 1024,
) -> CalibratedCellModel:
    """The model from the figures the log gave (module docstring); `switches` maps (previous role, role) to the
    switch times seen, previous role "" for boots."""
    decode = fit_decode(calls)
    train = fit_train(microsteps)

    def switch(previous: str, role: str) -> float:
        for key in ((previous, role), ("", role), (role, previous)):
            if switches.get(key):
                return _median(switches[key], 0.0)
        return 0.0

    fit = {**decode, **train, "optimizer_steps": len(optimizer_s), "weight_loads": len(weight_loads_s),
           "switches": {f"{a or 'boot'}->{b}": len(v) for (a, b), v in sorted(switches.items())}}
    return CalibratedCellModel(
        decode_base_s=decode["decode_base_s"], decode_per_sequence_s=decode["decode_per_sequence_s"],
        prefill_s_per_token=decode["prefill_s_per_token"], call_overhead_s=decode["call_overhead_s"],
        train_fixed_s=train["train_fixed_s"], train_s_per_token=train["train_s_per_token"],
        optimizer_step_s=_median(optimizer_s, 0.0),
        rollout_to_train_s=switch(ROLLOUT, TRAIN), train_to_rollout_s=switch(TRAIN, ROLLOUT),
        weight_sync_s=_median(weight_loads_s, 0.0), weight_bytes=weight_bytes,
        kv_capacity_tokens=kv_capacity_tokens, max_running_requests=max_running_requests, capacity=capacity, fit=fit,
    )
