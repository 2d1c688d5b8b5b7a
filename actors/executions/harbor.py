"""Harbor task directories (Terminal-Bench 2's format, read from Harbor's documentation and task layout; no Harbor
code is used): load one, refuse a broken one with the file and the reason, and turn it into a TaskSpec.

    task/
      instruction.md      the instruction, given to the agent verbatim
      task.toml           [agent] timeout_sec; [verifier] timeout_sec, env; [environment] cpus, memory_mb (or
                          memory = "2G")
      environment/        Dockerfile: the agent's container
      tests/test.sh       the verifier; writes /logs/verifier/reward.txt (a number) or reward.json ({"reward": x})
      solution/solve.sh   optional reference solution (the "oracle" agent runs it)

The bubblewrap sandbox has no image builder: its "image" is the host's root, read-only. So a Dockerfile is accepted
only when that root can stand in for it: `FROM` one of `HOST_COMPATIBLE_IMAGES` (the host is Debian 12 with Python
3.11), a `WORKDIR` (where the workspace is mounted), `COPY` of text files from environment/ into the WORKDIR (they
become the workspace files; modes are not kept, so scripts are run as `bash script.sh`), `ENV`, and the
instructions that change nothing a task sees here (CMD, ENTRYPOINT, LABEL, EXPOSE, HEALTHCHECK). Anything else
(`RUN`, another base image, a docker-compose.yaml, COPY outside the WORKDIR or from another stage) is refused with
the line and the reason: such a task would need a real image, and running it on the host root would score it
wrongly. A docker backend will lift this.

The verifier runs after the agent, in a sandbox of its own, on the preserved workspace (at the same WORKDIR), with
tests/ at /tests and a fresh writable /logs/verifier; `VERIFY_SCRIPT` runs tests/test.sh and turns the reward file
into the evaluator's JSON line. No reward file (the verifier crashed), a reward that is not a number, or a verifier
that overruns its timeout drops the execution, as the evaluator does for any scorer.
"""

from __future__ import annotations

import json
import re
import shlex
import tomllib
from pathlib import Path, PurePosixPath
from typing import Any

import attrs

from gyre.actors.errors import ActorError
from gyre.messages.executions import TaskSpec

__all__ = [
    "HOST_COMPATIBLE_IMAGES",
    "HarborTask",
    "HarborTaskError",
    "VERIFY_SCRIPT",
    "harbor_task_spec",
    "is_harbor_task",
    "load_harbor_task",
    "load_harbor_tasks",
]

HOST_COMPATIBLE_IMAGES = (
    "python:3.11", "python:3.11-slim", "python:3.11-bookworm", "python:3.11-slim-bookworm",
    "debian:bookworm", "debian:bookworm-slim", "debian:12", "debian:12-slim",
)
"""Base images whose role the host root (Debian 12, Python 3.11) can play for a task that adds no RUN steps."""
MAX_WORKSPACE_BYTES = 16 * 1024 * 1024
"""The workspace files of one task, in all: they travel in every StartGroup message."""
MAX_TASKS = 10_000
"""Tasks in one task set; a directory tree larger than this is refused rather than walked without end."""
DEFAULT_AGENT_TIMEOUT_S = 600.0
"""Harbor's default agent timeout, for a task.toml that names none."""
DEFAULT_VERIFIER_TIMEOUT_S = 600.0
"""Harbor's default verifier timeout."""
_IGNORED_INSTRUCTIONS = frozenset({"CMD", "ENTRYPOINT", "LABEL", "EXPOSE", "HEALTHCHECK", "MAINTAINER", "STOPSIGNAL"})

VERIFY_SCRIPT = r"""
env "$@" bash /tests/test.sh >/logs/verifier/test-output.txt 2>&1 </dev/null
status=$?
if [ -s /logs/verifier/reward.json ]; then
  cat /logs/verifier/reward.json
  exit 0
fi
if [ -s /logs/verifier/reward.txt ]; then
  printf '{"reward": %s, "test_exit_code": %d}\n' "$(tr -d ' \t\r\n' < /logs/verifier/reward.txt)" "$status"
  exit 0
fi
echo "the verifier wrote neither /logs/verifier/reward.txt nor reward.json (tests/test.sh exited $status):" >&2
tail -c 300 /logs/verifier/test-output.txt >&2
exit 1
"""
"""The scorer of a Harbor task: its arguments are the verifier's env as NAME=VALUE; stdout the evaluator's JSON."""


class HarborTaskError(ActorError, ValueError):
    """A task directory that cannot be loaded or cannot run here; the message names the file and the reason."""


@attrs.frozen
class HarborTask:
    """One loaded Harbor task."""

    task_id: str
    """The directory's name."""
    directory: str
    """The task directory (absolute)."""
    instruction: str
    """instruction.md, verbatim."""
    workdir: str
    """The Dockerfile's WORKDIR: where the workspace is mounted."""
    workspace_files: dict[str, str]
    """Relative path (under WORKDIR) -> text, from the Dockerfile's COPY lines."""
    env: dict[str, str]
    """The Dockerfile's ENV (agent and verifier)."""
    verifier_env: dict[str, str]
    """task.toml's [verifier] env (verifier only)."""
    agent_timeout_s: float
    """[agent] timeout_sec."""
    verifier_timeout_s: float
    """[verifier] timeout_sec."""
    cpus: float
    """[environment] cpus (0: the sandbox's default)."""
    memory_mb: int
    """[environment] memory_mb (0: the sandbox's default)."""
    has_solution: bool
    """Whether solution/solve.sh exists."""


def is_harbor_task(path: str | Path) -> bool:
    """Whether `path` is a task directory (it holds a task.toml)."""
    return (Path(path) / "task.toml").is_file()


def load_harbor_tasks(path: str | Path) -> tuple[HarborTask, ...]:
    """The task at `path`, or every task directory directly below it (sorted by name). Raises HarborTaskError for
    the first broken one, or when there is none."""
    root = Path(path)
    if not root.is_dir():
        raise HarborTaskError(f"{root}: not a directory")
    if is_harbor_task(root):
        return (load_harbor_task(root),)
    children = sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    if len(children) > MAX_TASKS:
        raise HarborTaskError(f"{root}: more than {MAX_TASKS} directories")
    tasks = []
    for child in children:
        if not is_harbor_task(child):
            raise HarborTaskError(f"{child / 'task.toml'}: missing (every directory of a task set is a task)")
        tasks.append(load_harbor_task(child))
    if not tasks:
        raise HarborTaskError(f"{root}: no task directories (a directory with task.toml, or directories of them)")
    return tuple(tasks)


def load_harbor_task(path: str | Path) -> HarborTask:
    """Load and check one task directory (module docstring); raises HarborTaskError naming the file and the reason."""
    directory = Path(path).resolve()
    if not directory.is_dir():
        raise HarborTaskError(f"{directory}: not a directory")
    instruction = _read_text(directory / "instruction.md")
    if not instruction.strip():
        raise HarborTaskError(f"{directory / 'instruction.md'}: empty")
    config = _read_toml(directory / "task.toml")
    agent = _table(config, "agent", directory)
    verifier = _table(config, "verifier", directory)
    environment = _table(config, "environment", directory)
    agent_timeout_s = _number(agent, "timeout_sec", DEFAULT_AGENT_TIMEOUT_S, directory, "agent")
    verifier_timeout_s = _number(verifier, "timeout_sec", DEFAULT_VERIFIER_TIMEOUT_S, directory, "verifier")
    cpus = _number(environment, "cpus", 0.0, directory, "environment") if "cpus" in environment else 0.0
    memory_mb = _memory_mb(environment, directory)
    verifier_env = verifier.get("env", {})
    if not isinstance(verifier_env, dict) or not all(
        isinstance(k, str) and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k) and isinstance(v, str)
        for k, v in verifier_env.items()
    ):
        raise HarborTaskError(f"{directory / 'task.toml'}: [verifier] env must map variable names to strings")
    test_sh = directory / "tests" / "test.sh"
    if not test_sh.is_file():
        raise HarborTaskError(f"{test_sh}: missing (the verifier)")
    environment_dir = directory / "environment"
    if (environment_dir / "docker-compose.yaml").exists() or (environment_dir / "docker-compose.yml").exists():
        raise HarborTaskError(f"{environment_dir / 'docker-compose.yaml'}: a multi-container environment needs a "
                              "docker backend; the bubblewrap sandbox cannot provide it")
    workdir, files, env = _dockerfile(environment_dir / "Dockerfile")
    return HarborTask(
        task_id=directory.name,
        directory=str(directory),
        instruction=instruction,
        workdir=workdir,
        workspace_files=files,
        env=env,
        verifier_env=dict(verifier_env),
        agent_timeout_s=agent_timeout_s,
        verifier_timeout_s=verifier_timeout_s,
        cpus=cpus,
        memory_mb=memory_mb,
        has_solution=(directory / "solution" / "solve.sh").is_file(),
    )


def harbor_task_spec(task: HarborTask, agent_argv: tuple[str, ...], *, with_solution: bool = False) -> TaskSpec:
    """The TaskSpec that runs `agent_argv` (the instruction appended) on `task` and scores it with its verifier;
    `with_solution` mounts solution/ read-only at /solution (for the oracle agent, `bash /solution/solve.sh`)."""
    if with_solution and not task.has_solution:
        raise HarborTaskError(f"{Path(task.directory) / 'solution' / 'solve.sh'}: missing (the oracle needs it)")
    directory = Path(task.directory)
    return TaskSpec(
        task_id=task.task_id,
        prompt=task.instruction,
        workspace_files=dict(task.workspace_files),
        agent_argv=tuple(agent_argv),
        scorer_argv=("/bin/sh", "-c", VERIFY_SCRIPT, "verify",
                     *(f"{k}={v}" for k, v in sorted(task.verifier_env.items()))),
        timeout_s=task.agent_timeout_s,
        scorer_timeout_s=task.verifier_timeout_s,
        workdir=task.workdir,
        env=dict(task.env),
        cpus=task.cpus,
        memory_mb=task.memory_mb,
        agent_mounts=((str(directory / "solution"), "/solution"),) if with_solution else (),
        scorer_mounts=((str(directory / "tests"), "/tests"),),
        scorer_output_dir="/logs/verifier",
    )


# ---- the files ----------------------------------------------------------------------------------------------------
def _read_text(path: Path) -> str:
    if not path.is_file():
        raise HarborTaskError(f"{path}: missing")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise HarborTaskError(f"{path}: not UTF-8 text ({error.reason})") from error


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        return tomllib.loads(_read_text(path))
    except tomllib.TOMLDecodeError as error:
        raise HarborTaskError(f"{path}: malformed TOML: {error}") from error


def _table(config: dict[str, Any], name: str, directory: Path) -> dict[str, Any]:
    table = config.get(name, {})
    if not isinstance(table, dict):
        raise HarborTaskError(f"{directory / 'task.toml'}: [{name}] must be a table")
    return table


def _number(table: dict[str, Any], key: str, default: float, directory: Path, section: str) -> float:
    value = table.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise HarborTaskError(f"{directory / 'task.toml'}: [{section}] {key} must be a number > 0, got {value!r}")
    return float(value)


def _memory_mb(environment: dict[str, Any], directory: Path) -> int:
    if "memory_mb" in environment:
        return int(_number(environment, "memory_mb", 0, directory, "environment"))
    if "memory" in environment:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([MmGg])[Bb]?\s*", str(environment["memory"]))
        if match is None:
            raise HarborTaskError(f"{directory / 'task.toml'}: [environment] memory must look like \"2G\" or "
                                  f"\"512M\", got {environment['memory']!r}")
        return int(float(match[1]) * (1024 if match[2] in "Gg" else 1))
    return 0


def _dockerfile_lines(path: Path) -> list[tuple[int, str]]:
    """(line number, logical line) with continuations joined and comments dropped."""
    lines: list[tuple[int, str]] = []
    pending, start = "", 0
    for number, raw in enumerate(_read_text(path).splitlines(), start=1):
        stripped = raw.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if not pending:
            start = number
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        lines.append((start, pending + stripped))
        pending = ""
    if pending:
        lines.append((start, pending))
    return lines


def _dockerfile(path: Path) -> tuple[str, dict[str, str], dict[str, str]]:
    """(WORKDIR, workspace files, ENV) of a Dockerfile the host root can stand in for; else HarborTaskError."""
    context = path.parent
    workdir = ""
    files: dict[str, str] = {}
    env: dict[str, str] = {}
    seen_from = False
    total_bytes = 0
    for number, line in _dockerfile_lines(path):
        where = f"{path}:{number}"
        instruction, _, rest = line.partition(" ")
        instruction, rest = instruction.upper(), rest.strip()
        if instruction == "FROM":
            image = rest.split()[0] if rest else ""
            if seen_from:
                raise HarborTaskError(f"{where}: a multi-stage build needs a docker backend")
            if image not in HOST_COMPATIBLE_IMAGES:
                raise HarborTaskError(f"{where}: image {image!r} cannot be provided by the bubblewrap sandbox, which "
                                      f"runs on the host root (one of {', '.join(HOST_COMPATIBLE_IMAGES)})")
            seen_from = True
        elif not seen_from:
            raise HarborTaskError(f"{where}: {instruction} before FROM")
        elif instruction == "WORKDIR":
            target = PurePosixPath(rest if rest.startswith("/") else f"{workdir or '/'}/{rest}")
            if not target.is_absolute() or ".." in target.parts or str(target) == "/":
                raise HarborTaskError(f"{where}: WORKDIR must be an absolute directory other than /, got {rest!r}")
            if files and workdir and str(target) != workdir:
                raise HarborTaskError(f"{where}: a second WORKDIR after COPY is not supported")
            workdir = str(target)
        elif instruction == "ENV":
            env.update(_env_pairs(rest, where))
        elif instruction in ("COPY", "ADD"):
            if not workdir:
                raise HarborTaskError(f"{where}: COPY before WORKDIR (the workspace is the WORKDIR)")
            total_bytes += _copy(rest, context, workdir, files, where)
            if total_bytes > MAX_WORKSPACE_BYTES:
                raise HarborTaskError(f"{where}: the workspace files exceed {MAX_WORKSPACE_BYTES} bytes")
        elif instruction in _IGNORED_INSTRUCTIONS:
            continue
        else:
            raise HarborTaskError(f"{where}: {instruction} needs an image build, which the bubblewrap sandbox "
                                  "cannot do (it runs on the host root, read-only)")
    if not seen_from:
        raise HarborTaskError(f"{path}: no FROM line")
    if not workdir:
        raise HarborTaskError(f"{path}: no WORKDIR (the sandbox mounts the workspace there)")
    return workdir, files, env


def _env_pairs(rest: str, where: str) -> dict[str, str]:
    try:
        words = shlex.split(rest)
    except ValueError as error:
        raise HarborTaskError(f"{where}: ENV: {error}") from error
    if words and "=" not in words[0]:
        return {words[0]: " ".join(words[1:])}
    pairs = {}
    for word in words:
        name, equals, value = word.partition("=")
        if not equals or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name) or "$" in value:
            raise HarborTaskError(f"{where}: ENV {word!r} is not NAME=VALUE (no substitutions)")
        pairs[name] = value
    return pairs


def _copy(rest: str, context: Path, workdir: str, files: dict[str, str], where: str) -> int:
    if rest.startswith("["):
        try:
            words = json.loads(rest)
        except ValueError as error:
            raise HarborTaskError(f"{where}: COPY's JSON form is malformed") from error
    else:
        words = rest.split()
    if any(w.startswith("--") for w in words):
        raise HarborTaskError(f"{where}: COPY options ({' '.join(w for w in words if w.startswith('--'))}) are not "
                              "supported")
    if len(words) < 2:
        raise HarborTaskError(f"{where}: COPY needs a source and a destination")
    *sources, destination = words
    target = PurePosixPath(destination if destination.startswith("/") else f"{workdir}/{destination}")
    inside = PurePosixPath(workdir)
    if ".." in target.parts or not (target == inside or inside in target.parents):
        raise HarborTaskError(f"{where}: COPY to {destination!r} is outside WORKDIR {workdir}, which the sandbox "
                              "cannot provide (only the workspace is writable)")
    relative_target = target.relative_to(inside)
    added = 0
    for source in sources:
        source_path = (context / source).resolve()
        if source_path != context.resolve() and context.resolve() not in source_path.parents:
            raise HarborTaskError(f"{where}: COPY source {source!r} is outside environment/")
        if not source_path.exists():
            raise HarborTaskError(f"{where}: COPY source {source!r} does not exist in environment/")
        if source_path.is_dir():
            entries = [(p, p.relative_to(source_path)) for p in sorted(source_path.rglob("*")) if p.is_file()]
            into_dir = True
        else:
            entries = [(source_path, PurePosixPath(source_path.name))]
            into_dir = destination.endswith("/") or len(sources) > 1 or target == inside
        for file_path, below in entries:
            relative = relative_target / below if into_dir else relative_target
            try:
                text = file_path.read_text(encoding="utf-8")
            except UnicodeDecodeError as error:
                raise HarborTaskError(f"{file_path}: not UTF-8 text; the sandbox's workspace takes text files "
                                      "only") from error
            if str(relative) in ("", "."):
                raise HarborTaskError(f"{where}: COPY of a file onto WORKDIR itself")
            files[str(relative)] = text
            added += len(text.encode())
    return added
