"""The main job survives `kill -9` of the whole run (issue 28): `--steps 4` with a full checkpoint after every step,
every process of the run killed at once after step 2 (ids 0 and 1), then `gyre run ... --resume`.

Small as the smoke test (groups of 4, one group per step, a tiny rebuilt warm start, no held-out evaluation). Checked:
- the resumed run starts from step 1's checkpoint (or a later one, if the run got further before the kill): the
  core's restored weights and AdamW moments have the digest the manifest recorded when they were saved;
- every step id 0-3 appears once in run.json, in order, with versions 1-4: steps 3 and 4 ran once each, and the
  learning curve (run.json's steps and groups, summary.json) continues across the kill;
- no execution trained twice: the re-rolled groups have new ids (r1), and the event log (two segments, read as one)
  holds StepApplied 0-3 each once per timeline.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# The warm start is rebuilt (tiny stages): CI's one run of the rebuild path (copy pretraining, SFT, their cache).
ARGS = ["--steps", "4", "--group-size", "4", "--groups-per-step", "1", "--warm-start", "rebuild",
        "--copy-steps", "2", "--copy-gap-steps", "2",
        "--sft-tasks", "20", "--sft-epochs", "1", "--train-tasks", "20", "--skip-eval", "--checkpoint-every", "1",
        "--min-reward-spread", "0"]


def _kill_leftovers(tmp_path: Path) -> list[int]:
    """SIGKILL the processes of this test's run that outlived the kill (engine servers, agents and scorers run in
    sessions of their own, so a process-group kill misses them): those whose command line, working folder or
    environment name this test's folder. Returns their pids."""
    mark = str(tmp_path).encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            seen = (entry / "cmdline").read_bytes() + (entry / "environ").read_bytes()
            seen += os.readlink(entry / "cwd").encode()
        except OSError:
            continue
        if mark in seen:
            found.append(int(entry.name))
            try:
                os.kill(int(entry.name), signal.SIGKILL)
            except ProcessLookupError:
                pass
    return found


def _json_lines(text: str) -> list[dict]:
    lines = []
    for line in text.splitlines():
        if line.startswith("{"):
            try:
                lines.append(json.loads(line))
            except ValueError:
                pass
    return lines


@pytest.mark.timeout(1500)
def test_the_main_job_resumes_after_kill_9(tmp_path: Path) -> None:
    report = tmp_path / "report"
    env = dict(os.environ, GYRE_CACHE=str(tmp_path / "cache"), GYRE_LOG_JSON="1")
    command = [sys.executable, "-m", "gyre.runtime.cli", "run", str(ROOT / "examples" / "agent_rl.py"),
               "--report", str(report)]
    stderr_path = tmp_path / "first.stderr"
    with open(stderr_path, "w") as stderr:
        first = subprocess.Popen(command + ARGS, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=stderr,
                                 start_new_session=True)  # its own process group: one kill reaches every process
        checkpoint = report / "run_checkpoints" / "step-00000001" / "manifest.json"
        deadline = time.monotonic() + 900
        while not checkpoint.is_file() and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        os.killpg(first.pid, signal.SIGKILL)
        first.wait(timeout=60)
    leftovers = _kill_leftovers(tmp_path)
    print(f"processes that outlived the process-group kill (killed now): {len(leftovers)}")
    assert checkpoint.is_file(), stderr_path.read_text()[-4000:]
    assert first.returncode == -signal.SIGKILL
    time.sleep(1.0)  # the killed processes' ports and sockets go away with them

    try:
        resumed = subprocess.run(command + ["--resume"], cwd=tmp_path, env=env, capture_output=True, text=True,
                                 timeout=900)
    finally:
        _kill_leftovers(tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    restored = [line for line in _json_lines(resumed.stderr) if line.get("event") == "core_restored"]
    assert len(restored) == 1, resumed.stderr[-4000:]
    start = Path(restored[0]["checkpoint"])
    manifest = json.loads((start / "manifest.json").read_text())
    assert manifest["step_id"] >= 1 and restored[0]["step_id"] == manifest["step_id"]
    assert restored[0]["state_digest"] == manifest["core_state_digest"]  # weights and moments as saved
    assert restored[0]["version"] == manifest["weight_version"]

    run = json.loads((report / "run.json").read_text())
    steps = [(s["step"], s["version"]) for s in run["steps"]]
    assert steps[:4] == [(0, 1), (1, 2), (2, 3), (3, 4)] and len({s for s, _ in steps}) == len(steps)
    assert [r["from_step"] for r in run["resumes"]] == [manifest["step_id"]]
    summary = json.loads((report / "summary.json").read_text())
    assert summary["steps"] >= 4 and summary["samples_trained"] > 0
    resumed_groups = [g["group_id"] for g in run["groups"] if g["group_id"].endswith("r1")]
    assert resumed_groups, run["groups"]

    from gyre.runtime import Codec, read_log

    log = report / "events.glog"
    assert sorted(p.name for p in log.iterdir()) == ["0000.glog", "0001.glog"]  # the killed run's parts, merged
    codec = Codec()
    applied = [r.decode(codec) for r in read_log(log / "0001.glog")
               if r.type_name.endswith(".StepApplied") and r.envelope.receiver == "monitor"]
    assert [m.step_id for m in applied][:4 - manifest["step_id"] - 1] == list(range(manifest["step_id"] + 1, 4))
    landed = [r.decode(codec) for r in read_log(log)
              if r.type_name.endswith(".SamplesLanded") and r.envelope.receiver == "claimer"]
    executions = [e for m in landed for e in m.execution_ids]
    assert len(executions) == len(set(executions))  # no execution landed twice, across both segments
