"""The warm launcher's server: a fork server (zygote) that imports heavy modules once and forks one child per agent run.

Why: a fresh `python agent.py` that imports `openai` spends ~2 CPU-seconds on imports before its first model call;
the executor runs thousands of such short agents. This process pays the imports once (`--preload openai,structlog`),
and runs warm-ups once (`gyre.actors.executions.sdk_warmup:openai_client`: the SDK's first request imports ~140 more modules,
0.13 CPU-s that every agent would pay again). Then each request forks a child that already has them in
`sys.modules` and runs the agent script in it, with the script's own argv, cwd, environment, stdio files and process
group, as `python script.py args...` would.

Protocol (newline-delimited JSON; the client is gyre.actors.executions.warm_launcher.WarmLauncher):
- first line out: {"ready": <server pid>} once the preload is done, or {"error": "..."} and exit 2;
- in: {"id", "argv": [python, script, args...], "cwd", "env": {str: str}, "stdout_path", "stderr_path"};
- out: {"id", "pid"} when the child is forked, or {"id", "error", "errno"} when it could not be (bad cwd, log
  file not writable, fork failed; the server goes on). The child runs no line of the script before its pid reply is
  written, so even a script that kills the server at once is a child the client knows of (and kills);
- out: {"exited": pid, "returncode": rc} when a child ends (rc as asyncio reports it: the exit code, or -signum).
On stdin EOF every live child's process group is SIGKILLed and reaped, and the server exits 0.

Single-threaded on purpose: fork() in a process with other threads copies locks held by threads that do not exist
in the child. Child exits are noticed through SIGCHLD -> `signal.set_wakeup_fd` -> the selector, and reaped with
waitpid(WNOHANG), so an exit is reported as soon as it happens, not on the next request.

The protocol runs on private duplicates of fds 0 and 1; fd 0 becomes /dev/null and fd 1 a copy of stderr, so a
preloaded module that prints cannot corrupt the protocol. Linux (POSIX fork) only.

Each script is compiled once, in the server (`ScriptCache`: keyed by its path, invalidated when its size or
modification time changes), and every child runs that code object: a fresh `python agent.py` compiles its script
on every start, never caching the bytecode of `__main__` (~3 CPU-ms for the toolbox agent, thousands of runs a
training run). A script that is not a plain `.py` file (a directory, a zip, compiled bytecode) is left to runpy.

Differences from a fresh interpreter, by design: preloaded modules are imported once, with the server's environment
and working directory (a module that captures either at import time sees the server's, not the agent's); the hash
seed and interpreter flags are the server's; third-party RNG state (numpy, ...) imported by the preload is shared by
all children (the stdlib `random` reseeds itself after fork).
"""

from __future__ import annotations

import argparse
import atexit
import errno
import importlib
import importlib.util
import io
import json
import os
import runpy
import selectors
import signal
import stat
import sys
import threading
import traceback
import types
from typing import Any

#: A request line longer than this breaks the protocol (the client refuses to send one, like exec's E2BIG).
MAX_REQUEST_BYTES = 8 * 1024 * 1024
_READ_BYTES = 65536
#: Compiled scripts the server keeps at most (a run launches one or two scripts thousands of times).
MAX_CACHED_SCRIPTS = 64


class _ClientGone(Exception):
    """The reply pipe is closed: nobody is left to report to."""


def _write_all(fd: int, data: bytes) -> None:
    # A blocking write to a pipe can still return short when a signal (SIGCHLD) interrupts it mid-way.
    view = memoryview(data)
    while view:
        try:
            written = os.write(fd, view)
        except BrokenPipeError as error:
            raise _ClientGone() from error
        view = view[written:]


def _exit_code(code: object) -> int:
    """The exit status the interpreter derives from SystemExit.code (the OS keeps the low 8 bits)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code % 256
    try:
        sys.stderr.write(f"{code}\n")
    except Exception:
        pass
    return 1


def _pythonpath(env: dict[str, str]) -> list[str]:
    return [entry for entry in env.get("PYTHONPATH", "").split(os.pathsep) if entry]


class ScriptCache:
    """Code objects of the scripts the server has run, compiled once: `code_for` compiles a script the first time
    and again only once its file changed (size, modification time or inode), as a .pyc would be."""

    def __init__(self, max_scripts: int = MAX_CACHED_SCRIPTS) -> None:
        self.max_scripts = max_scripts
        self._entries: dict[str, tuple[tuple[int, int, int, int], types.CodeType]] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def code_for(self, path: str) -> types.CodeType | None:
        """The code of the script at `path` (absolute), or None: not a plain .py file, unreadable, or it does not
        compile. A None leaves the script to runpy in the child, which reports any problem as the interpreter
        would."""
        if not path.endswith(".py"):
            return None
        try:
            found = os.stat(path)
        except OSError:
            return None
        if not stat.S_ISREG(found.st_mode):
            return None
        key = (found.st_dev, found.st_ino, found.st_size, found.st_mtime_ns)
        cached = self._entries.get(path)
        if cached is not None and cached[0] == key:
            return cached[1]
        try:
            with io.open_code(path) as file:
                source = file.read()
            if source[:4] == importlib.util.MAGIC_NUMBER:
                return None  # compiled bytecode under a .py name: runpy reads it as such
            # dont_inherit: this module's `from __future__ import annotations` must not leak into the script.
            code = compile(source, path, "exec", dont_inherit=True)
        except (OSError, SyntaxError, ValueError):
            return None
        if len(self._entries) >= self.max_scripts:
            self._entries.clear()
        self._entries[path] = (key, code)
        return code


def _run_main_code(code: types.CodeType, script: str) -> None:
    """Execute `code` (compiled from `script`) as __main__, with the globals runpy.run_path(script,
    run_name="__main__") gives a plain .py file: a fresh module in sys.modules["__main__"], __file__ the script,
    no loader or spec, sys.argv[0] the script while it runs."""
    module = types.ModuleType("__main__")
    module.__dict__.update(__name__="__main__", __file__=script, __cached__=None, __doc__=None, __loader__=None,
                           __package__="", __spec__=None)
    saved_main, saved_argv0 = sys.modules.get("__main__"), sys.argv[0]
    sys.modules["__main__"] = module
    sys.argv[0] = script
    try:
        exec(code, module.__dict__)
    finally:
        sys.argv[0] = saved_argv0
        if saved_main is not None:
            sys.modules["__main__"] = saved_main


def _run_script(argv: list[str], server_pythonpath: list[str],
                compiled: tuple[str, types.CodeType] | None = None) -> tuple[int, bool]:
    """Run argv[1] as __main__ the way `python script args` does; return (exit status, interrupted by Ctrl-C).
    `compiled` is (absolute path, code) of the script as the server compiled it before forking: run when it names
    the path the child resolves (the cwd may hold a symlink the server did not resolve alike)."""
    script = os.path.abspath(argv[1])  # after chdir: relative to the agent's cwd, as the interpreter resolves it
    sys.argv = list(argv[1:])
    sys.path[0] = os.path.dirname(os.path.realpath(script))
    wanted = _pythonpath(dict(os.environ))
    if wanted != server_pythonpath:  # the agent's PYTHONPATH, not the server's, follows the script's directory
        rest = [p for p in sys.path[1:] if p not in server_pythonpath]
        sys.path[:] = [sys.path[0], *wanted, *rest]
    atexit._clear()
    try:
        with open(script, "rb"):
            pass
    except OSError as error:  # what the interpreter says and returns for a script it cannot open
        sys.stderr.write(f"{sys.executable}: can't open file {script!r}: [Errno {error.errno}] {error.strerror}\n")
        return 2, False
    code, interrupted = 0, False
    try:
        if compiled is not None and compiled[0] == script:
            _run_main_code(compiled[1], script)
        else:
            runpy.run_path(script, run_name="__main__")
    except SystemExit as exit_:
        code = _exit_code(exit_.code)
    except KeyboardInterrupt:
        sys.excepthook(*sys.exc_info())
        code, interrupted = 1, True
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    # The interpreter's own shutdown order: wait for non-daemon threads (this also runs threading's exit hooks,
    # e.g. concurrent.futures telling idle workers to quit), then atexit callbacks.
    try:
        threading._shutdown()  # type: ignore[attr-defined]
    except BaseException:
        traceback.print_exc()
    atexit._run_exitfuncs()
    return code, interrupted


class Server:
    """One fork server: preloaded modules, live children, the request loop."""

    def __init__(self, proto_in: int, proto_out: int) -> None:
        # Ctrl-C on the executor's terminal reaches this process too; the server ends on stdin EOF instead, and
        # each child gets back the SIGINT disposition a fresh interpreter would have had.
        self.previous_sigint = signal.signal(signal.SIGINT, signal.SIG_IGN)
        self.proto_in = proto_in
        self.proto_out = proto_out
        self.children: set[int] = set()
        self.server_pythonpath = _pythonpath(dict(os.environ))
        self.scripts = ScriptCache()
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        os.set_blocking(self.wake_w, False)
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.proto_in, selectors.EVENT_READ, "requests")
        self.selector.register(self.wake_r, selectors.EVENT_READ, "sigchld")
        # A Python-level handler is what makes the C handler write to the wakeup fd; it does nothing itself.
        self.previous_sigchld = signal.signal(signal.SIGCHLD, lambda signum, frame: None)
        signal.set_wakeup_fd(self.wake_w, warn_on_full_buffer=False)

    def send(self, reply: dict[str, Any]) -> None:
        _write_all(self.proto_out, (json.dumps(reply) + "\n").encode())

    def serve(self) -> int:
        buffer = b""
        try:
            while True:
                for key, _ in self.selector.select():
                    if key.data == "sigchld":
                        self._drain_wakeup()
                        self.reap()
                        continue
                    data = os.read(self.proto_in, _READ_BYTES)
                    if not data:
                        return self.shutdown()
                    buffer += data
                    *lines, buffer = buffer.split(b"\n")
                    if len(buffer) > MAX_REQUEST_BYTES:
                        sys.stderr.write(f"warm launcher: a request longer than {MAX_REQUEST_BYTES} bytes\n")
                        self.shutdown()
                        return 1
                    for line in lines:
                        if line.strip():
                            self.handle(line)
                self.reap()  # a lost wakeup byte (full pipe) must not hide an exit
        except _ClientGone:
            self.shutdown()
            return 0

    def _drain_wakeup(self) -> None:
        try:
            while os.read(self.wake_r, 4096):
                pass
        except BlockingIOError:
            pass

    def reap(self) -> None:
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            if pid in self.children:
                self.children.discard(pid)
                self.send({"exited": pid, "returncode": os.waitstatus_to_exitcode(status)})

    def shutdown(self) -> int:
        """No client any more: no child may outlive the server."""
        for pid in self.children:
            for kill in (os.killpg, os.kill):  # the group, and the child itself should it have left its group
                try:
                    kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        for pid in sorted(self.children):
            try:
                _, status = os.waitpid(pid, 0)
            except ChildProcessError:
                continue
            try:
                self.send({"exited": pid, "returncode": os.waitstatus_to_exitcode(status)})
            except _ClientGone:
                pass
        self.children.clear()
        return 0

    def handle(self, line: bytes) -> None:
        request_id = None
        try:
            request = json.loads(line)
            if not isinstance(request, dict):
                raise ValueError("a request must be a JSON object")
            request_id = request.get("id")
            argv, cwd, env = request["argv"], request["cwd"], request["env"]
            stdout_path, stderr_path = request["stdout_path"], request["stderr_path"]
            if not (isinstance(argv, list) and len(argv) >= 2 and all(isinstance(a, str) and a for a in argv)):
                raise ValueError("argv must be [python, script, args...] of non-empty strings")
            if not (isinstance(env, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())):
                raise ValueError("env must map strings to strings")
            if not all(isinstance(p, str) and p for p in (cwd, stdout_path, stderr_path)):
                raise ValueError("cwd, stdout_path and stderr_path must be non-empty strings")
        except (ValueError, KeyError) as error:
            self.send({"id": request_id, "error": f"bad request: {error!r}", "errno": errno.EINVAL})
            return
        try:
            pid, go_w = self.fork_child(argv, cwd, env, stdout_path, stderr_path)
        except OSError as error:  # bad cwd, unwritable log file, fork failure: this request fails, not the server
            self.send({"id": request_id, "error": f"{type(error).__name__}: {error}", "errno": error.errno or 0})
            return
        self.children.add(pid)
        try:
            self.send({"id": request_id, "pid": pid})
            try:
                os.write(go_w, b"g")  # the reply is in the client's pipe: the script may run now
            except BrokenPipeError:  # the child was killed before it could start: its exit is reaped as any other
                pass
        finally:
            os.close(go_w)

    def fork_child(self, argv: list[str], cwd: str, env: dict[str, str], stdout_path: str,
                   stderr_path: str) -> tuple[int, int]:
        """Fork a child for one run; its pid, and the fd to write one byte to once the client has been told that pid.

        The child runs nothing of the script before that byte: a script that kills this server at once must not
        leave a child the client never heard of (it would run on, unkillable by the client). Should the server die
        first, the child reads EOF and exits without running the script."""
        # Opened here, not in the child, so that a bad path is an error reply (as create_subprocess_exec raises).
        opened: list[int] = []
        try:
            opened.append(os.open(cwd, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC))
            opened.append(os.open(stdout_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o666))
            opened.append(os.open(stderr_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o666))
            sys.stdout.flush()  # buffered text would otherwise be written once more by every child
            sys.stderr.flush()
            # The pid goes out only once the child leads its own process group (as create_subprocess_exec returns
            # after start_new_session took effect): a group signal sent right after the reply must reach it.
            in_group_r, in_group_w = os.pipe()
            opened += [in_group_r, in_group_w]
            go_r, go_w = os.pipe2(os.O_CLOEXEC)
            opened += [go_r, go_w]
            # Compiled here, once per script, so that every child runs the same code object (module docstring).
            script = os.path.abspath(os.path.join(cwd, argv[1]))
            code = self.scripts.code_for(script)
            compiled = (script, code) if code is not None else None
            pid = os.fork()
            if pid == 0:
                self._become_child(argv, env, compiled, *opened)  # never returns
            os.close(in_group_w)
            opened.remove(in_group_w)
            os.read(in_group_r, 1)  # EOF once the child has called setsid() (or died)
            opened.remove(go_w)
            return pid, go_w
        finally:
            for fd in opened:
                os.close(fd)

    def _become_child(self, argv: list[str], env: dict[str, str], compiled: tuple[str, types.CodeType] | None,
                      cwd_fd: int, out_fd: int, err_fd: int, in_group_r: int, in_group_w: int, go_r: int,
                      go_w: int) -> None:
        code, interrupted = 1, False
        try:
            os.close(go_w)
            try:
                os.setsid()  # its own session and process group: the executor signals the group by the child's pid
            finally:
                os.close(in_group_w)  # tells the server the group exists
                os.close(in_group_r)
            confirmed = os.read(go_r, 1)  # the server has told the client this pid (see fork_child)
            os.close(go_r)
            if not confirmed:
                os.write(err_fd, b"warm launcher: the server ended before this run was reported; not running it\n")
                os._exit(1)
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, self.previous_sigchld)
            signal.signal(signal.SIGINT, self.previous_sigint)
            self.selector.close()
            for fd in (self.proto_in, self.proto_out, self.wake_r, self.wake_w):
                os.close(fd)
            os.fchdir(cwd_fd)
            null = os.open(os.devnull, os.O_RDONLY)
            os.dup2(null, 0)
            os.dup2(out_fd, 1)
            os.dup2(err_fd, 2)
            for fd in (null, cwd_fd, out_fd, err_fd):
                os.close(fd)
            os.environ.clear()
            os.environ.update(env)
            code, interrupted = _run_script(argv, self.server_pythonpath, compiled)
        except BaseException:
            try:
                traceback.print_exc()
            except BaseException:
                pass
        finally:
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except BaseException:
                    pass
            if interrupted:  # like the interpreter: die of SIGINT, so the parent sees -2
                signal.signal(signal.SIGINT, signal.SIG_DFL)
                os.kill(os.getpid(), signal.SIGINT)
            os._exit(code)


PRELOADED_FILE_PREFIX = "_gyre_preloaded_"
"""A file preloaded by path is imported as the module named this plus its stem (not importable by that name by
accident: it only has to sit in sys.modules, with whatever the file's own import did)."""


def _import_file(path: str) -> None:
    """Import the Python file at `path` as a module of its own. Why: an agent script's siblings are on no import
    path, but importing the script itself runs its imports (its module body, not its `__main__` block), so every
    fork finds those modules in sys.modules and runs only the script's own body (~4.5 of ~31 CPU-ms a toolbox
    agent; BENCHMARKS.md, session 26)."""
    name = PRELOADED_FILE_PREFIX + os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise


def _preload(entries: list[str]) -> str | None:
    """Import every module (or file, for an absolute path) and call each "module:function" warm-up; the first
    failure as text, or None."""
    for entry in entries:
        try:
            if entry.startswith("/"):
                _import_file(entry)
                continue
            module_name, _, function_name = entry.partition(":")
            module = importlib.import_module(module_name)
            if function_name:
                getattr(module, function_name)()
        except BaseException as error:  # SystemExit from a module's import is a failure too
            return f"preload {entry!r} failed: {type(error).__name__}: {error}"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Fork server for agent processes (gyre.actors.executions.warm_launcher).")
    parser.add_argument("--preload", default="", help="comma-separated modules to import once, e.g. openai,structlog; "
                        "an entry module:function also calls that function once (a warm-up)")
    args = parser.parse_args(argv)
    proto_in, proto_out = os.dup(0), os.dup(1)  # non-inheritable: agents' own subprocesses never see them
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.dup2(2, 1)
    problem = _preload([name for name in args.preload.split(",") if name])
    if problem is not None:
        _write_all(proto_out, (json.dumps({"error": problem}) + "\n").encode())
        return 2
    if threading.active_count() > 1:  # forking with live threads is unsafe: say so rather than hang later
        sys.stderr.write(f"warm launcher: the preload started {threading.active_count() - 1} thread(s)\n")
    server = Server(proto_in, proto_out)
    try:
        server.send({"ready": os.getpid()})
    except _ClientGone:
        return 0
    return server.serve()


if __name__ == "__main__":
    sys.exit(main())
