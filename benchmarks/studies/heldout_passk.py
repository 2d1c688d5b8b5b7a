"""Held-out pass@k of a model on the toolbox tasks: the ceiling of what RL can turn into greedy answers.

    python benchmarks/studies/heldout_passk.py MODEL_DIR --samples 4 --temperature 1.0

Runs the main job's 224 held-out tasks (seed 1, as examples/agent_rl.py scores them) `--samples` times at
`--temperature` through examples/toolbox/evaluate.py (all passes pooled on one engine), and prints per kind how many tasks were solved at least once
(pass@k) and the mean success, then the totals. Compare with the greedy score in the warm start's eval-224-0.json.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

TOOLBOX = Path(__file__).resolve().parents[2] / "examples" / "toolbox"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir")
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--tasks", type=int, default=224)
    args = parser.parse_args(argv)
    sys.path.insert(0, str(TOOLBOX))
    from agent import load_sibling
    from evaluate import evaluate_passes

    tasks = load_sibling("tasks").generate_tasks(1, "heldout", args.tasks)
    kind_of = {task.task_id: task.kind for task in tasks}
    wins: collections.Counter = collections.Counter()
    for one_pass in evaluate_passes(args.model_dir, tasks, (args.temperature,) * args.samples):
        for outcome in one_pass.outcomes:
            wins[outcome.task_id] += int(outcome.success)
    kinds: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0, 0])
    for task_id, kind in kind_of.items():
        row = kinds[kind]
        row[0] += wins[task_id] > 0
        row[1] += wins[task_id]
        row[2] += 1
    print(json.dumps({kind: {"pass_at_k": f"{solved}/{count}", "mean_success": round(total / (count * args.samples), 3)}
                      for kind, (solved, total, count) in kinds.items()}))
    print(json.dumps({"k": args.samples, "temperature": args.temperature,
                      "pass_at_k": round(sum(wins[t] > 0 for t in kind_of) / len(kind_of), 3),
                      "mean_success": round(sum(wins.values()) / (len(kind_of) * args.samples), 3)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
