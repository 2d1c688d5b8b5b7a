"""The prefix-shared token tree: storage, policy flags, chains (labelled and unlabelled), trajectories."""

from __future__ import annotations

import random

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gyre.benchmarks.trajectories import WorkloadConfig, incremental_records, simulate_execution
from gyre.policies.errors import PromptMismatch, TrajectoryError, TreeFull
from gyre.policies.trajectory_tree import (
    MAIN,
    MAIN_SUMMARY,
    SUB_AGENT,
    SUB_AGENT_SUMMARY,
    TrajectoryTree,
    TreeConfig,
    build_tree,
    prompt_ids_digest,
    rebuild_prompts,
    whole_prompt_call,
)


def call(index, prompt, output, agent="", kind="", logprobs=None, versions=None, execution="e", group="g",
         temperature=1.0):
    if logprobs is None:
        logprobs = [-0.01 * (index + 1) - 0.001 * j for j in range(len(output))]
    logprobs = tuple(logprobs)
    versions = tuple(versions) if versions is not None else (index,) * len(output)
    return whole_prompt_call(
        execution_id=execution,
        group_id=group,
        call_index=index,
        agent_id=agent,
        call_kind=kind,
        prompt_ids=tuple(prompt),
        output_ids=tuple(output),
        output_logprobs=logprobs,
        output_versions=versions,
        finish_reason="stop",
        cached_tokens=0,
        cell="c0",
        started_s=0.0,
        finished_s=1.0,
        sampling_temperature=temperature,
    )


def chain_summary(tree):
    return [(c.kind, c.call_indices, c.branched_from) for c in tree.chains()]


# -- storage and policy flags ----------------------------------------------------------------------------------------


def test_shared_prefixes_are_stored_once():
    tree = build_tree([call(0, [1, 2, 3, 4], [5, 6]), call(1, [1, 2, 3, 9], [7])])
    stats = tree.statistics()
    # [1,2,3] shared; then 4,5,6 and 9,7.
    assert stats.stored_tokens == 3 + 3 + 2
    assert stats.call_tokens == 6 + 5
    assert stats.policy_tokens == 3
    assert stats.num_nodes == 3


def test_ids_calls_and_versions_are_stored_in_32_bits_and_wider_ones_are_refused():
    top = 2**31 - 1
    tree = build_tree([call(0, [top, 0, -5], [top - 1], versions=[top]), call(1, [top, 0, -5, top - 1, 3], [4])])
    path = tree.path(1)
    assert path.token_ids == (top, 0, -5, top - 1, 3, 4) and path.versions[3] == top
    assert tree.prompt_ids(1) == (top, 0, -5, top - 1, 3)  # rebuilt and checked against its 64-bit digest
    for wide in (call(2, [top + 1], [1]), call(2, [1], [-(2**31) - 1]), call(2, [1], [2], versions=[2**31])):
        with pytest.raises(TrajectoryError, match="32 bits"):
            tree.add_call(wide)
    with pytest.raises(TrajectoryError, match="call_index"):
        tree.add_call(call(2**31, [1], [2]))
    assert tree.num_calls == 2


def test_policy_tokens_of_earlier_calls_stay_policy_inside_later_prompts():
    first = call(0, [1, 2], [10, 11], logprobs=[-0.5, -0.25], versions=[3, 4])
    second = call(1, [1, 2, 10, 11, 7, 8], [12], logprobs=[-0.125], versions=[5])
    tree = build_tree([first, second])
    path = tree.path(1)
    assert path.token_ids == (1, 2, 10, 11, 7, 8, 12)
    assert path.policy_mask == (False, False, True, True, False, False, True)
    assert path.logprobs == (0.0, 0.0, -0.5, -0.25, 0.0, 0.0, -0.125)
    assert path.versions == (-1, -1, 3, 4, -1, -1, 5)


def test_same_token_text_at_another_position_is_not_policy():
    # The summary's tokens re-appear in a fresh context: there they are prompt text, not policy output.
    summary = call(0, [1, 2, 3], [40, 41])
    fresh = call(1, [1, 40, 41], [50])
    path = build_tree([summary, fresh]).path(1)
    assert path.policy_mask == (False, False, False, True)


@pytest.mark.parametrize("order", [(0, 1), (1, 0)])
def test_lowest_call_index_supplies_logprob_whatever_the_arrival_order(order):
    calls = [call(0, [1, 2], [3, 4], logprobs=[-1.0, -2.0]), call(1, [1, 2], [3, 5], logprobs=[-7.0, -8.0])]
    tree = TrajectoryTree("e", "g")
    for i in order:
        tree.add_call(calls[i])
    assert tree.path(1).logprobs == (0.0, 0.0, -1.0, -8.0)
    assert tree.path(0).logprobs == (0.0, 0.0, -1.0, -2.0)


def test_each_policy_token_carries_the_temperature_of_the_call_that_emitted_it():
    # A main turn at 0.7 whose output reappears inside a summary call's prompt, and the summary drawn at 0.3: each
    # emitted token keeps its own call's temperature (the trainer divides its logits by it); prompt tokens get 1.
    turn = call(0, [1, 2], [3, 4], agent="main", kind="turn", temperature=0.7)
    summary = call(1, [1, 2, 3, 4, 9], [5, 6], agent="main", kind="summary", temperature=0.3)
    tree = build_tree([summary, turn])
    assert tree.path(0).temperatures == (1.0, 1.0, 0.7, 0.7)
    assert tree.path(1).temperatures == (1.0, 1.0, 0.7, 0.7, 1.0, 0.3, 0.3)


def test_a_redelivered_call_at_another_temperature_is_a_conflict():
    tree = TrajectoryTree("e", "g")
    tree.add_call(call(0, [1], [2], temperature=0.7))
    with pytest.raises(TrajectoryError, match="already added"):
        tree.add_call(call(0, [1], [2], temperature=1.0))


def test_a_late_arriving_earlier_call_marks_its_tokens_inside_a_later_prompt():
    later = call(1, [1, 2, 10, 11, 7], [12])
    earlier = call(0, [1, 2], [10, 11])
    tree = TrajectoryTree("e", "g")
    tree.add_call(later)
    assert tree.path(1).policy_mask == (False, False, False, False, False, True)
    tree.add_call(earlier)
    assert tree.path(1).policy_mask == (False, False, True, True, False, True)


def test_paths_survive_splits_of_nodes_they_end_in():
    tree = build_tree([call(0, [1, 2, 3, 4, 5], [6]), call(1, [1, 2], [3]), call(2, [1, 2, 3, 9], [])])
    assert tree.path(0).token_ids == (1, 2, 3, 4, 5, 6)
    assert tree.path(1).token_ids == (1, 2, 3)
    assert tree.path(1).policy_mask == (False, False, True)
    assert tree.path(2).token_ids == (1, 2, 3, 9)
    # Call 1 emitted the 3 at position 2; call 0 (lower index) had it as prompt, so it is call 1's policy token.
    assert tree.path(0).policy_mask == (False, False, True, False, False, True)


# -- chains ---------------------------------------------------------------------------------------------------------


def test_unlabelled_chains_follow_prefix_extension():
    calls = [
        call(0, [1, 2], [10]),  # main starts
        call(1, [1, 2, 10, 3], [11]),  # extends call 0: main continues
        call(2, [8, 9], [20]),  # fresh context: a sub-agent
        call(3, [1, 2, 10, 3, 11, 4], [12]),  # extends call 1: main continues
        call(4, [8, 9, 20, 5], [21]),  # extends call 2: the sub-agent continues
        call(5, [1, 2, 10, 6], [13]),  # extends call 0, which is no longer last: a retry branch of main
        call(6, [1, 2], [14]),  # same prompt as call 0: a resample, a branch of main
    ]
    tree = build_tree(calls)
    assert chain_summary(tree) == [
        (MAIN, (0, 1, 3), None),
        (SUB_AGENT, (2, 4), None),
        (MAIN, (5,), 0),
        (MAIN, (6,), 0),
    ]
    assert all(c.agent_id == "" for c in tree.chains())


def test_unlabelled_call_continues_the_deepest_extended_chain():
    calls = [call(0, [1], [2]), call(1, [1, 2, 3], [4]), call(2, [1, 2, 9], [5]), call(3, [1, 2, 3, 4, 7], [6])]
    tree = build_tree(calls)
    # call 2 branches from chain 0 (whose last call is call 1); call 3 extends call 1, the deepest end.
    assert chain_summary(tree) == [(MAIN, (0, 1, 3), None), (MAIN, (2,), 0)]


def test_labelled_chains_follow_labels():
    calls = [
        call(0, [1, 2], [10], agent="main", kind="turn"),
        call(1, [1, 2, 10, 3], [11], agent="main", kind="turn"),
        call(2, [6, 7], [30], agent="explorer", kind="turn"),
        call(3, [1, 2, 10, 3, 11, 90], [40, 41], agent="main", kind="summary"),  # extends main, another label
        call(4, [6, 7, 30, 5], [31], agent="explorer", kind="turn"),
        call(5, [6, 7, 30, 5, 31, 90], [32], agent="explorer", kind="summary"),
        call(6, [1, 5, 40, 41], [12], agent="main", kind="turn"),  # after compression: a fresh main context
        call(7, [1, 5, 40, 41, 12, 4], [13], agent="main", kind="turn"),
    ]
    tree = build_tree(calls)
    assert chain_summary(tree) == [
        (MAIN, (0, 1), None),
        (SUB_AGENT, (2, 4), None),
        (MAIN_SUMMARY, (3,), 0),
        (SUB_AGENT_SUMMARY, (5,), 1),
        (MAIN, (6, 7), None),
    ]
    assert [c.agent_id for c in tree.chains()] == ["main", "explorer", "main", "explorer", "main"]


def test_partial_labels_default_to_main_agent_and_turn():
    tree = build_tree([call(0, [1], [2], kind="summary"), call(1, [5], [6], agent="helper")])
    assert [c.kind for c in tree.chains()] == [MAIN_SUMMARY, SUB_AGENT]


def test_labelled_call_does_not_continue_a_chain_with_another_label():
    calls = [call(0, [1, 2], [3], agent="main", kind="turn"), call(1, [1, 2, 3, 4], [5], agent="sub", kind="turn")]
    assert chain_summary(build_tree(calls)) == [(MAIN, (0,), None), (SUB_AGENT, (1,), 0)]


def test_unlabelled_fresh_chain_is_main_only_until_a_main_chain_exists():
    calls = [call(0, [1], [2], agent="worker", kind="turn"), call(1, [5], [6]), call(2, [7], [8])]
    assert [c.kind for c in build_tree(calls).chains()] == [SUB_AGENT, MAIN, SUB_AGENT]


# -- trajectories ---------------------------------------------------------------------------------------------------


def test_chain_carried_by_a_longer_trajectory_lends_it_its_kind():
    calls = [
        call(0, [1, 2], [10], agent="main", kind="turn"),
        call(1, [1, 2, 10, 3], [11], agent="main", kind="turn"),
        call(2, [1, 2, 10, 3, 11, 90], [40], agent="main", kind="summary"),
        call(3, [1, 40], [12], agent="main", kind="turn"),
    ]
    trajectories = build_tree(calls).trajectories()
    assert [(t.leaf_call_index, t.kind, t.leaf_kind, t.chain_ids, t.num_tokens) for t in trajectories] == [
        (2, MAIN, MAIN_SUMMARY, (0, 1), 7),
        (3, MAIN, MAIN, (2,), 3),
    ]


def test_identical_paths_become_one_trajectory_of_the_latest_call():
    calls = [call(0, [1, 2], [3]), call(1, [1, 2], [3])]
    tree = build_tree(calls)
    assert len(tree.chains()) == 2
    [only] = tree.trajectories()
    assert (only.leaf_call_index, only.chain_ids) == (1, (0, 1))


def test_summary_that_the_main_chain_outgrows_ranks_as_a_summary():
    calls = [
        call(0, [1, 2], [10], agent="main", kind="turn"),
        call(1, [1, 2, 10, 90], [40], agent="main", kind="summary"),
        call(2, [1, 2, 10, 3], [11], agent="main", kind="turn"),  # main went on without compressing
    ]
    kinds = {t.leaf_call_index: t.kind for t in build_tree(calls).trajectories()}
    assert kinds == {1: MAIN_SUMMARY, 2: MAIN}


# -- validation and bounds ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "bad",
    [
        call(0, [1], [2], execution="other"),
        call(0, [1], [2], group="other"),
        call(0, [], [2]),
        call(0, [1], [2, 3], logprobs=[-1.0]),
        call(0, [1], [2], versions=[1, 2]),
        call(0, [1], [2], agent="main", kind="chat"),
        call(-1, [1], [2]),
        call(0, [1], [2], temperature=0.0),
        call(0, [1], [2], temperature=-0.5),
        call(0, [1], [2], temperature=float("inf")),
        call(0, [1], [2], temperature=float("nan")),
    ],
)
def test_bad_calls_are_rejected_with_a_typed_error(bad):
    with pytest.raises(TrajectoryError):
        TrajectoryTree("e", "g").add_call(bad)


def test_redelivered_call_is_a_no_op_and_a_conflicting_one_an_error():
    tree = TrajectoryTree("e", "g")
    tree.add_call(call(0, [1], [2]))
    tree.add_call(call(0, [1], [2]))
    assert tree.num_calls == 1 and tree.statistics().stored_tokens == 2
    with pytest.raises(TrajectoryError, match="already added"):
        tree.add_call(call(0, [1], [3]))


def test_bounds_raise_tree_full():
    tree = TrajectoryTree("e", "g", TreeConfig(max_stored_tokens=5))
    tree.add_call(call(0, [1, 2], [3]))
    with pytest.raises(TreeFull):
        tree.add_call(call(1, [4, 5], [6]))
    small = TrajectoryTree("e", "g", TreeConfig(max_calls=1))
    small.add_call(call(0, [1], [2]))
    with pytest.raises(TreeFull):
        small.add_call(call(1, [1], [3]))


def test_build_tree_needs_calls():
    with pytest.raises(TrajectoryError):
        build_tree([])


# -- properties on simulated agents ---------------------------------------------------------------------------------

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


class _NaiveNode:
    """A one-token-per-node trie: the obviously correct model the radix tree must agree with."""

    def __init__(self):
        self.children = {}
        self.emitter = None


def _naive(calls):
    root, count = _NaiveNode(), 0
    for c in sorted(calls, key=lambda c: c.call_index):
        node = root
        for p, token in enumerate(c.new_prompt_ids + c.output_ids):
            if token not in node.children:
                node.children[token] = _NaiveNode()
                count += 1
            node = node.children[token]
            if p >= len(c.new_prompt_ids) and node.emitter is None:
                o = p - len(c.new_prompt_ids)
                node.emitter = (c.output_logprobs[o], c.output_versions[o])
    return root, count


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**30), labelled=st.booleans())
def test_tree_agrees_with_a_naive_trie_and_ignores_arrival_order(seed, labelled):
    config = SMALL if labelled else attrs.evolve(SMALL, labelled=False)
    calls = simulate_execution(seed, config)
    tree = build_tree(calls)
    root, distinct = _naive(calls)
    assert tree.statistics().stored_tokens == distinct
    for c in calls:
        path = tree.path(c.call_index)
        assert path.token_ids == c.new_prompt_ids + c.output_ids
        node = root
        for p, token in enumerate(path.token_ids):
            node = node.children[token]
            expected = node.emitter or (0.0, -1)
            assert (path.policy_mask[p], path.logprobs[p], path.versions[p]) == (node.emitter is not None, *expected)
    shuffled = list(calls)
    random.Random(seed).shuffle(shuffled)
    again = build_tree(shuffled)
    assert again.chains() == tree.chains()
    assert again.trajectories() == tree.trajectories()
    for c in calls:
        a, b = tree.path(c.call_index), again.path(c.call_index)
        # Node ids (in `segments`) depend on the order of insertion; the per-token view must not.
        assert attrs.evolve(a, segments=()) == attrs.evolve(b, segments=())
    # The same calls as incremental records (each names the earlier call it extends, as the proxy sends them), in
    # any order: the same tree, token for token.
    records = incremental_records(calls)
    assert any(r.extends_call >= 0 for r in records)
    assert sum(len(r.new_prompt_ids) for r in records) < sum(len(c.new_prompt_ids) for c in calls)
    random.Random(seed + 1).shuffle(records)
    incremental = build_tree(records)
    assert incremental.pending_calls == 0
    assert incremental.chains() == tree.chains() and incremental.trajectories() == tree.trajectories()
    assert incremental.statistics() == tree.statistics()
    for c in calls:
        assert incremental.prompt_ids(c.call_index) == c.new_prompt_ids
        a, b = tree.path(c.call_index), incremental.path(c.call_index)
        assert attrs.evolve(a, segments=()) == attrs.evolve(b, segments=())
    # Every chain's calls extend each other; every chain end lies on exactly the trajectories that list it.
    for chain in tree.chains():
        for before, after in zip(chain.call_indices, chain.call_indices[1:]):
            earlier = tree.path(before).token_ids
            assert tree.path(after).token_ids[: len(earlier)] == earlier
    for trajectory in tree.trajectories():
        leaf = tree.path(trajectory.leaf_call_index).token_ids
        for chain in tree.chains():
            end = tree.path(chain.call_indices[-1]).token_ids
            assert (chain.chain_id in trajectory.chain_ids) == (leaf[: len(end)] == end)


def test_tree_full_leaves_the_content_unchanged():
    tree = TrajectoryTree("e", "g", TreeConfig(max_stored_tokens=6))
    tree.add_call(call(0, [1, 2, 3], [4]))
    before = tree.path(0)
    with pytest.raises(TreeFull):
        # Would mark 2 and 3 as policy tokens on the way, then needs 4 new positions: 4 + 4 > 6.
        tree.add_call(call(1, [1], [2, 3, 7, 8, 9, 10]))
    assert attrs.evolve(tree.path(0), segments=()) == attrs.evolve(before, segments=())
    assert tree.num_calls == 1 and tree.statistics().stored_tokens == 4


def test_a_call_with_a_non_finite_log_prob_is_refused():
    """A broken engine's NaN must not reach the loss: the tree refuses the call and the execution cannot train."""
    from gyre.messages.model_calls import ModelCallCompleted
    from gyre.policies.trajectory_tree import TrajectoryTree

    tree = TrajectoryTree("e", "g")
    call = ModelCallCompleted("e", "g", 0, "main", "turn", 2, -1, 0, (1, 2), b"", (3, 4), (-0.5, float("nan")), (0, 0),
                              "stop", 0, "c", 0.0, 1.0, 1.0)
    with pytest.raises(TrajectoryError, match="non-finite"):
        tree.add_call(call)


# -- incremental records ---------------------------------------------------------------------------------------------


def extending(index, base, shared, new, output, prompt, **labels):
    """Call `index` as an incremental record: `shared` tokens of call `base`'s path, then `new`; `prompt` is the whole
    prompt it claims (its digest)."""
    whole = call(index, prompt, output, **labels)
    return attrs.evolve(whole, prompt_tokens=shared + len(new), extends_call=base, shared_tokens=shared,
                        new_prompt_ids=tuple(new), prompt_digest=prompt_ids_digest(prompt))


def test_an_incremental_call_extends_an_earlier_path_or_branches_inside_it():
    tree = TrajectoryTree("e", "g")
    tree.add_call(call(0, [1, 2, 3], [4, 5]))
    tree.add_call(extending(1, 0, 5, [6], [7], [1, 2, 3, 4, 5, 6]))  # extends call 0's whole path
    tree.add_call(extending(2, 0, 3, [8], [9], [1, 2, 3, 8]))  # from call 0's prompt (a resample)
    tree.add_call(extending(3, 1, 4, [10, 11], [12], [1, 2, 3, 4, 10, 11]))  # inside call 1's path (an output token)
    tree.add_call(extending(4, 1, 7, [], [13], [1, 2, 3, 4, 5, 6, 7]))  # nothing new but the output
    assert [tree.prompt_ids(i) for i in range(5)] == [
        (1, 2, 3), (1, 2, 3, 4, 5, 6), (1, 2, 3, 8), (1, 2, 3, 4, 10, 11), (1, 2, 3, 4, 5, 6, 7)
    ]
    assert tree.path(4).token_ids == (1, 2, 3, 4, 5, 6, 7, 13)
    # Position 3 (token 4) was emitted by call 0 and stays a policy token in call 3's prompt.
    path = tree.path(3)
    assert path.policy_mask == (False, False, False, True, False, False, True)
    whole = build_tree([call(i, tree.prompt_ids(i), tree.path(i).token_ids[len(tree.prompt_ids(i)):])
                        for i in range(5)])
    assert whole.statistics() == tree.statistics()


def test_a_prompt_that_does_not_match_its_digest_is_refused_and_adds_nothing():
    tree = TrajectoryTree("e", "g")
    tree.add_call(call(0, [1, 2, 3], [4, 5]))
    before = tree.statistics()
    # The proxy's prompt had 6 where the builder's copy of call 0 has 5 (a record built on a different call 0).
    with pytest.raises(PromptMismatch, match="does not match"):
        tree.add_call(extending(1, 0, 5, [7], [8], [1, 2, 3, 4, 6, 7]))
    with pytest.raises(PromptMismatch):  # a branch inside the path is checked too
        tree.add_call(extending(1, 0, 4, [7], [8], [1, 2, 3, 5, 7]))
    assert tree.num_calls == 1 and tree.statistics() == before
    with pytest.raises(PromptMismatch):  # a whole-prompt record with a wrong digest
        tree.add_call(attrs.evolve(call(1, [1, 9], [8]), prompt_digest=prompt_ids_digest([1, 8])))
    tree.add_call(extending(1, 0, 5, [7], [8], [1, 2, 3, 4, 5, 7]))
    assert tree.num_calls == 2


def test_bad_incremental_fields_are_refused():
    tree = TrajectoryTree("e", "g")
    tree.add_call(call(0, [1, 2, 3], [4, 5]))
    with pytest.raises(TrajectoryError, match="not an earlier call"):
        tree.add_call(extending(1, 1, 1, [2], [3], [1, 2]))
    with pytest.raises(TrajectoryError, match="whose path has 5"):
        tree.add_call(extending(1, 0, 6, [], [3], [1, 2, 3, 4, 5, 0]))
    with pytest.raises(TrajectoryError, match="prompt_tokens"):
        tree.add_call(attrs.evolve(extending(1, 0, 5, [6], [7], [1, 2, 3, 4, 5, 6]), prompt_tokens=7))
    with pytest.raises(TrajectoryError, match="shared tokens"):
        tree.add_call(attrs.evolve(call(1, [1], [2]), shared_tokens=1, prompt_tokens=2))


def test_a_call_waits_for_the_call_it_extends_and_the_wait_is_bounded():
    tree = TrajectoryTree("e", "g", TreeConfig(max_pending_calls=2))
    late = extending(2, 1, 8, [9], [10], [1, 2, 3, 4, 5, 6, 7, 8, 9])
    middle = extending(1, 0, 5, [6], [7, 8], [1, 2, 3, 4, 5, 6])
    tree.add_call(late)
    tree.add_call(late)  # redelivered while waiting: still one
    tree.add_call(middle)
    assert tree.pending_calls == 2 and tree.num_calls == 0
    with pytest.raises(TreeFull, match="wait"):
        tree.add_call(extending(3, 1, 2, [0], [1], [1, 2, 0]))
    with pytest.raises(TrajectoryError, match="other content"):
        tree.add_call(attrs.evolve(late, output_ids=(11,)))
    tree.add_call(call(0, [1, 2, 3], [4, 5]))
    assert tree.pending_calls == 0 and tree.num_calls == 3
    assert tree.path(2).token_ids == (1, 2, 3, 4, 5, 6, 7, 8, 9, 10)
    assert rebuild_prompts([late, middle, call(0, [1, 2, 3], [4, 5])])[0] == (1, 2, 3, 4, 5, 6, 7, 8, 9)
    with pytest.raises(TrajectoryError, match="extends a call not taken"):
        rebuild_prompts([late])
