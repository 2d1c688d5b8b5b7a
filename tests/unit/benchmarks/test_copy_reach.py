"""benchmarks/studies/copy_reach.py: token accuracy by gap, and with --by-kind the share of copies each kind gets whole."""

from __future__ import annotations

import importlib
import re
from pathlib import Path



def _load():
    return importlib.import_module("gyre.benchmarks.studies.copy_reach")


def test_by_kind_scores_every_kind_at_every_gap_and_counts_whole_copies(tiny_model_dir, capsys):
    assert _load().main([str(tiny_model_dir), "--gaps", "0,10", "--examples", "6", "--by-kind"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if "copy accuracy" in line]
    rows = [re.search(r"gap <=\s+(\d+) .* copy accuracy ([\d.]+), (\w+)\s+copied whole ([\d.]+)", line) for line in lines]
    assert all(rows), lines
    assert [(int(r[1]), r[3]) for r in rows] == [(gap, kind) for gap in (0, 10) for kind in ("span", "join", "look",
                                                                                            "quote")]
    for row in rows:  # an untrained model: every share is a share, and a whole copy needs every token right
        accuracy, whole = float(row[2]), float(row[4])
        assert 0.0 <= whole <= 1.0 and 0.0 <= accuracy <= 1.0
        assert whole == 0.0 or accuracy > 0.0


def test_without_by_kind_one_line_per_gap(tiny_model_dir, capsys):
    assert _load().main([str(tiny_model_dir), "--gaps", "0,5", "--examples", "4"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == str(tiny_model_dir)
    assert len([line for line in out.splitlines() if "copy accuracy" in line]) == 2 and "whole" not in out
