"""MegatronTrainer on CPU: learning, gradient algebra for data parallelism, weight import/export."""

from __future__ import annotations

import pytest
import torch

from gyre.engines.errors import TrainerError
from gyre.engines.model_format import load_hf_state_dict
from gyre.engines.trainer import MegatronTrainer, TrainerConfig, ensure_parallel_state

VOCAB = 2041  # ordinary (non-added) token ids of the tiny tokenizer


def batch(seed: int, lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded random ids (padding id 0 past each length)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (len(lengths), max(lengths)), generator=g)
    for row, n in enumerate(lengths):
        ids[row, n:] = 0
    return ids, torch.tensor(lengths)


def union(*parts):
    width = max(ids.shape[1] for ids, _ in parts)
    ids = torch.cat([torch.nn.functional.pad(i, (0, width - i.shape[1])) for i, _ in parts])
    return ids, torch.cat([n for _, n in parts])


def summed_nll(logprobs: torch.Tensor):
    loss = -logprobs.sum()
    return loss, {"nll_sum": loss}


@pytest.fixture(scope="module")
def trainers(tiny_model_dir):
    """Two trainers of the same model in one process (as a core and a satellite would be in a test)."""
    torch.set_num_threads(2)
    return MegatronTrainer(tiny_model_dir), MegatronTrainer(tiny_model_dir)


@pytest.fixture
def fresh(trainers, tiny_model_dir):
    """The two trainers reset to the initial weights, zero gradients and fresh optimizer state."""
    state = load_hf_state_dict(tiny_model_dir)
    for t in trainers:
        t.load_hf_state_dict(state, version=0)
        t.zero_grads()
        t.optimizer.state.clear()
    return trainers


def test_logprobs_shape_and_padding(fresh):
    a, _ = fresh
    ids, lengths = batch(0, [9, 5, 1])
    lp = a.logprobs(ids, lengths)
    assert lp.shape == ids.shape and lp.dtype == torch.float32
    assert torch.all(lp[:, 0] == 0)
    assert torch.all(lp[1, 5:] == 0) and torch.all(lp[2] == 0)
    assert torch.all(lp[0, 1:] < 0)
    # A row's log-probs do not depend on what else is in the batch (right padding plus causality).
    alone = a.logprobs(ids[1:2, :5], lengths[1:2])
    torch.testing.assert_close(alone[0], lp[1, :5], atol=1e-5, rtol=0)


def test_logprobs_at_per_token_temperatures(fresh):
    # Token t's log-prob is taken from the logits that predict it divided by temperatures[b, t]: the distribution a
    # rollout at that temperature drew it from. At temperature 1 everywhere it is the plain log-prob.
    a, _ = fresh
    ids, lengths = batch(11, [9, 6])
    temperatures = torch.ones(ids.shape)
    temperatures[0, 4:] = 0.7
    temperatures[1, 1:3] = 1.3
    plain = a.logprobs(ids, lengths)
    torch.testing.assert_close(a.logprobs(ids, lengths, torch.ones(ids.shape)), plain, atol=0, rtol=0)
    scaled = a.logprobs(ids, lengths, temperatures)
    with torch.no_grad():
        logits = a.model(ids, position_ids=None, attention_mask=None).float()
    for row, n in enumerate(lengths.tolist()):
        for t in range(1, n):
            expected = torch.log_softmax(logits[row, t - 1] / temperatures[row, t], -1)[ids[row, t]]
            assert scaled[row, t].item() == pytest.approx(expected.item(), abs=1e-5)
    assert torch.equal(scaled[0, :4], plain[0, :4]) and torch.equal(scaled[1, 3:6], plain[1, 3:6])
    assert not torch.allclose(scaled[0, 4:9], plain[0, 4:9])
    # forward_backward takes the same temperatures: its loss is computed from the scaled log-probs.
    metrics = a.forward_backward(ids, lengths, summed_nll, temperatures)
    assert metrics["loss"] == pytest.approx(-scaled.sum().item(), rel=1e-5)
    a.zero_grads()


def test_loss_goes_down_on_a_tiny_batch(fresh):
    a, _ = fresh
    a_ids, a_len = batch(1, [24, 16, 20, 9])

    def mean_nll(lp):
        loss = -lp.sum() / (a_len - 1).sum()
        return loss, {}

    losses = []
    for _ in range(12):
        losses.append(a.forward_backward(a_ids, a_len, mean_nll)["loss"])
        a.optimizer_step(lr=3e-3)
    assert a.version == 12
    assert losses[-1] < losses[0] - 1.0, losses
    assert max(losses[-3:]) < min(losses[:3]), losses


def test_flat_grads_of_two_trainers_sum_to_the_union_batch(fresh):
    a, b = fresh
    part1, part2 = batch(2, [12, 7]), batch(3, [15, 4, 10])
    a.forward_backward(*part1, summed_nll)
    b.forward_backward(*part2, summed_nll)
    g1, g2 = a.grads_to_flat(), b.grads_to_flat()
    assert g1.dtype == torch.float32 and g1.dim() == 1 and g1.numel() == a.num_params
    assert g1.abs().sum() > 0 and not torch.equal(g1, g2)

    a.zero_grads()
    metrics = a.forward_backward(*union(part1, part2), summed_nll)
    assert metrics["num_tokens"] == 12 + 7 + 15 + 4 + 10
    gu = a.grads_to_flat()
    torch.testing.assert_close(g1 + g2, gu, atol=2e-5, rtol=1e-4)

    # The core's path: its own micro-step, plus the satellite's flat gradients.
    a.zero_grads()
    a.forward_backward(*part1, summed_nll)
    a.add_flat_grads(g2)
    torch.testing.assert_close(a.grads_to_flat(), gu, atol=2e-5, rtol=1e-4)
    a.add_flat_grads(g2, scale=-1.0)
    torch.testing.assert_close(a.grads_to_flat(), g1, atol=2e-5, rtol=1e-4)


def test_core_step_then_flat_weights_move_to_a_satellite(fresh):
    a, b = fresh
    a.forward_backward(*batch(4, [10, 6]), summed_nll)
    before = a.flat_params()
    report = a.optimizer_step()
    assert report["version"] == 1 and report["grad_norm"] > 0 and not report["skipped"]
    assert not torch.equal(before, a.flat_params())
    assert a.grads_to_flat().abs().sum() == 0  # the step zeroes the gradients
    b.load_flat_params(a.flat_params(), version=a.version)
    ids, lengths = batch(5, [11, 8])
    assert b.version == 1
    assert torch.equal(a.logprobs(ids, lengths), b.logprobs(ids, lengths))
    assert [s.name for s in a.param_layout()] == [s.name for s in b.param_layout()]
    assert sum(s.numel for s in a.param_layout()) == a.num_params


def test_grad_clipping_and_non_finite_steps(fresh, tiny_model_dir):
    a, _ = fresh
    a.forward_backward(*batch(6, [10]), lambda lp: (-1000.0 * lp.sum(), {}))
    flat = a.grads_to_flat()
    report = a.optimizer_step()
    # Against a float64 norm: fp32's own norm of the 1.3M gradients is off by ~1e-4 relative.
    assert report["grad_norm"] == pytest.approx(float(flat.double().norm()), rel=1e-9) and report["grad_norm"] > 1.0
    # AdamW's first step moves each weight by about lr regardless of the gradient scale.
    step = (a.flat_params() - MegatronTrainer_flat(tiny_model_dir, a)).abs().max()
    assert step <= 1.1 * a.config.lr
    a.add_flat_grads(torch.full_like(flat, float("nan")))
    params = a.flat_params()
    report = a.optimizer_step()
    assert report["skipped"] and report["version"] == 1
    assert torch.equal(params, a.flat_params()) and a.grads_to_flat().abs().sum() == 0


def MegatronTrainer_flat(model_dir, like: MegatronTrainer) -> torch.Tensor:
    """The initial weights in `like`'s flat layout (through a scratch load and restore)."""
    saved = like.flat_params()
    like.load_hf_state_dict(load_hf_state_dict(model_dir))
    initial = like.flat_params()
    like.load_flat_params(saved)
    return initial


def test_hf_export_round_trip(fresh, tmp_path):
    a, b = fresh
    a.forward_backward(*batch(7, [9, 9]), summed_nll)
    a.optimizer_step()
    state = a.hf_state_dict()
    b.load_hf_state_dict(state, version=5)
    assert b.version == 5 and torch.equal(a.flat_params(), b.flat_params())
    saved = a.save_hf(tmp_path / "step1")
    assert {p.name for p in saved.iterdir()} >= {"config.json", "model.safetensors", "tokenizer.json",
                                                  "tokenizer_config.json", "generation_config.json"}
    from transformers import Qwen3ForCausalLM

    from gyre.engines.trainer import token_logprobs

    hf = Qwen3ForCausalLM.from_pretrained(saved, dtype=torch.float32).eval()
    ids, lengths = batch(8, [13])
    with torch.no_grad():
        reference = token_logprobs(hf(ids).logits, ids, lengths)
    torch.testing.assert_close(a.logprobs(ids, lengths), reference, atol=1e-4, rtol=0)


def test_gradients_live_in_the_flat_buffer(fresh):
    a, _ = fresh
    a.forward_backward(*batch(9, [6]), summed_nll)
    buffer = a._grads
    for p in a.model.parameters():
        assert p.grad.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
        assert p.untyped_storage().data_ptr() == a.param_buffer().untyped_storage().data_ptr()
    assert buffer.abs().sum() > 0


def test_bad_input_raises_trainer_error(fresh):
    a, _ = fresh
    ids, lengths = batch(10, [5, 3])
    with pytest.raises(TrainerError):
        a.logprobs(ids.float(), lengths)
    with pytest.raises(TrainerError):
        a.logprobs(ids, torch.tensor([5, 6]))
    with pytest.raises(TrainerError):
        a.logprobs(ids, torch.tensor([5]))
    with pytest.raises(TrainerError):
        a.logprobs(ids + 100_000, lengths)
    with pytest.raises(TrainerError):
        a.forward_backward(ids, lengths, lambda lp: (lp.sum(dim=1), {}))
    with pytest.raises(TrainerError):
        a.forward_backward(ids, lengths, lambda lp: lp.sum())
    for bad in (torch.ones(2, 4), torch.zeros(ids.shape), torch.full(ids.shape, float("nan")), ids.tolist()):
        with pytest.raises(TrainerError, match="temperatures"):
            a.logprobs(ids, lengths, bad)
    with pytest.raises(TrainerError, match="temperatures"):
        a.forward_backward(ids, lengths, summed_nll, -torch.ones(ids.shape))
    with pytest.raises(TrainerError):
        a.add_flat_grads(torch.zeros(3))
    with pytest.raises(TrainerError):
        a.load_flat_params(torch.zeros(3))


def test_works_when_megatron_state_was_torn_down(trainers, tiny_model_dir):
    """Another component may destroy megatron's parallel state; a new trainer sets it up again."""
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    assert not parallel_state.model_parallel_is_initialized()
    c = MegatronTrainer(tiny_model_dir, TrainerConfig(lr=1e-3))
    assert parallel_state.model_parallel_is_initialized()
    ensure_parallel_state()  # idempotent
    ids, lengths = batch(11, [7])
    torch.testing.assert_close(c.logprobs(ids, lengths), trainers[0].logprobs(ids, lengths), atol=1e-6, rtol=0)


def test_cpu_shims_are_idempotent_and_cpu_only(trainers):
    from megatron.core import parallel_state
    from megatron.core.transformer import utils as transformer_utils

    from gyre.engines import megatron_cpu

    assert not torch.cuda.is_available()
    assert megatron_cpu.apply() and megatron_cpu.apply() and megatron_cpu.is_applied()
    buffer = parallel_state.get_global_memory_buffer().get_tensor((2, 3), torch.float32, "test")
    assert buffer.device.type == "cpu" and buffer.shape == (2, 3)
    mask = transformer_utils.get_default_causal_mask(3)
    assert mask.device.type == "cpu" and mask.tolist() == [[False, True, True], [False, False, True],
                                                            [False, False, False]]


LONE_RANK_GROUPS = """
import os, torch, torch.distributed as dist
from megatron.core import parallel_state
from gyre.engines.trainer import prepare_training_runtime

prepare_training_runtime()
threads = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
x = torch.ones(3)
dist.all_reduce(x, group=parallel_state.get_tensor_model_parallel_group())
dist.all_reduce(x, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
dist.all_reduce(x)
print(threads.count("gloo_tcp_loop"), x.tolist())
"""


def test_the_parallel_state_s_groups_of_one_rank_share_one_gloo_device() -> None:
    # Shim 10 (engines/megatron_cpu.py): each gloo device runs a loop thread that wakes every 10 ms; megatron's
    # ~20 single-rank groups used to hold one each. In a process of its own: the test process has its groups.
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", LONE_RANK_GROUPS], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    loops, summed = done.stdout.strip().splitlines()[-1].split(maxsplit=1)  # after the log lines
    assert loops == "1" and summed.strip() == "[1.0, 1.0, 1.0]"


CONCURRENT_PREPARE = """
import datetime, threading
import torch.distributed as dist
from torch.distributed import distributed_c10d
from gyre.engines import megatron_cpu
from gyre.engines.trainer import prepare_training_runtime

start = threading.Barrier(4)
errors = []

def prepare():
    start.wait()
    try:
        prepare_training_runtime()
    except Exception as error:
        errors.append(repr(error))

threads = [threading.Thread(target=prepare) for _ in range(4)]
for t in threads:
    t.start()
for t in threads:
    t.join()
wrapped = distributed_c10d.ProcessGroupGloo
# Wrapped once: its base is torch's own class. A group of one made by options (the constructor's other form) too.
options = wrapped.__mro__[1]._Options()
options._timeout = datetime.timedelta(seconds=5)
wrapped(dist.HashStore(), 0, 1, options)
print(errors, wrapped.__mro__[1] is dist.ProcessGroupGloo)
"""


def test_training_runtime_prepared_from_several_threads_at_once_wraps_gloo_once() -> None:
    # A cell prepares its training runtime in one thread while a trainer is built in another; the shims were applied
    # twice and a group made between the two swaps failed c10d's type check (an async run with a training satellite
    # failed every switch with it).
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", CONCURRENT_PREPARE], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[] True"


def test_config_validation():
    with pytest.raises(TrainerError):
        TrainerConfig(core_attention="flash")
    with pytest.raises(TrainerError):
        TrainerConfig(device="tpu")
    with pytest.raises(TrainerError):
        TrainerConfig(lr=-1.0)
    for decay in (-0.1, 1.0, 1.5):
        with pytest.raises(TrainerError, match="average_decay"):
            TrainerConfig(average_decay=decay)


def test_lr_warmup_ramps_by_version(tiny_model_dir):
    t = MegatronTrainer(tiny_model_dir, TrainerConfig(lr=0.01, lr_warmup_steps=4))
    seen = []
    for seed in range(5):
        t.forward_backward(*batch(40 + seed, [6]), summed_nll)
        seen.append(t.optimizer_step()["lr"])
    assert seen == pytest.approx([0.0025, 0.005, 0.0075, 0.01, 0.01])
    assert t.optimizer_step(lr=0.5)["lr"] == 0.5  # an explicit lr wins over the ramp
    t.load_flat_params(t.flat_params(), version=1)  # the ramp follows the version, also after a load
    assert t.scheduled_lr() == pytest.approx(0.005)
    with pytest.raises(TrainerError, match="lr_warmup_steps"):
        TrainerConfig(lr_warmup_steps=-1)


def test_weight_average_follows_the_applied_steps(tiny_model_dir, tmp_path):
    decay = 0.6
    t = MegatronTrainer(tiny_model_dir, TrainerConfig(lr=0.01, average_decay=decay))
    expected = t.flat_params()
    assert t.has_average and torch.equal(t.averaged_params(), expected)
    for seed in range(3):
        t.forward_backward(*batch(20 + seed, [8, 5]), summed_nll)
        t.optimizer_step()
        expected = decay * expected + (1 - decay) * t.flat_params()
        torch.testing.assert_close(t.averaged_params(), expected, atol=1e-7, rtol=1e-6)
    assert not torch.allclose(t.averaged_params(), t.flat_params())
    # A skipped step (non-finite gradients) leaves the average alone.
    t.add_flat_grads(torch.full((t.num_params,), float("nan")))
    t.optimizer_step()
    torch.testing.assert_close(t.averaged_params(), expected, atol=1e-7, rtol=1e-6)
    # The average saves as a complete model directory whose weights load back to the average.
    averaged = t.save_hf(tmp_path / "average", averaged=True)
    live = t.save_hf(tmp_path / "live")
    loader = MegatronTrainer(tiny_model_dir)
    loader.load_hf_state_dict(load_hf_state_dict(averaged))
    torch.testing.assert_close(loader.flat_params(), t.averaged_params(), atol=0, rtol=0)
    loader.load_hf_state_dict(load_hf_state_dict(live))
    assert torch.equal(loader.flat_params(), t.flat_params())
    # Loaded weights restart the average: it never mixes unrelated weights.
    t.load_flat_params(loader.flat_params() * 0.5, version=9)
    assert torch.equal(t.averaged_params(), t.flat_params())


def test_no_weight_average_unless_configured(fresh, tmp_path):
    a, _ = fresh
    assert not a.has_average
    with pytest.raises(TrainerError, match="no weight average"):
        a.averaged_params()
    with pytest.raises(TrainerError, match="no weight average"):
        a.save_hf(tmp_path / "average", averaged=True)
    assert not (tmp_path / "average").exists()


def test_weight_decay_spares_norm_weights(tiny_model_dir):
    t = MegatronTrainer(tiny_model_dir, TrainerConfig(lr=0.1, weight_decay=0.5))
    before = t.flat_params()
    t.optimizer_step()  # zero gradients: AdamW's only effect is the decay
    after = t.flat_params()
    for slot in t.param_layout():
        old, new = (x[slot.offset : slot.offset + slot.numel] for x in (before, after))
        if len(slot.shape) >= 2:
            torch.testing.assert_close(new, old * (1 - 0.1 * 0.5))
        else:
            assert torch.equal(new, old), slot.name


def test_preparing_the_training_runtime_sets_up_megatron_once_for_later_trainers() -> None:
    # A fresh interpreter: this one set the parallel state up long ago.
    code = (
        "from megatron.core import parallel_state\n"
        "from gyre.engines.trainer import prepare_training_runtime\n"
        "assert not parallel_state.model_parallel_is_initialized()\n"
        "prepare_training_runtime()\n"
        "prepare_training_runtime()  # idempotent\n"
        "assert parallel_state.model_parallel_is_initialized()\n"
        "print('ok')\n"
    )
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().endswith("ok")


COLLECTIVES = ("all_reduce", "all_gather", "all_gather_object", "all_gather_into_tensor", "all_to_all",
               "all_to_all_single", "barrier", "batch_isend_irecv", "broadcast", "broadcast_object_list", "gather",
               "gather_object", "irecv", "isend", "recv", "reduce", "reduce_scatter", "reduce_scatter_tensor",
               "scatter", "send")


def test_one_process_runs_no_collective(fresh, monkeypatch):
    """World size 1 keeps a gloo group of one on CUDA too (ensure_parallel_state): safe only because nothing goes
    through it. Every torch.distributed collective raises here while a trainer computes, steps, publishes and
    checkpoints."""
    import torch.distributed as dist

    a, _ = fresh

    def refuse(*args, **kwargs):
        raise AssertionError("a collective ran in a one-process trainer")

    for name in COLLECTIVES:
        monkeypatch.setattr(dist, name, refuse)
    ids, lengths = batch(5, [9, 4])
    a.logprobs(ids, lengths)
    a.forward_backward(ids, lengths, summed_nll)
    a.reduce_grads()
    assert a.grad_norm() > 0
    assert not a.optimizer_step()["skipped"]
    assert a.hf_state_dict().keys() == {k for bucket in a.iter_hf_buckets(bucket_bytes=1 << 20) for k in bucket}
    a.load_checkpoint_state(a.checkpoint_state())


def test_a_cpu_trainer_is_refused_where_cuda_is(monkeypatch):
    """megatron-core's CPU shims go in only without CUDA: a CPU trainer beside a GPU would put parts of its model on
    the GPU. Refused with the way out (the GPU is faked present: this machine has none)."""
    from gyre.engines.trainer import trainer_device

    assert trainer_device(TrainerConfig(device="cpu")).type == "cpu"
    assert trainer_device(TrainerConfig()).type == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert trainer_device(TrainerConfig()).type == trainer_device(TrainerConfig(device="cuda")).type == "cuda"
    with pytest.raises(TrainerError, match="CUDA_VISIBLE_DEVICES"):
        trainer_device(TrainerConfig(device="cpu"))
