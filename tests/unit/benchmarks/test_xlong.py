"""`gyre bench xlong` on a small workload: the real proxy (over a scripted backend, and over the embedded engine for
a short execution), log and tree; incremental records against whole prompts."""

from __future__ import annotations

from gyre.benchmarks.xlong import ExecutionShape, XlongConfig, run_xlong_bench


def test_incremental_records_train_the_same_samples_for_a_fraction_of_the_bytes() -> None:
    shapes = (ExecutionShape(40, 400, context_limit_tokens=6000, sub_agent_every=8, sub_agent_calls=2,
                             sub_agent_tool_tokens=300), ExecutionShape(12, 200))
    engine = ExecutionShape(10, 120, context_limit_tokens=1200, sub_agent_every=4, sub_agent_calls=1,
                            sub_agent_tool_tokens=60)
    result = run_xlong_bench(XlongConfig(executions=shapes, probe_calls=3, probe_context_tokens=4000,
                                         probe_many_message_tokens=200,
                                         engine_execution=engine, engine_context_tokens=2048))
    long, short, real = result["executions"]["x0"], result["executions"]["x1"], result["executions"]["engine-0"]
    assert (long["calls"], short["calls"], real["calls"]) == (40, 12, 10) and result["calls"] == 62
    # The short execution ran on the embedded engine (its sampled ids reused by the proxy), within its context.
    assert result["engine_execution"]["calls"] == 10 and real["max_prompt_tokens"] < 2048
    assert long["summaries"] >= 2 and long["sub_agent_calls"] >= 4  # compressions and sub-agents happened
    assert result["samples_equal"] and result["pending_calls"] == 0 and result["samples"] > 0
    base = result["baseline_whole_prompt_records"]
    # Whole prompts repeat every earlier context; the incremental records carry each token about once.
    assert result["prompt_tokens_sent"] > 3 * result["unique_tokens"]
    assert result["bus_bytes_per_unique_token"] * 3 < base["bus_bytes_per_unique_token"]
    assert result["log_bytes_per_unique_token"] * 3 < base["log_bytes_per_unique_token"]
    assert result["bus_bytes_per_unique_token"] <= 16
    assert result["probe_prompt_tokens"][1] > result["probe_prompt_tokens"][0]
    assert result["probe_many_messages_prompt_tokens"] > result["probe_prompt_tokens"][0]
    assert result["proxy_overhead_p50_ms_at_128k_many_messages"] > 0
