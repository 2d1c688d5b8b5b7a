"""`gyre bench switch` at its smallest: one round trip of a satellite under two live sessions, with and without KV
migration. Checked: the JSON keys the issue asks for, no call lost, both switches recorded, and the migrated run's
moved sessions finding their prefix cached on the new cell (the re-prefill run's do not)."""

from __future__ import annotations

import argparse

import attrs

from gyre.benchmarks.switch import SwitchBenchConfig, register, run_switch_bench


def test_the_bench_parses_its_command_line():
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["switch", "--json", "--repeats", "2", "--sessions", "3", "--think-s", "0.5"])
    assert (args.json, args.repeats, args.sessions, args.think_s, args.model_dir) == (True, 2, 3, 0.5, None)
    assert args.engine_kind == "server"  # the HTTP path is what the bench exercises unless told otherwise
    assert parser.parse_args(["switch", "--engine-kind", "embedded"]).engine_kind == "embedded"
    assert callable(args.func)


def test_one_round_trip_under_load(tiny_model_dir):
    config = SwitchBenchConfig(repeats=1, sessions=2, max_new_tokens=24, opening_words=120, think_s=0.1)
    result = run_switch_bench(config, tiny_model_dir)
    figures = attrs.asdict(result)
    for key in ("rollout_to_train_s", "train_to_rollout_s", "prefix_reuse_after_switch", "prefix_reuse_reprefill",
                "lost_requests", "weight_update_s", "weight_update_distributed_s"):
        assert key in figures
    assert result.lost_requests == 0
    for run in (result.migrated, result.reprefill):
        assert len(run.rollout_to_train_s) == len(run.train_to_rollout_s) == 1
        assert run.rollout_to_train_s[0] > 0 and run.train_to_rollout_s[0] > 0
        assert run.sessions_moved >= 1 and run.calls_completed >= 4
        assert run.resumed_prompt_tokens + run.next_turn_prompt_tokens > 0
    assert result.prefix_reuse_after_switch >= 0.9
    assert result.prefix_reuse_reprefill < 0.5
    assert result.engine_kind == "server" and result.weight_update_path == "disk" and result.weight_update_s > 0
    assert result.weight_update_distributed_s > 0 and result.weight_broadcast_fallbacks == 0
