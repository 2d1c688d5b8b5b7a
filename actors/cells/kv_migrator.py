"""The KV migrator: moves the live sessions of a cell that leaves rollout to the cells that stay, KV blocks included.

A cell switching to training asks `MigrateSessions`. The migrator asks the proxy which sessions live on the source
and the token ids whose KV they hold there (SessionsOnCell), spreads them over the targets, and for each session:
export on the source (pins the cached blocks of its longest cached prefix), import on the target (the target reads
the blocks straight from the source's pool through Mooncake and caches the prefix), release on the source, then
publishes SessionPlaced so the proxy routes the session's next call to its new cell, which finds the prefix cached.

In-flight generations. A call in flight on the source has only its prompt in the proxy's view, but the source
paused it in place and holds the KV of prompt + partial output. The draining cell names those sequences
(`MigrateSessions.in_flight`); a session whose ids are a prefix of one moves the whole sequence
(`extend_with_in_flight`), so when the cell then aborts the call and the proxy resubmits prompt + partial output to
the new cell, that cell finds all of it cached and only generates what is left.

When the blocks cannot move (a real SGLang server has no /gyre/kv/*: CapabilityMissing; Mooncake failed; the
source no longer caches the prefix; the target has no room) the session is still placed and the target prefills it
again on its next call: slower, never wrong. Such sessions are counted as `reprefill_sessions`.

SGLang servers started with HiCache over one shared storage backend (`--enable-hierarchical-cache
--hicache-storage-backend mooncake`, the same store for all) need no move: the source wrote the prefix's KV through
to the store, and the target finds it there on the session's next call. When the source cannot export and both
servers' /server_info report hierarchical caching with the same storage backend, the session is placed and counted
as `hicache_sessions` instead. That the target really loads the prefix from the store is SGLang's part, not checked
here (no GPU, no SGLang); the proxy's `cached_tokens` on the next call says whether it did.

Sessions move a few at a time (`max_concurrent`): each transfer is bounded by the engines' own queues, and the
target keeps serving while it imports. MigrateSessions asks are handled one at a time (the actor's mailbox), so two
cells switching together migrate one after the other.

`statistics()` (the answer to StatisticsAsked) sums every migration so far: `KVMigratorStatistics`.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from typing import Any, Mapping, Sequence

import aiohttp
import attrs
import structlog

from gyre.engines.sglang_client import CapabilityMissing, ClientConfig, SGLangClient, SGLangError
from gyre.messages.cell_internal import KVMigratorStatistics
from gyre.messages.cells import MigrateSessions, SessionPlaced, SessionsMigrated
from gyre.messages.proxy import SessionPrefixes, SessionsOnCell
from gyre.runtime import Actor, handler
from gyre.runtime.errors import ConfigError
from gyre.runtime.validators import count, positive

__all__ = ["KVMigratorConfig", "KVMigrator", "assign_sessions", "extend_with_in_flight", "hicache_backend"]

log = structlog.get_logger(__name__)


@attrs.frozen
class KVMigratorConfig:
    """Where the proxy is and how hard to push the engines."""

    proxy: str = "proxy"
    """Name of the proxy actor (asked SessionsOnCell)."""
    max_concurrent: int = attrs.field(default=4, validator=count)
    """Sessions in transfer at once."""
    proxy_timeout_s: float = attrs.field(default=30.0, validator=positive)
    """How long to wait for the proxy's answer."""
    client: ClientConfig = ClientConfig(control_timeout_s=120.0)
    """Deadlines of the engine clients (export/import are control calls)."""
    max_clients: int = attrs.field(default=64, validator=count)
    """Engine clients kept (one per engine URL; least recently used closed first). At least 2: a migration uses
    the source's client and a target's at once."""

    def __attrs_post_init__(self) -> None:
        if self.max_clients < 2:
            raise ConfigError(f"max_clients must be >= 2 (a source and a target), got {self.max_clients}")


def assign_sessions(prefix_tokens: Mapping[str, int], targets: Sequence[str]) -> dict[str, str]:
    """Session -> target, balancing prefix tokens: longest prefix first onto the target with the fewest tokens so
    far (ties: fewer sessions, then name). Deterministic for the same input."""
    if not targets:
        return {}
    tokens = {target: 0 for target in targets}
    counts = {target: 0 for target in targets}
    placement: dict[str, str] = {}
    for session in sorted(prefix_tokens, key=lambda s: (-prefix_tokens[s], s)):
        target = min(sorted(targets), key=lambda t: (tokens[t], counts[t]))
        placement[session] = target
        tokens[target] += prefix_tokens[session]
        counts[target] += 1
    return placement


def extend_with_in_flight(
    prefixes: Mapping[str, tuple[int, ...]], in_flight: Sequence[tuple[int, ...]]
) -> dict[str, tuple[int, ...]]:
    """Each session's ids, replaced by the longest in-flight sequence that begins with them and is longer (its call
    is generating: the partial output's KV moves too). Sessions no sequence extends keep their ids."""
    by_head: dict[int, list[tuple[int, ...]]] = {}
    for sequence in in_flight:
        if sequence:
            by_head.setdefault(sequence[0], []).append(sequence)
    extended: dict[str, tuple[int, ...]] = {}
    for session, ids in prefixes.items():
        best = ids
        for sequence in by_head.get(ids[0], ()) if ids else ():
            if len(sequence) > len(best) and sequence[: len(ids)] == ids:
                best = sequence
        extended[session] = best
    return extended


def _wanted(session: str, wanted: frozenset[str]) -> bool:
    """A session key is "<execution_id>/<agent_id>"; MigrateSessions may name either form."""
    return session in wanted or any(session.startswith(w + "/") for w in wanted)


@attrs.define
class _Outcome:
    moved_tokens: int = 0
    reprefill: bool = False
    hicache: bool = False


def hicache_backend(server_info: Mapping[str, Any]) -> str:
    """The storage backend a server's HiCache writes through to ("" when it has none): SGLang's /server_info
    fields `enable_hierarchical_cache` and `hicache_storage_backend`."""
    if not server_info.get("enable_hierarchical_cache"):
        return ""
    backend = server_info.get("hicache_storage_backend")
    return backend if isinstance(backend, str) else ""


class KVMigrator(Actor):
    """Answers MigrateSessions with SessionsMigrated; see the module doc."""

    config_cls = KVMigratorConfig

    async def on_start(self) -> None:
        self.http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=4 * self.config.max_concurrent))
        self.clients: OrderedDict[str, SGLangClient] = OrderedDict()
        self.migrations = 0
        self.sessions_placed = 0
        self.reprefill_sessions = 0
        self.hicache_sessions = 0
        """Sessions left to HiCache's shared store (see the module doc)."""
        self._hicache: OrderedDict[str, str] = OrderedDict()
        """Engine URL -> its HiCache storage backend ("" for none), asked once per URL (bounded like clients)."""
        self.moved_tokens = 0
        """KV tokens moved in all migrations so far."""
        self.partial_output_tokens = 0
        """Of the sessions placed, tokens of partial output (generations paused in place) asked to move with them."""

    async def on_stop(self) -> None:
        await self.http.close()

    def statistics(self) -> KVMigratorStatistics:
        return KVMigratorStatistics(
            migrations=self.migrations,
            sessions_placed=self.sessions_placed,
            moved_tokens=self.moved_tokens,
            partial_output_tokens=self.partial_output_tokens,
            reprefill_sessions=self.reprefill_sessions,
            hicache_sessions=self.hicache_sessions,
        )

    def _client(self, url: str) -> SGLangClient:
        client = self.clients.get(url)
        if client is None:
            client = self.clients[url] = SGLangClient(url, session=self.http, config=self.config.client)
            while len(self.clients) > self.config.max_clients:
                self.clients.popitem(last=False)  # shares self.http: nothing to close
        else:
            self.clients.move_to_end(url)
        return client

    @handler(MigrateSessions)
    async def on_migrate(self, msg: MigrateSessions) -> SessionsMigrated:
        started = self.clock.now()
        answer = await self.ask(self.config.proxy, SessionsOnCell(msg.source), timeout_s=self.config.proxy_timeout_s)
        assert isinstance(answer, SessionPrefixes), type(answer)
        prefixes = extend_with_in_flight(answer.sessions, msg.in_flight)
        if msg.sessions:
            wanted = frozenset(msg.sessions)
            prefixes = {s: ids for s, ids in prefixes.items() if _wanted(s, wanted)}
        targets = {name: url for name, url in msg.targets.items() if name != msg.source}
        placement = assign_sessions({s: len(ids) for s, ids in prefixes.items()}, tuple(targets))
        partial = sum(len(prefixes[s]) - len(answer.sessions[s]) for s in placement)
        if prefixes and not placement:
            self.log.warning("no_target_cell_to_migrate_to", source=msg.source, sessions=len(prefixes))

        source = self._client(msg.source_url) if msg.source_url else None
        gate = asyncio.Semaphore(self.config.max_concurrent)
        capability = {"missing": source is None}

        async def move(session: str) -> _Outcome:
            async with gate:
                target = placement[session]
                outcome = await self._move(source, self._client(targets[target]), prefixes[session], capability)
                if outcome.reprefill and capability["missing"] and source is not None:
                    if await self._shared_hicache(msg.source_url, targets[target]):
                        outcome = _Outcome(hicache=True)
                self.publish(SessionPlaced(session=session, cell=target))
                return outcome

        outcomes = await asyncio.gather(*(move(session) for session in sorted(placement)))
        moved = sum(o.moved_tokens for o in outcomes)
        reprefill = sum(1 for o in outcomes if o.reprefill) + (len(prefixes) - len(placement))
        hicache = sum(1 for o in outcomes if o.hicache)
        self.hicache_sessions += hicache
        seconds = self.clock.now() - started
        self.migrations += 1
        self.sessions_placed += len(placement)
        self.reprefill_sessions += reprefill
        self.moved_tokens += moved
        self.partial_output_tokens += partial
        self.log.info(
            "sessions_migrated",
            source=msg.source,
            sessions=len(placement),
            moved_tokens=moved,
            partial_output_tokens=partial,
            reprefill_sessions=reprefill,
            hicache_sessions=hicache,
            seconds=round(seconds, 4),
        )
        return SessionsMigrated(
            source=msg.source, placement=placement, moved_tokens=moved, reprefill_sessions=reprefill, seconds=seconds,
            hicache_sessions=hicache,
        )

    async def _hicache_of(self, url: str) -> str:
        backend = self._hicache.get(url)
        if backend is None:
            try:
                backend = hicache_backend(await self._client(url).server_info())
            except SGLangError:
                backend = ""  # Gyre's server (no /server_info) or one that does not answer: no shared store
            self._hicache[url] = backend
            while len(self._hicache) > self.config.max_clients:
                self._hicache.popitem(last=False)
        return backend

    async def _shared_hicache(self, source_url: str, target_url: str) -> bool:
        """Whether both servers write their HiCache through to the same kind of storage backend."""
        source = await self._hicache_of(source_url)
        return bool(source) and source == await self._hicache_of(target_url)

    async def _move(
        self, source: SGLangClient | None, target: SGLangClient, ids: tuple[int, ...], capability: dict[str, bool]
    ) -> _Outcome:
        """Export, import, release one session's prefix; any failure means the target re-prefills."""
        if not ids:
            return _Outcome()  # nothing was ever computed for it: nothing to move, nothing to redo
        if capability["missing"] or source is None:
            return _Outcome(reprefill=True)
        try:
            export = await source.export_kv(ids)
        except CapabilityMissing as error:
            capability["missing"] = True  # the same server will refuse every other session too
            self.log.info("source_cannot_export_kv_re_prefill", error=str(error))
            return _Outcome(reprefill=True)
        except SGLangError as error:
            self.log.warning("kv_export_failed_re_prefill", error=str(error))
            return _Outcome(reprefill=True)
        try:
            if int(export.get("num_tokens", 0)) <= 0:
                return _Outcome(reprefill=True)  # the source no longer caches any of it
            try:
                result = await target.import_kv(ids, export)
            except CapabilityMissing as error:
                self.log.info("target_cannot_import_kv_re_prefill", error=str(error))
                return _Outcome(reprefill=True)
            except SGLangError as error:
                self.log.warning("kv_import_failed_re_prefill", error=str(error))
                return _Outcome(reprefill=True)
            return _Outcome(moved_tokens=int(result.get("imported_tokens", 0)))
        finally:
            await self._release(source, export)

    async def _release(self, source: SGLangClient, export: Mapping[str, Any]) -> None:
        handle = export.get("handle")
        if not isinstance(handle, str):
            return
        try:
            await source.release_kv(handle)
        except SGLangError as error:
            # A pinned export only keeps blocks from eviction; the engine bounds how many can be pinned.
            self.log.warning("kv_release_failed", handle=handle, error=str(error))
