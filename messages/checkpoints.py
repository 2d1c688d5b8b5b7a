"""A run's full checkpoints (issue 28): the core saves its part after a step, the checkpointer gathers the others.

The core decides when (after every N-th applied step) and writes its trainer state into the step's staging folder
itself (it is large, and sharded with the trainer), then tells the checkpointer `CorePartsSaved`. The checkpointer
asks each other participant `CheckpointAsked`; each answers `CheckpointState` with its state as of that step's end.
Once every part is in, the checkpointer writes the manifest last and publishes `CheckpointCommitted`.
"""

from __future__ import annotations

from gyre.messages._define import message


@message("gyre.checkpoints.CorePartsSaved")
class CorePartsSaved:
    """Core -> checkpointer: after applying step `step_id` it wrote these files into that step's staging folder."""

    cell: str
    """The core cell."""
    step_id: int
    """The step just applied (or skipped): the checkpoint's step."""
    weight_version: int
    """The core's weight version after it."""
    part_names: tuple[str, ...]
    """File names in the staging folder (one per trainer shard)."""
    part_sha256: tuple[str, ...]
    """Hex SHA-256 of each file, in the order of `part_names`."""
    part_bytes: tuple[int, ...]
    """Size of each file."""
    state_digest: str
    """SHA-256 over the weights and optimizer moments saved (what a restore must reproduce)."""


@message("gyre.checkpoints.CheckpointAsked")
class CheckpointAsked:
    """Checkpointer -> a participant (ask): your state at the end of step `step_id`; the reply is CheckpointState
    (an actor that can no longer give that step's state raises, and the checkpoint of that step is abandoned)."""

    step_id: int


@message("gyre.checkpoints.CheckpointState")
class CheckpointState:
    """A participant's reply: its state, and the groups in it whose samples the checkpointed weights lack."""

    actor: str
    """Who answers."""
    step_id: int
    """The step asked about."""
    state: bytes
    """The actor's state (JSON, gyre.runtime.checkpoint.encode_json); its restore function reads it back."""
    groups_not_trained: tuple[str, ...]
    """Groups started or landed whose samples did not go into steps up to `step_id`: a resumed run re-rolls them."""


@message("gyre.checkpoints.CheckpointCommitted")
class CheckpointCommitted:
    """Checkpointer -> everyone interested (published): a checkpoint is complete on disk."""

    step_id: int
    """The checkpoint's step."""
    weight_version: int
    """The core's weight version in it."""
    path: str
    """Its folder."""
    num_parts: int
    """Files in it besides the manifest."""
    groups_to_reroll: int
    """Groups a resume from it re-rolls."""
    seconds: float
    """From the core's part saved to the commit."""


@message("gyre.checkpoints.CheckpointerStatistics")
class CheckpointerStatistics:
    """What the checkpointer has done so far."""

    committed: int
    """Checkpoints committed."""
    abandoned: int
    """Checkpoints given up (a participant could not answer, a part could not be written): nothing committed."""
    last_step_id: int
    """Step of the newest committed checkpoint (-1: none yet)."""
    last_seconds: float
    """How long the newest one took, from the core's part saved to the commit."""
