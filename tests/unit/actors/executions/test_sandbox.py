"""The bubblewrap sandbox's properties, each tried by a command that attempts to break it: writes outside the
workspace, reads another workspace, reaches the network, forks without bound, eats memory, outlives its time
limit, finds another sandbox's key; and what it must allow (its workspace, /tmp, the proxy). The `none` backend
refuses what it cannot honour."""

from __future__ import annotations

import ast
import asyncio
import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path

import pytest

from gyre.actors.executions.sandbox import (
    SandboxConfig,
    SandboxRefused,
    SandboxRequest,
    open_sandbox,
    proxy_url_inside,
    sandbox_problem,
)

needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None or os.geteuid() != 0,
                                 reason="the bubblewrap sandbox needs bwrap (.ci/setup installs it) and root")
BWRAP = SandboxConfig(kind="bubblewrap")
ENV = {"PATH": "/usr/bin:/bin"}


async def run_in(request: SandboxRequest, config: SandboxConfig = BWRAP, timeout_s: float = 60.0) -> tuple[int, str]:
    prepared = await open_sandbox(config, request)
    try:
        process = await asyncio.create_subprocess_exec(
            *prepared.argv, env=prepared.env, cwd=prepared.cwd, stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, start_new_session=True)
        out, _ = await asyncio.wait_for(process.communicate(), timeout_s)
        return process.returncode, out.decode()
    finally:
        await prepared.close()


def sh(script: str, workspace: Path, **fields) -> SandboxRequest:
    return SandboxRequest(("/bin/sh", "-c", script), fields.pop("env", ENV), str(workspace), fields.pop("workdir", "/app"),
                          **fields)


def py(code: str, workspace: Path, **fields) -> SandboxRequest:
    return SandboxRequest(("/usr/bin/python3", "-c", code), fields.pop("env", ENV), str(workspace),
                          fields.pop("workdir", "/app"), **fields)


@needs_bwrap
def test_only_the_workspace_is_writable(tmp_path: Path) -> None:
    workspace = tmp_path / "ws"
    workspace.mkdir()
    (workspace / "given.txt").write_text("task file")
    script = (
        "cat /app/given.txt; echo; echo made > /app/made.txt && echo workspace_ok; "
        "for p in /etc/x /usr/x /root/x /work/x /x; do (echo no > $p) 2>/dev/null && echo WROTE $p; done; "
        "echo scratch > /tmp/scratch && echo tmp_ok"
    )
    code, out = asyncio.run(run_in(sh(script, workspace)))
    assert code == 0, out
    assert "task file" in out and "workspace_ok" in out and "tmp_ok" in out
    assert "WROTE" not in out
    assert (workspace / "made.txt").read_text() == "made\n"
    assert not Path("/tmp/scratch").exists() or Path("/tmp/scratch").read_text() != "scratch\n"


@needs_bwrap
def test_another_workspace_is_not_readable(tmp_path: Path) -> None:
    # Outside /tmp (private in every sandbox anyway), so that only `hide` keeps the other workspace out of sight.
    scratch = Path(tempfile.mkdtemp(dir="/var/tmp", prefix="gyre-test-"))
    try:
        _check_other_workspace_hidden(scratch / "executions")
    finally:
        shutil.rmtree(scratch)


def _check_other_workspace_hidden(root: Path) -> None:
    mine, theirs = root / "g" / "0000" / "workspace", root / "g" / "0001" / "workspace"
    for directory in (mine, theirs):
        directory.mkdir(parents=True)
    (theirs / "answer.txt").write_text("the other execution's work")
    script = (f"cat {theirs}/answer.txt 2>/dev/null; ls {root}/g 2>/dev/null; "
              "find / -xdev -name answer.txt 2>/dev/null; find /var/tmp -name answer.txt 2>/dev/null; echo end")
    code, out = asyncio.run(run_in(sh(script, mine, hide=(str(root),))))
    assert "the other execution's work" not in out and "answer.txt" not in out and "0001" not in out, out
    assert out.strip().endswith("end")


@needs_bwrap
def test_no_network_but_the_proxy(tmp_path: Path) -> None:
    async def main() -> tuple[int, str]:
        async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.0 200 OK\r\nContent-Length: 8\r\n\r\nproxy-ok")
            await writer.drain()
            writer.close()

        proxy = await asyncio.start_server(answer, "127.0.0.1", 0)
        other = await asyncio.start_server(answer, "127.0.0.1", 0)  # a host service the sandbox must not reach
        proxy_port, other_port = (s.sockets[0].getsockname()[1] for s in (proxy, other))
        code = (
            "import socket, urllib.request\n"
            f"print(urllib.request.urlopen('http://127.0.0.1:{proxy_port}/v1/models', timeout=10).read().decode())\n"
            f"for host, port in (('127.0.0.1', {other_port}), ('1.1.1.1', 80), ('8.8.8.8', 53)):\n"
            "    s = socket.socket(); s.settimeout(3)\n"
            "    try:\n"
            "        s.connect((host, port)); print('REACHED', host, port)\n"
            "    except OSError as e:\n"
            "        print('blocked', host, port)\n"
        )
        try:
            return await run_in(py(code, workspace, proxy_url=f"http://localhost:{proxy_port}/v1"))
        finally:
            proxy.close()
            other.close()

    workspace = tmp_path / "ws"
    workspace.mkdir()
    code, out = asyncio.run(main())
    assert code == 0, out
    assert "proxy-ok" in out
    assert "REACHED" not in out and out.count("blocked") == 3, out
    assert proxy_url_inside("http://10.1.2.3:8123/v1") == "http://127.0.0.1:8123/v1"


@needs_bwrap
def test_identity_and_environment(tmp_path: Path) -> None:
    os.environ["GYRE_TEST_HOST_SECRET"] = "host-only"
    try:
        ids = asyncio.run(run_in(SandboxRequest(("/usr/bin/id", "-u", "-n"), ENV, str(tmp_path), "/app")))
        code, out = asyncio.run(run_in(SandboxRequest(("/usr/bin/env",), {"PATH": "/usr/bin:/bin", "TASK_VAR": "1"},
                                                      str(tmp_path), "/app")))
    finally:
        del os.environ["GYRE_TEST_HOST_SECRET"]
    assert ids == (0, "nobody\n")
    assert code == 0, out
    assert sorted(line.split("=")[0] for line in out.splitlines()) == ["PATH", "TASK_VAR"]


@needs_bwrap
def test_roots_home_is_hidden_but_the_interpreter_runs(tmp_path: Path) -> None:
    code, out = asyncio.run(run_in(SandboxRequest(
        (sys.executable, "-c", "import os; print(sorted(os.listdir('/root')))"), ENV, str(tmp_path), "/app")))
    assert code == 0, out
    visible = ast.literal_eval(out)
    host_only = set(os.listdir("/root")) - {Path(os.path.realpath(sys.base_prefix)).relative_to("/root").parts[0]} \
        if os.path.realpath(sys.base_prefix).startswith("/root/") else set(os.listdir("/root"))
    assert not host_only & set(visible), visible


@needs_bwrap
def test_fork_bomb_is_bounded(tmp_path: Path) -> None:
    code = (
        "import os, time\n"
        "children = 0\n"
        "try:\n"
        "    for _ in range(10000):\n"
        "        if os.fork() == 0:\n"
        "            time.sleep(60); os._exit(0)\n"
        "        children += 1\n"
        "    print('UNBOUNDED', children)\n"
        "except OSError:\n"
        "    print('blocked after', children)\n"
    )
    status, out = asyncio.run(run_in(py(code, tmp_path, max_processes=40)))
    assert "UNBOUNDED" not in out
    count = int(out.split("blocked after")[1].split()[0])
    assert count < 40, out  # the limit counts every process of the sandbox: bwrap, its init, python


@needs_bwrap
def test_memory_hog_is_killed(tmp_path: Path) -> None:
    code = "blocks = [bytearray(16 * 1024 * 1024) for _ in range(32)]\nprint('ALLOCATED', len(blocks))"
    status, out = asyncio.run(run_in(py(code, tmp_path, memory_mb=64)))
    assert "ALLOCATED" not in out
    assert status != 0


@needs_bwrap
def test_limits_are_the_requested_ones(tmp_path: Path) -> None:
    async def main() -> dict[str, str]:
        prepared = await open_sandbox(BWRAP, sh("true", tmp_path, memory_mb=96, max_processes=17, cpus=0.5))
        try:
            groups = prepared.cgroups
            if (groups["memory"] / "memory.limit_in_bytes").exists():  # cgroup v1
                return {"memory": (groups["memory"] / "memory.limit_in_bytes").read_text().strip(),
                        "pids": (groups["pids"] / "pids.max").read_text().strip(),
                        "cpu": (groups["cpu"] / "cpu.cfs_quota_us").read_text().strip()}
            return {"memory": (groups["memory"] / "memory.max").read_text().strip(),
                    "pids": (groups["pids"] / "pids.max").read_text().strip(),
                    "cpu": (groups["cpu"] / "cpu.max").read_text().split()[0]}
        finally:
            await prepared.close()
            assert not any(group.exists() for group in groups.values())

    assert asyncio.run(main()) == {"memory": str(96 * 1024 * 1024), "pids": "17", "cpu": "50000"}


def _processes_with(marker: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
                if argv[0].endswith(b"sleep") and marker.encode() in argv:
                    found.append(int(entry))
            except OSError:
                pass
    return found


@needs_bwrap
def test_killing_at_the_time_limit_kills_the_whole_sandbox(tmp_path: Path) -> None:
    marker = "4321.5"  # a sleep length no other process uses

    async def main() -> list[int]:
        # A detached grandchild in its own session would survive a plain process-group kill.
        script = f"setsid sleep {marker} & sleep {marker} & echo started; wait"
        prepared = await open_sandbox(BWRAP, sh(script, tmp_path))
        process = await asyncio.create_subprocess_exec(
            *prepared.argv, env=prepared.env, cwd=prepared.cwd, stdout=asyncio.subprocess.PIPE,
            start_new_session=True)
        assert process.stdout is not None
        assert await asyncio.wait_for(process.stdout.readline(), 30) == b"started\n"
        for _ in range(200):  # "started" may come before the second sleep has exec'd
            if len(_processes_with(marker)) == 2:
                break
            await asyncio.sleep(0.05)
        assert len(_processes_with(marker)) == 2
        os.killpg(process.pid, signal.SIGKILL)  # what the executor does at the time limit
        await process.wait()
        await prepared.close()
        return _processes_with(marker)

    assert asyncio.run(main()) == []


@needs_bwrap
def test_another_sandboxs_key_is_out_of_reach(tmp_path: Path) -> None:
    root = tmp_path / "executions"
    a, b = root / "a" / "workspace", root / "b" / "workspace"
    a.mkdir(parents=True)
    b.mkdir(parents=True)
    key = "gyre-key-of-b-0123456789"

    async def main() -> str:
        holder = await open_sandbox(BWRAP, sh("echo up; sleep 30", b, env={**ENV, "OPENAI_API_KEY": key},
                                              hide=(str(root),)))
        process = await asyncio.create_subprocess_exec(*holder.argv, env=holder.env, cwd=holder.cwd,
                                                       stdout=asyncio.subprocess.PIPE, start_new_session=True)
        try:
            assert process.stdout is not None
            assert await asyncio.wait_for(process.stdout.readline(), 30) == b"up\n"
            search = (f"cat /proc/*/environ 2>/dev/null | tr '\\0' '\\n' | grep -c {key}; "
                      f"grep -rl {key} /tmp /run /app {root} 2>/dev/null; ls /proc | grep -c '^[0-9]'; echo done")
            _, out = await run_in(sh(search, a, hide=(str(root),)))
            return out
        finally:
            os.killpg(process.pid, signal.SIGKILL)
            await process.wait()
            await holder.close()

    out = asyncio.run(main())
    assert key not in out
    lines = out.strip().splitlines()
    assert lines[0] == "0" and lines[-1] == "done", out
    assert int(lines[-2]) <= 8, out  # only the searcher's own few processes are visible


def test_the_none_backend_refuses_what_it_cannot_do(tmp_path: Path) -> None:
    none = SandboxConfig()
    with pytest.raises(SandboxRefused, match="/app"):
        asyncio.run(open_sandbox(none, sh("true", tmp_path)))
    with pytest.raises(SandboxRefused, match="/tests"):
        asyncio.run(open_sandbox(none, sh("true", tmp_path, workdir="", read_only_mounts=((str(tmp_path), "/tests"),))))
    prepared = asyncio.run(open_sandbox(none, sh("true", tmp_path, workdir="")))
    assert prepared.argv == ("/bin/sh", "-c", "true") and prepared.cwd == str(tmp_path)
    assert sandbox_problem(none, "/app", False) is not None
    assert sandbox_problem(none, "", False) is None
    assert sandbox_problem(BWRAP, "/app", True) is None
    with pytest.raises(ValueError):
        SandboxConfig(kind="docker")
