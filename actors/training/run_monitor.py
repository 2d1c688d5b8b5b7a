"""The run monitor: watches a training run's events, shows progress, ends the run after N steps, writes run.json.

It reacts only to published events (roles, steps, finished groups), so any topology can add it without other
actors knowing. The report (pictures, summary) is drawn from run.json afterwards, outside the actor system.

Checkpoints (issue 28): its history (steps, groups, role changes, the run's elapsed time) is its part of a
checkpoint. Resumed (`resume_from`), it takes the history back up to the checkpoint's step, its clock goes on from
the elapsed time recorded then (the time between that checkpoint and the crash is not counted), and run.json gains a
`resumes` entry; the run still ends after `steps` steps in all.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import attrs

from gyre.messages.cells import RoleChanged, SwitchRole
from gyre.messages.checkpoints import CheckpointAsked, CheckpointCommitted, CheckpointState
from gyre.messages.executions import GroupDone
from gyre.messages.samples import LandingsLost
from gyre.messages.training import StepApplied
from gyre.runtime import Actor, handler
from gyre.runtime.checkpoint import encode_json, read_actor_state


@attrs.frozen
class RunMonitorConfig:
    """What to watch for and where to write."""

    report_dir: str
    """Folder for run.json."""
    steps: int
    """End the run after this many optimizer steps."""
    cells: tuple[str, ...]
    """Cell names, in display order."""
    core_cell: str = ""
    """The core's name, recorded in run.json for tools that vary the split of cells (gyre bench policies)."""
    progress: bool = True
    """Draw a progress bar on stderr."""
    resume_from: str = ""
    """A committed checkpoint folder whose history this monitor continues ("" = start afresh)."""


class RunMonitor(Actor):
    """Collects the run's timeline; stops the topology when the configured number of steps has been applied."""

    config_cls = RunMonitorConfig
    subscriptions = (RoleChanged, StepApplied, GroupDone, SwitchRole, CheckpointCommitted, LandingsLost)

    async def on_start(self) -> None:
        self.started_s = self.clock.now()
        self.roles: dict[str, str] = {cell: "starting" for cell in self.config.cells}
        self.role_changes: list[dict] = []
        self.steps: list[dict] = []
        self.groups: list[dict] = []
        self.switch_requests = 0
        self.checkpoints: list[dict] = []
        # Samples the claimer refused as too stale since the last step (its LandingsLost "stale"): the core never
        # sees them, so StepApplied cannot count them.
        self.stale_samples = 0
        self.resumes: list[dict] = []
        if self.config.resume_from:
            state, checkpoint = await self.offload(read_actor_state, self.config.resume_from, self.name)
            self._restore(state, checkpoint.step_id, int(checkpoint.manifest["weight_version"]))
        self.bar = None
        if self.config.progress:
            from tqdm import tqdm

            self.bar = tqdm(total=self.config.steps, initial=len(self.steps), desc="GSPO steps", unit="step",
                            file=sys.stderr, dynamic_ncols=True)
        self._write()

    def _state(self) -> dict:
        return {"elapsed_s": self._elapsed(), "steps": self.steps, "groups": self.groups,
                "role_changes": self.role_changes, "switch_requests": self.switch_requests,
                "checkpoints": self.checkpoints, "resumes": self.resumes}

    def _restore(self, state: dict, step_id: int, version: int) -> None:
        elapsed = float(state["elapsed_s"])
        self.started_s = self.clock.now() - elapsed
        self.steps = [step for step in state["steps"] if step["step"] <= step_id]
        self.groups = list(state["groups"])
        self.role_changes = list(state["role_changes"])
        self.switch_requests = int(state["switch_requests"])
        self.checkpoints = [c for c in state.get("checkpoints", []) if c["step"] <= step_id]
        self.resumes = [*state.get("resumes", []), {"t_s": elapsed, "from_step": step_id, "version": version}]

    @handler(CheckpointAsked)
    def on_checkpoint_asked(self, msg: CheckpointAsked) -> CheckpointState:
        return CheckpointState(self.name, msg.step_id, encode_json(self._state()), ())

    @handler(CheckpointCommitted)
    def on_checkpoint(self, msg: CheckpointCommitted) -> None:
        self.checkpoints.append({"t_s": self._elapsed(), "step": msg.step_id, "version": msg.weight_version,
                                 "seconds": msg.seconds, "groups_to_reroll": msg.groups_to_reroll})

    def _elapsed(self) -> float:
        return self.clock.now() - self.started_s

    def _refresh(self) -> None:
        if self.bar is None:
            return
        recent = self.groups[-8:]
        reward = sum(g["mean_reward"] for g in recent) / len(recent) if recent else float("nan")
        success = sum(g["success_rate"] for g in recent) / len(recent) if recent else float("nan")
        roles = " ".join(f"{cell}:{self.roles[cell][:5]}" for cell in self.config.cells)
        self.bar.set_postfix_str(f"reward {reward:.2f} success {success:.2f} | {roles}", refresh=True)

    @handler(RoleChanged)
    def on_role(self, msg: RoleChanged) -> None:
        self.roles[msg.cell] = msg.role
        self.role_changes.append({
            "t_s": self._elapsed(), "cell": msg.cell, "role": msg.role, "previous": msg.previous_role,
            "switch_s": msg.switch_s, "sessions_migrated": msg.sessions_migrated,
        })
        self._refresh()

    @handler(SwitchRole)
    def on_switch_request(self, msg: SwitchRole) -> None:
        self.switch_requests += 1

    @handler(GroupDone)
    def on_group(self, msg: GroupDone) -> None:
        self.groups.append({
            "t_s": self._elapsed(), "group_id": msg.group_id, "landed": msg.landed, "mean_reward": msg.mean_reward,
            "success_rate": msg.success_rate, "scored": msg.num_scored, "dropped": msg.num_dropped,
        })
        self._refresh()

    @handler(LandingsLost)
    def on_landings_lost(self, msg: LandingsLost) -> None:
        if msg.why == "stale":
            self.stale_samples += msg.samples

    @handler(StepApplied)
    def on_step(self, msg: StepApplied) -> None:
        if self.steps and msg.step_id <= self.steps[-1]["step"]:
            # A second copy, or a step older than the newest: recorded once (found by gyre bench faults).
            self.log.warning("step_applied_again_ignored", step=msg.step_id, newest=self.steps[-1]["step"])
            return
        self.steps.append({
            "t_s": self._elapsed(), "step": msg.step_id, "version": msg.version, "loss": msg.loss,
            "grad_norm": msg.grad_norm, "tokens": msg.num_tokens, "samples": msg.num_samples,
            "stale_dropped": msg.stale_samples_dropped + self.stale_samples, "skipped": msg.skipped,
        })
        self.stale_samples = 0
        if self.bar is not None:
            self.bar.update(1)
        self._refresh()
        self._write()
        if len(self.steps) >= self.config.steps:
            self.stop_topology(f"trained {len(self.steps)} steps")

    async def on_stop(self) -> None:
        if self.bar is not None:
            self.bar.close()
        self._write()

    def _write(self) -> None:
        folder = Path(self.config.report_dir)
        folder.mkdir(parents=True, exist_ok=True)
        record = {
            "cells": list(self.config.cells), "core_cell": self.config.core_cell, "elapsed_s": self._elapsed(),
            "steps": self.steps,
            "groups": self.groups, "role_changes": self.role_changes, "switch_requests": self.switch_requests,
            "checkpoints": self.checkpoints, "resumes": self.resumes,
        }
        # Whole or not at all: a run killed mid-write keeps the previous run.json (a resume continues from it).
        temp = folder / ".run.json.tmp"
        temp.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
        os.replace(temp, folder / "run.json")
