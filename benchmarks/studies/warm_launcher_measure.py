"""Cold vs warm agent starts: N agent-like scripts (import openai, build a client, exit), started as fresh
processes or forked from the warm launcher's server; total CPU seconds of all processes involved, and wall time.

    python benchmarks/studies/warm_launcher_measure.py --agents 16 --repeats 3

CPU is read with getrusage(RUSAGE_CHILDREN): it covers every descendant that was reaped, so the warm figure
includes the server's own start (its preload imports) and the children it reaped, once the server has exited.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

from gyre.actors.executions.warm_launcher import WarmLauncher

AGENT = """
import openai
client = openai.OpenAI(base_url="http://127.0.0.1:9/v1", api_key="k")
print(type(client).__name__)
"""


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


async def _cold(agent: Path, work: Path, n: int) -> list[int]:
    async def one(i: int) -> int:
        with open(work / f"cold{i}.out", "wb") as out:
            process = await asyncio.create_subprocess_exec(
                sys.executable, str(agent), cwd=work, env=dict(os.environ), stdin=asyncio.subprocess.DEVNULL,
                stdout=out, stderr=out, start_new_session=True)
        return await process.wait()

    return list(await asyncio.gather(*(one(i) for i in range(n))))


async def _warm(agent: Path, work: Path, n: int, preload: tuple[str, ...]) -> list[int]:
    launcher = WarmLauncher()
    await launcher.start(preload)
    try:
        processes = await asyncio.gather(*(
            launcher.launch([sys.executable, str(agent)], work, dict(os.environ), work / f"warm{i}.out",
                            work / f"warm{i}.out") for i in range(n)))
        return [await p.wait() for p in processes]
    finally:
        await launcher.close()


def _measure(run) -> tuple[float, float]:
    cpu0, wall0 = _children_cpu_s(), time.perf_counter()
    codes = asyncio.run(run())
    cpu_s, wall_s = _children_cpu_s() - cpu0, time.perf_counter() - wall0
    if any(codes):
        raise SystemExit(f"an agent failed: exit codes {codes}")
    return cpu_s, wall_s


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--agents", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--preload", default="openai")
    args = parser.parse_args()
    preload = tuple(name for name in args.preload.split(",") if name)
    work = Path(tempfile.mkdtemp(prefix="gyre-warm-measure-"))
    agent = work / "agent.py"
    agent.write_text(AGENT)
    rows: dict[str, list[tuple[float, float]]] = {"cold": [], "warm": [], "server_only": []}
    for _ in range(args.repeats):  # interleaved, so that machine noise hits both alike
        rows["cold"].append(_measure(lambda: _cold(agent, work, args.agents)))
        rows["warm"].append(_measure(lambda: _warm(agent, work, args.agents, preload)))
        rows["server_only"].append(_measure(lambda: _warm(agent, work, 0, preload)))
    medians = {k: (statistics.median(c for c, _ in v), statistics.median(w for _, w in v)) for k, v in rows.items()}
    print(f"{args.agents} agents, preload {preload}, medians of {args.repeats} (CPU s over all processes / wall s):")
    for kind, (cpu_s, wall_s) in medians.items():
        print(f"  {kind:12s} cpu {cpu_s:7.2f} s   wall {wall_s:6.2f} s")
    cold_cpu, warm_cpu, server_cpu = medians["cold"][0], medians["warm"][0], medians["server_only"][0]
    print(f"  per agent: cold {cold_cpu / args.agents:.3f} CPU-s, warm {(warm_cpu - server_cpu) / args.agents:.3f}"
          f" CPU-s (+{server_cpu:.2f} CPU-s once for the server); total ratio cold/warm {cold_cpu / warm_cpu:.1f}x,"
          f" wall ratio {medians['cold'][1] / medians['warm'][1]:.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
