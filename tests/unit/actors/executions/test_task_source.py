"""The task source in virtual time; a driver actor plays the executor (and the builder's GroupDone) and training's
StepApplied. What was sent is read back from the event log."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import attrs
import pytest

from gyre.actors.executions.task_source import TaskSource, TaskSourceConfig, groups_ahead_for_staleness
from gyre.messages.execution_stats import TaskSourceStatistics
from gyre.messages.runtime_control import StatisticsAsked
from gyre.messages.executions import GroupDone, StartGroup, TaskSpec
from gyre.messages.samples import LandingsLost
from gyre.messages.training import StepApplied
from gyre.policies.task_sampling import EpochOrder, SignalPerToken, SignalWeighted
from gyre.runtime import Actor, Codec, RunOptions, Topology, VirtualLauncher, handler, read_log


def spec(task_id: str) -> TaskSpec:
    return TaskSpec(task_id, f"do {task_id}", {}, (sys.executable, "agent.py"), (sys.executable, "score.py"), 60.0, 5.0)


TASKS = tuple(spec(f"t{i}") for i in range(5))


@attrs.frozen
class DriverConfig:
    dropped: tuple[str, ...] = ()
    """Groups reported as dropped (not landed)."""
    dropped_families: tuple[str, ...] = ()
    """Groups of tasks whose id starts with one of these (and "-") are reported as dropped."""
    steps_after_done: tuple[int, ...] = ()
    """Publish StepApplied (next step, next version) when this many groups are done."""
    skipped_steps: tuple[int, ...] = ()
    """Steps published as skipped (non-finite gradients: the version stays)."""
    ask_statistics_after_done: int = 0
    """Ask the task source's statistics and stop the run when this many groups are done (0: never)."""
    work_tokens_by_family: tuple[tuple[str, int], ...] = ()
    """GroupDone.work_tokens of the groups of a family ((family, tokens) pairs); 100 for the others."""
    never_done: tuple[str, ...] = ()
    """Groups whose GroupDone never comes (lost on the way)."""
    lost_after_done: int = 0
    """Publish the claimer's LandingsLost (one group, step 1 at version 1) when this many groups are done."""


class Driver(Actor):
    config_cls = DriverConfig

    async def on_start(self) -> None:
        self.started = 0
        self.done = 0
        self.version = 0
        self.step = 0

    @handler(StartGroup)
    def on_start_group(self, msg: StartGroup) -> None:
        self.started += 1
        landed = msg.group_id not in self.config.dropped and not any(
            msg.task.task_id.startswith(family + "-") for family in self.config.dropped_families)
        reward = self.started / 10
        tokens = dict(self.config.work_tokens_by_family).get(msg.task.task_id.split("-")[0], 100)
        result = GroupDone(msg.group_id, landed, reward, 0.5, msg.group_size, 0 if landed else msg.group_size, tokens)
        if msg.group_id not in self.config.never_done:
            self.send_later(1.0 + self.started % 3, result)  # groups take different times: they finish out of order

    @handler(GroupDone)
    async def on_done(self, msg: GroupDone) -> None:
        self.tell("task_source", msg)
        self.done += 1
        if self.done in self.config.steps_after_done:
            skipped = self.step in self.config.skipped_steps
            self.version += 0 if skipped else 1
            self.publish(StepApplied(self.step, self.version, 0.0, 0.0, 0, 0, 0, skipped=skipped))
            self.step += 1
        if self.done == self.config.lost_after_done:
            self.publish(LandingsLost(1, 2, "in transit", 1, 1))
        if self.done == self.config.ask_statistics_after_done:
            await self.ask("task_source", StatisticsAsked())
            self.stop_topology("done")


def run(tmp_path: Path, config: TaskSourceConfig, driver: DriverConfig = DriverConfig()) -> tuple[str, list[Any]]:
    """Run; return the run's end reason and, in handling order, the StartGroup/GroupDone/statistics messages."""
    topology = Topology("task-source-test", seed=0)
    topology.add("task_source", TaskSource, attrs.evolve(config, executor="driver"))
    topology.add("driver", Driver, driver)
    log_path = tmp_path / "run.glog"
    result = VirtualLauncher().run(topology, RunOptions(log_path=str(log_path), until_s=10_000.0))
    codec = Codec()
    seen = []
    for record in read_log(log_path):
        name = record.type_name.rsplit(".", 1)[-1]
        if (name == "StartGroup" and record.envelope.receiver == "driver") or (
            name == "GroupDone" and record.envelope.receiver == "task_source"
        ) or name == "TaskSourceStatistics":
            seen.append(record.decode(codec))
    return result.reason, seen


def in_flight_peak(seen: list[Any]) -> int:
    running = peak = 0
    for msg in seen:
        running += 1 if isinstance(msg, StartGroup) else -1 if isinstance(msg, GroupDone) else 0
        peak = max(peak, running)
    return peak


def test_keeps_groups_in_flight_and_stops_after_max_groups(tmp_path: Path) -> None:
    config = TaskSourceConfig(TASKS, group_size=4, groups_in_flight=3, max_groups=12, seed=7)
    reason, seen = run(tmp_path, config)
    assert reason == "task source: 12 groups done (12 landed)"
    starts = [m for m in seen if isinstance(m, StartGroup)]
    assert [m.group_id for m in starts] == [f"g{i:06d}" for i in range(12)]
    assert all(m.group_size == 4 and m.weight_version == 0 for m in starts)
    assert in_flight_peak(seen) == 3
    order = [m.task.task_id for m in starts]
    assert sorted(order[:5]) == sorted(order[5:10]) == [t.task_id for t in TASKS]  # epochs visit every task once
    assert order[:5] != order[5:10]  # each epoch has its own shuffle
    again = run(tmp_path / "again", config)[1]
    assert [m.task.task_id for m in again if isinstance(m, StartGroup)] == order  # one seed, one order
    plain = run(tmp_path / "plain", attrs.evolve(config, shuffle=False, max_groups=7))[1]
    assert [m.task.task_id for m in plain if isinstance(m, StartGroup)] == ["t0", "t1", "t2", "t3", "t4", "t0", "t1"]


def test_staleness_bound_holds_rollouts_until_training_catches_up(tmp_path: Path) -> None:
    config = TaskSourceConfig(
        TASKS, group_size=2, groups_in_flight=4, max_groups=6, groups_per_step=2,
        max_groups_ahead_of_training=groups_ahead_for_staleness(0, 2),
    )
    reason, seen = run(tmp_path, config, DriverConfig(steps_after_done=(2, 4)))
    assert reason.startswith("task source: 6 groups done")
    assert [m.weight_version for m in seen if isinstance(m, StartGroup)] == [0, 0, 1, 1, 2, 2]
    assert in_flight_peak(seen) == 2  # groups_in_flight=4, but only two may be ahead of training

    reason, seen = run(tmp_path / "no-training", config)
    assert reason == "time limit of 10000.0s reached"  # nothing trains: no third group ever starts
    assert len([m for m in seen if isinstance(m, StartGroup)]) == 2


def test_a_skipped_step_counts_as_a_step_for_the_staleness_bound(tmp_path: Path) -> None:
    config = TaskSourceConfig(
        TASKS, group_size=2, groups_in_flight=4, max_groups=6, groups_per_step=2,
        max_groups_ahead_of_training=groups_ahead_for_staleness(0, 2),
    )
    # Step 0 is skipped: the version stays 0, but its two groups are used up, so two more may start.
    reason, seen = run(tmp_path, config, DriverConfig(steps_after_done=(2, 4), skipped_steps=(0,)))
    assert reason.startswith("task source: 6 groups done")
    assert [m.weight_version for m in seen if isinstance(m, StartGroup)] == [0, 0, 0, 0, 1, 1]
    assert in_flight_peak(seen) == 2


def test_dropped_groups_do_not_use_up_the_staleness_allowance(tmp_path: Path) -> None:
    config = TaskSourceConfig(
        TASKS, groups_in_flight=4, max_groups=6, groups_per_step=2, max_groups_ahead_of_training=2,
    )
    reason, seen = run(tmp_path, config, DriverConfig(dropped=("g000000",)))
    assert reason == "time limit of 10000.0s reached"
    assert [m.group_id for m in seen if isinstance(m, StartGroup)] == ["g000000", "g000001", "g000002"]


def test_records_every_group_in_its_statistics(tmp_path: Path) -> None:
    config = TaskSourceConfig(TASKS, groups_in_flight=2, max_groups=4, stop_topology_when_done=False, history_size=3)
    reason, seen = run(tmp_path, config, DriverConfig(dropped=("g000002",), ask_statistics_after_done=4))
    assert reason == "done"
    (stats,) = [m for m in seen if isinstance(m, TaskSourceStatistics)]
    assert (stats.groups_started, stats.groups_done, stats.groups_landed, stats.groups_in_flight) == (4, 4, 3, 0)
    done = [m for m in seen if isinstance(m, GroupDone)]
    assert [r.group_id for r in stats.history] == [m.group_id for m in done][-3:]  # bounded: the newest three
    started = {m.group_id: m.task.task_id for m in seen if isinstance(m, StartGroup)}
    for record, msg in zip(stats.history, done[-3:]):
        assert (record.mean_reward, record.landed, record.task_id) == (msg.mean_reward, msg.landed,
                                                                       started[msg.group_id])


def test_signal_weighted_sampling_runs_the_families_whose_groups_land_and_keeps_visiting_the_others(
    tmp_path: Path,
) -> None:
    tasks = tuple(spec(f"{family}-{i}") for family in ("flat", "split") for i in range(6))
    config = TaskSourceConfig(tasks, groups_in_flight=2, max_groups=80, seed=3,
                              sampling=SignalWeighted(window_groups=4, min_groups=2, floor=0.1))
    reason, seen = run(tmp_path, config, DriverConfig(dropped_families=("flat",)))
    assert reason == "task source: 80 groups done (%d landed)" % sum(
        1 for m in seen if isinstance(m, GroupDone) and m.landed)
    order = [m.task.task_id for m in seen if isinstance(m, StartGroup)]
    late = order[20:]
    flat_share = sum(task.startswith("flat-") for task in late) / len(late)
    assert 0.0 < flat_share < 0.3  # weights 0.1 vs 1: about 1 in 11, yet never none
    split_tasks = [task for task in order if task.startswith("split-")]
    assert sorted(split_tasks[:6]) == [f"split-{i}" for i in range(6)]  # a family's tasks still go in epochs
    assert run(tmp_path / "again", config, DriverConfig(dropped_families=("flat",)))[1] == seen  # seeded

    even = run(tmp_path / "even", attrs.evolve(config, sampling=EpochOrder(), max_groups=72),
               DriverConfig(dropped_families=("flat",)))
    even_order = [m.task.task_id for m in even[1] if isinstance(m, StartGroup)]
    assert sum(task.startswith("flat-") for task in even_order) == 36  # the default ignores what landed: 6 epochs


def test_per_token_sampling_gives_fewer_groups_to_a_family_whose_groups_cost_more(tmp_path: Path) -> None:
    # Both families land every group; "long" groups cost four times the tokens of "short" ones. SignalWeighted draws
    # them alike; SignalPerToken gives each the same share of tokens, so "long" runs about 1 group in 5.
    tasks = tuple(spec(f"{family}-{i}") for family in ("long", "short") for i in range(6))
    driver = DriverConfig(work_tokens_by_family=(("long", 400), ("short", 100)))
    config = TaskSourceConfig(tasks, groups_in_flight=2, max_groups=120, seed=5,
                              sampling=SignalPerToken(window_groups=4, min_groups=2, floor=0.1))

    def long_share(sampling) -> float:
        _, seen = run(tmp_path / type(sampling).__name__, attrs.evolve(config, sampling=sampling), driver)
        late = [m.task.task_id for m in seen if isinstance(m, StartGroup)][20:]
        return sum(task.startswith("long-") for task in late) / len(late)

    assert 0.1 < long_share(SignalPerToken(window_groups=4, min_groups=2, floor=0.1)) < 0.3
    assert 0.35 < long_share(SignalWeighted(window_groups=4, min_groups=2, floor=0.1)) < 0.65


@pytest.mark.parametrize(
    "change",
    [
        {"tasks": ()},
        {"tasks": (spec("a"), spec("a"))},
        {"group_size": 0},
        {"groups_in_flight": 0},
        {"max_groups": 0},
        {"max_groups_ahead_of_training": 0},
        {"groups_per_step": True},
        {"sampling": "signal"},
    ],
)
def test_bad_config_is_refused(change: dict[str, Any]) -> None:
    fields = {"tasks": TASKS, **change}
    with pytest.raises((ValueError, TypeError)):
        TaskSourceConfig(**fields)


def test_groups_ahead_for_staleness() -> None:
    assert groups_ahead_for_staleness(0, 4) == 4
    assert groups_ahead_for_staleness(2, 3) == 9
    with pytest.raises(ValueError):
        groups_ahead_for_staleness(-1, 1)


def test_groups_the_claimer_lost_free_the_gate_and_its_step_is_caught_up(tmp_path: Path) -> None:
    config = TaskSourceConfig(TASKS, group_size=2, groups_in_flight=4, max_groups=3, groups_per_step=2,
                              max_groups_ahead_of_training=groups_ahead_for_staleness(0, 2))
    # Without training only two groups may start (test above); a LandingsLost saying one of them never reached
    # the claimer, whose step 1 trains on version 1, lets the third start, on version 1.
    reason, seen = run(tmp_path, config, DriverConfig(lost_after_done=2))
    starts = [m for m in seen if isinstance(m, StartGroup)]
    assert reason.startswith("task source: 3 groups done") and [m.weight_version for m in starts] == [0, 0, 1]


def test_a_group_whose_group_done_never_comes_is_given_up_at_its_deadline(tmp_path: Path) -> None:
    config = TaskSourceConfig(TASKS, groups_in_flight=2, max_groups=4, group_deadline_s=50.0)
    reason, _ = run(tmp_path, config, DriverConfig(never_done=("g000001",)))
    assert reason == "task source: 4 groups done (3 landed)"
    reason, _ = run(tmp_path / "no-deadline", attrs.evolve(config, group_deadline_s=None),
                    DriverConfig(never_done=("g000001",)))
    assert reason == "time limit of 10000.0s reached"
