"""`gyre bench bus` end to end at a tiny size (no Ray): two real processes, every figure present and positive."""

from __future__ import annotations

import pytest

from gyre.benchmarks.bus import BenchConfig, run_bench

pytestmark = pytest.mark.timeout(180)


def test_bus_bench_measures_every_figure() -> None:
    config = BenchConfig(roundtrips=50, oneway=300, repeats=1, warmup=20)
    figures = run_bench(config, runs=1, ray_calls=0, with_ray=False)
    for key in ("gyre_roundtrip_per_s", "gyre_roundtrip_p50_ms", "gyre_roundtrip_p99_ms", "gyre_oneway_per_s",
                "gyre_oneway_recorded_per_s", "raw_zmq_roundtrip_per_s", "raw_asyncio_roundtrip_per_s"):
        assert figures[key] > 0, key
    assert figures["gyre_roundtrip_p50_ms"] <= figures["gyre_roundtrip_p99_ms"]
    assert figures["recording_overhead"] < 1.0
    assert set(figures["targets_met"]) == {"ratio_at_least_5x", "p99_at_most_1ms", "recording_overhead_at_most_15pct"}
    assert "ray_roundtrip_per_s" not in figures  # skipped, not invented
