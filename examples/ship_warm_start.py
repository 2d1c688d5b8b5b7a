"""Put a warm start built by `gyre run examples/agent_rl.py --warm-start rebuild` into examples/warm_start.

    python3 examples/ship_warm_start.py REPORT [--to examples/warm_start]

REPORT is the report folder of the run that built it (its prepare.json names the cached warm start and how long
preparing took). What is written, into a staging folder renamed into place at the end:
- the model files (config, generation config, safetensors, tokenizer) and the held-out score files the run cached
  beside them (`eval-*.json`: the run at the defaults reads them instead of scoring the warm start again);
- `manifest.json` (engines/model_manifest.py): each model file's SHA-256 and size, and how it was built: the
  command, the commit, the date, the CPU, the preparation time, the held-out scores, and the ids of the held-out
  tasks a greedy decode solves (re-scored here, so a test can check a few of them on another machine).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "toolbox"))

HELD_OUT_TASKS = 224
"""The main job's default held-out set (agent_rl --heldout-tasks), drawn with the run's seed + 1."""


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def git_commit(root: Path) -> str:
    try:
        return subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def ship(report: Path, target: Path, seed: int = 0, commit: str = "") -> dict:
    from agent import load_sibling
    from evaluate import evaluate

    from gyre.engines.model_manifest import MODEL_FILES, verify, write_manifest

    prepared = json.loads((report / "prepare.json").read_text())
    source = Path(prepared["model_dir"])
    staging = target.parent / f".{target.name}.partial"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    for path in sorted(source.iterdir()):
        if path.name in MODEL_FILES or (path.name.startswith("eval-") and path.suffix == ".json"):
            shutil.copy2(path, staging / path.name)
    tasks = load_sibling("tasks")
    held_out = tasks.generate_tasks(seed + 1, "heldout", HELD_OUT_TASKS)
    started = time.perf_counter()
    greedy = evaluate(staging, held_out)
    cached = json.loads((staging / f"eval-{HELD_OUT_TASKS}-{seed}.json").read_text())
    sampled = [json.loads(p.read_text()) for p in sorted(staging.glob(f"eval-sampled-*-{HELD_OUT_TASKS}-{seed}-*.json"))]
    facts = {
        "built_by": "gyre run examples/agent_rl.py --report REPORT --warm-start rebuild (the defaults: "
                    "--seed 0 --copy-steps 3000 --copy-gap-steps 1200 --sft-tasks 900 --sft-epochs 1)",
        "shipped_by": "python3 examples/ship_warm_start.py REPORT",
        "commit": commit or git_commit(HERE.parent),
        # prepare.json's started_at is when RL began, after the preparation: the build began prepare_s before.
        "built_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(prepared["started_at"] - prepared["prepare_s"])),
        "cpu": cpu_model(),
        "cpus": os.cpu_count(),
        "prepare_s": round(prepared["prepare_s"], 1),
        "cache_name": source.name,
        "held_out": {
            "tasks": HELD_OUT_TASKS, "seed": seed + 1,
            "greedy_success_rate": cached["success_rate"],
            "greedy_success_by_kind": cached.get("success_by_kind", {}),
            "greedy_rescored_success_rate": greedy.success_rate,
            "greedy_rescore_s": round(time.perf_counter() - started, 1),
            "greedy_solved_task_ids": sorted(o.task_id for o in greedy.outcomes if o.success),
            "sampled": sampled,
        },
    }
    write_manifest(staging, facts)
    verify(staging)
    if target.exists():
        shutil.rmtree(target)
    os.replace(staging, target)
    return facts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("report", type=Path, help="the report folder of the run that built the warm start")
    parser.add_argument("--to", type=Path, default=HERE / "warm_start")
    parser.add_argument("--seed", type=int, default=0, help="the building run's --seed")
    parser.add_argument("--commit", default="", help="the commit the building run ran (default: HEAD now)")
    args = parser.parse_args(argv)
    if not (args.report / "prepare.json").is_file():
        parser.error(f"{args.report} has no prepare.json: not the report of a run that prepared a warm start")
    facts = ship(args.report, args.to, args.seed, args.commit)
    print(json.dumps(facts["held_out"] | {"greedy_solved_task_ids": len(facts["held_out"]["greedy_solved_task_ids"])},
                     indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
