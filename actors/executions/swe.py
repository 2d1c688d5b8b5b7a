"""SWE-bench-style instances: a repository snapshot, a problem statement, FAIL_TO_PASS and PASS_TO_PASS test ids,
scored by running those tests in the sandbox on the workspace the agent leaves.

One instance is a directory:

    <instance_id>/
      instance.json   SWE-bench's fields: instance_id, repo, base_commit, problem_statement, FAIL_TO_PASS,
                      PASS_TO_PASS (lists of pytest node ids, or SWE-bench's JSON-encoded strings of them),
                      test_patch (the tests that judge the fix, hidden from the agent), patch (the gold fix:
                      optional, the oracle applies it); and Gyre's optional agent_timeout_sec,
                      verifier_timeout_sec (defaults 600 and 300)
      repo/           the repository at base_commit (text files; what the agent sees, at /testbed)

Scoring, as SWE-bench's harness does it (its logic read from the SWE-bench paper and harness documentation; no code
taken): the files the test patch touches are put back to the snapshot's version (the agent's edits to those tests
do not count), the test patch is applied (`git apply`; one that does not apply scores 0, as in SWE-bench), then
pytest runs the FAIL_TO_PASS and PASS_TO_PASS ids once with `-rA`, and each id's outcome is read off its summary
line. The reward is 1 when every id of both lists passed, else 0; the detail carries the counts and the ids that
did not pass. The scorer needs git and pytest in the sandbox (the host root's git, the interpreter's pytest); a
repository whose tests need packages the interpreter lacks needs a docker backend (the environment images
SWE-bench builds), which is how the real SWE-bench instances will run.

The agent works at /testbed (SWE-bench's path) and gets the problem statement as its instruction.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path, PurePosixPath
from typing import Any

import attrs

from gyre.actors.errors import ActorError
from gyre.messages.executions import TaskSpec

__all__ = [
    "APPLY_SCRIPT",
    "SCORE_SCRIPT",
    "SweInstance",
    "SweInstanceError",
    "is_swe_task_set",
    "load_swe_instance",
    "load_swe_instances",
    "patched_files",
    "swe_task_spec",
]

WORKDIR = "/testbed"
"""Where the repository is mounted (SWE-bench's images use /testbed)."""
DEFAULT_AGENT_TIMEOUT_S = 600.0
DEFAULT_VERIFIER_TIMEOUT_S = 300.0
MAX_REPO_BYTES = 16 * 1024 * 1024
"""A snapshot's files, in all: they travel in every StartGroup message."""
MAX_REPO_FILES = 5_000
"""Files of one snapshot; a larger tree is refused rather than walked without end."""
MAX_PATCH_BYTES = 96 * 1024
"""A test or gold patch travels as one argument of the scorer's or oracle's command (Linux caps one at 128 KiB)."""
MAX_TEST_IDS = 2_000
"""FAIL_TO_PASS + PASS_TO_PASS ids of one instance (they travel in the scorer's argument too)."""
MAX_INSTANCES = 10_000
"""Instances in one set."""
_SKIPPED_DIRS = frozenset({".git", "__pycache__", ".pytest_cache", ".mypy_cache", ".venv", "node_modules"})

APPLY_SCRIPT = r"""
import pathlib, subprocess, sys
patch = pathlib.Path("/tmp/gyre.patch")
patch.write_text(sys.argv[1])
sys.exit(subprocess.run(["git", "apply", "--whitespace=nowarn", str(patch)]).returncode)
"""
"""The oracle of an SWE instance: `python -c APPLY_SCRIPT GOLD_PATCH` in /testbed (the instruction the executor
appends is ignored)."""

SCORE_SCRIPT = r"""
import json, os, pathlib, re, subprocess, sys
spec = json.loads(sys.argv[1])
for name, text in spec["originals"].items():
    path = pathlib.Path(name)
    if text is None:
        if path.is_file() or path.is_symlink():
            path.unlink()
    else:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
patch = pathlib.Path("/tmp/gyre-test.patch")
patch.write_text(spec["test_patch"])
applied = subprocess.run(["git", "apply", "--whitespace=nowarn", str(patch)], capture_output=True, text=True)
if applied.returncode != 0:
    print(json.dumps({"reward": 0.0, "success": False, "test_patch_applied": False,
                      "error": applied.stderr[-300:]}))
    sys.exit(0)
ids = spec["fail_to_pass"] + spec["pass_to_pass"]
env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
ran = subprocess.run([sys.executable, "-m", "pytest", "-rA", "--tb=no", "-q", "-p", "no:cacheprovider", *ids],
                     capture_output=True, text=True, env=env, stdin=subprocess.DEVNULL)
outcome = {}
for line in ran.stdout.splitlines():
    match = re.match(r"(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS) (\S+)", line)
    if match:
        outcome.setdefault(match[2], match[1])
def passed(group):
    return [i for i in spec[group] if outcome.get(i) == "PASSED"]
f2p, p2p = passed("fail_to_pass"), passed("pass_to_pass")
ok = len(f2p) == len(spec["fail_to_pass"]) and len(p2p) == len(spec["pass_to_pass"])
print(json.dumps({"reward": 1.0 if ok else 0.0, "success": ok, "test_patch_applied": True,
                  "fail_to_pass_passed": len(f2p), "fail_to_pass": len(spec["fail_to_pass"]),
                  "pass_to_pass_passed": len(p2p), "pass_to_pass": len(spec["pass_to_pass"]),
                  "not_passed": [i for i in ids if outcome.get(i) != "PASSED"][:20],
                  "pytest_exit_code": ran.returncode}))
"""
"""The scorer: `python -c SCORE_SCRIPT JSON` in /testbed, JSON holding the test patch, the snapshot's version of the
files it touches (null: absent), and the two id lists (module docstring)."""


class SweInstanceError(ActorError, ValueError):
    """An instance directory that cannot be loaded; the message names the file and the reason."""


@attrs.frozen
class SweInstance:
    """One loaded SWE-bench-style instance."""

    instance_id: str
    directory: str
    """The instance directory (absolute)."""
    problem_statement: str
    fail_to_pass: tuple[str, ...]
    pass_to_pass: tuple[str, ...]
    test_patch: str
    patch: str
    """The gold patch; "" when the instance has none (no oracle)."""
    repo_files: dict[str, str]
    """Relative path -> text: the snapshot."""
    agent_timeout_s: float
    verifier_timeout_s: float


def is_swe_task_set(path: str | Path) -> bool:
    """Whether `path` is an instance directory (it holds instance.json) or a directory of them."""
    root = Path(path)
    if (root / "instance.json").is_file():
        return True
    return root.is_dir() and any((child / "instance.json").is_file() for child in root.iterdir() if child.is_dir())


def load_swe_instances(path: str | Path) -> tuple[SweInstance, ...]:
    """The instance at `path`, or every instance directory directly below it (sorted by name)."""
    root = Path(path)
    if not root.is_dir():
        raise SweInstanceError(f"{root}: not a directory")
    if (root / "instance.json").is_file():
        return (load_swe_instance(root),)
    children = sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    if len(children) > MAX_INSTANCES:
        raise SweInstanceError(f"{root}: more than {MAX_INSTANCES} directories")
    instances = []
    for child in children:
        if not (child / "instance.json").is_file():
            raise SweInstanceError(f"{child / 'instance.json'}: missing (every directory of an instance set is one)")
        instances.append(load_swe_instance(child))
    if not instances:
        raise SweInstanceError(f"{root}: no instance directories")
    return tuple(instances)


def load_swe_instance(path: str | Path) -> SweInstance:
    """Load and check one instance directory (module docstring)."""
    directory = Path(path).resolve()
    where = directory / "instance.json"
    try:
        data = json.loads(where.read_text(encoding="utf-8"))
    except FileNotFoundError as error:
        raise SweInstanceError(f"{where}: missing") from error
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise SweInstanceError(f"{where}: not a readable JSON file ({error})") from error
    if not isinstance(data, dict):
        raise SweInstanceError(f"{where}: must hold a JSON object")
    instance_id = _text(data, "instance_id", where)
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}", instance_id):
        raise SweInstanceError(f"{where}: instance_id {instance_id!r} must be letters, digits, '.', '_', '-'")
    statement = _text(data, "problem_statement", where)
    test_patch = _text(data, "test_patch", where)
    patch = data.get("patch", "")
    if not isinstance(patch, str):
        raise SweInstanceError(f"{where}: patch must be a string (a unified diff)")
    for name, text in (("test_patch", test_patch), ("patch", patch)):
        if len(text.encode()) > MAX_PATCH_BYTES:
            raise SweInstanceError(f"{where}: {name} is larger than {MAX_PATCH_BYTES} bytes")
    fail_to_pass = _ids(data, "FAIL_TO_PASS", where)
    pass_to_pass = _ids(data, "PASS_TO_PASS", where)
    if not fail_to_pass:
        raise SweInstanceError(f"{where}: FAIL_TO_PASS is empty (nothing would tell a fix from no fix)")
    if len(fail_to_pass) + len(pass_to_pass) > MAX_TEST_IDS:
        raise SweInstanceError(f"{where}: more than {MAX_TEST_IDS} test ids")
    if not patched_files(test_patch):
        raise SweInstanceError(f"{where}: test_patch touches no file (not a unified diff?)")
    timeouts = []
    for key, default in (("agent_timeout_sec", DEFAULT_AGENT_TIMEOUT_S),
                         ("verifier_timeout_sec", DEFAULT_VERIFIER_TIMEOUT_S)):
        value = data.get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
            raise SweInstanceError(f"{where}: {key} must be a number > 0, got {value!r}")
        timeouts.append(float(value))
    return SweInstance(
        instance_id=instance_id, directory=str(directory), problem_statement=statement,
        fail_to_pass=fail_to_pass, pass_to_pass=pass_to_pass, test_patch=test_patch, patch=patch,
        repo_files=_snapshot(directory / "repo"), agent_timeout_s=timeouts[0], verifier_timeout_s=timeouts[1],
    )


def patched_files(diff: str) -> tuple[str, ...]:
    """The repository paths a unified diff touches (from its ---/+++ lines; /dev/null left out), in order."""
    names: list[str] = []
    for line in diff.splitlines():
        if line.startswith(("--- ", "+++ ")):
            name = line[4:].split("\t")[0].strip()
            if name == "/dev/null":
                continue
            name = name[2:] if name[:2] in ("a/", "b/") else name
            if name not in names:
                names.append(name)
    return tuple(names)


def swe_task_spec(instance: SweInstance, agent_argv: tuple[str, ...] | None,
                  env: dict[str, str] | None = None) -> TaskSpec:
    """The TaskSpec that runs `agent_argv` (the problem statement appended) on the instance at /testbed and scores
    it (module docstring); `agent_argv` None is the oracle, which applies the gold patch."""
    if agent_argv is None:
        if not instance.patch:
            raise SweInstanceError(f"{Path(instance.directory) / 'instance.json'}: no patch (the oracle needs it)")
        agent_argv = (sys.executable, "-c", APPLY_SCRIPT, instance.patch)
    originals: dict[str, str | None] = {}
    for name in patched_files(instance.test_patch):
        relative = PurePosixPath(name)
        if relative.is_absolute() or ".." in relative.parts:
            raise SweInstanceError(f"{Path(instance.directory) / 'instance.json'}: test_patch touches {name!r}, "
                                   "outside the repository")
        originals[name] = instance.repo_files.get(name)
    payload = json.dumps({"test_patch": instance.test_patch, "originals": originals,
                          "fail_to_pass": list(instance.fail_to_pass), "pass_to_pass": list(instance.pass_to_pass)})
    if len(payload.encode()) > 2 * MAX_PATCH_BYTES:
        raise SweInstanceError(f"{Path(instance.directory) / 'instance.json'}: the test patch and the files it "
                               f"touches exceed {2 * MAX_PATCH_BYTES} bytes (one argument of the scorer)")
    return TaskSpec(
        task_id=instance.instance_id,
        prompt=instance.problem_statement,
        workspace_files=dict(instance.repo_files),
        agent_argv=tuple(agent_argv),
        scorer_argv=(sys.executable, "-c", SCORE_SCRIPT, payload),
        timeout_s=instance.agent_timeout_s,
        scorer_timeout_s=instance.verifier_timeout_s,
        workdir=WORKDIR,
        env=dict(env or {}),
    )


# ---- the files ----------------------------------------------------------------------------------------------------
def _text(data: dict[str, Any], key: str, where: Path) -> str:
    value = data.get(key)
    if not isinstance(value, str) or not value.strip():
        raise SweInstanceError(f"{where}: {key} must be a non-empty string")
    return value


def _ids(data: dict[str, Any], key: str, where: Path) -> tuple[str, ...]:
    value = data.get(key)
    if isinstance(value, str):  # SWE-bench's datasets store the lists JSON-encoded
        try:
            value = json.loads(value)
        except ValueError as error:
            raise SweInstanceError(f"{where}: {key} is a string but not a JSON list") from error
    if not isinstance(value, list) or not all(isinstance(i, str) and i and not i.startswith("-") for i in value):
        raise SweInstanceError(f"{where}: {key} must be a list of test ids (pytest node ids)")
    return tuple(value)


def _snapshot(repo: Path) -> dict[str, str]:
    if not repo.is_dir():
        raise SweInstanceError(f"{repo}: missing (the repository snapshot)")
    files: dict[str, str] = {}
    total = 0
    stack = [repo]
    while stack:
        folder = stack.pop()
        for entry in sorted(folder.iterdir()):
            if entry.is_symlink():
                raise SweInstanceError(f"{entry}: a symlink; the workspace takes text files only")
            if entry.is_dir():
                if entry.name not in _SKIPPED_DIRS:
                    stack.append(entry)
                continue
            if entry.suffix in (".pyc", ".pyo"):
                continue
            try:
                text = entry.read_text(encoding="utf-8")
            except UnicodeDecodeError as error:
                raise SweInstanceError(f"{entry}: not UTF-8 text; the workspace takes text files only") from error
            files[entry.relative_to(repo).as_posix()] = text
            total += len(text.encode())
            if len(files) > MAX_REPO_FILES or total > MAX_REPO_BYTES:
                raise SweInstanceError(f"{repo}: more than {MAX_REPO_FILES} files or {MAX_REPO_BYTES} bytes")
    if not files:
        raise SweInstanceError(f"{repo}: empty")
    return files
