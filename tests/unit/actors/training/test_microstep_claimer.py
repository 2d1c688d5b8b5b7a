"""The micro-step claimer's ledger (steps, packing, claims, exactly once), its actor, and the staleness contract."""

from __future__ import annotations

import random

import attrs
import pytest

from gyre.actors.training.microstep_claimer import (
    AccountingError,
    ClaimerConfig,
    ClaimerConfigError,
    MicroStepClaimer,
    MicroStepLedger,
    check_exactly_once,
)
from gyre.messages.cells import LoadReport, RoleChanged
from gyre.messages.samples import SamplesLanded, TrainingSample
from gyre.messages.runtime_control import StatisticsAsked
from gyre.messages.scheduling import ClaimerStatistics, TrainingBacklog
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
from gyre.runtime import Actor, Codec, RunOptions, Topology, VirtualLauncher, handler, read_log


# ---- builders -----------------------------------------------------------------------------------------------------
def sample(execution: str, rank: int, tokens: int, version: int = 0, group: str = "g") -> TrainingSample:
    mask = (False,) + (True,) * (tokens - 1)
    return TrainingSample(
        execution_id=execution, group_id=group, trajectory_rank=rank, trajectory_kind="main", leaf_call_index=rank,
        token_ids=tuple(range(tokens)), loss_mask=mask, behaviour_logprobs=tuple(-0.5 if m else 0.0 for m in mask),
        advantages=(1.0,) * tokens, weights=tuple(1.0 / (tokens - 1) if m else 0.0 for m in mask),
        min_weight_version=version, max_weight_version=version, num_loss_tokens=tokens - 1,
        sampling_temperatures=(1.0,) * tokens,
    )


def group(name: str, tokens_per_execution: list[list[int]], version: int = 0) -> SamplesLanded:
    """A landed group: execution i of `name` has one sample per entry of tokens_per_execution[i]."""
    samples = tuple(
        sample(f"{name}.{i}", rank, n, version, name)
        for i, sizes in enumerate(tokens_per_execution) for rank, n in enumerate(sizes)
    )
    ids = tuple(f"{name}.{i}" for i in range(len(tokens_per_execution)))
    return SamplesLanded(
        group_id=name, samples=samples, execution_ids=ids, rewards=(0.0,) * len(ids), advantages=(0.0,) * len(ids),
        num_dropped=0, num_tokens=sum(len(s.token_ids) for s in samples),
        num_loss_tokens=sum(s.num_loss_tokens for s in samples),
        min_weight_version=min((s.min_weight_version for s in samples), default=-1),
        max_weight_version=max((s.max_weight_version for s in samples), default=-1),
    )


def config(**overrides) -> ClaimerConfig:
    base = dict(groups_per_step=2, group_size=2, microstep_token_budget=100, early_close_fraction=1.0,
                max_claims_per_cell=1, retry_after_s=0.25)
    base.update(overrides)
    return ClaimerConfig(**base)


def claim(ledger: MicroStepLedger, cell: str = "c", version: int | None = None, now: float = 0.0) -> ClaimGranted:
    return ledger.claim(ClaimMicroStep(cell, ledger.base_version if version is None else version), now)


def done(ledger: MicroStepLedger, granted: ClaimGranted, cell: str = "c", now: float = 0.0) -> None:
    ledger.done(MicroStepDone(cell, granted.step_id, granted.microstep_index, "", 0, 0, 1, 0.0), now)


def tokens(granted: ClaimGranted) -> int:
    return sum(len(s.token_ids) for s in granted.samples)


# ---- config ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("field, value", [
    ("groups_per_step", 0), ("group_size", -1), ("microstep_token_budget", 0), ("early_close_fraction", 1.5),
    ("max_claims_per_cell", 0), ("retry_after_s", 0.0), ("cell_silence_limit_s", -1.0),
])
def test_config_rejects_impossible_values(field, value):
    with pytest.raises(ClaimerConfigError, match=field):
        ClaimerConfig(**{field: value})


def test_config_rejects_a_staleness_policy_that_breaks_the_contract():
    @attrs.frozen
    class RefusesFresh:
        def admits(self, sample_version: int, base_version: int) -> bool:
            return base_version - sample_version >= 1

    with pytest.raises(ClaimerConfigError, match="fresh data refused"):
        ClaimerConfig(staleness=RefusesFresh())


# ---- steps ----------------------------------------------------------------------------------------------------------
def test_a_step_is_exactly_groups_times_group_size_executions_and_groups_may_straddle():
    ledger = MicroStepLedger(config(groups_per_step=2, group_size=2))  # E = 4
    assert ledger.land(group("a", [[10], [10], [10]])) == []  # 3 executions: not fixed
    assert ledger.step_executions == 3 and not ledger.step_fixed
    published = ledger.land(group("b", [[20, 5], [10], [10]]))  # b.0 completes the step; b.1, b.2 wait
    assert published == [StepReady(step_id=0, num_microsteps=1, num_samples=5, num_executions=4, base_version=0)]
    assert [e.execution_id for e in ledger.pending] == ["b.1", "b.2"]
    stats = ledger.statistics()
    assert (stats.samples_landed, stats.samples_in_flight, stats.executions_assigned) == (7, 7, 4)


def test_execution_samples_stay_in_one_step_and_every_claim_carries_the_step_execution_count():
    ledger = MicroStepLedger(config(groups_per_step=1, group_size=3, microstep_token_budget=30))
    ledger.land(group("a", [[20, 20], [20], [20, 20]]))  # E = 3: one step, 5 samples of 20 tokens
    grants = []
    while (granted := claim(ledger)).step_id != -1:
        grants.append(granted)
        done(ledger, granted)
    assert len(grants) == 5 and {g.num_executions_in_step for g in grants} == {3}
    assert sorted(s.execution_id for g in grants for s in g.samples) == ["a.0", "a.0", "a.1", "a.2", "a.2"]


def test_packing_respects_the_budget_first_fit_and_an_oversized_sample_goes_alone():
    ledger = MicroStepLedger(config(groups_per_step=1, group_size=5, microstep_token_budget=100,
                                    max_open_microsteps=2))
    ledger.land(group("a", [[60], [50], [30], [150], [20]]))
    # 60 -> m0; 50 -> m1 (no room in m0); 30 -> m0 (90); 150 -> m2 alone; 20 -> m1 (70); fixed: m0, m1 close.
    contents = {i: [len(s.token_ids) for s in m.samples] for i, m in ledger.microsteps.items()}
    assert contents == {0: [60, 30], 1: [50, 20], 2: [150]}
    assert list(ledger.queue) == [2, 0, 1]  # the oversized one was claimable at once


def test_the_fullest_open_microstep_closes_when_a_sample_fits_none():
    ledger = MicroStepLedger(config(groups_per_step=1, group_size=4, microstep_token_budget=100,
                                    max_open_microsteps=2))
    ledger.land(group("a", [[70], [80], [60]]))
    # 70 -> m0, 80 -> m1, 60 fits neither: m1 (fullest) closes, 60 opens m2.
    assert list(ledger.queue) == [1]
    assert [m.index for m in ledger.open] == [0, 2]


def test_microsteps_stream_before_the_step_is_fixed():
    ledger = MicroStepLedger(config(groups_per_step=3, group_size=2, microstep_token_budget=50,
                                    early_close_fraction=0.5))
    ledger.land(group("a", [[40], [40]]))  # 40 opens m0; 40 fits nowhere... m0 stays open (max_open 2): m1 opens
    assert not ledger.step_fixed
    granted = claim(ledger)
    assert granted.step_id == 0 and tokens(granted) == 40 and granted.num_executions_in_step == 6


def test_a_claim_closes_an_open_microstep_only_when_it_is_full_enough():
    ledger = MicroStepLedger(config(groups_per_step=2, group_size=2, microstep_token_budget=100,
                                    early_close_fraction=0.5))
    ledger.land(group("a", [[30]]))
    assert claim(ledger) == ClaimGranted(-1, -1, (), 0, 0.25)
    ledger.land(group("b", [[25]]))  # 55 tokens open: above half the budget
    granted = claim(ledger)
    assert granted.step_id == 0 and tokens(granted) == 55


# ---- claims -------------------------------------------------------------------------------------------------------
def test_claims_are_refused_for_the_wrong_version_role_or_beyond_the_limit():
    ledger = MicroStepLedger(config(groups_per_step=1, group_size=3, microstep_token_budget=10))
    ledger.land(group("a", [[10], [10], [10]]))
    assert claim(ledger, version=7).step_id == -1
    ledger.role_changed(RoleChanged("r", "rollout", "train", "http://r", 0, 1.0, 0, False), 0.0)
    assert claim(ledger, cell="r").step_id == -1
    assert claim(ledger, cell="c").step_id == 0
    assert claim(ledger, cell="c").step_id == -1  # max_claims_per_cell = 1
    assert ledger.statistics().claims_refused == 3
    assert claim(ledger, cell="d").step_id == 0


def test_done_duplicates_and_strays_are_counted_and_ignored():
    ledger = MicroStepLedger(config(groups_per_step=1, group_size=2, microstep_token_budget=10))
    ledger.land(group("a", [[10], [10]]))
    first = claim(ledger, "c")
    done(ledger, first, "c")
    done(ledger, first, "c")
    done(ledger, first, "x")  # never held it
    ledger.done(MicroStepDone("c", 5, 0, "", 0, 0, 1, 0.0), 0.0)  # another step
    stats = ledger.statistics()
    assert (stats.samples_trained, stats.duplicate_dones, stats.stray_messages) == (1, 1, 2)
    check_exactly_once(stats)


def test_release_requeues_at_the_front_and_only_the_holder_can_release():
    ledger = MicroStepLedger(config(groups_per_step=1, group_size=3, microstep_token_budget=10))
    ledger.land(group("a", [[10], [10], [10]]))
    granted = claim(ledger, "c")
    ledger.release(ReleaseMicroStep("x", 0, granted.microstep_index), 0.0)
    assert ledger.statistics().stray_messages == 1
    ledger.release(ReleaseMicroStep("c", 0, granted.microstep_index), 0.0)
    again = claim(ledger, "d")
    assert again.microstep_index == granted.microstep_index and again.samples == granted.samples
    assert ledger.statistics().microsteps_requeued == 1


@pytest.mark.parametrize("why", ["switched", "restarted", "silent"])
def test_claims_of_a_cell_that_leaves_are_requeued_and_a_late_done_still_counts_once(why):
    ledger = MicroStepLedger(config(groups_per_step=1, group_size=2, microstep_token_budget=10,
                                    cell_silence_limit_s=30.0))
    ledger.land(group("a", [[10], [10]]))
    held = claim(ledger, "c", now=0.0)
    if why == "switched":
        ledger.role_changed(RoleChanged("c", "rollout", "train", "http://c", 0, 1.0, 0, False), 1.0)
    elif why == "restarted":
        ledger.role_changed(RoleChanged("c", "train", "", "", 0, 0.0, 0, False), 1.0)
    else:
        ledger.load_report(LoadReport("d", "train", "", 0, 0, 0, 0, 0, 0, 0, 20.0), 20.0)
        ledger.check_silence(29.0)
        assert ledger.statistics().microsteps_requeued == 0  # not silent long enough
        ledger.check_silence(31.0)
    assert ledger.statistics().microsteps_requeued == 1
    retaken = claim(ledger, "d", now=32.0)
    assert retaken.microstep_index == held.microstep_index
    done(ledger, held, "c")  # the first holder's result arrives after all: first done wins
    done(ledger, retaken, "d")
    stats = ledger.statistics()
    assert (stats.samples_trained, stats.duplicate_dones) == (1, 1)
    check_exactly_once(stats)


def test_a_late_done_for_a_requeued_unclaimed_microstep_takes_it_out_of_the_queue():
    ledger = MicroStepLedger(config(groups_per_step=1, group_size=1, microstep_token_budget=10))
    ledger.land(group("a", [[10]]))
    held = claim(ledger, "c")
    ledger.release(ReleaseMicroStep("c", 0, held.microstep_index), 0.0)
    done(ledger, held, "c")
    assert claim(ledger, "d").step_id == -1
    assert ledger.statistics().samples_trained == 1


# ---- steps applied, staleness -------------------------------------------------------------------------------------
def test_step_applied_finishes_claimed_microsteps_advances_the_base_and_fills_the_next_step():
    ledger = MicroStepLedger(config(groups_per_step=1, group_size=2, microstep_token_budget=10))
    ledger.land(group("a", [[10], [10]]))
    ledger.land(group("b", [[10], [10]]))
    first, second = claim(ledger, "c"), claim(ledger, "d")
    done(ledger, first, "c")
    published = ledger.step_applied(StepApplied(0, 1, 0.0, 0.0, 20, 2, 0))  # second's done is still on its way
    assert published == [StepReady(step_id=1, num_microsteps=2, num_samples=2, num_executions=2, base_version=1)]
    done(ledger, second, "d")  # late: already counted by the apply
    stats = ledger.statistics()
    assert (stats.samples_trained, stats.stray_messages, stats.step_id, stats.base_version) == (2, 1, 1, 1)
    assert claim(ledger, "c", version=0).step_id == -1 and claim(ledger, "c", version=1).step_id == 1
    check_exactly_once(stats)


def test_a_skipped_step_uses_its_samples_up_as_skipped_and_keeps_the_base_version():
    ledger = MicroStepLedger(config(groups_per_step=1, group_size=2, microstep_token_budget=10))
    ledger.land(group("a", [[10], [10]]))
    ledger.land(group("b", [[10], [10]]))
    first, second = claim(ledger, "c"), claim(ledger, "d")
    done(ledger, first, "c")  # second's done is still on its way when the core skips the step
    published = ledger.step_applied(StepApplied(0, 0, float("nan"), float("nan"), 20, 2, 0, skipped=True))
    assert published == [StepReady(step_id=1, num_microsteps=2, num_samples=2, num_executions=2, base_version=0)]
    stats = ledger.statistics()
    assert (stats.samples_trained, stats.samples_skipped, stats.steps_applied, stats.steps_skipped) == (0, 2, 1, 1)
    assert (stats.step_id, stats.base_version) == (1, 0)
    check_exactly_once(stats)
    while (granted := claim(ledger, "c", version=0)).step_id == 1:  # the same weights train the next step
        done(ledger, granted, "c")
    ledger.step_applied(StepApplied(1, 1, 0.1, 1.0, 20, 2, 0))
    stats = ledger.statistics()
    assert (stats.samples_trained, stats.samples_skipped, stats.steps_skipped, stats.base_version) == (2, 2, 1, 1)
    check_exactly_once(stats)


def test_stale_executions_are_dropped_when_assigned_and_when_the_base_moves_on():
    ledger = MicroStepLedger(config(groups_per_step=1, group_size=2, microstep_token_budget=10,
                                    staleness=MaxVersionLag(1), base_version=5))
    ledger.land(group("old", [[10], [10]], version=3))  # lag 2: dropped at once
    assert ledger.statistics().samples_dropped_stale == 2 and ledger.step_executions == 0
    ledger.land(group("a", [[10], [10]], version=4))  # lag 1: fixes step 0
    ledger.land(group("b", [[10], [10]], version=4))  # waits; at base 6 it has lag 2
    for _ in range(2):
        done(ledger, claim(ledger, "c"), "c")
    ledger.step_applied(StepApplied(0, 6, 0.0, 0.0, 20, 2, 0))
    stats = ledger.statistics()
    assert (stats.samples_dropped_stale, stats.executions_dropped_stale, stats.samples_in_flight) == (4, 4, 0)
    check_exactly_once(stats)


def test_an_execution_is_as_stale_as_its_oldest_sample():
    ledger = MicroStepLedger(config(groups_per_step=1, group_size=1, microstep_token_budget=10,
                                    staleness=MaxVersionLag(0), base_version=2))
    landed = group("a", [[10, 10]], version=2)
    older = attrs.evolve(landed.samples[1], min_weight_version=1)
    ledger.land(attrs.evolve(landed, samples=(landed.samples[0], older)))
    assert ledger.statistics().samples_dropped_stale == 2


def test_applying_a_step_with_unclaimed_microsteps_is_reported_as_lost():
    ledger = MicroStepLedger(config(groups_per_step=1, group_size=2, microstep_token_budget=10))
    ledger.land(group("a", [[10], [10]]))
    ledger.step_applied(StepApplied(0, 1, 0.0, 0.0, 20, 2, 0))
    stats = ledger.statistics()
    assert stats.samples_lost == 2
    check_exactly_once(stats, lost_ok=True)
    with pytest.raises(AccountingError, match="lost"):
        check_exactly_once(stats)


def test_a_step_applied_out_of_turn_is_ignored():
    ledger = MicroStepLedger(config())
    assert ledger.step_applied(StepApplied(3, 9, 0.0, 0.0, 0, 0, 0)) == []
    assert (ledger.step_id, ledger.base_version, ledger.statistics().stray_messages) == (0, 0, 1)


def test_duplicate_executions_and_pending_overflow_are_counted():
    ledger = MicroStepLedger(config(groups_per_step=1, group_size=1, microstep_token_budget=10,
                                    max_pending_executions=2))
    ledger.land(group("a", [[10]]))  # fixes step 0
    ledger.land(group("a", [[10]]))  # the same execution again
    ledger.land(group("b", [[10], [10], [10]]))  # 3 pending, bound 2: b.0 dropped
    stats = ledger.statistics()
    assert (stats.samples_duplicate, stats.samples_dropped_overflow) == (1, 1)
    assert [e.execution_id for e in ledger.pending] == ["b.1", "b.2"]
    check_exactly_once(stats)


def test_check_exactly_once_catches_an_unbalanced_ledger():
    ledger = MicroStepLedger(config())
    ledger.land(group("a", [[10]]))
    stats = attrs.evolve(ledger.statistics(), samples_in_flight=0)
    with pytest.raises(AccountingError, match="1 samples landed but 0"):
        check_exactly_once(stats)
    with pytest.raises(AccountingError, match="trained twice"):
        check_exactly_once(attrs.evolve(ledger.statistics(), samples_trained_twice=1))


@pytest.mark.parametrize("seed", range(6))
def test_randomised_cells_train_every_sample_exactly_once(seed):
    """Cells claim, finish, release, switch away, restart and go silent in a seeded random order; the core applies a
    step once all its micro-steps are done. Every admitted sample is trained exactly once, whatever the order."""
    rng = random.Random(seed)
    ledger = MicroStepLedger(config(groups_per_step=2, group_size=3, microstep_token_budget=64,
                                    early_close_fraction=0.5, max_claims_per_cell=2, staleness=MaxVersionLag(1),
                                    cell_silence_limit_s=5.0))
    cells = ["c0", "c1", "c2"]
    held: dict[str, list[ClaimGranted]] = {c: [] for c in cells}
    trained: list[tuple[str, int]] = []
    now, groups_landed, version = 0.0, 0, 0
    while ledger.statistics().steps_applied < 6:
        now += 1.0
        action = rng.random()
        cell = rng.choice(cells)
        if action < 0.12 and groups_landed < 80:
            sizes = [[rng.randint(5, 70) for _ in range(rng.randint(1, 3))] for _ in range(rng.randint(1, 3))]
            ledger.land(group(f"g{groups_landed}", sizes, version=max(0, version - (rng.random() < 0.2))))
            groups_landed += 1
        elif action < 0.5:
            granted = claim(ledger, cell, now=now)
            if granted.step_id != -1:
                held[cell].append(granted)
        elif action < 0.8 and held[cell]:
            granted = held[cell].pop(rng.randrange(len(held[cell])))
            before = ledger.statistics().samples_trained
            done(ledger, granted, cell, now)  # may be late, a duplicate or for a step already applied
            if ledger.statistics().samples_trained > before:
                trained.extend((s.execution_id, s.trajectory_rank) for s in granted.samples)
        elif action < 0.85 and held[cell]:
            granted = held[cell].pop()
            ledger.release(ReleaseMicroStep(cell, granted.step_id, granted.microstep_index), now)
        elif action < 0.9:
            ledger.role_changed(RoleChanged(cell, "train", "" if rng.random() < 0.5 else "rollout", "", version,
                                            0.0, 0, False), now)
            held[cell] = []
        elif action < 0.95:
            ledger.check_silence(now + 10.0)  # everyone looks silent: claims go back, but cells may still finish
        elif groups_landed >= 80 and not ledger.step_fixed:
            break  # no more data will come: the last step cannot fill
        if ledger.step_fixed and all(m.state == "done" for m in ledger.microsteps.values()):
            version += 1
            ledger.step_applied(StepApplied(ledger.step_id, version, 0.0, 0.0, 0, 0, 0))
        check_exactly_once(ledger.statistics())
    stats = ledger.statistics()
    assert len(trained) == len(set(trained)) == stats.samples_trained
    assert stats.steps_applied >= 1 and stats.samples_trained > 0
    check_exactly_once(stats)


# ---- wake-ups ------------------------------------------------------------------------------------------------------
def train(ledger: MicroStepLedger, cell: str) -> None:
    ledger.role_changed(RoleChanged(cell, "train", "rollout", "", 0, 1.0, 0, False), 0.0)


def test_a_train_cell_that_finds_no_work_waits_and_is_woken_once_when_work_is_claimable():
    ledger = MicroStepLedger(config(groups_per_step=2, group_size=2, microstep_token_budget=100,
                                    early_close_fraction=0.5, waiting_retry_after_s=30.0))
    train(ledger, "t1")
    train(ledger, "t2")
    assert claim(ledger, "t1") == ClaimGranted(-1, -1, (), 0, 30.0)  # it will be woken: the poll is the fallback
    assert claim(ledger, "t2").retry_after_s == 30.0
    assert claim(ledger, "stranger").retry_after_s == 0.25  # no RoleChanged: never woken, so it polls
    assert claim(ledger, "t1", version=3).retry_after_s == 0.25  # wrong weights: it asks again once it has them
    ledger.land(group("a", [[30]]))
    assert ledger.wakeups() == []  # 30 of 100 open: a claim would still find nothing
    ledger.land(group("b", [[25]]))  # 55: a claim would close it early
    assert ledger.wakeups() == ["t1", "t2"]
    assert ledger.wakeups() == []  # told once
    assert claim(ledger, "t2").step_id == 0
    assert claim(ledger, "t1").step_id == -1  # woken, but t2 took it: waiting again
    ledger.role_changed(RoleChanged("t1", "rollout", "train", "http://t1", 0, 1.0, 0, False), 0.0)
    ledger.land(group("c", [[100]]))  # queued at once (full)
    assert ledger.wakeups() == []  # t1 left the train role
    assert ledger.statistics().wakeups_sent == 2


def test_without_waiting_retry_after_a_waiting_cell_is_told_the_usual_poll():
    ledger = MicroStepLedger(config())
    train(ledger, "t")
    assert claim(ledger, "t").retry_after_s == 0.25
    ledger.land(group("a", [[100]]))
    assert ledger.wakeups() == ["t"]


@attrs.frozen
class SleeperConfig:
    """Nothing to configure."""


class Sleeper(Actor):
    """A train cell that polls once an hour: only a ClaimsOpen can get it its micro-step early."""

    config_cls = SleeperConfig

    async def on_start(self) -> None:
        self.publish(RoleChanged(self.name, "train", "", "", 0, 0.0, 0, False))
        self.send_later(1.0, ClaimsOpen(-1))  # its first claim, after the claimer has its RoleChanged

    @handler(ClaimsOpen)
    async def on_open(self, msg: ClaimsOpen) -> None:
        granted = await self.ask("claimer", ClaimMicroStep(self.name, 0))
        if granted.step_id >= 0:
            self.stop_topology(f"granted at {self.clock.now():.1f} s")


class Lander(Actor):
    """Lands one full group at 5 s."""

    config_cls = SleeperConfig

    async def on_start(self) -> None:
        self.send_later(5.0, group("a", [[60], [60]]))

    @handler(SamplesLanded)
    def on_landed(self, msg: SamplesLanded) -> None:
        self.tell("claimer", msg)


def test_the_claimer_actor_wakes_a_waiting_cell_when_its_work_lands():
    topology = Topology("wake", seed=1)
    topology.add("claimer", MicroStepClaimer, config(groups_per_step=1, group_size=2, microstep_token_budget=60,
                                                     retry_after_s=3600.0, waiting_retry_after_s=3600.0))
    topology.add("t", Sleeper, SleeperConfig())
    topology.add("lander", Lander, SleeperConfig())
    result = VirtualLauncher().run(topology, RunOptions(until_s=100.0))
    assert result.reason == "granted at 5.0 s"


# ---- the actor ------------------------------------------------------------------------------------------------------
@attrs.frozen
class DriverConfig:
    """Nothing to configure."""


class Driver(Actor):
    """Lands two groups, trains the step as one cell, and ends the run with the claimer's statistics in the log."""

    config_cls = DriverConfig
    subscriptions = (StepReady, TrainingBacklog)

    async def on_start(self) -> None:
        self.ready: list[StepReady] = []
        self.tell("claimer", group("a", [[30], [30]]))
        self.tell("claimer", group("b", [[30], [30]]))
        self.tell("claimer", RoleChanged("driver", "train", "", "", 0, 0.0, 0, True))

    @handler(TrainingBacklog)
    def on_backlog(self, msg: TrainingBacklog) -> None:
        pass

    @handler(StepReady)
    async def on_ready(self, msg: StepReady) -> None:
        while (granted := await self.ask("claimer", ClaimMicroStep("driver", 0))).step_id != -1:
            self.tell("claimer", MicroStepDone("driver", granted.step_id, granted.microstep_index, "", 0, 0, 30, 0.0))
        self.publish(StepApplied(msg.step_id, 1, 0.0, 0.0, 120, msg.num_samples, 0))
        stats = await self.ask("claimer", StatisticsAsked())
        self.stop_topology(f"trained {stats.samples_trained}")


def test_the_claimer_actor_publishes_step_ready_and_backlog_and_answers_statistics(tmp_path):
    topology = Topology("claimer", seed=3)
    topology.add("claimer", MicroStepClaimer, config(groups_per_step=2, group_size=2, microstep_token_budget=60))
    topology.add("driver", Driver, DriverConfig())
    log_path = tmp_path / "claimer.glog"
    result = VirtualLauncher().run(topology, RunOptions(log_path=str(log_path), until_s=100.0))
    assert result.reason == "trained 4"
    codec = Codec()
    messages = [r.decode(codec) for r in read_log(log_path)]
    ready = [m for m in messages if isinstance(m, StepReady)]
    assert ready == [StepReady(step_id=0, num_microsteps=2, num_samples=4, num_executions=4, base_version=0)]
    backlogs = [m for m in messages if isinstance(m, TrainingBacklog)]
    assert backlogs[0].executions_in_step == 0 and any(b.step_fixed for b in backlogs)
    assert backlogs[-1].step_id == 1 and backlogs[-1].base_version == 1
    stats = [m for m in messages if isinstance(m, ClaimerStatistics)][-1]
    assert (stats.samples_trained, stats.steps_applied) == (4, 1)
    check_exactly_once(stats)


# ---- the staleness contract ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("lag", [0, 1, 3])
def test_max_version_lag_passes_the_contract_and_means_t_minus_v_at_most_s(lag):
    policy = MaxVersionLag(lag)
    check_staleness_policy(policy)
    assert policy.admits(10 - lag, 10) and not policy.admits(9 - lag, 10) and policy.admits(11, 10)


@pytest.mark.parametrize("lag", [-1, 1.5, True])
def test_max_version_lag_rejects_bad_bounds(lag):
    with pytest.raises(StalenessPolicyError):
        MaxVersionLag(lag)


@attrs.frozen
class _Inverted:
    def admits(self, sample_version: int, base_version: int) -> bool:
        return sample_version <= base_version  # accepts old data and refuses newer: not monotone


@attrs.frozen
class _IntAnswer:
    def admits(self, sample_version: int, base_version: int) -> bool:
        return 1  # type: ignore[return-value]


class _NotAttrs:
    def admits(self, sample_version: int, base_version: int) -> bool:
        return True


@attrs.frozen
class _NoMethod:
    max_lag: int = 1


@pytest.mark.parametrize("policy, problem", [
    (_Inverted(), "not monotone"), (_IntAnswer(), "not a bool"), (_NotAttrs(), "not an attrs class"),
    (_NoMethod(), "has no admits"),
])
def test_invalid_staleness_policies_fail_the_contract_loudly(policy, problem):
    with pytest.raises(StalenessPolicyError, match=problem):
        check_staleness_policy(policy)
