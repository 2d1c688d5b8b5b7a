"""`gyre bench trajectories`: how many tokens the trajectory processor saves forward-backward, and what it keeps.

A seeded simulator plays agents token by token (no model, no tokenizer): a main agent that works in turns with tool
results, compresses its context with a summary call when it grows past a limit, spawns sub-agents (which may
compress too) and sometimes retries a turn from an earlier prefix. Each execution's calls become a tree; the
default processor (cap 5, shared tokens trained once, tails trimmed) is compared with the baseline that trains
every chain in full (`AllChainsProcessor`).

The simulated calls are turned into incremental records (each names the earlier call it extends, as the proxy's
do) before they enter the trees. The check does not trust the tree: it re-derives, from the raw calls, which token
positions (exact prefixes) the policy emitted, and verifies that every such position on the kept trajectories
carries loss exactly once, with its behaviour log-prob, and that nothing else carries loss.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections.abc import Sequence

import attrs
import numpy as np

from gyre.messages.model_calls import ModelCallCompleted
from gyre.messages.samples import ExecutionScored, TrainingSample
from gyre.policies.trajectory_processor import (
    AllChainsProcessor,
    ProcessorConfig,
    RankedTrajectoryProcessor,
    TrajectoryProcessor,
    build_group_samples,
)
from gyre.policies.trajectory_tree import (
    MAIN,
    TrajectoryTree,
    build_tree,
    prompt_ids_digest,
    whole_prompt_call,
)

# Chat-template glue of the simulated vocabulary; content tokens are drawn from [100, 32000).
IM_START, IM_END, NEWLINE, SYSTEM, USER, ASSISTANT, TOOL = 1, 2, 3, 4, 5, 6, 7
GENERATION_PROMPT = (IM_START, ASSISTANT, NEWLINE)
SUMMARY_REQUEST = (IM_START, USER, 90, 91, 92, 93, 94, 95, IM_END, NEWLINE)
TARGET_REDUCTION = 0.25
_CONTENT = range(100, 32000)


@attrs.frozen
class WorkloadConfig:
    """Shape of the simulated executions."""

    executions: int = 16
    """Executions (one GSPO group)."""
    main_turns: int = 48
    """Turns of the main agent."""
    context_limit_tokens: int = 8192
    """An agent compresses (summary call, then a fresh context) when its context grows past this."""
    system_tokens: int = 600
    """Length of the system prompt."""
    task_tokens: int = 200
    """Length of the task statement."""
    output_tokens: tuple[int, int] = (24, 240)
    """Range of a turn's generated tokens."""
    tool_tokens: tuple[int, int] = (40, 600)
    """Range of a tool result's tokens."""
    summary_tokens: tuple[int, int] = (150, 400)
    """Range of a summary's tokens."""
    sub_agent_probability: float = 0.1
    """Chance that a main turn spawns a sub-agent."""
    sub_agent_turns: tuple[int, int] = (3, 12)
    """Range of a sub-agent's turns."""
    retry_probability: float = 0.08
    """Chance that an agent retries from an earlier prefix after a turn."""
    retry_back_turns: tuple[int, int] = (0, 3)
    """How many turns a retry goes back (0: resample the last call)."""
    calls_per_weight_version: int = 25
    """The simulated weight version advances every this many calls."""
    labelled: bool = True
    """Whether calls carry agent and call-kind labels."""


class _Simulator:
    """Plays one execution and records its ModelCallCompleted messages."""

    def __init__(self, seed: int, config: WorkloadConfig, execution_id: str, group_id: str) -> None:
        self.rng = random.Random(seed)
        self.config = config
        self.execution_id = execution_id
        self.group_id = group_id
        self.calls: list[ModelCallCompleted] = []
        self.sub_agents = 0

    def tokens(self, span: tuple[int, int] | int) -> list[int]:
        n = span if isinstance(span, int) else self.rng.randint(*span)
        return self.rng.choices(_CONTENT, k=n)

    def call(self, agent: str, kind: str, prompt: list[int], span: tuple[int, int]) -> list[int]:
        output = self.tokens(span) + [IM_END]
        index = len(self.calls)
        version = index // self.config.calls_per_weight_version
        labelled = self.config.labelled
        self.calls.append(
            whole_prompt_call(
                execution_id=self.execution_id,
                group_id=self.group_id,
                call_index=index,
                agent_id=agent if labelled else "",
                call_kind=kind if labelled else "",
                prompt_ids=tuple(prompt),
                output_ids=tuple(output),
                output_logprobs=tuple(-self.rng.expovariate(3.0) for _ in output),
                output_versions=(version,) * len(output),
                finish_reason="stop",
                cached_tokens=0,
                cell="sim",
                started_s=float(index),
                finished_s=float(index) + 0.5,
                sampling_temperature=1.0,
            )
        )
        return output

    def run(self, agent: str, task: list[int], turns: int) -> list[int]:
        """Play one agent; return its last output (the sub-agent's answer to its parent)."""
        cfg = self.config
        system = [IM_START, SYSTEM, *self.tokens(cfg.system_tokens), IM_END, NEWLINE]
        base = system + [IM_START, USER, *task, IM_END, NEWLINE]
        context = list(base)
        snapshots: list[list[int]] = []  # contexts of this agent's calls since its last compression
        output: list[int] = []
        for _ in range(turns):
            if len(context) > cfg.context_limit_tokens:
                request = context + list(SUMMARY_REQUEST) + list(GENERATION_PROMPT)
                summary = self.call(agent, "summary", request, cfg.summary_tokens)
                context = base + [IM_START, USER, *summary[:-1], IM_END, NEWLINE]
                snapshots = []
            snapshots.append(context)
            prompt = context + list(GENERATION_PROMPT)
            output = self.call(agent, "turn", prompt, cfg.output_tokens)
            context = prompt + output + [NEWLINE]
            draw = self.rng.random()
            if agent == MAIN and draw < cfg.sub_agent_probability:
                self.sub_agents += 1
                answer = self.run(f"sub-{self.sub_agents}", output[:40], self.rng.randint(*cfg.sub_agent_turns))
                context += [IM_START, TOOL, *answer[:-1], IM_END, NEWLINE]
            elif cfg.sub_agent_probability <= draw < cfg.sub_agent_probability + cfg.retry_probability:
                back = min(self.rng.randint(*cfg.retry_back_turns), len(snapshots) - 1)
                context = snapshots[-1 - back]
                del snapshots[len(snapshots) - 1 - back :]
            else:
                context += [IM_START, TOOL, *self.tokens(cfg.tool_tokens), IM_END, NEWLINE]
        return output


def simulate_execution(
    seed: int, config: WorkloadConfig = WorkloadConfig(), execution_id: str = "e0", group_id: str = "g0"
) -> list[ModelCallCompleted]:
    """The calls of one simulated execution (deterministic in `seed`), as records that carry their whole prompt."""
    sim = _Simulator(seed, config, execution_id, group_id)
    sim.run(MAIN, sim.tokens(config.task_tokens), config.main_turns)
    return sim.calls


def full_prompts(calls: Sequence[ModelCallCompleted]) -> dict[int, tuple[int, ...]]:
    """call_index -> whole prompt of one execution's records, rebuilt without the tree: each record's shared prefix
    is taken from the path (prompt + output) of the call it names, and the digest is checked (ValueError)."""
    paths: dict[int, tuple[int, ...]] = {}
    prompts: dict[int, tuple[int, ...]] = {}
    for call in sorted(calls, key=lambda c: c.call_index):
        head = paths[call.extends_call][: call.shared_tokens] if call.extends_call >= 0 else ()
        prompt = head + tuple(call.new_prompt_ids)
        if (call.prompt_digest or call.extends_call >= 0) and prompt_ids_digest(prompt) != call.prompt_digest:
            raise ValueError(f"call {call.call_index}: the rebuilt prompt does not match its digest")
        prompts[call.call_index] = prompt
        paths[call.call_index] = prompt + tuple(call.output_ids)
    return prompts


def incremental_records(calls: Sequence[ModelCallCompleted]) -> list[ModelCallCompleted]:
    """One execution's records as the proxy sends them: each names the earlier call whose path shares the longest
    prefix with its prompt and carries only the ids after it (a call that shares nothing carries its whole prompt).
    For producers that know no earlier call (the simulator); O(calls^2 x context), for benchmark-sized inputs."""
    prompts = full_prompts(calls)
    paths: list[tuple[int, np.ndarray]] = []
    result = []
    for call in sorted(calls, key=lambda c: c.call_index):
        prompt = np.asarray(prompts[call.call_index], dtype=np.int64)
        best, shared = -1, 0
        for index, path in paths:
            n = min(len(path), len(prompt))
            differ = np.flatnonzero(path[:n] != prompt[:n])
            common = int(differ[0]) if len(differ) else n
            if common > shared:
                best, shared = index, common
        result.append(attrs.evolve(
            call, extends_call=best, shared_tokens=shared, new_prompt_ids=tuple(prompt[shared:].tolist()),
            prompt_digest=prompt_ids_digest(prompts[call.call_index]),
        ))
        paths.append((call.call_index, np.concatenate([prompt, np.asarray(call.output_ids, dtype=np.int64)])))
    return result


# -- the independent check ------------------------------------------------------------------------------------------

_MOD = (1 << 61) - 1


def _position_keys(seq: Sequence[int], known: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """A key per position that identifies the exact prefix ending there (polynomial hash plus the position);
    `known` holds the keys of a prefix of `seq` already hashed."""
    keys = list(known)
    h = keys[-1][1] if keys else 0
    for p in range(len(keys), len(seq)):
        h = (h * 1_000_003 + seq[p] + 1) % _MOD
        keys.append((p, h))
    return keys


def _longest_known_prefix(seq: tuple[int, ...], hashed: list[tuple[tuple[int, ...], int, list[tuple[int, int]]]]):
    """Keys of the longest earlier prompt or prompt + output that `seq` starts with (plain tuple comparison)."""
    lengths = ((n, i) for i, (earlier, prompt_len, _) in enumerate(hashed) for n in (len(earlier), prompt_len))
    candidates = sorted(((n, i) for n, i in lengths if n <= len(seq)), reverse=True)
    for n, i in candidates:
        earlier, _, keys = hashed[i]
        # Two spot checks reject most candidates before the full comparison copies n tokens.
        if seq[n - 1] == earlier[n - 1] and seq[n // 2] == earlier[n // 2] and seq[:n] == earlier[:n]:
            return keys[:n]
    return []


@attrs.frozen
class CheckResult:
    lost: int
    """Policy-emitted positions on kept trajectories that carry no loss (must be 0)."""
    double_trained: int
    """Loss-bearing positions that carry loss in more than one sample (must be 0)."""
    non_policy_loss: int
    """Loss on positions the policy did not emit (must be 0)."""
    logprob_mismatches: int
    """Loss positions whose behaviour log-prob differs from the emitting call's (must be 0)."""
    not_a_prefix: int
    """Samples whose tokens are not a prefix of their leaf call's prompt + output (must be 0)."""
    trained: int
    """Distinct positions trained."""
    policy_distinct: int
    """Distinct positions the policy emitted in the whole execution."""
    main_policy: int
    """Distinct policy positions in the calls of main chains."""
    main_trained: int
    """How many of those are trained."""

    @property
    def passed(self) -> bool:
        failures = (self.lost, self.double_trained, self.non_policy_loss, self.logprob_mismatches, self.not_a_prefix)
        return not any(failures)


def check_samples(
    calls: Sequence[ModelCallCompleted], samples: Sequence[TrainingSample], main_calls: set[int]
) -> CheckResult:
    """Verify samples against the raw calls (not the tree); see the module docstring."""
    by_index = {c.call_index: c for c in calls}
    emitted: dict[tuple[int, int], tuple[int, float]] = {}
    main_keys: set[tuple[int, int]] = set()
    keys_of: dict[int, list[tuple[int, int]]] = {}
    hashed: list[tuple[tuple[int, ...], int, list[tuple[int, int]]]] = []
    prompts = full_prompts(calls)
    for call in sorted(calls, key=lambda c: c.call_index):
        seq = prompts[call.call_index] + call.output_ids
        keys = _position_keys(seq, _longest_known_prefix(seq, hashed))
        hashed.append((seq, call.prompt_tokens, keys))
        keys_of[call.call_index] = keys
        start = call.prompt_tokens
        for o, key in enumerate(keys[start:]):
            emitted.setdefault(key, (call.call_index, call.output_logprobs[o]))
            if call.call_index in main_calls:
                main_keys.add(key)
    policy_on_kept: set[tuple[int, int]] = set()
    trained: set[tuple[int, int]] = set()
    double = non_policy = mismatches = not_prefix = 0
    for sample in samples:
        leaf = by_index[sample.leaf_call_index]
        full = prompts[leaf.call_index] + leaf.output_ids
        keys = keys_of[sample.leaf_call_index]
        if full[: len(sample.token_ids)] != sample.token_ids:
            not_prefix += 1
            continue
        policy_on_kept.update(k for k in keys if k in emitted)
        for p, carries in enumerate(sample.loss_mask):
            if not carries:
                continue
            key = keys[p]
            if key in trained:
                double += 1
            trained.add(key)
            if key not in emitted:
                non_policy += 1
            elif emitted[key][1] != sample.behaviour_logprobs[p]:
                mismatches += 1
    main_trained = len(main_keys & trained)
    return CheckResult(
        lost=len(policy_on_kept - trained),
        double_trained=double,
        non_policy_loss=non_policy,
        logprob_mismatches=mismatches,
        not_a_prefix=not_prefix,
        trained=len(trained),
        policy_distinct=len(emitted),
        main_policy=len(main_keys),
        main_trained=main_trained,
    )


# -- the benchmark --------------------------------------------------------------------------------------------------


def _land(
    trees: dict[str, TrajectoryTree], rewards: dict[str, float], processor: TrajectoryProcessor
) -> list[TrainingSample]:
    scores = [ExecutionScored(e, "g0", rewards[e], False, "") for e in trees]
    return list(build_group_samples("g0", trees, scores, processor).samples)


def run_benchmark(seed: int, config: WorkloadConfig, max_trajectories: int = 5) -> dict:
    """Simulate one group, process it three ways, check the result; return the figures."""
    rng = random.Random(seed)
    calls_of = {
        f"e{i}": simulate_execution(rng.randrange(1 << 30), config, f"e{i}", "g0") for i in range(config.executions)
    }
    rewards = {e: float(rng.random() < 0.5) for e in calls_of}
    records_of = {e: incremental_records(calls) for e, calls in calls_of.items()}  # as the proxy sends them
    started = time.perf_counter()
    trees = {e: build_tree(records) for e, records in records_of.items()}
    build_s = time.perf_counter() - started
    started = time.perf_counter()
    processed = _land(trees, rewards, RankedTrajectoryProcessor(ProcessorConfig(max_trajectories=max_trajectories)))
    process_s = time.perf_counter() - started
    baseline = _land(trees, rewards, AllChainsProcessor())
    dedup_only = _land(trees, rewards, RankedTrajectoryProcessor(ProcessorConfig(max_trajectories=1 << 30)))

    results = []
    for e, calls in calls_of.items():
        main_calls = {i for chain in trees[e].chains() if chain.kind == MAIN for i in chain.call_indices}
        results.append(check_samples(calls, [s for s in processed if s.execution_id == e], main_calls))
    uncapped = sum(len(s.token_ids) for s in baseline)
    main_trained, main_policy = sum(r.main_trained for r in results), sum(r.main_policy for r in results)
    tokens_processed = sum(len(s.token_ids) for s in processed)
    stats = [t.statistics() for t in trees.values()]
    return {
        "seed": seed,
        "labelled": config.labelled,
        "executions": config.executions,
        "max_trajectories": max_trajectories,
        "calls": sum(s.num_calls for s in stats),
        "chains": sum(len(t.chains()) for t in trees.values()),
        "trajectories": sum(len(t.trajectories()) for t in trees.values()),
        "call_tokens": sum(s.call_tokens for s in stats),
        "stored_tokens": sum(s.stored_tokens for s in stats),
        "tokens_uncapped": uncapped,
        "tokens_processed": tokens_processed,
        "token_reduction": 1.0 - tokens_processed / uncapped if uncapped else 0.0,
        "tokens_dedup_only": sum(len(s.token_ids) for s in dedup_only),
        "samples_uncapped": len(baseline),
        "samples_processed": len(processed),
        "loss_tokens_uncapped": sum(s.num_loss_tokens for s in baseline),
        "loss_tokens_processed": sum(s.num_loss_tokens for s in processed),
        "policy_tokens_distinct": sum(r.policy_distinct for r in results),
        "policy_tokens_trained": sum(r.trained for r in results),
        "main_policy_tokens_trained_fraction": main_trained / max(1, main_policy),
        "main_policy_tokens_trained_fraction_min": min(r.main_trained / max(1, r.main_policy) for r in results),
        "top_ranked_policy_tokens_lost": sum(r.lost for r in results),
        "double_trained_tokens": sum(r.double_trained for r in results),
        "non_policy_loss_tokens": sum(r.non_policy_loss for r in results),
        "logprob_mismatches": sum(r.logprob_mismatches for r in results),
        "check_passed": all(r.passed for r in results),
        "build_s": round(build_s, 3),
        "process_s": round(process_s, 3),
    }


def _handle(args: argparse.Namespace) -> int:
    base = WorkloadConfig(executions=args.executions, main_turns=args.main_turns)
    report = run_benchmark(args.seed, base, args.max_trajectories)
    unlabelled = run_benchmark(args.seed, attrs.evolve(base, labelled=False), args.max_trajectories)
    keys = ("tokens_uncapped", "tokens_processed", "token_reduction", "check_passed")
    keys += ("main_policy_tokens_trained_fraction",)
    report["unlabelled"] = {k: unlabelled[k] for k in keys}
    report["target_reduction"] = TARGET_REDUCTION
    report["target_met"] = report["token_reduction"] >= TARGET_REDUCTION
    passed = report["check_passed"] and unlabelled["check_passed"]
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(f"trajectories bench, seed {args.seed}: {report['executions']} executions, {report['calls']} calls, "
              f"{report['chains']} chains, {report['trajectories']} trajectories")
        for label, r in (("labelled", report), ("unlabelled", unlabelled)):
            print(f"  {label:10s} tokens uncapped {r['tokens_uncapped']:>9,}  processed {r['tokens_processed']:>9,}  "
                  f"reduction {r['token_reduction']:.1%}  "
                  f"main tokens trained {r['main_policy_tokens_trained_fraction']:.1%}  "
                  f"check {'ok' if r['check_passed'] else 'FAILED'}")
        print(f"  dedup without the cap: {report['tokens_dedup_only']:,} tokens; "
              f"tree stores {report['stored_tokens']:,} "
              f"of {report['call_tokens']:,} call tokens; process {report['process_s']} s")
    return 0 if passed else 1


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("trajectories", help="tokens saved by the trajectory processor on branching agents")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--seed", type=int, default=0, help="seed of the simulated group (default 0)")
    p.add_argument("--executions", type=_positive, default=16, help="executions in the group (default 16)")
    p.add_argument("--main-turns", type=_positive, default=48, help="turns of each main agent (default 48)")
    p.add_argument("--max-trajectories", type=_positive, default=5, help="K, trajectories kept (default 5)")
    p.set_defaults(func=_handle)
