"""SIGTERM, then resume, on the main job (issue 28): the final checkpoint a stopping run takes, and a resume from it.

    python benchmarks/studies/sigterm_resume.py WORK_DIR

Runs the tiny main job of the smoke test with `--steps 6 --checkpoint-every 3` in WORK_DIR, sends SIGTERM to `gyre
run` once step id 0 is applied (before any periodic checkpoint), then `gyre run ... --resume`; prints the exit
codes, the checkpoints on disk, the saved and restored state digests and run.json's steps. Minutes on a small
machine, so not in CI (tests/e2e/test_agent_rl_resume.py covers kill -9 there).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ARGS = ["--steps", "6", "--group-size", "4", "--groups-per-step", "1", "--warm-start", "rebuild", "--copy-steps", "2",
        "--copy-gap-steps", "2",
        "--sft-tasks", "20", "--sft-epochs", "1", "--train-tasks", "20", "--skip-eval", "--checkpoint-every", "3",
        "--min-reward-spread", "0"]


def _events(path: Path, name: str) -> list[dict]:
    found = []
    for line in path.read_text().splitlines():
        if line.startswith("{") and f'"event": "{name}"' in line:
            found.append(json.loads(line))
    return found


def main(work: Path) -> int:
    work.mkdir(parents=True, exist_ok=True)
    report = work / "report"
    env = dict(os.environ, GYRE_CACHE=str(work / "cache"), GYRE_LOG_JSON="1")
    command = [sys.executable, "-m", "gyre.runtime.cli", "run", str(ROOT / "examples" / "agent_rl.py"),
               "--report", str(report)]
    started = time.monotonic()
    with open(work / "first.stderr", "w") as stderr:
        first = subprocess.Popen(command + ARGS, cwd=work, env=env, stdout=subprocess.DEVNULL, stderr=stderr)
        while first.poll() is None and time.monotonic() - started < 900:
            try:
                if json.loads((report / "run.json").read_text())["steps"]:
                    break
            except (OSError, ValueError, KeyError):
                pass
            time.sleep(0.2)
        first.send_signal(signal.SIGTERM)
        first.wait(timeout=120)
    print(f"first run: exit {first.returncode} after {time.monotonic() - started:.0f} s")
    for folder in sorted((report / "run_checkpoints").glob("step-*")):
        print(f"  {folder.name}: {sorted(p.name for p in folder.iterdir())}")
    for event in _events(work / "first.stderr", "core_checkpoint_part_saved"):
        print(f"  saved step {event['step_id']}: state digest {event['state_digest']}")
    for event in _events(work / "first.stderr", "checkpoint_committed"):
        print(f"  committed step {event['step_id']} in {event['seconds']} s")
    resumed = subprocess.run(command + ["--resume"], cwd=work, env=env, capture_output=True, text=True, timeout=1200)
    (work / "resumed.stderr").write_text(resumed.stderr)
    print(f"resumed run: exit {resumed.returncode}")
    for event in _events(work / "resumed.stderr", "core_restored"):
        print(f"  restored step {event['step_id']}: state digest {event['state_digest']}")
    run = json.loads((report / "run.json").read_text())
    print(f"  run.json steps {[(s['step'], s['version']) for s in run['steps']]}, resumes {run['resumes']}")
    return resumed.returncode


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    sys.exit(main(Path(sys.argv[1])))
