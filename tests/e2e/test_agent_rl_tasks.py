"""A short RL run of the main job on the shipped Harbor tasks with mini-swe-agent, unchanged, as the agent: real
cells (engine servers), proxy, bubblewrap sandbox, Harbor verifiers and trainer, two GSPO steps on the tiny model.
Learning is not expected at this size (its replies are noise); the run must end cleanly, having trained samples
built from mini-swe-agent's unlabelled calls (inferred trajectory chains) and scored by the tasks' verifiers.

Small on purpose so CI can afford it: groups of 2, one group a step, two cells, mini-swe-agent held to two steps of
16 tokens by its own configuration, the shipped warm start (examples/warm_start), no held-out evaluation.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(shutil.which("mini") is None, reason="needs the PyPI package mini-swe-agent (.ci/setup)")
@pytest.mark.skipif(shutil.which("bwrap") is None or os.geteuid() != 0, reason="needs bwrap and root")
@pytest.mark.timeout(900)
def test_main_job_trains_mini_swe_agent_on_the_shipped_tasks(tmp_path: Path) -> None:
    report = tmp_path / "report"
    env = dict(os.environ, GYRE_CACHE=str(tmp_path / "cache"), GYRE_LOG_JSON="1")
    command = [
        sys.executable, "-m", "gyre.runtime.cli", "run", str(ROOT / "examples" / "agent_rl.py"),
        "--report", str(report), "--tasks", str(ROOT / "examples" / "tasks"), "--agent", "mini-swe-agent",
        "--agent-option", "agent.step_limit=2", "--agent-option", "model.model_kwargs.max_tokens=16",
        "--steps", "2", "--group-size", "2", "--groups-per-step", "1", "--cells", "2",
        "--train-tasks", "20",
        # Noise scores 0 everywhere: keep groups of equal rewards, or the two steps never fill.
        "--min-reward-spread", "0",
    ]
    run = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=840)
    assert run.returncode == 0, run.stderr[-4000:]
    summary = json.loads((report / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["exit_reason"] == "trained 2 steps"
    assert summary["tasks"] == str(ROOT / "examples" / "tasks") and summary["agent"] == "mini-swe-agent"
    assert summary["samples_trained"] > 0 and summary["tokens_trained"] > 0
    assert summary["success_measure"] == "not scored"  # the toolbox's held-out evaluation does not apply
    assert (report / "final_model" / "model.safetensors").is_file()

    from gyre.runtime import Codec, read_log

    codec = Codec()
    calls, scored, landed, shipped = [], [], [], {p.name for p in (ROOT / "examples" / "tasks").iterdir()}
    started: dict[str, str] = {}
    for record in read_log(report / "events.glog"):
        name = record.type_name.rsplit(".", 1)[-1]
        if name == "ModelCallCompleted" and record.envelope.receiver == "trajectory_builder":
            calls.append(record.decode(codec))
        elif name == "ExecutionScored" and record.envelope.receiver == "trajectory_builder":
            scored.append(record.decode(codec))
        elif name == "SamplesLanded":
            landed.append(record.decode(codec))
        elif name == "StartGroup":
            msg = record.decode(codec)
            started[msg.group_id] = msg.task.task_id
            # mini-swe-agent, unchanged, in the sandbox at the task's workdir, at the rollout temperature.
            assert msg.task.workdir == "/app" and "--yolo" in msg.task.agent_argv
            assert "model.model_kwargs.temperature=0.7" in msg.task.agent_argv
    assert set(started.values()) <= shipped and started
    # mini-swe-agent's calls, token-in/token-out, without Gyre's labels: chains inferred from the tokens.
    assert calls and all(c.prompt_tokens and c.output_ids and len(c.output_logprobs) == len(c.output_ids)
                         for c in calls)
    assert {c.agent_id for c in calls} == {""} and {c.call_kind for c in calls} == {""}
    # Each execution was judged by its task's verifier (tests/test.sh's reward file, through VERIFY_SCRIPT).
    assert scored and all("test_exit_code" in json.loads(s.detail) or "reward" in json.loads(s.detail)
                          for s in scored)
    assert landed and all(sample.group_id in started for sample in landed)
    assert {e for msg in landed for e in msg.execution_ids} <= {c.execution_id for c in calls}
