"""What cells and the weight broker say to each other (and to themselves) beyond the public protocol.

The public conversation (messages/cells.py, messages/training.py) names a weight version and a Mooncake buffer
(`WeightsPublished`). Pulling it safely needs two more facts that only the core knows: where its *fence* word
lives (the version of the weights in the buffer, -1 while an optimizer step rewrites them, so a puller can tell
a torn read from a clean one) and the buffer's layout (Megatron names, shapes and offsets, so a cell without a
trainer can turn the flat buffer into a Hugging Face state dict for its engine). The core hands both to the
broker once (`WeightSource`); cells ask the broker for the newest one when they pull (`WeightsQuery`).

Also here: the statistics records of the cells' wing (`CellStatistics`, `WeightBrokerStatistics`,
`KVMigratorStatistics`, each the answer to `StatisticsAsked`) and the ask for a cell's weights digest
(`WeightsDigestAsked`), kept apart from the statistics because hashing the weights costs a pass over them.
"""

from __future__ import annotations

from gyre.messages._define import message


@message("gyre.cell_internal.WeightSource", version=3)
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
    shards: tuple[tuple[str, int, int], ...] = ()
    """A core whose trainer spans processes: every global rank's parameter shard (Mooncake peer, address, bytes),
    rank 0 first (the buffer above is rank 0's shard and the layout its own); a satellite of the same layout pulls
    shard g into its rank g. () for a one-process core."""
    layout: tuple[int, int, int, int] = (1, 1, 1, 1)
    """The core's training layout (tensor, pipeline, data, expert sizes)."""


@message("gyre.cell_internal.WeightsQuery")
class WeightsQuery:
    """Cell -> weight broker (ask): where are the newest weights? Answered with a WeightSource."""

    cell: str
    """The asking cell (for the broker's statistics)."""


@message("gyre.cell_internal.WeightBrokerStatistics")
class WeightBrokerStatistics:
    """The weight broker's statistics (its answer to StatisticsAsked): which cell holds which version."""

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


@message("gyre.cell_internal.CellStatistics", version=4)
class CellStatistics:
    """A cell's statistics (its answer to StatisticsAsked): cheap, it reads counters only."""

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
    engine_kind: str = "embedded"
    """How it hosts its engine: "embedded" (in its process), "server" (a child process it launched) or "url"."""
    engine_weight_updates: int = 0
    """Weight updates its engine took while serving (not counting the load at a switch into rollout)."""
    last_weight_update_path: str = ""
    """How the last update reached the engine: "memory" (embedded), "disk" (update_weights_from_disk); "" = none."""
    last_weight_update_s: float = 0.0
    """Seconds the last update took, from the weights in hand to the engine holding them."""
    engine_weight_updates_refused: int = 0
    """Newer weights its engine could not take in the core's layout (e.g. a tensor-parallel core's shards reaching an
    embedded engine that pulls a whole buffer): it went on serving the weights it had."""
    gradient_rounds: int = 0
    """Gradient reduction rounds: led (the core) or joined (a satellite)."""
    gradient_rounds_failed: int = 0
    """Of those, rounds that counted nothing (their micro-steps went back to the claimer)."""
    gradient_bytes_sent: int = 0
    """Gradient bytes this cell sent in rounds (a satellite: one buffer a round)."""
    gradient_bytes_received: int = 0
    """Gradient bytes this cell received in rounds (the core: one buffer a round, whatever the number of members)."""


@message("gyre.cell_internal.WeightsDigestAsked")
class WeightsDigestAsked:
    """Anyone -> cell (ask): hash the weights you hold. Answered with WeightsDigest. Costs a pass over the weights
    (and waits for the cell's compute in progress), so ask it when checking, not when polling."""


@message("gyre.cell_internal.WeightsDigest")
class WeightsDigest:
    """A cell's answer to WeightsDigestAsked."""

    cell: str
    """Cell name."""
    weight_version: int
    """Version of the weights hashed (-1 when the cell holds none); without a digest, the version it serves or
    trains with."""
    sha256: str
    """Hex SHA-256 of the flat fp32 weights it holds (its trainer's, when it has one) or its engine last pulled;
    "" when unknown (a rollout cell that loaded its weights from disk)."""


@message("gyre.cell_internal.KVMigratorStatistics")
class KVMigratorStatistics:
    """The KV migrator's statistics (its answer to StatisticsAsked)."""

    migrations: int
    """MigrateSessions asks answered so far."""
    sessions_placed: int
    """Sessions placed on another cell in all migrations so far."""
    moved_tokens: int
    """KV tokens moved through Mooncake in all migrations so far."""
    partial_output_tokens: int
    """Of the sessions placed, tokens of partial output (generations paused in place) asked to move with them."""
    reprefill_sessions: int
    """Sessions that fell back to re-prefill on their new cell, in all migrations so far."""
    hicache_sessions: int = 0
    """Sessions left to SGLang's HiCache (a shared storage backend), in all migrations so far."""
