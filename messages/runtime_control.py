"""Messages the runtime itself exchanges: ask failures, supervision, shutdown, statistics, and the per-actor start
record of logs."""

from __future__ import annotations

from gyre.messages._define import message


@message("gyre.runtime.AskFailed")
class AskFailed:
    """The reply to an ask whose handler raised, whose target is dead, or that no handler takes."""

    actor: str
    """The actor that was asked."""
    error_type: str
    """Name of the error class, e.g. "ValueError", "ActorDead", "NoHandler"."""
    message: str
    """Human-readable detail."""


@message("gyre.runtime.ActorFailed")
class ActorFailed:
    """Sent to the supervisor when a handler of a tell raised and the actor stopped."""

    actor: str
    """Name of the failed actor."""
    error_type: str
    """Name of the error class that escaped the handler."""
    message: str
    """Human-readable detail."""
    restarts: int
    """How many times this actor has been restarted so far."""
    action: str
    """What the actor's node did about it: "restarted", "stopped" or "escalated"."""


@message("gyre.runtime.StopTopology")
class StopTopology:
    """Ask the supervisor to stop every actor and end the run."""

    reason: str
    """Why the run ends; printed by the launcher."""
    exit_code: int
    """Process exit status of the launcher: 0 for a normal end."""


@message("gyre.runtime.ActorStarted", version=2)
class ActorStarted:
    """Written to the event log when an actor (re)starts: what replay needs to rebuild it. Version 2 added
    `source_sha256`; replay reads version 1 records from their fields, with no hash."""

    actor: str
    """Name of the actor."""
    class_path: str
    """"module:QualName" of the actor class."""
    source_path: str
    """File that defines the class (topology files are not importable by module name); "" for gyre's own classes."""
    source_sha256: str
    """Hex SHA-256 of that file's content when the run started ("" with no file): replay loads the file only if it
    still matches, or if the user names it."""
    config_blob: bytes
    """The actor's attrs config, encoded by the runtime's config codec."""
    seed: int
    """Seed of the actor's private random generator."""
    index: int
    """The actor's index in the topology; message ids are index * 2**40 + sequence."""
    subscriptions: tuple[str, ...]
    """Wire names of the published message types the actor listens to."""
    incarnation: int
    """0 for the first start, then 1, 2, ... for each restart."""


@message("gyre.runtime.StatisticsAsked")
class StatisticsAsked:
    """Anyone -> any actor (ask): your statistics, now. Every actor answers with its own frozen record,
    `<Actor>Statistics` (what `Actor.statistics()` returns); one without counters answers with a NoHandler error."""
