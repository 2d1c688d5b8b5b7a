"""`gyre eval`: the report (report.json and a picture, tokens and time per task) and a model served through Gyre's
proxy, from an engine server the eval launches itself or one already running (--engine-url); bad combinations of
options are refused with a message."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest

from gyre.actors.eval_cli import run_eval, write_report
from gyre.runtime.cli import main

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
# A command-line agent that makes two chat calls through the proxy with the real openai SDK, then gives up.
AGENT = f'''command = ["{sys.executable}", "-c", """
import openai, sys
chat = openai.OpenAI(max_retries=0)
for _ in range(2):
    chat.chat.completions.create(model="gyre", messages=[{{"role": "user", "content": sys.argv[-1]}}], max_tokens=5)
"""]
'''

needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None or os.geteuid() != 0, reason="needs bwrap and root")


@needs_bwrap
@pytest.mark.timeout(300)
def test_the_report_has_a_picture_and_each_tasks_time(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    code = main(["eval", str(EXAMPLES / "swe"), "--agent", "oracle", "--report", str(tmp_path / "r"), "--json"])
    assert code == 0
    printed = json.loads(capsys.readouterr().out)
    saved = json.loads((tmp_path / "r" / "report.json").read_text())
    assert printed == saved and saved["success_rate"] == 1.0 and saved["agent"] == "oracle"
    for task in saved["tasks"]:
        assert 0 < task["agent_s"] < task["wall_s"]  # the agent ran, then the verifier: both inside wall_s
        assert task["tokens"] == {"calls": 0, "prompt": 0, "output": 0, "cached": 0}  # no model, no tokens
    assert (tmp_path / "r" / "eval.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_picture_draws_failures_and_refusals(tmp_path: Path) -> None:
    tokens = {"calls": 3, "prompt": 900, "output": 40, "cached": 500}
    report = {"success_rate": 0.5, "num_tasks": 3, "agent": "a", "tasks_dir": "t", "tasks": [
        {"task_id": "ok", "success": True, "reward": 1.0, "runs": [{"reward": 1.0}], "tokens": tokens,
         "agent_s": 1.0, "wall_s": 2.0},
        {"task_id": "dropped", "success": False, "reward": 0.0, "runs": [{"reward": None, "dropped": "crashed"}],
         "tokens": tokens, "agent_s": 1.0, "wall_s": 3.0},
        {"task_id": "refused", "success": False, "reward": 0.0, "runs": [], "refused": "bad task",
         "tokens": dict(tokens, calls=0), "agent_s": 0.0, "wall_s": None},
    ]}
    picture = write_report(report, tmp_path / "deep" / "r")
    assert picture.stat().st_size > 0 and json.loads((tmp_path / "deep" / "r" / "report.json").read_text()) == report


@needs_bwrap
@pytest.mark.timeout(300)
def test_a_model_served_through_the_proxy_counts_each_tasks_tokens(tiny_model_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "agent.toml").write_text(AGENT)
    report = run_eval(EXAMPLES / "tasks" / "fix-add", str(tmp_path / "agent.toml"), "bubblewrap", attempts=2,
                      model_dir=str(tiny_model_dir), max_context_tokens=4096,
                      workspace_root=str(tmp_path / "executions"))
    (task,) = report["tasks"]
    assert [run["reward"] for run in task["runs"]] == [0.0, 0.0]  # noise fixes nothing; the verifier judged it
    assert task["tokens"]["calls"] == 4 and task["tokens"]["prompt"] > 0 and task["tokens"]["output"] > 0
    assert report["tokens"] == task["tokens"] and report["model"] == str(tiny_model_dir)


@needs_bwrap
@pytest.mark.timeout(300)
def test_an_engine_already_running_is_used_through_the_proxy(tiny_model_dir: Path, tmp_path: Path,
                                                              engine_servers) -> None:
    (tmp_path / "agent.toml").write_text(AGENT)
    with engine_servers(tiny_model_dir, tmp_path, {"e": ["--max-context", "4096"]}) as urls:
        report = run_eval(EXAMPLES / "tasks" / "fix-add", str(tmp_path / "agent.toml"), "bubblewrap",
                          model_dir=str(tiny_model_dir), engine_url=urls["e"], max_context_tokens=4096,
                          workspace_root=str(tmp_path / "executions"))
    assert report["tasks"][0]["tokens"]["calls"] == 2


@needs_bwrap
@pytest.mark.timeout(300)
def test_an_engine_with_a_key_of_its_own_is_used_with_its_key_file(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A server started with its own key (as SGLang with --api-key): the proxy sends the key in the file."""
    import os
    import socket
    import subprocess
    import sys
    import time
    import urllib.request

    (tmp_path / "agent.toml").write_text(AGENT)
    key = "own-engine-key-" + os.urandom(8).hex()
    key_file = tmp_path / "engine.key"
    key_file.write_text(key + "\n")
    key_file.chmod(0o600)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "gyre.engines.engine_server", "--model-dir", str(tiny_model_dir),
                               "--port", str(port), "--num-threads", "1", "--max-context", "4096"],
                              env=dict(os.environ, GYRE_ENGINE_API_KEY=key), stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(1200):  # up to ~2 minutes to import torch and load the model: a bound
            try:
                with urllib.request.urlopen(url + "/health", timeout=2):
                    break
            except OSError:
                time.sleep(0.1)
        report = run_eval(EXAMPLES / "tasks" / "fix-add", str(tmp_path / "agent.toml"), "bubblewrap",
                          model_dir=str(tiny_model_dir), engine_url=url, max_context_tokens=4096,
                          workspace_root=str(tmp_path / "executions"), engine_api_key_file=str(key_file))
    finally:
        server.terminate()
        server.wait(timeout=30)
    assert report["tasks"][0]["tokens"]["calls"] == 2  # without the key every call would be refused (401)


@pytest.mark.parametrize(("argv", "message"), [
    (["--engine-url", "http://127.0.0.1:1"], "--engine-url needs --model"),
    (["--engine-api-key-file", "/nowhere"], "needs --engine-url"),
    (["--model", "/nowhere"], "no config.json there"),
    (["--attempts", "0"], "must be >= 1"),
])
def test_bad_options_are_refused(argv: list[str], message: str, capsys: pytest.CaptureFixture) -> None:
    assert main(["eval", str(EXAMPLES / "swe"), *argv]) == 2
    assert message in capsys.readouterr().err


def test_a_model_and_a_model_url_together_are_refused(tiny_model_dir: Path) -> None:
    with pytest.raises(ValueError, match="not both"):
        run_eval(EXAMPLES / "swe", "noop", model_dir=str(tiny_model_dir), model_url="http://127.0.0.1:1/v1")
