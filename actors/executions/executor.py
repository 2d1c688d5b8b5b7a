"""The executor: runs the G agent executions of each group, each in a fresh workspace, under a time limit.

One execution, start to end:
1. ask the proxy for an API key (`IssueKey` -> `KeyIssued`);
2. make `<root>/<group>/<index>/workspace` (the task's files written into it) and `.../logs` beside it, so that
   the agent's stdout and stderr never land in what the scorer judges;
3. spawn `task.agent_argv + (task.prompt,)` in the workspace, in a process group of its own, with
   OPENAI_BASE_URL, OPENAI_API_KEY, ANTHROPIC_BASE_URL, ANTHROPIC_API_KEY (the proxy and the key) and
   GYRE_EXECUTION_ID, GYRE_GROUP_ID set; publish `ExecutionStarted`;
4. wait for it under `task.timeout_s`; at the limit SIGTERM the whole process group, then SIGKILL it after
   `kill_grace_s` (an agent's tool subprocesses die with it); stragglers of an agent that exited are killed too;
5. revoke the key (`RevokeKey`), publish `ExecutionEnded` (rollout cells stop counting its sessions as live), and
   hand the workspace, preserved even after a timeout, to the evaluator (`ExecutionFinished`).
An execution that never gets a process (no key, unwritable workspace, a command that does not exist) is dropped
(`ExecutionDropped` to the trajectory builder): that is the system failing, not the policy, so it is not scored.

Waiting happens in child tasks (`spawn`), never in a handler, so the mailbox stays free; children report back with
messages (`AgentLaunched`, `AgentExited`, `LaunchFailed`) and the handlers make the state changes. At most
`max_concurrent` executions hold a slot (from the key request to the exit); the rest wait in a bounded FIFO queue.

Every group is announced with `GroupStarted` (its execution ids), so the trajectory builder knows when it is
complete. A StartGroup that cannot run (a bad task, a bad size, no room in the queue) is announced as refused and
runs nothing. Execution ids are `<group_id>.<index>`.

Warm launches (`warm_launcher_preload`, off by default): a fresh `python agent.py` that imports `openai` spends ~2
CPU-seconds on imports before its first model call. With the option on, the executor starts a fork server
(gyre.actors.executions.warm_launcher) that imports those modules once, and an agent whose argv is `<this interpreter>
<script> args...` is forked from it (same argv, cwd, environment, log files and own process group, so the time
limit and the group kill work unchanged); any other argv (`-m`, `-c`, another program) is exec'd as before. If
the server dies, its agents are killed (exit -9), a warning is logged once, and the rest of the run execs agents
the plain way. The statistics count warm and cold launches. Warm launches are Linux only.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import math
import os
import re
import shutil
import signal
import tempfile
from pathlib import Path, PurePosixPath

import attrs

from gyre.actors.executions.process_groups import signal_process_group, stop_process_group
from gyre.actors.executions.sandbox import (
    PreparedSandbox,
    SandboxConfig,
    SandboxRequest,
    SandboxUnavailable,
    open_sandbox,
    proxy_url_inside,
    sandbox_problem,
)
from gyre.actors.executions.warm_launcher import LaunchedProcess, LauncherDied, WarmLauncher, preload_problem, watch_launcher
from gyre.messages.execution_reports import AgentExited, AgentLaunched, LaunchFailed
from gyre.messages.execution_stats import ExecutorStatistics
from gyre.messages.executions import (
    ExecutionEnded,
    ExecutionFinished,
    ExecutionStarted,
    IssueKey,
    KeyIssued,
    RevokeKey,
    StartGroup,
    TaskSpec,
)
from gyre.messages.groups import GroupStarted
from gyre.messages.samples import ExecutionDropped
from gyre.runtime import Actor, ActorDead, handler
from gyre.runtime.validators import count, positive

__all__ = [
    "ExecutorConfig",
    "Executor",
    "PROXY_STOPPED",
    "execution_id_for",
    "task_problem",
    "safe_path_component",
    "sandbox_env",
]

PROXY_STOPPED = "no API key: the proxy is stopped"
"""LaunchFailed's reason when the proxy is stopped (ActorDead): the run is ending, or the proxy failed for good."""

AGENT_STDOUT = "agent.stdout.log"
AGENT_STDERR = "agent.stderr.log"


def _module_names(instance: object, attribute: attrs.Attribute, value: object) -> None:
    problem = preload_problem(value)
    if problem is not None:
        raise ValueError(f"{attribute.name}: {problem}")


@attrs.frozen
class ExecutorConfig:
    """Where workspaces go, whom to talk to, and the bounds."""

    workspace_root: str = ""
    """Directory that holds every execution's workspace and logs; "" makes a fresh temporary one at start."""
    proxy: str = "proxy"
    """Actor that issues and revokes API keys."""
    evaluator: str = "evaluator"
    """Actor that scores finished executions."""
    builder: str = "trajectory_builder"
    """Actor told about executions that never got a process."""
    max_concurrent: int = attrs.field(default=16, validator=count)
    """Executions holding a slot (key requested, agent alive) at once."""
    max_queued: int = attrs.field(default=4096, validator=count)
    """Executions waiting for a slot at most; a group that does not fit is refused."""
    max_group_size: int = attrs.field(default=1024, validator=count)
    """Largest group accepted."""
    issue_key_timeout_s: float = attrs.field(default=30.0, validator=positive)
    """How long to wait for the proxy's key."""
    kill_grace_s: float = attrs.field(default=2.0, validator=positive)
    """Time between SIGTERM and SIGKILL of a timed-out agent's process group."""
    inherit_env: bool = True
    """Agents see this process's environment (PATH, PYTHONPATH, ...) under the variables the executor sets; False
    gives them only PATH plus `extra_env`."""
    extra_env: dict[str, str] = attrs.field(factory=dict)
    """More environment variables for every agent (the executor's own variables win on a clash)."""
    sandbox: SandboxConfig = SandboxConfig()
    """Where agents run (gyre.actors.executions.sandbox): "none" runs them on the host as they are (trusted agents);
    "bubblewrap" isolates each (only its workspace writable, no network but the proxy, a non-root uid, cgroup
    limits, an environment of only `extra_env`, the task's `env` and the proxy variables: `inherit_env` does not
    apply). Warm launches happen only without a sandbox."""
    warm_launcher_preload: tuple[str, ...] = attrs.field(default=(), validator=_module_names)
    """Modules a fork server imports once, so that agents run as `<this python> <script> ...` start with them
    already imported; an entry "module:function" also calls that warm-up once (gyre.actors.executions.sdk_warmup has the SDK
    clients'), and an absolute path to a .py file imports that file (e.g. the agent script, whose siblings are on no
    import path); () = off, every agent is a fresh process. Caveat: a preloaded module must not capture the
    environment or the working directory at import time (it would see the executor's, not the agent's)."""


@attrs.define(eq=False)
class _Execution:
    execution_id: str
    group_id: str
    task: TaskSpec
    directory: Path
    workspace: Path
    logs: Path


def execution_id_for(group_id: str, index: int) -> str:
    """The id of execution `index` (0-based) of a group."""
    return f"{group_id}.{index}"


_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


def safe_path_component(text: str, max_chars: int = 80) -> str:
    """A directory name for any id: unsafe characters become "_", and a short hash keeps altered names distinct."""
    cleaned = _UNSAFE.sub("_", text)[:max_chars]
    if cleaned == text and text not in ("", ".", ".."):
        return text
    return f"{cleaned.strip('.') or 'id'}-{hashlib.blake2b(text.encode(), digest_size=4).hexdigest()}"


def _positive_finite(value: object) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and value > 0 and math.isfinite(value)


def task_problem(task: TaskSpec) -> str | None:
    """Why a task cannot run (empty commands, bad time limits, a workspace file outside the workspace), or None."""
    if not task.agent_argv or not all(isinstance(a, str) and a for a in task.agent_argv):
        return "agent_argv must be non-empty strings"
    if not task.scorer_argv or not all(isinstance(a, str) and a for a in task.scorer_argv):
        return "scorer_argv must be non-empty strings"
    if not isinstance(task.prompt, str):
        return "prompt must be a string"
    if not _positive_finite(task.timeout_s):
        return f"timeout_s must be a finite number > 0, got {task.timeout_s!r}"
    if not _positive_finite(task.scorer_timeout_s):
        return f"scorer_timeout_s must be a finite number > 0, got {task.scorer_timeout_s!r}"
    for relative, content in task.workspace_files.items():
        path = PurePosixPath(relative)
        if not relative or path.is_absolute() or any(part in ("", "..") for part in path.parts) or "\\" in relative:
            return f"workspace file {relative!r} is not a relative path inside the workspace"
        if not isinstance(content, str):
            return f"workspace file {relative!r} has no text content"
    return None


def sandbox_env(extra: dict[str, str]) -> dict[str, str]:
    """The base environment inside a bubblewrap sandbox, before the task's, the agent's and the proxy's variables: a
    PATH of the host's system directories and a writable HOME (the private /tmp)."""
    return {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/tmp",
            "LANG": "C.UTF-8", **extra}


def _prepare(execution: _Execution) -> None:
    """Fresh directories and the task's files. Runs in a worker thread (file I/O)."""
    if execution.directory.exists():  # a stale copy from an earlier run with the same ids
        shutil.rmtree(execution.directory)
    execution.workspace.mkdir(parents=True)
    execution.logs.mkdir()
    for relative, content in execution.task.workspace_files.items():
        target = execution.workspace / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(content, encoding="utf-8")


class Executor(Actor):
    """Runs groups of agent executions (module docstring)."""

    config_cls = ExecutorConfig

    async def on_start(self) -> None:
        root = self.config.workspace_root or tempfile.mkdtemp(prefix="gyre-executions-")
        self.root = Path(root).resolve()
        self.root.mkdir(parents=True, exist_ok=True)
        self.queue: collections.deque[_Execution] = collections.deque()
        self.running: dict[str, _Execution] = {}
        self.active_groups: dict[str, int] = {}  # group id -> executions not finished yet
        self.counts: collections.Counter[str] = collections.Counter()
        self.launcher: WarmLauncher | None = None
        self.warned_not_warm = False
        if self.config.warm_launcher_preload:
            launcher = WarmLauncher()
            await launcher.start(self.config.warm_launcher_preload)  # a preload that fails to import fails here
            self.launcher = launcher
            self.spawn(watch_launcher(launcher, self.log), name=f"{self.name}.warm_launcher")
        self.log.info("executor_started", workspace_root=str(self.root), warm=self.launcher is not None)

    async def on_stop(self) -> None:
        if self.launcher is not None:
            await self.launcher.close()

    # ---- groups -------------------------------------------------------------------------------------------------
    @handler(StartGroup)
    def on_start_group(self, msg: StartGroup) -> None:
        if msg.group_id in self.active_groups:
            # Announcing it again would confuse the builder about a group it tracks: ignore it, logged as an error.
            self.counts["groups_refused"] += 1
            self.log.error("duplicate_group_ignored", group_id=msg.group_id)
            return
        problem = self._group_problem(msg)
        if problem is not None:
            self.counts["groups_refused"] += 1
            self.log.warning("group_refused", group_id=msg.group_id, task_id=msg.task.task_id, reason=problem)
            self.publish(GroupStarted(msg.group_id, msg.task.task_id, 0, (), msg.weight_version, problem))
            return
        group_dir = self.root / safe_path_component(msg.group_id)
        executions = []
        for index in range(msg.group_size):
            directory = group_dir / f"{index:04d}"
            executions.append(
                _Execution(
                    execution_id_for(msg.group_id, index),
                    msg.group_id,
                    msg.task,
                    directory,
                    directory / "workspace",
                    directory / "logs",
                )
            )
        self.counts["groups_started"] += 1
        self.active_groups[msg.group_id] = msg.group_size
        self.publish(
            GroupStarted(
                msg.group_id,
                msg.task.task_id,
                msg.group_size,
                tuple(e.execution_id for e in executions),
                msg.weight_version,
                "",
            )
        )
        self.queue.extend(executions)
        self.log.info("group_started", group_id=msg.group_id, task_id=msg.task.task_id, size=msg.group_size)
        self._pump()

    def _group_problem(self, msg: StartGroup) -> str | None:
        if not msg.group_id:
            return "group_id must be non-empty"
        size = msg.group_size
        if isinstance(size, bool) or not isinstance(size, int) or not 1 <= size <= self.config.max_group_size:
            return f"group_size must be in 1..{self.config.max_group_size}, got {size!r}"
        if len(self.queue) + size > self.config.max_queued:
            return f"executor queue full ({len(self.queue)} queued, max_queued {self.config.max_queued})"
        return task_problem(msg.task) or sandbox_problem(self.config.sandbox, msg.task.workdir,
                                                         bool(msg.task.agent_mounts or msg.task.scorer_mounts
                                                              or msg.task.scorer_output_dir))

    def _pump(self) -> None:
        while self.queue and len(self.running) < self.config.max_concurrent:
            execution = self.queue.popleft()
            self.running[execution.execution_id] = execution
            self.spawn(self._run(execution), name=f"{self.name}.{execution.execution_id}")

    # ---- one execution (child task) -----------------------------------------------------------------------------
    async def _run(self, execution: _Execution) -> None:
        try:
            reply = await self.ask(
                self.config.proxy,
                IssueKey(execution.execution_id, execution.group_id),
                timeout_s=self.config.issue_key_timeout_s,
            )
            if not isinstance(reply, KeyIssued):
                raise TypeError(f"the proxy answered {type(reply).__qualname__}, not KeyIssued")
        except ActorDead:  # the proxy stopped (the run is ending): every execution still queued goes the same way
            await self.send(self.name, LaunchFailed(execution.execution_id, PROXY_STOPPED, False))
            return
        except Exception as error:  # any failure to get a key drops this execution, not the executor
            await self.send(self.name, LaunchFailed(execution.execution_id, f"no API key: {error!r}", False))
            return
        sandbox: list[PreparedSandbox] = []
        try:
            try:
                await self.offload(_prepare, execution)
                process = await self._spawn_agent(execution, reply, sandbox)
            except (OSError, ValueError, SandboxUnavailable) as error:  # unwritable root, missing program, bad argv
                await self.send(self.name,
                                LaunchFailed(execution.execution_id, f"agent did not start: {error!r}", True))
                return
            await self._wait_agent(execution, process)
        finally:
            for prepared in sandbox:  # whatever the agent left in its sandbox dies with it
                await prepared.close()

    async def _wait_agent(self, execution: _Execution, process: asyncio.subprocess.Process | LaunchedProcess) -> None:
        started_s = self.clock.now()
        await self.send(self.name, AgentLaunched(execution.execution_id, str(execution.workspace), process.pid))
        timed_out = False
        try:
            await asyncio.wait_for(process.wait(), execution.task.timeout_s)
        except asyncio.TimeoutError:
            timed_out = True
            await stop_process_group(process, self.config.kill_grace_s)
        except asyncio.CancelledError:  # the executor stops: no agent may outlive it
            signal_process_group(process.pid, signal.SIGKILL)
            raise
        signal_process_group(process.pid, signal.SIGKILL)  # tool processes the agent left behind
        assert process.returncode is not None
        await self.send(
            self.name,
            AgentExited(execution.execution_id, process.returncode, timed_out, self.clock.now() - started_s),
        )

    async def _spawn_agent(
        self, execution: _Execution, key: KeyIssued, sandbox: list[PreparedSandbox]
    ) -> asyncio.subprocess.Process | LaunchedProcess:
        sandboxed = self.config.sandbox.kind != "none"
        openai_url, anthropic_url = key.openai_base_url, key.anthropic_base_url
        if sandboxed:
            env = sandbox_env(self.config.extra_env)
            openai_url, anthropic_url = proxy_url_inside(openai_url), proxy_url_inside(anthropic_url)
        else:
            env = dict(os.environ) if self.config.inherit_env else {"PATH": os.environ.get("PATH", os.defpath)}
            env.update(self.config.extra_env)
        env.update(execution.task.env)
        env.update(
            OPENAI_BASE_URL=openai_url,
            OPENAI_API_KEY=key.api_key,
            ANTHROPIC_BASE_URL=anthropic_url,
            ANTHROPIC_API_KEY=key.api_key,
            GYRE_EXECUTION_ID=execution.execution_id,
            GYRE_GROUP_ID=execution.group_id,
        )
        argv = (*execution.task.agent_argv, execution.task.prompt)
        stdout_path, stderr_path = execution.logs / AGENT_STDOUT, execution.logs / AGENT_STDERR
        task = execution.task
        prepared = await open_sandbox(self.config.sandbox, SandboxRequest(
            argv, env, str(execution.workspace), task.workdir, read_only_mounts=task.agent_mounts,
            hide=(str(self.root),), proxy_url=key.openai_base_url if sandboxed else "",
            memory_mb=task.memory_mb, max_processes=task.max_processes, cpus=task.cpus,
        ))
        sandbox.append(prepared)
        # The launch counters are bumped here, in the child task, rather than through a report: they are statistics
        # only, and no handler decides anything from them.
        launcher = self.launcher
        if launcher is not None and launcher.alive and not sandboxed:
            if launcher.accepts(argv, execution.workspace, env):
                try:
                    process = await launcher.launch(argv, execution.workspace, env, stdout_path, stderr_path)
                except LauncherDied:
                    pass  # the watcher logs it once; this and every later agent is exec'd the plain way
                else:
                    self.counts["warm_launches"] += 1
                    return process
            elif not self.warned_not_warm:
                self.warned_not_warm = True
                self.log.warning("agent_not_launched_warm", argv0=argv[0], argv1=argv[1][:80] if len(argv) > 1 else "",
                                 why="only `<this python> <existing script> ...` can be forked warm")
        with open(stdout_path, "wb") as stdout, open(stderr_path, "wb") as stderr:
            process = await asyncio.create_subprocess_exec(
                *prepared.argv,
                cwd=prepared.cwd,
                env=prepared.env,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=stdout,
                stderr=stderr,
                start_new_session=True,  # its own process group: a timeout kills the agent and all it spawned
            )
        self.counts["cold_launches"] += 1
        return process

    # ---- reports from the children ------------------------------------------------------------------------------
    @handler(AgentLaunched)
    def on_agent_launched(self, msg: AgentLaunched) -> None:
        execution = self.running.get(msg.execution_id)
        if execution is None:
            self._unknown(msg)
            return
        self.counts["executions_launched"] += 1
        self.publish(ExecutionStarted(msg.execution_id, execution.group_id, msg.workspace))

    @handler(AgentExited)
    async def on_agent_exited(self, msg: AgentExited) -> None:
        execution = self._release(msg.execution_id)
        if execution is None:
            self._unknown(msg)
            return
        self.counts["executions_finished"] += 1
        self.counts["executions_timed_out"] += int(msg.timed_out)
        self.log.info(
            "agent_exited",
            execution_id=msg.execution_id,
            exit_code=msg.exit_code,
            timed_out=msg.timed_out,
            wall_s=round(msg.wall_s, 3),
        )
        self.tell(self.config.proxy, RevokeKey(msg.execution_id))
        self.publish(ExecutionEnded(msg.execution_id, execution.group_id))
        await self.send(
            self.config.evaluator,
            ExecutionFinished(
                msg.execution_id,
                execution.group_id,
                execution.task,
                str(execution.workspace),
                msg.exit_code,
                msg.timed_out,
                msg.wall_s,
            ),
        )
        self._pump()

    @handler(LaunchFailed)
    async def on_launch_failed(self, msg: LaunchFailed) -> None:
        execution = self._release(msg.execution_id)
        if execution is None:
            self._unknown(msg)
            return
        self.counts["executions_failed"] += 1
        if msg.reason == PROXY_STOPPED:
            # Expected while a topology stops (the proxy may stop before this executor's queue is empty): counted,
            # logged at the 1st, 2nd, 4th... instead of one error line per queued execution.
            self.counts["not_started_proxy_stopped"] += 1
            n = self.counts["not_started_proxy_stopped"]
            if n & (n - 1) == 0:
                self.log.warning("executions_not_started_proxy_stopped", execution_id=msg.execution_id, count=n)
        else:
            self.log.error("execution_not_started", execution_id=msg.execution_id, reason=msg.reason)
        if msg.key_issued:
            self.tell(self.config.proxy, RevokeKey(msg.execution_id))
            self.publish(ExecutionEnded(msg.execution_id, execution.group_id))
        await self.send(
            self.config.builder, ExecutionDropped(msg.execution_id, execution.group_id, msg.reason, False)
        )
        self._pump()

    def _unknown(self, msg: AgentLaunched | AgentExited | LaunchFailed) -> None:
        # A report queued before a restart: the restarted executor no longer knows (or runs) that execution.
        self.log.warning("report_for_unknown_execution", type=type(msg).__name__, execution_id=msg.execution_id)

    def _release(self, execution_id: str) -> _Execution | None:
        execution = self.running.pop(execution_id, None)
        if execution is None:
            return None
        left = self.active_groups[execution.group_id] - 1
        if left:
            self.active_groups[execution.group_id] = left
        else:
            del self.active_groups[execution.group_id]
        return execution

    def statistics(self) -> ExecutorStatistics:
        c = self.counts
        return ExecutorStatistics(
            groups_started=c["groups_started"],
            groups_refused=c["groups_refused"],
            executions_launched=c["executions_launched"],
            executions_finished=c["executions_finished"],
            executions_timed_out=c["executions_timed_out"],
            executions_failed=c["executions_failed"],
            running=len(self.running),
            queued=len(self.queue),
            warm_launches=c["warm_launches"],
            cold_launches=c["cold_launches"],
        )
