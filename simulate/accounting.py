"""Where an emulated run's cell-hours went, and what a perfect packing of its own work would take.

Every cell-second of a run (cells x its length) is in one of these, booked by the emulated cells (cells.py, from the
engine's counters in engine.py and the train role's marks) into `RunRecord.seconds`:

- rollout.decode: engine iterations decoding (an iteration's time less the prefill chunk mixed into it), at the
  mean batch and KV occupancy reported under "decode";
- rollout.prefill: prefilling the workload's own new tokens (prompts, tool observations);
- rollout.prefill_evicted: prefilling again the share of a prefix the cell's KV could not keep (more sessions held
  than the KV holds: engine.py's prefix-cache model);
- rollout.prefill_moved: prefilling again the whole context of a session that came without its KV (re-placed after
  its cell left rollout without migrating it, as colocate's cells do);
- rollout.tools: the cell holds sessions but every one is in setup, a tool call or scoring: nothing to compute;
- rollout.weight_sync: generation paused while a new version loads;
- rollout.empty: no session at all;
- train.compute: micro-steps (forward, backward, log-probs);
- train.optimizer: the core's optimizer step (and the satellites' gradients reduced into it);
- train.weight_sync: a satellite in the train role loading the new version;
- train.idle_step_filling: a train cell with nothing to claim while the step still waits for samples (the rollout
  tail of the step: every execution of it must land before the last micro-step exists);
- train.idle_step_fixed: a train cell with nothing to claim although the step is fixed (its last micro-steps are
  on other cells, or the next step waits for the optimizer step);
- switching: between roles (the role intervals);
- unaccounted: the rest, which should be ~0: the last tick before the run ended (at most `tick_s` a cell).

The bounds (`packed_hours`): a run's own necessary work, rollout decode at the occupancy the run reached, its
workload's prefill, training compute and optimizer steps, packed perfectly onto every cell (no tool wait, no idle,
no re-prefill, no switch, no weight sync): no schedule that decodes at that occupancy does better; and the same with
decode at the best occupancy the KV allows (every cell's KV full of sequences at the workload's mean context, none in
a tool call), the work term of harness.lower_bound computed from the run's own output tokens.
"""

from __future__ import annotations

from typing import Any

from gyre.simulate.hardware import CellModel

__all__ = ["KEYS", "account", "packed_hours", "best_decode_tokens_per_s"]

KEYS = (
    "rollout.decode", "rollout.prefill", "rollout.prefill_evicted", "rollout.prefill_moved", "rollout.tools",
    "rollout.weight_sync", "rollout.empty", "train.compute", "train.optimizer", "train.weight_sync",
    "train.idle_step_filling", "train.idle_step_fixed", "switching", "unaccounted",
)
"""Every account, in the order the output shows them (module docstring)."""

NECESSARY = ("rollout.decode", "rollout.prefill", "train.compute", "train.optimizer")
"""The accounts any schedule pays for this work (decode at the run's own occupancy)."""


def best_decode_tokens_per_s(model: Any, mean_context_tokens: float) -> float:
    """A cell's decode rate with its KV full of sequences at the mean context (or at the engine's running bound)."""
    sequences = max(1, min(model.max_running_requests, int(model.kv_capacity_tokens // mean_context_tokens)))
    return model.decode_tokens_per_s(sequences, sequences * mean_context_tokens)


def account(seconds: dict[str, float], cells: int, end_s: float, switching_s: float, model: CellModel,
            mean_context_tokens: float) -> dict[str, Any]:
    """The run's cell-hours by account (KEYS), and its decode occupancy, from the cells' bookings (`seconds`,
    RunRecord.seconds), the run's length and its time switching."""
    hours = {key: 0.0 for key in KEYS}
    prefill_s = seconds.get("rollout.prefill_s", 0.0)
    started = seconds.get("rollout.prefill_started_tokens", 0.0)
    evicted = seconds.get("rollout.evicted_prefill_tokens", 0.0)
    moved = seconds.get("rollout.moved_prefill_tokens", 0.0)
    # Prefill time is linear in tokens (chunk / prefill rate per iteration), so its causes split it by tokens.
    again = (evicted + moved) / started if started > 0 else 0.0
    hours["rollout.decode"] = seconds.get("rollout.decode_s", 0.0) / 3600
    hours["rollout.prefill"] = prefill_s * (1.0 - again) / 3600
    hours["rollout.prefill_evicted"] = prefill_s * (evicted / started if started > 0 else 0.0) / 3600
    hours["rollout.prefill_moved"] = prefill_s * (moved / started if started > 0 else 0.0) / 3600
    hours["rollout.tools"] = seconds.get("rollout.tools_s", 0.0) / 3600
    hours["rollout.weight_sync"] = seconds.get("rollout.paused_s", 0.0) / 3600
    hours["rollout.empty"] = seconds.get("rollout.empty_s", 0.0) / 3600
    for key in ("train.compute", "train.optimizer", "train.weight_sync", "train.idle_step_filling",
                "train.idle_step_fixed"):
        hours[key] = seconds.get(key, 0.0) / 3600
    hours["switching"] = switching_s / 3600
    total_h = cells * end_s / 3600
    hours["unaccounted"] = total_h - sum(hours.values())
    decoding_s = seconds.get("rollout.decoding_s", 0.0)
    output = seconds.get("rollout.output_tokens", 0.0)
    decode_s = seconds.get("rollout.decode_s", 0.0)
    best = best_decode_tokens_per_s(model, mean_context_tokens)
    rate = output / decode_s if decode_s > 0 else 0.0
    return {
        "total_cell_hours": total_h,
        "cell_hours": hours,
        "decode": {
            "output_tokens": int(output),
            "mean_sequences": seconds.get("rollout.decoding_sequence_s", 0.0) / decoding_s if decoding_s else 0.0,
            "capacity_sessions": model.capacity_sessions(mean_context_tokens),
            "mean_kv_occupancy": (seconds.get("rollout.decoding_kv_token_s", 0.0) / decoding_s
                                  / model.kv_capacity_tokens if decoding_s else 0.0),
            "tokens_per_cell_s": rate,
            "best_tokens_per_cell_s": best,
            "best_decode_cell_hours": output / best / 3600,
        },
    }


def packed_hours(accounts: dict[str, Any], cells: int) -> dict[str, float]:
    """Hours the run's own necessary work takes packed perfectly onto `cells` (module docstring): at the run's own
    decode occupancy, and at the best occupancy the KV allows."""
    hours = accounts["cell_hours"]
    necessary = sum(hours[key] for key in NECESSARY)
    at_best = necessary - hours["rollout.decode"] + accounts["decode"]["best_decode_cell_hours"]
    return {"packed_hours": necessary / cells, "packed_best_decode_hours": at_best / cells}
