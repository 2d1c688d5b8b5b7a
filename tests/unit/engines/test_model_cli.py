"""`gyre model ...` on a model directory it cannot read: one line on stderr naming the problem, exit status 2."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from gyre.engines.errors import ModelFormatError
from gyre.engines.model_format import ModelSpec, load_hf_state_dict
from gyre.engines.qwen3_paged import Qwen3Spec, read_safetensors_dir
from gyre.runtime.cli import main

GOOD_SIZES = {"hidden_size": 128, "num_attention_heads": 4, "num_hidden_layers": 1, "intermediate_size": 8,
              "vocab_size": 4096}

BROKEN_CONFIGS = {
    "not_json": ("{bad", "not readable JSON"),
    "a_list": ("[1, 2]", "JSON object"),
    "no_hidden_size": (json.dumps({"model_type": "qwen3"}), "hidden_size"),
    "a_string_size": (json.dumps({"model_type": "qwen3", **GOOD_SIZES, "hidden_size": "x"}), "wrong type"),
    "zero_heads": (
        json.dumps({"model_type": "qwen3", **GOOD_SIZES, "num_attention_heads": 0, "head_dim": 32}), "positive"
    ),
    "rope_not_object": (json.dumps({"model_type": "qwen3", **GOOD_SIZES, "rope_scaling": "yarn"}), "rope"),
    "not_utf8": (b"\xff\xfe{", "not readable JSON"),
}


def broken_dir(tmp_path: Path, name: str) -> Path:
    content, _ = BROKEN_CONFIGS[name]
    folder = tmp_path / name
    folder.mkdir()
    path = folder / "config.json"
    path.write_bytes(content) if isinstance(content, bytes) else path.write_text(content)
    return folder


def one_error_line(capsys: pytest.CaptureFixture, prefix: str) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    errors = [line for line in err if line.startswith(prefix)]
    assert len(errors) == 1, err
    assert not any("Traceback" in line for line in err), err
    return errors[0]


@pytest.mark.parametrize("name", sorted(BROKEN_CONFIGS))
def test_info_on_a_broken_config_is_one_line_and_exit_2(tmp_path, capsys, name) -> None:
    folder = broken_dir(tmp_path, name)
    assert main(["model", "info", str(folder)]) == 2
    assert BROKEN_CONFIGS[name][1] in one_error_line(capsys, "gyre model info: ")


@pytest.mark.parametrize("name", sorted(BROKEN_CONFIGS))
def test_both_config_readers_raise_the_one_model_format_error(tmp_path, name) -> None:
    folder = broken_dir(tmp_path, name)
    with pytest.raises(ModelFormatError):
        ModelSpec.from_model_dir(folder)
    with pytest.raises(ModelFormatError):
        Qwen3Spec.from_model_dir(folder)


def test_info_on_a_directory_without_config(tmp_path, capsys) -> None:
    assert main(["model", "info", str(tmp_path)]) == 2
    assert "has no config.json" in one_error_line(capsys, "gyre model info: ")


def test_info_on_a_good_directory_still_prints_its_shape(tiny_model_dir, capsys) -> None:
    assert main(["model", "info", str(tiny_model_dir)]) == 0
    assert json.loads(capsys.readouterr().out)["hidden_size"] == ModelSpec.from_model_dir(tiny_model_dir).hidden_size


@pytest.fixture
def truncated_weights(tiny_model_dir: Path, tmp_path: Path) -> Path:
    folder = tmp_path / "truncated"
    folder.mkdir()
    shutil.copy(tiny_model_dir / "config.json", folder / "config.json")
    (folder / "model.safetensors").write_bytes((tiny_model_dir / "model.safetensors").read_bytes()[:1000])
    return folder


def test_truncated_weights_are_a_model_format_error(truncated_weights) -> None:
    with pytest.raises(ModelFormatError, match="safetensors"):
        load_hf_state_dict(truncated_weights)
    with pytest.raises(ModelFormatError, match="safetensors"):
        read_safetensors_dir(truncated_weights)


def test_a_broken_shard_index_is_a_model_format_error(tiny_model_dir, tmp_path) -> None:
    shutil.copy(tiny_model_dir / "config.json", tmp_path / "config.json")
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": ["model.safetensors"]}))
    with pytest.raises(ModelFormatError, match="weight_map"):
        read_safetensors_dir(tmp_path)


@pytest.mark.parametrize("backend", ["embedded", "megatron"])
def test_logprobs_on_truncated_weights_is_one_line_and_exit_2(truncated_weights, tmp_path, capsys, backend) -> None:
    tokens = tmp_path / "tokens.json"
    tokens.write_text("[5, 6, 7]")
    assert main(["model", "logprobs", str(truncated_weights), "--backend", backend, "--tokens", str(tokens)]) == 2
    assert "is not a readable safetensors file" in one_error_line(capsys, "gyre model logprobs: ")


def test_init_tiny_tied_preset_and_score_it_with_the_embedded_engine(tmp_path, capsys) -> None:
    assert main(["model", "init", str(tmp_path / "tied"), "--preset", "tiny-tied"]) == 0
    report = json.loads(capsys.readouterr().out)
    spec = ModelSpec.from_model_dir(tmp_path / "tied")
    assert spec.tie_word_embeddings and report["params"] == spec.num_params
    assert "lm_head.weight" not in load_hf_state_dict(tmp_path / "tied")
    (tmp_path / "ids.json").write_text("[5, 9, 11, 300]")
    assert main(["model", "logprobs", str(tmp_path / "tied"), "--backend", "embedded",
                 "--tokens", str(tmp_path / "ids.json")]) == 0
    assert len(json.loads(capsys.readouterr().out)) == 3
