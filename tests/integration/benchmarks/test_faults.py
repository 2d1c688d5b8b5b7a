"""`gyre bench faults` in miniature: seeded fault cases of the training run in virtual time, the invariants checked
after each (issue 28). Each fault has a defined outcome: the run keeps going with every column at 0 (what it
dropped is counted as dropped), or it ends with a message saying to resume and the resumed run finishes."""

from __future__ import annotations

import json

import pytest

from gyre.benchmarks.faults import KINDS, run_case, run_realtime_case, sweep

COLUMNS = ("samples_lost_in_transit", "samples_unaccounted", "samples_trained_twice", "versions_not_monotone",
           "staleness_violations")


def kept(row: dict) -> None:
    assert row["fired"] > 0 and row["finished"] and row["outcome"] == "kept", row
    assert all(row[column] == 0 for column in COLUMNS), row


def test_faults_the_run_survives_leave_every_invariant_whole():
    for kind in ("delay", "duplicate-samples", "duplicate-microstep-done", "duplicate-step-applied",
                 "drop-microstep-done"):
        kept(run_case(kind, 0))


def test_a_dropped_landing_is_counted_dropped_and_the_run_goes_on():
    row = run_case("drop-samples", 0)
    kept(row)
    assert row["samples_dropped_counted"] == 2, row  # one group of 2 executions, 1 sample each


def test_a_dropped_step_ready_or_step_applied_is_announced_again():
    kept(run_case("drop-step-ready", 0, plan="drop claimer>core StepReady 2 1"))
    kept(run_case("drop-step-applied", 0, plan="drop core>claimer StepApplied 2 1"))


def test_a_claimer_killed_between_steps_restarts_from_its_journal():
    row = run_case("kill", 0, plan="kill claimer at 3 SamplesLanded")
    kept(row)
    assert row["samples_dropped_counted"] > 0, row  # what was in flight died with it, counted


def test_a_claimer_killed_while_its_step_was_out_ends_the_run_and_the_resume_finishes():
    row = run_case("kill", 0, plan="kill claimer at 3 MicroStepDone")
    assert row["reason"].startswith("the micro-step claimer restarted after micro-steps of step"), row
    assert "--resume" in row["reason"]
    assert row["resumed"] and row["finished"] and row["outcome"] == "resumed", row
    assert all(row[column] == 0 for column in COLUMNS), row


def test_the_sweep_covers_every_kind(capsys):
    result = sweep(tuple(KINDS), 1)
    assert sorted(result["by_kind"]) == sorted(KINDS) and len(KINDS) >= 8
    assert json.loads(json.dumps(result, default=str))["seeds"] == 1


def test_real_process_kills_a_satellite_restarts_and_the_cores_death_ends_the_run_for_a_resume():
    """Real deaths (os._exit) under the local-process launcher: kept few (two runs of a few seconds each)."""
    satellite = run_realtime_case("satellite-after-2nd-grant")
    assert satellite["fired"] and satellite["outcome"] == "kept", (satellite["reason"], satellite)
    assert all(satellite[column] == 0 for column in COLUMNS), satellite
    core = run_realtime_case("core-after-step-2")
    assert core["reason"] == "process core exited with status 9", (core["reason"], core)
    assert core["outcome"] == "resumed" and core["resumed_from_step"] >= 0, core
    assert all(core[column] == 0 for column in COLUMNS), core


@pytest.mark.timeout(420)
def test_gyre_run_restarts_the_named_process_groups_and_refuses_unknown_ones(tmp_path, capsys):
    from gyre.benchmarks import faults
    from gyre.runtime.testing import gyre_cli

    topology = ["--", "--work", str(tmp_path), "--steps", "3", "--satellite-dies-at-grant", "2"]
    assert gyre_cli(["run", faults.__file__, "--restart-processes", "sat9", *topology]) == 2
    assert "--restart-processes names no process group of the topology: ['sat9']" in capsys.readouterr().err
    # A bound on the run (not a timed assertion): a run that stalls ends with a reason that says so.
    code = gyre_cli(["run", faults.__file__, "--restart-processes", "sat1", "--until-s", "300", *topology])
    err = capsys.readouterr().err
    assert code == 0 and "trained 3 steps" in err, err[-3000:]
    assert (tmp_path / "satellite.killed").exists()  # it died once, holding its second claim, and came back


def test_a_claimer_restarted_without_a_journal_ends_the_run_instead_of_hanging(tmp_path):
    from gyre.benchmarks.faults import fault_topology
    from gyre.runtime.testing import run_with_faults

    topology = fault_topology(str(tmp_path / "checkpoints"), steps=6, seed=0, claimer_journal=False)
    run = run_with_faults(topology, "kill claimer at 3 SamplesLanded", until_s=120.0)
    assert run.exit_code == 1 and run.reason.startswith("the micro-step claimer restarted without a journal"), run
