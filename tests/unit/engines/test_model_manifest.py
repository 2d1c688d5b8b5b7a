"""A model directory's manifest: written with each file's digest, verified, and a changed, missing or extra file
refused by name."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from gyre.engines.model_manifest import MANIFEST_FILE, ManifestError, model_digest, verify, write_manifest


@pytest.fixture()
def model(tiny_model_dir: Path, tmp_path: Path) -> Path:
    target = tmp_path / "model"
    shutil.copytree(tiny_model_dir, target)
    return target


def test_a_written_manifest_verifies_and_names_the_model(model: Path) -> None:
    manifest = write_manifest(model, {"built_by": "test", "held_out": {"success_rate": 0.5}})
    assert verify(model) == manifest == json.loads((model / MANIFEST_FILE).read_text())
    assert manifest["built_by"] == "test" and "model.safetensors" in manifest["files"]
    assert manifest["model_digest"] == model_digest(manifest["files"])


def test_a_changed_missing_or_extra_file_is_refused_by_name(model: Path) -> None:
    write_manifest(model, {})
    weights = model / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    with pytest.raises(ManifestError, match="model.safetensors differs"):
        verify(model)
    write_manifest(model, {})
    (model / "tokenizer.json").unlink()
    with pytest.raises(ManifestError, match="tokenizer.json is missing"):
        verify(model)


def test_a_directory_without_a_manifest_is_refused(model: Path) -> None:
    with pytest.raises(ManifestError, match="has no manifest.json"):
        verify(model)
    (model / MANIFEST_FILE).write_text("{not json")
    with pytest.raises(ManifestError, match="cannot be read"):
        verify(model)
