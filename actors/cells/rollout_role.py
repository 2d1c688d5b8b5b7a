"""The rollout role of a cell: the embedded engine and its HTTP server, run in the cell's own event loop.

`RolloutHost` owns one `EmbeddedEngine` (driven by an `AsyncEngine` worker thread) and serves it with the engine
server's aiohttp app (SGLang's API plus /gyre/kv/*, registered with the cell's transfer agent so the KV migrator
can move blocks in and out). The engine object outlives role switches: leaving the rollout role releases its
memory (weights and KV pool) and stops the server; coming back resumes the memory and loads the newest weights.
Resuming is several times cheaper than constructing an engine (which allocates and initialises every weight
before loading), and the result is the same as a fresh engine: an empty pool and a new prefix-cache epoch.

Draining (rollout -> train) happens in steps the cell orders: `pause_in_place` (generations stop at a token
boundary and keep their KV), `live_sequences` (prompt + partial output of each, so the migrator exports everything
computed so far), then `shutdown`: abort what is still in flight (the proxy resubmits prompt + partial output to the
cell that took the session, which holds its KV by then), stop the server while aborting any late arrival, release
the memory.

Also here: `EngineWeights` fetches the newest weights for the engine (the cell loads them at a start or switch, and
after every publication while serving), `RecentSessions` is the cell's estimate of its live sessions, and `PeerView`
is what a cell knows of the other cells, so that a draining cell knows who can take its sessions. None of them sees
the cell: they take explicit inputs and return results; the cell owns the state and orders the steps.
"""

from __future__ import annotations

import asyncio
import json
from collections import OrderedDict
from typing import Any, Callable, Mapping

import attrs
import structlog
import torch
from aiohttp import web

from gyre.actors.cells.train_role import Offload, TrainerHost
from gyre.actors.cells.weight_pull import WeightLayoutError, WeightPuller, flat_to_hf, pull_weights
from gyre.engines.async_engine import AsyncEngine
from gyre.engines.embedded_engine import EmbeddedEngine, EngineConfig, EngineStats
from gyre.engines.engine_server import build_engine_app
from gyre.engines.model_format import ModelSpec
from gyre.engines.trainer_group import TrainerGroup
from gyre.engines.transfer import host_sha256
from gyre.engines.weight_buckets import HFBuckets, as_state_dict
from gyre.messages.cell_internal import WeightSource
from gyre.messages.cells import ROLLOUT, CellDraining, LoadReport, RoleChanged

__all__ = ["EngineWeights", "PeerView", "PullStaging", "RecentSessions", "RolloutHost"]

log = structlog.get_logger(__name__)


PUBLISH_BUCKET_BYTES = 256 << 20
"""A sharded core trainer publishes its weights in buckets of whole decoder layers of at most this many fp32 bytes
(a larger layer is a bucket of its own): the most of the model the core's process holds at once while publishing."""


class RecentSessions:
    """The sessions (executions) that called this engine lately: the cell's estimate of its live sessions.

    The proxy knows its sessions exactly; a cell sees only request ids, which the proxy makes
    "<execution_id>/<call_index>". An agent runs tools between its calls, so a session counts as live for `ttl_s`
    after its last call here (or after the KV migrator placed it here), or until the executor publishes its
    ExecutionEnded, whichever comes first. Without the latter, a stream of short agents would count every agent of
    the last `ttl_s` as live (100+ per cell in the main job, against ~10 running requests), and the elastic policy
    would never find capacity to spare. Bounded: the stalest are forgotten first.
    """

    def __init__(self, ttl_s: float, max_sessions: int, clock: Callable[[], float]) -> None:
        self.ttl_s = ttl_s
        self.max_sessions = max_sessions
        self.clock = clock
        self._last_s: OrderedDict[str, float] = OrderedDict()

    @staticmethod
    def session_of(key: str) -> str:
        """The execution id in a request id or a proxy session key ("<execution_id>/<...>")."""
        return key.rsplit("/", 1)[0]

    def seen(self, key: str) -> None:
        session = self.session_of(key)
        self._last_s[session] = self.clock()
        self._last_s.move_to_end(session)
        while len(self._last_s) > self.max_sessions:
            self._last_s.popitem(last=False)

    def count(self) -> int:
        horizon = self.clock() - self.ttl_s
        while self._last_s and next(iter(self._last_s.values())) < horizon:
            self._last_s.popitem(last=False)
        return len(self._last_s)

    def ended(self, execution_id: str) -> None:
        """The execution is over (the executor said so): it is no longer live, whatever its last call's time."""
        self._last_s.pop(execution_id, None)

    def clear(self) -> None:
        self._last_s.clear()

    def middleware(self) -> Callable:
        """An aiohttp middleware noting the session of every /generate call (the body is read once and cached)."""
        sessions = self

        @web.middleware
        async def note_session(request: web.Request, handler: Callable) -> web.StreamResponse:
            if request.method == "POST" and request.path == "/generate":
                try:
                    body = json.loads(await request.read())
                except (ValueError, UnicodeDecodeError):
                    body = None  # the handler answers 400
                rid = body.get("rid") if isinstance(body, dict) else None
                if isinstance(rid, str) and rid:
                    sessions.seen(rid)
            return await handler(request)

        return note_session


class PullStaging:
    """The registered staging buffer a satellite's engine host pulls flat weights from the core into (kept for the
    next pull); shared by the embedded host and the server host (actors/cells/server_host.py)."""

    def __init__(self, agent: Any) -> None:
        self.agent = agent
        self.pulled: torch.Tensor | None = None
        """Registered staging buffer for flat weights pulled from the core (kept for the next pull)."""
        self.pulled_version = -1

    def pull_buffer(self, nbytes: int) -> torch.Tensor:
        """The registered staging buffer for a pull of `nbytes` (fp32), made (or remade) to fit."""
        if nbytes % 4:
            raise WeightLayoutError(f"a flat fp32 weight buffer cannot be {nbytes} bytes")
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
        return host_sha256(self.pulled)



class RolloutHost(PullStaging):
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
        sessions: RecentSessions,
    ) -> None:
        super().__init__(agent)
        self.sessions = sessions
        self.model_dir = model_dir
        self.engine_config = engine_config
        self.host = host
        self.port = port
        """Port to bind; after the first start, the port it got (reused so a cell keeps its URL if it can)."""
        self.shutdown_timeout_s = shutdown_timeout_s
        self._offload = offload
        self.async_engine: AsyncEngine | None = None
        self._runner: web.AppRunner | None = None
        self.url = ""
        self.last_weight_update_path = "memory"
        """How the last weight update reached the engine: in memory, for an engine in this process."""
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
            await self.async_engine.load_weights(await self._offload(as_state_dict, weights), version)
        await self.async_engine.continue_generation()
        app = build_engine_app(self.async_engine, self.agent, model_path=self.model_dir)
        app.middlewares.append(self.sessions.middleware())
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

    async def live_sequences(self) -> tuple[tuple[int, ...], ...]:
        """Prompt + output so far of every generation in the engine (after `pause_in_place`: what the KV migrator
        should move, partial outputs included)."""
        assert self.async_engine is not None
        sequences = await self.async_engine.call(lambda engine: engine.live_sequences())
        return tuple(sequences[rid] for rid in sorted(sequences))

    async def shutdown(self) -> int:
        """Abort what is in flight, stop the server (aborting late arrivals until it is down), release the engine's
        memory. Returns the number of requests aborted at the first abort."""
        assert self.async_engine is not None
        engine = self.async_engine
        aborted = await engine.abort_all()
        runner, self._runner = self._runner, None
        self.url = ""
        self.sessions.clear()  # placed elsewhere by the migrator, or re-prefilled elsewhere
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

    async def load_weights(self, weights: Mapping[str, torch.Tensor] | HFBuckets, version: int) -> None:
        """Swap weights between two steps: pause in place, load, continue. In-flight requests keep their tokens
        and version tags; tokens generated afterwards carry `version`. (HFBuckets are made whole first: an
        in-process engine holds the whole model anyway.)"""
        assert self.async_engine is not None
        weights = await self._offload(as_state_dict, weights)

        def swap(engine: EmbeddedEngine) -> None:
            was_paused = engine.paused
            engine.pause("in_place")
            engine.load_weights(weights, version)
            if not was_paused:
                engine.continue_generation()

        await self.async_engine.call(swap)

class EngineWeights:
    """The newest weights for a cell's engine, as a Hugging Face state dict (`newest`): what the engine loads at a
    start or switch and, in the rollout role, after every publication (the cell runs that loop and loads).

    The core reads them straight from its own trainer (`trainer`, under the compute lock). A satellite pulls the
    flat buffer from the core into the engine's registered staging buffer (a clean copy, see
    actors/cells/weight_pull.py) and converts it to Hugging Face names. Explicit inputs, no cell: what a pulled
    version means for the cell (the newest it has heard of) is the cell's business, with the version returned.
    """

    def __init__(
        self, rollout: RolloutHost, *, spec: ModelSpec, puller: WeightPuller, agent: Any, fence_scratch: torch.Tensor,
        compute_lock: asyncio.Lock, offload: Offload, trainer: TrainerHost | None = None,
    ) -> None:
        self.rollout = rollout
        self.spec = spec
        self.puller = puller
        self.agent = agent
        self.fence_scratch = fence_scratch
        """The cell's registered int64 scratch word the fence is read into."""
        self.compute_lock = compute_lock
        self.offload = offload
        self.trainer = trainer
        """The core's trainer host (the core always has one); None on a satellite."""
        self.publish_bucket_bytes = PUBLISH_BUCKET_BYTES
        """A sharded core trainer's publishing bucket bound (fp32 bytes; whole decoder layers)."""

    async def newest(self) -> tuple[dict[str, torch.Tensor] | None, int]:
        """The newest weights as an HF state dict and their version; (None, version held) when there is nothing
        newer than what the engine holds. Raises WeightsUnavailable."""
        rollout = self.rollout
        if self.trainer is not None:
            async with self.compute_lock:
                trainer = self.trainer.trainer
                if isinstance(trainer, TrainerGroup):
                    # Sharded: each rank copies its shard now (no step runs under the lock), and the engine host
                    # gathers the copy bucket by bucket as it writes or broadcasts it (engines/weight_buckets.py).
                    return await self.offload(trainer.publication, self.publish_bucket_bytes), self.trainer.version
                weights = await self.offload(trainer.hf_state_dict)
                return weights, self.trainer.version

        async def pull_into_staging(source: WeightSource) -> None:
            buffer = rollout.pull_buffer(source.nbytes)
            rollout.pulled_version = -1
            await self.offload(pull_weights, self.agent, source, buffer, self.fence_scratch)
            rollout.pulled_version = source.version

        source = await self.puller.pull(lambda: rollout.weight_version, pull_into_staging)
        if source is None:
            return None, rollout.weight_version
        assert rollout.pulled is not None
        return await self.offload(flat_to_hf, rollout.pulled, source, self.spec), source.version


@attrs.define
class _Peer:
    role: str
    engine_url: str
    draining: bool


class PeerView:
    """What a cell knows of the other cells from their announcements: role, URL, whether they drain."""

    def __init__(self, me: str, max_cells: int = 4096) -> None:
        self.me = me
        self.max_cells = max_cells
        self.cells: dict[str, _Peer] = {}

    def _update(self, cell: str, role: str | None = None, url: str | None = None,
                draining: bool | None = None) -> None:
        if cell == self.me:
            return
        peer = self.cells.get(cell)
        if peer is None:
            if len(self.cells) >= self.max_cells:
                return
            peer = self.cells[cell] = _Peer("", "", False)
        if role is not None:
            peer.role = role
        if url is not None:
            peer.engine_url = url
        if draining is not None:
            peer.draining = draining

    def on_role_changed(self, msg: RoleChanged) -> None:
        self._update(msg.cell, msg.role, msg.engine_url, draining=False)

    def on_load(self, msg: LoadReport) -> None:
        self._update(msg.cell, msg.role, msg.engine_url)

    def on_draining(self, msg: CellDraining) -> None:
        self._update(msg.cell, draining=True)

    def rollout_targets(self) -> dict[str, str]:
        """Cell -> URL of every other cell that serves rollouts now and is not draining."""
        return {name: p.engine_url for name, p in sorted(self.cells.items())
                if p.role == ROLLOUT and p.engine_url and not p.draining}
