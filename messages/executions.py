"""Executor, evaluator and the task source: groups of agent executions and their outcomes."""

from __future__ import annotations

import attrs

from gyre.messages._define import message


@message("gyre.executions.TaskSpec", version=2)
class TaskSpec:
    """Everything the executor and evaluator need to run and score one task; plain data, no code."""

    task_id: str
    """Stable id of the task."""
    prompt: str
    """The instruction handed to the agent (as the last argv item of the agent command)."""
    workspace_files: dict[str, str]
    """Relative path -> text content, written into each execution's fresh workspace."""
    agent_argv: tuple[str, ...]
    """Command that runs the agent; the prompt is appended as its last argument."""
    scorer_argv: tuple[str, ...]
    """Command run inside the finished workspace; it prints JSON {"reward": float, ...} and exits 0."""
    timeout_s: float
    """Wall-time limit of one execution; on expiry its process group is killed and the workspace still scored."""
    scorer_timeout_s: float
    """Wall-time limit of the scorer; a scorer that overruns drops the execution."""
    workdir: str = ""
    """Where a sandbox mounts the workspace and starts agent and scorer (Harbor's WORKDIR, e.g. /app); "" = the
    workspace's host path (the only choice of the `none` sandbox)."""
    env: dict[str, str] = attrs.field(factory=dict)
    """Environment variables the task declares for its agent and scorer (a sandbox sets only declared ones)."""
    cpus: float = 0.0
    """CPU quota of each sandbox in cores (Harbor's [environment] cpus); 0 = the sandbox's default."""
    memory_mb: int = 0
    """Memory limit of each sandbox (Harbor's [environment] memory_mb); 0 = the sandbox's default."""
    max_processes: int = 0
    """Process limit of each sandbox; 0 = the sandbox's default."""
    agent_mounts: tuple[tuple[str, str], ...] = ()
    """(host path, path inside) mounted read-only for the agent (an oracle's solution/ at /solution)."""
    scorer_mounts: tuple[tuple[str, str], ...] = ()
    """(host path, path inside) mounted read-only for the scorer (a Harbor verifier's tests/ at /tests)."""
    scorer_output_dir: str = ""
    """Path inside the scorer's sandbox where a fresh writable directory is mounted (Harbor's /logs/verifier); ""
    = none."""


@message("gyre.executions.GroupOverdue")
class GroupOverdue:
    """Task source -> itself: a group's deadline (TaskSourceConfig.group_deadline_s) has come."""

    group_id: str
    """The group."""


@message("gyre.executions.StartGroup")
class StartGroup:
    """Task source -> executor: run `group_size` executions of one task (a GSPO group)."""

    group_id: str
    """Unique id of the group."""
    task: TaskSpec
    """The task to run."""
    group_size: int
    """Executions in the group (G, 16 by default)."""
    weight_version: int
    """Newest weight version when the group started (for staleness accounting)."""


@message("gyre.executions.ExecutionStarted")
class ExecutionStarted:
    """Executor -> everyone interested: an execution has a key and a process."""

    execution_id: str
    """Unique id of the execution."""
    group_id: str
    """Its group."""
    workspace: str
    """Path of its workspace directory."""


@message("gyre.executions.ExecutionFinished")
class ExecutionFinished:
    """Executor -> evaluator: the agent process ended (by itself or killed at its time limit)."""

    execution_id: str
    """Which execution."""
    group_id: str
    """Its group."""
    task: TaskSpec
    """The task, for its scorer."""
    workspace: str
    """Workspace directory to score (preserved after a timeout)."""
    exit_code: int
    """Agent's exit status (negative: killed by that signal)."""
    timed_out: bool
    """True when the executor killed the agent at its time limit."""
    wall_s: float
    """How long the agent ran."""


@message("gyre.executions.ExecutionEnded")
class ExecutionEnded:
    """Executor -> everyone interested: an execution's agent is gone (exited, killed, or never started after its key
    was issued), so its sessions will make no more model calls. Rollout cells stop counting them as live: their
    LoadReport.live_sessions is what the scheduling policy weighs against capacity."""

    execution_id: str
    """Which execution (the session key prefix the proxy puts on every call: "<execution_id>/...")."""
    group_id: str
    """Its group."""


@message("gyre.executions.GroupDone", version=2)
class GroupDone:
    """Trajectory builder -> task source: a group was turned into samples or dropped."""

    group_id: str
    """Which group."""
    landed: bool
    """True when its samples landed; False when the group was dropped."""
    mean_reward: float
    """Mean reward over the scored executions (0 when none)."""
    success_rate: float
    """Fraction of scored executions judged successful."""
    num_scored: int
    """Executions scored."""
    num_dropped: int
    """Executions dropped (scorer crash or hang)."""
    work_tokens: int
    """What the group's rollouts cost the engines: over every model call of its executions that the builder heard,
    the prompt tokens not served from the prefix cache plus the output tokens (the task sampler weighs a family's
    landed groups against this: policies/task_sampling.py)."""


@message("gyre.executions.IssueKey")
class IssueKey:
    """Executor -> proxy (ask): an API key for one execution."""

    execution_id: str
    """Which execution."""
    group_id: str
    """Its group."""


@message("gyre.executions.KeyIssued")
class KeyIssued:
    """Proxy's reply to IssueKey."""

    api_key: str
    """Secret the agent presents; only this execution's data is reachable with it."""
    openai_base_url: str
    """Base URL for the OpenAI SDK (ends in /v1)."""
    anthropic_base_url: str
    """Base URL for the Anthropic SDK."""


@message("gyre.executions.RevokeKey")
class RevokeKey:
    """Executor -> proxy: the execution ended; refuse its key from now on."""

    execution_id: str
    """Which execution."""
