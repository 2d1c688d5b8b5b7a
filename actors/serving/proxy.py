"""The proxy actor: the agents' HTTP face on the bus, routing every call to a rollout cell's engine.

It hosts the OpenAI/Anthropic application (`build_proxy_app`) on its own event loop and answers it through a
`RoutedBackend`, which keeps the proxy's view of the cells (from RoleChanged, LoadReport, CellDraining and
SessionPlaced) and asks the routing policy where each call goes. Every finished call becomes a ModelCallCompleted
that the actor sends to itself and publishes from its handler, so the publication is caused by a message in its
own inbox (recorded, replayable) rather than by an HTTP request the log never saw.

Role switches, seen from here (the cell drives them; see actors/cells/kv_migrator.py):
1. CellDraining(cell): no new calls go there.
2. The migrator asks SessionsOnCell(cell): the proxy answers each session's latest ids and marks the sessions as
   migrating, so that their next calls wait (up to `placement_wait_s`) for the SessionPlaced that says where the
   KV went, instead of re-prefilling on whichever cell is least loaded.
3. The cell aborts its in-flight generations (after the migration, with generation paused in place; the migrator
   moved the KV of prompt + partial output, see actors/cells/kv_migrator.py): each comes back with finish_reason "abort"
   and its partial output, and the backend resubmits prompt + partial output to the session's new cell (which finds
   it cached) with the remaining token budget and the same seed, then concatenates ids, log-probs and versions: the
   partial tokens keep the log-probs and version tags they were generated with. The agent's HTTP call just takes
   longer.
The continued tokens equal an unswitched run's: the engine derives each token's sampling noise from (seed, absolute
position) (engines/sampling.py), and every call is submitted with an explicit seed (the agent's, or one derived
from the call's rid when it gave none), so the resumed request draws the noise the cut one would have drawn.

While no cell accepts a session's calls, they wait (up to `no_cell_wait_s`) for one to appear, then get 503 (the SDKs
retry). How many wait so is published as CallsWaitingForCell whenever it changes: demand that no cell sees, which a
scheduler needs once every cell has left rollout. When the proxy stops (the end of a run stops the engines too),
calls that wait for a cell or would resume get 503 "the proxy is stopping" at once, and generations under way get
`shutdown_timeout_s` to finish.
"""

from __future__ import annotations

import asyncio
import hashlib
from array import array
from collections import Counter, OrderedDict
from typing import Any, Callable

import aiohttp
import attrs
import structlog
from aiohttp import web

from gyre.actors.serving.backends import StreamProgress, result_from_sglang, stream_generate
from gyre.actors.serving.http_app import (
    PROXY_SERVICE,
    BackendRejected,
    BackendRequest,
    BackendResult,
    BackendUnavailable,
    OnOutput,
    ProxyHttpConfig,
    build_proxy_app,
)
from gyre.actors.serving.sessions import ProxySessions, ProxySessionsConfig
from gyre.engines.sglang_client import (
    ClientConfig,
    EngineUnreachable,
    RequestRejected,
    ServerError,
    SGLangClient,
    SGLangError,
)
from gyre.messages.cells import ROLLOUT, CellDraining, LoadReport, RoleChanged, SessionPlaced
from gyre.messages.executions import IssueKey, KeyIssued, RevokeKey
from gyre.messages.model_calls import ModelCallCompleted
from gyre.messages.proxy import (
    CallsWaitingForCell,
    ProxyStatus,
    ProxyStatusAsked,
    SessionPrefixes,
    SessionsOnCell,
)
from gyre.policies.routing import CellView, RoutingPolicy, StickyLeastLoaded, checked_choice
from gyre.runtime import Actor, handler

__all__ = ["RoutingConfig", "ProxyConfig", "RoutedBackend", "Proxy"]

log = structlog.get_logger(__name__)


@attrs.frozen
class RoutingConfig:
    """How the backend routes, waits and resumes."""

    policy: RoutingPolicy = attrs.field(factory=StickyLeastLoaded)
    """Chooses the cell of each call (see gyre.policies.routing)."""
    max_sessions: int = 65536
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
    client: ClientConfig = ClientConfig()
    """Deadlines of the engine clients."""

    def __attrs_post_init__(self) -> None:
        for name in ("no_cell_wait_s", "placement_wait_s", "resume_grace_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        if self.max_sessions < 1 or self.max_resumes < 0:
            raise ValueError("max_sessions must be >= 1 and max_resumes >= 0")


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

    @property
    def accepts_new_calls(self) -> bool:
        return self.role == ROLLOUT and not self.draining and bool(self.engine_url) and self.client is not None


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
    resumed_generations: int
    resumed_prompt_tokens: int
    """Prompt tokens (prompt + partial output) of resubmitted generations that came back."""
    resumed_cached_tokens: int
    """Of those, tokens the new cell served from its cache (the migrated KV, when the migration moved it)."""
    waits_for_cell: int
    sessions: int
    sessions_by_cell: dict[str, int]


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
        return tuple(
            CellView(
                name=cell.name,
                role=cell.role,
                draining=cell.draining,
                engine_url=cell.engine_url if cell.client is not None else "",
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
        while cell.accepts_new_calls and route.cell == cell.name and not route.revoked and not self._stopping:
            if asyncio.get_running_loop().time() >= deadline:
                return
            await self._wait_change(deadline)

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
                if progress is None:
                    response = await cell.client.generate(prompt_ids, params, rid=rid, return_logprob=True)
                else:
                    response = await stream_generate(cell.client, prompt_ids, params, rid, on_output, progress)
                result = result_from_sglang(response, cell.name)
            except RequestRejected as error:
                raise BackendRejected(error.message) from None
            except (EngineUnreachable, ServerError) as error:
                failure = error  # the cell went away or failed this request: like an abort, try again
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


@attrs.frozen
class ProxyConfig:
    """The proxy actor's knobs."""

    model_dir: str
    """Model directory whose chat template and tokenizer render the prompts (the cells serve the same model)."""
    host: str = "127.0.0.1"
    """Address the HTTP face binds."""
    port: int = 0
    """Port it binds; 0 picks a free one (KeyIssued carries the real URL)."""
    http: ProxyHttpConfig = ProxyHttpConfig()
    """API behaviour: served model names, context limit, body and in-flight bounds."""
    sessions: ProxySessionsConfig = ProxySessionsConfig()
    """Bounds of the per-execution state."""
    routing: RoutingConfig = RoutingConfig()
    """Routing policy, waits and resumes."""
    max_engine_connections: int = 1024
    """HTTP connections to all engines together."""
    shutdown_timeout_s: float = 3.0
    """How long stopping waits for generations under way to finish before it cancels them (calls waiting for a
    cell or to resume fail at once). Below the launcher's stop timeout (10 s), so the proxy stops on its own."""


class Proxy(Actor):
    """Serves agents' model calls over HTTP and routes them to rollout cells; see the module doc."""

    config_cls = ProxyConfig
    subscriptions = (RoleChanged, LoadReport, CellDraining, SessionPlaced)

    async def on_start(self) -> None:
        from gyre.engines.chat_template import ChatTemplate

        config: ProxyConfig = self.config
        template = await self.offload(ChatTemplate.from_model_dir, config.model_dir)
        self.sessions = ProxySessions(template, config.sessions)
        self.http_client = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=config.max_engine_connections)
        )
        self.backend = RoutedBackend(
            config.routing, lambda url: SGLangClient(url, session=self.http_client, config=config.routing.client),
            on_waiting_for_cell=self._waiting_for_cell_changed,
        )
        app = build_proxy_app(config.http, self.sessions, self.backend, self._call_completed, clock=self.clock.now)
        self.service = app[PROXY_SERVICE]
        self.runner = web.AppRunner(app, access_log=None, shutdown_timeout=config.shutdown_timeout_s)
        await self.runner.setup()
        await web.TCPSite(self.runner, config.host, config.port).start()
        port = self.runner.addresses[0][1]
        self.base_url = f"http://{config.host}:{port}"
        self.log.info("proxy_serving", base_url=self.base_url)
        # A restarted proxy holds no call: say so, in case its predecessor's last count said otherwise.
        self.publish(CallsWaitingForCell(calls=0, time_s=self.clock.now()))

    async def on_stop(self) -> None:
        self.backend.stop_accepting()
        await self.runner.cleanup()
        await self.backend.close()
        await self.http_client.close()

    async def _call_completed(self, message: ModelCallCompleted) -> None:
        # Through the inbox, so that the publication is caused by a recorded message (see the module doc).
        await self.send(self.name, message)

    @handler(ModelCallCompleted)
    def on_call_completed(self, msg: ModelCallCompleted) -> None:
        self.publish(msg)

    def _waiting_for_cell_changed(self, calls: int) -> None:
        # Through the inbox, like ModelCallCompleted: the publication is caused by a recorded message.
        self.tell(self.name, CallsWaitingForCell(calls=calls, time_s=self.clock.now()))

    @handler(CallsWaitingForCell)
    def on_calls_waiting_for_cell(self, msg: CallsWaitingForCell) -> None:
        self.publish(msg)

    @handler(IssueKey)
    def on_issue_key(self, msg: IssueKey) -> KeyIssued:
        api_key = self.sessions.issue_key(msg.execution_id, msg.group_id)
        return KeyIssued(api_key=api_key, openai_base_url=self.base_url + "/v1", anthropic_base_url=self.base_url)

    @handler(RevokeKey)
    def on_revoke_key(self, msg: RevokeKey) -> None:
        known = self.sessions.revoke(msg.execution_id)
        aborted = self.backend.forget_execution(msg.execution_id)
        if not known:
            self.log.info("revoke_of_an_unknown_execution", execution_id=msg.execution_id)
        elif aborted:
            self.log.info("revoked_with_calls_in_flight", execution_id=msg.execution_id, aborted=aborted)

    @handler(RoleChanged)
    def on_role_changed(self, msg: RoleChanged) -> None:
        self.backend.role_changed(msg)

    @handler(LoadReport)
    def on_load_report(self, msg: LoadReport) -> None:
        self.backend.load_report(msg)

    @handler(CellDraining)
    def on_cell_draining(self, msg: CellDraining) -> None:
        self.backend.cell_draining(msg.cell)

    @handler(SessionPlaced)
    def on_session_placed(self, msg: SessionPlaced) -> None:
        if not self.backend.session_placed(msg.session, msg.cell):
            self.log.info("placement_of_an_unknown_session", session=msg.session, cell=msg.cell)

    @handler(SessionsOnCell)
    def on_sessions_on_cell(self, msg: SessionsOnCell) -> SessionPrefixes:
        return SessionPrefixes(cell=msg.cell, sessions=self.backend.sessions_on(msg.cell))

    @handler(ProxyStatusAsked)
    def on_status(self, msg: ProxyStatusAsked) -> ProxyStatus:
        http = self.service.statistics()
        routing = self.backend.statistics()
        return ProxyStatus(
            base_url=self.base_url,
            calls_completed=http.calls_completed,
            calls_rejected=http.calls_rejected,
            calls_failed=http.calls_failed,
            in_flight=http.in_flight,
            resumed_generations=routing.resumed_generations,
            waits_for_cell=routing.waits_for_cell,
            sessions=routing.sessions,
            sessions_by_cell=routing.sessions_by_cell,
        )
