"""The checkpoint format: parts written atomically, the manifest last, the last K kept, torn ones passed over."""

from __future__ import annotations

import json
import random

import pytest

from gyre.runtime.checkpoint import (
    MANIFEST,
    CheckpointError,
    commit,
    decode_json,
    encode_json,
    list_steps,
    load_latest,
    open_checkpoint,
    staging_dir,
    step_dir,
    to_tuples,
    write_file_atomic,
)


def _checkpoint(root, step, payload=b"x", keep=3):
    staging = staging_dir(root, step)
    parts = {
        "a.json": write_file_atomic(staging / "a.json", encode_json({"step": step})),
        "core.tp0.pp0.pt": write_file_atomic(staging / "core.tp0.pp0.pt", payload * 1000),
    }
    return commit(root, step, parts, {"weight_version": step + 1}, keep=keep)


def test_a_committed_checkpoint_reads_back_whole(tmp_path):
    path = _checkpoint(tmp_path, 4, b"w")
    assert path == step_dir(tmp_path, 4) and sorted(p.name for p in tmp_path.iterdir()) == ["step-00000004"]
    checkpoint, skipped = load_latest(tmp_path)
    assert skipped == [] and checkpoint.step_id == 4 and checkpoint.manifest["weight_version"] == 5
    assert checkpoint.read_json("a.json") == {"step": 4}
    assert checkpoint.read_part("core.tp0.pp0.pt") == b"w" * 1000
    # No temp file is left behind, and the manifest lists exactly the parts.
    assert sorted(p.name for p in path.iterdir()) == sorted(["a.json", "core.tp0.pp0.pt", MANIFEST])


def test_only_the_newest_k_are_kept(tmp_path):
    for step in range(6):
        _checkpoint(tmp_path, step, keep=2)
    assert list_steps(tmp_path) == [4, 5]


def test_a_torn_newest_checkpoint_falls_back_to_the_one_before(tmp_path):
    _checkpoint(tmp_path, 1)
    _checkpoint(tmp_path, 2)
    # A part rots (a flipped byte): its digest no longer matches.
    part = step_dir(tmp_path, 2) / "core.tp0.pp0.pt"
    data = bytearray(part.read_bytes())
    data[10] ^= 0xFF
    part.write_bytes(bytes(data))
    checkpoint, skipped = load_latest(tmp_path)
    assert checkpoint.step_id == 1
    assert len(skipped) == 1 and "does not match its SHA-256" in skipped[0].reason
    # A manifest lost (a folder renamed into place by hand, or a file system that dropped it): passed over too.
    (step_dir(tmp_path, 1) / MANIFEST).unlink()
    checkpoint, skipped = load_latest(tmp_path)
    assert checkpoint is None and [s.path.name for s in skipped] == ["step-00000002", "step-00000001"]
    assert "no manifest.json" in skipped[1].reason


def test_a_truncated_part_and_a_bad_manifest_are_named(tmp_path):
    path = _checkpoint(tmp_path, 3)
    with open(path / "a.json", "r+b") as handle:
        handle.truncate(3)
    with pytest.raises(CheckpointError, match="has 3 bytes"):
        open_checkpoint(path)
    (path / MANIFEST).write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        open_checkpoint(path)
    (path / MANIFEST).write_text(json.dumps({"format": "other/9"}))
    with pytest.raises(CheckpointError, match="not a gyre-checkpoint/1 manifest"):
        open_checkpoint(path)


def test_a_crash_before_the_commit_leaves_nothing_a_reader_takes(tmp_path):
    _checkpoint(tmp_path, 1)
    staging = staging_dir(tmp_path, 2)
    write_file_atomic(staging / "a.json", b"{}")  # the sequencer died here: no manifest, no rename
    checkpoint, skipped = load_latest(tmp_path)
    assert checkpoint.step_id == 1 and skipped == []
    # The next commit's prune removes the abandoned staging folder once a newer step is committed.
    _checkpoint(tmp_path, 3)
    assert not staging.exists()


def test_commit_refuses_a_part_that_differs_from_its_record(tmp_path):
    staging = staging_dir(tmp_path, 0)
    record = write_file_atomic(staging / "a.json", b"{}")
    (staging / "a.json").write_bytes(b"[]")  # changed after its writer reported it
    with pytest.raises(CheckpointError, match="not committed: part a.json does not match"):
        commit(tmp_path, 0, {"a.json": record}, {}, keep=2)
    assert list_steps(tmp_path) == []
    with pytest.raises(CheckpointError, match="bad checkpoint part name"):
        write_file_atomic(staging / MANIFEST, b"{}")


def test_rng_state_survives_json():
    rng = random.Random(7)
    rng.random()
    restored = random.Random()
    restored.setstate(to_tuples(decode_json(encode_json(rng.getstate()))))
    assert [restored.random() for _ in range(3)] == [rng.random() for _ in range(3)]


def test_a_step_committed_again_replaces_the_old_timeline(tmp_path):
    _checkpoint(tmp_path, 1, b"a")
    _checkpoint(tmp_path, 2, b"old")  # a run resumed from step 1 makes its own step 2
    _checkpoint(tmp_path, 2, b"new")
    checkpoint, _ = load_latest(tmp_path)
    assert checkpoint.step_id == 2 and checkpoint.read_part("core.tp0.pp0.pt") == b"new" * 1000
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000001", "step-00000002"]
