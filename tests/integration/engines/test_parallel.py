"""Tensor, pipeline and data parallelism (two processes over gloo each) against the one-process trainer, fp32.

parallel_worker.py runs both ranks of every layout in one pair of processes (megatron's import is paid once);
this file runs the same steps in one process and compares: loss and gradients within 1e-5, log-probs within 1e-5,
and the weights after three AdamW steps within 1e-5. The steps use TrainerConfig's default lr (1e-4): Adam divides each
gradient by its own running scale, so an element whose gradient is near zero moves by up to lr whatever its size,
and the 1e-7 round-off by which a tensor-parallel sum differs from a one-process one can flip such a move (at lr 1e-3
the tensor-parallel weights differ by 5e-5 after three steps; at 1e-4 by 5e-6). Tied models run at tensor 2 and pipeline 2 too (at pipeline 2
the tied embedding lives on both stages and its gradient is summed across them), and the MoE model at pipeline 2,
data 2 and expert 2 (each rank half of the experts, tokens exchanged by megatron's all-to-all dispatcher; tensor
parallelism of experts is not wired up and ParallelSizes refuses it).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gyre.engines.model_format import PRESETS, init_model_dir, init_state_dict, save_hf_state_dict
from gyre.engines.parallel import ParallelSizes, shard_state, unshard_state
from gyre.engines.weight_convert import hf_to_megatron

WORKER = Path(__file__).with_name("parallel_worker.py")
TOL = 1e-5
WORKER_TIMEOUT_S = 300  # two megatron imports and eight layouts take ~50 s of CPU on two cores; a hang fails the test


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def model_dir(root: Path, preset: str) -> Path:
    path = init_model_dir(root / preset, preset, seed=0)
    state = init_state_dict(PRESETS[preset], seed=31, std=0.05)  # wider than init: gradients well above round-off
    save_hf_state_dict(path, state)
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("parallel-models")
    return {"untied": str(model_dir(root, "tiny")), "tied": str(model_dir(root, "tiny-tied")),
            "moe": str(model_dir(root, "tiny-moe"))}


@pytest.fixture(scope="module")
def records(models, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("parallel-out") / "records.pt"
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(rank), str(port), str(out), json.dumps(models)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for rank in range(2)]
    try:
        outputs = [p.communicate(timeout=WORKER_TIMEOUT_S)[0].decode(errors="replace") for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, text in zip(procs, outputs):
        assert p.returncode == 0, text[-4000:]
    return torch.load(out)


@pytest.fixture(scope="module")
def reference(models) -> dict:
    """The same steps in this process (world of one)."""
    sys.path.insert(0, str(WORKER.parent))
    try:
        import parallel_worker as worker
    finally:
        sys.path.pop(0)
    from gyre.engines.trainer import MegatronTrainer, TrainerConfig

    torch.set_num_threads(2)
    out = {}
    for model in ("untied", "tied", "moe"):
        trainer = MegatronTrainer(models[model], TrainerConfig(lr=worker.LR))
        out[model] = worker.run_layout(trainer, rank=0, data=1)
    return out


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tp2", "pp2", "dp2", "tied_tp2", "tied_pp2", "moe_pp2", "moe_dp2", "moe_ep2"])
def test_two_process_layout_matches_one_process(records, reference, layout):
    got = records[layout]
    want = reference[layout.split("_")[0] if "_" in layout else "untied"]
    assert max(abs(a - b) for a, b in zip(got["losses"], want["losses"])) < TOL
    assert want["losses"][-1] < want["losses"][0]  # the steps changed something worth comparing
    assert max(float(v.abs().max()) for v in want["grads"].values()) > 1e-3
    assert max_diff(got["grads"], want["grads"]) < TOL
    assert float((got["logprobs"] - want["logprobs"]).abs().max()) < TOL
    assert max_diff(got["weights"], want["weights"]) < TOL


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["dp2", "moe_dp2", "moe_ep2", "tp2"])
def test_data_parallel_ranks_keep_a_share_of_the_optimizer_state_and_checkpoint_it_whole(records, reference, layout):
    # The sharded optimizer (TrainerConfig.shard_optimizer): at data 2 a rank keeps the moments of half the flat
    # parameters (at expert 2, and without data parallelism, all of its shard); a checkpoint holds the whole moments,
    # equal to one process's within 1e-5 where the shard is the whole model, and loading it back gives the same state.
    got = records[layout]["optimizer"]
    total = got["total"]
    if layout in ("dp2", "moe_dp2"):
        assert got["kept"] == -(-total // 2)  # rank 0's share: ceil(total / 2)
        want = reference["moe" if layout.startswith("moe") else "untied"]["optimizer"]
        assert got["moments"].shape == want["moments"].shape
        assert float((got["moments"] - want["moments"]).abs().max()) < TOL
        assert float(want["moments"].abs().max()) > 1e-4  # three steps left moments worth comparing
    else:
        assert got["kept"] == total
    assert got["roundtrip"]


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tp2", "pp2", "dp2", "tied_tp2", "tied_pp2", "moe_pp2", "moe_dp2", "moe_ep2"])
def test_weights_are_published_bucket_by_bucket_never_the_whole_model_at_once(records, layout):
    got = records[layout]
    buckets, whole = got["buckets"], got["weights"]
    assert buckets["publisher"]  # rank 0 publishes; the worker checked rank 1 got nothing
    assert buckets["union"].keys() == whole.keys()
    assert all(torch.equal(buckets["union"][k], whole[k]) for k in whole)
    total = sum(t.numel() * t.element_size() for t in whole.values())
    assert len(buckets["sizes"]) >= 5 and sum(buckets["sizes"]) == total
    assert max(buckets["sizes"]) < total / 2  # one decoder layer or the embedding at most, never the model


def test_bucket_plan_keeps_units_whole_and_within_the_bound():
    from gyre.engines.errors import TrainerError
    from gyre.engines.parallel import bucket_plan
    from gyre.engines.weight_convert import megatron_param_names

    for preset in ("tiny", "tiny-tied", "tiny-moe"):
        spec = PRESETS[preset]
        full = hf_to_megatron(init_state_dict(spec, seed=4), spec)
        for bound in (1, 1 << 20, 1 << 30):
            plan = bucket_plan(spec, bound)
            assert [n for bucket in plan for n in bucket] == megatron_param_names(spec)
            for bucket in plan:
                layers = {n.split(".")[2] for n in bucket if n.startswith("decoder.layers.")}
                size = sum(full[n].numel() * 4 for n in bucket)
                assert size <= bound or len(layers) <= 1  # only a single unit may exceed the bound
        assert len(bucket_plan(spec, 1 << 30)) == 1 and len(bucket_plan(spec, 1)) == spec.num_layers + 2
    with pytest.raises(TrainerError):
        bucket_plan(PRESETS["tiny"], 0)


@pytest.mark.parametrize("preset", ["tiny", "tiny-tied"])
@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2), (2, 2)])
def test_shards_put_back_together_exactly(preset, tp, pp):
    spec = PRESETS[preset]
    full = hf_to_megatron(init_state_dict(spec, seed=4), spec)
    shards = {(t, p): shard_state(full, spec, t, tp, p, pp) for t in range(tp) for p in range(pp)}
    # Each rank holds a 1/tp slice of every split matrix and only its stage's layers.
    assert sum(k.startswith("decoder.layers.") for k in shards[(0, 0)]) * pp == sum(
        k.startswith("decoder.layers.") for k in full)
    qkv = "decoder.layers.0.self_attention.linear_qkv.weight"
    assert shards[(0, 0)][qkv].shape[0] * tp == full[qkv].shape[0]
    back = unshard_state(shards, spec, tp, pp)
    assert back.keys() == full.keys()
    assert all(torch.equal(back[k], full[k]) for k in full)
    if spec.tie_word_embeddings and pp > 1:  # the last stage's copy of the embedding starts equal
        assert torch.equal(shards[(0, pp - 1)]["output_layer.weight"],
                           shards[(0, 0)]["embedding.word_embeddings.weight"])


@pytest.mark.parametrize("pp,ep", [(1, 2), (2, 2), (1, 4), (1, 8)])
def test_expert_shards_put_back_together_exactly(pp, ep):
    spec = PRESETS["tiny-moe"]  # 8 experts in layers 1-3 (layer 0 is dense)
    full = hf_to_megatron(init_state_dict(spec, seed=4), spec)
    shards = {(0, p, e): shard_state(full, spec, 0, 1, p, pp, e, ep) for p in range(pp) for e in range(ep)}
    per_rank, per_stage = spec.num_experts // ep, spec.num_layers // pp
    for (_, p, e), shard in shards.items():
        experts = {k for k in shard if ".local_experts." in k}
        # Its experts of each of its stage's sparse layers, numbered from 0 as megatron's local experts are ...
        sparse = [i for i in range(p * per_stage, (p + 1) * per_stage) if spec.is_sparse_layer(i)]
        assert len(experts) == 2 * per_rank * len(sparse)
        for i in sparse:
            local = i - p * per_stage
            for n in range(per_rank):
                fc1 = f"decoder.layers.{local}.mlp.experts.local_experts.{n}.linear_fc1.weight"
                # ... and global expert e * per_rank + n of the full model.
                want = f"decoder.layers.{i}.mlp.experts.local_experts.{e * per_rank + n}.linear_fc1.weight"
                assert torch.equal(shard[fc1], full[want])
        # Every dense weight (the router too) is whole on every expert rank.
        dense = {k for k in shard if k not in experts}
        assert dense == {k for k in shards[(0, p, 0)] if ".local_experts." not in k}
        assert all(torch.equal(shard[k], shards[(0, p, 0)][k]) for k in dense)
    back = unshard_state(shards, spec, 1, pp, ep)
    assert back.keys() == full.keys()
    assert all(torch.equal(back[k], full[k]) for k in full)


def test_gated_mlp_shard_holds_matching_gate_and_up_rows():
    spec = PRESETS["tiny"]
    full = hf_to_megatron(init_state_dict(spec, seed=4), spec)
    fc1 = "decoder.layers.1.mlp.linear_fc1.weight"
    gate, up = full[fc1].chunk(2)
    local = shard_state(full, spec, 1, 2, 0, 1)[fc1]
    assert torch.equal(local, torch.cat([gate.chunk(2)[1], up.chunk(2)[1]]))


def test_sizes_that_do_not_split_the_model_are_refused():
    from gyre.engines.errors import TrainerError

    with pytest.raises(TrainerError):
        ParallelSizes(tensor=4).check_fits(PRESETS["tiny"])  # 2 KV heads over 4 ranks
    with pytest.raises(TrainerError):
        ParallelSizes(pipeline=3).check_fits(PRESETS["tiny"])  # 4 layers over 3 stages
    with pytest.raises(TrainerError):
        ParallelSizes(data=0)
    with pytest.raises(TrainerError, match="num_experts 8 is not a multiple of expert size 3"):
        ParallelSizes(data=3, expert=3).check_fits(PRESETS["tiny-moe"])
    with pytest.raises(TrainerError, match="expert size 2 needs a qwen3_moe model; this one is dense"):
        ParallelSizes(data=2, expert=2).check_fits(PRESETS["tiny"])
    with pytest.raises(TrainerError, match="data size 2 is not a multiple of expert size 4"):
        ParallelSizes(data=2, expert=4).check_fits(PRESETS["tiny-moe"])
    with pytest.raises(TrainerError, match="expert parallel size must be an int >= 1"):
        ParallelSizes(expert=0)
    sizes = ParallelSizes(data=4, expert=2)
    sizes.check_fits(PRESETS["tiny-moe"])
    assert (sizes.world_size, sizes.expert_data) == (4, 2)  # the expert ranks are data-parallel ones
