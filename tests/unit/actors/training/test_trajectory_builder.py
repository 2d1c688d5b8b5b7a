"""The trajectory builder in virtual time, fed synthetic model calls, announcements and scores by a driver actor
(which also plays the micro-step claimer and the task source). What it sent is read back from the event log."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs
import pytest

from gyre.actors.training.trajectory_builder import TrajectoryBuilder, TrajectoryBuilderConfig, scored_success
from gyre.messages.runtime_control import StatisticsAsked
from gyre.messages.executions import GroupDone
from gyre.messages.groups import GroupStarted
from gyre.messages.model_calls import ModelCallCompleted
from gyre.messages.samples import ExecutionDropped, ExecutionScored, SamplesLanded
from gyre.policies.group_filter import AtLeast, FractionOfGroup
from gyre.policies.trajectory_processor import RankedTrajectoryProcessor, build_group_samples
from gyre.policies.trajectory_tree import build_tree, prompt_ids_digest
from gyre.runtime import Actor, Codec, RunOptions, Topology, VirtualLauncher, handler, read_log

PUBLISHED = (ModelCallCompleted, GroupStarted)


@attrs.frozen
class DriverConfig:
    script: tuple[Any, ...]
    """Messages in order: calls and announcements are published, outcomes told to the builder."""
    expected_groups_done: int
    """GroupDone messages to wait for."""
    after: tuple[Any, ...] = ()
    """Sent once every expected GroupDone arrived (late messages), before the statistics are asked."""


class Driver(Actor):
    config_cls = DriverConfig

    async def on_start(self) -> None:
        self.done = 0
        self._play(self.config.script)

    def _play(self, script: tuple[Any, ...]) -> None:
        for msg in script:
            if isinstance(msg, PUBLISHED):
                self.publish(msg)
            else:
                self.tell("trajectory_builder", msg)

    @handler(SamplesLanded)
    def on_landed(self, msg: SamplesLanded) -> None:
        pass

    @handler(GroupDone)
    async def on_group_done(self, msg: GroupDone) -> None:
        self.done += 1
        if self.done == self.config.expected_groups_done:
            self._play(self.config.after)
            await self.ask("trajectory_builder", StatisticsAsked())
            self.stop_topology("done")


def run(tmp_path: Path, driver: DriverConfig, **builder: Any) -> dict[str, list[Any]]:
    topology = Topology("builder-test", seed=3)
    topology.add("trajectory_builder", TrajectoryBuilder,
                 TrajectoryBuilderConfig(claimer="driver", task_source="driver", **builder))
    topology.add("driver", Driver, driver)
    log_path = tmp_path / "run.glog"
    result = VirtualLauncher().run(topology, RunOptions(log_path=str(log_path), until_s=600.0))
    assert result.reason == "done", result
    codec = Codec()
    received: dict[str, list[Any]] = {}
    for record in read_log(log_path):
        if record.envelope.receiver == "driver":
            received.setdefault(record.type_name.rsplit(".", 1)[-1], []).append(record.decode(codec))
    return received


def calls(execution: str, group: str, seed: int, *, version: int = 0) -> tuple[ModelCallCompleted, ...]:
    """Two main turns and a summary that extends the second: a small branching tree. Nothing is cached, so the calls
    cost 5 + 3, 10 + 4 and 15 + 2 work tokens: 39 an execution (GroupDone.work_tokens)."""
    system = (1, 2, 3, 4)
    out0 = (20 + seed, 21, 99)
    prompt1 = system + (5,) + out0 + (6, 7)
    out1 = (30 + seed, 31, 32, 99)
    summary_prompt = prompt1 + out1 + (8,)

    def call(index: int, prompt: tuple[int, ...], out: tuple[int, ...], kind: str) -> ModelCallCompleted:
        return ModelCallCompleted(
            execution, group, index, "main", kind, len(prompt), -1, 0, prompt, prompt_ids_digest(prompt), out,
            tuple(-0.1 * (i + 1) for i in range(len(out))),
            (version,) * len(out), "stop", 0, "cell-0", float(index), float(index) + 0.5, 1.0,
        )

    return (
        call(0, system + (5,), out0, "turn"),
        call(1, prompt1, out1, "turn"),
        call(2, summary_prompt, (40 + seed, 99), "summary"),
    )


def scored(execution: str, reward: float, group: str = "g", detail: str = "") -> ExecutionScored:
    return ExecutionScored(execution, group, reward, False, detail)


def dropped(execution: str, group: str = "g") -> ExecutionDropped:
    return ExecutionDropped(execution, group, "scorer crashed: exit 1", False)


def announce(group: str, size: int, refused: str = "") -> GroupStarted:
    ids = tuple(f"{group}.{i}" for i in range(size)) if not refused else ()
    return GroupStarted(group, "task", size if not refused else 0, ids, 0, refused)


def test_complete_group_lands_the_processors_samples(tmp_path: Path) -> None:
    c0, c1, c2 = calls("g.0", "g", 0, version=2), calls("g.1", "g", 1, version=3), calls("g.2", "g", 2, version=3)
    scores = (
        scored("g.0", 1.0),
        scored("g.1", 0.5, detail=json.dumps({"reward": 0.5, "success": True})),
        scored("g.2", 0.0, detail="not json"),
    )
    # Out of order on purpose: a score and calls before the announcement; a call after its execution's score.
    script = (*c0, scores[0], *c1[:2], announce("g", 3), *c2, scores[2], c1[2], scores[1])
    late = calls("g.0", "g", 9)[:1]
    got = run(tmp_path, DriverConfig(script, expected_groups_done=1, after=late))

    trees = {"g.0": build_tree(c0), "g.1": build_tree(c1), "g.2": build_tree(c2)}
    ordered = [scores[0], scores[1], scores[2]]  # the announced order of executions, whatever the arrival order
    expected = build_group_samples("g", trees, ordered, RankedTrajectoryProcessor())
    (landed,) = got["SamplesLanded"]
    # The builder numbers its landings for the claimer (a gap is a lost landing): the first one, all its samples.
    assert landed == attrs.evolve(expected, landing_seq=1, samples_sent=len(expected.samples))
    assert landed.execution_ids == ("g.0", "g.1", "g.2") and landed.num_dropped == 0
    assert landed.samples and {s.execution_id for s in landed.samples} == {"g.0", "g.1", "g.2"}
    assert (landed.min_weight_version, landed.max_weight_version) == (2, 3)
    assert got["GroupDone"] == [GroupDone("g", True, 0.5, pytest.approx(2 / 3), 3, 0, 3 * 39)]
    (stats,) = got["BuilderStatistics"]
    assert (stats.groups_landed, stats.groups_dropped, stats.calls_added) == (1, 0, 9)
    assert (stats.late_messages, stats.live_trees, stats.live_groups) == (1, 0, 0)  # trees of the group are gone
    assert (stats.samples_landed, stats.tokens_landed) == (len(landed.samples), landed.num_tokens)


def test_group_with_too_few_survivors_is_dropped_whole(tmp_path: Path) -> None:
    script = (
        announce("g", 4), *calls("g.0", "g", 0), *calls("g.1", "g", 1), *calls("g.2", "g", 2), *calls("g.3", "g", 3),
        dropped("g.1"), dropped("g.2"), dropped("g.3"), scored("g.0", 1.0),
    )
    got = run(tmp_path, DriverConfig(script, expected_groups_done=1), group_filter=FractionOfGroup(0.5))
    assert "SamplesLanded" not in got
    assert got["GroupDone"] == [GroupDone("g", False, 1.0, 1.0, 1, 3, 4 * 39)]
    stats = got["BuilderStatistics"][0]
    assert (stats.groups_dropped, stats.executions_dropped, stats.live_trees) == (1, 3, 0)


def test_exactly_enough_survivors_land_and_count_the_dropped(tmp_path: Path) -> None:
    script = (
        announce("h", 4), *calls("h.0", "h", 0), *calls("h.1", "h", 1), *calls("h.2", "h", 2),
        dropped("h.2", "h"), scored("h.0", 1.0, "h"), scored("h.1", 0.0, "h"), dropped("h.3", "h"),
    )
    got = run(tmp_path, DriverConfig(script, expected_groups_done=1), group_filter=FractionOfGroup(0.5))
    (landed,) = got["SamplesLanded"]
    assert landed.execution_ids == ("h.0", "h.1") and landed.num_dropped == 2
    assert landed.advantages[0] > 0 > landed.advantages[1]
    assert got["GroupDone"] == [GroupDone("h", True, 0.5, 0.5, 2, 2, 3 * 39)]


def test_group_without_reward_spread_is_dropped_when_asked(tmp_path: Path) -> None:
    def group(name: str, rewards: tuple[float, ...]) -> tuple[Any, ...]:
        script: list[Any] = [announce(name, len(rewards))]
        for i, reward in enumerate(rewards):
            script += [*calls(f"{name}.{i}", name, i), scored(f"{name}.{i}", reward, name)]
        return tuple(script)

    script = (*group("flat", (0.2, 0.2, 0.2)), *group("close", (0.2, 0.25, 0.2)), *group("wide", (0.2, 1.0, 0.2)))
    got = run(tmp_path, DriverConfig(script, expected_groups_done=3), min_reward_spread=0.05)
    (landed,) = got["SamplesLanded"]
    assert landed.group_id == "wide"
    done = {d.group_id: d for d in got["GroupDone"]}
    assert (done["flat"].landed, done["close"].landed, done["wide"].landed) == (False, False, True)
    assert done["flat"].mean_reward == pytest.approx(0.2) and done["flat"].num_scored == 3  # still reported
    assert got["BuilderStatistics"][0].groups_dropped == 2

    # Off by default: a group whose rewards are all equal lands (with zero advantages).
    got = run(tmp_path, DriverConfig(group("flat", (0.2, 0.2)), expected_groups_done=1))
    (landed,) = got["SamplesLanded"]
    assert all(a == 0 for a in landed.advantages)


def test_reward_spread_must_not_be_negative() -> None:
    with pytest.raises(ValueError, match="min_reward_spread"):
        TrajectoryBuilderConfig(min_reward_spread=-0.1)


def test_scored_execution_without_calls_or_with_a_bad_tree_does_not_survive(tmp_path: Path) -> None:
    good = calls("g.0", "g", 0)
    bad = attrs.evolve(calls("g.2", "g", 2)[0], output_logprobs=(0.0,))  # lengths disagree: refused
    script = (announce("g", 3), *good, bad, scored("g.0", 1.0), scored("g.1", 0.0), scored("g.2", 0.0))
    got = run(tmp_path, DriverConfig(script, expected_groups_done=1), group_filter=AtLeast(2))
    assert "SamplesLanded" not in got  # one survivor of three: AtLeast(2) drops the group
    assert got["GroupDone"] == [GroupDone("g", False, pytest.approx(1 / 3), pytest.approx(1 / 3), 3, 0, 39 + 8)]
    assert got["BuilderStatistics"][0].messages_refused == 1


def test_refused_group_is_done_at_once_and_groups_are_independent(tmp_path: Path) -> None:
    script = (
        announce("a", 0, refused="bad task"),
        announce("b", 2), *calls("b.0", "b", 0), *calls("b.1", "b", 1), scored("b.0", 1.0, "b"),
        scored("b.1", 0.0, "b"),
    )
    got = run(tmp_path, DriverConfig(script, expected_groups_done=2))
    assert got["GroupDone"] == [GroupDone("a", False, 0.0, 0.0, 0, 0, 0), GroupDone("b", True, 0.5, 0.5, 2, 0, 2 * 39)]
    assert [m.group_id for m in got["SamplesLanded"]] == ["b"]


def test_live_trees_are_capped(tmp_path: Path) -> None:
    script = (
        announce("g", 3), *calls("g.0", "g", 0), *calls("g.1", "g", 1), *calls("g.2", "g", 2),
        scored("g.0", 1.0), scored("g.1", 0.0), scored("g.2", 0.5),
    )
    got = run(tmp_path, DriverConfig(script, expected_groups_done=1), max_live_executions=2)
    (landed,) = got["SamplesLanded"]
    assert landed.execution_ids == ("g.0", "g.1")  # g.2's calls were refused: it cannot survive
    assert got["BuilderStatistics"][0].messages_refused == 3


def test_scored_success() -> None:
    assert scored_success(scored("e", 1.0))
    assert scored_success(scored("e", 0.2, detail='{"success": true}'))
    assert not scored_success(scored("e", 0.2, detail='{"success": "yes"}'))
    assert not scored_success(scored("e", 0.99, detail="{"))
    assert scored_success(scored("e", 0.5), success_reward=0.5)


def test_calls_of_unannounced_executions_leave_no_tree_behind(tmp_path: Path) -> None:
    stray_before = calls("g.7", "g", 7)[:1]  # before the announcement: a tree is made, then found to be stray
    stray_after = calls("g.8", "g", 8)[:1]  # after it: refused at once
    script = (*stray_before, announce("g", 1), *stray_after, *calls("g.0", "g", 0), scored("g.0", 1.0))
    got = run(tmp_path, DriverConfig(script, expected_groups_done=1))
    assert [m.execution_ids for m in got["SamplesLanded"]] == [("g.0",)]
    stats = got["BuilderStatistics"][0]
    assert (stats.live_trees, stats.messages_refused) == (0, 1)


def test_incremental_records_land_the_samples_of_whole_prompt_records_and_a_mismatch_drops(tmp_path: Path) -> None:
    """The proxy's records name the call they extend and carry only the new ids: the builder lands exactly the
    samples the whole-prompt records give. A record whose rebuilt prompt misses its digest refuses its execution
    (counted among the refused); one that extends a call that never came leaves its execution unable to survive."""
    from gyre.benchmarks.trajectories import incremental_records

    whole = {e: calls(e, "g", i) for i, e in enumerate(("g.0", "g.1"))}
    records = {e: incremental_records(c) for e, c in whole.items()}
    assert all(r.extends_call >= 0 for c in records.values() for r in c[1:])
    scores = (scored("g.0", 1.0), scored("g.1", 0.0))
    # Out of order: call 2 of g.1 before the call it extends.
    script = (announce("g", 2), *records["g.0"], records["g.1"][0], records["g.1"][2], records["g.1"][1], *scores)
    got = run(tmp_path, DriverConfig(script, expected_groups_done=1))
    expected = build_group_samples("g", {e: build_tree(c) for e, c in whole.items()}, list(scores),
                                   RankedTrajectoryProcessor())
    assert got["SamplesLanded"] == [attrs.evolve(expected, landing_seq=1, samples_sent=len(expected.samples))]

    bad = attrs.evolve(records["g.1"][1], new_prompt_ids=(7,) + records["g.1"][1].new_prompt_ids[1:])
    lost = records["g.0"][2]  # extends call 1, which is never sent
    script = (announce("g", 3), records["g.0"][0], lost, *records["g.1"][:1], bad, *calls("g.2", "g", 2), *scores,
              scored("g.2", 0.5))
    got = run(tmp_path, DriverConfig(script, expected_groups_done=1), group_filter=AtLeast(2))
    assert "SamplesLanded" not in got  # g.0 (incomplete) and g.1 (mismatch) cannot survive: one of three
    stats = got["BuilderStatistics"][0]
    assert stats.messages_refused == 2 and stats.live_trees == 0
    assert (stats.prompt_mismatches, stats.incomplete_trees) == (1, 1)


def test_an_event_log_of_whole_prompt_records_is_refused_with_both_versions() -> None:
    """Logs written before incremental records hold ModelCallCompleted v2 (a whole prompt_ids): the codec refuses
    them by name and version rather than misread their fields (replay, gyre log and the studies say so)."""
    import msgpack

    from gyre.runtime.codec import SchemaVersionMismatch

    codec = Codec()
    call = calls("g.0", "g", 0)[0]
    body = codec.encode_body(call)
    assert codec.decode_body("gyre.model_calls.ModelCallCompleted", 3, body) == call
    old_fields = msgpack.packb(("g.0", "g", 0, "main", "turn", list(call.new_prompt_ids), [1], [0.0], [0], "stop", 0,
                                "c", 0.0, 1.0, 1.0), use_bin_type=True)
    with pytest.raises(SchemaVersionMismatch, match="version 2; this process speaks version 3"):
        codec.decode_body("gyre.model_calls.ModelCallCompleted", 2, old_fields)
