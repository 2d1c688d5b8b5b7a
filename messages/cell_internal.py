"""What cells and the weight broker say to each other (and to themselves) beyond the public protocol.

The public conversation (messages/cells.py, messages/training.py) names a weight version and a Mooncake buffer
(`WeightsPublished`). Pulling it safely needs two more facts that only the core knows: where its *fence* word
lives (the version of the weights in the buffer, -1 while an optimizer step rewrites them, so a puller can tell
a torn read from a clean one) and the buffer's layout (Megatron names, shapes and offsets, so a cell without a
trainer can turn the flat buffer into a Hugging Face state dict for its engine). The core hands both to the
broker once (`WeightSource`); cells ask the broker for the newest one when they pull (`WeightsQuery`).
"""

from __future__ import annotations

from gyre.messages._define import message


@message("gyre.cell_internal.WeightSource")
class WeightSource:
    """Core -> weight broker (tell, at start); broker -> cell (reply to WeightsQuery): where to pull weights from."""

    cell: str
    """The core cell that owns the buffer ("" when there is no source yet)."""
    version: int
    """Weight version the buffer holds now (-1 when there is no source yet)."""
    peer: str
    """Mooncake peer ("host:port") of the core's transfer agent."""
    addr: int
    """Address of the flat fp32 parameter buffer there."""
    nbytes: int
    """Size of the buffer."""
    fence_addr: int
    """Address of an int64 there: the version of the weights in the buffer, -1 while a step writes them."""
    param_names: tuple[str, ...]
    """Megatron parameter names, in buffer order."""
    param_shapes: tuple[tuple[int, ...], ...]
    """Shape of each parameter."""
    param_offsets: tuple[int, ...]
    """First element of each parameter in the buffer."""


@message("gyre.cell_internal.WeightsQuery")
class WeightsQuery:
    """Cell -> weight broker (ask): where are the newest weights? Answered with a WeightSource."""

    cell: str
    """The asking cell (for the broker's statistics)."""


@message("gyre.cell_internal.WeightsStatusQuery")
class WeightsStatusQuery:
    """Anyone -> weight broker (ask): which cell holds which version. Answered with WeightsStatus."""


@message("gyre.cell_internal.WeightsStatus")
class WeightsStatus:
    """The weight broker's statistics."""

    version: int
    """Newest published version (-1 before the core registered)."""
    published: int
    """WeightsPublished messages sent so far."""
    cell_versions: dict[str, int]
    """Cell -> version it last reported loaded (WeightsLoaded)."""
    last_load_s: dict[str, float]
    """Cell -> seconds its last pull-and-load took."""
    loads: int
    """WeightsLoaded reports received so far."""


@message("gyre.cell_internal.ReportTick")
class ReportTick:
    """Cell -> itself (timer): publish a LoadReport."""


@message("gyre.cell_internal.SwitchFinished")
class SwitchFinished:
    """Cell -> itself: the work of a role switch is done; the handler commits the new role and announces it."""

    role: str
    """The role the cell is now ready to play."""
    previous_role: str
    """The role it left ("" at start)."""
    engine_url: str
    """Inference server URL in the rollout role; "" otherwise."""
    weight_version: int
    """Weights the cell holds now."""
    switch_s: float
    """Runtime-clock seconds from the switch's start to now."""
    sessions_migrated: int
    """Sessions the KV migrator placed elsewhere (rollout -> train)."""


@message("gyre.cell_internal.CellStatusQuery")
class CellStatusQuery:
    """Anyone -> cell (ask): what it is doing. Answered with CellStatus."""

    with_digest: bool
    """Also hash the weights the cell holds (costs a pass over them)."""


@message("gyre.cell_internal.CellStatus")
class CellStatus:
    """A cell's statistics record."""

    cell: str
    """Cell name."""
    role: str
    """"rollout", "train" or "switching"."""
    is_core: bool
    """Whether it is the core."""
    engine_url: str
    """Inference server URL while it serves rollouts; "" otherwise."""
    weight_version: int
    """Version of the weights it serves or trains with (-1 while it holds none)."""
    weights_sha256: str
    """With with_digest: hex SHA-256 of the flat fp32 weights it holds (trainer) or last pulled (rollout); "" if
    unknown (a rollout cell that loaded its weights from disk)."""
    microsteps_computed: int
    """Micro-steps it computed gradients for."""
    microsteps_released: int
    """Micro-steps it handed back unfinished."""
    steps_applied: int
    """Optimizer steps it applied (core only)."""
    switches: int
    """Role switches completed (the initial role not counted)."""
    switches_refused: int
    """Switches refused (no other rollout cell to take the sessions)."""
    has_trainer: bool
    """Whether it holds a trainer now."""
    has_engine_memory: bool
    """Whether its engine holds weights and a KV pool now."""
