"""The emulated cost models against hand-worked numbers (hardware.py, workloads.py, engine.py)."""

from __future__ import annotations

import pytest

from gyre.simulate.engine import DONE, Engine, Session
from gyre.simulate.hardware import HARDWARE, CellModel, ModelProfile
from gyre.simulate.workloads import WORKLOADS, ExecutionPlan, Workload

H200 = HARDWARE["h200"]
QWEN3_235B = ModelProfile()


def test_kv_capacity_from_memory_weights_and_kv_bytes() -> None:
    cell = CellModel(H200, 8, QWEN3_235B)
    # 8 x 141 GB x 0.9 = 1015.2 GB, minus 470 GB of BF16 weights = 545.2 GB, over 192,512 bytes a token.
    assert cell.kv_capacity_tokens == int(545.2e9 // 192_512)
    assert cell.kv_capacity_tokens == 2_832_031


def test_weights_that_do_not_fit_are_refused() -> None:
    with pytest.raises(ValueError, match="no KV room"):
        CellModel(HARDWARE["h100"], 4, QWEN3_235B)  # 4 x 80 GB x 0.9 = 288 GB < 470 GB


def test_decode_iteration_is_memory_bound_then_compute_bound() -> None:
    cell = CellModel(H200, 8, QWEN3_235B)
    bandwidth = 8 * 4.8e12 * 0.7  # 26.88 TB/s
    # One sequence at 10k context: (470e9 + 10k x 192,512) / 26.88e12 + 5 ms.
    expected = (470e9 + 10_000 * 192_512) / bandwidth + 0.005
    assert cell.decode_iteration_s(1, 10_000) == pytest.approx(expected)
    assert cell.decode_iteration_s(1, 10_000) == pytest.approx(0.02256, abs=1e-4)
    assert cell.decode_tokens_per_s(100, 100 * 10_000) == pytest.approx(100 / cell.decode_iteration_s(100, 1e6))
    # A dense 1B model with a huge batch: 2 x 1e9 x 100k / (8 x 989e12 x 0.5) = 50.6 ms of compute wins.
    small = CellModel(H200, 8, ModelProfile(active_params=1e9, total_params=1e9, kv_bytes_per_token=1.0))
    assert small.decode_iteration_s(100_000, 0) == pytest.approx(2e14 / (8 * 989e12 * 0.5) + 0.005)


def test_h200_decodes_about_1_4x_faster_than_h100() -> None:
    model = ModelProfile(active_params=32e9, total_params=32e9, kv_bytes_per_token=262_144)
    h100, h200 = CellModel(HARDWARE["h100"], 8, model), CellModel(H200, 8, model)
    ratio = h200.decode_tokens_per_s(64, 64 * 8000) / h100.decode_tokens_per_s(64, 64 * 8000)
    # Below the 1.43x bandwidth ratio: the fixed 5 ms iteration overhead does not speed up with HBM.
    assert 1.2 < ratio < 4.8 / 3.35


def test_prefill_train_and_sync_times() -> None:
    cell = CellModel(H200, 8, QWEN3_235B)
    # 8 x 989e12 x 0.5 / (2 x 22e9) = 89,909 tokens a second.
    assert cell.prefill_tokens_per_s == pytest.approx(89_909.09, rel=1e-6)
    # 262,144 tokens: 8 x 22e9 x 262,144 / (8 x 989e12 x 0.35) = 16.66 s.
    assert cell.train_s(262_144) == pytest.approx(8 * 22e9 * 262_144 / (8 * 989e12 * 0.35))
    assert cell.train_s(262_144) == pytest.approx(16.66, abs=0.01)
    # 2 s + 470 GB / (8 x 50 GB/s x 0.3) = 5.92 s, near checkpoint-engine's 6.22 s for Qwen3-235B.
    assert cell.weight_sync_s == pytest.approx(2 + 470e9 / 120e9)
    assert cell.rollout_to_train_s == 8.52 and cell.train_to_rollout_s == 3.46


def test_mixed_iteration_adds_one_chunk_of_prefill() -> None:
    cell = CellModel(H200, 8, QWEN3_235B)
    decode = cell.decode_iteration_s(10, 100_000)
    assert cell.mixed_iteration_s(10, 100_000, 20_000) == pytest.approx(decode + 8192 / cell.prefill_tokens_per_s)
    assert cell.mixed_iteration_s(10, 100_000, 1000) == pytest.approx(decode + 1000 / cell.prefill_tokens_per_s)


def _plan(turns: int = 2) -> ExecutionPlan:
    return ExecutionPlan("e0", setup_s=10.0, output_tokens=(100,) * turns, observation_tokens=(50,) * turns,
                         tool_s=(5.0,) * turns, prompt_tokens=1000)


def test_plan_lengths() -> None:
    plan = _plan(3)
    assert plan.turns == 3
    assert plan.trajectory_tokens == 1000 + 300 + 100  # the last observation is never prefilled
    assert plan.context_before(2) == 1000 + 200 + 100


def test_one_session_on_an_empty_engine_by_hand() -> None:
    cell = CellModel(H200, 8, QWEN3_235B)
    engine = Engine(cell)
    session = Session(_plan(2), "g", phase_end_s=10.0)
    engine.admit([session])
    finished = engine.advance(1000.0)
    assert finished == [session] and session.phase == DONE
    # Hand-worked: setup 10 s; prefill 1000 tokens alone (1000 / 89,909 tokens/s plus one iteration overhead per
    # chunk: the chunk is below 8192 so one iteration of 5 ms + 1000 / R); 100 decode iterations at 1,100 context;
    # tool 5 s; prefill 50; 100 iterations at 1,250 context; reward 5 s.
    r = cell.prefill_tokens_per_s
    prefill_1 = 1000 * (0.005 + 1000 / r) / 1000  # rate = chunk / iteration time, for the chunk's tokens
    decode_1 = 100 * cell.decode_iteration_s(1, 1000)
    prefill_2 = 50 * (0.005 + 50 / r) / 50
    decode_2 = 100 * cell.decode_iteration_s(1, 1150)
    expected = 10 + prefill_1 + decode_1 + 5 + prefill_2 + decode_2 + 5
    assert session.finished_s == pytest.approx(expected, rel=1e-6)
    assert session.output_tokens_done == 200 and engine.output_tokens == 200
    assert session.context_tokens == 1000 + 100 + 50 + 100


def test_sessions_share_decode_and_slow_each_other() -> None:
    cell = CellModel(H200, 8, QWEN3_235B)
    alone, shared = Engine(cell), Engine(cell)
    alone.admit([Session(ExecutionPlan("e", 0.0, (100,), (1,), (0.0,), 1000), "g")])
    shared.admit([Session(ExecutionPlan(f"e{i}", 0.0, (100,), (1,), (0.0,), 1000), "g") for i in range(50)])
    t_alone = alone.advance(100.0)[0].finished_s
    t_shared = max(s.finished_s for s in shared.advance(100.0))
    assert t_shared > t_alone  # 50 prefills queue and 50 contexts are read each iteration
    # but far less than 50 times: one iteration serves all 50 (decode is memory-bound on the weights).
    assert t_shared < 10 * t_alone


def test_a_pause_delays_generation_by_its_length() -> None:
    cell = CellModel(H200, 8, QWEN3_235B)
    free, paused = Engine(cell), Engine(cell)
    free.admit([Session(_plan(1), "g", phase_end_s=0.0)])
    paused.admit([Session(_plan(1), "g", phase_end_s=0.0)])
    paused.pause(6.0)
    assert paused.advance(100.0)[0].finished_s == pytest.approx(free.advance(100.0)[0].finished_s + 6.0)


def test_sessions_taken_out_resume_elsewhere_with_or_without_kv() -> None:
    cell = CellModel(H200, 8, QWEN3_235B)
    first = Engine(cell)
    session = Session(ExecutionPlan("e0", 0.0, (1000,), (1,), (1.0,), 50_000), "g")
    first.admit([session])
    first.advance(2.0)  # prefill done (~0.6 s), decoding
    taken = first.take_all(keep_kv=False)
    assert taken == [session] and not first.sessions and 0 < session.remaining_tokens < 1000
    left = session.remaining_tokens
    second = Engine(cell, now_s=2.0)
    second.admit(taken)
    done = second.advance(1000.0)
    assert done == [session]
    assert session.output_tokens_done == pytest.approx(1000 - left + left, abs=1)
    # Without its KV it prefilled its 50k-token context again on the second engine.
    assert second.prefill_tokens == pytest.approx(session.context_tokens - 1000 + (1000 - round(left)), rel=0.05)


def test_workload_draws_are_seeded_by_group_and_respect_caps() -> None:
    workload = WORKLOADS["terminalbench"]
    a, b = workload.plans("g000001", 16), workload.plans("g000001", 16)
    assert a == b and a != workload.plans("g000002", 16)
    plans = [p for g in range(40) for p in workload.plans(f"g{g:06d}", 16)]
    turns = sorted(p.turns for p in plans)
    assert 20 <= turns[len(turns) // 2] <= 40  # median ~30
    assert max(turns) <= 100
    tools = [t for p in plans for t in p.tool_s[:-1]]
    assert max(tools) <= 300.0
    slow = sum(1 for t in tools if t >= 30.0) / len(tools)
    assert 0.01 < slow < 0.06  # a few percent of calls take 30 s and more
    assert all(p.context_before(p.turns - 1) <= workload.context_cap_tokens for p in plans)


def test_swe_runs_longer_than_terminalbench() -> None:
    swe = [p.turns for g in range(20) for p in WORKLOADS["swe"].plans(f"g{g:06d}", 16)]
    tb = [p.turns for g in range(20) for p in WORKLOADS["terminalbench"].plans(f"g{g:06d}", 16)]
    assert sum(swe) > 1.5 * sum(tb)


def test_capacity_sessions() -> None:
    cell = CellModel(H200, 8, QWEN3_235B)
    assert cell.capacity_sessions(14_000) == 2_832_031 // 14_000
    assert cell.capacity_sessions(1.0) == cell.max_running_requests
    assert isinstance(Workload("x", 10.0).plans("g", 1)[0], ExecutionPlan)
