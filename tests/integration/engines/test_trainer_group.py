"""A trainer of several processes driven from one (engines/trainer_group.py) against the in-process trainer, fp32.

trainer_group_driver.py is rank 0, as a core cell's process is: it starts the group (two processes over gloo:
tensor 2; marked slow, pipeline 2, data 2, the tied model at tensor 2, the MoE model at data 2, and expert
parallelism: the MoE model at data 2 with expert 2, each rank half of the experts, at data 4 with expert 2, four
processes in two expert groups, each expert's gradient summed over its two replicas, and at pipeline 2 with expert 2),
trains three optimizer steps on Gyre's loss, publishes, and round-trips a sharded checkpoint; this file runs the same
steps in one process (world size 1) and compares: log-probs, each step's loss and gradient norm, and the weights
after the steps within 1e-5; the weights published bucket by bucket equal the group's whole weights exactly and
never sit whole in one bucket; the checkpoint gives back the same weights and AdamW moments (digests over both, every shard)
after a step that moved them; a publication (the core's path to engine servers) streams a snapshot of the
version it was taken at, bucket by bucket, into the safetensors file an engine server loads; where the core's agent
cannot register its weights (device memory, Mooncake without CUDA) every rank serves a host copy that each step and
load refreshes. A worker killed mid-run makes the next call fail at once with an
error that names the rank, and every later call too; a worker that exits at start or never answers fails the start
(bounded) with its rank and output.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gyre.engines.model_format import PRESETS, init_model_dir, init_state_dict, save_hf_state_dict

DRIVER = Path(__file__).with_name("trainer_group_driver.py")
TOL = 1e-5
DRIVER_TIMEOUT_S = 400  # each group pays a megatron import in its worker (~10 s on busy cores); a hang fails


def driver():
    sys.path.insert(0, str(DRIVER.parent))
    try:
        import trainer_group_driver
    finally:
        sys.path.pop(0)
    return trainer_group_driver


PRESET_OF = {"untied": "tiny", "tied": "tiny-tied", "moe": "tiny-moe"}


def model_dir(root: Path, preset: str) -> str:
    path = init_model_dir(root / preset, preset, seed=0)
    save_hf_state_dict(path, init_state_dict(PRESETS[preset], seed=31, std=0.05))  # gradients well above round-off
    return str(path)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("group-models")
    return {name: model_dir(root, preset) for name, preset in PRESET_OF.items()}


@pytest.fixture(scope="module")
def model(models) -> str:
    return models["untied"]


def run_driver(models: dict, out: Path, *layouts: str) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(DRIVER), json.dumps(models), str(out), *layouts], env=env,
                          capture_output=True, timeout=DRIVER_TIMEOUT_S)
    assert proc.returncode == 0, (proc.stdout + proc.stderr).decode(errors="replace")[-6000:]
    return torch.load(out)


@pytest.fixture(scope="module")
def records(models, tmp_path_factory) -> dict:
    return run_driver(models, tmp_path_factory.mktemp("group-out") / "records.pt", "bad_start", "tp2", "kill")


def one_process(model: str) -> dict:
    from gyre.engines.trainer import MegatronTrainer, TrainerConfig

    torch.set_num_threads(2)
    return driver().train(MegatronTrainer(model, TrainerConfig(lr=driver().LR)), data=1)


@pytest.fixture(scope="module")
def reference(model) -> dict:
    return one_process(model)


@pytest.fixture(scope="module")
def moe_reference(models) -> dict:
    return one_process(models["moe"])


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def check_matches_one_process(got: dict, want: dict, preset: str = "tiny") -> None:
    assert float((got["logprobs"] - want["logprobs"]).abs().max()) < TOL
    assert max(abs(a - b) for a, b in zip(got["losses"], want["losses"])) < TOL
    assert max(abs(a - b) for a, b in zip(got["grad_norms"], want["grad_norms"])) < TOL
    assert min(want["grad_norms"]) > 0.1  # gradients well above round-off: the comparison means something
    assert max_diff(got["weights"], want["weights"]) < TOL
    moved = max(float((want["weights"][k] - w).abs().max())
                for k, w in init_weights(want["weights"].keys(), preset).items())
    assert moved > 5 * TOL  # the steps moved the weights by well over the tolerance


def init_weights(names, preset: str) -> dict:
    state = init_state_dict(PRESETS[preset], seed=31, std=0.05)
    return {k: state[k] for k in names}


def check_published_and_checkpoint(got: dict, want: dict) -> None:
    buckets = got["buckets"]
    whole = got["weights"]
    assert buckets["union"].keys() == whole.keys()
    assert all(torch.equal(buckets["union"][k], whole[k]) for k in whole)  # what a publisher sends is the model
    assert max_diff(buckets["union"], want["weights"]) < TOL  # ... and the in-process trainer's within 1e-5
    total = sum(t.numel() * t.element_size() for t in whole.values())
    assert sum(buckets["sizes"]) == total and max(buckets["sizes"]) < total / 2  # never the whole model at once
    checkpoint = got["checkpoint"]
    assert checkpoint["restored_digest"] == checkpoint["saved_digest"]  # weights and moments of every shard
    assert checkpoint["restored_version"] == checkpoint["saved_version"] == 3
    assert max_diff(checkpoint["moved"], whole) > driver().LR / 2  # the extra step moved the weights ...
    assert max_diff(checkpoint["restored"], whole) == 0.0  # ... and the restore put them back exactly
    publication = got["publication"]
    assert publication["version"] == 3
    assert max_diff(publication["file"], whole) == 0.0  # the snapshot's version, though a step came in between
    assert publication["sizes"] == buckets["sizes"] and len(publication["sizes"]) == publication["num_buckets"]
    assert sum(publication["sizes"]) == publication["total_bytes"] == total
    assert max_diff(got["loaded"]["weights"], whole) == 0.0 and got["loaded"]["version"] == 11  # loaded by shard
    check_served_copies(got)


def check_served_copies(got: dict) -> None:
    """Device weights on a Mooncake build without CUDA, every rank: the shard peers pull is a host copy, and it holds
    the weights of the last step or load, never older ones."""
    served = got["served"]
    assert served["how"] == "copy" and served["copy_apart"]
    assert served["sizes"] == [4 * n for n in got["lane_numels"]]
    ranks = len(got["lane_numels"])
    assert served["after_steps"] == [0.0] * ranks  # each rank's copy: exactly its checkpoint part's weights
    assert min(served["after_step_moved"]) > driver().LR / 2  # one more step: every rank's copy took it
    assert served["after_step_rank0"] == 0.0
    assert served["after_restore"] == served["after_load"] == [0.0] * ranks  # loads reach every copy too


def test_tensor_parallel_group_trains_like_one_process(records, reference):
    check_matches_one_process(records["tp2"], reference)


def test_tensor_parallel_group_publishes_by_bucket_and_restores_its_sharded_checkpoint(records, reference):
    check_published_and_checkpoint(records["tp2"], reference)
    assert records["tp2"]["checkpoint"]["parts"] == ["core.tp0.pp0.pt", "core.tp1.pp0.pt"]  # one file per shard


def test_a_killed_worker_fails_the_group_with_its_rank_and_output(records):
    first, second = records["kill"]["first"], records["kill"]["second"]
    assert first.startswith("trainer group rank 1 of 2 exited with code -9 during 'forward_backward'"), first
    assert "its output ends with" in first and "trainer_ready" in first  # the worker's own log lines
    assert second.startswith("the trainer group failed earlier: trainer group rank 1"), second


def test_a_worker_that_cannot_start_fails_the_start_naming_it(records):
    exits, hangs = records["bad_start"]["exits"], records["bad_start"]["hangs"]
    assert exits.startswith("trainer group rank 1 of 2 exited with code 3 during 'start'"), exits
    assert exits.endswith("no device for this rank")  # its own last words
    assert hangs.startswith("trainer group rank 1 of 2 is alive"), hangs
    assert "did not answer in time during 'start'" in hangs


@pytest.mark.slow
def test_pipeline_and_data_parallel_groups_train_like_one_process(models, reference, tmp_path):
    got = run_driver(models, tmp_path / "records.pt", "pp2", "dp2")
    for layout in ("pp2", "dp2"):
        check_matches_one_process(got[layout], reference)
        check_published_and_checkpoint(got[layout], reference)
    assert got["pp2"]["checkpoint"]["parts"] == ["core.tp0.pp0.pt", "core.tp0.pp1.pt"]
    assert got["dp2"]["checkpoint"]["parts"] == ["core.tp0.pp0.pt"]  # replicas share one shard; replica 0 writes it


@pytest.mark.slow
def test_tied_and_moe_groups_train_like_one_process(models, tmp_path):
    got = run_driver(models, tmp_path / "records.pt", "tied_tp2", "moe_dp2")
    for layout, model in (("tied_tp2", "tied"), ("moe_dp2", "moe")):  # the two other layouts of issue 26
        want = one_process(models[model])
        check_matches_one_process(got[layout], want, PRESET_OF[model])
        check_published_and_checkpoint(got[layout], want)


@pytest.mark.slow
def test_expert_parallel_group_trains_like_one_process(models, moe_reference, tmp_path):
    got = run_driver(models, tmp_path / "records.pt", "moe_ep2")["moe_ep2"]
    check_matches_one_process(got, moe_reference, "tiny-moe")
    check_published_and_checkpoint(got, moe_reference)
    assert got["checkpoint"]["parts"] == ["core.tp0.pp0.ep0.pt", "core.tp0.pp0.ep1.pt"]  # one file per expert shard
    assert [r["expert"] for r in got["ranks"]] == [0, 1]
    assert max(got["lane_numels"]) < moe_reference["num_params"]  # each rank holds only its half of the experts


@pytest.mark.slow
def test_expert_parallel_group_with_expert_replicas_trains_like_one_process(models, moe_reference, tmp_path):
    # Four ranks: data 4, expert 2. Megatron's expert groups are ranks {0, 1} and {2, 3}; an expert's replicas
    # (its expert-data-parallel group) {0, 2} or {1, 3}: a sum over the data-parallel group would count it twice.
    got = run_driver(models, tmp_path / "records.pt", "moe_dp4_ep2")["moe_dp4_ep2"]
    check_matches_one_process(got, moe_reference, "tiny-moe")
    check_published_and_checkpoint(got, moe_reference)
    assert got["checkpoint"]["parts"] == ["core.tp0.pp0.ep0.pt", "core.tp0.pp0.ep1.pt"]  # written by ranks 0 and 1
    assert [(r["data"], r["expert"]) for r in got["ranks"]] == [(0, 0), (1, 1), (2, 0), (3, 1)]


@pytest.mark.slow
def test_expert_parallel_pipeline_group_trains_like_one_process(models, moe_reference, tmp_path):
    # Four ranks: pipeline 2, data 2, expert 2; each stage's experts split over its two data ranks.
    got = run_driver(models, tmp_path / "records.pt", "moe_pp2_ep2")["moe_pp2_ep2"]
    check_matches_one_process(got, moe_reference, "tiny-moe")
    check_published_and_checkpoint(got, moe_reference)
    assert got["checkpoint"]["parts"] == ["core.tp0.pp0.ep0.pt", "core.tp0.pp0.ep1.pt", "core.tp0.pp1.ep0.pt",
                                          "core.tp0.pp1.ep1.pt"]


def test_parallel_sizes_are_checked_as_the_config_is_built(model, models):
    from gyre.engines.parallel import ParallelSizes
    from gyre.engines.trainer import TrainerConfig
    from gyre.engines.trainer_group import TrainerGroup, TrainerGroupError, build_trainer
    from gyre.runtime.errors import ConfigError

    for bad in ({"tensor_parallel": 0}, {"data_parallel": 1.5}, {"expert_parallel": 0}):
        with pytest.raises(ConfigError):
            TrainerConfig(**bad)
    with pytest.raises(ConfigError, match="expert_parallel=2 does not divide data_parallel=1"):
        TrainerConfig(expert_parallel=2)
    with pytest.raises(ConfigError, match="num_experts 8 is not a multiple of expert size 3"):
        TrainerConfig(data_parallel=3, expert_parallel=3).check_parallel_fits(PRESETS["tiny-moe"])
    with pytest.raises(ConfigError, match="expert size 2 needs a qwen3_moe model; this one is dense"):
        build_trainer(model, TrainerConfig(data_parallel=2, expert_parallel=2))  # refused before any process starts
    with pytest.raises(ConfigError, match="a qwen3_moe model trains at tensor size 1 only"):
        build_trainer(models["moe"], TrainerConfig(tensor_parallel=2, data_parallel=2, expert_parallel=2))
    assert TrainerConfig(data_parallel=4, expert_parallel=2).parallel == ParallelSizes(data=4, expert=2)
    with pytest.raises(ConfigError, match="num_kv_heads 2 is not a multiple of tensor size 4"):
        TrainerConfig(tensor_parallel=4).check_parallel_fits(PRESETS["tiny"])
    with pytest.raises(ConfigError, match="num_layers 4 is not a multiple of pipeline size 3"):
        build_trainer(model, TrainerConfig(pipeline_parallel=3))
    assert TrainerConfig(tensor_parallel=2, data_parallel=2).parallel.world_size == 4
    from gyre.engines.trainer import ensure_parallel_state

    ensure_parallel_state()  # this process has its group of one: no group's rank 0 can live here
    with pytest.raises(TrainerGroupError, match="already has a torch.distributed group"):
        TrainerGroup(model, TrainerConfig(tensor_parallel=2))
