"""simulate/calibrated.py: the fits of a recorded run's cells, on hand-worked cases, and the calibrated model driving
the emulated engine."""

from __future__ import annotations

import pytest

from gyre.simulate.calibrated import (
    CalibratedCellModel,
    CallRecord,
    MicroStepRecord,
    fit_cell_model,
    fit_decode,
    fit_nonnegative,
    fit_train,
    time_averaged_concurrency,
)
from gyre.simulate.engine import DONE, Engine, Session
from gyre.simulate.workloads import ExecutionPlan


def test_time_averaged_concurrency_by_hand() -> None:
    # [0,2) overlaps [1,3) on [1,2): each is open with 1 other half its time -> 1.5; [5,6) is alone; [1,1] is an
    # instant inside [0,2) and [1,3): the count there plus itself.
    assert time_averaged_concurrency([(0.0, 2.0), (1.0, 3.0), (5.0, 6.0)]) == [1.5, 1.5, 1.0]
    # Nested: [0,4) holds [1,2) for a quarter of its time -> 1.25; [1,2) is always with [0,4) -> 2.
    assert time_averaged_concurrency([(0.0, 4.0), (1.0, 2.0)]) == [1.25, 2.0]
    assert time_averaged_concurrency([]) == []


def test_fit_nonnegative_exact_and_clamped() -> None:
    assert fit_nonnegative([(1, 1), (1, 2), (1, 4)], [5, 8, 14]) == pytest.approx((2.0, 3.0))
    # Unconstrained: y = -1 + 2x. With the intercept held at 0 the slope is sum(xy)/sum(x^2) = (1 + 6)/(1 + 4).
    assert fit_nonnegative([(1, 1), (1, 2)], [1, 3]) == pytest.approx((0.0, 1.4))
    with pytest.raises(ValueError):
        fit_nonnegative([], [])


def test_fit_decode_recovers_the_costs_that_made_the_calls() -> None:
    overhead, base, per_sequence, prefill = 0.1, 0.01, 0.005, 0.001

    def duration(output: int, prefilled: int, n: int) -> float:
        return overhead + output * (base + per_sequence * n) + prefilled * prefill

    calls = [
        CallRecord("a", 0.0, duration(100, 50, 1), 100, 50),                      # alone: 1.65 s
        CallRecord("b", 0.0, duration(100, 50, 2), 100, 50),                      # two side by side: 2.15 s each
        CallRecord("b", 0.0, duration(100, 50, 2), 100, 50),
        CallRecord("c", 10.0, 10.0 + duration(200, 0, 1), 200, 0),                # 3.1 s
        CallRecord("d", 0.0, duration(50, 400, 1), 50, 400),                      # 1.25 s
    ]
    assert calls[0].finished_s == pytest.approx(1.65) and calls[1].finished_s == pytest.approx(2.15)
    fit = fit_decode(calls)
    assert fit["call_overhead_s"] == pytest.approx(overhead)
    assert fit["decode_base_s"] == pytest.approx(base)
    assert fit["decode_per_sequence_s"] == pytest.approx(per_sequence)
    assert fit["prefill_s_per_token"] == pytest.approx(prefill)
    assert fit["calls"] == 5
    with pytest.raises(ValueError, match="no model call"):
        fit_decode([CallRecord("a", 0.0, 1.0, 0, 10)])


def test_fit_train_line_and_single_size() -> None:
    fit = fit_train([MicroStepRecord("core", 1000, 1.2), MicroStepRecord("core", 2000, 2.2)])
    assert fit["train_fixed_s"] == pytest.approx(0.2) and fit["train_s_per_token"] == pytest.approx(0.001)
    # One size only: no line to fit, the median rate through the origin.
    fit = fit_train([MicroStepRecord("core", 500, 1.0), MicroStepRecord("sat1", 500, 2.0),
                     MicroStepRecord("core", 500, 4.0)])
    assert fit == {"train_fixed_s": 0.0, "train_s_per_token": pytest.approx(2.0 / 500), "microsteps": 3}
    with pytest.raises(ValueError, match="micro-step"):
        fit_train([])


def test_switch_times_fall_back_to_the_boot_then_the_other_direction() -> None:
    calls = [CallRecord("a", 0.0, 1.0, 100, 0)]
    steps = [MicroStepRecord("core", 100, 0.5)]
    model = fit_cell_model(calls, steps, [0.02, 0.04, 0.03], {("", "rollout"): [5.0, 7.0],
                                                              ("rollout", "train"): [0.03, 0.05, 0.5]},
                           [0.2, 0.1, 0.3], weight_bytes=1234, capacity=12)
    assert model.rollout_to_train_s == pytest.approx(0.05)   # seen: the median
    assert model.train_to_rollout_s == pytest.approx(6.0)    # never seen: the boot into rollout
    assert model.optimizer_step_s == pytest.approx(0.03)
    assert model.weight_sync_s == pytest.approx(0.2)
    assert (model.weight_bytes, model.capacity_sessions(1e9)) == (1234, 12)
    only_back = fit_cell_model(calls, steps, [], {("train", "rollout"): [2.0]}, [])
    assert only_back.rollout_to_train_s == pytest.approx(2.0) and only_back.optimizer_step_s == 0.0


def test_calibrated_model_costs_by_hand() -> None:
    model = CalibratedCellModel(decode_base_s=0.01, decode_per_sequence_s=0.005, prefill_s_per_token=0.001,
                                train_fixed_s=0.2, train_s_per_token=0.001, kv_capacity_tokens=16384,
                                max_running_requests=12)
    assert model.decode_iteration_s(4, 1e6) == pytest.approx(0.03)       # context is no term
    assert model.decode_tokens_per_s(4, 0) == pytest.approx(4 / 0.03)
    assert model.mixed_iteration_s(4, 0, 100) == pytest.approx(0.03 + 0.1)
    assert model.prefill_tokens_per_s == pytest.approx(1000)
    assert model.train_s(3000) == pytest.approx(3.2)
    assert model.capacity_sessions(1000) == 12                           # KV holds 16, the engine runs 12
    assert model.capacity_sessions(4096) == 4


def test_one_session_on_a_calibrated_engine_by_hand() -> None:
    model = CalibratedCellModel(decode_base_s=0.01, decode_per_sequence_s=0.005, prefill_s_per_token=0.001)
    engine = Engine(model, 0.0)
    plan = ExecutionPlan("g-00", setup_s=1.0, output_tokens=(50,), observation_tokens=(0,), tool_s=(2.0,),
                         prompt_tokens=100)
    session = Session(plan, "g", phase_end_s=1.0)
    engine.admit([session])
    finished = engine.advance(10.0)
    # setup 1 s; the prompt's 100 tokens in one iteration (0.01 + 0.1 s); 50 tokens alone at 0.015 s each; tool 2 s.
    assert finished == [session] and session.phase == DONE
    assert session.finished_s == pytest.approx(1.0 + 0.11 + 0.75 + 2.0)
