"""Cells, their roles and load, and the proxy's routing view of them."""

from __future__ import annotations

from gyre.messages._define import message

ROLLOUT = "rollout"
TRAIN = "train"
SWITCHING = "switching"


@message("gyre.cells.LoadReport")
class LoadReport:
    """Cell -> everyone (published periodically and on change): what it is doing and how full it is."""

    cell: str
    """Cell name."""
    role: str
    """"rollout", "train" or "switching"."""
    engine_url: str
    """Base URL of the cell's inference server (SGLang API) while it serves rollouts; "" otherwise."""
    live_sessions: int
    """Sessions (executions) whose KV the cell holds."""
    running_requests: int
    """Generations in progress."""
    waiting_requests: int
    """Generations queued."""
    free_kv_blocks: int
    """KV blocks free in the pool."""
    total_kv_blocks: int
    """KV blocks in the pool."""
    capacity_requests: int
    """Concurrent generations the cell can run."""
    weight_version: int
    """Version of the weights it serves or trains."""
    time_s: float
    """Runtime-clock time of the report."""


@message("gyre.cells.SwitchRole", version=2)
class SwitchRole:
    """Scheduler -> cell: move to `role`."""

    cell: str
    """Cell to switch."""
    role: str
    """"rollout" or "train"."""
    reason: str
    """Why the scheduler decided it (for logs and reports)."""
    migrate_sessions: bool = True
    """Into training: move the cell's live sessions to the other rollout cells, and refuse the switch when there are
    none. False: leave them, even when no rollout cell remains; their generations are aborted and the proxy holds
    their calls until a cell rolls out again. The colocate baseline asks this: every cell leaves rollout at once, so
    there is nowhere to move the sessions to (and in its GPU form the KV cache is freed for training anyway)."""


@message("gyre.cells.RoleChanged")
class RoleChanged:
    """Cell -> everyone: a switch finished (or the initial role at start)."""

    cell: str
    """Cell name."""
    role: str
    """New role."""
    previous_role: str
    """Role before the switch ("" at start)."""
    engine_url: str
    """Inference server URL when the new role is rollout; "" otherwise."""
    weight_version: int
    """Weights the cell now holds."""
    switch_s: float
    """How long the switch took (0 at start)."""
    sessions_migrated: int
    """Live sessions moved away (rollout -> train)."""
    is_core: bool
    """Whether this is the core cell."""


@message("gyre.cells.CellDraining")
class CellDraining:
    """Cell -> everyone: stop routing new calls to me; in-flight calls will be migrated."""

    cell: str
    """Cell name."""


@message("gyre.cells.MigrateSessions", version=2)
class MigrateSessions:
    """Cell -> KV migrator (ask): move every live session of `source` to the given targets."""

    source: str
    """Cell being drained."""
    source_url: str
    """Its inference server URL."""
    targets: dict[str, str]
    """Cell name -> inference server URL of the cells that take sessions over."""
    sessions: tuple[str, ...]
    """Session keys (execution ids) to move."""
    in_flight: tuple[tuple[int, ...], ...] = ()
    """Token ids (prompt + output so far) of the source's generations paused in place: a session whose latest ids
    (its prompt) begin one of these moves the longer ids, partial output included."""


@message("gyre.cells.SessionsMigrated")
class SessionsMigrated:
    """KV migrator's reply: where each session went and how."""

    source: str
    """Cell drained."""
    placement: dict[str, str]
    """Session key -> target cell."""
    moved_tokens: int
    """Prefix tokens whose KV moved through Mooncake."""
    reprefill_sessions: int
    """Sessions that fell back to re-prefill (no export capability or a failed transfer)."""
    seconds: float
    """Wall time of the migration."""
    hicache_sessions: int = 0
    """Sessions left to SGLang's HiCache: both servers write through to the same shared storage backend."""


@message("gyre.cells.SessionPlaced")
class SessionPlaced:
    """KV migrator -> proxy (published): route this session to this cell from now on."""

    session: str
    """Session key (execution id)."""
    cell: str
    """Cell that holds its prefix now."""


@message("gyre.cells.EngineServerFailed")
class EngineServerFailed:
    """Cell -> everyone: its engine server did not start, died or broke; the cell fails after this (its supervisor
    decides what follows)."""

    cell: str
    """Cell name."""
    engine_url: str
    """The server's base URL ("" if it never got one)."""
    reason: str
    """What happened, in one line."""
    exit_code: int
    """The server process's exit code; -1 when it still runs or the cell did not launch it."""
    last_output: tuple[str, ...]
    """The last lines the server printed (bounded by the cell's EngineServerConfig.output_lines)."""
