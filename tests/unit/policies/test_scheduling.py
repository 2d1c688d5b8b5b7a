"""Scheduling policies: decisions on hand-built views, and the contract every policy (and no broken one) passes."""

from __future__ import annotations

import random

import attrs
import pytest

from gyre.messages.cells import SwitchRole
from gyre.policies.errors import PolicyContractError, SchedulingConfigError
from gyre.policies.scheduling import (
    AsyncPolicy,
    BacklogView,
    CellView,
    ColocatePolicy,
    ElasticPolicy,
    SchedulerView,
    check_decisions,
    check_scheduling_policy,
)


def cell(name, role="rollout", core=False, sessions=0, cap=4, since=0.0, claims=0, to="", idle=None,
         kv=(0, 0)) -> CellView:
    return CellView(name=name, role=role, is_core=core, live_sessions=sessions, running_requests=min(sessions, cap),
                    waiting_requests=max(0, sessions - cap), capacity_requests=cap, role_since_s=since,
                    switching_to=to, claims=claims, idle_since_s=idle, free_kv_blocks=kv[0], total_kv_blocks=kv[1])


def view(*cells, t=100.0, round_trip=None, **backlog) -> SchedulerView:
    return SchedulerView(time_s=t, cells=tuple(sorted(cells, key=lambda c: c.name)), backlog=BacklogView(**backlog),
                         switch_round_trip_s=round_trip)


def moves(decisions) -> list[tuple[str, str]]:
    return [(d.cell, d.role) for d in decisions]


ELASTIC = ElasticPolicy(min_dwell_s=30.0, capacity_headroom=0.9, dry_grace_s=10.0)


# ---- elastic --------------------------------------------------------------------------------------------------------
def test_elastic_moves_the_least_loaded_satellite_when_work_waits_and_the_rest_covers_the_sessions():
    v = view(cell("core", "train", core=True, claims=1), cell("s1", sessions=2), cell("s2", sessions=1),
             claimable_microsteps=3)
    decisions = ELASTIC.decide(v)
    assert moves(decisions) == [("s2", "train")]
    assert "3 micro-steps waiting" in decisions[0].reason


def test_elastic_keeps_satellites_when_the_remaining_capacity_would_not_cover_live_sessions():
    # demand 4 sessions; without either satellite 4 slots remain, and 4 > 0.9 * 4.
    v = view(cell("core", "train", core=True, claims=1), cell("s1", sessions=2), cell("s2", sessions=2),
             claimable_microsteps=5)
    assert ELASTIC.decide(v) == ()


def test_elastic_waits_for_the_dwell_time_and_for_work_idle_train_cells_would_not_take():
    settled = dict(claimable_microsteps=3)
    assert ELASTIC.decide(view(cell("core", "train", core=True, claims=1), cell("s1", since=80.0),
                               cell("s2", since=90.0), **settled)) == ()
    # one micro-step waiting and the core idle: the core takes it, nobody needs to move
    assert ELASTIC.decide(view(cell("core", "train", core=True), cell("s1"), cell("s2"),
                               claimable_microsteps=1)) == ()
    # a satellite already on its way into training counts as a taker too
    assert ELASTIC.decide(view(cell("core", "train", core=True, claims=1), cell("s1", "switching", to="train"),
                               cell("s2"), claimable_microsteps=1)) == ()


def test_elastic_brings_a_satellite_back_when_rollout_demand_exceeds_capacity():
    v = view(cell("core", "train", core=True, claims=1), cell("s1", sessions=5),
             cell("s2", "train", claims=1, since=50.0), cell("s3", "train", claims=0, since=50.0),
             claimable_microsteps=4)
    decisions = ELASTIC.decide(v)
    assert moves(decisions) == [("s3", "rollout")]  # the one without a claim goes first
    assert "exceeds capacity" in decisions[0].reason


def test_elastic_has_a_band_between_leaving_and_coming_back_so_it_does_not_flap():
    base = dict(claimable_microsteps=4)
    core, trainer = cell("core", "train", core=True, claims=1), cell("s2", "train", claims=1, since=0.0)
    # 4 sessions on 4 slots: not over capacity, so s2 stays in training...
    assert ELASTIC.decide(view(core, trainer, cell("s1", sessions=4), **base)) == ()
    # ...but s1 would not be allowed to leave with 4 sessions on 4 remaining slots either (4 > 0.9 * 4)
    assert ELASTIC.decide(view(core, cell("s1", sessions=2), cell("s3", sessions=2), **base)) == ()
    # one more session and s2 comes back
    assert moves(ELASTIC.decide(view(core, trainer, cell("s1", sessions=5), **base))) == [("s2", "rollout")]


def test_elastic_sends_idle_satellites_back_only_after_training_work_stays_dry_for_the_grace():
    cells = (cell("core", "train", core=True), cell("s1", sessions=1), cell("s2", "train", since=0.0),
             cell("s3", "train", since=0.0, claims=1))
    assert ELASTIC.decide(view(*cells, t=100.0, dry_since_s=95.0)) == ()
    decisions = ELASTIC.decide(view(*cells, t=100.0, dry_since_s=90.0))
    assert moves(decisions) == [("s2", "rollout")]  # s3 still computes its micro-step
    assert decisions[0].reason == "training work ran dry"
    # a full step already waiting behind the current one is not dryness
    assert ELASTIC.decide(view(*cells, t=100.0, dry_since_s=0.0, pending_executions=8, executions_per_step=8)) == ()


def test_elastic_puts_the_core_into_training_and_respects_the_switch_limit():
    v = view(cell("core", core=True), cell("s1"), cell("s2"), claimable_microsteps=5)
    assert moves(ELASTIC.decide(v)) == [("core", "train")]
    two = attrs.evolve(ELASTIC, max_switches_per_decision=2)
    assert moves(two.decide(v)) == [("core", "train"), ("s1", "train")]


def test_elastic_keeps_the_minimum_of_rollout_cells():
    v = view(cell("core", "train", core=True, claims=1), cell("s1"), claimable_microsteps=5)
    assert ELASTIC.decide(v) == ()
    none_needed = attrs.evolve(ELASTIC, min_rollout_cells=0)
    assert moves(none_needed.decide(v)) == [("s1", "train")]


def test_elastic_trains_on_the_last_rollout_cell_while_the_rollout_has_nothing_to_do():
    # A whole step waits behind the one in training (staleness holds rollout back) and no session is live.
    idle = dict(claimable_microsteps=3, step_fixed=True, pending_executions=8, executions_per_step=8)
    trainers = (cell("core", "train", core=True, claims=2), cell("s1", "train", claims=2))
    decisions = ELASTIC.decide(view(*trainers, cell("s2"), **idle))
    assert moves(decisions) == [("s2", "train")]
    assert decisions[0].migrate_sessions is False  # the last one: nowhere to migrate to, nothing to migrate
    assert "the rollout is idle" in decisions[0].reason
    # Not while a session is live there, a call waits at the proxy, the step behind is not whole, the cell has not
    # dwelt long enough, or the policy is told not to.
    assert ELASTIC.decide(view(*trainers, cell("s2", sessions=1), **idle)) == ()
    waiting_call = SchedulerView(time_s=100.0, cells=(*trainers, cell("s2")), backlog=BacklogView(**idle),
                                 calls_waiting_for_cell=1)
    assert ELASTIC.decide(waiting_call) == ()
    assert ELASTIC.decide(view(*trainers, cell("s2"), **dict(idle, pending_executions=7))) == ()
    assert ELASTIC.decide(view(*trainers, cell("s2", since=80.0), **idle)) == ()
    assert attrs.evolve(ELASTIC, idle_rollout_trains=False).decide(view(*trainers, cell("s2"), **idle)) == ()


def test_elastic_brings_a_satellite_back_at_once_when_no_cell_rolls_out_and_rollout_work_returns():
    trainers = (cell("core", "train", core=True, claims=1), cell("s1", "train", claims=1, since=99.0),
                cell("s2", "train", since=99.0))
    # The step behind is still whole: nothing to roll out yet.
    assert ELASTIC.decide(view(*trainers, claimable_microsteps=2, pending_executions=8, executions_per_step=8)) == ()
    # The step was applied and the next one's rollouts can start: the satellite without a claim returns, although
    # it entered training a second ago.
    decisions = ELASTIC.decide(view(*trainers, claimable_microsteps=2, executions_per_step=8))
    assert moves(decisions) == [("s2", "rollout")]
    assert "no cell rolls out" in decisions[0].reason
    # A call waiting at the proxy is rollout work too.
    calls = SchedulerView(time_s=100.0, cells=trainers, calls_waiting_for_cell=3,
                          backlog=BacklogView(claimable_microsteps=2, pending_executions=8, executions_per_step=8))
    decisions = ELASTIC.decide(calls)
    assert moves(decisions) == [("s2", "rollout")] and "3 calls wait" in decisions[0].reason
    # A cell already on its way back is enough.
    on_the_way = (*trainers[:2], cell("s2", "switching", to="rollout"))
    assert ELASTIC.decide(view(*on_the_way, claimable_microsteps=2, executions_per_step=8)) == ()


# ---- elastic, counted in seconds (work_per_switch > 0) ---------------------------------------------------------------
BY_WORK = ElasticPolicy(min_dwell_s=30.0, capacity_headroom=0.9, dry_grace_s=10.0, work_per_switch=2.0)
CORE_BUSY = cell("core", "train", core=True, claims=1)


def test_by_work_a_satellite_leaves_only_for_work_worth_its_round_trip():
    # round trip 12 s, so a move must bring 2 x 12 = 24 s; one train cell (the core) today, two after the move.
    rollout = (cell("s1", sessions=10, cap=100), cell("s2", sessions=5, cap=100))
    fixed = dict(step_fixed=True, executions_per_step=100, executions_in_step=100, microstep_s=16.0, round_trip=12.0)
    # 4 micro-steps x 16 s / 2 cells = 32 s >= 24 s: the one with fewer sessions goes
    decisions = BY_WORK.decide(view(CORE_BUSY, *rollout, claimable_microsteps=4, **fixed))
    assert moves(decisions) == [("s2", "train")]
    assert "32 s a train cell" in decisions[0].reason and "12.0 s round trip" in decisions[0].reason
    # 2 x 16 / 2 = 16 s < 24 s: not worth it (the session-counting rules would move a cell for one micro-step)
    assert BY_WORK.decide(view(CORE_BUSY, *rollout, claimable_microsteps=2, **fixed)) == ()
    assert moves(ELASTIC.decide(view(CORE_BUSY, *rollout, claimable_microsteps=2, **fixed))) == [("s2", "train")]
    # a slower round trip (measured 20 s: 40 s needed) keeps it, 4 x 16 / 2 = 32 s < 40 s
    assert BY_WORK.decide(view(CORE_BUSY, *rollout, claimable_microsteps=4, **{**fixed, "round_trip": 20.0})) == ()
    # not measured yet: the assumed 12 s round trip stands in; no micro-step time measured: nobody moves
    assert moves(BY_WORK.decide(view(CORE_BUSY, *rollout, claimable_microsteps=4, **{**fixed, "round_trip": None}))
                 ) == [("s2", "train")]
    assert BY_WORK.decide(view(CORE_BUSY, *rollout, claimable_microsteps=40, **{**fixed, "microstep_s": None})) == ()


def test_by_work_a_satellite_leaves_only_while_the_rest_covers_the_steps_unfinished_executions():
    rollout = (cell("s1", sessions=10, cap=100), cell("s2", sessions=5, cap=100))
    work = dict(claimable_microsteps=4, executions_per_step=100, microstep_s=16.0, round_trip=12.0)
    # 100 unfinished executions; the cell that stays holds 100 sessions: 100 > 0.9 x 100
    assert BY_WORK.decide(view(CORE_BUSY, *rollout, executions_in_step=0, **work)) == ()
    # 20 in, 80 unfinished <= 90: it may go (live sessions of later steps do not count, 10 + 5 here or 2,000)
    assert moves(BY_WORK.decide(view(CORE_BUSY, *rollout, executions_in_step=20, **work))) == [("s2", "train")]
    # without the free-room rule, live sessions of later steps do not count at all (1,000 on 100 slots each)
    many = (cell("s1", sessions=1000, cap=100), cell("s2", sessions=1000, cap=100))
    piling = attrs.evolve(BY_WORK, leave_into_free_capacity=False)
    assert moves(piling.decide(view(CORE_BUSY, *many, executions_in_step=20, **work))) == [("s1", "train")]


def test_by_work_a_satellite_leaves_only_into_free_room_on_the_cells_that_stay():
    work = dict(claimable_microsteps=4, executions_per_step=100, executions_in_step=90, microstep_s=16.0,
                round_trip=12.0)
    # s3 (the fewest sessions, 30) would migrate 30 sessions; s1 and s2 have 100 - 80 = 20 free each: 40 >= 30
    roomy = (cell("s1", sessions=80, cap=100), cell("s2", sessions=80, cap=100), cell("s3", sessions=30, cap=100))
    assert moves(BY_WORK.decide(view(CORE_BUSY, *roomy, **work))) == [("s3", "train")]
    # s1 over its capacity counts no room (not negative room): 0 + 20 < 30, nobody goes; s2, with 80, would need 70
    crowded = (cell("s1", sessions=150, cap=100), cell("s2", sessions=80, cap=100), cell("s3", sessions=30, cap=100))
    assert BY_WORK.decide(view(CORE_BUSY, *crowded, **work)) == ()
    # calls waiting at the proxy: it admits up to capacity and queues what it cannot place, so the sessions a move
    # cannot place wait there for any cell, the one that comes back included: the room rule is off
    waiting = attrs.evolve(view(CORE_BUSY, *crowded, **work), calls_waiting_for_cell=3)
    assert moves(BY_WORK.decide(waiting)) == [("s3", "train")]
    # the rule is the cost-aware rules' alone: the session-counting ones are unchanged
    assert attrs.evolve(BY_WORK, leave_into_free_capacity=False).decide(
        view(CORE_BUSY, *crowded, **work)) != ()


def test_by_work_a_satellite_leaves_only_into_free_kv_on_the_cells_that_stay():
    work = dict(claimable_microsteps=4, executions_per_step=100, executions_in_step=90, microstep_s=16.0,
                round_trip=12.0)
    # room in sessions (20 + 20 >= 30), but s3's 30 sessions hold 600 blocks and s1, s2 have 250 free each: nobody
    # goes (their contexts are longer than the mean the session count assumes)
    tight = (cell("s1", sessions=80, cap=100, kv=(250, 1000)), cell("s2", sessions=80, cap=100, kv=(250, 1000)),
             cell("s3", sessions=30, cap=100, kv=(400, 1000)))
    assert BY_WORK.decide(view(CORE_BUSY, *tight, **work)) == ()
    # 300 free each: 600 >= 600, it goes
    roomy = (cell("s1", sessions=80, cap=100, kv=(300, 1000)), cell("s2", sessions=80, cap=100, kv=(300, 1000)),
             tight[2])
    assert moves(BY_WORK.decide(view(CORE_BUSY, *roomy, **work))) == [("s3", "train")]
    # a cell that reports no pool (SGLang's /get_load gives no block counts) holds nobody back
    unreported = (cell("s1", sessions=80, cap=100), *tight[1:])
    assert moves(BY_WORK.decide(view(CORE_BUSY, *unreported, **work))) == [("s3", "train")]
    # the rule off, or the session-counting rules: the blocks are not looked at
    assert moves(attrs.evolve(BY_WORK, leave_into_free_kv=False).decide(view(CORE_BUSY, *tight, **work))) == [
        ("s3", "train")]
    few = (cell("s1", sessions=10, cap=100, kv=(250, 1000)), cell("s2", sessions=10, cap=100, kv=(250, 1000)),
           cell("s3", sessions=5, cap=100, kv=(400, 1000)))
    assert BY_WORK.decide(view(CORE_BUSY, *few, **work)) == ()
    assert moves(ELASTIC.decide(view(CORE_BUSY, *few, **work))) == [("s3", "train")]
    # free blocks alone are not room either: a burst of new sessions holds little KV now and much later
    fresh = (cell("s1", sessions=100, cap=100, kv=(900, 1000)), cell("s2", sessions=100, cap=100, kv=(900, 1000)),
             cell("s3", sessions=30, cap=100, kv=(900, 1000)))
    assert BY_WORK.decide(view(CORE_BUSY, *fresh, **work)) == ()


def test_by_work_a_train_cell_goes_back_after_idling_one_round_trip():
    rollout = cell("s1", sessions=10, cap=100)
    measured = dict(microstep_s=16.0, dry_since_s=50.0, round_trip=12.0)
    # idle since 88: 12 s >= max(dry grace 10, round trip 12)
    idle = cell("s2", "train", since=0.0, idle=88.0)
    decisions = BY_WORK.decide(view(CORE_BUSY, rollout, idle, **measured))
    assert moves(decisions) == [("s2", "rollout")] and "idle in training for 12 s" in decisions[0].reason
    # idle since 90: 10 s < 12 s, it stays; holding a claim, it stays however long ago it was last idle
    assert BY_WORK.decide(view(CORE_BUSY, rollout, cell("s2", "train", since=0.0, idle=90.0), **measured)) == ()
    assert BY_WORK.decide(view(CORE_BUSY, rollout, cell("s2", "train", since=0.0, claims=1), **measured)) == ()
    # a micro-step no one takes would be its work: it stays
    assert BY_WORK.decide(view(CORE_BUSY, rollout, idle, claimable_microsteps=1, **measured)) == ()
    # the demand-over-capacity rule does not pull a busy trainer back (1,000 sessions on 100 slots)
    crowded = cell("s1", sessions=1000, cap=100)
    assert BY_WORK.decide(view(CORE_BUSY, crowded, cell("s2", "train", since=0.0, claims=1), **measured)) == ()
    assert moves(ELASTIC.decide(view(CORE_BUSY, crowded, cell("s2", "train", since=0.0, claims=1),
                                     claimable_microsteps=0))) == [("s2", "rollout")]


def test_by_work_the_core_lends_itself_after_a_round_trip_dry_and_returns_for_work_worth_it():
    rollout = cell("s1", sessions=10, cap=100)
    core_idle = cell("core", "train", core=True, since=0.0, idle=80.0)
    assert moves(BY_WORK.decide(view(core_idle, rollout, dry_since_s=85.0, round_trip=12.0))) == [("core", "rollout")]
    # dry only 10 s (< 12 s round trip): it stays
    assert BY_WORK.decide(view(core_idle, rollout, dry_since_s=90.0, round_trip=12.0)) == ()
    core_out = cell("core", "rollout", core=True, sessions=3, cap=100)
    # one micro-step waits (16 s < 24 s) and no one takes it: the core waits for more
    assert BY_WORK.decide(view(core_out, rollout, claimable_microsteps=1, microstep_s=16.0, round_trip=12.0)) == ()
    assert moves(BY_WORK.decide(view(core_out, rollout, claimable_microsteps=2, microstep_s=16.0, round_trip=12.0))
                 ) == [("core", "train")]
    # a fixed step needs the core's optimizer step: it returns at once
    assert moves(BY_WORK.decide(view(core_out, rollout, step_fixed=True))) == [("core", "train")]


@pytest.mark.parametrize("field, value", [
    ("capacity_headroom", 0.0), ("capacity_headroom", 1.5), ("min_dwell_s", -1.0), ("grow_min_waiting", 0),
    ("max_switches_per_decision", 0), ("work_per_switch", -1.0), ("assumed_round_trip_s", 0.0),
])
def test_elastic_rejects_bad_settings(field, value):
    with pytest.raises(SchedulingConfigError):
        ElasticPolicy(**{field: value})


# ---- async ----------------------------------------------------------------------------------------------------------
def test_async_enforces_the_fixed_split_and_leaves_switching_cells_alone():
    policy = AsyncPolicy(train_cells=("core", "s1"))
    v = view(cell("core", "train", core=True), cell("s1"), cell("s2", "train"), cell("s3", "switching", to="train"),
             claimable_microsteps=9, dry_since_s=0.0)
    assert moves(policy.decide(v)) == [("s1", "train"), ("s2", "rollout")]
    settled = view(cell("core", "train", core=True), cell("s1", "train"), cell("s2", sessions=40))
    assert policy.decide(settled) == ()


def test_async_refuses_a_split_without_the_core_or_without_cells():
    with pytest.raises(SchedulingConfigError):
        AsyncPolicy(train_cells=())
    with pytest.raises(SchedulingConfigError):
        AsyncPolicy(train_cells=("a", "a"))
    with pytest.raises(SchedulingConfigError, match="core"):
        AsyncPolicy(train_cells=("s1",)).decide(view(cell("core", "train", core=True), cell("s1")))


def test_async_accepts_a_list_and_stores_a_tuple():
    assert AsyncPolicy(train_cells=["core"]).train_cells == ("core",)


# ---- colocate -------------------------------------------------------------------------------------------------------
def test_colocate_trains_everyone_when_a_step_is_fixed_and_rolls_out_everyone_after_it():
    policy = ColocatePolicy()
    filling = (cell("core", core=True, sessions=3), cell("s1", sessions=3))
    assert policy.decide(view(*filling, step_fixed=False)) == ()
    into_training = policy.decide(view(*filling, step_fixed=True))
    assert moves(into_training) == [("core", "train"), ("s1", "train")]
    # Every cell leaves rollout, so none can take the others' sessions: the switches strand them (the calls wait at
    # the proxy) instead of being refused for want of a rollout cell.
    assert [d.migrate_sessions for d in into_training] == [False, False]
    training = (cell("core", "train", core=True, claims=1), cell("s1", "train"))
    assert policy.decide(view(*training, step_fixed=True, claimed_microsteps=1)) == ()
    assert moves(policy.decide(view(cell("core", "train", core=True), cell("s1", "train"), step_id=1))) == [
        ("core", "rollout"), ("s1", "rollout")]


def test_elastic_and_async_switches_always_migrate_sessions():
    sessions = (cell("core", core=True, sessions=1), cell("s1", sessions=1), cell("s2", sessions=1))
    decisions = AsyncPolicy(train_cells=("core", "s1")).decide(view(*sessions))
    decisions += ElasticPolicy(min_dwell_s=0).decide(view(*sessions, claimable_microsteps=4, step_fixed=True))
    assert decisions and all(d.migrate_sessions for d in decisions)


def test_colocate_does_not_pull_a_cell_out_while_it_holds_a_claim():
    v = view(cell("core", "train", core=True, claims=1), cell("s1", "train"), step_fixed=False)
    assert moves(ColocatePolicy().decide(v)) == [("s1", "rollout")]


# ---- the contract ---------------------------------------------------------------------------------------------------
def random_views(seed: int, count: int = 300) -> tuple[SchedulerView, ...]:
    rng = random.Random(seed)
    views = []
    for _ in range(count):
        cells = []
        for i in range(rng.randint(1, 6)):
            role = rng.choice(["rollout", "train", "switching"])
            cells.append(cell(
                "core" if i == 0 else f"s{i}", role, core=i == 0, sessions=rng.randint(0, 12), cap=rng.randint(1, 8),
                since=rng.uniform(0, 100), claims=rng.randint(0, 2) if role == "train" else 0,
                to=rng.choice(["rollout", "train"]) if role == "switching" else "",
                kv=rng.choice([(0, 0), (rng.randint(0, 100), 100)]),
            ))
        views.append(view(
            *cells, t=100.0, step_id=rng.randint(0, 5), step_fixed=rng.random() < 0.5,
            claimable_microsteps=rng.randint(0, 6), claimed_microsteps=rng.randint(0, 3),
            pending_executions=rng.randint(0, 20), executions_per_step=8,
            dry_since_s=rng.choice([None, rng.uniform(0, 100)]), executions_in_step=rng.randint(0, 8),
            microstep_s=rng.choice([None, rng.uniform(1, 40)]), round_trip=rng.choice([None, rng.uniform(1, 30)]),
        ))
        if rng.random() < 0.5:  # idle trainers, as the scheduler marks them
            views[-1] = attrs.evolve(views[-1], cells=tuple(
                attrs.evolve(c, idle_since_s=rng.uniform(c.role_since_s, 100)) if c.role == "train" and not c.claims
                else c for c in views[-1].cells))
    return tuple(views)


@pytest.mark.parametrize("policy", [
    ElasticPolicy(), ElasticPolicy(min_dwell_s=0.0, dry_grace_s=0.0, max_switches_per_decision=3),
    AsyncPolicy(train_cells=("core", "s1", "s2")), ColocatePolicy(), ElasticPolicy(work_per_switch=2.0),
    ElasticPolicy(work_per_switch=0.5, min_dwell_s=0.0, dry_grace_s=0.0, max_switches_per_decision=3),
], ids=["elastic", "elastic-eager", "async", "colocate", "elastic-by-work", "elastic-by-work-eager"])
@pytest.mark.parametrize("seed", [0, 1])
def test_every_shipped_policy_passes_the_contract(policy, seed):
    check_scheduling_policy(policy, random_views(seed))


@attrs.frozen
class ReturnsList:
    def decide(self, view):
        return [SwitchRole(c.name, "train", "x") for c in view.cells if c.role == "rollout"]


@attrs.frozen
class SwitchesSwitchingCells:
    def decide(self, view):
        return tuple(SwitchRole(c.name, "rollout", "x") for c in view.cells if c.role == "switching")


@attrs.frozen
class DecidesTwice:
    def decide(self, view):
        rollout = [c for c in view.cells if c.role == "rollout"][:1]
        return tuple(SwitchRole(c.name, "train", "x") for c in rollout * 2)


@attrs.frozen
class SameRole:
    def decide(self, view):
        return tuple(SwitchRole(c.name, c.role, "x") for c in view.cells if c.role == "train")


@attrs.frozen
class UnknownCell:
    def decide(self, view):
        return (SwitchRole("nobody", "train", "x"),)


@attrs.frozen
class BadRole:
    def decide(self, view):
        return tuple(SwitchRole(c.name, "idle", "x") for c in view.cells if c.role == "rollout")


@attrs.frozen
class NoReason:
    def decide(self, view):
        return tuple(SwitchRole(c.name, "train", "") for c in view.cells if c.role == "rollout")


@attrs.frozen
class KeepsState:
    """Answers every other call differently: a hidden state the view does not show."""

    calls: list = attrs.field(factory=list)

    def decide(self, view):
        self.calls.append(None)
        rollout = [c for c in view.cells if c.role == "rollout"][: len(self.calls) % 2]
        return tuple(SwitchRole(c.name, "train", "x") for c in rollout)


class NotAttrs:
    def decide(self, view):
        return ()


@attrs.frozen
class NoDecide:
    x: int = 0


@pytest.mark.parametrize("policy, problem", [
    (ReturnsList(), "must be a tuple"), (SwitchesSwitchingCells(), "already switching"),
    (DecidesTwice(), "two decisions"), (SameRole(), "already in role"), (UnknownCell(), "unknown cell"),
    (BadRole(), "neither rollout nor train"), (NoReason(), "gives no reason"), (KeepsState(), "differently"),
    (NotAttrs(), "not an attrs class"), (NoDecide(), "has no decide"),
])
def test_broken_policies_fail_the_contract_loudly(policy, problem):
    with pytest.raises(PolicyContractError, match=problem):
        check_scheduling_policy(policy, random_views(0, count=100))


def test_check_decisions_returns_valid_decisions_unchanged():
    v = view(cell("core", "train", core=True), cell("s1"))
    decisions = (SwitchRole("s1", "train", "because"),)
    assert check_decisions(v, decisions) is decisions
