"""gyre bench gradients on a small buffer: real satellite processes, real Mooncake pulls and real gloo rounds."""

from __future__ import annotations

import pytest

from gyre.benchmarks.gradients import GradientBenchConfig, run_gradient_bench


def test_rounds_keep_each_cells_bytes_to_one_buffer_while_the_parameter_server_grows():
    result = run_gradient_bench(GradientBenchConfig(cells=(2, 3), numel=10_001, rounds=2))
    buffer = result.buffer_bytes
    assert buffer == 40_004
    figures = {(f.path, f.cells): f for f in result.figures}
    for cells in (2, 3):
        rounds, server = figures[("rounds", cells)], figures[("parameter_server", cells)]
        assert rounds.core_received == rounds.largest_received == rounds.largest_sent == buffer
        assert server.core_received == server.largest_received == (cells - 1) * buffer
        assert rounds.round_s > 0 and server.round_s > 0 and rounds.join_s > 0
    # Three cells: a satellite also receives half a buffer in the ring (the chunk it sums), no more.
    assert figures[("rounds", 3)].satellite_received == 5001 * 4  # chunks of 5001 and 5000 elements
    assert result.rounds_growth_largest_received == result.rounds_growth_largest_sent == 1.0
    assert result.parameter_server_growth_largest_received == 2.0
    assert result.server_over_rounds_largest_received == 2.0


def test_bad_configs_are_refused():
    for bad in (dict(cells=(1,)), dict(cells=()), dict(numel=1), dict(rounds=0)):
        with pytest.raises(ValueError):
            GradientBenchConfig(**bad)
