"""What the proxy is asked about the sessions it routes (the KV migrator), what it answers StatisticsAsked with, and
what it publishes about calls that wait for a cell."""

from __future__ import annotations

from gyre.messages._define import message


@message("gyre.proxy.SessionsOnCell")
class SessionsOnCell:
    """KV migrator -> proxy (ask): which sessions live on `cell`, and the token ids whose KV they hold there.

    Asking marks those sessions as migrating: their next calls wait (bounded) for a SessionPlaced instead of
    re-prefilling on whichever cell is least loaded.
    """

    cell: str
    """Cell being drained."""


@message("gyre.proxy.SessionPrefixes")
class SessionPrefixes:
    """Proxy's reply to SessionsOnCell."""

    cell: str
    """The cell asked about."""
    sessions: dict[str, tuple[int, ...]]
    """Session key -> token ids of its latest prompt + output there (only the prompt while a call is in flight)."""


@message("gyre.proxy.ProxyStatistics", version=2)
class ProxyStatistics:
    """Proxy's answer to StatisticsAsked (gyre.messages.runtime_control): its counters and where it serves.

    Version 2: was ProxyStatus (the reply to the retired ProxyStatusAsked); adds calls_disconnected, emit_failures,
    in_flight_peak and the resumed generations' token counts.
    """

    base_url: str
    """Where agents reach it (http://host:port; the OpenAI SDK's base URL adds /v1)."""
    calls_completed: int
    """Calls answered with a result."""
    calls_rejected: int
    """Calls answered with a 4xx."""
    calls_failed: int
    """Calls answered with a 5xx (503s that the SDKs retry included)."""
    calls_disconnected: int
    """Streamed calls whose client left before the generation finished (aborted, neither recorded nor emitted)."""
    emit_failures: int
    """ModelCallCompleted records the proxy failed to hand on (each one logged)."""
    in_flight: int
    """Model calls being handled now (from the body read to the answer's last byte)."""
    in_flight_peak: int
    """The most model calls handled at once since the proxy started."""
    resumed_generations: int
    """Generations aborted on one cell and continued (prompt + partial output) on another or the same cell."""
    resumed_prompt_tokens: int
    """Prompt tokens (prompt + partial output) of resubmitted generations that came back."""
    resumed_cached_tokens: int
    """Of those, tokens the new cell served from its cache (the migrated KV, when the migration moved it)."""
    waits_for_cell: int
    """Calls that had to wait for a rollout cell or for a migrating session's placement."""
    sessions: int
    """Sessions the proxy routes (and remembers the prefix of)."""
    sessions_by_cell: dict[str, int]
    """Cell name -> sessions placed on it."""
    engines_unreachable: int = 0
    """Times a cell's engine refused a connection or answered 5xx (its calls resumed elsewhere)."""
    failed_cells: tuple[str, ...] = ()
    """Cells whose engine server failed (EngineServerFailed) and that are not rollout cells again yet."""


@message("gyre.proxy.CallsWaitingForCell")
class CallsWaitingForCell:
    """Proxy -> everyone, whenever the number changes: agent calls waiting because no rollout cell accepts them.

    A cell reports the sessions and generations it holds; a call that no cell can take is demand only the proxy
    sees. It happens when every cell has left rollout (colocate's training phase; elastic, while the rollout had
    nothing to do), and tells a scheduler that rollout work is back.
    """

    calls: int
    """Calls waiting for a rollout cell now."""
    time_s: float
    """Proxy's runtime-clock time of the change."""
