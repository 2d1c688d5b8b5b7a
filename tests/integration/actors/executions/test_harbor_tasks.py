"""Harbor tasks through the real executor and evaluator in bubblewrap sandboxes (gyre.actors.eval_cli's topology):
every shipped task's oracle scores 1 and a do-nothing agent 0 (all 2 x 27 executions, 4 at a time: a few seconds);
a verifier that crashes, hangs or writes nonsense drops the execution; an agent that overruns its limit is still
scored on its preserved workspace; the `none` sandbox refuses Harbor tasks; `gyre eval --json` reports 1.0."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gyre.actors.eval_cli import run_eval

SHIPPED = Path(__file__).resolve().parents[4] / "examples" / "tasks"
needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None or os.geteuid() != 0,
                                 reason="the bubblewrap sandbox needs bwrap (.ci/setup installs it) and root")


def write_task(root: Path, name: str, test_sh: str, solve_sh: str = "true\n", agent_timeout_s: float = 30,
               verifier_timeout_s: float = 20) -> None:
    directory = root / name
    (directory / "environment" / "app").mkdir(parents=True)
    (directory / "tests").mkdir()
    (directory / "solution").mkdir()
    (directory / "instruction.md").write_text("Make /app/flag.txt say done.\n")
    (directory / "task.toml").write_text(f"[agent]\ntimeout_sec = {agent_timeout_s}\n"
                                         f"[verifier]\ntimeout_sec = {verifier_timeout_s}\n")
    (directory / "environment" / "Dockerfile").write_text("FROM debian:bookworm-slim\nWORKDIR /app\nCOPY app/ /app/\n")
    (directory / "environment" / "app" / "flag.txt").write_text("not yet\n")
    (directory / "tests" / "test.sh").write_text(test_sh)
    (directory / "solution" / "solve.sh").write_text(solve_sh)


@needs_bwrap
@pytest.mark.timeout(300)
def test_every_oracle_scores_one_and_doing_nothing_scores_zero() -> None:
    oracle = run_eval(SHIPPED, "oracle", "bubblewrap", max_concurrent=4)
    assert oracle["num_tasks"] >= 24
    assert [t["task_id"] for t in oracle["tasks"] if not t["success"]] == []
    assert oracle["success_rate"] == 1.0
    noop = run_eval(SHIPPED, "noop", "bubblewrap", max_concurrent=4)
    assert [(t["task_id"], t["runs"]) for t in noop["tasks"] if t["reward"] != 0.0 or len(t["runs"]) != 1] == []
    assert all(run["reward"] == 0.0 for t in noop["tasks"] for run in t["runs"])  # scored 0, not dropped
    assert noop["success_rate"] == 0.0


@needs_bwrap
@pytest.mark.timeout(300)
def test_broken_verifiers_drop_and_a_timed_out_agent_is_still_scored(tmp_path: Path) -> None:
    good = "grep -q done /app/flag.txt && echo 1 > /logs/verifier/reward.txt || echo 0 > /logs/verifier/reward.txt\n"
    write_task(tmp_path, "crashes", "exit 3\n")
    write_task(tmp_path, "hangs", "sleep 600\n", verifier_timeout_s=1)
    write_task(tmp_path, "nonsense", "echo lots > /logs/verifier/reward.txt\n")
    write_task(tmp_path, "json-reward", "echo '{\"reward\": 0.5, \"tests\": 2}' > /logs/verifier/reward.json\n")
    # 5 s, not 1: the agent must have written its flag before the timeout, and on a loaded 2-core machine (the suite
    # runs two workers) starting the sandbox alone took more than a second.
    write_task(tmp_path, "slow-agent", good, solve_sh="echo done > /app/flag.txt\nsleep 600\n", agent_timeout_s=5)
    report = run_eval(tmp_path, "oracle", "bubblewrap", max_concurrent=5)
    by_id = {t["task_id"]: t for t in report["tasks"]}
    assert "scorer crashed" in by_id["crashes"]["runs"][0]["dropped"]
    assert "timed out" in by_id["hangs"]["runs"][0]["dropped"]
    assert "output unusable" in by_id["nonsense"]["runs"][0]["dropped"]
    assert by_id["json-reward"]["runs"][0]["reward"] == 0.5 and not by_id["json-reward"]["success"]
    slow = by_id["slow-agent"]["runs"][0]
    assert slow["reward"] == 1.0 and slow["agent_timed_out"] is True
    assert report["success_rate"] == pytest.approx(1 / 5)


def test_the_none_sandbox_refuses_harbor_tasks(tmp_path: Path) -> None:
    write_task(tmp_path, "t", "echo 1 > /logs/verifier/reward.txt\n")
    report = run_eval(tmp_path, "oracle", "none")
    (task,) = report["tasks"]
    assert "none" in task["refused"] and task["runs"] == [] and report["success_rate"] == 0.0


@needs_bwrap
@pytest.mark.timeout(300)
def test_gyre_eval_json_on_the_shipped_tasks() -> None:
    done = subprocess.run([sys.executable, "-m", "gyre.runtime.cli", "eval", str(SHIPPED), "--agent", "oracle",
                           "--json"], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout)
    assert report["success_rate"] == 1.0 and len(report["tasks"]) >= 24
    broken = subprocess.run([sys.executable, "-m", "gyre.runtime.cli", "eval", str(SHIPPED / "fix-add" / "tests")],
                            capture_output=True, text=True, timeout=60)
    assert broken.returncode == 2 and "no task directories" in broken.stderr
