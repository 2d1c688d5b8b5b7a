"""A satellite joins a parallel core's step: shard g of every cell reduces with shard g of the others.

parallel_satellite_driver.py is the core cell's process: its trainer host holds a TrainerGroup of two processes over
gloo (tensor 2, or data 2); it trains one step alone (both micro-steps on the core), then the same step with a
satellite of the same layout in another process computing one of the two micro-steps, whose gradients come in by a
reduction round lane by lane (engines/grad_exchange.py, TrainerGroup.reduce_lanes: each core rank receives only its
own shard's bytes). Checked: the joined step's loss, gradient norm and weights equal the core alone's within 1e-5
(fp32) and a one-process trainer's on the same step; the core counted the satellite's micro-step; each side moved
exactly its shards' bytes (no rank receives the whole model); a satellite of another layout refuses the round; the
satellite then pulls the new weights shard by shard (each rank from the core's rank of the same place) and holds
exactly the core's, and a stale version is refused. The same with an expert-parallel MoE core (data 2, expert 2): lane
g carries rank g's dense weights and its half of the experts.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gyre.engines.model_format import PRESETS, init_model_dir, init_state_dict, save_hf_state_dict

DRIVER = Path(__file__).with_name("parallel_satellite_driver.py")
TOL = 1e-5


def driver_module():
    sys.path.insert(0, str(DRIVER.parent))
    try:
        import parallel_satellite_driver
    finally:
        sys.path.pop(0)
    return parallel_satellite_driver


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    path = init_model_dir(tmp_path_factory.mktemp("satellite-model") / "tiny", "tiny", seed=0)
    save_hf_state_dict(path, init_state_dict(PRESETS["tiny"], seed=31, std=0.05))  # gradients well above round-off
    return str(path)


@pytest.fixture(scope="module")
def one_process(model) -> dict:
    return reference_step(model)


def reference_step(model: str) -> dict:
    """The same step on an in-process trainer (world size 1), both micro-steps."""
    from gyre.engines.trainer import MegatronTrainer, TrainerConfig
    from gyre.policies.loss import loss_from_samples, pack_samples

    torch.set_num_threads(1)
    d = driver_module()
    trainer = MegatronTrainer(model, TrainerConfig(lr=d.LR, num_threads=1))
    start = trainer.hf_state_dict()
    for index in range(d.MICROSTEPS):
        batch = pack_samples(d.microstep(index))
        trainer.forward_backward(batch.input_ids, batch.lengths, functools.partial(
            loss_from_samples, batch=batch, num_executions=d.NUM_EXECUTIONS, clip_low=0.9, clip_high=10.0))
    result = trainer.optimizer_step()
    return {"start": start, "weights": trainer.hf_state_dict(), "grad_norm": result["grad_norm"],
            "numel": trainer.num_params}


def run_driver(model: str, tmp_path: Path, layout: str) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = tmp_path / f"{layout}.pt"
    proc = subprocess.run([sys.executable, str(DRIVER), model, str(out), layout], env=env, capture_output=True,
                          timeout=280)
    assert proc.returncode == 0, (proc.stdout + proc.stderr).decode(errors="replace")[-6000:]
    return torch.load(out)


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def check(records: dict, one_process: dict, layout: tuple[int, int, int, int]) -> None:
    alone, joined = records["alone"], records["joined"]
    assert alone["version"] == joined["version"] == 1 and not alone["skipped"] and not joined["skipped"]
    assert max_diff(one_process["weights"], one_process["start"]) > 5 * TOL  # the step moved the weights
    assert abs(joined["loss"] - alone["loss"]) < TOL
    assert abs(joined["grad_norm"] - alone["grad_norm"]) < TOL
    assert abs(joined["grad_norm"] - one_process["grad_norm"]) < TOL
    assert max_diff(joined["weights"], alone["weights"]) < TOL  # the core alone, same layout
    assert max_diff(joined["weights"], one_process["weights"]) < TOL
    assert [c[:2] for c in joined["counted"]] == [(0, 1)]  # the satellite's micro-step, counted by the core
    assert tuple(joined["layout"]) == layout
    lanes = joined["lane_numels"]
    assert len(lanes) == 2
    shard_bytes = 4 * sum(lanes)
    assert joined["core_received"] == joined["joined"]["sent"] == shard_bytes  # one buffer's worth per lane
    assert joined["core_sent"] == joined["joined"]["received"] == 0  # one satellite: no ring step
    if layout[0] > 1:  # tensor-parallel: each rank moves only its shard, never the whole model
        assert max(lanes) < one_process["numel"]
    assert "share one training layout" in joined["refused"]["error"]
    # Weights back to the satellite, shard by shard: exactly the core's new weights, at its version.
    assert tuple(joined["source_layout"]) == layout and [s[2] for s in joined["shards"]] == [4 * n for n in lanes]
    assert "fence shows 1" in joined["stale"]["error"] and joined["stale"]["version"] == -1
    assert joined["pulled"]["version"] == 1 and joined["pulled"]["moved"] == shard_bytes
    assert joined["pulled"]["digest"] == joined["core_digest"]


@pytest.mark.slow
def test_a_satellite_joins_a_tensor_parallel_cores_step(model, tmp_path, one_process):
    check(run_driver(model, tmp_path, "tp2"), one_process, (2, 1, 1, 1))


@pytest.mark.slow
def test_a_satellite_joins_a_data_parallel_cores_step(model, tmp_path, one_process):
    check(run_driver(model, tmp_path, "dp2"), one_process, (1, 1, 2, 1))


@pytest.mark.slow
def test_a_satellite_joins_an_expert_parallel_cores_step(tmp_path):
    path = init_model_dir(tmp_path / "tiny-moe", "tiny-moe", seed=0)
    save_hf_state_dict(path, init_state_dict(PRESETS["tiny-moe"], seed=31, std=0.05))
    want = reference_step(str(path))
    records = run_driver(str(path), tmp_path, "moe_ep2")
    check(records, want, (1, 1, 2, 2))
    assert max(records["joined"]["lane_numels"]) < want["numel"]  # each lane: the dense weights and half the experts
