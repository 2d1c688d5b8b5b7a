"""Scheduling policies: which cells roll out and which train, decided from an immutable view of the load.

A policy is a frozen attrs object with one method, `decide(view) -> tuple[SwitchRole, ...]`. It is pure: everything
it needs is in the view (the scheduler actor builds the view, remembers when each cell entered its role and when the
training queue ran dry), so a policy keeps no state, can be recorded in the event log as part of the scheduler's
config, and can be swapped (or re-run on a recorded view) without touching any actor. `check_decisions` and
`check_scheduling_policy` are the contract every implementation passes; the scheduler checks every decision.

- `ElasticPolicy`: hardware follows the work. A satellite moves into training when micro-steps are waiting and the
  remaining rollout cells' capacity still covers every live session, and back when training work has run dry for a
  grace period or rollout demand exceeds rollout capacity. The band between "covers with headroom" (to leave) and
  "exceeds" (to come back), plus a minimum dwell time in a role, keeps cells from flapping. The core trains whenever
  there is training work and, by default, lends itself to rollout while there is none (it keeps its weights and
  optimizer state, so coming back costs a session migration, not a weight transfer). And while the rollout side has
  nothing to do (no live session, and a whole step already waits behind the one in training: the staleness bound
  holds rollout back), even the last rollout cell trains, and one comes back as soon as rollout work returns.
- `AsyncPolicy`: a fixed split chosen by the user (the baseline that isolates what switching adds to streaming).
- `ColocatePolicy`: every cell rolls out until a step's samples are fixed, then every cell trains until the core has
  applied it, then every cell rolls out again. Its switches into training do not migrate sessions (there is no
  rollout cell left to take them): the agents' calls wait at the proxy while the step trains.

Counted in seconds (`ElasticPolicy(work_per_switch=K)`, K > 0; `gyre simulate` runs it as "elastic", the main job
keeps the defaults). The session-counting rules flap where live sessions always exceed capacity (a staleness bound
that keeps two steps of executions in flight): "come back when demand exceeds capacity" then always holds. These
rules weigh the cost of a move instead, in seconds the scheduler measures (the mean time of recent micro-steps from
the claims it sees start and end, `BacklogView.microstep_s`; a switch's round trip from the cells' RoleChanged,
`SchedulerView.switch_round_trip_s`): a satellite leaves rollout only while the waiting micro-steps, shared among
the train cells and it, give it at least K round trips of work, and only while the rollout cells that stay cover
the unfinished executions of the step being filled (the published rule: the tail of a step may lose cells, its bulk
may not) and, unless the proxy holds calls for lack of a cell (it admits up to capacity), have free room for the
sessions it would migrate to them (`leave_into_free_capacity`: sessions of later steps are live too, and sessions
stay on the cell they were moved to, so a move into full cells oversubscribes them while the cells that come back
later sit empty), and free KV blocks for the KV they hold (`leave_into_free_kv`). A train cell goes back once it
has idled as long as a round trip costs (the ski-rental rule: waiting longer than a switch costs is the worst case
twice over), never because demand exceeds capacity. The core lends itself to rollout after a round trip without training work, and returns when the
step is fixed or when the work waiting for it is worth its round trip.

Capacity and demand are counted in sessions: a cell's capacity is the concurrent generations it reports
(`capacity_requests`) and demand is the live sessions on rollout cells (each live session may issue a call at any
moment, so counting sessions rather than running requests is the conservative choice).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import attrs

from gyre.messages.cells import ROLLOUT, SWITCHING, TRAIN, SwitchRole
from gyre.policies.errors import PolicyContractError, SchedulingConfigError


@attrs.frozen
class CellView:
    """One cell as the scheduler sees it."""

    name: str
    """Cell name."""
    role: str
    """"rollout", "train" or "switching" (a switch is under way)."""
    is_core: bool
    """The core holds the authoritative weights and applies the optimizer step."""
    live_sessions: int
    """Sessions whose KV the cell holds."""
    running_requests: int
    """Generations in progress."""
    waiting_requests: int
    """Generations queued."""
    capacity_requests: int
    """Concurrent generations the cell can run."""
    role_since_s: float
    """When the cell entered its current role (or started switching)."""
    switching_to: str = ""
    """Target role while switching; "" otherwise."""
    claims: int = 0
    """Micro-steps the cell holds."""
    idle_since_s: float | None = None
    """A train cell holding no micro-step: since when (its entry into training or its last micro-step's end);
    None otherwise."""
    free_kv_blocks: int = 0
    """KV blocks free in its pool (its last LoadReport; the prefixes of sessions between calls count as used)."""
    total_kv_blocks: int = 0
    """KV blocks in its pool (0: not reported)."""


@attrs.frozen
class BacklogView:
    """The training work as the scheduler sees it (from the claimer's TrainingBacklog, StepReady and StepApplied)."""

    step_id: int = 0
    """Step being trained."""
    step_fixed: bool = False
    """Its samples are all there (StepReady); it ends when the core publishes StepApplied."""
    claimable_microsteps: int = 0
    """Micro-steps queued and not claimed."""
    claimed_microsteps: int = 0
    """Micro-steps held by cells."""
    pending_executions: int = 0
    """Executions waiting for a later step."""
    executions_per_step: int = 1
    """Executions a step takes."""
    dry_since_s: float | None = None
    """Since when nothing has been claimable (None while something is)."""
    executions_in_step: int = 0
    """Executions assigned to the step so far (its unfinished ones: executions_per_step minus these)."""
    microstep_s: float | None = None
    """Seconds a micro-step takes on a train cell, measured by the scheduler from the claims it sees start and end
    (the mean of the recent ones); None until one has been measured."""

    @property
    def unfinished_executions(self) -> int:
        """Executions the step still waits for (0 once it is fixed)."""
        return 0 if self.step_fixed else max(0, self.executions_per_step - self.executions_in_step)

    @property
    def steps_waiting(self) -> int:
        """Whole steps' worth of executions waiting behind the current step."""
        return self.pending_executions // max(1, self.executions_per_step)


@attrs.frozen
class SchedulerView:
    """Everything a policy may look at; immutable, so a decision is a function of it."""

    time_s: float
    """Runtime-clock time of the evaluation."""
    cells: tuple[CellView, ...]
    """Every known cell, sorted by name."""
    backlog: BacklogView
    """Training work."""
    calls_waiting_for_cell: int = 0
    """Agent calls the proxy holds because no rollout cell accepts them: rollout demand no cell reports."""
    switch_round_trip_s: float | None = None
    """Seconds of a switch into training plus one back, measured from the cells' RoleChanged (the recent mean of
    each direction); None until both directions have been seen."""

    def cell(self, name: str) -> CellView:
        for cell in self.cells:
            if cell.name == name:
                return cell
        raise KeyError(name)


@runtime_checkable
class SchedulingPolicy(Protocol):
    """Decides role switches from a view. Contract: pure and deterministic; at most one decision per cell; only known,
    non-switching cells; the target role is "rollout" or "train" and differs from the cell's role."""

    def decide(self, view: SchedulerView) -> tuple[SwitchRole, ...]:
        """The switches to make now (often none)."""
        ...


def _settled(cell: CellView, view: SchedulerView, min_dwell_s: float) -> bool:
    return cell.role in (ROLLOUT, TRAIN) and view.time_s - cell.role_since_s >= min_dwell_s


def _rollout_supply(view: SchedulerView) -> tuple[int, int]:
    """(live sessions, capacity) of the rollout side, counting cells on their way into rollout as capacity and the
    sessions of cells on their way out as demand (they are being migrated to the others)."""
    demand = capacity = 0
    for cell in view.cells:
        if cell.role == ROLLOUT or (cell.role == SWITCHING and cell.switching_to == ROLLOUT):
            capacity += cell.capacity_requests
        if cell.role == ROLLOUT or (cell.role == SWITCHING and cell.switching_to == TRAIN):
            demand += cell.live_sessions
    return demand, capacity


def _kv_room(leaving: CellView, rolling_out: list[CellView]) -> bool:
    """Whether the rollout cells other than `leaving` have free KV blocks for every block `leaving` holds; True
    when a cell does not report its pool (an engine that gives no block counts, such as SGLang's /get_load)."""
    staying = [c for c in rolling_out if c.name != leaving.name]
    if leaving.total_kv_blocks <= 0 or any(c.total_kv_blocks <= 0 for c in staying):
        return True
    return sum(c.free_kv_blocks for c in staying) >= leaving.total_kv_blocks - leaving.free_kv_blocks


def _switch(cell: CellView, role: str, reason: str, migrate_sessions: bool = True) -> SwitchRole:
    return SwitchRole(cell=cell.name, role=role, reason=reason, migrate_sessions=migrate_sessions)


@attrs.frozen
class ElasticPolicy:
    """Satellites move to training when work waits and rollout capacity allows, and back when it does not (the
    module docstring: in sessions by default, in seconds with `work_per_switch` > 0)."""

    min_dwell_s: float = 30.0
    """A cell stays at least this long in a role before it is switched again (no flapping)."""
    grow_min_waiting: int = 1
    """Micro-steps waiting beyond what idle train cells will take before another satellite joins training."""
    capacity_headroom: float = 0.9
    """A satellite leaves rollout only if live sessions <= headroom * capacity of the cells that stay."""
    dry_grace_s: float = 10.0
    """Training work must stay dry this long before idle satellites go back (a step boundary is not dryness)."""
    max_switches_per_decision: int = 1
    """Switches per evaluation: one at a time lets load reports catch up with each move."""
    min_rollout_cells: int = 1
    """Never leave fewer rollout cells than this."""
    core_rolls_out_when_dry: bool = True
    """While no training work exists (nothing claimable or claimed, no step fixed) for `dry_grace_s`, the core rolls
    out too; it returns to training as soon as a micro-step is claimable. False pins the core to training."""
    idle_rollout_trains: bool = True
    """While the rollout side has nothing to do (no live session on it, no call waiting at the proxy, and a whole
    step's executions already waiting behind the step in training: rollout is as far ahead as the staleness bound
    lets it go), its last cells may train too, below `min_rollout_cells`: they would idle until that step is applied.
    The last one leaves without migrating (there are no sessions to move, and nowhere to move them). As soon as no
    cell rolls out and rollout work is back (nothing waits behind the training step any more, or a call waits at
    the proxy), a satellite returns to rollout, dwell time or not."""

    work_per_switch: float = 0.0
    """0: the rules above (capacity and demand counted in sessions). > 0: the cost-aware rules (class docstring,
    "Counted in seconds"): a satellite leaves rollout only while the waiting training work, in measured seconds,
    would give it at least `work_per_switch` times the measured switch round trip, and only while the rollout cells
    that stay cover the step's unfinished executions (and, with `leave_into_free_capacity`, have room for its
    sessions); a train cell goes back only after idling a round trip."""
    assumed_round_trip_s: float = 12.0
    """The cost-aware rules' switch round trip until the scheduler has measured one (the seed's 8.52 s + 3.46 s)."""
    leave_into_free_capacity: bool = True
    """Cost-aware rules only: while no call waits at the proxy, a satellite leaves rollout only if the cells that
    stay have free room (capacity minus live sessions, each cell counted alone) for the sessions it would migrate to
    them. Without it a move in a step's tail piles the next step's live sessions onto the few cells that stay (their
    KV oversubscribed, calls queued), while the cells that come back later find nothing to take: sessions stay where
    they were placed. Calls waiting at the proxy mean it admits up to capacity and queues the rest: what a move
    cannot place waits there for whichever cell frees first, the returning one included, so the rule is off."""

    leave_into_free_kv: bool = True
    """Cost-aware rules only: a satellite leaves rollout only if the cells that stay also have free KV blocks for
    every block it holds (the cells' LoadReports; a pool not reported does not hold it back). Counted in sessions,
    room misleads both ways: a count at the mean context underestimates what live sessions hold (the longest
    executions live longest), and a burst of new sessions holds little KV now and much later. The two rules
    together ask for room now (blocks) and later (sessions). Without it, satellites left during the burst of new
    sessions each applied step starts, and the cells that stayed held more context than their KV, prefilling the
    evicted prefixes again on every call (BENCHMARKS.md, gyre simulate, session 26: the time accounts)."""

    def __attrs_post_init__(self) -> None:
        if self.min_dwell_s < 0 or self.dry_grace_s < 0:
            raise SchedulingConfigError("min_dwell_s and dry_grace_s must be >= 0")
        if self.work_per_switch < 0 or self.assumed_round_trip_s <= 0:
            raise SchedulingConfigError("work_per_switch must be >= 0 and assumed_round_trip_s > 0")
        if not 0 < self.capacity_headroom <= 1:
            raise SchedulingConfigError(f"capacity_headroom must be in (0, 1], got {self.capacity_headroom}")
        if self.grow_min_waiting < 1 or self.max_switches_per_decision < 1 or self.min_rollout_cells < 0:
            raise SchedulingConfigError("grow_min_waiting and max_switches_per_decision must be >= 1")

    def decide(self, view: SchedulerView) -> tuple[SwitchRole, ...]:
        if self.work_per_switch > 0:
            return self._decide_by_work(view)
        decisions: list[SwitchRole] = []
        backlog = view.backlog
        training_active = (backlog.claimable_microsteps > 0 or backlog.claimed_microsteps > 0 or backlog.step_fixed
                           or any(c.claims > 0 for c in view.cells))
        for cell in (c for c in view.cells if c.is_core):  # the core applies every step
            if cell.role == ROLLOUT and (training_active or not self.core_rolls_out_when_dry):
                decisions.append(_switch(cell, TRAIN, "the core applies the optimizer step"))
            elif (
                cell.role == TRAIN and self.core_rolls_out_when_dry and not training_active and cell.claims == 0
                and _settled(cell, view, self.min_dwell_s) and backlog.dry_since_s is not None
                and view.time_s - backlog.dry_since_s >= self.dry_grace_s
            ):
                decisions.append(_switch(cell, ROLLOUT, "no training work: the core lends itself to rollout"))
        demand, capacity = _rollout_supply(view)
        rolling_out = [c for c in view.cells
                       if c.role == ROLLOUT or (c.role == SWITCHING and c.switching_to == ROLLOUT)]
        satellites_training = [c for c in view.cells if not c.is_core and c.role == TRAIN]
        rollout_work_back = view.calls_waiting_for_cell > 0 or backlog.steps_waiting == 0
        if not rolling_out and rollout_work_back and satellites_training and not any(
                d.role == ROLLOUT for d in decisions):
            cell = min(satellites_training, key=lambda c: (c.claims, c.name))
            why = (f"{view.calls_waiting_for_cell} calls wait for a rollout cell" if view.calls_waiting_for_cell
                   else "no cell rolls out and the next step's rollouts can start")
            decisions.append(_switch(cell, ROLLOUT, why))
            return tuple(decisions[: self.max_switches_per_decision])
        movable_back = sorted(
            (c for c in satellites_training if _settled(c, view, self.min_dwell_s)), key=lambda c: (c.claims, c.name)
        )
        if demand > capacity and movable_back:
            cell = movable_back[0]
            decisions.append(_switch(cell, ROLLOUT, f"rollout demand {demand} sessions exceeds capacity {capacity}"))
            return tuple(decisions[: self.max_switches_per_decision])
        dry = (
            backlog.claimable_microsteps == 0
            and backlog.steps_waiting == 0
            and backlog.dry_since_s is not None
            and view.time_s - backlog.dry_since_s >= self.dry_grace_s
        )
        if dry:
            idle = [c for c in movable_back if c.claims == 0]
            decisions.extend(_switch(c, ROLLOUT, "training work ran dry") for c in idle)
            return tuple(decisions[: self.max_switches_per_decision])
        takers = sum(1 for c in view.cells if c.role == TRAIN and c.claims == 0) + sum(
            1 for c in view.cells if c.role == SWITCHING and c.switching_to == TRAIN
        )
        waiting = backlog.claimable_microsteps - takers
        if waiting >= self.grow_min_waiting:
            rollout_cells = [c for c in view.cells if c.role == ROLLOUT and not c.is_core]
            rollout_idle = (
                self.idle_rollout_trains and demand == 0 and view.calls_waiting_for_cell == 0
                and backlog.steps_waiting >= 1
                and all(c.running_requests == 0 and c.waiting_requests == 0 for c in rolling_out)
            )
            settled = (c for c in rollout_cells if _settled(c, view, self.min_dwell_s))
            candidates = sorted(settled, key=lambda c: (c.live_sessions, c.name))
            staying = len(rollout_cells)
            for cell in candidates:
                if staying - 1 < self.min_rollout_cells and not rollout_idle:
                    break
                if demand <= self.capacity_headroom * (capacity - cell.capacity_requests):
                    others = any(c.name != cell.name for c in rolling_out)
                    why = (f"{demand} sessions fit in {capacity - cell.capacity_requests}" if others
                           else "the rollout is idle: a whole step waits behind the one in training")
                    decisions.append(_switch(cell, TRAIN, f"{waiting} micro-steps waiting; {why}",
                                             migrate_sessions=others))
                    break
        return tuple(decisions[: self.max_switches_per_decision])


    # ---- counted in seconds (work_per_switch > 0) ------------------------------------------------------------------
    def _decide_by_work(self, view: SchedulerView) -> tuple[SwitchRole, ...]:
        """The cost-aware rules (class docstring, "Counted in seconds")."""
        decisions: list[SwitchRole] = []
        backlog = view.backlog
        now = view.time_s
        round_trip = view.switch_round_trip_s if view.switch_round_trip_s is not None else self.assumed_round_trip_s
        worth_s = self.work_per_switch * round_trip  # work a move must bring to pay for its round trip
        idle_limit_s = max(self.dry_grace_s, round_trip)  # ski rental: idle as long as a round trip costs, then go
        microstep_s = backlog.microstep_s
        trainers = [c for c in view.cells if c.role == TRAIN or (c.role == SWITCHING and c.switching_to == TRAIN)]
        takers = sum(1 for c in trainers if c.role == SWITCHING or c.claims == 0)
        surplus = backlog.claimable_microsteps - takers
        training_active = (backlog.claimable_microsteps > 0 or backlog.claimed_microsteps > 0 or backlog.step_fixed
                           or any(c.claims > 0 for c in view.cells))

        def idle_long(c: CellView) -> bool:
            return (c.role == TRAIN and c.claims == 0 and _settled(c, view, self.min_dwell_s)
                    and c.idle_since_s is not None and now - c.idle_since_s >= idle_limit_s)

        for cell in (c for c in view.cells if c.is_core):
            if cell.role == ROLLOUT:
                waiting_s = surplus * microstep_s if microstep_s is not None else None
                if not self.core_rolls_out_when_dry or backlog.step_fixed or (
                        surplus >= 1 and (waiting_s is None or waiting_s >= worth_s)):
                    decisions.append(_switch(cell, TRAIN, "the core applies the optimizer step" if backlog.step_fixed
                                             else f"{surplus} micro-steps wait for a train cell"))
            elif (self.core_rolls_out_when_dry and not training_active and idle_long(cell)
                  and backlog.dry_since_s is not None and now - backlog.dry_since_s >= idle_limit_s):
                decisions.append(_switch(cell, ROLLOUT, f"no training work for {now - backlog.dry_since_s:.0f} s: the "
                                         "core lends itself to rollout"))
        demand, capacity = _rollout_supply(view)
        rolling_out = [c for c in view.cells
                       if c.role == ROLLOUT or (c.role == SWITCHING and c.switching_to == ROLLOUT)]
        satellites_training = [c for c in view.cells if not c.is_core and c.role == TRAIN]
        rollout_work_back = view.calls_waiting_for_cell > 0 or backlog.steps_waiting == 0
        if not rolling_out and rollout_work_back and satellites_training and not any(
                d.role == ROLLOUT for d in decisions):
            cell = min(satellites_training, key=lambda c: (c.claims, c.name))
            why = (f"{view.calls_waiting_for_cell} calls wait for a rollout cell" if view.calls_waiting_for_cell
                   else "no cell rolls out and the next step's rollouts can start")
            decisions.append(_switch(cell, ROLLOUT, why))
            return tuple(decisions[: self.max_switches_per_decision])
        idle = sorted((c for c in satellites_training if idle_long(c)), key=lambda c: (c.idle_since_s, c.name))
        if idle and backlog.claimable_microsteps == 0:
            cell = idle[0]
            decisions.append(_switch(cell, ROLLOUT, f"idle in training for {now - cell.idle_since_s:.0f} s, longer "
                                     f"than a switch round trip ({round_trip:.1f} s)"))
            return tuple(decisions[: self.max_switches_per_decision])
        if microstep_s is None or surplus < self.grow_min_waiting:
            return tuple(decisions[: self.max_switches_per_decision])
        coming = sum(1 for d in decisions if d.role == TRAIN)  # the core, called back just now
        share_s = backlog.claimable_microsteps * microstep_s / (len(trainers) + coming + 1)
        rollout_cells = [c for c in view.cells if c.role == ROLLOUT and not c.is_core]
        rollout_idle = (
            self.idle_rollout_trains and demand == 0 and view.calls_waiting_for_cell == 0
            and backlog.steps_waiting >= 1
            and all(c.running_requests == 0 and c.waiting_requests == 0 for c in rolling_out)
        )
        if share_s < worth_s and not rollout_idle:
            return tuple(decisions[: self.max_switches_per_decision])
        unfinished = backlog.unfinished_executions
        settled = sorted((c for c in rollout_cells if _settled(c, view, self.min_dwell_s)),
                         key=lambda c: (c.live_sessions, c.name))
        for cell in settled:
            if len(rollout_cells) - 1 < self.min_rollout_cells and not rollout_idle:
                break
            staying = capacity - cell.capacity_requests
            if not rollout_idle and self.leave_into_free_capacity and view.calls_waiting_for_cell == 0 and sum(
                    max(0, c.capacity_requests - c.live_sessions) for c in rolling_out if c.name != cell.name
            ) < cell.live_sessions:
                continue
            if not rollout_idle and self.leave_into_free_kv and not _kv_room(cell, rolling_out):
                continue
            if rollout_idle or unfinished <= self.capacity_headroom * staying:
                others = any(c.name != cell.name for c in rolling_out)
                why = (f"{backlog.claimable_microsteps} micro-steps ({share_s:.0f} s a train cell) wait, worth a "
                       f"{round_trip:.1f} s round trip; the step's {unfinished} unfinished executions fit in "
                       f"{staying}" if others else "the rollout is idle: a whole step waits behind the one in training")
                decisions.append(_switch(cell, TRAIN, why, migrate_sessions=others))
                break
        return tuple(decisions[: self.max_switches_per_decision])

@attrs.frozen
class AsyncPolicy:
    """A fixed split: the cells named in `train_cells` train, every other cell rolls out."""

    train_cells: tuple[str, ...] = attrs.field(converter=tuple)
    """Cells that train (the core must be one of them: it applies the optimizer step)."""

    def __attrs_post_init__(self) -> None:
        if not self.train_cells or len(set(self.train_cells)) != len(self.train_cells):
            raise SchedulingConfigError(f"train_cells must name distinct cells, got {self.train_cells!r}")

    def decide(self, view: SchedulerView) -> tuple[SwitchRole, ...]:
        decisions = []
        train_cells = self.train_cells
        for cell in view.cells:  # one pass: a misplaced core raises whatever was decided before it
            trains = cell.name in train_cells
            if cell.is_core and not trains:
                raise SchedulingConfigError(f"the core {cell.name!r} is not in train_cells {train_cells!r}")
            wanted = TRAIN if trains else ROLLOUT
            if cell.role != wanted and cell.role in (ROLLOUT, TRAIN):
                decisions.append(_switch(cell, wanted, "fixed split"))
        return tuple(decisions)


@attrs.frozen
class ColocatePolicy:
    """All cells roll out; when a step's samples are fixed all train; when it is applied all roll out again.

    All means all: the last rollout cell leaves too, without migrating its sessions (`migrate_sessions=False`), so
    live generations are aborted and the agents' calls wait at the proxy until the cells roll out again, where the
    calls resume from their partial output (re-prefilled). That is the cost a colocated system pays; a switch that
    kept one cell rolling out would be a fixed split in disguise."""

    def decide(self, view: SchedulerView) -> tuple[SwitchRole, ...]:
        backlog = view.backlog
        training_phase = backlog.step_fixed or backlog.claimed_microsteps > 0
        decisions = []
        for cell in view.cells:
            if training_phase and cell.role == ROLLOUT:
                decisions.append(_switch(cell, TRAIN, f"step {backlog.step_id} is ready", migrate_sessions=False))
            elif not training_phase and cell.role == TRAIN and cell.claims == 0:
                decisions.append(_switch(cell, ROLLOUT, f"step {backlog.step_id} is filling"))
        return tuple(decisions)


def check_decisions(view: SchedulerView, decisions: object) -> tuple[SwitchRole, ...]:
    """Raise PolicyContractError unless `decisions` is a valid answer to `view`; returns them."""
    if not isinstance(decisions, tuple):
        raise PolicyContractError(f"decisions must be a tuple of SwitchRole, got {type(decisions).__qualname__}")
    if not decisions:  # most evaluations decide nothing: no index of the cells to build
        return decisions
    known = {cell.name: cell for cell in view.cells}
    named: set[str] = set()
    for decision in decisions:
        if not isinstance(decision, SwitchRole):
            raise PolicyContractError(f"a decision is a {type(decision).__qualname__}, not a SwitchRole")
        cell = known.get(decision.cell)
        if cell is None:
            raise PolicyContractError(f"decision for unknown cell {decision.cell!r}")
        if decision.cell in named:
            raise PolicyContractError(f"two decisions for cell {decision.cell!r}")
        named.add(decision.cell)
        if decision.role not in (ROLLOUT, TRAIN):
            raise PolicyContractError(f"role {decision.role!r} is neither rollout nor train")
        if cell.role == SWITCHING:
            raise PolicyContractError(f"{decision.cell} is already switching to {cell.switching_to}")
        if cell.role == decision.role:
            raise PolicyContractError(f"{decision.cell} is already in role {decision.role}")
        if not decision.reason:
            raise PolicyContractError(f"the switch of {decision.cell} gives no reason")
    return decisions


def check_scheduling_policy(policy: object, views: tuple[SchedulerView, ...]) -> None:
    """The contract test: raise PolicyContractError unless `policy` is a recordable, pure policy whose decisions on
    every view pass `check_decisions` and are the same when asked twice."""
    if not attrs.has(type(policy)):
        raise PolicyContractError(f"{type(policy).__qualname__} is not an attrs class; configs must be recordable")
    if not isinstance(policy, SchedulingPolicy):
        raise PolicyContractError(f"{type(policy).__qualname__} has no decide(view)")
    for view in views:
        first = check_decisions(view, policy.decide(view))
        if policy.decide(view) != first:
            raise PolicyContractError(f"{type(policy).__qualname__} answered the same view differently")
