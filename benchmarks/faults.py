"""`gyre bench faults [--json] [--seeds N] [--kinds K,...]`: a training run under seeded faults, in virtual time, with
its invariants checked after each (issue 28).

The run: the real task source, micro-step claimer, run monitor and checkpointer around a scripted executor (each
group lands a moment after it starts) and a scripted core (claims each step's micro-steps, applies the step, saves
its checkpoint part: the contract of actors/cells/core_checkpoint.py). Each case is one fault drawn from (kind,
seed) by gyre.runtime.faults.random_plan and run with gyre.runtime.testing.run_with_faults. Checked after it, from
the event log and the actors' statistics:
- samples_lost_in_transit: samples the executor sent that the claimer never counted (a dropped SamplesLanded);
- samples_unaccounted: the claimer's ledger does not balance (landed != trained + skipped + dropped + in flight);
- samples_trained_twice: an execution the scripted core trained twice (its own record) or the claimer counted twice;
- versions_not_monotone: a StepApplied whose version is below an earlier one, or a step id applied twice;
- staleness_violations: a granted sample older than the step's base version minus the staleness bound;
- samples_dropped_counted: samples the claimer counted as dropped (a gap in the landing numbers, or in flight at its
  restart): not a violation, the defined outcome of those faults;
- finished: the run reached its steps within the time limit; recover_s: from the fault to the next applied step.
Outcomes: "kept" (the run went on), "resumed" (the fault ended the run with a message saying to resume, as the
core's death or a claimer restart mid-step does, and a fault-free `--resume` from its newest checkpoint finished),
"ended, no checkpoint yet" (it ended before the first checkpoint), "hung" (the time limit).
Agent calls are not part of this run (no proxy, no agents): "lost calls" are measured by the real-time rollout
cases (benchmarks/fault_rollouts.py: an agent killed mid-call, the evaluator's scorer killed). Real-time process
kills: REALTIME_CASES.
Every number is what happened: a fault kind the system does not yet survive shows up as a non-zero column.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import attrs

from gyre.actors.executions.task_source import TaskSource, TaskSourceConfig, groups_ahead_for_staleness
from gyre.actors.training.checkpointer import Checkpointer, CheckpointerConfig
from gyre.actors.training.microstep_claimer import ClaimerConfig, MicroStepClaimer
from gyre.actors.training.run_monitor import RunMonitor, RunMonitorConfig
from gyre.messages.cells import TRAIN, RoleChanged
from gyre.messages.checkpoints import CorePartsSaved
from gyre.messages.executions import GroupDone, StartGroup, TaskSpec
from gyre.messages.runtime_control import StatisticsAsked
from gyre.messages.samples import SamplesLanded, TrainingSample
from gyre.messages.training import ClaimGranted, ClaimMicroStep, ClaimsOpen, MicroStepDone, StepApplied, StepReady
from gyre.policies.staleness import MaxVersionLag
from gyre.runtime import Actor, Codec, GyreError, RestartPolicy, Topology, handler, read_log
from gyre.runtime.checkpoint import (
    decode_json, encode_json, load_latest, read_actor_state, staging_dir, write_core_record, write_file_atomic,
)
from gyre.runtime.faults import random_plan
from gyre.runtime.testing import run_with_faults

GROUP_SIZE = 2
STALENESS = 1
TASKS = tuple(TaskSpec(f"t{i}", f"do t{i}", {}, (sys.executable, "agent.py"), (sys.executable, "score.py"), 60.0, 5.0)
              for i in range(6))
ACTORS = ("task_source", "claimer", "monitor", "checkpointer")
"""Actors a kill or a partition may hit: the real ones (the scripted executor and core stand in for processes whose
kills need a real-time run)."""
LINKS = (("executor", "claimer", "SamplesLanded"), ("executor", "task_source", "GroupDone"),
         ("core", "claimer", "MicroStepDone"), ("core", "claimer", "ClaimMicroStep"),
         ("task_source", "executor", "StartGroup"), ("claimer", "core", "StepReady"),
         ("core", "monitor", "StepApplied"), ("core", "task_source", "StepApplied"))
"""(sender, receiver, type) a drop, delay or duplicate may hit."""
_APPLIED = (("core", "monitor", "StepApplied"), ("core", "task_source", "StepApplied"), ("core", "claimer", "StepApplied"))
KINDS: dict[str, tuple[str, tuple[tuple[str, str, str], ...]]] = {
    "kill": ("kill", LINKS),
    "partition": ("partition", LINKS),
    "delay": ("delay", LINKS),
    "drop-samples": ("drop", (("executor", "claimer", "SamplesLanded"),)),
    "drop-microstep-done": ("drop", (("core", "claimer", "MicroStepDone"),)),
    "drop-step-ready": ("drop", (("claimer", "core", "StepReady"),)),
    "drop-step-applied": ("drop", _APPLIED),
    "duplicate-samples": ("duplicate", (("executor", "claimer", "SamplesLanded"),)),
    "duplicate-microstep-done": ("duplicate", (("core", "claimer", "MicroStepDone"),)),
    "duplicate-step-applied": ("duplicate", _APPLIED),
}
"""The benchmark's fault kinds: a gyre.runtime.faults kind and the links it may hit."""
HORIZON_S = 2.0
"""Virtual seconds a fault-free run of 6 steps takes (2.1): partitions and kills fall inside it."""


def _sample(execution: str, group: str, version: int) -> TrainingSample:
    return TrainingSample(execution, group, 0, "main", 0, (1, 2, 3, 4), (False, True, True, True), (0.0,) * 4,
                          (1.0,) * 4, (1.0,) * 4, (1 / 3,) * 4, version, version, 3)


@attrs.frozen
class ScriptedExecutorConfig:
    report_file: str = ""
    """Where the samples it sent are written as it stops (a run in processes: nobody can read its instance)."""


class ScriptedExecutor(Actor):
    """Executor, evaluator and trajectory builder in one: each group lands at the claimer 0.7 s after it starts, then
    its GroupDone reaches the task source (the builder's order). Counts the samples it sent and numbers its
    landings as the trajectory builder does."""

    config_cls = ScriptedExecutorConfig

    async def on_start(self) -> None:
        self.starts: dict[str, StartGroup] = {}
        self.samples_sent = 0
        self.landings_sent = 0

    @handler(StartGroup)
    def on_start_group(self, msg: StartGroup) -> None:
        self.starts[msg.group_id] = msg
        self.send_later(0.7, GroupDone(msg.group_id, True, 1.0, 1.0, msg.group_size, 0, 10))

    @handler(GroupDone)
    def on_landed(self, msg: GroupDone) -> None:
        start = self.starts.pop(msg.group_id, None)
        if start is None:  # a duplicated timer of a group already landed
            return
        ids = tuple(f"{msg.group_id}-{i}" for i in range(start.group_size))
        samples = tuple(_sample(e, msg.group_id, start.weight_version) for e in ids)
        self.samples_sent += len(samples)
        self.landings_sent += 1
        self.tell("claimer", SamplesLanded(msg.group_id, samples, ids, (1.0,) * len(ids), (1.0,) * len(ids), 0,
                                           4 * len(ids), 3 * len(ids), start.weight_version, start.weight_version,
                                           self.landings_sent, self.samples_sent))
        self.tell("task_source", msg)

    async def on_stop(self) -> None:
        if self.config.report_file:
            Path(self.config.report_file).write_text(json.dumps({"samples_sent": self.samples_sent}))


def _note_trained(path: str, executions: list[str]) -> None:
    """Append what a scripted trainer trained to `path` (one line a micro-step): a record that outlives a kill."""
    if path and executions:
        with open(path, "a") as handle:
            handle.write(" ".join(executions) + "\n")


@attrs.frozen
class ScriptedCoreConfig:
    root: str
    every_steps: int = 1
    resume_from: str = ""
    crash_after_step: int = -1
    """End a fresh run (not a resumed one) with status 1 right after this step, as a dying core does."""
    crash_by_exit: bool = False
    """Die by os._exit (a real process death, for a run in processes) instead of asking the run to stop."""
    trained_log: str = ""
    """Also append what it trains to this file (_note_trained)."""
    claims_per_ready: int = 0
    """Micro-steps it claims on each StepReady (0: all it can), so that a satellite gets the others; and with a
    satellite it trains nothing before the satellite announced itself (a slow process start would else leave it
    no work)."""


class ScriptedCore(Actor):
    """The core's side of a step and of a checkpoint: claims a step's micro-steps once StepReady fixed it, counts
    them and those satellites report (MicroStepDone), publishes StepApplied once all are in; its "weights" are a
    hash chain of what it trained."""

    config_cls = ScriptedCoreConfig
    subscriptions = (StepReady, RoleChanged)

    async def on_start(self) -> None:
        self.version = 0
        self.weights = "0" * 64
        self.trained: list[str] = []
        self.applied_through = -1
        self.saved_through = -1
        self.last_applied: StepApplied | None = None
        self.ready: dict[int, StepReady] = {}
        self.done: dict[int, set[int]] = {}
        self.satellite_seen = not self.config.claims_per_ready
        if self.config.resume_from:
            state, checkpoint = read_actor_state(self.config.resume_from, "core")
            self.version, self.weights, self.trained = state["version"], state["weights"], state["trained"]
            self.applied_through = self.saved_through = checkpoint.step_id

    @handler(StepReady)
    async def on_step_ready(self, msg: StepReady) -> None:
        if msg.step_id <= self.applied_through:
            if self.last_applied is not None and self.last_applied.step_id == msg.step_id:
                self.tell("claimer", self.last_applied)  # as the core does: the claimer missed it
            return
        self.ready[msg.step_id] = msg
        done = self.done.setdefault(msg.step_id, set())
        if not self.satellite_seen:
            return  # the claimer announces the step again
        limit = self.config.claims_per_ready or 4 * msg.num_microsteps  # bounded either way
        for _ in range(limit):
            if len(done) >= msg.num_microsteps:
                break
            try:
                grant = await self.ask("claimer", ClaimMicroStep(self.name, self.version), timeout_s=5.0)
            except GyreError:
                break  # the claimer is gone or silent: a re-announced StepReady tries again
            if grant.step_id != msg.step_id or grant.microstep_index in done:
                break  # nothing left to claim (a satellite holds the rest) or not this step
            executions = [sample.execution_id for sample in grant.samples]
            for execution in executions:
                self.trained.append(execution)
                self.weights = hashlib.sha256((self.weights + execution).encode()).hexdigest()
            _note_trained(self.config.trained_log, executions)
            done.add(grant.microstep_index)
            self.tell("claimer", MicroStepDone(self.name, grant.step_id, grant.microstep_index, "", 0, 0, 4, 0.0))
        self._apply_if_complete(msg.step_id)

    @handler(RoleChanged)
    def on_role_changed(self, msg: RoleChanged) -> None:
        self.satellite_seen = True

    @handler(MicroStepDone)
    def on_satellite_done(self, msg: MicroStepDone) -> None:
        if msg.step_id <= self.applied_through:
            return
        self.done.setdefault(msg.step_id, set()).add(msg.microstep_index)
        self.weights = hashlib.sha256(f"{self.weights}{msg.cell}:{msg.step_id}.{msg.microstep_index}".encode()
                                      ).hexdigest()
        self._apply_if_complete(msg.step_id)

    def _apply_if_complete(self, step_id: int) -> None:
        ready = self.ready.get(step_id)
        if ready is None or step_id != self.applied_through + 1 or len(self.done[step_id]) < ready.num_microsteps:
            return
        self.version += 1
        self.applied_through = step_id
        self.ready.pop(step_id)
        self.done.pop(step_id)
        self.last_applied = StepApplied(step_id, self.version, 0.1, 1.0, 4 * ready.num_samples, ready.num_samples, 0)
        self.publish(self.last_applied)
        if self.config.root and (step_id + 1) % self.config.every_steps == 0:
            self._save(step_id)
        if step_id == self.config.crash_after_step and not self.config.resume_from:
            if self.config.crash_by_exit:
                os._exit(9)
            self.stop_topology(f"the core died after step {step_id}", 1)

    def _save(self, step_id: int) -> None:
        folder = staging_dir(self.config.root, step_id)
        part = write_file_atomic(folder / "core.json", encode_json(
            {"version": self.version, "weights": self.weights, "trained": self.trained}))
        saved = CorePartsSaved(self.name, step_id, self.version, (part.name,), (part.sha256,), (part.size_bytes,),
                               self.weights)
        write_core_record(folder, saved)
        self.saved_through = step_id
        try:
            self.tell("checkpointer", saved)
        except GyreError:
            pass  # stopping: the checkpointer reads the record instead

    async def on_stop(self) -> None:
        """As the core does: the newest step's part, if not saved yet (actors/cells/core_checkpoint.py)."""
        if self.config.root and self.applied_through > self.saved_through:
            self._save(self.applied_through)


@attrs.frozen
class ScriptedSatelliteConfig:
    trained_log: str = ""
    """Where it appends what it trains (_note_trained)."""
    die_at_grant: int = 0
    """Its process dies (os._exit) as its N-th ClaimGranted with work arrives, holding that claim (0: never)."""
    marker: str = ""
    """File written (the kill's wall time) before dying; it dies only while the file does not exist, so its
    restarted process trains on."""


class ScriptedSatellite(Actor):
    """A train-role satellite: claims micro-steps, "trains" them, reports MicroStepDone to the claimer and the core.
    It announces its (re)start with RoleChanged(previous_role ""), so the claimer re-queues what it held."""

    config_cls = ScriptedSatelliteConfig
    subscriptions = (StepApplied,)

    async def on_start(self) -> None:
        self.version = 0
        self.grants = 0
        self.woken = asyncio.Event()
        self.publish(RoleChanged(self.name, TRAIN, "", "", self.version, 0.0, 0, False))
        self.spawn(self._claim_loop(), "claims")

    @handler(StepApplied)
    def on_step_applied(self, msg: StepApplied) -> None:
        self.version = max(self.version, msg.version)

    @handler(ClaimsOpen)
    def on_claims_open(self, msg: ClaimsOpen) -> None:
        self.woken.set()

    async def _claim_loop(self) -> None:
        while True:
            try:
                grant = await self.ask("claimer", ClaimMicroStep(self.name, self.version), timeout_s=5.0)
            except GyreError:
                await asyncio.sleep(0.5)
                continue
            if grant.step_id < 0:
                self.woken.clear()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self.woken.wait(), min(grant.retry_after_s, 0.2))
                continue
            self.grants += 1
            marker = self.config.marker
            if self.grants == self.config.die_at_grant and marker and not Path(marker).exists():
                Path(marker).write_text(repr(time.time()))
                os._exit(9)  # holding the claim: a real death, no goodbye
            _note_trained(self.config.trained_log, [sample.execution_id for sample in grant.samples])
            done = MicroStepDone(self.name, grant.step_id, grant.microstep_index, "", 0, 0, 4, 0.0)
            self.tell("claimer", done)
            self.tell("core", done)


def fault_topology(root: str, *, steps: int, seed: int, resume_from: str = "", crash_after_step: int = -1,
                   report: str = "", processes: bool = False, satellite: ScriptedSatelliteConfig | None = None,
                   crash_by_exit: bool = False, trained_log: str = "", executor_report: str = "",
                   claimer_journal: bool = True) -> Topology:
    """The run of this benchmark (module docstring); checkpoints under `root`. `processes`: the core (and the
    satellite, if any) in processes of their own, the rest in "control", for a run under the local-process
    launcher."""
    control = "control" if processes else None
    result = Topology("fault-run", seed=seed)
    result.checkpoint_dir = root
    result.add("executor", ScriptedExecutor, ScriptedExecutorConfig(executor_report), process=control)
    result.add("task_source", TaskSource, TaskSourceConfig(
        tasks=TASKS, group_size=GROUP_SIZE, groups_in_flight=3, groups_per_step=1, seed=seed,
        max_groups_ahead_of_training=groups_ahead_for_staleness(STALENESS, 1), stop_topology_when_done=False,
        resume_from=resume_from, group_deadline_s=10.0), process=control)
    result.add("claimer", MicroStepClaimer, ClaimerConfig(groups_per_step=1, group_size=GROUP_SIZE,
                                                          microstep_token_budget=4,  # one sample a micro-step
                                                          staleness=MaxVersionLag(STALENESS), cell_silence_limit_s=5.0,
                                                          liveness_check_s=1.0, resume_from=resume_from,
                                                          step_ready_resend_s=2.0,
                                                          journal_path=str(Path(root) / "claimer.journal")
                                                          if claimer_journal else ""),
               process=control)
    result.add("monitor", RunMonitor, RunMonitorConfig(report_dir=report or root, steps=steps, cells=("core",),
                                                       core_cell="core", progress=False, resume_from=resume_from),
               process=control)
    result.add("checkpointer", Checkpointer, CheckpointerConfig(
        root=root, participants=("task_source", "claimer", "monitor"), keep=2, ask_timeout_s=5.0), process=control)
    if satellite is not None:
        result.add("sat1", ScriptedSatellite, satellite, process="sat1" if processes else None,
                   restart=RestartPolicy("restart", max_restarts=2))
    # After the checkpointer: on one node actors stop in reverse order, so the core leaves its final part before
    # the checkpointer, stopping, looks for it (in a multi-process run they stop at once).
    result.add("core", ScriptedCore, ScriptedCoreConfig(root, 1, resume_from, crash_after_step, crash_by_exit,
                                                        trained_log, 1 if satellite is not None else 0),
               process="core" if processes else None, restart=RestartPolicy("stop_topology"))
    return result


async def _inspect(node) -> dict:
    """The claimer's ledger (asked), and what the scripted actors recorded (read off their instances: they are this
    benchmark's own, and a killed one's record restarts with it)."""
    found: dict[str, Any] = {}
    try:
        found["claimer"] = await node.ask("claimer", StatisticsAsked(), 5.0)
    except GyreError as error:
        found["claimer"] = error
    found["samples_sent"] = getattr(node.slots["executor"].actor, "samples_sent", 0)
    found["trained"] = list(getattr(node.slots["core"].actor, "trained", []))
    return found


def check_invariants(log_path: Path, inspected: dict, fault_times: list[float]) -> dict:
    """The invariants of the module docstring, as counts (0 is good), from the run's log and statistics."""
    codec = Codec()
    versions: list[tuple[float, int, int]] = []
    base_of: dict[int, int] = {}
    stale = 0
    for record in read_log(log_path, codec):
        name = record.type_name.rsplit(".", 1)[-1]
        if name == "StepApplied" and record.envelope.receiver == "monitor":
            msg = record.decode(codec)
            versions.append((record.handled_s, msg.step_id, msg.version))
        elif name == "StepReady" and record.envelope.receiver == "core":
            msg = record.decode(codec)
            base_of[msg.step_id] = msg.base_version
        elif name == "ClaimGranted" and record.envelope.receiver == "core":
            msg: ClaimGranted = record.decode(codec)
            base = base_of.get(msg.step_id)
            if base is not None:
                stale += sum(1 for s in msg.samples if s.min_weight_version < base - STALENESS)
    # A duplicated delivery of the same (step, version) is no regression; a lower version, or a step applied
    # again under another version, is.
    seen: dict[int, int] = {}
    not_monotone = newest = 0
    for _, step, version in versions:
        if seen.get(step, version) != version or version < newest:
            not_monotone += 1
        seen.setdefault(step, version)
        newest = max(newest, version)
    steps = list(seen)
    claimer, trained = inspected.get("claimer"), inspected.get("trained", [])
    row: dict[str, Any] = {"steps_applied": len(set(steps)), "versions_not_monotone": not_monotone,
                           "staleness_violations": stale,
                           "samples_trained_twice": len(trained) - len(set(trained))}
    if isinstance(claimer, Exception):
        row["inspect_error"] = f"claimer: {claimer}"
    elif claimer is not None:
        accounted = (claimer.samples_trained + claimer.samples_skipped + claimer.samples_dropped_stale
                     + claimer.samples_dropped_overflow + claimer.samples_duplicate + claimer.samples_in_flight
                     + claimer.samples_rerolled + claimer.samples_dropped_in_transit + claimer.samples_dropped_restart)
        row["samples_unaccounted"] = claimer.samples_landed - accounted + claimer.samples_lost
        row["samples_trained_twice"] += claimer.samples_trained_twice
        baseline = inspected.get("landed_before", 0)  # a resumed claimer's count goes on from its checkpoint's
        row["samples_lost_in_transit"] = inspected.get("samples_sent", 0) - (claimer.samples_landed - baseline
                                                                             - claimer.samples_duplicate)
    row["samples_dropped_counted"] = (claimer.samples_dropped_in_transit + claimer.samples_dropped_restart
                                      if claimer is not None and not isinstance(claimer, Exception) else 0)
    if fault_times:
        after = [t for t, _, _ in versions if t > fault_times[0]]
        row["recover_s"] = round(after[0] - fault_times[0], 3) if after else None
    return row


def run_case(kind: str, seed: int, *, steps: int = 6, until_s: float = 120.0, plan: str | None = None) -> dict:
    """One fault of `kind` drawn from `seed` (or the given `plan`), the run, its invariants. A run the fault ended
    (exit status 1, a reason saying why) is resumed from its newest checkpoint, fault-free, as `gyre run --resume`
    does; its row then has `resumed` and the resumed run's invariants (the core's record spans both runs)."""
    if plan is None:
        base, links = KINDS[kind]
        plan = random_plan(base, seed, actors=ACTORS, links=links, horizon_s=HORIZON_S)
    with tempfile.TemporaryDirectory(prefix="gyre-faults-") as folder:
        log_path, root = Path(folder) / "events.glog", Path(folder) / "checkpoints"
        run = run_with_faults(fault_topology(str(root), steps=steps, seed=seed), plan,
                              until_s=until_s, log_path=str(log_path), inspect=_inspect)
        row = {"kind": kind, "seed": seed, "plan": plan, "fired": len(run.applied),
               "finished": run.exit_code == 0 and run.reason.startswith("trained"), "reason": run.reason,
               "resumed": False}
        fault_times = [t for t, _, _ in run.applied]
        value = run.value or {}
        checkpoint, _ = load_latest(root) if root.is_dir() else (None, [])
        if not row["finished"] and run.exit_code == 1 and not run.reason.startswith("time limit") and checkpoint:
            log_path = Path(folder) / "resumed.glog"
            before, _ = read_actor_state(checkpoint.path, "claimer")  # before the resumed run prunes it
            resumed = run_with_faults(fault_topology(str(root), steps=steps, seed=seed,
                                                     resume_from=str(checkpoint.path)),
                                      "", until_s=until_s, log_path=str(log_path), inspect=_inspect)
            row.update(resumed=True, finished=resumed.exit_code == 0 and resumed.reason.startswith("trained"),
                       resumed_reason=resumed.reason, resumed_from_step=checkpoint.step_id)
            value, fault_times = resumed.value or {}, [0.0]
            value["landed_before"] = before["counts"].get("samples_landed", 0) - before["counts"].get(
                "samples_duplicate", 0)
        row.update(check_invariants(log_path, value, fault_times))
    if row["finished"]:
        row["outcome"] = "resumed" if row["resumed"] else "kept"
    elif run.exit_code == 1 and not run.reason.startswith("time limit"):
        row["outcome"] = "ended, no checkpoint yet" if not checkpoint else "ended, resume failed"
    else:
        row["outcome"] = "hung"
    return row


# ---- process kills in real time --------------------------------------------------------------------------------
ROLLOUT_CASES = ("agent-mid-call", "scorer-killed")
"""Real deaths on the rollout side, with the lost-call check (benchmarks/fault_rollouts.py)."""
REALTIME_CASES = ("satellite-after-2nd-grant", "core-after-step-2", *ROLLOUT_CASES)
"""Real process deaths (os._exit) under the local-process launcher, the satellite's group in `restart_processes`: a satellite that dies
holding a claim (its process restarts; the claimer re-queues its claim when the new one announces itself) and the
core (its policy is stop_topology: the run ends, and a `--resume` from the newest checkpoint finishes it)."""


def topology(argv: list[str]) -> Topology:
    """The real-time run as a topology file (each process of the local-process launcher re-imports it)."""
    parser = argparse.ArgumentParser(prog="gyre.benchmarks.faults")
    parser.add_argument("--work", required=True)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--satellite-dies-at-grant", type=int, default=-1, help="-1: no satellite")
    parser.add_argument("--core-dies-after-step", type=int, default=-1)
    parser.add_argument("--resume-from", default="")
    args = parser.parse_args(argv)
    work = Path(args.work)
    satellite = None
    if args.satellite_dies_at_grant >= 0:
        satellite = ScriptedSatelliteConfig(str(work / "trained.txt"), args.satellite_dies_at_grant,
                                            str(work / "satellite.killed"))
    return fault_topology(str(work / "checkpoints"), steps=args.steps, seed=args.seed, resume_from=args.resume_from,
                          crash_after_step=args.core_dies_after_step, crash_by_exit=True, processes=True,
                          satellite=satellite, trained_log=str(work / "trained.txt"),
                          executor_report=str(work / "executor.json"), report=str(work / "report"))


def _realtime_invariants(work: Path, log_path: Path, kill_s: float | None, landed_before: int) -> dict:
    """The invariants from what a run in processes leaves: the log, the trainers' record, the claimer's journal."""
    row = check_invariants(log_path, {}, [kill_s] if kill_s is not None else [])
    lines = (work / "trained.txt").read_text().split() if (work / "trained.txt").exists() else []
    row["samples_trained_twice"] = len(lines) - len(set(lines))
    journal = decode_json((work / "checkpoints" / "claimer.journal").read_bytes())
    counts = journal["counts"]
    accounted = sum(counts.get(k, 0) for k in (
        "samples_trained", "samples_skipped", "samples_dropped_stale", "samples_dropped_overflow", "samples_duplicate",
        "samples_rerolled", "samples_dropped_in_transit", "samples_dropped_restart"))
    row["samples_unaccounted"] = counts.get("samples_landed", 0) - accounted  # in flight: counted in dropped_restart
    row["samples_trained_twice"] += counts.get("samples_trained_twice", 0)
    row["samples_dropped_counted"] = (counts.get("samples_dropped_in_transit", 0)
                                      + counts.get("samples_dropped_restart", 0) - journal["in_flight"])
    sent = json.loads((work / "executor.json").read_text())["samples_sent"] if (work / "executor.json").exists() else 0
    row["samples_lost_in_transit"] = sent - (counts.get("samples_landed", 0) - counts.get("samples_duplicate", 0)
                                             - landed_before)
    row["lost_calls"] = None  # no agent calls in this run
    return row


def run_realtime_case(case: str, *, steps: int = 6, timeout_s: float = 120.0) -> dict:
    """One real-time case (REALTIME_CASES) under the local-process launcher; a run the kill ended is resumed."""
    from gyre.runtime.launch import LocalProcessLauncher, RunOptions

    if case in ROLLOUT_CASES:
        from gyre.benchmarks.fault_rollouts import run_rollout_case

        return run_rollout_case(case)
    if case not in REALTIME_CASES:
        raise ValueError(f"unknown real-time case {case!r}; the cases are {', '.join(REALTIME_CASES)}")
    with tempfile.TemporaryDirectory(prefix="gyre-faults-rt-") as folder:
        work = Path(folder)
        argv = ["--work", folder, "--steps", str(steps)]
        argv += ["--satellite-dies-at-grant", "2"] if case.startswith("satellite") else ["--core-dies-after-step", "2"]
        started = time.monotonic()
        launcher = LocalProcessLauncher(__file__, tuple(argv), restart_processes=("sat1",))
        log_path = work / "events.glog"
        result = launcher.run(topology(argv), RunOptions(log_path=str(log_path), until_s=timeout_s))
        marker = work / "satellite.killed"
        kill_s = float(marker.read_text()) if marker.exists() else None
        row = {"kind": case, "seed": 0, "plan": case, "fired": int(marker.exists() or result.exit_code != 0),
               "finished": result.exit_code == 0 and result.reason.startswith("trained"), "reason": result.reason,
               "resumed": False}
        landed_before = 0
        if not row["finished"] and result.exit_code == 1:
            checkpoint, _ = load_latest(work / "checkpoints")
            if checkpoint is not None:
                before, _ = read_actor_state(checkpoint.path, "claimer")
                landed_before = before["counts"].get("samples_landed", 0) - before["counts"].get("samples_duplicate",
                                                                                                    0)
                kill_s = max(r.handled_s for r in read_log(log_path, Codec()))  # the run's last record
                (work / "executor.json").unlink(missing_ok=True)
                log_path = work / "resumed.glog"
                resumed = ["--work", folder, "--steps", str(steps), "--resume-from", str(checkpoint.path)]
                again = LocalProcessLauncher(__file__, tuple(resumed)).run(
                    topology(resumed), RunOptions(log_path=str(log_path), until_s=timeout_s))
                row.update(resumed=True, finished=again.exit_code == 0 and again.reason.startswith("trained"),
                           resumed_reason=again.reason, resumed_from_step=checkpoint.step_id)
        row.update(_realtime_invariants(work, log_path, kill_s, landed_before))
        row["wall_s"] = round(time.monotonic() - started, 1)
        if row["finished"]:
            row["outcome"] = "resumed" if row["resumed"] else "kept"
        else:
            row["outcome"] = "hung" if "time limit" in row.get("resumed_reason", row["reason"]) else "ended"
    return row


COLUMNS = ("samples_lost_in_transit", "samples_unaccounted", "samples_trained_twice", "versions_not_monotone",
           "staleness_violations", "executions_without_one_outcome", "groups_without_group_done")
"""The invariants' columns: each must be 0 in every case (the last two: the rollout cases)."""


def _summary(mine: list[dict]) -> dict:
    recover = sorted(r["recover_s"] for r in mine if r.get("recover_s") is not None)
    outcomes: dict[str, int] = {}
    for r in mine:
        outcomes[r["outcome"]] = outcomes.get(r["outcome"], 0) + 1
    calls = [r["lost_calls"] for r in mine if r.get("lost_calls") is not None]
    return {
        "cases": len(mine), "fired": sum(1 for r in mine if r["fired"]),
        "finished": sum(1 for r in mine if r["finished"]), "outcomes": outcomes,
        **{c: sum(r.get(c) or 0 for r in mine) for c in COLUMNS},
        "samples_dropped_counted": sum(r.get("samples_dropped_counted") or 0 for r in mine),
        "lost_calls": sum(calls) if calls else None,
        "recover_s_median": recover[len(recover) // 2] if recover else None,
    }


def sweep(kinds: tuple[str, ...], seeds: int, steps: int = 6, realtime: tuple[str, ...] = ()) -> dict:
    """Every kind x seed in virtual time, then each real-time case once."""
    rows = [run_case(kind, seed, steps=steps) for kind in kinds for seed in range(seeds)]
    rows += [run_realtime_case(case, steps=steps) for case in realtime if case not in ROLLOUT_CASES]
    rollouts = [case for case in realtime if case in ROLLOUT_CASES]
    if rollouts:
        from gyre.benchmarks.fault_rollouts import run_rollout_case
        from gyre.engines.model_format import init_model_dir

        with tempfile.TemporaryDirectory(prefix="gyre-faults-model-") as folder:
            model_dir = str(init_model_dir(Path(folder), preset="tiny", seed=0))  # one tiny model for the cases
            rows += [run_rollout_case(case, model_dir) for case in rollouts]
    by_kind = {kind: _summary([r for r in rows if r["kind"] == kind]) for kind in (*kinds, *realtime)}
    return {"kinds": list(kinds), "realtime": list(realtime), "seeds": seeds, "steps": steps, "by_kind": by_kind,
            "cases": rows}


def _handle(args: argparse.Namespace) -> int:
    from gyre.runtime.logs import configure_logging

    configure_logging("critical")  # the faults make the actors log errors by design: the table is the output
    os.environ["GYRE_LOG_LEVEL"] = "critical"  # and the real-time runs' processes, which inherit it
    kinds = tuple(k for k in args.kinds.split(",") if k)
    realtime = tuple(k for k in args.realtime.split(",") if k)
    unknown = sorted(set(kinds) - set(KINDS)) + sorted(set(realtime) - set(REALTIME_CASES))
    if unknown:
        print(f"gyre bench faults: unknown kinds {unknown}; the kinds are {', '.join(KINDS)}; the real-time cases "
              f"{', '.join(REALTIME_CASES)}", file=sys.stderr)
        return 2
    result = sweep(kinds, args.seeds, args.steps, realtime)
    if args.json:
        print(json.dumps(result, indent=1, default=str))
        return 0
    print(f"{'kind':<26} {'cases':>5} {'fired':>5} {'done':>5} {'transit':>7} {'unacc':>5} {'twice':>5} "
          f"{'mono':>4} {'stale':>5} {'dropped':>7} {'calls':>5} {'recover_s':>9}  outcomes")
    for kind, row in result["by_kind"].items():
        calls = "-" if row["lost_calls"] is None else row["lost_calls"]
        outcomes = ", ".join(f"{k} {v}" for k, v in sorted(row["outcomes"].items()))
        print(f"{kind:<26} {row['cases']:>5} {row['fired']:>5} {row['finished']:>5} "
              f"{row['samples_lost_in_transit']:>7} {row['samples_unaccounted']:>5} {row['samples_trained_twice']:>5} "
              f"{row['versions_not_monotone']:>4} {row['staleness_violations']:>5} "
              f"{row['samples_dropped_counted']:>7} {calls!s:>5} {row['recover_s_median']!s:>9}  {outcomes}")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("faults", help="a training run under seeded faults (virtual time, and real process "
                              "kills), invariants checked")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--seeds", type=int, default=5, help="seeds per fault kind (default 5)")
    p.add_argument("--steps", type=int, default=6, help="optimizer steps each run trains (default 6)")
    p.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated ({', '.join(KINDS)})")
    p.add_argument("--realtime", default=",".join(REALTIME_CASES),
                   help=f"real-time process kills, comma-separated ({', '.join(REALTIME_CASES)}); '' for none")
    p.set_defaults(func=_handle)
