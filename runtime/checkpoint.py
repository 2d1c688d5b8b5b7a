"""The on-disk format of a run's checkpoints: atomic parts, a manifest written last, the last K kept, torn ones seen.

A checkpoint of step S is a folder `ROOT/step-SSSSSSSS/` holding one file per *part* (each actor's state, the
core's weights and optimizer moments, one file per trainer shard) and `manifest.json`, which names every part with
its size and SHA-256. Writing one:

1. every writer puts its parts into the staging folder `ROOT/.staging-step-SSSSSSSS/` (a fixed name, so writers in
   different processes need not agree on anything but the step), each through `write_file_atomic`: a temp file in
   the same folder, written, fsynced, renamed into place, the folder fsynced;
2. the one that sequences the checkpoint (actors/training/checkpointer.py) then `commit`s: it checks every part
   against the digest its writer reported, writes the manifest last (atomically too), fsyncs, renames the staging
   folder to `step-SSSSSSSS` and fsyncs ROOT; then prunes to the newest `keep` checkpoints.

A crash before the rename leaves a staging folder, which no reader looks at (the next commit or prune removes it);
after it, a complete checkpoint. Reading (`load_latest`) walks the committed checkpoints newest first and takes the
first whose manifest parses and whose every part has the recorded size and digest; each one it passes over is
reported with the reason (`Skipped`), so a torn or corrupt newest checkpoint falls back to the one before it, said
out loud, never silently.

Parts are bytes; `encode_json` / `decode_json` are the convention for small actor states (sorted keys, UTF-8), and
`to_tuples` turns the lists JSON makes back into the tuples `random.Random.setstate` wants.

What this format assumes: every writer sees ROOT on one file system (one machine, or a shared mount under Ray); a
file system that honours fsync. What it cannot see: an old checkpoint folder swapped whole for another one.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any, Mapping

import attrs

from gyre.runtime.errors import GyreError

__all__ = [
    "CORE_RECORD", "FORMAT", "MANIFEST", "Checkpoint", "CheckpointError", "PartRecord", "Skipped", "actor_part_name",
    "commit", "decode_json", "read_actor_state",
    "encode_json", "file_sha256", "list_steps", "load_latest", "open_checkpoint", "prune", "staging_dir", "step_dir",
    "read_core_record", "to_tuples", "write_core_record", "write_file_atomic",
]

FORMAT = "gyre-checkpoint/1"
"""The manifest's `format`; a reader refuses any other."""
MANIFEST = "manifest.json"
CORE_RECORD = "core.record.json"
"""The core's CorePartsSaved as a file in the staging folder, written after its parts: how a checkpointer that can
no longer receive messages (it is stopping) learns of the core's final part."""
_STEP = re.compile(r"^step-(\d{8})$")
_STAGING = re.compile(r"^\.(?:staging|replaced)-step-(\d{8})(?:-\d+)?$")
_PART_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")
MAX_MANIFEST_BYTES = 64 * 1024 * 1024
"""A manifest larger than this is corruption, not data (it lists parts and a few small records)."""


class CheckpointError(GyreError):
    """A checkpoint cannot be written or read: a part missing or not matching its digest, a bad manifest."""


@attrs.frozen
class PartRecord:
    """One file of a checkpoint, as the manifest lists it."""

    name: str
    """File name inside the checkpoint folder."""
    sha256: str
    """Hex SHA-256 of its bytes."""
    size_bytes: int
    """Its length."""


@attrs.frozen
class Skipped:
    """A committed checkpoint that `load_latest` passed over, and why."""

    path: Path
    reason: str


def _check_part_name(name: str) -> None:
    if not _PART_NAME.match(name) or name == MANIFEST or name.startswith(".tmp"):
        raise CheckpointError(f"bad checkpoint part name {name!r} (letters, digits, '_', '.', '-'; not {MANIFEST})")


def step_dir(root: str | os.PathLike, step_id: int) -> Path:
    """Where the committed checkpoint of `step_id` lives."""
    if step_id < 0:
        raise CheckpointError(f"step ids are >= 0, got {step_id}")
    return Path(root) / f"step-{step_id:08d}"


def staging_dir(root: str | os.PathLike, step_id: int) -> Path:
    """Where the parts of `step_id`'s checkpoint are written before the commit (created if missing)."""
    if step_id < 0:
        raise CheckpointError(f"step ids are >= 0, got {step_id}")
    path = Path(root) / f".staging-step-{step_id:08d}"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file_atomic(path: str | os.PathLike, data: bytes) -> PartRecord:
    """Write `data` to `path` so that a reader sees all of it or nothing: temp file, fsync, rename, fsync folder.
    Returns its PartRecord (name, digest, size)."""
    path = Path(path)
    _check_part_name(path.name)
    temp = path.with_name(f".tmp-{path.name}-{os.getpid()}")
    with open(temp, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temp, path)
    _fsync_dir(path.parent)
    return PartRecord(path.name, hashlib.sha256(data).hexdigest(), len(data))


def file_sha256(path: str | os.PathLike) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def encode_json(state: Any) -> bytes:
    """A small state as a part's bytes (sorted keys: the same state gives the same bytes)."""
    return json.dumps(state, sort_keys=True, separators=(",", ":"), allow_nan=True).encode("utf-8")


def decode_json(data: bytes) -> Any:
    return json.loads(data.decode("utf-8"))


def to_tuples(value: Any) -> Any:
    """Lists (as JSON gives them back) to tuples, all the way down: `random.Random.setstate(to_tuples(state))`."""
    if isinstance(value, list):
        return tuple(to_tuples(item) for item in value)
    return value


def _verify_part(folder: Path, record: PartRecord) -> str:
    """"" if the part is whole, else why not."""
    path = folder / record.name
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return f"part {record.name} is missing"
    if size != record.size_bytes:
        return f"part {record.name} has {size} bytes, the manifest says {record.size_bytes}"
    if file_sha256(path) != record.sha256:
        return f"part {record.name} does not match its SHA-256"
    return ""


def commit(
    root: str | os.PathLike, step_id: int, parts: Mapping[str, PartRecord], meta: Mapping[str, Any], keep: int,
) -> Path:
    """Seal the staging folder of `step_id`: check each part against its record, write the manifest last, rename
    the folder into place, prune to the newest `keep`. Raises CheckpointError (nothing committed) when a part is
    missing or does not match. A step already committed is replaced: it belongs to a timeline a resume left behind
    (a run resumed from an older checkpoint, or a torn newer one that a resume passed over)."""
    if keep < 1:
        raise CheckpointError(f"keep must be >= 1, got {keep}")
    root = Path(root)
    staging = staging_dir(root, step_id)
    final = step_dir(root, step_id)
    for name, record in parts.items():
        _check_part_name(name)
        if name != record.name:
            raise CheckpointError(f"part {name!r} is recorded as {record.name!r}")
        problem = _verify_part(staging, record)
        if problem:
            raise CheckpointError(f"checkpoint of step {step_id} not committed: {problem}")
    manifest = {
        "format": FORMAT, "step_id": step_id, **dict(meta),
        "parts": {name: {"sha256": r.sha256, "size_bytes": r.size_bytes} for name, r in sorted(parts.items())},
    }
    temp = staging / f".tmp-{MANIFEST}"
    with open(temp, "wb") as handle:
        handle.write(json.dumps(manifest, sort_keys=True, indent=1).encode("utf-8"))
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temp, staging / MANIFEST)
    _fsync_dir(staging)
    replaced = root / f".replaced-step-{step_id:08d}-{os.getpid()}"
    if final.exists():
        os.replace(final, replaced)  # a crash right here leaves the older checkpoints, still whole
    os.replace(staging, final)
    _fsync_dir(root)
    shutil.rmtree(replaced, ignore_errors=True)
    prune(root, keep)
    return final


def list_steps(root: str | os.PathLike) -> list[int]:
    """Step ids of the committed checkpoint folders under `root`, oldest first (valid or not)."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(int(m.group(1)) for p in root.iterdir() if (m := _STEP.match(p.name)) and p.is_dir())


def prune(root: str | os.PathLike, keep: int) -> list[Path]:
    """Delete all but the newest `keep` committed checkpoints, and staging folders of steps not newer than the
    newest committed one (left by a crash or an abandoned checkpoint). Returns what was deleted."""
    root = Path(root)
    steps = list_steps(root)
    removed = [step_dir(root, step) for step in steps[:-keep]] if keep > 0 else []
    newest = steps[-1] if steps else -1
    for path in root.iterdir() if root.is_dir() else ():
        match = _STAGING.match(path.name)
        if match and int(match.group(1)) <= newest:
            removed.append(path)
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed


@attrs.frozen
class Checkpoint:
    """A committed checkpoint whose parts were all checked against the manifest."""

    path: Path
    step_id: int
    manifest: dict
    """The manifest as written: format, step_id, the sequencer's records (weight_version, run, ...), parts."""

    @property
    def parts(self) -> dict[str, PartRecord]:
        return {name: PartRecord(name, p["sha256"], p["size_bytes"]) for name, p in self.manifest["parts"].items()}

    def has_part(self, name: str) -> bool:
        return name in self.manifest["parts"]

    def part_path(self, name: str) -> Path:
        if not self.has_part(name):
            raise CheckpointError(f"{self.path} has no part {name!r} (it has {sorted(self.manifest['parts'])})")
        return self.path / name

    def read_part(self, name: str) -> bytes:
        """A part's bytes, checked again against its digest (a part may rot after the checkpoint was opened)."""
        data = self.part_path(name).read_bytes()
        if hashlib.sha256(data).hexdigest() != self.manifest["parts"][name]["sha256"]:
            raise CheckpointError(f"{self.path}: part {name} does not match its SHA-256")
        return data

    def read_json(self, name: str) -> Any:
        return decode_json(self.read_part(name))


def open_checkpoint(path: str | os.PathLike) -> Checkpoint:
    """The committed checkpoint in `path`, every part checked. Raises CheckpointError saying what is wrong."""
    path = Path(path)
    match = _STEP.match(path.name)
    if not match:
        raise CheckpointError(f"{path} is not a checkpoint folder (step-NNNNNNNN)")
    manifest_path = path / MANIFEST
    try:
        if manifest_path.stat().st_size > MAX_MANIFEST_BYTES:
            raise CheckpointError(f"{manifest_path} is larger than {MAX_MANIFEST_BYTES} bytes")
        manifest = json.loads(manifest_path.read_bytes())
    except FileNotFoundError:
        raise CheckpointError(f"{path} has no {MANIFEST} (torn: its writer died before the commit)") from None
    except ValueError as error:
        raise CheckpointError(f"{manifest_path} is not valid JSON: {error}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{manifest_path} is not a {FORMAT} manifest")
    if manifest.get("step_id") != int(match.group(1)) or not isinstance(manifest.get("parts"), dict):
        raise CheckpointError(f"{manifest_path} does not describe {path.name}")
    checkpoint = Checkpoint(path, int(match.group(1)), manifest)
    try:
        records = checkpoint.parts
    except (KeyError, TypeError) as error:
        raise CheckpointError(f"{manifest_path} lists a part without its digest or size: {error}") from None
    for record in records.values():
        problem = _verify_part(path, record)
        if problem:
            raise CheckpointError(f"{path}: {problem}")
    return checkpoint


def load_latest(root: str | os.PathLike) -> tuple[Checkpoint | None, list[Skipped]]:
    """The newest whole checkpoint under `root` (None if there is none) and the newer ones passed over, with why."""
    skipped: list[Skipped] = []
    for step in reversed(list_steps(root)):
        path = step_dir(root, step)
        try:
            return open_checkpoint(path), skipped
        except (CheckpointError, OSError) as error:
            skipped.append(Skipped(path, str(error)))
    return None, skipped


def actor_part_name(actor: str) -> str:
    """The part that holds an actor's own state (what it answered to CheckpointAsked): "<actor>.json"."""
    name = f"{actor}.json"
    _check_part_name(name)
    return name


def read_actor_state(resume_from: str | os.PathLike, actor: str) -> tuple[Any, Checkpoint]:
    """An actor's restore input: its state from the committed checkpoint in `resume_from` (every part checked),
    and the checkpoint (its manifest has the step, the weight version and the groups that re-roll)."""
    checkpoint = open_checkpoint(resume_from)
    return checkpoint.read_json(actor_part_name(actor)), checkpoint


def write_core_record(folder: str | os.PathLike, saved: Any) -> PartRecord:
    """Write the core's CorePartsSaved (gyre.messages.checkpoints) next to its parts, atomically."""
    return write_file_atomic(Path(folder) / CORE_RECORD, encode_json(attrs.asdict(saved)))


def read_core_record(folder: str | os.PathLike) -> Any:
    """The CorePartsSaved a core left in `folder` (None if it has not written one)."""
    from gyre.messages.checkpoints import CorePartsSaved

    try:
        fields = decode_json((Path(folder) / CORE_RECORD).read_bytes())
    except FileNotFoundError:
        return None
    return CorePartsSaved(**{key: to_tuples(value) for key, value in fields.items()})
