"""The rollout role of a cell whose engine is a server: a child process the cell launches (kind "server") or one
someone else runs (kind "url"), driven only over SGLang's HTTP API through one `SGLangClient`.

`ServerRolloutHost` has the embedded host's face (actors/cells/rollout_role.py `RolloutHost`), so the cell orders a
switch the same way whatever its engine kind:

- prepare: launch the server (first time; kind "server"), wait for /health, check it holds the cell's model, or
  /resume_memory_occupation after a switch. The process outlives role switches: its memory is released, not the
  process, because restarting a server costs a model load (minutes for a large model on a GPU).
- start: the newest weights (update_weights_from_disk), /continue_generation, and the cell serves its URL.
- pause_in_place: /pause_generation {"mode": "in_place"}; live_sequences: Gyre's /gyre/live_sequences (SGLang has
  none: the migrator then moves what the prefix cache holds and the proxy re-prefills the rest).
- shutdown: /abort_request {abort_all} until /release_memory_occupation succeeds (a call the proxy routed just
  before it heard CellDraining may still land); a /generate after that gets 503 from Gyre's server, which the proxy
  retries elsewhere.
- load_weights: the weights go into a versioned safetensors directory (`WeightsDir`: written in a temporary
  directory, fsynced, renamed into place, so a server never reads half a checkpoint), then pause in place ->
  update_weights_from_disk -> continue. SGLang reports one weight_version per request; pausing around the update
  keeps every token's version right on Gyre's server, which tags tokens one by one.

With `EngineServerConfig.weight_path` "distributed" the update is a broadcast instead (init_weights_update_group
once, then update_weights_from_distributed per bucket: engines/weight_broadcast.py), pausing the same way; a
broadcast that fails closes the group, the update goes by disk, and the fallback is counted.

Each update's path ("disk" or "distributed") and seconds are recorded (`weight_updates`, `last_weight_update_s`,
`last_weight_update_path`). A server that
does not start, dies or breaks is reported through `report` (the cell publishes EngineServerFailed) and then fails
the cell through the task it runs in.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable, Mapping

import attrs
import structlog
import torch

from gyre.actors.errors import ActorError
from gyre.actors.cells.engine_process import (
    SERVER,
    EngineProcess,
    EngineServerConfig,
    EngineServerFailed,
    EngineServerRefused,
    free_port,
    server_command,
)
from gyre.actors.cells.rollout_role import PullStaging, RecentSessions
from gyre.actors.cells.train_role import Offload
from gyre.engines.embedded_engine import EngineConfig, EngineStats
from gyre.engines.model_format import ModelSpec, ServedModelMismatch, check_served_model
from gyre.engines.weight_broadcast import BroadcastSender, WeightGroupError
from gyre.engines.weight_buckets import HFBuckets, write_safetensors
from gyre.engines.sglang_client import (
    API_KEY_PURPOSE,
    CapabilityMissing,
    ClientConfig,
    EngineUnreachable,
    RequestRejected,
    ServerError,
    SGLangClient,
    SGLangError,
)
from gyre.runtime.run_secrets import run_token

__all__ = ["ServerRolloutHost", "WeightsDir"]

log = structlog.get_logger(__name__)


class _ExitedEarly(ActorError):
    """A launched server ended before it was healthy and another launch may follow (never leaves this module)."""

    def __init__(self, exit_code: int | None, lines) -> None:
        super().__init__(f"exited with code {exit_code}")
        self.exit_code, self.lines = exit_code, tuple(lines)

RELEASE_ATTEMPTS = 200
"""Abort-then-release rounds while draining (20 ms apart: 4 s): late calls keep landing only until the proxy has
heard CellDraining, a few bus hops."""
MODEL_FILES_SKIPPED = (".safetensors", ".bin", ".pt", ".index.json")


class WeightsDir:
    """Versioned Hugging Face directories `<root>/v<version>` the server loads with update_weights_from_disk.

    Each is written whole in a temporary directory beside it, its files and the directory fsynced, then renamed into
    place (atomic on one file system), so a reader sees a complete checkpoint or none. The config and tokenizer
    files come from the cell's model directory (SGLang's loader reads config.json from the path it is given). Only
    the newest `keep` directories stay.
    """

    def __init__(self, root: str, model_dir: str, keep: int) -> None:
        self.owned = not root
        self.root = Path(root or tempfile.mkdtemp(prefix="gyre-weights-"))
        self.root.mkdir(parents=True, exist_ok=True)
        self.model_dir = Path(model_dir)
        self.keep = keep

    def write(self, weights: Mapping[str, torch.Tensor] | HFBuckets, version: int) -> str:
        from safetensors.torch import save_file

        final = self.root / f"v{version}"
        if final.exists():  # written before (a retried update): complete by construction
            return str(final)
        tmp = Path(tempfile.mkdtemp(prefix=f".v{version}-", dir=self.root))
        try:
            for item in self.model_dir.iterdir():
                if item.is_file() and not item.name.endswith(MODEL_FILES_SKIPPED):
                    shutil.copyfile(item, tmp / item.name)
            if isinstance(weights, HFBuckets):  # a sharded trainer's: streamed, one bucket in memory at a time
                write_safetensors(tmp / "model.safetensors", weights)
            else:
                # A clone per tensor: pulled weights are views of one flat buffer, which safetensors refuses to save.
                tensors = {name: tensor.detach().contiguous().clone() for name, tensor in weights.items()}
                save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
            for item in tmp.iterdir():
                _fsync(item)
            _fsync(tmp)
            os.rename(tmp, final)
            _fsync(self.root)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        self._prune()
        return str(final)

    def _prune(self) -> None:
        versions = sorted((int(p.name[1:]), p) for p in self.root.iterdir()
                          if p.is_dir() and p.name.startswith("v") and p.name[1:].isdigit())
        for _, path in versions[:-self.keep]:
            shutil.rmtree(path, ignore_errors=True)

    def close(self) -> None:
        if self.owned:
            shutil.rmtree(self.root, ignore_errors=True)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class ServerRolloutHost(PullStaging):
    """One cell's engine server, driven over HTTP; see the module docstring. Call from the cell's event loop."""

    def __init__(
        self,
        kind: str,
        model_dir: str,
        spec: ModelSpec,
        engine_config: EngineConfig,
        server_config: EngineServerConfig,
        agent: Any,
        host: str,
        port: int,
        offload: Offload,
        sessions: RecentSessions,
        spawn: Callable[[Any, str], Any],
        report: Callable[[EngineServerFailed], None],
        clock: Callable[[], float],
        transfer_protocol: str = "tcp",
        rdma_devices: str = "",
    ) -> None:
        super().__init__(agent)
        self.transfer_protocol = transfer_protocol
        """The cell's Mooncake protocol, which the server it launches uses for KV too."""
        self.rdma_devices = rdma_devices
        self.kind = kind
        self.model_dir = model_dir
        self.spec = spec
        self.engine_config = engine_config
        self.server_config = server_config
        self.host = host
        self.port = port
        self._offload = offload
        self.sessions = sessions
        self._spawn = spawn
        self._report = report
        self._clock = clock
        self.process: EngineProcess | None = None
        self.client: SGLangClient | None = None
        self.base_url = ""
        """The server's URL, whether or not the cell serves it now."""
        self.url = ""
        """The URL while the cell serves (what it announces); "" otherwise."""
        self._serving = False
        self._memory_held = False
        self._paused = False
        self._weight_version = -1
        self.model_check = ""
        """How the server's model was checked at start (see engines.model_format.check_served_model)."""
        self.weights_dir = WeightsDir(server_config.weights_dir, model_dir, server_config.keep_weight_versions)
        self.weight_updates = 0
        self.last_weight_update_s = 0.0
        self.last_weight_update_path = ""
        self.weight_broadcast_fallbacks = 0
        """Updates meant to be broadcast that went by disk (the group could not form or a bucket failed)."""
        self._sender: BroadcastSender | None = None
        self.kv_moves_unavailable = 0
        """Drains in which the server could not list its live generations (SGLang): the proxy re-prefilled them."""

    # ---- state --------------------------------------------------------------------------------------------

    @property
    def serving(self) -> bool:
        return self._serving

    @property
    def has_memory(self) -> bool:
        return self._memory_held

    @property
    def weight_version(self) -> int:
        return self._weight_version

    async def stats(self) -> EngineStats | None:
        if self.client is None:
            return None
        try:
            load = await self.client.get_load()
        except SGLangError as error:  # a dead server is the watcher's to report; a load report can go without
            log.warning("engine_stats_unavailable", url=self.base_url, error=str(error))
            return None
        if isinstance(load, dict) and "running" in load and "free_blocks" in load:
            load = dict(load, memory_released=tuple(load.get("memory_released", ())))
            return EngineStats(**{field.name: load[field.name] for field in attrs.fields(EngineStats)})
        # SGLang's own load record: only the counts it gives are known.
        first = load[0] if isinstance(load, list) and load else load if isinstance(load, dict) else {}
        running = int(first.get("num_reqs", 0) or 0)
        waiting = int(first.get("num_waiting_reqs", 0) or 0)
        return EngineStats(running=running, waiting=waiting, paused=self._paused, free_blocks=0, total_blocks=0,
                           cached_blocks=0, cached_tokens_total=0, prompt_tokens_total=0, generated_tokens_total=0,
                           prefix_hit_rate=0.0, weight_version=self._weight_version, steps=0, retractions=0,
                           exports=0, memory_released=())

    # ---- start / stop -------------------------------------------------------------------------------------

    async def prepare(self) -> None:
        """Launch the server and check it (the first time), or give it its memory back."""
        if self.client is None:
            await self._connect()
        elif not self._memory_held:
            await self.client.resume_memory(None)
            await self._read_version()
        self._memory_held = True

    async def _connect(self) -> None:
        config = self.server_config
        if self.kind == SERVER:
            picked = not self.port
            attempts = config.start_attempts if picked else 1
            for attempt in range(1, attempts + 1):
                if picked:
                    self.port = free_port(self.host)
                self.base_url = f"http://{self.host}:{self.port}"
                command = server_command(config, self.model_dir, self.host, self.port, self.engine_config,
                                         self.transfer_protocol, self.rdma_devices)
                self.process = EngineProcess.for_key(command, run_token(API_KEY_PURPOSE), config)
                await self.process.launch()
                self.client = SGLangClient(self.base_url, config=ClientConfig(pause_body=config.pause_body))
                try:
                    await self._wait_healthy(last_attempt=attempt == attempts)
                    break
                except _ExitedEarly as early:
                    log.warning("engine_server_start_retried", url=self.base_url, exit_code=early.exit_code,
                                attempt=attempt, attempts=attempts, last_output="\n".join(early.lines[-5:]))
                    await self.client.close()
        else:
            self.base_url = config.url.rstrip("/")
            self.client = SGLangClient(self.base_url, config=ClientConfig(
                pause_body=config.pause_body, api_key_file=config.api_key_file))
            if not await self.client.health():
                raise EngineServerFailed(f"the engine server at {self.base_url} does not answer /health")
        info = await self.client.model_info()
        try:
            self.model_check = check_served_model(info, self.spec, self.model_dir)
        except ServedModelMismatch as mismatch:
            error = EngineServerRefused(str(mismatch))
            log.error("engine_server_refused", url=self.base_url, error=str(error))
            if self.process is not None:
                await self.process.stop()
            self._report(EngineServerFailed(str(error), self.process.last_output() if self.process else (),
                                            self.exit_code_or_none()))
            raise error from None
        if self.model_check == "unverified":
            log.warning("engine_model_not_verified", url=self.base_url,
                        why="the server reports neither its layout nor a model_path this machine can read")
        await self._read_version()
        log.info("engine_server_ready", url=self.base_url, kind=self.kind, model_check=self.model_check,
                 pid=self.process.pid if self.process else None, weight_version=self._weight_version)
        if self.process is not None:
            self._spawn(self._watch(self.process), "engine_server.watch")

    async def _wait_healthy(self, last_attempt: bool = True) -> None:
        """Until /health answers 200; EngineServerFailed if the process ends first or it takes too long (_ExitedEarly,
        unreported, when it ended first and another launch may follow)."""
        assert self.process is not None and self.client is not None
        config = self.server_config
        loop = asyncio.get_running_loop()
        deadline = loop.time() + config.startup_timeout_s
        exited = asyncio.ensure_future(self.process.wait_exit())
        try:
            while not await self.client.health():
                if exited.done():
                    if not last_attempt:
                        raise _ExitedEarly(exited.result(), self.process.last_output())
                    raise self._failure(f"the engine server exited with code {exited.result()} before it was "
                                        f"healthy", exited.result())
                if loop.time() >= deadline:
                    await self.process.stop()
                    raise self._failure(f"the engine server was not healthy within {config.startup_timeout_s} s",
                                        self.process.exit_code)
                await asyncio.wait({exited}, timeout=config.health_poll_s)
        finally:
            if not exited.done():
                exited.cancel()

    def exit_code_or_none(self) -> int | None:
        return self.process.exit_code if self.process is not None else None

    def _failure(self, message: str, exit_code: int | None) -> EngineServerFailed:
        lines = self.process.last_output() if self.process is not None else ()
        error = EngineServerFailed(message, lines, exit_code)
        log.error("engine_server_failed", url=self.base_url, error=message, exit_code=exit_code,
                  last_output="\n".join(lines[-20:]))
        self._report(error)
        return error

    async def _watch(self, process: EngineProcess) -> None:
        """Fail the cell (raise in its task) when the server ends without being stopped."""
        code = await process.wait_exit()
        if process.stopping:
            return
        self._serving = False
        self.url = ""
        raise self._failure(f"the engine server died (exit code {code})", code)

    async def _read_version(self) -> None:
        assert self.client is not None
        info = await self.client.model_info()
        try:
            self._weight_version = int(info.get("weight_version", 0) or 0)
        except (TypeError, ValueError):  # SGLang's default version string is "default"
            self._weight_version = 0

    async def start(self, weights: Mapping[str, torch.Tensor] | None, version: int) -> str:
        """Load `weights` as `version` if given (after `prepare`, done here if not yet), serve; returns the URL."""
        assert not self.serving, "already serving"
        await self.prepare()
        assert self.client is not None
        if weights is not None:
            await self._update(weights, version)
        await self.client.continue_generation()
        self._paused = False
        self._serving = True
        self.url = self.base_url
        log.info("engine_serving", url=self.url, weight_version=self._weight_version, kind=self.kind)
        return self.url

    async def pause_in_place(self) -> int:
        assert self.client is not None
        self._paused = True
        try:
            answer = await self.client.pause("in_place")
        except CapabilityMissing as error:  # SGLang <= 0.5.5: abort; the proxy re-prefills
            log.info("pause_in_place_unavailable_aborting", error=str(error))
            await self.client.pause("abort")
            return 0
        return int(answer.get("requests", 0) or 0)

    async def live_sequences(self) -> tuple[tuple[int, ...], ...]:
        assert self.client is not None
        try:
            sequences = await self.client.live_sequences()
        except CapabilityMissing:
            self.kv_moves_unavailable += 1
            return ()
        return tuple(tuple(int(t) for t in seq) for seq in sequences)

    async def shutdown(self) -> int:
        """Abort what is in flight and release the server's memory (late arrivals aborted until that succeeds).
        Returns 0: SGLang's /abort_request does not say how many it aborted."""
        assert self.client is not None
        client = self.client
        self._serving = False
        self.url = ""
        self.sessions.clear()
        await client.abort(None)
        for attempt in range(RELEASE_ATTEMPTS):
            try:
                await client.release_memory(None)
                break
            except RequestRejected as error:  # requests still in flight: abort them again
                if attempt == RELEASE_ATTEMPTS - 1:
                    raise EngineServerFailed(f"the engine server kept requests past {RELEASE_ATTEMPTS} aborts: "
                                             f"{error}") from error
                await client.abort(None)
                await asyncio.sleep(0.02)
        self._memory_held = False
        log.info("engine_released", url=self.base_url)
        return 0

    async def close(self) -> None:
        """Stop serving and stop the server if the cell launched it (the cell is stopping)."""
        if self._sender is not None:
            await self._sender.close()
            self._sender = None
        if self.client is not None and self._serving:
            try:
                await self.shutdown()
            except SGLangError as error:  # it is going away anyway
                log.warning("engine_not_released_at_close", error=str(error))
        if self.process is not None:
            await self.process.stop()
            self.process = None
        if self.client is not None:
            await self.client.close()
            self.client = None
        self._memory_held = False
        self.drop_pull_buffer()
        await self._offload(self.weights_dir.close)

    # ---- weights ------------------------------------------------------------------------------------------

    async def load_weights(self, weights: Mapping[str, torch.Tensor], version: int) -> None:
        """Pause in place, update (disk or broadcast), continue: in-flight requests keep their tokens and versions,
        and no token straddles two versions."""
        assert self.client is not None
        path = None
        if self.server_config.weight_path == "disk":  # written before the pause: serving goes on meanwhile
            path = await self._offload(self.weights_dir.write, weights, version)
        was_paused = self._paused
        if self.server_config.pause_body:  # SGLang <= 0.5.5 can only pause by aborting: update under way then
            await self.client.pause("in_place")
        try:
            await self._update(weights, version, path)
        finally:
            if not was_paused:
                await self.client.continue_generation()

    async def _update(self, weights: Mapping[str, torch.Tensor], version: int, path: str | None = None) -> None:
        if self.server_config.weight_path == "distributed" and await self._update_from_distributed(weights, version):
            return
        await self._update_from_disk(weights, version, path)

    async def _update_from_distributed(self, weights: Mapping[str, torch.Tensor], version: int) -> bool:
        """Broadcast `weights` to the server; False (counted, logged, the group closed) if that failed and the
        update must go by disk. A server that is gone fails the cell as in `_update_from_disk`."""
        assert self.client is not None
        config = self.server_config
        started = self._clock()
        if self._sender is None:
            self._sender = BroadcastSender([self.client], self.host, backend=config.weight_group_backend,
                                           timeout_s=config.weight_broadcast_timeout_s)
        try:
            sent = await self._sender.send(weights, version)
        except WeightGroupError as error:
            self.weight_broadcast_fallbacks += 1
            log.warning("engine_weight_broadcast_failed", version=version, error=str(error), fallback="disk",
                        fallbacks=self.weight_broadcast_fallbacks)
            if not await self.client.health():
                raise self._failure(f"the engine server failed a weight broadcast: {error}",
                                    self.exit_code_or_none()) from None
            return False
        self._weight_version = version
        self.weight_updates += 1
        self.last_weight_update_s = self._clock() - started
        self.last_weight_update_path = "distributed"
        log.info("engine_weights_updated", path="distributed", version=version, bytes=sent,
                 group=self._sender.group_name, seconds=round(self.last_weight_update_s, 4))
        return True

    async def _update_from_disk(self, weights: Mapping[str, torch.Tensor], version: int,
                                path: str | None = None) -> None:
        assert self.client is not None
        started = self._clock()
        if path is None:
            path = await self._offload(self.weights_dir.write, weights, version)
        try:
            await self.client.update_weights_from_disk(path, weight_version=version)
        except (ServerError, EngineUnreachable) as error:  # 5xx or gone: the server broke, not the request
            raise self._failure(f"the engine server failed a weight update: {error}", self.exit_code_or_none()
                                ) from error
        self._weight_version = version
        self.weight_updates += 1
        self.last_weight_update_s = self._clock() - started
        self.last_weight_update_path = "disk"
        log.info("engine_weights_updated", path="disk", version=version, directory=path,
                 seconds=round(self.last_weight_update_s, 4))
