"""A core cell whose trainer is a tensor-parallel group of two processes trains through the real Cell code path.

parallel_core_driver.py runs the whole loop (task source -> scripted executor -> claimer -> the core's claim loop ->
its trainer -> optimizer steps -> StepApplied -> sharded run checkpoints -> a switch to rollout whose engine starts
on the trainer's published weights -> the final save) with the core's trainer at tensor size 2 in a fresh process,
and at data-parallel size 2, and here at size 1. Checked: the same steps apply with the same loss and gradient norm (1e-5), the saved
weights agree within 1e-5 (and moved), the engine serves the last version, each step's checkpoint part is one
file per shard, and a fresh TP=2 core resumed from the last one restores every shard's weights and moments.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from gyre.engines.model_format import PRESETS, init_model_dir, init_state_dict, save_hf_state_dict

DRIVER = Path(__file__).with_name("parallel_core_driver.py")
TOL = 1e-5


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    path = init_model_dir(tmp_path_factory.mktemp("core-model") / "tiny", "tiny", seed=0)
    save_hf_state_dict(path, init_state_dict(PRESETS["tiny"], seed=31, std=0.05))
    return str(path)


def run_driver(model: str, tmp_path: Path, layout: str) -> tuple[dict, Path]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    save, ckpt = tmp_path / f"{layout}-save", tmp_path / f"{layout}-ckpt"
    proc = subprocess.run([sys.executable, str(DRIVER), model, str(tmp_path / f"{layout}.pt"), str(save), str(ckpt),
                           layout], env=env, capture_output=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr).decode(errors="replace")[-6000:]
    return torch.load(tmp_path / f"{layout}.pt"), save


def driver_module():
    sys.path.insert(0, str(DRIVER.parent))
    try:
        import parallel_core_driver
    finally:
        sys.path.pop(0)
    return parallel_core_driver


@pytest.fixture(scope="module")
def one_process_core(model, tmp_path_factory) -> tuple[dict, dict]:
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("tp1")
    want = driver_module().run(model, 1, str(root / "save"), str(root / "ckpt"))
    return want, load_file(str(root / "save" / "model.safetensors"))


def check_like_one_process(got: dict, save: Path, one_process_core) -> None:
    want, reference = one_process_core
    steps = driver_module().STEPS
    start = init_state_dict(PRESETS["tiny"], seed=31, std=0.05)
    assert [s[:2] + s[4:] for s in want["steps"]] == [(i, i + 1, False) for i in range(steps)]
    assert min(s[3] for s in want["steps"]) > 0.1  # real gradients, not clipped away
    assert max(float((reference[k] - start[k]).abs().max()) for k in reference) > 5 * TOL  # the steps moved them
    assert [s[:2] + s[4:] for s in got["steps"]] == [(i, i + 1, False) for i in range(steps)]
    for (_, _, loss, norm, _), (_, _, want_loss, want_norm, _) in zip(got["steps"], want["steps"]):
        assert abs(loss - want_loss) < TOL and abs(norm - want_norm) < TOL
    assert got["engine_version"] == want["engine_version"] == steps and got["role"] == want["role"] == "rollout"
    trained = load_file(str(save / "model.safetensors"))
    assert trained.keys() == reference.keys()
    assert max(float((trained[k] - reference[k]).abs().max()) for k in trained) < TOL


@pytest.mark.slow
def test_a_tensor_parallel_core_cell_trains_like_a_one_process_core_and_resumes(model, tmp_path, one_process_core):
    got, save = run_driver(model, tmp_path, "tp2")
    check_like_one_process(got, save, one_process_core)
    for step in range(driver_module().STEPS):
        files, told = got["staged"][step]
        assert files == ["core.tp0.pp0.pt", "core.tp1.pp0.pt"]
        assert sorted(told) == files  # the checkpointer is told of both shards
    resumed = got["resumed"]  # a fresh TP=2 core from the last step's checkpoint, each rank reading its own shard
    assert resumed["restored_digest"] == resumed["saved_digest"] != ""  # weights and AdamW moments of both shards
    assert resumed["trainer_version"] == resumed["saved_version"] == driver_module().STEPS
    assert resumed["engine_version"] == driver_module().STEPS  # its engine started on the restored weights


@pytest.mark.slow
def test_a_data_parallel_core_cell_trains_like_a_one_process_core(model, tmp_path, one_process_core):
    got, save = run_driver(model, tmp_path, "dp2")
    check_like_one_process(got, save, one_process_core)
