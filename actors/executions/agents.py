"""Agents for task sets: the built-in ones and any command-line agent described by a small spec; and a task set
(Harbor task directories or SWE-bench-style instances) turned into the TaskSpecs that run one of them.

Every agent gets the proxy through the variables the executor sets (OPENAI_BASE_URL ending in /v1,
ANTHROPIC_BASE_URL without it, OPENAI_API_KEY and ANTHROPIC_API_KEY, the execution's own key). An agent that reads
other names declares them in its spec and a two-line shell wrapper copies the values over before it execs the
agent, unchanged; nothing else of the agent is touched. Its model calls reach the proxy like any other: captured
token-in/token-out as ModelCallCompleted, and without X-Gyre-* labels they are grouped into trajectories by the
inferred chains of policies/trajectory_tree.py.

Built-in agents (`--agent NAME`):
- `oracle`: the task's reference solution (a Harbor task's solution/solve.sh, mounted read-only at /solution; an
  SWE instance's gold patch);
- `noop`: does nothing (a task set's verifiers must give it 0);
- `mini-swe-agent`: the PyPI package's `mini` command unchanged (yolo mode, exit when done) with its litellm model
  `openai/<model name>`, which reads OPENAI_BASE_URL / OPENAI_API_KEY; `mini_options` are its own `-c KEY=VALUE`
  configuration (step limit, max tokens, temperature).
Anything else is a spec file (`*.toml`, see `load_agent_spec`) or a command line, split like a shell would.

An agent spec file:

    command = ["my-agent", "--yolo"]        # or a string, split like a shell would; the instruction is appended
    [base_url_env]                          # variables that must carry the proxy's URL, and which API's form
    MY_AGENT_BASE_URL = "openai"            #   "openai": http://127.0.0.1:PORT/v1; "anthropic": without /v1
    [api_key_env]
    names = ["MY_AGENT_KEY"]                # variables that must carry the execution's key
    [env]                                   # constant variables the agent needs (no secrets: they travel in
    MY_AGENT_TELEMETRY = "off"              #   every StartGroup and the event log)
"""

from __future__ import annotations

import re
import shlex
import shutil
import sys
import tomllib
from pathlib import Path
from typing import Any

import attrs

from gyre.actors.errors import ActorError
from gyre.messages.executions import TaskSpec

__all__ = [
    "AgentSpec",
    "AgentSpecError",
    "BUILTIN_AGENTS",
    "MINI_SWE_AGENT_ENV",
    "agent_spec",
    "load_agent_spec",
    "mini_swe_agent_argv",
    "spec_argv",
    "task_set_specs",
]

BUILTIN_AGENTS = ("oracle", "noop", "mini-swe-agent")
MINI_SWE_AGENT_ENV = {
    "MSWEA_CONFIGURED": "true",  # skip its first-run set-up dialogue
    "MSWEA_COST_TRACKING": "ignore_errors",  # a local model has no price in litellm's table
    "LITELLM_LOCAL_MODEL_COST_MAP": "True",  # litellm would fetch its price table from the internet at import
}
"""What mini-swe-agent (and the litellm inside it) needs to run offline, unattended."""
PROXY_URL_FORMS = {"openai": "OPENAI_BASE_URL", "anthropic": "ANTHROPIC_BASE_URL"}
"""A spec's URL form -> the executor's variable that holds the proxy's URL in that form."""
MAX_SPEC_BYTES = 64 * 1024
"""An agent spec file is a few lines; a larger one is refused rather than parsed."""
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_RESERVED = frozenset({*PROXY_URL_FORMS.values(), "OPENAI_API_KEY", "ANTHROPIC_API_KEY", "GYRE_EXECUTION_ID",
                       "GYRE_GROUP_ID"})


class AgentSpecError(ActorError, ValueError):
    """An agent that cannot be built: a bad spec file (named, with the reason) or a missing program."""


@attrs.frozen
class AgentSpec:
    """A command-line agent: what to run and which variables carry the proxy's URL and the execution's key."""

    command: tuple[str, ...]
    """The agent's command; the executor appends the instruction as its last argument."""
    base_url_env: tuple[tuple[str, str], ...] = ()
    """(variable, "openai" | "anthropic"): variables set to the proxy's URL in that API's form, besides the
    executor's own OPENAI_BASE_URL / ANTHROPIC_BASE_URL."""
    api_key_env: tuple[str, ...] = ()
    """Variables set to the execution's key, besides OPENAI_API_KEY / ANTHROPIC_API_KEY."""
    env: dict[str, str] = attrs.field(factory=dict)
    """Constant variables."""


def spec_argv(spec: AgentSpec) -> tuple[str, ...]:
    """The argv that runs `spec.command` with its URL and key variables copied from the executor's: the command
    itself when it needs none, else `/bin/sh -c 'export ...; exec "$@"' agent COMMAND...` (the instruction the
    executor appends arrives as the command's last argument, unquoted by no shell)."""
    if not spec.base_url_env and not spec.api_key_env:
        return spec.command
    exports = [f'{name}="${PROXY_URL_FORMS[form]}"' for name, form in spec.base_url_env]
    exports += [f'{name}="$OPENAI_API_KEY"' for name in spec.api_key_env]
    return ("/bin/sh", "-c", f'export {" ".join(exports)}; exec "$@"', "agent", *spec.command)


def load_agent_spec(path: str | Path) -> AgentSpec:
    """Read an agent spec file (module docstring); AgentSpecError names the file and the reason."""
    path = Path(path)
    try:
        if path.stat().st_size > MAX_SPEC_BYTES:
            raise AgentSpecError(f"{path}: larger than {MAX_SPEC_BYTES} bytes; an agent spec is a few lines")
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as error:
        raise AgentSpecError(f"{path}: cannot be read ({error})") from error
    except tomllib.TOMLDecodeError as error:
        raise AgentSpecError(f"{path}: malformed TOML: {error}") from error
    return _spec_from(data, str(path))


def _spec_from(data: dict[str, Any], where: str) -> AgentSpec:
    unknown = set(data) - {"command", "base_url_env", "api_key_env", "env"}
    if unknown:
        raise AgentSpecError(f"{where}: unknown keys {sorted(unknown)} (command, base_url_env, api_key_env, env)")
    command = data.get("command")
    if isinstance(command, str):
        command = shlex.split(command)
    if not isinstance(command, list) or not command or not all(isinstance(w, str) and w for w in command):
        raise AgentSpecError(f"{where}: command must be a non-empty string or list of strings")
    urls = data.get("base_url_env", {})
    if not isinstance(urls, dict) or not all(isinstance(v, str) for v in urls.values()):
        raise AgentSpecError(f"{where}: [base_url_env] must map variable names to \"openai\" or \"anthropic\"")
    for name, form in urls.items():
        if form not in PROXY_URL_FORMS:
            raise AgentSpecError(f"{where}: [base_url_env] {name} = {form!r}: the form is \"openai\" or \"anthropic\"")
    keys = data.get("api_key_env", {})
    names = keys.get("names", []) if isinstance(keys, dict) else None
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names) or set(keys) - {"names"}:
        raise AgentSpecError(f"{where}: [api_key_env] must be names = [\"VAR\", ...]")
    env = data.get("env", {})
    if not isinstance(env, dict) or not all(isinstance(v, str) for v in env.values()):
        raise AgentSpecError(f"{where}: [env] must map variable names to strings")
    for name in (*urls, *names, *env):
        if not _NAME.fullmatch(name):
            raise AgentSpecError(f"{where}: {name!r} is not a variable name")
        if name in _RESERVED:
            raise AgentSpecError(f"{where}: {name} is set by the executor itself")
    clash = (set(urls) & set(names)) | ((set(urls) | set(names)) & set(env))
    if clash:
        raise AgentSpecError(f"{where}: {sorted(clash)} named twice")
    return AgentSpec(tuple(command), tuple(sorted(urls.items())), tuple(names), dict(env))


def mini_swe_agent_argv(model_name: str, mini_options: tuple[str, ...] = ()) -> tuple[str, ...]:
    """mini-swe-agent's own command line, unattended; the executor appends the instruction after `--task`.
    `mini_options` are KEY=VALUE settings of its configuration (each passed as `-c KEY=VALUE` over mini.yaml)."""
    mini = shutil.which("mini")
    if mini is None:
        raise AgentSpecError("the mini-swe-agent agent needs the PyPI package mini-swe-agent (its `mini` command)")
    config: tuple[str, ...] = ()
    for option in mini_options:
        if "=" not in option or not option.split("=", 1)[0]:
            raise AgentSpecError(f"a mini-swe-agent option is KEY=VALUE (e.g. agent.step_limit=4), got {option!r}")
        config += ("-c", option)
    if config:
        config = ("-c", "mini.yaml", *config)  # its default configuration, then the overrides
    return (sys.executable, mini, "--yolo", "--exit-immediately", "--model", f"openai/{model_name}", *config,
            "--output", "/tmp/mini-swe-agent.traj.json", "--task")


def agent_spec(agent: str, model_name: str = "gyre", mini_options: tuple[str, ...] = ()) -> AgentSpec:
    """The spec of a named agent other than the oracle: noop, mini-swe-agent, a spec file (*.toml) or a command."""
    if agent == "oracle":
        raise AgentSpecError("the oracle runs each task's own solution; it has no single command")
    if agent == "noop":
        return AgentSpec(("true",))
    if agent == "mini-swe-agent":
        return AgentSpec(mini_swe_agent_argv(model_name, mini_options), env=dict(MINI_SWE_AGENT_ENV))
    if agent.endswith(".toml"):
        return load_agent_spec(agent)
    command = tuple(shlex.split(agent))
    if not command:
        raise AgentSpecError("the agent is empty")
    return AgentSpec(command)


def task_set_specs(path: str | Path, agent: str, model_name: str = "gyre",
                   mini_options: tuple[str, ...] = ()) -> tuple[TaskSpec, ...]:
    """The task set at `path` (Harbor task directories or SWE-bench-style instances, one or a directory of them)
    as TaskSpecs that run `agent`. Raises HarborTaskError / SweInstanceError for a broken task, AgentSpecError for
    a broken agent."""
    from gyre.actors.executions.harbor import harbor_task_spec, load_harbor_tasks
    from gyre.actors.executions.swe import is_swe_task_set, load_swe_instances, swe_task_spec

    if is_swe_task_set(path):
        instances = load_swe_instances(path)
        if agent == "oracle":
            return tuple(swe_task_spec(i, None) for i in instances)
        spec = agent_spec(agent, model_name, mini_options)
        return tuple(swe_task_spec(i, spec_argv(spec), spec.env) for i in instances)
    tasks = load_harbor_tasks(path)
    if agent == "oracle":
        return tuple(harbor_task_spec(t, ("bash", "/solution/solve.sh"), with_solution=True) for t in tasks)
    spec = agent_spec(agent, model_name, mini_options)
    argv = spec_argv(spec)
    return tuple(attrs.evolve(harbor_task_spec(t, argv), env={**t.env, **spec.env}) for t in tasks)
