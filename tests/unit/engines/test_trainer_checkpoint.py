"""A trainer's checkpoint state: a trainer restored from it steps exactly as the one that saved it (issue 28)."""

from __future__ import annotations

import io

import pytest
import torch

from gyre.engines.errors import TrainerError
from gyre.engines.trainer import MegatronTrainer, TrainerConfig


def batch(seed: int, lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 2041, (len(lengths), max(lengths)), generator=g)
    for row, n in enumerate(lengths):
        ids[row, n:] = 0
    return ids, torch.tensor(lengths)


def summed_nll(logprobs: torch.Tensor):
    loss = -logprobs.sum()
    return loss, {}


def _step(trainer: MegatronTrainer, seed: int) -> dict:
    trainer.forward_backward(*batch(seed, [9, 6]), summed_nll)
    return trainer.optimizer_step()


def test_a_restored_trainer_continues_bit_for_bit(tiny_model_dir):
    torch.set_num_threads(1)
    config = TrainerConfig(lr=0.01, lr_warmup_steps=4, average_decay=0.5)
    saved = MegatronTrainer(tiny_model_dir, config)
    for seed in range(2):
        _step(saved, seed)
    buffer = io.BytesIO()
    torch.save(saved.checkpoint_state(), buffer)  # the bytes a checkpoint part holds
    restored = MegatronTrainer(tiny_model_dir, config)
    restored.load_checkpoint_state(torch.load(io.BytesIO(buffer.getvalue()), weights_only=False))
    assert restored.version == saved.version == 2
    assert restored.scheduled_lr() == pytest.approx(saved.scheduled_lr()) == pytest.approx(0.0075)
    assert torch.equal(restored.flat_params(), saved.flat_params())
    assert torch.equal(restored.averaged_params(), saved.averaged_params())
    moments = lambda t: [s[k] for s in t.optimizer.state.values() for k in ("exp_avg", "exp_avg_sq")]  # noqa: E731
    assert all(torch.equal(a, b) for a, b in zip(moments(restored), moments(saved), strict=True))
    # The next step, on the same batch, lands on the same weights: moments, step counts and lr all came back.
    a, b = _step(saved, 7), _step(restored, 7)
    assert a == b
    assert torch.equal(restored.flat_params(), saved.flat_params())
    # A fresh trainer's first step differs (no moments): the check above can fail.
    fresh = MegatronTrainer(tiny_model_dir, config)
    fresh.load_flat_params(saved.flat_params(), version=3)
    _step(fresh, 8), _step(saved, 8)
    assert not torch.equal(fresh.flat_params(), saved.flat_params())


def test_the_state_of_another_model_is_refused(tiny_model_dir):
    trainer = MegatronTrainer(tiny_model_dir, TrainerConfig())
    state = trainer.checkpoint_state()
    state["num_params"] += 1
    with pytest.raises(TrainerError, match="another model or another parallel layout"):
        trainer.load_checkpoint_state(state)


def test_the_state_digest_is_over_the_bytes_in_memory(tiny_model_dir):
    """checkpoint_state_digest hashes host tensors in place (no bytes copy of a model-sized buffer); the digest is the
    one of the tensors' bytes, as checkpoints written before recorded it."""
    import hashlib

    from gyre.engines.trainer import checkpoint_state_digest

    trainer = MegatronTrainer(tiny_model_dir, TrainerConfig(lr=0.01))
    _step(trainer, 3)
    state = trainer.checkpoint_state()
    assert state["params"].device.type == "cpu" and state["params"].data_ptr() != trainer.param_buffer().data_ptr()
    want = hashlib.sha256(f"version={state['version']}".encode())
    want.update(state["params"].numpy().tobytes())
    for index in sorted(state["optimizer"]["state"]):
        entry = state["optimizer"]["state"][index]
        want.update(entry["exp_avg"].numpy().tobytes() + entry["exp_avg_sq"].numpy().tobytes())
        want.update(repr(float(entry["step"])).encode())
    assert checkpoint_state_digest(state) == want.hexdigest()
    state["optimizer"]["state"][0]["exp_avg"][7] += 1e-3
    assert checkpoint_state_digest(state) != want.hexdigest()
