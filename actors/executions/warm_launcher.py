"""The client side of the warm launcher (for the executor's agents and the evaluator's scorers): start Python scripts
by forking a server that has already imported the heavy modules, instead of starting a fresh interpreter each time.

Why: on a small machine a `python agent.py` that imports `openai` spends ~2 CPU-seconds on imports, once per agent
run. `WarmLauncher.start(("openai",))` starts gyre.actors.executions.warm_launcher_server (the protocol is described there),
which imports them once; `launch(...)` then forks a child per run that runs the script with its own argv, cwd,
environment, stdio files and process group. The `LaunchedProcess` it returns has the parts of
asyncio.subprocess.Process the executor uses (`pid`, `returncode`, `wait()`), and the child's pid is its process
group id, so signalling the group works unchanged.

Only `<this interpreter> <existing script> args...` can be launched warm (`accepts`); anything else (`-m`, `-c`,
another program or interpreter) must be started the ordinary way. Between the two, the flags in `STARTUP_FLAGS` (-B,
-S, -s) are accepted and dropped: they only trim what a fresh interpreter does at start (write bytecode, import
`site`, add the user's site-packages), and the server's interpreter has started already; a script that runs without
`site` runs with it too. If the server dies, every child it launched is SIGKILLed (their `wait()` gives -9) and
later launches raise `LauncherDied`; `close()` ends the server and its children (later launches raise
`LauncherClosed`). Both are OSErrors, the errors a failed exec raises too. Linux only (the server forks).
"""

from __future__ import annotations

import asyncio
import errno
import json
import os
import re
import signal
import shutil
import sys
from typing import Any

import attrs
import structlog

from gyre.actors.errors import ActorError
from gyre.actors.executions.warm_launcher_server import MAX_REQUEST_BYTES
from gyre.runtime.validators import positive

__all__ = [
    "LaunchedProcess",
    "LauncherClosed",
    "LauncherDied",
    "LauncherStartFailed",
    "WarmLauncher",
    "WarmLauncherConfig",
    "preload_problem",
    "watch_launcher",
]

log = structlog.get_logger(__name__)

SERVER_MODULE = "gyre.actors.executions.warm_launcher_server"
STARTUP_FLAGS = frozenset({"-B", "-S", "-s"})
"""Interpreter flags that a warm launch drops (module docstring): they change only a fresh interpreter's start."""
_PRELOAD_ENTRY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*(:[A-Za-z_][A-Za-z0-9_]*)?")
"""A dotted module name, optionally followed by ":function", a warm-up the server calls once after the import."""
_PRELOAD_PATH = re.compile(r"/[^,:\0]*\.py")
"""Or the absolute path of a Python file, which the server imports by path (an agent's own modules, which are on no
import path: warm_launcher_server's `_preload`). No comma (the entries travel comma-separated) and no colon."""


class LauncherDied(ActorError, OSError):
    """The server ended without being asked to: nothing more can be launched through it."""


class LauncherClosed(ActorError, OSError):
    """The launcher was closed (or never started): nothing more can be launched through it."""


class LauncherStartFailed(ActorError, RuntimeError):
    """The server did not come up: a preload module failed to import, or the server crashed or hung at start."""


def preload_problem(preload: object) -> str | None:
    """Why `preload` is not a tuple of entries "package.module", "package.module:function" or "/absolute/file.py",
    or None."""
    if not isinstance(preload, tuple):
        return f"preload must be a tuple of module names, got {preload!r}"
    for name in preload:
        if not isinstance(name, str) or not (_PRELOAD_ENTRY.fullmatch(name) or _PRELOAD_PATH.fullmatch(name)):
            return (f"preload entry {name!r} is not a dotted module name (optionally with ':function') nor the "
                    f"absolute path of a .py file (without ',' or ':')")
    return None


@attrs.frozen
class WarmLauncherConfig:
    """Time bounds of the launcher's conversations with its server."""

    start_timeout_s: float = attrs.field(default=120.0, validator=positive)
    """How long the server may take to import the preload modules and say it is ready."""
    launch_timeout_s: float = attrs.field(default=30.0, validator=positive)
    """How long one fork may take to be answered; a server that does not answer is treated as dead."""
    close_timeout_s: float = attrs.field(default=10.0, validator=positive)
    """How long `close()` waits for the server to kill its children and exit before it is SIGKILLed."""


class LaunchedProcess:
    """A child of the server, as far as the executor needs a process: pid (= its process group id), returncode
    (None while it runs) and wait()."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._exited = asyncio.Event()

    async def wait(self) -> int:
        """Wait until it has ended; its exit code, or -signum if a signal killed it."""
        await self._exited.wait()
        assert self.returncode is not None
        return self.returncode

    def _set_exited(self, returncode: int) -> None:
        if self.returncode is None:
            self.returncode = returncode
            self._exited.set()

    def __repr__(self) -> str:
        return f"<LaunchedProcess pid={self.pid} returncode={self.returncode}>"


def _venv_root(executable: str) -> str | None:
    """The virtual environment an interpreter path belongs to: a venv's `python` links to the base interpreter, so
    equal realpaths alone do not mean equal site-packages."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(executable)))
    return root if os.path.isfile(os.path.join(root, "pyvenv.cfg")) else None


class WarmLauncher:
    """Client of one fork server (module docstring). Use from one event loop."""

    def __init__(self, config: WarmLauncherConfig | None = None) -> None:
        self.config = config or WarmLauncherConfig()
        self._interpreter = os.path.realpath(sys.executable)
        self._venv = _venv_root(sys.executable)
        self._server: asyncio.subprocess.Process | None = None
        self._reader: asyncio.Task | None = None
        self._pending: dict[int, asyncio.Future[LaunchedProcess]] = {}
        self._live: dict[int, LaunchedProcess] = {}
        self._next_id = 0
        self._state = "new"  # new -> running -> closed | dead
        self._ended = asyncio.Event()

    # ---- state ----------------------------------------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        """Whether launches can go through the server now."""
        return self._state == "running"

    @property
    def died(self) -> bool:
        """Whether the server ended without being asked to."""
        return self._state == "dead"

    @property
    def server_pid(self) -> int | None:
        return self._server.pid if self._server is not None else None

    async def wait_ended(self) -> None:
        """Wait until the server has ended (closed or died) and every child it launched is accounted for."""
        await self._ended.wait()

    # ---- start ----------------------------------------------------------------------------------------------------
    async def start(self, preload: tuple[str, ...]) -> None:
        """Start the server and wait until it has imported `preload`. Raises ValueError for a bad module name and
        LauncherStartFailed if an import fails or the server does not come up within `start_timeout_s`."""
        problem = preload_problem(preload)
        if problem is not None:
            raise ValueError(problem)
        if self._state != "new":
            raise RuntimeError(f"start() on a launcher that is {self._state}")
        self._state = "starting"
        try:
            server = await asyncio.create_subprocess_exec(
                sys.executable, "-m", SERVER_MODULE, "--preload", ",".join(preload),
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            )
        except BaseException:
            self._finish("closed")
            raise
        self._server = server
        assert server.stdout is not None
        try:
            first = await asyncio.wait_for(server.stdout.readline(), self.config.start_timeout_s)
            hello = json.loads(first) if first else {}
            hello = hello if isinstance(hello, dict) else {"error": f"unexpected first line {first!r}"}
        except (asyncio.TimeoutError, ValueError) as error:
            hello = {"error": f"no ready line from the server: {error!r}"}
        except BaseException:
            await self._kill_server()
            self._finish("closed")
            raise
        if "ready" not in hello:
            await self._kill_server()
            self._finish("closed")
            reason = hello.get("error") or f"the server exited with {server.returncode} before it was ready"
            raise LauncherStartFailed(f"warm launcher did not start: {reason}")
        if self._state != "starting":  # closed while it was starting
            await self._kill_server()
            raise LauncherClosed("the warm launcher was closed while it started")
        self._state = "running"
        self._reader = asyncio.get_running_loop().create_task(self._read_replies(), name="warm_launcher.reader")
        log.info("warm_launcher_started", server_pid=server.pid, preload=list(preload))

    # ---- launching ------------------------------------------------------------------------------------------------
    def accepts(self, argv: tuple[str, ...] | list[str], cwd: str | os.PathLike[str] | None = None,
                env: dict[str, str] | None = None) -> bool:
        """Whether `argv` is `<this interpreter> [STARTUP_FLAGS...] <existing script file> args...` (script
        relative to `cwd`, the program looked up on env's PATH, as a plain exec would): only that can be launched
        warm."""
        if not all(isinstance(a, str) and a for a in argv):
            return False
        argv = _without_startup_flags(argv)
        if len(argv) < 2:
            return False
        program, script = argv[0], argv[1]
        if "/" in program and not os.path.isabs(program) and cwd is not None:
            program = os.path.join(cwd, program)
        found = shutil.which(program, path=None if env is None else env.get("PATH", os.defpath))
        if found is None or os.path.realpath(found) != self._interpreter or _venv_root(found) != self._venv:
            return False
        if script.startswith("-"):
            return False
        if not os.path.isabs(script):
            script = os.path.join(cwd if cwd is not None else os.getcwd(), script)
        return os.path.isfile(script)

    async def launch(self, argv: tuple[str, ...] | list[str], cwd: str | os.PathLike[str], env: dict[str, str],
                     stdout_path: str | os.PathLike[str], stderr_path: str | os.PathLike[str]) -> LaunchedProcess:
        """Fork a child that runs the script (argv[1], once STARTUP_FLAGS are left out) with sys.argv = argv[1:],
        in `cwd`, with exactly `env`, stdin from /dev/null, stdout and stderr truncated into the two files, in a
        process group of its own. Raises OSError as exec would (bad cwd, unwritable file, fork failure),
        LauncherDied or LauncherClosed."""
        self._check_usable()
        argv = _without_startup_flags(argv)
        request_id = self._next_id
        self._next_id += 1
        line = (json.dumps({
            "id": request_id, "argv": list(argv), "cwd": os.fspath(cwd), "env": dict(env),
            "stdout_path": os.fspath(stdout_path), "stderr_path": os.fspath(stderr_path),
        }) + "\n").encode()
        if len(line) > MAX_REQUEST_BYTES:
            raise OSError(errno.E2BIG, f"launch request of {len(line)} bytes (max {MAX_REQUEST_BYTES})")
        assert self._server is not None and self._server.stdin is not None
        future: asyncio.Future[LaunchedProcess] = asyncio.get_running_loop().create_future()
        self._pending[request_id] = future
        try:
            self._server.stdin.write(line)
            await self._server.stdin.drain()
            return await asyncio.wait_for(asyncio.shield(future), self.config.launch_timeout_s)
        except (BrokenPipeError, ConnectionResetError) as error:
            raise LauncherDied(f"the warm launcher's server is gone: {error!r}") from error
        except asyncio.TimeoutError:
            log.error("warm_launcher_unresponsive", launch_timeout_s=self.config.launch_timeout_s)
            await self._kill_server()  # its reader then marks it dead and kills what it launched
            raise LauncherDied(f"the warm launcher did not answer within {self.config.launch_timeout_s}s") from None
        finally:
            # A launch that gave up (cancelled, timed out) before its reply: the reader kills that child when the
            # reply comes; cancelling the future keeps a late error from being logged as never retrieved.
            waiting = self._pending.pop(request_id, None)
            if waiting is not None and not waiting.done():
                waiting.cancel()

    def _check_usable(self) -> None:
        if self._state == "dead":
            raise LauncherDied("the warm launcher's server died")
        if self._state != "running":
            raise LauncherClosed(f"the warm launcher is {self._state}")

    # ---- replies --------------------------------------------------------------------------------------------------
    async def _read_replies(self) -> None:
        assert self._server is not None and self._server.stdout is not None
        reason = "EOF"
        try:
            while True:
                line = await self._server.stdout.readline()
                if not line:
                    break
                self._on_reply(json.loads(line))
        except (ValueError, KeyError, TypeError, ConnectionError) as error:  # a garbled reply: stop trusting it
            reason = repr(error)
            await self._kill_server()
        finally:
            closing = self._state == "closing"
            self._finish("closed" if closing else "dead")
        code = await self._server.wait()
        if not closing:
            log.error("warm_launcher_died", server_pid=self._server.pid, exit_code=code, reason=reason)

    def _on_reply(self, reply: dict[str, Any]) -> None:
        if "exited" in reply:
            process = self._live.pop(int(reply["exited"]), None)
            if process is not None:
                process._set_exited(int(reply["returncode"]))
            return
        future = self._pending.get(reply["id"])
        if "pid" in reply:
            process = LaunchedProcess(int(reply["pid"]))
            if future is None or future.done():  # nobody waits for it any more: it must not run unobserved
                _kill_group(process.pid)
            self._live[process.pid] = process
            if future is not None and not future.done():
                future.set_result(process)
        elif future is not None and not future.done():
            code = int(reply.get("errno") or 0)
            future.set_exception(OSError(code, reply["error"]) if code else OSError(reply["error"]))

    def _finish(self, state: str) -> None:
        """The server is gone: fail waiting launches, and kill and release every child it launched."""
        self._state = state
        error = LauncherDied("the warm launcher's server died") if state == "dead" else LauncherClosed(
            "the warm launcher was closed")
        for future in self._pending.values():
            if not future.done():
                future.set_exception(error)
        self._pending.clear()
        for process in self._live.values():
            _kill_group(process.pid)
            process._set_exited(-signal.SIGKILL)
        self._live.clear()
        self._ended.set()

    # ---- closing --------------------------------------------------------------------------------------------------
    def close_nowait(self) -> None:
        """Ask the server to end (its stdin closes: it SIGKILLs its children and exits) without waiting for it."""
        if self._state in ("running", "starting"):
            self._state = "closing"
        if self._server is not None and self._server.stdin is not None and not self._server.stdin.is_closing():
            self._server.stdin.close()
        if self._reader is None and self._state in ("new", "closing"):
            self._finish("closed")

    async def close(self) -> None:
        """End the server and every child it launched; wait (up to `close_timeout_s`) for that, then SIGKILL it."""
        self.close_nowait()
        if self._server is None:
            return
        try:
            await asyncio.wait_for(self._server.wait(), self.config.close_timeout_s)
        except asyncio.TimeoutError:
            log.warning("warm_launcher_close_timeout", server_pid=self._server.pid)
            await self._kill_server()
        if self._reader is not None:
            await self._reader

    async def _kill_server(self) -> None:
        assert self._server is not None
        if self._server.returncode is None:
            try:
                self._server.kill()
            except ProcessLookupError:
                pass
            await self._server.wait()


async def watch_launcher(launcher: WarmLauncher, logger: Any) -> None:
    """Wait until the server has ended, and say once (on `logger`) if it died: its owner runs later launches the plain
    way. Run it as the owning actor's child task: cancelled when the actor stops or fails, it ends the server (a
    restarted actor starts a fresh one)."""
    try:
        await launcher.wait_ended()
    finally:
        launcher.close_nowait()
    if launcher.died:
        logger.warning("warm_launcher_died", fallback="plain exec for the rest of the run")


def _without_startup_flags(argv: tuple[str, ...] | list[str]) -> list[str]:
    """argv with the STARTUP_FLAGS between the program and the first other argument left out."""
    rest = 1
    while rest < len(argv) and argv[rest] in STARTUP_FLAGS:
        rest += 1
    return [*argv[:1], *argv[rest:]]


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
