"""Scorer of a toolbox task: judges the answer file that the agent left in its workspace.

Run inside the workspace after the agent has finished:

    python score.py --answer-file answer.txt --expected 17

It prints one JSON object {"reward": float, "success": bool} and exits 0 whatever the workspace holds (missing
file, a directory, binary garbage): a workspace state is a score, never a crash, because the evaluator drops an
execution whose scorer crashes. Only bad command-line arguments exit non-zero (2).

The expected answer travels on this command line, which exists only after the agent has exited, so the agent
cannot read it. Rewards give partial credit so a group of attempts has signal before any attempt is right:
    1.0  the file holds exactly the answer (numbers compare by value: "17.0" is 17)
    0.5  the answer appears in the file among other words ("The sum is 17")
    0.2  the file exists but holds something else (the agent made a well-formed write_file call)
    0.0  no answer file
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path

MAX_ANSWER_BYTES = 64 * 1024
"""Only this much of the answer file is read; a larger file is judged on its head."""

REWARD_EXACT = 1.0
REWARD_CONTAINS = 0.5
REWARD_WRITTEN = 0.2
REWARD_MISSING = 0.0

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def _as_number(text: str) -> float | None:
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def _same(answer: str, expected: str) -> bool:
    if answer == expected:
        return True
    left, right = _as_number(answer), _as_number(expected)
    return left is not None and right is not None and math.isclose(left, right, rel_tol=1e-9, abs_tol=1e-9)


def _contains(answer: str, expected: str) -> bool:
    """The expected answer stands in the text as a whole phrase (any case) or as a number of equal value."""
    if expected and re.search(rf"(?<![\w.-]){re.escape(expected)}(?!\w|\.\d)", answer, flags=re.IGNORECASE):
        return True
    return _as_number(expected) is not None and any(_same(token, expected) for token in _NUMBER.findall(answer))


def score_workspace(workspace: Path, answer_file: str, expected: str) -> dict[str, float | bool]:
    """The score of a workspace: {"reward": float, "success": bool}."""
    target = workspace / answer_file
    if not target.is_file():  # missing, a directory, or a pipe or device that could block the read
        return {"reward": REWARD_MISSING, "success": False}
    try:
        with target.open("rb") as handle:
            data = handle.read(MAX_ANSWER_BYTES)
    except OSError:  # vanished or unreadable: there is no answer
        return {"reward": REWARD_MISSING, "success": False}
    answer = data.decode("utf-8", errors="replace").strip()
    expected = expected.strip()
    if _same(answer, expected):
        return {"reward": REWARD_EXACT, "success": True}
    if _contains(answer, expected):
        return {"reward": REWARD_CONTAINS, "success": False}
    return {"reward": REWARD_WRITTEN, "success": False}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Score a toolbox task's workspace; prints JSON.")
    parser.add_argument("--answer-file", required=True, help="path of the answer, relative to the workspace")
    parser.add_argument("--expected", required=True, help="the right answer")
    parser.add_argument("--workspace", default=".", help="workspace directory (default: the current one)")
    args = parser.parse_args(argv)
    if Path(args.answer_file).is_absolute() or ".." in Path(args.answer_file).parts:
        parser.error("--answer-file must be a path inside the workspace")
    print(json.dumps(score_workspace(Path(args.workspace), args.answer_file, args.expected)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
