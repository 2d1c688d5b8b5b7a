"""Role pictures: one row per cell, colour by role over virtual time, one panel per policy (matplotlib, PNG)."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

__all__ = ["draw_roles"]

COLOURS = {"rollout": "#4c8bd6", "train": "#e0823a", "switching": "#b0b0b0"}


def draw_roles(runs: Sequence, path: Path) -> Path:
    """Write one PNG with a panel per run (PolicyRun.intervals)."""
    import matplotlib

    matplotlib.use("Agg")  # no display: files only
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(runs), 1, figsize=(10, 1.0 + 0.9 * len(runs)), squeeze=False)
    for ax, run in zip(axes[:, 0], runs):
        cells = sorted({cell for cell, _, _, _ in run.intervals})
        rows = {cell: index for index, cell in enumerate(cells)}
        for cell, role, start, end in run.intervals:
            ax.broken_barh([(start / 3600, (end - start) / 3600)], (rows[cell] - 0.4, 0.8),
                           facecolors=COLOURS.get(role, "black"))
        ax.set_yticks(range(len(cells)), cells, fontsize=5)
        ax.set_ylabel(f"{run.name}\n{run.hours:.2f} h", rotation=0, ha="right", va="center", fontsize=7)
        ax.tick_params(axis="x", labelsize=6)
    axes[-1, 0].set_xlabel("hours (virtual)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in COLOURS.values()]
    fig.legend(handles, list(COLOURS), loc="upper right", fontsize=7, ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)
