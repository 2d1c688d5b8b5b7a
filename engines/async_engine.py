"""Drive an `EmbeddedEngine` from asyncio without blocking the event loop.

One worker thread owns the engine: it runs queued control calls between steps, then one `step()` while there is
work, and hands results back to the loop with `call_soon_threadsafe`. Serialising every engine call on that thread
is what makes the engine's single-threaded state machine safe, and a control call (abort, pause, weight load) lands
exactly at a token boundary.

A request awaited whole (`generate`) gets only its finished event: the worker drops its per-token events, and a
step whose events are all such is not handed to the loop at all. Waking the loop, a queue and the waiting coroutine
for every token of every request cost the engine server's loop ~0.4 CPU-ms a request of 24 tokens, and the worker
a write to the loop's wake-up pipe every step (BENCHMARKS.md, session 26). `stream` still sees every event.

Failure model: a control call's exception goes back to its caller only. An exception inside `step()` breaks the
engine: every pending request and queued call fails with `EngineFailed` naming the cause, and later calls fail at
once. `close()` stops the thread; calls after it raise `EngineClosed`.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from typing import Any, AsyncIterator, Callable, Iterable, Mapping, Sequence, TypeVar

import structlog
import torch

from gyre.engines.embedded_engine import (
    EmbeddedEngine,
    EngineStats,
    ExportedPrefix,
    GenerateOutput,
    KVLayout,
    SamplingParams,
    StepEvent,
)
from gyre.engines.errors import EngineClosed, EngineFailed, RequestError

log = structlog.get_logger(__name__)

T = TypeVar("T")


class AsyncEngine:
    """Awaitable face of an `EmbeddedEngine`; see the module docstring."""

    def __init__(self, engine: EmbeddedEngine) -> None:
        self.engine = engine
        self._cond = threading.Condition()
        self._commands: list[tuple[Callable[[EmbeddedEngine], Any], asyncio.Future]] = []
        self._streams: dict[str, asyncio.Queue] = {}
        self._whole: set[str] = set()
        """Rids awaited whole (`generate`): the worker passes on only their finished events. Added before the
        request is submitted and discarded after it ends, on the loop; the worker only tests membership."""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._failure: BaseException | None = None
        self._closing = False

    # ---- lifecycle ----------------------------------------------------------------------------------------

    def _ensure_started(self) -> None:
        if self._closing:
            raise EngineClosed("the engine is closed")
        if self._failure is not None:
            raise self._failure
        if self._thread is None:
            self._loop = asyncio.get_running_loop()
            self._thread = threading.Thread(target=self._run, name="gyre-engine", daemon=True)
            self._thread.start()
        elif asyncio.get_running_loop() is not self._loop:
            raise RuntimeError("an AsyncEngine serves the event loop that first used it")

    async def close(self) -> None:
        """Stop the worker thread after the call in progress; pending requests fail with EngineClosed."""
        if self._closing:
            return
        with self._cond:
            self._closing = True
            self._cond.notify()
        if self._thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join)
        closed = EngineClosed("the engine was closed")
        with self._cond:
            stranded, self._commands = self._commands, []
        for _, future in stranded:
            if not future.done():
                future.set_exception(closed)
        self._fail_all(closed)

    @property
    def failure(self) -> BaseException | None:
        """The error that broke the engine, if one did."""
        return self._failure

    # ---- worker thread ------------------------------------------------------------------------------------

    def _run(self) -> None:
        engine = self.engine
        if engine.config.num_threads is not None:
            torch.set_num_threads(engine.config.num_threads)  # OpenMP settings can be per thread: set it here too
        while True:
            with self._cond:
                while not self._commands and not self._closing and not engine.has_work():
                    self._cond.wait()
                commands, self._commands = self._commands, []
                closing = self._closing
            for fn, future in commands:
                try:
                    result = fn(engine)
                except BaseException as error:  # goes back to the caller, the engine stays usable
                    self._resolve(future, error=error)
                else:
                    self._resolve(future, result=result)
            if closing:
                return
            if engine.has_work():
                try:
                    events = engine.step()
                except BaseException as error:
                    log.exception("engine_step_failed")
                    failure = EngineFailed(f"engine step failed: {type(error).__name__}: {error}")
                    failure.__cause__ = error
                    self._failure = failure
                    self._post(self._fail_all, failure)
                    with self._cond:
                        late, self._commands = self._commands, []
                    for _, future in late:
                        self._resolve(future, error=failure)
                    return
                whole = self._whole
                if whole:
                    events = [event for event in events if event.finished is not None or event.rid not in whole]
                if events:
                    self._post(self._dispatch, events)

    def _post(self, fn: Callable[..., None], *args: Any) -> None:
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: nobody is left to tell
            pass

    def _resolve(self, future: asyncio.Future, result: Any = None, error: BaseException | None = None) -> None:
        def settle() -> None:
            if future.done():
                return
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(result)

        self._post(settle)

    # ---- loop side ----------------------------------------------------------------------------------------

    def _dispatch(self, events: list[StepEvent]) -> None:
        for event in events:
            queue = self._streams.get(event.rid)
            if queue is not None:
                queue.put_nowait(event)

    def _fail_all(self, error: BaseException) -> None:
        for queue in self._streams.values():
            queue.put_nowait(error)

    async def call(self, fn: Callable[[EmbeddedEngine], T]) -> T:
        """Run `fn(engine)` on the worker thread between two steps and return its result."""
        self._ensure_started()
        future: asyncio.Future = asyncio.get_running_loop().create_future()
        with self._cond:
            if self._failure is not None:
                raise self._failure
            self._commands.append((fn, future))
            self._cond.notify()
        return await future

    def stream(
        self,
        rid: str | None,
        input_ids: Sequence[int],
        params: SamplingParams = SamplingParams(),
        return_logprob: bool = True,
    ) -> AsyncIterator[StepEvent]:
        """Submit a request and yield its events as steps produce them; the last one has `finished` set.

        Leaving the iteration early (break, cancellation, a client gone) aborts the request.
        """
        return self._events(rid, input_ids, params, return_logprob, whole=False)

    async def _events(
        self, rid: str | None, input_ids: Sequence[int], params: SamplingParams, return_logprob: bool, whole: bool,
    ) -> AsyncIterator[StepEvent]:
        """`stream`; with `whole`, only the finished event comes (the module docstring)."""
        self._ensure_started()
        rid = rid or uuid.uuid4().hex
        if rid in self._streams:
            raise RequestError(f"request {rid!r} is already in flight")
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[rid] = queue
        if whole:
            self._whole.add(rid)
        finished = False
        try:
            ids = list(input_ids)
            await self.call(lambda engine: engine.submit(rid, ids, params, return_logprob))
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    finished = True  # nothing left to abort
                    raise item
                if item.finished is not None:
                    finished = True
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(rid, None)
            self._whole.discard(rid)
            if not finished and self._failure is None and not self._closing:
                self._abort_nowait(rid)

    def _abort_nowait(self, rid: str) -> None:
        loop = self._loop
        assert loop is not None
        future = loop.create_future()
        future.add_done_callback(lambda f: f.exception())  # nobody awaits it: do not warn
        with self._cond:
            self._commands.append((lambda engine: engine.abort(rid), future))
            self._cond.notify()

    async def generate(
        self,
        rid: str | None,
        input_ids: Sequence[int],
        params: SamplingParams = SamplingParams(),
        return_logprob: bool = True,
    ) -> GenerateOutput:
        """Submit a request and wait for its result (cancelling the wait aborts the request)."""
        async for event in self._events(rid, input_ids, params, return_logprob, whole=True):
            if event.finished is not None:
                return event.finished
        raise AssertionError("stream ended without a finished event")

    # ---- control wrappers ---------------------------------------------------------------------------------

    async def abort(self, rid: str) -> bool:
        return await self.call(lambda engine: engine.abort(rid))

    async def abort_all(self) -> int:
        return await self.call(lambda engine: engine.abort_all())

    async def pause(self, mode: str = "abort") -> int:
        return await self.call(lambda engine: engine.pause(mode))

    async def continue_generation(self) -> None:
        await self.call(lambda engine: engine.continue_generation())

    async def load_weights(self, hf_state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        await self.call(lambda engine: engine.load_weights(hf_state_dict, version))

    async def load_weights_from_disk(self, model_dir: str, version: int) -> None:
        await self.call(lambda engine: engine.load_weights_from_disk(model_dir, version))

    async def flush_cache(self) -> bool:
        return await self.call(lambda engine: engine.flush_cache())

    async def release_memory(self, tags: Iterable[str] | None = None) -> None:
        await self.call(lambda engine: engine.release_memory(tags))

    async def resume_memory(self, tags: Iterable[str] | None = None) -> None:
        await self.call(lambda engine: engine.resume_memory(tags))

    async def prompt_logprobs(self, token_ids: Sequence[int]) -> list[float]:
        return await self.call(lambda engine: engine.prompt_logprobs(token_ids))

    async def export_prefix(self, token_ids: Sequence[int]) -> ExportedPrefix:
        return await self.call(lambda engine: engine.export_prefix(token_ids))

    async def release_export(self, handle: str) -> None:
        await self.call(lambda engine: engine.release_export(handle))

    async def import_prefix(self, token_ids: Sequence[int], fill: Callable[[list[int]], None]) -> int:
        """`fill` runs on the worker thread (it may block, e.g. on a Mooncake read)."""
        return await self.call(lambda engine: engine.import_prefix(token_ids, fill))

    async def kv_layout(self) -> KVLayout:
        return await self.call(lambda engine: engine.kv_layout())

    async def stats(self) -> EngineStats:
        return await self.call(lambda engine: engine.stats())
