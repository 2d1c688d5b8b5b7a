"""A model directory's manifest: the SHA-256 of each of its files, and what built it.

A model that ships with the project (the main job's warm start, examples/warm_start) or is handed between machines
must be the bytes it claims to be: its scores and the figures measured from it hold for those bytes only. The
manifest (`manifest.json` in the directory) lists every model file with its digest and size, and free-form facts
about how it was built (the command, the commit, its held-out scores). `verify` recomputes the digests and refuses
a directory whose files are missing, extra among the model files, or different, naming the file.

The manifest is written atomically (a temporary file, fsync, rename), so a reader never sees half of one.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Mapping

from gyre.engines.errors import ModelFormatError
from gyre.runtime.checkpoint import file_sha256

__all__ = ["MANIFEST_FILE", "MODEL_FILES", "ManifestError", "file_digests", "model_digest", "verify", "write_manifest"]

MANIFEST_FILE = "manifest.json"
MODEL_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
"""The files of a model directory the manifest covers (what engines read: model_format.py)."""


class ManifestError(ModelFormatError):
    """A model directory whose files do not match its manifest, or that has none where one is required."""


def file_digests(model_dir: str | Path) -> dict[str, dict[str, Any]]:
    """{file name: {"sha256", "bytes"}} of the model files present in `model_dir`."""
    root = Path(model_dir)
    return {name: {"sha256": file_sha256(root / name), "bytes": (root / name).stat().st_size}
            for name in MODEL_FILES if (root / name).is_file()}


def model_digest(files: Mapping[str, Mapping[str, Any]]) -> str:
    """One digest of all the files' digests (the model's identity, e.g. in a cache folder's name)."""
    text = json.dumps({name: entry["sha256"] for name, entry in sorted(files.items())}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def write_manifest(model_dir: str | Path, facts: Mapping[str, Any]) -> dict[str, Any]:
    """Write `model_dir`/manifest.json: the model files' digests and `facts`; returns the manifest."""
    root = Path(model_dir)
    files = file_digests(root)
    if "model.safetensors" not in files or "config.json" not in files:
        raise ManifestError(f"{root} is not a model directory (no config.json or model.safetensors)")
    manifest = {"files": files, "model_digest": model_digest(files), **dict(facts)}
    fd, tmp = tempfile.mkstemp(dir=root, prefix=".manifest-")
    try:
        with os.fdopen(fd, "w") as out:
            json.dump(manifest, out, indent=1, sort_keys=True)
            out.write("\n")
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, root / MANIFEST_FILE)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return manifest


def verify(model_dir: str | Path) -> dict[str, Any]:
    """The manifest of `model_dir` once every file it lists is there with its digest and no other model file is;
    ManifestError naming the first file that differs (or the missing manifest) otherwise."""
    root = Path(model_dir)
    path = root / MANIFEST_FILE
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise ManifestError(f"{root} has no {MANIFEST_FILE}") from None
    except (OSError, json.JSONDecodeError) as error:
        raise ManifestError(f"{path} cannot be read: {error}") from None
    listed = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(listed, dict) or "model.safetensors" not in listed:
        raise ManifestError(f"{path} lists no model files")
    present = file_digests(root)
    for name, entry in sorted(listed.items()):
        if name not in present:
            raise ManifestError(f"{root}: {name} is missing (the manifest lists it)")
        if present[name]["sha256"] != entry.get("sha256"):
            raise ManifestError(f"{root}: {name} differs from the manifest (sha256 {present[name]['sha256'][:12]}, "
                                f"expected {str(entry.get('sha256'))[:12]}): not the model the manifest describes")
    extra = sorted(set(present) - set(listed))
    if extra:
        raise ManifestError(f"{root}: {extra} are not in the manifest")
    return manifest
