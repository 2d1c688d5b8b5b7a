"""Emulated agents: the shape of one execution (turns, tokens, tool latency, setup, reward) drawn from published
workload numbers (shared/reference/agent-workloads.md gathers them with their sources).

- turns: LogNormal; TerminalBench-like median 30 (Terminal-Bench 31.9-33.4 average turns; its cap is 100 turns),
  SWE-like median 60 (SWE-bench agents average 69.6-81.1 turns; SWE-agent's medians 29-78 with sigma 0.36-0.78 on
  SWE-Bench Pro, 250-turn cap).
- output tokens per turn LogNormal(median 350, sigma 1.0) capped at 8k; observation tokens per turn
  LogNormal(median 600, sigma 1.1) capped at 16k (the reference's suggested workload, consistent with 7-18k visible
  output and 35-42k mean context per call in SWE-agent traces).
- tool latency: 95% LogNormal(median 0.7 s, sigma 1.0), 5% LogNormal(median 30 s, sigma 1.2), capped at 300 s
  (Terminal-Bench 2's per-command limit); mean tool time per SWE task 266-296 s, 3.4-4.6 s a step.
- setup Uniform(5, 20) s; reward LogNormal(median 20 s, sigma 1) capped at 1,200 s.
- the system prompt and task: 2,000 tokens (a typical agent scaffold's prompt) [D].

Every draw is seeded by the group id, so every policy compared runs exactly the same executions.
"""

from __future__ import annotations

import hashlib

import attrs
import numpy as np

__all__ = ["WORKLOADS", "Workload", "ExecutionPlan"]


@attrs.frozen
class Workload:
    """Distributions of one agent workload."""

    name: str
    """Preset name."""
    turns_median: float
    """Median model calls per execution."""
    turns_sigma: float = 0.6
    """LogNormal sigma of the turn count."""
    turns_cap: int = 100
    """Most turns an execution takes (the benchmark's cap)."""
    output_median: float = 350.0
    """Median output tokens per call."""
    output_sigma: float = 1.0
    output_cap: int = 8192
    observation_median: float = 600.0
    """Median tokens a tool result adds to the context."""
    observation_sigma: float = 1.1
    observation_cap: int = 16384
    prompt_tokens: int = 2000
    """System prompt and task before the first call."""
    tool_fast_median_s: float = 0.7
    tool_fast_sigma: float = 1.0
    tool_slow_fraction: float = 0.05
    """Share of tool calls drawn from the slow (tests, builds, installs) mode."""
    tool_slow_median_s: float = 30.0
    tool_slow_sigma: float = 1.2
    tool_cap_s: float = 300.0
    """Per-command limit (Terminal-Bench 2)."""
    setup_min_s: float = 5.0
    setup_max_s: float = 20.0
    reward_median_s: float = 20.0
    reward_sigma: float = 1.0
    reward_cap_s: float = 1200.0
    context_cap_tokens: int = 131072
    """The model's context window: an execution whose context would pass it ends there."""

    def plans(self, group_id: str, group_size: int, seed: int = 0) -> list["ExecutionPlan"]:
        """The group's executions, drawn from a generator seeded by (seed, group id)."""
        digest = hashlib.blake2b(f"{seed}:{group_id}".encode(), digest_size=8).digest()
        rng = np.random.default_rng(int.from_bytes(digest, "little"))
        return [self._plan(rng, f"{group_id}-{index:02d}") for index in range(group_size)]

    def _plan(self, rng: np.random.Generator, execution_id: str) -> "ExecutionPlan":
        turns = int(min(self.turns_cap, max(1, round(rng.lognormal(np.log(self.turns_median), self.turns_sigma)))))
        out = np.minimum(self.output_cap, np.maximum(1, rng.lognormal(np.log(self.output_median), self.output_sigma,
                                                                       turns))).astype(np.int64)
        obs = np.minimum(self.observation_cap, np.maximum(
            1, rng.lognormal(np.log(self.observation_median), self.observation_sigma, turns))).astype(np.int64)
        slow = rng.random(turns) < self.tool_slow_fraction
        tool = np.where(slow, rng.lognormal(np.log(self.tool_slow_median_s), self.tool_slow_sigma, turns),
                        rng.lognormal(np.log(self.tool_fast_median_s), self.tool_fast_sigma, turns))
        tool = np.minimum(self.tool_cap_s, tool)
        # The context may not outgrow the window: the execution ends at the turn that would pass it.
        context = self.prompt_tokens + np.cumsum(out + obs)
        fits = int(np.searchsorted(context, self.context_cap_tokens, side="right"))
        turns = max(1, min(turns, fits))
        setup_s = float(rng.uniform(self.setup_min_s, self.setup_max_s))
        reward_s = float(min(self.reward_cap_s, rng.lognormal(np.log(self.reward_median_s), self.reward_sigma)))
        # The last call's tool time is the reward: the agent stops after it and the scorer runs.
        tool[turns - 1] = reward_s
        # tolist() gives the Python ints and floats that int(x) and float(x) would, without a loop in Python.
        return ExecutionPlan(execution_id, setup_s, tuple(out[:turns].tolist()), tuple(obs[:turns].tolist()),
                             tuple(tool[:turns].tolist()), self.prompt_tokens)


@attrs.frozen
class ExecutionPlan:
    """One emulated execution: `setup_s`, then per turn a model call (prefill, decode `output_tokens[i]`) followed
    by `tool_s[i]` of tool time that adds `observation_tokens[i]` to the context; the last tool time is the
    scorer's."""

    execution_id: str
    """Execution id (group id + index)."""
    setup_s: float
    """Sandbox start before the first call."""
    output_tokens: tuple[int, ...]
    """Tokens generated per call."""
    observation_tokens: tuple[int, ...]
    """Tokens each tool result adds (the last one is never prefilled: the execution ends)."""
    tool_s: tuple[float, ...]
    """Tool time after each call; the last entry is the reward time."""
    prompt_tokens: int
    """Context before the first call."""
    trained_tokens: int = 0
    """Tokens its samples carry to training, when recorded (a recorded execution's trajectory tree: sub-agents and
    compressions make several samples); 0: `trajectory_tokens`."""
    prefilled_tokens: tuple[int, ...] = ()
    """Per call, the prompt tokens the recorded engine computed (prompt minus its prefix-cache hits), when recorded
    (the control-plane replay prices each call's prefill from them)."""
    scoring_s: float = 0.0
    """Scorer time after the agent exited, outside the agent's slot (a recorded execution's); the presets put the
    reward time in the last tool time instead."""

    @property
    def turns(self) -> int:
        return len(self.output_tokens)

    @property
    def trajectory_tokens(self) -> int:
        """Tokens of the whole trajectory (prompt, every output, every observation but the last): what training
        processes, since prefix sharing makes one sample of the execution's single chain."""
        return self.prompt_tokens + sum(self.output_tokens) + sum(self.observation_tokens[:-1])

    def context_before(self, turn: int) -> int:
        """Context tokens the call of `turn` starts from."""
        return self.prompt_tokens + sum(self.output_tokens[:turn]) + sum(self.observation_tokens[:turn])


WORKLOADS = {
    "terminalbench": Workload("terminalbench", turns_median=30.0, turns_cap=100),
    "swe": Workload("swe", turns_median=60.0, turns_sigma=0.5, turns_cap=250),
    # DeepSWE's recipe (Qwen3-32B, R2E-Gym): ~30 turns a rollout within a 32k-token context budget.
    "deepswe": Workload("deepswe", turns_median=30.0, turns_sigma=0.5, turns_cap=100, context_cap_tokens=32768),
}
