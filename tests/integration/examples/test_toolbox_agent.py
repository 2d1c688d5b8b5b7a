"""examples/toolbox/agent.py as a real subprocess against a local OpenAI-compatible server.

The server stands in for the model behind Gyre's proxy: it is the outer edge, the only fake here. It speaks the
OpenAI chat-completions wire format (what the proxy speaks) and answers with the scripted expert's moves, or with
injected malformed replies. The agent program, the openai SDK, the tools, the workspace and the scorer are real.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

TOOLBOX = Path(__file__).resolve().parents[3] / "examples" / "toolbox"
API_KEY = "sk-toolbox-test"
MODEL = "toolbox-test-model"


def load(name: str):
    """Load examples/toolbox/<name>.py under the private name agent.load_sibling uses."""
    qualified = f"_gyre_toolbox_{name}"
    if qualified not in sys.modules:
        spec = importlib.util.spec_from_file_location(qualified, TOOLBOX / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[qualified] = module
        spec.loader.exec_module(module)
    return sys.modules[qualified]


expert = load("expert")
tasks = load("tasks")
prompts = load("prompts")
score = load("score")

UNPARSED = {"role": "assistant", "content": '<tool_call>\n{"name": "read_file", "arguments": {"path": \n</tool_call>'}
UNKNOWN_TOOL = {
    "role": "assistant",
    "content": "",
    "tool_calls": [{"id": "bad", "type": "function", "function": {"name": "shell", "arguments": '{"cmd": "ls"}'}}],
}


class ExpertServer:
    """OpenAI chat completions on 127.0.0.1, answered by the expert; records each request's headers (lower-cased
    names) and body."""

    def __init__(self, injected: dict[int, dict[str, Any]] | None = None) -> None:
        self.injected = dict(injected or {})  # call index -> reply to send instead of the expert's
        self.requests: list[tuple[dict[str, str], dict[str, Any]]] = []
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._runner: web.AppRunner | None = None
        self.port = 0

    async def _completions(self, request: web.Request) -> web.Response:
        body = await request.json()
        index = len(self.requests)
        self.requests.append(({key.lower(): value for key, value in request.headers.items()}, body))
        if request.headers.get("Authorization") != f"Bearer {API_KEY}":
            return web.json_response({"error": {"message": "bad key", "type": "invalid_request_error"}}, status=401)
        message = self.injected.get(index) or expert.expert_reply(body["messages"])
        wire = {"role": "assistant", "content": message.get("content") or None}
        if message.get("tool_calls"):
            wire["tool_calls"] = message["tool_calls"]
        return web.json_response(
            {
                "id": f"chatcmpl-{index}",
                "object": "chat.completion",
                "created": 0,
                "model": body["model"],
                "choices": [
                    {"index": 0, "message": wire, "finish_reason": "tool_calls" if "tool_calls" in wire else "stop"}
                ],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
            }
        )

    async def _start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._completions)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = self._runner.addresses[0][1]

    def __enter__(self) -> "ExpertServer":
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(timeout=30)
        return self

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(timeout=30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)
        self._loop.close()

    def calls(self) -> list[tuple[str, str, list[dict[str, Any]]]]:
        """(X-Gyre-Agent, X-Gyre-Call, messages) of every request, in arrival order."""
        return [(h.get("x-gyre-agent", ""), h.get("x-gyre-call", ""), b["messages"]) for h, b in self.requests]


def run_agent(task, workspace: Path, server: ExpertServer, *extra: str) -> subprocess.CompletedProcess:
    tasks.write_workspace(task, workspace)
    env = {
        **os.environ,
        "OPENAI_BASE_URL": f"http://127.0.0.1:{server.port}/v1",
        "OPENAI_API_KEY": API_KEY,
        "GYRE_MODEL": MODEL,
    }
    argv = [*load("agent").agent_argv(task.prompt), *extra]
    # The timeout only guards against a hang; nothing asserts on time.
    return subprocess.run(argv, cwd=workspace, env=env, capture_output=True, text=True, timeout=120)


def one_task(kind: str):
    return tasks.generate_tasks(11, "heldout", 1, kinds=(kind,))[0]


def assert_solved(task, workspace: Path, completed: subprocess.CompletedProcess) -> None:
    assert completed.returncode == 0, completed.stderr
    assert score.score_workspace(workspace, tasks.ANSWER_FILE, task.expected) == {"reward": 1.0, "success": True}


def test_agent_uses_tools_and_labels_sub_agent_and_summary_calls(tmp_path: Path) -> None:
    task = one_task("helper")  # delegate; the sub-agent reads four files and passes the default budget
    with ExpertServer() as server:
        completed = run_agent(task, tmp_path, server)
    assert_solved(task, tmp_path, completed)
    for headers, body in server.requests:
        assert headers["authorization"] == f"Bearer {API_KEY}"
        assert body["model"] == MODEL
        assert [tool["function"]["name"] for tool in body["tools"]] == (
            ["read_file", "write_file", "calculator", "delegate"]
            if headers["x-gyre-agent"] == "main"
            else ["read_file", "write_file", "calculator"]
        )
    calls = server.calls()
    labels = [(agent_id, kind) for agent_id, kind, _ in calls]
    assert labels[0] == ("main", "turn")
    assert ("sub-1", "turn") in labels and ("sub-1", "summary") in labels
    assert {agent_id for agent_id, _ in labels} == {"main", "sub-1"}
    # The sub-agent runs inside the main agent's delegate call: its calls come between two main calls.
    assert labels[1][0] == "sub-1" and labels[-1][0] == "main"
    summary_index = labels.index(("sub-1", "summary"))
    summary_messages = calls[summary_index][2]
    previous = calls[summary_index - 1][2]
    assert summary_messages[: len(previous)] == previous  # the summary call extends the context it compresses
    assert summary_messages[-1] == {"role": "user", "content": prompts.SUMMARY_REQUEST}
    restarted = calls[summary_index + 1][2]
    assert [m["role"] for m in restarted] == ["system", "user"]
    assert restarted[1]["content"].startswith(expert.SUBTASKS["add"] + prompts.NOTES_HEADER)


def test_agent_compresses_its_own_context_over_budget(tmp_path: Path) -> None:
    task = one_task("sum")
    with ExpertServer() as server:
        completed = run_agent(task, tmp_path, server, "--budget-chars", "90", "--max-summaries", "1")
    assert_solved(task, tmp_path, completed)
    calls = server.calls()
    kinds = [kind for _, kind, _ in calls]
    assert kinds.count("summary") == 1
    index = kinds.index("summary")
    assert calls[index][0] == "main"
    notes = prompts.split_restart_prompt(calls[index + 1][2][1]["content"])[1]
    assert notes and calls[index + 1][2][1]["content"] == prompts.restart_prompt(task.prompt, notes)
    assert prompts.conversation_chars(calls[index][2][:-1]) > 90


def test_agent_retries_malformed_output(tmp_path: Path) -> None:
    task = one_task("lookup")
    with ExpertServer(injected={0: UNPARSED, 1: UNKNOWN_TOOL, 3: UNPARSED}) as server:
        completed = run_agent(task, tmp_path, server, "--max-retries", "2")
    assert_solved(task, tmp_path, completed)
    messages = [messages for _, _, messages in server.calls()]
    assert messages[0] == messages[1] == messages[2]  # two retries of the first call, same prompt
    assert messages[3] == messages[4]  # one retry of the second
    assert all(kind == "turn" for _, kind, _ in server.calls())


def test_agent_gives_up_after_bounded_turns(tmp_path: Path) -> None:
    task = one_task("write")
    always_broken = {index: UNPARSED for index in range(100)}
    with ExpertServer(injected=always_broken) as server:
        completed = run_agent(task, tmp_path, server, "--max-turns", "2", "--max-retries", "1")
    assert completed.returncode == 3
    assert len(server.requests) == 2 * 2
    assert not (tmp_path / tasks.ANSWER_FILE).exists()


def test_agent_reports_an_endpoint_failure(tmp_path: Path) -> None:
    task = one_task("write")
    with ExpertServer() as server:
        tasks.write_workspace(task, tmp_path)
        env = {**os.environ, "OPENAI_BASE_URL": f"http://127.0.0.1:{server.port}/v1", "OPENAI_API_KEY": "wrong"}
        completed = subprocess.run(
            load("agent").agent_argv(task.prompt), cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
        )
    assert completed.returncode == 1
    assert "model_endpoint_failed" in completed.stderr


def test_agent_usage_errors_exit_2(tmp_path: Path) -> None:
    agent_path = str(TOOLBOX / "agent.py")
    for argv in ([], ["task", "--max-turns", "0"]):
        completed = subprocess.run([sys.executable, agent_path, *argv], cwd=tmp_path, capture_output=True, timeout=120)
        assert completed.returncode == 2
