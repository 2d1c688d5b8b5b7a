"""A short run of the main job: real cells, proxy, agents, scorer, trainer, a couple of GSPO steps.

Small on purpose (groups of 4, one group per step, no held-out evaluation) so CI can afford it, from the warm start
that ships in examples/warm_start, as a user's first run is; it checks that samples were trained and that weight
versions advanced. (The rebuilt warm start's path, copy pretraining and SFT, runs in the resume test.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(900)
def test_main_job_trains_a_few_steps(tmp_path: Path) -> None:
    report = tmp_path / "report"
    env = dict(os.environ, GYRE_CACHE=str(tmp_path / "cache"), GYRE_LOG_JSON="1")
    command = [
        sys.executable, "-m", "gyre.runtime.cli", "run", str(ROOT / "examples" / "agent_rl.py"),
        "--report", str(report), "--steps", "2", "--group-size", "4", "--groups-per-step", "1",
        "--train-tasks", "20", "--skip-eval", "--weight-average-decay", "0.5", "--checkpoint-every", "1",
        # Groups of 4 often get equal rewards: keep them (dynamic sampling would drop them and the two steps
        # might never fill).
        "--min-reward-spread", "0",
    ]
    run = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=840)
    assert run.returncode == 0, run.stderr[-4000:]
    summary = json.loads((report / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["task_sampling"] == "signal-per-token"
    # The run began from the shipped warm start, checked and copied into the cache under its digest.
    from gyre.engines.model_manifest import verify

    shipped = verify(ROOT / "examples" / "warm_start")
    assert summary["warm_start"] == str(tmp_path / "cache" / "agent_rl" / f"warm-{shipped['model_digest'][:16]}")
    assert summary["samples_trained"] > 0 and summary["tokens_trained"] > 0
    # Without held-out evaluation there is no per-kind split to report, and the keys say so rather than vanish.
    assert summary["success_by_kind_before"] == {} and summary["success_by_kind_after"] == {}
    assert summary["success_measure"] == "not scored"
    timeline = json.loads((report / "run.json").read_text())
    assert [step["version"] for step in timeline["steps"]] == [1, 2]
    assert any(group["landed"] for group in timeline["groups"])
    assert (report / "reward_curve.png").stat().st_size > 0
    assert (report / "cell_roles.png").stat().st_size > 0
    assert (report / "final_model" / "model.safetensors").is_file()
    # The core kept a weight average, which is the model the report scores, and saved a checkpoint every step.
    assert summary["scored_model"] == "final_model_average" and summary["weight_average_decay"] == 0.5
    assert (report / "final_model_average" / "model.safetensors").is_file()
    assert sorted(p.name for p in (report / "checkpoints").iterdir()) == ["v00001", "v00002"]
    # The event log is recorded into the report without --log, and holds the run's applied steps.
    from gyre.runtime import Codec, read_log

    applied = [r.decode(Codec()) for r in read_log(report / "events.glog") if r.type_name.endswith(".StepApplied")]
    assert sorted({(m.step_id, m.version) for m in applied}) == [(0, 1), (1, 2)]
    # Where each cell's time went, read off the same log: every cell's roles cover the steady window, and some cell
    # held a micro-step for part of its train time in it. (Not necessarily the core: it applies every step, but the
    # micro-steps between the first applied step and the last can all go to a satellite.)
    from gyre.benchmarks.studies.cell_utilization import utilization

    cells = utilization(report / "events.glog")["cells"]
    assert sorted(cells) == ["core", "sat1", "sat2"]
    for row in cells.values():
        assert row["rollout_share"] + row["train_share"] + row["switching_share"] == pytest.approx(1.0, abs=0.02)
    busy = [row["train_busy_share"] for row in cells.values() if row["train_busy_share"] is not None]
    assert busy and all(0.0 <= share <= 1.0 for share in busy) and max(busy) > 0.0, cells
    # Where the rollout tokens went: the landed groups' executions are among those counted, with their kinds.
    from gyre.benchmarks.studies.rollout_cost import rollout_cost

    cost = rollout_cost(report / "events.glog")
    assert cost["groups_landed"] >= 2 * summary["groups_per_step"] and cost["tokens"] > 0
    assert sum(kind["tokens"] for kind in cost["by_kind"].values()) == cost["tokens"]
    executor = [line for line in run.stderr.splitlines() if '"executor_started"' in line]
    assert executor and '"warm": true' in executor[0]  # agents were forked from the warm launcher
