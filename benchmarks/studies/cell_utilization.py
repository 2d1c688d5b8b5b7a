"""Where each cell's time went in a training run: its roles, and how busy it was in each, read off the event log.

    python benchmarks/studies/cell_utilization.py REPORT_DIR [REPORT_DIR ...] [--json]

A policy can only win time that some cell spends idle, so this is the question to ask of a policy comparison
(`gyre bench policies --out DIR` keeps each run's report folder). Over the steady window of a run (the first applied
step to the last, as the policy bench measures), per cell:

- the share of the window spent in each role (rollout, train, switching);
- training: the share of its train time with a micro-step in hand (from the ClaimGranted that gave it one to the
  MicroStepDone it sent; a cell may hold two, their union counts);
- rollout: the time-weighted mean of running generations its load reports give, and the share of its rollout time
  in which it ran none.

Read from the log alone (the records carry the handling actor's clock, the same wall clock in every process of a
local run), so it works on any recorded run, old ones included. A satellite's micro-step ends when its MicroStepDone
reaches the core (which then pulls the gradients); the core's own when it tells itself.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Iterable

from gyre.messages.cells import LoadReport, RoleChanged
from gyre.messages.training import ClaimGranted, MicroStepDone, StepApplied
from gyre.runtime.codec import Codec
from gyre.runtime.event_log import read_log

WANTED = {"gyre.cells.RoleChanged", "gyre.cells.LoadReport", "gyre.training.ClaimGranted",
          "gyre.training.MicroStepDone", "gyre.training.StepApplied"}


def _union_s(intervals: Iterable[tuple[float, float]], start: float, end: float) -> float:
    """Length of the union of `intervals`, clipped to [start, end]."""
    total, reach = 0.0, start
    for a, b in sorted((max(a, start), min(b, end)) for a, b in intervals):
        if b <= a or b <= reach:
            continue
        total += b - max(a, reach)
        reach = b
    return total


def utilization(log_path: Path) -> dict[str, Any]:
    """Per-cell role shares and busy shares over the run's steady window (see the module doc)."""
    codec = Codec()
    changes: dict[str, list[tuple[float, str, float]]] = {}
    """cell -> (announced at, role, seconds the switch into it took), in order."""
    loads: dict[str, list[tuple[float, int, str]]] = {}
    granted: dict[tuple[str, int, int], float] = {}
    done: dict[tuple[str, int, int], float] = {}
    busy: dict[str, list[tuple[float, float]]] = {}
    step_at: dict[int, float] = {}
    for record in read_log(log_path, codec):
        if record.type_name not in WANTED:
            continue
        message = record.decode(codec)
        receiver = record.envelope.receiver
        if isinstance(message, RoleChanged):
            if record.envelope.sender == message.cell == receiver:  # one copy of each: the cell's own
                changes.setdefault(message.cell, []).append(
                    (record.handled_s, message.role, message.switch_s if message.previous_role else 0.0))
        elif isinstance(message, LoadReport):
            if receiver == message.cell:
                loads.setdefault(message.cell, []).append((message.time_s, message.running_requests, message.role))
        elif isinstance(message, ClaimGranted):
            if message.samples:
                key = (receiver, message.step_id, message.microstep_index)
                granted[key] = min(granted.get(key, record.handled_s), record.handled_s)
        elif isinstance(message, MicroStepDone):
            key = (message.cell, message.step_id, message.microstep_index)
            done[key] = min(done.get(key, record.handled_s), record.handled_s)
        elif isinstance(message, StepApplied):
            step_at[message.step_id] = min(step_at.get(message.step_id, record.handled_s), record.handled_s)
    # A log's records come in the order of its parts (one per process), not of time: pair and sort afterwards.
    for key, at in granted.items():
        if key in done and done[key] >= at:
            busy.setdefault(key[0], []).append((at, done[key]))
    for timeline in changes.values():
        timeline.sort()
    for reports in loads.values():
        reports.sort()
    steps = sorted(step_at.values())
    if len(steps) < 2:
        raise SystemExit(f"{log_path}: fewer than two applied steps; no steady window")
    start, end = steps[0], steps[-1]
    window = end - start
    cells: dict[str, Any] = {}
    for cell, timeline in sorted(changes.items()):
        spans: dict[str, list[tuple[float, float]]] = {"rollout": [], "train": [], "switching": []}
        for (t, role, _), following in zip(timeline, timeline[1:] + [(float("inf"), "", 0.0)]):
            leaves_at = following[0] - following[2]  # the next switch began switch_s before it was announced
            spans.setdefault(role, []).append((t, leaves_at))
            spans["switching"].append((leaves_at, following[0]))
        share = {role: _union_s(intervals, start, end) for role, intervals in spans.items()}
        train_busy_s = _union_s([(max(a, s), min(b, e)) for a, b in busy.get(cell, []) for s, e in spans["train"]
                                 if min(b, e) > max(a, s)], start, end)
        reports = [(t, n) for t, n, role in loads.get(cell, []) if role == "rollout" and start <= t <= end]
        weighted = idle = covered = 0.0
        for (t, n), (t_next, _) in zip(reports, reports[1:]):
            dt = t_next - t
            covered += dt
            weighted += n * dt
            idle += dt if n == 0 else 0.0
        cells[cell] = {
            "rollout_share": share["rollout"] / window, "train_share": share["train"] / window,
            "switching_share": share["switching"] / window,
            "train_busy_share": train_busy_s / share["train"] if share["train"] else None,
            "rollout_mean_running": weighted / covered if covered else None,
            "rollout_idle_share": idle / covered if covered else None,
            "switches": sum(1 for t, _, _ in timeline[1:] if start <= t <= end),
        }
    return {"window_s": window, "steps": len(steps), "s_per_step": window / (len(steps) - 1), "cells": cells}


def _print(name: str, result: dict[str, Any]) -> None:
    print(f"{name}: {result['s_per_step']:.1f} s/step over {result['window_s']:.0f} s ({result['steps']} steps)")
    for cell, row in result["cells"].items():
        def pct(value):
            return "   -" if value is None else f"{100 * value:3.0f}%"

        running = "   -" if row["rollout_mean_running"] is None else f"{row['rollout_mean_running']:4.1f}"
        print(f"  {cell:<6} rollout {pct(row['rollout_share'])} train {pct(row['train_share'])} switching "
              f"{pct(row['switching_share'])} | train busy {pct(row['train_busy_share'])} | rollout running "
              f"{running}, none {pct(row['rollout_idle_share'])} | switches {row['switches']}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("reports", nargs="+", help="report folders (each holds events.glog) or event logs")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    results = {}
    for report in args.reports:
        path = Path(report)
        log_path = path / "events.glog" if path.is_dir() else path
        results[report] = utilization(log_path)
    if args.json:
        print(json.dumps(results, indent=1))
    else:
        for name, result in results.items():
            _print(name, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
