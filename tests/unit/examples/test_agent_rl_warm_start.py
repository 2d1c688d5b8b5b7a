"""The main job's `--warm-start DIR`: a warm start built elsewhere is checked against its manifest, copied once into
the cache with the held-out scores that came with it, and the flags that would only shape a rebuilt one are refused."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest

from gyre.engines.model_manifest import ManifestError, write_manifest

AGENT_RL = Path(__file__).resolve().parents[3] / "examples" / "agent_rl.py"


@pytest.fixture(scope="module")
def agent_rl():
    spec = importlib.util.spec_from_file_location("agent_rl_warm_start_under_test", AGENT_RL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture()
def built(tiny_model_dir: Path, tmp_path: Path) -> Path:
    warm = tmp_path / "warm"
    shutil.copytree(tiny_model_dir, warm)
    (warm / "eval-224-0.json").write_text(json.dumps({"success_rate": 0.25, "mean_reward": 0.3}))
    write_manifest(warm, {"built_by": "test"})
    return warm


def test_a_built_warm_start_is_checked_and_copied_once_with_its_scores(agent_rl, built: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    first = agent_rl.built_warm_start(built, cache)
    assert first.parent == cache and first.name.startswith("warm-")
    assert (first / "model.safetensors").read_bytes() == (built / "model.safetensors").read_bytes()
    assert json.loads((first / "eval-224-0.json").read_text())["success_rate"] == 0.25  # reused, not re-scored
    assert agent_rl.built_warm_start(built, cache) == first  # the same bytes: the same folder, no second copy
    assert [p.name for p in cache.iterdir()] == [first.name]
    # A score shipped later (more attempts a task) reaches a cache made before it; one the run wrote stays its own.
    (first / "eval-224-0.json").write_text(json.dumps({"success_rate": 0.5, "mean_reward": 0.6}))
    (built / "eval-sampled-pooled-224-0-t0.7-k16.json").write_text(json.dumps({"samples": 16, "success_rate": 0.1}))
    assert agent_rl.built_warm_start(built, cache) == first
    assert json.loads((first / "eval-sampled-pooled-224-0-t0.7-k16.json").read_text())["samples"] == 16
    assert json.loads((first / "eval-224-0.json").read_text())["success_rate"] == 0.5
    assert sorted(p.name for p in first.iterdir() if p.name.startswith(".")) == []


def test_a_warm_start_that_differs_from_its_manifest_is_refused(agent_rl, built: Path, tmp_path: Path) -> None:
    (built / "config.json").write_text((built / "config.json").read_text().replace("}", ', "x": 1}', 1))
    with pytest.raises(ManifestError, match="config.json differs"):
        agent_rl.built_warm_start(built, tmp_path)


def test_flags_that_shape_a_rebuilt_warm_start_are_refused_with_a_built_one(agent_rl, built: Path, capsys) -> None:
    assert agent_rl.parse_args([]).warm_start == str(agent_rl.SHIPPED_WARM_START)  # the shipped one by default
    assert agent_rl.parse_args(["--warm-start", "rebuild", "--copy-steps", "2"]).copy_steps == 2
    assert agent_rl.parse_args(["--warm-start", str(built)]).warm_start == str(built)
    with pytest.raises(SystemExit):
        agent_rl.parse_args(["--warm-start", str(built), "--copy-steps", "2", "--sft-tasks", "20"])
    assert "--sft-tasks, --copy-steps shape the warm start" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        agent_rl.parse_args(["--sft-tasks", "20"])  # the shipped one is built already too
    assert "add --warm-start rebuild" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        agent_rl.parse_args(["--warm-start", str(built / "nowhere")])
    assert "not an HF model directory" in capsys.readouterr().err


def test_a_missing_shipped_warm_start_is_a_clear_error(agent_rl, tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.setattr(agent_rl, "SHIPPED_WARM_START", tmp_path / "warm_start")
    with pytest.raises(SystemExit):
        agent_rl.parse_args([])
    err = capsys.readouterr().err
    assert "the shipped warm start" in err and "is missing" in err and "--warm-start rebuild" in err


def test_the_shipped_warm_start_must_have_its_manifest(agent_rl, tiny_model_dir: Path, tmp_path: Path) -> None:
    bare = tmp_path / "warm"
    shutil.copytree(tiny_model_dir, bare)
    with pytest.raises(ManifestError, match="has no manifest.json"):
        agent_rl.built_warm_start(bare, tmp_path, require_manifest=True)
    assert agent_rl.built_warm_start(bare, tmp_path).name.startswith("warm-")  # another directory needs none
