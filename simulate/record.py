"""What an emulated run leaves behind for the harness: each cell's roles over time, busy time, step times, and where
each cell's time went (`seconds`, by the keys of simulate/accounting.py).

Actors of one emulated topology write here (it rides in their configs, in process); the harness reads it after the
run. It is an output channel like gyre.testing's log capture, not state any actor reads back.
"""

from __future__ import annotations

import collections

__all__ = ["RunRecord"]


class RunRecord:
    """Appends only; `role_intervals(end_s)` turns role changes into (cell, role, start, end)."""

    def __init__(self) -> None:
        self.role_changes: list[tuple[str, float, str]] = []
        self.busy_s: collections.Counter[str] = collections.Counter()
        self.step_times_s: dict[int, float] = {}
        self.trained_tokens = 0
        self.executions_finished = 0
        self.model_calls = 0
        self.seconds: collections.Counter[str] = collections.Counter()
        """Cell-seconds by what the cells did (accounting.py names the keys), summed over cells."""

    def role(self, cell: str, time_s: float, role: str) -> None:
        self.role_changes.append((cell, time_s, role))

    def busy(self, cell: str, seconds: float) -> None:
        self.busy_s[cell] += seconds

    def account(self, key: str, seconds: float) -> None:
        self.seconds[key] += seconds

    def step(self, step_id: int, time_s: float) -> None:
        self.step_times_s[step_id] = time_s

    def trained(self, tokens: int) -> None:
        self.trained_tokens += tokens

    def role_intervals(self, end_s: float) -> list[tuple[str, str, float, float]]:
        by_cell: dict[str, list[tuple[float, str]]] = collections.defaultdict(list)
        for cell, time_s, role in self.role_changes:
            by_cell[cell].append((time_s, role))
        intervals = []
        for cell in sorted(by_cell):
            changes = by_cell[cell]
            for (start, role), (end, _) in zip(changes, changes[1:] + [(end_s, "")]):
                if end > start:
                    intervals.append((cell, role, start, min(end, end_s)))
        return intervals
