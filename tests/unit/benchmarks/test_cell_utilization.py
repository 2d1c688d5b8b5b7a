"""benchmarks/studies/cell_utilization.py: each cell's role and busy shares, read off an event log written here."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

from gyre.messages.cells import LoadReport, RoleChanged
from gyre.messages.samples import TrainingSample
from gyre.messages.training import ClaimGranted, MicroStepDone, StepApplied
from gyre.runtime.codec import Codec
from gyre.runtime.envelope import Envelope, Kind
from gyre.runtime.event_log import EventLogWriter

SAMPLE = TrainingSample(
    execution_id="e", group_id="g", trajectory_rank=0, trajectory_kind="main", leaf_call_index=0, token_ids=(1, 2),
    loss_mask=(False, True), behaviour_logprobs=(0.0, 0.0), sampling_temperatures=(1.0, 1.0), advantages=(0.0, 0.0),
    weights=(0.0, 0.0), min_weight_version=0, max_weight_version=0, num_loss_tokens=1,
)


def _load():
    return importlib.import_module("gyre.benchmarks.studies.cell_utilization")


def _write(path: Path, records: list[tuple[float, str, str, object]]) -> None:
    codec = Codec()
    writer = EventLogWriter(path)
    # Out of time order on purpose: a merged log holds one process's records after another's.
    for index, (t, sender, receiver, msg) in enumerate(reversed(records)):
        envelope = Envelope(msg_id=index + 1, sender=sender, receiver=receiver, topic="", time_s=t, correlation_id=0,
                            causation_id=0, kind=Kind.TELL)
        writer.append(t, *codec.encode(envelope, msg))
    writer.close()


def _report(t: float, running: int) -> LoadReport:
    return LoadReport(cell="sat", role="rollout", engine_url="http://x", live_sessions=running,
                      running_requests=running, waiting_requests=0, free_kv_blocks=1, total_kv_blocks=1,
                      capacity_requests=8, weight_version=0, time_s=t)


def _granted(step: int, index: int) -> ClaimGranted:
    return ClaimGranted(step_id=step, microstep_index=index, samples=(SAMPLE,), num_executions_in_step=1,
                        retry_after_s=0.0)


def _done(cell: str, step: int, index: int) -> MicroStepDone:
    return MicroStepDone(cell=cell, step_id=step, microstep_index=index, grad_peer="", grad_addr=0, grad_nbytes=0,
                         num_tokens=2, loss=0.0)


def _applied(step: int) -> StepApplied:
    return StepApplied(step_id=step, version=step + 1, loss=0.0, grad_norm=0.0, num_tokens=2, num_samples=1,
                       stale_samples_dropped=0)


def test_role_and_busy_shares_over_the_steady_window(tmp_path):
    records = [
        (0.0, "core", "core", RoleChanged("core", "train", "", "", 0, 0.0, 0, True)),
        (0.0, "sat", "sat", RoleChanged("sat", "rollout", "", "http://x", 0, 0.0, 0, False)),
        (10.0, "core", "claimer", _applied(0)),  # the window: 10 .. 30
        (10.0, "core", "monitor", _applied(0)),  # the same event to another subscriber counts once
        # sat rolls out 10..20 (4 generations 10..15, none 15..20), switches 20..21, trains 21..30
        (10.0, "sat", "sat", _report(10.0, 4)),
        (15.0, "sat", "sat", _report(15.0, 0)),
        (20.0, "sat", "sat", _report(20.0, 0)),
        (21.0, "sat", "sat", RoleChanged("sat", "train", "rollout", "", 0, 1.0, 0, False)),
        (21.0, "sat", "core", RoleChanged("sat", "train", "rollout", "", 0, 1.0, 0, False)),  # another copy
        # sat holds a micro-step 22..26 (its MicroStepDone reaches the core at 26): busy 4 of its 9 s in training
        (22.0, "claimer", "sat", _granted(1, 0)),
        (26.0, "sat", "core", _done("sat", 1, 0)),
        # the core holds two overlapping micro-steps, 12..16 and 14..18, then 24..28: busy 10 of its 20 s
        (12.0, "claimer", "core", _granted(1, 1)),
        (14.0, "claimer", "core", _granted(1, 2)),
        (16.0, "core", "core", _done("core", 1, 1)),
        (18.0, "core", "core", _done("core", 1, 2)),
        (24.0, "claimer", "core", _granted(1, 3)),
        (28.0, "core", "core", _done("core", 1, 3)),
        (30.0, "core", "claimer", _applied(1)),
    ]
    _write(tmp_path / "events.glog", records)
    module = _load()
    result = module.utilization(tmp_path / "events.glog")
    assert result["window_s"] == 20.0 and result["steps"] == 2 and result["s_per_step"] == 20.0
    core, sat = result["cells"]["core"], result["cells"]["sat"]
    assert core["train_share"] == 1.0 and core["rollout_share"] == 0.0 and core["train_busy_share"] == 0.5
    assert core["rollout_mean_running"] is None and core["switches"] == 0
    assert sat["rollout_share"] == pytest.approx(0.5) and sat["switching_share"] == pytest.approx(0.05)
    assert sat["train_share"] == pytest.approx(0.45) and sat["train_busy_share"] == pytest.approx(4 / 9)
    assert sat["rollout_mean_running"] == pytest.approx(2.0) and sat["rollout_idle_share"] == pytest.approx(0.5)
    assert sat["switches"] == 1
    assert module.main([str(tmp_path)]) == 0


def test_a_log_without_two_applied_steps_is_refused(tmp_path):
    _write(tmp_path / "events.glog", [(0.0, "core", "core", RoleChanged("core", "train", "", "", 0, 0.0, 0, True)),
                                      (5.0, "core", "claimer", _applied(0))])
    with pytest.raises(SystemExit, match="fewer than two applied steps"):
        _load().utilization(tmp_path / "events.glog")
