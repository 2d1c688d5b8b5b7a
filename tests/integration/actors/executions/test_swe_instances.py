"""The shipped SWE-bench-style instances in the bubblewrap sandbox: the gold patch scores 1, doing nothing 0, and
the scorer judges only what the FAIL_TO_PASS and PASS_TO_PASS tests say: a half fix scores 0, an agent that
rewrites the hidden tests gains nothing (they are put back first), one that breaks a passing test scores 0."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from gyre.actors.eval_cli import run_eval

SHIPPED = Path(__file__).resolve().parents[4] / "examples" / "swe"

pytestmark = [
    pytest.mark.skipif(shutil.which("bwrap") is None or os.geteuid() != 0, reason="needs bwrap and root"),
    pytest.mark.skipif(shutil.which("git") is None, reason="the SWE scorer applies the test patch with git"),
    pytest.mark.timeout(300),
]


def _details(report: dict) -> dict[str, dict]:
    return {t["task_id"]: json.loads(t["runs"][0]["detail"]) for t in report["tasks"]}


def test_oracle_scores_one_and_noop_zero(tmp_path: Path) -> None:
    oracle = run_eval(SHIPPED, "oracle", "bubblewrap", workspace_root=str(tmp_path / "a"))
    assert oracle["success_rate"] == 1.0 and oracle["num_tasks"] == 2, oracle
    for detail in _details(oracle).values():
        assert detail["fail_to_pass_passed"] == detail["fail_to_pass"] == 2 and detail["pass_to_pass_passed"] == 3
    noop = run_eval(SHIPPED, "noop", "bubblewrap", workspace_root=str(tmp_path / "b"))
    assert noop["success_rate"] == 0.0 and noop["mean_reward"] == 0.0, noop
    for detail in _details(noop).values():
        assert detail["test_patch_applied"] and detail["fail_to_pass_passed"] == 0 and detail["pass_to_pass_passed"] == 3


@pytest.mark.parametrize(("agent", "reward", "f2p_passed", "p2p_passed"), [
    # only longest_word fixed: one of the two FAIL_TO_PASS tests passes
    ("sed -i 's/in text.split(\" \"):/in text.split():/' textstats/words.py", 0.0, 1, 3),
    # the agent "fixes" the tests instead of the code: they are restored from the snapshot before the test patch
    ("sh -c 'printf \"def test_word_count_tabs_and_newlines():\\n    pass\\n\" > tests/test_words.py'", 0.0, 0, 3),
    # the full fix, then a passing behaviour broken
    ("sh -c \"sed -i 's/text.split(\\\" \\\")/text.split()/' textstats/words.py && "
     "sed -i 's/return best/return best + \\\"!\\\"/' textstats/words.py\"", 0.0, 1, 2),
    # the full fix
    ("sed -i 's/text.split(\" \")/text.split()/' textstats/words.py", 1.0, 2, 3),
])
def test_the_scorer_counts_each_listed_test(tmp_path: Path, agent: str, reward: float, f2p_passed: int,
                                            p2p_passed: int) -> None:
    report = run_eval(SHIPPED / "textstats-1", agent, "bubblewrap", workspace_root=str(tmp_path / "x"))
    (task,) = report["tasks"]
    assert task["runs"][0]["reward"] == reward, task
    detail = _details(report)["textstats-1"]
    assert (detail["fail_to_pass_passed"], detail["pass_to_pass_passed"]) == (f2p_passed, p2p_passed), detail
