"""Where the emulated engine's time goes (engine.py's counters, accounting.py), against hand-worked cases."""

from __future__ import annotations

import pytest

from gyre.simulate.accounting import KEYS, account, best_decode_tokens_per_s, packed_hours
from gyre.simulate.engine import DECODE, TOOL, Engine, Session
from gyre.simulate.hardware import HARDWARE, CellModel, ModelProfile
from gyre.simulate.workloads import ExecutionPlan

CELL = CellModel(HARDWARE["h200"], 8, ModelProfile())


def _plan(execution_id: str = "e0", turns: int = 2, prompt: int = 1000, tool_s: float = 5.0) -> ExecutionPlan:
    return ExecutionPlan(execution_id, setup_s=10.0, output_tokens=(100,) * turns, observation_tokens=(50,) * turns,
                         tool_s=(tool_s,) * turns, prompt_tokens=prompt)


def _accounted(engine: Engine) -> float:
    return engine.decode_s + engine.prefill_s + engine.paused_s + engine.tools_s + engine.empty_s


def test_one_session_by_hand_every_second_in_one_account() -> None:
    engine = Engine(CELL)
    session = Session(_plan(), "g", phase_end_s=10.0)
    engine.admit([session])
    engine.advance(1000.0)
    # The same hand-worked timeline as test_models.py: setup 10 s, prefill 1000, decode 100 at 1,000 context,
    # tool 5 s, prefill 50, decode 100 at 1,150, reward 5 s. Prefill alone: the whole iteration is prefill.
    r = CELL.prefill_tokens_per_s
    prefill = (0.005 + 1000 / r) + (0.005 + 50 / r)
    decode_1, decode_2 = 100 * CELL.decode_iteration_s(1, 1000), 100 * CELL.decode_iteration_s(1, 1150)
    assert engine.prefill_s == pytest.approx(prefill, rel=1e-9)
    assert engine.decode_s == pytest.approx(decode_1 + decode_2, rel=1e-9)
    assert engine.tools_s == pytest.approx(10 + 5 + 5, rel=1e-9)  # setup, the tool, the scorer
    assert engine.empty_s == pytest.approx(1000 - session.finished_s, rel=1e-9)
    assert engine.paused_s == 0 and _accounted(engine) == pytest.approx(1000.0, rel=1e-12)
    assert engine.busy_s == pytest.approx(engine.decode_s + engine.prefill_s, rel=1e-12)
    # one sequence decoding, its KV the context it decodes from
    assert engine.decoding_s == pytest.approx(decode_1 + decode_2, rel=1e-9)
    assert engine.decoding_sequence_s / engine.decoding_s == pytest.approx(1.0)
    mean_context = (1000 * decode_1 + 1150 * decode_2) / (decode_1 + decode_2)
    assert engine.decoding_kv_token_s / engine.decoding_s == pytest.approx(mean_context, rel=1e-9)
    assert engine.prefill_started_tokens == 1050 and engine.evicted_prefill_tokens == 0
    assert engine.moved_prefill_tokens == 0


def test_a_pause_is_weight_sync_whatever_the_sessions_do() -> None:
    engine = Engine(CELL)
    engine.admit([Session(_plan(), "g", phase_end_s=10.0)])
    engine.pause(6.0)
    engine.advance(8.0)  # paused 0-6 (in setup), then 2 s of setup left alone
    assert engine.paused_s == pytest.approx(6.0) and engine.tools_s == pytest.approx(2.0)
    assert _accounted(engine) == pytest.approx(8.0)


def test_a_mixed_iteration_splits_between_decode_and_its_prefill_chunk() -> None:
    engine = Engine(CELL)
    decoding = Session(ExecutionPlan("a", 0.0, (10_000,), (1,), (1.0,), 1000), "g")
    engine.admit([decoding])
    engine.advance(1.0)  # prefilled, decoding alone now
    assert decoding.phase == DECODE
    prefill_before, decode_before = engine.prefill_s, engine.decode_s
    engine.admit([Session(ExecutionPlan("b", 0.0, (10,), (1,), (1.0,), 8192), "g")])
    engine.advance(1.0 + 1e-6)  # the first event: a mixed iteration starts
    engine.advance(2.0)
    # The 8,192-token prompt is one chunk, mixed into one decode iteration: its share of iteration time is
    # 8192 / R, the rest decode; the newcomer's own decode afterwards is decode too.
    assert engine.prefill_s - prefill_before == pytest.approx(8192 / CELL.prefill_tokens_per_s, rel=1e-6)
    assert engine.decode_s - decode_before == pytest.approx(1.0 - (engine.prefill_s - prefill_before), rel=1e-6)


def test_prefixes_evicted_and_contexts_moved_without_kv_are_counted_apart() -> None:
    # A KV of 2,000 tokens (545.2 GB of KV memory at 545.2e9 / 2,000 bytes a token): two sessions of 1,500-token
    # prompts hold more than it keeps, so their next calls prefill the evicted share of their prefixes again.
    tight = CellModel(HARDWARE["h200"], 8, ModelProfile(kv_bytes_per_token=545.2e9 / 2000))
    assert tight.kv_capacity_tokens == 2000
    engine = Engine(tight)
    sessions = [Session(_plan(f"e{i}", prompt=1500), "g", phase_end_s=0.0) for i in range(2)]
    engine.admit(sessions)
    engine.advance(10_000.0)
    fresh = 2 * (1500 + 50)  # prompts and the one observation each prefills
    assert engine.evicted_prefill_tokens > 0
    assert engine.prefill_started_tokens == pytest.approx(fresh + engine.evicted_prefill_tokens)
    # A session that moves without its KV prefills its whole context again, counted as moved.
    first, second = Engine(CELL), Engine(CELL, now_s=2.0)
    session = Session(ExecutionPlan("m", 0.0, (1000,), (1,), (1.0,), 50_000), "g")
    first.admit([session])
    first.advance(2.0)
    second.admit(first.take_all(keep_kv=False))
    assert second.moved_prefill_tokens == session.context_tokens > 50_000


def test_take_idle_hands_over_the_sessions_between_calls_longest_wait_first() -> None:
    engine = Engine(CELL)
    busy = Session(ExecutionPlan("busy", 0.0, (5000,), (1,), (1.0,), 1000), "g")
    short = Session(_plan("short", tool_s=3.0), "g", phase=TOOL, phase_end_s=3.0, context_tokens=2000, turn=0)
    long = Session(_plan("long", tool_s=40.0), "g", phase=TOOL, phase_end_s=40.0, context_tokens=3000, turn=0)
    engine.admit([busy, short, long])
    engine.advance(1.0)
    held = engine.held_context_tokens
    assert engine.take_idle(1) == [long] and long.kv_cached
    assert engine.held_context_tokens == pytest.approx(held - 3000)
    assert engine.take_idle(5) == [short]  # the decoding session is never handed over
    assert engine.sessions == {busy} and engine.take_idle(3) == [] and engine.take_idle(0) == []
    assert engine.advance(1000.0) == [busy]
    # elsewhere they go on from their tool calls, their prefixes cached (no prefill again)
    other = Engine(CELL, now_s=1.0)
    other.admit([long, short])
    assert sorted(s.plan.execution_id for s in other.advance(1000.0)) == ["long", "short"]
    assert other.moved_prefill_tokens == 0 and other.prefill_started_tokens == 2 * 50


def test_account_splits_prefill_by_cause_and_leaves_the_rest_unaccounted() -> None:
    seconds = {
        "rollout.decode_s": 7200.0, "rollout.prefill_s": 3600.0, "rollout.prefill_started_tokens": 1000.0,
        "rollout.evicted_prefill_tokens": 250.0, "rollout.moved_prefill_tokens": 250.0, "rollout.tools_s": 360.0,
        "rollout.paused_s": 36.0, "rollout.empty_s": 0.0, "rollout.decoding_s": 7200.0,
        "rollout.decoding_sequence_s": 7200.0 * 50, "rollout.decoding_kv_token_s": 7200.0 * 1e6,
        "rollout.output_tokens": 7200.0 * 1000, "train.compute": 3600.0, "train.optimizer": 36.0,
        "train.idle_step_filling": 72.0,
    }
    accounts = account(seconds, cells=2, end_s=3 * 3600.0, switching_s=360.0, model=CELL,
                       mean_context_tokens=20_000.0)
    hours = accounts["cell_hours"]
    assert list(hours) == list(KEYS)
    assert hours["rollout.decode"] == 2.0 and hours["rollout.prefill"] == 0.5
    assert hours["rollout.prefill_evicted"] == 0.25 and hours["rollout.prefill_moved"] == 0.25
    assert hours["rollout.weight_sync"] == 0.01 and hours["switching"] == 0.1 and hours["train.compute"] == 1.0
    assert accounts["total_cell_hours"] == 6.0
    assert hours["unaccounted"] == pytest.approx(6.0 - (2 + 1 + 0.1 + 0.01 + 1 + 0.01 + 0.02 + 0.1))
    decode = accounts["decode"]
    assert decode["mean_sequences"] == 50 and decode["tokens_per_cell_s"] == 1000
    assert decode["mean_kv_occupancy"] == pytest.approx(1e6 / CELL.kv_capacity_tokens)
    best = best_decode_tokens_per_s(CELL, 20_000.0)
    assert best == pytest.approx(141 / CELL.decode_iteration_s(141, 141 * 20_000))  # 2.83M KV / 20k = 141
    assert decode["best_decode_cell_hours"] == pytest.approx(7200 * 1000 / best / 3600)
    packed = packed_hours(accounts, cells=2)
    assert packed["packed_hours"] == pytest.approx((2.0 + 0.5 + 1.0 + 0.01) / 2)
    assert packed["packed_best_decode_hours"] == pytest.approx((decode["best_decode_cell_hours"] + 1.51) / 2)
