"""`gyre bench engine` on a workload small enough for CI: every figure is there and the KV move really worked."""

from __future__ import annotations

import pytest

from gyre.benchmarks.engine import EngineBenchConfig, run_bench


def test_engine_bench_reports_every_figure_on_a_small_workload() -> None:
    pytest.importorskip("mooncake.engine")
    config = EngineBenchConfig(
        sessions=3, turns=2, system_tokens=40, task_tokens=8, observation_tokens_min=4, observation_tokens_max=12,
        output_tokens=4, backend_repeats=2, kv_repeats=1, trainer_steps=1,
    )
    report = run_bench(config)
    for key in ("embedded_tokens_per_s", "transformers_tokens_per_s", "speedup", "kv_transfer_gb_per_s",
                "kv_raw_gb_per_s", "kv_transfer_vs_raw", "trainer_tokens_per_s"):
        assert report[key] > 0, key
    assert len(report["embedded_tokens_per_s_runs"]) == len(report["transformers_tokens_per_s_runs"]) == 2
    assert report["output_tokens"] == 3 * 2 * 4
    assert report["first_turn_greedy_match"] == 1.0  # both backends generate the same greedy tokens
    assert 0 < report["prefix_hit_rate"] < 1  # turn 2 reuses turn 1's history; the first prompts are computed
    # The target engine now serves every moved history from its cache, and each session moved as one entry.
    assert report["kv_imported_tokens"] > 0
    assert report["kv_verified_cached_tokens"] == report["kv_imported_tokens"]
    assert report["kv_entries_sent"] == config.sessions
