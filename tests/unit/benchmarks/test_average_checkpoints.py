"""benchmarks/studies/average_checkpoints.py: averaging a run's checkpoints afterwards gives the core's in-run average."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import torch

from gyre.engines.model_format import load_hf_state_dict, save_hf_state_dict
from gyre.engines.trainer import MegatronTrainer, TrainerConfig



@pytest.fixture(scope="module")
def tool():
    return importlib.import_module("gyre.benchmarks.studies.average_checkpoints")


def train_with_checkpoints(model_dir: Path, root: Path, decay: float, steps: int) -> MegatronTrainer:
    """A trainer that keeps an average and saves v<version> after each step, as the core does."""
    trainer = MegatronTrainer(model_dir, TrainerConfig(lr=0.01, average_decay=decay))
    g = torch.Generator().manual_seed(3)
    for _ in range(steps):
        ids = torch.randint(1, 2041, (2, 9), generator=g)
        trainer.forward_backward(ids, torch.tensor([9, 6]), lambda lp: (-lp.sum(), {}))
        trainer.optimizer_step()
        trainer.save_hf(root / f"v{trainer.version:05d}")
    return trainer


def test_offline_average_equals_the_trainers(tool, tiny_model_dir, tmp_path):
    trainer = train_with_checkpoints(tiny_model_dir, tmp_path / "checkpoints", decay=0.7, steps=11)
    out = tmp_path / "averaged"
    versions = tool.average_checkpoints(tiny_model_dir, tmp_path / "checkpoints", out, 0.7)
    assert versions == list(range(1, 12))  # v00010 and v00011 come after v00009: numeric order
    averaged = load_hf_state_dict(out)
    expected = trainer.hf_state_dict(averaged=True)
    assert averaged.keys() == expected.keys()
    for name, tensor in expected.items():
        torch.testing.assert_close(averaged[name], tensor, atol=1e-7, rtol=1e-6)
    assert {p.name for p in out.iterdir()} >= {"config.json", "model.safetensors", "tokenizer.json"}
    # Decay 0 is the last checkpoint itself.
    tool.average_checkpoints(tiny_model_dir, tmp_path / "checkpoints", tmp_path / "last", 0.0)
    last = load_hf_state_dict(tmp_path / "last")
    assert all(torch.equal(last[k], v) for k, v in load_hf_state_dict(tmp_path / "checkpoints" / "v00011").items())


def test_bad_input_is_a_clear_error(tool, tiny_model_dir, tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="no v<version> checkpoint"):
        tool.average_checkpoints(tiny_model_dir, empty, tmp_path / "out", 0.5)
    with pytest.raises(ValueError, match="decay"):
        tool.average_checkpoints(tiny_model_dir, empty, tmp_path / "out", 1.0)
    odd = tmp_path / "odd" / "v00001"
    odd.mkdir(parents=True)
    save_hf_state_dict(odd, {"model.embed_tokens.weight": torch.zeros(3, 2)})
    with pytest.raises(ValueError, match="does not have the tensors"):
        tool.average_checkpoints(tiny_model_dir, tmp_path / "odd", tmp_path / "out", 0.5)
    assert not (tmp_path / "out").exists()
    assert tool.main([str(tiny_model_dir), str(empty), str(tmp_path / "out"), "--decay", "0.5"]) == 2
    assert "no v<version> checkpoint" in capsys.readouterr().err
