"""mini-swe-agent (PyPI, run unchanged) in the bubblewrap sandbox solves a shipped task: its litellm model is
pointed at an OpenAI-compatible URL that the sandbox's forwarder carries to a scripted chat server on the host (the
model is the faked edge; the agent, the sandbox, the executor and the verifier are real)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import threading
from pathlib import Path

import pytest
from aiohttp import web

from gyre.actors.eval_cli import run_eval

SHIPPED = Path(__file__).resolve().parents[4] / "examples" / "tasks"
COMMANDS = ("sed -i 's/return a - b/return a + b/' /app/calc.py", "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT")


class ScriptedChat:
    """An OpenAI chat-completions server on a thread of its own: the first call gets the fix as a bash tool call,
    every later one the command mini-swe-agent takes as "done"."""

    def __init__(self) -> None:
        self.requests: list[tuple[dict, str]] = []
        self.ready = threading.Event()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._serve, daemon=True)

    async def _chat(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.requests.append((body, request.headers.get("Authorization", "")))
        command = COMMANDS[min(len(self.requests) - 1, 1)]
        call = {"id": f"call{len(self.requests)}", "type": "function",
                "function": {"name": "bash", "arguments": json.dumps({"command": command})}}
        return web.json_response({
            "id": "scripted", "object": "chat.completion", "created": 0, "model": body.get("model", ""),
            "choices": [{"index": 0, "finish_reason": "tool_calls",
                         "message": {"role": "assistant", "content": "THOUGHT: next.", "tool_calls": [call]}}],
            "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15},
        })

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._chat)
        self.runner = web.AppRunner(app, access_log=None)
        self.loop.run_until_complete(self.runner.setup())
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        self.port = self.runner.addresses[0][1]
        self.ready.set()
        self.loop.run_forever()
        self.loop.run_until_complete(self.runner.cleanup())

    def __enter__(self) -> "ScriptedChat":
        self.thread.start()
        assert self.ready.wait(30)
        return self

    def __exit__(self, *exc: object) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)


@pytest.mark.skipif(shutil.which("mini") is None, reason="needs the PyPI package mini-swe-agent (.ci/setup)")
@pytest.mark.skipif(shutil.which("bwrap") is None or os.geteuid() != 0, reason="needs bwrap and root")
@pytest.mark.timeout(300)
def test_mini_swe_agent_solves_a_shipped_task_in_the_sandbox(tmp_path: Path) -> None:
    with ScriptedChat() as chat:
        report = run_eval(SHIPPED / "fix-add", "mini-swe-agent", "bubblewrap",
                          model_url=f"http://localhost:{chat.port}/v1", workspace_root=str(tmp_path / "executions"))
    (task,) = report["tasks"]
    assert task["runs"][0]["reward"] == 1.0 and task["success"], task
    assert len(chat.requests) >= 2
    body, authorization = chat.requests[0]
    assert body["model"] == "gyre" and authorization == "Bearer no-model"
    assert "calc.py" in json.dumps(body["messages"])  # the task's instruction reached the model
