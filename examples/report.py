"""Draw a training run's report from run.json and the held-out evaluations: PNGs and summary.json."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROLE_COLOURS = {"rollout": "tab:blue", "train": "tab:orange", "switching": "tab:gray", "starting": "white"}


def _reward_curve(run: dict, path: Path) -> None:
    groups = [g for g in run["groups"] if g["scored"]]
    figure, axis = plt.subplots(figsize=(7, 3.5))
    if groups:
        times = [g["t_s"] for g in groups]
        rewards = [g["mean_reward"] for g in groups]
        axis.plot(times, rewards, ".", alpha=0.4, label="group mean reward")
        window = 8
        smooth = [statistics.fmean(rewards[max(0, i - window + 1) : i + 1]) for i in range(len(rewards))]
        axis.plot(times, smooth, "-", label=f"moving mean ({window} groups)")
    for step in run["steps"]:
        axis.axvline(step["t_s"], color="gray", alpha=0.15)
    axis.set_xlabel("seconds since start (grey lines: optimizer steps)")
    axis.set_ylabel("reward")
    axis.set_title("Reward per GSPO group")
    axis.legend(loc="lower right")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def _role_timeline(run: dict, path: Path) -> None:
    cells = run["cells"]
    end = run["elapsed_s"]
    figure, axis = plt.subplots(figsize=(7, 0.6 + 0.5 * len(cells)))
    for row, cell in enumerate(cells):
        changes = [c for c in run["role_changes"] if c["cell"] == cell]
        for index, change in enumerate(changes):
            stop = changes[index + 1]["t_s"] if index + 1 < len(changes) else end
            axis.barh(row, stop - change["t_s"], left=change["t_s"], color=ROLE_COLOURS.get(change["role"], "black"),
                      edgecolor="none")
    axis.set_yticks(range(len(cells)), cells)
    axis.set_xlabel("seconds since start")
    axis.set_title("Cell roles (blue: rollout, orange: train)")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def write_report(report_dir: str | Path, before: dict[str, Any], after: dict[str, Any], extra: dict[str, Any]) -> dict:
    """Write reward_curve.png, cell_roles.png and summary.json into `report_dir`; returns the summary."""
    folder = Path(report_dir)
    run = json.loads((folder / "run.json").read_text(encoding="utf-8"))
    _reward_curve(run, folder / "reward_curve.png")
    _role_timeline(run, folder / "cell_roles.png")
    switches = [c for c in run["role_changes"] if c["previous"]]
    by_direction: dict[str, list[float]] = {}
    for change in switches:
        by_direction.setdefault(f"{change['previous']}_to_{change['role']}", []).append(change["switch_s"])
    summary = {
        "success_rate_before": before["success_rate"],
        "success_rate_after": after["success_rate"],
        "mean_reward_before": before["mean_reward"],
        "mean_reward_after": after["mean_reward"],
        "success_by_kind_before": before.get("success_by_kind", {}),
        "success_by_kind_after": after.get("success_by_kind", {}),
        "steps": len(run["steps"]),
        "wall_s": extra.get("wall_s", run["elapsed_s"]),
        "train_wall_s": run["elapsed_s"],
        "samples_trained": sum(s["samples"] for s in run["steps"] if not s.get("skipped")),
        "tokens_trained": sum(s["tokens"] for s in run["steps"] if not s.get("skipped")),
        "steps_skipped": sum(1 for s in run["steps"] if s.get("skipped")),
        "stale_samples_dropped": sum(s["stale_dropped"] for s in run["steps"]),
        "groups_landed": sum(1 for g in run["groups"] if g["landed"]),
        "groups_dropped": sum(1 for g in run["groups"] if not g["landed"]),
        "switch_counts": {k: len(v) for k, v in by_direction.items()},
        "switch_median_s": {k: statistics.median(v) for k, v in by_direction.items()},
        **{k: v for k, v in extra.items() if k != "wall_s"},
    }
    (folder / "summary.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    return summary
