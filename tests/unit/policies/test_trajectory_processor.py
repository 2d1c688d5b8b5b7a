"""The trajectory processor: its contract, the cap and ranking, dedup, loss masks, weights, group landing."""

from __future__ import annotations

import math
import random

import attrs
import pytest

from gyre.messages.samples import ExecutionScored, TrainingSample
from gyre.benchmarks.trajectories import WorkloadConfig, check_samples, simulate_execution
from gyre.policies.errors import ProcessorError
from gyre.policies.trajectory_processor import (
    AllChainsProcessor,
    ProcessorConfig,
    RankedTrajectoryProcessor,
    TrajectoryProcessor,
    build_group_samples,
)
from gyre.policies.trajectory_tree import MAIN, MAIN_SUMMARY, SUB_AGENT, SUB_AGENT_SUMMARY, build_tree, whole_prompt_call

SMALL = WorkloadConfig(
    main_turns=12,
    context_limit_tokens=300,
    system_tokens=12,
    task_tokens=6,
    output_tokens=(1, 10),
    tool_tokens=(1, 16),
    summary_tokens=(2, 8),
    sub_agent_probability=0.2,
    sub_agent_turns=(1, 4),
    retry_probability=0.2,
    calls_per_weight_version=5,
)


def call(index, prompt, output, agent="", kind=""):
    """A call of execution "e" in group "g"; output j gets log-prob -0.01 * (index + 1) - 0.001 * j, version index;
    calls sample at temperatures 0.6, 0.8 and 1.0 in turn."""
    return whole_prompt_call(
        execution_id="e",
        group_id="g",
        call_index=index,
        agent_id=agent,
        call_kind=kind,
        prompt_ids=tuple(prompt),
        output_ids=tuple(output),
        output_logprobs=tuple(-0.01 * (index + 1) - 0.001 * j for j in range(len(output))),
        output_versions=(index,) * len(output),
        finish_reason="stop",
        cached_tokens=0,
        cell="c0",
        started_s=0.0,
        finished_s=1.0,
        sampling_temperature=(0.6, 0.8, 1.0)[index % 3],
    )


def check_contract(processor: TrajectoryProcessor, tree, advantage: float) -> tuple[TrainingSample, ...]:
    """What every TrajectoryProcessor must guarantee (see its docstring); AssertionError says which rule broke."""
    assert isinstance(processor, TrajectoryProcessor)
    samples = processor.process(tree, advantage)
    assert isinstance(samples, tuple)
    total_weight = 0.0
    for s in samples:
        assert (s.execution_id, s.group_id) == (tree.execution_id, tree.group_id)
        path = tree.path(s.leaf_call_index)
        n = len(s.token_ids)
        assert path.token_ids[:n] == s.token_ids, "a sample is a prefix of a call path"
        fields = (s.loss_mask, s.behaviour_logprobs, s.advantages, s.weights, s.sampling_temperatures)
        assert all(len(f) == n for f in fields), "per-token fields are aligned"
        assert not s.loss_mask[0], "token 0 has no log-prob"
        assert s.num_loss_tokens == sum(s.loss_mask) >= 1
        for t in range(n):
            if s.loss_mask[t]:
                assert path.policy_mask[t], "only policy-emitted tokens carry loss"
                assert s.behaviour_logprobs[t] == path.logprobs[t]
                assert s.sampling_temperatures[t] == path.temperatures[t], "trained at the temperature it was drawn at"
                assert s.weights[t] > 0
            else:
                assert s.weights[t] == 0.0 and s.sampling_temperatures[t] == 1.0
        assert all(a == advantage for a in s.advantages)
        versions = [v for v, m in zip(path.versions, s.loss_mask) if m]
        assert (s.min_weight_version, s.max_weight_version) == (min(versions), max(versions))
        total_weight += sum(s.weights)
    if samples:
        assert math.isclose(total_weight, 1.0, rel_tol=1e-9), "an execution's weights sum to 1"
    return samples


PROCESSORS = [
    RankedTrajectoryProcessor(),
    RankedTrajectoryProcessor(ProcessorConfig(max_trajectories=1)),
    RankedTrajectoryProcessor(ProcessorConfig(max_trajectories=3, trim_after_last_loss_token=False)),
    AllChainsProcessor(),
]


@pytest.mark.parametrize("processor", PROCESSORS, ids=lambda p: type(p).__name__)
@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("labelled", [True, False])
def test_processors_keep_the_contract(processor, seed, labelled):
    tree = build_tree(simulate_execution(seed, attrs.evolve(SMALL, labelled=labelled)))
    samples = check_contract(processor, tree, advantage=-0.75)
    assert samples


class _TrainsPrompts:
    """Broken on purpose: gives loss to every token after the first."""

    def process(self, tree, advantage):
        samples = RankedTrajectoryProcessor().process(tree, advantage)
        out = []
        for s in samples:
            mask = (False,) + (True,) * (len(s.token_ids) - 1)
            weights = tuple(1.0 / (len(mask) - 1) / len(samples) if m else 0.0 for m in mask)
            out.append(attrs.evolve(s, loss_mask=mask, weights=weights, num_loss_tokens=len(mask) - 1))
        return tuple(out)


class _Unweighted:
    """Broken on purpose: weight 1 on every loss token (a bigger tree would weigh more)."""

    def process(self, tree, advantage):
        return tuple(
            attrs.evolve(s, weights=tuple(1.0 if m else 0.0 for m in s.loss_mask))
            for s in RankedTrajectoryProcessor().process(tree, advantage)
        )


@pytest.mark.parametrize("broken", [_TrainsPrompts(), _Unweighted()], ids=lambda p: type(p).__name__)
def test_contract_check_catches_broken_processors(broken):
    tree = build_tree(simulate_execution(1, SMALL))
    with pytest.raises(AssertionError):
        check_contract(broken, tree, advantage=1.0)


# -- a hand-built execution -----------------------------------------------------------------------------------------

# main: m0 -> m1 -> m2 (m2 continues past a summary that branched off m1); m3 resamples m1 (a retry).
# explorer (sub-agent): a0 -> a1, with a summary a2 branching off a0; a3 is an aborted call with no output.
HAND = [
    call(0, [1, 2], [10, 11], agent="main", kind="turn"),
    call(1, [1, 2, 10, 11, 3], [12, 13], agent="main", kind="turn"),
    call(2, [7, 8], [30, 31], agent="explorer", kind="turn"),
    call(3, [1, 2, 10, 11, 3, 12, 13, 90], [40, 41, 42], agent="main", kind="summary"),
    call(4, [7, 8, 30, 31, 90], [50], agent="explorer", kind="summary"),
    call(5, [7, 8, 30, 31, 4], [32, 33], agent="explorer", kind="turn"),
    call(6, [1, 2, 10, 11, 3, 12, 13, 5], [14], agent="main", kind="turn"),
    call(7, [1, 2, 10, 11, 3], [15, 16, 17], agent="main", kind="turn"),
    call(8, [7, 8, 30, 31, 4, 32, 33, 6], [], agent="explorer", kind="turn"),
]


def test_ranking_kinds_and_later_first():
    tree = build_tree(HAND)
    ranked = RankedTrajectoryProcessor().rank(tree)
    assert [(t.leaf_call_index, t.kind) for t in ranked] == [
        (7, MAIN),
        (6, MAIN),
        (3, MAIN_SUMMARY),
        (8, SUB_AGENT),
        (4, SUB_AGENT_SUMMARY),
    ]


def test_cap_keeps_the_top_ranked():
    tree = build_tree(HAND)
    samples = RankedTrajectoryProcessor(ProcessorConfig(max_trajectories=2)).process(tree, 1.0)
    assert [(s.trajectory_rank, s.leaf_call_index, s.trajectory_kind) for s in samples] == [(0, 7, MAIN), (1, 6, MAIN)]


def test_shared_policy_tokens_are_trained_once_by_the_higher_ranked_sample():
    tree = build_tree(HAND)
    samples = {s.leaf_call_index: s for s in RankedTrajectoryProcessor().process(tree, 1.0)}
    # Call 7 (rank 0) trains m0's output (positions 2, 3) and its own; call 6 trains m1's output and its own.
    assert samples[7].token_ids == (1, 2, 10, 11, 3, 15, 16, 17)
    assert samples[7].loss_mask == (False, False, True, True, False, True, True, True)
    assert samples[6].token_ids == (1, 2, 10, 11, 3, 12, 13, 5, 14)
    assert samples[6].loss_mask == (False,) * 5 + (True, True, False, True)
    assert samples[3].loss_mask == (False,) * 8 + (True, True, True)
    # The explorer's a0 output is shared by call 8's path and the summary's; rank 3 (call 8) trains it.
    # Call 8 produced nothing, so its sample is trimmed after a1's output.
    assert samples[8].token_ids == (7, 8, 30, 31, 4, 32, 33)
    assert samples[8].loss_mask == (False, False, True, True, False, True, True)
    assert samples[4].loss_mask == (False,) * 5 + (True,)
    assert samples[4].behaviour_logprobs == (0.0,) * 5 + (-0.05,)
    assert samples[4].sampling_temperatures == (1.0,) * 5 + (0.8,)  # call 4's temperature on its one loss token


def test_weights_make_the_execution_loss_a_mean_over_its_trained_tokens():
    samples = RankedTrajectoryProcessor().process(build_tree(HAND), 0.5)
    trained = sum(s.num_loss_tokens for s in samples)
    assert trained == 5 + 3 + 3 + 4 + 1
    for s in samples:
        assert s.weights == tuple(1.0 / trained if m else 0.0 for m in s.loss_mask)
        assert s.advantages == (0.5,) * len(s.token_ids)


def test_untrimmed_samples_keep_the_whole_path():
    config = ProcessorConfig(trim_after_last_loss_token=False)
    samples = {s.leaf_call_index: s for s in RankedTrajectoryProcessor(config).process(build_tree(HAND), 1.0)}
    assert samples[8].token_ids == (7, 8, 30, 31, 4, 32, 33, 6)
    assert samples[8].loss_mask[-1] is False


def test_a_trajectory_with_nothing_left_to_train_does_not_take_a_slot():
    calls = [
        call(0, [1, 2], [10], agent="main", kind="turn"),
        call(1, [1, 2, 10, 4], [], agent="main", kind="turn"),  # aborted at once; the agent retried
        call(2, [1, 2, 10, 3], [11], agent="main", kind="turn"),  # the retry: ranks first (later), trains 10
        call(3, [9], [20], agent="sub", kind="turn"),
    ]
    tree = build_tree(calls)
    assert [t.leaf_call_index for t in RankedTrajectoryProcessor().rank(tree)] == [2, 1, 3]
    samples = RankedTrajectoryProcessor(ProcessorConfig(max_trajectories=2)).process(tree, 1.0)
    assert [s.leaf_call_index for s in samples] == [2, 3]


def test_execution_without_policy_tokens_gives_no_samples():
    tree = build_tree([call(0, [1, 2], [])])
    assert RankedTrajectoryProcessor().process(tree, 1.0) == ()
    assert AllChainsProcessor().process(tree, 1.0) == ()


def test_baseline_trains_every_chain_in_full():
    tree = build_tree(HAND)
    samples = AllChainsProcessor().process(tree, 1.0)
    # Chains: main (0, 1, 6), explorer (2, 5, 8), main summary (3), explorer summary (4), main retry (7).
    assert sorted(s.leaf_call_index for s in samples) == [3, 4, 6, 7, 8]
    for s in samples:
        path = tree.path(s.leaf_call_index)
        assert (s.token_ids, s.loss_mask) == (path.token_ids, path.policy_mask)
    # Call paths 6, 3, 7, 8, 4 hold 5, 7, 5, 4 and 3 policy tokens: m0 counted thrice, m1 and a0 twice.
    assert sum(s.num_loss_tokens for s in samples) == 5 + 7 + 5 + 4 + 3


def test_non_finite_advantage_is_rejected():
    with pytest.raises(ProcessorError):
        RankedTrajectoryProcessor().process(build_tree(HAND), float("nan"))


@pytest.mark.parametrize("seed", [4, 5])
def test_processor_output_does_not_depend_on_arrival_order(seed):
    calls = simulate_execution(seed, SMALL)
    shuffled = list(calls)
    random.Random(seed).shuffle(shuffled)
    processor = RankedTrajectoryProcessor()
    assert processor.process(build_tree(calls), 1.0) == processor.process(build_tree(shuffled), 1.0)


@pytest.mark.parametrize("seed", [6, 7, 8])
def test_independent_check_finds_no_lost_or_double_trained_token(seed):
    calls = simulate_execution(seed, SMALL)
    tree = build_tree(calls)
    samples = RankedTrajectoryProcessor().process(tree, 1.0)
    main_calls = {i for c in tree.chains() if c.kind == MAIN for i in c.call_indices}
    result = check_samples(calls, samples, main_calls)
    assert result.passed, result
    assert result.trained == sum(s.num_loss_tokens for s in samples)
    # The check is not vacuous: dropping one loss token is noticed.
    first = samples[0]
    t = first.loss_mask.index(True)
    broken = attrs.evolve(first, loss_mask=first.loss_mask[:t] + (False,) + first.loss_mask[t + 1 :])
    assert check_samples(calls, (broken, *samples[1:]), main_calls).lost == 1


def test_reduction_on_a_small_branching_group():
    config = attrs.evolve(SMALL, main_turns=30, context_limit_tokens=200)
    before = after = 0
    for seed in range(4):
        tree = build_tree(simulate_execution(seed, config))
        before += sum(len(s.token_ids) for s in AllChainsProcessor().process(tree, 1.0))
        after += sum(len(s.token_ids) for s in RankedTrajectoryProcessor().process(tree, 1.0))
    assert after < 0.75 * before


# -- landing a group ------------------------------------------------------------------------------------------------


def _trees(n, config=SMALL):
    return {f"e{i}": build_tree(simulate_execution(10 + i, config, f"e{i}", "g")) for i in range(n)}


def test_group_lands_with_advantages_and_counts():
    trees = _trees(3)
    scores = [ExecutionScored(e, "g", r, e == "e2", "") for e, r in zip(trees, (1.0, 0.0, 0.5))]
    landed = build_group_samples("g", trees, scores, RankedTrajectoryProcessor(), num_dropped=1)
    # mean 0.5, Bessel std 0.5: advantages 1, -1, 0 (up to eps).
    assert landed.advantages == pytest.approx((1.0, -1.0, 0.0), abs=1e-5)
    assert landed.execution_ids == ("e0", "e1", "e2") and landed.rewards == (1.0, 0.0, 0.5)
    assert landed.num_dropped == 1
    assert landed.num_tokens == sum(len(s.token_ids) for s in landed.samples)
    assert landed.num_loss_tokens == sum(s.num_loss_tokens for s in landed.samples)
    for e, a in zip(landed.execution_ids, landed.advantages):
        mine = [s for s in landed.samples if s.execution_id == e]
        assert mine and all(s.advantages[0] == a for s in mine)
        assert math.isclose(sum(sum(s.weights) for s in mine), 1.0)
    assert landed.min_weight_version == min(s.min_weight_version for s in landed.samples)
    assert landed.max_weight_version == max(s.max_weight_version for s in landed.samples)


def test_group_of_one_has_zero_advantage_and_empty_group_lands_nothing():
    trees = _trees(1)
    landed = build_group_samples("g", trees, [ExecutionScored("e0", "g", 3.0, False, "")], RankedTrajectoryProcessor())
    assert landed.advantages == (0.0,)
    assert all(a == 0.0 for s in landed.samples for a in s.advantages)
    empty = build_group_samples("g", trees, [], RankedTrajectoryProcessor(), num_dropped=1)
    assert (empty.samples, empty.min_weight_version, empty.max_weight_version) == ((), -1, -1)


@pytest.mark.parametrize(
    "scores",
    [
        [ExecutionScored("e0", "other", 1.0, False, "")],
        [ExecutionScored("e9", "g", 1.0, False, "")],
        [ExecutionScored("e0", "g", 1.0, False, ""), ExecutionScored("e0", "g", 0.0, False, "")],
    ],
)
def test_group_landing_rejects_inconsistent_scores(scores):
    with pytest.raises(ProcessorError):
        build_group_samples("g", _trees(1), scores, RankedTrajectoryProcessor())


def test_landed_samples_survive_the_wire_codec():
    from gyre.runtime.codec import Codec

    trees = _trees(2)
    scores = [ExecutionScored(e, "g", float(i), False, "") for i, e in enumerate(trees)]
    landed = build_group_samples("g", trees, scores, RankedTrajectoryProcessor())
    codec = Codec()
    assert codec.decode_message(codec.encode_message(landed)) == landed
