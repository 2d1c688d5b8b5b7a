"""Held-out scoring, one pass after another against all passes pooled on one engine.

    python benchmarks/studies/eval_pooling.py MODEL_DIR [--tasks 224] [--samples 2] [--temperature 0.7]

The main job scores a model after RL with a greedy pass and `--samples` sampled passes over the held-out tasks
(seed 1, as examples/agent_rl.py draws them). The baseline runs them as before session 15: each pass its own engine
(2,048 KV blocks, the engine's default), 16 agents at once. The pooled way is examples/toolbox/evaluate.py's
evaluate_passes at its defaults: one engine with 128 KV blocks an agent, 64 agents at once, every pass in one queue. Prints one JSON line: each way's seconds and success rates, the speed-up, and whether the
greedy outcomes agree task by task (they should: greedy decoding does not depend on what it is batched with).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

TOOLBOX = Path(__file__).resolve().parents[2] / "examples" / "toolbox"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir")
    parser.add_argument("--tasks", type=int, default=224)
    parser.add_argument("--samples", type=int, default=2)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--baseline-concurrency", type=int, default=16)
    parser.add_argument("--pooled-concurrency", type=int, default=64)
    args = parser.parse_args(argv)
    sys.path.insert(0, str(TOOLBOX))
    from agent import load_sibling
    from evaluate import evaluate, evaluate_passes

    tasks = load_sibling("tasks").generate_tasks(1, "heldout", args.tasks)
    temperatures = (0.0,) + (args.temperature,) * args.samples

    started = time.perf_counter()
    one_by_one = [evaluate(args.model_dir, tasks, temperature=t, concurrency=args.baseline_concurrency,
                           kv_blocks=2048) for t in temperatures]
    one_by_one_s = time.perf_counter() - started
    started = time.perf_counter()
    pooled = evaluate_passes(args.model_dir, tasks, temperatures, concurrency=args.pooled_concurrency)
    pooled_s = time.perf_counter() - started

    def rates(passes) -> list[float]:
        return [round(p.success_rate, 4) for p in passes]

    print(json.dumps({
        "tasks": len(tasks), "temperatures": temperatures,
        "one_by_one_s": round(one_by_one_s, 1), "one_by_one_concurrency": args.baseline_concurrency,
        "one_by_one_success": rates(one_by_one),
        "pooled_s": round(pooled_s, 1), "pooled_concurrency": args.pooled_concurrency,
        "pooled_success": rates(pooled),
        "speedup": round(one_by_one_s / pooled_s, 2),
        "greedy_outcomes_agree": [o.success for o in one_by_one[0].outcomes] == [o.success for o in pooled[0].outcomes],
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
