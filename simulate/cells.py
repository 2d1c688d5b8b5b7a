"""Emulated cells: actors that speak a cell's messages (actors/cells/cell.py) over a cost model instead of GPUs.

To the scheduler, the micro-step claimer and the task source they are cells: they announce themselves with
RoleChanged, report LoadReport, obey SwitchRole (taking `CellModel.rollout_to_train_s` / `train_to_rollout_s`),
claim micro-steps with ClaimMicroStep, send MicroStepDone, release claims when they switch away; the core collects
a step's MicroStepDone after StepReady, applies the optimizer step and publishes StepApplied and WeightsPublished.
A rollout cell runs its sessions in an `Engine` (engine.py); a cell that receives StepApplied loads the new weights
(`weight_sync_s`, generation paused) before it serves or trains with them.

What is emulated is only the time things take (hardware.py); what is decided (who trains, which micro-step, which
step a sample joins, when a step is fixed) is the real actors' business.
"""

from __future__ import annotations

from typing import Any

import attrs

from gyre.messages.cells import ROLLOUT, SWITCHING, TRAIN, LoadReport, RoleChanged, SwitchRole
from gyre.messages.training import (
    ClaimMicroStep,
    ClaimsOpen,
    MicroStepDone,
    ReleaseMicroStep,
    StepApplied,
    StepReady,
    WeightsPublished,
)
from gyre.runtime import Actor, handler
from gyre.simulate.engine import Engine, Session
from gyre.simulate.hardware import CellModel
from gyre.simulate.record import RunRecord

__all__ = ["EmulatedCell", "EmulatedCellConfig", "AdmitSessions", "SessionsOut", "CellTick", "ENGINE_COUNTERS"]

ENGINE_COUNTERS = ("decode_s", "prefill_s", "paused_s", "tools_s", "empty_s", "decoding_s", "decoding_sequence_s",
                   "decoding_kv_token_s", "prefill_started_tokens", "evicted_prefill_tokens", "moved_prefill_tokens",
                   "output_tokens")
"""The engine's cumulative counters (engine.py) a cell books as "rollout.<name>" for its time in the rollout role."""


@attrs.frozen
class AdmitSessions:
    """Agents -> emulated cell: run these sessions (in-process only: sessions are mutable records handed over)."""

    sessions: tuple[Session, ...]
    """The sessions, now this cell's."""


@attrs.frozen
class SessionsOut:
    """Emulated cell -> agents: sessions that finished, and sessions handed back because the cell left rollout."""

    cell: str
    """The cell."""
    finished: tuple[Session, ...]
    """Executions whose reward is in."""
    returned: tuple[Session, ...] = ()
    """Live sessions to place elsewhere."""


@attrs.frozen
class HandOverSessions:
    """Agents -> emulated cell: hand back up to `count` sessions between calls (their KV moves with them)."""

    count: int
    """Sessions wanted."""


@attrs.frozen
class CellTick:
    """The cell's own timer: advance the engine, report load."""

    token: int = 0
    """The tick chain it belongs to: a cell with no session ticks only at its report interval, and an admission
    starts a new chain at `tick_s` (the old chain's ticks are then ignored)."""


@attrs.frozen
class _SwitchDone:
    role: str
    started_s: float
    migrated: int


@attrs.frozen
class _MicroStepComputed:
    generation: int
    step_id: int
    microstep_index: int
    num_tokens: int


@attrs.frozen
class _ClaimAgain:
    generation: int
    token: int
    """The claim timer it belongs to: a ClaimsOpen supersedes a pending poll."""


@attrs.frozen
class _WeightsLoaded:
    version: int


@attrs.frozen
class _Apply:
    step_id: int


@attrs.frozen
class _Booted:
    pass


@attrs.frozen
class EmulatedCellConfig:
    """One emulated cell."""

    model: CellModel
    """Its cost model."""
    initial_role: str = ROLLOUT
    """Role at start."""
    is_core: bool = False
    """The core applies the optimizer step."""
    mean_context_tokens: float = 16384.0
    """Context a session holds on average: `capacity_requests` = KV tokens / this."""
    tick_s: float = 2.0
    """How often the engine is advanced to the clock and finished sessions are handed on (the resolution of a
    session's end; finer ticks cost run time, see engine.py)."""
    report_every_s: float = 10.0
    """A LoadReport at least this often (well inside the scheduler's 120 s silence limit)."""
    claimer: str = "claimer"
    core: str = "cell00"
    agents: str = "agents"
    stream_microsteps: bool = True
    """False: claim only once the step's samples are fixed (StepReady): the non-streaming baseline."""
    last_step_id: int = 19
    """The core ends the run after applying this step."""
    record: Any = None
    """A RunRecord the simulate harness reads after the run (roles over time, busy time)."""
    wake_on_claims_open: bool = True
    """Claim at once on the claimer's ClaimsOpen, as real cells do; False: only poll (`gyre replay --control-plane`
    of a run recorded before wake-ups, whose cells polled)."""
    boot_s: float = 0.0
    """Seconds from the cell's start to its first RoleChanged (a recorded cell's engine or trainer start-up, in
    `gyre replay --control-plane`); it is silent until then."""


class EmulatedCell(Actor):
    """A cell over a cost model (module docstring)."""

    config_cls = EmulatedCellConfig
    subscriptions = (StepApplied, StepReady)

    async def on_start(self) -> None:
        cfg = self.config
        self.model: CellModel = cfg.model
        self.role = cfg.initial_role
        self.target_role = ""
        self.engine = Engine(self.model, self.clock.now())
        self.version = 0
        self.loading_until_s = 0.0
        self.capacity = self.model.capacity_sessions(cfg.mean_context_tokens)
        # Read at every report; kv_capacity_tokens is a property computed anew each time (the model is frozen).
        self.kv_blocks = max(1, self.model.kv_capacity_tokens // 64)
        self.generation = 0  # bumps on every role change: stale timers of the old role are ignored
        self.claim: tuple[int, int] | None = None
        self.claim_at_s: float | None = None
        """When the pending claim timer fires (None: none pending)."""
        self.claim_token = 0
        self.step_ready: dict[int, int] = {}
        self.done_microsteps: dict[int, set[int]] = {}
        self.satellite_contributed: set[int] = set()
        self.applying = -1
        self.applied_step = -1
        self.last_report_s = -1e9
        self.record: RunRecord | None = cfg.record
        self.tick_token = 0
        self.tick = CellTick(0)  # the current chain's tick, sent again and again (messages are immutable)
        self.fast_ticks = False
        # Where the time goes (RunRecord.seconds; simulate/accounting.py): the engine's counters when the cell last
        # entered rollout, and in the train role what the cell has been doing since when.
        self.engine_seen: tuple[float, ...] = ()
        self.train_kind = ""
        self.train_since_s = 0.0
        if cfg.boot_s > 0:
            self.target_role = cfg.initial_role  # not serving nor training until it has booted
            self._note_role(SWITCHING)
            self.send_later(cfg.boot_s, _Booted())
            return
        self._announce()

    @handler(_Booted)
    def on_booted(self, msg: _Booted) -> None:
        self.target_role = ""
        self.engine.now_s = self.clock.now()
        self._announce()

    def _announce(self) -> None:
        cfg = self.config
        self._note_role(self.role)
        self._entered_role()
        self.publish(RoleChanged(self.name, self.role, "", "", self.version, cfg.boot_s, 0, cfg.is_core))
        self._report(force=True)
        self._schedule_tick()
        if self.role == TRAIN:
            self._claim_soon(0.0)

    # ---- reports --------------------------------------------------------------------------------------------------
    def _note_role(self, role: str) -> None:
        if self.record is not None:
            self.record.role(self.name, self.clock.now(), role)

    def _entered_role(self) -> None:
        """Start counting the role the cell has just settled in."""
        if self.record is None:
            return
        if self.role == ROLLOUT:
            self.engine_seen = tuple(getattr(self.engine, name) for name in ENGINE_COUNTERS)
        self._book_train()

    def _leaving_role(self) -> None:
        """Book the role the cell is leaving (its engine advanced to now, or the run ending)."""
        if self.record is None:
            return
        if self.role == ROLLOUT and self.engine_seen:
            for name, seen in zip(ENGINE_COUNTERS, self.engine_seen):
                self.record.account("rollout." + name, getattr(self.engine, name) - seen)
            self.engine_seen = ()
        self._book_train(leaving=True)

    def _book_train(self, leaving: bool = False) -> None:
        """In the train role: book the time since the last mark under what the cell was doing, and mark now with
        what it does from now on. Called wherever that can change (a claim, the optimizer step, a weight load, a
        step fixed or applied, a role change)."""
        if self.record is None:
            return
        now = self.clock.now()
        if self.train_kind:
            self.record.account(self.train_kind, now - self.train_since_s)
        self.train_since_s = now
        if leaving or self.role != TRAIN or self.target_role:
            self.train_kind = ""
        elif self.claim is not None:
            self.train_kind = "train.compute"
        elif self.config.is_core and self.applying > self.applied_step:
            self.train_kind = "train.optimizer"
        elif now < self.loading_until_s:
            self.train_kind = "train.weight_sync"
        elif self.applied_step + 1 in self.step_ready:
            self.train_kind = "train.idle_step_fixed"
        else:
            self.train_kind = "train.idle_step_filling"

    async def on_stop(self) -> None:
        if not self.target_role:  # a switch under way was booked when it began; the harness counts switching
            self._leaving_role()

    def _report(self, force: bool = False) -> None:
        now = self.clock.now()
        if not force and now - self.last_report_s < self.config.report_every_s:
            return
        self.last_report_s = now
        engine = self.engine
        role = SWITCHING if self.target_role else self.role
        kv_blocks = self.kv_blocks
        free = max(0, kv_blocks - int(engine.held_context_tokens // 64))
        rolling = self.role == ROLLOUT and not self.target_role
        self.publish(LoadReport(
            cell=self.name, role=role, engine_url="", live_sessions=len(engine.sessions),
            running_requests=engine.running, waiting_requests=engine.waiting, free_kv_blocks=free,
            total_kv_blocks=kv_blocks, capacity_requests=self.capacity if rolling or role == TRAIN else 0,
            weight_version=self.version, time_s=now,
        ))

    @handler(CellTick)
    def on_tick(self, msg: CellTick) -> None:
        if msg.token != self.tick_token:
            return  # a chain replaced by a faster one
        self._advance()
        self._report(force=not self.fast_ticks)  # a slow chain ticks at the report interval
        self._schedule_tick()

    def _schedule_tick(self) -> None:
        """Next tick: at `tick_s` while the engine holds sessions (their ends are seen at that resolution), else at
        the report interval: a cell with no session has nothing to advance (a training cell, an empty rollout cell),
        and ticking it every `tick_s` was most of a long run's events."""
        self.fast_ticks = bool(self.engine.sessions)
        delay = self.config.tick_s if self.fast_ticks else max(self.config.tick_s, self.config.report_every_s)
        self.send_later(delay, self.tick)

    def _fast_ticks_now(self) -> None:
        if not self.fast_ticks and self.engine.sessions:
            self.tick_token += 1
            self.tick = CellTick(self.tick_token)
            self.fast_ticks = True
            self.send_later(self.config.tick_s, self.tick)

    def _advance(self) -> None:
        now = self.clock.now()
        before = self.engine.busy_s
        finished = self.engine.advance(now)
        if self.record is not None:
            self.record.busy(self.name, self.engine.busy_s - before)
        if finished:
            self.tell(self.config.agents, SessionsOut(self.name, tuple(finished)))

    # ---- rollout --------------------------------------------------------------------------------------------------
    @handler(AdmitSessions)
    def on_admit(self, msg: AdmitSessions) -> None:
        self._advance()
        if self.role != ROLLOUT or self.target_role:
            # It left rollout after the agents placed these: hand them straight back.
            self.tell(self.config.agents, SessionsOut(self.name, (), msg.sessions))
            return
        self.engine.admit(msg.sessions)
        self._report(force=True)
        self._fast_ticks_now()

    @handler(HandOverSessions)
    def on_hand_over(self, msg: HandOverSessions) -> None:
        if self.role != ROLLOUT or self.target_role:
            return
        self._advance()
        sessions = self.engine.take_idle(msg.count)
        if sessions:
            self.tell(self.config.agents, SessionsOut(self.name, (), tuple(sessions)))
            self._report(force=True)

    # ---- role switches --------------------------------------------------------------------------------------------
    @handler(SwitchRole)
    def on_switch(self, msg: SwitchRole) -> None:
        if self.target_role or msg.role == self.role:
            self.log.warning("switch_ignored", role=msg.role, current=self.role, target=self.target_role)
            return
        self._advance()
        self._leaving_role()
        now = self.clock.now()
        self.generation += 1
        self.target_role = msg.role
        migrated = 0
        if self.role == ROLLOUT:
            sessions = self.engine.take_all(keep_kv=msg.migrate_sessions)
            migrated = len(sessions) if msg.migrate_sessions else 0
            if sessions:
                self.tell(self.config.agents, SessionsOut(self.name, (), tuple(sessions)))
            seconds = self.model.rollout_to_train_s
        else:
            if self.claim is not None:
                step_id, index = self.claim
                self.tell(self.config.claimer, ReleaseMicroStep(self.name, step_id, index))
                self.claim = None
            seconds = self.model.train_to_rollout_s
        self._note_role(SWITCHING)
        self._report(force=True)
        self.send_later(seconds, _SwitchDone(msg.role, now, migrated))

    @handler(_SwitchDone)
    def on_switch_done(self, msg: _SwitchDone) -> None:
        previous = self.role
        self.role = msg.role
        self.target_role = ""
        self.generation += 1
        self.claim_at_s = None  # the old role's claim timer, if any, is ignored (generation)
        now = self.clock.now()
        self.engine.now_s = now
        self.engine.pause(self.loading_until_s)
        self._note_role(self.role)
        self._entered_role()
        self.publish(RoleChanged(self.name, self.role, previous, "", self.version, now - msg.started_s, msg.migrated,
                                 self.config.is_core))
        self._report(force=True)
        if self.role == TRAIN:
            self._claim_soon(0.0)
            self._maybe_apply()

    # ---- training -------------------------------------------------------------------------------------------------
    def _claim_soon(self, delay_s: float, wake: bool = False) -> None:
        """Claim in `delay_s` (not before the weights are loaded) unless a claim timer is pending: a real cell that
        pauses after a refused claim pauses on, whatever happens, until its pause ends or (`wake`) a ClaimsOpen
        cuts it short (actors/cells/train_role.py, ClaimLoop)."""
        now = self.clock.now()
        delay_s = max(delay_s, self.loading_until_s - now, 0.0)
        if self.claim_at_s is not None and not (wake and now + delay_s < self.claim_at_s):
            return
        self.claim_at_s = now + delay_s
        self.claim_token += 1
        self.send_later(delay_s, _ClaimAgain(self.generation, self.claim_token))

    @handler(ClaimsOpen)
    def on_claims_open(self, msg: ClaimsOpen) -> None:
        if self.config.wake_on_claims_open and self.role == TRAIN and not self.target_role:
            self._claim_soon(0.0, wake=True)

    @handler(_ClaimAgain)
    async def on_claim_again(self, msg: _ClaimAgain) -> None:
        if msg.token != self.claim_token:
            return  # superseded by a sooner claim timer
        self.claim_at_s = None
        if msg.generation != self.generation or self.role != TRAIN or self.target_role or self.claim is not None:
            return
        now = self.clock.now()
        if now < self.loading_until_s:
            self._claim_soon(0.0)
            return
        step = self.applied_step + 1
        if not self.config.stream_microsteps and step not in self.step_ready:
            return  # StepReady will call again
        granted = await self.ask(self.config.claimer, ClaimMicroStep(self.name, self.version))
        if msg.generation != self.generation or self.role != TRAIN or self.target_role:
            if granted.step_id >= 0:
                self.tell(self.config.claimer, ReleaseMicroStep(self.name, granted.step_id, granted.microstep_index))
            return
        if granted.step_id < 0:
            self._claim_soon(granted.retry_after_s)
            return
        tokens = sum(len(sample.token_ids) for sample in granted.samples)
        seconds = self.model.train_s(tokens)
        self.claim = (granted.step_id, granted.microstep_index)
        self._book_train()
        if self.record is not None:
            self.record.busy(self.name, seconds)
            self.record.trained(tokens)
        self.send_later(seconds, _MicroStepComputed(self.generation, granted.step_id, granted.microstep_index, tokens))

    @handler(_MicroStepComputed)
    def on_computed(self, msg: _MicroStepComputed) -> None:
        if msg.generation != self.generation or self.claim != (msg.step_id, msg.microstep_index):
            return  # released when the cell switched away; the claimer re-queued it
        self.claim = None
        self._book_train()
        done = MicroStepDone(self.name, msg.step_id, msg.microstep_index, "", 0, 0, msg.num_tokens, 0.0)
        self.tell(self.config.claimer, done)
        if self.config.is_core:
            self._core_done(done)
        else:
            self.tell(self.config.core, done)
        self._claim_soon(0.0)

    @handler(MicroStepDone)
    def on_microstep_done(self, msg: MicroStepDone) -> None:
        if self.config.is_core:
            self._core_done(msg)

    def _core_done(self, msg: MicroStepDone) -> None:
        if msg.step_id <= self.applied_step:
            return
        self.done_microsteps.setdefault(msg.step_id, set()).add(msg.microstep_index)
        if msg.cell != self.name:
            self.satellite_contributed.add(msg.step_id)
        self._maybe_apply()

    @handler(StepReady)
    def on_step_ready(self, msg: StepReady) -> None:
        self.step_ready[msg.step_id] = msg.num_microsteps
        self._book_train()
        if self.config.is_core:
            self._maybe_apply()
        if self.role == TRAIN and not self.target_role:
            self._claim_soon(0.0)

    def _maybe_apply(self) -> None:
        """The core: once every micro-step of the next step is in, and the core trains, apply it."""
        step = self.applied_step + 1
        if not self.config.is_core or self.applying == step or step not in self.step_ready:
            return
        if self.role != TRAIN or self.target_role:
            return
        if len(self.done_microsteps.get(step, ())) < self.step_ready[step]:
            return
        self.applying = step
        self._book_train()
        seconds = self.model.optimizer_step_s
        if step in self.satellite_contributed:
            seconds += self.model.gradient_reduce_s
        self.send_later(seconds, _Apply(step))

    @handler(_Apply)
    def on_apply(self, msg: _Apply) -> None:
        self.version += 1
        self.engine.weight_version = self.version
        self.applied_step = msg.step_id
        self.done_microsteps.pop(msg.step_id, None)
        self.step_ready.pop(msg.step_id, None)
        self._book_train()
        now = self.clock.now()
        self.log.info("step_applied", step=msg.step_id, version=self.version)
        if self.record is not None:
            self.record.step(msg.step_id, now)
        applied = StepApplied(msg.step_id, self.version, 0.0, 0.0, 0, 0, 0)
        self.publish(WeightsPublished(self.version, self.name, 0, int(self.model.weight_bytes)))
        self.publish(applied)
        if msg.step_id >= self.config.last_step_id:
            self.stop_topology(f"emulation: {msg.step_id + 1} steps applied")
            return
        self._claim_soon(0.0)
        self._maybe_apply()

    @handler(StepApplied)
    def on_step_applied(self, msg: StepApplied) -> None:
        if self.config.is_core:
            return  # its own
        self._advance()
        self.applied_step = max(self.applied_step, msg.step_id)
        self.step_ready.pop(msg.step_id, None)
        until = self.clock.now() + self.model.weight_sync_s
        self.loading_until_s = until
        self._book_train()
        self.engine.pause(until)
        self.send_later(self.model.weight_sync_s, _WeightsLoaded(msg.version))

    @handler(_WeightsLoaded)
    def on_weights_loaded(self, msg: _WeightsLoaded) -> None:
        self._advance()
        self.version = max(self.version, msg.version)
        self.engine.weight_version = self.version
        self._book_train()
        if self.role == TRAIN and not self.target_role:
            self._claim_soon(0.0)
