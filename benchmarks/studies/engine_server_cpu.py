"""CPU milliseconds the engine server spends per /generate call, split between its event loop (HTTP, JSON, handing
results over) and its other threads (the engine worker's steps, nearly all of it), on the main job's warm start.

    python benchmarks/studies/engine_server_cpu.py --sessions 32 --turns 8

Starts `python -m gyre.engines.engine_server` on examples/warm_start (one torch thread, the main job's pool and
limits), then drives it over HTTP the way the proxy does: `--sessions` agent-like sessions share a 300-token system
prompt, each turn appends the reply and a 30-token observation and asks for 24 new tokens (temperature 0.7, seeded
per call, non-streamed), `--at-once` calls in flight. Reads each server thread's CPU from /proc before and after.
Prints one JSON line: calls, the loop's and the worker's CPU-ms per call, and a digest of every output id (equal
digests: the same tokens, so a change that is meant to keep the engine's results can be checked with it).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import random
import socket
import subprocess
import sys
from pathlib import Path

WARM_START = Path(__file__).resolve().parents[2] / "examples" / "warm_start"
KEY = "k" * 32


def _thread_cpu_s(pid: int) -> dict[int, float]:
    found = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        found[int(task.name)] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return found


async def _drive(port: int, sessions: int, turns: int, at_once: int, pid: int) -> tuple[dict, dict, list]:
    import aiohttp

    headers = {"Authorization": f"Bearer {KEY}"}
    async with aiohttp.ClientSession() as client:
        for _ in range(600):
            try:
                async with client.get(f"http://127.0.0.1:{port}/health") as response:
                    if response.status == 200:
                        break
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.2)
        else:
            raise SystemExit("engine_server_cpu: the server did not come up")
        rng = random.Random(0)
        system = [rng.randrange(2000) for _ in range(300)]
        slots = asyncio.Semaphore(at_once)
        outputs: list = []

        async def session(index: int) -> None:
            ids = system + [rng.randrange(2000) for _ in range(60)]
            for turn in range(turns):
                body = {"input_ids": ids, "return_logprob": True, "logprob_start_len": -1, "stream": False,
                        "rid": f"s{index}t{turn}", "sampling_params": {
                            "temperature": 0.7, "max_new_tokens": 24, "ignore_eos": True,
                            "sampling_seed": index * 100 + turn}}
                async with slots:
                    async with client.post(f"http://127.0.0.1:{port}/generate", json=body,
                                           headers=headers) as response:
                        reply = await response.json()
                outputs.append((index, turn, reply["output_ids"]))
                ids = ids + reply["output_ids"] + [rng.randrange(2000) for _ in range(30)]

        before = _thread_cpu_s(pid)
        await asyncio.gather(*(session(i) for i in range(sessions)))
        return before, _thread_cpu_s(pid), outputs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=32)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--at-once", type=int, default=16, help="calls in flight at most")
    args = parser.parse_args(argv)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen(
        [sys.executable, "-m", "gyre.engines.engine_server", "--model-dir", str(WARM_START), "--port", str(port),
         "--num-threads", "1", "--num-blocks", "1536", "--max-running", "48", "--max-context", "4096"],
        env={**os.environ, "GYRE_ENGINE_API_KEY": KEY}, stderr=subprocess.DEVNULL)
    try:
        before, after, outputs = asyncio.run(_drive(port, args.sessions, args.turns, args.at_once, server.pid))
    finally:
        server.terminate()
        server.wait()
    calls = args.sessions * args.turns
    spent = {tid: cpu_s - before.get(tid, 0.0) for tid, cpu_s in after.items()}
    loop_s = spent.pop(server.pid)  # the main thread runs the event loop
    print(json.dumps({
        "calls": calls, "loop_cpu_ms_per_call": round(1000 * loop_s / calls, 3),
        "worker_cpu_ms_per_call": round(1000 * sum(spent.values()) / calls, 3),
        "outputs_digest": hashlib.sha256(repr(sorted(outputs)).encode()).hexdigest()[:16],
    }))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
