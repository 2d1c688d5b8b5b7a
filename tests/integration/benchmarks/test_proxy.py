"""`gyre bench proxy --hostile` at its smallest: every bad request is refused with a 4xx (none is a 5xx), /health
is answered while they are in flight, every half-sent request head is closed, and memory figures come back."""

from __future__ import annotations

import argparse

from gyre.benchmarks.proxy import HostileBenchConfig, register, run_hostile_bench


def test_the_bench_parses_its_command_line():
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["proxy", "--hostile", "--rounds", "2", "--json"])
    assert (args.hostile, args.rounds, args.json) == (True, 2, True)


def test_one_hostile_round(tiny_model_dir):
    config = HostileBenchConfig(rounds=1, nested_per_round=2, huge_prompts_per_round=1, slow_connections=3,
                                header_read_timeout_s=0.5, settle_s=0.1)
    result = run_hostile_bench(config, tiny_model_dir)
    assert set(result.statuses["prompt_10mb"]) <= {413, 0}  # 0: closed before the whole body was sent
    for name, statuses in result.statuses.items():
        if name != "prompt_10mb":
            assert statuses and all(status == 400 for status in statuses), (name, statuses)
    assert result.health_answers_under_attack >= 1
    assert result.slow_connections_closed == 3
    assert result.rss_start_mb > 0 and result.rss_after_mb > 0
