"""CPU seconds a toolbox scorer run costs: exec'd fresh (`python -S score.py`, the evaluator's plain way) against
forked from a warm launcher that imported score.py's modules (`EvaluatorConfig(warm_launcher_preload=...)`).

    python benchmarks/studies/scorer_launch.py --runs 60 --repeats 3

Each repeat runs `--runs` scorers one after another on a workspace holding the right answer, both ways. CPU is
read with getrusage(RUSAGE_CHILDREN): it covers every reaped descendant, so the warm figure holds the server's work
for each fork and the forked children it reaped; the server's own start (its imports, paid once a run) is measured
by starting and closing one with no launch and is left out of the per-run figure. Prints one JSON line with the
median milliseconds a run of each way and their ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Awaitable, Callable

from gyre.actors.executions.warm_launcher import WarmLauncher

TOOLBOX = Path(__file__).resolve().parents[2] / "examples" / "toolbox"
sys.path.insert(0, str(TOOLBOX))
import tasks  # noqa: E402  (examples/toolbox/tasks.py: the scorer's command line and what it imports)


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


async def run_warm(argv: list[str], workspace: Path, runs: int) -> None:
    launcher = WarmLauncher()
    await launcher.start(tasks.SCORER_PRELOAD)
    try:
        for _ in range(runs):
            process = await launcher.launch(argv, workspace, dict(os.environ), workspace / "out", workspace / "err")
            if await process.wait() != 0:
                raise RuntimeError(f"warm scorer failed: {(workspace / 'err').read_text()}")
    finally:
        await launcher.close()


async def run_plain(argv: list[str], workspace: Path, runs: int) -> None:
    for _ in range(runs):
        process = await asyncio.create_subprocess_exec(*argv, cwd=workspace, stdout=asyncio.subprocess.DEVNULL)
        if await process.wait() != 0:
            raise RuntimeError("plain scorer failed")


def cpu_of(run: Callable[[list[str], Path, int], Awaitable[None]], argv: list[str], workspace: Path,
           runs: int) -> float:
    before = children_cpu_s()
    asyncio.run(run(argv, workspace, runs))
    return children_cpu_s() - before


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=60, help="scorer runs a way per repeat")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    scorer = list(tasks.scorer_argv("17"))
    warm_ms, plain_ms = [], []
    with tempfile.TemporaryDirectory(prefix="gyre-scorer-launch-") as folder:
        workspace = Path(folder)
        (workspace / tasks.ANSWER_FILE).write_text("17")
        for _ in range(args.repeats):
            server_start = cpu_of(run_warm, scorer, workspace, 0)
            warm_ms.append((cpu_of(run_warm, scorer, workspace, args.runs) - server_start) / args.runs * 1000)
            plain_ms.append(cpu_of(run_plain, scorer, workspace, args.runs) / args.runs * 1000)
    warm, plain = statistics.median(warm_ms), statistics.median(plain_ms)
    print(json.dumps({"runs": args.runs, "repeats": args.repeats, "plain_cpu_ms_per_run": round(plain, 1),
                      "warm_cpu_ms_per_run": round(warm, 1), "plain_over_warm": round(plain / warm, 2)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
