"""`gyre bench faults` in miniature: a few seeded fault cases of the training run in virtual time, the invariants
checked after each (issue 28). A fault the run survives leaves every column at 0; one it does not yet survive shows
up in its column (this test pins both, so a harness that stopped seeing faults would fail)."""

from __future__ import annotations

import json

from gyre.benchmarks.faults import KINDS, run_case, sweep

COLUMNS = ("samples_lost_in_transit", "samples_unaccounted", "samples_trained_twice", "versions_not_monotone",
           "staleness_violations")


def test_faults_the_run_survives_leave_every_invariant_whole():
    for kind in ("delay", "duplicate-samples", "duplicate-microstep-done", "duplicate-step-applied",
                 "drop-microstep-done"):
        row = run_case(kind, 0)
        assert row["fired"] > 0 and row["finished"], row
        assert all(row[column] == 0 for column in COLUMNS), row


def test_a_dropped_landing_is_seen_as_samples_lost_in_transit():
    row = run_case("drop-samples", 0)
    assert row["fired"] == 1 and row["samples_lost_in_transit"] > 0, row


def test_the_sweep_covers_every_kind(capsys):
    result = sweep(tuple(KINDS), 1)
    assert sorted(result["by_kind"]) == sorted(KINDS) and len(KINDS) >= 8
    assert json.loads(json.dumps(result, default=str))["seeds"] == 1
