"""Emulated agents: the executor, the agents' processes and the trajectory builder of an emulated run, in one actor.

It takes the real task source's StartGroup like the executor does, draws each execution's plan from the workload
(workloads.py, seeded by the group id, so every policy runs the same executions), and places sessions on rollout
cells the way the proxy's sticky routing does: a new session goes to the rollout cell with the most free capacity
(capacity_requests minus live sessions), and stays there until its cell leaves rollout. Sessions handed back are
placed again; while no rollout cell exists they wait, and their count is published as CallsWaitingForCell (what the
proxy tells the scheduler). When a group's executions have all finished, its samples (one per execution: the
chain of a single agent, prefix-shared) land at the micro-step claimer and the task source hears GroupDone.

Samples carry lengths only: `token_ids` is a `range` of the trajectory's length (the claimer and the emulated
train cells only count tokens), so 20k executions of 30k tokens cost no memory.
"""

from __future__ import annotations

from typing import Any

import attrs

from gyre.messages.cells import ROLLOUT, LoadReport, RoleChanged
from gyre.messages.executions import GroupDone, StartGroup
from gyre.messages.proxy import CallsWaitingForCell
from gyre.messages.samples import SamplesLanded, TrainingSample
from gyre.runtime import Actor, handler
from gyre.simulate.cells import AdmitSessions, HandOverSessions, SessionsOut
from gyre.simulate.engine import Session
from gyre.simulate.record import RunRecord
from gyre.simulate.workloads import Workload

__all__ = ["EmulatedAgents", "EmulatedAgentsConfig"]


@attrs.frozen
class EmulatedAgentsConfig:
    """The workload and whom to tell."""

    workload: Workload
    """Distributions the executions are drawn from."""
    seed: int = 0
    """Mixed with each group id into the plans' seed."""
    claimer: str = "claimer"
    task_source: str = "task_source"
    record: Any = None
    """A RunRecord (record.py)."""
    admit_up_to_capacity: bool = False
    """Place a session only on a cell with free capacity (capacity_requests minus the sessions placed there); the
    rest wait, counted as CallsWaitingForCell. False: always place (sticky routing with no admission bound)."""
    rebalance_on_join: bool = False
    """A cell that joins rollout takes over live sessions between calls from the cells holding more than their
    share (their KV moved, as the KV migrator moves a draining cell's), instead of waiting for new sessions."""
    max_concurrent: int = 0
    """Executions running at once, as the executor's `max_concurrent` bounds agent processes: the rest wait, in
    the order their groups started, before their setup begins. A slot is held until the agent's last tool time ends
    (the agent exits); a plan's `scoring_s` then runs outside the slot, as the executor hands a finished agent's
    execution to the evaluator. 0: no bound."""


@attrs.frozen
class _Scored:
    """The evaluator's time for a session is over (in-process timer)."""

    session: Session


@attrs.define
class _Group:
    size: int
    version: int
    finished: list[Session] = attrs.field(factory=list)


class EmulatedAgents(Actor):
    """See the module docstring."""

    config_cls = EmulatedAgentsConfig
    subscriptions = (RoleChanged, LoadReport)

    async def on_start(self) -> None:
        self.groups: dict[str, _Group] = {}
        self.rollout_cells: dict[str, int] = {}  # rollout cell -> capacity it reported
        self.placed: dict[str, int] = {}  # cell -> live sessions we placed there (our own count, always current)
        self.unplaced: list[Session] = []
        self.waiting_published = 0
        self.queued: list[tuple[Any, str]] = []  # (plan, group id) waiting for an execution slot
        self.running = 0
        self.record: RunRecord | None = self.config.record

    # ---- cells ----------------------------------------------------------------------------------------------------
    @handler(RoleChanged)
    def on_role_changed(self, msg: RoleChanged) -> None:
        if msg.role == ROLLOUT:
            joined = msg.cell not in self.rollout_cells
            self.rollout_cells.setdefault(msg.cell, 1)
        else:
            joined = False
            self.rollout_cells.pop(msg.cell, None)
        self._place(self.unplaced)
        if joined and self.config.rebalance_on_join:
            self._rebalance(msg.cell)

    @handler(LoadReport)
    def on_load(self, msg: LoadReport) -> None:
        if msg.cell in self.rollout_cells and msg.capacity_requests > 0:
            self.rollout_cells[msg.cell] = msg.capacity_requests
        elif msg.role != ROLLOUT:
            self.rollout_cells.pop(msg.cell, None)

    def _place(self, sessions: list[Session]) -> None:
        waiting: list[Session] = []
        batches: dict[str, list[Session]] = {}
        for session in sessions:
            if not self.rollout_cells:
                waiting.append(session)
                continue
            cell = max(self.rollout_cells, key=lambda c: (self.rollout_cells[c] - self.placed.get(c, 0), c))
            if self.config.admit_up_to_capacity and self.placed.get(cell, 0) >= self.rollout_cells[cell]:
                waiting.append(session)
                continue
            self.placed[cell] = self.placed.get(cell, 0) + 1
            batches.setdefault(cell, []).append(session)
        for cell, batch in sorted(batches.items()):
            self.tell(cell, AdmitSessions(tuple(batch)))
        self.unplaced = waiting
        if len(waiting) != self.waiting_published:
            self.waiting_published = len(waiting)
            self.publish(CallsWaitingForCell(calls=len(waiting), time_s=self.clock.now()))

    def _rebalance(self, joined: str) -> None:
        total = sum(self.placed.get(c, 0) for c in self.rollout_cells)
        share = total // max(1, len(self.rollout_cells))
        want = share - self.placed.get(joined, 0)
        for cell in sorted(self.rollout_cells, key=lambda c: (-self.placed.get(c, 0), c)):
            if want <= 0 or cell == joined:
                continue
            surplus = self.placed.get(cell, 0) - share
            if surplus > 0:
                n = min(surplus, want)
                want -= n
                self.tell(cell, HandOverSessions(n))

    # ---- executions -----------------------------------------------------------------------------------------------
    @handler(StartGroup)
    def on_start_group(self, msg: StartGroup) -> None:
        plans = self.config.workload.plans(msg.group_id, msg.group_size, self.config.seed)
        self.groups[msg.group_id] = _Group(msg.group_size, msg.weight_version)
        self.queued.extend((plan, msg.group_id) for plan in plans)
        self._start_queued()

    def _start_queued(self) -> None:
        bound = self.config.max_concurrent
        now = self.clock.now()
        sessions = []
        while self.queued and (bound <= 0 or self.running < bound):
            plan, group_id = self.queued.pop(0)
            self.running += 1
            sessions.append(Session(plan, group_id, phase_end_s=now + plan.setup_s))
        if sessions:
            self._place(list(self.unplaced) + sessions)

    @handler(SessionsOut)
    def on_sessions_out(self, msg: SessionsOut) -> None:
        self.placed[msg.cell] = max(0, self.placed.get(msg.cell, 0) - len(msg.finished) - len(msg.returned))
        for session in msg.finished:
            self.running = max(0, self.running - 1)  # the agent exited: its slot frees, scoring runs outside it
            if session.plan.scoring_s > 0:
                self.send_later(session.plan.scoring_s, _Scored(session))
            else:
                self._finished(session)
        if msg.returned or (msg.finished and self.unplaced):
            self._place(list(self.unplaced) + list(msg.returned))
        if msg.finished:
            self._start_queued()

    @handler(_Scored)
    def on_scored(self, msg: _Scored) -> None:
        self._finished(msg.session)

    def _finished(self, session: Session) -> None:
        group = self.groups.get(session.group_id)
        if group is None:
            self.log.warning("session_of_unknown_group", group=session.group_id)
            return
        group.finished.append(session)
        if self.record is not None:
            self.record.executions_finished += 1
            self.record.model_calls += session.plan.turns
        if len(group.finished) == group.size:
            self._land(session.group_id, self.groups.pop(session.group_id))

    def _land(self, group_id: str, group: _Group) -> None:
        samples = []
        for session in sorted(group.finished, key=lambda s: s.plan.execution_id):
            length = session.plan.trained_tokens or session.plan.trajectory_tokens
            version = max(0, session.min_weight_version)
            samples.append(TrainingSample(
                execution_id=session.plan.execution_id, group_id=group_id, trajectory_rank=0,
                trajectory_kind="main", leaf_call_index=session.plan.turns - 1, token_ids=range(length),
                loss_mask=(), behaviour_logprobs=(), sampling_temperatures=(), advantages=(), weights=(),
                min_weight_version=version, max_weight_version=max(version, session.max_weight_version),
                num_loss_tokens=max(1, session.output_tokens_done),
            ))
        tokens = sum(len(s.token_ids) for s in samples)
        ids = tuple(s.execution_id for s in samples)
        landed = SamplesLanded(
            group_id=group_id, samples=tuple(samples), execution_ids=ids, rewards=(0.0,) * len(ids),
            advantages=(0.0,) * len(ids), num_dropped=0, num_tokens=tokens,
            num_loss_tokens=sum(s.num_loss_tokens for s in samples),
            min_weight_version=min(s.min_weight_version for s in samples),
            max_weight_version=max(s.max_weight_version for s in samples),
        )
        self.tell(self.config.claimer, landed)
        self.tell(self.config.task_source, GroupDone(group_id, True, 0.0, 0.0, len(ids), 0, tokens))
