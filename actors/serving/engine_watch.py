"""Engine servers that someone else runs, watched: what `gyre serve MODEL_DIR --engine-url URL ...` routes to.

Inside a run, the cells tell the proxy where their engines are and when they fail (RoleChanged, EngineServerFailed).
`gyre serve --engine-url` has no cells: the user points it at SGLang servers (or Gyre's engine servers) that already
run. `EngineWatch` stands in for the cells. At start it checks each server (it answers /health within
`startup_timeout_s`, and its model is MODEL_DIR's: same vocabulary and layout, `check_served_model`) and refuses
the whole start otherwise (`EngineWatchError`, naming the URL and the reason), so a user never collects trajectories
whose ids mean other tokens. Then it tells the `RoutedBackend` each server is a rollout cell named `engine-<i>`,
and every `health_interval_s` it asks /health: a server that stops answering is `cell_failed` (its sessions go to
the others, which re-prefill them; generations it held resume there, see routing.py), one that answers again is
`cell_recovered`. Calls in flight notice a dead server sooner than the watch does (a refused connection starts the
backend's own backoff).

The watch is the parent of nothing and keeps no state but each server's last health: the backend holds the view.
"""

from __future__ import annotations

import asyncio
from typing import Any, Sequence

import attrs
import structlog

from gyre.actors.errors import ActorError
from gyre.actors.serving.routing import RoutedBackend
from gyre.engines.model_format import ModelSpec, ServedModelMismatch, check_served_model
from gyre.engines.sglang_client import SGLangClient, SGLangError
from gyre.messages.cells import ROLLOUT, RoleChanged
from gyre.runtime.errors import ConfigError

__all__ = ["EngineWatch", "EngineWatchConfig", "EngineWatchError", "engine_cell_name"]

log = structlog.get_logger(__name__)


class EngineWatchError(ActorError, RuntimeError):
    """An engine server that `gyre serve` was pointed at cannot be used (not answering, another model)."""


@attrs.frozen
class EngineWatchConfig:
    startup_timeout_s: float = 120.0
    """How long each server may take to answer /health at start (SGLang loading a large model takes minutes: the
    user raises this); after that the start is refused."""
    health_interval_s: float = 1.0
    """Between two rounds of /health checks. One second: a dead server is noticed within about a second even
    when no call is in flight on it, for one tiny GET per server per second."""

    health_timeout_s: float = 5.0
    """A /health that takes longer counts as unhealthy: a server that accepts connections but hangs must not stall
    the watch (the client's own deadline for control calls is minutes)."""

    def __attrs_post_init__(self) -> None:
        if self.startup_timeout_s <= 0 or self.health_interval_s <= 0 or self.health_timeout_s <= 0:
            raise ConfigError("startup_timeout_s, health_interval_s and health_timeout_s must be > 0")


def engine_cell_name(index: int) -> str:
    """The name a watched server's cell has in the proxy's view (and in ModelCallCompleted.cell)."""
    return f"engine-{index}"


class EngineWatch:
    """Checks the servers at `urls` and keeps `backend`'s view of them current (see the module doc)."""

    def __init__(self, backend: RoutedBackend, urls: Sequence[str], spec: ModelSpec, model_dir: str,
                 make_client: Any, config: EngineWatchConfig = EngineWatchConfig()) -> None:
        if not urls:
            raise ConfigError("EngineWatch needs at least one engine URL")
        if len(set(urls)) != len(urls):
            raise ConfigError(f"an engine URL is given twice: {list(urls)}")
        self.backend = backend
        self.urls = tuple(url.rstrip("/") for url in urls)
        self.spec = spec
        self.model_dir = model_dir
        self.config = config
        self._clients: list[SGLangClient] = [make_client(url) for url in self.urls]
        self._healthy = [False] * len(self.urls)
        self.model_checks: tuple[str, ...] = ()
        """How each server's model was checked ("layout", "config" or "unverified")."""

    async def check_all(self) -> None:
        """Every server healthy and serving MODEL_DIR's model, or EngineWatchError; then each is a rollout cell."""
        checks = []
        for index, (url, client) in enumerate(zip(self.urls, self._clients)):
            try:
                await client.wait_healthy(self.config.startup_timeout_s)
                info = await client.model_info()
                checks.append(check_served_model(info, self.spec, self.model_dir))
            except ServedModelMismatch as error:
                raise EngineWatchError(f"engine server {url}: {error}") from None
            except SGLangError as error:
                raise EngineWatchError(f"engine server {url} cannot be used: {error}") from None
            if checks[-1] == "unverified":
                log.warning("engine_model_not_verified", url=url,
                            why="the server reports neither its layout nor a model_path this machine can read")
            self._healthy[index] = True
            self.backend.role_changed(RoleChanged(
                cell=engine_cell_name(index), role=ROLLOUT, previous_role="", engine_url=url, weight_version=0,
                switch_s=0.0, sessions_migrated=0, is_core=False,
            ))
        self.model_checks = tuple(checks)
        log.info("engine_servers_ready", urls=list(self.urls), model_checks=list(checks))

    async def check_once(self) -> None:
        """One round of /health checks; tells the backend of every change."""
        answers = await asyncio.gather(*(self._healthy_within(client) for client in self._clients))
        for index, healthy in enumerate(answers):
            if healthy == self._healthy[index]:
                continue
            self._healthy[index] = healthy
            name, url = engine_cell_name(index), self.urls[index]
            if healthy:
                log.info("engine_server_recovered", cell=name, url=url)
                self.backend.cell_recovered(name)
            else:
                log.error("engine_server_unhealthy", cell=name, url=url)
                self.backend.cell_failed(name, f"{url} does not answer /health")

    async def _healthy_within(self, client: SGLangClient) -> bool:
        try:
            return await asyncio.wait_for(client.health(), self.config.health_timeout_s)
        except asyncio.TimeoutError:
            return False

    async def run(self) -> None:
        """Check every `health_interval_s` until cancelled."""
        while True:
            await asyncio.sleep(self.config.health_interval_s)
            await self.check_once()

    @property
    def healthy(self) -> tuple[bool, ...]:
        return tuple(self._healthy)

    async def close(self) -> None:
        for client in self._clients:
            await client.close()
