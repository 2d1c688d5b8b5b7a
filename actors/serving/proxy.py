"""The proxy actor: the agents' HTTP face on the bus, routing every call to a rollout cell's engine.

It hosts the OpenAI/Anthropic application (`build_proxy_app`, http_app.py) on its own event loop and answers it
through a `RoutedBackend` (routing.py), which keeps the proxy's view of the cells (from RoleChanged, LoadReport,
CellDraining and SessionPlaced, which this actor's handlers pass in) and asks the routing policy where each call
goes. The path of a call through those files is in the package doc (gyre.actors.serving). Every finished call becomes a ModelCallCompleted
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

A cell whose engine server fails (EngineServerFailed) takes nothing more until it is a rollout cell again; one whose
engine refuses a connection or answers 5xx takes nothing for `unreachable_backoff_s`. Either way the generations it
held resume, like aborted ones, on the cells that take their sessions (which re-prefill them).

While no cell accepts a session's calls, they wait (up to `no_cell_wait_s`) for one to appear, then get 503 (the SDKs
retry). How many wait so is published as CallsWaitingForCell whenever it changes: demand that no cell sees, which a
scheduler needs once every cell has left rollout. When the proxy stops (the end of a run stops the engines too),
calls that wait for a cell or would resume get 503 "the proxy is stopping" at once, and generations under way get
`shutdown_timeout_s` to finish. A call whose body is still arriving then ends with a closed connection (the
SDKs retry it): aiohttp reads nothing more once its server shuts down.
"""

from __future__ import annotations

import aiohttp
import attrs
from aiohttp import web

from gyre.actors.serving.http_app import (
    PROXY_SERVICE,
    ProxyHttpConfig,
    build_proxy_app,
    check_context_fits,
    runner_options,
)
from gyre.actors.serving.routing import RoutedBackend, RoutingConfig
from gyre.actors.serving.sessions import ProxySessions, ProxySessionsConfig
from gyre.engines.sglang_client import SGLangClient
from gyre.messages.cells import CellDraining, EngineServerFailed, LoadReport, RoleChanged, SessionPlaced
from gyre.messages.executions import IssueKey, KeyIssued, RevokeKey
from gyre.messages.model_calls import ModelCallCompleted
from gyre.messages.proxy import CallsWaitingForCell, ProxyStatistics, SessionPrefixes, SessionsOnCell
from gyre.runtime import Actor, handler
from gyre.runtime.launch import node_address

__all__ = ["ProxyConfig", "Proxy"]


@attrs.frozen
class ProxyConfig:
    """The proxy actor's knobs."""

    model_dir: str
    """Model directory whose chat template and tokenizer render the prompts (the cells serve the same model)."""
    host: str = attrs.field(factory=node_address)
    """Address the HTTP face binds: the node's (runtime.launch.node_address: GYRE_NODE_ADDRESS where a Ray host set
    it, else 127.0.0.1), so agents on other nodes reach it too; every call still needs its execution's key."""
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
    subscriptions = (RoleChanged, LoadReport, CellDraining, SessionPlaced, EngineServerFailed)

    async def on_start(self) -> None:
        from gyre.engines.chat_template import ChatTemplate

        config: ProxyConfig = self.config
        check_context_fits(config.model_dir, config.http.max_context_tokens)
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
        self.runner = web.AppRunner(
            app, access_log=None, shutdown_timeout=config.shutdown_timeout_s, **runner_options(config.http)
        )
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
        self.service.bodies.forget(msg.execution_id)
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

    @handler(EngineServerFailed)
    def on_engine_server_failed(self, msg: EngineServerFailed) -> None:
        self.backend.cell_failed(msg.cell, msg.reason)

    @handler(SessionPlaced)
    def on_session_placed(self, msg: SessionPlaced) -> None:
        if not self.backend.session_placed(msg.session, msg.cell):
            self.log.info("placement_of_an_unknown_session", session=msg.session, cell=msg.cell)

    @handler(SessionsOnCell)
    def on_sessions_on_cell(self, msg: SessionsOnCell) -> SessionPrefixes:
        return SessionPrefixes(cell=msg.cell, sessions=self.backend.sessions_on(msg.cell))

    def statistics(self) -> ProxyStatistics:
        """The answer to StatisticsAsked: the HTTP face's and the router's counters, and where the proxy serves."""
        http = self.service.statistics()
        routing = self.backend.statistics()
        return ProxyStatistics(
            base_url=self.base_url,
            calls_completed=http.calls_completed,
            calls_rejected=http.calls_rejected,
            calls_failed=http.calls_failed,
            calls_disconnected=http.calls_disconnected,
            emit_failures=http.emit_failures,
            in_flight=http.in_flight,
            in_flight_peak=http.in_flight_peak,
            resumed_generations=routing.resumed_generations,
            resumed_prompt_tokens=routing.resumed_prompt_tokens,
            resumed_cached_tokens=routing.resumed_cached_tokens,
            waits_for_cell=routing.waits_for_cell,
            sessions=routing.sessions,
            sessions_by_cell=routing.sessions_by_cell,
            engines_unreachable=routing.engines_unreachable,
            failed_cells=routing.failed_cells,
        )
