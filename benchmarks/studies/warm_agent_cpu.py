"""CPU milliseconds one toolbox agent run costs when the executor's warm launcher forks it, as in the main job.

    python benchmarks/studies/warm_agent_cpu.py --agents 150
    python benchmarks/studies/warm_agent_cpu.py --agents 150 \
        --preload openai,structlog,gyre.actors.executions.sdk_warmup:openai_client    # without agent.py

Starts a WarmLauncher with the main job's preload (examples/toolbox/evaluate.py: AGENT_PRELOAD, or `--preload`) and
launches `--agents` runs of examples/toolbox/agent.py, one after another, on a "write" task against a canned
OpenAI-compatible server on loopback (benchmarks/studies/agent_warmup_cost.py --serve, in a process of its own):
a tool call, then a final answer, two model calls. An agent's CPU is what the launcher's server reaped for it
(cutime + cstime from /proc: fork, the script, exit); the first run is not counted. Prints one JSON line. To compare
two versions of Gyre, run it with each one's import path, alternating a few times: runs vary by a few ms.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
from pathlib import Path

from gyre.benchmarks.studies.agent_warmup_cost import canned_server

ROOT = Path(__file__).resolve().parents[2]
TOOLBOX = ROOT / "examples" / "toolbox"
AGENT = TOOLBOX / "agent.py"
TASK = "Write the words amber bird to answer.txt."


def _reaped_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[13]) + int(fields[14])) / os.sysconf("SC_CLK_TCK")


async def _measure(agents: int, port: int, preload: tuple[str, ...]) -> float:
    from gyre.actors.executions.warm_launcher import WarmLauncher

    launcher = WarmLauncher()
    await launcher.start(preload)
    env = {**os.environ, "OPENAI_BASE_URL": f"http://127.0.0.1:{port}/v1", "OPENAI_API_KEY": "k"}
    try:
        with tempfile.TemporaryDirectory() as root:
            async def one(index: int) -> None:
                folder = Path(root) / str(index)
                folder.mkdir()
                process = await launcher.launch([sys.executable, str(AGENT), TASK], folder, env,
                                                folder / "out.log", folder / "err.log")
                code = await process.wait()
                if code != 0 or (folder / "answer.txt").read_text() != "amber bird":
                    problem = (folder / "err.log").read_text()
                    raise SystemExit(f"warm_agent_cpu: an agent run failed ({code}): {problem}")

            await one(-1)
            assert launcher.server_pid is not None
            before = _reaped_cpu_s(launcher.server_pid)
            for index in range(agents):
                await one(index)
            return (_reaped_cpu_s(launcher.server_pid) - before) / agents
    finally:
        await launcher.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--agents", type=int, default=150)
    parser.add_argument("--preload", default="", help="comma-separated preload entries (default: AGENT_PRELOAD)")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(TOOLBOX))
    from evaluate import AGENT_PRELOAD

    preload = tuple(entry for entry in args.preload.split(",") if entry) or AGENT_PRELOAD
    with canned_server() as port:
        per_agent_s = asyncio.run(_measure(args.agents, port, preload))
    print(json.dumps({"agents": args.agents, "preload": list(preload),
                      "cpu_ms_per_agent": round(1000 * per_agent_s, 1)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
