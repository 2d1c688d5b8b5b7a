"""The rollout role of a cell: the embedded engine and its HTTP server, run in the cell's own event loop.

`RolloutHost` owns one `EmbeddedEngine` (driven by an `AsyncEngine` worker thread) and serves it with the engine
server's aiohttp app (SGLang's API plus /gyre/kv/*, registered with the cell's transfer agent so the KV migrator
can move blocks in and out). The engine object outlives role switches: leaving the rollout role releases its
memory (weights and KV pool) and stops the server; coming back resumes the memory and loads the newest weights.
Resuming is several times cheaper than constructing an engine (which allocates and initialises every weight
before loading), and the result is the same as a fresh engine: an empty pool and a new prefix-cache epoch.

Draining (rollout -> train) happens in steps the cell orders: `pause_in_place` (generations stop at a token
boundary and keep their KV, so the migrator can export everything computed so far), then `shutdown`: abort what is
still in flight (the proxy resubmits prompt + partial output to the cell that took the session), stop the server
while aborting any late arrival, release the memory.
"""

from __future__ import annotations

import asyncio
import hashlib
from typing import Any, Awaitable, Callable, Mapping

import structlog
import torch
from aiohttp import web

from gyre.engines.async_engine import AsyncEngine
from gyre.engines.embedded_engine import EmbeddedEngine, EngineConfig, EngineStats
from gyre.engines.engine_server import build_engine_app

__all__ = ["RolloutHost"]

log = structlog.get_logger(__name__)

Offload = Callable[..., Awaitable[Any]]


class RolloutHost:
    """One cell's inference engine and server; see the module docstring. Call from the cell's event loop."""

    def __init__(
        self,
        model_dir: str,
        engine_config: EngineConfig,
        agent: Any,
        host: str,
        port: int,
        shutdown_timeout_s: float,
        offload: Offload,
    ) -> None:
        self.model_dir = model_dir
        self.engine_config = engine_config
        self.agent = agent
        self.host = host
        self.port = port
        """Port to bind; after the first start, the port it got (reused so a cell keeps its URL if it can)."""
        self.shutdown_timeout_s = shutdown_timeout_s
        self._offload = offload
        self.async_engine: AsyncEngine | None = None
        self._runner: web.AppRunner | None = None
        self.url = ""
        self.pulled: torch.Tensor | None = None
        """Registered staging buffer for flat weights pulled from the core (kept for the next pull)."""
        self.pulled_version = -1
        self._memory_held = False

    # ---- state --------------------------------------------------------------------------------------------

    @property
    def serving(self) -> bool:
        return self._runner is not None

    @property
    def has_memory(self) -> bool:
        """Whether the engine holds its weights and KV pool (False before the first start and while released)."""
        return self._memory_held

    @property
    def engine(self) -> EmbeddedEngine | None:
        return self.async_engine.engine if self.async_engine is not None else None

    @property
    def weight_version(self) -> int:
        engine = self.engine
        return engine.weight_version if engine is not None else -1

    async def stats(self) -> EngineStats | None:
        if self.async_engine is None:
            return None
        return await self.async_engine.stats()

    # ---- start / stop -------------------------------------------------------------------------------------

    async def prepare(self) -> None:
        """Give the engine its memory back (build it the first time): weights from the model directory, version 0,
        an empty KV pool. Separate from `start` so a switch can do it while the trainer winds down."""
        if self.async_engine is None:
            engine = await self._offload(EmbeddedEngine, self.model_dir, self.engine_config)
            self.async_engine = AsyncEngine(engine)
        elif not self._memory_held:
            await self.async_engine.resume_memory(None)
        self._memory_held = True

    async def start(self, weights: Mapping[str, torch.Tensor] | None, version: int) -> str:
        """Load `weights` as `version` if given (after `prepare`, done here if not yet), start serving; returns the
        base URL."""
        assert not self.serving, "already serving"
        await self.prepare()
        assert self.async_engine is not None
        if weights is not None:
            await self.async_engine.load_weights(weights, version)
        await self.async_engine.continue_generation()
        app = build_engine_app(self.async_engine, self.agent, model_path=self.model_dir)
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=self.shutdown_timeout_s)
        await runner.setup()  # registers the KV pool with the transfer agent
        try:
            await self._bind(runner)
        except BaseException:
            await runner.cleanup()
            raise
        self._runner = runner
        self.port = int(runner.addresses[0][1])
        self.url = f"http://{self.host}:{self.port}"
        log.info("engine_serving", url=self.url, weight_version=self.weight_version)
        return self.url

    async def _bind(self, runner: web.AppRunner) -> None:
        site = web.TCPSite(runner, self.host, self.port, reuse_address=True)
        try:
            await site.start()
        except OSError as error:
            if self.port == 0:
                raise
            log.warning("engine_port_taken_using_another", port=self.port, error=str(error))
            site = web.TCPSite(runner, self.host, 0)
            await site.start()

    async def pause_in_place(self) -> int:
        """Stop generating at the next token boundary; requests keep their KV. Returns how many are paused."""
        assert self.async_engine is not None
        return await self.async_engine.pause("in_place")

    async def shutdown(self) -> int:
        """Abort what is in flight, stop the server (aborting late arrivals until it is down), release the engine's
        memory. Returns the number of requests aborted at the first abort."""
        assert self.async_engine is not None
        engine = self.async_engine
        aborted = await engine.abort_all()
        runner, self._runner = self._runner, None
        self.url = ""
        if runner is not None:
            stopped = asyncio.Event()

            async def abort_late_arrivals() -> None:
                # A call the proxy routed just before it heard CellDraining may still land; abort it so its
                # handler answers (and the proxy resubmits) instead of waiting on a paused engine.
                while not stopped.is_set():
                    await engine.abort_all()
                    try:
                        await asyncio.wait_for(stopped.wait(), 0.02)
                    except asyncio.TimeoutError:
                        pass

            aborter = asyncio.ensure_future(abort_late_arrivals())
            try:
                await runner.cleanup()  # stops listening, waits for handlers, unregisters the KV pool
            finally:
                stopped.set()
                await aborter
        await engine.abort_all()
        await engine.release_memory(None)
        self._memory_held = False
        log.info("engine_released", aborted=aborted)
        return aborted

    async def close(self) -> None:
        """Stop serving and end the engine's worker thread (the cell is stopping)."""
        if self.serving:
            await self.shutdown()
        if self.async_engine is not None:
            await self.async_engine.close()
            self.async_engine = None
        self.drop_pull_buffer()

    # ---- weights ------------------------------------------------------------------------------------------

    async def load_weights(self, weights: Mapping[str, torch.Tensor], version: int) -> None:
        """Swap weights between two steps: pause in place, load, continue. In-flight requests keep their tokens
        and version tags; tokens generated afterwards carry `version`."""
        assert self.async_engine is not None

        def swap(engine: EmbeddedEngine) -> None:
            was_paused = engine.paused
            engine.pause("in_place")
            engine.load_weights(weights, version)
            if not was_paused:
                engine.continue_generation()

        await self.async_engine.call(swap)

    def pull_buffer(self, nbytes: int) -> torch.Tensor:
        """The registered staging buffer for a pull of `nbytes` (fp32), made (or remade) to fit."""
        if nbytes % 4:
            raise ValueError(f"a flat fp32 weight buffer cannot be {nbytes} bytes")
        if self.pulled is None or self.pulled.numel() * 4 != nbytes:
            self.drop_pull_buffer()
            buffer = torch.zeros(nbytes // 4, dtype=torch.float32)
            self.agent.register_tensor(buffer)
            self.pulled = buffer
        return self.pulled

    def drop_pull_buffer(self) -> None:
        if self.pulled is not None:
            self.agent.unregister_tensor(self.pulled)
            self.pulled = None
            self.pulled_version = -1

    def pulled_digest(self) -> str:
        if self.pulled is None or self.pulled_version < 0:
            return ""
        return hashlib.sha256(self.pulled.numpy().tobytes()).hexdigest()
