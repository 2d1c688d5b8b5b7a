"""Routing: the proxy's view of the cells and the `RoutedBackend` that sends every generation to one of them.

The view is built from what the cells publish (RoleChanged, LoadReport, CellDraining, SessionPlaced), which the
proxy actor's handlers pass in; the routing policy (gyre.policies.routing) picks a cell from it for each generation.
A session sticks to the cell that holds its prefix. The backend waits (bounded) while no cell accepts a session's
call or while a migrating session waits for its placement, and resumes a generation that its cell aborted (prompt
+ partial output, same seed, the remaining budget) on the session's new cell; see proxy.py for the switch as a
whole. It reaches the engines through `backends.engine_generate` and an `SGLangClient` per cell.
"""

from __future__ import annotations

import asyncio
import hashlib
from array import array
from collections import Counter, OrderedDict
from typing import Any, Callable

import attrs
import structlog

from gyre.actors.serving.backends import (
    BackendRejected,
    BackendRequest,
    BackendResult,
    BackendUnavailable,
    OnOutput,
    StreamProgress,
    engine_generate,
)
from gyre.engines.sglang_client import ClientConfig, EngineUnreachable, RequestRejected, ServerError, SGLangError
from gyre.messages.cells import ROLLOUT, LoadReport, RoleChanged
from gyre.policies.routing import CellView, RoutingPolicy, StickyLeastLoaded, checked_choice
from gyre.runtime.errors import ConfigError
from gyre.runtime.validators import count

__all__ = ["RoutingConfig", "RoutedBackend", "RouterStatistics", "call_seed"]

log = structlog.get_logger(__name__)


@attrs.frozen
class RoutingConfig:
    """How the backend routes, waits and resumes."""

    policy: RoutingPolicy = attrs.field(factory=StickyLeastLoaded)
    """Chooses the cell of each call (see gyre.policies.routing)."""
    max_sessions: int = attrs.field(default=65536, validator=count)
    """Sessions whose placement and latest ids are remembered; the least recently used idle ones go first."""
    no_cell_wait_s: float = 300.0
    """How long a call waits for a cell that accepts it before it gets 503."""
    placement_wait_s: float = 60.0
    """How long a migrating session's call waits for the migrator's SessionPlaced before it re-prefills elsewhere."""
    resume_grace_s: float = 2.0
    """After an abort, how long to wait for the view to say why (the cell drains, the session is placed) before
    routing again; an abort for another reason (a weight update) resumes on the same cell after this. Also how long
    a call of a session on a draining cell waits for the migrator to claim the session before going elsewhere."""
    max_resumes: int = 8
    """Resubmissions of one call at most; beyond, the call ends as aborted (503, the SDK retries)."""
    unreachable_backoff_s: float = 5.0
    """After a cell's engine refuses a connection or answers 5xx (but 503, which says busy or released, not broken),
    how long no new generation is sent to it (the calls it held resume elsewhere at once). Long enough to skip a
    dead server for several calls, short enough that a server that restarts at the same URL is used again without
    anyone telling the proxy."""
    client: ClientConfig = ClientConfig()
    """Deadlines of the engine clients."""

    def __attrs_post_init__(self) -> None:
        for name in ("no_cell_wait_s", "placement_wait_s", "resume_grace_s", "unreachable_backoff_s"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0")
        if self.max_resumes < 0:
            raise ConfigError(f"max_resumes must be >= 0, got {self.max_resumes}")


@attrs.define(eq=False)
class _Cell:
    name: str
    role: str = ""
    draining: bool = False
    engine_url: str = ""
    client: Any = None
    in_flight: int = 0
    queued_requests: int = 0
    capacity_requests: int = 0
    free_kv_blocks: int = 0
    total_kv_blocks: int = 0
    failed: str = ""
    """Why the cell's engine server is gone (EngineServerFailed, or `gyre serve`'s health watch); "" while it
    serves. Cleared when the cell is in the rollout role again (RoleChanged) or `cell_recovered`."""
    unreachable_until_s: float = 0.0
    """Loop time before which no new generation goes here: its engine just refused a connection or answered 5xx."""

    def usable(self, now_s: float) -> bool:
        """Whether the engine can take generations now (whatever the role)."""
        return (self.client is not None and bool(self.engine_url) and not self.failed
                and now_s >= self.unreachable_until_s)

    def accepts_new_calls(self, now_s: float) -> bool:
        return self.role == ROLLOUT and not self.draining and self.usable(now_s)


@attrs.define(eq=False)
class _Route:
    key: str
    execution_id: str
    cell: str | None = None
    ids: array = attrs.field(factory=lambda: array("q"))
    """Latest prompt + output, as a compact array (a tuple of Python ints costs ~9x the memory)."""
    in_flight: int = 0
    migrating: bool = False
    revoked: bool = False
    submissions: dict[str, str] = attrs.field(factory=dict)
    """rid -> cell of the generations in flight now."""


def call_seed(rid: str) -> int:
    """The sampling seed of a call that brought none: a stable function of its rid, in [0, 2**63)."""
    return int.from_bytes(hashlib.blake2b(rid.encode(), digest_size=8).digest(), "big") >> 1


@attrs.frozen
class RouterStatistics:
    """The routed backend's counters (part of the proxy's ProxyStatistics)."""

    resumed_generations: int
    """Generations aborted on one cell and continued (prompt + partial output) on another or the same cell."""
    resumed_prompt_tokens: int
    """Prompt tokens (prompt + partial output) of resubmitted generations that came back."""
    resumed_cached_tokens: int
    """Of those, tokens the new cell served from its cache (the migrated KV, when the migration moved it)."""
    waits_for_cell: int
    """Calls that had to wait for a rollout cell or for a migrating session's placement."""
    sessions: int
    """Sessions routed (and whose prefix is remembered)."""
    sessions_by_cell: dict[str, int]
    """Cell name -> sessions placed on it."""
    engines_unreachable: int = 0
    """Times a cell's engine refused a connection or answered 5xx (each starts a backoff; see RoutingConfig)."""
    failed_cells: tuple[str, ...] = ()
    """Cells whose engine server is gone now (cell_failed, not yet recovered)."""


class RoutedBackend:
    """A GenerateBackend over the cells the proxy knows, routed by a RoutingPolicy; it resumes aborted generations.

    Its view is changed only by the owning actor's handlers (`role_changed`, `load_report`, `cell_draining`,
    `session_placed`, `forget_execution`); everything runs on one event loop, so no locks.
    """

    def __init__(self, config: RoutingConfig, make_client: Callable[[str], Any],
                 on_waiting_for_cell: Callable[[int], None] | None = None) -> None:
        self.config = config
        self._make_client = make_client
        self._on_waiting_for_cell = on_waiting_for_cell
        """Told the number of calls waiting for a rollout cell each time it changes."""
        self._waiting_for_cell = 0
        self._cells: dict[str, _Cell] = {}
        self._routes: OrderedDict[str, _Route] = OrderedDict()
        self._by_execution: dict[str, set[str]] = {}
        self._placed: Counter[str] = Counter()
        self._changed = asyncio.Event()
        self._background: set[asyncio.Task] = set()
        self._resumed = 0
        self._resumed_prompt_tokens = 0
        self._resumed_cached_tokens = 0
        self._waits = 0
        self._unreachable_count = 0
        self._stopping = False

    # ---- the view (actor handlers) ---------------------------------------------------------------------------

    def _notify(self) -> None:
        """Wake every call waiting for the view to change (they re-check their condition)."""
        self._changed.set()
        self._changed = asyncio.Event()

    def _cell(self, name: str) -> _Cell:
        cell = self._cells.get(name)
        if cell is None:
            cell = self._cells[name] = _Cell(name)
        return cell

    def _set_url(self, cell: _Cell, url: str) -> None:
        if url and url != cell.engine_url:
            cell.engine_url = url
            cell.client = self._make_client(url)

    def role_changed(self, msg: RoleChanged) -> None:
        cell = self._cell(msg.cell)
        cell.role = msg.role
        if msg.role == ROLLOUT:
            cell.draining = False
            cell.failed = ""
            cell.unreachable_until_s = 0.0
            self._set_url(cell, msg.engine_url)
        else:
            # The switch is over: a migration that left a session unplaced will not place it any more.
            for route in self._routes.values():
                if route.cell == cell.name:
                    route.migrating = False
        self._notify()

    def load_report(self, msg: LoadReport) -> None:
        cell = self._cell(msg.cell)
        cell.role = msg.role  # draining is cleared only by a RoleChanged back to rollout
        self._set_url(cell, msg.engine_url)
        cell.queued_requests = msg.running_requests + msg.waiting_requests
        cell.capacity_requests = msg.capacity_requests
        cell.free_kv_blocks = msg.free_kv_blocks
        cell.total_kv_blocks = msg.total_kv_blocks
        self._notify()

    def cell_draining(self, name: str) -> None:
        self._cell(name).draining = True
        self._notify()

    def cell_failed(self, name: str, reason: str) -> None:
        """The cell's engine server is gone (it died, or never started): route nothing to it until it is a rollout
        cell again (RoleChanged) or `cell_recovered`. Its sessions re-prefill on the cells that take them, and the
        generations it held resume there (they fail with EngineUnreachable and come back through `_generate`)."""
        cell = self._cell(name)
        cell.failed = reason or "failed"
        self._notify()

    def cell_recovered(self, name: str) -> None:
        """The cell's engine server answers again (`gyre serve`'s health watch)."""
        cell = self._cell(name)
        cell.failed = ""
        cell.unreachable_until_s = 0.0
        self._notify()

    def session_placed(self, session: str, cell: str) -> bool:
        """Route `session` to `cell` from now on. False when the session is unknown (revoked or forgotten)."""
        route = self._routes.get(session)
        if route is None:
            return False
        route.migrating = False
        self._place(route, cell)
        self._notify()
        return True

    def sessions_on(self, cell: str) -> dict[str, tuple[int, ...]]:
        """Sessions placed on `cell` with their latest ids; marks them migrating (see the module doc)."""
        found: dict[str, tuple[int, ...]] = {}
        for route in self._routes.values():
            if route.cell == cell:
                route.migrating = True
                found[route.key] = tuple(route.ids)
        if found:
            self._notify()  # calls waiting for the migration to begin now wait for the placement
        return found

    def forget_execution(self, execution_id: str) -> int:
        """Drop an ended execution's sessions and abort its generations in flight; returns how many were aborted."""
        aborted = 0
        for key in self._by_execution.pop(execution_id, set()):
            route = self._routes.pop(key, None)
            if route is None:
                continue
            route.revoked = True
            if route.cell is not None:
                self._placed[route.cell] -= 1
            for rid, cell_name in list(route.submissions.items()):
                cell = self._cells.get(cell_name)
                if cell is not None and cell.client is not None:
                    self._abort_soon(cell, rid)
                    aborted += 1
        self._notify()
        return aborted

    def views(self) -> tuple[CellView, ...]:
        """What the routing policy sees; a cell whose engine is failed or just unreachable shows no engine."""
        now_s = asyncio.get_running_loop().time()
        return tuple(
            CellView(
                name=cell.name,
                role=cell.role,
                draining=cell.draining,
                engine_url=cell.engine_url if cell.usable(now_s) else "",
                sessions=self._placed[cell.name],
                in_flight=cell.in_flight,
                queued_requests=cell.queued_requests,
                capacity_requests=cell.capacity_requests,
                free_kv_blocks=cell.free_kv_blocks,
                total_kv_blocks=cell.total_kv_blocks,
            )
            for cell in sorted(self._cells.values(), key=lambda c: c.name)
        )

    def statistics(self) -> RouterStatistics:
        return RouterStatistics(
            resumed_generations=self._resumed,
            resumed_prompt_tokens=self._resumed_prompt_tokens,
            resumed_cached_tokens=self._resumed_cached_tokens,
            waits_for_cell=self._waits,
            sessions=len(self._routes),
            sessions_by_cell={name: count for name, count in sorted(self._placed.items()) if count > 0},
            engines_unreachable=self._unreachable_count,
            failed_cells=tuple(sorted(name for name, cell in self._cells.items() if cell.failed)),
        )

    # ---- sessions --------------------------------------------------------------------------------------------

    def _place(self, route: _Route, cell: str) -> None:
        if route.cell == cell:
            return
        if route.cell is not None:
            self._placed[route.cell] -= 1
        route.cell = cell
        self._placed[cell] += 1

    def _route_for(self, request: BackendRequest) -> _Route:
        route = self._routes.get(request.session_key)
        if route is None:
            route = _Route(request.session_key, request.execution_id)
            self._routes[route.key] = route
            self._by_execution.setdefault(request.execution_id, set()).add(route.key)
            self._evict()
        else:
            self._routes.move_to_end(route.key)
        return route

    def _evict(self) -> None:
        excess = len(self._routes) - self.config.max_sessions
        for key in list(self._routes):
            if excess <= 0:
                break
            route = self._routes[key]
            if route.in_flight:
                continue
            del self._routes[key]
            keys = self._by_execution.get(route.execution_id)
            if keys is not None:
                keys.discard(key)
                if not keys:
                    del self._by_execution[route.execution_id]
            if route.cell is not None:
                self._placed[route.cell] -= 1
            excess -= 1

    # ---- waiting ---------------------------------------------------------------------------------------------

    async def _wait_change(self, deadline: float) -> None:
        """Until the view changes or the loop clock reaches `deadline`."""
        remaining = deadline - asyncio.get_running_loop().time()
        if remaining <= 0:
            return
        try:
            await asyncio.wait_for(self._changed.wait(), remaining)
        except asyncio.TimeoutError:
            pass

    async def _choose(self, route: _Route) -> _Cell:
        """The cell for the route's next generation, waiting (bounded) while none may take it."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        waited = waiting_for_cell = False
        try:
            while True:
                if self._stopping:
                    raise BackendUnavailable("the proxy is stopping")
                holder = self._cells.get(route.cell) if route.cell is not None else None
                if route.migrating and holder is not None and holder.draining and holder.role == ROLLOUT:
                    if loop.time() - started < self.config.placement_wait_s:
                        waited = True
                        await self._wait_change(started + self.config.placement_wait_s)
                        continue
                    log.warning("no_placement_came_for_a_migrating_session", session=route.key, cell=holder.name)
                    route.migrating = False
                if (not route.migrating and holder is not None and holder.draining and holder.role == ROLLOUT
                        and loop.time() - started < self.config.resume_grace_s):
                    # The holder drains but the migrator has not asked for its sessions yet (the cell pauses first):
                    # wait for that ask, or the switch's end, rather than re-prefill the session elsewhere.
                    waited = True
                    await self._wait_change(started + self.config.resume_grace_s)
                    continue
                choice = checked_choice(self.config.policy, route.key, route.cell, self.views())
                if choice is None:
                    if loop.time() - started >= self.config.no_cell_wait_s:
                        raise BackendUnavailable(f"no rollout cell accepted calls for {self.config.no_cell_wait_s} s")
                    waited = True
                    if not waiting_for_cell:
                        waiting_for_cell = True
                        self._count_waiting_for_cell(+1)
                    await self._wait_change(started + self.config.no_cell_wait_s)
                    continue
                cell = self._cells[choice]
                assert cell.client is not None, "views() shows cells without a client as having no engine"
                self._place(route, choice)
                return cell
        finally:
            if waited:
                self._waits += 1
            if waiting_for_cell:
                self._count_waiting_for_cell(-1)

    def _count_waiting_for_cell(self, change: int) -> None:
        self._waiting_for_cell += change
        if self._on_waiting_for_cell is not None:
            self._on_waiting_for_cell(self._waiting_for_cell)

    @property
    def calls_waiting_for_cell(self) -> int:
        """Calls waiting now because no rollout cell accepts them (not those waiting for a migration)."""
        return self._waiting_for_cell

    async def _after_abort(self, route: _Route, cell: _Cell) -> None:
        """Give the view a moment to explain an abort (the cell drains; the migrator places the session)."""
        deadline = asyncio.get_running_loop().time() + self.config.resume_grace_s
        loop = asyncio.get_running_loop()
        while (cell.accepts_new_calls(loop.time()) and route.cell == cell.name and not route.revoked
               and not self._stopping):
            if loop.time() >= deadline:
                return
            await self._wait_change(deadline)

    def _unreachable(self, cell: _Cell, error: SGLangError) -> None:
        """Send no new generation to `cell` for `unreachable_backoff_s` (counted; see RoutingConfig)."""
        now_s = asyncio.get_running_loop().time()
        if now_s >= cell.unreachable_until_s:
            self._unreachable_count += 1
            log.warning("engine_unreachable", cell=cell.name, url=cell.engine_url, error=str(error),
                        backoff_s=self.config.unreachable_backoff_s)
        cell.unreachable_until_s = now_s + self.config.unreachable_backoff_s
        self._notify()

    def _abort_soon(self, cell: _Cell, rid: str) -> None:
        """Best effort: tell the engine to stop a generation nobody will read."""

        async def abort() -> None:
            try:
                await cell.client.abort(rid)
            except SGLangError as error:
                log.info("abort_failed", cell=cell.name, rid=rid, error=str(error))

        task = asyncio.ensure_future(abort())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def stop_accepting(self) -> None:
        """From now on, calls that wait for a cell or would resume an aborted generation fail at once (503)
        instead of waiting: at shutdown the engines stop too, and a call retrying a gone engine would hold the
        proxy's HTTP server open until the launcher kills the process. Generations under way may still finish."""
        self._stopping = True
        self._notify()

    async def close(self) -> None:
        for task in list(self._background):
            task.cancel()
        for task in list(self._background):
            try:
                await task
            except (asyncio.CancelledError, Exception):
                pass

    # ---- GenerateBackend -------------------------------------------------------------------------------------

    async def generate(self, request: BackendRequest) -> BackendResult:
        return await self.generate_streaming(request, None)

    async def generate_streaming(self, request: BackendRequest, on_output: OnOutput | None) -> BackendResult:
        """`generate`, passing output ids to `on_output` as they come. A resubmitted call continues after the
        ids already passed on (prompt + output so far), so none is passed twice; a stream that breaks off keeps
        what it delivered and resumes from it like an aborted generation."""
        route = self._route_for(request)
        route.ids = array("q", request.prompt_ids)
        route.in_flight += 1
        try:
            return await self._generate(route, request, on_output)
        finally:
            route.in_flight -= 1

    async def _generate(self, route: _Route, request: BackendRequest, on_output: OnOutput | None) -> BackendResult:
        params = dict(request.sampling_params)
        if params.get("sampling_seed") is None:
            # Pin the seed the engine would pick for itself: a resubmission after an abort must sample with the
            # same one to continue with the same tokens (see the module doc).
            params["sampling_seed"] = call_seed(request.rid)
        budget = int(params.get("max_new_tokens", 128))
        out_ids: list[int] = []
        out_logprobs: list[float] = []
        out_versions: list[int] = []
        cached_tokens: int | None = None
        attempt = 0
        while True:
            cell = await self._choose(route)
            params["max_new_tokens"] = budget - len(out_ids)
            rid = request.rid if attempt == 0 else f"{request.rid}#resume{attempt}"
            route.submissions[rid] = cell.name
            cell.in_flight += 1
            result: BackendResult | None = None
            failure: SGLangError | None = None
            progress = StreamProgress() if on_output is not None else None
            try:
                prompt_ids = request.prompt_ids + tuple(out_ids)
                result = await engine_generate(cell.client, cell.name, prompt_ids, params, rid, on_output, progress)
            except RequestRejected as error:
                raise BackendRejected(error.message) from None
            except (EngineUnreachable, ServerError) as error:
                failure = error  # the cell went away or failed this request: like an abort, try again
                if error.status != 503:  # 503 is busy or released (a full queue, a drain): not broken, not skipped
                    self._unreachable(cell, error)
                if progress is not None and progress.output_ids:
                    result = progress.partial_result(cell.name)  # already streamed to the agent: keep it
            except SGLangError as error:
                raise BackendUnavailable(f"cell {cell.name}: {error}") from None
            except BaseException:  # cancelled, or the streaming consumer gave up (client gone)
                self._abort_soon(cell, rid)
                raise
            finally:
                cell.in_flight -= 1
                route.submissions.pop(rid, None)

            if result is not None:
                if attempt:
                    self._resumed_prompt_tokens += len(request.prompt_ids) + len(out_ids)
                    self._resumed_cached_tokens += result.cached_tokens
                out_ids.extend(result.output_ids)
                out_logprobs.extend(result.output_logprobs)
                out_versions.extend(result.output_versions)
                if cached_tokens is None:
                    cached_tokens = result.cached_tokens
                finish = result.finish_reason
                if finish == "abort" and len(out_ids) >= budget:
                    finish = "length"
                if finish != "abort":
                    route.ids = array("q", request.prompt_ids)
                    route.ids.extend(out_ids)
                    return BackendResult(
                        output_ids=tuple(out_ids),
                        output_logprobs=tuple(out_logprobs),
                        output_versions=tuple(out_versions),
                        finish_reason=finish,
                        cached_tokens=cached_tokens,
                        cell=cell.name,
                        matched_stop=result.matched_stop,
                    )
                # The engine cached what it computed before the abort: that is the session's prefix now.
                route.ids = array("q", request.prompt_ids)
                route.ids.extend(out_ids)
            attempt += 1
            if route.revoked or self._stopping or attempt > self.config.max_resumes:
                if result is None:
                    reason = "the proxy is stopping" if self._stopping else failure
                    raise BackendUnavailable(f"cell {cell.name}: {reason}")
                log.warning(
                    "generation_aborted_for_good",
                    rid=request.rid,
                    attempts=attempt,
                    revoked=route.revoked,
                    stopping=self._stopping,
                )
                return BackendResult(
                    output_ids=tuple(out_ids),
                    output_logprobs=tuple(out_logprobs),
                    output_versions=tuple(out_versions),
                    finish_reason="abort",
                    cached_tokens=cached_tokens or 0,
                    cell=cell.name,
                )
            self._resumed += 1
            log.info(
                "resuming_generation",
                rid=request.rid,
                cell=cell.name,
                generated=len(out_ids),
                reason="abort" if failure is None else str(failure),
            )
            await self._after_abort(route, cell)
