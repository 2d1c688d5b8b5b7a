"""The scheduler: hosts a scheduling policy, keeps the view it decides on, and sends SwitchRole to cells.

It owns nothing but its view of the load. Cells announce themselves with RoleChanged (at start and after every
switch) and keep it current with LoadReport; the proxy's CallsWaitingForCell counts the calls no rollout cell takes;
the micro-step claimer's TrainingBacklog, StepReady and StepApplied describe the training work. After every such
event, and on a timer (dwell times and grace periods expire without events), it builds an immutable SchedulerView and
asks the policy. Every decision is checked against the policy contract before it is sent: a policy bug fails the
scheduler loudly rather than sending a cell a nonsense switch.

A switch is pending from the SwitchRole until the cell's RoleChanged; meanwhile the cell shows as "switching" to the
policy, which may not decide about it. A switch that no RoleChanged confirms within `switch_timeout_s` is given up
(the cell's own reports are then taken as truth) so that a lost cell does not freeze the view.
"""

from __future__ import annotations

import collections
from typing import Any

import attrs

from gyre.actors.errors import ActorError
from gyre.messages.cells import ROLLOUT, SWITCHING, TRAIN, LoadReport, RoleChanged, SwitchRole
from gyre.messages.proxy import CallsWaitingForCell
from gyre.messages.scheduling import (
    SchedulerStatistics,
    SchedulerTick,
    TrainingBacklog,
)
from gyre.messages.training import StepApplied, StepReady
from gyre.policies.scheduling import (
    BacklogView,
    CellView,
    ElasticPolicy,
    PolicyContractError,
    SchedulerView,
    SchedulingPolicy,
    check_decisions,
)
from gyre.runtime import Actor, UnknownAddress, handler


MEASURED_WINDOW = 16
"""Recent micro-steps and switches (per direction) whose mean the view reports."""


class SchedulerConfigError(ActorError, ValueError):
    """A scheduler config that cannot work."""


def _check_policy(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if not attrs.has(type(value)) or not isinstance(value, SchedulingPolicy):
        raise SchedulerConfigError(f"policy must be a SchedulingPolicy attrs object, got {type(value).__qualname__}")


@attrs.frozen
class SchedulerConfig:
    """Which policy, and how often to look again."""

    policy: Any = attrs.field(default=ElasticPolicy(), validator=_check_policy)
    """A SchedulingPolicy (ElasticPolicy, AsyncPolicy, ColocatePolicy or your own frozen attrs class)."""
    tick_s: float | None = 1.0
    """Re-evaluate this often even without events; None: only on events."""
    expected_cells: tuple[str, ...] = ()
    """Decide nothing until every one of these cells has announced itself (a partial view misleads a policy)."""
    switch_timeout_s: float = 300.0
    """Give up waiting for a switch's RoleChanged after this long."""
    cell_silence_limit_s: float | None = 120.0
    """A cell heard from (RoleChanged, LoadReport) no later than this long ago is left out of the view: a dead cell
    shown as an idle trainer would make the policy believe someone takes the waiting work. None: never."""

    def __attrs_post_init__(self) -> None:
        if self.tick_s is not None and self.tick_s <= 0:
            raise SchedulerConfigError(f"tick_s must be > 0 or None, got {self.tick_s}")
        if self.switch_timeout_s <= 0:
            raise SchedulerConfigError(f"switch_timeout_s must be > 0, got {self.switch_timeout_s}")
        if self.cell_silence_limit_s is not None and self.cell_silence_limit_s <= 0:
            raise SchedulerConfigError(f"cell_silence_limit_s must be > 0 or None, got {self.cell_silence_limit_s}")


@attrs.define
class _CellState:
    name: str
    role: str = ROLLOUT
    is_core: bool = False
    role_since_s: float = 0.0
    switching_to: str = ""
    switch_sent_s: float = 0.0
    load: LoadReport | None = None
    announced: bool = False
    last_heard_s: float = 0.0
    silent: bool = False


class Scheduler(Actor):
    """Hosts `config.policy`; see the module docstring."""

    config_cls = SchedulerConfig
    subscriptions = (LoadReport, RoleChanged, CallsWaitingForCell, TrainingBacklog, StepReady, StepApplied)

    async def on_start(self) -> None:
        self.cells: dict[str, _CellState] = {}
        self.backlog = BacklogView()
        self.calls_waiting_for_cell = 0
        self.claims_by_cell: dict[str, int] = {}
        # What the cost-aware policy reads (ElasticPolicy.work_per_switch): measured here, never configured.
        self.claim_started_s: dict[str, float] = {}  # cell -> when its current claim began
        self.claim_ended_s: dict[str, float] = {}  # cell -> when it last held no claim after holding one
        self.done_seen = (0, 0)  # (step id, done micro-steps) of the last TrainingBacklog
        self.microstep_seconds: collections.deque[float] = collections.deque(maxlen=MEASURED_WINDOW)
        self.switch_seconds: dict[str, collections.deque[float]] = {
            TRAIN: collections.deque(maxlen=MEASURED_WINDOW), ROLLOUT: collections.deque(maxlen=MEASURED_WINDOW)}
        self.counts = {"evaluations": 0, "switches_sent": 0, "to_train": 0, "to_rollout": 0, "switch_timeouts": 0}
        self._names_sorted: list[str] = []  # self.cells' names, sorted (view)
        self._built_views: dict[str, tuple[tuple, CellView]] = {}  # cell -> (its view's fields, the view built)
        # Cells whose view may have changed since it was built. A load report changes its cell's alone and a tick
        # none (most evaluations); everything else marks them all.
        self._stale_views: set[str] = set()
        self._all_expected_announced = not self.config.expected_cells
        if self.config.tick_s is not None:
            self.send_later(self.config.tick_s, SchedulerTick())

    # ---- the view -------------------------------------------------------------------------------------------------
    def _cell(self, name: str) -> _CellState:
        """The cell's state, marked as heard from now (every caller handles a message from or about it)."""
        self._stale_views.add(name)
        if name not in self.cells:
            self.cells[name] = _CellState(name, role_since_s=self.clock.now())
        state = self.cells[name]
        state.last_heard_s = self.clock.now()
        if state.silent:
            self.log.info("cell_heard_from_again", cell=name)
            state.silent = False
        return state

    @handler(RoleChanged)
    def on_role_changed(self, msg: RoleChanged) -> None:
        cell = self._cell(msg.cell)
        cell.announced = True
        cell.is_core = msg.is_core
        if cell.role != msg.role or cell.switching_to or msg.previous_role == "":
            cell.role_since_s = self.clock.now()
        if msg.previous_role in (ROLLOUT, TRAIN) and msg.role != msg.previous_role and msg.switch_s > 0:
            self.switch_seconds[msg.role].append(msg.switch_s)
        cell.role = msg.role
        cell.switching_to = ""
        self._stale_views.update(self.cells)
        self._evaluate()

    @handler(LoadReport)
    def on_load_report(self, msg: LoadReport) -> None:
        cell = self._cell(msg.cell)
        cell.load = msg
        if not cell.switching_to and not cell.announced:
            cell.role = msg.role  # a cell we have not heard RoleChanged from: its report is all we know
        self._evaluate()

    @handler(CallsWaitingForCell)
    def on_calls_waiting(self, msg: CallsWaitingForCell) -> None:
        self.calls_waiting_for_cell = msg.calls
        self._stale_views.update(self.cells)
        self._evaluate()

    @handler(TrainingBacklog)
    def on_backlog(self, msg: TrainingBacklog) -> None:
        self._measure_claims(msg)
        dry = msg.claimable_microsteps == 0
        dry_since = (self.backlog.dry_since_s if self.backlog.dry_since_s is not None else msg.time_s) if dry else None
        self.backlog = BacklogView(
            step_id=msg.step_id,
            step_fixed=msg.step_fixed,
            claimable_microsteps=msg.claimable_microsteps,
            claimed_microsteps=msg.claimed_microsteps,
            pending_executions=msg.pending_executions,
            executions_per_step=msg.executions_per_step,
            dry_since_s=dry_since,
            executions_in_step=msg.executions_in_step,
            microstep_s=_mean(self.microstep_seconds),
        )
        self.claims_by_cell = dict(msg.claims_by_cell)
        self._stale_views.update(self.cells)
        self._evaluate()

    def _measure_claims(self, msg: TrainingBacklog) -> None:
        """Micro-step seconds from claims seen to start and end: a cell whose claims drop while the step's done count
        rises by as many finished one (a drop without a done is a release, not measured)."""
        now = msg.time_s
        before = self.claims_by_cell
        step, done = self.done_seen
        finished = msg.done_microsteps - done if msg.step_id == step else 0
        dropped = sorted(c for c, n in before.items() if msg.claims_by_cell.get(c, 0) < n)
        if finished >= len(dropped) > 0:
            for cell in dropped:
                if cell in self.claim_started_s:
                    self.microstep_seconds.append(now - self.claim_started_s[cell])
        for cell in dropped:
            self.claim_started_s.pop(cell, None)
            if msg.claims_by_cell.get(cell, 0) == 0:
                self.claim_ended_s[cell] = now
        for cell, n in msg.claims_by_cell.items():
            if n > 0 and (before.get(cell, 0) == 0 or cell in dropped):
                self.claim_started_s[cell] = now
        self.done_seen = (msg.step_id, msg.done_microsteps)

    @handler(StepReady)
    def on_step_ready(self, msg: StepReady) -> None:
        if msg.step_id == self.backlog.step_id:
            self.backlog = attrs.evolve(self.backlog, step_fixed=True)
        self._stale_views.update(self.cells)
        self._evaluate()

    @handler(StepApplied)
    def on_step_applied(self, msg: StepApplied) -> None:
        if msg.step_id >= self.backlog.step_id:
            # The claimer's next TrainingBacklog will tell the rest; until then the applied step is not training work.
            self.backlog = attrs.evolve(
                self.backlog, step_id=msg.step_id + 1, step_fixed=False, claimable_microsteps=0, claimed_microsteps=0
            )
            for cell in self.claims_by_cell:  # their last micro-steps ended with the step
                self.claim_ended_s[cell] = self.clock.now()
                self.claim_started_s.pop(cell, None)
            self.claims_by_cell = {}
        self._stale_views.update(self.cells)
        self._evaluate()

    @handler(SchedulerTick)
    def on_tick(self, msg: SchedulerTick) -> None:
        self._evaluate()
        if self.config.tick_s is not None:
            self.send_later(self.config.tick_s, SchedulerTick())

    def view(self) -> SchedulerView:
        now = self.clock.now()
        cells = []
        limit = self.config.cell_silence_limit_s
        claims_by_cell, claim_ended_s, built, stale = (self.claims_by_cell, self.claim_ended_s, self._built_views,
                                                       self._stale_views)
        if len(self._names_sorted) != len(self.cells):  # cells are only ever added
            self._names_sorted = sorted(self.cells)
        for name in self._names_sorted:
            state = self.cells[name]
            if limit is not None and now - state.last_heard_s > limit:
                if not state.silent:
                    self.log.warning("cell_silent_left_out_of_the_view", cell=name, silent_s=now - state.last_heard_s)
                    state.silent = True
                continue
            if name not in stale and name in built:
                cells.append(built[name][1])
                continue
            stale.discard(name)
            load = state.load
            claims = claims_by_cell.get(name, 0)
            switching_to = state.switching_to
            idle_since = None
            if state.role == TRAIN and not switching_to and claims == 0:
                idle_since = max(state.role_since_s, claim_ended_s.get(name, state.role_since_s))
            fields = (
                SWITCHING if switching_to else state.role, state.is_core,
                load.live_sessions if load else 0, load.running_requests if load else 0,
                load.waiting_requests if load else 0, load.capacity_requests if load else 0,
                state.switch_sent_s if switching_to else state.role_since_s, switching_to, claims, idle_since,
                load.free_kv_blocks if load else 0, load.total_kv_blocks if load else 0,
            )
            # A cell's view is rebuilt only when one of its fields changed: an evaluation follows every cell's load
            # report, which changes that cell alone, and building the frozen CellViews was most of an evaluation.
            previous = built.get(name)
            if previous is None or previous[0] != fields:
                previous = built[name] = (fields, CellView(name, *fields))
            cells.append(previous[1])
        to_train, to_rollout = _mean(self.switch_seconds[TRAIN]), _mean(self.switch_seconds[ROLLOUT])
        return SchedulerView(time_s=now, cells=tuple(cells), backlog=self.backlog,
                             calls_waiting_for_cell=self.calls_waiting_for_cell,
                             switch_round_trip_s=to_train + to_rollout if to_train and to_rollout else None)

    # ---- deciding -------------------------------------------------------------------------------------------------
    def _evaluate(self) -> None:
        now = self.clock.now()
        for state in self.cells.values():
            if state.switching_to and now - state.switch_sent_s > self.config.switch_timeout_s:
                self.log.warning("switch not confirmed in time; trusting the cell's reports", cell=state.name,
                                 target=state.switching_to)
                self.counts["switch_timeouts"] += 1
                state.switching_to = ""
                if state.load is not None and state.load.role in (ROLLOUT, TRAIN):
                    state.role = state.load.role
                state.role_since_s = now
                self._stale_views.add(state.name)
        if not self._all_expected_announced:  # once true, for good: cells are never forgotten nor unannounced
            if any(name not in self.cells or not self.cells[name].announced for name in self.config.expected_cells):
                return
            self._all_expected_announced = True
        view = self.view()
        if not view.cells:
            return
        self.counts["evaluations"] += 1
        decisions = self.config.policy.decide(view)
        try:
            check_decisions(view, decisions)
        except PolicyContractError as error:
            raise PolicyContractError(f"{type(self.config.policy).__qualname__}: {error}") from None
        for decision in decisions:
            self._send(decision, now)

    def _send(self, decision: SwitchRole, now: float) -> None:
        state = self.cells[decision.cell]
        try:
            self.tell(decision.cell, decision)
        except UnknownAddress as error:  # a cell of another topology announced itself: not ours to switch
            self.log.error("cannot_switch_an_unknown_cell", cell=decision.cell, error=str(error))
            return
        self.log.info("switch", cell=decision.cell, role=decision.role, reason=decision.reason)
        state.switching_to = decision.role
        state.switch_sent_s = now
        self._stale_views.add(decision.cell)
        self.counts["switches_sent"] += 1
        self.counts["to_train" if decision.role == TRAIN else "to_rollout"] += 1

    # ---- reports --------------------------------------------------------------------------------------------------
    def statistics(self) -> SchedulerStatistics:
        return SchedulerStatistics(
            policy=type(self.config.policy).__qualname__,
            evaluations=self.counts["evaluations"],
            switches_sent=self.counts["switches_sent"],
            switches_to_train=self.counts["to_train"],
            switches_to_rollout=self.counts["to_rollout"],
            switch_timeouts=self.counts["switch_timeouts"],
            cells={name: (SWITCHING if s.switching_to else s.role) for name, s in sorted(self.cells.items())},
        )


def _mean(values: collections.deque[float]) -> float | None:
    return sum(values) / len(values) if values else None
