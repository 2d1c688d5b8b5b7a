"""`gyre run --resume` end to end in virtual time (tests/integration/runtime/resume_topology.py): a run whose core
dies after step 1 continues from its checkpoint with its own arguments; a conflicting flag is refused; the event
log gains a segment that `gyre log` reads with the first; no sample trains twice (issue 28)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from gyre.messages.checkpoints import CheckpointAsked
from gyre.runtime import Codec, Envelope, Kind, read_log
from gyre.runtime.checkpoint import load_latest
from gyre.runtime.cli_run import conflicts, next_log_segment
from gyre.runtime.event_log import EventLogWriter
from gyre.runtime.logs import configure_logging
from gyre.runtime.testing import gyre_cli

TOPOLOGY = str(Path(__file__).with_name("resume_topology.py"))


@pytest.fixture(autouse=True)
def _logging_back_on_the_real_stderr(capsys):
    """`gyre run` in-process points structlog at the stderr capsys captures, which closes after the test: later
    tests' log lines would then raise. Point it back."""
    yield
    with capsys.disabled():
        configure_logging()


def test_a_run_whose_core_died_resumes_from_its_checkpoint(tmp_path, capsys):
    report = tmp_path / "report"
    assert gyre_cli(["run", TOPOLOGY, "--virtual", "--report", str(report), "--steps", "4",
                     "--crash-after-step", "1"]) == 1
    err = capsys.readouterr().err
    # Step 1's checkpoint is the final one, taken as the run stopped (the core's part left as a file).
    assert "the core died after step 1 (exit 1)" in err and "can go on from its checkpoint of step 1" in err
    first, _ = load_latest(report / "run_checkpoints")
    assert first.step_id == 1 and first.manifest["run"]["argv"][-2:] == ["--crash-after-step", "1"]
    assert first.has_part("core.record.json")

    # Another value for a topology argument, or another seed, is refused with both values.
    assert gyre_cli(["run", TOPOLOGY, "--virtual", "--resume", "--report", str(report), "--steps", "5"]) == 2
    assert "--steps: given '5', the run's '4'" in capsys.readouterr().err
    assert gyre_cli(["run", TOPOLOGY, "--virtual", "--resume", "--seed", "9", "--report", str(report)]) == 2
    assert "--seed: given 9, the run had none" in capsys.readouterr().err

    assert gyre_cli(["run", TOPOLOGY, "--virtual", "--resume", "--report", str(report)]) == 0
    err = capsys.readouterr().err
    assert "from " + str(first.path) in err and "trained 4 steps" in err
    run = json.loads((report / "run.json").read_text())
    # (a step may still end as the run stops: the record is honest about it)
    assert [(s["step"], s["version"]) for s in run["steps"]][:4] == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert [r["from_step"] for r in run["resumes"]] == [1]
    last, _ = load_latest(report / "run_checkpoints")
    assert last.step_id >= 3 and last.manifest["weight_version"] == last.step_id + 1  # the final one, at the end
    # The scripted core's "weights" chain its trained executions: each once, across both runs.
    trained = last.read_json("core.json")["trained"]
    assert trained and max(Counter(trained).values()) == 1
    ledger = last.read_json("claimer.json")["counts"]
    assert ledger["samples_trained"] == len(trained) and ledger.get("samples_lost", 0) == 0
    # Groups of the first run not trained by step 1 ran again under new ids.
    resumed_groups = {e.rsplit("-", 1)[0] for e in trained if "r1" in e}
    assert resumed_groups and all(g.endswith("r1") for g in resumed_groups)

    # The log: a folder of two segments, read as one; each step applied once, in order.
    log = report / "events.glog"
    assert sorted(p.name for p in log.iterdir()) == ["0000.glog", "0001.glog"]
    codec = Codec()
    applied = [r.decode(codec) for r in read_log(log)
               if r.type_name.endswith(".StepApplied") and r.envelope.receiver == "monitor"]
    assert [(m.step_id, m.version) for m in applied][:4] == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert gyre_cli(["log", "stats", str(log)]) == 0
    assert "records:" in capsys.readouterr().out


def test_resume_without_a_checkpoint_says_so(tmp_path, capsys):
    report = tmp_path / "report"
    assert gyre_cli(["run", TOPOLOGY, "--virtual", "--resume", "--report", str(report)]) == 2
    assert "no whole checkpoint under" in capsys.readouterr().err


def test_conflicts_compare_flag_values():
    run = ["--report", "r", "--steps", "4", "--engine-arg=--x", "--engine-arg", "y", "--skip-eval"]
    assert conflicts(run, ["--report", "r"]) == []
    assert conflicts(run, ["--skip-eval", "--steps=4"]) == []
    assert conflicts(run, ["--steps", "5"]) == ["--steps: given '5', the run's '4'"]
    assert conflicts(run, ["--policy", "async"]) == ["--policy: given 'async', the run had none"]
    assert conflicts(run, ["--engine-arg", "y"]) == ["--engine-arg: given 'y', the run's '--x y'"]


def test_a_killed_runs_unmerged_segments_join_the_log(tmp_path):
    log = tmp_path / "events.glog"
    parts = tmp_path / "events.glog.parts"
    codec = Codec()
    for index, name in enumerate(("launcher", "control")):  # what a kill -9 of the launcher leaves
        writer = EventLogWriter(parts / f"{name}.glog")
        envelope = Envelope(index + 1, name, "monitor", "", float(index), 0, 0, Kind.TELL)
        writer.append(float(index), *codec.encode(envelope, CheckpointAsked(index)))
        writer.close()
    nxt = next_log_segment(str(log))
    assert nxt == str(log / "0001.glog") and not parts.exists()
    assert sorted(p.name for p in log.iterdir()) == ["0000.glog"]
    assert [r.decode(codec).step_id for r in read_log(log)] == [0, 1]


def test_gyre_run_under_a_fault_plan(tmp_path, capsys):
    report = tmp_path / "report"
    plan = "delay executor>claimer SamplesLanded 0.5; duplicate core>monitor StepApplied 2"
    assert gyre_cli(["run", TOPOLOGY, "--virtual", "--faults", plan, "--report", str(report), "--steps", "3"]) == 0
    err = capsys.readouterr().err
    assert "delay executor>claimer SamplesLanded 0.5: executor>claimer gyre.samples.SamplesLanded" in err
    assert "duplicate core>monitor StepApplied 2" in err and "trained 3 steps" in err
    run = json.loads((report / "run.json").read_text())
    assert [s["step"] for s in run["steps"]][:3] == [0, 1, 2]  # the duplicated StepApplied is recorded once
    assert gyre_cli(["run", TOPOLOGY, "--faults", plan, "--report", str(report)]) == 2
    assert "--faults needs --virtual" in capsys.readouterr().err
    assert gyre_cli(["run", TOPOLOGY, "--virtual", "--faults", "melt core", "--report", str(report)]) == 2
    assert "unknown fault" in capsys.readouterr().err
