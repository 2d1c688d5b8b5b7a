"""Sandboxes for agents and scorers: one interface, two backends.

`open_sandbox(config, request)` turns a `SandboxRequest` (the command, its complete environment, the workspace and
where it is mounted, extra read-only and writable mounts, resource limits, the proxy to reach) into a
`PreparedSandbox`: the argv, environment and working directory to exec on the host, and `close()`, which kills
whatever is left of the sandbox and removes what was made for it. The executor (agents) and the evaluator (scorers)
exec it exactly as they exec a plain command, in a process group of their own, so time limits work unchanged.

Backends (`SandboxConfig.kind`):
- "none": today's behaviour, for trusted commands (the toolbox tests): the command runs on the host as it is, with
  the caller's environment, in the workspace. It refuses a request it cannot honour (a workspace mounted at another
  path such as /app, extra mounts), so a task made for a sandbox never runs wrongly without one.
- "bubblewrap" (`bwrap`, Debian package bubblewrap; needs root here, no user namespace is used):
  * file system: a fresh root in which every top-level host directory is bound read-only (symlinks such as /bin
    recreated), `/tmp` and `/run` private tmpfs, `/dev` and `/proc` minimal (a new pid namespace: no other process
    is visible); each path of `hide` (the executor's workspace root, so other executions' workspaces, logs and
    sockets) is covered by an empty tmpfs; the workspace is the only writable host path, bound at `workdir`
    (`/app` for Harbor tasks); `writable_mounts` (a verifier's fresh /logs/verifier) are bound after it;
  * network: a new network namespace with only loopback. The proxy is reached at http://127.0.0.1:PORT inside (PORT
    the proxy's own port): sandbox_init.py listens there and pipes each connection to a unix socket bound in at
    /run/gyre/proxy.sock, whose host end (an asyncio server here) connects to the proxy. Nothing else is routable;
  * identity: sandbox_init drops to `uid`/`gid` (65534, nobody, by default) before anything of the task runs, and
    bwrap sets no_new_privs, so setuid programs gain nothing; the workspace is chowned to that uid first;
  * environment: cleared; only `request.env` (what the task and the agent declare, plus the proxy variables) is set;
  * limits: a cgroup per sandbox (v1: the memory, pids and cpu controllers; v2: one group with all three) with
    memory (`memory_mb`, swap included where the kernel accounts it), processes (`max_processes`) and CPU
    (`cpus`, a CFS quota); the host-side launcher writes its own pid into the groups before it execs bwrap, so
    nothing escapes them by forking early;
  * end: bwrap runs with --die-with-parent, so when the caller kills the launcher's process group (time limit) the
    whole pid namespace dies; `close()` then SIGKILLs every process still in the sandbox's pids cgroup and removes
    the groups.
  A host without bwrap or without writable cgroup controllers gets `SandboxUnavailable` when the sandbox opens.

A docker backend (for clusters) has the same interface and will need: an image per task (Harbor's
environment/Dockerfile built, or pulled) instead of the host root; `--network none` plus the same unix-socket
forwarder (the socket bind-mounted, the forwarder as the container's entry point, or a sidecar); `--user`,
`--memory`, `--pids-limit`, `--cpus`, `--read-only` with the workspace as a volume at `workdir` and a tmpfs /tmp;
`docker kill` on time out and `docker rm` in `close()`; the workspace copied out (or a volume) so the verifier
runs on the preserved state in a second container with tests/ mounted.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path
from typing import Iterable
from urllib.parse import urlsplit, urlunsplit

import attrs
import structlog

from gyre.actors.errors import ActorError
from gyre.runtime.validators import count, positive

__all__ = [
    "SANDBOX_KINDS",
    "PreparedSandbox",
    "SandboxConfig",
    "SandboxRequest",
    "SandboxUnavailable",
    "SandboxRefused",
    "open_sandbox",
    "proxy_url_inside",
    "sandbox_problem",
]

log = structlog.get_logger(__name__)

SANDBOX_KINDS = ("none", "bubblewrap")
INIT_SCRIPT = Path(__file__).with_name("sandbox_init.py")
SOCKET_DIR_INSIDE = "/run/gyre"
SOCKET_INSIDE = f"{SOCKET_DIR_INSIDE}/proxy.sock"
KILL_SWEEPS = 20
"""Rounds of SIGKILL over a pids cgroup in `close()` before giving up (a fork race can refill it for a round or
two; twenty rounds is far beyond what a frozen-by-pids.max group needs)."""
_NUMBERS = itertools.count()
_SKIPPED_ROOT_ENTRIES = frozenset({"proc", "dev", "tmp", "run", "sys", "lost+found"})


class SandboxUnavailable(ActorError, RuntimeError):
    """The host cannot make this kind of sandbox (no bwrap, no writable cgroup controller)."""


class SandboxRefused(ActorError, ValueError):
    """The request asks for what this backend cannot honour (the reason says what)."""


def _kind(instance: object, attribute: attrs.Attribute, value: object) -> None:
    if value not in SANDBOX_KINDS:
        raise ValueError(f"{attribute.name} must be one of {SANDBOX_KINDS}, got {value!r}")


@attrs.frozen
class SandboxConfig:
    """Which backend, and its defaults for a task that names no limits."""

    kind: str = attrs.field(default="none", validator=_kind)
    """"none" (trusted commands, run as they are) or "bubblewrap" (module docstring)."""
    uid: int = 65534
    """Uid everything in a bubblewrap sandbox runs as (nobody)."""
    gid: int = 65534
    """Its gid (nogroup)."""
    memory_mb: int = attrs.field(default=2048, validator=count)
    """Memory limit of a sandbox whose request names none (Harbor's default is 2 GB too)."""
    max_processes: int = attrs.field(default=512, validator=count)
    """Processes and threads in one sandbox when the request names none: enough for a test run with a thread pool,
    far below what would starve the host."""
    cpus: float = attrs.field(default=1.0, validator=positive)
    """CPU quota of a sandbox whose request names none, in cores."""
    bwrap: str = "bwrap"
    """The bubblewrap program."""
    hidden_paths: tuple[str, ...] = ("/root",)
    """Host directories every sandbox sees as empty (root's home: its keys and caches are no agent's business)."""
    exposed_paths: tuple[str, ...] = ()
    """Host directories bound read-only at their own path even inside a hidden one. The running interpreter's
    installation and this package's folder are always exposed: sandbox_init runs on them (and agents such as
    mini-swe-agent run as `sys.executable ...`, e.g. on a pyenv Python under /root)."""


@attrs.frozen
class SandboxRequest:
    """One command to run in one sandbox."""

    argv: tuple[str, ...]
    """The command."""
    env: dict[str, str]
    """Its complete environment (bubblewrap sets exactly this; "none" uses it as given)."""
    workspace: str
    """Host directory of the workspace: the only writable host path."""
    workdir: str = ""
    """Where the workspace appears inside and the command starts ("" = at its host path)."""
    read_only_mounts: tuple[tuple[str, str], ...] = ()
    """(host path, path inside) bound read-only (a verifier's tests at /tests, an oracle's solution)."""
    writable_mounts: tuple[tuple[str, str], ...] = ()
    """(host directory, path inside) bound writable (a verifier's /logs/verifier)."""
    hide: tuple[str, ...] = ()
    """Host directories covered by an empty tmpfs (other executions' workspaces)."""
    proxy_url: str = ""
    """The proxy's URL on the host (http://HOST:PORT/...); "" = no proxy reachable."""
    memory_mb: int = 0
    """Memory limit; 0 = the config's."""
    max_processes: int = 0
    """Process limit; 0 = the config's."""
    cpus: float = 0.0
    """CPU quota in cores; 0 = the config's."""


def proxy_url_inside(url: str) -> str:
    """The URL an agent in a bubblewrap sandbox uses for the proxy at `url`: the same port on 127.0.0.1."""
    parts = urlsplit(url)
    if parts.port is None:
        return url
    return urlunsplit(parts._replace(netloc=f"127.0.0.1:{parts.port}"))


class PreparedSandbox:
    """What to exec on the host for one sandboxed command, and the clean-up (`close`, safe to call twice)."""

    def __init__(self, argv: tuple[str, ...], env: dict[str, str], cwd: str) -> None:
        self.argv = argv
        self.env = env
        self.cwd = cwd
        self.cgroups: dict[str, Path] = {}
        """Controller name -> this sandbox's cgroup folder (empty for "none")."""
        self._server: asyncio.AbstractServer | None = None
        self._scratch: Path | None = None
        self._connections: set[asyncio.Task] = set()

    async def close(self) -> None:
        """Kill what is left in the sandbox, stop its proxy forwarder, remove its cgroups and scratch folder."""
        if self._server is not None:
            self._server.close()
            self._server = None
        for task in list(self._connections):
            task.cancel()
        if self.cgroups:
            await asyncio.to_thread(_kill_and_remove, self.cgroups)
            self.cgroups = {}
        if self._scratch is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)
            self._scratch = None


def sandbox_problem(config: SandboxConfig, workdir: str, needs_mounts: bool) -> str | None:
    """Why a task with this workdir (and mounts, or not) cannot run under `config`'s backend, or None; a task made
    for a sandbox is refused without one rather than run wrongly."""
    if config.kind == "none" and (workdir or needs_mounts):
        what = f"mount the workspace at {workdir}" if workdir else "mount the task's directories"
        return f"the task needs a sandbox that can {what}; the `none` sandbox cannot (use bubblewrap)"
    return None


async def open_sandbox(config: SandboxConfig, request: SandboxRequest) -> PreparedSandbox:
    """Prepare `request` under `config`'s backend. Raises SandboxRefused (the request) or SandboxUnavailable (the
    host)."""
    if not request.argv:
        raise SandboxRefused("the command is empty")
    if config.kind == "none":
        if request.workdir and os.path.abspath(request.workdir) != os.path.abspath(request.workspace):
            raise SandboxRefused(f"the `none` sandbox cannot mount the workspace at {request.workdir}; "
                                 "use the bubblewrap sandbox")
        if request.read_only_mounts or request.writable_mounts:
            inside = [p for _, p in request.read_only_mounts + request.writable_mounts]
            raise SandboxRefused(f"the `none` sandbox cannot mount {', '.join(inside)}; use the bubblewrap sandbox")
        return PreparedSandbox(request.argv, dict(request.env), request.workspace)
    return await _open_bubblewrap(config, request)


# ---- bubblewrap ---------------------------------------------------------------------------------------------------
async def _open_bubblewrap(config: SandboxConfig, request: SandboxRequest) -> PreparedSandbox:
    bwrap = shutil.which(config.bwrap)
    if bwrap is None:
        raise SandboxUnavailable(f"the bubblewrap sandbox needs `{config.bwrap}` (Debian package bubblewrap)")
    workdir = request.workdir or request.workspace
    for _, inside in (("", workdir), *request.read_only_mounts, *request.writable_mounts):
        if not os.path.isabs(inside) or ".." in Path(inside).parts:
            raise SandboxRefused(f"mount point {inside!r} is not an absolute path")
    scratch = Path(tempfile.mkdtemp(prefix="gyre-sb-"))  # short: a unix socket path has ~100 characters at most
    prepared = PreparedSandbox((), {}, str(scratch))
    prepared._scratch = scratch
    try:
        await asyncio.to_thread(_chown_tree, [request.workspace, *(h for h, _ in request.writable_mounts)],
                                config.uid, config.gid)
        listen: tuple[str, ...] = ()
        socket_bind: tuple[str, ...] = ()
        if request.proxy_url:
            port = urlsplit(request.proxy_url).port
            host = urlsplit(request.proxy_url).hostname
            if port is None or host is None:
                raise SandboxRefused(f"proxy URL {request.proxy_url!r} names no host and port")
            os.chmod(scratch, 0o711)
            socket_path = scratch / "proxy.sock"
            prepared._server = await asyncio.start_unix_server(
                lambda r, w: _forward(prepared, r, w, host, port), path=str(socket_path)
            )
            os.chmod(socket_path, 0o777)  # the sandbox's uid connects; only the sandbox has this path bound
            listen = ("--listen", str(port), "--socket", SOCKET_INSIDE)
            socket_bind = ("--bind", str(scratch), SOCKET_DIR_INSIDE)
        prepared.cgroups = await asyncio.to_thread(
            _make_cgroups,
            request.memory_mb or config.memory_mb,
            request.max_processes or config.max_processes,
            request.cpus or config.cpus,
        )
        args: list[str] = [bwrap, "--die-with-parent", "--new-session", "--unshare-ipc", "--unshare-pid",
                           "--unshare-net", "--unshare-uts", "--unshare-cgroup-try", "--hostname", "sandbox"]
        args += _root_binds()
        args += ["--dev", "/dev", "--proc", "/proc", "--perms", "1777", "--tmpfs", "/tmp", "--tmpfs", "/run"]
        hidden_paths = (*config.hidden_paths, *request.hide)
        for hidden in hidden_paths:
            if os.path.isdir(hidden) and not _under(hidden, "/tmp") and not _under(hidden, "/run"):
                args += ["--perms", "0755", "--tmpfs", hidden]
        # bwrap makes missing mount points 0700 root, which the sandbox's uid could not pass: make them 0755 first.
        always = (os.path.realpath(sys.base_prefix), str(INIT_SCRIPT.parent))
        # Exposed again where the sandbox covers the host: a hidden path, and its private /tmp and /run (a checkout
        # or a virtual environment under /tmp, as CI's clone may be, must still run sandbox_init).
        covered = (*hidden_paths, "/tmp", "/run")
        exposed = [p for p in dict.fromkeys((*always, *config.exposed_paths))
                   if os.path.isdir(p) and any(_under(p, h) for h in covered)]
        mount_points = [workdir, *(p for _, p in request.read_only_mounts + request.writable_mounts), *exposed]
        for directory in _directories_to_make(mount_points, hidden_paths):
            args += ["--perms", "0755", "--dir", directory]
        for path in exposed:
            args += ["--ro-bind", path, path]
        args += ["--bind", request.workspace, workdir]
        for host_path, inside in request.read_only_mounts:
            args += ["--ro-bind", host_path, inside]
        for host_path, inside in request.writable_mounts:
            args += ["--bind", host_path, inside]
        args += [*socket_bind, "--remount-ro", "/", "--chdir", workdir, "--clearenv"]
        for name, value in sorted(request.env.items()):
            args += ["--setenv", name, value]
        args += ["--", sys.executable, "-S", "-I", str(INIT_SCRIPT), "--uid", str(config.uid), "--gid",
                 str(config.gid), *listen]
        # Variables the launch itself adds (the interpreter's locale coercion, bwrap's PWD) unless declared.
        undeclared = [name for name in ("LC_CTYPE", "PWD") if name not in request.env]
        if undeclared:
            args += ["--drop", ",".join(undeclared)]
        args += ["--", *request.argv]
        procs = [str(group / "cgroup.procs") for group in dict.fromkeys(prepared.cgroups.values())]
        # Join the groups before exec'ing bwrap, so that the sandbox is inside them from its first instruction.
        joiner = 'n=$1; shift; while [ "$n" -gt 0 ]; do echo $$ > "$1" || exit 125; shift; n=$((n-1)); done; exec "$@"'
        prepared.argv = ("/bin/sh", "-c", joiner, "sh", str(len(procs)), *procs, *args)
        prepared.env = {"PATH": os.environ.get("PATH", os.defpath)}
        return prepared
    except BaseException:
        await prepared.close()
        raise


def _directories_to_make(mount_points: list[str], hidden: tuple[str, ...]) -> list[str]:
    """The ancestors of the mount points that lie on a tmpfs of the sandbox (its root, /tmp, /run, a hidden path)
    rather than on a read-only host directory, outermost first."""
    wanted: list[str] = []
    for point in mount_points:
        parts = Path(point).parts[1:]
        for depth in range(1, len(parts)):
            ancestor = "/" + "/".join(parts[:depth])
            on_tmpfs = (parts[0] in ("tmp", "run") or not os.path.isdir(f"/{parts[0]}")
                        or parts[0] in _SKIPPED_ROOT_ENTRIES
                        or any(_under(ancestor, h) and os.path.abspath(ancestor) != os.path.abspath(h)
                               for h in hidden))
            if on_tmpfs and ancestor not in wanted and ancestor not in ("/tmp", "/run"):
                wanted.append(ancestor)
    return sorted(wanted, key=lambda d: d.count("/"))


def _under(path: str, parent: str) -> bool:
    return os.path.abspath(path) == parent or os.path.abspath(path).startswith(parent + "/")


def _root_binds() -> list[str]:
    args: list[str] = []
    for entry in sorted(os.listdir("/")):
        if entry in _SKIPPED_ROOT_ENTRIES:
            continue
        path = f"/{entry}"
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
    # /sys read-only: programs read CPU counts and such there; the cgroup tree in it is read-only too.
    return args + ["--ro-bind", "/sys", "/sys"]


def _chown_tree(roots: Iterable[str], uid: int, gid: int) -> None:
    for root in roots:
        os.chown(root, uid, gid)
        for directory, subdirs, files in os.walk(root):
            for name in subdirs + files:
                os.chown(os.path.join(directory, name), uid, gid, follow_symlinks=False)


async def _forward(prepared: PreparedSandbox, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                   host: str, port: int) -> None:
    task = asyncio.current_task()
    assert task is not None
    prepared._connections.add(task)
    try:
        up_reader, up_writer = await asyncio.open_connection(host, port)
    except OSError:
        writer.close()
        prepared._connections.discard(task)
        return

    async def pump(source: asyncio.StreamReader, target: asyncio.StreamWriter) -> None:
        try:
            while chunk := await source.read(65536):
                target.write(chunk)
                await target.drain()
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            try:
                target.write_eof()
            except (OSError, RuntimeError):
                pass

    try:
        await asyncio.gather(pump(reader, up_writer), pump(up_reader, writer))
    finally:
        writer.close()
        up_writer.close()
        prepared._connections.discard(task)


# ---- cgroups ------------------------------------------------------------------------------------------------------
def _own_groups() -> tuple[dict[str, Path], Path | None]:
    """(v1 controller -> this process's group folder, the v2 group folder or None)."""
    own: dict[str, str] = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        for controller in controllers.split(",") if controllers else ["<v2>"]:
            own[controller] = path
    v1: dict[str, Path] = {}
    v2: Path | None = None
    for line in Path("/proc/self/mounts").read_text().splitlines():
        fields = line.split()
        if len(fields) < 4:
            continue
        mount_point, fs_type, options = fields[1], fields[2], set(fields[3].split(","))
        if fs_type == "cgroup":
            for controller in ("memory", "pids", "cpu"):
                if controller in options and controller in own:
                    v1[controller] = Path(mount_point) / own[controller].lstrip("/")
        elif fs_type == "cgroup2" and "<v2>" in own:
            v2 = Path(mount_point) / own["<v2>"].lstrip("/")
    return v1, v2


def _write(path: Path, text: str) -> None:
    try:
        path.write_text(text)
    except OSError as error:
        raise SandboxUnavailable(f"cannot write {path}: {error.strerror or error}; the bubblewrap sandbox's limits "
                                 "need write access to the cgroup controllers (root, or a delegated cgroup)") from error


def _make_cgroups(memory_mb: int, max_processes: int, cpus: float) -> dict[str, Path]:
    name = f"gyre-sandbox-{os.getpid()}-{next(_NUMBERS)}"
    v1, v2 = _own_groups()
    made: dict[str, Path] = {}
    try:
        if all(c in v1 for c in ("memory", "pids", "cpu")):
            for controller in ("memory", "pids", "cpu"):
                group = v1[controller] / name
                group.mkdir()
                made[controller] = group
            memory = str(memory_mb * 1024 * 1024)
            _write(made["memory"] / "memory.limit_in_bytes", memory)
            if (made["memory"] / "memory.memsw.limit_in_bytes").exists():  # swap counts too, where accounted
                _write(made["memory"] / "memory.memsw.limit_in_bytes", memory)
            _write(made["pids"] / "pids.max", str(max_processes))
            _write(made["cpu"] / "cpu.cfs_period_us", "100000")
            _write(made["cpu"] / "cpu.cfs_quota_us", str(max(1000, round(cpus * 100000))))
        elif v2 is not None:
            enabled = (v2 / "cgroup.subtree_control").read_text().split()
            missing = [c for c in ("memory", "pids", "cpu") if c not in enabled]
            if missing:
                _write(v2 / "cgroup.subtree_control", " ".join(f"+{c}" for c in missing))
            group = v2 / name
            group.mkdir()
            made = {"memory": group, "pids": group, "cpu": group}
            _write(group / "memory.max", str(memory_mb * 1024 * 1024))
            if (group / "memory.swap.max").exists():
                _write(group / "memory.swap.max", "0")
            _write(group / "pids.max", str(max_processes))
            _write(group / "cpu.max", f"{max(1000, round(cpus * 100000))} 100000")
        else:
            raise SandboxUnavailable("the bubblewrap sandbox's limits need the cgroup memory, pids and cpu "
                                     "controllers; this process has none writable")
    except OSError as error:
        _kill_and_remove(made)
        if isinstance(error, SandboxUnavailable):
            raise
        raise SandboxUnavailable(f"cannot make the sandbox's cgroups: {error}") from error
    except BaseException:
        _kill_and_remove(made)
        raise
    return made


def _kill_and_remove(groups: dict[str, Path]) -> None:
    pids_group = groups.get("pids")
    if pids_group is not None and pids_group.is_dir():
        for _ in range(KILL_SWEEPS):
            try:
                members = [int(p) for p in (pids_group / "cgroup.procs").read_text().split()]
            except OSError:
                break
            if not members:
                break
            for pid in members:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            # The killed processes leave the group once reaped; a short wait between sweeps lets that happen.
            _wait_briefly()
    for group in dict.fromkeys(groups.values()):
        for _ in range(KILL_SWEEPS):
            try:
                group.rmdir()
                break
            except FileNotFoundError:
                break
            except OSError:
                _wait_briefly()  # members still exiting
        else:
            log.warning("sandbox_cgroup_not_removed", group=str(group))


def _wait_briefly() -> None:
    # Runs in a worker thread (never the actor's loop), so blocking here is fine; it is not the actor's clock.
    import time
    time.sleep(0.05)
