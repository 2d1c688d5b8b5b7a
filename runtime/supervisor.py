"""The built-in supervisor: hears about failed actors and requests to stop, and ends the run when it must."""

from __future__ import annotations

import attrs

from gyre.messages.runtime_control import ActorFailed, StopTopology
from gyre.runtime.actor import Actor, handler


@attrs.frozen
class SupervisorConfig:
    """How the supervisor treats failures that nodes could not absorb."""

    stop_on_escalation: bool = True
    """End the run (exit status 1) when an actor's restart policy escalates."""


class Supervisor(Actor):
    """Lives on the launcher's node. Restarts happen on the failed actor's own node; this actor only ends runs."""

    config_cls = SupervisorConfig

    async def on_start(self) -> None:
        self.failures: list[ActorFailed] = []

    @handler(ActorFailed)
    def on_actor_failed(self, msg: ActorFailed) -> None:
        self.failures.append(msg)
        self.log.warning("actor_failed", failed=msg.actor, error=msg.error_type, detail=msg.message, action=msg.action)
        if msg.action == "escalated" and self.config.stop_on_escalation:
            self._slot.node.resolve_stop(f"{msg.actor} failed: {msg.error_type}: {msg.message}", 1)

    @handler(StopTopology)
    def on_stop_topology(self, msg: StopTopology) -> None:
        self._slot.node.resolve_stop(msg.reason, msg.exit_code)
