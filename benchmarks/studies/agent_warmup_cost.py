"""CPU milliseconds one toolbox agent run costs when forked from a warm process, by how that process was warmed:
`request` (one refused call: the request path's imports, the warm-up before session 17) against `reply`
(`gyre.actors.executions.sdk_warmup:openai_client`: one answered call, which also builds the reply types' schemas).

    python benchmarks/studies/agent_warmup_cost.py --runs 30 --repeats 3

Each way gets a process of its own that imports what the main job's warm launcher imports, runs its warm-up, then
forks `--runs` agents, as the warm launcher's server does (runpy, then os._exit). Each agent runs
examples/toolbox/agent.py on a "write" task against a canned OpenAI-compatible server on loopback (this file with
--serve) that answers a tool call, then a final answer: two model calls, the shortest successful run. The CPU of
an agent is its rusage from wait4 (user + system, fork and exit included). The ways alternate `--repeats` times;
prints one JSON line with each way's median over all its runs and each repeat's median.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import runpy
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Iterator

AGENT = Path(__file__).resolve().parents[2] / "examples" / "toolbox" / "agent.py"
TASK = "Write the words amber bird to answer.txt."


class _CannedChat(BaseHTTPRequestHandler):
    """A tool call (write_file) to a conversation that has no tool result yet; a final answer to one that has."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args: object) -> None:
        pass

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if request["messages"][-1]["role"] == "tool":
            message, finish = {"role": "assistant", "content": "done"}, "stop"
        else:
            arguments = json.dumps({"path": "answer.txt", "content": "amber bird"})
            message, finish = {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call-1", "type": "function", "function": {"name": "write_file", "arguments": arguments}}]}, \
                "tool_calls"
        body = json.dumps({"id": "c", "object": "chat.completion", "created": 0, "model": "gyre",
                           "choices": [{"index": 0, "message": message, "finish_reason": finish}],
                           "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def _request_only_warmup() -> None:
    """The warm-up before session 17: one call to a port that refuses it (imports, no reply parsed)."""
    import openai

    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{holder.getsockname()[1]}/v1", api_key="w",
                               max_retries=0, timeout=5.0)
        try:
            client.chat.completions.create(model="w", messages=[{"role": "user", "content": "hi"}])
        except openai.APIConnectionError:
            pass
        client.close()
    finally:
        holder.close()


def _fork_agent(workspace: str) -> float:
    """Fork one agent run the way the warm launcher's server does; its CPU milliseconds."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.chdir(workspace)
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 2)
            sys.argv = [str(AGENT), TASK]
            sys.path[0] = str(AGENT.parent)
            try:
                runpy.run_path(str(AGENT), run_name="__main__")
                code = 0
            except SystemExit as exit_:
                code = exit_.code if isinstance(exit_.code, int) else 1
        finally:
            os._exit(code)
    _, status, usage = os.wait4(pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"agent_warmup_cost: an agent run failed (status {status})")
    return (usage.ru_utime + usage.ru_stime) * 1000


def _measure(way: str, runs: int, base_url: str) -> list[float]:
    """In this (fresh) process: import, warm up `way`, fork `runs` agents; their CPU milliseconds."""
    import openai  # noqa: F401  (the main job's AGENT_PRELOAD)
    import structlog  # noqa: F401

    if way == "reply":
        from gyre.actors.executions.sdk_warmup import openai_client

        openai_client()
    else:
        _request_only_warmup()
    os.environ.update(OPENAI_BASE_URL=base_url, OPENAI_API_KEY="k")
    costs = []
    for _ in range(runs):
        with tempfile.TemporaryDirectory() as workspace:
            costs.append(_fork_agent(workspace))
            if (Path(workspace) / "answer.txt").read_text() != "amber bird":
                raise SystemExit("agent_warmup_cost: the agent did not write its answer")
    return costs


@contextlib.contextmanager
def canned_server() -> Iterator[int]:
    """This file's canned OpenAI server (`--serve PORT`) in a child process, up and answering; yields its port."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen([sys.executable, __file__, "--serve", str(port)])
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise SystemExit("the canned server did not start")
                time.sleep(0.05)
        yield port
    finally:
        server.kill()
        server.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=30, help="agent runs a way per repeat")
    parser.add_argument("--repeats", type=int, default=3, help="times the ways alternate")
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)  # internal: be the canned server on this port
    parser.add_argument("--way", choices=("request", "reply"), help=argparse.SUPPRESS)  # internal: one measurement
    parser.add_argument("--base-url", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve is not None:
        ThreadingHTTPServer(("127.0.0.1", args.serve), _CannedChat).serve_forever()
        return 0
    if args.way:
        print(json.dumps(_measure(args.way, args.runs, args.base_url)))
        return 0
    with canned_server() as port:
        rounds: dict[str, list[list[float]]] = {"request": [], "reply": []}
        for _ in range(args.repeats):
            for way in rounds:
                done = subprocess.run([sys.executable, __file__, "--way", way, "--runs", str(args.runs),
                                       "--base-url", f"http://127.0.0.1:{port}/v1"],
                                      capture_output=True, text=True, check=True)
                rounds[way].append(json.loads(done.stdout))
    medians = {way: statistics.median(c for one in costs for c in one) for way, costs in rounds.items()}
    print(json.dumps({
        "runs_per_repeat": args.runs, "repeats": args.repeats,
        "request_warmup_cpu_ms": round(medians["request"], 2), "reply_warmup_cpu_ms": round(medians["reply"], 2),
        "ratio": round(medians["request"] / medians["reply"], 2),
        "repeat_medians_ms": {way: [round(statistics.median(one), 2) for one in costs]
                              for way, costs in rounds.items()},
    }))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
