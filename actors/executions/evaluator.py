"""The evaluator: scores a finished (or timed-out) execution's workspace with the task's scorer.

The scorer is `task.scorer_argv`, run with the workspace as its working directory, in a process group of its own,
under `task.scorer_timeout_s`. It must exit 0 and print one JSON object with a finite number under "reward"
(optionally "success": bool and anything else); the object may be the whole of stdout or its last non-empty line
(so a scorer may log before it). The object, compact, becomes `ExecutionScored.detail`, which is how the scorer's
success flag reaches the trajectory builder.

A scorer that does not do its job never turns into a reward of 0, which would teach the policy that a good
workspace was bad: the execution is dropped (`ExecutionDropped`), and the drop is counted by kind:
- "crashed": non-zero exit (the reason carries the tail of its stderr);
- "timed_out": it overran its limit (its whole process group is killed: SIGTERM, then SIGKILL);
- "bad_output": no JSON object, no "reward", or a reward that is not a finite number;
- "workspace_lost": the workspace directory is gone;
- "failed_to_start": the command does not run;
- "no_room": `max_queued` executions already wait for a scorer.
An agent that timed out is scored like any other: its preserved workspace is what it achieved.

Scorers run in child tasks (at most `max_concurrent` at once, the rest queue), which report back with
`ScoringEnded`, so waiting never blocks the mailbox.

Warm scorers (`warm_launcher_preload`, off by default): a scorer is a fresh interpreter per execution, ~0.04 CPU-s
even with `-S`, which the main job pays ~250 times a step (about a tenth of its CPU on 2 cores); a fork from a warm
launcher costs ~0.01 (benchmarks/studies/scorer_launch.py). With a preload the evaluator starts a warm launcher
(gyre.actors.executions.warm_launcher) that imported those modules once, and forks a scorer whose argv is `<this interpreter>
[-S|-B|-s] <existing script> ...` from it; any other scorer, and every scorer after the launcher died, is exec'd the
plain way. A warm scorer's stdout and stderr go to files in a folder of the evaluator's (not the workspace) and are
judged like the plain pipes, capped alike; unlike a pipe, a file takes all a scorer prints until its time limit. The
statistics count warm and plain scorer runs.
"""

from __future__ import annotations

import asyncio
import collections
import json
import math
import os
import shutil
import signal
import tempfile
from pathlib import Path
from typing import Any

import attrs

from gyre.actors.errors import ActorError
from gyre.actors.executions.process_groups import signal_process_group, stop_process_group
from gyre.actors.executions.sandbox import (
    SandboxConfig,
    SandboxRequest,
    SandboxUnavailable,
    open_sandbox,
)
from gyre.actors.executions.warm_launcher import (
    LaunchedProcess,
    LauncherClosed,
    LauncherDied,
    WarmLauncher,
    preload_problem,
    watch_launcher,
)
from gyre.messages.execution_reports import ScoringEnded
from gyre.messages.execution_stats import EvaluatorStatistics
from gyre.messages.executions import ExecutionFinished
from gyre.messages.samples import ExecutionDropped, ExecutionScored
from gyre.runtime import Actor, handler
from gyre.runtime.validators import count, positive

__all__ = ["EvaluatorConfig", "Evaluator", "ScorerOutputError", "parse_scorer_output", "DROP_KINDS"]

DROP_KINDS = ("crashed", "timed_out", "bad_output", "workspace_lost", "failed_to_start", "no_room")
STDERR_TAIL_CHARS = 300
"""How much of a crashed scorer's stderr goes into the drop reason."""


def _module_names(instance: object, attribute: attrs.Attribute, value: object) -> None:
    problem = preload_problem(value)
    if problem is not None:
        raise ValueError(f"{attribute.name}: {problem}")


@attrs.frozen
class EvaluatorConfig:
    """Whom to tell, and the bounds."""

    builder: str = "trajectory_builder"
    """Actor that receives ExecutionScored and ExecutionDropped."""
    max_concurrent: int = attrs.field(default=4, validator=count)
    """Scorers running at once."""
    max_queued: int = attrs.field(default=4096, validator=count)
    """Executions waiting for a scorer at most; beyond it an execution is dropped ("no_room"), loudly."""
    kill_grace_s: float = attrs.field(default=1.0, validator=positive)
    """Time between SIGTERM and SIGKILL of an overrunning scorer's process group."""
    max_output_bytes: int = attrs.field(default=64 * 1024, validator=count)
    """Stdout (and stderr) kept per scorer run; the rest is read and discarded so the scorer never blocks."""
    max_detail_chars: int = attrs.field(default=2048, validator=count)
    """Longest `detail` sent on; a longer scorer object is cut down to its "reward" and "success"."""
    remove_workspace: bool = False
    """Delete the workspace directory once scored or dropped (the logs beside it stay)."""
    inherit_env: bool = True
    """Scorers see this process's environment (plus GYRE_EXECUTION_ID and GYRE_AGENT_TIMED_OUT)."""
    sandbox: SandboxConfig = SandboxConfig()
    """Where scorers run (gyre.actors.executions.sandbox). With bubblewrap a scorer sees the workspace at the task's
    `workdir`, its `scorer_mounts` read-only, a fresh writable `scorer_output_dir` (made beside the workspace as
    `verifier/`), and an environment of PATH, HOME, the task's `env`, GYRE_EXECUTION_ID and GYRE_AGENT_TIMED_OUT
    (`inherit_env` does not apply); the folder two levels above the workspace (the executor's root, laid out as
    root/group/index/workspace) is hidden. Warm scorers run only without a sandbox."""
    warm_launcher_preload: tuple[str, ...] = attrs.field(default=(), validator=_module_names)
    """Modules a warm launcher imports once for the scorers it forks (module docstring); () runs every scorer as a
    fresh process. An entry "module:function" also calls that warm-up once."""


class ScorerOutputError(ActorError, ValueError):
    """A scorer's stdout holds no usable reward."""


def parse_scorer_output(stdout: bytes) -> tuple[float, dict[str, Any]]:
    """(reward, the JSON object) from a scorer's stdout: the whole text, or else its last non-empty line."""
    text = stdout.decode("utf-8", errors="replace").strip()
    if not text:
        raise ScorerOutputError("the scorer printed nothing")
    lines = [line for line in text.splitlines() if line.strip()]
    obj: Any = None
    for candidate in (text, lines[-1]):
        try:
            obj = json.loads(candidate)
            break
        except ValueError:
            continue
    else:
        raise ScorerOutputError(f"the scorer's output is not JSON: {lines[-1][:120]!r}")
    if not isinstance(obj, dict):
        raise ScorerOutputError(f"the scorer printed a JSON {type(obj).__name__}, not an object")
    if "reward" not in obj:
        raise ScorerOutputError("the scorer's JSON has no \"reward\"")
    reward = obj["reward"]
    if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
        raise ScorerOutputError(f"the scorer's reward {reward!r} is not a finite number")
    return float(reward), obj


def _detail(obj: dict[str, Any], max_chars: int) -> str:
    text = json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    if len(text) <= max_chars:
        return text
    kept = {key: obj[key] for key in ("reward", "success") if key in obj and not isinstance(obj[key], (dict, list))}
    return json.dumps(kept, sort_keys=True, separators=(",", ":"), ensure_ascii=False)[:max_chars]


def _fresh_directory(path: Path) -> None:
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)


def _read_files_capped(paths: tuple[Path, ...], cap: int) -> tuple[bytes, ...]:
    """The first `cap` bytes of each file (b"" for one that is missing)."""
    contents = []
    for path in paths:
        try:
            with open(path, "rb") as file:
                contents.append(file.read(cap))
        except FileNotFoundError:
            contents.append(b"")
    return tuple(contents)


async def _read_capped(stream: asyncio.StreamReader, into: bytearray, cap: int) -> None:
    """Append up to `cap` bytes of `stream` to `into`; read and discard the rest until EOF."""
    while True:
        chunk = await stream.read(65536)
        if not chunk:
            return
        room = cap - len(into)
        if room > 0:
            into.extend(chunk[:room])


class Evaluator(Actor):
    """Scores workspaces; drops, never zeroes, what it cannot score (module docstring)."""

    config_cls = EvaluatorConfig

    async def on_start(self) -> None:
        self.queue: collections.deque[ExecutionFinished] = collections.deque()
        self.running: dict[str, ExecutionFinished] = {}
        self.scored = 0
        self.dropped_by_kind: collections.Counter[str] = collections.Counter()
        self.runs = {"warm": 0, "plain": 0}
        self.launcher: WarmLauncher | None = None
        self.output_dir: Path | None = None
        self.output_serial = 0
        if self.config.warm_launcher_preload:
            self.output_dir = Path(tempfile.mkdtemp(prefix="gyre-scorer-output-"))
            launcher = WarmLauncher()
            await launcher.start(self.config.warm_launcher_preload)  # a preload that fails to import fails here
            self.launcher = launcher
            self.spawn(watch_launcher(launcher, self.log), name=f"{self.name}.warm_launcher")

    async def on_stop(self) -> None:
        if self.launcher is not None:
            await self.launcher.close()
        if self.output_dir is not None:
            shutil.rmtree(self.output_dir, ignore_errors=True)

    @handler(ExecutionFinished)
    async def on_execution_finished(self, msg: ExecutionFinished) -> None:
        if msg.execution_id in self.running or any(q.execution_id == msg.execution_id for q in self.queue):
            self.log.error("execution_already_being_scored", execution_id=msg.execution_id)
            return
        if len(self.queue) >= self.config.max_queued:
            self.dropped_by_kind["no_room"] += 1
            reason = f"evaluator queue full ({self.config.max_queued} waiting)"
            self.log.error("execution_dropped", execution_id=msg.execution_id, reason=reason)
            dropped = ExecutionDropped(msg.execution_id, msg.group_id, reason, msg.timed_out)
            await self.send(self.config.builder, dropped)
            return
        self.queue.append(msg)
        self._pump()

    def _pump(self) -> None:
        while self.queue and len(self.running) < self.config.max_concurrent:
            finished = self.queue.popleft()
            self.running[finished.execution_id] = finished
            self.spawn(self._score(finished), name=f"{self.name}.{finished.execution_id}")

    # ---- one scorer run (child task) ----------------------------------------------------------------------------
    async def _score(self, finished: ExecutionFinished) -> None:
        ended = await self._run_scorer(finished)
        if self.config.remove_workspace:
            await self.offload(shutil.rmtree, finished.workspace, True)
        await self.send(self.name, ended)

    async def _run_scorer(self, finished: ExecutionFinished) -> ScoringEnded:
        execution_id = finished.execution_id
        task = finished.task
        workspace = Path(finished.workspace)

        def drop(kind: str, reason: str) -> ScoringEnded:
            return ScoringEnded(execution_id, None, "", kind, reason)

        if not workspace.is_dir():
            return drop("workspace_lost", f"workspace lost: {workspace} is not a directory")
        sandboxed = self.config.sandbox.kind != "none"
        if sandboxed:
            env = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/tmp",
                   "LANG": "C.UTF-8"}
        else:
            env = dict(os.environ) if self.config.inherit_env else {"PATH": os.environ.get("PATH", os.defpath)}
        env.update(task.env)
        env.update(GYRE_EXECUTION_ID=execution_id, GYRE_AGENT_TIMED_OUT="1" if finished.timed_out else "0")
        argv = task.scorer_argv
        prepared = None
        try:
            writable: tuple[tuple[str, str], ...] = ()
            if task.scorer_output_dir:
                output = workspace.parent / "verifier"
                await self.offload(_fresh_directory, output)
                writable = ((str(output), task.scorer_output_dir),)
            hide = (str(workspace.parents[2]),) if sandboxed and len(workspace.parents) > 3 else ()
            prepared = await open_sandbox(self.config.sandbox, SandboxRequest(
                argv, env, str(workspace), task.workdir, read_only_mounts=task.scorer_mounts,
                writable_mounts=writable, hide=hide, memory_mb=task.memory_mb, max_processes=task.max_processes,
                cpus=task.cpus,
            ))
            ran = None
            launcher = self.launcher
            if not sandboxed and launcher is not None and launcher.alive and launcher.accepts(argv, workspace, env):
                ran = await self._run_warm(launcher, argv, workspace, env, task.scorer_timeout_s)
            if ran is None:
                ran = await self._run_plain(prepared.argv, Path(prepared.cwd), prepared.env, task.scorer_timeout_s)
        except (OSError, ValueError, SandboxUnavailable) as error:  # SandboxRefused is a ValueError
            return drop("failed_to_start", f"scorer did not start: {error!r}")
        finally:
            if prepared is not None:
                await prepared.close()
        returncode, out, err, timed_out = ran
        if timed_out:
            return drop("timed_out", f"scorer timed out after {task.scorer_timeout_s} s")
        if returncode != 0:
            tail = err.decode("utf-8", errors="replace").strip()[-STDERR_TAIL_CHARS:]
            return drop("crashed", f"scorer crashed: exit {returncode}" + (f": {tail}" if tail else ""))
        try:
            reward, obj = parse_scorer_output(bytes(out))
        except ScorerOutputError as error:
            return drop("bad_output", f"scorer output unusable: {error}")
        return ScoringEnded(execution_id, reward, _detail(obj, self.config.max_detail_chars), "", "")

    async def _run_plain(self, argv: tuple[str, ...], workspace: Path, env: dict[str, str],
                         timeout_s: float) -> tuple[int, bytes, bytes, bool]:
        """Exec the scorer; (exit code, stdout, stderr, timed out), output capped. Raises what exec raises."""
        process = await asyncio.create_subprocess_exec(
            *argv,
            cwd=workspace,
            env=env,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
        )
        self.runs["plain"] += 1
        out, err = bytearray(), bytearray()
        assert process.stdout is not None and process.stderr is not None
        readers = asyncio.gather(
            _read_capped(process.stdout, out, self.config.max_output_bytes),
            _read_capped(process.stderr, err, self.config.max_output_bytes),
        )
        try:
            timed_out = await self._wait_or_stop(process, timeout_s)
        except asyncio.CancelledError:
            readers.cancel()
            raise
        try:
            await asyncio.wait_for(readers, self.config.kill_grace_s)
        except asyncio.TimeoutError:  # something outside the group holds a pipe: judge what was read
            pass
        assert process.returncode is not None
        return process.returncode, bytes(out), bytes(err), timed_out

    async def _run_warm(self, launcher: WarmLauncher, argv: tuple[str, ...], workspace: Path, env: dict[str, str],
                        timeout_s: float) -> tuple[int, bytes, bytes, bool] | None:
        """Fork the scorer from the warm launcher; as `_run_plain`, or None if the launcher is gone (run it plain)."""
        assert self.output_dir is not None
        self.output_serial += 1
        out_path = self.output_dir / f"{self.output_serial}.out"
        err_path = self.output_dir / f"{self.output_serial}.err"
        try:
            try:
                process = await launcher.launch(argv, workspace, env, out_path, err_path)
            except (LauncherDied, LauncherClosed):
                return None  # the watcher logs a death once
            self.runs["warm"] += 1
            timed_out = await self._wait_or_stop(process, timeout_s)
            out, err = await self.offload(_read_files_capped, (out_path, err_path), self.config.max_output_bytes)
            assert process.returncode is not None
            return process.returncode, out, err, timed_out
        finally:
            for path in (out_path, err_path):
                path.unlink(missing_ok=True)

    async def _wait_or_stop(self, process: asyncio.subprocess.Process | LaunchedProcess, timeout_s: float) -> bool:
        """Wait for the scorer within its limit (else stop its group); then kill what is left of the group. Whether
        it timed out."""
        timed_out = False
        try:
            await asyncio.wait_for(process.wait(), timeout_s)
        except asyncio.TimeoutError:
            timed_out = True
            await stop_process_group(process, self.config.kill_grace_s)
        except asyncio.CancelledError:
            signal_process_group(process.pid, signal.SIGKILL)
            raise
        signal_process_group(process.pid, signal.SIGKILL)  # leftovers, and the pipe ends they hold
        return timed_out

    # ---- reports from the children ------------------------------------------------------------------------------
    @handler(ScoringEnded)
    async def on_scoring_ended(self, msg: ScoringEnded) -> None:
        finished = self.running.pop(msg.execution_id, None)
        if finished is None:  # queued before a restart: that scorer run belongs to the previous incarnation
            self.log.warning("report_for_unknown_execution", execution_id=msg.execution_id)
            return
        if msg.reward is None:
            self.dropped_by_kind[msg.drop_kind] += 1
            self.log.warning("execution_dropped", execution_id=msg.execution_id, kind=msg.drop_kind, reason=msg.reason)
            out: Any = ExecutionDropped(msg.execution_id, finished.group_id, msg.reason, finished.timed_out)
        else:
            self.scored += 1
            self.log.info("execution_scored", execution_id=msg.execution_id, reward=msg.reward,
                          agent_timed_out=finished.timed_out)
            out = ExecutionScored(msg.execution_id, finished.group_id, msg.reward, finished.timed_out, msg.detail)
        await self.send(self.config.builder, out)
        self._pump()

    def statistics(self) -> EvaluatorStatistics:
        return EvaluatorStatistics(
            scored=self.scored,
            dropped=sum(self.dropped_by_kind.values()),
            dropped_by_kind={kind: self.dropped_by_kind[kind] for kind in DROP_KINDS},
            running=len(self.running),
            queued=len(self.queue),
            warm_scorer_runs=self.runs["warm"],
            plain_scorer_runs=self.runs["plain"],
        )
