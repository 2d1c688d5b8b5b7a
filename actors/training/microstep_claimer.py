"""The micro-step claimer: packs landed samples into micro-steps by a token budget and hands them out exactly once.

What a step is. A step takes exactly `executions_per_step = groups_per_step * group_size` executions, in landing
order. Groups land whole (advantages need the whole group), but a group may straddle two steps, and an execution
whose scorer crashed (it never lands) or that the staleness policy refuses does not count, so the step simply takes
the next execution. The payoff: every claim, even one for a step that is still filling, carries the step's exact
execution count (`num_executions_in_step`), so every execution weighs 1/E in the summed gradient of its step with no
rescaling at the end. A step's membership is fixed the moment its E-th execution is assigned: then its open
micro-steps are closed and StepReady is published with the final `num_microsteps`, which tells the core how many
MicroStepDone to wait for. All samples of one execution go to the same step (its weights sum to 1 there), but they
may be spread over several micro-steps (the loss is a sum over samples).

Streaming. Only the current step (base version = the weights all train cells hold) is claimable. Its samples are
packed first-fit into at most `max_open_microsteps` open micro-steps; one closes (becomes claimable) when full, when
a sample fits none of the open ones (the fullest closes), when the step is fixed, or when a claim finds nothing
queued and the fullest open micro-step is at least `early_close_fraction` full (an idle cell gets work before the
step's last group lands). Executions landing after the step is fixed wait in a bounded pending queue and are
assigned when StepApplied makes the next step current; that is also when the staleness policy is checked against the
next base version, so fixed steps never change and "too stale" is decided with the exact base.

Wake-ups. A train-role cell whose claim finds no work is *waiting*. When work becomes claimable (a micro-step is
queued, or the fullest open one reaches `early_close_fraction`, which the cell's claim then closes), the claimer
tells every waiting cell `ClaimsOpen` once, and the cell claims at once instead of at its next poll
(`retry_after_s`): work does not sit for up to a poll interval, and cells that know wake-ups may poll seldom (the
emulated cells of `gyre simulate`, whose 1 s polls were most of its run time). Polls stay the fallback for a lost
wake-up. Only cells whose RoleChanged said train are woken (a client that only asks is never told anything).

Exactly once. A micro-step is queued, claimed (by one cell) or done. A claim goes back to the queue when its cell
releases it, switches to another role, restarts (RoleChanged with previous_role "") or stays silent longer than
`cell_silence_limit_s` (no LoadReport, claim or MicroStepDone). The first MicroStepDone from a cell that holds or
held the micro-step wins; later ones are counted and ignored (the core must likewise count a (step, micro-step) once).
StepApplied from the core ends the step: claimed micro-steps whose MicroStepDone has not reached us yet are done (the
core had their gradients). A step the core skipped (its gradients were not finite, `StepApplied.skipped`) ends the
same way, but its samples move from trained to skipped: they are used up (training them again would likely fail
again, and would break "each execution in one step") and the ledger says honestly that no update came of them. The
base version then stays, since the weights did not change. `statistics()` is the ledger; `check_exactly_once` checks
it.

Checkpoints (issue 28). At every step's end the ledger notes a *boundary*: its counters, the next step id and base
version, and the groups of every execution not trained by then (pending, or packed into the next step); groups that
land later are added to the boundaries kept (the newest `MAX_BOUNDARIES`). A checkpoint of step s asks for s's
boundary (`checkpoint_state`), whatever happened since. Re-roll rule: a run resumed from it starts at step s + 1 on
the weights of s; the samples in flight at the boundary are counted as `samples_rerolled` (never trained, neither
lost), and their groups are named in `groups_not_trained`, so the task source runs their tasks again as new groups.
What is not kept: the duplicate-detection memory (the old run's executions cannot land in the new one: every group
it runs has a new id).

Lost messages (issue 28, part 4). Each has a defined outcome:
- a SamplesLanded that never arrives: the builder numbers its landings (`landing_seq`, with `samples_sent`, its
  running sample count); a gap counts the missing landings' samples as landed and `samples_dropped_in_transit`, and
  LandingsLost tells the task source that those groups will never train (its gate stops waiting for them; groups
  refused as stale are announced the same way, with the current step and base version, so a task source that
  missed a StepApplied catches up instead of starting groups on old weights). A landing that arrives after its gap
  was counted (overtaken on the way) is taken after all: the count is undone, and a LandingsLost of -1 group says
  so. One builder a run: a landing numbered 1 with executions never seen starts a new numbering (the builder
  restarted). A lost last landing is seen at the next one.
- a StepReady that never reaches the core: a fixed step whose StepApplied has not come is announced again every
  `step_ready_resend_s` (at most `max_step_ready_resends` times); the core treats a repeat as a no-op.
- a StepApplied that never reaches the claimer: the same re-announcement; a core that applied the step already
  answers it with the step's StepApplied again (actors/cells/cell.py), and the ledger moves on.
Claimer restarts. With `journal_path`, the ledger's summary is written (atomically, without fsync: a restart in the
same process or machine reads it) whenever its step, its landings or its grants change: the step id and base
version, the counters with every sample in flight counted as `samples_dropped_restart`, the groups in flight, the
landing numbers and the newest step boundary. A restarted claimer (`Actor.restarts` > 0) reads it: if no
micro-step of the current step had been granted, the run goes on from there (the samples in flight are counted as
dropped and announced in LandingsLost: their groups do not train); if some had been, their samples died with the
old instance and the step cannot end exactly once, so the claimer ends the run with a message saying to resume it
from its last checkpoint (the boundary it restored still serves that checkpoint). Without a journal a restarted
claimer ends the run the same way (started empty, it would wait at step 0 for ever).
"""

from __future__ import annotations

import collections
from pathlib import Path
from typing import Any

import attrs
import structlog

from gyre.actors.errors import ActorError
from gyre.messages.cells import LoadReport, RoleChanged, TRAIN
from gyre.messages.checkpoints import CheckpointAsked, CheckpointState
from gyre.messages.samples import LandingsLost, SamplesLanded, TrainingSample
from gyre.messages.scheduling import ClaimerStatistics, ClaimerTick, TrainingBacklog
from gyre.messages.training import (
    ClaimGranted,
    ClaimMicroStep,
    ClaimsOpen,
    MicroStepDone,
    ReleaseMicroStep,
    StepApplied,
    StepReady,
)
from gyre.policies.staleness import MaxVersionLag, StalenessPolicyError, check_staleness_policy
from gyre.runtime import Actor, handler
from gyre.runtime.checkpoint import decode_json, encode_json, read_actor_state

log = structlog.get_logger(__name__)


class ClaimerConfigError(ActorError, ValueError):
    """A claimer config with impossible values."""


class AccountingError(ActorError, RuntimeError):
    """The exactly-once ledger does not balance: a sample was lost or trained twice."""


class CheckpointUnavailable(ActorError, LookupError):
    """The ledger no longer holds (or never held) the boundary of the step a checkpoint asks for."""


MAX_BOUNDARIES = 4
"""Step boundaries kept for checkpoints: the checkpointer asks for a step right after the core saved it, so only a
run whose steps outpace the checkpoint by four steps asks for one that is gone (that checkpoint is abandoned)."""


def _positive(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is not None and not value > 0:
        raise ClaimerConfigError(f"{attribute.name} must be > 0, got {value!r}")


@attrs.frozen
class ClaimerConfig:
    """How steps and micro-steps are cut, and how long a silent cell keeps its claims."""

    groups_per_step: int = attrs.field(default=4, validator=_positive)
    """N: groups per optimizer step."""
    group_size: int = attrs.field(default=16, validator=_positive)
    """G: executions per group. A step takes N * G executions (see the module docstring)."""
    microstep_token_budget: int = attrs.field(default=32768, validator=_positive)
    """Most tokens one micro-step holds (a single longer sample gets a micro-step of its own)."""
    staleness: Any = MaxVersionLag(1)
    """A StalenessPolicy (frozen attrs) deciding which executions may still train at a step's base version."""
    base_version: int = 0
    """Weights the first step trains with."""
    first_step_id: int = 0
    """Id of the first step."""
    max_open_microsteps: int = attrs.field(default=2, validator=_positive)
    """Micro-steps filling at once (first-fit packing among them)."""
    early_close_fraction: float = attrs.field(default=0.5, validator=_positive)
    """A claim that finds nothing queued closes the fullest open micro-step if it is at least this full."""
    max_claims_per_cell: int = attrs.field(default=2, validator=_positive)
    """Micro-steps one cell may hold at once. Two, because a satellite already computes its next micro-step while the
    core is still pulling the gradients of the previous one (the core tells us it is done only after the pull)."""
    retry_after_s: float = attrs.field(default=1.0, validator=_positive)
    """Told to a cell that gets no work: when to ask again."""
    waiting_retry_after_s: float | None = attrs.field(default=None, validator=_positive)
    """Told instead to a train-role cell that now waits for a ClaimsOpen (module docstring, Wake-ups): its poll is
    only the fallback for a lost wake-up, so it may be long. None: `retry_after_s`."""
    max_pending_executions: int = attrs.field(default=4096, validator=_positive)
    """Executions waiting for a later step; beyond it the oldest are dropped and counted."""
    cell_silence_limit_s: float | None = attrs.field(default=60.0, validator=_positive)
    """A cell holding claims that sends nothing for this long is presumed dead; None: never presume."""
    liveness_check_s: float = attrs.field(default=5.0, validator=_positive)
    """How often silence is checked while claims are held."""
    max_remembered_samples: int = attrs.field(default=1 << 20, validator=_positive)
    """Trained samples (and landed executions) remembered to catch duplicates; the oldest are forgotten."""
    resume_from: str = ""
    """A committed checkpoint folder whose ledger this claimer continues ("" = start afresh; module docstring)."""
    step_ready_resend_s: float | None = attrs.field(default=30.0, validator=_positive)
    """A fixed step whose StepApplied has not come for this long is announced again (module docstring, Lost
    messages); None: never."""
    max_step_ready_resends: int = attrs.field(default=100, validator=_positive)
    """Re-announcements of one step, at most."""
    journal_path: str = ""
    """Where the ledger's summary is kept for a restart (module docstring, Claimer restarts); "" = nowhere (a
    restarted claimer then starts empty)."""

    def __attrs_post_init__(self) -> None:
        if self.early_close_fraction > 1.0:
            raise ClaimerConfigError(f"early_close_fraction must be in (0, 1], got {self.early_close_fraction}")
        try:
            check_staleness_policy(self.staleness)
        except StalenessPolicyError as error:
            raise ClaimerConfigError(f"staleness: {error}") from None

    @property
    def executions_per_step(self) -> int:
        return self.groups_per_step * self.group_size


@attrs.define
class _Execution:
    execution_id: str
    samples: tuple[TrainingSample, ...]
    min_weight_version: int
    num_tokens: int


@attrs.define
class _MicroStep:
    index: int
    samples: list[TrainingSample] = attrs.field(factory=list)
    num_tokens: int = 0
    state: str = "open"  # open -> queued <-> claimed -> done
    holder: str = ""
    past_holders: set[str] = attrs.field(factory=set)


@attrs.define
class _Boundary:
    """The ledger as a step ended (module docstring, Checkpoints)."""

    state: dict
    groups_not_trained: set[str]


@attrs.define
class _Cell:
    role: str = ""
    last_seen_s: float = 0.0


def _sample_key(sample: TrainingSample) -> tuple[str, int]:
    return (sample.execution_id, sample.trajectory_rank)


class _BoundedSet:
    """A set that forgets its oldest members beyond `limit` (duplicate detection must not grow without bound)."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._order: collections.deque = collections.deque()
        self._members: set = set()

    def __contains__(self, item: object) -> bool:
        return item in self._members

    def discard(self, item: object) -> None:
        self._members.discard(item)  # its place in the order goes when it would have been forgotten

    def add(self, item: object) -> None:
        if item in self._members:
            return
        self._members.add(item)
        self._order.append(item)
        if len(self._order) > self._limit:
            self._members.discard(self._order.popleft())


class MicroStepLedger:
    """The claimer's state machine, without the actor: every method takes the time it happens at and returns what to
    publish. Kept apart so that its bookkeeping is tested directly and the actor stays a thin adapter."""

    def __init__(self, config: ClaimerConfig) -> None:
        self.config = config
        self.step_id = config.first_step_id
        self.base_version = config.base_version
        self.step_fixed = False
        self.step_executions = 0
        self.microsteps: dict[int, _MicroStep] = {}
        self.open: list[_MicroStep] = []
        self.queue: collections.deque[int] = collections.deque()
        self.pending: collections.deque[_Execution] = collections.deque()
        self.cells: dict[str, _Cell] = {}
        self._seen_executions = _BoundedSet(config.max_remembered_samples)
        self._trained = _BoundedSet(config.max_remembered_samples)
        self.counts: collections.Counter[str] = collections.Counter()
        self.boundaries: collections.OrderedDict[int, _Boundary] = collections.OrderedDict()
        self.step_granted = False
        """A micro-step of the current step was handed out (a restart then cannot rebuild the step)."""
        self.last_ready: StepReady | None = None
        self.ready_sent_s = 0.0
        self.ready_resends = 0
        self.landing_seq = 0
        self.landing_samples = 0
        self._missing_landings = _BoundedSet(4096)
        self._stale_groups: set[str] = set()
        self._stale_samples = 0
        self.waiting: dict[str, None] = {}
        """Train-role cells whose last claim found no work, in order (module docstring, Wake-ups)."""

    # ---- checkpoints ----------------------------------------------------------------------------------------------
    def _note_boundary(self, ended_step: int) -> None:
        """The ledger right after `ended_step` ended: what a checkpoint of that step holds (module docstring)."""
        counts = dict(self.counts)
        in_flight = self.samples_in_flight()
        executions = len(self.pending) + len({s.execution_id for m in self.microsteps.values() for s in m.samples})
        counts["samples_rerolled"] = counts.get("samples_rerolled", 0) + in_flight
        counts["executions_rerolled"] = counts.get("executions_rerolled", 0) + executions
        groups = {s.group_id for e in self.pending for s in e.samples}
        groups |= {s.group_id for m in self.microsteps.values() for s in m.samples}
        state = {"step_id": self.step_id, "base_version": self.base_version, "counts": counts}
        self.boundaries[ended_step] = _Boundary(state, groups)
        while len(self.boundaries) > MAX_BOUNDARIES:
            self.boundaries.popitem(last=False)

    def checkpoint_state(self, step_id: int) -> tuple[dict, tuple[str, ...]]:
        """The ledger at the end of `step_id` and the groups not trained by then (landed later ones included).
        Raises CheckpointUnavailable when that boundary is not kept."""
        boundary = self.boundaries.get(step_id)
        if boundary is None:
            raise CheckpointUnavailable(f"the claimer keeps the ends of steps {list(self.boundaries)}, not {step_id}")
        return boundary.state, tuple(sorted(boundary.groups_not_trained))

    def restore(self, state: dict) -> None:
        """Continue from `checkpoint_state`'s ledger: the next step, its base version, the counters (the samples that
        were in flight are counted as re-rolled)."""
        self.step_id = int(state["step_id"])
        self.base_version = int(state["base_version"])
        self.counts = collections.Counter({key: int(value) for key, value in state["counts"].items()})

    # ---- the journal (module docstring, Claimer restarts) ---------------------------------------------------------
    def journal_key(self) -> tuple:
        """What a journal write must follow: the step, its grants, the landings, the samples trained (a refused
        claim or a load report changes nothing)."""
        return (self.step_id, self.step_granted, self.step_fixed, self.counts["samples_landed"], self.landing_seq,
                self.counts["samples_trained"])

    def journal_state(self) -> dict:
        in_flight = self.samples_in_flight()
        counts = dict(self.counts)
        counts["samples_dropped_restart"] = counts.get("samples_dropped_restart", 0) + in_flight
        groups = {s.group_id for e in self.pending for s in e.samples}
        groups |= {s.group_id for m in self.microsteps.values() if m.state != "done" for s in m.samples}
        boundary = None
        if self.boundaries:
            step, last = next(reversed(self.boundaries.items()))
            boundary = {"step": step, "state": last.state, "groups": sorted(last.groups_not_trained)}
        return {"step_id": self.step_id, "base_version": self.base_version, "granted": self.step_granted,
                "counts": counts, "in_flight": in_flight, "groups": sorted(groups),
                "landing": [self.landing_seq, self.landing_samples], "boundary": boundary}

    def restore_journal(self, journal: dict) -> list[Any]:
        """Continue from `journal_state` after a restart; returns the LandingsLost for the samples that were in
        flight (nothing when there were none)."""
        self.restore(journal)
        self.landing_seq, self.landing_samples = (int(v) for v in journal["landing"])
        boundary = journal.get("boundary")
        if boundary:
            self.boundaries[int(boundary["step"])] = _Boundary(boundary["state"], set(boundary["groups"]))
        groups, samples = len(journal["groups"]), int(journal["in_flight"])
        return [self._lost(groups, samples, "claimer restarted")] if samples else []

    def _lost(self, groups: int, samples: int, why: str) -> LandingsLost:
        return LandingsLost(groups, samples, why, self.step_id, self.base_version)

    def stale_announcement(self) -> list[LandingsLost]:
        """The groups dropped as stale since the last call, as one LandingsLost (module docstring)."""
        if not self._stale_groups:
            return []
        lost = self._lost(len(self._stale_groups), self._stale_samples, "stale")
        self._stale_groups, self._stale_samples = set(), 0
        return [lost]

    # ---- landing and packing --------------------------------------------------------------------------------------
    def _sequence(self, msg: SamplesLanded) -> tuple[bool, list[Any]]:
        """Check a landing's number (module docstring, Lost messages): whether to take it, and a LandingsLost for
        a gap before it."""
        number, total, size = msg.landing_seq, msg.samples_sent, len(msg.samples)
        if number <= self.landing_seq:
            if number in self._missing_landings:  # counted lost at its gap: it is not, after all
                self._missing_landings.discard(number)
                self.counts["samples_dropped_in_transit"] -= size
                self.counts["samples_landed"] -= size  # land() counts it again
                log.warning("landing_counted_lost_arrived_late", group=msg.group_id, landing=number)
                return True, [self._lost(-1, -size, "arrived late")]
            if number != 1 or all(e in self._seen_executions for e in msg.execution_ids):
                return True, []  # a repeat: the execution check refuses it
            log.warning("landings_numbered_afresh_the_builder_restarted", previous=self.landing_seq)
            self.landing_seq = self.landing_samples = 0
        published: list[Any] = []
        if number > self.landing_seq + 1:
            groups, samples = number - 1 - self.landing_seq, max(0, total - size - self.landing_samples)
            for missing in range(self.landing_seq + 1, number):
                self._missing_landings.add(missing)
            self.counts["samples_landed"] += samples
            self.counts["samples_dropped_in_transit"] += samples
            log.error("landings_lost_in_transit_counted_dropped", landings=groups, samples=samples, next=number)
            published.append(self._lost(groups, samples, "in transit"))
        self.landing_seq, self.landing_samples = number, total
        return True, published

    def land(self, msg: SamplesLanded) -> list[Any]:
        """Take one group's samples; returns the messages to publish (StepReady if a step got fixed, LandingsLost
        for a gap in the landings' numbers)."""
        published: list[Any] = []
        if msg.landing_seq:
            take, published = self._sequence(msg)
            if not take:
                return published
        self.counts["samples_landed"] += len(msg.samples)
        for boundary in self.boundaries.values():  # landed after those steps ended: not trained by then
            boundary.groups_not_trained.add(msg.group_id)
        by_execution: dict[str, list[TrainingSample]] = {}
        for sample in msg.samples:
            by_execution.setdefault(sample.execution_id, []).append(sample)
        for execution_id, samples in by_execution.items():
            if execution_id in self._seen_executions:
                self.counts["samples_duplicate"] += len(samples)
                log.error("execution_landed_twice_refused", execution=execution_id, group=msg.group_id)
                continue
            self._seen_executions.add(execution_id)
            self.counts["executions_landed"] += 1
            self.pending.append(
                _Execution(
                    execution_id,
                    tuple(samples),
                    min(s.min_weight_version for s in samples),
                    sum(len(s.token_ids) for s in samples),
                )
            )
        while len(self.pending) > self.config.max_pending_executions:
            dropped = self.pending.popleft()
            self.counts["samples_dropped_overflow"] += len(dropped.samples)
            log.warning("pending_queue_full_dropped_the_oldest_execution", execution=dropped.execution_id,
                        bound=self.config.max_pending_executions)
        published += self._fill()
        return published + self.stale_announcement()

    def _fill(self) -> list[Any]:
        """Assign pending executions to the current step until it is fixed."""
        published: list[Any] = []
        while not self.step_fixed and self.pending:
            execution = self.pending.popleft()
            if not self.config.staleness.admits(execution.min_weight_version, self.base_version):
                self._drop_stale(execution)
                continue
            self.counts["executions_assigned"] += 1
            self.step_executions += 1
            for sample in execution.samples:
                self._pack(sample)
            if self.step_executions == self.config.executions_per_step:
                published.append(self._fix_step())
        return published

    def _drop_stale(self, execution: _Execution) -> None:
        self.counts["executions_dropped_stale"] += 1
        self.counts["samples_dropped_stale"] += len(execution.samples)
        self._stale_groups |= {s.group_id for s in execution.samples}
        self._stale_samples += len(execution.samples)
        log.debug("stale_execution_dropped", execution=execution.execution_id,
                 sample_version=execution.min_weight_version, base_version=self.base_version)

    def _pack(self, sample: TrainingSample) -> None:
        size = len(sample.token_ids)
        budget = self.config.microstep_token_budget
        if size >= budget:  # too big to share: a micro-step of its own, claimable at once
            microstep = self._new_microstep()
            self._add(microstep, sample)
            self._close(microstep)
            return
        for microstep in self.open:
            if microstep.num_tokens + size <= budget:
                self._add(microstep, sample)
                if microstep.num_tokens == budget:
                    self._close(microstep)
                return
        if len(self.open) >= self.config.max_open_microsteps:
            self._close(max(self.open, key=lambda m: (m.num_tokens, -m.index)))
        microstep = self._new_microstep()
        self.open.append(microstep)
        self._add(microstep, sample)

    def _new_microstep(self) -> _MicroStep:
        microstep = _MicroStep(len(self.microsteps))
        self.microsteps[microstep.index] = microstep
        return microstep

    @staticmethod
    def _add(microstep: _MicroStep, sample: TrainingSample) -> None:
        microstep.samples.append(sample)
        microstep.num_tokens += len(sample.token_ids)

    def _close(self, microstep: _MicroStep) -> None:
        if microstep in self.open:
            self.open.remove(microstep)
        microstep.state = "queued"
        self.queue.append(microstep.index)
        self.counts["microsteps_closed"] += 1

    def _fix_step(self) -> StepReady:
        for microstep in list(self.open):
            self._close(microstep)
        self.step_fixed = True
        self.counts["steps_ready"] += 1
        self.ready_resends = 0
        self.last_ready = StepReady(
            step_id=self.step_id,
            num_microsteps=len(self.microsteps),
            num_samples=sum(len(m.samples) for m in self.microsteps.values()),
            num_executions=self.step_executions,
            base_version=self.base_version,
        )
        return self.last_ready

    def ready_published(self, now_s: float) -> None:
        """The actor published (or re-published) the current StepReady at `now_s`."""
        self.ready_sent_s = now_s

    def ready_due(self, now_s: float) -> list[StepReady]:
        """The current step's StepReady again, if it is fixed, not applied, and quiet for `step_ready_resend_s`
        (module docstring, Lost messages)."""
        limit = self.config.step_ready_resend_s
        if limit is None or not self.step_fixed or self.last_ready is None or now_s - self.ready_sent_s < limit:
            return []
        if self.ready_resends >= self.config.max_step_ready_resends:
            return []
        self.ready_resends += 1
        self.counts["step_ready_resends"] += 1
        log.warning("step_ready_announced_again", step=self.step_id, resends=self.ready_resends)
        return [self.last_ready]

    # ---- claims ---------------------------------------------------------------------------------------------------
    def _no_work(self) -> ClaimGranted:
        return ClaimGranted(-1, -1, (), 0, self.config.retry_after_s)

    def claim(self, msg: ClaimMicroStep, now_s: float) -> ClaimGranted:
        cell = self._seen(msg.cell, now_s)
        if cell.role and cell.role != TRAIN:
            return self._refuse(msg, f"its role is {cell.role}")
        if msg.weight_version != self.base_version:
            return self._refuse(msg, f"it holds version {msg.weight_version}, the step trains {self.base_version}")
        if self._claims_of(msg.cell) >= self.config.max_claims_per_cell:
            return self._refuse(msg, f"it holds {self.config.max_claims_per_cell} claims already")
        if not self.queue and self.open:
            fullest = max(self.open, key=lambda m: (m.num_tokens, -m.index))
            if fullest.num_tokens >= self.config.early_close_fraction * self.config.microstep_token_budget:
                self._close(fullest)
        if not self.queue:
            if cell.role != TRAIN:
                return self._no_work()
            self.waiting[msg.cell] = None
            return ClaimGranted(-1, -1, (), 0, self.config.waiting_retry_after_s or self.config.retry_after_s)
        self.waiting.pop(msg.cell, None)
        microstep = self.microsteps[self.queue.popleft()]
        microstep.state = "claimed"
        microstep.holder = msg.cell
        microstep.past_holders.add(msg.cell)
        self.step_granted = True
        self.counts["microsteps_granted"] += 1
        return ClaimGranted(
            step_id=self.step_id,
            microstep_index=microstep.index,
            samples=tuple(microstep.samples),
            num_executions_in_step=self.config.executions_per_step,
            retry_after_s=0.0,
        )

    def _refuse(self, msg: ClaimMicroStep, why: str) -> ClaimGranted:
        self.counts["claims_refused"] += 1
        log.debug("claim_refused", cell=msg.cell, why=why)
        return self._no_work()

    def _claims_of(self, cell: str) -> int:
        return sum(1 for m in self.microsteps.values() if m.state == "claimed" and m.holder == cell)

    def _seen(self, name: str, now_s: float) -> _Cell:
        cell = self.cells.setdefault(name, _Cell())
        cell.last_seen_s = now_s
        return cell

    def done(self, msg: MicroStepDone, now_s: float) -> None:
        self._seen(msg.cell, now_s)
        if msg.step_id != self.step_id:
            # A step already applied (this MicroStepDone lost the race with StepApplied) or a step we never gave.
            self.counts["stray_messages"] += 1
            return
        microstep = self.microsteps.get(msg.microstep_index)
        if microstep is None or msg.cell not in microstep.past_holders:
            self.counts["stray_messages"] += 1
            log.warning("micro_step_done_from_a_cell_that_never_held_it", cell=msg.cell, step=msg.step_id,
                        microstep=msg.microstep_index)
            return
        if microstep.state == "done":
            self.counts["duplicate_dones"] += 1
            return
        if microstep.state == "queued":  # re-queued after its cell was presumed gone; the late result still counts
            self.queue.remove(microstep.index)
        self._mark_done(microstep)

    def _mark_done(self, microstep: _MicroStep) -> None:
        microstep.state = "done"
        microstep.holder = ""
        self.counts["microsteps_done"] += 1
        for sample in microstep.samples:
            key = _sample_key(sample)
            if key in self._trained:
                self.counts["samples_trained_twice"] += 1
            self._trained.add(key)
        self.counts["samples_trained"] += len(microstep.samples)

    def release(self, msg: ReleaseMicroStep, now_s: float) -> None:
        self._seen(msg.cell, now_s)
        microstep = self.microsteps.get(msg.microstep_index) if msg.step_id == self.step_id else None
        if microstep is None or microstep.state != "claimed" or microstep.holder != msg.cell:
            self.counts["stray_messages"] += 1
            return
        self._requeue(microstep, "released")

    def _requeue(self, microstep: _MicroStep, why: str) -> None:
        log.info("micro_step_re_queued", step=self.step_id, microstep=microstep.index, cell=microstep.holder, why=why)
        microstep.state = "queued"
        microstep.holder = ""
        self.queue.appendleft(microstep.index)  # oldest work first: it holds the step back
        self.counts["microsteps_requeued"] += 1

    def _requeue_cell(self, cell: str, why: str) -> None:
        for microstep in sorted(self.microsteps.values(), key=lambda m: -m.index):
            if microstep.state == "claimed" and microstep.holder == cell:
                self._requeue(microstep, why)

    # ---- cells ----------------------------------------------------------------------------------------------------
    def role_changed(self, msg: RoleChanged, now_s: float) -> None:
        cell = self._seen(msg.cell, now_s)
        cell.role = msg.role
        if msg.role != TRAIN:
            self.waiting.pop(msg.cell, None)
        if msg.previous_role == "":
            self._requeue_cell(msg.cell, "the cell (re)started")
        elif msg.role != TRAIN:
            self._requeue_cell(msg.cell, f"the cell switched to {msg.role}")

    def load_report(self, msg: LoadReport, now_s: float) -> None:
        self._seen(msg.cell, now_s)

    def check_silence(self, now_s: float) -> None:
        limit = self.config.cell_silence_limit_s
        if limit is None:
            return
        for name, cell in sorted(self.cells.items()):
            if now_s - cell.last_seen_s > limit and self._claims_of(name):
                log.warning("cell_silent_while_holding_claims_presumed_dead", cell=name,
                            silent_s=now_s - cell.last_seen_s)
                self._requeue_cell(name, "the cell went silent")

    def wakeups(self) -> list[str]:
        """The waiting cells to tell ClaimsOpen, if a claim would now find work (each is told once: it is no longer
        waiting until a claim of its finds nothing again)."""
        if not self.waiting:
            return []
        threshold = self.config.early_close_fraction * self.config.microstep_token_budget
        if not self.queue and not any(m.num_tokens >= threshold for m in self.open):
            return []
        cells = list(self.waiting)
        self.waiting.clear()
        self.counts["wakeups_sent"] += len(cells)
        return cells

    @property
    def claims_held(self) -> int:
        return sum(1 for m in self.microsteps.values() if m.state == "claimed")

    # ---- steps ----------------------------------------------------------------------------------------------------
    def step_applied(self, msg: StepApplied) -> list[Any]:
        """The core applied a step: finish it, move to the next base version, drop what became too stale."""
        if msg.step_id != self.step_id:
            self.counts["stray_messages"] += 1
            log.error("step_applied_for_a_step_that_is_not_current", step=msg.step_id, current=self.step_id)
            return []
        done_samples = 0
        for microstep in self.microsteps.values():
            if microstep.state == "claimed":
                self._mark_done(microstep)  # its MicroStepDone to us is still on the way; the core had it
            elif microstep.state != "done":
                self.counts["samples_lost"] += len(microstep.samples)
                log.error("the_core_applied_a_step_without_one_of_its_micro_steps", step=self.step_id,
                          microstep=microstep.index, state=microstep.state)
            if microstep.state == "done":
                done_samples += len(microstep.samples)
        self.counts["steps_applied"] += 1
        if msg.skipped:
            # Computed but never applied: the samples are used up, not trained (module docstring).
            self.counts["steps_skipped"] += 1
            self.counts["samples_trained"] -= done_samples
            self.counts["samples_skipped"] += done_samples
            log.warning("step_skipped_by_the_core_its_samples_count_as_skipped", step=self.step_id,
                        samples=done_samples, version=msg.version)
        self.step_id = msg.step_id + 1
        self.base_version = msg.version
        self.step_fixed = False
        self.step_granted = False
        self.last_ready = None
        self.step_executions = 0
        self.microsteps = {}
        self.open = []
        self.queue.clear()
        kept: collections.deque[_Execution] = collections.deque()
        for execution in self.pending:
            if self.config.staleness.admits(execution.min_weight_version, self.base_version):
                kept.append(execution)
            else:
                self._drop_stale(execution)
        self.pending = kept
        published = self._fill()
        self._note_boundary(msg.step_id)
        return published + self.stale_announcement()

    # ---- reports --------------------------------------------------------------------------------------------------
    def samples_in_flight(self) -> int:
        pending = sum(len(e.samples) for e in self.pending)
        packed = sum(len(m.samples) for m in self.microsteps.values() if m.state != "done")
        return pending + packed

    def statistics(self) -> ClaimerStatistics:
        c = self.counts
        return ClaimerStatistics(
            samples_landed=c["samples_landed"],
            samples_trained=c["samples_trained"],
            samples_skipped=c["samples_skipped"],
            samples_dropped_stale=c["samples_dropped_stale"],
            samples_dropped_overflow=c["samples_dropped_overflow"],
            samples_duplicate=c["samples_duplicate"],
            samples_lost=c["samples_lost"],
            samples_in_flight=self.samples_in_flight(),
            samples_trained_twice=c["samples_trained_twice"],
            executions_landed=c["executions_landed"],
            executions_assigned=c["executions_assigned"],
            executions_dropped_stale=c["executions_dropped_stale"],
            microsteps_closed=c["microsteps_closed"],
            microsteps_granted=c["microsteps_granted"],
            microsteps_done=c["microsteps_done"],
            microsteps_requeued=c["microsteps_requeued"],
            duplicate_dones=c["duplicate_dones"],
            stray_messages=c["stray_messages"],
            claims_refused=c["claims_refused"],
            steps_ready=c["steps_ready"],
            steps_applied=c["steps_applied"],
            steps_skipped=c["steps_skipped"],
            step_id=self.step_id,
            base_version=self.base_version,
            samples_rerolled=c["samples_rerolled"],
            samples_dropped_in_transit=c["samples_dropped_in_transit"],
            samples_dropped_restart=c["samples_dropped_restart"],
            step_ready_resends=c["step_ready_resends"],
            wakeups_sent=c["wakeups_sent"],
        )

    def backlog(self, now_s: float) -> TrainingBacklog:
        states = collections.Counter(m.state for m in self.microsteps.values())
        claims: dict[str, int] = {}
        for microstep in self.microsteps.values():
            if microstep.state == "claimed":
                claims[microstep.holder] = claims.get(microstep.holder, 0) + 1
        return TrainingBacklog(
            step_id=self.step_id,
            base_version=self.base_version,
            step_fixed=self.step_fixed,
            claimable_microsteps=states["queued"],
            claimed_microsteps=states["claimed"],
            done_microsteps=states["done"],
            open_tokens=sum(m.num_tokens for m in self.open),
            executions_in_step=self.step_executions,
            executions_per_step=self.config.executions_per_step,
            pending_executions=len(self.pending),
            claims_by_cell=dict(sorted(claims.items())),
            time_s=now_s,
        )


def check_exactly_once(stats: ClaimerStatistics, *, lost_ok: bool = False) -> None:
    """Raise AccountingError unless every landed sample is trained once, skipped with its step, dropped with a reason
    (stale, overflow, duplicate, lost in transit, in flight at a restart), re-rolled at a resume, or still in flight.

    `lost_ok` skips the check that no sample was lost: the claimer itself uses it, because a loss means the core
    applied a step early (its bug, logged as an error), while an unbalanced ledger or a double training is ours.
    """
    accounted = (
        stats.samples_trained + stats.samples_skipped + stats.samples_dropped_stale + stats.samples_dropped_overflow
        + stats.samples_duplicate + stats.samples_lost + stats.samples_in_flight + stats.samples_rerolled
        + stats.samples_dropped_in_transit + stats.samples_dropped_restart
    )
    problems = []
    if accounted != stats.samples_landed:
        problems.append(f"{stats.samples_landed} samples landed but {accounted} are accounted for")
    if stats.samples_lost and not lost_ok:
        problems.append(f"{stats.samples_lost} samples lost (applied without being trained)")
    if stats.samples_trained_twice:
        problems.append(f"{stats.samples_trained_twice} samples trained twice")
    if problems:
        raise AccountingError("; ".join(problems))


class MicroStepClaimer(Actor):
    """Hosts a MicroStepLedger: SamplesLanded in, ClaimGranted / StepReady / TrainingBacklog out (module docstring)."""

    config_cls = ClaimerConfig
    subscriptions = (RoleChanged, LoadReport, StepApplied)

    async def on_start(self) -> None:
        self.ledger = MicroStepLedger(self.config)
        self._journal_key: tuple | None = None
        self._ending = ""
        """Why this instance ends the run (a restart that cannot rebuild its step): it then takes no StepApplied,
        so the checkpoint it serves stays the last boundary before its failure."""
        self._last_backlog: TrainingBacklog | None = None
        self._tick_armed = False
        journal = Path(self.config.journal_path) if self.config.journal_path else None
        if self.restarts and journal is not None and journal.exists():
            await self._restart_from(journal)
            return
        if self.restarts:
            # Started empty, it would wait at step 0 while the core trains a later one: the run would hang.
            self._ending = ("the micro-step claimer restarted without a journal (ClaimerConfig.journal_path): its "
                            "ledger died with it; the run ends here: resume it from its last checkpoint (gyre run "
                            "FILE --report DIR --resume)")
            self.log.error("claimer_restarted_without_a_journal")
            self.stop_topology(self._ending, 1)
            self._after()
            return
        if self.config.resume_from:
            state, checkpoint = await self.offload(read_actor_state, self.config.resume_from, self.name)
            self.ledger.restore(state)
            self.log.info("claimer_restored", checkpoint=str(checkpoint.path), step_id=self.ledger.step_id,
                          base_version=self.ledger.base_version, rerolled=self.ledger.counts["samples_rerolled"])
        self._after()

    async def _restart_from(self, journal: Path) -> None:
        """A restart: the ledger from the journal, or the run's end (module docstring, Claimer restarts)."""
        state = decode_json(await self.offload(journal.read_bytes))
        lost = self.ledger.restore_journal(state)
        self.log.warning("claimer_restarted_from_its_journal", step_id=self.ledger.step_id,
                         base_version=self.ledger.base_version, samples_dropped=state["in_flight"],
                         groups_dropped=len(state["groups"]), granted=state["granted"])
        if state["granted"]:
            self._ending = (
                f"the micro-step claimer restarted after micro-steps of step {self.ledger.step_id} were handed out: "
                "their samples died with it, so that step cannot be trained exactly once; the run ends here: resume "
                "it from its last checkpoint (gyre run FILE --report DIR --resume)")
            self.stop_topology(self._ending, 1)
        self._after(lost)

    def _write_journal(self) -> None:
        key = self.ledger.journal_key()
        if not self.config.journal_path or key == self._journal_key:
            return
        self._journal_key = key
        path = Path(self.config.journal_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        temp = path.with_name(f".tmp-{path.name}")
        temp.write_bytes(encode_json(self.ledger.journal_state()))
        temp.replace(path)  # no fsync: the journal serves restarts on this machine, not a machine's crash

    def statistics(self) -> ClaimerStatistics:
        return self.ledger.statistics()

    # Every handler ends in _after(): publish what changed and arm the silence check while claims are held.
    def _after(self, published: list[Any] = ()) -> None:
        for msg in published:
            if isinstance(msg, StepReady):
                self.log.info("step_ready", step=msg.step_id, microsteps=msg.num_microsteps, samples=msg.num_samples)
                self.ledger.ready_published(self.clock.now())
            self.publish(msg)
        self._write_journal()
        self._publish_backlog()
        for cell in self.ledger.wakeups():
            self.tell(cell, ClaimsOpen(self.ledger.step_id))
        silence = self.ledger.claims_held and self.config.cell_silence_limit_s is not None
        resend = self.ledger.step_fixed and self.config.step_ready_resend_s is not None
        if (silence or resend) and not self._tick_armed:
            self._tick_armed = True
            self.send_later(self.config.liveness_check_s, ClaimerTick())

    def _publish_backlog(self) -> None:
        backlog = self.ledger.backlog(self.clock.now())
        if self._last_backlog is not None and attrs.evolve(backlog, time_s=0.0) == attrs.evolve(
            self._last_backlog, time_s=0.0
        ):
            return
        self._last_backlog = backlog
        self.publish(backlog)

    @handler(SamplesLanded)
    def on_samples_landed(self, msg: SamplesLanded) -> None:
        self._after(self.ledger.land(msg))

    @handler(ClaimMicroStep)
    def on_claim(self, msg: ClaimMicroStep) -> ClaimGranted:
        granted = self.ledger.claim(msg, self.clock.now())
        if granted.step_id >= 0:
            self._after()  # a claim that gets nothing changes nothing to publish, journal or arm (only liveness)
        return granted

    @handler(MicroStepDone)
    def on_done(self, msg: MicroStepDone) -> None:
        self.ledger.done(msg, self.clock.now())
        self._after()

    @handler(ReleaseMicroStep)
    def on_release(self, msg: ReleaseMicroStep) -> None:
        self.ledger.release(msg, self.clock.now())
        self._after()

    @handler(RoleChanged)
    def on_role_changed(self, msg: RoleChanged) -> None:
        self.ledger.role_changed(msg, self.clock.now())
        self._after()

    @handler(LoadReport)
    def on_load_report(self, msg: LoadReport) -> None:
        self.ledger.load_report(msg, self.clock.now())

    @handler(StepApplied)
    def on_step_applied(self, msg: StepApplied) -> None:
        if self._ending:
            self.log.warning("step_applied_ignored_the_run_is_ending", step=msg.step_id, why=self._ending)
            return
        published = self.ledger.step_applied(msg)
        stats = self.ledger.statistics()
        self.log.info("step_applied", step=msg.step_id, version=msg.version, skipped=msg.skipped,
                      trained=stats.samples_trained, stale=stats.samples_dropped_stale)
        check_exactly_once(stats, lost_ok=True)  # a failure here is a bug in the ledger: fail loudly
        self._after(published)

    @handler(CheckpointAsked)
    def on_checkpoint_asked(self, msg: CheckpointAsked) -> CheckpointState:
        state, groups = self.ledger.checkpoint_state(msg.step_id)
        return CheckpointState(self.name, msg.step_id, encode_json(state), groups)

    @handler(ClaimerTick)
    def on_tick(self, msg: ClaimerTick) -> None:
        self._tick_armed = False
        self.ledger.check_silence(self.clock.now())
        self._after(self.ledger.ready_due(self.clock.now()))
