"""Questions other actors ask the proxy about the sessions it routes (the KV migrator, benchmarks, reports)."""

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


@message("gyre.proxy.ProxyStatusAsked")
class ProxyStatusAsked:
    """Anyone -> proxy (ask): its counters and where it serves."""


@message("gyre.proxy.ProxyStatus")
class ProxyStatus:
    """Proxy's reply to ProxyStatusAsked."""

    base_url: str
    """Where agents reach it (http://host:port; the OpenAI SDK's base URL adds /v1)."""
    calls_completed: int
    """Calls answered with a result."""
    calls_rejected: int
    """Calls answered with a 4xx."""
    calls_failed: int
    """Calls answered with a 5xx (503s that the SDKs retry included)."""
    in_flight: int
    """Calls being generated now."""
    resumed_generations: int
    """Generations aborted on one cell and continued (prompt + partial output) on another or the same cell."""
    waits_for_cell: int
    """Calls that had to wait for a rollout cell or for a migrating session's placement."""
    sessions: int
    """Sessions the proxy routes (and remembers the prefix of)."""
    sessions_by_cell: dict[str, int]
    """Cell name -> sessions placed on it."""


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
