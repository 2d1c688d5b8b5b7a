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
"""

from __future__ import annotations

import asyncio
import collections
import json
import math
import os
import shutil
import signal
from pathlib import Path
from typing import Any

import attrs

from gyre.actors.executor import signal_process_group, stop_process_group
from gyre.messages.execution_reports import ScoringEnded
from gyre.messages.execution_stats import EvaluatorStatistics, StatisticsAsked
from gyre.messages.executions import ExecutionFinished
from gyre.messages.samples import ExecutionDropped, ExecutionScored
from gyre.runtime import Actor, handler

__all__ = ["EvaluatorConfig", "Evaluator", "ScorerOutputError", "parse_scorer_output", "DROP_KINDS"]

DROP_KINDS = ("crashed", "timed_out", "bad_output", "workspace_lost", "failed_to_start", "no_room")
STDERR_TAIL_CHARS = 300
"""How much of a crashed scorer's stderr goes into the drop reason."""


def _positive(instance: object, attribute: attrs.Attribute, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{attribute.name} must be a finite number > 0, got {value!r}")


def _count(instance: object, attribute: attrs.Attribute, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{attribute.name} must be an int >= 1, got {value!r}")


@attrs.frozen
class EvaluatorConfig:
    """Whom to tell, and the bounds."""

    builder: str = "trajectory_builder"
    """Actor that receives ExecutionScored and ExecutionDropped."""
    max_concurrent: int = attrs.field(default=4, validator=_count)
    """Scorers running at once."""
    max_queued: int = attrs.field(default=4096, validator=_count)
    """Executions waiting for a scorer at most; beyond it an execution is dropped ("no_room"), loudly."""
    kill_grace_s: float = attrs.field(default=1.0, validator=_positive)
    """Time between SIGTERM and SIGKILL of an overrunning scorer's process group."""
    max_output_bytes: int = attrs.field(default=64 * 1024, validator=_count)
    """Stdout (and stderr) kept per scorer run; the rest is read and discarded so the scorer never blocks."""
    max_detail_chars: int = attrs.field(default=2048, validator=_count)
    """Longest `detail` sent on; a longer scorer object is cut down to its "reward" and "success"."""
    remove_workspace: bool = False
    """Delete the workspace directory once scored or dropped (the logs beside it stay)."""
    inherit_env: bool = True
    """Scorers see this process's environment (plus GYRE_EXECUTION_ID and GYRE_AGENT_TIMED_OUT)."""


class ScorerOutputError(ValueError):
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
        env = dict(os.environ) if self.config.inherit_env else {"PATH": os.environ.get("PATH", os.defpath)}
        env.update(GYRE_EXECUTION_ID=execution_id, GYRE_AGENT_TIMED_OUT="1" if finished.timed_out else "0")
        try:
            process = await asyncio.create_subprocess_exec(
                *task.scorer_argv,
                cwd=workspace,
                env=env,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                start_new_session=True,
            )
        except (OSError, ValueError) as error:
            return drop("failed_to_start", f"scorer did not start: {error!r}")
        out, err = bytearray(), bytearray()
        assert process.stdout is not None and process.stderr is not None
        readers = asyncio.gather(
            _read_capped(process.stdout, out, self.config.max_output_bytes),
            _read_capped(process.stderr, err, self.config.max_output_bytes),
        )
        timed_out = False
        try:
            await asyncio.wait_for(process.wait(), task.scorer_timeout_s)
        except asyncio.TimeoutError:
            timed_out = True
            await stop_process_group(process, self.config.kill_grace_s)
        except asyncio.CancelledError:
            signal_process_group(process.pid, signal.SIGKILL)
            readers.cancel()
            raise
        signal_process_group(process.pid, signal.SIGKILL)  # leftovers, and the pipe ends they hold
        try:
            await asyncio.wait_for(readers, self.config.kill_grace_s)
        except asyncio.TimeoutError:  # something outside the group holds a pipe: judge what was read
            pass
        if timed_out:
            return drop("timed_out", f"scorer timed out after {task.scorer_timeout_s} s")
        if process.returncode != 0:
            tail = err.decode("utf-8", errors="replace").strip()[-STDERR_TAIL_CHARS:]
            return drop("crashed", f"scorer crashed: exit {process.returncode}" + (f": {tail}" if tail else ""))
        try:
            reward, obj = parse_scorer_output(bytes(out))
        except ScorerOutputError as error:
            return drop("bad_output", f"scorer output unusable: {error}")
        return ScoringEnded(execution_id, reward, _detail(obj, self.config.max_detail_chars), "", "")

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

    @handler(StatisticsAsked)
    def on_statistics(self, msg: StatisticsAsked) -> EvaluatorStatistics:
        return EvaluatorStatistics(
            scored=self.scored,
            dropped=sum(self.dropped_by_kind.values()),
            dropped_by_kind={kind: self.dropped_by_kind[kind] for kind in DROP_KINDS},
            running=len(self.running),
            queued=len(self.queue),
        )
