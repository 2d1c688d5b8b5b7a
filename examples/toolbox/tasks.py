"""The toolbox task family: short tool-using chores in a workspace, generated from a seed.

Every task needs at least one tool call (the answer goes into answer.txt through write_file) and most need the
agent to carry a value from a tool's observation into the next call, which is what a ~1M-parameter model can
learn by copying. Kinds, from easy to long:

    kind    prompt (shortened)                                       expert's calls
    write   Write the words W1 W2 to answer.txt.                     write_file
    calc    Compute 12*7 and write the result to answer.txt.         calculator, write_file
    sum     Add the numbers in data.txt and write the sum ...        read_file, calculator, write_file
    lookup  Write the price of pear in prices.json to answer.txt.    read_file, write_file
    cost    Multiply the price of pear in prices.json by 3 ...       delegate (sub-agent: read_file), calculator,
                                                                     write_file
    total   Add the numbers in a.txt, b.txt and c.txt ...            3 x read_file, calculator, write_file; passes
                                                                     the context budget: a main summary call
    helper  Ask a sub-agent to add the numbers in a.txt, ... d.txt   delegate (sub-agent: 4 x read_file, calculator;
            ...                                                      it passes the budget: a sub-agent summary)

The split of a task is a function of its content (a hash), not of the seed or of its position: a held-out task can
never appear among training tasks, whatever seeds generate them. The scorer is a command line (score.py) that
carries the expected answer, run in the workspace after the agent has exited.

This module imports only the standard library and attrs, so a topology file can load it by path.
"""

from __future__ import annotations

import hashlib
import json
import random
import sys
from pathlib import Path
from typing import Callable

import attrs

SPLITS = ("train", "heldout")
HELDOUT_PERCENT = 20
"""Share of the task space that is held out, by content hash."""
ANSWER_FILE = "answer.txt"
SCORE_SCRIPT = Path(__file__).resolve().with_name("score.py")
MAX_ATTEMPTS_PER_TASK = 2000
"""Bound on draws for one task slot; exceeding it means the requested kinds ran out of distinct tasks."""

PROMPTS: dict[str, str] = {
    "write": "Write the words {words} to answer.txt.",
    "calc": "Compute {expression} and write the result to answer.txt.",
    "sum": "Add the numbers in data.txt and write the sum to answer.txt.",
    "lookup": "Write the price of {item} in prices.json to answer.txt.",
    "cost": "Multiply the price of {item} in prices.json by {quantity} and write the result to answer.txt.",
    "total": "Add the numbers in a.txt, b.txt and c.txt and write the sum to answer.txt.",
    "helper": "Ask a sub-agent to add the numbers in a.txt, b.txt, c.txt and d.txt, then write the sum to answer.txt.",
}
"""Prompt template of each kind; the expert parses prompts with these same templates."""

KINDS = tuple(PROMPTS)

WORDS = (
    "amber", "bird", "cloud", "delta", "eagle", "fern", "glass", "harbor", "iron", "jade", "kite", "lake", "maple",
    "north", "ocean", "pine", "quartz", "river", "stone", "tiger", "umbra", "violet", "willow", "yellow", "zebra",
    "copper", "forest", "garden", "marble", "planet",
)
ITEMS = (
    "apple", "pear", "plum", "lemon", "mango", "grape", "melon", "peach", "kiwi", "cherry", "bread", "milk", "rice",
    "tea", "coffee", "sugar", "salt", "cheese", "butter", "honey", "egg", "fish", "bean", "corn", "nut", "soap",
    "pen", "cup", "lamp", "rope",
)


class TaskSpaceExhausted(ValueError):
    """More distinct tasks were asked for than the chosen kinds can make in the chosen split."""


@attrs.frozen(eq=True, hash=False)
class Task:
    """One task: what the agent is told, the files it starts with, and how its workspace is judged."""

    task_id: str
    """Stable id from the task's content: "<kind>-<10 hex digits>"."""
    split: str
    """"train" or "heldout"."""
    kind: str
    """One of KINDS."""
    prompt: str
    """The user message the agent receives."""
    workspace_files: dict[str, str]
    """Files (relative path -> text) to put in a fresh workspace before the agent starts."""
    expected: str
    """The right content of answer.txt; only the scorer's command line carries it to the workspace side."""
    scorer_argv: tuple[str, ...]
    """Command line that scores the workspace: run it with the workspace as working directory; prints JSON
    {"reward": float, "success": bool} and exits 0."""


def _numbers(rng: random.Random, low: int, high: int) -> list[int]:
    return [rng.randint(1, 99) for _ in range(rng.randint(low, high))]


def _prices(rng: random.Random) -> dict[str, int]:
    items = rng.sample(ITEMS, rng.randint(3, 5))
    return {item: rng.randint(1, 50) for item in items}


def _numbers_text(numbers: list[int]) -> str:
    return " ".join(str(number) for number in numbers)


Draw = tuple[str, dict[str, str], str]
"""(prompt, workspace files, expected answer)."""


def _draw_write(rng: random.Random) -> Draw:
    words = " ".join(rng.sample(WORDS, 2))
    return PROMPTS["write"].format(words=words), {}, words


def _draw_calc(rng: random.Random) -> Draw:
    left, right, op = rng.randint(2, 99), rng.randint(2, 99), rng.choice("+-*")
    value = {"+": left + right, "-": left - right, "*": left * right}[op]
    return PROMPTS["calc"].format(expression=f"{left}{op}{right}"), {}, str(value)


def _draw_sum(rng: random.Random) -> Draw:
    numbers = _numbers(rng, 2, 4)
    return PROMPTS["sum"], {"data.txt": _numbers_text(numbers)}, str(sum(numbers))


def _draw_lookup(rng: random.Random) -> Draw:
    prices = _prices(rng)
    item = rng.choice(sorted(prices))
    return PROMPTS["lookup"].format(item=item), {"prices.json": json.dumps(prices)}, str(prices[item])


def _draw_cost(rng: random.Random) -> Draw:
    prices = _prices(rng)
    item, quantity = rng.choice(sorted(prices)), rng.randint(2, 9)
    prompt = PROMPTS["cost"].format(item=item, quantity=quantity)
    return prompt, {"prices.json": json.dumps(prices)}, str(prices[item] * quantity)


def _number_files(rng: random.Random, names: tuple[str, ...]) -> tuple[dict[str, str], str]:
    # Longer files than "sum": reading three or four of them passes the agent's context budget, so these kinds
    # teach (and in RL exercise) the summary call, of the main agent ("total") and of a sub-agent ("helper").
    groups = [[rng.randint(10, 99) for _ in range(rng.randint(3, 5))] for _ in names]
    files = {name: _numbers_text(numbers) for name, numbers in zip(names, groups)}
    return files, str(sum(sum(numbers) for numbers in groups))


def _draw_total(rng: random.Random) -> Draw:
    files, expected = _number_files(rng, ("a.txt", "b.txt", "c.txt"))
    return PROMPTS["total"], files, expected


def _draw_helper(rng: random.Random) -> Draw:
    files, expected = _number_files(rng, ("a.txt", "b.txt", "c.txt", "d.txt"))
    return PROMPTS["helper"], files, expected


_DRAWS: dict[str, Callable[[random.Random], Draw]] = {
    "write": _draw_write,
    "calc": _draw_calc,
    "sum": _draw_sum,
    "lookup": _draw_lookup,
    "cost": _draw_cost,
    "total": _draw_total,
    "helper": _draw_helper,
}


def content_digest(kind: str, prompt: str, workspace_files: dict[str, str]) -> str:
    """Hex digest of what defines a task; its id and its split derive from it."""
    canonical = json.dumps([kind, prompt, sorted(workspace_files.items())], ensure_ascii=False)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def split_of(digest: str) -> str:
    """The split a task's content belongs to."""
    return "heldout" if int(digest[:8], 16) % 100 < HELDOUT_PERCENT else "train"


SCORER_PRELOAD = ("argparse", "json", "math", "re")
"""What score.py imports: a warm launcher that imported them forks each scorer (gyre.actors.executions.evaluator)."""


def scorer_argv(expected: str, *, python: str = sys.executable) -> tuple[str, ...]:
    """The scoring command line for a task whose answer is `expected` (run with the workspace as cwd).

    `-S` skips `site` (the scorer needs only the standard library): 0.04 instead of 0.06 CPU-s a run, and the main
    job scores ~190 executions a step."""
    return (python, "-S", str(SCORE_SCRIPT), "--answer-file", ANSWER_FILE, "--expected", expected)


def generate_tasks(
    seed: int, split: str, count: int, *, kinds: tuple[str, ...] = KINDS, exclude: frozenset[str] = frozenset()
) -> tuple[Task, ...]:
    """`count` distinct tasks of `split`, the same for the same arguments; kinds take turns in the given order.

    `exclude` holds task ids that must not be drawn (for example the tasks a warm start was fine-tuned on, so that
    RL trains on tasks the model has to solve rather than recall)."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    unknown = [kind for kind in kinds if kind not in _DRAWS]
    if unknown or not kinds:
        raise ValueError(f"kinds must be a non-empty subset of {KINDS}, got {kinds!r}")
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}")
    rng = random.Random(f"toolbox:{seed}")
    tasks: list[Task] = []
    seen: set[str] = set()
    for slot in range(count):
        kind = kinds[slot % len(kinds)]
        for _ in range(MAX_ATTEMPTS_PER_TASK):
            prompt, files, expected = _DRAWS[kind](rng)
            digest = content_digest(kind, prompt, files)
            if digest not in seen and split_of(digest) == split and f"{kind}-{digest[:10]}" not in exclude:
                break
        else:
            raise TaskSpaceExhausted(f"no new {split} task of kind {kind!r} after {MAX_ATTEMPTS_PER_TASK} draws")
        seen.add(digest)
        tasks.append(
            Task(
                task_id=f"{kind}-{digest[:10]}",
                split=split,
                kind=kind,
                prompt=prompt,
                workspace_files=files,
                expected=expected,
                scorer_argv=scorer_argv(expected),
            )
        )
    return tuple(tasks)


def write_workspace(task: Task, directory: Path) -> Path:
    """Put the task's files into `directory` (created if needed) and return it."""
    directory.mkdir(parents=True, exist_ok=True)
    for relative, text in task.workspace_files.items():
        target = directory / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text, encoding="utf-8")
    return directory
