"""An engine server as a cell's child process: its command line, start (until /health answers), watch, stop.

A cell of engine kind "server" launches its inference server from a command line and a port, waits for /health,
checks that the server holds the cell's model, and stops it with the cell. Two presets build the command line:

- "gyre": `python -m gyre.engines.engine_server --model-dir D --host H --port P --kv-transfer ...`, the cell's
  EngineConfig as flags. The key every route but /health checks is the run's engine token, handed to the child in
  its own environment (GYRE_ENGINE_API_KEY), never on its command line, where any user of the machine could read it.
- "sglang": `python -m sglang.launch_server --model-path D --host H --port P --skip-tokenizer-init
  --enable-memory-saver` (token ids in and out; release/resume of memory across a switch). SGLang takes its key
  only as --api-key, which would put it on the command line, so the cell gives it none: bind SGLang to a private
  address, or start it yourself with a key and use the "url" kind with `api_key_file`.

`extra_args` are appended as given (e.g. `--tp-size 2 --mem-fraction-static 0.7`, or HiCache's
`--enable-hierarchical-cache`); `command` replaces the preset altogether, with {python} {model_dir} {host} {port}
filled in.

Failures are reported with the server's own words: the last `output_lines` lines it printed (stdout and stderr
together) are kept and go into `EngineServerFailed`, whether it exits before it is healthy, does not become healthy
within `startup_timeout_s`, or dies later.
"""

from __future__ import annotations

import asyncio
import collections
import os
import signal
import socket
import sys
from typing import Any

import attrs
import structlog

from gyre.actors.errors import ActorError
from gyre.engines.embedded_engine import EngineConfig
from gyre.engines.engine_server import API_KEY_ENV
from gyre.runtime.errors import ConfigError
from gyre.runtime.validators import positive

__all__ = [
    "ENGINE_KINDS",
    "EngineProcess",
    "EngineServerConfig",
    "EngineServerFailed",
    "EngineServerRefused",
    "PRESETS",
    "server_command",
]

log = structlog.get_logger(__name__)

EMBEDDED, SERVER, URL = "embedded", "server", "url"
ENGINE_KINDS = (EMBEDDED, SERVER, URL)
"""embedded: the engine in the cell's process; server: a child process the cell launches; url: a server run by
someone else."""
PRESETS = ("gyre", "sglang")


class EngineServerFailed(ActorError, RuntimeError):
    """The engine server did not start, died, or broke; `last_output` holds its last lines."""

    def __init__(self, message: str, last_output: tuple[str, ...] = (), exit_code: int | None = None) -> None:
        super().__init__(message)
        self.last_output = last_output
        self.exit_code = exit_code


class EngineServerRefused(ActorError, ValueError):
    """The engine server holds another model than the cell's model directory (vocabulary or layout differ)."""


def _positive_or_none(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is not None:
        positive(instance, attribute, value)


@attrs.frozen
class EngineServerConfig:
    """How a cell of engine kind "server" or "url" reaches its engine server."""

    preset: str = attrs.field(default="gyre", validator=attrs.validators.in_(PRESETS))
    """Which server the cell launches (kind "server"): "gyre" (Gyre's engine server) or "sglang"."""
    command: tuple[str, ...] = ()
    """A whole command line instead of the preset's; {python}, {model_dir}, {host}, {port} are filled in."""
    extra_args: tuple[str, ...] = ()
    """Arguments appended to the command line as given."""
    python: str = ""
    """Interpreter the preset runs ("" = the cell's own)."""
    url: str = ""
    """Kind "url": the base URL of the server someone else runs."""
    api_key_file: str | None = None
    """Kind "url": a file holding that server's key (None: the run's engine token, for a server of this run)."""
    pause_body: bool = True
    """False for SGLang <= 0.5.5, whose /pause_generation takes no body (and cannot pause in place: the cell then
    aborts and the proxy re-prefills)."""
    startup_timeout_s: float = attrs.field(default=300.0, validator=positive)
    """How long the server may take to answer /health (a large model on a GPU loads for minutes)."""
    start_attempts: int = attrs.field(default=3, validator=positive)
    """Launches of a server whose port the cell picked, when it exits before it is healthy: each again on a new
    port (a port picked free can be taken by another process before the server binds it). A server that does not
    answer in `startup_timeout_s`, or whose port was given, is launched once."""
    health_poll_s: float = attrs.field(default=0.1, validator=positive)
    """Pause between /health probes while it starts."""
    stop_timeout_s: float = attrs.field(default=10.0, validator=positive)
    """Grace time after SIGTERM before the server's process group is killed."""
    output_lines: int = attrs.field(default=200, validator=positive)
    """Lines of the server's output remembered (for the failure report); older ones are dropped."""
    weights_dir: str = ""
    """Where the cell writes the versioned safetensors directories the server loads (update_weights_from_disk);
    "" = a private temporary directory per cell. On several nodes it must be a path the server can read."""
    keep_weight_versions: int = attrs.field(default=2, validator=positive)
    """Weight directories kept on disk (the newest ones): the one loaded and the one being written."""
    weight_path: str = attrs.field(default="disk", validator=attrs.validators.in_(("disk", "distributed")))
    """How new weights reach the server. "disk": update_weights_from_disk from a versioned safetensors directory
    (portable: any SGLang, any node that reads the directory). "distributed": init_weights_update_group +
    update_weights_from_distributed, the cell broadcasting them over a torch.distributed group it forms with its
    server (engines/weight_broadcast.py; no disk, no second copy of the checkpoint). A broadcast that fails falls
    back to disk for that update and is counted (`weight_broadcast_fallbacks`)."""
    weight_group_backend: str = attrs.field(default="gloo", validator=attrs.validators.in_(("gloo", "nccl")))
    """The broadcast's backend: gloo (CPU, Gyre's server) or nccl (SGLang on GPUs; the cell's copy goes to its GPU
    bucket by bucket)."""
    weight_broadcast_timeout_s: float = attrs.field(default=120.0, validator=positive)
    """How long forming the group, or one bucket's broadcast, may take before the update falls back to disk."""

    def __attrs_post_init__(self) -> None:
        if self.url and not self.url.startswith(("http://", "https://")):
            raise ConfigError(f"engine server url must start with http:// or https://, got {self.url!r}")


def free_port(host: str) -> int:
    """A port free on `host` now (the OS picks it). Another process may take it before the server binds: the start
    then fails with the server's own message, and the cell launches it again on another port
    (EngineServerConfig.start_attempts)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def server_command(config: EngineServerConfig, model_dir: str, host: str, port: int,
                   engine: EngineConfig, transfer_protocol: str = "tcp", rdma_devices: str = "") -> list[str]:
    """The command line that launches the server (no key on it, ever). Gyre's server moves KV over the cell's
    Mooncake protocol (`transfer_protocol`, `rdma_devices`: CellConfig's)."""
    python = config.python or sys.executable
    if config.command:
        fill = dict(python=python, model_dir=model_dir, host=host, port=str(port))
        return [part.format(**fill) for part in config.command] + list(config.extra_args)
    if config.preset == "sglang":
        base = [python, "-m", "sglang.launch_server", "--model-path", model_dir, "--host", host, "--port", str(port),
                "--skip-tokenizer-init", "--enable-memory-saver"]
        return base + list(config.extra_args)
    base = [python, "-m", "gyre.engines.engine_server", "--model-dir", model_dir, "--host", host,
            "--port", str(port), "--kv-transfer",
            "--block-size", str(engine.block_size_tokens), "--num-blocks", str(engine.num_blocks),
            "--max-running", str(engine.max_running_requests), "--max-waiting", str(engine.max_waiting_requests),
            "--max-context", str(engine.max_context_tokens), "--max-prefill", str(engine.max_prefill_tokens),
            "--dtype", engine.dtype, "--seed", str(engine.seed), "--max-exports", str(engine.max_exports),
            "--exit-with-parent"]
    if engine.num_threads is not None:
        base += ["--num-threads", str(engine.num_threads)]
    if engine.kv_staging_tokens is not None:
        base += ["--kv-staging-tokens", str(engine.kv_staging_tokens)]
    if transfer_protocol != "tcp":
        base += ["--transfer-protocol", transfer_protocol]
    if rdma_devices:
        base += ["--rdma-devices", rdma_devices]
    return base + list(config.extra_args)


class EngineProcess:
    """One engine server child process. Call from the cell's event loop."""

    def __init__(self, command: list[str], env: dict[str, str], config: EngineServerConfig) -> None:
        self.command = command
        self._env = env
        self.config = config
        self.process: asyncio.subprocess.Process | None = None
        self.output: collections.deque[str] = collections.deque(maxlen=config.output_lines)
        self._reader: asyncio.Task | None = None
        self.stopping = False

    @classmethod
    def for_key(cls, command: list[str], api_key: str, config: EngineServerConfig) -> EngineProcess:
        """A process whose environment (its own only: the cell's stays as it was) carries the server's key."""
        env = dict(os.environ)
        env[API_KEY_ENV] = api_key
        env.setdefault("PYTHONUNBUFFERED", "1")  # its last lines must reach the report when it dies
        return cls(command, env, config)

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    @property
    def exit_code(self) -> int | None:
        return self.process.returncode if self.process is not None else None

    def last_output(self) -> tuple[str, ...]:
        return tuple(self.output)

    async def launch(self) -> None:
        # A process group of its own: SGLang forks a scheduler and a detokenizer, and a stop must reach them too.
        self.process = await asyncio.create_subprocess_exec(
            *self.command, env=self._env, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT, start_new_session=True,
        )
        self._reader = asyncio.ensure_future(self._read_output())
        log.info("engine_server_launched", pid=self.process.pid, program=self.command[:3])

    async def _read_output(self) -> None:
        assert self.process is not None and self.process.stdout is not None
        stream = self.process.stdout
        while True:
            try:
                line = await stream.readline()
            except ValueError:  # a line over the stream's limit: keep what fits, go on
                line = b"<line too long>\n"
            if not line:
                return
            self.output.append(line.decode("utf-8", "replace").rstrip())

    async def wait_exit(self) -> int:
        """Wait for the process to end (its output read to the end); its exit code."""
        assert self.process is not None
        code = await self.process.wait()
        if self._reader is not None:
            await asyncio.shield(self._reader)
        return code

    async def stop(self) -> int | None:
        """SIGTERM to its group, then SIGKILL after `stop_timeout_s`; the exit code (None if never launched)."""
        self.stopping = True
        process = self.process
        if process is None:
            return None
        if process.returncode is None:
            self._signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(process.wait(), self.config.stop_timeout_s)
            except asyncio.TimeoutError:
                log.warning("engine_server_killed", pid=process.pid, after_s=self.config.stop_timeout_s)
                self._signal(signal.SIGKILL)
                await process.wait()
        if self._reader is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self._reader), 5.0)
            except asyncio.TimeoutError:  # a grandchild keeps the pipe open; its lines no longer matter
                self._reader.cancel()
        log.info("engine_server_stopped", pid=process.pid, exit_code=process.returncode)
        return process.returncode

    def _signal(self, sig: int) -> None:
        assert self.process is not None
        try:
            os.killpg(self.process.pid, sig)  # its own group (start_new_session): the server and its children
        except ProcessLookupError:
            pass
